//! Phase 5: release idle workers past their keep-alive, cancel booting workers nothing needs.

use std::sync::Arc;

use crate::choice::RankMemo;
use crate::config::{KeepAliveMode, PolicyConfig};
use crate::keepalive;
use crate::observation::{LaneId, Observation, WorkerState, WorkerView};
use crate::offering::CapacityType;
use crate::plan::{Action, Plan, Reason};

use super::fleet::{Fleet, Stopped};
use super::warm::Warm;
use super::FreeClass;

/// A free class's key: GPUs, memory bits, spot, and an on-demand worker's (price, spot price)
/// bits ([`FreeClass`]).
type ClassKey = (u32, u64, bool, Option<(u64, u64)>);

/// Drop, per class, the idle workers that matching consumed (the first ones of each class in
/// `idle`, which is sorted most recently idle first); `after` is the free capacity left.
pub(crate) fn skip_consumed<'a>(
    idle: &[&'a WorkerView],
    after: &[FreeClass],
    consumed_total: u32,
) -> Vec<&'a WorkerView> {
    if consumed_total == 0 {
        return idle.to_vec();
    }
    // Per class (GPUs, memory bits, spot), the idle workers to skip; a fleet has few classes,
    // so a list beats hashing (this runs on every decision).
    let class = |w: &WorkerView| {
        (
            w.gpus,
            w.gpu_memory_gib.to_bits(),
            w.offering.capacity_type == CapacityType::Spot,
            super::fleet::on_demand_of_spot(w).map(|(p, s)| (p.to_bits(), s.to_bits())),
        )
    };
    let mut to_skip: Vec<(ClassKey, u32)> = Vec::new();
    for w in idle {
        let k = class(w);
        match to_skip.iter_mut().find(|e| e.0 == k) {
            Some(e) => e.1 += 1,
            None => to_skip.push((k, 1)),
        }
    }
    for (k, n) in &mut to_skip {
        let left = after
            .iter()
            .find(|c| {
                c.gpus == k.0
                    && c.mem.to_bits() == k.1
                    && c.spot == k.2
                    && c.on_demand_of_spot.map(|(p, s)| (p.to_bits(), s.to_bits())) == k.3
            })
            .map_or(0, |c| c.idle);
        *n = n.saturating_sub(left);
    }
    idle.iter()
        .filter(|w| {
            let k = class(w);
            match to_skip.iter_mut().find(|e| e.0 == k) {
                Some((_, n)) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            }
        })
        .copied()
        .collect()
}

/// Most arrivals a worker can wait for in the keep-alive's model: past this it is not needed
/// within any keep-alive (its scaled gaps all exceed `max_keep_alive_s`).
const ARRIVALS_CAP: f64 = 1e6;

/// What a line's keep-alives read, built at first need: the gap curve of the shapes its workers
/// serve (if trusted), the mean worker units of an arrival, and when the lane's running workers of
/// its size end their jobs (seconds from now, any order).
type LineFacts<'h> = (Option<Arc<keepalive::GapCurve>>, f64, Ends<'h>);

/// The expected job ends of a line's running workers, which the keep-alive counts
/// ([`keepalive::arrivals_until_needed_after_ends`]).
enum Ends<'h> {
    /// Seconds from now, in any order, from a pass over the workers ([`running_ends_from`]).
    Scanned(Vec<f64>),
    /// Unix seconds, ascending, none before now: from the caller's [`crate::FleetHint`].
    Sorted(&'h [f64]),
}

/// The running workers of `lane` with `gpus` GPUs whose job is expected to end at or after `now`,
/// seconds from `now`, in the workers' order (a job past its declared run time ends at an unknown
/// time: not counted).
fn running_ends_from(obs: &Observation<'_>, lane: LaneId, gpus: u32, now: f64) -> Vec<f64> {
    // Sized for every worker: growing it cost more than the pass.
    let mut ends = Vec::with_capacity(obs.workers.len());
    ends.extend(
        obs.workers
            .iter()
            .filter(|r| r.lane == lane && r.gpus == gpus && r.state == WorkerState::Running)
            .filter_map(|r| r.busy_until)
            .filter(|t| *t >= now)
            .map(|t| t - now),
    );
    ends
}

