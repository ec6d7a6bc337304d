//! The four functions' invocations as Lambda runs them. Each gets a request id of its own and the
//! deadline its function's `Timeout` sets (template.yaml; `Context::deadline`, milliseconds since
//! the Unix epoch), and is cut off at that deadline wherever the handler is, as Lambda ends an
//! invocation ("Task timed out after 60.00 seconds"). Calling a handler with
//! `Context::default()` instead gave it no deadline at all: the reconcile lease fell back to a
//! configured TTL, and a run slower than its function's timeout passed here where Lambda would
//! have killed it half-way.
//!
//! Every invocation of a local run but the submission queue's is asynchronous, as on AWS
//! (EventBridge rules, the schedule, S3 notifications, the scale requests' `InvocationType:
//! Event`; the SQS event source mapping invokes synchronously, [`Lambda::invoke_sync`]), and a
//! failed one is handled as Lambda handles it (Lambda Developer Guide, "How Lambda handles errors
//! and retries with asynchronous invocation"): retried with the same request id after 1 and then
//! 2 minutes, up to the function's `MaximumRetryAttempts`, while the event is younger than its
//! `MaximumEventAgeInSeconds` (template.yaml `EventInvokeConfig`); then sent to the function's
//! dead-letter queue ([`DeadLetter`]), body the event unchanged, under the function's own role.
//! Before, a failed invocation was counted and dropped here: neither a handler's retry nor the
//! dead-letter send (and the role's right to it) was ever exercised.

use std::future::Future;
use std::time::Duration;

use lambda_runtime::LambdaEvent;
use onoff_fn_common::HandlerError;
use onoff_iam::AsyncInvokeConfig;
/// The functions' principals, as [`DeadLetter::function`] names them.
pub use onoff_iam::Principal;
use serde::Serialize;
use tokio::time::Instant;
use tracing::Instrument;

/// Lambda's waits before an asynchronous invocation's first and second retry, seconds (Lambda
/// Developer Guide, "How Lambda handles errors and retries with asynchronous invocation": "a
/// one-minute wait between the first two attempts, and two minutes between the second and
/// third").
pub const RETRY_DELAYS_S: [f64; 2] = [60.0, 120.0];

/// The longest `ErrorMessage` attribute of a dead letter, bytes ("truncated to 1 KB", Lambda
/// Developer Guide, "Dead-letter queues").
pub const ERROR_MESSAGE_MAX_BYTES: usize = 1024;

/// One function's invocations in a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FunctionRuns {
    /// `scaler`, `reconciler`, `interruption` or `submit`.
    pub function: String,
    /// Its `Timeout` in template.yaml, seconds.
    pub timeout_s: f64,
    /// Its `EventInvokeConfig.MaximumRetryAttempts` (template.yaml; Lambda's default 2).
    pub max_retry_attempts: u32,
    /// Invocations, retries included.
    pub invocations: usize,
    /// The longest, wall seconds (a timed-out one counts its timeout).
    pub longest_s: f64,
    /// Invocations cut off at their deadline. A green run has 0.
    pub timed_out: usize,
    /// Invocations that returned an error (those cut off included).
    pub failed: usize,
    /// Of the invocations, Lambda's retries of a failed event.
    pub retries: usize,
    /// Events given up on (retries spent, or too old for one): sent to the dead-letter queue.
    pub dead_lettered: usize,
    /// Events delivered a second time (Lambda's asynchronous queue and EventBridge deliver at
    /// least once; [`Lambda::with_duplicates`]).
    pub delivered_twice: usize,
}

/// An event that failed, waiting for Lambda's retry.
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// The function it is for.
    pub function: Principal,
    /// The event, as first delivered.
    pub event: serde_json::Value,
    /// The request id of its first invocation, kept by every retry.
    pub request_id: String,
    /// Retries so far, this one included (1 or 2).
    pub attempt: u32,
    /// When Lambda took the event in.
    pub queued_at: Instant,
    /// When the retry is due.
    pub due: Instant,
    /// The last attempt's error.
    pub error: String,
}

