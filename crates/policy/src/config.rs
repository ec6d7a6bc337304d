//! `PolicyConfig`: every knob of the policy, with its default, unit and the source of the default.
//!
//! Loaded from TOML ([`PolicyConfig::from_toml_str`]); every field has a default, so an empty file is
//! a valid configuration. [`PolicyConfig::validate`] returns every problem at once.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::offering::{CapacityType, InterruptionBucket};

/// How far back a lane's recent arrivals reach, seconds (6 h: the longest predictive look-back a
/// lane may configure; `LaneObservation::recent_arrivals` keeps this much).
pub const RECENT_ARRIVALS_KEPT_S: f64 = 6.0 * 3600.0;

/// Half-life of a recorded arrival gap in the keep-alive statistics, seconds (one day: a day's
/// pattern weighs fully, last week's a hundredth). An assumption of ours, not a measured figure.
pub const GAP_HALF_LIFE_S: f64 = 86_400.0;

/// Which capacity types a lane launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapacityPreference {
    /// Spot and on-demand both considered, ranked by expected cost per job (spot usually wins).
    SpotFirst,
    /// Spot only (jobs wait when no spot offering is available).
    SpotOnly,
    /// On-demand only (for lanes that must not be interrupted).
    OnDemand,
}

impl CapacityPreference {
    /// Whether the lane may launch spot: only such a lane has spot workers to keep a job whose
    /// deadline is at risk off, and on-demand capacity to pin to it ([`crate::deadline`]).
    pub fn may_use_spot(self) -> bool {
        self != Self::OnDemand
    }
}

/// One window of the warm-pool schedule: `size` ready workers between `start_hour` and `end_hour` (UTC).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmWindow {
    /// First hour of the window, 0..=23, UTC.
    pub start_hour: u32,
    /// Hour the window ends (exclusive), 1..=24, UTC; a window with end <= start wraps past midnight.
    pub end_hour: u32,
    /// Ready (idle or booting) workers to hold during the window.
    pub size: u32,
}

