//! `onoff dead-letters`: what the stack's dead-letter queues hold, why, and what to do about it.
//! The answer to the `onoff-dead-letters` alarm.
//!
//! Four queues (template.yaml): the submission queue's dead-letter queue (job specs submit
//! refused, or could not store, `maxReceiveCount` times), each lane's (wake-up messages a worker
//! found poison), and `failed-events` (the events a function failed on past Lambda's retries).
//! A submission or wake-up message there is explained by its error record in the jobs table
//! (`error#sqs:<message id>`: submit and the agent write it before they leave the message, and
//! SQS keeps a message's id when it moves it to its dead-letter queue); an event by the
//! `ErrorCode` and `ErrorMessage` attributes Lambda sends it with, and an S3 event also by what
//! became of its object: the job made of it, its error record, or neither (put it again). A
//! submission is also looked up under the job id submit would give it: in a rare case (the job's
//! write applied, its answer lost, the table refusing every later receive) a dead-lettered
//! submission made its job, and without a `client_token` a move back would make a second one.
//!
//! The queues are read, never changed: each message is received with a visibility timeout of
//! [`PEEK_VISIBILITY_S`] (so the next receive returns others, not it again) and put back at once
//! (ChangeMessageVisibilityBatch to 0). Receiving counts: a message's `ApproximateReceiveCount`
//! grows by one per read, which moves nothing (no dead-letter queue has one of its own).
//!
//! A queue whose counts say it is empty is not read. The others are read with a 1 s long poll
//! until the count is reached or a receive returns nothing: a short poll asks a sample of SQS's
//! servers, and of a small queue "you might not receive any messages in a particular
//! ReceiveMessage response", where a long poll "eliminates false empty responses by querying all
//! [...] Amazon SQS servers" (Amazon SQS Developer Guide, "Amazon SQS short and long polling").
//! moto does not sample servers: the difference shows on AWS only.

use anyhow::{Context, Result};
use aws_sdk_sqs::types::{ChangeMessageVisibilityBatchRequestEntry, MessageSystemAttributeName, QueueAttributeName};
use comfy_table::{presets::UTF8_BORDERS_ONLY, Table};
use onoff_control::job::MAX_REASON_BYTES;
use onoff_control::ports::JobStore as _;
use serde::Serialize;

use super::{aws_error, when, Ops, Target};

/// `onoff dead-letters`.
#[derive(clap::Args, Debug)]
pub struct DeadLettersArgs {
    /// Messages shown per queue, at most, oldest first (the count is of all of them).
    #[arg(long, default_value_t = 20)]
    limit: usize,
    #[command(flatten)]
    target: Target,
}

/// Seconds a message read by `onoff dead-letters` stays hidden before the command puts it back
/// (it puts back every message it read as soon as it has read the queue): long enough that the
/// receives after it return other messages.
pub const PEEK_VISIBILITY_S: i32 = 30;

/// Body bytes shown (and given in `--json`), at most.
pub const BODY_BYTES: usize = 1024;

/// What a queue holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueKind {
    /// The submission queue's dead-letter queue: job specs.
    Submissions,
    /// A lane's dead-letter queue: wake-up messages.
    Lane,
    /// The functions' failed-events queue: events.
    FailedEvents,
}

impl QueueKind {
    /// The kind of queue `name` (`<stack>-submissions-dlq`, `<stack>-<lane>-dlq`,
    /// `<stack>-failed-events`, template.yaml's names); `None` for any other.
    pub fn of(name: &str) -> Option<Self> {
        if name.ends_with("-failed-events") {
            Some(QueueKind::FailedEvents)
        } else if name.ends_with("-submissions-dlq") {
            Some(QueueKind::Submissions)
        } else if name.ends_with("-dlq") {
            Some(QueueKind::Lane)
        } else {
            None
        }
    }

