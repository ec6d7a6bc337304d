//! `template.yaml` against the code it deploys:
//!
//! - every function in the template is a workspace package with that bin, built the way
//!   `sam build` builds it (provided.al2023, arm64, rust-cargolambda), and every function package
//!   is in the template;
//! - every environment variable a function reads (string literals `ONOFF_*` / `AWS_*` in the
//!   sources of the function and of the path dependencies it builds with) is set for it, unless
//!   Lambda sets it;
//! - every sample in `events/` matches a trigger of the function `events/README.md` names for it
//!   (EventBridge patterns, schedules, S3 notifications, SQS event sources), and no other;
//! - the policy TOML the parameters assemble parses and validates, with its lanes in
//!   `ONOFF_QUEUE_URLS`;
//! - the workers' user data sets every variable the agent requires (`worker-image/README.md`) with
//!   the same values the functions get;
//! - every metric in namespace `onoff` the dashboard and alarms use is printed by the code;
//! - every function's `Timeout` is covered by the reconcile lease the code takes for it
//!   (`onoff_control::lease`), so the lease never expires while an invocation may still act;
//! - the reconciler's schedule admits no period long enough for a hold on a kept idle worker
//!   (`onoff_control::reconcile::renew_holds`) to lapse between runs;
//! - every SQS event source's queue hides a batch at least six times its function's timeout
//!   (Lambda refuses one under once), the function's role may receive, delete and read the
//!   attributes of its messages, as the event source polls with that role, and the event source
//!   reads the function's `batchItemFailures` (`ReportBatchItemFailures`).
//!
//! The template's intrinsic functions are evaluated for a stack called `onoff` in us-east-1 of
//! account 123456789012 (the samples' values) with the parameters' defaults.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

// ---- the template as JSON, short-form tags expanded ---------------------------------------------

fn yaml_to_json(v: serde_yaml::Value) -> Value {
    use serde_yaml::Value as Y;
    match v {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                json!(i)
            } else if let Some(u) = n.as_u64() {
                json!(u)
            } else {
                json!(n.as_f64().expect("a YAML number"))
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(items) => Value::Array(items.into_iter().map(yaml_to_json).collect()),
        Y::Mapping(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s,
                        other => serde_yaml::to_string(&other).expect("key").trim().to_string(),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(t) => {
            let tag = t.tag.to_string();
            let name = tag.trim_start_matches('!').to_string();
            let inner = yaml_to_json(t.value);
            match name.as_str() {
                "Ref" => json!({ "Ref": inner }),
                "Condition" => json!({ "Condition": inner }),
                "GetAtt" => match inner {
                    Value::String(s) => {
                        let (res, attr) = s.split_once('.').expect("!GetAtt Resource.Attribute");
                        json!({ "Fn::GetAtt": [res, attr] })
                    }
                    other => json!({ "Fn::GetAtt": other }),
                },
                other => json!({ format!("Fn::{other}"): inner }),
            }
        }
    }
}

fn template() -> Value {
    let y: serde_yaml::Value = serde_yaml::from_str(&read("template.yaml")).expect("template.yaml is YAML");
    yaml_to_json(y)
}

// ---- intrinsic functions ------------------------------------------------------------------------

/// Values for the parameters without a default (what `sam deploy --guided` asks for).
const REQUIRED_PARAMETERS: &[(&str, &str)] = &[
    (
        "WorkerImageUri",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/onoff-worker:1",
    ),
    ("WorkerVpcId", "vpc-0123456789abcdef0"),
    ("WorkerSubnets", "subnet-0a,subnet-0b"),
];

struct Stack<'a> {
    template: &'a Value,
    params: BTreeMap<String, String>,
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other}"),
    }
}

impl<'a> Stack<'a> {
    /// The stack with every parameter at its default (or [`REQUIRED_PARAMETERS`]), then `overrides`.
    fn new(template: &'a Value, overrides: &[(&str, &str)]) -> Self {
        let mut params = BTreeMap::new();
        for (name, p) in template["Parameters"].as_object().expect("Parameters") {
            let value = match p.get("Default") {
                Some(d) => scalar_text(d),
                None => REQUIRED_PARAMETERS
                    .iter()
                    .find(|(n, _)| n == name)
                    .unwrap_or_else(|| {
                        panic!("parameter {name} has no default: add a test value to REQUIRED_PARAMETERS")
                    })
                    .1
                    .to_string(),
            };
            params.insert(name.clone(), value);
        }
        for (k, v) in overrides {
            assert!(params.contains_key(*k), "no parameter {k}");
            params.insert(k.to_string(), v.to_string());
        }
        Self { template, params }
    }

    fn reference(&self, name: &str) -> Value {
        match name {
            "AWS::StackName" => json!("onoff"),
            "AWS::Region" => json!("us-east-1"),
            "AWS::AccountId" => json!("123456789012"),
            "AWS::Partition" => json!("aws"),
            "AWS::URLSuffix" => json!("amazonaws.com"),
            "AWS::NoValue" => Value::Null,
            _ => match self.params.get(name) {
                Some(v) => {
                    let ty = self.template["Parameters"][name]["Type"].as_str().unwrap_or_default();
                    if ty == "CommaDelimitedList" || ty.starts_with("List<") {
                        json!(v.split(',').collect::<Vec<_>>())
                    } else {
                        json!(v)
                    }
                }
                None => {
                    assert!(
                        self.template["Resources"].get(name).is_some(),
                        "Ref to {name}: neither a parameter nor a resource"
                    );
                    json!(format!("<{name}>"))
                }
            },
        }
    }

    fn condition(&self, v: &Value) -> bool {
        let obj = v.as_object().expect("a condition is an object");
        let (k, args) = obj.iter().next().expect("a condition function");
        match k.as_str() {
            "Condition" => self.condition(
                self.template["Conditions"]
                    .get(args.as_str().expect("condition name"))
                    .unwrap_or_else(|| panic!("no condition {args}")),
            ),
            "Fn::Equals" => {
                let a = self.eval(&args[0]);
                let b = self.eval(&args[1]);
                scalar_text(&a) == scalar_text(&b)
            }
            "Fn::Not" => !self.condition(&args[0]),
            "Fn::And" => args.as_array().expect("list").iter().all(|c| self.condition(c)),
            "Fn::Or" => args.as_array().expect("list").iter().any(|c| self.condition(c)),
            other => panic!("unsupported condition function {other}"),
        }
    }

    fn named_condition(&self, name: &str) -> bool {
        self.condition(&json!({ "Condition": name }))
    }

    fn sub(&self, text: &str, vars: &Map<String, Value>) -> String {
        let mut out = String::new();
        let mut rest = text;
        while let Some(i) = rest.find("${") {
            out.push_str(&rest[..i]);
            let end = rest[i..].find('}').expect("unclosed ${ in Fn::Sub") + i;
            let name = &rest[i + 2..end];
            if let Some(literal) = name.strip_prefix('!') {
                out.push_str("${");
                out.push_str(literal);
                out.push('}');
            } else if let Some(v) = vars.get(name) {
                out.push_str(&scalar_text(&self.eval(v)));
            } else if let Some((res, attr)) = name.split_once('.').filter(|_| !name.starts_with("AWS::")) {
                out.push_str(&format!("<{res}.{attr}>"));
            } else {
                out.push_str(&scalar_text(&self.reference(name)));
            }
            rest = &rest[end + 1..];
        }
        out.push_str(rest);
        out
    }

    /// Evaluate every intrinsic function in `v`; `AWS::NoValue` drops the key or item.
    fn eval(&self, v: &Value) -> Value {
        match v {
            Value::Array(items) => Value::Array(items.iter().map(|i| self.eval(i)).filter(|i| !i.is_null()).collect()),
            Value::Object(obj) if obj.len() == 1 => {
                let (k, args) = obj.iter().next().expect("one key");
                match k.as_str() {
                    "Ref" => self.reference(args.as_str().expect("Ref name")),
                    "Fn::GetAtt" => json!(format!("<{}.{}>", args[0].as_str().unwrap(), args[1].as_str().unwrap())),
                    "Fn::Sub" => match args {
                        Value::String(s) => json!(self.sub(s, &Map::new())),
                        Value::Array(a) => json!(self.sub(
                            a[0].as_str().expect("Fn::Sub text"),
                            a[1].as_object().expect("Fn::Sub variables")
                        )),
                        other => panic!("bad Fn::Sub {other}"),
                    },
                    "Fn::If" => {
                        let branch = if self.named_condition(args[0].as_str().expect("Fn::If condition")) {
                            &args[1]
                        } else {
                            &args[2]
                        };
                        self.eval(branch)
                    }
                    "Fn::Join" => {
                        let sep = args[0].as_str().expect("Fn::Join separator");
                        let items = self.eval(&args[1]);
                        json!(items
                            .as_array()
                            .expect("Fn::Join list")
                            .iter()
                            .map(scalar_text)
                            .collect::<Vec<_>>()
                            .join(sep))
                    }
                    "Fn::Split" => {
                        let sep = args[0].as_str().expect("Fn::Split separator");
                        json!(scalar_text(&self.eval(&args[1])).split(sep).collect::<Vec<_>>())
                    }
                    "Fn::Select" => {
                        let i: usize = scalar_text(&self.eval(&args[0])).parse().expect("Fn::Select index");
                        self.eval(&args[1])[i].clone()
                    }
                    "Fn::Base64" => self.eval(args),
                    _ if k.starts_with("Fn::") => panic!("unsupported intrinsic function {k}"),
                    _ => self.eval_map(obj),
                }
            }
            Value::Object(obj) => self.eval_map(obj),
            other => other.clone(),
        }
    }

