//! Interruption: EC2 events from EventBridge (spot interruption warning, rebalance
//! recommendation, state change). Idempotent by event id, recorded once the event's work is done
//! (a retry after a failure does it); unknown kinds are a logged no-op; a malformed event is an
//! error (`NonRetryable`), so Lambda, after its retries, sends it to the function's dead-letter
//! queue (template.yaml: `FailedEventsQueue`) with the reason in its `ErrorMessage` attribute,
//! where the dead-letter alarm tells the operator. After a worker is drained it asks the scaler to run at once (an asynchronous
//! invoke: this function holds no launch rights), so replacement capacity is launched elsewhere
//! when the backlog needs it; a failure of that request is logged, not retried (the event's own
//! work is done and recorded; the schedule and the alarm catch up). Each notice to one of the
//! deployment's workers is counted (`SpotNotices`, `onoff_fn_common::spot_notice_line`); a
//! duplicate delivery and an instance of the account that is no worker are not.

use lambda_runtime::LambdaEvent;
use onoff_control::interruption::{handle_event, HandleError, Handled};
use onoff_control::ports::{
    Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability, WorkerRegistry,
};
use onoff_fn_common::{emf, spot_notice_line, Ctx, HandlerError, ScalerTrigger, SpotNotice};

/// Handle one EventBridge event.
///
/// # Errors
/// `Retryable` when a store failed; `NonRetryable` for a malformed event (Lambda retries both, up
/// to `MaximumRetryAttempts`, then dead-letters the event).
pub async fn handle<Q, W, J, F, A, E, L, C>(
    ctx: &Ctx<Q, W, J, F, A, E, L>,
    clients: &C,
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
    C: ScalerTrigger,
{
    let now = onoff_fn_common::now();
    // The replacement decision after a drain is the scaler's: ask it, best effort.
    let ask = |reason: String| async move {
        match onoff_fn_common::request_scale(&ctx.lease, clients, &[], &reason).await {
            Ok(onoff_fn_common::ScaleAsk::Invoke) => serde_json::json!({ "scale_request": reason }),
            Ok(onoff_fn_common::ScaleAsk::Joined) => serde_json::json!({ "scale_request_joined": reason }),
            Err(e) => {
                tracing::warn!(error = %e, "asking the scaler failed; the alarm and the schedule catch up");
                serde_json::json!({ "scale_request_error": e })
            }
        }
    };
    let replace = |what: &'static str, worker: String| async move {
        let mut out = ask(format!("interruption: {what} {worker}")).await;
        out[what] = serde_json::Value::String(worker);
        out
    };
    match handle_event(
        &event.payload,
        &ctx.settings.policy,
        &ctx.workers,
        &ctx.avail,
        &ctx.events,
        now,
    )
    .await
    {
        Ok(Handled::Drained { worker }) => {
            tracing::info!(%worker, "drained after a spot interruption warning");
            emf::emit(&spot_notice_line(
                &ctx.settings.deployment,
                SpotNotice::InterruptionWarning,
                now,
            ));
            Ok(replace("drained", worker).await)
        }
        Ok(Handled::Rebalanced { worker }) => {
            tracing::info!(%worker, "drained after a rebalance recommendation; its job runs on");
            emf::emit(&spot_notice_line(
                &ctx.settings.deployment,
                SpotNotice::RebalanceRecommendation,
                now,
            ));
            Ok(replace("rebalanced", worker).await)
        }
        Ok(Handled::Terminated { worker }) => Ok(serde_json::json!({ "terminated": worker })),
        Ok(Handled::Duplicate) => Ok(serde_json::json!({ "duplicate": true })),
        Ok(Handled::NoOp(why)) => {
            tracing::info!(%why, "no-op");
            Ok(serde_json::json!({ "noop": why }))
        }
        Ok(Handled::Reconcile) => Ok(ask("interruption: capacity changed".into()).await),
        Err(HandleError::Malformed(e)) => {
            tracing::warn!(error = %e, "a malformed event: failing it to the dead-letter queue");
            Err(HandlerError::NonRetryable(e.to_string()))
        }
        Err(HandleError::Store(e)) => Err(HandlerError::Retryable(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_control::fake::FleetCall;
    use onoff_control::ports::WorkerRecord;
    use onoff_control::submit::{submit, Source};
    use onoff_fn_common::testing::{fake_ctx, FakeObjects};
    use onoff_policy::{CapacityType, OfferingKey, WorkerState};

    fn sample(name: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(format!("{}/../../events/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[tokio::test]
    async fn a_spot_warning_drains_and_launches_a_replacement_elsewhere() {
        let ctx = fake_ctx();
        let now = onoff_fn_common::now();
        // The warned worker runs a job; one more job is queued.
        let spot = OfferingKey {
            instance_type: "g4dn.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::Spot,
        };
        ctx.workers
            .register_launch(WorkerRecord {
                state: WorkerState::Running,
                heartbeat_at: Some(now),
                ..WorkerRecord::launched("i-0b662ef9931388ba0", "standard", spot.clone(), 0.18, now - 600.0)
            })
            .await
            .unwrap();
        ctx.fleet.add_instance("i-0b662ef9931388ba0", spot.clone());
        submit(
            r#"{"image":"i","command":["x"],"project":"p"}"#,
            &Source::Sqs { message_id: "m".into() },
            &["express", "standard"],
            now,
            &ctx.jobs,
            &ctx.queues,
        )
        .await
        .unwrap();
        let asks = FakeObjects::default();
        let out = handle(
            &ctx,
            &asks,
            LambdaEvent::new(
                sample("spot-interruption-warning.json"),
                lambda_runtime::Context::default(),
            ),
        )
        .await
        .unwrap();
        assert_eq!(out["drained"], "i-0b662ef9931388ba0", "{out}");
        assert_eq!(
            ctx.workers.records()["i-0b662ef9931388ba0"].state,
            WorkerState::Draining
        );
        assert!(ctx.avail.marked().contains_key(&spot));
        // It launches nothing itself (no launch rights): it asks the scaler...
        assert!(
            ctx.fleet.calls().iter().all(|c| !matches!(c, FleetCall::Launch(_))),
            "{out}"
        );
        assert_eq!(
            *asks.scale_requests.lock().unwrap(),
            ["interruption: drained i-0b662ef9931388ba0"]
        );
        // ...whose run launches the replacement elsewhere.
        let r = ctx
            .reconcile(now, false, &lambda_runtime::Context::default())
            .await
            .unwrap();
        let launched = r["launched"].as_array().unwrap();
        assert_eq!(launched.len(), 1, "{r}");
        let new = &ctx.fleet.running()[launched[0].as_str().unwrap()];
        assert_ne!(new, &spot, "the replacement avoids the interrupted offering");
        // EventBridge delivers it again: handled once.
        let again = handle(
            &ctx,
            &FakeObjects::default(),
            LambdaEvent::new(
                sample("spot-interruption-warning.json"),
                lambda_runtime::Context::default(),
            ),
        )
        .await
        .unwrap();
        assert_eq!(again["duplicate"], true);
    }

    #[tokio::test]
    async fn a_rebalance_drains_the_worker_but_neither_stops_it_nor_requeues_its_job() {
        use onoff_control::job::JobState;
        use onoff_control::ports::Claim;
        let ctx = fake_ctx();
        let now = onoff_fn_common::now();
        let id = "i-0b662ef9931388ba0";
        let spot = OfferingKey {
            instance_type: "g4dn.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::Spot,
        };
        ctx.workers
            .register_launch(WorkerRecord {
                state: WorkerState::Running,
                heartbeat_at: Some(now),
                ..WorkerRecord::launched(id, "standard", spot.clone(), 0.18, now - 600.0)
            })
            .await
            .unwrap();
        ctx.fleet.add_instance(id, spot.clone());
        // The worker runs a job.
        submit(
            r#"{"image":"i","command":["x"],"project":"p"}"#,
            &Source::Sqs { message_id: "m".into() },
            &["express", "standard"],
            now,
            &ctx.jobs,
            &ctx.queues,
        )
        .await
        .unwrap();
        let job = ctx.jobs.records().into_keys().next().unwrap();
        assert!(matches!(
            ctx.jobs.claim(&job, id, now + 300.0, now).await.unwrap(),
            Claim::Claimed(_)
        ));
        let sent = ctx.queues.sent().len();
        let out = handle(
            &ctx,
            &FakeObjects::default(),
            LambdaEvent::new(
                sample("rebalance-recommendation.json"),
                lambda_runtime::Context::default(),
            ),
        )
        .await
        .unwrap();
        assert_eq!(out["rebalanced"], id, "{out}");
        // Draining (no new work) and its offering skipped for a while...
        assert_eq!(ctx.workers.records()[id].state, WorkerState::Draining);
        assert!(ctx.avail.marked().contains_key(&spot));
        // ...but still running, and its job still held by it: only the spot warning stops it.
        assert!(ctx.fleet.running().contains_key(id));
        assert!(!ctx.fleet.calls().iter().any(|c| match c {
            FleetCall::Terminate(ids) | FleetCall::Cancel(ids) | FleetCall::Stop(ids) => ids.iter().any(|i| i == id),
            FleetCall::Launch(_) | FleetCall::Start(_) | FleetCall::CancelRequests(_) => false,
        }));
        let rec = &ctx.jobs.records()[&job];
        assert_eq!((rec.state, rec.lease_owner.as_deref()), (JobState::Running, Some(id)));
        assert_eq!(ctx.queues.sent().len(), sent, "no job re-queued");
    }

    #[tokio::test]
    async fn every_ec2_sample_is_handled_and_a_malformed_event_is_an_error() {
        let ctx = fake_ctx();
        for name in ["rebalance-recommendation.json", "instance-state-change.json"] {
            let out = handle(
                &ctx,
                &FakeObjects::default(),
                LambdaEvent::new(sample(name), lambda_runtime::Context::default()),
            )
            .await
            .unwrap();
            assert!(
                out["noop"].as_str().unwrap().contains("not an onoff worker"),
                "{name}: {out}"
            );
        }
        // An error, so that Lambda dead-letters it with the reason (a drop was a log line only).
        for (event, why) in [
            (serde_json::json!({"source": "aws.ec2"}), "missing field"),
            (
                serde_json::json!({"id": "e1", "source": "aws.ec2", "detail-type": "EC2 Spot Instance Interruption Warning", "time": "2026-11-30T00:00:00Z", "detail": {"instance-action": "terminate"}}),
                "lacks detail.instance-id",
            ),
        ] {
            let err = handle(
                &ctx,
                &FakeObjects::default(),
                LambdaEvent::new(event, lambda_runtime::Context::default()),
            )
            .await
            .unwrap_err();
            assert!(
                matches!(&err, HandlerError::NonRetryable(m) if m.contains(why)),
                "{err}"
            );
        }
    }
}
