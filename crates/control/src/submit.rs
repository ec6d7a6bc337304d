//! The submit use case: validate a job spec, write the job record, enqueue it.
//!
//! Order: validate → create the record (idempotent by id) → send the wake-up message → record
//! `sent_at`. The submission is done once the record is written: the row is the job. A wake-up
//! message that cannot be sent is left to the reconciler's reaper, which sends one to a pending
//! row that never had one at its next run ([`Submitted::Unsent`]; `reconcile::reap_jobs`), so
//! the submission is not retried for it. A failure before the record is written is retryable; a
//! retry resumes there, and a resubmission of a job already written sends at most its missing
//! wake-up. A bad spec leaves an error record with its reason and nothing else: one over
//! [`MAX_SPEC_BYTES`], one that does not parse or validate, one the [`Rules`] say no allowed
//! instance can run ([`feasible`]), and one the jobs table refuses as invalid.
//!
//! So a submission that ends in the submission queue's dead-letter queue made no job. That
//! matters on AWS: a dead-letter queue redrive (`StartMessageMoveTask`, the console's "Start DLQ
//! redrive") gives every message it moves a new message id ("All redriven messages are considered
//! new messages and are assigned a new messageID and enqueueTime", Amazon SQS Developer Guide,
//! "Configure a dead-letter queue redrive"), and a message without a `client_token` is keyed by its
//! id: had a written job's submission been dead-lettered, its redrive would have made a second
//! job.

pub use crate::admission::{feasible, too_large, Admission, Rules, MAX_SPEC_BYTES};
use crate::job::{bounded_reason, job_id_for, JobSpec};
use crate::ports::{wake, Created, JobQueue, JobRecord, JobStore, StoreError, WakeError};

/// Where a submission came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An S3 object version. Each version is its own submission (an overwrite is a new job);
    /// the same version delivered twice is one job. Without a version id (a bucket without
    /// versioning) the ETag tells submissions apart, so a re-put of the same bytes is one job.
    S3 {
        /// Bucket.
        bucket: String,
        /// Object key.
        key: String,
        /// ETag.
        etag: String,
        /// Version id, when the bucket has versioning.
        version: Option<String>,
    },
    /// An SQS submission message.
    Sqs {
        /// Message id.
        message_id: String,
    },
}

/// The key a spec with `client_token` in `project` is idempotent by, whatever its source (a job
/// id is [`job_id_for`] of it): what `onoff submit`, which always sets a token, names its object by.
pub fn token_key(client_token: &str, project: &str) -> String {
    format!("token:{project}:{client_token}")
}

impl Source {
    /// The key a job submitted from here is idempotent by (its id is [`job_id_for`] of it): the
    /// spec's `client_token` within its `project` when it has one, else the source itself (an
    /// S3 object version with its ETag, an SQS message id).
    pub fn job_key(&self, client_token: Option<&str>, project: &str) -> String {
        match (client_token, self) {
            (Some(t), _) => token_key(t, project),
            (
                None,
                Source::S3 {
                    bucket,
                    key,
                    etag,
                    version,
                },
            ) => match version {
                Some(v) => format!("s3:{bucket}/{key}#{etag}@{v}"),
                None => format!("s3:{bucket}/{key}#{etag}"),
            },
            (None, Source::Sqs { message_id }) => format!("sqs:{message_id}"),
        }
    }

    /// Text stored on the job and on error records.
    pub fn describe(&self) -> String {
        match self {
            Source::S3 {
                bucket,
                key,
                etag,
                version,
            } => match version {
                Some(v) => format!("s3://{bucket}/{key}?versionId={v}#{etag}"),
                None => format!("s3://{bucket}/{key}#{etag}"),
            },
            Source::Sqs { message_id } => format!("sqs:{message_id}"),
        }
    }
}

/// What a submission did.
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    /// A new job, enqueued.
    New(String),
    /// A resubmission of an existing job (enqueued now if it had not been).
    Existing(String),
    /// A job written (new, or an existing one never enqueued) whose wake-up message could not
    /// be sent, or whose `sent_at` could not be recorded after it was: the submission is done
    /// all the same, and the reconciler's reaper sends a message at its next run where the
    /// lane's queue holds fewer than it has pending jobs (a pending row with no message
    /// recorded is due at once, `JobRecord::needs_wake_up`).
    Unsent {
        /// The job.
        id: String,
        /// Whether this submission created it.
        new: bool,
        /// Why the message was not sent (the queue's or the table's error).
        reason: String,
    },
}

impl Submitted {
    /// The job's id.
    pub fn id(&self) -> &str {
        match self {
            Submitted::New(id) | Submitted::Existing(id) | Submitted::Unsent { id, .. } => id,
        }
    }

    /// Whether this submission created the job.
    pub fn is_new(&self) -> bool {
        matches!(self, Submitted::New(_) | Submitted::Unsent { new: true, .. })
    }
}

