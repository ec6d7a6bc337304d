//! Simulator tests on hand-made traces whose costs and waits can be computed by hand.

use std::sync::Arc;

use onoff_policy::{CapacityPreference, CapacityType, KeepAliveMode, LaneConfig, Offering, OfferingKey, PolicyConfig};
use onoff_sim::strategies::{AlwaysOn, PolicyStrategy, SkyPilotLike};
use onoff_sim::{
    assign_deadlines, compare, lower_bound_usd, peak_need, run, MeasuredPreemptions, Preemptions, RunReport, SimConfig,
    Trace, TraceFormat, TraceJob,
};

const T0: f64 = 1_500_000_000.0;

fn offering(ty: &str, cap: CapacityType, gpus: u32, price: f64) -> Offering {
    Offering {
        key: OfferingKey {
            instance_type: ty.into(),
            zone: "us-east-1a".into(),
            capacity_type: cap,
        },
        gpus,
        gpu_model: "NVIDIA T".into(),
        gpu_memory_gib: 24.0,
        vcpus: 8,
        price_usd_per_h: price,
        interruption: None,
    }
}

/// One 1-GPU on-demand type at $1/h and one 4-GPU at $4/h: prices that make hand sums easy.
fn offerings() -> Vec<Offering> {
    vec![
        offering("one.gpu", CapacityType::OnDemand, 1, 1.0),
        offering("four.gpu", CapacityType::OnDemand, 4, 4.0),
    ]
}

fn trace(jobs: &[(f64, f64, u32)]) -> Trace {
    Trace {
        format: TraceFormat::Philly,
        start_unix_s: T0,
        jobs: jobs
            .iter()
            .enumerate()
            .map(|(i, &(arrival_s, duration_s, gpus))| TraceJob {
                id: i as u64,
                arrival_s,
                duration_s,
                gpus,
                project: "p".into(),
            })
            .collect(),
    }
}

/// A world with a fixed boot time and no randomness that matters.
fn sim(boot_s: f64) -> SimConfig {
    SimConfig {
        boot_min_s: boot_s,
        boot_max_s: boot_s,
        capacity_error_rate: 0.0,
        interruptions: false,
        ..SimConfig::default()
    }
}

/// [`sim`] with jobs that declare no run time (`--undeclared-runtimes`).
fn undeclared(boot_s: f64) -> SimConfig {
    SimConfig {
        declared_runtimes: false,
        ..sim(boot_s)
    }
}

/// One lane, fixed idle timeout of `idle_s`, idle workers terminated at it (not stopped: the
/// stopped workers' own test below turns that on).
fn policy(idle_s: f64) -> PolicyConfig {
    // No warm pool (the predictive one off): the sums below follow the keep-alive alone.
    let lane = LaneConfig {
        predictive_max: 0,
        ..LaneConfig::default()
    };
    let mut cfg = PolicyConfig {
        lanes: vec![lane],
        ..PolicyConfig::default()
    };
    cfg.scale_down.mode = KeepAliveMode::Fixed;
    cfg.scale_down.fixed_idle_timeout_s = idle_s;
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::Never;
    cfg.offers.min_gpu_memory_gib = 0.0;
    cfg
}

