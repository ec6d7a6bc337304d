//! The reconcile use case: observe, reap, decide, act. The `scaler` runs it without reaping on
//! alarms and submissions; the `reconciler` runs it with reaping on its schedule.
//!
//! Reaping, the second layer behind each agent's own idle exit:
//! - instances tagged `onoff:managed` that the workers table does not know are adopted when they
//!   are a launch whose registration failed (a lane's tag, younger than `boot_timeout_s`, no row:
//!   registered as booting, at the catalogue price), else (orphans) terminated once
//!   `launch_grace_s` passed;
//! - workers whose instance is gone are marked Terminating and their jobs re-queued;
//! - persistent spot requests of this deployment whose instance is no live worker's (it
//!   terminated, or the request is open to launch again) are cancelled once `launch_grace_s`
//!   passed since they were made (`cancel_orphan_requests`);
//! - workers whose heartbeat is older than `heartbeat_timeout_s`, or that never reported within
//!   `boot_timeout_s` of launch, are terminated and their jobs re-queued;
//! - RUNNING jobs whose lease expired are re-queued (or FAILED after `max_lease_expiries`), each
//!   write conditioned on the exact lease the reaper saw;
//! - pending jobs (QUEUED, RETRYING) with no wake-up message sent for `resend_after_s` get a fresh
//!   one where their lane's queue holds fewer messages than the lane has pending jobs (a message
//!   lost, expired or never sent: the jobs table is the truth, messages only wake workers up, and
//!   a duplicate is harmless because claims are conditional; [`reap_jobs`]).
//!
//! Launches younger than `launch_grace_s` are left alone (the workers table and EC2 may not agree
//! yet). Every step is idempotent: a re-queue is a conditional write, so two reconcilers at once
//! re-queue a job once. Rows that do not parse are skipped and counted, never fatal.

use std::collections::{BTreeMap, BTreeSet};

use onoff_policy::{
    decide, Action, LaneObservation, Observation, Offering, OfferingKey, PendingJob, Plan, PolicyConfig, WorkerState,
    WorkerView,
};

use crate::act::{act, ActContext, ActOutcome};
use crate::job::{AttemptEnd, JobSpec, JobState, RerunLimits, Settle};
use crate::ports::{
    wake, ArrivalStatsStore, Backlog, Fleet, FleetInstance, FleetLister, JobQueue, JobRecord, JobStore,
    OfferingAvailability, StoreError, WorkerRecord, WorkerRegistry, MAX_ASKED_JOBS,
};
use crate::quota::{quotas_behind, without_full_quotas, BlockedByQuotas, QuotaMark};

/// Reconcile settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReconcileOptions {
    /// Run the reaper. The scheduled reconciler does; the scaler does not.
    pub reap: bool,
    /// A worker whose agent has not sent a heartbeat for this long is lost, seconds. Default 300 s
    /// (five missed one-minute heartbeats).
    pub heartbeat_timeout_s: f64,
    /// A worker whose agent never reported this long after launch is lost, seconds. Default 1800 s
    /// (three times the seed's 10-minute worst cold start).
    pub boot_timeout_s: f64,
    /// Launches younger than this are not reaped, seconds. Default 180 s.
    pub launch_grace_s: f64,
    /// GPUs of the largest instance; larger jobs run on several instances. Default 8.
    pub max_gpus_per_instance: u32,
    /// A pending job with no wake-up message sent for this long gets a fresh one, seconds.
    /// Default 600: two of the agents' default 300 s leases (`ONOFF_LEASE_S`), long enough that a
    /// message sent with the retry delay (at most 900 s is SQS's cap; the agent's default is 30 s)
    /// has usually been received, short enough that a lost one costs minutes, not a GPU forever.
    pub resend_after_s: f64,
    /// Bounds on re-runs (lost leases).
    pub limits: RerunLimits,
    /// How long a decision holds each idle worker it keeps, seconds ([`renew_holds`]): the
    /// worker's agent does not end itself for its idle timeout before then. Renewed by the first
    /// decision after less than two thirds of it is left (a third of it after the write), so
    /// decisions at most two thirds of it apart (600 s; the template's reconciler runs every
    /// minute) keep a kept worker held without a gap. Default 900 s: when decisions stop, a held
    /// worker ends itself at most 900 s after the last one, or at its own idle timeout if that
    /// comes later.
    pub hold_s: f64,
}

impl Default for ReconcileOptions {
    fn default() -> Self {
        Self {
            reap: true,
            heartbeat_timeout_s: 300.0,
            boot_timeout_s: 1800.0,
            launch_grace_s: 180.0,
            max_gpus_per_instance: 8,
            resend_after_s: 600.0,
            limits: RerunLimits::default(),
            hold_s: 900.0,
        }
    }
}

/// What a reconcile did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReconcileReport {
    /// The decision.
    pub plan: Plan,
    /// What carrying it out did.
    pub acted: ActOutcome,
    /// Orphan instances terminated.
    pub orphans_terminated: Vec<String>,
    /// Instances launched for a lane whose registration failed, registered by the reaper as
    /// booting workers instead of terminated ([`ReconcileOptions::boot_timeout_s`] still applies).
    pub orphans_adopted: Vec<String>,
    /// Workers whose instance was gone.
    pub workers_gone: Vec<String>,
    /// Persistent spot requests cancelled because no live worker has their instance (the
    /// reaper's `cancel_orphan_requests`).
    pub spot_requests_cancelled: Vec<String>,
    /// Workers terminated for a stale heartbeat or a boot that never finished.
    pub workers_lost: Vec<String>,
    /// Jobs re-queued (lost worker or expired lease).
    pub jobs_requeued: Vec<String>,
    /// Jobs FAILED because they lost their lease `max_lease_expiries` times.
    pub jobs_failed: Vec<String>,
    /// Pending jobs sent a fresh wake-up message (none sent for two lease periods, and their
    /// lane's queue short of one message per pending job: [`reap_jobs`]).
    pub jobs_woken: Vec<String>,
    /// Pending jobs with no message sent for two lease periods that were not sent another: their
    /// lane's queue held one message per pending job ([`reap_jobs`]).
    pub wake_ups_spared: usize,
    /// Idle workers the decision kept whose hold was written or renewed ([`renew_holds`]).
    pub workers_held: Vec<String>,
    /// Live workers whose row had no run-time estimate and was given its lane's
    /// ([`give_run_time_estimates`]).
    pub workers_given_estimates: Vec<String>,
    /// The live workers as this run leaves them, for the functions' fleet metrics without a
    /// second listing of the table: as listed (the reaper's losses removed, prices filled in),
    /// less those the plan released (but the ones an agent took a job for first, left as
    /// listed), plus those launched (Pending, as registered), with the holds written.
    pub workers: Vec<WorkerRecord>,
    /// Rows that do not parse, skipped: (key, problem).
    pub unreadable: Vec<(String, String)>,
    /// Non-fatal errors.
    pub errors: Vec<String>,
    /// `Some(false)` when a scale request came in while the run was under way, `Some(true)` when
    /// none did and the pending one, if any, was ended ([`reconcile_exclusive`]); `None` when the
    /// count could not be read or settled (among the errors), or for a run outside the lease.
    pub asks_settled: Option<bool>,
    /// Jobs a scale request asked for ([`crate::ports::Asks::jobs`]) whose row, read by id,
    /// differed from what the `active` index listed (not listed yet, or in an older state): the
    /// run decided on the row. The index is eventually consistent; without this a job submitted
    /// just before its own scale request could be missed by that run and wait for the next one.
    pub jobs_read_past_index: Vec<String>,
    /// The asked jobs could not be read by id (the read failed: among the errors): they stay
    /// asked for, so a later run reads them ([`reconcile_exclusive`] does not forget them).
    pub asked_jobs_unread: bool,
    /// Arrivals folded into the lanes' kept statistics by this run ([`crate::arrivals`]).
    pub arrivals_folded: usize,
    /// Per lane with one: the run time a job that declares none is taken to have, seconds (the
    /// mean of the lane's last jobs to finish, [`onoff_policy::RecentRunTimes`]; before 5 have,
    /// the lane's `default_runtime_s` if it has one).
    pub run_time_estimates: Vec<(String, f64)>,
    /// Jobs the decision held for want of any offering where full vCPU quotas had left offerings
    /// that could run them out of the catalogue ([`blocked_by_quotas`]): waiting on the operator
    /// (the handlers log each with the quota to raise), not on capacity.
    pub blocked_by_quotas: Vec<BlockedByQuotas>,
    /// Jobs the reaper ended FAILED for waiting past their lane's `quota_wait_limit_s` while full
    /// vCPU quotas kept them from every offering ([`quotas_blocking`]): (job id, the reason
    /// written on its row).
    pub jobs_past_quota_wait: Vec<(String, String)>,
}

