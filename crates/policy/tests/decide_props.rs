//! Property tests of `decide` over random observations: 0..200 queued jobs of 1/2/4/8 GPUs,
//! 0..100 workers in random states with random idle times, random limits, one or two lanes.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};

use common::*;
use onoff_policy::{
    decide, keepalive, Action, CapacityPreference, CapacityType, DemandWindows, KeepAliveMode, LaneConfig,
    LaneObservation, Observation, Offering, PendingJob, Plan, PolicyConfig, ProjectQuota, Reason, StopIdle,
    UnavailableOffering, WarmWindow, WorkerState, WorkerView,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

const PROJECTS: [&str; 4] = ["p0", "p1", "p2", "p3"];
const TYPES: [&str; 2] = ["t0", "t1"];
const STATES: [WorkerState; 6] = [
    WorkerState::Pending,
    WorkerState::Running,
    WorkerState::Idle,
    WorkerState::Draining,
    WorkerState::Terminating,
    WorkerState::Stopped,
];

/// The test catalogue plus a 2-GPU type (so every job shape has an offering).
fn prop_offerings() -> Vec<Offering> {
    let mut v = offerings();
    v.push(offering("g2.gpu2", CapacityType::Spot, 2, "NVIDIA A10G", 24.0, 0.25));
    v.push(offering(
        "g2.gpu2",
        CapacityType::OnDemand,
        2,
        "NVIDIA A10G",
        24.0,
        1.00,
    ));
    v
}

#[derive(Debug, Clone)]
struct Case {
    cfg: PolicyConfig,
    lanes: Vec<LaneObservation>,
    jobs: Vec<PendingJob>,
    workers: Vec<WorkerView>,
    offerings: Vec<Offering>,
    unavailable: Vec<UnavailableOffering>,
    now: f64,
}

impl Case {
    fn obs(&self) -> Observation<'_> {
        obs(
            &self.lanes,
            &self.jobs,
            &self.workers,
            &self.offerings,
            &self.unavailable,
        )
    }
}

// (lane selector, project, job type (2 = none), GPUs, instances, min memory, runtime, deadline offset, age)
type RawJob = (u8, u8, u8, u32, u32, f64, Option<f64>, Option<f64>, f64);
// (lane selector, state, GPUs, launched s ago, idle share of that, project, job type)
type RawWorker = (u8, usize, u32, f64, f64, Option<u8>, Option<u8>);

fn raw_job() -> impl Strategy<Value = RawJob> {
    (
        any::<u8>(),
        0u8..4,
        0u8..3,
        prop::sample::select(vec![1u32, 2, 4, 8]),
        prop_oneof![9 => Just(1u32), 1 => Just(2u32)],
        prop::sample::select(vec![0.0, 24.0, 32.0]),
        prop::option::of(60.0f64..36_000.0),
        prop::option::weighted(0.2, -2000.0f64..20_000.0),
        0.0f64..3600.0,
    )
}

fn raw_worker() -> impl Strategy<Value = RawWorker> {
    (
        any::<u8>(),
        0usize..STATES.len(),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        0.0f64..7200.0,
        0.0f64..=1.0,
        prop::option::of(0u8..4),
        prop::option::weighted(0.3, 0u8..2),
    )
}

#[derive(Debug, Clone)]
struct Limits {
    two_lanes: bool,
    /// With two lanes, every job in the first: the second's idle workers match none (the fleet's
    /// cap holding the first lane's jobs makes room there).
    jobs_in_first: bool,
    max_total: u32,
    lane_max: [u32; 2],
    quotas: Vec<Option<u32>>,
    weights: Vec<f64>,
    type_caps: Vec<Option<u32>>,
    budget: Option<f64>,
    frozen: bool,
    jobs_per_worker: u32,
    activation: u32,
    band: u32,
    mode: KeepAliveMode,
    warm: Option<(u32, u32, u32)>,
    min_runtime: f64,
    delay: f64,
    count_delayed: bool,
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        (any::<bool>(), 1u32..=80, 1u32..=40, 1u32..=40),
        (
            prop::collection::vec(prop::option::weighted(0.4, 0u32..24), 4),
            prop::collection::vec(0.5f64..4.0, 4),
        ),
        (
            prop::collection::vec(prop::option::weighted(0.5, 0u32..6), 2),
            prop::option::weighted(0.3, 0.5f64..60.0),
            prop::bool::weighted(0.1),
        ),
        (
            1u32..=2,
            0u32..=3,
            1u32..=2,
            prop::sample::select(vec![
                KeepAliveMode::Adaptive,
                KeepAliveMode::CooldownDecay,
                KeepAliveMode::Fixed,
            ]),
            prop::option::weighted(0.4, (0u32..24, 1u32..=24, 0u32..=3)),
            prop::sample::select(vec![0.0, 60.0, 600.0]),
            prop::sample::select(vec![0.0, 120.0, 600.0]),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (two_lanes, max_total, a, b),
                (quotas, weights),
                (type_caps, budget, frozen),
                (jobs_per_worker, activation, band, mode, warm, min_runtime, delay, count_delayed),
            )| Limits {
                two_lanes,
                // A quarter of the cases, from a draw made anyway (a draw of its own would shift
                // every case after it).
                jobs_in_first: b % 4 == 0,
                max_total,
                lane_max: [a, b],
                quotas,
                weights,
                type_caps,
                budget,
                frozen,
                jobs_per_worker,
                activation,
                band,
                mode,
                warm,
                min_runtime,
                delay,
                count_delayed,
            },
        )
}

