//! In-memory fakes of the agent's ports, on tokio time (run tests with paused time), plus a
//! scripted job launcher whose jobs checkpoint to a real directory and honour stop and resume.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onoff_control::fake::FakeRegistry;
use onoff_control::ports::{CheckpointRef, CheckpointStore, StoreError, WorkerRecord, WorkerRegistry};
use onoff_policy::WorkerState;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::ports::{
    Control, Identity, Inbox, Instance, JobCommand, JobEvent, JobExit, JobHandle, Launcher, Message, Metadata, Notice,
    Objects, Registry,
};

/// IMDS in memory: a fixed identity and a settable notice.
#[derive(Debug)]
pub struct FakeMetadata {
    /// The identity returned.
    pub identity: Identity,
    notice: Mutex<Option<Notice>>,
}

impl FakeMetadata {
    /// An instance `id` of type g5.xlarge in us-east-1a, spot.
    pub fn new(id: &str) -> Self {
        Self {
            identity: Identity {
                instance_id: id.into(),
                instance_type: "g5.xlarge".into(),
                zone: "us-east-1a".into(),
                lifecycle: "spot".into(),
            },
            notice: Mutex::new(None),
        }
    }

    /// From now on IMDS reports `n`.
    pub fn set_notice(&self, n: Notice) {
        *self.notice.lock().expect("lock") = Some(n);
    }
}

impl Metadata for FakeMetadata {
    async fn identity(&self) -> Result<Identity, String> {
        Ok(self.identity.clone())
    }
    async fn notice(&self) -> Result<Option<Notice>, String> {
        Ok(self.notice.lock().expect("lock").clone())
    }
}

#[derive(Debug, Clone)]
struct Queued {
    lane: String,
    id: String,
    body: String,
    sent_at: Instant,
    visible_at: Instant,
    /// When the current receive happened (the 12-hour visibility cap counts from it).
    received_at: Option<Instant>,
    receives: u32,
    deleted: bool,
    dead: bool,
}

/// SQS limits the fake enforces, as AWS documents them ("Amazon SQS message quotas", "Amazon SQS
/// visibility timeout", "Using dead-letter queues in Amazon SQS").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SqsLimits {
    /// Longest a received message can stay hidden, counted from its receive, seconds (12 h).
    pub max_visibility_s: u64,
    /// How long a message is kept after it was sent, seconds (the template's 14 days; SQS's
    /// default is 4 days).
    pub retention_s: u64,
    /// Receives after which the next receive moves the message to the dead-letter queue (the
    /// template's `MaxReceiveCount`, 5).
    pub max_receive_count: u32,
    /// Longest delay of a sent message, seconds (900).
    pub max_delay_s: u32,
}

impl Default for SqsLimits {
    fn default() -> Self {
        Self {
            max_visibility_s: 12 * 3600,
            retention_s: 1_209_600,
            max_receive_count: 5,
            max_delay_s: 900,
        }
    }
}

/// Lane queues in memory with SQS's semantics on tokio time: visibility timeouts capped at 12 h
/// from the receive, retention, delays, receive counts and the redrive to a dead-letter queue.
/// A receipt handle belongs to one receive, and the fake answers a stale one (the message has
/// been received again since) as the worst SQS allows: a DeleteMessage with it "will still
/// succeed, but the message might not be deleted" (SQS API Reference, DeleteMessage), so it is
/// not; a ChangeMessageVisibility with it is refused (`InvalidParameterValue`, "... is not
/// available for visibility timeout change"), and so is one for a message visible again
/// (`MessageNotInflight`).
#[derive(Debug, Default)]
pub struct FakeInbox {
    messages: Mutex<Vec<Queued>>,
    visibility_changes: Mutex<Vec<(String, u32)>>,
    stale_deletes: Mutex<Vec<String>>,
    limits: SqsLimits,
    short_polls_miss: bool,
}

impl FakeInbox {
    /// Queues whose short polls (a receive that waits 0 s) find nothing, whatever they hold: the
    /// worst SQS allows. A short poll asks a sample of SQS's servers only, and "if the number of
    /// messages in the queue is extremely small, you might not receive any messages" (Amazon SQS
    /// Developer Guide, "Amazon SQS short and long polling"); a long poll asks them all.
    #[must_use]
    pub fn with_short_polls_missing(mut self) -> Self {
        self.short_polls_miss = true;
        self
    }

