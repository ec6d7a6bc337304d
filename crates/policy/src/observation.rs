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
    /// Stopped by the policy when its keep-alive ran out: the instance is not billed, its volume
    /// (the worker image and the model it loaded) is kept, and a start brings it back in about
    /// `offers.restart_estimate_s` instead of a cold start (`Action::Start`). Not live: it
    /// counts toward no limit until it is started. The second slope of the keep-alive's ski
    /// rental (`keepalive::stopped_keep_s`).
    Stopped,
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
    /// When the instance was launched, or last started from Stopped, seconds.
    pub launched_at: f64,
    /// When the worker last became idle (Idle state), or was stopped (Stopped state), seconds.
    pub idle_since: Option<f64>,
    /// Project of the job it runs, or the project it was launched for while Pending.
    pub project: Option<String>,
    /// Job type of the job it runs.
    pub job_type: Option<String>,
    /// When the job it runs is expected to end (Running, with a declared run time), unix seconds.
    /// A worker ending a job within the short-job horizon is capacity for short jobs (they queue
    /// behind it), so a stream of one-second items on busy workers launches nothing.
    #[serde(default)]
    pub busy_until: Option<f64>,
    /// The job it was launched for, if the launch was pinned to one (a deadline at risk on spot,
    /// [`crate::plan::Action::Launch`]'s `job`). While it boots and that job is queued, it is that
    /// job's capacity, not its lane's; its agent claims that job first.
    #[serde(default)]
    pub pinned_job: Option<String>,
    /// For an on-demand worker of a spot-first lane: the best spot price for its shape when it
    /// was launched, $/h per instance (availability ignored); `None` otherwise. A job takes such
    /// a worker only while its premium there is worth less than the launch and wait it saves
    /// ([`crate::choice::worth_an_on_demand_worker`]).
    #[serde(default)]
    pub spot_price_usd_per_h: Option<f64>,
    /// For a stopped worker: until when it is kept stopped, seconds (set when the policy stopped
    /// it, `Action::Stop`'s `keep_s` after its stop); then it is terminated. `None` otherwise, or
    /// for a stopped worker whose keep is not recorded (the break-even from its stop applies).
    #[serde(default)]
    pub stopped_until: Option<f64>,
    /// The projects whose cache its volume holds, most recently used first (its agent's
    /// `ONOFF_CACHE_DIR` directories, at most `onoff_control::ports::MAX_CACHED_PROJECTS`), as
    /// its agent last wrote them; empty when none or unknown. A stopped worker keeps them through its stop
    /// (the volume is EBS): among stopped workers equally cheap per job, one holding the
    /// project's cache is started for it first, so its job does not download again what the
    /// last one left (model weights, datasets, compiled kernels).
    #[serde(default)]
    pub cached_projects: Vec<String>,
}

impl WorkerState {
    /// Pending, running or idle: billed and not on its way out, so it counts toward the fleet.
    /// A stopped worker is not live until it is started.
    pub fn is_live(self) -> bool {
        !matches!(
            self,
            WorkerState::Draining | WorkerState::Terminating | WorkerState::Stopped
        )
    }
}

