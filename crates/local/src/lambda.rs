//! The four functions' invocations as Lambda runs them. Each gets a request id of its own and the
//! deadline its function's `Timeout` sets (template.yaml; `Context::deadline`, milliseconds since
//! the Unix epoch), and is cut off at that deadline wherever the handler is, as Lambda ends an
//! invocation ("Task timed out after 60.00 seconds"). Calling a handler with
//! `Context::default()` instead gave it no deadline at all: the reconcile lease fell back to a
//! configured TTL, and a run slower than its function's timeout passed here where Lambda would
//! have killed it half-way.

use std::future::Future;
use std::time::Duration;

use lambda_runtime::LambdaEvent;
use onoff_fn_common::HandlerError;
use onoff_iam::Principal;
use serde::Serialize;
use tokio::time::Instant;

/// One function's invocations in a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FunctionRuns {
    /// `scaler`, `reconciler`, `interruption` or `submit`.
    pub function: String,
    /// Its `Timeout` in template.yaml, seconds.
    pub timeout_s: f64,
    /// Invocations.
    pub invocations: usize,
    /// The longest, wall seconds (a timed-out one counts its timeout).
    pub longest_s: f64,
    /// Invocations cut off at their deadline. A green run has 0.
    pub timed_out: usize,
}

/// The functions of a run, each with its timeout and what its invocations took.
#[derive(Debug)]
pub struct Lambda {
    runs: Vec<(Principal, FunctionRuns)>,
    next_request: u64,
}

/// The principals that run in a function.
const FUNCTIONS: [Principal; 4] = [
    Principal::Scaler,
    Principal::Reconciler,
    Principal::Interruption,
    Principal::Submit,
];

impl Lambda {
    /// The four functions with the timeouts `template` gives them.
    ///
    /// # Errors
    /// A function is missing from the template or its `Timeout` is not a number of seconds.
    pub fn from_template(template: &str) -> Result<Self, onoff_iam::Error> {
        let runs = FUNCTIONS
            .into_iter()
            .map(|p| {
                let timeout_s = onoff_iam::function_timeout_s(template, p)?;
                let runs = FunctionRuns {
                    function: p.as_str().to_string(),
                    timeout_s,
                    ..FunctionRuns::default()
                };
                Ok((p, runs))
            })
            .collect::<Result<_, onoff_iam::Error>>()?;
        Ok(Self { runs, next_request: 0 })
    }

    /// Invoke `p`'s `handler` with `event` as Lambda would: a fresh request id, the deadline of
    /// its timeout, and the handler's future dropped at that deadline (an error, as Lambda reports
    /// the invocation failed).
    ///
    /// # Panics
    /// `p` is not one of the four functions.
    pub async fn invoke<Fut>(
        &mut self,
        p: Principal,
        event: serde_json::Value,
        handler: impl FnOnce(LambdaEvent<serde_json::Value>) -> Fut,
    ) -> Result<serde_json::Value, HandlerError>
    where
        Fut: Future<Output = Result<serde_json::Value, HandlerError>>,
    {
        self.next_request += 1;
        let (_, runs) = self
            .runs
            .iter_mut()
            .find(|r| r.0 == p)
            .unwrap_or_else(|| panic!("{} runs in no function", p.as_str()));
        let timeout = Duration::from_secs_f64(runs.timeout_s);
        let mut cx = lambda_runtime::Context::default();
        cx.request_id = format!("local-{}-{}", p.as_str(), self.next_request);
        let deadline = std::time::SystemTime::now() + timeout;
        cx.deadline = deadline
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let started = Instant::now();
        let r = tokio::time::timeout(timeout, handler(LambdaEvent::new(event, cx))).await;
        runs.invocations += 1;
        runs.longest_s = runs.longest_s.max(started.elapsed().as_secs_f64());
        r.unwrap_or_else(|_| {
            runs.timed_out += 1;
            Err(HandlerError::Retryable(format!(
                "Task timed out after {:.2} seconds",
                timeout.as_secs_f64()
            )))
        })
    }

    /// Each function's invocations so far.
    #[must_use]
    pub fn runs(&self) -> Vec<FunctionRuns> {
        self.runs.iter().map(|r| r.1.clone()).collect()
    }

    /// Invocations cut off at their deadline, all functions.
    #[must_use]
    pub fn timed_out(&self) -> usize {
        self.runs.iter().map(|r| r.1.timed_out).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            .invoke(Principal::Scaler, serde_json::json!({}), |_| async move {
                tokio::time::sleep(Duration::from_secs(2)).await;
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok(serde_json::Value::Null)
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

    #[test]
    fn the_shipped_template_gives_every_function_a_timeout() {
        let lambda = Lambda::from_template(onoff_iam::TEMPLATE).unwrap();
        let runs = lambda.runs();
        assert_eq!(runs.len(), 4);
        assert!(runs.iter().all(|r| r.timeout_s == 60.0), "{runs:?}");
    }
}
