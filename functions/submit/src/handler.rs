//! Submit: job specs from S3 (ObjectCreated under `jobs/`) and from the submission SQS queue.
//!
//! Each spec is validated, checked against the policy and the catalogue (some allowed instance must
//! be able to run it), written as a job and enqueued in its lane (idempotent by client token, or
//! by S3 key, ETag and version id, or by SQS message id). A bad spec gets an error record with its
//! reason; an SQS record that fails (rejected, or not written) is reported in `batchItemFailures`,
//! so SQS redelivers it and, after maxReceiveCount, moves it to the dead-letter queue. A job
//! written whose wake-up message could not be sent is submitted all the same (the reconciler
//! sends the message): a record in the dead-letter queue made no job, so a redrive, which gives
//! it a new message id, makes one at most. After new jobs it asks the scaler to
//! run at once (an asynchronous invoke: this function holds no launch rights), so scale-from-zero
//! does not wait for the alarm period.
//!
//! An S3 spec is read as the version the event names (an overwrite is its own event and its own
//! job), HeadObject first: an object over
//! [`MAX_SPEC_BYTES`](onoff_control::submit::MAX_SPEC_BYTES) or not UTF-8 is rejected with an
//! error record, and not retried, without being downloaded whole.

use aws_lambda_events::event::s3::S3Event;
use aws_lambda_events::event::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent};
use lambda_runtime::LambdaEvent;
use onoff_control::ports::{
    Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability, WorkerRegistry,
};
use onoff_control::submit::{reject, submit, too_large, Admission, Rules, Source, SubmitError, Submitted};
use onoff_fn_common::{Ctx, HandlerError, ObjectError, ObjectReader, ObjectRef, ScalerTrigger};

/// Submit the S3 object version `obj`: its size first (HeadObject), then its bytes, then the spec.
async fn submit_object<C, J, Q, R>(
    objects: &C,
    obj: &ObjectRef,
    source: &Source,
    rules: &R,
    now: f64,
    jobs: &J,
    queue: &Q,
) -> Result<Submitted, SubmitError>
where
    C: ObjectReader,
    J: JobStore,
    Q: JobQueue,
    R: Rules + ?Sized,
{
    let failed = |e: ObjectError| SubmitError::Retryable {
        source_desc: source.describe(),
        reason: e.to_string(),
    };
    // Read without a version id (a bucket without versioning) after an overwrite: the event's
    // content is gone; the new content is submitted by its own event.
    let overwritten = |e: ObjectError| {
        format!("the object was overwritten before it could be read, and the bucket keeps no versions ({e})")
    };
    let size = match objects.size(obj).await {
        Ok(n) => n,
        Err(ObjectError::Changed(m)) => {
            return Err(reject(source, overwritten(ObjectError::Changed(m)), now, jobs).await)
        }
        Err(e) => return Err(failed(e)),
    };
    if let Some(reason) = too_large(size) {
        return Err(reject(source, reason, now, jobs).await);
    }
    let bytes = match objects.read(obj).await {
        Ok(b) => b,
        Err(ObjectError::Changed(m)) => {
            return Err(reject(source, overwritten(ObjectError::Changed(m)), now, jobs).await)
        }
        Err(e) => return Err(failed(e)),
    };
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let reason = format!("job spec is not UTF-8 text ({}): save it as UTF-8 JSON", e.utf8_error());
            return Err(reject(source, reason, now, jobs).await);
        }
    };
    submit(&text, source, rules, now, jobs, queue).await
}

