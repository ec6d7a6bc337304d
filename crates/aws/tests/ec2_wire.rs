//! The EC2 fleet adapter against EC2's own wire format for what moto never answers: an instant
//! fleet whose overrides EC2 refused (a full vCPU quota, no capacity), each error naming its
//! override in `errorSet`, and a call refused whole (`VcpuLimitExceeded`, HTTP 400). A one-shot
//! HTTP server in the test answers the SDK with those bodies (element names from the EC2 API
//! Reference, CreateFleet; the same the SDK's deserializer reads), so the adapter's parsing and
//! classification run as they would against EC2.

use std::sync::{Arc, Mutex};

use aws_sdk_ec2::config::{BehaviorVersion, Credentials, Region};
use onoff_aws::fleet::Ec2Fleet;
use onoff_control::ports::{Fleet, FleetErrorKind, LaunchRequest};
use onoff_policy::{CapacityType, OfferingKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serve `status` and `body` to every request on a local port; the requests' bodies are kept.
async fn ec2_answering(status: u16, body: String) -> (String, Arc<Mutex<Vec<String>>>) {
    ec2_answering_in_turn(vec![(status, body)]).await
}

/// Serve `replies` in turn, one a request, the last to every request after; the requests'
/// bodies are kept.
async fn ec2_answering_in_turn(replies: Vec<(u16, String)>) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = seen.clone();
    tokio::spawn(async move {
        let mut served = 0;
        while let Ok((mut sock, _)) = listener.accept().await {
            let (status, body) = &replies[served.min(replies.len() - 1)];
            served += 1;
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            // Headers, then as many body bytes as Content-Length says.
            loop {
                let n = sock.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text[..end]
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    if buf.len() >= end + 4 + len {
                        kept.lock().unwrap().push(text[end + 4..].to_string());
                        break;
                    }
                }
            }
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: text/xml;charset=UTF-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(reply.as_bytes()).await;
            let _ = sock.shutdown().await;
        }
    });
    (url, seen)
}

fn fleet(url: &str) -> Ec2Fleet {
    fleet_retrying(url, aws_sdk_ec2::config::retry::RetryConfig::standard())
}

fn fleet_retrying(url: &str, retry: aws_sdk_ec2::config::retry::RetryConfig) -> Ec2Fleet {
    let conf = aws_sdk_ec2::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("AKIDTEST", "secret", None, None, "test"))
        .endpoint_url(url)
        .retry_config(retry)
        .build();
    Ec2Fleet::new(aws_sdk_ec2::Client::from_conf(conf), "lt-0123456789abcdef0").with_deployment("wire")
}

fn spot(zone: &str) -> OfferingKey {
    OfferingKey {
        instance_type: "g5.xlarge".into(),
        zone: zone.into(),
        capacity_type: CapacityType::Spot,
    }
}

fn request() -> LaunchRequest {
    LaunchRequest {
        lane: "standard".into(),
        offerings: vec![spot("us-east-1a"), spot("us-east-1b")],
        count: 2,
        project: None,
        job: None,
        client_token: String::new(),
    }
}

/// The override of a g5.xlarge in `zone`, as an `errorSet` or `fleetInstanceSet` item names it.
fn overrides(zone: &str) -> String {
    format!(
        "<launchTemplateAndOverrides><launchTemplateSpecification><launchTemplateId>lt-0123456789abcdef0</launchTemplateId>\
         <version>1</version></launchTemplateSpecification><overrides><instanceType>g5.xlarge</instanceType>\
         <availabilityZone>{zone}</availabilityZone></overrides></launchTemplateAndOverrides><lifecycle>spot</lifecycle>"
    )
}

/// An `errorSet` item: the override in `zone` refused with `code`.
fn refused(zone: &str, code: &str, message: &str) -> String {
    format!(
        "<item>{}<errorCode>{code}</errorCode><errorMessage>{message}</errorMessage></item>",
        overrides(zone)
    )
}

