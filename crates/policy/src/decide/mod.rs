//! `decide`: the whole policy as one pure function, in five phases a reader can follow, each a
//! function of its own with its own table tests:
//!
//! 1. `fleet::fill`: what the fleet is now: spend, live workers per lane, free capacity per
//!    lane by worker class (idle and booting), idle, booting and stopped workers, the budget
//!    breaker.
//! 2. `matching::match_jobs`: queued jobs, per lane most urgent first, matched to free capacity
//!    (idle workers first, then booting ones: a booting worker counts as capacity, so a 3-10
//!    minute GPU cold start causes no duplicate launch); short jobs queue behind each other on one
//!    worker up to the short-job horizon.
//! 3. `scale_up::scale_up`: launches for the unmet jobs, lanes by priority (activation 0 -> 1
//!    apart from the 1 -> N target), with weighted fair share between projects, project quotas,
//!    job-type caps, max workers, the budget breaker and the freeze; a job whose deadline spot
//!    capacity can no longer meet gets on-demand capacity of its own. Stopped workers that fit
//!    are started before anything is launched (`scale_up::push_starts`).
//! 4. `warm::warm_capacity`: ready workers to hold for arrivals not yet here: the scheduled warm
//!    pool, and the predictive one where it pays for itself (stopped workers started first).
//! 5. `scale_down::scale_down`: idle workers past their keep-alive (or at the decay steps),
//!    never busy ones, never within the delay after a scale-up or the minimum run time; booting
//!    workers nothing needs are cancelled. A released worker is stopped where
//!    `scale_down.stop_idle` covers it (kept stopped for its place in line, then terminated),
//!    else terminated. Jobs a worker cap holds make room first: the lane's idle workers none of
//!    them fits go (`make_room`), and, for jobs only the fleet's cap holds, idle workers of any
//!    lane, once the lanes' own releases are counted (`make_room_for_lanes`).

mod fleet;
mod matching;
mod scale_down;
mod scale_up;
mod warm;

use crate::choice::RankMemo;
use crate::config::PolicyConfig;
use crate::observation::{Observation, PendingJob, WorkerView};
use crate::plan::{LanePlan, Plan};

/// A class of free capacity in a lane: workers with the same GPUs, memory and capacity type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FreeClass {
    pub(crate) gpus: u32,
    pub(crate) mem: f64,
    /// Spot workers (a job whose deadline is at risk on spot does not count them).
    pub(crate) spot: bool,
    /// On-demand workers of a spot-first lane: (their price, the best spot price for their
    /// shape), $/h; a job takes them only when [`crate::choice::worth_an_on_demand_worker`].
    pub(crate) on_demand_of_spot: Option<(f64, f64)>,
    pub(crate) idle: u32,
    pub(crate) pending: u32,
    /// Seconds of short-job work the workers already taken from this class can still absorb.
    pub(crate) credit: f64,
}

/// A job shorter than `offers.short_job_horizon_s` does not get a worker of its own: short jobs
/// queue behind each other on one worker (idle, booting or launched now) until their run times add
/// up to the horizon, instead of paying a cold start each. Returns the job's run time when it is
/// short (single-instance, shorter than the horizon).
pub(crate) fn short_runtime(job: &PendingJob, oc: &crate::config::OfferConfig) -> Option<f64> {
    let runtime = job.est_runtime_s.unwrap_or(oc.default_runtime_s);
    (job.instances.max(1) == 1 && runtime < oc.short_job_horizon_s).then_some(runtime)
}

/// Decide what to launch, terminate and cancel. Pure: same inputs, same plan.
///
/// `now` is unix seconds. See the module docs for the phases; every action carries a
/// [`crate::plan::Reason`], every want not acted on lands in [`Plan::held`].
pub fn decide<'a>(obs: &Observation<'a>, cfg: &PolicyConfig, now: f64) -> Plan {
    decide_with_memo(obs, cfg, now, &mut RankMemo::default())
}

/// [`decide`], for a caller that decides many times over one catalogue (the simulator): `memo`
/// keeps the warm pool's offering rankings from one decision to the next while the catalogue, the
/// configuration and the unavailable offerings stay the same, the warm pool's fractile per job
/// shape while its window demand does, and the keep-alive's gap curve per worker size while the
/// shape's arrival statistics do ([`RankMemo`]). The plan is the one [`decide`] returns for the
/// same inputs.
pub fn decide_with_memo<'a>(obs: &Observation<'a>, cfg: &PolicyConfig, now: f64, memo: &mut RankMemo) -> Plan {
    let nl = cfg.lanes.len();
    let mut plan = Plan::default();
    let mut fleet = fleet::Fleet::unlisted(nl);
    fleet.list_lanes(nl);
    fleet::fill(&mut fleet, obs, cfg, now);
    // A lane with no free capacity to match and no room to launch in, and no quota or cap to
    // hold a job for first, holds every job for its limit: nothing reads its jobs' order, and the
    // room only shrinks as lanes ahead of it launch.
    let unordered = |l: usize| fleet.free[l].is_empty() && scale_up::full_before_any(cfg, l, &fleet).is_some();
    let queued = matching::queues(obs, nl, &fleet.pinned_met, unordered);
    let queue_empty: smallvec::SmallVec<[bool; 4]> = queued.iter().map(Vec::is_empty).collect();
    let unmet = matching::match_jobs(cfg, now, queued, &mut fleet);
    let mut lanes: Vec<LanePlan> = unmet
        .iter()
        .map(|u| LanePlan {
            unmet_jobs: u.len() as u32,
            warm_target: 0,
        })
        .collect();
    if unmet.iter().any(|u| !u.is_empty()) {
        fleet.count_running_by_project_and_type(obs, nl);
    }
    scale_up::scale_up(obs, cfg, now, unmet, &mut fleet, &mut plan, memo);
    // Jobs the worker caps held, per lane, before the warm phase adds its own wants held at them.
    let capped = scale_down::held_at_cap(&plan, nl);
    // Of them, those only the fleet's cap holds: any lane's idle worker makes room for them.
    let fleet_held = if nl > 1 {
        scale_down::held_at_fleet_cap(cfg, &fleet, &capped)
    } else {
        0
    };
    let across = fleet_held > 0 && fleet.breaker.is_none();
    let mut kept: Vec<&WorkerView> = Vec::new();
    let released_from = plan.actions.len();
    for (lane, lane_plan) in lanes.iter_mut().enumerate() {
        let warm = warm::warm_capacity(obs, cfg, now, lane, &mut fleet, &mut plan, memo);
        lane_plan.warm_target = warm.target();
        scale_down::scale_down(
            obs,
            cfg,
            now,
            lane,
            &warm,
            queue_empty[lane],
            capped[lane],
            across.then_some(&mut kept),
            &mut fleet,
            &mut plan,
            memo,
        );
    }
    if across {
        let freed = scale_down::released_live(&plan.actions[released_from..]);
        scale_down::make_room_for_lanes(obs, cfg, fleet_held, freed, kept, &mut fleet.stopped, &mut plan, memo);
    }
    plan.lanes = lanes;
    plan
}
