//! Control-plane state on DynamoDB: the workers table ([`WorkerRegistry`]) and the control table
//! ([`OfferingAvailability`]). Every write is conditional, so a transition happens once however
//! many invocations race for it.
//!
//! Workers table (key `instance_arn`, the instance's ARN, so IAM can let an instance write only
//! its own row with `dynamodb:LeadingKeys`): `instance_id`, `lane`, `instance_type`, `zone`, `capacity_type`,
//! `price_usd_per_h`, `state`, `launched_at`, `project`, `pinned_job`, and `ended_at` and `expires_at` (TTL)
//! once a worker is terminating; `closed_runs_s` (seconds it ran in its runs a stop ended) and,
//! while its last run is ended by a stop, `stopped_at` (`onoff cost` prices a worker's instance
//! time with them, [`instance_run_s`]). Control table (key `pk`): `unavailable#<type>#<zone>#<capacity>` items with
//! `until` and `expires_at`; `lease#<name>` items with `owner` and `until`; `event#<id>` items (with `expires_at`) for events already handled;
//! `arrivals#<lane>` items with `folded_to` and `stats` (the lane's [`ArrivalStats`] as JSON).

use std::collections::HashMap;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValuesOnConditionCheckFailure};

use crate::dynamo::{condition_failed, epoch_s, n, s, store_error};
use onoff_control::ports::{
    ArrivalStats, Asks, Listing, OfferingAvailability, ScaleAsk, StoreError, WorkerRecord, WorkerRegistry,
    MAX_ASKED_JOBS, MAX_ASKED_JOB_ID_BYTES, MAX_CACHED_PROJECTS, MAX_KEPT_ASKED_JOBS,
};
use onoff_policy::{CapacityType, OfferingKey, UnavailableOffering, WorkerState};

/// How long a finished worker's row is kept before DynamoDB's TTL removes it, seconds (7 days).
pub const FINISHED_ROW_TTL_S: f64 = 7.0 * 86_400.0;

/// Seconds a worker row's instance has run, so far or in all (its instance time billed at its
/// price, for `onoff cost`'s idle workers): the runs a stop ended (`closed_runs_s`, 0 when
/// absent), plus the last run, from `launched_at` to its stop (`stopped_at`: none, it is
/// counted in `closed_runs_s`), to `ended_at` once the worker is terminating, else to `now`
/// (unix seconds). A stopped instance bills its volume only, which this does not count. `None`
/// without `launched_at`.
pub fn instance_run_s(item: &HashMap<String, AttributeValue>, now: f64) -> Option<f64> {
    let launched = number(item, "launched_at")?;
    let closed = number(item, "closed_runs_s").unwrap_or(0.0);
    let last = if number(item, "stopped_at").is_some() {
        0.0
    } else {
        (number(item, "ended_at").unwrap_or(now) - launched).max(0.0)
    };
    Some(closed + last)
}

/// Name of a worker state as stored.
pub fn state_name(state: WorkerState) -> &'static str {
    match state {
        WorkerState::Pending => "Pending",
        WorkerState::Running => "Running",
        WorkerState::Idle => "Idle",
        WorkerState::Draining => "Draining",
        WorkerState::Terminating => "Terminating",
        WorkerState::Stopped => "Stopped",
    }
}

/// Parse a stored worker state.
pub fn parse_state(name: &str) -> Option<WorkerState> {
    Some(match name {
        "Pending" => WorkerState::Pending,
        "Running" => WorkerState::Running,
        "Idle" => WorkerState::Idle,
        "Draining" => WorkerState::Draining,
        "Terminating" => WorkerState::Terminating,
        "Stopped" => WorkerState::Stopped,
        _ => return None,
    })
}

/// The key attribute of the workers table: the instance's ARN.
pub const WORKER_KEY: &str = "instance_arn";

/// The workers table.
#[derive(Debug, Clone)]
pub struct DynamoWorkers {
    client: aws_sdk_dynamodb::Client,
    table: String,
    arn_prefix: String,
    now: fn() -> f64,
}

/// Unix seconds now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl DynamoWorkers {
    /// The table called `table`, whose rows are keyed by `instance_arn_prefix` + instance id
    /// (`arn:aws:ec2:<region>:<account>:instance/`, `ONOFF_INSTANCE_ARN_PREFIX`).
    pub fn new(
        client: aws_sdk_dynamodb::Client,
        table: impl Into<String>,
        instance_arn_prefix: impl Into<String>,
    ) -> Self {
        Self {
            client,
            table: table.into(),
            arn_prefix: instance_arn_prefix.into(),
            now: unix_now,
        }
    }

    /// The key of instance `id`'s row: its ARN.
    #[must_use]
    pub fn key_of(&self, id: &str) -> AttributeValue {
        s(format!("{}{id}", self.arn_prefix))
    }

    async fn get_record(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(WORKER_KEY, self.key_of(id))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| store_error("get worker", &e))?;
        out.item().map(record_from_item).transpose()
    }
}