    /// Queues with other limits than AWS's defaults.
    pub fn with_limits(limits: SqsLimits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Send `body` to `lane` (visible at once); returns the message id.
    pub fn send(&self, lane: &str, body: &str) -> String {
        self.send_delayed(lane, body, 0)
    }

    /// Send `body` to `lane`, visible after `delay_s` (at most 900 s, as SQS); returns the id.
    pub fn send_delayed(&self, lane: &str, body: &str, delay_s: u32) -> String {
        let mut m = self.messages.lock().expect("lock");
        let id = format!("m-{}", m.len() + 1);
        let now = Instant::now();
        m.push(Queued {
            lane: lane.into(),
            id: id.clone(),
            body: body.into(),
            sent_at: now,
            visible_at: now + Duration::from_secs(u64::from(delay_s.min(self.limits.max_delay_s))),
            received_at: None,
            receives: 0,
            deleted: false,
            dead: false,
        });
        id
    }

    fn expire(&self, m: &mut [Queued]) {
        let now = Instant::now();
        for q in m.iter_mut() {
            if !q.deleted && now.duration_since(q.sent_at).as_secs() >= self.limits.retention_s {
                q.deleted = true;
            }
        }
    }

    /// Messages neither deleted, expired nor dead-lettered: (id, receives).
    pub fn remaining(&self) -> Vec<(String, u32)> {
        let mut m = self.messages.lock().expect("lock");
        self.expire(&mut m);
        m.iter()
            .filter(|q| !q.deleted)
            .map(|q| (q.id.clone(), q.receives))
            .collect()
    }

    /// Messages on `lane` not deleted, expired or dead-lettered whose body names `job_id`.
    pub fn pending_for(&self, lane: &str, job_id: &str) -> usize {
        let mut m = self.messages.lock().expect("lock");
        self.expire(&mut m);
        m.iter()
            .filter(|q| !q.deleted && q.lane == lane && q.body.contains(job_id))
            .count()
    }

    /// Bodies of the messages moved to the dead-letter queue.
    pub fn dead_letters(&self) -> Vec<String> {
        self.messages
            .lock()
            .expect("lock")
            .iter()
            .filter(|q| q.dead)
            .map(|q| q.body.clone())
            .collect()
    }

    /// Every visibility change: (message id, seconds).
    pub fn visibility_changes(&self) -> Vec<(String, u32)> {
        self.visibility_changes.lock().expect("lock").clone()
    }

    /// Deletes (and the deletes of hand-backs) sent with a stale receipt handle, which
    /// succeeded and deleted nothing: the message ids.
    pub fn stale_deletes(&self) -> Vec<String> {
        self.stale_deletes.lock().expect("lock").clone()
    }

    fn take(&self, lane: &str, visibility_s: u32) -> Option<Message> {
        let now = Instant::now();
        let mut m = self.messages.lock().expect("lock");
        self.expire(&mut m);
        let max_receives = self.limits.max_receive_count;
        let q = loop {
            let q = m
                .iter_mut()
                .find(|q| q.lane == lane && !q.deleted && q.visible_at <= now)?;
            if q.receives >= max_receives {
                // SQS moves it to the dead-letter queue instead of delivering it again.
                q.deleted = true;
                q.dead = true;
                continue;
            }
            break q;
        };
        q.receives += 1;
        q.received_at = Some(now);
        q.visible_at = now + Duration::from_secs(u64::from(visibility_s).min(self.limits.max_visibility_s));
        Some(Message {
            lane: q.lane.clone(),
            message_id: q.id.clone(),
            receipt: format!("{}#{}", q.id, q.receives),
            body: q.body.clone(),
            receive_count: q.receives,
        })
    }

    /// `f` on the message `receipt` names, told whether the receipt is its latest receive's. A
    /// receipt of a message gone (deleted, expired, dead-lettered) is refused.
    fn with<T>(&self, receipt: &str, f: impl FnOnce(&mut Queued, bool) -> Result<T, String>) -> Result<T, String> {
        let (id, receive) = receipt.split_once('#').unwrap_or((receipt, ""));
        let mut m = self.messages.lock().expect("lock");
        self.expire(&mut m);
        let q = m
            .iter_mut()
            .find(|q| q.id == id && !q.deleted)
            .ok_or_else(|| format!("ReceiptHandleIsInvalid: receipt {receipt} is not valid"))?;
        let latest = receive.parse::<u32>().ok() == Some(q.receives);
        f(q, latest)
    }

    /// Delete the message of `receipt`, or, for a stale receipt, succeed and delete nothing.
    fn delete_receipt(&self, receipt: &str) -> Result<(), String> {
        let stale = self.with(receipt, |q, latest| {
            q.deleted |= latest;
            Ok((!latest).then(|| q.id.clone()))
        })?;
        if let Some(id) = stale {
            self.stale_deletes.lock().expect("lock").push(id);
        }
        Ok(())
    }
}

impl onoff_control::ports::JobQueue for FakeInbox {
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String> {
        self.send_delayed(lane, body, delay_s);
        Ok(())
    }
}

impl Inbox for FakeInbox {
    async fn receive(&self, lane: &str, wait_s: u32, visibility_s: u32) -> Result<Option<Message>, String> {
        if wait_s == 0 && self.short_polls_miss {
            return Ok(None);
        }
        if let Some(m) = self.take(lane, visibility_s) {
            return Ok(Some(m));
        }
        let until = Instant::now() + Duration::from_secs(u64::from(wait_s));
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(500).min(until - Instant::now())).await;
            if let Some(m) = self.take(lane, visibility_s) {
                return Ok(Some(m));
            }
        }
        Ok(None)
    }

    async fn set_visibility(&self, _lane: &str, receipt: &str, visibility_s: u32) -> Result<(), String> {
        let cap = self.limits.max_visibility_s;
        let id = self.with(receipt, |q, latest| {
            let now = Instant::now();
            if !latest {
                return Err(format!(
                    "InvalidParameterValue: Value {receipt} for parameter ReceiptHandle is invalid. Reason: \
                     Message does not exist or is not available for visibility timeout change."
                ));
            }
            if q.visible_at <= now {
                return Err(format!("MessageNotInflight: message {} is not in flight", q.id));
            }
            let until = now + Duration::from_secs(u64::from(visibility_s));
            // SQS: "the visibility timeout can't be extended beyond 12 hours from the receive".
            if let Some(r) = q.received_at {
                if until > r + Duration::from_secs(cap) {
                    return Err(format!(
                        "InvalidParameterValue: visibility of {} cannot reach past {cap} s after its receive",
                        q.id
                    ));
                }
            }
            q.visible_at = until;
            Ok(q.id.clone())
        })?;
        self.visibility_changes.lock().expect("lock").push((id, visibility_s));
        Ok(())
    }

    async fn delete(&self, _lane: &str, receipt: &str) -> Result<(), String> {
        self.delete_receipt(receipt)
    }

    async fn requeue(&self, lane: &str, receipt: &str, body: &str, delay_s: u32) -> Result<(), String> {
        self.send_delayed(lane, body, delay_s);
        self.delete_receipt(receipt)
    }
}

