//! The operator verbs end to end on `onoff local --serve` (its own moto server, IAM enforced, one
//! worker at most): a job submitted from a YAML spec runs, `onoff logs` shows its own lines and
//! `onoff outputs` downloads the file it wrote; a long job is cancelled while it runs and one
//! while it waits (`onoff workers` shows the one worker running the first), and the second
//! submitted again from its row (`onoff submit --from`) runs; a job put by the AWS
//! CLI (`aws s3 cp` under `jobs/`) runs too; a spec sent to the submission queue that submit
//! refuses reaches its dead-letter queue, where `onoff dead-letters` shows it with its reason, and
//! a malformed EC2 event the interruption function failed on with the function's error;
//! `onoff cost` per project adds up to what the jobs
//! recorded; after Ctrl-C nothing is left running. The account has no G spot quota (played by the
//! emulator), so the workers are on-demand and `onoff workers` names the full quota. Every verb
//! runs under `OperatorAccess`, and none of its calls is denied.
#![cfg(feature = "local")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Stack {
    child: Child,
    run_dir: PathBuf,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

/// `onoff <verb> --local --run-dir <dir> <rest>` (the stack's flags before a `--` in `rest`).
fn onoff(stack: &Stack, args: &[&str]) -> Output {
    let (verb, rest) = args.split_first().expect("a verb");
    Command::new(env!("CARGO_BIN_EXE_onoff"))
        .arg(verb)
        .args(["--local", "--run-dir"])
        .arg(&stack.run_dir)
        .args(rest)
        .output()
        .expect("onoff runs")
}

#[track_caller]
fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json(stack: &Stack, args: &[&str]) -> serde_json::Value {
    let mut a = args.to_vec();
    a.insert(1, "--json");
    let text = ok(&onoff(stack, &a));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {text}"))
}

