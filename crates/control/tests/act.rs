//! `act` through the fakes: launch fallback on any non-throttling launch error, partial
//! fulfilment, idempotency tokens, conditional scale-down racing an agent's claim, releases.

use onoff_control::fake::{FakeAvailability, FakeFleet, FakeRegistry, FleetCall};
use onoff_control::ports::{Decimal, FleetError, FleetErrorKind, LaunchRequest, WorkerRegistry};
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

/// The context of a decision at time 0 with nothing unavailable.
fn at_zero<'a>(cfg: &'a PolicyConfig, offerings: &'a [Offering]) -> ActContext<'a> {
    ActContext {
        cfg,
        offerings,
        unavailable: &[],
        now: 0.0,
        table: None,
        run_time_estimates: &[],
    }
}

/// `k` on on-demand.
fn on_demand(k: OfferingKey) -> OfferingKey {
    OfferingKey {
        capacity_type: CapacityType::OnDemand,
        ..k
    }
}

/// An offering like `o` (its GPUs and memory) under another key and price ($/h).
fn like(o: &Offering, key: OfferingKey, price_usd_per_h: f64) -> Offering {
    Offering {
        key,
        price_usd_per_h,
        ..o.clone()
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
                max_cost_usd: None,
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
        table: None,
        run_time_estimates: &[],
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
        table: None,
        run_time_estimates: &[],
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
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert!(out.launched.is_empty());
    assert_eq!(out.unlaunched, vec![(1, 2)]);
    assert_eq!(out.capacity_errors.len(), 3);
}

#[test]
fn a_fallback_dearer_than_the_launchs_cost_ceiling_is_not_taken() {
    // a.1 is out of capacity in both zones; b.1, at twice the price, has room. A launch without a
    // ceiling falls back to b.1; one whose ceiling (what its jobs' wait is worth over a.1) is below
    // b.1's cost for the job leaves its instances unlaunched, and the jobs wait for capacity.
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let cost = |ty: &str| {
        let o = offs.iter().find(|o| o.key == key(ty, "z1")).unwrap();
        onoff_policy::choice::expected_cost_per_job(o, 3600.0, 1, &cfg.offers)
    };
    for (ceiling, want_b) in [
        (None, true),
        (Some((cost("a.1") + cost("b.1")) / 2.0), false),
        (Some(cost("b.1")), true),
    ] {
        let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
        fleet.set_no_capacity(key("a.1", "z1"));
        fleet.set_no_capacity(key("a.1", "z2"));
        let mut plan = launch_plan(key("a.1", "z1"), 2);
        if let Action::Launch { request, .. } = &mut plan.actions[0] {
            request.max_cost_usd = ceiling;
        }
        let out = pollster::block_on(act(&plan, at_zero(&cfg, &offs), &fleet, &reg, &avail));
        let tried_b = launched_offerings(&fleet).contains(&key("b.1", "z1"));
        assert_eq!(tried_b, want_b, "ceiling {ceiling:?}");
        if want_b {
            assert_eq!(out.launched.len(), 2, "ceiling {ceiling:?}");
            assert!(out.unlaunched.is_empty());
        } else {
            assert!(out.launched.is_empty());
            assert_eq!(out.unlaunched, vec![(1, 2)]);
            // The cheap offerings are still marked, so the next decisions know they are short.
            assert_eq!(out.capacity_errors.len(), 2);
        }
    }
}

#[test]
fn an_on_demand_worker_of_a_spot_first_lane_records_the_spot_price_it_is_weighed_against() {
    // a.1 on-demand at 0.30 $/h; the best spot price for its shape (1 GPU, 24 GiB) is b.1's
    // 0.08 $/h, a.1's own 0.10 $/h is dearer. Recorded for an on-demand worker of the spot-first
    // lane (1, standard) only: not for a spot worker, nor in the on-demand lane (0, express).
    let od = on_demand(key("a.1", "z1"));
    let mut offs = offerings();
    offs.push(like(&offs[0], od.clone(), 0.30));
    offs.push(like(&offs[0], key("b.1", "z2"), 0.08));
    let cfg = PolicyConfig::default();
    for (lane, offering, want) in [
        (1, od.clone(), Some(0.08)),
        (1, key("a.1", "z1"), None),
        (0, od.clone(), None),
    ] {
        let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
        let mut plan = launch_plan(offering.clone(), 1);
        if let Action::Launch { lane: l, .. } = &mut plan.actions[0] {
            *l = lane;
        }
        let out = pollster::block_on(act(&plan, at_zero(&cfg, &offs), &fleet, &reg, &avail));
        assert_eq!(out.launched.len(), 1, "{lane} {offering}");
        let recs = reg.records();
        let rec = recs.values().next().unwrap();
        assert_eq!(rec.spot_price_usd_per_h, want, "lane {lane}, {offering}");
    }
}

#[test]
fn any_non_throttling_launch_error_skips_the_offering_for_a_while_and_falls_back() {
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 100.0,
        table: None,
        run_time_estimates: &[],
    };
    for kind in [FleetErrorKind::Other, FleetErrorKind::NotFound] {
        // The whole call fails (EC2: an instant fleet with one override and an Unsupported or
        // InvalidParameterValue error for its type).
        let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
        fleet.fail_next(FleetError {
            kind,
            message: "InvalidParameterValue: a.1 is not supported in z1".into(),
        });
        let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 1), ctx, &fleet, &reg, &avail));
        assert_eq!(out.launched.len(), 1, "{kind:?}: {out:?}");
        assert_ne!(out.launched[0].launched.offering, key("a.1", "z1"));
        assert_eq!(
            avail.marked().get(&key("a.1", "z1")),
            Some(&(100.0 + cfg.offers.unavailable_ttl_s))
        );
        assert_eq!(out.capacity_errors, vec![key("a.1", "z1")]);
        // Still reported, so a deployment-wide mistake is seen.
        assert!(
            out.errors.iter().any(|e| e.contains("InvalidParameterValue")),
            "{out:?}"
        );
        assert!(out.unlaunched.is_empty());
    }
    // One override of a spread call fails with its own error: the rest go elsewhere.
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.set_launch_error(
        key("a.1", "z1"),
        FleetError {
            kind: FleetErrorKind::Other,
            message: "Unsupported: a.1 in z1".into(),
        },
    );
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert_eq!(out.launched.len(), 2, "{out:?}");
    assert!(out.launched.iter().all(|l| l.launched.offering != key("a.1", "z1")));
    assert!(avail.marked().contains_key(&key("a.1", "z1")));
}

