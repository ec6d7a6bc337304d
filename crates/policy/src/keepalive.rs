//! Keep-alive (idle timeout) rules.
//!
//! Keep-alive is ski rental (Karlin et al. 1988): an idle worker costs r $/s, a cold start costs
//! B $. Releasing after T = B / r costs at most twice the offline optimum. Here r is the worker's
//! price and B the billed cold start (boot seconds x price) plus the value of the wait it adds
//! (boot seconds x `wait_value_usd_per_h`), so T = boot x (1 + wait value / price): cheap GPUs
//! are kept longer than expensive ones. Once the gap histogram of the job shapes the worker
//! serves holds enough gaps, the timeout is the one with the least expected cost under it
//! ([`cost_optimal_timeout_s`]), for the worker's place in line: the i-th idle worker is
//! needed only when i jobs arrive beyond the running workers that end their jobs meanwhile
//! ([`arrivals_until_needed_after_ends`]), so a pool shrinks to what the arrival rate keeps busy
//! while the worker a dense stream of items uses is kept. A worker needed only after n >= 2
//! arrivals goes at the minimum keep-alive once n mean gaps exceed the break-even.

use crate::config::{KeepAliveMode, ScaleDownConfig};
use crate::observation::{GapHistogram, GAP_BUCKETS};

/// Ski-rental break-even idle timeout, seconds, for a worker billed `price_usd_per_h`:
/// `boot_s x (1 + wait_value_usd_per_h / price)` (just `boot_s` for a free worker's price of 0
/// would be infinite, so a price of 0 is treated as 1e-9 $/h).
pub fn break_even_s(boot_s: f64, price_usd_per_h: f64, cfg: &ScaleDownConfig) -> f64 {
    boot_s * (1.0 + cfg.wait_value_usd_per_h / price_usd_per_h.max(1e-9))
}

/// Keep-alive in force now for a worker billed `price_usd_per_h`, seconds, for the configured mode
/// (for cooldown-with-decay: the time of the final release step).
///
/// `gaps`: the arrival-gap histogram of the job shapes the worker serves, if any;
/// `arrivals_until_needed` (>= 1): how many arrivals of those shapes it takes before this worker
/// gets one (1 for the idle worker next in line; see [`arrivals_until_needed`]). Adaptive mode:
/// with fewer than `min_gap_samples` gaps, the break-even [`break_even_s`]; with them,
/// [`cost_optimal_timeout_s`] over the gaps scaled by `arrivals_until_needed`, so a dense stream
/// of items keeps the worker that serves it and a pool shrinks to what the arrivals keep busy;
/// but `min_keep_alive_s` when `arrivals_until_needed >= 2` and that many mean gaps exceed the
/// break-even (the sum of n gaps is near n mean gaps: n x one gap overstates its spread, and
/// the chance it is short). Clamped to `[min_keep_alive_s, max_keep_alive_s]`.
pub fn keep_alive_s(
    gaps: Option<&GapHistogram>,
    arrivals_until_needed: f64,
    boot_s: f64,
    price_usd_per_h: f64,
    cfg: &ScaleDownConfig,
) -> f64 {
    let curve = gaps.filter(|g| trusted(g, cfg)).map(GapCurve::new);
    keep_alive_with_curve_s(curve.as_ref(), arrivals_until_needed, boot_s, price_usd_per_h, cfg)
}

/// Whether `gaps` holds enough gaps (`min_gap_samples`, at least 1) for the keep-alive to follow.
pub fn trusted(gaps: &GapHistogram, cfg: &ScaleDownConfig) -> bool {
    gaps.samples() >= cfg.min_gap_samples.max(1)
}

/// [`keep_alive_s`] with the gaps' [`GapCurve`] built already (`None`: no trusted gaps).
pub fn keep_alive_with_curve_s(
    curve: Option<&GapCurve>,
    arrivals_until_needed: f64,
    boot_s: f64,
    price_usd_per_h: f64,
    cfg: &ScaleDownConfig,
) -> f64 {
    match cfg.mode {
        KeepAliveMode::Fixed => cfg.fixed_idle_timeout_s,
        KeepAliveMode::CooldownDecay => cfg.release_rest_at_s,
        KeepAliveMode::Adaptive => {
            let be = break_even_s(boot_s, price_usd_per_h, cfg);
            let (lo, hi) = (cfg.min_keep_alive_s, cfg.max_keep_alive_s.max(cfg.min_keep_alive_s));
            match curve {
                // Needed only after n >= 2 arrivals: their sum is about n mean gaps (it varies far
                // less than n x one gap), so when that is past the break-even, holding the
                // worker until it is needed costs more than the cold start it saves.
                Some(c) if arrivals_until_needed >= 2.0 && arrivals_until_needed * c.mean_s() > be => lo,
                Some(c) => c.timeout_s(arrivals_until_needed.max(1.0), be, lo, hi),
                None => be.clamp(lo, hi),
            }
        }
    }
}

