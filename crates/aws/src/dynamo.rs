//! DynamoDB helpers shared by the table adapters: attribute values and error mapping.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::AttributeValue;
use onoff_control::ports::StoreError;

/// A string attribute.
pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

/// A number attribute.
pub(crate) fn n(v: f64) -> AttributeValue {
    AttributeValue::N(format!("{v}"))
}

/// A whole-seconds number attribute (DynamoDB TTL wants integer epoch seconds).
pub(crate) fn epoch_s(v: f64) -> AttributeValue {
    AttributeValue::N(format!("{}", v as i64))
}

/// The error naming the operation, the code and the message: `StoreError::Invalid` for a
/// ValidationException (the request itself is bad, e.g. an item over 400 KB: retrying cannot
/// help), otherwise `StoreError::Other` (a missing table says so).
pub(crate) fn store_error<E>(what: &str, e: &SdkError<E>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let code = e.code().unwrap_or("Unknown");
    let msg = crate::errors::error_text(e);
    if code == "ResourceNotFoundException" {
        StoreError::Other(format!("{what}: table not found ({msg})"))
    } else if code == "ValidationException" {
        StoreError::Invalid(format!("{what}: {code}: {msg}"))
    } else {
        StoreError::Other(format!("{what}: {code}: {msg}"))
    }
}

/// Whether a conditional write lost.
pub(crate) fn condition_failed<E: ProvideErrorMetadata>(e: &SdkError<E>) -> bool {
    e.code() == Some("ConditionalCheckFailedException")
}
