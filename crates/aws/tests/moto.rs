//! The AWS adapters against a real AWS wire-protocol emulator (moto server on loopback).
//!
//! `scripts/test.sh` installs moto into `.venv`, starts it on a free port and exports
//! `ONOFF_TEST_AWS_ENDPOINT`; these tests talk to nothing else. Each test uses its own resource
//! names, so they run in parallel against one server.

use std::sync::atomic::{AtomicU32, Ordering};

use aws_config::{BehaviorVersion, SdkConfig};
use aws_sdk_dynamodb::types::{AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType};
use aws_sdk_sqs::config::{Credentials, Region};
use onoff_aws::fleet::{offering_of, Ec2Fleet, TAG_LANE, TAG_MANAGED, TAG_PROJECT};
use onoff_aws::queue::SqsQueues;
use onoff_aws::settings::Clients;
use onoff_aws::state::{DynamoControl, DynamoWorkers};
use onoff_control::fake::{contract, FaultyFleet};
use onoff_control::job::JobState;
use onoff_control::ports::SpotPrices as _;
use onoff_control::ports::{Fleet, LaunchRequest, OfferingAvailability, StoreError, WorkerRecord, WorkerRegistry};
use onoff_control::{act, ActContext};
use onoff_policy::{
    Action, CapacityPreference, CapacityType, LaunchShape, Offering, OfferingKey, Plan, PolicyConfig, Reason,
    WorkerState,
};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Worker rows are keyed by instance ARN: moto's account and region.
const ARN_PREFIX: &str = "arn:aws:ec2:us-east-1:123456789012:instance/";

/// Records the body of every request an SDK client sends.
#[derive(Debug, Clone, Default)]
struct BodyLog(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl aws_sdk_ec2::config::Intercept for BodyLog {
    fn name(&self) -> &'static str {
        "BodyLog"
    }

    fn read_before_transmit(
        &self,
        context: &aws_sdk_ec2::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &aws_sdk_ec2::config::RuntimeComponents,
        _cfg: &mut aws_sdk_ec2::config::ConfigBag,
    ) -> Result<(), aws_sdk_ec2::error::BoxError> {
        let body = context.request().body().bytes().unwrap_or_default();
        self.0.lock().unwrap().push(String::from_utf8_lossy(body).into_owned());
        Ok(())
    }
}

/// A name unique to this test process and call.
fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

async fn conf() -> SdkConfig {
    let endpoint = std::env::var("ONOFF_TEST_AWS_ENDPOINT").expect(
        "ONOFF_TEST_AWS_ENDPOINT is not set: run the tests with scripts/test.sh, which installs and starts moto server",
    );
    assert!(
        endpoint.starts_with("http://127.0.0.1:"),
        "tests only talk to a loopback emulator, not {endpoint}"
    );
    aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new("test", "test", None, None, "onoff-tests"))
        .load()
        .await
}

async fn clients() -> Clients {
    Clients::from_conf(&conf().await)
}

async fn table(c: &Clients, name: &str, key: &str) {
    c.dynamodb
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name(key)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name(key)
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
}

async fn launch_template(c: &Clients) -> String {
    let name = unique("onoff-worker");
    let image = c
        .ec2
        .describe_images()
        .owners("amazon")
        .send()
        .await
        .unwrap()
        .images()
        .first()
        .and_then(|i| i.image_id())
        .map(str::to_string)
        .unwrap_or_else(|| "ami-12c6146b".into());
    c.ec2
        .create_launch_template()
        .launch_template_name(&name)
        .launch_template_data(
            aws_sdk_ec2::types::RequestLaunchTemplateData::builder()
                .image_id(image)
                .instance_initiated_shutdown_behavior(aws_sdk_ec2::types::ShutdownBehavior::Terminate)
                .build(),
        )
        .send()
        .await
        .unwrap()
        .launch_template()
        .and_then(|t| t.launch_template_id())
        .expect("a launch template id")
        .to_string()
}

/// A launch template by name: the fleet then lists instances by the deployment tag alone (moto
/// does not tag CreateFleet's instances with their launch template, as EC2 does).
async fn launch_template_name(c: &Clients) -> String {
    let id = launch_template(c).await;
    c.ec2
        .describe_launch_templates()
        .launch_template_ids(&id)
        .send()
        .await
        .unwrap()
        .launch_templates()[0]
        .launch_template_name()
        .unwrap()
        .to_string()
}

/// A fleet of a deployment of its own (tagged apart from every other test's), launching from the
/// shared launch template into the default subnets.
async fn own_fleet(c: &Clients) -> Ec2Fleet {
    let subnets = Ec2Fleet::default_subnets(&c.ec2).await.unwrap();
    Ec2Fleet::new(c.ec2.clone(), launch_template_name(c).await)
        .with_subnets(subnets)
        .with_deployment(unique("deploy"))
}

/// The EC2 state of `fleet`'s instance `id` as the fleet lists it; `None` when not listed
/// (terminated).
async fn state_of(fleet: &Ec2Fleet, id: &str) -> Option<String> {
    fleet
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .find(|i| i.instance_id == id)
        .map(|i| i.state)
}

/// Submit a 1-GPU job of project `p` through SQS as message `token` (also its client token) to
/// the `standard` lane at `now`; its id.
async fn new_job(jobs: &onoff_aws::jobs::DynamoJobs, queue: &SqsQueues, token: &str, now: f64) -> String {
    use onoff_control::submit::{submit, Source, Submitted};
    let spec = format!(r#"{{"image":"img","command":["x"],"project":"p","client_token":"{token}"}}"#);
    let source = Source::Sqs {
        message_id: token.into(),
    };
    match submit(&spec, &source, &["standard"], now, jobs, queue).await.unwrap() {
        Submitted::New(id) => id,
        other => panic!("{token}: not a new job: {other:?}"),
    }
}

/// A queue named after `name` whose messages SQS moves to a dead-letter queue of its own after
/// `max_receives` receives, as provisioned for a lane: (queue URL, dead-letter queue URL).
async fn queue_with_dlq(c: &Clients, name: &str, max_receives: u32) -> (String, String) {
    onoff_aws::provision::queue_with_dlq(c, &unique(name), max_receives, 30)
        .await
        .unwrap()
}

/// Launch one instance of offering `k` through `fleet` (lane `standard`, a fresh token); its id.
async fn launch_one(fleet: &Ec2Fleet, k: OfferingKey) -> String {
    let req = LaunchRequest {
        lane: "standard".into(),
        offerings: vec![k],
        count: 1,
        project: None,
        job: None,
        client_token: String::new(),
    }
    .with_token_for(&unique("decision"));
    fleet.launch(&req).await.unwrap().launched[0].instance_id.clone()
}

fn key(ty: &str, zone: &str, cap: CapacityType) -> OfferingKey {
    OfferingKey {
        instance_type: ty.into(),
        zone: zone.into(),
        capacity_type: cap,
    }
}

#[tokio::test]
async fn sqs_backlog_counts_visible_in_flight_and_delayed() {
    let c = clients().await;
    let url = c
        .sqs
        .create_queue()
        .queue_name(unique("standard"))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let q = SqsQueues::new(c.sqs.clone(), vec![("standard".into(), url)]);
    q.send("standard", r#"{"job":"a"}"#, 0).await.unwrap();
    q.send("standard", r#"{"job":"b"}"#, 0).await.unwrap();
    q.send("standard", r#"{"job":"c"}"#, 600).await.unwrap();
    let got = q.receive("standard", 1, 0, 300).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].receive_count, 1);
    let b = q.backlog("standard").await.unwrap();
    assert_eq!((b.visible, b.in_flight, b.delayed), (1, 1, 1));
    assert_eq!(b.total(false), 2);
    assert_eq!(b.total(true), 3);
    // Release for resume, then finish it.
    q.set_visibility("standard", &got[0].receipt, 0).await.unwrap();
    let again = q.receive("standard", 10, 0, 300).await.unwrap();
    assert_eq!(again.len(), 2);
    assert!(again.iter().any(|m| m.receive_count == 2));
    for m in &again {
        q.delete("standard", &m.receipt).await.unwrap();
    }
    let b = q.backlog("standard").await.unwrap();
    assert_eq!((b.visible, b.in_flight, b.delayed), (0, 0, 1));
    let err = q.backlog("express").await.unwrap_err();
    assert!(
        err.to_string().contains("express") && err.to_string().contains("no queue"),
        "{err}"
    );
}

/// Spot prices per zone from `DescribeSpotPriceHistory`: one quote per offered (type, zone), only
/// for the types asked about. moto quotes $0.00001 for everything, which is no price EC2
/// charges: put on the shipped catalogue, every such quote is refused and the catalogue's prices
/// stay (`apply_spot_quotes`' unit test covers quotes that are taken).
#[tokio::test]
async fn spot_quotes_come_per_type_and_zone_and_moto_s_are_refused() {
    let c = clients().await;
    let lt = launch_template(&c).await;
    let fleet = Ec2Fleet::new(c.ec2.clone(), &lt);
    let types = vec!["g5.xlarge".to_string(), "g4dn.xlarge".to_string()];
    let quotes = fleet.spot_quotes(&types).await.unwrap();
    assert!(!quotes.is_empty());
    assert!(quotes.iter().all(|q| types.contains(&q.instance_type)), "{quotes:?}");
    let g5_zones: Vec<&str> = quotes
        .iter()
        .filter(|q| q.instance_type == "g5.xlarge")
        .map(|q| q.zone.as_str())
        .collect();
    assert!(
        g5_zones.len() >= 2 && g5_zones.iter().all(|z| z.starts_with("us-east-1")),
        "{g5_zones:?}"
    );
    let distinct: std::collections::BTreeSet<&str> = g5_zones.iter().copied().collect();
    assert_eq!(distinct.len(), g5_zones.len(), "one quote per zone");
    let mut offerings = onoff_control::catalog::load_offerings_from_dir(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/catalog")),
        &onoff_control::catalog::CatalogOptions::default(),
    )
    .unwrap();
    let catalogue = offerings.clone();
    let report = onoff_control::catalog::apply_spot_quotes(&mut offerings, &quotes);
    assert_eq!(report.applied, 0);
    assert!(report.refused.len() >= g5_zones.len(), "{report:?}");
    assert_eq!(offerings, catalogue);
}

/// A user gives subnets in some zones and not all. An offering in a zone without one is not
/// launched (EC2 would place it by zone alone, in that zone's default subnet: outside the workers'
/// VPC, and outside what the scaler role may launch into; moto takes it); it is reported short,
/// so the launch falls back, and a launch with no placeable offering at all is refused whole.
#[tokio::test]
async fn an_offering_in_a_zone_without_a_subnet_is_not_launched_there() {
    let c = clients().await;
    let subnets = Ec2Fleet::default_subnets(&c.ec2).await.unwrap();
    let two: Vec<(String, String)> = subnets
        .iter()
        .filter(|(z, _)| z == "us-east-1a" || z == "us-east-1b")
        .map(|(_, id)| (String::new(), id.clone()))
        .collect();
    assert_eq!(two.len(), 2, "{subnets:?}");
    let lt = launch_template(&c).await;
    let fleet = Ec2Fleet::new(c.ec2.clone(), &lt)
        .with_subnets(two)
        .with_deployment(unique("deploy"));
    let mut zones: Vec<String> = fleet
        .subnet_zones()
        .await
        .unwrap()
        .into_iter()
        .map(|(z, _)| z)
        .collect();
    zones.sort();
    assert_eq!(zones, ["us-east-1a", "us-east-1b"]);
    let req = |offerings: Vec<OfferingKey>| {
        LaunchRequest {
            lane: "standard".into(),
            offerings,
            count: 1,
            project: None,
            job: None,
            client_token: String::new(),
        }
        .with_token_for(&unique("decision"))
    };
    let d = key("g5.xlarge", "us-east-1d", CapacityType::Spot);
    let b = key("g5.xlarge", "us-east-1b", CapacityType::Spot);
    let res = fleet.launch(&req(vec![d.clone(), b.clone()])).await.unwrap();
    assert_eq!(res.launched.len(), 1);
    assert_eq!(res.launched[0].offering, b);
    assert_eq!(res.short.len(), 1, "{:?}", res.short);
    assert_eq!(res.short[0].0, d);
    assert!(
        res.short[0].1.message.contains("no subnet in us-east-1d"),
        "{}",
        res.short[0].1
    );
    let placed = c
        .ec2
        .describe_instances()
        .instance_ids(&res.launched[0].instance_id)
        .send()
        .await
        .unwrap();
    let inst = &placed.reservations()[0].instances()[0];
    assert_eq!(inst.placement().and_then(|p| p.availability_zone()), Some("us-east-1b"));
    // Only zones without a subnet: nothing goes out, and the error names the zone.
    let err = fleet.launch(&req(vec![d.clone()])).await.unwrap_err();
    assert!(err.message.contains("no subnet in us-east-1d"), "{err}");
    // What EC2 refuses whole (moto takes it): two capacity types in one call, one pool twice.
    let od = key("g5.xlarge", "us-east-1b", CapacityType::OnDemand);
    let err = fleet.launch(&req(vec![b.clone(), od])).await.unwrap_err();
    assert!(err.message.contains("two capacity types"), "{err}");
    let err = fleet.launch(&req(vec![b.clone(), b.clone()])).await.unwrap_err();
    assert!(err.message.contains("duplicate instance pools"), "{err}");
    fleet.terminate(&[res.launched[0].instance_id.clone()]).await.unwrap();
}

#[tokio::test]
async fn fleet_launches_tagged_instances_describes_and_terminates_them() {
    let c = clients().await;
    let subnets = Ec2Fleet::default_subnets(&c.ec2).await.unwrap();
    let deployment = unique("deploy");
    // The adapter's EC2 client, with the request bodies it sends recorded.
    let sent = BodyLog::default();
    let ec2 = aws_sdk_ec2::Client::from_conf(
        aws_sdk_ec2::config::Builder::from(&conf().await)
            .interceptor(sent.clone())
            .interceptor(onoff_aws::limits::AwsLimits)
            .build(),
    );
    // Subnet ids alone, as template.yaml gives them: the fleet looks their zones up.
    let ids_only: Vec<(String, String)> = subnets.iter().map(|(_, id)| (String::new(), id.clone())).collect();
    let lt = launch_template(&c).await;
    let fleet = Ec2Fleet::new(ec2, &lt)
        .with_subnets(ids_only)
        .with_deployment(&deployment);
    let lane = unique("lane");
    let req = LaunchRequest {
        lane: lane.clone(),
        offerings: vec![key("g5.xlarge", "us-east-1b", CapacityType::Spot)],
        count: 2,
        project: Some("vision".into()),
        job: None,
        client_token: String::new(),
    }
    .with_token_for(&unique("decision"));
    assert!(req.client_token.starts_with("onoff-") && req.client_token.len() <= 64);
    let launched = fleet.launch(&req).await.unwrap().launched;
    assert_eq!(launched.len(), 2);
    // EC2 tags them with their launch template; moto does not (the emulator's gap).
    onoff_aws::fleet::tag_as_ec2_does(&c.ec2, &deployment, &lt).await;
    // CreateFleet went out with the request's token as its ClientToken (moto accepts it; it does
    // not replay by it, the fake fleet does).
    let bodies = sent.0.lock().unwrap().clone();
    let create: Vec<&String> = bodies.iter().filter(|b| b.contains("Action=CreateFleet")).collect();
    assert_eq!(create.len(), 1, "{bodies:?}");
    assert!(
        create[0].contains(&format!("ClientToken={}", req.client_token)),
        "{}",
        create[0]
    );
    let mine: Vec<_> = fleet
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .filter(|i| i.lane.as_deref() == Some(&lane))
        .collect();
    assert_eq!(mine.len(), 2);
    for i in &mine {
        assert_eq!(i.instance_type, "g5.xlarge");
        assert_eq!(i.zone, "us-east-1b");
        assert!(launched.iter().any(|l| l.instance_id == i.instance_id));
    }
    // The reaper's listing carries the lane and project tags (it adopts a launch whose
    // registration failed into its lane), and the job a launch was pinned to (none here).
    let listed = onoff_control::ports::FleetLister::list_managed(&fleet).await.unwrap();
    let tagged: Vec<_> = listed.iter().filter(|i| i.lane.as_deref() == Some(&lane)).collect();
    assert_eq!(tagged.len(), 2, "{listed:?}");
    assert!(tagged
        .iter()
        .all(|i| i.project.as_deref() == Some("vision") && i.job.is_none() && i.launched_at > 0.0));
    // A launch pinned to a job carries it as `onoff:job`.
    let pinned = fleet
        .launch(
            &LaunchRequest {
                job: Some("job-0123456789abcdef".into()),
                count: 1,
                client_token: String::new(),
                ..req.clone()
            }
            .with_token_for(&unique("decision")),
        )
        .await
        .unwrap()
        .launched;
    onoff_aws::fleet::tag_as_ec2_does(&c.ec2, &deployment, &lt).await;
    let listed = onoff_control::ports::FleetLister::list_managed(&fleet).await.unwrap();
    let i = listed
        .iter()
        .find(|i| i.instance_id == pinned[0].instance_id)
        .expect("listed");
    assert_eq!(i.job.as_deref(), Some("job-0123456789abcdef"));
    fleet.terminate(&[pinned[0].instance_id.clone()]).await.unwrap();
    // The override named the zone's subnet, found by its id alone.
    let zone_b = subnets.iter().find(|(z, _)| z == "us-east-1b").unwrap().1.clone();
    assert!(create[0].contains(&format!("SubnetId={zone_b}")), "{}", create[0]);
    // An instance that carries the tag but was not launched from the worker template is not
    // this deployment's: not listed, so never reaped.
    let stray = c
        .ec2
        .run_instances()
        .image_id("ami-12c6146b")
        .min_count(1)
        .max_count(1)
        .tag_specifications(
            aws_sdk_ec2::types::TagSpecification::builder()
                .resource_type(aws_sdk_ec2::types::ResourceType::Instance)
                .tags(
                    aws_sdk_ec2::types::Tag::builder()
                        .key(TAG_MANAGED)
                        .value(&deployment)
                        .build(),
                )
                .tags(aws_sdk_ec2::types::Tag::builder().key(TAG_LANE).value(&lane).build())
                .build(),
        )
        .send()
        .await
        .unwrap();
    let stray_id = stray.instances()[0].instance_id().unwrap().to_string();
    let listed = fleet.describe_managed().await.unwrap();
    assert!(
        !listed.iter().any(|i| i.instance_id == stray_id),
        "a tagged instance from elsewhere is not listed"
    );
    assert_eq!(listed.iter().filter(|i| i.lane.as_deref() == Some(&lane)).count(), 2);
    c.ec2
        .terminate_instances()
        .instance_ids(&stray_id)
        .send()
        .await
        .unwrap();
    // Tags as EC2 stores them.
    let d = c
        .ec2
        .describe_instances()
        .instance_ids(&launched[0].instance_id)
        .send()
        .await
        .unwrap();
    let tags: Vec<(String, String)> = d.reservations()[0].instances()[0]
        .tags()
        .iter()
        .map(|t| (t.key().unwrap().to_string(), t.value().unwrap().to_string()))
        .collect();
    for (k, v) in [
        (TAG_MANAGED, deployment.as_str()),
        (TAG_LANE, lane.as_str()),
        (TAG_PROJECT, "vision"),
    ] {
        assert!(tags.contains(&(k.to_string(), v.to_string())), "{k}={v} in {tags:?}");
    }
    let ids: Vec<String> = launched.iter().map(|l| l.instance_id.clone()).collect();
    fleet.terminate(&ids).await.unwrap();
    // Terminating again, and an id that never existed, is not an error.
    fleet.terminate(&ids).await.unwrap();
    fleet.terminate(&["i-0123456789abcdef0".to_string()]).await.unwrap();
    let left = fleet
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .filter(|i| i.lane.as_deref() == Some(&lane))
        .count();
    assert_eq!(left, 0);
    assert_eq!(offering_of(&mine[0]).instance_type, "g5.xlarge");
}

/// EC2 takes at most 1,000 ids per TerminateInstances call; a reconciler that finds more
/// stale instances than that (or a plan that ends that many) terminates them all, in batches.
#[tokio::test]
async fn terminating_more_instances_than_one_call_takes_ends_every_one() {
    let c = clients().await;
    let lt = launch_template(&c).await;
    let fleet = Ec2Fleet::new(c.ec2.clone(), &lt);
    let out = c
        .ec2
        .run_instances()
        .image_id("ami-12c6146b")
        .min_count(1001)
        .max_count(1001)
        .send()
        .await
        .unwrap();
    let ids: Vec<String> = out
        .instances()
        .iter()
        .map(|i| i.instance_id().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 1001);
    // The local stack refuses what EC2 would: one call naming them all.
    let whole = c
        .ec2
        .terminate_instances()
        .set_instance_ids(Some(ids.clone()))
        .send()
        .await
        .unwrap_err();
    let why = format!("{}", aws_smithy_types::error::display::DisplayErrorContext(&whole));
    assert!(
        why.contains("AWS would refuse") && why.contains("1001 instance ids"),
        "{why}"
    );
    fleet.terminate(&ids).await.unwrap();
    let mut live = 0;
    for batch in ids.chunks(200) {
        let d = c
            .ec2
            .describe_instances()
            .set_instance_ids(Some(batch.to_vec()))
            .send()
            .await
            .unwrap();
        live += d
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter(|i| {
                i.state()
                    .and_then(|s| s.name())
                    .is_some_and(|n| !matches!(n.as_str(), "shutting-down" | "terminated"))
            })
            .count();
    }
    assert_eq!(live, 0, "every instance terminated");
}

#[tokio::test]
async fn worker_registry_writes_are_conditional_and_idempotent() {
    let c = clients().await;
    let name = unique("workers");
    table(&c, &name, onoff_aws::state::WORKER_KEY).await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &name, ARN_PREFIX);
    let rec = WorkerRecord {
        project: Some("p".into()),
        ..WorkerRecord::launched(
            "i-0aaaaaaaaaaaaaaa1",
            "standard",
            key("g5.xlarge", "us-east-1a", CapacityType::Spot),
            0.39,
            1_700_000_000.0,
        )
    };
    reg.register_launch(rec.clone()).await.unwrap();
    // A second registration (a retried invocation) changes nothing.
    reg.register_launch(WorkerRecord {
        state: WorkerState::Running,
        ..rec.clone()
    })
    .await
    .unwrap();
    assert_eq!(reg.get(&rec.id).await.unwrap(), Some(rec.clone()));
    // A launch pinned to a job (a deadline at risk on spot) keeps the job on the row, for the
    // worker's agent (which claims it first) and the reconciler (which counts the worker for it);
    // an on-demand worker of a spot-first lane keeps the spot price it is weighed against.
    let pinned = WorkerRecord {
        id: "i-0ccccccccccccccc3".into(),
        offering: key("g5.xlarge", "us-east-1a", CapacityType::OnDemand),
        pinned_job: Some("job-due".into()),
        spot_price_usd_per_h: Some(0.4375),
        ..rec.clone()
    };
    reg.register_launch(pinned.clone()).await.unwrap();
    assert_eq!(reg.get(&pinned.id).await.unwrap(), Some(pinned.clone()));
    let live = reg.list_live().await.unwrap().items;
    let listed = live.iter().find(|w| w.id == pinned.id).expect("listed");
    assert_eq!(listed.pinned_job.as_deref(), Some("job-due"));
    assert_eq!(listed.spot_price_usd_per_h, Some(0.4375));
    assert_eq!(live.iter().find(|w| w.id == rec.id).unwrap().spot_price_usd_per_h, None);
    // The row's key is the instance's ARN (the worker role may write only the row whose leading
    // key is its own ec2:SourceInstanceARN).
    let raw = c
        .dynamodb
        .get_item()
        .table_name(&name)
        .key(
            onoff_aws::state::WORKER_KEY,
            aws_sdk_dynamodb::types::AttributeValue::S(format!("{ARN_PREFIX}{}", rec.id)),
        )
        .send()
        .await
        .unwrap();
    assert!(raw.item().is_some(), "keyed by {ARN_PREFIX}{}", rec.id);
    reg.set_state(&rec.id, WorkerState::Draining).await.unwrap();
    assert_eq!(reg.get(&rec.id).await.unwrap().unwrap().state, WorkerState::Draining);
    assert_eq!(
        reg.set_state("i-0bbbbbbbbbbbbbbb2", WorkerState::Draining).await,
        Err(StoreError::NotFound("i-0bbbbbbbbbbbbbbb2".into()))
    );
    assert_eq!(reg.get("i-0bbbbbbbbbbbbbbb2").await.unwrap(), None);
    // A row its agent registered (price 0) takes the catalogue's price once; a priced row keeps
    // its own; an unknown worker is NotFound.
    let unpriced = WorkerRecord {
        id: "i-0ddddddddddddddd4".into(),
        price_usd_per_h: 0.0,
        ..rec.clone()
    };
    reg.register_launch(unpriced.clone()).await.unwrap();
    assert!(reg.set_price_if_unpriced(&unpriced.id, 0.39).await.unwrap());
    assert!(!reg.set_price_if_unpriced(&unpriced.id, 9.0).await.unwrap());
    assert_eq!(reg.get(&unpriced.id).await.unwrap().unwrap().price_usd_per_h, 0.39);
    assert!(!reg.set_price_if_unpriced(&rec.id, 9.0).await.unwrap());
    assert_eq!(reg.get(&rec.id).await.unwrap().unwrap().price_usd_per_h, 0.39);
    assert_eq!(
        reg.set_price_if_unpriced("i-0bbbbbbbbbbbbbbb2", 0.39).await,
        Err(StoreError::NotFound("i-0bbbbbbbbbbbbbbb2".into()))
    );
    // A hold is written on an Idle row only, and only to extend it; an unknown worker is NotFound.
    assert!(
        !reg.hold_idle(&rec.id, 1_700_000_900.0).await.unwrap(),
        "Draining: not held"
    );
    reg.set_state(&rec.id, WorkerState::Idle).await.unwrap();
    assert!(reg.hold_idle(&rec.id, 1_700_000_900.0).await.unwrap());
    assert!(
        !reg.hold_idle(&rec.id, 1_700_000_800.0).await.unwrap(),
        "never shortened"
    );
    assert!(reg.hold_idle(&rec.id, 1_700_001_200.0).await.unwrap());
    assert_eq!(
        reg.get(&rec.id).await.unwrap().unwrap().hold_until,
        Some(1_700_001_200.0)
    );
    assert_eq!(
        reg.hold_idle("i-0bbbbbbbbbbbbbbb2", 1_700_000_900.0).await,
        Err(StoreError::NotFound("i-0bbbbbbbbbbbbbbb2".into()))
    );
    // A missing table is a clear error, not a panic.
    let missing = DynamoWorkers::new(c.dynamodb.clone(), unique("no-such-table"), ARN_PREFIX);
    let err = missing.register_launch(rec).await.unwrap_err().to_string();
    assert!(
        err.contains("table not found") || err.contains("ResourceNotFound"),
        "{err}"
    );
}

#[tokio::test]
async fn the_workers_table_keeps_the_registry_contract_the_fake_keeps() {
    // The same steps the fake's test runs (crates/control/tests/contract.rs).
    let c = clients().await;
    let name = unique("workers");
    table(&c, &name, onoff_aws::state::WORKER_KEY).await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &name, ARN_PREFIX);
    let beat = |id: String, state, idle_since, now| {
        let reg = reg.clone();
        async move { reg.heartbeat(&id, state, idle_since, now).await }
    };
    contract::worker_rows_keep_their_conditions(&reg, beat, "i-0c0ffee000000000", 1_700_000_000.0).await;
}