/// End the lease of a RUNNING job whose lease expired or whose worker is lost: QUEUED with a
/// fresh wake-up message, or FAILED once it lost `max_lease_expiries` leases. Conditioned on the
/// lease as seen: a lease renewed or re-claimed meanwhile is left alone (`Ok(None)`).
async fn requeue_lost<J: JobStore, Q: JobQueue>(
    job: &JobRecord,
    why: &str,
    opts: &ReconcileOptions,
    now: f64,
    jobs: &J,
    queue: &Q,
    errors: &mut Vec<String>,
) -> Result<Option<JobState>, String> {
    let (Some(owner), Some(expires)) = (job.lease_owner.as_deref(), job.lease_expires_at) else {
        return Ok(None);
    };
    let settle = Settle::of(job, &AttemptEnd::LeaseLost(why.to_string()), &opts.limits);
    match jobs.requeue_lost(&job.id, owner, expires, &settle, now).await {
        Ok(()) => {}
        Err(StoreError::Conflict(_) | StoreError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    if settle.to == JobState::Queued {
        if let Err(e) = wake(jobs, queue, &job.id, &job.spec, 0, now).await {
            // The row is QUEUED without a recent message: the next sweep sends one.
            errors.push(format!("wake {} after re-queue: {e}", job.id));
        }
    }
    Ok(Some(settle.to))
}

/// What [`reap_jobs`] did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct JobsReaped {
    /// Jobs whose lease was ended and that were re-queued with a fresh message.
    pub requeued: Vec<String>,
    /// Jobs FAILED for losing `max_lease_expiries` leases.
    pub failed: Vec<String>,
    /// Pending jobs sent a fresh wake-up message.
    pub woken: Vec<String>,
    /// Pending jobs due a fresh message that were not sent one: their lane's queue held one
    /// message per pending job.
    pub spared: usize,
    /// Every lease ended, with the state the job went to (QUEUED, or FAILED or CANCELLED).
    pub ended: Vec<(String, JobState)>,
    /// Failures of single writes or sends (the next run tries again).
    pub errors: Vec<String>,
}

/// The reaper's work on jobs, on `snapshot`, the active jobs as read at `now`: end the lease of
/// every RUNNING job whose lease expired before `now` or whose owner is in `lost` (each write
/// conditioned on the lease as the snapshot has it, so a lease renewed or re-claimed since is left
/// alone), and make good the wake-up messages that are gone.
///
/// A pending job with no message sent for `resend_after_s` (two lease periods) is *due*: its
/// message may be gone (never sent, lost, expired after SQS's retention, moved to the dead-letter
/// queue by its receive count). Whether it is, only the lane's queue can tell, and only by its
/// count: per lane, the due jobs sent a fresh message are as many as the queue's messages
/// (visible, in flight and delayed: `GetQueueAttributes`, [`Backlog`]) fall short of the lane's
/// pending jobs, never-sent and longest-waiting first. A backlog behind `max_workers`, a budget
/// breaker or a frozen deployment, whose messages all wait in the queue, gets none: before, every
/// due job got one per `resend_after_s`, and 1,000 jobs waiting five hours left some 30,000
/// duplicates for the workers to receive and drop one by one.
///
/// The count can hide a gone message behind a duplicate of another job (or a message of a job no
/// longer pending). Workers receive and delete those as they poll, the count then falls below
/// the pending jobs, and a later run sends the missing one. SQS's counts are approximate ("in most
/// cases close to the actual number", SQS Developer Guide, "Resources required to process Amazon
/// SQS messages"); a count that lags costs a duplicate or a run's wait, never a job. When the
/// count cannot be read, every due job of the lane gets a fresh message, as a duplicate is
/// harmless.
///
/// Two reconcilers may run it at once on snapshots of different ages: the conditional writes keep
/// a lease from being ended twice, and a duplicate message is harmless.
pub async fn reap_jobs<J: JobStore, Q: JobQueue + Backlog>(
    snapshot: &[JobRecord],
    lost: &BTreeSet<String>,
    opts: &ReconcileOptions,
    now: f64,
    jobs: &J,
    queue: &Q,
) -> JobsReaped {
    let mut out = JobsReaped::default();
    for job in snapshot.iter().filter(|j| j.state == JobState::Running) {
        let owner_lost = job.lease_owner.as_deref().is_some_and(|o| lost.contains(o));
        let expired = job.lease_expires_at.is_some_and(|t| t < now);
        if !(owner_lost || expired) {
            continue;
        }
        let why = if owner_lost {
            format!("worker {} lost", job.lease_owner.as_deref().unwrap_or("?"))
        } else {
            "lease expired".to_string()
        };
        match requeue_lost(job, &why, opts, now, jobs, queue, &mut out.errors).await {
            Ok(Some(to)) => {
                if to == JobState::Failed {
                    out.failed.push(job.id.clone());
                } else {
                    out.requeued.push(job.id.clone());
                }
                out.ended.push((job.id.clone(), to));
            }
            Ok(None) => {}
            Err(e) => out.errors.push(format!("requeue {}: {e}", job.id)),
        }
    }
    // Jobs re-queued just now count as pending: their fresh message is in the queue's count.
    let requeued: Vec<&str> = snapshot
        .iter()
        .filter(|j| out.requeued.contains(&j.id))
        .map(|j| j.spec.lane.as_str())
        .collect();
    let mut due: BTreeMap<&str, Vec<&JobRecord>> = BTreeMap::new();
    for job in snapshot.iter().filter(|j| j.needs_wake_up(now, opts.resend_after_s)) {
        due.entry(job.spec.lane.as_str()).or_default().push(job);
    }
    for (lane, mut due) in due {
        let pending = snapshot
            .iter()
            .filter(|j| j.state.is_pending() && j.spec.lane == lane)
            .count()
            + requeued.iter().filter(|l| **l == lane).count();
        let missing = match queue.backlog(lane).await {
            Ok(b) => pending.saturating_sub(b.total(true) as usize),
            Err(e) => {
                out.errors.push(format!(
                    "backlog of lane {lane}: {e} (every due job sent a fresh message)"
                ));
                due.len()
            }
        };
        // Never sent first, then the longest since its last message.
        due.sort_by(|a, b| {
            let at = |j: &JobRecord| j.sent_at.unwrap_or(f64::NEG_INFINITY);
            at(a).total_cmp(&at(b)).then_with(|| a.id.cmp(&b.id))
        });
        out.spared += due.len().saturating_sub(missing);
        for job in due.into_iter().take(missing) {
            match wake(jobs, queue, &job.id, &job.spec, 0, now).await {
                Ok(()) => out.woken.push(job.id.clone()),
                Err(e) => out.errors.push(format!("wake {}: {e}", job.id)),
            }
        }
    }
    out
}

/// What the orphan pass makes of an instance no live worker row knows ([`adopt`]).
#[derive(Debug)]
enum Unknown {
    /// A launch whose registration failed, registered now.
    Adopted(Box<WorkerRecord>),
    /// Its row is Terminating: the control plane retired it and it still runs. Terminated again
    /// at once, within the launch grace too: EC2 answers a TerminateInstances for an instance
    /// it launched moments ago with `InvalidInstanceID.NotFound` while its launch propagates
    /// ("Eventual consistency in the Amazon EC2 API", which names TerminateInstances), and the
    /// adapter takes not-found for gone ([`Fleet::terminate`]). Terminating again is idempotent
    /// for one already shutting down that the listing still shows running.
    Retired,
    /// Not a launch of this policy's lanes, past its boot timeout, or with a live row the scan
    /// did not show: an orphan once `launch_grace_s` passed.
    Other,
}

/// Cancel the persistent spot requests of this deployment (stoppable spot workers') whose
/// instance is no live worker's, once `opts.launch_grace_s` passed since they were made (a
/// launch's row may not be written or visible yet). A persistent request whose instance
/// terminated opens again and launches another ("To ensure that no new Spot Instance is
/// launched, you must first cancel the Spot request", EC2 User Guide, "Terminate a Spot
/// Instance"). onoff cancels a request as it terminates its instance, and the agent as it exits
/// on an error, but an instance that powers off before its agent runs (the worker image not
/// pulled, the user data failing) leaves its request open: EC2 launched another in its place,
/// which failed the same way, for as long as the image stayed broken. The reaper ends the chain:
/// such a request is open without an instance, or names an instance gone or unknown (an
/// unknown one of ours is an orphan the pass above terminates). A Stopped worker's request
/// (disabled) names a live row and is kept. `live` is the live rows once the lost ones are out.
async fn cancel_orphan_requests<F: FleetLister>(
    fleet: &F,
    live: &[WorkerRecord],
    opts: &ReconcileOptions,
    now: f64,
    report: &mut ReconcileReport,
) {
    let requests = match fleet.list_spot_requests().await {
        Ok(r) => r,
        Err(e) => {
            report.errors.push(format!("list spot requests: {e}"));
            return;
        }
    };
    let known: BTreeSet<&str> = live.iter().map(|w| w.id.as_str()).collect();
    let orphans: Vec<String> = requests
        .into_iter()
        .filter(|r| now - r.created_at >= opts.launch_grace_s)
        .filter(|r| !r.is_held(|i| known.contains(i)))
        .map(|r| r.id)
        .collect();
    if orphans.is_empty() {
        return;
    }
    match fleet.cancel_spot_requests(&orphans).await {
        Ok(()) => report.spot_requests_cancelled = orphans,
        Err(e) => report.errors.push(format!("cancel spot requests {orphans:?}: {e}")),
    }
}

/// Register instance `i`, which no live worker row knows, as a booting worker of its lane, when
/// it is a launch whose registration failed: tagged with a lane of the policy, younger than
/// `boot_timeout_s`, and with no row at all ([`Unknown::Retired`] when its row is Terminating).
/// Its price is its offering's in the catalogue, its project and pinned job the ones its tags
/// name.
///
/// Without this, a launch whose `register_launch` failed after CreateFleet (throttling past the
/// SDK's retries, the function's timeout) was terminated as an orphan once `launch_grace_s`
/// passed, after billing its boot, and the decisions until then did not count it. No grace is
/// needed here: runs hold the reconcile lease one at a time, and the row is conditional
/// (`register_launch` creates, never overwrites), so a row registered meanwhile (a row the scan
/// did not show yet, its agent's own) is kept. If its agent never reports, the boot timeout ends
/// it as any worker's.
///
/// # Errors
/// Store failures.
async fn adopt<W: WorkerRegistry>(
    i: &FleetInstance,
    cfg: &PolicyConfig,
    offerings: &[Offering],
    opts: &ReconcileOptions,
    now: f64,
    workers: &W,
) -> Result<Unknown, StoreError> {
    let Some(lane) = i.lane.as_deref().filter(|l| cfg.lane_index(l).is_some()) else {
        return Ok(Unknown::Other);
    };
    if now - i.launched_at >= opts.boot_timeout_s {
        return Ok(Unknown::Other);
    }
    match workers.get(&i.instance_id).await? {
        Some(row) if row.state == WorkerState::Terminating => return Ok(Unknown::Retired),
        Some(_) => return Ok(Unknown::Other),
        None => {}
    }
    let mut record = WorkerRecord {
        project: i.project.clone(),
        // Launched for a job (a deadline at risk on spot): its agent claims that job first, and
        // the policy counts the worker as that job's capacity, as if registered at launch.
        pinned_job: i.job.clone(),
        ..WorkerRecord::launched(&i.instance_id, lane, i.offering.clone(), 0.0, i.launched_at)
    };
    record.price_usd_per_h = worker_price_usd_per_h(&record, offerings);
    // Conditional: a row registered meanwhile (its agent's, a late scaler's) is kept, and this
    // decision counts the instance as booting either way.
    workers.register_launch(record.clone()).await?;
    Ok(Unknown::Adopted(Box::new(record)))
}

/// Where the offerings a pending job could be launched on stand, by the control plane's stored
/// marks ([`offerings_for`]): what `onoff status` tells of a job that waits.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOfferings {
    /// GPUs per instance the job is launched with (its shape, as the reconciler computes it).
    pub gpus_per_instance: u32,
    /// Offerings its lane may launch for it: the lane's capacity types, the GPU fit and memory,
    /// the configured type, price and interruption filters.
    pub eligible: usize,
    /// Of those, the ones in a vCPU quota found full, and the marks that cover them (each once).
    pub in_full_quotas: usize,
    /// The full quotas.
    pub quotas: Vec<QuotaMark>,
    /// Of the rest, the ones skipped after a capacity error.
    pub after_capacity_errors: usize,
    /// When the last of those skips ends, unix seconds.
    pub capacity_errors_until: Option<f64>,
}

