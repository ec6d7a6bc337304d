//! `onoff local`: flags, progress line and report around [`onoff_local::run_local`].

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use onoff_local::{LocalOptions, LocalReport, Progress};

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

#[derive(clap::Args)]
pub struct LocalArgs {
    /// Philly trace CSV to replay. Default: the shipped `data/philly/philly-short.csv`.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Jobs to replay (the first N after --skip).
    #[arg(long, default_value_t = 24)]
    jobs: usize,
    /// Jobs of the trace to skip first.
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Time compression: trace seconds per wall second, for arrivals and job durations alike.
    /// Costs and waits are reported in trace time.
    #[arg(long, default_value_t = 60.0)]
    compress: f64,
    /// Longest wall duration of one job, seconds (longer trace jobs are cut to it).
    #[arg(long, default_value_t = 20.0)]
    max_job_s: f64,
    /// Wall milliseconds the example workload spends per item, at least.
    #[arg(long, default_value_t = 250.0)]
    item_ms: f64,
    /// Spot interruption notices injected, per busy spot worker per wall minute (0: none; EC2
    /// sends none to on-demand instances). One is due every 1/RATE busy-spot-worker-minutes, the
    /// first after half that; each worker takes one fault at most. Default 1 (0 with --serve).
    #[arg(long)]
    spot_notices: Option<f64>,
    /// Abrupt worker deaths (agent and job killed, instance gone, no notice), per busy worker per
    /// wall minute (0: none). Default 0.5 (0 with --serve).
    #[arg(long)]
    kill_workers: Option<f64>,
    /// Lost answers: every Nth DynamoDB write the emulator applied, by a function or an agent,
    /// answers HTTP 500 instead (the connection dropped after the write, as on AWS; moto never
    /// does), and the SDK retries it (0: none). Default 20 (0 with --serve).
    #[arg(long)]
    lose_answers: Option<u32>,
    /// An EC2 vCPU quota for the emulator to enforce on the control plane's launches and starts, as
    /// CAPACITY:BUCKET=VCPUS, e.g. `spot:g-vt=16` (`All G and VT Spot Instance Requests`, 16
    /// vCPUs) or `on-demand:p=0`; repeatable. Buckets: standard, dl, f, g-vt, hpc, high-memory,
    /// inf, p, trn, x. A launch or a start over a quota is refused as EC2 refuses it
    /// (`MaxSpotInstanceCountExceeded`, `VcpuLimitExceeded`); moto enforces none. Default: none.
    #[arg(long = "vcpu-quota", value_name = "QUOTA=VCPUS", value_parser = parse_vcpu_quota)]
    vcpu_quotas: Vec<(onoff_aws::faults::quotas::QuotaKey, u32)>,
    /// Serve instead of replaying: start the stack with no trace, print its endpoint and names
    /// (also written to RUN_DIR/stack.json), and run until Ctrl-C or SIGTERM, taking the jobs
    /// any client submits (`onoff submit --local`, `aws s3 cp spec.json s3://<bucket>/jobs/`).
    /// Jobs run in real time (no compression).
    #[arg(long)]
    serve: bool,
    /// Wall seconds from a spot notice to the reclaim (AWS gives 120; scaled down here).
    #[arg(long, default_value_t = 10.0)]
    notice_lead_s: f64,
    /// Malformed EC2 events (a spot interruption warning naming no instance) delivered to the
    /// interruption function at the start. Each must fail, be retried as Lambda retries an
    /// asynchronous invocation, and land in the failed-events queue under the function's role;
    /// the run checks it does. Default 1 (0 with --serve).
    #[arg(long)]
    malformed_events: Option<usize>,
    /// Wall seconds Lambda waits before an asynchronous invocation's first and second retry, as
    /// FIRST,SECOND (AWS waits 60 and 120; scaled down here, as the notice lead is).
    #[arg(long, value_name = "FIRST,SECOND", value_delimiter = ',', default_values_t = [6.0, 12.0])]
    retry_delays_s: Vec<f64>,
    /// Every Nth asynchronous event (EventBridge, the schedule, S3 notifications, scale
    /// requests) is delivered twice, as Lambda's event queue and EventBridge deliver at least
    /// once (0: none); every handler must take the second as a no-op. Default 10 (0 with
    /// --serve).
    #[arg(long)]
    deliver_twice_every: Option<u64>,
    /// Every Nth replayed job is sent to the submission queue (which Lambda's SQS event source
    /// polls for the submit function) instead of put under jobs/ in the bucket (0: none).
    /// Default 4 (0 with --serve).
    #[arg(long)]
    via_queue_every: Option<usize>,
    /// Messages that are no job spec sent to the submission queue at the start. Each must be
    /// refused with an error record on every receive and be moved by SQS to the queue's
    /// dead-letter queue after maxReceiveCount (5) receives; the run checks it is. Default 1 (0
    /// with --serve).
    #[arg(long)]
    poison_messages: Option<usize>,
    /// Wall seconds from launch until the instance's agent starts (the boot).
    #[arg(long, default_value_t = 2.0)]
    boot_s: f64,
    /// Wall seconds from the start of a stopped instance until its agent starts again (no
    /// image pull or model download: shorter than the boot).
    #[arg(long, default_value_t = 1.0)]
    restart_s: f64,
    /// Wall seconds a stopped instance stays "stopping": the emulator refuses its start until
    /// then, as EC2 does (EC2 takes minutes: `onoff_aws::limits::STOPPING_S` against emulators
    /// elsewhere; scaled down here with the boot).
    #[arg(long, default_value_t = 0.5)]
    stopping_s: f64,
    /// Wall seconds a new job takes to reach the jobs table's `active` index, as a global
    /// secondary index may lag its table on AWS ("within a fraction of a second" normally; moto's
    /// index is immediate): the functions do not list a job this young, and a scale request's run
    /// reads its jobs by id instead (0: no lag).
    #[arg(long, default_value_t = 1.0)]
    index_lag_s: f64,
    /// Reconciler schedule period, wall seconds (deployed: 60).
    #[arg(long, default_value_t = 5.0)]
    tick_s: f64,
    /// Agents' idle timeout, wall seconds: an agent with no job this long terminates its instance.
    #[arg(long, default_value_t = 15.0)]
    agent_idle_timeout_s: f64,
    /// Cap on workers: overrides the policy's max_workers_total and every lane's max_workers.
    #[arg(long)]
    max_workers: Option<u32>,
    /// Policy TOML. Default: examples/local-policy.toml (short keep-alive, g5 types, 8 workers).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Seed of the fault injection (which busy worker takes a fault).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stop waiting for unfinished jobs after this many wall seconds (they count as lost).
    #[arg(long, default_value_t = 900.0)]
    timeout_s: f64,
    /// After the last job ends, wall seconds to wait for the workers to terminate themselves
    /// before the run terminates what is left (and reports it).
    #[arg(long, default_value_t = 60.0)]
    drain_s: f64,
    /// Use an emulator already running at this URL instead of starting moto server.
    #[arg(long)]
    endpoint: Option<String>,
    /// moto server program. Default: $ONOFF_MOTO_SERVER, else .venv/bin/moto_server.
    #[arg(long)]
    moto_server: Option<PathBuf>,
    /// Do not enforce IAM. By default every component runs under its own role with the policies
    /// template.yaml gives it, and the emulator refuses what they do not allow (with --endpoint,
    /// enforcement is on for the whole emulator during the run).
    #[arg(long)]
    no_iam: bool,
    /// Run jobs as the agents' user. By default, when run as root, jobs run as UID 10002 (as on a
    /// worker) and the local instance metadata service refuses that user.
    #[arg(long)]
    no_job_user: bool,
    /// The onoff-agent binary. Default: next to this binary.
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    /// The job command's script. Default: worker-image/examples/matmul_items.py.
    #[arg(long)]
    workload: Option<PathBuf>,
    /// Python interpreter that runs the workload.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Logs (moto, control-plane metrics, one per worker) and the workers' work dirs go here.
    #[arg(long, default_value = "target/onoff-local")]
    run_dir: PathBuf,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
}