#[tokio::test]
async fn the_workers_table_records_an_agents_cached_projects_as_the_fake_does() {
    let c = clients().await;
    let name = unique("workers");
    table(&c, &name, onoff_aws::state::WORKER_KEY).await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &name, ARN_PREFIX);
    let set = |id: String, projects: Vec<String>| {
        let reg = reg.clone();
        async move { reg.set_cached_projects(&id, &projects).await }
    };
    contract::cached_projects_are_recorded_bounded(&reg, set, "i-0cac4e0000000000", 1_700_000_000.0).await;
}

#[tokio::test]
async fn scale_down_and_an_agent_claim_race_through_conditional_writes_and_one_wins() {
    let c = clients().await;
    let name = unique("workers");
    table(&c, &name, onoff_aws::state::WORKER_KEY).await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &name, ARN_PREFIX);
    let worker = |id: &str| {
        WorkerRecord::launched(
            id,
            "standard",
            key("g5.xlarge", "us-east-1a", CapacityType::Spot),
            0.39,
            1_700_000_000.0,
        )
    };
    let (a, b) = ("i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2");
    for id in [a, b] {
        reg.register_launch(worker(id)).await.unwrap();
        reg.heartbeat(id, WorkerState::Idle, Some(1_700_000_100.0), 1_700_000_100.0)
            .await
            .unwrap();
    }
    // `a`: the agent claims first; scale-down's move from Idle is refused and leaves it Running.
    assert_eq!(reg.mark_busy(a, 1_700_000_200.0).await, Ok(true));
    let row = reg.get(a).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.heartbeat_at, row.idle_since),
        (WorkerState::Running, Some(1_700_000_200.0), None)
    );
    assert_eq!(
        reg.set_state_if(a, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(false)
    );
    assert_eq!(reg.get(a).await.unwrap().unwrap().state, WorkerState::Running);
    // `b`: scale-down first; the agent's claim is refused.
    assert_eq!(
        reg.set_state_if(b, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(true)
    );
    assert_eq!(reg.mark_busy(b, 1_700_000_200.0).await, Ok(false));
    assert_eq!(reg.get(b).await.unwrap().unwrap().state, WorkerState::Terminating);
    // A Draining worker (an interruption notice) takes no job either; several `from` states.
    assert_eq!(
        reg.set_state_if(
            a,
            WorkerState::Draining,
            &[WorkerState::Pending, WorkerState::Running, WorkerState::Idle]
        )
        .await,
        Ok(true)
    );
    assert_eq!(reg.mark_busy(a, 1_700_000_300.0).await, Ok(false));
    // The agent's heartbeats never revive a worker the control plane is retiring: the state
    // stays, the heartbeat time is written (the reaper sees the agent alive while it finishes).
    assert!(matches!(
        reg.heartbeat(a, WorkerState::Idle, Some(1_700_000_400.0), 1_700_000_400.0)
            .await,
        Err(StoreError::Conflict(_))
    ));
    let row = reg.get(a).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.heartbeat_at),
        (WorkerState::Draining, Some(1_700_000_400.0))
    );
    assert!(matches!(
        reg.heartbeat(b, WorkerState::Running, None, 1_700_000_400.0).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(reg.get(b).await.unwrap().unwrap().state, WorkerState::Terminating);
    // Unknown workers are NotFound for every write.
    assert_eq!(
        reg.heartbeat("i-0bbbbbbbbbbbbbbb8", WorkerState::Idle, None, 1.0).await,
        Err(StoreError::NotFound("i-0bbbbbbbbbbbbbbb8".into()))
    );
    let gone = "i-0bbbbbbbbbbbbbbb9";
    assert_eq!(
        reg.set_state_if(gone, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Err(StoreError::NotFound(gone.into()))
    );
    assert_eq!(reg.mark_busy(gone, 1.0).await, Err(StoreError::NotFound(gone.into())));
    assert_eq!(reg.get(gone).await.unwrap(), None, "a refused write creates no row");
    assert_eq!(reg.set_state_if(a, WorkerState::Idle, &[]).await, Ok(false));
}

#[tokio::test]
async fn the_event_log_reads_without_recording() {
    use onoff_control::ports::EventLog;
    let c = clients().await;
    let name = unique("control");
    table(&c, &name, "pk").await;
    let ctl = DynamoControl::new(c.dynamodb.clone(), &name);
    assert!(!ctl.seen("e-1").await.unwrap());
    assert!(!ctl.seen("e-1").await.unwrap(), "reading does not record");
    assert!(ctl.first_time("e-1", 1_700_000_000.0).await.unwrap());
    assert!(ctl.seen("e-1").await.unwrap());
    assert!(!ctl.first_time("e-1", 1_700_000_001.0).await.unwrap());
}

/// The arrivals index lists every job of a lane, finished ones too, in creation order: the same
/// steps the fake's test runs (crates/control/tests/contract.rs), on the table as the local stack
/// provisions it (template.yaml's indexes).
#[tokio::test]
async fn the_arrivals_index_lists_every_job_of_a_lane() {
    let c = clients().await;
    let name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &name).await.unwrap();
    let jobs = onoff_aws::jobs::DynamoJobs::new(c.dynamodb.clone(), &name);
    contract::arrivals_list_every_job_of_the_lane(&jobs, || async {}, "arr", 1_700_000_000.0).await;
}

/// The run times of a lane's last jobs to finish, from the sparse run_times index: the fake's steps.
#[tokio::test]
async fn finished_run_times_are_the_lanes_latest() {
    let c = clients().await;
    let name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &name).await.unwrap();
    let jobs = onoff_aws::jobs::DynamoJobs::new(c.dynamodb.clone(), &name);
    contract::finished_run_times_are_the_lanes_latest(&jobs, || async {}, "fin", "standard", 1_700_000_000.0).await;
}

/// A lane's arrival statistics kept in the control table: the fake's steps.
#[tokio::test]
async fn arrival_stats_are_kept_over_what_was_read() {
    let c = clients().await;
    let name = unique("control");
    table(&c, &name, "pk").await;
    let ctl = DynamoControl::new(c.dynamodb.clone(), &name);
    contract::arrival_stats_are_kept_over_what_was_read(&ctl, "standard").await;
    // Statistics an older build kept in another format start afresh, and the next save replaces
    // them (else every run would fall back to the unfinished jobs for good).
    use onoff_control::ports::ArrivalStatsStore;
    c.dynamodb
        .put_item()
        .table_name(&name)
        .item("pk", aws_sdk_dynamodb::types::AttributeValue::S("arrivals#old".into()))
        .item("folded_to", aws_sdk_dynamodb::types::AttributeValue::N("1000".into()))
        .item(
            "stats",
            aws_sdk_dynamodb::types::AttributeValue::S("{\"v0\": []}".into()),
        )
        .send()
        .await
        .unwrap();
    let read = ctl.load_arrival_stats("old").await.unwrap().unwrap();
    assert_eq!((read.folded_to, read.gaps.len()), (1000.0, 0));
    let next = onoff_control::ports::ArrivalStats {
        folded_to: 2000.0,
        ..read
    };
    assert!(ctl.save_arrival_stats("old", &next, Some(1000.0)).await.unwrap());
    assert_eq!(ctl.load_arrival_stats("old").await.unwrap().unwrap().folded_to, 2000.0);
}

