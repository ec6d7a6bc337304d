//! Ports: the narrow capabilities the use cases need, one trait per capability.
//!
//! Each method's doc says whether it is idempotent and what "not found" means. Adapters (AWS in
//! `crates/aws`, the simulator, the fakes in [`crate::fake`]) implement them.

use onoff_policy::{OfferingKey, WorkerState};

/// Kinds of fleet errors the core acts on; adapters classify provider errors into these once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetErrorKind {
    /// No capacity for the offering (EC2: InsufficientInstanceCapacity, MaxSpotInstanceCountExceeded,
    /// SpotMaxPriceTooLow, VcpuLimitExceeded, ...): try the next offering, skip this one for a while.
    InsufficientCapacity,
    /// The instance or resource does not exist.
    NotFound,
    /// Rate limited (EC2 RequestLimitExceeded): retried with backoff by the adapter; surfaced when
    /// retries ran out.
    Throttled,
    /// Anything else.
    Other,
}

/// An error from a [`Fleet`] call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct FleetError {
    /// What the core should do about it.
    pub kind: FleetErrorKind,
    /// The provider's message (code and text).
    pub message: String,
}

/// One launch: `count` instances of one offering for one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchRequest {
    /// Lane name (tagged on the instances as `onoff:lane`).
    pub lane: String,
    /// The offering.
    pub offering: OfferingKey,
    /// Instances wanted.
    pub count: u32,
    /// Project the capacity is for (tagged `onoff:project`), if any.
    pub project: Option<String>,
    /// Job the capacity is pinned to, if any.
    pub job: Option<String>,
}

/// An instance a launch created.
#[derive(Debug, Clone, PartialEq)]
pub struct Launched {
    /// Instance id.
    pub instance_id: String,
    /// Offering it came from.
    pub offering: OfferingKey,
}

/// Launch and retire instances.
#[allow(async_fn_in_trait)]
pub trait Fleet {
    /// Launch up to `req.count` instances of `req.offering` (EC2 CreateFleet type `instant`). May
    /// return fewer than asked (partial fulfilment) with `Ok`. Not idempotent: each call launches.
    ///
    /// # Errors
    /// [`FleetErrorKind::InsufficientCapacity`] when the offering has no capacity at all.
    async fn launch(&self, req: &LaunchRequest) -> Result<Vec<Launched>, FleetError>;

    /// Terminate running instances. Idempotent: an instance already gone is not an error.
    ///
    /// # Errors
    /// Provider failures other than not-found.
    async fn terminate(&self, instance_ids: &[String]) -> Result<(), FleetError>;

    /// Cancel launches that have not finished booting (kept apart from [`Fleet::terminate`]:
    /// Cluster Autoscaler's "cancel unfulfilled launches" vs "delete this node"). Idempotent.
    ///
    /// # Errors
    /// Provider failures other than not-found.
    async fn cancel_launch(&self, instance_ids: &[String]) -> Result<(), FleetError>;
}

/// Record of a worker kept by the control plane.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRecord {
    /// Instance id.
    pub id: String,
    /// Lane name.
    pub lane: String,
    /// Offering.
    pub offering: OfferingKey,
    /// Price billed, $/h.
    pub price_usd_per_h: f64,
    /// State.
    pub state: WorkerState,
    /// Launch time, unix seconds.
    pub launched_at: f64,
    /// Project it was launched for, if any.
    pub project: Option<String>,
}

/// Errors of state stores.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The item does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// A conditional write lost (someone else changed the item first).
    #[error("conflict: {0}")]
    Conflict(String),
    /// Anything else (I/O, throttling after retries, missing table).
    #[error("store error: {0}")]
    Other(String),
}

/// The workers table.
#[allow(async_fn_in_trait)]
pub trait WorkerRegistry {
    /// Insert a new worker record (state Pending). Idempotent by instance id.
    ///
    /// # Errors
    /// [`StoreError::Other`] on store failure.
    async fn register_launch(&self, record: WorkerRecord) -> Result<(), StoreError>;

    /// Set a worker's state. Not-found is [`StoreError::NotFound`] (the worker is gone).
    ///
    /// # Errors
    /// [`StoreError`] as above.
    async fn set_state(&self, id: &str, state: WorkerState) -> Result<(), StoreError>;
}

/// Offerings that failed with a capacity error, skipped until a time.
#[allow(async_fn_in_trait)]
pub trait OfferingAvailability {
    /// Mark `key` unavailable until `until` (unix seconds). Idempotent; a later `until` wins.
    ///
    /// # Errors
    /// [`StoreError::Other`] on store failure.
    async fn mark_unavailable(&self, key: &OfferingKey, until: f64) -> Result<(), StoreError>;
}
