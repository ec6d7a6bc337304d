//! `onoff local`: the whole system on one machine. moto server stands in for AWS; the resources
//! `template.yaml` declares are created through the SDK; the four Lambda handlers run in process
//! on their real triggers (the reconciler's schedule as a timer, the queue-depth alarm evaluated
//! from the queue, S3 ObjectCreated notifications for job specs put under `jobs/`, EC2
//! interruption and state-change events); every instance CreateFleet creates in the emulator
//! becomes a real `onoff-agent` process after a boot delay, with its own IMDS endpoint; a slice of
//! the Philly trace is replayed, time-compressed, with the example workload as every job's
//! command; spot notices and worker kills are injected at the rates asked for.
//!
//! # Layout
//! - [`moto`]: the emulator process.
//! - [`imds`]: a per-instance IMDSv2 endpoint.
//! - [`replay`]: trace jobs as job specs.
//! - [`lambda`]: the functions' invocations, each with its deadline and cut off there.
//! - [`run_local`]: the run, its progress and its [`LocalReport`].
#![warn(missing_docs)]

pub mod iam;
pub mod imds;
pub mod lambda;
pub mod moto;
pub mod replay;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use aws_sdk_s3::primitives::{DateTime, DateTimeFormat};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use onoff_aws::fleet::Ec2Fleet;
use onoff_aws::settings::Clients;
use onoff_control::job::JobState;
use onoff_control::ports::WorkerRegistry;
use onoff_iam::Principal;
use onoff_policy::{CapacityType, PolicyConfig, WorkerState};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;

use crate::imds::{ImdsServer, ImdsState};
use crate::lambda::{DeadLetter, FunctionRuns, Lambda};
use crate::moto::Moto;
use crate::replay::ReplayJob;

/// The agents' job lease in local runs, seconds (deployed: 300), renewed every third of it. Short,
/// so a killed worker's job is re-queued within seconds; not shorter: with dozens of agents and
/// the emulator checking IAM on every call, a 6 s lease saw renewals late enough on this 2-core
/// machine that a 500-job run failed a healthy job for lost leases.
const AGENT_LEASE_S: f64 = 15.0;

/// Wall time one pass of the run's loop spends putting the replay's due job specs, again
/// delivering S3 notifications (to submit), and again EC2 events (to interruption), before the
/// instance runner, the faults and the monitor have their turn; what is left is delivered in the
/// next pass (each pass delivers at least one of each). On AWS the machines boot while the
/// functions run; here one loop does both, and a burst of 80 submissions once took 67 s of
/// invocations in one pass, while 11 launched instances waited that long to boot (`--seed 21`,
/// stop 65).
const EVENT_SLICE: Duration = Duration::from_millis(500);

/// The zones the local stack's workers get a subnet in (the default subnet of each): three of
/// us-east-1's six, as a user's VPC gives subnets in some zones and not all. The functions offer
/// only these zones (`onoff_fn_common::offer_subnet_zones`); a launch elsewhere would land outside
/// the workers' VPC on AWS.
pub const LOCAL_ZONES: [&str; 3] = ["us-east-1a", "us-east-1b", "us-east-1c"];

/// The default policy of local runs (`examples/local-policy.toml`).
pub const LOCAL_POLICY: &str = include_str!("../../../examples/local-policy.toml");

/// What `<run-dir>/stack.json` says of a running local stack: where the emulator is, the names
/// of its resources, the functions' settings (the operator CLI validates specs with them, as
/// submit does) and sessions for a submitter and an operator (`onoff ... --local`).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct LocalStack {
    /// The emulator's URL.
    pub endpoint: String,
    /// Region.
    pub region: String,
    /// The stack's name (prefix of every resource).
    pub prefix: String,
    /// The bucket (job specs under `jobs/`, checkpoints, outputs).
    pub bucket: String,
    /// The submission queue's URL: a job spec sent there is submitted too (Lambda's SQS event
    /// source hands it to submit).
    #[serde(default)]
    pub submission_queue: String,
    /// The jobs table.
    pub jobs_table: String,
    /// The workers table.
    pub workers_table: String,
    /// The workers' log group (a stream per job attempt: `<job_id>/<attempt>`).
    pub log_group: String,
    /// URLs of the submission queue's dead-letter queue, each lane's, and the failed-events
    /// queue (`onoff dead-letters`).
    #[serde(default)]
    pub dead_letter_queues: Vec<String>,
    /// The functions' environment (`ONOFF_*`), as the template sets it.
    pub functions_env: BTreeMap<String, String>,
    /// IAM was enforced.
    pub iam_enforced: bool,
    /// A session that may put job specs under `jobs/` and send them to the submission queue
    /// (`aws_access_key_id`, ...).
    pub submitter: Option<serde_json::Value>,
    /// The operator CLI's session: the template's managed policy `OperatorAccess` and nothing
    /// more, as an operator's role on AWS has it.
    pub operator: Option<serde_json::Value>,
    /// The run's call log: the operator CLI records its calls there (as `operator`), and the
    /// run's end evaluates them with everyone else's against template.yaml.
    #[serde(default)]
    pub call_log: Option<PathBuf>,
    /// The `onoff local` process.
    pub pid: u32,
}

/// A vCPU quota a local run played ([`LocalReport::vcpu_quotas`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct QuotaPlayed {
    /// Its name in Service Quotas, e.g. `All G and VT Spot Instance Requests`.
    pub quota: String,
    /// Its Service Quotas code (service `ec2`), when it has one.
    pub code: Option<String>,
    /// The limit, vCPUs.
    pub limit_vcpus: u32,
    /// The most vCPUs of its live instances at once (sampled every 250 ms).
    pub peak_vcpus: u32,
}

/// Everything a local run can be told. Times are wall seconds unless they say trace seconds.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// Philly trace CSV (default: the shipped `data/philly/philly-short.csv`).
    pub trace: PathBuf,
    /// Jobs to replay.
    pub jobs: usize,
    /// Jobs of the trace to skip first.
    pub skip: usize,
    /// Trace seconds per wall second (arrivals and durations alike).
    pub compress: f64,
    /// Longest wall duration of one job, seconds (longer trace jobs are cut to it).
    pub max_job_s: f64,
    /// Wall milliseconds the example workload spends per item (at least).
    pub item_ms: f64,
    /// Spot interruption notices per busy spot worker per wall minute: one is due every 1/rate
    /// busy-spot-worker-minutes (the first after half that), on a busy spot worker the seed picks
    /// (EC2 sends none to on-demand instances).
    pub spot_notices: f64,
    /// Abrupt worker deaths (process killed, instance gone, no notice) per busy worker per wall
    /// minute, due like `spot_notices`.
    pub kill_workers: f64,
    /// Every Nth DynamoDB write the emulator applied (functions and agents alike) loses its
    /// answer: HTTP 500 in its place, which the SDK retries (`onoff_aws::faults`); 0: none.
    pub lose_answers: u32,
    /// EC2 vCPU quotas the emulator is made to enforce on the functions' launches, vCPUs per
    /// (bucket, capacity type) (`onoff_aws::faults::VcpuQuotas`; moto enforces none); empty:
    /// none.
    pub vcpu_quotas: BTreeMap<onoff_aws::faults::quotas::QuotaKey, u32>,
    /// Seconds from a spot notice to the reclaim (AWS: 120; scaled down by default).
    pub notice_lead_s: f64,
    /// Malformed EC2 events (a spot interruption warning without its instance id) delivered to
    /// the interruption function at the start: each must fail, be retried as Lambda retries it
    /// and land in the failed-events queue ([`lambda`]).
    pub malformed_events: usize,
    /// Lambda's waits before an asynchronous invocation's first and second retry, seconds (AWS:
    /// 60 and 120, [`lambda::RETRY_DELAYS_S`]; scaled down by default, as the notice lead is).
    pub retry_delays_s: [f64; 2],
    /// Every Nth asynchronous event (EventBridge, the schedule, S3, a scale request) is delivered
    /// a second time, as Lambda's asynchronous queue, EventBridge and S3 notifications may
    /// deliver an event more than once ([`Lambda::with_duplicates`]); 0: none.
    pub deliver_twice_every: u64,
    /// Every Nth replayed job is sent to the submission queue (template.yaml `SubmissionQueue`,
    /// which Lambda's SQS event source mapping polls for submit) instead of put under `jobs/`;
    /// 0: none.
    pub via_queue_every: usize,
    /// Messages that are no job spec sent to the submission queue at the start: each must be
    /// refused with an error record on every receive and end in the queue's dead-letter queue
    /// after `maxReceiveCount` receives, moved there by SQS.
    pub poison_messages: usize,
    /// Seconds from launch to the agent's start (the boot).
    pub boot_s: f64,
    /// Seconds from the start of a stopped instance to its agent's start (no image pull, no
    /// model download: shorter than `boot_s`).
    pub restart_s: f64,
    /// Seconds a stopped instance stays stopping: its start is refused until then, as EC2 does
    /// (`onoff_aws::limits::StoppingInstances`).
    pub stopping_s: f64,
    /// Seconds a new job row takes to reach the jobs table's `active` index, as a global
    /// secondary index may lag its table on AWS (moto's is immediate): the functions' listings
    /// leave out rows younger than this (`onoff_aws::jobs::DynamoJobs::set_index_lag_s`); 0: none.
    pub index_lag_s: f64,
    /// Reconciler schedule period, seconds.
    pub tick_s: f64,
    /// Idle timeout of the agents, seconds.
    pub agent_idle_timeout_s: f64,
    /// Override of the policy's worker caps (the total and every lane's).
    pub max_workers: Option<u32>,
    /// Policy TOML (default [`LOCAL_POLICY`]).
    pub policy: Option<PathBuf>,
    /// Seed of the fault injection (which worker takes a fault).
    pub seed: u64,
    /// Give up on unfinished jobs after this long, seconds.
    pub timeout_s: f64,
    /// After the last job, wait this long for the workers to exit by themselves, seconds.
    pub drain_s: f64,
    /// Use a running emulator at this URL instead of starting moto.
    pub endpoint: Option<String>,
    /// moto server program (default: [`moto::find_moto_server`]).
    pub moto_server: Option<PathBuf>,
    /// The `onoff-agent` binary.
    pub agent_bin: PathBuf,
    /// The example workload script.
    pub workload: PathBuf,
    /// Python interpreter for the workload.
    pub python: String,
    /// Directory for logs and the workers' work dirs.
    pub run_dir: PathBuf,
    /// Enforce IAM in the emulator ([`iam`](mod@iam)); off with `--no-iam`.
    pub iam: bool,
    /// Run jobs as a user of their own ([`LOCAL_JOB_UID`]) when this process runs as root; off
    /// with `--no-job-user`.
    pub job_user: bool,
    /// Serve: replay no trace, run the stack until interrupted (Ctrl-C, SIGTERM), taking the jobs
    /// any client submits (`onoff submit --local`, `aws s3 cp` under `jobs/`).
    pub serve: bool,
}

