//! Simulator tests on hand-made traces whose costs and waits can be computed by hand.

use onoff_policy::{CapacityType, KeepAliveMode, LaneConfig, Offering, OfferingKey, PolicyConfig};
use onoff_sim::strategies::{AlwaysOn, PolicyStrategy};
use onoff_sim::{compare, lower_bound_usd, peak_need, run, RunReport, SimConfig, Trace, TraceFormat, TraceJob};

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

/// One lane, fixed idle timeout of `idle_s`.
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
    // Arrives at 0, worker boots 300 s, runs 3600 s, the fleet ends at the last completion (3900 s).
    let r = run_policy(&trace(&[(0.0, 3600.0, 1)]), policy(600.0), &sim(300.0));
    assert_eq!(r.jobs_completed, 1);
    assert_eq!(r.jobs_lost, 0);
    assert_eq!(r.launches, 1);
    assert!(close(r.total_usd, 3900.0 / 3600.0), "total {}", r.total_usd);
    assert!(close(r.boot_usd, 300.0 / 3600.0), "boot {}", r.boot_usd);
    assert!(close(r.wait_p50_s, 300.0));
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
    // Billed from 0 to B's end at 1800 s.
    assert!(close(r.total_usd, 1800.0 / 3600.0), "total {}", r.total_usd);
    assert!(close(r.idle_usd, 300.0 / 3600.0), "idle {}", r.idle_usd);
    assert!(close(r.idle_gpu_hours, 300.0 / 3600.0));
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
    // First worker 0..1020 s, second 2000..2900 s.
    assert!(close(r.total_usd, (1020.0 + 900.0) / 3600.0), "total {}", r.total_usd);
}

#[test]
fn ec2_bills_a_60_second_minimum() {
    // Zero boot, a 10 s job: billed 60 s.
    let r = run_policy(&trace(&[(0.0, 10.0, 1)]), policy(600.0), &sim(0.0));
    assert!(close(r.total_usd, 60.0 / 3600.0), "total {}", r.total_usd);
}

#[test]
fn a_job_runs_on_an_instance_with_enough_gpus() {
    // A 3-GPU job needs the 4-GPU type ($4/h): 300 s boot + 3600 s run.
    let r = run_policy(&trace(&[(0.0, 3600.0, 3)]), policy(600.0), &sim(300.0));
    assert!(close(r.total_usd, 4.0 * 3900.0 / 3600.0), "total {}", r.total_usd);
    let lb = lower_bound_usd(&trace(&[(0.0, 3600.0, 3)]), &offerings(), &policy(600.0), &sim(300.0)).unwrap();
    assert!(close(lb, 4.0));
}

#[test]
fn multi_instance_jobs_use_several_instances_at_once() {
    // 10 GPUs with at most 4 per instance in this world: 3 instances of 4 GPUs.
    let mut s = sim(0.0);
    s.max_gpus_per_instance = 4;
    let t = trace(&[(0.0, 3600.0, 10)]);
    let r = run_policy(&t, policy(600.0), &s);
    assert_eq!(r.launches, 3);
    assert!(close(r.total_usd, 3.0 * 4.0), "total {}", r.total_usd);
    assert!(close(
        lower_bound_usd(&t, &offerings(), &policy(600.0), &s).unwrap(),
        12.0
    ));
}

#[test]
fn always_on_holds_the_peak_for_the_whole_run() {
    // Two overlapping 1-GPU jobs (peak 2), last completion at 7200 s: 2 x $1/h x 2 h.
    let t = trace(&[(0.0, 3600.0, 1), (1800.0, 5400.0, 1)]);
    let s = sim(0.0);
    assert_eq!(peak_need(&t, &s).get(&1), Some(&2));
    let mut st = AlwaysOn::new(policy(600.0), peak_need(&t, &s));
    let r = run(&t, &offerings(), &mut st, &s, &mut |_| {});
    assert_eq!(r.jobs_completed, 2);
    assert!(close(r.total_usd, 4.0), "total {}", r.total_usd);
    assert!(close(r.wait_p95_s, 0.0));
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
    assert_eq!(c.policies.len(), 5);
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