/// A `fleetInstanceSet` item: instance `id` launched for the override in `zone`.
fn launched(zone: &str, id: &str) -> String {
    format!(
        "<item>{}<instanceIds><item>{id}</item></instanceIds><instanceType>g5.xlarge</instanceType></item>",
        overrides(zone)
    )
}

/// An instant fleet's answer (HTTP 200) with these `errorSet` and `fleetInstanceSet` items.
fn create_fleet_response(errors: &[String], instances: &[String]) -> String {
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<CreateFleetResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
    <requestId>7a3ba8b4-0000-0000-0000-000000000000</requestId>
    <fleetId>fleet-0123456789abcdef0</fleetId>
    <errorSet>{}</errorSet>
    <fleetInstanceSet>{}</fleetInstanceSet>
</CreateFleetResponse>"#,
        errors.concat(),
        instances.concat()
    )
}

const MAX_SPOT: (&str, &str) = ("MaxSpotInstanceCountExceeded", "Max spot instance count exceeded");

/// The whole call refused (HTTP 400), as EC2 answers a request over the on-demand vCPU quota.
const VCPU_LIMIT: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>VcpuLimitExceeded</Code><Message>You have requested more vCPU capacity than your current vCPU limit of 0 allows for the instance bucket that the specified instance type belongs to. Please visit http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit.</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000002</RequestID></Response>"#;

#[tokio::test]
async fn each_refused_override_is_short_with_its_own_kind() {
    // The spot quota refused one override, the other had no capacity: no instance.
    let body = create_fleet_response(
        &[
            refused("us-east-1a", MAX_SPOT.0, MAX_SPOT.1),
            refused(
                "us-east-1b",
                "InsufficientInstanceCapacity",
                "There is no Spot capacity available that matches your request.",
            ),
        ],
        &[],
    );
    let (url, seen) = ec2_answering(200, body).await;
    let r = fleet(&url)
        .launch(&request())
        .await
        .expect("an instant fleet answers 200");
    assert!(r.launched.is_empty());
    let kinds: Vec<(String, FleetErrorKind)> = r.short.iter().map(|(k, e)| (k.zone.clone(), e.kind)).collect();
    assert_eq!(
        kinds,
        [
            ("us-east-1a".to_string(), FleetErrorKind::QuotaExceeded),
            ("us-east-1b".to_string(), FleetErrorKind::InsufficientCapacity)
        ]
    );
    assert!(
        r.short[0].1.message.starts_with("MaxSpotInstanceCountExceeded"),
        "{:?}",
        r.short
    );
    let body = seen.lock().unwrap().join("\n");
    assert!(
        body.contains("Action=CreateFleet") && body.contains("Type=instant"),
        "{body}"
    );
}

#[tokio::test]
async fn a_partly_fulfilled_fleet_launches_one_and_names_the_quota_of_the_other() {
    let body = create_fleet_response(
        &[refused("us-east-1a", MAX_SPOT.0, MAX_SPOT.1)],
        &[launched("us-east-1b", "i-0123456789abcdef0")],
    );
    let (url, _) = ec2_answering(200, body).await;
    let r = fleet(&url).launch(&request()).await.unwrap();
    assert_eq!(r.launched.len(), 1);
    assert_eq!(
        (r.launched[0].instance_id.as_str(), &r.launched[0].offering),
        ("i-0123456789abcdef0", &spot("us-east-1b"))
    );
    assert_eq!(r.short.len(), 1);
    assert_eq!(
        (&r.short[0].0, r.short[0].1.kind),
        (&spot("us-east-1a"), FleetErrorKind::QuotaExceeded)
    );
}

