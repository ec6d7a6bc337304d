//! Phase 4: ready workers held for arrivals not yet here: the scheduled warm pool, and the
//! predictive one where its idle cost is below the wait it saves.

use smallvec::SmallVec;

use crate::choice::{self, RankMemo, Request};
use crate::config::{CapacityPreference, PolicyConfig};
use crate::keepalive;
use crate::observation::{LaneId, Observation};
use crate::plan::{Held, Plan, Reason};
use crate::shape::fits;

use super::fleet::Fleet;
use super::scale_up::{push_launches_booked, push_starts, StartFor};

/// What phase 4 decided for a lane, for phase 5: the warm pool per job shape.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Warm {
    /// One entry per shape with a target, GPUs ascending.
    pub(crate) shapes: SmallVec<[WarmShape; 4]>,
}

/// The warm pool of one job shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct WarmShape {
    /// GPUs per instance of the jobs the pool is for.
    pub(crate) gpus: u32,
    /// Ready workers fitting such jobs to hold.
    pub(crate) target: u32,
    /// Idle workers fitting such jobs left after matching.
    pub(crate) idle: u32,
}

impl Warm {
    /// Ready workers held in all, over the shapes.
    pub(crate) fn target(&self) -> u32 {
        self.shapes.iter().map(|s| s.target).sum()
    }

    /// The first shape a worker of `gpus` GPUs of `mem` GiB each serves whose count in `held`
    /// (one per shape) is still below its target.
    pub(crate) fn slot(&self, cfg: &PolicyConfig, gpus: u32, mem: f64, held: &[u32]) -> Option<usize> {
        self.shapes.iter().enumerate().position(|(i, s)| {
            held[i] < s.target
                && fits(
                    gpus,
                    mem,
                    s.gpus,
                    cfg.offers.min_gpu_memory_gib,
                    cfg.offers.max_gpu_oversize,
                )
        })
    }
}

/// The predictive warm pool of one job shape, from the lane's long-job demand per window of the look-back, most recent (the current, partial one)
/// first ([`crate::observation::LaneObservation::window_demand`]): the newsvendor's critical
/// fractile.
///
/// Holding the i-th ready worker through a window of W seconds costs W idle seconds when the
/// window needs fewer than i workers; not holding it costs a cold start (the break-even `be` idle
/// seconds' worth: billed boot plus the wait valued at `wait_value_usd_per_h`,
/// [`keepalive::break_even_s`]) when it needs i or more. It pays for itself when the share p_i of
/// windows needing at least i workers satisfies `p_i x be >= (1 - p_i) x W`, i.e.
/// `p_i >= W / (be + W)`. Demand comes in runs (bursts, then quiet), so p_i is taken over the
/// windows that followed one like the current one (busy or quiet), not over all: a quiet spell
/// holds nothing even when the look-back saw bursts. The target is the largest such i: the k-th
/// largest of those m windows' demand with `k = ceil(m x W / (be + W))` (and k at least
/// `predictive_min_bursts`), at most `predictive_max`. So a higher wait value holds more, every
/// shape is priced at its own price, a lone burst holds nothing, and a steady stream of long jobs
/// holds what it uses. 0 without demand.
pub(crate) struct Fractile(SmallVec<[u32; 32]>);

impl Fractile {
    /// The demand of the windows that followed one like the current one (busy or quiet),
    /// ascending.
    pub(crate) fn new(demand: &[u32]) -> Self {
        let busy_now = demand.first().is_some_and(|d| *d > 0);
        // Most windows need nothing: the zeros first, then only the others sorted (this runs per
        // shape on every decision).
        let mut d: SmallVec<[u32; 32]> = SmallVec::with_capacity(demand.len());
        let mut zeros = 0;
        for p in demand.windows(2).filter(|p| (p[1] > 0) == busy_now) {
            if p[0] == 0 {
                zeros += 1;
            } else {
                d.push(p[0]);
            }
        }
        d.sort_unstable();
        d.insert_many(0, std::iter::repeat_n(0, zeros));
        Self(d)
    }