    /// What to do about its messages, for a queue of ARN `arn`.
    fn advice(self, arn: &str) -> String {
        match self {
            QueueKind::Submissions => format!(
                "each one made no job unless its line names one: a record submit refused has its \
                 reason (fix the spec or the policy and send it again), one without a reason failed \
                 for another cause (the submit function's log). Delete a message whose line says \
                 a move back would make a second job. Once fixed, `aws sqs start-message-move-task --source-arn \
                 {arn}` moves them all back to the submission queue (rights `OperatorAccess` does not give); a job \
                 is made once per message (module docs of onoff_control::submit)"
            ),
            QueueKind::Lane => "poison wake-up messages: no job is waiting for them (a job's row is \
                 the truth, and the reconciler sends a pending job a fresh message). Read the \
                 reasons and purge the queue (`aws sqs purge-queue`, a right `OperatorAccess` does not give)"
                .to_string(),
            QueueKind::FailedEvents => "events a function failed on past Lambda's retries. \
                 EC2 events and scale requests need nothing (the reconciler's next run reads \
                 EC2 and the jobs table itself); an S3 event is a job spec never submitted: put \
                 it again (a new object version is a new submission). Then purge the queue \
                 (`aws sqs purge-queue`, a right `OperatorAccess` does not give)"
                .to_string(),
        }
    }
}

/// One message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    pub message_id: String,
    /// When it was first sent, unix seconds (SQS's `SentTimestamp`).
    pub sent_at: Option<f64>,
    /// When SQS deletes it, unix seconds: its first send plus the queue's retention. A message
    /// moved to a dead-letter queue keeps its enqueue time ("The expiration of a message is
    /// always based on its original enqueue timestamp", Amazon SQS Developer Guide, "Using
    /// dead-letter queues in Amazon SQS"), so its time in the source queue counts.
    pub expires_at: Option<f64>,
    /// Receives so far (SQS's `ApproximateReceiveCount`, this read included).
    pub receives: Option<u64>,
    /// What it is: a job spec's project and name, a wake-up message's job, an event's kind.
    pub what: String,
    /// Why it is here: its error record's reason, or the function's error; `None` when nothing
    /// recorded one.
    pub reason: Option<String>,
    /// The body, cut to [`BODY_BYTES`].
    pub body: String,
}

/// One queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueReport {
    pub queue: String,
    pub kind: QueueKind,
    pub url: String,
    /// Messages it holds, visible or not (SQS's approximate counts).
    pub messages: u64,
    /// The messages read, oldest first, at most `--limit`.
    pub shown: Vec<DeadLetter>,
    /// What to do about them (empty for an empty queue).
    pub action: String,
}

/// `text` cut to at most `max` bytes, at a character boundary, with `…` when cut.
fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// What a message of a `kind` queue with `body` is, in a few words.
pub fn describe(kind: QueueKind, body: &str) -> String {
    let v: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let field = |k: &str| {
        v.as_ref()
            .and_then(|v| v.get(k))
            .and_then(serde_json::Value::as_str)
            .map(str::to_string)
    };
    match kind {
        QueueKind::Submissions => match v.as_ref().filter(|v| v.is_object()) {
            Some(_) => {
                let project = field("project").unwrap_or_else(|| "?".into());
                match field("name") {
                    Some(name) => format!("job spec {name:?} of project {project}"),
                    None => format!("job spec of project {project}"),
                }
            }
            None => "a body that is not a JSON object".to_string(),
        },
        QueueKind::Lane => match field("job_id") {
            Some(job) => format!("wake-up message for job {job}"),
            None => "a body that is not a wake-up message".to_string(),
        },
        QueueKind::FailedEvents => {
            let Some(v) = v.as_ref() else {
                return "a body that is not JSON".to_string();
            };
            if field("source").as_deref() == Some("onoff.scale-request") {
                return format!("scale request ({})", field("reason").as_deref().unwrap_or("no reason"));
            }
            if let Some(kind) = field("detail-type") {
                let instance = v["detail"]["instance-id"].as_str();
                return match instance {
                    Some(i) => format!("EventBridge: {kind}, {i}"),
                    None => format!("EventBridge: {kind}"),
                };
            }
            let objects: Vec<String> = s3_submissions(body)
                .iter()
                .filter_map(|s| match s {
                    onoff_control::submit::Source::S3 { bucket, key, .. } => Some(format!("s3://{bucket}/{key}")),
                    onoff_control::submit::Source::Sqs { .. } => None,
                })
                .collect();
            if !objects.is_empty() {
                return format!("S3 event: {}", objects.join(", "));
            }
            "an event of unknown kind".to_string()
        }
    }
}

/// The submissions an S3 event (`body`, Lambda's failed event) stood for: one per record of
/// an object created under `jobs/`, as the submit function names them.
pub fn s3_submissions(body: &str) -> Vec<onoff_control::submit::Source> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return Vec::new();
    };
    let records = v["Records"].as_array().map(Vec::as_slice).unwrap_or_default();
    records
        .iter()
        .filter(|r| r["eventSource"] == "aws:s3")
        .filter_map(|r| {
            let o = &r["s3"]["object"];
            onoff_aws::objects::s3_submission(
                r["s3"]["bucket"]["name"].as_str().unwrap_or_default(),
                o["key"].as_str()?,
                o["eTag"].as_str().unwrap_or_default(),
                o["versionId"].as_str(),
            )
        })
        .collect()
}

