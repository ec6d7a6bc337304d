//! The submit use case through the fakes: valid, invalid, resubmitted and half-failed submissions.

use onoff_control::fake::{FakeJobs, FakeQueue};
use onoff_control::job::{AttemptEnd, JobState, RerunLimits, Settle};
use onoff_control::ports::{Claim, JobStore, StoreError};
use onoff_control::reconcile::{reap_jobs, ReconcileOptions};
use onoff_control::submit::{job_id_of, submit, Source, SubmitError, Submitted};
use std::collections::BTreeSet;

const LANES: &[&str] = &["express", "standard"];
const NOW: f64 = 1_700_000_000.0;
const GOOD: &str = r#"{"image":"img","command":["python","train.py"],"project":"vision","gpus":2}"#;

fn s3(key: &str, etag: &str) -> Source {
    Source::S3 {
        bucket: "b".into(),
        key: key.into(),
        etag: etag.into(),
        version: None,
    }
}

#[test]
fn a_valid_spec_becomes_one_queued_job_and_one_message() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let got = pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap();
    let Submitted::New(id) = got else { panic!("{got:?}") };
    let recs = jobs.records();
    assert_eq!(recs.len(), 1);
    let r = &recs[&id];
    assert_eq!(
        (r.state, r.sent_at, r.spec.gpus, r.source.as_str()),
        (JobState::Queued, Some(NOW), 2, "s3://b/jobs/a.json#e1")
    );
    assert_eq!(
        queue.sent(),
        vec![(
            "standard".to_string(),
            format!(r#"{{"gpus":2,"job_id":"{id}","sent_at":1700000000.0}}"#)
        )]
    );
}

#[test]
fn the_same_object_or_token_twice_is_one_job_and_one_message() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let a = pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap();
    let b = pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap();
    assert!(matches!(a, Submitted::New(_)) && matches!(b, Submitted::Existing(_)));
    // New bytes (new ETag) are a new job.
    pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e2"), LANES, NOW, &jobs, &queue)).unwrap();
    // A client token makes the source irrelevant.
    let tok = r#"{"image":"img","command":["x"],"project":"vision","client_token":"run-7"}"#;
    pollster::block_on(submit(
        tok,
        &Source::Sqs {
            message_id: "m1".into(),
        },
        LANES,
        NOW,
        &jobs,
        &queue,
    ))
    .unwrap();
    pollster::block_on(submit(tok, &s3("jobs/b.json", "e9"), LANES, NOW, &jobs, &queue)).unwrap();
    assert_eq!(jobs.records().len(), 3);
    assert_eq!(queue.sent().len(), 3);
}

#[test]
fn a_bad_spec_leaves_an_error_record_and_nothing_else() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let bad = r#"{"image":"img","command":"rm -rf /","project":"p"}"#;
    let err = pollster::block_on(submit(bad, &s3("jobs/bad.json", "e"), LANES, NOW, &jobs, &queue)).unwrap_err();
    let SubmitError::Rejected { reason, .. } = &err else {
        panic!("{err:?}")
    };
    assert!(reason.contains("argv array"), "{reason}");
    assert!(jobs.records().is_empty());
    assert!(queue.sent().is_empty());
    assert_eq!(jobs.errors().get("s3://b/jobs/bad.json#e"), Some(reason));
}

