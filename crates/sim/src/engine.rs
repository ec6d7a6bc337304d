//! The discrete-event engine: a virtual clock, a simulated fleet, and a strategy deciding.
//!
//! Events (arrival, boot done, job done, spot notice, spot interruption, decision tick) are
//! processed in time order. Decisions run the strategy's `decide`, and plans are carried out by
//! the real [`onoff_control::act()`] through simulated ports, so capacity-error fallback, the
//! unavailable-offering TTL and the interruption-notice handling are the control plane's own code.
//!
//! Billing follows EC2 Linux: per second from launch (boot and model load included) to
//! termination, with a 60-second minimum.
//!
//! Spot interruptions come from one of two models ([`Preemptions`]): random draws at the Spot
//! Advisor bucket rates, or measured per-zone series replayed over the span
//! ([`crate::preemption`]), which also refuse spot launches in a zone while its series says spot
//! is unavailable. Deadlines ([`SimConfig::deadline_fraction`]) are handed to the strategy in
//! [`PendingJob::deadline`] and measured: a job misses its deadline when it finishes after it, or
//! never.
//!
//! Every step is linear in the events it handles: arrivals are read from the sorted trace, a zone
//! flip looks at each worker once, deadlines are drawn once per run, and a worker's drawn
//! interruption leaves the agenda with the worker (`agenda.rs`).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use onoff_control::ports::{
    Decimal, Fleet, FleetError, FleetErrorKind, LaunchRequest, LaunchResult, Launched, OfferingAvailability,
    StoreError, WorkerRecord, WorkerRegistry,
};
use onoff_control::{act, handle_interruption_notice, ActContext};
use onoff_policy::choice::{self, fits, speed, worth_an_on_demand_worker};
use onoff_policy::deadline::keeps_off_spot;
use onoff_policy::{
    CapacityType, DemandWindows, FleetHint, LaneObservation, Observation, Offering, OfferingKey, PendingJob, Plan,
    PolicyConfig, Reason, RecentRunTimes, UnavailableOffering, WorkerState, WorkerView,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::agenda::{self, Agenda};
use crate::fleet_index::{brief, FleetIndex};
use crate::preemption::{MeasuredPreemptions, ZoneMapping};
use crate::trace::Trace;

/// Where spot interruptions come from.
#[derive(Debug, Clone, Default)]
pub enum Preemptions {
    /// Random interruptions at the Spot Instance Advisor bucket's rate of each offering (bucket
    /// midpoint per month, [`onoff_policy::InterruptionBucket::rate_per_s`]), times
    /// [`SimConfig::interruption_rate_factor`]. The default.
    #[default]
    Advisor,
    /// Measured per-zone availability series replayed over the span ([`crate::preemption`]):
    /// interruptions when a zone turns unavailable, spot launches refused while it is.
    Measured(Arc<MeasuredPreemptions>),
}

impl Preemptions {
    /// `advisor` or `skypilot`.
    pub fn name(&self) -> &'static str {
        match self {
            Preemptions::Advisor => "advisor",
            Preemptions::Measured(_) => "skypilot",
        }
    }

    /// The zone mapping the engine uses for `offerings` (empty for the advisor model).
    pub fn zone_mapping(&self, offerings: &[Offering]) -> Vec<ZoneMapping> {
        match self {
            Preemptions::Advisor => Vec::new(),
            Preemptions::Measured(m) => m.map_zones(&zone_names(offerings)),
        }
    }
}

impl Serialize for Preemptions {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Preemptions::Advisor => s.serialize_str("advisor"),
            Preemptions::Measured(m) => s.serialize_str(&format!("skypilot:{}", m.source)),
        }
    }
}

/// Zone names of `offerings`, sorted, each once.
fn zone_names(offerings: &[Offering]) -> Vec<String> {
    let mut z: Vec<String> = offerings.iter().map(|o| o.key.zone.clone()).collect();
    z.sort();
    z.dedup();
    z
}

/// Simulation settings (the world, not the policy).
#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    /// RNG seed: same seed, same run.
    pub seed: u64,
    /// Shortest cold start, seconds. Default 180 s (seed: GPU cold start "3-10 minutes").
    pub boot_min_s: f64,
    /// Longest cold start, seconds; boot times are uniform between the two. Default 600 s.
    pub boot_max_s: f64,
    /// Shortest start of a stopped worker until it takes a job, seconds: no image pull and no model
    /// download, the volume kept both. Default 60 s (an assumption: EC2's start of a stopped
    /// instance, the OS and the agent, the model loaded from the volume).
    pub restart_min_s: f64,
    /// Longest start of a stopped worker, seconds; starts are uniform between the two. Default
    /// 180 s (an assumption, as `restart_min_s`; `onoff simulate --restart-min-s/--restart-max-s`
    /// replays other figures).
    pub restart_max_s: f64,
    /// Seconds a stopped worker's instance stays stopping: a start within them is refused as EC2
    /// refuses StartInstances on an instance not yet stopped (`IncorrectInstanceState`; not a
    /// capacity error), and `control::act` launches instead. EC2 takes what its User Guide calls
    /// several minutes to stop an instance (docs/control-plane.md, "A stop takes time"). Default
    /// 0: a stop is instant, as the README's figures were measured; `onoff simulate
    /// --stopping-s` replays another figure.
    pub stopping_s: f64,
    /// What a stopped worker costs, $/h: its EBS volume, billed from its stop to its start or
    /// termination. Default 0.011 $/h: a 100 GiB gp3 volume at $0.08 per GB-month (Amazon EBS
    /// pricing, us-east-1) over 730 hours.
    pub stopped_usd_per_h: f64,
    /// Probability that one launch call fails with InsufficientCapacity (and that one start of
    /// a stopped worker does). Default 0.02 (assumption).
    pub capacity_error_rate: f64,
    /// Spot interruptions (either model). Default true. With `false` and measured preemptions,
    /// spot launches are still refused while a zone's series says unavailable.
    pub interruptions: bool,
    /// Multiplier on the bucket interruption rates (stress tests; advisor model only). Default 1.0.
    pub interruption_rate_factor: f64,
    /// Interruption model. Default [`Preemptions::Advisor`].
    pub preemptions: Preemptions,
    /// Share of jobs (0..=1) given a deadline, chosen by the seed ([`assign_deadlines`]). Default 0.
    pub deadline_fraction: f64,
    /// A job's deadline is its arrival + this x its run time on the reference GPU. Default 1.5
    /// (an assumption: half the run time again as slack; boot and queueing must fit in it).
    pub deadline_slack: f64,
    /// Spot interruption notice, seconds. Default 120 s (EC2's two-minute warning).
    pub notice_s: f64,
    /// Jobs checkpoint every this many seconds of run time. Default 600 s.
    pub checkpoint_interval_s: f64,
    /// Jobs also checkpoint when the notice arrives (then an interruption loses nothing).
    /// Default false: only periodic checkpoints count, the conservative case.
    pub checkpoint_on_notice: bool,
    /// GPUs of the largest instance a job may use; larger jobs run on several instances at once.
    /// Default 8.
    pub max_gpus_per_instance: u32,
    /// Lane every trace job is submitted to. Default `standard`.
    pub lane: String,
    /// Give up this long after the last arrival (jobs still unfinished count as lost), seconds.
    /// Default 60 days.
    pub horizon_after_last_arrival_s: f64,
    /// Record a per-minute timeline (for `--out`). Default false.
    pub timeline: bool,
    /// Whether each job declares its run time (`est_runtime_s`), exactly as the trace has it, so
    /// the policy reads it: the short-job share of a worker, the predictive pool's long jobs, the
    /// running workers' ends (`busy_until`). Default true (how the README's figures were
    /// measured). `false` replays jobs that declare nothing, as a deployment sees them when its
    /// users do not set it (`onoff simulate --undeclared-runtimes`).
    pub declared_runtimes: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            boot_min_s: 180.0,
            boot_max_s: 600.0,
            restart_min_s: 60.0,
            restart_max_s: 180.0,
            stopping_s: 0.0,
            stopped_usd_per_h: 100.0 * 0.08 / 730.0,
            capacity_error_rate: 0.02,
            interruptions: true,
            interruption_rate_factor: 1.0,
            preemptions: Preemptions::Advisor,
            deadline_fraction: 0.0,
            deadline_slack: 1.5,
            notice_s: 120.0,
            checkpoint_interval_s: 600.0,
            checkpoint_on_notice: false,
            max_gpus_per_instance: 8,
            lane: "standard".into(),
            horizon_after_last_arrival_s: 60.0 * 86_400.0,
            timeline: false,
            declared_runtimes: true,
        }
    }
}

/// A strategy under test: the onoff policy or a baseline.
pub trait Strategy {
    /// Name in reports.
    fn name(&self) -> &str;
    /// The policy config it runs with (lanes, offer settings for `act`).
    fn config(&self) -> &PolicyConfig;
    /// Seconds between scheduled decisions.
    fn tick_s(&self) -> f64;
    /// Whether a submission triggers a decision at once (onoff's submit invokes the scaler).
    fn decides_on_submit(&self) -> bool;
    /// The longest a worker of this strategy stays up after its last job, seconds: how long the
    /// replay goes on, and bills, after the last job ends (see [`run`]). 0 for a fleet that is
    /// never released (billed up to the last job's end: its standing cost over the trace).
    fn longest_keep_alive_s(&self) -> f64;
    /// Decide.
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan;
    /// A replay starts: forget whatever was kept from another one (a strategy may be run again,
    /// over another catalogue). Default: nothing is kept.
    fn start_run(&mut self) {}
    /// Whether the 2-minute spot notice reaches the control plane (onoff's interruption handler:
    /// the worker drains, its job is released for resume, the offering is skipped for a while).
    /// Default true; a strategy that only notices a lost instance later says false, and its job
    /// is requeued when the instance is gone.
    fn handles_notice(&self) -> bool {
        true
    }
    /// Whether its workers run onoff's agent, which keeps a job whose deadline is at risk off
    /// spot workers ([`onoff_policy::deadline::keeps_off_spot`]) and claims the job a worker was
    /// launched for first. Default false: a baseline's workers take the oldest job that fits.
    fn runs_onoff_agent(&self) -> bool {
        false
    }
}

