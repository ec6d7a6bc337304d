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

/// Keys one `BatchGetItem` request may name: 100 (DynamoDB API Reference, BatchGetItem: "up to
/// 100 items"; more is a ValidationException).
pub(crate) const BATCH_GET_MAX_KEYS: usize = 100;

/// Requests a batch read makes before it gives up on keys DynamoDB keeps answering as
/// unprocessed.
pub(crate) const BATCH_GET_TRIES: u32 = 8;

/// Wait before the `try_no`-th request of a batch read (1 = the first retry), the exponential
/// backoff DynamoDB asks for when it returns unprocessed keys (API Reference, BatchGetItem: "we
/// strongly recommend that you use an exponential backoff algorithm"): 50 ms doubled per retry,
/// at most 1.6 s (about 4.8 s over all [`BATCH_GET_TRIES`]).
pub(crate) fn batch_backoff(try_no: u32) -> std::time::Duration {
    std::time::Duration::from_millis(50u64 << try_no.saturating_sub(1).min(5))
}

/// Read `keys` with `send`, one request of the keys still unread, which answers the items it read
/// and the keys it left unprocessed, until none is left.
///
/// `BatchGetItem` answers part of a request when the answer would pass 16 MB, when the table's
/// throughput is exceeded or when a partition fails, and names the rest in `UnprocessedKeys`
/// (API Reference, BatchGetItem); the caller retries them after [`batch_backoff`] (`pause`).
///
/// # Errors
/// `send`'s; [`StoreError::Other`] when keys are still unprocessed after [`BATCH_GET_TRIES`]
/// requests.
pub(crate) async fn batch_get<K, I, S, Fut, P, PFut>(
    what: &str,
    keys: Vec<K>,
    mut send: S,
    mut pause: P,
) -> Result<Vec<I>, StoreError>
where
    S: FnMut(Vec<K>) -> Fut,
    Fut: std::future::Future<Output = Result<(Vec<I>, Vec<K>), StoreError>>,
    P: FnMut(std::time::Duration) -> PFut,
    PFut: std::future::Future<Output = ()>,
{
    let mut unread = keys;
    let mut items = Vec::new();
    for try_no in 0..BATCH_GET_TRIES {
        if unread.is_empty() {
            break;
        }
        if try_no > 0 {
            pause(batch_backoff(try_no)).await;
        }
        let (got, left) = send(std::mem::take(&mut unread)).await?;
        items.extend(got);
        unread = left;
    }
    if unread.is_empty() {
        Ok(items)
    } else {
        Err(StoreError::Other(format!(
            "{what}: {} keys still unprocessed after {BATCH_GET_TRIES} BatchGetItem requests",
            unread.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// A table of `n` items whose answers hold at most `per_answer` of them (as DynamoDB stops at
    /// 16 MB): the rest come back unprocessed.
    async fn read(n: u32, per_answer: usize) -> (Result<Vec<u32>, StoreError>, u32, Vec<std::time::Duration>) {
        let calls = RefCell::new(0);
        let pauses = RefCell::new(Vec::new());
        let out = batch_get(
            "read items",
            (0..n).collect(),
            |keys: Vec<u32>| {
                *calls.borrow_mut() += 1;
                let cut = per_answer.min(keys.len());
                let (got, left) = keys.split_at(cut);
                let answer = Ok((got.to_vec(), left.to_vec()));
                async move { answer }
            },
            |d| {
                pauses.borrow_mut().push(d);
                async {}
            },
        )
        .await;
        (out, calls.into_inner(), pauses.into_inner())
    }

    #[tokio::test]
    async fn unprocessed_keys_are_asked_again_until_every_item_is_read() {
        let (items, calls, pauses) = read(10, 3).await;
        let mut items = items.expect("read");
        items.sort_unstable();
        assert_eq!(items, (0..10).collect::<Vec<_>>());
        assert_eq!(calls, 4, "3 + 3 + 3 + 1");
        let ms: Vec<u128> = pauses.iter().map(std::time::Duration::as_millis).collect();
        assert_eq!(
            ms,
            [50, 100, 200],
            "exponential backoff before each retry, none before the first"
        );
    }

    #[tokio::test]
    async fn keys_never_processed_fail_the_read_after_the_last_try() {
        let (items, calls, pauses) = read(5, 0).await;
        let e = items.expect_err("nothing is ever read");
        assert!(e.to_string().contains("5 keys still unprocessed"), "{e}");
        assert_eq!(calls, BATCH_GET_TRIES);
        assert_eq!(pauses.last().map(std::time::Duration::as_millis), Some(1600));
        assert_eq!(read(0, 0).await.1, 0, "no keys, no request");
    }
}