/// What a run did. Dollar figures are in trace time: instance price × lifetime × `compress`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LocalReport {
    /// Jobs submitted: put as S3 job specs, or sent to the submission queue
    /// ([`LocalReport::jobs_via_queue`]).
    pub jobs_submitted: usize,
    /// Jobs that ended SUCCEEDED.
    pub jobs_succeeded: usize,
    /// Jobs that ended FAILED.
    pub jobs_failed: usize,
    /// Submitted jobs refused at submission (an error record with the reason, in
    /// [`LocalReport::rejected`]), e.g. a 2-GPU job where no allowed instance type fits it.
    pub jobs_rejected: usize,
    /// Submitted jobs neither refused nor SUCCEEDED or FAILED when the run ended.
    pub jobs_lost: usize,
    /// Job runs that exited 0 beyond the first per job (work done twice).
    pub duplicate_completions: usize,
    /// Jobs that ran at least once from a checkpoint.
    pub resumed_from_checkpoint: usize,
    /// Job attempts the agents reported (their EMF lines).
    pub attempts: usize,
    /// Attempts whose project cache (`ONOFF_CACHE_DIR`) held what an earlier job of the project
    /// left on the same worker when they started: the replayed jobs keep a 1 MiB model there
    /// (the example workload's `--model-mb 1`), so this counts the starts that found it.
    pub attempts_with_warm_cache: usize,
    /// Instances the control plane launched.
    pub instances_launched: usize,
    /// Per lane of the policy: the replayed jobs in it (spread over the lanes in turn,
    /// [`replay::plan`]), those that ended SUCCEEDED, and the instances launched for it. One lane
    /// unless `--policy` names more.
    pub lanes: BTreeMap<String, LaneFigures>,
    /// Attempts run by a worker of another lane than their job's: each worker takes its own
    /// lane's jobs only (`ONOFF_LANES`), so any is a fault.
    pub attempts_off_lane: usize,
    /// The zones they were launched in, each once: only zones with a subnet of the stack's
    /// ([`LOCAL_ZONES`]); an instance elsewhere would, on AWS, be outside the workers' VPC.
    pub zones_launched_in: Vec<String>,
    /// Idle workers the control plane stopped (their instances kept), and stopped ones it started
    /// again.
    pub instances_stopped: usize,
    /// See [`LocalReport::instances_stopped`].
    pub instances_started: usize,
    /// Instances still running when the run ended (before the final cleanup terminated them).
    pub instances_left_running: usize,
    /// Spot interruption notices injected.
    pub spot_notices_sent: usize,
    /// Workers killed without notice.
    pub workers_killed: usize,
    /// DynamoDB writes applied whose answer was lost (HTTP 500 in the call log), functions' and
    /// agents'.
    pub answers_lost: usize,
    /// [`LocalOptions::lose_answers`].
    pub lose_answers_every: u32,
    /// The vCPU quotas played ([`LocalOptions::vcpu_quotas`]): each with the most vCPUs its
    /// instances held at once, as the runner saw them.
    pub vcpu_quotas: Vec<QuotaPlayed>,
    /// CreateFleet calls a played vCPU quota refused or cut, and RunInstances and StartInstances
    /// calls it refused.
    pub launches_refused_for_quota: u32,
    /// $ for all instances (trace time).
    pub total_usd: f64,
    /// `total_usd` / jobs succeeded.
    pub usd_per_job: f64,
    /// Median wait from submission to the first start, trace seconds.
    pub wait_p50_s: f64,
    /// 95th percentile wait, trace seconds.
    pub wait_p95_s: f64,
    /// Handler invocations that returned an error (those cut off at their deadline included).
    pub handler_errors: usize,
    /// Per function: its `Timeout` (template.yaml), invocations, the longest and those cut off at
    /// their deadline ([`lambda`]).
    pub functions: Vec<FunctionRuns>,
    /// Invocations cut off at their deadline, as Lambda would have ended them. A green run has 0.
    pub handler_timeouts: usize,
    /// [`LocalOptions::malformed_events`] delivered, by event id.
    pub malformed_events_sent: Vec<String>,
    /// Events a function failed on that Lambda gave up on (retries spent, or too old for one),
    /// each sent to the failed-events queue under the function's own role. A green run has the
    /// malformed events sent, and no other.
    pub dead_letters: Vec<DeadLetter>,
    /// Dead-letter sends that failed (a denied role, say), each with its error: on AWS the event
    /// would be lost (Lambda's `DeadLetterErrors` metric). A green run has none.
    pub dead_letter_errors: Vec<String>,
    /// Messages read back from the failed-events queue at the end, by their `RequestID`
    /// attribute, each with its `ErrorCode` and `ErrorMessage` attributes and its body the event.
    /// A green run reads back exactly [`LocalReport::dead_letters`].
    pub failed_events_read_back: usize,
    /// Failed events still waiting for a retry when the run ended.
    pub retries_pending: usize,
    /// Asynchronous events delivered a second time ([`LocalOptions::deliver_twice_every`]).
    pub events_delivered_twice: usize,
    /// EC2 events (spot notices, state changes) the run ended before delivering to the
    /// interruption function. A green run has none: the run waits for them (up to
    /// [`LocalOptions::drain_s`]).
    pub events_undelivered: usize,
    /// Replayed jobs sent to the submission queue instead of put as S3 job specs (counted in
    /// [`LocalReport::jobs_submitted`] too).
    pub jobs_via_queue: usize,
    /// Batches Lambda's SQS event source mapping handed submit (synchronous invocations), and
    /// the records it deleted after submit took them.
    pub submission_batches: usize,
    /// See [`LocalReport::submission_batches`].
    pub submission_records_deleted: usize,
    /// Batches whose answer Lambda's SQS event source reads as a failure of the whole batch
    /// (`lambda::sqs_batch_item_failures`: an empty, missing or unknown `itemIdentifier`), each
    /// with the reason; nothing of such a batch is deleted. A green run has none.
    pub submission_batches_failed: Vec<String>,
    /// [`LocalOptions::poison_messages`] sent, by message id.
    pub poison_messages_sent: Vec<String>,
    /// The ids of the messages in the submission queue's dead-letter queue at the end (SQS moves
    /// one there after `maxReceiveCount` receives). A green run finds every poison message there
    /// and has an error record for each (`sqs:<message id>` in [`LocalReport::rejected`]): one
    /// without is a message submit took but the event source could not delete.
    pub submission_dead_letters: Vec<String>,
    /// IAM was enforced: every component (the four functions, each agent, each job) ran under its
    /// own role with the policies template.yaml gives it, as moto evaluates them
    /// ([`iam`](mod@iam)). False with `--no-iam`.
    pub iam_enforced: bool,
    /// AWS calls of the components the emulator refused (HTTP 403, or 401 for a signature or
    /// credentials it did not accept), from the call log
    /// (`calls.jsonl` in the run directory). A green run has 0.
    pub access_denied: usize,
    /// Refused calls by principal and operation, e.g. `worker/i-0abc: sqs:SendMessage` (at most 20).
    pub denied_calls: Vec<String>,
    /// AWS calls recorded (all components).
    pub calls_recorded: usize,
    /// The recorded calls evaluated against template.yaml's full policies (conditions, session
    /// and resource-based policies; `onoff_iam::eval`); `None` without IAM. A green run has
    /// `denied: 0`.
    pub policy_check: Option<iam::PolicyCheck>,
    /// The user jobs ran as ([`LOCAL_JOB_UID`]); `None`: the agents' own (not root, or
    /// `--no-job-user`), and a job could then reach the local IMDS.
    pub job_user: Option<u32>,
    /// The capabilities the agents ran with, as the worker's container gives them
    /// ([`AGENT_CAPABILITIES`], through `setpriv`: [`container_privileges`]); `None`: this
    /// process's own (not root, or no `setpriv`).
    pub agent_capabilities: Option<Vec<String>>,
    /// Scale requests invoked (submit's or interruption's asynchronous invoke of the scaler), each
    /// an event of its own: the asks that found none pending ([`Self::scale_asks`]).
    pub scale_requests_served: usize,
    /// Asks for a scaler run that submit and interruption counted in the control table
    /// (`onoff_fn_common::request_scale`): those that found a request pending joined it instead
    /// of invoking the scaler; `None` when the count could not be read.
    pub scale_asks: Option<u64>,
    /// Wall seconds from the start of the invocation that asked to the end of the scaler's run
    /// (its launch calls included), median.
    pub scale_request_latency_p50_s: f64,
    /// The same, the longest.
    pub scale_request_latency_max_s: f64,
    /// [`LocalOptions::index_lag_s`].
    pub index_lag_s: f64,
    /// Jobs the scaler's and the reconciler's runs read by id because the `active` index did not
    /// list them as they were ([`LocalOptions::index_lag_s`];
    /// `onoff_control::reconcile::ReconcileReport::jobs_read_past_index`), summed over the
    /// invocations (a scaler invocation that runs again answers with its last run's only: a lower
    /// bound).
    pub jobs_read_past_index: usize,
    /// Fresh wake-up messages the reconciler's reaper sent for pending jobs whose message may be
    /// gone (none sent for `resend_after_s`, and the lane's queue short of one per pending job).
    pub wake_ups_resent: usize,
    /// Such jobs the reaper sent none, as the lane's queue held one message per pending job
    /// (`reconcile::reap_jobs`).
    pub wake_ups_spared: usize,
    /// Wall seconds the run took.
    pub wall_s: f64,
    /// Trace seconds per wall second.
    pub compress: f64,
    /// The run was stopped by Ctrl-C or SIGTERM before its end.
    pub interrupted: bool,
    /// Submissions the stack refused (specs put under `jobs/` by the replay or by any client),
    /// each with the error record's reason.
    pub rejected: Vec<Rejected>,
}

/// A submission the stack refused: its error record.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Rejected {
    /// Where it came from (`s3://bucket/key?versionId=...#etag` or `sqs:<id>`).
    pub source: String,
    /// The reason on its error record.
    pub reason: String,
    /// Wall seconds from the object's put (S3 LastModified, whole seconds) to the error record.
    pub after_s: Option<f64>,
}

/// A snapshot for the progress line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Jobs submitted so far / to submit.
    pub submitted: usize,
    /// Of all to submit.
    pub to_submit: usize,
    /// Jobs QUEUED or RETRYING.
    pub queued: usize,
    /// Jobs RUNNING.
    pub running: usize,
    /// Jobs SUCCEEDED or FAILED.
    pub done: usize,
    /// Workers by state (`booting` are launched instances whose agent has not started).
    pub workers: BTreeMap<String, usize>,
    /// $ so far.
    pub usd: f64,
    /// Wall seconds since start.
    pub elapsed_s: f64,
    /// Phase (`replaying`, `draining`, `cleaning up`).
    pub phase: &'static str,
}

/// One lane's figures in a [`LocalReport`].
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LaneFigures {
    /// Replayed jobs submitted into the lane.
    pub jobs: usize,
    /// Of them, those that ended SUCCEEDED.
    pub succeeded: usize,
    /// Instances launched for the lane (their `onoff:lane` tag).
    pub instances: usize,
}

/// One line an agent printed about a job attempt (its EMF line).
#[derive(Debug, Clone)]
struct AttemptLine {
    job_id: String,
    /// The lane of the worker that ran it.
    worker_lane: String,
    completed: bool,
    resumed: bool,
    started_at: f64,
    /// The job's project cache held something when it started (`CacheBytesAtStart` > 0).
    cache_warm: bool,
}

struct Agent {
    child: tokio::process::Child,
    pgid: Option<i32>,
}

struct Inst {
    instance_type: String,
    zone: String,
    capacity: CapacityType,
    lane: String,
    /// When it was seen launched, or started again after a stop: its boot runs from here.
    seen_at: Instant,
    ended_at: Option<Instant>,
    /// Stopped since (EC2 says stopping or stopped): its agent was shut down with it.
    stopped_at: Option<Instant>,
    /// Started again after a stop: its boot is a restart (`LocalOptions::restart_s`).
    restarted: bool,
    /// Seconds it ran (billed) before its current run, over its earlier starts.
    billed_s: f64,
    agent: Option<Agent>,
    imds: Option<ImdsServer>,
    faulted: bool,
    reclaim_at: Option<Instant>,
}

impl Inst {
    /// Shut its agent down as a stop does (SIGTERM to its process group: the OS's shutdown stops
    /// the agent's container, which may release a job first).
    fn stop(&mut self) {
        if let Some(pg) = self.agent.as_ref().and_then(|a| a.pgid) {
            let _ = killpg(Pid::from_raw(pg), Signal::SIGTERM);
        }
        self.imds = None;
    }

    /// Seconds billed up to `now`: its earlier runs and the current one (none while stopped).
    fn billed_s(&self, now: Instant) -> f64 {
        let current = match (self.stopped_at, self.ended_at) {
            (Some(_), _) => 0.0,
            (None, end) => (end.unwrap_or(now) - self.seen_at).as_secs_f64(),
        };
        self.billed_s + current
    }

    fn kill(&mut self) {
        if let Some(a) = &mut self.agent {
            if let Some(pg) = a.pgid {
                let _ = killpg(Pid::from_raw(pg), Signal::SIGKILL);
            }
            let _ = a.child.start_kill();
        }
        self.imds = None;
    }
}

fn iso(unix: f64) -> String {
    DateTime::from_secs_f64(unix)
        .fmt(DateTimeFormat::DateTime)
        .unwrap_or_default()
}

fn unix_now() -> f64 {
    onoff_aws::state::unix_now()
}

