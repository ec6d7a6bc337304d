//! Seeded synthetic traces: arrival shapes the real traces mix together, one at a time.
//!
//! `onoff simulate --trace synthetic:KIND[:N]` with KIND one of
//!
//! * `poisson`: constant-rate arrivals (a Poisson process at [`MEAN_JOBS_PER_H`]);
//! * `diurnal`: the rate follows a day curve (`1 + A cos(2π (hour - peak) / 24)`, [`DIURNAL_AMPLITUDE`],
//!   [`DIURNAL_PEAK_HOUR_UTC`]);
//! * `bursty`: on/off arrivals, bursts at [`BURST_JOBS_PER_H`] lasting [`BURST_MEAN_S`] on average,
//!   separated by quiet periods of [`QUIET_MEAN_S`] on average (an interrupted Poisson process);
//! * `heavy-tail`: Poisson arrivals as `poisson`, run times lognormal ([`LOG_RUNTIME_MEAN`],
//!   [`LOG_RUNTIME_SD`]) instead of exponential;
//!
//! and N jobs (default [`DEFAULT_JOBS`]). Every kind has the same long-run arrival rate, the same GPU
//! mix ([`GPU_MIX`]) and, but for `heavy-tail`, the same exponential run times of mean
//! [`mean_runtime_s`], so that two kinds differ in one property only: `poisson` against `diurnal`
//! or `bursty` in the arrival shape, `poisson` against `heavy-tail` in the run-time tail (equal
//! expected work per job, lognormal median 890 s against the exponential's 6,300 s).
//!
//! Every parameter is measured on the full Philly trace (82,247 jobs, 2017-09-04 .. 12-22,
//! `philly_pollux/philly.csv`; the computation is described at each constant). Times are in the
//! generator's own clock starting at [`EPOCH_UNIX_S`] (2024-01-01 00:00:00 UTC, a Monday); the
//! trace's `start_unix_s` is the first arrival, as for parsed traces. The same (kind, N, seed)
//! always gives the same trace.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::trace::{Trace, TraceFormat, TraceJob};

/// Jobs generated when the spec gives no N.
pub const DEFAULT_JOBS: usize = 5_000;

/// Unix seconds where the generator's clock starts: 2024-01-01 00:00:00 UTC (a Monday), so the
/// diurnal curve's hours are UTC hours (as the policy's warm-pool schedule reads them).
pub const EPOCH_UNIX_S: f64 = 1_704_067_200.0;

/// Long-run arrival rate of every kind, jobs per hour: Philly's mean, 82,247 jobs over the
/// 108.897 days from its first to its last submission (31.47 jobs/h). 5,000 jobs span about 6.6
/// days.
pub const MEAN_JOBS_PER_H: f64 = 82_247.0 / (108.896_875 * 24.0);

/// Relative amplitude of the diurnal rate curve: Philly's first hour-of-day harmonic (submissions
/// per hour of day, 24 bins, |c1| / c0 = 0.288): the peak hour gets 1.29 x the mean rate, the
/// trough 0.71 x.
pub const DIURNAL_AMPLITUDE: f64 = 0.29;

/// Hour of the diurnal peak, UTC: where Philly's first harmonic peaks (04:59 in the file's clock,
/// whose zone is unknown; rounded).
pub const DIURNAL_PEAK_HOUR_UTC: f64 = 5.0;

/// Arrival rate inside a burst, jobs per hour: one job every 11.5 s on average. Philly's median
/// gap between submissions is 8 s (= 11.5 s x ln 2 for exponential gaps): most jobs arrive in
/// bursts (hyper-parameter sweeps), like the 200 jobs in 25 minutes of `philly-short.csv`.
pub const BURST_JOBS_PER_H: f64 = 3600.0 / 11.5;

/// Mean length of a burst, seconds (exponential): 1,650 s, about 140 jobs per burst. Chosen with
/// [`QUIET_MEAN_S`] so that the generated gaps have Philly's coefficient of variation (15.1; a
/// 200,000-job run of this generator gives 15.1, mean gap 117 s against Philly's 114 s, median 8 s).
pub const BURST_MEAN_S: f64 = 1_650.0;