impl WorkerView {
    /// True while the worker is billed and not on its way out ([`WorkerState::is_live`]).
    pub fn is_live(&self) -> bool {
        self.state.is_live()
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

/// Histogram of inter-arrival gaps of one job shape, in log-spaced buckets, with exponential
/// decay: a gap recorded [`GAP_HALF_LIFE_S`] before another weighs half as much, so the quantiles
/// follow a workload that changes (a busy week after a quiet one).
///
/// Kept by the caller (updated with [`GapHistogram::record`] on each arrival) so that the policy can
/// read a quantile in O(buckets) without sorting samples. Bucket `i` covers gaps up to
/// `GAP_BUCKET_BASE_S * GAP_BUCKET_GROWTH^i` seconds: 1 s to about 1.5 days in 48 buckets.
/// Decay costs O(1) per record: a new gap is given weight `2^((at - epoch) / half-life)` instead of
/// every old weight being shrunk, and the weights are rescaled once they grow large.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GapHistogram {
    weights: Vec<f64>,
    total_weight: f64,
    samples: u64,
    /// Time the weights are relative to, seconds; NaN until the first record (written as JSON
    /// `null`, which is how serde_json writes a NaN, and read back as NaN).
    #[serde(deserialize_with = "nan_from_null")]
    epoch: f64,
}

/// A number, or NaN for `null` (serde_json writes NaN as `null` and refuses `null` for an `f64`).
fn nan_from_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Upper edge of the first gap bucket, seconds.
pub const GAP_BUCKET_BASE_S: f64 = 1.0;
/// Ratio between consecutive bucket edges (about 25 % wide buckets).
pub const GAP_BUCKET_GROWTH: f64 = 1.25;
/// Buckets of a [`GapHistogram`].
pub const GAP_BUCKETS: usize = 48;
/// Half-life of a recorded gap's weight, seconds. Defined with the configuration.
pub use crate::config::GAP_HALF_LIFE_S;

impl Default for GapHistogram {
    fn default() -> Self {
        Self {
            weights: vec![0.0; GAP_BUCKETS],
            total_weight: 0.0,
            samples: 0,
            epoch: f64::NAN,
        }
    }
}

impl GapHistogram {
    /// Upper edge of bucket `i` (< 48), seconds.
    pub fn bucket_edge_s(i: usize) -> f64 {
        Self::bucket_edges()[i.min(GAP_BUCKETS - 1)]
    }

    /// Every bucket's upper edge, seconds, in bucket order.
    fn bucket_edges() -> &'static [f64] {
        static EDGES: std::sync::LazyLock<Vec<f64>> = std::sync::LazyLock::new(|| {
            (0..GAP_BUCKETS)
                .map(|i| GAP_BUCKET_BASE_S * GAP_BUCKET_GROWTH.powi(i as i32))
                .collect()
        });
        &EDGES
    }

    /// Record one inter-arrival gap, seconds (negative values count as 0), that ended at `at`
    /// (seconds; record in time order).
    pub fn record(&mut self, gap_s: f64, at: f64) {
        let g = gap_s.max(0.0);
        let idx = if g <= GAP_BUCKET_BASE_S {
            0
        } else {
            ((g / GAP_BUCKET_BASE_S).ln() / GAP_BUCKET_GROWTH.ln()).ceil() as usize
        };
        if self.epoch.is_nan() {
            self.epoch = at;
        }
        let mut exp = (at - self.epoch) / GAP_HALF_LIFE_S;
        if exp > 500.0 {
            // Rescale before the weights overflow: same ratios, new epoch.
            let f = (-exp).exp2();
            self.weights.iter_mut().for_each(|w| *w *= f);
            self.total_weight *= f;
            self.epoch = at;
            exp = 0.0;
        }
        let w = exp.exp2();
        self.weights[idx.min(GAP_BUCKETS - 1)] += w;
        self.total_weight += w;
        self.samples += 1;
    }

    /// Number of gaps recorded (not decayed).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Share of the (decayed) weight in each bucket, in bucket order; all zero with no samples.
    pub fn masses(&self) -> impl Iterator<Item = f64> + '_ {
        let t = self.total_weight;
        self.weights.iter().map(move |w| if t > 0.0 { w / t } else { 0.0 })
    }

    /// Upper edge (seconds) of the bucket holding quantile `q` (0..=1) of the decayed weights, or
    /// `None` with no samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.samples == 0 || self.total_weight <= 0.0 {
            return None;
        }
        let want = q.clamp(0.0, 1.0) * self.total_weight * (1.0 - 1e-12);
        let mut seen = 0.0;
        for (i, w) in self.weights.iter().enumerate() {
            seen += w;
            if *w > 0.0 && seen >= want {
                return Some(Self::bucket_edge_s(i));
            }
        }
        Some(Self::bucket_edge_s(GAP_BUCKETS - 1))
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
    /// Recent arrivals, oldest first, for the predictive warm pool.
    /// [`LaneObservation::record_arrival`] keeps the last [`RECENT_ARRIVALS_KEPT_S`].
    pub recent_arrivals: std::collections::VecDeque<Arrival>,
    /// The predictive warm pool's window demand kept up to date arrival by arrival, for a caller
    /// that keeps one ([`DemandWindows`]: the simulator); `None` (the default, and what the
    /// deployed reconciler sends): [`LaneObservation::window_demand`] scans the recent arrivals on
    /// each decision. Fed by [`LaneObservation::record_arrival_with_runtime`]; not serialised.
    #[serde(skip)]
    pub demand_windows: Option<DemandWindows>,
}