/// An event Lambda gave up on, for the function's dead-letter queue: the body is the event
/// unchanged, the attributes `RequestID` (String), `ErrorCode` (Number, "3-digit HTTP error
/// code") and `ErrorMessage` (String, at most [`ERROR_MESSAGE_MAX_BYTES`]) (Lambda Developer
/// Guide, "Dead-letter queues"). The code is 200 for a function error: Lambda ran the function,
/// and the error is the function's (the guide's "Retries on errors": "The status code is 200 for
/// function errors").
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    /// The function that failed on it.
    #[serde(serialize_with = "principal_name")]
    pub function: Principal,
    /// The event.
    pub event: serde_json::Value,
    /// Its request id.
    pub request_id: String,
    /// The last error, truncated to [`ERROR_MESSAGE_MAX_BYTES`].
    pub error_message: String,
    /// Invocations it had (1 + retries; fewer when it grew too old for a retry).
    pub invocations: u32,
}

fn principal_name<S: serde::Serializer>(p: &Principal, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.as_str())
}

/// `m` cut to at most `max` bytes, on a character boundary.
fn truncate(m: &str, max: usize) -> String {
    let mut end = m.len().min(max);
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    m[..end].to_string()
}

impl DeadLetter {
    /// The event's `id` (EventBridge events have one).
    #[must_use]
    pub fn event_id(&self) -> Option<&str> {
        self.event["id"].as_str()
    }

    /// Send it to the dead-letter queue `queue_url` with `sqs`, the function's own client (on
    /// AWS, Lambda sends it with the function's execution role, which needs `sqs:SendMessage` on
    /// the queue).
    ///
    /// # Errors
    /// The send failed (a denied role, a message over the queue's size limit): on AWS the event
    /// is then lost, and Lambda counts it in the `DeadLetterErrors` metric.
    pub async fn send(&self, sqs: &aws_sdk_sqs::Client, queue_url: &str) -> Result<(), String> {
        use aws_sdk_sqs::types::MessageAttributeValue;
        let attr = |data_type: &str, value: &str| {
            MessageAttributeValue::builder()
                .data_type(data_type)
                .string_value(value)
                .build()
                .map_err(|e| e.to_string())
        };
        sqs.send_message()
            .queue_url(queue_url)
            .message_body(self.event.to_string())
            .message_attributes("RequestID", attr("String", &self.request_id)?)
            .message_attributes("ErrorCode", attr("Number", "200")?)
            .message_attributes("ErrorMessage", attr("String", &self.error_message)?)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| aws_sdk_sqs::error::DisplayErrorContext(e).to_string())
    }
}

/// A function of the run: its principal, async settings and invocations.
#[derive(Debug)]
struct Function {
    p: Principal,
    config: AsyncInvokeConfig,
    runs: FunctionRuns,
}

/// The functions of a run, each with its timeout and retry settings, what its invocations took,
/// the failed events waiting for a retry and those given up on.
#[derive(Debug)]
pub struct Lambda {
    functions: Vec<Function>,
    next_request: u64,
    duplicate_every: u64,
    async_events: u64,
    retry_delays: [Duration; 2],
    retries: Vec<Retry>,
    dead_letters: Vec<DeadLetter>,
}

/// The principals that run in a function.
pub const FUNCTIONS: [Principal; 4] = [
    Principal::Scaler,
    Principal::Reconciler,
    Principal::Interruption,
    Principal::Submit,
];

impl Lambda {
    /// The four functions with the timeouts and `EventInvokeConfig` `template` gives them, and
    /// Lambda's retry delays ([`RETRY_DELAYS_S`]).
    ///
    /// # Errors
    /// A function is missing from the template, or its `Timeout` or `EventInvokeConfig` is not
    /// a number in Lambda's range.
    pub fn from_template(template: &str) -> Result<Self, onoff_iam::Error> {
        let functions = FUNCTIONS
            .into_iter()
            .map(|p| {
                let config = onoff_iam::function_async_config(template, p)?;
                let runs = FunctionRuns {
                    function: p.as_str().to_string(),
                    timeout_s: onoff_iam::function_timeout_s(template, p)?,
                    max_retry_attempts: config.maximum_retry_attempts,
                    ..FunctionRuns::default()
                };
                Ok(Function { p, config, runs })
            })
            .collect::<Result<_, onoff_iam::Error>>()?;
        Ok(Self {
            functions,
            next_request: 0,
            duplicate_every: 0,
            async_events: 0,
            retry_delays: RETRY_DELAYS_S.map(Duration::from_secs_f64),
            retries: Vec::new(),
            dead_letters: Vec::new(),
        })
    }

