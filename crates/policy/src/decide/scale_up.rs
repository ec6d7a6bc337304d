//! Phase 3: launches for the jobs matching left unmet, lanes by priority.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::choice::{self, PriceTable, RankMemo, Request};
use crate::config::{CapacityPreference, PolicyConfig};
use crate::observation::{LaneId, Observation, PendingJob, WorkerView};
use crate::offering::{Offering, OfferingKey};
use crate::plan::{Action, Held, LaunchShape, Plan, Reason};

use super::fleet::Fleet;
use super::short_runtime;

/// Launch for the unmet jobs of every lane, lanes by priority: held while frozen or over the
/// budget cap; a lane with no live worker launches once its backlog reaches its activation
/// threshold, a live lane once enough jobs are unmet; only jobs queued longer than the scale-up
/// window count (arrivals within it may still be matched).
pub(crate) fn scale_up<'a>(
    obs: &Observation<'a>,
    cfg: &PolicyConfig,
    now: f64,
    mut unmet: super::fleet::PerLane<Vec<&'a PendingJob>>,
    fleet: &mut Fleet<'a>,
    plan: &mut Plan,
    memo: &mut RankMemo,
) {
    if unmet.iter().all(Vec::is_empty) {
        return;
    }
    let table = memo.table(obs.offerings, &cfg.offers);
    let nl = cfg.lanes.len();
    let mut order: Vec<LaneId> = (0..nl).collect();
    order.sort_by_key(|&l| (cfg.lanes[l].priority, l));
    for &lane in &order {
        let lc = &cfg.lanes[lane];
        let jobs = std::mem::take(&mut unmet[lane]);
        if jobs.is_empty() {
            continue;
        }
        let n_unmet = jobs.len() as u32;
        if cfg.limits.frozen {
            plan.held.push(Held {
                lane,
                count: n_unmet,
                reason: Reason::Frozen,
            });
            continue;
        }
        if let Some(cap) = fleet.breaker {
            plan.held.push(Held {
                lane,
                count: n_unmet,
                reason: Reason::BudgetBreaker {
                    spend_usd_per_h: fleet.spend,
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
        let activation = fleet.lane_live[lane] == 0;
        if activation && backlog.max(n_unmet) < lc.activation_backlog {
            continue;
        }
        if !activation && n_unmet < cfg.anti_thrash.scale_up_unmet_jobs {
            continue;
        }
        let is_ripe = |j: &PendingJob| now - j.enqueued_at >= cfg.anti_thrash.scale_up_window_s;
        if let Some(limit) = full_before_any(cfg, lane, fleet) {
            // What `scale_up_lane` would hold, without queueing each job by project first: with
            // the lane or the fleet full, and no quota or cap to hold a job for first, the first
            // job is held for the limit and every job left with it. A backlog of tens of
            // thousands behind a capped fleet made that queueing most of each decision.
            let count = jobs.iter().filter(|j| is_ripe(j)).count() as u32;
            if count > 0 {
                plan.held.push(Held {
                    lane,
                    count,
                    reason: Reason::MaxWorkers { limit },
                });
            }
            continue;
        }
        let reason = if activation {
            Reason::Activation {
                backlog: backlog.max(n_unmet),
            }
        } else {
            Reason::UnmetBacklog { unmet_jobs: n_unmet }
        };
        let ripe: Vec<&'a PendingJob> = jobs.into_iter().filter(|j| is_ripe(j)).collect();
        scale_up_lane(obs, cfg, table, now, lane, &ripe, reason, fleet, plan);
    }
}

/// Request a ranking is cached for: (GPUs, min memory bits, instances, capacity (0 the lane's,
/// 1 on-demand for a deadline, 2 spot only while waiting for spot), run-time bucket). Run times within a factor of two share a ranking: the expected cost per job
/// weighs boot against run time, so a long job may rank offerings differently from a short one.
type RankKey = (u32, u64, u32, u8, i32);

/// A per-decision cache of [`scale_up_lane`], keyed by small integers.
type Cache<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// The on-demand premium of a request, $: the best on-demand offering's expected cost per job less
/// the best spot offering's, ignoring availability; `None` when either kind has no offering.
///
/// A spot-first job launches on spot only (and waits for spot while none is available) until
/// on-demand's premium is below what its wait is worth,
/// `wait_value_usd_per_h x (waited + unavailable_ttl_s) / 3600` ([`waits_for_spot`]). A long job
/// waits for spot through capacity errors (an hour on a V100 costs about $2 more on-demand, so at
/// $1/h of waiting it waits up to two hours per hour of run time); a short one, or one that has
/// waited long, may take on-demand. Jobs whose deadline is at risk are apart: they go to
/// on-demand whatever this says.
/// `table` is the [`PriceTable`] of the decision's catalogue under `cfg.offers`.
pub(crate) fn on_demand_premium_usd(table: &PriceTable, req: &Request) -> Option<f64> {
    let (spot, od) = table.cheapest_by_capacity(req);
    (spot.is_finite() && od.is_finite()).then_some(od - spot)
}

/// What a job that has waited `waited_s` would save by launching now rather than after the
/// offerings it waits for are back, $: `wait_value_usd_per_h x (waited + unavailable_ttl_s) /
/// 3600`. Both [`waits_for_spot`] and [`cost_ceiling_usd`] weigh a premium against it.
fn wait_worth_usd(cfg: &PolicyConfig, waited_s: f64) -> f64 {
    cfg.scale_down.wait_value_usd_per_h * (waited_s + cfg.offers.unavailable_ttl_s) / 3600.0
}

/// Whether a job that has waited `waited_s` with on-demand `premium_usd` dearer than spot stays on
/// spot (see [`on_demand_premium_usd`]).
pub(crate) fn waits_for_spot(cfg: &PolicyConfig, premium_usd: f64, waited_s: f64) -> bool {
    premium_usd > wait_worth_usd(cfg, waited_s)
}

/// The best expected cost per job, $, of a request whose capacity preference is `capacity`, from
/// [`choice::PriceTable::cheapest_by_capacity`]'s (spot, on-demand) pair: infinite when no
/// offering of the kinds it allows exists.
fn best_cost_usd((spot, on_demand): (f64, f64), capacity: CapacityPreference) -> f64 {
    match capacity {
        CapacityPreference::SpotOnly => spot,
        CapacityPreference::OnDemand => on_demand,
        CapacityPreference::SpotFirst => spot.min(on_demand),
    }
}

/// The most a job that has waited `waited_s` may cost on the offering it launches on, $: the best
/// offering's expected cost per job, availability ignored (`best_usd`), plus what its wait is
/// worth, `wait_value_usd_per_h x (waited + unavailable_ttl_s) / 3600`.
///
/// When the best offerings are out of capacity (a capacity error marks one unavailable for
/// `unavailable_ttl_s`, 180 s), the next in the ranking may cost several times as much for the same
/// job: a p5en.48xlarge at 17.50 $/h where a g4dn.metal at 2.83 $/h would do. Taking one saves
/// the job the wait until the cheaper ones are back, so it is taken only while that wait, at the
/// user's wait value, is worth more than the difference: the rule [`waits_for_spot`] applies to
/// on-demand, applied to every fallback. On the busy week with measured preemptions, where spot
/// capacity is short most of the time, it took onoff from 1.276 to 1.139 x the lower bound at the
/// same waits (README, "Measured preemptions").
pub(crate) fn cost_ceiling_usd(cfg: &PolicyConfig, best_usd: f64, waited_s: f64) -> f64 {
    best_usd + wait_worth_usd(cfg, waited_s)
}

/// How many of `ranked` (best first, with expected costs per job) cost no more than `ceiling_usd`.
fn within_ceiling(ranked: &[(&Offering, f64)], ceiling_usd: f64) -> usize {
    ranked.partition_point(|&(_, c)| c <= ceiling_usd * (1.0 + 1e-9))
}

/// Jobs of one lane launched together: one ranking, one project.
struct Group<'a> {
    key: RankKey,
    /// How much of the ranking the group's jobs may take (see [`within_ceiling`]).
    worth: usize,
    project: &'a str,
    req: Request,
    instances: u32,
    /// The lowest cost ceiling of its jobs, $ per instance (`LaunchShape::max_cost_usd`).
    max_cost: f64,
}

/// Run-time bucket of [`RankKey`]: ceil(log2(seconds)).
fn runtime_bucket(runtime_s: f64) -> i32 {
    runtime_s.max(1.0).log2().ceil() as i32
}

/// Per-project FIFO queues of one lane's unmet jobs, each under its project's name and a cheap
/// key of it ([`super::fleet::name_key`]). A map keyed by name compared whole names for every job
/// queued: with a backlog of thousands behind a full fleet that was most of a decision.
struct ProjectQueues<'a>(Vec<(u64, &'a str, VecDeque<&'a PendingJob>)>);

impl<'a> ProjectQueues<'a> {
    /// `jobs` (most urgent first) per project, in order.
    fn new(jobs: &[&'a PendingJob]) -> Self {
        let mut queues: Vec<(u64, &'a str, VecDeque<&'a PendingJob>)> = Vec::new();
        for &j in jobs {
            let (key, name) = (super::fleet::name_key(&j.project), j.project.as_str());
            match queues.iter_mut().find(|q| super::fleet::same_name(q.0, q.1, key, name)) {
                Some(q) => q.2.push_back(j),
                None => queues.push((key, name, VecDeque::from([j]))),
            }
        }
        Self(queues)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Jobs queued in all.
    fn len(&self) -> usize {
        self.0.iter().map(|q| q.2.len()).sum()
    }

    /// Take the first job of the project that `order` puts first (a total order on names).
    fn pop_next(&mut self, order: impl Fn(&str, &str) -> std::cmp::Ordering) -> (&'a str, &'a PendingJob) {
        let i = (0..self.0.len())
            .min_by(|&x, &y| order(self.0[x].1, self.0[y].1))
            .expect("pop_next on no queue");
        let (_, name, q) = &mut self.0[i];
        let (name, job) = (*name, q.pop_front().expect("queues hold no empty deque"));
        if q.is_empty() {
            self.0.swap_remove(i);
        }
        (name, job)
    }

    /// Drop `project`'s queue; returns how many jobs it held.
    fn remove(&mut self, project: &str) -> usize {
        match self.0.iter().position(|q| q.1 == project) {
            Some(i) => self.0.swap_remove(i).2.len(),
            None => 0,
        }
    }
}

/// The limit that holds every job of `lane` before any is looked at: the lane or the fleet is full
/// (no room for one instance), and no project GPU quota or job-type cap is configured (either could
/// hold the first job for itself instead). `None` otherwise.
pub(crate) fn full_before_any(cfg: &PolicyConfig, lane: LaneId, b: &Fleet<'_>) -> Option<u32> {
    let (room, limit) = b.room(cfg, lane);
    let no_other_hold =
        cfg.limits.job_type_caps.is_empty() && cfg.limits.projects.values().all(|q| q.max_gpus.is_none());
    (room == 0 && no_other_hold).then_some(limit)
}

/// Allocate launches for the unmet jobs of one lane with weighted fair share between projects.
#[allow(clippy::too_many_arguments)]
fn scale_up_lane<'a>(
    obs: &Observation<'a>,
    cfg: &PolicyConfig,
    table: &PriceTable,
    now: f64,
    lane: LaneId,
    jobs: &[&'a PendingJob],
    reason: Reason,
    b: &mut Fleet<'a>,
    plan: &mut Plan,
) {
    let lc = &cfg.lanes[lane];
    let oc = &cfg.offers;
    // Per-project FIFO queues (jobs are already most-urgent first).
    let mut queues = ProjectQueues::new(jobs);
    // Ranked offerings per request shape, computed once; likewise on-demand's premium over spot.
    // Looked up for every job of the backlog (three times), never iterated: foldhash, not the
    // default SipHash, which was a twelfth of a replay's instructions with measured preemptions
    // (`callgrind`, README "Replays with measured preemptions").
    let mut ranked_cache: Cache<RankKey, Vec<(&Offering, f64)>> = Cache::default();
    let mut premium_cache: Cache<(u32, u64, u32, i32), Option<f64>> = Cache::default();
    // The best expected cost per job of a request, availability ignored.
    let mut best_cache: Cache<RankKey, f64> = Cache::default();
    // Jobs allocated per group (for aggregated launches), in allocation order.
    let mut groups: Vec<Group<'a>> = Vec::new();
    let mut held: BTreeMap<String, (u32, Reason)> = BTreeMap::new();
    let mut hold = |reason: Reason, n: u32| {
        // Jobs waiting for spot, or for capacity, are one entry each (their premiums and waits
        // differ).
        let key = match reason {
            Reason::WaitingForSpot { .. } => "waiting for spot".to_string(),
            Reason::WaitingForCapacity { .. } => "waiting for capacity".to_string(),
            _ => reason.to_string(),
        };
        let e = held.entry(key).or_insert((0, reason));
        e.0 += n;
    };
    // Once the lane or the fleet is full, the limit that bound.
    let mut full: Option<u32> = None;
    // Short-job work the workers launched here can still absorb, per (GPUs, min memory bits).
    let mut credit: Vec<((u32, u64), f64)> = Vec::new();
    while !queues.is_empty() {
        // Project with the least GPUs per unit of weight goes next.
        let (project, job) = queues.pop_next(|a, b2| {
            let ua = b.project_gpus.get(a) as f64 / cfg.project_quota(a).weight;
            let ub = b.project_gpus.get(b2) as f64 / cfg.project_quota(b2).weight;
            ua.total_cmp(&ub).then(a.cmp(b2))
        });
        if let Some(limit) = full {
            // Every job left is held for the same limit: all at once, not one by one (a backlog
            // of thousands behind a full fleet made each decision format a reason per job).
            hold(Reason::MaxWorkers { limit }, 1 + queues.len() as u32);
            break;
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
                    1 + queues.remove(project) as u32,
                );
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
        let (room, limit) = b.room(cfg, lane);
        if room < instances {
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
        let at_risk =
            crate::deadline::at_risk_slack_s(job.deadline, runtime, now, cfg).filter(|_| lc.capacity.may_use_spot());
        let capacity = if at_risk.is_some() {
            CapacityPreference::OnDemand
        } else {
            lc.capacity
        };
        let mut req = Request {
            gpus: job.gpus_per_instance,
            min_mem_gib: min_mem,
            capacity,
            instances,
            runtime_s: runtime,
        };
        let mut cap_code = u8::from(at_risk.is_some());
        let waited = now - job.enqueued_at;
        let spot_premium = if capacity == CapacityPreference::SpotFirst {
            let pkey = (
                job.gpus_per_instance,
                min_mem.to_bits(),
                instances,
                runtime_bucket(runtime),
            );
            (*premium_cache
                .entry(pkey)
                .or_insert_with(|| on_demand_premium_usd(table, &req)))
            .filter(|p| waits_for_spot(cfg, *p, waited))
        } else {
            None
        };
        if spot_premium.is_some() {
            req.capacity = CapacityPreference::SpotOnly;
            cap_code = 2;
        }
        let key = (
            job.gpus_per_instance,
            min_mem.to_bits(),
            instances,
            cap_code,
            runtime_bucket(runtime),
        );
        let ranked = ranked_cache.entry(key).or_insert_with(|| {
            let blocked = b
                .blocked
                .get_or_init(|| table.blocked(obs.offerings, obs.unavailable, now));
            table.top_in(obs.offerings, &req, blocked, oc.diversify as usize)
        });
        // Fallback types dearer than the job's wait is worth are not taken (a deadline at risk
        // takes what there is).
        let best = *best_cache
            .entry(key)
            .or_insert_with(|| best_cost_usd(table.cheapest_by_capacity(&req), req.capacity));
        let ceiling = match at_risk {
            Some(_) => f64::INFINITY,
            None => cost_ceiling_usd(cfg, best, waited),
        };
        let worth = within_ceiling(ranked, ceiling);
        if worth == 0 {
            // No launch is worth it now, but a stopped worker may be: a start bills no boot and
            // saves the wait a cold start would add, so its cost per job can be under the ceiling
            // where every offering's launch is over it.
            if start_whole(obs, cfg, table, now, lane, &req, project, &reason, b, plan, ceiling) {
                if let Some(t) = &job.job_type {
                    b.type_jobs.add(t, 1);
                }
                continue;
            }
            let reason = match (ranked.first(), spot_premium) {
                (Some(&(_, cost)), _) => Reason::WaitingForCapacity {
                    premium_usd: cost - best,
                    waited_s: waited,
                },
                (None, Some(premium)) => Reason::WaitingForSpot {
                    on_demand_premium_usd: premium,
                    waited_s: waited,
                },
                (None, None) => Reason::NoOffering {
                    gpus: job.gpus_per_instance,
                    min_gpu_memory_gib: min_mem,
                },
            };
            hold(reason, 1);
            continue;
        }
        let ranked = &ranked[..worth];
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
            let starts = StartFor {
                lane,
                req: &req,
                project: Some(project),
                job: Some(&job.id),
                reason: &reason,
                max_price_usd_per_h: cfg.limits.max_usd_per_h.map(|_| price / instances as f64),
                whole: false,
            };
            let started = push_starts(
                plan,
                b.stopped.of(lane),
                obs,
                table,
                &b.blocked,
                now,
                &starts,
                instances,
                f64::INFINITY,
                cfg,
            );
            push_launches_booked(
                plan,
                lane,
                ranked,
                &req,
                instances - started,
                Some(project),
                Some(&job.id),
                reason,
                None,
                oc,
            );
            continue;
        }
        let max_cost = ceiling / instances as f64;
        match groups
            .iter_mut()
            .find(|g| g.key == key && g.worth == worth && g.project == project)
        {
            Some(g) => {
                g.instances += instances;
                g.max_cost = g.max_cost.min(max_cost);
            }
            None => groups.push(Group {
                key,
                worth,
                project,
                req,
                instances,
                max_cost,
            }),
        }
    }
    for g in groups {
        // jobs_per_worker jobs share one worker (1 by default); the spare bookings are handed back.
        let workers = g.instances.div_ceil(lc.jobs_per_worker);
        let spare = g.instances - workers;
        b.live_total -= spare;
        b.lane_live[lane] -= spare;
        let ranked = &ranked_cache[&g.key][..g.worth];
        let starts = StartFor {
            lane,
            req: &g.req,
            project: Some(g.project),
            job: None,
            reason: &reason,
            max_price_usd_per_h: cfg.limits.max_usd_per_h.map(|_| choice::spread_max_price(ranked, oc)),
            whole: false,
        };
        let started = push_starts(
            plan,
            b.stopped.of(lane),
            obs,
            table,
            &b.blocked,
            now,
            &starts,
            workers,
            g.max_cost,
            cfg,
        );
        push_launches_booked(
            plan,
            lane,
            ranked,
            &g.req,
            workers - started,
            Some(g.project),
            None,
            reason.clone(),
            g.max_cost.is_finite().then_some(g.max_cost),
            oc,
        );
    }
    for (_, (count, reason)) in held {
        plan.held.push(Held { lane, count, reason });
    }
}

/// Start `req.instances` of `lane`'s stopped workers for one job of `project` whose launch is
/// held (no offering's launch is within its cost ceiling, `ceiling_usd`, $ for the whole job),
/// all or none, each at most `ceiling_usd / instances` per job (see [`push_starts`]); under a $/h
/// budget, each at most the room left under the cap per instance. Books the started workers in the
/// fleet (spend at their rows' prices, live counts, the project's GPUs) and returns whether it
/// started them.
#[allow(clippy::too_many_arguments)]
fn start_whole<'a>(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    table: &PriceTable,
    now: f64,
    lane: LaneId,
    req: &Request,
    project: &'a str,
    reason: &Reason,
    b: &mut Fleet<'a>,
    plan: &mut Plan,
    ceiling_usd: f64,
) -> bool {
    let n = req.instances.max(1);
    if (b.stopped.of(lane).len() as u32) < n {
        return false;
    }
    let for_ = StartFor {
        lane,
        req,
        project: Some(project),
        job: None,
        reason,
        max_price_usd_per_h: cfg.limits.max_usd_per_h.map(|cap| (cap - b.spend) / n as f64),
        whole: true,
    };
    let first = plan.actions.len();
    let started = push_starts(
        plan,
        b.stopped.of(lane),
        obs,
        table,
        &b.blocked,
        now,
        &for_,
        n,
        ceiling_usd / n as f64,
        cfg,
    );
    if started == 0 {
        return false;
    }
    for a in &plan.actions[first..] {
        if let Action::Start { price_usd_per_h, .. } = a {
            b.spend += price_usd_per_h;
        }
    }
    b.live_total += n;
    b.lane_live[lane] += n;
    b.project_gpus.add(project, req.gpus * n);
    true
}

/// What capacity started from stopped workers is for.
pub(crate) struct StartFor<'r> {
    pub(crate) lane: LaneId,
    pub(crate) req: &'r Request,
    pub(crate) project: Option<&'r str>,
    /// The job it is pinned to (a deadline at risk on spot).
    pub(crate) job: Option<&'r str>,
    pub(crate) reason: &'r Reason,
    /// With `limits.max_usd_per_h` set: the $/h per instance the budget booked for the capacity
    /// (the launch's dearest spread price); a stopped worker billing more per hour is not started,
    /// so the cap holds.
    pub(crate) max_price_usd_per_h: Option<f64>,
    /// All `n` workers or none: a job on several instances is not started on some of them.
    pub(crate) whole: bool,
}

/// Start up to `n` of a lane's stopped workers (`stopped`; the ones started are taken out of
/// it) for `for_.req` instead of launching, the cheapest per job first, and among those equally
/// cheap one holding `for_.project`'s cache ([`WorkerView::cached_projects`]), then the most
/// recently stopped; returns how many were
/// started. A stopped worker is started when it fits the request (GPUs, memory, capacity type),
/// its offering is available and still allowed, and its expected cost per job started
/// ([`PriceTable::restart_cost_at`]), less the wait a start saves over a cold start
/// (`wait value x (boot - restart) / 3600`), is at most `max_cost_usd` (per instance: the launch's
/// cost ceiling, infinite for none), and, under a $/h budget, neither its row's price nor its
/// offering's price now is above the launch the budget booked (`StartFor::max_price_usd_per_h`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn push_starts(
    plan: &mut Plan,
    stopped: &mut super::fleet::Workers<'_>,
    obs: &Observation<'_>,
    table: &PriceTable,
    blocked: &std::cell::OnceCell<crate::choice::Blocked>,
    now: f64,
    for_: &StartFor<'_>,
    n: u32,
    max_cost_usd: f64,
    cfg: &PolicyConfig,
) -> u32 {
    if n == 0 || stopped.is_empty() {
        return 0;
    }
    let oc = &cfg.offers;
    let req = for_.req;
    let saved_usd =
        cfg.scale_down.wait_value_usd_per_h * (oc.boot_estimate_s - oc.restart_estimate_s).max(0.0) / 3600.0;
    // The offerings the lane's stopped workers are of are few: each one's availability and cost
    // for the request worked out once.
    let mut priced: smallvec::SmallVec<[(&OfferingKey, Option<f64>); 8]> = smallvec::SmallVec::new();
    // Inline: a lane's stopped workers are a few dozen, and this runs on most warm-pool top-ups.
    let mut fit: smallvec::SmallVec<[(usize, f64); 32]> = smallvec::SmallVec::new();
    for (i, w) in stopped.iter().enumerate() {
        if !(choice::capacity_ok(req.capacity, w.offering.capacity_type)
            && choice::fits(w.gpus, w.gpu_memory_gib, req.gpus, req.min_mem_gib, oc.max_gpu_oversize)
            && for_
                .max_price_usd_per_h
                .is_none_or(|m| w.price_usd_per_h <= m * (1.0 + 1e-9)))
        {
            continue;
        }
        let cost = match priced.iter().find(|p| same_offering(p.0, &w.offering)) {
            Some(p) => p.1,
            None => {
                // An offering not in the catalogue has no restart cost. The marks are looked up
                // once per decision ([`Fleet::blocked`]): comparing each stopped worker's
                // offering with each of hundreds of marks was a tenth of a replay's time with
                // measured preemptions (`perf`).
                let at = table.index_of(obs.offerings, &w.offering);
                let available = at.is_some_and(|i| {
                    !blocked
                        .get_or_init(|| table.blocked(obs.offerings, obs.unavailable, now))
                        .contains(i)
                });
                // Under a budget, the offering's price now (what a started instance bills) is
                // held to the booked price too.
                let within_budget = for_
                    .max_price_usd_per_h
                    .is_none_or(|m| at.is_some_and(|i| obs.offerings[i].price_usd_per_h <= m * (1.0 + 1e-9)));
                let cost = at
                    .and_then(|i| table.restart_cost_at(i, req.runtime_s, oc))
                    .filter(|_| available && within_budget)
                    .map(|c| c - saved_usd)
                    .filter(|c| *c <= max_cost_usd * (1.0 + 1e-9));
                priced.push((&w.offering, cost));
                cost
            }
        };
        if let Some(c) = cost {
            fit.push((i, c));
        }
    }
    if fit.is_empty() {
        return 0;
    }
    // Cheapest first; among equals one whose volume holds the project's cache (its job finds
    // what the project's last job left), then the most recently stopped (its volume the
    // freshest), then by launch sequence and id: never by the order the workers were listed in.
    let since = |w: &WorkerView| w.idle_since.unwrap_or(w.launched_at);
    let cached = |w: &WorkerView| for_.project.is_some_and(|p| w.cached_projects.iter().any(|c| c == p));
    let order = |a: &(usize, f64), b: &(usize, f64)| {
        let (wa, wb) = (stopped[a.0], stopped[b.0]);
        a.1.total_cmp(&b.1)
            .then(cached(wb).cmp(&cached(wa)))
            .then(since(wb).total_cmp(&since(wa)))
            .then(wb.seq.cmp(&wa.seq))
            .then_with(|| wa.id.cmp(&wb.id))
    };
    if for_.whole && fit.len() < n as usize {
        return 0;
    }
    let n = (n as usize).min(fit.len());
    if n == 1 {
        // The common case (one warm worker or one job short): the first in order, in one pass.
        let best = fit.iter().copied().min_by(order).expect("fit is not empty");
        fit.clear();
        fit.push(best);
    } else {
        if n < fit.len() {
            fit.select_nth_unstable_by(n, order);
            fit.truncate(n);
        }
        fit.sort_unstable_by(order);
    }
    let max_cost = max_cost_usd.is_finite().then_some(max_cost_usd);
    for &(i, _) in &fit {
        let w = stopped[i];
        plan.actions.push(Action::Start {
            worker: w.id.clone(),
            lane: for_.lane,
            offering: w.offering.clone(),
            price_usd_per_h: w.price_usd_per_h,
            request: LaunchShape {
                gpus: req.gpus,
                min_gpu_memory_gib: req.min_mem_gib,
                capacity: req.capacity,
                runtime_s: req.runtime_s,
                max_cost_usd: max_cost,
            },
            project: for_.project.map(str::to_string),
            job: for_.job.map(str::to_string),
            stopped_at: w.idle_since,
            stopped_until: w.stopped_until,
            launched_at: w.launched_at,
            reason: for_.reason.clone(),
        });
    }
    let mut taken: smallvec::SmallVec<[usize; 8]> = fit.iter().map(|f| f.0).collect();
    taken.sort_unstable();
    for i in taken.into_iter().rev() {
        stopped.remove(i);
    }
    fit.len() as u32
}

/// `a == b`, most unequal keys told apart without comparing whole names: a lane's stopped
/// workers are of a few offerings, often one instance type in several zones (`us-east-1a`,
/// `us-east-1b`: the last letter differs), and `push_starts` matches each to them. Comparing
/// whole names was 1.7 % of a full Philly replay's instructions (`callgrind`).
fn same_offering(a: &OfferingKey, b: &OfferingKey) -> bool {
    let ends = |x: &str, y: &str| x.len() == y.len() && x.as_bytes().last() == y.as_bytes().last();
    a.capacity_type == b.capacity_type
        && ends(&a.zone, &b.zone)
        && ends(&a.instance_type, &b.instance_type)
        && a.zone == b.zone
        && a.instance_type == b.instance_type
}

/// Push launch actions for capacity already booked in the fleet's budget.
#[allow(clippy::too_many_arguments)]
pub(crate) fn push_launches_booked(
    plan: &mut Plan,
    lane: LaneId,
    ranked: &[(&Offering, f64)],
    req: &Request,
    count: u32,
    project: Option<&str>,
    job: Option<&str>,
    reason: Reason,
    max_cost_usd: Option<f64>,
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
                max_cost_usd,
            },
            project: project.map(str::to_string),
            job: job.map(str::to_string),
            reason: reason.clone(),
        });
        n += c;
    }
    n
}