fn default_agent_bin() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let dir = exe.parent().context("this binary has no folder")?;
    // Integration tests run from target/debug/deps; the binaries sit one level up.
    for d in [dir, dir.parent().unwrap_or(dir)] {
        let p = d.join("onoff-agent");
        if p.exists() {
            return Ok(p);
        }
    }
    bail!(
        "onoff-agent not found next to {}: build it (cargo build -p onoff-agent) or pass --agent-bin",
        exe.display()
    )
}

fn options(a: &LocalArgs) -> Result<LocalOptions> {
    for (name, v) in [
        ("--compress", a.compress),
        ("--max-job-s", a.max_job_s),
        ("--item-ms", a.item_ms),
        ("--tick-s", a.tick_s),
        ("--agent-idle-timeout-s", a.agent_idle_timeout_s),
        ("--timeout-s", a.timeout_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bail!("{name} must be > 0 (got {v})");
        }
    }
    for (name, v) in [
        ("--spot-notices", a.spot_notices.unwrap_or(0.0)),
        ("--kill-workers", a.kill_workers.unwrap_or(0.0)),
        ("--notice-lead-s", a.notice_lead_s),
        ("--boot-s", a.boot_s),
        ("--restart-s", a.restart_s),
        ("--stopping-s", a.stopping_s),
        ("--index-lag-s", a.index_lag_s),
        ("--drain-s", a.drain_s),
        (
            "--retry-delays-s",
            a.retry_delays_s
                .iter()
                .copied()
                .find(|v| !(v.is_finite() && *v >= 0.0))
                .unwrap_or(0.0),
        ),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            bail!("{name} must be >= 0 (got {v})");
        }
    }
    if a.jobs == 0 {
        bail!("--jobs must be at least 1");
    }
    let [first, second] = a.retry_delays_s[..] else {
        bail!(
            "--retry-delays-s takes two waits, FIRST,SECOND (got {:?})",
            a.retry_delays_s
        );
    };
    Ok(LocalOptions {
        trace: a.trace.clone().unwrap_or_else(|| {
            let p = Path::new(crate::DATA_DIR).join("philly/philly-short.csv");
            p.canonicalize().unwrap_or(p)
        }),
        jobs: a.jobs,
        skip: a.skip,
        compress: if a.serve { 1.0 } else { a.compress },
        max_job_s: a.max_job_s,
        item_ms: a.item_ms,
        spot_notices: a.spot_notices.unwrap_or(if a.serve { 0.0 } else { 1.0 }),
        kill_workers: a.kill_workers.unwrap_or(if a.serve { 0.0 } else { 0.5 }),
        lose_answers: a.lose_answers.unwrap_or(if a.serve { 0 } else { 20 }),
        vcpu_quotas: a.vcpu_quotas.iter().cloned().collect(),
        notice_lead_s: a.notice_lead_s,
        malformed_events: a.malformed_events.unwrap_or(if a.serve { 0 } else { 1 }),
        retry_delays_s: [first, second],
        deliver_twice_every: a.deliver_twice_every.unwrap_or(if a.serve { 0 } else { 10 }),
        via_queue_every: a.via_queue_every.unwrap_or(if a.serve { 0 } else { 4 }),
        poison_messages: a.poison_messages.unwrap_or(if a.serve { 0 } else { 1 }),
        boot_s: a.boot_s,
        restart_s: a.restart_s,
        stopping_s: a.stopping_s,
        index_lag_s: a.index_lag_s,
        tick_s: a.tick_s,
        agent_idle_timeout_s: a.agent_idle_timeout_s,
        max_workers: a.max_workers,
        policy: a.policy.clone(),
        seed: a.seed,
        timeout_s: a.timeout_s,
        drain_s: a.drain_s,
        endpoint: a.endpoint.clone(),
        moto_server: a.moto_server.clone(),
        agent_bin: match &a.agent_bin {
            Some(p) => p.clone(),
            None => default_agent_bin()?,
        },
        workload: a.workload.clone().unwrap_or_else(|| {
            let p = Path::new(REPO).join("worker-image/examples/matmul_items.py");
            p.canonicalize().unwrap_or(p)
        }),
        python: a.python.clone(),
        run_dir: a.run_dir.clone(),
        iam: !a.no_iam,
        job_user: !a.no_job_user,
        serve: a.serve,
    })
}