/// What became of the submissions of a failed S3 event (`body`): the job made of each object
/// (the id submit gives a spec without a `client_token`), its error record's reason, or
/// neither. `None` for any other event.
async fn s3_outcome(ops: &Ops, body: &str) -> Option<String> {
    let sources = s3_submissions(body);
    if sources.is_empty() {
        return None;
    }
    let mut said = Vec::new();
    for src in sources {
        let id = onoff_control::job::job_id_for(&src.job_key(None, ""));
        let line = match ops.jobs.get(&id).await {
            Ok(Some(_)) => format!("job {id} was made of it: nothing to do"),
            Ok(None) => match ops.jobs.error_record(&src.describe()).await {
                Ok(Some(reason)) => format!("rejected: {reason}"),
                Ok(None) => "no job under its object version (a spec with a client_token is keyed by it instead: see `onoff jobs`); put it again"
                    .to_string(),
                Err(e) => format!("its error record could not be read: {e}"),
            },
            Err(e) => format!("its job could not be read: {e}"),
        };
        said.push(line);
    }
    Some(said.join("; "))
}

/// Whether a job exists under the key submit gives the spec `body` of submission message `id`
/// (`onoff_control::submit::job_id_of`), and so what a move back would do. A dead-lettered
/// submission normally made none (module docs of onoff_control::submit); one did when the job's
/// write was applied, its answer lost, and the table refused every later receive. `None` when no
/// job is found, or the body names none.
async fn submission_outcome(ops: &Ops, id: &str, body: &str) -> Option<String> {
    let source = onoff_control::submit::Source::Sqs {
        message_id: id.to_string(),
    };
    let job = onoff_control::submit::job_id_of(body, &source)?;
    // Keyed by its client token, not by this message's id.
    let tokened = job != onoff_control::job::job_id_for(&source.job_key(None, ""));
    match ops.jobs.get(&job).await {
        Ok(None) => None,
        Ok(Some(_)) if tokened => Some(format!(
            "job {job} holds its client_token: a move back makes no second job"
        )),
        Ok(Some(_)) => Some(format!(
            "job {job} was made of it, its write's answer lost: delete this message before a move \
             back, which gives it a new message id and so would make a second job"
        )),
        Err(e) => Some(format!("its job {job} could not be read: {e}")),
    }
}