#[tokio::test]
async fn a_call_refused_whole_for_the_vcpu_quota_is_a_quota_error() {
    let (url, _) = ec2_answering(400, VCPU_LIMIT.to_string()).await;
    let e = fleet(&url).launch(&request()).await.expect_err("refused");
    assert_eq!(e.kind, FleetErrorKind::QuotaExceeded, "{e:?}");
    assert!(
        e.message
            .starts_with("VcpuLimitExceeded: You have requested more vCPU capacity"),
        "{e:?}"
    );
}

/// The whole call refused for the account's limit of fleets per region (HTTP 400, as
/// runs-on/runs-on#88 quotes EC2's answer).
const MAX_FLEETS: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>MaxFleetCountExceeded</Code><Message>You've reached your quota for maximum Fleet Requests for this account.</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000003</RequestID></Response>"#;

#[tokio::test]
async fn the_accounts_fleet_limit_is_the_calls_error_not_an_offerings() {
    // Refused whole: an account limit, not a capacity or quota error of the offering.
    let (url, _) = ec2_answering(400, MAX_FLEETS.to_string()).await;
    let e = fleet(&url).launch(&request()).await.expect_err("refused");
    assert_eq!(e.kind, FleetErrorKind::AccountLimit, "{e:?}");
    assert!(e.message.starts_with("MaxFleetCountExceeded: "), "{e:?}");
    // Named in an instant fleet's errors beside an override: still the call's, so the caller
    // stops instead of skipping that offering and trying the next.
    let body = create_fleet_response(
        &[refused(
            "us-east-1a",
            "MaxFleetCountExceeded",
            "You've reached your quota for maximum Fleet Requests for this account.",
        )],
        &[],
    );
    let (url, _) = ec2_answering(200, body).await;
    let e = fleet(&url).launch(&request()).await.expect_err("the call's error");
    assert_eq!(e.kind, FleetErrorKind::AccountLimit, "{e:?}");
}

/// StartInstances' answer for one instance (EC2 API Reference, StartInstances).
fn started(id: &str) -> String {
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<StartInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000010</requestId><instancesSet><item><instanceId>{id}</instanceId><currentState><code>0</code><name>pending</name></currentState><previousState><code>80</code><name>stopped</name></previousState></item></instancesSet></StartInstancesResponse>"#
    )
}

/// EC2's throttling answer (HTTP 503, `RequestLimitExceeded`).
const THROTTLED: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>RequestLimitExceeded</Code><Message>Request limit exceeded.</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000011</RequestID></Response>"#;

/// The fleet with no retries: a throttle is final at once (the SDK's retries would only repeat it).
fn fleet_no_retries(url: &str) -> Ec2Fleet {
    fleet_retrying(url, aws_sdk_ec2::config::retry::RetryConfig::disabled())
}

/// EC2's refusal of a start for capacity (HTTP 500, `InsufficientInstanceCapacity`), which
/// refuses a call for several instances whole.
const NO_CAPACITY: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>InsufficientInstanceCapacity</Code><Message>We currently do not have sufficient g5.xlarge capacity in the Availability Zone you requested (us-east-1a).</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000018</RequestID></Response>"#;

/// The `Action` and `InstanceId.N` values of each request body.
fn calls(seen: &[String]) -> Vec<(String, Vec<String>)> {
    seen.iter()
        .map(|b| {
            let kv: Vec<(&str, &str)> = b.split('&').filter_map(|kv| kv.split_once('=')).collect();
            let action = kv.iter().find(|(k, _)| *k == "Action").map_or("", |(_, v)| v);
            let ids = kv
                .iter()
                .filter(|(k, _)| k.starts_with("InstanceId."))
                .map(|(_, v)| v.to_string())
                .collect();
            (action.to_string(), ids)
        })
        .collect()
}

