//! Promises of the [`JobStore`], [`WorkerRegistry`], [`OfferingAvailability`],
//! [`ArrivalStatsStore`], [`Lease`] and [`Fleet`] traits that every implementation must keep, written once and run against each: the
//! fakes here ([`crate::fake::FakeJobs`], [`crate::fake::FakeRegistry`],
//! [`crate::fake::FakeAvailability`], [`crate::fake::FakeLease`], [`crate::fake::FakeFleet`];
//! `crates/control/tests/contract.rs`) and DynamoDB and EC2 through their adapters against moto
//! with the local stack's limits (`crates/aws/tests/moto.rs`). A fake that answered otherwise
//! than DynamoDB would let a test pass that fails on AWS; running the same steps on both is what
//! shows they agree.

use crate::job::{AttemptEnd, AttemptRecord, JobSpec, JobState, OutputsRecord, RerunLimits, Settle};
use crate::ports::{
    ArrivalStats, ArrivalStatsStore, CancelOutcome, Claim, Created, Fleet, FleetErrorKind, FleetLister, JobRecord,
    JobStore, LaunchRequest, Lease, OfferingAvailability, ScaleAsk, StoreError, WorkerRecord, WorkerRegistry,
    MAX_ASKED_JOBS, MAX_ASKED_JOB_ID_BYTES, MAX_KEPT_ASKED_JOBS,
};
use onoff_policy::{CapacityType, OfferingKey, WorkerState};

fn spec() -> JobSpec {
    serde_json::from_value(serde_json::json!({
        "image": "img", "command": ["x"], "project": "p", "max_attempts": 3
    }))
    .expect("a valid spec")
}

fn attempt(rec: &JobRecord, owner: &str, ended_at: f64, outcome: &str) -> AttemptRecord {
    AttemptRecord {
        n: rec.attempts,
        instance_id: owner.into(),
        instance_type: Some("g5.xlarge".into()),
        capacity_type: Some("spot".into()),
        price_usd_per_h: Some(0.4),
        started_at: rec.claimed_at.unwrap_or(ended_at),
        ended_at,
        outcome: outcome.into(),
        exit_code: Some(0),
        signal: None,
        checkpoint: None,
        // Floats JSON's default parser reads back one unit in the last place off (a local run's
        // figures): the attempt record is kept as JSON text, and the settle is recognised by it.
        seconds: 370.598_059_919_999_97,
        cost_usd: 0.103_561_568_966_533_33,
    }
}

async fn claimed<J: JobStore>(jobs: &J, id: &str, owner: &str, now: f64) -> JobRecord {
    match jobs.claim(id, owner, now + 300.0, now).await.expect("claim") {
        Claim::Claimed(r) => *r,
        other => panic!("{owner}'s claim of {id} at {now}: {other:?}"),
    }
}

