//! AWS's own request limits, held by the local stack: an SDK interceptor that refuses, before
//! sending, a request AWS would refuse but the emulator (moto 5.2.5) takes. With it, a test
//! against moto fails where AWS would, and the code's error path runs as it would on AWS.
//!
//! [`Clients`](crate::settings::Clients) add it whenever an endpoint override is set (an
//! emulator); against AWS itself the service holds its limits. Each check is a documented limit,
//! named with its source:
//!
//! | call | limit | source |
//! |---|---|---|
//! | EC2 `TerminateInstances` | at most 1,000 instance ids | EC2 API Reference, TerminateInstances, `InstanceIds` |
//! | EC2 `Describe*` with filters (instances, spot requests, subnets, images, spot prices) | at most 200 filter values in one call, each at most 255 characters | EC2 API Reference, "Error codes": `FilterLimitExceeded`, "The request uses too many filters or too many filter values"; EC2 answers "The maximum number of filter values specified on a single call is 200" and "The maximum length for a filter value is 255 characters" |
//! | EC2 `CreateFleet`, `CreateTags` | at most 50 tags per resource; keys 1–128 characters, values at most 256 | EC2 User Guide, "Tag restrictions" |
//! | EC2 `CreateFleet` | no instance type twice in one subnet (zone) among the overrides | EC2 error `InvalidFleetConfig`, "The fleet configuration contains duplicate instance pools" |
//! | STS `AssumeRole` | `Policy` at most 2,048 characters of U+0020–U+00FF, tab, LF, CR; `RoleSessionName` 2–64 of `[\w+=,.@-]`; `DurationSeconds` 900–43,200 | AWS STS API Reference, AssumeRole |
//! | S3 object calls | key at most 1,024 bytes of UTF-8 | Amazon S3 User Guide, "Naming Amazon S3 objects" |
//! | EC2 `RunInstances` | tags as for `CreateFleet` | EC2 User Guide, "Tag restrictions" |
//! | DynamoDB item and key calls | a number is a decimal of at most 38 significant digits within ±1E-130 to ±9.9…9E+125 (no NaN, no infinity) | Amazon DynamoDB Developer Guide, "Supported data types and naming rules": Number |
//! | DynamoDB expressions (condition, update, key condition, filter, projection) | no reserved word as an attribute name written out: `#alias` it | Amazon DynamoDB Developer Guide, "Reserved words in DynamoDB" (moto checks an UpdateExpression only) |
//!
//! Limits moto already enforces (SQS receive, visibility and delay bounds, message size, and
//! DynamoDB's item size) are left to it. moto checks a PutItem's numbers in part and an
//! UpdateItem's not at all: it stores `NaN` and `inf` (what `format!("{}", f64::NAN)` gives)
//! and numbers past DynamoDB's range.
//!
//! [`OneTimeSpotStops`] holds one of EC2's rules that needs what an earlier call launched: EC2
//! refuses StopInstances on a spot instance of a one-time request ("You can't stop the Spot
//! Instance ... because it is associated with a one-time Spot Instance request. You can only
//! stop Spot Instances associated with persistent Spot Instance requests.",
//! `UnsupportedOperation`; EC2 User Guide, "Stop a Spot Instance"), and an instant EC2 Fleet's
//! spot instances are of one-time requests. moto stops them. The interceptor answers such a call
//! with EC2's refusal, so the caller's error path runs as on AWS.
//!
//! [`StoppingInstances`] holds another: EC2 stops an instance in steps (the OS shut down, then
//! the instance released), "stopping" for what its User Guide calls several minutes ("Stop and
//! start Amazon EC2 instances"), and StartInstances on an instance not yet stopped is refused
//! (`IncorrectInstanceState`, "The instance ... is not in a state from which it can be
//! started."). moto stops an instance at once. The interceptor refuses a StartInstances naming
//! an instance stopped less than [`STOPPING_S`] ago (or what [`set_stopping_s`] set) through the
//! process's clients, so a start soon after a stop fails locally as it would on AWS
//! (`control::act` launches instead).
//!
//! [`TerminatedInstances`] holds a third: EC2 refuses StopInstances and StartInstances on an
//! instance shutting down or terminated (`IncorrectInstanceState`, "This instance ... is not in a
//! state from which it can be stopped.", as EC2 answers an instance terminated minutes before;
//! a terminated instance stays listed for about an hour). moto stops or starts it, and it is back.
//! The race is a real one: a worker's agent shuts its instance down at its idle timeout (the
//! launch template's shutdown behaviour is terminate) while the scaler stops it as idle. The
//! interceptor refuses either call naming an instance terminated through the process's clients.

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{BeforeSerializationInterceptorContextRef, Input};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_types::config_bag::ConfigBag;

/// Most instance ids one `TerminateInstances` call takes (EC2 API Reference).
pub const MAX_TERMINATE_IDS: usize = 1000;

/// Most filter values one EC2 `Describe*` call takes, over all its filters (EC2's
/// `FilterLimitExceeded`: "The maximum number of filter values specified on a single call is
/// 200"). A lookup of more instances by id goes in batches of this many.
pub const MAX_FILTER_VALUES: usize = 200;

/// Longest EC2 filter value, characters (EC2's `FilterLimitExceeded`: "The maximum length for a
/// filter value is 255 characters").
pub const MAX_FILTER_VALUE_CHARS: usize = 255;

/// Most tags on one EC2 resource (EC2 User Guide, "Tag restrictions").
pub const MAX_TAGS: usize = 50;

pub use onoff_control::job::MAX_S3_KEY_BYTES;

/// A request AWS would refuse, and why (the interceptor's error: the call fails with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{operation}: AWS would refuse this request: {problem}")]
pub struct LimitExceeded {
    /// The operation, e.g. `TerminateInstances`.
    pub operation: &'static str,
    /// The limit broken.
    pub problem: String,
}

/// The interceptor. Add it to each client's config builder (`.interceptor(AwsLimits)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct AwsLimits;

