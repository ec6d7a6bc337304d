//! The operator's verbs, against a deployed stack (`--stack NAME`: names from its CloudFormation
//! outputs, the policy from the scaler's configuration) or a running `onoff local --serve`
//! (`--local`: `<run-dir>/stack.json`). One code path for both: the same tables, bucket and log
//! group, read and written through the AWS SDK; region and credentials as every AWS tool resolves
//! them (a local stack names its emulator and an operator session, of the template's
//! `OperatorAccess` only, and the call log the CLI records its calls in, so the run's end
//! evaluates them against the template); no credentials is said in one line, with what to set.
//!
//! - `submit`: a spec from a file (YAML or JSON) and flags, validated with the submit function's
//!   own code (`JobSpec::parse`, `admission::feasible` under the stack's policy and catalogue)
//!   before anything is put, its own errors (file, syntax, fields) before the stack is even looked
//!   up; put under `jobs/`; then waits (a minute at most) to see it admitted or rejected with the
//!   reason.
//! - `jobs`, `status`: the jobs table (`attempt_log` for the attempts).
//! - `logs`: the job's own output, one CloudWatch Logs stream per attempt (`<job_id>/<n>`).
//! - `cancel`: `JobStore::request_cancel`.
//! - `outputs`: `outputs/<job_id>/` of the bucket.
//! - `cost`: from the attempts the jobs table records and the workers table.
//! - `workers`: the live workers, EC2's instances of the stack, and what holds launches back
//!   ([`mod@workers`]).
//! - `dead-letters`: what the dead-letter queues and the failed-events queue hold, and why
//!   ([`mod@dead_letters`]).

mod dead_letters;
mod workers;
pub use dead_letters::{dead_letters, DeadLettersArgs};
pub use workers::{workers, WorkersArgs};

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use aws_sdk_dynamodb::types::AttributeValue;
use comfy_table::{presets::UTF8_BORDERS_ONLY, Table};
use onoff_aws::jobs::{record_from_item, DynamoJobs};
use onoff_aws::settings::Clients;
use onoff_control::job::{job_id_for, JobSpec, JobState, OutputsRecord};
use onoff_control::ports::{CancelOutcome, JobRecord, JobStore};
use onoff_control::reconcile::JobOfferings;
use onoff_control::submit::{Admission, Rules};
use onoff_policy::CapacityType;

/// Which stack a verb talks to.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// A deployed stack: its CloudFormation stack name (resource names come from its outputs).
    #[arg(long, conflicts_with = "local", global = true)]
    stack: Option<String>,
    /// The running `onoff local --serve` (found through RUN_DIR/stack.json).
    #[arg(long, global = true)]
    local: bool,
    /// The run directory of `onoff local --serve`.
    #[arg(long, default_value = "target/onoff-local", global = true)]
    run_dir: PathBuf,
    /// AWS region of a deployed stack (default: as the AWS CLI resolves it).
    #[arg(long, global = true)]
    region: Option<String>,
    /// Print JSON instead of a table or line.
    #[arg(long, global = true)]
    json: bool,
}

/// A stack's resources and settings, and clients for it.
pub struct Ops {
    clients: Clients,
    jobs: DynamoJobs,
    bucket: String,
    jobs_table: String,
    workers_table: String,
    log_group: String,
    /// URLs of the dead-letter queues (submissions', each lane's) and the failed-events queue.
    dead_letter_queues: Vec<String>,
    settings: onoff_fn_common::Settings,
    /// The worker image jobs must name (a deployed stack's `WorkerImageUri`).
    image: Option<String>,
    json: bool,
}

fn credentials(v: &serde_json::Value) -> Option<aws_sdk_s3::config::Credentials> {
    Some(aws_sdk_s3::config::Credentials::new(
        v["aws_access_key_id"].as_str()?,
        v["aws_secret_access_key"].as_str()?,
        v["aws_session_token"].as_str().map(str::to_string),
        None,
        "onoff-local-stack",
    ))
}

impl Ops {
    /// Resolve `t` to a stack.
    ///
    /// # Errors
    /// Neither `--stack` nor `--local`; no running local stack; the stack or its outputs not
    /// found; its settings do not load.
    pub async fn connect(t: &Target) -> Result<Self> {
        match (&t.stack, t.local) {
            (Some(name), _) => Self::deployed(name, t).await,
            (None, true) => Self::local(t).await,
            (None, false) => bail!(
                "say which stack: --stack NAME (a deployed CloudFormation stack) or --local (a running `onoff local --serve`)"
            ),
        }
    }