fn record_from_item(item: &HashMap<String, AttributeValue>) -> Result<WorkerRecord, StoreError> {
    let text = |k: &str| item.get(k).and_then(|v| v.as_s().ok()).cloned();
    let num = |k: &str| {
        item.get(k)
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let bad = |k: &str| StoreError::Other(format!("worker row lacks a valid {k}"));
    let capacity_type = match text("capacity_type").as_deref() {
        Some("spot") => CapacityType::Spot,
        Some("on-demand") => CapacityType::OnDemand,
        _ => return Err(bad("capacity_type")),
    };
    Ok(WorkerRecord {
        id: text("instance_id").ok_or_else(|| bad("instance_id"))?,
        lane: text("lane").ok_or_else(|| bad("lane"))?,
        offering: OfferingKey {
            instance_type: text("instance_type").ok_or_else(|| bad("instance_type"))?,
            zone: text("zone").ok_or_else(|| bad("zone"))?,
            capacity_type,
        },
        price_usd_per_h: num("price_usd_per_h").ok_or_else(|| bad("price_usd_per_h"))?,
        state: text("state")
            .as_deref()
            .and_then(parse_state)
            .ok_or_else(|| bad("state"))?,
        launched_at: num("launched_at").ok_or_else(|| bad("launched_at"))?,
        project: text("project"),
        idle_since: num("idle_since"),
        heartbeat_at: num("heartbeat_at"),
        pinned_job: text("pinned_job"),
        hold_until: num("hold_until"),
        spot_price_usd_per_h: num("spot_price_usd_per_h"),
        run_time_estimate_s: num("run_time_estimate_s"),
        min_job_gpus: num("min_job_gpus")
            .filter(|g| g.fract() == 0.0 && (1.0..=f64::from(u16::MAX)).contains(g))
            .map(|g| g as u32),
        // A list of names; anything else in it (a row written by hand) is skipped.
        cached_projects: item
            .get("cached_projects")
            .and_then(|v| v.as_l().ok())
            .map(|l| l.iter().filter_map(|v| v.as_s().ok().cloned()).collect())
            .unwrap_or_default(),
    })
}

/// `projects` as a row's `cached_projects`: the first [`MAX_CACHED_PROJECTS`] as a list of
/// strings; `None` for none (the attribute is then left out).
fn cached_projects_value(projects: &[String]) -> Option<AttributeValue> {
    (!projects.is_empty()).then(|| AttributeValue::L(projects.iter().take(MAX_CACHED_PROJECTS).map(s).collect()))
}

impl WorkerRegistry for DynamoWorkers {
    async fn register_launch(&self, r: WorkerRecord) -> Result<(), StoreError> {
        let mut req = self
            .client
            .put_item()
            .table_name(&self.table)
            .item(WORKER_KEY, self.key_of(&r.id))
            .item("instance_id", s(&r.id))
            .item("lane", s(&r.lane))
            .item("instance_type", s(&r.offering.instance_type))
            .item("zone", s(&r.offering.zone))
            .item("capacity_type", s(r.offering.capacity_type.as_str()))
            .item("price_usd_per_h", n(r.price_usd_per_h))
            .item("state", s(state_name(r.state)))
            .item("launched_at", n(r.launched_at))
            .condition_expression("attribute_not_exists(instance_id)");
        if let Some(p) = &r.project {
            req = req.item("project", s(p));
        }
        if let Some(j) = &r.pinned_job {
            req = req.item("pinned_job", s(j));
        }
        if let Some(p) = r.spot_price_usd_per_h {
            req = req.item("spot_price_usd_per_h", n(p));
        }
        if let Some(e) = r.run_time_estimate_s {
            req = req.item("run_time_estimate_s", n(e));
        }
        if let Some(g) = r.min_job_gpus {
            req = req.item("min_job_gpus", n(f64::from(g)));
        }
        if let Some(c) = cached_projects_value(&r.cached_projects) {
            req = req.item("cached_projects", c);
        }
        // A launch has none of these (`WorkerRecord::launched`); a record that has them keeps
        // them, so the row reads back as the record it was given, as in the fake.
        for (name, v) in [
            ("idle_since", r.idle_since),
            ("heartbeat_at", r.heartbeat_at),
            ("hold_until", r.hold_until),
        ] {
            if let Some(v) = v {
                req = req.item(name, n(v));
            }
        }
        match req.send().await {
            Ok(_) => Ok(()),
            // Already registered: registering is idempotent.
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("register worker", &e)),
        }
    }

    async fn set_state(&self, id: &str, state: WorkerState) -> Result<(), StoreError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(WORKER_KEY, self.key_of(id))
            .condition_expression("attribute_exists(instance_id)")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":s", s(state_name(state)));
        req = if state == WorkerState::Terminating {
            req.update_expression("SET #s = :s, expires_at = :e, ended_at = if_not_exists(ended_at, :now)")
                .expression_attribute_values(":e", epoch_s((self.now)() + FINISHED_ROW_TTL_S))
                .expression_attribute_values(":now", n((self.now)()))
        } else {
            req.update_expression("SET #s = :s")
        };
        match req.send().await {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Err(StoreError::NotFound(id.to_string())),
            Err(e) => Err(store_error("set worker state", &e)),
        }
    }

    async fn set_state_if(&self, id: &str, to: WorkerState, from: &[WorkerState]) -> Result<bool, StoreError> {
        if from.is_empty() {
            // No state qualifies: nothing to write, but an unknown worker is still NotFound.
            return match self.get_record(id).await? {
                Some(_) => Ok(false),
                None => Err(StoreError::NotFound(id.to_string())),
            };
        }
        let placeholders: Vec<String> = (0..from.len()).map(|i| format!(":f{i}")).collect();
        let mut req = self
            .update_if(id)
            .condition_expression(format!("#s IN ({})", placeholders.join(", ")))
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":s", s(state_name(to)));
        for (p, st) in placeholders.iter().zip(from) {
            req = req.expression_attribute_values(p, s(state_name(*st)));
        }
        req = if to == WorkerState::Terminating {
            req.update_expression("SET #s = :s, expires_at = :e, ended_at = if_not_exists(ended_at, :now)")
                .expression_attribute_values(":e", epoch_s((self.now)() + FINISHED_ROW_TTL_S))
                .expression_attribute_values(":now", n((self.now)()))
        } else {
            req.update_expression("SET #s = :s")
        };
        // Already in `to` is done: this very write, or the same end by another writer.
        written_or_done(req, id, "set worker state", |row| {
            row.get("state").and_then(|v| v.as_s().ok()).map(String::as_str) == Some(state_name(to))
        })
        .await
    }

    async fn set_price_if_unpriced(&self, id: &str, price_usd_per_h: f64) -> Result<bool, StoreError> {
        let req = self
            .update_if(id)
            .update_expression("SET price_usd_per_h = :p")
            .condition_expression("attribute_exists(instance_id) AND price_usd_per_h = :zero")
            .expression_attribute_values(":p", n(price_usd_per_h))
            .expression_attribute_values(":zero", n(0.0));
        // Already at this price is done (exact: the value read back is the one written).
        written_or_done(req, id, "price worker", |row| {
            number(row, "price_usd_per_h") == Some(price_usd_per_h)
        })
        .await
    }

    async fn set_run_time_estimate_if_unset(&self, id: &str, run_time_estimate_s: f64) -> Result<bool, StoreError> {
        let req = self
            .update_if(id)
            .update_expression("SET run_time_estimate_s = :e")
            .condition_expression("attribute_exists(instance_id) AND attribute_not_exists(run_time_estimate_s)")
            .expression_attribute_values(":e", n(run_time_estimate_s));
        // Already this figure is done (exact: the value read back is the one written).
        written_or_done(req, id, "give worker its run-time estimate", |row| {
            number(row, "run_time_estimate_s") == Some(run_time_estimate_s)
        })
        .await
    }

    async fn hold_idle(&self, id: &str, until: f64) -> Result<bool, StoreError> {
        let req = self
            .update_if(id)
            .update_expression("SET hold_until = :u")
            .condition_expression(
                "attribute_exists(instance_id) AND #s = :idle AND (attribute_not_exists(hold_until) OR hold_until < :u)",
            )
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":idle", s(state_name(WorkerState::Idle)))
            .expression_attribute_values(":u", n(until));
        // Idle and held until exactly `until` is done.
        written_or_done(req, id, "hold worker", |row| {
            row.get("state").and_then(|v| v.as_s().ok()).map(String::as_str) == Some(state_name(WorkerState::Idle))
                && number(row, "hold_until") == Some(until)
        })
        .await
    }

    async fn mark_stopped(&self, id: &str, at: f64, until: f64, launched_at: f64) -> Result<bool, StoreError> {
        let stopped = state_name(WorkerState::Stopped);
        // The run the stop ends joins the closed ones, once: the write is conditional on Idle.
        let req = self
            .update_if(id)
            .update_expression(
                "SET #s = :stopped, idle_since = :at, hold_until = :u, stopped_at = :at, \
                 closed_runs_s = if_not_exists(closed_runs_s, :zero) + :run",
            )
            .condition_expression("attribute_exists(instance_id) AND #s = :idle")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":stopped", s(stopped))
            .expression_attribute_values(":idle", s(state_name(WorkerState::Idle)))
            .expression_attribute_values(":at", n(at))
            .expression_attribute_values(":u", n(until))
            .expression_attribute_values(":zero", n(0.0))
            .expression_attribute_values(":run", n((at - launched_at).max(0.0)));
        // Already Stopped is done.
        written_or_done(req, id, "mark worker stopped", |row| {
            row.get("state").and_then(|v| v.as_s().ok()).map(String::as_str) == Some(stopped)
        })
        .await
    }

    async fn mark_started(
        &self,
        id: &str,
        at: f64,
        project: Option<&str>,
        job: Option<&str>,
        run_time_estimate_s: Option<f64>,
    ) -> Result<bool, StoreError> {
        let pending = state_name(WorkerState::Pending);
        // A new run from `at`: the stop that ended the last one is over.
        let mut u = Update {
            set: vec!["#s = :pending".into(), "launched_at = :at".into()],
            remove: vec!["idle_since", "hold_until", "heartbeat_at", "stopped_at"],
        };
        // `state` and `project` are DynamoDB reserved words: aliased.
        let mut req = self
            .update_if(id)
            .condition_expression("attribute_exists(instance_id) AND #s = :stopped")
            .expression_attribute_names("#s", "state")
            .expression_attribute_names("#pr", "project")
            .expression_attribute_values(":pending", s(pending))
            .expression_attribute_values(":stopped", s(state_name(WorkerState::Stopped)))
            .expression_attribute_values(":at", n(at));
        req = u.set_or_remove(req, "#pr", project.map(s));
        req = u.set_or_remove(req, "pinned_job", job.map(s));
        req = u.set_or_remove(req, "run_time_estimate_s", run_time_estimate_s.map(n));
        let req = req.update_expression(u.expression());
        // Pending since this very start is done (the write's own retry).
        written_or_done(req, id, "mark worker started", |row| {
            row.get("state").and_then(|v| v.as_s().ok()).map(String::as_str) == Some(pending)
                && number(row, "launched_at") == Some(at)
        })
        .await
    }

    async fn mark_start_refused(
        &self,
        id: &str,
        at: f64,
        launched_at: f64,
        stopped_at: Option<f64>,
        stopped_until: Option<f64>,
    ) -> Result<bool, StoreError> {
        let stopped = state_name(WorkerState::Stopped);
        let mut u = Update {
            set: vec!["#s = :stopped".into(), "launched_at = :was".into()],
            remove: Vec::new(),
        };
        let mut req = self
            .update_if(id)
            .condition_expression("attribute_exists(instance_id) AND #s = :pending AND launched_at = :at")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":pending", s(state_name(WorkerState::Pending)))
            .expression_attribute_values(":stopped", s(stopped))
            .expression_attribute_values(":at", n(at))
            .expression_attribute_values(":was", n(launched_at));
        req = u.set_or_remove(req, "idle_since", stopped_at.map(n));
        // The run before the start ended at the stop, as before the start (its seconds are still
        // in `closed_runs_s`; with the stop time unknown the run reads as open again).
        req = u.set_or_remove(req, "stopped_at", stopped_at.map(n));
        req = u.set_or_remove(req, "hold_until", stopped_until.map(n));
        // Stopped since that stop again is done (the write's own retry).
        written_or_done(
            req.update_expression(u.expression()),
            id,
            "mark worker start refused",
            |row| {
                row.get("state").and_then(|v| v.as_s().ok()).map(String::as_str) == Some(stopped)
                    && number(row, "idle_since") == stopped_at
                    && number(row, "launched_at") == Some(launched_at)
            },
        )
        .await
    }

    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        self.get_record(id).await
    }

    async fn list_live(&self) -> Result<Listing<WorkerRecord>, StoreError> {
        let mut out = Listing::default();
        let mut pages = self
            .client
            .scan()
            .table_name(&self.table)
            .filter_expression("#s <> :t")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":t", s(state_name(WorkerState::Terminating)))
            .consistent_read(true)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| store_error("scan workers", &e))?;
            for item in page.items() {
                match record_from_item(item) {
                    Ok(w) => out.items.push(w),
                    Err(e) => out.unreadable.push((
                        item.get("instance_id")
                            .and_then(|v| v.as_s().ok())
                            .cloned()
                            .unwrap_or_else(|| "?".into()),
                        e.to_string(),
                    )),
                }
            }
        }
        Ok(out)
    }
}