/// A spot-first launch falls back over a ranking of both capacity types. When the next best are
/// the spot and the on-demand offering of one instance type in one zone, at close prices, one
/// fleet call must not carry both: it launches one capacity type, and EC2 refuses an instance type
/// twice in one subnet (`InvalidFleetConfig`, "duplicate instance pools"; the fake refuses it
/// too), which would mark both good offerings unavailable and launch nothing.
#[test]
fn a_fallback_never_mixes_capacity_types_or_names_one_pool_twice() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let mut offs = offerings();
    offs.push(like(&offs[2], on_demand(key("b.1", "z1")), 0.205));
    // The a.1 offerings have no capacity: the fallback reaches b.1 in z1, spot and on-demand.
    fleet.set_no_capacity(key("a.1", "z1"));
    fleet.set_no_capacity(key("a.1", "z2"));
    let cfg = PolicyConfig::default();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 100.0,
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert_eq!(out.launched.len(), 2, "{out:?}");
    assert!(
        out.launched.iter().all(|l| l.launched.offering == key("b.1", "z1")),
        "{out:?}"
    );
    for call in fleet.calls() {
        if let FleetCall::Launch(r) = call {
            assert!(
                onoff_control::ports::invalid_fleet_request(&r).is_none(),
                "{:?}",
                r.offerings
            );
        }
    }
    assert!(
        !avail.marked().keys().any(|k| k.instance_type == "b.1"),
        "{:?}",
        avail.marked()
    );
    assert!(out.errors.is_empty(), "{:?}", out.errors);
}

#[test]
fn a_throttled_launch_stops_without_marking_anything() {
    throttled_or_over_an_account_limit(FleetErrorKind::Throttled, "RequestLimitExceeded");
}

/// The account's limit of fleets per region (MaxFleetCountExceeded) refuses every offering alike:
/// no fallback through the catalogue, nothing marked, the next reconcile retries.
#[test]
fn a_launch_over_the_accounts_fleet_limit_stops_without_marking_anything() {
    throttled_or_over_an_account_limit(FleetErrorKind::AccountLimit, "MaxFleetCountExceeded");
}

fn throttled_or_over_an_account_limit(kind: FleetErrorKind, code: &str) {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.fail_next(FleetError {
        kind,
        message: code.into(),
    });
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 0.0,
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 1), ctx, &fleet, &reg, &avail));
    assert_eq!(out.errors.len(), 1);
    assert!(out.errors[0].contains(code));
    assert_eq!(
        launched_offerings(&fleet).len(),
        1,
        "no fallback: the next reconcile retries"
    );
    assert!(avail.marked().is_empty());
    assert_eq!(out.unlaunched, vec![(1, 1)]);
}

fn launch_requests(fleet: &FakeFleet) -> Vec<LaunchRequest> {
    fleet
        .calls()
        .into_iter()
        .filter_map(|c| if let FleetCall::Launch(r) = c { Some(r) } else { None })
        .collect()
}

#[test]
fn each_launch_carries_an_idempotency_token_stable_for_its_decision() {
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let at = |now| ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now,
        table: None,
        run_time_estimates: &[],
    };
    let plan = launch_plan(key("a.1", "z1"), 2);
    let tokens = |now| {
        let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
        fleet.set_no_capacity(key("a.1", "z1"));
        pollster::block_on(act(&plan, at(now), &fleet, &reg, &avail));
        launch_requests(&fleet)
            .into_iter()
            .map(|r| r.client_token)
            .collect::<Vec<_>>()
    };
    let first = tokens(1000.0);
    // The first call and its fallback: two tokens, EC2's ClientToken shape, distinct.
    assert_eq!(first.len(), 2);
    assert!(first
        .iter()
        .all(|t| t.starts_with("onoff-") && t.len() <= 64 && t.is_ascii()));
    assert_ne!(first[0], first[1]);
    // The same decision again: the same tokens. Another decision: others.
    assert_eq!(tokens(1000.0), first);
    assert!(tokens(1060.0).iter().all(|t| !first.contains(t)));

    // Replaying a decision on the same fleet (a retry after a lost response) launches nothing new.
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let once = pollster::block_on(act(&plan, at(2000.0), &fleet, &reg, &avail));
    let again = pollster::block_on(act(&plan, at(2000.0), &fleet, &reg, &avail));
    assert_eq!(fleet.running().len(), 2);
    assert_eq!(once.launched, again.launched);
    assert_eq!(reg.records().len(), 2);
}

/// EC2 answers a repeated client token with the first call's result, and refuses the token with
/// other parameters (`IdempotentParameterMismatch`, EC2 API Reference, "Ensuring idempotency"):
/// so does the fake, and nothing is launched for the refused call.
#[test]
fn a_token_reused_with_other_parameters_is_refused_as_ec2_does() {
    use onoff_control::ports::Fleet;
    let fleet = FakeFleet::new();
    let req = token_request().with_token_for("decision-1");
    let first = pollster::block_on(fleet.launch(&req)).unwrap();
    assert_eq!(first.launched.len(), 2);
    assert_eq!(pollster::block_on(fleet.launch(&req)), Ok(first), "the retry's answer");
    let other = LaunchRequest {
        count: 3,
        ..req.clone()
    };
    let e = pollster::block_on(fleet.launch(&other)).unwrap_err();
    assert!(e.message.starts_with("IdempotentParameterMismatch"), "{e:?}");
    assert_eq!(fleet.running().len(), 2, "nothing launched for the refused call");
}

