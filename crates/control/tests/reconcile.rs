//! The reconcile use case through the fakes: scale from zero without duplicate launches, the
//! keep-alive, and the reaper (orphans, lost workers, stale heartbeats, expired leases).

use onoff_control::fake::{FakeAvailability, FakeFleet, FakeJobs, FakeQueue, FakeRegistry};
use onoff_control::job::JobState;
use onoff_control::ports::{
    wake_up_body, Claim, FleetError, FleetErrorKind, JobStore, LaunchRequest, WorkerRecord, WorkerRegistry,
};
use onoff_control::reconcile::{reconcile, ReconcileOptions, ReconcileReport};
use onoff_control::submit::{submit, Source};
use onoff_policy::{Action, CapacityType, LaneConfig, Offering, OfferingKey, PolicyConfig, WorkerState};

const NOW: f64 = 1_700_000_000.0;

fn offerings() -> Vec<Offering> {
    ["us-east-1a", "us-east-1b"]
        .into_iter()
        .map(|z| Offering {
            key: OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: z.into(),
                capacity_type: CapacityType::Spot,
            },
            gpus: 1,
            gpu_model: "NVIDIA A10G".into(),
            gpu_memory_gib: 24.0,
            vcpus: 4,
            price_usd_per_h: 0.39,
            interruption: None,
        })
        .collect()
}

fn cfg() -> PolicyConfig {
    let mut cfg = PolicyConfig {
        lanes: vec![LaneConfig {
            predictive_max: 0,
            ..LaneConfig::default()
        }],
        ..PolicyConfig::default()
    };
    cfg.scale_down.mode = onoff_policy::KeepAliveMode::Fixed;
    cfg.scale_down.fixed_idle_timeout_s = 600.0;
    // Idle workers terminated at the timeout; the stopped workers' tests stop them
    // (`stopping_cfg`).
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::Never;
    cfg
}

/// [`cfg`] with idle workers stopped at the timeout, as the default configuration stops them.
fn stopping_cfg() -> PolicyConfig {
    let mut cfg = cfg();
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::SpotAndOnDemand;
    cfg
}

struct World {
    queue: FakeQueue,
    workers: FakeRegistry,
    jobs: FakeJobs,
    fleet: FakeFleet,
    avail: FakeAvailability,
    cfg: PolicyConfig,
}

impl World {
    fn new() -> Self {
        Self {
            queue: FakeQueue::default(),
            workers: FakeRegistry::default(),
            jobs: FakeJobs::default(),
            fleet: FakeFleet::new(),
            avail: FakeAvailability::default(),
            cfg: cfg(),
        }
    }

    /// A world whose policy stops idle workers ([`stopping_cfg`]).
    fn stopping() -> Self {
        Self {
            cfg: stopping_cfg(),
            ..Self::new()
        }
    }

