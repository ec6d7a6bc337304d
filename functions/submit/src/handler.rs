//! Submit: job specs from S3 (ObjectCreated under `jobs/`) and from the submission SQS queue.
//!
//! Each spec is validated, written as a job and enqueued in its lane (idempotent by client token,
//! or by S3 key and ETag, or by SQS message id). A bad spec gets an error record with its reason;
//! an SQS record that fails is reported in `batchItemFailures`, so SQS redelivers it and, after
//! maxReceiveCount, moves it to the dead-letter queue. After new jobs the policy runs at once, so
//! scale-from-zero does not wait for the alarm period.

use aws_lambda_events::event::s3::S3Event;
use aws_lambda_events::event::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent};
use lambda_runtime::LambdaEvent;
use onoff_control::ports::{
    Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability, WorkerRegistry,
};
use onoff_control::submit::{submit, Source, SubmitError, Submitted};
use onoff_fn_common::{Ctx, HandlerError, ObjectReader};

/// S3 event keys are URL-encoded (`+` for space, `%xx`).
fn decode_key(key: &str) -> String {
    let bytes = key.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Handle an S3 event or an SQS batch.
///
/// # Errors
/// `NonRetryable` for a payload that is neither; `Retryable` when an S3 submission could not be
/// stored (S3's asynchronous invocation retries).
pub async fn handle<Q, W, J, F, A, E, L, C>(
    ctx: &Ctx<Q, W, J, F, A, E, L>,
    objects: &C,
    event: LambdaEvent<serde_json::Value>,
) -> Result<serde_json::Value, HandlerError>
where
    Q: Backlog + JobQueue,
    W: WorkerRegistry,
    J: JobStore,
    F: Fleet + FleetLister,
    A: OfferingAvailability,
    E: EventLog,
    L: Lease,
    C: ObjectReader,
{
    let now = onoff_fn_common::now();
    let lanes: Vec<&str> = ctx.settings.policy.lanes.iter().map(|l| l.name.as_str()).collect();
    let source_kind = event.payload["Records"][0]["eventSource"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut new_jobs = 0;
    let response = match source_kind.as_str() {
        "aws:sqs" => {
            let batch: SqsEvent = serde_json::from_value(event.payload.clone())
                .map_err(|e| HandlerError::NonRetryable(format!("not an SQS batch: {e}")))?;
            let mut failures = Vec::new();
            for m in &batch.records {
                let id = m.message_id.clone().unwrap_or_default();
                let body = m.body.clone().unwrap_or_default();
                match submit(
                    &body,
                    &Source::Sqs { message_id: id.clone() },
                    &lanes,
                    now,
                    &ctx.jobs,
                    &ctx.queues,
                )
                .await
                {
                    Ok(Submitted::New(job)) => {
                        new_jobs += 1;
                        tracing::info!(%job, message = %id, "submitted");
                    }
                    Ok(Submitted::Existing(job)) => tracing::info!(%job, message = %id, "already submitted"),
                    Err(e) => {
                        match &e {
                            SubmitError::Rejected { .. } => {
                                tracing::warn!(error = %e, "rejected; the message goes to the dead-letter queue")
                            }
                            SubmitError::Retryable { .. } => tracing::warn!(error = %e, "will be retried"),
                        }
                        let mut f = BatchItemFailure::default();
                        f.item_identifier = id;
                        failures.push(f);
                    }
                }
            }
            let mut resp = SqsBatchResponse::default();
            resp.batch_item_failures = failures;
            serde_json::to_value(resp).map_err(|e| HandlerError::Retryable(e.to_string()))?
        }
        "aws:s3" => {
            let s3: S3Event = serde_json::from_value(event.payload.clone())
                .map_err(|e| HandlerError::NonRetryable(format!("not an S3 event: {e}")))?;
            let mut results = Vec::new();
            for r in &s3.records {
                let bucket = r.s3.bucket.name.clone().unwrap_or_default();
                let key = decode_key(r.s3.object.key.as_deref().unwrap_or_default());
                let etag = r.s3.object.e_tag.clone().unwrap_or_default();
                if !key.starts_with("jobs/") {
                    tracing::info!(%key, "not under jobs/: ignored");
                    continue;
                }
                let text = objects
                    .read_text(&bucket, &key)
                    .await
                    .map_err(HandlerError::Retryable)?;
                let source = Source::S3 {
                    bucket,
                    key: key.clone(),
                    etag,
                };
                match submit(&text, &source, &lanes, now, &ctx.jobs, &ctx.queues).await {
                    Ok(Submitted::New(job)) => {
                        new_jobs += 1;
                        results.push(serde_json::json!({ "key": key, "job": job }));
                    }
                    Ok(Submitted::Existing(job)) => {
                        results.push(serde_json::json!({ "key": key, "job": job, "existing": true }))
                    }
                    Err(e @ SubmitError::Rejected { .. }) => {
                        tracing::warn!(error = %e, "rejected; the error record holds the reason");
                        results.push(serde_json::json!({ "key": key, "rejected": e.to_string() }));
                    }
                    Err(e @ SubmitError::Retryable { .. }) => return Err(HandlerError::Retryable(e.to_string())),
                }
            }
            serde_json::json!({ "submissions": results })
        }
        other => {
            return Err(HandlerError::NonRetryable(format!(
                "unsupported event source {other:?}: expected aws:s3 or aws:sqs"
            )))
        }
    };
    if new_jobs > 0 {
        // Scale from zero now rather than at the next alarm period; a failure here is logged, the
        // alarm and the schedule catch up.
        if let Err(e) = ctx.reconcile(now, false, &event.context).await {
            tracing::warn!(error = %e, "scaling after submission failed");
        }
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_control::job::JobState;
    use onoff_fn_common::testing::{fake_ctx, FakeObjects};

    fn sample(name: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(format!("{}/../../events/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn keys_are_url_decoded() {
        assert_eq!(decode_key("jobs/my+run%3A1.json"), "jobs/my run:1.json");
        assert_eq!(decode_key("jobs/100%"), "jobs/100%");
    }

    #[tokio::test]
    async fn the_sqs_sample_submits_the_good_record_and_fails_the_malformed_one() {
        let ctx = fake_ctx();
        let out = handle(
            &ctx,
            &FakeObjects::default(),
            LambdaEvent::new(sample("sqs-submission-batch.json"), lambda_runtime::Context::default()),
        )
        .await
        .unwrap();
        let failures = out["batchItemFailures"].as_array().unwrap();
        assert_eq!(failures.len(), 1, "{out}");
        assert_eq!(failures[0]["itemIdentifier"], "2e1424d4-f796-459a-8184-9c92662be6da");
        let jobs = ctx.jobs.records();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs.values().next().unwrap().state, JobState::Queued);
        let errors = ctx.jobs.errors();
        assert!(
            errors["sqs:2e1424d4-f796-459a-8184-9c92662be6da"].contains("argv array"),
            "{errors:?}"
        );
        // Scale-from-zero ran: one worker for the one job.
        assert_eq!(ctx.fleet.running().len(), 1);
        // Redelivered (at-least-once): still one job, no new launch.
        handle(
            &ctx,
            &FakeObjects::default(),
            LambdaEvent::new(sample("sqs-submission-batch.json"), lambda_runtime::Context::default()),
        )
        .await
        .unwrap();
        assert_eq!(ctx.jobs.records().len(), 1);
        assert_eq!(ctx.fleet.running().len(), 1);
    }

    #[tokio::test]
    async fn the_s3_sample_submits_the_spec_it_points_at() {
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        objects.put(
            "onoff-jobs-123456789012",
            "jobs/resnet sweep/run-1.json",
            r#"{"image":"ghcr.io/acme/train:1.4","command":["python","train.py"],"project":"vision","gpus":1}"#,
        );
        let out = handle(
            &ctx,
            &objects,
            LambdaEvent::new(sample("s3-object-created.json"), lambda_runtime::Context::default()),
        )
        .await
        .unwrap();
        assert_eq!(out["submissions"][0]["key"], "jobs/resnet sweep/run-1.json", "{out}");
        assert!(out["submissions"][0]["job"].is_string());
        assert_eq!(ctx.jobs.records().len(), 1);
        // A bad spec object: an error record, no job, and no retry.
        objects.put(
            "onoff-jobs-123456789012",
            "jobs/resnet sweep/run-1.json",
            r#"{"image":"x","command":"bash run.sh","project":"vision"}"#,
        );
        let mut ev = sample("s3-object-created.json");
        ev["Records"][0]["s3"]["object"]["eTag"] = "ffff".into();
        let out = handle(&ctx, &objects, LambdaEvent::new(ev, lambda_runtime::Context::default()))
            .await
            .unwrap();
        assert!(
            out["submissions"][0]["rejected"].as_str().unwrap().contains("argv"),
            "{out}"
        );
        assert_eq!(ctx.jobs.records().len(), 1);
        assert_eq!(ctx.jobs.errors().len(), 1);
        // A missing object is retried.
        let mut ev = sample("s3-object-created.json");
        ev["Records"][0]["s3"]["object"]["key"] = "jobs/gone.json".into();
        let err = handle(&ctx, &objects, LambdaEvent::new(ev, lambda_runtime::Context::default()))
            .await
            .unwrap_err();
        assert!(matches!(err, HandlerError::Retryable(_)));
        // Neither S3 nor SQS.
        let err = handle(
            &ctx,
            &objects,
            LambdaEvent::new(serde_json::json!({"hello": 1}), lambda_runtime::Context::default()),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, HandlerError::NonRetryable(_)));
    }
}