    fn eval_map(&self, obj: &Map<String, Value>) -> Value {
        Value::Object(
            obj.iter()
                .map(|(k, v)| (k.clone(), self.eval(v)))
                .filter(|(_, v)| !v.is_null())
                .collect(),
        )
    }
}

// ---- functions ----------------------------------------------------------------------------------

/// A serverless function: its properties merged over `Globals.Function`, and its metadata.
struct Function {
    logical_id: String,
    props: Value,
    metadata: Value,
}

fn merge(base: &Value, over: &Value) -> Value {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            let mut out = b.clone();
            for (k, v) in o {
                let merged = match b.get(k) {
                    Some(bv) if bv.is_object() && v.is_object() && !is_intrinsic(v) => merge(bv, v),
                    _ => v.clone(),
                };
                out.insert(k.clone(), merged);
            }
            Value::Object(out)
        }
        _ => over.clone(),
    }
}

fn is_intrinsic(v: &Value) -> bool {
    v.as_object()
        .is_some_and(|o| o.len() == 1 && o.keys().all(|k| k == "Ref" || k.starts_with("Fn::")))
}

fn functions(t: &Value) -> Vec<Function> {
    let globals = t["Globals"]["Function"].clone();
    let fns: Vec<Function> = t["Resources"]
        .as_object()
        .expect("Resources")
        .iter()
        .filter(|(_, r)| r["Type"] == "AWS::Serverless::Function")
        .map(|(id, r)| Function {
            logical_id: id.clone(),
            props: merge(&globals, &r["Properties"]),
            metadata: r["Metadata"].clone(),
        })
        .collect();
    assert!(!fns.is_empty(), "template.yaml has no AWS::Serverless::Function");
    fns
}

fn manifest(dir: &Path) -> toml::Table {
    let path = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse().unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn workspace_members() -> BTreeSet<String> {
    manifest(&root())["workspace"]["members"]
        .as_array()
        .expect("workspace.members")
        .iter()
        .map(|m| m.as_str().expect("member path").trim_end_matches('/').to_string())
        .collect()
}

/// Bin target names of the package in `dir`.
fn bins(dir: &Path) -> BTreeSet<String> {
    let m = manifest(dir);
    let mut out: BTreeSet<String> = m
        .get("bin")
        .and_then(|b| b.as_array())
        .map(|bins| {
            bins.iter()
                .map(|b| b["name"].as_str().expect("bin name").to_string())
                .collect()
        })
        .unwrap_or_default();
    let autobins = m["package"].get("autobins").and_then(|v| v.as_bool()).unwrap_or(true);
    if autobins && dir.join("src/main.rs").exists() && out.is_empty() {
        out.insert(m["package"]["name"].as_str().expect("package name").to_string());
    }
    out
}

fn code_uri(f: &Function) -> String {
    f.props["CodeUri"]
        .as_str()
        .unwrap_or_else(|| panic!("{}: CodeUri must be a local directory", f.logical_id))
        .trim_end_matches('/')
        .to_string()
}

#[test]
fn every_function_timeout_is_covered_by_the_reconcile_lease() {
    use onoff_control::lease::{lease_ttl_s, LEASE_MARGIN_S};
    let t = template();
    let stack = Stack::new(&t, &[]);
    for f in functions(&t) {
        // Lambda's default timeout is 3 s.
        let timeout: f64 = match f.props.get("Timeout") {
            Some(v) => scalar_text(&stack.eval(v))
                .parse()
                .unwrap_or_else(|e| panic!("{}: Timeout: {e}", f.logical_id)),
            None => 3.0,
        };
        // At the start of an invocation `timeout` seconds are left: the lease must outlive its
        // deadline by the whole margin (the TTL's cap must not cut into it).
        let ttl = lease_ttl_s(timeout);
        assert!(
            ttl >= timeout + LEASE_MARGIN_S,
            "{}: Timeout {timeout} s but the reconcile lease it would take lasts {ttl} s: lower the \
             Timeout or raise MAX_LEASE_TTL_S in crates/control/src/lease.rs",
            f.logical_id
        );
    }
}

#[test]
fn a_message_is_received_at_least_five_times_before_its_dead_letter_queue() {
    // Lambda's SQS poller counts a receive for every batch a throttled submit function hands
    // back ("Handling errors for an SQS event source in Lambda": a throttled message returns
    // to the queue); AWS recommends a maxReceiveCount of at least 5 for such queues.
    let param = &template()["Parameters"]["MaxReceiveCount"];
    assert!(param["MinValue"].as_f64().is_some_and(|m| m >= 5.0), "{param}");
    assert!(param["Default"].as_f64().is_some_and(|d| d >= 5.0), "{param}");
}

#[test]
fn every_sqs_event_source_may_poll_its_queue_hides_a_batch_six_function_timeouts_and_reads_batch_item_failures() {
    // Lambda refuses an SQS event source whose queue's visibility timeout is below the function's
    // timeout, and advises six times it ("Configuring an Amazon SQS queue to use with Lambda");
    // it polls with the function's execution role, which needs sqs:ReceiveMessage,
    // sqs:DeleteMessage and sqs:GetQueueAttributes on the queue (its DeleteMessageBatch is
    // authorized under sqs:DeleteMessage).
    let t = template();
    let stack = Stack::new(&t, &[]);
    let mut seen = 0;
    for f in functions(&t) {
        let timeout: f64 = f
            .props
            .get("Timeout")
            .map_or(3.0, |v| scalar_text(&stack.eval(v)).parse().expect("Timeout"));
        for (name, e) in f.props["Events"].as_object().into_iter().flatten() {
            if e["Type"] != "SQS" {
                continue;
            }
            seen += 1;
            let queue = e["Properties"]["Queue"]["Fn::GetAtt"][0]
                .as_str()
                .unwrap_or_else(|| panic!("{}.{name}: Queue is not !GetAtt X.Arn", f.logical_id));
            let q = &t["Resources"][queue]["Properties"];
            // SQS's default visibility timeout is 30 s.
            let visibility: f64 = q.get("VisibilityTimeout").map_or(30.0, |v| {
                scalar_text(&stack.eval(v)).parse().expect("VisibilityTimeout")
            });
            assert!(
                visibility >= 6.0 * timeout,
                "{}.{name}: {queue} hides a batch {visibility} s, under six times the function's {timeout} s",
                f.logical_id
            );
            // The function reports the records it failed on (a spec it refused, a write throttled
            // past its retries). Without ReportBatchItemFailures Lambda ignores that answer and
            // deletes the whole batch: a throttled job would be lost, a refused spec would never
            // reach the dead-letter queue ("Handling errors for an SQS event source in Lambda").
            assert!(
                e["Properties"]["FunctionResponseTypes"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|v| v == "ReportBatchItemFailures")),
                "{}.{name}: no ReportBatchItemFailures, so Lambda would delete the records the function failed on",
                f.logical_id
            );
            let role = f.props["Role"]["Fn::GetAtt"][0].as_str().expect("Role: !GetAtt R.Arn");
            let statements = role_statements(&t, &stack, role);
            let arn = scalar_text(&stack.eval(&e["Properties"]["Queue"]));
            for action in ["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"] {
                assert!(
                    allows(&statements, action, &arn),
                    "{role} may not {action} on {queue}, which the event source polls with it"
                );
            }
        }
    }
    assert_eq!(seen, 1, "the submission queue's event source");
}

#[test]
fn the_reconciler_schedule_admits_only_periods_that_keep_idle_holds_renewed() {
    // A decision renews the hold on each idle worker it keeps once less than two thirds of
    // `hold_s` is left (`onoff_control::reconcile::renew_holds`), so a hold lapses between two
    // runs further apart than that: the schedule's pattern must admit no such period.
    let hold_s = onoff_control::reconcile::ReconcileOptions::default().hold_s;
    let param = &template()["Parameters"]["ReconcileSchedule"];
    let pattern = param["AllowedPattern"]
        .as_str()
        .expect("ReconcileSchedule has an AllowedPattern");
    let re = regex::Regex::new(pattern).unwrap();
    assert!(re.is_match(param["Default"].as_str().unwrap()));
    let mut longest = 0;
    for n in 1..=180u32 {
        let rate = if n == 1 {
            "rate(1 minute)".to_string()
        } else {
            format!("rate({n} minutes)")
        };
        if re.is_match(&rate) {
            assert!(
                f64::from(n * 60) <= hold_s * 2.0 / 3.0,
                "{rate} is admitted, but a hold of {hold_s} s lapses between runs that far apart"
            );
            longest = n;
        }
    }
    assert!(
        longest >= 5,
        "the pattern admits schedules up to rate(5 minutes) at least"
    );
    for other in [
        "rate(1 hour)",
        "rate(2 hours)",
        "cron(0/5 * * * ? *)",
        "rate(1 minutes)",
    ] {
        assert!(!re.is_match(other), "{other}");
    }
}

