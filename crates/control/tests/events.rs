//! Every sample in `events/` parses and is handled; malformed, unknown and repeated events.

use onoff_control::events::{parse, Trigger};
use onoff_control::fake::{FakeAvailability, FakeEventLog, FakeRegistry};
use onoff_control::interruption::{handle_event, HandleError, Handled};
use onoff_control::ports::{WorkerRecord, WorkerRegistry};
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
    pollster::block_on(reg.register_launch(WorkerRecord {
        id: WORKER.into(),
        lane: "standard".into(),
        offering: OfferingKey {
            instance_type: "g5.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::Spot,
        },
        price_usd_per_h: 0.39,
        state: WorkerState::Running,
        launched_at: NOW - 3600.0,
        project: None,
        idle_since: None,
        heartbeat_at: None,
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
                assert_eq!(handled, Handled::Drained { worker: WORKER.into() });
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
        if matches!(handled, Handled::Drained { .. } | Handled::Terminated { .. }) {
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
