//! The strategies compared side by side: onoff's policy and the baselines users run today.
//!
//! - `onoff`: [`onoff_policy::decide()`] with the default configuration (adaptive keep-alive).
//! - `fixed-idle-10m`: the same queue-depth policy with a fixed 10-minute idle timeout.
//! - `keda-like`: KEDA's SQS scaler semantics: poll every 30 s, desired workers =
//!   ceil(backlog / 5) with backlog = visible + in flight (at least a gang job's instances), idle
//!   workers removed after a 300 s cooldown down to that (and empty ones no queued job fits),
//!   cheapest $/h offering (Karpenter-style) for the queued jobs' shapes; idle workers only are
//!   removed (a graceful drain; KEDA #157 shows the harsher real behaviour).
//! - `min-one-warm`: the seed write-up's naive setup: at least one on-demand instance always on,
//!   target tracking on utilisation (70 %), scale-out at most every 60 s, scale-in after 15 minutes
//!   under target. A queued job no worker fits counts as a busy worker (the best a utilisation
//!   metric can see of pending work).
//! - `always-on`: a fleet fixed at the trace's peak concurrent need (zero-wait schedule), on-demand,
//!   launched at the start and never released.
//! - `skypilot-like`: SkyPilot managed jobs with `use_spot`: capacity for each job on the cheapest
//!   spot offering by $/h, the job restarted from its last checkpoint after a preemption (seen
//!   when the instance is gone, not at the notice), idle instances stopped after 5 minutes.
//! - `all-on-demand`: the onoff policy with every lane on on-demand capacity: what the same jobs
//!   cost without spot (the reference for deadline runs).

use std::collections::{BTreeMap, HashMap, HashSet};

use onoff_policy::choice::{self, Request};
use onoff_policy::{
    decide_with_memo, Action, CapacityPreference, KeepAliveMode, LaunchShape, Observation, Offering, PendingJob, Plan,
    PolicyConfig, RankMemo, Reason, StopIdle, WorkerState, WorkerView,
};

use crate::engine::Strategy;

/// The onoff policy (or any `PolicyConfig` of it).
pub struct PolicyStrategy {
    name: String,
    cfg: PolicyConfig,
    /// Offering rankings kept across this replay's decisions (one catalogue, one configuration).
    memo: RankMemo,
}

impl PolicyStrategy {
    /// Wrap a configuration under a report name.
    pub fn new(name: &str, cfg: PolicyConfig) -> Self {
        Self {
            name: name.into(),
            cfg,
            memo: RankMemo::default(),
        }
    }

    /// `fixed-idle-10m`: `cfg` with a fixed 600 s idle timeout, no warm pool (scheduled or
    /// predictive) and no stopped workers (an idle worker is terminated, as a fixed idle timeout
    /// does elsewhere).
    pub fn fixed_idle_10m(mut cfg: PolicyConfig) -> Self {
        cfg.scale_down.mode = KeepAliveMode::Fixed;
        cfg.scale_down.fixed_idle_timeout_s = 600.0;
        cfg.scale_down.stop_idle = StopIdle::Never;
        for l in &mut cfg.lanes {
            l.warm_pool.clear();
            l.predictive_max = 0;
        }
        Self::new("fixed-idle-10m", cfg)
    }

    /// `all-on-demand`: `cfg` with every lane's capacity [`CapacityPreference::OnDemand`].
    pub fn all_on_demand(mut cfg: PolicyConfig) -> Self {
        for l in &mut cfg.lanes {
            l.capacity = CapacityPreference::OnDemand;
        }
        Self::new("all-on-demand", cfg)
    }
}