// (per-lane backlog (visible, in flight, delayed), arrivals (lane, GPUs, gap), unavailable mask,
//  unavailable until - now, seconds into the day)
type RawWorld = (Vec<(u32, u32, u32)>, Vec<(u8, u32, f64)>, u16, f64, f64);

fn raw_world() -> impl Strategy<Value = RawWorld> {
    (
        prop::collection::vec((0u32..60, 0u32..60, 0u32..10), 2),
        prop::collection::vec(
            (0u8..2, prop::sample::select(vec![1u32, 2, 4, 8]), 1.0f64..3000.0),
            0..60,
        ),
        any::<u16>(),
        -100.0f64..300.0,
        0.0f64..86_400.0,
    )
}

fn build(l: Limits, raw_jobs: Vec<RawJob>, raw_workers: Vec<RawWorker>, world: RawWorld) -> Case {
    let nl = if l.two_lanes { 2 } else { 1 };
    let (backlogs, arrivals, mask, until, tod) = world;
    let now = DAY0 + tod;

    let mut lanes_cfg = Vec::new();
    for i in 0..nl {
        let max_workers = l.lane_max[i];
        let lc = LaneConfig {
            name: if nl == 2 && i == 0 { "express" } else { "standard" }.into(),
            priority: if nl == 2 && i == 0 { 0 } else { 1 },
            capacity: if nl == 2 && i == 0 {
                CapacityPreference::OnDemand
            } else {
                CapacityPreference::SpotFirst
            },
            max_workers,
            activation_backlog: l.activation,
            jobs_per_worker: l.jobs_per_worker,
            warm_pool: l
                .warm
                .iter()
                .map(|&(start_hour, end_hour, size)| WarmWindow {
                    start_hour,
                    end_hour,
                    size: size.min(max_workers),
                })
                .collect(),
            warm_pool_gpus: 1,
            ..LaneConfig::default()
        };
        lanes_cfg.push(lc);
    }
    let mut cfg = PolicyConfig {
        lanes: lanes_cfg,
        ..Default::default()
    };
    cfg.scale_down.mode = l.mode;
    // Idle workers stopped or terminated: a third of the cases each way (the workers are spot).
    cfg.scale_down.stop_idle =
        [StopIdle::Never, StopIdle::OnDemand, StopIdle::SpotAndOnDemand][l.max_total as usize % 3];
    cfg.anti_thrash.scale_up_unmet_jobs = l.band;
    cfg.anti_thrash.min_runtime_s = l.min_runtime;
    cfg.anti_thrash.scale_down_delay_after_scale_up_s = l.delay;
    cfg.limits.max_workers_total = l.max_total;
    cfg.limits.max_usd_per_h = l.budget;
    cfg.limits.frozen = l.frozen;
    cfg.limits.count_delayed = l.count_delayed;
    for (i, p) in PROJECTS.iter().enumerate() {
        if l.quotas[i].is_some() || i % 2 == 0 {
            cfg.limits.projects.insert(
                p.to_string(),
                ProjectQuota {
                    max_gpus: l.quotas[i],
                    weight: l.weights[i],
                },
            );
        }
    }
    for (i, t) in TYPES.iter().enumerate() {
        if let Some(c) = l.type_caps[i] {
            cfg.limits.job_type_caps.insert(t.to_string(), c);
        }
    }

    let jobs: Vec<PendingJob> = raw_jobs
        .into_iter()
        .enumerate()
        .map(
            |(i, (ls, p, t, gpus, instances, mem, runtime, deadline, age))| PendingJob {
                id: format!("j{i}"),
                lane: if l.jobs_in_first { 0 } else { ls as usize % nl },
                project: PROJECTS[p as usize].into(),
                job_type: TYPES.get(t as usize).map(|s| s.to_string()),
                gpus_per_instance: gpus,
                instances,
                min_gpu_memory_gib: mem,
                est_runtime_s: runtime,
                deadline: deadline.map(|d| now + d),
                enqueued_at: now - age,
            },
        )
        .collect();

    let workers: Vec<WorkerView> = raw_workers
        .into_iter()
        .enumerate()
        .map(|(i, (ls, s, gpus, launched_ago, idle_share, p, t))| {
            let state = STATES[s];
            let idle_since =
                matches!(state, WorkerState::Idle | WorkerState::Stopped).then_some(now - launched_ago * idle_share);
            let mut w = worker(&format!("w{i}"), i as u64, state, gpus, now - launched_ago, idle_since);
            // Half the stopped workers have their keep recorded: up to an hour after their stop.
            if state == WorkerState::Stopped && i % 2 == 0 {
                w.stopped_until = idle_since.map(|t| t + 3600.0 * idle_share);
            }
            w.lane = ls as usize % nl;
            w.project = p.map(|p| PROJECTS[p as usize].to_string());
            w.job_type = t.map(|t| TYPES[t as usize].to_string());
            w
        })
        .collect();

    let mut lanes: Vec<LaneObservation> = backlogs[..nl]
        .iter()
        .map(|&(v, f, d)| {
            let mut lo = lane(v, f);
            lo.backlog.delayed = d;
            lo
        })
        .collect();
    let mut clock: BTreeMap<(usize, u32), f64> = BTreeMap::new();
    for (ls, gpus, gap) in arrivals {
        let lane_i = ls as usize % nl;
        let t = clock.entry((lane_i, gpus)).or_insert(now - 100_000.0);
        *t += gap;
        lanes[lane_i].record_arrival(gpus, *t);
    }

    let offerings = prop_offerings();
    let unavailable = offerings
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0 && mask & 0x8000 != 0)
        .map(|(_, o)| UnavailableOffering {
            key: o.key.clone(),
            until: now + until,
        })
        .collect();

    Case {
        cfg,
        lanes,
        jobs,
        workers,
        offerings,
        unavailable,
        now,
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        limits(),
        prop::collection::vec(raw_job(), 0..200),
        prop::collection::vec(raw_worker(), 0..100),
        raw_world(),
    )
        .prop_map(|(l, j, w, world)| build(l, j, w, world))
}

