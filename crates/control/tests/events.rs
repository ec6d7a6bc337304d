//! Every sample in `events/` parses and is handled; malformed, unknown and repeated events; a
//! retry after a failure does the work; a rebalance drains without stopping anything.

use onoff_control::events::{parse, Trigger};
use onoff_control::fake::{FakeAvailability, FakeEventLog, FakeRegistry};
use onoff_control::interruption::{handle_event, HandleError, Handled};
use onoff_control::ports::{EventLog, StoreError, WorkerRecord, WorkerRegistry};
use onoff_policy::{CapacityType, OfferingKey, PolicyConfig, WorkerState};

const EVENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../events");
const WORKER: &str = "i-0b662ef9931388ba0";
const NOW: f64 = 1_700_000_000.0;

fn sample(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{EVENTS}/{name}")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn registry() -> FakeRegistry {
    let reg = FakeRegistry::default();
    let offering = OfferingKey {
        instance_type: "g5.xlarge".into(),
        zone: "us-east-1a".into(),
        capacity_type: CapacityType::Spot,
    };
    pollster::block_on(reg.register_launch(WorkerRecord {
        state: WorkerState::Running,
        ..WorkerRecord::launched(WORKER, "standard", offering, 0.39, NOW - 3600.0)
    }))
    .unwrap();
    reg
}

#[test]
fn every_eventbridge_sample_parses_and_is_handled() {
    let mut names: Vec<String> = std::fs::read_dir(EVENTS)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        // S3 and SQS submissions are the submit function's (functions/submit tests them).
        .filter(|n| sample(n).get("detail-type").is_some())
        .collect();
    names.sort();
    assert!(names.len() >= 5, "{names:?}");
    let cfg = PolicyConfig::default();
    for name in &names {
        let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
        let v = sample(name);
        let (_, trigger) = parse(&v).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            !matches!(trigger, Trigger::Unknown { .. }),
            "{name} is a kind the control plane handles"
        );
        let handled = pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap();
        let state = reg.records()[WORKER].state;
        match name.as_str() {
            "spot-interruption-warning.json" | "rebalance-recommendation.json" => {
                let expected = if name.starts_with("spot") {
                    Handled::Drained { worker: WORKER.into() }
                } else {
                    Handled::Rebalanced { worker: WORKER.into() }
                };
                assert_eq!(handled, expected);
                assert_eq!(state, WorkerState::Draining);
                let marked = avail.marked();
                assert_eq!(marked.len(), 1);
                assert_eq!(*marked.values().next().unwrap(), NOW + cfg.offers.unavailable_ttl_s);
            }
            "instance-state-change.json" => {
                assert_eq!(handled, Handled::Terminated { worker: WORKER.into() });
                assert_eq!(state, WorkerState::Terminating);
            }
            "queue-depth-alarm.json" | "schedule.json" => assert_eq!(handled, Handled::Reconcile),
            other => panic!("no expectation for {other}"),
        }
        // Delivered twice, handled once.
        if matches!(
            handled,
            Handled::Drained { .. } | Handled::Rebalanced { .. } | Handled::Terminated { .. }
        ) {
            assert_eq!(
                pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap(),
                Handled::Duplicate
            );
        }
    }
}

#[test]
fn unknown_kinds_and_strangers_are_no_ops_and_malformed_events_errors() {
    let cfg = PolicyConfig::default();
    let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
    let mut v = sample("spot-interruption-warning.json");
    v["detail-type"] = "EC2 Fast Launch State-change Notification".into();
    assert!(matches!(
        pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap(),
        Handled::NoOp(_)
    ));
    let mut v = sample("spot-interruption-warning.json");
    v["detail"]["instance-id"] = "i-0ffffffffffffffff".into();
    let h = pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap();
    assert!(
        matches!(&h, Handled::NoOp(m) if m.contains("not an onoff worker")),
        "{h:?}"
    );
    assert_eq!(reg.records()[WORKER].state, WorkerState::Running);
    let mut v = sample("spot-interruption-warning.json");
    v["detail"].as_object_mut().unwrap().remove("instance-id");
    let err = pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap_err();
    assert!(
        matches!(&err, HandleError::Malformed(e) if e.to_string().contains("instance-id")),
        "{err:?}"
    );
    let err = pollster::block_on(handle_event(
        &serde_json::json!({"hello": 1}),
        &cfg,
        &reg,
        &avail,
        &log,
        NOW,
    ))
    .unwrap_err();
    assert!(matches!(err, HandleError::Malformed(_)));
    assert!(avail.marked().is_empty());
}