impl Strategy for PolicyStrategy {
    fn name(&self) -> &str {
        &self.name
    }
    fn longest_keep_alive_s(&self) -> f64 {
        let sd = &self.cfg.scale_down;
        match sd.mode {
            KeepAliveMode::Fixed => sd.fixed_idle_timeout_s,
            KeepAliveMode::CooldownDecay => sd.release_rest_at_s,
            KeepAliveMode::Adaptive => sd.max_keep_alive_s.max(sd.min_keep_alive_s),
        }
    }
    fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
    fn tick_s(&self) -> f64 {
        60.0
    }
    fn decides_on_submit(&self) -> bool {
        true
    }
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan {
        decide_with_memo(obs, &self.cfg, now, &mut self.memo)
    }
    fn start_run(&mut self) {
        // The memo knows a catalogue by its address: a new replay's may reuse an old one's.
        self.memo = RankMemo::default();
    }
    fn runs_onoff_agent(&self) -> bool {
        true
    }
}

/// Cheapest offering by $/h (how Karpenter, Cluster Autoscaler's price expander and AWS Batch
/// choose) among those fitting `gpus` with the config's filters.
fn cheapest_per_hour<'a>(
    offerings: &'a [Offering],
    gpus: u32,
    capacity: CapacityPreference,
    cfg: &PolicyConfig,
    obs: &Observation<'_>,
    now: f64,
) -> Option<&'a Offering> {
    let req = Request {
        gpus,
        min_mem_gib: cfg.offers.min_gpu_memory_gib,
        capacity,
        instances: 1,
        runtime_s: cfg.offers.default_runtime_s,
    };
    // Unavailable offerings as a set when there are many (measured preemptions: a scan of the
    // list per offering would cost offerings x unavailable); a short list is scanned.
    let live: Vec<&onoff_policy::OfferingKey> = obs
        .unavailable
        .iter()
        .filter(|u| u.until > now)
        .map(|u| &u.key)
        .collect();
    let set: HashSet<&onoff_policy::OfferingKey> = if live.len() > 8 {
        live.iter().copied().collect()
    } else {
        HashSet::new()
    };
    let out = |k: &onoff_policy::OfferingKey| {
        if live.len() > 8 {
            set.contains(k)
        } else {
            live.contains(&k)
        }
    };
    offerings
        .iter()
        .filter(|o| !out(&o.key) && choice::eligible(o, &req, &cfg.offers, &[], now))
        .min_by(|a, b| {
            a.price_usd_per_h
                .total_cmp(&b.price_usd_per_h)
                .then_with(|| a.key.cmp(&b.key))
        })
}

fn launch(
    lane: usize,
    o: &Offering,
    gpus: u32,
    count: u32,
    capacity: CapacityPreference,
    reason: Reason,
    cfg: &PolicyConfig,
) -> Action {
    Action::Launch {
        lane,
        offering: o.key.clone(),
        price_usd_per_h: o.price_usd_per_h,
        count,
        request: LaunchShape {
            gpus,
            min_gpu_memory_gib: cfg.offers.min_gpu_memory_gib,
            capacity,
            runtime_s: cfg.offers.default_runtime_s,
            max_cost_usd: None,
        },
        project: None,
        job: None,
        reason,
    }
}

/// Launch one instance per entry of `shapes` (GPUs per instance), grouped by shape, each on the
/// cheapest $/h offering that fits.
#[allow(clippy::too_many_arguments)]
fn launch_cheapest(
    plan: &mut Plan,
    shapes: impl IntoIterator<Item = u32>,
    lane: usize,
    capacity: CapacityPreference,
    reason: &Reason,
    cfg: &PolicyConfig,
    obs: &Observation<'_>,
    now: f64,
) {
    let mut by_shape: BTreeMap<u32, u32> = BTreeMap::new();
    for g in shapes {
        *by_shape.entry(g).or_default() += 1;
    }
    for (g, n) in by_shape {
        if let Some(o) = cheapest_per_hour(obs.offerings, g, capacity, cfg, obs, now) {
            plan.actions.push(launch(lane, o, g, n, capacity, reason.clone(), cfg));
        }
    }
}

/// Shapes (GPUs per instance) of queued jobs that idle or booting workers cannot take, oldest
/// first, one entry per instance needed.
fn unmatched_shapes(obs: &Observation<'_>, cfg: &PolicyConfig) -> Vec<u32> {
    unmatched_jobs(obs, cfg)
        .into_iter()
        .flat_map(|(j, short)| std::iter::repeat_n(j.gpus_per_instance, short as usize))
        .collect()
}