/// A launch action as (lane, offering, count, project, reason).
type LaunchRow<'a> = (usize, &'a Offering, u32, Option<&'a str>, &'a Reason);

fn launch_rows<'a>(plan: &'a Plan, offerings: &'a [Offering]) -> Result<Vec<LaunchRow<'a>>, TestCaseError> {
    let mut v = Vec::new();
    for a in &plan.actions {
        if let Action::Launch {
            lane,
            offering,
            count,
            project,
            reason,
            ..
        } = a
        {
            let o = offerings.iter().find(|o| &o.key == offering);
            prop_assert!(o.is_some(), "launch of an unknown offering {offering}");
            v.push((*lane, o.unwrap(), *count, project.as_deref(), reason));
        }
        // A stopped worker started: one instance of its offering.
        if let Action::Start {
            lane,
            offering,
            project,
            reason,
            ..
        } = a
        {
            let o = offerings.iter().find(|o| &o.key == offering);
            prop_assert!(o.is_some(), "start of a worker of an unknown offering {offering}");
            v.push((*lane, o.unwrap(), 1, project.as_deref(), reason));
        }
    }
    Ok(v)
}

fn is_live(w: &WorkerView) -> bool {
    matches!(w.state, WorkerState::Pending | WorkerState::Running | WorkerState::Idle)
}

