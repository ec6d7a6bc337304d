//! Trace-replay simulator: the real onoff policy and control code over a virtual clock and a
//! simulated fleet, side by side with the baselines users run today.
//!
//! # Layout
//! - [`trace`]: Philly and Azure trace parsing; the train/test split and back-to-back repeats.
//! - [`synthetic`]: seeded synthetic traces (`poisson`, `diurnal`, `bursty`, `heavy-tail`).
//! - [`preemption`]: measured per-zone spot availability series (SkyPilot's spot traces).
//! - [`engine`]: discrete-event engine, simulated fleet ports, billing, deadlines, the run report.
//! - [`strategies`]: `onoff`, `fixed-idle-10m`, `keda-like`, `min-one-warm`, `always-on`,
//!   `skypilot-like`, `all-on-demand`.
//! - [`sweep`]: one policy setting over several values (the cost / wait frontier).
//! - [`compare`]: run them all on one trace; [`lower_bound_usd`], [`peak_need`], [`job_shapes`].
#![warn(missing_docs)]

mod agenda;
pub mod engine;
mod fleet_index;
pub mod preemption;
pub mod strategies;
pub mod sweep;
pub mod synthetic;
pub mod trace;

use std::collections::BTreeMap;

use onoff_policy::choice::{self, Request};
use onoff_policy::{CapacityPreference, Offering, PolicyConfig};
use serde::Serialize;

pub use engine::{assign_deadlines, run, JobWait, Preemptions, RunReport, SimConfig, Strategy, TimelineRow};
pub use onoff_policy::shape::job_shape;
pub use preemption::{MeasuredPreemptions, ZoneMapping};
pub use trace::{AzureModel, Half, SplitInfo, Trace, TraceError, TraceFormat, TraceJob};

/// A float as an integer key that orders as the float (`f64::total_cmp`): positive floats order
/// as their bits; the flip makes negative ones order below them. For times in ordered maps and
/// sets (the agenda, the fleet index).
pub(crate) fn ordered(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | (1 << 63)
    }
}

/// Names of every strategy [`strategy`] builds: the [`DEFAULT_STRATEGIES`], then
/// [`ALL_ON_DEMAND`].
pub const STRATEGIES: [&str; DEFAULT_STRATEGIES.len() + 1] = {
    let mut all = [ALL_ON_DEMAND; DEFAULT_STRATEGIES.len() + 1];
    let mut i = 0;
    while i < DEFAULT_STRATEGIES.len() {
        all[i] = DEFAULT_STRATEGIES[i];
        i += 1;
    }
    all
};

/// The strategies `onoff simulate` runs unless told otherwise, in report order (`all-on-demand`
/// joins them when deadlines are on).
pub const DEFAULT_STRATEGIES: [&str; 6] = [
    "onoff",
    "always-on",
    "min-one-warm",
    "fixed-idle-10m",
    "keda-like",
    "skypilot-like",
];

/// The reference strategy of deadline runs.
pub const ALL_ON_DEMAND: &str = "all-on-demand";

/// Cheapest eligible price for one instance of `gpus` GPUs, $/h, any capacity type.
fn cheapest_price(offerings: &[Offering], gpus: u32, cfg: &PolicyConfig) -> Option<f64> {
    let req = Request {
        gpus,
        min_mem_gib: cfg.offers.min_gpu_memory_gib,
        capacity: CapacityPreference::SpotFirst,
        instances: 1,
        runtime_s: cfg.offers.default_runtime_s,
    };
    offerings
        .iter()
        .filter(|o| choice::eligible(o, &req, &cfg.offers, &[], 0.0))
        .map(|o| o.price_usd_per_h / choice::speed(&cfg.offers, &o.gpu_model))
        .min_by(f64::total_cmp)
}

/// Offline lower bound, $: every job's run time on its instances at the cheapest eligible price
/// (speed-adjusted), no idle, no boot, no interruption.
///
/// # Errors
/// The GPUs per instance of a job no offering can serve.
pub fn lower_bound_usd(trace: &Trace, offerings: &[Offering], cfg: &PolicyConfig, sim: &SimConfig) -> Result<f64, u32> {
    let mut cache: BTreeMap<u32, f64> = BTreeMap::new();
    let mut total = 0.0;
    for (j, (g, n)) in trace.jobs.iter().zip(job_shapes(trace, offerings, cfg, sim)) {
        let p = match cache.get(&g) {
            Some(p) => *p,
            None => {
                let p = cheapest_price(offerings, g, cfg).ok_or(g)?;
                cache.insert(g, p);
                p
            }
        };
        total += p * n as f64 * j.duration_s / 3600.0;
    }
    Ok(total)
}

/// Each trace job's shape as the policy schedules it, in trace order: (GPUs per instance,
/// instances), split at `sim.max_gpus_per_instance` ([`job_shape`]) and scheduled past a size the
/// allowed offerings lack ([`choice::schedule_gpus`]: with x86_64 types only, a 2-GPU job runs on
/// a 4-GPU instance). Trace jobs ask for no GPU memory beyond the policy's minimum.
pub fn job_shapes(trace: &Trace, offerings: &[Offering], cfg: &PolicyConfig, sim: &SimConfig) -> Vec<(u32, u32)> {
    let mut scheduled: BTreeMap<u32, u32> = BTreeMap::new();
    let min_mem = cfg.offers.min_gpu_memory_gib;
    trace
        .jobs
        .iter()
        .map(|j| {
            let (g, n) = job_shape(j.gpus, sim.max_gpus_per_instance);
            let g = *scheduled
                .entry(g)
                .or_insert_with(|| choice::schedule_gpus(offerings, g, min_mem, &cfg.offers));
            (g, n)
        })
        .collect()
}

