//! The job state machine under random interleavings: three agents and two reconcilers working on
//! a few jobs through the real [`JobStore`] semantics (the fake's conditional writes), the real
//! [`Settle`] rules and the real reaper ([`reap_jobs`]), with wake-up messages that are
//! duplicated, reordered and lost, agents that crash, renew late or end attempts every way, and
//! reconcilers whose reads go stale before they write, and writes to the table whose answers are
//! lost on the way back, so the SDK sends them again (`FakeJobs::lose_next_answer`: the retry
//! meets the row its first try wrote, as on DynamoDB).
//!
//! Users cancel jobs at random moments too (`request_cancel`); an agent that learns of a cancel at
//! a renewal ends its attempt CANCELLED. A reconciler ends jobs past a lane's quota wait limit
//! from what it read (maybe long ago: `fail_waiting`, conditioned on the row as read).
//!
//! After every step:
//! - a job succeeds at most once, and a final state never changes;
//! - a job the user cancelled never waits again: it is RUNNING (until its lease holder or the
//!   reaper ends it) or final, and final means CANCELLED unless it had succeeded;
//! - no live lease is ever stripped: an agent whose last claim or renewal set an expiry still in
//!   the future holds the job in the table (so no two agents hold live leases on one job);
//! - no live lease is orphaned: a job the table shows RUNNING under a lease still live is held by
//!   that agent, unless the agent crashed holding it (a claim whose answer was lost is the
//!   agent's own, not "someone else's RUNNING job" whose message it deletes);
//! - a cancel the user asks for of a waiting job answers that it cancelled it.
//!
//! After the faults stop and time runs on (drain):
//! - every sweep leaves the queue at least one message per pending job;
//! - every job ends in exactly one final state.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use onoff_control::fake::FakeJobs;
use onoff_control::job::{AttemptEnd, JobSpec, JobState, Settle};
use onoff_control::ports::{wake, Backlog, CancelOutcome, Claim, JobQueue, JobRecord, JobStore, StoreError};
use onoff_control::reconcile::{reap_jobs, ReconcileOptions};
use proptest::prelude::*;

const LEASE_S: f64 = 60.0;
const JOBS: usize = 3;
const AGENTS: usize = 3;

/// The lane queue as a list of job ids (a message is its body), in any order.
#[derive(Default)]
struct Queue(Mutex<Vec<String>>);

/// Its count, as `GetQueueAttributes` gives it (every message visible).
impl Backlog for Queue {
    async fn backlog(&self, _lane: &str) -> Result<onoff_policy::LaneBacklog, String> {
        Ok(onoff_policy::LaneBacklog {
            visible: self.0.lock().unwrap().len() as u32,
            ..Default::default()
        })
    }
}

impl JobQueue for Queue {
    async fn send(&self, _lane: &str, body: &str, _delay_s: u32) -> Result<(), String> {
        let v: serde_json::Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
        self.0.lock().unwrap().push(v["job_id"].as_str().unwrap().to_string());
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Agent `a` receives message `k` (any of them: SQS does not keep order) and acts on it.
    Receive(usize, usize),
    /// Agent `a` renews its lease.
    Renew(usize),
    /// Agent `a` ends its attempt.
    End(usize, u8),
    /// Agent `a` dies without a word (its lease runs out).
    Crash(usize),
    /// Reconciler `r` reads the active jobs.
    ReapRead(usize),
    /// Reconciler `r` acts on what it read (maybe long ago).
    ReapApply(usize),
    /// SQS delivers message `k` twice.
    Duplicate(usize),
    /// Message `k` is lost.
    Lose(usize),
    /// Time passes.
    Advance(u8),
    /// The user cancels job `j`.
    Cancel(usize),
    /// The next write to the jobs table is applied and its answer lost: the SDK sends it again.
    LoseAnswer,
    /// Reconciler `r` ends job `j` as past its quota wait limit, from what it read (if it read
    /// the job waiting).
    QuotaWaitEnd(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..AGENTS, 0..8usize).prop_map(|(a, k)| Op::Receive(a, k)),
        3 => (0..AGENTS).prop_map(Op::Renew),
        3 => (0..AGENTS, 0..6u8).prop_map(|(a, e)| Op::End(a, e)),
        1 => (0..AGENTS).prop_map(Op::Crash),
        2 => (0..2usize).prop_map(Op::ReapRead),
        2 => (0..2usize).prop_map(Op::ReapApply),
        1 => (0..8usize).prop_map(Op::Duplicate),
        1 => (0..8usize).prop_map(Op::Lose),
        3 => (0..4u8).prop_map(Op::Advance),
        1 => (0..JOBS).prop_map(Op::Cancel),
        2 => Just(Op::LoseAnswer),
        1 => (0..2usize, 0..JOBS).prop_map(|(r, j)| Op::QuotaWaitEnd(r, j)),
    ]
}

