//! What the agent needs from the outside, one trait per capability, beside the control plane's
//! own [`onoff_control::ports::JobStore`] and [`onoff_control::ports::CheckpointStore`]. AWS
//! adapters are in [`crate::aws`], in-memory fakes in [`crate::fake`].

use std::path::PathBuf;

use onoff_control::ports::{StoreError, WorkerRecord};
use onoff_policy::WorkerState;
use tokio::sync::mpsc;

/// Who this instance is (IMDS `instance-id`, `instance-type`, `placement/availability-zone`,
/// `instance-life-cycle`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Instance id.
    pub instance_id: String,
    /// Instance type.
    pub instance_type: String,
    /// Availability zone.
    pub zone: String,
    /// `spot` or `on-demand`.
    pub lifecycle: String,
}

/// A notice from IMDS that the instance is going away or should be drained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// `spot/instance-action`: `{"action": "terminate"|"stop"|"hibernate", "time": ...}`; about
    /// two minutes before the reclaim.
    SpotInterruption {
        /// The action.
        action: String,
        /// When, as IMDS gives it.
        time: String,
    },
    /// `events/recommendations/rebalance`: elevated risk of interruption (often not followed by
    /// one): the agent checkpoints, finishes its job and takes no other.
    Rebalance {
        /// `noticeTime`, as IMDS gives it.
        time: String,
    },
}

/// The instance metadata service.
#[allow(async_fn_in_trait)]
pub trait Metadata {
    /// This instance's identity.
    ///
    /// # Errors
    /// IMDS unreachable or a field missing, as text.
    async fn identity(&self) -> Result<Identity, String>;

    /// A pending notice, if any (IMDS answers 404 when there is none).
    ///
    /// # Errors
    /// IMDS unreachable, as text.
    async fn notice(&self) -> Result<Option<Notice>, String>;
}

/// A job message received from a lane queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Lane it came from.
    pub lane: String,
    /// SQS message id.
    pub message_id: String,
    /// Receipt handle (for visibility changes and delete).
    pub receipt: String,
    /// Body: `{"job_id": "...", "gpus": n, "sent_at": t}` (`onoff_control::ports::wake_up_body`).
    pub body: String,
    /// Times received (SQS ApproximateReceiveCount).
    pub receive_count: u32,
}

/// The lane queues, as a consumer, and as a sender of fresh wake-up messages
/// ([`onoff_control::ports::JobQueue`]) for the jobs this worker re-queues.
#[allow(async_fn_in_trait)]
pub trait Inbox: onoff_control::ports::JobQueue {
    /// Receive at most one message from `lane`, waiting up to `wait_s` (long poll) and hiding it
    /// for `visibility_s`.
    ///
    /// # Errors
    /// Queue failures, as text.
    async fn receive(&self, lane: &str, wait_s: u32, visibility_s: u32) -> Result<Option<Message>, String>;

    /// Hide a received message for `visibility_s` from now (0 makes it visible at once).
    ///
    /// # Errors
    /// Queue failures (an expired receipt among them), as text.
    async fn set_visibility(&self, lane: &str, receipt: &str, visibility_s: u32) -> Result<(), String>;

    /// Delete a received message (claimed, or its job is not claimable).
    ///
    /// # Errors
    /// Queue failures, as text.
    async fn delete(&self, lane: &str, receipt: &str) -> Result<(), String>;

    /// Hand a received message back as a new one with the same body, visible after `delay_s`,
    /// and delete the original: for a message this worker could not act on for a passing reason
    /// (the jobs table throttled, say). A visibility change would count every such receive
    /// towards the dead-letter queue's maxReceiveCount, which is for poison only; a new message
    /// starts at zero. (Sent before the delete: if the delete fails, the job has two messages,
    /// which is harmless: claims are conditional.)
    ///
    /// # Errors
    /// Queue failures, as text.
    async fn requeue(&self, lane: &str, receipt: &str, body: &str, delay_s: u32) -> Result<(), String>;
}

/// The workers table, as the agent writes it.
#[allow(async_fn_in_trait)]
pub trait Registry {
    /// This worker's record (`None` when the control plane never registered it).
    ///
    /// # Errors
    /// Store failures.
    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError>;

    /// Register a worker the control plane did not launch (idempotent).
    ///
    /// # Errors
    /// Store failures.
    async fn register(&self, record: WorkerRecord) -> Result<(), StoreError>;