fn refuse(operation: &'static str, problem: String) -> Result<(), BoxError> {
    Err(Box::new(LimitExceeded { operation, problem }))
}

fn tags_ok(operation: &'static str, tags: &[aws_sdk_ec2::types::Tag]) -> Result<(), BoxError> {
    if tags.len() > MAX_TAGS {
        return refuse(
            operation,
            format!("{} tags on one resource; at most {MAX_TAGS}", tags.len()),
        );
    }
    for t in tags {
        let (k, v) = (t.key().unwrap_or_default(), t.value().unwrap_or_default());
        if k.is_empty() || k.chars().count() > 128 {
            return refuse(operation, format!("tag key {k:?} is not 1-128 characters"));
        }
        if v.chars().count() > 256 {
            return refuse(
                operation,
                format!("tag {k:?} has a value of {} characters; at most 256", v.chars().count()),
            );
        }
    }
    Ok(())
}

fn filters_ok(operation: &'static str, filters: &[aws_sdk_ec2::types::Filter]) -> Result<(), BoxError> {
    let values = filters.iter().map(|f| f.values().len()).sum::<usize>();
    if values > MAX_FILTER_VALUES {
        return refuse(
            operation,
            format!("FilterLimitExceeded: {values} filter values in one call; at most {MAX_FILTER_VALUES}"),
        );
    }
    for v in filters.iter().flat_map(|f| f.values()) {
        let n = v.chars().count();
        if n > MAX_FILTER_VALUE_CHARS {
            return refuse(
                operation,
                format!("FilterLimitExceeded: a filter value of {n} characters; at most {MAX_FILTER_VALUE_CHARS}"),
            );
        }
    }
    Ok(())
}

/// The filters of an EC2 `Describe*` input this project sends, with the operation's name.
fn ec2_filters(input: &Input) -> Option<(&'static str, &[aws_sdk_ec2::types::Filter])> {
    use aws_sdk_ec2::operation as ec2;
    if let Some(i) = input.downcast_ref::<ec2::describe_instances::DescribeInstancesInput>() {
        Some(("DescribeInstances", i.filters()))
    } else if let Some(i) =
        input.downcast_ref::<ec2::describe_spot_instance_requests::DescribeSpotInstanceRequestsInput>()
    {
        Some(("DescribeSpotInstanceRequests", i.filters()))
    } else if let Some(i) = input.downcast_ref::<ec2::describe_subnets::DescribeSubnetsInput>() {
        Some(("DescribeSubnets", i.filters()))
    } else if let Some(i) = input.downcast_ref::<ec2::describe_images::DescribeImagesInput>() {
        Some(("DescribeImages", i.filters()))
    } else if let Some(i) = input.downcast_ref::<ec2::describe_spot_price_history::DescribeSpotPriceHistoryInput>() {
        Some(("DescribeSpotPriceHistory", i.filters()))
    } else {
        None
    }
}

fn key_ok(operation: &'static str, key: Option<&str>) -> Result<(), BoxError> {
    match key {
        Some(k) if k.len() > MAX_S3_KEY_BYTES => refuse(
            operation,
            format!("object key of {} bytes; S3 takes at most {MAX_S3_KEY_BYTES}", k.len()),
        ),
        _ => Ok(()),
    }
}

/// Why DynamoDB would refuse the number `v` (an `N` value as sent), or `None`. A number is a
/// decimal, optionally signed and with an exponent, of at most 38 significant digits (leading
/// and trailing zeros trimmed), 0 or of magnitude 1E-130 to 9.9…9E+125 (Amazon DynamoDB
/// Developer Guide, "Supported data types and naming rules"); the texts are DynamoDB's.
#[must_use]
pub fn dynamodb_number_problem(v: &str) -> Option<String> {
    let bad = || Some(format!("The parameter cannot be converted to a numeric value: {v}"));
    let unsigned = v.strip_prefix(['-', '+']).unwrap_or(v);
    let (mantissa, exp) = match unsigned.find(['e', 'E']) {
        Some(i) => match unsigned[i + 1..].parse::<i64>() {
            Ok(e) => (&unsigned[..i], e),
            Err(_) => return bad(),
        },
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() && frac.is_empty() || !(int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())) {
        return bad();
    }
    let digits: Vec<u8> = int.bytes().chain(frac.bytes()).collect();
    let Some(first) = digits.iter().position(|d| *d != b'0') else {
        return None; // zero
    };
    let last = digits.iter().rposition(|d| *d != b'0').unwrap_or(first);
    if last - first + 1 > 38 {
        return Some("Attempting to store more than 38 significant digits in a Number".into());
    }
    // The power of ten of the first significant digit.
    let e10 = int.len() as i64 - 1 - first as i64 + exp;
    if e10 > 125 {
        Some("Number overflow. Attempting to store a number with magnitude larger than supported range".into())
    } else if e10 < -130 {
        Some("Number underflow. Attempting to store a number with magnitude smaller than supported range".into())
    } else {
        None
    }
}

/// Refuses `operation` at the first number among `values` (nested lists, maps and number sets
/// included) DynamoDB would refuse, naming it and why ([`dynamodb_number_problem`]).
fn dynamodb_numbers_ok<'a>(
    operation: &'static str,
    values: impl IntoIterator<Item = &'a aws_sdk_dynamodb::types::AttributeValue>,
) -> Result<(), BoxError> {
    use aws_sdk_dynamodb::types::AttributeValue as A;
    let mut stack: Vec<&A> = values.into_iter().collect();
    while let Some(v) = stack.pop() {
        let numbers: &[String] = match v {
            A::N(n) => std::slice::from_ref(n),
            A::Ns(ns) => ns,
            A::L(l) => {
                stack.extend(l);
                &[]
            }
            A::M(m) => {
                stack.extend(m.values());
                &[]
            }
            _ => &[],
        };
        for n in numbers {
            if let Some(problem) = dynamodb_number_problem(n) {
                return refuse(operation, format!("ValidationException: {problem} ({n:?})"));
            }
        }
    }
    Ok(())
}

