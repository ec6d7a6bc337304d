//! The arrivals a lane's decisions are made on, as the simulator sees them.
//!
//! The policy reads two things of a lane's arrivals ([`LaneObservation`]): the gap and run-time
//! statistics of every arrival so far ([`LaneObservation::gaps`], decaying with a one-day
//! half-life: the keep-alive and the stopped keep), and the arrivals of the predictive pool's
//! look-back ([`LaneObservation::recent_arrivals`]). The simulator records every arrival as it
//! comes. A reconcile run sees only the jobs table, so each run:
//!
//! 1. loads the lane's statistics kept by the run before ([`ArrivalStats`], an item of the
//!    control table);
//! 2. lists the lane's jobs created since the earlier of their `folded_to` and the start of the
//!    look-back ([`JobStore::arrivals`]: finished jobs too; the `active` index it read before
//!    drops a job once it ends, so a burst of short jobs that had ended was no arrival to the
//!    policy, and the gaps came only from the unfinished jobs of the last 6 h);
//! 3. folds the arrivals created after `folded_to` (and at least [`ARRIVAL_SETTLE_S`] ago) into
//!    the statistics, in creation order, as the simulator records them, and the look-back's
//!    arrivals into the recent ones ([`fold`]);
//! 4. keeps the statistics if no other run kept newer ones meanwhile
//!    ([`ArrivalStatsStore::save_arrival_stats`]).
//!
//! So the deployed policy decides on the statistics the simulator's figures were measured with
//! (`fold` over any split of the arrivals into runs gives what recording them one by one gives:
//! tested). An arrival that declared no run time (`est_runtime_s`) is recorded with the lane's
//! estimate at the time it is folded (the mean of its last jobs to finish,
//! [`onoff_policy::RecentRunTimes`]); the simulator records it with the estimate at its arrival
//! (`onoff simulate --undeclared-runtimes`).

use crate::ports::{ArrivalRecord, ArrivalStats, ArrivalStatsStore, JobRecord, JobStore, StoreError};
use onoff_policy::observation::RECENT_ARRIVALS_KEPT_S;
use onoff_policy::LaneObservation;

/// Seconds after its creation before an arrival is folded into the kept statistics: the arrivals
/// index is eventually consistent (a write reaches a global secondary index "within a fraction
/// of a second" in normal conditions, DynamoDB Developer Guide, "Read consistency"), and an
/// arrival folded past would be left out for good. Younger arrivals
/// count among the recent ones at once and are folded by a later run.
pub const ARRIVAL_SETTLE_S: f64 = 10.0;

/// How far back a run folds at most, seconds (6 h, as far as the recent arrivals reach): the
/// first run of a lane, or one after the control plane was away for longer, folds the last 6 h
/// only, so a run's reads and memory stay bounded (a stream of 2.5 items a second, the Azure
/// trace's rate, is 54,000 arrivals in 6 h: about 3,400 read units and 30 MB of specs in the
/// function's 256 MB). A first run's statistics start there, as a replay's start at its first
/// arrival.
pub const FOLD_AT_MOST_S: f64 = RECENT_ARRIVALS_KEPT_S;

/// One arrival as the policy records it: (created at, GPUs per instance, declared run time).
pub type Arrival = (f64, u32, Option<f64>);

/// Where a run's listing of a lane's arrivals starts (exclusive), unix seconds: at the earlier of
/// the statistics' `folded_to` (the last arrival folded) and `now - lookback_s` (the
/// arrivals the policy reads among the recent ones; 0 when the lane reads none), but at most
/// [`FOLD_AT_MOST_S`] back.
#[must_use]
pub fn listing_start(kept: Option<&ArrivalStats>, lookback_s: f64, now: f64) -> f64 {
    let folded_to = kept.map_or(f64::NEG_INFINITY, |k| k.folded_to);
    folded_to.min(now - lookback_s.max(0.0)).max(now - FOLD_AT_MOST_S)
}