/// A conditional update that lost: `Ok(false)` when the row exists (returned with
/// `ReturnValuesOnConditionCheckFailure::AllOld`), [`StoreError::NotFound`] when it does not.
fn refused_or_missing(id: &str, what: &str, e: &SdkError<UpdateItemError>) -> Result<bool, StoreError> {
    if let Some(UpdateItemError::ConditionalCheckFailedException(c)) = e.as_service_error() {
        return match c.item() {
            Some(_) => Ok(false),
            None => Err(StoreError::NotFound(id.to_string())),
        };
    }
    Err(store_error(what, e))
}

/// Send a conditional update of one worker row made with [`DynamoWorkers::update_if`]:
/// `Ok(true)` written, `Ok(false)` refused by its condition, [`StoreError::NotFound`] when the row
/// does not exist ([`refused_or_missing`]).
async fn written(req: UpdateItemFluentBuilder, id: &str, what: &str) -> Result<bool, StoreError> {
    match req.send().await {
        Ok(_) => Ok(true),
        Err(e) => refused_or_missing(id, what, &e),
    }
}

/// [`written`], and a refusal whose row (ALL_OLD) `done` finds already as this write leaves it
/// is `Ok(true)`: this very write, applied on an earlier try whose answer was lost (the SDK
/// retried it, and it then failed its own condition), or the same value by another writer.
async fn written_or_done(
    req: UpdateItemFluentBuilder,
    id: &str,
    what: &str,
    done: impl FnOnce(&HashMap<String, AttributeValue>) -> bool,
) -> Result<bool, StoreError> {
    match req.send().await {
        Ok(_) => Ok(true),
        Err(e) => match e.as_service_error() {
            Some(UpdateItemError::ConditionalCheckFailedException(c)) if c.item().is_some_and(done) => Ok(true),
            _ => refused_or_missing(id, what, &e),
        },
    }
}

