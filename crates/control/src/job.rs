//! Jobs: the submitted spec, its validation, the job record and its state machine.
//!
//! A job spec is JSON (an S3 object under `jobs/` or an SQS message body):
//!
//! ```json
//! {"image": "ghcr.io/acme/train:1.4", "command": ["python", "train.py", "--epochs", "3"],
//!  "gpus": 1, "min_gpu_memory_gib": 16, "lane": "standard", "project": "vision",
//!  "deadline": 1790000000, "max_attempts": 3, "checkpoint_interval_s": 600,
//!  "est_runtime_s": 3600, "job_type": "train", "client_token": "run-42",
//!  "input": "s3://my-bucket/inputs/batch-7.txt", "name": "resnet sweep 3"}
//! ```
//!
//! `command` is an argv array, never a shell string. Only `image`, `command` and `project` are
//! required.

use serde::{Deserialize, Serialize};

/// A job as submitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Container image the worker runs the command in.
    pub image: String,
    /// argv of the command (first element is the program). Never a shell string.
    pub command: Vec<String>,
    /// GPUs needed. Default 1.
    #[serde(default = "one")]
    pub gpus: u32,
    /// Minimum GPU memory per GPU, GiB. Default 0 (the policy's own minimum applies).
    #[serde(default)]
    pub min_gpu_memory_gib: f64,
    /// Lane. Default `standard`.
    #[serde(default = "standard")]
    pub lane: String,
    /// Project billed.
    pub project: String,
    /// Deadline, unix seconds. Default none.
    #[serde(default)]
    pub deadline: Option<f64>,
    /// Attempts before the job is FAILED (interruptions do not count). Default 3.
    #[serde(default = "three")]
    pub max_attempts: u32,
    /// Checkpoint upload interval, seconds. Default 600.
    #[serde(default = "six_hundred")]
    pub checkpoint_interval_s: f64,
    /// Expected run time, seconds, if known.
    #[serde(default)]
    pub est_runtime_s: Option<f64>,
    /// Job type, for per-type concurrency caps.
    #[serde(default)]
    pub job_type: Option<String>,
    /// Idempotency token: two submissions with the same token are one job.
    #[serde(default)]
    pub client_token: Option<String>,
    /// Input object, `s3://bucket/key`: the agent downloads it and gives the job its local path
    /// (`ONOFF_JOB_INPUT`). Default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// A name for people (`onoff jobs` shows it), 1-128 printable characters. Default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

fn one() -> u32 {
    1
}
fn three() -> u32 {
    3
}
fn six_hundred() -> f64 {
    600.0
}
fn standard() -> String {
    "standard".into()
}

/// Why a spec was rejected. Every message names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// Not JSON, or not the spec's shape (a missing or unknown field, a wrong type).
    #[error("job spec is not valid JSON for a job: {0}")]
    Parse(String),
    /// A field has a bad value.
    #[error("job spec field {field}: {problem}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
}