/// Mean length of a quiet period, seconds (exponential), derived so that the long-run rate is
/// [`MEAN_JOBS_PER_H`]: `BURST_JOBS_PER_H x BURST_MEAN_S / MEAN_JOBS_PER_H - BURST_MEAN_S`, about
/// 14,760 s (4.1 h). Philly's quiet periods are not silent (21 % of its hours have no
/// submission, 71 % here): the on/off shape is the extreme.
pub const QUIET_MEAN_S: f64 = BURST_JOBS_PER_H * BURST_MEAN_S / MEAN_JOBS_PER_H - BURST_MEAN_S;

/// Mean of the natural log of Philly's run times (seconds, durations below 1 s read as 1 s): 6.791,
/// a median of 890 s.
pub const LOG_RUNTIME_MEAN: f64 = 6.791;

/// Standard deviation of the natural log of Philly's run times: 2.156 (its p99 run time is 70.8 h
/// against a median of 19 minutes).
pub const LOG_RUNTIME_SD: f64 = 2.156;

/// Longest run time drawn, seconds: Philly's longest job (4,628,226 s, 53.6 days), so no draw
/// from the lognormal's tail outlasts anything observed.
pub const MAX_RUNTIME_S: f64 = 4_628_226.0;

/// GPUs per job and their weights: Philly's job counts for 1, 2, 4, 8, 16 and 32 GPUs (76,627,
/// 1,818, 1,870, 1,643, 199, 67: 99.97 % of its jobs; the 23 jobs of 12, 24, 64 and 128 GPUs are
/// left out). 93.2 % of jobs use 1 GPU; 16 and 32 run on 2 and 4 instances of 8 GPUs.
pub const GPU_MIX: [(u32, u32); 6] = [(1, 76_627), (2, 1_818), (4, 1_870), (8, 1_643), (16, 199), (32, 67)];

/// Mean run time of every kind, seconds: the lognormal's mean `exp(mu + sigma^2 / 2)`, 9,083 s
/// (2.5 h). The exponential run times of `poisson`, `diurnal` and `bursty` have this mean, so every
/// kind carries the same expected work per job (Philly's own mean is 13,136 s: its tail is heavier
/// than lognormal).
pub fn mean_runtime_s() -> f64 {
    (LOG_RUNTIME_MEAN + LOG_RUNTIME_SD * LOG_RUNTIME_SD / 2.0).exp()
}

/// The arrival shape of a synthetic trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyntheticKind {
    /// Constant-rate (Poisson) arrivals, exponential run times.
    Poisson,
    /// Arrival rate following a day curve, exponential run times.
    Diurnal,
    /// Bursts of arrivals separated by quiet periods, exponential run times.
    Bursty,
    /// Poisson arrivals, lognormal run times.
    HeavyTail,
}

impl SyntheticKind {
    /// Every kind, in the order of the docs.
    pub const ALL: [SyntheticKind; 4] = [Self::Poisson, Self::Diurnal, Self::Bursty, Self::HeavyTail];

    /// Name as given after `synthetic:`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Poisson => "poisson",
            Self::Diurnal => "diurnal",
            Self::Bursty => "bursty",
            Self::HeavyTail => "heavy-tail",
        }
    }
}

/// A parsed `synthetic:KIND[:N]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SyntheticSpec {
    /// Arrival shape.
    pub kind: SyntheticKind,
    /// Jobs to generate (>= 1).
    pub jobs: usize,
}

impl SyntheticSpec {
    /// `Ok(None)` when `s` does not start with `synthetic:` (a file path); `Err` when it does and
    /// the rest is not `KIND[:N]`.
    pub fn parse(s: &str) -> Result<Option<SyntheticSpec>, String> {
        let Some(rest) = s.strip_prefix("synthetic:") else {
            return Ok(None);
        };
        let (kind, n) = match rest.split_once(':') {
            Some((k, n)) => (k, Some(n)),
            None => (rest, None),
        };
        let kind = SyntheticKind::ALL
            .into_iter()
            .find(|k| k.name() == kind)
            .ok_or_else(|| {
                let names: Vec<&str> = SyntheticKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown synthetic trace {kind:?}; choose from {}", names.join(", "))
            })?;
        let jobs = match n {
            None => DEFAULT_JOBS,
            Some(n) => n
                .replace('_', "")
                .parse::<usize>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| format!("synthetic:{}: {n:?} is not a number of jobs >= 1", kind.name()))?,
        };
        Ok(Some(SyntheticSpec { kind, jobs }))
    }

    /// Label for reports: `synthetic:KIND:N`.
    pub fn label(&self) -> String {
        format!("synthetic:{}:{}", self.kind.name(), self.jobs)
    }
}

