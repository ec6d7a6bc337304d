//! A 30-hour job against the lane queue as SQS behaves (12-hour visibility cap, retention, receive
//! counts and the redrive to the dead-letter queue: `FakeInbox`) and the jobs table as DynamoDB
//! does (conditional writes: `FakeJobs`), in paused time: three spot interruption notices and two
//! crashed attempts on the way, one worker after another. It succeeds exactly once, its wake-up
//! messages never reach the dead-letter queue, and every worker that ran it terminates its own
//! instance, the last one after its idle timeout once the job is done.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onoff_agent::fake::{
    FakeCheckpoints, FakeInbox, FakeInstance, FakeMetadata, FakeObjects, Script, ScriptedLauncher,
};
use onoff_agent::ports::Notice;
use onoff_agent::{run, AgentReport, Deps, ExitReason, Outcome};
use onoff_control::fake::{FakeJobs, FakeRegistry};
use onoff_control::job::{JobSpec, JobState};
use onoff_control::ports::{JobRecord, WorkerRecord, WorkerRegistry};
use onoff_policy::{CapacityType, OfferingKey, WorkerState};

use common::{cfg, ArcMd};

const T0: f64 = 1_800_000_000.0;
const HOUR: u64 = 3600;

#[tokio::test(start_paused = true)]
async fn a_30_hour_job_with_three_notices_and_two_crashes_succeeds_once_and_nothing_stays_up() {
    let dir = std::env::temp_dir().join(format!("onoff-lifecycle-30h-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let inbox = FakeInbox::default();
    let jobs = FakeJobs::default();
    let registry = FakeRegistry::default();
    let checkpoints = FakeCheckpoints::default();
    let objects = FakeObjects::default();
    let launcher = ScriptedLauncher::default();
    let total_s = 30 * HOUR;
    launcher.script(
        "train",
        Script {
            items: total_s,
            items_per_s: 1,
            checkpoint_every_s: Some(1800),
            exit_code: 0,
        },
    );
    // Starts 1 and 3 (from 0) crash after 2 h and 1 h of work.
    launcher.fail_start(1, 2 * HOUR);
    launcher.fail_start(3, HOUR);
    // Spot interruption notices 8 h into start 0, 4 h into start 2 and 2 h into start 4; start 5
    // runs the remaining ~13 h, past SQS's 12-hour visibility cap.
    let notices = [(0usize, 8 * HOUR), (2, 4 * HOUR), (4, 2 * HOUR)];
    let spec: JobSpec = serde_json::from_value(serde_json::json!({
        "image": "img", "command": ["train"], "project": "p", "max_attempts": 3,
        "checkpoint_interval_s": 3600
    }))
    .unwrap();
    let mut rec = JobRecord::new("job-30h".into(), spec, "test".into(), T0);
    rec.sent_at = Some(T0);
    jobs.put(rec);
    inbox.send("standard", r#"{"job_id":"job-30h"}"#);

    let mut reports: Vec<(String, AgentReport, Vec<String>)> = Vec::new();
    let mut clock = T0;
    for n in 0..10 {
        let state = jobs.records()["job-30h"].state;
        if state.is_final() && n > 0 {
            break;
        }
        let id = format!("i-{n}");
        registry
            .register_launch(WorkerRecord::launched(
                &id,
                "standard",
                OfferingKey {
                    instance_type: "g5.xlarge".into(),
                    zone: "us-east-1a".into(),
                    capacity_type: CapacityType::Spot,
                },
                0.36,
                clock,
            ))
            .await
            .unwrap();
        let md = Arc::new(FakeMetadata::new(&id));
        // Watch the launcher: when a start with a notice begins on this worker, post the notice
        // that many hours into it.
        let watcher = {
            let md = md.clone();
            let launcher = &launcher;
            // Counted before the agent runs: its first poll may start the job at once.
            let mut seen = launcher.started().len();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let now = launcher.started().len();
                    if now > seen {
                        seen = now;
                        if let Some((_, after)) = notices.iter().find(|(k, _)| *k == now - 1) {
                            tokio::time::sleep(Duration::from_secs(*after)).await;
                            md.set_notice(Notice::SpotInterruption {
                                action: "terminate".into(),
                                time: "2026-11-24T10:00:00Z".into(),
                            });
                        }
                    }
                }
            }
        };
        let deps = Deps {
            metadata: ArcMd(md),
            inbox: &inbox,
            jobs: &jobs,
            registry: &registry,
            checkpoints: &checkpoints,
            objects: &objects,
            instance: FakeInstance::default(),
            launcher: &launcher,
        };
        let c = cfg(&dir.join(&id));
        let started = tokio::time::Instant::now();
        let report = tokio::select! {
            r = run(&deps, &c, clock, std::future::pending()) => r.unwrap(),
            () = watcher => unreachable!(),
        };
        clock += started.elapsed().as_secs_f64();
        let terminated = deps.instance.0.lock().unwrap().clone();
        reports.push((id, report, terminated));
    }

    let rec = jobs.records()["job-30h"].clone();
    let attempts: Vec<Outcome> = reports
        .iter()
        .flat_map(|(_, r, _)| r.jobs.iter().map(|j| j.outcome))
        .collect();
    assert_eq!(rec.state, JobState::Succeeded, "{rec:?} {attempts:?}");
    assert_eq!(
        attempts.iter().filter(|o| **o == Outcome::Succeeded).count(),
        1,
        "{attempts:?}"
    );
    let completed = reports
        .iter()
        .flat_map(|(_, r, _)| &r.jobs)
        .filter(|j| j.completed)
        .count();
    assert_eq!(completed, 1, "the job's process exited 0 once");
    assert_eq!(
        attempts.iter().filter(|o| **o == Outcome::Released).count(),
        3,
        "{attempts:?}"
    );
    assert_eq!(
        attempts.iter().filter(|o| **o == Outcome::Retrying).count(),
        2,
        "{attempts:?}"
    );
    // Releases are not counted: two crashes and the success are the three attempts it had.
    assert_eq!((rec.attempts, rec.lease_expiries), (3, 0));
    // All 30 h of work were done, none of it twice beyond what the crashes lost (at most the
    // 30 minutes since the last checkpoint each).
    let worked: f64 = reports.iter().flat_map(|(_, r, _)| &r.jobs).map(|j| j.seconds).sum();
    assert!(
        worked >= total_s as f64 && worked <= (total_s + 2 * 1800 + 600) as f64,
        "{worked}"
    );
    // The queue: nothing dead-lettered, nothing left behind.
    assert!(inbox.dead_letters().is_empty(), "{:?}", inbox.dead_letters());
    assert!(inbox.remaining().is_empty(), "{:?}", inbox.remaining());
    // Every worker that ran it terminated its own instance: three after their notices, the last
    // after its idle timeout once the job was done.
    for (id, r, terminated) in &reports {
        assert_eq!(terminated, &vec![id.clone()], "{id}: {:?}", r.exit);
        assert_eq!(registry.records()[id].state, WorkerState::Terminating, "{id}");
    }
    let notices_seen = reports
        .iter()
        .filter(|(_, r, _)| matches!(r.exit, ExitReason::Notice(_)))
        .count();
    assert_eq!(notices_seen, 3);
    assert_eq!(reports.last().unwrap().1.exit, ExitReason::IdleTimeout);
    let _ = std::fs::remove_dir_all(&dir);
}