/// An UpdateItem's expression built attribute by attribute: `SET` clauses, `REMOVE`d names.
struct Update {
    set: Vec<String>,
    remove: Vec<&'static str>,
}

impl Update {
    /// `SET name = :value` with `value` bound on `req` (the placeholder is `name` without a
    /// leading `#`), or `REMOVE name` without one.
    fn set_or_remove(
        &mut self,
        req: UpdateItemFluentBuilder,
        name: &'static str,
        value: Option<AttributeValue>,
    ) -> UpdateItemFluentBuilder {
        match value {
            Some(v) => {
                let placeholder = format!(":{}", name.trim_start_matches('#'));
                self.set.push(format!("{name} = {placeholder}"));
                req.expression_attribute_values(placeholder, v)
            }
            None => {
                self.remove.push(name);
                req
            }
        }
    }

    /// `SET a = :a, ... [REMOVE b, ...]`.
    fn expression(&self) -> String {
        match self.remove.is_empty() {
            true => format!("SET {}", self.set.join(", ")),
            false => format!("SET {} REMOVE {}", self.set.join(", "), self.remove.join(", ")),
        }
    }
}

/// A number attribute of a row, if it is one.
fn number(row: &HashMap<String, AttributeValue>, name: &str) -> Option<f64> {
    row.get(name)?.as_n().ok()?.parse().ok()
}

