//! The discrete-event engine: a virtual clock, a simulated fleet, and a strategy deciding.
//!
//! Events (arrival, boot done, job done, spot notice, spot interruption, decision tick) are
//! processed in time order. Decisions run the strategy's `decide`, and plans are carried out by
//! the real [`onoff_control::act()`] through simulated ports, so capacity-error fallback, the
//! unavailable-offering TTL and the interruption-notice handling are the control plane's own code.
//!
//! Billing follows EC2 Linux: per second from launch (boot and model load included) to
//! termination, with a 60-second minimum.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use onoff_control::ports::{
    Fleet, FleetError, FleetErrorKind, LaunchRequest, LaunchResult, Launched, OfferingAvailability, StoreError,
    WorkerRecord, WorkerRegistry,
};
use onoff_control::{act, handle_interruption_notice, ActContext};
use onoff_policy::choice::{fits, speed};
use onoff_policy::{
    CapacityType, LaneObservation, Observation, Offering, OfferingKey, PendingJob, Plan, PolicyConfig,
    UnavailableOffering, WorkerState, WorkerView,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::trace::Trace;

/// Simulation settings (the world, not the policy).
#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    /// RNG seed: same seed, same run.
    pub seed: u64,
    /// Shortest cold start, seconds. Default 180 s (seed: GPU cold start "3-10 minutes").
    pub boot_min_s: f64,
    /// Longest cold start, seconds; boot times are uniform between the two. Default 600 s.
    pub boot_max_s: f64,
    /// Probability that one launch call fails with InsufficientCapacity. Default 0.02 (assumption).
    pub capacity_error_rate: f64,
    /// Spot interruptions at the Spot Advisor bucket rates. Default true.
    pub interruptions: bool,
    /// Multiplier on the bucket interruption rates (stress tests). Default 1.0.
    pub interruption_rate_factor: f64,
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
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            boot_min_s: 180.0,
            boot_max_s: 600.0,
            capacity_error_rate: 0.02,
            interruptions: true,
            interruption_rate_factor: 1.0,
            notice_s: 120.0,
            checkpoint_interval_s: 600.0,
            checkpoint_on_notice: false,
            max_gpus_per_instance: 8,
            lane: "standard".into(),
            horizon_after_last_arrival_s: 60.0 * 86_400.0,
            timeline: false,
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
    /// Decide.
    fn decide(&mut self, obs: &Observation<'_>, now: f64) -> Plan;
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
    /// Spend rate, $/h.
    pub usd_per_h: f64,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Strategy name.
    pub name: String,
    /// Total billed, $.
    pub total_usd: f64,
    /// `total_usd / jobs_completed`.
    pub usd_per_job: f64,
    /// GPU-hours of workers that were ready with no job.
    pub idle_gpu_hours: f64,
    /// GPU-hours billed while booting.
    pub boot_gpu_hours: f64,
    /// Part of `total_usd` billed while workers were idle, $.
    pub idle_usd: f64,
    /// Part of `total_usd` billed while workers were booting, $.
    pub boot_usd: f64,
    /// Instances launched.
    pub launches: u64,
    /// Instances launched per `type/capacity-type`.
    pub launches_by_offering: std::collections::BTreeMap<String, u64>,
    /// Launch calls that failed with a capacity error.
    pub capacity_errors: u64,
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
    /// Virtual seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// Per-minute timeline, when recorded.
    #[serde(skip)]
    pub timeline: Vec<TimelineRow>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ev {
    Arrival(usize),
    BootDone(u64),
    JobDone { job: usize, epoch: u32 },
    Notice(u64),
    Interrupt(u64),
    Tick,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    at: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.seq == o.seq
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap on (time, seq).
        o.at.total_cmp(&self.at).then(o.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Clone)]
struct JobSim {
    arrival: f64,
    /// Work left on the reference GPU, seconds.
    remaining: f64,
    gpus_per_instance: u32,
    instances: u32,
    project: String,
    started_first: Option<f64>,
    done: bool,
    epoch: u32,
    /// Current run: start time, speed, workers.
    run_start: f64,
    run_speed: f64,
    run_workers: Vec<u64>,
}

#[derive(Debug, Clone)]
struct WorkerSim {
    num: u64,
    gpu_model: String,
    ready_at: f64,
    job: Option<usize>,
    idle_from: Option<f64>,
}

/// The simulated world behind the ports.
struct World {
    now: f64,
    rng: StdRng,
    heap: BinaryHeap<Event>,
    seq: u64,
    jobs: Vec<JobSim>,
    queued: Vec<PendingJob>,
    queued_idx: Vec<usize>,
    workers: Vec<WorkerView>,
    wsim: Vec<WorkerSim>,
    by_num: HashMap<u64, usize>,
    by_id: HashMap<String, u64>,
    next_num: u64,
    lanes: Vec<LaneObservation>,
    unavailable: Vec<UnavailableOffering>,
    offerings: Vec<Offering>,
    offering_index: HashMap<OfferingKey, usize>,
    lane_names: Vec<String>,
    cfg: SimConfig,
    // Accounting.
    cost: f64,
    idle_gpu_s: f64,
    idle_usd: f64,
    boot_gpu_s: f64,
    boot_usd: f64,
    launches: u64,
    launches_by_offering: std::collections::BTreeMap<String, u64>,
    capacity_errors: u64,
    interruptions: u64,
    lost_gpu_s: f64,
    busy_terminations: u64,
    completed: u64,
    last_completion: f64,
    running_jobs: u32,
}

impl World {
    fn push(&mut self, at: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Event { at, seq: self.seq, ev });
    }

    fn lane_index(&self, name: &str) -> usize {
        self.lane_names.iter().position(|l| l == name).unwrap_or(0)
    }

    fn worker_idx(&self, num: u64) -> Option<usize> {
        self.by_num.get(&num).copied()
    }

    /// A launch call over several offerings: each offering independently lacks capacity with
    /// probability `capacity_error_rate`; the count is spread round-robin over the others.
    fn launch(&mut self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        let mut res = LaunchResult::default();
        let mut ok: Vec<Offering> = Vec::new();
        for k in &req.offerings {
            let Some(o) = self.offering_index.get(k).map(|&i| self.offerings[i].clone()) else {
                return Err(FleetError {
                    kind: FleetErrorKind::Other,
                    message: format!("unknown offering {k}"),
                });
            };
            if self.rng.random::<f64>() < self.cfg.capacity_error_rate {
                self.capacity_errors += 1;
                res.short.push((
                    k.clone(),
                    FleetError {
                        kind: FleetErrorKind::InsufficientCapacity,
                        message: format!("InsufficientInstanceCapacity (simulated) for {k}"),
                    },
                ));
            } else {
                ok.push(o);
            }
        }
        if ok.is_empty() {
            return Err(res.short.swap_remove(0).1);
        }
        let n = ok.len() as u32;
        for (i, o) in ok.iter().enumerate() {
            let count = req.count / n + u32::from((i as u32) < req.count % n);
            res.launched
                .extend(self.launch_offering(o, &req.lane, req.project.as_ref(), count));
        }
        Ok(res)
    }

    /// Create `count` instances of `o`: Pending, boot done after a random cold start.
    fn launch_offering(&mut self, o: &Offering, lane: &str, project: Option<&String>, count: u32) -> Vec<Launched> {
        let lane = self.lane_index(lane);
        let mut out = Vec::new();
        for _ in 0..count {
            self.next_num += 1;
            let num = self.next_num;
            let id = format!("i-sim{num:010}");
            let boot = self
                .rng
                .random_range(self.cfg.boot_min_s..=self.cfg.boot_max_s.max(self.cfg.boot_min_s));
            let spot = o.key.capacity_type == CapacityType::Spot;
            self.workers.push(WorkerView {
                id: id.clone(),
                seq: num,
                lane,
                offering: o.key.clone(),
                gpus: o.gpus,
                gpu_memory_gib: o.gpu_memory_gib,
                price_usd_per_h: o.price_usd_per_h,
                state: WorkerState::Pending,
                launched_at: self.now,
                idle_since: None,
                project: project.cloned(),
                job_type: None,
                busy_until: None,
            });
            self.wsim.push(WorkerSim {
                num,
                gpu_model: o.gpu_model.clone(),
                ready_at: self.now + boot,
                job: None,
                idle_from: None,
            });
            self.by_num.insert(num, self.workers.len() - 1);
            self.by_id.insert(id.clone(), num);
            self.push(self.now + boot, Ev::BootDone(num));
            if spot && self.cfg.interruptions {
                let rate = o.interruption_rate_per_s() * self.cfg.interruption_rate_factor;
                if rate > 0.0 {
                    let u: f64 = self.rng.random::<f64>().max(1e-300);
                    let t = -u.ln() / rate;
                    let at = self.now + t;
                    self.push((at - self.cfg.notice_s).max(self.now), Ev::Notice(num));
                    self.push(at, Ev::Interrupt(num));
                }
            }
            self.launches += 1;
            *self
                .launches_by_offering
                .entry(format!("{}/{}", o.key.instance_type, o.key.capacity_type.as_str()))
                .or_default() += 1;
            out.push(Launched {
                instance_id: id,
                offering: o.key.clone(),
            });
        }
        out
    }

    /// Remove a worker: bill it, requeue its job if it had one.
    fn remove_worker(&mut self, num: u64, interrupted: bool) {
        let Some(i) = self.worker_idx(num) else { return };
        let w = &self.workers[i];
        let ws = &self.wsim[i];
        let billed = (self.now - w.launched_at).max(60.0);
        self.cost += w.price_usd_per_h * billed / 3600.0;
        let boot = (ws.ready_at.min(self.now) - w.launched_at).max(0.0);
        self.boot_gpu_s += boot * w.gpus as f64;
        self.boot_usd += boot * w.price_usd_per_h / 3600.0;
        if let Some(from) = ws.idle_from {
            self.idle_gpu_s += (self.now - from) * w.gpus as f64;
            self.idle_usd += (self.now - from) * w.price_usd_per_h / 3600.0;
        }
        if let Some(job) = ws.job {
            if !interrupted {
                self.busy_terminations += 1;
            }
            self.preempt_job(job, false);
        }
        let id = self.workers[i].id.clone();
        self.by_id.remove(&id);
        self.by_num.remove(&num);
        self.workers.swap_remove(i);
        self.wsim.swap_remove(i);
        if i < self.workers.len() {
            let moved = self.wsim[i].num;
            self.by_num.insert(moved, i);
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
        for num in workers {
            if let Some(i) = self.worker_idx(num) {
                self.wsim[i].job = None;
                self.workers[i].project = None;
                if self.workers[i].state == WorkerState::Running {
                    self.workers[i].state = WorkerState::Idle;
                    self.workers[i].idle_since = Some(self.now);
                    self.wsim[i].idle_from = Some(self.now);
                }
            }
        }
        self.enqueue(job);
    }

    fn enqueue(&mut self, job: usize) {
        let j = &self.jobs[job];
        let lane = self.lane_index(&self.cfg.lane);
        self.queued.push(PendingJob {
            id: format!("job-{job}"),
            lane,
            project: j.project.clone(),
            job_type: None,
            gpus_per_instance: j.gpus_per_instance,
            instances: j.instances,
            min_gpu_memory_gib: 0.0,
            est_runtime_s: Some(j.remaining),
            deadline: None,
            enqueued_at: self.now,
        });
        self.queued_idx.push(job);
        self.lanes[lane].backlog.visible += 1;
    }

    /// Give idle workers queued jobs they fit, oldest job first (workers pulling from the queue).
    fn dispatch(&mut self, pcfg: &PolicyConfig) {
        if self.queued.is_empty() {
            return;
        }
        let mut idle: Vec<usize> = (0..self.workers.len())
            .filter(|&i| self.workers[i].state == WorkerState::Idle)
            .collect();
        let mut qi = 0;
        while qi < self.queued.len() && !idle.is_empty() {
            let pj = &self.queued[qi];
            let min_mem = pj.min_gpu_memory_gib.max(pcfg.offers.min_gpu_memory_gib);
            let need = pj.instances.max(1) as usize;
            // Smallest fitting idle workers of the lane.
            let mut cands: Vec<usize> = idle
                .iter()
                .copied()
                .filter(|&i| {
                    let w = &self.workers[i];
                    w.lane == pj.lane
                        && fits(
                            w.gpus,
                            w.gpu_memory_gib,
                            pj.gpus_per_instance,
                            min_mem,
                            pcfg.offers.max_gpu_oversize,
                        )
                })
                .collect();
            if cands.len() < need {
                qi += 1;
                continue;
            }
            cands.sort_by_key(|&i| (self.workers[i].gpus, self.workers[i].seq));
            cands.truncate(need);
            idle.retain(|i| !cands.contains(i));
            let pj = self.queued.remove(qi);
            let job = self.queued_idx.remove(qi);
            self.lanes[pj.lane].backlog.visible -= 1;
            self.start_job(job, &cands, pcfg);
        }
    }

    fn start_job(&mut self, job: usize, workers: &[usize], pcfg: &PolicyConfig) {
        let mut sp = f64::INFINITY;
        let mut nums = Vec::with_capacity(workers.len());
        for &i in workers {
            let now = self.now;
            let w = &mut self.workers[i];
            let ws = &mut self.wsim[i];
            if let Some(from) = ws.idle_from.take() {
                self.idle_gpu_s += (now - from) * w.gpus as f64;
                self.idle_usd += (now - from) * w.price_usd_per_h / 3600.0;
            }
            w.state = WorkerState::Running;
            w.idle_since = None;
            w.project = Some(self.jobs[job].project.clone());
            ws.job = Some(job);
            sp = sp.min(speed(&pcfg.offers, &ws.gpu_model));
            nums.push(ws.num);
        }
        let j = &mut self.jobs[job];
        j.started_first.get_or_insert(self.now);
        j.run_start = self.now;
        j.run_speed = sp;
        j.run_workers = nums;
        let epoch = j.epoch;
        let at = self.now + j.remaining / sp;
        for &i in workers {
            self.workers[i].busy_until = Some(at);
        }
        self.running_jobs += 1;
        self.push(at, Ev::JobDone { job, epoch });
    }

    fn finish_job(&mut self, job: usize) {
        let workers = std::mem::take(&mut self.jobs[job].run_workers);
        self.jobs[job].done = true;
        self.jobs[job].remaining = 0.0;
        self.completed += 1;
        self.running_jobs -= 1;
        self.last_completion = self.now;
        for num in workers {
            if let Some(i) = self.worker_idx(num) {
                self.wsim[i].job = None;
                let w = &mut self.workers[i];
                w.project = None;
                if w.state == WorkerState::Running {
                    w.state = WorkerState::Idle;
                    w.idle_since = Some(self.now);
                    self.wsim[i].idle_from = Some(self.now);
                }
            }
        }
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
            usd_per_h: 0.0,
        };
        for w in &self.workers {
            r.usd_per_h += w.price_usd_per_h;
            match w.state {
                WorkerState::Pending => r.pending += 1,
                WorkerState::Running => r.busy += 1,
                WorkerState::Idle => r.idle += 1,
                WorkerState::Draining | WorkerState::Terminating => r.draining += 1,
            }
        }
        r
    }
}

/// The simulated ports over the world.
struct SimPorts<'a>(&'a RefCell<World>);