/// One row of the per-minute timeline.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineRow {
    /// Minutes since the first arrival.
    pub minute: u64,
    /// Jobs queued (not running).
    pub backlog: u32,
    /// Jobs running.
    pub running_jobs: u32,
    /// Workers booting.
    pub pending: u32,
    /// Workers running a job.
    pub busy: u32,
    /// Workers idle.
    pub idle: u32,
    /// Workers draining.
    pub draining: u32,
    /// Workers stopped (their volumes kept).
    pub stopped: u32,
    /// Spend rate, $/h.
    pub usd_per_h: f64,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Strategy name.
    pub name: String,
    /// Total billed, $, the keep-alive after the last job included (see [`run`]).
    pub total_usd: f64,
    /// `total_usd / jobs_completed`.
    pub usd_per_job: f64,
    /// Part of `total_usd` billed on on-demand instances, $ (the rest is spot).
    pub on_demand_usd: f64,
    /// GPU-hours of workers that were ready with no job.
    pub idle_gpu_hours: f64,
    /// GPU-hours billed while booting.
    pub boot_gpu_hours: f64,
    /// Part of `total_usd` billed while workers were idle, $.
    pub idle_usd: f64,
    /// Part of `total_usd` billed after the last job ended, while workers idled out their
    /// keep-alive (or booted for a warm pool), $: 0 for a fleet never released.
    pub keep_alive_tail_usd: f64,
    /// Part of `total_usd` billed while workers were booting, $.
    pub boot_usd: f64,
    /// Instances launched.
    pub launches: u64,
    /// Stopped workers started again (not counted in `launches`).
    pub restarts: u64,
    /// Part of `total_usd` billed for stopped workers' volumes, $.
    pub stopped_usd: f64,
    /// Instances launched per `type/capacity-type`.
    pub launches_by_offering: std::collections::BTreeMap<String, u64>,
    /// What each `type/capacity-type` was billed, $ and instance-hours (booting, busy and idle
    /// alike): where `total_usd` went.
    pub spend_by_offering: std::collections::BTreeMap<String, OfferingSpend>,
    /// Launch calls that failed with a capacity error.
    pub capacity_errors: u64,
    /// Of `capacity_errors`, spot launches refused because the zone's measured series said spot
    /// was unavailable (measured preemptions only).
    pub spot_unavailable_errors: u64,
    /// Median wait from arrival to first start, seconds.
    pub wait_p50_s: f64,
    /// 95th percentile wait, seconds.
    pub wait_p95_s: f64,
    /// 99th percentile wait, seconds.
    pub wait_p99_s: f64,
    /// Mean wait, seconds.
    pub wait_mean_s: f64,
    /// Jobs that finished.
    pub jobs_completed: u64,
    /// Jobs that never finished (must be 0).
    pub jobs_lost: u64,
    /// Spot interruptions of workers.
    pub interruptions: u64,
    /// Work lost to interruptions (since the last checkpoint), GPU-hours.
    pub lost_work_gpu_hours: f64,
    /// Busy workers the strategy terminated (onoff: must be 0).
    pub busy_terminations: u64,
    /// Decisions taken.
    pub decisions: u64,
    /// Decisions that held back a launch for a configured limit rather than by the policy's
    /// choice, per limit (`max workers N`, `budget cap X $/h`, a project's quota, a job type's cap,
    /// `freeze`). Empty when no limit ever bound; when one binds in many decisions, the waits are
    /// the limit's, not the policy's.
    pub held_by_limit: BTreeMap<String, u64>,
    /// Virtual seconds from the first arrival to the last completion (billing may go on after it,
    /// while workers idle out their keep-alive).
    pub makespan_s: f64,
    /// Jobs that had a deadline.
    pub deadline_jobs: u64,
    /// Jobs with a deadline that finished after it, or never finished.
    pub deadlines_missed: u64,
    /// Jobs whose deadline leaves less slack than the shortest cold start (`deadline - arrival -
    /// run time < boot_min_s`): met only by starting on a worker already up.
    pub deadlines_need_warm: u64,
    /// Jobs whose deadline leaves at least the longest cold start of slack (`deadline - arrival -
    /// run time >= boot_max_s`): met by any launch at arrival that is not interrupted.
    pub deadlines_with_slack: u64,
    /// Of those, the ones that missed: what the policy, not the cold start, lost.
    pub deadlines_missed_with_slack: u64,
    /// `total_usd` over the cost of `all-on-demand` on the same trace (filled by
    /// [`crate::compare`] when deadlines are on): below 1 is what spot saved.
    pub cost_vs_all_on_demand: Option<f64>,
    /// Wall-clock seconds the replay took (a measurement of this machine, not of the policy).
    pub wall_s: f64,
    /// Per-minute timeline, when recorded.
    #[serde(skip)]
    pub timeline: Vec<TimelineRow>,
    /// Each started job's wait, in trace order, recorded with the timeline.
    #[serde(skip)]
    pub job_waits: Vec<JobWait>,
}

/// One offering's share of a run's bill.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OfferingSpend {
    /// Billed, $.
    pub usd: f64,
    /// Instance-hours billed.
    pub instance_hours: f64,
}

/// Sums per `type/capacity-type` label from per-offering (index) sums of ($, seconds).
fn spend_by_offering(labels: &[String], billed: &[(f64, f64)]) -> std::collections::BTreeMap<String, OfferingSpend> {
    let mut out = std::collections::BTreeMap::<String, OfferingSpend>::new();
    for (label, &(usd, s)) in labels.iter().zip(billed).filter(|(_, b)| b.1 > 0.0) {
        let e = out.entry(label.clone()).or_insert(OfferingSpend {
            usd: 0.0,
            instance_hours: 0.0,
        });
        e.usd += usd;
        e.instance_hours += s / 3600.0;
    }
    out
}

/// One job's wait from arrival to its first start (recorded with [`SimConfig::timeline`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct JobWait {
    /// The trace job's id ([`crate::TraceJob::id`]).
    pub job: u64,
    /// Arrival, seconds after the trace's first.
    pub arrival_s: f64,
    /// GPUs asked for.
    pub gpus: u32,
    /// Instances it ran on at once.
    pub instances: u32,
    /// Run time on the reference GPU, seconds.
    pub run_s: f64,
    /// Seconds from arrival to first start.
    pub wait_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ev {
    Arrival(usize),
    BootDone(u64),
    JobDone {
        job: usize,
        epoch: u32,
    },
    Notice(u64),
    Interrupt(u64),
    /// A zone's measured series changes value (index into the world's zone clocks).
    ZoneFlip(usize),
    Tick,
}

/// An event popped from the agenda (or an arrival from the trace).
#[derive(Debug, Clone, Copy)]
struct Event {
    at: f64,
    ev: Ev,
}

/// The id the policy sees for the trace's job `index`.
fn job_id(index: usize) -> String {
    format!("job-{index}")
}

/// The trace index of a job id made by [`job_id`].
fn job_index(id: &str) -> Option<usize> {
    id.strip_prefix("job-")?.parse().ok()
}

/// The instance id of simulated worker `num`: `i-sim` and its number in at least ten digits, as
/// `format!("i-sim{num:010}")` gives it, without the formatting machinery (one per launch, and
/// [`worker_num`] reads the number back instead of a map from ids).
fn instance_id(num: u64) -> String {
    let digits = Decimal::new(num);
    let digits = digits.as_bytes();
    let mut id = String::with_capacity(15);
    id.push_str("i-sim");
    id.extend(std::iter::repeat_n('0', 10usize.saturating_sub(digits.len())));
    id.extend(digits.iter().map(|&d| char::from(d)));
    id
}

/// The worker number an [`instance_id`] names (`None` for any other id).
fn worker_num(id: &str) -> Option<u64> {
    let digits = id.strip_prefix("i-sim")?;
    if digits.len() < 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `World::by_num` of a worker that is gone.
const NO_WORKER: u32 = u32::MAX;

/// One job's state. Kept small (about 100 bytes): ten copies of Philly hold 822,470 of them.
#[derive(Debug, Clone)]
struct JobSim {
    arrival: f64,
    /// Work left on the reference GPU, seconds.
    remaining: f64,
    gpus_per_instance: u32,
    instances: u32,
    /// Index into the world's project names.
    project: u32,
    /// First start; NaN until the job starts.
    started_first: f64,
    done: bool,
    /// Completion time (when `done`).
    finished_at: f64,
    /// Absolute deadline; infinite when the job has none.
    deadline: f64,
    epoch: u32,
    /// Current run: start time, speed, workers.
    run_start: f64,
    run_speed: f64,
    run_workers: Vec<u64>,
}

#[derive(Debug, Clone)]
struct WorkerSim {
    num: u64,
    /// Index of its offering.
    offering: usize,
    ready_at: f64,
    job: Option<usize>,
    idle_from: Option<f64>,
    /// Index of its zone in the world's zone list.
    zone: usize,
    spot: bool,
    /// A measured-series interruption is already scheduled.
    doomed: bool,
    /// In the world's `idle_listed`.
    listed: bool,
    /// The job it was launched for (a deadline at risk on spot), claimed first at boot.
    pinned: Option<usize>,
    /// Its drawn interruption (notice, end) on the agenda, cancelled when it is removed or
    /// stopped.
    timers: Option<[agenda::Key; 2]>,
    /// When it was stopped (Stopped state): its volume is billed from then.
    stopped_from: Option<f64>,
    /// The run time its agent counts for a job that declares none, seconds: the lane's estimate
    /// its row was given at its launch or last start
    /// ([`onoff_control::ports::WorkerRecord::run_time_estimate_s`]); `None`: the policy's
    /// `offers.default_runtime_s`.
    agent_estimate: Option<f64>,
}

/// Whether an idle worker takes a job ([`World::smallest_idle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Takes {
    /// It takes it.
    Yes,
    /// Never this job's shape (an agent's rule that depends on the job alone).
    No,
    /// Not now, for this job: another job of its shape, or this one later, may be taken.
    NotNow,
}

/// One simulated zone's place in its measured series.
#[derive(Debug, Clone)]
struct ZoneClock {
    series: usize,
    /// Absolute tick of the series at the trace's first arrival.
    offset_ticks: u64,
    /// Absolute tick of the next change.
    next_tick: Option<u64>,
    unavailable: bool,
}