/// Peak concurrent instances per GPUs-per-instance shape ([`job_shapes`]) if every job started
/// on arrival.
pub fn peak_need(trace: &Trace, offerings: &[Offering], cfg: &PolicyConfig, sim: &SimConfig) -> BTreeMap<u32, u32> {
    let mut events: Vec<(f64, i64, u32)> = Vec::with_capacity(trace.jobs.len() * 2);
    for (j, (g, n)) in trace.jobs.iter().zip(job_shapes(trace, offerings, cfg, sim)) {
        events.push((j.arrival_s, n as i64, g));
        events.push((j.arrival_s + j.duration_s, -(n as i64), g));
    }
    // Ends before starts at the same instant.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut cur: BTreeMap<u32, i64> = BTreeMap::new();
    let mut peak: BTreeMap<u32, u32> = BTreeMap::new();
    for (_, d, g) in events {
        let c = cur.entry(g).or_default();
        *c += d;
        let p = peak.entry(g).or_default();
        *p = (*p).max(*c as u32);
    }
    peak
}

/// Result of [`compare`].
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Trace file name or label.
    pub trace: String,
    /// Jobs in the trace.
    pub jobs: usize,
    /// GPU-hours of work in the trace.
    pub gpu_hours: f64,
    /// Offline lower bound, $.
    pub lower_bound_usd: f64,
    /// The half of the trace replayed (`--split`), if any; set by the caller.
    pub split: Option<SplitInfo>,
    /// Interruption model: `advisor` or `skypilot:<source>`.
    pub preemptions: Preemptions,
    /// Each simulated zone and the measured series it replays (measured preemptions only).
    pub zones: Vec<ZoneMapping>,
    /// Share of jobs with a deadline (0 = deadlines off).
    pub deadline_fraction: f64,
    /// Deadline = arrival + this x run time.
    pub deadline_slack: f64,
    /// Whether the jobs declared their run times ([`SimConfig::declared_runtimes`]).
    pub declared_runtimes: bool,
    /// Cost of `all-on-demand`, $, when deadlines are on.
    pub all_on_demand_usd: Option<f64>,
    /// One report per strategy.
    pub policies: Vec<RunReport>,
}

/// Build the strategy called `name` (one of [`STRATEGIES`]) for `cfg`.
///
/// # Panics
/// Never for the names in [`STRATEGIES`]; other names return `None`.
pub fn strategy(
    name: &str,
    cfg: &PolicyConfig,
    trace: &Trace,
    offerings: &[Offering],
    sim: &SimConfig,
) -> Option<Box<dyn Strategy>> {
    use strategies::*;
    Some(match name {
        "onoff" => Box::new(PolicyStrategy::new("onoff", cfg.clone())),
        "always-on" => Box::new(AlwaysOn::new(cfg.clone(), peak_need(trace, offerings, cfg, sim))),
        "min-one-warm" => Box::new(MinOneWarm::new(cfg.clone())),
        "fixed-idle-10m" => Box::new(PolicyStrategy::fixed_idle_10m(cfg.clone())),
        "keda-like" => Box::new(KedaLike::new(cfg.clone())),
        "skypilot-like" => Box::new(SkyPilotLike::new(cfg.clone())),
        "all-on-demand" => Box::new(PolicyStrategy::all_on_demand(cfg.clone())),
        _ => return None,
    })
}

/// Run every strategy in `names` over `trace`. `progress(strategy_index, share_done)`.
///
/// With deadlines on (`sim.deadline_fraction > 0`), `all-on-demand` is run too (appended when
/// `names` lacks it) and every report gets its `cost_vs_all_on_demand`.
///
/// # Errors
/// A job shape no offering serves (the lower bound cannot be computed), or an unknown strategy name.
pub fn compare(
    label: &str,
    trace: &Trace,
    offerings: &[Offering],
    cfg: &PolicyConfig,
    sim: &SimConfig,
    names: &[&str],
    progress: &mut dyn FnMut(usize, f64),
) -> Result<Comparison, String> {
    let lower = lower_bound_usd(trace, offerings, cfg, sim)
        .map_err(|g| format!("no offering in the catalogue has {g} GPUs with the configured filters"))?;
    let deadlines = sim.deadline_fraction > 0.0;
    let mut names: Vec<&str> = names.to_vec();
    if deadlines && !names.contains(&ALL_ON_DEMAND) {
        names.push(ALL_ON_DEMAND);
    }
    let mut policies = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let mut s = strategy(name, cfg, trace, offerings, sim).ok_or_else(|| format!("unknown strategy {name:?}"))?;
        policies.push(run(trace, offerings, s.as_mut(), sim, &mut |p| progress(i, p)));
    }
    let all_on_demand_usd = policies
        .iter()
        .find(|p| deadlines && p.name == ALL_ON_DEMAND)
        .map(|p| p.total_usd);
    if let Some(od) = all_on_demand_usd.filter(|od| *od > 0.0) {
        for p in &mut policies {
            p.cost_vs_all_on_demand = Some(p.total_usd / od);
        }
    }
    Ok(Comparison {
        trace: label.to_string(),
        jobs: trace.jobs.len(),
        gpu_hours: trace.gpu_seconds() / 3600.0,
        lower_bound_usd: lower,
        split: None,
        preemptions: sim.preemptions.clone(),
        zones: sim.preemptions.zone_mapping(offerings),
        deadline_fraction: sim.deadline_fraction,
        deadline_slack: sim.deadline_slack,
        declared_runtimes: sim.declared_runtimes,
        all_on_demand_usd,
        policies,
    })
}