impl JobOfferings {
    /// Offerings neither in a full quota nor skipped: what a launch may take now.
    pub fn free(&self) -> usize {
        self.eligible
            .saturating_sub(self.in_full_quotas + self.after_capacity_errors)
    }
}

/// What [`onoff_policy::choice::eligible`] asks of an offering for one instance of `gpus` GPUs of
/// `min_mem_gib` GiB each in a lane of `capacity` (run time and instance count do not enter it).
fn launch_request(
    gpus: u32,
    min_mem_gib: f64,
    capacity: onoff_policy::CapacityPreference,
) -> onoff_policy::choice::Request {
    onoff_policy::choice::Request {
        gpus,
        min_mem_gib,
        capacity,
        instances: 1,
        runtime_s: 0.0,
    }
}

/// [`JobOfferings`] of a pending job of `spec` at `now`: `offerings` the catalogue, `marks` the
/// control table's unavailable offerings and quota marks as stored
/// ([`OfferingAvailability::list_unavailable`]), `max_gpus_per_instance` the reconciler's
/// ([`ReconcileOptions::max_gpus_per_instance`]). `None` when `cfg` has no lane of the job's.
pub fn offerings_for(
    spec: &JobSpec,
    cfg: &PolicyConfig,
    offerings: &[Offering],
    marks: Vec<onoff_policy::UnavailableOffering>,
    max_gpus_per_instance: u32,
    now: f64,
) -> Option<JobOfferings> {
    let lane = cfg.lanes.get(cfg.lane_index(&spec.lane)?)?;
    let (gpus, _) = shape(&mut Vec::new(), spec, max_gpus_per_instance, offerings, cfg);
    let req = launch_request(
        gpus,
        spec.min_gpu_memory_gib.max(cfg.offers.min_gpu_memory_gib),
        lane.capacity,
    );
    let (quotas, unavailable) = QuotaMark::split(marks.into_iter().filter(|m| m.until > now).collect());
    let eligible: Vec<&Offering> = offerings
        .iter()
        .filter(|o| onoff_policy::choice::eligible(o, &req, &cfg.offers, &[], now))
        .collect();
    let mut out = JobOfferings {
        gpus_per_instance: gpus,
        eligible: eligible.len(),
        in_full_quotas: 0,
        quotas: Vec::new(),
        after_capacity_errors: 0,
        capacity_errors_until: None,
    };
    for o in eligible {
        let covering: Vec<&QuotaMark> = quotas.iter().filter(|m| m.covers(&o.key, o.vcpus)).collect();
        if !covering.is_empty() {
            out.in_full_quotas += 1;
            for m in covering {
                if !out.quotas.contains(m) {
                    out.quotas.push(*m);
                }
            }
        } else if let Some(u) = unavailable.iter().find(|u| u.key == o.key) {
            out.after_capacity_errors += 1;
            out.capacity_errors_until = Some(out.capacity_errors_until.map_or(u.until, |t: f64| t.max(u.until)));
        }
    }
    Some(out)
}

