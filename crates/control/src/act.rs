//! Carry out a [`Plan`]: launch with fallback across offerings, terminate, cancel.
//!
//! The launches of one decision that differ only in their offering (the policy's spread) go out
//! as one fleet call with an override per offering, with an idempotency token derived from the
//! decision (its time, the group and the attempt) and the request, so a retried call launches
//! once. Offerings that fail with any error but throttling (no capacity, an unsupported type, an
//! invalid parameter for that type, anything else), or leave the launch short, are marked
//! unavailable for `offers.unavailable_ttl_s`, and the rest of the launch moves to the next best
//! eligible offerings (fallback types), up to [`MAX_FALLBACKS`] times: one bad offering never
//! blocks a lane. A fallback never costs more per job than the launch's `max_cost_usd` (what the
//! job's wait is worth over the best offering); past it, the rest of the launch is left unlaunched
//! and its jobs wait for capacity. An offering refused for a full vCPU quota takes with it every offering of the
//! same quota bucket and capacity type at least as large ([`crate::quota`]), and the error names
//! the quota to raise. A throttled call stops the launch; the next reconcile retries it.
//!
//! Scale-down is conditional: a worker is terminated only after its row moved from Idle (or, for a
//! cancelled launch, Pending) to Terminating in one conditional write. A worker whose agent took a
//! job in the meantime (its row is Running) is left alone and reported in
//! [`ActOutcome::skipped`].

use std::borrow::Cow;

use onoff_policy::choice::{self, Request};
use onoff_policy::{Action, Offering, OfferingKey, Plan, PolicyConfig, Reason, UnavailableOffering, WorkerState};

use crate::ports::{
    Decimal, Fleet, FleetError, FleetErrorKind, LaunchRequest, Launched, OfferingAvailability, WorkerRecord,
    WorkerRegistry,
};
use crate::quota::{held_vcpus, QuotaBucket, QuotaMark};

/// Consecutive launch actions that differ only in their offering.
struct LaunchGroup<'a> {
    lane: usize,
    offerings: Vec<(OfferingKey, f64)>,
    count: u32,
    request: &'a onoff_policy::LaunchShape,
    project: &'a Option<String>,
    job: &'a Option<String>,
    reason: &'a Reason,
}

/// Offerings tried after the first one fails.
pub const MAX_FALLBACKS: usize = 4;

/// For a worker of `offering` in lane `lane`: the best spot price for its shape when the offering
/// is on-demand and the lane may use spot ([`WorkerRecord::spot_price_usd_per_h`]), else `None`.
fn spot_reference(ctx: ActContext<'_>, lane: usize, offering: &OfferingKey) -> Option<f64> {
    let spot_lane = ctx.cfg.lanes.get(lane).is_some_and(|l| l.capacity.may_use_spot());
    if !spot_lane || offering.capacity_type != onoff_policy::CapacityType::OnDemand {
        return None;
    }
    let o = ctx.offerings.iter().find(|o| o.key == *offering)?;
    choice::best_spot_price_usd_per_h(ctx.offerings, o.gpus, o.gpu_memory_gib, &ctx.cfg.offers)
}

/// A worker launched by [`act`], with the reason of its launch.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchedWorker {
    /// The instance.
    pub launched: Launched,
    /// Lane index.
    pub lane: usize,
    /// Project it was launched for.
    pub project: Option<String>,
    /// Job it is pinned to.
    pub job: Option<String>,
    /// Price, $/h.
    pub price_usd_per_h: f64,
    /// On-demand in a lane that may use spot: the best spot price for its shape, $/h
    /// ([`WorkerRecord::spot_price_usd_per_h`]).
    pub spot_price_usd_per_h: Option<f64>,
    /// The lane's run-time estimate at the launch, seconds ([`ActContext::run_time_estimates`],
    /// [`WorkerRecord::run_time_estimate_s`]).
    pub run_time_estimate_s: Option<f64>,
    /// The fewest GPUs a job it runs may ask for ([`WorkerRecord::min_job_gpus`]); `None` when
    /// its offering is not in the catalogue.
    pub min_job_gpus: Option<u32>,
    /// Why it was launched.
    pub reason: Reason,
}