#[test]
fn a_retry_after_a_failed_write_does_the_work_and_only_then_records_the_event() {
    let cfg = PolicyConfig::default();
    let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
    let v = sample("spot-interruption-warning.json");
    let id = v["id"].as_str().unwrap().to_string();
    // The first delivery's write fails: retryable, and the event is not recorded as handled.
    reg.fail_next(StoreError::Other("ProvisionedThroughputExceededException".into()));
    let err = pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap_err();
    assert!(matches!(err, HandleError::Store(_)), "{err:?}");
    assert_eq!(reg.records()[WORKER].state, WorkerState::Running);
    assert!(!pollster::block_on(log.seen(&id)).unwrap());
    // EventBridge retries: the work is done this time.
    let handled = pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW + 5.0)).unwrap();
    assert_eq!(handled, Handled::Drained { worker: WORKER.into() });
    assert_eq!(reg.records()[WORKER].state, WorkerState::Draining);
    assert_eq!(avail.marked().len(), 1);
    assert!(pollster::block_on(log.seen(&id)).unwrap());
    // A later delivery is a duplicate.
    assert_eq!(
        pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW + 9.0)).unwrap(),
        Handled::Duplicate
    );
}

#[test]
fn a_rebalance_drains_the_worker_without_stopping_it_and_never_revives_a_terminating_one() {
    let cfg = PolicyConfig::default();
    let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
    let v = sample("rebalance-recommendation.json");
    let handled = pollster::block_on(handle_event(&v, &cfg, &reg, &avail, &log, NOW)).unwrap();
    assert_eq!(handled, Handled::Rebalanced { worker: WORKER.into() });
    // Takes no new work: its agent's claim is refused.
    assert_eq!(reg.records()[WORKER].state, WorkerState::Draining);
    assert_eq!(reg.mark_busy(WORKER, NOW + 1.0), Ok(false));
    assert_eq!(avail.marked().len(), 1, "the offering is skipped for a while");

    // A notice that arrives after the instance is already terminating leaves it Terminating.
    let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
    pollster::block_on(reg.set_state(WORKER, WorkerState::Terminating)).unwrap();
    for name in ["rebalance-recommendation.json", "spot-interruption-warning.json"] {
        pollster::block_on(handle_event(&sample(name), &cfg, &reg, &avail, &log, NOW)).unwrap();
        assert_eq!(reg.records()[WORKER].state, WorkerState::Terminating, "{name}");
    }
}

/// The state-change sample for `state`, at `time` (RFC 3339).
fn state_change(state: &str, time: &str, id: &str) -> serde_json::Value {
    let mut v = sample("instance-state-change.json");
    v["detail"]["state"] = state.into();
    v["time"] = time.into();
    v["id"] = id.into();
    v
}

#[test]
fn a_stop_onoff_made_is_not_a_loss_but_a_stop_by_anyone_else_is() {
    let cfg = PolicyConfig::default();
    // NOW is 2023-11-14T22:13:20Z; the worker was launched an hour before.
    let after_launch = "2023-11-14T22:13:00Z";
    let before_launch = "2023-11-14T21:00:00Z";
    for state in ["stopping", "stopped"] {
        // Stopped by onoff: its row says so; nothing changes.
        let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
        pollster::block_on(reg.set_state(WORKER, WorkerState::Stopped)).unwrap();
        let h = pollster::block_on(handle_event(
            &state_change(state, after_launch, "e1"),
            &cfg,
            &reg,
            &avail,
            &log,
            NOW,
        ))
        .unwrap();
        assert!(matches!(h, Handled::NoOp(_)), "{state}: {h:?}");
        assert_eq!(reg.records()[WORKER].state, WorkerState::Stopped);
        // A stop from before its last start (the event came late): nothing either.
        let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
        let h = pollster::block_on(handle_event(
            &state_change(state, before_launch, "e2"),
            &cfg,
            &reg,
            &avail,
            &log,
            NOW,
        ))
        .unwrap();
        assert!(matches!(h, Handled::NoOp(_)), "{state}: {h:?}");
        assert_eq!(reg.records()[WORKER].state, WorkerState::Running);
        // Stopped by EC2 or from inside while it ran: it runs nothing now, so it is Terminating
        // (the reaper terminates it and requeues its job).
        let (reg, avail, log) = (registry(), FakeAvailability::default(), FakeEventLog::default());
        let h = pollster::block_on(handle_event(
            &state_change(state, after_launch, "e3"),
            &cfg,
            &reg,
            &avail,
            &log,
            NOW,
        ))
        .unwrap();
        assert_eq!(h, Handled::Terminated { worker: WORKER.into() }, "{state}");
        assert_eq!(reg.records()[WORKER].state, WorkerState::Terminating);
    }
}