    /// The same, with other waits before the first and second retry, seconds (a local run scales
    /// Lambda's down, as it does EC2's notice lead).
    #[must_use]
    pub fn with_retry_delays(mut self, delays_s: [f64; 2]) -> Self {
        self.retry_delays = delays_s.map(|d| Duration::from_secs_f64(d.max(0.0)));
        self
    }

    /// A fresh request id for an invocation of `p`: `local-<function>-<n>`.
    fn request_id(&mut self, p: Principal) -> String {
        self.next_request += 1;
        format!("local-{}-{}", p.as_str(), self.next_request)
    }

    /// The same, delivering every `every`th asynchronous event twice (0: none), as Lambda's
    /// asynchronous queue may even when the function succeeds ("it's possible for it to receive
    /// the same event from Lambda multiple times because the queue itself is eventually
    /// consistent", Lambda Developer Guide, "How Lambda handles errors and retries with
    /// asynchronous invocation"); EventBridge and S3 notifications deliver at least once too. Each
    /// handler must take a second delivery as a no-op.
    #[must_use]
    pub fn with_duplicates(mut self, every: u64) -> Self {
        self.duplicate_every = every;
        self
    }

    fn function(&mut self, p: Principal) -> &mut Function {
        self.functions
            .iter_mut()
            .find(|f| f.p == p)
            .unwrap_or_else(|| panic!("{} runs in no function", p.as_str()))
    }

    /// Invoke `p`'s `handler` with `event` asynchronously, as Lambda would: a fresh request id,
    /// the deadline of its timeout, and the handler's future dropped at that deadline (an error,
    /// as Lambda reports the invocation failed). A failed event is kept for its retry
    /// ([`Lambda::due`]) or, past its function's retries, given up on ([`Lambda::take_dead_letters`]).
    /// Every `every`th event ([`Lambda::with_duplicates`]) is delivered a second time right
    /// after, as a delivery of its own; the first delivery's answer is returned.
    ///
    /// # Panics
    /// `p` is not one of the four functions.
    pub async fn invoke<Fut>(
        &mut self,
        p: Principal,
        event: serde_json::Value,
        handler: impl Fn(LambdaEvent<serde_json::Value>) -> Fut,
    ) -> Result<serde_json::Value, HandlerError>
    where
        Fut: Future<Output = Result<serde_json::Value, HandlerError>>,
    {
        self.async_events += 1;
        let twice = self.duplicate_every > 0 && self.async_events.is_multiple_of(self.duplicate_every);
        let first = self.deliver(p, event.clone(), &handler).await;
        if twice {
            self.function(p).runs.delivered_twice += 1;
            let _ = self.deliver(p, event, &handler).await;
        }
        first
    }

    /// One delivery of an asynchronous event: a fresh request id; a failure kept for its retry
    /// or given up on.
    async fn deliver<Fut>(
        &mut self,
        p: Principal,
        event: serde_json::Value,
        handler: &impl Fn(LambdaEvent<serde_json::Value>) -> Fut,
    ) -> Result<serde_json::Value, HandlerError>
    where
        Fut: Future<Output = Result<serde_json::Value, HandlerError>>,
    {
        let request_id = self.request_id(p);
        let queued_at = Instant::now();
        let r = self.run(p, event.clone(), &request_id, handler).await;
        if let Err(e) = &r {
            self.failed(Retry {
                function: p,
                event,
                request_id,
                attempt: 0,
                queued_at,
                due: queued_at,
                error: e.to_string(),
            });
        }
        r
    }

    /// Invoke `p`'s `handler` with `event` synchronously, as Lambda's SQS event source mapping
    /// does with a batch: a fresh request id and the deadline, and no retry or dead letter on a
    /// failure (the batch's messages come back after their visibility timeout, and SQS moves one
    /// to the queue's dead-letter queue after `maxReceiveCount` receives).
    ///
    /// # Panics
    /// `p` is not one of the four functions.
    pub async fn invoke_sync<Fut>(
        &mut self,
        p: Principal,
        event: serde_json::Value,
        handler: impl FnOnce(LambdaEvent<serde_json::Value>) -> Fut,
    ) -> Result<serde_json::Value, HandlerError>
    where
        Fut: Future<Output = Result<serde_json::Value, HandlerError>>,
    {
        let request_id = self.request_id(p);
        self.run(p, event, &request_id, handler).await
    }

