//! `decide`: the whole policy as one pure function.
//!
//! Steps, per lane in priority order:
//! 1. **Match** queued jobs to free capacity (idle workers first, then booting ones: a booting
//!    worker counts as capacity, so a 3-10 minute GPU cold start causes no duplicate launch).
//! 2. **Scale up** for unmet jobs (activation 0 -> 1 apart from the 1 -> N target), with weighted
//!    fair share between projects, project quotas, job-type caps, max workers, the budget breaker
//!    and the freeze; deadline-at-risk jobs get on-demand capacity of their own.
//! 3. **Warm pool**: top up ready workers to the scheduled size.
//! 4. **Scale down** idle workers past the keep-alive (or at the decay steps), never busy ones,
//!    never within the delay after a scale-up or the minimum run time; cancel booting workers that
//!    nothing needs.

use std::collections::{BTreeMap, HashMap};

use crate::choice::{self, Request};
use crate::config::{CapacityPreference, KeepAliveMode, PolicyConfig};
use crate::keepalive;
use crate::observation::{LaneId, Observation, PendingJob, WorkerState, WorkerView};
use crate::offering::Offering;
use crate::plan::{Action, Held, LanePlan, LaunchShape, Plan, Reason};

/// A class of free capacity in a lane: workers with the same GPUs and memory.
#[derive(Debug)]
struct FreeClass {
    gpus: u32,
    mem: f64,
    idle: u32,
    pending: u32,
    /// Seconds of short-job work the workers already taken from this class can still absorb.
    credit: f64,
}

/// A job shorter than `offers.short_job_horizon_s` does not get a worker of its own: short jobs
/// queue behind each other on one worker (idle, booting or launched now) until their run times add
/// up to the horizon, instead of paying a cold start each. Returns the job's run time when it is
/// short (single-instance, shorter than the horizon).
fn short_runtime(job: &PendingJob, oc: &crate::config::OfferConfig) -> Option<f64> {
    let runtime = job.est_runtime_s.unwrap_or(oc.default_runtime_s);
    (job.instances.max(1) == 1 && runtime < oc.short_job_horizon_s).then_some(runtime)
}

/// Counts per name for the few projects / job types of a fleet: a linear list beats hashing here
/// (`decide` runs on every submission).
#[derive(Default)]
struct Tally<'a>(Vec<(&'a str, u32)>);

impl<'a> Tally<'a> {
    fn add(&mut self, name: &'a str, n: u32) {
        match self.0.iter_mut().find(|(k, _)| *k == name) {
            Some(e) => e.1 += n,
            None => self.0.push((name, n)),
        }
    }

    fn get(&self, name: &str) -> u32 {
        self.0.iter().find(|(k, _)| *k == name).map_or(0, |e| e.1)
    }
}

/// Launch bookkeeping while the plan is built.
struct Budget<'a> {
    spend: f64,
    live_total: u32,
    lane_live: Vec<u32>,
    project_gpus: Tally<'a>,
    type_jobs: Tally<'a>,
}

/// Seconds of slack of a job: deadline - now - expected runtime; `None` without a deadline.
fn slack_s(job: &PendingJob, runtime_s: f64, now: f64) -> Option<f64> {
    job.deadline.map(|d| d - now - runtime_s)
}

