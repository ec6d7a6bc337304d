//! The agent's loop: register, poll, claim, run, checkpoint, react to notices, exit when idle.
//!
//! A claimed job's attempt is two futures polled together from the claim until the attempt is
//! settled: the attempt itself (resume download, input download, a lease check, the process,
//! checkpoint uploads, the final record) and its watcher (lease renewal, heartbeat, IMDS notices,
//! the agent's shutdown), which tells the attempt what it saw. No transfer, however long, holds
//! up the lease or the heartbeat, and the periodic uploads run beside the process.
//!
//! Notices: a spot interruption notice (or the agent's shutdown) stops the job, which
//! checkpoints and is released; a rebalance recommendation asks the job for a checkpoint,
//! uploads checkpoints as they appear, lets the job finish and takes no new one.
//!
//! Everything goes through the ports in [`crate::ports`] and tokio time, so the whole loop runs in
//! tests against fakes with paused time.

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use onoff_control::job::{bounded_reason, parse_s3_uri, AttemptEnd, AttemptRecord, JobState, OutputsRecord, Settle};
use onoff_control::ports::{
    checkpoint_prefix, wake, CheckpointStore, Claim, JobRecord, JobStore, StoreError, WakeUp, WorkerRecord,
};
use onoff_policy::choice::worth_an_on_demand_worker;
use onoff_policy::deadline::{keeps_off_spot, spot_start_slack_s};
use onoff_policy::{CapacityType, OfferingKey, WorkerState};
use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};

use crate::cache::{clear_job_dir, prepare_work_dir, JobCache};
use crate::config::{AgentConfig, ShutdownMode};
use crate::ports::{
    Control, Identity, Inbox, Instance, JobCommand, JobEvent, JobExit, Launcher, Message, Metadata, Notice, Objects,
    Registry, SessionError,
};
use crate::process::{chown_tree, write_job_credentials};

/// The ports the agent runs against.
#[derive(Debug)]
pub struct Deps<M, Q, J, R, C, O, I, L> {
    /// IMDS.
    pub metadata: M,
    /// Lane queues.
    pub inbox: Q,
    /// Jobs table.
    pub jobs: J,
    /// Workers table.
    pub registry: R,
    /// Checkpoints.
    pub checkpoints: C,
    /// Input objects.
    pub objects: O,
    /// This instance.
    pub instance: I,
    /// Job processes.
    pub launcher: L,
}

/// Seconds an agent whose row is Stopped waits for the shutdown the control plane's
/// StopInstances brings before it ends its instance itself. EC2 begins a stop by shutting the OS
/// down, which reaches the agent within seconds ("Stop and start Amazon EC2 instances", EC2 User
/// Guide); ten minutes covers a slow stop many times over (an assumption, not an EC2 figure).
pub const STOP_WAIT_S: f64 = 600.0;

/// What an idle worker's row says at its idle timeout (`Worker::hold`).
enum Hold {
    /// Held by the control plane until this unix time.
    Until(f64),
    /// Its row is Stopped: the control plane is stopping the instance.
    Stopping,
    /// Not held: the idle timeout ends the instance.
    None,
}

/// Why the agent stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// No job for the idle timeout: deregistered and terminated its instance.
    IdleTimeout,
    /// A notice: deregistered and terminated its instance. After a spot interruption notice its
    /// job was checkpointed and released; after a rebalance recommendation its job was
    /// checkpointed at once and run to its end, and no other job was taken.
    Notice(Notice),
    /// Asked to stop (SIGTERM/SIGINT to the agent): released its job and deregistered.
    Shutdown,
    /// The control plane is retiring this worker (its row is Draining or Terminating: a
    /// scale-down, or an interruption notice): it takes no new work, deregistered and terminated
    /// its instance.
    Drained,
    /// The control plane stopped this worker's instance (its row is Stopped: kept, to be started
    /// again): it took no new work and waited for the shutdown the stop brings; its row stays
    /// Stopped and its instance is neither deregistered nor terminated.
    Stopped,
}

/// How one job attempt on this worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0, recorded SUCCEEDED, message deleted.
    Succeeded,
    /// Failed for good (attempts used up, or it cannot run here), recorded FAILED.
    Failed,
    /// Failed, retried after `retry_delay_s`.
    Retrying,
    /// Stopped for a notice or shutdown, checkpointed, released for resume (attempt not counted).
    Released,
    /// The lease was lost (ended by the reaper): the job was killed, or not started when that
    /// was found before its start; nothing recorded.
    LostLease,
    /// The user cancelled it (`onoff cancel`): stopped (SIGTERM, grace, SIGKILL) or never
    /// started, recorded CANCELLED, never retried.
    Cancelled,
}

impl Outcome {
    /// Lower-case name (metrics, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Retrying => "retrying",
            Outcome::Released => "released",
            Outcome::LostLease => "lost_lease",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// Per-job figures, also printed as an EMF line (namespace `onoff`).
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// Job id.
    pub job_id: String,
    /// Attempt number (claims that counted).
    pub attempt: u32,
    /// When this worker claimed it, unix seconds.
    pub started_at: f64,
    /// How it ended.
    pub outcome: Outcome,
    /// How the process ended (`None`: it never started).
    pub exit: Option<JobExit>,
    /// Whether the process exited 0 (the work completed, whatever was recorded).
    pub completed: bool,
    /// Checkpoint sequence it resumed from.
    pub resumed_from: Option<u64>,
    /// Checkpoints uploaded.
    pub checkpoints_uploaded: u32,
    /// Seconds the job ran (job time: wall seconds × `time_scale`).
    pub seconds: f64,
    /// GPU-seconds: seconds × the job's GPUs.
    pub gpu_seconds: f64,
    /// $: the instance price × seconds.
    pub cost_usd: f64,
    /// Items this attempt processed, when the job reported them (`ONOFF_ITEMS <n>`, cumulative
    /// over the job; after a resume, counted from the first count the job printed).
    pub items: Option<u64>,
    /// S3 prefix of the last checkpoint this attempt uploaded.
    pub checkpoint: Option<String>,
    /// Files of `ONOFF_OUTPUT_DIR` uploaded to `outputs/<job_id>/` when the attempt ended.
    pub outputs_uploaded: usize,
    /// Bytes the job's project cache held when the job started (`ONOFF_CACHE_DIR`: what earlier
    /// jobs of the project left on this worker); `None`: no cache, or the job never started.
    pub cache_bytes_at_start: Option<u64>,
}

impl JobReport {
    /// The process's exit code (`None`: a signal ended it, or it never started).
    pub fn exit_code(&self) -> Option<i32> {
        self.exit.and_then(JobExit::code)
    }

    /// $ per item, when items were reported.
    pub fn usd_per_item(&self) -> Option<f64> {
        self.items.filter(|&n| n > 0).map(|n| self.cost_usd / n as f64)
    }
}

/// What a run of the agent did.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentReport {
    /// Why it stopped.
    pub exit: ExitReason,
    /// Every job attempt, in order.
    pub jobs: Vec<JobReport>,
    /// Messages dropped because their job was finished or held by another worker's live lease,
    /// or (a message this worker would pass on) a later message of its job was sent.
    pub dropped: u32,
    /// Messages left for the dead-letter queue (malformed, unknown job), each with an error record.
    pub poison: u32,
    /// Jobs handed back to their lane unrun because they ask for more GPUs than this worker has
    /// (`ONOFF_GPUS`), claimed first: their message did not say how many GPUs they ask for.
    pub handed_back: u32,
    /// Messages passed on unclaimed because their job asks for more GPUs than this worker has,
    /// or fewer than it serves ([`WorkerRecord::min_job_gpus`]; the message says how many:
    /// [`onoff_control::ports::WakeUp`]).
    pub passed_on: u32,
    /// Jobs given back unrun because this spot worker would put their deadline at risk
    /// (`onoff_policy::deadline::keeps_off_spot`), or because this on-demand worker costs them
    /// more than the wait for spot is worth (`onoff_policy::choice::worth_an_on_demand_worker`).
    pub deferred: u32,
    /// The job this worker was launched for (its row's `pinned_job`), when it claimed it by id.
    pub pinned_claimed: Option<String>,
}

/// A failure that stops the agent before it can work.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// IMDS did not answer.
    #[error("instance metadata: {0}")]
    Metadata(String),
    /// The workers table could not be read or written.
    #[error("workers table: {0}")]
    Registry(#[from] StoreError),
    /// The work dir could not be made ready for jobs ([`crate::cache::prepare_work_dir`]).
    #[error("work dir {0}")]
    WorkDir(String),
}

/// Unix seconds from a base and tokio's clock (paused in tests).
#[derive(Debug, Clone, Copy)]
struct Clock {
    base_unix: f64,
    start: Instant,
}

impl Clock {
    fn now(&self) -> f64 {
        self.base_unix + self.start.elapsed().as_secs_f64()
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// Largest `n` among the directories named by an integer under `dir` (complete checkpoints).
fn newest_checkpoint(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .max()
}

/// Hard-link every file of checkpoint `src` into `dst` (made anew), for an upload that the job
/// cannot spoil by deleting or renaming `src` meanwhile (the files of a complete checkpoint are
/// not rewritten: a new checkpoint is a new directory). Links cost neither space nor time; `src`
/// and `dst` are both under the job's work directory, so on one file system.
fn stage(src: &Path, dst: &Path) -> std::io::Result<()> {
    if dst.exists() {
        std::fs::remove_dir_all(dst)?;
    }
    std::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        let (from, to) = (e.path(), dst.join(e.file_name()));
        if e.file_type()?.is_dir() {
            stage(&from, &to)?;
        } else {
            std::fs::hard_link(&from, &to)?;
        }
    }
    Ok(())
}

/// `ONOFF_ITEMS <n>` lines.
fn items_line(line: &str) -> Option<u64> {
    line.trim().strip_prefix("ONOFF_ITEMS")?.trim().parse().ok()
}

type Shutdown<'a> = Pin<&'a mut (dyn Future<Output = ()> + Send)>;

/// What an attempt's watcher ([`Worker::watch`]) has seen, for the attempt to act on.
#[derive(Debug, Clone, Default)]
struct Alerts {
    /// Checkpoint and stop: a spot interruption notice or the agent's shutdown.
    stop: Option<ExitReason>,
    /// A rebalance recommendation: checkpoint now, finish this job, take no other.
    rebalance: Option<Notice>,
    /// This worker no longer holds the lease (why): the job must not run here any more.
    lease_lost: Option<String>,
    /// The user cancelled the job (seen at a lease renewal): stop it, record CANCELLED.
    cancel: bool,
}

/// Why a wait of an attempt was cut short.
#[derive(Debug)]
enum Interrupt {
    /// Before the process started: release the job.
    Stop(ExitReason),
    /// Record nothing.
    LeaseLost(String),
    /// Cancelled by the user: record CANCELLED.
    Cancel,
}

impl Interrupt {
    /// Before the job's process runs, a lost lease, a cancel or a stop ends the attempt.
    fn before_start(a: &Alerts) -> Option<Self> {
        Self::lease_lost(a)
            .or_else(|| a.cancel.then_some(Interrupt::Cancel))
            .or_else(|| a.stop.clone().map(Interrupt::Stop))
    }

