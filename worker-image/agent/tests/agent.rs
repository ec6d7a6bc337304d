//! The agent loop against fakes with paused tokio time: claims, leases, checkpoints (slow ones
//! too), notices and rebalance recommendations, idle exit, retries and poison messages.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onoff_agent::fake::{
    FakeCheckpoints, FakeInbox, FakeInstance, FakeMetadata, FakeObjects, Script, ScriptedLauncher,
};
use onoff_agent::ports::Notice;
use onoff_agent::{run, AgentConfig, AgentReport, Deps, ExitReason, Outcome};
use onoff_control::fake::{FakeJobs, FakeRegistry};
use onoff_control::job::{AttemptEnd, JobSpec, JobState, RerunLimits, Settle};
use onoff_control::ports::{
    wake, wake_up_body, CancelOutcome, CheckpointStore, Claim, JobRecord, JobStore, WorkerRecord, WorkerRegistry,
};
use onoff_policy::{CapacityType, OfferingKey, WorkerState};

use common::{cfg, ArcMd};

const T0: f64 = 1_800_000_000.0;

/// Shared state of one "deployment"; each agent gets its own metadata and instance.
#[derive(Default)]
struct World {
    inbox: FakeInbox,
    jobs: FakeJobs,
    registry: FakeRegistry,
    checkpoints: FakeCheckpoints,
    objects: FakeObjects,
    launcher: ScriptedLauncher,
}

fn register(w: &World, id: &str) {
    register_as(w, id, CapacityType::Spot, None);
}

/// Register `id` as the scaler does: a g5.xlarge of `capacity`, launched for `pinned` (if any).
fn register_as(w: &World, id: &str, capacity: CapacityType, pinned: Option<&str>) {
    let offering = OfferingKey {
        instance_type: "g5.xlarge".into(),
        zone: "us-east-1a".into(),
        capacity_type: capacity,
    };
    let price = if capacity == CapacityType::Spot { 0.36 } else { 1.006 };
    pollster::block_on(w.registry.register_launch(WorkerRecord {
        pinned_job: pinned.map(str::to_string),
        ..WorkerRecord::launched(id, "standard", offering, price, T0)
    }))
    .unwrap();
}

/// Put a job in the table and its message in the queue.
/// Submit a 1-GPU job and its wake-up message, as submit does.
fn submit(w: &World, id: &str, program: &str, max_attempts: u32, checkpoint_interval_s: f64) {
    put_job(w, id, program, max_attempts, checkpoint_interval_s);
    w.inbox.send("standard", &wake_up_body(id, 1, T0));
}

/// A 1-GPU job's row, without a message.
fn put_job(w: &World, id: &str, program: &str, max_attempts: u32, checkpoint_interval_s: f64) {
    let spec = JobSpec {
        image: "img".into(),
        command: vec![program.into(), "--flag".into()],
        gpus: 1,
        min_gpu_memory_gib: 0.0,
        lane: "standard".into(),
        project: "p".into(),
        deadline: None,
        max_attempts,
        checkpoint_interval_s,
        est_runtime_s: None,
        job_type: None,
        client_token: None,
        input: None,
        name: None,
    };
    let mut rec = JobRecord::new(id.into(), spec, "test".into(), T0);
    rec.sent_at = Some(T0);
    w.jobs.put(rec);
}

async fn agent(w: &World, id: &str, c: &AgentConfig) -> (AgentReport, Vec<String>) {
    agent_until(w, id, c, std::future::pending(), None).await
}

async fn agent_until(
    w: &World,
    id: &str,
    c: &AgentConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
    metadata: Option<Arc<FakeMetadata>>,
) -> (AgentReport, Vec<String>) {
    agent_on(w, &w.inbox, id, c, shutdown, metadata).await
}

/// [`agent_until`] reading its messages from `inbox` instead of the world's queue.
async fn agent_on(
    w: &World,
    inbox: impl onoff_agent::ports::Inbox,
    id: &str,
    c: &AgentConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
    metadata: Option<Arc<FakeMetadata>>,
) -> (AgentReport, Vec<String>) {
    let md = metadata.unwrap_or_else(|| Arc::new(FakeMetadata::new(id)));
    let deps = Deps {
        metadata: ArcMd(md),
        inbox,
        jobs: &w.jobs,
        registry: &w.registry,
        checkpoints: &w.checkpoints,
        objects: &w.objects,
        instance: FakeInstance::default(),
        launcher: &w.launcher,
    };
    let report = run(&deps, c, T0, shutdown).await.unwrap();
    let terminated = deps.instance.0.lock().unwrap().clone();
    (report, terminated)
}

/// Program `train`: 300 items at one a second, a local checkpoint every 20 s, exit 0.
fn script_train_300(w: &World) {
    w.launcher.script(
        "train",
        Script {
            items: 300,
            items_per_s: 1,
            checkpoint_every_s: Some(20),
            exit_code: 0,
        },
    );
}

fn job(w: &World, id: &str) -> JobRecord {
    w.jobs.records()[id].clone()
}