/// A priority lane: its own queue, workers and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LaneConfig {
    /// Lane name, e.g. `express` or `standard` (the queue name suffix).
    pub name: String,
    /// Lower runs first when capacity is short. Default 1 (`express` 0).
    pub priority: u8,
    /// Capacity types the lane launches. Default spot-first (cold pool); the seed design serves the
    /// express lane from warm capacity.
    pub capacity: CapacityPreference,
    /// Maximum live workers in this lane. Default 32.
    pub max_workers: u32,
    /// Backlog (jobs) that activates a lane with no workers (0 -> 1). Default 1: a single GPU job is
    /// worth a launch. KEDA's `activationQueueLength` default is 0 (any message).
    pub activation_backlog: u32,
    /// Jobs one worker is expected to take from the backlog (1 -> N target). Default 1: a GPU worker
    /// runs one job at a time. KEDA's SQS `queueLength` default is 5.
    pub jobs_per_worker: u32,
    /// Warm pool schedule (time-of-day windows, UTC). Default empty: no warm pool.
    pub warm_pool: Vec<WarmWindow>,
    /// GPUs per instance of warm-pool workers. Default 1.
    pub warm_pool_gpus: u32,
    /// Predictive warm pool, per job shape (GPUs per instance): ready workers held for long jobs
    /// (at least `offers.short_job_horizon_s`) not yet here, sized by the newsvendor's critical
    /// fractile: the i-th worker is held while the share of recent windows that needed at least
    /// i workers is at least `W / (break-even + W)` (W = `predictive_window_s`, break-even as in
    /// `keepalive::break_even_s` for the shape's price), i.e. while its expected idle cost is below
    /// the cold starts it saves, priced with `scale_down.wait_value_usd_per_h`. At most this many
    /// per shape; 0 turns it off. Zero once nothing has arrived for the look-back, so a quiet
    /// queue costs nothing. For `warm_pool_gpus` the pool is the larger of this and the schedule.
    /// Default 40 (a cap, not a target; the README's sweep shows the cost and waits it gives).
    pub predictive_max: u32,
    /// Window of the predictive warm pool, seconds: capacity launched now is ready about one cold
    /// start later. Default 390 s (`offers.boot_estimate_s`).
    pub predictive_window_s: f64,
    /// Look-back of the predictive warm pool, seconds: the windows its fractile is taken over.
    /// Default 10,800 s (3 h); at most [`RECENT_ARRIVALS_KEPT_S`] minus the window.
    pub predictive_lookback_s: f64,
    /// Windows of the look-back that must have needed a worker before the predictive pool holds
    /// it, whatever the fractile says: a lone burst is left to the keep-alive, so one job never
    /// keeps a worker warm for hours however high the wait value. Default 2.
    pub predictive_min_bursts: u32,
    /// Launches ahead of a burst bigger than the look-back saw, per job shape: when the current
    /// window's long-job demand exceeds every earlier window of the look-back (where the
    /// fractile has nothing to go on), this many times the excess over the largest of them is
    /// launched ahead of the arrivals still to come, on the bet that the burst goes on for another
    /// window (a cold start); only when that window needs at least `predictive_burst_min`
    /// workers. Spot only in a spot-first lane, within `max_workers`; not capped by
    /// `predictive_max`, but read from the predictive pool's windows, so only while that pool is
    /// on (`predictive_max` > 0). Default 0 (off): it buys a lower p95 wait with cost, and on the
    /// bursty synthetic trace more cost than issue 12's 1.10 x bound allows. 3 gives the test half
    /// of Philly p95 241 s at 1.016 x the lower bound (334 s at 1.015 x off), the bursty trace
    /// 1.106 x (1.099 x off); 2 gives 254 s at 1.015 x and 1.0996 x; README "Launching ahead of a
    /// burst", `onoff simulate --sweep predictive_burst=0,1,2,3`.
    pub predictive_burst: f64,
    /// The least demand of the current window, in workers of one shape (its long-job arrivals),
    /// that `predictive_burst` launches ahead of: a window of fewer is no burst to bet on. A lone
    /// arrival of a rare shape (an 8-GPU job after hours without one) exceeds every earlier
    /// window too, and launching several 8-GPU workers after it was most of what the bet cost on
    /// the bursty synthetic trace. Default 12: of 1, 4, 8, 12, 16 and 24, the one with the lowest
    /// cost plus the wait's value on the train half of Philly at `predictive_burst` 2 and 3
    /// (README "Launching ahead of a burst", `--sweep predictive_burst_min=1,4,8,12,16,24`).
    pub predictive_burst_min: u32,
    /// Run time a job of this lane counts as when it declares none (`est_runtime_s`), seconds,
    /// until the lane's last jobs to finish give an estimate ([`crate::RecentRunTimes`]: their
    /// mean once 5 have finished). The lane's prior: with it a lane of short items (inference
    /// requests, a few seconds each) shares workers from its first cold start, where
    /// `offers.default_runtime_s` (an hour) would launch a GPU per queued item; once the estimate
    /// exists it replaces the prior. Like an estimate, a running job's worker is taken to end
    /// this long after its claim, until the job outlives that by `offers.short_job_horizon_s`.
    /// Default none (`offers.default_runtime_s`); must be > 0 when set. README "Run times
    /// declared or not" shows what it saves on the Azure hour.
    pub default_runtime_s: Option<f64>,
    /// How long a job of this lane may wait while full EC2 vCPU quotas leave out every offering
    /// the lane may launch for it, seconds: once it has waited this long (since its submission or
    /// its last attempt's end) and the reaper finds it so blocked, the job is ended FAILED with
    /// the quota to raise in its reason. Blocked means a quota no worker of this deployment will
    /// free (none of ours holds it, or the job's offerings would not fit even were ours all
    /// gone) and no live worker of the lane could run the job. The model is AWS Batch's
    /// `jobStateTimeLimitActions` (a job queue's action on a job RUNNABLE for a given reason for
    /// `maxTimeSeconds`, 600 to 86,400 s there; AWS Batch User Guide, "Jobs stuck in a RUNNABLE
    /// status"). Default none: the job waits until the quota is raised, as in AWS Batch without
    /// the action. Must be > 0 when set.
    pub quota_wait_limit_s: Option<f64>,
}