/// The gap curve of the job shape a worker of `gpus` GPUs in `lane` serves
/// ([`crate::observation::LaneObservation::gaps_for`]), if its gaps are trusted, and the mean
/// worker units of an arrival of it (1 without statistics). Kept in `memo` while the shape's
/// statistics are what they were ([`crate::observation::ShapeGaps::stamp`]): building the curve
/// and the units was 2.6 % of a full Philly replay's instructions (`callgrind`), and most
/// decisions (the minute's) see no new arrival. Debug builds check a kept curve against a new one.
fn shape_facts(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    lane: LaneId,
    gpus: u32,
    memo: &mut RankMemo,
) -> (Option<Arc<keepalive::GapCurve>>, f64) {
    let oc = &cfg.offers;
    let Some(shape) = obs.lanes.get(lane).and_then(|o| o.gaps_for(gpus, oc.max_gpu_oversize)) else {
        return (None, 1.0);
    };
    let units_of = || shape.mean_worker_units(oc.short_job_horizon_s, oc.default_runtime_s);
    let stamp = (
        shape.stamp(),
        oc.short_job_horizon_s.to_bits(),
        oc.default_runtime_s.to_bits(),
    );
    let (curve, units) = crate::choice::kept(
        &mut memo.shape_facts,
        (lane, gpus),
        |kept| *kept == stamp,
        |kept| {
            *kept = stamp;
            (Arc::new(keepalive::GapCurve::new(&shape.hist)), units_of())
        },
    );
    debug_assert!(
        **curve == keepalive::GapCurve::new(&shape.hist) && *units == units_of(),
        "kept keep-alive facts differ from the statistics' own"
    );
    let trusted = keepalive::trusted(&shape.hist, &cfg.scale_down);
    (trusted.then(|| curve.clone()), *units)
}

/// The idle workers of one GPU count, in line for the keep-alive (the most recently idle first).
struct Line<'h> {
    gpus: u32,
    /// Workers seen so far: the next one's rank.
    len: u32,
    /// Boxed: a curve is 1.5 kB, and a line is moved about on every decision.
    curve: Option<Box<LineFacts<'h>>>,
    /// The keep-alive a worker ahead in line was released at: the workers behind it (idle
    /// longer, needed only after it) go at that keep-alive too, so a line never keeps its back
    /// while releasing its front.
    cut: Option<f64>,
}

/// The stopped workers of one GPU count in a lane, in line for the stopped keep-alive: the new
/// ones join the back of the line.
struct StopLine {
    gpus: u32,
    /// Workers in line: stopped already (scale-up did not start them), and stopped by this plan.
    len: u32,
    /// The gaps' curve of the shapes they serve, if trusted.
    curve: Option<Arc<keepalive::GapCurve>>,
    /// Mean worker units an arrival of those shapes brings.
    units: f64,
}

/// Release idle worker `w` of `lane` for `reason`: stopped when `scale_down.stop_idle` covers it
/// and a start saves anything over a cold start ([`keepalive::stops`]), kept stopped for its
/// place at the back of its size's line of stopped workers (`lines`, built as needed from
/// `stopped`, the lane's stopped workers; [`keepalive::stopped_keep_s`]); else terminated.
#[allow(clippy::too_many_arguments)]
fn release(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    lane: LaneId,
    stopped: &mut Stopped<'_>,
    lines: &mut smallvec::SmallVec<[StopLine; 4]>,
    w: &WorkerView,
    reason: Reason,
    memo: &mut RankMemo,
) -> Action {
    let worker = w.id.clone();
    if !keepalive::stops(w.offering.capacity_type, w.price_usd_per_h, cfg) {
        return Action::Terminate { worker, reason };
    }
    let li = match lines.iter().position(|l| l.gpus == w.gpus) {
        Some(i) => i,
        None => {
            let (curve, units) = shape_facts(obs, cfg, lane, w.gpus, memo);
            lines.push(StopLine {
                gpus: w.gpus,
                len: stopped.of(lane).iter().filter(|s| s.gpus == w.gpus).count() as u32,
                curve,
                units,
            });
            lines.len() - 1
        }
    };
    let line = &mut lines[li];
    let until_needed = keepalive::arrivals_until_needed(line.len, line.units);
    line.len += 1;
    let keep_s = keepalive::stopped_keep_s(line.curve.as_deref(), until_needed, w.price_usd_per_h, cfg);
    Action::Stop {
        worker,
        keep_s,
        launched_at: w.launched_at,
        reason,
    }
}

