//! Phase 1: the fleet as it is, and the bookkeeping later phases update as they plan launches.

use smallvec::{smallvec, SmallVec};

use crate::config::PolicyConfig;
use crate::observation::{FleetHint, Observation, WorkerState, WorkerView};
use crate::offering::CapacityType;

use super::FreeClass;

/// One entry per lane. `decide` runs on every submission and every tick, and a fleet has a lane
/// or two: inline storage instead of a heap allocation per list per decision (allocation was a
/// tenth of a replay's time).
pub(crate) type PerLane<T> = SmallVec<[T; 2]>;

/// A lane's idle or booting workers: inline up to a typical count, on the heap past it.
pub(crate) type Workers<'a> = SmallVec<[&'a WorkerView; 16]>;

/// A lane's free capacity classes (a fleet has a few worker sizes).
pub(crate) type Classes = SmallVec<[FreeClass; 4]>;

/// Counts per name for the few projects / job types of a fleet: a linear list beats hashing here
/// (`decide` runs on every submission). Each entry keeps a cheap key (length and first 7 bytes,
/// [`name_key`]) so a lookup compares whole names only where the keys match and the names are
/// longer than the key tells apart: on full Philly (14 projects) the name comparisons were 10 %
/// of fixed-idle-10m's replay profile, and building the key and comparing the (6-byte) names a
/// further 5 % (`callgrind`).
#[derive(Debug, Default)]
pub(crate) struct Tally<'a>(Vec<(u64, &'a str, u32)>);

/// Length and first 7 bytes of `name`, as one word: the low 7 bytes hold the name's first bytes
/// (zero past its end), the top byte its length (capped at 255). Two names shorter than 8 bytes
/// have the same key only when they are the same name.
pub(crate) fn name_key(name: &str) -> u64 {
    let b = name.as_bytes();
    let n = b.len();
    // Read in a few loads, two overlapping ones for a short name (the bytes they share are the
    // same): copying a variable length is a `memcpy` call, and shifting the bytes in one by one
    // was as slow, for every pending or running worker of a decision that launches.
    let head = match n {
        8.. => u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], 0]),
        4..=7 => {
            let lo = u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let hi = u64::from(u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]));
            lo | (hi << (8 * (n - 4)))
        }
        1..=3 => u64::from(b[0]) | (u64::from(b[n / 2]) << (8 * (n / 2))) | (u64::from(b[n - 1]) << (8 * (n - 1))),
        0 => 0,
    };
    head | ((n.min(255) as u64) << 56)
}

/// Whether the entry (`k`, `s`) is `name`, whose key is `key`.
#[inline]
pub(crate) fn same_name(k: u64, s: &str, key: u64, name: &str) -> bool {
    k == key && (name.len() < 8 || s == name)
}

impl<'a> Tally<'a> {
    pub(crate) fn add(&mut self, name: &'a str, n: u32) {
        let key = name_key(name);
        match self.0.iter_mut().find(|(k, s, _)| same_name(*k, s, key, name)) {
            Some(e) => e.2 += n,
            None => self.0.push((key, name, n)),
        }
    }

    pub(crate) fn get(&self, name: &str) -> u32 {
        let key = name_key(name);
        self.0
            .iter()
            .find(|(k, s, _)| same_name(*k, s, key, name))
            .map_or(0, |e| e.2)
    }
}

/// The stopped workers per lane, listed at first need when the caller's [`FleetHint`] names them
/// apart ([`FleetHint::stopped`]): most decisions neither start nor release one.
#[derive(Debug)]
pub(crate) struct Stopped<'a> {
    /// Per lane: listed (by the pass over the workers, or from `unlisted`).
    lists: PerLane<Workers<'a>>,
    /// The workers and the hint's indices of the stopped ones, not yet listed.
    unlisted: Option<(&'a [WorkerView], &'a [usize])>,
    /// Before this time (unix seconds) no stopped keep-alive has run out
    /// ([`FleetHint::stopped_due`]); negative infinity: each is to be looked at.
    pub(crate) due: f64,
}