#[test]
fn a_failed_send_still_submits_the_job_and_the_reaper_sends_its_message() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    queue.fail_next("AWS.SimpleQueueService.NonExistentQueue");
    let got = pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap();
    let Submitted::Unsent { id, new: true, reason } = &got else {
        panic!("{got:?}")
    };
    assert!(reason.contains("NonExistentQueue"), "{reason}");
    assert!(got.is_new());
    let rec = jobs.records()[id].clone();
    assert_eq!((rec.state, rec.sent_at), (JobState::Queued, None));
    assert!(queue.sent().is_empty());
    // The reconciler's next run sends the message the submission could not.
    let snapshot = pollster::block_on(jobs.active()).unwrap().items;
    let opts = ReconcileOptions::default();
    pollster::block_on(reap_jobs(&snapshot, &BTreeSet::new(), &opts, NOW + 60.0, &jobs, &queue));
    assert_eq!(
        queue.sent(),
        vec![(
            "standard".to_string(),
            format!(r#"{{"gpus":2,"job_id":"{id}","sent_at":1700000060.0}}"#)
        )]
    );
    assert_eq!(jobs.records()[id].sent_at, Some(NOW + 60.0));
    // A redelivery of the same submission finds the job sent: nothing more.
    let again = pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap();
    assert_eq!(again, Submitted::Existing(id.clone()));
    assert_eq!(queue.sent().len(), 1);
    // A store failure before the row is written is retryable: nothing was made.
    jobs.fail_next(StoreError::Other("ProvisionedThroughputExceeded".into()));
    let err = pollster::block_on(submit(GOOD, &s3("jobs/c.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap_err();
    assert!(matches!(err, SubmitError::Retryable { .. }));
    assert_eq!(jobs.records().len(), 1);
}

/// A submission the queue's redrive policy dead-letters (every receive failed) made no job: a
/// dead-letter queue redrive, which sends the body again under a new message id, makes exactly
/// one. And a submission that made a job is never failed back to SQS, so its redrive cannot
/// make a second (the send failing on every try included).
#[test]
fn a_dead_lettered_submission_made_no_job_so_its_redrive_under_a_new_message_id_makes_one() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let sqs = |id: &str| Source::Sqs { message_id: id.into() };
    // maxReceiveCount receives of message m1, each refused by the table before a row is written.
    for _ in 0..5 {
        jobs.fail_next(StoreError::Other("ProvisionedThroughputExceeded".into()));
        let err = pollster::block_on(submit(GOOD, &sqs("m1"), LANES, NOW, &jobs, &queue)).unwrap_err();
        assert!(matches!(err, SubmitError::Retryable { .. }), "{err:?}");
    }
    assert!(jobs.records().is_empty());
    // The redrive: the same body, message id m2.
    let got = pollster::block_on(submit(GOOD, &sqs("m2"), LANES, NOW + 900.0, &jobs, &queue)).unwrap();
    assert!(matches!(got, Submitted::New(_)), "{got:?}");
    assert_eq!(jobs.records().len(), 1);
    // Message m3's row is written but its send fails on each receive: the first receive is a
    // success already (nothing for SQS to redeliver or dead-letter), and the one job it made is
    // all there is.
    queue.fail_next("ServiceUnavailable");
    let got = pollster::block_on(submit(GOOD, &sqs("m3"), LANES, NOW, &jobs, &queue)).unwrap();
    assert!(matches!(got, Submitted::Unsent { new: true, .. }), "{got:?}");
    assert_eq!(jobs.records().len(), 2);
}

/// `job_id_of` names the job `submit` makes of the same text and source, without the rules: with
/// and without a `client_token`, from SQS and S3. `onoff dead-letters` looks a dead-lettered
/// submission's job up by it, for the case where the job was written and its answer lost.
#[test]
fn job_id_of_names_the_job_submit_makes_of_the_same_message() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let sqs = |id: &str| Source::Sqs { message_id: id.into() };
    let tokened = r#"{"image":"img","command":["true"],"project":"vision","client_token":"t-7"}"#;
    let nulled = r#"{"image":"img","command":["true"],"project":"vision","client_token":null}"#;
    for (text, source) in [
        (GOOD, sqs("m1")),
        (tokened, sqs("m2")),
        (nulled, sqs("m3")),
        (GOOD, s3("jobs/a.json", "e1")),
        (tokened, s3("jobs/b.json", "e2")),
    ] {
        let got = pollster::block_on(submit(text, &source, LANES, NOW, &jobs, &queue)).unwrap();
        assert_eq!(
            job_id_of(text, &source).as_deref(),
            Some(got.id()),
            "{text} from {source:?}"
        );
    }
    // A token names one job whatever message carries it; without one, each message is its own.
    assert_eq!(job_id_of(tokened, &sqs("m9")), job_id_of(tokened, &sqs("m2")));
    assert_ne!(job_id_of(GOOD, &sqs("m9")), job_id_of(GOOD, &sqs("m1")));
    assert_eq!(jobs.records().len(), 4);
    // No project string, a token that is not a string, not JSON: no spec submit takes, no id.
    for text in [
        r#"{"image":"img","command":["true"]}"#,
        r#"{"image":"img","command":["true"],"project":7}"#,
        r#"{"image":"img","command":["true"],"project":"vision","client_token":7}"#,
        "not json",
    ] {
        assert_eq!(job_id_of(text, &sqs("m1")), None, "{text}");
    }
}

#[test]
fn a_claimed_job_cannot_be_claimed_again_until_the_reaper_ends_its_lease() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let Submitted::New(id) = pollster::block_on(submit(GOOD, &s3("k", "e"), LANES, NOW, &jobs, &queue)).unwrap() else {
        panic!()
    };
    let a = pollster::block_on(jobs.claim(&id, "i-a", NOW + 300.0, NOW)).unwrap();
    assert!(matches!(a, Claim::Claimed(ref r) if r.attempts == 1 && r.lease_owner.as_deref() == Some("i-a")));
    let b = pollster::block_on(jobs.claim(&id, "i-b", NOW + 300.0, NOW + 10.0)).unwrap();
    assert_eq!(b, Claim::NotClaimable(JobState::Running));
    // Expired, but still RUNNING: only the reaper's conditional re-queue frees it, so every lost
    // lease is counted.
    let c = pollster::block_on(jobs.claim(&id, "i-b", NOW + 900.0, NOW + 301.0)).unwrap();
    assert_eq!(c, Claim::NotClaimable(JobState::Running));
    let seen = jobs.records()[&id].clone();
    let settle = Settle::of(&seen, &AttemptEnd::LeaseLost("expired".into()), &RerunLimits::default());
    pollster::block_on(jobs.requeue_lost(&id, "i-a", NOW + 300.0, &settle, NOW + 301.0)).unwrap();
    let c = pollster::block_on(jobs.claim(&id, "i-b", NOW + 900.0, NOW + 302.0)).unwrap();
    assert!(
        matches!(c, Claim::Claimed(ref r) if r.attempts == 1 && r.lease_expiries == 1),
        "{c:?}"
    );
    pollster::block_on(jobs.transition(&id, JobState::Running, JobState::Succeeded)).unwrap();
    assert_eq!(
        pollster::block_on(jobs.claim(&id, "i-c", NOW + 2000.0, NOW + 1000.0)).unwrap(),
        Claim::NotClaimable(JobState::Succeeded)
    );
    assert!(matches!(
        pollster::block_on(jobs.transition(&id, JobState::Running, JobState::Failed)),
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        pollster::block_on(jobs.claim("job-nope", "i-c", 0.0, 0.0)).unwrap(),
        Claim::Unknown
    );
}

#[test]
fn concurrent_claims_of_one_job_give_one_claim() {
    let (jobs, queue) = (std::sync::Arc::new(FakeJobs::default()), FakeQueue::default());
    let Submitted::New(id) = pollster::block_on(submit(GOOD, &s3("race", "e"), LANES, NOW, &*jobs, &queue)).unwrap()
    else {
        panic!()
    };
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let (jobs, id) = (jobs.clone(), id.clone());
            std::thread::spawn(move || {
                pollster::block_on(jobs.claim(&id, &format!("i-{i}"), NOW + 300.0, NOW)).unwrap()
            })
        })
        .collect();
    let claimed = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|c| matches!(c, Claim::Claimed(_)))
        .count();
    assert_eq!(claimed, 1);
}