    async fn local(t: &Target) -> Result<Self> {
        let path = t.run_dir.join("stack.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "no local stack at {} (start one with `onoff local --serve`, or pass --run-dir)",
                path.display()
            )
        })?;
        let s: onoff_local::LocalStack =
            serde_json::from_str(&text).with_context(|| format!("{} is not a local stack's file", path.display()))?;
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(s.pid as i32), None).is_ok();
        if !alive {
            bail!(
                "the local stack of {} is gone (its onoff local, pid {}, is not running): start `onoff local --serve`",
                path.display(),
                s.pid
            );
        }
        let creds = s
            .operator
            .as_ref()
            .and_then(credentials)
            .unwrap_or_else(|| aws_sdk_s3::config::Credentials::new("test", "test", None, None, "onoff-local"));
        let conf = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new(s.region.clone()))
            .endpoint_url(&s.endpoint)
            .credentials_provider(creds)
            .load()
            .await;
        // Recorded as `operator` (best effort: a log that cannot be opened records nothing).
        let recorder = s
            .call_log
            .as_deref()
            .and_then(|p| onoff_aws::record::CallLog::open(p).ok())
            .map(|log| log.recorder("operator"));
        let clients = Clients::from_conf_recorded(&conf, recorder);
        let mut env = s.functions_env.clone();
        env.insert("AWS_REGION".into(), s.region.clone());
        let settings = onoff_fn_common::Settings::from_lookup(|k| env.get(k).cloned())
            .context("the local stack's function settings")?;
        Ok(Self {
            jobs: DynamoJobs::new(clients.dynamodb.clone(), &s.jobs_table),
            clients,
            bucket: s.bucket,
            jobs_table: s.jobs_table,
            workers_table: s.workers_table,
            log_group: s.log_group,
            dead_letter_queues: s.dead_letter_queues,
            settings,
            image: Some(onoff_local::iam::LOCAL_IMAGE.into()),
            json: t.json,
        })
    }

    async fn deployed(name: &str, t: &Target) -> Result<Self> {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(r) = &t.region {
            loader = loader.region(aws_config::Region::new(r.clone()));
        }
        let conf = loader.load().await;
        let region = conf
            .region()
            .map(ToString::to_string)
            .context("no AWS region: pass --region or set AWS_REGION / a profile's region")?;
        let cfn = aws_sdk_cloudformation::Client::new(&conf);
        let out = match cfn.describe_stacks().stack_name(name).send().await {
            Ok(out) => out,
            Err(e) => {
                // No credentials is the usual reason a first call fails without an answer: said
                // so in one line (the SDK's own error is a chain of providers that found none).
                if let (None, Some(p)) = (
                    aws_sdk_s3::error::ProvideErrorMetadata::code(&e),
                    conf.credentials_provider(),
                ) {
                    use aws_sdk_s3::config::ProvideCredentials as _;
                    if let Err(why) = p.provide_credentials().await {
                        bail!(
                            "no AWS credentials to reach stack {name} ({why}): set AWS_PROFILE, or \
                             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run `aws configure`"
                        );
                    }
                }
                bail!("stack {name} in {region}: {}", aws_error(&e));
            }
        };
        let stack = out
            .stacks()
            .first()
            .with_context(|| format!("no stack {name} in {region}"))?;
        let output = |k: &str| {
            stack
                .outputs()
                .iter()
                .find(|o| o.output_key() == Some(k))
                .and_then(|o| o.output_value())
                .map(str::to_string)
                .with_context(|| format!("stack {name} has no output {k}: is it an onoff stack?"))
        };
        let image = stack
            .parameters()
            .iter()
            .find(|p| p.parameter_key() == Some("WorkerImageUri"))
            .and_then(|p| p.parameter_value())
            .map(str::to_string);
        let clients = Clients::from_conf_recorded(&conf, None);
        // The functions' own settings: the policy and lanes submit validates with.
        let lambda = aws_sdk_lambda::Client::new(&conf);
        let f = lambda
            .get_function_configuration()
            .function_name(format!("{name}-scaler"))
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("reading the settings of {name}-scaler: {}", aws_error(&e)))?;
        let mut env: BTreeMap<String, String> = f
            .environment()
            .and_then(|e| e.variables())
            .map(|v| v.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        env.insert("AWS_REGION".into(), region);
        let settings =
            onoff_fn_common::Settings::from_lookup(|k| env.get(k).cloned()).context("the stack's function settings")?;
        let jobs_table = output("JobsTableName")?;
        Ok(Self {
            jobs: DynamoJobs::new(clients.dynamodb.clone(), &jobs_table),
            clients,
            bucket: output("BucketName")?,
            jobs_table,
            workers_table: output("WorkersTableName")?,
            log_group: output("WorkerLogGroupName")?,
            dead_letter_queues: [
                "SubmissionDeadLetterQueueUrl",
                "ExpressDeadLetterQueueUrl",
                "StandardDeadLetterQueueUrl",
                "FailedEventsQueueUrl",
            ]
            .into_iter()
            .map(output)
            .collect::<Result<_>>()?,
            settings,
            image,
            json: t.json,
        })
    }

    /// Every job row (error records left out), newest first.
    async fn all_jobs(&self) -> Result<Vec<JobRecord>> {
        let mut out = Vec::new();
        let mut pages = self
            .clients
            .dynamodb
            .scan()
            .table_name(&self.jobs_table)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| anyhow::anyhow!("scan {}: {}", self.jobs_table, aws_error(&e)))?;
            for item in page.items() {
                let id = item
                    .get("job_id")
                    .and_then(|v| v.as_s().ok())
                    .map_or("", String::as_str);
                if id.starts_with("error#") {
                    continue;
                }
                match record_from_item(item) {
                    Ok(r) => out.push(r),
                    Err(e) => eprintln!("onoff: skipping an unreadable job row: {e}"),
                }
            }
        }
        out.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
        Ok(out)
    }

    async fn job(&self, id: &str) -> Result<JobRecord> {
        self.jobs
            .get(id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .with_context(|| format!("no job {id}"))
    }

    /// [`onoff_control::reconcile::offerings_for`] a pending job of `spec`: the stack's policy
    /// and catalogue, the control table's marks. `Err` with the reason when the marks cannot be
    /// read (`onoff status` says so and goes on).
    async fn job_offerings(&self, spec: &JobSpec, now: f64) -> std::result::Result<Option<JobOfferings>, String> {
        Ok(self.offerings_for(spec, self.marks(now).await?, now))
    }

    /// The control table's unavailable offerings and quota marks in force at `now`.
    async fn marks(&self, now: f64) -> std::result::Result<Vec<onoff_policy::UnavailableOffering>, String> {
        onoff_fn_common::ctx_from_clients(self.settings.clone(), &self.clients)
            .avail
            .unavailable(now)
            .await
            .map_err(|e| format!("reading the control table's marks: {e}"))
    }

    /// [`onoff_control::reconcile::offerings_for`] with the stack's policy and catalogue.
    fn offerings_for(
        &self,
        spec: &JobSpec,
        marks: Vec<onoff_policy::UnavailableOffering>,
        now: f64,
    ) -> Option<JobOfferings> {
        onoff_control::reconcile::offerings_for(
            spec,
            &self.settings.policy,
            &self.settings.offerings,
            marks,
            self.settings.reconcile.max_gpus_per_instance,
            now,
        )
    }
}

fn now() -> f64 {
    onoff_aws::state::unix_now()
}

/// The `exit` column of an attempt: its exit code, or the signal that ended it by name
/// (`SIGKILL`: the kernel's out-of-memory killer, most often; the attempt's reason says more).
fn exit_column(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => c.to_string(),
        (None, Some(n)) => {
            nix::sys::signal::Signal::try_from(n).map_or_else(|_| format!("signal {n}"), |s| s.to_string())
        }
        (None, None) => "-".into(),
    }
}

/// What a waiting job waits on besides its turn, in `onoff jobs`' reason column: `None` while an
/// offering its lane may launch for it is free.
fn waiting_on(o: &JobOfferings) -> Option<String> {
    if o.eligible == 0 {
        return Some("waits: no offering of its lane fits it".into());
    }
    if o.free() > 0 {
        return None;
    }
    Some(match o.quotas.first() {
        Some(m) => match m.bucket.code(m.capacity) {
            Some(code) => format!("waits on a full vCPU quota ({code})"),
            None => format!("waits on a full vCPU quota ({})", m.bucket.name(m.capacity)),
        },
        None => format!(
            "waits on EC2 capacity (skips end {})",
            o.capacity_errors_until.map_or_else(|| "-".into(), when)
        ),
    })
}

/// `onoff status`'s lines on a waiting job's offerings ([`JobOfferings`]): how many its lane may
/// launch for it and how many are free; each full vCPU quota among them with the command that
/// raises it; and, when none is free, that it waits on those, not on its turn, and, when its lane
/// bounds that wait (`limit`: the lane's `quota_wait_limit_s` and the seconds the job has waited,
/// both s), when the reconciler ends it.
fn offerings_lines(o: &JobOfferings, lane: &str, limit: Option<(f64, f64)>) -> Vec<String> {
    if o.eligible == 0 {
        return vec![format!(
            "offerings  none of the catalogue's offerings lane {lane} may launch fits it ({} GPU(s) per instance): it waits until the policy or the catalogue changes",
            o.gpus_per_instance
        )];
    }
    let mut head = format!(
        "offerings  {} lane {lane} may launch for it ({} GPU(s) per instance), {} free",
        o.eligible,
        o.gpus_per_instance,
        o.free()
    );
    if o.in_full_quotas > 0 {
        head.push_str(&format!(", {} in a full vCPU quota", o.in_full_quotas));
    }
    if let Some(t) = o.capacity_errors_until {
        head.push_str(&format!(
            ", {} skipped after a capacity error (until {})",
            o.after_capacity_errors,
            when(t)
        ));
    }
    let mut out = vec![head];
    if o.free() == 0 {
        out.push(
            if o.in_full_quotas > 0 {
                "waiting    on the quota below, not on its turn: it launches once the quota has room (raised, or freed by other instances)"
            } else {
                "waiting    on EC2 capacity: the skips end, and the launch is tried again"
            }
            .to_string(),
        );
        if let Some((limit_s, waited_s)) = limit.filter(|_| o.in_full_quotas > 0) {
            out.push(format!(
                "limit      lane {lane} ends it FAILED after {limit_s:.0} s of such a wait (quota_wait_limit_s; {waited_s:.0} s so far)"
            ));
        }
    }
    for m in &o.quotas {
        out.push(format!("quota      {}", m.bucket.advice(m.capacity, m.vcpus)));
    }
    out
}

