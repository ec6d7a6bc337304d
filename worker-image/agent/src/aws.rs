//! The agent's ports on AWS: IMDSv2 (aws-config's client: session token, retries), the lane
//! queues on SQS, the workers table on DynamoDB, inputs on S3, TerminateInstances on itself.

use std::path::Path;
use std::time::Duration;

use aws_config::imds::client::error::ImdsError;
use onoff_aws::queue::SqsQueues;
use onoff_aws::state::DynamoWorkers;
use onoff_control::job::parse_s3_uri;
use onoff_control::ports::{StoreError, WorkerRecord, WorkerRegistry};
use onoff_policy::WorkerState;
use tokio::io::AsyncWriteExt;

use crate::config::ShutdownMode;
use crate::ports::{
    Identity, Inbox, Instance, JobCredentials, Message, Metadata, Notice, Objects, Registry, SessionError,
};

/// IMDSv2 through aws-config's client. The endpoint is IMDS's, or
/// `AWS_EC2_METADATA_SERVICE_ENDPOINT` when set (the local runner gives each agent its own).
#[derive(Debug, Clone)]
pub struct Imds(aws_config::imds::Client);

impl Imds {
    /// A client for `endpoint` (`None`: the default IMDS address).
    ///
    /// # Errors
    /// A malformed endpoint.
    pub fn new(endpoint: Option<&str>) -> Result<Self, String> {
        let mut b = aws_config::imds::Client::builder()
            .max_attempts(2)
            .connect_timeout(Duration::from_secs(1))
            .read_timeout(Duration::from_secs(2));
        if let Some(e) = endpoint {
            b = b.endpoint(e).map_err(|err| format!("IMDS endpoint {e:?}: {err}"))?;
        }
        Ok(Self(b.build()))
    }

    async fn get(&self, path: &str) -> Result<Option<String>, String> {
        match self.0.get(path).await {
            Ok(v) => Ok(Some(v.as_ref().to_string())),
            Err(ImdsError::ErrorResponse(r)) if r.response().status().as_u16() == 404 => Ok(None),
            Err(e) => Err(format!("IMDS {path}: {e}")),
        }
    }

    async fn need(&self, path: &str) -> Result<String, String> {
        self.get(path).await?.ok_or_else(|| format!("IMDS {path}: not found"))
    }
}

impl Metadata for Imds {
    async fn identity(&self) -> Result<Identity, String> {
        Ok(Identity {
            instance_id: self.need("/latest/meta-data/instance-id").await?,
            instance_type: self.need("/latest/meta-data/instance-type").await?,
            zone: self.need("/latest/meta-data/placement/availability-zone").await?,
            lifecycle: self
                .get("/latest/meta-data/instance-life-cycle")
                .await?
                .unwrap_or_else(|| "on-demand".into()),
        })
    }

    async fn notice(&self) -> Result<Option<Notice>, String> {
        if let Some(body) = self.get("/latest/meta-data/spot/instance-action").await? {
            let v: serde_json::Value =
                serde_json::from_str(&body).map_err(|e| format!("spot/instance-action {body:?}: {e}"))?;
            return Ok(Some(Notice::SpotInterruption {
                action: v["action"].as_str().unwrap_or("terminate").to_string(),
                time: v["time"].as_str().unwrap_or_default().to_string(),
            }));
        }
        if let Some(body) = self.get("/latest/meta-data/events/recommendations/rebalance").await? {
            let v: serde_json::Value =
                serde_json::from_str(&body).map_err(|e| format!("events/recommendations/rebalance {body:?}: {e}"))?;
            return Ok(Some(Notice::Rebalance {
                time: v["noticeTime"].as_str().unwrap_or_default().to_string(),
            }));
        }
        Ok(None)
    }
}

/// The lane queues on SQS.
#[derive(Debug, Clone)]
pub struct SqsInbox(pub SqsQueues);

impl Inbox for SqsInbox {
    async fn receive(&self, lane: &str, wait_s: u32, visibility_s: u32) -> Result<Option<Message>, String> {
        let got = self
            .0
            .receive(lane, 1, wait_s, visibility_s)
            .await
            .map_err(|e| e.to_string())?;
        Ok(got.into_iter().next().map(|m| Message {
            lane: lane.to_string(),
            message_id: m.message_id,
            receipt: m.receipt,
            body: m.body,
            receive_count: m.receive_count,
        }))
    }

