//! The trust boundary of template.yaml, evaluated as IAM would (`onoff_iam::eval`): what a job,
//! a worker, each function and a submitter may and may not do, including the conditions moto
//! does not evaluate (`dynamodb:LeadingKeys`, `ec2:ResourceTag`, `ec2:SourceInstanceARN`,
//! `s3:prefix`, `aws:PrincipalArn`), session policies and the bucket and queue policies.
//!
//! The stack: `st` in us-east-1 of account 123456789012, workers in subnet-0a and subnet-0b.

use onoff_iam::eval::{Authorizer, Caller, Decision, Request};
use onoff_iam::{Principal, Stack, TEMPLATE};

const ACCOUNT: &str = "123456789012";
const BUCKET: &str = "st-123456789012-us-east-1";
const LT: &str = "lt-0123456789abcdef0";

fn stack_with(params: &[(&str, &str)]) -> Stack {
    let mut s = Stack {
        partition: "aws".into(),
        region: "us-east-1".into(),
        account: ACCOUNT.into(),
        stack_name: "st".into(),
        ..Stack::default()
    };
    let q = |name: &str| format!("https://sqs.us-east-1.amazonaws.com/{ACCOUNT}/{name}");
    let qarn = |name: &str| format!("arn:aws:sqs:us-east-1:{ACCOUNT}:{name}");
    for (logical, name) in [
        ("ExpressQueue", "st-express"),
        ("StandardQueue", "st-standard"),
        ("SubmissionQueue", "st-submissions"),
        ("FailedEventsQueue", "st-failed-events"),
    ] {
        s.refs.insert(logical.into(), q(name));
        s.atts.insert(format!("{logical}.Arn"), qarn(name));
    }
    for (logical, name) in [
        ("JobsTable", "st-jobs"),
        ("WorkersTable", "st-worker-rows"),
        ("ControlTable", "st-control"),
    ] {
        s.refs.insert(logical.into(), name.into());
        s.atts.insert(
            format!("{logical}.Arn"),
            format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/{name}"),
        );
    }
    s.refs.insert("Bucket".into(), BUCKET.into());
    s.atts.insert("Bucket.Arn".into(), format!("arn:aws:s3:::{BUCKET}"));
    s.refs.insert("WorkerLaunchTemplate".into(), LT.into());
    s.atts.insert("WorkerSecurityGroup.GroupId".into(), "sg-0w".into());
    for p in Principal::ALL {
        s.atts.insert(
            format!("{}.Arn", p.role_logical_id()),
            format!("arn:aws:iam::{ACCOUNT}:role/st-{}", p.as_str()),
        );
        s.refs.insert(p.role_logical_id().into(), format!("st-{}", p.as_str()));
    }
    for l in ["Scaler", "Reconciler", "Interruption", "Submit", "Worker"] {
        s.atts.insert(
            format!("{l}LogGroup.Arn"),
            format!("arn:aws:logs:us-east-1:{ACCOUNT}:log-group:{l}:*"),
        );
    }
    s.params.insert("WorkerSubnets".into(), "subnet-0a,subnet-0b".into());
    s.params.insert(
        "WorkerImageUri".into(),
        format!("{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/team/onoff-worker:7"),
    );
    s.params.insert("WorkerVpcId".into(), "vpc-0".into());
    for (k, v) in params {
        s.params.insert((*k).into(), (*v).into());
    }
    s
}

fn authorizer() -> Authorizer {
    Authorizer::for_template(TEMPLATE, &stack_with(&[])).expect("the template resolves")
}

fn allowed(a: &Authorizer, c: &Caller, r: &Request) -> bool {
    a.decide(c, r)
        .unwrap_or_else(|e| panic!("{} {}: {e}", r.action, r.resource))
        .allowed()
}

#[track_caller]
fn assert_allowed(a: &Authorizer, c: &Caller, r: Request) {
    let d = a.decide(c, &r).unwrap();
    assert_eq!(d, Decision::Allow, "{} on {} by {}", r.action, r.resource, c.role_arn);
}

#[track_caller]
fn assert_denied(a: &Authorizer, c: &Caller, r: Request) {
    let d = a.decide(c, &r).unwrap();
    assert!(
        !d.allowed(),
        "{} on {} by {} must be denied",
        r.action,
        r.resource,
        c.role_arn
    );
}

fn obj(key: &str) -> String {
    format!("arn:aws:s3:::{BUCKET}/{key}")
}

fn instance(id: &str) -> String {
    format!("arn:aws:ec2:us-east-1:{ACCOUNT}:instance/{id}")
}