/// The plan's holds for want of any offering (`Reason::NoOffering`) that full quotas explain: for
/// each such hold, the marks of `marks` that left out of the catalogue (`all` less `kept`) an
/// offering the lane's jobs of that many GPUs could otherwise run on (its capacity types, the
/// GPU fit and the configured filters, `onoff_policy::choice::eligible`; availability aside: a
/// refused launch also marks its offering unavailable for a while). Holds no left-out offering
/// explains are not listed.
pub fn blocked_by_quotas(
    plan: &Plan,
    cfg: &PolicyConfig,
    all: &[Offering],
    kept: &[Offering],
    marks: &[QuotaMark],
) -> Vec<BlockedByQuotas> {
    let left_out: Vec<&Offering> = all.iter().filter(|o| !kept.iter().any(|k| k.key == o.key)).collect();
    plan.held
        .iter()
        .filter_map(|h| {
            let onoff_policy::Reason::NoOffering {
                gpus,
                min_gpu_memory_gib,
            } = h.reason
            else {
                return None;
            };
            let lane = cfg.lanes.get(h.lane)?;
            let req = launch_request(gpus, min_gpu_memory_gib, lane.capacity);
            let quotas: Vec<QuotaMark> = quotas_behind(marks, &left_out, |o| {
                onoff_policy::choice::eligible(o, &req, &cfg.offers, &[], 0.0)
            })
            .into_iter()
            .copied()
            .collect();
            (!quotas.is_empty()).then(|| BlockedByQuotas {
                lane: lane.name.clone(),
                gpus,
                min_gpu_memory_gib,
                held: h.count,
                quotas,
            })
        })
        .collect()
}

/// The full vCPU quotas that keep a job of `gpus` GPUs per instance, of at least
/// `min_gpu_memory_gib` GiB each, in `lane` from every offering the lane may launch for it: no
/// offering of `kept` (the catalogue the run decided on, [`without_full_quotas`]) passes the
/// lane's filters for it, and the marks of `marks` left out of it (`all` less `kept`) offerings
/// that would. Empty when it is not so blocked (availability aside, as in [`blocked_by_quotas`]).
pub fn quotas_blocking(
    lane: &onoff_policy::LaneConfig,
    gpus: u32,
    min_gpu_memory_gib: f64,
    cfg: &PolicyConfig,
    all: &[Offering],
    kept: &[Offering],
    marks: &[QuotaMark],
) -> Vec<QuotaMark> {
    let req = launch_request(gpus, min_gpu_memory_gib, lane.capacity);
    let eligible = |o: &Offering| onoff_policy::choice::eligible(o, &req, &cfg.offers, &[], 0.0);
    if kept.iter().any(eligible) {
        return Vec::new();
    }
    let left_out: Vec<&Offering> = all.iter().filter(|o| !kept.iter().any(|k| k.key == o.key)).collect();
    quotas_behind(marks, &left_out, eligible).into_iter().copied().collect()
}

/// The reaper's end of the pending jobs of `pending` that waited past their lane's
/// `quota_wait_limit_s` and that full quotas keep from every offering ([`quotas_blocking`]),
/// where no worker of the lane that may yet run a job (`workers` but those draining or
/// terminating: a stopped one may be started) has the GPUs and GPU memory to run them: each
/// ended FAILED with the quotas to raise in its reason ([`JobStore::fail_waiting`], conditioned
/// on the row as listed in `active`). Returns (job id, reason) of those it ended, and the
/// errors.
#[allow(clippy::too_many_arguments)]
async fn fail_past_quota_wait<J: JobStore>(
    jobs: &J,
    pending: &[PendingJob],
    active: &[JobRecord],
    workers: &[WorkerView],
    cfg: &PolicyConfig,
    all: &[Offering],
    kept: &[Offering],
    marks: &[QuotaMark],
    now: f64,
) -> (Vec<(String, String)>, Vec<String>) {
    let (mut ended, mut errors) = (Vec::new(), Vec::new());
    if cfg.lanes.iter().all(|l| l.quota_wait_limit_s.is_none()) {
        return (ended, errors);
    }
    let rows: BTreeMap<&str, &JobRecord> = active
        .iter()
        .filter(|r| r.state.is_pending())
        .map(|r| (r.id.as_str(), r))
        .collect();
    for p in pending {
        let Some(lane) = cfg.lanes.get(p.lane) else { continue };
        let Some(limit) = lane.quota_wait_limit_s else { continue };
        let Some(row) = rows.get(p.id.as_str()).copied() else {
            continue;
        };
        let waited = now - row.waiting_since();
        if waited < limit {
            continue;
        }
        let min_mem = p.min_gpu_memory_gib.max(cfg.offers.min_gpu_memory_gib);
        if workers.iter().any(|w| {
            w.lane == p.lane
                && !matches!(w.state, WorkerState::Draining | WorkerState::Terminating)
                && w.gpus >= p.gpus_per_instance
                && w.gpu_memory_gib >= min_mem
        }) {
            continue;
        }
        let quotas = quotas_blocking(lane, p.gpus_per_instance, min_mem, cfg, all, kept, marks);
        if quotas.is_empty() {
            continue;
        }
        let advice: Vec<String> = quotas.iter().map(|m| m.bucket.advice(m.capacity, m.vcpus)).collect();
        let reason = format!(
            "waited {waited:.0} s, past lane {}'s quota_wait_limit_s of {limit:.0} s, while full vCPU quotas \
             left out every offering of {} GPU(s) per instance the lane may launch for it: {}",
            lane.name,
            p.gpus_per_instance,
            advice.join("; ")
        );
        match jobs.fail_waiting(row, &reason, now).await {
            Ok(true) => ended.push((p.id.clone(), crate::job::bounded_reason(reason))),
            Ok(false) => {}
            Err(e) => errors.push(format!("end {} past its quota wait limit: {e}", p.id)),
        }
    }
    (ended, errors)
}

