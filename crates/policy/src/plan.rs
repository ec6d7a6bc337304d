//! The output of `decide`: actions as data, each with the reason it was taken.

use serde::Serialize;

use crate::config::CapacityPreference;
use crate::observation::LaneId;
use crate::offering::OfferingKey;

/// Why an action was taken (or held back). Shown in logs and in the simulator's timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// The lane had no workers and its backlog reached the activation threshold (0 -> 1).
    Activation {
        /// Lane backlog (jobs).
        backlog: u32,
    },
    /// Queued jobs that no idle or booting worker can take (1 -> N).
    UnmetBacklog {
        /// Jobs without capacity in the lane.
        unmet_jobs: u32,
    },
    /// Filling the warm pool to its scheduled size.
    WarmPool {
        /// Workers worth launching for the pool now (the scheduled size or the predictive
        /// target for a launch, whichever is larger).
        target: u32,
        /// Ready (idle or booting) workers before this launch.
        ready: u32,
    },
    /// A job's deadline is at risk on spot: its capacity is launched on-demand.
    DeadlineAtRisk {
        /// The job.
        job: String,
        /// Seconds of slack left (deadline - now - expected runtime).
        slack_s: f64,
    },
    /// An idle worker outlived the keep-alive.
    KeepAliveExpired {
        /// Seconds the worker has been idle.
        idle_s: f64,
        /// The keep-alive in force, seconds.
        keep_alive_s: f64,
    },
    /// A stopped worker outlived its stopped keep-alive: its volume costs more than the cold
    /// starts it may still save ([`crate::keepalive::stopped_keep_s`]).
    StoppedKeepAliveExpired {
        /// Seconds the worker has been stopped.
        stopped_s: f64,
        /// The stopped keep-alive in force, seconds.
        keep_s: f64,
    },
    /// Cooldown with decay released this worker at a decay step.
    DecayStep {
        /// Seconds the worker has been idle.
        idle_s: f64,
        /// The step it was released at, seconds (e.g. 600 or 1800).
        step_s: f64,
    },
    /// A booting worker is no longer needed: nothing is queued for it and the warm pool is full.
    PendingNotNeeded,
    /// An idle worker none of the lane's queued jobs fits held a place the worker cap keeps
    /// from them: it goes before its keep-alive ran out, so they can be launched for.
    MakeRoom {
        /// The lane's jobs the cap held back.
        held_jobs: u32,
        /// The cap that held them (the lane's or the fleet's `max_workers`).
        limit: u32,
    },
    /// An idle worker of one lane held a place under the fleet's worker cap
    /// (`limits.max_workers_total`) that jobs of other lanes wait for, lanes whose own cap has
    /// room: it goes before its keep-alive ran out, so they can be launched for.
    MakeRoomForLanes {
        /// The other lanes' jobs the fleet's cap alone held back.
        held_jobs: u32,
        /// The fleet's cap, `limits.max_workers_total`.
        limit: u32,
    },
    /// The budget breaker is tripped: the fleet spends more than the cap.
    BudgetBreaker {
        /// Current spend rate, $/h.
        spend_usd_per_h: f64,
        /// The cap, $/h.
        cap_usd_per_h: f64,
    },
    /// Manual freeze: no launches.
    Frozen,
    /// Capacity limited by the lane's or the fleet's maximum workers.
    MaxWorkers {
        /// The limit that bound.
        limit: u32,
    },
    /// A project's GPU quota is reached.
    ProjectQuota {
        /// The project.
        project: String,
        /// Its maximum GPUs.
        max_gpus: u32,
    },
    /// A job type's concurrency cap is reached.
    JobTypeCap {
        /// The job type.
        job_type: String,
        /// Its cap.
        cap: u32,
    },
    /// No offering passes the filters (GPUs, memory, price, reliability, availability).
    NoOffering {
        /// GPUs per instance asked for.
        gpus: u32,
        /// GPU memory per GPU asked for, GiB (the job's or the config's floor, the larger).
        min_gpu_memory_gib: f64,
    },
    /// Spot capacity for the job is unavailable, and on-demand would cost more than the job's
    /// wait is worth so far: it waits for spot (see `decide::scale_up::spot_only`).
    WaitingForSpot {
        /// Expected extra cost of the job on on-demand over spot, $.
        on_demand_premium_usd: f64,
        /// Seconds the job has waited.
        waited_s: f64,
    },
    /// The offerings worth a job's wait are out of capacity: each one left costs the job more
    /// than the best offering (availability ignored) by more than its wait is worth so far
    /// (see `decide::scale_up`'s cost ceiling). It waits for the cheaper ones to come back.
    WaitingForCapacity {
        /// Expected extra cost of the job on the best offering left over the best one, $.
        premium_usd: f64,
        /// Seconds the job has waited.
        waited_s: f64,
    },
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Activation { backlog } => write!(f, "activation: backlog {backlog} on an empty lane"),
            Reason::UnmetBacklog { unmet_jobs } => write!(f, "{unmet_jobs} queued job(s) without capacity"),
            Reason::WarmPool { target, ready } => write!(f, "warm pool {ready}/{target}"),
            Reason::DeadlineAtRisk { job, slack_s } => {
                write!(f, "deadline of {job} at risk on spot (slack {slack_s:.0} s)")
            }
            Reason::KeepAliveExpired { idle_s, keep_alive_s } => {
                write!(f, "idle {idle_s:.0} s > keep-alive {keep_alive_s:.0} s")
            }
            Reason::StoppedKeepAliveExpired { stopped_s, keep_s } => {
                write!(f, "stopped {stopped_s:.0} s > stopped keep-alive {keep_s:.0} s")
            }
            Reason::DecayStep { idle_s, step_s } => {
                write!(f, "cooldown decay step at {step_s:.0} s (idle {idle_s:.0} s)")
            }
            Reason::PendingNotNeeded => write!(f, "booting worker no longer needed"),
            Reason::MakeRoom { held_jobs, limit } => write!(
                f,
                "idle, fits none of the {held_jobs} job(s) held at max workers {limit}: room made"
            ),
            Reason::MakeRoomForLanes { held_jobs, limit } => write!(
                f,
                "idle, while the fleet's max workers {limit} holds {held_jobs} job(s) of other lanes: room made"
            ),
            Reason::BudgetBreaker {
                spend_usd_per_h,
                cap_usd_per_h,
            } => {
                write!(
                    f,
                    "budget breaker: {spend_usd_per_h:.2} $/h over cap {cap_usd_per_h:.2} $/h"
                )
            }
            Reason::Frozen => write!(f, "manual freeze"),
            Reason::MaxWorkers { limit } => write!(f, "max workers {limit} reached"),
            Reason::ProjectQuota { project, max_gpus } => {
                write!(f, "project {project} at its quota of {max_gpus} GPUs")
            }
            Reason::JobTypeCap { job_type, cap } => write!(f, "job type {job_type} at its cap of {cap}"),
            Reason::NoOffering {
                gpus,
                min_gpu_memory_gib,
            } => {
                write!(f, "no eligible offering with >= {gpus} GPUs")?;
                if *min_gpu_memory_gib > 0.0 {
                    write!(f, " of >= {min_gpu_memory_gib} GiB each")?;
                }
                Ok(())
            }
            Reason::WaitingForSpot {
                on_demand_premium_usd,
                waited_s,
            } => write!(
                f,
                "waiting for spot: on-demand ${on_demand_premium_usd:.2} dearer, waited {waited_s:.0} s"
            ),
            Reason::WaitingForCapacity { premium_usd, waited_s } => write!(
                f,
                "waiting for capacity: the offerings left are ${premium_usd:.2} dearer, waited {waited_s:.0} s"
            ),
        }
    }
}

