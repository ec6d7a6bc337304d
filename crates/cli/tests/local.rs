//! `onoff local` end to end: its own moto server (IAM enforced: every component under the role
//! template.yaml gives it), the control plane in process, real `onoff-agent` processes running the example
//! workload, a slice of the real Philly trace, spot notices, worker kills and lost answers of
//! applied DynamoDB writes injected, malformed EC2 events that must reach the failed-events
//! queue through Lambda's retries, every third job sent through the submission queue (Lambda's
//! SQS event source) and a poison message that must end in its dead-letter queue, and every 5th
//! asynchronous event delivered twice; and, while
//! it runs, bad job specs put into its bucket by a real AWS client (boto3, from the `.venv` the
//! test script installs).
#![cfg(feature = "local")]

use std::process::{Command, Stdio};

/// Puts five bad specs under `jobs/` of the run's bucket as the run's submitter (its stack.json
/// names the emulator, the bucket and the submitter's session); prints their keys. Then tries what
/// a submitter may not do, and prints each refusal.
const BAD_INPUTS: &str = r#"
import sys, time, json, os, boto3
path = sys.argv[1]
for _ in range(600):
    if os.path.exists(path):
        break
    time.sleep(0.2)
else:
    sys.exit("%s never appeared" % path)
time.sleep(0.2)
stack = json.load(open(path))
endpoint, bucket, creds = stack["endpoint"], stack["bucket"], stack["submitter"]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)
ok = {"image": "img", "command": ["python", "x.py"], "project": "p"}
bad = {
    "jobs/bad-oversize.json": json.dumps(dict(ok, note="x" * (300 * 1024))).encode(),
    "jobs/bad-not-utf8.json": b'\xff\xfe{"image": "img"}',
    "jobs/bad-gpus.json": json.dumps(dict(ok, gpus=64)).encode(),
    "jobs/bad-memory.json": json.dumps(dict(ok, min_gpu_memory_gib=500)).encode(),
    "jobs/bad-lane.json": json.dumps(dict(ok, lane="gold")).encode(),
}
for key, body in bad.items():
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    print(key)
for what, call in [
    ("read a checkpoint", lambda: s3.list_objects_v2(Bucket=bucket, Prefix="checkpoints/")),
    ("write outside jobs/", lambda: s3.put_object(Bucket=bucket, Key="checkpoints/x/y", Body=b"x")),
]:
    try:
        call()
        print("ALLOWED", what)
    except Exception as e:
        print("refused", what, type(e).__name__)
"#;