#[tokio::test]
async fn unavailable_offerings_keep_the_latest_expiry() {
    let c = clients().await;
    let name = unique("control");
    table(&c, &name, "pk").await;
    let ctl = DynamoControl::new(c.dynamodb.clone(), &name);
    // The same steps the fake's test runs (crates/control/tests/contract.rs).
    let k = key("g6.xlarge", "us-east-1c", CapacityType::Spot);
    contract::unavailable_offerings_keep_the_latest_expiry(&ctl, k.clone(), 0.0).await;
    let got = ctl.unavailable(500.0).await.unwrap();
    assert_eq!((got.len(), got[0].until), (1, 2_000.0), "read as the trait lists it");
    assert!(ctl.unavailable(2_500.0).await.unwrap().is_empty());
    // A full vCPU quota is kept the same way, and read back as itself.
    use onoff_control::quota::{QuotaBucket, QuotaMark};
    let m = QuotaMark {
        bucket: QuotaBucket::GAndVt,
        capacity: CapacityType::Spot,
        vcpus: 4,
        until: 3_000.0,
        ceiling: Some(36),
    };
    ctl.mark_unavailable(&m.key(), m.until).await.unwrap();
    let (marks, rest) = QuotaMark::split(ctl.unavailable(2_500.0).await.unwrap());
    assert_eq!((marks, rest.len()), (vec![m], 0));
}

#[tokio::test]
async fn insufficient_capacity_on_the_first_offering_falls_back_to_the_next() {
    let c = clients().await;
    let workers = unique("workers");
    let control = unique("control");
    table(&c, &workers, onoff_aws::state::WORKER_KEY).await;
    table(&c, &control, "pk").await;
    let fleet = FaultyFleet::new(own_fleet(&c).await);
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &workers, ARN_PREFIX);
    let ctl = DynamoControl::new(c.dynamodb.clone(), &control);
    let first = key("g5.xlarge", "us-east-1a", CapacityType::Spot);
    fleet.set_no_capacity(first.clone());
    let offerings: Vec<Offering> = ["us-east-1a", "us-east-1b"]
        .into_iter()
        .map(|z| Offering {
            key: key("g5.xlarge", z, CapacityType::Spot),
            gpus: 1,
            gpu_model: "NVIDIA A10G".into(),
            gpu_memory_gib: 24.0,
            vcpus: 4,
            price_usd_per_h: 0.39,
            interruption: None,
        })
        .collect();
    let lane_name = unique("lane");
    let mut cfg = PolicyConfig::default();
    cfg.lanes[1].name = lane_name.clone();
    let plan = Plan {
        actions: vec![Action::Launch {
            lane: 1,
            offering: first.clone(),
            price_usd_per_h: 0.39,
            count: 2,
            request: LaunchShape {
                gpus: 1,
                min_gpu_memory_gib: 16.0,
                capacity: CapacityPreference::SpotFirst,
                runtime_s: 3600.0,
                max_cost_usd: None,
            },
            project: None,
            job: None,
            reason: Reason::UnmetBacklog { unmet_jobs: 2 },
        }],
        ..Plan::default()
    };
    let now = 1_700_000_000.0;
    let ctx = ActContext {
        cfg: &cfg,
        offerings: &offerings,
        unavailable: &[],
        now,
        table: None,
        run_time_estimates: &[],
    };
    let out = act(&plan, ctx, &fleet, &reg, &ctl).await;
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.capacity_errors, vec![first.clone()]);
    assert_eq!(out.launched.len(), 2);
    // The instances exist in EC2, in the second zone, tagged with the lane.
    let mine: Vec<_> = fleet
        .inner()
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .filter(|i| i.lane.as_deref() == Some(&lane_name))
        .collect();
    assert_eq!(mine.len(), 2);
    assert!(mine.iter().all(|i| i.zone == "us-east-1b"));
    // Registered as Pending, and the first offering is skipped for the TTL.
    for l in &out.launched {
        assert_eq!(
            reg.get(&l.launched.instance_id).await.unwrap().unwrap().state,
            WorkerState::Pending
        );
    }
    let un = ctl.unavailable(now).await.unwrap();
    assert_eq!(un.len(), 1);
    assert_eq!(un[0].key, first);
    assert_eq!(un[0].until, now + cfg.offers.unavailable_ttl_s);
}

#[tokio::test]
async fn submit_writes_one_job_and_one_message_and_rejects_bad_specs_with_a_record() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::ports::JobStore;
    use onoff_control::submit::{submit, Source, SubmitError, Submitted};
    let c = clients().await;
    let table_name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &table_name).await.unwrap();
    let url = c
        .sqs
        .create_queue()
        .queue_name(unique("standard"))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &table_name);
    let queue = SqsQueues::new(c.sqs.clone(), vec![("standard".into(), url)]);
    let lanes = ["express", "standard"];
    let now = 1_700_000_000.0;
    let src = Source::S3 {
        bucket: "b".into(),
        key: "jobs/train.json".into(),
        etag: "\"abc\"".into(),
        version: None,
    };
    let spec = r#"{"image":"img","command":["python","train.py"],"project":"vision"}"#;
    let Submitted::New(id) = submit(spec, &src, &lanes, now, &jobs, &queue).await.unwrap() else {
        panic!()
    };
    // The S3 event delivered twice is one job, one message.
    assert_eq!(
        submit(spec, &src, &lanes, now, &jobs, &queue).await.unwrap(),
        Submitted::Existing(id.clone())
    );
    let rec = jobs.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.sent_at, rec.spec.command.len()),
        (JobState::Queued, Some(now), 2)
    );
    let msgs = queue.receive("standard", 10, 0, 60).await.unwrap();
    assert_eq!(msgs.len(), 1);
    assert!(msgs[0].body.contains(&id));
    // A bad spec: an error record with the reason, no job, no message.
    let bad_src = Source::S3 {
        bucket: "b".into(),
        key: "jobs/bad.json".into(),
        etag: "\"def\"".into(),
        version: None,
    };
    let err = submit(
        r#"{"image":"img","command":"bash -c x","project":"vision"}"#,
        &bad_src,
        &lanes,
        now,
        &jobs,
        &queue,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, SubmitError::Rejected { .. }));
    let reason = jobs.error_record(&bad_src.describe()).await.unwrap().unwrap();
    assert!(reason.contains("argv array"), "{reason}");
    // One from an S3 key near S3's 1,024 bytes: `error#` and its source would pass the `active`
    // index's 1,024-byte sort key, which moto refuses (before, the rejection was retried until
    // the event was dead-lettered); its record's id is bounded, and found by its source.
    let long_src = Source::S3 {
        bucket: "b".into(),
        key: format!("jobs/{}.json", "k".repeat(1000)),
        etag: "\"def\"".into(),
        version: Some("v1".into()),
    };
    let err = submit("{not json", &long_src, &lanes, now, &jobs, &queue)
        .await
        .unwrap_err();
    assert!(matches!(err, SubmitError::Rejected { .. }), "{err:?}");
    assert!(jobs.error_record(&long_src.describe()).await.unwrap().is_some());
    assert!(queue.receive("standard", 10, 0, 60).await.unwrap().is_empty());
}

/// The reaper reads the lane queue's counts (`GetQueueAttributes`) before it re-sends: jobs whose
/// messages wait in the queue get no duplicate; jobs whose messages SQS moved to the dead-letter
/// queue by their receive count (received and handed back `maxReceiveCount` times) get fresh
/// ones; a message held in flight by a worker counts as there.
#[tokio::test]
async fn the_reaper_resends_only_the_wake_up_messages_the_queue_lacks() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::ports::JobStore;
    use onoff_control::reconcile::{reap_jobs, ReconcileOptions};
    use onoff_control::submit::{submit, Source};
    use std::collections::BTreeSet;
    let c = clients().await;
    let table_name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &table_name).await.unwrap();
    let (url, dlq) = queue_with_dlq(&c, "standard", 2).await;
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &table_name);
    let queue = SqsQueues::new(c.sqs.clone(), vec![("standard".into(), url), ("dlq".into(), dlq)]);
    let now = 1_700_000_000.0;
    for i in 0..3 {
        let spec = format!(r#"{{"image":"img","command":["x"],"project":"p","client_token":"t{i}"}}"#);
        let src = Source::Sqs {
            message_id: format!("m{i}"),
        };
        submit(&spec, &src, &["standard"], now, &jobs, &queue).await.unwrap();
    }
    let opts = ReconcileOptions::default();
    let reap = |at: f64| {
        let (jobs, queue, opts) = (&jobs, &queue, &opts);
        async move {
            let active = jobs.active().await.unwrap().items;
            reap_jobs(&active, &BTreeSet::new(), opts, at, jobs, queue).await
        }
    };
    // Due (no message sent for two lease periods), but every message is in the queue.
    let r = reap(now + opts.resend_after_s).await;
    assert!(r.woken.is_empty() && r.errors.is_empty(), "{r:?}");
    assert_eq!(r.spared, 3);
    // Every message is received and handed back at once, twice (workers being retired): on the
    // next receive SQS moves each to the dead-letter queue.
    for _ in 0..3 {
        for m in queue.receive("standard", 10, 0, 0).await.unwrap() {
            assert!(m.receive_count <= 2, "{m:?}");
        }
    }
    assert_eq!(queue.receive("dlq", 10, 0, 30).await.unwrap().len(), 3);
    let r = reap(now + 2.0 * opts.resend_after_s).await;
    assert_eq!((r.woken.len(), r.spared), (3, 0), "{r:?}");
    // A worker holds one of the fresh messages in flight: it counts, no duplicate.
    assert_eq!(queue.receive("standard", 1, 0, 300).await.unwrap().len(), 1);
    let r = reap(now + 3.0 * opts.resend_after_s).await;
    assert_eq!((r.woken.len(), r.spared), (0, 3), "{r:?}");
    let b = queue.backlog("standard").await.unwrap();
    assert_eq!((b.visible, b.in_flight), (2, 1));
}

#[tokio::test]
async fn two_workers_claiming_one_job_get_one_claim() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::job::{AttemptEnd, RerunLimits, Settle};
    use onoff_control::ports::{Claim, JobStore};
    let c = clients().await;
    let table_name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &table_name).await.unwrap();
    let url = c
        .sqs
        .create_queue()
        .queue_name(unique("standard"))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &table_name);
    let queue = SqsQueues::new(c.sqs.clone(), vec![("standard".into(), url)]);
    let now = 1_700_000_000.0;
    let id = new_job(&jobs, &queue, "t-1", now).await;
    let limits = RerunLimits::default();
    for round in 0..5 {
        let t = now + f64::from(round) * 1000.0;
        // Two claims for the same message, one after the other at the same instant: moto applies
        // a conditional update and its check without a lock, so truly concurrent requests can both
        // pass there (DynamoDB itself is atomic); the concurrent race is tested against the fake.
        let a = jobs.claim(&id, "i-a", t + 300.0, t).await.unwrap();
        let b = jobs.claim(&id, "i-b", t + 300.0, t).await.unwrap();
        let won: Vec<&Claim> = [&a, &b]
            .into_iter()
            .filter(|c| matches!(c, Claim::Claimed(_)))
            .collect();
        assert_eq!(won.len(), 1, "round {round}");
        // An expired lease is not taken over by a claim: the reaper ends it, conditioned on the
        // lease it saw, so a renewed lease is never stripped.
        assert_eq!(
            jobs.claim(&id, "i-c", t + 900.0, t + 400.0).await.unwrap(),
            Claim::NotClaimable(JobState::Running)
        );
        let Claim::Claimed(seen) = won[0] else { unreachable!() };
        let lost = Settle::of(seen, &AttemptEnd::LeaseLost("expired".into()), &limits);
        let holder = seen.lease_owner.clone().unwrap();
        jobs.renew(&id, &holder, t + 600.0).await.unwrap();
        assert!(matches!(
            jobs.requeue_lost(&id, &holder, t + 300.0, &lost, t + 400.0).await,
            Err(StoreError::Conflict(_))
        ));
        jobs.requeue_lost(&id, &holder, t + 600.0, &lost, t + 700.0)
            .await
            .unwrap();
    }
    let rec = jobs.get(&id).await.unwrap().unwrap();
    // Five lost leases: the attempts were taken back, the losses counted; the fifth failed it.
    assert_eq!((rec.state, rec.attempts, rec.lease_expiries), (JobState::Failed, 0, 5));
    assert!(
        rec.reason
            .as_deref()
            .unwrap_or_default()
            .contains("lost its worker 5 times"),
        "{rec:?}"
    );
    assert!(rec.finished_at.is_some());
    assert!(jobs.active().await.unwrap().items.iter().all(|j| j.id != id));
    // A second job for the lease holder's writes.
    let id = new_job(&jobs, &queue, "t-2", now).await;
    assert!(jobs.active().await.unwrap().items.iter().any(|j| j.id == id));
    let Claim::Claimed(rec) = jobs.claim(&id, "i-a", now + 300.0, now).await.unwrap() else {
        panic!()
    };
    // The lease holder records checkpoints and cost; nobody else can.
    let holder = rec.lease_owner.clone().unwrap();
    jobs.record_progress(&id, &holder, Some("checkpoints/j/00000000000000000003/"), 0.5)
        .await
        .unwrap();
    jobs.record_progress(&id, &holder, None, 0.75).await.unwrap();
    assert!(matches!(
        jobs.record_progress(&id, "i-intruder", None, 1.0).await,
        Err(StoreError::Conflict(_))
    ));
    let rec = jobs.get(&id).await.unwrap().unwrap();
    assert_eq!(
        rec.last_checkpoint.as_deref(),
        Some("checkpoints/j/00000000000000000003/")
    );
    assert!((rec.cost_usd - 0.75).abs() < 1e-9);
    // Only the holder renews; a release after a spot notice takes the attempt back.
    jobs.renew(&id, &holder, now + 9e3).await.unwrap();
    assert!(matches!(
        jobs.renew(&id, "i-intruder", now + 9e3).await,
        Err(StoreError::Conflict(_))
    ));
    let released = Settle::of(&rec, &AttemptEnd::Released("spot notice".into()), &limits);
    jobs.finish(&id, &holder, &released, now).await.unwrap();
    let rec = jobs.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.attempts, rec.lease_owner.clone()),
        (JobState::Queued, 0, None)
    );
    assert!(matches!(
        jobs.finish(&id, &holder, &Settle::of(&rec, &AttemptEnd::Succeeded, &limits), now)
            .await,
        Err(StoreError::Conflict(_))
    ));
    let Claim::Claimed(rec) = jobs.claim(&id, "i-d", now + 9e3, now).await.unwrap() else {
        panic!()
    };
    jobs.finish(&id, "i-d", &Settle::of(&rec, &AttemptEnd::Succeeded, &limits), now)
        .await
        .unwrap();
    // Transitions are conditional: only from the state the job is in.
    assert!(matches!(
        jobs.transition(&id, JobState::Running, JobState::Failed).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        jobs.claim(&id, "i-c", now + 9e4, now + 9e3).await.unwrap(),
        Claim::NotClaimable(JobState::Succeeded)
    );
    let rec = jobs.get(&id).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.lease_owner), (JobState::Succeeded, None));
    assert_eq!(
        jobs.claim("job-unknown", "i-c", 1.0, 0.0).await.unwrap(),
        Claim::Unknown
    );
}