/// The simulated world behind the ports.
struct World {
    now: f64,
    rng: StdRng,
    agenda: Agenda<Ev>,
    jobs: Vec<JobSim>,
    /// Project names, indexed by `JobSim::project`.
    projects: Vec<String>,
    /// (GPUs, number) of the workers that turned idle since they were last seen busy or gone: a
    /// superset of the idle workers, in the order dispatch picks them ([`World::list_idle`]).
    idle_set: BTreeSet<(u32, u64)>,
    /// Queued jobs, oldest first, and their trace indices. Ring buffers: a job starts from near
    /// the front, and removing it from a vector moved every job behind it (a fifth of a replay
    /// behind a capped fleet, with tens of thousands queued). Made contiguous for the policy's
    /// observation, which costs a move only when the ring has wrapped.
    queued: VecDeque<PendingJob>,
    queued_idx: VecDeque<usize>,
    workers: Vec<WorkerView>,
    wsim: Vec<WorkerSim>,
    /// Index in `workers` of each worker number ([`NO_WORKER`] once gone): numbers run from 1
    /// without gaps, so a vector is the map.
    by_num: Vec<u32>,
    next_num: u64,
    lanes: Vec<LaneObservation>,
    unavailable: Vec<UnavailableOffering>,
    offerings: Vec<Offering>,
    offering_index: HashMap<OfferingKey, usize>,
    /// Zone index of each offering.
    offering_zone: Vec<usize>,
    /// `type/capacity-type` of each offering (the keys of `launches_by_offering`).
    offering_label: Vec<String>,
    /// Measured series and the clock of each zone (measured preemptions only).
    measured: Option<Arc<MeasuredPreemptions>>,
    zones: Vec<ZoneClock>,
    t0: f64,
    lane_names: Vec<String>,
    cfg: SimConfig,
    // Accounting.
    cost: f64,
    on_demand_usd: f64,
    idle_gpu_s: f64,
    idle_usd: f64,
    boot_gpu_s: f64,
    boot_usd: f64,
    launches: u64,
    /// Stopped workers started again, and the volume they and the others cost while stopped.
    restarts: u64,
    stopped_usd: f64,
    launches_by_offering: std::collections::BTreeMap<String, u64>,
    /// Billed ($, seconds) per offering index.
    billed_by_offering: Vec<(f64, f64)>,
    capacity_errors: u64,
    spot_unavailable_errors: u64,
    interruptions: u64,
    lost_gpu_s: f64,
    busy_terminations: u64,
    completed: u64,
    last_completion: f64,
    /// Run times of the last jobs to finish (claim to end of their last attempt), as the
    /// deployed reconciler reads them from the `run_times` index: the estimate of an undeclared
    /// job's run time (`SimConfig::declared_runtimes` false).
    run_times: RecentRunTimes,
    /// The run time of an undeclared job before the estimate exists, seconds: the replay's
    /// lane's `default_runtime_s` (none: the policy's `offers.default_runtime_s`).
    runtime_prior: Option<f64>,
    /// The estimate the queued jobs were last given, seconds (undeclared run times only).
    estimate_given: Option<f64>,
    /// Part of `cost` billed after the last completion, once every job is done, $.
    tail_usd: f64,
    running_jobs: u32,
    /// The strategy's workers run onoff's agent ([`Strategy::runs_onoff_agent`]).
    onoff_agent: bool,
    /// Per offering: for an on-demand one, the best spot price for its shape
    /// ([`onoff_policy::choice::best_spot_price_usd_per_h`]); what its workers record in a lane
    /// that may use spot, when they run onoff's agent (`WorkerView::spot_price_usd_per_h`).
    spot_reference: Vec<Option<f64>>,
    /// Per lane: it may use spot.
    lane_spot: Vec<bool>,
    /// Booted workers held for the multi-instance job they were launched for, by job index.
    reserved: HashMap<usize, Vec<u64>>,
    /// Stopped workers being started by `act`: the project and pinned job each is started for
    /// (recorded by the registry's `mark_started`, read by the fleet's `start`).
    starting: HashMap<String, (Option<String>, Option<usize>)>,
    /// The fleet figures `decide` reads, kept as workers change ([`FleetIndex`]): every change
    /// to a worker's state or `busy_until` goes through [`World::change_worker`].
    fleet_index: FleetIndex,
    fleet_hint: FleetHint,
}

impl World {
    fn push(&mut self, at: f64, ev: Ev) {
        self.agenda.push(at, ev);
    }

    fn lane_index(&self, name: &str) -> usize {
        self.lane_names.iter().position(|l| l == name).unwrap_or(0)
    }

    /// A job's workers (by number) are done with it: the running ones go idle.
    fn free_workers(&mut self, workers: Vec<u64>) {
        for num in workers {
            if let Some(i) = self.worker_idx(num) {
                self.wsim[i].job = None;
                self.workers[i].project = None;
                if self.workers[i].state == WorkerState::Running {
                    let now = self.now;
                    self.change_worker(i, |w| {
                        w.state = WorkerState::Idle;
                        w.idle_since = Some(now);
                    });
                    self.wsim[i].idle_from = Some(now);
                    self.list_idle(i);
                }
            }
        }
    }

    /// Change worker `i` (its state, or anything [`FleetIndex`] counts) with the index kept.
    fn change_worker(&mut self, i: usize, f: impl FnOnce(&mut WorkerView)) {
        let before = brief(&self.workers[i]);
        f(&mut self.workers[i]);
        self.fleet_index.change(i, before, &self.workers[i]);
    }

    fn worker_idx(&self, num: u64) -> Option<usize> {
        self.by_num
            .get(num as usize)
            .copied()
            .filter(|&i| i != NO_WORKER)
            .map(|i| i as usize)
    }

    /// Index in `workers` of the live worker with instance id `id`.
    fn worker_by_id(&self, id: &str) -> Option<usize> {
        let i = self.worker_idx(worker_num(id)?)?;
        (self.workers[i].id == id).then_some(i)
    }

    /// A launch call over several offerings: a spot offering in a zone whose measured series
    /// says unavailable lacks capacity; any offering independently lacks capacity with
    /// probability `capacity_error_rate`; the count is spread round-robin over the others.
    fn launch(&mut self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        let mut res = LaunchResult::default();
        let mut ok: Vec<usize> = Vec::new();
        for k in &req.offerings {
            let Some(&o) = self.offering_index.get(k) else {
                return Err(FleetError {
                    kind: FleetErrorKind::Other,
                    message: format!("unknown offering {k}"),
                });
            };
            match self.capacity_error(o) {
                Some(e) => res.short.push((k.clone(), e)),
                None => ok.push(o),
            }
        }
        if ok.is_empty() {
            return Err(res.short.swap_remove(0).1);
        }
        // The job the capacity is pinned to (a deadline at risk on spot): its worker claims it
        // first when it boots, as the agent does ([`World::start_pinned`]).
        let pinned = req.job.as_deref().and_then(job_index).filter(|&j| j < self.jobs.len());
        let n = ok.len() as u32;
        for (i, &o) in ok.iter().enumerate() {
            let count = req.count / n + u32::from((i as u32) < req.count % n);
            res.launched
                .extend(self.launch_offering(o, &req.lane, req.project.as_ref(), pinned, count));
        }
        Ok(res)
    }

    /// Create `count` instances of offering `oi`: Pending, boot done after a random cold start.
    fn launch_offering(
        &mut self,
        oi: usize,
        lane: &str,
        project: Option<&String>,
        pinned: Option<usize>,
        count: u32,
    ) -> Vec<Launched> {
        let lane = self.lane_index(lane);
        let zone = self.offering_zone[oi];
        let mut out = Vec::new();
        for _ in 0..count {
            self.next_num += 1;
            let num = self.next_num;
            let id = instance_id(num);
            let boot = self
                .rng
                .random_range(self.cfg.boot_min_s..=self.cfg.boot_max_s.max(self.cfg.boot_min_s));
            let o = &self.offerings[oi];
            let spot = o.key.capacity_type == CapacityType::Spot;
            let rate = o.interruption_rate_per_s();
            let key = o.key.clone();
            self.workers.push(WorkerView {
                id: id.clone(),
                seq: num,
                lane,
                offering: key.clone(),
                gpus: o.gpus,
                gpu_memory_gib: o.gpu_memory_gib,
                price_usd_per_h: o.price_usd_per_h,
                state: WorkerState::Pending,
                launched_at: self.now,
                idle_since: None,
                project: project.cloned(),
                job_type: None,
                busy_until: None,
                pinned_job: pinned.map(job_id),
                // Only onoff's agent weighs it (a baseline's workers take any job).
                spot_price_usd_per_h: self.spot_reference[oi]
                    .filter(|_| self.onoff_agent && self.lane_spot.get(lane).copied().unwrap_or(false)),
                stopped_until: None,
                cached_projects: Vec::new(),
            });
            self.wsim.push(WorkerSim {
                num,
                offering: oi,
                ready_at: self.now + boot,
                job: None,
                idle_from: None,
                zone,
                spot,
                doomed: false,
                listed: false,
                pinned,
                timers: None,
                stopped_from: None,
                agent_estimate: None,
            });
            debug_assert_eq!(self.by_num.len() as u64, num);
            self.by_num.push((self.workers.len() - 1) as u32);
            self.fleet_index
                .add(self.workers.len() - 1, &self.workers[self.workers.len() - 1]);
            self.push(self.now + boot, Ev::BootDone(num));
            if spot {
                self.draw_interruption(self.workers.len() - 1, rate);
            }
            self.launches += 1;
            let label = &self.offering_label[oi];
            match self.launches_by_offering.get_mut(label.as_str()) {
                Some(c) => *c += 1,
                None => {
                    self.launches_by_offering.insert(label.clone(), 1);
                }
            }
            out.push(Launched {
                instance_id: id,
                offering: key,
            });
        }
        out
    }

    /// A spot worker `i` (just launched or started) at interruption rate `rate` (per second):
    /// its interruption drawn (advisor model), the notice and the end put on the agenda.
    fn draw_interruption(&mut self, i: usize, rate: f64) {
        if !(self.cfg.interruptions && self.measured.is_none()) {
            return;
        }
        let rate = rate * self.cfg.interruption_rate_factor;
        if rate > 0.0 {
            let num = self.wsim[i].num;
            let u: f64 = self.rng.random::<f64>().max(1e-300);
            let t = -u.ln() / rate;
            let at = self.now + t;
            let notice_at = (at - self.cfg.notice_s).max(self.now);
            let notice = self.agenda.push_cancellable(notice_at, Ev::Notice(num));
            let end = self.agenda.push_cancellable(at, Ev::Interrupt(num));
            self.wsim[i].timers = Some([notice, end]);
        }
    }

    /// Whether a spot launch or start of offering `o` fails with a capacity error now: its zone's
    /// measured series says unavailable, or the drawn 2 % (`capacity_error_rate`). `Some` with
    /// EC2's message when it does (counted).
    fn capacity_error(&mut self, o: usize) -> Option<FleetError> {
        let k = &self.offerings[o].key;
        let spot = k.capacity_type == CapacityType::Spot;
        if spot && self.zones.get(self.offering_zone[o]).is_some_and(|z| z.unavailable) {
            self.capacity_errors += 1;
            self.spot_unavailable_errors += 1;
            Some(FleetError {
                kind: FleetErrorKind::InsufficientCapacity,
                message: format!("InsufficientInstanceCapacity (measured: no spot in {})", k.zone),
            })
        } else if self.rng.random::<f64>() < self.cfg.capacity_error_rate {
            self.capacity_errors += 1;
            Some(FleetError {
                kind: FleetErrorKind::InsufficientCapacity,
                message: format!("InsufficientInstanceCapacity (simulated) for {k}"),
            })
        } else {
            None
        }
    }

    /// Stop idle worker `i`: its running time billed, its drawn interruption dropped, its volume
    /// billed from now on.
    fn stop_worker(&mut self, i: usize) {
        self.bill_run(i);
        for key in self.wsim[i].timers.take().into_iter().flatten() {
            self.agenda.cancel(key);
        }
        let now = self.now;
        self.wsim[i].stopped_from = Some(now);
        self.wsim[i].idle_from = None;
        self.wsim[i].doomed = false;
        self.change_worker(i, |w| {
            w.state = WorkerState::Stopped;
            w.idle_since = Some(now);
            w.busy_until = None;
        });
    }