impl Registry for FakeRegistry {
    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        WorkerRegistry::get(self, id).await
    }
    async fn register(&self, record: WorkerRecord) -> Result<(), StoreError> {
        self.register_launch(record).await
    }
    async fn heartbeat(
        &self,
        id: &str,
        state: WorkerState,
        idle_since: Option<f64>,
        now: f64,
    ) -> Result<(), StoreError> {
        // As the DynamoDB adapter's agent registry: deregistering is a conditional move that
        // leaves a Stopped row as it is (no error).
        if state == WorkerState::Terminating {
            return self
                .set_state_if(id, state, &crate::ports::DEREGISTER_FROM)
                .await
                .map(|_| ());
        }
        self.agent_heartbeat(id, state, idle_since, now)
    }

    async fn mark_busy(&self, id: &str, now: f64) -> Result<bool, StoreError> {
        FakeRegistry::mark_busy(self, id, now)
    }

    async fn set_cached_projects(&self, id: &str, projects: &[String]) -> Result<(), StoreError> {
        FakeRegistry::set_cached_projects(self, id, projects)
    }
}

/// Files of one checkpoint: (relative path, bytes).
type Files = Vec<(String, Vec<u8>)>;

/// Checkpoints in memory: job -> seq -> files; each upload and download can take a set time of
/// tokio time (a checkpoint of many GB on a real link).
#[derive(Debug, Default)]
pub struct FakeCheckpoints {
    store: Mutex<BTreeMap<String, BTreeMap<u64, Files>>>,
    transfer_time: Duration,
    transfers: Mutex<Vec<Transfer>>,
}