/// `CAPACITY:BUCKET=VCPUS` (`spot:g-vt=16`).
fn parse_vcpu_quota(s: &str) -> Result<(onoff_aws::faults::quotas::QuotaKey, u32), String> {
    use onoff_control::quota::QuotaBucket;
    let (quota, vcpus) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected CAPACITY:BUCKET=VCPUS, e.g. spot:g-vt=16"))?;
    let (capacity, bucket) = quota
        .split_once(':')
        .ok_or_else(|| format!("`{quota}`: expected CAPACITY:BUCKET, e.g. spot:g-vt"))?;
    let capacity = match capacity {
        "spot" => onoff_policy::CapacityType::Spot,
        "on-demand" => onoff_policy::CapacityType::OnDemand,
        other => return Err(format!("capacity `{other}`: spot or on-demand")),
    };
    let bucket = QuotaBucket::ALL.into_iter().find(|b| b.id() == bucket).ok_or_else(|| {
        let ids: Vec<&str> = QuotaBucket::ALL.iter().map(|b| b.id()).collect();
        format!("bucket `{bucket}`: one of {}", ids.join(", "))
    })?;
    let vcpus = vcpus
        .parse()
        .map_err(|e| format!("`{vcpus}`: vCPUs, a whole number ({e})"))?;
    Ok(((bucket, capacity), vcpus))
}