/// Whether an idle worker of capacity type `capacity`, billed `price_usd_per_h`, is stopped
/// rather than terminated when its keep-alive runs out: `scale_down.stop_idle` covers its
/// capacity type and a stop saves anything (a start is shorter than a cold start:
/// [`stopped_break_even_s`] is positive).
pub fn stops(capacity: crate::offering::CapacityType, price_usd_per_h: f64, cfg: &crate::PolicyConfig) -> bool {
    cfg.scale_down.stop_idle.covers(capacity) && stopped_break_even_s(price_usd_per_h, cfg) > 0.0
}

/// Stopped seconds a stopped worker billed `price_usd_per_h` (when running) is worth: the second
/// slope of the multislope ski rental (running, stopped, terminated; Lotker et al., FIELD.md).
/// Kept stopped, it costs its volume, `ScaleDownConfig::stopped_usd_per_h`; terminated, the next
/// arrival it would have served waits a cold start instead of a start, which costs
/// `(boot - restart) x (price + wait value) / 3600` $ more (the billed boot and the wait, with
/// `offers.boot_estimate_s` and `offers.restart_estimate_s`). The break-even is that difference
/// over the volume's rate: `(boot - restart) x (price + wait value) / stopped_usd_per_h()`
/// seconds (8.2 h for a 0.20 $/h GPU at the defaults). 0 when a start saves nothing; infinite
/// for a volume that costs nothing.
pub fn stopped_break_even_s(price_usd_per_h: f64, cfg: &crate::PolicyConfig) -> f64 {
    let saved_s = (cfg.offers.boot_estimate_s - cfg.offers.restart_estimate_s).max(0.0);
    let saved_usd_h = saved_s * (price_usd_per_h.max(0.0) + cfg.scale_down.wait_value_usd_per_h);
    if saved_usd_h <= 0.0 {
        0.0
    } else {
        saved_usd_h / cfg.scale_down.stopped_usd_per_h().max(0.0)
    }
}

/// How long a stopped worker billed `price_usd_per_h` (when running) is kept stopped, seconds,
/// before it is terminated: the second slope of the keep-alive's ski rental. The break-even is
/// [`stopped_break_even_s`] (the cold start a start saves, over the volume's rate). With trusted
/// gaps of the shapes the worker serves, for its place in line: it is needed after
/// `arrivals_until_needed` (n) arrivals the workers ahead of it do not take.
///
/// - The timeout with the least expected cost when the wait is n times a gap, as for an idle
///   worker ([`GapCurve::timeout_s`]).
/// - For n >= 2 at most the sum of n gaps' likely bound, `n x mean + 3 x sqrt(n) x sd` (the
///   central limit: the sum spreads far less than n times one gap, which kept a stopped worker
///   behind a stream of one-second items, n = 241, for 17 hours). At the minimum when
///   `n x mean` exceeds the break-even: it would cost more stopped than the cold start it saves.
/// - Without gaps: the break-even (2-competitive whatever the arrivals).
///
/// Clamped to `[min_keep_alive_s, max_stopped_s]`.
pub fn stopped_keep_s(
    curve: Option<&GapCurve>,
    arrivals_until_needed: f64,
    price_usd_per_h: f64,
    cfg: &crate::PolicyConfig,
) -> f64 {
    let sd = &cfg.scale_down;
    let be = stopped_break_even_s(price_usd_per_h, cfg);
    let (lo, hi) = (sd.min_keep_alive_s.min(sd.max_stopped_s), sd.max_stopped_s);
    let n = arrivals_until_needed.max(1.0);
    match curve {
        Some(c) if n >= 2.0 && n * c.mean_s() > be => lo,
        Some(c) => {
            // A volume that costs nothing has an infinite break-even: kept to the bound.
            let t = c.timeout_s(n, be.min(hi * 1e6), lo, hi);
            if n >= 2.0 {
                t.min((n * c.mean_s() + 3.0 * n.sqrt() * c.sd_s()).max(lo))
            } else {
                t
            }
        }
        None => be.clamp(lo, hi),
    }
}

/// Arrivals it takes before the idle worker with `rank` workers ahead of it in line (0 = the most
/// recently idle, which the next arrival takes) is needed, when an arrival brings `mean_units`
/// workers' worth of demand (1 for jobs longer than the short-job horizon, less for short ones
/// that share a worker, see [`crate::observation::worker_units`]): `1 + rank / mean_units`.
pub fn arrivals_until_needed(rank: u32, mean_units: f64) -> f64 {
    1.0 + f64::from(rank) / mean_units.max(1e-6)
}