/// The attribute values of a DynamoDB input this project sends (items, keys, expression
/// values), with the operation's name.
fn dynamodb_values(input: &Input) -> Option<(&'static str, Vec<&aws_sdk_dynamodb::types::AttributeValue>)> {
    use aws_sdk_dynamodb::operation as ddb;
    type Values<'a> = Option<&'a std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue>>;
    fn all<'a>(maps: &[Values<'a>]) -> Vec<&'a aws_sdk_dynamodb::types::AttributeValue> {
        maps.iter().copied().flatten().flat_map(|m| m.values()).collect()
    }
    if let Some(i) = input.downcast_ref::<ddb::put_item::PutItemInput>() {
        Some(("PutItem", all(&[i.item(), i.expression_attribute_values()])))
    } else if let Some(i) = input.downcast_ref::<ddb::update_item::UpdateItemInput>() {
        Some(("UpdateItem", all(&[i.key(), i.expression_attribute_values()])))
    } else if let Some(i) = input.downcast_ref::<ddb::delete_item::DeleteItemInput>() {
        Some(("DeleteItem", all(&[i.key(), i.expression_attribute_values()])))
    } else if let Some(i) = input.downcast_ref::<ddb::get_item::GetItemInput>() {
        Some(("GetItem", all(&[i.key()])))
    } else if let Some(i) = input.downcast_ref::<ddb::query::QueryInput>() {
        Some((
            "Query",
            all(&[i.expression_attribute_values(), i.exclusive_start_key()]),
        ))
    } else if let Some(i) = input.downcast_ref::<ddb::scan::ScanInput>() {
        Some(("Scan", all(&[i.expression_attribute_values(), i.exclusive_start_key()])))
    } else if let Some(i) = input.downcast_ref::<ddb::batch_get_item::BatchGetItemInput>() {
        let keys = i
            .request_items()
            .into_iter()
            .flat_map(|m| m.values())
            .flat_map(|k| k.keys())
            .flat_map(|k| k.values())
            .collect();
        Some(("BatchGetItem", keys))
    } else {
        None
    }
}

/// DynamoDB's reserved words (`dynamodb_reserved_words.txt`; Amazon DynamoDB Developer Guide,
/// "Reserved words in DynamoDB"), upper case.
fn dynamodb_reserved_words() -> &'static std::collections::HashSet<&'static str> {
    static WORDS: std::sync::OnceLock<std::collections::HashSet<&'static str>> = std::sync::OnceLock::new();
    WORDS.get_or_init(|| {
        include_str!("dynamodb_reserved_words.txt")
            .lines()
            .filter(|l| !l.starts_with('#'))
            .flat_map(str::split_whitespace)
            .collect()
    })
}

/// The first attribute name in the DynamoDB expression `expr` that is a reserved word, as
/// DynamoDB finds it: a name written out (not an `#alias`, not a `:value`), each element of a
/// document path included, that is not the expression grammar's own (`AND`, `OR`, `NOT`,
/// `BETWEEN`, `IN`; `SET`, `REMOVE`, `ADD`, `DELETE`) or a function called (`size(`, ...).
#[must_use]
pub fn dynamodb_reserved_word_in(expr: &str) -> Option<&str> {
    const GRAMMAR: &[&str] = &["AND", "OR", "NOT", "BETWEEN", "IN", "SET", "REMOVE", "ADD", "DELETE"];
    const FUNCTIONS: &[&str] = &[
        "attribute_exists",
        "attribute_not_exists",
        "attribute_type",
        "begins_with",
        "contains",
        "size",
        "if_not_exists",
        "list_append",
    ];
    let b = expr.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'#' || b[i] == b':' {
            // An alias or a value placeholder: its name is not an attribute's.
            i += 1;
            while i < b.len() && word(b[i]) {
                i += 1;
            }
        } else if b[i].is_ascii_alphabetic() || b[i] == b'_' {
            let start = i;
            while i < b.len() && word(b[i]) {
                i += 1;
            }
            let name = &expr[start..i];
            let called = expr[i..].trim_start().starts_with('(');
            let upper = name.to_ascii_uppercase();
            if GRAMMAR.contains(&upper.as_str()) || (called && FUNCTIONS.contains(&name)) {
                continue;
            }
            if dynamodb_reserved_words().contains(upper.as_str()) {
                return Some(name);
            }
        } else {
            i += 1;
        }
    }
    None
}

/// A DynamoDB input's expressions, each with its parameter's name (`None`: not set).
type Expressions<'a> = Vec<(&'static str, Option<&'a str>)>;

/// The expressions of a DynamoDB input this project sends, each with its parameter's name
/// (`None`: not set).
fn dynamodb_expressions(input: &Input) -> Option<(&'static str, Expressions<'_>)> {
    use aws_sdk_dynamodb::operation as ddb;
    const CONDITION: &str = "ConditionExpression";
    const PROJECTION: &str = "ProjectionExpression";
    const FILTER: &str = "FilterExpression";
    if let Some(i) = input.downcast_ref::<ddb::put_item::PutItemInput>() {
        Some(("PutItem", vec![(CONDITION, i.condition_expression())]))
    } else if let Some(i) = input.downcast_ref::<ddb::update_item::UpdateItemInput>() {
        Some((
            "UpdateItem",
            vec![
                ("UpdateExpression", i.update_expression()),
                (CONDITION, i.condition_expression()),
            ],
        ))
    } else if let Some(i) = input.downcast_ref::<ddb::delete_item::DeleteItemInput>() {
        Some(("DeleteItem", vec![(CONDITION, i.condition_expression())]))
    } else if let Some(i) = input.downcast_ref::<ddb::get_item::GetItemInput>() {
        Some(("GetItem", vec![(PROJECTION, i.projection_expression())]))
    } else if let Some(i) = input.downcast_ref::<ddb::query::QueryInput>() {
        Some((
            "Query",
            vec![
                ("KeyConditionExpression", i.key_condition_expression()),
                (FILTER, i.filter_expression()),
                (PROJECTION, i.projection_expression()),
            ],
        ))
    } else if let Some(i) = input.downcast_ref::<ddb::scan::ScanInput>() {
        Some((
            "Scan",
            vec![(FILTER, i.filter_expression()), (PROJECTION, i.projection_expression())],
        ))
    } else if let Some(i) = input.downcast_ref::<ddb::batch_get_item::BatchGetItemInput>() {
        let projections = i
            .request_items()
            .into_iter()
            .flat_map(|m| m.values())
            .map(|k| (PROJECTION, k.projection_expression()))
            .collect();
        Some(("BatchGetItem", projections))
    } else {
        None
    }
}