/// Print what a serving stack's clients need: its endpoint and names (`stack.json`).
fn announce(run_dir: &Path, bar: Option<&ProgressBar>) {
    let path = run_dir.join("stack.json");
    let Ok(s) = std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<onoff_local::LocalStack>(&t).map_err(|e| e.to_string()))
    else {
        return;
    };
    let text = format!(
        "onoff local is serving (Ctrl-C stops it and cleans up)\n  endpoint     {}\n  bucket       {} (put job specs under jobs/)\n  queue        {} (or send them here)\n  jobs table   {}\n  log group    {}\n  stack file   {}\n  try          onoff submit --local -- python3 -c 'print(42)'  (in a checkout: scripts/run.sh submit ...)",
        s.endpoint,
        s.bucket,
        s.submission_queue,
        s.jobs_table,
        s.log_group,
        path.display()
    );
    match bar {
        Some(b) => b.println(text),
        None => eprintln!("{text}"),
    }
}

fn progress_line(p: &Progress) -> String {
    if p.phase == "cleaning up" {
        return "cleaning up: stopping every process, terminating what is left".into();
    }
    if p.phase == "serving" {
        let workers: Vec<String> = p.workers.iter().map(|(s, n)| format!("{n} {s}")).collect();
        return format!(
            "serving     jobs {} queued, {} running, {} done | workers: {} | ${:.2}",
            p.queued,
            p.running,
            p.done,
            if workers.is_empty() {
                "none".to_string()
            } else {
                workers.join(", ")
            },
            p.usd
        );
    }
    let workers: Vec<String> = p.workers.iter().map(|(s, n)| format!("{n} {s}")).collect();
    format!(
        "{:<11} jobs {}/{} submitted, {} queued, {} running, {} done | workers: {} | ${:.2}",
        p.phase,
        p.submitted,
        p.to_submit,
        p.queued,
        p.running,
        p.done,
        if workers.is_empty() {
            "none".to_string()
        } else {
            workers.join(", ")
        },
        p.usd
    )
}