/// One job arrival as the predictive warm pool sees it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Arrival {
    /// When, unix seconds.
    pub at: f64,
    /// GPUs per instance.
    pub gpus: u32,
    /// Declared run time, seconds, if any.
    pub runtime_s: Option<f64>,
}

/// The worker demand of one job, in workers: 1 for a job of at least `horizon_s` (or of unknown
/// run time when `default_runtime_s` is that long), `runtime / horizon_s` for a shorter one (short
/// jobs queue behind each other on one worker up to the horizon, see `offers.short_job_horizon_s`).
pub fn worker_units(runtime_s: Option<f64>, horizon_s: f64, default_runtime_s: f64) -> f64 {
    if horizon_s <= 0.0 {
        return 1.0;
    }
    (runtime_s.unwrap_or(default_runtime_s).max(0.0) / horizon_s).min(1.0)
}

/// Whether an arrival that declared `runtime_s` is long for `(horizon_s, default_runtime_s)`:
/// [`worker_units`] of 1, a worker of its own (any arrival when `horizon_s` is 0), without
/// `worker_units`' division (the warm pool asks this of every arrival it counts).
fn is_long(runtime_s: Option<f64>, (horizon_s, default_runtime_s): (f64, f64)) -> bool {
    horizon_s <= 0.0 || runtime_s.unwrap_or(default_runtime_s) >= horizon_s
}

/// Windows of `window_s` over a look-back of `lookback_s`: `floor(lookback_s / window_s) + 1`.
fn window_count(window_s: f64, lookback_s: f64) -> usize {
    (lookback_s / window_s).floor().max(0.0) as usize + 1
}

/// How far back [`LaneObservation::recent_arrivals`] reaches, seconds (6 h: the longest
/// predictive look-back). Defined with the configuration it bounds.
pub use crate::config::RECENT_ARRIVALS_KEPT_S;

/// Arrival gaps and run times of one job shape in a lane.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShapeGaps {
    /// Histogram of gaps, seconds.
    pub hist: GapHistogram,
    /// Histogram of the declared run times of the arrivals, seconds (same buckets and decay; the
    /// last bucket holds everything from about 8 h up).
    pub runtimes: GapHistogram,
    /// Time of the last arrival of this shape, unix seconds.
    pub last_arrival: Option<f64>,
}

impl ShapeGaps {
    /// What tells these statistics apart from their earlier states: every
    /// [`GapHistogram::record`] (the only change a [`LaneObservation`] makes) adds a sample and a
    /// weight, so two states with the same stamp hold the same gaps and run times. The memo of
    /// the keep-alive's curve is keyed by it.
    pub(crate) fn stamp(&self) -> [u64; 6] {
        let (h, r) = (&self.hist, &self.runtimes);
        [
            h.samples,
            h.total_weight.to_bits(),
            h.epoch.to_bits(),
            r.samples,
            r.total_weight.to_bits(),
            r.epoch.to_bits(),
        ]
    }

    /// Mean [`worker_units`] of an arrival of this shape, from the run-time histogram (bucket
    /// midpoints); `default_runtime_s`'s when no run time was declared.
    pub fn mean_worker_units(&self, horizon_s: f64, default_runtime_s: f64) -> f64 {
        if self.runtimes.samples() == 0 {
            return worker_units(None, horizon_s, default_runtime_s);
        }
        // Empty buckets add nothing: skipped (the keep-alive asks this of most decisions). With
        // every weight decayed away, every mass is 0 (`GapHistogram::masses`).
        let (edges, t) = (GapHistogram::bucket_edges(), self.runtimes.total_weight);
        if t <= 0.0 {
            return 0.0;
        }
        let mut sum = 0.0;
        for (i, &w) in self.runtimes.weights.iter().enumerate() {
            if w == 0.0 {
                continue;
            }
            let lo = if i == 0 { 0.0 } else { edges[i - 1] };
            sum += w / t * worker_units(Some((lo + edges[i]) / 2.0), horizon_s, default_runtime_s);
        }
        sum
    }
}

