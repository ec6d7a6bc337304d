//! onoff's scaling policy: a pure function from what the control plane observes to a plan.
//!
//! `decide(&Observation, &PolicyConfig, now) -> Plan` decides on queue depth and cost per job,
//! never on utilisation. No I/O, no async, no AWS, no clock, no randomness: the reconciler Lambda
//! and the trace-replay simulator run exactly this code.
//!
//! # Layout
//! - [`offering`]: offerings (instance type, zone, capacity type), Spot Advisor interruption buckets.
//! - [`observation`]: backlog per lane, queued jobs, workers, arrival gaps and run times per job shape.
//! - [`config`]: [`PolicyConfig`], every knob with its default and source; TOML loading; `validate()`.
//! - [`shape`]: the GPU fit rule (a leaf: choice and observation both use it).
//! - [`choice`]: offering filter, expected cost per job, diversified spread.
//! - [`deadline`]: when a deadline is at risk on spot, and where such a job may run.
//! - [`keepalive`]: ski-rental break-even keep-alive, the expected-cost timeout under the gaps, decay steps.
//! - [`decide`](mod@decide): the policy itself.
//! - [`plan`]: actions with reasons.
#![warn(missing_docs)]

pub mod choice;
pub mod config;
pub mod deadline;
pub mod decide;
pub mod keepalive;
pub mod observation;
pub mod offering;
pub mod plan;
pub mod shape;

pub use choice::{PriceTable, RankMemo};
pub use config::{
    AntiThrashConfig, CapacityPreference, ConfigError, ConfigProblem, KeepAliveMode, LaneConfig, LimitsConfig,
    OfferConfig, PolicyConfig, ProjectQuota, ScaleDownConfig, StopIdle, WarmWindow,
};
pub use decide::{decide, decide_with_memo};
pub use observation::{
    DemandWindows, FleetHint, GapHistogram, LaneBacklog, LaneId, LaneObservation, Observation, PendingJob,
    RecentRunTimes, ShapeGaps, UnavailableOffering, WorkerState, WorkerView,
};
pub use offering::{CapacityType, InterruptionBucket, Offering, OfferingKey};
pub use plan::{Action, Held, LanePlan, LaunchShape, Plan, Reason};