impl Fleet for SimPorts<'_> {
    async fn launch(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        self.0.borrow_mut().launch(req)
    }
    async fn terminate(&self, ids: &[String]) -> Result<(), FleetError> {
        let mut w = self.0.borrow_mut();
        for id in ids {
            if let Some(num) = w.by_id.get(id).copied() {
                w.remove_worker(num, false);
            }
        }
        Ok(())
    }
    async fn cancel_launch(&self, ids: &[String]) -> Result<(), FleetError> {
        self.terminate(ids).await
    }
}

impl WorkerRegistry for SimPorts<'_> {
    async fn register_launch(&self, _record: WorkerRecord) -> Result<(), StoreError> {
        // The simulated fleet keeps the worker table itself.
        Ok(())
    }
    async fn set_state(&self, id: &str, state: WorkerState) -> Result<(), StoreError> {
        let mut w = self.0.borrow_mut();
        let num = *w.by_id.get(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        let i = w.worker_idx(num).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        w.workers[i].state = state;
        Ok(())
    }
    async fn set_state_if(&self, id: &str, to: WorkerState, from: &[WorkerState]) -> Result<bool, StoreError> {
        let mut w = self.0.borrow_mut();
        let num = *w.by_id.get(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        let i = w.worker_idx(num).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if !from.contains(&w.workers[i].state) {
            return Ok(false);
        }
        w.workers[i].state = to;
        Ok(true)
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

/// Split a trace job's GPUs over instances: `g <= max` runs on one instance, larger jobs on
/// `ceil(g / max)` instances of `max` GPUs each. Returns (GPUs per instance, instances).
pub fn job_shape(gpus: u32, max_gpus_per_instance: u32) -> (u32, u32) {
    let g = gpus.max(1);
    if g <= max_gpus_per_instance {
        (g, 1)
    } else {
        (max_gpus_per_instance, g.div_ceil(max_gpus_per_instance))
    }
}

/// Run one strategy over a trace. `progress` is called with the share of jobs finished (0..=1)
/// now and then.
pub fn run(
    trace: &Trace,
    offerings: &[Offering],
    strategy: &mut dyn Strategy,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(f64),
) -> RunReport {
    let pcfg = strategy.config().clone();
    let lane_names: Vec<String> = pcfg.lanes.iter().map(|l| l.name.clone()).collect();
    let t0 = trace.start_unix_s;
    let mut world = World {
        now: t0,
        rng: StdRng::seed_from_u64(cfg.seed),
        heap: BinaryHeap::new(),
        seq: 0,
        jobs: trace
            .jobs
            .iter()
            .map(|j| {
                let (gpi, n) = job_shape(j.gpus, cfg.max_gpus_per_instance);
                JobSim {
                    arrival: t0 + j.arrival_s,
                    remaining: j.duration_s,
                    gpus_per_instance: gpi,
                    instances: n,
                    project: j.project.clone(),
                    started_first: None,
                    done: false,
                    epoch: 0,
                    run_start: 0.0,
                    run_speed: 1.0,
                    run_workers: Vec::new(),
                }
            })
            .collect(),
        queued: Vec::new(),
        queued_idx: Vec::new(),
        workers: Vec::new(),
        wsim: Vec::new(),
        by_num: HashMap::new(),
        by_id: HashMap::new(),
        next_num: 0,
        lanes: vec![LaneObservation::default(); lane_names.len()],
        unavailable: Vec::new(),
        offerings: offerings.to_vec(),
        offering_index: offerings.iter().enumerate().map(|(i, o)| (o.key.clone(), i)).collect(),
        lane_names,
        cfg: cfg.clone(),
        cost: 0.0,
        idle_gpu_s: 0.0,
        idle_usd: 0.0,
        boot_gpu_s: 0.0,
        boot_usd: 0.0,
        launches: 0,
        launches_by_offering: Default::default(),
        capacity_errors: 0,
        interruptions: 0,
        lost_gpu_s: 0.0,
        busy_terminations: 0,
        completed: 0,
        last_completion: t0,
        running_jobs: 0,
    };
    // Arrivals are fed from the (sorted) trace as the clock reaches them, so the event heap stays
    // small; at equal times an arrival goes first, as if it had been queued first.
    let mut arrivals: Vec<(f64, usize)> = world.jobs.iter().enumerate().map(|(i, j)| (j.arrival, i)).collect();
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut next_arrival = 0usize;
    world.push(t0, Ev::Tick);
    let total_jobs = world.jobs.len() as u64;
    let last_arrival = world.jobs.iter().map(|j| j.arrival).fold(t0, f64::max);
    let horizon = last_arrival + cfg.horizon_after_last_arrival_s;
    let tick_s = strategy.tick_s();
    let on_submit = strategy.decides_on_submit();
    let world = RefCell::new(world);
    let mut decisions = 0u64;
    let mut timeline = Vec::new();
    let mut next_minute = 0u64;
    let mut reported = 0u64;

    loop {
        let ev = {
            let mut w = world.borrow_mut();
            if w.completed == total_jobs {
                break;
            }
            let arrival_first = arrivals
                .get(next_arrival)
                .is_some_and(|&(a, _)| w.heap.peek().is_none_or(|top| a <= top.at));
            let ev = if arrival_first {
                let (at, job) = arrivals[next_arrival];
                next_arrival += 1;
                Event {
                    at,
                    seq: 0,
                    ev: Ev::Arrival(job),
                }
            } else {
                let Some(ev) = w.heap.pop() else { break };
                ev
            };
            if ev.at > horizon {
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
                w.lanes[lane].record_arrival_with_runtime(gpus, ev.at, Some(runtime));
                w.enqueue(job);
                w.dispatch(&pcfg);
                decide_now = on_submit;
            }
            Ev::BootDone(num) => {
                let mut w = world.borrow_mut();
                if let Some(i) = w.worker_idx(num) {
                    if w.workers[i].state == WorkerState::Pending {
                        let now = w.now;
                        w.workers[i].state = WorkerState::Idle;
                        w.workers[i].idle_since = Some(now);
                        w.workers[i].project = None;
                        w.wsim[i].idle_from = Some(now);
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
                let obs = Observation {
                    lanes: &w.lanes,
                    jobs: &w.queued,
                    workers: &w.workers,
                    offerings: &w.offerings,
                    unavailable: &w.unavailable,
                };
                strategy.decide(&obs, now)
            };
            if !plan.actions.is_empty() {
                let (unavailable, now) = {
                    let w = world.borrow();
                    (w.unavailable.clone(), w.now)
                };
                let ports = SimPorts(&world);
                let ctx = ActContext {
                    cfg: &pcfg,
                    offerings,
                    unavailable: &unavailable,
                    now,
                };
                let _ = pollster::block_on(act(&plan, ctx, &ports, &ports, &ports));
                world.borrow_mut().dispatch(&pcfg);
            }
        }
        let done = world.borrow().completed;
        if done * 100 / total_jobs.max(1) > reported {
            reported = done * 100 / total_jobs.max(1);
            progress(done as f64 / total_jobs.max(1) as f64);
        }
    }

    // End: retire whatever is left at the last completion (or now, if jobs were lost).
    let mut w = world.into_inner();
    let end = if w.completed == total_jobs {
        w.last_completion
    } else {
        w.now
    };
    w.now = end;
    let nums: Vec<u64> = w.wsim.iter().map(|s| s.num).collect();
    for num in nums {
        if let Some(i) = w.worker_idx(num) {
            // A job still running at the end is lost, not preempted.
            w.wsim[i].job = None;
        }
        w.remove_worker(num, true);
    }
    let mut waits: Vec<f64> = w
        .jobs
        .iter()
        .filter_map(|j| j.started_first.map(|s| s - j.arrival))
        .collect();
    waits.sort_by(f64::total_cmp);
    let pct = |q: f64| -> f64 {
        if waits.is_empty() {
            return 0.0;
        }
        let idx = ((q * waits.len() as f64).ceil() as usize).clamp(1, waits.len()) - 1;
        waits[idx]
    };
    let completed = w.completed;
    RunReport {
        name: strategy.name().to_string(),
        total_usd: w.cost,
        usd_per_job: if completed > 0 { w.cost / completed as f64 } else { 0.0 },
        idle_gpu_hours: w.idle_gpu_s / 3600.0,
        boot_gpu_hours: w.boot_gpu_s / 3600.0,
        idle_usd: w.idle_usd,
        boot_usd: w.boot_usd,
        launches: w.launches,
        launches_by_offering: std::mem::take(&mut w.launches_by_offering),
        capacity_errors: w.capacity_errors,
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
        makespan_s: end - t0,
        timeline,
    }
}
