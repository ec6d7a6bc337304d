//! The jobs table on DynamoDB ([`JobStore`]): every state change a conditional update, the claim
//! a lease taken in one write, error records for submissions that could not become jobs.
//!
//! Item (key `job_id`): `spec` (the spec as JSON), `state`, `attempts`, `hand_backs`,
//! `lease_expiries`, `lease_owner`, `lease_expires_at`, `last_checkpoint`, `sent_at`, `cost_usd`,
//! `source`, `created_at`, `reason`, `finished_at`, `lane`, `project`, `cancel_requested`,
//! `claimed_at`, `attempt_log` (a list of JSON texts, one [`onoff_control::job::AttemptRecord`]
//! each, appended as attempts end), `outputs` (a map: `attempt`, `files`, `at`, maybe `error`:
//! [`onoff_control::job::OutputsRecord`]); `active_lane` (the lane)
//! only while the job is not finished, which makes the [`ACTIVE_INDEX`] sparse: listing the
//! active jobs reads only them, however long the history. A job whose run ended it gets `run_s`
//! and `run_lane` (the lane) with `finished_at`, which makes the [`RUN_TIMES_INDEX`] sparse in
//! the same way. A finished job gets `expires_at`
//! ([`FINISHED_JOB_TTL_S`] later) for the table's TTL. Error records use the key
//! `error#<source>` with `reason`, `created_at` and `expires_at`.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::{AttributeValue, KeysAndAttributes, ReturnValue};
use onoff_control::job::{bounded_reason, JobSpec, JobState, OutputsRecord, Settle, CANCELLED_REASON};
use onoff_control::ports::{
    ArrivalRecord, CancelOutcome, Claim, Created, JobQueue, JobRecord, JobStore, Listing, Renewal, StoreError,
};

use crate::dynamo::{batch_get, condition_failed, epoch_s, n, s, store_error, BATCH_GET_MAX_KEYS};

/// Key of an item, for error messages.
fn key_of(item: &HashMap<String, AttributeValue>) -> String {
    item.get("job_id")
        .and_then(|v| v.as_s().ok())
        .cloned()
        .unwrap_or_else(|| "?".into())
}
use crate::queue::SqsQueues;

/// How long an error record is kept, seconds (30 days).
pub const ERROR_RECORD_TTL_S: f64 = 30.0 * 86_400.0;

/// How long a finished job's row is kept after it finished, seconds (90 days: a quarter of cost
/// and history for the operator).
pub const FINISHED_JOB_TTL_S: f64 = 90.0 * 86_400.0;

/// The sparse global secondary index of active jobs: partition key `active_lane`, sort key
/// `job_id`, every attribute projected. template.yaml and [`crate::provision`] create it.
pub const ACTIVE_INDEX: &str = "active";

/// The global secondary index of every job by lane and creation time: partition key `lane`,
/// sort key `created_at`, `spec` projected (a job's row changes its state, never these three, so
/// its state changes write nothing to the index). The reconciler reads the arrivals of the
/// policy's look-back and those since its last run from it (finished jobs too, which the
/// [`ACTIVE_INDEX`] drops). Error records have no `lane` and are not in it. template.yaml and
/// [`crate::provision`] create it.
pub const ARRIVALS_INDEX: &str = "arrivals";

/// The sparse global secondary index of the run times of finished jobs, by lane and finishing
/// time: partition key `run_lane`, sort key `finished_at`, `run_s` projected. Only the settle that
/// ends a job's run writes `run_lane` (the job's lane) with `run_s` and `finished_at`
/// ([`onoff_control::job::Settle::run_s`]), so a job that finished without a run (cancelled while
/// queued, failed on its lost leases) is not in it: a mass cancel cannot push a lane's run times
/// out of the newest `Limit` the reconciler reads (a `FilterExpression` would be applied after
/// the `Limit`, DynamoDB Developer Guide, "Filter expressions for the Query operation"). The
/// reconciler reads a lane's last run times from it, newest first: the estimate of an undeclared
/// job's run time. A job finishes once, so each job is written to it at most once.
/// template.yaml and [`crate::provision`] create it.
pub const RUN_TIMES_INDEX: &str = "run_times";