    /// Start stopped worker `i` again: refused while it is still stopping (`stopping_s` after its
    /// stop; [`FleetErrorKind::Stopping`]), a capacity error as a launch of its offering would
    /// meet (either refusal leaves it as it was, as `control::act` puts the functions' row
    /// back), else booting for a drawn start (`restart_min_s`..`restart_max_s`), billed as a launch from
    /// now (60-second minimum), its volume up to now billed, a spot worker's interruption drawn
    /// afresh.
    fn start_worker(&mut self, i: usize, project: Option<String>, pinned: Option<usize>) -> Result<(), FleetError> {
        let oi = self.wsim[i].offering;
        if self.wsim[i]
            .stopped_from
            .is_some_and(|t| self.now - t < self.cfg.stopping_s)
        {
            return Err(FleetError {
                kind: FleetErrorKind::Stopping,
                message: format!(
                    "IncorrectInstanceState: The instance '{}' is not in a state from which it can be started. \
                     (the instance is stopping)",
                    self.workers[i].id
                ),
            });
        }
        if let Some(e) = self.capacity_error(oi) {
            return Err(e);
        }
        self.bill_stopped(i);
        let now = self.now;
        let boot = self
            .rng
            .random_range(self.cfg.restart_min_s..=self.cfg.restart_max_s.max(self.cfg.restart_min_s));
        let num = self.wsim[i].num;
        self.wsim[i].ready_at = now + boot;
        self.wsim[i].pinned = pinned;
        self.wsim[i].doomed = false;
        self.change_worker(i, |w| {
            w.state = WorkerState::Pending;
            w.launched_at = now;
            w.idle_since = None;
            w.stopped_until = None;
            w.project = project;
            w.pinned_job = pinned.map(job_id);
        });
        self.push(now + boot, Ev::BootDone(num));
        if self.wsim[i].spot {
            let rate = self.offerings[oi].interruption_rate_per_s();
            self.draw_interruption(i, rate);
        }
        self.restarts += 1;
        Ok(())
    }

    /// Bill stopped worker `i`'s volume up to now (nothing when it is not stopped).
    fn bill_stopped(&mut self, i: usize) {
        if let Some(from) = self.wsim[i].stopped_from.take() {
            let usd = (self.now - from).max(0.0) * self.cfg.stopped_usd_per_h / 3600.0;
            self.cost += usd;
            self.stopped_usd += usd;
            if self.completed as usize == self.jobs.len() {
                let after = (self.now - from.max(self.last_completion)).max(0.0);
                self.tail_usd += after * self.cfg.stopped_usd_per_h / 3600.0;
            }
        }
    }

    /// Worker `i` turned idle: list it for `dispatch` (once).
    fn list_idle(&mut self, i: usize) {
        if !self.wsim[i].listed {
            self.wsim[i].listed = true;
            self.idle_set.insert((self.workers[i].gpus, self.wsim[i].num));
        }
        if self.idle_set.len() > 2 * self.workers.len() + 1024 {
            // Mostly entries of workers gone or busy that no search passed over: rebuild it from
            // the workers (rare: amortised over the insertions that grew it).
            self.idle_set.clear();
            for j in 0..self.workers.len() {
                let idle = self.workers[j].state == WorkerState::Idle;
                self.wsim[j].listed = idle;
                if idle {
                    self.idle_set.insert((self.workers[j].gpus, self.wsim[j].num));
                }
            }
        }
    }

    /// Simulated time of absolute tick `tick` of zone `z`'s series.
    fn tick_time(&self, z: usize, tick: u64) -> f64 {
        let c = &self.zones[z];
        let gap = self.measured.as_ref().map_or(1.0, |m| m.series[c.series].gap_s);
        self.t0 + (tick - c.offset_ticks) as f64 * gap
    }

    /// Start the zone clocks at the trace's first arrival: each zone's state there and its first
    /// change on the agenda.
    fn start_zones(&mut self, mapping: &[ZoneMapping]) {
        let Some(m) = self.measured.clone() else { return };
        self.zones = mapping
            .iter()
            .map(|z| ZoneClock {
                series: z.series,
                offset_ticks: z.offset_ticks,
                next_tick: m.series[z.series].next_change_after(z.offset_ticks),
                unavailable: m.series[z.series].unavailable_at(z.offset_ticks),
            })
            .collect();
        for z in 0..self.zones.len() {
            if let Some(t) = self.zones[z].next_tick {
                let at = self.tick_time(z, t);
                self.push(at, Ev::ZoneFlip(z));
            }
        }
    }

    /// Zone `z`'s series changes value now. Turning unavailable, every spot instance in the
    /// zone gets the notice now and is interrupted when it runs out.
    fn zone_flip(&mut self, z: usize) {
        let Some(m) = self.measured.clone() else { return };
        let Some(tick) = self.zones[z].next_tick else { return };
        let series = &m.series[self.zones[z].series];
        let unavailable = series.unavailable_at(tick);
        self.zones[z].unavailable = unavailable;
        if unavailable && self.cfg.interruptions {
            let now = self.now;
            let doomed: Vec<u64> = self
                .wsim
                .iter_mut()
                .filter(|w| w.zone == z && w.spot && !w.doomed && w.stopped_from.is_none())
                .map(|w| {
                    w.doomed = true;
                    w.num
                })
                .collect();
            for num in doomed {
                self.push(now, Ev::Notice(num));
                self.push(now + self.cfg.notice_s, Ev::Interrupt(num));
            }
        }
        self.zones[z].next_tick = series.next_change_after(tick);
        if let Some(t) = self.zones[z].next_tick {
            let at = self.tick_time(z, t);
            self.push(at, Ev::ZoneFlip(z));
        }
    }

    /// Remove a worker: bill it, requeue its job if it had one.
    fn remove_worker(&mut self, num: u64, interrupted: bool) {
        let Some(i) = self.worker_idx(num) else { return };
        if self.wsim[i].stopped_from.is_some() {
            self.bill_stopped(i);
        } else {
            self.bill_run(i);
        }
        let ws = &self.wsim[i];
        if let Some(job) = ws.job {
            if !interrupted {
                self.busy_terminations += 1;
            }
            self.preempt_job(job, false);
        }
        for key in self.wsim[i].timers.into_iter().flatten() {
            self.agenda.cancel(key);
        }
        self.fleet_index.remove(i, &self.workers[i]);
        self.by_num[num as usize] = NO_WORKER;
        self.workers.swap_remove(i);
        self.wsim.swap_remove(i);
        if i < self.workers.len() {
            self.fleet_index.moved(self.workers.len(), i, &self.workers[i]);
            let moved = self.wsim[i].num;
            self.by_num[moved as usize] = i as u32;
        }
        debug_assert!(
            self.agenda.cancellable().all(|ev| match *ev {
                Ev::Notice(n) | Ev::Interrupt(n) => self.worker_idx(n).is_some(),
                _ => false,
            }),
            "a timer outlived its worker"
        );
    }

    /// Bill worker `i`'s run from its launch (or start) to now: per second with the 60-second
    /// minimum, its boot and its idle time counted.
    fn bill_run(&mut self, i: usize) {
        let w = &self.workers[i];
        let ws = &self.wsim[i];
        let billed = (self.now - w.launched_at).max(60.0);
        self.cost += w.price_usd_per_h * billed / 3600.0;
        let spent = &mut self.billed_by_offering[ws.offering];
        spent.0 += w.price_usd_per_h * billed / 3600.0;
        spent.1 += billed;
        if self.completed as usize == self.jobs.len() {
            let from = self.last_completion;
            // What billing to `from` alone would have been (nothing for a worker launched after).
            let before = if from > w.launched_at {
                (from - w.launched_at).max(60.0)
            } else {
                0.0
            };
            self.tail_usd += w.price_usd_per_h * (billed - before).max(0.0) / 3600.0;
        }
        if !ws.spot {
            self.on_demand_usd += w.price_usd_per_h * billed / 3600.0;
        }
        let boot = (ws.ready_at.min(self.now) - w.launched_at).max(0.0);
        self.boot_gpu_s += boot * w.gpus as f64;
        self.boot_usd += boot * w.price_usd_per_h / 3600.0;
        if let Some(from) = ws.idle_from {
            self.idle_gpu_s += (self.now - from) * w.gpus as f64;
            self.idle_usd += (self.now - from) * w.price_usd_per_h / 3600.0;
        }
    }

    /// Stop a running job (notice or lost worker): keep the checkpointed work, requeue the rest.
    fn preempt_job(&mut self, job: usize, checkpoint_now: bool) {
        let (elapsed, speed, workers) = {
            let j = &self.jobs[job];
            if j.done || j.run_workers.is_empty() {
                return;
            }
            (self.now - j.run_start, j.run_speed, j.run_workers.clone())
        };
        let progress = elapsed * speed;
        let ck = self.cfg.checkpoint_interval_s;
        let saved = if checkpoint_now {
            progress
        } else {
            (elapsed / ck).floor() * ck * speed
        };
        let j = &mut self.jobs[job];
        j.remaining = (j.remaining - saved).max(0.0);
        self.lost_gpu_s += (progress - saved) * (j.gpus_per_instance * j.instances) as f64;
        j.epoch += 1;
        j.run_workers.clear();
        self.running_jobs -= 1;
        self.free_workers(workers);
        self.enqueue(job);
    }

    fn enqueue(&mut self, job: usize) {
        let j = &self.jobs[job];
        let lane = self.lane_index(&self.cfg.lane);
        self.queued.push_back(PendingJob {
            id: job_id(job),
            lane,
            project: self.projects[j.project as usize].clone(),
            job_type: None,
            gpus_per_instance: j.gpus_per_instance,
            instances: j.instances,
            min_gpu_memory_gib: 0.0,
            est_runtime_s: self.runtime_known(j.remaining),
            deadline: Some(j.deadline).filter(|d| d.is_finite()),
            enqueued_at: self.now,
        });
        self.queued_idx.push_back(job);
        self.lanes[lane].backlog.visible += 1;
    }

    /// Take the `qi`-th queued job off the queue (it starts now); returns its trace index.
    fn dequeue(&mut self, qi: usize) -> usize {
        let pj = self.queued.remove(qi).expect("dequeue: a queued index");
        self.lanes[pj.lane].backlog.visible -= 1;
        self.queued_idx.remove(qi).expect("dequeue: a queued index")
    }