/// The lane's observation of its arrivals at `now`, and the statistics to keep: `kept` (or none)
/// with the `arrivals` created after its `folded_to` and no later than `now -`
/// [`ARRIVAL_SETTLE_S`] recorded into its gaps in order; every arrival of the last
/// [`RECENT_ARRIVALS_KEPT_S`] among the recent ones. `arrivals` in creation order. The third
/// value counts the arrivals folded.
#[must_use]
pub fn fold(kept: Option<&ArrivalStats>, arrivals: &[Arrival], now: f64) -> (LaneObservation, ArrivalStats, usize) {
    let mut lo = LaneObservation::default();
    let mut folded_to = 0.0;
    if let Some(k) = kept {
        lo.gaps = k.gaps.clone();
        folded_to = k.folded_to;
    }
    let (settled, recent_from) = (now - ARRIVAL_SETTLE_S, now - RECENT_ARRIVALS_KEPT_S);
    let mut to = folded_to;
    let mut folded = 0;
    for &(at, gpus, runtime) in arrivals {
        if at > folded_to && at <= settled {
            lo.record_arrival_with_runtime(gpus, at, runtime);
            to = at;
            folded += 1;
        } else if at >= recent_from && at <= now {
            lo.record_recent_arrival(gpus, at, runtime);
        }
    }
    // Those folded after an absence may be older than the recent ones reach.
    while lo.recent_arrivals.front().is_some_and(|a| a.at < recent_from) {
        lo.recent_arrivals.pop_front();
    }
    let stats = ArrivalStats {
        folded_to: to,
        gaps: lo.gaps.clone(),
    };
    (lo, stats, folded)
}

/// What [`observe`] saw of a lane.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The lane's arrivals as the policy reads them.
    pub lane: LaneObservation,
    /// Arrivals folded into the kept statistics by this run.
    pub folded: usize,
    /// Rows of the index that did not parse: (key, problem).
    pub unreadable: Vec<(String, String)>,
    /// Non-fatal errors (the write of the statistics; a write refused because another run kept
    /// newer statistics first is none: the next run folds from those).
    pub errors: Vec<String>,
}

