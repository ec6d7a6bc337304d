//! Cross-crate: the policy decides, `control::act` carries it out through the fakes, again and
//! again, as the reconciler does, and the fleet converges without duplicate launches.

use onoff_control::fake::{FakeAvailability, FakeFleet, FakeRegistry};
use onoff_control::{act, ActContext};
use onoff_policy::{
    decide, CapacityType, LaneConfig, LaneObservation, Observation, Offering, OfferingKey, PendingJob, PolicyConfig,
    WorkerState, WorkerView,
};

fn offerings() -> Vec<Offering> {
    ["a", "b", "c"]
        .into_iter()
        .map(|z| Offering {
            key: OfferingKey {
                instance_type: "g.1".into(),
                zone: format!("us-east-1{z}"),
                capacity_type: CapacityType::Spot,
            },
            gpus: 1,
            gpu_model: "NVIDIA L4".into(),
            gpu_memory_gib: 24.0,
            vcpus: 4,
            price_usd_per_h: 0.3,
            interruption: None,
        })
        .collect()
}

fn views(reg: &FakeRegistry, cfg: &PolicyConfig) -> Vec<WorkerView> {
    reg.records()
        .into_values()
        .filter(|r| r.state != WorkerState::Terminating)
        .map(|r| WorkerView {
            id: r.id.clone(),
            seq: 0,
            lane: cfg.lane_index(&r.lane).unwrap(),
            offering: r.offering.clone(),
            gpus: 1,
            gpu_memory_gib: 24.0,
            price_usd_per_h: r.price_usd_per_h,
            state: r.state,
            launched_at: r.launched_at,
            idle_since: None,
            project: r.project.clone(),
            job_type: None,
            busy_until: None,
            pinned_job: r.pinned_job.clone(),
            spot_price_usd_per_h: r.spot_price_usd_per_h,
            stopped_until: None,
            cached_projects: r.cached_projects.clone(),
        })
        .collect()
}

#[test]
fn repeated_reconciles_while_workers_boot_launch_once_per_job_and_spread_over_zones() {
    let cfg = PolicyConfig {
        lanes: vec![LaneConfig::default()],
        ..PolicyConfig::default()
    };
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let offs = offerings();
    let jobs: Vec<PendingJob> = (0..6)
        .map(|i| PendingJob {
            id: format!("j{i}"),
            lane: 0,
            project: "p".into(),
            job_type: None,
            gpus_per_instance: 1,
            instances: 1,
            min_gpu_memory_gib: 0.0,
            est_runtime_s: Some(3600.0),
            deadline: None,
            enqueued_at: 0.0,
        })
        .collect();
    let mut lanes = vec![LaneObservation::default()];
    lanes[0].backlog.visible = 6;
    // Five reconciles a minute apart; the workers are still booting (Pending) throughout.
    for tick in 0..5 {
        let now = 1_000.0 + 60.0 * tick as f64;
        let workers = views(&reg, &cfg);
        let obs = Observation {
            lanes: &lanes,
            jobs: &jobs,
            workers: &workers,
            offerings: &offs,
            unavailable: &[],
            fleet: None,
        };
        let plan = decide(&obs, &cfg, now);
        let ctx = ActContext {
            cfg: &cfg,
            offerings: &offs,
            unavailable: &[],
            now,
            table: None,
            run_time_estimates: &[],
        };
        let out = pollster::block_on(act(&plan, ctx, &fleet, &reg, &avail));
        assert!(out.errors.is_empty(), "{:?}", out.errors);
    }
    let running = fleet.running();
    assert_eq!(
        running.len(),
        6,
        "one worker per queued job, no duplicates across reconciles"
    );
    let zones: std::collections::BTreeSet<_> = running.values().map(|k| k.zone.clone()).collect();
    assert_eq!(zones.len(), 3, "launch spread over the three equal offerings");
}