/// Refuses a DynamoDB call whose expression names a reserved word outright, as DynamoDB does
/// ("ValidationException: Invalid ConditionExpression: Attribute name is a reserved keyword;
/// reserved keyword: state"). moto checks an UpdateExpression's names only.
fn dynamodb_expressions_ok(
    operation: &'static str,
    expressions: &[(&'static str, Option<&str>)],
) -> Result<(), BoxError> {
    for (parameter, expr) in expressions {
        if let Some(word) = expr.and_then(dynamodb_reserved_word_in) {
            return refuse(
                operation,
                format!(
                    "ValidationException: Invalid {parameter}: Attribute name is a reserved keyword; reserved keyword: \
                     {word}"
                ),
            );
        }
    }
    Ok(())
}

/// Whether `input` (an operation's input, type-erased) is within the limits above.
fn check(input: &Input) -> Result<(), BoxError> {
    use aws_sdk_ec2::operation as ec2;
    use aws_sdk_s3::operation as s3;
    if let Some((operation, filters)) = ec2_filters(input) {
        filters_ok(operation, filters)?;
    } else if let Some((operation, values)) = dynamodb_values(input) {
        dynamodb_numbers_ok(operation, values)?;
        if let Some((operation, expressions)) = dynamodb_expressions(input) {
            dynamodb_expressions_ok(operation, &expressions)?;
        }
    } else if let Some(i) = input.downcast_ref::<ec2::run_instances::RunInstancesInput>() {
        for spec in i.tag_specifications() {
            tags_ok("RunInstances", spec.tags())?;
        }
    } else if let Some(i) = input.downcast_ref::<ec2::terminate_instances::TerminateInstancesInput>() {
        let n = i.instance_ids().len();
        if n > MAX_TERMINATE_IDS {
            return refuse(
                "TerminateInstances",
                format!("{n} instance ids; at most {MAX_TERMINATE_IDS} per call"),
            );
        }
    } else if let Some(i) = input.downcast_ref::<ec2::create_fleet::CreateFleetInput>() {
        for spec in i.tag_specifications() {
            tags_ok("CreateFleet", spec.tags())?;
        }
        // One pool is an instance type in a subnet (or, named by zone, a zone): EC2 refuses a
        // fleet naming one twice.
        let mut pools: Vec<(Option<&str>, Option<&str>, Option<&str>)> = Vec::new();
        for o in i.launch_template_configs().iter().flat_map(|c| c.overrides()) {
            let pool = (
                o.instance_type().map(|t| t.as_str()),
                o.subnet_id(),
                o.availability_zone(),
            );
            if pools.contains(&pool) {
                return refuse(
                    "CreateFleet",
                    format!(
                        "InvalidFleetConfig: The fleet configuration contains duplicate instance pools ({} in {})",
                        pool.0.unwrap_or("?"),
                        pool.1.or(pool.2).unwrap_or("?")
                    ),
                );
            }
            pools.push(pool);
        }
    } else if let Some(i) = input.downcast_ref::<ec2::create_tags::CreateTagsInput>() {
        tags_ok("CreateTags", i.tags())?;
    } else if let Some(i) = input.downcast_ref::<aws_sdk_sts::operation::assume_role::AssumeRoleInput>() {
        if let Some(p) = i.policy() {
            if let Err(e) = onoff_control::boundary::sts_session_policy_check(p) {
                return refuse("AssumeRole", e.to_string());
            }
        }
        let name = i.role_session_name().unwrap_or_default();
        let name_ok =
            (2..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "_+=,.@-".contains(c));
        if !name_ok {
            return refuse(
                "AssumeRole",
                format!("role session name {name:?} is not 2-64 of [\\w+=,.@-]"),
            );
        }
        if let Some(d) = i.duration_seconds() {
            if !(900..=43_200).contains(&d) {
                return refuse("AssumeRole", format!("DurationSeconds {d} is not within 900-43,200"));
            }
        }
    } else if let Some(i) = input.downcast_ref::<s3::put_object::PutObjectInput>() {
        key_ok("PutObject", i.key())?;
    } else if let Some(i) = input.downcast_ref::<s3::create_multipart_upload::CreateMultipartUploadInput>() {
        key_ok("CreateMultipartUpload", i.key())?;
    } else if let Some(i) = input.downcast_ref::<s3::upload_part::UploadPartInput>() {
        key_ok("UploadPart", i.key())?;
    } else if let Some(i) = input.downcast_ref::<s3::get_object::GetObjectInput>() {
        key_ok("GetObject", i.key())?;
    } else if let Some(i) = input.downcast_ref::<s3::head_object::HeadObjectInput>() {
        key_ok("HeadObject", i.key())?;
    }
    Ok(())
}

impl Intercept for AwsLimits {
    fn name(&self) -> &'static str {
        "onoff-aws-limits"
    }

    fn read_before_execution(
        &self,
        context: &BeforeSerializationInterceptorContextRef<'_>,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        check(context.input())
    }
}

/// The spot instances of one-time requests this process saw launched (by CreateFleet, or by
/// RunInstances without a persistent spot request): instance ids are unique per emulator, so one
/// set serves every client of the process.
fn one_time_spot() -> &'static std::sync::Mutex<std::collections::HashSet<String>> {
    static SET: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> = std::sync::OnceLock::new();
    SET.get_or_init(Default::default)
}