/// [`arrivals_until_needed`] when running workers free up ahead of this one: a worker whose job
/// ends becomes the most recently idle, first in line, so it takes an arrival this worker would
/// otherwise have had. `ends_s`: seconds from now at which the running workers of the line's
/// size are expected to end their jobs (their `busy_until`), in any order; `mean_gap_s`: the mean
/// arrival gap, seconds. The fluid estimate: the smallest n with
/// `n >= 1 + (rank + freed(n x mean_gap_s)) / mean_units`, freed(t) being the workers ending
/// within t; at most `cap` (reached when workers free up as fast as arrivals come: the worker is
/// then not needed within any keep-alive). Without ends (no declared run times) this is
/// [`arrivals_until_needed`].
pub fn arrivals_until_needed_after_ends(rank: u32, mean_units: f64, mean_gap_s: f64, ends_s: &[f64], cap: f64) -> f64 {
    // A count per step, not a sort of the ends: this runs on most decisions, and sorting every
    // running worker's end cost more than the steps.
    arrivals_until_needed_freed(rank, mean_units, mean_gap_s, cap, |t| {
        ends_s.iter().filter(|e| **e <= t).count()
    })
}

/// [`arrivals_until_needed_after_ends`] with the ends given as absolute times `ends_at`, unix
/// seconds, ascending and none before `now`: each count is a binary search. Gives exactly what
/// [`arrivals_until_needed_after_ends`] gives for the ends `ends_at[i] - now`.
pub fn arrivals_until_needed_after_sorted_ends(
    rank: u32,
    mean_units: f64,
    mean_gap_s: f64,
    now: f64,
    ends_at: &[f64],
    cap: f64,
) -> f64 {
    debug_assert!(ends_at.is_sorted() && ends_at.first().is_none_or(|e| *e >= now));
    // `e - now` only grows with e (rounding keeps the order), so the ends within t are a prefix.
    arrivals_until_needed_freed(rank, mean_units, mean_gap_s, cap, |t| {
        ends_at.partition_point(|e| *e - now <= t)
    })
}

/// The fluid estimate of [`arrivals_until_needed_after_ends`], `freed(t)` counting the running
/// workers whose jobs end within t seconds.
fn arrivals_until_needed_freed(
    rank: u32,
    mean_units: f64,
    mean_gap_s: f64,
    cap: f64,
    freed: impl Fn(f64) -> usize,
) -> f64 {
    let u = mean_units.max(1e-6);
    let mut n = arrivals_until_needed(rank, u);
    // freed(t) only grows with t, so n only grows: each step frees at least one more worker,
    // and there are finitely many.
    loop {
        let t = n * mean_gap_s;
        let freed = freed(t);
        let next = 1.0 + (f64::from(rank) + freed as f64) / u;
        if next <= n {
            return n.min(cap);
        }
        if next >= cap {
            return cap;
        }
        n = next;
    }
}

/// The idle timeout T in `[min_s, max_s]` with the least expected cost when the idle gap is
/// `scale` x a gap drawn from `gaps` (uniform within a bucket). See [`GapCurve::timeout_s`].
pub fn cost_optimal_timeout_s(gaps: &GapHistogram, scale: f64, break_even_s: f64, min_s: f64, max_s: f64) -> f64 {
    GapCurve::new(gaps).timeout_s(scale, break_even_s, min_s, max_s)
}

/// A gap histogram's cumulative sums, built once per decision so that each idle worker's
/// cost-optimal timeout costs O(buckets) arithmetic (fixed-size arrays: no allocation).
#[derive(Debug, Clone, PartialEq)]
pub struct GapCurve {
    /// Upper edge of each bucket, seconds.
    edges: [f64; GAP_BUCKETS],
    /// Probability mass of each bucket.
    mass: [f64; GAP_BUCKETS],
    /// Mass of the buckets up to and including i.
    cum_mass: [f64; GAP_BUCKETS],
    /// Sum of mass x bucket midpoint up to and including i, seconds.
    cum_idle: [f64; GAP_BUCKETS],
}