fn when(t: f64) -> String {
    let s = t as i64;
    let (days, rem) = (s.div_euclid(86_400), s.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Dollars: four decimals, or three significant digits below a cent.
fn usd(v: f64) -> String {
    if v != 0.0 && v.abs() < 0.01 {
        format!("{v:.2e}")
    } else {
        format!("{v:.4}")
    }
}

fn span(s: f64) -> String {
    if !s.is_finite() || s < 0.0 {
        return "-".into();
    }
    let s = s.round() as u64;
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// Parse a time: unix seconds, or a duration back from now (`30m`, `6h`, `2d`).
fn parse_since(text: &str, now: f64) -> Result<f64> {
    if let Ok(t) = text.parse::<f64>() {
        return Ok(t);
    }
    parse_duration(text)
        .map(|d| now - d)
        .with_context(|| format!("{text:?} is neither unix seconds nor a duration such as 30m, 6h, 2d"))
}

/// `45s`, `30m`, `6h`, `2d` as seconds.
fn parse_duration(text: &str) -> Option<f64> {
    let t = text.trim();
    let (num, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic())?);
    let n: f64 = num.parse().ok()?;
    let mult = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => return None,
    };
    (n.is_finite() && n >= 0.0).then_some(n * mult)
}

// ---- submit -------------------------------------------------------------------------------------

/// `onoff submit`.
#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    /// A job spec, YAML or JSON (crates/control/src/job.rs); flags override its fields.
    spec: Option<PathBuf>,
    /// Start from job JOB's spec instead of a file (a job in any state: run a FAILED or
    /// CANCELLED one again, or a variant of any): its fields, the flags overriding them, under
    /// a new client token, so it is a new job.
    #[arg(long, value_name = "JOB", conflicts_with = "spec", value_parser = onoff_control::job::parse_job_id)]
    from: Option<String>,
    /// Container image (default: the stack's worker image).
    #[arg(long)]
    image: Option<String>,
    /// GPUs.
    #[arg(long)]
    gpus: Option<u32>,
    /// Project billed (default: `default`).
    #[arg(long)]
    project: Option<String>,
    /// Lane.
    #[arg(long)]
    lane: Option<String>,
    /// Deadline: unix seconds, or a duration from now (`2h`).
    #[arg(long)]
    deadline: Option<String>,
    /// Input object, s3://bucket/key (the job gets its local path as ONOFF_JOB_INPUT).
    #[arg(long)]
    input: Option<String>,
    /// A name for people (`onoff jobs` shows it).
    #[arg(long)]
    name: Option<String>,
    /// Idempotency token: submitting twice with one token is one job (default: a new one).
    #[arg(long)]
    client_token: Option<String>,
    /// Do not wait for the stack to admit or reject the job.
    #[arg(long)]
    no_wait: bool,
    /// The command, after `--`: argv, never a shell string.
    #[arg(last = true)]
    command: Vec<String>,
    #[command(flatten)]
    target: Target,
}

/// The spec `a` describes, as JSON text: the fields of `base` (a job's spec, `--from`) or of the
/// file, then the flags.
fn spec_text(
    a: &SubmitArgs,
    base: Option<&JobSpec>,
    default_image: Option<&str>,
    now: f64,
) -> Result<(serde_json::Value, String)> {
    let mut spec: serde_json::Value = match (&a.spec, base) {
        (_, Some(job)) => {
            let mut v = serde_json::to_value(job)?;
            if let Some(obj) = v.as_object_mut() {
                // A new job: the old token would name the old one.
                obj.remove("client_token");
                obj.retain(|_, v| !v.is_null());
            }
            v
        }
        (Some(path), None) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            // YAML is a superset of JSON: one parser for both.
            let v: serde_yaml::Value =
                serde_yaml::from_str(&text).with_context(|| format!("{} is neither YAML nor JSON", path.display()))?;
            serde_json::to_value(v).with_context(|| format!("{}: not a job spec", path.display()))?
        }
        (None, None) => serde_json::json!({}),
    };
    let obj = spec.as_object_mut().context("a job spec is a mapping of fields")?;
    let mut set = |k: &str, v: serde_json::Value| {
        obj.insert(k.to_string(), v);
    };
    if let Some(v) = &a.image {
        set("image", v.clone().into());
    }
    if let Some(v) = a.gpus {
        set("gpus", v.into());
    }
    if let Some(v) = &a.project {
        set("project", v.clone().into());
    }
    if let Some(v) = &a.lane {
        set("lane", v.clone().into());
    }
    if let Some(v) = &a.input {
        set("input", v.clone().into());
    }
    if let Some(v) = &a.name {
        set("name", v.clone().into());
    }
    if let Some(v) = &a.client_token {
        set("client_token", v.clone().into());
    }
    if let Some(d) = &a.deadline {
        let t = match d.parse::<f64>() {
            Ok(t) => t,
            Err(_) => {
                now + parse_duration(d)
                    .with_context(|| format!("--deadline {d:?}: unix seconds or a duration such as 2h"))?
            }
        };
        set("deadline", t.into());
    }
    if !a.command.is_empty() {
        set("command", a.command.clone().into());
    }
    if !obj.contains_key("image") {
        if let Some(img) = default_image {
            obj.insert("image".into(), img.into());
        }
    }
    obj.entry("project").or_insert_with(|| "default".into());
    // The id must be known before the put: a token makes it (submit derives the id from it).
    obj.entry("client_token").or_insert_with(|| {
        format!(
            "cli-{}-{}-{:08x}",
            (now * 1000.0) as u64,
            std::process::id(),
            rand_u32()
        )
        .into()
    });
    let text = serde_json::to_string(&spec)?;
    Ok((spec, text))
}

/// An AWS SDK error in one line: the service's error code and message when it answered (e.g.
/// `ValidationError: Stack with id x does not exist`), else the error and its causes, without the
/// raw response the SDK's `DisplayErrorContext` appends.
fn aws_error<E, R>(e: &aws_sdk_s3::error::SdkError<E, R>) -> String
where
    E: std::error::Error + aws_sdk_s3::error::ProvideErrorMetadata + 'static,
    R: std::fmt::Debug,
{
    use aws_sdk_s3::error::ProvideErrorMetadata as _;
    if let Some(code) = e.code() {
        return format!("{code}: {}", e.message().unwrap_or("(no message)"));
    }
    let mut line = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        line.push_str(": ");
        line.push_str(&c.to_string());
        cause = c.source();
    }
    line
}

/// The image a spec without one is checked with before the stack (which names the default) is
/// found.
const PRECHECK_IMAGE: &str = "image-from-the-stack";

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now().to_bits());
    h.finish() as u32
}