impl Default for LaneConfig {
    fn default() -> Self {
        Self {
            name: "standard".into(),
            priority: 1,
            capacity: CapacityPreference::SpotFirst,
            max_workers: 32,
            activation_backlog: 1,
            jobs_per_worker: 1,
            warm_pool: Vec::new(),
            warm_pool_gpus: 1,
            predictive_max: 40,
            predictive_window_s: 390.0,
            predictive_lookback_s: 10_800.0,
            predictive_min_bursts: 2,
            predictive_burst: 0.0,
            predictive_burst_min: 12,
            default_runtime_s: None,
            quota_wait_limit_s: None,
        }
    }
}

impl LaneConfig {
    /// Warm-pool size at `hour` (0..=23, UTC): the largest window covering it, 0 if none.
    pub fn warm_pool_size_at(&self, hour: u32) -> u32 {
        self.warm_pool
            .iter()
            .filter(|w| {
                if w.end_hour > w.start_hour {
                    hour >= w.start_hour && hour < w.end_hour
                } else {
                    hour >= w.start_hour || hour < w.end_hour
                }
            })
            .map(|w| w.size)
            .max()
            .unwrap_or(0)
    }
}

/// How idle workers are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeepAliveMode {
    /// Ski-rental break-even idle timeout, or, once the lane's arrival gaps are known, the timeout
    /// with the least expected cost under them for the worker's place in line (default).
    Adaptive,
    /// The seed design's cooldown with decay: keep every idle worker `warm_for_s`, then release
    /// half, the rest at `release_rest_at_s`.
    CooldownDecay,
    /// A fixed idle timeout (`fixed_idle_timeout_s`), as KEDA / Ray / SkyPilot use.
    Fixed,
}

/// Which idle workers are stopped, not terminated, when their keep-alive runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StopIdle {
    /// None: every idle worker past its keep-alive is terminated.
    Never,
    /// On-demand workers only (any EBS-backed on-demand instance can be stopped).
    OnDemand,
    /// Spot and on-demand workers: spot workers are launched from persistent spot requests that
    /// stop on interruption, the only spot instances EC2 lets you stop (default).
    SpotAndOnDemand,
}

impl StopIdle {
    /// Whether a worker of capacity type `ct` is stopped rather than terminated.
    pub fn covers(self, ct: CapacityType) -> bool {
        match self {
            StopIdle::Never => false,
            StopIdle::OnDemand => ct == CapacityType::OnDemand,
            StopIdle::SpotAndOnDemand => true,
        }
    }
}