/// Two spot offerings, two instances, a project, no token yet.
fn token_request() -> LaunchRequest {
    LaunchRequest {
        lane: "standard".into(),
        offerings: vec![key("a.1", "z1"), key("a.1", "z2")],
        count: 2,
        project: Some("p".into()),
        job: None,
        client_token: String::new(),
    }
}

#[test]
fn the_idempotency_token_depends_on_every_field_of_the_request() {
    let base = token_request();
    let t = base.idempotency_token("d1");
    assert_eq!(t, base.clone().with_token_for("d1").client_token);
    assert_eq!(t, base.idempotency_token("d1"), "deterministic");
    assert_eq!(t.len(), "onoff-".len() + 32);
    let variants = [
        LaunchRequest {
            lane: "express".into(),
            ..base.clone()
        },
        LaunchRequest {
            offerings: vec![key("a.1", "z2"), key("a.1", "z1")],
            ..base.clone()
        },
        LaunchRequest {
            count: 3,
            ..base.clone()
        },
        LaunchRequest {
            project: None,
            ..base.clone()
        },
        LaunchRequest {
            project: Some(String::new()),
            ..base.clone()
        },
        LaunchRequest {
            job: Some("job-1".into()),
            ..base.clone()
        },
    ];
    let mut seen = vec![t.clone(), base.idempotency_token("d2")];
    for v in &variants {
        seen.push(v.idempotency_token("d1"));
    }
    let n = seen.len();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), n, "every field changes the token");
    // A token already set does not feed into the next one.
    let set = base.clone().with_token_for("d1");
    assert_eq!(set.idempotency_token("d1"), t);
}

#[test]
fn the_idempotency_token_is_fnv1a_of_the_fields_and_a_decision_id_in_parts_is_the_joined_id() {
    let req = token_request();
    // Computed apart from the crate (FNV-1a 128 in Python over the fields as the docs give
    // them): a release that changed the token would relaunch a retried decision.
    let want = "onoff-471ee463902255a2a7932c8342e1dc7f";
    assert_eq!(req.idempotency_token("1000/0/2"), want);
    assert_eq!(req.idempotency_token_of_parts(&[b"1000", b"/", b"0", b"/", b"2"]), want);
    assert_eq!(req.idempotency_token_of_parts(&[b"1000/0", b"/2"]), want);
    assert_eq!(req.clone().with_token_for_parts(&[b"1000/0/2"]).client_token, want);
    assert_ne!(req.idempotency_token_of_parts(&[b"1000", b"/", b"0", b"/", b"3"]), want);
    for n in [0, 7, 10, 99, 1_700_000_000_123, u64::MAX] {
        assert_eq!(Decimal::new(n).as_bytes(), n.to_string().as_bytes());
    }
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
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, &fleet, &reg, &avail));
    let ids: Vec<String> = out.launched.iter().map(|l| l.launched.instance_id.clone()).collect();
    // The first booted and is idle (the policy releases idle workers); the second still boots.
    reg.agent_heartbeat(&ids[0], WorkerState::Idle, Some(10.0), 10.0)
        .unwrap();
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
    assert_eq!(reg.records()[&ids[1]].state, WorkerState::Terminating);
    assert!(out.skipped.is_empty());
}

/// Two workers launched through `act`: the first idle, the second still booting.
fn idle_and_booting(
    fleet: &FakeFleet,
    reg: &FakeRegistry,
    avail: &FakeAvailability,
    cfg: &PolicyConfig,
) -> Vec<String> {
    let offs = offerings();
    let ctx = ActContext {
        cfg,
        offerings: &offs,
        unavailable: &[],
        now: LAUNCHED_AT,
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 2), ctx, fleet, reg, avail));
    let ids: Vec<String> = out.launched.iter().map(|l| l.launched.instance_id.clone()).collect();
    reg.agent_heartbeat(&ids[0], WorkerState::Idle, Some(10.0), 10.0)
        .unwrap();
    ids
}

fn release(ids: &[String]) -> Plan {
    Plan {
        actions: vec![
            Action::Terminate {
                worker: ids[0].clone(),
                reason: Reason::KeepAliveExpired {
                    idle_s: 900.0,
                    keep_alive_s: 600.0,
                },
            },
            Action::CancelLaunch {
                worker: ids[1].clone(),
                reason: Reason::PendingNotNeeded,
            },
        ],
        ..Plan::default()
    }
}

#[test]
fn scale_down_leaves_alone_a_worker_whose_agent_took_a_job_first() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let ids = idle_and_booting(&fleet, &reg, &avail, &cfg);
    // The policy decided on a view where the first was idle and the second booting; meanwhile the
    // first's agent claimed a job and the second's booted and claimed one too.
    assert_eq!(reg.mark_busy(&ids[0], 20.0), Ok(true));
    assert_eq!(reg.mark_busy(&ids[1], 20.0), Ok(true));
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 21.0,
        table: None,
        run_time_estimates: &[],
    };
    let before = fleet.calls().len();
    let out = pollster::block_on(act(&release(&ids), ctx, &fleet, &reg, &avail));
    assert_eq!(out.skipped, ids);
    assert!(out.terminated.is_empty() && out.cancelled.is_empty() && out.errors.is_empty());
    assert_eq!(fleet.calls().len(), before, "no terminate or cancel call");
    assert_eq!(fleet.running().len(), 2);
    assert!(reg.records().values().all(|w| w.state == WorkerState::Running));
}

