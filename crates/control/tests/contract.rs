//! The store contracts of `onoff_control::fake::contract`, run against the fakes (the moto tests
//! run the same against DynamoDB).

use onoff_control::fake::{contract, FakeJobs};

#[test]
fn a_write_to_the_fake_jobs_table_whose_answer_was_lost_is_taken_as_done_on_the_retry() {
    let jobs = FakeJobs::default();
    pollster::block_on(contract::lost_answers_are_taken_as_done(
        &jobs,
        || jobs.lose_next_answer(),
        "lost",
        1_700_000_000.0,
    ));
}

#[test]
fn the_fake_jobs_table_ends_a_waiting_job_only_as_it_was_read() {
    let jobs = FakeJobs::default();
    pollster::block_on(contract::a_waiting_job_is_failed_only_as_it_was_read(
        &jobs,
        || jobs.lose_next_answer(),
        "quota",
        1_700_000_000.0,
    ));
    assert_eq!(jobs.answers_lost(), 1);
}

#[test]
fn the_fake_workers_table_keeps_its_conditions_and_takes_retries_as_done() {
    let reg = onoff_control::fake::FakeRegistry::default();
    pollster::block_on(contract::worker_rows_keep_their_conditions(
        &reg,
        |id, state, idle_since, now| std::future::ready(reg.agent_heartbeat(&id, state, idle_since, now)),
        "i-0c0ffee000000000",
        1_700_000_000.0,
    ));
}

#[test]
fn the_fake_workers_table_records_an_agents_cached_projects_bounded() {
    let reg = onoff_control::fake::FakeRegistry::default();
    pollster::block_on(contract::cached_projects_are_recorded_bounded(
        &reg,
        |id, projects| std::future::ready(reg.set_cached_projects(&id, &projects)),
        "i-0cac4e0000000000",
        1_700_000_000.0,
    ));
}

#[test]
fn the_fake_fleet_answers_as_ec2() {
    let fleet = onoff_control::fake::FakeFleet::new();
    fleet.stops_take_time();
    let offering = onoff_policy::OfferingKey {
        instance_type: "g5.xlarge".into(),
        zone: "us-east-1a".into(),
        capacity_type: onoff_policy::CapacityType::OnDemand,
    };
    pollster::block_on(contract::fleet_answers_as_ec2(
        &fleet,
        |id| {
            fleet.set_stopped_fully(&id);
            std::future::ready(())
        },
        offering,
        "i-0123456789abcdef0",
    ));
}

#[test]
fn the_fake_unavailable_offerings_keep_the_latest_expiry() {
    let avail = onoff_control::fake::FakeAvailability::default();
    let key = onoff_policy::OfferingKey {
        instance_type: "g6.xlarge".into(),
        zone: "us-east-1c".into(),
        capacity_type: onoff_policy::CapacityType::Spot,
    };
    pollster::block_on(contract::unavailable_offerings_keep_the_latest_expiry(
        &avail,
        key,
        1_700_000_000.0,
    ));
}

#[test]
fn the_fake_lease_keeps_the_lease_contract() {
    use onoff_control::fake::FakeLease;
    pollster::block_on(async {
        contract::the_lease_admits_one_holder_until_it_expires_or_is_released(&FakeLease::default()).await;
        contract::the_latest_completed_runs_start_is_kept_and_only_raised(&FakeLease::default()).await;
        let lease = FakeLease::default();
        contract::scale_requests_join_the_pending_one_and_a_run_settles_only_what_it_saw(&lease, || {
            lease.lose_next_answer()
        })
        .await;
        contract::asked_jobs_are_kept_with_the_count_and_forgotten_by_id(&FakeLease::default()).await;
    });
}

#[test]
fn the_fake_jobs_table_lists_every_arrival_of_a_lane() {
    let jobs = FakeJobs::default();
    pollster::block_on(contract::arrivals_list_every_job_of_the_lane(
        &jobs,
        || std::future::ready(()),
        "arr",
        1_700_000_000.0,
    ));
}

#[test]
fn the_fake_jobs_table_lists_the_run_times_of_a_lanes_last_finishes() {
    let jobs = FakeJobs::default();
    pollster::block_on(contract::finished_run_times_are_the_lanes_latest(
        &jobs,
        || std::future::ready(()),
        "fin",
        "standard",
        1_700_000_000.0,
    ));
}

#[test]
fn the_fake_keeps_arrival_stats_over_what_was_read() {
    let store = onoff_control::fake::FakeAvailability::default();
    pollster::block_on(contract::arrival_stats_are_kept_over_what_was_read(&store, "standard"));
}