/// One upload or download of [`FakeCheckpoints`], for tests to check when it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// `true` for an upload.
    pub upload: bool,
    /// Job id.
    pub job_id: String,
    /// Sequence number.
    pub seq: u64,
    /// When it started.
    pub started: Instant,
    /// When it completed (`None`: in flight, or abandoned).
    pub ended: Option<Instant>,
}

impl FakeCheckpoints {
    /// Every upload and download takes `t` (tokio time; an upload counts only at its end, as
    /// the S3 store's manifest is written last).
    pub fn with_transfer_time(t: Duration) -> Self {
        Self {
            transfer_time: t,
            ..Self::default()
        }
    }

    /// Every transfer started, in order.
    pub fn transfers(&self) -> Vec<Transfer> {
        self.transfers.lock().expect("lock").clone()
    }

    /// Record a transfer's start; returns its index.
    fn begin(&self, upload: bool, job_id: &str, seq: u64) -> usize {
        let mut t = self.transfers.lock().expect("lock");
        t.push(Transfer {
            upload,
            job_id: job_id.into(),
            seq,
            started: Instant::now(),
            ended: None,
        });
        t.len() - 1
    }

    /// Take the transfer time, then record the end of transfer `i`.
    async fn finish(&self, i: usize) {
        tokio::time::sleep(self.transfer_time).await;
        self.transfers.lock().expect("lock")[i].ended = Some(Instant::now());
    }

    /// Sequence numbers stored for `job`.
    pub fn seqs(&self, job: &str) -> Vec<u64> {
        self.store
            .lock()
            .expect("lock")
            .get(job)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }
}

fn read_tree(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        if e.file_type()?.is_dir() {
            read_tree(root, &p, out)?;
        } else {
            let rel = p.strip_prefix(root).unwrap_or(&p).display().to_string();
            out.push((rel, std::fs::read(&p)?));
        }
    }
    Ok(())
}

impl CheckpointStore for FakeCheckpoints {
    async fn upload(&self, job_id: &str, seq: u64, dir: &Path) -> Result<CheckpointRef, StoreError> {
        // The files are read as the transfer goes, as S3 uploads stream them: here at its end.
        let i = self.begin(true, job_id, seq);
        self.finish(i).await;
        let mut files = Vec::new();
        read_tree(dir, dir, &mut files).map_err(|e| StoreError::Other(e.to_string()))?;
        let r = CheckpointRef {
            job_id: job_id.into(),
            seq,
            files: files.iter().map(|(p, b)| (p.clone(), b.len() as u64)).collect(),
        };
        self.store
            .lock()
            .expect("lock")
            .entry(job_id.into())
            .or_default()
            .insert(seq, files);
        Ok(r)
    }

    async fn latest(&self, job_id: &str) -> Result<Option<CheckpointRef>, StoreError> {
        let s = self.store.lock().expect("lock");
        Ok(s.get(job_id)
            .and_then(|m| m.iter().next_back())
            .map(|(seq, files)| CheckpointRef {
                job_id: job_id.into(),
                seq: *seq,
                files: files.iter().map(|(p, b)| (p.clone(), b.len() as u64)).collect(),
            }))
    }