struct Held {
    job: JobRecord,
    lease_until: f64,
}

struct World {
    jobs: FakeJobs,
    queue: Queue,
    agents: Vec<Option<Held>>,
    snapshots: Vec<Option<(f64, Vec<JobRecord>)>>,
    now: f64,
    succeeded: BTreeMap<String, u32>,
    finals: BTreeMap<String, JobState>,
    cancelled: BTreeSet<String>,
    /// (agent, job) leases left behind by a crash.
    orphans: BTreeSet<(usize, String)>,
    /// Broken promises seen while stepping, reported by the next check.
    violations: Vec<String>,
    opts: ReconcileOptions,
}

fn spec(max_attempts: u32) -> JobSpec {
    serde_json::from_value(serde_json::json!({
        "image": "img", "command": ["x"], "project": "p", "max_attempts": max_attempts
    }))
    .unwrap()
}

impl World {
    fn new() -> Self {
        let w = Self {
            jobs: FakeJobs::default(),
            queue: Queue::default(),
            agents: (0..AGENTS).map(|_| None).collect(),
            snapshots: vec![None, None],
            now: 1_000.0,
            succeeded: BTreeMap::new(),
            finals: BTreeMap::new(),
            cancelled: BTreeSet::new(),
            orphans: BTreeSet::new(),
            violations: Vec::new(),
            opts: ReconcileOptions {
                resend_after_s: 2.0 * LEASE_S,
                ..ReconcileOptions::default()
            },
        };
        for i in 0..JOBS {
            let id = format!("job-{i}");
            w.jobs.put(JobRecord::new(id.clone(), spec(3), "test".into(), w.now));
            pollster::block_on(wake(&w.jobs, &w.queue, &id, &spec(3), 0, w.now)).unwrap();
        }
        w
    }

    fn messages(&self) -> Vec<String> {
        self.queue.0.lock().unwrap().clone()
    }

    fn take_message(&self, k: usize) -> Option<String> {
        let mut q = self.queue.0.lock().unwrap();
        if q.is_empty() {
            return None;
        }
        let i = k % q.len();
        Some(q.remove(i))
    }