/// Parse an item of the [`ARRIVALS_INDEX`].
fn arrival_from_item(item: &HashMap<String, AttributeValue>) -> Result<ArrivalRecord, StoreError> {
    let id = key_of(item);
    let bad = |k: &str| StoreError::Malformed(format!("job item {id} lacks a valid {k}"));
    let spec = item
        .get("spec")
        .and_then(|v| v.as_s().ok())
        .and_then(|t| serde_json::from_str::<JobSpec>(t).ok())
        .ok_or_else(|| bad("spec"))?;
    let created_at = item
        .get("created_at")
        .and_then(|v| v.as_n().ok())
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or_else(|| bad("created_at"))?;
    Ok(ArrivalRecord { id, created_at, spec })
}

/// Parse a stored job item.
///
/// # Errors
/// [`StoreError::Other`] naming the attribute that is missing or malformed.
pub fn record_from_item(item: &HashMap<String, AttributeValue>) -> Result<JobRecord, StoreError> {
    let text = |k: &str| item.get(k).and_then(|v| v.as_s().ok()).cloned();
    let num = |k: &str| {
        item.get(k)
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let bad = |k: &str| {
        StoreError::Malformed(format!(
            "job item {} lacks a valid {k}",
            text("job_id").unwrap_or_else(|| "?".into())
        ))
    };
    let spec: JobSpec = serde_json::from_str(&text("spec").ok_or_else(|| bad("spec"))?).map_err(|_| bad("spec"))?;
    Ok(JobRecord {
        id: text("job_id").ok_or_else(|| bad("job_id"))?,
        spec,
        state: text("state")
            .as_deref()
            .and_then(JobState::parse)
            .ok_or_else(|| bad("state"))?,
        attempts: num("attempts").unwrap_or(0.0) as u32,
        hand_backs: num("hand_backs").unwrap_or(0.0) as u32,
        lease_expiries: num("lease_expiries").unwrap_or(0.0) as u32,
        lease_owner: text("lease_owner"),
        lease_expires_at: num("lease_expires_at"),
        last_checkpoint: text("last_checkpoint"),
        sent_at: num("sent_at"),
        cost_usd: num("cost_usd").unwrap_or(0.0),
        source: text("source").unwrap_or_default(),
        created_at: num("created_at").ok_or_else(|| bad("created_at"))?,
        reason: text("reason"),
        finished_at: num("finished_at"),
        run_s: num("run_s"),
        cancel_requested: item
            .get("cancel_requested")
            .and_then(|v| v.as_bool().ok())
            .copied()
            .unwrap_or(false),
        claimed_at: num("claimed_at"),
        attempt_log: item
            .get("attempt_log")
            .and_then(|v| v.as_l().ok())
            .map(|l| {
                l.iter()
                    .filter_map(|e| e.as_s().ok())
                    .map(|s| serde_json::from_str(s).map_err(|_| bad("attempt_log")))
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?
            .unwrap_or_default(),
        outputs: match item.get("outputs") {
            None => None,
            Some(v) => Some(outputs_from(v).ok_or_else(|| bad("outputs"))?),
        },
    })
}

/// The `outputs` map of a job item: `attempt`, `files`, `at` (numbers) and maybe `error`.
fn outputs_from(v: &AttributeValue) -> Option<OutputsRecord> {
    let m = v.as_m().ok()?;
    let num = |k: &str| m.get(k)?.as_n().ok()?.parse::<f64>().ok();
    Some(OutputsRecord {
        attempt: num("attempt")? as u32,
        files: num("files")? as u32,
        error: m.get("error").and_then(|e| e.as_s().ok()).cloned(),
        at: num("at")?,
    })
}

/// The jobs table.
#[derive(Debug, Clone)]
pub struct DynamoJobs {
    client: aws_sdk_dynamodb::Client,
    table: String,
    /// Emulators only: rows created less than this many seconds ago are left out of
    /// [`JobStore::active`] ([`DynamoJobs::set_index_lag_s`]).
    index_lag_s: f64,
}

impl DynamoJobs {
    /// The table called `table`.
    pub fn new(client: aws_sdk_dynamodb::Client, table: impl Into<String>) -> Self {
        Self {
            client,
            table: table.into(),
            index_lag_s: 0.0,
        }
    }

    /// Against an emulator, list the `active` index as AWS may: a global secondary index is
    /// eventually consistent (a write reaches it "within a fraction of a second" in normal
    /// conditions, DynamoDB Developer Guide, "Read consistency"), and moto's indexes are
    /// immediate. From now on, [`JobStore::active`] leaves out the rows created less than
    /// `lag_s` seconds ago by this process's clock (their `created_at`): a job just submitted is
    /// not listed yet. Only new rows are held back; a changed row is listed as it is. 0 (the
    /// default): listed as the emulator answers.
    pub fn set_index_lag_s(&mut self, lag_s: f64) {
        self.index_lag_s = lag_s.max(0.0);
    }

    /// The reason stored for a rejected submission from `key`, if any.
    ///
    /// # Errors
    /// Store failures.
    pub async fn error_record(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.raw_string(onoff_control::job::error_record_id(key), "reason", "get error record")
            .await
    }

    /// String attribute `name` of the item keyed `job_id` = `key`, read consistently and raw (an
    /// error record, or a job row that may not parse); `what` names the read in an error.
    async fn raw_string(&self, key: String, name: &str, what: &str) -> Result<Option<String>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("job_id", s(key))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| store_error(what, &e))?;
        Ok(out
            .item()
            .and_then(|i| i.get(name))
            .and_then(|v| v.as_s().ok())
            .cloned())
    }

    async fn state_of(&self, id: &str) -> Result<Option<JobState>, StoreError> {
        Ok(self.get(id).await?.map(|r| r.state))
    }
}

impl JobStore for DynamoJobs {
    async fn create(&self, r: &JobRecord) -> Result<Created, StoreError> {
        let spec = serde_json::to_string(&r.spec).map_err(|e| StoreError::Other(format!("encode spec: {e}")))?;
        let res = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("job_id", s(&r.id))
            .item("spec", s(spec))
            .item("state", s(r.state.as_str()))
            .item("attempts", n(f64::from(r.attempts)))
            .item("hand_backs", n(f64::from(r.hand_backs)))
            .item("lease_expiries", n(f64::from(r.lease_expiries)))
            .item("cost_usd", n(r.cost_usd))
            .item("active_lane", s(&r.spec.lane))
            .item("source", s(&r.source))
            .item("created_at", n(r.created_at))
            .item("lane", s(&r.spec.lane))
            .item("project", s(&r.spec.project))
            .condition_expression("attribute_not_exists(job_id)")
            .send()
            .await;
        match res {
            Ok(_) => Ok(Created::New),
            Err(e) if condition_failed(&e) => match self.get(&r.id).await? {
                Some(existing) => Ok(Created::Existing(Box::new(existing))),
                None => Err(StoreError::Conflict(format!("{} exists but cannot be read", r.id))),
            },
            Err(e) => Err(store_error("create job", &e)),
        }
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| store_error("get job", &e))?;
        out.item().map(record_from_item).transpose()
    }

    async fn get_many(&self, ids: &[String]) -> Result<Listing<JobRecord>, StoreError> {
        let mut unique: Vec<&String> = ids.iter().collect();
        // BatchGetItem refuses a request that names a key twice (a ValidationException).
        unique.sort_unstable();
        unique.dedup();
        let mut out = Listing::default();
        for chunk in unique.chunks(BATCH_GET_MAX_KEYS) {
            let keys = chunk
                .iter()
                .map(|id| HashMap::from([("job_id".to_string(), s(id.as_str()))]))
                .collect();
            let items = batch_get(
                "get jobs",
                keys,
                |keys| async move {
                    let request = KeysAndAttributes::builder()
                        .set_keys(Some(keys))
                        .consistent_read(true)
                        .build()
                        .map_err(|e| StoreError::Other(format!("get jobs: {e}")))?;
                    let answer = self
                        .client
                        .batch_get_item()
                        .request_items(&self.table, request)
                        .send()
                        .await
                        .map_err(|e| store_error("get jobs", &e))?;
                    let items = answer
                        .responses()
                        .and_then(|r| r.get(&self.table))
                        .cloned()
                        .unwrap_or_default();
                    let left = answer
                        .unprocessed_keys()
                        .and_then(|u| u.get(&self.table))
                        .map(|k| k.keys().to_vec())
                        .unwrap_or_default();
                    Ok((items, left))
                },
                tokio::time::sleep,
            )
            .await?;
            for item in items {
                match record_from_item(&item) {
                    Ok(r) => out.items.push(r),
                    Err(e) => out.unreadable.push((key_of(&item), e.to_string())),
                }
            }
        }
        Ok(out)
    }

    async fn mark_sent(&self, id: &str, at: f64) -> Result<(), StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .update_expression("SET sent_at = :t")
            .condition_expression("attribute_exists(job_id)")
            .expression_attribute_values(":t", n(at))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Err(StoreError::NotFound(id.into())),
            Err(e) => Err(store_error("record wake-up message", &e)),
        }
    }

    async fn transition(&self, id: &str, from: JobState, to: JobState) -> Result<(), StoreError> {
        if !from.can_go(to) {
            return Err(StoreError::Conflict(format!(
                "{} -> {} is not a job transition",
                from.as_str(),
                to.as_str()
            )));
        }
        let update = if to == JobState::Running {
            "SET #s = :to"
        } else if to.is_final() {
            "SET #s = :to REMOVE lease_owner, lease_expires_at, active_lane"
        } else {
            "SET #s = :to REMOVE lease_owner, lease_expires_at"
        };
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .update_expression(update)
            .condition_expression("#s = :from")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":to", s(to.as_str()))
            .expression_attribute_values(":from", s(from.as_str()))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => match self.state_of(id).await? {
                None => Err(StoreError::NotFound(id.into())),
                // Already there: the SDK's retry of this very write, whose first answer was lost
                // (or another's move to the same state). Either way the job is where it was
                // asked to be.
                Some(now) if now == to => Ok(()),
                Some(now) => Err(StoreError::Conflict(format!(
                    "{id} is {}, not {}",
                    now.as_str(),
                    from.as_str()
                ))),
            },
            Err(e) => Err(store_error("transition job", &e)),
        }
    }

    async fn claim(&self, id: &str, owner: &str, lease_until: f64, now: f64) -> Result<Claim, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .update_expression(
                "SET #s = :run, lease_owner = :o, lease_expires_at = :u, claimed_at = :now ADD attempts :one",
            )
            .expression_attribute_values(":now", n(now))
            .condition_expression("attribute_exists(job_id) AND (#s = :q OR #s = :r)")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":run", s(JobState::Running.as_str()))
            .expression_attribute_values(":q", s(JobState::Queued.as_str()))
            .expression_attribute_values(":r", s(JobState::Retrying.as_str()))
            .expression_attribute_values(":o", s(owner))
            .expression_attribute_values(":u", n(lease_until))
            .expression_attribute_values(":one", n(1.0))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match res {
            Ok(out) => match out.attributes() {
                Some(item) => Ok(Claim::Claimed(Box::new(record_from_item(item)?))),
                None => Err(StoreError::Other(format!("claim of {id} returned no item"))),
            },
            // Refused: by the row as it is, or by this very claim, written on an earlier try whose
            // answer was lost (the SDK retried it; `claimed_at` is this claim's own time).
            Err(e) if condition_failed(&e) => Ok(match self.get(id).await? {
                None => Claim::Unknown,
                Some(r)
                    if r.state == JobState::Running
                        && r.lease_owner.as_deref() == Some(owner)
                        && r.claimed_at == Some(now) =>
                {
                    Claim::Claimed(Box::new(r))
                }
                Some(r) => Claim::NotClaimable(r.state),
            }),
            Err(e) => Err(store_error("claim job", &e)),
        }
    }

    async fn record_error(&self, key: &str, reason: &str, now: f64) -> Result<(), StoreError> {
        let res = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("job_id", s(onoff_control::job::error_record_id(key)))
            .item("reason", s(reason))
            .item("created_at", n(now))
            .item("expires_at", epoch_s(now + ERROR_RECORD_TTL_S))
            .condition_expression("attribute_not_exists(job_id)")
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("record submission error", &e)),
        }
    }

    async fn active(&self) -> Result<Listing<JobRecord>, StoreError> {
        let mut out = Listing::default();
        let not_before = if self.index_lag_s > 0.0 {
            crate::state::unix_now() - self.index_lag_s
        } else {
            f64::INFINITY
        };
        let mut pages = self
            .client
            .scan()
            .table_name(&self.table)
            .index_name(ACTIVE_INDEX)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| store_error("scan active jobs", &e))?;
            for item in page.items() {
                match record_from_item(item) {
                    // The index is eventually consistent: a row that just finished may linger.
                    Ok(r) if r.state.is_final() => {}
                    // One not there yet on AWS (an emulator's lag, `set_index_lag_s`).
                    Ok(r) if r.created_at > not_before => {}
                    Ok(r) => out.items.push(r),
                    Err(e) => out.unreadable.push((key_of(item), e.to_string())),
                }
            }
        }
        Ok(out)
    }

    async fn arrivals(&self, lane: &str, after: f64) -> Result<Listing<ArrivalRecord>, StoreError> {
        let mut out = Listing::default();
        let mut pages = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(ARRIVALS_INDEX)
            .key_condition_expression("#l = :l AND #c > :a")
            .expression_attribute_names("#l", "lane")
            .expression_attribute_names("#c", "created_at")
            .expression_attribute_values(":l", s(lane))
            .expression_attribute_values(":a", n(after))
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| store_error("query arrivals", &e))?;
            for item in page.items() {
                match arrival_from_item(item) {
                    Ok(a) => out.items.push(a),
                    Err(e) => out.unreadable.push((key_of(item), e.to_string())),
                }
            }
        }
        // The index sorts by creation time; ties (same number) in any order: by id here, as the fake.
        out.items
            .sort_by(|a, b| a.created_at.total_cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
        Ok(out)
    }

    async fn finished_run_times(&self, lane: &str, limit: u32) -> Result<Vec<f64>, StoreError> {
        // One page: `Limit` items at most, newest first (a run asks for tens).
        let page = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(RUN_TIMES_INDEX)
            .key_condition_expression("run_lane = :l")
            .expression_attribute_values(":l", s(lane))
            .scan_index_forward(false)
            .limit(i32::try_from(limit).unwrap_or(i32::MAX).max(1))
            .send()
            .await
            .map_err(|e| store_error("query run_times", &e))?;
        Ok(page
            .items()
            .iter()
            .filter_map(|item| item.get("run_s")?.as_n().ok()?.parse::<f64>().ok())
            .filter(|r| r.is_finite() && *r >= 0.0)
            .collect())
    }

    async fn record_progress(
        &self,
        id: &str,
        owner: &str,
        checkpoint: Option<&str>,
        cost_usd: f64,
    ) -> Result<(), StoreError> {
        self.progress(id, owner, checkpoint, cost_usd).await
    }
    async fn renew(&self, id: &str, owner: &str, lease_until: f64) -> Result<Renewal, StoreError> {
        // The renewal tells the lease holder about a cancel: the item as written comes back
        // (ALL_NEW; UPDATED_NEW would leave out an attribute the update did not change). A write
        // is charged by the item's size anyway, so this costs no extra capacity.
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .update_expression("SET lease_expires_at = :u")
            .condition_expression("#s = :run AND lease_owner = :o")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":run", s(JobState::Running.as_str()))
            .expression_attribute_values(":o", s(owner))
            .expression_attribute_values(":u", n(lease_until))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match res {
            Ok(out) => Ok(Renewal {
                cancel_requested: out
                    .attributes()
                    .and_then(|a| a.get("cancel_requested"))
                    .and_then(|v| v.as_bool().ok())
                    .copied()
                    .unwrap_or(false),
            }),
            Err(e) if condition_failed(&e) => {
                Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}")))
            }
            Err(e) => Err(store_error("renew job lease", &e)),
        }
    }

    async fn finish(&self, id: &str, owner: &str, settle: &Settle, now: f64) -> Result<(), StoreError> {
        if !JobState::Running.can_go(settle.to) {
            return Err(StoreError::Conflict(format!(
                "RUNNING -> {} is not an end of an attempt",
                settle.to.as_str()
            )));
        }
        let lease = |settle: &Settle| {
            self.settle_request(id, settle, now)
                .condition_expression(format!("#s = :run AND lease_owner = :o{}", not_cancelled(settle)))
                .expression_attribute_values(":o", s(owner))
        };
        match lease(settle).send().await {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => {
                // A cancel asked for since the claim: end it CANCELLED instead, still only under
                // this lease. Or this settle itself, written on an earlier try whose answer was
                // lost (the SDK retried it): done.
                match self.get(id).await? {
                    Some(r) if settle.written_on(&r) => Ok(()),
                    Some(r) if r.cancel_requested && r.lease_owner.as_deref() == Some(owner) => {
                        match lease(&cancelled(settle)).send().await {
                            Ok(_) => Ok(()),
                            Err(e) if condition_failed(&e) => match self.get(id).await? {
                                Some(r) if cancelled(settle).written_on(&r) => Ok(()),
                                _ => Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}"))),
                            },
                            Err(e) => Err(store_error("finish cancelled job", &e)),
                        }
                    }
                    _ => Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}"))),
                }
            }
            Err(e) => Err(store_error("finish job attempt", &e)),
        }
    }

    async fn record_outputs(&self, id: &str, outputs: &OutputsRecord) -> Result<(), StoreError> {
        let mut map = HashMap::from([
            ("attempt".to_string(), n(f64::from(outputs.attempt))),
            ("files".to_string(), n(f64::from(outputs.files))),
            ("at".to_string(), n(outputs.at)),
        ]);
        if let Some(e) = &outputs.error {
            map.insert("error".into(), s(bounded_reason(e.clone())));
        }
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .update_expression("SET #out = :o")
            // The row exists (an update would create it), and holds no later attempt's record.
            .condition_expression("attribute_exists(job_id) AND (attribute_not_exists(#out) OR #out.#att <= :n)")
            .expression_attribute_names("#out", "outputs")
            .expression_attribute_names("#att", "attempt")
            .expression_attribute_values(":o", AttributeValue::M(map))
            .expression_attribute_values(":n", n(f64::from(outputs.attempt)))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => match self.get(id).await? {
                None => Err(StoreError::NotFound(id.into())),
                Some(r) => Err(StoreError::Conflict(format!(
                    "{id} holds the outputs of attempt {}, later than {}",
                    r.outputs.map_or(0, |o| o.attempt),
                    outputs.attempt
                ))),
            },
            Err(e) => Err(store_error("record job outputs", &e)),
        }
    }

    async fn request_cancel(&self, id: &str, now: f64) -> Result<CancelOutcome, StoreError> {
        // A few rounds: the job may move between our writes (claimed, settled, re-queued).
        for _ in 0..5 {
            let waiting = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("job_id", s(id))
                .update_expression("SET #s = :c, reason = :why, finished_at = :now, expires_at = :ttl REMOVE active_lane, lease_owner, lease_expires_at")
                .condition_expression("#s = :q OR #s = :r")
                .expression_attribute_names("#s", "state")
                .expression_attribute_values(":c", s(JobState::Cancelled.as_str()))
                .expression_attribute_values(":q", s(JobState::Queued.as_str()))
                .expression_attribute_values(":r", s(JobState::Retrying.as_str()))
                .expression_attribute_values(":why", s(CANCELLED_REASON))
                .expression_attribute_values(":now", n(now))
                .expression_attribute_values(":ttl", epoch_s(now + FINISHED_JOB_TTL_S))
                .send()
                .await;
            match waiting {
                Ok(_) => return Ok(CancelOutcome::Cancelled),
                Err(e) if condition_failed(&e) => {}
                Err(e) => return Err(store_error("cancel job", &e)),
            }
            let running = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("job_id", s(id))
                .update_expression("SET cancel_requested = :yes")
                .condition_expression("#s = :run")
                .expression_attribute_names("#s", "state")
                .expression_attribute_values(":run", s(JobState::Running.as_str()))
                .expression_attribute_values(":yes", AttributeValue::Bool(true))
                .send()
                .await;
            match running {
                Ok(_) => return Ok(CancelOutcome::Requested),
                Err(e) if condition_failed(&e) => {}
                Err(e) => return Err(store_error("request job cancel", &e)),
            }
            match self.get(id).await? {
                None => return Ok(CancelOutcome::Unknown),
                // This very cancel, applied on an earlier try whose answer was lost (the SDK
                // retried it): its own end time is on the row.
                Some(r) if r.state == JobState::Cancelled && r.finished_at == Some(now) => {
                    return Ok(CancelOutcome::Cancelled)
                }
                Some(r) if r.state.is_final() => return Ok(CancelOutcome::AlreadyFinished(r.state)),
                Some(_) => {}
            }
        }
        Err(StoreError::Conflict(format!("{id} kept changing state; try again")))
    }

    async fn fail_waiting(&self, seen: &JobRecord, reason: &str, now: f64) -> Result<bool, StoreError> {
        let reason = bounded_reason(reason.to_string());
        // As `seen` read the row: pending, and no attempt claimed, ended or handed back since
        // (the attempt log is a list: `size` is its number of entries).
        let log = if seen.attempt_log.is_empty() {
            "(attribute_not_exists(attempt_log) OR size(attempt_log) = :n)"
        } else {
            "size(attempt_log) = :n"
        };
        // And no fresh wake-up message since (a deferral, which changes no count, sends one).
        let sent = match seen.sent_at {
            Some(_) => "sent_at = :sent",
            None => "attribute_not_exists(sent_at)",
        };
        let mut update = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(&seen.id))
            .update_expression(
                "SET #s = :failed, reason = :why, finished_at = :now, expires_at = :ttl \
                 REMOVE active_lane, lease_owner, lease_expires_at",
            )
            .condition_expression(format!(
                "(#s = :q OR #s = :r) AND attempts = :a AND hand_backs = :h AND lease_expiries = :x AND {log} AND {sent}"
            ))
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":failed", s(JobState::Failed.as_str()))
            .expression_attribute_values(":q", s(JobState::Queued.as_str()))
            .expression_attribute_values(":r", s(JobState::Retrying.as_str()))
            .expression_attribute_values(":a", n(f64::from(seen.attempts)))
            .expression_attribute_values(":h", n(f64::from(seen.hand_backs)))
            .expression_attribute_values(":x", n(f64::from(seen.lease_expiries)))
            .expression_attribute_values(":n", n(seen.attempt_log.len() as f64))
            .expression_attribute_values(":why", s(&reason))
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":ttl", epoch_s(now + FINISHED_JOB_TTL_S));
        if let Some(t) = seen.sent_at {
            update = update.expression_attribute_values(":sent", n(t));
        }
        let res = update.send().await;
        match res {
            Ok(_) => Ok(true),
            // Written on an earlier try whose answer was lost (its own end time and reason are on
            // the row), or the job moved on.
            Err(e) if condition_failed(&e) => Ok(self.get(&seen.id).await?.is_some_and(|r| {
                r.state == JobState::Failed
                    && r.finished_at == Some(now)
                    && r.reason.as_deref() == Some(reason.as_str())
            })),
            Err(e) => Err(store_error("fail waiting job", &e)),
        }
    }

    async fn fail_unreadable(&self, id: &str, owner: &str, reason: &str, now: f64) -> Result<(), StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .update_expression(
                "SET #s = :failed, reason = :why, finished_at = :now, expires_at = :ttl \
                 REMOVE lease_owner, lease_expires_at, claimed_at, active_lane",
            )
            .condition_expression("#s = :run AND lease_owner = :o")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":failed", s(JobState::Failed.as_str()))
            .expression_attribute_values(":run", s(JobState::Running.as_str()))
            .expression_attribute_values(":o", s(owner))
            .expression_attribute_values(":why", s(onoff_control::job::bounded_reason(reason.to_string())))
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":ttl", epoch_s(now + FINISHED_JOB_TTL_S))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            // Written on an earlier try whose answer was lost: done. Read raw: the row does not
            // parse.
            Err(e) if condition_failed(&e) => match self.raw_string(id.to_string(), "state", "read job state").await? {
                Some(st) if st == JobState::Failed.as_str() => Ok(()),
                _ => Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}"))),
            },
            Err(e) => Err(store_error("fail unreadable job", &e)),
        }
    }

    async fn requeue_lost(
        &self,
        id: &str,
        owner: &str,
        lease_expires_at: f64,
        settle: &Settle,
        now: f64,
    ) -> Result<(), StoreError> {
        if !matches!(settle.to, JobState::Queued | JobState::Failed | JobState::Cancelled) {
            return Err(StoreError::Conflict(format!(
                "a lost lease ends in QUEUED, FAILED or CANCELLED, not {}",
                settle.to.as_str()
            )));
        }
        let lease = |settle: &Settle| {
            self.settle_request(id, settle, now)
                .condition_expression(format!(
                    "#s = :run AND lease_owner = :o AND lease_expires_at = :e{}",
                    not_cancelled(settle)
                ))
                .expression_attribute_values(":o", s(owner))
                .expression_attribute_values(":e", n(lease_expires_at))
        };
        let changed = || StoreError::Conflict(format!("the lease of {id} changed since it was seen"));
        match lease(settle).send().await {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => match self.get(id).await? {
                // Written on an earlier try whose answer was lost (the SDK retried it): done.
                Some(r) if settle.written_on(&r) => Ok(()),
                Some(r)
                    if r.cancel_requested
                        && r.lease_owner.as_deref() == Some(owner)
                        && r.lease_expires_at == Some(lease_expires_at) =>
                {
                    match lease(&cancelled(settle)).send().await {
                        Ok(_) => Ok(()),
                        Err(e) if condition_failed(&e) => match self.get(id).await? {
                            Some(r) if cancelled(settle).written_on(&r) => Ok(()),
                            _ => Err(changed()),
                        },
                        Err(e) => Err(store_error("cancel job with a lost lease", &e)),
                    }
                }
                _ => Err(changed()),
            },
            Err(e) => Err(store_error("re-queue job with a lost lease", &e)),
        }
    }
}