/// Every write a worker, the reaper or an operator makes, each sent once more after its answer
/// was lost on the way back (`lose` arms that for the next write: the AWS SDK retries such a
/// request, and the retry meets the row its first try wrote). Each retry must be taken as the
/// write's own, done, not refused: a claim that read as "someone else's RUNNING job" would have
/// its message deleted and the job left running under nobody; a success that read as a lost lease
/// would have its outputs dropped; a re-queue that read as "the lease changed" would send no
/// wake-up message. Writes that are not the retry's own are still refused. Job ids start with
/// `tag` (several runs may share one table); `now` is unix seconds.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn lost_answers_are_taken_as_done<J: JobStore>(jobs: &J, lose: impl Fn(), tag: &str, now: f64) {
    let limits = RerunLimits::default();
    let new = |n: &str| JobRecord::new(format!("{tag}-{n}"), spec(), "contract".into(), now);
    let [a, b, c, d, e] = [new("a"), new("b"), new("c"), new("d"), new("e")];

    // create: the retry finds the row its first try wrote (the caller still sends its wake-up).
    lose();
    let created = jobs.create(&a).await.expect("create");
    assert!(
        matches!(&created, Created::Existing(r) if r.state == JobState::Queued && r.attempts == 0),
        "a create whose answer was lost: {created:?}"
    );
    for r in [&b, &c, &d, &e] {
        assert_eq!(jobs.create(r).await.expect("create"), Created::New);
    }

    // claim: the worker's own, with the row it wrote, counted once.
    lose();
    let rec = claimed(jobs, &a.id, "i-a", now).await;
    assert_eq!(
        (rec.lease_owner.as_deref(), rec.attempts),
        (Some("i-a"), 1),
        "a claim whose answer was lost"
    );
    assert_eq!(
        jobs.claim(&a.id, "i-b", now + 400.0, now + 1.0).await.expect("claim"),
        Claim::NotClaimable(JobState::Running),
        "another worker's claim is refused"
    );

    // renew and progress: values, so a retry sets the same again.
    lose();
    jobs.renew(&a.id, "i-a", now + 600.0)
        .await
        .expect("a renewal whose answer was lost");
    lose();
    jobs.record_progress(&a.id, "i-a", Some("s3://b/ckpt/1"), 0.5)
        .await
        .expect("progress whose answer was lost");
    let row = jobs.get(&a.id).await.expect("get").expect("row");
    assert_eq!(
        (row.lease_expires_at, row.cost_usd, row.last_checkpoint.as_deref()),
        (Some(now + 600.0), 0.5, Some("s3://b/ckpt/1"))
    );

    // finish with an attempt record: done, appended once; a settle this lease never wrote is not.
    let mut done = Settle::of(&rec, &AttemptEnd::Succeeded, &limits);
    done.attempt = Some(attempt(&rec, "i-a", now + 60.0, "succeeded"));
    lose();
    jobs.finish(&a.id, "i-a", &done, now + 60.0)
        .await
        .expect("a success whose answer was lost is done");
    let row = jobs.get(&a.id).await.expect("get").expect("row");
    assert_eq!((row.state, row.lease_owner.as_deref()), (JobState::Succeeded, None));
    assert_eq!(
        row.attempt_log,
        [done.attempt.clone().expect("attempt")],
        "appended once"
    );
    let other = Settle {
        attempt: Some(attempt(&rec, "i-a", now + 61.0, "succeeded")),
        ..done.clone()
    };
    assert!(
        matches!(
            jobs.finish(&a.id, "i-a", &other, now + 61.0).await,
            Err(StoreError::Conflict(_))
        ),
        "a settle the lease never wrote is refused"
    );

    // record_outputs: the attempt's record, once.
    let outputs = OutputsRecord {
        attempt: 1,
        files: 2,
        error: None,
        at: now + 70.0,
    };
    lose();
    jobs.record_outputs(&a.id, &outputs)
        .await
        .expect("outputs whose answer was lost");
    assert_eq!(jobs.get(&a.id).await.expect("get").expect("row").outputs, Some(outputs));

    // finish without an attempt record (a hand-back): done by its counts.
    let rec = claimed(jobs, &b.id, "i-c", now).await;
    let back = Settle::of(&rec, &AttemptEnd::HandedBack("too small".into()), &limits);
    lose();
    jobs.finish(&b.id, "i-c", &back, now + 5.0)
        .await
        .expect("a hand-back whose answer was lost is done");
    let row = jobs.get(&b.id).await.expect("get").expect("row");
    assert_eq!(
        (row.state, row.attempts, row.hand_backs, row.lease_owner),
        (JobState::Queued, 0, 1, None)
    );

    // requeue_lost: the reaper's end of a lost lease, done, so its wake-up message is sent.
    let rec = claimed(jobs, &b.id, "i-d", now + 10.0).await;
    let lost = Settle::of(&rec, &AttemptEnd::LeaseLost("worker gone".into()), &limits);
    lose();
    jobs.requeue_lost(&b.id, "i-d", now + 310.0, &lost, now + 400.0)
        .await
        .expect("a re-queue whose answer was lost is done");
    let row = jobs.get(&b.id).await.expect("get").expect("row");
    assert_eq!(
        (row.state, row.lease_expiries, row.lease_owner),
        (JobState::Queued, 1, None)
    );
    let rec = claimed(jobs, &b.id, "i-e", now + 500.0).await;
    assert!(
        matches!(
            jobs.requeue_lost(&b.id, "i-d", now + 310.0, &lost, now + 900.0).await,
            Err(StoreError::Conflict(_))
        ),
        "the old lease's re-queue does not strip the new one"
    );
    assert_eq!(rec.lease_owner.as_deref(), Some("i-e"));

    // request_cancel of a waiting job: cancelled by this call, not "already finished".
    lose();
    assert_eq!(
        jobs.request_cancel(&c.id, now + 20.0).await.expect("cancel"),
        CancelOutcome::Cancelled,
        "a cancel whose answer was lost"
    );
    assert_eq!(
        jobs.request_cancel(&c.id, now + 30.0).await.expect("cancel"),
        CancelOutcome::AlreadyFinished(JobState::Cancelled),
        "a later cancel finds it finished"
    );

    // request_cancel of a running job, then its fatal end: CANCELLED, each retry done.
    let rec = claimed(jobs, &d.id, "i-f", now).await;
    lose();
    assert_eq!(
        jobs.request_cancel(&d.id, now + 40.0).await.expect("cancel"),
        CancelOutcome::Requested
    );
    let mut fatal = Settle::of(&rec, &AttemptEnd::Fatal("bad image".into()), &limits);
    fatal.attempt = Some(attempt(&rec, "i-f", now + 50.0, "fatal"));
    lose();
    jobs.finish(&d.id, "i-f", &fatal, now + 50.0)
        .await
        .expect("the end of a cancelled job whose answer was lost is done");
    let row = jobs.get(&d.id).await.expect("get").expect("row");
    assert_eq!((row.state, row.lease_owner), (JobState::Cancelled, None));
    assert_eq!(row.attempt_log.len(), 1, "appended once");

    // transition (an operator's or a test's): done, the job in the state asked for; one from a
    // state the job is not in, to one it is not in either, is still refused.
    lose();
    jobs.transition(&e.id, JobState::Queued, JobState::Cancelled)
        .await
        .expect("a transition whose answer was lost is done");
    assert_eq!(
        jobs.get(&e.id).await.expect("get").expect("row").state,
        JobState::Cancelled
    );
    assert!(
        matches!(
            jobs.transition(&e.id, JobState::Running, JobState::Failed).await,
            Err(StoreError::Conflict(_))
        ),
        "a transition from a state the job is not in"
    );
}

/// The reaper's end of a job past its lane's quota wait limit ([`JobStore::fail_waiting`]): a
/// pending job as it was read is ended FAILED with the reason (cut to
/// [`crate::job::MAX_REASON_BYTES`]) and leaves the active listing, and the write's retry after
/// its answer was lost is this call's (`true`); a job claimed since, or one that ran and came
/// back to the queue since (released, or deferred and woken by a fresh message), is left as it is
/// (`false`), and so is a job already ended or unknown.
/// Job ids start with `tag`; `now` is unix seconds.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn a_waiting_job_is_failed_only_as_it_was_read<J: JobStore>(jobs: &J, lose: impl Fn(), tag: &str, now: f64) {
    let new = |n: &str| JobRecord::new(format!("{tag}-{n}"), spec(), "contract".into(), now);
    let [f, g, h] = [new("f"), new("g"), new("h")];
    for r in [&f, &g, &h] {
        assert_eq!(jobs.create(r).await.expect("create"), Created::New);
    }
    let read = |id: String| async move { jobs.get(&id).await.expect("get").expect("row") };

    // Ended, with its answer lost: the retry is this call's end.
    let seen = read(f.id.clone()).await;
    let long = "q".repeat(3 * crate::job::MAX_REASON_BYTES);
    lose();
    assert!(
        jobs.fail_waiting(&seen, &long, now + 10.0).await.expect("fail"),
        "an end whose answer was lost is this call's"
    );
    let row = read(f.id.clone()).await;
    assert_eq!((row.state, row.finished_at), (JobState::Failed, Some(now + 10.0)));
    assert_eq!(row.reason, Some(crate::job::bounded_reason(long.clone())));
    assert!(
        !jobs.active().await.expect("active").items.iter().any(|r| r.id == f.id),
        "an ended job leaves the active listing"
    );
    assert!(
        !jobs.fail_waiting(&seen, &long, now + 11.0).await.expect("fail"),
        "a job already ended is not ended again"
    );

    // Claimed since it was read: left RUNNING.
    let seen_h = read(h.id.clone()).await;
    claimed(jobs, &h.id, "i-h", now + 20.0).await;
    assert!(!jobs.fail_waiting(&seen_h, "why", now + 21.0).await.expect("fail"));
    assert_eq!(read(h.id.clone()).await.state, JobState::Running);

    // Claimed and released (a spot notice) since it was read: QUEUED again with the same counts
    // but for its attempt log, and left QUEUED.
    let seen_g = read(g.id.clone()).await;
    let rec = claimed(jobs, &g.id, "i-g", now + 30.0).await;
    let mut released = Settle::of(
        &rec,
        &AttemptEnd::Released("spot notice".into()),
        &RerunLimits::default(),
    );
    released.attempt = Some(attempt(&rec, "i-g", now + 40.0, "released"));
    jobs.finish(&g.id, "i-g", &released, now + 40.0).await.expect("release");
    let row = read(g.id.clone()).await;
    assert_eq!((row.state, row.attempts), (JobState::Queued, seen_g.attempts));
    assert!(!jobs.fail_waiting(&seen_g, "why", now + 41.0).await.expect("fail"));
    assert_eq!(read(g.id.clone()).await.state, JobState::Queued);
    // Read again, it is ended.
    let again = read(g.id.clone()).await;
    assert!(jobs.fail_waiting(&again, "why", now + 42.0).await.expect("fail"));
    assert_eq!(read(g.id.clone()).await.state, JobState::Failed);

    // Claimed and deferred (a spot worker's hand-back of a job whose deadline is at risk), which
    // changes no count and logs no attempt, then woken by a fresh message: left QUEUED.
    let k = new("k");
    assert_eq!(jobs.create(&k).await.expect("create"), Created::New);
    jobs.mark_sent(&k.id, now + 50.0).await.expect("sent");
    let seen_k = read(k.id.clone()).await;
    let rec = claimed(jobs, &k.id, "i-k", now + 51.0).await;
    let deferred = Settle::of(
        &rec,
        &AttemptEnd::Deferred("deadline at risk on spot".into()),
        &RerunLimits::default(),
    );
    jobs.finish(&k.id, "i-k", &deferred, now + 52.0).await.expect("defer");
    jobs.mark_sent(&k.id, now + 52.0).await.expect("sent");
    let row = read(k.id.clone()).await;
    assert_eq!(
        (row.state, row.attempts, row.hand_backs, row.attempt_log.len()),
        (
            JobState::Queued,
            seen_k.attempts,
            seen_k.hand_backs,
            seen_k.attempt_log.len()
        ),
        "a deferral changes no count"
    );
    assert!(
        !jobs.fail_waiting(&seen_k, "why", now + 53.0).await.expect("fail"),
        "a job woken since it was read is left alone"
    );
    assert_eq!(read(k.id.clone()).await.state, JobState::Queued);

    // Unknown: nothing to end.
    let mut ghost = seen_h;
    ghost.id = format!("{tag}-ghost");
    assert!(!jobs.fail_waiting(&ghost, "why", now + 50.0).await.expect("fail"));
    assert!(jobs.get(&ghost.id).await.expect("get").is_none(), "nothing created");
}

