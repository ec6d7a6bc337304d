//! `act` through the fakes: launch fallback on capacity errors, partial fulfilment, releases.

use onoff_control::fake::{FakeAvailability, FakeFleet, FakeRegistry, FleetCall};
use onoff_control::ports::{FleetError, FleetErrorKind};
use onoff_control::{act, handle_interruption_notice, ActContext};
use onoff_policy::{
    Action, CapacityPreference, CapacityType, LaunchShape, Offering, OfferingKey, Plan, PolicyConfig, Reason,
    WorkerState,
};

fn key(ty: &str, zone: &str) -> OfferingKey {
    OfferingKey {
        instance_type: ty.into(),
        zone: zone.into(),
        capacity_type: CapacityType::Spot,
    }
}

fn offerings() -> Vec<Offering> {
    [("a.1", "z1", 0.10), ("a.1", "z2", 0.10), ("b.1", "z1", 0.20)]
        .into_iter()
        .map(|(t, z, p)| Offering {
            key: key(t, z),
            gpus: 1,
            gpu_model: "NVIDIA X".into(),
            gpu_memory_gib: 24.0,
            vcpus: 4,
            price_usd_per_h: p,
            interruption: None,
        })
        .collect()
}

fn launch_plan(offering: OfferingKey, count: u32) -> Plan {
    let price_usd_per_h = offerings()
        .iter()
        .find(|o| o.key == offering)
        .map_or(0.0, |o| o.price_usd_per_h);
    Plan {
        actions: vec![Action::Launch {
            lane: 1,
            offering,
            price_usd_per_h,
            count,
            request: LaunchShape {
                gpus: 1,
                min_gpu_memory_gib: 16.0,
                capacity: CapacityPreference::SpotFirst,
                runtime_s: 3600.0,
            },
            project: Some("p".into()),
            job: None,
            reason: Reason::UnmetBacklog { unmet_jobs: count },
        }],
        ..Plan::default()
    }
}

fn launched_offerings(fleet: &FakeFleet) -> Vec<OfferingKey> {
    fleet
        .calls()
        .into_iter()
        .filter_map(|c| {
            if let FleetCall::Launch(r) = c {
                Some(r.offerings[0].clone())
            } else {
                None
            }
        })
        .collect()
}

#[test]
fn capacity_error_falls_back_to_the_next_offering_and_marks_the_first_unavailable() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.set_no_capacity(key("a.1", "z1"));
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 1000.0,
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert_eq!(out.launched.len(), 2);
    assert!(out.launched.iter().all(|l| l.launched.offering == key("a.1", "z2")));
    assert_eq!(launched_offerings(&fleet), vec![key("a.1", "z1"), key("a.1", "z2")]);
    assert_eq!(out.capacity_errors, vec![key("a.1", "z1")]);
    assert_eq!(
        avail.marked().get(&key("a.1", "z1")),
        Some(&(1000.0 + cfg.offers.unavailable_ttl_s))
    );
    // Registered as Pending, lane name from the config, project kept.
    let recs = reg.records();
    assert_eq!(recs.len(), 2);
    assert!(recs
        .values()
        .all(|r| r.state == WorkerState::Pending && r.lane == "standard" && r.project.as_deref() == Some("p")));
    assert!(out.unlaunched.is_empty());
    assert!(out.launched.iter().all(|l| l.price_usd_per_h == 0.10));
}

#[test]
fn partial_fulfilment_moves_the_rest_to_the_next_offering() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.set_capacity_limit(key("a.1", "z1"), 1);
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 3), ctx, &fleet, &reg, &avail));
    assert_eq!(out.launched.len(), 3);
    let in_z2 = out
        .launched
        .iter()
        .filter(|l| l.launched.offering == key("a.1", "z2"))
        .count();
    assert_eq!(in_z2, 2);
}

#[test]
fn when_no_offering_has_capacity_the_shortfall_is_reported_not_hidden() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    for o in offerings() {
        fleet.set_no_capacity(o.key);
    }
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert!(out.launched.is_empty());
    assert_eq!(out.unlaunched, vec![(1, 2)]);
    assert_eq!(out.capacity_errors.len(), 3);
}

