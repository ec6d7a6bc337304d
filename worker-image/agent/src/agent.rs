//! The agent's loop: register, poll, claim, run, checkpoint, react to notices, exit when idle.
//!
//! Everything goes through the ports in [`crate::ports`] and tokio time, so the whole loop runs in
//! tests against fakes with paused time.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use onoff_control::job::{parse_s3_uri, AttemptEnd, JobState, Settle};
use onoff_control::ports::{
    checkpoint_prefix, wake, CheckpointStore, Claim, JobRecord, JobStore, StoreError, WorkerRecord,
};
use onoff_policy::{CapacityType, OfferingKey, WorkerState};
use tokio::time::{sleep_until, Instant};

use crate::config::{AgentConfig, ShutdownMode};
use crate::ports::{
    Control, Identity, Inbox, Instance, JobCommand, JobEvent, Launcher, Message, Metadata, Notice, Objects, Registry,
};

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

/// Why the agent stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// No job for the idle timeout: deregistered and terminated its instance.
    IdleTimeout,
    /// A spot interruption notice or rebalance recommendation: released its job, deregistered and
    /// terminated its instance.
    Notice(Notice),
    /// Asked to stop (SIGTERM/SIGINT to the agent): released its job and deregistered.
    Shutdown,
    /// The control plane is retiring this worker (its row is Draining or Terminating: a
    /// scale-down, or an interruption notice): it takes no new work, deregistered and terminated
    /// its instance.
    Drained,
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
    /// The lease was lost (expired and taken over): the job was killed, nothing recorded.
    LostLease,
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
    /// The process's exit code (`None`: killed by a signal, or never started).
    pub exit_code: Option<i32>,
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
}

impl JobReport {
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
    /// Messages dropped because their job was finished or held by another worker's live lease.
    pub dropped: u32,
    /// Messages left for the dead-letter queue (malformed, unknown job), each with an error record.
    pub poison: u32,
    /// Jobs handed back to their lane unrun because they ask for more GPUs than this worker has
    /// (`ONOFF_GPUS`).
    pub handed_back: u32,
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

/// `ONOFF_ITEMS <n>` lines.
fn items_line(line: &str) -> Option<u64> {
    line.trim().strip_prefix("ONOFF_ITEMS")?.trim().parse().ok()
}

type Shutdown<'a> = Pin<&'a mut (dyn Future<Output = ()> + Send)>;

struct Worker<'a, M, Q, J, R, C, O, I, L> {
    deps: &'a Deps<M, Q, J, R, C, O, I, L>,
    cfg: &'a AgentConfig,
    clock: Clock,
    me: Identity,
    lanes: Vec<String>,
    price_usd_per_h: f64,
    report: AgentReport,
}

