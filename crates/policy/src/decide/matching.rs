//! Phase 2: queued jobs matched to free capacity.

use crate::choice::worth_an_on_demand_worker;
use crate::config::PolicyConfig;
use crate::deadline::keeps_off_spot;
use crate::observation::{Observation, PendingJob};
use crate::shape::fits;

use super::fleet::{Fleet, PerLane};
use super::{short_runtime, FreeClass};

/// Queued jobs per lane, most urgent first: earliest deadline, then longest queued, then id.
/// Jobs in `pinned_met` (workers launched for each are booting or held for it) are left out.
/// The lanes `unordered` says yes to (nothing reads their order, see `decide`) are left in
/// observation order: sorting a backlog of tens of thousands behind a full fleet was most of
/// each decision.
pub(crate) fn queues<'a>(
    obs: &Observation<'a>,
    nl: usize,
    pinned_met: &[&str],
    unordered: impl Fn(usize) -> bool,
) -> PerLane<Vec<&'a PendingJob>> {
    // Sized first: a backlog of thousands would otherwise grow each list by copying, every decision.
    // The per-lane lists are inline ([`PerLane`]): no allocation for a lane with nothing queued.
    let mut sizes: PerLane<usize> = smallvec::smallvec![0; nl];
    for j in obs.jobs.iter().filter(|j| j.lane < nl) {
        sizes[j.lane] += 1;
    }
    let mut by_lane: PerLane<Vec<&'a PendingJob>> = sizes.into_iter().map(Vec::with_capacity).collect();
    for j in obs
        .jobs
        .iter()
        .filter(|j| j.lane < nl && !pinned_met.contains(&j.id.as_str()))
    {
        by_lane[j.lane].push(j);
    }
    for (lane, jobs) in by_lane.iter_mut().enumerate() {
        if jobs.len() < 2 || unordered(lane) {
            continue;
        }
        jobs.sort_by(|a, b| {
            let da = a.deadline.unwrap_or(f64::INFINITY);
            let db = b.deadline.unwrap_or(f64::INFINITY);
            da.total_cmp(&db)
                .then(a.enqueued_at.total_cmp(&b.enqueued_at))
                .then_with(|| a.id.cmp(&b.id))
        });
    }
    by_lane
}