impl JobSpec {
    /// Parse and validate a spec. `lanes`: the lane names that exist; `now`: unix seconds.
    ///
    /// # Errors
    /// [`SpecError`] naming the first bad field.
    pub fn parse(text: &str, lanes: &[&str], now: f64) -> Result<Self, SpecError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| SpecError::Parse(e.to_string()))?;
        if value.get("command").is_some_and(serde_json::Value::is_string) {
            return Err(SpecError::Invalid {
                field: "command",
                problem: "must be an argv array such as [\"python\", \"train.py\"], not a shell string".into(),
            });
        }
        let spec: JobSpec = serde_json::from_value(value).map_err(|e| SpecError::Parse(e.to_string()))?;
        spec.validate(lanes, now)?;
        Ok(spec)
    }

    /// Check every field.
    ///
    /// # Errors
    /// [`SpecError::Invalid`] naming the first bad field.
    pub fn validate(&self, lanes: &[&str], now: f64) -> Result<(), SpecError> {
        let bad = |field, problem: &str| {
            Err(SpecError::Invalid {
                field,
                problem: problem.to_string(),
            })
        };
        if self.image.trim().is_empty() {
            return bad("image", "must not be empty");
        }
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return bad(
                "command",
                "must be a non-empty argv array whose first element is the program",
            );
        }
        if !(1..=64).contains(&self.gpus) {
            return bad("gpus", "must be within 1..=64");
        }
        if !(self.min_gpu_memory_gib.is_finite() && self.min_gpu_memory_gib >= 0.0) {
            return bad("min_gpu_memory_gib", "must be a number >= 0");
        }
        if !lanes.contains(&self.lane.as_str()) {
            return Err(SpecError::Invalid {
                field: "lane",
                problem: format!("unknown lane {}; lanes: {}", quoted(&self.lane), lanes.join(", ")),
            });
        }
        let name_ok = onoff_policy::config::is_plain_name;
        if !name_ok(&self.project) {
            return bad("project", "must be 1-64 characters of A-Z a-z 0-9 - _ .");
        }
        if let Some(t) = &self.job_type {
            if !name_ok(t) {
                return bad("job_type", "must be 1-64 characters of A-Z a-z 0-9 - _ .");
            }
        }
        if let Some(d) = self.deadline {
            if !(d.is_finite() && d > now) {
                return bad("deadline", "must be a unix time in the future");
            }
        }
        if !(1..=20).contains(&self.max_attempts) {
            return bad("max_attempts", "must be within 1..=20");
        }
        if !(self.checkpoint_interval_s.is_finite() && self.checkpoint_interval_s >= 60.0) {
            return bad("checkpoint_interval_s", "must be >= 60 seconds");
        }
        if let Some(r) = self.est_runtime_s {
            if !(r.is_finite() && r > 0.0) {
                return bad("est_runtime_s", "must be > 0 seconds");
            }
        }
        if let Some(t) = &self.client_token {
            if t.is_empty() || t.len() > 128 {
                return bad("client_token", "must be 1-128 characters");
            }
        }
        if let Some(n) = &self.name {
            if n.is_empty() || n.chars().count() > 128 || n.chars().any(char::is_control) {
                return bad("name", "must be 1-128 characters without control characters");
            }
        }
        if let Some(uri) = &self.input {
            let Some((bucket, key)) = parse_s3_uri(uri) else {
                return bad("input", "must be an S3 URI s3://bucket/key");
            };
            if key.len() > MAX_S3_KEY_BYTES {
                return bad("input", "key must be at most 1,024 bytes (S3's limit)");
            }
            // The job's session names the input object; STS takes a session policy of at most
            // 2,048 characters (each character beyond ASCII costs six, as a JSON escape).
            if let Err(e) = crate::boundary::session_policy_fits(bucket, key) {
                return Err(SpecError::Invalid {
                    field: "input",
                    problem: format!("key too long for the job's AWS session: {e}"),
                });
            }
        }
        Ok(())
    }
}

/// Longest S3 object key, bytes of UTF-8 (Amazon S3 User Guide, "Naming Amazon S3 objects").
pub const MAX_S3_KEY_BYTES: usize = 1024;

/// Bucket and key of `s3://bucket/key`; `None` when `uri` is not of that form.
pub fn parse_s3_uri(uri: &str) -> Option<(&str, &str)> {
    let rest = uri.strip_prefix("s3://")?;
    let (bucket, key) = rest.split_once('/')?;
    (!bucket.is_empty() && !key.is_empty()).then_some((bucket, key))
}

/// State of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobState {
    /// In its lane queue, waiting for a worker.
    Queued,
    /// Claimed by a worker under a lease.
    Running,
    /// Finished with exit code 0.
    Succeeded,
    /// Failed `max_attempts` times (or cannot run).
    Failed,
    /// Failed or lost, will be queued again.
    Retrying,
    /// Cancelled by the user.
    Cancelled,
}

impl JobState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "QUEUED",
            JobState::Running => "RUNNING",
            JobState::Succeeded => "SUCCEEDED",
            JobState::Failed => "FAILED",
            JobState::Retrying => "RETRYING",
            JobState::Cancelled => "CANCELLED",
        }
    }

    /// Parse a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Queued,
            Self::Running,
            Self::Succeeded,
            Self::Failed,
            Self::Retrying,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }

    /// Finished for good.
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }

    /// Whether the state machine allows `self -> to`. The table is in docs/control-plane.md
    /// ("Job lifecycle"): a claim takes QUEUED or RETRYING to RUNNING; an attempt ends RUNNING ->
    /// SUCCEEDED | FAILED | RETRYING (failed, counted) | QUEUED (released, handed back, or its
    /// lease lost: not counted as a failure); QUEUED or RETRYING -> FAILED (the reaper, a job
    /// past its lane's `quota_wait_limit_s`); any non-final state -> CANCELLED.
    pub fn can_go(self, to: JobState) -> bool {
        use JobState::*;
        matches!(
            (self, to),
            (Queued | Retrying, Running)
                | (Queued | Retrying, Failed)
                | (Running, Succeeded)
                | (Running, Failed)
                | (Running, Retrying)
                | (Running, Queued)
                | (Queued | Running | Retrying, Cancelled)
        )
    }

    /// Waiting for a worker: a claim may take it, and it needs a queue message to be found.
    pub fn is_pending(self) -> bool {
        matches!(self, JobState::Queued | JobState::Retrying)
    }
}