/// Run the agent until it exits (idle timeout, notice, or `shutdown` resolving). `start_unix`:
/// the unix time now (the agent's clock advances with tokio's).
///
/// # Errors
/// [`AgentError`] when IMDS or the workers table cannot be reached at start; later failures are
/// logged and retried.
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
    let record = deps.registry.get(&me.instance_id).await?;
    let (lane, price) = match record {
        Some(r) => (r.lane, r.price_usd_per_h),
        None => {
            let lane = cfg.lanes.first().cloned().unwrap_or_else(|| "standard".into());
            let capacity_type = if me.lifecycle == "spot" {
                CapacityType::Spot
            } else {
                CapacityType::OnDemand
            };
            deps.registry
                .register(WorkerRecord {
                    id: me.instance_id.clone(),
                    lane: lane.clone(),
                    offering: OfferingKey {
                        instance_type: me.instance_type.clone(),
                        zone: me.zone.clone(),
                        capacity_type,
                    },
                    price_usd_per_h: 0.0,
                    state: WorkerState::Pending,
                    launched_at: clock.now(),
                    project: None,
                    idle_since: None,
                    heartbeat_at: None,
                })
                .await?;
            tracing::warn!(instance = %me.instance_id, "not registered by the control plane: registered with price 0");
            (lane, 0.0)
        }
    };
    let lanes = if cfg.lanes.is_empty() {
        vec![lane]
    } else {
        cfg.lanes.clone()
    };
    tracing::info!(instance = %me.instance_id, ?lanes, price_usd_per_h = price, "agent started");
    let mut w = Worker {
        deps,
        cfg,
        clock,
        me,
        lanes,
        price_usd_per_h: price,
        report: AgentReport {
            exit: ExitReason::Shutdown,
            jobs: Vec::new(),
            dropped: 0,
            poison: 0,
            handed_back: 0,
        },
    };
    let mut shutdown: Pin<Box<dyn Future<Output = ()> + Send + '_>> = Box::pin(shutdown);
    let exit = w.serve(shutdown.as_mut()).await;
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
        let mut next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
        let mut next_poll = Instant::now();
        loop {
            if Instant::now() >= next_poll {
                next_poll = Instant::now() + secs(self.cfg.imds_poll_s);
                if let Some(n) = self.notice().await {
                    tracing::warn!(notice = ?n, "notice while idle: draining");
                    return ExitReason::Notice(n);
                }
            }
            let idle_for = idle_at.elapsed().as_secs_f64();
            if idle_for >= self.cfg.idle_timeout_s {
                tracing::info!(idle_s = idle_for, "idle timeout");
                return ExitReason::IdleTimeout;
            }
            if Instant::now() >= next_heartbeat {
                next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
                if !self.heartbeat(WorkerState::Idle, Some(idle_since), None).await {
                    return ExitReason::Drained;
                }
            }
            // Long-poll no longer than the next thing to do.
            let until_next = [
                self.cfg.idle_timeout_s - idle_for,
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

    /// One message from the lanes, preferred lane first; long-polls the last lane for `wait_s`.
    async fn receive(&self, wait_s: f64) -> Option<Message> {
        let visibility = self.cfg.lease_s.ceil() as u32;
        for (i, lane) in self.lanes.iter().enumerate() {
            let wait = if i + 1 == self.lanes.len() {
                wait_s.floor().max(0.0) as u32
            } else {
                0
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
        let job_id = serde_json::from_str::<serde_json::Value>(&msg.body)
            .ok()
            .and_then(|v| v.get("job_id")?.as_str().map(str::to_string));
        let Some(job_id) = job_id else {
            let excerpt: String = msg.body.chars().take(200).collect();
            let reason = format!("job message is not {{\"job_id\": \"...\"}}: {excerpt:?}");
            self.poison(&msg, &format!("sqs:{}", msg.message_id), &reason).await;
            return None;
        };
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
                if self.cfg.gpus.is_some_and(|g| rec.spec.gpus > g) {
                    self.hand_back(&rec).await;
                    return None;
                }
                let (report, exit) = self.run_job(&msg.lane, *rec, shutdown).await;
                self.emit(&report);
                self.report.jobs.push(report);
                exit
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
                // The row exists and cannot be read: nothing can run it. Poison, with its reason.
                let reason = format!("job {job_id} cannot be read: {e}");
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
                ("ExitCode", r.exit_code.into()),
                ("Completed", r.completed.into()),
                ("ResumedFrom", r.resumed_from.into()),
            ],
        );
        onoff_control::emf::emit(&line);
    }

    /// End the attempt as `end` says: one conditional write under this worker's lease, then a
    /// fresh wake-up message when the job is to run again. `None` when the lease was lost (the
    /// reaper or another worker has the job: nothing recorded here).
    async fn end_attempt(&mut self, job: &JobRecord, end: AttemptEnd) -> Option<JobState> {
        let settle = Settle::of(job, &end, &self.cfg.rerun_limits);
        let now = self.clock.now();
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
            if let Err(e) = wake(&self.deps.jobs, &self.deps.inbox, &job.id, &job.spec.lane, delay, now).await {
                // The row is pending with no recent message: the reaper sends one.
                tracing::warn!(job = %job.id, error = %e, "wake-up message after the attempt");
            }
        }
        Some(settle.to)
    }

    /// [`Self::end_attempt`] as an [`Outcome`].
    async fn settle(&mut self, job: &JobRecord, end: AttemptEnd) -> Outcome {
        match self.end_attempt(job, end).await {
            Some(JobState::Succeeded) => Outcome::Succeeded,
            Some(JobState::Failed) => Outcome::Failed,
            Some(JobState::Retrying) => Outcome::Retrying,
            Some(_) => Outcome::Released,
            None => Outcome::LostLease,
        }
    }

    async fn run_job(
        &mut self,
        lane: &str,
        job: JobRecord,
        mut shutdown: Shutdown<'_>,
    ) -> (JobReport, Option<ExitReason>) {
        let id = job.id.clone();
        let owner = self.id().to_string();
        tracing::info!(job = %id, attempt = job.attempts, %lane, "claimed");
        let _ = self.heartbeat(WorkerState::Running, None, Some(&id)).await;
        let mut report = JobReport {
            job_id: id.clone(),
            attempt: job.attempts,
            started_at: self.clock.now(),
            outcome: Outcome::Failed,
            exit_code: None,
            completed: false,
            resumed_from: None,
            checkpoints_uploaded: 0,
            seconds: 0.0,
            gpu_seconds: 0.0,
            cost_usd: 0.0,
            items: None,
        };
        let dir = self.cfg.work_dir.join("jobs").join(&id);
        let (ckpt_dir, resume_dir, input_dir) = (dir.join("checkpoint"), dir.join("resume"), dir.join("input"));
        let prepared = (|| -> std::io::Result<()> {
            if dir.exists() {
                std::fs::remove_dir_all(&dir)?;
            }
            for d in [&ckpt_dir, &resume_dir, &input_dir] {
                std::fs::create_dir_all(d)?;
            }
            Ok(())
        })();
        if let Some(img) = &self.cfg.worker_image {
            if &job.spec.image != img {
                let reason = format!("job wants image {:?}; this worker runs {img:?}", job.spec.image);
                report.outcome = self.settle(&job, AttemptEnd::Fatal(reason)).await;
                return (report, None);
            }
        }
        if let Err(e) = prepared {
            let why = format!("work dir {}: {e}", dir.display());
            report.outcome = self.settle(&job, AttemptEnd::Failed(why)).await;
            return (report, None);
        }
        // The latest complete checkpoint, if any.
        let mut remote_seq = 0;
        let mut env: Vec<(String, String)> = vec![
            ("ONOFF_JOB_ID".into(), id.clone()),
            ("ONOFF_ATTEMPT".into(), job.attempts.to_string()),
            ("ONOFF_CHECKPOINT_DIR".into(), ckpt_dir.display().to_string()),
            ("ONOFF_STOP_FILE".into(), dir.join("STOP").display().to_string()),
        ];
        match self.deps.checkpoints.latest(&id).await {
            Ok(Some(r)) => match self.deps.checkpoints.download(&r, &resume_dir).await {
                Ok(()) => {
                    remote_seq = r.seq;
                    report.resumed_from = Some(r.seq);
                    env.push(("ONOFF_RESUME_DIR".into(), resume_dir.display().to_string()));
                    tracing::info!(job = %id, seq = r.seq, "resuming from checkpoint");
                }
                Err(e) => {
                    let why = format!("download checkpoint: {e}");
                    report.outcome = self.settle(&job, AttemptEnd::Released(why)).await;
                    return (report, None);
                }
            },
            Ok(None) => {}
            Err(e) => {
                let why = format!("list checkpoints: {e}");
                report.outcome = self.settle(&job, AttemptEnd::Released(why)).await;
                return (report, None);
            }
        }
        if let Some(uri) = &job.spec.input {
            let name = parse_s3_uri(uri)
                .and_then(|(_, k)| k.rsplit('/').next())
                .filter(|n| !n.is_empty() && *n != "." && *n != "..")
                .unwrap_or("input");
            let dest = input_dir.join(name);
            if let Err(e) = self.deps.objects.download(uri, &dest).await {
                report.outcome = self.settle(&job, AttemptEnd::Failed(format!("input {uri}: {e}"))).await;
                return (report, None);
            }
            env.push(("ONOFF_JOB_INPUT".into(), dest.display().to_string()));
            env.push(("ONOFF_JOB_INPUT_URI".into(), uri.clone()));
        }
        let cmd = JobCommand {
            argv: job.spec.command.clone(),
            env,
            cwd: dir.clone(),
        };
        let mut handle = match self.deps.launcher.start(&cmd) {
            Ok(h) => h,
            Err(e) => {
                report.outcome = self.settle(&job, AttemptEnd::Failed(e)).await;
                return (report, None);
            }
        };
        let started = Instant::now();
        let mut billed = started;
        let mut local_uploaded: Option<u64> = None;
        let renew_every = secs(self.cfg.lease_s / 3.0);
        let ckpt_every = secs(job.spec.checkpoint_interval_s / self.cfg.time_scale);
        let mut next_renew = Instant::now() + renew_every;
        let mut next_ckpt = Instant::now() + ckpt_every;
        let mut next_poll = Instant::now() + secs(self.cfg.imds_poll_s);
        let mut next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
        let mut stop: Option<ExitReason> = None;
        let mut items_base: Option<u64> = None;
        let mut stop_deadline: Option<Instant> = None;
        let exit_code = loop {
            let kill_at = stop_deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
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
                    }
                    Some(JobEvent::Exited(code)) => break code,
                    None => break None,
                },
                () = sleep_until(next_renew) => {
                    next_renew = Instant::now() + renew_every;
                    let until = self.clock.now() + self.cfg.lease_s;
                    match self.deps.jobs.renew(&id, &owner, until).await {
                        Ok(()) => {}
                        Err(StoreError::Conflict(e)) => {
                            tracing::error!(job = %id, error = %e, "lease lost: killing the job");
                            let _ = handle.control.send(Control::Kill).await;
                            while let Some(ev) = handle.events.recv().await {
                                if let JobEvent::Exited(c) = ev {
                                    report.exit_code = c;
                                    break;
                                }
                            }
                            report.outcome = Outcome::LostLease;
                            self.account(&mut report, &job, started, &mut billed, None).await;
                            return (report, None);
                        }
                        Err(e) => tracing::warn!(job = %id, error = %e, "renew lease"),
                    }
                }
                () = sleep_until(next_ckpt), if stop.is_none() => {
                    next_ckpt = Instant::now() + ckpt_every;
                    let uploaded = self.upload_newest(&id, &ckpt_dir, &mut local_uploaded, &mut remote_seq).await;
                    if uploaded.is_some() {
                        report.checkpoints_uploaded += 1;
                    }
                    self.account(&mut report, &job, started, &mut billed, uploaded).await;
                }
                () = sleep_until(next_poll), if stop.is_none() => {
                    next_poll = Instant::now() + secs(self.cfg.imds_poll_s);
                    if let Some(n) = self.notice().await {
                        tracing::warn!(job = %id, notice = ?n, "notice: asking the job to checkpoint and stop");
                        stop = Some(ExitReason::Notice(n));
                    }
                }
                () = &mut shutdown, if stop.is_none() => {
                    tracing::warn!(job = %id, "agent shutdown: asking the job to checkpoint and stop");
                    stop = Some(ExitReason::Shutdown);
                }
                () = sleep_until(next_heartbeat) => {
                    next_heartbeat = Instant::now() + secs(self.cfg.heartbeat_s);
                    let state = if stop.is_some() { WorkerState::Draining } else { WorkerState::Running };
                    let _ = self.heartbeat(state, None, Some(&id)).await;
                }
                () = sleep_until(kill_at), if stop_deadline.is_some() => {
                    tracing::warn!(job = %id, "grace period over: killing the job");
                    let _ = handle.control.send(Control::Kill).await;
                    stop_deadline = Some(Instant::now() + Duration::from_secs(86_400 * 365));
                }
            }
            if stop.is_some() && stop_deadline.is_none() {
                let _ = self.heartbeat(WorkerState::Draining, None, Some(&id)).await;
                let _ = std::fs::write(dir.join("STOP"), b"");
                let _ = handle.control.send(Control::Stop).await;
                stop_deadline = Some(Instant::now() + secs(self.cfg.notice_grace_s));
            }
        };
        report.exit_code = exit_code;
        report.completed = exit_code == Some(0);
        if report.completed {
            // SUCCEEDED is recorded before anything optional: a job that exited 0 must never run
            // again, whatever a last upload does (nobody resumes a finished job's checkpoint).
            self.account(&mut report, &job, started, &mut billed, None).await;
            report.outcome = self.settle(&job, AttemptEnd::Succeeded).await;
            tracing::info!(job = %id, seconds = report.seconds, cost_usd = report.cost_usd, outcome = report.outcome.as_str(), "exited 0");
            return (report, stop);
        }
        // The newest complete checkpoint goes up before the attempt ends: the resume or the retry
        // starts from it.
        let uploaded = self
            .upload_newest(&id, &ckpt_dir, &mut local_uploaded, &mut remote_seq)
            .await;
        if uploaded.is_some() {
            report.checkpoints_uploaded += 1;
        }
        self.account(&mut report, &job, started, &mut billed, uploaded).await;
        if let Some(reason) = stop {
            let why = match &reason {
                ExitReason::Notice(n) => format!("{n:?}"),
                other => format!("{other:?}"),
            };
            report.outcome = self.settle(&job, AttemptEnd::Released(why)).await;
            tracing::info!(job = %id, outcome = report.outcome.as_str(), "stopped for {reason:?}");
            return (report, Some(reason));
        }
        let why = match exit_code {
            Some(c) => format!("exit code {c}"),
            None => "killed by a signal".to_string(),
        };
        report.outcome = self.settle(&job, AttemptEnd::Failed(why)).await;
        (report, None)
    }

    /// Add the cost since the last record (and the new checkpoint, if any) to the job record.
    async fn account(
        &self,
        report: &mut JobReport,
        job: &JobRecord,
        started: Instant,
        billed: &mut Instant,
        checkpoint: Option<String>,
    ) {
        let now = Instant::now();
        let delta_s = (now - *billed).as_secs_f64() * self.cfg.time_scale;
        let delta_usd = self.price_usd_per_h * delta_s / 3600.0;
        *billed = now;
        report.seconds = (now - started).as_secs_f64() * self.cfg.time_scale;
        report.gpu_seconds = report.seconds * f64::from(job.spec.gpus);
        report.cost_usd += delta_usd;
        if let Err(e) = self
            .deps
            .jobs
            .record_progress(&job.id, self.id(), checkpoint.as_deref(), delta_usd)
            .await
        {
            tracing::warn!(job = %job.id, error = %e, "record progress");
        }
    }

    /// Upload the newest complete local checkpoint if it is newer than the last one uploaded;
    /// returns its prefix.
    async fn upload_newest(
        &self,
        id: &str,
        dir: &Path,
        local_uploaded: &mut Option<u64>,
        remote_seq: &mut u64,
    ) -> Option<String> {
        let newest = newest_checkpoint(dir)?;
        if local_uploaded.is_some_and(|u| u >= newest) {
            return None;
        }
        let seq = *remote_seq + 1;
        let path: PathBuf = dir.join(newest.to_string());
        match self.deps.checkpoints.upload(id, seq, &path).await {
            Ok(_) => {
                *remote_seq = seq;
                *local_uploaded = Some(newest);
                tracing::info!(job = %id, seq, "checkpoint uploaded");
                Some(checkpoint_prefix(id, seq))
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
        self.end_attempt(job, AttemptEnd::HandedBack(why)).await;
    }

    /// Deregister, and terminate the instance when the exit calls for it.
    async fn leave(&self, exit: &ExitReason) {
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