/// An EventBridge event as EC2 sends it, from the shipped sample of its kind.
fn ec2_event(sample: &str, instance_id: &str, extra: &[(&str, &str)], n: usize) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_str(sample).expect("shipped sample event parses");
    v["id"] = format!("local-{n}-{instance_id}").into();
    v["time"] = iso(unix_now()).into();
    v["resources"] = serde_json::json!([format!("arn:aws:ec2:us-east-1:123456789012:instance/{instance_id}")]);
    v["detail"]["instance-id"] = instance_id.into();
    for (k, val) in extra {
        v["detail"][*k] = (*val).into();
    }
    v
}

const SPOT_WARNING: &str = include_str!("../../../events/spot-interruption-warning.json");
const STATE_CHANGE: &str = include_str!("../../../events/instance-state-change.json");
/// Visibility timeout of a local run's submission queue, seconds (template.yaml: 360, six times
/// the submit function's timeout; scaled down so that a refused message's five receives take
/// seconds, not half an hour).
pub const LOCAL_SUBMISSION_VISIBILITY_S: u32 = 3;

const ALARM: &str = include_str!("../../../events/queue-depth-alarm.json");
const SCHEDULE: &str = include_str!("../../../events/schedule.json");
const S3_PUT: &str = include_str!("../../../events/s3-object-created.json");

