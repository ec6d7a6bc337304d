//! Small builders shared by the integration tests: offerings, workers, jobs, a one-lane config and
//! observations, all from bare numbers.
#![allow(dead_code)]

use onoff_policy::{
    decide, Action, CapacityType, InterruptionBucket, LaneConfig, LaneObservation, Observation, Offering, OfferingKey,
    PendingJob, Plan, PolicyConfig, Reason, UnavailableOffering, WorkerState, WorkerView,
};

/// Midnight UTC (2023-11-14 00:00:00).
pub const DAY0: f64 = 1_699_920_000.0;
/// Noon UTC of [`DAY0`]: the default "now" of the tests.
pub const NOW: f64 = DAY0 + 12.0 * 3600.0;
/// Zone of every test offering.
pub const ZONE: &str = "us-east-1a";

/// Offering key from bare values.
pub fn key(instance_type: &str, capacity_type: CapacityType) -> OfferingKey {
    OfferingKey {
        instance_type: instance_type.into(),
        zone: ZONE.into(),
        capacity_type,
    }
}

/// One offering; spot offerings get the most reliable interruption bucket.
pub fn offering(instance_type: &str, cap: CapacityType, gpus: u32, model: &str, mem_gib: f64, price: f64) -> Offering {
    Offering {
        key: key(instance_type, cap),
        gpus,
        gpu_model: model.into(),
        gpu_memory_gib: mem_gib,
        vcpus: 4 * gpus,
        price_usd_per_h: price,
        interruption: (cap == CapacityType::Spot).then_some(InterruptionBucket::Under5),
    }
}

pub const G5: &str = "g5.xlarge";
pub const G6: &str = "g6.xlarge";
pub const G5_12X: &str = "g5.12xlarge";
pub const P4D: &str = "p4d.24xlarge";

/// The test catalogue: two 1-GPU types (g5.xlarge $0.10 spot / $0.50 on-demand, g6.xlarge $0.13 /
/// $0.65, i.e. 30 % dearer, outside the default 15 % diversify tolerance, so launches do not
/// spread over both), a 4-GPU type and an 8-GPU type. One spot bucket (`<5%`) each.
pub fn offerings() -> Vec<Offering> {
    use CapacityType::{OnDemand, Spot};
    vec![
        offering(G5, Spot, 1, "NVIDIA A10G", 24.0, 0.10),
        offering(G5, OnDemand, 1, "NVIDIA A10G", 24.0, 0.50),
        offering(G6, Spot, 1, "NVIDIA L4", 24.0, 0.13),
        offering(G6, OnDemand, 1, "NVIDIA L4", 24.0, 0.65),
        offering(G5_12X, Spot, 4, "NVIDIA A10G", 24.0, 1.60),
        offering(G5_12X, OnDemand, 4, "NVIDIA A10G", 24.0, 5.60),
        offering(P4D, Spot, 8, "NVIDIA A100", 40.0, 10.0),
        offering(P4D, OnDemand, 8, "NVIDIA A100", 40.0, 32.0),
    ]
}

/// (instance type, GPU memory, spot price) of the spot offering a worker with `gpus` GPUs runs on.
fn worker_offering(gpus: u32) -> (&'static str, f64, f64) {
    match gpus {
        1 => (G5, 24.0, 0.10),
        4 => (G5_12X, 24.0, 1.60),
        8 => (P4D, 40.0, 10.0),
        2 => ("g2.gpu2", 24.0, 0.25),
        _ => ("other.gpu", 24.0, 0.25 * gpus as f64),
    }
}

/// A worker in lane 0 on the spot offering of its GPU count (see [`offerings`]), no project.
pub fn worker(
    id: &str,
    seq: u64,
    state: WorkerState,
    gpus: u32,
    launched_at: f64,
    idle_since: Option<f64>,
) -> WorkerView {
    let (ty, mem, price) = worker_offering(gpus);
    WorkerView {
        id: id.into(),
        seq,
        lane: 0,
        offering: key(ty, CapacityType::Spot),
        gpus,
        gpu_memory_gib: mem,
        price_usd_per_h: price,
        state,
        launched_at,
        idle_since,
        project: None,
        job_type: None,
        busy_until: None,
        pinned_job: None,
        spot_price_usd_per_h: None,
        stopped_until: None,
        cached_projects: Vec::new(),
    }
}

/// A running 1-GPU worker launched an hour before [`NOW`].
pub fn running(id: &str) -> WorkerView {
    worker(id, 0, WorkerState::Running, 1, NOW - 3600.0, None)
}

/// An idle 1-GPU worker launched two hours before [`NOW`], idle for `idle_for` seconds.
pub fn idle(id: &str, seq: u64, idle_for: f64) -> WorkerView {
    worker(id, seq, WorkerState::Idle, 1, NOW - 7200.0, Some(NOW - idle_for))
}

