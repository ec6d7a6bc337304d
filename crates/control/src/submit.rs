//! The submit use case: validate a job spec, write the job record, enqueue it.
//!
//! Order: validate → create the record (idempotent by id) → send the wake-up message → record
//! `sent_at`. A retry after a failure at any step resumes there; a resubmission of a job already
//! sent sends nothing (and if the message is lost anyway, the reaper sends another within two
//! lease periods). A bad spec leaves an error record with its reason and nothing else.

use crate::job::{job_id_for, JobSpec};
use crate::ports::{wake, Created, JobQueue, JobRecord, JobStore, StoreError, WakeError};

/// Where a submission came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An S3 object (key and ETag): a re-put of the same bytes is the same job.
    S3 {
        /// Bucket.
        bucket: String,
        /// Object key.
        key: String,
        /// ETag.
        etag: String,
    },
    /// An SQS submission message.
    Sqs {
        /// Message id.
        message_id: String,
    },
}

impl Source {
    /// Text stored on the job and on error records.
    pub fn describe(&self) -> String {
        match self {
            Source::S3 { bucket, key, etag } => format!("s3://{bucket}/{key}#{etag}"),
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

/// Submit the spec `text` from `source`. `lanes`: the lane names that exist; `now`: unix seconds.
///
/// # Errors
/// [`SubmitError::Rejected`] for a bad spec (error record written), [`SubmitError::Retryable`]
/// when a store or the queue failed.
pub async fn submit<J: JobStore, Q: JobQueue>(
    text: &str,
    source: &Source,
    lanes: &[&str],
    now: f64,
    jobs: &J,
    queue: &Q,
) -> Result<Submitted, SubmitError> {
    let desc = source.describe();
    let retryable = |e: &dyn std::fmt::Display| SubmitError::Retryable {
        source_desc: desc.clone(),
        reason: e.to_string(),
    };
    let spec = match JobSpec::parse(text, lanes, now) {
        Ok(s) => s,
        Err(e) => {
            let reason = e.to_string();
            jobs.record_error(&desc, &reason, now)
                .await
                .map_err(|e| retryable(&e))?;
            return Err(SubmitError::Rejected {
                source_desc: desc,
                reason,
            });
        }
    };
    let key = match (&spec.client_token, source) {
        (Some(t), _) => format!("token:{}:{t}", spec.project),
        (None, Source::S3 { bucket, key, etag }) => format!("s3:{bucket}/{key}#{etag}"),
        (None, Source::Sqs { message_id }) => format!("sqs:{message_id}"),
    };
    let id = job_id_for(&key);
    let record = JobRecord::new(id.clone(), spec.clone(), desc.clone(), now);
    let (existing, lane) = match jobs.create(&record).await {
        Ok(Created::New) => (false, spec.lane.clone()),
        Ok(Created::Existing(r)) if r.sent_at.is_some() => return Ok(Submitted::Existing(id)),
        Ok(Created::Existing(r)) => (true, r.spec.lane.clone()),
        Err(StoreError::Malformed(reason)) => {
            // DynamoDB refused the item as it is (over 400 KB, say): retrying cannot help.
            let reason = format!("the job cannot be stored: {reason}");
            jobs.record_error(&desc, &reason, now)
                .await
                .map_err(|e| retryable(&e))?;
            return Err(SubmitError::Rejected {
                source_desc: desc,
                reason,
            });
        }
        Err(e) => return Err(retryable(&e)),
    };
    match wake(jobs, queue, &id, &lane, 0, now).await {
        Ok(()) | Err(WakeError::Store(StoreError::NotFound(_))) => {}
        Err(e) => return Err(retryable(&e)),
    }
    Ok(if existing {
        Submitted::Existing(id)
    } else {
        Submitted::New(id)
    })
}