/// Terminate `lane`'s stopped workers (those scale-up did not start) once their stopped keep-alive
/// is over: `stopped_until`, set when they were stopped ([`release`]); for a stopped worker
/// without one, the break-even from its stop ([`keepalive::stopped_keep_s`] without gaps).
fn release_stopped(cfg: &PolicyConfig, now: f64, stopped: &[&WorkerView], plan: &mut Plan) {
    // Stopped since its stop (a failed start leaves it stopped since that start's time).
    let since = |w: &WorkerView| w.idle_since.unwrap_or(w.launched_at);
    let mut expired: smallvec::SmallVec<[(&WorkerView, f64); 4]> = stopped
        .iter()
        .filter_map(|&w| {
            let until = w
                .stopped_until
                .unwrap_or_else(|| since(w) + keepalive::stopped_keep_s(None, 1.0, w.price_usd_per_h, cfg));
            (now >= until).then_some((w, until))
        })
        .collect();
    // In the order of their ids: the plan never depends on the order the workers came in.
    expired.sort_unstable_by(|a, b| a.0.id.cmp(&b.0.id));
    for (w, until) in expired {
        plan.actions.push(Action::Terminate {
            worker: w.id.clone(),
            reason: Reason::StoppedKeepAliveExpired {
                stopped_s: now - since(w),
                keep_s: until - since(w),
            },
        });
    }
}

/// Per lane, the jobs the worker caps hold back and the cap that held them last
/// (`Reason::MaxWorkers` in `plan.held` after scale-up; the warm phase's wants held at a cap come
/// later and are not jobs).
pub(crate) fn held_at_cap(plan: &Plan, lanes: usize) -> smallvec::SmallVec<[(u32, u32); 4]> {
    let mut capped: smallvec::SmallVec<[(u32, u32); 4]> = smallvec::smallvec![(0, 0); lanes];
    for h in &plan.held {
        if let (Reason::MaxWorkers { limit }, Some(c)) = (&h.reason, capped.get_mut(h.lane)) {
            *c = (c.0 + h.count, *limit);
        }
    }
    capped
}

/// The jobs, over all lanes, that only the fleet's cap (`limits.max_workers_total`) holds back
/// after scale-up: per lane with jobs held at a cap ([`held_at_cap`]), as many as its own cap
/// would still let launch beyond the fleet's room. A worker of any lane released makes room for
/// them; a lane at its own cap gains nothing from another lane's release.
pub(crate) fn held_at_fleet_cap(cfg: &PolicyConfig, fleet: &Fleet<'_>, capped: &[(u32, u32)]) -> u32 {
    let total_room = cfg.limits.max_workers_total.saturating_sub(fleet.live_total);
    capped
        .iter()
        .zip(&cfg.lanes)
        .zip(&fleet.lane_live)
        .map(|((&(held, _), lc), &live)| {
            let lane_room = lc.max_workers.saturating_sub(live);
            if lane_room > total_room {
                held.min(lane_room - total_room)
            } else {
                0
            }
        })
        .sum()
}

/// Live workers `actions` release (idle ones stopped or terminated, booting ones cancelled), each
/// a place under the worker caps; a stopped worker's termination frees none.
pub(crate) fn released_live(actions: &[Action]) -> u32 {
    actions
        .iter()
        .filter(|a| match a {
            Action::Terminate { reason, .. } => !matches!(reason, Reason::StoppedKeepAliveExpired { .. }),
            Action::Stop { .. } | Action::CancelLaunch { .. } => true,
            Action::Launch { .. } | Action::Start { .. } => false,
        })
        .count() as u32
}

