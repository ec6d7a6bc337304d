//! The fleet figures `decide` reads, kept worker by worker as the replay changes its workers, so a
//! decision visits only the workers that can be free capacity or pinned to a job
//! ([`onoff_policy::FleetHint`]) instead of every worker. On full Philly a decision sees about 175
//! workers, of which about 20 are idle, booting or about to end their job; the pass over all of
//! them was a third of the replay's instructions.
//!
//! The world tells it every worker that comes ([`FleetIndex::add`]), goes
//! ([`FleetIndex::remove`]) or moves to another index ([`FleetIndex::moved`]), and every change
//! of a worker's state or `busy_until` ([`FleetIndex::change`], through `World::change_worker`); a
//! worker's lane, shape, price and launch time never change. Debug builds of `decide` check each
//! hint against a pass over the workers (and the engine its visit list), so a change that skips
//! the index fails the replay tests that reach it.

use std::collections::{BTreeMap, BTreeSet};

use onoff_policy::{FleetHint, WorkerState, WorkerView};

use crate::ordered;

/// A multiset of floats: its size, least and greatest element.
#[derive(Debug, Default, Clone)]
struct Floats {
    /// Each value (keyed by [`ordered`]) and how many times it is in.
    counts: BTreeMap<u64, (f64, u32)>,
    len: u32,
}

impl Floats {
    fn insert(&mut self, x: f64) {
        self.counts.entry(ordered(x)).or_insert((x, 0)).1 += 1;
        self.len += 1;
    }
    fn remove(&mut self, x: f64) {
        let k = ordered(x);
        match self.counts.get_mut(&k) {
            Some(e) if e.1 > 1 => e.1 -= 1,
            Some(_) => {
                self.counts.remove(&k);
            }
            None => {
                debug_assert!(false, "removing {x}, which was never added");
                return;
            }
        }
        self.len -= 1;
    }
    fn min(&self) -> Option<f64> {
        self.counts.values().next().map(|e| e.0)
    }
    fn max(&self) -> Option<f64> {
        self.counts.values().next_back().map(|e| e.0)
    }
    fn len(&self) -> u32 {
        self.len
    }
}

/// A set of worker indices, kept as an ascending list: the sets here hold tens of workers (about
/// 20 awake and 75 stopped on full Philly) and are read whole on every decision, which walking a
/// `BTreeSet` made 3 % of a full Philly replay's instructions (`callgrind`); a change moves at
/// most the list's tail.
#[derive(Debug, Default, Clone)]
struct Indices(Vec<usize>);

impl Indices {
    fn insert(&mut self, i: usize) {
        if let Err(at) = self.0.binary_search(&i) {
            self.0.insert(at, i);
        }
    }
    fn remove(&mut self, i: usize) {
        if let Ok(at) = self.0.binary_search(&i) {
            self.0.remove(at);
        }
    }
}

/// The live workers' figures, and the workers a decision visits, by index in the world's workers.
#[derive(Debug, Default, Clone)]
pub(crate) struct FleetIndex {
    /// Per lane index: launch times of the live (pending, running, idle) workers.
    launched: Vec<Floats>,
    /// Per (GPUs, GPU memory bits): prices of the live workers, $/h.
    prices: Vec<((u32, u64), Floats)>,
    /// Indices of the idle and booting workers.
    awake: Indices,
    /// Indices of the stopped workers.
    stopped: Indices,
    /// The stopped workers' `stopped_until`, and how many have none.
    stopped_until: Floats,
    stopped_unknown: u32,
    /// `stopped` changed since the last hint listed it.
    stopped_changed: bool,
    /// (`busy_until` as [`ordered`], index) of the running workers with an expected end.
    running: BTreeSet<(u64, usize)>,
    /// The same ends per (lane, GPUs), ascending ([`FleetHint::running_ends`]), and whether they
    /// changed since the last hint copied them.
    running_ends: Vec<((usize, u32), Vec<f64>, bool)>,
    /// Scratch for [`FleetIndex::hint`].
    soon: Vec<usize>,
}

/// What [`FleetIndex`] reads of a worker that can change: its state, expected job end and end of
/// its stopped keep-alive.
pub(crate) type Brief = (WorkerState, Option<f64>, Option<f64>);

/// `w`'s lane and GPUs, which never change.
fn shape(w: &WorkerView) -> (usize, u32) {
    (w.lane, w.gpus)
}