/// Why a submission failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The spec is bad: an error record was written; retrying cannot help (dead-letter queue).
    #[error("rejected {source_desc}: {reason}")]
    Rejected {
        /// The submission's source.
        source_desc: String,
        /// The clear reason.
        reason: String,
    },
    /// A store or queue failed: retrying may help.
    #[error("retryable failure for {source_desc}: {reason}")]
    Retryable {
        /// The submission's source.
        source_desc: String,
        /// What failed.
        reason: String,
    },
}

/// The id [`submit`] gives the job of spec `text` from `source`, read without validating the spec:
/// its `client_token` and `project` when both are strings, else `None` (a spec without a project
/// string never parses, so no job was made of it). For `onoff dead-letters`, which asks whether a
/// dead-lettered submission made a job after all: the rare case where the job's write was applied,
/// its answer lost, and the table refused every later receive. Such a message without a
/// `client_token` is keyed by its message id, which a redrive changes (module docs), so it must be
/// deleted rather than moved back.
pub fn job_id_of(text: &str, source: &Source) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let project = v.get("project")?.as_str()?;
    let token = match v.get("client_token") {
        None | Some(serde_json::Value::Null) => None,
        Some(t) => Some(t.as_str()?),
    };
    Some(job_id_for(&source.job_key(token, project)))
}

/// Write the error record for a submission from `source` rejected for `reason` (a rejection's
/// only effect) and return the [`SubmitError::Rejected`] to report, or
/// [`SubmitError::Retryable`] when the record could not be written. For rejections found before
/// a spec is read (an object over [`MAX_SPEC_BYTES`], not UTF-8 text); [`submit`] calls it for
/// the rest. The reason is cut to [`MAX_REASON_BYTES`](crate::job::MAX_REASON_BYTES)
/// ([`bounded_reason`]), recorded and reported alike: it may quote the spec (a parser's message
/// names an unknown field), and a record over DynamoDB's 400 KB item limit would be refused,
/// leaving the submission to be retried into the dead-letter queue with no reason recorded.
pub async fn reject<J: JobStore>(source: &Source, reason: String, now: f64, jobs: &J) -> SubmitError {
    let reason = bounded_reason(reason);
    let source_desc = source.describe();
    match jobs.record_error(&source_desc, &reason, now).await {
        Ok(()) => SubmitError::Rejected { source_desc, reason },
        Err(e) => SubmitError::Retryable {
            source_desc,
            reason: format!("recording the rejection ({reason}) failed: {e}"),
        },
    }
}

/// Submit the spec `text` from `source`, checked against `rules` (the lanes that exist and, with
/// an [`Admission`], whether an allowed instance can run it); `now`: unix seconds.
///
/// # Errors
/// [`SubmitError::Rejected`] for a bad spec (error record written), [`SubmitError::Retryable`]
/// when a store or the queue failed.
pub async fn submit<J: JobStore, Q: JobQueue, R: Rules + ?Sized>(
    text: &str,
    source: &Source,
    rules: &R,
    now: f64,
    jobs: &J,
    queue: &Q,
) -> Result<Submitted, SubmitError> {
    let desc = source.describe();
    let retryable = |e: &dyn std::fmt::Display| SubmitError::Retryable {
        source_desc: desc.clone(),
        reason: e.to_string(),
    };
    if let Some(reason) = too_large(text.len() as u64) {
        return Err(reject(source, reason, now, jobs).await);
    }
    let checked = JobSpec::parse(text, &rules.lanes(), now).and_then(|s| rules.runnable(&s).map(|()| s));
    let spec = match checked {
        Ok(s) => s,
        Err(e) => return Err(reject(source, e.to_string(), now, jobs).await),
    };
    let id = job_id_for(&source.job_key(spec.client_token.as_deref(), &spec.project));
    let record = JobRecord::new(id.clone(), spec.clone(), desc.clone(), now);
    let created = match jobs.create(&record).await {
        Ok(c) => c,
        // The table refused the item itself (too large, a bad attribute): retrying cannot help.
        Err(StoreError::Invalid(why)) => {
            return Err(reject(source, format!("the jobs table refused the job: {why}"), now, jobs).await)
        }
        Err(e) => return Err(retryable(&e)),
    };
    let (existing, stored) = match created {
        Created::New => (false, spec),
        Created::Existing(r) if r.sent_at.is_some() => return Ok(Submitted::Existing(id)),
        Created::Existing(r) => (true, r.spec),
    };
    match wake(jobs, queue, &id, &stored, 0, now).await {
        Ok(()) | Err(WakeError::Store(StoreError::NotFound(_))) => {}
        // The row is written: the job exists, and the reaper sends its message. Retrying the
        // submission instead could dead-letter a job's submission (module docs).
        Err(e) => {
            return Ok(Submitted::Unsent {
                id,
                new: !existing,
                reason: e.to_string(),
            })
        }
    }
    Ok(if existing {
        Submitted::Existing(id)
    } else {
        Submitted::New(id)
    })
}