    async fn download(&self, r: &CheckpointRef, dest: &Path) -> Result<(), StoreError> {
        let i = self.begin(false, &r.job_id, r.seq);
        self.finish(i).await;
        let files = self
            .store
            .lock()
            .expect("lock")
            .get(&r.job_id)
            .and_then(|m| m.get(&r.seq))
            .cloned()
            .ok_or_else(|| StoreError::NotFound(format!("{} #{}", r.job_id, r.seq)))?;
        for (p, b) in files {
            let path = dest.join(p);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| StoreError::Other(e.to_string()))?;
            }
            std::fs::write(path, b).map_err(|e| StoreError::Other(e.to_string()))?;
        }
        Ok(())
    }
}

/// Input objects in memory (uri -> bytes), and job sessions.
#[derive(Debug, Default)]
pub struct FakeObjects {
    /// uri -> bytes.
    pub objects: Mutex<BTreeMap<String, Vec<u8>>>,
    /// `None`: no job role (jobs get no session). `Some(n)`: sessions are issued, `n` so far
    /// (each an hour long, key `ASIAJOB<n>`).
    pub sessions: Mutex<Option<u32>>,
    /// Uploaded outputs: `outputs/<job_id>/<path>` -> bytes.
    pub outputs: Mutex<BTreeMap<String, Vec<u8>>>,
    /// When set, output uploads fail with this error (as S3 refusing them would).
    pub outputs_error: Mutex<Option<String>>,
    /// Log streams: stream -> lines.
    pub logs: Mutex<BTreeMap<String, Vec<String>>>,
    /// When set, every job session fails with this error (as STS refusing or failing would).
    pub session_error: Mutex<Option<crate::ports::SessionError>>,
}

impl FakeObjects {
    /// Issue job sessions (as with a job role).
    pub fn with_sessions() -> Self {
        Self {
            sessions: Mutex::new(Some(0)),
            ..Self::default()
        }
    }
}

impl Objects for FakeObjects {
    async fn download(&self, uri: &str, dest: &Path) -> Result<(), String> {
        let b = self
            .objects
            .lock()
            .expect("lock")
            .get(uri)
            .cloned()
            .ok_or_else(|| format!("{uri}: NoSuchKey"))?;
        std::fs::write(dest, b).map_err(|e| e.to_string())
    }

    async fn upload_outputs(&self, job_id: &str, dir: &Path) -> Result<usize, String> {
        fn walk(base: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) -> std::io::Result<()> {
            for e in std::fs::read_dir(dir)? {
                let p = e?.path();
                if p.is_dir() {
                    walk(base, &p, out)?;
                } else {
                    let rel = p.strip_prefix(base).unwrap_or(&p).display().to_string();
                    out.push((rel, std::fs::read(&p)?));
                }
            }
            Ok(())
        }
        if let Some(e) = self.outputs_error.lock().expect("lock").clone() {
            return Err(e);
        }
        let mut files = Vec::new();
        walk(dir, dir, &mut files).map_err(|e| e.to_string())?;
        let mut m = self.outputs.lock().expect("lock");
        for (rel, bytes) in &files {
            m.insert(format!("outputs/{job_id}/{rel}"), bytes.clone());
        }
        Ok(files.len())
    }

    async fn log_lines(&self, stream: &str, lines: &[(f64, String)]) -> Result<(), String> {
        self.logs
            .lock()
            .expect("lock")
            .entry(stream.to_string())
            .or_default()
            .extend(lines.iter().map(|(_, l)| l.clone()));
        Ok(())
    }

    async fn job_session(
        &self,
        job_id: &str,
        input: Option<&str>,
    ) -> Result<Option<crate::ports::JobCredentials>, crate::ports::SessionError> {
        use crate::ports::SessionError;
        let mut s = self.sessions.lock().expect("lock");
        let Some(n) = s.as_mut() else { return Ok(None) };
        // The session policy the AWS adapter sends, held to STS's rules as STS would.
        let input = input.and_then(onoff_control::job::parse_s3_uri);
        let policy = onoff_control::boundary::job_session_policy("aws", "onoff-fake", job_id, input);
        onoff_control::boundary::session_policy_text(&policy)
            .map_err(|e| SessionError::Refused(format!("job session: {e}")))?;
        if let Some(e) = self.session_error.lock().expect("lock").clone() {
            return Err(e);
        }
        *n += 1;
        Ok(Some(crate::ports::JobCredentials {
            access_key_id: format!("ASIAJOB{n}"),
            secret_access_key: format!("secret-{job_id}-{n}"),
            session_token: format!("token-{n}"),
            expiration: "2099-01-01T00:00:00Z".into(),
            lifetime_s: 3600.0,
        }))
    }
}