/// A worker's price, $/h: as registered; for a worker its agent registered itself, with price
/// 0 (the control plane's own registration failed after the launch, and the agent carries no
/// catalogue), the catalogue's price of its offering, so that spend, the budget breaker and
/// `SpendUsdPerHour` count it.
#[must_use]
pub fn worker_price_usd_per_h(w: &WorkerRecord, offerings: &[Offering]) -> f64 {
    if w.price_usd_per_h > 0.0 {
        return w.price_usd_per_h;
    }
    offerings
        .iter()
        .find(|o| o.key == w.offering)
        .map_or(w.price_usd_per_h, |o| o.price_usd_per_h)
}

/// Shapes already worked out in one reconcile: ((GPUs asked, GiB per GPU bits), shape).
type ShapeMemo = Vec<((u32, u64), (u32, u32))>;

/// Shape of a job for the policy: (GPUs per instance, instances), split at `max` GPUs per
/// instance ([`onoff_policy::shape::job_shape`]) and scheduled past a size the allowed offerings
/// lack ([`onoff_policy::choice::schedule_gpus`]). Shapes repeat: `memo` keeps them per (GPUs, GiB).
fn shape(memo: &mut ShapeMemo, spec: &JobSpec, max: u32, offerings: &[Offering], cfg: &PolicyConfig) -> (u32, u32) {
    let min_mem = spec.min_gpu_memory_gib.max(cfg.offers.min_gpu_memory_gib);
    let key = (spec.gpus, min_mem.to_bits());
    if let Some((_, s)) = memo.iter().find(|(k, _)| *k == key) {
        return *s;
    }
    let (g, n) = onoff_policy::shape::job_shape(spec.gpus, max);
    let s = (
        onoff_policy::choice::schedule_gpus(offerings, g, min_mem, &cfg.offers),
        n,
    );
    memo.push((key, s));
    s
}

/// Observe, reap (if `opts.reap`), decide and act.
///
/// # Errors
/// Only when the state cannot be read at all (workers, jobs or unavailable offerings); failures
/// of single actions are collected in the report.
#[allow(clippy::too_many_arguments)]
pub async fn reconcile<Q, W, J, F, A>(
    cfg: &PolicyConfig,
    offerings: &[Offering],
    opts: &ReconcileOptions,
    now: f64,
    queues: &Q,
    workers: &W,
    jobs: &J,
    fleet: &F,
    avail: &A,
) -> Result<ReconcileReport, StoreError>
where
    Q: JobQueue + Backlog,
    W: WorkerRegistry,
    J: JobStore,
    F: Fleet + FleetLister,
    A: OfferingAvailability + ArrivalStatsStore,
{
    reconcile_asked(cfg, offerings, opts, now, &[], queues, workers, jobs, fleet, avail).await
}

/// Overlay the rows of the jobs `asked` for ([`crate::ports::Asks::jobs`]), read by id
/// (consistently), on `active` as the eventually consistent index listed it: a row the index
/// does not show yet is added, one it shows in an older state replaced, one that has ended since
/// dropped. Returns the ids whose row differed, `None` when the read failed (among the errors;
/// the listing stands); an unreadable row is among the errors and the listing stands for it.
async fn read_asked_jobs<J: JobStore>(
    jobs: &J,
    asked: &[String],
    active: &mut Vec<JobRecord>,
    errors: &mut Vec<String>,
) -> Option<Vec<String>> {
    if asked.is_empty() {
        return Some(Vec::new());
    }
    let read = match jobs.get_many(asked).await {
        Ok(read) => read,
        Err(e) => {
            errors.push(format!("read the {} asked jobs: {e}", asked.len()));
            return None;
        }
    };
    for (id, why) in &read.unreadable {
        errors.push(format!("read asked job {id}: {why}"));
    }
    let unreadable: BTreeSet<&str> = read.unreadable.iter().map(|(id, _)| id.as_str()).collect();
    let mut rows: BTreeMap<&str, &JobRecord> = read
        .items
        .iter()
        .filter(|r| !r.state.is_final())
        .map(|r| (r.id.as_str(), r))
        .collect();
    let mut differed = Vec::new();
    let mut done = BTreeSet::new();
    for id in asked {
        // Read once, whatever the repeats; an unreadable row leaves the listing as it is.
        if !done.insert(id.as_str()) || unreadable.contains(id.as_str()) {
            continue;
        }
        let row = rows.remove(id.as_str());
        let at = active.iter().position(|j| j.id == *id);
        match (at, row) {
            (Some(i), Some(r)) if active[i] != *r => active[i] = r.clone(),
            (Some(_), Some(_)) | (None, None) => continue,
            (None, Some(r)) => active.push(r.clone()),
            (Some(i), None) => {
                active.swap_remove(i);
            }
        }
        differed.push(id.clone());
    }
    Some(differed)
}