    fn submit(&self, n: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                let spec = format!(r#"{{"image":"i","command":["x"],"project":"p","client_token":"t{i}"}}"#);
                let src = Source::Sqs {
                    message_id: format!("m{i}"),
                };
                pollster::block_on(submit(&spec, &src, &["standard"], NOW, &self.jobs, &self.queue))
                    .unwrap()
                    .id()
                    .to_string()
            })
            .collect()
    }

    /// Submit one job declaring `runtime_s` seconds of run time.
    fn submit_timed(&self, token: &str, runtime_s: f64) -> String {
        self.submit_one(token, NOW, Some(runtime_s))
    }

    /// Submit one job of token `token` at `at`, declaring `runtime_s` seconds of run time if
    /// any.
    fn submit_one(&self, token: &str, at: f64, runtime_s: Option<f64>) -> String {
        let declared = runtime_s.map_or(String::new(), |r| format!(r#","est_runtime_s":{r}"#));
        let spec = format!(r#"{{"image":"i","command":["x"],"project":"p","client_token":"{token}"{declared}}}"#);
        let src = Source::Sqs {
            message_id: format!("m-{token}"),
        };
        pollster::block_on(submit(&spec, &src, &["standard"], at, &self.jobs, &self.queue))
            .unwrap()
            .id()
            .to_string()
    }

    /// A worker launched for job `first` (queued), which it claims at `NOW + 100` and runs;
    /// returns the worker's id.
    fn running_on_its_worker(&self, first: &str) -> String {
        self.reconcile(NOW + 1.0, false);
        let worker = self.workers.records().keys().next().unwrap().clone();
        pollster::block_on(self.jobs.claim(first, &worker, NOW + 10_000.0, NOW + 100.0)).unwrap();
        self.workers
            .agent_heartbeat(&worker, WorkerState::Running, None, NOW + 100.0)
            .unwrap();
        worker
    }

    /// One job submitted, a worker launched for it, and the job run there (claimed at
    /// `claimed_at`) to success; returns the worker's id.
    fn one_job_done(&self, claimed_at: f64) -> String {
        self.submit(1);
        self.reconcile(NOW + 1.0, false);
        let id = self.workers.records().keys().next().unwrap().clone();
        let job = self.jobs.records().keys().next().unwrap().clone();
        pollster::block_on(self.jobs.claim(&job, &id, NOW + 10_000.0, claimed_at)).unwrap();
        pollster::block_on(self.jobs.transition(&job, JobState::Running, JobState::Succeeded)).unwrap();
        id
    }

    /// [`World::one_job_done`], its worker idle from `NOW + 500` (heartbeat at `NOW + 1,150`),
    /// and the reconcile at `NOW + 1,160`, 660 s idle, past the 600 s timeout: with
    /// [`stopping_cfg`] it stops the worker. Returns the worker's id and that reconcile's report.
    fn idle_worker_released(&self) -> (String, ReconcileReport) {
        let id = self.one_job_done(NOW + 400.0);
        self.workers
            .agent_heartbeat(&id, WorkerState::Idle, Some(NOW + 500.0), NOW + 1_150.0)
            .unwrap();
        let r = self.reconcile(NOW + 1_160.0, true);
        (id, r)
    }

    /// The scaler's run under the reconcile lease held in `lease` (no reaper); `None` when the
    /// lease is held by another.
    fn scaler_run(&self, lease: &onoff_control::fake::FakeLease, now: f64) -> Option<ReconcileReport> {
        let opts = ReconcileOptions {
            reap: false,
            ..ReconcileOptions::default()
        };
        pollster::block_on(onoff_control::reconcile::reconcile_exclusive(
            &cfg(),
            &offerings(),
            &opts,
            now,
            "scaler",
            60.0,
            &self.queue,
            &self.workers,
            &self.jobs,
            &self.fleet,
            &self.avail,
            lease,
        ))
        .unwrap()
    }

    fn reconcile(&self, now: f64, reap: bool) -> ReconcileReport {
        self.reconcile_with(&offerings(), now, reap)
    }

    fn reconcile_with(&self, offerings: &[Offering], now: f64, reap: bool) -> ReconcileReport {
        let opts = ReconcileOptions {
            reap,
            ..ReconcileOptions::default()
        };
        self.reconcile_opts(offerings, &opts, now)
    }

    /// One reconcile; its report's fleet (`workers`, what the functions' metrics count) must be
    /// the one a fresh listing shows, but for the workers an agent took a job for under the
    /// decision (`acted.skipped`, left as listed).
    fn reconcile_opts(&self, offerings: &[Offering], opts: &ReconcileOptions, now: f64) -> ReconcileReport {
        let r = pollster::block_on(reconcile(
            &self.cfg,
            offerings,
            opts,
            now,
            &self.queue,
            &self.workers,
            &self.jobs,
            &self.fleet,
            &self.avail,
        ))
        .unwrap();
        let fleet = |ws: &[WorkerRecord]| {
            let mut v: Vec<WorkerRecord> = ws
                .iter()
                .filter(|w| !r.acted.skipped.contains(&w.id))
                .cloned()
                .collect();
            v.sort_by(|a, b| a.id.cmp(&b.id));
            v
        };
        let listed = pollster::block_on(self.workers.list_live()).unwrap().items;
        assert_eq!(
            fleet(&r.workers),
            fleet(&listed),
            "the report's fleet is not the table's: {r:?}"
        );
        r
    }
}

#[test]
fn scale_from_zero_launches_once_per_job_while_workers_boot() {
    let w = World::new();
    w.submit(3);
    let r = w.reconcile(NOW + 1.0, false);
    assert_eq!(r.acted.launched.len(), 3, "{:?}", r.plan);
    assert_eq!(w.fleet.running().len(), 3);
    assert_eq!(
        w.workers
            .records()
            .values()
            .filter(|r| r.state == WorkerState::Pending)
            .count(),
        3
    );
    // Alarm and schedule fire again while the workers boot: nothing more.
    for t in [NOW + 30.0, NOW + 90.0, NOW + 150.0] {
        let r = w.reconcile(t, true);
        assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
        assert!(r.workers_lost.is_empty() && r.orphans_terminated.is_empty(), "{r:?}");
    }
}

#[test]
fn a_job_of_a_size_the_catalogue_lacks_is_launched_on_the_next_size_up() {
    // 1- and 4-GPU types only, as us-east-1's x86_64 catalogue: a 2-GPU job gets a 4-GPU instance
    // (not a wait for a size that does not exist), and counts it as its capacity while it boots.
    let w = World::new();
    let spec = r#"{"image":"i","command":["x"],"project":"p","client_token":"two","gpus":2}"#;
    let src = Source::Sqs {
        message_id: "m-two".into(),
    };
    pollster::block_on(submit(spec, &src, &["standard"], NOW, &w.jobs, &w.queue)).unwrap();
    let mut offs = offerings();
    offs.push(Offering {
        key: OfferingKey {
            instance_type: "g5.12xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::Spot,
        },
        gpus: 4,
        gpu_model: "NVIDIA A10G".into(),
        gpu_memory_gib: 24.0,
        vcpus: 48,
        price_usd_per_h: 2.0,
        interruption: None,
    });
    let r = w.reconcile_with(&offs, NOW + 1.0, false);
    assert_eq!(r.acted.launched.len(), 1, "{:?}", r.plan);
    let types: Vec<String> = w.fleet.running().values().map(|k| k.instance_type.clone()).collect();
    assert_eq!(types, ["g5.12xlarge"]);
    // While it boots, the job is matched to it: nothing more.
    let r = w.reconcile_with(&offs, NOW + 90.0, false);
    assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
    // Without the 4-GPU type nothing can run it: no launch (admission rejects such a job).
    let w2 = World::new();
    pollster::block_on(submit(spec, &src, &["standard"], NOW, &w2.jobs, &w2.queue)).unwrap();
    let r = w2.reconcile(NOW + 1.0, false);
    assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
}

#[test]
fn the_reaper_terminates_orphans_and_requeues_jobs_of_lost_workers() {
    let w = World::new();
    let ids = w.submit(2);
    w.reconcile(NOW + 1.0, false);
    let workers: Vec<String> = w.workers.records().keys().cloned().collect();
    // Worker 0 claims job 0 and heartbeats; worker 1 claims job 1 and then goes silent.
    for (wid, jid) in workers.iter().zip(&ids) {
        assert!(matches!(
            pollster::block_on(w.jobs.claim(jid, wid, NOW + 10_000.0, NOW + 400.0)).unwrap(),
            Claim::Claimed(_)
        ));
    }
    w.workers
        .agent_heartbeat(&workers[0], WorkerState::Running, None, NOW + 1_000.0)
        .unwrap();
    w.workers
        .agent_heartbeat(&workers[1], WorkerState::Running, None, NOW + 500.0)
        .unwrap();
    // An instance tagged onoff:managed that the table does not know.
    w.fleet.add_instance("i-orphan", offerings()[0].key.clone());
    let sent_before = w.queue.sent().len();
    let r = w.reconcile(NOW + 1_100.0, true);
    assert_eq!(r.orphans_terminated, vec!["i-orphan".to_string()]);
    assert_eq!(r.workers_lost, vec![workers[1].clone()]);
    assert_eq!(r.jobs_requeued, vec![ids[1].clone()]);
    assert!(!w.fleet.running().contains_key("i-orphan"));
    assert!(!w.fleet.running().contains_key(&workers[1]));
    assert_eq!(w.workers.records()[&workers[1]].state, WorkerState::Terminating);
    let job1 = pollster::block_on(w.jobs.get(&ids[1])).unwrap().unwrap();
    assert_eq!((job1.state, job1.lease_owner), (JobState::Queued, None));
    assert_eq!(
        w.queue.sent().len(),
        sent_before + 1,
        "one message for the re-queued job"
    );
    // The healthy worker and its job are untouched.
    assert_eq!(
        pollster::block_on(w.jobs.get(&ids[0])).unwrap().unwrap().state,
        JobState::Running
    );
    // A second reconciler run re-queues nothing twice.
    let r2 = w.reconcile(NOW + 1_110.0, true);
    assert!(r2.jobs_requeued.is_empty() && r2.workers_lost.is_empty(), "{r2:?}");
}

/// CreateFleet succeeded, `register_launch` did not (throttled past the SDK's retries, or the
/// function timed out): the instance boots with no row. The reaper registers it as a booting
/// worker of its lane at its catalogue price, and the decision counts it, instead of terminating
/// it after its billed boot and launching again for the same job. What is not such a launch is
/// still terminated: no lane tag, a lane the policy does not have, past the boot timeout, or a row
/// the control plane already retired.
#[test]
fn a_launch_whose_registration_failed_is_adopted_not_reaped_and_launched_again() {
    let w = World::new();
    let ids = w.submit(1);
    let key = offerings()[0].key.clone();
    let launched_at = NOW + 1.0;
    let req = |lane: &str, project: Option<&str>| LaunchRequest {
        lane: lane.into(),
        offerings: vec![key.clone()],
        count: 1,
        project: project.map(str::to_string),
        job: None,
        client_token: String::new(),
    };
    let standard = req("standard", None);
    w.fleet
        .add_launched_instance("i-unregistered", key.clone(), &req("standard", Some("p")), launched_at);
    // Not launches of this policy's lanes, or long past their boot: orphans.
    w.fleet.add_instance("i-untagged", key.clone());
    w.fleet
        .add_launched_instance("i-other-lane", key.clone(), &req("gold", None), launched_at);
    w.fleet
        .add_launched_instance("i-old", key.clone(), &standard, launched_at - 3_600.0);
    // Retired by the control plane (its row Terminating), and its termination did not take
    // (EC2's eventual consistency: NotFound for an instance it launched moments ago).
    w.fleet
        .add_launched_instance("i-retired", key.clone(), &standard, launched_at);
    pollster::block_on(w.workers.register_launch(WorkerRecord {
        state: WorkerState::Terminating,
        ..WorkerRecord::launched("i-retired", "standard", key.clone(), 0.39, launched_at)
    }))
    .unwrap();
    // Adopted at the first run that lists it; the retired one terminated again at once; the
    // orphans are left alone within the launch grace (a row may not be visible yet), then
    // terminated.
    let r = w.reconcile(launched_at + 60.0, true);
    assert_eq!(r.orphans_adopted, ["i-unregistered"]);
    let mut reaped = r.orphans_terminated.clone();
    reaped.sort();
    assert_eq!(
        reaped,
        ["i-old", "i-retired", "i-untagged"],
        "past the grace, or retired"
    );
    let row = w.workers.records()["i-unregistered"].clone();
    assert_eq!(row.state, WorkerState::Pending);
    assert_eq!((row.lane.as_str(), row.project.as_deref()), ("standard", Some("p")));
    assert_eq!((row.price_usd_per_h, row.launched_at), (0.39, launched_at));
    assert!(w.fleet.running().contains_key("i-unregistered"));
    // The job waits for the adopted worker: nothing launched for it again.
    assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
    let job = pollster::block_on(w.jobs.get(&ids[0])).unwrap().unwrap();
    assert_eq!(job.state, JobState::Queued);
    let r = w.reconcile(launched_at + 200.0, true);
    assert!(r.orphans_adopted.is_empty() && r.acted.launched.is_empty(), "{r:?}");
    let mut reaped = r.orphans_terminated.clone();
    reaped.sort();
    assert_eq!(reaped, ["i-other-lane"]);
    assert_eq!(w.fleet.running().len(), 1, "{:?}", w.fleet.running());
    // An agent that never reports is lost at the boot timeout, as any worker.
    let r = w.reconcile(launched_at + 1_900.0, true);
    assert_eq!(r.workers_lost, ["i-unregistered"]);
}

/// A launch pinned to a job (a deadline at risk on spot gets on-demand capacity of its own) whose
/// registration failed is adopted pinned to that job, from its `onoff:job` tag: the worker is that
/// job's capacity alone, as it would have been registered.
#[test]
fn an_adopted_launch_stays_pinned_to_the_job_it_was_launched_for() {
    let w = World::new();
    let ids = w.submit(1);
    let key = offerings()[0].key.clone();
    let req = LaunchRequest {
        lane: "standard".into(),
        offerings: vec![key.clone()],
        count: 1,
        project: Some("p".into()),
        job: Some(ids[0].clone()),
        client_token: String::new(),
    };
    w.fleet.add_launched_instance("i-pinned", key, &req, NOW + 1.0);
    let r = w.reconcile(NOW + 61.0, true);
    assert_eq!(r.orphans_adopted, ["i-pinned"]);
    assert_eq!(
        w.workers.records()["i-pinned"].pinned_job.as_deref(),
        Some(ids[0].as_str())
    );
    assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
}

#[test]
fn a_worker_whose_instance_is_gone_and_an_expired_lease_are_handled() {
    let w = World::new();
    let ids = w.submit(2);
    w.reconcile(NOW + 1.0, false);
    let workers: Vec<String> = w.workers.records().keys().cloned().collect();
    pollster::block_on(w.jobs.claim(&ids[0], &workers[0], NOW + 10_000.0, NOW + 400.0)).unwrap();
    pollster::block_on(w.jobs.claim(&ids[1], &workers[1], NOW + 900.0, NOW + 400.0)).unwrap();
    for id in &workers {
        w.workers
            .agent_heartbeat(id, WorkerState::Running, None, NOW + 990.0)
            .unwrap();
    }
    // Worker 0's instance disappears behind onoff's back.
    pollster::block_on(onoff_control::ports::Fleet::terminate(
        &w.fleet,
        std::slice::from_ref(&workers[0]),
    ))
    .unwrap();
    let r = w.reconcile(NOW + 1_000.0, true);
    assert_eq!(r.workers_gone, vec![workers[0].clone()]);
    let mut requeued = r.jobs_requeued.clone();
    requeued.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(
        requeued, want,
        "job 0 (worker gone) and job 1 (lease expired at +900 s)"
    );
    assert_eq!(
        pollster::block_on(w.workers.get(&workers[0])).unwrap().unwrap().state,
        WorkerState::Terminating
    );
}

/// A stoppable spot worker's persistent request opens again when its instance terminates, and
/// EC2 launches another: an instance that powers off before its agent runs (a worker image that
/// does not pull) left a chain of launches for as long as the image stayed broken. The reaper
/// cancels this deployment's requests whose instance is no live worker's, once the launch grace
/// passed, and keeps those of live workers, Stopped ones included.
#[test]
fn the_reaper_cancels_spot_requests_whose_instance_is_no_live_workers() {
    let w = World::new();
    w.submit(2);
    w.reconcile(NOW + 1.0, false);
    let workers: Vec<String> = w.workers.records().keys().cloned().collect();
    for id in &workers {
        w.workers
            .agent_heartbeat(id, WorkerState::Idle, None, NOW + 990.0)
            .unwrap();
    }
    // Worker 0's instance powered itself off: gone, its request open again (no instance yet).
    pollster::block_on(onoff_control::ports::Fleet::terminate(
        &w.fleet,
        std::slice::from_ref(&workers[0]),
    ))
    .unwrap();
    w.fleet.add_spot_request("sir-gone", None, NOW);
    // A request that launched an instance no row knows (its replacement).
    w.fleet.add_spot_request("sir-replaced", Some("i-replacement"), NOW);
    // Worker 1's own request, and a Stopped worker's (disabled): kept.
    w.fleet.add_spot_request("sir-live", Some(&workers[1]), NOW);
    let mut stopped = w.workers.records()[&workers[1]].clone();
    stopped.id = "i-stopped".into();
    stopped.state = WorkerState::Stopped;
    stopped.heartbeat_at = None;
    pollster::block_on(w.workers.register_launch(stopped)).unwrap();
    w.fleet.add_instance("i-stopped", offerings()[0].key.clone());
    w.fleet.stop_behind_the_back("i-stopped");
    w.fleet.add_spot_request("sir-stopped", Some("i-stopped"), NOW);
    // One made within the launch grace (its row may not be visible yet): kept this time.
    let at = NOW + 1_000.0;
    w.fleet.add_spot_request("sir-young", None, at - 10.0);
    let r = w.reconcile(at, true);
    assert_eq!(r.workers_gone, vec![workers[0].clone()]);
    assert_eq!(
        r.spot_requests_cancelled,
        ["sir-gone", "sir-replaced"],
        "{:?}",
        r.errors
    );
    assert_eq!(w.fleet.cancelled_spot_requests(), ["sir-gone", "sir-replaced"]);
    // The next run, past the grace, cancels the young one too, and nothing twice (worker 1
    // still reporting).
    w.workers
        .agent_heartbeat(&workers[1], WorkerState::Idle, None, at + 590.0)
        .unwrap();
    let r = w.reconcile(at + 600.0, true);
    assert_eq!(r.spot_requests_cancelled, ["sir-young"], "{:?}", r.errors);
    // Without the reaper (the scaler's runs) no request is looked at.
    w.fleet.add_spot_request("sir-later", None, NOW);
    let r = w.reconcile(at + 700.0, false);
    assert!(r.spot_requests_cancelled.is_empty(), "{r:?}");
}

/// The active index is eventually consistent: listed again right after the reaper re-queued a
/// job, it may still show the job RUNNING on its lost worker. The decision sees it queued, and its
/// replacement launches in the same run, not a run later.
#[test]
fn a_job_requeued_by_the_reaper_gets_capacity_in_the_same_run_whatever_the_index_shows() {
    let w = World::new();
    let ids = w.submit(1);
    w.reconcile(NOW + 1.0, false);
    let workers: Vec<String> = w.workers.records().keys().cloned().collect();
    assert_eq!(workers.len(), 1);
    pollster::block_on(w.jobs.claim(&ids[0], &workers[0], NOW + 10_000.0, NOW + 400.0)).unwrap();
    w.workers
        .agent_heartbeat(&workers[0], WorkerState::Running, None, NOW + 990.0)
        .unwrap();
    pollster::block_on(onoff_control::ports::Fleet::terminate(
        &w.fleet,
        std::slice::from_ref(&workers[0]),
    ))
    .unwrap();
    w.jobs.lag_index();
    let r = w.reconcile(NOW + 1_000.0, true);
    assert_eq!(r.jobs_requeued, ids);
    assert_eq!(w.fleet.running().len(), 1, "a replacement launched: {r:?}");
    let job = pollster::block_on(w.jobs.get(&ids[0])).unwrap().unwrap();
    assert_eq!((job.state, job.lease_owner), (JobState::Queued, None));
}

/// A worker its agent registered itself (price 0: the control plane's registration failed after
/// the launch) still counts against the budget, at its offering's catalogue price.
#[test]
fn a_worker_that_registered_itself_counts_against_the_budget_at_its_catalogue_price() {
    let w = World::new();
    let adopted = offerings()[0].clone();
    pollster::block_on(w.workers.register_launch(WorkerRecord {
        state: WorkerState::Running,
        heartbeat_at: Some(NOW + 5.0),
        ..WorkerRecord::launched("i-adopted", "standard", adopted.key.clone(), 0.0, NOW)
    }))
    .unwrap();
    w.fleet.add_instance("i-adopted", adopted.key.clone());
    w.submit(1);
    // Room for one worker at $0.39/h, not two.
    let mut budget = cfg();
    budget.limits.max_usd_per_h = Some(0.5);
    // The scaler's run (no reaper): the row still reads price 0.
    let r = pollster::block_on(reconcile(
        &budget,
        &offerings(),
        &ReconcileOptions {
            reap: false,
            ..ReconcileOptions::default()
        },
        NOW + 10.0,
        &w.queue,
        &w.workers,
        &w.jobs,
        &w.fleet,
        &w.avail,
    ))
    .unwrap();
    assert!(r.acted.launched.is_empty(), "{r:?}");
    assert!(
        r.plan.held.iter().any(|h| matches!(
            h.reason,
            onoff_policy::Reason::BudgetBreaker { spend_usd_per_h, .. } if spend_usd_per_h == adopted.price_usd_per_h
        )),
        "{:?}",
        r.plan.held
    );
    let registered = onoff_control::reconcile::worker_price_usd_per_h(
        &pollster::block_on(w.workers.get("i-adopted")).unwrap().unwrap(),
        &offerings(),
    );
    assert_eq!(registered, adopted.price_usd_per_h);
    // The reaper writes that price into the row, where the worker's agent reads it to charge its
    // jobs; a row with a price keeps its own.
    assert_eq!(w.workers.records()["i-adopted"].price_usd_per_h, 0.0);
    w.reconcile(NOW + 20.0, true);
    assert_eq!(
        w.workers.records()["i-adopted"].price_usd_per_h,
        adopted.price_usd_per_h
    );
    assert!(!pollster::block_on(w.workers.set_price_if_unpriced("i-adopted", 9.0)).unwrap());
    assert_eq!(
        w.workers.records()["i-adopted"].price_usd_per_h,
        adopted.price_usd_per_h
    );
}

#[test]
fn idle_workers_past_the_keep_alive_are_released() {
    let w = World::new();
    // The job ran and finished; the worker has been idle since +500 s.
    let id = w.one_job_done(NOW + 400.0);
    w.workers
        .agent_heartbeat(&id, WorkerState::Idle, Some(NOW + 500.0), NOW + 1_000.0)
        .unwrap();
    let r = w.reconcile(NOW + 1_000.0, true);
    assert!(r.acted.terminated.is_empty(), "idle 500 s < 600 s: {:?}", r.plan);
    w.workers
        .agent_heartbeat(&id, WorkerState::Idle, Some(NOW + 500.0), NOW + 1_150.0)
        .unwrap();
    let r = w.reconcile(NOW + 1_160.0, true);
    assert_eq!(r.acted.terminated, vec![id.clone()]);
    assert!(w.fleet.running().is_empty());
}

#[test]
fn an_idle_worker_the_policy_keeps_is_held_and_the_hold_renewed_but_not_once_it_is_released() {
    let w = World::new();
    let id = w.one_job_done(NOW + 400.0);
    let opts = ReconcileOptions {
        hold_s: 300.0,
        ..ReconcileOptions::default()
    };
    let hold = |w: &World| w.workers.records()[&id].hold_until;
    // Idle since +900 s; the keep-alive is 600 s. At +1,000 s it is kept: held to +1,300 s.
    let at = |w: &World, t: f64| {
        w.workers
            .agent_heartbeat(&id, WorkerState::Idle, Some(NOW + 900.0), NOW + t)
            .unwrap();
        w.reconcile_opts(&offerings(), &opts, NOW + t)
    };
    let r = at(&w, 1_000.0);
    assert!(r.acted.terminated.is_empty(), "{:?}", r.plan);
    assert_eq!(r.workers_held, vec![id.clone()]);
    assert_eq!(hold(&w), Some(NOW + 1_300.0));
    // 240 s of the hold left (more than two thirds of 300 s): not written again.
    let r = at(&w, 1_060.0);
    assert!(r.workers_held.is_empty());
    assert_eq!(hold(&w), Some(NOW + 1_300.0));
    // 190 s left: renewed.
    let r = at(&w, 1_110.0);
    assert_eq!(r.workers_held, vec![id.clone()]);
    assert_eq!(hold(&w), Some(NOW + 1_410.0));
    // Past the keep-alive (idle 610 s), with the hold due again: released, not held.
    let r = at(&w, 1_510.0);
    assert_eq!(r.acted.terminated, vec![id.clone()]);
    assert!(r.workers_held.is_empty());
    assert_eq!(hold(&w), Some(NOW + 1_410.0));
    // A worker the plan releases is not held, even when its termination fails (left to its
    // agent's idle exit).
    let w2 = World::new();
    let id2 = w2.one_job_done(NOW + 50.0);
    w2.workers
        .agent_heartbeat(&id2, WorkerState::Idle, Some(NOW + 100.0), NOW + 800.0)
        .unwrap();
    w2.fleet.fail_next(FleetError {
        kind: FleetErrorKind::Other,
        message: "UnauthorizedOperation".into(),
    });
    let r = w2.reconcile_opts(&offerings(), &opts, NOW + 800.0);
    assert!(r
        .plan
        .actions
        .iter()
        .any(|a| matches!(a, Action::Terminate { worker, .. } if *worker == id2)));
    assert!(r.acted.terminated.is_empty(), "{:?}", r.acted);
    assert!(r.workers_held.is_empty());
    assert_eq!(w2.workers.records()[&id2].hold_until, None);
    // A busy worker is never held.
    let w = World::new();
    w.submit(1);
    w.reconcile(NOW + 1.0, false);
    let id = w.workers.records().keys().next().unwrap().clone();
    w.workers
        .agent_heartbeat(&id, WorkerState::Running, None, NOW + 500.0)
        .unwrap();
    let r = w.reconcile_opts(&offerings(), &opts, NOW + 500.0);
    assert!(r.workers_held.is_empty());
    assert_eq!(w.workers.records()[&id].hold_until, None);
}

#[test]
fn two_scalers_at_once_launch_once() {
    use onoff_control::fake::FakeLease;
    use onoff_control::reconcile::reconcile_exclusive;
    let w = World::new();
    w.submit(4);
    let lease = FakeLease::default();
    let opts = ReconcileOptions {
        reap: false,
        ..ReconcileOptions::default()
    };
    // Invocation A holds the lease while B arrives: B does nothing.
    assert!(pollster::block_on(onoff_control::ports::Lease::acquire(
        &lease,
        "reconcile",
        "A",
        60.0,
        NOW
    ))
    .unwrap());
    let b = pollster::block_on(reconcile_exclusive(
        &cfg(),
        &offerings(),
        &opts,
        NOW + 1.0,
        "B",
        60.0,
        &w.queue,
        &w.workers,
        &w.jobs,
        &w.fleet,
        &w.avail,
        &lease,
    ))
    .unwrap();
    assert!(b.is_none());
    let a = pollster::block_on(reconcile_exclusive(
        &cfg(),
        &offerings(),
        &opts,
        NOW + 2.0,
        "A",
        60.0,
        &w.queue,
        &w.workers,
        &w.jobs,
        &w.fleet,
        &w.avail,
        &lease,
    ))
    .unwrap()
    .unwrap();
    assert_eq!(a.acted.launched.len(), 4);
    // A released it; B's next invocation runs and finds the booting workers: no launch.
    let b = pollster::block_on(reconcile_exclusive(
        &cfg(),
        &offerings(),
        &opts,
        NOW + 3.0,
        "B",
        60.0,
        &w.queue,
        &w.workers,
        &w.jobs,
        &w.fleet,
        &w.avail,
        &lease,
    ))
    .unwrap()
    .unwrap();
    assert!(b.acted.launched.is_empty());
    assert_eq!(w.fleet.running().len(), 4);
}

/// A run reads the count of scale requests before it reads the backlog and, once done, ends the
/// pending request only when none came in meanwhile; one that came in (its jobs perhaps queued
/// after the run read the backlog) keeps the request pending, and the asker's next ask joins it.
#[test]
fn a_run_settles_the_scale_requests_it_saw_and_leaves_one_that_came_in_during_it() {
    use onoff_control::fake::FakeLease;
    use onoff_control::ports::{Lease, ScaleAsk};
    use onoff_control::reconcile::RECONCILE_LEASE;
    let w = World::new();
    let lease = FakeLease::default();
    let run = |now: f64| w.scaler_run(&lease, now);
    let ask = |now: f64| pollster::block_on(lease.ask(RECONCILE_LEASE, &[], now, 30.0)).unwrap();
    // No ask ever: nothing pending, settled.
    assert_eq!(run(NOW).unwrap().asks_settled, Some(true));
    // Two submissions: the first invokes, the second joins.
    w.submit(1);
    assert_eq!(ask(NOW + 1.0), ScaleAsk::Invoke);
    w.submit(1);
    assert_eq!(ask(NOW + 2.0), ScaleAsk::Joined);
    // A third comes in while the run is under way: not settled, still pending, and an ask now
    // joins the pending one.
    lease.ask_during_next_run(1);
    let r = run(NOW + 3.0).unwrap();
    assert!(
        !r.acted.launched.is_empty(),
        "it launched for the jobs it saw: {:?}",
        r.acted
    );
    assert_eq!(r.asks_settled, Some(false));
    assert_eq!(lease.pending_ask(RECONCILE_LEASE), Some(NOW + 1.0));
    assert_eq!(ask(NOW + 4.0), ScaleAsk::Joined);
    // The run that goes again sees every ask and ends the pending one: the next ask invokes.
    assert_eq!(run(NOW + 5.0).unwrap().asks_settled, Some(true));
    assert_eq!(lease.pending_ask(RECONCILE_LEASE), None);
    assert_eq!(ask(NOW + 6.0), ScaleAsk::Invoke);
    // A pending ask whose run never came (a lost invoke) lapses after its stale time.
    assert_eq!(ask(NOW + 20.0), ScaleAsk::Joined);
    assert_eq!(ask(NOW + 40.0), ScaleAsk::Invoke);
    assert_eq!(lease.pending_ask(RECONCILE_LEASE), Some(NOW + 40.0));
    // A run that cannot take the lease settles nothing.
    assert!(pollster::block_on(lease.acquire(RECONCILE_LEASE, "other", 60.0, NOW + 41.0)).unwrap());
    assert!(run(NOW + 42.0).is_none());
    assert_eq!(lease.pending_ask(RECONCILE_LEASE), Some(NOW + 40.0));
    // Ended whatever the count (a scaler that gives up): the next ask invokes.
    pollster::block_on(lease.drop_pending_ask(RECONCILE_LEASE)).unwrap();
    assert_eq!(ask(NOW + 43.0), ScaleAsk::Invoke);
}

/// The `active` index is eventually consistent: the run a submission's scale request invokes may
/// list the backlog before the new job reaches the index. The ask keeps the job's id, and the run
/// reads that row by id, so it launches for the job instead of settling the request without it
/// (the job would wait for the next scheduled run). A job the index still lists after it ended is
/// dropped the same way.
#[test]
fn a_scale_request_s_run_launches_for_its_jobs_before_the_index_shows_them() {
    use onoff_control::fake::FakeLease;
    use onoff_control::ports::{Lease, ScaleAsk};
    use onoff_control::reconcile::RECONCILE_LEASE;
    let run = |w: &World, lease: &FakeLease, now: f64| w.scaler_run(lease, now).expect("the lease is free");
    // (the ask keeps the job's id, workers launched by the run the ask invoked)
    for (with_ids, launched) in [(false, 0), (true, 1)] {
        let w = World::new();
        let lease = FakeLease::default();
        w.jobs.lag_index();
        let ids = w.submit(1);
        let asked: &[String] = if with_ids { &ids } else { &[] };
        let ask = pollster::block_on(lease.ask(RECONCILE_LEASE, asked, NOW + 1.0, 30.0)).unwrap();
        assert_eq!(ask, ScaleAsk::Invoke);
        let r = run(&w, &lease, NOW + 2.0);
        assert_eq!(r.acted.launched.len(), launched, "ids kept {with_ids}: {r:?}");
        assert_eq!(r.asks_settled, Some(true));
        assert_eq!(r.jobs_read_past_index, asked.to_vec());
        // Decided: forgotten, so later runs do not read it again.
        assert!(pollster::block_on(lease.asks(RECONCILE_LEASE)).unwrap().jobs.is_empty());
    }
    // The index still lists a job that has ended: the asked row wins, nothing is launched for it.
    let w = World::new();
    let lease = FakeLease::default();
    let ids = w.submit(1);
    w.jobs.lag_index();
    pollster::block_on(w.jobs.transition(&ids[0], JobState::Queued, JobState::Cancelled)).unwrap();
    pollster::block_on(lease.ask(RECONCILE_LEASE, &ids, NOW + 1.0, 30.0)).unwrap();
    let r = run(&w, &lease, NOW + 2.0);
    assert!(r.acted.launched.is_empty(), "{r:?}");
    assert_eq!(r.jobs_read_past_index, ids);
    // Asks repeat ids (a resubmission) and may name a row that does not parse: each row is read
    // once, and the unreadable one is named among the errors without holding up the others.
    let w = World::new();
    let lease = FakeLease::default();
    w.jobs.lag_index();
    let ids = w.submit(2);
    w.jobs.put_unreadable("job-bad", "spec: not JSON");
    let asked = [ids[0].clone(), ids[1].clone(), ids[0].clone(), "job-bad".to_string()];
    pollster::block_on(lease.ask(RECONCILE_LEASE, &asked, NOW + 1.0, 30.0)).unwrap();
    let r = run(&w, &lease, NOW + 2.0);
    assert_eq!(r.acted.launched.len(), 2, "{r:?}");
    assert_eq!(r.jobs_read_past_index, ids);
    assert!(
        r.errors.iter().any(|e| e.contains("job-bad") && e.contains("not JSON")),
        "{:?}",
        r.errors
    );
    // The read itself fails (DynamoDB keeps leaving the keys unprocessed): the run decides on the
    // listing, and the ids stay asked for, so the next run reads them and launches.
    let w = World::new();
    let lease = FakeLease::default();
    w.jobs.lag_index();
    let ids = w.submit(1);
    pollster::block_on(lease.ask(RECONCILE_LEASE, &ids, NOW + 1.0, 30.0)).unwrap();
    w.jobs.fail_next_get_many(onoff_control::ports::StoreError::Other(
        "get jobs: 1 keys still unprocessed".into(),
    ));
    let r = run(&w, &lease, NOW + 2.0);
    assert!(r.acted.launched.is_empty() && r.asked_jobs_unread, "{r:?}");
    assert!(
        r.errors.iter().any(|e| e.contains("read the 1 asked jobs")),
        "{:?}",
        r.errors
    );
    assert_eq!(pollster::block_on(lease.asks(RECONCILE_LEASE)).unwrap().jobs, ids);
    let r = run(&w, &lease, NOW + 3.0);
    assert_eq!(r.acted.launched.len(), 1, "{r:?}");
    assert!(!r.asked_jobs_unread);
    assert!(pollster::block_on(lease.asks(RECONCILE_LEASE)).unwrap().jobs.is_empty());
}

/// A pending row whose message is gone (never sent, lost, expired) is a "ghost": without a
/// message no worker ever claims it, and the policy keeps capacity matched to it forever. The
/// reaper sends a fresh message within two lease periods of the last one, and not before.
#[test]
fn a_ghost_row_gets_a_fresh_message_within_two_lease_periods() {
    let w = World::new();
    let ids = w.submit(2);
    assert_eq!(w.queue.sent().len(), 2);
    // Both messages are lost (retention, the dead-letter queue, a hand-deleted message): the rows
    // stay QUEUED.
    assert_eq!(w.queue.lose("standard", None), 2);
    let lease = ReconcileOptions::default().resend_after_s / 2.0;
    let r = w.reconcile(NOW + lease, true);
    assert!(r.jobs_woken.is_empty(), "too early: {r:?}");
    assert_eq!(w.queue.sent().len(), 2);
    let r = w.reconcile(NOW + 2.0 * lease, true);
    assert_eq!(r.jobs_woken.len(), 2, "{r:?}");
    assert_eq!(r.wake_ups_spared, 0);
    let sent = w.queue.sent();
    assert_eq!(sent.len(), 4);
    for id in &ids {
        assert!(sent[2..].iter().any(|(_, b)| b.contains(id.as_str())));
        assert_eq!(w.jobs.records()[id].sent_at, Some(NOW + 2.0 * lease));
    }
    // Not again until two more lease periods have passed.
    assert!(w.reconcile(NOW + 3.0 * lease, true).jobs_woken.is_empty());
    // A worker receives the first job's message and claims it; the second's is lost again. A job
    // claimed is not pending: no message for it.
    let body = w.queue.receive("standard").unwrap();
    assert!(body.contains(ids[0].as_str()), "{body}");
    let Claim::Claimed(_) = pollster::block_on(w.jobs.claim(&ids[0], "i-a", NOW + 9e9, NOW)).unwrap() else {
        panic!()
    };
    assert_eq!(w.queue.lose("standard", None), 1);
    let r = w.reconcile(NOW + 4.0 * lease, true);
    assert_eq!(r.jobs_woken, vec![ids[1].clone()]);
}

/// A job whose message waits in its lane's queue (a backlog behind `max_workers`, a budget
/// breaker, a frozen deployment) is not sent another every two lease periods: the queue's count
/// shows the message is there. Only as many jobs as the queue is short of get one, the longest
/// without a message first; when the count cannot be read, every due job does.
#[test]
fn a_job_whose_message_waits_in_its_queue_is_not_sent_another() {
    let w = World::new();
    let ids = w.submit(3);
    let resend = ReconcileOptions::default().resend_after_s;
    // Ten resend periods of waiting with every message in the queue: no duplicate.
    for k in 1..=10 {
        let r = w.reconcile(NOW + f64::from(k) * resend, true);
        assert!(r.jobs_woken.is_empty(), "period {k}: {r:?}");
        assert_eq!(r.wake_ups_spared, 3, "period {k}");
    }
    assert_eq!(w.queue.sent().len(), 3);
    // One message is received and its job run; the message of another is lost. The queue holds
    // one message for two pending jobs: one fresh message, to the job that waited longest without
    // one (all were sent at submission: the first by id). That is the job whose message was not
    // lost: it now has two and the other none, which the count cannot tell.
    let body = w.queue.receive("standard").unwrap();
    let ran = ids.iter().find(|id| body.contains(id.as_str())).unwrap().clone();
    pollster::block_on(w.jobs.claim(&ran, "i-a", NOW + 9e9, NOW)).unwrap();
    pollster::block_on(w.jobs.transition(&ran, JobState::Running, JobState::Succeeded)).unwrap();
    let mut pending: Vec<String> = ids.iter().filter(|id| **id != ran).cloned().collect();
    pending.sort();
    let (first, other) = (&pending[0], &pending[1]);
    assert_eq!(w.queue.lose("standard", Some(other)), 1);
    let t = NOW + 11.0 * resend;
    let r = w.reconcile(t, true);
    assert_eq!(r.jobs_woken, vec![first.clone()], "{r:?}");
    assert_eq!(r.wake_ups_spared, 1);
    assert_eq!(w.jobs.records()[first].sent_at, Some(t));
    // Workers drain the queue: a claim, then the duplicate dropped. The count falls below the
    // pending jobs, and the next run sends the missing message.
    for _ in 0..2 {
        let body = w.queue.receive("standard").unwrap();
        assert!(body.contains(first.as_str()), "{body}");
        pollster::block_on(w.jobs.claim(first, "i-b", NOW + 9e9, t)).unwrap();
    }
    let r = w.reconcile(t + 60.0, true);
    assert_eq!(r.jobs_woken, vec![other.clone()], "{r:?}");
    assert_eq!(
        w.queue.receive("standard").as_deref(),
        Some(wake_up_body(other, 1, t + 60.0).as_str())
    );
    // The count cannot be read: every due job of the lane gets a fresh message, and the error
    // says why.
    let w = World::new();
    w.submit(2);
    w.queue.fail_next_backlog("throttled");
    let r = w.reconcile(NOW + resend, true);
    assert_eq!(r.jobs_woken.len(), 2, "{r:?}");
    assert!(
        r.errors
            .iter()
            .any(|e| e.contains("backlog of lane standard: throttled")),
        "{r:?}"
    );
}

#[test]
fn an_unreadable_row_is_skipped_and_counted_and_scaling_goes_on() {
    let w = World::new();
    w.submit(1);
    w.jobs.put_unreadable("job-garbled", "spec is not JSON");
    let r = w.reconcile(NOW + 200.0, true);
    assert_eq!(
        r.unreadable,
        vec![("job-garbled".to_string(), "spec is not JSON".to_string())]
    );
    assert_eq!(r.acted.launched.len(), 1, "{r:?}");
}

/// A job that takes its worker down loses its lease every time: after `max_lease_expiries` it is
/// FAILED with a reason, so it cannot boot GPUs forever.
#[test]
fn a_job_that_keeps_losing_its_lease_is_failed_after_the_bound() {
    let w = World::new();
    let id = w.submit(1).remove(0);
    let max = ReconcileOptions::default().limits.max_lease_expiries;
    let mut t = NOW;
    for round in 1..=max {
        let Claim::Claimed(_) = pollster::block_on(w.jobs.claim(&id, "i-a", t + 60.0, t)).unwrap() else {
            panic!("round {round}")
        };
        t += 61.0;
        let r = w.reconcile(t, true);
        let rec = &w.jobs.records()[&id];
        assert_eq!(rec.lease_expiries, round);
        assert_eq!(rec.attempts, 0, "a lost lease is not a failed attempt");
        if round < max {
            assert_eq!((rec.state, r.jobs_requeued.len()), (JobState::Queued, 1));
        } else {
            assert_eq!((rec.state, r.jobs_failed.clone()), (JobState::Failed, vec![id.clone()]));
            assert!(rec.reason.as_deref().unwrap().contains("lost its worker"), "{rec:?}");
        }
    }
}

#[test]
fn short_jobs_queue_behind_a_worker_whose_job_ends_within_the_horizon() {
    // A worker runs a job claimed at +100 s; three 10 s jobs arrive at +110 s. When the running
    // job declared 30 s (ends at +130 s, within the 120 s short-job horizon) they wait for that
    // worker; when it declared an hour they get a worker (one: short jobs share it).
    // (declared run time of the running job, launches)
    for (running_job_s, want) in [(30.0, 0usize), (3600.0, 1)] {
        let w = World::new();
        let first = w.submit_timed("first", running_job_s);
        w.running_on_its_worker(&first);
        for i in 0..3 {
            w.submit_timed(&format!("short{i}"), 10.0);
        }
        let r = w.reconcile(NOW + 110.0, false);
        assert_eq!(
            r.acted.launched.len(),
            want,
            "running job of {running_job_s} s: {:?}",
            r.plan
        );
    }
}

/// A new account with no G and VT spot quota. The first run's decision waits for spot (a long
/// job's on-demand premium is worth more than the wait, as after a capacity error), and its
/// refused launch marks every G spot offering and names the quota; from the next run on the jobs
/// run on on-demand (no spot offering is left to wait for), and EC2 gets no G spot launch while
/// the marks last.
#[test]
fn with_no_spot_quota_jobs_run_on_demand_from_the_next_run_and_the_quota_is_named() {
    use onoff_control::fake::FleetCall;
    use onoff_control::quota::QuotaBucket;
    let mut offs = offerings();
    for o in offerings() {
        offs.push(Offering {
            key: OfferingKey {
                instance_type: "g6.xlarge".into(),
                ..o.key.clone()
            },
            price_usd_per_h: 0.45,
            ..o.clone()
        });
        offs.push(Offering {
            key: OfferingKey {
                capacity_type: CapacityType::OnDemand,
                ..o.key.clone()
            },
            price_usd_per_h: 1.006,
            ..o
        });
    }
    let w = World::new();
    w.fleet
        .set_vcpu_quota(QuotaBucket::GAndVt, CapacityType::Spot, 0, &offs);
    let spot_calls = || {
        w.fleet
            .calls()
            .iter()
            .filter(|c| matches!(c, FleetCall::Launch(r) if r.offerings[0].capacity_type == CapacityType::Spot))
            .count()
    };
    w.submit(2);
    let r = w.reconcile_with(&offs, NOW + 1.0, false);
    assert!(r.acted.launched.is_empty(), "{r:?}");
    assert_eq!(
        r.acted.quotas_full,
        ["All G and VT Spot Instance Requests (L-3819A6DF)"]
    );
    assert_eq!(spot_calls(), 1, "{:?}", w.fleet.calls());
    for t in [NOW + 60.0, NOW + 120.0] {
        let r = w.reconcile_with(&offs, t, false);
        assert!(r.acted.quotas_full.is_empty(), "{r:?}");
        assert!(r
            .acted
            .launched
            .iter()
            .all(|l| l.launched.offering.capacity_type == CapacityType::OnDemand));
    }
    assert_eq!(w.fleet.running().len(), 2, "{:?}", w.fleet.calls());
    assert_eq!(spot_calls(), 1, "{:?}", w.fleet.calls());
}

/// A spot quota our small workers fill, and an 8-GPU job (stop 64's every-fault run: a 32-vCPU
/// G spot quota, 1-GPU spot workers, an 8-GPU job that tried a 192-vCPU spot type every 180 s for
/// about 20 minutes). A small type refused while ours hold 8 vCPUs says the room left to us is
/// under 12 vCPUs: from the next run on, the 192-vCPU spot type is no choice even while our
/// workers hold the quota, and the 8-GPU job runs on on-demand.
#[test]
fn a_type_a_spot_quota_can_never_fit_runs_on_demand_while_our_workers_hold_the_quota() {
    use onoff_control::fake::FleetCall;
    use onoff_control::quota::QuotaBucket;
    let small = offerings();
    let mut offs = small.clone();
    for capacity_type in [CapacityType::Spot, CapacityType::OnDemand] {
        offs.push(Offering {
            key: OfferingKey {
                instance_type: "g5.48xlarge".into(),
                zone: "us-east-1a".into(),
                capacity_type,
            },
            gpus: 8,
            vcpus: 192,
            price_usd_per_h: if capacity_type == CapacityType::Spot {
                5.0
            } else {
                16.288
            },
            ..small[0].clone()
        });
    }
    let w = World::new();
    w.fleet
        .set_vcpu_quota(QuotaBucket::GAndVt, CapacityType::Spot, 8, &offs);
    let big_launches = |capacity: CapacityType| {
        w.fleet
            .calls()
            .iter()
            .filter(|c| {
                matches!(c, FleetCall::Launch(r)
                    if r.offerings.iter().any(|k| k.instance_type == "g5.48xlarge" && k.capacity_type == capacity))
            })
            .count()
    };
    // Two 1-GPU jobs: two 4-vCPU spot workers fill the quota.
    w.submit(2);
    let r = w.reconcile_with(&offs, NOW + 1.0, false);
    assert_eq!(r.acted.launched.len(), 2, "{r:?}");
    // A third 1-GPU job and an 8-GPU one: both refused on spot.
    w.submit_one("third", NOW + 30.0, None);
    let spec = r#"{"image":"i","command":["x"],"project":"p","client_token":"big","gpus":8}"#;
    let src = Source::Sqs {
        message_id: "m-big".into(),
    };
    pollster::block_on(submit(spec, &src, &["standard"], NOW + 30.0, &w.jobs, &w.queue)).unwrap();
    let r = w.reconcile_with(&offs, NOW + 60.0, false);
    assert!(!r.acted.quotas_full.is_empty(), "{r:?}");
    let spot_tries = big_launches(CapacityType::Spot);
    let refused_small =
        r.acted.errors.iter().any(|e| {
            e.contains("g5.xlarge") && e.contains("types of 12 vCPUs or more would not fit even once they end")
        });
    assert!(refused_small, "{:?}", r.acted.errors);
    // While the marks last and our workers still hold the quota: on-demand, no spot try.
    let r = w.reconcile_with(&offs, NOW + 120.0, false);
    let big: Vec<_> = r
        .acted
        .launched
        .iter()
        .filter(|l| l.launched.offering.instance_type == "g5.48xlarge")
        .collect();
    assert_eq!(big.len(), 1, "{r:?}");
    assert_eq!(big[0].launched.offering.capacity_type, CapacityType::OnDemand);
    assert_eq!(big_launches(CapacityType::Spot), spot_tries, "{:?}", w.fleet.calls());
}

/// A world of two lanes, `express` on-demand (its `quota_wait_limit_s` as given) and `standard`
/// spot-first, no predictive pool.
fn quota_world(quota_wait_limit_s: Option<f64>) -> World {
    let lane = |name: &str, capacity| LaneConfig {
        name: name.into(),
        capacity,
        predictive_max: 0,
        quota_wait_limit_s,
        ..LaneConfig::default()
    };
    World {
        cfg: PolicyConfig {
            lanes: vec![
                lane("express", onoff_policy::CapacityPreference::OnDemand),
                lane("standard", onoff_policy::CapacityPreference::SpotFirst),
            ],
            ..cfg()
        },
        ..World::new()
    }
}

/// g5.xlarge (1 GPU, 4 vCPUs) and g5.48xlarge (8 GPUs, 192 vCPUs), spot and on-demand, in one
/// zone; `w`'s fleet refuses on-demand G launches past 96 vCPUs, as EC2 refuses them past the
/// account's quota: no 8-GPU instance ever fits on-demand.
fn g5_offerings_in_a_96_vcpu_on_demand_quota(w: &World) -> Vec<Offering> {
    let small = offerings();
    let mut offs = Vec::new();
    for capacity_type in [CapacityType::Spot, CapacityType::OnDemand] {
        for (instance_type, gpus, vcpus) in [("g5.xlarge", 1, 4), ("g5.48xlarge", 8, 192)] {
            offs.push(Offering {
                key: OfferingKey {
                    instance_type: instance_type.into(),
                    zone: "us-east-1a".into(),
                    capacity_type,
                },
                gpus,
                vcpus,
                price_usd_per_h: f64::from(gpus) * if capacity_type == CapacityType::Spot { 0.4 } else { 1.0 },
                ..small[0].clone()
            });
        }
    }
    w.fleet.set_vcpu_quota(
        onoff_control::quota::QuotaBucket::GAndVt,
        CapacityType::OnDemand,
        96,
        &offs,
    );
    offs
}

/// Submit a job to `lane` of `w` at `at` (`extra`: more JSON fields, each after a comma); its id.
fn submit_to(w: &World, lane: &str, token: &str, extra: &str, at: f64) -> String {
    let spec =
        format!(r#"{{"image":"i","command":["x"],"project":"p","client_token":"{token}","lane":"{lane}"{extra}}}"#);
    let src = Source::Sqs {
        message_id: format!("m-{token}"),
    };
    let lanes: Vec<&str> = w.cfg.lanes.iter().map(|l| l.name.as_str()).collect();
    pollster::block_on(submit(&spec, &src, lanes.as_slice(), at, &w.jobs, &w.queue))
        .unwrap()
        .id()
        .to_string()
}

/// An on-demand lane whose 8-GPU jobs no on-demand quota of the account can hold (stop 68's
/// two-lane run: a 96-vCPU on-demand G quota, an 8-GPU express job, g5.48xlarge's 192 vCPUs):
/// after the refused launch, the job is held for want of any offering, and the report says the
/// quota is why, with its code, so the handlers' log names the quota to raise. A 1-GPU job of the
/// same lane runs; an 8-GPU job no offering fits for its own asks (GPU memory) is not put on the
/// quota.
#[test]
fn a_job_only_a_full_quota_keeps_from_every_offering_is_reported_with_the_quota() {
    use onoff_control::quota::{BlockedByQuotas, QuotaBucket, QuotaMark};
    let w = quota_world(None);
    let offs = g5_offerings_in_a_96_vcpu_on_demand_quota(&w);
    let express = |token: &str, extra: &str, at: f64| submit_to(&w, "express", token, extra, at);
    express("big", r#","gpus":8"#, NOW);
    let r = w.reconcile_with(&offs, NOW + 1.0, false);
    assert!(r.acted.launched.is_empty(), "{r:?}");
    assert_eq!(
        r.acted.quotas_full,
        ["Running On-Demand G and VT instances (L-DB2E81BA)"]
    );
    assert!(
        r.blocked_by_quotas.is_empty(),
        "the run's catalogue still had it: {r:?}"
    );

    express("small", "", NOW + 30.0);
    express("roomy", r#","gpus":8,"min_gpu_memory_gib":40"#, NOW + 30.0);
    let r = w.reconcile_with(&offs, NOW + 60.0, false);
    let launched: Vec<&OfferingKey> = r.acted.launched.iter().map(|l| &l.launched.offering).collect();
    assert_eq!(launched, [&offs[2].key], "the 1-GPU job on on-demand g5.xlarge: {r:?}");
    let mark = QuotaMark {
        bucket: QuotaBucket::GAndVt,
        capacity: CapacityType::OnDemand,
        vcpus: 192,
        until: NOW + 1.0 + w.cfg.offers.unavailable_ttl_s,
        ceiling: Some(192),
    };
    assert_eq!(
        r.blocked_by_quotas,
        [BlockedByQuotas {
            lane: "express".into(),
            gpus: 8,
            min_gpu_memory_gib: w.cfg.offers.min_gpu_memory_gib,
            held: 1,
            quotas: vec![mark],
        }],
        "{:?}",
        r.plan.held
    );
    let said = r.blocked_by_quotas[0].to_string();
    assert!(
        said.starts_with("lane express: 1 held for want of an offering of 8 GPU(s) per instance, a full vCPU quota leaving out every one: ")
            && said.contains("\"Running On-Demand G and VT instances\" (L-DB2E81BA)")
            && said.contains("--quota-code L-DB2E81BA"),
        "{said}"
    );
    // The 8-GPU job asking 40 GiB per GPU is held for want of an offering too, on its own
    // account: no g5 has 40 GiB per GPU, left out or not.
    let no_offering = r
        .plan
        .held
        .iter()
        .filter(|h| matches!(h.reason, onoff_policy::Reason::NoOffering { .. }))
        .map(|h| h.count)
        .sum::<u32>();
    assert_eq!(no_offering, 2, "{:?}", r.plan.held);
}

/// A lane's `quota_wait_limit_s`: a job full quotas keep from every offering its lane may launch
/// for it is ended FAILED by the reaper once it has waited that long, with the quota to raise in
/// its reason; a job no offering fits for its own asks, a job of a lane without the limit, one
/// younger than the limit and one a worker of the lane could run wait on. Only the reaper ends
/// them (the scaler's runs do not).
#[test]
fn a_job_a_full_quota_blocks_past_its_lanes_wait_limit_is_failed_with_the_quota_by_the_reaper() {
    // 100 s: within the quota mark's 180 s (offers.unavailable_ttl_s), so one mark covers it.
    let mut w = quota_world(Some(100.0));
    w.cfg.lanes[1].capacity = onoff_policy::CapacityPreference::OnDemand;
    w.cfg.lanes[1].quota_wait_limit_s = None;
    let offs = g5_offerings_in_a_96_vcpu_on_demand_quota(&w);
    let big = submit_to(&w, "express", "big", r#","gpus":8"#, NOW);
    let roomy = submit_to(&w, "express", "roomy", r#","gpus":8,"min_gpu_memory_gib":40"#, NOW);
    let unlimited = submit_to(&w, "standard", "unlimited", r#","gpus":8"#, NOW);
    let state = |id: &str| pollster::block_on(w.jobs.get(id)).unwrap().unwrap();
    // The first launch is refused (the quota marked); before the limit nothing is ended.
    let r = w.reconcile_with(&offs, NOW + 1.0, true);
    assert!(!r.acted.quotas_full.is_empty(), "{r:?}");
    let r = w.reconcile_with(&offs, NOW + 60.0, true);
    assert!(!r.blocked_by_quotas.is_empty(), "{r:?}");
    assert!(r.jobs_past_quota_wait.is_empty(), "{r:?}");
    // Past the limit, while the mark holds: the scaler's run (no reaper) ends nothing, the
    // reconciler's ends the blocked express job.
    let t = NOW + 150.0;
    let r = w.reconcile_with(&offs, t, false);
    assert!(r.jobs_past_quota_wait.is_empty(), "{r:?}");
    let r = w.reconcile_with(&offs, t, true);
    let ended: Vec<&str> = r.jobs_past_quota_wait.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ended, [big.as_str()], "{r:?}");
    let row = state(&big);
    assert_eq!((row.state, row.finished_at), (JobState::Failed, Some(t)));
    let why = row.reason.unwrap();
    assert!(
        why.starts_with("waited 150 s, past lane express's quota_wait_limit_s of 100 s")
            && why.contains("8 GPU(s) per instance")
            && why.contains("--quota-code L-DB2E81BA"),
        "{why}"
    );
    assert_eq!(r.jobs_past_quota_wait[0].1, why);
    for id in [&roomy, &unlimited] {
        assert_eq!(state(id).state, JobState::Queued, "{id}");
    }
    assert!(
        pollster::block_on(w.jobs.active())
            .unwrap()
            .items
            .iter()
            .all(|j| j.id != big),
        "out of the active index"
    );
    // A job a worker of its lane could run waits on, even past the limit: an 8-GPU express worker
    // booting (registered as a launch would register it). The mark lapsed: the next run's launch
    // is refused again and marks the quota anew.
    let later = submit_to(&w, "express", "later", r#","gpus":8"#, t);
    let r = w.reconcile_with(&offs, NOW + 190.0, true);
    assert!(!r.acted.quotas_full.is_empty(), "{r:?}");
    let booting = WorkerRecord::launched(
        "i-big",
        "express",
        offs[3].key.clone(),
        offs[3].price_usd_per_h,
        NOW + 300.0,
    );
    pollster::block_on(w.workers.register_launch(booting)).unwrap();
    let r = w.reconcile_with(&offs, NOW + 300.0, true);
    assert!(
        !r.blocked_by_quotas.is_empty(),
        "the mark holds: standard's job is on it: {r:?}"
    );
    assert!(r.jobs_past_quota_wait.is_empty(), "{r:?}");
    assert!(state(&later).state.is_pending());
}

/// What `onoff status` tells of a waiting job: the offerings its lane may launch for it, and of
/// those the ones in a full vCPU quota (with the quota) or skipped after a capacity error (until
/// when), from the marks as the control table stores them; lapsed marks count for nothing.
#[test]
fn a_waiting_jobs_offerings_are_told_apart_by_the_stored_marks() {
    use onoff_control::quota::{QuotaBucket, QuotaMark};
    use onoff_control::reconcile::offerings_for;
    use onoff_policy::UnavailableOffering;
    let mut cfg = cfg();
    cfg.lanes = vec![LaneConfig {
        name: "express".into(),
        capacity: onoff_policy::CapacityPreference::OnDemand,
        ..LaneConfig::default()
    }];
    let mut offs = Vec::new();
    for zone in ["us-east-1a", "us-east-1b"] {
        for capacity_type in [CapacityType::Spot, CapacityType::OnDemand] {
            for (instance_type, gpus, vcpus) in [("g5.xlarge", 1, 4), ("g5.48xlarge", 8, 192)] {
                offs.push(Offering {
                    key: OfferingKey {
                        instance_type: instance_type.into(),
                        zone: zone.into(),
                        capacity_type,
                    },
                    gpus,
                    vcpus,
                    ..offerings()[0].clone()
                });
            }
        }
    }
    let quota = QuotaMark {
        bucket: QuotaBucket::GAndVt,
        capacity: CapacityType::OnDemand,
        vcpus: 192,
        until: NOW + 100.0,
        ceiling: Some(192),
    };
    let od = |t: &str, z: &str| OfferingKey {
        instance_type: t.into(),
        zone: z.into(),
        capacity_type: CapacityType::OnDemand,
    };
    let marks = vec![
        UnavailableOffering {
            key: quota.key(),
            until: quota.until,
        },
        UnavailableOffering {
            key: od("g5.xlarge", "us-east-1a"),
            until: NOW + 50.0,
        },
        // Lapsed: counts for nothing.
        UnavailableOffering {
            key: od("g5.xlarge", "us-east-1b"),
            until: NOW - 1.0,
        },
    ];
    let spec = |extra: &str| -> onoff_control::job::JobSpec {
        serde_json::from_str(&format!(
            r#"{{"image":"i","command":["x"],"project":"p","lane":"express"{extra}}}"#
        ))
        .unwrap()
    };
    let big = offerings_for(&spec(r#","gpus":8"#), &cfg, &offs, marks.clone(), 8, NOW).unwrap();
    assert_eq!(
        (big.gpus_per_instance, big.eligible, big.in_full_quotas, big.free()),
        (8, 2, 2, 0),
        "{big:?}"
    );
    assert_eq!(big.quotas, [quota]);
    // Sixteen GPUs: two 8-GPU instances, the same offerings.
    let two = offerings_for(&spec(r#","gpus":16"#), &cfg, &offs, marks.clone(), 8, NOW).unwrap();
    assert_eq!((two.gpus_per_instance, two.in_full_quotas), (8, 2));
    let small = offerings_for(&spec(""), &cfg, &offs, marks.clone(), 8, NOW).unwrap();
    assert_eq!(
        (
            small.eligible,
            small.in_full_quotas,
            small.after_capacity_errors,
            small.free()
        ),
        (2, 0, 1, 1),
        "the on-demand g5.xlarge of each zone, one skipped: {small:?}"
    );
    assert_eq!(small.capacity_errors_until, Some(NOW + 50.0));
    assert!(small.quotas.is_empty());
    // Once the marks lapse, everything is free.
    let later = offerings_for(&spec(r#","gpus":8"#), &cfg, &offs, marks.clone(), 8, NOW + 200.0).unwrap();
    assert_eq!((later.eligible, later.free()), (2, 2));
    let mut other = spec("");
    other.lane = "batch".into();
    assert!(
        offerings_for(&other, &cfg, &offs, marks, 8, NOW).is_none(),
        "no such lane"
    );
}

#[test]
fn an_idle_worker_is_stopped_kept_through_the_reaper_and_started_again_for_the_next_job() {
    let w = World::stopping();
    // Idle 660 s > 600 s: stopped, not terminated.
    let (id, r) = w.idle_worker_released();
    assert_eq!(r.acted.stopped, vec![id.clone()], "{:?}", r.plan);
    assert!(r.acted.terminated.is_empty());
    let row = w.workers.records()[&id].clone();
    assert_eq!((row.state, row.idle_since), (WorkerState::Stopped, Some(NOW + 1_160.0)));
    assert!(row.hold_until.is_some_and(|h| h > NOW + 1_160.0));
    assert!(w.fleet.stopped().contains_key(&id));
    // Hours later, with no heartbeat since: the reaper neither terminates it as lost nor as gone
    // (a stopped instance is listed), nor is it held as an idle worker.
    let r = w.reconcile(NOW + 5_000.0, true);
    assert!(r.workers_lost.is_empty() && r.workers_gone.is_empty(), "{r:?}");
    assert!(r.orphans_terminated.is_empty() && r.workers_held.is_empty(), "{r:?}");
    assert_eq!(w.workers.records()[&id].state, WorkerState::Stopped);
    // A new job: the stopped worker is started for it rather than a launch.
    w.submit_timed("next", 3600.0);
    let r = w.reconcile(NOW + 5_060.0, true);
    assert_eq!(r.acted.started, vec![id.clone()], "{:?}", r.plan);
    assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
    let row = w.workers.records()[&id].clone();
    assert_eq!(
        (row.state, row.launched_at, row.heartbeat_at),
        (WorkerState::Pending, NOW + 5_060.0, None)
    );
    assert!(w.fleet.running().contains_key(&id));
    // Booting now: its boot deadline counts from the start, not from its first launch.
    let r = w.reconcile(NOW + 5_300.0, true);
    assert!(r.workers_lost.is_empty(), "{r:?}");
}

#[test]
fn a_stopped_worker_whose_volume_holds_the_jobs_project_cache_is_started_before_a_fresher_one() {
    // Two workers run a job each; `a` is stopped at NOW + 1,160, `b` at NOW + 1,220. Then a job
    // of project `p` comes: with no cache recorded the most recently stopped, `b`, is started;
    // with `a`'s agent having recorded `p` (and `b`'s another project), `a` is.
    for a_holds_p in [false, true] {
        let w = World::stopping();
        let jobs = w.submit(2);
        w.reconcile(NOW + 1.0, false);
        let ids: Vec<String> = w.workers.records().keys().cloned().collect();
        assert_eq!(ids.len(), 2, "one worker per job");
        let (a, b) = (&ids[0], &ids[1]);
        for (job, id) in jobs.iter().zip([a, b]) {
            pollster::block_on(w.jobs.claim(job, id, NOW + 10_000.0, NOW + 400.0)).unwrap();
            pollster::block_on(w.jobs.transition(job, JobState::Running, JobState::Succeeded)).unwrap();
        }
        w.workers
            .agent_heartbeat(a, WorkerState::Idle, Some(NOW + 500.0), NOW + 1_150.0)
            .unwrap();
        w.workers
            .agent_heartbeat(b, WorkerState::Idle, Some(NOW + 600.0), NOW + 1_150.0)
            .unwrap();
        let r = w.reconcile(NOW + 1_160.0, true);
        assert_eq!(r.acted.stopped, vec![a.clone()], "{:?}", r.plan);
        w.workers
            .agent_heartbeat(b, WorkerState::Idle, Some(NOW + 600.0), NOW + 1_210.0)
            .unwrap();
        let r = w.reconcile(NOW + 1_220.0, true);
        assert_eq!(r.acted.stopped, vec![b.clone()], "{:?}", r.plan);
        if a_holds_p {
            w.workers.set_cached_projects(a, &["p".into()]).unwrap();
            w.workers.set_cached_projects(b, &["q".into()]).unwrap();
        }
        w.submit_timed("next", 3600.0);
        let r = w.reconcile(NOW + 2_000.0, true);
        let want = if a_holds_p { a } else { b };
        assert_eq!(
            &r.acted.started,
            &vec![want.clone()],
            "cache recorded: {a_holds_p}; {:?}",
            r.plan
        );
        assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
    }
}

#[test]
fn a_job_arriving_while_ec2_still_stops_the_idle_worker_waits_for_it_rather_than_a_launch() {
    let w = World::stopping();
    let (id, r) = w.idle_worker_released();
    assert_eq!(r.acted.stopped, vec![id.clone()], "{:?}", r.plan);
    let stopped = w.workers.records()[&id].clone();
    // EC2 takes its time: the instance is still stopping when the next job comes 40 s later.
    w.fleet.set_still_stopping(&id);
    w.submit_timed("next", 3600.0);
    let r = w.reconcile(NOW + 1_200.0, true);
    // The start is refused and held: nothing launched, no error, the offering still available,
    // and the row as the stop left it (its stop time and keep), the job still queued.
    assert_eq!(r.acted.held, vec![id.clone()], "{:?} {:?}", r.plan, r.acted);
    assert!(
        r.acted.launched.is_empty() && r.acted.started.is_empty(),
        "{:?}",
        r.acted
    );
    assert!(
        r.acted.errors.is_empty() && r.acted.capacity_errors.is_empty(),
        "{:?}",
        r.acted
    );
    assert!(w.avail.marked().is_empty());
    let row = w.workers.records()[&id].clone();
    assert_eq!(
        (row.state, row.idle_since, row.hold_until),
        (WorkerState::Stopped, stopped.idle_since, stopped.hold_until)
    );
    // The reaper, a minute on, finds nothing wrong; the stop is over and the start goes through.
    w.fleet.set_stopped_fully(&id);
    let r = w.reconcile(NOW + 1_260.0, true);
    assert!(r.workers_lost.is_empty() && r.workers_gone.is_empty(), "{r:?}");
    assert_eq!(r.acted.started, vec![id.clone()], "{:?}", r.plan);
    assert!(r.acted.launched.is_empty(), "{:?}", r.acted);
    assert!(w.fleet.running().contains_key(&id));
    // Had EC2 still been stopping it past boot - restart after the stop, a launch would have
    // gone instead: the same world, refused later.
    let w = World::stopping();
    let (id, _) = w.idle_worker_released();
    w.fleet.set_still_stopping(&id);
    w.submit_timed("next", 3600.0);
    let late = NOW + 1_160.0 + w.cfg.offers.boot_estimate_s - w.cfg.offers.restart_estimate_s;
    let r = w.reconcile(late, true);
    assert!(r.acted.held.is_empty(), "{:?}", r.acted);
    assert_eq!(r.acted.launched.len(), 1, "{:?}", r.acted);
    assert_eq!(w.workers.records()[&id].state, WorkerState::Stopped);
}

#[test]
fn a_stopped_worker_is_terminated_when_its_keep_ends() {
    let w = World::stopping();
    let (id, _) = w.idle_worker_released();
    let until = w.workers.records()[&id].hold_until.unwrap();
    let r = w.reconcile(until - 1.0, true);
    assert!(r.acted.terminated.is_empty(), "{:?}", r.plan);
    let r = w.reconcile(until + 1.0, true);
    assert_eq!(r.acted.terminated, vec![id.clone()], "{:?}", r.plan);
    assert_eq!(w.workers.records()[&id].state, WorkerState::Terminating);
    assert!(w.fleet.stopped().is_empty() && w.fleet.running().is_empty());
}

#[test]
fn a_worker_whose_instance_ec2_stopped_under_it_is_lost_and_its_job_requeued() {
    let w = World::stopping();
    let ids = w.submit(1);
    w.reconcile(NOW + 1.0, false);
    let id = w.workers.records().keys().next().unwrap().clone();
    pollster::block_on(w.jobs.claim(&ids[0], &id, NOW + 10_000.0, NOW + 300.0)).unwrap();
    w.workers
        .agent_heartbeat(&id, WorkerState::Running, None, NOW + 300.0)
        .unwrap();
    // EC2 stops it (an interruption of a persistent spot request), the event missed.
    w.fleet.stop_behind_the_back(&id);
    let r = w.reconcile(NOW + 320.0, true);
    assert_eq!(r.workers_lost, vec![id.clone()], "{r:?}");
    assert_eq!(w.workers.records()[&id].state, WorkerState::Terminating);
    assert!(w.fleet.stopped().is_empty() && !w.fleet.running().contains_key(&id));
    assert!(r.jobs_requeued.contains(&ids[0]), "{r:?}");
}

/// Jobs of the last two hours, three every cold-start window (one every 130 s), each declaring an
/// hour of run time and each finished by `now`: the predictive pool's demand, none of it in the
/// `active` index any more. Returns `now`.
fn finished_stream(w: &World) -> f64 {
    let now = NOW + 7_200.0;
    for i in 0..55 {
        let at = NOW + 130.0 * f64::from(i);
        let spec =
            format!(r#"{{"image":"i","command":["x"],"project":"p","client_token":"s{i}","est_runtime_s":3600}}"#);
        let src = Source::Sqs {
            message_id: format!("s{i}"),
        };
        let id = pollster::block_on(submit(&spec, &src, &["standard"], at, &w.jobs, &w.queue))
            .unwrap()
            .id()
            .to_string();
        pollster::block_on(w.jobs.claim(&id, "i-gone", at + 10_000.0, at + 1.0)).unwrap();
        pollster::block_on(w.jobs.transition(&id, JobState::Running, JobState::Succeeded)).unwrap();
    }
    now
}

fn warm_launches(r: &ReconcileReport) -> u32 {
    r.plan
        .actions
        .iter()
        .map(|a| match a {
            Action::Launch {
                count,
                reason: onoff_policy::Reason::WarmPool { .. },
                ..
            } => *count,
            _ => 0,
        })
        .sum()
}

/// The deployed policy decides on every arrival, as the simulator does, not only on the jobs
/// still unfinished: a stream of jobs that all ended by now still keeps the predictive pool warm
/// (the simulator's `onoff` policy holds capacity for it). Before the arrivals index the run saw
/// the `active` index only, so such a lane was an empty one: fails without it.
#[test]
fn a_run_decides_on_the_arrivals_of_jobs_that_have_finished() {
    let mut w = World::new();
    w.cfg.lanes[0].predictive_max = 40;
    let now = finished_stream(&w);
    let r = w.reconcile(now, false);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.arrivals_folded, 55);
    assert!(warm_launches(&r) >= 3, "{:?}", r.plan.actions);
    // The arrivals are kept folded: a later run folds only what is new.
    let again = w.reconcile(now + 30.0, false);
    assert_eq!(again.arrivals_folded, 0);
    let kept = pollster::block_on(onoff_control::ports::ArrivalStatsStore::load_arrival_stats(
        &w.avail, "standard",
    ))
    .unwrap()
    .unwrap();
    assert_eq!(
        (
            kept.folded_to,
            kept.gaps[&1].hist.samples(),
            kept.gaps[&1].runtimes.samples()
        ),
        (NOW + 130.0 * 54.0, 54, 55)
    );
}

/// While the arrivals cannot be listed (an update of the stack still building the index), a run
/// decides on the unfinished jobs' arrivals, as before the index, and says so.
#[test]
fn without_the_arrivals_a_run_decides_on_the_unfinished_jobs_and_says_so() {
    let mut w = World::new();
    w.cfg.lanes[0].predictive_max = 40;
    let now = finished_stream(&w);
    w.jobs.fail_next_arrivals(onoff_control::ports::StoreError::Other(
        "ValidationException: Cannot read from backfilling global secondary index: arrivals".into(),
    ));
    let r = w.reconcile(now, false);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert!(r.errors[0].contains("backfilling"), "{}", r.errors[0]);
    assert_eq!((r.arrivals_folded, warm_launches(&r)), (0, 0), "{:?}", r.plan.actions);
    // The next run reads them.
    assert!(warm_launches(&w.reconcile(now + 30.0, false)) >= 3);
}

/// `n` jobs of the standard lane that declared no run time, each run `run_s` seconds from its
/// claim to its success, the last ending before `t0 + 10 n`.
fn finished_runs(w: &World, n: usize, run_s: f64, t0: f64) {
    use onoff_control::job::{AttemptEnd, AttemptRecord, RerunLimits, Settle};
    for i in 0..n {
        let at = t0 + 10.0 * i as f64;
        let id = w.submit_one(&format!("done{i}"), at, None);
        let Claim::Claimed(rec) = pollster::block_on(w.jobs.claim(&id, "i-done", at + 600.0, at + 1.0)).unwrap() else {
            panic!("claim of {id}");
        };
        let attempt = AttemptRecord {
            n: 1,
            instance_id: "i-done".into(),
            instance_type: None,
            capacity_type: None,
            price_usd_per_h: None,
            started_at: at + 1.0,
            ended_at: at + 1.0 + run_s,
            outcome: "succeeded".into(),
            exit_code: Some(0),
            signal: None,
            checkpoint: None,
            seconds: run_s,
            cost_usd: 0.0,
        };
        let settle = Settle::of(&rec, &AttemptEnd::Succeeded, &RerunLimits::default()).with_attempt(&rec, attempt);
        pollster::block_on(w.jobs.finish(&id, "i-done", &settle, at + 1.0 + run_s)).unwrap();
    }
}

/// Twenty queued jobs that declare no run time, in a lane whose last jobs ran 3 s each: they
/// take the lane's estimate (3 s), so they queue behind each other on one worker (60 s of work,
/// within the 120 s short-job horizon) instead of counting an hour each and getting a worker
/// each, as they do with too few finished jobs, or while the run times cannot be read (which
/// the run says).
#[test]
fn undeclared_jobs_take_the_run_time_of_the_lanes_last_jobs_to_finish() {
    // (jobs finished before, the run_times index readable, launches, estimate)
    for (finished, readable, want, estimate) in
        [(8, true, 1usize, Some(3.0)), (4, true, 20, None), (8, false, 20, None)]
    {
        let w = World::new();
        finished_runs(&w, finished, 3.0, NOW - 1_000.0);
        w.submit(20);
        if !readable {
            w.jobs.fail_next_run_times(onoff_control::ports::StoreError::Other(
                "ValidationException: Cannot read from backfilling global secondary index: run_times".into(),
            ));
        }
        let r = w.reconcile(NOW + 1.0, false);
        let case = format!("{finished} finished, readable {readable}");
        assert_eq!(r.acted.launched.len(), want, "{case}: {:?}", r.plan);
        let want_estimates: Vec<(String, f64)> = estimate.into_iter().map(|e| ("standard".to_string(), e)).collect();
        assert_eq!(r.run_time_estimates, want_estimates, "{case}");
        assert_eq!(
            r.errors
                .iter()
                .any(|e| e.contains("run times of lane standard") && e.contains("backfilling")),
            !readable,
            "{case}: {:?}",
            r.errors
        );
    }
}

/// A lane's prior (`lanes[].default_runtime_s`, here 3 s) stands in for the estimate until 5 of
/// its jobs have finished: the same twenty undeclared jobs share one worker with 4 finished, or
/// while the run times cannot be read (which the run says, with the prior's figure); once 8
/// have finished (30 s each) their mean replaces it (600 s of work: five workers). The rows of
/// the workers launched hold the figure used, for their agents.
#[test]
fn a_lanes_prior_run_time_stands_in_until_its_last_jobs_give_an_estimate() {
    // (jobs finished before, the run_times index readable, launches, estimate)
    for (finished, readable, want, estimate) in [(4, true, 1usize, 3.0), (8, false, 1, 3.0), (8, true, 5, 30.0)] {
        let mut w = World::new();
        w.cfg.lanes[0].default_runtime_s = Some(3.0);
        finished_runs(&w, finished, 30.0, NOW - 1_000.0);
        w.submit(20);
        if !readable {
            w.jobs
                .fail_next_run_times(onoff_control::ports::StoreError::Other("throttled".into()));
        }
        let r = w.reconcile(NOW + 1.0, false);
        let case = format!("{finished} finished, readable {readable}");
        assert_eq!(r.acted.launched.len(), want, "{case}: {:?}", r.plan);
        assert_eq!(r.run_time_estimates, [("standard".to_string(), estimate)], "{case}");
        // The launched workers' rows hold the figure, for their agents.
        let rows: Vec<Option<f64>> = w.workers.records().values().map(|r| r.run_time_estimate_s).collect();
        assert_eq!(rows, vec![Some(estimate); want], "{case}");
        assert_eq!(
            r.errors
                .iter()
                .any(|e| e.contains("run times of lane standard") && e.contains("count as 3 s")),
            !readable,
            "{case}: {:?}",
            r.errors
        );
    }
}

/// A worker launched before its lane had a run-time estimate (no job finished, no prior) has
/// none on its row; once 8 jobs have finished (30 s each), the next run writes the lane's 30 s on
/// it, for its agent, and the run after writes nothing.
#[test]
fn a_worker_launched_before_its_lane_had_an_estimate_is_given_it_once_there_is_one() {
    let w = World::new();
    let first = w.submit(1).remove(0);
    let worker = w.running_on_its_worker(&first);
    assert_eq!(w.workers.records()[&worker].run_time_estimate_s, None);
    finished_runs(&w, 8, 30.0, NOW - 1_000.0);
    let r = w.reconcile(NOW + 200.0, false);
    assert_eq!(r.run_time_estimates, [("standard".to_string(), 30.0)]);
    assert_eq!(r.workers_given_estimates, vec![worker.clone()], "{:?}", r.errors);
    assert_eq!(w.workers.records()[&worker].run_time_estimate_s, Some(30.0));
    let again = w.reconcile(NOW + 260.0, false);
    assert!(again.workers_given_estimates.is_empty(), "{again:?}");
}

/// A running job that declared no run time ends, as the policy sees it, at its claim plus the
/// lane's estimate (3 s): three undeclared jobs queued a second after the claim wait for that
/// worker (nothing launched), still 100 s past that end. Once the job has outlived its estimate
/// by the 120 s short-job horizon its end is unknown, so the same three get a worker (one: 9 s of
/// work, within the horizon).
#[test]
fn a_running_undeclared_job_ends_at_its_estimate_until_it_outlives_it_by_the_horizon() {
    // (reconcile at, launches)
    for (at, want) in [(NOW + 102.0, 0usize), (NOW + 203.0, 0), (NOW + 224.0, 1)] {
        let w = World::new();
        finished_runs(&w, 8, 3.0, NOW - 1_000.0);
        let first = w.submit(1).remove(0);
        w.running_on_its_worker(&first);
        for i in 0..3 {
            w.submit_one(&format!("later{i}"), NOW + 101.0, None);
        }
        let r = w.reconcile(at, false);
        assert_eq!(r.run_time_estimates, [("standard".to_string(), 3.0)]);
        assert_eq!(r.acted.launched.len(), want, "at {at}: {:?}", r.plan);
    }
}