/// A queued job in lane 0, project `p`, one instance, no memory ask, no runtime, no deadline.
pub fn job(id: &str, gpus: u32, enqueued_at: f64) -> PendingJob {
    PendingJob {
        id: id.into(),
        lane: 0,
        project: "p".into(),
        job_type: None,
        gpus_per_instance: gpus,
        instances: 1,
        min_gpu_memory_gib: 0.0,
        est_runtime_s: None,
        deadline: None,
        enqueued_at,
    }
}

/// `n` 1-GPU jobs enqueued a minute before [`NOW`], ids `{prefix}{i}`.
pub fn jobs(prefix: &str, n: usize) -> Vec<PendingJob> {
    (0..n).map(|i| job(&format!("{prefix}{i}"), 1, NOW - 60.0)).collect()
}

/// A config with the one lane "standard" (default lane settings) and every other knob at its
/// default, but idle workers terminated, not stopped (`scale_down.stop_idle = never`): most
/// tables are of the keep-alive's first slope; the stopped workers' own tests
/// ([`stopping_cfg`]) turn stopping on.
pub fn cfg() -> PolicyConfig {
    let mut c = stopping_cfg();
    c.scale_down.stop_idle = onoff_policy::StopIdle::Never;
    c
}

/// [`cfg`] with idle workers stopped as the default configuration stops them.
pub fn stopping_cfg() -> PolicyConfig {
    PolicyConfig {
        lanes: vec![LaneConfig {
            name: "standard".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Lane observation with `visible` messages waiting and `in_flight` being processed.
pub fn lane(visible: u32, in_flight: u32) -> LaneObservation {
    let mut l = LaneObservation::default();
    l.backlog.visible = visible;
    l.backlog.in_flight = in_flight;
    l
}

/// An observation over borrowed slices.
pub fn obs<'a>(
    lanes: &'a [LaneObservation],
    jobs: &'a [PendingJob],
    workers: &'a [WorkerView],
    offerings: &'a [Offering],
    unavailable: &'a [UnavailableOffering],
) -> Observation<'a> {
    Observation {
        lanes,
        jobs,
        workers,
        offerings,
        unavailable,
        fleet: None,
    }
}

/// Owned inputs of one observation, for tests that build them step by step.
#[derive(Debug, Clone)]
pub struct World {
    pub lanes: Vec<LaneObservation>,
    pub jobs: Vec<PendingJob>,
    pub workers: Vec<WorkerView>,
    pub offerings: Vec<Offering>,
    pub unavailable: Vec<UnavailableOffering>,
}

impl World {
    /// One lane whose backlog is the queued jobs (visible) plus the running workers (in flight),
    /// the test catalogue, nothing unavailable.
    pub fn new(jobs: Vec<PendingJob>, workers: Vec<WorkerView>) -> Self {
        let in_flight = workers.iter().filter(|w| w.state == WorkerState::Running).count() as u32;
        Self {
            lanes: vec![lane(jobs.len() as u32, in_flight)],
            jobs,
            workers,
            offerings: offerings(),
            unavailable: Vec::new(),
        }
    }

    /// The observation borrowing this world.
    pub fn obs(&self) -> Observation<'_> {
        obs(
            &self.lanes,
            &self.jobs,
            &self.workers,
            &self.offerings,
            &self.unavailable,
        )
    }

    /// `decide` on this world.
    pub fn decide(&self, cfg: &PolicyConfig, now: f64) -> Plan {
        decide(&self.obs(), cfg, now)
    }
}

/// Launch actions as (offering key, count, reason, job).
pub fn launch_list(plan: &Plan) -> Vec<(&OfferingKey, u32, &Reason, Option<&str>)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::Launch {
                offering,
                count,
                reason,
                job,
                ..
            } => Some((offering, *count, reason, job.as_deref())),
            _ => None,
        })
        .collect()
}

/// Instances launched for `project`.
pub fn launched_for(plan: &Plan, project: &str) -> u32 {
    plan.actions
        .iter()
        .map(|a| match a {
            Action::Launch {
                count,
                project: Some(p),
                ..
            } if p == project => *count,
            _ => 0,
        })
        .sum()
}

/// Ids of terminated workers, in plan order.
pub fn terminated(plan: &Plan) -> Vec<&str> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::Terminate { worker, .. } => Some(worker.as_str()),
            _ => None,
        })
        .collect()
}

/// Ids of cancelled launches, in plan order.
pub fn cancelled(plan: &Plan) -> Vec<&str> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::CancelLaunch { worker, .. } => Some(worker.as_str()),
            _ => None,
        })
        .collect()
}

/// Total count held back for reasons matching `pred`.
pub fn held_count(plan: &Plan, pred: impl Fn(&Reason) -> bool) -> u32 {
    plan.held.iter().filter(|h| pred(&h.reason)).map(|h| h.count).sum()
}