fn worker(id: &str, now: f64) -> WorkerRecord {
    WorkerRecord::launched(
        id,
        "standard",
        OfferingKey {
            instance_type: "g5.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::Spot,
        },
        0.4212,
        now,
    )
}

async fn row<R: WorkerRegistry>(reg: &R, id: &str) -> WorkerRecord {
    reg.get(id).await.expect("get").expect("the row")
}

/// The workers table's writes, each conditional on the row's state and each taken as done when
/// sent again with the same arguments (the write's own retry, after a lost answer): registering,
/// a scale-down's move to Terminating, a hold, a stop, a start, a refused start, a price, and the
/// agent's heartbeat (`beat`: what `DynamoWorkers::heartbeat` or
/// [`crate::fake::FakeRegistry::agent_heartbeat`] writes for worker id, state, idle-since and
/// now), which never revives a row the control plane is retiring. Worker ids are
/// `tag` followed by a digit (EC2 ids are `i-` and 17 hex digits: pass `i-0c0ffee000000000`, say);
/// `now` is unix seconds.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn worker_rows_keep_their_conditions<R, B, F>(reg: &R, beat: B, tag: &str, now: f64)
where
    R: WorkerRegistry,
    B: Fn(String, WorkerState, Option<f64>, f64) -> F,
    F: std::future::Future<Output = Result<(), StoreError>>,
{
    let [a, b, c] = [format!("{tag}1"), format!("{tag}2"), format!("{tag}3")];

    // register_launch: the record reads back whole; registering again changes nothing.
    let full = WorkerRecord {
        state: WorkerState::Idle,
        project: Some("p".into()),
        idle_since: Some(now + 10.0),
        heartbeat_at: Some(now + 15.5),
        pinned_job: Some("job-due".into()),
        hold_until: Some(now + 600.0),
        spot_price_usd_per_h: Some(0.4375),
        run_time_estimate_s: Some(120.5),
        cached_projects: vec!["p".into(), "q".into()],
        min_job_gpus: Some(5),
        ..worker(&a, now)
    };
    reg.register_launch(full.clone()).await.expect("register");
    reg.register_launch(WorkerRecord {
        state: WorkerState::Running,
        ..worker(&a, now + 1.0)
    })
    .await
    .expect("a second registration");
    assert_eq!(row(reg, &a).await, full, "registering again changes nothing");

    // hold_idle: written, done again at the same time, never shortened.
    assert_eq!(reg.hold_idle(&a, now + 900.0).await, Ok(true));
    assert_eq!(reg.hold_idle(&a, now + 900.0).await, Ok(true), "the hold's own retry");
    assert_eq!(
        reg.hold_idle(&a, now + 800.0).await,
        Ok(false),
        "a hold is never shortened"
    );
    assert_eq!(row(reg, &a).await.hold_until, Some(now + 900.0));

    // mark_stopped: Idle to Stopped with its stop time and keep; done again.
    assert_eq!(reg.mark_stopped(&a, now + 1_000.0, now + 4_600.0, now).await, Ok(true));
    assert_eq!(
        reg.mark_stopped(&a, now + 1_000.0, now + 4_600.0, now).await,
        Ok(true),
        "the stop's own retry"
    );
    let r = row(reg, &a).await;
    assert_eq!(
        (r.state, r.idle_since, r.hold_until),
        (WorkerState::Stopped, Some(now + 1_000.0), Some(now + 4_600.0))
    );
    // The heartbeat of an agent still up on a stopped row: alive, but the row stays Stopped.
    assert!(
        matches!(
            beat(a.clone(), WorkerState::Idle, Some(now + 900.0), now + 1_001.0).await,
            Err(StoreError::Conflict(_))
        ),
        "a heartbeat on a Stopped row is refused"
    );
    let r = row(reg, &a).await;
    assert_eq!(
        (r.state, r.idle_since, r.heartbeat_at),
        (WorkerState::Stopped, Some(now + 1_000.0), Some(now + 1_001.0)),
        "only heartbeat_at is written on a retiring row"
    );
    assert_eq!(
        reg.hold_idle(&a, now + 9_000.0).await,
        Ok(false),
        "a stopped worker is not held"
    );

    // mark_started: Pending since the start, pinned as a launch, with the lane's estimate of
    // now; done again.
    assert_eq!(
        reg.mark_started(&a, now + 2_000.0, Some("q"), Some("job-2"), Some(95.25))
            .await,
        Ok(true)
    );
    assert_eq!(
        reg.mark_started(&a, now + 2_000.0, Some("q"), Some("job-2"), Some(95.25))
            .await,
        Ok(true),
        "the start's own retry"
    );
    let r = row(reg, &a).await;
    assert_eq!(
        (r.state, r.launched_at, r.project.as_deref(), r.pinned_job.as_deref()),
        (WorkerState::Pending, now + 2_000.0, Some("q"), Some("job-2"))
    );
    assert_eq!(
        r.run_time_estimate_s,
        Some(95.25),
        "the start's estimate replaces the launch's"
    );
    assert_eq!((r.idle_since, r.hold_until, r.heartbeat_at), (None, None, None));
    assert_eq!(
        r.cached_projects, full.cached_projects,
        "a stop and a start keep what the volume's cache holds"
    );
    assert_eq!(
        reg.mark_started(&a, now + 2_100.0, None, None, None).await,
        Ok(false),
        "a worker not stopped is not started"
    );

    // mark_start_refused: Stopped again as the start found it; done again.
    let refused = reg
        .mark_start_refused(&a, now + 2_000.0, now, Some(now + 1_000.0), Some(now + 4_600.0))
        .await;
    assert_eq!(refused, Ok(true));
    assert_eq!(
        reg.mark_start_refused(&a, now + 2_000.0, now, Some(now + 1_000.0), Some(now + 4_600.0))
            .await,
        Ok(true),
        "the refused start's own retry"
    );
    let r = row(reg, &a).await;
    assert_eq!(
        (r.state, r.launched_at, r.idle_since, r.hold_until),
        (WorkerState::Stopped, now, Some(now + 1_000.0), Some(now + 4_600.0))
    );
    // Started again when the lane has no estimate: the old one is removed.
    assert_eq!(reg.mark_started(&a, now + 3_000.0, None, None, None).await, Ok(true));
    let r = row(reg, &a).await;
    assert_eq!(
        (r.state, r.run_time_estimate_s),
        (WorkerState::Pending, None),
        "a start without an estimate leaves none"
    );
    // set_run_time_estimate_if_unset: written on a row without one; done again; never replaced.
    assert_eq!(reg.set_run_time_estimate_if_unset(&a, 30.5).await, Ok(true));
    assert_eq!(
        reg.set_run_time_estimate_if_unset(&a, 30.5).await,
        Ok(true),
        "the write's own retry"
    );
    assert_eq!(
        reg.set_run_time_estimate_if_unset(&a, 40.0).await,
        Ok(false),
        "a row's figure is not replaced"
    );
    assert_eq!(row(reg, &a).await.run_time_estimate_s, Some(30.5));
    assert!(matches!(
        reg.set_run_time_estimate_if_unset(&format!("{tag}-unknown"), 30.5)
            .await,
        Err(StoreError::NotFound(_))
    ));

    // set_state_if: a scale-down from Idle; done again; refused once an agent took it.
    reg.register_launch(WorkerRecord {
        state: WorkerState::Idle,
        ..worker(&b, now)
    })
    .await
    .expect("register");
    assert_eq!(
        reg.set_state_if(&b, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(true)
    );
    assert_eq!(
        reg.set_state_if(&b, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(true),
        "already in the target state is done"
    );
    assert_eq!(
        reg.set_state_if(&b, WorkerState::Idle, &[]).await,
        Ok(false),
        "no state qualifies"
    );
    assert!(
        !reg.list_live().await.expect("list").items.iter().any(|w| w.id == b),
        "a Terminating worker is not live"
    );
    reg.register_launch(WorkerRecord {
        state: WorkerState::Running,
        ..worker(&c, now)
    })
    .await
    .expect("register");
    assert_eq!(
        reg.set_state_if(&c, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(false),
        "a busy worker is not scaled down"
    );

    // The heartbeat: written on a live row; an agent's own Draining kept; never revived.
    beat(c.clone(), WorkerState::Idle, Some(now + 50.0), now + 60.0)
        .await
        .expect("a live row's heartbeat");
    let r = row(reg, &c).await;
    assert_eq!(
        (r.state, r.idle_since, r.heartbeat_at),
        (WorkerState::Idle, Some(now + 50.0), Some(now + 60.0))
    );
    beat(c.clone(), WorkerState::Draining, None, now + 70.0)
        .await
        .expect("the agent drains itself");
    beat(c.clone(), WorkerState::Draining, None, now + 80.0)
        .await
        .expect("a draining agent's heartbeat");
    assert!(matches!(
        beat(c.clone(), WorkerState::Idle, Some(now + 85.0), now + 90.0).await,
        Err(StoreError::Conflict(_))
    ));
    let r = row(reg, &c).await;
    assert_eq!(
        (r.state, r.idle_since, r.heartbeat_at),
        (WorkerState::Draining, None, Some(now + 90.0)),
        "a draining row is never revived"
    );

    // set_price_if_unpriced: only an agent-registered (price 0) row; done again at its price.
    assert_eq!(reg.set_price_if_unpriced(&c, 0.5).await, Ok(false), "priced at launch");
    reg.register_launch(WorkerRecord {
        price_usd_per_h: 0.0,
        ..worker(&format!("{tag}4"), now)
    })
    .await
    .expect("register");
    let d = format!("{tag}4");
    assert_eq!(reg.set_price_if_unpriced(&d, 0.4212).await, Ok(true));
    assert_eq!(
        reg.set_price_if_unpriced(&d, 0.4212).await,
        Ok(true),
        "the price's own retry"
    );
    assert_eq!(reg.set_price_if_unpriced(&d, 0.5).await, Ok(false));

    // An unknown worker: not found, never created.
    let gone = format!("{tag}9");
    assert!(matches!(reg.hold_idle(&gone, now).await, Err(StoreError::NotFound(_))));
    assert!(matches!(
        reg.set_state_if(&gone, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        reg.mark_stopped(&gone, now, now, now).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        beat(gone.clone(), WorkerState::Idle, None, now).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(reg.get(&gone).await, Ok(None));
}

fn ids_of(refused: &[(String, crate::ports::FleetError)]) -> Vec<(&str, FleetErrorKind)> {
    refused.iter().map(|(id, e)| (id.as_str(), e.kind)).collect()
}

async fn listed<F: FleetLister>(fleet: &F, id: &str) -> Option<crate::ports::FleetInstance> {
    let all = fleet.list_managed().await.expect("list the fleet");
    all.into_iter().find(|i| i.instance_id == id)
}

/// A fleet's answers where EC2's are known: a launch of no offering refused whole; instances
/// launched into the offering asked for, listed with their lane and project; a stop done, and
/// done again when already stopped; a start refused while the stop is under way (EC2 takes
/// minutes to stop an instance: `IncorrectInstanceState`, [`FleetErrorKind::Stopping`]) and done
/// once `settle` says the stop is over (`settle(id)`: wait for it, or tell the fake); an unknown
/// id refused as [`FleetErrorKind::NotFound`] without failing the others of its call; a cancelled
/// launch's instances, stopped ones too, gone from the listing; a terminated instance refused a
/// stop for its state (`IncorrectInstanceState`, [`FleetErrorKind::Other`]: the caller
/// terminates it) and a start as gone ([`FleetErrorKind::NotFound`]: the caller retires its
/// row); terminating again, or an unknown id, done. `offering` is an on-demand offering the fleet
/// can launch; `unknown` a well-formed instance id no one launched.
///
/// # Panics
/// On the first answer that differs from EC2's, naming it.
pub async fn fleet_answers_as_ec2<F, S, W>(fleet: &F, settle: S, offering: OfferingKey, unknown: &str)
where
    F: Fleet + FleetLister,
    S: Fn(String) -> W,
    W: std::future::Future<Output = ()>,
{
    let request = |offerings: Vec<OfferingKey>, count: u32| LaunchRequest {
        lane: "standard".into(),
        offerings,
        count,
        project: Some("p".into()),
        job: None,
        client_token: String::new(),
    };
    let refused = fleet.launch(&request(Vec::new(), 1)).await;
    assert!(
        matches!(&refused, Err(e) if e.kind == FleetErrorKind::Other),
        "a launch of no offering: {refused:?}"
    );

    let out = fleet.launch(&request(vec![offering.clone()], 2)).await.expect("launch");
    assert!(out.short.is_empty(), "nothing short: {:?}", out.short);
    assert_eq!(out.launched.len(), 2, "{:?}", out.launched);
    assert!(
        out.launched.iter().all(|l| l.offering == offering),
        "{:?}",
        out.launched
    );
    let (x, y) = (out.launched[0].instance_id.clone(), out.launched[1].instance_id.clone());
    assert_ne!(x, y);
    for id in [&x, &y] {
        let i = listed(fleet, id).await.expect("a launched instance is listed");
        assert_eq!(
            (i.offering, i.lane.as_deref(), i.project.as_deref(), i.stopped),
            (offering.clone(), Some("standard"), Some("p"), false)
        );
    }

    // Stop, stop again, start while stopping, start once stopped, start again.
    let one = |id: &str| vec![id.to_string()];
    assert_eq!(ids_of(&fleet.stop(&one(&x)).await.expect("stop")), []);
    assert!(
        listed(fleet, &x).await.expect("listed").stopped,
        "a stopped instance is listed stopped"
    );
    assert_eq!(
        ids_of(&fleet.stop(&one(&x)).await.expect("stop")),
        [],
        "stopping a stopped instance"
    );
    assert_eq!(
        ids_of(&fleet.start(&one(&x)).await.expect("start")),
        [(x.as_str(), FleetErrorKind::Stopping)],
        "a start while the stop is under way"
    );
    settle(x.clone()).await;
    assert_eq!(ids_of(&fleet.start(&one(&x)).await.expect("start")), []);
    assert!(!listed(fleet, &x).await.expect("listed").stopped, "started");
    assert_eq!(
        ids_of(&fleet.start(&one(&x)).await.expect("start")),
        [],
        "starting a running instance"
    );

    // An unknown id is refused alone.
    assert_eq!(
        ids_of(&fleet.stop(&[x.clone(), unknown.to_string()]).await.expect("stop")),
        [(unknown, FleetErrorKind::NotFound)]
    );
    assert!(
        listed(fleet, &x).await.expect("listed").stopped,
        "the known one stopped"
    );
    assert_eq!(
        ids_of(&fleet.start(&one(unknown)).await.expect("start")),
        [(unknown, FleetErrorKind::NotFound)]
    );

    // A cancelled launch: its instances gone, the stopped one too.
    fleet.cancel_launch(&[x.clone(), y.clone()]).await.expect("cancel");
    for id in [&x, &y] {
        assert!(listed(fleet, id).await.is_none(), "{id} is gone after the cancel");
    }
    let refused = fleet.stop(&one(&x)).await.expect("stop");
    assert_eq!(ids_of(&refused), [(x.as_str(), FleetErrorKind::Other)], "{refused:?}");
    assert!(
        refused[0].1.message.starts_with("IncorrectInstanceState"),
        "a terminated instance's stop is refused for its state: {refused:?}"
    );
    assert_eq!(
        ids_of(&fleet.start(&one(&y)).await.expect("start")),
        [(y.as_str(), FleetErrorKind::NotFound)],
        "a terminated instance's start"
    );
    fleet
        .terminate(&[x, y, unknown.to_string()])
        .await
        .expect("terminating again, and an unknown id");
}

/// The arrivals of a lane ([`JobStore::arrivals`]): every job created in it after the given
/// time, finished ones too, in creation order; other lanes' jobs and error records not. Job ids
/// start with `tag`; `now` is unix seconds. `settle` waits for the store's index to show the
/// writes (DynamoDB's is eventually consistent; the fake's at once).
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn arrivals_list_every_job_of_the_lane<J: JobStore, S: std::future::Future<Output = ()>>(
    jobs: &J,
    settle: impl Fn() -> S,
    tag: &str,
    now: f64,
) {
    let lane_of = |lane: &str| {
        let mut s = spec();
        s.lane = lane.into();
        s
    };
    let new = |n: &str, lane: &str, at: f64| JobRecord::new(format!("{tag}-{n}"), lane_of(lane), "contract".into(), at);
    let (a, b, c) = (
        new("a", "standard", now),
        new("b", "standard", now + 10.0),
        new("c", "standard", now + 20.0),
    );
    let other = new("x", "express", now + 15.0);
    for r in [&c, &a, &other, &b] {
        assert_eq!(jobs.create(r).await.expect("create"), Created::New);
    }
    jobs.record_error(&format!("{tag}-error"), "a bad spec", now + 12.0)
        .await
        .expect("an error record");
    // One of them ends: still an arrival.
    let rec = claimed(jobs, &b.id, "i-a", now + 11.0).await;
    let done = Settle::of(&rec, &AttemptEnd::Succeeded, &RerunLimits::default());
    jobs.finish(&b.id, "i-a", &done, now + 30.0).await.expect("finish");
    settle().await;
    let ids = |l: crate::ports::Listing<crate::ports::ArrivalRecord>| -> Vec<(String, f64)> {
        assert!(l.unreadable.is_empty(), "{:?}", l.unreadable);
        l.items.into_iter().map(|a| (a.id, a.created_at)).collect()
    };
    assert_eq!(
        ids(jobs.arrivals("standard", now - 1.0).await.expect("arrivals")),
        [
            (a.id.clone(), now),
            (b.id.clone(), now + 10.0),
            (c.id.clone(), now + 20.0)
        ],
        "every job of the lane, the finished one too, in creation order"
    );
    assert_eq!(
        ids(jobs.arrivals("standard", now).await.expect("arrivals")),
        [(b.id.clone(), now + 10.0), (c.id.clone(), now + 20.0)],
        "only those created after the time given"
    );
    assert_eq!(
        ids(jobs.arrivals("express", now - 1.0).await.expect("arrivals")),
        [(other.id.clone(), now + 15.0)],
        "another lane's"
    );
    let listed = jobs.arrivals("standard", now - 1.0).await.expect("arrivals");
    assert_eq!(listed.items[1].spec, b.spec, "with its spec");
}

/// The run times of a lane's last jobs to finish ([`JobStore::finished_run_times`]): newest
/// first, seconds from the claim to the end of the attempt that ended the job, the `limit`
/// newest of them however many jobs finished without a run after them (three cancelled while
/// queued, more than `limit`); other lanes' and unfinished jobs not; a job that ran and failed
/// is one. Job ids start with `tag`;
/// lanes `lane` and `lane-other` are this test's only (several runs may share one table). `settle`
/// waits for the index as in [`arrivals_list_every_job_of_the_lane`].
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn finished_run_times_are_the_lanes_latest<J: JobStore, S: std::future::Future<Output = ()>>(
    jobs: &J,
    settle: impl Fn() -> S,
    tag: &str,
    lane: &str,
    now: f64,
) {
    let lane_of = |lane: &str| {
        let mut s = spec();
        s.lane = lane.into();
        s
    };
    let other_lane = format!("{lane}-other");
    let new = |n: &str, lane: &str| JobRecord::new(format!("{tag}-{n}"), lane_of(lane), "contract".into(), now);
    let limits = &RerunLimits::default();
    // Each job of `lane`: claimed at `now + claim`, ended at `now + end` as `how`.
    let run = |n: &'static str, claim: f64, end: f64, how: AttemptEnd| {
        let r = new(n, lane);
        async move {
            assert_eq!(jobs.create(&r).await.expect("create"), Created::New);
            let rec = claimed(jobs, &r.id, "i-a", now + claim).await;
            let s = Settle::of(&rec, &how, limits).with_attempt(&rec, attempt(&rec, "i-a", now + end, "ended"));
            jobs.finish(&r.id, "i-a", &s, now + end).await.expect("finish");
            r
        }
    };
    run("a", 0.0, 30.0, AttemptEnd::Succeeded).await;
    run("b", 5.0, 95.0, AttemptEnd::Fatal("bad image".into())).await;
    run("c", 10.0, 210.0, AttemptEnd::Succeeded).await;
    // Cancelled while queued, after c finished: finished, no run.
    for (i, n) in ["q1", "q2", "q3"].into_iter().enumerate() {
        let q = new(n, lane);
        assert_eq!(jobs.create(&q).await.expect("create"), Created::New);
        jobs.request_cancel(&q.id, now + 300.0 + i as f64)
            .await
            .expect("cancel");
        assert_eq!(
            jobs.get(&q.id).await.expect("get").expect("row").state,
            JobState::Cancelled,
            "cancelled while queued"
        );
    }
    // Still running, and another lane's finished job: not this lane's finishes.
    let running = new("r", lane);
    assert_eq!(jobs.create(&running).await.expect("create"), Created::New);
    claimed(jobs, &running.id, "i-b", now + 20.0).await;
    let x = new("x", &other_lane);
    assert_eq!(jobs.create(&x).await.expect("create"), Created::New);
    let rec = claimed(jobs, &x.id, "i-c", now + 1.0).await;
    let done =
        Settle::of(&rec, &AttemptEnd::Succeeded, limits).with_attempt(&rec, attempt(&rec, "i-c", now + 2.0, "ok"));
    jobs.finish(&x.id, "i-c", &done, now + 2.0).await.expect("finish");
    settle().await;
    assert_eq!(
        jobs.get(&format!("{tag}-c")).await.expect("get").expect("row").run_s,
        Some(200.0),
        "the row keeps its run time"
    );
    assert_eq!(
        jobs.finished_run_times(lane, 10).await.expect("run times"),
        [200.0, 90.0, 30.0],
        "newest first, the failed run too, the cancelled ones without a run left out"
    );
    assert_eq!(
        jobs.finished_run_times(lane, 2).await.expect("run times"),
        [200.0, 90.0],
        "the 2 newest run times, not the 2 newest finishes (cancels)"
    );
    assert_eq!(
        jobs.finished_run_times(&other_lane, 10).await.expect("run times"),
        [1.0]
    );
    assert!(jobs
        .finished_run_times(&format!("{lane}-none"), 10)
        .await
        .expect("run times")
        .is_empty());
}

/// A lane's kept arrival statistics ([`ArrivalStatsStore`]): none before the first save; a save
/// only over what was read (none, or the statistics folded to the time given), so two runs never
/// both keep a fold; read back as saved, an unset histogram epoch (NaN) too. `lane` names a lane
/// no other test uses.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn arrival_stats_are_kept_over_what_was_read<S: ArrivalStatsStore>(store: &S, lane: &str) {
    assert_eq!(store.load_arrival_stats(lane).await.expect("load"), None, "none yet");
    let mut lo = onoff_policy::LaneObservation::default();
    // A shape with one arrival only (its gap histogram never recorded: epoch NaN) and one with gaps.
    lo.record_arrival_with_runtime(8, 1_000.0, None);
    for (i, t) in [1_000.0, 1_003.0, 1_090.0, 4_000.0].into_iter().enumerate() {
        lo.record_arrival_with_runtime(1, t, (i % 2 == 0).then_some(600.0));
    }
    let first = ArrivalStats {
        folded_to: 4_000.0,
        gaps: lo.gaps.clone(),
    };
    assert!(
        store.save_arrival_stats(lane, &first, None).await.expect("save"),
        "the first save"
    );
    assert!(
        !store.save_arrival_stats(lane, &first, None).await.expect("save"),
        "a second first save (another run's) is refused"
    );
    let read = store.load_arrival_stats(lane).await.expect("load").expect("kept");
    assert_eq!(read.folded_to, 4_000.0);
    assert_eq!(read.gaps.keys().collect::<Vec<_>>(), [&1, &8]);
    assert_eq!(read.gaps[&1].hist.samples(), 3);
    assert_eq!(read.gaps[&1].runtimes.samples(), 2);
    assert_eq!(read.gaps[&8].hist.samples(), 0);
    assert_eq!(read.gaps[&8].last_arrival, Some(1_000.0));
    for (p, q) in read.gaps[&1].hist.masses().zip(first.gaps[&1].hist.masses()) {
        assert!((p - q).abs() < 1e-12, "{p} against {q}");
    }
    let mut later = read.clone();
    later.folded_to = 5_000.0;
    assert!(
        !store
            .save_arrival_stats(lane, &later, Some(3_999.0))
            .await
            .expect("save"),
        "a save over statistics that are not the kept ones is refused"
    );
    assert!(
        store
            .save_arrival_stats(lane, &later, Some(4_000.0))
            .await
            .expect("save"),
        "a save over the kept ones"
    );
    let read = store.load_arrival_stats(lane).await.expect("load").expect("kept");
    assert_eq!(read.folded_to, 5_000.0);
    assert_eq!(
        store.load_arrival_stats(&format!("{lane}-other")).await.expect("load"),
        None,
        "per lane"
    );
}

/// Offerings marked unavailable after a capacity error: a later expiry wins, an earlier one
/// changes nothing, and a listing at `now` holds only the marks that expire after it. `key` is
/// any offering; `now` is unix seconds.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn unavailable_offerings_keep_the_latest_expiry<A: OfferingAvailability>(
    avail: &A,
    key: OfferingKey,
    now: f64,
) {
    let until = |listed: Vec<onoff_policy::UnavailableOffering>| -> Vec<f64> {
        listed.into_iter().filter(|u| u.key == key).map(|u| u.until).collect()
    };
    avail.mark_unavailable(&key, now + 1_000.0).await.expect("mark");
    avail
        .mark_unavailable(&key, now + 900.0)
        .await
        .expect("an earlier mark");
    assert_eq!(
        until(avail.list_unavailable(now).await.expect("list")),
        [now + 1_000.0],
        "an earlier expiry changes nothing"
    );
    avail.mark_unavailable(&key, now + 2_000.0).await.expect("a later mark");
    assert_eq!(
        until(avail.list_unavailable(now).await.expect("list")),
        [now + 2_000.0],
        "a later expiry wins"
    );
    assert_eq!(
        until(avail.list_unavailable(now + 2_000.0).await.expect("list")),
        [] as [f64; 0],
        "expired at its time"
    );
}

/// The reconcile lease: one holder at a time until it expires or is released; the holder renews;
/// a release by another owner does nothing.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn the_lease_admits_one_holder_until_it_expires_or_is_released<L: Lease>(lease: &L) {
    let acquire = |owner: &'static str, now: f64| async move {
        lease.acquire("reconcile", owner, 60.0, now).await.expect("acquire")
    };
    assert!(acquire("scaler-a", 1_000.0).await);
    assert!(!acquire("scaler-b", 1_010.0).await, "held");
    assert!(acquire("scaler-a", 1_020.0).await, "the holder renews");
    lease.release("reconcile", "scaler-b").await.expect("release");
    assert!(
        !acquire("scaler-b", 1_030.0).await,
        "released by another owner: still held"
    );
    assert!(acquire("scaler-b", 1_081.0).await, "expired at 1,080");
    lease.release("reconcile", "scaler-b").await.expect("release");
    assert!(acquire("scaler-c", 1_082.0).await, "released");
}

/// The start of the latest completed run is kept and only ever raised; the lease is untouched.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn the_latest_completed_runs_start_is_kept_and_only_raised<L: Lease>(lease: &L) {
    let last = || async { lease.last_done("reconcile").await.expect("last done") };
    assert_eq!(last().await, None);
    lease.mark_done("reconcile", 1_700_000_100.5).await.expect("mark");
    lease
        .mark_done("reconcile", 1_700_000_090.0)
        .await
        .expect("an earlier mark");
    assert_eq!(last().await, Some(1_700_000_100.5), "an earlier start changes nothing");
    lease
        .mark_done("reconcile", 1_700_000_160.0)
        .await
        .expect("a later mark");
    assert_eq!(last().await, Some(1_700_000_160.0));
    assert_eq!(lease.last_done("other").await.expect("last done"), None);
    assert!(lease
        .acquire("reconcile", "scaler-a", 60.0, 1_700_000_170.0)
        .await
        .expect("acquire"));
}