/// Refuses StopInstances on a spot instance of a one-time request as EC2 does (module docs).
/// Add it to an EC2 client against an emulator (`.interceptor(OneTimeSpotStops)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct OneTimeSpotStops;

/// What a launch call was, from its request to its answer: spot of one-time requests or not.
#[derive(Debug, Clone)]
struct LaunchKind {
    one_time_spot: bool,
}

impl aws_smithy_types::config_bag::Storable for LaunchKind {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

/// A call to answer with EC2's refusal (it was sent as a dry run, so the emulator did nothing):
/// the error body.
#[derive(Debug, Clone)]
struct Refusal {
    body: String,
}

impl aws_smithy_types::config_bag::Storable for Refusal {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

/// Answer the call with the [`Refusal`] stored for it, if any (HTTP 400, EC2's body), and forget
/// it.
fn answer_refusal(
    context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeDeserializationInterceptorContextMut<'_>,
    cfg: &mut ConfigBag,
) -> Result<(), BoxError> {
    let Some(Refusal { body }) = cfg.load::<Refusal>().cloned() else {
        return Ok(());
    };
    cfg.interceptor_state().unset::<Refusal>();
    crate::faults::answer_instead(context.response_mut(), 400, body)
}

/// EC2's answer to a StopInstances naming `id`, a spot instance of a one-time request.
fn stop_refusal_body(id: &str) -> String {
    crate::faults::ec2_error_body(
        "UnsupportedOperation",
        &format!(
            "You can't stop the Spot Instance '{id}' because it is associated with a one-time Spot Instance \
             request. You can only stop Spot Instances associated with persistent Spot Instance requests."
        ),
    )
}

impl Intercept for OneTimeSpotStops {
    fn name(&self) -> &'static str {
        "onoff-one-time-spot-stops"
    }