impl LaneObservation {
    /// Record an arrival of a job asking `gpus` GPUs per instance at `at` (unix seconds), run time
    /// unknown. Record arrivals in time order.
    pub fn record_arrival(&mut self, gpus: u32, at: f64) {
        self.record_arrival_with_runtime(gpus, at, None);
    }

    /// Record an arrival of a job asking `gpus` GPUs per instance at `at` (unix seconds) that
    /// declared `runtime_s` seconds of run time. Record arrivals in time order.
    pub fn record_arrival_with_runtime(&mut self, gpus: u32, at: f64, runtime_s: Option<f64>) {
        let g = self.gaps.entry(gpus).or_default();
        if let Some(prev) = g.last_arrival {
            g.hist.record(at - prev, at);
        }
        if let Some(r) = runtime_s {
            g.runtimes.record(r, at);
        }
        g.last_arrival = Some(at);
        if let Some(d) = &mut self.demand_windows {
            d.record(at, gpus, runtime_s);
        }
        self.record_recent_arrival(gpus, at, runtime_s);
    }

    /// Record an arrival among the [`LaneObservation::recent_arrivals`] only, its gap and run
    /// time left out of [`LaneObservation::gaps`]: for a caller that keeps the gaps elsewhere and
    /// has recorded this arrival's there already (the deployed reconciler, which folds each
    /// arrival into its kept statistics once and reads the look-back afresh on every run).
    /// Record arrivals in time order.
    pub fn record_recent_arrival(&mut self, gpus: u32, at: f64, runtime_s: Option<f64>) {
        self.recent_arrivals.push_back(Arrival { at, gpus, runtime_s });
        while self
            .recent_arrivals
            .front()
            .is_some_and(|a| a.at < at - RECENT_ARRIVALS_KEPT_S)
        {
            self.recent_arrivals.pop_front();
        }
    }

    /// Worker demand per window over the look-back, per job shape (GPUs per instance, ascending):
    /// the arrivals of long jobs (at least `horizon_s`, or of unknown run time when
    /// `default_runtime_s` is that long; see [`worker_units`]), each of which needs a worker of its
    /// own. Short jobs are left out: they queue behind each other on the workers a stream of them
    /// keeps busy, which the keep-alive holds. Window k (0-based) is
    /// `(now - (k + 1) x window_s, now - k x window_s]`, for `floor(lookback_s / window_s) + 1`
    /// windows, most recent first. O(arrivals in the look-back + shapes x windows).
    pub fn window_demand(&self, now: f64, window_s: f64, lookback_s: f64, long: (f64, f64)) -> Vec<(u32, Vec<u32>)> {
        let n = window_count(window_s, lookback_s);
        let mut per: Vec<(u32, Vec<u32>)> = Vec::new();
        // Arrivals are recorded in time order: binary search for the range.
        let q = &self.recent_arrivals;
        let start = q.partition_point(|a| a.at <= now - n as f64 * window_s);
        let end = q.partition_point(|a| a.at <= now);
        // Newest first, walking the window boundaries instead of dividing per arrival: window k is
        // (now - (k + 1) W, now - k W].
        let (mut k, mut lower) = (0usize, now - window_s);
        for a in q.range(start..end).rev().filter(|a| is_long(a.runtime_s, long)) {
            while a.at <= lower && k < n - 1 {
                k += 1;
                lower = now - (k + 1) as f64 * window_s;
            }
            let i = match per.iter().position(|p| p.0 == a.gpus) {
                Some(i) => i,
                None => {
                    per.push((a.gpus, vec![0; n]));
                    per.len() - 1
                }
            };
            per[i].1[k] += 1;
        }
        per.sort_by_key(|p| p.0);
        per
    }