#[test]
fn every_function_is_a_workspace_package_with_its_bin() {
    let t = template();
    let members = workspace_members();
    let mut deployed = BTreeSet::new();
    for f in functions(&t) {
        let id = &f.logical_id;
        assert_eq!(f.props["Runtime"], "provided.al2023", "{id}: Runtime");
        assert_eq!(f.props["Handler"], "bootstrap", "{id}: Handler");
        assert_eq!(f.props["Architectures"], json!(["arm64"]), "{id}: Architectures");
        assert_eq!(
            f.metadata["BuildMethod"], "rust-cargolambda",
            "{id}: Metadata.BuildMethod"
        );
        let uri = code_uri(&f);
        let dir = root().join(&uri);
        assert!(
            dir.join("Cargo.toml").is_file(),
            "{id}: CodeUri {uri} has no Cargo.toml (sam build runs cargo lambda there)"
        );
        assert!(members.contains(&uri), "{id}: {uri} is not a workspace member");
        // sam's rust-cargolambda builder passes BuildProperties.Binary as `--bin` and copies
        // target/lambda/<Binary>/bootstrap; without it, it guesses from the package's bins.
        let binary = f.metadata["BuildProperties"]["Binary"]
            .as_str()
            .unwrap_or_else(|| panic!("{id}: Metadata.BuildProperties.Binary names the bin to build"));
        let found = bins(&dir);
        assert!(
            found.contains(binary),
            "{id}: package {uri} has no bin {binary:?} (bins: {found:?})"
        );
        deployed.insert(uri);
    }
    // And the other way round: every function package (one with a bin under functions/) is deployed.
    for member in members.iter().filter(|m| m.starts_with("functions/")) {
        if !bins(&root().join(member)).is_empty() {
            assert!(
                deployed.contains(member),
                "{member} has a bin but no function in template.yaml"
            );
        }
    }
}

// ---- environment --------------------------------------------------------------------------------

/// Directories of `dir`'s package and of every path dependency it builds with (not dev-dependencies).
fn path_dependency_closure(dir: &Path) -> BTreeSet<PathBuf> {
    let ws = manifest(&root());
    let ws_deps = ws["workspace"]["dependencies"]
        .as_table()
        .expect("workspace.dependencies");
    let mut seen = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let d = d.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        if !seen.insert(d.clone()) {
            continue;
        }
        let m = manifest(&d);
        let Some(deps) = m.get("dependencies").and_then(|v| v.as_table()) else {
            continue;
        };
        for (name, spec) in deps {
            let path = match spec.get("path").and_then(|p| p.as_str()) {
                Some(p) => Some(d.join(p)),
                None if spec.get("workspace").and_then(|w| w.as_bool()) == Some(true) => ws_deps
                    .get(name)
                    .and_then(|w| w.get("path"))
                    .and_then(|p| p.as_str())
                    .map(|p| root().join(p)),
                None => None,
            };
            if let Some(p) = path {
                todo.push(p);
            }
        }
    }
    seen
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// String literals in `text` that satisfy `keep`.
fn string_literals(text: &str, keep: impl Fn(&str) -> bool) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut parts = text.split('"');
    parts.next();
    // Every second piece between quotes; escaped quotes and raw strings do not occur in the
    // literals looked for, and a stray pairing only yields pieces `keep` rejects.
    while let Some(inside) = parts.next() {
        if keep(inside) {
            out.insert(inside.to_string());
        }
        parts.next();
    }
    out
}

fn is_env_name(s: &str) -> bool {
    (s.starts_with("ONOFF_") || s.starts_with("AWS_"))
        && s.len() > 6
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// Environment variables the sources under `dirs` name (string literals in `src/`).
fn env_names_in(dirs: &BTreeSet<PathBuf>) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    for d in dirs {
        let mut files = Vec::new();
        rust_files(&d.join("src"), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).expect("source file");
            for name in string_literals(&text, is_env_name) {
                out.entry(name).or_insert_with(|| f.clone());
            }
        }
    }
    out
}

/// Set by Lambda in every function's environment.
const SET_BY_LAMBDA: &[&str] = &[
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_EXECUTION_ENV",
    "AWS_LAMBDA_FUNCTION_NAME",
    "AWS_LAMBDA_FUNCTION_MEMORY_SIZE",
    "AWS_LAMBDA_FUNCTION_VERSION",
    "AWS_LAMBDA_INITIALIZATION_TYPE",
    "AWS_LAMBDA_LOG_GROUP_NAME",
    "AWS_LAMBDA_LOG_STREAM_NAME",
    "AWS_LAMBDA_RUNTIME_API",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_XRAY_CONTEXT_MISSING",
    "AWS_XRAY_DAEMON_ADDRESS",
];

/// Read only to record calls (`onoff_aws::record`: `onoff local` sets them for its components), or
/// to inject faults against an emulator (`onoff_aws::faults`, read only with an endpoint
/// override); a deployment leaves them unset, records nothing and injects nothing.
const LOCAL_ONLY: &[&str] = &["ONOFF_CALL_LOG", "ONOFF_PRINCIPAL", "ONOFF_LOSE_ANSWERS"];

#[test]
fn every_environment_variable_a_function_reads_is_set() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    for f in functions(&t) {
        let id = &f.logical_id;
        let dirs = path_dependency_closure(&root().join(code_uri(&f)));
        let read = env_names_in(&dirs);
        assert!(
            read.keys().any(|k| k.starts_with("ONOFF_")),
            "{id}: found no ONOFF_ variable in {dirs:?}: the scan is broken"
        );
        let env = stack.eval(&f.props["Environment"]["Variables"]);
        for (name, file) in &read {
            if SET_BY_LAMBDA.contains(&name.as_str()) || LOCAL_ONLY.contains(&name.as_str()) {
                continue;
            }
            if name == "AWS_LAMBDA_LOG_FORMAT" {
                assert!(
                    f.props["LoggingConfig"]["LogFormat"].is_string(),
                    "{id}: {} reads AWS_LAMBDA_LOG_FORMAT: set LoggingConfig.LogFormat",
                    file.display()
                );
                continue;
            }
            let value = env.get(name).map(scalar_text).unwrap_or_default();
            assert!(
                !value.trim().is_empty(),
                "{id}: {} reads {name}, which the template does not set for it",
                file.display()
            );
        }
    }
}

#[test]
fn the_policy_the_parameters_assemble_parses_and_validates() {
    let t = template();
    let f = functions(&t).into_iter().next().expect("a function");
    let render = |overrides: &[(&str, &str)]| {
        let stack = Stack::new(&t, overrides);
        let env = stack.eval(&f.props["Environment"]["Variables"]);
        let toml = scalar_text(&env["ONOFF_POLICY"]);
        let cfg = onoff_policy::PolicyConfig::from_toml_str(&toml)
            .unwrap_or_else(|e| panic!("ONOFF_POLICY with {overrides:?} does not load: {e}\n{toml}"));
        let queues = scalar_text(&env["ONOFF_QUEUE_URLS"]);
        (cfg, queues)
    };
    let (cfg, queues) = render(&[]);
    let lanes_with_queues: BTreeSet<&str> = queues
        .split(',')
        .filter_map(|p| p.split_once('='))
        .map(|(l, _)| l)
        .collect();
    for lane in &cfg.lanes {
        assert!(
            lanes_with_queues.contains(lane.name.as_str()),
            "lane {} has no queue in ONOFF_QUEUE_URLS ({queues})",
            lane.name
        );
    }
    assert_eq!(cfg.limits.max_usd_per_h, None);
    // The workers' agent takes the deadline rule's figures from ONOFF_POLICY, which the user data
    // does not set (worker-image/README.md): the functions' policy must leave them at the
    // defaults the agent then uses, or a spot worker would defer by another rule than the
    // scaler's.
    let d = onoff_policy::PolicyConfig::default();
    assert_eq!(
        (
            cfg.offers.boot_estimate_s,
            cfg.offers.checkpoint_interval_s,
            cfg.limits.deadline_margin_s
        ),
        (
            d.offers.boot_estimate_s,
            d.offers.checkpoint_interval_s,
            d.limits.deadline_margin_s
        )
    );
    assert!(cfg.offers.allowed_instance_types.is_empty());
    assert_eq!(cfg.offers.max_price_usd_per_h, None);
    assert_eq!(cfg.limits.max_workers_total, 64);
    assert!(
        cfg.lanes.iter().all(|l| l.default_runtime_s.is_none()),
        "no lane's run-time prior by default"
    );
    assert!(
        cfg.lanes.iter().all(|l| l.quota_wait_limit_s.is_none()),
        "no lane's quota wait limit by default: a blocked job waits for the quota"
    );

    let (cfg, _) = render(&[
        ("MaxUsdPerHour", "250"),
        ("MaxPriceUsdPerHour", "4.5"),
        ("AllowedInstanceTypes", "g5.xlarge,g6.xlarge"),
        ("KeepAliveMode", "fixed"),
        ("WarmPoolSize", "3"),
        ("Frozen", "true"),
        ("ExpressDefaultRuntimeSeconds", "5"),
        ("StandardDefaultRuntimeSeconds", "90.5"),
        ("ExpressQuotaWaitLimitSeconds", "14400"),
    ]);
    assert_eq!(cfg.limits.max_usd_per_h, Some(250.0));
    assert_eq!(cfg.offers.max_price_usd_per_h, Some(4.5));
    assert_eq!(cfg.offers.allowed_instance_types, ["g5.xlarge", "g6.xlarge"]);
    assert_eq!(cfg.scale_down.mode, onoff_policy::KeepAliveMode::Fixed);
    assert!(cfg.limits.frozen);
    let standard = &cfg.lanes[cfg.lane_index("standard").expect("standard lane")];
    assert_eq!(standard.warm_pool_size_at(9), 3);
    assert_eq!(standard.default_runtime_s, Some(90.5));
    let express = &cfg.lanes[cfg.lane_index("express").expect("express lane")];
    assert_eq!(express.default_runtime_s, Some(5.0));
    assert_eq!(express.quota_wait_limit_s, Some(14_400.0));
    assert_eq!(standard.quota_wait_limit_s, None);
}

