//! The onoff worker agent: one process per GPU instance (see `worker-image/README.md` for its
//! settings and the job contract).
//!
//! # Layout
//! - [`config`]: settings from the environment.
//! - [`ports`]: IMDS, queue, workers table, inputs, the instance, job processes.
//! - [`agent`]: the loop, [`run`]: register, poll, claim, run, checkpoint, notices, idle exit.
//! - [`cache`]: what a worker keeps between jobs (the project cache) and what it clears (job
//!   work dirs).
//! - [`process`]: jobs as child processes (argv, streamed output, SIGTERM/SIGKILL).
//! - [`aws`]: the ports on AWS.
//! - [`fake`]: the ports in memory on tokio time, and a scripted job launcher.
#![warn(missing_docs)]

pub mod agent;
pub mod aws;
pub mod cache;
pub mod config;
pub mod fake;
pub mod ports;
pub mod process;

pub use agent::{run, AgentError, AgentReport, Deps, ExitReason, JobReport, Outcome};
pub use config::{AgentConfig, ShutdownMode};