fn check_invariants(c: &Case, plan: &Plan) -> Result<(), TestCaseError> {
    let cfg = &c.cfg;
    let nl = cfg.lanes.len();
    let now = c.now;
    let by_id: HashMap<&str, &WorkerView> = c.workers.iter().map(|w| (w.id.as_str(), w)).collect();

    // Releases: terminate only Idle workers (past min runtime), cancel only Pending ones, each once.
    let spend: f64 = c
        .workers
        .iter()
        .map(|w| match w.state {
            WorkerState::Terminating => 0.0,
            WorkerState::Stopped => cfg.scale_down.stopped_usd_per_h(),
            _ => w.price_usd_per_h,
        })
        .sum();
    let breaker = cfg.limits.max_usd_per_h.is_some_and(|cap| spend > cap);
    let mut released = HashSet::new();
    for a in &plan.actions {
        // A stop is a release as a termination is, for the same reasons.
        let (a, stop_keep) = match a {
            Action::Stop {
                worker, keep_s, reason, ..
            } => (
                Action::Terminate {
                    worker: worker.clone(),
                    reason: reason.clone(),
                },
                Some(*keep_s),
            ),
            a => (a.clone(), None),
        };
        match &a {
            Action::Terminate { worker, reason }
                if by_id
                    .get(worker.as_str())
                    .is_some_and(|w| w.state == WorkerState::Stopped) =>
            {
                // A stopped worker is terminated once its keep is over, for that reason only.
                let w = by_id[worker.as_str()];
                prop_assert!(stop_keep.is_none(), "stops the stopped {worker}");
                let since = w.idle_since.unwrap_or(w.launched_at);
                let until = w
                    .stopped_until
                    .unwrap_or_else(|| since + keepalive::stopped_keep_s(None, 1.0, w.price_usd_per_h, cfg));
                prop_assert!(now >= until, "terminates stopped {worker} before its keep ends");
                prop_assert!(
                    matches!(reason, Reason::StoppedKeepAliveExpired { stopped_s, keep_s } if stopped_s >= keep_s),
                    "{reason:?}"
                );
                prop_assert!(released.insert(worker.clone()), "{worker} released twice");
            }
            Action::Terminate { worker, reason } => {
                let w = by_id.get(worker.as_str());
                prop_assert!(w.is_some(), "terminates unknown {worker}");
                let w = w.unwrap();
                if let Some(keep) = stop_keep {
                    prop_assert!(
                        keepalive::stops(w.offering.capacity_type, w.price_usd_per_h, cfg),
                        "stops {worker}, which the configuration terminates"
                    );
                    prop_assert!(keep.is_finite() && keep >= 0.0 && keep <= cfg.scale_down.max_stopped_s);
                } else {
                    prop_assert!(
                        !keepalive::stops(w.offering.capacity_type, w.price_usd_per_h, cfg),
                        "terminates idle {worker}, which the configuration stops"
                    );
                }
                prop_assert_eq!(
                    w.state,
                    WorkerState::Idle,
                    "terminates {} in state {:?}",
                    worker,
                    w.state
                );
                prop_assert!(
                    now - w.launched_at >= cfg.anti_thrash.min_runtime_s,
                    "terminates {worker} before its minimum run time"
                );
                prop_assert!(released.insert(worker.clone()), "{worker} released twice");
                match reason {
                    Reason::BudgetBreaker { .. } => prop_assert!(breaker),
                    Reason::KeepAliveExpired { idle_s, keep_alive_s } => {
                        prop_assert!(!breaker);
                        prop_assert!(idle_s >= keep_alive_s, "{reason:?}");
                        prop_assert!(
                            cfg.scale_down.mode != KeepAliveMode::CooldownDecay,
                            "{reason:?} in decay mode"
                        );
                    }
                    Reason::DecayStep { idle_s, step_s } => {
                        prop_assert!(!breaker);
                        prop_assert_eq!(cfg.scale_down.mode, KeepAliveMode::CooldownDecay);
                        prop_assert!(idle_s >= step_s);
                        if *step_s < cfg.scale_down.release_rest_at_s {
                            prop_assert!(keepalive::in_first_release(w.seq, cfg.scale_down.release_fraction));
                        }
                    }
                    Reason::MakeRoom { held_jobs, limit } => {
                        // Only while the cap holds that many of the lane's queued jobs (its
                        // warm-pool wants held there too are not jobs), one worker per held job
                        // at most.
                        prop_assert!(!breaker);
                        let capped: u32 = plan
                            .held
                            .iter()
                            .filter(|h| h.lane == w.lane && matches!(h.reason, Reason::MaxWorkers { .. }))
                            .map(|h| h.count)
                            .sum();
                        let queued = c.jobs.iter().filter(|j| j.lane == w.lane).count() as u32;
                        prop_assert!(
                            *held_jobs > 0 && *held_jobs <= capped && *held_jobs <= queued,
                            "{reason:?}: {capped} held at the cap, {queued} queued"
                        );
                        prop_assert!(
                            plan.held
                                .iter()
                                .any(|h| h.lane == w.lane && h.reason == Reason::MaxWorkers { limit: *limit }),
                            "{reason:?}"
                        );
                        let made = plan
                            .actions
                            .iter()
                            .filter_map(|a| match a {
                                Action::Terminate { worker, reason } | Action::Stop { worker, reason, .. } => {
                                    Some((worker, reason))
                                }
                                _ => None,
                            })
                            .filter(|(worker, reason)| {
                                matches!(reason, Reason::MakeRoom { .. })
                                    && by_id.get(worker.as_str()).is_some_and(|x| x.lane == w.lane)
                            })
                            .count() as u32;
                        prop_assert!(made <= *held_jobs, "{made} released for {held_jobs} held jobs");
                    }
                    Reason::MakeRoomForLanes { held_jobs, limit } => {
                        // Only while the fleet's cap holds that many jobs (of lanes with room of
                        // their own), one worker per held job at most, the places the other
                        // releases freed counted first.
                        prop_assert!(!breaker);
                        prop_assert_eq!(*limit, cfg.limits.max_workers_total);
                        let at_fleet_cap: u32 = plan
                            .held
                            .iter()
                            .filter(|h| h.reason == Reason::MaxWorkers { limit: *limit })
                            .map(|h| h.count)
                            .sum();
                        prop_assert!(
                            *held_jobs > 0 && *held_jobs <= at_fleet_cap && *held_jobs <= c.jobs.len() as u32,
                            "{reason:?}: {at_fleet_cap} held at the fleet's cap, {} queued",
                            c.jobs.len()
                        );
                        let freed = plan
                            .actions
                            .iter()
                            .filter(|a| match a {
                                Action::Terminate { worker, .. } | Action::Stop { worker, .. } => {
                                    by_id.get(worker.as_str()).is_some_and(|x| x.state == WorkerState::Idle)
                                }
                                Action::CancelLaunch { .. } => true,
                                _ => false,
                            })
                            .count() as u32;
                        prop_assert!(freed <= *held_jobs, "{freed} released for {held_jobs} held jobs");
                    }
                    r => prop_assert!(false, "terminate with reason {r:?}"),
                }
            }
            Action::CancelLaunch { worker, reason } => {
                let w = by_id.get(worker.as_str());
                prop_assert!(w.is_some(), "cancels unknown {worker}");
                let w = w.unwrap();
                prop_assert_eq!(
                    w.state,
                    WorkerState::Pending,
                    "cancels {} in state {:?}",
                    worker,
                    w.state
                );
                prop_assert_eq!(reason, &Reason::PendingNotNeeded);
                prop_assert!(
                    !c.jobs.iter().any(|j| j.lane == w.lane),
                    "cancels {worker} while its lane has queued jobs"
                );
                prop_assert!(released.insert(worker.clone()), "{worker} released twice");
            }
            Action::Start { worker, job, .. } => {
                let w = by_id.get(worker.as_str());
                prop_assert!(w.is_some(), "starts unknown {worker}");
                prop_assert_eq!(w.unwrap().state, WorkerState::Stopped, "starts {} not stopped", worker);
                prop_assert!(
                    released.insert(worker.clone()),
                    "{worker} started twice or released too"
                );
                prop_assert!(
                    !cfg.limits.frozen && !breaker,
                    "starts {worker} while frozen or over budget"
                );
                if let Some(j) = job {
                    prop_assert!(c.jobs.iter().any(|q| &q.id == j), "start pinned to unknown job {j}");
                }
            }
            Action::Launch { .. } | Action::Stop { .. } => {}
        }
    }

    // Launches.
    let rows = launch_rows(plan, &c.offerings)?;
    let total_launched: u32 = rows.iter().map(|r| r.2).sum();
    prop_assert_eq!(total_launched, plan.launches() + plan.starts());
    for (lane, o, count, _, _) in &rows {
        prop_assert!(*lane < nl);
        prop_assert!(*count > 0, "empty launch");
        prop_assert!(
            !c.unavailable.iter().any(|u| u.key == o.key && u.until > now),
            "launch of unavailable {}",
            o.key
        );
        if cfg.lanes[*lane].capacity == CapacityPreference::OnDemand {
            prop_assert_eq!(o.key.capacity_type, CapacityType::OnDemand);
        }
    }
    if cfg.limits.frozen {
        prop_assert_eq!(total_launched, 0, "launches while frozen");
    }
    if breaker {
        prop_assert_eq!(total_launched, 0, "launches while the breaker is tripped");
    }

    // Max workers, total and per lane.
    let live_total = c.workers.iter().filter(|w| is_live(w)).count() as u32;
    prop_assert!(
        live_total + total_launched <= live_total.max(cfg.limits.max_workers_total),
        "live {live_total} + launched {total_launched} > max {}",
        cfg.limits.max_workers_total
    );
    prop_assert_eq!(plan.lanes.len(), nl);
    for l in 0..nl {
        let live = c.workers.iter().filter(|w| w.lane == l && is_live(w)).count() as u32;
        let launched: u32 = rows.iter().filter(|r| r.0 == l).map(|r| r.2).sum();
        let max = cfg.lanes[l].max_workers;
        prop_assert!(
            live + launched <= live.max(max),
            "lane {l}: live {live} + launched {launched} > max {max}"
        );

        // Launches <= instances of the unmet jobs + warm deficit.
        let mut inst: Vec<u32> = c
            .jobs
            .iter()
            .filter(|j| j.lane == l)
            .map(|j| j.instances.max(1))
            .collect();
        let unmet = plan.lanes[l].unmet_jobs as usize;
        prop_assert!(unmet <= inst.len());
        inst.sort_unstable_by(|a, b| b.cmp(a));
        let unmet_instances: u32 = inst[..unmet].iter().sum();
        let for_jobs: u32 = rows
            .iter()
            .filter(|r| r.0 == l && !matches!(r.4, Reason::WarmPool { .. }))
            .map(|r| r.2)
            .sum();
        prop_assert!(
            for_jobs <= unmet_instances,
            "lane {l}: {for_jobs} launched for {unmet} unmet jobs ({unmet_instances} instances)"
        );
        let target = plan.lanes[l].warm_target;
        let hour = ((now - DAY0) / 3600.0) as u32;
        // The schedule, or more when the predictive pool saw a bigger burst (up to its cap).
        let scheduled = cfg.lanes[l].warm_pool_size_at(hour);
        prop_assert!(target >= scheduled && target <= scheduled.max(cfg.lanes[l].predictive_max));
        let warm_ready = c
            .workers
            .iter()
            .filter(|w| w.lane == l && w.gpus == 1 && matches!(w.state, WorkerState::Idle | WorkerState::Pending))
            .count() as u32;
        let mut for_warm = 0;
        for r in rows.iter().filter(|r| r.0 == l) {
            if let Reason::WarmPool { target: t, ready } = r.4 {
                prop_assert_eq!(*t, target);
                prop_assert!(*ready <= warm_ready);
                prop_assert!(r.3.is_none());
                for_warm += r.2;
                prop_assert!(ready + for_warm <= target, "warm pool over its target");
            }
        }
        prop_assert!(for_warm <= target);
    }

    // Project quotas: GPUs held + launched for a project stay within max_gpus.
    for (p, q) in &cfg.limits.projects {
        let Some(max) = q.max_gpus else { continue };
        let held: u32 = c
            .workers
            .iter()
            .filter(|w| {
                w.project.as_deref() == Some(p.as_str())
                    && matches!(w.state, WorkerState::Pending | WorkerState::Running)
            })
            .map(|w| w.gpus)
            .sum();
        let launched: u32 = rows
            .iter()
            .filter(|r| r.3 == Some(p.as_str()))
            .map(|r| r.1.gpus * r.2)
            .sum();
        if launched > 0 {
            prop_assert!(
                held + launched <= max,
                "project {p}: held {held} + launched {launched} > max {max}"
            );
        }
    }

    // Budget: no launch, warm pool included, takes the spend above the cap.
    if let Some(cap) = cfg.limits.max_usd_per_h {
        if spend <= cap {
            let launched_usd: f64 = rows.iter().map(|r| r.1.price_usd_per_h * r.2 as f64).sum();
            prop_assert!(
                spend + launched_usd <= cap + 1e-6,
                "spend {spend} + launched {launched_usd} > cap {cap}: {:?}",
                plan.actions
            );
        }
    }
    Ok(())
}