#[test]
fn only_the_lease_holder_records_progress() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let Submitted::New(id) = pollster::block_on(submit(GOOD, &s3("p", "e"), LANES, NOW, &jobs, &queue)).unwrap() else {
        panic!()
    };
    pollster::block_on(jobs.claim(&id, "i-a", NOW + 300.0, NOW)).unwrap();
    pollster::block_on(jobs.record_progress(&id, "i-a", Some("checkpoints/x/00000000000000000001/"), 0.25)).unwrap();
    // The cost so far is a value: the latest write's, not a sum of writes.
    pollster::block_on(jobs.record_progress(&id, "i-a", None, 0.75)).unwrap();
    pollster::block_on(jobs.record_progress(&id, "i-a", None, 0.75)).unwrap();
    let err = pollster::block_on(jobs.record_progress(&id, "i-b", Some("checkpoints/x/2/"), 9.0)).unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)));
    let r = pollster::block_on(jobs.get(&id)).unwrap().unwrap();
    assert_eq!(
        r.last_checkpoint.as_deref(),
        Some("checkpoints/x/00000000000000000001/")
    );
    assert!((r.cost_usd - 0.75).abs() < 1e-9);
}

fn s3_version(etag: &str, version: &str) -> Source {
    Source::S3 {
        bucket: "b".into(),
        key: "jobs/v.json".into(),
        etag: etag.into(),
        version: Some(version.into()),
    }
}