// ---- triggers -----------------------------------------------------------------------------------

/// One way a function is invoked.
#[derive(Debug)]
enum Trigger {
    /// An EventBridge pattern (rules and schedules).
    Pattern(Value),
    /// S3 notifications: event names and key prefix / suffix.
    S3 {
        events: Vec<String>,
        prefix: String,
        suffix: String,
    },
    /// An SQS event source: queue name, and whether it reports batch item failures.
    Sqs { queue: String, partial_batch: bool },
}

fn triggers(t: &Value, stack: &Stack) -> BTreeMap<String, Vec<Trigger>> {
    let mut out: BTreeMap<String, Vec<Trigger>> = BTreeMap::new();
    for f in functions(t) {
        let Some(events) = f.props.get("Events").and_then(|e| e.as_object()) else {
            continue;
        };
        for (name, ev) in events {
            let p = stack.eval(&ev["Properties"]);
            let trigger = match ev["Type"].as_str().expect("event Type") {
                "EventBridgeRule" | "CloudWatchEvent" => Trigger::Pattern(p["Pattern"].clone()),
                "Schedule" => {
                    let rule = p["Name"]
                        .as_str()
                        .unwrap_or_else(|| panic!("{}.{name}: name the schedule's rule", f.logical_id));
                    Trigger::Pattern(json!({
                        "source": ["aws.events"],
                        "detail-type": ["Scheduled Event"],
                        "resources": [format!("arn:aws:events:us-east-1:123456789012:rule/{rule}")],
                    }))
                }
                "S3" => {
                    let events = match &p["Events"] {
                        Value::String(s) => vec![s.clone()],
                        Value::Array(a) => a.iter().map(scalar_text).collect(),
                        other => panic!("{}.{name}: Events {other}", f.logical_id),
                    };
                    let rule = |n: &str| {
                        p["Filter"]["S3Key"]["Rules"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .find(|r| r["Name"].as_str().is_some_and(|x| x.eq_ignore_ascii_case(n)))
                            .map(|r| scalar_text(&r["Value"]))
                            .unwrap_or_default()
                    };
                    let bucket = &ev["Properties"]["Bucket"]["Ref"];
                    assert_eq!(
                        t["Resources"][bucket.as_str().unwrap_or_default()]["Type"],
                        "AWS::S3::Bucket",
                        "{}.{name}: Bucket must be a !Ref to a bucket of the template",
                        f.logical_id
                    );
                    Trigger::S3 {
                        events,
                        prefix: rule("prefix"),
                        suffix: rule("suffix"),
                    }
                }
                "SQS" => {
                    let queue_id = ev["Properties"]["Queue"]["Fn::GetAtt"][0]
                        .as_str()
                        .unwrap_or_else(|| panic!("{}.{name}: Queue must be !GetAtt <queue>.Arn", f.logical_id));
                    let queue = stack.eval(&t["Resources"][queue_id]["Properties"]["QueueName"]);
                    Trigger::Sqs {
                        queue: scalar_text(&queue),
                        partial_batch: p["FunctionResponseTypes"]
                            .as_array()
                            .is_some_and(|a| a.iter().any(|x| x == "ReportBatchItemFailures")),
                    }
                }
                other => panic!(
                    "{}.{name}: event type {other} is not covered by this test",
                    f.logical_id
                ),
            };
            out.entry(f.logical_id.clone()).or_default().push(trigger);
        }
    }
    // S3 notifications declared on a bucket of the template, invoking a function.
    for (id, r) in t["Resources"].as_object().expect("Resources") {
        if r["Type"] != "AWS::S3::Bucket" {
            continue;
        }
        let configs = &r["Properties"]["NotificationConfiguration"]["LambdaConfigurations"];
        for c in configs.as_array().into_iter().flatten() {
            let fn_id = c["Function"]["Fn::GetAtt"][0]
                .as_str()
                .unwrap_or_else(|| panic!("{id}: a notification's Function must be !GetAtt <function>.Arn"));
            let p = stack.eval(c);
            let rule = |n: &str| {
                p["Filter"]["S3Key"]["Rules"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|r| r["Name"].as_str().is_some_and(|x| x.eq_ignore_ascii_case(n)))
                    .map(|r| scalar_text(&r["Value"]))
                    .unwrap_or_default()
            };
            out.entry(fn_id.to_string()).or_default().push(Trigger::S3 {
                events: vec![scalar_text(&p["Event"])],
                prefix: rule("prefix"),
                suffix: rule("suffix"),
            });
        }
    }
    // EventBridge rules declared as plain resources, targeting a function.
    for (id, r) in t["Resources"].as_object().expect("Resources") {
        if r["Type"] != "AWS::Events::Rule" {
            continue;
        }
        let p = stack.eval(&r["Properties"]);
        for target in r["Properties"]["Targets"].as_array().into_iter().flatten() {
            let Some(fn_id) = target["Arn"]["Fn::GetAtt"][0].as_str() else {
                continue;
            };
            let pattern = if let Some(pattern) = p.get("EventPattern") {
                pattern.clone()
            } else {
                let name = p["Name"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{id}: name the schedule's rule"));
                json!({
                    "source": ["aws.events"],
                    "detail-type": ["Scheduled Event"],
                    "resources": [format!("arn:aws:events:us-east-1:123456789012:rule/{name}")],
                })
            };
            out.entry(fn_id.to_string())
                .or_default()
                .push(Trigger::Pattern(pattern));
        }
    }
    out
}

/// EventBridge pattern matching (the subset onoff uses: literals, prefix, suffix, anything-but,
/// exists, equals-ignore-case, wildcard; nested objects).
fn pattern_matches(pattern: &Value, event: &Value) -> bool {
    let Some(p) = pattern.as_object() else {
        panic!("a pattern is an object: {pattern}")
    };
    p.iter().all(|(key, want)| {
        let got = event.get(key);
        match want {
            Value::Object(_) => got.is_some_and(|g| g.is_object() && pattern_matches(want, g)),
            Value::Array(options) => {
                let values: Vec<&Value> = match got {
                    None => Vec::new(),
                    Some(Value::Array(a)) => a.iter().collect(),
                    Some(v) => vec![v],
                };
                options.iter().any(|o| leaf_matches(o, &values))
            }
            other => panic!("pattern value for {key} must be an array or an object: {other}"),
        }
    })
}

fn leaf_matches(option: &Value, values: &[&Value]) -> bool {
    let text = |v: &&Value| v.as_str().map(str::to_string);
    match option {
        Value::Object(op) => {
            let (k, arg) = op.iter().next().expect("a matching operator");
            match k.as_str() {
                "exists" => arg.as_bool().expect("exists: bool") != values.is_empty(),
                "prefix" => values
                    .iter()
                    .filter_map(text)
                    .any(|v| v.starts_with(arg.as_str().unwrap())),
                "suffix" => values
                    .iter()
                    .filter_map(text)
                    .any(|v| v.ends_with(arg.as_str().unwrap())),
                "equals-ignore-case" => values
                    .iter()
                    .filter_map(text)
                    .any(|v| v.eq_ignore_ascii_case(arg.as_str().unwrap())),
                "anything-but" => {
                    let excluded: Vec<&Value> = match arg {
                        Value::Array(a) => a.iter().collect(),
                        v => vec![v],
                    };
                    !values.is_empty() && values.iter().all(|v| !excluded.contains(v))
                }
                "wildcard" => {
                    let parts: Vec<&str> = arg.as_str().unwrap().split('*').collect();
                    values.iter().filter_map(text).any(|v| wildcard(&parts, &v))
                }
                other => panic!("matching operator {other} is not covered by this test"),
            }
        }
        Value::String(s) => {
            assert!(
                !(s.starts_with('<') && s.ends_with('>')),
                "pattern value {s} is not known before deployment (a !GetAtt or a resource !Ref): \
                 spell it with !Sub so the samples can be matched"
            );
            values.contains(&option)
        }
        _ => values.contains(&option),
    }
}

fn wildcard(parts: &[&str], v: &str) -> bool {
    let Some((first, rest)) = parts.split_first() else {
        return v.is_empty();
    };
    let Some(mut at) = v.strip_prefix(first) else {
        return false;
    };
    for (i, part) in rest.iter().enumerate() {
        if i == rest.len() - 1 {
            return at.ends_with(part);
        }
        match at.find(part) {
            Some(j) => at = &at[j + part.len()..],
            None => return false,
        }
    }
    at.is_empty()
}

/// S3 keys in notifications are URL-encoded (`+` for space, `%xx`).
fn url_decode(key: &str) -> String {
    let b = key.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(x) => {
                        out.push(x);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            x => out.push(x),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn trigger_matches(trigger: &Trigger, sample: &Value) -> bool {
    let record = &sample["Records"][0];
    match trigger {
        Trigger::Pattern(p) => sample.get("detail-type").is_some() && pattern_matches(p, sample),
        Trigger::S3 { events, prefix, suffix } => {
            if record["eventSource"] != "aws:s3" {
                return false;
            }
            let name = format!("s3:{}", record["eventName"].as_str().unwrap_or_default());
            let key = url_decode(record["s3"]["object"]["key"].as_str().unwrap_or_default());
            events.iter().any(|e| match e.strip_suffix('*') {
                Some(stem) => name.starts_with(stem),
                None => *e == name,
            }) && key.starts_with(prefix.as_str())
                && key.ends_with(suffix.as_str())
        }
        Trigger::Sqs { queue, .. } => {
            record["eventSource"] == "aws:sqs"
                && record["eventSourceARN"]
                    .as_str()
                    .is_some_and(|arn| arn.rsplit(':').next() == Some(queue.as_str()))
        }
    }
}

/// `events/README.md`'s table: sample file -> function (package) name.
fn sample_owners() -> BTreeMap<String, String> {
    read("events/README.md")
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(|c| c.trim()).collect();
            (
                cells[0].trim_matches('`').to_string(),
                cells[cells.len() - 1].to_string(),
            )
        })
        .collect()
}

#[test]
fn every_event_sample_matches_a_trigger_of_its_function() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let triggers = triggers(&t, &stack);
    // Function logical id by package directory name (functions/<name>).
    let by_name: BTreeMap<String, String> = functions(&t)
        .iter()
        .map(|f| {
            let uri = code_uri(f);
            (uri.rsplit('/').next().unwrap().to_string(), f.logical_id.clone())
        })
        .collect();
    let owners = sample_owners();
    let mut samples: Vec<PathBuf> = std::fs::read_dir(root().join("events"))
        .expect("events/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    samples.sort();
    assert!(!samples.is_empty(), "no samples in events/");
    for path in samples {
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        let sample: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap_or_else(|e| panic!("{file}: {e}"));
        let owner = owners
            .get(&file)
            .unwrap_or_else(|| panic!("{file} is not in events/README.md's table"));
        let expected = by_name
            .get(owner)
            .unwrap_or_else(|| panic!("{file}: events/README.md names function {owner}, not in template.yaml"));
        let matched: BTreeSet<&String> = triggers
            .iter()
            .filter(|(_, ts)| ts.iter().any(|t| trigger_matches(t, &sample)))
            .map(|(f, _)| f)
            .collect();
        assert_eq!(
            matched,
            BTreeSet::from([expected]),
            "{file} must trigger {expected} (events/README.md) and nothing else"
        );
        if sample["Records"][0]["eventSource"] == "aws:sqs" {
            let partial = triggers[expected].iter().any(|t| {
                matches!(
                    t,
                    Trigger::Sqs {
                        partial_batch: true,
                        ..
                    }
                ) && trigger_matches(t, &sample)
            });
            assert!(partial, "{file}: the SQS trigger must report batch item failures");
        }
    }
}

// ---- workers ------------------------------------------------------------------------------------

/// Variables `worker-image/README.md`'s settings table marks as required.
fn agent_required_env() -> Vec<String> {
    let readme = read("worker-image/README.md");
    let names: Vec<String> = readme
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(|c| c.trim()).collect();
            (cells.len() >= 2 && cells[1] == "required").then(|| cells[0].trim_matches('`').to_string())
        })
        .collect();
    assert!(
        names.iter().any(|n| n == "ONOFF_QUEUE_URLS"),
        "worker-image/README.md's settings table changed shape: {names:?}"
    );
    names
}

