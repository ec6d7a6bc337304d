//! Reconciler: on its EventBridge schedule, run the policy with the reaper (orphans, lost
//! workers, stale heartbeats, expired leases, idle workers past the keep-alive).

use lambda_runtime::LambdaEvent;
use onoff_control::ports::{
    Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability, SpotPrices, WorkerRegistry,
};
use onoff_fn_common::{Ctx, HandlerError};

/// Handle one scheduled tick (the payload is not read).
///
/// # Errors
/// `Retryable` when the state cannot be read.
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
    ctx.reconcile(onoff_fn_common::now(), true, &event.context).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_fn_common::testing::fake_ctx;
    use onoff_policy::{CapacityType, OfferingKey};

    #[tokio::test]
    async fn the_schedule_sample_reaps_an_orphan() {
        let ctx = fake_ctx();
        ctx.fleet.add_instance(
            "i-orphan",
            OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: "us-east-1a".into(),
                capacity_type: CapacityType::Spot,
            },
        );
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../events/schedule.json")).unwrap();
        let payload: serde_json::Value = serde_json::from_str(&text).unwrap();
        let out = handle(&ctx, &(), LambdaEvent::new(payload, lambda_runtime::Context::default()))
            .await
            .unwrap();
        assert_eq!(out["orphans_terminated"], serde_json::json!(["i-orphan"]));
        assert!(ctx.fleet.running().is_empty());
    }
}