proptest! {
    // 256 cases by default (a few seconds in debug); PROPTEST_CASES=N for a longer run.
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256)
    ))]

    /// The keep-alive's count of running workers freed ahead of an idle one gives the same from
    /// absolute ends, sorted (the simulator's hint, a binary search per count) as from the ends
    /// relative to now in any order (a pass over the workers), rounding included.
    #[test]
    fn arrivals_until_needed_count_the_same_from_sorted_absolute_ends(
        rank in 0u32..60,
        units in 0.01f64..2.0,
        gap in 0.5f64..900.0,
        now in 1.5e9f64..1.8e9,
        offsets in prop::collection::vec(0.0f64..20_000.0, 0..80),
        cap in prop::sample::select(vec![8.0, 1e6]),
    ) {
        let mut at: Vec<f64> = offsets.iter().map(|o| now + o).filter(|t| *t >= now).collect();
        let relative: Vec<f64> = at.iter().map(|t| t - now).collect();
        at.sort_unstable_by(f64::total_cmp);
        let scanned = keepalive::arrivals_until_needed_after_ends(rank, units, gap, &relative, cap);
        let sorted = keepalive::arrivals_until_needed_after_sorted_ends(rank, units, gap, now, &at, cap);
        prop_assert_eq!(scanned.to_bits(), sorted.to_bits());
    }

    #[test]
    fn decide_keeps_its_invariants(c in case()) {
        prop_assert!(c.cfg.validate().is_ok(), "{:?}", c.cfg.validate());
        let plan = decide(&c.obs(), &c.cfg, c.now);
        check_invariants(&c, &plan)?;
    }

    /// The warm pool reads the window demand from the caller's kept windows (every shape they
    /// ever counted, those with no arrival left in the look-back as all zeros) or scans it from
    /// the recent arrivals: the plan is the same either way, whatever the scheduled pool. Each
    /// lane also sees a dense stream of arrivals up to now (bursts the predictive pool holds
    /// workers for).
    #[test]
    fn decide_plans_the_same_from_kept_or_scanned_window_demand(
        c in case(),
        stream in prop::collection::vec((prop::sample::select(vec![1u32, 2, 4, 8]), 0.0f64..400.0), 0..120),
    ) {
        let mut kept = c.clone();
        let span: f64 = stream.iter().map(|s| s.1).sum();
        for (l, lane) in kept.lanes.iter_mut().enumerate() {
            let lc = &c.cfg.lanes[l];
            let long = (c.cfg.offers.short_job_horizon_s, c.cfg.offers.default_runtime_s);
            let mut arrivals: Vec<_> = lane.recent_arrivals.iter().filter(|a| a.at <= c.now).cloned().collect();
            let mut t = c.now - span;
            for &(gpus, gap) in &stream {
                t += gap;
                arrivals.push(onoff_policy::observation::Arrival { at: t.min(c.now), gpus, runtime_s: None });
            }
            arrivals.sort_by(|a, b| a.at.total_cmp(&b.at));
            let mut fresh = LaneObservation {
                backlog: lane.backlog,
                demand_windows: Some(DemandWindows::new(lc.predictive_window_s, lc.predictive_lookback_s, long)),
                ..Default::default()
            };
            for a in &arrivals {
                fresh.record_arrival_with_runtime(a.gpus, a.at, a.runtime_s);
            }
            fresh.demand_windows.as_mut().unwrap().advance(c.now);
            *lane = fresh;
        }
        let mut scanned = kept.clone();
        for lane in &mut scanned.lanes {
            lane.demand_windows = None;
        }
        let read = kept.lanes.iter().enumerate().any(|(l, lane)| {
            let lc = &c.cfg.lanes[l];
            let long = (c.cfg.offers.short_job_horizon_s, c.cfg.offers.default_runtime_s);
            lane.kept_demand(c.now, lc.predictive_window_s, lc.predictive_lookback_s, long).is_some()
        });
        prop_assert!(read, "the kept windows are for this decision");
        prop_assert_eq!(
            decide(&kept.obs(), &kept.cfg, kept.now),
            decide(&scanned.obs(), &scanned.cfg, scanned.now)
        );
    }

    #[test]
    fn decide_is_deterministic(c in case()) {
        let a = decide(&c.obs(), &c.cfg, c.now);
        let b = decide(&c.obs(), &c.cfg, c.now);
        prop_assert_eq!(&a, &b);
        // Cloned inputs, same plan.
        let c2 = c.clone();
        let d = decide(&c2.obs(), &c2.cfg, c2.now);
        prop_assert_eq!(&a, &d);
    }

    #[test]
    fn decide_ignores_input_order(c in case()) {
        // Without a budget cap no floating-point sum reaches the plan, so the order of jobs and
        // workers (ids and seqs are unique) must not matter at all.
        let mut c = c;
        c.cfg.limits.max_usd_per_h = None;
        let a = decide(&c.obs(), &c.cfg, c.now);
        let mut r = c.clone();
        r.jobs.reverse();
        r.workers.reverse();
        let b = decide(&r.obs(), &r.cfg, r.now);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn frozen_never_launches(c in case()) {
        let mut c = c;
        c.cfg.limits.frozen = true;
        let plan = decide(&c.obs(), &c.cfg, c.now);
        prop_assert_eq!(plan.launches(), 0);
        let unmet: u32 = plan.lanes.iter().map(|l| l.unmet_jobs).sum();
        let held: u32 = plan.held.iter().filter(|h| h.reason == Reason::Frozen).map(|h| h.count).sum();
        prop_assert_eq!(held, unmet);
    }
}