impl<'a> Stopped<'a> {
    /// Lane `lane`'s stopped workers (in the order of the workers), listed now if they were not.
    pub(crate) fn of(&mut self, lane: usize) -> &mut Workers<'a> {
        self.list();
        &mut self.lists[lane]
    }

    /// List the hint's stopped workers, if not yet done.
    fn list(&mut self) {
        if let Some(unlisted) = self.unlisted.take() {
            Self::append(&mut self.lists, unlisted);
        }
    }

    /// The lists as [`Stopped::of`] gives them, without listing them here: the debug checks
    /// compare them, and listing would take the lazy path away from the replays they check.
    #[cfg(any(test, debug_assertions))]
    fn listed(&self) -> PerLane<Workers<'a>> {
        let mut lists = self.lists.clone();
        if let Some(unlisted) = self.unlisted {
            Self::append(&mut lists, unlisted);
        }
        lists
    }

    /// Push each of `ids` (indices into `workers`) onto its lane's list.
    fn append(lists: &mut PerLane<Workers<'a>>, (workers, ids): (&'a [WorkerView], &'a [usize])) {
        // One lane (most fleets): its list takes them all, sized once rather than grown.
        if let [list] = lists.as_mut_slice() {
            list.reserve(ids.len());
        }
        for w in ids.iter().filter_map(|&i| workers.get(i)) {
            if let Some(l) = lists.get_mut(w.lane) {
                l.push(w);
            }
        }
    }
}

/// Job ends per (lane, GPUs), as [`FleetHint::running_ends`] gives them.
pub(crate) type RunningEnds = [((usize, u32), Vec<f64>)];

/// The fleet, and the launches booked so far.
#[derive(Debug)]
pub(crate) struct Fleet<'a> {
    /// $/h of every worker not terminating, plus the launches booked. Summed only under a budget
    /// cap (`limits.max_usd_per_h`), the only thing that reads it; 0 without one. The sum over the
    /// fleet is one long chain of dependent additions: skipping it made the full Philly replay of
    /// onoff about 2 % faster (README, Figures).
    pub(crate) spend: f64,
    /// Live workers (pending, running, idle), plus the launches booked.
    pub(crate) live_total: u32,
    /// The same per lane.
    pub(crate) lane_live: PerLane<u32>,
    /// GPUs per project of the pending and running workers (filled only when launches are to be
    /// planned), plus the launches booked.
    pub(crate) project_gpus: Tally<'a>,
    /// Jobs per job type of the pending and running workers, likewise.
    pub(crate) type_jobs: Tally<'a>,
    /// Last launch per lane, unix seconds.
    pub(crate) last_launch: PerLane<f64>,
    /// Free capacity per lane by class (GPUs, then memory, ascending); matching takes from it.
    pub(crate) free: PerLane<Classes>,
    /// Free (idle, pending) workers per lane before matching.
    pub(crate) free_before: PerLane<(u32, u32)>,
    /// Idle workers per lane.
    pub(crate) idle: PerLane<Workers<'a>>,
    /// Booting workers per lane.
    pub(crate) pending: PerLane<Workers<'a>>,
    /// Stopped workers per lane (not live: a start makes them capacity again).
    pub(crate) stopped: Stopped<'a>,
    /// The budget cap, when the spend is over it (no launches, idle workers released).
    pub(crate) breaker: Option<f64>,
    /// Cheapest price of a live worker per (GPUs, GPU memory bits), $/h: what the warm pool of a
    /// shape is priced at without ranking the catalogue.
    pub(crate) cheapest: SmallVec<[((u32, u64), f64); 8]>,
    /// Queued jobs whose pinned workers (booting, or up and not yet running it: launched for the
    /// job) are as many as the job's instances: those workers are its capacity, so matching skips
    /// the job and nobody else counts the workers.
    pub(crate) pinned_met: Vec<&'a str>,
    /// The offerings marked unavailable now, looked up in the catalogue at first use and shared
    /// by every ranking and start of the decision: with measured preemptions hundreds are marked,
    /// and looking them up for each was a third of a replay's time (`perf`).
    pub(crate) blocked: std::cell::OnceCell<crate::choice::Blocked>,
    /// The running workers' job ends per (lane, GPUs), ascending, when the caller's hint gave
    /// them ([`FleetHint::running_ends`]); `None` from a pass (scale-down then scans the workers).
    pub(crate) running_ends: Option<&'a RunningEnds>,
}