#[test]
fn each_object_version_is_its_own_job_and_the_same_version_twice_is_one() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let a = pollster::block_on(submit(GOOD, &s3_version("e1", "v1"), LANES, NOW, &jobs, &queue)).unwrap();
    let again = pollster::block_on(submit(GOOD, &s3_version("e1", "v1"), LANES, NOW, &jobs, &queue)).unwrap();
    // The same bytes put again: a new version, a new submission.
    let b = pollster::block_on(submit(GOOD, &s3_version("e1", "v2"), LANES, NOW, &jobs, &queue)).unwrap();
    let (Submitted::New(a), Submitted::Existing(again), Submitted::New(b)) = (a, again, b) else {
        panic!()
    };
    assert_eq!(a, again);
    assert_ne!(a, b);
    assert_eq!(jobs.records()[&a].source, "s3://b/jobs/v.json?versionId=v1#e1");
}

#[test]
fn a_spec_over_the_size_cap_gets_an_error_record_and_nothing_else() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let big = format!(
        r#"{{"image":"img","command":["x","{}"],"project":"p"}}"#,
        "y".repeat(300_000)
    );
    let src = Source::Sqs { message_id: "m".into() };
    let err = pollster::block_on(submit(&big, &src, LANES, NOW, &jobs, &queue)).unwrap_err();
    let SubmitError::Rejected { reason, .. } = &err else {
        panic!("{err:?}")
    };
    assert!(reason.contains("the limit is 262144 bytes"), "{reason}");
    assert_eq!(jobs.errors().get("sqs:m"), Some(reason));
    assert!(jobs.records().is_empty() && queue.sent().is_empty());
}