    async fn set_visibility(&self, lane: &str, receipt: &str, visibility_s: u32) -> Result<(), String> {
        self.0
            .set_visibility(lane, receipt, visibility_s)
            .await
            .map_err(|e| e.to_string())
    }

    async fn delete(&self, lane: &str, receipt: &str) -> Result<(), String> {
        self.0.delete(lane, receipt).await.map_err(|e| e.to_string())
    }

    async fn requeue(&self, lane: &str, receipt: &str, body: &str, delay_s: u32) -> Result<(), String> {
        self.0
            .send(lane, body, delay_s.min(900))
            .await
            .map_err(|e| e.to_string())?;
        self.0.delete(lane, receipt).await.map_err(|e| e.to_string())
    }
}

impl onoff_control::ports::JobQueue for SqsInbox {
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String> {
        onoff_control::ports::JobQueue::send(&self.0, lane, body, delay_s.min(900)).await
    }
}

/// The workers table on DynamoDB.
#[derive(Debug, Clone)]
pub struct DynamoRegistry(pub DynamoWorkers);

impl Registry for DynamoRegistry {
    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        WorkerRegistry::get(&self.0, id).await
    }
    async fn register(&self, record: WorkerRecord) -> Result<(), StoreError> {
        self.0.register_launch(record).await
    }
    async fn mark_busy(&self, id: &str, now: f64) -> Result<bool, StoreError> {
        self.0.mark_busy(id, now).await
    }
    async fn heartbeat(
        &self,
        id: &str,
        state: WorkerState,
        idle_since: Option<f64>,
        now: f64,
    ) -> Result<(), StoreError> {
        if state == WorkerState::Terminating {
            // Deregistering (also starts the row's TTL), never over a Stopped row.
            return self
                .0
                .set_state_if(id, state, &crate::ports::DEREGISTER_FROM)
                .await
                .map(|_| ());
        }
        self.0.heartbeat(id, state, idle_since, now).await
    }
    async fn set_cached_projects(&self, id: &str, projects: &[String]) -> Result<(), StoreError> {
        self.0.set_cached_projects(id, projects).await
    }
}