impl LaunchedWorker {
    /// Its row in the workers table as [`act`] registers it: Pending in lane `lane_name`,
    /// launched at `at` (unix seconds).
    pub fn record(&self, lane_name: &str, at: f64) -> WorkerRecord {
        WorkerRecord {
            project: self.project.clone(),
            pinned_job: self.job.clone(),
            spot_price_usd_per_h: self.spot_price_usd_per_h,
            run_time_estimate_s: self.run_time_estimate_s,
            min_job_gpus: self.min_job_gpus,
            ..WorkerRecord::launched(
                &self.launched.instance_id,
                lane_name,
                self.launched.offering.clone(),
                self.price_usd_per_h,
                at,
            )
        }
    }
}

/// What [`act`] did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ActOutcome {
    /// Instances launched.
    pub launched: Vec<LaunchedWorker>,
    /// Offerings that failed (no capacity, or any other error but throttling) and were marked
    /// unavailable.
    pub capacity_errors: Vec<OfferingKey>,
    /// Instances not launched at all after every fallback, with the lane.
    pub unlaunched: Vec<(usize, u32)>,
    /// Workers whose termination was requested.
    pub terminated: Vec<String>,
    /// Idle workers stopped (kept as stopped capacity).
    pub stopped: Vec<String>,
    /// Stopped workers started again.
    pub started: Vec<String>,
    /// Starts refused because the instance is still stopping ([`FleetErrorKind::Stopping`]),
    /// held: nothing launched for them, the worker left stopped for the next decision to start
    /// (the stop recent enough that a start after it still beats a cold start, see
    /// [`onoff_policy::Action::Start`]'s `stopped_at`).
    pub held: Vec<String>,
    /// Launches cancelled.
    pub cancelled: Vec<String>,
    /// Workers the plan would terminate or cancel that were left alone: they were no longer in
    /// the state the plan saw (an agent took a job first).
    pub skipped: Vec<String>,
    /// The vCPU quotas that refused a launch or a start (`<Service Quotas name> (<code>)`, once
    /// per quota and launch call or refused start): metric `LaunchesRefusedByQuota` and the
    /// stack's quota alarm.
    pub quotas_full: Vec<String>,
    /// Other errors, as text for the decision log (never fatal: the next reconcile retries).
    pub errors: Vec<String>,
}

/// Inputs [`act`] reads besides the plan.
#[derive(Debug, Clone, Copy)]
pub struct ActContext<'a> {
    /// The policy configuration (lane names, offer settings).
    pub cfg: &'a PolicyConfig,
    /// Offerings (to rank fallbacks and read prices).
    pub offerings: &'a [Offering],
    /// Offerings already unavailable.
    pub unavailable: &'a [UnavailableOffering],
    /// Now, unix seconds.
    pub now: f64,
    /// The [`choice::PriceTable`] of `offerings` under `cfg.offers`, for a caller that keeps one
    /// across calls (the simulator, over a replay); `None`: [`act`] builds one when a fallback
    /// first needs it.
    pub table: Option<&'a choice::PriceTable>,
    /// Per lane name: the run time, seconds, a job that declares none is taken to have
    /// ([`crate::reconcile::ReconcileReport::run_time_estimates`]); a lane not listed has none.
    /// Written on the rows of the workers launched or started for the lane
    /// ([`WorkerRecord::run_time_estimate_s`]), for their agents.
    pub run_time_estimates: &'a [(String, f64)],
}

impl ActContext<'_> {
    /// The fewest GPUs a job may ask for and run on a worker of `offering`
    /// ([`choice::smallest_job_gpus`]); `None` when the offering is not in the catalogue.
    fn min_job_gpus(&self, offering: &OfferingKey) -> Option<u32> {
        let o = self
            .offerings
            .iter()
            .find(|o| o.key.instance_type == offering.instance_type)?;
        Some(choice::smallest_job_gpus(
            self.offerings,
            o.gpus,
            o.gpu_memory_gib,
            &self.cfg.offers,
        ))
    }

    /// Lane `lane`'s run-time estimate, seconds ([`ActContext::run_time_estimates`]), if any.
    fn run_time_estimate(&self, lane: usize) -> Option<f64> {
        let name = &self.cfg.lanes.get(lane)?.name;
        self.run_time_estimates.iter().find(|(l, _)| l == name).map(|&(_, e)| e)
    }
}