/// How an attempt (a claim) ended, as its lease holder or the reaper saw it. [`Settle::of`] turns
/// it into the job's next state and counters; the store applies that in one conditional write.
#[derive(Debug, Clone, PartialEq)]
pub enum AttemptEnd {
    /// The process exited 0.
    Succeeded,
    /// The attempt failed (non-zero exit, killed, input missing): counted; RETRYING while
    /// attempts remain, then FAILED.
    Failed(String),
    /// The job can never run (wrong image, unreadable record): FAILED whatever attempts remain.
    Fatal(String),
    /// Given back unrun or stopped to resume elsewhere (spot interruption notice, agent shutdown,
    /// a dependency down before start): QUEUED, the attempt not counted.
    Released(String),
    /// Given back unrun because this worker is too small: QUEUED, not counted; FAILED after
    /// `max_hand_backs` hand-backs.
    HandedBack(String),
    /// Given back unrun because this worker must not run it now: a job whose deadline is at risk
    /// on spot, claimed by a spot worker (`onoff_policy::deadline::keeps_off_spot`). QUEUED,
    /// not counted and not bounded: the rule lets go of the job once its deadline is lost.
    Deferred(String),
    /// The reaper found the lease expired or its worker lost: QUEUED, the attempt not counted but
    /// the lease expiry is; FAILED after `max_lease_expiries` (a job that kills its worker must not
    /// boot a GPU forever).
    LeaseLost(String),
    /// The user cancelled it while it ran (`onoff cancel`): CANCELLED, never retried.
    Cancelled,
}

impl AttemptEnd {
    /// The outcome's name in an [`AttemptRecord`]: `succeeded`, `failed`, `fatal`, `released`,
    /// `handed_back`, `deferred`, `lease_lost`, `cancelled`.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            AttemptEnd::Succeeded => "succeeded",
            AttemptEnd::Failed(_) => "failed",
            AttemptEnd::Fatal(_) => "fatal",
            AttemptEnd::Released(_) => "released",
            AttemptEnd::HandedBack(_) => "handed_back",
            AttemptEnd::Deferred(_) => "deferred",
            AttemptEnd::LeaseLost(_) => "lease_lost",
            AttemptEnd::Cancelled => "cancelled",
        }
    }
}

/// Why a cancelled job ended, as its row says.
pub const CANCELLED_REASON: &str = "cancelled by the user";

/// One attempt that ran, as the job's row keeps it (`onoff status`, `onoff cost`): where it ran,
/// when, how it ended, what it cost. Appended when the attempt ends (by its lease holder, or by
/// the reaper for a lost lease); a hand-back that never started the job is not one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// 1-based, in the order the attempts started (also the job's log stream: `<job_id>/<n>`).
    pub n: u32,
    /// The worker's instance id.
    pub instance_id: String,
    /// EC2 instance type, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_type: Option<String>,
    /// `spot` or `on-demand`, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_type: Option<String>,
    /// The instance's price while it ran, $/h (its worker row's launch price), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_usd_per_h: Option<f64>,
    /// Claim time, unix seconds.
    pub started_at: f64,
    /// End time, unix seconds.
    pub ended_at: f64,
    /// [`AttemptEnd::name`].
    pub outcome: String,
    /// The process's exit code, if it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that ended the process, if one did (9: SIGKILL, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// S3 prefix of the last checkpoint it uploaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// Seconds the job's process ran (job seconds: a local replay's are scaled).
    #[serde(default)]
    pub seconds: f64,
    /// What the attempt cost, $ (instance price × its time on the job).
    #[serde(default)]
    pub cost_usd: f64,
}

/// What became of an attempt's outputs (`ONOFF_OUTPUT_DIR`, uploaded to `outputs/<job_id>/` after
/// the attempt is recorded), as the job's row keeps it (`outputs`; `onoff status`, `onoff
/// outputs`). Written by the worker that ran the attempt once the upload is over
/// ([`crate::ports::JobStore::record_outputs`]); a later attempt's record replaces an earlier one,
/// never the other way round. Kept apart from [`AttemptRecord`]: the attempt is settled first, so
/// a job that exited 0 never runs again whatever its upload does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputsRecord {
    /// The attempt ([`AttemptRecord::n`]) whose outputs these are.
    pub attempt: u32,
    /// Files uploaded (0 when the upload failed: those before the failure may be there).
    pub files: u32,
    /// Why the upload failed (cut to [`MAX_REASON_BYTES`]); `None`: every file went up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the upload ended, unix seconds.
    pub at: f64,
}

/// Bounds that turn repeated re-runs into FAILED.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RerunLimits {
    /// Hand-backs to a bigger worker before FAILED. Default 100: with the agent's 30 s retry
    /// delay that is at least 50 minutes of bounces, several cold starts of the worker the scaler
    /// launches for the job.
    pub max_hand_backs: u32,
    /// Leases lost (expired, or the worker died) before FAILED. Default 5: spot reclaims are
    /// released with the 2-minute notice and do not count, so five lost workers in one job is a
    /// job that takes its worker down.
    pub max_lease_expiries: u32,
}

