//! Faults of AWS that an emulator never produces, injected on request against an emulator only
//! (`onoff local --lose-answers N`): the control plane and the agents then meet them as they
//! would on AWS.
//!
//! - [`LoseAnswers`]: a DynamoDB write that was applied, whose answer is lost (the connection
//!   dropped after the write: an HTTP 500 in its place). The SDK's standard retry sends the same
//!   request again, and a conditional write then fails its own condition against the row the
//!   first try wrote ("the expected condition is not met after the first update", DynamoDB
//!   Developer Guide, "Working with items and attributes"). moto answers every request it applies.
//!
//! - [`VcpuQuotas`]: EC2's vCPU quotas, which moto does not enforce: CreateFleet overrides over
//!   their quota are refused as EC2 refuses them ([`quotas`]).
//!
//! An agent loses answers when [`LOSE_ANSWERS_ENV`] is set and its clients have an endpoint
//! override ([`crate::settings::Clients`]); `onoff local` gives its functions their own
//! [`LoseAnswers`] ([`crate::settings::Clients::losing_answers`]).

pub mod quotas;

pub use quotas::VcpuQuotas;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::BeforeDeserializationInterceptorContextMut;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::ConfigBag;

/// Environment variable: every Nth DynamoDB write applied loses its answer (N ≥ 2; unset or 0:
/// none). Read only for clients with an endpoint override (an emulator).
pub const LOSE_ANSWERS_ENV: &str = "ONOFF_LOSE_ANSWERS";

/// The DynamoDB operations that write an item (the ones whose answers [`LoseAnswers`] loses).
pub const WRITES: &[&str] = &["PutItem", "UpdateItem", "DeleteItem"];

/// Loses the answer of every `every`th DynamoDB write the emulator applied (HTTP 200), counted
/// per [`LoseAnswers`] (clones share the count): the answer becomes an HTTP 500
/// `InternalServerError`, which the SDK retries.
#[derive(Debug, Clone)]
pub struct LoseAnswers {
    every: u32,
    applied: Arc<AtomicU32>,
    lost: Arc<AtomicU32>,
    armed: Arc<AtomicBool>,
}

impl LoseAnswers {
    /// Lose every `every`th applied write's answer; `every` below 2 is 2 (losing every answer
    /// would also lose every retry's).
    #[must_use]
    pub fn every(every: u32) -> Self {
        Self {
            every: every.max(2),
            applied: Arc::default(),
            lost: Arc::default(),
            armed: Arc::default(),
        }
    }

    /// Lose only the answers [`LoseAnswers::arm`] asks for (tests).
    #[must_use]
    pub fn when_armed() -> Self {
        Self::every(u32::MAX)
    }

    /// Lose the next applied write's answer too, whatever the count.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Answers lost so far.
    #[must_use]
    pub fn lost(&self) -> u32 {
        self.lost.load(Ordering::Relaxed)
    }
}

/// [`LoseAnswers`] as [`LOSE_ANSWERS_ENV`] asks, if it does.
#[must_use]
pub fn from_env() -> Option<LoseAnswers> {
    let every: u32 = std::env::var(LOSE_ANSWERS_ENV).ok()?.trim().parse().ok()?;
    (every > 0).then(|| LoseAnswers::every(every))
}

impl Intercept for LoseAnswers {
    fn name(&self) -> &'static str {
        "onoff-lose-answers"
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(op) = cfg.load::<Metadata>().map(|m| m.name().to_string()) else {
            return Ok(());
        };
        let response = context.response_mut();
        if !WRITES.contains(&op.as_str()) || response.status().as_u16() != 200 {
            return Ok(());
        }
        let due = (self.applied.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(self.every);
        if !(self.armed.swap(false, Ordering::SeqCst) || due) {
            return Ok(());
        }
        answer_instead(
            response,
            500,
            r#"{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"onoff: the answer of an applied write was lost (injected)"}"#.to_string(),
        )?;
        self.lost.fetch_add(1, Ordering::Relaxed);
        tracing::info!(operation = %op, "injected: the answer of an applied DynamoDB write was lost");
        Ok(())
    }
}

/// Replace the emulator's answer with `status` and `body`, an answer AWS would give: the SDK
/// reads it as it reads AWS's (its length and DynamoDB's checksum header dropped).
pub(crate) fn answer_instead(
    response: &mut aws_smithy_runtime_api::http::Response,
    status: u16,
    body: String,
) -> Result<(), BoxError> {
    *response.status_mut() = status.try_into().map_err(|e| Box::new(e) as BoxError)?;
    response.headers_mut().remove("x-amz-crc32");
    response.headers_mut().remove("content-length");
    *response.body_mut() = aws_smithy_types::body::SdkBody::from(body);
    Ok(())
}

/// EC2's error answer (query protocol: `Response/Errors/Error`, EC2 API Reference, "Error codes")
/// with `code` and `message`.
pub(crate) fn ec2_error_body(code: &str, message: &str) -> String {
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>00000000-0000-0000-0000-000000000000</RequestID></Response>"
    )
}
