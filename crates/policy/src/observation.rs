//! What the policy sees: backlog per lane, queued jobs, workers, offerings and recent arrival gaps.
//!
//! The observation borrows slices so that a caller (the reconciler, the simulator) can keep them
//! up to date incrementally and hand them over without copying.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::offering::{Offering, OfferingKey};

/// Index of a lane in [`crate::PolicyConfig::lanes`].
pub type LaneId = usize;

/// Backlog of one lane as the queue reports it (SQS: ApproximateNumberOfMessages, ...NotVisible, ...Delayed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneBacklog {
    /// Messages waiting to be received.
    pub visible: u32,
    /// Messages received by a worker and not yet deleted (jobs running or being claimed).
    pub in_flight: u32,
    /// Messages sent with a delay that are not yet visible.
    pub delayed: u32,
}

impl LaneBacklog {
    /// Backlog as KEDA's SQS scaler counts it: visible + in flight, plus delayed when `count_delayed`.
    pub fn total(&self, count_delayed: bool) -> u32 {
        self.visible + self.in_flight + if count_delayed { self.delayed } else { 0 }
    }
}

/// A queued job the policy may need capacity for (not yet running).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingJob {
    /// Job id (opaque).
    pub id: String,
    /// Lane the job was submitted to.
    pub lane: LaneId,
    /// Project (tenant) the job is billed to.
    pub project: String,
    /// Optional job type, for per-type concurrency caps.
    pub job_type: Option<String>,
    /// GPUs needed on each instance (>= 1).
    pub gpus_per_instance: u32,
    /// Instances the job needs at once (1 unless it is a multi-node job).
    pub instances: u32,
    /// Minimum GPU memory per GPU, GiB (0 = any).
    pub min_gpu_memory_gib: f64,
    /// Expected run time on the reference GPU, seconds, if the submitter declared one.
    pub est_runtime_s: Option<f64>,
    /// Absolute deadline, seconds on the same clock as `now`, if any.
    pub deadline: Option<f64>,
    /// When the job entered the queue, seconds on the same clock as `now`.
    pub enqueued_at: f64,
}

/// Lifecycle state of a worker (one instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WorkerState {
    /// Launched, still booting (pulling the image, loading the model). Counts as capacity.
    Pending,
    /// Running a job.
    Running,
    /// Ready and without a job.
    Idle,
    /// Got a spot interruption notice or rebalance recommendation: takes no new work.
    Draining,
    /// Termination requested.
    Terminating,
}

/// One worker as the policy sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerView {
    /// Worker id (EC2 instance id).
    pub id: String,
    /// Monotonic launch sequence number (e.g. launch time in ms); used for stable ordering.
    pub seq: u64,
    /// Lane the worker serves.
    pub lane: LaneId,
    /// The offering it was launched from.
    pub offering: OfferingKey,
    /// GPUs on the instance.
    pub gpus: u32,
    /// GPU memory per GPU, GiB.
    pub gpu_memory_gib: f64,
    /// Price the worker is billed at, $/h.
    pub price_usd_per_h: f64,
    /// Current state.
    pub state: WorkerState,
    /// When the instance was launched, seconds.
    pub launched_at: f64,
    /// When the worker last became idle (Idle state only), seconds.
    pub idle_since: Option<f64>,
    /// Project of the job it runs, or the project it was launched for while Pending.
    pub project: Option<String>,
    /// Job type of the job it runs.
    pub job_type: Option<String>,
}

impl WorkerView {
    /// True while the worker is billed and not on its way out.
    pub fn is_live(&self) -> bool {
        !matches!(self.state, WorkerState::Draining | WorkerState::Terminating)
    }
}

/// An offering that recently failed with a capacity error and must not be used until `until`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnavailableOffering {
    /// The offering.
    pub key: OfferingKey,
    /// Seconds (same clock as `now`) until which it is skipped.
    pub until: f64,
}

/// Histogram of inter-arrival gaps of one lane, in log-spaced buckets.
///
/// Kept by the caller (updated with [`GapHistogram::record`] on each arrival) so that the policy can
/// read a quantile in O(buckets) without sorting samples. Bucket `i` covers gaps up to
/// `GAP_BUCKET_BASE_S * GAP_BUCKET_GROWTH^i` seconds: 1 s to about 1.5 days in 48 buckets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GapHistogram {
    counts: Vec<u64>,
    total: u64,
}

/// Upper edge of the first gap bucket, seconds.
pub const GAP_BUCKET_BASE_S: f64 = 1.0;
/// Ratio between consecutive bucket edges (about 25 % wide buckets).
pub const GAP_BUCKET_GROWTH: f64 = 1.25;
const GAP_BUCKETS: usize = 48;

impl Default for GapHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; GAP_BUCKETS],
            total: 0,
        }
    }
}

impl GapHistogram {
    /// Record one inter-arrival gap, seconds (negative values count as 0).
    pub fn record(&mut self, gap_s: f64) {
        let g = gap_s.max(0.0);
        let idx = if g <= GAP_BUCKET_BASE_S {
            0
        } else {
            ((g / GAP_BUCKET_BASE_S).ln() / GAP_BUCKET_GROWTH.ln()).ceil() as usize
        };
        self.counts[idx.min(GAP_BUCKETS - 1)] += 1;
        self.total += 1;
    }

    /// Number of gaps recorded.
    pub fn samples(&self) -> u64 {
        self.total
    }