    /// After it ran (its last upload), only a lost lease does.
    fn lease_lost(a: &Alerts) -> Option<Self> {
        a.lease_lost.clone().map(Interrupt::LeaseLost)
    }
}

/// The number of the attempt `job` was claimed for: 1 + the attempts its log holds (also its log
/// stream, `<job_id>/<n>`, and its entry in the attempt log).
fn attempt_number(job: &JobRecord) -> u32 {
    job.attempt_log.len() as u32 + 1
}

/// `fut`, unless `alerts` call for `interrupt` first (then `fut` is dropped).
async fn unless<T>(
    alerts: &mut watch::Receiver<Alerts>,
    interrupt: fn(&Alerts) -> Option<Interrupt>,
    fut: impl Future<Output = T>,
) -> Result<T, Interrupt> {
    tokio::pin!(fut);
    loop {
        if let Some(i) = interrupt(&alerts.borrow_and_update()) {
            return Err(i);
        }
        tokio::select! {
            biased;
            changed = alerts.changed() => {
                if changed.is_err() {
                    // No watcher any more: nothing can interrupt.
                    return Ok(fut.await);
                }
            }
            v = &mut fut => return Ok(v),
        }
    }
}

/// The output of the future in `slot`; pending while there is none.
async fn poll_some<F: Future + Unpin>(slot: &mut Option<F>) -> F::Output {
    match slot {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Which checkpoints of an attempt are in the store.
#[derive(Debug, Clone, Copy, Default)]
struct Uploads {
    /// The newest local checkpoint (its directory number) uploaded.
    local: Option<u64>,
    /// The last sequence number in the store (the resumed one, or the last upload).
    remote_seq: u64,
}

impl Uploads {
    /// Whether `dir` holds a complete checkpoint newer than the last one uploaded.
    fn behind(&self, dir: &Path) -> bool {
        newest_checkpoint(dir).is_some_and(|n| self.local.is_none_or(|u| n > u))
    }
}

/// A checkpoint just uploaded.
#[derive(Debug)]
struct Uploaded {
    uploads: Uploads,
    /// Its S3 prefix.
    prefix: String,
}

/// The least time, seconds, between two reads of a worker's row for a run-time estimate it
/// lacks (the agent reads it again at a job that declares no run time): the reconciler, which
/// writes the figure, runs every minute at its fastest schedule (template.yaml
/// `ReconcileSchedule`, `rate(1 minute)` to `rate(10 minutes)`), so reading more often finds
/// nothing new.
pub const ESTIMATE_REREAD_S: f64 = 60.0;

struct Worker<'a, M, Q, J, R, C, O, I, L> {
    deps: &'a Deps<M, Q, J, R, C, O, I, L>,
    cfg: &'a AgentConfig,
    clock: Clock,
    me: Identity,
    lanes: Vec<String>,
    /// $/h, as the worker's row has it: 0 for a worker the agent registered itself until the
    /// reaper writes its offering's price into the row ([`Worker::account`] reads it back).
    price_usd_per_h: std::cell::Cell<f64>,
    /// The job the scaler launched this worker for, claimed before the first poll.
    pinned: Option<String>,
    /// On-demand in a spot-first lane: the best spot price for its shape, $/h, as its row has
    /// it ([`WorkerRecord::spot_price_usd_per_h`]).
    spot_price_usd_per_h: Option<f64>,
    /// The lane its row names.
    row_lane: String,
    /// The run time, seconds, the control plane gave a job of `row_lane` declaring none when it
    /// launched or last started this worker, or later ([`WorkerRecord::run_time_estimate_s`]);
    /// read again while `None` ([`Worker::read_run_time_estimate`]).
    run_time_estimate_s: Option<f64>,
    /// When the row was last read again for `run_time_estimate_s`, unix seconds (not at start).
    estimate_read_at: Option<f64>,
    /// The fewest GPUs a job may ask for and be run here ([`WorkerRecord::min_job_gpus`]): the
    /// message of a smaller job is passed on, for a worker of its size.
    min_job_gpus: Option<u32>,
    /// The project cache jobs get as `ONOFF_CACHE_DIR`; `None` with `ONOFF_CACHE_GIB` = 0.
    cache: Option<JobCache>,
    /// The projects the worker's row says its cache holds ([`WorkerRecord::cached_projects`]):
    /// as read at start, then as last written ([`Worker::record_cache`]).
    cache_recorded: std::cell::RefCell<Vec<String>>,
    report: AgentReport,
}

/// Cancel instance `id`'s persistent spot request, if any ([`Instance::release_request`]),
/// before the agent exits on the error `why`: its instance then powers off and terminates, which
/// would otherwise reopen the request for EC2 to launch another. A failed cancel is logged.
pub async fn release_request_on_exit<I: Instance>(instance: &I, id: &str, why: &dyn std::fmt::Display) {
    match instance.release_request(id).await {
        Ok(()) => tracing::info!(error = %why, "exiting on an error: this instance's spot request is released"),
        Err(e) => tracing::error!(error = %e, exiting_on = %why, "cancel this instance's spot request"),
    }
}

/// Run the agent until it exits (idle timeout, notice, or `shutdown` resolving). `start_unix`:
/// the unix time now (the agent's clock advances with tokio's).
///
/// # Errors
/// [`AgentError`] when IMDS or the workers table cannot be reached at start; later failures are
/// logged and retried. Past IMDS, the instance's persistent spot request is cancelled before
/// the error is returned ([`release_request_on_exit`]): the agent exits, and its instance
/// powers off.
pub async fn run<M, Q, J, R, C, O, I, L>(
    deps: &Deps<M, Q, J, R, C, O, I, L>,
    cfg: &AgentConfig,
    start_unix: f64,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<AgentReport, AgentError>
where
    M: Metadata,
    Q: Inbox,
    J: JobStore,
    R: Registry,
    C: CheckpointStore,
    O: Objects,
    I: Instance,
    L: Launcher,
{
    let clock = Clock {
        base_unix: start_unix,
        start: Instant::now(),
    };
    let me = deps.metadata.identity().await.map_err(AgentError::Metadata)?;
    // Before the row: no attempt of this agent is under way yet, so every job work dir is an
    // earlier run's, and without a work dir no job could run.
    match prepare_work_dir(&cfg.work_dir, cfg.job_user) {
        Ok(0) => {}
        Ok(n) => tracing::info!(dirs = n, "removed the work dirs of jobs an earlier agent left"),
        Err(e) => {
            let e = AgentError::WorkDir(format!("{}: {e}", cfg.work_dir.display()));
            release_request_on_exit(&deps.instance, &me.instance_id, &e).await;
            return Err(e);
        }
    }
    let record = match deps.registry.get(&me.instance_id).await {
        Ok(r) => r,
        Err(e) => {
            let e = AgentError::from(e);
            release_request_on_exit(&deps.instance, &me.instance_id, &e).await;
            return Err(e);
        }
    };
    let (lane, price, pinned, spot_price_usd_per_h, run_time_estimate_s, cache_recorded, min_job_gpus) = match record {
        Some(r) => (
            r.lane,
            r.price_usd_per_h,
            r.pinned_job,
            r.spot_price_usd_per_h,
            r.run_time_estimate_s,
            r.cached_projects,
            r.min_job_gpus,
        ),
        None => {
            let lane = cfg.lanes.first().cloned().unwrap_or_else(|| "standard".into());
            let capacity_type = if me.lifecycle == "spot" {
                CapacityType::Spot
            } else {
                CapacityType::OnDemand
            };
            let registered = deps
                .registry
                .register(WorkerRecord::launched(
                    &me.instance_id,
                    lane.clone(),
                    OfferingKey {
                        instance_type: me.instance_type.clone(),
                        zone: me.zone.clone(),
                        capacity_type,
                    },
                    0.0,
                    clock.now(),
                ))
                .await;
            if let Err(e) = registered {
                let e = AgentError::from(e);
                release_request_on_exit(&deps.instance, &me.instance_id, &e).await;
                return Err(e);
            }
            tracing::warn!(instance = %me.instance_id, "not registered by the control plane: registered with price 0");
            (lane, 0.0, None, None, None, Vec::new(), None)
        }
    };
    let lanes = if cfg.lanes.is_empty() {
        vec![lane.clone()]
    } else {
        cfg.lanes.clone()
    };
    let shm_bytes = crate::process::fs_size_bytes(std::path::Path::new(crate::process::SHM_DIR));
    let nofile = crate::process::nofile_limits();
    tracing::info!(instance = %me.instance_id, ?lanes, price_usd_per_h = price, ?shm_bytes, ?nofile, "agent started");
    for w in [
        crate::process::shm_warning(shm_bytes),
        crate::process::nofile_warning(nofile),
    ]
    .into_iter()
    .flatten()
    {
        tracing::warn!("{w}");
    }
    let cache = JobCache::new(&cfg.work_dir, cfg.cache_gib);
    // What the cache holds once ready (none without a cache; unknown when it cannot be read).
    let mut held = Some(Vec::new());
    if let Some(c) = &cache {
        // A project's directory an earlier agent lent and never took back (killed mid-job), and
        // a bound that may have been lowered since.
        let failed = c.take_back_all(cfg.job_user);
        if !failed.is_empty() {
            tracing::warn!(projects = ?failed, "project caches left to a job could not be taken back: removed");
        }
        held = match c.trim() {
            Ok(t) => Some(t.held),
            Err(e) => {
                tracing::warn!(error = %e, "trim the project cache");
                None
            }
        };
    }
    let mut w = Worker {
        deps,
        cfg,
        clock,
        me,
        lanes,
        price_usd_per_h: std::cell::Cell::new(price),
        pinned,
        spot_price_usd_per_h,
        row_lane: lane,
        run_time_estimate_s,
        estimate_read_at: None,
        min_job_gpus,
        cache,
        cache_recorded: std::cell::RefCell::new(cache_recorded),
        report: AgentReport {
            exit: ExitReason::Shutdown,
            jobs: Vec::new(),
            dropped: 0,
            poison: 0,
            handed_back: 0,
            passed_on: 0,
            deferred: 0,
            pinned_claimed: None,
        },
    };
    // A started worker's row says what its cache held when it stopped; a new one's, nothing.
    if let Some(held) = held {
        w.record_cache(held).await;
    }
    let mut shutdown: Pin<Box<dyn Future<Output = ()> + Send + '_>> = Box::pin(shutdown);
    let exit = loop {
        let exit = w.serve(shutdown.as_mut()).await;
        if exit != ExitReason::Drained {
            break exit;
        }
        // Refused work: retired (Draining, Terminating), or being stopped (Stopped), when the
        // instance goes down with the stop and must not be terminated.
        match w.while_stopped(shutdown.as_mut()).await {
            Some(exit) => break exit,
            None => tracing::info!("the stop did not happen: serving again"),
        }
    };
    w.leave(&exit).await;
    w.report.exit = exit;
    Ok(w.report)
}

impl<M, Q, J, R, C, O, I, L> Worker<'_, M, Q, J, R, C, O, I, L>
where
    M: Metadata,
    Q: Inbox,
    J: JobStore,
    R: Registry,
    C: CheckpointStore,
    O: Objects,
    I: Instance,
    L: Launcher,
{
    fn id(&self) -> &str {
        &self.me.instance_id
    }

    /// Write the heartbeat; `false` when the control plane is retiring this worker (its row is
    /// Draining or Terminating and keeps that state).
    async fn heartbeat(&self, state: WorkerState, idle_since: Option<f64>, job: Option<&str>) -> bool {
        let now = self.clock.now();
        let mut retiring = false;
        match self.deps.registry.heartbeat(self.id(), state, idle_since, now).await {
            Ok(()) => {}
            Err(StoreError::Conflict(e)) => {
                tracing::info!(reason = %e, "worker is being retired: no new work");
                retiring = true;
            }
            Err(e) => tracing::warn!(error = %e, "heartbeat"),
        }
        let health = serde_json::json!({
            "instance_id": self.id(), "state": format!("{state:?}"), "at": now, "job": job,
        });
        let _ = std::fs::create_dir_all(&self.cfg.work_dir);
        let _ = std::fs::write(self.cfg.health_file(), health.to_string());
        !retiring
    }

    async fn notice(&self) -> Option<Notice> {
        match self.deps.metadata.notice().await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "IMDS notice poll");
                None
            }
        }
    }