/// `w`'s [`Brief`].
pub(crate) fn brief(w: &WorkerView) -> Brief {
    (w.state, w.busy_until, w.stopped_until)
}

impl FleetIndex {
    /// A new worker at index `i`.
    pub(crate) fn add(&mut self, i: usize, w: &WorkerView) {
        if w.is_live() {
            self.count(w, true);
        }
        self.mark(i, shape(w), brief(w), true);
    }

    /// The worker at index `i` goes (before it is removed).
    pub(crate) fn remove(&mut self, i: usize, w: &WorkerView) {
        if w.is_live() {
            self.count(w, false);
        }
        self.mark(i, shape(w), brief(w), false);
    }

    /// The worker `w`, at index `from`, moved to index `to` (a swap-remove filled a gap with it).
    pub(crate) fn moved(&mut self, from: usize, to: usize, w: &WorkerView) {
        // This takes its job end out of the sorted ends and puts it back, which a move need not;
        // keeping the ends apart from `mark` to skip that cost more (callgrind, full Philly: 7.00
        // G instructions against 7.03 G).
        self.mark(from, shape(w), brief(w), false);
        self.mark(to, shape(w), brief(w), true);
    }

    /// The worker `w` at index `i` changed from `before`. Its lane, shape and price never change,
    /// nor its launch time but while it is not live (a stopped worker started again).
    pub(crate) fn change(&mut self, i: usize, before: Brief, w: &WorkerView) {
        match (before.0.is_live(), w.is_live()) {
            (false, true) => self.count(w, true),
            (true, false) => self.count(w, false),
            _ => {}
        }
        self.mark(i, shape(w), before, false);
        self.mark(i, shape(w), brief(w), true);
    }

    /// Add (or take away) a live worker's launch time and price.
    fn count(&mut self, w: &WorkerView, on: bool) {
        if self.launched.len() <= w.lane {
            self.launched.resize_with(w.lane + 1, Floats::default);
        }
        let shape = (w.gpus, w.gpu_memory_gib.to_bits());
        let at = match self.prices.iter().position(|p| p.0 == shape) {
            Some(at) => at,
            None => {
                self.prices.push((shape, Floats::default()));
                self.prices.len() - 1
            }
        };
        if on {
            self.launched[w.lane].insert(w.launched_at);
            self.prices[at].1.insert(w.price_usd_per_h);
        } else {
            self.launched[w.lane].remove(w.launched_at);
            self.prices[at].1.remove(w.price_usd_per_h);
        }
    }

    /// Name (or stop naming) index `i` among the workers a decision may visit.
    fn mark(&mut self, i: usize, shape: (usize, u32), (state, busy_until, stopped_until): Brief, on: bool) {
        match (state, busy_until) {
            (WorkerState::Stopped, _) => {
                self.stopped_changed = true;
                match (stopped_until, on) {
                    (Some(t), true) => self.stopped_until.insert(t),
                    (Some(t), false) => self.stopped_until.remove(t),
                    (None, true) => self.stopped_unknown += 1,
                    (None, false) => self.stopped_unknown -= 1,
                }
                if on {
                    self.stopped.insert(i);
                } else {
                    self.stopped.remove(i);
                }
            }
            (WorkerState::Idle | WorkerState::Pending, _) => {
                if on {
                    self.awake.insert(i);
                } else {
                    self.awake.remove(i);
                }
            }
            (WorkerState::Running, Some(t)) => {
                let at = match self.running_ends.iter().position(|e| e.0 == shape) {
                    Some(at) => at,
                    None => {
                        self.running_ends.push((shape, Vec::new(), true));
                        self.running_ends.len() - 1
                    }
                };
                let (_, ends, changed) = &mut self.running_ends[at];
                *changed = true;
                // Among equal ends any one will do: they are the same value.
                let pos = ends.partition_point(|e| e.total_cmp(&t).is_lt());
                if on {
                    self.running.insert((ordered(t), i));
                    ends.insert(pos, t);
                } else {
                    self.running.remove(&(ordered(t), i));
                    debug_assert!(
                        ends.get(pos).is_some_and(|e| e.total_cmp(&t).is_eq()),
                        "removing an end never added"
                    );
                    ends.remove(pos);
                }
            }
            _ => {}
        }
    }