/// A write to job `key`'s row in the jobs table, as `onoff_iam::calls` describes one: `action`
/// (`dynamodb:PutItem`, `dynamodb:UpdateItem`), the attributes it names and its return values.
fn job_row_write(action: &str, key: &str, attributes: &[&str], return_values: &str) -> Request {
    Request::new(action, &format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-jobs"))
        .with_many("dynamodb:LeadingKeys", &[key])
        .with_many("dynamodb:Attributes", attributes)
        .with("dynamodb:ReturnValues", return_values)
}

fn job_caller(a: &Authorizer, job: &str, input: Option<&str>) -> Caller {
    // The session policy the agent passes to sts:AssumeRole for this job, as the text it sends.
    let policy = onoff_control::boundary::job_session_policy("aws", BUCKET, job, input.map(|k| (BUCKET, k)));
    let text = onoff_control::boundary::session_policy_text(&policy).expect("STS takes it");
    a.job(serde_json::from_str(&text).unwrap())
        .expect("the template has a job role")
}

// ---- a job ------------------------------------------------------------------------------------

#[test]
fn a_jobs_input_is_the_one_object_its_key_names() {
    let a = authorizer();
    // IAM reads `*` and `?` in a Resource as wildcards: the key's own are written as literals.
    let job = job_caller(&a, "job-1", Some("inputs/a*?.bin"));
    assert_allowed(&a, &job, Request::new("s3:GetObject", &obj("inputs/a*?.bin")));
    for other in [
        "inputs/a.bin",
        "inputs/ab.bin",
        "inputs/anything-else-x.bin",
        "inputs/a*x.bin",
    ] {
        assert_denied(&a, &job, Request::new("s3:GetObject", &obj(other)));
    }
    let job = job_caller(&a, "job-2", Some("inputs/${aws:username}/data.bin"));
    assert_allowed(
        &a,
        &job,
        Request::new("s3:GetObject", &obj("inputs/${aws:username}/data.bin")),
    );
    assert_denied(&a, &job, Request::new("s3:GetObject", &obj("inputs//data.bin")));
    // Any script: the policy text is ASCII, the object is the key's own.
    let job = job_caller(&a, "job-3", Some("inputs/run’s 入力.csv"));
    assert_allowed(&a, &job, Request::new("s3:GetObject", &obj("inputs/run’s 入力.csv")));
    assert_denied(&a, &job, Request::new("s3:GetObject", &obj("inputs/run's.csv")));
}

#[test]
fn a_job_touches_its_own_input_checkpoints_and_outputs() {
    let a = authorizer();
    let job = job_caller(&a, "job-1", Some("inputs/data.bin"));
    assert_allowed(&a, &job, Request::new("s3:GetObject", &obj("inputs/data.bin")));
    assert_allowed(
        &a,
        &job,
        Request::new("s3:GetObject", &obj("checkpoints/job-1/3/model.pt")),
    );
    assert_allowed(
        &a,
        &job,
        Request::new("s3:PutObject", &obj("checkpoints/job-1/4/model.pt")),
    );
    assert_allowed(&a, &job, Request::new("s3:PutObject", &obj("outputs/job-1/result.csv")));
    assert_allowed(
        &a,
        &job,
        Request::new("s3:ListBucket", &format!("arn:aws:s3:::{BUCKET}")).with("s3:prefix", "checkpoints/job-1/"),
    );
}

#[test]
fn a_job_cannot_read_another_jobs_checkpoint_or_input() {
    let a = authorizer();
    let job = job_caller(&a, "job-1", Some("inputs/data.bin"));
    assert_denied(
        &a,
        &job,
        Request::new("s3:GetObject", &obj("checkpoints/job-2/3/model.pt")),
    );
    assert_denied(
        &a,
        &job,
        Request::new("s3:PutObject", &obj("checkpoints/job-2/4/model.pt")),
    );
    assert_denied(&a, &job, Request::new("s3:GetObject", &obj("outputs/job-2/result.csv")));
    assert_denied(&a, &job, Request::new("s3:GetObject", &obj("inputs/other.bin")));
    assert_denied(&a, &job, Request::new("s3:GetObject", &obj("jobs/spec.json")));
    assert_denied(
        &a,
        &job,
        Request::new("s3:ListBucket", &format!("arn:aws:s3:::{BUCKET}")).with("s3:prefix", "checkpoints/"),
    );
}

#[test]
fn a_job_cannot_write_the_jobs_table_delete_a_message_or_terminate_an_instance() {
    let a = authorizer();
    let job = job_caller(&a, "job-1", None);
    let jobs = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-jobs");
    assert_denied(
        &a,
        &job,
        Request::new("dynamodb:UpdateItem", &jobs).with_many("dynamodb:LeadingKeys", &["job-1"]),
    );
    assert_denied(
        &a,
        &job,
        Request::new("dynamodb:PutItem", &jobs).with_many("dynamodb:LeadingKeys", &["job-9"]),
    );
    assert_denied(
        &a,
        &job,
        Request::new(
            "sqs:DeleteMessage",
            &format!("arn:aws:sqs:us-east-1:{ACCOUNT}:st-standard"),
        ),
    );
    assert_denied(
        &a,
        &job,
        Request::new("ec2:TerminateInstances", &instance("i-1")).with("ec2:ResourceTag/onoff:managed", "st"),
    );
    // Even the job role without a session policy holds no table, queue or EC2 rights.
    let role = a.caller(Principal::Job).unwrap();
    assert_denied(
        &a,
        &role,
        Request::new("dynamodb:UpdateItem", &jobs).with_many("dynamodb:LeadingKeys", &["job-1"]),
    );
    assert_denied(&a, &role, Request::new("ec2:TerminateInstances", &instance("i-1")));
}

#[test]
fn only_the_worker_role_may_start_a_job_session() {
    let a = authorizer();
    let worker = a.worker("i-1").unwrap();
    assert!(a.may_assume(TEMPLATE, &worker, Principal::Job).unwrap());
    for p in [Principal::Scaler, Principal::Submit, Principal::Job] {
        let c = a.caller(p).unwrap();
        assert!(
            !a.may_assume(TEMPLATE, &c, Principal::Job).unwrap(),
            "{} must not assume the job role",
            p.as_str()
        );
    }
}

// ---- a worker ---------------------------------------------------------------------------------

#[test]
fn a_worker_writes_only_its_own_worker_row() {
    let a = authorizer();
    let worker = a.worker("i-1").unwrap();
    let rows = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-worker-rows");
    for action in ["dynamodb:UpdateItem", "dynamodb:PutItem", "dynamodb:GetItem"] {
        assert_allowed(
            &a,
            &worker,
            Request::new(action, &rows).with_many("dynamodb:LeadingKeys", &[&instance("i-1")]),
        );
        assert_denied(
            &a,
            &worker,
            Request::new(action, &rows).with_many("dynamodb:LeadingKeys", &[&instance("i-2")]),
        );
    }
}

#[test]
fn a_worker_creates_no_job_rows_but_error_records() {
    let a = authorizer();
    let worker = a.worker("i-1").unwrap();
    let put = |key: &str, attributes: &[&str]| job_row_write("dynamodb:PutItem", key, attributes, "NONE");
    let error_record = ["created_at", "expires_at", "job_id", "reason"];
    assert_denied(&a, &worker, put("job-1", &error_record));
    assert_allowed(&a, &worker, put("error#sqs:m-1", &error_record));
    // An error record's attributes only: not a job's row under an error key.
    assert_denied(&a, &worker, put("error#sqs:m-1", &["job_id", "spec", "state"]));
}

#[test]
fn submit_creates_job_rows_only_as_admission_writes_them() {
    let a = authorizer();
    let submit = a.caller(Principal::Submit).unwrap();
    let put = |attributes: &[&str], return_values: &str| {
        job_row_write("dynamodb:PutItem", "job-1", attributes, return_values)
    };
    let created = [
        "active_lane",
        "attempts",
        "cost_usd",
        "created_at",
        "hand_backs",
        "job_id",
        "lane",
        "lease_expiries",
        "project",
        "source",
        "spec",
        "state",
    ];
    assert_allowed(&a, &submit, put(&created, "NONE"));
    assert_allowed(
        &a,
        &submit,
        put(&["created_at", "expires_at", "job_id", "reason"], "NONE"),
    );
    // Not a row already leased, checkpointed or with a history; not overwriting one to read it.
    for attribute in ["lease_owner", "lease_expires_at", "last_checkpoint", "attempt_log"] {
        assert_denied(&a, &submit, put(&["job_id", "spec", "state", attribute], "NONE"));
    }
    assert_denied(&a, &submit, put(&created, "ALL_OLD"));
    // The other functions create no rows.
    for p in [Principal::Scaler, Principal::Reconciler, Principal::Interruption] {
        assert_denied(&a, &a.caller(p).unwrap(), put(&created, "NONE"));
    }
}

#[test]
fn a_worker_updates_only_the_lease_attributes_of_a_job_row() {
    let a = authorizer();
    let worker = a.worker("i-1").unwrap();
    let jobs = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-jobs");
    let update = |attributes: &[&str], return_values: &str| {
        job_row_write("dynamodb:UpdateItem", "job-1", attributes, return_values)
    };
    // A claim, which reads back the row it wrote; a settle; progress. Which job it holds is a
    // condition in code (the lease owner is an attribute IAM cannot compare with the caller).
    assert_allowed(
        &a,
        &worker,
        update(
            &[
                "attempts",
                "claimed_at",
                "job_id",
                "lease_expires_at",
                "lease_owner",
                "state",
            ],
            "ALL_NEW",
        ),
    );
    assert_allowed(
        &a,
        &worker,
        update(
            &[
                "active_lane",
                "attempt_log",
                "attempts",
                "claimed_at",
                "expires_at",
                "finished_at",
                "hand_backs",
                "job_id",
                "lease_expires_at",
                "lease_expiries",
                "lease_owner",
                "reason",
                "run_lane",
                "run_s",
                "state",
            ],
            "NONE",
        ),
    );
    assert_allowed(
        &a,
        &worker,
        update(&["cost_usd", "job_id", "last_checkpoint", "lease_owner"], "NONE"),
    );
    // What became of an attempt's outputs, after the settle (DynamoJobs::record_outputs).
    assert_allowed(&a, &worker, update(&["job_id", "outputs"], "NONE"));
    // A row it claimed that does not parse, ended FAILED under its lease
    // (DynamoJobs::fail_unreadable).
    assert_allowed(
        &a,
        &worker,
        update(
            &[
                "active_lane",
                "claimed_at",
                "expires_at",
                "finished_at",
                "job_id",
                "lease_expires_at",
                "lease_owner",
                "reason",
                "state",
            ],
            "NONE",
        ),
    );
    // Never what a job is: what it runs, whom it bills, where it queues, where it came from.
    for definition in ["spec", "project", "lane", "source", "created_at"] {
        assert_denied(&a, &worker, update(&["job_id", "state", definition], "NONE"));
    }
    // Nor an update naming no attribute (IAM's ForAllValues holds of an empty set).
    assert_denied(
        &a,
        &worker,
        Request::new("dynamodb:UpdateItem", &jobs).with_many("dynamodb:LeadingKeys", &["job-1"]),
    );
}

#[test]
fn a_worker_terminates_only_itself() {
    let a = authorizer();
    let worker = a.worker("i-1").unwrap();
    assert_allowed(
        &a,
        &worker,
        Request::new("ec2:TerminateInstances", &instance("i-1")).with("ec2:ResourceTag/onoff:managed", "st"),
    );
    assert_denied(
        &a,
        &worker,
        Request::new("ec2:TerminateInstances", &instance("i-2")).with("ec2:ResourceTag/onoff:managed", "st"),
    );
    // Ending itself, a stoppable spot worker cancels its persistent request first: this stack's
    // requests only. It stops and starts nothing.
    let request = |stack: &str| {
        Request::new(
            "ec2:CancelSpotInstanceRequests",
            &format!("arn:aws:ec2:us-east-1:{ACCOUNT}:spot-instances-request/sir-1"),
        )
        .with("ec2:ResourceTag/onoff:managed", stack)
    };
    assert_allowed(&a, &worker, Request::new("ec2:DescribeSpotInstanceRequests", "*"));
    assert_allowed(&a, &worker, request("st"));
    assert_denied(&a, &worker, request("other-stack"));
    for action in ["ec2:StopInstances", "ec2:StartInstances"] {
        let own = Request::new(action, &instance("i-1")).with("ec2:ResourceTag/onoff:managed", "st");
        assert_denied(&a, &worker, own);
    }
}

#[test]
fn a_worker_pulls_only_the_worker_images_repository() {
    let a = authorizer();
    let worker = a.worker("i-1").unwrap();
    let repo = |name: &str| format!("arn:aws:ecr:us-east-1:{ACCOUNT}:repository/{name}");
    assert_allowed(
        &a,
        &worker,
        Request::new("ecr:BatchGetImage", &repo("team/onoff-worker")),
    );
    assert_allowed(
        &a,
        &worker,
        Request::new("ecr:GetDownloadUrlForLayer", &repo("team/onoff-worker")),
    );
    assert_denied(&a, &worker, Request::new("ecr:BatchGetImage", &repo("team/other")));
    assert_denied(&a, &worker, Request::new("ecr:BatchGetImage", &repo("onoff-worker")));
    // A digest reference names the same repository.
    let pinned = Authorizer::for_template(
        TEMPLATE,
        &stack_with(&[(
            "WorkerImageUri",
            "123456789012.dkr.ecr.us-east-1.amazonaws.com/onoff-worker@sha256:abcd",
        )]),
    )
    .unwrap();
    let w = pinned.worker("i-1").unwrap();
    assert_allowed(&pinned, &w, Request::new("ecr:BatchGetImage", &repo("onoff-worker")));
    // An image outside ECR: no repository at all.
    let public = Authorizer::for_template(
        TEMPLATE,
        &stack_with(&[("WorkerImageUri", "nvcr.io/nvidia/pytorch:24.01")]),
    )
    .unwrap();
    let w = public.worker("i-1").unwrap();
    assert_denied(&public, &w, Request::new("ecr:BatchGetImage", &repo("nvidia/pytorch")));
}

// ---- the functions ----------------------------------------------------------------------------

fn launch(a: &Authorizer, c: &Caller, lt: &str, subnet: &str) -> bool {
    let lt_arn = format!("arn:aws:ec2:us-east-1:{ACCOUNT}:launch-template/{lt}");
    let subnet_arn = format!("arn:aws:ec2:us-east-1:{ACCOUNT}:subnet/{subnet}");
    let inst = Request::new(
        "ec2:CreateFleet",
        &format!("arn:aws:ec2:us-east-1:{ACCOUNT}:instance/*"),
    )
    .with("aws:RequestTag/onoff:managed", "st");
    allowed(a, c, &Request::new("ec2:CreateFleet", &lt_arn))
        && allowed(a, c, &Request::new("ec2:CreateFleet", &subnet_arn))
        && allowed(a, c, &inst)
}

#[test]
fn the_scaler_launches_only_from_the_worker_template_into_the_stacks_subnets() {
    let a = authorizer();
    for p in [Principal::Scaler, Principal::Reconciler] {
        let c = a.caller(p).unwrap();
        assert!(launch(&a, &c, LT, "subnet-0a"), "{} launches", p.as_str());
        assert!(launch(&a, &c, LT, "subnet-0b"));
        assert!(!launch(&a, &c, "lt-other", "subnet-0a"), "another launch template");
        assert!(!launch(&a, &c, LT, "subnet-0c"), "a subnet outside WorkerSubnets");
        let pass = Request::new("iam:PassRole", &format!("arn:aws:iam::{ACCOUNT}:role/st-worker"))
            .with("iam:PassedToService", "ec2.amazonaws.com");
        assert_allowed(&a, &c, pass);
        let other = Request::new("iam:PassRole", &format!("arn:aws:iam::{ACCOUNT}:role/admin"))
            .with("iam:PassedToService", "ec2.amazonaws.com");
        assert_denied(&a, &c, other);
        // The spot prices their launches are chosen on.
        assert_allowed(&a, &c, Request::new("ec2:DescribeSpotPriceHistory", "*"));
    }
    for p in [
        Principal::Submit,
        Principal::Interruption,
        Principal::Worker,
        Principal::Job,
    ] {
        let c = a.caller(p).unwrap();
        assert!(!launch(&a, &c, LT, "subnet-0a"), "{} must not launch", p.as_str());
        assert_denied(&a, &c, Request::new("ec2:DescribeSpotPriceHistory", "*"));
    }
}

#[test]
fn the_reaper_terminates_only_instances_of_the_worker_launch_template() {
    let a = authorizer();
    let c = a.caller(Principal::Reconciler).unwrap();
    let ours = Request::new("ec2:TerminateInstances", &instance("i-1"))
        .with("ec2:ResourceTag/onoff:managed", "st")
        .with("ec2:ResourceTag/aws:ec2launchtemplate:id", LT);
    assert_allowed(&a, &c, ours);
    // Carries the tag, launched some other way.
    let tagged = Request::new("ec2:TerminateInstances", &instance("i-2")).with("ec2:ResourceTag/onoff:managed", "st");
    assert_denied(&a, &c, tagged);
    let other_lt = Request::new("ec2:TerminateInstances", &instance("i-3"))
        .with("ec2:ResourceTag/onoff:managed", "st")
        .with("ec2:ResourceTag/aws:ec2launchtemplate:id", "lt-other");
    assert_denied(&a, &c, other_lt);
    let submit = a.caller(Principal::Submit).unwrap();
    let ours = Request::new("ec2:TerminateInstances", &instance("i-1"))
        .with("ec2:ResourceTag/onoff:managed", "st")
        .with("ec2:ResourceTag/aws:ec2launchtemplate:id", LT);
    assert_denied(&a, &submit, ours);
}

#[test]
fn only_the_scaler_and_reaper_stop_and_start_and_only_this_stacks_workers() {
    let a = authorizer();
    let ours = |action: &str| {
        Request::new(action, &instance("i-1"))
            .with("ec2:ResourceTag/onoff:managed", "st")
            .with("ec2:ResourceTag/aws:ec2launchtemplate:id", LT)
    };
    let request = |tag: Option<&str>| {
        let r = Request::new(
            "ec2:CancelSpotInstanceRequests",
            &format!("arn:aws:ec2:us-east-1:{ACCOUNT}:spot-instances-request/sir-1"),
        );
        match tag {
            Some(t) => r.with("ec2:ResourceTag/onoff:managed", t),
            None => r,
        }
    };
    // A stoppable spot launch tags its request, at launch only.
    let tag_request = |action: &str| {
        Request::new(
            "ec2:CreateTags",
            &format!("arn:aws:ec2:us-east-1:{ACCOUNT}:spot-instances-request/*"),
        )
        .with("ec2:CreateAction", action)
    };
    for p in [Principal::Scaler, Principal::Reconciler] {
        let c = a.caller(p).unwrap();
        for action in ["ec2:StopInstances", "ec2:StartInstances"] {
            assert_allowed(&a, &c, ours(action));
            // Carries the tag, launched some other way.
            let tagged = Request::new(action, &instance("i-2")).with("ec2:ResourceTag/onoff:managed", "st");
            assert_denied(&a, &c, tagged);
        }
        assert_allowed(&a, &c, request(Some("st")));
        assert_denied(&a, &c, request(Some("other-stack")));
        assert_denied(&a, &c, request(None));
        // Which requests are this stack's, before a termination cancels them.
        assert_allowed(&a, &c, Request::new("ec2:DescribeSpotInstanceRequests", "*"));
        assert_allowed(&a, &c, tag_request("RunInstances"));
        assert_denied(&a, &c, tag_request("CreateTags"));
    }
    for p in [
        Principal::Submit,
        Principal::Interruption,
        Principal::Worker,
        Principal::Job,
    ] {
        let c = a.caller(p).unwrap();
        for action in ["ec2:StopInstances", "ec2:StartInstances"] {
            assert_denied(&a, &c, ours(action));
        }
        // A worker cancels its own request as it ends itself (a_worker_terminates_only_itself).
        if p != Principal::Worker {
            assert_denied(&a, &c, request(Some("st")));
        }
    }
}

/// A reconcile run reads every job's arrival (the arrivals index) and the last run times (the
/// run_times index), and keeps the lanes' arrival statistics in the control table; the functions
/// that only ask for a run read neither.
#[test]
fn only_reconcile_runs_read_the_arrivals_and_run_times_and_keep_their_statistics() {
    let a = authorizer();
    let jobs = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-jobs");
    let control = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-control");
    let query = Request::new("dynamodb:Query", &format!("{jobs}/index/arrivals"))
        .with_many("dynamodb:LeadingKeys", &["standard"]);
    let run_times = Request::new("dynamodb:Query", &format!("{jobs}/index/run_times"))
        .with_many("dynamodb:LeadingKeys", &["standard"]);
    let keep = |action: &str| Request::new(action, &control).with_many("dynamodb:LeadingKeys", &["arrivals#standard"]);
    for p in [Principal::Scaler, Principal::Reconciler] {
        let c = a.caller(p).unwrap();
        assert_allowed(&a, &c, query.clone());
        assert_allowed(&a, &c, run_times.clone());
        assert_allowed(&a, &c, keep("dynamodb:GetItem"));
        assert_allowed(&a, &c, keep("dynamodb:PutItem"));
        // Not the table itself, nor the other index.
        assert_denied(&a, &c, Request::new("dynamodb:Query", &jobs));
        assert_denied(&a, &c, Request::new("dynamodb:Query", &format!("{jobs}/index/active")));
    }
    for p in [Principal::Submit, Principal::Interruption, Principal::Worker] {
        let c = a.caller(p).unwrap();
        assert_denied(&a, &c, query.clone());
        assert_denied(&a, &c, run_times.clone());
    }
}

#[test]
fn submit_and_interruption_may_ask_only_the_scaler() {
    let a = authorizer();
    let f = |n: &str| format!("arn:aws:lambda:us-east-1:{ACCOUNT}:function:st-{n}");
    for p in [Principal::Submit, Principal::Interruption] {
        let c = a.caller(p).unwrap();
        assert_allowed(&a, &c, Request::new("lambda:InvokeFunction", &f("scaler")));
        assert_denied(&a, &c, Request::new("lambda:InvokeFunction", &f("reconciler")));
        assert_denied(&a, &c, Request::new("lambda:InvokeFunction", &f("submit")));
    }
}

// ---- who may submit ---------------------------------------------------------------------------

/// A role outside the template whose own policy allows everything: only resource-based policies
/// can stop it.
fn admin(arn: &str) -> Caller {
    Caller {
        role_arn: arn.into(),
        identity: vec![serde_json::json!({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "*", "Resource": "*"}]})],
        session_policy: None,
        instance_arn: None,
    }
}