/// Decide what to launch, terminate and cancel. Pure: same inputs, same plan.
///
/// `now` is unix seconds. See the module docs for the steps; every action carries a [`Reason`],
/// every want not acted on lands in [`Plan::held`].
pub fn decide<'a>(obs: &Observation<'a>, cfg: &PolicyConfig, now: f64) -> Plan {
    let nl = cfg.lanes.len();
    let oc = &cfg.offers;
    let mut plan = Plan::default();
    let hour = (now.rem_euclid(86_400.0) / 3600.0) as u32;

    // Fleet figures.
    let mut b = Budget {
        spend: 0.0,
        live_total: 0,
        lane_live: vec![0; nl],
        project_gpus: Tally::default(),
        type_jobs: Tally::default(),
    };
    let mut last_launch = vec![f64::NEG_INFINITY; nl];
    // One pass over the workers: fleet figures, free capacity per lane by class, idle and booting
    // workers per lane.
    let mut free: Vec<Vec<FreeClass>> = (0..nl).map(|_| Vec::new()).collect();
    let mut idle_by_lane: Vec<Vec<&'a WorkerView>> = vec![Vec::new(); nl];
    let mut pending_by_lane: Vec<Vec<&'a WorkerView>> = vec![Vec::new(); nl];
    for w in obs.workers.iter().filter(|w| w.lane < nl) {
        if w.state != WorkerState::Terminating {
            b.spend += w.price_usd_per_h;
        }
        if matches!(w.state, WorkerState::Pending | WorkerState::Running | WorkerState::Idle) {
            b.live_total += 1;
            b.lane_live[w.lane] += 1;
            last_launch[w.lane] = last_launch[w.lane].max(w.launched_at);
        }
        let (idle, pending) = match w.state {
            WorkerState::Idle => {
                idle_by_lane[w.lane].push(w);
                (1, 0)
            }
            WorkerState::Pending => {
                pending_by_lane[w.lane].push(w);
                (0, 1)
            }
            _ => continue,
        };
        let classes = &mut free[w.lane];
        match classes
            .iter_mut()
            .find(|c| c.gpus == w.gpus && c.mem == w.gpu_memory_gib)
        {
            Some(c) => {
                c.idle += idle;
                c.pending += pending;
            }
            None => classes.push(FreeClass {
                gpus: w.gpus,
                mem: w.gpu_memory_gib,
                idle,
                pending,
                credit: 0.0,
            }),
        }
    }
    let breaker = cfg.limits.max_usd_per_h.filter(|cap| b.spend > *cap);
    let frozen = cfg.limits.frozen;
    for classes in &mut free {
        classes.sort_by(|a, b| a.gpus.cmp(&b.gpus).then(a.mem.total_cmp(&b.mem)));
    }
    let free_before: Vec<(u32, u32)> = free
        .iter()
        .map(|cs| (cs.iter().map(|c| c.idle).sum(), cs.iter().map(|c| c.pending).sum()))
        .collect();

    // Queued jobs per lane, most urgent first.
    let mut by_lane: Vec<Vec<&'a PendingJob>> = vec![Vec::new(); nl];
    for j in obs.jobs.iter().filter(|j| j.lane < nl) {
        by_lane[j.lane].push(j);
    }
    for jobs in &mut by_lane {
        jobs.sort_by(|a, b| {
            let da = a.deadline.unwrap_or(f64::INFINITY);
            let db = b.deadline.unwrap_or(f64::INFINITY);
            da.total_cmp(&db)
                .then(a.enqueued_at.total_cmp(&b.enqueued_at))
                .then_with(|| a.id.cmp(&b.id))
        });
    }

    // 1. Match.
    let mut unmet: Vec<Vec<&'a PendingJob>> = vec![Vec::new(); nl];
    for lane in 0..nl {
        for &job in &by_lane[lane] {
            let min_mem = job.min_gpu_memory_gib.max(oc.min_gpu_memory_gib);
            let fit = |c: &FreeClass| choice::fits(c.gpus, c.mem, job.gpus_per_instance, min_mem, oc.max_gpu_oversize);
            let short = short_runtime(job, oc);
            if let Some(rt) = short {
                if let Some(c) = free[lane].iter_mut().find(|c| fit(c) && c.credit >= rt) {
                    c.credit -= rt;
                    continue;
                }
            }
            let avail: u32 = free[lane].iter().filter(|c| fit(c)).map(|c| c.idle + c.pending).sum();
            if avail < job.instances.max(1) {
                unmet[lane].push(job);
                continue;
            }
            let mut need = job.instances.max(1);
            for pending in [false, true] {
                for c in free[lane].iter_mut().filter(|c| fit(c)) {
                    let slot = if pending { &mut c.pending } else { &mut c.idle };
                    let take = need.min(*slot);
                    *slot -= take;
                    need -= take;
                    if take > 0 {
                        if let Some(rt) = short {
                            c.credit += oc.short_job_horizon_s - rt;
                        }
                    }
                }
            }
        }
    }

    // Per-project GPUs and per-type jobs, needed only when something is to be launched.
    if unmet.iter().any(|u| !u.is_empty()) {
        for w in obs.workers.iter().filter(|w| w.lane < nl) {
            if matches!(w.state, WorkerState::Pending | WorkerState::Running) {
                if let Some(p) = &w.project {
                    b.project_gpus.add(p, w.gpus);
                }
                if let Some(t) = &w.job_type {
                    b.type_jobs.add(t, 1);
                }
            }
        }
    }

    // 2. Scale up, lanes by priority.
    let mut order: Vec<LaneId> = (0..nl).collect();
    order.sort_by_key(|&l| (cfg.lanes[l].priority, l));
    let mut lane_plans: Vec<LanePlan> = (0..nl)
        .map(|l| LanePlan {
            unmet_jobs: unmet[l].len() as u32,
            warm_target: 0,
        })
        .collect();
    for &lane in &order {
        let lc = &cfg.lanes[lane];
        let jobs = std::mem::take(&mut unmet[lane]);
        if jobs.is_empty() {
            continue;
        }
        let n_unmet = jobs.len() as u32;
        if frozen {
            plan.held.push(Held {
                lane,
                count: n_unmet,
                reason: Reason::Frozen,
            });
            continue;
        }
        if let Some(cap) = breaker {
            plan.held.push(Held {
                lane,
                count: n_unmet,
                reason: Reason::BudgetBreaker {
                    spend_usd_per_h: b.spend,
                    cap_usd_per_h: cap,
                },
            });
            continue;
        }
        let backlog = obs
            .lanes
            .get(lane)
            .map(|o| o.backlog.total(cfg.limits.count_delayed))
            .unwrap_or(n_unmet);
        let activation = b.lane_live[lane] == 0;
        if activation && backlog.max(n_unmet) < lc.activation_backlog {
            continue;
        }
        if !activation && n_unmet < cfg.anti_thrash.scale_up_unmet_jobs {
            continue;
        }
        let reason = if activation {
            Reason::Activation {
                backlog: backlog.max(n_unmet),
            }
        } else {
            Reason::UnmetBacklog { unmet_jobs: n_unmet }
        };
        let ripe: Vec<&'a PendingJob> = jobs
            .into_iter()
            .filter(|j| now - j.enqueued_at >= cfg.anti_thrash.scale_up_window_s)
            .collect();
        scale_up_lane(obs, cfg, now, lane, &ripe, reason, &mut b, &mut plan);
    }

    // 3. Warm pool and 4. scale down.
    for lane in 0..nl {
        let lc = &cfg.lanes[lane];
        // Predictive warm pool: the biggest recent burst, once bursts recur (a single burst is
        // served by the keep-alive alone).
        let predicted = match (lc.predictive_max, obs.lanes.get(lane)) {
            (0, _) | (_, None) => 0,
            (max, Some(o)) => {
                let fits_warm = |g| choice::fits(lc.warm_pool_gpus, f64::INFINITY, g, 0.0, oc.max_gpu_oversize);
                let (peak, bursts) = o.recent_bursts(
                    now,
                    lc.predictive_window_s,
                    lc.predictive_lookback_s,
                    (max, lc.predictive_min_bursts),
                    fits_warm,
                );
                if bursts >= lc.predictive_min_bursts {
                    peak.min(max)
                } else {
                    0
                }
            }
        };
        let warm_target = lc.warm_pool_size_at(hour).max(predicted);
        lane_plans[lane].warm_target = warm_target;
        let free_idle: u32 = free[lane].iter().map(|c| c.idle).sum();
        let free_pending: u32 = free[lane].iter().map(|c| c.pending).sum();
        // The warm pool is made of workers of the warm shape only.
        let is_warm_shape = |gpus: u32, mem: f64| {
            choice::fits(gpus, mem, lc.warm_pool_gpus, oc.min_gpu_memory_gib, oc.max_gpu_oversize)
        };
        let (warm_idle, warm_pending) = free[lane]
            .iter()
            .filter(|c| is_warm_shape(c.gpus, c.mem))
            .fold((0, 0), |(i, p), c| (i + c.idle, p + c.pending));
        if warm_target > warm_idle + warm_pending && !frozen && breaker.is_none() {
            let want = warm_target - warm_idle - warm_pending;
            let lane_room = lc.max_workers.saturating_sub(b.lane_live[lane]);
            let total_room = cfg.limits.max_workers_total.saturating_sub(b.live_total);
            let mut n = want.min(lane_room).min(total_room);
            if n < want {
                let limit = if lane_room < total_room {
                    lc.max_workers
                } else {
                    cfg.limits.max_workers_total
                };
                plan.held.push(Held {
                    lane,
                    count: want - n,
                    reason: Reason::MaxWorkers { limit },
                });
            }
            let req = Request {
                gpus: lc.warm_pool_gpus,
                min_mem_gib: oc.min_gpu_memory_gib,
                capacity: lc.capacity,
                instances: 1,
                runtime_s: oc.default_runtime_s,
            };
            let ranked = if n > 0 {
                choice::top(obs.offerings, &req, oc, obs.unavailable, now, oc.diversify as usize)
            } else {
                Vec::new()
            };
            if n > 0 && ranked.is_empty() {
                plan.held.push(Held {
                    lane,
                    count: n,
                    reason: Reason::NoOffering {
                        gpus: lc.warm_pool_gpus,
                    },
                });
                n = 0;
            }
            // The budget cap holds for the warm pool too.
            let price = choice::spread_max_price(&ranked, oc);
            if let (Some(cap), true) = (cfg.limits.max_usd_per_h, n > 0 && price > 0.0) {
                let fit = ((cap - b.spend) / price).floor().max(0.0) as u32;
                if fit < n {
                    let reason = Reason::BudgetBreaker {
                        spend_usd_per_h: b.spend,
                        cap_usd_per_h: cap,
                    };
                    plan.held.push(Held {
                        lane,
                        count: n - fit,
                        reason,
                    });
                    n = fit;
                }
            }
            if n > 0 {
                let reason = Reason::WarmPool {
                    target: warm_target,
                    ready: warm_idle + warm_pending,
                };
                push_launches_booked(&mut plan, lane, &ranked, &req, n, None, None, reason, oc);
                b.spend += price * n as f64;
                b.live_total += n;
                b.lane_live[lane] += n;
            }
        }

        let lane_obs = obs.lanes.get(lane);

        // Idle workers nobody matched: the matched ones are the most recently idle of their class.
        let (idle_before, _) = free_before[lane];
        let consumed_idle = idle_before - free_idle;
        let idle = &mut idle_by_lane[lane];
        idle.sort_by(|a, b| {
            b.idle_since
                .unwrap_or(now)
                .total_cmp(&a.idle_since.unwrap_or(now))
                .then(b.seq.cmp(&a.seq))
        });
        let idle_free = skip_consumed(idle, &free[lane], consumed_idle);

        if let Some(cap) = breaker {
            for w in idle_free
                .iter()
                .filter(|w| now - w.launched_at >= cfg.anti_thrash.min_runtime_s)
            {
                plan.actions.push(Action::Terminate {
                    worker: w.id.clone(),
                    reason: Reason::BudgetBreaker {
                        spend_usd_per_h: b.spend,
                        cap_usd_per_h: cap,
                    },
                });
            }
            continue;
        }
        let backlog = obs
            .lanes
            .get(lane)
            .map(|o| o.backlog.total(cfg.limits.count_delayed))
            .unwrap_or(0);
        if now - last_launch[lane] < cfg.anti_thrash.scale_down_delay_after_scale_up_s
            || backlog > cfg.anti_thrash.scale_down_max_backlog
        {
            continue;
        }
        // The most recently idle workers form the warm pool.
        let mut warm_kept = 0;
        for w in &idle_free {
            if warm_kept < warm_target && is_warm_shape(w.gpus, w.gpu_memory_gib) {
                warm_kept += 1;
                continue;
            }
            if now - w.launched_at < cfg.anti_thrash.min_runtime_s {
                continue;
            }
            let idle_s = now - w.idle_since.unwrap_or(now);
            let gaps = lane_obs.and_then(|o| o.gaps_for(w.gpus, oc.max_gpu_oversize));
            let keep_alive = keepalive::keep_alive_s(gaps, oc.boot_estimate_s, w.price_usd_per_h, &cfg.scale_down);
            let reason = match cfg.scale_down.mode {
                KeepAliveMode::Adaptive | KeepAliveMode::Fixed => {
                    (idle_s >= keep_alive).then_some(Reason::KeepAliveExpired {
                        idle_s,
                        keep_alive_s: keep_alive,
                    })
                }
                KeepAliveMode::CooldownDecay => {
                    let sd = &cfg.scale_down;
                    if idle_s >= sd.release_rest_at_s {
                        Some(Reason::DecayStep {
                            idle_s,
                            step_s: sd.release_rest_at_s,
                        })
                    } else if idle_s >= sd.warm_for_s && keepalive::in_first_release(w.seq, sd.release_fraction) {
                        Some(Reason::DecayStep {
                            idle_s,
                            step_s: sd.warm_for_s,
                        })
                    } else {
                        None
                    }
                }
            };
            if let Some(reason) = reason {
                plan.actions.push(Action::Terminate {
                    worker: w.id.clone(),
                    reason,
                });
            }
        }
        // Booting workers nothing needs: only when the lane has no queued job at all.
        if by_lane[lane].is_empty() && free_pending > 0 {
            let mut warm_left = warm_target.saturating_sub(warm_idle);
            let pending = &mut pending_by_lane[lane];
            // Keep the ones launched first (closest to ready).
            pending.sort_by(|a, b| a.launched_at.total_cmp(&b.launched_at).then(a.seq.cmp(&b.seq)));
            for w in pending {
                if warm_left > 0 && is_warm_shape(w.gpus, w.gpu_memory_gib) {
                    warm_left -= 1;
                    continue;
                }
                plan.actions.push(Action::CancelLaunch {
                    worker: w.id.clone(),
                    reason: Reason::PendingNotNeeded,
                });
            }
        }
    }
    plan.lanes = lane_plans;
    plan
}