/// The workers' user data (the launch template's, Base64 undone), as `stack` renders it.
fn worker_user_data(t: &Value, stack: &Stack) -> String {
    let lt = t["Resources"]
        .as_object()
        .unwrap()
        .values()
        .find(|r| r["Type"] == "AWS::EC2::LaunchTemplate")
        .expect("a launch template");
    scalar_text(&stack.eval(&lt["Properties"]["LaunchTemplateData"]["UserData"]))
}

#[test]
fn the_workers_user_data_sets_what_the_agent_requires_as_the_functions_have_it() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let user_data = worker_user_data(&t, &stack);
    let set: BTreeMap<&str, &str> = user_data
        .lines()
        .map(str::trim)
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| is_env_name(k))
        .collect();
    let mut want = agent_required_env();
    // The metric dimension and the tag the agent's instance carries, and the image check.
    want.extend(["ONOFF_DEPLOYMENT", "ONOFF_WORKER_IMAGE", "AWS_REGION"].map(String::from));
    for name in &want {
        assert!(
            set.get(name.as_str()).is_some_and(|v| !v.is_empty()),
            "the user data does not set {name}"
        );
    }
    // And nothing the agent does not read: a misspelt name would be ignored on every worker, its
    // default silently in force. Every variable it sets is named in the agent's sources (or its
    // path dependencies') and documented in worker-image/README.md.
    let named = env_names_in(&path_dependency_closure(&root().join("worker-image/agent")));
    let readme = read("worker-image/README.md");
    // The env file's lines (the script's own shell variables are not the agent's).
    let env_file: Vec<&str> = user_data
        .lines()
        .map(str::trim)
        .skip_while(|l| !l.starts_with("cat > /etc/onoff/agent.env <<'ENV'"))
        .skip(1)
        .take_while(|l| *l != "ENV")
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .collect();
    assert!(env_file.len() >= 10, "the env file's lines: {env_file:?}");
    for name in env_file.iter().filter(|n| **n != "AWS_REGION") {
        assert!(
            named.contains_key(*name),
            "the user data sets {name}, which the agent never reads"
        );
        assert!(
            readme.contains(&format!("`{name}`")),
            "the user data sets {name}, which worker-image/README.md does not document"
        );
    }
    let f = functions(&t).into_iter().next().expect("a function");
    let env = stack.eval(&f.props["Environment"]["Variables"]);
    for (name, value) in &set {
        let Some(fv) = env.get(*name) else { continue };
        if *name == "ONOFF_POLICY" {
            // The workers get the figures the agent reads, in one line (an env file has no
            // newlines); those must be the functions' figures.
            let parse = |text: &str| onoff_policy::PolicyConfig::from_toml_str(text).expect("a policy");
            let (agent, functions) = (parse(value), parse(&scalar_text(fv)));
            let read = |c: &onoff_policy::PolicyConfig| {
                (
                    c.scale_down.wait_value_usd_per_h,
                    c.offers.boot_estimate_s,
                    c.offers.checkpoint_interval_s,
                    c.offers.default_runtime_s,
                    c.limits.deadline_margin_s,
                )
            };
            assert_eq!(read(&agent), read(&functions), "ONOFF_POLICY: the agent's figures");
            continue;
        }
        assert_eq!(
            scalar_text(fv),
            *value,
            "{name}: the workers and the functions disagree"
        );
    }
    // The wait value is a parameter: the workers follow it.
    let stack = Stack::new(&t, &[("WaitValueUsdPerHour", "7.5")]);
    let user_data = worker_user_data(&t, &stack);
    let policy = user_data
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("ONOFF_POLICY="))
        .expect("the workers get a policy");
    let policy = onoff_policy::PolicyConfig::from_toml_str(policy).unwrap();
    assert_eq!(policy.scale_down.wait_value_usd_per_h, 7.5);
    assert_eq!(set["ONOFF_WORKER_IMAGE"], REQUIRED_PARAMETERS[0].1);
}