    /// Poll and run jobs until a reason to exit.
    async fn serve(&mut self, mut shutdown: Shutdown<'_>) -> ExitReason {
        let mut idle_since = self.clock.now();
        let mut idle_at = Instant::now();
        if !self.heartbeat(WorkerState::Idle, Some(idle_since), None).await {
            return ExitReason::Drained;
        }
        if let Some(job) = self.pinned.take() {
            if let Some(exit) = self.run_pinned(&job, shutdown.as_mut()).await {
                return exit;
            }
            if !self.report.jobs.is_empty() {
                idle_since = self.clock.now();
                idle_at = Instant::now();
                if !self.heartbeat(WorkerState::Idle, Some(idle_since), None).await {
                    return ExitReason::Drained;
                }
            }
        }
        let mut next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
        let mut next_poll = Instant::now();
        // Until when the control plane holds this worker past its idle timeout (read from its
        // row when the timeout is reached; see `held_until`).
        let mut held = Instant::now();
        loop {
            if Instant::now() >= next_poll {
                next_poll = Instant::now() + secs(self.cfg.imds_poll_s);
                if let Some(n) = self.notice().await {
                    tracing::warn!(notice = ?n, "notice while idle: draining");
                    return ExitReason::Notice(n);
                }
            }
            let idle_for = idle_at.elapsed().as_secs_f64();
            if idle_for >= self.cfg.idle_timeout_s && Instant::now() >= held {
                match self.hold().await {
                    Hold::Until(until) => {
                        tracing::info!(
                            idle_s = idle_for,
                            hold_until = until,
                            "idle timeout, held by the control plane"
                        );
                        held = Instant::now() + secs(until - self.clock.now());
                    }
                    Hold::Stopping => {
                        // The control plane released this worker by a stop a moment ago (its
                        // row turned Stopped since the last heartbeat): terminating now would
                        // lose the volume the stop keeps. Wait for the stop (`while_stopped`).
                        tracing::info!(
                            idle_s = idle_for,
                            "idle timeout while the control plane stops this instance"
                        );
                        return ExitReason::Drained;
                    }
                    Hold::None => {
                        tracing::info!(idle_s = idle_for, "idle timeout");
                        return ExitReason::IdleTimeout;
                    }
                }
            }
            if Instant::now() >= next_heartbeat {
                next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
                if !self.heartbeat(WorkerState::Idle, Some(idle_since), None).await {
                    return ExitReason::Drained;
                }
            }
            // Long-poll no longer than the next thing to do.
            let until_next = [
                (self.cfg.idle_timeout_s - idle_for).max(held.saturating_duration_since(Instant::now()).as_secs_f64()),
                next_poll.saturating_duration_since(Instant::now()).as_secs_f64(),
                next_heartbeat.saturating_duration_since(Instant::now()).as_secs_f64(),
            ]
            .into_iter()
            .fold(self.cfg.poll_wait_s, f64::min);
            let received = tokio::select! {
                () = &mut shutdown => return ExitReason::Shutdown,
                m = self.receive(until_next) => m,
            };
            let Some(msg) = received else { continue };
            let ran = self.report.jobs.len();
            if let Some(exit) = self.handle(msg, shutdown.as_mut()).await {
                return exit;
            }
            if self.report.jobs.len() == ran {
                // A dropped or poison message is not work: the idle clock keeps running.
                continue;
            }
            idle_since = self.clock.now();
            idle_at = Instant::now();
            if !self.heartbeat(WorkerState::Idle, Some(idle_since), None).await {
                return ExitReason::Drained;
            }
            next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
        }
    }

    /// After this worker was refused work, or its idle timeout found its row Stopped:
    /// `Some(Drained)` when the control plane is retiring it (its row is not Stopped); while the
    /// row is Stopped (the control plane is stopping this instance), wait for the shutdown the
    /// stop brings (`Some(Stopped)`), reading the row every heartbeat interval: back to Idle (the
    /// stop failed and was undone) is `None`, serve again; any other state is `Some(Drained)`. A
    /// failed read counts as retired. No shutdown within [`STOP_WAIT_S`] of the first read is
    /// `Some(IdleTimeout)`: the stop never came (the control plane died between its row write
    /// and StopInstances), and the idle timeout's safety net ends the instance, which would
    /// otherwise run, billed, until its stopped keep ran out.
    async fn while_stopped(&self, mut shutdown: Shutdown<'_>) -> Option<ExitReason> {
        let give_up = Instant::now() + secs(STOP_WAIT_S);
        loop {
            match self.deps.registry.get(self.id()).await {
                Ok(Some(r)) if r.state == WorkerState::Stopped => {}
                Ok(Some(r)) if r.state == WorkerState::Idle => return None,
                Ok(_) => return Some(ExitReason::Drained),
                Err(e) => {
                    tracing::warn!(error = %e, "reading this worker's row");
                    return Some(ExitReason::Drained);
                }
            }
            if Instant::now() >= give_up {
                tracing::warn!(
                    waited_s = STOP_WAIT_S,
                    "the control plane's stop of this instance never came: ending it"
                );
                return Some(ExitReason::IdleTimeout);
            }
            tracing::info!("the control plane is stopping this instance: waiting for its shutdown");
            tokio::select! {
                () = &mut shutdown => return Some(ExitReason::Stopped),
                () = tokio::time::sleep_until(give_up.min(Instant::now() + secs(self.cfg.heartbeat_s))) => {}
            }
        }
    }

    /// What this idle worker's row says at its idle timeout: held until a time (unix seconds) by
    /// the control plane, the `hold_until` of its Idle row while that is still ahead
    /// (`onoff_control::reconcile::renew_holds`); being stopped (its row is Stopped); or neither
    /// (end the instance: no hold, it has passed, another state, or the row cannot be read; the
    /// idle timeout is the safety net for a control plane that is gone, so a failed read never
    /// keeps a worker).
    async fn hold(&self) -> Hold {
        match self.deps.registry.get(self.id()).await {
            Ok(Some(r)) if r.state == WorkerState::Idle => r
                .hold_until
                .filter(|h| *h > self.clock.now())
                .map_or(Hold::None, Hold::Until),
            Ok(Some(r)) if r.state == WorkerState::Stopped => Hold::Stopping,
            Ok(_) => Hold::None,
            Err(e) => {
                tracing::warn!(error = %e, "reading this worker's hold");
                Hold::None
            }
        }
    }