/// The jobs a run's summary says it read past the `active` index (`jobs_read_past_index`).
fn past_index(summary: &serde_json::Value) -> usize {
    summary["jobs_read_past_index"].as_array().map_or(0, Vec::len)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The run's policy: `--policy`'s file, else [`LOCAL_POLICY`].
fn load_policy(opts: &LocalOptions) -> anyhow::Result<PolicyConfig> {
    let text = match &opts.policy {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading policy {}", p.display()))?,
        None => LOCAL_POLICY.to_string(),
    };
    PolicyConfig::from_toml_str(&text).context("policy")
}

/// Every lane of `policy` is one `template` (the template's lanes and their queues' logical ids,
/// [`onoff_iam::lane_queues`]) gives a queue. A local run enforces the template's policies, which
/// grant the functions and workers the queues of those lanes only: another lane's queue would be
/// created, then every call on it denied. (Deployed, the functions refuse to start on such a
/// lane: `ONOFF_QUEUE_URLS` names no queue for it.)
///
/// # Errors
/// A lane without one, naming it, the template's lanes and the ways out.
pub fn lanes_have_template_queues(policy: &PolicyConfig, template: &[(String, String)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = policy
        .lanes
        .iter()
        .map(|l| l.name.as_str())
        .filter(|l| !template.iter().any(|(t, _)| t == l))
        .collect();
    anyhow::ensure!(
        missing.is_empty(),
        "policy lane{} {} ha{} no queue in template.yaml (its ONOFF_QUEUE_URLS gives lanes {}): a local \
         run enforces the template's IAM policies, which grant only those lanes' queues. Name the \
         policy's lanes after them, add the lane's queue to template.yaml (and to ONOFF_QUEUE_URLS \
         in Globals and the worker's user data), or run with --no-iam",
        if missing.len() == 1 { "" } else { "s" },
        missing.iter().map(|l| format!("{l:?}")).collect::<Vec<_>>().join(", "),
        if missing.len() == 1 { "s" } else { "ve" },
        template
            .iter()
            .map(|(l, q)| format!("{l} ({q})"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    Ok(())
}

/// Run it: start (or reach) the emulator, create the resources, replay, inject faults, drain,
/// clean up. `on_progress` is called about twice a second. Ctrl-C (SIGINT) or SIGTERM ends the
/// run early: the cleanup still stops every process and terminates every instance, and the report
/// counts unfinished jobs as lost.
///
/// # Errors
/// Setup failures (emulator, resources, trace, policy); failures during the run are counted in
/// the report instead.
pub async fn run_local(opts: &LocalOptions, mut on_progress: impl FnMut(&Progress)) -> anyhow::Result<LocalReport> {
    let started = Instant::now();
    std::fs::create_dir_all(&opts.run_dir).with_context(|| format!("creating {}", opts.run_dir.display()))?;
    let run_dir = std::fs::canonicalize(&opts.run_dir)?;
    for (what, p) in [("agent binary", &opts.agent_bin), ("example workload", &opts.workload)] {
        anyhow::ensure!(p.exists(), "{what} not found at {}", p.display());
    }
    // The functions' metric lines go to a file: stdout is the report's.
    let metrics = std::fs::File::create(run_dir.join("control-plane-metrics.log"))?;
    onoff_control::emf::redirect(Box::new(metrics));
    // A policy the run would refuse later is refused before the emulator starts.
    let policy = load_policy(opts)?;
    if opts.iam {
        let template = onoff_iam::lane_queues(onoff_iam::TEMPLATE, onoff_iam::Principal::Scaler)
            .context("template.yaml's lane queues")?;
        lanes_have_template_queues(&policy, &template)?;
    }

    let mut moto = match &opts.endpoint {
        Some(e) => Moto::existing(e),
        None => {
            let program = opts
                .moto_server
                .clone()
                .or_else(moto::find_moto_server)
                .context("moto server not found: run scripts/run.sh (it installs moto into .venv), or pass --moto-server or --endpoint")?;
            Moto::start(&program, &run_dir.join("moto.log")).await?
        }
    };
    let result = run_with(opts, policy, &run_dir, &moto.endpoint, started, &mut on_progress).await;
    moto.stop().await;
    result
}

#[allow(clippy::too_many_lines)]
async fn run_with(
    opts: &LocalOptions,
    mut policy: PolicyConfig,
    run_dir: &std::path::Path,
    endpoint: &str,
    started: Instant,
    on_progress: &mut impl FnMut(&Progress),
) -> anyhow::Result<LocalReport> {
    let conf = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(aws_sdk_s3::config::Credentials::new(
            "test",
            "test",
            None,
            None,
            "onoff-local",
        ))
        .load()
        .await;
    // EC2's stop, at this run's scale.
    onoff_aws::limits::set_stopping_s(opts.stopping_s);
    // The setup's clients: IAM is not enforced yet.
    let setup = Clients::from_conf_recorded(&conf, None);
    // Clients with a session's credentials, recording their calls if a recorder is given.
    let with_session = |s: Option<&iam::Session>, rec: Option<onoff_aws::record::CallRecorder>| {
        let conf = match s {
            Some(s) => conf
                .to_builder()
                .credentials_provider(aws_sdk_s3::config::SharedCredentialsProvider::new(s.credentials()))
                .build(),
            None => conf.clone(),
        };
        Clients::from_conf_recorded(&conf, rec)
    };

    // Policy and resources.
    if let Some(m) = opts.max_workers {
        policy.limits.max_workers_total = m;
        for l in &mut policy.lanes {
            l.max_workers = m;
        }
    }
    let lanes: Vec<String> = policy.lanes.iter().map(|l| l.name.clone()).collect();
    let lane = lanes.first().cloned().context("the policy has no lane")?;
    let prefix = format!("onoff-local-{}", std::process::id());
    let provisioned = onoff_aws::provision::provision(
        &setup,
        &onoff_aws::provision::ProvisionOptions {
            prefix: prefix.clone(),
            lanes: lanes.clone(),
            max_receive_count: 5,
            visibility_timeout_s: 30,
            submission_visibility_timeout_s: LOCAL_SUBMISSION_VISIBILITY_S,
            zones: LOCAL_ZONES.iter().map(|z| (*z).to_string()).collect(),
        },
    )
    .await?;
    let res = provisioned.resources.clone();
    let mut env: Vec<(String, String)> = res.env_pairs().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    env.push(("ONOFF_DEPLOYMENT".into(), prefix.clone()));
    env.push(("AWS_REGION".into(), "us-east-1".into()));
    let mut fn_env = env.clone();
    fn_env.push(("ONOFF_POLICY".into(), toml_of(&policy)?));
    let mut settings =
        onoff_fn_common::Settings::from_lookup(|k| fn_env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))?;
    settings.reconcile.heartbeat_timeout_s = 10.0;
    settings.reconcile.boot_timeout_s = 30.0 + opts.boot_s;
    settings.reconcile.launch_grace_s = (opts.boot_s + 2.0).max(3.0);
    // A pending job whose message may be gone is due another after 20 s (deployed: 10 minutes),
    // so that jobs waiting in a burst take the reaper through its queue count (a fresh message
    // only for as many as the lane's queue lacks) under the reconciler's role.
    settings.reconcile.resend_after_s = 20.0;
    // Holds of kept idle workers last three reconciler periods (deployed: 900 s).
    settings.reconcile.hold_s = 3.0 * opts.tick_s;
    // The lease's TTL without a deadline; every local invocation has one (`lambda`), so the TTL
    // is the deadline's plus the margin, as deployed.
    settings.lease_ttl_s = 10.0;
    // GPUs per instance type, for each agent's ONOFF_GPUS (on EC2 the user data counts them).
    let gpus_of: BTreeMap<String, u32> = settings
        .offerings
        .iter()
        .map(|o| (o.key.instance_type.clone(), o.gpus))
        .collect();
    // The workers' log group (template.yaml `WorkerLogGroup`): each job attempt's output goes to
    // a stream of its own there (`<job_id>/<attempt>`), which `onoff logs` reads.
    let log_group = format!("/onoff/{prefix}/workers");
    setup
        .logs
        .create_log_group()
        .log_group_name(&log_group)
        .send()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "create log group {log_group}: {}",
                aws_sdk_s3::error::DisplayErrorContext(e)
            )
        })?;
    // IAM: every component under its own role, the template's policies enforced by the emulator.
    let call_log_path = run_dir.join("calls.jsonl");
    // A run's own calls only: a log left in the run directory by an earlier run (a `--serve`
    // session, say) would be evaluated against this run's resources and denied.
    let call_log = onoff_aws::record::CallLog::create(&call_log_path)
        .with_context(|| format!("creating {}", call_log_path.display()))?;
    let mut iam_stack: Option<onoff_iam::Stack> = None;
    let sessions = if opts.iam {
        let account = setup
            .sts
            .get_caller_identity()
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("sts GetCallerIdentity: {}", aws_sdk_s3::error::DisplayErrorContext(e)))?
            .account
            .unwrap_or_default();
        let stack = iam::local_stack(&prefix, &account, &res).context("template.yaml's lane queues")?;
        let s = iam::setup(endpoint, &stack)
            .await
            .context("IAM setup in the emulator")?;
        iam_stack = Some(stack);
        Some(s)
    } else {
        None
    };
    let creds = |s: &iam::Session| {
        serde_json::json!({
            "aws_access_key_id": s.access_key_id,
            "aws_secret_access_key": s.secret_access_key,
            "aws_session_token": s.session_token,
        })
    };
    let stack_json = LocalStack {
        endpoint: endpoint.to_string(),
        region: "us-east-1".into(),
        prefix: prefix.clone(),
        bucket: res.bucket.clone(),
        submission_queue: provisioned.submission_queue.0.clone(),
        jobs_table: res.jobs_table.clone(),
        workers_table: res.workers_table.clone(),
        log_group: log_group.clone(),
        dead_letter_queues: std::iter::once(provisioned.submission_queue.1.clone())
            .chain(provisioned.dead_letter_queues.iter().map(|(_, url)| url.clone()))
            .chain(std::iter::once(provisioned.failed_events_queue.clone()))
            .collect(),
        functions_env: fn_env.iter().cloned().collect(),
        iam_enforced: sessions.is_some(),
        submitter: sessions.as_ref().map(|s| creds(&s.submitter)),
        operator: sessions.as_ref().map(|s| creds(&s.operator)),
        call_log: Some(call_log_path.clone()),
        pid: std::process::id(),
    };
    std::fs::write(run_dir.join("stack.json"), serde_json::to_string_pretty(&stack_json)?)?;
    // The runner plays AWS itself (EC2, CloudWatch alarms, S3 notifications) and watches.
    let clients = with_session(sessions.as_ref().map(|s| &s.runner), None);
    let submitter = with_session(
        sessions.as_ref().map(|s| &s.submitter),
        Some(call_log.recorder("submitter")),
    );
    // EC2's vCPU quotas, played on the functions' launches and told the live instances below.
    let quotas = (!opts.vcpu_quotas.is_empty()).then(|| {
        let vcpus_of: BTreeMap<String, u32> = settings
            .offerings
            .iter()
            .map(|o| (o.key.instance_type.clone(), o.vcpus))
            .collect();
        onoff_aws::faults::VcpuQuotas::new(opts.vcpu_quotas.clone(), vcpus_of)
    });
    // Each function's context as its cold start builds it (`aws_ctx`): its own session, and (but
    // the interruption handler's, which neither decides nor admits) its offerings restricted to
    // the subnets' zones by its own DescribeSubnets.
    let function = |name: &str| {
        let c = with_session(
            sessions.as_ref().and_then(|s| s.functions.get(name)),
            Some(call_log.recorder(name)),
        );
        let c = match opts.lose_answers {
            0 => c,
            n => c.losing_answers(onoff_aws::faults::LoseAnswers::every(n)),
        };
        let c = match &quotas {
            Some(q) => c.with_vcpu_quotas(q.clone()),
            None => c,
        };
        let mut ctx = onoff_fn_common::ctx_from_clients(settings.clone(), &c);
        ctx.jobs.set_index_lag_s(opts.index_lag_s);
        let name = name.to_string();
        async move {
            if name != "interruption" {
                onoff_fn_common::offer_subnet_zones(&mut ctx.settings, &ctx.fleet)
                    .await
                    .with_context(|| format!("the {name} function's cold start"))?;
            }
            anyhow::Ok((ctx, c))
        }
    };
    let (scaler_ctx, scaler_clients) = function("scaler").await?;
    let (reconciler_ctx, reconciler_clients) = function("reconciler").await?;
    let (interruption_ctx, interruption_clients) = function("interruption").await?;
    let (submit_ctx, submit_clients) = function("submit").await?;
    // Scale requests (submit's and interruption's asynchronous invokes of the scaler), each with
    // when its asker's invocation started.
    let asks: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let submit_clients = Asking {
        clients: submit_clients,
        asks: asks.clone(),
    };
    let interruption_clients = Asking {
        clients: interruption_clients,
        asks: asks.clone(),
    };
    let mut ask_latencies: Vec<f64> = Vec::new();
    let mut lambda = Lambda::from_template(onoff_iam::TEMPLATE)
        .context("template.yaml's function timeouts and retry settings")?
        .with_retry_delays(opts.retry_delays_s)
        .with_duplicates(opts.deliver_twice_every);
    // Where Lambda sends the events a function failed on: each function's DeadLetterQueue in
    // template.yaml, the failed-events queue provisioned as it declares.
    for p in lambda::FUNCTIONS {
        let dlq =
            onoff_iam::function_dead_letter_queue(onoff_iam::TEMPLATE, p).context("template.yaml's DeadLetterQueue")?;
        anyhow::ensure!(
            dlq.as_deref() == Some("FailedEventsQueue"),
            "template.yaml: the {} function's dead-letter queue is {dlq:?}, which a local run does not provision",
            p.as_str()
        );
    }
    // Submit's SQS event source as template.yaml declares it (batch size, whether Lambda reads
    // the answer's batchItemFailures); without one no queue invokes submit, and none is polled.
    let submission_source = onoff_iam::function_sqs_event_source(onoff_iam::TEMPLATE, Principal::Submit)
        .context("template.yaml's SQS event of submit")?;
    if let Some(s) = &submission_source {
        anyhow::ensure!(
            s.queue == "SubmissionQueue",
            "template.yaml: submit's event source polls {}, which a local run does not provision",
            s.queue
        );
    }
    let failed_events_url = provisioned.failed_events_queue.clone();
    let (submission_url, submission_dlq_url) = provisioned.submission_queue.clone();
    // moto's account, as in the EC2 events' ARNs.
    let submission_arn = format!("arn:aws:sqs:us-east-1:123456789012:{prefix}-submissions");
    let ctx = onoff_fn_common::ctx_from_clients(settings, &clients);
    let fleet = Ec2Fleet::new(clients.ec2.clone(), &res.launch_template).with_deployment(&prefix);

    // Jobs run as a user of their own when this process can switch users (root), as on a worker
    // (template.yaml: ONOFF_JOB_UID=10002, and a firewall rule keeps that user from IMDS; here the
    // local IMDS refuses it). Their files must then be reachable: the run dir is opened to others
    // and the workload copied into it (the checkout may sit in a private home).
    let job_uid = (opts.job_user && can_switch_user()).then_some(LOCAL_JOB_UID);
    // And then with the worker container's privileges only, where setpriv is.
    let setpriv = container_privileges(job_uid.is_some());
    let mut replay_opts = opts.clone();
    if job_uid.is_some() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o755))?;
        let dir = run_dir.join("workload");
        std::fs::create_dir_all(&dir)?;
        let name = opts.workload.file_name().context("--workload names no file")?;
        let copy = dir.join(name);
        std::fs::copy(&opts.workload, &copy)
            .with_context(|| format!("copying the workload {}", opts.workload.display()))?;
        replay_opts.workload = copy;
    }

    // The replay.
    let plan = if opts.serve {
        Vec::new()
    } else {
        replay::plan(&replay_opts, &lanes)?
    };
    let job_lanes: BTreeMap<String, String> = plan.iter().map(|j| (j.job_id.clone(), j.lane.clone())).collect();
    let job_ids: BTreeSet<String> = plan.iter().map(|j| j.job_id.clone()).collect();
    let replay_keys: Vec<String> = plan.iter().map(|j| format!("jobs/{}.json", j.name)).collect();
    let mut pending: VecDeque<ReplayJob> = plan.into_iter().collect();
    let to_submit = pending.len();
    let mut submitted_at: BTreeMap<String, f64> = BTreeMap::new();
    let mut seen_keys: BTreeSet<String> = BTreeSet::new();
    // When each object key under jobs/ was put (S3 LastModified), to time its rejection.
    let mut put_at: BTreeMap<String, f64> = BTreeMap::new();

    // Agents' environment.
    let mut agent_env = env.clone();
    agent_env.extend(
        [
            ("AWS_ENDPOINT_URL", endpoint.to_string()),
            ("ONOFF_CALL_LOG", call_log_path.display().to_string()),
            ("ONOFF_LOG_GROUP", log_group.clone()),
            ("ONOFF_SHUTDOWN", "api-only".into()),
            ("ONOFF_IDLE_TIMEOUT_S", opts.agent_idle_timeout_s.to_string()),
            ("ONOFF_HEARTBEAT_S", "1".into()),
            ("ONOFF_LEASE_S", AGENT_LEASE_S.to_string()),
            ("ONOFF_IMDS_POLL_S", "0.5".into()),
            ("ONOFF_POLL_WAIT_S", "1".into()),
            ("ONOFF_RETRY_DELAY_S", "1".into()),
            ("ONOFF_NOTICE_GRACE_S", (opts.notice_lead_s * 0.6).min(90.0).to_string()),
            ("ONOFF_TIME_SCALE", opts.compress.to_string()),
            // The functions' policy: the agent takes its deadline rule's figures from it.
            ("ONOFF_POLICY", toml_of(&policy)?),
            ("RUST_LOG", "info".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v)),
    );
    if let Some(uid) = job_uid {
        agent_env.push(("ONOFF_JOB_UID".into(), uid.to_string()));
    }
    if opts.lose_answers > 0 {
        agent_env.push((
            onoff_aws::faults::LOSE_ANSWERS_ENV.into(),
            opts.lose_answers.to_string(),
        ));
    }
    match &sessions {
        Some(s) => {
            agent_env.extend(s.worker.env());
            if let Some(arn) = &s.job_role_arn {
                agent_env.push(("ONOFF_JOB_ROLE_ARN".into(), arn.clone()));
            }
        }
        None => agent_env.extend(
            [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")]
                .map(|(k, v)| (k.to_string(), v.to_string())),
        ),
    }
    let attempts: Arc<Mutex<Vec<AttemptLine>>> = Arc::default();
    let mut instances: BTreeMap<String, Inst> = BTreeMap::new();
    let mut events: VecDeque<serde_json::Value> = VecDeque::new();
    let mut event_n = 0usize;
    // Malformed events: a spot interruption warning that names no instance.
    let mut malformed_sent = Vec::new();
    for i in 0..opts.malformed_events {
        let mut ev = ec2_event(SPOT_WARNING, "i-malformed", &[], event_n);
        event_n += 1;
        ev["id"] = format!("local-malformed-{i}").into();
        if let Some(d) = ev["detail"].as_object_mut() {
            d.remove("instance-id");
        }
        malformed_sent.push(format!("local-malformed-{i}"));
        events.push_back(ev);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    let mut report = LocalReport {
        jobs_submitted: 0,
        compress: opts.compress,
        iam_enforced: sessions.is_some(),
        lose_answers_every: opts.lose_answers,
        index_lag_s: opts.index_lag_s,
        ..LocalReport::default()
    };
    let mut alarm_state: BTreeMap<String, bool> = BTreeMap::new();
    let mut worker_states: BTreeMap<String, WorkerState> = BTreeMap::new();
    let mut job_states: BTreeMap<String, JobState> = BTreeMap::new();

    let t0 = Instant::now();
    let mut next_schedule = t0;
    let mut next_alarm = t0;
    let mut next_s3 = t0;
    let mut next_fleet = t0;
    let mut next_faults = t0 + Duration::from_secs(1);
    let (mut notices_due, mut kills_due) = (0.5, 0.5);
    let mut next_monitor = t0;
    let mut drain_started: Option<Instant> = None;
    let mut phase = if opts.serve { "serving" } else { "replaying" };
    // Ctrl-C / SIGTERM: stop early, but through the cleanup (the agents run in process groups of
    // their own, so the terminal's signal does not reach them).
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        tokio::spawn(async move {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let invoke_err = |what: &str, r: Result<serde_json::Value, onoff_fn_common::HandlerError>, errors: &mut usize| {
        if let Err(e) = r {
            *errors += 1;
            tracing::warn!(function = what, error = %e, "handler error");
        }
    };

    // Scale requests: Lambda would start the scaler within moments of the asynchronous invoke
    // (and concurrently with the asker's next events); here it runs right after the invocation
    // that asked, or, for S3 notifications, after the pass's notifications (submit's invocations
    // run side by side on AWS: the asks of a burst join one pending request). Each invoke is an
    // event of its own, as on AWS: the askers' own protocol (`onoff_fn_common::request_scale`,
    // against the emulated control table) is what keeps them few. Timed from the start of that
    // invocation to the end of the scaler's run (its launch calls included).
    macro_rules! serve_scale_requests {
        () => {
            let requests: Vec<(Instant, String)> = std::mem::take(&mut *asks.lock().expect("lock"));
            for (at, reason) in requests {
                let asked_at = onoff_fn_common::now() - at.elapsed().as_secs_f64();
                let payload = onoff_fn_common::scale_request(&reason, asked_at);
                let r = lambda
                    .invoke(Principal::Scaler, payload, |ev| {
                        scaler::handler::handle(&scaler_ctx, &scaler_clients, ev)
                    })
                    .await;
                ask_latencies.push(at.elapsed().as_secs_f64());
                if let Ok(summary) = &r {
                    report.jobs_read_past_index += past_index(summary);
                }
                invoke_err("scaler", r, &mut report.handler_errors);
                onoff_aws::fleet::tag_as_ec2_does(&clients.ec2, &prefix, &res.launch_template).await;
            }
        };
    }

    // Poison messages: bodies no submit can make a job of.
    for i in 0..opts.poison_messages {
        let out = submitter
            .sqs
            .send_message()
            .queue_url(&submission_url)
            .message_body(format!("poison message {i}: not a job spec"))
            .send()
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "send to {submission_url}: {}",
                    aws_sdk_sqs::error::DisplayErrorContext(e)
                )
            })?;
        report.poison_messages_sent.push(out.message_id.unwrap_or_default());
    }
    let mut next_sqs = t0;

    loop {
        let now = Instant::now();
        let elapsed = (now - t0).as_secs_f64();
        // Replay: put job specs whose arrival has come (a slice's worth: a client uploads while
        // the machines boot).
        let slice = Instant::now();
        while slice.elapsed() < EVENT_SLICE && pending.front().is_some_and(|j| j.at_s <= elapsed) {
            let j = pending.pop_front().expect("front exists");
            if opts.via_queue_every > 0 && (report.jobs_submitted + 1).is_multiple_of(opts.via_queue_every) {
                // As a client sends a job to the submission queue (`aws sqs send-message`).
                submitter
                    .sqs
                    .send_message()
                    .queue_url(&submission_url)
                    .message_body(j.spec.to_string())
                    .send()
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!(
                            "send to {submission_url}: {}",
                            aws_sdk_sqs::error::DisplayErrorContext(e)
                        )
                    })?;
                submitted_at.insert(j.job_id.clone(), unix_now());
                report.jobs_submitted += 1;
                report.jobs_via_queue += 1;
                continue;
            }
            let key = format!("jobs/{}.json", j.name);
            submitter
                .s3
                .put_object()
                .bucket(&res.bucket)
                .key(&key)
                .body(j.spec.to_string().into_bytes().into())
                .send()
                .await
                .map_err(|e| {
                    anyhow::anyhow!(
                        "put s3://{}/{key}: {}",
                        res.bucket,
                        aws_sdk_s3::error::DisplayErrorContext(e)
                    )
                })?;
            submitted_at.insert(j.job_id.clone(), unix_now());
            report.jobs_submitted += 1;
        }
        // S3 ObjectCreated notifications -> submit.
        if now >= next_s3 {
            next_s3 = now + Duration::from_millis(500);
            // The bucket has versioning (as the template's): every version is an event, named
            // by its version id. Every page: S3 (and moto) answer 1,000 versions at most.
            if let Ok(versions) = onoff_aws::objects::list_versions(&clients.s3, &res.bucket, "jobs/", 1000).await {
                let slice = Instant::now();
                for o in &versions {
                    if slice.elapsed() >= EVENT_SLICE {
                        // The rest next pass (not yet seen): the machines have their turn.
                        break;
                    }
                    let (Some(key), Some(etag)) = (o.key(), o.e_tag()) else {
                        continue;
                    };
                    let version = o.version_id().unwrap_or_default();
                    if !seen_keys.insert(format!("{key}#{etag}@{version}")) {
                        continue;
                    }
                    if let Some(t) = o.last_modified() {
                        put_at.insert(key.to_string(), t.as_secs_f64());
                    }
                    let mut ev: serde_json::Value = serde_json::from_str(S3_PUT).expect("sample parses");
                    let rec = &mut ev["Records"][0];
                    rec["eventTime"] = iso(unix_now()).into();
                    rec["s3"]["bucket"]["name"] = res.bucket.clone().into();
                    rec["s3"]["bucket"]["arn"] = format!("arn:aws:s3:::{}", res.bucket).into();
                    rec["s3"]["object"]["key"] = key.into();
                    rec["s3"]["object"]["eTag"] = etag.trim_matches('"').into();
                    rec["s3"]["object"]["size"] = o.size().unwrap_or(0).into();
                    rec["s3"]["object"]["versionId"] = match o.version_id() {
                        Some(v) if v != "null" => v.into(),
                        _ => serde_json::Value::Null,
                    };
                    let t = Instant::now();
                    let r = lambda
                        .invoke(Principal::Submit, ev, |ev| {
                            submit::handler::handle(&submit_ctx, &submit_clients, ev)
                        })
                        .await;
                    since_invocation_start(&asks, t);
                    invoke_err("submit", r, &mut report.handler_errors);
                }
            }
        }
        // After the pass's notifications, as the scaler starts while submit's next invocations
        // still run: asks made meanwhile join the pending request
        // (`onoff_fn_common::request_scale`) instead of each running the scaler in turn.
        serve_scale_requests!();
        // Lambda's SQS event source mapping on the submission queue: it polls with the
        // function's role, hands submit a batch of up to BatchSize records synchronously, and
        // deletes the records submit did not report failed (with ReportBatchItemFailures; without
        // it, every record of a batch submit returned from); a failed invocation deletes none.
        // What it leaves comes back after the visibility timeout, and SQS moves a message to the
        // dead-letter queue after maxReceiveCount.
        if let Some(source) = submission_source.as_ref().filter(|_| now >= next_sqs) {
            next_sqs = now + Duration::from_millis(500);
            let sqs = &submit_clients.clients.sqs;
            let received = sqs
                .receive_message()
                .queue_url(&submission_url)
                // One receive takes at most 10; Lambda gathers larger batches over several.
                .max_number_of_messages(source.batch_size.min(10) as i32)
                .message_system_attribute_names(aws_sdk_sqs::types::MessageSystemAttributeName::All)
                .message_attribute_names("All")
                .send()
                .await;
            match received {
                Ok(out) if !out.messages().is_empty() => {
                    let records: Vec<serde_json::Value> =
                        out.messages().iter().map(|m| sqs_record(m, &submission_arn)).collect();
                    let t = Instant::now();
                    let r = lambda
                        .invoke_sync(Principal::Submit, serde_json::json!({ "Records": records }), |ev| {
                            submit::handler::handle(&submit_ctx, &submit_clients, ev)
                        })
                        .await;
                    since_invocation_start(&asks, t);
                    report.submission_batches += 1;
                    let ids: Vec<&str> = out.messages().iter().filter_map(|m| m.message_id()).collect();
                    // A failed invocation, or an answer Lambda reads as a whole failure, deletes
                    // nothing: every record comes back.
                    let kept = match &r {
                        // Lambda reads no answer then: the batch succeeded whole.
                        Ok(_) if !source.report_batch_item_failures => Ok(BTreeSet::new()),
                        Ok(answer) => lambda::sqs_batch_item_failures(answer, &ids).map_err(|e| {
                            report.submission_batches_failed.push(e.clone());
                            tracing::error!(error = %e, "submit's batch answer fails the whole batch, as Lambda reads it");
                        }),
                        Err(_) => Err(()),
                    };
                    if let Ok(failed) = kept {
                        let done: Vec<_> = out
                            .messages()
                            .iter()
                            .filter(|m| !failed.contains(m.message_id().unwrap_or_default()))
                            .enumerate()
                            .filter_map(|(i, m)| {
                                aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                                    .id(i.to_string())
                                    .receipt_handle(m.receipt_handle().unwrap_or_default())
                                    .build()
                                    .ok()
                            })
                            .collect();
                        if !done.is_empty() {
                            let n = done.len();
                            match sqs
                                .delete_message_batch()
                                .queue_url(&submission_url)
                                .set_entries(Some(done))
                                .send()
                                .await
                            {
                                Ok(d) => report.submission_records_deleted += n - d.failed().len(),
                                Err(e) => {
                                    tracing::warn!(error = %aws_sdk_sqs::error::DisplayErrorContext(e), "the event source's delete failed; the records come back")
                                }
                            }
                        }
                    }
                    invoke_err("submit", r, &mut report.handler_errors);
                    serve_scale_requests!();
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %aws_sdk_sqs::error::DisplayErrorContext(e), "the event source's receive failed")
                }
            }
        }
        // The queue-depth alarm: ALARM while a lane has visible messages; EventBridge delivers the
        // state change to the scaler.
        if now >= next_alarm {
            next_alarm = now + Duration::from_secs(1);
            for l in &lanes {
                let Ok(b) = ctx.queues.backlog(l).await else { continue };
                let alarm = b.visible > 0;
                let was = alarm_state.insert(l.clone(), alarm).unwrap_or(false);
                if alarm && !was {
                    let mut ev: serde_json::Value = serde_json::from_str(ALARM).expect("sample parses");
                    ev["id"] = format!("local-alarm-{event_n}").into();
                    event_n += 1;
                    ev["time"] = iso(unix_now()).into();
                    ev["detail"]["alarmName"] = format!("{prefix}-{l}-backlog").into();
                    let r = lambda
                        .invoke(Principal::Scaler, ev, |ev| {
                            scaler::handler::handle(&scaler_ctx, &scaler_clients, ev)
                        })
                        .await;
                    invoke_err("scaler", r, &mut report.handler_errors);
                    onoff_aws::fleet::tag_as_ec2_does(&clients.ec2, &prefix, &res.launch_template).await;
                }
            }
        }
        // The reconciler's schedule.
        if now >= next_schedule {
            next_schedule = now + Duration::from_secs_f64(opts.tick_s);
            let mut ev: serde_json::Value = serde_json::from_str(SCHEDULE).expect("sample parses");
            ev["id"] = format!("local-schedule-{event_n}").into();
            event_n += 1;
            ev["time"] = iso(unix_now()).into();
            let r = lambda
                .invoke(Principal::Reconciler, ev, |ev| {
                    reconciler::handler::handle(&reconciler_ctx, &reconciler_clients, ev)
                })
                .await;
            if let Ok(summary) = &r {
                report.jobs_read_past_index += past_index(summary);
                report.wake_ups_resent += summary["jobs_woken"].as_array().map_or(0, Vec::len);
                report.wake_ups_spared += summary["wake_ups_spared"].as_u64().unwrap_or(0) as usize;
            }
            invoke_err("reconciler", r, &mut report.handler_errors);
            onoff_aws::fleet::tag_as_ec2_does(&clients.ec2, &prefix, &res.launch_template).await;
        }
        // EC2 events -> interruption.
        let slice = Instant::now();
        while slice.elapsed() < EVENT_SLICE {
            let Some(ev) = events.pop_front() else { break };
            let t = Instant::now();
            let r = lambda
                .invoke(Principal::Interruption, ev, |ev| {
                    interruption::handler::handle(&interruption_ctx, &interruption_clients, ev)
                })
                .await;
            since_invocation_start(&asks, t);
            invoke_err("interruption", r, &mut report.handler_errors);
            serve_scale_requests!();
        }
        // Lambda's retries of the events a function failed on, as they come due.
        for r in lambda.due(Instant::now()) {
            let (function, t) = (r.function, Instant::now());
            let out = match function {
                Principal::Scaler => {
                    lambda
                        .retry(r, |ev| scaler::handler::handle(&scaler_ctx, &scaler_clients, ev))
                        .await
                }
                Principal::Reconciler => {
                    lambda
                        .retry(r, |ev| {
                            reconciler::handler::handle(&reconciler_ctx, &reconciler_clients, ev)
                        })
                        .await
                }
                Principal::Interruption => {
                    lambda
                        .retry(r, |ev| {
                            interruption::handler::handle(&interruption_ctx, &interruption_clients, ev)
                        })
                        .await
                }
                Principal::Submit => {
                    lambda
                        .retry(r, |ev| submit::handler::handle(&submit_ctx, &submit_clients, ev))
                        .await
                }
                other => unreachable!("{} runs in no function", other.as_str()),
            };
            since_invocation_start(&asks, t);
            invoke_err(function.as_str(), out, &mut report.handler_errors);
            onoff_aws::fleet::tag_as_ec2_does(&clients.ec2, &prefix, &res.launch_template).await;
            serve_scale_requests!();
        }
        // The events given up on: to the failed-events queue, sent with the function's own role.
        for dead in lambda.take_dead_letters() {
            let sqs = match dead.function {
                Principal::Scaler => &scaler_clients.sqs,
                Principal::Reconciler => &reconciler_clients.sqs,
                Principal::Interruption => &interruption_clients.clients.sqs,
                Principal::Submit => &submit_clients.clients.sqs,
                other => unreachable!("{} runs in no function", other.as_str()),
            };
            let function = dead.function.as_str();
            match dead.send(sqs, &failed_events_url).await {
                Ok(()) => {
                    tracing::warn!(%function, request_id = %dead.request_id, error = %dead.error_message, "an event failed past its retries: sent to the failed-events queue");
                    report.dead_letters.push(dead);
                }
                Err(e) => {
                    tracing::error!(%function, request_id = %dead.request_id, error = %e, "the dead-letter send failed: the event is lost");
                    report
                        .dead_letter_errors
                        .push(format!("{function} {}: {e}", dead.request_id));
                }
            }
        }
        // The instance runner.
        if now >= next_fleet {
            next_fleet = now + Duration::from_millis(250);
            if let Ok(present) = fleet.describe_managed().await {
                if let Some(q) = &quotas {
                    q.set_instances(present.iter().map(|i| {
                        (
                            i.instance_id.as_str(),
                            i.instance_type.as_str(),
                            i.capacity_type,
                            i.state.as_str(),
                        )
                    }));
                }
                let present_ids: BTreeSet<String> = present.iter().map(|i| i.instance_id.clone()).collect();
                // Stops and starts, as the machine sees them: a stop shuts its agent down (and EC2
                // tells the interruption handler), a start boots it again.
                for i in &present {
                    let Some(inst) = instances.get_mut(&i.instance_id).filter(|x| x.ended_at.is_none()) else {
                        continue;
                    };
                    let stopped = matches!(i.state.as_str(), "stopping" | "stopped");
                    if stopped && inst.stopped_at.is_none() {
                        inst.stop();
                        inst.billed_s += (now - inst.seen_at).as_secs_f64();
                        inst.stopped_at = Some(now);
                        events.push_back(ec2_event(
                            STATE_CHANGE,
                            &i.instance_id,
                            &[("state", "stopped")],
                            event_n,
                        ));
                        event_n += 1;
                        report.instances_stopped += 1;
                    } else if !stopped && inst.stopped_at.is_some() {
                        inst.stopped_at = None;
                        inst.seen_at = now;
                        inst.restarted = true;
                        if let Some(mut a) = inst.agent.take() {
                            // Down with the stop; reaped before its successor starts.
                            let _ = a.child.start_kill();
                            let _ = a.child.wait().await;
                        }
                        report.instances_started += 1;
                    }
                }
                for i in &present {
                    instances.entry(i.instance_id.clone()).or_insert_with(|| Inst {
                        instance_type: i.instance_type.clone(),
                        zone: i.zone.clone(),
                        capacity: i.capacity_type,
                        lane: i.lane.clone().unwrap_or_else(|| lane.clone()),
                        seen_at: now,
                        ended_at: None,
                        stopped_at: None,
                        restarted: false,
                        billed_s: 0.0,
                        agent: None,
                        imds: None,
                        faulted: false,
                        reclaim_at: None,
                    });
                }
                for (id, inst) in &mut instances {
                    if inst.ended_at.is_some() {
                        continue;
                    }
                    if !present_ids.contains(id) {
                        // Terminated in the emulator: the machine is gone, and EC2 says so. Its
                        // agent may have ended it, from its own process: from now on a stop or
                        // start of it is refused as EC2 refuses it (moto would bring it back).
                        onoff_aws::limits::record_terminated([id.clone()]);
                        inst.kill();
                        inst.ended_at = Some(now);
                        events.push_back(ec2_event(STATE_CHANGE, id, &[("state", "terminated")], event_n));
                        event_n += 1;
                        continue;
                    }
                    let boot_s = if inst.restarted { opts.restart_s } else { opts.boot_s };
                    if inst.agent.is_none()
                        && inst.stopped_at.is_none()
                        && now - inst.seen_at >= Duration::from_secs_f64(boot_s)
                    {
                        let imds = ImdsExtras {
                            gpus: gpus_of.get(&inst.instance_type).copied(),
                            credentials: sessions
                                .as_ref()
                                .map(|s| (s.worker.role_name().to_string(), s.worker.imds_json())),
                            refuse_uid: job_uid,
                            setpriv: setpriv.clone(),
                        };
                        let agent = start_agent(&opts.agent_bin, id, inst, &agent_env, run_dir, &attempts, imds).await;
                        match agent {
                            Ok((a, imds)) => {
                                inst.agent = Some(a);
                                inst.imds = Some(imds);
                            }
                            Err(e) => tracing::error!(instance = %id, error = %e, "start agent"),
                        }
                    }
                    if inst.reclaim_at.is_some_and(|t| now >= t) {
                        inst.reclaim_at = None;
                        let _ = clients.ec2.terminate_instances().instance_ids(id).send().await;
                    }
                }
            }
        }
        // Faults: only busy workers (their jobs are what a fault puts at risk), each at most once.
        // Not drawn at random: a fault is due every 1/rate busy-worker-minutes (the first after
        // half that), so a run of a given length sees the faults its rates promise; the seed
        // picks which worker takes it.
        if now >= next_faults {
            let dt = (now - next_faults).as_secs_f64() + 1.0;
            next_faults = now + Duration::from_secs(1);
            // (instance, whether it is spot): EC2 sends spot interruption notices to spot
            // instances only; any instance may die.
            let mut eligible: Vec<(String, bool)> = instances
                .iter()
                .filter(|(id, i)| {
                    i.ended_at.is_none()
                        && !i.faulted
                        && i.agent.is_some()
                        && worker_states.get(*id) == Some(&WorkerState::Running)
                })
                .map(|(id, i)| (id.clone(), i.capacity == CapacityType::Spot))
                .collect();
            let spot_busy = eligible.iter().filter(|(_, spot)| *spot).count();
            notices_due += opts.spot_notices * spot_busy as f64 * dt / 60.0;
            kills_due += opts.kill_workers * eligible.len() as f64 * dt / 60.0;
            // The next worker to take a fault of a kind whose fault is due (a spot one for a
            // notice).
            let mut take = |due: &mut f64, spot_only: bool| {
                let candidates: Vec<usize> = (0..eligible.len()).filter(|&k| !spot_only || eligible[k].1).collect();
                (*due >= 1.0 && !candidates.is_empty()).then(|| {
                    *due -= 1.0;
                    let k = candidates[rng.random_range(0..candidates.len())];
                    eligible.swap_remove(k).0
                })
            };
            while let Some(id) = take(&mut notices_due, true) {
                let inst = instances.get_mut(&id).expect("eligible instance exists");
                inst.faulted = true;
                report.spot_notices_sent += 1;
                if let Some(imds) = &inst.imds {
                    imds.spot_notice(&iso(unix_now() + opts.notice_lead_s));
                }
                events.push_back(ec2_event(
                    SPOT_WARNING,
                    &id,
                    &[("instance-action", "terminate")],
                    event_n,
                ));
                event_n += 1;
                inst.reclaim_at = Some(now + Duration::from_secs_f64(opts.notice_lead_s));
                tracing::info!(instance = %id, "injected a spot interruption notice");
            }
            while let Some(id) = take(&mut kills_due, false) {
                let inst = instances.get_mut(&id).expect("eligible instance exists");
                inst.faulted = true;
                report.workers_killed += 1;
                inst.kill();
                let _ = clients.ec2.terminate_instances().instance_ids(&id).send().await;
                tracing::info!(instance = %id, "killed a worker without notice");
            }
        }
        // Monitor, progress, and the end.
        if now >= next_monitor {
            next_monitor = now + Duration::from_millis(500);
            if let Ok(live) = ctx.workers.list_live().await {
                worker_states = live.items.iter().map(|w| (w.id.clone(), w.state)).collect();
            }
            job_states = scan_jobs(&clients, &res.jobs_table, &job_ids)
                .await
                .unwrap_or(job_states);
            let mut p = Progress {
                submitted: report.jobs_submitted,
                to_submit,
                elapsed_s: (now - started).as_secs_f64(),
                phase,
                ..Progress::default()
            };
            for st in job_states.values() {
                match st {
                    JobState::Queued | JobState::Retrying => p.queued += 1,
                    JobState::Running => p.running += 1,
                    _ => p.done += 1,
                }
            }
            for (id, inst) in &instances {
                if inst.ended_at.is_some() {
                    continue;
                }
                let state = match (inst.agent.is_some(), worker_states.get(id)) {
                    (false, _) => "booting".to_string(),
                    (true, Some(s)) => format!("{s:?}").to_lowercase(),
                    (true, None) => "gone".to_string(),
                };
                *p.workers.entry(state).or_default() += 1;
            }
            p.usd = cost(&instances, &ctx.workers, now, opts.compress).await;
            on_progress(&p);
            let all_final =
                pending.is_empty() && job_states.len() == job_ids.len() && job_states.values().all(|s| s.is_final());
            let live_instances = instances.values().filter(|i| i.ended_at.is_none()).count();
            if !opts.serve && drain_started.is_none() && (all_final || elapsed > opts.timeout_s) {
                drain_started = Some(now);
                phase = "draining";
            }
            if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
                tracing::warn!("interrupted: cleaning up");
                report.interrupted = true;
                report.instances_left_running = live_instances;
                break;
            }
            if let Some(d) = drain_started {
                // Done when no instance is left, every EC2 event is delivered and Lambda holds
                // no event for a retry.
                let settled = live_instances == 0
                    && events.is_empty()
                    && lambda.pending_retries() == 0
                    && queue_empty(&clients.sqs, &submission_url).await;
                if settled || now - d >= Duration::from_secs_f64(opts.drain_s) {
                    report.instances_left_running = live_instances;
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    report.events_undelivered = events.len();
    if !events.is_empty() {
        tracing::warn!(
            left = events.len(),
            "EC2 events never delivered to the interruption function before the run ended"
        );
    }
    // Clean up: nothing left running, in the emulator or on this machine.
    on_progress(&Progress {
        phase: "cleaning up",
        elapsed_s: started.elapsed().as_secs_f64(),
        ..Progress::default()
    });
    let end = Instant::now();
    let left: Vec<String> = instances
        .iter()
        .filter(|(_, i)| i.ended_at.is_none())
        .map(|(id, _)| id.clone())
        .collect();
    // TerminateInstances takes 1,000 ids at most (onoff_aws::limits::MAX_TERMINATE_IDS).
    for batch in left.chunks(onoff_aws::limits::MAX_TERMINATE_IDS) {
        let _ = clients
            .ec2
            .terminate_instances()
            .set_instance_ids(Some(batch.to_vec()))
            .send()
            .await;
    }
    for inst in instances.values_mut() {
        inst.kill();
        if let Some(a) = &mut inst.agent {
            let _ = a.child.wait().await;
        }
        inst.ended_at.get_or_insert(end);
    }

    // The report.
    let final_states = scan_jobs(&clients, &res.jobs_table, &job_ids)
        .await
        .unwrap_or(job_states);
    report.jobs_succeeded = final_states.values().filter(|s| **s == JobState::Succeeded).count();
    report.jobs_failed = final_states.values().filter(|s| **s == JobState::Failed).count();
    report.rejected = scan_rejections(&clients, &res.jobs_table, &res.bucket, &put_at)
        .await
        .unwrap_or_default();
    report.jobs_rejected = replay_keys
        .iter()
        .filter(|k| {
            report
                .rejected
                .iter()
                .any(|r| r.source.contains(&format!("/{k}?")) || r.source.contains(&format!("/{k}#")))
        })
        .count();
    report.jobs_lost = report
        .jobs_submitted
        .saturating_sub(report.jobs_succeeded + report.jobs_failed + report.jobs_rejected);
    report.instances_launched = instances.len();
    report.zones_launched_in = instances
        .values()
        .map(|i| i.zone.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let lines = attempts.lock().expect("lock").clone();
    let mut completions: BTreeMap<&str, usize> = BTreeMap::new();
    let mut resumed: BTreeSet<&str> = BTreeSet::new();
    let mut first_start: BTreeMap<&str, f64> = BTreeMap::new();
    for l in &lines {
        if l.completed {
            *completions.entry(&l.job_id).or_default() += 1;
        }
        if l.resumed {
            resumed.insert(&l.job_id);
        }
        let e = first_start.entry(&l.job_id).or_insert(l.started_at);
        *e = e.min(l.started_at);
    }
    report.duplicate_completions = completions.values().map(|n| n.saturating_sub(1)).sum();
    report.lanes = lanes.iter().map(|l| (l.clone(), LaneFigures::default())).collect();
    for (job, lane) in &job_lanes {
        let f = report.lanes.entry(lane.clone()).or_default();
        f.jobs += 1;
        f.succeeded += usize::from(final_states.get(job) == Some(&JobState::Succeeded));
    }
    for i in instances.values() {
        report.lanes.entry(i.lane.clone()).or_default().instances += 1;
    }
    report.attempts_off_lane = lines
        .iter()
        .filter(|l| job_lanes.get(&l.job_id).is_some_and(|lane| *lane != l.worker_lane))
        .count();
    report.resumed_from_checkpoint = resumed.len();
    report.attempts = lines.len();
    report.attempts_with_warm_cache = lines.iter().filter(|l| l.cache_warm).count();
    let mut waits: Vec<f64> = first_start
        .iter()
        .filter_map(|(id, t)| submitted_at.get(*id).map(|s| (t - s).max(0.0) * opts.compress))
        .collect();
    waits.sort_by(f64::total_cmp);
    report.wait_p50_s = percentile(&waits, 0.5);
    report.wait_p95_s = percentile(&waits, 0.95);
    report.total_usd = cost(&instances, &ctx.workers, end, opts.compress).await;
    report.usd_per_job = if report.jobs_succeeded > 0 {
        report.total_usd / report.jobs_succeeded as f64
    } else {
        0.0
    };
    report.functions = lambda.runs();
    report.handler_timeouts = lambda.timed_out();
    report.retries_pending = lambda.pending_retries();
    report.events_delivered_twice = report.functions.iter().map(|f| f.delivered_twice).sum();
    match receive_all(&clients.sqs, &submission_dlq_url).await {
        Ok(messages) => {
            let ids: BTreeSet<String> = messages
                .iter()
                .filter_map(|m| m.message_id().map(str::to_string))
                .collect();
            report.submission_dead_letters = ids.into_iter().collect();
        }
        Err(e) => tracing::warn!(error = %e, "reading the submission dead-letter queue"),
    }
    report.malformed_events_sent = malformed_sent;
    report.failed_events_read_back =
        match read_dead_letters(&clients.sqs, &failed_events_url, &report.dead_letters).await {
            Ok(n) => n,
            Err(e) => {
                report
                    .dead_letter_errors
                    .push(format!("reading the failed-events queue back: {e}"));
                0
            }
        };
    ask_latencies.sort_by(f64::total_cmp);
    report.scale_requests_served = ask_latencies.len();
    {
        use onoff_control::ports::Lease;
        let control = onoff_aws::state::DynamoControl::new(clients.dynamodb.clone(), res.control_table.clone());
        report.scale_asks = control
            .asks(onoff_control::reconcile::RECONCILE_LEASE)
            .await
            .ok()
            .map(|a| a.count);
    }
    report.scale_request_latency_p50_s = percentile(&ask_latencies, 0.5);
    report.scale_request_latency_max_s = ask_latencies.last().copied().unwrap_or(0.0);
    // Every component's calls: the refused ones are IAM's verdict on the template's policies.
    let calls = onoff_aws::record::read_log(&call_log_path).unwrap_or_default();
    report.calls_recorded = calls.len();
    // 403: a policy denies; 401: a signature or credentials the emulator did not accept (EC2's
    // AuthFailure). Either way the call did not happen.
    let denied: Vec<&onoff_aws::record::CallRecord> =
        calls.iter().filter(|c| c.status == 403 || c.status == 401).collect();
    report.access_denied = denied.len();
    if let Some(q) = &quotas {
        report.launches_refused_for_quota = q.refused();
        report.vcpu_quotas = q
            .peaks()
            .into_iter()
            .map(|((bucket, cap), limit, peak)| QuotaPlayed {
                quota: bucket.name(cap),
                code: bucket.code(cap).map(str::to_string),
                limit_vcpus: limit,
                peak_vcpus: peak,
            })
            .collect();
    }
    // A lost answer is recorded as the write's HTTP 500 (moto itself answers none of them so).
    report.answers_lost = calls
        .iter()
        .filter(|c| {
            c.service == "dynamodb" && c.status == 500 && onoff_aws::faults::WRITES.contains(&c.operation.as_str())
        })
        .count();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for c in &denied {
        *kinds
            .entry(format!("{}: {}:{}", c.principal, c.service, c.operation))
            .or_default() += 1;
    }
    report.denied_calls = kinds.into_iter().take(20).map(|(k, n)| format!("{k} ({n}x)")).collect();
    report.job_user = job_uid;
    report.agent_capabilities = setpriv
        .as_ref()
        .map(|_| AGENT_CAPABILITIES.iter().map(|c| c.to_string()).collect());
    // The same calls against the template's full policies (conditions, session and resource
    // policies), which moto does not evaluate.
    if let (Some(stack), Some(s)) = (&iam_stack, &sessions) {
        let world = world_of(&clients, &res, s).await;
        let text = std::fs::read_to_string(&call_log_path).unwrap_or_default();
        let recorded = onoff_iam::calls::parse_log(&text);
        report.policy_check = Some(iam::check_calls(&recorded, stack, &world, &s.local_callers())?);
    }
    if sessions.is_some() && opts.endpoint.is_some() {
        // A shared emulator: leave it as it was found.
        if let Err(e) = iam::enforce(endpoint, false).await {
            tracing::warn!(error = %e, "could not turn IAM enforcement off again");
        }
    }
    report.wall_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// What the evaluation of recorded calls needs to know of the run: every instance's tags (the
/// emulator lists terminated instances too), the launch template, the worker role.
async fn world_of(
    clients: &Clients,
    res: &onoff_aws::settings::Resources,
    s: &iam::LocalSessions,
) -> onoff_iam::calls::World {
    let mut world = onoff_iam::calls::World {
        worker_role_arn: s.worker.role_arn.clone(),
        ..onoff_iam::calls::World::default()
    };
    world
        .launch_templates
        .insert(res.launch_template.clone(), res.launch_template.clone());
    let mut pages = clients.ec2.describe_instances().into_paginator().send();
    while let Some(Ok(page)) = pages.next().await {
        for r in page.reservations() {
            for i in r.instances() {
                let tags = i
                    .tags()
                    .iter()
                    .filter_map(|t| Some((t.key()?.to_string(), t.value()?.to_string())))
                    .collect();
                world
                    .instance_tags
                    .insert(i.instance_id().unwrap_or_default().to_string(), tags);
            }
        }
    }
    world
}

/// The error records of the jobs table, timed against the puts of their S3 objects.
async fn scan_rejections(
    clients: &Clients,
    table: &str,
    bucket: &str,
    put_at: &BTreeMap<String, f64>,
) -> Result<Vec<Rejected>, String> {
    let mut out = Vec::new();
    let mut pages = clients
        .dynamodb
        .scan()
        .table_name(table)
        .filter_expression("begins_with(job_id, :e)")
        .expression_attribute_values(":e", aws_sdk_dynamodb::types::AttributeValue::S("error#".into()))
        .consistent_read(true)
        .into_paginator()
        .send();
    let prefix = format!("s3://{bucket}/");
    while let Some(page) = pages.next().await {
        let page = page.map_err(|e| e.to_string())?;
        for item in page.items() {
            let text = |k: &str| item.get(k).and_then(|v| v.as_s().ok()).cloned().unwrap_or_default();
            let source = text("job_id").trim_start_matches("error#").to_string();
            let created = item
                .get("created_at")
                .and_then(|v| v.as_n().ok())
                .and_then(|n| n.parse::<f64>().ok());
            let key = source
                .strip_prefix(&prefix)
                .map(|rest| rest.split(['?', '#']).next().unwrap_or(rest));
            let after_s = match (key.and_then(|k| put_at.get(k)), created) {
                (Some(put), Some(c)) => Some((c - put).max(0.0)),
                _ => None,
            };
            out.push(Rejected {
                source,
                reason: text("reason"),
                after_s,
            });
        }
    }
    out.sort_by(|a, b| a.source.cmp(&b.source));
    Ok(out)
}

/// The policy as TOML for `ONOFF_POLICY`.
fn toml_of(p: &PolicyConfig) -> anyhow::Result<String> {
    toml::to_string(p).context("policy to TOML")
}

/// $ of every instance so far: the workers table's price × lifetime × `compress`.
async fn cost<W: WorkerRegistry>(instances: &BTreeMap<String, Inst>, workers: &W, now: Instant, compress: f64) -> f64 {
    let mut usd = 0.0;
    for (id, i) in instances {
        let price = match workers.get(id).await {
            Ok(Some(w)) => w.price_usd_per_h,
            _ => 0.0,
        };
        usd += price * i.billed_s(now) * compress / 3600.0;
    }
    usd
}

/// State of each of `ids` in the jobs table (ids not yet written are absent).
/// States of the jobs `ids` (every job when `ids` is empty: a serving stack's).
/// A record of Lambda's SQS event as the event source mapping builds it from a received message
/// (events/sqs-submission-batch.json).
fn sqs_record(m: &aws_sdk_sqs::types::Message, queue_arn: &str) -> serde_json::Value {
    let attributes: serde_json::Map<String, serde_json::Value> = m
        .attributes()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.as_str().to_string(), v.clone().into()))
        .collect();
    serde_json::json!({
        "messageId": m.message_id(),
        "receiptHandle": m.receipt_handle(),
        "body": m.body(),
        "attributes": attributes,
        "messageAttributes": {},
        "md5OfBody": m.md5_of_body(),
        "eventSource": "aws:sqs",
        "eventSourceARN": queue_arn,
        "awsRegion": "us-east-1",
    })
}

/// The queue holds no message, visible or in flight (`ApproximateNumberOfMessages` and
/// `...NotVisible` both 0); false when it cannot be read.
async fn queue_empty(sqs: &aws_sdk_sqs::Client, url: &str) -> bool {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let Ok(out) = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(A::ApproximateNumberOfMessages)
        .attribute_names(A::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
    else {
        return false;
    };
    let n = |a: A| out.attributes().and_then(|m| m.get(&a)).map(String::as_str);
    n(A::ApproximateNumberOfMessages) == Some("0") && n(A::ApproximateNumberOfMessagesNotVisible) == Some("0")
}

/// Every message in queue `url`, read to its end with its message attributes (each hidden for 5
/// minutes, so none is read twice).
///
/// # Errors
/// A receive failed.
async fn receive_all(sqs: &aws_sdk_sqs::Client, url: &str) -> Result<Vec<aws_sdk_sqs::types::Message>, String> {
    let mut all = Vec::new();
    loop {
        let out = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(300)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| aws_sdk_sqs::error::DisplayErrorContext(e).to_string())?;
        if out.messages().is_empty() {
            return Ok(all);
        }
        all.extend(out.messages().iter().cloned());
    }
}

/// Read the failed-events queue to its end: how many of `sent` it holds, each found by its
/// `RequestID` attribute with `ErrorCode` 200, its `ErrorMessage` and its event as the body.
///
/// # Errors
/// A receive failed, or the queue holds a message none of `sent` is, or one without the
/// attributes Lambda sets.
async fn read_dead_letters(sqs: &aws_sdk_sqs::Client, url: &str, sent: &[DeadLetter]) -> Result<usize, String> {
    let mut found = BTreeSet::new();
    for m in receive_all(sqs, url).await? {
        let attr = |k: &str| {
            m.message_attributes().and_then(|a| a.get(k)).map(|v| {
                (
                    v.data_type().to_string(),
                    v.string_value().unwrap_or_default().to_string(),
                )
            })
        };
        let request_id = attr("RequestID").map(|a| a.1).unwrap_or_default();
        let Some(d) = sent.iter().find(|d| d.request_id == request_id) else {
            return Err(format!("a message no function sent: RequestID {request_id:?}"));
        };
        if attr("ErrorCode") != Some(("Number".into(), "200".into()))
            || attr("ErrorMessage").map(|a| a.1).as_deref() != Some(d.error_message.as_str())
        {
            return Err(format!(
                "{request_id}: not the attributes Lambda sets: {:?}",
                m.message_attributes()
            ));
        }
        let body: serde_json::Value = serde_json::from_str(m.body().unwrap_or_default())
            .map_err(|e| format!("{request_id}: the body is not the event: {e}"))?;
        if body != d.event {
            return Err(format!("{request_id}: the body is not its event: {body}"));
        }
        found.insert(request_id);
    }
    Ok(found.len())
}

async fn scan_jobs(
    clients: &Clients,
    table: &str,
    ids: &BTreeSet<String>,
) -> Result<BTreeMap<String, JobState>, String> {
    let mut out = BTreeMap::new();
    let mut pages = clients
        .dynamodb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .send();
    while let Some(page) = pages.next().await {
        let page = page.map_err(|e| e.to_string())?;
        for item in page.items() {
            let Some(id) = item.get("job_id").and_then(|v| v.as_s().ok()) else {
                continue;
            };
            if id.starts_with("error#") || (!ids.is_empty() && !ids.contains(id)) {
                continue;
            }
            if let Some(st) = item
                .get("state")
                .and_then(|v| v.as_s().ok())
                .and_then(|s| JobState::parse(s))
            {
                out.insert(id.clone(), st);
            }
        }
    }
    Ok(out)
}

/// Date the scale requests made since `t` (an invocation's start) at `t`.
fn since_invocation_start(asks: &Mutex<Vec<(Instant, String)>>, t: Instant) {
    for (at, _) in asks.lock().expect("lock").iter_mut() {
        if *at >= t {
            *at = t;
        }
    }
}

/// A function's clients in the local stack, where an asynchronous invoke of the scaler is a
/// request the run loop serves at once (moto runs no functions).
struct Asking {
    clients: Clients,
    asks: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl onoff_fn_common::ObjectReader for Asking {
    async fn size(&self, obj: &onoff_fn_common::ObjectRef) -> Result<u64, onoff_fn_common::ObjectError> {
        self.clients.size(obj).await
    }
    async fn read(&self, obj: &onoff_fn_common::ObjectRef) -> Result<Vec<u8>, onoff_fn_common::ObjectError> {
        self.clients.read(obj).await
    }
}

impl onoff_fn_common::ScalerTrigger for Asking {
    async fn ask_scaler(&self, reason: &str) -> Result<(), String> {
        self.asks
            .lock()
            .expect("lock")
            .push((Instant::now(), reason.to_string()));
        Ok(())
    }
}

/// The user jobs run as when `onoff local` runs as root (the worker image's `onoff-job`).
pub const LOCAL_JOB_UID: u32 = 10002;

/// The capabilities template.yaml's user data gives the agent's container (`--user 0:0
/// --cap-drop ALL --cap-add ...`): starting each job as its own user (SETUID, SETGID), signalling
/// it (KILL), handing it its work dir (CHOWN) and reading and hard-linking its files
/// (DAC_OVERRIDE, FOWNER).
pub const AGENT_CAPABILITIES: [&str; 6] = ["setuid", "setgid", "kill", "chown", "fowner", "dac_override"];

/// What the worker image's `ENV` (worker-image/Dockerfile) gives its agent, less what names a
/// path of the image (`PATH`, `VIRTUAL_ENV`, `ONOFF_WORK_DIR`): a local agent starts with these,
/// as the container's agent does, and its jobs inherit them as they would there.
pub const IMAGE_ENV: [(&str, &str); 2] = [("PYTHONUNBUFFERED", "1"), ("PYTHONDONTWRITEBYTECODE", "1")];

/// This machine's variables a local agent keeps (when set): what finds programs and what reads
/// text and time. A container's agent gets nothing of its host's environment (template.yaml's
/// `docker run` passes only `--env-file`), so a local agent gets nothing else of this one's: no
/// `HOME` (the SDK reads no profile of this machine's), none of the shell's or CI's variables,
/// which its jobs would otherwise inherit.
pub const HOST_ENV_KEPT: [&str; 6] = ["PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "RUST_BACKTRACE"];

/// How a local agent is started with the privileges of the worker's container, as root with
/// only [`AGENT_CAPABILITIES`] and no new privileges (`--security-opt no-new-privileges`):
/// util-linux's `setpriv`, with the bounding set cut to those capabilities, so what the agent
/// does that needs more fails here as it would on a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setpriv {
    /// `setpriv`, found on `PATH`.
    pub program: std::path::PathBuf,
    /// Its arguments, up to the agent's program.
    pub args: Vec<String>,
}

/// [`Setpriv`] when the agent runs as root with a job user (`as_root`), as on a worker, and
/// `setpriv` is on `PATH`; `None` otherwise (the agent then runs with this process's
/// privileges, and a warning says so once).
pub fn container_privileges(as_root: bool) -> Option<Setpriv> {
    if !as_root {
        return None;
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("setpriv"))
            .find(|p| p.is_file())
    });
    let Some(program) = found else {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!("setpriv (util-linux) is not on PATH: the agents run with every privilege of this process, not only the worker container's capabilities");
        });
        return None;
    };
    let caps: Vec<String> = AGENT_CAPABILITIES.iter().map(|c| format!("+{c}")).collect();
    Some(Setpriv {
        program,
        args: vec![
            format!("--bounding-set=-all,{}", caps.join(",")),
            "--inh-caps=-all".into(),
            "--no-new-privs".into(),
            "--".into(),
        ],
    })
}