impl<'a> Fleet<'a> {
    /// Count worker `w` (not pinned to a queued job) as free capacity of its lane: an idle or
    /// booting worker, or a running one whose job ends within the short-job horizon (credit).
    #[inline]
    fn add_free(&mut self, w: &'a WorkerView, cfg: &PolicyConfig, now: f64) {
        let horizon = cfg.offers.short_job_horizon_s;
        let (idle, pending, credit) = match (w.state, w.busy_until) {
            (WorkerState::Idle, _) => {
                self.idle[w.lane].push(w);
                (1, 0, 0.0)
            }
            (WorkerState::Pending, _) => {
                self.pending[w.lane].push(w);
                (0, 1, 0.0)
            }
            (WorkerState::Running, Some(t)) if t - now < horizon => (0, 0, horizon - (t - now).max(0.0)),
            _ => return,
        };
        let classes = &mut self.free[w.lane];
        let spot = w.offering.capacity_type == CapacityType::Spot;
        let on_demand_of_spot = on_demand_of_spot(w);
        match classes.iter_mut().find(|c| {
            c.gpus == w.gpus && c.mem == w.gpu_memory_gib && c.spot == spot && c.on_demand_of_spot == on_demand_of_spot
        }) {
            Some(c) => {
                c.idle += idle;
                c.pending += pending;
                c.credit += credit;
            }
            None => classes.push(FreeClass {
                gpus: w.gpus,
                mem: w.gpu_memory_gib,
                spot,
                on_demand_of_spot,
                idle,
                pending,
                credit,
            }),
        }
    }
}

/// An on-demand worker of a spot-first lane: (its price, the best spot price for its shape), $/h
/// ([`super::FreeClass::on_demand_of_spot`]).
pub(crate) fn on_demand_of_spot(w: &WorkerView) -> Option<(f64, f64)> {
    w.spot_price_usd_per_h
        .filter(|_| w.offering.capacity_type == CapacityType::OnDemand)
        .map(|spot| (w.price_usd_per_h, spot))
}

/// [`fill`] into a new fleet (the tests' way to get the figures).
#[cfg(test)]
pub(crate) fn figures<'a>(obs: &Observation<'a>, cfg: &PolicyConfig, now: f64) -> Fleet<'a> {
    let mut f = Fleet::empty(cfg.lanes.len());
    fill(&mut f, obs, cfg, now);
    f
}

/// What the fleet is now, into `f` ([`Fleet::unlisted`] with [`Fleet::list_lanes`] for the
/// configured lanes; filled in place: the fleet is about 2 kB, and `decide` runs on every
/// submission and tick): spend, live workers, free capacity per lane by class (running workers
/// whose job ends within the short-job horizon give short jobs credit: the rest of the horizon),
/// idle and booting workers per lane, the budget breaker. Workers pinned to a queued job
/// (booting, or up and held for it), as many as it has instances, are that job's: neither free
/// nor in the idle or booting lists (never cancelled or released while the job waits), the job in
/// `pinned_met`. `now`: unix seconds.
///
/// From the caller's [`FleetHint`] when it has one for this `now` and horizon (and no budget cap
/// asks for the spend), else from one pass over the workers. Debug builds compute both and panic
/// when a hint disagrees with the workers.
pub(crate) fn fill<'a>(f: &mut Fleet<'a>, obs: &Observation<'a>, cfg: &PolicyConfig, now: f64) {
    let budget = cfg.limits.max_usd_per_h.is_some();
    let hint = obs
        .fleet
        .filter(|h| !budget && h.now == now && h.horizon_s == cfg.offers.short_job_horizon_s);
    match hint {
        Some(h) => {
            fill_from_hint(f, obs, cfg, now, h);
            #[cfg(debug_assertions)]
            {
                let pass = figures_by_pass(obs, cfg, now);
                // Each stopped keep-alive run out is on or after the hint's due time.
                for w in pass.stopped.lists.iter().flatten() {
                    assert!(
                        w.stopped_until.is_some_and(|t| t >= h.stopped_due) || h.stopped_due == f64::NEG_INFINITY,
                        "the FleetHint disagrees with the workers at {now}: {} stopped until {:?}, due {}",
                        w.id,
                        w.stopped_until,
                        h.stopped_due
                    );
                }
                assert_eq!(
                    f.digest(),
                    pass.digest(),
                    "the FleetHint disagrees with the workers at {now}"
                );
            }
        }
        None => fill_by_pass(f, obs, cfg, now),
    }
}