    /// [`LaneObservation::window_demand`], read from [`LaneObservation::demand_windows`] when it
    /// was kept for these windows and advanced to `now`, computed otherwise.
    pub fn demand_at(&self, now: f64, window_s: f64, lookback_s: f64, long: (f64, f64)) -> Vec<(u32, Vec<u32>)> {
        match self.kept_demand(now, window_s, lookback_s, long) {
            Some(d) => d.demand(),
            None => self.window_demand(now, window_s, lookback_s, long),
        }
    }

    /// The kept [`LaneObservation::demand_windows`] when they are for these windows and advanced
    /// to `now` (`None`: scan with [`LaneObservation::window_demand`]). Their
    /// [`DemandWindows::shapes`] answer without a copy, which `decide` reads on every decision.
    pub fn kept_demand(&self, now: f64, window_s: f64, lookback_s: f64, long: (f64, f64)) -> Option<&DemandWindows> {
        self.demand_windows
            .as_ref()
            .filter(|d| d.is_for(now, window_s, lookback_s, long))
    }

    /// Arrivals in `(now - window_s, now]` whose GPUs per instance `fits` accepts.
    pub fn arrivals_since(&self, now: f64, window_s: f64, fits: impl Fn(u32) -> bool) -> u32 {
        self.recent_arrivals
            .iter()
            .rev()
            .take_while(|a| a.at > now - window_s)
            .filter(|a| fits(a.gpus))
            .count() as u32
    }

    /// The arrival statistics relevant to a worker with `worker_gpus` GPUs: those of the job shape
    /// it fits with the most gaps (`max_oversize` as in [`crate::shape::fits`]).
    pub fn gaps_for(&self, worker_gpus: u32, max_oversize: u32) -> Option<&ShapeGaps> {
        self.gaps
            .iter()
            .filter(|(g, _)| crate::shape::fits(worker_gpus, 0.0, **g, 0.0, max_oversize))
            .map(|(_, s)| s)
            .max_by_key(|s| s.hist.samples())
    }
}

/// [`LaneObservation::window_demand`] kept up to date incrementally, for a caller that decides far
/// more often than the look-back turns over. The simulator decides on every arrival and every
/// minute; scanning the look-back's arrivals on each decision was a tenth of a replay's time.
/// Here each long arrival moves once across each window boundary: O(windows) per
/// [`DemandWindows::advance`] plus O(windows) per arrival over its life, and the counts are the
/// ones [`LaneObservation::window_demand`] returns (same boundaries, same arithmetic).
///
/// Record arrivals in time order, none older than the last `advance`'s `now`, and advance with a
/// `now` that never decreases; an arrival out of that order rebuilds the counts by a scan at the
/// next `advance`.
#[derive(Debug, Clone, PartialEq)]
pub struct DemandWindows {
    window_s: f64,
    lookback_s: f64,
    /// Short-job horizon and default run time, seconds: which arrivals are long.
    long: (f64, f64),
    /// Windows: `floor(lookback_s / window_s) + 1`.
    n: usize,
    /// The `now` of the last advance, seconds.
    now: f64,
    /// Long arrivals (time, GPUs per instance) not yet past the look-back, oldest first.
    arrivals: std::collections::VecDeque<(f64, u32)>,
    /// For j in 0..=n, the index in `arrivals` of the first one after `now - j x window_s`:
    /// window k holds `bounds[k + 1]..bounds[k]`.
    bounds: Vec<usize>,
    /// Long arrivals per shape (GPUs ascending) per window, most recent window first.
    per: Vec<(u32, Vec<u32>)>,
    /// For j in 0..=n, when the arrival at `bounds[j]` crosses boundary j: `at + j x window_s`
    /// (unix seconds; infinity with none, negative infinity before the first advance). An advance
    /// looks only at the boundaries due: an arrival crosses a few per decision, and looking up
    /// each boundary's next arrival on every decision was 3 % of a full Philly replay's
    /// instructions (`callgrind`).
    due: Vec<f64>,
    /// An arrival came out of order: rebuild at the next advance.
    stale: bool,
    /// Advanced to an earlier time once: arrivals it needs may be dropped, so it is never read.
    lost: bool,
}

