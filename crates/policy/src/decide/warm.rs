//! Phase 4: ready workers held for arrivals not yet here: the scheduled warm pool, and the
//! predictive one.

use crate::choice::{self, Request};
use crate::config::PolicyConfig;
use crate::observation::{LaneId, Observation};
use crate::plan::{Held, Plan, Reason};
use crate::shape::fits;

use super::fleet::Fleet;
use super::scale_up::push_launches_booked;

/// What phase 4 decided for a lane, for phase 5.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Warm {
    /// Ready workers of the warm shape to hold.
    pub(crate) target: u32,
    /// GPUs of the warm shape (`lanes.warm_pool_gpus`).
    pub(crate) gpus: u32,
    /// Idle workers of the warm shape left after matching.
    pub(crate) idle: u32,
}

impl Warm {
    /// Whether a worker of `gpus` GPUs of `mem` GiB each is of the warm shape.
    pub(crate) fn is_warm_shape(&self, cfg: &PolicyConfig, gpus: u32, mem: f64) -> bool {
        fits(
            gpus,
            mem,
            self.gpus,
            cfg.offers.min_gpu_memory_gib,
            cfg.offers.max_gpu_oversize,
        )
    }
}

/// The predictive warm pool of `lane` now: the biggest recent burst of arrivals of the warm
/// shape, at most `predictive_max`, once bursts recur (a single burst is served by the
/// keep-alive alone); 0 without an observation.
pub(crate) fn predicted(obs: &Observation<'_>, cfg: &PolicyConfig, lane: LaneId, now: f64) -> u32 {
    let lc = &cfg.lanes[lane];
    let oc = &cfg.offers;
    match (lc.predictive_max, obs.lanes.get(lane)) {
        (0, _) | (_, None) => 0,
        (max, Some(o)) => {
            let fits_warm = |g| fits(lc.warm_pool_gpus, f64::INFINITY, g, 0.0, oc.max_gpu_oversize);
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
    }
}

/// Top up `lane`'s ready workers of the warm shape to the target (the scheduled size for this
/// hour, or the predictive pool, whichever is larger), within the lane's and the fleet's caps and
/// the budget; nothing while frozen or over the budget cap.
pub(crate) fn warm_capacity(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    now: f64,
    lane: LaneId,
    fleet: &mut Fleet<'_>,
    plan: &mut Plan,
) -> Warm {
    let lc = &cfg.lanes[lane];
    let oc = &cfg.offers;
    let hour = (now.rem_euclid(86_400.0) / 3600.0) as u32;
    let target = lc.warm_pool_size_at(hour).max(predicted(obs, cfg, lane, now));
    let mut warm = Warm {
        target,
        gpus: lc.warm_pool_gpus,
        idle: 0,
    };
    let (warm_idle, warm_pending) = fleet.free[lane]
        .iter()
        .filter(|c| warm.is_warm_shape(cfg, c.gpus, c.mem))
        .fold((0, 0), |(i, p), c| (i + c.idle, p + c.pending));
    warm.idle = warm_idle;
    if target <= warm_idle + warm_pending || cfg.limits.frozen || fleet.breaker.is_some() {
        return warm;
    }
    let want = target - warm_idle - warm_pending;
    let (lane_room, total_room) = fleet.room(cfg, lane);
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
    if n > 0 {
        let reason = Reason::WarmPool {
            target,
            ready: warm_idle + warm_pending,
        };
        push_launches_booked(plan, lane, &ranked, &req, n, None, None, reason, oc);
        fleet.book(lane, n, price * n as f64);
    }
    warm
}