    /// One message from the lanes, preferred lane first; long-polls the last lane for what is
    /// left of `wait_s`. A preferred lane is long-polled too, for a second (when `wait_s` allows
    /// one): a short poll asks only a sample of SQS's servers and may miss the few messages of a
    /// quiet queue ("Amazon SQS short and long polling"), which would hand the worker a lower
    /// lane's job first.
    async fn receive(&self, wait_s: f64) -> Option<Message> {
        let visibility = self.cfg.lease_s.ceil() as u32;
        let total = wait_s.floor().max(0.0) as u32;
        let preferred = u32::try_from(self.lanes.len().saturating_sub(1)).unwrap_or(u32::MAX);
        // A second per preferred lane, when the whole wait has room for them and the last lane.
        let each = u32::from(total > preferred);
        for (i, lane) in self.lanes.iter().enumerate() {
            let wait = if i + 1 == self.lanes.len() {
                total - each * preferred
            } else {
                each
            };
            let started = Instant::now();
            match self.deps.inbox.receive(lane, wait, visibility).await {
                Ok(Some(m)) => return Some(m),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(lane = %lane, error = %e, "receive");
                    // Do not spin on a failing queue.
                    tokio::time::sleep_until(started + secs(wait_s.min(1.0))).await;
                }
            }
        }
        // A long poll shorter than a second still waits, so the loop does not spin.
        if wait_s < 1.0 {
            tokio::time::sleep(secs(wait_s)).await;
        }
        None
    }

    async fn poison(&mut self, msg: &Message, key: &str, reason: &str) {
        // Cut as a submission's rejection is: the reason may quote the message (a job id of
        // any length), and the record must stay within DynamoDB's item limit.
        let reason = &bounded_reason(reason.to_string());
        tracing::error!(message = %msg.message_id, %reason, "poison message: left for the dead-letter queue");
        if let Err(e) = self.deps.jobs.record_error(key, reason, self.clock.now()).await {
            tracing::warn!(error = %e, "record error");
        }
        self.report.poison += 1;
        // Visible again after the retry delay; SQS moves it to the dead-letter queue after
        // maxReceiveCount receives.
        let _ = self
            .deps
            .inbox
            .set_visibility(&msg.lane, &msg.receipt, self.cfg.retry_delay_s as u32)
            .await;
    }

    /// Claim and run the message's job. `Some` when the agent must exit.
    async fn handle(&mut self, msg: Message, shutdown: Shutdown<'_>) -> Option<ExitReason> {
        let Some(wake_up) = WakeUp::parse(&msg.body) else {
            let excerpt: String = msg.body.chars().take(200).collect();
            let reason = format!("job message is not {{\"job_id\": \"...\"}}: {excerpt:?}");
            self.poison(&msg, &format!("sqs:{}", msg.message_id), &reason).await;
            return None;
        };
        // A job for more GPUs than this worker has: the message goes on, as a fresh one after the
        // retry delay (so its receive count never nears the dead-letter queue's), for a worker
        // that fits; the job is not claimed, and no hand-back is counted against it. A job the
        // policy keeps waiting for a spot offering of its size is bounced for as long as it
        // waits, which a claim and a counted hand-back each time turned into FAILED after
        // `max_hand_backs` (50 minutes with one small idle worker in the lane).
        // A job smaller than the policy runs on this worker (a 1-GPU job on an 8-GPU worker
        // launched for an 8-GPU job): the same, for a worker of its size. Run here, it would cost
        // this worker's price instead of its size's, and leave the job this worker was launched
        // for waiting while the policy launched another.
        let too_small = wake_up.too_small_for(self.min_job_gpus);
        if too_small || wake_up.too_big_for(self.cfg.gpus) {
            // Only a message its job still waits on goes on (`WakeUp::stale`): a duplicate went
            // round with it for as long as the job waited, and counted in the lane's queue as
            // the message of another waiting job, whose own gone message the reaper then did not
            // replace.
            match self.deps.jobs.get(&wake_up.job_id).await {
                Ok(None) => {
                    let reason = format!("no job {} in the jobs table", wake_up.job_id);
                    self.poison(&msg, &format!("sqs:{}", msg.message_id), &reason).await;
                    return None;
                }
                Ok(Some(row)) => {
                    if let Some(why) = wake_up.stale(&row) {
                        tracing::info!(job = %wake_up.job_id, %why, "message dropped, not passed on");
                        self.report.dropped += 1;
                        if let Err(e) = self.deps.inbox.delete(&msg.lane, &msg.receipt).await {
                            tracing::warn!(error = %e, "delete dropped message");
                        }
                        return None;
                    }
                }
                Err(e) => {
                    tracing::warn!(job = %wake_up.job_id, error = %e, "reading the job's row: message passed on as it is");
                }
            }
            let why = if too_small {
                "job needs fewer GPUs than this worker serves"
            } else {
                "job needs more GPUs"
            };
            tracing::info!(job = %wake_up.job_id, wants = ?wake_up.gpus, has = ?self.cfg.gpus, serves_from = ?self.min_job_gpus, why, "message passed on unclaimed");
            self.report.passed_on += 1;
            if let Err(e) = self
                .deps
                .inbox
                .requeue(&msg.lane, &msg.receipt, &msg.body, self.cfg.retry_delay_s as u32)
                .await
            {
                tracing::warn!(job = %wake_up.job_id, error = %e, "pass the message on (it reappears after its visibility)");
            }
            return None;
        }
        let job_id = wake_up.job_id;
        // A notice may have come while this message was on its way (the idle loop polls IMDS
        // every few seconds): a worker at risk takes no new job. The message goes back as a new
        // one, visible at once, for a worker that stays.
        if let Some(n) = self.notice().await {
            tracing::warn!(job = %job_id, notice = ?n, "notice before the claim: message handed back, draining");
            if let Err(e) = self.deps.inbox.requeue(&msg.lane, &msg.receipt, &msg.body, 0).await {
                tracing::warn!(job = %job_id, error = %e, "hand the message back (it reappears after its visibility)");
            }
            return Some(ExitReason::Notice(n));
        }
        let now = self.clock.now();
        let owner = self.id().to_string();
        // One conditional write on this worker's row before the claim: a scale-down or an
        // interruption notice that marked it Draining or Terminating first wins, and then this
        // worker takes no job (its message goes back for another).
        match self.deps.registry.mark_busy(&owner, now).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(job = %job_id, "worker is being retired: message left for another worker");
                if let Err(e) = self.deps.inbox.set_visibility(&msg.lane, &msg.receipt, 0).await {
                    tracing::warn!(error = %e, "give the message back");
                }
                return Some(ExitReason::Drained);
            }
            Err(e) => {
                tracing::warn!(error = %e, "mark busy failed: message handed back");
                if let Err(e) = self
                    .deps
                    .inbox
                    .requeue(&msg.lane, &msg.receipt, &msg.body, self.cfg.retry_delay_s as u32)
                    .await
                {
                    tracing::warn!(job = %job_id, error = %e, "hand the message back");
                }
                return None;
            }
        }
        match self.deps.jobs.claim(&job_id, &owner, now + self.cfg.lease_s, now).await {
            Ok(Claim::Claimed(rec)) => {
                // The row is the truth from here on: the message has done its work. Every re-run
                // sends a fresh one, so no message lives as long as a job (SQS's 12-hour
                // visibility cap) or gathers receives towards the dead-letter queue.
                if let Err(e) = self.deps.inbox.delete(&msg.lane, &msg.receipt).await {
                    tracing::warn!(job = %job_id, error = %e, "delete claimed message (it reappears and is dropped)");
                }
                self.run_claimed(&msg.lane, *rec, shutdown).await
            }
            Ok(Claim::NotClaimable(state)) => {
                // Finished, or RUNNING under a live lease (if that lease is lost, the reaper
                // re-queues the job with a fresh message): this message is irrelevant.
                tracing::info!(job = %job_id, state = state.as_str(), "job not claimable: message dropped");
                self.report.dropped += 1;
                if let Err(e) = self.deps.inbox.delete(&msg.lane, &msg.receipt).await {
                    tracing::warn!(error = %e, "delete dropped message");
                }
                None
            }
            Ok(Claim::Unknown) => {
                let reason = format!("no job {job_id} in the jobs table");
                self.poison(&msg, &format!("sqs:{}", msg.message_id), &reason).await;
                None
            }
            Err(StoreError::Malformed(e) | StoreError::Invalid(e)) => {
                // The row exists and cannot be read: nothing can run it. The claim, one write that
                // returns the row, may have made it RUNNING under this lease first: end it FAILED
                // with the reason, so it neither stays RUNNING nor is listed unreadable on every
                // reconcile (refused, and left, when the claim was not written). Then poison.
                let reason = format!("job {job_id} cannot be read: {e}");
                match self.deps.jobs.fail_unreadable(&job_id, &owner, &reason, now).await {
                    Ok(()) => tracing::warn!(job = %job_id, "unreadable job: FAILED with its reason"),
                    Err(StoreError::Conflict(_)) => {}
                    Err(e) => tracing::warn!(job = %job_id, error = %e, "end the unreadable job"),
                }
                self.poison(&msg, &format!("sqs:{}", msg.message_id), &reason).await;
                None
            }
            Err(e) => {
                // A passing failure (throttling, a network error): not poison. A fresh message
                // after the retry delay keeps the receive count of this one from creeping
                // towards the dead-letter queue; if even that fails, the reaper re-sends.
                tracing::warn!(job = %job_id, error = %e, "claim failed: retried later");
                if let Err(e) = self
                    .deps
                    .inbox
                    .requeue(&msg.lane, &msg.receipt, &msg.body, self.cfg.retry_delay_s as u32)
                    .await
                {
                    tracing::warn!(job = %job_id, error = %e, "hand the message back");
                }
                None
            }
        }
    }

    fn emit(&self, r: &JobReport) {
        let mut metrics = vec![
            ("JobSeconds", r.seconds, "Seconds"),
            ("GpuSeconds", r.gpu_seconds, "Seconds"),
            ("JobCostUsd", r.cost_usd, "None"),
            ("CheckpointsUploaded", f64::from(r.checkpoints_uploaded), "Count"),
        ];
        if let Some(n) = r.items {
            metrics.push(("ItemsProcessed", n as f64, "Count"));
        }
        if let Some(c) = r.usd_per_item() {
            metrics.push(("UsdPerItem", c, "None"));
        }
        let line = onoff_control::emf::line_with(
            "onoff",
            self.clock.now(),
            &[
                ("Deployment", self.cfg.deployment.as_str()),
                ("Outcome", r.outcome.as_str()),
            ],
            &metrics,
            &[
                ("JobId", r.job_id.clone().into()),
                ("InstanceId", self.id().into()),
                ("Attempt", r.attempt.into()),
                ("StartedAt", r.started_at.into()),
                ("ExitCode", r.exit_code().into()),
                ("Completed", r.completed.into()),
                ("ResumedFrom", r.resumed_from.into()),
                ("CacheBytesAtStart", r.cache_bytes_at_start.into()),
            ],
        );
        onoff_control::emf::emit(&line);
    }

    /// End the attempt as `end` says: one conditional write under this worker's lease, then a
    /// fresh wake-up message when the job is to run again. `None` when the lease was lost (the
    /// reaper or another worker has the job: nothing recorded here).
    async fn end_attempt(&self, job: &JobRecord, end: AttemptEnd, report: Option<&JobReport>) -> Option<JobState> {
        let mut settle = Settle::of(job, &end, &self.cfg.rerun_limits);
        let now = self.clock.now();
        if let Some(r) = report {
            let record = AttemptRecord {
                n: attempt_number(job),
                instance_id: self.id().to_string(),
                instance_type: Some(self.me.instance_type.clone()).filter(|t| !t.is_empty()),
                capacity_type: Some(
                    if self.me.lifecycle == "spot" {
                        "spot"
                    } else {
                        "on-demand"
                    }
                    .to_string(),
                ),
                price_usd_per_h: Some(self.price_usd_per_h.get()),
                started_at: r.started_at,
                ended_at: now,
                outcome: end.name().to_string(),
                exit_code: r.exit_code(),
                signal: r.exit.and_then(JobExit::signal),
                checkpoint: r.checkpoint.clone(),
                seconds: r.seconds,
                cost_usd: r.cost_usd,
            };
            settle = settle.with_attempt(job, record);
        }
        if let Err(e) = self.deps.jobs.finish(&job.id, self.id(), &settle, now).await {
            tracing::warn!(job = %job.id, error = %e, "attempt end not recorded (lease lost)");
            return None;
        }
        if settle.to == JobState::Failed {
            let reason = settle.reason.as_deref().unwrap_or("failed");
            tracing::error!(job = %job.id, %reason, "job failed");
            let _ = self
                .deps
                .jobs
                .record_error(&format!("job:{}", job.id), reason, now)
                .await;
        }
        if settle.to.is_pending() {
            let delay = match end {
                AttemptEnd::Released(_) => 0,
                _ => self.cfg.retry_delay_s as u32,
            };
            if let Err(e) = wake(&self.deps.jobs, &self.deps.inbox, &job.id, &job.spec, delay, now).await {
                // The row is pending with no recent message: the reaper sends one.
                tracing::warn!(job = %job.id, error = %e, "wake-up message after the attempt");
            }
        }
        Some(settle.to)
    }

    /// [`Self::end_attempt`] as an [`Outcome`].
    async fn settle(&self, job: &JobRecord, end: AttemptEnd, report: &JobReport) -> Outcome {
        match self.end_attempt(job, end, Some(report)).await {
            Some(JobState::Succeeded) => Outcome::Succeeded,
            Some(JobState::Failed) => Outcome::Failed,
            Some(JobState::Retrying) => Outcome::Retrying,
            Some(JobState::Cancelled) => Outcome::Cancelled,
            Some(_) => Outcome::Released,
            None => Outcome::LostLease,
        }
    }

    /// Run a claimed job's attempt, with [`Self::watch`] beside it from the claim to the settle.
    async fn run_job(&self, lane: &str, job: JobRecord, shutdown: Shutdown<'_>) -> (JobReport, Option<ExitReason>) {
        tracing::info!(job = %job.id, attempt = job.attempts, %lane, "claimed");
        self.heartbeat(WorkerState::Running, None, Some(&job.id)).await;
        let (tx, rx) = watch::channel(Alerts::default());
        let attempt = self.attempt(&job, rx);
        let watcher = self.watch(&job.id, &tx, shutdown);
        // The watcher never ends by itself: it stops (is dropped) when the attempt is settled.
        let report = tokio::select! {
            biased;
            report = attempt => report,
            never = watcher => match never {},
        };
        if let Some(held) = self.after_attempt(&job) {
            self.record_cache(held).await;
        }
        let alerts = tx.borrow().clone();
        // A stop (a spot notice, the agent's shutdown) or a rebalance recommendation seen during
        // the attempt ends the agent once the attempt is settled, however the job ended.
        let exit = alerts.stop.or_else(|| alerts.rebalance.map(ExitReason::Notice));
        (report, exit)
    }

    /// Once an attempt is settled: its project's cache goes back to the agent (removed if it
    /// cannot: no job of another project may read it), its work dir is removed, and the cache is
    /// trimmed to its bound ([`crate::cache`]). Failures are logged: they cost room, never a job.
    /// Returns the projects the cache holds now ([`crate::cache::Trimmed::held`]); `None`
    /// without a cache, or when the trim could not read it.
    fn after_attempt(&self, job: &JobRecord) -> Option<Vec<String>> {
        if let Some(cache) = &self.cache {
            if let Err(e) = cache.take_back(&job.spec.project, self.cfg.job_user) {
                let dir = cache.dir_of(&job.spec.project);
                tracing::warn!(job = %job.id, error = %e, "take the project cache back: removing it");
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        if let Err(e) = clear_job_dir(&self.cfg.work_dir, &job.id) {
            tracing::warn!(job = %job.id, error = %e, "remove the job's work dir");
        }
        let cache = self.cache.as_ref()?;
        match cache.trim() {
            Ok(t) => {
                if !t.projects.is_empty() {
                    tracing::info!(
                        projects = ?t.projects, removed_bytes = t.bytes, kept_bytes = t.kept_bytes,
                        limit_bytes = t.limit_bytes,
                        "project cache over ONOFF_CACHE_GIB or half the free room: least recently used projects removed"
                    );
                }
                Some(t.held)
            }
            Err(e) => {
                tracing::warn!(error = %e, "trim the project cache");
                None
            }
        }
    }

    /// Record in the worker's row the projects its cache holds (`held`, most recently used
    /// first; the first [`onoff_control::ports::MAX_CACHED_PROJECTS`]) when they differ from what
    /// the row says, so the policy starts this worker for their jobs first once it is stopped
    /// ([`WorkerRecord::cached_projects`]). A failed write is logged and tried again after the
    /// next attempt: it costs a preference, never a job.
    async fn record_cache(&self, mut held: Vec<String>) {
        held.truncate(onoff_control::ports::MAX_CACHED_PROJECTS);
        if *self.cache_recorded.borrow() == held {
            return;
        }
        match self.deps.registry.set_cached_projects(self.id(), &held).await {
            Ok(()) => {
                tracing::info!(projects = ?held, "recorded the project cache in the worker's row");
                *self.cache_recorded.borrow_mut() = held;
            }
            Err(e) => tracing::warn!(error = %e, "record the project cache in the worker's row"),
        }
    }

    /// The attempt's watcher: renews the lease every third of it, heartbeats, polls IMDS for
    /// notices and watches the agent's shutdown, and tells the attempt through `alerts`. It runs
    /// beside the attempt's transfers and its process alike, so a checkpoint that takes an hour to
    /// move neither lets the lease expire nor silences the heartbeat or the notices.
    async fn watch(&self, id: &str, alerts: &watch::Sender<Alerts>, mut shutdown: Shutdown<'_>) -> Infallible {
        let renew_every = secs(self.cfg.lease_s / 3.0);
        let mut next_renew = Instant::now() + renew_every;
        let mut next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
        let mut next_poll = Instant::now() + secs(self.cfg.imds_poll_s);
        let mut shutdown_open = true;
        loop {
            let (lost, stopping, draining) = {
                let a = alerts.borrow();
                (
                    a.lease_lost.is_some(),
                    a.stop.is_some(),
                    a.stop.is_some() || a.rebalance.is_some(),
                )
            };
            let mut heartbeat_now = false;
            tokio::select! {
                () = sleep_until(next_renew), if !lost => {
                    next_renew = Instant::now() + renew_every;
                    match self.renew(id).await {
                        Ok(false) => {}
                        Ok(true) => {
                            if !alerts.borrow().cancel {
                                tracing::warn!(job = %id, "cancelled by the user: the job is stopped");
                                alerts.send_modify(|a| a.cancel = true);
                            }
                        }
                        Err(why) => {
                            tracing::error!(job = %id, error = %why, "lease lost");
                            alerts.send_modify(|a| a.lease_lost = Some(why));
                        }
                    }
                }
                () = sleep_until(next_heartbeat) => heartbeat_now = true,
                () = sleep_until(next_poll), if !stopping => {
                    next_poll = Instant::now() + secs(self.cfg.imds_poll_s);
                    match self.notice().await {
                        Some(n @ Notice::SpotInterruption { .. }) => {
                            tracing::warn!(job = %id, notice = ?n, "spot interruption notice: the job checkpoints and stops");
                            alerts.send_modify(|a| a.stop = Some(ExitReason::Notice(n)));
                            heartbeat_now = true;
                        }
                        Some(n @ Notice::Rebalance { .. }) if !draining => {
                            tracing::warn!(job = %id, notice = ?n, "rebalance recommendation: checkpoint now, finish this job, take no other");
                            alerts.send_modify(|a| a.rebalance = Some(n));
                            heartbeat_now = true;
                        }
                        _ => {}
                    }
                }
                () = &mut shutdown, if shutdown_open => {
                    // Resolved once: never polled again.
                    shutdown_open = false;
                    if !stopping {
                        tracing::warn!(job = %id, "agent shutdown: the job checkpoints and stops");
                        alerts.send_modify(|a| a.stop = Some(ExitReason::Shutdown));
                        heartbeat_now = true;
                    }
                }
            }
            if heartbeat_now {
                next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
                let a = alerts.borrow().clone();
                // Draining: on its way out, or finishing its job and taking no other.
                let state = if a.stop.is_some() || a.rebalance.is_some() {
                    WorkerState::Draining
                } else {
                    WorkerState::Running
                };
                self.heartbeat(state, None, Some(id)).await;
            }
        }
    }

    /// Extend the lease of job `id` by a lease from now; `Ok(true)` when the user asked to cancel
    /// the job. `Err` with the reason when this worker no longer holds it; a passing store failure
    /// is logged and counts as held (the next renewal tries again, two more before the lease runs
    /// out).
    async fn renew(&self, id: &str) -> Result<bool, String> {
        let until = self.clock.now() + self.cfg.lease_s;
        match self.deps.jobs.renew(id, self.id(), until).await {
            Ok(r) => Ok(r.cancel_requested),
            Err(e @ (StoreError::Conflict(_) | StoreError::NotFound(_))) => Err(e.to_string()),
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "renew lease (tried again at the next renewal)");
                Ok(false)
            }
        }
    }

    /// One attempt from its claim to its settle: resume data, input, the process, checkpoint
    /// uploads, the final record. Every wait here is raced against `alerts`, never against the
    /// lease or the heartbeat, which [`Self::watch`] keeps beside it.
    async fn attempt(&self, job: &JobRecord, mut alerts: watch::Receiver<Alerts>) -> JobReport {
        let id = job.id.clone();
        let mut report = JobReport {
            job_id: id.clone(),
            attempt: job.attempts,
            started_at: self.clock.now(),
            outcome: Outcome::Failed,
            exit: None,
            completed: false,
            resumed_from: None,
            checkpoints_uploaded: 0,
            seconds: 0.0,
            gpu_seconds: 0.0,
            cost_usd: 0.0,
            items: None,
            checkpoint: None,
            outputs_uploaded: 0,
            cache_bytes_at_start: None,
        };
        let dir = self.cfg.work_dir.join("jobs").join(&id);
        let (ckpt_dir, resume_dir, input_dir) = (dir.join("checkpoint"), dir.join("resume"), dir.join("input"));
        let output_dir = dir.join("output");
        // The job's temporary files: under its work dir, so they go with the attempt. The
        // container's /tmp lives as long as the container, on the instance's volume, shared by
        // every job the worker runs (and every project's: they run as one user).
        let tmp_dir = dir.join("tmp");
        let (stop_file, checkpoint_now_file) = (dir.join("STOP"), dir.join("CHECKPOINT_NOW"));
        let prepared = (|| -> std::io::Result<()> {
            if dir.exists() {
                std::fs::remove_dir_all(&dir)?;
            }
            for d in [&ckpt_dir, &resume_dir, &input_dir, &output_dir, &tmp_dir] {
                std::fs::create_dir_all(d)?;
            }
            Ok(())
        })();
        if let Some(img) = &self.cfg.worker_image {
            if &job.spec.image != img {
                let reason = format!("job wants image {:?}; this worker runs {img:?}", job.spec.image);
                report.outcome = self.settle(job, AttemptEnd::Fatal(reason), &report).await;
                return report;
            }
        }
        if let Err(e) = prepared {
            let why = format!("work dir {}: {e}", dir.display());
            report.outcome = self.settle(job, AttemptEnd::Failed(why), &report).await;
            return report;
        }
        let mut uploads = Uploads::default();
        let mut env: Vec<(String, String)> = vec![
            ("ONOFF_JOB_ID".into(), id.clone()),
            ("ONOFF_ATTEMPT".into(), job.attempts.to_string()),
            ("ONOFF_CHECKPOINT_DIR".into(), ckpt_dir.display().to_string()),
            ("ONOFF_STOP_FILE".into(), stop_file.display().to_string()),
            ("ONOFF_OUTPUT_DIR".into(), output_dir.display().to_string()),
            ("TMPDIR".into(), tmp_dir.display().to_string()),
            (
                "ONOFF_CHECKPOINT_NOW_FILE".into(),
                checkpoint_now_file.display().to_string(),
            ),
        ];
        // The latest complete checkpoint, if any: a long download, with the lease kept beside it.
        let resume = async {
            match self.deps.checkpoints.latest(&id).await {
                Ok(Some(r)) => match self.deps.checkpoints.download(&r, &resume_dir).await {
                    Ok(()) => Ok(Some(r.seq)),
                    Err(e) => Err(format!("download checkpoint: {e}")),
                },
                Ok(None) => Ok(None),
                Err(e) => Err(format!("list checkpoints: {e}")),
            }
        };
        match unless(&mut alerts, Interrupt::before_start, resume).await {
            Ok(Ok(Some(seq))) => {
                uploads.remote_seq = seq;
                report.resumed_from = Some(seq);
                env.push(("ONOFF_RESUME_DIR".into(), resume_dir.display().to_string()));
                tracing::info!(job = %id, seq, "resuming from checkpoint");
            }
            Ok(Ok(None)) => {}
            Ok(Err(why)) => {
                report.outcome = self.settle(job, AttemptEnd::Released(why), &report).await;
                return report;
            }
            Err(i) => return self.interrupted(job, report, i).await,
        }
        if let Some(uri) = &job.spec.input {
            let name = parse_s3_uri(uri)
                .and_then(|(_, k)| k.rsplit('/').next())
                // A key's last part may be up to 1,024 bytes; a file name at most 255 (NAME_MAX).
                .filter(|n| !n.is_empty() && *n != "." && *n != ".." && n.len() <= 255)
                .unwrap_or("input");
            let dest = input_dir.join(name);
            match unless(
                &mut alerts,
                Interrupt::before_start,
                self.deps.objects.download(uri, &dest),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    report.outcome = self
                        .settle(job, AttemptEnd::Failed(format!("input {uri}: {e}")), &report)
                        .await;
                    return report;
                }
                Err(i) => return self.interrupted(job, report, i).await,
            }
            env.push(("ONOFF_JOB_INPUT".into(), dest.display().to_string()));
            env.push(("ONOFF_JOB_INPUT_URI".into(), uri.clone()));
        }
        // The transfers may have taken long: start only under a lease this worker still holds
        // (cancelled, or taken by the reaper meanwhile: another worker may be running it).
        if let Some(i) = Interrupt::before_start(&alerts.borrow_and_update()) {
            return self.interrupted(job, report, i).await;
        }
        if let Err(why) = self.renew(&id).await {
            return self.interrupted(job, report, Interrupt::LeaseLost(why)).await;
        }
        // The job's own AWS session, scoped to its input and its prefixes; never the agent's.
        let aws_dir = dir.join(".aws");
        let mut next_session: Option<Instant> = None;
        match self.deps.objects.job_session(&id, job.spec.input.as_deref()).await {
            Ok(Some(creds)) => match write_job_credentials(&aws_dir, &creds, self.cfg.job_user) {
                Ok(vars) => {
                    env.extend(vars);
                    next_session = Some(Instant::now() + Duration::from_secs_f64(creds.lifetime_s / 2.0));
                }
                Err(e) => {
                    let why = format!("job credentials in {}: {e}", aws_dir.display());
                    report.outcome = self.settle(job, AttemptEnd::Failed(why), &report).await;
                    return report;
                }
            },
            Ok(None) => {}
            Err(SessionError::Refused(e)) => {
                report.outcome = self.settle(job, AttemptEnd::Fatal(e), &report).await;
                return report;
            }
            Err(SessionError::Failed(e)) => {
                report.outcome = self.settle(job, AttemptEnd::Failed(e), &report).await;
                return report;
            }
        }
        if let Some((uid, gid)) = self.cfg.job_user {
            // The job's own user owns its work dir (resume data and input included) and HOME.
            if let Err(e) = chown_tree(&dir, uid, gid) {
                let why = format!("work dir {} for uid {uid}: {e}", dir.display());
                report.outcome = self.settle(job, AttemptEnd::Failed(why), &report).await;
                return report;
            }
            env.push(("HOME".into(), dir.display().to_string()));
        }
        let mut defaults: Vec<(String, String)> = Vec::new();
        if let Some(cache) = &self.cache {
            match cache.lend(&job.spec.project, self.cfg.job_user) {
                Ok(d) => {
                    report.cache_bytes_at_start = Some(cache.bytes_of(&job.spec.project));
                    env.push(("ONOFF_CACHE_DIR".into(), d.display().to_string()));
                    // The XDG cache (pip's, Hugging Face's, torch hub's) and the compiled kernels
                    // of Triton and torch.compile go to the project's cache, not under the job's
                    // HOME, which goes with the attempt. An image that sets its own keeps it.
                    defaults = crate::cache::cache_env_defaults(&d);
                }
                Err(e) => tracing::warn!(job = %id, error = %e, "project cache: the job runs without ONOFF_CACHE_DIR"),
            }
        }
        let cmd = JobCommand {
            argv: job.spec.command.clone(),
            env,
            defaults,
            cwd: dir.clone(),
        };
        let mut handle = match self.deps.launcher.start(&cmd) {
            Ok(h) => h,
            Err(e) => {
                report.outcome = self.settle(job, AttemptEnd::Failed(e), &report).await;
                return report;
            }
        };
        let started = Instant::now();
        let mut billed = started;
        let ckpt_every = secs(job.spec.checkpoint_interval_s / self.cfg.time_scale);
        let mut next_ckpt = Instant::now() + ckpt_every;
        // After a rebalance recommendation: look for a new complete checkpoint this often, and
        // upload each one as soon as it is there.
        let mut next_scan: Option<Instant> = None;
        // The upload in flight: polled beside everything else, never awaited alone.
        let mut upload: Option<Pin<Box<dyn Future<Output = Option<Uploaded>> + '_>>> = None;
        let mut items_base: Option<u64> = None;
        let mut stop: Option<ExitReason> = None;
        let mut cancelling = false;
        let mut stop_deadline: Option<Instant> = None;
        // The job's output lines go to its own log stream (`<job_id>/<n>`), a batch at a time,
        // one batch in flight, never holding up this loop.
        let stream = format!("{id}/{}", attempt_number(job));
        let mut log_lines: Vec<(f64, String)> = Vec::new();
        let mut log_flush: Option<Pin<Box<dyn Future<Output = ()> + '_>>> = None;
        let mut next_log_flush = Instant::now() + Duration::from_secs(2);
        let mut rebalanced = false;
        let mut watched = true;
        let far = Instant::now() + Duration::from_secs(86_400 * 365 * 10);
        let exit = loop {
            let a = alerts.borrow_and_update().clone();
            if let Some(why) = a.lease_lost {
                // Another writer ended the lease (the reaper, a cancel): another worker may run
                // the job now. Kill it, its whole process group, and record nothing.
                tracing::error!(job = %id, %why, "lease lost: killing the job");
                let _ = handle.control.send(Control::Kill).await;
                while let Some(ev) = handle.events.recv().await {
                    if let JobEvent::Exited(c) = ev {
                        report.exit = Some(c);
                        break;
                    }
                }
                report.outcome = Outcome::LostLease;
                self.account(&mut report, job, started, &mut billed, None).await;
                return report;
            }
            if let (Some(reason), None) = (&a.stop, &stop) {
                let _ = std::fs::write(&stop_file, b"");
                if !cancelling {
                    let _ = handle.control.send(Control::Stop).await;
                    stop_deadline = Some(Instant::now() + secs(self.cfg.notice_grace_s));
                }
                stop = Some(reason.clone());
            }
            if a.cancel && !cancelling {
                // SIGTERM to the job's process group, the grace period, then SIGKILL.
                cancelling = true;
                let _ = std::fs::write(&stop_file, b"");
                if stop.is_none() {
                    let _ = handle.control.send(Control::Stop).await;
                    stop_deadline = Some(Instant::now() + secs(self.cfg.notice_grace_s));
                }
            }
            if log_flush.is_none()
                && (log_lines.len() >= 500 || (!log_lines.is_empty() && Instant::now() >= next_log_flush))
            {
                let batch = std::mem::take(&mut log_lines);
                let stream = stream.clone();
                log_flush = Some(Box::pin(async move {
                    if let Err(e) = self.deps.objects.log_lines(&stream, &batch).await {
                        tracing::warn!(stream = %stream, error = %e, lines = batch.len(), "job log lines not shipped");
                    }
                }));
                next_log_flush = Instant::now() + Duration::from_secs(2);
            }
            if a.rebalance.is_some() && !rebalanced && stop.is_none() {
                rebalanced = true;
                // Ask for a checkpoint (jobs that honour the file write one and delete it), and
                // upload the newest complete one now.
                let _ = std::fs::write(&checkpoint_now_file, b"");
                next_scan = Some(Instant::now());
            }
            let next_upload = match next_scan {
                Some(scan) => scan.min(next_ckpt),
                None => next_ckpt,
            };
            tokio::select! {
                ev = handle.events.recv() => match ev {
                    Some(JobEvent::Line(l)) => {
                        if let Some(n) = items_line(&l) {
                            // Counts are cumulative over the job; a resumed job first repeats the
                            // count it resumed at, which this attempt did not process.
                            let base = *items_base.get_or_insert(if report.resumed_from.is_some() { n } else { 0 });
                            report.items = Some(n.saturating_sub(base));
                        } else {
                            tracing::info!(job = %id, "| {l}");
                        }
                        log_lines.push((self.clock.now(), l));
                    }
                    Some(JobEvent::Exited(exit)) => break exit,
                    None => break JobExit::Unknown,
                },
                changed = alerts.changed(), if watched => {
                    // The sender lives until the attempt ends; were it gone, the job would run
                    // on unwatched rather than the loop spin.
                    watched = changed.is_ok();
                }
                () = sleep_until(next_upload), if upload.is_none() && stop.is_none() => {
                    let regular = Instant::now() >= next_ckpt;
                    if regular {
                        next_ckpt = Instant::now() + ckpt_every;
                    }
                    if let Some(scan) = &mut next_scan {
                        *scan = Instant::now() + secs(self.cfg.imds_poll_s);
                    }
                    if uploads.behind(&ckpt_dir) {
                        upload = Some(Box::pin(self.upload_newest(&id, &ckpt_dir, uploads)));
                    } else if regular {
                        self.account(&mut report, job, started, &mut billed, None).await;
                    }
                }
                done = poll_some(&mut upload) => {
                    upload = None;
                    let prefix = done.map(|u| {
                        uploads = u.uploads;
                        report.checkpoints_uploaded += 1;
                        u.prefix
                    });
                    self.account(&mut report, job, started, &mut billed, prefix).await;
                }
                () = sleep_until(next_session.unwrap_or(far)), if next_session.is_some() => {
                    // A new session before the old one expires: the job's SDKs read the file again
                    // as their credentials near expiry. A failure keeps the old one (valid for the
                    // other half of its life) and tries again in a minute.
                    let renewed = match self.deps.objects.job_session(&id, job.spec.input.as_deref()).await {
                        Ok(Some(creds)) => write_job_credentials(&aws_dir, &creds, self.cfg.job_user)
                            .map(|_| creds.lifetime_s)
                            .map_err(|e| e.to_string()),
                        Ok(None) => Err("no job role any more".into()),
                        Err(e) => Err(e.to_string()),
                    };
                    next_session = Some(match renewed {
                        Ok(lifetime_s) => Instant::now() + Duration::from_secs_f64(lifetime_s / 2.0),
                        Err(e) => {
                            tracing::warn!(job = %id, error = %e, "renew the job's AWS session (tried again in 60 s)");
                            Instant::now() + Duration::from_secs(60)
                        }
                    });
                }
                () = sleep_until(stop_deadline.unwrap_or(far)), if stop_deadline.is_some() => {
                    tracing::warn!(job = %id, "grace period over: killing the job");
                    let _ = handle.control.send(Control::Kill).await;
                    stop_deadline = None;
                }
                () = poll_some(&mut log_flush) => log_flush = None,
                () = sleep_until(next_log_flush), if log_flush.is_none() && !log_lines.is_empty() => {}
            }
        };
        // The rest of the job's output, before the attempt is recorded.
        if let Some(f) = log_flush.take() {
            f.await;
        }
        if !log_lines.is_empty() {
            if let Err(e) = self.deps.objects.log_lines(&stream, &log_lines).await {
                tracing::warn!(stream = %stream, error = %e, "job log lines not shipped");
            }
        }
        let cancelling = cancelling || alerts.borrow().cancel;
        report.exit = Some(exit);
        report.completed = exit == JobExit::Code(0);
        if report.completed {
            // SUCCEEDED is recorded before anything optional: a job that exited 0 must never run
            // again, whatever a last upload does (nobody resumes a finished job's checkpoint). An
            // upload still in flight is abandoned.
            drop(upload);
            self.account(&mut report, job, started, &mut billed, None).await;
            report.outcome = self.settle(job, AttemptEnd::Succeeded, &report).await;
            tracing::info!(job = %id, seconds = report.seconds, cost_usd = report.cost_usd, outcome = report.outcome.as_str(), "exited 0");
            if report.outcome == Outcome::Succeeded {
                self.upload_outputs(job, &output_dir, &stream, &mut report).await;
            }
            return report;
        }
        if cancelling {
            // Cancelled: it never runs again, so no last checkpoint; its outputs go up.
            drop(upload);
            self.account(&mut report, job, started, &mut billed, None).await;
            report.outcome = self.settle(job, AttemptEnd::Cancelled, &report).await;
            tracing::info!(job = %id, outcome = report.outcome.as_str(), "cancelled by the user");
            if report.outcome != Outcome::LostLease {
                self.upload_outputs(job, &output_dir, &stream, &mut report).await;
            }
            return report;
        }
        // The newest complete checkpoint goes up before the attempt ends: the resume or the retry
        // starts from it. The one in flight finishes first (the newer one gets the next number).
        // Only a lost lease cuts this short: a stop has already been acted on.
        let last = async {
            let mut uploads = uploads;
            let mut prefixes = Vec::new();
            if let Some(u) = upload.take() {
                if let Some(u) = u.await {
                    uploads = u.uploads;
                    prefixes.push(u.prefix);
                }
            }
            if uploads.behind(&ckpt_dir) {
                if let Some(u) = self.upload_newest(&id, &ckpt_dir, uploads).await {
                    prefixes.push(u.prefix);
                }
            }
            prefixes
        };
        let prefixes = match unless(&mut alerts, Interrupt::lease_lost, last).await {
            Ok(p) => p,
            Err(i) => return self.interrupted(job, report, i).await,
        };
        report.checkpoints_uploaded += prefixes.len() as u32;
        self.account(&mut report, job, started, &mut billed, prefixes.last().cloned())
            .await;
        if let Some(reason) = stop {
            let why = match &reason {
                ExitReason::Notice(n) => format!("{n:?}"),
                other => format!("{other:?}"),
            };
            report.outcome = self.settle(job, AttemptEnd::Released(why), &report).await;
            tracing::info!(job = %id, outcome = report.outcome.as_str(), "stopped for {reason:?}");
            return report;
        }
        // The agent asked for no end here (a stop and a cancel are settled above): whatever
        // signal ended the job came from elsewhere, the kernel's OOM killer most often.
        let why = exit.describe();
        report.outcome = self.settle(job, AttemptEnd::Failed(why), &report).await;
        if report.outcome != Outcome::LostLease {
            self.upload_outputs(job, &output_dir, &stream, &mut report).await;
        }
        report
    }

    /// End an attempt that was interrupted before or after its process ran.
    async fn interrupted(&self, job: &JobRecord, mut report: JobReport, i: Interrupt) -> JobReport {
        match i {
            Interrupt::LeaseLost(why) => {
                tracing::error!(job = %job.id, %why, "lease lost: the job is not run here");
                report.outcome = Outcome::LostLease;
            }
            Interrupt::Stop(reason) => {
                tracing::info!(job = %job.id, "stopped for {reason:?} before the job started");
                let end = AttemptEnd::Released(format!("{reason:?} before the job started"));
                report.outcome = self.settle(job, end, &report).await;
            }
            Interrupt::Cancel => {
                tracing::info!(job = %job.id, "cancelled by the user before the job started");
                report.outcome = self.settle(job, AttemptEnd::Cancelled, &report).await;
            }
        }
        report
    }

    /// Upload the job's `ONOFF_OUTPUT_DIR` to `outputs/<job_id>/` (after the attempt is recorded:
    /// a failed upload changes no outcome), then record on the job's row what became of them
    /// ([`OutputsRecord`]: `onoff status` and `onoff outputs` show it) unless there were none. A
    /// failure is logged, and told in the attempt's own log `stream` too, where the job's user
    /// reads its output (`onoff logs`).
    async fn upload_outputs(&self, job: &JobRecord, dir: &Path, stream: &str, report: &mut JobReport) {
        let id = &job.id;
        let record = match self.deps.objects.upload_outputs(id, dir).await {
            Ok(0) => None,
            Ok(n) => {
                report.outputs_uploaded = n;
                tracing::info!(job = %id, files = n, "outputs uploaded");
                Some((n, None))
            }
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "outputs not uploaded");
                let line = format!("onoff agent: the job's outputs were not uploaded: {e}");
                if let Err(e) = self.deps.objects.log_lines(stream, &[(self.clock.now(), line)]).await {
                    tracing::warn!(stream = %stream, error = %e, "job log line not shipped");
                }
                Some((0, Some(e)))
            }
        };
        if let Some((files, error)) = record {
            let outputs = OutputsRecord {
                attempt: attempt_number(job),
                files: u32::try_from(files).unwrap_or(u32::MAX),
                error,
                at: self.clock.now(),
            };
            if let Err(e) = self.deps.jobs.record_outputs(id, &outputs).await {
                tracing::warn!(job = %id, error = %e, "what became of the outputs not recorded on the job");
            }
        }
    }

    /// This worker's price, $/h. A worker the agent registered itself (price 0) reads its row
    /// again until the reaper has written its offering's price there
    /// (`onoff_control::reconcile`, within a run of the reconciler); 0 until then.
    async fn price(&self) -> f64 {
        if self.price_usd_per_h.get() == 0.0 {
            match self.deps.registry.get(self.id()).await {
                Ok(Some(r)) if r.price_usd_per_h > 0.0 => {
                    tracing::info!(price_usd_per_h = r.price_usd_per_h, "priced by the control plane");
                    self.price_usd_per_h.set(r.price_usd_per_h);
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "reading this worker's price"),
            }
        }
        self.price_usd_per_h.get()
    }

    /// Add the cost since the last record (and the new checkpoint, if any) to the job record. A
    /// stretch run before the worker had a price is charged at the first record after it has one.
    async fn account(
        &self,
        report: &mut JobReport,
        job: &JobRecord,
        started: Instant,
        billed: &mut Instant,
        checkpoint: Option<String>,
    ) {
        let now = Instant::now();
        let price = self.price().await;
        let delta_s = (now - *billed).as_secs_f64() * self.cfg.time_scale;
        let delta_usd = price * delta_s / 3600.0;
        // Time not yet priced is held back, and charged once the price is known.
        if price > 0.0 {
            *billed = now;
        }
        report.seconds = (now - started).as_secs_f64() * self.cfg.time_scale;
        report.gpu_seconds = report.seconds * f64::from(job.spec.gpus);
        report.cost_usd += delta_usd;
        if checkpoint.is_some() {
            report.checkpoint.clone_from(&checkpoint);
        }
        // The job's cost so far as a value (what the claim returned plus this attempt's), not an
        // increment: a retried write whose first answer was lost sets the same value.
        let total_usd = job.cost_usd + report.cost_usd;
        if let Err(e) = self
            .deps
            .jobs
            .record_progress(&job.id, self.id(), checkpoint.as_deref(), total_usd)
            .await
        {
            tracing::warn!(job = %job.id, error = %e, "record progress");
        }
    }

    /// Upload the newest complete local checkpoint if it is newer than the last one uploaded
    /// (`done`); returns what was uploaded.
    async fn upload_newest(&self, id: &str, dir: &Path, done: Uploads) -> Option<Uploaded> {
        let newest = newest_checkpoint(dir).filter(|_| done.behind(dir))?;
        let seq = done.remote_seq + 1;
        let path: PathBuf = dir.join(newest.to_string());
        // The job may delete this checkpoint once it has written a newer one, long before a
        // checkpoint of many GB is up: upload from hard links of its files.
        let staged = dir.with_file_name("uploading").join(newest.to_string());
        let from = match stage(&path, &staged) {
            Ok(()) => staged.clone(),
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "cannot stage the checkpoint: uploading it in place");
                path
            }
        };
        let uploaded = self.deps.checkpoints.upload(id, seq, &from).await;
        let _ = std::fs::remove_dir_all(&staged);
        match uploaded {
            Ok(_) => {
                tracing::info!(job = %id, seq, "checkpoint uploaded");
                Some(Uploaded {
                    uploads: Uploads {
                        local: Some(newest),
                        remote_seq: seq,
                    },
                    prefix: checkpoint_prefix(id, seq),
                })
            }
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "checkpoint upload (the previous one still counts)");
                None
            }
        }
    }

    /// A job that asks for more GPUs than this worker has: give it back unrun (not counted) with a
    /// fresh wake-up message after the retry delay, for a worker that fits, usually the one the
    /// scaler launched for it; FAILED after `max_hand_backs`. This worker stays idle.
    async fn hand_back(&mut self, job: &JobRecord) {
        let mine = self.cfg.gpus.unwrap_or_default();
        tracing::info!(job = %job.id, wants = job.spec.gpus, has = mine, "job needs more GPUs: handed back");
        self.report.handed_back += 1;
        let why = format!("needs {} GPUs, worker {} has {mine}", job.spec.gpus, self.id());
        self.end_attempt(job, AttemptEnd::HandedBack(why), None).await;
    }

    /// A job this worker holds the claim of: handed back when it needs more GPUs than this worker
    /// has, deferred when its deadline keeps it off this (spot) worker, run otherwise. `Some`
    /// when the agent must exit.
    async fn run_claimed(&mut self, lane: &str, job: JobRecord, shutdown: Shutdown<'_>) -> Option<ExitReason> {
        if self.cfg.gpus.is_some_and(|g| job.spec.gpus > g) {
            self.hand_back(&job).await;
            return None;
        }
        if job.spec.est_runtime_s.is_none()
            && self.run_time_estimate_s.is_none()
            && job.spec.lane == self.row_lane
            && self
                .estimate_read_at
                .is_none_or(|t| self.clock.now() - t >= ESTIMATE_REREAD_S)
        {
            self.read_run_time_estimate().await;
        }
        if let Some(why) = self.keeps_off_this_worker(&job) {
            self.defer(&job, why).await;
            return None;
        }
        let (report, exit) = self.run_job(lane, job, shutdown).await;
        self.emit(&report);
        self.report.jobs.push(report);
        exit
    }

    /// Why this worker must not run `job` now, if it must not: a spot worker and a job whose
    /// deadline it would put at risk ([`keeps_off_spot`] with the job's run time as
    /// [`Worker::runtime_of`] counts it, and its creation as the time it queued, as the
    /// reconciler sees it); or an on-demand worker of a spot-first lane and a job whose
    /// on-demand premium here is worth more than the spot launch and the wait it saves
    /// ([`worth_an_on_demand_worker`]), unless its deadline is at risk on spot or this worker
    /// was launched for it.
    fn keeps_off_this_worker(&self, job: &JobRecord) -> Option<String> {
        let p = &self.cfg.policy;
        let runtime = self.runtime_of(job);
        let now = self.clock.now();
        let at_risk = keeps_off_spot(job.spec.deadline, runtime, now, job.created_at, p);
        if self.me.lifecycle != "spot" {
            let spot = self.spot_price_usd_per_h?;
            let price = self.price_usd_per_h.get();
            let waited = now - job.created_at;
            let mine = self.report.pinned_claimed.as_deref() == Some(job.id.as_str());
            if at_risk || mine || worth_an_on_demand_worker(price, spot, 1, runtime, waited, p) {
                return None;
            }
            return Some(format!(
                "waiting for spot: on-demand worker {} costs ${:.2} more for its {runtime:.0} s than spot \
                 ({price:.3} against {spot:.3} $/h), more than the launch and the wait it saves",
                self.id(),
                (price - spot) * runtime / 3600.0
            ));
        }
        at_risk.then(|| {
            let slack = job.spec.deadline.unwrap_or(now) - now - runtime;
            format!(
                "deadline at risk on spot: {slack:.0} s of slack, under {:.0} s; worker {} is spot",
                spot_start_slack_s(p),
                self.id()
            )
        })
    }

    /// `job`'s run time, seconds: declared; else, for a job of this worker's lane, the estimate
    /// the policy counted such a job with when it launched or last started this worker, or when
    /// it first gave the row one (its row's [`WorkerRecord::run_time_estimate_s`]); else the
    /// policy's `offers.default_runtime_s`.
    fn runtime_of(&self, job: &JobRecord) -> f64 {
        let estimate = self.run_time_estimate_s.filter(|_| job.spec.lane == self.row_lane);
        job.spec
            .est_runtime_s
            .or(estimate)
            .unwrap_or(self.cfg.policy.offers.default_runtime_s)
    }

    /// Read this worker's row again for a run-time estimate its launch or start did not give
    /// it: the reconciler writes the lane's on rows without one once the lane has one
    /// (`onoff_control::reconcile::give_run_time_estimates`). One `GetItem` at a claimed job of
    /// the row's lane that declares no run time, at most one per [`ESTIMATE_REREAD_S`], until
    /// the row has a figure (a lane that never gets one costs a read a minute at most, however
    /// many jobs it claims); a failed read keeps none.
    async fn read_run_time_estimate(&mut self) {
        self.estimate_read_at = Some(self.clock.now());
        match self.deps.registry.get(self.id()).await {
            Ok(Some(r)) => self.run_time_estimate_s = r.run_time_estimate_s,
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "reading this worker's run-time estimate"),
        }
    }

    /// Give a job back unrun, for on-demand capacity or for spot (not counted, not bounded): a
    /// fresh wake-up message after the retry delay. This worker stays idle.
    async fn defer(&mut self, job: &JobRecord, why: String) {
        tracing::info!(job = %job.id, reason = %why, "job deferred");
        self.report.deferred += 1;
        self.end_attempt(job, AttemptEnd::Deferred(why), None).await;
    }

    /// Claim, by id and without its message, the job the scaler launched this worker for (a
    /// deadline at risk on spot) and run it. The job's message stays in the queue; whoever
    /// receives it later drops it as not claimable. Nothing happens when the job is no longer
    /// queued (another worker took it) or the claim fails: the queue serves it then. `Some` when
    /// the agent must exit.
    async fn run_pinned(&mut self, job_id: &str, shutdown: Shutdown<'_>) -> Option<ExitReason> {
        if let Some(n) = self.notice().await {
            return Some(ExitReason::Notice(n));
        }
        let now = self.clock.now();
        let owner = self.id().to_string();
        match self.deps.registry.mark_busy(&owner, now).await {
            Ok(true) => {}
            Ok(false) => return Some(ExitReason::Drained),
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "mark busy failed: pinned job left to the queue");
                return None;
            }
        }
        match self.deps.jobs.claim(job_id, &owner, now + self.cfg.lease_s, now).await {
            Ok(Claim::Claimed(rec)) => {
                tracing::info!(job = %job_id, "claimed the job this worker was launched for");
                self.report.pinned_claimed = Some(job_id.to_string());
                let lane = rec.spec.lane.clone();
                self.run_claimed(&lane, *rec, shutdown).await
            }
            Ok(other) => {
                tracing::info!(job = %job_id, claim = ?other, "pinned job not claimable: left to the queue");
                None
            }
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "claim of the pinned job failed: left to the queue");
                None
            }
        }
    }

    /// Deregister, and terminate the instance when the exit calls for it; a stopped worker does
    /// neither (its row stays Stopped for a start).
    async fn leave(&self, exit: &ExitReason) {
        if *exit == ExitReason::Stopped {
            let _ = std::fs::remove_file(self.cfg.health_file());
            return;
        }
        if let Err(e) = self
            .deps
            .registry
            .heartbeat(self.id(), WorkerState::Terminating, None, self.clock.now())
            .await
        {
            tracing::warn!(error = %e, "deregister");
        }
        let _ = std::fs::remove_file(self.cfg.health_file());
        let terminate = !matches!(exit, ExitReason::Shutdown) && self.cfg.shutdown != ShutdownMode::None;
        if terminate {
            tracing::info!(reason = ?exit, "terminating this instance");
            if let Err(e) = self.deps.instance.terminate_self(self.id()).await {
                tracing::error!(error = %e, "terminate this instance");
            }
        }
    }
}