#[test]
fn after_scale_down_marks_a_worker_terminating_its_agent_cannot_take_a_job() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let ids = idle_and_booting(&fleet, &reg, &avail, &cfg);
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 21.0,
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&release(&ids), ctx, &fleet, &reg, &avail));
    assert_eq!(out.terminated, vec![ids[0].clone()]);
    assert_eq!(out.cancelled, vec![ids[1].clone()]);
    // The agents' claims come too late: refused, the rows stay Terminating.
    for id in &ids {
        assert_eq!(reg.mark_busy(id, 22.0), Ok(false));
        assert_eq!(reg.records()[id].state, WorkerState::Terminating);
    }
    assert_eq!(
        reg.mark_busy("i-unknown", 22.0),
        Err(onoff_control::ports::StoreError::NotFound("i-unknown".into()))
    );
}

#[test]
fn a_cancel_is_only_for_a_launch_still_booting_and_a_failed_mark_keeps_the_worker() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let ids = idle_and_booting(&fleet, &reg, &avail, &cfg);
    // The booting one reported idle since the decision: not cancelled under it.
    reg.agent_heartbeat(&ids[1], WorkerState::Idle, Some(15.0), 15.0)
        .unwrap();
    // The store fails for the first's mark: it is not terminated blind.
    reg.fail_next(onoff_control::ports::StoreError::Other("throttled".into()));
    let offs = offerings();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 21.0,
        table: None,
        run_time_estimates: &[],
    };
    let out = pollster::block_on(act(&release(&ids), ctx, &fleet, &reg, &avail));
    assert_eq!(out.skipped, vec![ids[1].clone()]);
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    assert!(out.terminated.is_empty() && out.cancelled.is_empty());
    assert_eq!(fleet.running().len(), 2);
    assert!(pollster::block_on(reg.get(&ids[0])).unwrap().is_some());
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
        table: None,
        run_time_estimates: &[],
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
        table: None,
        run_time_estimates: &[],
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

/// 1-GPU G offerings (4 and 32 vCPUs) in three zones, spot and on-demand, and a P spot one.
fn gpu_offerings() -> Vec<Offering> {
    let mut out = Vec::new();
    for zone in ["z1", "z2", "z3"] {
        for (ty, vcpus, spot, on_demand) in [
            ("g5.8xlarge", 32, 0.25, 2.45),
            ("g5.xlarge", 4, 0.30, 1.01),
            ("g6.xlarge", 4, 0.32, 0.80),
            ("g4dn.xlarge", 4, 0.35, 0.53),
            ("p3.2xlarge", 8, 0.95, 3.06),
        ] {
            for (capacity_type, price) in [(CapacityType::Spot, spot), (CapacityType::OnDemand, on_demand)] {
                out.push(Offering {
                    key: OfferingKey {
                        instance_type: ty.into(),
                        zone: zone.into(),
                        capacity_type,
                    },
                    gpus: 1,
                    gpu_model: "NVIDIA X".into(),
                    gpu_memory_gib: 24.0,
                    vcpus,
                    price_usd_per_h: price,
                    interruption: None,
                });
            }
        }
    }
    out
}

fn gpu_launch(offering: OfferingKey, count: u32) -> Plan {
    let mut plan = launch_plan(offering.clone(), count);
    if let Action::Launch { price_usd_per_h, .. } = &mut plan.actions[0] {
        *price_usd_per_h = gpu_offerings()
            .iter()
            .find(|o| o.key == offering)
            .map_or(0.0, |o| o.price_usd_per_h);
    }
    plan
}

/// A launched worker's row says the fewest GPUs a job may ask for and run on it, as the policy
/// matches them (`choice::smallest_job_gpus`): its agent passes smaller jobs on.
#[test]
fn a_launched_workers_row_says_the_fewest_gpus_of_a_job_it_serves() {
    let mut offs = gpu_offerings();
    let eight = Offering {
        key: key("g5.48xlarge", "z1"),
        gpus: 8,
        vcpus: 192,
        price_usd_per_h: 5.0,
        ..offs[0].clone()
    };
    offs.push(eight.clone());
    let cfg = PolicyConfig::default();
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    // Each at a time of its own: a launch of the same decision is the same fleet request (its
    // client token).
    let launch = |offs: &[Offering], offering: &OfferingKey, now: f64| {
        let mut plan = launch_plan(offering.clone(), 1);
        if let Action::Launch { request, .. } = &mut plan.actions[0] {
            request.gpus = offs.iter().find(|o| o.key == *offering).unwrap().gpus;
        }
        let out = pollster::block_on(act(&plan, at(&cfg, offs, now), &fleet, &reg, &avail));
        assert_eq!(out.launched.len(), 1, "{out:?}");
        reg.records()[&out.launched[0].launched.instance_id].min_job_gpus
    };
    // No 2- or 4-GPU type: a 2-GPU job is scheduled on 8 GPUs, so the 8-GPU worker serves it.
    assert_eq!(launch(&offs, &eight.key, 100.0), Some(2));
    offs.push(Offering {
        key: key("g5.12xlarge", "z1"),
        gpus: 4,
        vcpus: 48,
        ..eight.clone()
    });
    for (offering, want, now) in [(key("g5.xlarge", "z1"), 1, 200.0), (eight.key.clone(), 5, 300.0)] {
        assert_eq!(launch(&offs, &offering, now), Some(want), "{offering}");
    }
}