impl DemandWindows {
    /// Windows of `window_s` seconds over `lookback_s` (as [`LaneObservation::window_demand`]),
    /// counting arrivals that are long for `(horizon_s, default_runtime_s)`. Nothing recorded.
    pub fn new(window_s: f64, lookback_s: f64, long: (f64, f64)) -> Self {
        let n = window_count(window_s, lookback_s);
        Self {
            window_s,
            lookback_s,
            long,
            n,
            now: f64::NEG_INFINITY,
            arrivals: std::collections::VecDeque::new(),
            bounds: vec![0; n + 1],
            per: Vec::new(),
            due: vec![f64::NEG_INFINITY; n + 1],
            stale: false,
            lost: false,
        }
    }

    /// Whether these are the windows `decide` asks for, advanced to `now`.
    pub fn is_for(&self, now: f64, window_s: f64, lookback_s: f64, long: (f64, f64)) -> bool {
        self.window_s == window_s
            && self.lookback_s == lookback_s
            && self.long == long
            && self.now == now
            && !self.stale
            && !self.lost
    }

    /// Record an arrival at `at` (unix seconds) of a job asking `gpus` GPUs per instance that
    /// declared `runtime_s`; only long ones count (as in [`LaneObservation::window_demand`]).
    pub fn record(&mut self, at: f64, gpus: u32, runtime_s: Option<f64>) {
        if !is_long(runtime_s, self.long) {
            return;
        }
        if at < self.now || self.arrivals.back().is_some_and(|b| at < b.0) {
            self.stale = true;
        }
        // The next to cross each boundary that every earlier arrival has crossed.
        for (j, due) in self.due.iter_mut().enumerate() {
            if *due == f64::INFINITY {
                *due = at + j as f64 * self.window_s;
            }
        }
        self.arrivals.push_back((at, gpus));
    }

    /// Move the windows to `now` (seconds, not before the last call's: an earlier `now` leaves
    /// them unread from then on, and [`LaneObservation::demand_at`] scans instead).
    pub fn advance(&mut self, now: f64) {
        if now < self.now {
            self.lost = true;
        }
        if self.lost {
            return;
        }
        if self.stale {
            self.rebuild(now);
            return;
        }
        self.now = now;
        // Boundary j, newest first: an arrival passing it leaves window j - 1 for window j (or
        // the look-back, past the last). In this order an arrival passing several boundaries at
        // once is counted out of each window after it was counted in.
        for j in 0..=self.n {
            // Short of its next crossing by more than the rounding of `at + j x window_s` against
            // `now - j x window_s` (a few ulps of a unix time, well under a millisecond).
            if now < self.due[j] - 1e-3 {
                continue;
            }
            let edge = now - j as f64 * self.window_s;
            self.due[j] = f64::INFINITY;
            while let Some(&(at, gpus)) = self.arrivals.get(self.bounds[j]) {
                if at > edge {
                    self.due[j] = at + j as f64 * self.window_s;
                    break;
                }
                self.bounds[j] += 1;
                // Out of window j - 1 (none for the first boundary), into window j (none past the
                // last): one lookup of the shape for both.
                let counts = self.counts(gpus);
                if j > 0 {
                    counts[j - 1] -= 1;
                }
                if let Some(c) = counts.get_mut(j) {
                    *c += 1;
                }
            }
        }
        // Past the look-back: no longer needed.
        let gone = self.bounds[self.n];
        if gone > 0 {
            self.arrivals.drain(..gone);
            self.bounds.iter_mut().for_each(|b| *b -= gone);
        }
    }

    /// The demand per shape and window, as [`LaneObservation::window_demand`] at the last
    /// advance's `now`: shapes with an arrival in the look-back, GPUs ascending.
    pub fn demand(&self) -> Vec<(u32, Vec<u32>)> {
        self.per
            .iter()
            .filter(|(_, d)| d.iter().any(|c| *c > 0))
            .cloned()
            .collect()
    }