#[tokio::test]
async fn stops_and_starts_go_out_as_one_call_and_one_per_instance_only_when_it_is_refused() {
    let ids: Vec<String> = ["i-1", "i-2", "i-3"].iter().map(|s| s.to_string()).collect();
    let stopping = r#"<?xml version="1.0" encoding="UTF-8"?>
<StopInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000019</requestId><instancesSet></instancesSet></StopInstancesResponse>"#;
    // Accepted whole: one round trip for the three.
    let (url, seen) = ec2_answering(200, stopping.to_string()).await;
    assert!(fleet_no_retries(&url).stop(&ids).await.unwrap().is_empty());
    let (url, seen_start) = ec2_answering(200, started("i-1")).await;
    assert!(fleet_no_retries(&url).start(&ids).await.unwrap().is_empty());
    for (seen, action) in [(seen, "StopInstances"), (seen_start, "StartInstances")] {
        assert_eq!(
            calls(&seen.lock().unwrap()),
            [(action.to_string(), ids.clone())],
            "one call naming all three"
        );
    }
    // Refused whole (one of them has no capacity): one call each, and only the one EC2 refuses
    // again is refused.
    let (url, seen) = ec2_answering_in_turn(vec![
        (500, NO_CAPACITY.to_string()),
        (200, started("i-1")),
        (500, NO_CAPACITY.to_string()),
        (200, started("i-3")),
    ])
    .await;
    let refused = fleet_no_retries(&url).start(&ids).await.unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(
        (refused[0].0.as_str(), refused[0].1.kind),
        ("i-2", FleetErrorKind::InsufficientCapacity)
    );
    let sent: Vec<Vec<String>> = calls(&seen.lock().unwrap()).into_iter().map(|(_, ids)| ids).collect();
    assert_eq!(
        sent,
        [ids.clone(), vec!["i-1".into()], vec!["i-2".into()], vec!["i-3".into()]]
    );
    // Throttled whole: nothing was done, the call's error.
    let (url, seen) = ec2_answering(503, THROTTLED.to_string()).await;
    let e = fleet_no_retries(&url).stop(&ids).await.expect_err("nothing done");
    assert_eq!(e.kind, FleetErrorKind::Throttled, "{e:?}");
    assert_eq!(seen.lock().unwrap().len(), 1, "no call per instance after a throttle");
}

#[tokio::test]
async fn a_start_throttled_midway_reports_the_instances_it_started() {
    let ids: Vec<String> = ["i-1", "i-2", "i-3"].iter().map(|s| s.to_string()).collect();
    // The call for all three is refused; then the first instance starts, and EC2 throttles the
    // rest. i-1 runs now: it must not come back refused, or its row would go back to Stopped
    // while it runs, billed.
    let (url, seen) = ec2_answering_in_turn(vec![
        (500, NO_CAPACITY.to_string()),
        (200, started("i-1")),
        (503, THROTTLED.to_string()),
    ])
    .await;
    let refused = fleet_no_retries(&url).start(&ids).await.expect("partly done");
    let refused_ids: Vec<&str> = refused.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(refused_ids, ["i-2", "i-3"], "{refused:?}");
    assert!(
        refused.iter().all(|(_, e)| e.kind == FleetErrorKind::Throttled),
        "{refused:?}"
    );
    // It stopped calling at the throttle: the refused call, one call for i-1, one throttled.
    assert_eq!(seen.lock().unwrap().len(), 3);
    // Throttled before anything started: the call failed whole.
    let (url, _) = ec2_answering(503, THROTTLED.to_string()).await;
    let e = fleet_no_retries(&url).start(&ids).await.expect_err("nothing done");
    assert_eq!(e.kind, FleetErrorKind::Throttled, "{e:?}");
}