/// Records self-terminations.
#[derive(Debug, Default)]
pub struct FakeInstance(pub Mutex<Vec<String>>, pub Mutex<Vec<String>>);

impl FakeInstance {
    /// Instances whose spot request was released ([`Instance::release_request`]), in order.
    #[must_use]
    pub fn released(&self) -> Vec<String> {
        self.1.lock().expect("lock").clone()
    }
}

impl Instance for FakeInstance {
    async fn terminate_self(&self, id: &str) -> Result<(), String> {
        self.0.lock().expect("lock").push(id.into());
        Ok(())
    }
    async fn release_request(&self, id: &str) -> Result<(), String> {
        self.1.lock().expect("lock").push(id.into());
        Ok(())
    }
}

/// How a scripted job behaves. It processes `items_per_s` items per second of tokio time until
/// `items` are done, resuming from `$ONOFF_RESUME_DIR/items`; writes a checkpoint (a numbered
/// directory holding `items`) every `checkpoint_every_s`, when `$ONOFF_CHECKPOINT_NOW_FILE`
/// appears (and deletes it) and when stopped, deleting the older ones as the example job does;
/// exits `exit_code` when done, 143 when stopped.
#[derive(Debug, Clone, PartialEq)]
pub struct Script {
    /// Items to process in all.
    pub items: u64,
    /// Items per second.
    pub items_per_s: u64,
    /// Local checkpoint period, seconds (`None`: only on stop).
    pub checkpoint_every_s: Option<u64>,
    /// Exit code once done.
    pub exit_code: i32,
}

/// Starts [`Script`]s by program name (`argv[0]`); an unknown program cannot be started.
///
/// Every scripted job also keeps a model in its project cache: at its start it looks for
/// `$ONOFF_CACHE_DIR/model.bin` ([`ScriptedLauncher::cache_hits`]) and writes it
/// ([`ScriptedLauncher::set_model_bytes`] bytes, 1 KiB unless set) when it is not there. As it
/// exits it leaves a copy of its work dir behind ([`ScriptedLauncher::work_dir`]), since the
/// agent removes the dir itself once the attempt is settled. It leaves a temporary file
/// (`scratch`) in `$TMPDIR` when that is set.
#[derive(Debug, Default)]
pub struct ScriptedLauncher {
    scripts: Mutex<BTreeMap<String, Script>>,
    started: Mutex<Vec<JobCommand>>,
    /// Per start: after how many seconds of work it ends, and how.
    failures: Mutex<BTreeMap<usize, (u64, JobExit)>>,
    cache_hits: Mutex<Vec<Option<bool>>>,
    model_bytes: Mutex<Option<usize>>,
    work_dirs: Arc<Mutex<BTreeMap<usize, WorkDirCopy>>>,
}

/// A job's work dir as the job left it: each file's path, mode bits and bytes.
pub type WorkDirCopy = BTreeMap<std::path::PathBuf, (u32, Vec<u8>)>;

fn copy_tree(dir: &Path, into: &mut WorkDirCopy) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => copy_tree(&path, into),
            Ok(m) => {
                let bytes = std::fs::read(&path).unwrap_or_default();
                into.insert(path, (m.permissions().mode() & 0o7777, bytes));
            }
            Err(_) => {}
        }
    }
}

impl ScriptedLauncher {
    /// Register `program`.
    pub fn script(&self, program: &str, s: Script) {
        self.scripts.lock().expect("lock").insert(program.into(), s);
    }

    /// The `n`-th start (counted from 0 over every program) crashes with exit code 1 after
    /// `after_s` seconds of work.
    pub fn fail_start(&self, n: usize, after_s: u64) {
        self.failures
            .lock()
            .expect("lock")
            .insert(n, (after_s, JobExit::Code(1)));
    }