    /// [`Fractile::new`] for `lane`'s job shape of `gpus` GPUs, from `memo` while its demand is
    /// what it was at the last decision that asked (rebuilding it was 3 % of a full Philly
    /// replay's instructions, `callgrind`).
    pub(crate) fn memoised(lane: LaneId, gpus: u32, demand: &[u32], memo: &mut RankMemo) -> Self {
        let samples = crate::choice::kept(
            &mut memo.fractiles,
            (lane, gpus),
            |kept_demand| kept_demand.as_slice() == demand,
            |kept_demand| {
                kept_demand.clear();
                kept_demand.extend_from_slice(demand);
                Self::new(demand).0
            },
        );
        Self(samples.clone())
    }

    /// The pool for workers billed `price_usd_per_h`.
    pub(crate) fn target(&self, cfg: &PolicyConfig, lane: LaneId, price_usd_per_h: f64) -> u32 {
        let be = keepalive::break_even_s(cfg.offers.boot_estimate_s, price_usd_per_h, &cfg.scale_down);
        self.target_at(cfg, lane, be)
    }

    /// The pool worth launching for, for workers billed `price_usd_per_h`: [`Fractile::target`]
    /// with the break-even `boot x wait value / price` in place of [`keepalive::break_even_s`].
    /// A worker launched ahead of an arrival pays its boot as one launched on the arrival would,
    /// so it saves only the wait; holding one already up also saves a billed boot.
    pub(crate) fn launch_target(&self, cfg: &PolicyConfig, lane: LaneId, price_usd_per_h: f64) -> u32 {
        let be = cfg.offers.boot_estimate_s * cfg.scale_down.wait_value_usd_per_h / price_usd_per_h.max(1e-9);
        self.target_at(cfg, lane, be)
    }

    fn target_at(&self, cfg: &PolicyConfig, lane: LaneId, be: f64) -> u32 {
        let lc = &cfg.lanes[lane];
        let w = lc.predictive_window_s;
        let k = ((self.0.len() as f64 * w / (be + w)).ceil() as usize)
            .max(lc.predictive_min_bursts as usize)
            .max(1);
        // The k-th largest.
        self.0
            .len()
            .checked_sub(k)
            .map_or(0, |i| self.0[i].min(lc.predictive_max))
    }
}

/// Workers to launch ahead of a burst bigger than the look-back saw
/// ([`crate::config::LaneConfig::predictive_burst`]): `factor` times the excess of the current
/// window's demand (`demand[0]`, windows most recent first, in workers) over every earlier
/// window's, rounded down; 0 when some earlier window needed as many, when the current window
/// needs fewer than `min` workers (`predictive_burst_min`), or when `factor` is 0.
pub(crate) fn burst_ahead(demand: &[u32], factor: f64, min: u32) -> u32 {
    let Some((&now, before)) = demand.split_first() else {
        return 0;
    };
    // Off by default: no pass over the windows then (one ran per shape on every decision).
    if factor <= 0.0 || now == 0 || now < min {
        return 0;
    }
    let seen = before.iter().copied().max().unwrap_or(0);
    if now <= seen {
        return 0;
    }
    (f64::from(now - seen) * factor) as u32
}