/// A lease holder's write that DynamoDB applied but whose answer was lost is retried by the SDK,
/// and the retry fails its own condition ("the expected condition is not met after the first
/// update", DynamoDB Developer Guide). The store reads the row back and takes its own write as
/// done: a claim is the worker's, a settle (with or without an attempt record) and a re-queue of
/// a lost lease are done, not a lost lease or a conflict; a progress record sets the cost so far,
/// so the retry counts nothing twice; a scale-down's move of a worker to Terminating is done; a
/// cancel of a waiting job is a cancel, not "already finished"; an operator's transition is done.
/// Each write is applied once.
#[tokio::test]
async fn a_write_applied_whose_answer_was_lost_is_taken_as_done_on_the_retry() {
    use onoff_aws::jobs::DynamoJobs;
    let conf = conf().await;
    let c = Clients::from_conf(&conf);
    let lose = onoff_aws::faults::LoseAnswers::when_armed();
    let lossy = aws_sdk_dynamodb::Client::from_conf(
        aws_sdk_dynamodb::config::Builder::from(&conf)
            .interceptor(lose.clone())
            .build(),
    );
    let table_name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &table_name).await.unwrap();
    let jobs_client = lossy.clone();
    let jobs = DynamoJobs::new(lossy, &table_name);
    let now = 1_700_000_000.0;

    // Every job write, each sent again after its answer was lost: the same steps the fake's test
    // runs (crates/control/tests/contract.rs), so the two stores are held to one contract.
    contract::lost_answers_are_taken_as_done(&jobs, || lose.arm(), "lost", now).await;
    assert_eq!(lose.lost(), 12, "every write the contract armed lost its answer");
    // The reaper's end of a job past its lane's quota wait limit: conditioned on the row as read
    // (a size() of the attempt log, a list), its retry after a lost answer this call's.
    contract::a_waiting_job_is_failed_only_as_it_was_read(&jobs, || lose.arm(), "quota", now).await;
    assert_eq!(lose.lost(), 13, "the end's lost answer");

    // A scale-down's move of an idle worker to Terminating: done on the retry, so its instance
    // is terminated (refused, it would be left running under a Terminating row).
    let workers = unique("workers");
    table(&c, &workers, onoff_aws::state::WORKER_KEY).await;
    let lossy_workers = DynamoWorkers::new(jobs_client.clone(), &workers, ARN_PREFIX);
    // An idle g5.xlarge worker at `price` $/h (0: registered by its agent, unpriced).
    let register_idle = |id: &'static str, price: f64| {
        let w = &lossy_workers;
        async move {
            w.register_launch(WorkerRecord {
                state: WorkerState::Idle,
                ..WorkerRecord::launched(
                    id,
                    "standard",
                    key("g5.xlarge", "us-east-1a", CapacityType::Spot),
                    price,
                    now,
                )
            })
            .await
            .unwrap();
        }
    };
    let idle = "i-0aaaaaaaaaaaaaaa7";
    register_idle(idle, 0.4).await;
    let lost_before = lose.lost();
    lose.arm();
    assert_eq!(
        lossy_workers
            .set_state_if(idle, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(true)
    );
    assert_eq!(lose.lost(), lost_before + 1);
    // A worker its agent took meanwhile is still refused.
    lossy_workers.set_state(idle, WorkerState::Running).await.unwrap();
    assert_eq!(
        lossy_workers
            .set_state_if(idle, WorkerState::Terminating, &[WorkerState::Idle])
            .await,
        Ok(false)
    );
    // The reconciler's price of a worker its agent registered, and a hold of an idle one: done
    // on the retry (refused, the hold would go uncounted and the price unread until the next run).
    let unpriced = "i-0aaaaaaaaaaaaaaa8";
    register_idle(unpriced, 0.0).await;
    let lost_before = lose.lost();
    lose.arm();
    assert_eq!(lossy_workers.set_price_if_unpriced(unpriced, 0.4212).await, Ok(true));
    assert_eq!(lose.lost(), lost_before + 1);
    assert_eq!(
        lossy_workers.set_price_if_unpriced(unpriced, 0.5).await,
        Ok(false),
        "priced"
    );
    lose.arm();
    assert_eq!(lossy_workers.hold_idle(unpriced, now + 600.5).await, Ok(true));
    assert_eq!(lose.lost(), lost_before + 2);
    assert_eq!(
        lossy_workers.hold_idle(unpriced, now + 300.0).await,
        Ok(false),
        "never shortened"
    );
    let row = lossy_workers.get(unpriced).await.unwrap().unwrap();
    assert_eq!((row.price_usd_per_h, row.hold_until), (0.4212, Some(now + 600.5)));
}

#[tokio::test]
async fn a_spot_warning_drains_the_worker_and_marks_its_offering_once() {
    use onoff_control::interruption::{handle_event, Handled};
    let c = clients().await;
    let workers = unique("workers");
    let control = unique("control");
    table(&c, &workers, onoff_aws::state::WORKER_KEY).await;
    table(&c, &control, "pk").await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &workers, ARN_PREFIX);
    let ctl = DynamoControl::new(c.dynamodb.clone(), &control);
    let id = "i-0b662ef9931388ba0";
    let offering = key("g5.xlarge", "us-east-1a", CapacityType::Spot);
    reg.register_launch(WorkerRecord {
        state: WorkerState::Running,
        ..WorkerRecord::launched(id, "standard", offering.clone(), 0.39, 1_700_000_000.0)
    })
    .await
    .unwrap();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../events/spot-interruption-warning.json"
    ))
    .unwrap();
    let event: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cfg = PolicyConfig::default();
    let now = 1_700_000_100.0;
    assert_eq!(
        handle_event(&event, &cfg, &reg, &ctl, &ctl, now).await.unwrap(),
        Handled::Drained { worker: id.into() }
    );
    assert_eq!(
        handle_event(&event, &cfg, &reg, &ctl, &ctl, now + 5.0).await.unwrap(),
        Handled::Duplicate
    );
    assert_eq!(reg.get(id).await.unwrap().unwrap().state, WorkerState::Draining);
    let un = ctl.unavailable(now).await.unwrap();
    assert_eq!(un.len(), 1);
    assert_eq!(
        (un[0].key.clone(), un[0].until),
        (offering, now + cfg.offers.unavailable_ttl_s)
    );
}

#[tokio::test]
async fn checkpoints_stream_up_manifest_last_and_only_complete_ones_count() {
    use onoff_aws::checkpoints::{S3Checkpoints, MANIFEST};
    use onoff_control::ports::CheckpointStore;
    let c = clients().await;
    let bucket = unique("onoff-ckpt");
    c.s3.create_bucket().bucket(&bucket).send().await.unwrap();
    let store = S3Checkpoints::new(c.s3.clone(), &bucket).with_part_size(5 * 1024 * 1024);
    let dir = std::env::temp_dir().join(unique("ckpt-src"));
    std::fs::create_dir_all(dir.join("opt")).unwrap();
    // 11 MiB of non-repeating bytes: three multipart parts of 5 MiB, 5 MiB and 1 MiB.
    let big: Vec<u8> = (0..11 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(dir.join("model.bin"), &big).unwrap();
    std::fs::write(dir.join("opt/state.json"), br#"{"step": 1200}"#).unwrap();
    assert_eq!(store.latest("job-1").await.unwrap(), None);
    let r = store.upload("job-1", 3, &dir).await.unwrap();
    assert_eq!(
        r.files,
        vec![
            ("model.bin".to_string(), big.len() as u64),
            ("opt/state.json".to_string(), 14)
        ]
    );
    // A later checkpoint whose upload died before its manifest: its files exist, it does not count.
    c.s3.put_object()
        .bucket(&bucket)
        .key("checkpoints/job-1/00000000000000000004/model.bin")
        .body(aws_sdk_s3::primitives::ByteStream::from_static(b"half"))
        .send()
        .await
        .unwrap();
    let latest = store.latest("job-1").await.unwrap().unwrap();
    assert_eq!(latest, r);
    let dest = std::env::temp_dir().join(unique("ckpt-dst"));
    store.download(&latest, &dest).await.unwrap();
    assert_eq!(std::fs::read(dest.join("model.bin")).unwrap(), big);
    assert_eq!(
        std::fs::read(dest.join("opt/state.json")).unwrap(),
        br#"{"step": 1200}"#
    );
    // Once checkpoint 5 is complete, it is the latest.
    let r5 = store.upload("job-1", 5, &dir).await.unwrap();
    assert_eq!(store.latest("job-1").await.unwrap().unwrap().seq, 5);
    assert_eq!(r5.seq, 5);
    let keys: Vec<String> =
        c.s3.list_objects_v2()
            .bucket(&bucket)
            .prefix("checkpoints/job-1/00000000000000000005/")
            .send()
            .await
            .unwrap()
            .contents()
            .iter()
            .filter_map(|o| o.key().map(str::to_string))
            .collect();
    assert!(keys.iter().any(|k| k.ends_with(MANIFEST)), "{keys:?}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&dest).ok();
}

/// A file whose key S3 would refuse (over 1,024 bytes, prefix included) fails the checkpoint,
/// naming the file, before any byte goes up: no part of it is left in the bucket.
#[tokio::test]
async fn a_checkpoint_with_a_path_too_long_for_s3_is_refused_whole_and_named() {
    use onoff_aws::checkpoints::S3Checkpoints;
    use onoff_control::ports::CheckpointStore;
    let c = clients().await;
    let bucket = unique("onoff-ckpt");
    c.s3.create_bucket().bucket(&bucket).send().await.unwrap();
    let store = S3Checkpoints::new(c.s3.clone(), &bucket);
    let dir = std::env::temp_dir().join(unique("ckpt-deep"));
    let deep = (0..4)
        .map(|i| format!("{i}{}", "d".repeat(249)))
        .collect::<Vec<_>>()
        .join("/");
    std::fs::create_dir_all(dir.join(&deep)).unwrap();
    std::fs::write(dir.join(&deep).join("state.bin"), b"deep").unwrap();
    std::fs::write(dir.join("model.bin"), b"model").unwrap();
    let err = store.upload("job-deep", 1, &dir).await.unwrap_err().to_string();
    assert!(err.contains("state.bin") && err.contains("at most 1024"), "{err}");
    let listed = c.s3.list_objects_v2().bucket(&bucket).send().await.unwrap();
    assert!(listed.contents().is_empty(), "{:?}", listed.contents());
    assert_eq!(store.latest("job-deep").await.unwrap(), None);
    // A job's outputs likewise.
    let err = store
        .upload_dir(&dir, "outputs/job-deep/")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("state.bin"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// File names XML 1.0 cannot carry (control characters) or that URL encoding changes (spaces,
/// `+`, `%`, non-ASCII): S3 lists such keys only URL-encoded ("the XML 1.0 parser can't parse
/// certain characters, such as characters with an ASCII value from 0 to 10", ListObjectsV2,
/// `EncodingType`). The latest checkpoint is still found, and comes back byte for byte.
#[tokio::test]
async fn checkpoint_files_with_names_xml_cannot_carry_are_listed_and_restored() {
    use onoff_aws::checkpoints::S3Checkpoints;
    use onoff_control::ports::CheckpointStore;
    let c = clients().await;
    let bucket = unique("onoff-ckpt-names");
    c.s3.create_bucket().bucket(&bucket).send().await.unwrap();
    let store = S3Checkpoints::new(c.s3.clone(), &bucket);
    let dir = std::env::temp_dir().join(unique("ckpt-names"));
    let names = ["bell\u{7}.bin", "tab\there.bin", "a b+c%41 ü.bin", "plain.bin"];
    for (i, n) in names.iter().enumerate() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(n), vec![i as u8; 10 + i]).unwrap();
    }
    let r = store.upload("job-names", 1, &dir).await.unwrap();
    assert_eq!(r.files.len(), names.len());
    let latest = store
        .latest("job-names")
        .await
        .unwrap()
        .expect("the checkpoint is found");
    assert_eq!(latest, r);
    let dest = std::env::temp_dir().join(unique("ckpt-names-dst"));
    store.download(&latest, &dest).await.unwrap();
    for (i, n) in names.iter().enumerate() {
        assert_eq!(std::fs::read(dest.join(n)).unwrap(), vec![i as u8; 10 + i], "{n:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&dest).ok();
}

#[tokio::test]
async fn checkpoints_of_many_files_and_parts_go_up_and_down_concurrently_byte_for_byte() {
    use onoff_aws::checkpoints::S3Checkpoints;
    use onoff_control::ports::CheckpointStore;
    let c = clients().await;
    let bucket = unique("onoff-ckpt");
    c.s3.create_bucket().bucket(&bucket).send().await.unwrap();
    // 3 at a time over 12 small files and two multipart files (4 + 3 parts of 5 MiB).
    let store = S3Checkpoints::new(c.s3.clone(), &bucket)
        .with_part_size(5 * 1024 * 1024)
        .with_concurrency(3);
    let dir = std::env::temp_dir().join(unique("ckpt-many"));
    let mut want = Vec::new();
    for i in 0..12u32 {
        let rel = format!("shard-{:02}/state-{i}.bin", i % 4);
        want.push((rel, (0..1000 + i * 37).map(|b| (b ^ i) as u8).collect::<Vec<u8>>()));
    }
    for (name, mib, seed) in [("a.bin", 18u32, 7u32), ("b.bin", 11, 13)] {
        let bytes = (0..mib * 1024 * 1024 + 3)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 11) as u8)
            .collect();
        want.push((name.to_string(), bytes));
    }
    for (rel, bytes) in &want {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
    let r = store.upload("job-many", 1, &dir).await.unwrap();
    assert_eq!(r.files.len(), want.len());
    let latest = store.latest("job-many").await.unwrap().unwrap();
    assert_eq!(latest, r);
    let dest = std::env::temp_dir().join(unique("ckpt-many-dst"));
    store.download(&latest, &dest).await.unwrap();
    for (rel, bytes) in &want {
        assert!(std::fs::read(dest.join(rel)).unwrap() == *bytes, "{rel} differs");
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&dest).ok();
}

#[tokio::test]
async fn submit_then_scaler_launches_tagged_instances_and_the_reaper_terminates_an_orphan() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::reconcile::{reconcile, ReconcileOptions};
    use onoff_control::submit::{submit, Source};
    let c = clients().await;
    let (jobs_t, workers_t, control_t) = (unique("jobs"), unique("workers"), unique("control"));
    onoff_aws::provision::jobs_table(&c, &jobs_t).await.unwrap();
    table(&c, &workers_t, onoff_aws::state::WORKER_KEY).await;
    table(&c, &control_t, "pk").await;
    let lane = unique("lane");
    let url = c
        .sqs
        .create_queue()
        .queue_name(unique("q"))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let queues = SqsQueues::new(c.sqs.clone(), vec![(lane.clone(), url)]);
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &jobs_t);
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &workers_t, ARN_PREFIX);
    let ctl = DynamoControl::new(c.dynamodb.clone(), &control_t);
    let subnets = Ec2Fleet::default_subnets(&c.ec2).await.unwrap();
    let deployment = unique("deploy");
    let fleet = Ec2Fleet::new(c.ec2.clone(), launch_template_name(&c).await)
        .with_subnets(subnets)
        .with_deployment(&deployment);
    let cfg = PolicyConfig {
        lanes: vec![onoff_policy::LaneConfig {
            name: lane.clone(),
            predictive_max: 0,
            ..Default::default()
        }],
        ..PolicyConfig::default()
    };
    let offerings: Vec<Offering> = vec![Offering {
        key: key("g5.xlarge", "us-east-1a", CapacityType::Spot),
        gpus: 1,
        gpu_model: "NVIDIA A10G".into(),
        gpu_memory_gib: 24.0,
        vcpus: 4,
        price_usd_per_h: 0.39,
        interruption: None,
    }];
    let now = onoff_aws::state::unix_now();
    for i in 0..2 {
        let spec = format!(r#"{{"image":"img","command":["python","train.py"],"project":"vision","lane":"{lane}"}}"#);
        let src = Source::S3 {
            bucket: "b".into(),
            key: format!("jobs/{i}.json"),
            etag: "e".into(),
            version: None,
        };
        submit(&spec, &src, &[lane.as_str()], now, &jobs, &queues)
            .await
            .unwrap();
    }
    // The scaler (no reaping): one launch per job, through CreateFleet.
    let opts = ReconcileOptions {
        reap: false,
        ..ReconcileOptions::default()
    };
    let r = reconcile(&cfg, &offerings, &opts, now, &queues, &reg, &jobs, &fleet, &ctl)
        .await
        .unwrap();
    assert!(r.errors.is_empty() && r.acted.errors.is_empty(), "{r:?}");
    assert_eq!(r.acted.launched.len(), 2);
    // The report's fleet (the functions' metrics) is the table's, without listing it again.
    let mut listed = reg.list_live().await.unwrap().items;
    let mut reported = r.workers.clone();
    listed.sort_by(|a, b| a.id.cmp(&b.id));
    reported.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(reported, listed);
    let mine: Vec<_> = fleet
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .filter(|i| i.lane.as_deref() == Some(&lane))
        .collect();
    assert_eq!(mine.len(), 2);
    // Invoked again at once (the alarm after the submit): the booting workers count, no launch.
    let r = reconcile(&cfg, &offerings, &opts, now + 5.0, &queues, &reg, &jobs, &fleet, &ctl)
        .await
        .unwrap();
    assert!(r.acted.launched.is_empty(), "{:?}", r.plan);
    // An instance tagged onoff:managed that the workers table does not know is terminated by the
    // scheduled reconciler once past the launch grace period.
    let orphan = fleet
        .launch(&LaunchRequest {
            lane: unique("other"),
            offerings: vec![key("g5.xlarge", "us-east-1a", CapacityType::Spot)],
            count: 1,
            project: None,
            job: None,
            client_token: String::new(),
        })
        .await
        .unwrap();
    let reap = ReconcileOptions {
        launch_grace_s: 0.0,
        ..ReconcileOptions::default()
    };
    let r = reconcile(&cfg, &offerings, &reap, now + 10.0, &queues, &reg, &jobs, &fleet, &ctl)
        .await
        .unwrap();
    assert!(r.orphans_terminated.contains(&orphan.launched[0].instance_id), "{r:?}");
    let still: Vec<String> = fleet
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.instance_id)
        .collect();
    assert!(!still.contains(&orphan.launched[0].instance_id));
    assert!(
        mine.iter().all(|m| still.contains(&m.instance_id)),
        "the workers onoff knows stay"
    );
}

#[tokio::test]
async fn the_reconcile_lease_admits_one_holder_until_it_expires_or_is_released() {
    let c = clients().await;
    let control = unique("control");
    table(&c, &control, "pk").await;
    let ctl = DynamoControl::new(c.dynamodb.clone(), &control);
    // The same steps the fake's test runs (crates/control/tests/contract.rs).
    contract::the_lease_admits_one_holder_until_it_expires_or_is_released(&ctl).await;
}

/// The start of the latest completed run is kept, and only ever raised: a run that ends after a
/// later-started one does not take the mark back. The lease itself is untouched.
#[tokio::test]
async fn the_latest_completed_runs_start_is_kept_and_only_raised() {
    let c = clients().await;
    let control = unique("control");
    table(&c, &control, "pk").await;
    let ctl = DynamoControl::new(c.dynamodb.clone(), &control);
    // The same steps the fake's test runs (crates/control/tests/contract.rs).
    contract::the_latest_completed_runs_start_is_kept_and_only_raised(&ctl).await;
}

/// Scale requests on the control table: the first ask invokes, asks while it is pending join
/// it, a run settles only the count it read, a pending ask lapses after its stale time, and an
/// ask whose answer was lost (applied, then retried by the SDK) still invokes: its retry finds
/// its own token on the pending mark instead of joining a request nobody invoked.
#[tokio::test]
async fn scale_requests_join_the_pending_one_and_a_run_settles_only_what_it_saw() {
    let conf = conf().await;
    let c = Clients::from_conf(&conf);
    let control = unique("control");
    table(&c, &control, "pk").await;
    let lose = onoff_aws::faults::LoseAnswers::when_armed();
    let lossy = aws_sdk_dynamodb::Client::from_conf(
        aws_sdk_dynamodb::config::Builder::from(&conf)
            .interceptor(lose.clone())
            .build(),
    );
    let ctl = DynamoControl::new(lossy, &control);
    // The same steps the fake's test runs (crates/control/tests/contract.rs).
    contract::scale_requests_join_the_pending_one_and_a_run_settles_only_what_it_saw(&ctl, || lose.arm()).await;
    assert_eq!(
        lose.lost(),
        2,
        "the ask's and the settle's answers were lost and the writes retried"
    );
}

/// The jobs scale requests ask for are kept with the count, a string set in the same item, so
/// the run reads them by id where the eventually consistent index may not show them yet: added by
/// invoking and joining asks alike, each id once; forgotten by id, while an id asked for since
/// stays. The set is bounded (`MAX_KEPT_ASKED_JOBS` ids of at most `MAX_ASKED_JOB_ID_BYTES`), so
/// the item stays far under DynamoDB's 400 KB: once full, asks are counted without their ids.
#[tokio::test]
async fn asked_jobs_are_kept_with_the_count_and_forgotten_by_id() {
    let c = clients().await;
    let control = unique("control");
    table(&c, &control, "pk").await;
    let ctl = DynamoControl::new(c.dynamodb.clone(), &control);
    // The same steps the fake's test runs (crates/control/tests/contract.rs).
    contract::asked_jobs_are_kept_with_the_count_and_forgotten_by_id(&ctl).await;
}

/// A deployment on moto: tables, a lane queue with its DLQ, a launch template.
struct Deployment {
    lane: String,
    queues: SqsQueues,
    jobs: onoff_aws::jobs::DynamoJobs,
    workers: DynamoWorkers,
    control: DynamoControl,
    fleet: Ec2Fleet,
    cfg: PolicyConfig,
    offerings: Vec<Offering>,
}

async fn deployment(c: &Clients, idle_timeout_s: f64) -> Deployment {
    let (jobs_t, workers_t, control_t) = (unique("jobs"), unique("workers"), unique("control"));
    onoff_aws::provision::jobs_table(c, &jobs_t).await.unwrap();
    table(c, &workers_t, onoff_aws::state::WORKER_KEY).await;
    table(c, &control_t, "pk").await;
    let lane = unique("lane");
    let url = c
        .sqs
        .create_queue()
        .queue_name(unique("q"))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let mut cfg = PolicyConfig {
        lanes: vec![onoff_policy::LaneConfig {
            name: lane.clone(),
            predictive_max: 0,
            ..Default::default()
        }],
        ..PolicyConfig::default()
    };
    cfg.scale_down.mode = onoff_policy::KeepAliveMode::Fixed;
    cfg.scale_down.fixed_idle_timeout_s = idle_timeout_s;
    cfg.anti_thrash.scale_down_delay_after_scale_up_s = 0.0;
    // The fleet below launches spot by CreateFleet (one-time requests), whose instances EC2
    // refuses to stop: as `onoff_fn_common::fleet_of` pairs them, only on-demand is stopped.
    cfg.scale_down.stop_idle = onoff_policy::StopIdle::OnDemand;
    Deployment {
        queues: SqsQueues::new(c.sqs.clone(), vec![(lane.clone(), url)]),
        lane,
        jobs: onoff_aws::jobs::DynamoJobs::new(c.dynamodb.clone(), &jobs_t),
        workers: DynamoWorkers::new(c.dynamodb.clone(), &workers_t, ARN_PREFIX),
        control: DynamoControl::new(c.dynamodb.clone(), &control_t),
        fleet: own_fleet(c).await,
        cfg,
        offerings: vec![Offering {
            key: key("g5.xlarge", "us-east-1a", CapacityType::Spot),
            gpus: 1,
            gpu_model: "NVIDIA A10G".into(),
            gpu_memory_gib: 24.0,
            vcpus: 4,
            price_usd_per_h: 0.39,
            interruption: None,
        }],
    }
}

impl Deployment {
    async fn reconcile(&self, now: f64, reap: bool) -> onoff_control::reconcile::ReconcileReport {
        let opts = onoff_control::reconcile::ReconcileOptions {
            reap,
            ..Default::default()
        };
        onoff_control::reconcile::reconcile(
            &self.cfg,
            &self.offerings,
            &opts,
            now,
            &self.queues,
            &self.workers,
            &self.jobs,
            &self.fleet,
            &self.control,
        )
        .await
        .unwrap()
    }

    async fn submit_one(&self, name: &str, now: f64) -> String {
        use onoff_control::submit::{submit, Source};
        let spec = format!(
            r#"{{"image":"img","command":["x"],"project":"p","lane":"{}"}}"#,
            self.lane
        );
        let src = Source::Sqs {
            message_id: unique(name),
        };
        submit(&spec, &src, &[self.lane.as_str()], now, &self.jobs, &self.queues)
            .await
            .unwrap()
            .id()
            .to_string()
    }

    async fn running_ids(&self) -> Vec<String> {
        self.fleet
            .describe_managed()
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.instance_id)
            .collect()
    }
}