fn run_policy(t: &Trace, cfg: PolicyConfig, s: &SimConfig) -> RunReport {
    let mut st = PolicyStrategy::new("onoff", cfg);
    run(t, &offerings(), &mut st, s, &mut |_| {})
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn one_job_pays_boot_plus_run_and_waits_for_the_boot() {
    // Arrives at 0, worker boots 300 s, runs 3600 s to 3900 s, then idles out its 600 s keep-alive
    // (released at the tick of 4500 s): billed 4500 s.
    let r = run_policy(&trace(&[(0.0, 3600.0, 1)]), policy(600.0), &sim(300.0));
    assert_eq!(r.jobs_completed, 1);
    assert_eq!(r.jobs_lost, 0);
    assert_eq!(r.launches, 1);
    assert!(close(r.total_usd, 4500.0 / 3600.0), "total {}", r.total_usd);
    assert!(close(r.idle_usd, 600.0 / 3600.0), "idle {}", r.idle_usd);
    assert!(
        close(r.keep_alive_tail_usd, 600.0 / 3600.0),
        "tail {}",
        r.keep_alive_tail_usd
    );
    assert!(close(r.boot_usd, 300.0 / 3600.0), "boot {}", r.boot_usd);
    assert!(close(r.wait_p50_s, 300.0));
}

#[test]
fn a_stopped_worker_bills_its_volume_and_starts_again_in_the_restart_time() {
    // A (0 s, 3,600 s): boot 300 s, runs to 3,900 s, idle 600 s: stopped at the tick of 4,500 s
    // (instance billed 0..4,500 s). B arrives at 10,000 s: the stopped worker is started (100 s,
    // not a 300 s cold start), runs B 10,100..10,700 s, idles 600 s and is stopped at the tick of
    // 11,340 s (billed 10,000..11,340 s). Two arrivals are too few gaps to trust: it is kept
    // stopped for the break-even, 270 s saved x ($1/h + $1/h of waiting) / $0.011/h (the
    // policy's 100 GiB gp3 volume). The volume, $0.01/h here, bills while stopped: 4,500..10,000 s
    // and from 11,340 s to the end of that keep (the replay ends a keep-alive after the last job
    // and bills a stopped worker to its keep, as the policy would terminate it then).
    let mut cfg = policy(600.0);
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::SpotAndOnDemand;
    let s = SimConfig {
        restart_min_s: 100.0,
        restart_max_s: 100.0,
        stopped_usd_per_h: 0.01,
        ..sim(300.0)
    };
    let r = run_policy(&trace(&[(0.0, 3600.0, 1), (10_000.0, 600.0, 1)]), cfg, &s);
    assert_eq!((r.jobs_completed, r.launches, r.restarts), (2, 1, 1));
    // Waits: 300 s for A's cold start, 100 s for B's start.
    assert!(close(r.wait_p99_s, 300.0) && close(r.wait_mean_s, 200.0), "{r:?}");
    let keep: f64 = 270.0 * 2.0 / (100.0 * 0.08 / 730.0);
    let ended = 11_340.0 + keep;
    let stopped_s = (10_000.0 - 4_500.0) + (ended - 11_340.0);
    assert!(
        close(r.stopped_usd, stopped_s * 0.01 / 3600.0),
        "stopped {} over {stopped_s} s",
        r.stopped_usd
    );
    let run_s = 4_500.0 + (11_340.0 - 10_000.0);
    assert!(
        close(r.total_usd, run_s / 3600.0 + stopped_s * 0.01 / 3600.0),
        "total {}",
        r.total_usd
    );
    // Boots billed: 300 s cold, 100 s started.
    assert!(close(r.boot_usd, 400.0 / 3600.0), "boot {}", r.boot_usd);
}

#[test]
fn a_worker_still_stopping_is_started_once_stopped_unless_a_launch_comes_sooner() {
    // A (0 s, 3,600 s) runs 300..3,900 s and is stopped at the tick of 4,500 s. EC2 takes
    // `stopping_s` (120 s here) to stop it. B arriving 20 s after the stop: its start is refused
    // at 4,520 s and at the tick of 4,560 s, held both times (the stop is less than boot -
    // restart, 390 - 120 s, old), and goes through at the tick of 4,620 s: B waits 200 s, not a
    // 300 s cold start. B arriving 200 s after the stop gets the stopped worker at once.
    let mut cfg = policy(600.0);
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::SpotAndOnDemand;
    let s = SimConfig {
        restart_min_s: 100.0,
        restart_max_s: 100.0,
        stopping_s: 120.0,
        ..sim(300.0)
    };
    assert_eq!(
        (cfg.offers.boot_estimate_s, cfg.offers.restart_estimate_s),
        (390.0, 120.0)
    );
    let soon = run_policy(&trace(&[(0.0, 3600.0, 1), (4_520.0, 600.0, 1)]), cfg.clone(), &s);
    assert_eq!(
        (soon.jobs_completed, soon.launches, soon.restarts),
        (2, 1, 1),
        "{soon:?}"
    );
    // A waits its cold start (300 s), B the stop and a start (200 s).
    assert!(
        close(soon.wait_p50_s, 200.0) && close(soon.wait_mean_s, 250.0),
        "B waits the stop and a start: {soon:?}"
    );
    // A stop that outlasts boot - restart: the start held while the stop is recent, then a
    // launch (at the tick of 4,800 s, 300 s after the stop).
    let slow = SimConfig {
        stopping_s: 1_000.0,
        ..s.clone()
    };
    let r = run_policy(&trace(&[(0.0, 3600.0, 1), (4_520.0, 600.0, 1)]), cfg.clone(), &slow);
    assert_eq!((r.jobs_completed, r.launches, r.restarts), (2, 2, 0), "{r:?}");
    assert!(close(r.wait_p99_s, 4_800.0 + 300.0 - 4_520.0), "{r:?}");
    let later = run_policy(&trace(&[(0.0, 3600.0, 1), (4_700.0, 600.0, 1)]), cfg.clone(), &s);
    assert_eq!(
        (later.jobs_completed, later.launches, later.restarts),
        (2, 1, 1),
        "{later:?}"
    );
    // Instant stops (the default): B 20 s after the stop is served by a start.
    let instant = SimConfig { stopping_s: 0.0, ..s };
    let r = run_policy(&trace(&[(0.0, 3600.0, 1), (4_520.0, 600.0, 1)]), cfg, &instant);
    assert_eq!((r.launches, r.restarts), (1, 1), "{r:?}");
}

#[test]
fn a_warm_worker_is_reused_within_the_idle_timeout() {
    // A: 0..600 s of work (runs 300..900), B arrives at 1200: the worker idled 300 s < 600 s.
    let r = run_policy(
        &trace(&[(0.0, 600.0, 1), (1200.0, 600.0, 1)]),
        policy(600.0),
        &sim(300.0),
    );
    assert_eq!(r.launches, 1);
    assert_eq!(r.jobs_completed, 2);
    // Billed from 0 to B's end at 1800 s and its 600 s keep-alive after: 300 + 600 s idle.
    assert!(close(r.total_usd, 2400.0 / 3600.0), "total {}", r.total_usd);
    assert!(close(r.idle_usd, 900.0 / 3600.0), "idle {}", r.idle_usd);
    assert!(close(r.idle_gpu_hours, 900.0 / 3600.0));
    // Waits: 300 s for A, 0 for B.
    assert!(close(r.wait_p50_s, 0.0) || close(r.wait_p50_s, 300.0));
    assert!(close(r.wait_mean_s, 150.0), "mean wait {}", r.wait_mean_s);
}

#[test]
fn past_the_idle_timeout_the_worker_is_released_and_a_new_one_launched() {
    // Idle timeout 120 s, decisions every 60 s: the worker idle from 900 s is released at the
    // first tick with idle >= 120 s (t = 1020 s), B launches a new worker at 2000 s.
    let mut cfg = policy(120.0);
    cfg.anti_thrash.scale_down_delay_after_scale_up_s = 0.0;
    let r = run_policy(&trace(&[(0.0, 600.0, 1), (2000.0, 600.0, 1)]), cfg, &sim(300.0));
    assert_eq!(r.launches, 2);
    assert_eq!(r.busy_terminations, 0);
    // First worker 0..1020 s, second 2000..3060 s (B ends at 2900 s; the tick of 3000 s finds it
    // idle 100 s, the one of 3060 s 160 s).
    assert!(close(r.total_usd, (1020.0 + 1060.0) / 3600.0), "total {}", r.total_usd);
}

#[test]
fn a_fleet_cap_below_the_demand_queues_jobs_and_the_report_names_the_cap() {
    // Three 1-hour jobs at 0 s, boot 300 s. Capped at one worker, they run one after another on it
    // (waits 300, 3,900 and 7,500 s) and the decisions that held the other two name the cap; with
    // room for three, each waits its boot and no limit bound.
    let jobs = trace(&[(0.0, 3600.0, 1), (0.0, 3600.0, 1), (0.0, 3600.0, 1)]);
    // (fleet cap, launches, wait p50, p99, limits that held launches)
    let rows: &[(u32, u64, f64, f64, &[&str])] =
        &[(1, 1, 3900.0, 7500.0, &["max workers 1"]), (3, 3, 300.0, 300.0, &[])];
    for &(cap, launches, p50, p99, limits) in rows {
        let mut cfg = policy(600.0);
        cfg.limits.max_workers_total = cap;
        let r = run_policy(&jobs, cfg, &sim(300.0));
        assert_eq!((r.jobs_completed, r.launches), (3, launches), "cap {cap}");
        assert!(close(r.wait_p50_s, p50) && close(r.wait_p99_s, p99), "cap {cap}: {r:?}");
        let held: Vec<&str> = r.held_by_limit.keys().map(String::as_str).collect();
        assert_eq!(held, limits, "cap {cap}");
        // Held from the first decision after the first launch until the third job started.
        for (limit, &n) in &r.held_by_limit {
            assert!(n >= 2 && n <= r.decisions, "{limit}: {n} of {} decisions", r.decisions);
        }
    }
}

#[test]
fn ec2_bills_a_60_second_minimum() {
    // Zero boot, a 10 s job: billed 60 s. Its keep-alive released at once (the idle timeout of
    // 0 s at the first tick, 60 s) leaves it at the minimum.
    let r = run_policy(&trace(&[(0.0, 10.0, 1)]), policy(0.0), &sim(0.0));
    assert!(close(r.total_usd, 60.0 / 3600.0), "total {}", r.total_usd);
    // With a 600 s keep-alive it idles from 10 s to the tick of 660 s.
    let r = run_policy(&trace(&[(0.0, 10.0, 1)]), policy(600.0), &sim(0.0));
    assert!(close(r.total_usd, 660.0 / 3600.0), "total {}", r.total_usd);
}

#[test]
fn a_job_runs_on_an_instance_with_enough_gpus() {
    // A 3-GPU job needs the 4-GPU type ($4/h): 300 s boot + 3600 s run + 600 s keep-alive.
    let r = run_policy(&trace(&[(0.0, 3600.0, 3)]), policy(600.0), &sim(300.0));
    assert!(close(r.total_usd, 4.0 * 4500.0 / 3600.0), "total {}", r.total_usd);
    let lb = lower_bound_usd(&trace(&[(0.0, 3600.0, 3)]), &offerings(), &policy(600.0), &sim(300.0)).unwrap();
    assert!(close(lb, 4.0));
}

#[test]
fn the_bill_is_split_per_offering_and_adds_up_to_the_total() {
    // A 1-GPU job (one.gpu, $1/h) and a 3-GPU one (four.gpu, $4/h), apart: each worker is billed
    // 300 s boot + 3600 s run + 600 s keep-alive.
    let r = run_policy(
        &trace(&[(0.0, 3600.0, 1), (0.0, 3600.0, 3)]),
        policy(600.0),
        &sim(300.0),
    );
    let spend: Vec<(&str, f64, f64)> = r
        .spend_by_offering
        .iter()
        .map(|(k, s)| (k.as_str(), s.usd, s.instance_hours))
        .collect();
    assert_eq!(spend.len(), 2, "{spend:?}");
    assert_eq!((spend[0].0, spend[1].0), ("four.gpu/on-demand", "one.gpu/on-demand"));
    assert!(
        close(spend[0].1, 4.0 * 4500.0 / 3600.0) && close(spend[0].2, 4500.0 / 3600.0),
        "{spend:?}"
    );
    assert!(
        close(spend[1].1, 4500.0 / 3600.0) && close(spend[1].2, 4500.0 / 3600.0),
        "{spend:?}"
    );
    assert!(close(spend.iter().map(|s| s.1).sum::<f64>(), r.total_usd));
}

#[test]
fn a_job_of_a_size_the_catalogue_lacks_runs_on_the_next_size_up() {
    // 2 GPUs, and this world has 1- and 4-GPU types only: the fit rule alone (a 2-GPU job on at
    // most 2-GPU instances) would leave it waiting for ever; it runs on the 4-GPU type ($4/h), 300 s
    // boot + 3600 s run, and the lower bound and the always-on fleet count it as a 4-GPU job.
    let t = trace(&[(0.0, 3600.0, 2), (10.0, 3600.0, 2)]);
    let r = run_policy(&t, policy(600.0), &sim(300.0));
    assert_eq!((r.jobs_completed, r.jobs_lost, r.launches), (2, 0, 2));
    // The first worker 0..4500 s (its job ends at 3900 s, released at the first tick 600 s
    // later), the second 10..4560 s (its job ends at 3910 s, the tick of 4500 s finds it idle
    // 590 s).
    assert!(
        close(r.total_usd, 4.0 * (4500.0 + 4550.0) / 3600.0),
        "total {}",
        r.total_usd
    );
    let lb = lower_bound_usd(&t, &offerings(), &policy(600.0), &sim(300.0)).unwrap();
    assert!(close(lb, 8.0), "lower bound {lb}");
    assert_eq!(
        peak_need(&t, &offerings(), &policy(600.0), &sim(300.0))
            .into_iter()
            .collect::<Vec<_>>(),
        [(4, 2)]
    );
}

#[test]
fn multi_instance_jobs_use_several_instances_at_once() {
    // 10 GPUs with at most 4 per instance in this world: 3 instances of 4 GPUs.
    let mut s = sim(0.0);
    s.max_gpus_per_instance = 4;
    let t = trace(&[(0.0, 3600.0, 10)]);
    let r = run_policy(&t, policy(600.0), &s);
    assert_eq!(r.launches, 3);
    // Three $4/h instances for the hour's job and a 600 s keep-alive.
    assert!(close(r.total_usd, 3.0 * 4.0 * 4200.0 / 3600.0), "total {}", r.total_usd);
    assert!(close(
        lower_bound_usd(&t, &offerings(), &policy(600.0), &s).unwrap(),
        12.0
    ));
}

#[test]
fn always_on_holds_the_peak_for_the_whole_run() {
    // Two overlapping 1-GPU jobs (peak 2), last completion at 7200 s: 2 x $1/h x 2 h. A fleet
    // never released is billed to the last completion, with no keep-alive after it.
    let t = trace(&[(0.0, 3600.0, 1), (1800.0, 5400.0, 1)]);
    let s = sim(0.0);
    assert_eq!(peak_need(&t, &offerings(), &policy(600.0), &s).get(&1), Some(&2));
    let mut st = AlwaysOn::new(policy(600.0), peak_need(&t, &offerings(), &policy(600.0), &s));
    let r = run(&t, &offerings(), &mut st, &s, &mut |_| {});
    assert_eq!(r.jobs_completed, 2);
    assert!(close(r.total_usd, 4.0), "total {}", r.total_usd);
    assert_eq!(r.keep_alive_tail_usd, 0.0);
    assert!(close(r.wait_p95_s, 0.0));
}

#[test]
fn after_the_last_job_each_worker_is_billed_until_its_keep_alive_releases_it() {
    // A stream of 10 s items every 20 s for an hour, then nothing; boots of 15 s, so one worker
    // serves it all. The adaptive keep-alive has learnt gaps of 20 s: after the last item it
    // releases the worker at the first tick past the minimum keep-alive (60 s), where a fixed
    // 10-minute timeout bills 540 s more idle. During the stream both run the same worker.
    let jobs: Vec<(f64, f64, u32)> = (0..180).map(|i| (f64::from(i) * 20.0, 10.0, 1)).collect();
    let t = trace(&jobs);
    let s = sim(15.0);
    let fixed = run_policy(&t, policy(600.0), &s);
    let mut adaptive = policy(600.0);
    adaptive.scale_down = onoff_policy::ScaleDownConfig {
        stop_idle: onoff_policy::StopIdle::Never,
        ..Default::default()
    };
    let adaptive = run_policy(&t, adaptive, &s);
    for r in [&fixed, &adaptive] {
        assert_eq!((r.jobs_completed, r.launches), (180, 1), "{r:?}");
    }
    assert_eq!(fixed.makespan_s, adaptive.makespan_s);
    assert_eq!(fixed.wait_p95_s, adaptive.wait_p95_s);
    // The last item ends at makespan; the fixed timeout's worker is released at the first tick
    // (every 60 s from 0) with 600 s idle, the adaptive one's at the first with 60 s.
    let last = fixed.makespan_s;
    let release = |idle_s: f64| ((last + idle_s) / 60.0).ceil() * 60.0;
    assert!(close(fixed.total_usd, release(600.0) / 3600.0), "{}", fixed.total_usd);
    assert!(
        close(adaptive.total_usd, release(60.0) / 3600.0),
        "{}",
        adaptive.total_usd
    );
    // The report names that part of the bill ($1/h).
    for (r, idle_s) in [(&fixed, 600.0), (&adaptive, 60.0)] {
        let tail = (release(idle_s) - last) / 3600.0;
        assert!(close(r.keep_alive_tail_usd, tail), "{} {}", r.keep_alive_tail_usd, tail);
    }
}

#[test]
fn a_warm_pool_held_past_the_last_job_is_billed_to_the_longest_keep_alive_and_no_further() {
    // A scheduled warm pool of one worker all day: after the last job it is never released, so the
    // replay stops at the last completion plus the longest keep-alive (3,600 s by default) and one
    // decision interval (60 s), and retires it there. One job (0 s, 600 s), boots of 300 s: the
    // worker launched for it is the one the pool holds.
    let mut cfg = policy(600.0);
    cfg.scale_down = onoff_policy::ScaleDownConfig {
        stop_idle: onoff_policy::StopIdle::Never,
        ..Default::default()
    };
    cfg.lanes[0].warm_pool = vec![onoff_policy::WarmWindow {
        start_hour: 0,
        end_hour: 24,
        size: 1,
    }];
    let r = run_policy(&trace(&[(0.0, 600.0, 1)]), cfg, &sim(300.0));
    assert_eq!((r.jobs_completed, r.launches), (1, 1), "{r:?}");
    assert!(close(r.makespan_s, 900.0), "{}", r.makespan_s);
    let tail = 3600.0 + 60.0;
    assert!(close(r.total_usd, (900.0 + tail) / 3600.0), "{}", r.total_usd);
    assert!(close(r.keep_alive_tail_usd, tail / 3600.0), "{}", r.keep_alive_tail_usd);
}

#[test]
fn spot_interruptions_lose_at_most_the_work_since_the_last_checkpoint() {
    let spot = vec![Offering {
        interruption: Some(onoff_policy::InterruptionBucket::Over20),
        ..offering("one.gpu", CapacityType::Spot, 1, 0.3)
    }];
    let t = trace(&[
        (0.0, 20.0 * 3600.0, 1),
        (0.0, 20.0 * 3600.0, 1),
        (60.0, 10.0 * 3600.0, 1),
    ]);
    let s = SimConfig {
        interruptions: true,
        interruption_rate_factor: 2000.0,
        ..sim(300.0)
    };
    let mut st = PolicyStrategy::new("onoff", policy(600.0));
    let r = run(&t, &spot, &mut st, &s, &mut |_| {});
    assert!(r.interruptions > 0, "the stress factor should interrupt");
    assert_eq!(r.jobs_completed + r.jobs_lost, 3);
    assert_eq!(r.jobs_lost, 0);
    // Each interruption loses less than one checkpoint interval on one GPU.
    assert!(r.lost_work_gpu_hours <= r.interruptions as f64 * s.checkpoint_interval_s / 3600.0 + 1e-9);
    // Checkpointing on the notice loses nothing.
    let s2 = SimConfig {
        checkpoint_on_notice: true,
        ..s
    };
    let r2 = run(
        &t,
        &spot,
        &mut PolicyStrategy::new("onoff", policy(600.0)),
        &s2,
        &mut |_| {},
    );
    assert!(r2.interruptions > 0);
    assert!(close(r2.lost_work_gpu_hours, 0.0));
    assert_eq!(r2.jobs_lost, 0);
}

#[test]
fn every_policy_finishes_the_shipped_short_slice_and_onoff_never_kills_a_busy_worker() {
    let t = Trace::load(
        std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/philly/philly-short.csv"
        )),
        Default::default(),
    )
    .unwrap();
    let offerings = onoff_control::catalog::load_offerings_from_dir(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/catalog")),
        &Default::default(),
    )
    .unwrap();
    let mut cfg = PolicyConfig::default();
    cfg.limits.max_workers_total = 1000;
    cfg.lanes.iter_mut().for_each(|l| l.max_workers = 1000);
    let s = SimConfig::default();
    let c = compare(
        "short",
        &t,
        &offerings,
        &cfg,
        &s,
        &onoff_sim::STRATEGIES,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(c.policies.len(), onoff_sim::STRATEGIES.len());
    for p in &c.policies {
        assert_eq!(p.jobs_completed + p.jobs_lost, t.jobs.len() as u64, "{}", p.name);
        assert_eq!(p.jobs_lost, 0, "{} lost jobs", p.name);
        assert!(
            p.total_usd >= c.lower_bound_usd * 0.999,
            "{} below the lower bound",
            p.name
        );
    }
    let onoff = &c.policies[0];
    assert_eq!(onoff.name, "onoff");
    assert_eq!(onoff.busy_terminations, 0);
    // Same seed, same result.
    let again = compare("short", &t, &offerings, &cfg, &s, &["onoff"], &mut |_, _| {}).unwrap();
    assert_eq!(again.policies[0].total_usd, onoff.total_usd);
    assert_eq!(again.policies[0].launches, onoff.launches);
}