    /// The `n`-th start is killed by `signal` (9: SIGKILL, as the kernel's OOM killer sends it)
    /// after `after_s` seconds of work, the agent having asked for nothing.
    pub fn kill_start(&self, n: usize, after_s: u64, signal: i32) {
        self.failures
            .lock()
            .expect("lock")
            .insert(n, (after_s, JobExit::Signal(signal)));
    }

    /// Every command started, in order.
    pub fn started(&self) -> Vec<JobCommand> {
        self.started.lock().expect("lock").clone()
    }

    /// Per start, in order: whether the job found its model in `$ONOFF_CACHE_DIR` (`None`: it
    /// was given no cache).
    pub fn cache_hits(&self) -> Vec<Option<bool>> {
        self.cache_hits.lock().expect("lock").clone()
    }

    /// The size of the model a job writes into its cache when it does not find it there.
    pub fn set_model_bytes(&self, n: usize) {
        *self.model_bytes.lock().expect("lock") = Some(n);
    }

    /// The work dir of the `n`-th start (from 0) as the job left it when it exited (`None`: it
    /// has not exited).
    pub fn work_dir(&self, n: usize) -> Option<WorkDirCopy> {
        self.work_dirs.lock().expect("lock").get(&n).cloned()
    }
}

fn env_of<'a>(cmd: &'a JobCommand, k: &str) -> Option<&'a str> {
    cmd.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
}

fn write_checkpoint(dir: &Path, n: u64, items: u64) {
    let tmp = dir.join(format!(".tmp-{n}"));
    let _ = std::fs::create_dir_all(&tmp);
    let _ = std::fs::write(tmp.join("items"), items.to_string());
    let _ = std::fs::rename(&tmp, dir.join(n.to_string()));
    if n > 1 {
        let _ = std::fs::remove_dir_all(dir.join((n - 1).to_string()));
    }
}