impl Default for RerunLimits {
    fn default() -> Self {
        Self {
            max_hand_backs: 100,
            max_lease_expiries: 5,
        }
    }
}

/// A job's next state and counters after an attempt ended: what [`crate::ports::JobStore::finish`]
/// and [`crate::ports::JobStore::requeue_lost`] write, conditioned on the lease they end.
#[derive(Debug, Clone, PartialEq)]
pub struct Settle {
    /// Next state: SUCCEEDED, FAILED, RETRYING or QUEUED.
    pub to: JobState,
    /// Attempts that counted (the claim counted one; releases, hand-backs and lost leases take
    /// it back).
    pub attempts: u32,
    /// Hand-backs so far.
    pub hand_backs: u32,
    /// Lost leases so far.
    pub lease_expiries: u32,
    /// Why it failed, was released or handed back (kept on the row), if it did.
    pub reason: Option<String>,
    /// The attempt, appended to the row's attempt log (`None`: nothing ran, e.g. a hand-back).
    pub attempt: Option<AttemptRecord>,
    /// The job's lane: with [`Settle::run_s`], the row joins its lane's run times (the jobs
    /// table's sparse `run_times` index, partition key `run_lane`).
    pub lane: String,
}

impl Settle {
    /// The outcome of `end` for `job` as its lease holder saw it at claim time (`job.attempts`
    /// counts the current attempt).
    pub fn of(job: &crate::ports::JobRecord, end: &AttemptEnd, limits: &RerunLimits) -> Self {
        let mut s = Settle {
            to: JobState::Queued,
            attempts: job.attempts,
            hand_backs: job.hand_backs,
            lease_expiries: job.lease_expiries,
            reason: None,
            attempt: None,
            lane: job.spec.lane.clone(),
        };
        // A cancel asked for while it ran wins over every end but success: it never runs again.
        if job.cancel_requested && !matches!(end, AttemptEnd::Succeeded) {
            s.to = JobState::Cancelled;
            s.reason = Some(CANCELLED_REASON.into());
            return s;
        }
        let uncount = job.attempts.saturating_sub(1);
        match end {
            AttemptEnd::Succeeded => s.to = JobState::Succeeded,
            AttemptEnd::Failed(why) => {
                if job.attempts >= job.spec.max_attempts {
                    s.to = JobState::Failed;
                    s.reason = Some(format!("{why} (attempt {} of {})", job.attempts, job.spec.max_attempts));
                } else {
                    s.to = JobState::Retrying;
                    s.reason = Some(format!("attempt {} failed: {why}", job.attempts));
                }
            }
            AttemptEnd::Fatal(why) => {
                s.to = JobState::Failed;
                s.reason = Some(why.clone());
            }
            AttemptEnd::Released(why) => {
                s.attempts = uncount;
                s.reason = Some(format!("released: {why}"));
            }
            AttemptEnd::Deferred(why) => {
                s.attempts = uncount;
                s.reason = Some(format!("deferred: {why}"));
            }
            AttemptEnd::HandedBack(why) => {
                s.attempts = uncount;
                s.hand_backs += 1;
                if s.hand_backs >= limits.max_hand_backs {
                    s.to = JobState::Failed;
                    s.reason = Some(format!("handed back {} times, never run: {why}", s.hand_backs));
                } else {
                    s.reason = Some(format!("handed back: {why}"));
                }
            }
            AttemptEnd::Cancelled => {
                s.to = JobState::Cancelled;
                s.reason = Some(CANCELLED_REASON.into());
            }
            AttemptEnd::LeaseLost(why) => {
                s.attempts = uncount;
                s.lease_expiries += 1;
                if s.lease_expiries >= limits.max_lease_expiries {
                    s.to = JobState::Failed;
                    s.reason = Some(format!(
                        "lost its worker {} times (the job may be taking its worker down): {why}",
                        s.lease_expiries
                    ));
                } else {
                    s.reason = Some(format!("lease lost: {why}"));
                }
            }
        }
        s.reason = s.reason.map(bounded_reason);
        s
    }

    /// The run time this settle records on the row ([`crate::ports::JobRecord::run_s`]),
    /// seconds: from the claim to the end of the attempt that ends the job, as its lease holder
    /// saw it end; `None` for a settle that does not end the job, ran nothing, or ends a lost
    /// lease (the reaper knows only when the lease expired, not when the job stopped).
    pub fn run_s(&self) -> Option<f64> {
        let a = self
            .attempt
            .as_ref()
            .filter(|a| self.to.is_final() && a.outcome != AttemptEnd::LeaseLost(String::new()).name())?;
        Some((a.ended_at - a.started_at).max(0.0))
    }