/// Scale-down settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaleDownConfig {
    /// Keep-alive mode. Default `adaptive`.
    pub mode: KeepAliveMode,
    /// Cooldown-with-decay: idle seconds before the first release step. Default 600 s (seed design:
    /// "instances remain warm for a configurable period (default: 10 minutes)").
    pub warm_for_s: f64,
    /// Cooldown-with-decay: share released at the first step. Default 0.5 (seed: "50% at 10 min").
    pub release_fraction: f64,
    /// Cooldown-with-decay: idle seconds after which the rest is released. Default 1800 s (seed:
    /// "remaining at 30 min").
    pub release_rest_at_s: f64,
    /// Fixed mode: idle timeout, seconds. Default 600 s (the seed write-up's SCALE_DOWN_DELAY).
    pub fixed_idle_timeout_s: f64,
    /// Adaptive: what one hour of a job waiting for a cold start costs you, $/h. Added to the
    /// cold-start cost B of the ski-rental break-even T = B / r, so T = boot x (1 + this / price);
    /// the keep-alive and the predictive warm pool both weigh idle cost against waits with it.
    /// Default 1.0 $/h (an assumption, set it to your own figure; 0 = pure billed-cost ski
    /// rental, which gives T = boot time). `onoff simulate --sweep wait_value_usd_per_h=...`
    /// shows the cost and waits of each value on your trace.
    pub wait_value_usd_per_h: f64,
    /// Adaptive: gaps needed before the histogram is trusted; below it break-even alone is used,
    /// above it the timeout with the least expected cost under the gaps
    /// (`keepalive::cost_optimal_timeout_s`). Default 20.
    pub min_gap_samples: u64,
    /// Lower bound of any keep-alive, seconds. Default 60 s: EC2 bills a 60-second minimum, so an
    /// earlier release saves nothing.
    pub min_keep_alive_s: f64,
    /// Upper bound of the adaptive keep-alive, seconds. Default 3600 s.
    pub max_keep_alive_s: f64,
    /// Which idle workers are stopped instead of terminated when their keep-alive runs out (the
    /// running / stopped / terminated multislope ski rental, FIELD.md): a stopped worker costs
    /// its volume only ([`ScaleDownConfig::stopped_usd_per_h`]) and starts again in
    /// `offers.restart_estimate_s` instead of a cold start. It is kept stopped while its volume
    /// costs less than the cold start it may save (`keepalive::stopped_keep_s`), then terminated.
    /// Default `spot-and-on-demand`.
    pub stop_idle: StopIdle,
    /// The GiB of a worker's EBS volume, which a stopped worker keeps and is billed for. Default
    /// 100 GiB: the stack's root volume (`WorkerRootVolumeGiB`, which template.yaml sets here).
    pub stopped_volume_gib: f64,
    /// What the volume costs, $ per GB-month. Default $0.08: gp3 in us-east-1 (Amazon EBS
    /// pricing), the stack's volume type.
    pub volume_usd_per_gb_month: f64,
    /// Upper bound of a stopped worker's keep, seconds. Default 86,400 s (one day).
    pub max_stopped_s: f64,
}

impl ScaleDownConfig {
    /// What a stopped worker costs, $/h: its volume, `stopped_volume_gib x
    /// volume_usd_per_gb_month / 730` (EBS bills per GB-month, 730 hours; 0.011 $/h at the
    /// defaults).
    pub fn stopped_usd_per_h(&self) -> f64 {
        self.stopped_volume_gib * self.volume_usd_per_gb_month / 730.0
    }
}

impl Default for ScaleDownConfig {
    fn default() -> Self {
        Self {
            mode: KeepAliveMode::Adaptive,
            warm_for_s: 600.0,
            release_fraction: 0.5,
            release_rest_at_s: 1800.0,
            fixed_idle_timeout_s: 600.0,
            wait_value_usd_per_h: 1.0,
            min_gap_samples: 20,
            min_keep_alive_s: 60.0,
            max_keep_alive_s: 3600.0,
            stop_idle: StopIdle::SpotAndOnDemand,
            stopped_volume_gib: 100.0,
            volume_usd_per_gb_month: 0.08,
            max_stopped_s: 86_400.0,
        }
    }
}