impl DynamoWorkers {
    /// An UpdateItem of worker `id`'s row that returns the row when its condition refuses it, so
    /// that a refusal tells an existing row from a missing one ([`refused_or_missing`]).
    fn update_if(&self, id: &str) -> UpdateItemFluentBuilder {
        self.client
            .update_item()
            .table_name(&self.table)
            .key(WORKER_KEY, self.key_of(id))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
    }

    /// What the agent writes when it takes a job: `SET state = Running, heartbeat_at = now REMOVE
    /// idle_since`, only if the state is not Draining, Terminating or Stopped. `Ok(false)` when
    /// refused: the control plane is retiring the worker (a scale-down, a stop, or an interruption
    /// notice), so the agent must not claim. One conditional write, so a scale-down ([`WorkerRegistry::set_state_if`]
    /// from Idle) and a claim never both win.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown worker; store failures.
    pub async fn mark_busy(&self, id: &str, now: f64) -> Result<bool, StoreError> {
        let req = self
            .update_if(id)
            .update_expression("SET #s = :run, heartbeat_at = :h REMOVE idle_since")
            .condition_expression("attribute_exists(instance_id) AND NOT (#s IN (:d, :t, :st))")
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":run", s(state_name(WorkerState::Running)))
            .expression_attribute_values(":d", s(state_name(WorkerState::Draining)))
            .expression_attribute_values(":t", s(state_name(WorkerState::Terminating)))
            .expression_attribute_values(":st", s(state_name(WorkerState::Stopped)))
            .expression_attribute_values(":h", n(now));
        written(req, id, "mark worker busy").await
    }

    /// What the agent writes when its project cache changes: the projects it holds, most
    /// recently used first ([`WorkerRecord::cached_projects`]; the first
    /// [`MAX_CACHED_PROJECTS`] are kept, none removes the attribute), whatever the row's state.
    /// Sending it again is done.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown worker; store failures.
    pub async fn set_cached_projects(&self, id: &str, projects: &[String]) -> Result<(), StoreError> {
        let req = self.update_if(id).condition_expression("attribute_exists(instance_id)");
        let req = match cached_projects_value(projects) {
            Some(v) => req
                .update_expression("SET cached_projects = :c")
                .expression_attribute_values(":c", v),
            None => req.update_expression("REMOVE cached_projects"),
        };
        match req.send().await {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Err(StoreError::NotFound(id.to_string())),
            Err(e) => Err(store_error("record the worker's cached projects", &e)),
        }
    }

    /// What the agent's heartbeat writes: state, idle-since and heartbeat time (the worker must
    /// exist). The state is written only while the control plane is not retiring the worker: a
    /// row it marked Draining, Terminating or Stopped keeps its state (an agent heartbeat never
    /// revives it), and only `heartbeat_at` is written, so the reaper still sees the agent alive
    /// while it finishes its job. The agent itself may write Draining (it saw a notice).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown worker; [`StoreError::Conflict`] when the row is
    /// Draining, Terminating or Stopped and the agent asked for another state (`heartbeat_at` was
    /// written); store failures.
    pub async fn heartbeat(
        &self,
        id: &str,
        state: WorkerState,
        idle_since: Option<f64>,
        now: f64,
    ) -> Result<(), StoreError> {
        let mut req = self
            .update_if(id)
            .expression_attribute_names("#s", "state")
            .expression_attribute_values(":s", s(state_name(state)))
            .expression_attribute_values(":h", n(now))
            .expression_attribute_values(":t", s(state_name(WorkerState::Terminating)))
            .expression_attribute_values(":st", s(state_name(WorkerState::Stopped)));
        req = if state == WorkerState::Draining {
            req.condition_expression("attribute_exists(instance_id) AND NOT (#s IN (:t, :st))")
        } else {
            req.condition_expression("attribute_exists(instance_id) AND NOT (#s IN (:d, :t, :st))")
                .expression_attribute_values(":d", s(state_name(WorkerState::Draining)))
        };
        req = match idle_since {
            Some(t) => req
                .update_expression("SET #s = :s, heartbeat_at = :h, idle_since = :i")
                .expression_attribute_values(":i", n(t)),
            None => req.update_expression("SET #s = :s, heartbeat_at = :h REMOVE idle_since"),
        };
        match req.send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                // NotFound and store failures are returned here; a refusal goes on.
                refused_or_missing(id, "heartbeat", &e)?;
                // Retiring: keep its state, record that the agent is alive.
                self.client
                    .update_item()
                    .table_name(&self.table)
                    .key(WORKER_KEY, self.key_of(id))
                    .update_expression("SET heartbeat_at = :h")
                    .condition_expression("attribute_exists(instance_id)")
                    .expression_attribute_values(":h", n(now))
                    .send()
                    .await
                    .map_err(|e| store_error("heartbeat", &e))?;
                Err(StoreError::Conflict(format!(
                    "{id} is being retired by the control plane (Draining, Terminating or Stopped)"
                )))
            }
        }
    }
}