#[tokio::test]
async fn backlog_drains_then_the_keep_alive_expires_and_the_reconciler_terminates() {
    use onoff_control::ports::{Claim, JobStore};
    let c = clients().await;
    let d = deployment(&c, 600.0).await;
    let t0 = onoff_aws::state::unix_now();
    let job = d.submit_one("m", t0).await;
    let r = d.reconcile(t0, false).await;
    assert_eq!(r.acted.launched.len(), 1);
    let worker = r.acted.launched[0].launched.instance_id.clone();
    // The agent boots, claims the job, runs it, finishes: idle from t0+400 (heartbeats say so).
    assert!(matches!(
        d.jobs.claim(&job, &worker, t0 + 3600.0, t0 + 300.0).await.unwrap(),
        Claim::Claimed(_)
    ));
    d.jobs
        .transition(&job, JobState::Running, JobState::Succeeded)
        .await
        .unwrap();
    for m in d.queues.receive(&d.lane, 10, 0, 60).await.unwrap() {
        d.queues.delete(&d.lane, &m.receipt).await.unwrap();
    }
    d.workers
        .heartbeat(&worker, WorkerState::Idle, Some(t0 + 400.0), t0 + 900.0)
        .await
        .unwrap();
    let r = d.reconcile(t0 + 900.0, true).await;
    assert!(r.acted.terminated.is_empty(), "idle 500 s < 600 s: {:?}", r.plan);
    d.workers
        .heartbeat(&worker, WorkerState::Idle, Some(t0 + 400.0), t0 + 1_010.0)
        .await
        .unwrap();
    let r = d.reconcile(t0 + 1_020.0, true).await;
    assert_eq!(r.acted.terminated, vec![worker.clone()], "{:?}", r.plan);
    assert!(!d.running_ids().await.contains(&worker));
    assert_eq!(
        d.workers.get(&worker).await.unwrap().unwrap().state,
        WorkerState::Terminating
    );
}

#[tokio::test]
async fn a_stale_heartbeat_requeues_the_job_and_terminates_the_instance() {
    use onoff_control::ports::{Claim, JobStore};
    let c = clients().await;
    let d = deployment(&c, 600.0).await;
    let t0 = onoff_aws::state::unix_now();
    let job = d.submit_one("m", t0).await;
    let worker = d.reconcile(t0, false).await.acted.launched[0]
        .launched
        .instance_id
        .clone();
    for m in d.queues.receive(&d.lane, 10, 0, 60).await.unwrap() {
        d.queues.delete(&d.lane, &m.receipt).await.unwrap();
    }
    assert!(matches!(
        d.jobs.claim(&job, &worker, t0 + 7200.0, t0 + 300.0).await.unwrap(),
        Claim::Claimed(_)
    ));
    d.workers
        .heartbeat(&worker, WorkerState::Running, None, t0 + 320.0)
        .await
        .unwrap();
    // Ten minutes of silence.
    let r = d.reconcile(t0 + 920.0, true).await;
    assert_eq!(r.workers_lost, vec![worker.clone()]);
    assert_eq!(r.jobs_requeued, vec![job.clone()]);
    assert!(!d.running_ids().await.contains(&worker));
    let rec = d.jobs.get(&job).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.lease_owner), (JobState::Queued, None));
    let msgs = d.queues.receive(&d.lane, 10, 0, 60).await.unwrap();
    assert_eq!(msgs.len(), 1);
    assert!(msgs[0].body.contains(&job));
    // The re-queued job gets a new worker in the same pass.
    assert_eq!(r.acted.launched.len(), 1, "{:?}", r.plan);
}

#[tokio::test]
async fn a_malformed_submission_message_ends_in_the_dead_letter_queue() {
    let c = clients().await;
    let (q, dlq) = queue_with_dlq(&c, "submit", 2).await;
    let queues = SqsQueues::new(c.sqs.clone(), vec![("submit".into(), q), ("dlq".into(), dlq)]);
    queues
        .send("submit", r#"{"image":"i","command":"rm -rf /","project":"p"}"#, 0)
        .await
        .unwrap();
    // The submit function fails the record each time (batchItemFailures): it becomes visible
    // again, and after maxReceiveCount receives SQS moves it to the DLQ.
    for _ in 0..3 {
        for m in queues.receive("submit", 10, 0, 0).await.unwrap() {
            assert!(m.receive_count <= 2);
        }
    }
    let dead = queues.receive("dlq", 10, 0, 30).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].body.contains("rm -rf"));
}

#[tokio::test]
async fn after_a_spot_warning_the_replacement_launches_in_another_offering() {
    use onoff_control::interruption::{handle_event, Handled};
    use onoff_control::ports::{Claim, JobStore};
    let c = clients().await;
    let mut d = deployment(&c, 600.0).await;
    // Two zones of the same type: the interrupted one is skipped for the TTL.
    d.offerings.push(Offering {
        key: key("g5.xlarge", "us-east-1b", CapacityType::Spot),
        ..d.offerings[0].clone()
    });
    let t0 = onoff_aws::state::unix_now();
    let job = d.submit_one("m", t0).await;
    let first = d.reconcile(t0, false).await.acted.launched[0].clone();
    let worker = first.launched.instance_id.clone();
    for m in d.queues.receive(&d.lane, 10, 0, 60).await.unwrap() {
        d.queues.delete(&d.lane, &m.receipt).await.unwrap();
    }
    assert!(matches!(
        d.jobs.claim(&job, &worker, t0 + 7200.0, t0 + 300.0).await.unwrap(),
        Claim::Claimed(_)
    ));
    d.workers
        .heartbeat(&worker, WorkerState::Running, None, t0 + 400.0)
        .await
        .unwrap();
    // The notice for this worker.
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../events/spot-interruption-warning.json"
    ))
    .unwrap();
    let mut event: serde_json::Value = serde_json::from_str(&text).unwrap();
    event["detail"]["instance-id"] = worker.clone().into();
    event["id"] = unique("event").into();
    let handled = handle_event(&event, &d.cfg, &d.workers, &d.control, &d.control, t0 + 500.0)
        .await
        .unwrap();
    assert_eq!(handled, Handled::Drained { worker: worker.clone() });
    // The agent checkpoints and releases the job (RUNNING -> QUEUED, attempt not failed) and
    // re-sends its message; the scaler then launches a replacement, not in the warned offering.
    d.jobs
        .transition(&job, JobState::Running, JobState::Queued)
        .await
        .unwrap();
    d.queues
        .send(&d.lane, &serde_json::json!({ "job_id": job }).to_string(), 0)
        .await
        .unwrap();
    let r = d.reconcile(t0 + 510.0, false).await;
    assert_eq!(r.acted.launched.len(), 1, "{:?}", r.plan);
    assert_ne!(r.acted.launched[0].launched.offering, first.launched.offering);
    assert_eq!(r.acted.launched[0].launched.offering.zone, "us-east-1b");
}