/// Queued jobs that idle or booting workers cannot take, oldest first, with the instances each
/// lacks.
fn unmatched_jobs<'a>(obs: &Observation<'a>, cfg: &PolicyConfig) -> Vec<(&'a PendingJob, u32)> {
    if obs.jobs.is_empty() {
        // Most decisions: nothing queued, no need to look at the fleet.
        return Vec::new();
    }
    let mut free: Vec<(u32, f64)> = obs
        .workers
        .iter()
        .filter(|w| matches!(w.state, WorkerState::Idle | WorkerState::Pending))
        .map(|w| (w.gpus, w.gpu_memory_gib))
        .collect();
    free.sort_by_key(|f| f.0);
    // Oldest first (the simulator's queue already is: jobs are queued at the current time).
    let mut jobs: Vec<&'a PendingJob> = obs.jobs.iter().collect();
    if !jobs.is_sorted_by(|a, b| a.enqueued_at <= b.enqueued_at) {
        jobs.sort_by(|a, b| a.enqueued_at.total_cmp(&b.enqueued_at));
    }
    let mut out = Vec::new();
    // Shapes no free worker fits any more (the free list only shrinks): later jobs of such a
    // shape are short of every instance without a scan, so a long queue of jobs nothing fits
    // costs queue + free, not queue x free.
    let mut no_fit: Vec<(u32, u64)> = Vec::new();
    for j in jobs {
        let min_mem = j.min_gpu_memory_gib.max(cfg.offers.min_gpu_memory_gib);
        let shape = (j.gpus_per_instance, min_mem.to_bits());
        let mut short = 0;
        for _ in 0..j.instances.max(1) {
            let found = if no_fit.contains(&shape) {
                None
            } else {
                free.iter()
                    .position(|f| choice::fits(f.0, f.1, j.gpus_per_instance, min_mem, cfg.offers.max_gpu_oversize))
            };
            match found {
                Some(p) => {
                    free.remove(p);
                }
                None => {
                    if !no_fit.contains(&shape) {
                        no_fit.push(shape);
                    }
                    short += 1;
                }
            }
        }
        if short > 0 {
            out.push((j, short));
        }
    }
    out
}

/// KEDA-like queue-length scaler.
pub struct KedaLike {
    cfg: PolicyConfig,
    /// Messages per replica (`queueLength`). 5.
    pub queue_length: u32,
    /// Idle seconds before a worker may be removed (cooldown). 300.
    pub cooldown_s: f64,
}

impl KedaLike {
    /// With KEDA's defaults: polling 30 s, queueLength 5, cooldown 300 s.
    pub fn new(cfg: PolicyConfig) -> Self {
        Self {
            cfg,
            queue_length: 5,
            cooldown_s: 300.0,
        }
    }
}