/// The agent's container (and so every job) gets half of the instance's memory as `/dev/shm`, not
/// Docker's 64 MiB: the user data's own shell computes the size and writes it into the agent's
/// unit. Both run here through bash, on this machine's `/proc/meminfo`, the unit written to a
/// temporary file, so a CloudFormation escape or a shell expansion gone wrong (`$SHM_MIBm`, an
/// empty size) fails here rather than on every worker.
#[test]
fn the_workers_container_gets_half_the_instances_memory_as_shared_memory() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let user_data = worker_user_data(&t, &stack);
    let lines: Vec<&str> = user_data.lines().map(str::trim).collect();
    let shm_line = lines
        .iter()
        .position(|l| l.starts_with("SHM_MIB="))
        .expect("the user data sizes /dev/shm");
    let unit_start = lines
        .iter()
        .position(|l| *l == "cat > /etc/systemd/system/onoff-agent.service <<UNIT")
        .expect("the agent's unit, written with expansion");
    assert!(shm_line < unit_start, "the size is known when the unit is written");
    let unit_end = unit_start
        + lines[unit_start..]
            .iter()
            .position(|l| *l == "UNIT")
            .expect("the unit's end");
    let out = std::env::temp_dir().join(format!("onoff-unit-{}", std::process::id()));
    let script = format!(
        "set -euo pipefail\n{}\nREGION=us-east-1 INSTANCE_ID=i-0 ONOFF_IMAGE=img\ncat > {} <<UNIT\n{}\nUNIT\n",
        lines[shm_line],
        out.display(),
        lines[unit_start + 1..unit_end].join("\n")
    );
    let run = std::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let unit = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let exec = unit
        .lines()
        .find(|l| l.starts_with("ExecStart=/usr/bin/docker run"))
        .expect("the agent's docker run");
    let words: Vec<&str> = exec.split_whitespace().collect();
    let size = words
        .windows(2)
        .find(|w| w[0] == "--shm-size")
        .map(|w| w[1])
        .expect("docker run sets --shm-size");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let total_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("MemTotal");
    assert_eq!(
        size,
        format!("{}m", total_kib / 2048),
        "half of this machine's memory, MiB"
    );
    assert!(total_kib / 2048 > 64, "more than Docker's default");
}

// ---- metrics ------------------------------------------------------------------------------------

/// Metrics the template uses that the code does not print yet: asked of the functions' code
/// (`functions/common/src/lib.rs`, `print_metrics`). Remove a name once it is printed.
const PENDING_METRICS: &[&str] = &[];

fn onoff_metrics_used(t: &Value, stack: &Stack) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    fn walk(v: &Value, used: &mut BTreeSet<String>) {
        match v {
            Value::Object(o) => {
                if o.get("Namespace").and_then(|n| n.as_str()) == Some("onoff") {
                    if let Some(m) = o.get("MetricName").and_then(|m| m.as_str()) {
                        used.insert(m.to_string());
                    }
                }
                o.values().for_each(|x| walk(x, used));
            }
            Value::Array(rows) => {
                // A dashboard widget's metrics: rows ["Namespace", "MetricName", dims..., {options}],
                // where "." repeats the previous row's value and ["...", values] its metric.
                let mut namespace = String::new();
                for row in rows.iter().filter_map(|r| r.as_array()) {
                    match row.first().and_then(|x| x.as_str()) {
                        Some("...") | None => continue,
                        Some(".") => {}
                        Some(ns) => namespace = ns.to_string(),
                    }
                    if namespace == "onoff" {
                        if let Some(m) = row.get(1).and_then(|m| m.as_str()).filter(|m| *m != ".") {
                            used.insert(m.to_string());
                        }
                    }
                }
                rows.iter().for_each(|x| walk(x, used));
            }
            Value::String(s) => {
                for piece in s.split("MetricName=\"").skip(1) {
                    used.insert(piece.split('"').next().unwrap().to_string());
                }
            }
            _ => {}
        }
    }
    for r in t["Resources"].as_object().unwrap().values() {
        let props = stack.eval(&r["Properties"]);
        if r["Type"] == "AWS::CloudWatch::Dashboard" {
            let body: Value = serde_json::from_str(props["DashboardBody"].as_str().expect("DashboardBody text"))
                .unwrap_or_else(|e| panic!("the dashboard body is not JSON: {e}"));
            walk(&body, &mut used);
        } else if r["Type"] == "AWS::CloudWatch::Alarm" {
            walk(&props, &mut used);
        }
    }
    used
}

#[test]
fn every_onoff_metric_of_the_dashboard_and_alarms_is_printed_by_the_code() {
    let t = template();
    let stack = Stack::new(&t, &[("MaxUsdPerHour", "100")]);
    let used = onoff_metrics_used(&t, &stack);
    assert!(used.contains("SpendUsdPerHour"), "metric scan broken: {used:?}");
    let mut dirs = BTreeSet::new();
    for f in functions(&t) {
        dirs.extend(path_dependency_closure(&root().join(code_uri(&f))));
    }
    dirs.extend(path_dependency_closure(&root().join("worker-image/agent")));
    let mut printed = BTreeSet::new();
    for d in &dirs {
        let mut files = Vec::new();
        rust_files(&d.join("src"), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            printed.extend(string_literals(&text, |s| {
                s.len() > 2
                    && s.starts_with(|c: char| c.is_ascii_uppercase())
                    && s.chars().all(|c| c.is_ascii_alphanumeric())
            }));
        }
    }
    for m in &used {
        if PENDING_METRICS.contains(&m.as_str()) {
            assert!(
                !printed.contains(m),
                "{m} is printed now: remove it from PENDING_METRICS in tests/tests/template.rs"
            );
        } else {
            assert!(
                printed.contains(m),
                "template.yaml uses metric onoff/{m}, which no code prints"
            );
        }
    }
}

// ---- the job lifecycle's AWS limits -------------------------------------------------------------

/// SQS's longest retention, seconds (14 days; its default is 4 days, which would drop the
/// wake-up message of a job that waits longer for capacity).
const SQS_MAX_RETENTION_S: i64 = 1_209_600;

#[test]
fn every_queue_keeps_messages_fourteen_days() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let mut seen = 0;
    for (name, r) in t["Resources"].as_object().unwrap() {
        if r["Type"] != "AWS::SQS::Queue" {
            continue;
        }
        seen += 1;
        let retention = scalar_text(&stack.eval(&r["Properties"]["MessageRetentionPeriod"]));
        assert_eq!(
            retention.parse::<i64>().ok(),
            Some(SQS_MAX_RETENTION_S),
            "{name}: MessageRetentionPeriod {retention:?}, not 14 days"
        );
    }
    assert!(seen >= 5, "{seen} queues");
}

/// The statements of the inline policies of role `role`, evaluated.
fn role_statements(t: &Value, stack: &Stack, role: &str) -> Vec<Value> {
    let r = &t["Resources"][role];
    assert_eq!(r["Type"], "AWS::IAM::Role", "{role}");
    r["Properties"]["Policies"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            stack
                .eval(&p["PolicyDocument"]["Statement"])
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

/// Whether some Allow statement among `statements` names `action` on `resource` (exact action or
/// `service:*`; exact resource or `*`).
fn allows(statements: &[Value], action: &str, resource: &str) -> bool {
    let list = |v: &Value| -> Vec<String> {
        match v {
            Value::Array(a) => a.iter().map(scalar_text).collect(),
            other => vec![scalar_text(other)],
        }
    };
    statements.iter().any(|s| {
        s["Effect"] == "Allow"
            && list(&s["Action"])
                .iter()
                .any(|a| a == action || a.strip_suffix('*').is_some_and(|p| action.starts_with(p)))
            && list(&s["Resource"]).iter().any(|r| r == resource || r == "*")
    })
}

/// The lane-queue calls of the worker agent (`worker-image/agent/src/agent.rs`), as the IAM
/// actions each needs: found in the source, so a new call the role lacks fails here, not on AWS.
#[test]
fn the_worker_role_allows_every_queue_call_the_agent_makes() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let statements = role_statements(&t, &stack, "WorkerRole");
    // Without whitespace, so a call split over lines by rustfmt is still found.
    let source: String = read("worker-image/agent/src/agent.rs").split_whitespace().collect();
    let calls: &[(&str, &[&str])] = &[
        ("inbox.receive(", &["sqs:ReceiveMessage"]),
        ("inbox.delete(", &["sqs:DeleteMessage"]),
        ("inbox.set_visibility(", &["sqs:ChangeMessageVisibility"]),
        ("inbox.requeue(", &["sqs:SendMessage", "sqs:DeleteMessage"]),
        // onoff_control::ports::wake: a fresh wake-up message, then sent_at on the job row.
        ("wake(", &["sqs:SendMessage"]),
    ];
    let made: Vec<&(&str, &[&str])> = calls.iter().filter(|(call, _)| source.contains(call)).collect();
    assert!(made.len() >= 4, "the agent's queue calls changed shape: {made:?}");
    for lane in ["ExpressQueue", "StandardQueue"] {
        let arn = format!("<{lane}.Arn>");
        for (call, actions) in &made {
            for action in *actions {
                assert!(
                    allows(&statements, action, &arn),
                    "the agent calls {call}...) which needs {action} on {arn}; WorkerRole does not allow it"
                );
            }
        }
    }
}

/// The jobs table's index whose name `crates/aws/src/jobs.rs` gives as `pub const CONST`: its
/// name, the index, and its key schema as (attribute, key type).
fn jobs_index(t: &Value, constant: &str) -> (String, Value, Vec<(String, String)>) {
    let code = read("crates/aws/src/jobs.rs");
    let prefix = format!("pub const {constant}: &str = \"");
    let name = code
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.strip_suffix("\";"))
        .unwrap_or_else(|| panic!("{constant} in crates/aws/src/jobs.rs"))
        .to_string();
    let index = t["Resources"]["JobsTable"]["Properties"]["GlobalSecondaryIndexes"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["IndexName"] == name.as_str()))
        .unwrap_or_else(|| panic!("JobsTable has no index {name:?}"))
        .clone();
    let keys = index["KeySchema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| (scalar_text(&k["AttributeName"]), scalar_text(&k["KeyType"])))
        .collect();
    (name, index, keys)
}