    /// [`DemandWindows::demand`] without the copy: every shape counted since the windows were
    /// made, GPUs ascending, those with no long arrival left in the look-back included (all
    /// windows 0).
    pub fn shapes(&self) -> &[(u32, Vec<u32>)] {
        &self.per
    }

    /// The counts per window of shape `gpus` (added, all 0, when new).
    fn counts(&mut self, gpus: u32) -> &mut [u32] {
        let i = match self.per.binary_search_by_key(&gpus, |p| p.0) {
            Ok(i) => i,
            Err(i) => {
                self.per.insert(i, (gpus, vec![0; self.n]));
                i
            }
        };
        &mut self.per[i].1
    }

    /// Counts from scratch at `now`, for arrivals recorded out of order.
    fn rebuild(&mut self, now: f64) {
        let mut sorted: Vec<(f64, u32)> = self.arrivals.drain(..).collect();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.arrivals.extend(sorted);
        self.bounds.iter_mut().for_each(|b| *b = 0);
        self.per.clear();
        self.stale = false;
        self.now = f64::NEG_INFINITY;
        self.due.iter_mut().for_each(|d| *d = f64::NEG_INFINITY);
        self.advance(now);
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
    /// Fleet figures the caller keeps worker by worker, so `decide` need not pass over every
    /// worker ([`FleetHint`]); `None` (every caller but the simulator): `decide` passes over them.
    pub fleet: Option<&'a FleetHint>,
}

/// What `decide` would otherwise gather from one pass over [`Observation::workers`], kept up to
/// date worker by worker by a caller with many workers and many decisions: the simulator, whose
/// workers mostly run long jobs, neither free capacity nor pinned to a job (on full Philly the
/// pass was a third of a replay's instructions).
///
/// It must describe `workers` exactly: debug builds of `decide` compute the figures both ways
/// and panic when they differ. `decide` takes it only for the `now` and short-job horizon it was
/// made for, and not under a budget cap (the spend counts every worker).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetHint {
    /// The decision time it describes, unix seconds.
    pub now: f64,
    /// The short-job horizon it was made with (`offers.short_job_horizon_s`), seconds.
    pub horizon_s: f64,
    /// Indices into `workers`, ascending: every idle or booting worker and every running one
    /// whose job is expected to end within `horizon_s` of `now` (more may be named: `decide`
    /// checks each), no stopped one.
    pub visit: Vec<usize>,
    /// Indices into `workers`, ascending: every stopped worker. `decide` lists them only when it
    /// may start or release one: on full Philly a decision sees about 30 stopped workers, and
    /// listing them on each one was about 5 % of a replay's instructions.
    pub stopped: Vec<usize>,
    /// The earliest `stopped_until` of the stopped workers, unix seconds: before it no stopped
    /// keep-alive has run out. Negative infinity when a stopped worker has none (0, the default,
    /// also has `decide` look at each); infinity when none is stopped.
    pub stopped_due: f64,
    /// Per lane index: the live workers (pending, running, idle) and the latest launch among them
    /// (unix seconds; negative infinity when none).
    pub lane_live: Vec<(u32, f64)>,
    /// The cheapest price of a live worker per (GPUs, GPU memory per GPU in GiB as `f64` bits),
    /// $/h, for each such pair with a live worker, in any order.
    pub cheapest: Vec<((u32, u64), f64)>,
    /// Per (lane index, GPUs): the expected job ends (`busy_until`, unix seconds) of the running
    /// workers that have one, ascending; pairs with none may be left out. The keep-alive counts
    /// the ends within a time of `now` with a binary search here instead of a pass over every
    /// worker for each line of idle workers (3 % of a full Philly replay, `perf`).
    pub running_ends: Vec<((usize, u32), Vec<f64>)>,
}

/// How many of a lane's most recently finished jobs [`RecentRunTimes`] keeps (50).
pub const RUN_TIMES_KEPT: usize = 50;

/// How many finished jobs [`RecentRunTimes::estimate_s`] needs before it answers (5).
pub const RUN_TIMES_NEEDED: usize = 5;