#[tokio::test]
async fn a_stop_throttled_midway_reports_the_instances_it_stopped() {
    let ids: Vec<String> = ["i-1", "i-2"].iter().map(|s| s.to_string()).collect();
    let stopped = r#"<?xml version="1.0" encoding="UTF-8"?>
<StopInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000012</requestId><instancesSet><item><instanceId>i-1</instanceId><currentState><code>64</code><name>stopping</name></currentState><previousState><code>16</code><name>running</name></previousState></item></instancesSet></StopInstancesResponse>"#;
    // The call for both is refused (one is a spot instance of a one-time request), then i-1
    // stops and EC2 throttles the rest.
    let one_time = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>UnsupportedOperation</Code><Message>You can't stop the Spot Instance 'i-2' because it is associated with a one-time Spot Instance request. You can only stop Spot Instances associated with persistent Spot Instance requests.</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000020</RequestID></Response>"#;
    let (url, _) = ec2_answering_in_turn(vec![
        (400, one_time.to_string()),
        (200, stopped.to_string()),
        (503, THROTTLED.to_string()),
    ])
    .await;
    let refused = fleet_no_retries(&url).stop(&ids).await.expect("partly done");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(
        (refused[0].0.as_str(), refused[0].1.kind),
        ("i-2", FleetErrorKind::Throttled)
    );
}

/// TerminateInstances' answer for `ids` (EC2 API Reference, TerminateInstances).
fn terminated(ids: &[&str]) -> String {
    let items: String = ids
        .iter()
        .map(|id| {
            format!(
                "<item><instanceId>{id}</instanceId><currentState><code>32</code><name>shutting-down</name></currentState><previousState><code>16</code><name>running</name></previousState></item>"
            )
        })
        .collect();
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<TerminateInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000013</requestId><instancesSet>{items}</instancesSet></TerminateInstancesResponse>"#
    )
}

/// EC2's answer to a call naming instances that do not exist (HTTP 400,
/// `InvalidInstanceID.NotFound`), with `message` as EC2 words it.
fn instance_not_found(message: &str) -> String {
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>InvalidInstanceID.NotFound</Code><Message>{message}</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000014</RequestID></Response>"#
    )
}

/// DescribeSpotInstanceRequests' answer listing the persistent requests `ids`.
fn spot_requests_described(ids: &[&str]) -> String {
    let items: String = ids
        .iter()
        .map(|id| format!("<item><spotInstanceRequestId>{id}</spotInstanceRequestId><type>persistent</type><state>active</state></item>"))
        .collect();
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<DescribeSpotInstanceRequestsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000019</requestId><spotInstanceRequestSet>{items}</spotInstanceRequestSet></DescribeSpotInstanceRequestsResponse>"#
    )
}

/// CancelSpotInstanceRequests' answer: `ids` cancelled.
fn spot_requests_cancelled(ids: &[&str]) -> String {
    let items: String = ids
        .iter()
        .map(|id| format!("<item><spotInstanceRequestId>{id}</spotInstanceRequestId><state>cancelled</state></item>"))
        .collect();
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<CancelSpotInstanceRequestsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000016</requestId><spotInstanceRequestSet>{items}</spotInstanceRequestSet></CancelSpotInstanceRequestsResponse>"#
    )
}

/// The `Action` of each request body, in order.
fn actions(seen: &[String]) -> Vec<String> {
    calls(seen).into_iter().map(|(action, _)| action).collect()
}