/// Read queue `url` (of `kind`): its counts and up to `limit` messages, put back after.
async fn read_queue(ops: &Ops, url: &str, kind: QueueKind, limit: usize) -> Result<QueueReport> {
    let sqs = &ops.clients.sqs;
    let name = url.rsplit('/').next().unwrap_or(url).to_string();
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::QueueArn)
        .attribute_names(QueueAttributeName::MessageRetentionPeriod)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("reading queue {name}: {}", aws_error(&e)))?;
    let attr = |a: QueueAttributeName| attrs.attributes().and_then(|m| m.get(&a)).cloned();
    let count = |a| attr(a).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let messages = count(QueueAttributeName::ApproximateNumberOfMessages)
        + count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible);
    let arn = attr(QueueAttributeName::QueueArn).unwrap_or_else(|| name.clone());
    let retention_s = attr(QueueAttributeName::MessageRetentionPeriod).and_then(|v| v.parse::<f64>().ok());
    let mut shown: Vec<DeadLetter> = Vec::new();
    let mut receipts: Vec<String> = Vec::new();
    let mut read = Ok(());
    // Receives until the count or `limit` is read, or a long poll returns nothing (module docs).
    let visible = count(QueueAttributeName::ApproximateNumberOfMessages) as usize;
    while shown.len() < limit.min(visible) {
        let want = (limit - shown.len()).min(10) as i32;
        let got = match sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(want)
            .visibility_timeout(PEEK_VISIBILITY_S)
            .wait_time_seconds(1)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
        {
            Ok(g) => g,
            Err(e) => {
                read = Err(anyhow::anyhow!("receiving from {name}: {}", aws_error(&e)));
                break;
            }
        };
        if got.messages().is_empty() {
            break;
        }
        for m in got.messages() {
            if let Some(r) = m.receipt_handle() {
                receipts.push(r.to_string());
            }
            let id = m.message_id().unwrap_or_default().to_string();
            if shown.iter().any(|d| d.message_id == id) {
                continue;
            }
            let sys = |a: MessageSystemAttributeName| m.attributes().and_then(|x| x.get(&a)).cloned();
            let body = m.body().unwrap_or_default();
            let reason = match kind {
                QueueKind::FailedEvents => {
                    let attr = |k: &str| {
                        m.message_attributes()
                            .and_then(|x| x.get(k))
                            .and_then(|v| v.string_value())
                            .map(str::to_string)
                    };
                    match (attr("ErrorCode"), attr("ErrorMessage")) {
                        (None, None) => None,
                        (code, msg) => Some([code, msg].into_iter().flatten().collect::<Vec<_>>().join(": ")),
                    }
                }
                QueueKind::Submissions | QueueKind::Lane => ops
                    .jobs
                    .error_record(&format!("sqs:{id}"))
                    .await
                    .unwrap_or_else(|e| Some(format!("(its error record could not be read: {e})"))),
            };
            let sent_at = sys(MessageSystemAttributeName::SentTimestamp)
                .and_then(|t| t.parse::<f64>().ok())
                .map(|ms| ms / 1000.0);
            let mut what = describe(kind, body);
            let outcome = match kind {
                QueueKind::FailedEvents => s3_outcome(ops, body).await,
                QueueKind::Submissions => submission_outcome(ops, &id, body).await,
                QueueKind::Lane => None,
            };
            if let Some(outcome) = outcome {
                what = format!("{what} ({outcome})");
            }
            shown.push(DeadLetter {
                message_id: id,
                sent_at,
                expires_at: sent_at.zip(retention_s).map(|(t, r)| t + r),
                receives: sys(MessageSystemAttributeName::ApproximateReceiveCount).and_then(|n| n.parse().ok()),
                what,
                reason: reason.map(|r| cut(&r, MAX_REASON_BYTES)),
                body: cut(body, BODY_BYTES),
            });
        }
    }
    // Put back what was read, whatever happened while reading.
    let mut put_back_failed = Vec::new();
    for chunk in receipts.chunks(10) {
        let entries: Vec<ChangeMessageVisibilityBatchRequestEntry> = chunk
            .iter()
            .enumerate()
            .map(|(i, r)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(r)
                    .visibility_timeout(0)
                    .build()
                    .expect("id and receipt handle are set")
            })
            .collect();
        match sqs
            .change_message_visibility_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            Ok(out) => put_back_failed.extend(out.failed().iter().map(|f| f.message().unwrap_or("?").to_string())),
            Err(e) => put_back_failed.push(aws_error(&e)),
        }
    }
    if !put_back_failed.is_empty() {
        eprintln!(
            "warning: {} message(s) of {name} were not put back; they are visible again within {PEEK_VISIBILITY_S} s ({})",
            put_back_failed.len(),
            put_back_failed.join("; ")
        );
    }
    read?;
    shown.sort_by(|a, b| a.sent_at.partial_cmp(&b.sent_at).unwrap_or(std::cmp::Ordering::Equal));
    // The counts are approximate: never fewer than were read.
    let messages = messages.max(shown.len() as u64);
    Ok(QueueReport {
        queue: name,
        kind,
        url: url.to_string(),
        messages,
        action: if messages == 0 {
            String::new()
        } else {
            kind.advice(&arn)
        },
        shown,
    })
}