fn state(stack: &Stack, id: &str) -> String {
    json(stack, &["status", id])["state"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn submit(stack: &Stack, args: &[&str]) -> String {
    let mut a = vec!["submit"];
    a.extend_from_slice(args);
    let v = json(stack, &a);
    v["job_id"].as_str().expect("a job id").to_string()
}

#[test]
fn the_operator_verbs_on_a_served_local_stack() {
    let moto = std::env::var("ONOFF_MOTO_SERVER")
        .expect("ONOFF_MOTO_SERVER is not set: run the tests with scripts/test.sh, which installs moto server");
    let venv_bin = Path::new(&moto).parent().expect("moto in a venv").to_path_buf();
    let run_dir = std::env::temp_dir().join(format!("onoff-ops-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    let stderr_path = run_dir.join("serve.stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_onoff"))
        .args([
            "local",
            "--serve",
            "--quiet",
            "--json",
            "--moto-server",
            &moto,
            "--max-workers",
            "1",
            // An account with no G spot quota at all: every spot launch is refused as EC2
            // refuses it, and the control plane launches on-demand instead.
            "--vcpu-quota",
            "spot:g-vt=0",
            // One malformed EC2 event: the interruption function fails on it three times, and
            // Lambda's failed-events queue holds it for `onoff dead-letters`.
            "--malformed-events",
            "1",
            "--retry-delays-s",
            "1,2",
            "--run-dir",
        ])
        .arg(&run_dir)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("onoff local --serve starts");
    let stack = Stack {
        child,
        run_dir: run_dir.clone(),
    };
    let stack_file = run_dir.join("stack.json");
    wait_for("stack.json", Duration::from_secs(120), || stack_file.exists());
    // Serving: the verbs answer.
    wait_for("the stack answers", Duration::from_secs(60), || {
        onoff(&stack, &["jobs"]).status.success()
    });

    // A bad spec is refused before anything is put.
    let bad = onoff(&stack, &["submit", "--gpus", "64", "--", "python3", "-c", "pass"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("gpus"), "{bad:?}");

    // 1. From a YAML spec: prints a line, writes an output file.
    let spec = run_dir.join("hello.yaml");
    std::fs::write(
        &spec,
        "name: hello\nproject: alpha\ncommand:\n  - python3\n  - -c\n  - |\n    import os\n    print('hello from the job', flush=True)\n    open(os.path.join(os.environ['ONOFF_OUTPUT_DIR'], 'hello.txt'), 'w').write('hi there\\n')\n",
    )
    .unwrap();
    let hello = submit(&stack, &[spec.to_str().unwrap()]);
    wait_for("hello succeeds", Duration::from_secs(120), || {
        state(&stack, &hello) == "SUCCEEDED"
    });
    let logs = ok(&onoff(&stack, &["logs", &hello]));
    assert!(logs.contains("hello from the job"), "the job's own lines: {logs}");
    // The row says what became of the outputs once the upload after the settle is over.
    let mut outputs = serde_json::Value::Null;
    wait_for("the outputs' record", Duration::from_secs(60), || {
        outputs = json(&stack, &["status", &hello])["outputs"].clone();
        !outputs.is_null()
    });
    assert_eq!(
        (outputs["attempt"].as_u64(), outputs["files"].as_u64()),
        (Some(1), Some(1)),
        "{outputs}"
    );
    assert!(outputs.get("error").is_none(), "{outputs}");
    assert!(ok(&onoff(&stack, &["status", &hello])).contains("1 file(s) of attempt 1"));
    let out_dir = run_dir.join("downloaded");
    ok(&onoff(&stack, &["outputs", &hello, out_dir.to_str().unwrap()]));
    assert_eq!(
        std::fs::read_to_string(out_dir.join("hello.txt")).unwrap(),
        "hi there\n"
    );

    // 2. A long job, cancelled while it runs (it holds the only worker).
    let long = submit(
        &stack,
        &[
            "--name",
            "long",
            "--project",
            "beta",
            "--",
            "python3",
            "-c",
            "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(1)",
        ],
    );
    wait_for("long runs", Duration::from_secs(120), || {
        state(&stack, &long) == "RUNNING"
    });
    // `onoff workers`: the one worker, running that job, backed by a running instance, with
    // EC2 read (an EC2 failure would be told in `ec2_error`) under `OperatorAccess` only.
    let w = json(&stack, &["workers"]);
    let live = w["workers"].as_array().expect("a list of workers");
    assert_eq!(live.len(), 1, "{w}");
    assert_eq!(live[0]["job"].as_str(), Some(long.as_str()), "{w}");
    assert_eq!(live[0]["state"], "Running", "{w}");
    assert_eq!(live[0]["ec2_state"], "running", "{w}");
    assert!(w["ec2_error"].is_null(), "{w}");
    assert_eq!(w["unregistered"].as_array().map(Vec::len), Some(0), "{w}");
    // The stack's spot requests read too (the emulator makes none for RunInstances).
    assert!(w["spot_requests_error"].is_null(), "{w}");
    assert_eq!(w["unheld_spot_requests"].as_array().map(Vec::len), Some(0), "{w}");
    let price = live[0]["price_usd_per_h"].as_f64().unwrap();
    assert!(
        price > 0.0 && (w["usd_per_h"].as_f64().unwrap() - price).abs() < 1e-9,
        "{w}"
    );
    // The account's G spot quota is full (0 vCPUs): the worker is on-demand, and the verb
    // names the quota, its Service Quotas code and how to raise it.
    assert_eq!(live[0]["capacity_type"], "on-demand", "{w}");
    let full = w["full_quotas"].as_array().expect("a list of full quotas");
    assert!(
        full.iter()
            .any(|q| q["code"] == "L-3819A6DF" && q["capacity_type"] == "spot"),
        "{w}"
    );
    let text = ok(&onoff(&stack, &["workers"]));
    assert!(
        text.contains(&long) && text.contains("1 worker(s) (1 running)"),
        "{text}"
    );
    assert!(text.contains("All G and VT Spot Instance Requests"), "{text}");
    // 3. One that waits behind it, cancelled before it starts.
    let waiting = submit(
        &stack,
        &[
            "--name",
            "waiting",
            "--project",
            "beta",
            "--",
            "python3",
            "-c",
            "print(1)",
        ],
    );
    assert_eq!(state(&stack, &waiting), "QUEUED");
    // Its wake-up message was sent with the submission.
    assert!(json(&stack, &["status", &waiting])["sent_at"].is_f64());
    let text = ok(&onoff(&stack, &["status", &waiting]));
    assert!(text.contains("wake-up    message sent"), "{text}");
    // The offerings its lane may launch for it: on-demand ones free, the spot ones in the full
    // G spot quota (read under `OperatorAccess` from the control table's marks). The mark was
    // there before (`onoff workers` above); when it is still there after, it was there for the
    // status too.
    let offerings = json(&stack, &["status", &waiting])["offerings"].clone();
    let (eligible, free) = (
        offerings["eligible"].as_u64().unwrap_or(0),
        offerings["free"].as_u64().unwrap_or(0),
    );
    assert!(eligible > 0 && free > 0 && free <= eligible, "{offerings}");
    let still_full = json(&stack, &["workers"])["full_quotas"]
        .as_array()
        .is_some_and(|q| q.iter().any(|q| q["code"] == "L-3819A6DF"));
    if still_full {
        assert!(offerings["in_full_quotas"].as_u64().unwrap_or(0) > 0, "{offerings}");
        assert!(offerings["quotas"].to_string().contains("L-3819A6DF"), "{offerings}");
    }
    assert!(
        text.contains("offerings  ") && text.contains(" lane standard may launch for it"),
        "{text}"
    );
    let c = json(&stack, &["cancel", &waiting]);
    assert_eq!(c["outcome"], "cancelled", "{c}");
    assert_eq!(state(&stack, &waiting), "CANCELLED");
    let c = json(&stack, &["cancel", &long]);
    assert_eq!(c["outcome"], "requested", "{c}");
    wait_for("long is cancelled", Duration::from_secs(90), || {
        state(&stack, &long) == "CANCELLED"
    });
    let status = json(&stack, &["status", &long]);
    assert_eq!(status["attempt_log"][0]["outcome"], "cancelled", "{status}");
    let c = json(&stack, &["cancel", &long]);
    assert_eq!(c["outcome"], "finished", "a finished job is left as it is: {c}");
    // 3a. The cancelled waiting job submitted again (`--from`): a new job of its name, project
    // and command, which runs; the old one stays CANCELLED.
    let again = submit(&stack, &["--from", &waiting]);
    assert_ne!(again, waiting);
    wait_for("the job submitted again succeeds", Duration::from_secs(120), || {
        state(&stack, &again) == "SUCCEEDED"
    });
    let (old, new) = (json(&stack, &["status", &waiting]), json(&stack, &["status", &again]));
    assert_eq!(old["state"], "CANCELLED", "{old}");
    for field in ["name", "project", "command", "image", "lane", "gpus"] {
        assert_eq!(old["spec"][field], new["spec"][field], "{field}: {old} / {new}");
    }
    assert_ne!(old["spec"]["client_token"], new["spec"]["client_token"], "{new}");
    let long_log = ok(&onoff(&stack, &["logs", &long]));
    assert!(long_log.contains("tick 0"), "{long_log}");

    // 4. Put by the AWS CLI under jobs/, as a submitter.
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stack_file).unwrap()).unwrap();
    let cli_spec = run_dir.join("by-aws-cli.json");
    std::fs::write(
        &cli_spec,
        serde_json::json!({"image": "onoff-local", "name": "by-aws-cli", "project": "alpha",
            "command": ["python3", "-c", "print('put by the aws cli')"]})
        .to_string(),
    )
    .unwrap();
    ok(&aws_as_submitter(
        &venv_bin,
        &s,
        &[
            "s3",
            "cp",
            cli_spec.to_str().unwrap(),
            &format!("s3://{}/jobs/by-aws-cli.json", s["bucket"].as_str().unwrap()),
        ],
    ));
    let mut by_cli = String::new();
    wait_for("the AWS CLI's job succeeds", Duration::from_secs(120), || {
        let jobs = json(&stack, &["jobs", "--project", "alpha"]);
        jobs.as_array().unwrap().iter().any(|j| {
            if j["name"] == "by-aws-cli" {
                by_cli = j["job_id"].as_str().unwrap().to_string();
                j["state"] == "SUCCEEDED"
            } else {
                false
            }
        })
    });
    assert!(ok(&onoff(&stack, &["logs", &by_cli])).contains("put by the aws cli"));

    // 4a. A spec sent to the submission queue that submit refuses: after the queue's
    // maxReceiveCount receives SQS moves it to its dead-letter queue, and `onoff dead-letters`
    // shows it with the reason submit recorded. Reading it does not take it away: a second read
    // shows it again. It carries the client token of job `again` (3a), so `onoff dead-letters`
    // finds that job under the id submit gives the message and says a move back makes no second
    // job: the lookup it makes for a submission whose job was written after all.
    let (poison_project, poison_token) = (
        new["spec"]["project"].as_str().unwrap().to_string(),
        new["spec"]["client_token"].as_str().unwrap().to_string(),
    );
    let poison = serde_json::json!({"image": "onoff-local", "name": "poison", "project": poison_project,
        "lane": "nope", "command": ["true"], "client_token": poison_token})
    .to_string();
    let send = aws_as_submitter(
        &venv_bin,
        &s,
        &[
            "sqs",
            "send-message",
            "--queue-url",
            s["submission_queue"].as_str().unwrap(),
            "--message-body",
            &poison,
        ],
    );
    ok(&send);
    let sent: serde_json::Value = serde_json::from_slice(&send.stdout).expect("send-message answers JSON");
    let message_id = sent["MessageId"].as_str().expect("a message id").to_string();
    let submissions_dlq = |report: &serde_json::Value| {
        report
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["kind"] == "submissions")
            .cloned()
            .expect("the submissions' dead-letter queue is read")
    };
    let mut dead = serde_json::Value::Null;
    wait_for(
        "the refused spec in the dead-letter queue",
        Duration::from_secs(120),
        || {
            dead = submissions_dlq(&json(&stack, &["dead-letters"]));
            dead["messages"].as_u64() == Some(1)
        },
    );
    for read in 0..2 {
        if read == 1 {
            dead = submissions_dlq(&json(&stack, &["dead-letters"]));
        }
        let shown = dead["shown"].as_array().unwrap();
        assert_eq!(shown.len(), 1, "read {read}: {dead}");
        let m = &shown[0];
        assert_eq!(m["message_id"], message_id.as_str(), "{m}");
        assert_eq!(
            m["what"],
            format!(
                r#"job spec "poison" of project {poison_project} (job {again} holds its client_token: a move back makes no second job)"#
            )
            .as_str(),
            "{m}"
        );
        assert!(m["reason"].as_str().is_some_and(|r| r.contains("unknown lane")), "{m}");
        assert!(m["receives"].as_u64().is_some_and(|n| n >= 5), "{m}");
        // Deleted by SQS 14 days after it was first sent (the queue's retention), not after it
        // moved.
        let (sent, expires) = (m["sent_at"].as_f64().unwrap(), m["expires_at"].as_f64().unwrap());
        assert!((expires - sent - 1_209_600.0).abs() < 1e-3, "{m}");
        assert!(
            dead["action"].as_str().unwrap().contains("start-message-move-task"),
            "{dead}"
        );
    }
    // The malformed event, with the function's error as Lambda sent it.
    let mut failed = serde_json::Value::Null;
    wait_for(
        "the malformed event in the failed-events queue",
        Duration::from_secs(60),
        || {
            let all = json(&stack, &["dead-letters"]);
            failed = all
                .as_array()
                .unwrap()
                .iter()
                .find(|q| q["kind"] == "failed_events")
                .cloned()
                .unwrap();
            failed["messages"].as_u64() == Some(1)
        },
    );
    let event = &failed["shown"][0];
    assert_eq!(
        event["what"], "EventBridge: EC2 Spot Instance Interruption Warning",
        "{failed}"
    );
    assert!(
        event["reason"].as_str().is_some_and(|r| r.contains("instance-id")),
        "the function's error names what the event lacks: {failed}"
    );
    assert!(failed["action"].as_str().unwrap().contains("EC2 events"), "{failed}");
    let all = json(&stack, &["dead-letters"]);
    let kinds: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["kind"].as_str().unwrap())
        .collect();
    // The local stack has one lane, standard.
    assert_eq!(kinds, ["submissions", "lane", "failed_events"], "{all}");
    let text = ok(&onoff(&stack, &["dead-letters"]));
    assert!(text.contains("unknown lane") && text.contains("what to do"), "{text}");
    // No job was made of it.
    let jobs = json(&stack, &["jobs"]);
    assert!(
        !jobs.as_array().unwrap().iter().any(|j| j["name"] == "poison"),
        "{jobs}"
    );

    // 4b. Outputs S3 would refuse (a key over 1,024 bytes): the job still SUCCEEDED, its row says
    // why nothing went up, and `onoff outputs` fails with that reason.
    let deep = submit(
        &stack,
        &[
            "--name",
            "deep-outputs",
            "--project",
            "alpha",
            "--",
            "python3",
            "-c",
            "import os\nd = os.path.join(os.environ['ONOFF_OUTPUT_DIR'], *['d' * 200] * 5)\nos.makedirs(d)\nopen(os.path.join(d, 'f.txt'), 'w').write('x')",
        ],
    );
    let mut outputs = serde_json::Value::Null;
    wait_for("the refused outputs' record", Duration::from_secs(120), || {
        let status = json(&stack, &["status", &deep]);
        outputs = status["outputs"].clone();
        status["state"] == "SUCCEEDED" && !outputs.is_null()
    });
    assert_eq!(outputs["files"].as_u64(), Some(0), "{outputs}");
    assert!(
        outputs["error"]
            .as_str()
            .is_some_and(|e| e.contains("a key of") && e.contains("at most 1024")),
        "{outputs}"
    );
    assert!(ok(&onoff(&stack, &["status", &deep])).contains("outputs were not uploaded"));
    let refused = onoff(&stack, &["outputs", &deep, run_dir.join("deep").to_str().unwrap()]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("not uploaded") && said.contains("at most 1024"), "{said}");

    // 5. Cost per project adds up to what the jobs recorded.
    let jobs = json(&stack, &["jobs"]);
    let recorded: f64 = jobs
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["cost_usd"].as_f64().unwrap())
        .sum();
    assert!(recorded > 0.0, "the jobs recorded their cost: {jobs}");
    let cost = json(&stack, &["cost", "--by", "project"]);
    let total = cost["total"]["usd"].as_f64().unwrap();
    let groups: f64 = cost["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["usd"].as_f64().unwrap())
        .sum();
    assert!(
        (total - recorded).abs() < 1e-9,
        "cost total {total} vs recorded {recorded}"
    );
    assert!((groups - total).abs() < 1e-9);
    let projects: Vec<&str> = cost["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["key"].as_str().unwrap())
        .collect();
    assert_eq!(projects, ["alpha", "beta"]);
    assert!(cost["note"].as_str().unwrap().contains("not your AWS bill"));

    // Ctrl-C: the stack stops, cleans up, exits 0, leaves nothing running.
    let mut stack = stack;
    nix_interrupt(stack.child.id());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = stack.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "onoff local --serve did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // The run's report: every verb above ran under the operator's session, which has the
    // template's `OperatorAccess` and nothing else; the emulator refused none of its calls (it
    // checks actions, and S3's resources), and none is denied by the template's full policy
    // (conditions included) evaluated after the run.
    let mut out = String::new();
    std::io::Read::read_to_string(&mut stack.child.stdout.take().expect("stdout piped"), &mut out).unwrap();
    assert!(
        status.success(),
        "exit status {status:?}: {out}\n{}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );
    let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("report ({e}): {out}"));
    assert_eq!(report["access_denied"], 0, "{report}");
    let check = &report["policy_check"];
    assert_eq!(check["denied"], 0, "{check}");
    assert_eq!(check["not_covered"].as_array().map(Vec::len), Some(0), "{check}");
    // No G spot instance ever ran; the emulator refused the spot launches.
    assert_eq!(report["vcpu_quotas"][0]["peak_vcpus"], 0, "{report}");
    assert!(
        report["launches_refused_for_quota"].as_u64().unwrap_or(0) >= 1,
        "{report}"
    );
    let operator = check["requests_by_principal"]["operator"].as_u64().unwrap_or(0);
    assert!(operator >= 20, "the operator's requests were evaluated: {check}");
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
    let after = onoff(&stack, &["jobs"]);
    assert!(!after.status.success(), "no stack to talk to once it stopped");
    let _ = std::fs::remove_dir_all(&run_dir);
}

/// The AWS CLI (`aws ARGS`, from the venv in `venv_bin`) against the local stack of `stack.json`
/// `s`, under its submitter session.
fn aws_as_submitter(venv_bin: &Path, s: &serde_json::Value, args: &[&str]) -> Output {
    let creds = &s["submitter"];
    Command::new(venv_bin.join("aws"))
        .args(args)
        .args([
            "--endpoint-url",
            s["endpoint"].as_str().unwrap(),
            "--region",
            "us-east-1",
        ])
        .env("AWS_ACCESS_KEY_ID", creds["aws_access_key_id"].as_str().unwrap())
        .env(
            "AWS_SECRET_ACCESS_KEY",
            creds["aws_secret_access_key"].as_str().unwrap(),
        )
        .env("AWS_SESSION_TOKEN", creds["aws_session_token"].as_str().unwrap())
        .output()
        .expect("the AWS CLI runs")
}

fn nix_interrupt(pid: u32) {
    let status = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
}
