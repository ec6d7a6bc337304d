//! onoff's control plane core: ports (narrow traits over the fleet and the state stores) and the
//! use cases that run the policy through them. No AWS here: `crates/aws` implements the ports with
//! the AWS SDK, the simulator with a simulated fleet, [`fake`] in memory.
//!
//! # Layout
//! - [`ports`]: `Fleet`, `WorkerRegistry`, `OfferingAvailability`, their errors.
//! - [`act`](mod@act): carry out a plan (launch with capacity-error fallback, terminate, cancel) and handle an
//!   interruption notice.
//! - [`job`]: job spec validation, the job state machine, idempotent job ids.
//! - [`events`]: EventBridge events parsed by (source, detail-type); unknown kinds are a no-op.
//! - [`interruption`]: spot warnings, rebalance recommendations, state changes (idempotent by event id).
//! - [`catalog`]: the EC2 GPU catalogue (specs, prices, Spot Advisor buckets) as offerings.
//! - [`reconcile`](mod@reconcile): observe, reap, decide, act (the scaler and the reconciler).
//! - [`lease`](mod@lease): how long an invocation holds the reconcile lease (from its deadline).
//! - [`submit`](mod@submit): validate a job spec, write the job, enqueue it (idempotent).
//! - [`boundary`]: what one job's AWS session may touch (the session policy the agent asks for).
//! - [`admission`]: the size cap of a spec, and [`admission::feasible`]: whether an allowed
//!   instance can ever run a job (checked at submission).
//! - [`emf`]: CloudWatch Embedded Metric Format lines (functions and the agent print them).
//! - [`fake`]: in-memory fakes (feature `fake`, on by default).
#![warn(missing_docs)]

pub mod act;
pub mod admission;
pub mod arrivals;
pub mod boundary;
pub mod catalog;
pub mod emf;
pub mod events;
#[cfg(feature = "fake")]
pub mod fake;
pub mod interruption;
pub mod job;
pub mod lease;
pub mod ports;
pub mod quota;
pub mod reconcile;
pub mod submit;

pub use act::{act, handle_interruption_notice, ActContext, ActOutcome, LaunchedWorker};
