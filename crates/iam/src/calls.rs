//! Recorded AWS calls (`calls.jsonl` of an `onoff local` run, written by
//! `onoff_aws::record`) as the IAM requests AWS would authorize for them: the action, the
//! resource ARN and the request context each one carries (the Service Authorization Reference's
//! resources and condition keys for the operations onoff makes).
//!
//! Covered: DynamoDB item, batch read and scan operations (`dynamodb:LeadingKeys` from the key; for item
//! operations `dynamodb:Attributes`, and for writes `dynamodb:ReturnValues`), SQS message
//! operations (batch forms as their single action), S3 object and list operations (`s3:prefix`;
//! a version id makes `GetObject` `s3:GetObjectVersion`), EC2 `CreateFleet` (the launch
//! template, each subnet, the instances with `aws:RequestTag/*`, the fleet, tagging at launch
//! `ec2:CreateTags` with `ec2:CreateAction`, and `iam:PassRole` of the worker role),
//! `TerminateInstances` (each instance with its `ec2:ResourceTag/*`) and the `Describe*` calls,
//! CloudWatch Logs streams (`CreateLogStream`, `PutLogEvents` on the stream's ARN), Lambda
//! `Invoke`, STS `AssumeRole`. Not covered: the image, snapshot, volume, network
//! interface and security group of a launch (the local emulator's launch template names none).

use std::collections::BTreeMap;

use serde_json::Value as J;

use crate::eval::{Request, Value};
use crate::Stack;

/// One recorded call, as `onoff_aws::record::CallRecord` writes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Call {
    /// `scaler`, `reconciler`, `interruption`, `submit`, `worker/<instance-id>`, `job/<job-id>`,
    /// `submitter`, `runner`.
    pub principal: String,
    /// Signing name of the service: `dynamodb`, `sqs`, `s3`, `ec2`, `sts`, `lambda`.
    pub service: String,
    /// SDK operation name, e.g. `UpdateItem`.
    pub operation: String,
    /// HTTP method.
    pub method: String,
    /// Full request URI.
    pub uri: String,
    /// Request body (cut at 16 KiB).
    pub body: String,
    /// HTTP status of the response.
    pub status: u16,
}

/// Read a call log; lines that do not parse are skipped.
#[must_use]
pub fn parse_log(text: &str) -> Vec<Call> {
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// What the requests need to know beyond the call itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct World {
    /// Instance id -> its tags (`aws:ec2launchtemplate:id` included), for
    /// `ec2:ResourceTag/<key>`.
    pub instance_tags: BTreeMap<String, BTreeMap<String, String>>,
    /// Launch template name -> id.
    pub launch_templates: BTreeMap<String, String>,
    /// The worker role's ARN (`iam:PassRole` at launch).
    pub worker_role_arn: String,
}

fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
}