/// [`reconcile`], with the jobs scale requests `asked` for read by id past the `active` index
/// ([`ReconcileReport::jobs_read_past_index`]).
///
/// # Errors
/// As [`reconcile`].
#[allow(clippy::too_many_arguments)]
async fn reconcile_asked<Q, W, J, F, A>(
    cfg: &PolicyConfig,
    offerings: &[Offering],
    opts: &ReconcileOptions,
    now: f64,
    asked: &[String],
    queues: &Q,
    workers: &W,
    jobs: &J,
    fleet: &F,
    avail: &A,
) -> Result<ReconcileReport, StoreError>
where
    Q: JobQueue + Backlog,
    W: WorkerRegistry,
    J: JobStore,
    F: Fleet + FleetLister,
    A: OfferingAvailability + ArrivalStatsStore,
{
    let mut report = ReconcileReport::default();
    let listed = workers.list_live().await?;
    let mut live = listed.items;
    report.unreadable.extend(listed.unreadable);
    let listed = jobs.active().await?;
    let mut active = listed.items;
    report.unreadable.extend(listed.unreadable);
    match read_asked_jobs(jobs, asked, &mut active, &mut report.errors).await {
        Some(differed) => report.jobs_read_past_index = differed,
        None => report.asked_jobs_unread = true,
    }
    // Full vCPU quotas are kept among the unavailable offerings; the policy sees the rest.
    let (quotas_full, unavailable) = QuotaMark::split(avail.list_unavailable(now).await?);

    if opts.reap {
        let instances = match fleet.list_managed().await {
            Ok(i) => Some(i),
            Err(e) => {
                report.errors.push(format!("list instances: {e}"));
                None
            }
        };
        // Workers their agent registered itself (price 0: the control plane's registration
        // failed, and the agent has no catalogue) get their offering's price, which their agent
        // reads back and charges its jobs with (their cost records would read $0 otherwise).
        for w in live.iter_mut().filter(|w| w.price_usd_per_h == 0.0) {
            let price = worker_price_usd_per_h(w, offerings);
            if price > 0.0 {
                match workers.set_price_if_unpriced(&w.id, price).await {
                    Ok(_) => w.price_usd_per_h = price,
                    Err(StoreError::NotFound(_)) => {}
                    Err(e) => report.errors.push(format!("price {}: {e}", w.id)),
                }
            }
        }
        let mut lost: BTreeSet<String> = BTreeSet::new();
        if let Some(instances) = &instances {
            let known: BTreeSet<&str> = live.iter().map(|w| w.id.as_str()).collect();
            let unknown: Vec<&FleetInstance> = instances
                .iter()
                .filter(|i| !known.contains(i.instance_id.as_str()))
                .collect();
            let mut orphans: Vec<String> = Vec::new();
            for i in unknown {
                match adopt(i, cfg, offerings, opts, now, workers).await {
                    Ok(Unknown::Adopted(w)) => {
                        report.orphans_adopted.push(w.id.clone());
                        live.push(*w);
                    }
                    Ok(Unknown::Retired) => orphans.push(i.instance_id.clone()),
                    // Left alone within the grace: its row may not be visible yet.
                    Ok(Unknown::Other) if now - i.launched_at >= opts.launch_grace_s => {
                        orphans.push(i.instance_id.clone());
                    }
                    Ok(Unknown::Other) => {}
                    // Neither adopted nor reaped: the next run looks again.
                    Err(e) => report.errors.push(format!("adopt {}: {e}", i.instance_id)),
                }
            }
            if !orphans.is_empty() {
                match fleet.terminate(&orphans).await {
                    Ok(()) => report.orphans_terminated = orphans,
                    Err(e) => report.errors.push(format!("terminate orphans: {e}")),
                }
            }
            let present: BTreeSet<&str> = instances.iter().map(|i| i.instance_id.as_str()).collect();
            for w in live
                .iter()
                .filter(|w| !present.contains(w.id.as_str()) && now - w.launched_at >= opts.launch_grace_s)
            {
                report.workers_gone.push(w.id.clone());
                lost.insert(w.id.clone());
            }
            // A worker onoff did not stop whose instance is stopped (EC2 stopped it: a spot
            // interruption stops a persistent request's instance; a start that found no
            // capacity left it stopped) runs nothing: lost, its jobs re-queued, its instance
            // terminated below, without waiting for its heartbeat or boot to time out.
            let stopped: BTreeSet<&str> = instances
                .iter()
                .filter(|i| i.stopped)
                .map(|i| i.instance_id.as_str())
                .collect();
            let stopped_under: Vec<String> = live
                .iter()
                .filter(|w| w.state != WorkerState::Stopped && stopped.contains(w.id.as_str()))
                .filter(|w| now - w.launched_at >= opts.launch_grace_s)
                .map(|w| w.id.clone())
                .collect();
            if !stopped_under.is_empty() {
                match fleet.terminate(&stopped_under).await {
                    Ok(()) => {
                        report.workers_lost.extend(stopped_under.iter().cloned());
                        lost.extend(stopped_under);
                    }
                    Err(e) => report.errors.push(format!("terminate stopped workers: {e}")),
                }
            }
        }
        // A stopped worker runs no agent: no heartbeat is due from it.
        let stale = |w: &WorkerRecord| match w.heartbeat_at {
            _ if w.state == WorkerState::Stopped => false,
            Some(h) => now - h > opts.heartbeat_timeout_s,
            None => now - w.launched_at > opts.boot_timeout_s,
        };
        let stale_ids: Vec<String> = live
            .iter()
            .filter(|w| !lost.contains(&w.id) && stale(w))
            .map(|w| w.id.clone())
            .collect();
        if !stale_ids.is_empty() {
            match fleet.terminate(&stale_ids).await {
                Ok(()) => {
                    report.workers_lost.extend(stale_ids.iter().cloned());
                    lost.extend(stale_ids);
                }
                Err(e) => report.errors.push(format!("terminate lost workers: {e}")),
            }
        }
        for id in &lost {
            match workers.set_state(id, WorkerState::Terminating).await {
                Ok(()) | Err(StoreError::NotFound(_)) => {}
                Err(e) => report.errors.push(format!("mark {id} terminating: {e}")),
            }
        }
        live.retain(|w| !lost.contains(&w.id));
        if instances.is_some() {
            cancel_orphan_requests(fleet, &live, opts, now, &mut report).await;
        }
        let reaped = reap_jobs(&active, &lost, opts, now, jobs, queues).await;
        // The decision below sees the leases just ended as they now are. Not by listing the
        // active jobs again: the index is eventually consistent and may still show them RUNNING
        // on a lost worker, and their replacement would wait for the next run.
        for (id, to) in &reaped.ended {
            if to.is_final() {
                active.retain(|j| j.id != *id);
            } else if let Some(j) = active.iter_mut().find(|j| j.id == *id) {
                j.state = *to;
                j.lease_owner = None;
                j.lease_expires_at = None;
            }
        }
        // A fresh wake-up message's time, as `wake` recorded it (the quota wait's end is
        // conditioned on it).
        let woken: BTreeSet<&str> = reaped.woken.iter().map(String::as_str).collect();
        for j in active.iter_mut().filter(|j| woken.contains(j.id.as_str())) {
            j.sent_at = Some(now);
        }
        report.jobs_requeued = reaped.requeued;
        report.jobs_failed = reaped.failed;
        report.jobs_woken = reaped.woken;
        report.wake_ups_spared = reaped.spared;
        report.errors.extend(reaped.errors);
    }

    // Observe.
    let mut shapes = ShapeMemo::new();
    let mut lanes: Vec<LaneObservation> = Vec::with_capacity(cfg.lanes.len());
    // Per lane: the run time of a job that declares none, from the lane's last jobs to finish,
    // else the lane's prior (`lanes[].default_runtime_s`); with neither (too few finished, or
    // unreadable) the policy's `offers.default_runtime_s`.
    let mut estimates: BTreeMap<&str, f64> = BTreeMap::new();
    for lane in &cfg.lanes {
        let measured = match jobs
            .finished_run_times(&lane.name, onoff_policy::observation::RUN_TIMES_KEPT as u32)
            .await
        {
            Ok(newest_first) => {
                let mut kept = onoff_policy::RecentRunTimes::default();
                for r in newest_first.into_iter().rev() {
                    kept.record(r);
                }
                kept.estimate_s()
            }
            Err(e) => {
                report.errors.push(format!(
                    "read the run times of lane {}: {e}; jobs that declare none count as {} s",
                    lane.name,
                    lane.default_runtime_s.unwrap_or(cfg.offers.default_runtime_s)
                ));
                None
            }
        };
        if let Some(e) = measured.or(lane.default_runtime_s) {
            estimates.insert(lane.name.as_str(), e);
            report.run_time_estimates.push((lane.name.clone(), e));
        }
    }
    // A job's run time as the policy is given it: declared, or the lane's estimate.
    let runtime_of = |spec: &crate::job::JobSpec| {
        spec.est_runtime_s
            .or_else(|| estimates.get(spec.lane.as_str()).copied())
    };
    for lane in &cfg.lanes {
        // The backlog as the jobs table has it (the lane queue may hold duplicates and
        // messages of finished jobs): pending jobs are waiting, running ones in flight.
        let mut lo = LaneObservation::default();
        for j in active.iter().filter(|j| j.spec.lane == lane.name) {
            match j.state {
                JobState::Queued | JobState::Retrying => lo.backlog.visible += 1,
                JobState::Running => lo.backlog.in_flight += 1,
                _ => {}
            }
        }
        // The lane's arrivals as the simulator sees them: every job's, kept statistics folded
        // run by run (crate::arrivals). The policy reads the look-back of the predictive pool
        // only while the pool is on.
        let lookback_s = if lane.predictive_max > 0 {
            lane.predictive_lookback_s + lane.predictive_window_s
        } else {
            0.0
        };
        let observed = crate::arrivals::observe(jobs, avail, &lane.name, lookback_s, now, &active, |a| {
            let g = shape(&mut shapes, &a.spec, opts.max_gpus_per_instance, offerings, cfg).0;
            (g, runtime_of(&a.spec))
        })
        .await;
        match observed {
            Ok(o) => {
                lo.gaps = o.lane.gaps;
                lo.recent_arrivals = o.lane.recent_arrivals;
                report.arrivals_folded += o.folded;
                report.unreadable.extend(o.unreadable);
                report.errors.extend(o.errors);
            }
            Err(e) => {
                // Without the index (an update of the stack still building it) or the kept
                // statistics: the unfinished jobs of the last 6 h, as before the index.
                report.errors.push(format!(
                    "read the arrivals of lane {}: {e}; deciding on the unfinished jobs' arrivals",
                    lane.name
                ));
                let mut arrivals: Vec<(f64, u32, Option<f64>)> = active
                    .iter()
                    .filter(|j| {
                        j.spec.lane == lane.name
                            && now - j.created_at <= onoff_policy::observation::RECENT_ARRIVALS_KEPT_S
                    })
                    .map(|j| {
                        let g = shape(&mut shapes, &j.spec, opts.max_gpus_per_instance, offerings, cfg).0;
                        (j.created_at, g, runtime_of(&j.spec))
                    })
                    .collect();
                arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
                for (t, g, runtime) in arrivals {
                    lo.record_arrival_with_runtime(g, t, runtime);
                }
            }
        }
        lanes.push(lo);
    }
    let pending: Vec<PendingJob> = active
        .iter()
        .filter(|j| j.state.is_pending())
        .filter_map(|j| {
            let lane = cfg.lane_index(&j.spec.lane)?;
            let (g, n) = shape(&mut shapes, &j.spec, opts.max_gpus_per_instance, offerings, cfg);
            Some(PendingJob {
                id: j.id.clone(),
                lane,
                project: j.spec.project.clone(),
                job_type: j.spec.job_type.clone(),
                gpus_per_instance: g,
                instances: n,
                min_gpu_memory_gib: j.spec.min_gpu_memory_gib,
                est_runtime_s: runtime_of(&j.spec),
                deadline: j.spec.deadline,
                enqueued_at: j.created_at,
            })
        })
        .collect();
    let specs: BTreeMap<&str, &Offering> = offerings.iter().map(|o| (o.key.instance_type.as_str(), o)).collect();
    // When each worker's running job is expected to end: its lease's start plus its declared run
    // time, or the lane's estimate until the job has outlived it by the short-job horizon (short
    // jobs queued behind it would have waited the horizon already; its end is unknown then).
    let busy_until: BTreeMap<&str, f64> = active
        .iter()
        .filter(|j| j.state == JobState::Running)
        .filter_map(|j| {
            let end = j.claimed_at? + runtime_of(&j.spec)?;
            let known = j.spec.est_runtime_s.is_some() || end + cfg.offers.short_job_horizon_s > now;
            Some((j.lease_owner.as_deref()?, end)).filter(|_| known)
        })
        .collect();
    let views: Vec<WorkerView> = live
        .iter()
        .filter_map(|w| {
            let lane = cfg.lane_index(&w.lane)?;
            let spec = specs.get(w.offering.instance_type.as_str());
            Some(WorkerView {
                id: w.id.clone(),
                seq: (w.launched_at * 1000.0) as u64,
                lane,
                offering: w.offering.clone(),
                gpus: spec.map_or(1, |o| o.gpus),
                gpu_memory_gib: spec.map_or(0.0, |o| o.gpu_memory_gib),
                price_usd_per_h: worker_price_usd_per_h(w, offerings),
                state: w.state,
                launched_at: w.launched_at,
                idle_since: w.idle_since,
                project: w.project.clone(),
                job_type: None,
                busy_until: busy_until.get(w.id.as_str()).copied(),
                pinned_job: w.pinned_job.clone(),
                spot_price_usd_per_h: w.spot_price_usd_per_h,
                // A stopped worker's hold is its stopped keep-alive.
                stopped_until: w.hold_until.filter(|_| w.state == WorkerState::Stopped),
                cached_projects: w.cached_projects.clone(),
            })
        })
        .collect();
    // A full quota no live worker of ours holds stays full until the operator raises it: its
    // offerings are no choice for this decision (nor for waiting on).
    let held: Vec<&OfferingKey> = live.iter().map(|w| &w.offering).collect();
    let choice = without_full_quotas(offerings, &quotas_full, &held);
    let offerings_now = choice.as_deref().unwrap_or(offerings);
    let obs = Observation {
        lanes: &lanes,
        jobs: &pending,
        workers: &views,
        offerings: offerings_now,
        unavailable: &unavailable,
        fleet: None,
    };
    report.plan = decide(&obs, cfg, now);
    if choice.is_some() {
        report.blocked_by_quotas = blocked_by_quotas(&report.plan, cfg, offerings, offerings_now, &quotas_full);
        if opts.reap {
            let (ended, errors) = fail_past_quota_wait(
                jobs,
                &pending,
                &active,
                &views,
                cfg,
                offerings,
                offerings_now,
                &quotas_full,
                now,
            )
            .await;
            report.jobs_past_quota_wait = ended;
            report.errors.extend(errors);
        }
    }
    let ctx = ActContext {
        cfg,
        offerings: offerings_now,
        unavailable: &unavailable,
        now,
        table: None,
        run_time_estimates: &report.run_time_estimates,
    };
    report.acted = act(&report.plan, ctx, fleet, workers, avail).await;
    // Every worker the plan releases (terminated, cancelled or stopped), whether or not that went
    // through: a worker whose termination keeps failing is left to its agent's idle exit, never
    // held.
    let ended: Vec<&str> = report.plan.releases().collect();
    let (held, errors) = renew_holds(&live, &ended, workers, now, opts.hold_s).await;
    report.errors.extend(errors);
    let (given, errors) = give_run_time_estimates(&mut live, &ended, &report.run_time_estimates, workers).await;
    report.workers_given_estimates = given;
    report.workers = workers_after(live, &report, &ended, &held, cfg, now, opts.hold_s);
    report.workers_held = held;
    report.errors.extend(errors);
    Ok(report)
}