fn spot(ty: &str, gpu_model: &str, price: f64) -> Offering {
    Offering {
        gpu_model: gpu_model.into(),
        interruption: Some(onoff_policy::InterruptionBucket::Under5),
        ..offering(ty, CapacityType::Spot, 1, price)
    }
}

/// One 1-GPU type, spot at $0.30/h and on-demand at $1/h.
fn spot_and_on_demand() -> Vec<Offering> {
    vec![
        spot("one.gpu", "NVIDIA T", 0.3),
        offering("one.gpu", CapacityType::OnDemand, 1, 1.0),
    ]
}

#[test]
fn a_deadline_is_missed_when_the_job_ends_after_it() {
    // Deadline = arrival + 1.2 x run time. A (0 s, 1,000 s) waits for a 300 s boot and ends at
    // 1,300 s, after its deadline at 1,200 s. B (5,000 s, 1,000 s) starts at once on the worker
    // kept warm (idle timeout 10,000 s) and ends at 6,000 s, before 6,200 s.
    let t = trace(&[(0.0, 1000.0, 1), (5000.0, 1000.0, 1)]);
    let s = SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: 1.2,
        ..sim(300.0)
    };
    let r = run_policy(&t, policy(10_000.0), &s);
    assert_eq!(r.jobs_completed, 2);
    assert_eq!(r.deadline_jobs, 2);
    assert_eq!(r.deadlines_missed, 1);
    // Both leave 200 s of slack, less than the 300 s cold start: only a warm worker meets them.
    assert_eq!(r.deadlines_need_warm, 2);
    assert_eq!((r.deadlines_with_slack, r.deadlines_missed_with_slack), (0, 0));
    // With slack 1.5 (500 s, more than the cold start) the same jobs are both met.
    let roomy = SimConfig {
        deadline_slack: 1.5,
        ..s.clone()
    };
    let r = run_policy(&t, policy(10_000.0), &roomy);
    assert_eq!((r.deadlines_missed, r.deadlines_need_warm), (0, 0));
    assert_eq!((r.deadlines_with_slack, r.deadlines_missed_with_slack), (2, 0));
    // With half the jobs given a deadline, the seed picks which: A's is missed, B's is met.
    let half = SimConfig {
        deadline_fraction: 0.5,
        ..s.clone()
    };
    let d = assign_deadlines(&t, 0.5, 1.2, half.seed);
    assert_eq!(d.iter().flatten().count(), 1);
    let r = run_policy(&t, policy(10_000.0), &half);
    assert_eq!(r.deadline_jobs, 1);
    assert_eq!(r.deadlines_missed, u64::from(d[0] == Some(1200.0)));
    assert!(d[0] == Some(1200.0) || d[1] == Some(6200.0), "{d:?}");
    // No deadlines, nothing measured.
    let r = run_policy(&t, policy(10_000.0), &sim(300.0));
    assert_eq!((r.deadline_jobs, r.deadlines_missed), (0, 0));
}