#[tokio::test(start_paused = true)]
async fn two_agents_one_job_it_runs_once_and_the_duplicate_message_is_dropped() {
    let dir = tempdir("race");
    let w = World::default();
    register(&w, "i-a");
    register(&w, "i-b");
    w.launcher.script(
        "work",
        Script {
            items: 100,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "work", 3, 600.0);
    // At-least-once delivery: the same job's message twice.
    w.inbox.send("standard", r#"{"job_id":"job-1"}"#);
    let (ca, cb) = (cfg(&dir.path().join("a")), cfg(&dir.path().join("b")));
    let ((ra, _), (rb, _)) = tokio::join!(agent(&w, "i-a", &ca), agent(&w, "i-b", &cb));
    assert_eq!(w.launcher.started().len(), 1, "the job ran once");
    let ran: Vec<_> = ra.jobs.iter().chain(&rb.jobs).collect();
    assert_eq!(ran.len(), 1);
    assert_eq!(ran[0].outcome, Outcome::Succeeded);
    assert_eq!(ra.dropped + rb.dropped, 1, "the duplicate message was dropped");
    assert_eq!(job(&w, "job-1").state, JobState::Succeeded);
    assert!(
        w.inbox.remaining().is_empty(),
        "both messages deleted: {:?}",
        w.inbox.remaining()
    );
    assert_eq!(
        (ra.exit.clone(), rb.exit.clone()),
        (ExitReason::IdleTimeout, ExitReason::IdleTimeout)
    );
}

/// A message that does not say how many GPUs its job asks for (an older sender's) is claimed, and
/// a worker too small for the job hands it back once; the fresh message says, and from then on
/// the small worker passes it on unclaimed.
#[tokio::test(start_paused = true)]
async fn a_job_for_more_gpus_is_handed_back_uncounted_and_runs_on_a_worker_that_fits() {
    let dir = tempdir("fit");
    let w = World::default();
    register(&w, "i-small");
    register(&w, "i-big");
    w.launcher.script(
        "train",
        Script {
            items: 30,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    put_job(&w, "job-4gpu", "train", 1, 600.0);
    let mut rec = job(&w, "job-4gpu");
    rec.spec.gpus = 4;
    w.jobs.put(rec);
    w.inbox.send("standard", r#"{"job_id":"job-4gpu"}"#);
    let small = AgentConfig {
        gpus: Some(1),
        ..cfg(&dir.path().join("small"))
    };
    // The big worker boots later, as the one the scaler launched for the job would.
    let big = AgentConfig {
        gpus: Some(4),
        ..cfg(&dir.path().join("big"))
    };
    let late_big = async {
        tokio::time::sleep(Duration::from_secs(40)).await;
        agent(&w, "i-big", &big).await
    };
    let ((rs, _), (rb, _)) = tokio::join!(agent(&w, "i-small", &small), late_big);
    assert!(rs.jobs.is_empty(), "the 1-GPU worker never ran it: {:?}", rs.jobs);
    assert_eq!(
        rs.handed_back, 1,
        "claimed and handed back once, from the message without GPUs"
    );
    assert!(rs.passed_on >= 1, "then passed on unclaimed: {}", rs.passed_on);
    assert_eq!(rb.jobs.len(), 1);
    assert_eq!(rb.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(w.launcher.started().len(), 1, "it ran once");
    let rec = job(&w, "job-4gpu");
    assert_eq!(rec.state, JobState::Succeeded);
    // max_attempts 1: the hand-backs did not use up its only attempt.
    assert_eq!(rec.attempts, 1);
    // Each hand-back is a fresh message, so none nears the dead-letter queue's receive limit.
    assert!(w.inbox.remaining().is_empty(), "{:?}", w.inbox.remaining());
    // Hand-backs are not work: the small worker still left after its idle timeout.
    assert_eq!(rs.exit, ExitReason::IdleTimeout);
}

/// A 4-GPU job waits an hour for its worker (the policy waits for a spot offering of its size)
/// while a 1-GPU worker idles in its lane and receives its message every retry delay. The small
/// worker passes the message on unclaimed each time, so no hand-back is counted: the job is not
/// FAILED at `max_hand_backs` (3 here; a claim and a counted hand-back each time failed it after
/// 45 s) and runs when its worker comes.
#[tokio::test(start_paused = true)]
async fn a_job_waiting_long_for_a_worker_of_its_size_is_passed_on_not_failed_by_smaller_ones() {
    let dir = tempdir("wait-big");
    let w = World::default();
    register(&w, "i-small");
    register(&w, "i-big");
    script(&w, "train", 10);
    put_job(&w, "job-4gpu", "train", 1, 600.0);
    let mut rec = job(&w, "job-4gpu");
    rec.spec.gpus = 4;
    w.jobs.put(rec);
    // The message as every sender writes it: with the job's GPUs.
    w.inbox.send("standard", &wake_up_body("job-4gpu", 4, T0));
    let small = AgentConfig {
        gpus: Some(1),
        // Past the big worker's arrival: the fake inbox hands a message to the receiver that has
        // waited longest, so the small worker would win it every time while it polls (SQS spreads
        // deliveries over its receivers).
        idle_timeout_s: 3_700.0,
        rerun_limits: RerunLimits {
            max_hand_backs: 3,
            ..RerunLimits::default()
        },
        ..cfg(&dir.path().join("small"))
    };
    let big = AgentConfig {
        gpus: Some(4),
        ..cfg(&dir.path().join("big"))
    };
    let late_big = async {
        tokio::time::sleep(Duration::from_secs(3_600)).await;
        agent(&w, "i-big", &big).await
    };
    let ((rs, _), (rb, _)) = tokio::join!(agent(&w, "i-small", &small), late_big);
    assert!(rs.jobs.is_empty(), "{:?}", rs.jobs);
    assert_eq!(rs.handed_back, 0);
    assert!(
        rs.passed_on >= 100,
        "passed on every retry delay for an hour: {}",
        rs.passed_on
    );
    assert_eq!(rb.jobs.len(), 1, "{:?}", rb.jobs);
    assert_eq!(rb.jobs[0].outcome, Outcome::Succeeded);
    let rec = job(&w, "job-4gpu");
    assert_eq!((rec.state, rec.hand_backs, rec.attempts), (JobState::Succeeded, 0, 1));
    assert!(w.inbox.remaining().is_empty(), "{:?}", w.inbox.remaining());
}

/// A worker larger than a job's size, as the policy matches them (an 8-GPU worker launched for an
/// 8-GPU job serves jobs from 5 GPUs up: `WorkerRecord::min_job_gpus`), passes a 1-GPU job's
/// message on unclaimed, and runs the 8-GPU job; a 1-GPU worker runs the 1-GPU job. Before, the
/// first message the 8-GPU worker received was the 1-GPU job's, which it ran at eight times the
/// price while the 8-GPU job waited and the policy launched another 8-GPU worker for it (stop 65's
/// every-fault run: 13 g5.48xlarge launched for one 8-GPU job).
#[tokio::test(start_paused = true)]
async fn a_worker_larger_than_a_job_passes_its_message_on_for_a_worker_of_its_size() {
    let dir = tempdir("too-big-worker");
    let w = World::default();
    let big_offering = OfferingKey {
        instance_type: "g5.48xlarge".into(),
        zone: "us-east-1a".into(),
        capacity_type: CapacityType::OnDemand,
    };
    pollster::block_on(w.registry.register_launch(WorkerRecord {
        min_job_gpus: Some(5),
        ..WorkerRecord::launched("i-big", "standard", big_offering, 16.288, T0)
    }))
    .unwrap();
    register(&w, "i-small");
    script(&w, "train", 10);
    // The 1-GPU job's message first, then the 8-GPU job's.
    submit(&w, "job-1gpu", "train", 1, 600.0);
    put_job(&w, "job-8gpu", "train", 1, 600.0);
    let mut rec = job(&w, "job-8gpu");
    rec.spec.gpus = 8;
    w.jobs.put(rec);
    w.inbox.send("standard", &wake_up_body("job-8gpu", 8, T0));
    let big = AgentConfig {
        gpus: Some(8),
        idle_timeout_s: 120.0,
        ..cfg(&dir.path().join("big"))
    };
    let small = AgentConfig {
        gpus: Some(1),
        idle_timeout_s: 120.0,
        ..cfg(&dir.path().join("small"))
    };
    // The small worker boots a minute later: the big one sees the 1-GPU job's message first.
    let late_small = async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        agent(&w, "i-small", &small).await
    };
    let ((rb, _), (rs, _)) = tokio::join!(agent(&w, "i-big", &big), late_small);
    let ran = |r: &AgentReport| r.jobs.iter().map(|j| j.job_id.clone()).collect::<Vec<_>>();
    assert_eq!(ran(&rb), ["job-8gpu"], "{rb:?}");
    assert_eq!(ran(&rs), ["job-1gpu"], "{rs:?}");
    assert!(rb.passed_on >= 1, "{rb:?}");
    assert_eq!((rb.handed_back, rs.passed_on), (0, 0));
    for id in ["job-1gpu", "job-8gpu"] {
        let rec = job(&w, id);
        assert_eq!(
            (rec.state, rec.attempts, rec.hand_backs),
            (JobState::Succeeded, 1, 0),
            "{id}"
        );
    }
}

/// A worker too small for a job passes on only the message its job still waits on: a duplicate
/// (sent before the row's latest `sent_at`) and the message of a job that no longer waits are
/// dropped, one of an unknown job is poison. Before, every one of them went round for as long as
/// the job waited, and counted in the lane's queue as a waiting job's message.
#[tokio::test(start_paused = true)]
async fn a_too_small_worker_passes_on_only_the_message_its_job_still_waits_on() {
    let dir = tempdir("stale-pass-on");
    let w = World::default();
    register(&w, "i-small");
    for id in ["job-4gpu", "job-done"] {
        put_job(&w, id, "train", 1, 600.0);
        let mut rec = job(&w, id);
        rec.spec.gpus = 4;
        rec.sent_at = Some(T0 + 5.0);
        if id == "job-done" {
            rec.state = JobState::Succeeded;
        }
        w.jobs.put(rec);
    }
    // The first message and the reaper's later one, of the waiting job; one of the finished job;
    // one of a job the table does not hold.
    let old = w.inbox.send("standard", &wake_up_body("job-4gpu", 4, T0));
    let latest = w.inbox.send("standard", &wake_up_body("job-4gpu", 4, T0 + 5.0));
    let done = w.inbox.send("standard", &wake_up_body("job-done", 4, T0 + 5.0));
    let unknown = w.inbox.send("standard", &wake_up_body("job-none", 4, T0));
    let small = AgentConfig {
        gpus: Some(1),
        idle_timeout_s: 600.0,
        ..cfg(dir.path())
    };
    let (r, _) = agent(&w, "i-small", &small).await;
    assert!(r.jobs.is_empty(), "{:?}", r.jobs);
    assert_eq!(r.dropped, 2, "{r:?}");
    assert!(r.poison >= 1, "{r:?}");
    assert!(r.passed_on >= 1, "{r:?}");
    let left: Vec<String> = w.inbox.remaining().into_iter().map(|(id, _)| id).collect();
    assert!(!left.contains(&old) && !left.contains(&done), "{left:?}");
    // The latest goes on (as a fresh message each time, so not under its first id), the unknown
    // job's is left for the dead-letter queue with its reason.
    assert!(!left.contains(&latest), "{left:?}");
    assert_eq!(w.inbox.pending_for("standard", "job-4gpu"), 1, "{left:?}");
    assert!(
        w.jobs
            .errors()
            .get(&format!("sqs:{unknown}"))
            .is_some_and(|e| e.contains("no job")),
        "{:?}",
        w.jobs.errors()
    );
    assert_eq!(job(&w, "job-4gpu").state, JobState::Queued);
}

#[tokio::test(start_paused = true)]
async fn a_long_job_keeps_its_lease_with_its_message_gone_and_uploads_checkpoints_on_the_interval() {
    let dir = tempdir("long");
    let w = World::default();
    register(&w, "i-a");
    // 300 s of work, a local checkpoint every 20 s, uploads every 100 s.
    script_train_300(&w);
    submit(&w, "job-1", "train", 3, 100.0);
    let c = cfg(dir.path());
    let (r, terminated) = agent(&w, "i-a", &c).await;
    let j = &r.jobs[0];
    assert_eq!(j.outcome, Outcome::Succeeded);
    // The message was deleted at claim: the row holds the job, the lease (60 s, renewed every
    // 20 s) keeps it; no visibility extension, so SQS's 12-hour cap never matters.
    assert!(
        w.inbox.visibility_changes().is_empty(),
        "{:?}",
        w.inbox.visibility_changes()
    );
    assert!(w.inbox.remaining().is_empty());
    assert_eq!(r.dropped, 0);
    // Uploads at 100 and 200 s (and 300 s if the job had not exited yet); none after exit 0:
    // SUCCEEDED is recorded first and nobody resumes a finished job (the job's own 20 s
    // checkpoints are not each uploaded).
    let n = u64::from(j.checkpoints_uploaded);
    assert!((2..=3).contains(&n), "{j:?}");
    assert_eq!(w.checkpoints.seqs("job-1"), (1..=n).collect::<Vec<_>>());
    let rec = job(&w, "job-1");
    assert_eq!(rec.last_checkpoint, Some(format!("checkpoints/job-1/{n:020}/")));
    // $ = 0.36 $/h x ~300 s, recorded on the job.
    assert!((j.seconds - 300.0).abs() < 3.0, "{}", j.seconds);
    assert!((rec.cost_usd - 0.36 * j.seconds / 3600.0).abs() < 1e-9);
    assert_eq!(j.items, Some(300));
    assert!((j.usd_per_item().unwrap() - j.cost_usd / 300.0).abs() < 1e-12);
    assert_eq!(terminated, vec!["i-a".to_string()]);
    assert_eq!(w.registry.records()["i-a"].state, WorkerState::Terminating);
}

/// An agent the control plane never registered registers itself at price 0 (it has no
/// catalogue). Once the reaper writes its offering's price into the row, the agent charges its
/// job with it, for the whole run: the stretch before the price was known is charged too.
#[tokio::test(start_paused = true)]
async fn a_worker_that_registered_itself_charges_its_jobs_once_the_reaper_prices_it() {
    let dir = tempdir("self-registered");
    let w = World::default();
    script_train_300(&w);
    submit(&w, "job-1", "train", 3, 100.0);
    let c = cfg(dir.path());
    let reaper = async {
        tokio::time::sleep(Duration::from_secs(150)).await;
        assert_eq!(w.registry.records()["i-self"].price_usd_per_h, 0.0, "registered itself");
        assert!(w.registry.set_price_if_unpriced("i-self", 0.36).await.unwrap());
    };
    let ((r, _), ()) = tokio::join!(agent(&w, "i-self", &c), reaper);
    let j = &r.jobs[0];
    assert_eq!(j.outcome, Outcome::Succeeded);
    assert!((j.seconds - 300.0).abs() < 3.0, "{}", j.seconds);
    let rec = job(&w, "job-1");
    assert!(
        (rec.cost_usd - 0.36 * j.seconds / 3600.0).abs() < 1e-9,
        "{} for {} s",
        rec.cost_usd,
        j.seconds
    );
    assert!((j.cost_usd - rec.cost_usd).abs() < 1e-12);
}

#[tokio::test(start_paused = true)]
async fn a_spot_notice_checkpoints_releases_without_counting_and_another_worker_resumes() {
    notice_release_resume("notice", None).await;
}

/// The same run with every second write to the jobs table losing its answer (the SDK sends it
/// again and the retry meets the row its first try wrote, `FakeJobs::lose_every`): the claim,
/// progress, release, second claim and success are each the agent's own, so the outcome, the
/// counts and the cost are the same.
#[tokio::test(start_paused = true)]
async fn a_notice_and_a_resume_end_the_same_when_every_second_write_loses_its_answer() {
    notice_release_resume("notice-lossy", Some(2)).await;
}

/// A spot notice at 50 s releases the job (one checkpoint up), and a second worker resumes it:
/// the assertions of both tests above, with every `lose_every`th job-table answer lost.
async fn notice_release_resume(name: &str, lose_every: Option<u32>) {
    let dir = tempdir(name);
    let w = World::default();
    if let Some(n) = lose_every {
        w.jobs.lose_every(n);
    }
    register(&w, "i-a");
    register(&w, "i-b");
    w.launcher.script(
        "train",
        Script {
            items: 200,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 1, 600.0);
    let md = Arc::new(FakeMetadata::new("i-a"));
    let md2 = md.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(50)).await;
        md2.set_notice(Notice::SpotInterruption {
            action: "terminate".into(),
            time: "2026-11-22T10:00:00Z".into(),
        });
    });
    let (r, terminated) = agent_until(&w, "i-a", &cfg(&dir.path().join("a")), std::future::pending(), Some(md)).await;
    assert!(
        matches!(r.exit, ExitReason::Notice(Notice::SpotInterruption { .. })),
        "{:?}",
        r.exit
    );
    assert_eq!(r.jobs[0].outcome, Outcome::Released);
    assert_eq!(r.jobs[0].checkpoints_uploaded, 1, "the stop checkpoint went up");
    assert_eq!(terminated, vec!["i-a".to_string()]);
    let rec = job(&w, "job-1");
    // Released: QUEUED, attempt not counted (max_attempts 1 would otherwise be used up).
    assert_eq!(
        (rec.state, rec.attempts, rec.lease_owner.clone()),
        (JobState::Queued, 0, None)
    );
    // The claimed message was deleted; the release sent a fresh one, visible at once.
    assert_eq!(w.inbox.remaining().len(), 1, "{:?}", w.inbox.remaining());
    assert_eq!(w.inbox.remaining()[0].1, 0, "a fresh message");
    assert_eq!(w.inbox.pending_for("standard", "job-1"), 1);
    // Another worker resumes from the checkpoint and finishes the rest.
    let (r2, _) = agent(&w, "i-b", &cfg(&dir.path().join("b"))).await;
    let j = &r2.jobs[0];
    assert_eq!((j.outcome, j.resumed_from), (Outcome::Succeeded, Some(1)));
    let started = w.launcher.started();
    assert!(started[1].env.iter().any(|(k, _)| k == "ONOFF_RESUME_DIR"));
    let done_before = r.jobs[0].items.unwrap();
    assert!((45..=60).contains(&done_before), "{done_before}");
    // Only the remaining items were processed on the second worker (about 200 - 50 seconds).
    assert!(j.seconds < 160.0, "{}", j.seconds);
    let rec = job(&w, "job-1");
    assert_eq!(rec.state, JobState::Succeeded);
    // The row's cost is both attempts': each worker records the cost so far as a value, the
    // second from what its claim returned.
    assert!(r.jobs[0].cost_usd > 0.0 && j.cost_usd > 0.0);
    assert!(
        (rec.cost_usd - (r.jobs[0].cost_usd + j.cost_usd)).abs() < 1e-12,
        "{} for {} + {}",
        rec.cost_usd,
        r.jobs[0].cost_usd,
        j.cost_usd
    );
    assert_eq!(
        rec.attempt_log.len(),
        2,
        "each attempt logged once: {:?}",
        rec.attempt_log
    );
    if lose_every.is_some() {
        assert!(w.jobs.answers_lost() >= 3, "{} answers lost", w.jobs.answers_lost());
    }
}

/// A worker serving two lanes takes the preferred lane's job first even when SQS's short polls
/// find nothing (the worst SQS allows for a queue of few messages): the preferred lane is
/// long-polled too.
#[tokio::test(start_paused = true)]
async fn the_preferred_lanes_job_comes_first_though_short_polls_miss() {
    let dir = tempdir("lanes");
    let w = World {
        inbox: FakeInbox::default().with_short_polls_missing(),
        ..World::default()
    };
    register(&w, "i-a");
    w.launcher.script(
        "work",
        Script {
            items: 30,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-standard", "work", 1, 600.0);
    put_job(&w, "job-express", "work", 1, 600.0);
    let mut express = job(&w, "job-express");
    express.spec.lane = "express".into();
    w.jobs.put(express);
    w.inbox.send("express", &wake_up_body("job-express", 1, T0));
    let mut c = cfg(dir.path());
    c.lanes = vec!["express".into(), "standard".into()];
    let (r, _) = agent(&w, "i-a", &c).await;
    let order: Vec<String> = w
        .launcher
        .started()
        .iter()
        .filter_map(|cmd| {
            cmd.env
                .iter()
                .find(|(k, _)| k == "ONOFF_JOB_ID")
                .map(|(_, v)| v.clone())
        })
        .collect();
    assert_eq!(order, ["job-express", "job-standard"], "{r:?}");
}

#[tokio::test(start_paused = true)]
async fn an_idle_worker_deregisters_and_terminates_itself_after_the_idle_timeout() {
    let dir = tempdir("idle");
    let w = World::default();
    register(&w, "i-a");
    let start = tokio::time::Instant::now();
    let (r, terminated) = agent(&w, "i-a", &cfg(dir.path())).await;
    let waited = start.elapsed().as_secs_f64();
    assert_eq!(r.exit, ExitReason::IdleTimeout);
    assert!((120.0..131.0).contains(&waited), "{waited}");
    assert_eq!(terminated, vec!["i-a".to_string()]);
    let rec = w.registry.records()["i-a"].clone();
    assert_eq!(rec.state, WorkerState::Terminating);
    assert!(rec.heartbeat_at.is_some(), "heartbeats were written");
    // Asked to stop instead: deregisters but does not terminate the instance.
    let w = World::default();
    register(&w, "i-c");
    let (r, terminated) = agent_until(
        &w,
        "i-c",
        &cfg(dir.path()),
        tokio::time::sleep(Duration::from_secs(30)),
        None,
    )
    .await;
    assert_eq!((r.exit, terminated.len()), (ExitReason::Shutdown, 0));
}

/// The world's ports for agent `id`, with an instance of its own (what it terminated and
/// released, [`FakeInstance`]).
fn own_deps<'w>(
    w: &'w World,
    id: &str,
) -> Deps<
    FakeMetadata,
    &'w FakeInbox,
    &'w FakeJobs,
    &'w FakeRegistry,
    &'w FakeCheckpoints,
    &'w FakeObjects,
    FakeInstance,
    &'w ScriptedLauncher,
> {
    Deps {
        metadata: FakeMetadata::new(id),
        inbox: &w.inbox,
        jobs: &w.jobs,
        registry: &w.registry,
        checkpoints: &w.checkpoints,
        objects: &w.objects,
        instance: FakeInstance::default(),
        launcher: &w.launcher,
    }
}

#[tokio::test(start_paused = true)]
async fn an_agent_that_cannot_register_releases_its_spot_request_before_it_exits() {
    // Not registered by the control plane, and the workers table refuses the agent's own
    // registration: the agent exits with the error, and its instance powers off (terminated, as
    // the launch template's shutdown behaviour says). Its persistent spot request is cancelled
    // first, or EC2 would launch another in its place to fail the same way.
    let dir = tempdir("unregistered");
    let w = World::default();
    w.registry.fail_next(onoff_control::ports::StoreError::Other(
        "throttled past its retries".into(),
    ));
    let deps = own_deps(&w, "i-u");
    let err = run(&deps, &cfg(dir.path()), T0, std::future::pending())
        .await
        .expect_err("the registration failed");
    assert!(err.to_string().contains("throttled past its retries"), "{err}");
    assert_eq!(deps.instance.released(), ["i-u"], "the request released");
    assert!(
        deps.instance.0.lock().unwrap().is_empty(),
        "not terminated by the agent"
    );
    // An agent that ends as it should releases nothing: terminating itself, it cancels its
    // request there (Ec2Instance::terminate_self), and a stopped one keeps it to start again.
    let w = World::default();
    register(&w, "i-v");
    let deps = own_deps(&w, "i-v");
    let r = run(&deps, &cfg(dir.path()), T0, std::future::pending()).await.unwrap();
    assert_eq!(r.exit, ExitReason::IdleTimeout);
    assert!(deps.instance.released().is_empty());
    // A work dir it cannot make (a file in its place): no job could run, so it exits before it
    // registers, its request released the same way.
    let w = World::default();
    let blocked = dir.path().join("not-a-dir");
    std::fs::write(&blocked, b"").unwrap();
    let deps = own_deps(&w, "i-w");
    let err = run(&deps, &cfg(&blocked.join("work")), T0, std::future::pending())
        .await
        .expect_err("no work dir");
    assert!(err.to_string().starts_with("work dir "), "{err}");
    assert_eq!(deps.instance.released(), ["i-w"]);
    assert!(w.registry.records().is_empty(), "not registered");
}

/// An idle agent `id` while the control plane holds it: each of `holds` is (seconds since the
/// previous one, hold until `T0` + seconds). Returns the world, the report, the instances
/// terminated and the seconds the agent ran.
async fn idle_under_holds(c: &AgentConfig, id: &str, holds: &[(u64, f64)]) -> (World, AgentReport, Vec<String>, f64) {
    let w = World::default();
    register(&w, id);
    let start = tokio::time::Instant::now();
    let decisions = async {
        for (after_s, until) in holds {
            tokio::time::sleep(Duration::from_secs(*after_s)).await;
            assert!(w.registry.hold_idle(id, T0 + until).await.unwrap());
        }
    };
    let ((r, terminated), ()) = tokio::join!(agent(&w, id, c), decisions);
    let waited = start.elapsed().as_secs_f64();
    (w, r, terminated, waited)
}

#[tokio::test(start_paused = true)]
async fn an_idle_worker_the_control_plane_holds_outlives_its_idle_timeout_until_the_hold_lapses() {
    let dir = tempdir("held");
    let c = cfg(dir.path());
    // The control plane keeps the worker for a warm pool: a decision at +60 s holds it to +400 s,
    // one at +350 s renews the hold to +700 s; then decisions stop (the control plane is gone).
    let (w, r, terminated, waited) = idle_under_holds(&c, "i-h", &[(60, 400.0), (290, 700.0)]).await;
    assert_eq!(r.exit, ExitReason::IdleTimeout);
    // Not at its 120 s idle timeout: at the end of the last hold, and no later.
    assert!((700.0..711.0).contains(&waited), "{waited}");
    assert_eq!(terminated, vec!["i-h".to_string()]);
    assert_eq!(w.registry.records()["i-h"].state, WorkerState::Terminating);
    // A hold that lapsed before the idle timeout changes nothing.
    let (_, r, _, waited) = idle_under_holds(&c, "i-l", &[(10, 60.0)]).await;
    assert_eq!(r.exit, ExitReason::IdleTimeout);
    assert!((120.0..131.0).contains(&waited), "{waited}");
}

#[tokio::test(start_paused = true)]
async fn a_crashing_job_is_retried_then_failed_with_its_reason() {
    let dir = tempdir("crash");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "crash",
        Script {
            items: 5,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 3,
        },
    );
    submit(&w, "job-1", "crash", 2, 600.0);
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    let outcomes: Vec<_> = r.jobs.iter().map(|j| (j.outcome, j.attempt, j.exit_code())).collect();
    assert_eq!(
        outcomes,
        vec![(Outcome::Retrying, 1, Some(3)), (Outcome::Failed, 2, Some(3))]
    );
    let rec = job(&w, "job-1");
    assert_eq!((rec.state, rec.attempts), (JobState::Failed, 2));
    let reason = &w.jobs.errors()["job:job-1"];
    assert!(
        reason.contains("exit code 3") && reason.contains("attempt 2 of 2"),
        "{reason}"
    );
    assert!(w.inbox.remaining().is_empty());
    // A program that does not exist fails the same way, with the start error as the reason (on
    // a new worker: i-a terminated itself when it went idle).
    submit(&w, "job-2", "no-such-program", 1, 600.0);
    register(&w, "i-b");
    let (r, _) = agent(&w, "i-b", &cfg(dir.path())).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Failed);
    assert!(w.jobs.errors()["job:job-2"].contains("no-such-program"));
}

/// A job a signal ended, the agent having asked for nothing, fails its attempt with the signal by
/// name and what most often sends it: SIGKILL the kernel's out-of-memory killer, SIGBUS a full
/// `/dev/shm`. Before, the reason was "killed by a signal", whichever it was.
#[tokio::test(start_paused = true)]
async fn a_job_killed_by_a_signal_names_it_in_its_reason() {
    let dir = tempdir("killed");
    let w = World::default();
    register(&w, "i-a");
    script(&w, "work", 20);
    w.launcher.kill_start(0, 5, 9);
    w.launcher.kill_start(1, 5, 7);
    submit(&w, "job-1", "work", 1, 600.0);
    submit(&w, "job-2", "work", 1, 600.0);
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    let outcomes: Vec<_> = r
        .jobs
        .iter()
        .map(|j| (j.job_id.as_str(), j.outcome, j.exit_code()))
        .collect();
    assert_eq!(
        outcomes,
        vec![("job-1", Outcome::Failed, None), ("job-2", Outcome::Failed, None)]
    );
    let errors = w.jobs.errors();
    let (oom, bus) = (&errors["job:job-1"], &errors["job:job-2"]);
    assert!(
        oom.contains("killed by SIGKILL (signal 9)") && oom.contains("out-of-memory killer"),
        "{oom}"
    );
    assert!(
        bus.contains("killed by SIGBUS (signal 7)") && bus.contains("/dev/shm"),
        "{bus}"
    );
    // The attempt records keep the signal (`onoff status` shows it in place of an exit code).
    let ended = |id: &str| {
        let a = &job(&w, id).attempt_log[0];
        (a.exit_code, a.signal)
    };
    assert_eq!((ended("job-1"), ended("job-2")), ((None, Some(9)), (None, Some(7))));
}

/// A reason quotes what failed; on a row whose spec is near its 256 KiB it must still fit
/// DynamoDB's 400 KB item (the fake jobs table refuses a write past it, as DynamoDB does).
#[tokio::test(start_paused = true)]
async fn a_reason_that_quotes_a_huge_spec_still_ends_the_job() {
    let dir = tempdir("huge-reason");
    let w = World::default();
    register(&w, "i-a");
    script(&w, "work", 5);
    submit(&w, "job-img", "work", 3, 600.0);
    let mut rec = job(&w, "job-img");
    rec.spec.image = "x".repeat(210_000);
    w.jobs.put(rec);
    let mut c = cfg(dir.path());
    c.worker_image = Some("other-image".into());
    let (r, _) = agent(&w, "i-a", &c).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Failed, "{r:?}");
    let rec = job(&w, "job-img");
    assert_eq!(rec.state, JobState::Failed, "ended at once, not left to the reaper");
    let reason = rec.reason.unwrap();
    assert!(reason.len() <= onoff_control::job::MAX_REASON_BYTES && reason.ends_with('…'));
    assert!(reason.starts_with("job wants image \"xxx"), "{reason}");
}

#[tokio::test(start_paused = true)]
async fn poison_messages_and_jobs_for_another_image_never_run() {
    let dir = tempdir("poison");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "work",
        Script {
            items: 5,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    let bad = w.inbox.send("standard", "not json at all");
    let unknown = w.inbox.send("standard", r#"{"job_id":"job-nope"}"#);
    submit(&w, "job-img", "work", 3, 600.0);
    let mut c = cfg(dir.path());
    c.worker_image = Some("other-image".into());
    let (r, _) = agent(&w, "i-a", &c).await;
    assert!(w.launcher.started().is_empty(), "nothing ran");
    let errors = w.jobs.errors();
    assert!(errors[&format!("sqs:{bad}")].contains("not {\"job_id\""), "{errors:?}");
    assert!(
        errors[&format!("sqs:{unknown}")].contains("no job job-nope"),
        "{errors:?}"
    );
    assert!(errors["job:job-img"].contains("other-image"));
    assert_eq!(job(&w, "job-img").state, JobState::Failed);
    // The poison messages are received again and again until SQS moves them to the dead-letter
    // queue (maxReceiveCount 5); the job's message was deleted at claim.
    let dead = w.inbox.dead_letters();
    assert_eq!(dead.len(), 2, "{dead:?} {:?}", w.inbox.remaining());
    assert!(dead.iter().all(|b| !b.contains("job-img")), "{dead:?}");
    assert!(w.inbox.remaining().is_empty(), "{:?}", w.inbox.remaining());
    assert!(r.poison >= 10, "{}", r.poison);
}

/// A job row that does not parse is claimed before the claim's answer says so (one conditional
/// write that returns the row, on DynamoDB as in the fake): the agent ends it FAILED with the
/// reason under the lease it got, so it does not stay RUNNING and listed unreadable on every
/// reconcile, and its message is poison, with the same reason, until the dead-letter queue.
#[tokio::test(start_paused = true)]
async fn an_unreadable_job_row_it_claimed_is_failed_with_its_reason_and_its_message_is_poison() {
    let dir = tempdir("unreadable");
    let w = World::default();
    register(&w, "i-a");
    submit(&w, "job-garbled", "work", 3, 600.0);
    w.jobs.put_unreadable("job-garbled", "spec is not JSON");
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert!(w.launcher.started().is_empty(), "nothing ran");
    let row = job(&w, "job-garbled");
    assert_eq!((row.state, row.lease_owner.as_deref()), (JobState::Failed, None));
    let reason = row.reason.unwrap_or_default();
    assert!(
        reason.contains("cannot be read") && reason.contains("spec is not JSON"),
        "{reason}"
    );
    assert!(row.finished_at.is_some());
    let listed = w.jobs.active().await.unwrap();
    assert!(listed.unreadable.is_empty() && listed.items.is_empty(), "{listed:?}");
    let errors = w.jobs.errors();
    assert!(
        errors.values().any(|e| e.contains("job job-garbled cannot be read")),
        "{errors:?}"
    );
    assert_eq!(w.inbox.dead_letters().len(), 1, "{:?}", w.inbox.remaining());
    assert!(r.poison >= 1, "{}", r.poison);
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_kills_the_job_and_records_nothing() {
    let dir = tempdir("lost");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 300,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 600.0);
    // The reaper ends the lease behind the agent's back (as after a missed renewal) and sends
    // a fresh message.
    let jobs = &w.jobs;
    let requeue = async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        let seen = jobs.get("job-1").await.unwrap().unwrap();
        let settle = Settle::of(&seen, &AttemptEnd::LeaseLost("expired".into()), &RerunLimits::default());
        jobs.requeue_lost(
            "job-1",
            seen.lease_owner.as_deref().unwrap(),
            seen.lease_expires_at.unwrap(),
            &settle,
            T0 + 30.0,
        )
        .await
        .unwrap();
        wake(jobs, &w.inbox, "job-1", &seen.spec, 0, T0 + 30.0).await.unwrap();
    };
    let c = cfg(dir.path());
    let (_, (r, _)) = tokio::join!(requeue, agent(&w, "i-a", &c));
    assert_eq!(r.jobs[0].outcome, Outcome::LostLease);
    assert!(!r.jobs[0].completed);
    // The reaper's fresh message runs it again; the lost lease is counted, the attempt is not.
    assert_eq!(r.jobs.len(), 2, "{:?}", r.jobs);
    assert_eq!(r.jobs[1].outcome, Outcome::Succeeded);
    let rec = job(&w, "job-1");
    assert_eq!(
        (rec.state, rec.attempts, rec.lease_expiries),
        (JobState::Succeeded, 1, 1)
    );
}

/// A fresh directory for one test's work, removed when the value is dropped.
fn tempdir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("onoff-agent-test-{name}-"))
        .tempdir()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_job_gets_its_input_and_contract_variables() {
    let dir = tempdir("input");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "work",
        Script {
            items: 2,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "work", 3, 600.0);
    let mut rec = job(&w, "job-1");
    rec.spec.input = Some("s3://b/inputs/items.txt".into());
    w.jobs.put(rec);
    w.objects
        .objects
        .lock()
        .unwrap()
        .insert("s3://b/inputs/items.txt".into(), b"1\n2\n".to_vec());
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    let env = &w.launcher.started()[0].env;
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get("ONOFF_JOB_ID").as_deref(), Some("job-1"));
    assert_eq!(get("ONOFF_ATTEMPT").as_deref(), Some("1"));
    assert_eq!(get("ONOFF_JOB_INPUT_URI").as_deref(), Some("s3://b/inputs/items.txt"));
    let input = std::path::PathBuf::from(get("ONOFF_JOB_INPUT").unwrap());
    assert_eq!(w.launcher.work_dir(0).unwrap()[&input].1, b"1\n2\n");
    assert!(!input.exists(), "the work dir is gone once the attempt is settled");
    assert!(get("ONOFF_CHECKPOINT_DIR").is_some() && get("ONOFF_STOP_FILE").is_some());
    assert!(get("ONOFF_RESUME_DIR").is_none(), "nothing to resume from");
    // A missing input fails the attempt with the reason.
    submit(&w, "job-2", "work", 1, 600.0);
    let mut rec = job(&w, "job-2");
    rec.spec.input = Some("s3://b/missing".into());
    w.jobs.put(rec);
    register(&w, "i-b");
    let (r, _) = agent(&w, "i-b", &cfg(dir.path())).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Failed);
    assert!(w.jobs.errors()["job:job-2"].contains("NoSuchKey"));
}