impl<'a> Fleet<'a> {
    /// No workers, for `nl` lanes (the tests' and the debug checks' way; `decide` builds its
    /// fleet in place).
    #[cfg(any(test, debug_assertions))]
    pub(crate) fn empty(nl: usize) -> Self {
        let mut f = Self::unlisted(nl);
        f.list_lanes(nl);
        f
    }

    /// [`Fleet::empty`] without its per-lane lists, which [`Fleet::list_lanes`] adds in place: the
    /// fleet is about 2 kB, and returning it once filled copied it on every decision (`callgrind`).
    pub(crate) fn unlisted(nl: usize) -> Self {
        Fleet {
            spend: 0.0,
            live_total: 0,
            lane_live: smallvec![0; nl],
            project_gpus: Tally::default(),
            type_jobs: Tally::default(),
            last_launch: smallvec![f64::NEG_INFINITY; nl],
            free: PerLane::new(),
            free_before: PerLane::new(),
            idle: PerLane::new(),
            pending: PerLane::new(),
            stopped: Stopped {
                lists: PerLane::new(),
                unlisted: None,
                due: f64::NEG_INFINITY,
            },
            breaker: None,
            cheapest: SmallVec::new(),
            pinned_met: Vec::new(),
            blocked: std::cell::OnceCell::new(),
            running_ends: None,
        }
    }

    /// Add the empty per-lane lists of `nl` lanes.
    pub(crate) fn list_lanes(&mut self, nl: usize) {
        // Pushed in place: collecting built each list of lists aside and moved it in.
        for _ in 0..nl {
            self.free.push(Classes::new());
            self.idle.push(Workers::new());
            self.pending.push(Workers::new());
            self.stopped.lists.push(Workers::new());
        }
    }

    /// Worker `w`'s part in the free capacity: set aside when pinned to a job (booting or idle),
    /// else counted when idle, booting or ending its job within the short-job horizon; a stopped
    /// worker is listed as such. Most workers run a long job: no free capacity, and no call.
    #[inline]
    fn visit(&mut self, w: &'a WorkerView, pinned: &mut Vec<&'a WorkerView>, cfg: &PolicyConfig, now: f64) {
        if w.state == WorkerState::Stopped {
            self.stopped.lists[w.lane].push(w);
            return;
        }
        if w.pinned_job.is_some() && matches!(w.state, WorkerState::Pending | WorkerState::Idle) {
            pinned.push(w);
            return;
        }
        let horizon = cfg.offers.short_job_horizon_s;
        if w.state != WorkerState::Running || w.busy_until.is_some_and(|t| t - now < horizon) {
            self.add_free(w, cfg, now);
        }
    }