#[tokio::test]
async fn one_create_fleet_call_spreads_over_its_overrides() {
    let c = clients().await;
    let fleet = own_fleet(&c).await;
    let a = key("g5.xlarge", "us-east-1a", CapacityType::Spot);
    let b = key("g5.xlarge", "us-east-1b", CapacityType::Spot);
    let res = fleet
        .launch(&LaunchRequest {
            lane: unique("lane"),
            offerings: vec![a.clone(), b.clone()],
            count: 4,
            project: None,
            job: None,
            client_token: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(res.launched.len(), 4);
    assert!(res.short.is_empty());
    // Each instance is attributed to the override it came from, as EC2 placed it.
    let placed: std::collections::BTreeMap<String, String> = fleet
        .describe_managed()
        .await
        .unwrap()
        .into_iter()
        .map(|i| (i.instance_id, i.zone))
        .collect();
    for l in &res.launched {
        assert_eq!(placed[&l.instance_id], l.offering.zone, "{l:?}");
    }
    let zones: std::collections::BTreeSet<_> = res.launched.iter().map(|l| l.offering.zone.clone()).collect();
    assert_eq!(zones.len(), 2, "diversified over both overrides: {res:?}");
}

/// A bucket `name` with versioning, as the template's.
async fn versioned_bucket(c: &Clients, name: &str) {
    c.s3.create_bucket().bucket(name).send().await.unwrap();
    c.s3.put_bucket_versioning()
        .bucket(name)
        .versioning_configuration(
            aws_sdk_s3::types::VersioningConfiguration::builder()
                .status(aws_sdk_s3::types::BucketVersioningStatus::Enabled)
                .build(),
        )
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn spec_objects_are_read_by_version_and_an_overwrite_without_one_is_detected() {
    use onoff_aws::objects::{ObjectError, ObjectRef, S3Objects};
    let c = clients().await;
    let bucket = unique("specs");
    versioned_bucket(&c, &bucket).await;
    let put = |body: &'static str| {
        c.s3.put_object()
            .bucket(&bucket)
            .key("jobs/a.json")
            .body(body.as_bytes().to_vec().into())
            .send()
    };
    let v1 = put(r#"{"v":1}"#).await.unwrap();
    let v2 = put(r#"{"v":22}"#).await.unwrap();
    let objects = S3Objects::new(c.s3.clone());
    let at = |version: Option<&str>, etag: Option<&str>| ObjectRef {
        bucket: bucket.clone(),
        key: "jobs/a.json".into(),
        version: version.map(str::to_string),
        // S3 events give the ETag without quotes.
        etag: etag.map(|e| e.trim_matches('"').to_string()),
    };
    // By version id: the first content, though the key now holds the second.
    let first = at(v1.version_id(), v1.e_tag());
    assert_eq!(objects.size(&first).await.unwrap(), 7);
    assert_eq!(objects.read(&first).await.unwrap(), br#"{"v":1}"#);
    let second = at(v2.version_id(), v2.e_tag());
    assert_eq!(objects.read(&second).await.unwrap(), br#"{"v":22}"#);
    // Without a version id, the first event's ETag no longer matches: changed, not the new bytes.
    let unversioned = at(None, v1.e_tag());
    assert!(matches!(objects.size(&unversioned).await, Err(ObjectError::Changed(_))));
    assert!(matches!(objects.read(&unversioned).await, Err(ObjectError::Changed(_))));
    assert_eq!(objects.size(&at(None, v2.e_tag())).await.unwrap(), 8);
    // A key that is not there.
    let missing = ObjectRef {
        key: "jobs/none.json".into(),
        ..at(None, None)
    };
    assert!(matches!(objects.size(&missing).await, Err(ObjectError::NotFound(_))));
    assert!(matches!(objects.read(&missing).await, Err(ObjectError::NotFound(_))));
}

/// Every version of a versioned prefix is listed, over pages: the local stack plays the bucket's
/// events from this listing, and read only the first page (1,000 versions, as S3 and moto
/// answer) before, so a replay's submissions past it were never made.
#[tokio::test]
async fn every_version_under_a_prefix_is_listed_page_after_page() {
    let c = clients().await;
    let bucket = unique("versions");
    versioned_bucket(&c, &bucket).await;
    // Three keys, one of them overwritten twice, and one outside the prefix.
    for (key, body) in [
        ("jobs/a.json", "1"),
        ("jobs/b.json", "2"),
        ("jobs/b.json", "22"),
        ("jobs/b.json", "222"),
        ("jobs/c.json", "3"),
        ("other/d.json", "4"),
    ] {
        c.s3.put_object()
            .bucket(&bucket)
            .key(key)
            .body(body.as_bytes().to_vec().into())
            .send()
            .await
            .unwrap();
    }
    for page in [1, 2, 1000] {
        let versions = onoff_aws::objects::list_versions(&c.s3, &bucket, "jobs/", page)
            .await
            .unwrap();
        let mut seen: Vec<(String, String)> = versions
            .iter()
            .map(|v| (v.key().unwrap().to_string(), v.version_id().unwrap().to_string()))
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 5, "page size {page}: {seen:?}");
        assert_eq!(versions.len(), 5, "each version once, page size {page}");
        assert_eq!(
            seen.iter().filter(|(k, _)| k == "jobs/b.json").count(),
            3,
            "page size {page}"
        );
    }
}

#[tokio::test]
async fn an_item_over_dynamodbs_size_limit_is_invalid_not_a_retryable_failure() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::ports::JobStore;
    let c = clients().await;
    let table_name = unique("jobs");
    table(&c, &table_name, "job_id").await;
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &table_name);
    // 500 KB in one item: DynamoDB answers ValidationException (items are at most 400 KB).
    let err = jobs
        .record_error("sqs:m", &"x".repeat(500_000), 1_700_000_000.0)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err:?}");
    assert!(err.to_string().contains("ValidationException"), "{err}");
    // Within the limit it is written.
    jobs.record_error("sqs:m", "too big", 1_700_000_000.0).await.unwrap();
}

/// One row that does not parse (a hand-edited item) is listed as unreadable; the other active jobs
/// are still listed, and finished ones are not (the sparse index).
#[tokio::test]
async fn an_unreadable_active_row_is_skipped_and_named() {
    use aws_sdk_dynamodb::types::AttributeValue;
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::job::{AttemptEnd, JobState, RerunLimits, Settle};
    use onoff_control::ports::{Claim, JobRecord, JobStore};
    let c = clients().await;
    let t = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &t).await.unwrap();
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &t);
    let spec: onoff_control::job::JobSpec =
        serde_json::from_value(serde_json::json!({"image": "i", "command": ["x"], "project": "p"})).unwrap();
    for id in ["job-ok", "job-done"] {
        jobs.create(&JobRecord::new(id.into(), spec.clone(), "test".into(), 1.0))
            .await
            .unwrap();
    }
    let Claim::Claimed(rec) = jobs.claim("job-done", "i-a", 100.0, 1.0).await.unwrap() else {
        panic!()
    };
    jobs.finish(
        "job-done",
        "i-a",
        &Settle::of(&rec, &AttemptEnd::Succeeded, &RerunLimits::default()),
        2.0,
    )
    .await
    .unwrap();
    c.dynamodb
        .put_item()
        .table_name(&t)
        .item("job_id", AttributeValue::S("job-garbled".into()))
        .item("active_lane", AttributeValue::S("standard".into()))
        .item("state", AttributeValue::S("QUEUED".into()))
        .item("spec", AttributeValue::S("{not json".into()))
        .send()
        .await
        .unwrap();
    let listed = jobs.active().await.unwrap();
    let ids: Vec<&str> = listed.items.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, ["job-ok"]);
    assert_eq!(listed.unreadable.len(), 1, "{:?}", listed.unreadable);
    assert_eq!(listed.unreadable[0].0, "job-garbled");
    assert!(listed.unreadable[0].1.contains("spec"), "{:?}", listed.unreadable);
    let done = jobs.get("job-done").await.unwrap().unwrap();
    assert_eq!((done.state, done.finished_at), (JobState::Succeeded, Some(2.0)));
    // A worker's claim of it is written (one conditional write that returns the row) and only
    // then found unreadable: the row is RUNNING under that worker's lease.
    assert!(matches!(
        jobs.claim("job-garbled", "i-b", 200.0, 3.0).await,
        Err(onoff_control::ports::StoreError::Malformed(_))
    ));
    let raw = |c: &Clients| {
        let (c, t) = (c.clone(), t.clone());
        async move {
            c.dynamodb
                .get_item()
                .table_name(&t)
                .key("job_id", AttributeValue::S("job-garbled".into()))
                .consistent_read(true)
                .send()
                .await
                .unwrap()
                .item
                .unwrap()
        }
    };
    let row = raw(&c).await;
    assert_eq!(row["state"].as_s().unwrap(), "RUNNING");
    assert_eq!(row["lease_owner"].as_s().unwrap(), "i-b");
    // Only its lease holder ends it: FAILED with the reason, out of the index, the write's retry
    // done.
    assert!(matches!(
        jobs.fail_unreadable("job-garbled", "i-other", "unreadable", 4.0).await,
        Err(onoff_control::ports::StoreError::Conflict(_))
    ));
    for _ in 0..2 {
        jobs.fail_unreadable("job-garbled", "i-b", "job job-garbled cannot be read", 4.0)
            .await
            .unwrap();
    }
    let row = raw(&c).await;
    assert_eq!(row["state"].as_s().unwrap(), "FAILED");
    assert_eq!(row["reason"].as_s().unwrap(), "job job-garbled cannot be read");
    assert!(
        !row.contains_key("lease_owner") && !row.contains_key("active_lane"),
        "{row:?}"
    );
    let listed = jobs.active().await.unwrap();
    assert!(listed.unreadable.is_empty(), "{:?}", listed.unreadable);
}

/// Against an emulator the `active` index can be made to lag as AWS's may: a row created less
/// than the lag ago is not listed yet (read by id it is there), an older one is.
#[tokio::test]
async fn a_lagging_active_index_leaves_out_rows_younger_than_the_lag() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::ports::{JobRecord, JobStore};
    let c = clients().await;
    let t = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &t).await.unwrap();
    let mut jobs = DynamoJobs::new(c.dynamodb.clone(), &t);
    jobs.set_index_lag_s(60.0);
    let spec: onoff_control::job::JobSpec =
        serde_json::from_value(serde_json::json!({"image": "i", "command": ["x"], "project": "p"})).unwrap();
    let now = onoff_aws::state::unix_now();
    for (id, created_at) in [("job-old", now - 120.0), ("job-new", now)] {
        jobs.create(&JobRecord::new(id.into(), spec.clone(), "test".into(), created_at))
            .await
            .unwrap();
    }
    let listed = |jobs: &DynamoJobs| {
        let jobs = jobs.clone();
        async move {
            let mut ids: Vec<String> = jobs.active().await.unwrap().items.into_iter().map(|j| j.id).collect();
            ids.sort();
            ids
        }
    };
    assert_eq!(listed(&jobs).await, ["job-old"]);
    assert!(jobs.get("job-new").await.unwrap().is_some());
    jobs.set_index_lag_s(0.0);
    assert_eq!(listed(&jobs).await, ["job-new", "job-old"]);
}

/// Jobs read by id in batches, as a scale request's run reads the jobs it was asked for: more ids
/// than one BatchGetItem takes (100), repeats (which BatchGetItem refuses), an unknown id and an
/// unreadable row. The first request's 60 rows of about 300 KB pass the 16 MB a BatchGetItem
/// answers at most, so DynamoDB (and moto) leave some keys unprocessed: read anyway, after a retry.
#[tokio::test]
async fn jobs_are_read_by_id_in_batches_with_unprocessed_keys_asked_again() {
    use aws_sdk_dynamodb::types::AttributeValue;
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::ports::{JobRecord, JobStore};
    let c = clients().await;
    let t = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &t).await.unwrap();
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &t);
    let spec = |arg: String| -> onoff_control::job::JobSpec {
        serde_json::from_value(serde_json::json!({"image": "i", "command": ["x", arg], "project": "p"})).unwrap()
    };
    let big: Vec<String> = (0..60).map(|i| format!("big-{i:03}")).collect();
    let small: Vec<String> = (0..90).map(|i| format!("small-{i:03}")).collect();
    for id in &big {
        jobs.create(&JobRecord::new(
            id.clone(),
            spec("y".repeat(300_000)),
            "test".into(),
            1.0,
        ))
        .await
        .unwrap();
    }
    for id in &small {
        jobs.create(&JobRecord::new(id.clone(), spec("y".into()), "test".into(), 1.0))
            .await
            .unwrap();
    }
    c.dynamodb
        .put_item()
        .table_name(&t)
        .item("job_id", AttributeValue::S("small-garbled".into()))
        .item("state", AttributeValue::S("QUEUED".into()))
        .item("spec", AttributeValue::S("{not json".into()))
        .send()
        .await
        .unwrap();
    let mut ids: Vec<String> = big.iter().chain(&small).cloned().collect();
    ids.extend([
        "small-garbled".to_string(),
        "unknown".to_string(),
        big[0].clone(),
        small[5].clone(),
    ]);
    let read = jobs.get_many(&ids).await.unwrap();
    let mut got: Vec<String> = read.items.iter().map(|r| r.id.clone()).collect();
    got.sort();
    let mut want: Vec<String> = big.iter().chain(&small).cloned().collect();
    want.sort();
    assert_eq!(got, want, "every row once, the unknown id absent");
    let r = read.items.iter().find(|r| r.id == "big-007").unwrap();
    assert_eq!(r.spec.command[1].len(), 300_000, "a big row whole");
    assert_eq!(read.unreadable.len(), 1, "{:?}", read.unreadable);
    assert_eq!(read.unreadable[0].0, "small-garbled");
    assert!(jobs.get_many(&[]).await.unwrap().items.is_empty());
}

/// The jobs table's cancel and attempt log, as DynamoDB applies them: a waiting job is cancelled
/// at once; a running one gets the flag, which the holder's renewal returns and which turns its
/// release into CANCELLED; an ended attempt is appended to the log; a finished job is left alone.
#[tokio::test]
async fn cancel_and_the_attempt_log_are_conditional_writes_on_the_row() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::job::{AttemptEnd, AttemptRecord, JobSpec, RerunLimits, Settle};
    use onoff_control::ports::{CancelOutcome, Claim, JobRecord, JobStore};
    let c = clients().await;
    let table_name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &table_name).await.unwrap();
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &table_name);
    let now = 1_700_000_000.0;
    let spec: JobSpec =
        serde_json::from_str(r#"{"image":"img","command":["x"],"project":"p","name":"sweep 3"}"#).unwrap();
    for id in ["job-a", "job-b", "job-c", "job-d"] {
        jobs.create(&JobRecord::new(id.into(), spec.clone(), "test".into(), now))
            .await
            .unwrap();
    }
    // Waiting: cancelled at once, a second cancel (later: one at the very same instant is taken
    // for this one's retry) finds it finished, and it leaves the active index.
    assert_eq!(
        jobs.request_cancel("job-a", now).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        jobs.request_cancel("job-a", now + 1.0).await.unwrap(),
        CancelOutcome::AlreadyFinished(JobState::Cancelled)
    );
    let a = jobs.get("job-a").await.unwrap().unwrap();
    assert_eq!((a.state, a.finished_at), (JobState::Cancelled, Some(now)));
    assert_eq!(a.spec.name.as_deref(), Some("sweep 3"));
    assert!(!jobs.active().await.unwrap().items.iter().any(|r| r.id == "job-a"));
    assert!(matches!(
        jobs.claim("job-a", "i-1", now + 60.0, now).await.unwrap(),
        Claim::NotClaimable(_)
    ));
    // Running: the flag; the renewal reports it.
    let Claim::Claimed(b) = jobs.claim("job-b", "i-1", now + 60.0, now).await.unwrap() else {
        panic!("claimable")
    };
    assert_eq!(b.claimed_at, Some(now));
    assert!(!jobs.renew("job-b", "i-1", now + 80.0).await.unwrap().cancel_requested);
    assert_eq!(
        jobs.request_cancel("job-b", now + 10.0).await.unwrap(),
        CancelOutcome::Requested
    );
    assert!(jobs.renew("job-b", "i-1", now + 90.0).await.unwrap().cancel_requested);
    // Its holder releases it (say a spot notice came first): the table makes it CANCELLED, never
    // pending again, and keeps the attempt.
    let attempt = AttemptRecord {
        n: 1,
        instance_id: "i-1".into(),
        instance_type: Some("g5.xlarge".into()),
        capacity_type: Some("spot".into()),
        price_usd_per_h: Some(0.4),
        started_at: now,
        ended_at: now + 30.0,
        outcome: "released".into(),
        exit_code: Some(143),
        signal: None,
        checkpoint: None,
        seconds: 30.0,
        cost_usd: 0.0033,
    };
    let settle = Settle::of(&b, &AttemptEnd::Released("spot notice".into()), &RerunLimits::default())
        .with_attempt(&b, attempt.clone());
    assert_eq!(settle.to, JobState::Queued, "the holder read no flag at its claim");
    jobs.finish("job-b", "i-1", &settle, now + 30.0).await.unwrap();
    let b = jobs.get("job-b").await.unwrap().unwrap();
    assert_eq!(b.state, JobState::Cancelled);
    assert_eq!(b.reason.as_deref(), Some("cancelled by the user"));
    assert_eq!(b.attempt_log, vec![attempt]);
    assert_eq!((b.lease_owner, b.claimed_at), (None, None));
    // A final end other than success loses to the cancel too: an attempt that then fails for
    // good (here a fatal end), and a lease the reaper finds lost for the last time, end CANCELLED,
    // as the fake ends them, not FAILED.
    for id in ["job-c", "job-d"] {
        let Claim::Claimed(r) = jobs.claim(id, "i-2", now + 60.0, now).await.unwrap() else {
            panic!("claimable")
        };
        assert_eq!(
            jobs.request_cancel(id, now + 10.0).await.unwrap(),
            CancelOutcome::Requested
        );
        let end = if id == "job-c" {
            AttemptEnd::Fatal("wrong image".into())
        } else {
            AttemptEnd::LeaseLost("worker lost".into())
        };
        let limits = RerunLimits {
            max_lease_expiries: 1,
            ..RerunLimits::default()
        };
        let settle = Settle::of(&r, &end, &limits);
        assert_eq!(settle.to, JobState::Failed, "{id}: a final end");
        if id == "job-c" {
            jobs.finish(id, "i-2", &settle, now + 20.0).await.unwrap();
        } else {
            jobs.requeue_lost(id, "i-2", now + 60.0, &settle, now + 70.0)
                .await
                .unwrap();
        }
        let r = jobs.get(id).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.reason.as_deref()),
            (JobState::Cancelled, Some("cancelled by the user")),
            "{id}"
        );
    }
    assert_eq!(jobs.request_cancel("job-z", now).await.unwrap(), CancelOutcome::Unknown);
}