    /// Take a job: state Running, only if the control plane is not retiring this worker (its row
    /// Draining or Terminating). `Ok(false)` when refused: the agent must not claim.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the row is gone; store failures.
    async fn mark_busy(&self, id: &str, now: f64) -> Result<bool, StoreError>;

    /// State, idle-since and heartbeat time. A row the control plane is retiring keeps its state
    /// (only the heartbeat time is written). Terminating (the agent deregistering) is a move from
    /// [`DEREGISTER_FROM`] only: a Stopped row stays Stopped (no error) for a start to find.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the row is gone; [`StoreError::Conflict`] when the row is
    /// Draining, Terminating or Stopped (the worker is being retired); store failures.
    async fn heartbeat(
        &self,
        id: &str,
        state: WorkerState,
        idle_since: Option<f64>,
        now: f64,
    ) -> Result<(), StoreError>;

    /// The projects whose cache this worker's volume holds, most recently used first
    /// ([`WorkerRecord::cached_projects`]; at most
    /// [`onoff_control::ports::MAX_CACHED_PROJECTS`] are kept; none clears them), in any state.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the row is gone; store failures.
    async fn set_cached_projects(&self, id: &str, projects: &[String]) -> Result<(), StoreError>;
}

/// The states an agent deregistering (Terminating) moves its row from: every live one. Not
/// Stopped: the control plane stopped the instance (the agent is shut down with it), and the row
/// must stay Stopped for a start to find.
pub const DEREGISTER_FROM: [WorkerState; 4] = [
    WorkerState::Pending,
    WorkerState::Running,
    WorkerState::Idle,
    WorkerState::Draining,
];

/// A job's objects beside its checkpoints: its input, its outputs, its log, its own AWS session.
#[allow(async_fn_in_trait)]
pub trait Objects {
    /// Download `uri` (`s3://bucket/key`) to `dest`.
    ///
    /// # Errors
    /// Not found or store failure, as text.
    async fn download(&self, uri: &str, dest: &std::path::Path) -> Result<(), String>;

    /// An AWS session of its own for job `job_id`, scoped to it
    /// ([`onoff_control::boundary::job_session_policy`]); `None` when no job role is configured
    /// (the job then gets no AWS credentials at all). The agent hands it to the job through a
    /// `credential_process` file and starts a new session before this one expires.
    ///
    /// # Errors
    /// [`SessionError::Refused`] when STS refuses this job's session policy itself (no attempt
    /// can get one); [`SessionError::Failed`] for any other failure.
    async fn job_session(&self, job_id: &str, input: Option<&str>) -> Result<Option<JobCredentials>, SessionError> {
        let _ = (job_id, input);
        Ok(None)
    }

    /// Upload every file under `dir` (the job's `ONOFF_OUTPUT_DIR`) to `outputs/<job_id>/<path>`,
    /// replacing what an earlier attempt put there; returns the number of files.
    ///
    /// # Errors
    /// A read or an upload failed, as text.
    async fn upload_outputs(&self, job_id: &str, dir: &std::path::Path) -> Result<usize, String> {
        let _ = (job_id, dir);
        Ok(0)
    }

    /// Append `lines` (unix seconds, text) to the job's log stream `stream` (`<job_id>/<attempt>`),
    /// created on first use.
    ///
    /// # Errors
    /// The log service refused, as text.
    async fn log_lines(&self, stream: &str, lines: &[(f64, String)]) -> Result<(), String> {
        let _ = (stream, lines);
        Ok(())
    }
}

/// Why a job's AWS session could not be made ([`Objects::job_session`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// STS refuses the job's session policy itself: over its 2,048 characters, or over the
    /// packed size it holds policies to (`PackedPolicyTooLarge`, which "you could receive even
    /// though you meet other defined session policy limits", STS API Reference, AssumeRole), or
    /// malformed. The policy depends on the job alone, so no attempt can get a session: the job
    /// fails for good at this attempt, whatever attempts it has left.
    #[error("{0}")]
    Refused(String),
    /// Anything else (throttling, the network, the role's trust): another attempt may succeed.
    #[error("{0}")]
    Failed(String),
}