    /// The hint for a decision at `now` with short-job horizon `horizon_s`, into `hint` (its
    /// buffers reused).
    pub(crate) fn hint(&mut self, now: f64, horizon_s: f64, hint: &mut FleetHint) {
        hint.now = now;
        hint.horizon_s = horizon_s;
        // The running workers ending soon (a few), then merged with the awake ones (in order).
        // A second past the horizon: `decide` checks each worker's end exactly (`t - now <
        // horizon`, which rounding can make differ from `t < now + horizon`).
        let until = ordered(now + horizon_s + 1.0);
        self.soon.clear();
        self.soon.extend(self.running.range(..(until, 0)).map(|&(_, i)| i));
        self.soon.sort_unstable();
        hint.visit.clear();
        let mut soon = self.soon.iter().copied().peekable();
        for &i in &self.awake.0 {
            while let Some(j) = soon.next_if(|&j| j < i) {
                hint.visit.push(j);
            }
            hint.visit.push(i);
        }
        hint.visit.extend(soon);
        if std::mem::take(&mut self.stopped_changed) || hint.stopped.len() != self.stopped.0.len() {
            hint.stopped.clone_from(&self.stopped.0);
        }
        hint.stopped_due = match (self.stopped_unknown, self.stopped_until.min()) {
            (0, Some(t)) => t,
            (0, None) => f64::INFINITY,
            _ => f64::NEG_INFINITY,
        };
        hint.lane_live.clear();
        hint.lane_live.extend(
            self.launched
                .iter()
                .map(|l| (l.len(), l.max().unwrap_or(f64::NEG_INFINITY))),
        );
        hint.cheapest.clear();
        hint.cheapest
            .extend(self.prices.iter().filter_map(|(shape, p)| Some((*shape, p.min()?))));
        // The pairs keep their places: a pair once seen stays (perhaps empty), so only the
        // lists that changed are copied, into the hint's own buffers.
        hint.running_ends.truncate(self.running_ends.len());
        for (i, (shape, ends, changed)) in self.running_ends.iter_mut().enumerate() {
            match hint.running_ends.get_mut(i) {
                Some(h) if h.0 == *shape => {
                    if std::mem::take(changed) {
                        h.1.clone_from(ends);
                    }
                }
                Some(h) => {
                    *changed = false;
                    h.0 = *shape;
                    h.1.clone_from(ends);
                }
                None => {
                    *changed = false;
                    hint.running_ends.push((*shape, ends.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_policy::{CapacityType, OfferingKey};

    fn worker(state: WorkerState, lane: usize, launched_at: f64, price: f64, busy_until: Option<f64>) -> WorkerView {
        WorkerView {
            id: "i-0".into(),
            seq: 0,
            lane,
            offering: OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: "us-east-1a".into(),
                capacity_type: CapacityType::Spot,
            },
            gpus: 1,
            gpu_memory_gib: 24.0,
            price_usd_per_h: price,
            state,
            launched_at,
            idle_since: None,
            project: None,
            job_type: None,
            busy_until,
            pinned_job: None,
            spot_price_usd_per_h: None,
            stopped_until: None,
            cached_projects: Vec::new(),
        }
    }

    #[test]
    fn floats_order_as_floats_and_count_repeats() {
        let mut f = Floats::default();
        for x in [3.0, -1.0, 0.5, 3.0] {
            f.insert(x);
        }
        assert_eq!((f.min(), f.max(), f.len()), (Some(-1.0), Some(3.0), 4));
        f.remove(3.0);
        assert_eq!((f.max(), f.len()), (Some(3.0), 3));
        f.remove(3.0);
        f.remove(-1.0);
        assert_eq!((f.min(), f.max(), f.len()), (Some(0.5), Some(0.5), 1));
    }

    #[test]
    fn a_hint_names_the_awake_and_soon_free_workers_and_the_live_figures() {
        let mut ix = FleetIndex::default();
        let ws = [
            worker(WorkerState::Running, 0, 100.0, 1.0, Some(10_000.0)),
            worker(WorkerState::Idle, 0, 200.0, 0.8, None),
            worker(WorkerState::Running, 1, 300.0, 1.2, Some(1_050.0)),
            worker(WorkerState::Draining, 0, 400.0, 0.5, None),
            worker(WorkerState::Pending, 1, 500.0, 1.1, None),
        ];
        for (i, w) in ws.iter().enumerate() {
            ix.add(i, w);
        }
        let mut h = FleetHint::default();
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(h.visit, vec![1, 2, 4]);
        assert_eq!(h.lane_live, vec![(2, 200.0), (2, 500.0)]);
        // The draining worker's 0.5 $/h is not a live price.
        assert_eq!(h.cheapest, vec![((1, 24f64.to_bits()), 0.8)]);
        assert_eq!(h.running_ends, vec![((0, 1), vec![10_000.0]), ((1, 1), vec![1_050.0])]);
        // The idle worker starts a job ending far out; the booting one goes, and the last worker
        // (draining) takes its place.
        let started = worker(WorkerState::Running, 0, 200.0, 0.8, Some(9_000.0));
        ix.change(1, brief(&ws[1]), &started);
        ix.remove(4, &ws[4]);
        ix.remove(0, &ws[0]);
        ix.moved(3, 0, &ws[3]);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(h.visit, vec![2]);
        assert_eq!(h.lane_live, vec![(1, 200.0), (1, 300.0)]);
        // Lane 0's ends are the started job's only; lane 1's, unchanged, are kept as they were.
        assert_eq!(h.running_ends, vec![((0, 1), vec![9_000.0]), ((1, 1), vec![1_050.0])]);
        // Equal ends are both counted, and one goes when one of them does.
        let twin = worker(WorkerState::Running, 0, 600.0, 0.8, Some(9_000.0));
        let earlier = worker(WorkerState::Running, 0, 650.0, 0.8, Some(2_000.0));
        ix.add(5, &twin);
        ix.add(6, &earlier);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(h.running_ends[0], ((0, 1), vec![2_000.0, 9_000.0, 9_000.0]));
        ix.remove(5, &twin);
        ix.remove(6, &earlier);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(h.running_ends[0], ((0, 1), vec![9_000.0]));
        assert_eq!(h.cheapest, vec![((1, 24f64.to_bits()), 0.8)]);
        // The draining worker, now at 0, turns idle (as no worker does; the index still follows).
        let idle = worker(WorkerState::Idle, 0, 400.0, 0.5, None);
        ix.change(0, brief(&ws[3]), &idle);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(h.visit, vec![0, 2]);
        assert_eq!(h.lane_live, vec![(2, 400.0), (1, 300.0)]);
        assert_eq!(h.cheapest, vec![((1, 24f64.to_bits()), 0.5)]);
    }

    #[test]
    fn stopped_workers_are_listed_apart_with_the_earliest_end_of_their_keep() {
        let mut ix = FleetIndex::default();
        let stopped = |until: Option<f64>| WorkerView {
            stopped_until: until,
            ..worker(WorkerState::Stopped, 0, 100.0, 1.0, None)
        };
        let ws = [
            stopped(Some(5_000.0)),
            worker(WorkerState::Idle, 0, 200.0, 0.8, None),
            stopped(Some(3_000.0)),
        ];
        for (i, w) in ws.iter().enumerate() {
            ix.add(i, w);
        }
        let mut h = FleetHint::default();
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(
            (h.visit.clone(), h.stopped.clone(), h.stopped_due),
            (vec![1], vec![0, 2], 3_000.0)
        );
        // Its keep set when it was stopped: a later one.
        let kept = stopped(Some(8_000.0));
        ix.change(2, brief(&ws[2]), &kept);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!((h.stopped.clone(), h.stopped_due), (vec![0, 2], 5_000.0));
        // One without a keep: decide looks at each.
        let unknown = stopped(None);
        ix.change(0, brief(&ws[0]), &unknown);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(h.stopped_due, f64::NEG_INFINITY);
        // Started again: none stopped but the one, moved to index 1's place.
        let started = worker(WorkerState::Pending, 0, 1_000.0, 1.0, None);
        ix.change(0, brief(&unknown), &started);
        ix.remove(1, &ws[1]);
        ix.moved(2, 1, &kept);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!(
            (h.visit.clone(), h.stopped.clone(), h.stopped_due),
            (vec![0], vec![1], 8_000.0)
        );
        ix.remove(1, &kept);
        ix.hint(1_000.0, 120.0, &mut h);
        assert_eq!((h.stopped.clone(), h.stopped_due), (vec![], f64::INFINITY));
    }
}