/// Log what a submission from `from` did (a wake-up message left to the reconciler as a
/// warning), and keep a new job's id in `new_jobs` for the scale request.
fn noted(done: &Submitted, from: &str, new_jobs: &mut Vec<String>) {
    match done {
        Submitted::New(job) => tracing::info!(%job, %from, "submitted"),
        Submitted::Existing(job) => tracing::info!(%job, %from, "already submitted"),
        Submitted::Unsent { id, reason, .. } => tracing::warn!(
            job = %id,
            %from,
            %reason,
            "submitted; its wake-up message was not sent: the reconciler's next run sends it"
        ),
    }
    if done.is_new() {
        new_jobs.push(done.id().to_string());
    }
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
    C: ObjectReader + ScalerTrigger,
{
    let now = onoff_fn_common::now();
    let rules = Admission {
        policy: &ctx.settings.policy,
        offerings: &ctx.settings.offerings,
    };
    let source_kind = event.payload["Records"][0]["eventSource"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // The new jobs' ids, for the scale request's run to read past the index.
    let mut new_jobs: Vec<String> = Vec::new();
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
                    &rules,
                    now,
                    &ctx.jobs,
                    &ctx.queues,
                )
                .await
                {
                    Ok(done) => noted(&done, &format!("sqs:{id}"), &mut new_jobs),
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
                // S3 event keys are URL-encoded (`+` for space, `%xx`).
                let raw_key = r.s3.object.key.as_deref().unwrap_or_default();
                let Some(source) = onoff_aws::objects::s3_submission(
                    r.s3.bucket.name.as_deref().unwrap_or_default(),
                    raw_key,
                    r.s3.object.e_tag.as_deref().unwrap_or_default(),
                    r.s3.object.version_id.as_deref(),
                ) else {
                    tracing::info!(key = %raw_key, "not under jobs/: ignored");
                    continue;
                };
                let Source::S3 {
                    bucket,
                    key,
                    etag,
                    version,
                } = &source
                else {
                    continue;
                };
                let obj = ObjectRef {
                    bucket: bucket.clone(),
                    key: key.clone(),
                    version: version.clone(),
                    etag: Some(etag.clone()),
                };
                match submit_object(objects, &obj, &source, &rules, now, &ctx.jobs, &ctx.queues).await {
                    Ok(done) => {
                        let mut line = serde_json::json!({ "key": key, "job": done.id() });
                        if !done.is_new() {
                            line["existing"] = true.into();
                        }
                        if let Submitted::Unsent { reason, .. } = &done {
                            line["unsent"] = reason.as_str().into();
                        }
                        results.push(line);
                        noted(&done, &source.describe(), &mut new_jobs);
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
    if !new_jobs.is_empty() {
        // Scale from zero now rather than at the next alarm period; a failure here is logged, the
        // alarm and the schedule catch up.
        // At most one scale request pending at a time: an ask while one is pending joins it.
        let reason = format!("submit: {} new job(s)", new_jobs.len());
        match onoff_fn_common::request_scale(&ctx.lease, objects, &new_jobs, &reason).await {
            Ok(ask) => tracing::info!(?ask, "scale request"),
            Err(e) => tracing::warn!(error = %e, "asking the scaler after submission failed"),
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

    /// `handle` of the sample SQS batch (`events/sqs-submission-batch.json`).
    async fn handle_sqs_sample(ctx: &onoff_fn_common::testing::FakeCtx, asks: &FakeObjects) -> serde_json::Value {
        handle(
            ctx,
            asks,
            LambdaEvent::new(sample("sqs-submission-batch.json"), lambda_runtime::Context::default()),
        )
        .await
        .unwrap()
    }

    /// The answer to the sample batch reports its malformed record, and only it, as failed.
    #[track_caller]
    fn only_the_malformed_record_fails(out: &serde_json::Value) {
        let failures = out["batchItemFailures"].as_array().unwrap();
        assert_eq!(failures.len(), 1, "{out}");
        assert_eq!(failures[0]["itemIdentifier"], "2e1424d4-f796-459a-8184-9c92662be6da");
    }

    #[tokio::test]
    async fn the_sqs_sample_submits_the_good_record_and_fails_the_malformed_one() {
        let ctx = fake_ctx();
        let asks = FakeObjects::default();
        let out = handle_sqs_sample(&ctx, &asks).await;
        only_the_malformed_record_fails(&out);
        let jobs = ctx.jobs.records();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs.values().next().unwrap().state, JobState::Queued);
        let errors = ctx.jobs.errors();
        assert!(
            errors["sqs:2e1424d4-f796-459a-8184-9c92662be6da"].contains("argv array"),
            "{errors:?}"
        );
        // Scale-from-zero: submit launches nothing itself (no launch rights), it asks the scaler.
        assert!(ctx.fleet.running().is_empty());
        assert_eq!(*asks.scale_requests.lock().unwrap(), ["submit: 1 new job(s)"]);
        // Redelivered (at-least-once): still one job, and no new job to ask for.
        handle_sqs_sample(&ctx, &asks).await;
        assert_eq!(ctx.jobs.records().len(), 1);
        assert_eq!(asks.scale_requests.lock().unwrap().len(), 1);
    }

    /// A record whose job is written but whose wake-up message cannot be sent is not failed
    /// back to SQS: the job exists, so a redelivery, and after maxReceiveCount a dead-letter
    /// queue redrive under a new message id, would only risk a second one. The scaler is asked
    /// for it as for any new job; the reconciler sends its message.
    #[tokio::test]
    async fn a_record_whose_job_is_written_is_not_failed_back_when_its_message_cannot_be_sent() {
        let ctx = fake_ctx();
        let asks = FakeObjects::default();
        ctx.queues
            .fail_next("AWS.SimpleQueueService.NonExistentQueue: the queue was deleted");
        let out = handle_sqs_sample(&ctx, &asks).await;
        only_the_malformed_record_fails(&out);
        let jobs = ctx.jobs.records();
        assert_eq!(jobs.len(), 1);
        let job = jobs.values().next().unwrap();
        assert_eq!((job.state, job.sent_at), (JobState::Queued, None));
        assert!(ctx.queues.sent().is_empty());
        assert_eq!(*asks.scale_requests.lock().unwrap(), ["submit: 1 new job(s)"]);
    }

    const BUCKET: &str = "onoff-jobs-123456789012";
    const KEY: &str = "jobs/resnet sweep/run-1.json";

    /// The S3 sample, naming version `version` (its ETag as the fake has it).
    fn s3_event(objects: &FakeObjects, version: Option<&str>) -> LambdaEvent<serde_json::Value> {
        let mut ev = sample("s3-object-created.json");
        let o = &mut ev["Records"][0]["s3"]["object"];
        o["versionId"] = version.map_or(serde_json::Value::Null, Into::into);
        if let Some(etag) = objects.etag(BUCKET, KEY) {
            o["eTag"] = etag.into();
        }
        LambdaEvent::new(ev, lambda_runtime::Context::default())
    }

    #[tokio::test]
    async fn the_s3_sample_submits_the_version_it_names_and_an_overwrite_is_its_own_job() {
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        let v1 = objects.put(
            BUCKET,
            KEY,
            r#"{"image":"ghcr.io/acme/train:1.4","command":["python","train.py"],"project":"vision","gpus":1}"#,
        );
        let ev1 = s3_event(&objects, Some(&v1));
        let ev1_again = LambdaEvent::new(ev1.payload.clone(), lambda_runtime::Context::default());
        // Overwritten before the first event is handled (S3 events are asynchronous).
        let v2 = objects.put(
            BUCKET,
            KEY,
            r#"{"image":"ghcr.io/acme/train:1.4","command":["python","train.py"],"project":"vision","gpus":4}"#,
        );
        let ev2 = s3_event(&objects, Some(&v2));
        let out = handle(&ctx, &objects, ev1).await.unwrap();
        assert_eq!(out["submissions"][0]["key"], KEY, "{out}");
        let first = out["submissions"][0]["job"].as_str().unwrap().to_string();
        handle(&ctx, &objects, ev2).await.unwrap();
        let jobs = ctx.jobs.records();
        assert_eq!(jobs.len(), 2);
        // v1 ran as v1 (not v2 twice).
        assert_eq!(jobs[&first].spec.gpus, 1);
        let mut gpus: Vec<u32> = jobs.values().map(|j| j.spec.gpus).collect();
        gpus.sort_unstable();
        assert_eq!(gpus, [1, 4]);
        assert!(
            jobs[&first].source.contains(&format!("?versionId={v1}#")),
            "{}",
            jobs[&first].source
        );
        // The event for v1 delivered again: the same job.
        let again = handle(&ctx, &objects, ev1_again).await.unwrap();
        assert_eq!(again["submissions"][0]["job"], first.as_str(), "{again}");
        assert_eq!(again["submissions"][0]["existing"], true);
        assert_eq!(ctx.jobs.records().len(), 2);
        // Two new jobs, one scale request: the second submission found the first's pending and
        // joined it instead of queueing a second invocation of the scaler.
        assert_eq!(*objects.scale_requests.lock().unwrap(), ["submit: 1 new job(s)"]);
        // Both asks kept their job's id, for the run to read past the index.
        use onoff_control::ports::Lease;
        let mut new_ids: Vec<String> = jobs.keys().cloned().collect();
        new_ids.sort_unstable();
        let asked = ctx.lease.asks(onoff_control::reconcile::RECONCILE_LEASE).await.unwrap();
        assert_eq!(asked.jobs, new_ids);
        // Once a scaler run has seen both asks, a new job invokes afresh; the ids are forgotten.
        let run = ctx
            .reconcile(onoff_fn_common::now(), false, &lambda_runtime::Context::default())
            .await
            .unwrap();
        assert_eq!(run["asks_settled"], true, "{run}");
        let asked = ctx.lease.asks(onoff_control::reconcile::RECONCILE_LEASE).await.unwrap();
        assert!(asked.jobs.is_empty(), "{asked:?}");
        let v3 = objects.put(
            BUCKET,
            KEY,
            r#"{"image":"i","command":["x"],"project":"vision","gpus":1}"#,
        );
        handle(&ctx, &objects, s3_event(&objects, Some(&v3))).await.unwrap();
        assert_eq!(objects.scale_requests.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn without_a_version_id_an_overwritten_object_is_rejected_not_run_as_the_new_content() {
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        objects.put(
            BUCKET,
            KEY,
            r#"{"image":"i","command":["x"],"project":"vision","gpus":1}"#,
        );
        let ev = s3_event(&objects, None);
        objects.put(
            BUCKET,
            KEY,
            r#"{"image":"i","command":["x"],"project":"vision","gpus":4}"#,
        );
        let out = handle(&ctx, &objects, ev).await.unwrap();
        assert!(
            out["submissions"][0]["rejected"]
                .as_str()
                .unwrap()
                .contains("overwritten"),
            "{out}"
        );
        assert!(ctx.jobs.records().is_empty());
        // The new content's own event submits it.
        handle(&ctx, &objects, s3_event(&objects, None)).await.unwrap();
        assert_eq!(ctx.jobs.records().values().next().unwrap().spec.gpus, 4);
    }

    #[tokio::test]
    async fn a_bad_spec_object_gets_an_error_record_and_a_missing_one_is_retried() {
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        let v = objects.put(
            BUCKET,
            KEY,
            r#"{"image":"x","command":"bash run.sh","project":"vision"}"#,
        );
        let out = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert!(
            out["submissions"][0]["rejected"].as_str().unwrap().contains("argv"),
            "{out}"
        );
        assert!(ctx.jobs.records().is_empty());
        assert_eq!(ctx.jobs.errors().len(), 1);
        // A missing object (or version) is retried.
        let err = handle(&ctx, &objects, s3_event(&objects, Some("no-such-version")))
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

    /// The one error record's reason; panics unless there is exactly one.
    fn only_error(ctx: &onoff_fn_common::testing::FakeCtx) -> String {
        let errors = ctx.jobs.errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        errors.into_values().next().unwrap()
    }

    #[tokio::test]
    async fn a_2_mb_spec_gets_an_error_record_without_being_downloaded_and_is_not_retried() {
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        // What a new user tried: a spec with a big inline payload.
        let big = format!(
            r#"{{"image":"i","command":["python","run.py","{}"],"project":"vision"}}"#,
            "x".repeat(2_000_000)
        );
        let v = objects.put(BUCKET, KEY, &big);
        let out = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert!(out["submissions"][0]["rejected"].is_string(), "{out}");
        let reason = only_error(&ctx);
        assert!(
            reason.contains(&format!("job spec is {} bytes; the limit is 262144 bytes", big.len())),
            "{reason}"
        );
        assert!(ctx.jobs.records().is_empty());
        assert_eq!(objects.reads(), 0, "HeadObject first: the object is never downloaded");
        // Just under the cap is read and checked as usual.
        let ctx = fake_ctx();
        let fits = format!(
            r#"{{"image":"i","command":["python","run.py","{}"],"project":"vision"}}"#,
            "x".repeat(200_000)
        );
        let v = objects.put(BUCKET, KEY, &fits);
        let out = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert!(out["submissions"][0]["job"].is_string(), "{out}");
    }

    #[tokio::test]
    async fn a_spec_that_is_not_utf8_gets_an_error_record_and_is_not_retried() {
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        // Latin-1 "é" in a project name, as an editor without UTF-8 saves it.
        let mut bytes = br#"{"image":"i","command":["x"],"project":"caf"#.to_vec();
        bytes.extend([0xE9, b'"', b'}']);
        let v = objects.put(BUCKET, KEY, &bytes);
        let out = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert!(out["submissions"][0]["rejected"].is_string(), "{out}");
        let reason = only_error(&ctx);
        assert!(reason.contains("not UTF-8 text"), "{reason}");
        assert!(ctx.jobs.records().is_empty());
    }

    #[tokio::test]
    async fn a_validation_exception_on_create_gets_an_error_record_but_throttling_is_retried() {
        use onoff_control::ports::StoreError;
        let spec = r#"{"image":"i","command":["x"],"project":"vision"}"#;
        // DynamoDB refuses the item itself: retrying cannot help.
        let ctx = fake_ctx();
        let objects = FakeObjects::default();
        let v = objects.put(BUCKET, KEY, spec);
        ctx.jobs.fail_next(StoreError::Invalid(
            "create job: ValidationException: Item size has exceeded the maximum allowed size".into(),
        ));
        let out = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert!(out["submissions"][0]["rejected"].is_string(), "{out}");
        let reason = only_error(&ctx);
        assert!(
            reason.contains("the jobs table refused the job") && reason.contains("Item size has exceeded"),
            "{reason}"
        );
        assert!(ctx.jobs.records().is_empty());
        // Throttling stays retryable, and leaves no error record.
        let ctx = fake_ctx();
        ctx.jobs.fail_next(StoreError::Other(
            "create job: ProvisionedThroughputExceededException: slow down".into(),
        ));
        let err = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap_err();
        assert!(matches!(err, HandlerError::Retryable(_)), "{err:?}");
        assert!(ctx.jobs.errors().is_empty());
        // The retry goes through.
        handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert_eq!(ctx.jobs.records().len(), 1);
    }

    #[tokio::test]
    async fn impossible_jobs_get_error_records_with_the_reason_and_no_job_or_launch() {
        let ctx = fake_ctx();
        let out = handle(
            &ctx,
            &FakeObjects::default(),
            LambdaEvent::new(
                sample("sqs-submission-impossible.json"),
                lambda_runtime::Context::default(),
            ),
        )
        .await
        .unwrap();
        // Each goes to the dead-letter queue, with an error record that says why.
        assert_eq!(out["batchItemFailures"].as_array().unwrap().len(), 3, "{out}");
        let errors = ctx.jobs.errors();
        let reason = |id: &str| errors[&format!("sqs:{id}")].clone();
        assert_eq!(
            reason("7d1f3c0a-52a9-4c1e-9a43-0b6f1e2d9a01"),
            "job spec field gpus: 64: the largest allowed instance has 8 GPUs (p6-b200.48xlarge)"
        );
        let mem = reason("a3c95e1b-0f7e-4d5c-8e21-6c7b9d1f4e02");
        assert!(
            mem.starts_with("job spec field min_gpu_memory_gib: 500 GiB per GPU is more than any allowed instance"),
            "{mem}"
        );
        assert_eq!(
            reason("e81b2d47-9c3a-4f60-b5d8-2a4e6c8f0b03"),
            "job spec field lane: unknown lane \"gold\"; lanes: express, standard"
        );
        assert!(ctx.jobs.records().is_empty());
        assert!(ctx.queues.sent().is_empty());
        assert!(ctx.fleet.calls().is_empty(), "nothing launched");
        // The same through S3: gpus 64 in an object.
        let objects = FakeObjects::default();
        let v = objects.put(
            BUCKET,
            KEY,
            r#"{"image":"i","command":["x"],"project":"vision","gpus":64}"#,
        );
        let ctx = fake_ctx();
        let out = handle(&ctx, &objects, s3_event(&objects, Some(&v))).await.unwrap();
        assert!(
            out["submissions"][0]["rejected"]
                .as_str()
                .unwrap()
                .contains("the largest allowed instance has 8 GPUs"),
            "{out}"
        );
        assert!(only_error(&ctx).contains("gpus: 64"));
        assert!(ctx.jobs.records().is_empty());
    }
}
