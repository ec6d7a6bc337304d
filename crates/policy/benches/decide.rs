//! `decide()` at 10,000 queued jobs x 1,000 workers (target: < 5 ms).
//! Run: `cargo bench -p onoff-policy --bench decide`.

use criterion::{criterion_group, criterion_main, Criterion};
use onoff_policy::{
    decide, CapacityType, LaneObservation, Observation, Offering, OfferingKey, PendingJob, PolicyConfig, WorkerState,
    WorkerView,
};

fn setup() -> (
    Vec<LaneObservation>,
    Vec<PendingJob>,
    Vec<WorkerView>,
    Vec<Offering>,
    PolicyConfig,
) {
    let now = 1_700_000_000.0;
    let mut offerings = Vec::new();
    for (i, gpus) in [1u32, 1, 2, 4, 8, 8].into_iter().enumerate() {
        for zone in ["a", "b", "c", "d", "e", "f"] {
            for (cap, p) in [(CapacityType::Spot, 0.3), (CapacityType::OnDemand, 1.0)] {
                offerings.push(Offering {
                    key: OfferingKey {
                        instance_type: format!("t{i}.x"),
                        zone: format!("us-east-1{zone}"),
                        capacity_type: cap,
                    },
                    gpus,
                    gpu_model: "NVIDIA A10G".into(),
                    gpu_memory_gib: 24.0,
                    vcpus: 8,
                    price_usd_per_h: p * gpus as f64 * (1.0 + i as f64 / 10.0),
                    interruption: Some(onoff_policy::InterruptionBucket::From5To10),
                });
            }
        }
    }
    let shapes = [1u32, 1, 1, 1, 2, 4, 8];
    let jobs: Vec<PendingJob> = (0..10_000)
        .map(|i| PendingJob {
            id: format!("job-{i}"),
            lane: 1,
            project: format!("p{}", i % 15),
            job_type: None,
            gpus_per_instance: shapes[i % shapes.len()],
            instances: 1,
            min_gpu_memory_gib: 0.0,
            est_runtime_s: Some(3600.0),
            deadline: if i % 100 == 0 { Some(now + 7200.0) } else { None },
            enqueued_at: now - i as f64,
        })
        .collect();
    let states = [
        WorkerState::Running,
        WorkerState::Running,
        WorkerState::Idle,
        WorkerState::Pending,
    ];
    let workers: Vec<WorkerView> = (0..1_000)
        .map(|i| {
            let state = states[i % states.len()];
            WorkerView {
                id: format!("i-{i:017x}"),
                seq: i as u64,
                lane: 1,
                offering: offerings[i % offerings.len()].key.clone(),
                gpus: shapes[i % shapes.len()],
                gpu_memory_gib: 24.0,
                price_usd_per_h: 0.5,
                state,
                launched_at: now - 3600.0,
                idle_since: (state == WorkerState::Idle).then_some(now - (i % 1200) as f64),
                project: Some(format!("p{}", i % 15)),
                job_type: None,
                busy_until: None,
                pinned_job: None,
                spot_price_usd_per_h: None,
                stopped_until: None,
                cached_projects: Vec::new(),
            }
        })
        .collect();
    let mut lanes = vec![LaneObservation::default(); 2];
    lanes[1].backlog.visible = 10_000;
    for k in 0..500 {
        lanes[1].record_arrival(shapes[k % shapes.len()], now - 30_000.0 + k as f64 * 60.0);
    }
    let mut cfg = PolicyConfig::default();
    cfg.limits.max_workers_total = 1_500;
    cfg.lanes[1].max_workers = 1_500;
    (lanes, jobs, workers, offerings, cfg)
}

fn bench(c: &mut Criterion) {
    let (lanes, jobs, workers, offerings, cfg) = setup();
    let obs = Observation {
        lanes: &lanes,
        jobs: &jobs,
        workers: &workers,
        offerings: &offerings,
        unavailable: &[],
        fleet: None,
    };
    c.bench_function("decide 10k jobs x 1k workers", |b| {
        b.iter(|| std::hint::black_box(decide(std::hint::black_box(&obs), &cfg, 1_700_000_000.0)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
