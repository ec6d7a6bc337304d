//! A record of every AWS call a component makes: one JSON line per request attempt, naming the
//! principal, the operation, the request (method, URI, body) and the response status. `onoff
//! local` records every component's calls, counts the refused ones (HTTP 403: `AccessDenied`,
//! `InvalidClientTokenId`, ...) and evaluates each against template.yaml's policies
//! (`onoff_iam::to_requests`). Off unless asked for: deployed functions and agents record nothing.
//!
//! The agent records when `ONOFF_CALL_LOG` (a file path, appended to) is set, under the principal
//! `ONOFF_PRINCIPAL` (default `worker`).

use std::io::Write;
use std::sync::{Arc, Mutex};

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeTransmitInterceptorContextRef, FinalizerInterceptorContextRef,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};

/// The request of the attempt under way (the orchestrator hands the request itself to the HTTP
/// client, so it is copied before transmission and completed with the status after).
#[derive(Debug, Clone)]
struct Pending(CallRecord);

impl Storable for Pending {
    type Storer = StoreReplace<Self>;
}

/// Request bodies longer than this are cut (uploads: only the operation and URI matter).
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// One recorded call, as a JSON line.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CallRecord {
    /// `scaler`, `reconciler`, `interruption`, `submit`, `worker/<instance-id>`, `job/<job-id>`.
    pub principal: String,
    /// Signing name of the service, lower case: `dynamodb`, `sqs`, `s3`, `ec2`, `sts`.
    pub service: String,
    /// SDK operation name, e.g. `UpdateItem`.
    pub operation: String,
    /// HTTP method.
    pub method: String,
    /// Full request URI.
    pub uri: String,
    /// Request body as text, cut at [`MAX_BODY_BYTES`]; empty for streamed bodies.
    pub body: String,
    /// HTTP status of the response; 0 when none came (a connection error).
    pub status: u16,
}

/// Where recorded calls go: a file shared by every client of the process.
#[derive(Debug, Clone)]
pub struct CallLog {
    file: Arc<Mutex<std::fs::File>>,
}

impl CallLog {
    /// Start `path` empty (a log left by an earlier run is dropped), then append to it as
    /// [`CallLog::open`] does: what one run reads back is that run's calls only.
    ///
    /// # Errors
    /// The file cannot be created.
    pub fn create(path: &std::path::Path) -> std::io::Result<Self> {
        std::fs::File::create(path)?;
        Self::open(path)
    }

    /// Append to `path` (created if missing).
    ///
    /// # Errors
    /// The file cannot be opened.
    pub fn open(path: &std::path::Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Arc::new(Mutex::new(file)),
        })
    }

    /// An interceptor recording as `principal`.
    #[must_use]
    pub fn recorder(&self, principal: &str) -> CallRecorder {
        CallRecorder {
            principal: principal.to_string(),
            log: self.clone(),
        }
    }

    fn write(&self, rec: &CallRecord) {
        if let Ok(mut line) = serde_json::to_string(rec) {
            line.push('\n');
            if let Ok(mut f) = self.file.lock() {
                // One write per line: processes appending to one log (O_APPEND) do not interleave.
                // Best effort: a full disk must not fail the call being recorded.
                let _ = f.write_all(line.as_bytes());
            }
        }
    }
}

/// The SDK interceptor that writes a [`CallRecord`] after each attempt.
#[derive(Debug, Clone)]
pub struct CallRecorder {
    principal: String,
    log: CallLog,
}

/// The recorder the environment asks for: `ONOFF_CALL_LOG` (path) as `ONOFF_PRINCIPAL`.
#[must_use]
pub fn from_env() -> Option<CallRecorder> {
    let path = std::env::var_os("ONOFF_CALL_LOG")?;
    let principal = std::env::var("ONOFF_PRINCIPAL").unwrap_or_else(|_| "worker".into());
    match CallLog::open(std::path::Path::new(&path)) {
        Ok(log) => Some(log.recorder(&principal)),
        Err(e) => {
            tracing::warn!(path = ?path, error = %e, "cannot open the call log: not recording");
            None
        }
    }
}

impl Intercept for CallRecorder {
    fn name(&self) -> &'static str {
        "onoff-call-recorder"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let req = context.request();
        let (service, operation) = cfg
            .load::<Metadata>()
            .map(|m| (m.service().to_ascii_lowercase(), m.name().to_string()))
            .unwrap_or_default();
        let body = req
            .body()
            .bytes()
            .map(|b| String::from_utf8_lossy(&b[..b.len().min(MAX_BODY_BYTES)]).into_owned())
            .unwrap_or_default();
        cfg.interceptor_state().store_put(Pending(CallRecord {
            principal: self.principal.clone(),
            service,
            operation,
            method: req.method().to_string(),
            uri: req.uri().to_string(),
            body,
            status: 0,
        }));
        Ok(())
    }

    fn read_after_attempt(
        &self,
        context: &FinalizerInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if let Some(Pending(mut rec)) = cfg.load::<Pending>().cloned() {
            rec.status = context.response().map_or(0, |r| r.status().as_u16());
            self.log.write(&rec);
        }
        Ok(())
    }
}

/// Read a call log written by [`CallLog`]; lines that do not parse are skipped.
///
/// # Errors
/// The file cannot be read.
pub fn read_log(path: &std::path::Path) -> std::io::Result<Vec<CallRecord>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(principal: &str) -> CallRecord {
        CallRecord {
            principal: principal.into(),
            service: "sqs".into(),
            operation: "SendMessage".into(),
            method: "POST".into(),
            uri: "http://127.0.0.1/".into(),
            body: String::new(),
            status: 200,
        }
    }

    #[test]
    fn a_new_run_starts_its_log_empty_while_other_writers_append() {
        let dir = std::env::temp_dir().join(format!("onoff-calllog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("calls.jsonl");
        // An earlier run's log.
        CallLog::open(&path).unwrap().write(&record("old"));
        // A new run: its own log, and an agent appending to the same file.
        let run = CallLog::create(&path).unwrap();
        run.write(&record("scaler"));
        CallLog::open(&path).unwrap().write(&record("worker/i-1"));
        let principals: Vec<String> = read_log(&path).unwrap().into_iter().map(|r| r.principal).collect();
        assert_eq!(principals, ["scaler", "worker/i-1"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