/// The generator is not degenerate: over 256 deterministic cases every kind of action and most
/// hold reasons occur, so the properties above are exercised on plans that do something.
#[test]
fn generator_reaches_every_branch() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strat = case();
    let mut seen: BTreeMap<&'static str, u32> = BTreeMap::new();
    for _ in 0..256 {
        let c = strat.new_tree(&mut runner).unwrap().current();
        let plan = decide(&c.obs(), &c.cfg, c.now);
        for a in &plan.actions {
            let k = match a {
                Action::Launch { reason, .. } => match reason {
                    Reason::Activation { .. } => "launch activation",
                    Reason::UnmetBacklog { .. } => "launch unmet",
                    Reason::WarmPool { .. } => "launch warm",
                    Reason::DeadlineAtRisk { .. } => "launch deadline",
                    _ => "launch other",
                },
                Action::Terminate { reason, .. } => match reason {
                    Reason::KeepAliveExpired { .. } => "terminate keep-alive",
                    Reason::DecayStep { .. } => "terminate decay",
                    Reason::BudgetBreaker { .. } => "terminate breaker",
                    Reason::StoppedKeepAliveExpired { .. } => "terminate stopped",
                    Reason::MakeRoom { .. } => "terminate make-room",
                    Reason::MakeRoomForLanes { .. } => "terminate make-room lanes",
                    _ => "terminate other",
                },
                Action::CancelLaunch { .. } => "cancel",
                Action::Stop { .. } => "stop",
                Action::Start { .. } => "start",
            };
            *seen.entry(k).or_default() += 1;
        }
        for h in &plan.held {
            let k = match h.reason {
                Reason::MaxWorkers { .. } => "held max workers",
                Reason::ProjectQuota { .. } => "held quota",
                Reason::JobTypeCap { .. } => "held type cap",
                Reason::BudgetBreaker { .. } => "held budget",
                Reason::Frozen => "held frozen",
                Reason::NoOffering { .. } => "held no offering",
                _ => "held other",
            };
            *seen.entry(k).or_default() += 1;
        }
    }
    for k in [
        "launch activation",
        "launch unmet",
        "launch warm",
        "launch deadline",
        "terminate keep-alive",
        "terminate decay",
        "terminate breaker",
        "terminate stopped",
        "terminate make-room",
        "terminate make-room lanes",
        "cancel",
        "stop",
        "start",
        "held max workers",
        "held quota",
        "held type cap",
        "held budget",
        "held frozen",
        "held no offering",
    ] {
        assert!(seen.get(k).copied().unwrap_or(0) > 0, "no {k:?} in 256 cases: {seen:?}");
    }
    assert!(
        !seen.contains_key("launch other") && !seen.contains_key("terminate other"),
        "{seen:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256)
    ))]

    /// The window demand kept arrival by arrival is the one scanned from the recent arrivals,
    /// at every decision: arrivals of mixed shapes and run times (some short, some with none
    /// declared, some at the same second), decisions in between at times that never go back,
    /// some of them with no arrival since the last (the windows move on the clock alone, or
    /// wait for the next crossing), some on a window boundary to the second.
    #[test]
    fn demand_windows_kept_incrementally_equal_the_scan(
        steps in prop::collection::vec(
            (0.0f64..900.0, 1u32..4, prop::option::of(0.0f64..400.0), any::<bool>(), 0u8..4),
            1..400,
        ),
        window_s in prop::sample::select(vec![60.0, 390.0, 1_200.0]),
        lookback_s in prop::sample::select(vec![0.0, 1_800.0, 10_800.0]),
    ) {
        let long = (120.0, 3_600.0);
        let mut lane = LaneObservation {
            demand_windows: Some(DemandWindows::new(window_s, lookback_s, long)),
            ..Default::default()
        };
        let mut now = NOW;
        let mut last_arrival = NOW;
        for (gap, gpus, runtime, decide_now, kind) in steps {
            // A gap under a second is a burst: same-second arrivals.
            now += if gap < 1.0 { 0.0 } else { gap };
            match kind {
                // A decision with no arrival.
                0 => {}
                // A decision on the boundary the last arrival crosses next, or just short of it
                // (when that is not back in time).
                1 => {
                    let edge = last_arrival + window_s * (1.0 + ((now - last_arrival) / window_s).floor());
                    now = now.max(edge - if gpus == 1 { 1e-3 } else { 0.0 });
                }
                _ => {
                    lane.record_arrival_with_runtime(gpus, now, runtime);
                    last_arrival = now;
                }
            }
            let at = if decide_now { now + gap / 3.0 } else { now };
            if decide_now {
                now = at;
            }
            lane.demand_windows.as_mut().unwrap().advance(at);
            let kept = lane.demand_windows.as_ref().unwrap();
            prop_assert!(kept.is_for(at, window_s, lookback_s, long));
            prop_assert_eq!(kept.demand(), lane.window_demand(at, window_s, lookback_s, long));
        }
    }
}