/// A job's temporary AWS credentials.
#[derive(Clone, PartialEq)]
pub struct JobCredentials {
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Session token.
    pub session_token: String,
    /// When they expire, RFC 3339 (UTC).
    pub expiration: String,
    /// Their lifetime from issue, seconds (the agent renews them after half of it).
    pub lifetime_s: f64,
}

impl std::fmt::Debug for JobCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret or the token in a log line.
        f.debug_struct("JobCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("expiration", &self.expiration)
            .finish_non_exhaustive()
    }
}

impl JobCredentials {
    /// The JSON a `credential_process` prints (AWS SDKs and CLI Reference Guide, "Sourcing
    /// credentials with an external process"): `Version` 1 and the four fields.
    #[must_use]
    pub fn process_json(&self) -> String {
        serde_json::json!({
            "Version": 1,
            "AccessKeyId": self.access_key_id,
            "SecretAccessKey": self.secret_access_key,
            "SessionToken": self.session_token,
            "Expiration": self.expiration,
        })
        .to_string()
    }
}

/// This instance, as a cloud resource.
#[allow(async_fn_in_trait)]
pub trait Instance {
    /// Terminate the instance `id` (this one).
    ///
    /// # Errors
    /// Provider failure, as text.
    async fn terminate_self(&self, id: &str) -> Result<(), String>;

    /// Cancel the persistent spot request instance `id` (this one) was launched from, if it has
    /// one, and leave the instance as it is: the agent is exiting on an error and the instance
    /// powers off after it (the image's unit shuts it down, and the launch template's shutdown
    /// behaviour terminates it). With its request open, EC2 would launch another in its place
    /// ("the Spot Instance request transitions to the open state so that a new Spot Instance can
    /// be launched", EC2 User Guide), likely to fail the same way, and again.
    ///
    /// # Errors
    /// Provider failure, as text.
    async fn release_request(&self, id: &str) -> Result<(), String>;
}

/// What to run for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobCommand {
    /// argv; the first element is the program. Never run through a shell.
    pub argv: Vec<String>,
    /// Variables added to the agent's environment (they win over it).
    pub env: Vec<(String, String)>,
    /// Variables the job gets unless the agent's environment (the image's `ENV`) sets them.
    pub defaults: Vec<(String, String)>,
    /// Working directory.
    pub cwd: PathBuf,
}

/// What a running job reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEvent {
    /// A line of its stdout or stderr.
    Line(String),
    /// It ended.
    Exited(JobExit),
}

/// How a job's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobExit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it: its number (9 SIGKILL, 7 SIGBUS, ...).
    Signal(i32),
    /// Not known (waiting for it failed).
    Unknown,
}

impl JobExit {
    /// The exit code, if it exited.
    pub fn code(self) -> Option<i32> {
        match self {
            JobExit::Code(c) => Some(c),
            _ => None,
        }
    }

    /// The signal's number, if a signal ended it.
    pub fn signal(self) -> Option<i32> {
        match self {
            JobExit::Signal(n) => Some(n),
            _ => None,
        }
    }

    /// The attempt's reason for an end the agent did not ask for: "exit code 3", or the signal
    /// by name with what most often sends it to a GPU job, e.g. "killed by SIGKILL (signal 9):
    /// the kernel's out-of-memory killer, most often (the instance's memory was full)".
    pub fn describe(self) -> String {
        use nix::sys::signal::Signal;
        match self {
            JobExit::Code(c) => format!("exit code {c}"),
            JobExit::Signal(n) => match Signal::try_from(n) {
                Ok(sig) => {
                    let hint = match sig {
                        Signal::SIGKILL => {
                            ": the kernel's out-of-memory killer, most often (the instance's memory was full)"
                        }
                        Signal::SIGBUS => {
                            ": shared memory (/dev/shm) full, most often, or a file mapped in memory cut short"
                        }
                        Signal::SIGSEGV => ": a crash (invalid memory access)",
                        Signal::SIGABRT => ": the program aborted (a failed assertion or an error it did not handle)",
                        _ => "",
                    };
                    format!("killed by {sig} (signal {n}){hint}")
                }
                Err(_) => format!("killed by signal {n}"),
            },
            JobExit::Unknown => "ended, how is not known (waiting for it failed)".into(),
        }
    }
}

/// Asking a running job to stop, every process it started included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// SIGTERM: checkpoint and exit.
    Stop,
    /// SIGKILL.
    Kill,
}