#[test]
fn deadlines_are_seeded_exact_in_count_and_due_slack_times_the_run_time() {
    let t = trace(&(0..1000).map(|i| (i as f64, 100.0 + i as f64, 1)).collect::<Vec<_>>());
    let a = assign_deadlines(&t, 0.3, 1.5, 7);
    assert_eq!(a, assign_deadlines(&t, 0.3, 1.5, 7));
    assert_ne!(a, assign_deadlines(&t, 0.3, 1.5, 8));
    assert_eq!(a.iter().flatten().count(), 300);
    for (j, d) in t.jobs.iter().zip(&a) {
        if let Some(d) = d {
            assert!((d - (j.arrival_s + 1.5 * j.duration_s)).abs() < 1e-9);
        }
    }
    // The chosen jobs are spread over the trace, not its head.
    assert!(a[..500].iter().flatten().count() > 100 && a[500..].iter().flatten().count() > 100);
    assert_eq!(assign_deadlines(&t, 0.0, 1.5, 7).iter().flatten().count(), 0);
    assert_eq!(assign_deadlines(&t, 1.0, 1.5, 7).iter().flatten().count(), 1000);
}

#[test]
fn the_policy_sees_deadlines_and_all_on_demand_prices_what_spot_saved() {
    // Spot at $0.30/h and on-demand at $1/h. A job whose deadline leaves no slack for a spot
    // interruption goes on-demand (the policy's deadline rule); with ample slack it goes on spot.
    let offs = spot_and_on_demand();
    let t = trace(&[(0.0, 3600.0, 1)]);
    let with_slack = |slack: f64| SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: slack,
        ..sim(300.0)
    };
    let run_with = |s: &SimConfig| {
        let mut st = PolicyStrategy::new("onoff", policy(600.0));
        run(&t, &offs, &mut st, s, &mut |_| {})
    };
    let tight = run_with(&with_slack(1.1));
    assert_eq!(
        tight.launches_by_offering.keys().collect::<Vec<_>>(),
        ["one.gpu/on-demand"]
    );
    assert!(close(tight.on_demand_usd, tight.total_usd));
    let loose = run_with(&with_slack(100.0));
    assert_eq!(loose.launches_by_offering.keys().collect::<Vec<_>>(), ["one.gpu/spot"]);
    assert_eq!(loose.on_demand_usd, 0.0);
    assert_eq!(loose.deadlines_missed, 0);

    // compare() adds all-on-demand and prices every policy against it: 4,500 s (with the 600 s
    // keep-alive) at $0.30 against 4,500 s at $1.
    let c = compare(
        "t",
        &t,
        &offs,
        &policy(600.0),
        &with_slack(100.0),
        &["onoff"],
        &mut |_, _| {},
    )
    .unwrap();
    let names: Vec<&str> = c.policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["onoff", "all-on-demand"]);
    assert!(close(c.all_on_demand_usd.unwrap(), 4500.0 / 3600.0));
    assert!(close(c.policies[0].cost_vs_all_on_demand.unwrap(), 0.3));
    assert!(close(c.policies[1].cost_vs_all_on_demand.unwrap(), 1.0));
    // Without deadlines neither the extra run nor the ratio.
    let c = compare("t", &t, &offs, &policy(600.0), &sim(300.0), &["onoff"], &mut |_, _| {}).unwrap();
    assert_eq!(c.policies.len(), 1);
    assert_eq!(c.policies[0].cost_vs_all_on_demand, None);
}