    fn modify_before_serialization(
        &self,
        context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeSerializationInterceptorContextMut<
            '_,
        >,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        use aws_sdk_ec2::operation as ec2;
        use aws_sdk_ec2::types::{DefaultTargetCapacityType, MarketType, SpotInstanceType};
        let input = context.input_mut();
        if let Some(i) = input.downcast_ref::<ec2::create_fleet::CreateFleetInput>() {
            let spot = i
                .target_capacity_specification()
                .and_then(|t| t.default_target_capacity_type())
                == Some(&DefaultTargetCapacityType::Spot);
            cfg.interceptor_state().store_put(LaunchKind { one_time_spot: spot });
        } else if let Some(i) = input.downcast_ref::<ec2::run_instances::RunInstancesInput>() {
            let m = i.instance_market_options();
            let spot = m.and_then(|m| m.market_type()) == Some(&MarketType::Spot);
            let persistent = m.and_then(|m| m.spot_options()).and_then(|o| o.spot_instance_type())
                == Some(&SpotInstanceType::Persistent);
            cfg.interceptor_state().store_put(LaunchKind {
                one_time_spot: spot && !persistent,
            });
        } else if let Some(i) = input.downcast_mut::<ec2::stop_instances::StopInstancesInput>() {
            let set = one_time_spot().lock().expect("one-time spot set");
            let refused = i
                .instance_ids
                .iter()
                .flatten()
                .find(|id| set.contains(id.as_str()))
                .cloned();
            drop(set);
            if let Some(id) = refused {
                // Sent as a dry run (moto stops nothing), answered as EC2 refuses it.
                i.dry_run = Some(true);
                cfg.interceptor_state().store_put(Refusal {
                    body: stop_refusal_body(&id),
                });
            }
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeDeserializationInterceptorContextMut<
            '_,
        >,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        answer_refusal(context, cfg)
    }

    fn read_after_deserialization(
        &self,
        context: &aws_smithy_runtime_api::client::interceptors::context::AfterDeserializationInterceptorContextRef<'_>,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        use aws_sdk_ec2::operation as ec2;
        use aws_sdk_ec2::types::InstanceLifecycle;
        let Some(kind) = cfg.load::<LaunchKind>().cloned() else {
            return Ok(());
        };
        let Ok(out) = context.output_or_error() else {
            return Ok(());
        };
        let mut ids: Vec<String> = Vec::new();
        if let Some(o) = out.downcast_ref::<ec2::create_fleet::CreateFleetOutput>() {
            // Every spot instance of an instant fleet is of a one-time request; an instance
            // without a lifecycle is of the fleet's default capacity type.
            for i in o.instances() {
                if i.lifecycle()
                    .map_or(kind.one_time_spot, |l| *l == InstanceLifecycle::Spot)
                {
                    ids.extend(i.instance_ids().iter().cloned());
                }
            }
        } else if let Some(o) = out.downcast_ref::<ec2::run_instances::RunInstancesOutput>() {
            if kind.one_time_spot {
                ids.extend(o.instances().iter().filter_map(|i| i.instance_id().map(str::to_string)));
            }
        }
        if !ids.is_empty() {
            one_time_spot().lock().expect("one-time spot set").extend(ids);
        }
        Ok(())
    }
}

/// Seconds an instance stays "stopping" after a StopInstances, for [`StoppingInstances`]: an
/// assumption at the short end of EC2's "several minutes" (EC2 User Guide, "Stop and start
/// Amazon EC2 instances").
pub const STOPPING_S: u64 = 60;

/// When each instance was last stopped through this process's clients (instance ids are unique
/// per emulator, so one map serves every client of the process).
fn stopped_at() -> &'static std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>> {
    static MAP: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>> =
        std::sync::OnceLock::new();
    MAP.get_or_init(Default::default)
}

/// Record `ids` as stopped at `now` in `map` ([`stopped_at`]'s), first dropping the stops older
/// than `keep`: they refuse no start any more.
fn record_stops(
    map: &mut std::collections::HashMap<String, std::time::Instant>,
    ids: Vec<String>,
    now: std::time::Instant,
    keep: std::time::Duration,
) {
    map.retain(|_, at| now.saturating_duration_since(*at) < keep);
    for id in ids {
        map.insert(id, now);
    }
}

/// The stop's length [`StoppingInstances::default`] holds, milliseconds ([`set_stopping_s`]).
static STOPPING_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(STOPPING_S * 1000);

/// Set how long an instance stays stopping for this process's emulator clients, seconds
/// (default [`STOPPING_S`]): `onoff local`, whose boots and starts last seconds of wall time,
/// scales it down with them (`--stopping-s`).
pub fn set_stopping_s(s: f64) {
    let ms = (s.max(0.0) * 1000.0).round() as u64;
    STOPPING_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

/// Refuses StartInstances on an instance still stopping, as EC2 does (module docs): one stopped
/// through this process's clients less than `window` ago. Add it to an EC2 client against an
/// emulator (`.interceptor(StoppingInstances::default())`).
#[derive(Debug, Clone, Copy, Default)]
pub struct StoppingInstances {
    /// How long an instance stays stopping after its StopInstances; `None`: the process's
    /// setting ([`set_stopping_s`], default [`STOPPING_S`]).
    pub window: Option<std::time::Duration>,
}

/// The instances of a StopInstances on its way, recorded as stopping once it is answered.
#[derive(Debug, Clone)]
struct Stopping(Vec<String>);

impl StoppingInstances {
    /// How long an instance stays stopping: `window`, else the process's setting.
    fn window(&self) -> std::time::Duration {
        self.window
            .unwrap_or_else(|| std::time::Duration::from_millis(STOPPING_MS.load(std::sync::atomic::Ordering::Relaxed)))
    }
}

impl aws_smithy_types::config_bag::Storable for Stopping {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

impl Intercept for StoppingInstances {
    fn name(&self) -> &'static str {
        "onoff-stopping-instances"
    }

    fn modify_before_serialization(
        &self,
        context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeSerializationInterceptorContextMut<
            '_,
        >,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        use aws_sdk_ec2::operation as ec2;
        let input = context.input_mut();
        if let Some(i) = input.downcast_ref::<ec2::stop_instances::StopInstancesInput>() {
            if i.dry_run != Some(true) {
                cfg.interceptor_state().store_put(Stopping(i.instance_ids().to_vec()));
            }
        } else if let Some(i) = input.downcast_mut::<ec2::start_instances::StartInstancesInput>() {
            let window = self.window();
            let map = stopped_at().lock().expect("stopped-at map");
            let stopping = i
                .instance_ids
                .iter()
                .flatten()
                .find(|id| map.get(id.as_str()).is_some_and(|at| at.elapsed() < window))
                .cloned();
            drop(map);
            if let Some(id) = stopping {
                // Sent as a dry run (moto starts nothing), answered as EC2 refuses it.
                i.dry_run = Some(true);
                cfg.interceptor_state().store_put(Refusal {
                    body: crate::faults::ec2_error_body(
                        "IncorrectInstanceState",
                        &format!("The instance '{id}' is not in a state from which it can be started."),
                    ),
                });
            }
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeDeserializationInterceptorContextMut<
            '_,
        >,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        answer_refusal(context, cfg)
    }

    fn read_after_deserialization(
        &self,
        context: &aws_smithy_runtime_api::client::interceptors::context::AfterDeserializationInterceptorContextRef<'_>,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(Stopping(ids)) = cfg.load::<Stopping>().cloned() else {
            return Ok(());
        };
        if context.output_or_error().is_ok() {
            let now = std::time::Instant::now();
            // Stops past every window in use (this client's and the process's) refuse nothing:
            // dropped, so a long `onoff local --serve` keeps only the instances still stopping.
            let keep = self.window().max(StoppingInstances::default().window());
            record_stops(&mut stopped_at().lock().expect("stopped-at map"), ids, now, keep);
        }
        Ok(())
    }
}

/// The instances terminated through this process's clients (instance ids are unique per
/// emulator, so one set serves every client of the process).
fn terminated() -> &'static std::sync::Mutex<std::collections::HashSet<String>> {
    static SET: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> = std::sync::OnceLock::new();
    SET.get_or_init(Default::default)
}

/// Record `ids` as terminated for [`TerminatedInstances`]: for a caller that sees instances end
/// by other means than this process's clients (`onoff local`, whose workers' agents terminate
/// their own instances from their own processes, records each instance its listing no longer
/// shows, within a listing period, 250 ms).
pub fn record_terminated(ids: impl IntoIterator<Item = String>) {
    terminated().lock().expect("terminated set").extend(ids);
}

/// Refuses StopInstances and StartInstances on an instance terminated (or shutting down) as EC2
/// does (module docs): one terminated through this process's clients, or recorded with
/// [`record_terminated`]. moto stops or starts it
/// again, bringing it back. Add it to an EC2 client against an emulator
/// (`.interceptor(TerminatedInstances)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct TerminatedInstances;

/// The instances of a TerminateInstances on its way, recorded as terminated once it is answered.
#[derive(Debug, Clone)]
struct Terminating(Vec<String>);

impl aws_smithy_types::config_bag::Storable for Terminating {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

/// EC2's answer to a StopInstances or StartInstances (`verb`: "stopped", "started") naming
/// instance `id`, which is shutting down or terminated.
fn ended_refusal_body(id: &str, verb: &str) -> String {
    crate::faults::ec2_error_body(
        "IncorrectInstanceState",
        &format!("This instance '{id}' is not in a state from which it can be {verb}."),
    )
}

impl Intercept for TerminatedInstances {
    fn name(&self) -> &'static str {
        "onoff-terminated-instances"
    }