/// The shape a launch was chosen for (GPUs, memory, capacity types).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LaunchShape {
    /// GPUs per instance asked for.
    pub gpus: u32,
    /// Minimum GPU memory per GPU, GiB.
    pub min_gpu_memory_gib: f64,
    /// Capacity types allowed.
    pub capacity: CapacityPreference,
    /// Expected job run time on the reference GPU, seconds (for ranking fallbacks).
    pub runtime_s: f64,
    /// The most a fallback may cost, $ per instance of a job
    /// (`choice::expected_cost_per_job` with one instance): the best offering's cost for the
    /// job, availability ignored, plus what its wait is worth
    /// (`wait_value_usd_per_h x (waited + unavailable_ttl_s) / 3600`), divided by its
    /// instances. A fallback type dearer than that is not taken: the job waits for capacity
    /// instead. `None`: no ceiling (warm capacity, a deadline at risk, the baselines).
    pub max_cost_usd: Option<f64>,
}

/// One thing to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Launch `count` instances of `offering` for `lane`.
    Launch {
        /// Lane the new workers serve.
        lane: LaneId,
        /// Offering to launch.
        offering: OfferingKey,
        /// Its price, $/h.
        price_usd_per_h: f64,
        /// Number of instances.
        count: u32,
        /// What the capacity is for, so a launch that fails with a capacity error can fall back to
        /// the next eligible offering.
        request: LaunchShape,
        /// Project the capacity is launched for (charged to its quota while booting), if any.
        project: Option<String>,
        /// The job the capacity is launched for when it is pinned (deadline moves), if any.
        job: Option<String>,
        /// Why.
        reason: Reason,
    },
    /// Start a stopped worker again for `lane`: capacity as a launch would give it, in about
    /// `offers.restart_estimate_s` instead of a cold start. When the start fails (no capacity
    /// for its type in its zone), `control::act` marks its offering unavailable and launches one
    /// instance for `request` instead, as it falls back from a launch; when it is refused because
    /// the instance is still stopping, `control::act` launches nothing while the stop is recent
    /// (the next decision starts it, see `stopped_at`).
    Start {
        /// Worker id (EC2 instance id).
        worker: String,
        /// Lane it serves.
        lane: LaneId,
        /// Its offering.
        offering: OfferingKey,
        /// The price it was launched at, $/h.
        price_usd_per_h: f64,
        /// What the capacity is for (the fallback launch's shape and cost ceiling).
        request: LaunchShape,
        /// Project the capacity is for, if any.
        project: Option<String>,
        /// The job it is pinned to (a deadline at risk on spot), if any.
        job: Option<String>,
        /// When the worker was stopped (its [`crate::observation::WorkerView::idle_since`]), unix
        /// seconds, if known. A start refused because the instance is still stopping is held
        /// (nothing launched for it) while less than `offers.boot_estimate_s -
        /// offers.restart_estimate_s` has passed since: a start after the stop still comes sooner
        /// than a cold start would.
        stopped_at: Option<f64>,
        /// Until when it was to be kept stopped (its [`crate::observation::WorkerView::stopped_until`]),
        /// unix seconds, if known: a start that fails puts it back on the worker with `stopped_at`,
        /// so the worker is kept, and held for, as before the start.
        stopped_until: Option<f64>,
        /// When it was launched, or last started (its [`crate::observation::WorkerView::launched_at`]),
        /// unix seconds: a start that fails puts it back too, so the stopped worker's row keeps
        /// its own launch time (the reconciler's launch grace and `onoff cost`'s idle estimate
        /// count from it), as the simulator, where a refused start changes nothing, keeps it.
        launched_at: f64,
        /// Why.
        reason: Reason,
    },
    /// Stop an idle worker whose keep-alive ran out instead of terminating it: it costs its
    /// volume only, and a start brings it back faster than a launch.
    Stop {
        /// Worker id.
        worker: String,
        /// How long to keep it stopped, seconds: then it is terminated
        /// ([`crate::keepalive::stopped_keep_s`] for its place in line when stopped).
        keep_s: f64,
        /// When it was launched, or last started (its [`crate::observation::WorkerView::launched_at`]),
        /// unix seconds: the run the stop ends began then, and its row adds that run to the
        /// instance time it has been billed for (`onoff cost`'s idle workers).
        launched_at: f64,
        /// Why.
        reason: Reason,
    },
    /// Terminate an idle or stopped worker.
    Terminate {
        /// Worker id.
        worker: String,
        /// Why.
        reason: Reason,
    },
    /// Cancel a launch that has not finished booting.
    CancelLaunch {
        /// Worker id.
        worker: String,
        /// Why.
        reason: Reason,
    },
}