    /// After the workers: the pinned workers' jobs, the breaker, the classes in matching's order.
    fn finish(&mut self, obs: &Observation<'a>, cfg: &PolicyConfig, now: f64, pinned: Vec<&'a WorkerView>) {
        if !pinned.is_empty() {
            // A queued job with as many pinned workers as it has instances has its capacity: those
            // workers are its alone. The others are free as any.
            let mut per_job = Tally::default();
            for j in pinned.iter().filter_map(|w| w.pinned_job.as_deref()) {
                per_job.add(j, 1);
            }
            self.pinned_met = obs
                .jobs
                .iter()
                .filter(|j| per_job.get(&j.id) >= j.instances.max(1))
                .map(|j| j.id.as_str())
                .collect();
            for w in pinned {
                if !w.pinned_job.as_deref().is_some_and(|j| self.pinned_met.contains(&j)) {
                    self.add_free(w, cfg, now);
                }
            }
        }
        self.breaker = cfg.limits.max_usd_per_h.filter(|cap| self.spend > *cap);
        for classes in &mut self.free {
            // Spot before on-demand within a size: a job matched to either takes spot, which leaves
            // the on-demand workers to jobs whose deadline keeps them off spot.
            classes.sort_by(|a, b| {
                a.gpus
                    .cmp(&b.gpus)
                    .then(a.mem.total_cmp(&b.mem))
                    .then(b.spot.cmp(&a.spot))
            });
        }
        self.free_before = self
            .free
            .iter()
            .map(|cs| (cs.iter().map(|c| c.idle).sum(), cs.iter().map(|c| c.pending).sum()))
            .collect();
    }

    /// Everything `fill` gives, comparable: the two ways must agree.
    #[cfg(any(test, debug_assertions))]
    fn digest(&self) -> impl PartialEq + std::fmt::Debug + '_ {
        let ids = |lists: &PerLane<Workers<'a>>| -> Vec<Vec<&'a str>> {
            lists
                .iter()
                .map(|l| l.iter().map(|w| w.id.as_str()).collect())
                .collect()
        };
        let mut cheapest = self.cheapest.to_vec();
        cheapest.sort_by_key(|c| c.0);
        (
            (self.spend, self.live_total, &self.lane_live, &self.last_launch),
            (&self.free, &self.free_before, ids(&self.idle), ids(&self.pending)),
            ids(&self.stopped.listed()),
            (self.breaker, cheapest, &self.pinned_met),
        )
    }
}

/// [`fill`] from the caller's hint: only the workers it names are visited.
fn fill_from_hint<'a>(f: &mut Fleet<'a>, obs: &Observation<'a>, cfg: &PolicyConfig, now: f64, h: &'a FleetHint) {
    let nl = cfg.lanes.len();
    for (lane, &(live, last)) in h.lane_live.iter().enumerate().take(nl) {
        if live > 0 {
            f.live_total += live;
            f.lane_live[lane] = live;
            f.last_launch[lane] = last;
        }
    }
    f.cheapest = h.cheapest.iter().copied().collect();
    f.stopped.unlisted = Some((obs.workers, &h.stopped));
    f.stopped.due = h.stopped_due;
    f.running_ends = Some(&h.running_ends);
    let mut pinned: Vec<&'a WorkerView> = Vec::new();
    for w in h
        .visit
        .iter()
        .filter_map(|&i| obs.workers.get(i))
        .filter(|w| w.lane < nl)
    {
        f.visit(w, &mut pinned, cfg, now);
    }
    f.finish(obs, cfg, now, pinned);
}

/// [`fill_by_pass`] into a new fleet: the oracle of the hint in debug builds.
#[cfg(any(test, debug_assertions))]
fn figures_by_pass<'a>(obs: &Observation<'a>, cfg: &PolicyConfig, now: f64) -> Fleet<'a> {
    let mut f = Fleet::empty(cfg.lanes.len());
    fill_by_pass(&mut f, obs, cfg, now);
    f
}