impl Strategy for KedaLike {
    fn name(&self) -> &str {
        "keda-like"
    }
    fn longest_keep_alive_s(&self) -> f64 {
        self.cooldown_s
    }
    fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
    fn tick_s(&self) -> f64 {
        30.0
    }
    fn decides_on_submit(&self) -> bool {
        false
    }
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan {
        let mut plan = Plan::default();
        let lane = self.cfg.lane_index("standard").unwrap_or(0);
        let backlog: u32 = obs.lanes.iter().map(|l| l.backlog.total(false)).sum();
        let max = self.cfg.lanes[lane].max_workers.min(self.cfg.limits.max_workers_total);
        // A multi-instance job's pods are pending together, so Karpenter provisions all of them.
        let gang = obs.jobs.iter().map(|j| j.instances).max().unwrap_or(0);
        let desired = backlog.div_ceil(self.queue_length).max(gang).min(max) as usize;
        let live: Vec<_> = obs.workers.iter().filter(|w| w.is_live()).collect();
        // Only when below the desired count (the queue can be long: computed lazily).
        let unmatched = if desired > live.len() {
            unmatched_shapes(obs, &self.cfg)
        } else {
            Vec::new()
        };
        if !unmatched.is_empty() {
            // Karpenter provisions nodes for the pending pods: shapes of unmatched jobs.
            let shapes = unmatched.into_iter().take(desired - live.len());
            let reason = Reason::UnmetBacklog { unmet_jobs: backlog };
            launch_cheapest(
                &mut plan,
                shapes,
                lane,
                CapacityPreference::SpotFirst,
                &reason,
                &self.cfg,
                obs,
                now,
            );
            return plan;
        }
        // Scale-in after the cooldown: down to `desired`, and empty nodes no queued job fits
        // (Karpenter consolidation) even at `desired`.
        let fits_queue = |w: &WorkerView| {
            obs.jobs.iter().any(|j| {
                choice::fits(
                    w.gpus,
                    w.gpu_memory_gib,
                    j.gpus_per_instance,
                    self.cfg.offers.min_gpu_memory_gib,
                    self.cfg.offers.max_gpu_oversize,
                )
            })
        };
        let mut idle: Vec<&&WorkerView> = live.iter().filter(|w| w.state == WorkerState::Idle).collect();
        idle.sort_by(|a, b| a.idle_since.unwrap_or(now).total_cmp(&b.idle_since.unwrap_or(now)));
        let surplus = live.len().saturating_sub(desired);
        let mut removed = 0;
        for w in idle {
            let idle_s = now - w.idle_since.unwrap_or(now);
            if idle_s < self.cooldown_s {
                continue;
            }
            if removed < surplus || !fits_queue(w) {
                removed += 1;
                plan.actions.push(Action::Terminate {
                    worker: w.id.clone(),
                    reason: Reason::KeepAliveExpired {
                        idle_s,
                        keep_alive_s: self.cooldown_s,
                    },
                });
            }
        }
        plan
    }
}

/// Utilisation target tracking with a minimum of one instance.
pub struct MinOneWarm {
    cfg: PolicyConfig,
    /// Target utilisation. 0.7.
    pub target: f64,
    /// Minutes under target before scale-in. 15 (EC2 target tracking's scale-in alarm).
    pub scale_in_after_s: f64,
    below_since: Option<f64>,
}

impl MinOneWarm {
    /// With the defaults above.
    pub fn new(cfg: PolicyConfig) -> Self {
        Self {
            cfg,
            target: 0.7,
            scale_in_after_s: 900.0,
            below_since: None,
        }
    }
}

impl Strategy for MinOneWarm {
    fn name(&self) -> &str {
        "min-one-warm"
    }
    /// Its scale-in delay; the one warm worker, never released, is billed to that point.
    fn longest_keep_alive_s(&self) -> f64 {
        self.scale_in_after_s
    }
    fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
    fn tick_s(&self) -> f64 {
        60.0
    }
    fn decides_on_submit(&self) -> bool {
        false
    }
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan {
        let mut plan = Plan::default();
        let lane = self.cfg.lane_index("standard").unwrap_or(0);
        let live: Vec<_> = obs.workers.iter().filter(|w| w.is_live()).collect();
        let busy = live.iter().filter(|w| w.state == WorkerState::Running).count();
        let unmatched = unmatched_shapes(obs, &self.cfg);
        let demand = busy + unmatched.len();
        let max = self.cfg.lanes[lane].max_workers.min(self.cfg.limits.max_workers_total) as usize;
        let desired = ((demand as f64 / self.target).ceil() as usize).clamp(1, max.max(1));
        if desired > live.len() {
            self.below_since = None;
            let mut shapes = unmatched;
            shapes.resize(desired - live.len(), 1);
            let reason = Reason::UnmetBacklog {
                unmet_jobs: demand as u32,
            };
            launch_cheapest(
                &mut plan,
                shapes,
                lane,
                CapacityPreference::OnDemand,
                &reason,
                &self.cfg,
                obs,
                now,
            );
        } else if desired < live.len() {
            let since = *self.below_since.get_or_insert(now);
            if now - since >= self.scale_in_after_s {
                let mut idle: Vec<_> = live.iter().filter(|w| w.state == WorkerState::Idle).collect();
                idle.sort_by(|a, b| a.idle_since.unwrap_or(now).total_cmp(&b.idle_since.unwrap_or(now)));
                for w in idle.into_iter().take(live.len() - desired) {
                    plan.actions.push(Action::Terminate {
                        worker: w.id.clone(),
                        reason: Reason::KeepAliveExpired {
                            idle_s: now - w.idle_since.unwrap_or(now),
                            keep_alive_s: self.scale_in_after_s,
                        },
                    });
                }
            }
        } else {
            self.below_since = None;
        }
        plan
    }
}