#[tokio::test]
async fn a_terminate_naming_gone_instances_goes_again_without_the_ids_ec2_named() {
    let ids: Vec<String> = ["i-1", "i-2", "i-3", "i-4"].iter().map(|s| s.to_string()).collect();
    // The spot requests looked up first (none: on-demand instances). EC2 refuses the
    // termination whole and names the two it does not know: the call goes again with the other
    // two, and that is all (before: one call per instance).
    let (url, seen) = ec2_answering_in_turn(vec![
        (200, spot_requests_described(&[])),
        (400, instance_not_found("The instance IDs 'i-2, i-3' do not exist")),
        (200, terminated(&["i-1", "i-4"])),
    ])
    .await;
    fleet_no_retries(&url).terminate(&ids).await.expect("done");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        actions(&seen),
        [
            "DescribeSpotInstanceRequests",
            "TerminateInstances",
            "TerminateInstances"
        ],
        "{seen:?}"
    );
    assert!(
        seen[2].contains("InstanceId.1=i-1")
            && seen[2].contains("InstanceId.2=i-4")
            && !seen[2].contains("InstanceId.3"),
        "{seen:?}"
    );
    // An answer that names none of the batch: one call per instance, not-found counting as done.
    let (url, seen) = ec2_answering_in_turn(vec![
        (200, spot_requests_described(&[])),
        (400, instance_not_found("The instance ID 'i-9' does not exist")),
    ])
    .await;
    fleet_no_retries(&url).terminate(&ids).await.expect("done");
    assert_eq!(seen.lock().unwrap().len(), 2 + ids.len());
    // Any other refusal is the call's error.
    let (url, _) = ec2_answering_in_turn(vec![(200, spot_requests_described(&[])), (503, THROTTLED.to_string())]).await;
    let e = fleet_no_retries(&url).terminate(&ids).await.expect_err("throttled");
    assert_eq!(e.kind, FleetErrorKind::Throttled, "{e:?}");
    // As is a failed lookup of the spot requests: nothing is terminated that would launch again.
    let (url, seen) = ec2_answering(503, THROTTLED.to_string()).await;
    let e = fleet_no_retries(&url).terminate(&ids).await.expect_err("throttled");
    assert_eq!(e.kind, FleetErrorKind::Throttled, "{e:?}");
    assert!(
        !seen
            .lock()
            .unwrap()
            .iter()
            .any(|b| b.contains("Action=TerminateInstances")),
        "terminated with its requests unknown"
    );
}

#[tokio::test]
async fn a_launch_cancelled_before_ec2_lists_it_still_cancels_its_spot_request() {
    // A stoppable spot launch (RunInstances, a persistent request) cancelled moments later, as
    // `act` cancels a launch it could not register: EC2's lookups may not list the instance yet
    // (eventually consistent, EC2 API Reference, "Eventual consistency"), but RunInstances named
    // its request, and that is cancelled before the instance is terminated, or EC2 would launch
    // another.
    let ran = r#"<?xml version="1.0" encoding="UTF-8"?>
<RunInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7a3ba8b4-0000-0000-0000-000000000021</requestId><reservationId>r-1</reservationId><ownerId>123456789012</ownerId><instancesSet><item><instanceId>i-0c0ffee000000000a</instanceId><spotInstanceRequestId>sir-86k84j6p</spotInstanceRequestId><instanceState><code>0</code><name>pending</name></instanceState></item></instancesSet></RunInstancesResponse>"#;
    let (url, seen) = ec2_answering_in_turn(vec![
        (200, ran.to_string()),
        // Not listed yet.
        (200, spot_requests_described(&[])),
        (200, spot_requests_cancelled(&["sir-86k84j6p"])),
        (200, terminated(&["i-0c0ffee000000000a"])),
    ])
    .await;
    let fleet = fleet_no_retries(&url).with_stoppable_spot(true, None);
    let mut req = request();
    req.offerings = vec![spot("us-east-1a")];
    req.count = 1;
    let launched = fleet.launch(&req).await.expect("launched").launched;
    let ids: Vec<String> = launched.iter().map(|l| l.instance_id.clone()).collect();
    assert_eq!(ids, ["i-0c0ffee000000000a"]);
    fleet.cancel_launch(&ids).await.expect("cancelled");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        actions(&seen),
        [
            "RunInstances",
            "DescribeSpotInstanceRequests",
            "CancelSpotInstanceRequests",
            "TerminateInstances"
        ],
        "{seen:?}"
    );
    assert!(seen[2].contains("SpotInstanceRequestId.1=sir-86k84j6p"), "{seen:?}");
}