#[test]
fn a_store_validation_error_gets_an_error_record_but_throttling_is_retryable() {
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    jobs.fail_next(StoreError::Invalid(
        "ValidationException: Item size has exceeded the maximum allowed size".into(),
    ));
    let err = pollster::block_on(submit(GOOD, &s3("jobs/a.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap_err();
    let SubmitError::Rejected { reason, .. } = &err else {
        panic!("{err:?}")
    };
    assert!(reason.contains("Item size has exceeded"), "{reason}");
    assert_eq!(jobs.errors().get("s3://b/jobs/a.json#e1"), Some(reason));
    assert!(jobs.records().is_empty() && queue.sent().is_empty());
    jobs.fail_next(StoreError::Other("ThrottlingException: Rate exceeded".into()));
    let err = pollster::block_on(submit(GOOD, &s3("jobs/b.json", "e1"), LANES, NOW, &jobs, &queue)).unwrap_err();
    assert!(matches!(err, SubmitError::Retryable { .. }), "{err:?}");
    assert_eq!(jobs.errors().len(), 1);
}

#[test]
fn an_admission_rejects_jobs_no_allowed_instance_can_run_and_unknown_lanes() {
    use onoff_control::submit::Admission;
    use onoff_policy::{CapacityType, Offering, OfferingKey, PolicyConfig};
    let offering = |ty: &str, gpus: u32, mem: f64| Offering {
        key: OfferingKey {
            instance_type: ty.into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::OnDemand,
        },
        gpus,
        gpu_model: "NVIDIA A10G".into(),
        gpu_memory_gib: mem,
        vcpus: 4 * gpus,
        price_usd_per_h: gpus as f64,
        interruption: None,
    };
    let offerings = [offering("g5.xlarge", 1, 24.0), offering("g5.12xlarge", 4, 24.0)];
    let policy = PolicyConfig::default();
    let rules = Admission {
        policy: &policy,
        offerings: &offerings,
    };
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let cases = [
        (r#""gpus":4"#, None),
        (
            r#""gpus":8"#,
            Some("job spec field gpus: 8: the largest allowed instance has 4 GPUs (g5.12xlarge)"),
        ),
        (
            r#""min_gpu_memory_gib":48"#,
            Some("48 GiB per GPU is more than any allowed instance"),
        ),
        (
            r#""lane":"gold""#,
            Some("unknown lane \"gold\"; lanes: express, standard"),
        ),
    ];
    for (i, (field, want)) in cases.into_iter().enumerate() {
        let spec = format!(r#"{{"image":"img","command":["x"],"project":"p",{field}}}"#);
        let src = Source::Sqs {
            message_id: format!("m{i}"),
        };
        let got = pollster::block_on(submit(&spec, &src, &rules, NOW, &jobs, &queue));
        match want {
            None => assert!(matches!(got, Ok(Submitted::New(_))), "{field}: {got:?}"),
            Some(want) => {
                let reason = jobs.errors().get(&src.describe()).cloned().unwrap_or_default();
                assert!(
                    matches!(got, Err(SubmitError::Rejected { .. })) && reason.contains(want),
                    "{field}: {got:?}, {reason}"
                );
            }
        }
    }
    assert_eq!(jobs.records().len(), 1);
}

/// A reason may quote the spec, and a spec may take 256 KiB: an unknown lane of 130,000
/// characters that `{:?}` writes as 6-byte escapes (780 KB quoted, over DynamoDB's 400 KB item
/// limit), and an unknown field named by 200,000 characters. Each is rejected with an error
/// record, not retried into the dead-letter queue; the reason is cut to `MAX_REASON_BYTES`, and
/// the lane's still names the lanes there are.
#[test]
fn a_reason_quoting_a_huge_field_is_cut_and_recorded() {
    use onoff_control::job::MAX_REASON_BYTES;
    use onoff_control::submit::MAX_SPEC_BYTES;
    let (jobs, queue) = (FakeJobs::default(), FakeQueue::default());
    let lane = "\u{85}".repeat(130_000);
    let field = "x".repeat(200_000);
    let cases = [
        (
            format!(r#"{{"image":"img","command":["x"],"project":"p","lane":"{lane}"}}"#),
            "; lanes: express, standard",
        ),
        (
            format!(r#"{{"image":"img","command":["x"],"project":"p","{field}":1}}"#),
            "job spec is not valid JSON for a job: unknown field `xxx",
        ),
    ];
    for (i, (spec, want)) in cases.iter().enumerate() {
        assert!(spec.len() as u64 <= MAX_SPEC_BYTES, "{}", spec.len());
        let src = Source::Sqs {
            message_id: format!("m{i}"),
        };
        let err = pollster::block_on(submit(spec, &src, LANES, NOW, &jobs, &queue)).unwrap_err();
        let SubmitError::Rejected { reason, .. } = &err else {
            panic!("{}", err.to_string().chars().take(300).collect::<String>())
        };
        assert!(reason.len() <= MAX_REASON_BYTES, "case {i}: {} bytes", reason.len());
        assert!(reason.contains(want), "case {i}: {reason}");
        assert_eq!(jobs.errors().get(&src.describe()), Some(reason));
    }
    assert!(jobs.records().is_empty() && queue.sent().is_empty());
}