/// [`fill`] from one pass over the workers.
fn fill_by_pass<'a>(f: &mut Fleet<'a>, obs: &Observation<'a>, cfg: &PolicyConfig, now: f64) {
    let nl = cfg.lanes.len();
    // Booting or idle workers launched for a job, set aside until the pass is done.
    let mut pinned: Vec<&'a WorkerView> = Vec::new();
    // Live workers and last launch of a run of workers of one lane, added to the lane's figures
    // when the run ends. Updating the lane's entries per worker chains every worker to the last
    // one's store; a fleet's workers come in long runs of one lane (most fleets have one).
    let mut run: (usize, u32, f64) = (0, 0, f64::NEG_INFINITY);
    let end_run = |f: &mut Fleet<'a>, (lane, live, last): (usize, u32, f64)| {
        if live > 0 {
            f.lane_live[lane] += live;
            f.last_launch[lane] = f.last_launch[lane].max(last);
        }
    };
    let budget = cfg.limits.max_usd_per_h.is_some();
    for w in obs.workers.iter().filter(|w| w.lane < nl) {
        if budget {
            f.spend += match w.state {
                WorkerState::Terminating => 0.0,
                WorkerState::Stopped => cfg.scale_down.stopped_usd_per_h(),
                _ => w.price_usd_per_h,
            };
        }
        if w.is_live() {
            let (k, price) = ((w.gpus, w.gpu_memory_gib.to_bits()), w.price_usd_per_h);
            match f.cheapest.iter_mut().find(|c| c.0 == k) {
                // A compare, not f64::min: the minimum rarely changes, so this is predicted.
                Some(c) if price < c.1 => c.1 = price,
                Some(_) => {}
                None => f.cheapest.push((k, price)),
            }
            f.live_total += 1;
            if w.lane != run.0 {
                end_run(f, std::mem::replace(&mut run, (w.lane, 0, f64::NEG_INFINITY)));
            }
            run.1 += 1;
            if w.launched_at > run.2 {
                run.2 = w.launched_at;
            }
        }
        f.visit(w, &mut pinned, cfg, now);
    }
    end_run(f, run);
    f.finish(obs, cfg, now, pinned);
}

impl<'a> Fleet<'a> {
    /// Per-project GPUs and per-type jobs of the pending and running workers: needed only when
    /// something is to be launched.
    pub(crate) fn count_running_by_project_and_type(&mut self, obs: &Observation<'a>, nl: usize) {
        for w in obs.workers.iter().filter(|w| w.lane < nl) {
            if matches!(w.state, WorkerState::Pending | WorkerState::Running) {
                if let Some(p) = &w.project {
                    self.project_gpus.add(p, w.gpus);
                }
                if let Some(t) = &w.job_type {
                    self.type_jobs.add(t, 1);
                }
            }
        }
    }

    /// Book `instances` launches in `lane` at `price_usd_per_h` in all.
    pub(crate) fn book(&mut self, lane: usize, instances: u32, price_usd_per_h: f64) {
        self.spend += price_usd_per_h;
        self.live_total += instances;
        self.lane_live[lane] += instances;
    }

    /// `(room, limit)`: how many more workers `lane` may launch, and the limit that sets it (the
    /// lane's `max_workers` when the lane's room is the smaller, else `limits.max_workers_total`).
    pub(crate) fn room(&self, cfg: &PolicyConfig, lane: usize) -> (u32, u32) {
        let lane_room = cfg.lanes[lane].max_workers.saturating_sub(self.lane_live[lane]);
        let total_room = cfg.limits.max_workers_total.saturating_sub(self.live_total);
        if lane_room < total_room {
            (lane_room, cfg.lanes[lane].max_workers)
        } else {
            (total_room, cfg.limits.max_workers_total)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observation::WorkerView;

    fn worker(id: &str, lane: usize, state: WorkerState, gpus: u32, price: f64) -> WorkerView {
        WorkerView {
            id: id.into(),
            lane,
            state,
            gpus,
            gpu_memory_gib: 24.0,
            price_usd_per_h: price,
            launched_at: 100.0,
            idle_since: (state == WorkerState::Idle).then_some(200.0),
            project: Some("p".into()),
            job_type: None,
            busy_until: None,
            pinned_job: None,
            spot_price_usd_per_h: None,
            stopped_until: None,
            cached_projects: Vec::new(),
            seq: 0,
            offering: crate::offering::OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: "us-east-1a".into(),
                capacity_type: crate::offering::CapacityType::Spot,
            },
        }
    }

    fn observe(workers: &[WorkerView]) -> Observation<'_> {
        Observation {
            lanes: &[],
            jobs: &[],
            workers,
            offerings: &[],
            unavailable: &[],
            fleet: None,
        }
    }