#[test]
fn only_submitter_principals_put_job_specs_or_send_submissions() {
    let a = Authorizer::for_template(
        TEMPLATE,
        &stack_with(&[(
            "SubmitterPrincipals",
            "arn:aws:iam::123456789012:role/ml-*,arn:aws:iam::123456789012:user/ci",
        )]),
    )
    .unwrap();
    let put = Request::new("s3:PutObject", &obj("jobs/train.json"));
    let send = Request::new(
        "sqs:SendMessage",
        &format!("arn:aws:sqs:us-east-1:{ACCOUNT}:st-submissions"),
    );
    for who in [
        "arn:aws:iam::123456789012:role/ml-alice",
        "arn:aws:iam::123456789012:user/ci",
    ] {
        assert_allowed(&a, &admin(who), put.clone());
        assert_allowed(&a, &admin(who), send.clone());
    }
    let outsider = admin("arn:aws:iam::123456789012:role/analytics");
    match a.decide(&outsider, &put).unwrap() {
        Decision::ExplicitDeny(why) => assert!(why.contains("OnlySubmittersPutJobSpecs"), "{why}"),
        other => panic!("the bucket policy must deny: {other:?}"),
    }
    assert!(matches!(a.decide(&outsider, &send).unwrap(), Decision::ExplicitDeny(_)));
    // The rest of the bucket is not submission: an admin still reads checkpoints.
    assert_allowed(
        &a,
        &outsider,
        Request::new("s3:GetObject", &obj("checkpoints/job-1/1/f")),
    );
}