fn form(body: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(body.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The path and the query pairs of a URI.
fn split_uri(uri: &str) -> (String, Vec<(String, String)>) {
    let no_scheme = uri.split_once("://").map_or(uri, |(_, r)| r);
    let path_query = no_scheme.find('/').map_or("/", |i| &no_scheme[i..]);
    let (path, query) = path_query.split_once('?').unwrap_or((path_query, ""));
    (path.to_string(), form(query))
}

/// The key value of a DynamoDB item or key map (`{"attr": {"S": "v"}}`), the one attribute of
/// onoff's tables' keys (`job_id`, `instance_arn`, `pk`).
fn leading_key(map: &J) -> Option<String> {
    for attr in ["job_id", "instance_arn", "pk", "instance_id"] {
        if let Some(v) = map.get(attr).and_then(|v| v.get("S")).and_then(J::as_str) {
            return Some(v.to_string());
        }
    }
    None
}

/// `dynamodb:Attributes` of an item operation: the top-level attributes the request names, each
/// once, sorted. "A top-level attribute is accessed by a request if it, or any nested attribute
/// that it contains, is specified in the request parameters" (DynamoDB developer guide, "Using
/// IAM policy conditions for fine-grained access control"), and AWS lists no parameter apart, so
/// every place a name can stand counts: the key and the item, the update, condition, projection,
/// filter and key-condition expressions (with `#placeholders` resolved through
/// `ExpressionAttributeNames`), and the legacy `AttributesToGet`, `AttributeUpdates` and
/// `Expected`. Counting a name AWS might not makes a policy stricter here than there, never looser.
/// What a write returns (`ReturnValues`) is not counted: the condition "is evaluated only on the
/// attributes specified in the request ..., not on attributes in the response" (same page), which
/// is why every statement of template.yaml that restricts `dynamodb:Attributes` also restricts
/// `dynamodb:ReturnValues`, as the guide asks.
fn attributes(body: &J) -> Vec<String> {
    let mut names = std::collections::BTreeSet::new();
    let placeholders = &body["ExpressionAttributeNames"];
    for map in ["Key", "Item", "AttributeUpdates", "Expected"] {
        if let Some(m) = body[map].as_object() {
            names.extend(m.keys().cloned());
        }
    }
    if let Some(list) = body["AttributesToGet"].as_array() {
        names.extend(list.iter().filter_map(J::as_str).map(str::to_string));
    }
    for expr in [
        "UpdateExpression",
        "ConditionExpression",
        "ProjectionExpression",
        "FilterExpression",
        "KeyConditionExpression",
    ] {
        if let Some(e) = body[expr].as_str() {
            expression_names(e, placeholders, &mut names);
        }
    }
    names.into_iter().collect()
}

/// A `BatchGetItem` as IAM authorizes it: one `dynamodb:BatchGetItem` request per table it reads,
/// with every key's value as `dynamodb:LeadingKeys` and the attributes it names (the keys'
/// and the projection's) as `dynamodb:Attributes` (DynamoDB developer guide, "Using IAM policy
/// conditions for fine-grained access control": a batch read is allowed only when the policy
/// allows it for every item it asks for).
fn batch_get_requests(body: &J, stack: &Stack) -> Result<Vec<Request>, String> {
    let tables = body["RequestItems"]
        .as_object()
        .ok_or("DynamoDB BatchGetItem: no RequestItems")?;
    let mut out = Vec::new();
    for (table, read) in tables {
        let arn = format!(
            "arn:{}:dynamodb:{}:{}:table/{table}",
            stack.partition, stack.region, stack.account
        );
        let mut req = Request::new("dynamodb:BatchGetItem", &arn);
        let keys = read["Keys"].as_array().map(Vec::as_slice).unwrap_or_default();
        let leading: Vec<String> = keys.iter().filter_map(leading_key).collect();
        req.context.insert("dynamodb:LeadingKeys".into(), Value::Many(leading));
        let mut names: std::collections::BTreeSet<String> = attributes(read).into_iter().collect();
        for key in keys {
            names.extend(key.as_object().into_iter().flat_map(|k| k.keys().cloned()));
        }
        req.context
            .insert("dynamodb:Attributes".into(), Value::Many(names.into_iter().collect()));
        out.push(req);
    }
    Ok(out)
}

/// The top-level attribute names of a DynamoDB expression: a name or `#placeholder` not after a
/// `.` (a nested attribute) and not before a `(` (a function: `list_append`, `if_not_exists`,
/// `attribute_exists`, `size`, ...), and not one of the expression keywords. Values (`:v`) and
/// list indexes (`[0]`) are not names.
fn expression_names(expr: &str, placeholders: &J, names: &mut std::collections::BTreeSet<String>) {
    const KEYWORDS: [&str; 9] = ["SET", "REMOVE", "ADD", "DELETE", "AND", "OR", "NOT", "BETWEEN", "IN"];
    let b = expr.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b':' || c.is_ascii_digit() {
            // A value or an index: skip the token.
            i += 1;
            while i < b.len() && word(b[i]) {
                i += 1;
            }
            continue;
        }
        if c != b'#' && !(c.is_ascii_alphabetic() || c == b'_') {
            i += 1;
            continue;
        }
        let start = i;
        i += 1;
        while i < b.len() && word(b[i]) {
            i += 1;
        }
        let token = &expr[start..i];
        let before = expr[..start].trim_end().as_bytes().last().copied();
        let after = expr[i..].trim_start().as_bytes().first().copied();
        if before == Some(b'.') || after == Some(b'(') {
            continue;
        }
        if token.starts_with('#') {
            if let Some(n) = placeholders[token].as_str() {
                names.insert(n.to_string());
            }
        } else if !KEYWORDS.iter().any(|k| k.eq_ignore_ascii_case(token)) {
            names.insert(token.to_string());
        }
    }
}

fn sqs_action(op: &str) -> String {
    let single = op.strip_suffix("Batch").unwrap_or(op);
    format!("sqs:{single}")
}

/// The IAM requests AWS authorizes for `call`, or why it cannot say.
///
/// # Errors
/// A service or operation this module does not cover, or a request it cannot read.
pub fn requests(call: &Call, stack: &Stack, world: &World) -> Result<Vec<Request>, String> {
    let (region, account, partition) = (&stack.region, &stack.account, &stack.partition);
    let op = call.operation.as_str();
    let unknown = || format!("{} {op} is not covered", call.service);
    match call.service.as_str() {
        "dynamodb" => {
            let body: J = serde_json::from_str(&call.body).map_err(|e| format!("DynamoDB {op} body: {e}"))?;
            if op == "BatchGetItem" {
                return batch_get_requests(&body, stack);
            }
            let table = body["TableName"]
                .as_str()
                .ok_or_else(|| format!("DynamoDB {op}: no TableName"))?;
            let mut arn = format!("arn:{partition}:dynamodb:{region}:{account}:table/{table}");
            if let Some(index) = body["IndexName"].as_str() {
                arn.push_str(&format!("/index/{index}"));
            }
            let mut req = Request::new(&format!("dynamodb:{op}"), &arn);
            let key = match op {
                "PutItem" => leading_key(&body["Item"]),
                "GetItem" | "UpdateItem" | "DeleteItem" => leading_key(&body["Key"]),
                "Scan" | "Query" | "DescribeTable" | "CreateTable" | "UpdateTimeToLive" => None,
                _ => return Err(unknown()),
            };
            if let Some(k) = key {
                req.context.insert("dynamodb:LeadingKeys".into(), Value::Many(vec![k]));
            }
            if matches!(op, "PutItem" | "GetItem" | "UpdateItem" | "DeleteItem") {
                req.context
                    .insert("dynamodb:Attributes".into(), Value::Many(attributes(&body)));
            }
            if matches!(op, "PutItem" | "UpdateItem" | "DeleteItem") {
                // A write always has one: NONE unless the request asks for more (the DynamoDB
                // developer guide's fine-grained access control: "the ReturnValues parameter
                // always has a value").
                let rv = body["ReturnValues"].as_str().unwrap_or("NONE");
                req.context
                    .insert("dynamodb:ReturnValues".into(), Value::One(rv.into()));
            }
            Ok(vec![req])
        }
        "sqs" => {
            let url = if call.body.trim_start().starts_with('{') {
                let body: J = serde_json::from_str(&call.body).map_err(|e| format!("SQS {op} body: {e}"))?;
                body["QueueUrl"].as_str().map(str::to_string)
            } else {
                form(&call.body)
                    .into_iter()
                    .find(|(k, _)| k == "QueueUrl")
                    .map(|(_, v)| v)
            };
            let url = url.ok_or_else(|| format!("SQS {op}: no QueueUrl"))?;
            let mut parts = url.trim_end_matches('/').rsplit('/');
            let name = parts.next().unwrap_or_default();
            let owner = parts.next().unwrap_or(account);
            Ok(vec![Request::new(
                &sqs_action(op),
                &format!("arn:{partition}:sqs:{region}:{owner}:{name}"),
            )])
        }
        "s3" => {
            let (path, query) = split_uri(&call.uri);
            let path = path.trim_start_matches('/');
            let (bucket, key) = path.split_once('/').unwrap_or((path, ""));
            let key = decode(key);
            let object = format!("arn:{partition}:s3:::{bucket}/{key}");
            let bucket_arn = format!("arn:{partition}:s3:::{bucket}");
            let q = |name: &str| query.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            Ok(vec![match op {
                "GetObject" | "HeadObject" => {
                    let action = if q("versionId").is_some() {
                        "s3:GetObjectVersion"
                    } else {
                        "s3:GetObject"
                    };
                    Request::new(action, &object)
                }
                "PutObject" | "CreateMultipartUpload" | "UploadPart" | "CompleteMultipartUpload" | "CopyObject" => {
                    Request::new("s3:PutObject", &object)
                }
                "AbortMultipartUpload" => Request::new("s3:AbortMultipartUpload", &object),
                "DeleteObject" => Request::new("s3:DeleteObject", &object),
                "ListObjectsV2" | "ListObjects" => {
                    let mut r = Request::new("s3:ListBucket", &bucket_arn);
                    if let Some(p) = q("prefix") {
                        r = r.with("s3:prefix", &p);
                    }
                    r
                }
                "ListObjectVersions" => Request::new("s3:ListBucketVersions", &bucket_arn),
                "HeadBucket" => Request::new("s3:ListBucket", &bucket_arn),
                _ => return Err(unknown()),
            }])
        }
        "ec2" => {
            let params = form(&call.body);
            let get = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            let instance = |id: &str| format!("arn:{partition}:ec2:{region}:{account}:instance/{id}");
            match op {
                "DescribeInstances"
                | "DescribeSubnets"
                | "DescribeLaunchTemplates"
                | "DescribeImages"
                | "DescribeSpotPriceHistory"
                | "DescribeSpotInstanceRequests" => Ok(vec![Request::new(&format!("ec2:{op}"), "*")]),
                "TerminateInstances" | "StopInstances" | "StartInstances" => Ok(params
                    .iter()
                    .filter(|(k, _)| k.starts_with("InstanceId."))
                    .map(|(_, id)| {
                        let mut r = Request::new(&format!("ec2:{op}"), &instance(id));
                        for (k, v) in world.instance_tags.get(id).into_iter().flatten() {
                            r = r.with(&format!("ec2:ResourceTag/{k}"), v);
                            r = r.with(&format!("aws:ResourceTag/{k}"), v);
                        }
                        r
                    })
                    .collect()),
                "CreateFleet" | "RunInstances" => {
                    let action = format!("ec2:{op}");
                    let lt_id = params
                        .iter()
                        .find(|(k, _)| k.ends_with("LaunchTemplateId"))
                        .map(|(_, v)| v.clone())
                        .or_else(|| {
                            params
                                .iter()
                                .find(|(k, _)| k.ends_with("LaunchTemplateName"))
                                .and_then(|(_, name)| world.launch_templates.get(name).cloned())
                        })
                        .ok_or_else(|| format!("{op}: no launch template"))?;
                    let mut out = vec![Request::new(
                        &action,
                        &format!("arn:{partition}:ec2:{region}:{account}:launch-template/{lt_id}"),
                    )];
                    for (_, subnet) in params.iter().filter(|(k, _)| k.ends_with("SubnetId")) {
                        out.push(Request::new(
                            &action,
                            &format!("arn:{partition}:ec2:{region}:{account}:subnet/{subnet}"),
                        ));
                    }
                    // The workers' security group named on a network interface (RunInstances).
                    for (_, group) in params.iter().filter(|(k, _)| k.contains(".SecurityGroupId.")) {
                        out.push(Request::new(
                            &action,
                            &format!("arn:{partition}:ec2:{region}:{account}:security-group/{group}"),
                        ));
                    }
                    // Tags of each resource type: TagSpecification.N.ResourceType, .Tag.M.Key/Value.
                    let tags_of = |kind: &str| -> Vec<(String, String)> {
                        let mut tags = Vec::new();
                        for (k, _) in params.iter().filter(|(k, v)| k.ends_with(".ResourceType") && v == kind) {
                            let spec = k.trim_end_matches(".ResourceType");
                            for m in 1.. {
                                let (Some(key), value) = (
                                    get(&format!("{spec}.Tag.{m}.Key")),
                                    get(&format!("{spec}.Tag.{m}.Value")),
                                ) else {
                                    break;
                                };
                                tags.push((key, value.unwrap_or_default()));
                            }
                        }
                        tags
                    };
                    let tags = tags_of("instance");
                    // A spot launch by RunInstances creates a spot request (a resource of its own,
                    // tagged with its own TagSpecification).
                    if op == "RunInstances" && get("InstanceMarketOptions.MarketType").as_deref() == Some("spot") {
                        let requests = format!("arn:{partition}:ec2:{region}:{account}:spot-instances-request/*");
                        let request_tags = tags_of("spot-instances-request");
                        let mut r = Request::new(&action, &requests);
                        let mut tag_req = Request::new("ec2:CreateTags", &requests).with("ec2:CreateAction", op);
                        for (k, v) in &request_tags {
                            r = r.with(&format!("aws:RequestTag/{k}"), v);
                            tag_req = tag_req.with(&format!("aws:RequestTag/{k}"), v);
                        }
                        out.push(r);
                        if !request_tags.is_empty() {
                            out.push(tag_req);
                        }
                    }
                    let mut inst = Request::new(&action, &format!("arn:{partition}:ec2:{region}:{account}:instance/*"));
                    let mut tag_req = Request::new(
                        "ec2:CreateTags",
                        &format!("arn:{partition}:ec2:{region}:{account}:instance/*"),
                    )
                    .with("ec2:CreateAction", op);
                    for (k, v) in &tags {
                        inst = inst.with(&format!("aws:RequestTag/{k}"), v);
                        tag_req = tag_req.with(&format!("aws:RequestTag/{k}"), v);
                    }
                    let keys: Vec<&str> = tags.iter().map(|(k, _)| k.as_str()).collect();
                    inst = inst.with_many("aws:TagKeys", &keys);
                    out.push(inst);
                    if !tags.is_empty() {
                        out.push(tag_req);
                    }
                    if op == "CreateFleet" {
                        out.push(Request::new(
                            &action,
                            &format!("arn:{partition}:ec2:{region}:{account}:fleet/*"),
                        ));
                    }
                    if !world.worker_role_arn.is_empty() {
                        out.push(
                            Request::new("iam:PassRole", &world.worker_role_arn)
                                .with("iam:PassedToService", "ec2.amazonaws.com"),
                        );
                    }
                    Ok(out)
                }
                // Authorized per request (tags unknown to this evaluator: a policy conditioned on
                // them denies, as it would without the tag).
                "CancelSpotInstanceRequests" => Ok(params
                    .iter()
                    .filter(|(k, _)| k.starts_with("SpotInstanceRequestId."))
                    .map(|(_, id)| {
                        Request::new(
                            "ec2:CancelSpotInstanceRequests",
                            &format!("arn:{partition}:ec2:{region}:{account}:spot-instances-request/{id}"),
                        )
                    })
                    .collect()),
                _ => Err(unknown()),
            }
        }
        "logs" | "cloudwatch logs" => {
            let body: J = serde_json::from_str(&call.body).map_err(|e| format!("Logs {op} body: {e}"))?;
            let group = body["logGroupName"]
                .as_str()
                .ok_or_else(|| format!("Logs {op}: no logGroupName"))?;
            let group_arn = format!("arn:{partition}:logs:{region}:{account}:log-group:{group}");
            match op {
                // Authorized on the stream's ARN (`log-group:<g>:log-stream:<s>`): what a policy
                // naming `log-group:<g>:*` (CloudFormation's LogGroup Arn) grants.
                "CreateLogStream" | "PutLogEvents" | "GetLogEvents" => {
                    let stream = body["logStreamName"]
                        .as_str()
                        .ok_or_else(|| format!("Logs {op}: no logStreamName"))?;
                    Ok(vec![Request::new(
                        &format!("logs:{op}"),
                        &format!("{group_arn}:log-stream:{stream}"),
                    )])
                }
                "CreateLogGroup" | "DescribeLogStreams" => {
                    Ok(vec![Request::new(&format!("logs:{op}"), &format!("{group_arn}:*"))])
                }
                _ => Err(unknown()),
            }
        }
        "lambda" => {
            let (path, _) = split_uri(&call.uri);
            // /2015-03-31/functions/<name>/invocations
            let name = path
                .split('/')
                .skip_while(|s| *s != "functions")
                .nth(1)
                .map(decode)
                .ok_or_else(|| format!("Lambda {op}: no function in {path}"))?;
            let arn = if name.starts_with("arn:") {
                name
            } else {
                format!("arn:{partition}:lambda:{region}:{account}:function:{name}")
            };
            match op {
                "Invoke" | "InvokeAsync" => Ok(vec![Request::new("lambda:InvokeFunction", &arn)]),
                _ => Err(unknown()),
            }
        }
        "sts" => {
            let params = form(&call.body);
            match op {
                "AssumeRole" => {
                    let role = params
                        .iter()
                        .find(|(k, _)| k == "RoleArn")
                        .map(|(_, v)| v.clone())
                        .ok_or("AssumeRole: no RoleArn")?;
                    Ok(vec![Request::new("sts:AssumeRole", &role)])
                }
                "GetCallerIdentity" => Ok(Vec::new()),
                _ => Err(unknown()),
            }
        }
        _ => Err(unknown()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack() -> Stack {
        Stack {
            partition: "aws".into(),
            region: "us-east-1".into(),
            account: "123456789012".into(),
            stack_name: "st".into(),
            ..Stack::default()
        }
    }

    fn call(service: &str, operation: &str, uri: &str, body: &str) -> Call {
        Call {
            principal: "worker/i-1".into(),
            service: service.into(),
            operation: operation.into(),
            method: "POST".into(),
            uri: uri.into(),
            body: body.into(),
            status: 200,
        }
    }

    #[test]
    fn a_dynamodb_update_names_its_table_and_leading_key() {
        let c = call(
            "dynamodb",
            "UpdateItem",
            "http://h/",
            r#"{"TableName":"st-worker-rows","Key":{"instance_arn":{"S":"arn:aws:ec2:us-east-1:123456789012:instance/i-1"}}}"#,
        );
        let r = requests(&c, &stack(), &World::default()).unwrap();
        assert_eq!(r[0].action, "dynamodb:UpdateItem");
        assert_eq!(
            r[0].resource,
            "arn:aws:dynamodb:us-east-1:123456789012:table/st-worker-rows"
        );
        assert_eq!(
            r[0].context["dynamodb:LeadingKeys"],
            Value::Many(vec!["arn:aws:ec2:us-east-1:123456789012:instance/i-1".into()])
        );
    }

    #[test]
    fn a_batch_read_is_one_request_per_table_with_every_key_it_reads() {
        let c = call(
            "dynamodb",
            "BatchGetItem",
            "http://h/",
            r##"{"RequestItems":{"st-jobs":{"Keys":[{"job_id":{"S":"a"}},{"job_id":{"S":"b"}}],"ConsistentRead":true,"ProjectionExpression":"#s","ExpressionAttributeNames":{"#s":"state"}},"st-control":{"Keys":[{"pk":{"S":"lease#scaler"}}]}}}"##,
        );
        let mut r = requests(&c, &stack(), &World::default()).unwrap();
        r.sort_by(|a, b| a.resource.cmp(&b.resource));
        assert_eq!(r.len(), 2);
        assert!(r.iter().all(|r| r.action == "dynamodb:BatchGetItem"));
        assert_eq!(
            r[0].resource,
            "arn:aws:dynamodb:us-east-1:123456789012:table/st-control"
        );
        assert_eq!(
            r[0].context["dynamodb:LeadingKeys"],
            Value::Many(vec!["lease#scaler".into()])
        );
        assert_eq!(r[1].resource, "arn:aws:dynamodb:us-east-1:123456789012:table/st-jobs");
        assert_eq!(
            r[1].context["dynamodb:LeadingKeys"],
            Value::Many(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            r[1].context["dynamodb:Attributes"],
            Value::Many(vec!["job_id".into(), "state".into()])
        );
        let bad = call("dynamodb", "BatchGetItem", "http://h/", r#"{"TableName":"st-jobs"}"#);
        assert!(requests(&bad, &stack(), &World::default())
            .unwrap_err()
            .contains("RequestItems"));
    }

    #[test]
    fn a_dynamodb_write_names_every_top_level_attribute_it_touches_and_its_return_values() {
        let c = call(
            "dynamodb",
            "UpdateItem",
            "http://h/",
            r##"{"TableName":"st-jobs","Key":{"job_id":{"S":"job-1"}},
                "UpdateExpression":"SET #s = :c, attempt_log = list_append(if_not_exists(attempt_log, :none), :e), spec.tags[0].name = :n REMOVE lease_owner, #l",
                "ConditionExpression":"(#s = :q OR #s = :r) AND attribute_exists(created_at) AND size(reason) < :max",
                "ExpressionAttributeNames":{"#s":"state","#l":"active_lane"},
                "ExpressionAttributeValues":{":c":{"S":"CANCELLED"}}}"##,
        );
        let r = requests(&c, &stack(), &World::default()).unwrap();
        let want = [
            "active_lane",
            "attempt_log",
            "created_at",
            "job_id",
            "lease_owner",
            "reason",
            "spec",
            "state",
        ];
        assert_eq!(
            r[0].context["dynamodb:Attributes"],
            Value::Many(want.iter().map(|s| (*s).to_string()).collect())
        );
        assert_eq!(r[0].context["dynamodb:ReturnValues"], Value::One("NONE".into()));
        let asks = call(
            "dynamodb",
            "PutItem",
            "http://h/",
            r#"{"TableName":"st-jobs","Item":{"job_id":{"S":"j"},"state":{"S":"QUEUED"}},"ReturnValues":"ALL_OLD"}"#,
        );
        let r = requests(&asks, &stack(), &World::default()).unwrap();
        assert_eq!(
            r[0].context["dynamodb:Attributes"],
            Value::Many(vec!["job_id".into(), "state".into()])
        );
        assert_eq!(r[0].context["dynamodb:ReturnValues"], Value::One("ALL_OLD".into()));
    }

    #[test]
    fn s3_operations_map_to_their_actions_and_a_list_carries_its_prefix() {
        let get = call(
            "s3",
            "GetObject",
            "http://127.0.0.1:5000/b/jobs/a%20b.json?versionId=v1&x-id=GetObject",
            "",
        );
        let r = requests(&get, &stack(), &World::default()).unwrap();
        assert_eq!(r[0].action, "s3:GetObjectVersion");
        assert_eq!(r[0].resource, "arn:aws:s3:::b/jobs/a b.json");
        let list = call(
            "s3",
            "ListObjectsV2",
            "http://127.0.0.1:5000/b?list-type=2&prefix=checkpoints%2Fjob-1%2F",
            "",
        );
        let r = requests(&list, &stack(), &World::default()).unwrap();
        assert_eq!(r[0].action, "s3:ListBucket");
        assert_eq!(r[0].resource, "arn:aws:s3:::b");
        assert_eq!(r[0].context["s3:prefix"], Value::One("checkpoints/job-1/".into()));
        let part = call(
            "s3",
            "UploadPart",
            "http://h/b/checkpoints/j/1/f?partNumber=2&uploadId=u",
            "",
        );
        assert_eq!(
            requests(&part, &stack(), &World::default()).unwrap()[0].action,
            "s3:PutObject"
        );
    }

    #[test]
    fn a_fleet_launch_is_the_template_the_subnets_the_tagged_instances_and_the_passed_role() {
        let body =
            "Action=CreateFleet&LaunchTemplateConfigs.1.LaunchTemplateSpecification.LaunchTemplateName=st-worker\
            &LaunchTemplateConfigs.1.Overrides.1.SubnetId=subnet-0a&TagSpecification.1.ResourceType=instance\
            &TagSpecification.1.Tag.1.Key=onoff%3Amanaged&TagSpecification.1.Tag.1.Value=st";
        let world = World {
            launch_templates: BTreeMap::from([("st-worker".to_string(), "lt-1".to_string())]),
            worker_role_arn: "arn:aws:iam::123456789012:role/st-worker".into(),
            ..World::default()
        };
        let r = requests(&call("ec2", "CreateFleet", "http://h/", body), &stack(), &world).unwrap();
        let resources: Vec<(&str, &str)> = r.iter().map(|x| (x.action.as_str(), x.resource.as_str())).collect();
        assert!(resources.contains(&(
            "ec2:CreateFleet",
            "arn:aws:ec2:us-east-1:123456789012:launch-template/lt-1"
        )));
        assert!(resources.contains(&("ec2:CreateFleet", "arn:aws:ec2:us-east-1:123456789012:subnet/subnet-0a")));
        let inst = r
            .iter()
            .find(|x| x.resource.ends_with(":instance/*") && x.action == "ec2:CreateFleet")
            .unwrap();
        assert_eq!(inst.context["aws:RequestTag/onoff:managed"], Value::One("st".into()));
        assert!(r.iter().any(|x| x.action == "iam:PassRole"));
        assert!(r.iter().any(|x| x.action == "ec2:CreateTags"));
    }

    #[test]
    fn a_terminate_carries_the_instances_tags() {
        let world = World {
            instance_tags: BTreeMap::from([(
                "i-9".to_string(),
                BTreeMap::from([("onoff:managed".to_string(), "st".to_string())]),
            )]),
            ..World::default()
        };
        let c = call(
            "ec2",
            "TerminateInstances",
            "http://h/",
            "Action=TerminateInstances&InstanceId.1=i-9",
        );
        let r = requests(&c, &stack(), &world).unwrap();
        assert_eq!(r[0].resource, "arn:aws:ec2:us-east-1:123456789012:instance/i-9");
        assert_eq!(r[0].context["ec2:ResourceTag/onoff:managed"], Value::One("st".into()));
        // A stop and a start are authorized the same way, each under its own action.
        for op in ["StopInstances", "StartInstances"] {
            let c = call("ec2", op, "http://h/", &format!("Action={op}&InstanceId.1=i-9"));
            let r = requests(&c, &stack(), &world).unwrap();
            assert_eq!(r[0].action, format!("ec2:{op}"));
            assert_eq!(r[0].context["ec2:ResourceTag/onoff:managed"], Value::One("st".into()));
        }
    }

    #[test]
    fn a_stoppable_spot_launch_is_also_a_tagged_spot_request_and_a_cancel_names_each_request() {
        let body = "Action=RunInstances&LaunchTemplate.LaunchTemplateId=lt-1&MinCount=1&MaxCount=1\
            &InstanceMarketOptions.MarketType=spot&NetworkInterface.1.SubnetId=subnet-0a\
            &NetworkInterface.1.SecurityGroupId.1=sg-1&TagSpecification.1.ResourceType=instance\
            &TagSpecification.1.Tag.1.Key=onoff%3Amanaged&TagSpecification.1.Tag.1.Value=st\
            &TagSpecification.2.ResourceType=spot-instances-request\
            &TagSpecification.2.Tag.1.Key=onoff%3Amanaged&TagSpecification.2.Tag.1.Value=st";
        let r = requests(
            &call("ec2", "RunInstances", "http://h/", body),
            &stack(),
            &World::default(),
        )
        .unwrap();
        let arn = |kind: &str| format!("arn:aws:ec2:us-east-1:123456789012:{kind}");
        let request = r
            .iter()
            .find(|x| x.action == "ec2:RunInstances" && x.resource == arn("spot-instances-request/*"))
            .expect("the spot request");
        assert_eq!(request.context["aws:RequestTag/onoff:managed"], Value::One("st".into()));
        assert!(r
            .iter()
            .any(|x| x.action == "ec2:CreateTags" && x.resource == arn("spot-instances-request/*")));
        assert!(r
            .iter()
            .any(|x| x.action == "ec2:RunInstances" && x.resource == arn("security-group/sg-1")));
        assert!(r
            .iter()
            .any(|x| x.action == "ec2:RunInstances" && x.resource == arn("subnet/subnet-0a")));
        let c = call(
            "ec2",
            "CancelSpotInstanceRequests",
            "http://h/",
            "Action=CancelSpotInstanceRequests&SpotInstanceRequestId.1=sir-1&SpotInstanceRequestId.2=sir-2",
        );
        let r = requests(&c, &stack(), &World::default()).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].resource, arn("spot-instances-request/sir-2"));
    }

    #[test]
    fn an_unknown_operation_is_named() {
        let c = call("ec2", "RebootInstances", "http://h/", "");
        assert!(requests(&c, &stack(), &World::default())
            .unwrap_err()
            .contains("RebootInstances"));
    }
}