/// The control table: unavailable offerings (and, later, leases).
#[derive(Debug, Clone)]
pub struct DynamoControl {
    client: aws_sdk_dynamodb::Client,
    table: String,
}

fn unavailable_pk(key: &OfferingKey) -> String {
    format!(
        "unavailable#{}#{}#{}",
        key.instance_type,
        key.zone,
        key.capacity_type.as_str()
    )
}

impl DynamoControl {
    /// The table called `table`.
    pub fn new(client: aws_sdk_dynamodb::Client, table: impl Into<String>) -> Self {
        Self {
            client,
            table: table.into(),
        }
    }

    /// The item keyed `pk`, read consistently; `what` names the read in an error.
    async fn item(&self, pk: String, what: &str) -> Result<Option<HashMap<String, AttributeValue>>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(pk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| store_error(what, &e))?;
        Ok(out.item)
    }

    /// Offerings marked unavailable until after `now`.
    ///
    /// # Errors
    /// Store failures.
    pub async fn unavailable(&self, now: f64) -> Result<Vec<UnavailableOffering>, StoreError> {
        self.scan_unavailable(now).await
    }

    async fn scan_unavailable(&self, now: f64) -> Result<Vec<UnavailableOffering>, StoreError> {
        let mut out = Vec::new();
        let mut pages = self
            .client
            .scan()
            .table_name(&self.table)
            .filter_expression("begins_with(pk, :p) AND #u > :now")
            .expression_attribute_names("#u", "until")
            .expression_attribute_values(":p", s("unavailable#"))
            .expression_attribute_values(":now", n(now))
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| store_error("scan unavailable offerings", &e))?;
            for item in page.items() {
                let pk = item.get("pk").and_then(|v| v.as_s().ok());
                let until = item
                    .get("until")
                    .and_then(|v| v.as_n().ok())
                    .and_then(|v| v.parse::<f64>().ok());
                let parts: Option<Vec<&str>> = pk.map(|p| p.splitn(4, '#').collect());
                if let (Some([_, ty, zone, cap]), Some(until)) = (parts.as_deref(), until) {
                    let capacity_type = if *cap == "spot" {
                        CapacityType::Spot
                    } else {
                        CapacityType::OnDemand
                    };
                    out.push(UnavailableOffering {
                        key: OfferingKey {
                            instance_type: ty.to_string(),
                            zone: zone.to_string(),
                            capacity_type,
                        },
                        until,
                    });
                }
            }
        }
        Ok(out)
    }
}

