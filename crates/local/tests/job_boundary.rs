//! A job is not the worker. Against a moto server of its own with IAM enforced and the roles
//! template.yaml gives (`onoff_local::iam::setup`): the worker role starts a job session as the
//! agent does (`sts:AssumeRole` on the job role with the job's session policy), and with that
//! session the job is refused writing the jobs table, deleting a queue message and terminating an
//! instance (moto refuses: the job role has none of those actions), and reading another job's
//! checkpoint (moto does not evaluate session policies: template.yaml's evaluation of the very
//! request the job made refuses it). An operator's cancel, as the CLI sends it, is what
//! template.yaml's `OperatorAccess` allows of the jobs table's rows, and no other update. The
//! agent's writes to a job's row over its whole lifecycle are what the worker role allows, and
//! name exactly the attributes it lists; a rewrite of what a job is, refused; likewise the
//! reconciler's (the functions' `StateAccess`), which also may not read a row back. And a
//! job process, run as its own user, gets nothing from the instance metadata service the agent
//! reads.

use std::collections::BTreeSet;
use std::path::PathBuf;

use aws_config::BehaviorVersion;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use aws_sdk_s3::config::{Credentials, Region, SharedCredentialsProvider};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use onoff_aws::settings::Clients;
use onoff_control::job::{AttemptEnd, AttemptRecord, JobState, OutputsRecord, RerunLimits, Settle};
use onoff_control::ports::{CancelOutcome, Claim, JobStore};

fn moto_program() -> PathBuf {
    std::env::var_os("ONOFF_MOTO_SERVER")
        .map(PathBuf::from)
        .or_else(onoff_local::moto::find_moto_server)
        .expect("moto server not found: run the tests with scripts/test.sh, which installs it")
}

async fn clients(endpoint: &str, creds: Credentials, log: Option<onoff_aws::record::CallRecorder>) -> Clients {
    let conf = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(SharedCredentialsProvider::new(creds))
        .load()
        .await;
    Clients::from_conf_recorded(&conf, log)
}

/// HTTP status of a call's answer: 200 for success, the error's status, 0 with none.
fn status<T, E>(r: &Result<T, aws_sdk_s3::error::SdkError<E, HttpResponse>>) -> u16 {
    match r {
        Ok(_) => 200,
        Err(e) => e.raw_response().map_or(0, |r| r.status().as_u16()),
    }
}