/// Run `onoff submit`.
///
/// # Errors
/// A bad spec (before the stack is looked up when the spec alone shows it, else before anything
/// is put), the stack, or a rejection by the stack.
pub async fn submit(a: SubmitArgs) -> Result<()> {
    let now = now();
    // The spec's own errors first (no such file, not YAML, a field missing or of the wrong type):
    // they need no stack and no credentials. Its lane and whether the stack can run it are
    // checked once the stack is found. A spec `--from` a job is read from the stack.
    if a.from.is_none() {
        let (early, early_text) = spec_text(&a, None, Some(PRECHECK_IMAGE), now)?;
        if early.get("command").is_none() {
            bail!("nothing to run: give the command after `--` (`onoff submit [SPEC] -- python train.py`) or as the spec's `command`");
        }
        let lane = early["lane"].as_str().unwrap_or("standard");
        JobSpec::parse(&early_text, &[lane], now).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let mut ops = Ops::connect(&a.target).await?;
    let base = match &a.from {
        Some(id) => {
            let job = ops
                .jobs
                .get(id)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .with_context(|| format!("no job {id} in this stack (`onoff jobs` lists them)"))?;
            if let (Some(d), None) = (job.spec.deadline, &a.deadline) {
                if d <= now {
                    bail!(
                        "the deadline of {id} ({}) has passed: give the new job one with --deadline (a duration such as 2h, or unix seconds)",
                        when(d)
                    );
                }
            }
            Some(job.spec)
        }
        None => None,
    };
    // Admission counts only the offerings in the zones of the workers' subnets, as the submit
    // function does; without ec2:DescribeSubnets the check counts every zone (the function
    // checks again).
    let fleet = onoff_fn_common::fleet_of(&ops.settings, &ops.clients);
    if let Err(e) = onoff_fn_common::offer_subnet_zones(&mut ops.settings, &fleet).await {
        eprintln!("onoff: warning: {e}; the spec is checked against every zone (the stack checks it again)");
    }
    let (spec, text) = spec_text(&a, base.as_ref(), ops.image.as_deref(), now)?;
    // The submit function's own checks, before anything is put.
    let rules = Admission {
        policy: &ops.settings.policy,
        offerings: &ops.settings.offerings,
    };
    let parsed = JobSpec::parse(&text, &rules.lanes(), now)
        .and_then(|s| rules.runnable(&s).map(|()| s))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(img) = &ops.image {
        if &parsed.image != img {
            eprintln!(
                "onoff: warning: this stack's workers run {img}; a job for {} will fail",
                parsed.image
            );
        }
    }
    let token = parsed.client_token.clone().unwrap_or_default();
    let id = job_id_for(&onoff_control::submit::token_key(&token, &parsed.project));
    let key = format!("jobs/{id}.json");
    let put = ops
        .clients
        .s3
        .put_object()
        .bucket(&ops.bucket)
        .key(&key)
        .content_type("application/json")
        .body(text.clone().into_bytes().into())
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("put s3://{}/{key}: {}", ops.bucket, aws_error(&e)))?;
    let source = put_source(&ops.bucket, &key, put.e_tag(), put.version_id()).describe();
    let mut state = None;
    if !a.no_wait {
        // The put wakes submit; the row (or an error record) shows within seconds.
        for _ in 0..120 {
            if let Some(r) = ops.jobs.get(&id).await.map_err(|e| anyhow::anyhow!("{e}"))? {
                state = Some(r.state);
                break;
            }
            if let Some(reason) = ops
                .jobs
                .error_record(&source)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?
            {
                bail!("the stack rejected the job: {reason}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    if ops.json {
        println!(
            "{}",
            serde_json::json!({"job_id": id, "object": format!("s3://{}/{key}", ops.bucket), "state": state.map(|s| s.as_str()), "spec": spec, "from": a.from})
        );
    } else {
        match state {
            Some(s) => match &a.from {
                Some(old) => println!("{id}  {}  (from {old})", s.as_str()),
                None => println!("{id}  {}", s.as_str()),
            },
            None if a.no_wait => println!("{id}  submitted (s3://{}/{key})", ops.bucket),
            None => println!(
                "{id}  submitted (s3://{}/{key}); not admitted within a minute: see `onoff status {id}`",
                ops.bucket
            ),
        }
    }
    Ok(())
}

/// The source the submit function names an object put at `key` of `bucket` by (its error record's
/// key): as its S3 event gives it, whose `eTag` is unquoted, where PutObject's `ETag` header
/// is quoted ("the ETag reflects changes only to the contents of an object", in double quotes).
fn put_source(
    bucket: &str,
    key: &str,
    etag_header: Option<&str>,
    version: Option<&str>,
) -> onoff_control::submit::Source {
    onoff_control::submit::Source::S3 {
        bucket: bucket.to_string(),
        key: key.to_string(),
        etag: etag_header.unwrap_or_default().trim_matches('"').to_string(),
        version: version.map(str::to_string),
    }
}

// ---- jobs, status ------------------------------------------------------------------------------

/// `onoff jobs`.
#[derive(clap::Args, Debug)]
pub struct JobsArgs {
    /// Only this project's jobs.
    #[arg(long)]
    project: Option<String>,
    /// Only jobs in this state (QUEUED, RUNNING, RETRYING, SUCCEEDED, FAILED, CANCELLED).
    #[arg(long)]
    state: Option<String>,
    /// At most this many, newest first.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    #[command(flatten)]
    target: Target,
}

/// Seconds from submission to the first start, if it started.
fn wait_s(r: &JobRecord) -> Option<f64> {
    r.attempt_log
        .first()
        .map(|a| a.started_at)
        .or(r.claimed_at)
        .map(|t| t - r.created_at)
}

/// Seconds its process ran over all attempts, and the current one so far.
fn run_s(r: &JobRecord, now: f64) -> f64 {
    r.attempt_log.iter().map(|a| a.seconds).sum::<f64>()
        + r.claimed_at
            .filter(|_| r.state == JobState::Running)
            .map_or(0.0, |t| now - t)
}

fn row_json(r: &JobRecord, now: f64) -> serde_json::Value {
    serde_json::json!({
        "job_id": r.id,
        "name": r.spec.name,
        "project": r.spec.project,
        "lane": r.spec.lane,
        "state": r.state.as_str(),
        "attempts": r.attempts,
        "instance_type": r.attempt_log.last().and_then(|a| a.instance_type.clone()),
        "wait_s": wait_s(r),
        "run_s": run_s(r, now),
        "cost_usd": r.cost_usd,
        "reason": r.reason,
        "created_at": r.created_at,
        "finished_at": r.finished_at,
        "cancel_requested": r.cancel_requested,
    })
}

/// Run `onoff jobs`.
///
/// # Errors
/// The stack; a bad `--state`.
pub async fn jobs(a: JobsArgs) -> Result<()> {
    let state = match &a.state {
        Some(s) => Some(
            JobState::parse(&s.to_ascii_uppercase())
                .with_context(|| format!("--state {s:?}: QUEUED, RUNNING, RETRYING, SUCCEEDED, FAILED or CANCELLED"))?,
        ),
        None => None,
    };
    let ops = Ops::connect(&a.target).await?;
    let now = now();
    let rows: Vec<JobRecord> = ops
        .all_jobs()
        .await?
        .into_iter()
        .filter(|r| a.project.as_ref().is_none_or(|p| &r.spec.project == p))
        .filter(|r| state.is_none_or(|s| r.state == s))
        .take(a.limit)
        .collect();
    // What the waiting ones wait on, when it is not their turn (one read of the control table's
    // marks for them all; none when no job waits).
    let waiting_on: BTreeMap<&str, String> = if rows.iter().any(|r| r.state.is_pending()) {
        match ops.marks(now).await {
            Ok(marks) => rows
                .iter()
                .filter(|r| r.state.is_pending())
                .filter_map(|r| {
                    let o = ops.offerings_for(&r.spec, marks.clone(), now)?;
                    Some((r.id.as_str(), waiting_on(&o)?))
                })
                .collect(),
            Err(e) => {
                eprintln!("onoff: what waiting jobs wait on is not shown: {e}");
                BTreeMap::new()
            }
        }
    } else {
        BTreeMap::new()
    };
    if ops.json {
        let v: Vec<_> = rows
            .iter()
            .map(|r| {
                let mut v = row_json(r, now);
                if let Some(w) = waiting_on.get(r.id.as_str()) {
                    v["waiting_on"] = w.clone().into();
                }
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY);
    t.set_header([
        "job", "name", "project", "lane", "state", "att", "type", "wait", "run", "cost $", "reason",
    ]);
    for r in &rows {
        t.add_row([
            r.id.clone(),
            r.spec.name.clone().unwrap_or_default(),
            r.spec.project.clone(),
            r.spec.lane.clone(),
            format!(
                "{}{}",
                r.state.as_str(),
                if r.cancel_requested && !r.state.is_final() {
                    " (cancelling)"
                } else {
                    ""
                }
            ),
            r.attempts.to_string(),
            r.attempt_log
                .last()
                .and_then(|a| a.instance_type.clone())
                .unwrap_or_else(|| "-".into()),
            wait_s(r).map_or_else(|| "-".into(), span),
            span(run_s(r, now)),
            usd(r.cost_usd),
            r.reason
                .clone()
                .or_else(|| waiting_on.get(r.id.as_str()).cloned())
                .unwrap_or_default()
                .chars()
                .take(60)
                .collect(),
        ]);
    }
    println!("{t}");
    if rows.is_empty() {
        println!("no jobs");
    }
    if !waiting_on.is_empty() {
        println!(
            "{} waiting job(s) wait on more than their turn: `onoff status JOB` says what",
            waiting_on.len()
        );
    }
    Ok(())
}

/// `onoff status JOB`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The job id (`onoff submit` printed it).
    #[arg(value_parser = onoff_control::job::parse_job_id)]
    job: String,
    #[command(flatten)]
    target: Target,
}

/// Run `onoff status`.
///
/// # Errors
/// The stack; no such job.
pub async fn status(a: StatusArgs) -> Result<()> {
    let ops = Ops::connect(&a.target).await?;
    let r = ops.job(&a.job).await?;
    let now = now();
    // A waiting job: where the offerings its lane may launch for it stand (full quotas, capacity
    // errors), as the control plane's marks say.
    let offerings = if r.state.is_pending() {
        Some(ops.job_offerings(&r.spec, now).await)
    } else {
        None
    };
    // Its lane's bound on a wait full quotas keep it in, and its wait so far, seconds.
    let limit = ops
        .settings
        .policy
        .lane_index(&r.spec.lane)
        .and_then(|i| ops.settings.policy.lanes[i].quota_wait_limit_s)
        .map(|l| (l, now - r.waiting_since()));
    if ops.json {
        let mut v = row_json(&r, now);
        if let Some(o) = &offerings {
            v["offerings"] = match o {
                Ok(Some(o)) => serde_json::json!({
                    "gpus_per_instance": o.gpus_per_instance,
                    "eligible": o.eligible,
                    "free": o.free(),
                    "in_full_quotas": o.in_full_quotas,
                    "quotas": o.quotas.iter().map(|m| m.bucket.advice(m.capacity, m.vcpus)).collect::<Vec<_>>(),
                    "after_capacity_errors": o.after_capacity_errors,
                    "capacity_errors_until": o.capacity_errors_until,
                    "quota_wait_limit_s": limit.map(|l| l.0),
                }),
                Ok(None) => serde_json::json!({ "error": format!("the stack's policy has no lane {:?}", r.spec.lane) }),
                Err(e) => serde_json::json!({ "error": e }),
            };
        }
        v["spec"] = serde_json::to_value(&r.spec)?;
        v["sent_at"] = r.sent_at.into();
        v["attempt_log"] = serde_json::to_value(&r.attempt_log)?;
        v["lease_owner"] = r.lease_owner.clone().into();
        v["last_checkpoint"] = r.last_checkpoint.clone().into();
        v["source"] = r.source.clone().into();
        v["outputs"] = serde_json::to_value(&r.outputs)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "job        {}{}",
        r.id,
        r.spec.name.as_ref().map_or_else(String::new, |n| format!("  ({n})"))
    );
    println!(
        "state      {}{}",
        r.state.as_str(),
        if r.cancel_requested && !r.state.is_final() {
            " (cancel requested)"
        } else {
            ""
        }
    );
    if let Some(why) = &r.reason {
        println!("reason     {why}");
    }
    println!(
        "project    {}   lane {}   gpus {}",
        r.spec.project, r.spec.lane, r.spec.gpus
    );
    println!("image      {}", r.spec.image);
    println!("command    {}", serde_json::to_string(&r.spec.command)?);
    println!("submitted  {} from {}", when(r.created_at), r.source);
    if let Some(f) = r.finished_at {
        println!("finished   {}", when(f));
    }
    if r.state.is_pending() {
        // A worker learns of a pending job from its wake-up message: none sent yet means the
        // submission could not send it, and the reconciler's next run sends one.
        match r.sent_at {
            Some(t) => println!("wake-up    message sent {}", when(t)),
            None => println!("wake-up    no message sent yet: the reconciler's next run sends one"),
        }
        match &offerings {
            Some(Ok(Some(o))) => {
                for line in offerings_lines(o, &r.spec.lane, limit) {
                    println!("{line}");
                }
            }
            Some(Ok(None)) => println!(
                "offerings  the stack's policy has no lane {:?}: no worker is launched for it",
                r.spec.lane
            ),
            Some(Err(e)) => println!("offerings  not known: {e}"),
            None => {}
        }
    }
    println!(
        "attempts   {} counted, {} lease(s) lost, {} hand-back(s); wait {}, run {}, cost ${}",
        r.attempts,
        r.lease_expiries,
        r.hand_backs,
        wait_s(&r).map_or_else(|| "-".into(), span),
        span(run_s(&r, now)),
        usd(r.cost_usd)
    );
    if let Some(c) = &r.last_checkpoint {
        println!("checkpoint {c}");
    }
    if let Some(o) = &r.outputs {
        println!("outputs    {}", outputs_line(o, &ops.bucket, &r.id));
    }
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY);
    t.set_header([
        "#",
        "instance",
        "type",
        "capacity",
        "start",
        "end",
        "outcome",
        "exit",
        "checkpoint",
    ]);
    for x in &r.attempt_log {
        t.add_row([
            x.n.to_string(),
            x.instance_id.clone(),
            x.instance_type.clone().unwrap_or_default(),
            x.capacity_type.clone().unwrap_or_default(),
            when(x.started_at),
            when(x.ended_at),
            x.outcome.clone(),
            exit_column(x.exit_code, x.signal),
            x.checkpoint.clone().unwrap_or_default(),
        ]);
    }
    if let (JobState::Running, Some(owner)) = (r.state, &r.lease_owner) {
        t.add_row([
            (r.attempt_log.len() + 1).to_string(),
            owner.clone(),
            String::new(),
            String::new(),
            r.claimed_at.map_or_else(String::new, when),
            "running".into(),
            String::new(),
            String::new(),
            String::new(),
        ]);
    }
    println!("{t}");
    Ok(())
}

// ---- logs ---------------------------------------------------------------------------------------

/// `onoff logs JOB`.
#[derive(clap::Args, Debug)]
pub struct LogsArgs {
    /// The job id.
    #[arg(value_parser = onoff_control::job::parse_job_id)]
    job: String,
    /// The attempt (1 is the first; default the latest).
    #[arg(long)]
    attempt: Option<u32>,
    /// Keep printing new lines until the job finishes.
    #[arg(long, short)]
    follow: bool,
    #[command(flatten)]
    target: Target,
}

/// Run `onoff logs`.
///
/// # Errors
/// The stack; no such job or attempt log.
pub async fn logs(a: LogsArgs) -> Result<()> {
    use aws_sdk_cloudwatchlogs::error::ProvideErrorMetadata;
    let ops = Ops::connect(&a.target).await?;
    let job = ops.job(&a.job).await?;
    let latest = job.attempt_log.len() as u32 + u32::from(job.state == JobState::Running);
    let n = a.attempt.unwrap_or(latest.max(1));
    let stream = format!("{}/{n}", a.job);
    let mut token: Option<String> = None;
    let mut quiet_since = std::time::Instant::now();
    let stdout = std::io::stdout();
    loop {
        let mut req = ops
            .clients
            .logs
            .get_log_events()
            .log_group_name(&ops.log_group)
            .log_stream_name(&stream)
            .start_from_head(true);
        if let Some(t) = &token {
            req = req.next_token(t);
        }
        let page = match req.send().await {
            Ok(p) => Some(p),
            Err(e) if e.code() == Some("ResourceNotFoundException") => None,
            Err(e) => bail!("log stream {}/{stream}: {}", ops.log_group, aws_error(&e)),
        };
        let mut got = 0;
        if let Some(p) = page {
            let mut out = stdout.lock();
            for e in p.events() {
                got += 1;
                if ops.json {
                    writeln!(
                        out,
                        "{}",
                        serde_json::json!({"t": e.timestamp().map(|t| t as f64 / 1000.0), "line": e.message()})
                    )?;
                } else {
                    writeln!(out, "{}", e.message().unwrap_or_default())?;
                }
            }
            let next = p.next_forward_token().map(str::to_string);
            match log_page_step(token.as_deref(), next.as_deref(), got, a.follow) {
                LogStep::Stop => break,
                LogStep::NextPage => {
                    token = next;
                    if got > 0 {
                        quiet_since = std::time::Instant::now();
                    }
                    continue;
                }
                LogStep::Wait => token = next,
            }
        } else if !a.follow {
            bail!(
                "no log for attempt {n} of {} (it has {} attempt(s); lines appear once its process prints)",
                a.job,
                latest
            );
        }
        if !a.follow {
            break;
        }
        // Following: stop once the job is final and the stream has been quiet for a while.
        let state = ops.job(&a.job).await?.state;
        if state.is_final() && quiet_since.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

/// What `onoff logs` does after a page of GetLogEvents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogStep {
    /// Ask for the next page at once.
    NextPage,
    /// The end of the stream for now: wait for more (following).
    Wait,
    /// The end of the stream (not following).
    Stop,
}

/// After a page of `got` events read with `token` that gave `next` as its forward token. A page
/// may be empty while more events lie further on ("This operation can return empty results while
/// there are more log events available through the token", CloudWatch Logs API Reference,
/// GetLogEvents): only the same token back means the end of the stream for now.
fn log_page_step(token: Option<&str>, next: Option<&str>, got: usize, follow: bool) -> LogStep {
    if got > 0 || next != token {
        LogStep::NextPage
    } else if follow {
        LogStep::Wait
    } else {
        LogStep::Stop
    }
}

// ---- cancel -------------------------------------------------------------------------------------

/// `onoff cancel JOB`.
#[derive(clap::Args, Debug)]
pub struct CancelArgs {
    /// The job id.
    #[arg(value_parser = onoff_control::job::parse_job_id)]
    job: String,
    #[command(flatten)]
    target: Target,
}

/// Run `onoff cancel`.
///
/// # Errors
/// The stack; no such job.
pub async fn cancel(a: CancelArgs) -> Result<()> {
    let ops = Ops::connect(&a.target).await?;
    let outcome = ops
        .jobs
        .request_cancel(&a.job, now())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (code, text) = match &outcome {
        CancelOutcome::Cancelled => ("cancelled", format!("{}: cancelled (it had not started)", a.job)),
        CancelOutcome::Requested => (
            "requested",
            format!(
                "{}: cancel requested; its worker stops it within a lease renewal (SIGTERM, grace, SIGKILL) and records CANCELLED",
                a.job
            ),
        ),
        CancelOutcome::AlreadyFinished(s) => (
            "finished",
            format!("{}: already {}, left as it is", a.job, s.as_str()),
        ),
        CancelOutcome::Unknown => bail!("no job {}", a.job),
    };
    if ops.json {
        println!("{}", serde_json::json!({"job_id": a.job, "outcome": code}));
    } else {
        println!("{text}");
    }
    Ok(())
}

// ---- outputs ------------------------------------------------------------------------------------

/// `onoff outputs JOB [DIR]`.
#[derive(clap::Args, Debug)]
pub struct OutputsArgs {
    /// The job id.
    #[arg(value_parser = onoff_control::job::parse_job_id)]
    job: String,
    /// Where to put them (default ./JOB_ID).
    dir: Option<PathBuf>,
    #[command(flatten)]
    target: Target,
}

/// Run `onoff outputs`.
///
/// # Errors
/// The stack; a download or a write failed.
pub async fn outputs(a: OutputsArgs) -> Result<()> {
    let ops = Ops::connect(&a.target).await?;
    let prefix = format!("outputs/{}/", a.job);
    let dir = a.dir.clone().unwrap_or_else(|| PathBuf::from(&a.job));
    let mut keys = Vec::new();
    let mut pages = ops
        .clients
        .s3
        .list_objects_v2()
        .bucket(&ops.bucket)
        .prefix(&prefix)
        // URL-encoded keys: one XML 1.0 cannot carry (a control character) would fail the listing.
        .encoding_type(aws_sdk_s3::types::EncodingType::Url)
        .into_paginator()
        .send();
    while let Some(page) = pages.next().await {
        let page = page.map_err(|e| anyhow::anyhow!("list {prefix}: {}", aws_error(&e)))?;
        keys.extend(
            page.contents()
                .iter()
                .filter_map(|o| Some((onoff_aws::objects::url_decoded_key(o.key()?), o.size().unwrap_or(0)))),
        );
    }
    // What the row says became of the latest upload: a failed one is told, before and whatever
    // is there (files of an earlier attempt, or those before the failure). Outputs outlive the
    // row (its TTL): without one, what is there is downloaded as it is.
    let row = ops.job(&a.job).await;
    let failed = row
        .as_ref()
        .ok()
        .and_then(|r| r.outputs.clone())
        .filter(|o| o.error.is_some());
    if keys.is_empty() {
        let r = row?;
        match &failed {
            Some(o) => bail!("{}: {}", a.job, outputs_line(o, &ops.bucket, &a.job)),
            None => bail!(
                "{} has no outputs yet ({}): a job's ONOFF_OUTPUT_DIR is uploaded when an attempt ends",
                a.job,
                r.state.as_str()
            ),
        }
    }
    if let Some(o) = &failed {
        eprintln!(
            "onoff: warning: {}; the files below may be only part of them, or an earlier attempt's",
            outputs_line(o, &ops.bucket, &a.job)
        );
    }
    let mut files = Vec::new();
    for (key, size) in &keys {
        let rel = &key[prefix.len()..];
        if rel.split('/').any(|p| p == ".." || p.is_empty()) {
            eprintln!("onoff: skipping {key}: not a plain relative path");
            continue;
        }
        let dest = dir.join(rel);
        download(&ops, key, &dest).await?;
        files.push(serde_json::json!({"key": key, "path": dest.display().to_string(), "bytes": size}));
        if !ops.json {
            println!("{}  ({size} bytes)", dest.display());
        }
    }
    if ops.json {
        println!("{}", serde_json::to_string_pretty(&files)?);
    }
    Ok(())
}

/// One line on what became of an attempt's outputs ([`OutputsRecord`]).
fn outputs_line(o: &OutputsRecord, bucket: &str, job: &str) -> String {
    match &o.error {
        None => format!(
            "{} file(s) of attempt {} in s3://{bucket}/outputs/{job}/ (onoff outputs {job})",
            o.files, o.attempt
        ),
        Some(e) => format!(
            "attempt {}'s outputs were not uploaded ({}): {e}",
            o.attempt,
            when(o.at)
        ),
    }
}

async fn download(ops: &Ops, key: &str, dest: &Path) -> Result<()> {
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    let obj = ops
        .clients
        .s3
        .get_object()
        .bucket(&ops.bucket)
        .key(key)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("get {key}: {}", aws_error(&e)))?;
    let bytes = obj
        .body
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("read {key}: {e}"))?
        .into_bytes();
    std::fs::write(dest, &bytes).with_context(|| format!("writing {}", dest.display()))
}

// ---- cost ---------------------------------------------------------------------------------------

/// `onoff cost`.
#[derive(clap::Args, Debug)]
pub struct CostArgs {
    /// Only this project's jobs (idle workers are not a project's).
    #[arg(long)]
    project: Option<String>,
    /// Only jobs submitted since: unix seconds, or a duration back from now (`24h`, `7d`).
    #[arg(long)]
    since: Option<String>,
    /// Group by `job`, `project` or `day` (the submission's UTC day).
    #[arg(long, default_value = "project")]
    by: String,
    #[command(flatten)]
    target: Target,
}

/// One group's figures.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CostLine {
    /// Group key.
    pub key: String,
    /// Jobs.
    pub jobs: usize,
    /// $ the jobs' attempts cost (instance price × time on the job).
    pub usd: f64,
    /// GPU-hours of the jobs' processes.
    pub gpu_hours: f64,
    /// Share of the job time on spot capacity, 0..1.
    pub spot_share: f64,
    /// What the same time would have cost at the on-demand list price, $.
    pub on_demand_usd: f64,
    /// `on_demand_usd - usd`.
    pub savings_usd: f64,
}

/// The `onoff cost` report.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CostReport {
    /// By the chosen key.
    pub groups: Vec<CostLine>,
    /// All jobs together.
    pub total: CostLine,
    /// $ of worker time no job paid for (instances' lifetimes × price, less the attempts on them),
    /// over the workers the workers table still knows (rows live 7 days after termination).
    pub idle_worker_usd: f64,
    /// Always: these are launch prices, not the bill.
    pub note: String,
}