#[test]
fn an_idle_on_demand_worker_of_a_spot_first_lane_takes_only_the_jobs_its_premium_is_worth() {
    // As below: A (0 s, 10,000 s) runs on spot; B (10,400 s, 1,600 s), its deadline at risk,
    // gets an on-demand worker of its own, idle from 12,300 s (keep-alive 10,000 s). A's spot
    // worker is released at about 20,300 s. C (21,000 s, 10,000 s; 5,000 s of slack, not at
    // risk) finds only the on-demand worker idle: on it C would pay $1.94 more than on spot, far
    // more than a spot launch's boot and wait are worth (about $0.14), so it waits 300 s for a
    // spot worker of its own, as onoff's agent on that worker would hand it back.
    let offs = spot_and_on_demand();
    let t = trace(&[(0.0, 10_000.0, 1), (10_400.0, 1_600.0, 1), (21_000.0, 10_000.0, 1)]);
    let s = SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: 1.5,
        ..sim(300.0)
    };
    let mut st = PolicyStrategy::new("onoff", policy(10_000.0));
    let r = run(&t, &offs, &mut st, &s, &mut |_| {});
    assert_eq!((r.jobs_completed, r.deadlines_missed), (3, 0));
    let launched: Vec<(&str, u64)> = r.launches_by_offering.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(launched, [("one.gpu/on-demand", 1), ("one.gpu/spot", 2)]);
    assert!(
        close(r.wait_p99_s, 300.0) && close(r.wait_p50_s, 300.0),
        "C waited {} s",
        r.wait_p99_s
    );
    // The on-demand worker ran B alone: billed from 10,400 s to its release after its keep-alive.
    let od = r.spend_by_offering["one.gpu/on-demand"];
    assert!(od.instance_hours < 12_000.0 / 3600.0, "{od:?}");
}

/// The agent on a worker counts an undeclared job's run time as the estimate its worker's row
/// was given at launch (`WorkerRecord::run_time_estimate_s`), the figure the policy decides with,
/// and the simulator's dispatch does as the agent does. Run times undeclared, deadlines at 8 x
/// the run time, the lane's prior 600 s. A (0 s, 1,000 s) runs on spot (boot 300 s) until
/// 1,300 s; its worker, launched while the lane's estimate was the prior, stays up. B (1,400 s,
/// 600 s) is due at 6,200 s: 4,200 s of slack counted with 600 s, over the 1,590 s a spot start
/// needs, so the spot worker's agent runs it at once. With the agent counting the policy's
/// default (3,600 s) instead, B's slack would be 1,200 s: handed back until that count says
/// the deadline is lost (2,600 s), B started at the next decision, 2,640 s, a 1,240 s wait.
#[test]
fn the_agent_counts_an_undeclared_jobs_run_time_as_its_rows_estimate_and_runs_it_on_spot() {
    let offs = spot_and_on_demand();
    let t = trace(&[(0.0, 1_000.0, 1), (1_400.0, 600.0, 1)]);
    let s = SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: 8.0,
        ..undeclared(300.0)
    };
    let mut cfg = policy(10_000.0);
    cfg.lanes[0].default_runtime_s = Some(600.0);
    let mut st = PolicyStrategy::new("onoff", cfg);
    let r = run(&t, &offs, &mut st, &s, &mut |_| {});
    assert_eq!((r.jobs_completed, r.deadlines_missed), (2, 0), "{r:?}");
    let launched: Vec<(&str, u64)> = r.launches_by_offering.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(launched, [("one.gpu/spot", 1)], "B ran on A's spot worker");
    // A waited its boot (300 s), B nothing.
    assert!(
        close(r.wait_p99_s, 300.0) && close(r.wait_p50_s, 0.0),
        "waits {} / {} s",
        r.wait_p50_s,
        r.wait_p99_s
    );
}

/// A worker launched before its lane had an estimate (no job finished, no prior) is given the
/// lane's once there is one, as the reconciler writes it on rows without one, and its agent
/// counts with it at its next undeclared job. Run times undeclared, deadlines at 8 x the run
/// time. Five A (0 s, 1,000 s) run on five spot workers (boot 300 s) until 1,300 s; the lane's
/// estimate is then 1,000 s. B (1,400 s, 600 s) is due at 6,200 s: 3,800 s of slack counted with
/// 1,000 s, over the 1,590 s a spot start needs, so an idle spot worker's agent runs it at once.
/// Counted with the default hour, B would have 1,200 s: handed back until that count says its
/// deadline is lost (2,600 s), started at 2,640 s.
#[test]
fn a_worker_launched_before_its_lane_had_an_estimate_counts_with_the_one_it_is_given_later() {
    let offs = spot_and_on_demand();
    let mut jobs = vec![(0.0, 1_000.0, 1); 5];
    jobs.push((1_400.0, 600.0, 1));
    let s = SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: 8.0,
        ..undeclared(300.0)
    };
    let mut st = PolicyStrategy::new("onoff", policy(10_000.0));
    let r = run(&trace(&jobs), &offs, &mut st, &s, &mut |_| {});
    assert_eq!((r.jobs_completed, r.deadlines_missed), (6, 0), "{r:?}");
    let launched: Vec<(&str, u64)> = r.launches_by_offering.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        launched,
        [("one.gpu/spot", 5)],
        "B ran on a spot worker of the first five"
    );
    // Five waited their boot, 300 s; B nothing.
    assert!(close(r.wait_mean_s, 250.0), "mean wait {} s", r.wait_mean_s);
}