/// The worker image's agent user (`onoff`, worker-image/Dockerfile), which owns the work dir
/// template.yaml's user data makes (`install -d -o 10001 -g 10001 -m 0750 /var/lib/onoff`).
pub const LOCAL_AGENT_UID: u32 = 10001;

/// Whether this process can start jobs as another user (it runs as root).
#[must_use]
pub fn can_switch_user() -> bool {
    nix::unistd::geteuid().is_root()
}

/// What an instance has beyond its identity.
struct ImdsExtras {
    /// GPUs of its type (`ONOFF_GPUS`; on EC2 the user data counts them).
    gpus: Option<u32>,
    /// The worker role's name and session its IMDS serves (`iam/security-credentials/<role>`).
    credentials: Option<(String, String)>,
    /// The job user, refused by its IMDS.
    refuse_uid: Option<u32>,
    /// How its agent is started with the worker container's privileges ([`container_privileges`]).
    setpriv: Option<Setpriv>,
}

/// Start an instance's IMDS and its agent process (in its own process group, so a kill takes the
/// job with it, as a dying machine would).
async fn start_agent(
    bin: &std::path::Path,
    id: &str,
    inst: &Inst,
    env: &[(String, String)],
    run_dir: &std::path::Path,
    attempts: &Arc<Mutex<Vec<AttemptLine>>>,
    extras: ImdsExtras,
) -> anyhow::Result<(Agent, ImdsServer)> {
    let imds = ImdsServer::start(ImdsState {
        credentials: extras.credentials,
        refuse_uid: extras.refuse_uid,
        instance_id: id.to_string(),
        instance_type: inst.instance_type.clone(),
        zone: inst.zone.clone(),
        lifecycle: match inst.capacity {
            CapacityType::Spot => "spot".into(),
            CapacityType::OnDemand => "on-demand".into(),
        },
        spot_action: None,
        rebalance: None,
    })
    .await?;
    let work = run_dir.join("workers").join(id);
    if !work.exists() {
        std::fs::create_dir_all(&work)?;
        if extras.refuse_uid.is_some() {
            // As template.yaml's user data made it on a worker until 2026-12 (it makes it 0711
            // now; a stopped worker's volume keeps the old mode): the agent user's (10001), mode
            // 0750, so an agent that does not open it to its jobs' user fails their starts here.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o750))?;
            std::os::unix::fs::chown(&work, Some(LOCAL_AGENT_UID), Some(LOCAL_AGENT_UID))?;
        }
    }
    // Appended to: a stopped instance's agent starts again, and its earlier log stays.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join("workers").join(format!("{id}.log")))?;
    let mut cmd = match extras.setpriv {
        Some(setpriv) => {
            let mut c = tokio::process::Command::new(setpriv.program);
            c.args(&setpriv.args).arg(bin);
            c
        }
        None => tokio::process::Command::new(bin),
    };
    cmd.env_clear()
        .envs(
            HOST_ENV_KEPT
                .iter()
                .filter_map(|k| std::env::var_os(k).map(|v| (*k, v))),
        )
        .envs(IMAGE_ENV);
    if let Some(g) = extras.gpus {
        cmd.env("ONOFF_GPUS", g.to_string());
    }
    let mut child = cmd
        .arg("run")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.endpoint)
        .env("ONOFF_WORK_DIR", &work)
        .env("ONOFF_LANES", &inst.lane)
        .env("ONOFF_PRINCIPAL", format!("worker/{id}"))
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("start onoff-agent")?;
    let pgid = child.id().map(|p| p as i32);
    if let Some(out) = child.stdout.take() {
        let attempts = attempts.clone();
        let worker_lane = inst.lane.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(out).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) else {
                    continue;
                };
                let Some(job_id) = v["JobId"].as_str() else { continue };
                attempts.lock().expect("lock").push(AttemptLine {
                    job_id: job_id.to_string(),
                    worker_lane: worker_lane.clone(),
                    completed: v["Completed"].as_bool().unwrap_or(false),
                    resumed: !v["ResumedFrom"].is_null(),
                    started_at: v["StartedAt"].as_f64().unwrap_or(0.0),
                    cache_warm: v["CacheBytesAtStart"].as_u64().is_some_and(|b| b > 0),
                });
            }
        });
    }
    Ok((Agent { child, pgid }, imds))
}