/// The extra condition of a settle other than SUCCEEDED or CANCELLED: no cancel asked for (else
/// the store ends it CANCELLED instead, [`cancelled`]), as [`JobStore::finish`] promises: a job
/// the user cancelled ends CANCELLED unless it succeeded, not FAILED (a failure at the attempt
/// limit, a fatal one, a lease lost for the last time) nor waiting again. Before, only a settle
/// that was not final carried it, so a cancelled job whose attempt then failed for the last time
/// ended FAILED on DynamoDB while the fake (and the docs) ended it CANCELLED.
fn not_cancelled(settle: &Settle) -> &'static str {
    if checks_cancel(settle) {
        " AND (attribute_not_exists(cancel_requested) OR cancel_requested = :no)"
    } else {
        ""
    }
}

/// Whether `settle` carries [`not_cancelled`]'s condition (and its `:no` value).
fn checks_cancel(settle: &Settle) -> bool {
    !matches!(settle.to, JobState::Succeeded | JobState::Cancelled)
}

/// `settle` turned CANCELLED (a cancel asked for while the attempt ran).
fn cancelled(settle: &Settle) -> Settle {
    Settle {
        to: JobState::Cancelled,
        reason: Some(CANCELLED_REASON.into()),
        ..settle.clone()
    }
}

