//! `onoff local` end to end: moto server (from `.venv`, which `scripts/test.sh` installs), the
//! control plane in process, real `onoff-agent` processes running the example workload, a slice of
//! the real Philly trace, spot notices and worker kills injected.
#![cfg(feature = "local")]

use std::process::Command;

#[test]
fn local_run_with_faults_finishes_every_job_exactly_once() {
    let run_dir = std::env::temp_dir().join(format!("onoff-local-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_onoff"))
        .args([
            "local",
            "--json",
            "--quiet",
            "--jobs",
            "12",
            "--compress",
            "60",
            "--max-job-s",
            "12",
            // Per busy worker per minute; faults are due deterministically (not drawn), so the
            // ~3 busy-worker-minutes of this run see several of each.
            "--spot-notices",
            "2",
            "--kill-workers",
            "1.5",
            "--notice-lead-s",
            "6",
            "--seed",
            "3",
            "--timeout-s",
            "400",
            "--drain-s",
            "60",
            "--run-dir",
        ])
        .arg(&run_dir)
        .output()
        .expect("onoff runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("no JSON report ({e}); stderr:\n{stderr}"));
    let n = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"));
    eprintln!("{v:#}");
    assert_eq!(n("jobs_submitted"), 12.0);
    assert_eq!(n("jobs_succeeded"), 12.0, "every job succeeds: {v}");
    assert_eq!(n("jobs_failed"), 0.0);
    assert_eq!(n("jobs_lost"), 0.0);
    assert_eq!(n("duplicate_completions"), 0.0, "no job completes twice");
    assert!(n("spot_notices_sent") >= 1.0, "the run injected a spot notice: {v}");
    assert!(n("workers_killed") >= 1.0, "the run killed a worker: {v}");
    assert!(
        n("resumed_from_checkpoint") >= 1.0,
        "a job resumed from a checkpoint: {v}"
    );
    assert!(n("instances_launched") >= 1.0);
    assert_eq!(n("instances_left_running"), 0.0, "every worker terminated itself");
    assert!(n("total_usd") > 0.0 && n("usd_per_job") > 0.0);
    assert!(n("wait_p95_s") >= n("wait_p50_s"));
    assert!(out.status.success(), "exit status {:?}; stderr:\n{stderr}", out.status);
    // Clean exit: no process of this run is left (agents and jobs carry the run dir in their
    // environment: ONOFF_WORK_DIR, ONOFF_CHECKPOINT_DIR).
    let needle = run_dir.canonicalize().expect("run dir exists");
    let needle = needle.to_str().expect("utf-8 path").as_bytes();
    let mut leftover = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env.windows(needle.len()).any(|w| w == needle) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            leftover.push(String::from_utf8_lossy(&cmd).replace('\0', " "));
        }
    }
    assert!(leftover.is_empty(), "processes left running: {leftover:?}");
    let _ = std::fs::remove_dir_all(&run_dir);
}
