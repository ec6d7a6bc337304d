//! The simulator's agenda: events in (time, sequence) order, some of them cancellable.
//!
//! Most events are pushed and popped once (boots, job ends, ticks). A spot worker's drawn
//! interruption (its notice and its end) is different: it is drawn at launch, mostly for a time
//! long after the worker is gone. On a plain binary heap such events stay until their time; on
//! full Philly they were 130 k of the heap's 131 k entries at its peak, and at 10 × Philly every
//! pop paid for them in cache misses. Cancellable events live in an ordered map instead, so the
//! worker's removal drops them.
//!
//! Every event gets the next sequence number, so ties in time pop in push order, whichever
//! side they are on.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use crate::ordered;

/// A cancellable event's key: its time as an ordered key, then its sequence number.
pub(crate) type Key = (u64, u64);

#[derive(Debug, Clone, Copy)]
struct Entry<E> {
    at: f64,
    seq: u64,
    ev: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.seq == o.seq
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Entry<E> {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap on (time, seq).
        o.at.total_cmp(&self.at).then(o.seq.cmp(&self.seq))
    }
}

/// Events of type `E` at times in seconds (any clock, as long as it is one clock).
#[derive(Debug)]
pub(crate) struct Agenda<E> {
    heap: BinaryHeap<Entry<E>>,
    cancellable: BTreeMap<Key, (f64, E)>,
    seq: u64,
}

impl<E> Default for Agenda<E> {
    fn default() -> Self {
        Agenda {
            heap: BinaryHeap::new(),
            cancellable: BTreeMap::new(),
            seq: 0,
        }
    }
}

impl<E: Copy> Agenda<E> {
    /// Add `ev` at `at`.
    pub(crate) fn push(&mut self, at: f64, ev: E) {
        self.seq += 1;
        self.heap.push(Entry { at, seq: self.seq, ev });
    }

    /// Add `ev` at `at`, to be dropped by [`Agenda::cancel`] with the key returned.
    pub(crate) fn push_cancellable(&mut self, at: f64, ev: E) -> Key {
        self.seq += 1;
        let key = (ordered(at), self.seq);
        self.cancellable.insert(key, (at, ev));
        key
    }

    /// Drop a cancellable event; one already popped (or cancelled) is left alone.
    pub(crate) fn cancel(&mut self, key: Key) {
        self.cancellable.remove(&key);
    }

    /// The time of the next event.
    pub(crate) fn next_at(&self) -> Option<f64> {
        let heap = self.heap.peek().map(|e| e.at);
        let cancellable = self.cancellable.first_key_value().map(|(_, &(at, _))| at);
        match (heap, cancellable) {
            (Some(h), Some(c)) => Some(h.min(c)),
            (h, c) => h.or(c),
        }
    }

    /// Take the next event: the earliest, and of equal times the first pushed.
    pub(crate) fn pop(&mut self) -> Option<(f64, E)> {
        let cancellable_first = match (self.heap.peek(), self.cancellable.first_key_value()) {
            (Some(h), Some((k, _))) => *k < (ordered(h.at), h.seq),
            (None, Some(_)) => true,
            _ => false,
        };
        if cancellable_first {
            self.cancellable.pop_first().map(|(_, e)| e)
        } else {
            self.heap.pop().map(|e| (e.at, e.ev))
        }
    }

    /// The cancellable events not yet popped or cancelled.
    pub(crate) fn cancellable(&self) -> impl Iterator<Item = &E> {
        self.cancellable.values().map(|(_, e)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(a: &mut Agenda<&'static str>) -> Vec<(f64, &'static str)> {
        std::iter::from_fn(|| a.pop()).collect()
    }

    #[test]
    fn events_pop_by_time_then_push_order_across_both_kinds() {
        let mut a = Agenda::default();
        a.push(5.0, "boot");
        a.push_cancellable(3.0, "notice");
        a.push(3.0, "tick");
        a.push_cancellable(5.0, "end");
        a.push(1.0, "job done");
        assert_eq!(a.next_at(), Some(1.0));
        assert_eq!(
            drain(&mut a),
            [
                (1.0, "job done"),
                (3.0, "notice"),
                (3.0, "tick"),
                (5.0, "boot"),
                (5.0, "end")
            ]
        );
        assert_eq!(a.next_at(), None);
    }

    #[test]
    fn a_cancelled_event_never_pops_and_a_popped_one_cancels_quietly() {
        let mut a = Agenda::default();
        let notice = a.push_cancellable(10.0, "notice");
        let end = a.push_cancellable(130.0, "end");
        a.push(60.0, "tick");
        assert_eq!(a.pop(), Some((10.0, "notice")));
        a.cancel(notice);
        a.cancel(end);
        assert_eq!(a.cancellable().count(), 0);
        assert_eq!(a.next_at(), Some(60.0));
        assert_eq!(drain(&mut a), [(60.0, "tick")]);
    }

    #[test]
    fn ordered_keys_order_as_the_floats() {
        let xs = [-1e300, -1.0, -0.0, 0.0, 1e-300, 1.0, 1.5e9, f64::INFINITY];
        for a in xs {
            for b in xs {
                assert_eq!(ordered(a).cmp(&ordered(b)), a.total_cmp(&b), "{a} against {b}");
            }
        }
    }

    #[test]
    fn only_cancellable_events_left_still_pop_in_order() {
        let mut a = Agenda::default();
        a.push_cancellable(7.0, "b");
        a.push_cancellable(2.0, "a");
        assert_eq!(a.next_at(), Some(2.0));
        assert_eq!(drain(&mut a), [(2.0, "a"), (7.0, "b")]);
    }
}