/// What became of an attempt's outputs goes on the job's row after the attempt is settled: a
/// later attempt's record is never replaced by an earlier one's, a long error is cut to the
/// row's bound, and a row that is gone is not created again (an update would).
#[tokio::test]
async fn the_outputs_record_is_written_once_the_attempt_ended_latest_attempt_wins() {
    use onoff_aws::jobs::DynamoJobs;
    use onoff_control::job::{JobSpec, OutputsRecord, MAX_REASON_BYTES};
    use onoff_control::ports::{JobRecord, JobStore, StoreError};
    let c = clients().await;
    let table_name = unique("jobs");
    onoff_aws::provision::jobs_table(&c, &table_name).await.unwrap();
    let jobs = DynamoJobs::new(c.dynamodb.clone(), &table_name);
    let now = 1_700_000_000.0;
    let spec: JobSpec = serde_json::from_str(r#"{"image":"img","command":["x"],"project":"p"}"#).unwrap();
    jobs.create(&JobRecord::new("job-o".into(), spec, "test".into(), now))
        .await
        .unwrap();
    assert_eq!(jobs.get("job-o").await.unwrap().unwrap().outputs, None);
    let second = OutputsRecord {
        attempt: 2,
        files: 0,
        error: Some(format!("AccessDenied: {}", "x".repeat(5000))),
        at: now + 100.0,
    };
    jobs.record_outputs("job-o", &second).await.unwrap();
    let o = jobs.get("job-o").await.unwrap().unwrap().outputs.unwrap();
    assert_eq!((o.attempt, o.files, o.at), (2, 0, now + 100.0));
    let e = o.error.unwrap();
    assert!(
        e.starts_with("AccessDenied") && e.len() <= MAX_REASON_BYTES,
        "{} bytes",
        e.len()
    );
    // The first attempt's upload, ending late: refused, the second's record stays.
    let first = OutputsRecord {
        attempt: 1,
        files: 3,
        error: None,
        at: now + 120.0,
    };
    assert!(matches!(
        jobs.record_outputs("job-o", &first).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(jobs.get("job-o").await.unwrap().unwrap().outputs.unwrap().attempt, 2);
    // The same attempt again (a retried write) and a later one replace it.
    let third = OutputsRecord {
        attempt: 3,
        files: 4,
        error: None,
        at: now + 200.0,
    };
    jobs.record_outputs("job-o", &third).await.unwrap();
    jobs.record_outputs("job-o", &third).await.unwrap();
    assert_eq!(jobs.get("job-o").await.unwrap().unwrap().outputs, Some(third.clone()));
    // No row: nothing is created.
    assert!(matches!(
        jobs.record_outputs("job-gone", &third).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(jobs.get("job-gone").await.unwrap(), None);
}

#[tokio::test]
async fn a_full_vcpu_quota_refuses_its_overrides_as_ec2_does() {
    use onoff_aws::faults::VcpuQuotas;
    use onoff_control::ports::FleetErrorKind;
    use onoff_control::quota::QuotaBucket;
    // 8 vCPUs of G spot instances: two g5.xlarge (4 vCPUs each).
    let quotas = VcpuQuotas::new(
        [((QuotaBucket::GAndVt, CapacityType::Spot), 8)].into_iter().collect(),
        [("g5.xlarge".to_string(), 4)].into_iter().collect(),
    );
    let c = clients().await.with_vcpu_quotas(quotas.clone());
    let fleet = own_fleet(&c).await;
    let a = key("g5.xlarge", "us-east-1a", CapacityType::Spot);
    let b = key("g5.xlarge", "us-east-1b", CapacityType::Spot);
    let ask = |offerings: Vec<OfferingKey>, count: u32| LaunchRequest {
        lane: "standard".into(),
        offerings,
        count,
        project: None,
        job: None,
        client_token: String::new(),
    };
    let live = || async {
        fleet
            .describe_managed()
            .await
            .unwrap()
            .into_iter()
            .map(|i| (i.instance_type, i.capacity_type))
            .collect::<Vec<_>>()
    };
    // Three asked, two fit: two launched, the rest refused for the quota, naming an override.
    let res = fleet.launch(&ask(vec![a.clone(), b.clone()], 3)).await.unwrap();
    assert_eq!(res.launched.len(), 2, "{res:?}");
    assert_eq!(res.short.len(), 1, "{res:?}");
    assert_eq!(res.short[0].1.kind, FleetErrorKind::QuotaExceeded, "{res:?}");
    assert!(
        res.short[0].1.message.starts_with("MaxSpotInstanceCountExceeded"),
        "{res:?}"
    );
    let now = live().await;
    assert_eq!(now.len(), 2);
    quotas.set_live(now.iter().map(|(t, c)| (t.as_str(), *c)));
    // Full: refused whole, nothing launched in the emulator, each override named.
    let res = fleet.launch(&ask(vec![a.clone(), b.clone()], 1)).await.unwrap();
    assert!(res.launched.is_empty(), "{res:?}");
    let refused: Vec<&OfferingKey> = res.short.iter().map(|(k, _)| k).collect();
    assert_eq!(refused, [&a, &b]);
    assert!(res.short.iter().all(|(_, e)| e.kind == FleetErrorKind::QuotaExceeded));
    assert_eq!(live().await.len(), 2);
    // On-demand is another quota (none here): launched.
    let od = key("g5.xlarge", "us-east-1a", CapacityType::OnDemand);
    assert_eq!(fleet.launch(&ask(vec![od], 1)).await.unwrap().launched.len(), 1);
    assert_eq!(quotas.refused(), 2);
    assert_eq!(quotas.peaks(), [((QuotaBucket::GAndVt, CapacityType::Spot), 8, 8)]);
}

#[tokio::test]
async fn a_full_vcpu_quota_refuses_a_stoppable_spot_run_instances_whole_as_ec2_does() {
    use onoff_aws::faults::VcpuQuotas;
    use onoff_control::ports::FleetErrorKind;
    use onoff_control::quota::QuotaBucket;
    // 8 vCPUs of G spot instances: two g5.xlarge (4 vCPUs each). Stoppable spot launches by
    // RunInstances, MinCount = MaxCount: all or none.
    let quotas = VcpuQuotas::new(
        [((QuotaBucket::GAndVt, CapacityType::Spot), 8)].into_iter().collect(),
        [("g5.xlarge".to_string(), 4)].into_iter().collect(),
    );
    let c = clients().await.with_vcpu_quotas(quotas.clone());
    let fleet = own_fleet(&c).await.with_stoppable_spot(true, None);
    let a = key("g5.xlarge", "us-east-1a", CapacityType::Spot);
    let ask = |count: u32| {
        LaunchRequest {
            lane: "standard".into(),
            offerings: vec![a.clone()],
            count,
            project: None,
            job: None,
            client_token: String::new(),
        }
        .with_token_for(&unique("decision"))
    };
    let live = || async { fleet.describe_managed().await.unwrap().len() };
    // Three do not fit: nothing launched; the one offering's refusal is the launch's error, as a
    // CreateFleet refused whole.
    let e = fleet.launch(&ask(3)).await.expect_err("refused");
    assert_eq!(e.kind, FleetErrorKind::QuotaExceeded, "{e:?}");
    assert!(e.message.starts_with("MaxSpotInstanceCountExceeded"), "{e:?}");
    assert_eq!(live().await, 0);
    // Two fit.
    assert_eq!(fleet.launch(&ask(2)).await.unwrap().launched.len(), 2);
    quotas.set_live(
        fleet
            .describe_managed()
            .await
            .unwrap()
            .iter()
            .map(|i| ("g5.xlarge", i.capacity_type)),
    );
    // Full: one more is refused.
    let e = fleet.launch(&ask(1)).await.expect_err("full");
    assert_eq!(e.kind, FleetErrorKind::QuotaExceeded, "{e:?}");
    assert_eq!(live().await, 2);
    assert_eq!(quotas.refused(), 2);
}

#[tokio::test]
async fn a_full_vcpu_quota_refuses_the_start_of_a_stopped_instance_as_ec2_does() {
    use onoff_aws::faults::VcpuQuotas;
    use onoff_control::ports::FleetErrorKind;
    use onoff_control::quota::QuotaBucket;
    // 8 vCPUs of G on-demand: two g5.xlarge (4 vCPUs each). EC2 counts a start against the
    // quota as it counts a launch, and a stopped instance not at all.
    let quotas = VcpuQuotas::new(
        [((QuotaBucket::GAndVt, CapacityType::OnDemand), 8)]
            .into_iter()
            .collect(),
        [("g5.xlarge".to_string(), 4)].into_iter().collect(),
    );
    // A stop lasting 200 ms instead of `limits::STOPPING_S`, so only the quota refuses.
    let c = clients().await;
    let window = std::time::Duration::from_millis(200);
    let ec2 = aws_sdk_ec2::Client::from_conf(
        aws_sdk_ec2::config::Builder::from(&conf().await)
            .interceptor(onoff_aws::limits::AwsLimits)
            .interceptor(onoff_aws::limits::StoppingInstances { window: Some(window) })
            .interceptor(quotas.clone())
            .build(),
    );
    let fleet = Ec2Fleet::new(ec2, launch_template_name(&c).await)
        .with_subnets(Ec2Fleet::default_subnets(&c.ec2).await.unwrap())
        .with_deployment(unique("deploy"));
    let od = key("g5.xlarge", "us-east-1a", CapacityType::OnDemand);
    // What the local run tells the quotas after each call: the instances listed.
    let tell = || async {
        let listed = fleet.describe_managed().await.unwrap();
        quotas.set_instances(listed.iter().map(|i| {
            (
                i.instance_id.as_str(),
                i.instance_type.as_str(),
                i.capacity_type,
                i.state.as_str(),
            )
        }));
    };
    let a = launch_one(&fleet, od.clone()).await;
    let b = launch_one(&fleet, od.clone()).await;
    assert!(fleet.stop(std::slice::from_ref(&a)).await.unwrap().is_empty());
    tokio::time::sleep(window + std::time::Duration::from_millis(100)).await;
    tell().await;
    // The stopped one freed its 4 vCPUs: a third instance takes them.
    let third = launch_one(&fleet, od.clone()).await;
    tell().await;
    // Full again: the start is refused whole, with EC2's code, and the instance stays stopped.
    let refused = fleet.start(std::slice::from_ref(&a)).await.unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].1.kind, FleetErrorKind::QuotaExceeded, "{refused:?}");
    assert!(refused[0].1.message.starts_with("VcpuLimitExceeded"), "{refused:?}");
    assert_eq!(state_of(&fleet, &a).await.as_deref(), Some("stopped"));
    assert_eq!(quotas.refused(), 1);
    // Room again (one terminated): it starts.
    fleet.terminate(&[third, b]).await.unwrap();
    tell().await;
    let refused = fleet.start(std::slice::from_ref(&a)).await.unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    assert_ne!(state_of(&fleet, &a).await.as_deref(), Some("stopped"));
    assert_eq!(quotas.refused(), 1);
}

#[tokio::test]
async fn the_deployments_spot_requests_are_listed_with_their_instance_and_cancelled_by_id() {
    use aws_sdk_ec2::types::{RequestSpotLaunchSpecification, ResourceType, SpotInstanceType, Tag, TagSpecification};
    use onoff_control::ports::FleetLister;
    // moto makes no spot request for RunInstances; RequestSpotInstances makes one, with the
    // tags a stoppable spot launch gives its request.
    let c = clients().await;
    let deployment = unique("deploy");
    let fleet = Ec2Fleet::new(c.ec2.clone(), launch_template_name(&c).await).with_deployment(deployment.clone());
    let request = |managed: String| {
        let ec2 = c.ec2.clone();
        async move {
            let out = ec2
                .request_spot_instances()
                .instance_count(1)
                .r#type(SpotInstanceType::Persistent)
                .launch_specification(
                    RequestSpotLaunchSpecification::builder()
                        .image_id("ami-12c6146b")
                        .instance_type(aws_sdk_ec2::types::InstanceType::G5Xlarge)
                        .build(),
                )
                .tag_specifications(
                    TagSpecification::builder()
                        .resource_type(ResourceType::SpotInstancesRequest)
                        .tags(Tag::builder().key("onoff:managed").value(managed).build())
                        .build(),
                )
                .send()
                .await
                .unwrap();
            out.spot_instance_requests()[0]
                .spot_instance_request_id()
                .unwrap()
                .to_string()
        }
    };
    let ours = request(deployment.clone()).await;
    let other = request(unique("other-deploy")).await;
    let listed = fleet.list_spot_requests().await.unwrap();
    assert_eq!(listed.len(), 1, "this deployment's only: {listed:?}");
    assert_eq!(listed[0].id, ours);
    assert!(
        listed[0].created_at > 1.0e9 && listed[0].created_at < f64::MAX,
        "{listed:?}"
    );
    assert!(
        listed[0].instance_id.as_deref().is_some_and(|i| i.starts_with("i-")),
        "{listed:?}"
    );
    // Cancelled by id, it is no longer listed; the other deployment's is left as it was.
    // (moto forgets a cancelled request and fails a second cancel with a 500; EC2 lists it
    // cancelled, and the adapter takes a request it does not find for done.)
    fleet.cancel_spot_requests(std::slice::from_ref(&ours)).await.unwrap();
    assert!(fleet.list_spot_requests().await.unwrap().is_empty());
    let left = c
        .ec2
        .describe_spot_instance_requests()
        .spot_instance_request_ids(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(left.spot_instance_requests().len(), 1);
}

#[tokio::test]
async fn a_one_time_spot_instance_is_refused_a_stop_as_ec2_refuses_it() {
    // moto stops any instance; EC2 refuses to stop a spot instance of a one-time request (an
    // instant fleet's), and the emulator's clients hold that (`onoff_aws::limits::OneTimeSpotStops`).
    let c = clients().await;
    let fleet = own_fleet(&c).await;
    let one_time = launch_one(&fleet, key("g5.xlarge", "us-east-1a", CapacityType::Spot)).await;
    let od = launch_one(&fleet, key("g5.xlarge", "us-east-1a", CapacityType::OnDemand)).await;
    let stoppable = fleet.clone().with_stoppable_spot(true, None);
    let persistent = launch_one(&stoppable, key("g5.xlarge", "us-east-1b", CapacityType::Spot)).await;
    let refused = fleet
        .stop(&[one_time.clone(), od.clone(), persistent.clone()])
        .await
        .unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0, one_time);
    assert!(
        refused[0]
            .1
            .message
            .starts_with("UnsupportedOperation: You can't stop the Spot Instance"),
        "{refused:?}"
    );
    assert_eq!(
        state_of(&fleet, &one_time).await.as_deref(),
        Some("running"),
        "nothing was stopped"
    );
    for id in [od, persistent] {
        assert!(
            matches!(state_of(&fleet, &id).await.as_deref(), Some("stopping" | "stopped")),
            "{id}"
        );
    }
}

#[tokio::test]
async fn a_terminated_instance_is_refused_a_stop_and_a_start_and_stays_terminated() {
    // moto stops (and starts) a terminated instance, and it is back; EC2 refuses both
    // (`IncorrectInstanceState`), and the emulator's clients hold that
    // (`onoff_aws::limits::TerminatedInstances`). The race: an agent shuts its instance down at
    // its idle timeout while the scaler stops it as idle. The stop must come back refused (the
    // caller then terminates the row), not done (a row stopped for an instance that is gone).
    let c = clients().await;
    let fleet = own_fleet(&c).await.with_stoppable_spot(true, None);
    let gone = launch_one(&fleet, key("g5.xlarge", "us-east-1a", CapacityType::OnDemand)).await;
    let kept = launch_one(&fleet, key("g5.xlarge", "us-east-1b", CapacityType::Spot)).await;
    fleet.terminate(std::slice::from_ref(&gone)).await.unwrap();
    let refused = fleet.stop(&[gone.clone(), kept.clone()]).await.unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0, gone);
    assert!(
        refused[0].1.message.starts_with(&format!(
            "IncorrectInstanceState: This instance '{gone}' is not in a state from which it can be stopped"
        )),
        "{refused:?}"
    );
    // Its start is refused too, and reported gone (looked up: terminated), so the caller retires
    // its row instead of keeping it as a stopped worker.
    let refused = fleet.start(std::slice::from_ref(&gone)).await.unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].1.message.starts_with("IncorrectInstanceState")
            && refused[0].1.message.ends_with("(the instance is terminated)"),
        "{refused:?}"
    );
    assert_eq!(
        refused[0].1.kind,
        onoff_control::ports::FleetErrorKind::NotFound,
        "{refused:?}"
    );
    let state = c
        .ec2
        .describe_instances()
        .instance_ids(&gone)
        .send()
        .await
        .unwrap()
        .reservations()
        .iter()
        .flat_map(|r| r.instances())
        .find_map(|i| i.state().and_then(|s| s.name()).map(|n| n.as_str().to_string()));
    assert_eq!(state.as_deref(), Some("terminated"), "not brought back");
    // The other one stopped, and a second stop of it is done, not refused.
    assert!(matches!(
        state_of(&fleet, &kept).await.as_deref(),
        Some("stopping" | "stopped")
    ));
    assert!(fleet.stop(std::slice::from_ref(&kept)).await.unwrap().is_empty());
    // Terminated in one batch with an id EC2 does not know: the call is refused whole, naming
    // it, and goes again without it.
    fleet
        .terminate(&["i-0123456789abcdef0".to_string(), kept.clone()])
        .await
        .unwrap();
    assert_eq!(state_of(&fleet, &kept).await, None, "terminated, no longer listed");
}

#[tokio::test]
async fn the_ec2_fleet_answers_as_the_fake_fleet_does() {
    // The same steps the fake's test runs (crates/control/tests/contract.rs), through the local
    // stack's EC2 limits, a stop lasting 300 ms instead of `limits::STOPPING_S`.
    let c = clients().await;
    let window = std::time::Duration::from_millis(300);
    let ec2 = aws_sdk_ec2::Client::from_conf(
        aws_sdk_ec2::config::Builder::from(&conf().await)
            .interceptor(onoff_aws::limits::AwsLimits)
            .interceptor(onoff_aws::limits::OneTimeSpotStops)
            .interceptor(onoff_aws::limits::StoppingInstances { window: Some(window) })
            .interceptor(onoff_aws::limits::TerminatedInstances)
            .build(),
    );
    let fleet = Ec2Fleet::new(ec2, launch_template_name(&c).await)
        .with_subnets(Ec2Fleet::default_subnets(&c.ec2).await.unwrap())
        .with_deployment(unique("deploy"));
    let settle = |_id: String| tokio::time::sleep(window + std::time::Duration::from_millis(100));
    contract::fleet_answers_as_ec2(
        &fleet,
        settle,
        key("g5.xlarge", "us-east-1a", CapacityType::OnDemand),
        "i-0123456789abcdef0",
    )
    .await;
}