/// A full vCPU quota refuses every type of its bucket of families, in every zone: the fallback
/// leaves the bucket at once (users of other tools report spot fallbacks that retried the same
/// quota type after type), and the operator is told which quota to raise.
#[test]
fn a_full_vcpu_quota_skips_its_whole_bucket_and_names_the_quota() {
    use onoff_control::quota::QuotaBucket;
    let offs = gpu_offerings();
    let cfg = PolicyConfig::default();
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offs,
        unavailable: &[],
        now: 100.0,
        table: None,
        run_time_estimates: &[],
    };
    // A new account: no G and VT spot quota at all.
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.set_vcpu_quota(QuotaBucket::GAndVt, CapacityType::Spot, 0, &offs);
    let out = pollster::block_on(act(&gpu_launch(key("g5.xlarge", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert_eq!(out.launched.len(), 2, "{out:?}");
    assert!(
        out.launched.iter().all(|l| {
            let k = &l.launched.offering;
            !(k.capacity_type == CapacityType::Spot && QuotaBucket::of(&k.instance_type) == QuotaBucket::GAndVt)
        }),
        "{:?}",
        out.launched
    );
    let g_spot_calls = launch_requests(&fleet)
        .iter()
        .filter(|r| {
            r.offerings
                .iter()
                .any(|k| k.capacity_type == CapacityType::Spot && k.instance_type.starts_with('g'))
        })
        .count();
    assert_eq!(g_spot_calls, 1, "one refused call, then out of the bucket");
    for o in offs
        .iter()
        .filter(|o| o.key.capacity_type == CapacityType::Spot && o.key.instance_type.starts_with('g'))
    {
        assert_eq!(
            avail.marked().get(&o.key),
            Some(&(100.0 + cfg.offers.unavailable_ttl_s)),
            "{}",
            o.key
        );
    }
    assert!(
        out.capacity_errors.len() <= 3,
        "the refused offerings only: {:?}",
        out.capacity_errors
    );
    let g_vt_spot = onoff_control::quota::QuotaMark {
        bucket: QuotaBucket::GAndVt,
        capacity: CapacityType::Spot,
        vcpus: 4,
        until: 100.0 + cfg.offers.unavailable_ttl_s,
        // Nothing of ours held the quota: the room is under 4 vCPUs.
        ceiling: Some(4),
    };
    assert_eq!(avail.marked().get(&g_vt_spot.key()), Some(&g_vt_spot.until));
    let quota_notes: Vec<&String> = out.errors.iter().filter(|e| e.contains("L-3819A6DF")).collect();
    assert_eq!(quota_notes.len(), 1, "one note per quota: {:?}", out.errors);
    assert_eq!(out.quotas_full, ["All G and VT Spot Instance Requests (L-3819A6DF)"]);
    assert!(
        quota_notes[0].contains("All G and VT Spot Instance Requests"),
        "{}",
        quota_notes[0]
    );

    // Room for 8 vCPUs: a 32-vCPU type is refused, and the 4-vCPU types of the bucket still fit.
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    fleet.set_vcpu_quota(QuotaBucket::GAndVt, CapacityType::Spot, 8, &offs);
    let out = pollster::block_on(act(&gpu_launch(key("g5.8xlarge", "z1"), 2), ctx, &fleet, &reg, &avail));
    assert_eq!(out.launched.len(), 2, "{out:?}");
    assert!(
        out.launched
            .iter()
            .all(|l| l.launched.offering.capacity_type == CapacityType::Spot
                && l.launched.offering.instance_type != "g5.8xlarge"),
        "{:?}",
        out.launched
    );
    let marked = avail.marked();
    assert!(
        ["z1", "z2", "z3"]
            .iter()
            .all(|z| marked.contains_key(&key("g5.8xlarge", z))),
        "{marked:?}"
    );
    // ... and the quota itself, from 32 vCPUs up, for the next runs.
    let others: Vec<&str> = marked
        .keys()
        .filter(|k| k.instance_type != "g5.8xlarge")
        .map(|k| k.instance_type.as_str())
        .collect();
    assert_eq!(others, ["quota:g-vt:32:32"], "{marked:?}");
}

/// A plan that stops `id`, kept stopped for `keep_s`.
fn stop_plan(id: &str, keep_s: f64) -> Plan {
    Plan {
        actions: vec![Action::Stop {
            worker: id.into(),
            keep_s,
            launched_at: LAUNCHED_AT,
            reason: Reason::KeepAliveExpired {
                idle_s: 900.0,
                keep_alive_s: 600.0,
            },
        }],
        ..Plan::default()
    }
}

/// When [`first_stopped`] stops its worker, unix seconds.
const STOPPED_AT: f64 = 100.0;

/// When [`idle_and_booting`] launches its workers, unix seconds.
const LAUNCHED_AT: f64 = 0.0;

/// A plan that starts stopped `id` of offering `offering` for project `p`, pinned to `job`; the
/// worker launched at [`LAUNCHED_AT`] and stopped at [`STOPPED_AT`].
fn start_plan(id: &str, offering: OfferingKey, job: Option<&str>) -> Plan {
    Plan {
        actions: vec![Action::Start {
            worker: id.into(),
            lane: 1,
            offering,
            price_usd_per_h: 0.10,
            request: LaunchShape {
                gpus: 1,
                min_gpu_memory_gib: 16.0,
                capacity: CapacityPreference::SpotFirst,
                runtime_s: 3600.0,
                max_cost_usd: None,
            },
            project: Some("p".into()),
            job: job.map(str::to_string),
            stopped_at: Some(STOPPED_AT),
            stopped_until: Some(STOPPED_AT + 3600.0),
            launched_at: LAUNCHED_AT,
            reason: Reason::UnmetBacklog { unmet_jobs: 1 },
        }],
        ..Plan::default()
    }
}

/// The context of a decision at `now` with nothing unavailable.
fn at<'a>(cfg: &'a PolicyConfig, offerings: &'a [Offering], now: f64) -> ActContext<'a> {
    ActContext {
        now,
        ..at_zero(cfg, offerings)
    }
}

#[test]
fn a_stop_marks_the_row_stopped_first_and_the_worker_comes_back_on_a_start() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ids = idle_and_booting(&fleet, &reg, &avail, &cfg);
    let out = pollster::block_on(act(
        &stop_plan(&ids[0], 3600.0),
        at(&cfg, &offs, 100.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.stopped, vec![ids[0].clone()]);
    assert!(out.terminated.is_empty());
    let row = reg.records()[&ids[0]].clone();
    // Stopped since now, kept until now + its keep; the instance stopped, not gone.
    assert_eq!(
        (row.state, row.idle_since, row.hold_until),
        (WorkerState::Stopped, Some(100.0), Some(3700.0))
    );
    assert!(fleet.stopped().contains_key(&ids[0]) && !fleet.running().contains_key(&ids[0]));
    // Its agent, about to take a job, is refused: the worker is on its way out.
    assert_eq!(reg.mark_busy(&ids[0], 101.0), Ok(false));
    // Started again for a job: Pending since the start, for the job's project, pinned, its old
    // heartbeat gone (its boot deadline counts from the start).
    let out = pollster::block_on(act(
        &start_plan(&ids[0], key("a.1", "z1"), Some("j-1")),
        at(&cfg, &offs, 500.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.started, vec![ids[0].clone()]);
    assert!(out.launched.is_empty());
    let row = reg.records()[&ids[0]].clone();
    assert_eq!(row.state, WorkerState::Pending);
    assert_eq!(row.launched_at, 500.0);
    assert_eq!(
        (row.project.as_deref(), row.pinned_job.as_deref()),
        (Some("p"), Some("j-1"))
    );
    assert_eq!((row.idle_since, row.hold_until, row.heartbeat_at), (None, None, None));
    assert!(fleet.running().contains_key(&ids[0]));
    assert_eq!(
        fleet
            .calls()
            .iter()
            .filter(|c| matches!(c, FleetCall::Start(_)))
            .count(),
        1
    );
}

#[test]
fn a_stop_the_provider_refuses_terminates_the_worker_and_one_racing_a_claim_is_left_alone() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ids = idle_and_booting(&fleet, &reg, &avail, &cfg);
    // A spot instance of a one-time request: EC2 will not stop it.
    fleet.set_unstoppable(&ids[0]);
    let out = pollster::block_on(act(
        &stop_plan(&ids[0], 3600.0),
        at(&cfg, &offs, 100.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert_eq!(out.terminated, vec![ids[0].clone()]);
    assert!(out.stopped.is_empty());
    assert_eq!(out.errors.len(), 1, "the refusal is named: {:?}", out.errors);
    assert!(out.errors[0].contains("UnsupportedOperation"), "{:?}", out.errors);
    assert_eq!(reg.records()[&ids[0]].state, WorkerState::Terminating);
    assert!(!fleet.running().contains_key(&ids[0]) && !fleet.stopped().contains_key(&ids[0]));
    // The second took a job since the decision: not stopped under it.
    reg.agent_heartbeat(&ids[1], WorkerState::Idle, Some(10.0), 10.0)
        .unwrap();
    assert_eq!(reg.mark_busy(&ids[1], 120.0), Ok(true));
    let before = fleet.calls().len();
    let out = pollster::block_on(act(
        &stop_plan(&ids[1], 3600.0),
        at(&cfg, &offs, 130.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert_eq!(out.skipped, vec![ids[1].clone()]);
    assert_eq!(fleet.calls().len(), before, "no stop call");
    assert_eq!(reg.records()[&ids[1]].state, WorkerState::Running);
}

/// [`idle_and_booting`], the first (idle) worker then stopped at 100 s, kept 3,600 s.
fn first_stopped(
    fleet: &FakeFleet,
    reg: &FakeRegistry,
    avail: &FakeAvailability,
    cfg: &PolicyConfig,
    offs: &[Offering],
) -> Vec<String> {
    let ids = idle_and_booting(fleet, reg, avail, cfg);
    pollster::block_on(act(
        &stop_plan(&ids[0], 3600.0),
        at(cfg, offs, STOPPED_AT),
        fleet,
        reg,
        avail,
    ));
    ids
}

#[test]
fn a_start_refused_while_the_instance_is_still_stopping_is_held_while_the_stop_is_recent() {
    let cfg = PolicyConfig::default();
    let offs = offerings();
    // A start beats a cold start while the stop began less than boot - restart ago.
    let hold_s = cfg.offers.boot_estimate_s - cfg.offers.restart_estimate_s;
    assert!(hold_s > 60.0, "{hold_s}");
    // A worker stopped at STOPPED_AT whose start (pinned to `job`) EC2 refuses at `now`.
    let refused_at = |fleet: &FakeFleet, job: Option<&str>, now: f64| {
        let (reg, avail) = (FakeRegistry::default(), FakeAvailability::default());
        let ids = first_stopped(fleet, &reg, &avail, &cfg, &offs);
        fleet.set_still_stopping(&ids[0]);
        let plan = start_plan(&ids[0], key("a.1", "z1"), job);
        let out = pollster::block_on(act(&plan, at(&cfg, &offs, now), fleet, &reg, &avail));
        (ids, out, reg, avail)
    };
    // Refused 60 s after the stop: held. Nothing launched, no error, the offering not marked,
    // the row Stopped again for the next decision to start.
    let fleet = FakeFleet::new();
    let (ids, out, reg, avail) = refused_at(&fleet, None, STOPPED_AT + 60.0);
    assert_eq!(out.held, vec![ids[0].clone()], "{out:?}");
    assert!(out.launched.is_empty() && out.started.is_empty(), "{out:?}");
    assert!(out.errors.is_empty() && out.capacity_errors.is_empty(), "{out:?}");
    assert!(avail.marked().is_empty());
    // Stopped since its stop and kept as before, so the next refusal is held by the same stop;
    // launched when it was, so the start that did not happen counts as no launch.
    let row = reg.records()[&ids[0]].clone();
    assert_eq!(
        (row.state, row.idle_since, row.hold_until, row.launched_at),
        (
            WorkerState::Stopped,
            Some(STOPPED_AT),
            Some(STOPPED_AT + 3600.0),
            LAUNCHED_AT
        )
    );
    assert!(fleet.stopped().contains_key(&ids[0]));
    let out = pollster::block_on(act(
        &start_plan(&ids[0], key("a.1", "z1"), None),
        at(&cfg, &offs, STOPPED_AT + 120.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert_eq!(out.held, vec![ids[0].clone()], "{out:?}");
    assert!(out.launched.is_empty(), "{out:?}");
    // Its stop over, the next decision's start goes through.
    fleet.set_stopped_fully(&ids[0]);
    let out = pollster::block_on(act(
        &start_plan(&ids[0], key("a.1", "z1"), None),
        at(&cfg, &offs, STOPPED_AT + 180.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert_eq!(out.started, vec![ids[0].clone()], "{out:?}");
    assert!(out.launched.is_empty() && out.held.is_empty(), "{out:?}");
    // Refused once the stop is older than boot - restart: a launch now is the faster bet.
    let fleet = FakeFleet::new();
    let (ids, out, reg, _) = refused_at(&fleet, None, STOPPED_AT + hold_s + 1.0);
    assert!(out.held.is_empty(), "{out:?}");
    assert_eq!(out.launched.len(), 1, "{out:?}");
    let row = reg.records()[&ids[0]].clone();
    assert_eq!(
        (row.state, row.idle_since, row.hold_until, row.launched_at),
        (
            WorkerState::Stopped,
            Some(STOPPED_AT),
            Some(STOPPED_AT + 3600.0),
            LAUNCHED_AT
        )
    );
    // A start pinned to a job (a deadline at risk) keeps its launch, however recent the stop.
    let fleet = FakeFleet::new();
    let (_, out, _, avail) = refused_at(&fleet, Some("j-1"), STOPPED_AT + 60.0);
    assert!(out.held.is_empty(), "{out:?}");
    assert_eq!(out.launched.len(), 1, "{out:?}");
    assert_eq!(out.launched[0].job.as_deref(), Some("j-1"));
    assert!(avail.marked().is_empty(), "not a capacity error");
    // So does a start whose stop time is unknown (a row a refused start already cleared).
    let fleet = FakeFleet::new();
    let (reg, avail) = (FakeRegistry::default(), FakeAvailability::default());
    let ids = first_stopped(&fleet, &reg, &avail, &cfg, &offs);
    fleet.set_still_stopping(&ids[0]);
    let mut plan = start_plan(&ids[0], key("a.1", "z1"), None);
    if let Some(Action::Start { stopped_at, .. }) = plan.actions.first_mut() {
        *stopped_at = None;
    }
    let out = pollster::block_on(act(&plan, at(&cfg, &offs, STOPPED_AT + 60.0), &fleet, &reg, &avail));
    assert!(out.held.is_empty(), "{out:?}");
    assert_eq!(out.launched.len(), 1, "{out:?}");
}

#[test]
fn a_start_of_a_stopped_worker_whose_instance_is_gone_retires_the_row_and_launches_instead() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ids = first_stopped(&fleet, &reg, &avail, &cfg, &offs);
    assert_eq!(reg.records()[&ids[0]].state, WorkerState::Stopped);
    // Ended while stopped, by someone else than this decision (EC2 then refuses a start:
    // `IncorrectInstanceState`, which the adapter reports as not-found once it sees it gone).
    pollster::block_on(onoff_control::ports::Fleet::terminate(
        &fleet,
        std::slice::from_ref(&ids[0]),
    ))
    .unwrap();
    let before = fleet.calls().len();
    let out = pollster::block_on(act(
        &start_plan(&ids[0], key("a.1", "z1"), Some("j-1")),
        at(&cfg, &offs, 500.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert!(out.started.is_empty());
    // Retired now, not left Stopped for the next decision to start again.
    assert_eq!(reg.records()[&ids[0]].state, WorkerState::Terminating);
    assert_eq!(out.terminated, vec![ids[0].clone()]);
    assert!(
        fleet.calls()[before..]
            .iter()
            .any(|c| matches!(c, FleetCall::Terminate(t) if t == &vec![ids[0].clone()])),
        "{:?}",
        fleet.calls()
    );
    // Not a capacity error: its offering stays available, and the job's capacity is launched there.
    assert!(out.capacity_errors.is_empty() && avail.marked().is_empty(), "{out:?}");
    assert_eq!(out.launched.len(), 1, "{out:?}");
    assert_eq!(out.launched[0].launched.offering, key("a.1", "z1"));
    assert_eq!(out.errors.len(), 1, "the refusal is named: {:?}", out.errors);
    assert!(
        out.errors[0].contains("terminated, launching instead"),
        "{:?}",
        out.errors
    );
}

#[test]
fn a_start_without_capacity_leaves_the_worker_stopped_marks_its_offering_and_launches_instead() {
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let ids = first_stopped(&fleet, &reg, &avail, &cfg, &offs);
    // No capacity for its type in its zone now: the start fails as a launch there would.
    fleet.set_no_capacity(key("a.1", "z1"));
    let out = pollster::block_on(act(
        &start_plan(&ids[0], key("a.1", "z1"), None),
        at(&cfg, &offs, 500.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert!(out.started.is_empty());
    assert_eq!(out.capacity_errors, vec![key("a.1", "z1")]);
    assert_eq!(
        avail.marked().get(&key("a.1", "z1")),
        Some(&(500.0 + cfg.offers.unavailable_ttl_s))
    );
    let row = reg.records()[&ids[0]].clone();
    assert_eq!((row.state, row.launched_at), (WorkerState::Stopped, LAUNCHED_AT));
    assert!(fleet.stopped().contains_key(&ids[0]));
    // Its capacity is launched from the next offering instead, for the same project.
    assert_eq!(out.launched.len(), 1, "{out:?}");
    assert_eq!(out.launched[0].launched.offering, key("a.1", "z2"));
    assert_eq!(out.launched[0].project.as_deref(), Some("p"));
    // A start of a worker that is gone (its row too) launches instead as well.
    let out = pollster::block_on(act(
        &start_plan("i-gone", key("a.1", "z2"), None),
        at(&cfg, &offs, 600.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert_eq!(out.skipped, vec!["i-gone".to_string()]);
    assert_eq!(out.launched.len(), 1, "{out:?}");
}

/// EC2 counts a started instance against its vCPU quota as it counts a launched one
/// (`VcpuLimitExceeded` / `MaxSpotInstanceCountExceeded` on StartInstances; stopped instances
/// count for nothing). A start refused for a full quota marks the quota as a launch's refusal
/// does, so the launch in its place goes straight to another bucket instead of meeting the same
/// refusal first.
#[test]
fn a_start_refused_for_a_full_vcpu_quota_marks_the_quota_and_launches_outside_it() {
    use onoff_control::quota::{QuotaBucket, QuotaMark};
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    // The standard types of `offerings()`, and one P type, a bucket of its own.
    let mut offs = offerings();
    offs.push(Offering {
        key: key("p.1", "z1"),
        price_usd_per_h: 0.50,
        ..offs[0].clone()
    });
    let ids = first_stopped(&fleet, &reg, &avail, &cfg, &offs);
    // The other worker (4 vCPUs, running) fills the standard spot quota: the stopped one had
    // room while it ran, none now.
    fleet.set_vcpu_quota(QuotaBucket::Standard, CapacityType::Spot, 4, &offs);
    let launches_before = launch_requests(&fleet).len();
    let out = pollster::block_on(act(
        &start_plan(&ids[0], key("a.1", "z1"), None),
        at(&cfg, &offs, 500.0),
        &fleet,
        &reg,
        &avail,
    ));
    assert!(out.started.is_empty(), "{out:?}");
    let row = reg.records()[&ids[0]].clone();
    assert_eq!((row.state, row.launched_at), (WorkerState::Stopped, LAUNCHED_AT));
    assert!(fleet.stopped().contains_key(&ids[0]));
    // The quota is marked for the next runs and named for the operator, once.
    let until = 500.0 + cfg.offers.unavailable_ttl_s;
    let mark = QuotaMark {
        bucket: QuotaBucket::Standard,
        capacity: CapacityType::Spot,
        vcpus: 4,
        until,
        // Both workers' 4 vCPUs counted as held, the stopped one's too (a ceiling errs high,
        // towards trying): types of 12 vCPUs or more never fit while the mark lasts.
        ceiling: Some(12),
    };
    assert_eq!(avail.marked().get(&mark.key()), Some(&until), "{:?}", avail.marked());
    assert_eq!(out.quotas_full.len(), 1, "{out:?}");
    assert!(
        out.errors
            .iter()
            .any(|e| e.contains(&format!("start {} on a.1", ids[0]))),
        "{:?}",
        out.errors
    );
    // Every standard spot offering is skipped, the refused one as a capacity error.
    for k in [key("a.1", "z1"), key("a.1", "z2"), key("b.1", "z1")] {
        assert_eq!(avail.marked().get(&k), Some(&until), "{k}");
    }
    assert_eq!(out.capacity_errors, vec![key("a.1", "z1")]);
    // One launch in its place, outside the full quota: no call spent on a sibling first.
    let launches: Vec<LaunchRequest> = launch_requests(&fleet).split_off(launches_before);
    assert_eq!(launches.len(), 1, "{launches:?}");
    assert_eq!(launches[0].offerings, vec![key("p.1", "z1")]);
    assert_eq!(out.launched.len(), 1, "{out:?}");
    assert_eq!(out.launched[0].launched.offering, key("p.1", "z1"));
}

#[test]
fn the_rows_of_workers_launched_or_started_carry_their_lanes_run_time_estimate() {
    // The default lanes: express (0) and standard (1). The launch and the start are for lane 1.
    let (fleet, reg, avail) = (FakeFleet::new(), FakeRegistry::default(), FakeAvailability::default());
    let cfg = PolicyConfig::default();
    let offs = offerings();
    let estimates = [("express".to_string(), 50.0), ("standard".to_string(), 420.0)];
    let ctx = ActContext {
        run_time_estimates: &estimates,
        ..at_zero(&cfg, &offs)
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 1), ctx, &fleet, &reg, &avail));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let id = out.launched[0].launched.instance_id.clone();
    assert_eq!(out.launched[0].run_time_estimate_s, Some(420.0));
    assert_eq!(
        reg.records()[&id].run_time_estimate_s,
        Some(420.0),
        "the launched lane's, not express's"
    );

    // A lane without an estimate: none on the row.
    let (fleet2, reg2) = (FakeFleet::new(), FakeRegistry::default());
    let express_only = [("express".to_string(), 50.0)];
    let ctx = ActContext {
        run_time_estimates: &express_only,
        ..at_zero(&cfg, &offs)
    };
    let out = pollster::block_on(act(&launch_plan(key("a.1", "z1"), 1), ctx, &fleet2, &reg2, &avail));
    let other = &out.launched[0].launched.instance_id;
    assert_eq!(reg2.records()[other].run_time_estimate_s, None);

    // Idle, stopped, then started when the lane's estimate has moved: the row takes the new one.
    reg.agent_heartbeat(&id, WorkerState::Idle, Some(10.0), 10.0).unwrap();
    let stopped = pollster::block_on(act(
        &stop_plan(&id, 3600.0),
        at(&cfg, &offs, STOPPED_AT),
        &fleet,
        &reg,
        &avail,
    ));
    assert_eq!(stopped.stopped, vec![id.clone()], "{:?}", stopped.errors);
    let moved = [("standard".to_string(), 75.0)];
    let ctx = ActContext {
        run_time_estimates: &moved,
        ..at(&cfg, &offs, 500.0)
    };
    let out = pollster::block_on(act(&start_plan(&id, key("a.1", "z1"), None), ctx, &fleet, &reg, &avail));
    assert_eq!(out.started, vec![id.clone()], "{:?}", out.errors);
    let row = reg.records()[&id].clone();
    assert_eq!((row.state, row.run_time_estimate_s), (WorkerState::Pending, Some(75.0)));
}