/// Scale requests: the first ask invokes, asks while it is pending join it, a run settles only
/// the count it read, a pending ask lapses after its stale time, a scaler that gives up drops it,
/// and an ask or a settle whose answer was lost (`lose` arms that for the next write: applied,
/// then sent again) is still its own: the ask invokes, the settle settles.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn scale_requests_join_the_pending_one_and_a_run_settles_only_what_it_saw<L: Lease>(
    lease: &L,
    lose: impl Fn(),
) {
    let t = 1_700_000_000.0;
    let ask = |at: f64| async move { lease.ask("reconcile", &[], at, 30.0).await.expect("ask") };
    let asks = || async { lease.asks("reconcile").await.expect("asks") };
    let settle = |seen: u64| async move { lease.settle_asks("reconcile", seen).await.expect("settle") };
    assert_eq!((asks().await.count, asks().await.pending_since), (0, None));
    assert!(settle(0).await, "nothing asked, nothing pending");
    assert_eq!(ask(t).await, ScaleAsk::Invoke);
    assert_eq!(ask(t + 1.0).await, ScaleAsk::Joined);
    let seen = asks().await;
    assert_eq!((seen.count, seen.pending_since), (2, Some(t)));
    // An ask while the run is under way: the run's settle fails, the request stays pending.
    assert_eq!(ask(t + 2.0).await, ScaleAsk::Joined);
    assert!(!settle(seen.count).await);
    assert_eq!(asks().await.pending_since, Some(t));
    // The run that goes again saw all three: settled, and the next ask invokes.
    assert!(settle(3).await);
    assert_eq!(asks().await.pending_since, None);
    assert_eq!(ask(t + 3.0).await, ScaleAsk::Invoke);
    // Its invocation lost: asks join until the mark is 30 s old, then one invokes.
    assert_eq!(ask(t + 33.0).await, ScaleAsk::Joined);
    assert_eq!(ask(t + 34.0).await, ScaleAsk::Invoke);
    // A scaler that gives up ends the pending ask whatever the count.
    lease.drop_pending_ask("reconcile").await.expect("drop");
    assert_eq!(asks().await.pending_since, None);
    // The invoking ask's answer lost: its retry finds its own mark, not someone else's.
    lose();
    assert_eq!(ask(t + 40.0).await, ScaleAsk::Invoke, "an ask whose answer was lost");
    assert_eq!(asks().await.pending_since, Some(t + 40.0));
    // A settle's answer lost: the retry's condition holds still; settled.
    let n = asks().await.count;
    lose();
    assert!(settle(n).await, "a settle whose answer was lost");
    assert_eq!(asks().await.pending_since, None);
}