impl Action {
    /// The reason attached to the action.
    pub fn reason(&self) -> &Reason {
        match self {
            Action::Launch { reason, .. }
            | Action::Start { reason, .. }
            | Action::Stop { reason, .. }
            | Action::Terminate { reason, .. }
            | Action::CancelLaunch { reason, .. } => reason,
        }
    }
}

/// Something the policy wanted and did not do, with the limit that stopped it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Held {
    /// Lane concerned.
    pub lane: LaneId,
    /// Jobs (or workers) held back.
    pub count: u32,
    /// The limit.
    pub reason: Reason,
}

/// Per-lane figures the plan hands to workers and logs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LanePlan {
    /// Queued jobs the lane's idle and booting workers cannot take.
    pub unmet_jobs: u32,
    /// Warm-pool size scheduled now.
    pub warm_target: u32,
}

/// The decision: actions plus what was held back.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Plan {
    /// Actions to carry out, in order.
    pub actions: Vec<Action>,
    /// Wants not acted on, with the limit that stopped them.
    pub held: Vec<Held>,
    /// One entry per lane.
    pub lanes: Vec<LanePlan>,
}

impl Plan {
    /// Instances the plan launches.
    pub fn launches(&self) -> u32 {
        self.actions
            .iter()
            .map(|a| {
                if let Action::Launch { count, .. } = a {
                    *count
                } else {
                    0
                }
            })
            .sum()
    }

    /// Worker ids the plan terminates, cancels or stops: idle or booting workers it gives up.
    pub fn releases(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().filter_map(|a| match a {
            Action::Terminate { worker, .. } | Action::CancelLaunch { worker, .. } | Action::Stop { worker, .. } => {
                Some(worker.as_str())
            }
            Action::Launch { .. } | Action::Start { .. } => None,
        })
    }

    /// Stopped workers the plan starts.
    pub fn starts(&self) -> u32 {
        self.actions
            .iter()
            .filter(|a| matches!(a, Action::Start { .. }))
            .count() as u32
    }
}