/// Release idle workers of any lane for the jobs of other lanes only the fleet's cap holds
/// (`held_jobs`, [`held_at_fleet_cap`]): the places the lanes' scale-down already freed
/// (`freed`, [`released_live`]) go to them first, then up to the rest of `kept` (the idle
/// workers nobody matched that scale-down kept, past `anti_thrash.min_runtime_s`, any lane)
/// go, the longest idle first, whatever their keep-alive or warm-pool place, as within a lane
/// ([`make_room`]). A stopped worker's stopped keep-alive is priced as the first of its line
/// (the lines of this decision's other stops are not carried over: a longer keep at most).
#[allow(clippy::too_many_arguments)]
pub(crate) fn make_room_for_lanes(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    held_jobs: u32,
    freed: u32,
    mut kept: Vec<&WorkerView>,
    stopped: &mut Stopped<'_>,
    plan: &mut Plan,
    memo: &mut RankMemo,
) {
    let left = held_jobs.saturating_sub(freed) as usize;
    if left == 0 {
        return;
    }
    kept.sort_by(|a, b| {
        a.idle_since
            .unwrap_or(f64::INFINITY)
            .total_cmp(&b.idle_since.unwrap_or(f64::INFINITY))
            .then(a.seq.cmp(&b.seq))
    });
    let mut lines: Vec<(LaneId, smallvec::SmallVec<[StopLine; 4]>)> = Vec::new();
    for w in kept.into_iter().take(left) {
        let li = match lines.iter().position(|(l, _)| *l == w.lane) {
            Some(i) => i,
            None => {
                lines.push((w.lane, smallvec::SmallVec::new()));
                lines.len() - 1
            }
        };
        let reason = Reason::MakeRoomForLanes {
            held_jobs,
            limit: cfg.limits.max_workers_total,
        };
        plan.actions.push(release(
            obs,
            cfg,
            w.lane,
            &mut *stopped,
            &mut lines[li].1,
            w,
            reason,
            memo,
        ));
    }
}

/// Release idle workers of `lane` that hold the room its capped jobs wait for: while the lane's
/// or the fleet's worker cap holds `held` of the lane's jobs back (`limit`, [`held_at_cap`]), up
/// to `held` of `idle` (the lane's idle workers nobody matched: none of its queued jobs fits them,
/// `max_gpu_oversize`) go whatever their keep-alive, the longest idle first and only past
/// `anti_thrash.min_runtime_s`, so the next decision launches for the held jobs. A keep-alive
/// would save a later job of the worker's size a cold start; the jobs held now would wait the
/// whole of it, at the idle worker's price. Returns the workers left for the keep-alive, in
/// `idle`'s order (most recently idle first).
#[allow(clippy::too_many_arguments)]
fn make_room<'a>(
    obs: &Observation<'_>,
    cfg: &PolicyConfig,
    now: f64,
    lane: LaneId,
    (held, limit): (u32, u32),
    mut idle: Vec<&'a WorkerView>,
    stopped: &mut Stopped<'_>,
    lines: &mut smallvec::SmallVec<[StopLine; 4]>,
    plan: &mut Plan,
    memo: &mut RankMemo,
) -> Vec<&'a WorkerView> {
    let mut left = held;
    let mut i = idle.len();
    while i > 0 && left > 0 {
        i -= 1;
        let w = idle[i];
        if now - w.launched_at < cfg.anti_thrash.min_runtime_s {
            continue;
        }
        let reason = Reason::MakeRoom { held_jobs: held, limit };
        plan.actions
            .push(release(obs, cfg, lane, &mut *stopped, lines, w, reason, memo));
        idle.remove(i);
        left -= 1;
    }
    idle
}