/// Per job shape, top up `lane`'s ready workers fitting it to the shape's target (for
/// `warm_pool_gpus`, the scheduled size for this hour or the predictive pool, whichever is
/// larger; for the other shapes the predictive pool), within the lane's and the fleet's caps and
/// the budget; nothing launched while frozen or over the budget cap.
pub(crate) fn warm_capacity(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    now: f64,
    lane: LaneId,
    fleet: &mut Fleet<'_>,
    plan: &mut Plan,
    memo: &mut RankMemo,
) -> Warm {
    let lc = &cfg.lanes[lane];
    let oc = &cfg.offers;
    let hour = (now.rem_euclid(86_400.0) / 3600.0) as u32;
    let scheduled = lc.warm_pool_size_at(hour);
    // The demand per shape, GPUs ascending: read from the kept windows where the caller keeps
    // them (shapes with no demand left are skipped below, as absent ones), else scanned.
    let scanned;
    let demand: &[(u32, Vec<u32>)] = match (lc.predictive_max, obs.lanes.get(lane)) {
        (0, _) | (_, None) => &[],
        (_, Some(o)) => {
            let (window_s, lookback_s) = (lc.predictive_window_s, lc.predictive_lookback_s);
            let long = (oc.short_job_horizon_s, oc.default_runtime_s);
            match o.kept_demand(now, window_s, lookback_s, long) {
                Some(d) => d.shapes(),
                None => {
                    scanned = o.window_demand(now, window_s, lookback_s, long);
                    &scanned
                }
            }
        }
    };
    // The scheduled pool's shape, in its place, when no arrival asked for it.
    let at = demand.partition_point(|(g, _)| *g < lc.warm_pool_gpus);
    let scheduled_shape = (scheduled > 0 && demand.get(at).is_none_or(|(g, _)| *g != lc.warm_pool_gpus))
        .then(|| (lc.warm_pool_gpus, Vec::new()));
    let mut warm = Warm::default();
    for (gpus, d) in demand[..at].iter().chain(&scheduled_shape).chain(&demand[at..]) {
        let scheduled = if *gpus == lc.warm_pool_gpus { scheduled } else { 0 };
        // An OR over the windows rather than a search for the first non-zero one: no branch
        // per window, and it runs per shape on every decision.
        if scheduled == 0 && d.iter().fold(0, |any, x| any | x) == 0 {
            continue;
        }
        let ws = shape_capacity(obs, cfg, now, lane, *gpus, scheduled, d, fleet, plan, memo);
        if ws.target > 0 {
            warm.shapes.push(ws);
        }
    }
    warm
}

/// Phase 4 for one shape: its target, and the launches that fill it.
#[allow(clippy::too_many_arguments)]
fn shape_capacity(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    now: f64,
    lane: LaneId,
    gpus: u32,
    scheduled: u32,
    demand: &[u32],
    fleet: &mut Fleet<'_>,
    plan: &mut Plan,
    memo: &mut RankMemo,
) -> WarmShape {
    let lc = &cfg.lanes[lane];
    let oc = &cfg.offers;
    let mut req = Request {
        gpus,
        min_mem_gib: oc.min_gpu_memory_gib,
        capacity: lc.capacity,
        instances: 1,
        runtime_s: oc.default_runtime_s,
    };
    let serves = |g: u32, mem: f64| fits(g, mem, gpus, oc.min_gpu_memory_gib, oc.max_gpu_oversize);
    let k = oc.diversify as usize;
    let mut ranked = None;
    let mut target = scheduled;
    let mut launch_target = scheduled;
    // The most the pool could be (a free worker's price: the smallest fractile): when that is
    // nothing, no price is needed.
    let fractile = Fractile::memoised(lane, gpus, demand, memo);
    if fractile.target(cfg, lane, 0.0) > 0 {
        // Priced at the fitting live workers (the cheapest), else at the offering a launch would
        // take: ranking the offerings only when it must keeps decide() cheap.
        let have = fleet
            .cheapest
            .iter()
            .filter(|((g, mem), _)| serves(*g, f64::from_bits(*mem)))
            .map(|(_, p)| *p)
            .reduce(f64::min);
        let price = have.or_else(|| {
            let top = memo.top(obs.offerings, &req, oc, obs.unavailable, now, k);
            ranked.insert(top).first().map(|(o, _)| o.price_usd_per_h)
        });
        if let Some(price) = price {
            target = target.max(fractile.target(cfg, lane, price));
            launch_target = launch_target.max(fractile.launch_target(cfg, lane, price));
        }
    }
    launch_target = launch_target.max(burst_ahead(demand, lc.predictive_burst, lc.predictive_burst_min));
    let (idle, pending) = fleet.free[lane]
        .iter()
        .filter(|c| serves(c.gpus, c.mem))
        .fold((0, 0), |(i, p), c| (i + c.idle, p + c.pending));
    let ws = WarmShape { gpus, target, idle };
    if launch_target <= idle + pending || cfg.limits.frozen || fleet.breaker.is_some() {
        return ws;
    }
    let want = launch_target - idle - pending;
    let (room, limit) = fleet.room(cfg, lane);
    let mut n = want.min(room);
    if n < want {
        plan.held.push(Held {
            lane,
            count: want - n,
            reason: Reason::MaxWorkers { limit },
        });
    }
    // Warm capacity in a spot-first lane is spot only: a speculative worker is not worth
    // on-demand's premium (a job that has waited may take on-demand, scale_up::waits_for_spot).
    if n > 0 && lc.capacity == CapacityPreference::SpotFirst {
        req.capacity = CapacityPreference::SpotOnly;
        ranked = None;
    }
    let ranked = match (n > 0, ranked) {
        (true, None) => memo.top(obs.offerings, &req, oc, obs.unavailable, now, k),
        (_, r) => r.unwrap_or_default(),
    };
    let reason = Reason::WarmPool {
        target: launch_target,
        ready: idle + pending,
    };
    // The budget cap holds for the warm pool too, starts included (booked at the launch's price).
    let price = choice::spread_max_price(&ranked, oc);
    if let (Some(cap), true) = (cfg.limits.max_usd_per_h, n > 0 && price > 0.0) {
        let fit = ((cap - fleet.spend) / price).floor().max(0.0) as u32;
        if fit < n {
            plan.held.push(Held {
                lane,
                count: n - fit,
                reason: Reason::BudgetBreaker {
                    spend_usd_per_h: fleet.spend,
                    cap_usd_per_h: cap,
                },
            });
            n = fit;
        }
    }
    if n > 0 && !fleet.stopped.of(lane).is_empty() {
        // Stopped workers first: no dearer per job than the launch they stand for.
        let table = memo.table(obs.offerings, oc);
        let starts = StartFor {
            lane,
            req: &req,
            project: None,
            job: None,
            reason: &reason,
            max_price_usd_per_h: cfg.limits.max_usd_per_h.map(|_| price),
            whole: false,
        };
        let max_cost = ranked.first().map_or(f64::INFINITY, |r| r.1);
        let started = push_starts(
            plan,
            fleet.stopped.of(lane),
            obs,
            table,
            &fleet.blocked,
            now,
            &starts,
            n,
            max_cost,
            cfg,
        );
        if started > 0 {
            fleet.book(lane, started, price * started as f64);
            n -= started;
        }
    }
    if n > 0 && ranked.is_empty() {
        plan.held.push(Held {
            lane,
            count: n,
            reason: Reason::NoOffering {
                gpus,
                min_gpu_memory_gib: req.min_mem_gib,
            },
        });
        n = 0;
    }
    if n > 0 {
        push_launches_booked(plan, lane, &ranked, &req, n, None, None, reason, None, oc);
        fleet.book(lane, n, price * n as f64);
    }
    ws
}