/// A fixed fleet sized at the trace's peak need, never released.
pub struct AlwaysOn {
    cfg: PolicyConfig,
    /// Instances per GPU shape.
    pub fleet: BTreeMap<u32, u32>,
    launched: bool,
}

impl AlwaysOn {
    /// `fleet`: instances to hold per GPUs-per-instance shape (see [`crate::peak_need`]).
    pub fn new(cfg: PolicyConfig, fleet: BTreeMap<u32, u32>) -> Self {
        Self {
            cfg,
            fleet,
            launched: false,
        }
    }
}

impl Strategy for AlwaysOn {
    fn name(&self) -> &str {
        "always-on"
    }
    /// Never released: billed up to the last job's end.
    fn longest_keep_alive_s(&self) -> f64 {
        0.0
    }
    fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
    fn tick_s(&self) -> f64 {
        300.0
    }
    fn decides_on_submit(&self) -> bool {
        false
    }
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan {
        let mut plan = Plan::default();
        let lane = self.cfg.lane_index("standard").unwrap_or(0);
        if self.launched {
            return plan;
        }
        // Launch the whole fleet once, at the start.
        for (&g, &n) in &self.fleet {
            if let Some(o) = cheapest_per_hour(obs.offerings, g, CapacityPreference::OnDemand, &self.cfg, obs, now) {
                plan.actions.push(launch(
                    lane,
                    o,
                    g,
                    n,
                    CapacityPreference::OnDemand,
                    Reason::WarmPool { target: n, ready: 0 },
                    &self.cfg,
                ));
            }
        }
        self.launched = true;
        plan
    }
}

/// SkyPilot managed jobs on spot (`sky jobs launch` with `use_spot: true`), as a baseline.
///
/// - Each queued job that no idle or booting instance can take gets its own capacity (one
///   instance per node) on the cheapest eligible **spot** offering by $/h (SkyPilot's optimizer
///   ranks by hourly price; its runtime estimator is experimental), never on-demand: with spot
///   short in every zone the job waits. A failed launch falls back over other spot offerings
///   through the control plane's own fallback (SkyPilot fails over zone by zone).
/// - The controller polls its jobs every 20 s (`JOB_STATUS_CHECK_GAP_SECONDS = 20` in SkyPilot's
///   `sky/jobs/utils.py`; 15 s in later versions) and submission launches at once.
/// - A launch that found no capacity is retried for that job after a backoff: 60 s, then 1.6 x
///   longer each time up to 5 x 60 s (SkyPilot's `StrategyExecutor.RETRY_INIT_GAP_SECONDS = 60`
///   with `common_utils.Backoff`: multiplier 1.6, at most 5 x the initial gap; its +-40 % jitter
///   is left out). A job is taken as refused when it is still short of capacity at a later
///   decision. Each managed job has its own controller, so each job backs off on its own.
/// - The 2-minute notice is not acted on ([`Strategy::handles_notice`] is false): SkyPilot finds
///   a preemption by polling the cluster, so the job is requeued when its instance is gone and
///   restarts from its last periodic checkpoint (the engine's checkpoint interval; SkyPilot
///   restarts from scratch unless the job checkpoints, which we assume it does).
/// - Idle instances are stopped after [`SkyPilotLike::autostop_s`] (5 minutes; FIELD.md:
///   SkyPilot's autostop default). An idle instance takes the next queued job that fits (every
///   simulated worker pulls from the lane's queue), as a job launched onto a cluster that is up.
pub struct SkyPilotLike {
    cfg: PolicyConfig,
    /// Idle seconds before an instance is stopped. 300.
    pub autostop_s: f64,
    /// First retry gap after a launch found no capacity, seconds. 60.
    pub retry_init_gap_s: f64,
    /// Queued jobs that asked for capacity: (when the job was queued, time of the last attempt,
    /// gap before the next). A job queued again (after a preemption) starts afresh.
    retries: HashMap<String, (f64, f64, f64)>,
}