/// The run times of a lane's most recently finished jobs, seconds: the estimate of an undeclared
/// job's run time. A job that declares no `est_runtime_s` otherwise counts as
/// `offers.default_runtime_s` (an hour), a worker of its own, and a running worker's end is
/// unknown; a stream of one-second items then launches a GPU per queued item. The caller (the
/// deployed reconciler from the jobs table's `run_times` index, the simulator as its jobs end)
/// fills the estimate in where a job declared nothing: for queued jobs, arrivals and running
/// workers' ends. The policy itself reads only what it is handed.
///
/// The estimate is the mean of the last [`RUN_TIMES_KEPT`] run times (claim to end of the attempt
/// that finished the job), once [`RUN_TIMES_NEEDED`] are known. The mean, not a quantile:
/// the policy sizes capacity by worker time (Little's law), which the mean gives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecentRunTimes {
    /// Run times, seconds, oldest first.
    kept: std::collections::VecDeque<f64>,
}

impl RecentRunTimes {
    /// Record a finished job's run time, seconds (negative or non-finite ones are ignored).
    /// Record in finishing order; the oldest beyond [`RUN_TIMES_KEPT`] is dropped.
    pub fn record(&mut self, run_s: f64) {
        if !run_s.is_finite() || run_s < 0.0 {
            return;
        }
        self.kept.push_back(run_s);
        if self.kept.len() > RUN_TIMES_KEPT {
            self.kept.pop_front();
        }
    }

    /// Run times kept.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// The estimated run time of a job that declared none, seconds: the mean of those kept, once
    /// at least [`RUN_TIMES_NEEDED`] are; `None` before. O([`RUN_TIMES_KEPT`]).
    pub fn estimate_s(&self) -> Option<f64> {
        (self.kept.len() >= RUN_TIMES_NEEDED).then(|| self.kept.iter().sum::<f64>() / self.kept.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No estimate before five run times; then their mean, over the last fifty only; a negative
    /// or non-finite run time is no run time.
    #[test]
    fn the_run_time_estimate_is_the_mean_of_the_last_fifty_once_five_are_known() {
        let mut r = RecentRunTimes::default();
        for t in [2.0, 4.0, 6.0, 8.0] {
            r.record(t);
            assert_eq!(r.estimate_s(), None, "{} run times", r.len());
        }
        r.record(f64::NAN);
        r.record(-1.0);
        r.record(f64::INFINITY);
        assert_eq!((r.len(), r.estimate_s()), (4, None));
        r.record(10.0);
        assert_eq!(r.estimate_s(), Some(6.0));
        // Fifty of 100 s more: the first five are dropped, the mean is theirs.
        for _ in 0..RUN_TIMES_KEPT {
            r.record(100.0);
        }
        assert_eq!((r.len(), r.estimate_s()), (RUN_TIMES_KEPT, Some(100.0)));
        r.record(50.0);
        assert_eq!(r.estimate_s(), Some((49.0 * 100.0 + 50.0) / 50.0));
    }

    /// The mean over the buckets that hold run times is the mean over all of them.
    #[test]
    fn mean_worker_units_is_the_mass_weighted_units_of_every_bucket() {
        let (horizon, default) = (120.0, 3_600.0);
        let mut g = ShapeGaps::default();
        for (i, r) in [5.0, 30.0, 30.0, 90.0, 400.0, 7_200.0].into_iter().enumerate() {
            g.runtimes.record(r, 1_000.0 + 600.0 * i as f64);
        }
        let every: f64 = g
            .runtimes
            .masses()
            .enumerate()
            .map(|(i, p)| {
                let lo = if i == 0 {
                    0.0
                } else {
                    GapHistogram::bucket_edge_s(i - 1)
                };
                p * worker_units(Some((lo + GapHistogram::bucket_edge_s(i)) / 2.0), horizon, default)
            })
            .sum();
        let mean = g.mean_worker_units(horizon, default);
        assert_eq!(mean.to_bits(), every.to_bits());
        // Two long runs of six (units 1), the short ones a fraction of the 120 s horizon.
        assert!(mean > 0.2 && mean < 1.0, "{mean}");
        assert_eq!(
            ShapeGaps::default().mean_worker_units(horizon, default),
            1.0,
            "no run times: the default's"
        );
    }
}
