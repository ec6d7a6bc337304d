//! The only onoff crate that speaks AWS: aws-sdk adapters for the control ports, AWS error
//! classification and typed settings. No `lambda_runtime` here: the worker agent reuses it.
//!
//! # Layout
//! - [`checkpoints`]: [`onoff_control::ports::CheckpointStore`] on S3: multipart, manifest last.
//! - [`settings`]: resource names from the environment; the SDK clients, built once.
//! - [`errors`]: EC2 error codes classified into the kinds the core acts on.
//! - [`fleet`]: [`onoff_control::ports::Fleet`] on EC2 (CreateFleet instant, TerminateInstances,
//!   tag-filtered DescribeInstances).
//! - [`state`]: [`onoff_control::ports::WorkerRegistry`] and
//!   [`onoff_control::ports::OfferingAvailability`] on DynamoDB, with conditional writes.
//! - [`jobs`]: [`onoff_control::ports::JobStore`] on DynamoDB: conditional transitions, leases, error records.
//! - [`queue`]: lane queues on SQS: backlog, send, receive, visibility, delete.
//! - [`objects`]: job spec objects on S3: size and bytes of the version an event names.
//! - [`record`]: every call a component makes as a JSON line (for `onoff local`'s IAM checks).
//! - [`limits`], [`faults`]: against an emulator, AWS's request limits held and AWS's lost answers
//!   injected, which the emulator has neither of.
//! - [`provision`]: the template's resources created through the SDK, for a local emulator.
#![warn(missing_docs)]

pub mod checkpoints;
mod dynamo;
pub mod errors;
pub mod faults;
pub mod fleet;
pub mod jobs;
pub mod limits;
pub mod objects;
pub mod provision;
pub mod queue;
pub mod record;
pub mod settings;
pub mod state;