/// A job's session names its input, in any script, as STS takes it (the fake holds the session
/// policy to STS's rules); an input whose policy STS would refuse fails the job for good with
/// the reason, never reaching the job and leaving its other attempts unspent: no attempt could
/// get that session.
#[tokio::test(start_paused = true)]
async fn a_job_gets_a_session_for_an_input_in_any_script() {
    let dir = tempdir("session-input");
    let w = World {
        objects: FakeObjects::with_sessions(),
        ..World::default()
    };
    script(&w, "work", 2);
    for (id, uri) in [
        ("job-1", "s3://b/inputs/run’s 入力.csv".to_string()),
        // Past admission's check (a spec stored before it): 2,041 characters escaped.
        ("job-2", format!("s3://b/{}", "入".repeat(339))),
    ] {
        submit(&w, id, "work", 3, 600.0);
        let mut rec = job(&w, id);
        rec.spec.input = Some(uri.clone());
        w.jobs.put(rec);
        w.objects.objects.lock().unwrap().insert(uri, b"1\n".to_vec());
    }
    register(&w, "i-a");
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    let outcome = |id: &str| r.jobs.iter().find(|j| j.job_id == id).map(|j| j.outcome);
    assert_eq!(outcome("job-1"), Some(Outcome::Succeeded), "{r:?}");
    assert_eq!(outcome("job-2"), Some(Outcome::Failed), "{r:?}");
    assert!(w.jobs.errors()["job:job-2"].contains("2,048"), "{:?}", w.jobs.errors());
    let failed = job(&w, "job-2");
    assert_eq!((failed.state, failed.attempts), (JobState::Failed, 1), "not retried");
    assert_eq!(w.launcher.started().len(), 1, "only job-1 ran");
}