/// Exponential draw of mean `mean`.
fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    // 1 - U lies in (0, 1]: ln never sees 0.
    -(1.0 - rng.random::<f64>()).ln() * mean
}

/// Standard normal draw (Box-Muller, one of the pair).
fn normal(rng: &mut StdRng) -> f64 {
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Rate of the diurnal curve at generator time `t` (seconds since [`EPOCH_UNIX_S`]), jobs per second.
pub fn diurnal_rate_per_s(t: f64) -> f64 {
    let hour = ((EPOCH_UNIX_S + t) / 3600.0).rem_euclid(24.0);
    let phase = 2.0 * std::f64::consts::PI * (hour - DIURNAL_PEAK_HOUR_UTC) / 24.0;
    MEAN_JOBS_PER_H / 3600.0 * (1.0 + DIURNAL_AMPLITUDE * phase.cos())
}

/// Arrival times (seconds since [`EPOCH_UNIX_S`], ascending) of `n` jobs.
fn arrivals(kind: SyntheticKind, n: usize, rng: &mut StdRng) -> Vec<f64> {
    let mean_gap = 3600.0 / MEAN_JOBS_PER_H;
    let mut out = Vec::with_capacity(n);
    let mut t = 0.0;
    match kind {
        SyntheticKind::Poisson | SyntheticKind::HeavyTail => {
            while out.len() < n {
                t += exponential(rng, mean_gap);
                out.push(t);
            }
        }
        SyntheticKind::Diurnal => {
            // Thinning (Lewis and Shedler 1979): candidates at the peak rate, each kept with
            // probability rate(t) / peak rate.
            let peak = MEAN_JOBS_PER_H / 3600.0 * (1.0 + DIURNAL_AMPLITUDE);
            while out.len() < n {
                t += exponential(rng, 1.0 / peak);
                if rng.random::<f64>() * peak < diurnal_rate_per_s(t) {
                    out.push(t);
                }
            }
        }
        SyntheticKind::Bursty => {
            let gap_in_burst = 3600.0 / BURST_JOBS_PER_H;
            while out.len() < n {
                let end = t + exponential(rng, BURST_MEAN_S);
                loop {
                    t += exponential(rng, gap_in_burst);
                    if t > end || out.len() == n {
                        break;
                    }
                    out.push(t);
                }
                t = end + exponential(rng, QUIET_MEAN_S);
            }
        }
    }
    out
}

/// Run time of one job, seconds (>= 1).
fn runtime(kind: SyntheticKind, rng: &mut StdRng) -> f64 {
    let d = match kind {
        SyntheticKind::HeavyTail => (LOG_RUNTIME_MEAN + LOG_RUNTIME_SD * normal(rng)).exp(),
        _ => exponential(rng, mean_runtime_s()),
    };
    d.clamp(1.0, MAX_RUNTIME_S)
}

/// GPUs of one job, drawn from [`GPU_MIX`].
fn gpus(rng: &mut StdRng) -> u32 {
    let total: u32 = GPU_MIX.iter().map(|g| g.1).sum();
    let mut x = rng.random_range(0..total);
    for (g, w) in GPU_MIX {
        if x < w {
            return g;
        }
        x -= w;
    }
    1
}

/// Generate the trace of `spec` with `seed`. Jobs are in the project `synthetic`.
pub fn generate(spec: &SyntheticSpec, seed: u64) -> Trace {
    let mut rng = StdRng::seed_from_u64(seed);
    let at = arrivals(spec.kind, spec.jobs.max(1), &mut rng);
    let first = at[0];
    let jobs = at
        .iter()
        .enumerate()
        .map(|(i, &t)| TraceJob {
            id: i as u64,
            arrival_s: t - first,
            duration_s: runtime(spec.kind, &mut rng),
            gpus: gpus(&mut rng),
            project: "synthetic".into(),
        })
        .collect();
    Trace {
        format: TraceFormat::Synthetic,
        start_unix_s: EPOCH_UNIX_S + first,
        jobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: SyntheticKind, jobs: usize) -> SyntheticSpec {
        SyntheticSpec { kind, jobs }
    }

    fn gaps(t: &Trace) -> Vec<f64> {
        t.jobs.windows(2).map(|w| w[1].arrival_s - w[0].arrival_s).collect()
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len() as f64
    }

    fn cv(v: &[f64]) -> f64 {
        let m = mean(v);
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64).sqrt() / m
    }

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        assert_eq!(SyntheticSpec::parse("data/philly.csv"), Ok(None));
        assert_eq!(
            SyntheticSpec::parse("synthetic:poisson"),
            Ok(Some(spec(SyntheticKind::Poisson, DEFAULT_JOBS)))
        );
        assert_eq!(
            SyntheticSpec::parse("synthetic:heavy-tail:20_000"),
            Ok(Some(spec(SyntheticKind::HeavyTail, 20_000)))
        );
        assert_eq!(
            SyntheticSpec::parse("synthetic:bursty:7").unwrap().unwrap().label(),
            "synthetic:bursty:7"
        );
        let e = SyntheticSpec::parse("synthetic:weekly").unwrap_err();
        assert!(
            e.contains("weekly") && e.contains("poisson, diurnal, bursty, heavy-tail"),
            "{e}"
        );
        for bad in ["synthetic:poisson:0", "synthetic:poisson:x", "synthetic:poisson:-3"] {
            assert!(SyntheticSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        for kind in SyntheticKind::ALL {
            let a = generate(&spec(kind, 500), 7);
            let b = generate(&spec(kind, 500), 7);
            let c = generate(&spec(kind, 500), 8);
            assert_eq!(a.jobs, b.jobs, "{kind:?}");
            assert_eq!(a.start_unix_s, b.start_unix_s);
            assert_ne!(a.jobs, c.jobs, "{kind:?}");
            assert_eq!(a.jobs.len(), 500);
            assert_eq!(a.format, TraceFormat::Synthetic);
            assert_eq!(a.jobs[0].arrival_s, 0.0);
            assert!(a.jobs.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
            assert!(a
                .jobs
                .iter()
                .enumerate()
                .all(|(i, j)| j.id == i as u64 && j.duration_s >= 1.0 && j.duration_s <= MAX_RUNTIME_S));
        }
    }

    #[test]
    fn poisson_arrivals_are_memoryless_at_philly_rate() {
        let t = generate(&spec(SyntheticKind::Poisson, 20_000), 1);
        let g = gaps(&t);
        let want = 3600.0 / MEAN_JOBS_PER_H; // 114.4 s
        assert!((mean(&g) / want - 1.0).abs() < 0.03, "mean gap {}", mean(&g));
        // Exponential gaps: coefficient of variation 1.
        assert!((cv(&g) - 1.0).abs() < 0.05, "cv {}", cv(&g));
        // Exponential run times of the common mean.
        let d: Vec<f64> = t.jobs.iter().map(|j| j.duration_s).collect();
        assert!(
            (mean(&d) / mean_runtime_s() - 1.0).abs() < 0.04,
            "mean run {}",
            mean(&d)
        );
    }

    #[test]
    fn diurnal_arrivals_crowd_the_peak_hours() {
        let t = generate(&spec(SyntheticKind::Diurnal, 20_000), 1);
        let mut per_hour = [0u32; 24];
        for j in &t.jobs {
            let h = ((t.start_unix_s + j.arrival_s) / 3600.0).rem_euclid(24.0) as usize;
            per_hour[h] += 1;
        }
        // The six hours around the peak (02:00-08:00 UTC) against the six around the trough
        // (14:00-20:00): (1 + A x 0.91) / (1 - A x 0.91) = 1.71 expected.
        let peak: u32 = per_hour[2..8].iter().sum();
        let trough: u32 = per_hour[14..20].iter().sum();
        let ratio = peak as f64 / trough as f64;
        assert!(ratio > 1.5 && ratio < 1.95, "peak {peak} trough {trough}");
        // The long-run rate is still the mean rate.
        let g = gaps(&t);
        assert!((mean(&g) / (3600.0 / MEAN_JOBS_PER_H) - 1.0).abs() < 0.04);
        // A Poisson trace of the same size has no such swing.
        let p = generate(&spec(SyntheticKind::Poisson, 20_000), 1);
        let mut flat = [0u32; 24];
        for j in &p.jobs {
            flat[((p.start_unix_s + j.arrival_s) / 3600.0).rem_euclid(24.0) as usize] += 1;
        }
        let r = flat[2..8].iter().sum::<u32>() as f64 / flat[14..20].iter().sum::<u32>() as f64;
        assert!((r - 1.0).abs() < 0.1, "poisson ratio {r}");
    }

    #[test]
    fn bursty_arrivals_come_in_bursts_with_quiet_gaps() {
        let t = generate(&spec(SyntheticKind::Bursty, 20_000), 1);
        let g = gaps(&t);
        // Philly-like gaps: mean about 114 s, coefficient of variation about 15, median 8 s.
        assert!(
            (mean(&g) / (3600.0 / MEAN_JOBS_PER_H) - 1.0).abs() < 0.25,
            "mean {}",
            mean(&g)
        );
        assert!(cv(&g) > 8.0, "cv {}", cv(&g));
        let mut sorted = g.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        assert!(median > 5.0 && median < 12.0, "median gap {median}");
        // Most hours hold no arrival at all, and the busy ones hold many.
        let hours = (t.span_s() / 3600.0).ceil() as usize + 1;
        let mut per_hour = vec![0u32; hours];
        for j in &t.jobs {
            per_hour[(j.arrival_s / 3600.0) as usize] += 1;
        }
        let empty = per_hour.iter().filter(|&&c| c == 0).count() as f64 / hours as f64;
        assert!(empty > 0.5, "empty hours {empty}");
        assert!(*per_hour.iter().max().unwrap() > 150);
    }

    #[test]
    fn heavy_tail_has_the_same_mean_work_and_a_far_longer_tail() {
        let h = generate(&spec(SyntheticKind::HeavyTail, 50_000), 1);
        let p = generate(&spec(SyntheticKind::Poisson, 50_000), 1);
        let mut dh: Vec<f64> = h.jobs.iter().map(|j| j.duration_s).collect();
        let mut dp: Vec<f64> = p.jobs.iter().map(|j| j.duration_s).collect();
        dh.sort_by(f64::total_cmp);
        dp.sort_by(f64::total_cmp);
        let q = |v: &[f64], x: f64| v[((v.len() as f64 * x) as usize).min(v.len() - 1)];
        // Lognormal median exp(6.791) = 890 s, exponential median 9,083 x ln 2 = 6,296 s.
        assert!(
            (q(&dh, 0.5) / LOG_RUNTIME_MEAN.exp() - 1.0).abs() < 0.05,
            "{}",
            q(&dh, 0.5)
        );
        assert!((q(&dp, 0.5) / (mean_runtime_s() * 2f64.ln()) - 1.0).abs() < 0.05);
        // The tail: p99.9 of the lognormal is far beyond the exponential's.
        assert!(
            q(&dh, 0.999) > 4.0 * q(&dp, 0.999),
            "{} vs {}",
            q(&dh, 0.999),
            q(&dp, 0.999)
        );
        // Arrivals are the same process as poisson's.
        assert!((cv(&gaps(&h)) - 1.0).abs() < 0.05);
    }

    #[test]
    fn gpu_mix_follows_philly() {
        let t = generate(&spec(SyntheticKind::Poisson, 50_000), 3);
        let total: u32 = GPU_MIX.iter().map(|g| g.1).sum();
        for (g, w) in GPU_MIX {
            let got = t.jobs.iter().filter(|j| j.gpus == g).count() as f64 / t.jobs.len() as f64;
            let want = w as f64 / total as f64;
            // Within 4 standard errors of the binomial share.
            let se = (want * (1.0 - want) / t.jobs.len() as f64).sqrt();
            assert!((got - want).abs() < 4.0 * se + 1e-4, "{g} GPUs: {got} vs {want}");
        }
        assert!(t.jobs.iter().all(|j| GPU_MIX.iter().any(|g| g.0 == j.gpus)));
    }
}