/// Job inputs and outputs on S3, job logs on CloudWatch Logs, job sessions from STS.
#[derive(Debug, Clone)]
pub struct S3Objects {
    /// S3.
    pub s3: aws_sdk_s3::Client,
    /// STS, for the jobs' sessions.
    pub sts: aws_sdk_sts::Client,
    /// `ONOFF_JOB_ROLE_ARN`: the role each job's session is of (template.yaml `JobRole`); none:
    /// jobs get no AWS credentials.
    pub job_role_arn: Option<String>,
    /// The deployment bucket (the jobs' checkpoints and outputs).
    pub bucket: String,
    /// CloudWatch Logs and `ONOFF_LOG_GROUP`, the group each attempt's output goes to (a stream
    /// `<job_id>/<attempt>` each); none: job output stays in the agent's own log only.
    pub logs: Option<(aws_sdk_cloudwatchlogs::Client, String)>,
    /// Streams created so far.
    pub streams: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

/// CloudWatch Logs' limits on one PutLogEvents call: events, bytes (each event counts its size
/// plus 26 bytes) and the time a batch spans, ms (PutLogEvents, API Reference); an event's
/// message is at most 256 KiB less the 26 ("CloudWatch Logs quotas"; the API Reference now says
/// 1 MB, and regions that keep the older figure refuse more).
const LOG_BATCH_EVENTS: usize = 10_000;
const LOG_BATCH_BYTES: usize = 1_048_576;
const LOG_EVENT_BYTES: usize = 256 * 1024 - 26;
const LOG_BATCH_SPAN_MS: i64 = 24 * 3600 * 1000;

/// `lines` (unix seconds, text) as PutLogEvents batches of (unix ms, message): in chronological
/// order (lines of one time keep their order), a line longer than an event takes split into
/// consecutive events of its time at character boundaries (nothing lost), an empty line sent as
/// one space (CloudWatch Logs refuses an empty message), each batch within
/// [`LOG_BATCH_EVENTS`], [`LOG_BATCH_BYTES`] and [`LOG_BATCH_SPAN_MS`].
fn log_batches(lines: &[(f64, String)]) -> Vec<Vec<(i64, String)>> {
    let mut events: Vec<(i64, String)> = Vec::with_capacity(lines.len());
    for (at, line) in lines {
        let ms = (at * 1000.0) as i64;
        let mut rest = line.as_str();
        if rest.is_empty() {
            events.push((ms, " ".to_string()));
        }
        while !rest.is_empty() {
            let mut cut = rest.len().min(LOG_EVENT_BYTES);
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            events.push((ms, rest[..cut].to_string()));
            rest = &rest[cut..];
        }
    }
    events.sort_by_key(|(ms, _)| *ms);
    let mut batches = Vec::new();
    let mut batch: Vec<(i64, String)> = Vec::new();
    let mut bytes = 0;
    for (ms, text) in events {
        let size = text.len() + 26;
        let full = batch.len() == LOG_BATCH_EVENTS
            || bytes + size > LOG_BATCH_BYTES
            || batch.first().is_some_and(|(first, _)| ms - first > LOG_BATCH_SPAN_MS);
        if full {
            batches.push(std::mem::take(&mut batch));
            bytes = 0;
        }
        bytes += size;
        batch.push((ms, text));
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches
}

/// Whether STS's error `code` refuses the session policy itself, whatever the moment: the
/// packed policy is too large, or the policy is malformed (STS API Reference, AssumeRole,
/// "Errors").
fn session_policy_refused(code: &str) -> bool {
    matches!(code, "PackedPolicyTooLarge" | "MalformedPolicyDocument")
}

/// A job's session lasts one hour: the longest STS allows when a role session (the worker's)
/// assumes another role ("role chaining", IAM User Guide).
pub const JOB_SESSION_S: i32 = 3600;

impl Objects for S3Objects {
    async fn upload_outputs(&self, job_id: &str, dir: &Path) -> Result<usize, String> {
        onoff_aws::checkpoints::S3Checkpoints::new(self.s3.clone(), self.bucket.clone())
            .upload_dir(dir, &format!("outputs/{job_id}/"))
            .await
            .map_err(|e| e.to_string())
    }

    async fn log_lines(&self, stream: &str, lines: &[(f64, String)]) -> Result<(), String> {
        use aws_sdk_cloudwatchlogs::error::ProvideErrorMetadata;
        use aws_sdk_cloudwatchlogs::types::InputLogEvent;
        let Some((client, group)) = &self.logs else {
            return Ok(());
        };
        let created = self.streams.lock().map(|s| s.contains(stream)).unwrap_or(false);
        if !created {
            match client
                .create_log_stream()
                .log_group_name(group)
                .log_stream_name(stream)
                .send()
                .await
            {
                Ok(_) => {}
                Err(e) if e.code() == Some("ResourceAlreadyExistsException") => {}
                Err(e) => {
                    return Err(format!(
                        "create log stream {group}/{stream}: {}",
                        onoff_aws::errors::describe(&e)
                    ))
                }
            }
            if let Ok(mut s) = self.streams.lock() {
                s.insert(stream.to_string());
            }
        }
        for batch in log_batches(lines) {
            let events = batch
                .into_iter()
                .filter_map(|(ms, text)| InputLogEvent::builder().timestamp(ms).message(text).build().ok())
                .collect();
            let out = client
                .put_log_events()
                .log_group_name(group)
                .log_stream_name(stream)
                .set_log_events(Some(events))
                .send()
                .await
                .map_err(|e| format!("put log events {group}/{stream}: {}", onoff_aws::errors::describe(&e)))?;
            // The call succeeds with events it did not take (too old, too far ahead, before the
            // group's retention): say so rather than lose them without a word.
            if let Some(r) = out.rejected_log_events_info() {
                tracing::warn!(
                    stream,
                    too_old_end = ?r.too_old_log_event_end_index(),
                    too_new_start = ?r.too_new_log_event_start_index(),
                    expired_end = ?r.expired_log_event_end_index(),
                    "CloudWatch Logs rejected some of a job's output lines"
                );
            }
        }
        Ok(())
    }

    async fn download(&self, uri: &str, dest: &Path) -> Result<(), String> {
        let (bucket, key) = parse_s3_uri(uri).ok_or_else(|| format!("{uri} is not s3://bucket/key"))?;
        let mut obj = self
            .s3
            .get_object()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| onoff_aws::errors::describe(&e))?;
        let mut file = tokio::fs::File::create(dest).await.map_err(|e| e.to_string())?;
        while let Some(chunk) = obj.body.try_next().await.map_err(|e| e.to_string())? {
            file.write_all(&chunk).await.map_err(|e| e.to_string())?;
        }
        file.flush().await.map_err(|e| e.to_string())
    }

    async fn job_session(&self, job_id: &str, input: Option<&str>) -> Result<Option<JobCredentials>, SessionError> {
        use aws_sdk_sts::error::ProvideErrorMetadata;
        let Some(role) = &self.job_role_arn else {
            return Ok(None);
        };
        let partition = role.split(':').nth(1).unwrap_or("aws");
        let input = input.and_then(parse_s3_uri);
        let policy = onoff_control::boundary::job_session_policy(partition, &self.bucket, job_id, input);
        let policy = onoff_control::boundary::session_policy_text(&policy)
            .map_err(|e| SessionError::Refused(format!("job session: {e}")))?;
        let out = self
            .sts
            .assume_role()
            .role_arn(role)
            .role_session_name(onoff_control::boundary::job_session_name(job_id))
            .policy(policy)
            .duration_seconds(JOB_SESSION_S)
            .send()
            .await
            .map_err(|e| {
                let why = format!("job session ({role}): {}", onoff_aws::errors::describe(&e));
                if e.code().is_some_and(session_policy_refused) {
                    SessionError::Refused(why)
                } else {
                    SessionError::Failed(why)
                }
            })?;
        let c = out
            .credentials()
            .ok_or_else(|| SessionError::Failed("job session: STS returned no credentials".into()))?;
        let expiration = c
            .expiration()
            .fmt(aws_sdk_sts::primitives::DateTimeFormat::DateTime)
            .map_err(|e| SessionError::Failed(format!("job session: expiration: {e}")))?;
        Ok(Some(JobCredentials {
            access_key_id: c.access_key_id().to_string(),
            secret_access_key: c.secret_access_key().to_string(),
            session_token: c.session_token().to_string(),
            expiration,
            lifetime_s: f64::from(JOB_SESSION_S),
        }))
    }
}

/// TerminateInstances on itself; with [`ShutdownMode::Terminate`], `shutdown -h now` when the API
/// call fails (the launch template's instance-initiated shutdown behaviour is terminate).
#[derive(Debug, Clone)]
pub struct Ec2Instance {
    /// EC2 client.
    pub client: aws_sdk_ec2::Client,
    /// Fallback policy.
    pub mode: ShutdownMode,
    /// The deployment (`ONOFF_DEPLOYMENT`): a persistent request the control plane launched is
    /// tagged `onoff:managed` with it, and only such a request is this agent's to cancel.
    pub deployment: String,
}

impl Ec2Instance {
    /// Cancel the persistent spot request this instance was launched from, if any: terminated
    /// (or shut down) with its request open, EC2 would launch another in its place ("If you
    /// terminate a running or stopped Spot Instance that was launched by a persistent Spot
    /// Instance request, the Spot Instance request transitions to the open state so that a new
    /// Spot Instance can be launched", EC2 User Guide), and with the control plane gone nobody
    /// would end that one. A one-time or on-demand instance has none. Only the requests tagged
    /// for the deployment are looked up: an instant fleet's spot instance has an untagged
    /// one-time request, which needs no cancel and which the worker role may not cancel (every
    /// such agent's cancel was an AccessDenied).
    async fn cancel_own_spot_request(&self, id: &str) -> Result<(), String> {
        let requests: Vec<String> = self
            .client
            .describe_spot_instance_requests()
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name("instance-id")
                    .values(id)
                    .build(),
            )
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name(format!("tag:{}", onoff_aws::fleet::TAG_MANAGED))
                    .values(&self.deployment)
                    .build(),
            )
            .send()
            .await
            .map_err(|e| {
                format!(
                    "DescribeSpotInstanceRequests {id}: {}",
                    aws_sdk_ec2::error::DisplayErrorContext(e)
                )
            })?
            .spot_instance_requests()
            .iter()
            .filter_map(|r| r.spot_instance_request_id().map(str::to_string))
            .collect();
        if requests.is_empty() {
            return Ok(());
        }
        self.client
            .cancel_spot_instance_requests()
            .set_spot_instance_request_ids(Some(requests.clone()))
            .send()
            .await
            .map(|_| tracing::info!(?requests, "cancelled this instance's persistent spot request"))
            .map_err(|e| {
                format!(
                    "CancelSpotInstanceRequests {requests:?}: {}",
                    aws_sdk_ec2::error::DisplayErrorContext(e)
                )
            })
    }
}