/// Drop, per class, the idle workers that matching consumed (the first ones of each class in
/// `idle`, which is sorted most recently idle first); `after` is the free capacity left.
fn skip_consumed<'a>(idle: &[&'a WorkerView], after: &[FreeClass], consumed_total: u32) -> Vec<&'a WorkerView> {
    if consumed_total == 0 {
        return idle.to_vec();
    }
    let mut before: BTreeMap<(u32, u64), u32> = BTreeMap::new();
    for w in idle {
        *before.entry((w.gpus, w.gpu_memory_gib.to_bits())).or_default() += 1;
    }
    let mut to_skip: HashMap<(u32, u64), u32> = before
        .iter()
        .map(|(k, n)| {
            let left = after
                .iter()
                .find(|c| c.gpus == k.0 && c.mem.to_bits() == k.1)
                .map_or(0, |c| c.idle);
            (*k, n.saturating_sub(left))
        })
        .collect();
    idle.iter()
        .filter(|w| {
            let k = (w.gpus, w.gpu_memory_gib.to_bits());
            match to_skip.get_mut(&k) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            }
        })
        .copied()
        .collect()
}

/// Request a ranking is cached for: (GPUs, min memory bits, instances, on-demand for a deadline,
/// run-time bucket). Run times within a factor of two share a ranking: the expected cost per job
/// weighs boot against run time, so a long job may rank offerings differently from a short one.
type RankKey = (u32, u64, u32, bool, i32);