#[cfg(test)]
mod container_tests {
    use super::*;

    /// The local agents get the capabilities template.yaml's user data gives the agent's
    /// container, no more and no fewer, so the two cannot drift apart.
    #[test]
    fn the_local_agents_capabilities_are_the_worker_containers() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../template.yaml");
        let template = std::fs::read_to_string(path).unwrap();
        let run = template
            .lines()
            .find(|l| l.contains("ExecStart=/usr/bin/docker run"))
            .expect("the agent unit's docker run");
        let words: Vec<&str> = run.split_whitespace().collect();
        let after = |flag: &str| -> Vec<String> {
            words
                .windows(2)
                .filter(|w| w[0] == flag)
                .map(|w| w[1].to_ascii_lowercase())
                .collect()
        };
        assert_eq!(after("--cap-drop"), ["all"]);
        assert_eq!(after("--user"), ["0:0"]);
        assert_eq!(after("--security-opt"), ["no-new-privileges"]);
        let mut added = after("--cap-add");
        added.sort();
        let mut ours: Vec<String> = AGENT_CAPABILITIES.iter().map(|c| c.to_string()).collect();
        ours.sort();
        assert_eq!(added, ours);
    }

    #[test]
    fn the_local_agents_image_env_is_the_worker_images() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../worker-image/Dockerfile");
        let dockerfile = std::fs::read_to_string(path).unwrap();
        // The runtime stage's ENV instruction, its continuation lines joined.
        let runtime = &dockerfile[dockerfile.rfind("\nFROM ").expect("a runtime stage")..];
        let start = runtime.find("\nENV ").expect("an ENV") + 5;
        let mut text = String::new();
        for line in runtime[start..].lines() {
            let l = line.trim();
            text.push_str(l.trim_end_matches('\\'));
            text.push(' ');
            if !l.ends_with('\\') {
                break;
            }
        }
        let mut set: Vec<(String, String)> = text
            .split_whitespace()
            .map(|kv| kv.split_once('=').expect("KEY=value"))
            .filter(|(k, _)| !["PATH", "VIRTUAL_ENV", "ONOFF_WORK_DIR"].contains(k))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        set.sort();
        let mut ours: Vec<(String, String)> = IMAGE_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ours.sort();
        assert_eq!(set, ours);
    }

    /// Under `setpriv`, a root process has exactly those capabilities (CapEff of
    /// /proc/self/status: CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, KILL 5, SETGID 6, SETUID 7) and no
    /// new privileges.
    #[test]
    fn setpriv_leaves_a_root_process_only_the_containers_capabilities() {
        assert!(container_privileges(false).is_none());
        let Some(sp) = container_privileges(can_switch_user()) else {
            eprintln!("not root, or no setpriv: nothing to check here");
            return;
        };
        let out = std::process::Command::new(&sp.program)
            .args(&sp.args)
            .args(["grep", "-E", "^(CapEff|CapBnd|NoNewPrivs)", "/proc/self/status"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        assert_eq!(u64::from_str_radix(&field("CapEff:"), 16).unwrap(), 0xeb, "{text}");
        assert_eq!(u64::from_str_radix(&field("CapBnd:"), 16).unwrap(), 0xeb, "{text}");
        assert_eq!(field("NoNewPrivs:"), "1", "{text}");
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;

    /// A policy lane the template gives no queue is refused, named with the template's lanes;
    /// the shipped local policies pass.
    #[test]
    fn policy_lanes_without_a_template_queue_are_refused() {
        let template = onoff_iam::lane_queues(onoff_iam::TEMPLATE, onoff_iam::Principal::Scaler).unwrap();
        let lanes_toml = include_str!("../../../examples/local-lanes.toml");
        for text in [LOCAL_POLICY, lanes_toml] {
            let policy = PolicyConfig::from_toml_str(text).unwrap();
            lanes_have_template_queues(&policy, &template).unwrap();
        }
        let one = PolicyConfig::from_toml_str(&lanes_toml.replace("\"express\"", "\"gpu\"")).unwrap();
        let err = lanes_have_template_queues(&one, &template).unwrap_err().to_string();
        assert!(
            err.starts_with("policy lane \"gpu\" has no queue in template.yaml")
                && err.contains("gives lanes express (ExpressQueue), standard (StandardQueue)")
                && err.contains("--no-iam"),
            "{err}"
        );
        let two = PolicyConfig::from_toml_str(
            &lanes_toml
                .replace("\"express\"", "\"gpu\"")
                .replace("\"standard\"", "\"cpu\""),
        )
        .unwrap();
        let err = lanes_have_template_queues(&two, &template).unwrap_err().to_string();
        assert!(err.starts_with("policy lanes \"gpu\", \"cpu\" have no queue"), "{err}");
    }
}