impl onoff_control::ports::Lease for DynamoControl {
    async fn acquire(&self, name: &str, owner: &str, ttl_s: f64, now: f64) -> Result<bool, StoreError> {
        let res = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("pk", s(format!("lease#{name}")))
            .item("owner", s(owner))
            .item("until", n(now + ttl_s))
            .item("expires_at", epoch_s(now + ttl_s + 3600.0))
            .condition_expression("attribute_not_exists(pk) OR #u < :now OR #o = :owner")
            .expression_attribute_names("#u", "until")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":owner", s(owner))
            .send()
            .await;
        match res {
            Ok(_) => Ok(true),
            Err(e) if condition_failed(&e) => Ok(false),
            Err(e) => Err(store_error("acquire lease", &e)),
        }
    }

    async fn release(&self, name: &str, owner: &str) -> Result<(), StoreError> {
        let res = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key("pk", s(format!("lease#{name}")))
            .condition_expression("#o = :owner")
            .expression_attribute_names("#o", "owner")
            .expression_attribute_values(":owner", s(owner))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("release lease", &e)),
        }
    }

    /// Item `done#<name>`, `started_at` raised only (a conditional update); it expires a day
    /// after the run.
    async fn mark_done(&self, name: &str, started_at: f64) -> Result<(), StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(format!("done#{name}")))
            .update_expression("SET started_at = :t, expires_at = :exp")
            .condition_expression("attribute_not_exists(started_at) OR started_at < :t")
            .expression_attribute_values(":t", n(started_at))
            .expression_attribute_values(":exp", epoch_s(started_at + 86_400.0))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            // A later run's mark is there already.
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("mark run done", &e)),
        }
    }

    async fn last_done(&self, name: &str) -> Result<Option<f64>, StoreError> {
        let item = self.item(format!("done#{name}"), "read run mark").await?;
        Ok(item.as_ref().and_then(|i| number(i, "started_at")))
    }

    /// Item `asks#<name>`: `asks` (a counter, `ADD`) and `pending_since` (the pending ask's time,
    /// present while one is pending) with `pending_by` (the pending ask's token). An ask first
    /// tries to become the pending one (no `pending_since`, one older than `stale_s`, or its own:
    /// the SDK's retry of a write whose answer was lost), else to join the pending one (a
    /// `pending_since` that is still fresh); each is one conditional write, so a settle between
    /// the two sends the asker round again. After three rounds lost to races it invokes. A retried
    /// `ADD` counts an ask twice, which only makes a run go once more. The item expires a day
    /// after the last ask.
    ///
    /// The jobs' ids go first, into the item's string set `jobs` (a write of their own, so the
    /// run the count invokes finds them): at most [`MAX_ASKED_JOBS`] of at most
    /// [`MAX_ASKED_JOB_ID_BYTES`] each, while the set holds fewer than [`MAX_KEPT_ASKED_JOBS`]
    /// (so the item stays far under DynamoDB's 400 KB: a set that full means runs have not
    /// forgotten their ids for many asks, and those jobs reach the run through the index). The
    /// bound is a condition, not a caught size error: moto (5.2.5) applies part of an UpdateItem
    /// it then refuses for the item's size and leaves an item no update fits, where DynamoDB
    /// changes nothing. A failed write of the ids is logged; the ask is counted anyway.
    async fn ask(&self, name: &str, jobs: &[String], now: f64, stale_s: f64) -> Result<ScaleAsk, StoreError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let key = s(format!("asks#{name}"));
        let mut ids: Vec<String> = jobs
            .iter()
            .filter(|j| !j.is_empty() && j.len() <= MAX_ASKED_JOB_ID_BYTES)
            .take(MAX_ASKED_JOBS)
            .cloned()
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if !ids.is_empty() {
            let res = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("pk", key.clone())
                .update_expression("ADD jobs :ids SET expires_at = :exp")
                .condition_expression("attribute_not_exists(jobs) OR size(jobs) < :max")
                .expression_attribute_values(":ids", AttributeValue::Ss(ids))
                .expression_attribute_values(":max", AttributeValue::N(MAX_KEPT_ASKED_JOBS.to_string()))
                .expression_attribute_values(":exp", epoch_s(now + 86_400.0))
                .send()
                .await;
            match res {
                Ok(_) => {}
                Err(e) if condition_failed(&e) => {
                    tracing::warn!(name, "the asked jobs are not kept: the set is full");
                }
                Err(e) => {
                    tracing::warn!(error = %store_error("keep the asked jobs", &e), "counting the ask without them")
                }
            }
        }
        for _ in 0..3 {
            let token = format!(
                "{}-{:x}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            );
            let res = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("pk", key.clone())
                .update_expression("ADD asks :one SET pending_since = :now, pending_by = :me, expires_at = :exp")
                .condition_expression(
                    "attribute_not_exists(pending_since) OR pending_since < :stale OR pending_by = :me",
                )
                .expression_attribute_values(":one", n(1.0))
                .expression_attribute_values(":me", s(token))
                .expression_attribute_values(":now", n(now))
                .expression_attribute_values(":stale", n(now - stale_s))
                .expression_attribute_values(":exp", epoch_s(now + 86_400.0))
                .send()
                .await;
            match res {
                Ok(_) => return Ok(ScaleAsk::Invoke),
                Err(e) if condition_failed(&e) => {}
                Err(e) => return Err(store_error("ask for a run", &e)),
            }
            let res = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("pk", key.clone())
                .update_expression("ADD asks :one SET expires_at = :exp")
                .condition_expression("attribute_exists(pending_since) AND pending_since >= :stale")
                .expression_attribute_values(":one", n(1.0))
                .expression_attribute_values(":stale", n(now - stale_s))
                .expression_attribute_values(":exp", epoch_s(now + 86_400.0))
                .send()
                .await;
            match res {
                Ok(_) => return Ok(ScaleAsk::Joined),
                Err(e) if condition_failed(&e) => {}
                Err(e) => return Err(store_error("join the pending run", &e)),
            }
        }
        Ok(ScaleAsk::Invoke)
    }

    async fn asks(&self, name: &str) -> Result<Asks, StoreError> {
        let item = self.item(format!("asks#{name}"), "count asks").await?;
        let mut jobs: Vec<String> = item
            .as_ref()
            .and_then(|i| i.get("jobs"))
            .and_then(|v| v.as_ss().ok())
            .cloned()
            .unwrap_or_default();
        jobs.sort_unstable();
        Ok(Asks {
            count: item.as_ref().and_then(|i| number(i, "asks")).map_or(0, |c| c as u64),
            pending_since: item.as_ref().and_then(|i| number(i, "pending_since")),
            jobs,
        })
    }

    /// `DELETE jobs :ids` (a string set: ids added since stay; an emptied set is removed).
    async fn forget_asked_jobs(&self, name: &str, jobs: &[String]) -> Result<(), StoreError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(format!("asks#{name}")))
            .update_expression("DELETE jobs :ids")
            .condition_expression("attribute_exists(pk)")
            .expression_attribute_values(":ids", AttributeValue::Ss(jobs.to_vec()))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("forget the asked jobs", &e)),
        }
    }

    /// `REMOVE pending_since` on the condition that `asks` is still `seen` (no write when `seen`
    /// is 0: a read says whether an ask came since).
    async fn settle_asks(&self, name: &str, seen: u64) -> Result<bool, StoreError> {
        if seen == 0 {
            return Ok(self.asks(name).await?.count == 0);
        }
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(format!("asks#{name}")))
            .update_expression("REMOVE pending_since, pending_by")
            .condition_expression("asks = :seen")
            .expression_attribute_values(":seen", AttributeValue::N(seen.to_string()))
            .send()
            .await;
        match res {
            Ok(_) => Ok(true),
            Err(e) if condition_failed(&e) => Ok(false),
            Err(e) => Err(store_error("settle asks", &e)),
        }
    }

    async fn drop_pending_ask(&self, name: &str) -> Result<(), StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(format!("asks#{name}")))
            .update_expression("REMOVE pending_since, pending_by")
            .condition_expression("attribute_exists(pk)")
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("drop the pending ask", &e)),
        }
    }
}