#[test]
fn the_active_jobs_index_is_the_one_the_code_scans_and_the_functions_may_scan_it() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let (name, index, keys) = jobs_index(&t, "ACTIVE_INDEX");
    let table = &t["Resources"]["JobsTable"]["Properties"];
    assert_eq!(
        keys,
        [
            ("active_lane".to_string(), "HASH".to_string()),
            ("job_id".into(), "RANGE".into())
        ]
    );
    assert_eq!(index["Projection"]["ProjectionType"], "ALL");
    assert_eq!(table["TimeToLiveSpecification"]["AttributeName"], "expires_at");
    let policy = &t["Resources"]["StateAccess"]["Properties"]["PolicyDocument"]["Statement"];
    let statements = stack.eval(policy).as_array().cloned().unwrap();
    let index_arn = format!("<JobsTable.Arn>/index/{name}");
    assert!(allows(&statements, "dynamodb:Scan", &index_arn), "{index_arn}");
}

/// An index of the jobs table only a reconcile run reads: the one `crates/aws/src/jobs.rs`
/// queries as `constant`, keyed on `partition` (a string) and `sort` (a number), projecting
/// `projected`, created by `crates/aws/src/provision.rs` for the local stack too, and queryable
/// by the scaler and the reconciler (which hold `LaunchAccess`) only.
fn assert_reconcile_index(constant: &str, partition: &str, sort: &str, projected: &str) {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let (name, index, keys) = jobs_index(&t, constant);
    let table = &t["Resources"]["JobsTable"]["Properties"];
    assert_eq!(
        keys,
        [
            (partition.to_string(), "HASH".to_string()),
            (sort.into(), "RANGE".into())
        ]
    );
    assert_eq!(index["Projection"]["ProjectionType"], "INCLUDE");
    assert_eq!(index["Projection"]["NonKeyAttributes"], json!([projected]));
    // Key attributes typed as the code writes them: the partition key a string, the sort key a
    // number.
    let types: Vec<(String, String)> = table["AttributeDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (scalar_text(&d["AttributeName"]), scalar_text(&d["AttributeType"])))
        .collect();
    assert!(types.contains(&(partition.into(), "S".into())), "{types:?}");
    assert!(types.contains(&(sort.into(), "N".into())), "{types:?}");
    let provision = read("crates/aws/src/provision.rs");
    assert!(
        provision.contains(&format!("crate::jobs::{constant}"))
            && provision.contains(&format!("key(\"{partition}\", KeyType::Hash)"))
            && provision.contains(&format!("attr(\"{partition}\")"))
            && provision.contains(&format!("number(\"{sort}\")"))
            && provision.contains(&format!(".non_key_attributes(\"{projected}\")")),
        "the local stack's jobs table has the index {name}"
    );
    let index_arn = format!("<JobsTable.Arn>/index/{name}");
    let launch = &t["Resources"]["LaunchAccess"]["Properties"]["PolicyDocument"]["Statement"];
    let launch = stack.eval(launch).as_array().cloned().unwrap();
    assert!(allows(&launch, "dynamodb:Query", &index_arn), "{index_arn}");
    let state = &t["Resources"]["StateAccess"]["Properties"]["PolicyDocument"]["Statement"];
    let state = stack.eval(state).as_array().cloned().unwrap();
    assert!(
        !allows(&state, "dynamodb:Query", &index_arn),
        "submit and interruption read no {name} index"
    );
}

/// The arrivals index: every job by lane and creation time, the spec projected.
#[test]
fn the_arrivals_index_is_the_one_the_code_queries_and_reconcile_runs_may_query_it() {
    assert_reconcile_index("ARRIVALS_INDEX", "lane", "created_at", "spec");
}

/// The run_times index: the run times of finished jobs by lane and finishing time. Sparse on its
/// partition key `run_lane`, which only the settle that writes a run time writes (with it), so
/// finishes without a run (a mass cancel) cannot crowd run times out of the newest the
/// reconciler reads. The worker's agent writes both as it settles the job's last attempt, so its
/// role may write them.
#[test]
fn the_run_times_index_is_the_one_the_code_queries_and_workers_write_its_run_times() {
    assert_reconcile_index("RUN_TIMES_INDEX", "run_lane", "finished_at", "run_s");
    let t = template();
    let jobs = read("crates/aws/src/jobs.rs");
    assert!(
        jobs.contains("\"run_s = :rt, run_lane = :rl\""),
        "the settle writes run_s and run_lane together"
    );
    assert!(
        !jobs.contains("\"run_lane\", s(") && !jobs.contains(".item(\"run_lane\""),
        "nothing else writes run_lane"
    );
    let worker = t["Resources"]["WorkerRole"]["Properties"]["Policies"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["PolicyDocument"]["Statement"].as_array().unwrap().clone())
        .find(|st| st["Sid"] == "JobLeases")
        .expect("the worker's JobLeases statement");
    let attributes = &worker["Condition"]["ForAllValues:StringEquals"]["dynamodb:Attributes"];
    for a in ["run_s", "run_lane"] {
        assert!(attributes.as_array().unwrap().contains(&json!(a)), "{a}: {attributes}");
    }
}

/// Launch rights only where launches happen (issue 10): submit and interruption may not launch,
/// terminate or pass a role (they ask the scaler, `lambda:InvokeFunction` on it and nothing
/// else); the scaler and the reconciler may. Fails on a template where every function holds the
/// launch policy.
#[test]
fn only_the_scaler_and_the_reconciler_may_launch_and_the_others_may_ask_the_scaler() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let sub = |text: &str| scalar_text(&stack.eval(&json!({ "Fn::Sub": text })));
    let instances = sub("arn:${AWS::Partition}:ec2:${AWS::Region}:${AWS::AccountId}:instance/*");
    let worker_role = sub("${WorkerRole.Arn}");
    let launch: Vec<(&str, &str)> = vec![
        ("ec2:CreateFleet", &instances),
        ("ec2:RunInstances", &instances),
        ("ec2:TerminateInstances", &instances),
        ("iam:PassRole", &worker_role),
    ];
    let scaler_arn =
        sub("arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-scaler");
    let scaler_arn = scaler_arn.as_str();
    // Inline and attached (the template's managed policies) statements of a role.
    let all_statements = |role: &str| {
        let mut st = role_statements(&t, &stack, role);
        for m in t["Resources"][role]["Properties"]["ManagedPolicyArns"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let name = m["Ref"].as_str().expect("a managed policy of the template").to_string();
            let doc = &t["Resources"][name.as_str()]["Properties"]["PolicyDocument"]["Statement"];
            st.extend(stack.eval(doc).as_array().cloned().unwrap_or_default());
        }
        st
    };
    for role in ["ScalerRole", "ReconcilerRole"] {
        let st = all_statements(role);
        for (action, resource) in &launch {
            assert!(
                allows(&st, action, resource),
                "{role} must allow {action} on {resource}"
            );
        }
    }
    for role in ["SubmitRole", "InterruptionRole"] {
        let st = all_statements(role);
        for (action, resource) in &launch {
            assert!(!allows(&st, action, resource), "{role} must not allow {action}");
            assert!(!allows(&st, action, "*"), "{role} must not allow {action} on *");
        }
        assert!(
            allows(&st, "lambda:InvokeFunction", scaler_arn),
            "{role} asks the scaler"
        );
        let invokes: Vec<&Value> = st
            .iter()
            .filter(|s| {
                let a = &s["Action"];
                a == "lambda:InvokeFunction"
                    || a.as_array()
                        .is_some_and(|v| v.iter().any(|x| x == "lambda:InvokeFunction"))
            })
            .collect();
        assert!(
            invokes.iter().all(|s| s["Resource"] == scaler_arn),
            "{role} invokes only the scaler: {invokes:?}"
        );
    }
}