/// [`ReconcileReport::workers`]: `live` less the workers of `ended` the plan released (not those
/// [`act`] skipped), with `held` held for `hold_s` past `now`, plus the launches of
/// `report.acted`, registered at `now`.
fn workers_after(
    live: Vec<WorkerRecord>,
    report: &ReconcileReport,
    ended: &[&str],
    held: &[String],
    cfg: &PolicyConfig,
    now: f64,
    hold_s: f64,
) -> Vec<WorkerRecord> {
    let acted = &report.acted;
    // Released (terminated or cancelled, or stopped: a stop the provider refused was terminated
    // instead), but for the workers an agent took a job for first.
    let released = |id: &str| {
        ended.contains(&id) && !acted.skipped.iter().any(|s| s == id) && !acted.stopped.iter().any(|s| s == id)
    };
    let mut after: Vec<WorkerRecord> = live.into_iter().filter(|w| !released(&w.id)).collect();
    for w in after.iter_mut() {
        if held.contains(&w.id) {
            w.hold_until = Some(now + hold_s);
        }
        // As `act` wrote them (WorkerRegistry::mark_stopped, mark_started, and for a start
        // refused mark_start_refused after it).
        for a in &report.plan.actions {
            match a {
                Action::Stop { worker, keep_s, .. } if *worker == w.id && acted.stopped.contains(worker) => {
                    w.state = WorkerState::Stopped;
                    w.idle_since = Some(now);
                    w.hold_until = Some(now + keep_s);
                }
                Action::Start {
                    worker,
                    project,
                    job,
                    stopped_at,
                    stopped_until,
                    launched_at,
                    ..
                } if *worker == w.id && !acted.skipped.contains(worker) && w.state == WorkerState::Stopped => {
                    let started = acted.started.contains(worker);
                    w.launched_at = if started { now } else { *launched_at };
                    w.project = project.clone();
                    w.pinned_job = job.clone();
                    w.heartbeat_at = None;
                    if started {
                        w.state = WorkerState::Pending;
                        w.idle_since = None;
                        w.hold_until = None;
                    } else {
                        w.state = WorkerState::Stopped;
                        w.idle_since = *stopped_at;
                        w.hold_until = *stopped_until;
                    }
                }
                _ => {}
            }
        }
    }
    after.extend(
        report
            .acted
            .launched
            .iter()
            .map(|l| l.record(cfg.lanes.get(l.lane).map_or("", |c| c.name.as_str()), now)),
    );
    after
}