/// `onoff dead-letters`.
///
/// # Errors
/// The stack could not be reached, or a queue not read.
pub async fn dead_letters(a: DeadLettersArgs) -> Result<()> {
    let ops = Ops::connect(&a.target).await?;
    let mut reports = Vec::new();
    for url in &ops.dead_letter_queues {
        let name = url.rsplit('/').next().unwrap_or(url);
        let kind = QueueKind::of(name).with_context(|| format!("{name} is not a dead-letter queue of onoff's"))?;
        reports.push(read_queue(&ops, url, kind, a.limit).await?);
    }
    if ops.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    let total: u64 = reports.iter().map(|r| r.messages).sum();
    for r in &reports {
        println!("{}: {} message(s)", r.queue, r.messages);
        if r.shown.is_empty() {
            continue;
        }
        let mut t = Table::new();
        t.load_preset(UTF8_BORDERS_ONLY).set_header([
            "message",
            "sent",
            "deleted by SQS",
            "receives",
            "what",
            "reason",
        ]);
        for d in &r.shown {
            t.add_row([
                d.message_id.clone(),
                d.sent_at.map_or("-".into(), when),
                d.expires_at.map_or("-".into(), when),
                d.receives.map_or("-".into(), |n| n.to_string()),
                d.what.clone(),
                d.reason.clone().unwrap_or_else(|| "(none recorded)".into()),
            ]);
        }
        println!("{t}");
        if (r.shown.len() as u64) < r.messages {
            println!("  ({} of {} shown: --limit)", r.shown.len(), r.messages);
        }
        println!("  what to do: {}\n", r.action);
    }
    if total == 0 {
        println!("nothing dead-lettered");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_are_told_apart_by_the_templates_names() {
        assert_eq!(QueueKind::of("onoff-submissions-dlq"), Some(QueueKind::Submissions));
        assert_eq!(QueueKind::of("onoff-express-dlq"), Some(QueueKind::Lane));
        assert_eq!(QueueKind::of("onoff-failed-events"), Some(QueueKind::FailedEvents));
        assert_eq!(QueueKind::of("onoff-submissions"), None);
        assert_eq!(QueueKind::of("onoff-express"), None);
    }

    #[test]
    fn each_kind_of_message_is_described() {
        let sample = |name: &str| {
            std::fs::read_to_string(format!("{}/../../events/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
        };
        assert_eq!(
            describe(
                QueueKind::Submissions,
                r#"{"project":"vision","name":"sweep-3","command":"x"}"#
            ),
            r#"job spec "sweep-3" of project vision"#
        );
        assert_eq!(
            describe(QueueKind::Submissions, "not json"),
            "a body that is not a JSON object"
        );
        assert_eq!(
            describe(QueueKind::Lane, r#"{"job_id":"j-1","gpus":1}"#),
            "wake-up message for job j-1"
        );
        assert_eq!(
            describe(QueueKind::Lane, r#"{"job":"j-1"}"#),
            "a body that is not a wake-up message"
        );
        let warning = describe(QueueKind::FailedEvents, &sample("spot-interruption-warning.json"));
        assert!(
            warning.starts_with("EventBridge: EC2 Spot Instance Interruption Warning, i-"),
            "{warning}"
        );
        let s3 = describe(QueueKind::FailedEvents, &sample("s3-object-created.json"));
        assert!(
            s3.starts_with("S3 event: s3://") && s3.contains("jobs/resnet sweep/run-1.json"),
            "{s3}"
        );
        assert_eq!(
            describe(
                QueueKind::FailedEvents,
                r#"{"source":"onoff.scale-request","reason":"submit: 2 new job(s)","asked_at":1.0}"#
            ),
            "scale request (submit: 2 new job(s))"
        );
        assert_eq!(describe(QueueKind::FailedEvents, "[1]"), "an event of unknown kind");
    }

    /// A failed S3 event names the submissions submit would have made of it, as submit names
    /// them: the key decoded, the version id kept ("null" is none), objects outside `jobs/` left out.
    #[test]
    fn a_failed_s3_events_submissions_are_named_as_submit_names_them() {
        let body = std::fs::read_to_string(format!(
            "{}/../../events/s3-object-created.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        let got = s3_submissions(&body);
        assert_eq!(got.len(), 1, "{got:?}");
        let onoff_control::submit::Source::S3 { key, version, .. } = &got[0] else {
            panic!("{got:?}")
        };
        assert_eq!(key, "jobs/resnet sweep/run-1.json");
        let mut v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["Records"][0]["s3"]["object"]["versionId"] = "null".into();
        let unversioned = s3_submissions(&v.to_string());
        assert!(
            matches!(&unversioned[0], onoff_control::submit::Source::S3 { version: None, .. }),
            "{unversioned:?} (had {version:?})"
        );
        v["Records"][0]["s3"]["object"]["key"] = "outputs/x.json".into();
        assert!(s3_submissions(&v.to_string()).is_empty());
        assert!(s3_submissions(r#"{"detail-type":"x"}"#).is_empty());
    }

    #[test]
    fn bodies_are_cut_at_a_character_boundary() {
        let body = "é".repeat(BODY_BYTES);
        let c = cut(&body, BODY_BYTES);
        assert!(
            c.len() <= BODY_BYTES + '…'.len_utf8() && c.ends_with('…'),
            "{}",
            c.len()
        );
        assert_eq!(cut("short", BODY_BYTES), "short");
    }
}