    /// Whether row `r` already shows this settle written: its lease holder's write landed, its
    /// answer was lost (a 5xx or a timeout), and the SDK sent it again, which fails its own
    /// condition ("the expected condition is not met after the first update", DynamoDB Developer
    /// Guide, "Working with items and attributes", conditional writes). The store reads the row
    /// back and takes such a write as done instead of as a lost lease.
    ///
    /// An attempt that ran is known by its record in the attempt log: its instance, start and end
    /// are that lease's alone, and only its settle appends it (the row may have moved on since:
    /// claimed again, even settled again). A settle with no attempt (a hand-back, a release before
    /// the job started) by the row having left the lease in this settle's state (or CANCELLED, a
    /// cancel having been asked for) with exactly its counts.
    #[must_use]
    pub fn written_on(&self, r: &crate::ports::JobRecord) -> bool {
        match &self.attempt {
            Some(a) => r.attempt_log.iter().any(|x| x == a),
            None => {
                r.lease_owner.is_none()
                    && (r.state == self.to || (r.cancel_requested && r.state == JobState::Cancelled))
                    && (r.attempts, r.hand_backs, r.lease_expiries)
                        == (self.attempts, self.hand_backs, self.lease_expiries)
            }
        }
    }
}

/// Characters of a user's text a message quotes ([`quoted`]).
pub const MAX_QUOTED_CHARS: usize = 64;

/// `text` quoted as `{:?}` quotes it, cut to its first [`MAX_QUOTED_CHARS`] characters (`…`
/// after the closing quote when cut): a message that quotes a spec's field stays short and keeps
/// what it says after the quote, whatever the field holds (a spec may take 256 KiB).
#[must_use]
pub fn quoted(text: &str) -> String {
    match text.char_indices().nth(MAX_QUOTED_CHARS) {
        Some((end, _)) => format!("{:?}…", &text[..end]),
        None => format!("{text:?}"),
    }
}

/// Bytes of a reason a job's row keeps ([`Settle::reason`]). A reason quotes what failed (an
/// image, an input URI, an error from AWS), and the spec beside it may take 256 KiB: cut to this,
/// the row stays within DynamoDB's 400 KB item limit whatever the reason quotes.
pub const MAX_REASON_BYTES: usize = 2048;

/// `reason` cut to at most [`MAX_REASON_BYTES`] bytes at a character boundary, ending in `…`
/// when cut.
#[must_use]
pub fn bounded_reason(reason: String) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason;
    }
    let mut end = MAX_REASON_BYTES - '…'.len_utf8();
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

/// Attempts a job's row keeps in its log: 100 entries of a few hundred bytes stay far below
/// DynamoDB's 400 KB item limit, however often a job is released (spot notices do not count
/// towards any bound). Later attempts still run; they are not logged.
pub const MAX_ATTEMPT_LOG: usize = 100;

impl Settle {
    /// This settle with `attempt` to append to `job`'s attempt log, unless the log is full
    /// ([`MAX_ATTEMPT_LOG`]).
    #[must_use]
    pub fn with_attempt(mut self, job: &crate::ports::JobRecord, attempt: AttemptRecord) -> Self {
        if job.attempt_log.len() < MAX_ATTEMPT_LOG {
            self.attempt = Some(attempt);
        }
        self
    }
}

/// Job id for a submission: derived from the idempotency key (client token, or the S3 object key
/// and ETag) so a resubmission maps to the same job. FNV-1a 64 over the key, hex, prefixed `job-`.
pub fn job_id_for(idempotency_key: &str) -> String {
    format!("job-{:016x}", fnv1a64(idempotency_key))
}