/// Release `lane`'s idle workers nobody matched once their keep-alive ran out (the most recently
/// idle ones of the warm shape form the warm pool and stay; the keep-alive of the others depends
/// on their place in line, see [`keepalive::keep_alive_s`]); over the budget cap, every idle
/// worker past the minimum run time goes. A released worker is stopped or terminated
/// ([`release`]); stopped workers past their stopped keep-alive are terminated
/// ([`release_stopped`]). Nothing is released within the delay after a scale-up
/// or while the backlog is over `scale_down_max_backlog`. Booting workers are cancelled only when
/// the lane has no queued job at all (`queue_empty`), the warm pool's share excepted. First,
/// while the caps hold jobs of the lane (`capped`, [`held_at_cap`]), idle workers none of them
/// fits make room ([`make_room`]). With `kept`, the idle workers nobody matched that stay, past
/// `anti_thrash.min_runtime_s`, are added to it (for [`make_room_for_lanes`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn scale_down<'a>(
    obs: &Observation<'a>,
    cfg: &PolicyConfig,
    now: f64,
    lane: LaneId,
    warm: &Warm,
    queue_empty: bool,
    capped: (u32, u32),
    kept: Option<&mut Vec<&'a WorkerView>>,
    fleet: &mut Fleet<'a>,
    plan: &mut Plan,
    memo: &mut RankMemo,
) {
    let past_min_runtime = |w: &WorkerView| now - w.launched_at >= cfg.anti_thrash.min_runtime_s;
    let oc = &cfg.offers;
    let running_ends = fleet.running_ends;
    let lane_obs = obs.lanes.get(lane);
    let free_idle: u32 = fleet.free[lane].iter().map(|c| c.idle).sum();
    let free_pending: u32 = fleet.free[lane].iter().map(|c| c.pending).sum();
    // Idle workers nobody matched: the matched ones are the most recently idle of their class.
    let (idle_before, _) = fleet.free_before[lane];
    let consumed_idle = idle_before - free_idle;
    let idle = &mut fleet.idle[lane];
    // Unstable: (idle_since, seq) orders workers totally, and it needs no buffer.
    idle.sort_unstable_by(|a, b| {
        b.idle_since
            .unwrap_or(now)
            .total_cmp(&a.idle_since.unwrap_or(now))
            .then(b.seq.cmp(&a.seq))
    });
    let idle_free = skip_consumed(idle, &fleet.free[lane], consumed_idle);
    let stopped = &mut fleet.stopped;
    if now >= stopped.due {
        release_stopped(cfg, now, stopped.of(lane), plan);
    }
    let mut stop_lines: smallvec::SmallVec<[StopLine; 4]> = smallvec::SmallVec::new();

    if let Some(cap) = fleet.breaker {
        for w in idle_free
            .iter()
            .filter(|w| now - w.launched_at >= cfg.anti_thrash.min_runtime_s)
        {
            let reason = Reason::BudgetBreaker {
                spend_usd_per_h: fleet.spend,
                cap_usd_per_h: cap,
            };
            plan.actions
                .push(release(obs, cfg, lane, &mut *stopped, &mut stop_lines, w, reason, memo));
        }
        return;
    }
    let idle_free = make_room(
        obs,
        cfg,
        now,
        lane,
        capped,
        idle_free,
        &mut *stopped,
        &mut stop_lines,
        plan,
        memo,
    );
    let backlog = lane_obs.map(|o| o.backlog.total(cfg.limits.count_delayed)).unwrap_or(0);
    if now - fleet.last_launch[lane] < cfg.anti_thrash.scale_down_delay_after_scale_up_s
        || backlog > cfg.anti_thrash.scale_down_max_backlog
    {
        if let Some(kept) = kept {
            kept.extend(idle_free.iter().copied().filter(|w| past_min_runtime(w)));
        }
        return;
    }
    let loop_start = plan.actions.len();
    // The most recently idle workers form the warm pool; the others are in line behind them,
    // per GPU count, for the keep-alive.
    let mut held: smallvec::SmallVec<[u32; 8]> = smallvec::smallvec![0u32; warm.shapes.len()];
    let mut lines: smallvec::SmallVec<[Line; 4]> = smallvec::SmallVec::new();
    for w in &idle_free {
        let li = match lines.iter().position(|l| l.gpus == w.gpus) {
            Some(i) => i,
            None => {
                lines.push(Line {
                    gpus: w.gpus,
                    len: 0,
                    curve: None,
                    cut: None,
                });
                lines.len() - 1
            }
        };
        let line = &mut lines[li];
        let rank = line.len;
        line.len += 1;
        if let Some(i) = warm.slot(cfg, w.gpus, w.gpu_memory_gib, &held) {
            held[i] += 1;
            continue;
        }
        if now - w.launched_at < cfg.anti_thrash.min_runtime_s {
            continue;
        }
        let idle_s = now - w.idle_since.unwrap_or(now);
        if idle_s < cfg.scale_down.min_keep_alive_s.min(cfg.scale_down.warm_for_s)
            && cfg.scale_down.mode != KeepAliveMode::Fixed
        {
            continue; // no keep-alive is shorter
        }
        let keep_alive = match line.cut {
            // Behind a worker released at `cut` and idle as long: it goes too, whatever its own
            // keep-alive (not computed: this loop runs over every idle worker on every decision).
            Some(cut) if idle_s >= cut => cut,
            cut => {
                let gpus = line.gpus;
                let (curve, units, ends) = &**line.curve.get_or_insert_with(|| {
                    let (curve, units) = shape_facts(obs, cfg, lane, w.gpus, memo);
                    // Only the adaptive keep-alive reads them.
                    let adaptive = cfg.scale_down.mode == KeepAliveMode::Adaptive;
                    let ends = match (curve.is_some() && adaptive, running_ends) {
                        (false, _) => Ends::Scanned(Vec::new()),
                        (true, Some(hinted)) => {
                            let at = hinted
                                .iter()
                                .find(|(k, _)| *k == (lane, gpus))
                                .map_or(&[][..], |(_, e)| e.as_slice());
                            // A job past its declared run time ends at an unknown time: not counted.
                            let at = &at[at.partition_point(|t| *t < now)..];
                            #[cfg(debug_assertions)]
                            {
                                let mut scanned = running_ends_from(obs, lane, gpus, now);
                                scanned.sort_unstable_by(f64::total_cmp);
                                let hinted: Vec<f64> = at.iter().map(|t| t - now).collect();
                                assert_eq!(
                                    hinted, scanned,
                                    "the FleetHint's running ends disagree with the workers at {now}"
                                );
                            }
                            Ends::Sorted(at)
                        }
                        (true, None) => Ends::Scanned(running_ends_from(obs, lane, gpus, now)),
                    };
                    Box::new((curve, units, ends))
                });
                let until_needed = match (curve, ends) {
                    (Some(c), Ends::Scanned(ends)) => {
                        keepalive::arrivals_until_needed_after_ends(rank, *units, c.mean_s(), ends, ARRIVALS_CAP)
                    }
                    (Some(c), Ends::Sorted(at)) => keepalive::arrivals_until_needed_after_sorted_ends(
                        rank,
                        *units,
                        c.mean_s(),
                        now,
                        at,
                        ARRIVALS_CAP,
                    ),
                    (None, _) => keepalive::arrivals_until_needed(rank, *units),
                };
                // Released, a worker that is stopped comes back in a start, not a cold start: its
                // keep-alive is priced against that (the multislope ski rental's first slope).
                let release_boot = if keepalive::stops(w.offering.capacity_type, w.price_usd_per_h, cfg) {
                    oc.restart_estimate_s
                } else {
                    oc.boot_estimate_s
                };
                let own = keepalive::keep_alive_with_curve_s(
                    curve.as_deref(),
                    until_needed,
                    release_boot,
                    w.price_usd_per_h,
                    &cfg.scale_down,
                );
                cut.map_or(own, |cut| own.min(cut))
            }
        };
        if cfg.scale_down.mode == KeepAliveMode::Adaptive && idle_s >= keep_alive {
            line.cut.get_or_insert(keep_alive);
        }
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
            plan.actions
                .push(release(obs, cfg, lane, &mut *stopped, &mut stop_lines, w, reason, memo));
        }
    }
    if let Some(kept) = kept {
        let gone: Vec<&str> = plan.actions[loop_start..]
            .iter()
            .filter_map(|a| match a {
                Action::Terminate { worker, .. } | Action::Stop { worker, .. } => Some(worker.as_str()),
                _ => None,
            })
            .collect();
        kept.extend(
            idle_free
                .iter()
                .copied()
                .filter(|w| past_min_runtime(w) && !gone.contains(&w.id.as_str())),
        );
    }
    // Booting workers nothing needs: only when the lane has no queued job at all.
    if queue_empty && free_pending > 0 {
        // Each shape's pool takes its idle workers first, then booting ones.
        let mut held: Vec<u32> = warm.shapes.iter().map(|s| s.idle.min(s.target)).collect();
        let pending = &mut fleet.pending[lane];
        // Keep the ones launched first (closest to ready).
        pending.sort_by(|a, b| a.launched_at.total_cmp(&b.launched_at).then(a.seq.cmp(&b.seq)));
        for w in pending.iter() {
            if let Some(i) = warm.slot(cfg, w.gpus, w.gpu_memory_gib, &held) {
                held[i] += 1;
                continue;
            }
            plan.actions.push(Action::CancelLaunch {
                worker: w.id.clone(),
                reason: Reason::PendingNotNeeded,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::shape_facts;
    use crate::choice::RankMemo;
    use crate::config::PolicyConfig;
    use crate::keepalive::GapCurve;
    use crate::observation::{LaneObservation, Observation};

    fn observe(lanes: &[LaneObservation]) -> Observation<'_> {
        Observation {
            lanes,
            jobs: &[],
            workers: &[],
            offerings: &[],
            unavailable: &[],
            fleet: None,
        }
    }

    #[test]
    fn the_keep_alive_facts_are_kept_while_the_shape_sees_no_arrival_and_rebuilt_after_one() {
        let cfg = PolicyConfig::default();
        let mut lane = LaneObservation::default();
        // Enough 1-GPU gaps to be trusted, a minute apart, each job an hour long.
        let n = cfg.scale_down.min_gap_samples + 1;
        for i in 0..=n {
            lane.record_arrival_with_runtime(1, 1_000.0 + 60.0 * i as f64, Some(3600.0));
        }
        let mut memo = RankMemo::default();
        let lanes = [lane];
        let (first, units) = shape_facts(&observe(&lanes), &cfg, 0, 1, &mut memo);
        let first = first.expect("trusted gaps");
        assert_eq!(*first, GapCurve::new(&lanes[0].gaps[&1].hist));
        assert_eq!(units, 1.0, "hour-long jobs: a worker each");
        // No arrival since: the same curve, not a new one.
        let (again, _) = shape_facts(&observe(&lanes), &cfg, 0, 1, &mut memo);
        assert!(Arc::ptr_eq(&first, &again.expect("trusted")));
        assert_eq!(memo.shape_facts.len(), 1);
        // An arrival of the shape (a 30 s gap, 5-second job): rebuilt, as the statistics say.
        let [mut lane] = lanes;
        lane.record_arrival_with_runtime(1, 1_000.0 + 60.0 * n as f64 + 30.0, Some(5.0));
        let lanes = [lane];
        let (after, units) = shape_facts(&observe(&lanes), &cfg, 0, 1, &mut memo);
        let after = after.expect("trusted");
        assert!(!Arc::ptr_eq(&first, &after));
        assert_eq!(*after, GapCurve::new(&lanes[0].gaps[&1].hist));
        assert_ne!(*after, *first);
        assert!(units < 1.0, "a short job shares a worker: {units}");
        assert_eq!(memo.shape_facts.len(), 1, "the entry replaced");
        // Another lane's shape of the same size has an entry of its own; a lane without
        // statistics has no curve and a worker per arrival.
        let lanes = [LaneObservation::default(), lanes.into_iter().next().unwrap()];
        let (other, units) = shape_facts(&observe(&lanes), &cfg, 1, 1, &mut memo);
        assert!(other.is_some() && units < 1.0);
        assert_eq!(shape_facts(&observe(&lanes), &cfg, 0, 1, &mut memo), (None, 1.0));
        assert_eq!(memo.shape_facts.len(), 2);
    }
}