#[tokio::test]
async fn a_terminate_cancels_only_this_deployments_spot_requests_whatever_the_fleet_launches_now() {
    // A fleet that no longer launches stoppable spot workers (`scale_down.stop_idle` changed)
    // ends one launched while it did: its persistent request, tagged for the deployment, is
    // cancelled first, or EC2 launches it again once its instance is gone. The one-time request
    // of an instant fleet's spot instance is not the deployment's (untagged, and the functions'
    // role may not cancel it): the lookup asks EC2 for the deployment's tag, and EC2 answers the
    // tagged request only. EC2 makes spot request ids of letters and digits.
    let (url, seen) = ec2_answering_in_turn(vec![
        (200, spot_requests_described(&["sir-86k84j6p"])),
        (200, spot_requests_cancelled(&["sir-86k84j6p"])),
        (200, terminated(&["i-1", "i-2", "i-3"])),
    ])
    .await;
    let ids: Vec<String> = ["i-1", "i-2", "i-3"].iter().map(|s| s.to_string()).collect();
    fleet_no_retries(&url)
        .with_deployment("st")
        .terminate(&ids)
        .await
        .expect("done");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        actions(&seen),
        [
            "DescribeSpotInstanceRequests",
            "CancelSpotInstanceRequests",
            "TerminateInstances"
        ],
        "{seen:?}"
    );
    // The lookup: every instance by id, and the deployment's tag.
    assert!(
        seen[0].contains("Filter.1.Name=instance-id")
            && seen[0].contains("Filter.1.Value.1=i-1")
            && seen[0].contains("Filter.1.Value.2=i-2")
            && seen[0].contains("Filter.1.Value.3=i-3")
            && seen[0].contains("Filter.2.Name=tag%3Aonoff%3Amanaged")
            && seen[0].contains("Filter.2.Value.1=st"),
        "{seen:?}"
    );
    assert!(
        seen[1].contains("SpotInstanceRequestId.1=sir-86k84j6p") && !seen[1].contains("sir-dryi1gcm"),
        "{seen:?}"
    );
    // Nothing tagged: no cancel at all.
    let (url, seen) =
        ec2_answering_in_turn(vec![(200, spot_requests_described(&[])), (200, terminated(&["i-2"]))]).await;
    fleet_no_retries(&url).terminate(&ids[1..2]).await.expect("done");
    assert_eq!(
        actions(&seen.lock().unwrap()),
        ["DescribeSpotInstanceRequests", "TerminateInstances"]
    );
}

#[tokio::test]
async fn a_cancel_naming_a_gone_spot_request_still_cancels_the_others_of_its_batch() {
    // A stoppable spot fleet cancels its instances' persistent requests before terminating them.
    // EC2 refuses a cancel whole for a request it does not know: the others must still be
    // cancelled, or each launches again once its instance is gone. Request ids as EC2 makes them
    // (letters and digits), so the one the refusal names is told from the others.
    let gone = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>InvalidSpotInstanceRequestID.NotFound</Code><Message>The spot instance request ID 'sir-k3x9q7mz' does not exist</Message></Error></Errors><RequestID>7a3ba8b4-0000-0000-0000-000000000017</RequestID></Response>"#;
    let (url, seen) = ec2_answering_in_turn(vec![
        (200, spot_requests_described(&["sir-k3x9q7mz", "sir-0a2"])),
        (400, gone.to_string()),
        (200, spot_requests_cancelled(&["sir-0a2"])),
        (200, terminated(&["i-1", "i-2"])),
    ])
    .await;
    let ids: Vec<String> = ["i-1", "i-2"].iter().map(|s| s.to_string()).collect();
    fleet_no_retries(&url)
        .with_stoppable_spot(true, None)
        .terminate(&ids)
        .await
        .expect("done");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        actions(&seen),
        [
            "DescribeSpotInstanceRequests",
            "CancelSpotInstanceRequests",
            "CancelSpotInstanceRequests",
            "TerminateInstances"
        ],
        "{seen:?}"
    );
    assert!(
        seen[2].contains("SpotInstanceRequestId.1=sir-0a2") && !seen[2].contains("sir-k3x9q7mz"),
        "{seen:?}"
    );
}