/// S3 may invoke a function only for a notification of the template's own bucket: every
/// `lambda:InvokeFunction` permission for `s3.amazonaws.com` names the bucket (`SourceArn`) and
/// the account, and every function a bucket notifies has one. (SAM's S3 event source names only
/// the account, so any bucket of the account could invoke the function.)
#[test]
fn s3_may_invoke_a_function_only_for_the_stacks_bucket() {
    let t = template();
    let stack = Stack::new(&t, &[]);
    let res = t["Resources"].as_object().expect("Resources");
    let bucket_arn = "arn:aws:s3:::onoff-123456789012-us-east-1";
    let mut permitted = BTreeSet::new();
    for (id, r) in res {
        if r["Type"] == "AWS::Serverless::Function" {
            for (name, ev) in r["Properties"]["Events"].as_object().into_iter().flatten() {
                assert_ne!(
                    ev["Type"], "S3",
                    "{id}.{name}: a SAM S3 event's permission names no bucket"
                );
            }
        }
        if r["Type"] != "AWS::Lambda::Permission" || r["Properties"]["Principal"] != "s3.amazonaws.com" {
            continue;
        }
        let p = stack.eval(&r["Properties"]);
        assert_eq!(p["SourceArn"], bucket_arn, "{id}: SourceArn must be the stack's bucket");
        assert_eq!(p["SourceAccount"], "123456789012", "{id}: SourceAccount");
        assert_eq!(p["Action"], "lambda:InvokeFunction");
        let f = r["Properties"]["FunctionName"]["Fn::GetAtt"][0]
            .as_str()
            .unwrap_or_else(|| panic!("{id}: FunctionName must be !GetAtt <function>.Arn"));
        permitted.insert(f.to_string());
    }
    let bucket = res
        .iter()
        .find(|(_, r)| r["Type"] == "AWS::S3::Bucket")
        .map(|(_, r)| r)
        .expect("a bucket");
    assert_eq!(
        stack.eval(&bucket["Properties"]["BucketName"]),
        bucket_arn.trim_start_matches("arn:aws:s3:::"),
        "the permission's SourceArn is built from the bucket's name"
    );
    let notified: BTreeSet<String> = bucket["Properties"]["NotificationConfiguration"]["LambdaConfigurations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["Function"]["Fn::GetAtt"][0].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(!notified.is_empty(), "the bucket notifies submit");
    assert_eq!(
        notified, permitted,
        "every notified function has a permission naming the bucket"
    );
}

/// Lambda refuses a function whose environment variables exceed 4 KB in all ("Lambda quotas":
/// 4 KB for all environment variables of a function, in aggregate); CloudFormation then fails the
/// deploy. Neither moto nor the local stack creates the functions, so this is checked here: each
/// function's environment, as JSON, with the parameters that reach it at their longest
/// (`AllowedInstanceTypes` at its `MaxLength`, `WorkerSubnets` at the 16 subnets its description
/// allows), the stack's name at 40 characters, and every name a resource gets (`<Name>` here) at
/// 128 characters.
#[test]
fn every_functions_environment_fits_lambdas_4_kb_with_the_longest_parameters() {
    let t = template();
    let max_types = t["Parameters"]["AllowedInstanceTypes"]["MaxLength"]
        .as_u64()
        .expect("AllowedInstanceTypes has a MaxLength") as usize;
    // Valid for its pattern, as long as allowed: "g5.xlarge,g5.xlarge,...".
    let mut types = String::from("p5.48xlarge");
    while types.len() + ",p5.48xlarge".len() <= max_types {
        types.push_str(",p5.48xlarge");
    }
    let subnets = vec!["subnet-0123456789abcdef0"; 16].join(",");
    let longest = Stack::new(
        &t,
        &[
            ("AllowedInstanceTypes", &types),
            ("WorkerSubnets", &subnets),
            ("MaxUsdPerHour", "123456.789"),
            ("MaxPriceUsdPerHour", "123.456789"),
            ("ExpressDefaultRuntimeSeconds", "86400.123456"),
            ("StandardDefaultRuntimeSeconds", "86400.123456"),
            ("ExpressQuotaWaitLimitSeconds", "86400.123456"),
            ("StandardQuotaWaitLimitSeconds", "86400.123456"),
        ],
    );
    for f in functions(&t) {
        let env = longest.eval(&f.props["Environment"]["Variables"]);
        let text = env.to_string();
        // Each resource name stands as `<Name>`: count it at 128 characters.
        let placeholders = text.matches('<').count();
        let placeholder_chars: usize = text.split('<').skip(1).map(|s| s.find('>').map_or(0, |e| e + 2)).sum();
        // The stack name ("onoff" here) at its longest: the bucket's name (stack, account and
        // region, joined by dashes) must fit S3's 63 characters, which leaves 40 in us-east-1.
        let stack_names = text.matches("onoff").count();
        let size = text.len() - placeholder_chars + 128 * placeholders + (40 - "onoff".len()) * stack_names;
        println!("{}: {} bytes ({} placeholders)", f.logical_id, size, placeholders);
        assert!(
            size <= 4096,
            "{}: its environment may reach {size} bytes, over Lambda's 4 KB",
            f.logical_id
        );
    }
}

/// EC2 refuses a launch whose user data exceeds 16 KB before base64 ("Instance user data":
/// "User data is limited to 16 KB, in raw form, before it is base64-encoded"): every CreateFleet of
/// the worker launch template would fail, and moto does not check it. Measured with the image URI
/// at 512 characters (an ECR URI is a registry host, a repository name of at most 256 and a tag
/// of at most 128) and every resource name (`<Name>` here) at 128.
#[test]
fn the_workers_user_data_fits_ec2s_16_kb() {
    let t = template();
    let image = format!(
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/{}:{}",
        "r".repeat(256),
        "t".repeat(128)
    );
    assert!(image.len() <= 512);
    let stack = Stack::new(&t, &[("WorkerImageUri", &image)]);
    let data = &t["Resources"]["WorkerLaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"];
    let raw = data.get("Fn::Base64").expect("UserData is Fn::Base64 of the script");
    let text = scalar_text(&stack.eval(raw));
    assert!(
        text.starts_with("#!") || text.contains("#cloud-config") || text.contains("MIME"),
        "{text:.200}"
    );
    let placeholders = text.matches('<').count();
    let size = text.len() + 128 * placeholders;
    println!("user data: {} bytes, {placeholders} placeholders", text.len());
    assert!(
        size <= 16 * 1024,
        "the workers' user data may reach {size} bytes, over EC2's 16 KB"
    );
}

/// Job specs under `jobs/` do not pile up: a lifecycle rule deletes them after
/// `JobSpecRetentionDays`, by default as long as the error record that names a refused spec lives
/// (`ERROR_RECORD_TTL_S` in crates/aws/src/jobs.rs), so that record's link stays good.
#[test]
fn job_specs_expire_with_the_error_records_that_name_them() {
    let t = template();
    let rules = t["Resources"]["Bucket"]["Properties"]["LifecycleConfiguration"]["Rules"]
        .as_array()
        .expect("the bucket's lifecycle rules");
    let rule = rules
        .iter()
        .find(|r| r["Prefix"] == "jobs/")
        .expect("a lifecycle rule for jobs/");
    assert_eq!(rule["Status"], "Enabled");
    assert_eq!(rule["ExpirationInDays"]["Ref"], "JobSpecRetentionDays");
    let days = t["Parameters"]["JobSpecRetentionDays"]["Default"].as_f64().unwrap();
    let code = read("crates/aws/src/jobs.rs");
    let ttl = code
        .lines()
        .find_map(|l| l.trim().strip_prefix("pub const ERROR_RECORD_TTL_S: f64 = "))
        .and_then(|rest| rest.strip_suffix(';'))
        .expect("ERROR_RECORD_TTL_S in crates/aws/src/jobs.rs");
    let ttl_days: f64 = ttl
        .split('*')
        .map(|f| f.trim().replace('_', "").parse::<f64>().expect("a product of numbers"))
        .product::<f64>()
        / 86_400.0;
    assert_eq!(days, ttl_days);
}

/// Every parameter is in exactly one group of the console's form (`AWS::CloudFormation::Interface`,
/// which lists no parameter the template lacks) and is referenced by the stack: a parameter in
/// no group is shown unordered at the form's end, and one nothing reads is a knob that changes
/// nothing.
#[test]
fn every_parameter_is_grouped_once_and_read_by_the_stack() {
    let t = template();
    let params: BTreeSet<String> = t["Parameters"]
        .as_object()
        .expect("Parameters")
        .keys()
        .cloned()
        .collect();
    let mut grouped = BTreeMap::<String, usize>::new();
    for g in t["Metadata"]["AWS::CloudFormation::Interface"]["ParameterGroups"]
        .as_array()
        .expect("ParameterGroups")
    {
        for p in g["Parameters"].as_array().expect("a group's Parameters") {
            *grouped
                .entry(p.as_str().expect("a parameter name").to_string())
                .or_default() += 1;
        }
    }
    for p in &params {
        assert_eq!(
            grouped.get(p),
            Some(&1),
            "{p}: in {} groups",
            grouped.get(p).unwrap_or(&0)
        );
    }
    for p in grouped.keys() {
        assert!(params.contains(p), "the group lists {p}, which is no parameter");
    }
    // Referenced by `Ref`, or by name in a `Fn::Sub` string, anywhere but the parameters.
    let mut rest = t.clone();
    for key in ["Parameters", "Metadata"] {
        rest.as_object_mut().unwrap().remove(key);
    }
    let text = rest.to_string();
    for p in &params {
        assert!(
            text.contains(&format!("{{\"Ref\":\"{p}\"}}")) || text.contains(&format!("${{{p}}}")),
            "the parameter {p} is read by nothing in the stack"
        );
    }
}