/// STS refusing a job's session policy whatever the moment (`PackedPolicyTooLarge`: the packed
/// policy has a limit of its own that the text's 2,048 characters do not show) fails the job for
/// good at its first attempt; any other STS failure (throttling, here on every call) fails the
/// attempt, and the job is tried again until its attempts are spent.
#[tokio::test(start_paused = true)]
async fn a_session_sts_refuses_fails_the_job_at_once_and_a_throttled_one_is_retried() {
    use onoff_agent::ports::SessionError;
    for (error, attempts) in [
        (
            SessionError::Refused("job session (role): PackedPolicyTooLarge: Packed size 102%".into()),
            1,
        ),
        (
            SessionError::Failed("job session (role): Throttling: Rate exceeded".into()),
            3,
        ),
    ] {
        let dir = tempdir("session-refused");
        let w = World {
            objects: FakeObjects::with_sessions(),
            ..World::default()
        };
        *w.objects.session_error.lock().unwrap() = Some(error.clone());
        script(&w, "work", 2);
        submit(&w, "job-1", "work", 3, 600.0);
        register(&w, "i-a");
        let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
        assert_eq!(r.jobs.len(), attempts as usize, "{r:?}");
        let rec = job(&w, "job-1");
        assert_eq!((rec.state, rec.attempts), (JobState::Failed, attempts), "{error:?}");
        assert!(
            w.jobs.errors()["job:job-1"].contains(&error.to_string()),
            "{:?}",
            w.jobs.errors()
        );
        assert!(w.launcher.started().is_empty(), "the job never started");
    }
}

/// A checkpoint of about 20 GB at ~70 Mbit/s: 40 minutes each way.
const SLOW: Duration = Duration::from_secs(2400);

/// Run agent `id` and look at the jobs table and the workers table every 5 s while it runs:
/// whenever job `job_id` is RUNNING, its lease must run into the future (the reaper would
/// otherwise end it and another worker run it), nobody else can claim it, and the agent's
/// heartbeat must be fresh (the reaper treats 300 s of silence as a lost instance). Returns the
/// report, the terminations and how many samples saw the job RUNNING.
async fn agent_watched(
    w: &World,
    id: &str,
    c: &AgentConfig,
    metadata: Option<Arc<FakeMetadata>>,
    job_id: &str,
) -> (AgentReport, Vec<String>, u32) {
    let start = tokio::time::Instant::now();
    let run = agent_until(w, id, c, std::future::pending(), metadata);
    tokio::pin!(run);
    let mut samples = 0;
    loop {
        tokio::select! {
            (report, terminated) = &mut run => return (report, terminated, samples),
            () = tokio::time::sleep(Duration::from_secs(5)) => {
                let now = T0 + start.elapsed().as_secs_f64();
                let rec = job(w, job_id);
                if rec.state != JobState::Running {
                    continue;
                }
                samples += 1;
                let until = rec.lease_expires_at.unwrap();
                assert!(until > now, "lease of {job_id} ran out at {until} (now {now})");
                assert_eq!(
                    w.jobs.claim(job_id, "i-other", now + 60.0, now).await.unwrap(),
                    Claim::NotClaimable(JobState::Running)
                );
                let beat = w.registry.records()[id].heartbeat_at.unwrap();
                assert!(now - beat <= c.heartbeat_s + 5.0, "last heartbeat {} s ago", now - beat);
            }
        }
    }
}

/// Put a complete checkpoint holding `items` in the store as `seq` of `job_id`.
async fn seed_checkpoint(w: &World, job_id: &str, seq: u64, items: u64) {
    let d = tempdir(&format!("seed-{job_id}-{seq}"));
    std::fs::write(d.path().join("items"), items.to_string()).unwrap();
    w.checkpoints.upload(job_id, seq, d.path()).await.unwrap();
}

