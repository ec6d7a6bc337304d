//! The interruption use case: EC2 events about onoff workers.
//!
//! Idempotent by event id (an [`EventLog`]): an event already recorded is a no-op, and an event is
//! recorded only after its work is done, so a retry after a failure does the work (the work itself
//! is idempotent, so two deliveries at once are harmless). On a spot interruption warning or a
//! rebalance recommendation the worker is marked Draining (it takes no new work) and its offering
//! unavailable for `offers.unavailable_ttl_s`, so the next decision launches replacement capacity
//! elsewhere. Neither terminates the worker nor re-queues its job: after the two-minute spot
//! warning the agent checkpoints and releases its job and AWS reclaims the instance; after a
//! rebalance recommendation (often not followed by an interruption) the job runs on and the
//! worker only stops taking new work. A terminated instance is marked Terminating, and so is a
//! stopping or stopped one onoff did not stop (its row is not Stopped, and the event is not from
//! before its last start). Instances onoff does not know are a no-op.

use onoff_policy::{PolicyConfig, WorkerState};

use crate::act::handle_interruption_notice;
use crate::events::{parse, EventError, Trigger};
use crate::ports::{EventLog, OfferingAvailability, StoreError, WorkerRegistry};

/// What handling an event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    /// After a spot interruption warning: worker marked Draining and its offering unavailable; a
    /// decision should follow.
    Drained {
        /// The worker.
        worker: String,
    },
    /// After a rebalance recommendation: worker marked Draining (its job runs on) and its
    /// offering unavailable; a decision should follow.
    Rebalanced {
        /// The worker.
        worker: String,
    },
    /// Worker marked Terminating.
    Terminated {
        /// The worker.
        worker: String,
    },
    /// The event was handled before.
    Duplicate,
    /// Nothing to do, and why.
    NoOp(String),
    /// An alarm or schedule: the caller runs a reconcile.
    Reconcile,
}

/// Why handling failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HandleError {
    /// The event is malformed (retrying cannot help): the handler fails it, and Lambda sends it
    /// to the function's dead-letter queue with the reason.
    #[error(transparent)]
    Malformed(#[from] EventError),
    /// A store failed: retry.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// Handle one EventBridge event (as JSON).
///
/// # Errors
/// [`HandleError::Malformed`] (dead-letter it), [`HandleError::Store`] (retry).
pub async fn handle_event<R, A, L>(
    event: &serde_json::Value,
    cfg: &PolicyConfig,
    registry: &R,
    avail: &A,
    log: &L,
    now: f64,
) -> Result<Handled, HandleError>
where
    R: WorkerRegistry,
    A: OfferingAvailability,
    L: EventLog,
{
    let (env, trigger) = parse(event)?;
    let instance = match &trigger {
        Trigger::SpotInterruption { instance_id, .. }
        | Trigger::Rebalance { instance_id }
        | Trigger::StateChange { instance_id, .. } => instance_id.clone(),
        Trigger::Alarm { .. } | Trigger::Schedule => return Ok(Handled::Reconcile),
        Trigger::Unknown { source, detail_type } => {
            return Ok(Handled::NoOp(format!("unhandled event kind {source} / {detail_type}")));
        }
    };
    // Check, work, then record: recording first would turn a retry after a failed write into a
    // no-op with the work never done.
    if log.seen(&env.id).await? {
        return Ok(Handled::Duplicate);
    }
    let Some(worker) = registry.get(&instance).await? else {
        return Ok(Handled::NoOp(format!("{instance} is not an onoff worker")));
    };
    let handled = match trigger {
        Trigger::SpotInterruption { .. } => {
            handle_interruption_notice(registry, avail, cfg, &worker.id, &worker.offering, now).await?;
            Handled::Drained { worker: worker.id }
        }
        Trigger::Rebalance { .. } => {
            handle_interruption_notice(registry, avail, cfg, &worker.id, &worker.offering, now).await?;
            Handled::Rebalanced { worker: worker.id }
        }
        Trigger::StateChange { state, .. } if matches!(state.as_str(), "shutting-down" | "terminated") => {
            match registry.set_state(&worker.id, WorkerState::Terminating).await {
                Ok(()) | Err(StoreError::NotFound(_)) => Handled::Terminated { worker: worker.id },
                Err(e) => return Err(e.into()),
            }
        }
        // Stopped by onoff (the row is Stopped since before the call): a stopped worker.
        Trigger::StateChange { state, .. }
            if matches!(state.as_str(), "stopping" | "stopped") && worker.state == WorkerState::Stopped =>
        {
            return Ok(Handled::NoOp(format!("{instance} is {state}: stopped by onoff")));
        }
        // A stop from before the worker's last start (the event came late): nothing now.
        Trigger::StateChange { state, .. }
            if matches!(state.as_str(), "stopping" | "stopped")
                && event_time(&env.time).is_some_and(|t| t < worker.launched_at) =>
        {
            return Ok(Handled::NoOp(format!(
                "{instance} was {state} at {} before its start at {}",
                env.time, worker.launched_at
            )));
        }
        // Stopped by anyone else (EC2 stopping a spot instance it interrupts, an instance shut
        // down from inside): it runs nothing, and the reaper terminates what is Terminating.
        Trigger::StateChange { state, .. } if matches!(state.as_str(), "stopping" | "stopped") => {
            let from = [
                WorkerState::Pending,
                WorkerState::Running,
                WorkerState::Idle,
                WorkerState::Draining,
            ];
            match registry.set_state_if(&worker.id, WorkerState::Terminating, &from).await {
                Ok(true) | Err(StoreError::NotFound(_)) => Handled::Terminated { worker: worker.id },
                // Stopped by onoff meanwhile, or already Terminating.
                Ok(false) => return Ok(Handled::NoOp(format!("{instance} is {state}"))),
                Err(e) => return Err(e.into()),
            }
        }
        // Nothing done: nothing to record.
        Trigger::StateChange { state, .. } => return Ok(Handled::NoOp(format!("{instance} is {state}"))),
        _ => unreachable!("alarm, schedule and unknown kinds returned above"),
    };
    // Recorded only now that the work is done; a concurrent delivery that recorded it first did
    // the same idempotent work.
    log.first_time(&env.id, now).await?;
    Ok(handled)
}

/// An event's time (RFC 3339, as EventBridge writes it) in unix seconds; `None` when it does not
/// parse (then it is taken as current).
fn event_time(time: &str) -> Option<f64> {
    chrono::DateTime::parse_from_rfc3339(time)
        .ok()
        .map(|t| t.timestamp_millis() as f64 / 1000.0)
}