#[tokio::test]
async fn an_instance_still_stopping_is_refused_a_start_as_ec2_refuses_it() {
    // moto stops an instance at once; EC2 takes minutes, and refuses StartInstances until the
    // instance is stopped. The emulator's clients hold that for `limits::STOPPING_S` after a stop
    // (`onoff_aws::limits::StoppingInstances`).
    let c = clients().await;
    let fleet = own_fleet(&c).await.with_stoppable_spot(true, None);
    let id = launch_one(&fleet, key("g5.xlarge", "us-east-1a", CapacityType::Spot)).await;
    assert!(fleet.stop(std::slice::from_ref(&id)).await.unwrap().is_empty());
    let refused = fleet.start(std::slice::from_ref(&id)).await.unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].1.message.starts_with(&format!(
            "IncorrectInstanceState: The instance '{id}' is not in a state from which it can be started"
        )),
        "{refused:?}"
    );
    // Not a capacity error: classed as still stopping (looked up after the refusal; moto lists
    // it stopped already), so the caller holds the start or launches, the offering stays
    // available.
    assert_eq!(
        refused[0].1.kind,
        onoff_control::ports::FleetErrorKind::Stopping,
        "{refused:?}"
    );
    assert!(
        refused[0].1.message.ends_with("(the instance is stopped)"),
        "{refused:?}"
    );
    assert_eq!(
        state_of(&fleet, &id).await.as_deref(),
        Some("stopped"),
        "nothing started"
    );
    // Once it has stopped (here a client that takes a stop to last 200 ms), it starts.
    let quick = aws_sdk_ec2::Client::from_conf(
        aws_sdk_ec2::config::Builder::from(&conf().await)
            .interceptor(onoff_aws::limits::StoppingInstances {
                window: Some(std::time::Duration::from_millis(200)),
            })
            .build(),
    );
    let quick = Ec2Fleet::new(quick, launch_template_name(&c).await);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(quick.start(std::slice::from_ref(&id)).await.unwrap().is_empty());
    assert_eq!(state_of(&fleet, &id).await.as_deref(), Some("running"));
    fleet.terminate(&[id]).await.unwrap();
}

/// `onoff cost` prices a worker's instance time from its row (`instance_run_s`): its runs, not its
/// stopped spells (a stopped instance bills its volume only). Before, it priced the whole span from
/// the last launch or start to the end, stopped hours included, and forgot the runs before a start.
#[tokio::test]
async fn a_worker_row_counts_its_runs_not_its_stopped_spells() {
    let c = clients().await;
    let name = unique("workers");
    table(&c, &name, onoff_aws::state::WORKER_KEY).await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &name, ARN_PREFIX);
    let id = "i-0eeeeeeeeeeeeeee6";
    let l = 1_700_000_000.0;
    reg.register_launch(WorkerRecord::launched(
        id,
        "standard",
        key("g5.xlarge", "us-east-1a", CapacityType::Spot),
        0.39,
        l,
    ))
    .await
    .unwrap();
    let run_s = |now: f64| {
        let (c, name) = (c.clone(), name.clone());
        async move {
            let item = c
                .dynamodb
                .get_item()
                .table_name(&name)
                .key(
                    onoff_aws::state::WORKER_KEY,
                    aws_sdk_dynamodb::types::AttributeValue::S(format!("{ARN_PREFIX}{id}")),
                )
                .consistent_read(true)
                .send()
                .await
                .unwrap()
                .item
                .unwrap();
            onoff_aws::state::instance_run_s(&item, now).unwrap()
        }
    };
    // Running: from its launch to now.
    assert_eq!(run_s(l + 300.0).await, 300.0);
    // Stopped after 600 s, its stop's write retried: 600 s, however long it stays stopped.
    reg.heartbeat(id, WorkerState::Idle, Some(l + 400.0), l + 400.0)
        .await
        .unwrap();
    for _ in 0..2 {
        assert!(reg.mark_stopped(id, l + 600.0, l + 90_000.0, l).await.unwrap());
    }
    assert_eq!(run_s(l + 600.0).await, 600.0);
    assert_eq!(run_s(l + 4_000.0).await, 600.0);
    // Started at 4,000 s: that run adds to the first, 300 s in.
    assert!(reg.mark_started(id, l + 4_000.0, None, None, None).await.unwrap());
    assert_eq!(run_s(l + 4_300.0).await, 900.0);
    // A start refused puts the stop back: the stopped spell does not count.
    assert!(reg
        .mark_start_refused(id, l + 4_000.0, l, Some(l + 600.0), Some(l + 90_000.0))
        .await
        .unwrap());
    assert_eq!(run_s(l + 8_000.0).await, 600.0);
    // Started at 8,000 s, stopped again at 9,000 s, then terminated while stopped: 1,600 s in all.
    assert!(reg.mark_started(id, l + 8_000.0, None, None, None).await.unwrap());
    reg.heartbeat(id, WorkerState::Idle, Some(l + 8_500.0), l + 8_500.0)
        .await
        .unwrap();
    assert!(reg
        .mark_stopped(id, l + 9_000.0, l + 90_000.0, l + 8_000.0)
        .await
        .unwrap());
    assert!(reg
        .set_state_if(id, WorkerState::Terminating, &[WorkerState::Stopped])
        .await
        .unwrap());
    assert_eq!(run_s(l + 50_000.0).await, 1_600.0);
}

#[tokio::test]
async fn a_stopped_worker_row_is_written_once_kept_from_its_agent_and_started_again() {
    let c = clients().await;
    let name = unique("workers");
    table(&c, &name, onoff_aws::state::WORKER_KEY).await;
    let reg = DynamoWorkers::new(c.dynamodb.clone(), &name, ARN_PREFIX);
    let id = "i-0eeeeeeeeeeeeeee5";
    let rec = WorkerRecord {
        project: Some("p".into()),
        pinned_job: Some("job-old".into()),
        ..WorkerRecord::launched(
            id,
            "standard",
            key("g5.xlarge", "us-east-1a", CapacityType::Spot),
            0.39,
            1_700_000_000.0,
        )
    };
    reg.register_launch(rec).await.unwrap();
    // Only an Idle row is stopped.
    assert!(
        !reg.mark_stopped(id, 1_700_000_500.0, 1_700_010_000.0, 1_700_000_000.0)
            .await
            .unwrap(),
        "Pending: not stopped"
    );
    reg.heartbeat(id, WorkerState::Idle, Some(1_700_000_400.0), 1_700_000_400.0)
        .await
        .unwrap();
    assert!(reg
        .mark_stopped(id, 1_700_000_500.0, 1_700_010_000.0, 1_700_000_000.0)
        .await
        .unwrap());
    // Its retry (an answer lost) is done, not refused.
    assert!(reg
        .mark_stopped(id, 1_700_000_500.0, 1_700_010_000.0, 1_700_000_000.0)
        .await
        .unwrap());
    let row = reg.get(id).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.idle_since, row.hold_until),
        (WorkerState::Stopped, Some(1_700_000_500.0), Some(1_700_010_000.0))
    );
    // Its agent, going down with the instance, neither takes a job nor revives the row.
    assert!(!reg.mark_busy(id, 1_700_000_510.0).await.unwrap());
    assert!(reg
        .heartbeat(id, WorkerState::Idle, Some(1_700_000_400.0), 1_700_000_510.0)
        .await
        .is_err());
    assert_eq!(reg.get(id).await.unwrap().unwrap().state, WorkerState::Stopped);
    // Started for another job (and no project): Pending since the start, the old job, idle time,
    // hold and heartbeat gone; its retry done; a second start refused.
    assert!(reg
        .mark_started(id, 1_700_002_000.0, None, Some("job-new"), None)
        .await
        .unwrap());
    assert!(reg
        .mark_started(id, 1_700_002_000.0, None, Some("job-new"), None)
        .await
        .unwrap());
    assert!(!reg.mark_started(id, 1_700_002_100.0, None, None, None).await.unwrap());
    let row = reg.get(id).await.unwrap().unwrap();
    assert_eq!((row.state, row.launched_at), (WorkerState::Pending, 1_700_002_000.0));
    assert_eq!((row.project, row.pinned_job.as_deref()), (None, Some("job-new")));
    assert_eq!((row.idle_since, row.hold_until, row.heartbeat_at), (None, None, None));
    // EC2 refused that start (still stopping): put back as it was stopped and launched, its retry
    // done; a put-back for another start (not the row's) refused.
    assert!(!reg
        .mark_start_refused(
            id,
            1_700_002_100.0,
            1_700_000_000.0,
            Some(1_700_000_500.0),
            Some(1_700_010_000.0)
        )
        .await
        .unwrap());
    for _ in 0..2 {
        assert!(reg
            .mark_start_refused(
                id,
                1_700_002_000.0,
                1_700_000_000.0,
                Some(1_700_000_500.0),
                Some(1_700_010_000.0)
            )
            .await
            .unwrap());
    }
    let row = reg.get(id).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.idle_since, row.hold_until, row.launched_at),
        (
            WorkerState::Stopped,
            Some(1_700_000_500.0),
            Some(1_700_010_000.0),
            1_700_000_000.0
        )
    );
    // Started again, refused again without a known stop: put back without one.
    assert!(reg.mark_started(id, 1_700_003_000.0, None, None, None).await.unwrap());
    assert!(reg
        .mark_start_refused(id, 1_700_003_000.0, 1_700_000_000.0, None, None)
        .await
        .unwrap());
    let row = reg.get(id).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.idle_since, row.hold_until, row.launched_at),
        (WorkerState::Stopped, None, None, 1_700_000_000.0)
    );
    assert_eq!(
        reg.mark_stopped("i-0bbbbbbbbbbbbbbb2", 1.0, 2.0, 0.0).await,
        Err(StoreError::NotFound("i-0bbbbbbbbbbbbbbb2".into()))
    );
    assert_eq!(
        reg.mark_start_refused("i-0bbbbbbbbbbbbbbb2", 1.0, 0.0, None, None)
            .await,
        Err(StoreError::NotFound("i-0bbbbbbbbbbbbbbb2".into()))
    );
}

/// A fleet of this stack's own deployment whose spot workers are stoppable (persistent
/// requests), every request body logged and held to AWS's limits; with its launch template id
/// and deployment name.
async fn stoppable_spot_fleet(c: &Clients) -> (Ec2Fleet, BodyLog, String, String) {
    let subnets = Ec2Fleet::default_subnets(&c.ec2).await.unwrap();
    let deployment = unique("deploy");
    let sent = BodyLog::default();
    let ec2 = aws_sdk_ec2::Client::from_conf(
        aws_sdk_ec2::config::Builder::from(&conf().await)
            .interceptor(sent.clone())
            .interceptor(onoff_aws::limits::AwsLimits)
            .build(),
    );
    let lt = launch_template(c).await;
    let fleet = Ec2Fleet::new(ec2, &lt)
        .with_subnets(subnets)
        .with_deployment(&deployment)
        .with_stoppable_spot(true, None);
    (fleet, sent, lt, deployment)
}

#[tokio::test]
async fn stoppable_spot_launches_persistent_requests_that_stop_start_and_terminate() {
    let c = clients().await;
    let (fleet, sent, lt, deployment) = stoppable_spot_fleet(&c).await;
    let lane = unique("lane");
    let req = LaunchRequest {
        lane: lane.clone(),
        offerings: vec![
            key("g5.xlarge", "us-east-1a", CapacityType::Spot),
            key("g5.xlarge", "us-east-1b", CapacityType::Spot),
        ],
        count: 3,
        project: Some("vision".into()),
        job: None,
        client_token: String::new(),
    }
    .with_token_for(&unique("decision"));
    let launched = fleet.launch(&req).await.unwrap().launched;
    // Two of three on the first offering, one on the second: one RunInstances each, all or none.
    let on = |z: &str| launched.iter().filter(|l| l.offering.zone == z).count();
    assert_eq!((on("us-east-1a"), on("us-east-1b")), (2, 1), "{launched:?}");
    let bodies = sent.0.lock().unwrap().clone();
    let runs: Vec<&String> = bodies.iter().filter(|b| b.contains("Action=RunInstances")).collect();
    assert_eq!(runs.len(), 2, "{bodies:?}");
    for (i, body) in runs.iter().enumerate() {
        for part in [
            "InstanceMarketOptions.MarketType=spot",
            "InstanceMarketOptions.SpotOptions.SpotInstanceType=persistent",
            "InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior=stop",
            "TagSpecification.2.ResourceType=spot-instances-request",
            &format!("ClientToken={}-{i}", req.client_token),
        ] {
            assert!(body.contains(part), "{part} not in {body}");
        }
        assert!(
            body.contains(if i == 0 { "MinCount=2" } else { "MinCount=1" }),
            "{body}"
        );
    }
    assert!(!bodies.iter().any(|b| b.contains("Action=CreateFleet")));
    onoff_aws::fleet::tag_as_ec2_does(&c.ec2, &deployment, &lt).await;
    let id = launched[0].instance_id.clone();
    // Stopped, it is still listed (the reaper must not take it for gone); started, it runs.
    let refused = fleet.stop(std::slice::from_ref(&id)).await.unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(state_of(&fleet, &id).await.as_deref(), Some("stopped"));
    let listed = onoff_control::ports::FleetLister::list_managed(&fleet).await.unwrap();
    assert!(listed.iter().any(|i| i.instance_id == id));
    // A stop of a stopped instance is done, not refused.
    assert!(fleet.stop(std::slice::from_ref(&id)).await.unwrap().is_empty());
    let refused = fleet.start(std::slice::from_ref(&id)).await.unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(state_of(&fleet, &id).await.as_deref(), Some("running"));
    // An unknown instance is refused with not-found (the caller terminates it instead).
    let gone = "i-00000000000000000".to_string();
    let refused = fleet.stop(std::slice::from_ref(&gone)).await.unwrap();
    assert_eq!(refused.len(), 1);
    assert_eq!(
        refused[0].1.kind,
        onoff_control::ports::FleetErrorKind::NotFound,
        "{refused:?}"
    );
    // Terminated: each instance's persistent request is looked up first (and cancelled where EC2
    // names one; moto's RunInstances records none), then the instances go.
    let ids: Vec<String> = launched.iter().map(|l| l.instance_id.clone()).collect();
    let before = sent.0.lock().unwrap().len();
    fleet.terminate(&ids).await.unwrap();
    let after: Vec<String> = sent.0.lock().unwrap()[before..].to_vec();
    let describe = after
        .iter()
        .position(|b| b.contains("Action=DescribeSpotInstanceRequests"));
    let terminate = after.iter().position(|b| b.contains("Action=TerminateInstances"));
    assert!(describe.is_some() && describe < terminate, "{after:?}");
    for id in ids {
        assert_eq!(state_of(&fleet, &id).await, None, "terminated: not listed");
    }
}

/// A terminate of more stoppable spot workers than EC2 takes filter values in one lookup: their
/// persistent requests are looked up with at most 200 filter values, 199 instance ids and the
/// deployment's tag (EC2 refuses more with `FilterLimitExceeded`, which `AwsLimits` holds), and
/// every instance ends.
#[tokio::test]
async fn terminating_more_than_200_stoppable_spot_workers_looks_them_up_200_at_a_time() {
    let c = clients().await;
    let (fleet, sent, _, _) = stoppable_spot_fleet(&c).await;
    let n = onoff_aws::limits::MAX_FILTER_VALUES + 1;
    let req = LaunchRequest {
        lane: unique("lane"),
        offerings: vec![key("g5.xlarge", "us-east-1a", CapacityType::Spot)],
        count: n as u32,
        project: None,
        job: None,
        client_token: String::new(),
    }
    .with_token_for(&unique("decision"));
    let launched = fleet.launch(&req).await.unwrap().launched;
    assert_eq!(launched.len(), n);
    let ids: Vec<String> = launched.iter().map(|l| l.instance_id.clone()).collect();
    let before = sent.0.lock().unwrap().len();
    fleet.terminate(&ids).await.unwrap();
    let after: Vec<String> = sent.0.lock().unwrap()[before..].to_vec();
    let lookups: Vec<usize> = after
        .iter()
        .filter(|b| b.contains("Action=DescribeSpotInstanceRequests") && b.contains("Filter.1.Name=instance-id"))
        .map(|b| b.matches("Filter.1.Value.").count())
        .collect();
    assert_eq!(lookups, vec![onoff_aws::limits::MAX_FILTER_VALUES - 1, 2], "{after:?}");
    let listed = onoff_control::ports::FleetLister::list_managed(&fleet).await.unwrap();
    assert!(
        !listed.iter().any(|i| ids.contains(&i.instance_id)),
        "all {n} terminated: none listed"
    );
}

/// moto stores a number DynamoDB refuses when an UpdateItem sets it (`NaN`, as
/// `format!("{}", f64::NAN)` gives it, or one past DynamoDB's range; a PutItem it checks in
/// part); the local stack's clients refuse it before it is sent, with DynamoDB's reason, so such
/// a write fails locally as it would on AWS. Most of this project's writes are UpdateItems.
#[tokio::test]
async fn a_number_dynamodb_refuses_is_refused_by_the_local_stack_though_moto_stores_it() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let c = clients().await;
    let name = unique("numbers");
    table(&c, &name, "id").await;
    let set = |client: &aws_sdk_dynamodb::Client, v: &str| {
        client
            .update_item()
            .table_name(&name)
            .key("id", AttributeValue::S("w".into()))
            .update_expression("SET price_usd_per_h = :v")
            .expression_attribute_values(":v", AttributeValue::N(v.into()))
            .send()
    };
    let bare = aws_sdk_dynamodb::Client::new(&conf().await);
    for (v, why) in [
        (format!("{}", f64::NAN), "cannot be converted to a numeric value: NaN"),
        (
            format!("{}", f64::INFINITY),
            "cannot be converted to a numeric value: inf",
        ),
        ("1E126".to_string(), "Number overflow"),
    ] {
        set(&bare, &v)
            .await
            .unwrap_or_else(|e| panic!("moto stores {v}: {e:?}"));
        let err = set(&c.dynamodb, &v).await.unwrap_err();
        let got = format!("{}", aws_smithy_types::error::display::DisplayErrorContext(&err));
        assert!(got.contains("AWS would refuse") && got.contains(why), "{v}: {got}");
    }
    set(&c.dynamodb, "0.25").await.unwrap();
}