impl GapCurve {
    /// The cumulative sums of `gaps` (unscaled).
    pub fn new(gaps: &GapHistogram) -> Self {
        let mut c = Self {
            edges: [0.0; GAP_BUCKETS],
            mass: [0.0; GAP_BUCKETS],
            cum_mass: [0.0; GAP_BUCKETS],
            cum_idle: [0.0; GAP_BUCKETS],
        };
        // Every bucket, even past the histogram's own (a shorter one has no mass there): the
        // edges ascend, which timeout_s's search relies on.
        let mut masses = gaps.masses();
        let (mut m, mut s) = (0.0, 0.0);
        for i in 0..GAP_BUCKETS {
            let p = masses.next().unwrap_or(0.0);
            c.edges[i] = GapHistogram::bucket_edge_s(i);
            let lo = if i == 0 { 0.0 } else { c.edges[i - 1] };
            m += p;
            s += p * (lo + c.edges[i]) / 2.0;
            c.mass[i] = p;
            c.cum_mass[i] = m;
            c.cum_idle[i] = s;
        }
        c
    }

    /// Mean gap, seconds (bucket midpoints).
    pub fn mean_s(&self) -> f64 {
        self.cum_idle[GAP_BUCKETS - 1]
    }

    /// Standard deviation of the gaps, seconds (each bucket's mass uniform over it). O(buckets).
    pub fn sd_s(&self) -> f64 {
        let mut second = 0.0;
        for i in 0..GAP_BUCKETS {
            let (lo, hi) = (if i == 0 { 0.0 } else { self.edges[i - 1] }, self.edges[i]);
            second += self.mass[i] * (lo * lo + lo * hi + hi * hi) / 3.0;
        }
        let mean = self.mean_s();
        (second - mean * mean).max(0.0).sqrt()
    }

    /// Expected cost, idle-seconds, of timeout `t` for gaps scaled by `scale`: the buckets wholly
    /// below `t` idle their gap, the rest idle `t` and then pay `be`, the bucket `t` falls in is
    /// split uniformly.
    fn cost_at(&self, t: f64, scale: f64, be: f64) -> f64 {
        let u = t / scale;
        let i = self.edges.partition_point(|e| *e < u).min(self.edges.len() - 1);
        let (below_mass, below_idle) = if i == 0 {
            (0.0, 0.0)
        } else {
            (self.cum_mass[i - 1], self.cum_idle[i - 1])
        };
        let lo = if i == 0 { 0.0 } else { self.edges[i - 1] };
        let hi = self.edges[i];
        let frac = ((u - lo) / (hi - lo)).clamp(0.0, 1.0);
        let p = self.mass[i];
        let straddle_idle = p * (frac * (lo + u.min(hi)) / 2.0 + (1.0 - frac) * u) * scale;
        let over = (1.0 - below_mass - p * frac).max(0.0);
        let above = over - p * (1.0 - frac);
        scale * below_idle + straddle_idle + above.max(0.0) * t + over * be
    }

    /// The idle timeout T in `[min_s, max_s]` with the least expected cost when the idle gap is
    /// `scale` x a gap of this curve, for a cold start worth `break_even_s` idle seconds.
    ///
    /// Cost of an idle period in idle-seconds: `E[min(G, T)] + break_even_s x P(G > T)`: the idle
    /// time paid for, plus a cold start (its billed boot and the wait it adds, `break_even_s` idle
    /// seconds' worth) whenever the gap outlasts T. This is the expected-cost form of the
    /// ski-rental problem with a known gap distribution (Karlin et al. 1994, "Competitive
    /// randomized algorithms for non-uniform problems"); with no gap data the break-even
    /// T = `break_even_s` is 2-competitive. Within a bucket the cost is concave in T, so only the
    /// scaled bucket edges and the bounds are candidates. Ties go to the shorter timeout.
    pub fn timeout_s(&self, scale: f64, break_even_s: f64, min_s: f64, max_s: f64) -> f64 {
        let mut best = (self.cost_at(min_s, scale, break_even_s), min_s);
        // The first edge above min_s (edges ascend): this runs for every idle worker on every decision.
        let first = self.edges.partition_point(|e| scale * e <= min_s);
        for i in first..self.edges.len() {
            let t = scale * self.edges[i];
            if t >= max_s {
                break;
            }
            let over = (1.0 - self.cum_mass[i]).max(0.0);
            let cost = scale * self.cum_idle[i] + over * (t + break_even_s);
            if cost < best.0 - 1e-9 {
                best = (cost, t);
            }
        }
        let at_max = self.cost_at(max_s, scale, break_even_s);
        if at_max < best.0 - 1e-9 {
            best = (at_max, max_s);
        }
        best.1
    }
}

/// Cooldown with decay: does an idle worker with launch sequence `seq` belong to the share released
/// at the first step? A Weyl sequence over `seq` spreads consecutive launches evenly, so about
/// `fraction` of any run of workers is in it, without state.
pub fn in_first_release(seq: u64, fraction: f64) -> bool {
    let u = (seq.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64;
    u < fraction
}