impl onoff_control::ports::EventLog for DynamoControl {
    async fn seen(&self, event_id: &str) -> Result<bool, StoreError> {
        Ok(self.item(format!("event#{event_id}"), "read event").await?.is_some())
    }

    async fn first_time(&self, event_id: &str, now: f64) -> Result<bool, StoreError> {
        let res = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("pk", s(format!("event#{event_id}")))
            .item("expires_at", epoch_s(now + 86_400.0))
            .condition_expression("attribute_not_exists(pk)")
            .send()
            .await;
        match res {
            Ok(_) => Ok(true),
            Err(e) if condition_failed(&e) => Ok(false),
            Err(e) => Err(store_error("record event", &e)),
        }
    }
}

/// Key of a lane's kept arrival statistics in the control table.
fn arrival_stats_pk(lane: &str) -> String {
    format!("arrivals#{lane}")
}

impl onoff_control::ports::ArrivalStatsStore for DynamoControl {
    /// Statistics that do not parse (kept by a build whose format differs) are started afresh
    /// from the item's `folded_to`, so the next save replaces them: they are a summary of the
    /// arrivals, not the truth about any job. An item without a `folded_to` is
    /// [`StoreError::Malformed`].
    async fn load_arrival_stats(&self, lane: &str) -> Result<Option<ArrivalStats>, StoreError> {
        let Some(item) = self.item(arrival_stats_pk(lane), "read arrival stats").await? else {
            return Ok(None);
        };
        let folded_to = item
            .get("folded_to")
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| StoreError::Malformed(format!("arrival stats of {lane} lack folded_to")))?;
        let parsed = item
            .get("stats")
            .and_then(|v| v.as_s().ok())
            .and_then(|text| serde_json::from_str::<ArrivalStats>(text).ok());
        Ok(Some(parsed.unwrap_or(ArrivalStats {
            folded_to,
            ..ArrivalStats::default()
        })))
    }

    async fn save_arrival_stats(
        &self,
        lane: &str,
        stats: &ArrivalStats,
        previous: Option<f64>,
    ) -> Result<bool, StoreError> {
        let text = serde_json::to_string(stats).map_err(|e| StoreError::Other(format!("encode arrival stats: {e}")))?;
        let mut put = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("pk", s(arrival_stats_pk(lane)))
            .item("folded_to", n(stats.folded_to))
            .item("stats", s(text));
        put = match previous {
            None => put.condition_expression("attribute_not_exists(pk)"),
            Some(p) => put
                .condition_expression("folded_to = :p")
                .expression_attribute_values(":p", n(p)),
        };
        match put.send().await {
            Ok(_) => Ok(true),
            Err(e) if condition_failed(&e) => Ok(false),
            Err(e) => Err(store_error("save arrival stats", &e)),
        }
    }
}

impl OfferingAvailability for DynamoControl {
    async fn mark_unavailable(&self, key: &OfferingKey, until: f64) -> Result<(), StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(unavailable_pk(key)))
            .update_expression("SET #u = :u, expires_at = :e")
            // A later `until` wins; an earlier one is a no-op.
            .condition_expression("attribute_not_exists(pk) OR #u < :u")
            .expression_attribute_names("#u", "until")
            .expression_attribute_values(":u", n(until))
            .expression_attribute_values(":e", epoch_s(until + 3600.0))
            .send()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) if condition_failed(&e) => Ok(()),
            Err(e) => Err(store_error("mark offering unavailable", &e)),
        }
    }

    async fn list_unavailable(&self, now: f64) -> Result<Vec<UnavailableOffering>, StoreError> {
        self.scan_unavailable(now).await
    }
}