/// Run-time bucket of [`RankKey`]: ceil(log2(seconds)).
fn runtime_bucket(runtime_s: f64) -> i32 {
    runtime_s.max(1.0).log2().ceil() as i32
}

/// Allocate launches for the unmet jobs of one lane with weighted fair share between projects.
#[allow(clippy::too_many_arguments)]
fn scale_up_lane<'a>(
    obs: &Observation<'a>,
    cfg: &PolicyConfig,
    now: f64,
    lane: LaneId,
    jobs: &[&'a PendingJob],
    reason: Reason,
    b: &mut Budget<'a>,
    plan: &mut Plan,
) {
    let lc = &cfg.lanes[lane];
    let oc = &cfg.offers;
    // Per-project FIFO queues (jobs are already most-urgent first).
    let mut queues: BTreeMap<&'a str, std::collections::VecDeque<&'a PendingJob>> = BTreeMap::new();
    for j in jobs {
        queues.entry(j.project.as_str()).or_default().push_back(j);
    }
    // Ranked offerings per request shape, computed once.
    let mut ranked_cache: HashMap<RankKey, Vec<(&Offering, f64)>> = HashMap::new();
    // Jobs allocated per group (for aggregated launches), in allocation order.
    let mut groups: Vec<(RankKey, &'a str, Request, u32)> = Vec::new();
    let mut held: BTreeMap<String, (u32, Reason)> = BTreeMap::new();
    let mut hold = |reason: Reason, n: u32| {
        let e = held.entry(reason.to_string()).or_insert((0, reason));
        e.0 += n;
    };
    // Once the lane or the fleet is full, the limit that bound.
    let mut full: Option<u32> = None;
    // Short-job work the workers launched here can still absorb, per (GPUs, min memory bits).
    let mut credit: Vec<((u32, u64), f64)> = Vec::new();
    while !queues.is_empty() {
        // Project with the least GPUs per unit of weight goes next.
        let project = *queues
            .keys()
            .min_by(|a, b2| {
                let ua = b.project_gpus.get(a) as f64 / cfg.project_quota(a).weight;
                let ub = b.project_gpus.get(b2) as f64 / cfg.project_quota(b2).weight;
                ua.total_cmp(&ub).then(a.cmp(b2))
            })
            .expect("non-empty");
        let q = queues.get_mut(project).expect("present");
        let job = q.pop_front().expect("queues hold no empty deque");
        if q.is_empty() {
            queues.remove(project);
        }
        if let Some(limit) = full {
            hold(Reason::MaxWorkers { limit }, 1);
            continue;
        }
        let instances = job.instances.max(1);
        let gpus = job.gpus_per_instance * instances;
        let quota = cfg.project_quota(project);
        if let Some(max) = quota.max_gpus {
            if b.project_gpus.get(project) + gpus > max {
                hold(
                    Reason::ProjectQuota {
                        project: project.to_string(),
                        max_gpus: max,
                    },
                    1 + queues.get(project).map_or(0, |q| q.len() as u32),
                );
                queues.remove(project);
                continue;
            }
        }
        if let Some(t) = &job.job_type {
            if let Some(&cap) = cfg.limits.job_type_caps.get(t) {
                if b.type_jobs.get(t) + 1 > cap {
                    hold(
                        Reason::JobTypeCap {
                            job_type: t.clone(),
                            cap,
                        },
                        1,
                    );
                    continue;
                }
            }
        }
        let lane_room = lc.max_workers.saturating_sub(b.lane_live[lane]);
        let total_room = cfg.limits.max_workers_total.saturating_sub(b.live_total);
        if lane_room.min(total_room) < instances {
            let limit = if lane_room < total_room {
                lc.max_workers
            } else {
                cfg.limits.max_workers_total
            };
            hold(Reason::MaxWorkers { limit }, 1);
            full = Some(limit);
            continue;
        }
        let runtime = job.est_runtime_s.unwrap_or(oc.default_runtime_s);
        let min_mem = job.min_gpu_memory_gib.max(oc.min_gpu_memory_gib);
        let short = short_runtime(job, oc).filter(|_| job.deadline.is_none());
        let credit_key = (job.gpus_per_instance, min_mem.to_bits());
        if let Some(rt) = short {
            if let Some(c) = credit.iter_mut().find(|c| c.0 == credit_key && c.1 >= rt) {
                // Rides on a worker launched for an earlier short job.
                c.1 -= rt;
                continue;
            }
        }
        // Deadline at risk on spot: on-demand capacity of its own.
        let at_risk = slack_s(job, runtime, now)
            .filter(|s| *s < oc.boot_estimate_s + oc.checkpoint_interval_s + cfg.limits.deadline_margin_s)
            .filter(|_| lc.capacity != CapacityPreference::OnDemand);
        let capacity = if at_risk.is_some() {
            CapacityPreference::OnDemand
        } else {
            lc.capacity
        };
        let req = Request {
            gpus: job.gpus_per_instance,
            min_mem_gib: min_mem,
            capacity,
            instances,
            runtime_s: runtime,
        };
        let key = (
            job.gpus_per_instance,
            min_mem.to_bits(),
            instances,
            at_risk.is_some(),
            runtime_bucket(runtime),
        );
        let ranked = ranked_cache
            .entry(key)
            .or_insert_with(|| choice::top(obs.offerings, &req, oc, obs.unavailable, now, oc.diversify as usize));
        if ranked.is_empty() {
            hold(
                Reason::NoOffering {
                    gpus: job.gpus_per_instance,
                },
                1,
            );
            continue;
        }
        // Book the dearest offering the launch may be spread over, so the cap holds.
        let price = choice::spread_max_price(ranked, oc) * instances as f64;
        if let Some(cap) = cfg.limits.max_usd_per_h {
            if b.spend + price > cap {
                hold(
                    Reason::BudgetBreaker {
                        spend_usd_per_h: b.spend,
                        cap_usd_per_h: cap,
                    },
                    1,
                );
                continue;
            }
        }
        // Book the capacity.
        if let Some(rt) = short {
            match credit.iter_mut().find(|c| c.0 == credit_key) {
                Some(c) => c.1 += oc.short_job_horizon_s - rt,
                None => credit.push((credit_key, oc.short_job_horizon_s - rt)),
            }
        }
        b.spend += price;
        b.live_total += instances;
        b.lane_live[lane] += instances;
        b.project_gpus.add(project, gpus);
        if let Some(t) = &job.job_type {
            b.type_jobs.add(t, 1);
        }
        if let Some(slack) = at_risk {
            let reason = Reason::DeadlineAtRisk {
                job: job.id.clone(),
                slack_s: slack,
            };
            push_launches_booked(
                plan,
                lane,
                ranked,
                &req,
                instances,
                Some(project),
                Some(&job.id),
                reason,
                oc,
            );
            continue;
        }
        match groups.iter_mut().find(|g| g.0 == key && g.1 == project) {
            Some(g) => g.3 += instances,
            None => groups.push((key, project, req, instances)),
        }
    }
    for (key, project, req, instances) in groups {
        // jobs_per_worker jobs share one worker (1 by default); the spare bookings are handed back.
        let workers = instances.div_ceil(lc.jobs_per_worker);
        let spare = instances - workers;
        b.live_total -= spare;
        b.lane_live[lane] -= spare;
        let ranked = &ranked_cache[&key];
        push_launches_booked(
            plan,
            lane,
            ranked,
            &req,
            workers,
            Some(project),
            None,
            reason.clone(),
            oc,
        );
    }
    for (_, (count, reason)) in held {
        plan.held.push(Held { lane, count, reason });
    }
}

/// Push launch actions for capacity already booked in the budget.
#[allow(clippy::too_many_arguments)]
fn push_launches_booked(
    plan: &mut Plan,
    lane: LaneId,
    ranked: &[(&Offering, f64)],
    req: &Request,
    count: u32,
    project: Option<&str>,
    job: Option<&str>,
    reason: Reason,
    oc: &crate::config::OfferConfig,
) -> u32 {
    let mut n = 0;
    for (o, c) in choice::spread(ranked, count, oc) {
        plan.actions.push(Action::Launch {
            lane,
            offering: o.key.clone(),
            price_usd_per_h: o.price_usd_per_h,
            count: c,
            request: LaunchShape {
                gpus: req.gpus,
                min_gpu_memory_gib: req.min_mem_gib,
                capacity: req.capacity,
                runtime_s: req.runtime_s,
            },
            project: project.map(str::to_string),
            job: job.map(str::to_string),
            reason: reason.clone(),
        });
        n += c;
    }
    n
}