/// Items in the newest stored checkpoint of `job_id`.
async fn stored_items(w: &World, job_id: &str) -> u64 {
    let latest = w.checkpoints.latest(job_id).await.unwrap().unwrap();
    let d = tempdir(&format!("stored-{job_id}-{}", latest.seq));
    w.checkpoints.download(&latest, d.path()).await.unwrap();
    std::fs::read_to_string(d.path().join("items"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_checkpoint_that_takes_40_minutes_each_way_never_costs_the_lease_or_the_heartbeat() {
    let dir = tempdir("slow");
    let w = World {
        checkpoints: FakeCheckpoints::with_transfer_time(SLOW),
        ..World::default()
    };
    register(&w, "i-a");
    // An hour of work resumed at item 100; local checkpoints every 10 minutes (each deletes the
    // one before, long before its 40-minute upload is done), uploads every 15.
    w.launcher.script(
        "train",
        Script {
            items: 3600,
            items_per_s: 1,
            checkpoint_every_s: Some(600),
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 900.0);
    seed_checkpoint(&w, "job-1", 1, 100).await;
    let seeded = w.checkpoints.transfers().len();
    let c = cfg(dir.path());
    let (r, _, samples) = agent_watched(&w, "i-a", &c, None, "job-1").await;
    // 40 min of download, then 3500 s of work: the lease and the heartbeat were checked
    // throughout (every 5 s) and always held.
    assert!(samples >= (2400 + 3500) / 5 - 2, "{samples}");
    assert_eq!(r.jobs.len(), 1, "{:?}", r.jobs);
    let j = &r.jobs[0];
    assert_eq!((j.outcome, j.resumed_from), (Outcome::Succeeded, Some(1)));
    assert!((j.seconds - 3500.0).abs() < 3.0, "{}", j.seconds);
    assert_eq!(w.launcher.started().len(), 1, "it ran once");
    let rec = job(&w, "job-1");
    assert_eq!(
        (rec.state, rec.attempts, rec.lease_expiries),
        (JobState::Succeeded, 1, 0)
    );
    // The download came first; the upload started 900 s into the run went up while the job ran
    // on (it took 40 min); the next one was still in flight when the job exited 0 and was left:
    // SUCCEEDED does not wait for it.
    let t = &w.checkpoints.transfers()[seeded..];
    assert_eq!(t.len(), 3, "{t:?}");
    assert!(!t[0].upload && t[0].ended.is_some());
    assert!(t[1].upload && t[1].ended.is_some() && t[1].seq == 2);
    assert!(t[2].upload && t[2].ended.is_none(), "{t:?}");
    assert_eq!(j.checkpoints_uploaded, 1);
    assert_eq!(rec.last_checkpoint, Some(format!("checkpoints/job-1/{:020}/", 2)));
    assert_eq!(r.exit, ExitReason::IdleTimeout);
}

#[tokio::test(start_paused = true)]
async fn a_spot_notice_during_a_slow_upload_stops_the_job_at_once_and_the_lease_outlasts_the_last_upload() {
    let dir = tempdir("slow-notice");
    let w = World {
        checkpoints: FakeCheckpoints::with_transfer_time(SLOW),
        ..World::default()
    };
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 10_000,
            items_per_s: 1,
            checkpoint_every_s: Some(100),
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 1, 100.0);
    let md = Arc::new(FakeMetadata::new("i-a"));
    let md2 = md.clone();
    // The upload started at 100 s is still going (until 2500 s) when the notice comes.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(300)).await;
        md2.set_notice(Notice::SpotInterruption {
            action: "terminate".into(),
            time: "2026-11-22T10:00:00Z".into(),
        });
    });
    let (r, terminated, samples) = agent_watched(&w, "i-a", &cfg(dir.path()), Some(md), "job-1").await;
    assert!(
        matches!(r.exit, ExitReason::Notice(Notice::SpotInterruption { .. })),
        "{:?}",
        r.exit
    );
    let j = &r.jobs[0];
    assert_eq!(j.outcome, Outcome::Released);
    // Stopped within an IMDS poll of the notice, not after the upload in flight.
    let done = j.items.unwrap();
    assert!((300..=310).contains(&done), "{done}");
    // The upload in flight finished, then the stop checkpoint went up, with the lease held the
    // whole time (about 80 minutes).
    assert_eq!(j.checkpoints_uploaded, 2);
    assert_eq!(w.checkpoints.seqs("job-1"), vec![1, 2]);
    assert_eq!(stored_items(&w, "job-1").await, done);
    assert!(samples >= 4800 / 5 - 2, "{samples}");
    let rec = job(&w, "job-1");
    assert_eq!((rec.state, rec.attempts, rec.lease_expiries), (JobState::Queued, 0, 0));
    assert_eq!(w.inbox.pending_for("standard", "job-1"), 1);
    assert_eq!(terminated, vec!["i-a".to_string()]);
}

#[tokio::test(start_paused = true)]
async fn a_job_cancelled_during_its_resume_download_is_never_started() {
    let dir = tempdir("slow-cancel");
    let w = World {
        checkpoints: FakeCheckpoints::with_transfer_time(Duration::from_secs(2410)),
        ..World::default()
    };
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 100,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 600.0);
    seed_checkpoint(&w, "job-1", 1, 10).await;
    // Cancelled at 2405 s: the lease was last renewed at 2400 s (every 20 s), the download ends
    // at 2410 s, the next renewal would come at 2420 s.
    let cancel = async {
        tokio::time::sleep(Duration::from_secs(2405)).await;
        w.jobs
            .transition("job-1", JobState::Running, JobState::Cancelled)
            .await
            .unwrap();
    };
    let c = cfg(dir.path());
    let (_, (r, _)) = tokio::join!(cancel, agent(&w, "i-a", &c));
    assert!(w.launcher.started().is_empty(), "the lease is checked before the start");
    assert_eq!(r.jobs.len(), 1);
    assert_eq!(r.jobs[0].outcome, Outcome::LostLease);
    assert_eq!(job(&w, "job-1").state, JobState::Cancelled);
}

#[tokio::test(start_paused = true)]
async fn a_rebalance_recommendation_uploads_a_checkpoint_at_once_lets_the_job_finish_and_takes_no_other() {
    let dir = tempdir("rebalance");
    let w = World::default();
    register(&w, "i-a");
    // No checkpoints of its own: only the one the agent asks for.
    w.launcher.script(
        "train",
        Script {
            items: 300,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 1, 600.0);
    submit(&w, "job-2", "train", 1, 600.0);
    let md = Arc::new(FakeMetadata::new("i-a"));
    let md2 = md.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(50)).await;
        md2.set_notice(Notice::Rebalance {
            time: "2026-11-22T10:00:00Z".into(),
        });
    });
    let registry = &w.registry;
    let draining = async {
        tokio::time::sleep(Duration::from_secs(100)).await;
        registry.records()["i-a"].state
    };
    let start = tokio::time::Instant::now();
    let c = cfg(dir.path());
    let (state_at_100, (r, terminated)) =
        tokio::join!(draining, agent_until(&w, "i-a", &c, std::future::pending(), Some(md)));
    assert!(
        matches!(r.exit, ExitReason::Notice(Notice::Rebalance { .. })),
        "{:?}",
        r.exit
    );
    // The job ran to the end on this instance: the rebalance did not stop it.
    assert_eq!(r.jobs.len(), 1, "{:?}", r.jobs);
    let j = &r.jobs[0];
    assert_eq!((j.outcome, j.completed, j.items), (Outcome::Succeeded, true, Some(300)));
    assert!((j.seconds - 300.0).abs() < 3.0, "{}", j.seconds);
    // It was asked for a checkpoint, which went up within seconds of the recommendation.
    assert_eq!(j.checkpoints_uploaded, 1);
    let up = &w.checkpoints.transfers()[0];
    let at = (up.started - start).as_secs_f64();
    assert!((50.0..=62.0).contains(&at), "uploaded at {at} s");
    let items = stored_items(&w, "job-1").await;
    assert!((50..=62).contains(&items), "{items}");
    // Meanwhile it told the control plane it takes no new work.
    assert_eq!(state_at_100, WorkerState::Draining);
    // It took no other job: job-2 waits, with its message, for a worker that stays.
    let other = job(&w, "job-2");
    assert_eq!((other.state, other.attempts), (JobState::Queued, 0));
    assert_eq!(w.inbox.pending_for("standard", "job-2"), 1);
    assert_eq!(w.launcher.started().len(), 1);
    assert_eq!(job(&w, "job-1").state, JobState::Succeeded);
    assert_eq!(terminated, vec!["i-a".to_string()]);
}

#[tokio::test(start_paused = true)]
async fn an_idle_agent_that_sees_a_rebalance_claims_nothing_and_leaves() {
    let dir = tempdir("rebalance-idle");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 30,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    let md = Arc::new(FakeMetadata::new("i-a"));
    let md2 = md.clone();
    let world = &w;
    // A job and a rebalance recommendation arrive together while the agent long-polls, between
    // two of its IMDS polls.
    let arrive = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        md2.set_notice(Notice::Rebalance {
            time: "2026-11-22T10:00:00Z".into(),
        });
        submit(world, "job-1", "train", 1, 600.0);
    };
    let c = cfg(dir.path());
    let (_, (r, terminated)) = tokio::join!(arrive, agent_until(&w, "i-a", &c, std::future::pending(), Some(md)));
    assert!(
        matches!(r.exit, ExitReason::Notice(Notice::Rebalance { .. })),
        "{:?}",
        r.exit
    );
    assert!(r.jobs.is_empty(), "{:?}", r.jobs);
    assert!(w.launcher.started().is_empty());
    let rec = job(&w, "job-1");
    assert_eq!((rec.state, rec.attempts), (JobState::Queued, 0));
    // Its message is back in the lane as a fresh one, for another worker.
    assert_eq!(w.inbox.pending_for("standard", "job-1"), 1);
    assert!(w.inbox.remaining().iter().all(|(_, receives)| *receives == 0));
    assert_eq!(terminated, vec!["i-a".to_string()]);
}