/// The jobs scale requests ask for are kept with the count, added by invoking and joining asks
/// alike, each id once, ids over [`MAX_ASKED_JOB_ID_BYTES`] skipped; forgotten by id, while an id
/// asked for since stays; bounded: once [`MAX_KEPT_ASKED_JOBS`] are kept, asks are counted
/// without their ids.
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn asked_jobs_are_kept_with_the_count_and_forgotten_by_id<L: Lease>(lease: &L) {
    let t = 1_700_000_000.0;
    let ids = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
    let ask = |jobs: Vec<String>, at: f64| async move { lease.ask("reconcile", &jobs, at, 30.0).await.expect("ask") };
    let asks = || async { lease.asks("reconcile").await.expect("asks") };
    let long = "j".repeat(MAX_ASKED_JOB_ID_BYTES + 1);
    let first = vec!["job-b".into(), "job-a".into(), "job-a".into(), long];
    assert_eq!(ask(first, t).await, ScaleAsk::Invoke);
    assert_eq!(ask(ids(&["job-c"]), t + 1.0).await, ScaleAsk::Joined);
    assert_eq!(ask(vec![], t + 2.0).await, ScaleAsk::Joined);
    let seen = asks().await;
    assert_eq!((seen.count, seen.jobs.clone()), (3, ids(&["job-a", "job-b", "job-c"])));
    // Asked for while the run was under way: kept when the run forgets what it read.
    assert_eq!(ask(ids(&["job-d"]), t + 3.0).await, ScaleAsk::Joined);
    lease.forget_asked_jobs("reconcile", &seen.jobs).await.expect("forget");
    assert_eq!(asks().await.jobs, ids(&["job-d"]));
    lease
        .forget_asked_jobs("reconcile", &ids(&["job-d"]))
        .await
        .expect("forget");
    let left = asks().await;
    assert_eq!((left.count, left.jobs.len()), (4, 0));
    // Nothing to forget, or no item: no error.
    lease.forget_asked_jobs("reconcile", &[]).await.expect("forget nothing");
    lease
        .forget_asked_jobs("other", &ids(&["job-x"]))
        .await
        .expect("forget under no item");
    // Runs that never forget: the set fills up to its bound, then asks are counted without ids.
    let asks_to_fill = MAX_KEPT_ASKED_JOBS.div_ceil(MAX_ASKED_JOBS);
    for a in 0..asks_to_fill {
        let batch: Vec<String> = (0..MAX_ASKED_JOBS).map(|i| format!("job-{a:04}-{i:04}")).collect();
        assert_eq!(ask(batch, t + 4.0).await, ScaleAsk::Joined);
    }
    assert_eq!(ask(ids(&["job-late"]), t + 5.0).await, ScaleAsk::Joined);
    let full = asks().await;
    assert_eq!(full.count, 4 + asks_to_fill as u64 + 1);
    assert_eq!(full.jobs.len(), MAX_KEPT_ASKED_JOBS);
    assert!(!full.jobs.contains(&"job-late".to_string()));
}