/// One local stack at a time: each starts its own moto server and agents, and two on the
/// machine's cores at once would slow both towards their timeouts.
static ONE_STACK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn local_run_with_faults_finishes_every_job_exactly_once() {
    let _one = ONE_STACK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let moto = std::env::var("ONOFF_MOTO_SERVER")
        .expect("ONOFF_MOTO_SERVER is not set: run the tests with scripts/test.sh, which installs moto server");
    let python = std::path::Path::new(&moto).with_file_name("python");
    let run_dir = std::env::temp_dir().join(format!("onoff-local-test-{}", std::process::id()));
    let child = Command::new(env!("CARGO_BIN_EXE_onoff"))
        .args(["local", "--moto-server", &moto])
        .args([
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
            // Every 10th DynamoDB write applied answers HTTP 500 (the SDK retries it).
            "--lose-answers",
            "10",
            "--notice-lead-s",
            "6",
            // Each fails in the interruption function, is retried twice (3 s, then 6 s later)
            // and is dead-lettered.
            "--malformed-events",
            "2",
            "--retry-delays-s",
            "3,6",
            "--via-queue-every",
            "3",
            // Every 5th asynchronous event delivered twice, as Lambda's queue may.
            "--deliver-twice-every",
            "5",
            "--poison-messages",
            "1",
            "--seed",
            "3",
            "--timeout-s",
            "400",
            "--drain-s",
            "60",
            "--run-dir",
        ])
        .arg(&run_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("onoff runs");
    let stack = run_dir.join("stack.json");
    let put = Command::new(&python)
        .args(["-c", BAD_INPUTS])
        .arg(&stack)
        .output()
        .expect("python from .venv runs");
    assert!(
        put.status.success(),
        "putting the bad inputs failed: {}",
        String::from_utf8_lossy(&put.stderr)
    );
    let said = String::from_utf8_lossy(&put.stdout);
    assert!(!said.contains("ALLOWED"), "the submitter did what it may not: {said}");
    assert_eq!(said.matches("refused").count(), 2, "{said}");
    let out = child.wait_with_output().expect("onoff ends");
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
    // Whatever answers of applied writes were lost on the way.
    assert!(n("answers_lost") >= 10.0, "answers lost: {v}");
    // IAM enforced with the template's policies, and nothing the components did was refused.
    assert_eq!(v["iam_enforced"], true, "{v}");
    assert_eq!(n("access_denied"), 0.0, "refused calls: {}", v["denied_calls"]);
    assert!(n("calls_recorded") > 100.0, "every component's calls are recorded: {v}");
    // The same calls against template.yaml's full policies (conditions, session and resource
    // policies, which moto does not evaluate): all allowed.
    let check = &v["policy_check"];
    assert!(
        check["requests"].as_f64().unwrap_or(0.0) > 100.0,
        "calls evaluated: {check}"
    );
    assert_eq!(check["denied"], 0, "denied by the template's policies: {check}");
    assert_eq!(
        check["not_covered"],
        serde_json::json!([]),
        "every operation evaluated: {check}"
    );
    // As root (CI), jobs run as a user of their own, as on a worker.
    if nix_is_root() {
        assert_eq!(v["job_user"], 10002, "{v}");
        // And the agents with only the worker container's capabilities, where setpriv is.
        if std::path::Path::new("/usr/bin/setpriv").exists() {
            assert_eq!(v["agent_capabilities"].as_array().map(Vec::len), Some(6), "{v}");
        }
    }
    // The replayed jobs keep a model in their project's cache, and jobs of the same project that
    // follow one another on a worker find it there (17 of the 24 are of one project): a start
    // that never found it would mean the cache never served, e.g. the job user could not write
    // it, or the agent cleared it between jobs.
    assert!(
        n("attempts_with_warm_cache") >= 1.0 && n("attempts_with_warm_cache") < n("attempts"),
        "{v}"
    );
    // Submit asks the scaler instead of launching; the launch follows within a second, and the
    // SDK's retry backoff when a lost answer is retried on the way (standard mode: a jittered
    // wait below 1 s before the first retry, below 2 s before the second).
    assert!(n("scale_requests_served") >= 1.0, "{v}");
    // Every invoke was an ask counted in the control table (the others joined a pending one).
    assert!(n("scale_asks") >= n("scale_requests_served"), "{v}");
    assert!(n("scale_request_latency_max_s") < 4.0, "{v}");
    // The active index lags its table by a second here, as a global secondary index may on AWS:
    // the run a submission's scale request invokes does not find the new job listed, and reads
    // it by id instead (and every job still ran once).
    assert_eq!(v["index_lag_s"], 1.0, "{v}");
    assert!(n("jobs_read_past_index") >= 1.0, "{v}");
    assert!(n("spot_notices_sent") >= 1.0, "the run injected a spot notice: {v}");
    // The interruption function counted the notices it drained a worker for (the dashboard's
    // graph), each once though every 5th event is delivered twice: at most one per notice sent,
    // and the malformed events not at all.
    let metrics = std::fs::read_to_string(run_dir.join("control-plane-metrics.log")).expect("the functions' metrics");
    let counted: f64 = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["Notice"] == "interruption-warning")
        .map(|m| m["SpotNotices"].as_f64().expect("a count"))
        .sum();
    assert!(
        counted >= 1.0 && counted <= n("spot_notices_sent"),
        "{counted} notices counted of {}",
        n("spot_notices_sent")
    );
    // The functions' log lines, as their log groups would hold them: each line a handler logged
    // names its function and request; the scaler's and the reconciler's decisions give action,
    // what it acts on (a launch: its lane, count and offering) and reason; the interruption function says which worker it drained, once per notice it counted; the malformed events'
    // failures are there.
    let log = std::fs::read_to_string(run_dir.join("control-plane.log")).expect("the functions' log");
    let launches: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" decision ") && l.contains("action=\"launch\""))
        .collect();
    assert!(!launches.is_empty(), "no launch decision logged:\n{log}");
    for l in &launches {
        assert!(
            (l.contains("invoke{function=scaler ") || l.contains("invoke{function=reconciler "))
                && l.contains("request_id=")
                && l.contains("on=lane standard: ")
                && l.contains("reason="),
            "{l}"
        );
    }
    let drained: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("drained after a spot interruption warning"))
        .collect();
    assert!(
        drained.len() == counted as usize && drained.iter().all(|l| l.contains("invoke{function=interruption ")),
        "{counted} notices counted, drained lines: {drained:?}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("handler error") && l.contains("lacks detail.instance-id")),
        "the malformed events' failures are not logged:\n{log}"
    );
    assert!(n("workers_killed") >= 1.0, "the run killed a worker: {v}");
    assert!(
        n("resumed_from_checkpoint") >= 1.0,
        "a job resumed from a checkpoint: {v}"
    );
    assert!(n("instances_launched") >= 1.0);
    // Only in zones the stack has a subnet in (three of six): the functions offer no other.
    let zones = v["zones_launched_in"].as_array().expect("zones in the report");
    assert!(
        !zones.is_empty()
            && zones
                .iter()
                .all(|z| onoff_local::LOCAL_ZONES.contains(&z.as_str().unwrap_or_default())),
        "launched outside the stack's subnets' zones {:?}: {v}",
        onoff_local::LOCAL_ZONES
    );
    assert_eq!(n("instances_left_running"), 0.0, "every worker terminated itself");
    // The malformed events: each failed, was retried as Lambda retries an asynchronous
    // invocation (the interruption function's MaximumRetryAttempts is 2), and was sent to the
    // failed-events queue under the function's role, where the run read it back; no other event
    // was given up on. One delivered twice is failed, retried and dead-lettered twice, as on AWS.
    let dead = v["dead_letters"].as_array().expect("dead_letters in the report");
    let events: std::collections::BTreeSet<&str> = dead.iter().filter_map(|d| d["event"]["id"].as_str()).collect();
    assert_eq!(events, ["local-malformed-0", "local-malformed-1"].into(), "{dead:?}");
    for d in dead {
        assert_eq!(
            (d["function"].as_str(), d["invocations"].as_u64()),
            (Some("interruption"), Some(3)),
            "{d}"
        );
        assert!(
            d["error_message"]
                .as_str()
                .unwrap_or_default()
                .contains("lacks detail.instance-id"),
            "{d}"
        );
    }
    assert_eq!(n("failed_events_read_back"), dead.len() as f64, "{v}");
    assert_eq!(v["dead_letter_errors"], serde_json::json!([]));
    assert_eq!(n("retries_pending"), 0.0);
    assert_eq!(n("events_undelivered"), 0.0, "{v}");
    // Events delivered twice changed nothing above: no job twice, none lost.
    assert!(n("events_delivered_twice") >= 5.0, "{v}");
    // Every third job went through the submission queue, and was deleted there once submit took
    // it (the submit role's sqs:DeleteMessage covers the event source's DeleteMessageBatch); the
    // poison message was refused with an error record on each receive and SQS moved it to the
    // dead-letter queue, the only message there.
    assert_eq!(n("jobs_via_queue"), 4.0, "{v}");
    assert!(n("submission_records_deleted") >= 4.0, "{v}");
    let poison = v["poison_messages_sent"].as_array().expect("poison_messages_sent");
    assert_eq!(poison.len(), 1);
    assert_eq!(
        &v["submission_dead_letters"],
        &serde_json::json!(poison),
        "alone there: {v}"
    );
    let source = format!("sqs:{}", poison[0].as_str().unwrap());
    let record = v["rejected"]
        .as_array()
        .and_then(|r| r.iter().find(|x| x["source"] == source.as_str()))
        .unwrap_or_else(|| panic!("no error record for the poison message {source}: {v}"));
    assert!(
        record["reason"].as_str().unwrap_or_default().contains("not valid JSON"),
        "{record}"
    );
    assert!(n("total_usd") > 0.0 && n("usd_per_job") > 0.0);
    assert!(n("wait_p95_s") >= n("wait_p50_s"));
    assert!(out.status.success(), "exit status {:?}; stderr:\n{stderr}", out.status);
    // Every bad input got an error record with a readable reason within a minute of its put.
    let rejected = v["rejected"].as_array().expect("rejected in the report");
    for (key, says) in [
        ("jobs/bad-oversize.json", "256 KiB"),
        ("jobs/bad-not-utf8.json", "UTF-8"),
        ("jobs/bad-gpus.json", "gpus"),
        ("jobs/bad-memory.json", "min_gpu_memory_gib"),
        ("jobs/bad-lane.json", "lane"),
    ] {
        let r = rejected
            .iter()
            .find(|r| r["source"].as_str().is_some_and(|s| s.contains(key)))
            .unwrap_or_else(|| panic!("no error record for {key}: {rejected:?}"));
        let reason = r["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(says), "{key}: {reason:?} does not say {says:?}");
        let after = r["after_s"].as_f64().unwrap_or(f64::INFINITY);
        assert!(after < 60.0, "{key}: error record {after} s after the put");
    }
    assert_eq!(n("jobs_submitted"), 12.0, "the bad inputs became no job");
    assert_eq!(n("jobs_rejected"), 0.0, "every replayed job was admitted");
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

fn nix_is_root() -> bool {
    // The owner of /proc/self is this process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// The local stack with spot workers on CreateFleet (`scale_down.stop_idle = "on-demand"`: an
/// instant fleet's one-time spot requests, which EC2 leaves untagged), spot notices and killed
/// workers: every call of the control plane and the agents is allowed by template.yaml's
/// policies. Before, each agent ending itself on such a worker asked to cancel its untagged
/// one-time request, which the worker role may cancel only with the stack's tag: an
/// AccessDenied on AWS for every spot worker (8 in a 24-job run).
#[test]
fn a_local_run_with_spot_on_create_fleet_is_denied_nothing() {
    let _one = ONE_STACK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let moto = std::env::var("ONOFF_MOTO_SERVER")
        .expect("ONOFF_MOTO_SERVER is not set: run the tests with scripts/test.sh, which installs moto server");
    let run_dir = std::env::temp_dir().join(format!("onoff-local-fleet-spot-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir).expect("run dir");
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/local-policy.toml");
    let policy = std::fs::read_to_string(&examples).expect("examples/local-policy.toml");
    assert!(policy.contains("[scale_down]\n"), "{policy}");
    let policy = policy.replacen("[scale_down]\n", "[scale_down]\nstop_idle = \"on-demand\"\n", 1);
    let policy_file = run_dir.join("policy.toml");
    std::fs::write(&policy_file, policy).expect("policy written");
    let args = [
        "--jobs",
        "8",
        "--max-job-s",
        "12",
        "--spot-notices",
        "2",
        "--kill-workers",
        "1",
        "--seed",
        "5",
        "--policy",
        policy_file.to_str().expect("utf-8 path"),
    ];
    let (v, out) = run_local(&moto, &args, &run_dir.join("run"));
    let n = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"));
    assert_eq!(n("jobs_succeeded"), 8.0, "every job succeeds: {v}");
    assert_eq!((n("jobs_lost"), n("duplicate_completions")), (0.0, 0.0), "{v}");
    assert!(n("spot_notices_sent") >= 1.0, "a spot worker ended at a notice: {v}");
    assert_eq!(n("instances_stopped"), 0.0, "spot workers are not stopped: {v}");
    assert_clean_end(&v, &out);
    let _ = std::fs::remove_dir_all(&run_dir);
}

/// Two priority lanes end to end (examples/local-lanes.toml): the replayed jobs spread over an
/// on-demand `express` lane and a spot-first `standard` one under a fleet cap of 4, each lane
/// with its own queue and workers. Every job ends once, in its lane, run only by workers of its
/// lane, with nothing denied.
#[test]
fn a_local_run_with_two_lanes_runs_each_job_on_its_own_lanes_workers() {
    let _one = ONE_STACK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let moto = std::env::var("ONOFF_MOTO_SERVER")
        .expect("ONOFF_MOTO_SERVER is not set: run the tests with scripts/test.sh, which installs moto server");
    let run_dir = std::env::temp_dir().join(format!("onoff-local-lanes-{}", std::process::id()));
    let policy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/local-lanes.toml");
    let policy = policy.to_str().expect("utf-8 path");
    let args = [
        "--jobs",
        "10",
        "--max-job-s",
        "10",
        "--spot-notices",
        "2",
        "--kill-workers",
        "0",
        "--seed",
        "7",
        "--policy",
        policy,
    ];
    let (v, out) = run_local(&moto, &args, &run_dir);
    eprintln!("{v:#}");
    let n = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"));
    assert_eq!(n("jobs_succeeded"), 10.0, "every job succeeds: {v}");
    assert_eq!((n("jobs_lost"), n("duplicate_completions")), (0.0, 0.0), "{v}");
    for lane in ["express", "standard"] {
        let f = &v["lanes"][lane];
        assert_eq!(
            (f["jobs"].as_u64(), f["succeeded"].as_u64()),
            (Some(5), Some(5)),
            "{lane}: {v}"
        );
        assert!(
            f["instances"].as_u64().unwrap_or(0) >= 1,
            "no worker launched for {lane}: {v}"
        );
    }
    assert!(n("attempts") >= 10.0, "{v}");
    assert_eq!(n("attempts_off_lane"), 0.0, "a job ran on another lane's worker: {v}");
    assert_clean_end(&v, &out);
    let _ = std::fs::remove_dir_all(&run_dir);
}

/// A lane's `quota_wait_limit_s` end to end: with an on-demand G quota of 96 vCPUs, the 8-GPU
/// job of the on-demand `express` lane (examples/local-lanes.toml) fits no instance of its lane
/// (g5.48xlarge has 192 vCPUs); with a limit of 30 s the reconciler's reaper ends it FAILED with
/// the quota to raise, under the template's policies (nothing denied), and every other job
/// succeeds. Without the limit it waits until the run's timeout and counts as lost.
#[test]
fn a_job_a_full_quota_blocks_past_its_lanes_wait_limit_is_failed_and_the_rest_run() {
    let _one = ONE_STACK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let moto = std::env::var("ONOFF_MOTO_SERVER")
        .expect("ONOFF_MOTO_SERVER is not set: run the tests with scripts/test.sh, which installs moto server");
    let run_dir = std::env::temp_dir().join(format!("onoff-local-quota-wait-{}", std::process::id()));
    let lanes = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/local-lanes.toml");
    let lanes = std::fs::read_to_string(lanes).expect("examples/local-lanes.toml");
    let on_demand = "capacity = \"on-demand\"\n";
    assert_eq!(lanes.matches(on_demand).count(), 1, "one on-demand lane, express");
    let policy = std::env::temp_dir().join(format!("onoff-quota-wait-{}.toml", std::process::id()));
    std::fs::write(
        &policy,
        lanes.replace(on_demand, &format!("{on_demand}quota_wait_limit_s = 30.0\n")),
    )
    .unwrap();
    let args = [
        "--jobs",
        "12",
        "--vcpu-quota",
        "on-demand:g-vt=96",
        "--policy",
        policy.to_str().expect("utf-8 path"),
    ];
    let (v, out) = run_local(&moto, &args, &run_dir);
    eprintln!("{v:#}");
    let n = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"));
    assert_eq!(
        (n("jobs_succeeded"), n("jobs_failed"), n("jobs_lost")),
        (11.0, 1.0, 0.0),
        "{v}"
    );
    assert_eq!(v["lanes"]["express"]["succeeded"].as_u64(), Some(5), "{v}");
    assert!(n("launches_refused_for_quota") >= 1.0, "{v}");
    let log = std::fs::read_to_string(run_dir.join("control-plane.log")).expect("control-plane.log");
    let ended: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("job FAILED: past its lane's quota wait limit"))
        .collect();
    assert_eq!(ended.len(), 1, "{ended:#?}");
    assert!(
        ended[0].contains("quota_wait_limit_s of 30 s")
            && ended[0].contains("8 GPU(s) per instance")
            && ended[0].contains("--quota-code L-DB2E81BA"),
        "{}",
        ended[0]
    );
    assert_clean_end(&v, &out);
    let _ = std::fs::remove_dir_all(&run_dir);
    let _ = std::fs::remove_file(&policy);
}

/// `onoff local` on `moto` with `args` besides the ones every such run here takes (`--json`,
/// `--quiet`, a compression of 60, a 300 s timeout and a 60 s drain, `run_dir`): its JSON report
/// and its output.
fn run_local(moto: &str, args: &[&str], run_dir: &std::path::Path) -> (serde_json::Value, std::process::Output) {
    let out = Command::new(env!("CARGO_BIN_EXE_onoff"))
        .args(["local", "--moto-server", moto])
        .args([
            "--json",
            "--quiet",
            "--compress",
            "60",
            "--timeout-s",
            "300",
            "--drain-s",
            "60",
        ])
        .args(args)
        .arg("--run-dir")
        .arg(run_dir)
        .output()
        .expect("onoff runs");
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}); stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (v, out)
}

/// How every run must end: no call refused by IAM or denied by the template's policies, no
/// instance left running, exit status 0.
fn assert_clean_end(v: &serde_json::Value, out: &std::process::Output) {
    assert_eq!(v["access_denied"], 0, "refused calls: {}", v["denied_calls"]);
    let check = &v["policy_check"];
    assert_eq!(check["denied"], 0, "denied by the template's policies: {check}");
    assert_eq!(v["instances_left_running"], 0, "{v}");
    assert!(
        out.status.success(),
        "exit status {:?}; stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