#[test]
fn by_default_any_principal_of_the_account_may_submit_and_no_one_else() {
    let a = authorizer();
    let put = Request::new("s3:PutObject", &obj("jobs/train.json"));
    assert_allowed(&a, &admin("arn:aws:iam::123456789012:role/anyone"), put.clone());
    assert_denied(&a, &admin("arn:aws:iam::210987654321:role/elsewhere"), put);
}

// ---- what every function needs still holds ---------------------------------------------------

#[test]
fn the_functions_keep_their_state_access() {
    let a = authorizer();
    let jobs = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-jobs");
    let rows = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-worker-rows");
    for p in [
        Principal::Scaler,
        Principal::Reconciler,
        Principal::Interruption,
        Principal::Submit,
    ] {
        let c = a.caller(p).unwrap();
        assert_allowed(&a, &c, Request::new("dynamodb:Scan", &format!("{jobs}/index/active")));
        assert_allowed(
            &a,
            &c,
            Request::new("dynamodb:UpdateItem", &rows).with_many("dynamodb:LeadingKeys", &[&instance("i-1")]),
        );
        assert_allowed(&a, &c, Request::new("ec2:DescribeInstances", "*"));
        // A job's row: its lifecycle only (a lost lease ended, a wake-up stamped), returning
        // nothing; never what the job is, and no read-back.
        let update = |attributes: &[&str], return_values: &str| {
            job_row_write("dynamodb:UpdateItem", "job-1", attributes, return_values)
        };
        let requeue = [
            "attempt_log",
            "attempts",
            "cancel_requested",
            "claimed_at",
            "hand_backs",
            "job_id",
            "lease_expires_at",
            "lease_expiries",
            "lease_owner",
            "state",
        ];
        assert_allowed(&a, &c, update(&requeue, "NONE"));
        assert_allowed(&a, &c, update(&["job_id", "sent_at"], "NONE"));
        assert_denied(&a, &c, update(&["job_id", "sent_at"], "ALL_NEW"));
        // What the job is, and what only its worker writes (its cost, its checkpoint).
        for attribute in [
            "spec",
            "project",
            "lane",
            "source",
            "created_at",
            "cost_usd",
            "last_checkpoint",
        ] {
            assert_denied(&a, &c, update(&["job_id", attribute], "NONE"));
        }
    }
    let submit = a.caller(Principal::Submit).unwrap();
    assert_allowed(&a, &submit, Request::new("s3:GetObjectVersion", &obj("jobs/x.json")));
    assert_denied(&a, &submit, Request::new("s3:GetObject", &obj("checkpoints/job-1/1/f")));
}