/// A moto server of its own (logging into `dir`) with a deployment's resources provisioned
/// under `prefix` and this process's id, by unrestricted setup clients; and the stack
/// template.yaml's policies are resolved for.
async fn provisioned(
    dir: &std::path::Path,
    prefix: &str,
) -> (
    onoff_local::moto::Moto,
    Clients,
    onoff_aws::settings::Resources,
    onoff_iam::Stack,
) {
    let moto = onoff_local::moto::Moto::start(&moto_program(), &dir.join("moto.log"))
        .await
        .expect("moto starts");
    let setup = clients(&moto.endpoint, Credentials::new("test", "test", None, None, "t"), None).await;
    let prefix = format!("{prefix}{}", std::process::id());
    let res = onoff_aws::provision::provision(
        &setup,
        &onoff_aws::provision::ProvisionOptions {
            prefix: prefix.clone(),
            lanes: vec!["standard".into()],
            max_receive_count: 5,
            visibility_timeout_s: 30,
            submission_visibility_timeout_s: 360,
            zones: Vec::new(),
        },
    )
    .await
    .expect("provision")
    .resources;
    let stack = onoff_local::iam::local_stack(&prefix, "123456789012", &res).expect("the template's lane queues");
    (moto, setup, res, stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_session_is_refused_what_is_not_its_own() {
    let dir = std::env::temp_dir().join(format!("onoff-job-boundary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut moto, _, res, stack) = provisioned(&dir, "jb").await;
    let endpoint = moto.endpoint.clone();
    let sessions = onoff_local::iam::setup(&endpoint, &stack).await.expect("IAM setup");
    let job_role = sessions.job_role_arn.clone().expect("template.yaml has a JobRole");

    // The agent's step: the worker role starts the job's session with its session policy.
    let worker = clients(&endpoint, sessions.worker.credentials(), None).await;
    let policy = onoff_control::boundary::job_session_policy("aws", &res.bucket, "job-1", None);
    let out = worker
        .sts
        .assume_role()
        .role_arn(&job_role)
        .role_session_name("job-1")
        .policy(policy.to_string())
        .duration_seconds(3600)
        .send()
        .await
        .expect("the worker role may start a job session");
    let c = out.credentials().expect("credentials");
    let job_creds = Credentials::new(
        c.access_key_id(),
        c.secret_access_key(),
        Some(c.session_token().to_string()),
        None,
        "job",
    );
    let log_path = dir.join("calls.jsonl");
    let log = onoff_aws::record::CallLog::open(&log_path).unwrap();
    let job = clients(&endpoint, job_creds, Some(log.recorder("job/job-1"))).await;

    // Its own checkpoint: allowed.
    let own = job
        .s3
        .put_object()
        .bucket(&res.bucket)
        .key("checkpoints/job-1/1/state.bin")
        .body(b"mine".to_vec().into())
        .send()
        .await;
    assert!(own.is_ok(), "a job writes its own checkpoint: {own:?}");

    // The jobs table, a queue message, an instance: refused by the emulator.
    let write = job
        .dynamodb
        .update_item()
        .table_name(&res.jobs_table)
        .key("job_id", aws_sdk_dynamodb::types::AttributeValue::S("job-1".into()))
        .update_expression("SET #s = :s")
        .expression_attribute_names("#s", "state")
        .expression_attribute_values(":s", aws_sdk_dynamodb::types::AttributeValue::S("SUCCEEDED".into()))
        .send()
        .await;
    assert_eq!(status(&write), 403, "a job may not write the jobs table: {write:?}");
    let delete = job
        .sqs
        .delete_message()
        .queue_url(res.queue_url("standard").unwrap())
        .receipt_handle("any")
        .send()
        .await;
    assert_eq!(status(&delete), 403, "a job may not delete a queue message: {delete:?}");
    let terminate = job
        .ec2
        .terminate_instances()
        .instance_ids("i-0123456789abcdef0")
        .send()
        .await;
    assert!(
        matches!(status(&terminate), 403 | 401),
        "a job may not terminate an instance: {terminate:?}"
    );

    // Another job's checkpoint: moto evaluates no session policy and lets it through, so the
    // request the job made is put to template.yaml's policies with its session policy.
    let _ = job
        .s3
        .get_object()
        .bucket(&res.bucket)
        .key("checkpoints/job-2/1/state.bin")
        .send()
        .await;
    onoff_local::iam::enforce(&endpoint, false).await.unwrap();
    moto.stop().await;
    let calls = onoff_iam::calls::parse_log(&std::fs::read_to_string(&log_path).unwrap());
    let auth = onoff_iam::eval::Authorizer::for_template(onoff_iam::TEMPLATE, &stack).unwrap();
    let caller = auth.job(policy).unwrap();
    let world = onoff_iam::calls::World::default();
    let verdict = |op: &str, key: &str| {
        let call = calls
            .iter()
            .find(|c| c.operation == op && c.uri.contains(key))
            .unwrap_or_else(|| panic!("the job's {op} of {key} was recorded"));
        let reqs = onoff_iam::calls::requests(call, &stack, &world).unwrap();
        auth.decide(&caller, &reqs[0]).unwrap()
    };
    assert!(verdict("PutObject", "checkpoints/job-1/").allowed());
    let other = verdict("GetObject", "checkpoints/job-2/");
    assert!(
        !other.allowed(),
        "another job's checkpoint must be refused by the session policy: {other:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Unix seconds the fixture's jobs are created at, and the tests' clock.
const NOW: f64 = 1_700_000_000.0;

/// A moto server of its own with a deployment provisioned, jobs created in its jobs table by
/// unrestricted setup clients, and a log of the calls made through [`JobRows::jobs_as`] and
/// [`JobRows::clients_as`], to put to template.yaml's policies once moto is stopped
/// ([`JobRows::stop`]).
struct JobRows {
    dir: PathBuf,
    moto: onoff_local::moto::Moto,
    res: onoff_aws::settings::Resources,
    stack: onoff_iam::Stack,
    /// The jobs table through the unrestricted setup clients (nothing recorded).
    table: onoff_aws::jobs::DynamoJobs,
    log: onoff_aws::record::CallLog,
    log_path: PathBuf,
}

impl JobRows {
    /// `ids` created as queued jobs at [`NOW`]; `name` names the run dir, `prefix` the deployment.
    async fn new(name: &str, prefix: &str, ids: &[&str]) -> Self {
        use onoff_control::ports::{JobRecord, JobStore};
        let dir = std::env::temp_dir().join(format!("onoff-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (moto, setup, res, stack) = provisioned(&dir, prefix).await;
        let table = onoff_aws::jobs::DynamoJobs::new(setup.dynamodb.clone(), &res.jobs_table);
        let spec: onoff_control::job::JobSpec =
            serde_json::from_str(r#"{"image":"img","command":["x"],"project":"p"}"#).unwrap();
        for id in ids {
            table
                .create(&JobRecord::new((*id).into(), spec.clone(), "test".into(), NOW))
                .await
                .unwrap();
        }
        let log_path = dir.join("calls.jsonl");
        let log = onoff_aws::record::CallLog::open(&log_path).unwrap();
        Self {
            dir,
            moto,
            res,
            stack,
            table,
            log,
            log_path,
        }
    }

    /// Clients whose calls are recorded as `principal`'s.
    async fn clients_as(&self, principal: &str) -> Clients {
        let creds = Credentials::new("test", "test", None, None, "t");
        clients(&self.moto.endpoint, creds, Some(self.log.recorder(principal))).await
    }

    /// The jobs table through the adapter the code uses, recorded as `principal`'s.
    async fn jobs_as(&self, principal: &str) -> onoff_aws::jobs::DynamoJobs {
        onoff_aws::jobs::DynamoJobs::new(self.clients_as(principal).await.dynamodb.clone(), &self.res.jobs_table)
    }

    /// An `UpdateItem` of job `id`'s row by `principal` that sets `attribute` (a string) and asks
    /// for `return_values`; moto applies it (it evaluates no conditions).
    async fn update_as(&self, principal: &str, id: &str, attribute: &str, return_values: ReturnValue) {
        let r = self
            .clients_as(principal)
            .await
            .dynamodb
            .update_item()
            .table_name(&self.res.jobs_table)
            .key("job_id", AttributeValue::S(id.into()))
            .update_expression("SET #a = :v")
            .expression_attribute_names("#a", attribute)
            .expression_attribute_values(":v", AttributeValue::S("x".into()))
            .return_values(return_values)
            .send()
            .await;
        assert!(r.is_ok(), "moto applies it: {r:?}");
    }

    /// Stop moto: the recorded calls, ready to be put to the template's policies.
    async fn stop(mut self) -> Recorded {
        self.moto.stop().await;
        Recorded {
            calls: onoff_iam::calls::parse_log(&std::fs::read_to_string(&self.log_path).unwrap()),
            auth: onoff_iam::eval::Authorizer::for_template(onoff_iam::TEMPLATE, &self.stack).unwrap(),
            stack: self.stack,
            dir: self.dir,
        }
    }
}

/// The calls a [`JobRows`] recorded, and template.yaml's policies resolved for its stack.
struct Recorded {
    calls: Vec<onoff_iam::calls::Call>,
    auth: onoff_iam::eval::Authorizer,
    stack: onoff_iam::Stack,
    dir: PathBuf,
}

impl Recorded {
    /// `principal`'s calls as the IAM requests they make.
    fn requests(&self, principal: &str) -> Vec<onoff_iam::eval::Request> {
        let world = onoff_iam::calls::World::default();
        self.calls
            .iter()
            .filter(|c| c.principal == principal)
            .flat_map(|c| onoff_iam::calls::requests(c, &self.stack, &world).unwrap())
            .collect()
    }

    /// Every one of `requests` is allowed to `caller` (`allow`), or every one refused; `what`
    /// names them in a failure.
    fn assert_all(
        &self,
        caller: &onoff_iam::eval::Caller,
        requests: &[onoff_iam::eval::Request],
        allow: bool,
        what: &str,
    ) {
        for r in requests {
            let allowed = self.auth.decide(caller, r).unwrap().allowed();
            assert_eq!(allowed, allow, "{what}: {}", shown(r));
        }
    }

    /// The `dynamodb:Attributes` that statement `sid` of `principal`'s policies allows.
    fn granted_attributes(&self, principal: onoff_iam::Principal, sid: &str) -> BTreeSet<String> {
        let policies = onoff_iam::identity_policies(onoff_iam::TEMPLATE, &self.stack, principal).unwrap();
        let statement = policies
            .iter()
            .flat_map(|d| d["Statement"].as_array().cloned().unwrap_or_default())
            .find(|s| s["Sid"] == sid)
            .unwrap_or_else(|| panic!("{principal:?} has no statement {sid}"));
        statement["Condition"]["ForAllValues:StringEquals"]["dynamodb:Attributes"]
            .as_array()
            .expect("a list of attributes")
            .iter()
            .map(|a| a.as_str().expect("a name").to_string())
            .collect()
    }

    /// The run dir goes once the test has passed (a failed one leaves it to look at).
    fn clean_up(self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A request's `dynamodb:Attributes` and `dynamodb:ReturnValues`, for messages.
fn shown(r: &onoff_iam::eval::Request) -> String {
    format!(
        "{} {:?} returning {:?}",
        r.action,
        r.context.get("dynamodb:Attributes"),
        r.context.get("dynamodb:ReturnValues")
    )
}

/// The attributes the `action` requests among `requests` name (`dynamodb:Attributes`).
fn named_attributes(requests: &[onoff_iam::eval::Request], action: &str) -> BTreeSet<String> {
    requests
        .iter()
        .filter(|r| r.action == action)
        .flat_map(|r| match r.context.get("dynamodb:Attributes") {
            Some(onoff_iam::eval::Value::Many(v)) => v.clone(),
            other => panic!("an update names its attributes: {other:?}"),
        })
        .collect()
}

/// An attempt of `job` on instance `i-1` that ended as `end` 100 s after [`NOW`].
fn attempt(job: &onoff_control::ports::JobRecord, end: &AttemptEnd) -> AttemptRecord {
    AttemptRecord {
        n: job.attempts,
        instance_id: "i-1".into(),
        instance_type: Some("g5.xlarge".into()),
        capacity_type: Some("spot".into()),
        price_usd_per_h: Some(0.4),
        started_at: NOW,
        ended_at: NOW + 100.0,
        outcome: end.name().into(),
        exit_code: None,
        signal: None,
        checkpoint: Some("checkpoints/x/1".into()),
        seconds: 100.0,
        cost_usd: 0.5,
    }
}

/// The operator's cancel, as the CLI's adapter sends it to a moto server, put to template.yaml's
/// `OperatorAccess` (moto evaluates no conditions): both of its updates (a waiting job ended, a
/// running one flagged) are allowed; an update of any other attribute, or one that reads the
/// row back, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_may_cancel_a_job_and_write_nothing_else_of_its_row() {
    let rows = JobRows::new("operator-boundary", "ob", &["job-a", "job-b"]).await;
    assert!(matches!(
        rows.table.claim("job-b", "i-1", NOW + 60.0, NOW).await.unwrap(),
        Claim::Claimed(_)
    ));
    let jobs = rows.jobs_as("operator/cli").await;
    assert_eq!(
        jobs.request_cancel("job-a", NOW).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        jobs.request_cancel("job-b", NOW).await.unwrap(),
        CancelOutcome::Requested
    );
    rows.update_as("operator/other", "job-b", "attempts", ReturnValue::None)
        .await;
    rows.update_as("operator/other", "job-b", "cancel_requested", ReturnValue::AllOld)
        .await;
    let rec = rows.stop().await;

    let operator = onoff_iam::eval::Caller {
        role_arn: "arn:aws:iam::123456789012:role/ml-operator".into(),
        identity: vec![onoff_iam::managed_policy(onoff_iam::TEMPLATE, &rec.stack, "OperatorAccess").unwrap()],
        session_policy: None,
        instance_arn: None,
    };
    let cancels = rec.requests("operator/cli");
    let updates = cancels.iter().filter(|r| r.action == "dynamodb:UpdateItem").count();
    assert!(updates >= 2, "{:?}", cancels.iter().map(shown).collect::<Vec<_>>());
    rec.assert_all(&operator, &cancels, true, "the CLI's cancel is allowed");
    let others = rec.requests("operator/other");
    assert_eq!(others.len(), 2, "{:?}", others.iter().map(shown).collect::<Vec<_>>());
    rec.assert_all(&operator, &others, false, "anything else is refused");
    rec.clean_up();
}

/// Every write the agent makes to a job's row, through the adapter it uses (`onoff_aws::jobs`)
/// against a moto server, over a claim, renewals, progress, each way an attempt ends, a cancel
/// while it runs and a wake-up stamp: all allowed to the worker role, naming exactly the
/// attributes its `JobLeases` statement lists. A rewrite of what a job is, refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_writes_only_the_lease_attributes_of_the_jobs_it_runs() {
    let ends = [
        ("job-ok", AttemptEnd::Succeeded),
        ("job-retry", AttemptEnd::Failed("exit 1".into())),
        ("job-fatal", AttemptEnd::Fatal("no such image".into())),
        ("job-notice", AttemptEnd::Released("spot interruption notice".into())),
        ("job-small", AttemptEnd::HandedBack("needs 8 GPUs".into())),
        ("job-deadline", AttemptEnd::Deferred("deadline at risk on spot".into())),
        ("job-cancel", AttemptEnd::Released("spot interruption notice".into())),
    ];
    let ids: Vec<&str> = ends.iter().map(|(id, _)| *id).collect();
    let rows = JobRows::new("worker-boundary", "wb", &ids).await;
    let jobs = rows.jobs_as("worker/agent").await;
    for (id, end) in &ends {
        let Claim::Claimed(job) = jobs.claim(id, "i-1", NOW + 60.0, NOW).await.unwrap() else {
            panic!("{id} is claimable");
        };
        jobs.renew(id, "i-1", NOW + 120.0).await.unwrap();
        jobs.record_progress(id, "i-1", Some("checkpoints/x/1"), 0.25)
            .await
            .unwrap();
        jobs.record_progress(id, "i-1", None, 0.25).await.unwrap();
        if *id == "job-cancel" {
            // The operator's cancel while it runs: the settle finds it and ends it CANCELLED.
            rows.table.request_cancel(id, NOW).await.unwrap();
        }
        let mut settle = Settle::of(&job, end, &RerunLimits::default());
        if !matches!(end, AttemptEnd::HandedBack(_) | AttemptEnd::Deferred(_)) {
            settle.attempt = Some(attempt(&job, end));
        }
        jobs.finish(id, "i-1", &settle, NOW + 100.0).await.unwrap();
        if !settle.to.is_final() && *id != "job-cancel" {
            // The wake-up message it sends for a job it puts back is stamped on the row.
            jobs.mark_sent(id, NOW + 100.0).await.unwrap();
        }
    }
    // What became of an attempt's outputs, after its settle.
    let outputs = OutputsRecord {
        attempt: 1,
        files: 2,
        error: None,
        at: NOW + 110.0,
    };
    jobs.record_outputs("job-ok", &outputs).await.unwrap();
    for (id, state) in [
        ("job-ok", JobState::Succeeded),
        ("job-retry", JobState::Retrying),
        ("job-fatal", JobState::Failed),
        ("job-notice", JobState::Queued),
        ("job-cancel", JobState::Cancelled),
    ] {
        assert_eq!(rows.table.get(id).await.unwrap().unwrap().state, state, "{id}");
    }
    // A claim of a job that is no longer claimable reads its state.
    assert!(matches!(
        jobs.claim("job-ok", "i-1", NOW + 60.0, NOW).await.unwrap(),
        Claim::NotClaimable(JobState::Succeeded)
    ));
    // A poison message's error record.
    jobs.record_error("sqs:m-1", "not a wake-up message", NOW)
        .await
        .unwrap();
    // What a worker must not do to a row: change what a job is.
    for attribute in ["spec", "project", "lane"] {
        rows.update_as("worker/other", "job-notice", attribute, ReturnValue::None)
            .await;
    }
    let rec = rows.stop().await;

    let worker = rec.auth.worker("i-1").unwrap();
    let agent = rec.requests("worker/agent");
    rec.assert_all(&worker, &agent, true, "the agent's writes are allowed");
    // Least privilege: the policy lists exactly the attributes the agent's updates name.
    assert_eq!(
        named_attributes(&agent, "dynamodb:UpdateItem"),
        rec.granted_attributes(onoff_iam::Principal::Worker, "JobLeases"),
        "granted to the worker and never written, or written and not granted"
    );
    assert_eq!(
        named_attributes(&agent, "dynamodb:PutItem"),
        rec.granted_attributes(onoff_iam::Principal::Worker, "ErrorRecords"),
        "an error record's attributes"
    );
    let others = rec.requests("worker/other");
    assert_eq!(others.len(), 3, "{:?}", others.iter().map(shown).collect::<Vec<_>>());
    rec.assert_all(&worker, &others, false, "a worker may not send it");
    rec.clean_up();
}

/// The reconciler's writes to a job's row (a lost lease ended, re-queued or, cancelled
/// meanwhile, CANCELLED; a wake-up stamped), recorded against a moto server: allowed to every
/// function (all hold `StateAccess`), naming exactly the attributes its `JobLifecycle`
/// statement lists. A rewrite of what a job is, or an update reading the row back, refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_ends_lost_leases_and_stamps_wake_ups_in_the_lifecycle_attributes_only() {
    let rows = JobRows::new("function-boundary", "fb", &["job-lost", "job-cancelled"]).await;
    let mut held = Vec::new();
    for id in ["job-lost", "job-cancelled"] {
        let Claim::Claimed(job) = rows.table.claim(id, "i-1", NOW + 60.0, NOW).await.unwrap() else {
            panic!("{id} is claimable");
        };
        held.push(job);
    }
    // Cancelled while its worker was gone: ending the lost lease ends the job.
    rows.table.request_cancel("job-cancelled", NOW).await.unwrap();
    let jobs = rows.jobs_as("function/reconciler").await;
    for job in &held {
        let end = AttemptEnd::LeaseLost("lease expired".into());
        let mut settle = Settle::of(job, &end, &RerunLimits::default());
        settle.attempt = Some(attempt(job, &end));
        jobs.requeue_lost(&job.id, "i-1", NOW + 60.0, &settle, NOW + 100.0)
            .await
            .unwrap();
    }
    jobs.mark_sent("job-lost", NOW + 100.0).await.unwrap();
    assert_eq!(
        rows.table.get("job-lost").await.unwrap().unwrap().state,
        JobState::Queued
    );
    assert_eq!(
        rows.table.get("job-cancelled").await.unwrap().unwrap().state,
        JobState::Cancelled
    );
    // What no function may do to a row: change what a job is, or read the row back in an update.
    rows.update_as("function/other", "job-lost", "spec", ReturnValue::None)
        .await;
    rows.update_as("function/other", "job-lost", "sent_at", ReturnValue::AllNew)
        .await;
    let rec = rows.stop().await;

    let ours = rec.requests("function/reconciler");
    let others = rec.requests("function/other");
    assert_eq!(others.len(), 2, "{:?}", others.iter().map(shown).collect::<Vec<_>>());
    for p in [
        onoff_iam::Principal::Scaler,
        onoff_iam::Principal::Reconciler,
        onoff_iam::Principal::Interruption,
        onoff_iam::Principal::Submit,
    ] {
        let caller = rec.auth.caller(p).unwrap();
        rec.assert_all(
            &caller,
            &ours,
            true,
            &format!("{p:?}: the reconciler's writes are allowed"),
        );
        rec.assert_all(&caller, &others, false, &format!("{p:?} may not send it"));
    }
    assert_eq!(
        named_attributes(&ours, "dynamodb:UpdateItem"),
        rec.granted_attributes(onoff_iam::Principal::Reconciler, "JobLifecycle"),
        "granted to the functions and never written, or written and not granted"
    );
    rec.clean_up();
}

/// Submit's writes to the jobs table, through the adapter it uses, recorded against a moto
/// server: a new job's row (and a repeat of the same submission, which finds it), an error record
/// and a wake-up stamp. Allowed to the submit role, naming exactly the attributes of its
/// `CreateJobsAndErrorRecords` statement; a row put with a lease, refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_creates_job_rows_only_as_admission_writes_them() {
    use onoff_control::ports::{Created, JobRecord};
    let rows = JobRows::new("submit-boundary", "sb", &[]).await;
    let jobs = rows.jobs_as("function/submit").await;
    let spec: onoff_control::job::JobSpec =
        serde_json::from_str(r#"{"image":"img","command":["x"],"project":"p"}"#).unwrap();
    let job = JobRecord::new("job-new".into(), spec, "s3://b/jobs/x.json@v1".into(), NOW);
    assert!(matches!(jobs.create(&job).await.unwrap(), Created::New));
    assert!(matches!(jobs.create(&job).await.unwrap(), Created::Existing(_)));
    jobs.record_error("s3://b/jobs/bad.json@v1", "gpus must be >= 1", NOW)
        .await
        .unwrap();
    jobs.mark_sent("job-new", NOW).await.unwrap();
    let other = rows.clients_as("function/other").await;
    let put = other
        .dynamodb
        .put_item()
        .table_name(&rows.res.jobs_table)
        .item("job_id", AttributeValue::S("job-leased".into()))
        .item("state", AttributeValue::S("RUNNING".into()))
        .item("lease_owner", AttributeValue::S("i-1".into()))
        .send()
        .await;
    assert!(put.is_ok(), "moto applies it: {put:?}");
    let rec = rows.stop().await;

    let submit = rec.auth.caller(onoff_iam::Principal::Submit).unwrap();
    let ours = rec.requests("function/submit");
    rec.assert_all(&submit, &ours, true, "submit's writes are allowed");
    assert_eq!(
        named_attributes(&ours, "dynamodb:PutItem"),
        rec.granted_attributes(onoff_iam::Principal::Submit, "CreateJobsAndErrorRecords"),
        "granted to submit and never written, or written and not granted"
    );
    let others = rec.requests("function/other");
    assert_eq!(others.len(), 1, "{:?}", others.iter().map(shown).collect::<Vec<_>>());
    rec.assert_all(&submit, &others, false, "submit may not send it");
    rec.clean_up();
}

#[tokio::test]
async fn a_job_run_as_its_own_user_gets_nothing_from_the_instance_metadata_service() {
    use onoff_local::imds::{ImdsServer, ImdsState};
    if !onoff_local::can_switch_user() {
        // Only root can start a process as another user (CI and onoff local on a worker run as
        // root); the refusal itself is tested in the IMDS's own tests.
        eprintln!("not root: a job cannot be started as another user here");
        return;
    }
    let imds = ImdsServer::start(ImdsState {
        instance_id: "i-1".into(),
        credentials: Some(("worker".into(), r#"{"AccessKeyId":"AKWORKER"}"#.into())),
        refuse_uid: Some(onoff_local::LOCAL_JOB_UID),
        ..ImdsState::default()
    })
    .await
    .unwrap();
    // The token request a metadata client starts with, from a shell as the job's user and as
    // this process's (the agent's).
    let script = format!(
        "exec 3<>/dev/tcp/{host}/{port} && printf 'PUT /latest/api/token HTTP/1.1\\r\\nHost: x\\r\\nx-aws-ec2-metadata-token-ttl-seconds: 60\\r\\nConnection: close\\r\\n\\r\\n' >&3 && cat <&3",
        host = "127.0.0.1",
        port = imds.endpoint.rsplit(':').next().unwrap()
    );
    let run = move |uid: Option<u32>| {
        let mut c = std::process::Command::new("bash");
        c.args(["-c", &script]);
        if let Some(u) = uid {
            use std::os::unix::process::CommandExt;
            c.uid(u).gid(u);
        }
        c.output().expect("bash runs")
    };
    let (as_job, as_agent) = tokio::task::spawn_blocking(move || (run(Some(onoff_local::LOCAL_JOB_UID)), run(None)))
        .await
        .unwrap();
    let agent_answer = String::from_utf8_lossy(&as_agent.stdout);
    assert!(
        agent_answer.starts_with("HTTP/1.1 200"),
        "the agent is served: {agent_answer}"
    );
    let job_answer = String::from_utf8_lossy(&as_job.stdout);
    assert!(
        !job_answer.contains("HTTP/1.1"),
        "the job's user must get no answer: {job_answer}"
    );
}

/// The events a function failed on, as a local run hands them to Lambda's dead-letter queue
/// (`onoff_local::lambda::DeadLetter::send`): each function's role may send them to the
/// failed-events queue (template.yaml's `FailedEvents` statement; on AWS Lambda sends them with
/// the function's execution role), the worker role may not; what arrives is the event unchanged
/// with Lambda's three attributes; and every send a function made is what template.yaml's
/// policies allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_functions_dead_letters_reach_the_failed_events_queue_under_its_role_only() {
    use onoff_iam::Principal;
    use onoff_local::lambda::DeadLetter;
    let dir = std::env::temp_dir().join(format!("onoff-dead-letters-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut moto, setup, _, stack) = provisioned(&dir, "dl").await;
    let endpoint = moto.endpoint.clone();
    let url = setup
        .sqs
        .get_queue_url()
        .queue_name(format!("{}-failed-events", stack.stack_name))
        .send()
        .await
        .expect("provision creates the failed-events queue")
        .queue_url
        .unwrap();
    let sessions = onoff_local::iam::setup(&endpoint, &stack).await.expect("IAM setup");
    let log_path = dir.join("calls.jsonl");
    let log = onoff_aws::record::CallLog::open(&log_path).unwrap();
    let letter = |function: Principal| DeadLetter {
        function,
        event: serde_json::json!({"id": format!("e-{}", function.as_str()), "detail": {"n": 1}}),
        request_id: format!("req-{}", function.as_str()),
        error_message: format!("{} failed", function.as_str()),
        invocations: 3,
    };
    let functions = [
        Principal::Scaler,
        Principal::Reconciler,
        Principal::Interruption,
        Principal::Submit,
    ];
    for p in functions {
        let session = &sessions.functions[p.as_str()];
        let c = clients(&endpoint, session.credentials(), Some(log.recorder(p.as_str()))).await;
        letter(p)
            .send(&c.sqs, &url)
            .await
            .unwrap_or_else(|e| panic!("{}'s role sends its dead letters: {e}", p.as_str()));
    }
    let worker = clients(&endpoint, sessions.worker.credentials(), None).await;
    let refused = letter(Principal::Worker).send(&worker.sqs, &url).await.unwrap_err();
    assert!(refused.contains("AccessDenied"), "the worker role may not: {refused}");

    // What arrived (read by the runner's role, as IAM is now enforced): one message per
    // function, the event its body, Lambda's attributes.
    let runner = clients(&endpoint, sessions.runner.credentials(), None).await;
    let mut got = std::collections::BTreeMap::new();
    loop {
        let out = runner
            .sqs
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        if out.messages().is_empty() {
            break;
        }
        for m in out.messages() {
            let attrs = m.message_attributes().unwrap();
            let attr = |k: &str| {
                let v = &attrs[k];
                (v.data_type().to_string(), v.string_value().unwrap().to_string())
            };
            got.insert(
                attr("RequestID").1,
                (
                    serde_json::from_str::<serde_json::Value>(m.body().unwrap()).unwrap(),
                    attr("ErrorCode"),
                    attr("ErrorMessage").1,
                ),
            );
        }
    }
    assert_eq!(got.len(), 4, "{got:?}");
    for p in functions {
        let l = letter(p);
        assert_eq!(
            got[&l.request_id],
            (l.event, ("Number".to_string(), "200".to_string()), l.error_message)
        );
    }
    onoff_local::iam::enforce(&endpoint, false).await.unwrap();
    moto.stop().await;

    // Each send, put to template.yaml's full policies: allowed to its function's role.
    let calls = onoff_iam::calls::parse_log(&std::fs::read_to_string(&log_path).unwrap());
    let auth = onoff_iam::eval::Authorizer::for_template(onoff_iam::TEMPLATE, &stack).unwrap();
    let world = onoff_iam::calls::World::default();
    for p in functions {
        let call = calls
            .iter()
            .find(|c| c.principal == p.as_str() && c.operation == "SendMessage")
            .unwrap_or_else(|| panic!("{}'s send was recorded", p.as_str()));
        let reqs = onoff_iam::calls::requests(call, &stack, &world).unwrap();
        assert_eq!(reqs.len(), 1);
        assert!(reqs[0].resource.ends_with("-failed-events"), "{}", reqs[0].resource);
        let caller = auth.caller(p).unwrap();
        assert!(auth.decide(&caller, &reqs[0]).unwrap().allowed(), "{}", p.as_str());
        // No other role of the template has the grant: the worker's is denied.
        assert!(!auth
            .decide(&auth.caller(Principal::Worker).unwrap(), &reqs[0])
            .unwrap()
            .allowed());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