/// Growth of the retry gap per refused launch (SkyPilot's `Backoff.MULTIPLIER`).
const RETRY_MULTIPLIER: f64 = 1.6;
/// Longest retry gap as a multiple of the first (SkyPilot's `max_backoff_factor` default).
const RETRY_MAX_FACTOR: f64 = 5.0;

impl SkyPilotLike {
    /// With the 5-minute autostop and SkyPilot's retry backoff from 60 s.
    pub fn new(cfg: PolicyConfig) -> Self {
        Self {
            cfg,
            autostop_s: 300.0,
            retry_init_gap_s: 60.0,
            retries: HashMap::new(),
        }
    }
}

impl Strategy for SkyPilotLike {
    fn name(&self) -> &str {
        "skypilot-like"
    }
    fn longest_keep_alive_s(&self) -> f64 {
        self.autostop_s
    }
    fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
    fn tick_s(&self) -> f64 {
        20.0
    }
    fn decides_on_submit(&self) -> bool {
        true
    }
    fn handles_notice(&self) -> bool {
        false
    }
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan {
        let mut plan = Plan::default();
        let lane = self.cfg.lane_index("standard").unwrap_or(0);
        if self.retries.len() > 2 * obs.jobs.len() + 64 {
            // Forget jobs that left the queue.
            let queued: HashSet<&str> = obs.jobs.iter().map(|j| j.id.as_str()).collect();
            self.retries.retain(|id, _| queued.contains(id.as_str()));
        }
        let mut shapes = Vec::new();
        let mut unmet = 0;
        for (job, short) in unmatched_jobs(obs, &self.cfg) {
            unmet += 1;
            let max_gap = self.retry_init_gap_s * RETRY_MAX_FACTOR;
            let due = match self.retries.get_mut(&job.id) {
                // Still short after its last attempt: that launch was refused; retry when due.
                Some((queued, last, gap)) if *queued == job.enqueued_at => {
                    let due = now >= *last + *gap;
                    if due {
                        *last = now;
                        *gap = (*gap * RETRY_MULTIPLIER).min(max_gap);
                    }
                    due
                }
                // New in the queue, or queued again after a preemption: at once.
                _ => {
                    self.retries
                        .insert(job.id.clone(), (job.enqueued_at, now, self.retry_init_gap_s));
                    true
                }
            };
            if due {
                shapes.extend(std::iter::repeat_n(job.gpus_per_instance, short as usize));
            }
        }
        if !shapes.is_empty() {
            let reason = Reason::UnmetBacklog { unmet_jobs: unmet };
            launch_cheapest(
                &mut plan,
                shapes,
                lane,
                CapacityPreference::SpotOnly,
                &reason,
                &self.cfg,
                obs,
                now,
            );
        }
        for w in obs.workers.iter().filter(|w| w.state == WorkerState::Idle) {
            let idle_s = now - w.idle_since.unwrap_or(now);
            if idle_s >= self.autostop_s {
                plan.actions.push(Action::Terminate {
                    worker: w.id.clone(),
                    reason: Reason::KeepAliveExpired {
                        idle_s,
                        keep_alive_s: self.autostop_s,
                    },
                });
            }
        }
        plan
    }
}