    proptest::proptest! {
        /// A name's key is its length (capped at 255) in the top byte over its first 7 bytes,
        /// zero past its end, whatever its length.
        #[test]
        fn a_name_key_is_its_length_over_its_first_seven_bytes(name in "[a-z0-9\\x00-]{0,12}|[a-z]{250,260}") {
            let b = name.as_bytes();
            let mut head = [0u8; 8];
            head[..b.len().min(7)].copy_from_slice(&b[..b.len().min(7)]);
            head[7] = b.len().min(255) as u8;
            proptest::prop_assert_eq!(name_key(&name), u64::from_le_bytes(head));
        }

        /// A tally counts per name exactly as a map does, whatever the names: short ones told
        /// apart by their keys alone, long ones sharing a head or a length, empty ones, NULs.
        #[test]
        fn a_tally_counts_each_name_as_a_map_does(
            names in proptest::collection::vec("[ab\\x00]{0,3}|abcdefg[ab]{0,3}|[a-z0-9-]{0,12}", 0..40)
        ) {
            let mut tally = Tally::default();
            let mut map: std::collections::BTreeMap<&str, u32> = std::collections::BTreeMap::new();
            for (i, n) in names.iter().enumerate() {
                tally.add(n, i as u32 + 1);
                *map.entry(n.as_str()).or_default() += i as u32 + 1;
            }
            for n in names.iter().map(String::as_str).chain(["", "zzzzzzzzzz", "abcdefgh"]) {
                proptest::prop_assert_eq!(tally.get(n), map.get(n).copied().unwrap_or(0), "{:?}", n);
            }
        }
    }

    #[test]
    fn figures_count_spend_live_workers_and_free_capacity_by_class() {
        let mut cfg = PolicyConfig::default();
        cfg.limits.max_usd_per_h = Some(3.0);
        let workers = vec![
            worker("a", 0, WorkerState::Idle, 1, 1.0),
            worker("b", 0, WorkerState::Pending, 1, 1.0),
            worker("c", 0, WorkerState::Running, 4, 2.0),
            worker("d", 0, WorkerState::Terminating, 1, 9.0),
            worker("e", 0, WorkerState::Idle, 4, 2.0),
        ];
        let obs = observe(&workers);
        let f = figures(&obs, &cfg, 0.0);
        // Terminating workers are not billed on; every other one is.
        assert_eq!(f.spend, 6.0);
        assert_eq!((f.live_total, f.lane_live[0]), (4, 4));
        assert_eq!(f.free[0].len(), 2, "two classes: 1 GPU and 4 GPUs");
        assert_eq!((f.free[0][0].gpus, f.free[0][0].idle, f.free[0][0].pending), (1, 1, 1));
        assert_eq!((f.free[0][1].gpus, f.free[0][1].idle, f.free[0][1].pending), (4, 1, 0));
        assert_eq!(f.free_before[0], (2, 1));
        assert_eq!(f.breaker, Some(3.0), "6 $/h is over the 3 $/h cap");
        assert_eq!((f.idle[0].len(), f.pending[0].len()), (2, 1));
    }

    /// Workers of every kind a hint must get right: idle, booting, running long and short jobs,
    /// draining, pinned.
    fn mixed_fleet() -> Vec<WorkerView> {
        let mut ws = vec![
            worker("a", 0, WorkerState::Idle, 1, 1.0),
            worker("b", 0, WorkerState::Running, 1, 0.9),
            worker("c", 0, WorkerState::Running, 4, 2.0),
            worker("d", 0, WorkerState::Draining, 1, 0.5),
            worker("e", 0, WorkerState::Pending, 4, 2.2),
            worker("f", 0, WorkerState::Idle, 1, 1.1),
        ];
        ws[1].busy_until = Some(1_050.0);
        ws[2].busy_until = Some(90_000.0);
        ws[2].launched_at = 700.0;
        ws[5].pinned_job = Some("j-1".into());
        ws
    }