/// Match each lane's queued jobs, in order, to its free capacity (idle workers first, then
/// booting ones, of classes that fit the job); a short job rides on the credit of a worker
/// already taken by short jobs. Takes what it matches from `fleet.free`; returns the jobs left
/// unmet per lane, in order.
pub(crate) fn match_jobs<'a>(
    cfg: &PolicyConfig,
    now: f64,
    queued: PerLane<Vec<&'a PendingJob>>,
    fleet: &mut Fleet<'a>,
) -> PerLane<Vec<&'a PendingJob>> {
    let oc = &cfg.offers;
    let mut unmet: PerLane<Vec<&'a PendingJob>> = smallvec::smallvec![Vec::new(); queued.len()];
    for (lane, jobs) in queued.into_iter().enumerate() {
        if fleet.free[lane].is_empty() {
            // No idle or booting worker, nor one ending soon: nothing to match (the usual case behind
            // a full fleet, where the backlog is longest).
            unmet[lane] = jobs;
            continue;
        }
        // A lane that may launch spot (an on-demand lane has no spot worker to keep a job off,
        // and no capacity pinned to a job: its at-risk jobs match as any other).
        let spot_lane = cfg.lanes.get(lane).is_none_or(|lc| lc.capacity.may_use_spot());
        // Idle and booting workers left: once none is, only a short job riding on a worker's
        // credit can still match (credit grows only when a job takes a worker), so any other job
        // is unmet without a pass over the classes, and every job is once no credit is left
        // either (behind a full fleet the backlog is long).
        let mut slots: u32 = fleet.free[lane].iter().map(|c| c.idle + c.pending).sum();
        let mut no_credit = false;
        let mut jobs = jobs.into_iter();
        while let Some(job) = jobs.next() {
            if slots == 0 {
                if no_credit {
                    unmet[lane].push(job);
                    unmet[lane].extend(jobs);
                    break;
                }
                if short_runtime(job, oc).is_none() {
                    unmet[lane].push(job);
                    continue;
                }
            }
            let min_mem = job.min_gpu_memory_gib.max(oc.min_gpu_memory_gib);
            // A job whose deadline is at risk on spot counts idle on-demand workers only: a booting
            // one, or a busy one it would queue behind, may go to a job queued ahead of it (workers
            // take the oldest message), so it gets capacity launched for it instead (pinned).
            let runtime = job.est_runtime_s.unwrap_or(oc.default_runtime_s);
            let off_spot = spot_lane && keeps_off_spot(job.deadline, runtime, now, job.enqueued_at, cfg);
            let waited = now - job.enqueued_at;
            // An on-demand worker of a spot-first lane only while its premium is worth it.
            let worth = |c: &FreeClass| {
                off_spot
                    || c.on_demand_of_spot.is_none_or(|(price, spot)| {
                        worth_an_on_demand_worker(price, spot, job.instances, runtime, waited, cfg)
                    })
            };
            let fit = |c: &FreeClass| {
                !(off_spot && c.spot)
                    && fits(c.gpus, c.mem, job.gpus_per_instance, min_mem, oc.max_gpu_oversize)
                    && worth(c)
            };
            let free = &mut fleet.free[lane];
            let short = short_runtime(job, oc).filter(|_| !off_spot);
            // Booting workers count as capacity, except for such a job.
            let phases: &[bool] = if off_spot { &[false] } else { &[false, true] };
            if let Some(rt) = short {
                if let Some(c) = free.iter_mut().find(|c| fit(c) && c.credit >= rt) {
                    c.credit -= rt;
                    if slots == 0 {
                        no_credit = free.iter().all(|c| c.credit <= 0.0);
                    }
                    continue;
                }
            }
            let avail: u32 = free
                .iter()
                .filter(|c| fit(c))
                .map(|c| phases.iter().map(|&p| if p { c.pending } else { c.idle }).sum::<u32>())
                .sum();
            if avail < job.instances.max(1) {
                unmet[lane].push(job);
                continue;
            }
            let mut need = job.instances.max(1);
            for &pending in phases {
                for c in free.iter_mut().filter(|c| fit(c)) {
                    let slot = if pending { &mut c.pending } else { &mut c.idle };
                    let take = need.min(*slot);
                    *slot -= take;
                    need -= take;
                    slots -= take;
                    if take > 0 {
                        if let Some(rt) = short {
                            c.credit += oc.short_job_horizon_s - rt;
                        }
                    }
                }
            }
            if slots == 0 {
                no_credit = fleet.free[lane].iter().all(|c| c.credit <= 0.0);
            }
        }
    }
    unmet
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CapacityPreference;
    use crate::decide::fleet::figures;
    use crate::observation::{WorkerState, WorkerView};

    fn job(id: &str, gpus: u32, enqueued_at: f64, runtime_s: f64, deadline: Option<f64>) -> PendingJob {
        PendingJob {
            id: id.into(),
            lane: 0,
            project: "p".into(),
            job_type: None,
            gpus_per_instance: gpus,
            instances: 1,
            min_gpu_memory_gib: 0.0,
            est_runtime_s: Some(runtime_s),
            deadline,
            enqueued_at,
        }
    }

    fn worker(id: &str, state: WorkerState, gpus: u32) -> WorkerView {
        WorkerView {
            id: id.into(),
            seq: 0,
            lane: 0,
            offering: crate::offering::OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: "us-east-1a".into(),
                capacity_type: crate::offering::CapacityType::Spot,
            },
            gpus,
            gpu_memory_gib: 24.0,
            price_usd_per_h: 1.0,
            state,
            launched_at: 0.0,
            idle_since: None,
            project: None,
            job_type: None,
            busy_until: None,
            pinned_job: None,
            spot_price_usd_per_h: None,
            stopped_until: None,
            cached_projects: Vec::new(),
        }
    }

    /// An on-demand worker.
    fn on_demand(id: &str, state: WorkerState, gpus: u32) -> WorkerView {
        let mut w = worker(id, state, gpus);
        w.offering.capacity_type = crate::offering::CapacityType::OnDemand;
        w
    }

    /// A running 1-GPU worker whose job ends at `busy_until` (now is 0).
    fn busy(id: &str, busy_until: Option<f64>) -> WorkerView {
        WorkerView {
            busy_until,
            ..worker(id, WorkerState::Running, 1)
        }
    }

    /// (workers, jobs) -> the ids left unmet.
    /// In one spot-first lane (the default config's first lane, `express`, is on-demand).
    fn unmet(workers: &[WorkerView], jobs: &[PendingJob]) -> Vec<String> {
        let cfg = PolicyConfig {
            lanes: vec![crate::config::LaneConfig::default()],
            ..PolicyConfig::default()
        };
        assert_eq!(cfg.lanes[0].capacity, CapacityPreference::SpotFirst);
        unmet_with(&cfg, workers, jobs)
    }

    fn unmet_with(cfg: &PolicyConfig, workers: &[WorkerView], jobs: &[PendingJob]) -> Vec<String> {
        let obs = Observation {
            lanes: &[],
            jobs,
            workers,
            offerings: &[],
            unavailable: &[],
            fleet: None,
        };
        let mut f = figures(&obs, cfg, 0.0);
        let q = queues(&obs, cfg.lanes.len(), &f.pinned_met, |_| false);
        match_jobs(cfg, 0.0, q, &mut f)
            .into_iter()
            .flatten()
            .map(|j| j.id.clone())
            .collect()
    }

    #[test]
    fn queues_sort_each_lane_most_urgent_first_but_leave_unordered_lanes_as_observed() {
        let mut jobs = vec![
            job("late", 1, 30.0, 60.0, None),
            job("early", 1, 10.0, 60.0, None),
            job("due", 1, 50.0, 60.0, Some(500.0)),
        ];
        let mut other: Vec<PendingJob> = jobs.iter().cloned().map(|j| PendingJob { lane: 1, ..j }).collect();
        jobs.append(&mut other);
        let obs = Observation {
            lanes: &[],
            jobs: &jobs,
            workers: &[],
            offerings: &[],
            unavailable: &[],
            fleet: None,
        };
        let ids = |q: &[&PendingJob]| q.iter().map(|j| j.id.clone()).collect::<Vec<_>>();
        let q = queues(&obs, 2, &[], |l| l == 1);
        assert_eq!(ids(&q[0]), ["due", "early", "late"]);
        assert_eq!(ids(&q[1]), ["late", "early", "due"]);
        let q = queues(&obs, 2, &[], |_| false);
        assert_eq!(ids(&q[1]), ["due", "early", "late"]);
    }

    #[test]
    fn jobs_take_free_capacity_of_a_fitting_class_urgent_first() {
        use WorkerState::*;
        let long = 7200.0;
        // (what, workers, jobs, the ids left unmet)
        type Case<'a> = (&'a str, Vec<WorkerView>, Vec<PendingJob>, &'a [&'a str]);
        let cases: &[Case] = &[
            (
                "an idle worker serves one job, the next is unmet",
                vec![worker("w1", Idle, 1)],
                vec![job("a", 1, 10.0, long, None), job("b", 1, 20.0, long, None)],
                &["b"],
            ),
            (
                "a booting worker counts as capacity",
                vec![worker("w1", Pending, 1)],
                vec![job("a", 1, 10.0, long, None)],
                &[],
            ),
            (
                "the earliest deadline goes first, whatever its arrival",
                vec![worker("w1", Idle, 1)],
                vec![job("a", 1, 10.0, long, None), job("b", 1, 20.0, long, Some(5_000.0))],
                &["a"],
            ),
            (
                "an 8-GPU job does not fit a 1-GPU worker",
                vec![worker("w1", Idle, 1)],
                vec![job("big", 8, 10.0, long, None)],
                &["big"],
            ),
            (
                "a 1-GPU job does not take an 8-GPU worker (max_gpu_oversize 1)",
                vec![worker("w8", Idle, 8)],
                vec![job("small", 1, 10.0, long, None)],
                &["small"],
            ),
            (
                "a running worker ending its job within the horizon takes short jobs for the rest of it",
                vec![busy("w1", Some(30.0))],
                vec![
                    job("s1", 1, 10.0, 30.0, None),
                    job("s2", 1, 11.0, 30.0, None),
                    job("s3", 1, 12.0, 30.0, None),
                    job("s4", 1, 13.0, 30.0, None),
                ],
                &["s4"],
            ),
            (
                "a running worker ending later, or at an unknown time, takes none",
                vec![busy("w1", Some(500.0)), busy("w2", None)],
                vec![job("s1", 1, 10.0, 30.0, None)],
                &["s1"],
            ),
            (
                "short jobs share one worker up to the horizon",
                vec![worker("w1", Idle, 1)],
                vec![
                    job("s1", 1, 10.0, 30.0, None),
                    job("s2", 1, 11.0, 30.0, None),
                    job("s3", 1, 12.0, 30.0, None),
                ],
                &[],
            ),
            // Deadlines (now 0; at risk under 1,980 s of slack; off spot from 390 s of it).
            (
                "a job whose deadline is at risk on spot does not count a spot worker",
                vec![worker("w1", Idle, 1), worker("w2", Pending, 1)],
                vec![job("d", 1, 10.0, long, Some(long + 1_000.0))],
                &["d"],
            ),
            (
                "it counts an idle on-demand one",
                vec![on_demand("w1", Idle, 1)],
                vec![job("d", 1, 10.0, long, Some(long + 1_000.0))],
                &[],
            ),
            (
                "not a booting one (a job queued ahead may take it): capacity is launched for it",
                vec![on_demand("w1", Pending, 1)],
                vec![job("d", 1, 10.0, long, Some(long + 1_000.0))],
                &["d"],
            ),
            (
                "once no worker is left, long jobs are unmet and a short one still rides on credit",
                vec![worker("w1", Idle, 1), busy("w2", Some(30.0))],
                vec![
                    job("a", 1, 10.0, long, None),
                    job("b", 1, 20.0, long, None),
                    job("c", 1, 30.0, 60.0, None),
                    job("d", 1, 40.0, long, None),
                ],
                &["b", "d"],
            ),
            (
                "once no worker and no credit are left, every job is unmet, short or long",
                vec![worker("w1", Idle, 1)],
                vec![
                    job("a", 1, 10.0, long, None),
                    job("b", 1, 20.0, 60.0, None),
                    job("c", 1, 30.0, long, None),
                ],
                &["b", "c"],
            ),
            (
                "with ample slack a deadline job takes spot",
                vec![worker("w1", Idle, 1)],
                vec![job("d", 1, 10.0, long, Some(long + 5_000.0))],
                &[],
            ),
            (
                "with less slack than a cold start any worker up is its best chance",
                vec![worker("w1", Idle, 1)],
                vec![job("d", 1, 10.0, long, Some(long + 100.0))],
                &[],
            ),
            (
                "a job that may take either takes spot, leaving on-demand to the one that may not",
                vec![on_demand("od", Idle, 1), worker("sp", Idle, 1)],
                vec![
                    job("late", 1, 10.0, long, Some(long - 200.0)),
                    job("d", 1, 20.0, long, Some(long + 1_000.0)),
                ],
                &[],
            ),
        ];
        // In an on-demand lane there is no spot to keep a job off: a booting worker counts.
        let mut od_lane = PolicyConfig {
            lanes: vec![crate::config::LaneConfig::default()],
            ..PolicyConfig::default()
        };
        od_lane.lanes[0].capacity = CapacityPreference::OnDemand;
        let (ws, js) = (
            [on_demand("w1", Pending, 1)],
            [job("d", 1, 10.0, long, Some(long + 1_000.0))],
        );
        assert_eq!(unmet_with(&od_lane, &ws, &js), Vec::<String>::new());
        assert_eq!(unmet(&ws, &js), ["d"]);
        for (what, workers, jobs, want) in cases {
            assert_eq!(
                unmet(workers, jobs),
                want.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                "{what}"
            );
        }
    }

    #[test]
    fn an_on_demand_worker_of_a_spot_first_lane_counts_only_for_jobs_its_premium_is_worth() {
        // An idle on-demand worker at 1.006 $/h whose best spot price is 0.36 $/h (now is 0). A
        // ten-hour job would pay $6.46 more there; the spot launch it would save is worth about
        // $0.15 at 1 $/h: unmet (a spot launch for it). A 30 s job, the same job after eight hours
        // queued, and one whose deadline is at risk on spot count it. So does every job on an
        // on-demand worker without a spot price (an on-demand lane's).
        let dear = WorkerView {
            price_usd_per_h: 1.006,
            spot_price_usd_per_h: Some(0.36),
            ..on_demand("od", WorkerState::Idle, 1)
        };
        let plain = WorkerView {
            spot_price_usd_per_h: None,
            ..dear.clone()
        };
        let long = 36_000.0;
        for (what, j, on_dear) in [
            ("a long job", job("j", 1, 0.0, long, None), false),
            ("a short job", job("j", 1, 0.0, 30.0, None), true),
            ("a long job queued 8 h", job("j", 1, -8.0 * 3600.0, long, None), true),
            ("a deadline at risk", job("j", 1, 0.0, long, Some(long + 600.0)), true),
        ] {
            let want: Vec<String> = if on_dear { vec![] } else { vec!["j".to_string()] };
            assert_eq!(
                unmet(std::slice::from_ref(&dear), std::slice::from_ref(&j)),
                want,
                "{what}"
            );
            assert!(
                unmet(std::slice::from_ref(&plain), &[j]).is_empty(),
                "{what}, no spot price"
            );
        }
    }
}