#[test]
fn a_job_whose_deadline_is_at_risk_waits_for_on_demand_rather_than_an_idle_spot_worker() {
    // Deadlines at 1.5 x the run time. A (0 s, 10,000 s) has 5,000 s of slack, over the policy's
    // 1,980 s threshold: it runs on spot (boot 300 s) until 10,300 s, and its worker stays up
    // (idle timeout 10,000 s). B (10,400 s, 1,600 s) has 800 s of slack: at risk on spot, and a
    // cold start (390 s estimated) still fits. It does not take the idle spot worker: on-demand
    // capacity is launched for it and it starts at 10,700 s, meeting its deadline (12,800 s).
    let offs = spot_and_on_demand();
    let t = trace(&[(0.0, 10_000.0, 1), (10_400.0, 1_600.0, 1)]);
    let s = SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: 1.5,
        ..sim(300.0)
    };
    let mut st = PolicyStrategy::new("onoff", policy(10_000.0));
    let r = run(&t, &offs, &mut st, &s, &mut |_| {});
    assert_eq!(r.jobs_completed, 2);
    assert_eq!(r.deadlines_missed, 0);
    let launched: Vec<(&str, u64)> = r.launches_by_offering.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(launched, [("one.gpu/on-demand", 1), ("one.gpu/spot", 1)]);
    // Both waited one boot; the on-demand worker is billed from 10,400 s to B's end at 12,300 s
    // and then its 10,000 s keep-alive, to the tick of 22,320 s.
    assert!(
        close(r.wait_p50_s, 300.0) && close(r.wait_p99_s, 300.0),
        "{} {}",
        r.wait_p50_s,
        r.wait_p99_s
    );
    assert!(
        close(r.on_demand_usd, 11_920.0 / 3600.0),
        "on-demand ${}",
        r.on_demand_usd
    );
    // A baseline's workers do not run onoff's agent: skypilot-like's idle spot worker (up 100 s
    // of its 5-minute autostop) takes B at once.
    let r = run(&t, &offs, &mut SkyPilotLike::new(policy(600.0)), &s, &mut |_| {});
    assert_eq!((r.jobs_completed, r.launches, r.on_demand_usd), (2, 1, 0.0));
    assert!(close(r.wait_p50_s, 0.0), "B waited {} s", r.wait_p50_s);
    // With S 1.1875, B (12,400 s, 1,600 s) has 300 s of slack, less than a cold start when it
    // queued: no launch can meet it, the spot worker A (12,000 s, slack 2,250 s) leaves idle at
    // 12,300 s can, and B takes it at once.
    let t = trace(&[(0.0, 12_000.0, 1), (12_400.0, 1_600.0, 1)]);
    let s = SimConfig {
        deadline_slack: 1.1875,
        ..s
    };
    let mut st = PolicyStrategy::new("onoff", policy(10_000.0));
    let r = run(&t, &offs, &mut st, &s, &mut |_| {});
    assert_eq!(r.deadlines_missed, 0);
    assert_eq!(r.on_demand_usd, 0.0, "{:?}", r.launches_by_offering);
    assert_eq!(r.launches, 1, "{:?}", r.launches_by_offering);
}

#[test]
fn the_workers_launched_for_a_multi_instance_job_are_held_for_it_until_all_are_up() {
    // 1-GPU types only, so B (2 GPUs) runs on two instances. Deadlines at 1.5 x the run time.
    // A (0 s, 10,000 s) runs on spot to 10,300 s; its worker idles (idle timeout 10,000 s) but B
    // may not use spot: B (10,400 s, 1,600 s, 800 s of slack) gets two on-demand instances pinned
    // to it, up at 10,700 s. C (10,450 s, 10,000 s, ample slack) finds A's idle spot worker and
    // starts at once. D (10,460 s, 10,000 s) gets a spot launch of its own, up at 10,760 s. When
    // B's first instance boots it is held for B (not handed to a job queued behind it), and B
    // starts on both at 10,700 s: every wait is 0 or one boot, no deadline missed.
    let offs = spot_and_on_demand();
    let t = trace(&[
        (0.0, 10_000.0, 1),
        (10_400.0, 1_600.0, 2),
        (10_450.0, 10_000.0, 1),
        (10_460.0, 10_000.0, 1),
    ]);
    let s = SimConfig {
        deadline_fraction: 1.0,
        deadline_slack: 1.5,
        max_gpus_per_instance: 1,
        ..sim(300.0)
    };
    let mut st = PolicyStrategy::new("onoff", policy(10_000.0));
    let r = run(&t, &offs, &mut st, &s, &mut |_| {});
    assert_eq!(r.jobs_completed, 4);
    assert_eq!(r.deadlines_missed, 0);
    assert_eq!(
        r.launches_by_offering.get("one.gpu/on-demand"),
        Some(&2),
        "{:?}",
        r.launches_by_offering
    );
    assert!(close(r.wait_p99_s, 300.0), "p99 wait {} s", r.wait_p99_s);
}

/// One zone `us-east-1a` whose spot is unavailable from 1,000 s to 1,500 s of every 11,500 s
/// (ticks of 100 s: 10 available, 5 unavailable, 100 available).
fn measured() -> Preemptions {
    let mut v = vec![0; 10];
    v.extend([1; 5]);
    v.extend([0; 100]);
    Preemptions::Measured(Arc::new(
        MeasuredPreemptions::from_series("hand-made", &[("us-east-1a", 100.0, v)]).unwrap(),
    ))
}

