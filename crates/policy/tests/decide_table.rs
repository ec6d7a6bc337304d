//! Table-driven tests of `decide`: each row is bare input counts / times and the expected launches,
//! terminations and held wants.

mod common;

use common::*;
use onoff_policy::{
    choice, keepalive, Action, CapacityPreference, CapacityType, ConfigError, DemandWindows, KeepAliveMode, LaneConfig,
    LaneObservation, Offering, PolicyConfig, ProjectQuota, Reason, ScaleDownConfig, UnavailableOffering, WarmWindow,
    WorkerState,
};

fn pending(id: &str, seq: u64, gpus: u32, launched_ago: f64) -> onoff_policy::WorkerView {
    worker(id, seq, WorkerState::Pending, gpus, NOW - launched_ago, None)
}

fn with_project(mut w: onoff_policy::WorkerView, p: &str) -> onoff_policy::WorkerView {
    w.project = Some(p.into());
    w
}

// ---------------------------------------------------------------------------------------------
// Booting workers count as capacity.

#[test]
fn no_duplicate_launches_while_workers_boot() {
    // (queued 1-GPU jobs, idle 1-GPU workers, pending 1-GPU workers, expected launches)
    let rows: &[(usize, usize, usize, u32)] = &[
        (0, 0, 0, 0),
        (1, 0, 0, 1),
        (5, 0, 0, 5),
        (1, 0, 1, 0),
        (5, 0, 5, 0),
        (5, 0, 2, 3),
        (5, 0, 4, 1),
        (2, 0, 5, 0),
        (3, 3, 0, 0),
        (5, 2, 2, 1),
        (8, 1, 3, 4),
    ];
    let cfg = cfg();
    for &(queued, n_idle, n_pending, want) in rows {
        let mut workers = Vec::new();
        for i in 0..n_idle {
            workers.push(idle(&format!("idle{i}"), i as u64, 5.0));
        }
        for i in 0..n_pending {
            workers.push(pending(&format!("pend{i}"), 100 + i as u64, 1, 90.0));
        }
        let w = World::new(jobs("j", queued), workers);
        let plan = w.decide(&cfg, NOW);
        let row = format!("queued {queued}, idle {n_idle}, pending {n_pending}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert_eq!(plan.lanes[0].unmet_jobs, want, "{row}");
        assert_eq!(plan.releases().count(), 0, "{row}: nothing is released: {plan:#?}");
        for (k, _, reason, job) in launch_list(&plan) {
            assert_eq!(k, &key(G5, CapacityType::Spot), "{row}");
            assert_eq!(job, None, "{row}");
            let expected = if n_idle + n_pending == 0 {
                Reason::Activation { backlog: queued as u32 }
            } else {
                Reason::UnmetBacklog { unmet_jobs: want }
            };
            assert_eq!(reason, &expected, "{row}");
        }
    }
}

#[test]
fn booting_workers_only_count_for_jobs_they_fit() {
    // (job GPUs, pending worker GPUs, queued, pending, expected launches, expected instance type)
    let rows: &[(u32, u32, usize, usize, u32, &str)] = &[
        (1, 1, 2, 2, 0, G5),
        (4, 1, 2, 2, 2, G5_12X), // a 4-GPU job does not fit a 1-GPU worker
        (1, 4, 2, 2, 2, G5),     // a 1-GPU job may not take a 4-GPU worker (max_gpu_oversize 1)
        (4, 4, 2, 1, 1, G5_12X), // one of two covered
        (8, 8, 3, 3, 0, P4D),    // covered
        (8, 4, 1, 2, 1, P4D),    // two 4-GPU workers are not one 8-GPU one
    ];
    let cfg = cfg();
    for &(jg, wg, queued, n_pending, want, ty) in rows {
        let js: Vec<_> = (0..queued).map(|i| job(&format!("j{i}"), jg, NOW - 60.0)).collect();
        let ws: Vec<_> = (0..n_pending)
            .map(|i| pending(&format!("p{i}"), i as u64, wg, 90.0))
            .collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        let row = format!("{queued} x {jg}-GPU jobs, {n_pending} x {wg}-GPU pending");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        for (k, ..) in launch_list(&plan) {
            assert_eq!(k, &key(ty, CapacityType::Spot), "{row}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Activation (0 -> 1) apart from the 1 -> N target.

#[test]
fn activation_is_apart_from_scale_out() {
    // (activation_backlog, queued, running workers, SQS visible override, expected launches, reason)
    type Row = (u32, usize, usize, Option<u32>, u32, Option<Reason>);
    let rows: Vec<Row> = vec![
        (1, 1, 0, None, 1, Some(Reason::Activation { backlog: 1 })),
        (3, 1, 0, None, 0, None),
        (3, 2, 0, None, 0, None),
        (3, 3, 0, None, 3, Some(Reason::Activation { backlog: 3 })),
        (3, 5, 0, None, 5, Some(Reason::Activation { backlog: 5 })),
        // The queue reports more than the jobs listed: the queue's figure activates the lane.
        (3, 1, 0, Some(3), 1, Some(Reason::Activation { backlog: 3 })),
        // Lane already live: the activation threshold does not apply.
        (3, 1, 1, None, 1, Some(Reason::UnmetBacklog { unmet_jobs: 1 })),
        (3, 2, 2, None, 2, Some(Reason::UnmetBacklog { unmet_jobs: 2 })),
        (1, 4, 3, None, 4, Some(Reason::UnmetBacklog { unmet_jobs: 4 })),
    ];
    for (threshold, queued, n_running, visible, want, reason) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].activation_backlog = threshold;
        let ws: Vec<_> = (0..n_running).map(|i| running(&format!("r{i}"))).collect();
        let mut w = World::new(jobs("j", queued), ws);
        if let Some(v) = visible {
            w.lanes[0].backlog.visible = v;
        }
        let plan = w.decide(&cfg, NOW);
        let row = format!("threshold {threshold}, queued {queued}, running {n_running}, visible {visible:?}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        let reasons: Vec<_> = launch_list(&plan).into_iter().map(|l| l.2.clone()).collect();
        match &reason {
            Some(r) => assert!(
                reasons.iter().all(|x| x == r) && !reasons.is_empty(),
                "{row}: {reasons:?}"
            ),
            None => assert!(reasons.is_empty(), "{row}"),
        }
    }
}

#[test]
fn draining_workers_do_not_keep_a_lane_active() {
    let mut cfg = cfg();
    cfg.lanes[0].activation_backlog = 2;
    let d = worker("d", 0, WorkerState::Draining, 1, NOW - 3600.0, None);
    // (queued, expected launches)
    for (queued, want) in [(1usize, 0u32), (2, 2)] {
        let plan = World::new(jobs("j", queued), vec![d.clone()]).decide(&cfg, NOW);
        assert_eq!(plan.launches(), want, "queued {queued}: {plan:#?}");
        if want > 0 {
            assert!(matches!(launch_list(&plan)[0].2, Reason::Activation { .. }));
        }
    }
}

#[test]
fn scale_up_hysteresis_and_window() {
    // (scale_up_unmet_jobs, scale_up_window_s, queued, job age s, running, expected launches)
    let rows: &[(u32, f64, usize, f64, usize, u32)] = &[
        (2, 0.0, 1, 60.0, 1, 0),
        (2, 0.0, 2, 60.0, 1, 2),
        (1, 120.0, 3, 60.0, 1, 0), // jobs too young
        (1, 120.0, 3, 180.0, 1, 3),
        (5, 0.0, 1, 60.0, 0, 1), // hysteresis does not hold back activation
    ];
    for &(band, window, queued, age, n_running, want) in rows {
        let mut cfg = cfg();
        cfg.anti_thrash.scale_up_unmet_jobs = band;
        cfg.anti_thrash.scale_up_window_s = window;
        let js: Vec<_> = (0..queued).map(|i| job(&format!("j{i}"), 1, NOW - age)).collect();
        let ws: Vec<_> = (0..n_running).map(|i| running(&format!("r{i}"))).collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        assert_eq!(
            plan.launches(),
            want,
            "band {band}, window {window}, queued {queued} aged {age}, running {n_running}: {plan:#?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Keep-alive (Fixed mode, 600 s) never touches busy or booting workers.

#[test]
fn fixed_keep_alive_releases_only_idle_workers_past_it() {
    struct Row {
        label: &'static str,
        state: WorkerState,
        launched_ago: f64,
        idle_for: Option<f64>,
        min_runtime: f64,
        other_launched_ago: Option<f64>,
        queued: usize,
        terminated: bool,
    }
    let r = |label, state, launched_ago, idle_for, min_runtime, other_launched_ago, queued, terminated| Row {
        label,
        state,
        launched_ago,
        idle_for,
        min_runtime,
        other_launched_ago,
        queued,
        terminated,
    };
    use WorkerState::*;
    let rows = [
        r("running", Running, 7200.0, None, 60.0, None, 0, false),
        r("draining", Draining, 7200.0, None, 60.0, None, 0, false),
        r("pending, needed", Pending, 7200.0, None, 60.0, None, 1, false),
        r("idle 601 s", Idle, 7200.0, Some(601.0), 60.0, None, 0, true),
        r("idle 600 s", Idle, 7200.0, Some(600.0), 60.0, None, 0, true),
        r("idle 599 s", Idle, 7200.0, Some(599.0), 60.0, None, 0, false),
        r("idle 10 s", Idle, 7200.0, Some(10.0), 60.0, None, 0, false),
        r("min runtime holds", Idle, 1000.0, Some(700.0), 1200.0, None, 0, false),
        r("min runtime passed", Idle, 1300.0, Some(700.0), 1200.0, None, 0, true),
        r(
            "scale-up 60 s ago",
            Idle,
            7200.0,
            Some(700.0),
            60.0,
            Some(60.0),
            0,
            false,
        ),
        r(
            "scale-up 119 s ago",
            Idle,
            7200.0,
            Some(700.0),
            60.0,
            Some(119.0),
            0,
            false,
        ),
        r(
            "scale-up 200 s ago",
            Idle,
            7200.0,
            Some(700.0),
            60.0,
            Some(200.0),
            0,
            true,
        ),
    ];
    for row in rows {
        let mut cfg = cfg();
        cfg.scale_down.mode = KeepAliveMode::Fixed;
        cfg.anti_thrash.min_runtime_s = row.min_runtime;
        let mut ws = vec![worker(
            "w",
            0,
            row.state,
            1,
            NOW - row.launched_ago,
            row.idle_for.map(|i| NOW - i),
        )];
        if let Some(ago) = row.other_launched_ago {
            let mut o = running("other");
            o.launched_at = NOW - ago;
            ws.push(o);
        }
        let plan = World::new(jobs("j", row.queued), ws).decide(&cfg, NOW);
        let t = terminated(&plan);
        assert_eq!(t.contains(&"w"), row.terminated, "{}: {plan:#?}", row.label);
        assert!(!t.contains(&"other"), "{}", row.label);
        assert!(cancelled(&plan).is_empty(), "{}: {plan:#?}", row.label);
        for a in &plan.actions {
            if let Action::Terminate { reason, .. } = a {
                let idle_s = row.idle_for.unwrap();
                assert_eq!(
                    reason,
                    &Reason::KeepAliveExpired {
                        idle_s,
                        keep_alive_s: 600.0
                    },
                    "{}",
                    row.label
                );
            }
        }
    }
}

#[test]
fn busy_and_booting_workers_survive_any_keep_alive_mode() {
    // Very long-running busy workers, and a booting worker with a job for it, in every mode.
    for mode in [
        KeepAliveMode::Fixed,
        KeepAliveMode::Adaptive,
        KeepAliveMode::CooldownDecay,
    ] {
        let mut cfg = cfg();
        cfg.scale_down.mode = mode;
        let ws = vec![
            worker("run", 0, WorkerState::Running, 1, NOW - 86_400.0, None),
            worker("drain", 1, WorkerState::Draining, 1, NOW - 86_400.0, None),
            worker("boot", 2, WorkerState::Pending, 4, NOW - 86_400.0, None),
            worker("idle", 3, WorkerState::Idle, 1, NOW - 86_400.0, Some(NOW - 80_000.0)),
        ];
        let js = vec![job("j", 4, NOW - 10.0)];
        let plan = World::new(js, ws).decide(&cfg, NOW);
        assert_eq!(terminated(&plan), vec!["idle"], "{mode:?}: {plan:#?}");
        assert!(cancelled(&plan).is_empty(), "{mode:?}");
        assert_eq!(plan.launches(), 0, "{mode:?}: the 4-GPU job has its booting worker");
    }
}

#[test]
fn idle_workers_taken_by_queued_jobs_are_not_released() {
    // Fixed keep-alive 600 s. A queued job takes the most recently idle worker that fits it.
    // (queued job GPUs (one job per entry), idle 1-GPU workers idle for s, expected terminated, launches)
    type Row = (&'static [u32], &'static [f64], &'static [&'static str], u32);
    let rows: &[Row] = &[
        (&[1], &[3000.0], &[], 0),
        (&[1], &[1000.0, 3000.0], &["w3000"], 0),
        (&[1, 1], &[1000.0, 3000.0], &[], 0),
        (&[], &[1000.0, 3000.0], &["w1000", "w3000"], 0),
        (&[4], &[3000.0], &["w3000"], 1),
        (&[1, 1, 1], &[1000.0, 3000.0], &[], 1),
    ];
    for &(job_gpus, idles, want, launches) in rows {
        let mut cfg = cfg();
        cfg.scale_down.mode = KeepAliveMode::Fixed;
        let js: Vec<_> = job_gpus
            .iter()
            .enumerate()
            .map(|(i, &g)| job(&format!("j{i}"), g, NOW - 5.0))
            .collect();
        let ws: Vec<_> = idles
            .iter()
            .enumerate()
            .map(|(i, &t)| idle(&format!("w{t}"), i as u64, t))
            .collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        let mut got = terminated(&plan);
        got.sort();
        assert_eq!(got, want.to_vec(), "jobs {job_gpus:?}, idle {idles:?}: {plan:#?}");
        assert_eq!(plan.launches(), launches, "jobs {job_gpus:?}, idle {idles:?}");
    }
}

#[test]
fn booting_workers_nothing_needs_are_cancelled_not_terminated() {
    // (queued jobs, pending launched s ago, expected cancelled)
    let rows: &[(usize, f64, bool)] = &[
        (0, 300.0, true),
        (0, 60.0, false), // within scale_down_delay_after_scale_up_s (120 s)
        (1, 300.0, false),
    ];
    for &(queued, ago, want) in rows {
        let plan = World::new(jobs("j", queued), vec![pending("p", 0, 1, ago)]).decide(&cfg(), NOW);
        assert!(terminated(&plan).is_empty());
        assert_eq!(
            !cancelled(&plan).is_empty(),
            want,
            "queued {queued}, ago {ago}: {plan:#?}"
        );
        for a in &plan.actions {
            if let Action::CancelLaunch { reason, .. } = a {
                assert_eq!(reason, &Reason::PendingNotNeeded);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Max workers.

#[test]
fn launches_capped_by_max_workers() {
    // (queued, running, lane max_workers, max_workers_total, launches, held, held limit)
    let rows: &[(usize, usize, u32, u32, u32, u32, u32)] = &[
        (3, 0, 4, 64, 3, 0, 0),
        (4, 0, 4, 64, 4, 0, 0),
        (10, 0, 4, 64, 4, 6, 4),
        (10, 3, 4, 64, 1, 9, 4),
        (10, 4, 4, 64, 0, 10, 4),
        (10, 6, 4, 64, 0, 10, 4), // already above the lane cap
        (10, 0, 32, 5, 5, 5, 5),
        (10, 2, 32, 5, 3, 7, 5),
        (10, 7, 32, 5, 0, 10, 5),
    ];
    for &(queued, n_running, lane_max, total_max, want, held, limit) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].max_workers = lane_max;
        cfg.limits.max_workers_total = total_max;
        let ws: Vec<_> = (0..n_running).map(|i| running(&format!("r{i}"))).collect();
        let plan = World::new(jobs("j", queued), ws).decide(&cfg, NOW);
        let row = format!("queued {queued}, running {n_running}, lane max {lane_max}, total max {total_max}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert_eq!(
            held_count(&plan, |r| matches!(r, Reason::MaxWorkers { .. })),
            held,
            "{row}: {plan:#?}"
        );
        for h in &plan.held {
            assert_eq!(h.reason, Reason::MaxWorkers { limit }, "{row}");
        }
    }
}

#[test]
fn idle_workers_no_held_job_fits_make_room_at_the_cap() {
    // A lane capped at `cap` workers: one running 1-GPU worker, idle 8-GPU workers (idle for
    // the given seconds, launched `age` seconds ago), queued 1-GPU jobs (an 8-GPU worker serves
    // jobs of 5 GPUs or more, `max_gpu_oversize` 1).
    // (cap, idle 8-GPU workers' idle seconds, age, min_runtime_s, queued, expected released)
    type Row = (u32, &'static [f64], f64, f64, usize, &'static [&'static str]);
    let rows: &[Row] = &[
        // At the cap, 3 jobs held: the idle 8-GPU worker goes, 5 s into its keep-alive.
        (2, &[5.0], 3600.0, 0.0, 3, &["big0"]),
        // Two idle and one job held: the longest idle goes, the other keeps its keep-alive.
        (3, &[5.0, 50.0], 3600.0, 0.0, 1, &["big1"]),
        // Two held, two idle: both go.
        (3, &[5.0, 50.0], 3600.0, 0.0, 2, &["big0", "big1"]),
        // Room left under the cap: nothing is held, the keep-alive stands.
        (8, &[5.0], 3600.0, 0.0, 3, &[]),
        // Nothing queued: nothing held.
        (2, &[5.0], 3600.0, 0.0, 0, &[]),
        // Within the minimum run time: kept.
        (2, &[5.0], 100.0, 600.0, 3, &[]),
    ];
    for &(cap, idle_for, age, min_runtime, queued, want) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].max_workers = cap;
        cfg.anti_thrash.min_runtime_s = min_runtime;
        let mut ws = vec![running("r0")];
        for (i, s) in idle_for.iter().enumerate() {
            ws.push(worker(
                &format!("big{i}"),
                10 + i as u64,
                WorkerState::Idle,
                8,
                NOW - age,
                Some(NOW - s),
            ));
        }
        let plan = World::new(jobs("j", queued), ws).decide(&cfg, NOW);
        let row = format!("cap {cap}, idle {idle_for:?}, age {age}, min runtime {min_runtime}, queued {queued}");
        let mut released = terminated(&plan);
        released.sort_unstable();
        assert_eq!(released, want, "{row}: {plan:#?}");
        let held = held_count(&plan, |r| matches!(r, Reason::MaxWorkers { .. }));
        for a in &plan.actions {
            if let Action::Terminate { reason, .. } = a {
                assert_eq!(
                    reason,
                    &Reason::MakeRoom {
                        held_jobs: held,
                        limit: cap
                    },
                    "{row}"
                );
            }
        }
        if !want.is_empty() {
            // The room is made, not taken in the same decision: the cap still holds.
            assert_eq!(plan.launches(), 0, "{row}: {plan:#?}");
        }
    }
}

#[test]
fn a_warm_pool_held_at_the_cap_makes_no_room() {
    // Nothing queued, a scheduled pool of two 1-GPU workers, the lane at its cap of 2 (one
    // running 1-GPU worker, one idle 8-GPU worker): the pool's want is held at the cap, but only
    // jobs make room; the 8-GPU worker keeps its keep-alive (5 s idle).
    let mut cfg = cfg();
    cfg.lanes[0].max_workers = 2;
    cfg.lanes[0].warm_pool = vec![WarmWindow {
        start_hour: 0,
        end_hour: 24,
        size: 2,
    }];
    let ws = vec![
        running("r0"),
        worker("big0", 10, WorkerState::Idle, 8, NOW - 3600.0, Some(NOW - 5.0)),
    ];
    let plan = World::new(vec![], ws).decide(&cfg, NOW);
    assert!(
        held_count(&plan, |r| matches!(r, Reason::MaxWorkers { .. })) > 0,
        "the pool's want is held at the cap: {plan:#?}"
    );
    assert!(terminated(&plan).is_empty(), "{plan:#?}");
}

fn two_lanes(max_a: u32, max_b: u32, total: u32) -> PolicyConfig {
    let mut cfg = cfg();
    cfg.lanes = vec![
        LaneConfig {
            name: "a".into(),
            priority: 0,
            max_workers: max_a,
            ..Default::default()
        },
        LaneConfig {
            name: "b".into(),
            priority: 1,
            max_workers: max_b,
            ..Default::default()
        },
    ];
    cfg.limits.max_workers_total = total;
    cfg
}

#[test]
fn max_workers_total_is_shared_by_lane_priority() {
    // (queued a, queued b, total max, launches a, launches b)
    let rows: &[(usize, usize, u32, u32, u32)] = &[(3, 3, 4, 3, 1), (5, 3, 4, 4, 0), (1, 3, 10, 1, 3)];
    for &(qa, qb, total, la, lb) in rows {
        let cfg = two_lanes(8, 8, total);
        let mut js = jobs("a", qa);
        for mut j in jobs("b", qb) {
            j.lane = 1;
            js.push(j);
        }
        let mut w = World::new(js, vec![]);
        w.lanes = vec![lane(qa as u32, 0), lane(qb as u32, 0)];
        let plan = w.decide(&cfg, NOW);
        let per_lane = |l| {
            plan.actions
                .iter()
                .map(|a| match a {
                    Action::Launch { lane, count, .. } if *lane == l => *count,
                    _ => 0,
                })
                .sum::<u32>()
        };
        assert_eq!(
            (per_lane(0), per_lane(1)),
            (la, lb),
            "{qa}/{qb} total {total}: {plan:#?}"
        );
    }
}

#[test]
fn idle_workers_of_one_lane_make_room_for_jobs_the_fleet_cap_holds_in_another() {
    // Lane a: one running 1-GPU worker and queued 1-GPU jobs; lane b: idle 1-GPU workers (idle
    // for the given seconds, launched `age` seconds ago) and nothing queued. The fleet's cap is
    // every live worker, so lane a's jobs are held at it unless lane a's own cap holds them first.
    // (lane a's cap, fleet cap, lane b's idle seconds, age, min_runtime_s, queued in a,
    //  expected released, of them made room for)
    type Row = (
        u32,
        u32,
        &'static [f64],
        f64,
        f64,
        usize,
        &'static [&'static str],
        usize,
    );
    let rows: &[Row] = &[
        // One job held at the fleet's cap: the longest idle of lane b goes, the other stays.
        (8, 3, &[5.0, 50.0], 3600.0, 0.0, 1, &["b1"], 1),
        // Two held: both go.
        (8, 3, &[5.0, 50.0], 3600.0, 0.0, 2, &["b0", "b1"], 2),
        // Lane a's own cap holds them (1 worker, the running one): lane b's release would not
        // let them launch, so nothing goes.
        (1, 3, &[5.0, 50.0], 3600.0, 0.0, 2, &[], 0),
        // Lane a's cap lets one more launch beyond the fleet's room: one goes for 3 held.
        (2, 3, &[5.0, 50.0], 3600.0, 0.0, 3, &["b1"], 1),
        // Room under the fleet's cap: lane a launches, nothing is released.
        (8, 8, &[5.0, 50.0], 3600.0, 0.0, 2, &[], 0),
        // Nothing queued: nothing held.
        (8, 3, &[5.0, 50.0], 3600.0, 0.0, 0, &[], 0),
        // Within the minimum run time: kept.
        (8, 3, &[5.0, 50.0], 100.0, 600.0, 2, &[], 0),
        // A worker past its keep-alive goes anyway: that room is the held job's, and the other
        // stays.
        (8, 3, &[5.0, 100_000.0], 3600.0, 0.0, 1, &["b1"], 0),
    ];
    for &(cap_a, total, idle_for, age, min_runtime, queued, want, made) in rows {
        let mut cfg = two_lanes(cap_a, 8, total);
        cfg.anti_thrash.min_runtime_s = min_runtime;
        let mut ws = vec![running("r0")];
        for (i, s) in idle_for.iter().enumerate() {
            let mut w = worker(
                &format!("b{i}"),
                10 + i as u64,
                WorkerState::Idle,
                1,
                NOW - age,
                Some(NOW - s),
            );
            w.lane = 1;
            ws.push(w);
        }
        let mut w = World::new(jobs("a", queued), ws);
        w.lanes = vec![lane(queued as u32, 1), lane(0, 0)];
        let plan = w.decide(&cfg, NOW);
        let row =
            format!("caps {cap_a}/{total}, idle {idle_for:?}, age {age}, min runtime {min_runtime}, queued {queued}");
        let mut released = terminated(&plan);
        released.sort_unstable();
        assert_eq!(released, want, "{row}: {plan:#?}");
        let fleet_held = held_count(&plan, |r| matches!(r, Reason::MaxWorkers { limit } if *limit == total));
        let for_lanes: Vec<&Reason> = plan
            .actions
            .iter()
            .map(Action::reason)
            .filter(|r| matches!(r, Reason::MakeRoomForLanes { .. }))
            .collect();
        assert_eq!(for_lanes.len(), made, "{row}: {plan:#?}");
        for r in for_lanes {
            assert_eq!(
                r,
                &Reason::MakeRoomForLanes {
                    held_jobs: (cap_a - 1).min(fleet_held),
                    limit: total
                },
                "{row}"
            );
        }
        if made > 0 {
            // The room is made, not taken in the same decision: the cap still holds.
            assert_eq!(plan.launches(), 0, "{row}: {plan:#?}");
        }
    }
}

#[test]
fn a_full_fleet_holds_every_project_s_jobs_left_with_fair_share_up_to_the_limit() {
    // Three projects of 4 jobs each and room for 5 workers: 2 + 2 + 1 launched by fair share, the
    // other 7 held in one entry for the fleet's limit, whichever project they are of.
    let mut cfg = cfg();
    cfg.limits.max_workers_total = 6;
    let js: Vec<_> = ["a", "b", "c"]
        .iter()
        .flat_map(|p| {
            jobs(p, 4).into_iter().map(move |mut j| {
                j.project = (*p).into();
                j
            })
        })
        .collect();
    let mut w = World::new(js, vec![running("r0")]);
    w.lanes = vec![lane(12, 1)];
    let plan = w.decide(&cfg, NOW);
    assert_eq!(plan.launches(), 5, "{plan:#?}");
    let per_project = |p: &str| {
        plan.actions
            .iter()
            .filter_map(|a| match a {
                Action::Launch { project, count, .. } if project.as_deref() == Some(p) => Some(*count),
                _ => None,
            })
            .sum::<u32>()
    };
    let mut launched = [per_project("a"), per_project("b"), per_project("c")];
    launched.sort_unstable();
    assert_eq!(launched, [1, 2, 2], "{plan:#?}");
    assert_eq!(plan.held.len(), 1, "{plan:#?}");
    assert_eq!(
        (plan.held[0].count, &plan.held[0].reason),
        (7, &Reason::MaxWorkers { limit: 6 })
    );
}

#[test]
fn a_fleet_full_before_any_job_holds_each_job_for_what_binds_first() {
    // Three running workers fill the lane or the fleet; projects a and b queue 3 jobs each (a's of
    // job type "render"). A quota or a cap binds a's jobs before the limit does; the rest are held
    // for the limit that bound, the lane's or the fleet's.
    type Row = (u32, u32, Option<u32>, Option<u32>, Vec<(Reason, u32)>);
    let max = |limit| Reason::MaxWorkers { limit };
    let quota = Reason::ProjectQuota {
        project: "a".into(),
        max_gpus: 0,
    };
    let cap = Reason::JobTypeCap {
        job_type: "render".into(),
        cap: 0,
    };
    // (lane max_workers, fleet max_workers_total, a's max_gpus, render cap, held)
    let rows: Vec<Row> = vec![
        (8, 3, None, None, vec![(max(3), 6)]),
        (2, 9, None, None, vec![(max(2), 6)]),
        (3, 3, None, None, vec![(max(3), 6)]),
        (8, 3, Some(0), None, vec![(max(3), 3), (quota.clone(), 3)]),
        (8, 3, Some(5), None, vec![(max(3), 6)]),
        (8, 3, None, Some(0), vec![(cap.clone(), 3), (max(3), 3)]),
        (2, 9, Some(0), Some(0), vec![(max(2), 3), (quota.clone(), 3)]),
    ];
    for (lane_max, total, a_max_gpus, render_cap, want) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].max_workers = lane_max;
        cfg.limits.max_workers_total = total;
        if let Some(m) = a_max_gpus {
            let q = ProjectQuota {
                max_gpus: Some(m),
                ..ProjectQuota::default()
            };
            cfg.limits.projects.insert("a".into(), q);
        }
        if let Some(c) = render_cap {
            cfg.limits.job_type_caps.insert("render".into(), c);
        }
        let js: Vec<_> = ["a", "b"]
            .iter()
            .flat_map(|p| {
                jobs(p, 3).into_iter().map(move |mut j| {
                    j.project = (*p).into();
                    j.job_type = (*p == "a").then(|| "render".into());
                    j
                })
            })
            .collect();
        let w = World::new(js, (0..3).map(|i| running(&format!("r{i}"))).collect());
        let plan = w.decide(&cfg, NOW);
        let row = format!("lane max {lane_max}, total {total}, a's quota {a_max_gpus:?}, cap {render_cap:?}");
        assert_eq!(plan.launches(), 0, "{row}: {plan:#?}");
        let held: Vec<(Reason, u32)> = plan.held.iter().map(|h| (h.reason.clone(), h.count)).collect();
        assert_eq!(held, want, "{row}");
    }
}

#[test]
fn max_workers_held_reason_names_the_limit_that_bound() {
    // Lane a holds 8 of the 10 workers the fleet may have; lane b (max 8) gets 5 jobs: 2 launched, 3
    // held, all by the fleet total (10), not by lane b's own maximum (8).
    let cfg = two_lanes(8, 8, 10);
    let mut ws: Vec<_> = (0..8).map(|i| running(&format!("r{i}"))).collect();
    ws.iter_mut().for_each(|w| w.lane = 0);
    let js: Vec<_> = jobs("b", 5)
        .into_iter()
        .map(|mut j| {
            j.lane = 1;
            j
        })
        .collect();
    let mut w = World::new(js, ws);
    w.lanes = vec![lane(0, 8), lane(5, 0)];
    let plan = w.decide(&cfg, NOW);
    assert_eq!(plan.launches(), 2);
    assert_eq!(held_count(&plan, |r| matches!(r, Reason::MaxWorkers { .. })), 3);
    for h in &plan.held {
        assert_eq!(h.reason, Reason::MaxWorkers { limit: 10 }, "{plan:#?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Project quotas and weighted fair share.

#[test]
fn weighted_fair_share_between_projects() {
    // (weight a, weight b, lane max_workers, running for a, running for b, launched (a, b))
    type Row = (f64, f64, u32, usize, usize, (u32, u32));
    let rows: &[Row] = &[
        (1.0, 3.0, 4, 0, 0, (1, 3)),
        (1.0, 1.0, 4, 0, 0, (2, 2)),
        (1.0, 3.0, 8, 0, 0, (2, 6)),
        (1.0, 1.0, 5, 0, 0, (3, 2)),
        (3.0, 1.0, 4, 0, 0, (3, 1)),
        (2.0, 1.0, 6, 0, 0, (4, 2)),
        (1.0, 1.0, 4, 2, 0, (0, 2)),
        (1.0, 3.0, 6, 0, 2, (2, 2)),
    ];
    for &(wa, wb, lane_max, ra, rb, (la, lb)) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].max_workers = lane_max;
        cfg.limits.projects.insert(
            "a".into(),
            ProjectQuota {
                max_gpus: None,
                weight: wa,
            },
        );
        cfg.limits.projects.insert(
            "b".into(),
            ProjectQuota {
                max_gpus: None,
                weight: wb,
            },
        );
        let mut js = Vec::new();
        for (p, n) in [("a", 10), ("b", 10)] {
            for mut j in jobs(p, n) {
                j.project = p.into();
                js.push(j);
            }
        }
        let mut ws = Vec::new();
        for i in 0..ra {
            ws.push(with_project(running(&format!("ra{i}")), "a"));
        }
        for i in 0..rb {
            ws.push(with_project(running(&format!("rb{i}")), "b"));
        }
        let plan = World::new(js, ws).decide(&cfg, NOW);
        let row = format!("weights {wa}/{wb}, room {lane_max} - {ra} - {rb}");
        assert_eq!(
            (launched_for(&plan, "a"), launched_for(&plan, "b")),
            (la, lb),
            "{row}: {plan:#?}"
        );
    }
}

#[test]
fn project_quota_caps_gpus() {
    // (max_gpus of a, running 1-GPU workers for a, GPUs per queued job, queued jobs of a,
    //  launched for a, held ProjectQuota)
    let rows: &[(u32, usize, u32, usize, u32, u32)] = &[
        (2, 0, 1, 5, 2, 3),
        (2, 1, 1, 5, 1, 4),
        (2, 2, 1, 5, 0, 5),
        (2, 3, 1, 5, 0, 5),
        (6, 0, 4, 2, 1, 1),
        (8, 0, 4, 2, 2, 0),
        (8, 1, 4, 2, 1, 1),
        (0, 0, 1, 1, 0, 1),
    ];
    for &(max, ra, gpus, queued, la, held) in rows {
        let mut cfg = cfg();
        cfg.limits.projects.insert(
            "a".into(),
            ProjectQuota {
                max_gpus: Some(max),
                weight: 1.0,
            },
        );
        let mut js: Vec<_> = (0..queued).map(|i| job(&format!("a{i}"), gpus, NOW - 60.0)).collect();
        js.iter_mut().for_each(|j| j.project = "a".into());
        // Project b has no quota and is not affected.
        for mut j in jobs("b", 2) {
            j.project = "b".into();
            js.push(j);
        }
        let ws: Vec<_> = (0..ra).map(|i| with_project(running(&format!("r{i}")), "a")).collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        let row = format!("max {max}, running {ra}, {queued} x {gpus}-GPU jobs");
        assert_eq!(launched_for(&plan, "a"), la, "{row}: {plan:#?}");
        assert_eq!(launched_for(&plan, "b"), 2, "{row}");
        assert_eq!(
            held_count(&plan, |r| r
                == &Reason::ProjectQuota {
                    project: "a".into(),
                    max_gpus: max
                }),
            held,
            "{row}: {plan:#?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Job type caps.

#[test]
fn job_type_cap_limits_concurrent_jobs_of_a_type() {
    // (cap, running of type, queued of type, queued untyped, launches, held JobTypeCap)
    let rows: &[(u32, usize, usize, usize, u32, u32)] = &[
        (2, 0, 1, 0, 1, 0),
        (2, 1, 5, 2, 3, 4),
        (2, 2, 5, 0, 0, 5),
        (0, 0, 3, 3, 3, 3),
        (5, 0, 3, 0, 3, 0),
        (5, 3, 3, 1, 3, 1),
    ];
    for &(cap, n_running, queued_t, queued_u, want, held) in rows {
        let mut cfg = cfg();
        cfg.limits.job_type_caps.insert("train".into(), cap);
        let mut js = jobs("t", queued_t);
        js.iter_mut().for_each(|j| j.job_type = Some("train".into()));
        js.extend(jobs("u", queued_u));
        let ws: Vec<_> = (0..n_running)
            .map(|i| {
                let mut w = running(&format!("r{i}"));
                w.job_type = Some("train".into());
                w
            })
            .collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        let row = format!("cap {cap}, running {n_running}, queued {queued_t} typed + {queued_u}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert_eq!(
            held_count(&plan, |r| r
                == &Reason::JobTypeCap {
                    job_type: "train".into(),
                    cap
                }),
            held,
            "{row}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Budget breaker and freeze.

#[test]
fn budget_breaker_and_cap() {
    // Workers: `n_p4d` running p4d spot workers ($10/h each), an idle 1-GPU worker launched 2 h ago
    // ("old") and one launched 30 s ago ("young", within min_runtime_s); queued 4-GPU jobs ($1.60/h
    // each), which the idle 1-GPU workers cannot take.
    // (label, n_p4d, cap, queued, launches, held BudgetBreaker, terminated)
    type Row = (
        &'static str,
        usize,
        Option<f64>,
        usize,
        u32,
        u32,
        &'static [&'static str],
    );
    let rows: &[Row] = &[
        ("tripped", 1, Some(5.0), 2, 0, 2, &["old"]),
        ("tripped, no queue", 1, Some(5.0), 0, 0, 0, &["old"]),
        ("room for one", 1, Some(12.0), 2, 1, 1, &[]),
        ("room for two", 1, Some(20.0), 2, 2, 0, &[]),
        ("no room", 1, Some(11.0), 2, 0, 2, &[]),
        ("no cap", 2, None, 3, 3, 0, &[]),
    ];
    for &(label, n_p4d, cap, queued, want, held, term) in rows {
        let mut cfg = cfg();
        cfg.limits.max_usd_per_h = cap;
        let mut ws: Vec<_> = (0..n_p4d)
            .map(|i| {
                worker(
                    &format!("p4d{i}"),
                    i as u64,
                    WorkerState::Running,
                    8,
                    NOW - 3600.0,
                    None,
                )
            })
            .collect();
        ws.push(worker("old", 10, WorkerState::Idle, 1, NOW - 7200.0, Some(NOW - 10.0)));
        ws.push(worker("young", 11, WorkerState::Idle, 1, NOW - 30.0, Some(NOW - 5.0)));
        let js: Vec<_> = (0..queued).map(|i| job(&format!("j{i}"), 4, NOW - 60.0)).collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        assert_eq!(plan.launches(), want, "{label}: {plan:#?}");
        assert_eq!(
            held_count(&plan, |r| matches!(r, Reason::BudgetBreaker { .. })),
            held,
            "{label}: {plan:#?}"
        );
        assert_eq!(terminated(&plan), term.to_vec(), "{label}: {plan:#?}");
        for a in &plan.actions {
            if let Action::Terminate { reason, .. } = a {
                assert!(
                    matches!(reason, Reason::BudgetBreaker { cap_usd_per_h, spend_usd_per_h }
                        if Some(*cap_usd_per_h) == cap && (*spend_usd_per_h - (10.0 * n_p4d as f64 + 0.2)).abs() < 1e-9),
                    "{label}: {reason:?}"
                );
            }
        }
    }
}

#[test]
fn warm_pool_launches_respect_the_budget_cap() {
    let mut cfg = cfg();
    cfg.limits.max_usd_per_h = Some(1.05);
    cfg.lanes[0].warm_pool = vec![WarmWindow {
        start_hour: 0,
        end_hour: 24,
        size: 2,
    }];
    // 9 running 1-GPU workers at $0.10/h: $0.90/h, room for one more $0.10 worker.
    let ws: Vec<_> = (0..9).map(|i| running(&format!("r{i}"))).collect();
    let plan = World::new(vec![], ws).decide(&cfg, NOW);
    let launched_usd: f64 = launch_list(&plan).iter().map(|l| 0.10 * l.1 as f64).sum();
    assert!(
        0.90 + launched_usd <= 1.05 + 1e-9,
        "spend after the plan {}: {plan:#?}",
        0.90 + launched_usd
    );
}

#[test]
fn diversified_launches_respect_the_budget_cap() {
    // Two 1-GPU spot offerings 5 % apart: the spread uses both. Booked 2 x $1.00, launched $1.00 + $1.05.
    use CapacityType::Spot;
    let mut cfg = cfg();
    cfg.limits.max_usd_per_h = Some(2.02);
    let mut w = World::new(jobs("j", 2), vec![]);
    w.offerings = vec![
        offering("a.xlarge", Spot, 1, "NVIDIA A10G", 24.0, 1.00),
        offering("b.xlarge", Spot, 1, "NVIDIA A10G", 24.0, 1.05),
    ];
    let plan = w.decide(&cfg, NOW);
    let price = |k: &onoff_policy::OfferingKey| w.offerings.iter().find(|o| &o.key == k).unwrap().price_usd_per_h;
    let spend: f64 = launch_list(&plan).iter().map(|l| price(l.0) * l.1 as f64).sum();
    assert!(spend <= 2.02 + 1e-9, "launched {spend} $/h: {plan:#?}");
}

#[test]
fn frozen_launches_nothing() {
    // (frozen, queued, warm pool size, launches, held Frozen)
    let rows: &[(bool, usize, u32, u32, u32)] = &[
        (true, 3, 0, 0, 3),
        (true, 0, 2, 0, 0),
        (true, 3, 2, 0, 3),
        (false, 3, 0, 3, 0),
        (false, 0, 2, 2, 0),
    ];
    for &(frozen, queued, warm, want, held) in rows {
        let mut cfg = cfg();
        cfg.limits.frozen = frozen;
        cfg.lanes[0].warm_pool = vec![WarmWindow {
            start_hour: 0,
            end_hour: 24,
            size: warm,
        }];
        let plan = World::new(jobs("j", queued), vec![]).decide(&cfg, NOW);
        let row = format!("frozen {frozen}, queued {queued}, warm {warm}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert_eq!(held_count(&plan, |r| r == &Reason::Frozen), held, "{row}");
    }
}

// ---------------------------------------------------------------------------------------------
// Fallback after a capacity error.

#[test]
fn spot_only_while_on_demand_costs_more_than_the_wait_is_worth() {
    use CapacityType::{OnDemand, Spot};
    // g5.xlarge: $0.10/h spot, $0.50/h on-demand. For an hour's job on-demand costs about $0.44
    // more; the wait is worth wait_value x (waited + 180 s TTL) / 3600.
    // (run time s, waited s, wait value $/h, spot unavailable, expected: launch capacity type and
    // requested capacity, or None when held waiting for spot)
    type Row = (f64, f64, f64, bool, Option<(CapacityType, CapacityPreference)>);
    let rows: &[Row] = &[
        (3600.0, 60.0, 1.0, true, None), // waits for spot
        (
            3600.0,
            1800.0,
            1.0,
            true,
            Some((OnDemand, CapacityPreference::SpotFirst)),
        ), // waited enough
        (
            3600.0,
            60.0,
            10.0,
            true,
            Some((OnDemand, CapacityPreference::SpotFirst)),
        ), // a dear wait
        (60.0, 60.0, 1.0, true, Some((OnDemand, CapacityPreference::SpotFirst))), // a short job
        // Spot available: a long job launches on spot and may not fall back to on-demand.
        (3600.0, 60.0, 1.0, false, Some((Spot, CapacityPreference::SpotOnly))),
        (60.0, 60.0, 1.0, false, Some((Spot, CapacityPreference::SpotFirst))),
    ];
    for &(runtime, waited, wait_value, spot_down, want) in rows {
        let mut j = job("j", 1, NOW - waited);
        j.est_runtime_s = Some(runtime);
        let mut w = World::new(vec![j], vec![]);
        if spot_down {
            w.unavailable = [G5, G6]
                .iter()
                .map(|t| UnavailableOffering {
                    key: key(t, Spot),
                    until: NOW + 100.0,
                })
                .collect();
        }
        let mut c = cfg();
        c.scale_down.wait_value_usd_per_h = wait_value;
        let plan = w.decide(&c, NOW);
        let row = format!("run time {runtime}, waited {waited}, wait value {wait_value}, spot down {spot_down}");
        let got: Vec<_> = plan
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Launch { offering, request, .. } => Some((offering.capacity_type, request.capacity)),
                _ => None,
            })
            .collect();
        match want {
            Some(w) => assert_eq!(got, vec![w], "{row}: {plan:#?}"),
            None => {
                assert!(got.is_empty(), "{row}: {plan:#?}");
                assert_eq!(
                    held_count(
                        &plan,
                        |r| matches!(r, Reason::WaitingForSpot { on_demand_premium_usd, .. }
                        if (0.4..0.5).contains(on_demand_premium_usd))
                    ),
                    1,
                    "{row}: {plan:#?}"
                );
            }
        }
    }
}

#[test]
fn a_fallback_dearer_than_the_wait_is_worth_waits_for_capacity() {
    use CapacityType::{OnDemand, Spot};
    // With g5.xlarge spot out of capacity, the next best is g6.xlarge spot (30 % dearer). For a
    // ten-hour job that difference is worth more than a minute's wait at 1 $/h, so the job waits
    // for g5 until it has waited long enough (the premium at the wait value, less the TTL); a
    // one-minute job, or a deadline at risk, takes g6 at once.
    let c = cfg();
    let oc = &c.offers;
    let cost = |ty: &str, runtime: f64| {
        let o = offerings().into_iter().find(|o| o.key == key(ty, Spot)).unwrap();
        choice::expected_cost_per_job(&o, runtime, 1, oc)
    };
    let long = 36_000.0;
    let premium = cost(G6, long) - cost(G5, long);
    let worth_after = |waited: f64| c.scale_down.wait_value_usd_per_h * (waited + oc.unavailable_ttl_s) / 3600.0;
    let enough = premium * 3600.0 / c.scale_down.wait_value_usd_per_h - oc.unavailable_ttl_s + 1.0;
    assert!(
        premium > worth_after(60.0) && premium <= worth_after(enough),
        "premium {premium}"
    );
    // (run time s, waited s, deadline from now, expected: launched type, capacity and cost ceiling,
    // or None when held waiting for capacity)
    type Row = (f64, f64, Option<f64>, Option<(&'static str, CapacityType, Option<f64>)>);
    let rows: &[Row] = &[
        (long, 60.0, None, None),
        (
            long,
            enough,
            None,
            Some((G6, Spot, Some(cost(G5, long) + worth_after(enough)))),
        ),
        (
            60.0,
            60.0,
            None,
            Some((G6, Spot, Some(cost(G5, 60.0) + worth_after(60.0)))),
        ),
        // Its slack no longer covers an interruption: on-demand, whatever it costs.
        (long, 60.0, Some(long + 600.0), Some((G5, OnDemand, None))),
    ];
    for &(runtime, waited, deadline, want) in rows {
        let mut j = job("j", 1, NOW - waited);
        j.est_runtime_s = Some(runtime);
        j.deadline = deadline.map(|d| NOW + d);
        let mut w = World::new(vec![j], vec![]);
        w.unavailable = vec![UnavailableOffering {
            key: key(G5, Spot),
            until: NOW + 100.0,
        }];
        let plan = w.decide(&c, NOW);
        let row = format!("run time {runtime}, waited {waited}, deadline {deadline:?}");
        let got: Vec<_> = plan
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Launch { offering, request, .. } => Some((
                    offering.instance_type.as_str(),
                    offering.capacity_type,
                    request.max_cost_usd,
                )),
                _ => None,
            })
            .collect();
        match want {
            Some((ty, cap, ceiling)) => {
                assert_eq!(got.len(), 1, "{row}: {plan:#?}");
                assert_eq!((got[0].0, got[0].1), (ty, cap), "{row}");
                match (got[0].2, ceiling) {
                    (Some(a), Some(b)) => assert!((a - b).abs() < 1e-9, "{row}: ceiling {a} against {b}"),
                    (a, b) => assert_eq!(a, b, "{row}"),
                }
            }
            None => {
                assert!(got.is_empty(), "{row}: {plan:#?}");
                assert_eq!(
                    held_count(&plan, |r| matches!(r, Reason::WaitingForCapacity { premium_usd, .. }
                        if (premium_usd - premium).abs() < 1e-9)),
                    1,
                    "{row}: {plan:#?}"
                );
            }
        }
    }
}

#[test]
fn unavailable_offerings_fall_back_to_the_next_best() {
    use CapacityType::{OnDemand, Spot};
    // A one-minute job: on-demand's premium is below what its wait is worth, so it may fall back
    // to on-demand (see spot_only_while_on_demand_costs_more_than_the_wait_is_worth), but not to
    // g6.xlarge on-demand, 6.5 times g5 spot's price, which costs it more than its wait is worth
    // (see a_fallback_dearer_than_the_wait_is_worth_waits_for_capacity).
    // (unavailable (type, capacity, until - now), expected offering, or None with the reason held)
    type Row = (
        Vec<(&'static str, CapacityType, f64)>,
        Result<(&'static str, CapacityType), &'static str>,
    );
    let rows: Vec<Row> = vec![
        (vec![], Ok((G5, Spot))),
        (vec![(G5, Spot, 100.0)], Ok((G6, Spot))),
        (vec![(G5, Spot, 180.0)], Ok((G6, Spot))),
        (vec![(G5, Spot, -1.0)], Ok((G5, Spot))), // expired: used again
        (vec![(G5, Spot, 0.0)], Ok((G5, Spot))),  // `until` is exclusive
        (vec![(G5, OnDemand, 100.0)], Ok((G5, Spot))),
        (vec![(G5, Spot, 100.0), (G6, Spot, 100.0)], Ok((G5, OnDemand))),
        (
            vec![(G5, Spot, 100.0), (G6, Spot, 100.0), (G5, OnDemand, 100.0)],
            Err("waiting for capacity"),
        ),
        (
            vec![
                (G5, Spot, 100.0),
                (G6, Spot, 100.0),
                (G5, OnDemand, 100.0),
                (G6, OnDemand, 100.0),
            ],
            Err("no offering"),
        ),
    ];
    for (unavail, want) in rows {
        let mut short = jobs("j", 1);
        short[0].est_runtime_s = Some(60.0);
        let mut w = World::new(short, vec![]);
        w.unavailable = unavail
            .iter()
            .map(|&(t, c, d)| UnavailableOffering {
                key: key(t, c),
                until: NOW + d,
            })
            .collect();
        let plan = w.decide(&cfg(), NOW);
        let got: Vec<_> = launch_list(&plan).iter().map(|l| (l.0.clone(), l.1)).collect();
        match want {
            Ok((t, c)) => assert_eq!(got, vec![(key(t, c), 1)], "{unavail:?}"),
            Err(why) => {
                assert!(got.is_empty(), "{unavail:?}");
                let held = |r: &Reason| match r {
                    Reason::NoOffering { gpus: 1, .. } => why == "no offering",
                    Reason::WaitingForCapacity { .. } => why == "waiting for capacity",
                    _ => false,
                };
                assert_eq!(held_count(&plan, held), 1, "{unavail:?}: {plan:#?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cooldown with decay.

#[test]
fn cooldown_decay_steps_at_10_and_30_minutes() {
    // in_first_release(seq, 0.5) for seq 0..3 is false, true, false, true: seqs 1 and 3 go first.
    let first: Vec<u64> = (0..4).filter(|&s| keepalive::in_first_release(s, 0.5)).collect();
    assert_eq!(first, vec![1, 3]);

    // (idle for s, expected released seqs, step)
    let rows: &[(f64, &[u64], f64)] = &[
        (60.0, &[], 0.0),
        (540.0, &[], 0.0),
        (599.0, &[], 0.0),
        (660.0, &[1, 3], 600.0),
        (1500.0, &[1, 3], 600.0),
        (1860.0, &[0, 1, 2, 3], 1800.0),
    ];
    let mut cfg = cfg();
    cfg.scale_down.mode = KeepAliveMode::CooldownDecay;
    assert_eq!(
        (
            cfg.scale_down.warm_for_s,
            cfg.scale_down.release_rest_at_s,
            cfg.scale_down.release_fraction
        ),
        (600.0, 1800.0, 0.5)
    );
    for &(idle_for, want, step) in rows {
        let ws: Vec<_> = (0..4).map(|s| idle(&format!("w{s}"), s, idle_for)).collect();
        let plan = World::new(vec![], ws).decide(&cfg, NOW);
        let mut got: Vec<String> = terminated(&plan).iter().map(|s| s.to_string()).collect();
        got.sort();
        let want_ids: Vec<String> = want.iter().map(|s| format!("w{s}")).collect();
        assert_eq!(got, want_ids, "idle {idle_for}: {plan:#?}");
        for a in &plan.actions {
            if let Action::Terminate { reason, .. } = a {
                assert_eq!(
                    reason,
                    &Reason::DecayStep {
                        idle_s: idle_for,
                        step_s: step
                    }
                );
            }
        }
    }
}

#[test]
fn in_first_release_is_about_the_fraction() {
    // (fraction, expected share of seq 0..1000 within 0.02)
    for fraction in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let n = (0..1000u64)
            .filter(|&s| keepalive::in_first_release(s, fraction))
            .count();
        assert!((n as f64 / 1000.0 - fraction).abs() <= 0.02, "{fraction}: {n}");
    }
}

// ---------------------------------------------------------------------------------------------
// Adaptive keep-alive.

#[test]
fn break_even_is_boot_times_one_plus_wait_value_over_price() {
    // (boot s, price $/h, wait value $/h, expected s)
    let rows: &[(f64, f64, f64, f64)] = &[
        (390.0, 0.10, 1.0, 4290.0),
        (390.0, 0.50, 1.0, 1170.0),
        (390.0, 1.00, 1.0, 780.0),
        (390.0, 2.00, 0.0, 390.0),
        (390.0, 0.10, 2.0, 8190.0),
        (600.0, 4.00, 1.0, 750.0),
    ];
    for &(boot, price, wait, want) in rows {
        let sd = ScaleDownConfig {
            wait_value_usd_per_h: wait,
            ..Default::default()
        };
        let got = keepalive::break_even_s(boot, price, &sd);
        assert!((got - want).abs() < 1e-6, "{boot} {price} {wait}: {got}");
        assert!((got - boot * (1.0 + wait / price)).abs() < 1e-9);
    }
    assert_eq!(ScaleDownConfig::default().wait_value_usd_per_h, 1.0);
}

#[test]
fn adaptive_keep_alive_without_gaps_is_clamped_break_even() {
    let sd = ScaleDownConfig::default();
    // (price, expected keep-alive)
    for (price, want) in [(0.10, 3600.0), (1.0, 780.0), (100.0, 393.9), (1e6, 390.0004)] {
        let got = keepalive::keep_alive_s(None, 1.0, 390.0, price, &sd);
        assert!((got - want).abs() < 0.01, "{price}: {got}");
    }
    // In `decide`: a $0.10/h worker is kept 3600 s (break-even 4290 s clamped to max_keep_alive_s).
    // (idle for, released)
    for (idle_for, want) in [(3000.0, false), (3599.0, false), (3601.0, true)] {
        let plan = World::new(vec![], vec![idle("w", 0, idle_for)]).decide(&cfg(), NOW);
        assert_eq!(terminated(&plan) == vec!["w"], want, "idle {idle_for}: {plan:#?}");
    }
}

#[test]
fn adaptive_keep_alive_follows_the_gaps() {
    // Gaps of 120 s (bucket (108.4, 135.5]): the worker next in line is kept to the bucket's upper
    // edge, where every gap has ended; longer costs idle time for nothing, shorter a cold start.
    // (recorded gaps, GPU shape the gaps were recorded for, idle for, released)
    let rows: &[(usize, u32, f64, bool)] = &[
        (20, 1, 200.0, true),
        (20, 1, 100.0, false),
        (50, 1, 200.0, true),
        (50, 1, 130.0, false),
        (19, 1, 200.0, false), // below min_gap_samples: break-even (clamped 3600 s) alone
        (20, 4, 200.0, false), // gaps of a shape the worker cannot serve do not count
    ];
    for &(n_gaps, shape, idle_for, want) in rows {
        let mut lo = LaneObservation::default();
        for k in 0..=n_gaps {
            lo.record_arrival(shape, NOW - 20_000.0 + 120.0 * k as f64);
        }
        let hist = lo.gaps.get(&shape).map(|g| &g.hist).unwrap();
        assert_eq!(hist.samples(), n_gaps as u64);
        let top = hist.quantile(1.0).unwrap();
        assert!((120.0..=1.25 * 120.0).contains(&top), "top bucket edge {top}");
        let gaps = lo.gaps_for(1, 1).map(|s| &s.hist);
        let ka = keepalive::keep_alive_s(gaps, 1.0, 390.0, 0.10, &ScaleDownConfig::default());
        if shape == 1 && n_gaps >= 20 {
            assert!((ka - top).abs() < 1e-9 && ka <= 150.0, "keep-alive {ka}");
        } else {
            assert_eq!(ka, 3600.0);
        }

        let mut w = World::new(vec![], vec![idle("w", 0, idle_for)]);
        w.lanes = vec![lo];
        let plan = w.decide(&cfg(), NOW);
        let row = format!("{n_gaps} gaps of shape {shape}, idle {idle_for}");
        assert_eq!(terminated(&plan) == vec!["w"], want, "{row}: {plan:#?}");
        for a in &plan.actions {
            if let Action::Terminate { reason, .. } = a {
                assert!(
                    matches!(reason, Reason::KeepAliveExpired { keep_alive_s, .. } if *keep_alive_s <= 150.0),
                    "{row}: {reason:?}"
                );
            }
        }
    }
}

#[test]
fn cost_optimal_timeout_weighs_idle_time_against_a_cold_start() {
    // Gaps: 90 % at about 10 s, 10 % at about 1000 s.
    let mut h = onoff_policy::GapHistogram::default();
    for k in 0..100 {
        h.record(if k % 10 == 9 { 1000.0 } else { 10.0 }, NOW);
    }
    // (scale, break-even s, expected timeout in s)
    let edge = |g: f64| {
        let i = (g.ln() / 1.25f64.ln()).ceil() as i32;
        1.25f64.powi(i)
    };
    let rows: &[(f64, f64, f64)] = &[
        // A cheap cold start: wait out the short gaps, not the long ones.
        (1.0, 100.0, edge(10.0).max(60.0)),
        // A dear cold start: wait out the long gaps too.
        (1.0, 100_000.0, edge(1000.0)),
        // A cold start worth 2000 idle seconds: the first worker in line waits out the long gaps
        // too, the third one (gaps three times as long, 30 s and 3000 s) only the short ones.
        (1.0, 2_000.0, edge(1000.0)),
        (3.0, 2_000.0, 60.0),
    ];
    for &(scale, be, want) in rows {
        let got = keepalive::cost_optimal_timeout_s(&h, scale, be, 60.0, 3600.0);
        assert!(
            (got - want).abs() < 1e-6,
            "scale {scale}, break-even {be}: {got} != {want}"
        );
    }
    // Workers further back in line are needed later, so with arrivals every 120 s the second
    // idle worker is kept to about twice the first one's keep-alive.
    let first = keepalive::arrivals_until_needed(0, 1.0);
    let second = keepalive::arrivals_until_needed(1, 1.0);
    assert_eq!((first, second), (1.0, 2.0));
    // Short jobs: a worker behind one that serves items of a hundredth of the horizon is needed
    // after a hundred of them.
    assert_eq!(keepalive::arrivals_until_needed(1, 0.01), 101.0);
}

#[test]
fn idle_workers_in_line_go_from_the_back() {
    // Arrivals every 120 s, the last one 300 s ago; three idle workers. The most recently idle is
    // first in line (kept to 135.5 s), the second to 271 s (gaps x 2), the third to 406 s.
    // (idle for of w0 (most recent), w1, w2; released)
    let rows: &[([f64; 3], &[&str])] = &[
        ([100.0, 200.0, 300.0], &[]),
        ([140.0, 200.0, 300.0], &["w0", "w1", "w2"]), // the front went: the back goes with it
        ([100.0, 280.0, 300.0], &["w1", "w2"]),
        ([100.0, 200.0, 410.0], &["w2"]),
    ];
    for (idle_for, want) in rows {
        let mut lo = LaneObservation::default();
        for k in 0..=40 {
            lo.record_arrival(1, NOW - 300.0 - 120.0 * (40 - k) as f64);
        }
        let ws = (0..3).map(|i| idle(&format!("w{i}"), i as u64, idle_for[i])).collect();
        let mut w = World::new(vec![], ws);
        w.lanes = vec![lo];
        let mut c = cfg();
        c.lanes[0].predictive_max = 0;
        let plan = w.decide(&c, NOW);
        let mut got = terminated(&plan);
        got.sort();
        assert_eq!(got, *want, "idle {idle_for:?}: {plan:#?}");
    }
}

#[test]
fn workers_freeing_up_ahead_in_line_shorten_the_keep_alive() {
    // Arrivals every 120 s; one idle 1-GPU worker ($0.10/h: a cold start is worth 4290 idle
    // seconds), idle for 100 s: first in line, it is kept to 135.5 s. Running workers whose jobs
    // end soon become idle ahead of it and take the next arrivals: behind 40 of them it is needed
    // only after 41 arrivals, about 5,100 s, past the break-even, so it goes at the minimum
    // keep-alive (60 s).
    // (running workers, their GPUs, their jobs end in s, released)
    let rows: &[(usize, u32, f64, bool)] = &[
        (0, 1, 30.0, false),
        (10, 1, 30.0, false), // needed after 11 arrivals (about 1,400 s): still worth holding
        (40, 1, 30.0, true),
        (40, 1, 20_000.0, false), // their jobs end long after it is needed
        (40, 1, -30.0, false),    // past their declared run time: when they end is unknown
        (40, 4, 30.0, false),     // another size: they free no worker of its line
    ];
    for &(n_running, gpus, ends_in, want) in rows {
        let mut lo = LaneObservation::default();
        for k in 0..=40 {
            lo.record_arrival(1, NOW - 300.0 - 120.0 * (40 - k) as f64);
        }
        let mut ws = vec![idle("w", 0, 100.0)];
        ws.extend((0..n_running).map(|i| {
            let mut r = worker(
                &format!("r{i}"),
                1 + i as u64,
                WorkerState::Running,
                gpus,
                NOW - 3600.0,
                None,
            );
            r.busy_until = Some(NOW + ends_in);
            r
        }));
        let mut w = World::new(vec![], ws);
        w.lanes = vec![lo];
        let mut c = cfg();
        c.lanes[0].predictive_max = 0;
        let plan = w.decide(&c, NOW);
        let row = format!("{n_running} running {gpus}-GPU workers ending in {ends_in} s");
        assert_eq!(terminated(&plan) == vec!["w"], want, "{row}: {plan:#?}");
    }
}

#[test]
fn arrivals_until_needed_counts_the_workers_freed_meanwhile() {
    // (rank, worker units per arrival, mean gap s, ends s from now, cap, expected arrivals)
    type Row<'a> = (u32, f64, f64, &'a [f64], f64, f64);
    let ends_every_50: Vec<f64> = (1..=40).map(|k| 50.0 * k as f64).collect();
    let rows: &[Row] = &[
        (0, 1.0, 100.0, &[], 1e6, 1.0),              // nothing ends: the next arrival
        (2, 1.0, 100.0, &[], 1e6, 3.0),              // as arrivals_until_needed
        (0, 1.0, 100.0, &[50.0], 1e6, 2.0),          // one ends before the next arrival
        (0, 1.0, 100.0, &[150.0], 1e6, 1.0),         // ends after the next arrival took it
        (1, 1.0, 100.0, &[150.0], 1e6, 3.0),         // ...but before the second worker's
        (1, 0.5, 100.0, &[50.0], 1e6, 5.0),          // short jobs: two arrivals per worker
        (0, 1.0, 100.0, &ends_every_50, 1e6, 41.0),  // twice as fast as arrivals: all 40 go first
        (0, 1.0, 100.0, &ends_every_50, 20.0, 20.0), // capped
    ];
    for (rank, units, gap, ends, cap, want) in rows {
        let got = keepalive::arrivals_until_needed_after_ends(*rank, *units, *gap, ends, *cap);
        assert_eq!(
            got,
            *want,
            "rank {rank}, units {units}, gap {gap}, {} ends, cap {cap}",
            ends.len()
        );
    }
    assert_eq!(
        keepalive::arrivals_until_needed_after_ends(3, 0.25, 60.0, &[], 1e6),
        keepalive::arrivals_until_needed(3, 0.25)
    );
}

#[test]
fn a_worker_needed_only_after_many_arrivals_goes_once_their_sum_passes_the_break_even() {
    // Gaps: 90 % at about 10 s, 10 % at about 1000 s (mean about 100 s). A cold start worth
    // 2000 idle seconds.
    let mut h = onoff_policy::GapHistogram::default();
    for k in 0..100 {
        h.record(if k % 10 == 9 { 1000.0 } else { 10.0 }, NOW);
    }
    let curve = keepalive::GapCurve::new(&h);
    let mean = curve.mean_s();
    assert!((90.0..110.0).contains(&mean), "mean gap {mean}");
    let sd = ScaleDownConfig::default();
    // price such that break_even_s = 2000: 390 x (1 + 1 / p) = 2000
    let price = 1.0 / (2000.0 / 390.0 - 1.0);
    let be = keepalive::break_even_s(390.0, price, &sd);
    assert!((be - 2000.0).abs() < 1e-6);
    // (arrivals until needed, expected keep-alive: None = the gap curve's optimum)
    let rows: &[(f64, Option<f64>)] = &[
        (1.0, None),                       // next in line: the gaps decide
        (10.0, None),                      // 10 gaps (about 1,000 s) are below the break-even
        (30.0, Some(sd.min_keep_alive_s)), // 30 gaps (about 3,000 s) are past it
    ];
    for &(n, want) in rows {
        let got = keepalive::keep_alive_with_curve_s(Some(&curve), n, 390.0, price, &sd);
        let want = want.unwrap_or_else(|| curve.timeout_s(n, be, sd.min_keep_alive_s, sd.max_keep_alive_s));
        assert_eq!(got, want, "{n} arrivals");
    }
    // The curve alone would hold the 30th worker through the short gaps (30 x 10 s).
    assert!(curve.timeout_s(30.0, be, sd.min_keep_alive_s, sd.max_keep_alive_s) > 250.0);
}

#[test]
fn gap_statistics_decay_with_a_one_day_half_life() {
    let mut h = onoff_policy::GapHistogram::default();
    // 100 gaps of 10 s two days ago, then 100 gaps of 1000 s now: the old ones weigh a quarter.
    for _ in 0..100 {
        h.record(10.0, NOW - 2.0 * onoff_policy::observation::GAP_HALF_LIFE_S);
    }
    for _ in 0..100 {
        h.record(1000.0, NOW);
    }
    assert_eq!(h.samples(), 200);
    let masses: Vec<f64> = h.masses().collect();
    let old: f64 = masses.iter().take(15).sum();
    assert!((old - 0.2).abs() < 1e-9, "old share {old}");
    // The median is a 1000 s gap now (without decay it would sit at the boundary).
    assert!(h.quantile(0.5).unwrap() >= 1000.0);
    assert!(h.quantile(0.1).unwrap() <= 12.5);
}

// ---------------------------------------------------------------------------------------------
// Deadlines.

#[test]
fn deadline_at_risk_gets_on_demand() {
    // Threshold: two cold starts 2 x 390 + checkpoint 600 + margin 600 = 1980 s of slack.
    // (slack s (None = no deadline), expected capacity, at risk)
    let rows: &[(Option<f64>, CapacityType, bool)] = &[
        (None, CapacityType::Spot, false),
        (Some(-100.0), CapacityType::OnDemand, true),
        (Some(0.0), CapacityType::OnDemand, true),
        (Some(1000.0), CapacityType::OnDemand, true),
        (Some(1589.0), CapacityType::OnDemand, true),
        (Some(1979.0), CapacityType::OnDemand, true),
        (Some(1980.0), CapacityType::Spot, false),
        (Some(5000.0), CapacityType::Spot, false),
    ];
    for &(slack, cap, at_risk) in rows {
        let mut j = job("d", 1, NOW - 60.0);
        j.est_runtime_s = Some(3600.0);
        j.deadline = slack.map(|s| NOW + 3600.0 + s);
        let plan = World::new(vec![j], vec![]).decide(&cfg(), NOW);
        let l = launch_list(&plan);
        assert_eq!(l.len(), 1, "slack {slack:?}: {plan:#?}");
        let (k, count, reason, jid) = l[0];
        assert_eq!((k, count), (&key(G5, cap), 1), "slack {slack:?}");
        if at_risk {
            assert_eq!(
                reason,
                &Reason::DeadlineAtRisk {
                    job: "d".into(),
                    slack_s: slack.unwrap()
                }
            );
            assert_eq!(jid, Some("d"));
        } else {
            assert_eq!(reason, &Reason::Activation { backlog: 1 });
            assert_eq!(jid, None);
        }
    }
}

#[test]
fn deadline_jobs_are_pinned_apart_from_the_rest() {
    let mut urgent = job("urgent", 1, NOW - 10.0);
    urgent.est_runtime_s = Some(3600.0);
    urgent.deadline = Some(NOW + 3600.0 + 600.0);
    let mut relaxed = job("relaxed", 1, NOW - 10.0);
    relaxed.deadline = Some(NOW + 86_400.0);
    let js = vec![urgent, relaxed, job("plain", 1, NOW - 10.0)];
    let plan = World::new(js, vec![]).decide(&cfg(), NOW);
    let l = launch_list(&plan);
    assert_eq!(plan.launches(), 3, "{plan:#?}");
    let od: Vec<_> = l
        .iter()
        .filter(|x| x.0.capacity_type == CapacityType::OnDemand)
        .collect();
    assert_eq!(od.len(), 1);
    assert_eq!((od[0].1, od[0].3), (1, Some("urgent")));
    let spot: u32 = l
        .iter()
        .filter(|x| x.0.capacity_type == CapacityType::Spot)
        .map(|x| x.1)
        .sum();
    assert_eq!(spot, 2);
}

#[test]
fn a_booting_worker_launched_for_a_job_is_that_jobs_capacity_only() {
    // An on-demand worker booting for d1 (its pinned job). d0's deadline is earlier, so matching
    // by urgency alone would hand d0 that worker and launch again for d1.
    let due = |id: &str, slack: f64| {
        let mut j = job(id, 1, NOW - 60.0);
        j.est_runtime_s = Some(3600.0);
        j.deadline = Some(NOW + 3600.0 + slack);
        j
    };
    let mut od = pending("od", 0, 1, 300.0);
    od.offering = key(G5, CapacityType::OnDemand);
    od.pinned_job = Some("d1".into());
    // (what, queued jobs, expected launches as (capacity type, pinned job))
    type Row<'a> = (
        &'a str,
        Vec<onoff_policy::PendingJob>,
        Vec<(CapacityType, Option<&'a str>)>,
    );
    let rows: Vec<Row> = vec![
        ("its job alone: nothing more", vec![due("d1", 1000.0)], vec![]),
        (
            "another at-risk job gets capacity of its own",
            vec![due("d0", 800.0), due("d1", 1000.0)],
            vec![(CapacityType::OnDemand, Some("d0"))],
        ),
        (
            "a plain job does not count it",
            vec![due("d1", 1000.0), job("plain", 1, NOW - 60.0)],
            vec![(CapacityType::Spot, None)],
        ),
        (
            "once its job is gone (taken elsewhere) it is anyone's",
            vec![job("plain", 1, NOW - 60.0)],
            vec![],
        ),
    ];
    for (what, js, want) in rows {
        let plan = World::new(js, vec![od.clone()]).decide(&cfg(), NOW);
        let got: Vec<(CapacityType, Option<&str>)> =
            launch_list(&plan).iter().map(|l| (l.0.capacity_type, l.3)).collect();
        assert_eq!(got, want, "{what}: {plan:#?}");
        assert!(cancelled(&plan).is_empty(), "{what}: the booting worker is kept");
    }
}

#[test]
fn on_demand_lane_does_not_flag_deadlines() {
    let mut cfg = cfg();
    cfg.lanes[0].capacity = CapacityPreference::OnDemand;
    let mut j = job("d", 1, NOW - 60.0);
    j.deadline = Some(NOW + 100.0);
    let plan = World::new(vec![j], vec![]).decide(&cfg, NOW);
    let l = launch_list(&plan);
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].0, &key(G5, CapacityType::OnDemand));
    assert_eq!(l[0].2, &Reason::Activation { backlog: 1 });
}

// ---------------------------------------------------------------------------------------------
// Cost-aware choice.

fn slow_fast() -> Vec<Offering> {
    vec![
        offering("slow.xlarge", CapacityType::OnDemand, 1, "SLOW", 24.0, 1.00),
        offering("fast.xlarge", CapacityType::OnDemand, 1, "FAST", 24.0, 2.00),
    ]
}

#[test]
fn cost_per_job_not_hourly_price_picks_the_offering() {
    // slow: $1/h speed 1; fast: $2/h speed 3. cost = price/3600 x (390 + runtime/speed):
    // equal at runtime 1170 s.
    // (runtime s, expected type)
    let rows: &[(f64, &str)] = &[
        (60.0, "slow.xlarge"),
        (600.0, "slow.xlarge"),
        (1000.0, "slow.xlarge"),
        (1400.0, "fast.xlarge"),
        (3600.0, "fast.xlarge"),
        (36_000.0, "fast.xlarge"),
    ];
    let mut cfg = cfg();
    cfg.offers.gpu_speed.insert("FAST".into(), 3.0);
    for &(runtime, ty) in rows {
        let mut j = job("j", 1, NOW - 60.0);
        j.est_runtime_s = Some(runtime);
        let mut w = World::new(vec![j], vec![]);
        w.offerings = slow_fast();
        let plan = w.decide(&cfg, NOW);
        let l = launch_list(&plan);
        assert_eq!(l.len(), 1, "{runtime}: {plan:#?}");
        assert_eq!(l[0].0, &key(ty, CapacityType::OnDemand), "runtime {runtime}");
    }
    // Without the speed table the cheaper one always wins.
    let mut j = job("j", 1, NOW - 60.0);
    j.est_runtime_s = Some(36_000.0);
    let mut w = World::new(vec![j], vec![]);
    w.offerings = slow_fast();
    let plan = w.decide(&common::cfg(), NOW);
    assert_eq!(launch_list(&plan)[0].0, &key("slow.xlarge", CapacityType::OnDemand));
}

#[test]
fn cost_choice_is_per_job_runtime_not_per_shape() {
    let mut cfg = cfg();
    cfg.offers.gpu_speed.insert("FAST".into(), 3.0);
    let mut short = job("short", 1, NOW - 120.0);
    short.est_runtime_s = Some(60.0);
    let mut long = job("long", 1, NOW - 60.0);
    long.est_runtime_s = Some(36_000.0);
    let mut w = World::new(vec![short, long], vec![]);
    w.offerings = slow_fast();
    let plan = w.decide(&cfg, NOW);
    let mut got: Vec<_> = launch_list(&plan)
        .iter()
        .map(|l| (l.0.instance_type.clone(), l.1))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![("fast.xlarge".to_string(), 1), ("slow.xlarge".to_string(), 1)],
        "{plan:#?}"
    );
}

#[test]
fn expected_cost_per_job_matches_hand_computation() {
    let mut oc = onoff_policy::OfferConfig::default();
    oc.gpu_speed.insert("FAST".into(), 3.0);
    let [slow, fast] = <[Offering; 2]>::try_from(slow_fast()).unwrap();
    // (offering, runtime, instances, expected $)
    let rows: Vec<(&Offering, f64, u32, f64)> = vec![
        (&fast, 36_000.0, 1, 2.0 / 3600.0 * (390.0 + 12_000.0)),
        (&slow, 36_000.0, 1, 1.0 / 3600.0 * (390.0 + 36_000.0)),
        (&slow, 3600.0, 2, 2.0 * (390.0 + 3600.0) / 3600.0),
        (&fast, 0.0, 1, 2.0 * 390.0 / 3600.0),
    ];
    for (o, runtime, n, want) in rows {
        let got = choice::expected_cost_per_job(o, runtime, n, &oc);
        assert!((got - want).abs() < 1e-9, "{} {runtime} x{n}: {got} vs {want}", o.key);
    }
    assert!((choice::expected_cost_per_job(&fast, 36_000.0, 1, &oc) - 6.883_333_333).abs() < 1e-6);

    // A spot offering prices interruptions in: rate = -ln(1 - 0.025) / (730 h), each losing half a
    // checkpoint (300 s) plus a boot (390 s).
    let spot = offering(G5, CapacityType::Spot, 1, "NVIDIA A10G", 24.0, 0.10);
    let rate = -(1.0f64 - 0.025).ln() / (730.0 * 3600.0);
    let want = 0.10 / 3600.0 * (390.0 + 3600.0 * (1.0 + rate * (300.0 + 390.0))) * 2.0;
    let got = choice::expected_cost_per_job(&spot, 3600.0, 2, &onoff_policy::OfferConfig::default());
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    assert!(got > 0.10 / 3600.0 * (390.0 + 3600.0) * 2.0);
}

// ---------------------------------------------------------------------------------------------
// Warm pool.

fn warm_cfg(windows: &[(u32, u32, u32)]) -> PolicyConfig {
    let mut cfg = cfg();
    cfg.scale_down.mode = KeepAliveMode::Fixed;
    cfg.lanes[0].warm_pool = windows
        .iter()
        .map(|&(start_hour, end_hour, size)| WarmWindow {
            start_hour,
            end_hour,
            size,
        })
        .collect();
    cfg
}

#[test]
fn warm_pool_fills_inside_its_window() {
    // (windows (start, end, size), hour of now, idle warm workers, launches)
    type Row = (&'static [(u32, u32, u32)], u32, usize, u32);
    let rows: &[Row] = &[
        (&[(8, 18, 2)], 12, 0, 2),
        (&[(8, 18, 2)], 12, 1, 1),
        (&[(8, 18, 2)], 12, 2, 0),
        (&[(8, 18, 2)], 12, 3, 0),
        (&[(8, 18, 2)], 8, 0, 2),
        (&[(8, 18, 2)], 17, 0, 2),
        (&[(8, 18, 2)], 18, 0, 0),
        (&[(8, 18, 2)], 7, 0, 0),
        (&[(8, 18, 2)], 20, 0, 0),
        (&[(22, 6, 1)], 23, 0, 1),
        (&[(22, 6, 1)], 3, 0, 1),
        (&[(22, 6, 1)], 12, 0, 0),
        (&[(0, 24, 1), (9, 17, 3)], 12, 0, 3),
        (&[(0, 24, 1), (9, 17, 3)], 20, 0, 1),
    ];
    for &(windows, hour, n_idle, want) in rows {
        let cfg = warm_cfg(windows);
        let now = DAY0 + hour as f64 * 3600.0 + 60.0;
        let ws: Vec<_> = (0..n_idle)
            .map(|i| {
                worker(
                    &format!("w{i}"),
                    i as u64,
                    WorkerState::Idle,
                    1,
                    now - 7200.0,
                    Some(now - 10.0),
                )
            })
            .collect();
        let plan = World::new(vec![], ws).decide(&cfg, now);
        let row = format!("{windows:?} at {hour}h, {n_idle} idle");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        let target = cfg.lanes[0].warm_pool_size_at(hour);
        assert_eq!(plan.lanes[0].warm_target, target, "{row}");
        for (k, _, reason, _) in launch_list(&plan) {
            assert_eq!(k, &key(G5, CapacityType::Spot), "{row}");
            assert_eq!(
                reason,
                &Reason::WarmPool {
                    target,
                    ready: n_idle as u32
                },
                "{row}"
            );
        }
    }
}

#[test]
fn warm_pool_keeps_idle_workers_past_keep_alive() {
    // Fixed keep-alive 600 s; idle 1-GPU workers idle 1000, 2000, 3000 s and a 4-GPU worker idle
    // 5000 s (not of the warm shape). The most recently idle warm-shape workers are kept.
    // (hour, warm size, expected terminated)
    let rows: &[(u32, u32, &[&str])] = &[
        (12, 2, &["w3000", "big"]),
        (12, 1, &["w2000", "w3000", "big"]),
        (12, 3, &["big"]),
        (12, 5, &["big"]),
        (20, 2, &["w1000", "w2000", "w3000", "big"]),
    ];
    for &(hour, size, want) in rows {
        let cfg = warm_cfg(&[(8, 18, size)]);
        let now = DAY0 + hour as f64 * 3600.0;
        let mut ws: Vec<_> = [1000.0, 2000.0, 3000.0]
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                worker(
                    &format!("w{t}"),
                    i as u64,
                    WorkerState::Idle,
                    1,
                    now - 7200.0,
                    Some(now - t),
                )
            })
            .collect();
        ws.push(worker("big", 9, WorkerState::Idle, 4, now - 7200.0, Some(now - 5000.0)));
        let plan = World::new(vec![], ws).decide(&cfg, now);
        let mut got = terminated(&plan);
        got.sort();
        let mut want = want.to_vec();
        want.sort();
        assert_eq!(got, want, "hour {hour}, size {size}: {plan:#?}");
    }
}

#[test]
fn warm_pool_keeps_booting_warm_workers() {
    // (hour, warm size, pending 1-GPU workers, expected cancelled)
    let rows: &[(u32, u32, usize, usize)] = &[(12, 2, 2, 0), (12, 1, 2, 1), (20, 2, 2, 2)];
    for &(hour, size, n, want) in rows {
        let cfg = warm_cfg(&[(8, 18, size)]);
        let now = DAY0 + hour as f64 * 3600.0;
        let ws: Vec<_> = (0..n)
            .map(|i| worker(&format!("p{i}"), i as u64, WorkerState::Pending, 1, now - 300.0, None))
            .collect();
        let plan = World::new(vec![], ws).decide(&cfg, now);
        assert_eq!(cancelled(&plan).len(), want, "hour {hour}, size {size}: {plan:#?}");
        assert_eq!(plan.launches(), 0);
    }
}

#[test]
fn warm_pool_is_capped_by_max_workers() {
    let mut cfg = warm_cfg(&[(0, 24, 3)]);
    cfg.limits.max_workers_total = 2;
    let plan = World::new(vec![], vec![]).decide(&cfg, NOW);
    assert_eq!(plan.launches(), 2, "{plan:#?}");
    assert_eq!(held_count(&plan, |r| matches!(r, Reason::MaxWorkers { .. })), 1);
}

#[test]
fn warm_pool_held_reason_names_the_limit_that_bound() {
    let mut cfg = warm_cfg(&[(0, 24, 3)]);
    cfg.limits.max_workers_total = 2;
    let plan = World::new(vec![], vec![]).decide(&cfg, NOW);
    assert_eq!(plan.held.len(), 1);
    assert_eq!(plan.held[0].reason, Reason::MaxWorkers { limit: 2 }, "{plan:#?}");
}

// ---------------------------------------------------------------------------------------------
// Configuration.

fn problems(text: &str) -> String {
    match PolicyConfig::from_toml_str(text) {
        Ok(_) => panic!("expected an error for {text:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn default_and_empty_configs_are_valid() {
    PolicyConfig::default().validate().unwrap();
    let empty = PolicyConfig::from_toml_str("").unwrap();
    assert_eq!(empty, PolicyConfig::default());
    assert_eq!(
        empty.lanes.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["express", "standard"]
    );
    cfg().validate().unwrap();
}

#[test]
fn bad_config_values_name_the_field() {
    // (TOML, text the error must contain)
    let rows: &[(&str, &str)] = &[
        ("[scale_down]\nmax_keep_alive_s = 1.0", "scale_down.max_keep_alive_s"),
        ("[scale_down]\nrelease_fraction = -1.0", "scale_down.release_fraction"),
        ("[scale_down]\nrelease_fraction = 1.5", "scale_down.release_fraction"),
        ("[scale_down]\nwarm_for_s = 2000.0", "scale_down.release_rest_at_s"),
        ("[scale_down]\nmin_keep_alive_s = -1.0", "scale_down.min_keep_alive_s"),
        ("[[lanes]]\nname = \"a\"\n[[lanes]]\nname = \"a\"", "lanes[1].name"),
        ("[[lanes]]\nname = \"\"", "lanes[0].name"),
        ("[[lanes]]\nname = \"gold lane\"", "lanes[0].name"),
        (
            "[[lanes]]\nname = \"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"",
            "1-64 characters",
        ),
        ("lanes = []", "lanes"),
        (
            "[[lanes]]\nname = \"a\"\njobs_per_worker = 0",
            "lanes[0].jobs_per_worker",
        ),
        (
            "[[lanes]]\nname = \"a\"\nmax_workers = 2\nwarm_pool = [{ start_hour = 8, end_hour = 18, size = 3 }]",
            "lanes[0].warm_pool[0].size",
        ),
        (
            "[[lanes]]\nname = \"a\"\nwarm_pool = [{ start_hour = 24, end_hour = 18, size = 1 }]",
            "lanes[0].warm_pool[0]",
        ),
        ("[limits]\nmax_workers_total = 0", "limits.max_workers_total"),
        ("[limits]\nmax_usd_per_h = 0.0", "limits.max_usd_per_h"),
        ("[limits.projects.x]\nweight = 0.0", "limits.projects.x.weight"),
        ("[offers]\ndiversify = 0", "offers.diversify"),
        ("[offers]\nmax_gpu_oversize = 0", "offers.max_gpu_oversize"),
        ("[offers]\ndefault_runtime_s = 0.0", "offers.default_runtime_s"),
        (
            "[[lanes]]\nname = \"a\"\ndefault_runtime_s = 0.0",
            "lanes[0].default_runtime_s",
        ),
        (
            "[[lanes]]\nname = \"a\"\ndefault_runtime_s = -5.0",
            "lanes[0].default_runtime_s",
        ),
        ("[offers.gpu_speed]\n\"NVIDIA A10G\" = 0.0", "offers.gpu_speed"),
        // Unknown keys and wrong types are parse errors naming the key.
        ("[scale_down]\nbogus = 1", "bogus"),
        ("unknown_top = 1", "unknown_top"),
        ("[[lanes]]\nname = \"a\"\nmax_worker = 3", "max_worker"),
        ("[limits]\nmax_workers_total = \"ten\"", "max_workers_total"),
        ("[scale_down]\nmode = \"sometimes\"", "sometimes"),
    ];
    for &(text, field) in rows {
        let e = problems(text);
        assert!(e.contains(field), "{text:?}: error {e:?} does not name {field:?}");
    }
}

#[test]
fn validate_reports_every_problem_at_once() {
    let text = "[scale_down]\nrelease_fraction = 2.0\n[limits]\nmax_workers_total = 0";
    match PolicyConfig::from_toml_str(text) {
        Err(ConfigError::Invalid(p)) => {
            let fields: Vec<_> = p.iter().map(|p| p.field.as_str()).collect();
            assert_eq!(fields, ["scale_down.release_fraction", "limits.max_workers_total"]);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        PolicyConfig::from_toml_str("[scale_down]\nbogus = 1"),
        Err(ConfigError::Parse(_))
    ));
}

#[test]
fn example_toml_with_lanes_and_warm_pool_parses() {
    let text = r#"
[[lanes]]
name = "express"
priority = 0
capacity = "on-demand"
max_workers = 8
warm_pool = [
  { start_hour = 8, end_hour = 18, size = 2 },
  { start_hour = 22, end_hour = 6, size = 1 },
]

[[lanes]]
name = "standard"
capacity = "spot-first"
max_workers = 48
activation_backlog = 2

[scale_down]
mode = "cooldown-decay"
warm_for_s = 300
release_rest_at_s = 900

[anti_thrash]
min_runtime_s = 120

[offers]
min_gpu_memory_gib = 24
max_interruption = "From5To10"
gpu_speed = { "NVIDIA A10G" = 1.3, "NVIDIA L4" = 1.1 }

[limits]
max_workers_total = 50
max_usd_per_h = 40.0
job_type_caps = { train = 4 }

[limits.projects.vision]
max_gpus = 16
weight = 3.0
"#;
    let cfg = PolicyConfig::from_toml_str(text).unwrap();
    assert_eq!(cfg.lanes.len(), 2);
    assert_eq!(cfg.lane_index("standard"), Some(1));
    let ex = &cfg.lanes[0];
    assert_eq!(ex.capacity, CapacityPreference::OnDemand);
    assert_eq!(ex.warm_pool.len(), 2);
    assert_eq!(
        (
            ex.warm_pool_size_at(9),
            ex.warm_pool_size_at(23),
            ex.warm_pool_size_at(19)
        ),
        (2, 1, 0)
    );
    let st = &cfg.lanes[1];
    assert_eq!((st.priority, st.max_workers, st.activation_backlog), (1, 48, 2));
    assert_eq!(cfg.scale_down.mode, KeepAliveMode::CooldownDecay);
    assert_eq!(
        (cfg.scale_down.warm_for_s, cfg.scale_down.release_rest_at_s),
        (300.0, 900.0)
    );
    assert_eq!(cfg.scale_down.release_fraction, 0.5);
    assert_eq!(cfg.anti_thrash.min_runtime_s, 120.0);
    assert_eq!(cfg.offers.gpu_speed["NVIDIA A10G"], 1.3);
    assert_eq!(
        cfg.offers.max_interruption,
        Some(onoff_policy::InterruptionBucket::From5To10)
    );
    assert_eq!(cfg.limits.max_workers_total, 50);
    assert_eq!(cfg.limits.max_usd_per_h, Some(40.0));
    assert_eq!(cfg.limits.job_type_caps["train"], 4);
    assert_eq!(
        cfg.project_quota("vision"),
        ProjectQuota {
            max_gpus: Some(16),
            weight: 3.0
        }
    );
    assert_eq!(cfg.project_quota("other"), ProjectQuota::default());
}

#[test]
fn partial_limits_table_keeps_the_documented_defaults() {
    let cfg = PolicyConfig::from_toml_str("[limits]\nfrozen = true").unwrap();
    assert!(cfg.limits.frozen);
    assert_eq!(cfg.limits.max_workers_total, 64);
    assert_eq!(cfg.limits.deadline_margin_s, 600.0);
}

// ---------------------------------------------------------------------------------------------
// Predictive warm pool.

#[test]
fn predictive_warm_pool_pays_for_itself() {
    // A ready 1-GPU worker costs $0.10/h; with the default wait value of $1/h a cold start is
    // worth 4290 idle seconds, so the i-th worker is held when at least 390 / 4680 = 8.3 % of the
    // windows that followed one like the current one (busy or quiet) needed i workers.
    // (long jobs per 390 s window, the current one first; wait value $/h; predictive_min_bursts;
    // predictive_max; idle 1-GPU workers; launches)
    type Row = (&'static [u32], f64, u32, u32, usize, u32);
    let rows: &[Row] = &[
        (&[5, 5, 5], 1.0, 2, 40, 0, 5), // a busy run: the windows after busy ones needed 5
        (&[5, 5], 1.0, 2, 40, 0, 0),    // one such window: below predictive_min_bursts
        (&[5, 5, 0, 5, 0, 5, 0], 1.0, 1, 40, 0, 5), // after busy windows: 5, 0, 0; 1 of 3 pays at $1/h
        (&[5, 5, 0, 5, 0, 5, 0], 0.0, 1, 40, 0, 0), // ...not without a wait value (half needed)
        // After busy windows: 5, 5, 0, 0, 0. A worker already up is held when a third of them
        // needed it (break-even 780 s at $0.10/h and $0.1/h of wait: 390 / 1170), but a launch
        // saves only the wait (390 s: half of them): none launched.
        (&[5, 5, 5, 0, 5, 0, 5, 0, 5, 0], 0.1, 1, 40, 0, 0),
        (&[0, 5, 5, 5], 1.0, 2, 40, 0, 0), // quiet now: quiet windows were followed by quiet
        (&[5, 5, 5], 1.0, 2, 3, 0, 3),     // capped by predictive_max
        (&[5, 5, 5], 1.0, 2, 0, 0, 0),     // off
        (&[5, 5, 5], 1.0, 2, 40, 2, 3),    // idle workers count
        (&[], 1.0, 2, 40, 0, 0),           // no arrivals: nothing held
    ];
    for &(demand, wait_value, min_bursts, max, n_idle, want) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].predictive_max = max;
        cfg.lanes[0].predictive_min_bursts = min_bursts;
        cfg.scale_down.wait_value_usd_per_h = wait_value;
        let ws: Vec<_> = (0..n_idle).map(|i| idle(&format!("w{i}"), i as u64, 10.0)).collect();
        let mut w = World::new(vec![], ws);
        let mut arrivals: Vec<f64> = demand
            .iter()
            .enumerate()
            .flat_map(|(k, &n)| (0..n).map(move |a| NOW - 390.0 * k as f64 - 10.0 - 10.0 * a as f64))
            .collect();
        arrivals.sort_by(f64::total_cmp);
        for t in arrivals {
            w.lanes[0].record_arrival(1, t);
        }
        let plan = w.decide(&cfg, NOW);
        let row =
            format!("demand {demand:?}, wait value {wait_value}, min bursts {min_bursts}, max {max}, idle {n_idle}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert!(
            launch_list(&plan)
                .iter()
                .all(|l| matches!(l.2, Reason::WarmPool { .. })),
            "{row}"
        );
    }
}

#[test]
fn predictive_warm_pool_is_per_job_shape_and_leaves_short_jobs_to_the_keep_alive() {
    // Windows with two 4-GPU jobs and three 1-GPU items of 1 s each: the current one and the two
    // before it (busy now), or only the two before it (quiet now).
    for (busy_now, want) in [(true, 2), (false, 0)] {
        let mut w = World::new(vec![], vec![]);
        let mut arrivals = Vec::new();
        let first = if busy_now { 0 } else { 1 };
        for k in first..first + 3 {
            let t0 = NOW - 390.0 * k as f64 - 100.0;
            arrivals.push((t0, 4, None));
            arrivals.push((t0 + 1.0, 4, None));
            for a in 0..3 {
                arrivals.push((t0 + 2.0 + a as f64, 1, Some(1.0)));
            }
        }
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (t, g, rt) in arrivals {
            w.lanes[0].record_arrival_with_runtime(g, t, rt);
        }
        let plan = w.decide(&cfg(), NOW);
        let launches = launch_list(&plan);
        // Two ready 4-GPU workers (g5.12xlarge) while the run goes on, none once it paused; the
        // 1-GPU items (short) never hold a worker.
        assert_eq!(plan.launches(), want, "busy now {busy_now}: {launches:?}");
        assert!(launches.iter().all(|l| l.0.instance_type == G5_12X), "{launches:?}");
        // Speculative capacity in a spot-first lane is spot only: no on-demand fallback.
        for a in &plan.actions {
            if let Action::Launch { request, .. } = a {
                assert_eq!(request.capacity, CapacityPreference::SpotOnly);
            }
        }
    }
}

#[test]
fn a_burst_bigger_than_the_look_back_is_launched_ahead_for_when_asked() {
    // Two long 1-GPU jobs in each of the 27 windows of the 3 h look-back, then twelve in the
    // current one. The fractile (the 3rd largest of 27 windows at $0.10/h, 1 $/h of wait) holds 2;
    // `predictive_burst` adds its multiple of the excess over the look-back's largest (12 - 2),
    // when the current window needs at least `predictive_burst_min` workers (default 12).
    // (predictive_burst; predictive_burst_min; lane max_workers; launches; held for the lane's cap)
    let rows: &[(f64, Option<u32>, u32, u32, u32)] = &[
        (0.0, None, 32, 2, 0),      // off (the default): the fractile alone
        (1.0, None, 32, 10, 0),     // the excess, once
        (2.0, None, 32, 20, 0),     // twice
        (2.0, None, 8, 8, 12),      // within the lane's cap: the rest held
        (2.0, Some(13), 32, 2, 0),  // 12 arrivals are no burst to bet on: the fractile alone
        (2.0, Some(12), 32, 20, 0), // as many as the least: a burst
    ];
    for &(factor, min, max_workers, want, held) in rows {
        let mut cfg = cfg();
        cfg.lanes[0].predictive_burst = factor;
        if let Some(min) = min {
            cfg.lanes[0].predictive_burst_min = min;
        }
        cfg.lanes[0].max_workers = max_workers;
        let mut w = World::new(vec![], vec![]);
        let mut arrivals: Vec<f64> = (0..28)
            .flat_map(|k| {
                let n = if k == 0 { 12 } else { 2 };
                (0..n).map(move |a| NOW - 390.0 * k as f64 - 10.0 - 10.0 * a as f64)
            })
            .collect();
        arrivals.sort_by(f64::total_cmp);
        for t in arrivals {
            w.lanes[0].record_arrival(1, t);
        }
        let plan = w.decide(&cfg, NOW);
        let row = format!("predictive_burst {factor}, least {min:?}, max_workers {max_workers}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert_eq!(
            held_count(&plan, |r| matches!(r, Reason::MaxWorkers { .. })),
            held,
            "{row}: {plan:#?}"
        );
        assert!(
            launch_list(&plan)
                .iter()
                .all(|l| matches!(l.2, Reason::WarmPool { .. })),
            "{row}"
        );
        // Launched ahead, it is speculative capacity: spot only in a spot-first lane.
        for a in &plan.actions {
            if let Action::Launch { request, .. } = a {
                assert_eq!(request.capacity, CapacityPreference::SpotOnly, "{row}");
            }
        }
    }
    let bad = PolicyConfig::from_toml_str("[[lanes]]\nname = \"a\"\npredictive_burst = -1.0").unwrap_err();
    assert!(bad.to_string().contains("predictive_burst"), "{bad}");
}

#[test]
fn warm_pool_shapes_launch_in_gpu_order_with_the_scheduled_shape_in_its_place() {
    // Busy windows of two 4-GPU jobs each (the predictive pool holds two 4-GPU workers) and a
    // scheduled pool of two 1-GPU workers, which no arrival asked for: the 1-GPU launches come
    // first, from the scanned arrivals and from windows kept arrival by arrival alike.
    let mut cfg = cfg();
    cfg.lanes[0].warm_pool = vec![WarmWindow {
        start_hour: 0,
        end_hour: 24,
        size: 2,
    }];
    let long = (cfg.offers.short_job_horizon_s, cfg.offers.default_runtime_s);
    for kept in [false, true] {
        let mut w = World::new(vec![], vec![]);
        let lc = &cfg.lanes[0];
        if kept {
            w.lanes[0].demand_windows = Some(DemandWindows::new(
                lc.predictive_window_s,
                lc.predictive_lookback_s,
                long,
            ));
        }
        for k in (0..3).rev() {
            let t0 = NOW - 390.0 * k as f64 - 100.0;
            w.lanes[0].record_arrival(4, t0);
            w.lanes[0].record_arrival(4, t0 + 1.0);
        }
        if let Some(d) = &mut w.lanes[0].demand_windows {
            d.advance(NOW);
        }
        let plan = w.decide(&cfg, NOW);
        let gpus: Vec<u32> = launch_list(&plan)
            .iter()
            .flat_map(|l| {
                let g = w.offerings.iter().find(|o| &o.key == l.0).unwrap().gpus;
                std::iter::repeat_n(g, l.1 as usize)
            })
            .collect();
        assert_eq!(gpus, [1, 1, 4, 4], "kept windows {kept}: {plan:#?}");
    }
}

#[test]
fn window_demand_counts_long_jobs_per_shape_and_window() {
    let mut l = LaneObservation::default();
    for i in 0..100 {
        l.record_arrival(1, NOW + i as f64 * 600.0);
    }
    let last = NOW + 99.0 * 600.0;
    assert!(l.recent_arrivals.front().unwrap().at >= last - onoff_policy::observation::RECENT_ARRIVALS_KEPT_S);
    // 600 s apart, windows of 390 s over 3 h: 28 windows, 19 arrivals in them, none doubled.
    let d = l.window_demand(last, 390.0, 10_800.0, (120.0, 3600.0));
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].0, d[0].1.len(), d[0].1.iter().sum::<u32>()), (1, 28, 19));
    assert!(d[0].1.iter().all(|c| *c <= 1));
    // Windows of 1200 s: two arrivals each.
    let d = l.window_demand(last, 1_200.0, 10_800.0, (120.0, 3600.0));
    assert_eq!(d[0].1[..9], [2; 9]);
    // A default run time under the horizon makes them short: no demand.
    let d = l.window_demand(last, 390.0, 10_800.0, (120.0, 60.0));
    assert!(d.is_empty());
}

#[test]
fn demand_windows_out_of_order_are_rebuilt_and_after_time_went_back_are_not_read() {
    let long = (120.0, 3600.0);
    let mut l = LaneObservation {
        demand_windows: Some(onoff_policy::DemandWindows::new(390.0, 10_800.0, long)),
        ..Default::default()
    };
    for i in 0..30 {
        l.record_arrival(1 + i % 2, NOW + i as f64 * 300.0);
    }
    let t = NOW + 30.0 * 300.0;
    l.demand_windows.as_mut().unwrap().advance(t);
    assert_eq!(
        l.demand_at(t, 390.0, 10_800.0, long),
        l.window_demand(t, 390.0, 10_800.0, long)
    );
    // An arrival older than the last advance: rebuilt from the arrivals at the next advance, to
    // the counts of the same arrivals recorded in order (the scan needs them in order).
    l.record_arrival(4, t - 5_000.0);
    l.demand_windows.as_mut().unwrap().advance(t + 60.0);
    let kept = l.demand_windows.as_ref().unwrap();
    assert!(kept.is_for(t + 60.0, 390.0, 10_800.0, long));
    let mut ordered = LaneObservation::default();
    let mut arrivals: Vec<_> = l.recent_arrivals.iter().map(|a| (a.at, a.gpus)).collect();
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    arrivals.iter().for_each(|(at, g)| ordered.record_arrival(*g, *at));
    let scan = ordered.window_demand(t + 60.0, 390.0, 10_800.0, long);
    assert_eq!(scan.iter().map(|d| d.0).collect::<Vec<_>>(), [1, 2, 4]);
    assert_eq!(kept.demand(), scan);
    // Kept for other windows, or not advanced to now: scanned.
    assert!(!kept.is_for(t + 60.0, 600.0, 10_800.0, long));
    assert!(!kept.is_for(t + 120.0, 390.0, 10_800.0, long));
    // Time went back: never read again, the scan answers.
    l.demand_windows.as_mut().unwrap().advance(t);
    assert!(!l.demand_windows.as_ref().unwrap().is_for(t, 390.0, 10_800.0, long));
    assert_eq!(
        l.demand_at(t, 390.0, 10_800.0, long),
        l.window_demand(t, 390.0, 10_800.0, long)
    );
}

#[test]
fn predictive_look_back_beyond_the_arrivals_kept_is_rejected() {
    let err = PolicyConfig::from_toml_str("[[lanes]]\nname = \"standard\"\npredictive_lookback_s = 30000.0\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("lanes[0].predictive_lookback_s"), "{err}");
}

#[test]
fn a_quota_wait_limit_is_a_positive_number_of_seconds_or_none() {
    let lane = |extra: &str| PolicyConfig::from_toml_str(&format!("[[lanes]]\nname = \"express\"\n{extra}"));
    assert_eq!(
        lane("").unwrap().lanes[0].quota_wait_limit_s,
        None,
        "waits until the quota is raised"
    );
    assert_eq!(
        lane("quota_wait_limit_s = 3600.0\n").unwrap().lanes[0].quota_wait_limit_s,
        Some(3600.0)
    );
    for bad in ["0.0", "-5.0"] {
        let err = lane(&format!("quota_wait_limit_s = {bad}\n")).unwrap_err().to_string();
        assert!(err.contains("lanes[0].quota_wait_limit_s"), "{bad}: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Short jobs share workers.

#[test]
fn short_jobs_share_a_worker_instead_of_each_paying_a_cold_start() {
    // (queued jobs' run time s, how many, booting 1-GPU workers, horizon s, launches)
    let rows: &[(f64, usize, usize, f64, u32)] = &[
        (10.0, 12, 0, 120.0, 1), // 12 x 10 s = 120 s: one worker takes them all
        (10.0, 13, 0, 120.0, 2), // the 13th overflows the horizon
        (10.0, 30, 1, 120.0, 2), // the booting worker takes 12, two launches for the other 18
        (10.0, 12, 0, 0.0, 12),  // horizon 0: one worker per job
        (200.0, 3, 0, 120.0, 3), // longer than the horizon: a worker each
        (60.0, 4, 0, 120.0, 2),  // two per worker
    ];
    for &(runtime, n, booting, horizon, want) in rows {
        let mut cfg = cfg();
        cfg.offers.short_job_horizon_s = horizon;
        let js: Vec<_> = jobs("s", n)
            .into_iter()
            .map(|mut j| {
                j.est_runtime_s = Some(runtime);
                j
            })
            .collect();
        let ws: Vec<_> = (0..booting)
            .map(|i| worker(&format!("b{i}"), i as u64, WorkerState::Pending, 1, NOW - 30.0, None))
            .collect();
        let plan = World::new(js, ws).decide(&cfg, NOW);
        let row = format!("{n} jobs of {runtime} s, {booting} booting, horizon {horizon}");
        assert_eq!(plan.launches(), want, "{row}: {plan:#?}");
        assert!(plan.held.is_empty(), "{row}: nothing is held back, the jobs ride along");
    }
}

#[test]
fn deadline_jobs_and_gangs_never_ride_along() {
    let mut cfg = cfg();
    cfg.offers.short_job_horizon_s = 120.0;
    let mut js = jobs("s", 3);
    for j in &mut js {
        j.est_runtime_s = Some(5.0);
        j.instances = 2;
    }
    let plan = World::new(js, vec![]).decide(&cfg, NOW);
    assert_eq!(plan.launches(), 6, "gangs: {plan:#?}");
    let mut js = jobs("d", 3);
    for j in &mut js {
        j.est_runtime_s = Some(5.0);
        j.deadline = Some(NOW + 1.0e6);
    }
    let plan = World::new(js, vec![]).decide(&cfg, NOW);
    assert_eq!(plan.launches(), 3, "deadline jobs: {plan:#?}");
}

// ---------------------------------------------------------------------------------------------
// Stopped workers: the keep-alive's second slope.

/// A stopped 1-GPU worker (g5.xlarge spot, $0.10/h), stopped `stopped_for` seconds before
/// [`NOW`], kept stopped until `until`.
fn stopped(id: &str, seq: u64, stopped_for: f64, until: Option<f64>) -> onoff_policy::WorkerView {
    let mut w = worker(id, seq, WorkerState::Stopped, 1, NOW - 7200.0, Some(NOW - stopped_for));
    w.stopped_until = until;
    w
}

/// What the stopped break-even is for a $0.10/h worker at the defaults: the 270 s a start saves
/// over a cold start, at its price plus the wait value, over a 100 GiB gp3 volume's $/h.
const G5_STOPPED_BREAK_EVEN_S: f64 = 270.0 * (0.10 + 1.0) / (100.0 * 0.08 / 730.0);

fn stops(plan: &onoff_policy::Plan) -> Vec<(&str, f64)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::Stop { worker, keep_s, .. } => Some((worker.as_str(), *keep_s)),
            _ => None,
        })
        .collect()
}

fn starts(plan: &onoff_policy::Plan) -> Vec<(&str, Option<&str>, &Reason)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::Start {
                worker, job, reason, ..
            } => Some((worker.as_str(), job.as_deref(), reason)),
            _ => None,
        })
        .collect()
}

#[test]
fn an_idle_worker_past_its_keep_alive_is_stopped_not_terminated() {
    let cfg = stopping_cfg();
    assert!((G5_STOPPED_BREAK_EVEN_S - 27_101.25).abs() < 1e-6);
    assert!((keepalive::stopped_break_even_s(0.10, &cfg) - G5_STOPPED_BREAK_EVEN_S).abs() < 1e-6);
    // Released, it comes back in a start (120 s), not a cold start (390 s): its keep-alive is
    // priced against that, 120 x (1 + 1 / 0.10) = 1,320 s, not 3,600 s.
    // (idle for, stopped)
    for (idle_for, want) in [(1300.0, false), (1321.0, true)] {
        let plan = World::new(vec![], vec![idle("w", 0, idle_for)]).decide(&cfg, NOW);
        assert!(terminated(&plan).is_empty(), "idle {idle_for}: {plan:#?}");
        if want {
            let s = stops(&plan);
            assert_eq!(s.len(), 1, "idle {idle_for}: {plan:#?}");
            // No gaps: kept stopped for the break-even.
            assert_eq!(s[0].0, "w");
            assert!((s[0].1 - G5_STOPPED_BREAK_EVEN_S).abs() < 1e-6, "{s:?}");
            assert!(
                matches!(plan.actions[0].reason(), Reason::KeepAliveExpired { keep_alive_s, .. }
                if (keep_alive_s - 1320.0).abs() < 1e-6)
            );
        } else {
            assert!(plan.actions.is_empty(), "idle {idle_for}: {plan:#?}");
        }
    }
    // Terminated where the configuration does not stop it (the worker is spot), or where a start
    // saves nothing over a cold start; then the keep-alive is priced against a cold start.
    for (mode, restart, idle_for, expect_release) in [
        (onoff_policy::StopIdle::OnDemand, 120.0, 1321.0, false),
        (onoff_policy::StopIdle::OnDemand, 120.0, 3601.0, true),
        (onoff_policy::StopIdle::Never, 120.0, 3601.0, true),
        (onoff_policy::StopIdle::SpotAndOnDemand, 390.0, 3601.0, true),
    ] {
        let mut cfg = stopping_cfg();
        cfg.scale_down.stop_idle = mode;
        cfg.offers.restart_estimate_s = restart;
        let plan = World::new(vec![], vec![idle("w", 0, idle_for)]).decide(&cfg, NOW);
        let row = format!("{mode:?}, restart {restart}, idle {idle_for}");
        assert!(stops(&plan).is_empty(), "{row}: {plan:#?}");
        assert_eq!(terminated(&plan) == vec!["w"], expect_release, "{row}: {plan:#?}");
    }
}

#[test]
fn a_stopped_worker_is_kept_for_its_place_in_line() {
    // Gaps of 120 s, 20 of them (trusted): the stopped worker first in line is needed at the
    // next arrival the idle workers do not take, so it is kept to the gaps' top bucket edge; the
    // one behind it (a worker stopped already is ahead) twice that.
    let mut lo = LaneObservation::default();
    for k in 0..=20 {
        lo.record_arrival(1, NOW - 20_000.0 + 120.0 * k as f64);
    }
    let top = lo.gaps_for(1, 1).unwrap().hist.quantile(1.0).unwrap();
    let cfg = stopping_cfg();
    // (workers stopped already, expected keep of the one stopped now)
    for (ahead, want) in [(0usize, top), (1, 2.0 * top)] {
        let mut ws = vec![idle("w", 0, 3000.0)];
        ws.extend((0..ahead).map(|i| stopped(&format!("s{i}"), 10 + i as u64, 60.0, Some(NOW + 3600.0))));
        let mut w = World::new(vec![], ws);
        w.lanes = vec![lo.clone()];
        let plan = w.decide(&cfg, NOW);
        let s = stops(&plan);
        assert_eq!(s.len(), 1, "{ahead} ahead: {plan:#?}");
        assert!(
            (s[0].1 - want).abs() < 1e-6,
            "{ahead} ahead: keep {} against {want}",
            s[0].1
        );
    }
}

#[test]
fn a_stopped_worker_is_terminated_when_its_keep_ends() {
    // (stopped for, kept until, terminated)
    let rows: &[(f64, Option<f64>, bool)] = &[
        (600.0, Some(NOW + 1.0), false),
        (600.0, Some(NOW), true),
        (600.0, Some(NOW - 1.0), true),
        // No keep recorded: the break-even from its stop.
        (G5_STOPPED_BREAK_EVEN_S - 1.0, None, false),
        (G5_STOPPED_BREAK_EVEN_S + 1.0, None, true),
    ];
    for &(stopped_for, until, want) in rows {
        let plan = World::new(vec![], vec![stopped("s", 0, stopped_for, until)]).decide(&stopping_cfg(), NOW);
        let row = format!("stopped {stopped_for} s, until {until:?}");
        assert_eq!(terminated(&plan) == vec!["s"], want, "{row}: {plan:#?}");
        if want {
            assert!(
                matches!(plan.actions[0].reason(), Reason::StoppedKeepAliveExpired { stopped_s, keep_s }
                    if *stopped_s == stopped_for && stopped_s >= keep_s),
                "{row}: {plan:#?}"
            );
        }
    }
    // Whatever the configuration says of idle workers now: a stopped worker is not kept forever.
    let mut cfg = stopping_cfg();
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::Never;
    let plan = World::new(vec![], vec![stopped("s", 0, 600.0, Some(NOW - 1.0))]).decide(&cfg, NOW);
    assert_eq!(terminated(&plan), vec!["s"]);
}

#[test]
fn unmet_jobs_start_stopped_workers_before_launching() {
    // Three 1-GPU jobs; two stopped 1-GPU workers and a stopped 4-GPU one (too big: no job runs
    // on twice the GPUs it needs): two starts and one launch.
    let ws = vec![
        stopped("s1", 1, 600.0, Some(NOW + 3600.0)),
        stopped("s2", 2, 60.0, Some(NOW + 3600.0)),
        worker("big", 3, WorkerState::Stopped, 4, NOW - 7200.0, Some(NOW - 600.0)),
    ];
    let plan = World::new(jobs("j", 3), ws).decide(&stopping_cfg(), NOW);
    let s = starts(&plan);
    // The most recently stopped first among equals; as a launch, for the lane's activation.
    assert_eq!(s.iter().map(|x| x.0).collect::<Vec<_>>(), vec!["s2", "s1"], "{plan:#?}");
    assert!(s
        .iter()
        .all(|x| x.1.is_none() && *x.2 == Reason::Activation { backlog: 3 }));
    assert_eq!(plan.launches(), 1, "{plan:#?}");
    assert_eq!(plan.starts(), 2);
    // Started workers are capacity like booting ones: nothing is started twice, nothing stopped.
    assert!(stops(&plan).is_empty() && terminated(&plan).is_empty(), "{plan:#?}");
}

#[test]
fn among_equally_cheap_stopped_workers_one_holding_the_projects_cache_is_started_first() {
    // s1 was stopped an hour ago, s2 a minute ago, both g5.xlarge spot: equally cheap per job.
    let with_cache = |w: onoff_policy::WorkerView, projects: &[&str]| onoff_policy::WorkerView {
        cached_projects: projects.iter().map(|p| p.to_string()).collect(),
        ..w
    };
    let g6 = |w: onoff_policy::WorkerView| onoff_policy::WorkerView {
        offering: key(G6, CapacityType::Spot),
        price_usd_per_h: 0.13,
        ..w
    };
    let s1 = || stopped("s1", 1, 3600.0, Some(NOW + 3600.0));
    let s2 = || stopped("s2", 2, 60.0, Some(NOW + 3600.0));
    // (row, stopped workers, jobs, started in order)
    let rows: Vec<(&str, Vec<onoff_policy::WorkerView>, usize, Vec<&str>)> = vec![
        (
            "neither holds it: the most recently stopped",
            vec![s1(), s2()],
            1,
            vec!["s2"],
        ),
        (
            "the older one holds it",
            vec![with_cache(s1(), &["p"]), s2()],
            1,
            vec!["s1"],
        ),
        (
            "among other projects' caches",
            vec![with_cache(s1(), &["q", "p"]), with_cache(s2(), &["q"])],
            1,
            vec!["s1"],
        ),
        (
            "another project's cache counts for nothing",
            vec![with_cache(s1(), &["q"]), s2()],
            1,
            vec!["s2"],
        ),
        (
            "both hold it: the most recently stopped",
            vec![with_cache(s1(), &["p"]), with_cache(s2(), &["p"])],
            1,
            vec!["s2"],
        ),
        (
            "two jobs: the one holding it, then the other",
            vec![with_cache(s1(), &["p"]), s2()],
            2,
            vec!["s1", "s2"],
        ),
        // Cost first: a dearer offering's cache does not outweigh a cheaper start.
        (
            "a dearer worker holding it",
            vec![with_cache(g6(s1()), &["p"]), s2()],
            1,
            vec!["s2"],
        ),
    ];
    for (row, ws, n, want) in rows {
        let plan = World::new(jobs("j", n), ws).decide(&stopping_cfg(), NOW);
        let got: Vec<&str> = starts(&plan).iter().map(|x| x.0).collect();
        assert_eq!(got, want, "{row}: {plan:#?}");
    }
}

#[test]
fn a_stopped_worker_is_started_only_where_a_launch_would_be_worth_it() {
    let mut unavailable = World::new(jobs("j", 1), vec![stopped("s", 1, 60.0, None)]);
    unavailable.unavailable = vec![UnavailableOffering {
        key: key(G5, CapacityType::Spot),
        until: NOW + 100.0,
    }];
    let mut long_job = job("long", 1, NOW - 60.0);
    long_job.est_runtime_s = Some(36_000.0);
    let g6 = worker("s6", 1, WorkerState::Stopped, 1, NOW - 7200.0, Some(NOW - 60.0));
    let g6 = onoff_policy::WorkerView {
        offering: key(G6, CapacityType::Spot),
        price_usd_per_h: 0.13,
        ..g6
    };
    let mut short_job = job("short", 1, NOW - 60.0);
    short_job.est_runtime_s = Some(3600.0);
    let mut frozen = stopping_cfg();
    frozen.limits.frozen = true;
    // Launched in a spot price spike: it bills 0.40 $/h until it ends, four times a launch now.
    let spiked = || {
        vec![onoff_policy::WorkerView {
            price_usd_per_h: 0.40,
            ..stopped("s", 1, 60.0, None)
        }]
    };
    let mut budget = stopping_cfg();
    budget.limits.max_usd_per_h = Some(100.0);
    // (world, config, started)
    let rows: Vec<(&str, World, onoff_policy::PolicyConfig, bool)> = vec![
        // Its type just failed a launch in its zone: a start would fail the same.
        ("unavailable", unavailable, stopping_cfg(), false),
        // A g6 (30 % dearer) for a 10-hour job: started, it costs about $0.29 more than a g5
        // launch, more than the start's 270 s and the launch's wait are worth ($0.125).
        (
            "dearer for a long job",
            World::new(vec![long_job], vec![g6.clone()]),
            stopping_cfg(),
            false,
        ),
        // For a one-hour job the difference, about $0.02, is worth it.
        (
            "dearer for a short job",
            World::new(vec![short_job], vec![g6]),
            stopping_cfg(),
            true,
        ),
        (
            "frozen",
            World::new(jobs("j", 1), vec![stopped("s", 1, 60.0, None)]),
            frozen,
            false,
        ),
        // A start is priced per job from today's offering price, so it is started...
        (
            "spiked, no budget",
            World::new(jobs("j", 1), spiked()),
            stopping_cfg(),
            true,
        ),
        // ...but under a $/h cap the budget booked a launch's price, which it would exceed.
        ("spiked, budget", World::new(jobs("j", 1), spiked()), budget, false),
    ];
    for (row, w, cfg, want) in rows {
        let plan = w.decide(&cfg, NOW);
        assert_eq!(!starts(&plan).is_empty(), want, "{row}: {plan:#?}");
        if !cfg.limits.frozen {
            assert_eq!(
                plan.launches() + plan.starts(),
                1,
                "{row}: one worker either way: {plan:#?}"
            );
        }
    }
}

#[test]
fn a_deadline_at_risk_starts_a_stopped_on_demand_worker_pinned_to_it() {
    let mut j = job("d", 1, NOW - 60.0);
    j.est_runtime_s = Some(3600.0);
    j.deadline = Some(NOW + 3600.0 + 1000.0);
    let od = onoff_policy::WorkerView {
        offering: key(G5, CapacityType::OnDemand),
        price_usd_per_h: 0.50,
        ..worker("od", 1, WorkerState::Stopped, 1, NOW - 7200.0, Some(NOW - 60.0))
    };
    // A stopped spot worker is no use to it; the on-demand one is started for it alone.
    let plan = World::new(vec![j], vec![stopped("spot", 2, 60.0, None), od]).decide(&stopping_cfg(), NOW);
    let s = starts(&plan);
    assert_eq!(s.len(), 1, "{plan:#?}");
    assert_eq!((s[0].0, s[0].1), ("od", Some("d")));
    assert!(matches!(s[0].2, Reason::DeadlineAtRisk { job, .. } if job == "d"));
    assert_eq!(plan.launches(), 0, "{plan:#?}");
}

#[test]
fn the_warm_pool_starts_stopped_workers_before_launching() {
    let mut cfg = stopping_cfg();
    cfg.lanes[0].warm_pool = vec![WarmWindow {
        start_hour: 0,
        end_hour: 24,
        size: 2,
    }];
    let plan = World::new(vec![], vec![stopped("s", 1, 60.0, None)]).decide(&cfg, NOW);
    let s = starts(&plan);
    assert_eq!(s.len(), 1, "{plan:#?}");
    assert!(matches!(s[0].2, Reason::WarmPool { target: 2, ready: 0 }));
    assert_eq!(plan.launches(), 1, "{plan:#?}");
}

#[test]
fn a_job_waiting_for_capacity_starts_a_stopped_worker_within_its_ceiling() {
    // A 10-hour job with g5.xlarge spot out of capacity. A g6.xlarge spot launch costs $0.303
    // more per job than g5 spot (the best, availability ignored); a start of a stopped g6.xlarge
    // about $0.085 less than that launch: the 270 s of wait a start saves over a cold start
    // ($0.075 at 1 $/h) and the boot it does not bill. At 1 $/h the job's wait is worth
    // (waited + 180 s) / 3600 $: a launch is worth it from about 912 s of wait, a start from
    // about 607 s. Until a launch is, the job is held waiting for capacity; a stopped worker
    // within its ceiling is started for it meanwhile.
    // (waited s, with a stopped g6.xlarge, expected: "held", "start" or "launch")
    let rows: &[(f64, bool, &str)] = &[
        (600.0, false, "held"),
        (600.0, true, "held"),
        (650.0, false, "held"),
        (650.0, true, "start"),
        (900.0, false, "held"),
        (900.0, true, "start"),
        (950.0, false, "launch"),
        (950.0, true, "start"),
    ];
    for &(waited, with_stopped, want) in rows {
        let mut j = job("long", 1, NOW - waited);
        j.est_runtime_s = Some(36_000.0);
        let g6 = onoff_policy::WorkerView {
            offering: key(G6, CapacityType::Spot),
            price_usd_per_h: 0.13,
            ..worker("s6", 1, WorkerState::Stopped, 1, NOW - 7200.0, Some(NOW - 60.0))
        };
        let mut w = World::new(vec![j], if with_stopped { vec![g6] } else { vec![] });
        w.unavailable = vec![UnavailableOffering {
            key: key(G5, CapacityType::Spot),
            until: NOW + 100.0,
        }];
        let plan = w.decide(&stopping_cfg(), NOW);
        let row = format!("waited {waited} s, stopped worker {with_stopped}");
        let got = match (plan.launches(), plan.starts()) {
            (0, 0) => "held",
            (0, 1) => "start",
            (1, 0) => "launch",
            _ => panic!("{row}: {plan:#?}"),
        };
        assert_eq!(got, want, "{row}: {plan:#?}");
        let waiting = held_count(&plan, |r| matches!(r, Reason::WaitingForCapacity { .. }));
        assert_eq!(waiting, u32::from(got == "held"), "{row}: {plan:#?}");
        if got == "start" {
            let s = starts(&plan);
            assert_eq!(s[0].0, "s6");
            // Not pinned: the job may take the worker or any other that comes up.
            assert_eq!(s[0].1, None);
        }
    }
    // A job on two instances, with a stopped g6.xlarge and a stopped g5.xlarge (its offering out
    // of capacity, so not startable): not started on one instance and held for the other.
    let mut pair = job("pair", 1, NOW - 1700.0);
    pair.est_runtime_s = Some(36_000.0);
    pair.instances = 2;
    let g6 = onoff_policy::WorkerView {
        offering: key(G6, CapacityType::Spot),
        price_usd_per_h: 0.13,
        ..worker("s6", 1, WorkerState::Stopped, 1, NOW - 7200.0, Some(NOW - 60.0))
    };
    let mut w = World::new(vec![pair], vec![g6, stopped("s5", 2, 60.0, None)]);
    w.unavailable = vec![UnavailableOffering {
        key: key(G5, CapacityType::Spot),
        until: NOW + 100.0,
    }];
    let plan = w.decide(&stopping_cfg(), NOW);
    assert_eq!((plan.launches(), plan.starts()), (0, 0), "{plan:#?}");
}