impl Instance for Ec2Instance {
    async fn release_request(&self, id: &str) -> Result<(), String> {
        self.cancel_own_spot_request(id).await
    }

    async fn terminate_self(&self, id: &str) -> Result<(), String> {
        if let Err(e) = self.cancel_own_spot_request(id).await {
            // Terminated all the same: an idle instance left running costs more for certain than
            // a replacement EC2 may launch, whose own agent ends it again.
            tracing::error!(error = %e, "cancel this instance's spot request");
        }
        let api = self
            .client
            .terminate_instances()
            .instance_ids(id)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| {
                format!(
                    "TerminateInstances {id}: {}",
                    aws_sdk_ec2::error::DisplayErrorContext(e)
                )
            });
        match (api, self.mode) {
            (Ok(()), _) => Ok(()),
            (Err(e), ShutdownMode::Terminate) => {
                tracing::error!(error = %e, "TerminateInstances failed: powering off (terminates the instance)");
                let status = tokio::process::Command::new("shutdown")
                    .args(["-h", "now"])
                    .status()
                    .await
                    .map_err(|se| format!("{e}; shutdown -h now: {se}"))?;
                if status.success() {
                    Ok(())
                } else {
                    Err(format!("{e}; shutdown -h now exited {status}"))
                }
            }
            (Err(e), _) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within_limits(batches: &[Vec<(i64, String)>]) {
        for b in batches {
            assert!(b.len() <= LOG_BATCH_EVENTS);
            assert!(b.iter().map(|(_, m)| m.len() + 26).sum::<usize>() <= LOG_BATCH_BYTES);
            assert!(b.iter().all(|(_, m)| !m.is_empty() && m.len() <= LOG_EVENT_BYTES));
            assert!(b.windows(2).all(|w| w[0].0 <= w[1].0));
            assert!(b.last().unwrap().0 - b[0].0 <= LOG_BATCH_SPAN_MS);
        }
    }

    /// Every byte of every line arrives, in order, within PutLogEvents' limits: a line of 856 KiB
    /// is split into events (at a character boundary: the 3-byte `€` straddles the first cut),
    /// an empty line is one space, lines out of order are sorted, and a day later starts a batch.
    #[test]
    fn a_long_line_is_split_not_cut_and_lines_go_in_time_order() {
        let long = format!("{}€{}", "a".repeat(LOG_EVENT_BYTES - 1), "b".repeat(600 * 1024));
        let lines = [
            (10.0, long.clone()),
            (5.0, String::new()),
            (10.0, "after".to_string()),
            (10.0 + 86_401.0, "next day".to_string()),
        ];
        let batches = log_batches(&lines);
        within_limits(&batches);
        assert_eq!(
            batches.len(),
            2,
            "{:?}",
            batches.iter().map(Vec::len).collect::<Vec<_>>()
        );
        let events: Vec<&(i64, String)> = batches.iter().flatten().collect();
        assert_eq!(events.len(), 7);
        assert_eq!(events[0], &(5_000, " ".to_string()));
        let pieces: Vec<&str> = events[1..5].iter().map(|(_, m)| m.as_str()).collect();
        assert!(events[1..5].iter().all(|(ms, _)| *ms == 10_000));
        assert_eq!(pieces.concat(), long);
        assert_eq!(
            pieces[0].len(),
            LOG_EVENT_BYTES - 1,
            "cut before the straddling character"
        );
        assert_eq!(events[5], &(10_000, "after".to_string()));
        assert_eq!(batches[1], [(86_411_000, "next day".to_string())]);
    }

    /// 10,001 lines of one second make two calls: 10,000 events, then one.
    #[test]
    fn a_batch_holds_at_most_ten_thousand_events() {
        let lines: Vec<(f64, String)> = (0..10_001).map(|i| (20.0, format!("{i}"))).collect();
        let batches = log_batches(&lines);
        within_limits(&batches);
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [10_000, 1]);
        let texts: Vec<String> = batches.into_iter().flatten().map(|(_, m)| m).collect();
        assert!(texts.iter().enumerate().all(|(i, m)| *m == i.to_string()));
    }
}