#[test]
fn a_measured_outage_interrupts_spot_and_refuses_spot_launches_while_it_lasts() {
    // Spot only, $0.30/h; one job of 3,600 s at 0. The worker boots until 300 s and runs the job;
    // at 1,000 s the zone turns unavailable: notice (the job is released with its 600 s
    // checkpoint, 100 s of work lost) and interruption at 1,120 s. The notice marks the offering
    // unavailable until 1,180 s; the ticks at 1,200 and 1,380 s try spot and are refused (the zone
    // is out until 1,500 s), each refusal skipping the offering 180 s more; the tick at 1,560 s
    // launches; the new worker is ready at 1,860 s and runs the remaining 3,000 s to 4,860 s.
    let offs = vec![spot("one.gpu", "NVIDIA T", 0.3)];
    let mut cfg = policy(600.0);
    cfg.lanes[0].capacity = CapacityPreference::SpotOnly;
    let s = SimConfig {
        preemptions: measured(),
        interruptions: true,
        ..sim(300.0)
    };
    let t = trace(&[(0.0, 3600.0, 1)]);
    let mut st = PolicyStrategy::new("onoff", cfg.clone());
    let r = run(&t, &offs, &mut st, &s, &mut |_| {});
    assert_eq!(r.jobs_completed, 1);
    assert_eq!(r.interruptions, 1);
    assert_eq!(r.spot_unavailable_errors, 2);
    assert_eq!(r.capacity_errors, 2);
    assert_eq!(r.launches, 2);
    assert!(
        close(r.lost_work_gpu_hours, 100.0 / 3600.0),
        "{}",
        r.lost_work_gpu_hours
    );
    assert!(close(r.makespan_s, 4860.0), "{}", r.makespan_s);
    // Billed 0..1,120 s and 1,560..5,460 s (the job ends at 4,860 s, then 600 s of keep-alive)
    // at $0.30/h.
    assert!(close(r.total_usd, 0.3 * (1120.0 + 3900.0) / 3600.0), "{}", r.total_usd);

    // The same world with the advisor model and no interruptions: one worker, no refusal.
    let calm = SimConfig {
        interruptions: false,
        ..sim(300.0)
    };
    let r = run(
        &t,
        &offs,
        &mut PolicyStrategy::new("onoff", cfg.clone()),
        &calm,
        &mut |_| {},
    );
    assert_eq!((r.interruptions, r.capacity_errors, r.launches), (0, 0, 1));

    // A job arriving inside the outage (1,100 s) is refused on arrival and at the tick of
    // 1,320 s (skipped 180 s after each refusal); the tick of 1,500 s, when the zone is back,
    // launches it: ready at 1,800 s, a 700 s wait.
    let late = trace(&[(1100.0, 600.0, 1)]);
    let r = run(&late, &offs, &mut PolicyStrategy::new("onoff", cfg), &s, &mut |_| {});
    assert_eq!(r.spot_unavailable_errors, 2);
    assert!(close(r.wait_p50_s, 700.0), "waited {} s", r.wait_p50_s);
}

#[test]
fn skypilot_like_takes_the_cheapest_spot_per_hour_and_stops_idle_instances_after_5_minutes() {
    // Spot A: $0.30/h at reference speed; spot B: $0.50/h on a GPU twice as fast (cheaper per
    // job: $0.25 against $0.30 for an hour of work); on-demand $1/h. SkyPilot ranks by $/h: A.
    let offs = vec![
        spot("slow.gpu", "NVIDIA T", 0.3),
        spot("fast.gpu", "NVIDIA F", 0.5),
        offering("od.gpu", CapacityType::OnDemand, 1, 1.0),
    ];
    let mut cfg = policy(600.0);
    cfg.offers.gpu_speed.insert("NVIDIA F".into(), 2.0);
    // Job 1 (0 s, 3,600 s): boot to 300 s, runs to 3,900 s, idle 300 s, stopped at the 20 s tick
    // of 4,200 s. Job 2 (5,000 s, 1,800 s): a new instance, ready at 5,300 s, done at 7,100 s,
    // stopped at 7,400 s.
    let t = trace(&[(0.0, 3600.0, 1), (5000.0, 1800.0, 1)]);
    let r = run(&t, &offs, &mut SkyPilotLike::new(cfg.clone()), &sim(300.0), &mut |_| {});
    assert_eq!(r.name, "skypilot-like");
    assert_eq!(r.jobs_completed, 2);
    assert_eq!(
        r.launches_by_offering.into_iter().collect::<Vec<_>>(),
        [("slow.gpu/spot".to_string(), 2)]
    );
    assert!(close(r.total_usd, 0.3 * (4200.0 + 2400.0) / 3600.0), "{}", r.total_usd);
    assert!(close(r.idle_usd, 0.3 * 600.0 / 3600.0));
    assert!(close(r.wait_p95_s, 300.0));
    // onoff ranks by cost per job and takes B for the same trace.
    let o = run(
        &t,
        &offs,
        &mut PolicyStrategy::new("onoff", cfg),
        &sim(300.0),
        &mut |_| {},
    );
    assert!(
        o.launches_by_offering.contains_key("fast.gpu/spot"),
        "{:?}",
        o.launches_by_offering
    );
}

#[test]
fn skypilot_like_restarts_from_the_last_checkpoint_when_the_instance_is_gone() {
    // The outage of `measured()`: the notice at 1,000 s is not acted on; the instance is gone at
    // 1,120 s with 820 s of work done since 300 s: the 600 s checkpoint is kept, 220 s lost. The
    // job asks for spot at the 20 s tick of 1,120 s: refused (the offering is then skipped until
    // 1,300 s). It retries after SkyPilot's backoff, 60 s then x 1.6: at 1,180 s and 1,280 s
    // nothing is eligible, at 1,440 s (due 1,433.6 s) spot is refused again (out until 1,500 s),
    // at 1,700 s (due 1,685.8 s) it launches: ready at 2,000 s, the remaining 3,000 s end at
    // 5,000 s.
    let offs = vec![spot("one.gpu", "NVIDIA T", 0.3)];
    let s = SimConfig {
        preemptions: measured(),
        interruptions: true,
        ..sim(300.0)
    };
    let t = trace(&[(0.0, 3600.0, 1)]);
    let r = run(&t, &offs, &mut SkyPilotLike::new(policy(600.0)), &s, &mut |_| {});
    assert_eq!(r.jobs_completed, 1);
    assert_eq!(r.interruptions, 1);
    assert_eq!(r.spot_unavailable_errors, 2);
    assert!(
        close(r.lost_work_gpu_hours, 220.0 / 3600.0),
        "{}",
        r.lost_work_gpu_hours
    );
    assert!(close(r.makespan_s, 5000.0), "{}", r.makespan_s);
    // Billed 0..1,120 s and 1,700..5,300 s (stopped after 5 idle minutes) at $0.30/h.
    assert!(close(r.total_usd, 0.3 * (1120.0 + 3600.0) / 3600.0), "{}", r.total_usd);
}

#[test]
fn a_strategy_run_again_over_another_catalogue_prices_that_one() {
    // The onoff policy with its warm pool, over a day of bursts; then the same strategy
    // object over a catalogue of the same size at other prices (its memo of offering rankings
    // knows a catalogue by address, and the new one may sit where the old one was).
    let jobs: Vec<(f64, f64, u32)> = (0..48)
        .flat_map(|burst| (0..3).map(move |j| (f64::from(burst) * 1800.0 + f64::from(j) * 30.0, 600.0, 1)))
        .collect();
    let t = trace(&jobs);
    let mut cfg = PolicyConfig::default();
    cfg.offers.min_gpu_memory_gib = 0.0;
    let s = sim(300.0);
    let cheap = offerings();
    let dear: Vec<Offering> = offerings()
        .into_iter()
        .map(|o| Offering {
            price_usd_per_h: o.price_usd_per_h * 3.0,
            ..o
        })
        .collect();
    let mut again = PolicyStrategy::new("onoff", cfg.clone());
    let first = run(&t, &cheap, &mut again, &s, &mut |_| {});
    let second = run(&t, &dear, &mut again, &s, &mut |_| {});
    let fresh = run(&t, &dear, &mut PolicyStrategy::new("onoff", cfg), &s, &mut |_| {});
    assert!(
        close(second.total_usd, fresh.total_usd),
        "{} vs {}",
        second.total_usd,
        fresh.total_usd
    );
    assert_eq!(
        (second.launches, second.wait_p50_s, second.wait_p95_s),
        (fresh.launches, fresh.wait_p50_s, fresh.wait_p95_s)
    );
    assert!(second.total_usd > first.total_usd, "the dear catalogue costs more");
}