impl Launcher for ScriptedLauncher {
    fn start(&self, cmd: &JobCommand) -> Result<JobHandle, String> {
        let script = self
            .scripts
            .lock()
            .expect("lock")
            .get(&cmd.argv[0])
            .cloned()
            .ok_or_else(|| format!("cannot start {:?}: No such file or directory", cmd.argv[0]))?;
        let (nth, fail_after_s) = {
            let mut started = self.started.lock().expect("lock");
            started.push(cmd.clone());
            let nth = started.len() - 1;
            (nth, self.failures.lock().expect("lock").get(&nth).copied())
        };
        let hit = env_of(cmd, "ONOFF_CACHE_DIR").map(|d| {
            let model = Path::new(d).join("model.bin");
            let hit = model.exists();
            if !hit {
                let n = self.model_bytes.lock().expect("lock").unwrap_or(1024);
                let _ = std::fs::write(&model, vec![0u8; n]);
            }
            hit
        });
        self.cache_hits.lock().expect("lock").push(hit);
        // A temporary file, as a job's libraries leave them: where `TMPDIR` says.
        if let Some(tmp) = env_of(cmd, "TMPDIR") {
            let _ = std::fs::write(Path::new(tmp).join("scratch"), b"temporary");
        }
        let (work_dirs, cwd) = (self.work_dirs.clone(), cmd.cwd.clone());
        let ckpt = env_of(cmd, "ONOFF_CHECKPOINT_DIR").map(std::path::PathBuf::from);
        let ckpt_now = env_of(cmd, "ONOFF_CHECKPOINT_NOW_FILE").map(std::path::PathBuf::from);
        let output = env_of(cmd, "ONOFF_OUTPUT_DIR").map(std::path::PathBuf::from);
        let mut done: u64 = env_of(cmd, "ONOFF_RESUME_DIR")
            .and_then(|d| std::fs::read_to_string(Path::new(d).join("items")).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let (etx, events) = mpsc::channel(1024);
        let (control, mut crx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut n = 0;
            let mut since_ckpt = 0;
            let mut worked_s: u64 = 0;
            // Its result, in ONOFF_OUTPUT_DIR, at every end it sees.
            let result = |done: u64| {
                if let Some(dir) = &output {
                    let _ = std::fs::write(dir.join("result.txt"), format!("{done}\n"));
                }
            };
            let code = loop {
                if done >= script.items {
                    result(done);
                    let _ = etx.send(JobEvent::Line(format!("finished {done}"))).await;
                    break JobExit::Code(script.exit_code);
                }
                if let Some((_, exit)) = fail_after_s.filter(|(s, _)| worked_s >= *s) {
                    let _ = etx.send(JobEvent::Line(format!("crashed at {done}"))).await;
                    break exit;
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {
                        worked_s += 1;
                        done = (done + script.items_per_s).min(script.items);
                        let _ = etx.send(JobEvent::Line(format!("ONOFF_ITEMS {done}"))).await;
                        since_ckpt += 1;
                        let asked = ckpt_now.as_deref().is_some_and(|f| std::fs::remove_file(f).is_ok());
                        if let Some(dir) = &ckpt {
                            if asked || script.checkpoint_every_s.is_some_and(|every| since_ckpt >= every) {
                                since_ckpt = 0;
                                n += 1;
                                write_checkpoint(dir, n, done);
                            }
                        }
                    }
                    c = crx.recv() => match c {
                        Some(Control::Stop) => {
                            if let Some(dir) = &ckpt {
                                n += 1;
                                write_checkpoint(dir, n, done);
                            }
                            result(done);
                            let _ = etx.send(JobEvent::Line(format!("stopped at {done}"))).await;
                            break JobExit::Code(143);
                        }
                        Some(Control::Kill) | None => break JobExit::Signal(9),
                    }
                }
            };
            let mut copy = WorkDirCopy::new();
            copy_tree(&cwd, &mut copy);
            work_dirs.lock().expect("lock").insert(nth, copy);
            let _ = etx.send(JobEvent::Exited(code)).await;
        });
        Ok(JobHandle { events, control })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::FakeInbox;
    use crate::ports::Inbox;

    #[tokio::test(start_paused = true)]
    async fn a_stale_receipt_deletes_nothing_and_changes_no_visibility() {
        let inbox = FakeInbox::default();
        let id = inbox.send("standard", "{\"job_id\": \"j1\"}");
        let first = inbox.receive("standard", 0, 30).await.unwrap().expect("received");
        // Its visibility runs out before the first receiver is done: another receives it.
        tokio::time::advance(Duration::from_secs(31)).await;
        let second = inbox.receive("standard", 0, 30).await.unwrap().expect("received again");
        assert_ne!(first.receipt, second.receipt);
        // The first receipt is stale: the delete succeeds and deletes nothing; a visibility
        // change is refused.
        inbox
            .delete("standard", &first.receipt)
            .await
            .expect("a stale delete succeeds");
        assert_eq!(inbox.remaining(), vec![(id.clone(), 2)]);
        assert_eq!(inbox.stale_deletes(), vec![id.clone()]);
        let e = inbox.set_visibility("standard", &first.receipt, 0).await.unwrap_err();
        assert!(e.starts_with("InvalidParameterValue"), "{e}");
        // A hand-back with it sends the new message and leaves the old one too.
        inbox
            .requeue("standard", &first.receipt, "{\"job_id\": \"j1\"}", 0)
            .await
            .unwrap();
        assert_eq!(inbox.pending_for("standard", "j1"), 2);
        // The latest receipt still works.
        inbox.set_visibility("standard", &second.receipt, 60).await.unwrap();
        inbox.delete("standard", &second.receipt).await.unwrap();
        assert_eq!(inbox.pending_for("standard", "j1"), 1);
        assert_eq!(inbox.stale_deletes().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_visible_again_takes_no_visibility_change_but_its_latest_receipt_deletes_it() {
        let inbox = FakeInbox::default();
        inbox.send("standard", "{\"job_id\": \"j1\"}");
        let m = inbox.receive("standard", 0, 30).await.unwrap().expect("received");
        tokio::time::advance(Duration::from_secs(31)).await;
        let e = inbox.set_visibility("standard", &m.receipt, 60).await.unwrap_err();
        assert!(e.starts_with("MessageNotInflight"), "{e}");
        // Not received since: its receipt is still the latest, and deletes it.
        inbox.delete("standard", &m.receipt).await.unwrap();
        assert!(inbox.remaining().is_empty());
        assert!(inbox.stale_deletes().is_empty());
    }
}