/// Execute `plan` through the ports. Never fails as a whole: per-action errors are collected in
/// [`ActOutcome::errors`] and the next reconcile starts from what exists.
pub async fn act<F, R, A>(plan: &Plan, ctx: ActContext<'_>, fleet: &F, registry: &R, avail: &A) -> ActOutcome
where
    F: Fleet,
    R: WorkerRegistry,
    A: OfferingAvailability,
{
    let mut out = ActOutcome::default();
    let own_table = std::cell::OnceCell::new();
    let table = || match ctx.table {
        Some(t) => t,
        None => own_table.get_or_init(|| choice::PriceTable::new(ctx.offerings, &ctx.cfg.offers)),
    };
    // Offerings unavailable, plus those this call finds short: copied only when one is (the
    // simulator runs this on every decision of a replay that changes the fleet).
    let mut unavailable: Cow<'_, [UnavailableOffering]> = Cow::Borrowed(ctx.unavailable);
    let oc = &ctx.cfg.offers;
    let mut to_terminate: Vec<String> = Vec::new();
    let mut to_cancel = Vec::new();
    let mut to_stop = Vec::new();
    // Consecutive launches that differ only in their offering (the policy's spread) become one
    // call with an override per offering.
    let mut groups: Vec<LaunchGroup<'_>> = Vec::new();
    for action in &plan.actions {
        match action {
            Action::Launch {
                lane,
                offering,
                price_usd_per_h,
                count,
                request,
                project,
                job,
                reason,
            } => {
                let same = groups.last_mut().filter(|g| {
                    g.lane == *lane
                        && g.request == request
                        && g.project == project
                        && g.job == job
                        && g.reason == reason
                        && g.offerings[0].0.capacity_type == offering.capacity_type
                });
                match same {
                    Some(g) => {
                        g.offerings.push((offering.clone(), *price_usd_per_h));
                        g.count += count;
                    }
                    None => groups.push(LaunchGroup {
                        lane: *lane,
                        offerings: vec![(offering.clone(), *price_usd_per_h)],
                        count: *count,
                        request,
                        project,
                        job,
                        reason,
                    }),
                }
            }
            Action::Terminate { worker, .. } => to_terminate.push(worker.clone()),
            Action::CancelLaunch { worker, .. } => to_cancel.push(worker.clone()),
            Action::Stop {
                worker,
                keep_s,
                launched_at,
                ..
            } => to_stop.push((worker.clone(), ctx.now + keep_s, *launched_at)),
            Action::Start { .. } => {}
        }
    }
    // Stopped workers started first: a start that fails becomes a launch of its own.
    groups.extend(
        start_stopped(
            plan,
            ctx,
            table,
            fleet,
            registry,
            avail,
            &mut unavailable,
            &mut to_terminate,
            &mut out,
        )
        .await,
    );
    // The decision's id for the launches' idempotency tokens: now in whole milliseconds, so a
    // retry of the same decision (same time, same plan) sends the same tokens. A launch's id is
    // `decision/group/attempt`, hashed from its parts (`with_token_for_parts`).
    let decision = Decimal::new((ctx.now * 1000.0).round().max(0.0) as u64);
    for (group_index, g) in groups.into_iter().enumerate() {
        let lane_name = ctx
            .cfg
            .lanes
            .get(g.lane)
            .map_or("standard", |l| l.name.as_str())
            .to_string();
        let mut remaining = g.count;
        let mut offerings = g.offerings.clone();
        for attempt in 0..=MAX_FALLBACKS {
            let lr = LaunchRequest {
                lane: lane_name.clone(),
                offerings: offerings.iter().map(|(k, _)| k.clone()).collect(),
                count: remaining,
                project: g.project.clone(),
                job: g.job.clone(),
                client_token: String::new(),
            }
            .with_token_for_parts(&[
                decision.as_bytes(),
                b"/",
                Decimal::new(group_index as u64).as_bytes(),
                b"/",
                Decimal::new(attempt as u64).as_bytes(),
            ]);
            let mut short: Vec<OfferingKey> = Vec::new();
            // Offerings refused for a full vCPU quota: their bucket's siblings are skipped too.
            let mut over_quota: Vec<(OfferingKey, FleetError)> = Vec::new();
            let mut throttled = false;
            let names = |keys: &[OfferingKey]| keys.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            match fleet.launch(&lr).await {
                Ok(res) => {
                    for l in res.launched {
                        remaining = remaining.saturating_sub(1);
                        let price = offerings
                            .iter()
                            .find(|(k, _)| *k == l.offering)
                            .map(|(_, p)| *p)
                            .or_else(|| {
                                ctx.offerings
                                    .iter()
                                    .find(|o| o.key == l.offering)
                                    .map(|o| o.price_usd_per_h)
                            })
                            .unwrap_or(0.0);
                        let spot_price_usd_per_h = spot_reference(ctx, g.lane, &l.offering);
                        let worker = LaunchedWorker {
                            spot_price_usd_per_h,
                            run_time_estimate_s: ctx.run_time_estimate(g.lane),
                            min_job_gpus: ctx.min_job_gpus(&l.offering),
                            launched: l,
                            lane: g.lane,
                            project: g.project.clone(),
                            job: g.job.clone(),
                            price_usd_per_h: price,
                            reason: g.reason.clone(),
                        };
                        if let Err(e) = registry.register_launch(worker.record(&lane_name, ctx.now)).await {
                            out.errors
                                .push(format!("register {}: {e}", worker.launched.instance_id));
                        }
                        out.launched.push(worker);
                    }
                    for (k, e) in res.short {
                        match e.kind {
                            FleetErrorKind::Throttled | FleetErrorKind::AccountLimit => {
                                out.errors.push(format!("launch {k}: {e}"));
                                throttled = true;
                            }
                            FleetErrorKind::InsufficientCapacity => short.push(k),
                            FleetErrorKind::QuotaExceeded => over_quota.push((k, e)),
                            _ => {
                                out.errors
                                    .push(format!("launch {k}: {e} (offering skipped for a while)"));
                                short.push(k);
                            }
                        }
                    }
                    if remaining > 0 && short.is_empty() && over_quota.is_empty() && !throttled {
                        // Fewer than asked with no reason given: every offering of the call is short.
                        short = lr.offerings.clone();
                    }
                }
                Err(
                    e @ FleetError {
                        kind: FleetErrorKind::Throttled | FleetErrorKind::AccountLimit,
                        ..
                    },
                ) => {
                    // Rate limited after the adapter's retries, or a limit of the whole account
                    // (any other offering would be refused the same): stop, mark nothing, the
                    // next reconcile retries.
                    out.errors.push(format!("launch {}: {e}", names(&lr.offerings)));
                    break;
                }
                Err(e) if e.kind == FleetErrorKind::QuotaExceeded => {
                    over_quota = lr.offerings.iter().map(|k| (k.clone(), e.clone())).collect();
                }
                Err(e) => {
                    // No capacity, or any other error (Unsupported, InvalidParameterValue for the
                    // type, ...): the call's offerings are skipped for a while and the launch falls
                    // back, so one bad offering never blocks the lane.
                    if e.kind != FleetErrorKind::InsufficientCapacity {
                        out.errors.push(format!(
                            "launch {}: {e} (offerings skipped for a while)",
                            names(&lr.offerings)
                        ));
                    }
                    short = lr.offerings.clone();
                }
            }
            // Offerings that failed are skipped for a while, even when others filled in; a full
            // quota's siblings too.
            let until = ctx.now + oc.unavailable_ttl_s;
            for key in short.into_iter().chain(over_quota.iter().map(|(k, _)| k.clone())) {
                skip_offering(avail, &mut unavailable, key.clone(), until, &mut out).await;
                out.capacity_errors.push(key);
            }
            note_full_quotas(
                ctx,
                registry,
                avail,
                &mut unavailable,
                &over_quota,
                until,
                "launch",
                "the launch falls back",
                &mut out,
            )
            .await;
            if remaining == 0 || throttled {
                break;
            }
            // Still short: fall back to the next best offerings.
            if attempt == MAX_FALLBACKS {
                break;
            }
            offerings = next_offerings(ctx, table(), g.request, &unavailable);
            if offerings.is_empty() {
                break;
            }
        }
        if remaining > 0 {
            out.unlaunched.push((g.lane, remaining));
        }
    }
    // Idle workers stopped: the row first (Idle -> Stopped, one conditional write, so an agent
    // that took a job meanwhile keeps it), then the instance. One the provider refuses to stop (a
    // spot instance of a one-time request) is terminated instead.
    let mut stop_ids = Vec::new();
    for (id, until, launched_at) in to_stop {
        match registry.mark_stopped(&id, ctx.now, until, launched_at).await {
            Ok(true) | Err(crate::ports::StoreError::NotFound(_)) => stop_ids.push(id),
            Ok(false) => out.skipped.push(id),
            Err(e) => out.errors.push(format!("mark {id} stopped: {e}")),
        }
    }
    if !stop_ids.is_empty() {
        match fleet.stop(&stop_ids).await {
            Ok(refused) => {
                for (id, e) in &refused {
                    out.errors.push(format!("stop {id}: {e} (terminated instead)"));
                    match registry
                        .set_state_if(id, WorkerState::Terminating, &[WorkerState::Stopped])
                        .await
                    {
                        Ok(true) | Err(crate::ports::StoreError::NotFound(_)) => to_terminate.push(id.clone()),
                        Ok(false) => out.skipped.push(id.clone()),
                        Err(e) => out.errors.push(format!("mark {id} terminating: {e}")),
                    }
                }
                out.stopped
                    .extend(stop_ids.into_iter().filter(|id| !refused.iter().any(|(r, _)| r == id)));
            }
            Err(e) => {
                // Nothing stopped: the rows go back to Idle, and the next decision releases them
                // again.
                out.errors.push(format!("stop {stop_ids:?}: {e}"));
                for id in &stop_ids {
                    if let Err(e) = registry
                        .set_state_if(id, WorkerState::Idle, &[WorkerState::Stopped])
                        .await
                    {
                        out.errors.push(format!("mark {id} idle again: {e}"));
                    }
                }
            }
        }
    }
    for (planned, cancel) in [(to_terminate, false), (to_cancel, true)] {
        // The policy releases Idle and Stopped workers (and those just refused a stop, already
        // Terminating) and cancels Pending launches; a worker whose agent has taken a job since
        // (Running) must not be terminated under it.
        let from: &[WorkerState] = if cancel {
            &[WorkerState::Pending]
        } else {
            &[WorkerState::Idle, WorkerState::Stopped]
        };
        let mut ids = Vec::new();
        for id in planned {
            match registry.set_state_if(&id, WorkerState::Terminating, from).await {
                // Gone from the table: the instance is still retired (idempotent at the fleet).
                Ok(true) | Err(crate::ports::StoreError::NotFound(_)) => ids.push(id),
                Ok(false) => out.skipped.push(id),
                // Not known to be idle: left for the next reconcile.
                Err(e) => out.errors.push(format!("mark {id} terminating: {e}")),
            }
        }
        if ids.is_empty() {
            continue;
        }
        let r = if cancel {
            fleet.cancel_launch(&ids).await
        } else {
            fleet.terminate(&ids).await
        };
        match r {
            Ok(()) => {
                if cancel {
                    out.cancelled.extend(ids);
                } else {
                    out.terminated.extend(ids);
                }
            }
            Err(e) => out
                .errors
                .push(format!("{} {ids:?}: {e}", if cancel { "cancel" } else { "terminate" })),
        }
    }
    out
}

/// The offerings a launch for `request` falls back to, with their prices: the best eligible ones
/// (availability as `unavailable` says), spread as the policy spreads (within the cost tolerance
/// of the best) and of the best's capacity type only. One fleet call launches one capacity type
/// (its target's; an override names none), and EC2 refuses a call with two overrides of one
/// instance type in one subnet ("duplicate instance pools"), which a spot-first request's ranking
/// of both capacity types could otherwise send. Never dearer than the job's wait is worth (the
/// launch's `max_cost_usd`). Empty when nothing is left.
fn next_offerings(
    ctx: ActContext<'_>,
    table: &choice::PriceTable,
    request: &onoff_policy::LaunchShape,
    unavailable: &[UnavailableOffering],
) -> Vec<(OfferingKey, f64)> {
    let oc = &ctx.cfg.offers;
    let req = Request {
        gpus: request.gpus,
        min_mem_gib: request.min_gpu_memory_gib,
        capacity: request.capacity,
        instances: 1,
        runtime_s: request.runtime_s,
    };
    let mut ranked = table.top(ctx.offerings, &req, unavailable, ctx.now, oc.diversify as usize);
    if let Some(max) = request.max_cost_usd {
        ranked.retain(|&(_, c)| c <= max * (1.0 + 1e-9));
    }
    let capacity = ranked.first().map(|(o, _)| o.key.capacity_type);
    choice::spread_pool(&ranked, oc)
        .into_iter()
        .filter(|o| Some(o.key.capacity_type) == capacity)
        .map(|o| (o.key.clone(), o.price_usd_per_h))
        .collect()
}

/// Carry out the plan's starts of stopped workers: each row first (Stopped -> Pending for its
/// project and pinned job, one conditional write), then one start call. A worker that does not
/// start (no capacity for its type in its zone: its offering is marked unavailable; its vCPU
/// quota full, as EC2 counts a start against it: the quota is marked as a launch's refusal
/// marks it, with every offering it covers; any other error; a row no longer Stopped) goes
/// back to Stopped, and its capacity is launched instead:
/// returned as launch groups of one instance each, from the next best offerings. One whose
/// instance is gone ([`FleetErrorKind::NotFound`]: terminated, or shutting down) is also added to
/// `to_terminate`, so its row is retired in this run instead of being offered to the next
/// decision as a stopped worker.
#[allow(clippy::too_many_arguments)]
async fn start_stopped<'p, 't, F, R, A>(
    plan: &'p Plan,
    ctx: ActContext<'_>,
    table: impl Fn() -> &'t choice::PriceTable,
    fleet: &F,
    registry: &R,
    avail: &A,
    unavailable: &mut Cow<'_, [UnavailableOffering]>,
    to_terminate: &mut Vec<String>,
    out: &mut ActOutcome,
) -> Vec<LaunchGroup<'p>>
where
    F: Fleet,
    R: WorkerRegistry,
    A: OfferingAvailability,
{
    let mut starting: Vec<&'p Action> = Vec::new();
    let mut failed: Vec<&'p Action> = Vec::new();
    for a in &plan.actions {
        if let Action::Start {
            worker,
            lane,
            project,
            job,
            ..
        } = a
        {
            let estimate = ctx.run_time_estimate(*lane);
            match registry
                .mark_started(worker, ctx.now, project.as_deref(), job.as_deref(), estimate)
                .await
            {
                Ok(true) => starting.push(a),
                Ok(false) | Err(crate::ports::StoreError::NotFound(_)) => {
                    out.skipped.push(worker.clone());
                    failed.push(a);
                }
                Err(e) => {
                    out.errors.push(format!("mark {worker} started: {e}"));
                    failed.push(a);
                }
            }
        }
    }
    let id_of = |a: &Action| match a {
        Action::Start { worker, .. } => worker.clone(),
        _ => String::new(),
    };
    if !starting.is_empty() {
        let ids: Vec<String> = starting.iter().map(|a| id_of(a)).collect();
        let refused = match fleet.start(&ids).await {
            Ok(refused) => refused,
            Err(e) => ids.iter().map(|id| (id.clone(), e.clone())).collect(),
        };
        let until = ctx.now + ctx.cfg.offers.unavailable_ttl_s;
        for a in starting {
            let Action::Start {
                worker,
                offering,
                job,
                stopped_at,
                stopped_until,
                launched_at,
                ..
            } = a
            else {
                continue;
            };
            let Some((_, e)) = refused.iter().find(|(id, _)| id == worker) else {
                out.started.push(worker.clone());
                continue;
            };
            // Stopped again, since its stop, kept and launched as before the start.
            if let Err(e) = registry
                .mark_start_refused(worker, ctx.now, *launched_at, *stopped_at, *stopped_until)
                .await
            {
                out.errors.push(format!("mark {worker} stopped again: {e}"));
            }
            if matches!(
                e.kind,
                FleetErrorKind::InsufficientCapacity | FleetErrorKind::QuotaExceeded
            ) {
                skip_offering(avail, unavailable, offering.clone(), until, out).await;
                out.capacity_errors.push(offering.clone());
                // EC2 counts a started instance against its vCPU quota as it counts a launched
                // one: the quota is marked as a launch marks it, so the launch in its place
                // goes to another bucket or capacity type instead of meeting the same refusal.
                if e.kind == FleetErrorKind::QuotaExceeded {
                    note_full_quotas(
                        ctx,
                        registry,
                        avail,
                        unavailable,
                        &[(offering.clone(), e.clone())],
                        until,
                        &format!("start {worker} on"),
                        "a launch takes its place",
                        out,
                    )
                    .await;
                }
            } else if e.kind == FleetErrorKind::NotFound {
                out.errors
                    .push(format!("start {worker}: {e} (terminated, launching instead)"));
                to_terminate.push(worker.clone());
            } else if e.kind == FleetErrorKind::Stopping && holds_for_stop(ctx, job.as_deref(), *stopped_at) {
                // Not an error: EC2 is still stopping it. The next decision starts it, sooner
                // than a cold start would be up.
                out.held.push(worker.clone());
                continue;
            } else {
                out.errors.push(format!("start {worker}: {e} (launching instead)"));
            }
            failed.push(a);
        }
    }
    failed
        .into_iter()
        .filter_map(|a| {
            let Action::Start {
                lane,
                request,
                project,
                job,
                reason,
                ..
            } = a
            else {
                return None;
            };
            let offerings = next_offerings(ctx, table(), request, unavailable);
            if offerings.is_empty() {
                out.unlaunched.push((*lane, 1));
                return None;
            }
            Some(LaunchGroup {
                lane: *lane,
                offerings,
                count: 1,
                request,
                project,
                job,
                reason,
            })
        })
        .collect()
}

/// Whether a start refused because its instance is still stopping is held rather than launched
/// for: the start is not pinned to a job (a deadline at risk keeps its launch), and the worker
/// was stopped at `stopped_at` less than `boot_estimate_s - restart_estimate_s` ago. Within
/// that, a start once the stop is over still beats a cold start launched now, which also leaves
/// the stopped worker unused; past it (EC2 stops for "several minutes" at times, and may be
/// stuck) a launch is the faster bet. Unknown `stopped_at`: not held.
fn holds_for_stop(ctx: ActContext<'_>, job: Option<&str>, stopped_at: Option<f64>) -> bool {
    let oc = &ctx.cfg.offers;
    job.is_none() && stopped_at.is_some_and(|t| ctx.now - t < oc.boot_estimate_s - oc.restart_estimate_s)
}

/// Handle a spot interruption notice or rebalance recommendation for a worker: mark it Draining
/// (it takes no new work) and its offering unavailable for `offers.unavailable_ttl_s`, so the next
/// decision launches replacement capacity elsewhere. The worker is not terminated and its job is
/// not re-queued here: after a spot warning its agent releases the job and AWS reclaims the
/// instance; after a rebalance recommendation the job runs on. Idempotent; a worker already
/// Terminating stays so.
///
/// # Errors
/// Store failures other than the worker being gone.
pub async fn handle_interruption_notice<R, A>(
    registry: &R,
    avail: &A,
    cfg: &PolicyConfig,
    worker_id: &str,
    offering: &OfferingKey,
    now: f64,
) -> Result<(), crate::ports::StoreError>
where
    R: WorkerRegistry,
    A: OfferingAvailability,
{
    let live = [
        WorkerState::Pending,
        WorkerState::Running,
        WorkerState::Idle,
        WorkerState::Draining,
    ];
    match registry.set_state_if(worker_id, WorkerState::Draining, &live).await {
        Ok(_) | Err(crate::ports::StoreError::NotFound(_)) => {}
        Err(e) => return Err(e),
    }
    avail
        .mark_unavailable(offering, now + cfg.offers.unavailable_ttl_s)
        .await
}

/// The offerings of one launch call that one full quota refused, and the quota as [`act`] marks
/// it (from the fewest vCPUs among them up).
struct QuotaNote<'a> {
    mark: QuotaMark,
    keys: Vec<OfferingKey>,
    error: &'a FleetError,
}

