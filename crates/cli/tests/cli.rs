//! The `onoff` binary end to end on the shipped short slice.

use std::process::Command;

fn onoff(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_onoff"))
        .args(args)
        .output()
        .expect("onoff runs")
}

const SHORT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/philly/philly-short.csv");

#[test]
fn simulate_json_has_every_policy_and_field() {
    let out = onoff(&["simulate", "--trace", SHORT, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let lb = v["lower_bound_usd"].as_f64().expect("lower_bound_usd");
    assert!(lb > 0.0);
    let policies = v["policies"].as_array().expect("policies");
    let names: Vec<&str> = policies.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["onoff", "always-on", "min-one-warm", "fixed-idle-10m", "keda-like"]
    );
    for p in policies {
        for k in [
            "total_usd",
            "usd_per_job",
            "idle_gpu_hours",
            "launches",
            "wait_p50_s",
            "wait_p95_s",
            "wait_p99_s",
            "jobs_completed",
            "jobs_lost",
            "interruptions",
            "lost_work_gpu_hours",
        ] {
            assert!(p[k].is_number(), "{} lacks {k}", p["name"]);
        }
        assert_eq!(
            p["jobs_completed"].as_u64().unwrap() + p["jobs_lost"].as_u64().unwrap(),
            200
        );
        assert_eq!(p["jobs_lost"].as_u64(), Some(0));
        assert!(p["total_usd"].as_f64().unwrap() >= lb * 0.999);
    }
}

#[test]
fn simulate_out_writes_json_timelines_and_a_plot() {
    let dir = std::env::temp_dir().join(format!("onoff-cli-test-{}", std::process::id()));
    let out = onoff(&[
        "simulate",
        "--trace",
        SHORT,
        "--quiet",
        "--policies",
        "onoff,keda-like",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("onoff") && table.contains("keda-like") && table.contains("lower bound"));
    let csv = std::fs::read_to_string(dir.join("timeline-onoff.csv")).unwrap();
    assert!(csv.starts_with("minute,backlog,running_jobs,pending,busy,idle,draining,usd_per_h"));
    assert!(csv.lines().count() > 10);
    let svg = std::fs::read_to_string(dir.join("timeline.svg")).unwrap();
    assert!(svg.contains("<svg"));
    assert!(dir.join("comparison.json").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_inputs_get_clear_errors() {
    let out = onoff(&["simulate", "--trace", "/nonexistent/trace.csv"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/trace.csv"));
    let out = onoff(&["simulate", "--trace", SHORT, "--policies", "onoff,nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy \"nope\""));
    let cfg = std::env::temp_dir().join(format!("onoff-bad-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[scale_down]\nrelease_fraction = 2.0\n").unwrap();
    let out = onoff(&["simulate", "--trace", SHORT, "--config", cfg.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("scale_down.release_fraction"));
    std::fs::remove_file(cfg).ok();
}

#[test]
fn the_example_config_parses() {
    let out = onoff(&[
        "simulate",
        "--trace",
        SHORT,
        "--quiet",
        "--policies",
        "onoff",
        "--config",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/policy.toml"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