#[test]
fn other_launch_errors_are_collected_and_not_retried_elsewhere() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.fail_next(FleetError {
        kind: FleetErrorKind::Other,
        message: "InvalidLaunchTemplateId.NotFound".into(),
    });
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 1), ctx, &fleet, &reg, &avail));
    assert_eq!(out.errors.len(), 1);
    assert!(out.errors[0].contains("InvalidLaunchTemplateId"));
    assert_eq!(launched_offerings(&fleet).len(), 1);
    assert!(avail.marked().is_empty());
}

#[test]
fn terminate_and_cancel_go_to_their_own_calls_and_mark_terminating() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    let ids: Vec<String> = out.launched.iter().map(|l| l.launched.instance_id.clone()).collect();
    let plan = Plan {
        actions: vec![
            Action::Terminate {
                worker: ids[0].clone(),
                reason: Reason::PendingNotNeeded,
            },
            Action::CancelLaunch {
                worker: ids[1].clone(),
                reason: Reason::PendingNotNeeded,
            },
            // Already gone: not an error.
            Action::Terminate {
                worker: "i-gone".into(),
                reason: Reason::PendingNotNeeded,
            },
        ],
        ..Plan::default()
    };
    let out = pollster::block_on(act(&plan, ctx, &fleet, &reg, &avail));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.terminated, vec![ids[0].clone(), "i-gone".to_string()]);
    assert_eq!(out.cancelled, vec![ids[1].clone()]);
    assert!(fleet.running().is_empty());
    assert!(fleet.calls().contains(&FleetCall::Cancel(vec![ids[1].clone()])));
    assert_eq!(reg.records()[&ids[0]].state, WorkerState::Terminating);
}

#[test]
fn an_interruption_notice_drains_the_worker_and_marks_its_offering() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 1), ctx, &fleet, &reg, &avail));
    let id = out.launched[0].launched.instance_id.clone();
    pollster::block_on(handle_interruption_notice(
        &reg,
        &avail,
        &cfg,
        &id,
        &key("a.1", "z1"),
        50.0,
    ))
    .unwrap();
    // Twice is the same as once.
    pollster::block_on(handle_interruption_notice(
        &reg,
        &avail,
        &cfg,
        &id,
        &key("a.1", "z1"),
        50.0,
    ))
    .unwrap();
    assert_eq!(reg.records()[&id].state, WorkerState::Draining);
    assert_eq!(avail.marked()[&key("a.1", "z1")], 50.0 + cfg.offers.unavailable_ttl_s);
    // A notice for a worker already gone is not an error.
    pollster::block_on(handle_interruption_notice(
        &reg,
        &avail,
        &cfg,
        "i-unknown",
        &key("b.1", "z1"),
        60.0,
    ))
    .unwrap();
}

#[test]
fn the_spread_of_one_decision_is_one_call_with_an_override_per_offering() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let mut plan = launch_plan(key("a.1", "z1"), 2);
    let mut second = launch_plan(key("a.1", "z2"), 2).actions.remove(0); // same reason as the first
    if let Action::Launch { count, .. } = &mut second {
        *count = 1;
    }
    plan.actions.push(second);
    // z2 has no capacity: its share goes to z1 in the same call.
    fleet.set_no_capacity(key("a.1", "z2"));
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
    };
    let out = pollster::block_on(act(&plan, ctx, &fleet, &reg, &avail));
    let calls: Vec<_> = fleet
        .calls()
        .into_iter()
        .filter_map(|c| if let FleetCall::Launch(r) = c { Some(r) } else { None })
        .collect();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].offerings, vec![key("a.1", "z1"), key("a.1", "z2")]);
    assert_eq!(calls[0].count, 3);
    assert_eq!(out.launched.len(), 3);
    assert!(out.launched.iter().all(|l| l.launched.offering == key("a.1", "z1")));
    assert_eq!(out.capacity_errors, vec![key("a.1", "z2")]);
    assert!(avail.marked().contains_key(&key("a.1", "z2")));
}