fn on_demand_price(ops: &Ops, instance_type: &str) -> Option<f64> {
    ops.settings
        .offerings
        .iter()
        .filter(|o| o.key.instance_type == instance_type && o.key.capacity_type == CapacityType::OnDemand)
        .map(|o| o.price_usd_per_h)
        .reduce(f64::min)
}

/// The cost figures of `rows` grouped by `by`.
fn cost_report(ops: &Ops, rows: &[JobRecord], by: &str) -> CostReport {
    let mut groups: BTreeMap<String, (CostLine, f64, f64)> = BTreeMap::new();
    let mut total = (CostLine::default(), 0.0, 0.0);
    for r in rows {
        let key = match by {
            "job" => r.id.clone(),
            "day" => when(r.created_at)[..10].to_string(),
            _ => r.spec.project.clone(),
        };
        let g = groups.entry(key.clone()).or_insert_with(|| {
            (
                CostLine {
                    key,
                    ..CostLine::default()
                },
                0.0,
                0.0,
            )
        });
        for acc in [&mut *g, &mut total] {
            acc.0.jobs += 1;
            // The row's cost is what its lease holders recorded (attempts still running included).
            acc.0.usd += r.cost_usd;
            for a in &r.attempt_log {
                acc.0.gpu_hours += a.seconds * f64::from(r.spec.gpus) / 3600.0;
                if a.capacity_type.as_deref() == Some("spot") {
                    acc.1 += a.seconds;
                }
                acc.2 += a.seconds;
                let od = a
                    .instance_type
                    .as_deref()
                    .and_then(|t| on_demand_price(ops, t))
                    .or(a.price_usd_per_h)
                    .unwrap_or(0.0);
                acc.0.on_demand_usd += od * a.seconds / 3600.0;
            }
        }
    }
    let finish = |(mut l, spot_s, all_s): (CostLine, f64, f64)| {
        l.spot_share = if all_s > 0.0 { spot_s / all_s } else { 0.0 };
        l.savings_usd = l.on_demand_usd - l.usd;
        l
    };
    CostReport {
        groups: groups.into_values().map(finish).collect(),
        total: finish(total),
        idle_worker_usd: 0.0,
        note: "launch prices (on-demand: data/catalog; spot: EC2's quote to the launching function, else the catalogue's average), not your AWS bill".into(),
    }
}