    /// Give idle workers queued jobs they fit, oldest job first (workers pulling from the queue).
    fn dispatch(&mut self, pcfg: &PolicyConfig) {
        if self.queued.is_empty() {
            return;
        }
        // Shapes (lane, GPUs, memory, instances) no idle worker could take in this pass: the idle
        // set only shrinks, so later jobs of such a shape are skipped without a search (a long
        // queue of jobs nothing fits would otherwise cost queue x idle per event).
        let mut no_fit: Vec<(usize, u32, u64, usize, bool)> = Vec::new();
        let mut qi = 0;
        while qi < self.queued.len() && !self.idle_set.is_empty() {
            let pj = &self.queued[qi];
            let (lane, job_gpus) = (pj.lane, pj.gpus_per_instance);
            let min_mem = pj.min_gpu_memory_gib.max(pcfg.offers.min_gpu_memory_gib);
            let need = pj.instances.max(1) as usize;
            // A job whose deadline is at risk on spot starts on on-demand workers only, as the
            // agent on a spot instance hands it back ([`onoff_policy::deadline`]). The agent
            // counts a job's run time as declared, else as the estimate its worker's row holds
            // (`agent_estimate`), else as the policy's default.
            let declared = pj.est_runtime_s.filter(|_| self.cfg.declared_runtimes);
            let runtime = |estimate: Option<f64>| declared.or(estimate).unwrap_or(pcfg.offers.default_runtime_s);
            let (deadline, enqueued_at, now, agent) = (pj.deadline, pj.enqueued_at, self.now, self.onoff_agent);
            let at_risk = |estimate| agent && keeps_off_spot(deadline, runtime(estimate), now, enqueued_at, pcfg);
            // Declared, the deadline rule is the job's alone: part of its shape. Otherwise it
            // depends on the worker's estimate, and a refusal is for this job only.
            let spot_ok = declared.is_none() || !at_risk(None);
            let shape = (lane, job_gpus, min_mem.to_bits(), need, spot_ok);
            if no_fit.contains(&shape) {
                qi += 1;
                continue;
            }
            // An on-demand worker of a spot-first lane takes the job only while its premium there
            // is worth it, as its agent does ([`onoff_policy::choice::worth_an_on_demand_worker`]);
            // a job whose deadline is at risk on spot takes it whatever it costs.
            let waited = now - enqueued_at;
            let instances = pj.instances;
            let takes = |spot: bool, price: f64, reference: Option<f64>, estimate: Option<f64>| {
                let risk = at_risk(estimate);
                match (spot, reference) {
                    (true, _) if risk && declared.is_some() => Takes::No,
                    (true, _) if risk => Takes::NotNow,
                    (false, Some(reference))
                        if !risk
                            && !worth_an_on_demand_worker(
                                price,
                                reference,
                                instances,
                                runtime(estimate),
                                waited,
                                pcfg,
                            ) =>
                    {
                        Takes::NotNow
                    }
                    _ => Takes::Yes,
                }
            };
            let (chosen, passed_over) =
                self.smallest_idle(lane, job_gpus, min_mem, need, pcfg.offers.max_gpu_oversize, takes);
            if chosen.len() < need {
                // A job that waited longer, or another of its shape, may yet take a worker this
                // one passed over.
                if !passed_over {
                    no_fit.push(shape);
                }
                qi += 1;
                continue;
            }
            for &i in &chosen {
                self.idle_set.remove(&(self.workers[i].gpus, self.wsim[i].num));
                self.wsim[i].listed = false;
            }
            let job = self.dequeue(qi);
            self.start_job(job, &chosen, pcfg);
        }
    }

    /// Up to `need` idle workers of `lane` that fit the shape and take the job (`takes(spot, its
    /// price, its spot reference, its agent's estimate)`), smallest first (fewest GPUs, then the
    /// oldest), as worker indices, and whether a worker was passed over for this job only
    /// ([`Takes::NotNow`]). Walks the idle set in (GPUs, number) order from the job's GPUs,
    /// skipping whole GPU counts that cannot fit; entries of workers no longer idle are dropped on
    /// the way. O(log n) per GPU count looked at, plus the entries passed over.
    fn smallest_idle(
        &mut self,
        lane: usize,
        job_gpus: u32,
        min_mem: f64,
        need: usize,
        oversize: u32,
        takes: impl Fn(bool, f64, Option<f64>, Option<f64>) -> Takes,
    ) -> (smallvec::SmallVec<[usize; 8]>, bool) {
        let mut passed_over = false;
        let mut chosen = smallvec::SmallVec::with_capacity(need);
        let mut stale = Vec::new();
        let mut from = (job_gpus, 0u64);
        while chosen.len() < need {
            let Some(&(g, num)) = self.idle_set.range(from..).next() else {
                break;
            };
            if !fits(g, f64::INFINITY, job_gpus, 0.0, oversize) {
                // No worker with this many GPUs fits: on to the next count.
                match g.checked_add(1) {
                    Some(next) => from = (next, 0),
                    None => break,
                }
                continue;
            }
            from = (g, num + 1);
            match self.worker_idx(num) {
                Some(i) if self.workers[i].state == WorkerState::Idle => {
                    let (w, ws) = (&self.workers[i], &self.wsim[i]);
                    if w.lane == lane && fits(w.gpus, w.gpu_memory_gib, job_gpus, min_mem, oversize) {
                        match takes(ws.spot, w.price_usd_per_h, w.spot_price_usd_per_h, ws.agent_estimate) {
                            Takes::Yes => chosen.push(i),
                            Takes::No => {}
                            Takes::NotNow => passed_over = true,
                        }
                    }
                }
                Some(i) => {
                    self.wsim[i].listed = false;
                    stale.push((g, num));
                }
                None => stale.push((g, num)),
            }
        }
        for k in stale {
            self.idle_set.remove(&k);
        }
        (chosen, passed_over)
    }

    /// Worker `i` just booted: if it was launched for a job still queued, it is that job's (the
    /// agent claims its pinned job before it polls the queue). A single-instance job starts at
    /// once; a multi-instance one (the simulator's gang jobs) starts when its last pinned worker
    /// is up, its booted workers held for it meanwhile. True when the worker was taken.
    fn start_pinned(&mut self, i: usize, pcfg: &PolicyConfig) -> bool {
        let pinned = self.wsim[i].pinned.take().filter(|_| self.onoff_agent);
        let queued = pinned.and_then(|job| Some((job, self.queued_idx.iter().position(|&j| j == job)?)));
        let Some((job, qi)) = queued else {
            self.workers[i].pinned_job = None;
            return false;
        };
        let need = self.jobs[job].instances.max(1) as usize;
        let mut held = self.reserved.remove(&job).unwrap_or_default();
        held.push(self.wsim[i].num);
        // Workers held earlier that are still up and idle.
        let mut up: Vec<usize> = held
            .iter()
            .filter_map(|&n| self.worker_idx(n))
            .filter(|&k| self.workers[k].state == WorkerState::Idle && self.wsim[k].job.is_none())
            .collect();
        if up.len() < need {
            // Held (its view keeps `pinned_job`, so the policy counts it for the job alone).
            let nums = up.iter().map(|&k| self.wsim[k].num).collect();
            self.reserved.insert(job, nums);
            return true;
        }
        for &k in &up {
            self.workers[k].pinned_job = None;
        }
        up.truncate(need);
        self.dequeue(qi);
        self.start_job(job, &up, pcfg);
        true
    }

    /// Job `job` started or ended otherwise: the workers held for it (see
    /// [`World::start_pinned`]) go back to serving the queue.
    fn release_reserved(&mut self, job: usize) {
        if let Some(nums) = self.reserved.remove(&job) {
            for n in nums {
                if let Some(k) = self.worker_idx(n) {
                    self.workers[k].pinned_job = None;
                    if self.workers[k].state == WorkerState::Idle && self.wsim[k].job.is_none() {
                        self.list_idle(k);
                    }
                }
            }
        }
    }

    fn start_job(&mut self, job: usize, workers: &[usize], pcfg: &PolicyConfig) {
        if !self.reserved.is_empty() {
            self.release_reserved(job);
        }
        // A gang runs at its slowest GPU's speed.
        let sp = workers.iter().fold(f64::INFINITY, |sp, &i| {
            sp.min(speed(&pcfg.offers, &self.offerings[self.wsim[i].offering].gpu_model))
        });
        let at = self.now + self.jobs[job].remaining / sp;
        // The policy knows when a job ends only from what it declared, or the estimate.
        let end = match self.cfg.declared_runtimes {
            true => Some(at),
            false => self.undeclared_runtime().map(|e| self.now + e),
        };
        let mut nums = Vec::with_capacity(workers.len());
        for &i in workers {
            let now = self.now;
            let (w, ws) = (&self.workers[i], &mut self.wsim[i]);
            if let Some(from) = ws.idle_from.take() {
                self.idle_gpu_s += (now - from) * w.gpus as f64;
                self.idle_usd += (now - from) * w.price_usd_per_h / 3600.0;
            }
            ws.job = Some(job);
            nums.push(ws.num);
            let project = self.projects[self.jobs[job].project as usize].clone();
            self.change_worker(i, |w| {
                w.state = WorkerState::Running;
                w.idle_since = None;
                w.project = Some(project);
                w.busy_until = end;
            });
        }
        let j = &mut self.jobs[job];
        if j.started_first.is_nan() {
            j.started_first = self.now;
        }
        j.run_start = self.now;
        j.run_speed = sp;
        j.run_workers = nums;
        let epoch = j.epoch;
        self.running_jobs += 1;
        self.push(at, Ev::JobDone { job, epoch });
    }

    /// The run time the policy is given for a job of trace run time `runtime_s`: that, when jobs
    /// declare theirs; otherwise the estimate from the last jobs to finish, if any.
    fn runtime_known(&self, runtime_s: f64) -> Option<f64> {
        match self.cfg.declared_runtimes {
            true => Some(runtime_s),
            false => self.undeclared_runtime(),
        }
    }

    /// The run time the policy is given for a job that declared none: the estimate from the last
    /// jobs to finish, else the lane's prior, else none.
    fn undeclared_runtime(&self) -> Option<f64> {
        self.run_times.estimate_s().or(self.runtime_prior)
    }

    /// Give the queued jobs and the running ones the current run-time estimate (undeclared run
    /// times only), as the deployed reconciler does on each run: a running job's workers end at
    /// its start plus the estimate, until it has outlived that by `horizon_s` (short jobs queued
    /// behind it would have waited the horizon already); then their end is unknown. Live workers
    /// whose row has no estimate for their agent get this one. O(queued) when the estimate
    /// changed, plus O(workers).
    fn refresh_estimates(&mut self, horizon_s: f64) {
        if self.cfg.declared_runtimes {
            return;
        }
        let e = self.undeclared_runtime();
        if e != self.estimate_given {
            self.estimate_given = e;
            for j in &mut self.queued {
                j.est_runtime_s = e;
            }
        }
        for i in 0..self.workers.len() {
            // A row without a figure is given the lane's, as the reconciler does on each run
            // (`onoff_control::reconcile::give_run_time_estimates`); its agent reads it at its
            // next undeclared job.
            let live = matches!(
                self.workers[i].state,
                WorkerState::Pending | WorkerState::Running | WorkerState::Idle
            );
            if live && self.wsim[i].agent_estimate.is_none() {
                self.wsim[i].agent_estimate = e;
            }
            if self.workers[i].state != WorkerState::Running {
                continue;
            }
            let Some(job) = self.wsim[i].job else { continue };
            let now = self.now;
            let end = e
                .map(|e| self.jobs[job].run_start + e)
                .filter(|end| end + horizon_s > now);
            if self.workers[i].busy_until != end {
                self.change_worker(i, |w| w.busy_until = end);
            }
        }
    }