/// Anti-thrash settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AntiThrashConfig {
    /// Hysteresis, upper band: unmet jobs in a lane needed before it scales up. Default 1.
    pub scale_up_unmet_jobs: u32,
    /// Hysteresis, lower band: idle workers are released only while the lane's backlog (visible +
    /// in flight) is at most this. Default: unlimited (`u32::MAX`), since idle workers that could
    /// serve the backlog are never idle for long.
    pub scale_down_max_backlog: u32,
    /// No scale-down in a lane this long after its last launch, seconds. Default 120 s
    /// (Karpenter #3059 asks for such a delay; Cluster Autoscaler uses 600 s).
    pub scale_down_delay_after_scale_up_s: f64,
    /// Evaluation window: a job must have waited this long before it causes a launch, seconds.
    /// Default 0 s: a GPU job is worth a launch at once.
    pub scale_up_window_s: f64,
    /// Minimum run time of a worker before it may be released, seconds. Default 60 s (EC2 per-second
    /// billing has a 60-second minimum).
    pub min_runtime_s: f64,
}

impl Default for AntiThrashConfig {
    fn default() -> Self {
        Self {
            scale_up_unmet_jobs: 1,
            scale_down_max_backlog: u32::MAX,
            scale_down_delay_after_scale_up_s: 120.0,
            scale_up_window_s: 0.0,
            min_runtime_s: 60.0,
        }
    }
}

/// Offering filter and cost model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OfferConfig {
    /// Minimum GPU memory per GPU, GiB, for every job (a job may ask for more). Default 16 GiB
    /// (assumption: the 12-24 GiB P100/P40 class the Philly trace's jobs ran on).
    pub min_gpu_memory_gib: f64,
    /// Highest price accepted, $/h. Default none.
    pub max_price_usd_per_h: Option<f64>,
    /// Least reliable spot interruption bucket accepted. Default none (all; the cost model prices
    /// interruptions in).
    pub max_interruption: Option<InterruptionBucket>,
    /// Instance types allowed (empty = all in the catalogue). Default empty.
    pub allowed_instance_types: Vec<String>,
    /// Largest ratio of instance GPUs to the GPUs a job asks for (rounded up to a power of two)
    /// that may serve it; see [`crate::shape::fits`]. Default 1: no job runs on an instance with
    /// twice the GPUs it needs (measured: allowing 2 cost more on the Philly week, see README),
    /// unless the allowed types have no such instance at all: then the next size up
    /// ([`crate::choice::schedule_gpus`]).
    pub max_gpu_oversize: u32,
    /// Spread one launch over up to this many offerings. Default 3.
    pub diversify: u32,
    /// Offerings within this fraction of the best expected cost per job take part in the spread.
    /// Default 0.15.
    pub diversify_tolerance: f64,
    /// How long an offering that failed with a capacity error is skipped, seconds. Default 180 s
    /// (Karpenter marks an interrupted offering unavailable for 3 minutes).
    pub unavailable_ttl_s: f64,
    /// Expected cold start of a GPU worker (boot, image pull, model load), seconds. Default 390 s,
    /// the middle of the seed's "3-10 minutes".
    pub boot_estimate_s: f64,
    /// Expected start of a stopped worker until it can take a job, seconds: EC2's start, the OS
    /// and the agent, the model loaded from the volume it kept (no image pull, no model
    /// download). Default 120 s, an assumption: the middle of 60-180 s, a third of the cold
    /// start's middle (the simulator draws restarts from `--restart-min-s`/`--restart-max-s`).
    pub restart_estimate_s: f64,
    /// Checkpoint interval assumed for jobs, seconds; an interruption loses half of it on average.
    /// Default 600 s.
    pub checkpoint_interval_s: f64,
    /// Run time assumed for a job that declares none, seconds. Default 3600 s.
    pub default_runtime_s: f64,
    /// Jobs shorter than this share workers instead of each causing a launch: they queue behind
    /// each other on one worker until their run times add up to it, seconds. So a stream of
    /// one-second inference items does not launch a GPU per item. Default 120 s (a short job waits
    /// at most about two minutes behind others, well under a 3-10 minute cold start); 0 = off.
    pub short_job_horizon_s: f64,
    /// Relative speed of a GPU model against the trace's reference GPU (`"NVIDIA A10G" = 1.3`);
    /// runtime on that type = runtime / speed. Models not listed have speed 1.0. Default empty.
    pub gpu_speed: BTreeMap<String, f64>,
}