/// What `<run-dir>/control-plane.log` keeps: the functions' lines as their CloudWatch log groups
/// would (the `info` lines: each decision's action, target and reason, each notice drained, each job
/// submitted), and every other component's warnings. Each handler's line names its function and
/// request id (the `invoke` span, [`onoff_local::lambda`]).
const CONTROL_PLANE_LOG_FILTER: &str = "warn,onoff=info,scaler=info,reconciler=info,interruption=info,submit=info";

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`), and to `<run_dir>/control-plane.log`
/// ([`CONTROL_PLANE_LOG_FILTER`], whatever `RUST_LOG` says), created or truncated here.
///
/// # Errors
/// The run dir cannot be created or the log file written.
fn logging(run_dir: &Path) -> Result<()> {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{fmt, EnvFilter, Layer as _};
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let path = run_dir.join("control-plane.log");
    let file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    tracing_subscriber::registry()
        .with(
            fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"))),
        )
        .with(
            fmt::layer()
                .with_writer(std::sync::Mutex::new(file))
                .with_ansi(false)
                .with_filter(EnvFilter::new(CONTROL_PLANE_LOG_FILTER)),
        )
        .init();
    Ok(())
}

/// Run `onoff local`. Fails (exit 1) when a job was lost or completed twice, an instance was left
/// running, IAM refused a call or the template's policies deny one, an invocation ran past its
/// function's `Timeout`, or the failed events are not what was injected ([`dead_letter_faults`]):
/// the run's report is printed first either way.
pub fn run(a: LocalArgs) -> Result<()> {
    let opts = options(&a)?;
    logging(&opts.run_dir)?;
    let tty = std::io::stderr().is_terminal();
    let bar = if tty && !a.quiet {
        let b = ProgressBar::new_spinner();
        b.set_style(ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}").expect("valid template"));
        b.enable_steady_tick(Duration::from_millis(200));
        b
    } else {
        ProgressBar::hidden()
    };
    // Without a terminal: one plain line every 10 s instead of a redrawn one.
    let mut last_line = f64::NEG_INFINITY;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if opts.serve {
        eprintln!("onoff local --serve: starting; logs in {}", opts.run_dir.display());
    } else {
        eprintln!(
            "onoff local: {} jobs of {}, compressed {}x; logs in {}",
            opts.jobs,
            opts.trace.display(),
            opts.compress,
            opts.run_dir.display()
        );
    }
    let mut announced = false;
    let report = rt.block_on(onoff_local::run_local(&opts, |p| {
        if opts.serve && !announced && p.phase == "serving" {
            announced = true;
            announce(&opts.run_dir, tty.then_some(&bar));
        }
        let line = progress_line(p);
        if tty {
            bar.set_message(line);
        } else if !a.quiet && (p.elapsed_s - last_line >= 10.0 || p.phase == "cleaning up") {
            last_line = p.elapsed_s;
            eprintln!("[{:>5.0} s] {line}", p.elapsed_s);
        }
    }))?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report, &opts);
    }
    let mut bad = Vec::new();
    // Serving ends with Ctrl-C or SIGTERM: that is no failure.
    if report.interrupted && !opts.serve {
        bad.push("interrupted (Ctrl-C or SIGTERM) before the end".to_string());
    }
    if report.handler_timeouts > 0 {
        bad.push(format!(
            "{} invocation(s) ran past their function's Timeout (template.yaml), where Lambda ends them",
            report.handler_timeouts
        ));
    }
    bad.extend(dead_letter_faults(&report));
    if report.jobs_lost > 0 {
        bad.push(format!("{} job(s) lost", report.jobs_lost));
    }
    if report.duplicate_completions > 0 {
        bad.push(format!("{} job(s) completed twice", report.duplicate_completions));
    }
    if report.attempts_off_lane > 0 {
        bad.push(format!(
            "{} attempt(s) ran on a worker of another lane than their job's",
            report.attempts_off_lane
        ));
    }
    if report.instances_left_running > 0 && !report.interrupted {
        bad.push(format!(
            "{} instance(s) did not terminate themselves within --drain-s",
            report.instances_left_running
        ));
    }
    if report.access_denied > 0 {
        bad.push(format!(
            "{} AWS call(s) refused by IAM: {}",
            report.access_denied,
            report.denied_calls.join(", ")
        ));
    }
    if let Some(c) = report.policy_check.as_ref().filter(|c| c.denied > 0) {
        bad.push(format!(
            "{} request(s) template.yaml's policies deny (conditions, session or resource policies): {}",
            c.denied,
            c.denied_requests.join("; ")
        ));
    }
    if !bad.is_empty() {
        bail!("{}", bad.join("; "));
    }
    Ok(())
}

/// What went wrong with the events the functions failed on: a malformed event delivered and not
/// dead-lettered, an event dead-lettered that was not one of them (a function failed on a real
/// event past its retries), a dead-letter send that failed, a dead letter not read back from the
/// failed-events queue, a poison message without an error record or not in the submission
/// queue's dead-letter queue, a retry still pending or an EC2 event undelivered at the end
/// (unless the run was cut short).
fn dead_letter_faults(r: &LocalReport) -> Vec<String> {
    let mut bad = Vec::new();
    let injected = |d: &&onoff_local::lambda::DeadLetter| is_injected(r, d);
    let lettered: Vec<&str> = r.dead_letters.iter().filter_map(|d| d.event_id()).collect();
    let missing: Vec<&str> = r
        .malformed_events_sent
        .iter()
        .map(String::as_str)
        .filter(|id| !lettered.contains(id))
        .collect();
    if !missing.is_empty() && !r.interrupted {
        bad.push(format!(
            "malformed event(s) not in the failed-events queue: {}",
            missing.join(", ")
        ));
    }
    let others: Vec<String> = r
        .dead_letters
        .iter()
        .filter(|d| !injected(d))
        .map(|d| format!("{} {}: {}", d.function.as_str(), d.request_id, d.error_message))
        .collect();
    if !others.is_empty() {
        bad.push(format!(
            "{} event(s) a function failed on past Lambda's retries: {}",
            others.len(),
            others.join("; ")
        ));
    }
    if !r.dead_letter_errors.is_empty() {
        bad.push(format!(
            "dead-letter sends failed (the events would be lost): {}",
            r.dead_letter_errors.join("; ")
        ));
    }
    if r.failed_events_read_back != r.dead_letters.len() {
        bad.push(format!(
            "{} dead letter(s) sent, {} read back from the failed-events queue",
            r.dead_letters.len(),
            r.failed_events_read_back
        ));
    }
    let unrecorded = |ids: &[String]| -> Vec<String> {
        ids.iter()
            .filter(|id| !r.rejected.iter().any(|x| x.source == format!("sqs:{id}")))
            .cloned()
            .collect()
    };
    let refused = unrecorded(&r.poison_messages_sent);
    if !refused.is_empty() {
        bad.push(format!(
            "poison message(s) with no error record: {}",
            refused.join(", ")
        ));
    }
    let undelivered: Vec<&str> = r
        .poison_messages_sent
        .iter()
        .filter(|id| !r.submission_dead_letters.contains(id))
        .map(String::as_str)
        .collect();
    if !undelivered.is_empty() && !r.interrupted {
        bad.push(format!(
            "poison message(s) not in the submission queue's dead-letter queue: {}",
            undelivered.join(", ")
        ));
    }
    // A bad spec any client sent is refused with an error record and ends there too; a message
    // without one is a job spec submit took and the event source failed to delete.
    let taken = unrecorded(&r.submission_dead_letters);
    if !taken.is_empty() {
        bad.push(format!(
            "message(s) in the submission queue's dead-letter queue with no error record: {}",
            taken.join(", ")
        ));
    }
    if !r.submission_batches_failed.is_empty() {
        bad.push(format!(
            "{} answer(s) of submit's that Lambda reads as a failure of the whole batch (nothing deleted): {}",
            r.submission_batches_failed.len(),
            r.submission_batches_failed.join("; ")
        ));
    }
    if r.retries_pending > 0 && !r.interrupted {
        bad.push(format!(
            "{} failed event(s) still waiting for Lambda's retry at the end (--drain-s)",
            r.retries_pending
        ));
    }
    if r.events_undelivered > 0 && !r.interrupted {
        bad.push(format!(
            "{} EC2 event(s) never delivered to the interruption function (--drain-s)",
            r.events_undelivered
        ));
    }
    bad
}

/// `d` is one of the malformed events the run delivered.
fn is_injected(r: &LocalReport, d: &onoff_local::lambda::DeadLetter) -> bool {
    d.event_id()
        .is_some_and(|id| r.malformed_events_sent.iter().any(|m| m == id))
}

/// Each function's invocations, the longest against its timeout, e.g. `scaler 41 runs, longest
/// 1.2 s of 60 s`; the ones cut off at their deadline, if any.
fn functions_line(runs: &[onoff_local::lambda::FunctionRuns]) -> String {
    runs.iter()
        .map(|f| {
            let mut cut = if f.timed_out > 0 {
                format!(", {} TIMED OUT", f.timed_out)
            } else {
                String::new()
            };
            if f.failed > 0 {
                cut += &format!(
                    ", {} failed, {} retried (of {} allowed), {} dead-lettered",
                    f.failed, f.retries, f.max_retry_attempts, f.dead_lettered
                );
            }
            format!(
                "{} {} runs, longest {:.1} s of {:.0} s{cut}",
                f.function, f.invocations, f.longest_s, f.timeout_s
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn print_report(r: &LocalReport, o: &LocalOptions) {
    println!(
        "onoff local: {} jobs replayed at {}x in {:.0} s wall",
        r.jobs_submitted, r.compress, r.wall_s
    );
    println!(
        "  jobs       {} succeeded, {} failed, {} refused at submission, {} lost, {} completed twice, {} resumed from a checkpoint",
        r.jobs_succeeded, r.jobs_failed, r.jobs_rejected, r.jobs_lost, r.duplicate_completions, r.resumed_from_checkpoint
    );
    println!(
        "  attempts   {}, {} of them found their project's model in the worker's cache (ONOFF_CACHE_DIR)",
        r.attempts, r.attempts_with_warm_cache
    );
    println!(
        "  faults     {} spot interruption notices, {} workers killed without notice, {} events delivered twice, {} write answers lost{}",
        r.spot_notices_sent,
        r.workers_killed,
        r.events_delivered_twice,
        r.answers_lost,
        if r.lose_answers_every > 0 {
            format!(" (every {}th applied)", r.lose_answers_every)
        } else {
            String::new()
        }
    );
    println!(
        "  instances  {} launched, {} stopped and {} started again, {} left running at the end",
        r.instances_launched, r.instances_stopped, r.instances_started, r.instances_left_running
    );
    if r.lanes.len() > 1 {
        let lanes: Vec<String> = r
            .lanes
            .iter()
            .map(|(l, f)| format!("{l}: {}/{} jobs, {} instances", f.succeeded, f.jobs, f.instances))
            .collect();
        println!(
            "  lanes      {}; {} attempt(s) on another lane's worker",
            lanes.join("; "),
            r.attempts_off_lane
        );
    }
    for q in &r.vcpu_quotas {
        println!(
            "  quota      {}{}: {} vCPUs, at most {} held at once; {} launch(es) refused or cut",
            q.quota,
            q.code.as_deref().map_or_else(String::new, |c| format!(" ({c})")),
            q.limit_vcpus,
            q.peak_vcpus,
            r.launches_refused_for_quota
        );
    }
    println!(
        "  cost       ${:.2} in all, ${:.3} per job (trace time: price x lifetime x {})",
        r.total_usd, r.usd_per_job, r.compress
    );
    println!(
        "  wait       p50 {:.0} s, p95 {:.0} s (trace time, submission to first start)",
        r.wait_p50_s, r.wait_p95_s
    );
    println!(
        "  wake-ups   {} re-sent by the reaper, {} spared (the lane's queue held one per pending job)",
        r.wake_ups_resent, r.wake_ups_spared
    );
    println!(
        "  index lag  {} job(s) read by id past the active index ({} s lag)",
        r.jobs_read_past_index, r.index_lag_s
    );
    println!(
        "  IAM        {}; {} AWS calls, {} refused{}",
        if r.iam_enforced {
            "enforced (each component under its template role)"
        } else {
            "not enforced (--no-iam)"
        },
        r.calls_recorded,
        r.access_denied,
        if r.denied_calls.is_empty() {
            String::new()
        } else {
            format!(": {}", r.denied_calls.join(", "))
        }
    );
    if let Some(c) = &r.policy_check {
        println!(
            "  policies   {} requests evaluated against template.yaml's full policies, {} denied{}",
            c.requests,
            c.denied,
            if c.not_covered.is_empty() {
                String::new()
            } else {
                format!("; not covered: {}", c.not_covered.join(", "))
            }
        );
    }
    println!(
        "  jobs' user {}",
        r.job_user.map_or_else(
            || "the agents' own (not root, or --no-job-user)".to_string(),
            |u| format!("uid {u}, refused by the local instance metadata service")
        )
    );
    println!(
        "  agents' privileges {}",
        r.agent_capabilities.as_ref().map_or_else(
            || "this process's own (not root, or no setpriv)".to_string(),
            |c| format!(
                "root with only {} and no new privileges, as in the worker's container",
                c.join(", ")
            )
        )
    );
    if r.handler_errors > 0 {
        let injected: u32 = r
            .dead_letters
            .iter()
            .filter(|d| is_injected(r, d))
            .map(|d| d.invocations)
            .sum();
        println!(
            "  handlers   {} invocation(s) returned an error, {injected} of them the malformed events' (control-plane.log has each)",
            r.handler_errors
        );
    }
    println!("  functions  {}", functions_line(&r.functions));
    println!(
        "  queue      {} job(s) sent to the submission queue; {} batch(es) handed to submit, {} record(s) deleted; {} poison message(s), {} in its dead-letter queue ({} there in all)",
        r.jobs_via_queue,
        r.submission_batches,
        r.submission_records_deleted,
        r.poison_messages_sent.len(),
        r.poison_messages_sent
            .iter()
            .filter(|id| r.submission_dead_letters.contains(id))
            .count(),
        r.submission_dead_letters.len()
    );
    println!(
        "  failed     {} event(s) dead-lettered ({} malformed delivered), {} read back from the failed-events queue{}",
        r.dead_letters.len(),
        r.malformed_events_sent.len(),
        r.failed_events_read_back,
        if r.dead_letter_errors.is_empty() {
            String::new()
        } else {
            format!("; {} send(s) FAILED", r.dead_letter_errors.len())
        }
    );
    if !r.rejected.is_empty() {
        println!(
            "  rejected   {} submission(s), each with an error record:",
            r.rejected.len()
        );
        for x in &r.rejected {
            let after = x
                .after_s
                .map_or_else(String::new, |s| format!(" ({s:.0} s after the put)"));
            println!("             {}{after}: {}", x.source, x.reason);
        }
    }
    println!("  logs       {}", o.run_dir.display());
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_control::quota::QuotaBucket;
    use onoff_policy::CapacityType;

    #[test]
    fn a_run_is_green_only_when_the_failed_events_are_the_malformed_ones_delivered() {
        let letter = |id: Option<&str>| onoff_local::lambda::DeadLetter {
            function: onoff_local::lambda::Principal::Interruption,
            event: id.map_or(serde_json::json!({}), |id| serde_json::json!({ "id": id })),
            request_id: format!("req-{}", id.unwrap_or("none")),
            invocations: 3,
            error_message: "malformed event".into(),
        };
        let green = LocalReport {
            malformed_events_sent: vec!["m-0".into()],
            dead_letters: vec![letter(Some("m-0"))],
            failed_events_read_back: 1,
            ..LocalReport::default()
        };
        assert!(
            dead_letter_faults(&green).is_empty(),
            "{:?}",
            dead_letter_faults(&green)
        );
        let faults = |f: &dyn Fn(&mut LocalReport)| {
            let mut r = green.clone();
            f(&mut r);
            dead_letter_faults(&r).join("; ")
        };
        assert!(faults(&|r| r.dead_letters.clear()).contains("not in the failed-events queue: m-0"));
        assert!(faults(&|r| {
            r.dead_letters.push(letter(None));
            r.failed_events_read_back = 2;
        })
        .contains("1 event(s) a function failed on past Lambda's retries"));
        assert!(faults(&|r| r.dead_letter_errors.push("AccessDenied".into())).contains("AccessDenied"));
        assert!(faults(&|r| r.failed_events_read_back = 0).contains("1 dead letter(s) sent, 0 read back"));
        assert!(faults(&|r| r.retries_pending = 1).contains("still waiting"));
        assert!(faults(&|r| r.events_undelivered = 2).contains("2 EC2 event(s) never delivered"));
        assert!(faults(&|r| r
            .submission_batches_failed
            .push("an empty itemIdentifier".into()))
        .contains("1 answer(s) of submit's that Lambda reads as a failure of the whole batch (nothing deleted): an empty itemIdentifier"));
        let poisoned = |r: &mut LocalReport| {
            r.poison_messages_sent = vec!["p-1".into()];
            r.submission_dead_letters = vec!["p-1".into()];
            r.rejected = vec![onoff_local::Rejected {
                source: "sqs:p-1".into(),
                reason: "expected value".into(),
                after_s: None,
            }];
        };
        assert_eq!(faults(&poisoned), "");
        assert!(faults(&|r| {
            poisoned(r);
            r.submission_dead_letters.push("job-1".into());
        })
        .contains("dead-letter queue with no error record: job-1"));
        // A bad spec a client sent, refused with its record, is no fault.
        assert_eq!(
            faults(&|r| {
                poisoned(r);
                r.submission_dead_letters.push("bad-1".into());
                r.rejected.push(onoff_local::Rejected {
                    source: "sqs:bad-1".into(),
                    reason: "lane".into(),
                    after_s: None,
                });
            }),
            ""
        );
        assert!(faults(&|r| {
            poisoned(r);
            r.submission_dead_letters.clear();
        })
        .contains("poison message(s) not in the submission queue's dead-letter queue: p-1"));
        assert!(faults(&|r| {
            poisoned(r);
            r.rejected.clear();
        })
        .contains("with no error record: p-1"));
        // Cut short by Ctrl-C: what had no time to happen is no fault.
        assert!(faults(&|r| {
            r.interrupted = true;
            r.dead_letters.clear();
            r.failed_events_read_back = 0;
            r.retries_pending = 1;
            r.events_undelivered = 1;
        })
        .is_empty());
    }

    #[test]
    fn a_vcpu_quota_is_read_as_capacity_bucket_and_vcpus() {
        assert_eq!(
            parse_vcpu_quota("spot:g-vt=16"),
            Ok(((QuotaBucket::GAndVt, CapacityType::Spot), 16))
        );
        assert_eq!(
            parse_vcpu_quota("on-demand:p=0"),
            Ok(((QuotaBucket::P, CapacityType::OnDemand), 0))
        );
        for (bad, says) in [
            ("spot:g-vt", "CAPACITY:BUCKET=VCPUS"),
            ("g-vt=16", "CAPACITY:BUCKET"),
            ("reserved:g-vt=16", "spot or on-demand"),
            ("spot:gpu=16", "one of standard, dl"),
            ("spot:g-vt=many", "whole number"),
        ] {
            let e = parse_vcpu_quota(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