/// A started job: its events (ending with [`JobEvent::Exited`]) and its control channel.
/// Dropping the control sender kills the job.
#[derive(Debug)]
pub struct JobHandle {
    /// Output lines, then the exit.
    pub events: mpsc::Receiver<JobEvent>,
    /// Stop or kill it.
    pub control: mpsc::Sender<Control>,
}

/// Starting job processes.
pub trait Launcher {
    /// Start `cmd`.
    ///
    /// # Errors
    /// The program cannot be started (not found, not executable), as text.
    fn start(&self, cmd: &JobCommand) -> Result<JobHandle, String>;
}

// References forward, so several agents (tests) can share one store.
impl<T: Metadata> Metadata for &T {
    async fn identity(&self) -> Result<Identity, String> {
        (**self).identity().await
    }
    async fn notice(&self) -> Result<Option<Notice>, String> {
        (**self).notice().await
    }
}
impl<T: Inbox> Inbox for &T {
    async fn receive(&self, lane: &str, wait_s: u32, visibility_s: u32) -> Result<Option<Message>, String> {
        (**self).receive(lane, wait_s, visibility_s).await
    }
    async fn set_visibility(&self, lane: &str, receipt: &str, visibility_s: u32) -> Result<(), String> {
        (**self).set_visibility(lane, receipt, visibility_s).await
    }
    async fn delete(&self, lane: &str, receipt: &str) -> Result<(), String> {
        (**self).delete(lane, receipt).await
    }
    async fn requeue(&self, lane: &str, receipt: &str, body: &str, delay_s: u32) -> Result<(), String> {
        (**self).requeue(lane, receipt, body, delay_s).await
    }
}
impl<T: Registry> Registry for &T {
    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        (**self).get(id).await
    }
    async fn mark_busy(&self, id: &str, now: f64) -> Result<bool, StoreError> {
        (**self).mark_busy(id, now).await
    }
    async fn set_cached_projects(&self, id: &str, projects: &[String]) -> Result<(), StoreError> {
        (**self).set_cached_projects(id, projects).await
    }
    async fn register(&self, record: WorkerRecord) -> Result<(), StoreError> {
        (**self).register(record).await
    }
    async fn heartbeat(
        &self,
        id: &str,
        state: WorkerState,
        idle_since: Option<f64>,
        now: f64,
    ) -> Result<(), StoreError> {
        (**self).heartbeat(id, state, idle_since, now).await
    }
}
impl<T: Objects> Objects for &T {
    async fn download(&self, uri: &str, dest: &std::path::Path) -> Result<(), String> {
        (**self).download(uri, dest).await
    }
    async fn job_session(&self, job_id: &str, input: Option<&str>) -> Result<Option<JobCredentials>, SessionError> {
        (**self).job_session(job_id, input).await
    }
    async fn upload_outputs(&self, job_id: &str, dir: &std::path::Path) -> Result<usize, String> {
        (**self).upload_outputs(job_id, dir).await
    }
    async fn log_lines(&self, stream: &str, lines: &[(f64, String)]) -> Result<(), String> {
        (**self).log_lines(stream, lines).await
    }
}
impl<T: Instance> Instance for &T {
    async fn terminate_self(&self, id: &str) -> Result<(), String> {
        (**self).terminate_self(id).await
    }
    async fn release_request(&self, id: &str) -> Result<(), String> {
        (**self).release_request(id).await
    }
}
impl<T: Launcher> Launcher for &T {
    fn start(&self, cmd: &JobCommand) -> Result<JobHandle, String> {
        (**self).start(cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::JobExit;

    #[test]
    fn an_end_is_described_by_its_code_or_its_signals_name_and_likely_sender() {
        assert_eq!(JobExit::Code(3).describe(), "exit code 3");
        assert_eq!(JobExit::Code(3).code(), Some(3));
        let kill = JobExit::Signal(9).describe();
        assert!(
            kill.starts_with("killed by SIGKILL (signal 9): the kernel's out-of-memory killer"),
            "{kill}"
        );
        assert_eq!(JobExit::Signal(9).code(), None);
        assert!(JobExit::Signal(7).describe().contains("/dev/shm"));
        assert_eq!(JobExit::Signal(15).describe(), "killed by SIGTERM (signal 15)");
        // A number nix has no name for (a real-time signal) is given as a number.
        assert_eq!(JobExit::Signal(40).describe(), "killed by signal 40");
    }
}