impl Default for OfferConfig {
    fn default() -> Self {
        Self {
            min_gpu_memory_gib: 16.0,
            max_price_usd_per_h: None,
            max_interruption: None,
            allowed_instance_types: Vec::new(),
            max_gpu_oversize: 1,
            diversify: 3,
            diversify_tolerance: 0.15,
            unavailable_ttl_s: 180.0,
            boot_estimate_s: 390.0,
            restart_estimate_s: 120.0,
            checkpoint_interval_s: 600.0,
            default_runtime_s: 3600.0,
            short_job_horizon_s: 120.0,
            gpu_speed: BTreeMap::new(),
        }
    }
}

/// Quota of one project.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProjectQuota {
    /// Maximum GPUs the project may hold at once (running + booting for it). Default none.
    pub max_gpus: Option<u32>,
    /// Fair-share weight against other projects when capacity is short. Default 1.0.
    pub weight: f64,
}

impl Default for ProjectQuota {
    fn default() -> Self {
        Self {
            max_gpus: None,
            weight: 1.0,
        }
    }
}

/// Quotas, caps and budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Maximum live workers over all lanes. Default 64.
    pub max_workers_total: u32,
    /// Per-project quotas; projects not listed get `ProjectQuota::default()`.
    pub projects: BTreeMap<String, ProjectQuota>,
    /// Maximum concurrent jobs (running + launching for) per job type. Default none.
    pub job_type_caps: BTreeMap<String, u32>,
    /// Budget circuit breaker: no launch may take the fleet's spend rate above this, $/h; above it
    /// idle workers are released at once. Default none.
    pub max_usd_per_h: Option<f64>,
    /// Manual freeze: no launches at all. Default false.
    pub frozen: bool,
    /// Deadline safety margin, seconds: a job whose slack (deadline - now - expected runtime) is
    /// below two cold starts (one after an interruption, one on on-demand) + one checkpoint
    /// interval + this margin is launched on on-demand (the Can't Be Late rule). Default 600 s
    /// (the spread of the seed's 3-10 minute cold starts around `offers.boot_estimate_s`).
    pub deadline_margin_s: f64,
    /// Count SQS delayed messages in the backlog. Default false (KEDA's `scaleOnDelayed` default).
    pub count_delayed: bool,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_workers_total: 64,
            projects: BTreeMap::new(),
            job_type_caps: BTreeMap::new(),
            max_usd_per_h: None,
            frozen: false,
            deadline_margin_s: 600.0,
            count_delayed: false,
        }
    }
}

/// Every knob of the policy. See each field's type for defaults and their sources.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Lanes, highest priority first. Default: `express` (warm capacity, on-demand) and `standard`
    /// (spot-first cold pool).
    pub lanes: Vec<LaneConfig>,
    /// Scale-down (keep-alive) settings.
    pub scale_down: ScaleDownConfig,
    /// Anti-thrash settings.
    pub anti_thrash: AntiThrashConfig,
    /// Offering filter and cost model.
    pub offers: OfferConfig,
    /// Quotas, caps, budget, deadlines.
    pub limits: LimitsConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            lanes: vec![
                LaneConfig {
                    name: "express".into(),
                    priority: 0,
                    capacity: CapacityPreference::OnDemand,
                    max_workers: 8,
                    ..LaneConfig::default()
                },
                LaneConfig::default(),
            ],
            scale_down: ScaleDownConfig::default(),
            anti_thrash: AntiThrashConfig::default(),
            offers: OfferConfig::default(),
            limits: LimitsConfig::default(),
        }
    }
}

/// True for a finite number > 0 (false for NaN).
fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// A configuration problem: which field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct ConfigProblem {
    /// Dotted path of the field, e.g. `lanes[1].max_workers`.
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