/// Declared run times tell the policy when a worker frees up and how much of one a short job
/// needs: B (60 s, half of the 120 s short-job horizon) arrives 50 s before A's worker ends, so
/// the policy counts the 70 s left of the horizon on that worker as capacity for it and B waits
/// 50 s; nothing is launched for B. With run times undeclared (`onoff simulate
/// --undeclared-runtimes`) A's end is unknown and B counts as a whole worker (the default run
/// time, an hour), so B's arrival launches a second worker (boot 200 s), which A's worker beats:
/// B still waits 50 s, and the second worker is billed for nothing (at least EC2's 60 s minimum)
/// until a decision releases it.
#[test]
fn a_declared_run_time_spares_a_launch_for_a_job_that_its_worker_frees_up_for() {
    let t = trace(&[(0.0, 300.0, 1), (450.0, 60.0, 1)]);
    let declared = run_policy(&t, policy(600.0), &sim(200.0));
    let undeclared = run_policy(&t, policy(600.0), &undeclared(200.0));
    assert_eq!((declared.jobs_completed, undeclared.jobs_completed), (2, 2));
    assert_eq!((declared.launches, undeclared.launches), (1, 2));
    // A waits its worker's boot, B the 50 s to A's end, either way.
    for r in [&declared, &undeclared] {
        assert!(close(r.wait_p99_s, 200.0) && close(r.wait_mean_s, 125.0), "{r:?}");
    }
    // The second worker, billed on top.
    assert!(
        undeclared.total_usd >= declared.total_usd + 60.0 / 3600.0,
        "{} against {}",
        undeclared.total_usd,
        declared.total_usd
    );
}

/// Jobs that declare no run time take the mean run time of the lane's last jobs to finish, once
/// five have (the deployed reconciler reads the same from the jobs table's `run_times` index).
/// Five 10 s items arrive at 0 s: nothing has finished, so each counts as an hour, a worker of
/// its own (5 launches; boot 200 s, they end at 210 s, and their workers are released after the
/// 600 s idle timeout). Five more arrive at 1,500 s: the estimate is 10 s, 50 s of work within
/// the 120 s short-job horizon, so one worker is launched for them and they run one after the
/// other on it (waits 200, 210, 220, 230, 240 s). With four items first, too few to estimate,
/// the second five get five workers again.
#[test]
fn undeclared_jobs_share_a_worker_once_the_lane_has_finished_enough_jobs_to_estimate_their_run_time() {
    let s = undeclared(200.0);
    let items = |first: usize| {
        let mut jobs: Vec<(f64, f64, u32)> = vec![(0.0, 10.0, 1); first];
        jobs.extend([(1_500.0, 10.0, 1); 5]);
        trace(&jobs)
    };
    let learnt = run_policy(&items(5), policy(600.0), &s);
    assert_eq!((learnt.jobs_completed, learnt.launches), (10, 6), "{learnt:?}");
    let too_few = run_policy(&items(4), policy(600.0), &s);
    assert_eq!((too_few.jobs_completed, too_few.launches), (9, 9), "{too_few:?}");
    // The second five waited 200 to 240 s on the one worker (the first five 200 s each): the
    // 99th percentile is the longest, 240 s.
    assert!(close(learnt.wait_p99_s, 240.0), "{learnt:?}");
}

/// A running undeclared job's end follows the estimate as it changes, as a reconcile run takes
/// the estimate of the run: job A (5,000 s) and five 10 s items arrive at 0 s with the lane's
/// prior of 300 s, each a worker of its own (6 launches; boot 200 s). The items end at 210 s,
/// and their mean, 10 s, is the estimate from then on, so A is taken to end at 210 s and, once
/// it has outlived that by the 120 s horizon (330 s), its end is unknown. Item B arrives at
/// 400 s (the items' workers are gone after their 60 s idle timeout): it gets a worker of its own
/// and waits its boot, 200 s, like every job. With A's end fixed at its start's estimate (500 s,
/// kept until 620 s), B would wait for A's worker instead, past 200 s.
#[test]
fn a_running_undeclared_jobs_end_follows_the_estimate_as_it_changes() {
    let s = undeclared(200.0);
    let mut jobs = vec![(0.0, 5_000.0, 1)];
    jobs.extend([(0.0, 10.0, 1); 5]);
    jobs.push((400.0, 10.0, 1));
    let mut cfg = policy(60.0);
    cfg.lanes[0].default_runtime_s = Some(300.0);
    let r = run_policy(&trace(&jobs), cfg, &s);
    assert_eq!((r.jobs_completed, r.launches), (7, 7), "{r:?}");
    assert!(close(r.wait_p99_s, 200.0), "{r:?}");
}

/// A lane's prior (`lanes[].default_runtime_s`) is the run time of its undeclared jobs before
/// any has finished: five 10 s items at 0 s with a prior of 10 s are 50 s of work, within the
/// 120 s short-job horizon, so one worker is launched and they run one after the other on it
/// (waits 200, 210, 220, 230, 240 s), where without the prior each counts as an hour and gets a
/// worker of its own (5 launches, every wait 200 s).
#[test]
fn a_lanes_prior_lets_undeclared_items_share_a_worker_before_any_has_finished() {
    let s = undeclared(200.0);
    let items = trace(&[(0.0, 10.0, 1); 5]);
    let mut with_prior = policy(600.0);
    with_prior.lanes[0].default_runtime_s = Some(10.0);
    let prior = run_policy(&items, with_prior, &s);
    let none = run_policy(&items, policy(600.0), &s);
    assert_eq!((prior.jobs_completed, prior.launches), (5, 1), "{prior:?}");
    assert_eq!((none.jobs_completed, none.launches), (5, 5), "{none:?}");
    assert!(
        close(prior.wait_p99_s, 240.0) && close(prior.wait_mean_s, 220.0),
        "{prior:?}"
    );
    assert!(close(none.wait_p99_s, 200.0), "{none:?}");
}

/// Queued jobs take the run-time estimate as it changes, as the reconciler's run gives them
/// theirs: five 10 s items (1 GPU) at 0 s and five 10 s items of 2 GPUs at 305 s, run times
/// undeclared, no prior, and a job must wait 100 s before it causes a launch
/// (`anti_thrash.scale_up_window_s`). The first five get a worker each (launched at 100 s, boot
/// 200 s, done at 310 s); the second five arrive before any job has finished, each counted as
/// an hour, and are still queued at 310 s, when the first five's mean, 10 s, becomes the estimate.
/// At their launch (405 s) they are 50 s of work, within the 120 s short-job horizon: one
/// 4-GPU worker runs them one after the other (the 1-GPU workers cannot). Had they kept the
/// hour they were queued with, each would get a worker of its own (10 launches).
#[test]
fn queued_undeclared_jobs_take_the_estimate_that_comes_while_they_wait() {
    let s = undeclared(200.0);
    let mut jobs = vec![(0.0, 10.0, 1); 5];
    jobs.extend([(305.0, 10.0, 2); 5]);
    let mut cfg = policy(60.0);
    cfg.anti_thrash.scale_up_window_s = 100.0;
    let r = run_policy(&trace(&jobs), cfg, &s);
    assert_eq!((r.jobs_completed, r.launches), (10, 6), "{r:?}");
}