    /// Run the retry `r` (from [`Lambda::due`]) with `handler`: the same event and request id,
    /// a fresh deadline. Failed again, it waits for the next retry or is given up on.
    ///
    /// # Panics
    /// `r` is for a principal that is not one of the four functions.
    pub async fn retry<Fut>(
        &mut self,
        mut r: Retry,
        handler: impl FnOnce(LambdaEvent<serde_json::Value>) -> Fut,
    ) -> Result<serde_json::Value, HandlerError>
    where
        Fut: Future<Output = Result<serde_json::Value, HandlerError>>,
    {
        self.function(r.function).runs.retries += 1;
        let out = self.run(r.function, r.event.clone(), &r.request_id, handler).await;
        if let Err(e) = &out {
            r.error = e.to_string();
            self.failed(r);
        }
        out
    }

    /// One attempt: the invocation under its deadline, counted.
    async fn run<Fut>(
        &mut self,
        p: Principal,
        event: serde_json::Value,
        request_id: &str,
        handler: impl FnOnce(LambdaEvent<serde_json::Value>) -> Fut,
    ) -> Result<serde_json::Value, HandlerError>
    where
        Fut: Future<Output = Result<serde_json::Value, HandlerError>>,
    {
        let runs = &mut self.function(p).runs;
        let timeout = Duration::from_secs_f64(runs.timeout_s);
        let mut cx = lambda_runtime::Context::default();
        cx.request_id = request_id.to_string();
        let deadline = std::time::SystemTime::now() + timeout;
        cx.deadline = deadline
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let started = Instant::now();
        // Every line the handler logs names its function and request, as Lambda's log stream
        // per function and its request id do. At WARN, so that the warnings the default filter
        // shows name them too.
        let span = tracing::warn_span!("invoke", function = %p.as_str(), %request_id);
        let r = tokio::time::timeout(timeout, handler(LambdaEvent::new(event, cx)).instrument(span)).await;
        runs.invocations += 1;
        runs.longest_s = runs.longest_s.max(started.elapsed().as_secs_f64());
        let r = r.unwrap_or_else(|_| {
            runs.timed_out += 1;
            Err(HandlerError::Retryable(format!(
                "Task timed out after {:.2} seconds",
                timeout.as_secs_f64()
            )))
        });
        if r.is_err() {
            runs.failed += 1;
        }
        r
    }

    /// `r` failed its attempt `r.attempt`: due again after Lambda's wait while its function has
    /// retries left, else given up on.
    fn failed(&mut self, mut r: Retry) {
        let retries = self.function(r.function).config.maximum_retry_attempts;
        if r.attempt < retries {
            let wait = self.retry_delays[(r.attempt as usize).min(1)];
            r.attempt += 1;
            r.due = Instant::now() + wait;
            self.retries.push(r);
        } else {
            self.give_up(r);
        }
    }

    fn give_up(&mut self, r: Retry) {
        self.function(r.function).runs.dead_lettered += 1;
        self.dead_letters.push(DeadLetter {
            function: r.function,
            error_message: truncate(&r.error, ERROR_MESSAGE_MAX_BYTES),
            event: r.event,
            request_id: r.request_id,
            invocations: r.attempt + 1,
        });
    }

    /// The retries due at `now`, oldest first, for the caller to run ([`Lambda::retry`]). An event
    /// older than its function's `MaximumEventAgeInSeconds` is not retried: it is given up on.
    pub fn due(&mut self, now: Instant) -> Vec<Retry> {
        let (due, later): (Vec<Retry>, Vec<Retry>) = std::mem::take(&mut self.retries)
            .into_iter()
            .partition(|r| r.due <= now);
        self.retries = later;
        let mut run = Vec::new();
        for mut r in due {
            let max_age = f64::from(self.function(r.function).config.maximum_event_age_s);
            if (now - r.queued_at).as_secs_f64() > max_age {
                // The attempts it had: the retry that was due never ran.
                r.attempt -= 1;
                self.give_up(r);
            } else {
                run.push(r);
            }
        }
        run.sort_by_key(|r| r.due);
        run
    }