// ---- the evaluation logic on the IAM User Guide's cases ---------------------------------------

fn caller(identity: serde_json::Value, session: Option<serde_json::Value>) -> Caller {
    Caller {
        role_arn: "arn:aws:iam::123456789012:role/r".into(),
        identity: vec![identity],
        session_policy: session,
        instance_arn: None,
    }
}

/// IAM User Guide, "Policy evaluation logic": an explicit deny overrides any allow; no allow is
/// an implicit deny; a session's permissions are the intersection of the role's identity
/// policies and its session policy, and a session policy cannot grant what the role lacks.
#[test]
fn the_policy_types_combine_as_the_iam_user_guide_says() {
    let a = authorizer();
    let allow_bucket = serde_json::json!({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::data/*"}]});
    let with_deny = serde_json::json!({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::data/*"},
        {"Sid": "NoSecrets", "Effect": "Deny", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::data/secret/*"}]});
    let only_public = serde_json::json!({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::data/public/*"}]});
    let get = |k: &str| Request::new("s3:GetObject", &format!("arn:aws:s3:::data/{k}"));

    // Allow.
    assert_eq!(
        a.decide(&caller(allow_bucket.clone(), None), &get("a")).unwrap(),
        Decision::Allow
    );
    // Explicit deny beats the allow.
    assert!(matches!(
        a.decide(&caller(with_deny, None), &get("secret/k")).unwrap(),
        Decision::ExplicitDeny(s) if s.contains("NoSecrets")
    ));
    // Nothing allows: implicit deny.
    assert!(matches!(
        a.decide(
            &caller(allow_bucket.clone(), None),
            &Request::new("s3:GetObject", "arn:aws:s3:::other/a")
        )
        .unwrap(),
        Decision::ImplicitDeny(_)
    ));
    // Session policy: intersection.
    let session = caller(allow_bucket.clone(), Some(only_public.clone()));
    assert_eq!(a.decide(&session, &get("public/a")).unwrap(), Decision::Allow);
    assert!(matches!(
        a.decide(&session, &get("private/a")).unwrap(),
        Decision::ImplicitDeny(_)
    ));
    // A session policy grants nothing the role lacks.
    let narrow_role = serde_json::json!({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::data/private/*"}]});
    let s2 = caller(narrow_role, Some(only_public));
    assert!(!a.decide(&s2, &get("public/a")).unwrap().allowed());
    // Policy variables in conditions come from the request context.
    let own = serde_json::json!({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "ec2:TerminateInstances", "Resource": "*",
         "Condition": {"StringEquals": {"aws:ARN": "${ec2:SourceInstanceARN}"}}}]});
    let mut w = caller(own, None);
    w.instance_arn = Some(instance("i-1"));
    assert!(a
        .decide(&w, &Request::new("ec2:TerminateInstances", &instance("i-1")))
        .unwrap()
        .allowed());
    assert!(!a
        .decide(&w, &Request::new("ec2:TerminateInstances", &instance("i-2")))
        .unwrap()
        .allowed());
}

// ---- the operator -----------------------------------------------------------------------------

#[test]
fn an_operator_runs_the_cli_verbs_and_launches_nothing() {
    let stack = stack_with(&[]);
    let a = Authorizer::for_template(TEMPLATE, &stack).unwrap();
    let doc = onoff_iam::managed_policy(TEMPLATE, &stack, "OperatorAccess").unwrap();
    let op = Caller {
        role_arn: format!("arn:aws:iam::{ACCOUNT}:role/ml-operator"),
        identity: vec![doc],
        session_policy: None,
        instance_arn: None,
    };
    let jobs = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-jobs");
    let workers = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-worker-rows");
    let control = format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-control");
    let group = format!("arn:aws:logs:us-east-1:{ACCOUNT}:log-group:Worker:*");
    let cancel = |attributes: &[&str], return_values: &str| {
        Request::new("dynamodb:UpdateItem", &jobs)
            .with_many("dynamodb:LeadingKeys", &["job-1"])
            .with_many("dynamodb:Attributes", attributes)
            .with("dynamodb:ReturnValues", return_values)
    };
    for r in [
        Request::new(
            "cloudformation:DescribeStacks",
            &format!("arn:aws:cloudformation:us-east-1:{ACCOUNT}:stack/st/1234"),
        ),
        Request::new(
            "lambda:GetFunctionConfiguration",
            &format!("arn:aws:lambda:us-east-1:{ACCOUNT}:function:st-scaler"),
        ),
        Request::new("s3:PutObject", &obj("jobs/job-1.json")),
        Request::new("s3:GetObject", &obj("outputs/job-1/result.csv")),
        Request::new("s3:ListBucket", &format!("arn:aws:s3:::{BUCKET}")).with("s3:prefix", "outputs/job-1/"),
        Request::new("dynamodb:Scan", &jobs),
        cancel(
            &["job_id", "state", "reason", "finished_at", "expires_at", "active_lane"],
            "NONE",
        ),
        cancel(&["job_id", "state", "cancel_requested"], "NONE"),
        Request::new("logs:GetLogEvents", &group.replace(":*", ":log-stream:job-1/1")),
        // `onoff submit` checks a spec against the offerings of the subnets' zones.
        Request::new("ec2:DescribeSubnets", "*"),
        // `onoff cost` and `onoff workers` read the workers table; `onoff workers` the marks of
        // the control table and EC2's instances and spot requests too.
        Request::new("dynamodb:Scan", &workers),
        Request::new("dynamodb:Scan", &format!("{jobs}/index/active")),
        Request::new("dynamodb:Scan", &control),
        Request::new("ec2:DescribeInstances", "*"),
        Request::new("ec2:DescribeSpotInstanceRequests", "*"),
    ] {
        assert_allowed(&a, &op, r);
    }
    // `onoff dead-letters` reads the dead-letter queues and the failed-events queue, and puts
    // back what it read; it changes nothing else there, and reads no other queue.
    let queue = |name: &str| format!("arn:aws:sqs:us-east-1:{ACCOUNT}:{name}");
    for q in [
        "st-submissions-dlq",
        "st-express-dlq",
        "st-standard-dlq",
        "st-failed-events",
    ] {
        for action in [
            "sqs:GetQueueAttributes",
            "sqs:ReceiveMessage",
            "sqs:ChangeMessageVisibility",
        ] {
            assert_allowed(&a, &op, Request::new(action, &queue(q)));
        }
        for action in [
            "sqs:DeleteMessage",
            "sqs:SendMessage",
            "sqs:PurgeQueue",
            "sqs:StartMessageMoveTask",
        ] {
            assert_denied(&a, &op, Request::new(action, &queue(q)));
        }
    }
    for q in [
        "st-submissions",
        "st-express",
        "st-standard",
        "other-express-dlq",
        "st-other-express-dlq",
    ] {
        assert_denied(&a, &op, Request::new("sqs:ReceiveMessage", &queue(q)));
    }
    // Updates of anything else, or that read the row back, or that name no attribute.
    for r in [
        cancel(&["job_id", "state", "attempts"], "NONE"),
        cancel(&["job_id", "priority"], "NONE"),
        cancel(&["job_id", "state", "reason"], "ALL_OLD"),
        Request::new("dynamodb:UpdateItem", &jobs)
            .with_many("dynamodb:LeadingKeys", &["job-1"])
            .with("dynamodb:ReturnValues", "NONE"),
    ] {
        assert_denied(&a, &op, r);
    }
    for r in [
        Request::new(
            "ec2:CreateFleet",
            &format!("arn:aws:ec2:us-east-1:{ACCOUNT}:launch-template/{LT}"),
        ),
        Request::new("ec2:TerminateInstances", &instance("i-1")).with("ec2:ResourceTag/onoff:managed", "st"),
        // Seeing the stack's spot requests is not cancelling them (the reaper does).
        Request::new(
            "ec2:CancelSpotInstanceRequests",
            &format!("arn:aws:ec2:us-east-1:{ACCOUNT}:spot-instances-request/sir-1"),
        )
        .with("ec2:ResourceTag/onoff:managed", "st"),
        Request::new("s3:GetObject", &obj("checkpoints/job-1/1/state.bin")),
        Request::new(
            "dynamodb:PutItem",
            &format!("arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/st-worker-rows"),
        ),
        // Reading the marks is not making or clearing them, nor taking the reconcile lease.
        Request::new("dynamodb:PutItem", &control),
        Request::new("dynamodb:DeleteItem", &control),
        Request::new("dynamodb:UpdateItem", &workers),
        Request::new(
            "lambda:GetFunctionConfiguration",
            &format!("arn:aws:lambda:us-east-1:{ACCOUNT}:function:st-submit"),
        ),
    ] {
        assert_denied(&a, &op, r);
    }
}

// ---- IAM's size quotas ------------------------------------------------------------------------

/// The stack at its longest names: a 40-character stack name (its bucket's name, stack, account
/// and region joined by dashes, must fit S3's 63), 16 worker subnets, a 512-character image URI.
fn longest_stack() -> Stack {
    let name = "x".repeat(40);
    let mut s = Stack {
        partition: "aws-us-gov".into(),
        region: "us-gov-west-1".into(),
        account: ACCOUNT.into(),
        stack_name: name.clone(),
        ..Stack::default()
    };
    let q = |n: &str| format!("https://sqs.us-gov-west-1.amazonaws.com/{ACCOUNT}/{name}-{n}");
    let qarn = |n: &str| format!("arn:aws-us-gov:sqs:us-gov-west-1:{ACCOUNT}:{name}-{n}");
    for (logical, n) in [
        ("ExpressQueue", "express"),
        ("StandardQueue", "standard"),
        ("SubmissionQueue", "submissions"),
        ("FailedEventsQueue", "failed-events"),
    ] {
        s.refs.insert(logical.into(), q(n));
        s.atts.insert(format!("{logical}.Arn"), qarn(n));
    }
    for (logical, n) in [
        ("JobsTable", "jobs"),
        ("WorkersTable", "workers"),
        ("ControlTable", "control"),
    ] {
        s.refs.insert(logical.into(), format!("{name}-{n}"));
        s.atts.insert(
            format!("{logical}.Arn"),
            format!("arn:aws-us-gov:dynamodb:us-gov-west-1:{ACCOUNT}:table/{name}-{n}"),
        );
    }
    let bucket = format!("{name}-{ACCOUNT}-us-gov-west-1");
    s.atts
        .insert("Bucket.Arn".into(), format!("arn:aws-us-gov:s3:::{bucket}"));
    s.refs.insert("Bucket".into(), bucket);
    s.refs.insert("WorkerLaunchTemplate".into(), LT.into());
    s.atts
        .insert("WorkerSecurityGroup.GroupId".into(), "sg-0123456789abcdef0".into());
    for p in Principal::ALL {
        let role = format!("{name}-{}-{}", p.role_logical_id(), "A".repeat(12));
        s.atts.insert(
            format!("{}.Arn", p.role_logical_id()),
            format!("arn:aws-us-gov:iam::{ACCOUNT}:role/{role}"),
        );
        s.refs.insert(p.role_logical_id().into(), role);
    }
    for l in ["scaler", "reconciler", "interruption", "submit"] {
        s.atts.insert(
            format!("{}LogGroup.Arn", l[..1].to_uppercase() + &l[1..]),
            format!("arn:aws-us-gov:logs:us-gov-west-1:{ACCOUNT}:log-group:/aws/lambda/{name}-{l}:*"),
        );
    }
    s.atts.insert(
        "WorkerLogGroup.Arn".into(),
        format!("arn:aws-us-gov:logs:us-gov-west-1:{ACCOUNT}:log-group:/onoff/{name}/workers:*"),
    );
    s.params
        .insert("WorkerSubnets".into(), vec!["subnet-0123456789abcdef0"; 16].join(","));
    s.params.insert(
        "WorkerImageUri".into(),
        format!(
            "{ACCOUNT}.dkr.ecr.us-gov-west-1.amazonaws.com/{}:{}",
            "r".repeat(256),
            "t".repeat(128)
        ),
    );
    s.params.insert("WorkerVpcId".into(), "vpc-0123456789abcdef0".into());
    s
}

/// IAM refuses policies past its quotas, and CloudFormation then fails the deploy; moto checks
/// none of them ("IAM and AWS STS quotas"; whitespace does not count): a managed policy at most
/// 6,144 characters, a role's inline policies at most 10,240 in all, a trust policy at most
/// 2,048 (the default quota). Measured at the longest names the stack can have.
#[test]
fn every_policy_fits_iams_size_quotas_at_the_longest_names() {
    let stack = longest_stack();
    let size = |doc: &serde_json::Value| serde_json::to_string(doc).unwrap().len();
    let t: serde_yaml::Value = serde_yaml::from_str(TEMPLATE).unwrap();
    let mut managed: Vec<(String, usize)> = Vec::new();
    for (id, r) in t["Resources"].as_mapping().unwrap() {
        if r["Type"].as_str() == Some("AWS::IAM::ManagedPolicy") {
            let id = id.as_str().unwrap().to_string();
            let doc = onoff_iam::managed_policy(TEMPLATE, &stack, &id).unwrap();
            managed.push((id, size(&doc)));
        }
    }
    assert!(managed.len() >= 3, "{managed:?}");
    for (id, n) in &managed {
        println!("managed {id}: {n} characters");
        assert!(*n <= 6_144, "managed policy {id}: {n} characters, over IAM's 6,144");
    }
    for p in Principal::ALL {
        if !onoff_iam::has_role(TEMPLATE, p).unwrap() {
            continue;
        }
        let all = onoff_iam::identity_policies(TEMPLATE, &stack, p).unwrap();
        // Less the managed policies it attaches (counted above).
        let managed_docs: Vec<serde_json::Value> = managed
            .iter()
            .map(|(id, _)| onoff_iam::managed_policy(TEMPLATE, &stack, id).unwrap())
            .collect();
        let inline: usize = all.iter().filter(|d| !managed_docs.contains(d)).map(size).sum();
        let trust = size(&onoff_iam::trust_policy(TEMPLATE, &stack, p).unwrap());
        println!("{}: inline {inline}, trust {trust}", p.as_str());
        assert!(
            inline <= 10_240,
            "{}: inline policies {inline} characters, over 10,240",
            p.as_str()
        );
        assert!(
            trust <= 2_048,
            "{}: trust policy {trust} characters, over 2,048",
            p.as_str()
        );
    }
}