/// Errors of loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The TOML did not parse or had an unknown key / wrong type.
    #[error("policy config is not valid TOML for PolicyConfig: {0}")]
    Parse(#[from] toml::de::Error),
    /// The values parsed but are inconsistent.
    #[error("policy config is invalid:\n  - {}", .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n  - "))]
    Invalid(Vec<ConfigProblem>),
}

impl PolicyConfig {
    /// Parse TOML (missing keys take their defaults) and validate.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] for bad TOML or unknown keys, [`ConfigError::Invalid`] listing every problem.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: PolicyConfig = toml::from_str(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Index of the lane called `name`.
    pub fn lane_index(&self, name: &str) -> Option<usize> {
        self.lanes.iter().position(|l| l.name == name)
    }

    /// Quota of `project` (the default quota when it is not listed).
    pub fn project_quota(&self, project: &str) -> ProjectQuota {
        self.limits.projects.get(project).cloned().unwrap_or_default()
    }

    /// Check every value; returns all problems at once.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] with one [`ConfigProblem`] per bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Vec::new();
        let mut bad = |field: String, problem: &str| {
            p.push(ConfigProblem {
                field,
                problem: problem.to_string(),
            })
        };
        if self.lanes.is_empty() {
            bad("lanes".into(), "at least one lane is needed");
        }
        for (i, l) in self.lanes.iter().enumerate() {
            // The name is a tag value on the lane's instances (`onoff:lane`, at most 256
            // characters) and the active index's partition key: a short name of plain
            // characters, as a job's project is.
            if !is_plain_name(&l.name) {
                bad(
                    format!("lanes[{i}].name"),
                    "must be 1-64 characters of A-Z a-z 0-9 - _ .",
                );
            }
            if self.lanes[..i].iter().any(|o| o.name == l.name) {
                bad(format!("lanes[{i}].name"), "duplicate lane name");
            }
            if l.jobs_per_worker == 0 {
                bad(format!("lanes[{i}].jobs_per_worker"), "must be >= 1");
            }
            if l.warm_pool_gpus == 0 {
                bad(format!("lanes[{i}].warm_pool_gpus"), "must be >= 1");
            }
            if !(l.predictive_burst.is_finite() && l.predictive_burst >= 0.0) {
                bad(format!("lanes[{i}].predictive_burst"), "must be a number >= 0");
            }
            if !positive(l.predictive_window_s) {
                bad(format!("lanes[{i}].predictive_window_s"), "must be > 0");
            }
            if l.default_runtime_s.is_some_and(|r| !positive(r)) {
                bad(format!("lanes[{i}].default_runtime_s"), "must be > 0 when set");
            }
            if l.quota_wait_limit_s.is_some_and(|r| !positive(r)) {
                bad(format!("lanes[{i}].quota_wait_limit_s"), "must be > 0 when set");
            }
            if !(l.predictive_lookback_s >= 0.0
                && l.predictive_lookback_s + l.predictive_window_s <= RECENT_ARRIVALS_KEPT_S)
            {
                bad(
                    format!("lanes[{i}].predictive_lookback_s"),
                    "must be >= 0, and with predictive_window_s at most 21600 s (the arrivals kept)",
                );
            }
            for (j, w) in l.warm_pool.iter().enumerate() {
                if w.start_hour > 23 || w.end_hour > 24 || w.end_hour == 0 {
                    bad(
                        format!("lanes[{i}].warm_pool[{j}]"),
                        "start_hour must be 0..=23 and end_hour 1..=24",
                    );
                }
                if w.size > l.max_workers {
                    bad(
                        format!("lanes[{i}].warm_pool[{j}].size"),
                        "exceeds the lane's max_workers",
                    );
                }
            }
        }
        let s = &self.scale_down;
        let nonneg = |v: f64| v.is_finite() && v >= 0.0;
        for (name, v) in [
            ("scale_down.warm_for_s", s.warm_for_s),
            ("scale_down.release_rest_at_s", s.release_rest_at_s),
            ("scale_down.fixed_idle_timeout_s", s.fixed_idle_timeout_s),
            ("scale_down.wait_value_usd_per_h", s.wait_value_usd_per_h),
            ("scale_down.min_keep_alive_s", s.min_keep_alive_s),
            ("scale_down.max_keep_alive_s", s.max_keep_alive_s),
            ("scale_down.stopped_volume_gib", s.stopped_volume_gib),
            ("scale_down.volume_usd_per_gb_month", s.volume_usd_per_gb_month),
            ("scale_down.max_stopped_s", s.max_stopped_s),
            (
                "anti_thrash.scale_down_delay_after_scale_up_s",
                self.anti_thrash.scale_down_delay_after_scale_up_s,
            ),
            ("anti_thrash.scale_up_window_s", self.anti_thrash.scale_up_window_s),
            ("anti_thrash.min_runtime_s", self.anti_thrash.min_runtime_s),
            ("offers.min_gpu_memory_gib", self.offers.min_gpu_memory_gib),
            ("offers.diversify_tolerance", self.offers.diversify_tolerance),
            ("offers.unavailable_ttl_s", self.offers.unavailable_ttl_s),
            ("offers.boot_estimate_s", self.offers.boot_estimate_s),
            ("offers.restart_estimate_s", self.offers.restart_estimate_s),
            ("offers.checkpoint_interval_s", self.offers.checkpoint_interval_s),
            ("offers.short_job_horizon_s", self.offers.short_job_horizon_s),
            ("limits.deadline_margin_s", self.limits.deadline_margin_s),
        ] {
            if !nonneg(v) {
                bad(name.into(), "must be a finite number >= 0");
            }
        }
        if s.release_rest_at_s < s.warm_for_s {
            bad(
                "scale_down.release_rest_at_s".into(),
                "must be >= scale_down.warm_for_s",
            );
        }
        if !(0.0..=1.0).contains(&s.release_fraction) {
            bad("scale_down.release_fraction".into(), "must be within 0..=1");
        }
        if s.max_keep_alive_s < s.min_keep_alive_s {
            bad(
                "scale_down.max_keep_alive_s".into(),
                "must be >= scale_down.min_keep_alive_s",
            );
        }
        if !positive(self.offers.default_runtime_s) {
            bad("offers.default_runtime_s".into(), "must be > 0");
        }
        if self.offers.max_gpu_oversize == 0 {
            bad("offers.max_gpu_oversize".into(), "must be >= 1");
        }
        if self.offers.diversify == 0 {
            bad("offers.diversify".into(), "must be >= 1");
        }
        if let Some(m) = self.offers.max_price_usd_per_h {
            if !positive(m) {
                bad("offers.max_price_usd_per_h".into(), "must be > 0");
            }
        }
        for (k, v) in &self.offers.gpu_speed {
            if !(v.is_finite() && *v > 0.0) {
                bad(format!("offers.gpu_speed.\"{k}\""), "must be > 0");
            }
        }
        if self.limits.max_workers_total == 0 {
            bad("limits.max_workers_total".into(), "must be >= 1");
        }
        if let Some(m) = self.limits.max_usd_per_h {
            if !positive(m) {
                bad("limits.max_usd_per_h".into(), "must be > 0");
            }
        }
        for (k, q) in &self.limits.projects {
            if !(q.weight.is_finite() && q.weight > 0.0) {
                bad(format!("limits.projects.{k}.weight"), "must be > 0");
            }
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(p))
        }
    }
}

/// Whether `name` is 1-64 characters of `A-Z a-z 0-9 - _ .`: the rule for a lane's name, a job's
/// project and job type (`JobSpec::parse`). Such a name fits a tag value (256 characters), a
/// DynamoDB key, a file name, and is never `.` or `..` behind a prefix.
pub fn is_plain_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}