/// $ of worker time no job paid for: every worker row's instance time billed at its price (its
/// runs, stopped spells left out: [`onoff_aws::state::instance_run_s`]) × that price, less the
/// attempts run on it.
async fn idle_worker_usd(ops: &Ops, rows: &[JobRecord], now: f64) -> Result<f64> {
    let mut lives: BTreeMap<String, f64> = BTreeMap::new();
    let mut pages = ops
        .clients
        .dynamodb
        .scan()
        .table_name(&ops.workers_table)
        .into_paginator()
        .send();
    let num = |item: &std::collections::HashMap<String, AttributeValue>, k: &str| {
        item.get(k)
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<f64>().ok())
    };
    while let Some(page) = pages.next().await {
        let page = page.map_err(|e| anyhow::anyhow!("scan {}: {}", ops.workers_table, aws_error(&e)))?;
        for item in page.items() {
            let id = item
                .get("instance_id")
                .and_then(|v| v.as_s().ok())
                .cloned()
                .unwrap_or_default();
            let (Some(run_s), Some(price)) = (
                onoff_aws::state::instance_run_s(item, now),
                num(item, "price_usd_per_h"),
            ) else {
                continue;
            };
            lives.insert(id, price * run_s / 3600.0);
        }
    }
    let mut worked: BTreeMap<&str, f64> = BTreeMap::new();
    for r in rows {
        for a in &r.attempt_log {
            *worked.entry(a.instance_id.as_str()).or_default() += a.cost_usd;
        }
    }
    // A fold from +0: an empty f64 sum is -0, printed "-0.0000".
    Ok(lives.iter().fold(0.0, |total, (id, usd)| {
        total + (usd - worked.get(id.as_str()).copied().unwrap_or(0.0)).max(0.0)
    }))
}