/// Hold every idle worker the decision keeps (in `live`, not in `ended`, the workers its plan
/// releases) for `hold_s` seconds past `now`, where less than two thirds of that is left
/// ([`WorkerRegistry::hold_idle`]).
///
/// The agent ends its instance after its idle timeout (`ONOFF_IDLE_TIMEOUT_S`, the template's
/// `WorkerIdleTimeoutSeconds`), a safety net for a control plane that is gone. The policy may
/// keep an idle worker longer, for a warm pool: without a hold the agent would end it and the
/// next decision launch another, paying a cold start for capacity that was ready. A hold is
/// renewed by each decision that still keeps the worker, so it lapses `hold_s` after the last
/// one. Returns the workers held and the errors (never fatal: the next decision retries).
pub async fn renew_holds<W: WorkerRegistry>(
    live: &[WorkerRecord],
    ended: &[&str],
    workers: &W,
    now: f64,
    hold_s: f64,
) -> (Vec<String>, Vec<String>) {
    let (mut held, mut errors) = (Vec::new(), Vec::new());
    let due = |w: &&WorkerRecord| {
        w.state == WorkerState::Idle
            && w.hold_until.is_none_or(|h| h - now < hold_s * 2.0 / 3.0)
            && !ended.contains(&w.id.as_str())
    };
    for w in live.iter().filter(due) {
        match workers.hold_idle(&w.id, now + hold_s).await {
            Ok(true) => held.push(w.id.clone()),
            // Busy, retiring or gone since it was listed: nothing to hold.
            Ok(false) | Err(StoreError::NotFound(_)) => {}
            Err(e) => errors.push(format!("hold {}: {e}", w.id)),
        }
    }
    (held, errors)
}

/// Write each lane's run-time estimate (`estimates`: lane name, seconds;
/// [`ReconcileReport::run_time_estimates`]) on the rows of its live workers that have none and
/// that the plan did not release (`ended`): Pending, Running or Idle workers launched or started
/// before the lane had an estimate or a prior, adopted, or registered by their agent. A worker
/// keeps the figure of its launch or start otherwise ([`WorkerRecord::run_time_estimate_s`]);
/// its agent reads the row again when it claims a job that declares none while it has no
/// figure. Returns the workers written and the errors (a row gone, or one given a figure
/// meanwhile, is skipped). `live` is updated. One conditional write per worker without a figure
/// in a lane with one; none once every row has one.
pub async fn give_run_time_estimates<W: WorkerRegistry>(
    live: &mut [WorkerRecord],
    ended: &[&str],
    estimates: &[(String, f64)],
    workers: &W,
) -> (Vec<String>, Vec<String>) {
    let (mut given, mut errors) = (Vec::new(), Vec::new());
    let due = |w: &WorkerRecord| {
        w.run_time_estimate_s.is_none()
            && matches!(w.state, WorkerState::Pending | WorkerState::Running | WorkerState::Idle)
            && !ended.contains(&w.id.as_str())
    };
    for w in live.iter_mut().filter(|w| due(w)) {
        let Some(&(_, e)) = estimates.iter().find(|(lane, _)| *lane == w.lane) else {
            continue;
        };
        match workers.set_run_time_estimate_if_unset(&w.id, e).await {
            Ok(true) => {
                w.run_time_estimate_s = Some(e);
                given.push(w.id.clone());
            }
            Ok(false) | Err(StoreError::NotFound(_)) => {}
            Err(e) => errors.push(format!("give {} its run-time estimate: {e}", w.id)),
        }
    }
    (given, errors)
}

/// Name of the lease the scaler and the reconciler share.
pub const RECONCILE_LEASE: &str = "reconcile";

/// [`reconcile`] under the [`RECONCILE_LEASE`] held for `lease_ttl_s`: when another invocation
/// holds it, nothing is done and `Ok(None)` is returned (that invocation acts on the same backlog).
/// A run that completes marks its start, `now`, done ([`crate::ports::Lease::mark_done`]): what
/// was asked for before it is decided (a failed mark is among the report's errors). It reads the
/// count of scale requests ([`crate::ports::Lease::asks`]) before it reads anything else and,
/// once done, ends the pending request, if one was pending then, when none came in meanwhile
/// ([`crate::ports::Lease::settle_asks`], [`ReconcileReport::asks_settled`]): askers then invoke
/// afresh, and until then join the pending one instead of queueing an invocation each.
///
/// # Errors
/// As [`reconcile`], and lease store failures.
#[allow(clippy::too_many_arguments)]
pub async fn reconcile_exclusive<Q, W, J, F, A, L>(
    cfg: &PolicyConfig,
    offerings: &[Offering],
    opts: &ReconcileOptions,
    now: f64,
    owner: &str,
    lease_ttl_s: f64,
    queues: &Q,
    workers: &W,
    jobs: &J,
    fleet: &F,
    avail: &A,
    lease: &L,
) -> Result<Option<ReconcileReport>, StoreError>
where
    Q: JobQueue + Backlog,
    W: WorkerRegistry,
    J: JobStore,
    F: Fleet + FleetLister,
    A: OfferingAvailability + ArrivalStatsStore,
    L: crate::ports::Lease,
{
    if !lease.acquire(RECONCILE_LEASE, owner, lease_ttl_s, now).await? {
        return Ok(None);
    }
    // Every ask counted by now is one whose jobs this run reads (asked after they were written):
    // through the index, or by id where the index may lag.
    let asks = lease.asks(RECONCILE_LEASE).await;
    // At most MAX_ASKED_JOBS reads by id per run (one BatchGetItem; 100 rows of up to 400 KB fit
    // the scaler's memory, all 1,099 that may be kept would not); the rest are kept for a later
    // run (the next scheduled one at the latest), which reads them past the index then.
    let asked = asks
        .as_ref()
        .map_or(&[][..], |a| &a.jobs[..a.jobs.len().min(MAX_ASKED_JOBS)]);
    let mut result = reconcile_asked(cfg, offerings, opts, now, asked, queues, workers, jobs, fleet, avail).await;
    if let Ok(report) = &mut result {
        // A scale request asked for before this run started is served by it
        // (`Lease::last_done`). Best effort: without the mark, such requests run again.
        if let Err(e) = lease.mark_done(RECONCILE_LEASE, now).await {
            report.errors.push(format!("mark the run done: {e}"));
        }
        // The asked jobs are decided: later runs need not read them by id (asks made since keep
        // theirs). Best effort: kept, they are read again; kept too when they could not be read.
        if !asked.is_empty() && !report.asked_jobs_unread {
            if let Err(e) = lease.forget_asked_jobs(RECONCILE_LEASE, asked).await {
                report.errors.push(format!("forget the asked jobs: {e}"));
            }
        }
        match &asks {
            // Nothing pending when the run began: an ask since then found none and invoked a
            // run of its own, so there is nothing to end (and no write on an idle run).
            Ok(seen) if seen.pending_since.is_none() => report.asks_settled = Some(true),
            Ok(seen) => match lease.settle_asks(RECONCILE_LEASE, seen.count).await {
                Ok(settled) => report.asks_settled = Some(settled),
                Err(e) => report.errors.push(format!("settle the scale requests: {e}")),
            },
            Err(e) => report.errors.push(format!("count the scale requests: {e}")),
        }
    }
    lease.release(RECONCILE_LEASE, owner).await?;
    result.map(Some)
}