    fn end(&mut self, a: usize, end: AttemptEnd) {
        let Some(held) = self.agents[a].take() else { return };
        let settle = Settle::of(&held.job, &end, &self.opts.limits);
        match pollster::block_on(self.jobs.finish(&held.job.id, &format!("agent-{a}"), &settle, self.now)) {
            Ok(()) => {
                if settle.to == JobState::Succeeded {
                    *self.succeeded.entry(held.job.id.clone()).or_default() += 1;
                }
                if settle.to.is_pending() {
                    let _ =
                        pollster::block_on(wake(&self.jobs, &self.queue, &held.job.id, &held.job.spec, 0, self.now));
                }
            }
            Err(StoreError::Conflict(_)) => {} // the lease was lost: nothing recorded
            Err(e) => panic!("finish: {e}"),
        }
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Receive(a, k) => {
                if self.agents[a].is_some() {
                    return;
                }
                let Some(id) = self.take_message(k) else { return };
                let owner = format!("agent-{a}");
                match pollster::block_on(self.jobs.claim(&id, &owner, self.now + LEASE_S, self.now)).unwrap() {
                    // The message was taken (deleted) either way.
                    Claim::Claimed(rec) => {
                        self.orphans.remove(&(a, id.clone()));
                        self.agents[a] = Some(Held {
                            job: *rec,
                            lease_until: self.now + LEASE_S,
                        })
                    }
                    Claim::NotClaimable(_) => {}
                    Claim::Unknown => panic!("a message for an unknown job"),
                }
            }
            Op::Renew(a) => {
                let Some(held) = &mut self.agents[a] else { return };
                let until = self.now + LEASE_S;
                match pollster::block_on(self.jobs.renew(&held.job.id, &format!("agent-{a}"), until)) {
                    Ok(r) => {
                        held.lease_until = until;
                        if r.cancel_requested {
                            self.end(a, AttemptEnd::Cancelled);
                        }
                    }
                    Err(StoreError::Conflict(_)) => self.agents[a] = None,
                    Err(e) => panic!("renew: {e}"),
                }
            }
            Op::End(a, e) => {
                let end = match e {
                    0 | 1 => AttemptEnd::Succeeded,
                    2 => AttemptEnd::Failed("exit code 1".into()),
                    3 => AttemptEnd::Released("spot notice".into()),
                    4 => AttemptEnd::Deferred("deadline at risk on spot".into()),
                    _ => AttemptEnd::HandedBack("too few GPUs".into()),
                };
                self.end(a, end);
            }
            Op::Crash(a) => {
                if let Some(held) = self.agents[a].take() {
                    self.orphans.insert((a, held.job.id));
                }
            }
            Op::ReapRead(r) => {
                let listed = pollster::block_on(self.jobs.active()).unwrap();
                self.snapshots[r] = Some((self.now, listed.items));
            }
            Op::ReapApply(r) => {
                let Some((read_at, snapshot)) = self.snapshots[r].take() else {
                    return;
                };
                pollster::block_on(reap_jobs(
                    &snapshot,
                    &BTreeSet::new(),
                    &self.opts,
                    read_at,
                    &self.jobs,
                    &self.queue,
                ));
            }
            Op::Duplicate(k) => {
                let mut q = self.queue.0.lock().unwrap();
                if !q.is_empty() {
                    let m = q[k % q.len()].clone();
                    q.push(m);
                }
            }
            Op::Lose(k) => {
                self.take_message(k);
            }
            Op::Advance(d) => {
                self.now += [1.0, LEASE_S / 3.0, LEASE_S + 1.0, 2.0 * LEASE_S + 1.0][d as usize];
            }
            Op::LoseAnswer => self.jobs.lose_next_answer(),
            Op::QuotaWaitEnd(r, j) => {
                let id = format!("job-{j}");
                let Some(seen) = self.snapshots[r]
                    .as_ref()
                    .and_then(|(_, rows)| rows.iter().find(|row| row.id == id && row.state.is_pending()))
                    .cloned()
                else {
                    return;
                };
                let before = self.jobs.records()[&id].clone();
                let ended =
                    pollster::block_on(self.jobs.fail_waiting(&seen, "past the quota wait limit", self.now)).unwrap();
                let after = self.jobs.records()[&id].clone();
                // Ended by this call, or found ended by one at this very instant (the read-back
                // of a write whose answer was lost cannot tell the two apart).
                let as_ended = after.state == JobState::Failed
                    && after.reason.as_deref() == Some("past the quota wait limit")
                    && (before.state.is_pending() || (before == after && after.finished_at == Some(self.now)));
                if (ended && !as_ended) || (!ended && after != before) {
                    self.violations.push(format!(
                        "the quota wait end of {id} answered {ended}: {before:?} -> {after:?}"
                    ));
                }
            }
            Op::Cancel(j) => {
                let id = format!("job-{j}");
                let waiting = self.jobs.records()[&id].state.is_pending();
                let outcome = pollster::block_on(self.jobs.request_cancel(&id, self.now)).unwrap();
                if waiting && outcome != CancelOutcome::Cancelled {
                    self.violations
                        .push(format!("the cancel of waiting {id} answered {outcome:?}"));
                }
                if matches!(outcome, CancelOutcome::Cancelled | CancelOutcome::Requested) {
                    self.cancelled.insert(id);
                }
            }
        }
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        prop_assert!(self.violations.is_empty(), "{:?}", self.violations);
        let records = self.jobs.records();
        for (id, r) in &records {
            let (Some(owner), Some(until)) = (r.lease_owner.as_deref(), r.lease_expires_at) else {
                continue;
            };
            if r.state != JobState::Running || until <= self.now {
                continue;
            }
            let a: usize = owner.trim_start_matches("agent-").parse().unwrap();
            let held = self.agents[a].as_ref().is_some_and(|h| h.job.id == *id);
            prop_assert!(
                held || self.orphans.contains(&(a, id.clone())),
                "{} is RUNNING under {}'s live lease (until {}, now {}), which {} does not hold",
                id,
                owner,
                until,
                self.now,
                owner
            );
        }
        for (id, n) in &self.succeeded {
            prop_assert!(*n <= 1, "{id} succeeded {n} times");
        }
        for (id, r) in &records {
            if let Some(f) = self.finals.get(id) {
                prop_assert_eq!(r.state, *f, "{} left its final state", id);
            } else if r.state.is_final() {
                self.finals.insert(id.clone(), r.state);
            }
        }
        for id in &self.cancelled {
            let r = &records[id];
            prop_assert!(
                matches!(r.state, JobState::Running | JobState::Cancelled | JobState::Succeeded),
                "{} was cancelled but is {:?}",
                id,
                r.state
            );
            if r.state == JobState::Succeeded {
                prop_assert!(
                    self.succeeded.get(id).copied().unwrap_or(0) == 1,
                    "{} SUCCEEDED after its cancel without a success",
                    id
                );
            }
        }
        for (a, held) in self.agents.iter().enumerate() {
            let Some(h) = held else { continue };
            if h.lease_until > self.now {
                let r = &records[&h.job.id];
                prop_assert!(
                    r.state == JobState::Running && r.lease_owner.as_deref() == Some(&*format!("agent-{a}")),
                    "agent-{a} holds a live lease on {} (until {}, now {}) but the table says {:?} by {:?}",
                    h.job.id,
                    h.lease_until,
                    self.now,
                    r.state,
                    r.lease_owner
                );
            }
        }
        Ok(())
    }

    /// No more faults: time runs on, a reconciler reaps and sweeps, agents run what they get.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        for a in 0..AGENTS {
            if self.agents[a].is_some() {
                self.end(a, AttemptEnd::Succeeded);
            }
        }
        for _ in 0..40 {
            self.now += 2.0 * LEASE_S + 1.0;
            self.step(&Op::ReapRead(0));
            self.step(&Op::ReapApply(0));
            // The sweep leaves at least one message per pending job. Which job a message wakes
            // only the queue could tell: a duplicate of one job may stand for another's lost
            // message until the agents drain it, and the next sweep sends the missing one (the
            // jobs all finishing below proves it).
            let records = self.jobs.records();
            let pending = records.values().filter(|r| r.state.is_pending()).count();
            prop_assert!(
                self.messages().len() >= pending,
                "{} pending jobs and {} messages after a sweep",
                pending,
                self.messages().len()
            );
            if records.values().all(|r| r.state.is_final()) {
                return Ok(());
            }
            while !self.messages().is_empty() {
                self.step(&Op::Receive(0, 0));
                self.end(0, AttemptEnd::Succeeded);
                self.check()?;
            }
        }
        let left: Vec<_> = self
            .jobs
            .records()
            .into_values()
            .filter(|r| !r.state.is_final())
            .collect();
        prop_assert!(left.is_empty(), "jobs never finished: {:?}", left);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn every_job_ends_once_and_no_live_lease_is_stripped(ops in prop::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for op in &ops {
            w.step(op);
            w.check()?;
        }
        w.drain()?;
        for id in w.jobs.records().keys() {
            prop_assert!(w.succeeded.get(id).copied().unwrap_or(0) <= 1);
        }
    }
}