/// A scale-down or an interruption notice that marked the worker first wins the race with a
/// claim: the agent sees its row Draining or Terminating, leaves the message for another worker,
/// takes no job and terminates its instance; its heartbeat never revives the row.
#[tokio::test(start_paused = true)]
async fn a_worker_the_control_plane_is_retiring_takes_no_job_and_terminates() {
    let dir = tempdir("retiring");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "work",
        Script {
            items: 5,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    // Idle and polling, then the control plane marks it Draining before a job arrives.
    let registry = &w.registry;
    let inbox = &w.inbox;
    let jobs = &w.jobs;
    let later = async {
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(registry
            .set_state_if("i-a", WorkerState::Draining, &[WorkerState::Idle])
            .await
            .unwrap());
        let spec: JobSpec =
            serde_json::from_value(serde_json::json!({"image": "img", "command": ["work"], "project": "p"})).unwrap();
        jobs.put(JobRecord::new("job-1".into(), spec, "test".into(), T0));
        inbox.send("standard", r#"{"job_id":"job-1"}"#);
    };
    let c = cfg(dir.path());
    let (_, (r, terminated)) = tokio::join!(later, agent(&w, "i-a", &c));
    assert_eq!(r.exit, ExitReason::Drained);
    assert!(r.jobs.is_empty() && w.launcher.started().is_empty(), "{r:?}");
    assert_eq!(terminated, vec!["i-a".to_string()]);
    assert_eq!(job(&w, "job-1").state, JobState::Queued);
    assert_eq!(
        w.inbox.pending_for("standard", "job-1"),
        1,
        "the message is there for another worker"
    );
}

/// A throttled jobs table at claim time is not poison: no error record, no visibility change
/// (which would count towards the dead-letter queue), a fresh message after the retry delay, and
/// the job runs once the table answers again.
#[tokio::test(start_paused = true)]
async fn a_throttled_claim_is_retried_with_a_fresh_message_not_dead_lettered() {
    let dir = tempdir("throttled");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "work",
        Script {
            items: 3,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "work", 3, 600.0);
    // The claim (the first jobs-table call of this run) is throttled.
    w.jobs.fail_next(onoff_control::ports::StoreError::Other(
        "claim job: ThrottlingException: Rate of requests exceeds the allowed throughput".into(),
    ));
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert_eq!(r.poison, 0);
    assert!(w.jobs.errors().is_empty(), "{:?}", w.jobs.errors());
    assert!(w.inbox.dead_letters().is_empty());
    assert_eq!(r.jobs.len(), 1, "{r:?}");
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(job(&w, "job-1").attempts, 1, "the throttled claim counted nothing");
}

/// A job gets its own AWS session as a `credential_process` file, never in its environment, and
/// a job that runs longer than a session lasts (an hour: role chaining's limit) gets a new one
/// every half hour while it runs.
#[tokio::test(start_paused = true)]
async fn a_long_job_keeps_a_session_of_its_own_renewed_before_it_expires() {
    let dir = tempdir("session");
    let w = World {
        objects: FakeObjects::with_sessions(),
        ..World::default()
    };
    register(&w, "i-a");
    // 140 minutes of work.
    w.launcher.script(
        "train",
        Script {
            items: 8400,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 3600.0);
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    let issued = w.objects.sessions.lock().unwrap().unwrap();
    // At the start, then at 30, 60, 90 and 120 minutes.
    assert_eq!(issued, 5, "one session at the start and one every half hour");
    let env = &w.launcher.started()[0].env;
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert!(get("AWS_ACCESS_KEY_ID").is_none() && get("AWS_SESSION_TOKEN").is_none());
    let config = std::path::PathBuf::from(get("AWS_CONFIG_FILE").expect("AWS_CONFIG_FILE"));
    // The work dir as the job left it (the agent removes it once the attempt is settled).
    let left = w.launcher.work_dir(0).unwrap();
    let text = String::from_utf8(left[&config].1.clone()).unwrap();
    let process = text
        .lines()
        .find_map(|l| l.strip_prefix("credential_process = cat "))
        .expect("a credential_process line");
    let (mode, json) = &left[std::path::Path::new(process)];
    let creds: serde_json::Value = serde_json::from_slice(json).unwrap();
    assert_eq!(creds["Version"], 1);
    assert_eq!(creds["AccessKeyId"], "ASIAJOB5", "the file holds the newest session");
    assert_eq!(mode & 0o777, 0o600, "only the job's user reads its credentials");
    assert!(!config.exists(), "no session is left on the volume after the attempt");
}

/// `onoff cancel` on a running job: the next lease renewal tells the agent, which stops the job's
/// process group (SIGTERM, the grace period), records CANCELLED with the attempt in the log,
/// uploads the job's outputs, and never runs it again.
#[tokio::test(start_paused = true)]
async fn a_running_job_cancelled_by_the_user_is_stopped_recorded_and_never_retried() {
    let dir = tempdir("cancel-running");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 600,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 600.0);
    let cancel = async {
        tokio::time::sleep(Duration::from_secs(100)).await;
        let out = w.jobs.request_cancel("job-1", T0 + 100.0).await.unwrap();
        assert_eq!(out, CancelOutcome::Requested);
        // Asked again: the same answer, nothing else changes.
        assert_eq!(
            w.jobs.request_cancel("job-1", T0 + 101.0).await.unwrap(),
            CancelOutcome::Requested
        );
    };
    let c = cfg(dir.path());
    let (_, (r, _)) = tokio::join!(cancel, agent(&w, "i-a", &c));
    assert_eq!(w.launcher.started().len(), 1, "never run again");
    assert_eq!(r.jobs[0].outcome, Outcome::Cancelled);
    assert_eq!(r.jobs[0].exit_code(), Some(143), "stopped by SIGTERM");
    // Seen within one renewal (every 20 s): stopped well before its 600 s of work.
    assert!(r.jobs[0].seconds < 100.0 + 20.0 + 1.0, "{} s", r.jobs[0].seconds);
    let rec = job(&w, "job-1");
    assert_eq!(rec.state, JobState::Cancelled);
    assert_eq!(rec.reason.as_deref(), Some("cancelled by the user"));
    assert_eq!(rec.attempt_log.len(), 1);
    assert_eq!(rec.attempt_log[0].outcome, "cancelled");
    assert_eq!(rec.attempt_log[0].exit_code, Some(143));
    assert_eq!(rec.attempt_log[0].instance_id, "i-a");
    assert_eq!(
        w.inbox.pending_for("standard", "job-1"),
        0,
        "no wake-up message: never retried"
    );
    assert!(
        w.objects
            .outputs
            .lock()
            .unwrap()
            .contains_key("outputs/job-1/result.txt"),
        "its outputs are uploaded"
    );
    // A finished job is left as it is.
    assert_eq!(
        w.jobs.request_cancel("job-1", T0 + 500.0).await.unwrap(),
        CancelOutcome::AlreadyFinished(JobState::Cancelled)
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiting_job_cancelled_never_starts() {
    let dir = tempdir("cancel-queued");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 10,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 600.0);
    assert_eq!(
        w.jobs.request_cancel("job-1", T0).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert!(w.launcher.started().is_empty());
    assert!(r.jobs.is_empty());
    assert_eq!(job(&w, "job-1").state, JobState::Cancelled);
    assert_eq!(
        w.jobs.request_cancel("job-9", T0).await.unwrap(),
        CancelOutcome::Unknown
    );
}

/// What `onoff status`, `onoff logs` and `onoff outputs` read: each attempt in the job's log with
/// where and how it ran, its output lines in the attempt's own stream, its output directory.
#[tokio::test(start_paused = true)]
async fn an_attempt_is_logged_its_lines_shipped_and_its_outputs_uploaded() {
    let dir = tempdir("outputs");
    let w = World::default();
    register(&w, "i-a");
    w.launcher.script(
        "train",
        Script {
            items: 30,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
    submit(&w, "job-1", "train", 3, 600.0);
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(r.jobs[0].outputs_uploaded, 1);
    let rec = job(&w, "job-1");
    let a = &rec.attempt_log[0];
    assert_eq!((a.n, a.outcome.as_str(), a.exit_code), (1, "succeeded", Some(0)));
    assert_eq!(a.instance_type.as_deref(), Some("g5.xlarge"));
    assert!((a.seconds - 30.0).abs() < 2.0, "{}", a.seconds);
    assert!(a.ended_at > a.started_at);
    // The row says what became of the outputs, after the attempt it belongs to.
    let o = rec.outputs.expect("the outputs' record");
    assert_eq!((o.attempt, o.files, o.error.as_deref()), (1, 1, None));
    assert!(o.at >= a.ended_at);
    let logs = w.objects.logs.lock().unwrap().clone();
    // Every line the job printed, in order (its item counts too).
    let lines = &logs["job-1/1"];
    assert_eq!(lines.len(), 31, "{lines:?}");
    assert_eq!(
        (lines[0].as_str(), lines[30].as_str()),
        ("ONOFF_ITEMS 1", "finished 30")
    );
    let outputs = w.objects.outputs.lock().unwrap().clone();
    assert_eq!(
        outputs.get("outputs/job-1/result.txt").map(Vec::as_slice),
        Some(&b"30\n"[..])
    );
    let env = &w.launcher.started()[0].env;
    assert!(env.iter().any(|(k, _)| k == "ONOFF_OUTPUT_DIR"));
}

/// Outputs S3 refuses do not change the outcome (success is recorded first), but the job's own
/// log and its row say so, where its user looks.
#[tokio::test(start_paused = true)]
async fn outputs_that_fail_to_upload_are_told_in_the_jobs_own_log() {
    let dir = tempdir("outputs-refused");
    let w = World::default();
    register(&w, "i-a");
    script(&w, "train", 5);
    submit(&w, "job-1", "train", 3, 600.0);
    *w.objects.outputs_error.lock().unwrap() = Some("AccessDenied: not allowed".into());
    let (r, _) = agent(&w, "i-a", &cfg(dir.path())).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(r.jobs[0].outputs_uploaded, 0);
    let rec = job(&w, "job-1");
    assert_eq!(rec.state, JobState::Succeeded);
    // ... and so does the job's row, which `onoff status` and `onoff outputs` read.
    let o = rec.outputs.expect("the outputs' record");
    assert_eq!((o.attempt, o.files), (1, 0));
    assert!(o.error.as_deref().is_some_and(|e| e.contains("AccessDenied")), "{o:?}");
    let logs = w.objects.logs.lock().unwrap().clone();
    let last = logs["job-1/1"].last().unwrap();
    assert!(
        last.contains("outputs were not uploaded") && last.contains("AccessDenied"),
        "{last}"
    );
}

/// Register `id` as an on-demand worker launched for `pinned` (if any), as the scaler does.
fn register_on_demand(w: &World, id: &str, pinned: Option<&str>) {
    register_as(w, id, CapacityType::OnDemand, pinned);
}

/// IMDS of an on-demand instance.
fn on_demand_metadata(id: &str) -> Arc<FakeMetadata> {
    let mut md = FakeMetadata::new(id);
    md.identity.lifecycle = "on-demand".into();
    Arc::new(md)
}

/// Run the agent of on-demand instance `id` until it exits.
async fn on_demand_agent(w: &World, id: &str, dir: &std::path::Path) -> AgentReport {
    agent_until(w, id, &cfg(dir), std::future::pending(), Some(on_demand_metadata(id)))
        .await
        .0
}

/// A job whose deadline leaves `slack_s` beyond its declared 30 s run time, created at T0.
fn submit_with_deadline(w: &World, id: &str, program: &str, slack_s: f64) {
    submit(w, id, program, 1, 600.0);
    let mut rec = job(w, id);
    rec.spec.est_runtime_s = Some(30.0);
    rec.spec.deadline = Some(T0 + 30.0 + slack_s);
    w.jobs.put(rec);
}

fn script(w: &World, program: &str, seconds: u64) {
    w.launcher.script(
        program,
        Script {
            items: seconds,
            items_per_s: 1,
            checkpoint_every_s: None,
            exit_code: 0,
        },
    );
}

#[tokio::test(start_paused = true)]
async fn a_spot_worker_defers_a_job_whose_deadline_is_at_risk_and_an_on_demand_one_runs_it() {
    // 1,000 s of slack: under the 1,590 s one interruption on a spot worker needs (the default
    // policy), over the 390 s an on-demand cold start takes. The spot worker claims it and gives
    // it back (uncounted) each time; the on-demand worker, up 40 s later, runs it.
    let dir = tempdir("deadline");
    let w = World::default();
    register(&w, "i-spot");
    register_on_demand(&w, "i-od", None);
    script(&w, "due", 30);
    submit_with_deadline(&w, "job-due", "due", 1_000.0);
    let (spot_cfg, od_cfg) = (cfg(&dir.path().join("spot")), cfg(&dir.path().join("od")));
    let late_od = async {
        tokio::time::sleep(Duration::from_secs(40)).await;
        agent_until(
            &w,
            "i-od",
            &od_cfg,
            std::future::pending(),
            Some(on_demand_metadata("i-od")),
        )
        .await
    };
    let ((rs, _), (ro, _)) = tokio::join!(agent(&w, "i-spot", &spot_cfg), late_od);
    assert!(rs.jobs.is_empty(), "the spot worker never ran it: {:?}", rs.jobs);
    assert!(rs.deferred >= 2, "deferred each time it came: {}", rs.deferred);
    assert_eq!(rs.handed_back, 0);
    assert_eq!(ro.jobs.len(), 1);
    assert_eq!(ro.jobs[0].outcome, Outcome::Succeeded);
    let rec = job(&w, "job-due");
    assert_eq!(rec.state, JobState::Succeeded);
    // max_attempts 1 and no hand-back counted: deferrals are free.
    assert_eq!((rec.attempts, rec.hand_backs), (1, 0));
    assert!(w.inbox.remaining().is_empty(), "{:?}", w.inbox.remaining());
    assert_eq!(rs.exit, ExitReason::IdleTimeout);

    // With ample slack (5,000 s) the spot worker runs it; with less than a cold start when it
    // was created (300 s) too: no launch could meet it, the worker already up can.
    for (id, slack) in [("job-roomy", 5_000.0), ("job-tight", 300.0)] {
        let dir = tempdir(id);
        let w = World::default();
        register(&w, "i-spot");
        script(&w, "due", 30);
        submit_with_deadline(&w, id, "due", slack);
        let (rs, _) = agent(&w, "i-spot", &cfg(dir.path())).await;
        assert_eq!((rs.jobs.len(), rs.deferred), (1, 0), "{id}");
        assert_eq!(job(&w, id).state, JobState::Succeeded, "{id}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_on_demand_worker_of_a_spot_first_lane_runs_only_the_jobs_its_premium_is_worth() {
    // i-od: a g5.xlarge on-demand at 1.006 $/h whose row records the best spot price for its
    // shape, 0.36 $/h. A ten-hour job would cost $6.46 more there, far more than a spot launch's
    // billed boot and the wait it saves at 1 $/h (about $0.15): handed back, uncounted. A 30 s
    // job, or the same ten-hour job after eight hours in the queue, runs.
    for (id, runtime, waited, runs) in [
        ("job-long", 36_000.0, 0.0, false),
        ("job-short", 30.0, 0.0, true),
        ("job-waited", 36_000.0, 8.0 * 3600.0, true),
    ] {
        let dir = tempdir(id);
        let w = World::default();
        let offering = OfferingKey {
            instance_type: "g5.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::OnDemand,
        };
        pollster::block_on(w.registry.register_launch(WorkerRecord {
            spot_price_usd_per_h: Some(0.36),
            ..WorkerRecord::launched("i-od", "standard", offering, 1.006, T0)
        }))
        .unwrap();
        script(&w, "p", 30);
        submit(&w, id, "p", 1, 600.0);
        let mut rec = job(&w, id);
        rec.spec.est_runtime_s = Some(runtime);
        rec.created_at = T0 - waited;
        w.jobs.put(rec);
        let r = on_demand_agent(&w, "i-od", dir.path()).await;
        if runs {
            assert_eq!((r.jobs.len(), r.deferred), (1, 0), "{id}");
            assert_eq!(job(&w, id).state, JobState::Succeeded, "{id}");
        } else {
            assert!(r.jobs.is_empty() && r.deferred >= 1, "{id}: {r:?}");
            let rec = job(&w, id);
            assert_ne!(rec.state, JobState::Succeeded, "{id}");
            assert_eq!(rec.hand_backs, 0, "{id}: deferrals are not counted");
            assert_eq!(
                rec.reason.as_deref(),
                Some(
                    "deferred: waiting for spot: on-demand worker i-od costs $6.46 more for its 36000 s than \
                     spot (1.006 against 0.360 $/h), more than the launch and the wait it saves"
                ),
                "{id}"
            );
            assert_eq!(
                r.exit,
                ExitReason::IdleTimeout,
                "{id}: it stayed idle until its timeout"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_undeclared_jobs_run_time_is_the_estimate_its_workers_row_holds_for_the_jobs_lane() {
    // Jobs of lane standard that declare no run time. On spot, one due 4,600 s after it was
    // created: counted as the row's 30 s it has 4,570 s of slack and runs; counted as the
    // policy's default 3,600 s it has 1,000 s, under the 1,590 s a spot start needs: deferred.
    // On an on-demand g5.xlarge (1.006 $/h, spot 0.36 $/h), one with no deadline: 30 s cost
    // under a cent more there and it runs; 3,600 s cost $0.65 more, more than the wait for spot
    // is worth: deferred. A row whose estimate is for another lane (express) counts the default.
    for (case, capacity, row_lane, estimate, deadline, runs) in [
        (
            "spot, estimate",
            CapacityType::Spot,
            "standard",
            Some(30.0),
            Some(T0 + 4_600.0),
            true,
        ),
        (
            "spot, none",
            CapacityType::Spot,
            "standard",
            None,
            Some(T0 + 4_600.0),
            false,
        ),
        (
            "spot, other lane's",
            CapacityType::Spot,
            "express",
            Some(30.0),
            Some(T0 + 4_600.0),
            false,
        ),
        (
            "on-demand, estimate",
            CapacityType::OnDemand,
            "standard",
            Some(30.0),
            None,
            true,
        ),
        ("on-demand, none", CapacityType::OnDemand, "standard", None, None, false),
    ] {
        let dir = tempdir("estimate");
        let w = World::default();
        let on_demand = capacity == CapacityType::OnDemand;
        let offering = OfferingKey {
            instance_type: "g5.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: capacity,
        };
        pollster::block_on(w.registry.register_launch(WorkerRecord {
            spot_price_usd_per_h: on_demand.then_some(0.36),
            run_time_estimate_s: estimate,
            ..WorkerRecord::launched("i-w", row_lane, offering, if on_demand { 1.006 } else { 0.36 }, T0)
        }))
        .unwrap();
        script(&w, "p", 30);
        submit(&w, "job-u", "p", 1, 600.0);
        let mut rec = job(&w, "job-u");
        assert_eq!(rec.spec.est_runtime_s, None);
        rec.spec.deadline = deadline;
        w.jobs.put(rec);
        let md = on_demand.then(|| on_demand_metadata("i-w"));
        let (r, _) = agent_until(&w, "i-w", &cfg(dir.path()), std::future::pending(), md).await;
        if runs {
            assert_eq!((r.jobs.len(), r.deferred), (1, 0), "{case}");
            assert_eq!(job(&w, "job-u").state, JobState::Succeeded, "{case}");
        } else {
            assert!(r.jobs.is_empty() && r.deferred >= 1, "{case}: {r:?}");
            let reason = job(&w, "job-u").reason.unwrap_or_default();
            let why = if on_demand {
                "for its 3600 s"
            } else {
                "deadline at risk on spot"
            };
            assert!(reason.contains(why), "{case}: {reason}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_agent_whose_row_had_no_estimate_reads_the_one_the_reconciler_gave_it_later() {
    // A spot worker launched before its lane had an estimate: its row has none when its agent
    // starts. The reconciler then gives the row the lane's 30 s, and a job declaring no run time,
    // due 4,600 s after it was created, comes: counted as 30 s it has the slack to run on spot.
    // Had the agent kept the policy's default hour, it would have deferred the job (the first
    // test above: "spot, none").
    let dir = tempdir("estimate-later");
    let w = World::default();
    register(&w, "i-spot");
    script(&w, "p", 30);
    let later = async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            w.registry.set_run_time_estimate_if_unset("i-spot", 30.0).await,
            Ok(true)
        );
        submit(&w, "job-u", "p", 1, 600.0);
        let mut rec = job(&w, "job-u");
        rec.spec.deadline = Some(rec.created_at + 4_600.0);
        w.jobs.put(rec);
    };
    let c = cfg(dir.path());
    let ((r, _), ()) = tokio::join!(agent(&w, "i-spot", &c), later);
    assert_eq!((r.jobs.len(), r.deferred), (1, 0), "{r:?}");
    assert_eq!(job(&w, "job-u").state, JobState::Succeeded);
}

#[tokio::test(start_paused = true)]
async fn an_agent_without_an_estimate_reads_its_row_again_at_most_once_a_minute() {
    // A lane that never gets an estimate (no prior, too few jobs finished with a run time): the
    // row stays without one. Five jobs of 10 s declaring none come at once, then a sixth at
    // +150 s, 100 s after they end (within the idle timeout). The agent reads its row again at the first, not at the next four (within a
    // minute of that read: the reconciler, which would write it, runs once a minute at most),
    // and again at the sixth. A lane's claims cost at most one GetItem a minute, not one each.
    // The same jobs declaring their run time cost no read at all: the difference is the reads
    // for the estimate.
    async fn reads(declared: bool) -> (usize, AgentReport) {
        let dir = tempdir(if declared { "reread-declared" } else { "reread" });
        let w = World::default();
        register(&w, "i-spot");
        script(&w, "p", 10);
        let jobs = |ids: std::ops::Range<u32>| {
            for i in ids {
                let id = format!("job-{i}");
                submit(&w, &id, "p", 1, 600.0);
                if declared {
                    let mut rec = job(&w, &id);
                    rec.spec.est_runtime_s = Some(10.0);
                    w.jobs.put(rec);
                }
            }
        };
        jobs(0..5);
        let later = async {
            tokio::time::sleep(Duration::from_secs(150)).await;
            jobs(5..6);
        };
        let c = cfg(dir.path());
        let ((r, _), ()) = tokio::join!(agent(&w, "i-spot", &c), later);
        (w.registry.gets(), r)
    }
    let (undeclared, r) = reads(false).await;
    assert_eq!((r.jobs.len(), r.deferred), (6, 0), "{r:?}");
    let (declared, r) = reads(true).await;
    assert_eq!((r.jobs.len(), r.deferred), (6, 0), "{r:?}");
    assert_eq!(undeclared - declared, 2, "{undeclared} reads against {declared}");
    const { assert!(onoff_agent::agent::ESTIMATE_REREAD_S < 150.0 - 5.0 * 10.0) };
}

#[tokio::test(start_paused = true)]
async fn a_worker_launched_for_a_job_claims_that_job_first_and_its_message_is_dropped_later() {
    // The queue holds another job's message first; the worker the scaler launched for job-due
    // (its row's pinned_job) claims job-due by id before it polls, then serves the queue: the
    // other job, then job-due's own message, dropped as not claimable.
    let dir = tempdir("pinned");
    let w = World::default();
    register_on_demand(&w, "i-od", Some("job-due"));
    script(&w, "other", 10);
    script(&w, "due", 30);
    submit(&w, "job-other", "other", 1, 600.0);
    submit_with_deadline(&w, "job-due", "due", 1_000.0);
    let r = on_demand_agent(&w, "i-od", dir.path()).await;
    assert_eq!(r.pinned_claimed.as_deref(), Some("job-due"));
    let order: Vec<String> = w.launcher.started().iter().map(|c| c.argv[0].clone()).collect();
    assert_eq!(order, ["due", "other"]);
    assert_eq!(r.dropped, 1, "job-due's message, received after it ran");
    assert_eq!(job(&w, "job-due").state, JobState::Succeeded);
    assert_eq!(job(&w, "job-other").state, JobState::Succeeded);
    assert!(w.inbox.remaining().is_empty(), "{:?}", w.inbox.remaining());

    // A pinned job already taken by another worker (or finished) is left alone.
    let dir = tempdir("pinned-gone");
    let w = World::default();
    register_on_demand(&w, "i-od", Some("job-gone"));
    script(&w, "due", 30);
    submit_with_deadline(&w, "job-gone", "due", 1_000.0);
    let mut rec = job(&w, "job-gone");
    rec.state = JobState::Succeeded;
    w.jobs.put(rec);
    let r = on_demand_agent(&w, "i-od", dir.path()).await;
    assert_eq!(r.pinned_claimed, None);
    assert!(r.jobs.is_empty());
    assert_eq!(r.exit, ExitReason::IdleTimeout);
}

#[tokio::test(start_paused = true)]
async fn an_agent_whose_instance_the_control_plane_stops_takes_no_job_and_leaves_its_row_stopped() {
    let dir = tempdir("stopped");
    let c = cfg(dir.path());
    let w = World::default();
    register(&w, "i-s");
    script_train_300(&w);
    // The control plane stops the idle worker at +30 s (its row first, as `act` does); a job
    // comes at +40 s; the stop's shutdown reaches the agent at +100 s.
    let control_plane = async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(w
            .registry
            .mark_stopped("i-s", T0 + 30.0, T0 + 3600.0, T0)
            .await
            .unwrap());
        tokio::time::sleep(Duration::from_secs(10)).await;
        submit(&w, "job-1", "train", 3, 600.0);
    };
    let (r, terminated) = tokio::join!(
        agent_until(&w, "i-s", &c, tokio::time::sleep(Duration::from_secs(100)), None),
        control_plane
    )
    .0;
    assert_eq!(r.exit, ExitReason::Stopped);
    assert!(r.jobs.is_empty(), "{r:?}");
    // Not terminated, not deregistered: the row stays Stopped, kept until its hold.
    assert!(terminated.is_empty(), "{terminated:?}");
    let row = w.registry.records()["i-s"].clone();
    assert_eq!((row.state, row.hold_until), (WorkerState::Stopped, Some(T0 + 3600.0)));
    // The job waits for another worker, its message still there.
    assert_eq!(job(&w, "job-1").state, JobState::Queued);
    assert_eq!(w.inbox.remaining().len(), 1);

    // Started again (its row Pending, as `act` writes it), the agent serves the queue.
    assert!(w
        .registry
        .mark_started("i-s", T0 + 200.0, Some("p"), None, None)
        .await
        .unwrap());
    let (r, _) = agent_until(&w, "i-s", &c, tokio::time::sleep(Duration::from_secs(1_000)), None).await;
    assert_eq!(r.jobs.len(), 1, "{r:?}");
    assert_eq!(job(&w, "job-1").state, JobState::Succeeded);
}

#[tokio::test(start_paused = true)]
async fn an_idle_timeout_that_finds_its_row_stopped_waits_for_the_stop_and_keeps_the_instance() {
    let dir = tempdir("stopped-at-timeout");
    let c = cfg(dir.path());
    let w = World::default();
    register(&w, "i-s");
    // The control plane stops the idle worker at +115 s, after its last heartbeat (+90 s) and
    // just before its idle timeout (+120 s); the stop's shutdown reaches the agent at +150 s.
    let control_plane = async {
        tokio::time::sleep(Duration::from_secs(115)).await;
        assert!(w
            .registry
            .mark_stopped("i-s", T0 + 115.0, T0 + 3600.0, T0)
            .await
            .unwrap());
    };
    let (r, terminated) = tokio::join!(
        agent_until(&w, "i-s", &c, tokio::time::sleep(Duration::from_secs(150)), None),
        control_plane
    )
    .0;
    // Before: the timeout read a row that was not Idle, ended the instance and lost the volume
    // the stop was to keep.
    assert_eq!(r.exit, ExitReason::Stopped);
    assert!(terminated.is_empty(), "{terminated:?}");
    let row = w.registry.records()["i-s"].clone();
    assert_eq!((row.state, row.hold_until), (WorkerState::Stopped, Some(T0 + 3600.0)));
}

#[tokio::test(start_paused = true)]
async fn a_stop_that_never_comes_ends_the_instance_after_the_stop_wait() {
    let dir = tempdir("stop-never-came");
    let c = cfg(dir.path());
    let w = World::default();
    register(&w, "i-s");
    // The row turns Stopped at +115 s, but no StopInstances follows (the control plane died
    // between the two): no shutdown reaches the agent.
    let control_plane = async {
        tokio::time::sleep(Duration::from_secs(115)).await;
        assert!(w
            .registry
            .mark_stopped("i-s", T0 + 115.0, T0 + 86_400.0, T0)
            .await
            .unwrap());
    };
    let started = tokio::time::Instant::now();
    let (r, terminated) = tokio::join!(
        agent_until(&w, "i-s", &c, tokio::time::sleep(Duration::from_secs(86_400)), None),
        control_plane
    )
    .0;
    let waited = started.elapsed().as_secs_f64();
    assert_eq!(r.exit, ExitReason::IdleTimeout);
    assert_eq!(terminated, ["i-s"]);
    // At the idle timeout (+120 s) plus the stop wait, not before and not at the day-long keep.
    assert!(
        (120.0 + onoff_agent::agent::STOP_WAIT_S..120.0 + onoff_agent::agent::STOP_WAIT_S + 60.0).contains(&waited),
        "ended after {waited} s"
    );
}

/// The queue of `World`, whose first delete comes too late: the message's visibility ran out
/// while the claim was under way, and another consumer received it (and then lost it, its own
/// visibility running out 30 s later). The delete's receipt is stale then, and SQS may answer it
/// with success and delete nothing (`FakeInbox` does).
struct ReceivedAgainBeforeTheDelete<'a> {
    inner: &'a FakeInbox,
    done: std::sync::atomic::AtomicBool,
}

impl onoff_control::ports::JobQueue for ReceivedAgainBeforeTheDelete<'_> {
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String> {
        onoff_control::ports::JobQueue::send(self.inner, lane, body, delay_s).await
    }
}

impl onoff_agent::ports::Inbox for ReceivedAgainBeforeTheDelete<'_> {
    async fn receive(
        &self,
        lane: &str,
        wait_s: u32,
        visibility_s: u32,
    ) -> Result<Option<onoff_agent::ports::Message>, String> {
        self.inner.receive(lane, wait_s, visibility_s).await
    }
    async fn set_visibility(&self, lane: &str, receipt: &str, visibility_s: u32) -> Result<(), String> {
        self.inner.set_visibility(lane, receipt, visibility_s).await
    }
    async fn delete(&self, lane: &str, receipt: &str) -> Result<(), String> {
        if !self.done.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // Visible again (its visibility over), and received by someone else.
            self.inner.set_visibility(lane, receipt, 0).await?;
            let other = self.inner.receive(lane, 0, 30).await?;
            assert!(other.is_some(), "the other consumer receives it");
        }
        self.inner.delete(lane, receipt).await
    }
    async fn requeue(&self, lane: &str, receipt: &str, body: &str, delay_s: u32) -> Result<(), String> {
        self.inner.requeue(lane, receipt, body, delay_s).await
    }
}

/// A claim slower than the message's visibility: the agent's delete of the claimed message has a
/// stale receipt, succeeds and deletes nothing. The job still runs once (the row is the truth:
/// the claim is conditional), and the message, received again once its other receiver's
/// visibility runs out, is dropped as not claimable and deleted with its latest receipt. Nothing
/// is left in the queue to reach the dead-letter queue.
#[tokio::test(start_paused = true)]
async fn a_message_received_again_during_the_claim_is_deleted_by_its_next_receive_and_the_job_runs_once() {
    let dir = tempdir("stale-receipt");
    let w = World::default();
    register(&w, "i-a");
    script(&w, "work", 100);
    submit(&w, "job-1", "work", 3, 600.0);
    let inbox = ReceivedAgainBeforeTheDelete {
        inner: &w.inbox,
        done: Default::default(),
    };
    let (report, _) = agent_on(&w, &inbox, "i-a", &cfg(dir.path()), std::future::pending(), None).await;
    assert_eq!(
        w.inbox.stale_deletes(),
        vec!["m-1".to_string()],
        "the claim's delete was stale"
    );
    assert_eq!(w.launcher.started().len(), 1, "the job ran once");
    assert_eq!(job(&w, "job-1").state, JobState::Succeeded);
    assert_eq!(report.dropped, 1, "its message, received again, was dropped");
    assert!(
        w.inbox.remaining().is_empty(),
        "deleted with its latest receipt: {:?}",
        w.inbox.remaining()
    );
    assert_eq!(report.exit, ExitReason::IdleTimeout);
}

/// A settled attempt leaves no work dir, and an agent starting removes those an earlier one left
/// (killed mid-job). What a job keeps in `ONOFF_CACHE_DIR` the next job of its project finds on
/// the same worker, also under a later agent on the same volume (an instance stopped and started
/// again); each project has its own directory; and the cache stays within `ONOFF_CACHE_GIB`, the
/// least recently used project out first.
/// A world whose jobs (program `work`, 5 items) keep a 2,000-byte model in their project's cache,
/// and an agent configuration bounding the cache to 5,000 bytes: two projects' models fit, three
/// do not. The work dir is a new temporary directory named after `name`.
fn cache_world(name: &str) -> (tempfile::TempDir, World, AgentConfig) {
    let dir = tempdir(name);
    let w = World::default();
    script(&w, "work", 5);
    w.launcher.set_model_bytes(2000);
    let c = AgentConfig {
        cache_gib: 5000.0 / f64::from(1u32 << 30),
        ..cfg(dir.path())
    };
    (dir, w, c)
}

/// Submit job `id` (program `work`, one attempt) of `project`.
fn submit_for_project(w: &World, id: &str, project: &str) {
    submit(w, id, "work", 1, 600.0);
    let mut rec = job(w, id);
    rec.spec.project = project.into();
    w.jobs.put(rec);
}

#[tokio::test(start_paused = true)]
async fn a_worker_records_in_its_row_which_projects_its_cache_holds() {
    let (dir, w, c) = cache_world("cache-row");
    let submit_for = |id: &str, project: &str| submit_for_project(&w, id, project);
    let recorded = |id: &str| pollster::block_on(w.registry.get(id)).unwrap().unwrap().cached_projects;
    // A row that lists a cache the volume does not hold (another volume, a lost write): the
    // agent puts it right when it starts, before any job.
    register(&w, "i-a");
    w.registry.set_cached_projects("i-a", &["gone".into()]).unwrap();
    for (id, project) in [("job-1", "a"), ("job-2", "b"), ("job-3", "c")] {
        submit_for(id, project);
    }
    let (r, _) = agent(&w, "i-a", &c).await;
    assert_eq!(r.jobs.len(), 3);
    // `a` was trimmed when `c`'s model came; the most recently used first.
    assert_eq!(recorded("i-a"), ["c", "b"]);
    // The same volume again (the instance stopped and started): a job of `b` makes it the most
    // recently used.
    submit_for("job-4", "b");
    register(&w, "i-b");
    let (r, _) = agent(&w, "i-b", &c).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(w.launcher.cache_hits()[3], Some(true));
    assert_eq!(recorded("i-b"), ["b", "c"]);
    // A job that keeps nothing in its project's cache does not list the project.
    w.launcher.set_model_bytes(0);
    submit_for("job-5", "keeps-nothing");
    register(&w, "i-c");
    let (r, _) = agent(&w, "i-c", &c).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert!(dir.path().join("cache/p-keeps-nothing").exists());
    assert_eq!(recorded("i-c"), ["b", "c"]);
    // ONOFF_CACHE_GIB = 0: jobs get no cache, and the row lists none.
    register(&w, "i-d");
    w.registry.set_cached_projects("i-d", &["b".into()]).unwrap();
    let (r, _) = agent(
        &w,
        "i-d",
        &AgentConfig {
            cache_gib: 0.0,
            ..c.clone()
        },
    )
    .await;
    assert!(r.jobs.is_empty());
    assert_eq!(recorded("i-d"), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn jobs_leave_no_work_dir_and_a_projects_cache_serves_its_next_job_within_its_bound() {
    let (dir, w, c) = cache_world("cache");
    let left = dir.path().join("jobs/job-0/checkpoint/3");
    std::fs::create_dir_all(&left).unwrap();
    std::fs::write(left.join("weights"), b"stale").unwrap();
    let submit_for = |id: &str, project: &str| submit_for_project(&w, id, project);
    for (id, project) in [
        ("job-1", "a"),
        ("job-2", "a"),
        ("job-3", "b"),
        ("job-4", "c"),
        ("job-5", "a"),
    ] {
        submit_for(id, project);
    }
    register(&w, "i-a");
    let (r, _) = agent(&w, "i-a", &c).await;
    assert_eq!(r.jobs.len(), 5);
    assert!(r.jobs.iter().all(|j| j.outcome == Outcome::Succeeded));
    // job-2 finds job-1's model; job-4's project fills the cache past its bound, so `a`, the
    // least recently used, goes, and job-5 fetches its model again.
    assert_eq!(
        w.launcher.cache_hits(),
        [Some(false), Some(true), Some(false), Some(false), Some(false)]
    );
    let cache_dir = |n: usize| {
        let env = &w.launcher.started()[n].env;
        env.iter().find(|(k, _)| k == "ONOFF_CACHE_DIR").map(|(_, v)| v.clone())
    };
    let p = |name: &str| dir.path().join("cache").join(name).display().to_string();
    assert_eq!(
        (0..5).map(cache_dir).collect::<Vec<_>>(),
        ["p-a", "p-a", "p-b", "p-c", "p-a"].map(|n| Some(p(n)))
    );
    // The XDG cache (pip, Hugging Face, torch hub) and the compiled kernels of Triton and
    // torch.compile default to the project's cache, unless the image sets its own.
    let default_of = |n: usize, k: &str| {
        let cmd = &w.launcher.started()[n];
        cmd.defaults.iter().find(|(name, _)| name == k).map(|(_, v)| v.clone())
    };
    let xdg_default = |n: usize| default_of(n, "XDG_CACHE_HOME");
    assert_eq!(
        (0..5).map(xdg_default).collect::<Vec<_>>(),
        (0..5).map(cache_dir).collect::<Vec<_>>()
    );
    assert_eq!(default_of(2, "TRITON_CACHE_DIR"), Some(format!("{}/triton", p("p-b"))));
    assert_eq!(
        default_of(2, "TORCHINDUCTOR_CACHE_DIR"),
        Some(format!("{}/torchinductor", p("p-b")))
    );
    // After job-5, `b` was the least recently used of the three.
    let kept: std::collections::BTreeSet<String> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept, ["p-a", "p-c"].map(String::from).into());
    // A job's temporary files are in its own work dir (TMPDIR), not the container's shared /tmp,
    // and go with it.
    let tmp = dir.path().join("jobs/job-1/tmp");
    let cmd = &w.launcher.started()[0];
    assert_eq!(
        cmd.env.iter().find(|(k, _)| k == "TMPDIR").map(|(_, v)| v.clone()),
        Some(tmp.display().to_string())
    );
    assert!(w.launcher.work_dir(0).unwrap().contains_key(&tmp.join("scratch")));
    // No job's work dir is left, the earlier agent's included.
    assert_eq!(std::fs::read_dir(dir.path().join("jobs")).unwrap().count(), 0);
    // Another agent on the same volume (the instance stopped and started): project c's model is
    // still there.
    submit_for("job-6", "c");
    register(&w, "i-b");
    let (r, _) = agent(&w, "i-b", &c).await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(w.launcher.cache_hits()[5], Some(true));
    // ONOFF_CACHE_GIB = 0: no cache for the job.
    submit_for("job-7", "c");
    register(&w, "i-c");
    let (r, _) = agent(
        &w,
        "i-c",
        &AgentConfig {
            cache_gib: 0.0,
            ..c.clone()
        },
    )
    .await;
    assert_eq!(r.jobs[0].outcome, Outcome::Succeeded);
    assert_eq!(
        (w.launcher.cache_hits()[6], cache_dir(6), xdg_default(6)),
        (None, None, None)
    );
}
