//! Scaler: on the queue-depth alarm (state change via EventBridge), or invoked directly, run the
//! policy without the reaper and carry out its plan.

use lambda_runtime::LambdaEvent;
use onoff_control::events::{parse, Trigger};
use onoff_control::ports::{
    Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability, SpotPrices, WorkerRegistry,
};
use onoff_fn_common::{Ctx, HandlerError};

/// Handle one invocation: an EventBridge alarm state change, or any direct invocation payload. A
/// scale request a later run decided already returns at once ([`Ctx::decided_already`]); one
/// that finds another run holding the lease waits for it (up to [`SCALE_REQUEST_WAIT_S`]), then
/// returns if that run decided it, or runs; one whose run saw asks join it meanwhile
/// ([`onoff_fn_common::request_scale`]) runs again (for up to [`SCALE_REQUEST_RUNS_S`]), and the
/// answer counts its runs (`runs`).
///
/// # Errors
/// `NonRetryable` for a malformed EventBridge event, `Retryable` when the state cannot be read.
pub async fn handle<Q, W, J, F, A, E, L, C>(
    ctx: &Ctx<Q, W, J, F, A, E, L>,
    _clients: &C,
    event: LambdaEvent<serde_json::Value>,
) -> Result<serde_json::Value, HandlerError>
where
    Q: Backlog + JobQueue,
    W: WorkerRegistry,
    J: JobStore,
    F: Fleet + FleetLister + SpotPrices,
    A: OfferingAvailability + onoff_control::ports::ArrivalStatsStore,
    E: EventLog,
    L: Lease,
{
    let decided = |started_at: f64| {
        tracing::info!(
            run_started_at = started_at,
            "scale request decided already by a later run"
        );
        serde_json::json!({
            "skipped": "decided by a run that started after the request",
            "run_started_at": started_at,
        })
    };
    if let Some(started_at) = ctx.decided_already(&event.payload).await {
        return Ok(decided(started_at));
    }
    if event.payload.get("detail-type").is_some() {
        let (_, trigger) = parse(&event.payload).map_err(|e| HandlerError::NonRetryable(e.to_string()))?;
        if let Trigger::Alarm { name, state } = &trigger {
            tracing::info!(alarm = %name, state = %state, "queue-depth alarm");
        } else {
            tracing::info!(?trigger, "scaler invoked by another event kind; reconciling anyway");
        }
    }
    let scale_request = onoff_fn_common::scale_request_asked_at(&event.payload).is_some();
    let mut waited_s = 0.0;
    let mut runs = 0u32;
    let started = tokio::time::Instant::now();
    loop {
        let mut out = ctx.reconcile(onoff_fn_common::now(), false, &event.context).await?;
        if !scale_request {
            return Ok(out);
        }
        if out.get("skipped").is_none() {
            runs += 1;
            out["runs"] = runs.into();
            if out["asks_settled"] != false {
                // Settled, or the count could not be read (among the run's errors): the pending
                // ask, if any, is ended so that the next ask invokes.
                if out["asks_settled"].is_null() {
                    give_up(ctx, "the scale requests could not be counted").await;
                }
                return Ok(out);
            }
            // Asks joined this request while the run was under way ([`onoff_fn_common::request_scale`]):
            // their jobs may have been queued after it read the backlog, so it goes again,
            // up to SCALE_REQUEST_RUNS_S; then the pending ask is ended so the next ask invokes
            // afresh (the schedule's run catches up with the rest).
            if started.elapsed().as_secs_f64() >= SCALE_REQUEST_RUNS_S {
                give_up(ctx, "scale requests still coming in").await;
                return Ok(out);
            }
            continue;
        }
        // A scale request that finds the lease held (the reconciler's run, which may have read
        // the backlog before the asker's jobs were queued) waits for that run to end rather than
        // leave its jobs to the next scheduled one, up to SCALE_REQUEST_WAIT_S.
        if waited_s >= SCALE_REQUEST_WAIT_S {
            give_up(ctx, "the lease stayed held").await;
            return Ok(out);
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        waited_s += 1.0;
        if let Some(started_at) = ctx.decided_already(&event.payload).await {
            return Ok(decided(started_at));
        }
    }
}

/// End the pending scale request of a scaler that stops going again: the next ask invokes.
async fn give_up<Q, W, J, F, A, E, L: Lease>(ctx: &Ctx<Q, W, J, F, A, E, L>, why: &str) {
    tracing::info!(why, "the pending scale request is ended: the next ask invokes afresh");
    if let Err(e) = ctx
        .lease
        .drop_pending_ask(onoff_control::reconcile::RECONCILE_LEASE)
        .await
    {
        tracing::warn!(error = %e, "could not end the pending scale request; it lapses after its stale time");
    }
}

/// Longest a scale request waits for a run holding the reconcile lease to end, seconds. A run
/// takes seconds; the reconciler's schedule (every minute by default) catches up after that.
pub const SCALE_REQUEST_WAIT_S: f64 = 20.0;

/// Longest a scale request goes on running again while asks keep joining it, seconds: well within
/// the scaler's 60 s `Timeout` (template.yaml) for a run of a few seconds. Past it, the next ask
/// invokes a fresh request.
pub const SCALE_REQUEST_RUNS_S: f64 = 30.0;

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_control::submit::{submit, Source};
    use onoff_fn_common::testing::fake_ctx;

    /// `handle` on `payload`, with a default Lambda context.
    async fn invoke(ctx: &onoff_fn_common::testing::FakeCtx, payload: serde_json::Value) -> serde_json::Value {
        handle(ctx, &(), LambdaEvent::new(payload, lambda_runtime::Context::default()))
            .await
            .unwrap()
    }

    /// One 1-GPU job submitted now to a fake context; returns the time, unix seconds.
    async fn one_job_queued(ctx: &onoff_fn_common::testing::FakeCtx) -> f64 {
        let spec = r#"{"image":"i","command":["x"],"project":"p"}"#;
        let t0 = onoff_fn_common::now();
        let src = Source::Sqs { message_id: "m".into() };
        submit(spec, &src, &["express", "standard"], t0, &ctx.jobs, &ctx.queues)
            .await
            .unwrap();
        t0
    }

    #[tokio::test]
    async fn the_alarm_sample_launches_for_the_backlog() {
        let ctx = fake_ctx();
        one_job_queued(&ctx).await;
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../events/queue-depth-alarm.json"
        ))
        .unwrap();
        let payload: serde_json::Value = serde_json::from_str(&text).unwrap();
        let out = handle(&ctx, &(), LambdaEvent::new(payload, lambda_runtime::Context::default()))
            .await
            .unwrap();
        assert_eq!(out["launched"].as_array().unwrap().len(), 1, "{out}");
        assert_eq!(ctx.fleet.running().len(), 1);
        // A malformed EventBridge event is not retried.
        let bad = serde_json::json!({"detail-type": "CloudWatch Alarm State Change"});
        let err = handle(&ctx, &(), LambdaEvent::new(bad, lambda_runtime::Context::default()))
            .await
            .unwrap_err();
        assert!(matches!(err, HandlerError::NonRetryable(_)));
    }

    /// 500 specs uploaded at once ask for 500 runs; Lambda queues them behind one another. A
    /// request asked for before a completed run started is answered at once with nothing done;
    /// one asked for after it (or without a time, or before any run) runs.
    #[tokio::test]
    async fn a_scale_request_a_later_run_decided_is_answered_without_a_run() {
        let ctx = fake_ctx();
        let t0 = one_job_queued(&ctx).await;
        let request = |asked_at: f64| onoff_fn_common::scale_request("submit", asked_at);
        // Before any run: it runs, and launches for the job.
        let out = invoke(&ctx, request(t0 - 60.0)).await;
        assert_eq!(out["launched"].as_array().unwrap().len(), 1, "{out}");
        let acquired = ctx.lease.acquisitions().len();
        // Asked 60 s before that run started: decided by it, no run (no lease taken).
        let out = invoke(&ctx, request(t0 - 60.0)).await;
        assert_eq!(
            out["skipped"], "decided by a run that started after the request",
            "{out}"
        );
        assert!(out["run_started_at"].as_f64().unwrap() >= t0, "{out}");
        assert_eq!(ctx.lease.acquisitions().len(), acquired);
        // Within the margin of the run's start, after it, or with no time: each runs.
        let late = out["run_started_at"].as_f64().unwrap() - onoff_fn_common::SCALE_REQUEST_MARGIN_S + 1.0;
        for payload in [
            request(late),
            request(onoff_fn_common::now() + 1.0),
            serde_json::json!({ "source": "onoff.scale-request", "reason": "older asker" }),
        ] {
            let out = invoke(&ctx, payload.clone()).await;
            assert!(out.get("skipped").is_none(), "{payload}: {out}");
        }
        assert_eq!(ctx.lease.acquisitions().len(), acquired + 3);
        assert_eq!(ctx.fleet.running().len(), 1, "one worker for the one job");
    }

    /// Asks that join a pending scale request while its run is under way make the run go again
    /// (their jobs may have been queued after it read the backlog), in the same invocation;
    /// once a run saw every ask, the pending request ends and the next ask invokes afresh.
    #[tokio::test]
    async fn a_scale_request_runs_again_for_asks_that_joined_during_its_run() {
        use onoff_control::reconcile::RECONCILE_LEASE;
        use onoff_fn_common::ScaleAsk;
        let ctx = fake_ctx();
        let t0 = one_job_queued(&ctx).await;
        let trigger = onoff_fn_common::testing::FakeObjects::default();
        let ask = || onoff_fn_common::request_scale(&ctx.lease, &trigger, &[], "submit: 1 new job(s)");
        assert_eq!(ask().await, Ok(ScaleAsk::Invoke));
        assert_eq!(ask().await, Ok(ScaleAsk::Joined), "pending: the second ask joins");
        assert_eq!(
            trigger.scale_requests.lock().unwrap().len(),
            1,
            "one invoke for two asks"
        );
        ctx.lease.ask_during_next_run(1);
        let out = invoke(&ctx, onoff_fn_common::scale_request("submit", t0)).await;
        assert_eq!(out["runs"], 2, "{out}");
        assert_eq!(out["asks_settled"], true, "{out}");
        assert_eq!(ctx.lease.pending_ask(RECONCILE_LEASE), None);
        assert_eq!(ask().await, Ok(ScaleAsk::Invoke));
        assert_eq!(trigger.scale_requests.lock().unwrap().len(), 2);
        // A run alone (no ask joined): once.
        let out = invoke(&ctx, onoff_fn_common::scale_request("submit", onoff_fn_common::now())).await;
        assert_eq!(out["runs"], 1, "{out}");
        assert_eq!(ctx.lease.pending_ask(RECONCILE_LEASE), None);
    }

    /// A scale request that finds the reconciler's run holding the lease waits for it to end and
    /// then runs (that run may have read the backlog before the asker's job was queued), rather
    /// than leave the job to the next scheduled run; an alarm's invocation does not wait.
    #[tokio::test(start_paused = true)]
    async fn a_scale_request_waits_for_the_run_holding_the_lease_then_runs() {
        let ctx = std::sync::Arc::new(fake_ctx());
        let t0 = one_job_queued(&ctx).await;
        let lease = onoff_control::reconcile::RECONCILE_LEASE;
        assert!(ctx.lease.acquire(lease, "reconciler-run", 300.0, t0).await.unwrap());
        let alarm = serde_json::json!({ "source": "test" });
        let out = invoke(&ctx, alarm).await;
        assert!(out.get("skipped").is_some(), "no wait without a request: {out}");
        let holder = {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(3)).await;
                ctx.lease.release(lease, "reconciler-run").await.unwrap();
            })
        };
        let request = onoff_fn_common::scale_request("submit", t0);
        let out = invoke(&ctx, request).await;
        holder.await.unwrap();
        assert_eq!(out["launched"].as_array().map(Vec::len), Some(1), "{out}");
        // A lease never given back (until its expiry): the request gives up after the wait.
        assert!(ctx
            .lease
            .acquire(lease, "stuck", 300.0, onoff_fn_common::now())
            .await
            .unwrap());
        let started = tokio::time::Instant::now();
        let request = onoff_fn_common::scale_request("submit", onoff_fn_common::now());
        let out = invoke(&ctx, request).await;
        assert!(out.get("skipped").is_some(), "{out}");
        let waited = started.elapsed().as_secs_f64();
        assert!(
            (SCALE_REQUEST_WAIT_S..SCALE_REQUEST_WAIT_S + 2.0).contains(&waited),
            "{waited}"
        );
    }
}
