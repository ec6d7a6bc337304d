//! Scaler: on the queue-depth alarm (state change via EventBridge), or invoked directly, run the
//! policy without the reaper and carry out its plan.

use lambda_runtime::LambdaEvent;
use onoff_control::events::{parse, Trigger};
use onoff_control::ports::{
    Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability, SpotPrices, WorkerRegistry,
};
use onoff_fn_common::{Ctx, HandlerError};

/// Handle one invocation: an EventBridge alarm state change, or any direct invocation payload.
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
    A: OfferingAvailability,
    E: EventLog,
    L: Lease,
{
    if event.payload.get("detail-type").is_some() {
        let (_, trigger) = parse(&event.payload).map_err(|e| HandlerError::NonRetryable(e.to_string()))?;
        if let Trigger::Alarm { name, state } = &trigger {
            tracing::info!(alarm = %name, state = %state, "queue-depth alarm");
        } else {
            tracing::info!(?trigger, "scaler invoked by another event kind; reconciling anyway");
        }
    }
    ctx.reconcile(onoff_fn_common::now(), false, &event.context).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_control::submit::{submit, Source};
    use onoff_fn_common::testing::fake_ctx;

    #[tokio::test]
    async fn the_alarm_sample_launches_for_the_backlog() {
        let ctx = fake_ctx();
        let spec = r#"{"image":"i","command":["x"],"project":"p"}"#;
        submit(
            spec,
            &Source::Sqs { message_id: "m".into() },
            &["express", "standard"],
            onoff_fn_common::now(),
            &ctx.jobs,
            &ctx.queues,
        )
        .await
        .unwrap();
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
}