    fn hint_of(visit: Vec<usize>) -> FleetHint {
        FleetHint {
            now: 1_000.0,
            horizon_s: PolicyConfig::default().offers.short_job_horizon_s,
            visit,
            stopped: vec![],
            stopped_due: f64::INFINITY,
            lane_live: vec![(5, 700.0)],
            cheapest: vec![((4, 24f64.to_bits()), 2.0), ((1, 24f64.to_bits()), 0.9)],
            running_ends: vec![],
        }
    }

    #[test]
    fn a_hint_naming_the_awake_and_soon_free_workers_gives_the_figures_of_the_pass() {
        let cfg = PolicyConfig::default();
        let workers = mixed_fleet();
        // The long-running worker (c) and the draining one (d) are not named.
        let hint = hint_of(vec![0, 1, 4, 5]);
        // A hint made for another decision time: it misses worker a, which would panic in a
        // debug build and lose an idle worker in a release one.
        let stale = FleetHint {
            now: 940.0,
            ..hint_of(vec![1, 4, 5])
        };
        let mut obs = observe(&workers);
        let pass = figures(&obs, &cfg, 1_000.0);
        obs.fleet = Some(&hint);
        let mut hinted = Fleet::empty(cfg.lanes.len());
        fill_from_hint(&mut hinted, &obs, &cfg, 1_000.0, &hint);
        assert_eq!(hinted.digest(), pass.digest());
        assert_eq!((hinted.live_total, hinted.last_launch[0]), (5, 700.0));
        assert_eq!(
            hinted.free_before[0],
            (2, 1),
            "a and the pinned f idle (its job is not queued), e booting"
        );
        // The stale hint is not taken.
        obs.fleet = Some(&stale);
        let (later, by_pass) = (figures(&obs, &cfg, 1_000.0), figures_by_pass(&obs, &cfg, 1_000.0));
        assert_eq!(later.digest(), by_pass.digest());
        assert_eq!(later.free_before[0], (2, 1));
    }

    #[test]
    fn stopped_workers_named_apart_are_listed_at_first_need_as_the_pass_lists_them() {
        let cfg = PolicyConfig::default();
        let mut workers = mixed_fleet();
        let mut g = worker("g", 0, WorkerState::Stopped, 1, 0.9);
        g.stopped_until = Some(5_000.0);
        workers.push(g);
        let hint = FleetHint {
            stopped: vec![6],
            stopped_due: 5_000.0,
            ..hint_of(vec![0, 1, 4, 5])
        };
        let mut obs = observe(&workers);
        let pass = figures(&obs, &cfg, 1_000.0);
        obs.fleet = Some(&hint);
        let mut hinted = Fleet::empty(cfg.lanes.len());
        fill_from_hint(&mut hinted, &obs, &cfg, 1_000.0, &hint);
        assert!(hinted.stopped.lists[0].is_empty(), "not listed before it is asked for");
        assert_eq!(hinted.stopped.due, 5_000.0);
        // The debug check compares what a listing would give, and lists nothing itself.
        assert_eq!(hinted.digest(), pass.digest());
        assert!(hinted.stopped.lists[0].is_empty());
        let listed: Vec<&str> = hinted.stopped.of(0).iter().map(|w| w.id.as_str()).collect();
        assert_eq!(listed, ["g"]);
        assert_eq!(hinted.digest(), pass.digest());
        // The pass lists them as it goes, and has no due time: each is looked at.
        assert_eq!(pass.stopped.due, f64::NEG_INFINITY);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "the FleetHint disagrees with the workers")]
    fn a_hint_that_misses_an_idle_worker_fails_a_debug_build() {
        let cfg = PolicyConfig::default();
        let workers = mixed_fleet();
        let hint = hint_of(vec![1, 4, 5]);
        let obs = Observation {
            fleet: Some(&hint),
            ..observe(&workers)
        };
        figures(&obs, &cfg, 1_000.0);
    }
}