    fn modify_before_serialization(
        &self,
        context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeSerializationInterceptorContextMut<
            '_,
        >,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        use aws_sdk_ec2::operation as ec2;
        let input = context.input_mut();
        let ended = |ids: &Option<Vec<String>>| {
            let set = terminated().lock().expect("terminated set");
            ids.iter().flatten().find(|id| set.contains(id.as_str())).cloned()
        };
        let refusal = if let Some(i) = input.downcast_ref::<ec2::terminate_instances::TerminateInstancesInput>() {
            if i.dry_run != Some(true) {
                cfg.interceptor_state()
                    .store_put(Terminating(i.instance_ids().to_vec()));
            }
            None
        } else if let Some(i) = input.downcast_mut::<ec2::stop_instances::StopInstancesInput>() {
            ended(&i.instance_ids).map(|id| {
                i.dry_run = Some(true);
                ended_refusal_body(&id, "stopped")
            })
        } else if let Some(i) = input.downcast_mut::<ec2::start_instances::StartInstancesInput>() {
            ended(&i.instance_ids).map(|id| {
                i.dry_run = Some(true);
                ended_refusal_body(&id, "started")
            })
        } else {
            None
        };
        if let Some(body) = refusal {
            // Sent as a dry run (moto changes nothing), answered as EC2 refuses it.
            cfg.interceptor_state().store_put(Refusal { body });
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut aws_smithy_runtime_api::client::interceptors::context::BeforeDeserializationInterceptorContextMut<
            '_,
        >,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        answer_refusal(context, cfg)
    }

    fn read_after_deserialization(
        &self,
        context: &aws_smithy_runtime_api::client::interceptors::context::AfterDeserializationInterceptorContextRef<'_>,
        _rc: &aws_smithy_runtime_api::client::runtime_components::RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(Terminating(ids)) = cfg.load::<Terminating>().cloned() else {
            return Ok(());
        };
        if context.output_or_error().is_ok() {
            terminated().lock().expect("terminated set").extend(ids);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(input: Input) -> Option<String> {
        check(&input).err().map(|e| e.to_string())
    }

    #[test]
    fn a_reserved_word_written_out_in_an_expression_is_refused_as_dynamodb_refuses_it() {
        // Names as the adapters write them pass: aliased reserved words, placeholders, the
        // grammar's words in any case, functions called, a path through a map.
        for ok in [
            "SET #s = :run, lease_owner = :o ADD attempts :one",
            "attribute_exists(job_id) AND (#s = :q OR #s = :r)",
            "#s IN (:f0, :f1) and not attribute_exists(hold_until)",
            "SET closed_runs_s = if_not_exists(closed_runs_s, :zero) + :run REMOVE idle_since, stopped_at",
            "attribute_not_exists(outputs) OR outputs.attempt <= :a",
            "size(#l) < :n",
        ] {
            assert_eq!(dynamodb_reserved_word_in(ok), None, "{ok}");
        }
        for (bad, word) in [
            ("state = :run", "state"),
            ("SET lease_owner = :o, project = :p", "project"),
            ("attribute_exists(job_id) AND outputs.size > :n", "size"),
            ("#s = :r AND source = :x", "source"),
            ("job_id, zone", "zone"),
        ] {
            assert_eq!(dynamodb_reserved_word_in(bad), Some(word), "{bad}");
        }
        let update = aws_sdk_dynamodb::operation::update_item::UpdateItemInput::builder()
            .table_name("jobs")
            .update_expression("SET lease_owner = :o")
            .condition_expression("state = :run")
            .build()
            .unwrap();
        let why = refused(Input::erase(update)).expect("refused");
        assert!(
            why.contains(
                "ValidationException: Invalid ConditionExpression: Attribute name is a reserved keyword; \
                 reserved keyword: state"
            ),
            "{why}"
        );
        let get = aws_sdk_dynamodb::operation::get_item::GetItemInput::builder()
            .table_name("jobs")
            .projection_expression("job_id, #s")
            .build()
            .unwrap();
        assert_eq!(refused(Input::erase(get)), None);
    }

    #[test]
    fn stops_past_the_window_are_dropped_when_a_stop_is_recorded() {
        use std::time::{Duration, Instant};
        let now = Instant::now() + Duration::from_secs(120);
        let mut map = std::collections::HashMap::new();
        map.insert("i-old".to_string(), now - Duration::from_secs(61));
        map.insert("i-recent".to_string(), now - Duration::from_secs(59));
        record_stops(&mut map, vec!["i-new".to_string()], now, Duration::from_secs(60));
        let mut kept: Vec<&str> = map.keys().map(String::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, vec!["i-new", "i-recent"]);
        assert_eq!(map["i-new"], now);
    }

    #[test]
    fn terminate_takes_at_most_1000_ids() {
        let ids = |n: usize| {
            aws_sdk_ec2::operation::terminate_instances::TerminateInstancesInput::builder()
                .set_instance_ids(Some((0..n).map(|i| format!("i-{i:017x}")).collect()))
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(ids(1000))), None);
        let why = refused(Input::erase(ids(1001))).unwrap();
        assert!(
            why.contains("TerminateInstances") && why.contains("1001 instance ids"),
            "{why}"
        );
    }

    #[test]
    fn an_ec2_lookup_takes_at_most_200_filter_values_of_at_most_255_characters() {
        use aws_sdk_ec2::types::Filter;
        let by_id = |n: usize| {
            aws_sdk_ec2::operation::describe_instances::DescribeInstancesInput::builder()
                .filters(
                    Filter::builder()
                        .name("instance-id")
                        .set_values(Some((0..n).map(|i| format!("i-{i:017x}")).collect()))
                        .build(),
                )
                .filters(Filter::builder().name("instance-state-name").values("running").build())
                .build()
                .unwrap()
        };
        // Counted over all the call's filters: 199 ids and one state are 200.
        assert_eq!(refused(Input::erase(by_id(199))), None);
        let why = refused(Input::erase(by_id(200))).unwrap();
        assert!(
            why.contains("DescribeInstances") && why.contains("201 filter values"),
            "{why}"
        );
        let spot = |value: String| {
            aws_sdk_ec2::operation::describe_spot_instance_requests::DescribeSpotInstanceRequestsInput::builder()
                .filters(Filter::builder().name("instance-id").values(value).build())
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(spot("i".repeat(255)))), None);
        let why = refused(Input::erase(spot("i".repeat(256)))).unwrap();
        assert!(
            why.contains("DescribeSpotInstanceRequests") && why.contains("256 characters"),
            "{why}"
        );
    }

    #[test]
    fn a_dynamodb_number_is_a_decimal_of_38_digits_within_its_range() {
        for ok in [
            "0",
            "-0.0",
            "1700000000.123456",
            "0.30000000000000004",
            "1E-130",
            "-9.9999999999999999999999999999999999999E+125",
            "12345678901234567890123456789012345678",
            "1000000000000000000000000000000000000000000",
            ".5",
            "5.",
        ] {
            assert_eq!(dynamodb_number_problem(ok), None, "{ok}");
        }
        for (bad, why) in [
            ("NaN", "cannot be converted"),
            ("inf", "cannot be converted"),
            ("-inf", "cannot be converted"),
            ("", "cannot be converted"),
            (".", "cannot be converted"),
            ("1e", "cannot be converted"),
            ("1.2.3", "cannot be converted"),
            ("123456789012345678901234567890123456789", "38 significant digits"),
            ("1E126", "overflow"),
            ("0.1E-130", "underflow"),
        ] {
            let got = dynamodb_number_problem(bad);
            assert!(got.as_deref().is_some_and(|g| g.contains(why)), "{bad}: {got:?}");
        }
        // What the adapters' `n(f64)` sends for a value that is not finite.
        assert!(dynamodb_number_problem(&format!("{}", f64::NAN)).is_some());
        assert!(dynamodb_number_problem(&format!("{}", f64::INFINITY)).is_some());
        assert!(dynamodb_number_problem(&format!("{}", f64::MAX)).is_some());
        // Nested in an update's values, named with its operation.
        use aws_sdk_dynamodb::types::AttributeValue as A;
        let update = |v: A| {
            aws_sdk_dynamodb::operation::update_item::UpdateItemInput::builder()
                .table_name("t")
                .key("job_id", A::S("job-1".into()))
                .expression_attribute_values(":v", v)
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(update(A::N("1.5".into())))), None);
        let nested = A::M([("a".to_string(), A::L(vec![A::Ns(vec!["1".into(), "NaN".into()])]))].into());
        let why = refused(Input::erase(update(nested))).unwrap();
        assert!(why.contains("UpdateItem") && why.contains("\"NaN\""), "{why}");
    }