#[cfg(test)]
mod tests {
    use super::burst_ahead;

    #[test]
    fn a_burst_is_launched_ahead_for_only_by_its_excess_over_the_look_back() {
        // (demand per window, the current one first; factor; least demand; workers launched ahead)
        let rows: &[(&[u32], f64, u32, u32)] = &[
            (&[30, 0, 10, 2], 1.0, 1, 20),  // 20 more than any window before
            (&[30, 0, 10, 2], 2.0, 1, 40),  // twice the excess
            (&[30, 0, 10, 2], 0.5, 1, 10),  // half of it
            (&[30, 0, 10, 2], 0.0, 1, 0),   // off
            (&[10, 0, 10, 2], 1.0, 1, 0),   // the look-back saw as much: the fractile's to price
            (&[3, 40, 10, 2], 1.0, 1, 0),   // a burst on its way out
            (&[7], 1.0, 1, 7),              // nothing before it
            (&[7, 6], 0.75, 1, 0),          // an excess of 1 at 0.75: none
            (&[], 1.0, 1, 0),               // no arrivals
            (&[30, 0, 10, 2], 1.0, 30, 20), // the window needs as many as the least: a burst
            (&[30, 0, 10, 2], 1.0, 31, 0),  // one fewer than the least: no burst to bet on
            (&[1, 0, 0, 0], 3.0, 12, 0),    // a lone arrival of a rare shape
            (&[1, 0, 0, 0], 3.0, 0, 3),     // ... which 0 (like 1) launches ahead of
        ];
        for &(demand, factor, min, want) in rows {
            assert_eq!(
                burst_ahead(demand, factor, min),
                want,
                "{demand:?} x {factor}, least {min}"
            );
        }
    }
}