/// Skip offering `key` until `until` (unix seconds): marked unavailable for the next runs
/// (a failed mark is an error line) and for the rest of this one.
async fn skip_offering<A: OfferingAvailability>(
    avail: &A,
    unavailable: &mut Cow<'_, [UnavailableOffering]>,
    key: OfferingKey,
    until: f64,
    out: &mut ActOutcome,
) {
    if let Err(e) = avail.mark_unavailable(&key, until).await {
        out.errors.push(format!("mark unavailable {key}: {e}"));
    }
    unavailable.to_mut().push(UnavailableOffering { key, until });
}

/// Note the vCPU quotas that refused `over_quota` (offerings, each with EC2's refusal): one mark
/// per quota (bucket and capacity type, from the fewest vCPUs refused up) stored among the
/// unavailable offerings until `until`, read back by the next runs; the quota named in
/// `out.quotas_full`; and one error line each: `what`, the offerings the quota refused, EC2's
/// error, the advice and `then`. Every other offering of the catalogue a full quota covers, in
/// any zone, not yet unavailable, is skipped until `until` too ([`skip_offering`]; not a
/// capacity error): without them a fallback would try the bucket's next types one call at a
/// time, each refused for the same quota, and never reach another bucket or capacity type. The
/// refused offerings themselves are the caller's to skip. Each mark gets its ceiling
/// ([`QuotaMark::ceiling`]) from the vCPUs `registry`'s live workers hold in its quota (one read
/// of the registry; none when it fails). (Nothing refused, the usual case: no pass over the
/// catalogue, no read.)
#[allow(clippy::too_many_arguments)]
async fn note_full_quotas<R: WorkerRegistry, A: OfferingAvailability>(
    ctx: ActContext<'_>,
    registry: &R,
    avail: &A,
    unavailable: &mut Cow<'_, [UnavailableOffering]>,
    over_quota: &[(OfferingKey, FleetError)],
    until: f64,
    what: &str,
    then: &str,
    out: &mut ActOutcome,
) {
    if over_quota.is_empty() {
        return;
    }
    // What our live workers hold of each quota (this run's launches registered already).
    let held = match registry.list_live().await {
        Ok(l) if l.unreadable.is_empty() => {
            let keys: Vec<&OfferingKey> = l.items.iter().map(|w| &w.offering).collect();
            held_vcpus(&keys, ctx.offerings)
        }
        Ok(_) => None,
        Err(e) => {
            out.errors.push(format!("list workers for a full quota's ceiling: {e}"));
            None
        }
    };
    let mut notes: Vec<QuotaNote> = Vec::new();
    for (k, e) in over_quota {
        let vcpus = ctx.offerings.iter().find(|o| o.key == *k).map_or(0, |o| o.vcpus);
        let bucket = QuotaBucket::of(&k.instance_type);
        match notes
            .iter_mut()
            .find(|n| n.mark.bucket == bucket && n.mark.capacity == k.capacity_type)
        {
            Some(n) => {
                n.mark.vcpus = n.mark.vcpus.min(vcpus);
                n.keys.push(k.clone());
            }
            None => notes.push(QuotaNote {
                mark: QuotaMark {
                    bucket,
                    capacity: k.capacity_type,
                    vcpus,
                    until,
                    ceiling: None,
                },
                keys: vec![k.clone()],
                error: e,
            }),
        }
    }
    for n in &mut notes {
        // None when the refused type is not in the catalogue (0 vCPUs): its size, and so the
        // ceiling, unknown.
        let m = &mut n.mark;
        m.ceiling = held.as_ref().filter(|_| m.vcpus > 0).map(|h| {
            let of_quota = h
                .iter()
                .find(|(b, c, _)| *b == m.bucket && *c == m.capacity)
                .map_or(0, |&(_, _, v)| v);
            of_quota + m.vcpus
        });
    }
    let siblings: Vec<OfferingKey> = ctx
        .offerings
        .iter()
        .filter(|o| notes.iter().any(|n| n.mark.covers(&o.key, o.vcpus)))
        .filter(|o| !over_quota.iter().any(|(q, _)| *q == o.key))
        .filter(|o| !unavailable.iter().any(|u| u.key == o.key && u.until > ctx.now))
        .map(|o| o.key.clone())
        .collect();
    for n in notes {
        let QuotaMark {
            bucket,
            capacity,
            vcpus,
            ..
        } = n.mark;
        if let Err(e) = avail.mark_unavailable(&n.mark.key(), until).await {
            out.errors.push(format!("mark quota {}: {e}", bucket.name(capacity)));
        }
        out.quotas_full.push(match bucket.code(capacity) {
            Some(code) => format!("{} ({code})", bucket.name(capacity)),
            None => bucket.name(capacity),
        });
        let keys = n.keys.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        let ceiling = match n.mark.ceiling {
            Some(c) if c > vcpus => format!(
                "; this deployment's workers hold {} vCPUs of it, so types of {c} vCPUs or more would not fit even \
                 once they end, and are left out of the choice while the mark lasts",
                c - vcpus
            ),
            _ => String::new(),
        };
        out.errors.push(format!(
            "{what} {keys}: {}: {}; every {} offering of those families with at least {vcpus} vCPUs is skipped for {} s \
             and {then}{ceiling}",
            n.error,
            bucket.advice(capacity, vcpus),
            capacity.as_str(),
            ctx.cfg.offers.unavailable_ttl_s
        ));
    }
    for key in siblings {
        skip_offering(avail, unavailable, key, until, out).await;
    }
}