    fn finish_job(&mut self, job: usize) {
        let workers = std::mem::take(&mut self.jobs[job].run_workers);
        self.jobs[job].done = true;
        self.jobs[job].finished_at = self.now;
        self.jobs[job].remaining = 0.0;
        self.completed += 1;
        self.running_jobs -= 1;
        self.last_completion = self.now;
        let run_s = self.now - self.jobs[job].run_start;
        self.run_times.record(run_s);
        self.free_workers(workers);
    }

    fn timeline_row(&self, minute: u64) -> TimelineRow {
        let mut r = TimelineRow {
            minute,
            backlog: self.queued.len() as u32,
            running_jobs: self.running_jobs,
            pending: 0,
            busy: 0,
            idle: 0,
            draining: 0,
            stopped: 0,
            usd_per_h: 0.0,
        };
        for w in &self.workers {
            match w.state {
                WorkerState::Pending => r.pending += 1,
                WorkerState::Running => r.busy += 1,
                WorkerState::Idle => r.idle += 1,
                WorkerState::Draining | WorkerState::Terminating => r.draining += 1,
                WorkerState::Stopped => r.stopped += 1,
            }
            r.usd_per_h += match w.state {
                WorkerState::Stopped => self.cfg.stopped_usd_per_h,
                _ => w.price_usd_per_h,
            };
        }
        r
    }
}

/// The simulated ports over the world.
struct SimPorts<'a>(&'a RefCell<World>);

impl Fleet for SimPorts<'_> {
    async fn launch(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        // What EC2 refuses whole, the simulated fleet refuses too.
        if let Some(e) = onoff_control::ports::invalid_fleet_request(req) {
            return Err(e);
        }
        self.0.borrow_mut().launch(req)
    }
    async fn terminate(&self, ids: &[String]) -> Result<(), FleetError> {
        let mut w = self.0.borrow_mut();
        for id in ids {
            if let Some(i) = w.worker_by_id(id) {
                let num = w.wsim[i].num;
                w.remove_worker(num, false);
            }
        }
        Ok(())
    }
    async fn cancel_launch(&self, ids: &[String]) -> Result<(), FleetError> {
        self.terminate(ids).await
    }
    async fn stop(&self, ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        let mut w = self.0.borrow_mut();
        for id in ids {
            if let Some(i) = w.worker_by_id(id).filter(|&i| w.workers[i].state == WorkerState::Idle) {
                w.stop_worker(i);
            }
        }
        Ok(Vec::new())
    }
    async fn start(&self, ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        let mut w = self.0.borrow_mut();
        let mut refused = Vec::new();
        for id in ids {
            let Some(i) = w
                .worker_by_id(id)
                .filter(|&i| w.workers[i].state == WorkerState::Stopped)
            else {
                continue;
            };
            let (project, pinned) = w.starting.remove(id).unwrap_or_default();
            if let Err(e) = w.start_worker(i, project, pinned) {
                refused.push((id.clone(), e));
            }
        }
        Ok(refused)
    }
}