/// Steps 1–4 of the module's doc for `lane`, whose policy reads `lookback_s` seconds of recent
/// arrivals; `counted` gives a job's GPUs per instance and run time as the policy counts them
/// (declared, or the lane's estimate; `None`: unknown). `known`: jobs of
/// the lane the run has read otherwise (the `active` index, and the asked jobs read by id past
/// it), added where the arrivals index does not show them yet (it is eventually consistent too):
/// a job submitted just before the scale request it asked for is among the run's arrivals.
///
/// # Errors
/// The kept statistics or the arrivals cannot be read (the caller falls back to what it has).
pub async fn observe<J, S>(
    jobs: &J,
    store: &S,
    lane: &str,
    lookback_s: f64,
    now: f64,
    known: &[JobRecord],
    mut counted: impl FnMut(&ArrivalRecord) -> (u32, Option<f64>),
) -> Result<Observed, StoreError>
where
    J: JobStore,
    S: ArrivalStatsStore,
{
    let kept = store.load_arrival_stats(lane).await?;
    let start = listing_start(kept.as_ref(), lookback_s, now);
    let mut listed = jobs.arrivals(lane, start).await?;
    let ids: std::collections::BTreeSet<&str> = listed.items.iter().map(|a| a.id.as_str()).collect();
    let missing: Vec<ArrivalRecord> = known
        .iter()
        .filter(|k| k.spec.lane == lane && k.created_at > start && k.created_at <= now && !ids.contains(k.id.as_str()))
        .map(|k| ArrivalRecord {
            id: k.id.clone(),
            created_at: k.created_at,
            spec: k.spec.clone(),
        })
        .collect();
    if !missing.is_empty() {
        listed.items.extend(missing);
        listed
            .items
            .sort_by(|a, b| a.created_at.total_cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
    }
    let arrivals: Vec<Arrival> = listed
        .items
        .iter()
        .map(|a| {
            let (gpus, runtime) = counted(a);
            (a.created_at, gpus, runtime)
        })
        .collect();
    let (lane_obs, stats, folded) = fold(kept.as_ref(), &arrivals, now);
    let mut out = Observed {
        lane: lane_obs,
        folded,
        unreadable: listed.unreadable,
        ..Observed::default()
    };
    if folded > 0 {
        match store
            .save_arrival_stats(lane, &stats, kept.as_ref().map(|k| k.folded_to))
            .await
        {
            Ok(_) => {}
            Err(e) => out.errors.push(format!("keep the arrival statistics of {lane}: {e}")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arrivals of two shapes, some with run times, at irregular times from t0.
    fn arrivals(n: usize, t0: f64) -> Vec<Arrival> {
        let mut t = t0;
        (0..n)
            .map(|i| {
                // A burst every 40 arrivals, else gaps of minutes to hours.
                t += if i % 40 < 10 {
                    3.0 + (i % 7) as f64
                } else {
                    60.0 * ((i * 37) % 200) as f64
                };
                let gpus = if i % 5 == 0 { 4 } else { 1 };
                let runtime = (i % 3 != 0).then_some(100.0 * ((i * 13) % 90) as f64);
                (t, gpus, runtime)
            })
            .collect()
    }

    /// As the simulator keeps them: every arrival recorded as it comes.
    fn recorded(all: &[Arrival], now: f64) -> LaneObservation {
        let mut lo = LaneObservation::default();
        for &(at, g, r) in all.iter().filter(|a| a.0 <= now) {
            lo.record_arrival_with_runtime(g, at, r);
        }
        lo
    }

    /// Per shape: GPUs, gap samples, run-time samples, last arrival, and the masses.
    type Summary = Vec<(u32, u64, u64, Option<f64>, Vec<f64>)>;

    /// The gaps' masses, samples and last arrivals, to compare statistics that went through JSON
    /// (a number read back may differ in its last bit).
    fn summary(lo: &LaneObservation) -> Summary {
        lo.gaps
            .iter()
            .map(|(g, s)| {
                let masses: Vec<f64> = s.hist.masses().chain(s.runtimes.masses()).collect();
                (*g, s.hist.samples(), s.runtimes.samples(), s.last_arrival, masses)
            })
            .collect()
    }

    fn assert_same(a: &LaneObservation, b: &LaneObservation) {
        let (sa, sb) = (summary(a), summary(b));
        assert_eq!(sa.len(), sb.len());
        for (x, y) in sa.iter().zip(&sb) {
            assert_eq!((x.0, x.1, x.2, x.3), (y.0, y.1, y.2, y.3));
            for (p, q) in x.4.iter().zip(&y.4) {
                assert!((p - q).abs() < 1e-9, "{p} against {q}");
            }
        }
        assert_eq!(a.recent_arrivals, b.recent_arrivals);
    }

    #[test]
    fn folding_run_by_run_gives_the_statistics_of_recording_every_arrival() {
        let all = arrivals(600, 1_000_000.0);
        let end = all.last().unwrap().0 + 60.0;
        // Runs at irregular times; each lists from its listing start as the adapter would, and
        // the kept statistics go through JSON between runs as the control table keeps them.
        let mut kept: Option<ArrivalStats> = None;
        let mut now = all[0].0 - 5.0;
        let mut step = 0;
        while now < end {
            step += 1;
            now += [7.0, 45.0, 600.0, 3_600.0, 20.0, 9_000.0][step % 6];
            let start = listing_start(kept.as_ref(), 3.0 * 3600.0 + 390.0, now);
            let listed: Vec<Arrival> = all.iter().copied().filter(|a| a.0 > start && a.0 <= now).collect();
            let (lo, stats, _) = fold(kept.as_ref(), &listed, now);
            // What the policy reads now: the statistics of every arrival settled by now, and the
            // recent arrivals of the last 6 h as recorded one by one.
            let mut want = recorded(&all, now - ARRIVAL_SETTLE_S);
            want.recent_arrivals = recorded(&all, now)
                .recent_arrivals
                .into_iter()
                .filter(|a| a.at >= now - RECENT_ARRIVALS_KEPT_S && a.at > start)
                .collect();
            assert_same(&lo, &want);
            let text = serde_json::to_string(&stats).unwrap();
            kept = Some(serde_json::from_str(&text).unwrap());
        }
        assert!(step > 100, "{step} runs");
        let gaps = &kept.unwrap().gaps;
        assert_eq!(gaps[&1].hist.samples() + gaps[&4].hist.samples(), 600 - 2);
    }

    #[test]
    fn an_arrival_younger_than_the_settle_time_counts_as_recent_and_is_folded_by_a_later_run() {
        let now = 10_000.0;
        let listed = [(now - 100.0, 1, None), (now - 2.0, 1, Some(50.0))];
        let (lo, stats, folded) = fold(None, &listed, now);
        assert_eq!((folded, stats.folded_to), (1, now - 100.0));
        assert_eq!(lo.recent_arrivals.len(), 2);
        assert_eq!(lo.gaps[&1].runtimes.samples(), 0);
        let later = now + 30.0;
        let listed: Vec<Arrival> = listed
            .iter()
            .copied()
            .filter(|a| a.0 > listing_start(Some(&stats), 0.0, later))
            .collect();
        assert_eq!(listed.len(), 1);
        let (lo, stats, folded) = fold(Some(&stats), &listed, later);
        assert_eq!((folded, stats.folded_to), (1, now - 2.0));
        assert_eq!((lo.gaps[&1].hist.samples(), lo.gaps[&1].runtimes.samples()), (1, 1));
    }

    /// A job the run read otherwise (the `active` index, an asked job read by id) that the
    /// arrivals index does not show yet counts among the arrivals, once, and another lane's not.
    #[test]
    fn a_job_the_index_does_not_show_yet_counts_once_when_the_run_knows_it() {
        use crate::fake::{FakeAvailability, FakeJobs};
        let now = 1_700_000_000.0;
        let spec = |lane: &str| {
            let mut s: crate::job::JobSpec =
                serde_json::from_value(serde_json::json!({"image": "i", "command": ["x"], "project": "p"})).unwrap();
            s.lane = lane.into();
            s
        };
        let jobs = FakeJobs::default();
        let listed = JobRecord::new("listed".into(), spec("standard"), "t".into(), now - 100.0);
        pollster::block_on(jobs.create(&listed)).unwrap();
        let young = JobRecord::new("young".into(), spec("standard"), "t".into(), now - 1.0);
        let other = JobRecord::new("other".into(), spec("express"), "t".into(), now - 2.0);
        let known = [listed, young, other];
        let o = pollster::block_on(observe(
            &jobs,
            &FakeAvailability::default(),
            "standard",
            3600.0,
            now,
            &known,
            |a| (1, a.spec.est_runtime_s),
        ))
        .unwrap();
        let at: Vec<f64> = o.lane.recent_arrivals.iter().map(|a| a.at).collect();
        assert_eq!(at, [now - 100.0, now - 1.0]);
        assert_eq!(o.folded, 1, "the young one is folded by a later run");
    }

    #[test]
    fn a_first_run_or_one_after_a_long_absence_lists_at_most_6_h() {
        let now = 10_000_000.0;
        assert_eq!(listing_start(None, 0.0, now), now - FOLD_AT_MOST_S);
        let stale = ArrivalStats {
            folded_to: now - 5.0 * 86_400.0,
            ..ArrivalStats::default()
        };
        assert_eq!(listing_start(Some(&stale), 3600.0, now), now - FOLD_AT_MOST_S);
        let fresh = ArrivalStats {
            folded_to: now - 60.0,
            ..ArrivalStats::default()
        };
        assert_eq!(listing_start(Some(&fresh), 0.0, now), now - 60.0);
        assert_eq!(listing_start(Some(&fresh), 3600.0, now), now - 3600.0);
    }
}