/// Run `onoff cost`.
///
/// # Errors
/// The stack; a bad `--since` or `--by`.
pub async fn cost(a: CostArgs) -> Result<()> {
    if !["job", "project", "day"].contains(&a.by.as_str()) {
        bail!("--by {:?}: job, project or day", a.by);
    }
    let now = now();
    let since = a.since.as_deref().map(|s| parse_since(s, now)).transpose()?;
    let ops = Ops::connect(&a.target).await?;
    let all = ops.all_jobs().await?;
    let rows: Vec<JobRecord> = all
        .iter()
        .filter(|r| a.project.as_ref().is_none_or(|p| &r.spec.project == p))
        .filter(|r| since.is_none_or(|t| r.created_at >= t))
        .cloned()
        .collect();
    let mut report = cost_report(&ops, &rows, &a.by);
    if a.project.is_none() {
        report.idle_worker_usd = idle_worker_usd(&ops, &all, now).await?;
    }
    if ops.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY);
    t.set_header([a.by.as_str(), "jobs", "$", "GPU-h", "spot", "on-demand $", "saved $"]);
    for l in report.groups.iter().chain(std::iter::once(&report.total)) {
        t.add_row([
            if std::ptr::eq(l, &report.total) {
                "total".to_string()
            } else {
                l.key.clone()
            },
            l.jobs.to_string(),
            usd(l.usd),
            format!("{:.3}", l.gpu_hours),
            format!("{:.0}%", l.spot_share * 100.0),
            usd(l.on_demand_usd),
            usd(l.savings_usd),
        ]);
    }
    println!("{t}");
    if a.project.is_none() {
        println!(
            "idle workers: ${} of instance time no job paid for",
            usd(report.idle_worker_usd)
        );
    }
    println!("({})", report.note);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{log_page_step, put_source, LogStep};

    /// `onoff status` on a waiting job: a quota that keeps every offering says the job waits on
    /// it, with the command; capacity errors say when the skips end; a job with free offerings
    /// gets the count only.
    #[test]
    fn a_waiting_job_is_told_what_its_offerings_wait_on() {
        use onoff_control::quota::{QuotaBucket, QuotaMark};
        use onoff_control::reconcile::JobOfferings;
        use onoff_policy::CapacityType;
        let quota = QuotaMark {
            bucket: QuotaBucket::GAndVt,
            capacity: CapacityType::OnDemand,
            vcpus: 192,
            until: 0.0,
            ceiling: Some(192),
        };
        let o = JobOfferings {
            gpus_per_instance: 8,
            eligible: 3,
            in_full_quotas: 3,
            quotas: vec![quota],
            after_capacity_errors: 0,
            capacity_errors_until: None,
        };
        let lines = super::offerings_lines(&o, "express", None);
        assert_eq!(
            lines[0],
            "offerings  3 lane express may launch for it (8 GPU(s) per instance), 0 free, 3 in a full vCPU quota"
        );
        assert!(lines[1].starts_with("waiting    on the quota below"), "{lines:?}");
        assert!(
            lines[2].starts_with(
                "quota      the account's vCPU quota \"Running On-Demand G and VT instances\" (L-DB2E81BA)"
            ) && lines[2].contains("--quota-code L-DB2E81BA"),
            "{lines:?}"
        );
        // Its lane bounds the wait: when the reconciler ends it.
        let limited = super::offerings_lines(&o, "express", Some((3600.0, 1200.4)));
        assert_eq!(
            limited[2],
            "limit      lane express ends it FAILED after 3600 s of such a wait (quota_wait_limit_s; 1200 s so far)"
        );
        assert_eq!(limited.len(), lines.len() + 1, "{limited:?}");
        let skipped = JobOfferings {
            in_full_quotas: 0,
            quotas: Vec::new(),
            after_capacity_errors: 3,
            capacity_errors_until: Some(1_700_000_000.0),
            ..o.clone()
        };
        let lines = super::offerings_lines(&skipped, "express", Some((3600.0, 4000.0)));
        assert!(
            lines[0].ends_with("0 free, 3 skipped after a capacity error (until 2023-11-14 22:13:20Z)"),
            "{lines:?}"
        );
        assert!(lines[1].starts_with("waiting    on EC2 capacity"), "{lines:?}");
        assert_eq!(lines.len(), 2, "capacity errors are no quota: no limit line: {lines:?}");
        let free = JobOfferings {
            after_capacity_errors: 1,
            ..skipped.clone()
        };
        let lines = super::offerings_lines(&free, "standard", Some((3600.0, 4000.0)));
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("3 lane standard may launch for it (8 GPU(s) per instance), 2 free"));
        let none = JobOfferings {
            eligible: 0,
            ..o.clone()
        };
        assert!(super::offerings_lines(&none, "express", None)[0].contains("none of the catalogue's offerings"));
        // `onoff jobs`' reason column.
        assert_eq!(
            super::waiting_on(&o).as_deref(),
            Some("waits on a full vCPU quota (L-DB2E81BA)")
        );
        assert_eq!(
            super::waiting_on(&skipped).as_deref(),
            Some("waits on EC2 capacity (skips end 2023-11-14 22:13:20Z)")
        );
        assert_eq!(super::waiting_on(&free), None);
        assert_eq!(
            super::waiting_on(&none).as_deref(),
            Some("waits: no offering of its lane fits it")
        );
    }

    #[derive(clap::Parser)]
    struct Submit {
        #[command(flatten)]
        a: super::SubmitArgs,
    }

    fn submit_args(args: &[&str]) -> super::SubmitArgs {
        use clap::Parser as _;
        Submit::parse_from(std::iter::once("submit").chain(args.iter().copied())).a
    }

    /// `--from JOB` starts from the job's spec: its fields, the flags over them, a new client
    /// token (the old one would name the old job), and no field the spec left unset.
    #[test]
    fn a_spec_from_a_job_keeps_its_fields_under_a_new_token_with_the_flags_over_them() {
        let old: onoff_control::job::JobSpec = serde_json::from_str(
            r#"{"image":"img","command":["python","train.py"],"project":"vision","gpus":2,
                "name":"sweep-3","client_token":"t-1","max_attempts":5}"#,
        )
        .unwrap();
        let a = submit_args(&[
            "--from",
            "job-0123456789abcdef",
            "--gpus",
            "4",
            "--",
            "python",
            "again.py",
        ]);
        let (spec, text) = super::spec_text(&a, Some(&old), Some("default-image"), 1_000.0).unwrap();
        let new = onoff_control::job::JobSpec::parse(&text, &["standard"], 1_000.0).unwrap();
        assert_eq!(
            (
                new.image.as_str(),
                new.project.as_str(),
                new.name.as_deref(),
                new.max_attempts
            ),
            ("img", "vision", Some("sweep-3"), 5)
        );
        assert_eq!(
            (new.gpus, new.command),
            (4, vec!["python".to_string(), "again.py".into()])
        );
        let token = new.client_token.unwrap();
        assert!(token.starts_with("cli-") && token != "t-1", "{token}");
        assert!(spec.get("deadline").is_none() && spec.get("input").is_none(), "{spec}");
        // A token given is kept.
        let a = submit_args(&["--from", "job-0123456789abcdef", "--client-token", "mine"]);
        let (spec, _) = super::spec_text(&a, Some(&old), None, 1_000.0).unwrap();
        assert_eq!(spec["client_token"], "mine");
    }

    #[test]
    fn from_a_job_and_a_spec_file_are_one_or_the_other() {
        use clap::Parser as _;
        let both = Submit::try_parse_from(["submit", "spec.yaml", "--from", "job-0123456789abcdef"]);
        assert!(both.is_err());
        let not_a_job = Submit::try_parse_from(["submit", "--from", "j1"]);
        assert!(not_a_job.is_err());
    }

    #[test]
    fn an_attempts_exit_is_its_code_or_its_signals_name() {
        assert_eq!(super::exit_column(Some(3), None), "3");
        assert_eq!(super::exit_column(None, Some(9)), "SIGKILL");
        assert_eq!(super::exit_column(None, Some(40)), "signal 40");
        assert_eq!(super::exit_column(None, None), "-");
    }

    /// The CLI looks a rejection up under the source the submit function records it by: the S3
    /// event's unquoted `eTag`, not PutObject's quoted `ETag` header.
    #[test]
    fn a_put_is_named_as_its_s3_event_names_it() {
        let event = onoff_control::submit::Source::S3 {
            bucket: "b".into(),
            key: "jobs/job-1.json".into(),
            etag: "0123456789abcdef0123456789abcdef".into(),
            version: Some("v1".into()),
        };
        let put = put_source(
            "b",
            "jobs/job-1.json",
            Some("\"0123456789abcdef0123456789abcdef\""),
            Some("v1"),
        );
        assert_eq!(put.describe(), event.describe());
    }

    #[test]
    fn logs_read_past_empty_pages_until_the_token_repeats() {
        // An empty page with a new token: more events may lie further on.
        assert_eq!(log_page_step(Some("f/1"), Some("f/2"), 0, false), LogStep::NextPage);
        assert_eq!(log_page_step(None, Some("f/1"), 0, false), LogStep::NextPage);
        assert_eq!(log_page_step(Some("f/1"), Some("f/2"), 3, false), LogStep::NextPage);
        // The same token back with nothing on the page: the end, for now.
        assert_eq!(log_page_step(Some("f/2"), Some("f/2"), 0, false), LogStep::Stop);
        assert_eq!(log_page_step(Some("f/2"), Some("f/2"), 0, true), LogStep::Wait);
    }
}