/// What an agent writes of its project cache (`set`: `DynamoWorkers::set_cached_projects` or
/// [`crate::fake::FakeRegistry::set_cached_projects`], for worker id and projects): the list as
/// given, most recently used first, cut to [`crate::ports::MAX_CACHED_PROJECTS`]; none clears it;
/// written in any state (a Stopped row too); an unknown worker is [`StoreError::NotFound`]. Worker
/// ids as in [`worker_rows_keep_their_conditions`].
///
/// # Panics
/// On the first promise the store breaks, naming it.
pub async fn cached_projects_are_recorded_bounded<R, S, F>(reg: &R, set: S, tag: &str, now: f64)
where
    R: WorkerRegistry,
    S: Fn(String, Vec<String>) -> F,
    F: std::future::Future<Output = Result<(), StoreError>>,
{
    let a = format!("{tag}1");
    reg.register_launch(worker(&a, now)).await.expect("register");
    assert!(row(reg, &a).await.cached_projects.is_empty(), "a launch holds no cache");

    let two = vec!["recent".to_string(), "older".to_string()];
    set(a.clone(), two.clone()).await.expect("record the cache");
    assert_eq!(row(reg, &a).await.cached_projects, two, "in the order given");
    set(a.clone(), two.clone()).await.expect("the write's own retry");
    assert_eq!(row(reg, &a).await.cached_projects, two);

    let many: Vec<String> = (0..crate::ports::MAX_CACHED_PROJECTS + 4)
        .map(|i| format!("p{i}"))
        .collect();
    set(a.clone(), many.clone()).await.expect("record a long list");
    assert_eq!(
        row(reg, &a).await.cached_projects,
        many[..crate::ports::MAX_CACHED_PROJECTS],
        "the most recently used MAX_CACHED_PROJECTS"
    );

    // A Stopped row is written too: the volume keeps its cache through the stop.
    reg.set_state(&a, WorkerState::Idle).await.expect("idle");
    assert_eq!(reg.mark_stopped(&a, now + 100.0, now + 3_700.0, now).await, Ok(true));
    set(a.clone(), vec!["last".to_string()])
        .await
        .expect("on a stopped row");
    let r = row(reg, &a).await;
    assert_eq!(
        (r.state, r.cached_projects),
        (WorkerState::Stopped, vec!["last".to_string()])
    );

    set(a.clone(), Vec::new()).await.expect("clear");
    assert!(row(reg, &a).await.cached_projects.is_empty(), "none clears the list");
    set(a.clone(), Vec::new()).await.expect("clear again");

    assert!(
        matches!(set(format!("{tag}9"), two).await, Err(StoreError::NotFound(_))),
        "an unknown worker"
    );
    assert_eq!(reg.get(&format!("{tag}9")).await, Ok(None), "no row is made for it");
}