/// FNV-1a 64 of `text`'s bytes.
fn fnv1a64(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Most bytes of a DynamoDB index's sort key (Amazon DynamoDB Developer Guide, "Constraints":
/// "The minimum length of a sort key value is 1 byte. The maximum length is 1024 bytes."). The
/// jobs table's `active` index sorts on `job_id`, so every row's `job_id` stays within it, an
/// error record's too (moto refuses one longer whether or not the row is in the sparse index).
pub const MAX_INDEX_SORT_KEY_BYTES: usize = 1024;

/// The `job_id` of the error record of a submission rejected from `source` (its
/// `submit::Source::describe`): `error#` and the source; past [`MAX_INDEX_SORT_KEY_BYTES`] (an S3
/// key near S3's 1,024 bytes), as much of the source as fits before `…#` and the FNV-1a 64 of
/// all of it, so one source is always one record and two long ones two.
pub fn error_record_id(source: &str) -> String {
    let whole = format!("error#{source}");
    if whole.len() <= MAX_INDEX_SORT_KEY_BYTES {
        return whole;
    }
    let tail = format!("…#{:016x}", fnv1a64(source));
    let mut end = MAX_INDEX_SORT_KEY_BYTES - tail.len();
    while !whole.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{tail}", &whole[..end])
}

/// `text` as a job id, or why it is none. Every job id is `job-` and 16 lowercase hex digits
/// ([`job_id_for`]); anything else names no job, and as a key or a path it could do harm (an
/// empty string is a key DynamoDB refuses; `../x`, as `onoff outputs`' default folder `./JOB`,
/// one outside the current folder).
///
/// # Errors
/// The text and the form expected.
pub fn parse_job_id(text: &str) -> Result<String, String> {
    let hex = text.strip_prefix("job-").unwrap_or_default();
    if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a job id: one is `job-` and 16 lowercase hex digits, as `onoff submit` and `onoff jobs` print it"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LANES: &[&str] = &["express", "standard"];

    #[test]
    fn a_minimal_spec_gets_defaults() {
        let s = JobSpec::parse(
            r#"{"image":"img","command":["python","x.py"],"project":"p"}"#,
            LANES,
            0.0,
        )
        .unwrap();
        assert_eq!(
            (s.gpus, s.lane.as_str(), s.max_attempts, s.checkpoint_interval_s),
            (1, "standard", 3, 600.0)
        );
    }

    #[test]
    fn bad_specs_name_their_field() {
        let cases = [
            (r#"{"image":"img","command":"python x.py","project":"p"}"#, "command"),
            (r#"{"image":"img","command":[],"project":"p"}"#, "command"),
            (r#"{"image":"","command":["x"],"project":"p"}"#, "image"),
            (r#"{"image":"i","command":["x"],"project":"p","gpus":0}"#, "gpus"),
            (r#"{"image":"i","command":["x"],"project":"p","lane":"gold"}"#, "lane"),
            (r#"{"image":"i","command":["x"],"project":"a b"}"#, "project"),
            (
                r#"{"image":"i","command":["x"],"project":"p","deadline":5}"#,
                "deadline",
            ),
            (
                r#"{"image":"i","command":["x"],"project":"p","max_attempts":0}"#,
                "max_attempts",
            ),
            (
                r#"{"image":"i","command":["x"],"project":"p","checkpoint_interval_s":1}"#,
                "checkpoint_interval_s",
            ),
            (
                r#"{"image":"i","command":["x"],"project":"p","colour":"red"}"#,
                "colour",
            ),
            (r#"{"image":"i","command":["x"]}"#, "project"),
            ("not json", "expected"),
        ];
        for (text, field) in cases {
            let err = JobSpec::parse(text, LANES, 100.0).unwrap_err().to_string();
            assert!(err.contains(field), "{text}: {err}");
        }
    }

    #[test]
    fn an_input_must_be_an_object_s3_and_sts_take() {
        let spec = |uri: &str| {
            let text = serde_json::json!({"image": "i", "command": ["x"], "project": "p", "input": uri});
            JobSpec::parse(&text.to_string(), LANES, 0.0)
        };
        for ok in [
            "s3://b/inputs/a.bin",
            "s3://b/inputs/run’s 入力.csv",
            "s3://b/inputs/a*?.bin",
        ] {
            assert!(spec(ok).is_ok(), "{ok}");
        }
        let longest_ascii = format!("s3://b/{}", "k".repeat(1024));
        assert!(spec(&longest_ascii).is_ok());
        for (uri, says) in [
            ("b/inputs/a.bin".to_string(), "S3 URI"),
            (format!("s3://b/{}", "k".repeat(1025)), "1,024 bytes"),
            // 1,020 bytes: S3 takes it, but escaped it does not fit a session policy.
            (format!("s3://b/{}", "入".repeat(340)), "session"),
        ] {
            let err = spec(&uri).unwrap_err().to_string();
            assert!(err.contains("input") && err.contains(says), "{err}");
        }
    }

    #[test]
    fn the_state_machine_allows_only_its_edges() {
        use JobState::*;
        let all = [Queued, Running, Succeeded, Failed, Retrying, Cancelled];
        let allowed = [
            (Queued, Running),
            (Retrying, Running),
            (Queued, Failed),
            (Retrying, Failed),
            (Running, Succeeded),
            (Running, Failed),
            (Running, Retrying),
            (Running, Queued),
            (Queued, Cancelled),
            (Running, Cancelled),
            (Retrying, Cancelled),
        ];
        for a in all {
            for b in all {
                assert_eq!(a.can_go(b), allowed.contains(&(a, b)), "{a:?} -> {b:?}");
            }
            assert_eq!(JobState::parse(a.as_str()), Some(a));
        }
        assert!(all
            .iter()
            .filter(|s| s.is_final())
            .all(|s| all.iter().all(|t| !s.can_go(*t))));
    }

    fn running(attempts: u32, hand_backs: u32, lease_expiries: u32) -> crate::ports::JobRecord {
        let spec = JobSpec::parse(
            r#"{"image":"i","command":["x"],"project":"p","max_attempts":3}"#,
            LANES,
            0.0,
        )
        .unwrap();
        let mut r = crate::ports::JobRecord::new("job-1".into(), spec, "test".into(), 0.0);
        (r.state, r.attempts, r.hand_backs, r.lease_expiries) =
            (JobState::Running, attempts, hand_backs, lease_expiries);
        r
    }

    /// The row as a settle leaves it (what the store's update writes).
    fn settled(r: &crate::ports::JobRecord, s: &Settle) -> crate::ports::JobRecord {
        let mut after = r.clone();
        (after.state, after.attempts, after.hand_backs, after.lease_expiries) =
            (s.to, s.attempts, s.hand_backs, s.lease_expiries);
        after.lease_owner = None;
        after.attempt_log.extend(s.attempt.clone());
        after
    }

    #[test]
    fn a_settle_knows_its_own_write_on_the_row_and_no_other() {
        let limits = RerunLimits::default();
        let mut held = running(1, 0, 0);
        held.lease_owner = Some("i-a".into());
        let attempt = |ended_at: f64| AttemptRecord {
            n: 1,
            instance_id: "i-a".into(),
            instance_type: None,
            capacity_type: None,
            price_usd_per_h: None,
            started_at: 10.0,
            ended_at,
            outcome: "failed".into(),
            exit_code: Some(1),
            signal: None,
            checkpoint: None,
            seconds: 5.0,
            cost_usd: 0.0,
        };
        let mut ran = Settle::of(&held, &AttemptEnd::Failed("exit code 1".into()), &limits);
        ran.attempt = Some(attempt(15.0));
        let row = settled(&held, &ran);
        assert!(!ran.written_on(&held), "not before it is written");
        assert!(ran.written_on(&row));
        // Known by its attempt record even after the row moved on (claimed again).
        let mut again = row.clone();
        (again.state, again.lease_owner, again.attempts) = (JobState::Running, Some("i-b".into()), 2);
        assert!(ran.written_on(&again));
        // Another attempt's end (another time) is not this one.
        let other = Settle {
            attempt: Some(attempt(16.0)),
            ..ran.clone()
        };
        assert!(!other.written_on(&row));
        // Without an attempt record: the state and counts it leaves, and no lease.
        let back = Settle::of(&held, &AttemptEnd::HandedBack("too small".into()), &limits);
        let row = settled(&held, &back);
        assert!(back.written_on(&row));
        assert!(!back.written_on(&held), "still leased");
        let mut claimed = row.clone();
        (claimed.state, claimed.lease_owner, claimed.attempts) = (JobState::Running, Some("i-b".into()), 1);
        assert!(
            !back.written_on(&claimed),
            "claimed again: not told apart, not taken as done"
        );
        let mut reaped = row.clone();
        reaped.lease_expiries += 1;
        assert!(!back.written_on(&reaped), "other counts: another writer's settle");
        // CANCELLED instead, when a cancel was asked for.
        let mut cancelled = row.clone();
        cancelled.state = JobState::Cancelled;
        assert!(!back.written_on(&cancelled));
        cancelled.cancel_requested = true;
        assert!(back.written_on(&cancelled));
    }

    #[test]
    fn attempt_ends_count_what_they_should_and_fail_at_their_bounds() {
        let limits = RerunLimits {
            max_hand_backs: 3,
            max_lease_expiries: 2,
        };
        let s = |r: &crate::ports::JobRecord, e: AttemptEnd| Settle::of(r, &e, &limits);
        // A failed attempt counts; the last one fails the job.
        let r = s(&running(2, 0, 0), AttemptEnd::Failed("exit code 1".into()));
        assert_eq!((r.to, r.attempts), (JobState::Retrying, 2));
        let r = s(&running(3, 0, 0), AttemptEnd::Failed("exit code 1".into()));
        assert_eq!((r.to, r.attempts), (JobState::Failed, 3));
        assert!(r.reason.unwrap().contains("attempt 3 of 3"));
        // Releases take the attempt back, whatever the count.
        let r = s(&running(3, 0, 0), AttemptEnd::Released("spot notice".into()));
        assert_eq!((r.to, r.attempts), (JobState::Queued, 2));
        // So do deferrals (a deadline kept off spot), with no bound: hand-backs stay as they were.
        let r = s(
            &running(3, 2, 0),
            AttemptEnd::Deferred("deadline at risk on spot".into()),
        );
        assert_eq!((r.to, r.attempts, r.hand_backs), (JobState::Queued, 2, 2));
        assert!(r.reason.unwrap().starts_with("deferred: "));
        // Hand-backs: not counted as attempts, FAILED at the bound.
        let r = s(&running(1, 1, 0), AttemptEnd::HandedBack("too few GPUs".into()));
        assert_eq!((r.to, r.attempts, r.hand_backs), (JobState::Queued, 0, 2));
        let r = s(&running(1, 2, 0), AttemptEnd::HandedBack("too few GPUs".into()));
        assert_eq!((r.to, r.hand_backs), (JobState::Failed, 3));
        assert!(r.reason.unwrap().contains("handed back 3 times"));
        // Lost leases: the attempt taken back, the loss counted, FAILED at the bound.
        let r = s(&running(1, 0, 0), AttemptEnd::LeaseLost("expired".into()));
        assert_eq!((r.to, r.attempts, r.lease_expiries), (JobState::Queued, 0, 1));
        let r = s(&running(1, 0, 1), AttemptEnd::LeaseLost("expired".into()));
        assert_eq!((r.to, r.lease_expiries), (JobState::Failed, 2));
        // A job that can never run fails at once; a success is a success.
        assert_eq!(
            s(&running(1, 0, 0), AttemptEnd::Fatal("wrong image".into())).to,
            JobState::Failed
        );
        assert_eq!(s(&running(1, 0, 0), AttemptEnd::Succeeded).to, JobState::Succeeded);
        // Cancelled by the user: CANCELLED; and once a cancel is asked for, every end of the
        // attempt but success is CANCELLED (never queued again).
        assert_eq!(s(&running(1, 0, 0), AttemptEnd::Cancelled).to, JobState::Cancelled);
        let mut asked = running(1, 0, 0);
        asked.cancel_requested = true;
        for end in [
            AttemptEnd::Released("spot notice".into()),
            AttemptEnd::LeaseLost("expired".into()),
            AttemptEnd::Failed("exit code 1".into()),
            AttemptEnd::HandedBack("too few GPUs".into()),
        ] {
            let r = s(&asked, end.clone());
            assert_eq!(r.to, JobState::Cancelled, "{end:?}");
            assert_eq!(r.reason.as_deref(), Some(CANCELLED_REASON));
        }
        assert_eq!(s(&asked, AttemptEnd::Succeeded).to, JobState::Succeeded);
    }

    #[test]
    fn an_attempt_record_round_trips_and_omits_what_is_unknown() {
        let a = AttemptRecord {
            n: 2,
            instance_id: "i-1".into(),
            instance_type: Some("g5.xlarge".into()),
            capacity_type: Some("spot".into()),
            price_usd_per_h: Some(0.4),
            started_at: 10.0,
            ended_at: 70.0,
            outcome: AttemptEnd::Released("notice".into()).name().into(),
            exit_code: None,
            signal: None,
            checkpoint: Some("checkpoints/job-1/00000000000000000003/".into()),
            seconds: 60.0,
            cost_usd: 0.0067,
        };
        let text = serde_json::to_string(&a).unwrap();
        assert!(!text.contains("exit_code"), "{text}");
        assert_eq!(serde_json::from_str::<AttemptRecord>(&text).unwrap(), a);
    }

    #[test]
    fn an_error_record_id_is_the_source_within_an_index_sort_key() {
        assert_eq!(error_record_id("sqs:m-1"), "error#sqs:m-1");
        let fits = format!(
            "s3://b/{}",
            "k".repeat(MAX_INDEX_SORT_KEY_BYTES - "error#s3://b/".len())
        );
        assert_eq!(error_record_id(&fits), format!("error#{fits}"));
        // Two bytes more: bounded, and the same source is the same id.
        let long = format!("{fits}é");
        let id = error_record_id(&long);
        assert!(
            id.len() <= MAX_INDEX_SORT_KEY_BYTES && id.starts_with("error#s3://b/kkk"),
            "{id}"
        );
        assert_eq!(id, error_record_id(&long));
        // Two long sources that differ only past the cut stay two records.
        let other = format!("{fits}x");
        assert_ne!(error_record_id(&other), id);
        assert!(error_record_id(&other).len() <= MAX_INDEX_SORT_KEY_BYTES);
        // A cut inside a character falls back to its start.
        let wide = format!("s3://b/{}", "é".repeat(600));
        let id = error_record_id(&wide);
        assert!(
            id.len() <= MAX_INDEX_SORT_KEY_BYTES && id.ends_with(&format!("#{:016x}", fnv1a64(&wide))),
            "{id}"
        );
    }

    #[test]
    fn a_job_id_is_job_and_16_lowercase_hex_digits() {
        let id = job_id_for("token:p:t");
        assert_eq!(parse_job_id(&id), Ok(id.clone()));
        for bad in [
            "",
            "job-",
            "job-0123456789abcdeF",
            "job-0123456789abcde",
            "job-0123456789abcdef0",
            "../x",
            " job-0123456789abcdef",
            "error#s3://b/k",
        ] {
            let why = parse_job_id(bad).unwrap_err();
            assert!(why.contains("is not a job id"), "{bad:?}: {why}");
        }
    }

    #[test]
    fn job_ids_follow_the_idempotency_key() {
        assert_eq!(job_id_for("token-1"), job_id_for("token-1"));
        assert_ne!(job_id_for("token-1"), job_id_for("token-2"));
        assert!(job_id_for("x").starts_with("job-") && job_id_for("x").len() == 20);
    }
}