    /// Failed events waiting for a retry.
    #[must_use]
    pub fn pending_retries(&self) -> usize {
        self.retries.len()
    }

    /// The events given up on since the last call, for the caller to send to the functions'
    /// dead-letter queue ([`DeadLetter::send`]).
    pub fn take_dead_letters(&mut self) -> Vec<DeadLetter> {
        std::mem::take(&mut self.dead_letters)
    }

    /// Each function's invocations so far.
    #[must_use]
    pub fn runs(&self) -> Vec<FunctionRuns> {
        self.functions.iter().map(|f| f.runs.clone()).collect()
    }

    /// Invocations cut off at their deadline, all functions.
    #[must_use]
    pub fn timed_out(&self) -> usize {
        self.functions.iter().map(|f| f.runs.timed_out).sum()
    }
}

/// What Lambda's SQS event source mapping, with `ReportBatchItemFailures`, makes of a function's
/// answer to a batch of messages `message_ids` (Lambda Developer Guide, "Handling errors for an
/// SQS event source in Lambda", success and failure conditions): `Ok` with the ids reported
/// failed, which stay in the queue (every other message is deleted); `Err` with the reason when
/// Lambda takes the whole batch as failed and deletes none.
///
/// - A complete success: no `batchItemFailures` (a null or empty answer, an answer without the
///   key) or an empty or null list.
/// - A complete failure: `batchItemFailures` not a list; an entry whose `itemIdentifier` is
///   missing (a misspelt key), null, not a string or empty; or one naming a message that is not
///   in the batch (a receipt handle, say, in place of the message id).
///
/// # Errors
/// The reason the whole batch counts as failed.
pub fn sqs_batch_item_failures(
    answer: &serde_json::Value,
    message_ids: &[&str],
) -> Result<std::collections::BTreeSet<String>, String> {
    let failures = match answer.get("batchItemFailures") {
        None | Some(serde_json::Value::Null) => return Ok(Default::default()),
        Some(serde_json::Value::Array(a)) => a,
        Some(other) => return Err(format!("batchItemFailures is not a list: {other}")),
    };
    failures
        .iter()
        .map(|f| match f.get("itemIdentifier") {
            Some(serde_json::Value::String(id)) if id.is_empty() => Err("an empty itemIdentifier".to_string()),
            Some(serde_json::Value::String(id)) if !message_ids.contains(&id.as_str()) => {
                Err(format!("itemIdentifier {id:?} names no message of the batch"))
            }
            Some(serde_json::Value::String(id)) => Ok(id.clone()),
            Some(other) => Err(format!("itemIdentifier {other} is not a message id")),
            None => Err(format!("a batch item failure without itemIdentifier: {f}")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_answer_is_read_as_lambdas_sqs_event_source_reads_it() {
        let ids = ["m-1", "m-2", "m-3"];
        let ok = |v: serde_json::Value| sqs_batch_item_failures(&v, &ids);
        // Complete successes: nothing stays.
        for answer in [
            serde_json::Value::Null,
            serde_json::json!({}),
            serde_json::json!({ "batchItemFailures": null }),
            serde_json::json!({ "batchItemFailures": [] }),
        ] {
            assert_eq!(ok(answer.clone()), Ok(Default::default()), "{answer}");
        }
        // A partial failure: the reported ones stay.
        assert_eq!(
            ok(serde_json::json!({ "batchItemFailures": [{ "itemIdentifier": "m-2" }, { "itemIdentifier": "m-3" }] })),
            Ok(["m-2".to_string(), "m-3".to_string()].into_iter().collect())
        );
        // Complete failures: one bad entry fails the whole batch, the good ones beside it too.
        for (answer, says) in [
            (
                serde_json::json!({ "batchItemFailures": [{ "itemIdentifier": "" }] }),
                "empty",
            ),
            (
                serde_json::json!({ "batchItemFailures": [{ "itemIdentifier": null }] }),
                "not a message id",
            ),
            (
                serde_json::json!({ "batchItemFailures": [{ "itemIdentifier": 7 }] }),
                "not a message id",
            ),
            (
                serde_json::json!({ "batchItemFailures": [{ "itemIdentifier": "m-1" }, { "messageId": "m-2" }] }),
                "without itemIdentifier",
            ),
            (
                serde_json::json!({ "batchItemFailures": [{ "itemIdentifier": "AQEB-receipt" }] }),
                "names no message",
            ),
            (serde_json::json!({ "batchItemFailures": "m-1" }), "not a list"),
        ] {
            let got = ok(answer.clone());
            assert!(got.as_ref().is_err_and(|e| e.contains(says)), "{answer}: {got:?}");
        }
    }

    const TEMPLATE: &str = "Globals:\n  Function:\n    Timeout: 60\nResources:\n  ScalerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Timeout: 1\n  ReconcilerFunction:\n    Type: AWS::Serverless::Function\n  InterruptionFunction:\n    Type: AWS::Serverless::Function\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";

    #[tokio::test(start_paused = true)]
    async fn an_invocation_sees_its_deadline_and_is_cut_off_there() {
        let mut lambda = Lambda::from_template(TEMPLATE).unwrap();
        // Within the timeout: the handler's answer, with a request id and the deadline a timeout
        // away.
        let before_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let seen = lambda
            .invoke(Principal::Reconciler, serde_json::json!({"n": 1}), |ev| async move {
                tokio::time::sleep(Duration::from_secs(59)).await;
                Ok(serde_json::json!({
                    "request_id": ev.context.request_id,
                    "deadline": ev.context.deadline,
                    "n": ev.payload["n"],
                }))
            })
            .await
            .unwrap();
        assert_eq!(seen["n"], 1);
        let deadline = seen["deadline"].as_u64().unwrap();
        assert!(
            (before_ms + 60_000..before_ms + 61_000).contains(&deadline),
            "{deadline} against {before_ms}"
        );
        let other = lambda
            .invoke(Principal::Reconciler, serde_json::json!({}), |ev| async move {
                Ok(serde_json::json!(ev.context.request_id))
            })
            .await
            .unwrap();
        assert_ne!(seen["request_id"], other, "each invocation has its own request id");
        // Past the timeout: cut off with Lambda's message, and counted.
        let ran_on = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran_on.clone();
        let err = lambda
            .invoke(Principal::Scaler, serde_json::json!({}), |_| {
                let flag = flag.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    Ok(serde_json::Value::Null)
                }
            })
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "Task timed out after 1.00 seconds");
        assert!(
            !ran_on.load(std::sync::atomic::Ordering::SeqCst),
            "nothing runs past the deadline"
        );
        assert_eq!(lambda.timed_out(), 1);
        let runs = lambda.runs();
        let scaler = runs.iter().find(|r| r.function == "scaler").unwrap();
        assert_eq!((scaler.invocations, scaler.timed_out, scaler.timeout_s), (1, 1, 1.0));
        assert!((scaler.longest_s - 1.0).abs() < 0.01, "{}", scaler.longest_s);
        let reconciler = runs.iter().find(|r| r.function == "reconciler").unwrap();
        assert_eq!((reconciler.invocations, reconciler.timed_out), (2, 0));
        assert!((reconciler.longest_s - 59.0).abs() < 0.01, "{}", reconciler.longest_s);
    }

    /// A template whose interruption function keeps Lambda's defaults (2 retries), scaler has 1
    /// retry and a 120 s event age, and reconciler none.
    const RETRIES: &str = "Resources:\n  ScalerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      EventInvokeConfig:\n        MaximumRetryAttempts: 2\n        MaximumEventAgeInSeconds: 120\n  ReconcilerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      EventInvokeConfig:\n        MaximumRetryAttempts: 0\n  InterruptionFunction:\n    Type: AWS::Serverless::Function\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";

    async fn malformed(_: LambdaEvent<serde_json::Value>) -> Result<serde_json::Value, HandlerError> {
        Err(HandlerError::NonRetryable("malformed event: no instance-id".into()))
    }

    fn runs_of(lambda: &Lambda, f: &str) -> FunctionRuns {
        lambda.runs().into_iter().find(|r| r.function == f).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_event_is_retried_after_lambdas_waits_then_dead_lettered() {
        let mut lambda = Lambda::from_template(RETRIES).unwrap();
        let event = serde_json::json!({"id": "e-1", "source": "aws.ec2"});
        let t0 = Instant::now();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = |seen: std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>| {
            move |ev: LambdaEvent<serde_json::Value>| {
                seen.lock()
                    .unwrap()
                    .push((ev.context.request_id.clone(), ev.payload.clone()));
                malformed(ev)
            }
        };
        assert!(lambda
            .invoke(Principal::Interruption, event.clone(), record(seen.clone()))
            .await
            .is_err());
        assert_eq!(lambda.pending_retries(), 1);
        assert!(lambda.take_dead_letters().is_empty());
        // Nothing before the first minute is up; the retry at one minute, the next two minutes
        // after that.
        assert!(lambda.due(t0 + Duration::from_secs(59)).is_empty());
        let mut at = Vec::new();
        for wait in [60, 120] {
            tokio::time::advance(Duration::from_secs(wait)).await;
            let due = lambda.due(Instant::now());
            assert_eq!(due.len(), 1, "after {wait} s more");
            at.push((Instant::now() - t0).as_secs());
            let r = due.into_iter().next().unwrap();
            assert!(lambda.retry(r, record(seen.clone())).await.is_err());
            assert!(lambda.due(Instant::now()).is_empty(), "one retry at a time");
        }
        assert_eq!(at, [60, 180]);
        // Each attempt saw the event unchanged, under the first attempt's request id.
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|(id, ev)| id == &seen[0].0 && ev == &event), "{seen:?}");
        // Retries spent: given up on, with the last error.
        assert_eq!(lambda.pending_retries(), 0);
        let dead = lambda.take_dead_letters();
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (
                dead[0].function,
                &dead[0].event,
                &dead[0].request_id,
                dead[0].invocations
            ),
            (Principal::Interruption, &event, &seen[0].0, 3)
        );
        assert_eq!(dead[0].error_message, "malformed event: no instance-id");
        assert!(lambda.take_dead_letters().is_empty(), "taken once");
        let runs = runs_of(&lambda, "interruption");
        assert_eq!(
            (
                runs.invocations,
                runs.failed,
                runs.retries,
                runs.dead_lettered,
                runs.max_retry_attempts
            ),
            (3, 3, 2, 1, 2)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_that_succeeds_on_its_retry_is_not_dead_lettered() {
        let mut lambda = Lambda::from_template(RETRIES).unwrap().with_retry_delays([6.0, 12.0]);
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let flaky = |calls: std::sync::Arc<std::sync::atomic::AtomicUsize>| {
            move |_: LambdaEvent<serde_json::Value>| {
                let calls = calls.clone();
                async move {
                    if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                        Err(HandlerError::Retryable("store: throttled".into()))
                    } else {
                        Ok(serde_json::json!({"ok": true}))
                    }
                }
            }
        };
        assert!(lambda
            .invoke(Principal::Submit, serde_json::json!({}), flaky(calls.clone()))
            .await
            .is_err());
        tokio::time::advance(Duration::from_secs(6)).await;
        let due = lambda.due(Instant::now());
        assert_eq!(due.len(), 1, "the scaled-down first wait");
        let out = lambda
            .retry(due.into_iter().next().unwrap(), flaky(calls.clone()))
            .await
            .unwrap();
        assert_eq!(out["ok"], true);
        assert_eq!(lambda.pending_retries(), 0);
        assert!(lambda.take_dead_letters().is_empty());
        let runs = runs_of(&lambda, "submit");
        assert_eq!(
            (runs.invocations, runs.failed, runs.retries, runs.dead_lettered),
            (2, 1, 1, 0)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_function_without_retries_dead_letters_at_once_and_an_old_event_is_not_retried() {
        let mut lambda = Lambda::from_template(RETRIES).unwrap();
        // MaximumRetryAttempts 0: given up on after its one attempt.
        assert!(lambda
            .invoke(Principal::Reconciler, serde_json::json!({"n": 1}), malformed)
            .await
            .is_err());
        assert_eq!(lambda.pending_retries(), 0);
        let dead = lambda.take_dead_letters();
        assert_eq!((dead.len(), dead[0].invocations), (1, 1));
        // The scaler keeps an event 120 s: its retry at 60 s runs, the one due at 180 s does not.
        assert!(lambda
            .invoke(Principal::Scaler, serde_json::json!({"n": 2}), malformed)
            .await
            .is_err());
        tokio::time::advance(Duration::from_secs(60)).await;
        let due = lambda.due(Instant::now());
        assert_eq!(due.len(), 1);
        assert!(lambda.retry(due.into_iter().next().unwrap(), malformed).await.is_err());
        tokio::time::advance(Duration::from_secs(120)).await;
        assert!(lambda.due(Instant::now()).is_empty(), "too old for a retry");
        let dead = lambda.take_dead_letters();
        assert_eq!((dead.len(), dead[0].invocations), (1, 2));
        assert_eq!(dead[0].event["n"], 2);
        let runs = runs_of(&lambda, "scaler");
        assert_eq!((runs.invocations, runs.retries, runs.dead_lettered), (2, 1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_synchronous_invocation_that_fails_is_neither_retried_nor_dead_lettered() {
        let mut lambda = Lambda::from_template(RETRIES).unwrap();
        assert!(lambda
            .invoke_sync(Principal::Submit, serde_json::json!({}), malformed)
            .await
            .is_err());
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(lambda.due(Instant::now()).is_empty());
        assert!(lambda.take_dead_letters().is_empty());
        let runs = runs_of(&lambda, "submit");
        assert_eq!(
            (runs.invocations, runs.failed, runs.retries, runs.dead_lettered),
            (1, 1, 0, 0)
        );
    }

    #[tokio::test]
    async fn every_nth_event_is_delivered_twice_each_time_under_a_request_id_of_its_own() {
        let mut lambda = Lambda::from_template(RETRIES).unwrap().with_duplicates(2);
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for n in 0..4 {
            let seen = seen.clone();
            let out = lambda
                .invoke(Principal::Interruption, serde_json::json!({ "n": n }), move |ev| {
                    seen.lock()
                        .unwrap()
                        .push((ev.payload["n"].as_i64().unwrap(), ev.context.request_id));
                    async { Ok(serde_json::json!({"ok": true})) }
                })
                .await;
            assert!(out.is_ok());
        }
        let seen = seen.lock().unwrap().clone();
        let events: Vec<i64> = seen.iter().map(|s| s.0).collect();
        assert_eq!(events, [0, 1, 1, 2, 3, 3], "the 2nd and 4th twice");
        let ids: std::collections::BTreeSet<&str> = seen.iter().map(|s| s.1.as_str()).collect();
        assert_eq!(ids.len(), 6, "each delivery its own request id");
        let runs = runs_of(&lambda, "interruption");
        assert_eq!((runs.invocations, runs.delivered_twice), (6, 2));
        // Synchronous invocations are not the asynchronous queue's: never twice.
        let mut lambda = Lambda::from_template(RETRIES).unwrap().with_duplicates(1);
        let out = lambda.invoke_sync(Principal::Submit, serde_json::json!({}), |_| async {
            Ok(serde_json::Value::Null)
        });
        assert!(out.await.is_ok());
        assert_eq!(runs_of(&lambda, "submit").invocations, 1);
    }

    #[test]
    fn an_error_message_is_cut_to_a_kilobyte_on_a_character_boundary() {
        let long = "é".repeat(600);
        let cut = truncate(&long, ERROR_MESSAGE_MAX_BYTES);
        assert_eq!(cut.len(), 1024);
        assert_eq!(truncate(&format!("x{long}"), ERROR_MESSAGE_MAX_BYTES).len(), 1023);
        assert_eq!(truncate("short", ERROR_MESSAGE_MAX_BYTES), "short");
    }

    #[test]
    fn the_shipped_template_gives_every_function_a_timeout() {
        let lambda = Lambda::from_template(onoff_iam::TEMPLATE).unwrap();
        let runs = lambda.runs();
        assert_eq!(runs.len(), 4);
        assert!(runs.iter().all(|r| r.timeout_s == 60.0), "{runs:?}");
        let retries: Vec<u32> = runs.iter().map(|r| r.max_retry_attempts).collect();
        assert_eq!(retries, [1, 0, 2, 2], "scaler, reconciler, interruption, submit");
    }
}