impl WorkerRegistry for SimPorts<'_> {
    async fn register_launch(&self, record: WorkerRecord) -> Result<(), StoreError> {
        // The simulated fleet keeps the worker table itself; the estimate its agent reads is
        // kept with it.
        let mut w = self.0.borrow_mut();
        if let Some(i) = w.worker_by_id(&record.id) {
            w.wsim[i].agent_estimate = record.run_time_estimate_s;
        }
        Ok(())
    }
    async fn set_state(&self, id: &str, state: WorkerState) -> Result<(), StoreError> {
        let mut w = self.0.borrow_mut();
        let i = w.worker_by_id(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        w.change_worker(i, |w| w.state = state);
        Ok(())
    }
    async fn set_state_if(&self, id: &str, to: WorkerState, from: &[WorkerState]) -> Result<bool, StoreError> {
        let mut w = self.0.borrow_mut();
        let i = w.worker_by_id(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        // As the trait says: already in `to` is done.
        if w.workers[i].state == to {
            return Ok(true);
        }
        if !from.contains(&w.workers[i].state) {
            return Ok(false);
        }
        w.change_worker(i, |w| w.state = to);
        Ok(true)
    }
    async fn mark_start_refused(
        &self,
        id: &str,
        _at: f64,
        _launched_at: f64,
        _stopped_at: Option<f64>,
        _stopped_until: Option<f64>,
    ) -> Result<bool, StoreError> {
        // A refused start leaves the simulated worker as it was (`start_worker`): stopped, with
        // its launch time, stop time and keep, which is what this write puts back on the
        // functions' row.
        let w = self.0.borrow();
        let i = w.worker_by_id(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        Ok(w.workers[i].state == WorkerState::Stopped)
    }
    async fn set_price_if_unpriced(&self, _id: &str, _price_usd_per_h: f64) -> Result<bool, StoreError> {
        // Every simulated worker is priced at its launch.
        Ok(false)
    }
    async fn mark_stopped(&self, id: &str, _at: f64, until: f64, _launched_at: f64) -> Result<bool, StoreError> {
        // The simulated fleet's `stop` moves the worker (and bills it); here the check, and the
        // keep recorded on its view.
        let mut w = self.0.borrow_mut();
        let i = w.worker_by_id(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if !matches!(w.workers[i].state, WorkerState::Idle | WorkerState::Stopped) {
            return Ok(false);
        }
        w.change_worker(i, |w| w.stopped_until = Some(until));
        Ok(true)
    }
    async fn mark_started(
        &self,
        id: &str,
        _at: f64,
        project: Option<&str>,
        job: Option<&str>,
        run_time_estimate_s: Option<f64>,
    ) -> Result<bool, StoreError> {
        // The simulated fleet's `start` moves the worker; what it is started for is kept for it,
        // and the estimate its agent reads when it boots again.
        let mut w = self.0.borrow_mut();
        let i = w.worker_by_id(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if w.workers[i].state != WorkerState::Stopped {
            return Ok(false);
        }
        w.wsim[i].agent_estimate = run_time_estimate_s;
        let pinned = job.and_then(job_index).filter(|&j| j < w.jobs.len());
        w.starting.insert(id.to_string(), (project.map(str::to_string), pinned));
        Ok(true)
    }
    async fn set_run_time_estimate_if_unset(&self, id: &str, run_time_estimate_s: f64) -> Result<bool, StoreError> {
        // What `World::refresh_estimates` does on each decision, for a caller that asks.
        let mut w = self.0.borrow_mut();
        let i = w.worker_by_id(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        let given = w.wsim[i].agent_estimate.get_or_insert(run_time_estimate_s);
        Ok(*given == run_time_estimate_s)
    }
    async fn hold_idle(&self, _id: &str, _until: f64) -> Result<bool, StoreError> {
        // Simulated workers end only as the policy says (the functions renew every idle worker's
        // hold on each decision, so an agent's idle timeout never ends a worker the policy keeps).
        Ok(false)
    }
    async fn get(&self, _id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        // The simulated fleet answers from its own table; nothing in the simulation asks.
        Ok(None)
    }
    async fn list_live(&self) -> Result<onoff_control::ports::Listing<WorkerRecord>, StoreError> {
        Ok(onoff_control::ports::Listing::default())
    }
}

impl OfferingAvailability for SimPorts<'_> {
    async fn mark_unavailable(&self, key: &OfferingKey, until: f64) -> Result<(), StoreError> {
        let mut w = self.0.borrow_mut();
        let now = w.now;
        // A later `until` wins; an earlier one changes nothing (as the trait says).
        let until = w
            .unavailable
            .iter()
            .filter(|u| u.key == *key)
            .fold(until, |a, u| a.max(u.until));
        w.unavailable.retain(|u| u.until > now && u.key != *key);
        w.unavailable.push(UnavailableOffering {
            key: key.clone(),
            until,
        });
        Ok(())
    }
    async fn list_unavailable(&self, now: f64) -> Result<Vec<UnavailableOffering>, StoreError> {
        Ok(self
            .0
            .borrow()
            .unavailable
            .iter()
            .filter(|u| u.until > now)
            .cloned()
            .collect())
    }
}

/// Stream of the deadline draws: the seed XOR this (ASCII `deadline`), so which jobs get a
/// deadline depends on the seed and the trace only, never on the strategy's draws.
const DEADLINE_STREAM: u64 = 0x6465_6164_6c69_6e65;

/// Deadlines of a seeded share of the jobs, seconds after the trace's first arrival (`None` for
/// jobs without): exactly `round(fraction x jobs)` jobs, drawn uniformly without replacement
/// (a partial Fisher-Yates shuffle seeded by `seed`), each due `slack x duration_s` after its
/// arrival. The same (trace, fraction, slack, seed) gives the same deadlines for every strategy.
pub fn assign_deadlines(trace: &Trace, fraction: f64, slack: f64, seed: u64) -> Vec<Option<f64>> {
    let n = trace.jobs.len();
    let mut out = vec![None; n];
    let k = ((fraction.clamp(0.0, 1.0) * n as f64).round() as usize).min(n);
    if k == 0 {
        return out;
    }
    let mut rng = StdRng::seed_from_u64(seed ^ DEADLINE_STREAM);
    let mut idx: Vec<u32> = (0..n as u32).collect();
    for i in 0..k {
        let j = rng.random_range(i..n);
        idx.swap(i, j);
        let job = &trace.jobs[idx[i] as usize];
        out[idx[i] as usize] = Some(job.arrival_s + slack * job.duration_s);
    }
    out
}

/// The configured limit a held want waited for, as [`RunReport::held_by_limit`] names it; `None`
/// for a hold that is not a configured limit's: waiting for spot while on-demand costs more than
/// the wait is worth (the policy's choice), or no offering left (capacity errors and outages as
/// much as the offer filters).
fn held_for_limit(reason: &Reason) -> Option<String> {
    match reason {
        Reason::MaxWorkers { limit } => Some(format!("max workers {limit}")),
        Reason::BudgetBreaker { cap_usd_per_h, .. } => Some(format!("budget cap {cap_usd_per_h:.2} $/h")),
        Reason::ProjectQuota { project, max_gpus } => Some(format!("project {project}'s quota of {max_gpus} GPUs")),
        Reason::JobTypeCap { job_type, cap } => Some(format!("job type {job_type}'s cap of {cap}")),
        Reason::Frozen => Some("freeze".to_string()),
        _ => None,
    }
}

/// Count `plan`'s holds into `counts`: each limit once per decision however many wants it held.
fn count_held_for_limits(plan: &Plan, counts: &mut BTreeMap<String, u64>) {
    let mut seen: Vec<String> = Vec::new();
    for limit in plan.held.iter().filter_map(|h| held_for_limit(&h.reason)) {
        if !seen.contains(&limit) {
            *counts.entry(limit.clone()).or_insert(0) += 1;
            seen.push(limit);
        }
    }
}

/// Run one strategy over a trace. `progress` is called with the share of jobs finished (0..=1)
/// now and then.
///
/// The replay goes on after the last job ends, deciding as before, until every worker is
/// released or the strategy's [`Strategy::longest_keep_alive_s`] plus one decision interval has
/// passed; what is still up then is retired and billed to that point. A worker's keep-alive
/// after the last job is spent on AWS too: a replay that stopped billing at the last job would
/// leave out the very idle time keep-alive policies differ in.
pub fn run(
    trace: &Trace,
    offerings: &[Offering],
    strategy: &mut dyn Strategy,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(f64),
) -> RunReport {
    let started = Instant::now();
    strategy.start_run();
    let pcfg = strategy.config().clone();
    // `act`'s fallback rankings over the replay's one catalogue and configuration.
    let act_table = onoff_policy::choice::PriceTable::new(offerings, &pcfg.offers);
    let lane_names: Vec<String> = pcfg.lanes.iter().map(|l| l.name.clone()).collect();
    let t0 = trace.start_unix_s;
    let deadlines = if cfg.deadline_fraction > 0.0 {
        assign_deadlines(trace, cfg.deadline_fraction, cfg.deadline_slack, cfg.seed)
    } else {
        Vec::new()
    };
    let zones = zone_names(offerings);
    let offering_zone: Vec<usize> = offerings
        .iter()
        .map(|o| zones.binary_search(&o.key.zone).unwrap_or(0))
        .collect();
    let measured = match &cfg.preemptions {
        Preemptions::Advisor => None,
        Preemptions::Measured(m) => Some(m.clone()),
    };
    // Project names once each; jobs refer to them by index.
    let mut projects: Vec<String> = Vec::new();
    let mut project_index: HashMap<&str, u32> = HashMap::new();
    let job_project: Vec<u32> = trace
        .jobs
        .iter()
        .map(|j| {
            *project_index.entry(j.project.as_str()).or_insert_with(|| {
                projects.push(j.project.clone());
                (projects.len() - 1) as u32
            })
        })
        .collect();
    drop(project_index);
    let mut world = World {
        now: t0,
        rng: StdRng::seed_from_u64(cfg.seed),
        agenda: Agenda::default(),
        jobs: trace
            .jobs
            .iter()
            .enumerate()
            .zip(crate::job_shapes(trace, offerings, &pcfg, cfg))
            .map(|((i, j), (gpi, n))| JobSim {
                arrival: t0 + j.arrival_s,
                remaining: j.duration_s,
                gpus_per_instance: gpi,
                instances: n,
                project: job_project[i],
                started_first: f64::NAN,
                done: false,
                finished_at: 0.0,
                deadline: deadlines.get(i).copied().flatten().map_or(f64::INFINITY, |d| t0 + d),
                epoch: 0,
                run_start: 0.0,
                run_speed: 1.0,
                run_workers: Vec::new(),
            })
            .collect(),
        projects,
        idle_set: BTreeSet::new(),
        queued: VecDeque::new(),
        queued_idx: VecDeque::new(),
        workers: Vec::new(),
        wsim: Vec::new(),
        by_num: vec![NO_WORKER],
        next_num: 0,
        lanes: vec![LaneObservation::default(); lane_names.len()],
        unavailable: Vec::new(),
        offerings: offerings.to_vec(),
        offering_index: offerings.iter().enumerate().map(|(i, o)| (o.key.clone(), i)).collect(),
        offering_zone,
        offering_label: offerings
            .iter()
            .map(|o| format!("{}/{}", o.key.instance_type, o.key.capacity_type.as_str()))
            .collect(),
        measured,
        zones: Vec::new(),
        t0,
        lane_names,
        cfg: cfg.clone(),
        cost: 0.0,
        on_demand_usd: 0.0,
        idle_gpu_s: 0.0,
        idle_usd: 0.0,
        boot_gpu_s: 0.0,
        boot_usd: 0.0,
        launches: 0,
        restarts: 0,
        stopped_usd: 0.0,
        launches_by_offering: Default::default(),
        billed_by_offering: vec![(0.0, 0.0); offerings.len()],
        capacity_errors: 0,
        spot_unavailable_errors: 0,
        interruptions: 0,
        lost_gpu_s: 0.0,
        busy_terminations: 0,
        completed: 0,
        last_completion: t0,
        run_times: RecentRunTimes::default(),
        runtime_prior: None,
        estimate_given: None,
        tail_usd: 0.0,
        running_jobs: 0,
        fleet_index: FleetIndex::default(),
        fleet_hint: FleetHint::default(),
        onoff_agent: strategy.runs_onoff_agent(),
        spot_reference: offerings
            .iter()
            .map(|o| {
                (o.key.capacity_type == CapacityType::OnDemand)
                    .then(|| choice::best_spot_price_usd_per_h(offerings, o.gpus, o.gpu_memory_gib, &pcfg.offers))
                    .flatten()
            })
            .collect(),
        lane_spot: pcfg.lanes.iter().map(|l| l.capacity.may_use_spot()).collect(),
        reserved: HashMap::new(),
        starting: HashMap::new(),
    };
    // Arrivals are fed from the (sorted) trace as the clock reaches them, so the agenda stays
    // small; at equal times an arrival goes first, as if it had been queued first. A hand-made
    // trace out of order is read through a stable order by arrival.
    let order: Option<Vec<u32>> = (!world.jobs.windows(2).all(|p| p[0].arrival <= p[1].arrival)).then(|| {
        let mut o: Vec<u32> = (0..world.jobs.len() as u32).collect();
        o.sort_by(|&a, &b| {
            world.jobs[a as usize]
                .arrival
                .total_cmp(&world.jobs[b as usize].arrival)
        });
        o
    });
    let job_at = |k: usize| order.as_ref().map_or(k, |o| o[k] as usize);
    let mut next_arrival = 0usize;
    drop(deadlines);
    drop(job_project);
    let mapping = cfg.preemptions.zone_mapping(offerings);
    world.start_zones(&mapping);
    world.push(t0, Ev::Tick);
    let total_jobs = world.jobs.len() as u64;
    let last_arrival = world.jobs.iter().map(|j| j.arrival).fold(t0, f64::max);
    let horizon = last_arrival + cfg.horizon_after_last_arrival_s;
    let tick_s = strategy.tick_s();
    // After the last job ends, workers idle out their keep-alive as they would on AWS, and are
    // billed for it; the next decision after the longest keep-alive would have released them.
    let tail_s = match strategy.longest_keep_alive_s() {
        k if k > 0.0 => k + tick_s,
        _ => 0.0,
    };
    let on_submit = strategy.decides_on_submit();
    let handles_notice = strategy.handles_notice();
    // The warm pool's window demand kept arrival by arrival instead of scanned per decision.
    let sim_lane = world.lane_index(&cfg.lane);
    world.runtime_prior = pcfg.lanes.get(sim_lane).and_then(|l| l.default_runtime_s);
    if let Some(lc) = pcfg.lanes.get(sim_lane).filter(|lc| lc.predictive_max > 0) {
        world.lanes[sim_lane].demand_windows = Some(DemandWindows::new(
            lc.predictive_window_s,
            lc.predictive_lookback_s,
            (pcfg.offers.short_job_horizon_s, pcfg.offers.default_runtime_s),
        ));
    }
    let world = RefCell::new(world);
    let mut decisions = 0u64;
    let mut held_by_limit: BTreeMap<String, u64> = BTreeMap::new();
    let mut timeline = Vec::new();
    let mut next_minute = 0u64;
    let mut reported = 0u64;

    loop {
        let ev = {
            let mut w = world.borrow_mut();
            let all_done = w.completed == total_jobs;
            if all_done && (tail_s == 0.0 || w.wsim.is_empty()) {
                break;
            }
            let arrival_first = next_arrival < w.jobs.len() && {
                let a = w.jobs[job_at(next_arrival)].arrival;
                w.agenda.next_at().is_none_or(|t| a <= t)
            };
            let ev = if arrival_first {
                let job = job_at(next_arrival);
                let at = w.jobs[job].arrival;
                next_arrival += 1;
                Event {
                    at,
                    ev: Ev::Arrival(job),
                }
            } else {
                let Some((at, ev)) = w.agenda.pop() else { break };
                Event { at, ev }
            };
            if ev.at > horizon || (all_done && ev.at > w.last_completion + tail_s) {
                break;
            }
            if cfg.timeline {
                while (t0 + next_minute as f64 * 60.0) <= ev.at {
                    timeline.push(w.timeline_row(next_minute));
                    next_minute += 1;
                }
            }
            w.now = ev.at;
            ev
        };
        let mut decide_now = false;
        match ev.ev {
            Ev::Arrival(job) => {
                let mut w = world.borrow_mut();
                let lane = w.lane_index(&cfg.lane);
                let (gpus, runtime) = (w.jobs[job].gpus_per_instance, w.jobs[job].remaining);
                let known = w.runtime_known(runtime);
                w.lanes[lane].record_arrival_with_runtime(gpus, ev.at, known);
                w.enqueue(job);
                w.dispatch(&pcfg);
                decide_now = on_submit;
            }
            Ev::BootDone(num) => {
                let mut w = world.borrow_mut();
                if let Some(i) = w.worker_idx(num) {
                    if w.workers[i].state == WorkerState::Pending {
                        let now = w.now;
                        w.change_worker(i, |w| {
                            w.state = WorkerState::Idle;
                            w.idle_since = Some(now);
                            w.project = None;
                        });
                        w.wsim[i].idle_from = Some(now);
                        if !w.start_pinned(i, &pcfg) {
                            w.list_idle(i);
                        }
                        w.dispatch(&pcfg);
                    }
                }
            }
            Ev::JobDone { job, epoch } => {
                let mut w = world.borrow_mut();
                if !w.jobs[job].done && w.jobs[job].epoch == epoch {
                    w.finish_job(job);
                    w.dispatch(&pcfg);
                }
            }
            Ev::Notice(_) if !handles_notice => {}
            Ev::ZoneFlip(z) => world.borrow_mut().zone_flip(z),
            Ev::Notice(num) => {
                let (id, key, job) = {
                    let w = world.borrow();
                    match w.worker_idx(num) {
                        Some(i) => (w.workers[i].id.clone(), w.workers[i].offering.clone(), w.wsim[i].job),
                        None => continue,
                    }
                };
                let ports = SimPorts(&world);
                let now = ev.at;
                // The control plane's own notice handling: Draining + offering unavailable.
                let _ = pollster::block_on(handle_interruption_notice(&ports, &ports, &pcfg, &id, &key, now));
                let mut w = world.borrow_mut();
                if let Some(i) = w.worker_idx(num) {
                    // Draining (set by the notice handler) is not idle time.
                    if let Some(from) = w.wsim[i].idle_from.take() {
                        w.idle_gpu_s += (now - from) * w.workers[i].gpus as f64;
                        w.idle_usd += (now - from) * w.workers[i].price_usd_per_h / 3600.0;
                    }
                }
                if let Some(job) = job {
                    // The agent releases the job for resume from its checkpoint.
                    w.preempt_job(job, cfg.checkpoint_on_notice);
                    // Other workers of a multi-instance job went back to Idle: give them work.
                    w.dispatch(&pcfg);
                }
                decide_now = true;
            }
            Ev::Interrupt(num) => {
                let mut w = world.borrow_mut();
                if w.worker_idx(num).is_some() {
                    w.interruptions += 1;
                    w.remove_worker(num, true);
                    w.dispatch(&pcfg);
                }
            }
            Ev::Tick => {
                decide_now = true;
                let mut w = world.borrow_mut();
                let next = w.now + tick_s;
                w.push(next, Ev::Tick);
            }
        }
        if decide_now {
            decisions += 1;
            let plan = {
                let mut w = world.borrow_mut();
                let now = w.now;
                w.unavailable.retain(|u| u.until > now);
                // Every trace job runs in one lane: its in-flight count is the running jobs.
                let (lane, running) = (w.lane_index(&cfg.lane), w.running_jobs);
                w.lanes[lane].backlog.in_flight = running;
                w.refresh_estimates(pcfg.offers.short_job_horizon_s);
                if let Some(d) = &mut w.lanes[lane].demand_windows {
                    d.advance(now);
                }
                let w = &mut *w;
                w.fleet_index
                    .hint(now, pcfg.offers.short_job_horizon_s, &mut w.fleet_hint);
                #[cfg(debug_assertions)]
                {
                    let until = now + pcfg.offers.short_job_horizon_s + 1.0;
                    let named: Vec<usize> = (0..w.workers.len())
                        .filter(|&i| match (w.workers[i].state, w.workers[i].busy_until) {
                            (WorkerState::Idle | WorkerState::Pending, _) => true,
                            (WorkerState::Running, Some(t)) => t < until,
                            _ => false,
                        })
                        .collect();
                    assert_eq!(w.fleet_hint.visit, named, "visit list at {now}");
                    let stopped: Vec<usize> = (0..w.workers.len())
                        .filter(|&i| w.workers[i].state == WorkerState::Stopped)
                        .collect();
                    assert_eq!(w.fleet_hint.stopped, stopped, "stopped list at {now}");
                    for (shape, ends) in &w.fleet_hint.running_ends {
                        let mut pass: Vec<f64> = w
                            .workers
                            .iter()
                            .filter(|v| (v.lane, v.gpus) == *shape && v.state == WorkerState::Running)
                            .filter_map(|v| v.busy_until)
                            .collect();
                        pass.sort_unstable_by(f64::total_cmp);
                        assert_eq!(*ends, pass, "running ends of {shape:?} at {now}");
                    }
                    let shapes = w
                        .workers
                        .iter()
                        .filter(|v| v.state == WorkerState::Running && v.busy_until.is_some());
                    for v in shapes {
                        assert!(
                            w.fleet_hint.running_ends.iter().any(|(s, _)| *s == (v.lane, v.gpus)),
                            "running ends of ({}, {}) missing at {now}",
                            v.lane,
                            v.gpus
                        );
                    }
                }
                let obs = Observation {
                    lanes: &w.lanes,
                    jobs: w.queued.make_contiguous(),
                    workers: &w.workers,
                    offerings: &w.offerings,
                    unavailable: &w.unavailable,
                    fleet: Some(&w.fleet_hint),
                };
                strategy.decide(&obs, now)
            };
            count_held_for_limits(&plan, &mut held_by_limit);
            if !plan.actions.is_empty() {
                let (unavailable, now, estimate) = {
                    let w = world.borrow();
                    let estimate = (!w.cfg.declared_runtimes).then(|| w.undeclared_runtime()).flatten();
                    (w.unavailable.clone(), w.now, estimate)
                };
                // The run time the deployed control plane writes on the rows of the workers it
                // launches or starts, for their agents: the estimate the policy was given (every
                // lane: the replay's jobs share one). Declared run times: no job needs it.
                let estimates: Vec<(String, f64)> = estimate
                    .map(|e| pcfg.lanes.iter().map(|l| (l.name.clone(), e)).collect())
                    .unwrap_or_default();
                let ports = SimPorts(&world);
                let ctx = ActContext {
                    cfg: &pcfg,
                    offerings,
                    unavailable: &unavailable,
                    now,
                    table: Some(&act_table),
                    run_time_estimates: &estimates,
                };
                let _ = pollster::block_on(act(&plan, ctx, &ports, &ports, &ports));
            }
            // Every decision re-offers the queued jobs to the idle workers, as a deployment's
            // agents are offered a job again and again (a job an agent hands back is woken again
            // after its 30 s retry delay): placement rules that change as a job waits (whether
            // an on-demand worker's premium is worth the wait, a deadline's slack) are applied
            // again, not only when a worker or a job comes.
            world.borrow_mut().dispatch(&pcfg);
        }
        let done = world.borrow().completed;
        if done * 100 / total_jobs.max(1) > reported {
            reported = done * 100 / total_jobs.max(1);
            progress(done as f64 / total_jobs.max(1) as f64);
        }
    }

    // End: retire whatever is left at the end of the keep-alive tail (or now, if jobs were lost).
    let mut w = world.into_inner();
    let end = if w.completed == total_jobs {
        w.last_completion
    } else {
        w.now
    };
    if w.completed == total_jobs {
        w.now = end + tail_s;
    }
    let nums: Vec<u64> = w.wsim.iter().map(|s| s.num).collect();
    let retire_at = w.now;
    for num in nums {
        if let Some(i) = w.worker_idx(num) {
            // A job still running at the end is lost, not preempted.
            w.wsim[i].job = None;
            // A stopped worker's volume bills until the policy would terminate it: its stopped
            // keep-alive (hours) is not replayed tick by tick after the last job.
            w.now = match (w.wsim[i].stopped_from, w.workers[i].stopped_until) {
                (Some(_), Some(until)) => until.max(retire_at),
                _ => retire_at,
            };
        }
        w.remove_worker(num, true);
    }
    let mut waits: Vec<f64> = w
        .jobs
        .iter()
        .filter(|j| !j.started_first.is_nan())
        .map(|j| j.started_first - j.arrival)
        .collect();
    waits.sort_by(f64::total_cmp);
    let pct = |q: f64| -> f64 {
        if waits.is_empty() {
            return 0.0;
        }
        let idx = ((q * waits.len() as f64).ceil() as usize).clamp(1, waits.len()) - 1;
        waits[idx]
    };
    let job_waits: Vec<JobWait> = if cfg.timeline {
        w.jobs
            .iter()
            .zip(&trace.jobs)
            .filter(|(j, _)| !j.started_first.is_nan())
            .map(|(j, t)| JobWait {
                job: t.id,
                arrival_s: t.arrival_s,
                gpus: t.gpus,
                instances: j.instances,
                run_s: t.duration_s,
                wait_s: j.started_first - j.arrival,
            })
            .collect()
    } else {
        Vec::new()
    };
    let completed = w.completed;
    let (mut deadline_jobs, mut deadlines_missed, mut deadlines_need_warm) = (0u64, 0u64, 0u64);
    let (mut deadlines_with_slack, mut deadlines_missed_with_slack) = (0u64, 0u64);
    for (j, t) in w.jobs.iter().zip(&trace.jobs).filter(|(j, _)| j.deadline.is_finite()) {
        deadline_jobs += 1;
        let missed = !j.done || j.finished_at > j.deadline;
        let slack = j.deadline - j.arrival - t.duration_s;
        deadlines_missed += u64::from(missed);
        deadlines_need_warm += u64::from(slack < cfg.boot_min_s);
        if slack >= cfg.boot_max_s {
            deadlines_with_slack += 1;
            deadlines_missed_with_slack += u64::from(missed);
        }
    }
    RunReport {
        name: strategy.name().to_string(),
        total_usd: w.cost,
        usd_per_job: if completed > 0 { w.cost / completed as f64 } else { 0.0 },
        on_demand_usd: w.on_demand_usd,
        idle_gpu_hours: w.idle_gpu_s / 3600.0,
        boot_gpu_hours: w.boot_gpu_s / 3600.0,
        idle_usd: w.idle_usd,
        keep_alive_tail_usd: w.tail_usd,
        boot_usd: w.boot_usd,
        launches: w.launches,
        restarts: w.restarts,
        stopped_usd: w.stopped_usd,
        launches_by_offering: std::mem::take(&mut w.launches_by_offering),
        spend_by_offering: spend_by_offering(&w.offering_label, &w.billed_by_offering),
        capacity_errors: w.capacity_errors,
        spot_unavailable_errors: w.spot_unavailable_errors,
        wait_p50_s: pct(0.50),
        wait_p95_s: pct(0.95),
        wait_p99_s: pct(0.99),
        wait_mean_s: if waits.is_empty() {
            0.0
        } else {
            waits.iter().sum::<f64>() / waits.len() as f64
        },
        jobs_completed: completed,
        jobs_lost: total_jobs - completed,
        interruptions: w.interruptions,
        lost_work_gpu_hours: w.lost_gpu_s / 3600.0,
        busy_terminations: w.busy_terminations,
        decisions,
        held_by_limit,
        makespan_s: end - t0,
        deadline_jobs,
        deadlines_missed,
        deadlines_need_warm,
        deadlines_with_slack,
        deadlines_missed_with_slack,
        cost_vs_all_on_demand: None,
        wall_s: started.elapsed().as_secs_f64(),
        timeline,
        job_waits,
    }
}

#[cfg(test)]
mod tests {
    use super::{instance_id, worker_num};

    #[test]
    fn instance_ids_read_back_as_their_number() {
        for num in [0, 1, 42, 9_999_999_999, 10_000_000_000, u64::MAX] {
            let id = instance_id(num);
            assert_eq!(id, format!("i-sim{num:010}"));
            assert_eq!(worker_num(&id), Some(num), "{id}");
        }
        for other in [
            "i-sim42",
            "i-sim+000000042",
            "i-0123456789abcdef0",
            "job-3",
            "i-sim00000000x1",
            "",
        ] {
            assert_eq!(worker_num(other), None, "{other}");
        }
    }
}
