//! EventBridge events the control plane reacts to, parsed by (source, detail-type).
//!
//! Unknown kinds are an explicit no-op ([`Trigger::Unknown`]); an event that is not an EventBridge
//! envelope, or a known kind whose detail lacks its fields, is an error (logged and dropped, never
//! retried forever). Shapes follow the EC2 and CloudWatch event references:
//! - `aws.ec2` / `EC2 Spot Instance Interruption Warning`: detail `instance-id`, `instance-action`.
//! - `aws.ec2` / `EC2 Instance Rebalance Recommendation`: detail `instance-id`.
//! - `aws.ec2` / `EC2 Instance State-change Notification`: detail `instance-id`, `state`.
//! - `aws.cloudwatch` / `CloudWatch Alarm State Change`: detail `alarmName`, `state.value`.
//! - `aws.events` / `Scheduled Event`: the reconciler's schedule.

use serde::Deserialize;

/// The EventBridge envelope.
#[derive(Debug, Clone, Deserialize)]
pub struct Envelope {
    /// Event id (the idempotency key).
    pub id: String,
    /// Source, e.g. `aws.ec2`.
    pub source: String,
    /// Detail type.
    #[serde(rename = "detail-type")]
    pub detail_type: String,
    /// Event time (RFC 3339).
    #[serde(default)]
    pub time: String,
    /// Resources (ARNs).
    #[serde(default)]
    pub resources: Vec<String>,
    /// Kind-specific detail.
    #[serde(default)]
    pub detail: serde_json::Value,
}

/// What an event asks of the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// Spot interruption notice: the instance goes in two minutes.
    SpotInterruption {
        /// Instance id.
        instance_id: String,
        /// `terminate`, `stop` or `hibernate`.
        action: String,
    },
    /// Rebalance recommendation: the instance is at elevated risk of interruption.
    Rebalance {
        /// Instance id.
        instance_id: String,
    },
    /// An instance changed state.
    StateChange {
        /// Instance id.
        instance_id: String,
        /// New state (`pending`, `running`, `shutting-down`, `terminated`, `stopping`, `stopped`).
        state: String,
    },
    /// The queue-depth alarm changed state.
    Alarm {
        /// Alarm name.
        name: String,
        /// New state (`ALARM`, `OK`, `INSUFFICIENT_DATA`).
        state: String,
    },
    /// The reconciler's schedule ticked.
    Schedule,
    /// A kind this control plane does not handle: a logged no-op.
    Unknown {
        /// Source.
        source: String,
        /// Detail type.
        detail_type: String,
    },
}

/// A malformed event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed event: {0}")]
pub struct EventError(pub String);

/// Parse an EventBridge event.
///
/// # Errors
/// [`EventError`] when it is not an envelope, or a known kind lacks a field.
pub fn parse(value: &serde_json::Value) -> Result<(Envelope, Trigger), EventError> {
    let env: Envelope = serde_json::from_value(value.clone()).map_err(|e| EventError(e.to_string()))?;
    let field = |path: &[&str]| -> Result<String, EventError> {
        let mut v = &env.detail;
        for p in path {
            v = v
                .get(p)
                .ok_or_else(|| EventError(format!("{} lacks detail.{}", env.detail_type, path.join("."))))?;
        }
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| EventError(format!("detail.{} is not a string", path.join("."))))
    };
    let trigger = match (env.source.as_str(), env.detail_type.as_str()) {
        ("aws.ec2", "EC2 Spot Instance Interruption Warning") => Trigger::SpotInterruption {
            instance_id: field(&["instance-id"])?,
            action: field(&["instance-action"])?,
        },
        ("aws.ec2", "EC2 Instance Rebalance Recommendation") => Trigger::Rebalance {
            instance_id: field(&["instance-id"])?,
        },
        ("aws.ec2", "EC2 Instance State-change Notification") => Trigger::StateChange {
            instance_id: field(&["instance-id"])?,
            state: field(&["state"])?,
        },
        ("aws.cloudwatch", "CloudWatch Alarm State Change") => Trigger::Alarm {
            name: field(&["alarmName"])?,
            state: field(&["state", "value"])?,
        },
        ("aws.events", "Scheduled Event") => Trigger::Schedule,
        (source, detail_type) => Trigger::Unknown {
            source: source.into(),
            detail_type: detail_type.into(),
        },
    };
    Ok((env, trigger))
}