    #[test]
    fn tags_keys_and_session_policies_are_held_to_aws_limits() {
        use aws_sdk_ec2::types::{Tag, TagSpecification};
        let fleet = |value: &str| {
            aws_sdk_ec2::operation::create_fleet::CreateFleetInput::builder()
                .tag_specifications(
                    TagSpecification::builder()
                        .tags(Tag::builder().key("onoff:lane").value(value).build())
                        .build(),
                )
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(fleet(&"l".repeat(256)))), None);
        // RunInstances (stoppable spot workers) as CreateFleet: at most 50 tags.
        let run = |n: usize| {
            let mut spec = TagSpecification::builder();
            for i in 0..n {
                spec = spec.tags(Tag::builder().key(format!("k{i}")).value("v").build());
            }
            aws_sdk_ec2::operation::run_instances::RunInstancesInput::builder()
                .tag_specifications(spec.build())
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(run(50))), None);
        assert!(refused(Input::erase(run(51)))
            .unwrap()
            .contains("RunInstances: AWS would refuse this request: 51 tags"));
        // The same instance type twice in one subnet: one pool named twice.
        let pools = |subnets: &[&str]| {
            use aws_sdk_ec2::types::{
                FleetLaunchTemplateConfigRequest, FleetLaunchTemplateOverridesRequest, InstanceType,
            };
            let mut c = FleetLaunchTemplateConfigRequest::builder();
            for s in subnets {
                c = c.overrides(
                    FleetLaunchTemplateOverridesRequest::builder()
                        .instance_type(InstanceType::G5Xlarge)
                        .subnet_id(*s)
                        .build(),
                );
            }
            aws_sdk_ec2::operation::create_fleet::CreateFleetInput::builder()
                .launch_template_configs(c.build())
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(pools(&["subnet-a", "subnet-b"]))), None);
        assert!(refused(Input::erase(pools(&["subnet-a", "subnet-a"])))
            .unwrap()
            .contains("duplicate instance pools (g5.xlarge in subnet-a)"));
        assert!(refused(Input::erase(fleet(&"l".repeat(257))))
            .unwrap()
            .contains("at most 256"));

        let put = |key: String| {
            aws_sdk_s3::operation::put_object::PutObjectInput::builder()
                .bucket("b")
                .key(key)
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(put("k".repeat(1024)))), None);
        assert!(refused(Input::erase(put("é".repeat(513))))
            .unwrap()
            .contains("1026 bytes"));

        let assume = |policy: &str, name: &str| {
            aws_sdk_sts::operation::assume_role::AssumeRoleInput::builder()
                .role_arn("arn:aws:iam::123456789012:role/r")
                .role_session_name(name)
                .policy(policy)
                .duration_seconds(3600)
                .build()
                .unwrap()
        };
        assert_eq!(refused(Input::erase(assume("{\"a\":\"\\u2019\"}", "job-1"))), None);
        assert!(refused(Input::erase(assume("{\"a\":\"’\"}", "job-1")))
            .unwrap()
            .contains("U+0020"));
        assert!(refused(Input::erase(assume(&"x".repeat(2049), "job-1")))
            .unwrap()
            .contains("2,048"));
        assert!(refused(Input::erase(assume("{}", "job/1")))
            .unwrap()
            .contains("session name"));
    }
}