impl DynamoJobs {
    /// The update that ends a lease as `settle` says; the caller adds the condition on the lease.
    fn settle_request(
        &self,
        id: &str,
        settle: &Settle,
        now: f64,
    ) -> aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder {
        let mut set = vec!["#s = :to", "attempts = :a", "hand_backs = :h", "lease_expiries = :x"];
        let mut remove = vec!["lease_owner", "lease_expires_at", "claimed_at"];
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":run", s(JobState::Running.as_str()))
            .expression_attribute_values(":to", s(settle.to.as_str()))
            .expression_attribute_values(":a", n(f64::from(settle.attempts)))
            .expression_attribute_values(":h", n(f64::from(settle.hand_backs)))
            .expression_attribute_values(":x", n(f64::from(settle.lease_expiries)));
        if let Some(r) = &settle.reason {
            set.push("reason = :why");
            req = req.expression_attribute_values(":why", s(r));
        }
        if checks_cancel(settle) {
            req = req.expression_attribute_values(":no", AttributeValue::Bool(false));
        }
        if let Some(a) = &settle.attempt {
            set.push("attempt_log = list_append(if_not_exists(attempt_log, :none), :entry)");
            let entry = serde_json::to_string(a).unwrap_or_default();
            req = req
                .expression_attribute_values(":none", AttributeValue::L(Vec::new()))
                .expression_attribute_values(":entry", AttributeValue::L(vec![s(entry)]));
        }
        if settle.to.is_final() {
            set.extend(["finished_at = :now", "expires_at = :ttl"]);
            remove.push("active_lane");
            req = req
                .expression_attribute_values(":now", n(now))
                .expression_attribute_values(":ttl", epoch_s(now + FINISHED_JOB_TTL_S));
            if let Some(r) = settle.run_s() {
                set.push("run_s = :rt, run_lane = :rl");
                req = req
                    .expression_attribute_values(":rt", n(r))
                    .expression_attribute_values(":rl", s(&settle.lane));
            }
        }
        req.update_expression(format!("SET {} REMOVE {}", set.join(", "), remove.join(", ")))
    }
}

impl DynamoJobs {
    async fn progress(&self, id: &str, owner: &str, checkpoint: Option<&str>, cost_usd: f64) -> Result<(), StoreError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("job_id", s(id))
            .condition_expression("lease_owner = :o")
            .expression_attribute_values(":o", s(owner))
            .expression_attribute_values(":c", n(cost_usd));
        req = match checkpoint {
            Some(c) => req
                .update_expression("SET last_checkpoint = :k, cost_usd = :c")
                .expression_attribute_values(":k", s(c)),
            None => req.update_expression("SET cost_usd = :c"),
        };
        match req.send().await {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => {
                Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}")))
            }
            Err(e) => Err(store_error("record job progress", &e)),
        }
    }
}

impl onoff_control::ports::Backlog for SqsQueues {
    async fn backlog(&self, lane: &str) -> Result<onoff_policy::LaneBacklog, String> {
        SqsQueues::backlog(self, lane).await.map_err(|e| e.to_string())
    }
}

impl JobQueue for SqsQueues {
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String> {
        SqsQueues::send(self, lane, body, delay_s)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