    /// Upper edge (seconds) of the bucket holding quantile `q` (0..=1), or `None` with no samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let want = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(GAP_BUCKET_BASE_S * GAP_BUCKET_GROWTH.powi(i as i32));
            }
        }
        Some(GAP_BUCKET_BASE_S * GAP_BUCKET_GROWTH.powi(GAP_BUCKETS as i32 - 1))
    }

    /// Multiply every count by `factor` (0..1), so old gaps weigh less (exponential decay).
    pub fn decay(&mut self, factor: f64) {
        let mut total = 0;
        for c in &mut self.counts {
            *c = (*c as f64 * factor).floor() as u64;
            total += *c;
        }
        self.total = total;
    }
}

/// Per-lane facts the policy reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneObservation {
    /// Queue backlog of the lane.
    pub backlog: LaneBacklog,
    /// Inter-arrival gaps seen on the lane, one histogram per GPUs-per-instance shape of the
    /// arriving jobs (for the adaptive keep-alive: a worker cares about arrivals it can serve).
    pub gaps: BTreeMap<u32, ShapeGaps>,
    /// Recent arrivals as (unix seconds, GPUs per instance), oldest first, for the predictive warm
    /// pool. [`LaneObservation::record_arrival`] keeps the last [`RECENT_ARRIVALS_KEPT_S`].
    pub recent_arrivals: std::collections::VecDeque<(f64, u32)>,
}

/// How far back [`LaneObservation::recent_arrivals`] reaches, seconds (6 h: the longest
/// predictive look-back). Defined with the configuration it bounds.
pub use crate::config::RECENT_ARRIVALS_KEPT_S;

/// Arrival gaps of one job shape in a lane.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShapeGaps {
    /// Histogram of gaps, seconds.
    pub hist: GapHistogram,
    /// Time of the last arrival of this shape, unix seconds.
    pub last_arrival: Option<f64>,
}

impl LaneObservation {
    /// Record an arrival of a job asking `gpus` GPUs per instance at `at` (unix seconds). Record
    /// arrivals in time order.
    pub fn record_arrival(&mut self, gpus: u32, at: f64) {
        let g = self.gaps.entry(gpus).or_default();
        if let Some(prev) = g.last_arrival {
            g.hist.record(at - prev);
        }
        g.last_arrival = Some(at);
        self.recent_arrivals.push_back((at, gpus));
        while self
            .recent_arrivals
            .front()
            .is_some_and(|(t, _)| *t < at - RECENT_ARRIVALS_KEPT_S)
        {
            self.recent_arrivals.pop_front();
        }
    }

    /// Bursts seen lately, for arrivals whose GPUs per instance `fits` accepts, in
    /// `(now - lookback_s - window_s, now]`: (the largest number of arrivals in any `window_s`
    /// window, the number of separate bursts, i.e. runs of arrivals less than `window_s` apart).
    ///
    /// The scan stops early once the peak reaches `stop_at.0` and the bursts `stop_at.1` (the
    /// caller needs no more), so then both are lower bounds; `(u32::MAX, u32::MAX)` scans it all.
    pub fn recent_bursts(
        &self,
        now: f64,
        window_s: f64,
        lookback_s: f64,
        stop_at: (u32, u32),
        fits: impl Fn(u32) -> bool,
    ) -> (u32, u32) {
        // Arrivals are recorded in time order: find the range by binary search, then two cursors
        // walk it once without allocating.
        let q = &self.recent_arrivals;
        let start = q.partition_point(|(t, _)| *t <= now - lookback_s - window_s);
        let end = q.partition_point(|(t, _)| *t <= now);
        let (mut lo, mut in_window, mut peak, mut bursts, mut prev) = (start, 0u32, 0u32, 0u32, f64::NEG_INFINITY);
        for hi in start..end {
            let (t, g) = q[hi];
            if !fits(g) {
                continue;
            }
            if t - prev >= window_s {
                bursts += 1;
            }
            prev = t;
            in_window += 1;
            // Drop arrivals a window or more before this one.
            while lo < hi {
                let (tl, gl) = q[lo];
                if !fits(gl) {
                    lo += 1;
                } else if t - tl >= window_s {
                    in_window -= 1;
                    lo += 1;
                } else {
                    break;
                }
            }
            peak = peak.max(in_window);
            if peak >= stop_at.0 && bursts >= stop_at.1 {
                break;
            }
        }
        (peak, bursts)
    }

    /// Arrivals in `(now - window_s, now]` whose GPUs per instance `fits` accepts.
    pub fn arrivals_since(&self, now: f64, window_s: f64, fits: impl Fn(u32) -> bool) -> u32 {
        self.recent_arrivals
            .iter()
            .rev()
            .take_while(|(t, _)| *t > now - window_s)
            .filter(|(_, g)| fits(*g))
            .count() as u32
    }

    /// The gap histogram relevant to a worker with `worker_gpus` GPUs: the shape it fits with the
    /// most samples (`max_oversize` as in [`crate::shape::fits`]).
    pub fn gaps_for(&self, worker_gpus: u32, max_oversize: u32) -> Option<&GapHistogram> {
        self.gaps
            .iter()
            .filter(|(g, _)| crate::shape::fits(worker_gpus, 0.0, **g, 0.0, max_oversize))
            .map(|(_, s)| &s.hist)
            .max_by_key(|h| h.samples())
    }
}

/// Everything `decide` reads. All times are unix seconds (the simulator's virtual clock is unix
/// seconds too, starting at the trace's first arrival), so the warm-pool schedule can read the hour of day.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// One entry per configured lane, same order as `PolicyConfig::lanes`.
    pub lanes: &'a [LaneObservation],
    /// Queued (not yet running) jobs, any order.
    pub jobs: &'a [PendingJob],
    /// Every known worker that is not terminated.
    pub workers: &'a [WorkerView],
    /// Launchable offerings (catalogue with prices).
    pub offerings: &'a [Offering],
    /// Offerings that recently failed with a capacity error.
    pub unavailable: &'a [UnavailableOffering],
}
