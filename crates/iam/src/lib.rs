//! template.yaml's IAM, executable: each component's policies resolved for a concrete stack
//! (CloudFormation intrinsics replaced by the stack's names), what moto server evaluates of them
//! ([`moto_projection`]), IAM's verdict on a request from all of them ([`eval`]) and recorded
//! calls as IAM requests ([`calls`]). No AWS SDK here.
#![warn(missing_docs)]

pub mod calls;
pub mod eval;

use std::collections::BTreeMap;

use serde_json::Value as J;
use serde_yaml::Value as Y;

/// The deployment template, as built into this crate.
pub const TEMPLATE: &str = include_str!("../../../template.yaml");

/// A failure to read or resolve the template.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not YAML.
    #[error("template: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// A `!Ref`, `!GetAtt` or `${...}` the stack does not name.
    #[error("the stack has no value for {0}")]
    Unresolved(String),
    /// A resource or form the template does not have, or one this crate does not resolve.
    #[error("template: {0}")]
    Shape(String),
}

/// The names a deployed stack gives the template's resources.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stack {
    /// `aws`.
    pub partition: String,
    /// e.g. `us-east-1`.
    pub region: String,
    /// 12-digit account id.
    pub account: String,
    /// `AWS::StackName`.
    pub stack_name: String,
    /// Logical id -> the value of `!Ref` (queue URL, table name, bucket name, launch template id,
    /// role name, function name).
    pub refs: BTreeMap<String, String>,
    /// `Logical.Attribute` -> the value of `!GetAtt` (e.g. `JobsTable.Arn`).
    pub atts: BTreeMap<String, String>,
    /// Template parameter values; a parameter missing here takes the template's `Default`.
    pub params: BTreeMap<String, String>,
}

/// A component that runs under a role of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Principal {
    /// The scaler function.
    Scaler,
    /// The reconciler function.
    Reconciler,
    /// The interruption function.
    Interruption,
    /// The submit function.
    Submit,
    /// The worker agent (the instance profile's role).
    Worker,
    /// A job (the agent assumes the job role per job, with a session policy of the job's own).
    Job,
}

impl Principal {
    /// Every principal.
    pub const ALL: [Principal; 6] = [
        Principal::Scaler,
        Principal::Reconciler,
        Principal::Interruption,
        Principal::Submit,
        Principal::Worker,
        Principal::Job,
    ];

    /// `scaler`, `reconciler`, `interruption`, `submit`, `worker`, `job`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Principal::Scaler => "scaler",
            Principal::Reconciler => "reconciler",
            Principal::Interruption => "interruption",
            Principal::Submit => "submit",
            Principal::Worker => "worker",
            Principal::Job => "job",
        }
    }

    /// The logical id of its function in the template; `None` for the worker and a job, which
    /// run in no function.
    #[must_use]
    pub fn function_logical_id(self) -> Option<&'static str> {
        match self {
            Principal::Scaler => Some("ScalerFunction"),
            Principal::Reconciler => Some("ReconcilerFunction"),
            Principal::Interruption => Some("InterruptionFunction"),
            Principal::Submit => Some("SubmitFunction"),
            Principal::Worker | Principal::Job => None,
        }
    }

    /// The logical id of its role in the template.
    #[must_use]
    pub fn role_logical_id(self) -> &'static str {
        match self {
            Principal::Scaler => "ScalerRole",
            Principal::Reconciler => "ReconcilerRole",
            Principal::Interruption => "InterruptionRole",
            Principal::Submit => "SubmitRole",
            Principal::Worker => "WorkerRole",
            Principal::Job => "JobRole",
        }
    }
}

impl std::str::FromStr for Principal {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Principal::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| Error::Shape(format!("no principal {s:?}")))
    }
}

fn resources(t: &Y) -> Result<&serde_yaml::Mapping, Error> {
    t.get("Resources")
        .and_then(Y::as_mapping)
        .ok_or_else(|| Error::Shape("no Resources".into()))
}

/// Whether the template has a role for `p`.
///
/// # Errors
/// The template is not YAML.
pub fn has_role(template: &str, p: Principal) -> Result<bool, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    Ok(resources(&t)?.get(p.role_logical_id()).is_some())
}

struct Resolver<'a> {
    stack: &'a Stack,
    defaults: BTreeMap<String, String>,
    /// Parameters whose `!Ref` is a list (`CommaDelimitedList`, `List<...>`).
    list_params: std::collections::BTreeSet<String>,
    /// The template's `Conditions`.
    conditions: serde_yaml::Mapping,
}

impl Resolver<'_> {
    /// `!Ref name`: a list for list-typed parameters (split at commas; empty text is `[""]`, as
    /// CloudFormation gives it), else text.
    fn reference_value(&self, name: &str) -> Result<J, Error> {
        if name == "AWS::NoValue" {
            return Ok(J::Null);
        }
        let text = self.reference(name)?;
        if self.list_params.contains(name) {
            return Ok(J::Array(
                text.split(',').map(|s| J::String(s.trim().to_string())).collect(),
            ));
        }
        Ok(J::String(text))
    }

    /// The named condition of the template's `Conditions`.
    fn condition(&self, name: &str) -> Result<bool, Error> {
        let c = self
            .conditions
            .get(name)
            .ok_or_else(|| Error::Shape(format!("no condition {name}")))?;
        self.truth(c)
    }

    /// A condition function (`Fn::Equals`, `Fn::Not`, `Fn::And`, `Fn::Or`, `Condition`).
    fn truth(&self, v: &Y) -> Result<bool, Error> {
        let (f, arg) = match v {
            Y::Tagged(t) => (t.tag.to_string().trim_start_matches('!').to_string(), &t.value),
            Y::Mapping(m) if m.len() == 1 => match m.iter().next() {
                Some((Y::String(k), inner)) => (k.trim_start_matches("Fn::").to_string(), inner),
                _ => return Err(Error::Shape(format!("condition {v:?}"))),
            },
            _ => return Err(Error::Shape(format!("condition {v:?}"))),
        };
        let items = || arg.as_sequence().cloned().unwrap_or_default();
        match f.as_str() {
            "Equals" => {
                let xs = items();
                if xs.len() != 2 {
                    return Err(Error::Shape("Fn::Equals takes two values".into()));
                }
                Ok(self.resolve(&xs[0])? == self.resolve(&xs[1])?)
            }
            "Not" => Ok(!self.truth(items().first().ok_or_else(|| Error::Shape("Fn::Not []".into()))?)?),
            "And" => items().iter().try_fold(true, |acc, x| Ok(acc && self.truth(x)?)),
            "Or" => items().iter().try_fold(false, |acc, x| Ok(acc || self.truth(x)?)),
            "Condition" => self.condition(arg.as_str().unwrap_or_default()),
            other => Err(Error::Shape(format!("condition function {other}"))),
        }
    }

    fn reference(&self, name: &str) -> Result<String, Error> {
        let s = self.stack;
        Ok(match name {
            "AWS::Partition" => s.partition.clone(),
            "AWS::Region" => s.region.clone(),
            "AWS::AccountId" => s.account.clone(),
            "AWS::StackName" => s.stack_name.clone(),
            "AWS::URLSuffix" => "amazonaws.com".into(),
            _ => match s
                .refs
                .get(name)
                .or_else(|| s.params.get(name))
                .or_else(|| self.defaults.get(name))
            {
                Some(v) => v.clone(),
                None => return Err(Error::Unresolved(format!("!Ref {name}"))),
            },
        })
    }

    fn att(&self, name: &str) -> Result<String, Error> {
        self.stack
            .atts
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Unresolved(format!("!GetAtt {name}")))
    }

    fn sub(&self, text: &str, vars: &BTreeMap<String, String>) -> Result<String, Error> {
        let mut out = String::new();
        let mut rest = text;
        while let Some(i) = rest.find("${") {
            out.push_str(&rest[..i]);
            let after = &rest[i + 2..];
            let end = after
                .find('}')
                .ok_or_else(|| Error::Shape(format!("unclosed ${{ in {text:?}")))?;
            let name = &after[..end];
            if let Some(lit) = name.strip_prefix('!') {
                // `${!Literal}` is the literal `${Literal}`.
                out.push_str("${");
                out.push_str(lit);
                out.push('}');
            } else if let Some(v) = vars.get(name) {
                out.push_str(v);
            } else if name.contains('.') {
                out.push_str(&self.att(name)?);
            } else {
                out.push_str(&self.reference(name)?);
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    fn resolve(&self, v: &Y) -> Result<J, Error> {
        Ok(match v {
            Y::Null => J::Null,
            Y::Bool(b) => J::Bool(*b),
            Y::Number(n) => serde_json::to_value(n).map_err(|e| Error::Shape(e.to_string()))?,
            Y::String(s) => J::String(s.clone()),
            Y::Sequence(xs) => J::Array(xs.iter().map(|x| self.resolve(x)).collect::<Result<_, _>>()?),
            Y::Mapping(m) => {
                if m.len() == 1 {
                    if let Some((Y::String(k), inner)) = m.iter().next() {
                        if let Some(f) = k.strip_prefix("Fn::").or((k == "Ref").then_some("Ref")) {
                            return self.intrinsic(f, inner);
                        }
                    }
                }
                let mut out = serde_json::Map::new();
                for (k, x) in m {
                    let k = k
                        .as_str()
                        .ok_or_else(|| Error::Shape(format!("a non-string key {k:?}")))?;
                    out.insert(k.to_string(), self.resolve(x)?);
                }
                J::Object(out)
            }
            Y::Tagged(t) => {
                let tag = t.tag.to_string();
                self.intrinsic(tag.trim_start_matches('!'), &t.value)?
            }
        })
    }

    fn string(&self, v: &Y) -> Result<String, Error> {
        match self.resolve(v)? {
            J::String(s) => Ok(s),
            other => Err(Error::Shape(format!("expected a string, got {other}"))),
        }
    }

    fn intrinsic(&self, f: &str, arg: &Y) -> Result<J, Error> {
        Ok(match (f, arg) {
            ("Ref", Y::String(name)) => self.reference_value(name)?,
            ("If", Y::Sequence(xs)) if xs.len() == 3 => {
                let name = xs[0]
                    .as_str()
                    .ok_or_else(|| Error::Shape("Fn::If names a condition".into()))?;
                if self.condition(name)? {
                    self.resolve(&xs[1])?
                } else {
                    self.resolve(&xs[2])?
                }
            }
            ("GetAtt", Y::String(name)) => J::String(self.att(name)?),
            ("GetAtt", Y::Sequence(xs)) if xs.len() == 2 => {
                J::String(self.att(&format!("{}.{}", self.string(&xs[0])?, self.string(&xs[1])?))?)
            }
            ("Sub", Y::String(text)) => J::String(self.sub(text, &BTreeMap::new())?),
            ("Sub", Y::Sequence(xs)) if xs.len() == 2 => {
                let text = self.string(&xs[0])?;
                let mut vars = BTreeMap::new();
                if let Y::Mapping(m) = &xs[1] {
                    for (k, v) in m {
                        vars.insert(k.as_str().unwrap_or_default().to_string(), self.string(v)?);
                    }
                }
                J::String(self.sub(&text, &vars)?)
            }
            ("Join", Y::Sequence(xs)) if xs.len() == 2 => {
                let sep = self.string(&xs[0])?;
                let parts = match self.resolve(&xs[1])? {
                    J::Array(a) => a
                        .into_iter()
                        .map(|p| p.as_str().map(str::to_string).unwrap_or_else(|| p.to_string()))
                        .collect::<Vec<_>>(),
                    other => return Err(Error::Shape(format!("!Join of {other}"))),
                };
                J::String(parts.join(&sep))
            }
            ("Split", Y::Sequence(xs)) if xs.len() == 2 => {
                let sep = self.string(&xs[0])?;
                let s = self.string(&xs[1])?;
                J::Array(s.split(sep.as_str()).map(|p| J::String(p.to_string())).collect())
            }
            ("Select", Y::Sequence(xs)) if xs.len() == 2 => {
                let i = match self.resolve(&xs[0])? {
                    J::Number(n) => n.as_u64().map_or(usize::MAX, |n| n as usize),
                    J::String(s) => s.parse::<usize>().unwrap_or(usize::MAX),
                    other => return Err(Error::Shape(format!("!Select index {other}"))),
                };
                match self.resolve(&xs[1])? {
                    J::Array(a) => a
                        .get(i)
                        .cloned()
                        .ok_or_else(|| Error::Shape(format!("!Select {i} out of range")))?,
                    other => return Err(Error::Shape(format!("!Select of {other}"))),
                }
            }
            (other, _) => return Err(Error::Shape(format!("intrinsic {other} is not resolved here"))),
        })
    }
}

fn resolver<'a>(t: &Y, stack: &'a Stack) -> Resolver<'a> {
    let mut defaults = BTreeMap::new();
    if let Some(params) = t.get("Parameters").and_then(Y::as_mapping) {
        for (k, v) in params {
            if let (Some(k), Some(d)) = (k.as_str(), v.get("Default")) {
                let d = match d {
                    Y::String(s) => s.clone(),
                    Y::Number(n) => n.to_string(),
                    Y::Bool(b) => b.to_string(),
                    _ => continue,
                };
                defaults.insert(k.to_string(), d);
            }
        }
    }
    let list_params = t
        .get("Parameters")
        .and_then(Y::as_mapping)
        .into_iter()
        .flatten()
        .filter(|(_, v)| {
            v.get("Type")
                .and_then(Y::as_str)
                .is_some_and(|ty| ty == "CommaDelimitedList" || ty.starts_with("List<"))
        })
        .filter_map(|(k, _)| k.as_str().map(str::to_string))
        .collect();
    let conditions = t.get("Conditions").and_then(Y::as_mapping).cloned().unwrap_or_default();
    Resolver {
        stack,
        defaults,
        list_params,
        conditions,
    }
}

/// The identity policy documents of `p`'s role: its inline `Policies` and the template's managed
/// policies it attaches (`ManagedPolicyArns: [!Ref X]`), resolved for `stack`.
///
/// # Errors
/// The template has no such role, or a name the stack does not give.
pub fn identity_policies(template: &str, stack: &Stack, p: Principal) -> Result<Vec<J>, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let res = resources(&t)?;
    let r = resolver(&t, stack);
    let role = res
        .get(p.role_logical_id())
        .ok_or_else(|| Error::Shape(format!("no resource {}", p.role_logical_id())))?;
    let props = role
        .get("Properties")
        .ok_or_else(|| Error::Shape(format!("{} has no Properties", p.role_logical_id())))?;
    let mut docs = Vec::new();
    for managed in props
        .get("ManagedPolicyArns")
        .and_then(Y::as_sequence)
        .into_iter()
        .flatten()
    {
        let Some(name) = ref_name(managed) else { continue };
        let doc = res
            .get(name.as_str())
            .and_then(|m| m.get("Properties"))
            .and_then(|p| p.get("PolicyDocument"))
            .ok_or_else(|| Error::Shape(format!("managed policy {name} is not in the template")))?;
        docs.push(r.resolve(doc)?);
    }
    for inline in props.get("Policies").and_then(Y::as_sequence).into_iter().flatten() {
        if let Some(doc) = inline.get("PolicyDocument") {
            docs.push(r.resolve(doc)?);
        }
    }
    // AWS::IAM::Policy resources attached to the role (`Roles: [!Ref <role>]`).
    for (_, res) in res.iter() {
        if res.get("Type").and_then(Y::as_str) != Some("AWS::IAM::Policy") {
            continue;
        }
        let Some(props) = res.get("Properties") else { continue };
        let attached = props
            .get("Roles")
            .and_then(Y::as_sequence)
            .into_iter()
            .flatten()
            .any(|r| ref_name(r).as_deref() == Some(p.role_logical_id()));
        if let (true, Some(doc)) = (attached, props.get("PolicyDocument")) {
            docs.push(r.resolve(doc)?);
        }
    }
    Ok(docs)
}

/// The document of the template's managed policy `logical_id` (e.g. `OperatorAccess`), resolved
/// for `stack`.
///
/// # Errors
/// No such managed policy, or a name the stack does not give.
pub fn managed_policy(template: &str, stack: &Stack, logical_id: &str) -> Result<J, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let doc = resources(&t)?
        .get(logical_id)
        .filter(|r| r.get("Type").and_then(Y::as_str) == Some("AWS::IAM::ManagedPolicy"))
        .and_then(|r| r.get("Properties"))
        .and_then(|p| p.get("PolicyDocument"))
        .ok_or_else(|| Error::Shape(format!("no managed policy {logical_id}")))?;
    resolver(&t, stack).resolve(doc)
}

/// The `Timeout` of `p`'s function, seconds: its own, else `Globals.Function`'s, else Lambda's
/// default of 3 s. Lambda ends an invocation at that deadline, wherever the handler is.
///
/// # Errors
/// `p` has no function (the worker, a job), the template is not YAML, or the timeout is not a
/// plain number (a `!Ref` is not resolved here).
pub fn function_timeout_s(template: &str, p: Principal) -> Result<f64, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let (logical_id, function) = function_resource(&t, p)?;
    match function_property(&t, function, "Timeout") {
        None => Ok(3.0),
        Some(v) => v
            .as_f64()
            .filter(|s| *s > 0.0)
            .ok_or_else(|| Error::Shape(format!("{logical_id}: Timeout {v:?} is not a number of seconds"))),
    }
}

/// How Lambda treats `p`'s asynchronous invocations (EventBridge rules, schedules, S3
/// notifications, an `Invoke` with `InvocationType: Event`): the function's `EventInvokeConfig`,
/// else `Globals.Function`'s, else Lambda's defaults (2 retries, 6 hours; Lambda Developer Guide,
/// "Configuring error handling settings for Lambda asynchronous invocations").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncInvokeConfig {
    /// `MaximumRetryAttempts`: retries after a function error (0 to 2).
    pub maximum_retry_attempts: u32,
    /// `MaximumEventAgeInSeconds`: how long Lambda keeps an event for a retry, seconds (60 to
    /// 21,600); an event older than this is discarded (to the dead-letter queue) untried.
    pub maximum_event_age_s: u32,
}

impl Default for AsyncInvokeConfig {
    fn default() -> Self {
        Self {
            maximum_retry_attempts: 2,
            maximum_event_age_s: 21_600,
        }
    }
}

/// `p`'s function in the template: its logical id and its resource.
fn function_resource(t: &Y, p: Principal) -> Result<(&'static str, &Y), Error> {
    let logical_id = p
        .function_logical_id()
        .ok_or_else(|| Error::Shape(format!("{} runs in no function", p.as_str())))?;
    let function = resources(t)?
        .get(logical_id)
        .filter(|r| r.get("Type").and_then(Y::as_str) == Some("AWS::Serverless::Function"))
        .ok_or_else(|| Error::Shape(format!("no function {logical_id}")))?;
    Ok((logical_id, function))
}

/// Property `key` of `p`'s function: its own, else `Globals.Function`'s.
fn function_property<'a>(t: &'a Y, function: &'a Y, key: &str) -> Option<&'a Y> {
    function.get("Properties").and_then(|p| p.get(key)).or_else(|| {
        t.get("Globals")
            .and_then(|g| g.get("Function"))
            .and_then(|f| f.get(key))
    })
}

/// [`AsyncInvokeConfig`] of `p`'s function in `template`.
///
/// # Errors
/// `p` has no function, the template is not YAML, or a setting is not a plain number in
/// Lambda's range (a `!Ref` is not resolved here).
pub fn function_async_config(template: &str, p: Principal) -> Result<AsyncInvokeConfig, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let (logical_id, function) = function_resource(&t, p)?;
    let mut c = AsyncInvokeConfig::default();
    let Some(conf) = function_property(&t, function, "EventInvokeConfig") else {
        return Ok(c);
    };
    let number = |key: &str, range: std::ops::RangeInclusive<u64>| -> Result<Option<u32>, Error> {
        conf.get(key)
            .map(|v| {
                v.as_u64()
                    .filter(|n| range.contains(n))
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| Error::Shape(format!("{logical_id}: {key} {v:?} is not in {range:?}")))
            })
            .transpose()
    };
    if let Some(n) = number("MaximumRetryAttempts", 0..=2)? {
        c.maximum_retry_attempts = n;
    }
    if let Some(n) = number("MaximumEventAgeInSeconds", 60..=21_600)? {
        c.maximum_event_age_s = n;
    }
    Ok(c)
}

/// The lanes the template gives a queue, in its order: each as (lane, the queue's logical id),
/// from `p`'s `ONOFF_QUEUE_URLS` (its own environment variable, else `Globals.Function`'s), a
/// `!Sub` of `lane=${QueueLogicalId}` pairs joined by commas. A policy lane without one has no
/// queue on AWS (the functions refuse to start) and none the template's policies grant.
///
/// # Errors
/// `p` has no function, the template is not YAML, it sets no `ONOFF_QUEUE_URLS`, or the value is
/// not such a `!Sub`.
pub fn lane_queues(template: &str, p: Principal) -> Result<Vec<(String, String)>, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let (logical_id, function) = function_resource(&t, p)?;
    let var = |env: Option<&Y>| {
        env.and_then(|e| e.get("Variables"))
            .and_then(|v| v.get("ONOFF_QUEUE_URLS"))
            .cloned()
    };
    let value = var(function.get("Properties").and_then(|p| p.get("Environment")))
        .or_else(|| {
            var(t
                .get("Globals")
                .and_then(|g| g.get("Function"))
                .and_then(|f| f.get("Environment")))
        })
        .ok_or_else(|| Error::Shape(format!("{logical_id}: no ONOFF_QUEUE_URLS")))?;
    let text = match &value {
        Y::Tagged(tagged) if tagged.tag == "Sub" => tagged.value.as_str(),
        _ => None,
    }
    .ok_or_else(|| {
        Error::Shape(format!(
            "{logical_id}: ONOFF_QUEUE_URLS {value:?} is not a !Sub of text"
        ))
    })?;
    text.split(',')
        .map(|pair| {
            pair.trim()
                .split_once('=')
                .and_then(|(lane, queue)| {
                    let queue = queue.strip_prefix("${")?.strip_suffix('}')?;
                    let plain =
                        |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
                    (plain(lane) && plain(queue)).then(|| (lane.to_string(), queue.to_string()))
                })
                .ok_or_else(|| {
                    Error::Shape(format!(
                        "{logical_id}: ONOFF_QUEUE_URLS pair {pair:?} is not lane=${{QueueLogicalId}}"
                    ))
                })
        })
        .collect()
}

/// The logical id of the queue `p`'s function sends the events it failed on to (its
/// `DeadLetterQueue`, else `Globals.Function`'s, of `Type: SQS` and `TargetArn: !GetAtt X.Arn`);
/// `None` when it has none (Lambda then discards them).
///
/// # Errors
/// `p` has no function, the template is not YAML, or the dead-letter target is not an SQS
/// queue's `!GetAtt X.Arn`.
pub fn function_dead_letter_queue(template: &str, p: Principal) -> Result<Option<String>, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let (logical_id, function) = function_resource(&t, p)?;
    let Some(dlq) = function_property(&t, function, "DeadLetterQueue") else {
        return Ok(None);
    };
    let bad = || {
        Error::Shape(format!(
            "{logical_id}: DeadLetterQueue {dlq:?} is not an SQS queue's !GetAtt X.Arn"
        ))
    };
    if dlq.get("Type").and_then(Y::as_str) != Some("SQS") {
        return Err(bad());
    }
    dlq.get("TargetArn").and_then(arn_of).map(Some).ok_or_else(bad)
}

/// The logical id X of `v` when it is `!GetAtt X.Arn` (either form); `None` otherwise.
fn arn_of(v: &Y) -> Option<String> {
    let target = match v {
        Y::Tagged(tv) if tv.tag == "!GetAtt" => tv.value.as_str().map(str::to_string),
        Y::Mapping(m) => m.get("Fn::GetAtt").and_then(|v| match v {
            Y::String(s) => Some(s.clone()),
            Y::Sequence(parts) => {
                let parts: Vec<&str> = parts.iter().filter_map(Y::as_str).collect();
                (parts.len() == 2).then(|| parts.join("."))
            }
            _ => None,
        }),
        _ => None,
    };
    target.and_then(|t| t.strip_suffix(".Arn").map(str::to_string))
}

/// An SQS event source mapping of a function (an `Events` entry of `Type: SQS`), as Lambda runs
/// it (Lambda Developer Guide, "Using Lambda with Amazon SQS").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsEventSource {
    /// The logical id of the queue it polls (`Queue: !GetAtt X.Arn`).
    pub queue: String,
    /// `BatchSize`: records per invocation at most (1 to 10,000; default 10).
    pub batch_size: u32,
    /// `FunctionResponseTypes` holds `ReportBatchItemFailures`: the records the function reports
    /// in `batchItemFailures` stay in the queue and the others are deleted. Without it Lambda
    /// ignores the answer: a batch the function returns from is deleted whole, failures
    /// reported or not.
    pub report_batch_item_failures: bool,
}

/// The SQS event source of `p`'s function in `template`, `None` when it has none (no queue
/// invokes it).
///
/// # Errors
/// `p` has no function, the template is not YAML, the function has more than one SQS event, its
/// queue is not `!GetAtt X.Arn`, or `BatchSize` is not a plain number from 1 to 10,000.
pub fn function_sqs_event_source(template: &str, p: Principal) -> Result<Option<SqsEventSource>, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let (logical_id, function) = function_resource(&t, p)?;
    let events = function
        .get("Properties")
        .and_then(|p| p.get("Events"))
        .and_then(Y::as_mapping)
        .into_iter()
        .flatten()
        .filter(|(_, e)| e.get("Type").and_then(Y::as_str) == Some("SQS"));
    let mut found = None;
    for (name, e) in events {
        let name = name.as_str().unwrap_or_default().to_string();
        if found.is_some() {
            return Err(Error::Shape(format!("{logical_id}: more than one SQS event")));
        }
        let props = e.get("Properties");
        let queue = props
            .and_then(|p| p.get("Queue"))
            .and_then(arn_of)
            .ok_or_else(|| Error::Shape(format!("{logical_id}.{name}: Queue is not !GetAtt X.Arn")))?;
        let batch_size = match props.and_then(|p| p.get("BatchSize")) {
            None => 10,
            Some(v) => v
                .as_u64()
                .filter(|n| (1..=10_000).contains(n))
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| Error::Shape(format!("{logical_id}.{name}: BatchSize {v:?} is not in 1..=10000")))?,
        };
        let report_batch_item_failures = props
            .and_then(|p| p.get("FunctionResponseTypes"))
            .and_then(Y::as_sequence)
            .is_some_and(|s| s.iter().any(|v| v.as_str() == Some("ReportBatchItemFailures")));
        found = Some(SqsEventSource {
            queue,
            batch_size,
            report_batch_item_failures,
        });
    }
    Ok(found)
}

/// The logical id a `!Ref X` (or `{Ref: X}`) names.
fn ref_name(v: &Y) -> Option<String> {
    match v {
        Y::Tagged(tv) if tv.tag == "!Ref" => tv.value.as_str().map(str::to_string),
        Y::Mapping(m) => m.get("Ref").and_then(Y::as_str).map(str::to_string),
        _ => None,
    }
}

/// The trust policy (`AssumeRolePolicyDocument`) of `p`'s role, resolved for `stack`.
///
/// # Errors
/// The template has no such role, or a name the stack does not give.
pub fn trust_policy(template: &str, stack: &Stack, p: Principal) -> Result<J, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let res = resources(&t)?;
    let doc = res
        .get(p.role_logical_id())
        .and_then(|r| r.get("Properties"))
        .and_then(|p| p.get("AssumeRolePolicyDocument"))
        .ok_or_else(|| Error::Shape(format!("{} has no AssumeRolePolicyDocument", p.role_logical_id())))?;
    resolver(&t, stack).resolve(doc)
}

/// The resource-based policies of the template (bucket policies, queue policies), resolved for
/// `stack`. Each statement names its resources, so every request may be evaluated against all.
///
/// # Errors
/// A name the stack does not give.
pub fn resource_policies(template: &str, stack: &Stack) -> Result<Vec<J>, Error> {
    let t: Y = serde_yaml::from_str(template)?;
    let r = resolver(&t, stack);
    let mut docs = Vec::new();
    for (_, res) in resources(&t)?.iter() {
        let ty = res.get("Type").and_then(Y::as_str).unwrap_or_default();
        if ty == "AWS::S3::BucketPolicy" || ty == "AWS::SQS::QueuePolicy" {
            if let Some(doc) = res.get("Properties").and_then(|p| p.get("PolicyDocument")) {
                docs.push(r.resolve(doc)?);
            }
        }
    }
    Ok(docs)
}

/// Services whose resource moto checks (S3 object and bucket ARNs, SQS queue ARNs, the role ARN of
/// STS AssumeRole); for every other service moto authorizes against the resource `*`.
pub const MOTO_RESOURCE_SERVICES: [&str; 3] = ["s3", "sqs", "sts"];

/// `doc` as moto server 5.2 evaluates it (moto/iam/access_control.py): the action always; the
/// resource only for [`MOTO_RESOURCE_SERVICES`] (elsewhere moto asks about `*`, which a
/// statement naming an ARN never matches, so such statements get `Resource: "*"` here);
/// conditions never (moto passes no context values, so every condition holds). moto evaluates no
/// resource-based policy and no session policy. What moto leaves out the policy-evaluation tests
/// cover. moto asks about an SQS batch call by its own name (`sqs:DeleteMessageBatch`), which
/// IAM does not have: AWS authorizes `SendMessageBatch`, `DeleteMessageBatch` and
/// `ChangeMessageVisibilityBatch` under `sqs:SendMessage`, `sqs:DeleteMessage` and
/// `sqs:ChangeMessageVisibility` (Amazon SQS Developer Guide, "Amazon SQS batch actions"), so a
/// statement granting one of those grants its batch name here too.
#[must_use]
pub fn moto_projection(doc: &J) -> J {
    /// The SQS actions whose batch calls IAM authorizes under them.
    const SQS_BATCHED: [&str; 3] = ["sqs:SendMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility"];
    let mut out = doc.clone();
    let statements = match out.get_mut("Statement") {
        Some(J::Array(a)) => a.iter_mut().collect::<Vec<_>>(),
        Some(one @ J::Object(_)) => vec![one],
        _ => Vec::new(),
    };
    for st in statements {
        let actions: Vec<String> = match st.get("Action") {
            Some(J::String(a)) => vec![a.clone()],
            Some(J::Array(a)) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
            _ => Vec::new(),
        };
        let batches: Vec<J> = actions
            .iter()
            .filter(|a| SQS_BATCHED.contains(&a.as_str()))
            .map(|a| J::String(format!("{a}Batch")))
            .collect();
        if !batches.is_empty() {
            let mut all: Vec<J> = actions.iter().cloned().map(J::String).collect();
            all.extend(batches);
            st["Action"] = J::Array(all);
        }
        let only_checked = !actions.is_empty()
            && actions
                .iter()
                .all(|a| MOTO_RESOURCE_SERVICES.iter().any(|s| a.starts_with(&format!("{s}:"))));
        if !only_checked {
            st["Resource"] = J::String("*".into());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The principals that run in a function.
    const FUNCTIONS: [Principal; 4] = [
        Principal::Scaler,
        Principal::Reconciler,
        Principal::Interruption,
        Principal::Submit,
    ];

    #[test]
    fn a_function_timeout_is_its_own_else_the_globals_else_lambdas_default() {
        for p in FUNCTIONS {
            assert_eq!(function_timeout_s(TEMPLATE, p).unwrap(), 60.0, "{}", p.as_str());
        }
        assert!(function_timeout_s(TEMPLATE, Principal::Worker).is_err());
        let t = "Globals:\n  Function:\n    Timeout: 30\nResources:\n  ScalerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Timeout: 45\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        assert_eq!(function_timeout_s(t, Principal::Scaler).unwrap(), 45.0);
        assert_eq!(function_timeout_s(t, Principal::Submit).unwrap(), 30.0);
        let bare = "Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        assert_eq!(function_timeout_s(bare, Principal::Submit).unwrap(), 3.0);
        assert!(function_timeout_s(bare, Principal::Scaler).is_err(), "no such function");
        let r = "Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Timeout: !Ref T\n";
        assert!(
            function_timeout_s(r, Principal::Submit).is_err(),
            "a !Ref is not a number"
        );
    }

    #[test]
    fn the_lanes_with_queues_are_the_functions_queue_urls_else_the_globals() {
        let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter().map(|(a, b)| ((*a).to_string(), (*b).to_string())).collect()
        };
        for p in FUNCTIONS {
            assert_eq!(
                lane_queues(TEMPLATE, p).unwrap(),
                pairs(&[("express", "ExpressQueue"), ("standard", "StandardQueue")]),
                "{}",
                p.as_str()
            );
        }
        let t = "Globals:\n  Function:\n    Environment:\n      Variables:\n        ONOFF_QUEUE_URLS: !Sub \"a=${AQueue}\"\nResources:\n  ScalerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Environment:\n        Variables:\n          ONOFF_QUEUE_URLS: !Sub \"gpu-big=${BigQueue}, batch_1=${Q1}\"\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Environment:\n        Variables:\n          OTHER: x\n";
        assert_eq!(
            lane_queues(t, Principal::Scaler).unwrap(),
            pairs(&[("gpu-big", "BigQueue"), ("batch_1", "Q1")])
        );
        assert_eq!(lane_queues(t, Principal::Submit).unwrap(), pairs(&[("a", "AQueue")]));
        let with = |value: &str| {
            format!("Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Environment:\n        Variables:\n          ONOFF_QUEUE_URLS: {value}\n")
        };
        for bad in [
            "\"a=http://q/a\"",
            "!Sub \"a=http://q/a\"",
            "!Sub \"a=${AQueue},b\"",
            "!Sub \"=${AQueue}\"",
            "!Sub \"a=${AQueue.Arn}\"",
            "!Sub [\"a=${Q}\", {Q: !Ref AQueue}]",
        ] {
            let err = lane_queues(&with(bad), Principal::Submit).unwrap_err().to_string();
            assert!(err.contains("SubmitFunction: ONOFF_QUEUE_URLS"), "{bad}: {err}");
        }
        let none = "Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        assert!(lane_queues(none, Principal::Submit)
            .unwrap_err()
            .to_string()
            .contains("no ONOFF_QUEUE_URLS"));
        assert!(lane_queues(TEMPLATE, Principal::Worker).is_err(), "no function");
    }

    #[test]
    fn async_settings_are_the_functions_else_the_globals_else_lambdas_defaults() {
        // The shipped template: each function's own EventInvokeConfig, and the ages Lambda
        // keeps by default where it sets none (submit).
        let got: Vec<(u32, u32)> = FUNCTIONS
            .into_iter()
            .map(|p| {
                let c = function_async_config(TEMPLATE, p).unwrap();
                (c.maximum_retry_attempts, c.maximum_event_age_s)
            })
            .collect();
        assert_eq!(got, [(1, 300), (0, 120), (2, 3600), (2, 21_600)]);
        let t = "Globals:\n  Function:\n    EventInvokeConfig:\n      MaximumRetryAttempts: 1\nResources:\n  ScalerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      EventInvokeConfig:\n        MaximumEventAgeInSeconds: 600\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        let scaler = function_async_config(t, Principal::Scaler).unwrap();
        assert_eq!(
            (scaler.maximum_retry_attempts, scaler.maximum_event_age_s),
            (2, 600),
            "its own block, whole"
        );
        let submit = function_async_config(t, Principal::Submit).unwrap();
        assert_eq!((submit.maximum_retry_attempts, submit.maximum_event_age_s), (1, 21_600));
        let bare = "Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        assert_eq!(
            function_async_config(bare, Principal::Submit).unwrap(),
            AsyncInvokeConfig::default()
        );
        for bad in [
            "MaximumRetryAttempts: 3",
            "MaximumEventAgeInSeconds: 30",
            "MaximumRetryAttempts: !Ref R",
        ] {
            let t = format!("Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      EventInvokeConfig:\n        {bad}\n");
            assert!(function_async_config(&t, Principal::Submit).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_function_sends_what_it_failed_on_to_the_failed_events_queue() {
        for p in FUNCTIONS {
            assert_eq!(
                function_dead_letter_queue(TEMPLATE, p).unwrap().as_deref(),
                Some("FailedEventsQueue"),
                "{}",
                p.as_str()
            );
        }
        let own = "Globals:\n  Function:\n    DeadLetterQueue:\n      Type: SQS\n      TargetArn: !GetAtt A.Arn\nResources:\n  ScalerFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      DeadLetterQueue:\n        Type: SQS\n        TargetArn: {\"Fn::GetAtt\": [B, Arn]}\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        assert_eq!(
            function_dead_letter_queue(own, Principal::Scaler).unwrap().as_deref(),
            Some("B")
        );
        assert_eq!(
            function_dead_letter_queue(own, Principal::Submit).unwrap().as_deref(),
            Some("A")
        );
        let none = "Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n";
        assert_eq!(function_dead_letter_queue(none, Principal::Submit).unwrap(), None);
        let sns = "Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      DeadLetterQueue:\n        Type: SNS\n        TargetArn: !Ref T\n";
        assert!(function_dead_letter_queue(sns, Principal::Submit).is_err());
    }

    #[test]
    fn submits_queue_is_read_as_lambdas_sqs_event_source() {
        assert_eq!(
            function_sqs_event_source(TEMPLATE, Principal::Submit).unwrap(),
            Some(SqsEventSource {
                queue: "SubmissionQueue".into(),
                batch_size: 10,
                report_batch_item_failures: true,
            })
        );
        for p in [Principal::Scaler, Principal::Reconciler, Principal::Interruption] {
            assert_eq!(function_sqs_event_source(TEMPLATE, p).unwrap(), None, "{}", p.as_str());
        }
        let f = |events: &str| {
            format!("Resources:\n  SubmitFunction:\n    Type: AWS::Serverless::Function\n    Properties:\n      Events:\n{events}")
        };
        // Lambda's defaults: 10 records, and the answer ignored.
        let bare = f("        Q:\n          Type: SQS\n          Properties:\n            Queue: {\"Fn::GetAtt\": [Jobs, Arn]}\n");
        assert_eq!(
            function_sqs_event_source(&bare, Principal::Submit).unwrap(),
            Some(SqsEventSource {
                queue: "Jobs".into(),
                batch_size: 10,
                report_batch_item_failures: false,
            })
        );
        let s3 = f("        Put:\n          Type: S3\n          Properties:\n            Bucket: !Ref B\n");
        assert_eq!(function_sqs_event_source(&s3, Principal::Submit).unwrap(), None);
        for bad in [
            "        Q:\n          Type: SQS\n          Properties:\n            Queue: !Ref Jobs\n",
            "        Q:\n          Type: SQS\n          Properties:\n            Queue: !GetAtt Jobs.Arn\n            BatchSize: 0\n",
            "        Q:\n          Type: SQS\n          Properties:\n            Queue: !GetAtt A.Arn\n        R:\n          Type: SQS\n          Properties:\n            Queue: !GetAtt B.Arn\n",
        ] {
            assert!(function_sqs_event_source(&f(bad), Principal::Submit).is_err(), "{bad}");
        }
    }

    fn stack() -> Stack {
        let mut s = Stack {
            partition: "aws".into(),
            region: "us-east-1".into(),
            account: "123456789012".into(),
            stack_name: "st".into(),
            ..Stack::default()
        };
        for (k, v) in [
            ("Bucket", "st-123456789012-us-east-1"),
            ("WorkerLaunchTemplate", "lt-1"),
        ] {
            s.refs.insert(k.into(), v.into());
        }
        for (k, v) in [
            ("WorkerSubnets", "subnet-0a,subnet-0b"),
            ("WorkerVpcId", "vpc-0"),
            (
                "WorkerImageUri",
                "123456789012.dkr.ecr.us-east-1.amazonaws.com/onoff-worker:1",
            ),
        ] {
            s.params.insert(k.into(), v.into());
        }
        s.atts.insert("WorkerSecurityGroup.GroupId".into(), "sg-0".into());
        for (k, v) in [
            ("ExpressQueue.Arn", "arn:aws:sqs:us-east-1:123456789012:st-express"),
            ("StandardQueue.Arn", "arn:aws:sqs:us-east-1:123456789012:st-standard"),
            (
                "SubmissionQueue.Arn",
                "arn:aws:sqs:us-east-1:123456789012:st-submissions",
            ),
            ("FailedEventsQueue.Arn", "arn:aws:sqs:us-east-1:123456789012:st-failed"),
            ("JobsTable.Arn", "arn:aws:dynamodb:us-east-1:123456789012:table/st-jobs"),
            (
                "WorkersTable.Arn",
                "arn:aws:dynamodb:us-east-1:123456789012:table/st-workers",
            ),
            (
                "ControlTable.Arn",
                "arn:aws:dynamodb:us-east-1:123456789012:table/st-control",
            ),
            ("Bucket.Arn", "arn:aws:s3:::st-123456789012-us-east-1"),
            ("WorkerRole.Arn", "arn:aws:iam::123456789012:role/st-worker"),
            ("JobRole.Arn", "arn:aws:iam::123456789012:role/st-job"),
            (
                "ScalerFunction.Arn",
                "arn:aws:lambda:us-east-1:123456789012:function:st-scaler",
            ),
            ("ScalerLogGroup.Arn", "arn:aws:logs:x"),
            ("ReconcilerLogGroup.Arn", "arn:aws:logs:x"),
            ("InterruptionLogGroup.Arn", "arn:aws:logs:x"),
            ("SubmitLogGroup.Arn", "arn:aws:logs:x"),
            ("WorkerLogGroup.Arn", "arn:aws:logs:x"),
        ] {
            s.atts.insert(k.into(), v.into());
        }
        s
    }

    #[test]
    fn every_role_of_the_template_resolves_for_a_stack() {
        for p in Principal::ALL {
            if !has_role(TEMPLATE, p).unwrap() {
                continue;
            }
            let docs = identity_policies(TEMPLATE, &stack(), p).unwrap_or_else(|e| panic!("{}: {e}", p.as_str()));
            assert!(!docs.is_empty(), "{} has policies", p.as_str());
            let text = serde_json::to_string(&docs).unwrap();
            assert!(!text.contains("${AWS::"), "{}: unresolved: {text}", p.as_str());
        }
    }

    #[test]
    fn the_worker_terminates_with_its_own_arn_as_a_literal_policy_variable() {
        let docs = identity_policies(TEMPLATE, &stack(), Principal::Worker).unwrap();
        let text = serde_json::to_string(&docs).unwrap();
        assert!(text.contains("${ec2:SourceInstanceARN}"), "{text}");
        assert!(
            text.contains("arn:aws:s3:::st-123456789012-us-east-1/checkpoints/*"),
            "{text}"
        );
    }

    #[test]
    fn moto_sees_dynamodb_and_ec2_statements_on_any_resource_and_keeps_s3_and_sqs_arns() {
        let doc = serde_json::json!({"Statement": [
            {"Effect": "Allow", "Action": "dynamodb:GetItem", "Resource": "arn:aws:dynamodb:r:a:table/t"},
            {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "arn:aws:s3:::b/k/*"},
            {"Effect": "Allow", "Action": ["sqs:SendMessage", "ec2:RunInstances"], "Resource": "arn:aws:sqs:r:a:q"},
        ]});
        let p = moto_projection(&doc);
        assert_eq!(p["Statement"][0]["Resource"], "*");
        assert_eq!(p["Statement"][1]["Resource"], "arn:aws:s3:::b/k/*");
        assert_eq!(
            p["Statement"][2]["Resource"], "*",
            "a mixed statement must not lose its EC2 action"
        );
    }

    #[test]
    fn moto_is_granted_the_sqs_batch_names_iam_authorizes_under_their_single_actions() {
        let doc = serde_json::json!({"Statement": [
            {"Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage"], "Resource": "arn:aws:sqs:r:a:q"},
            {"Effect": "Allow", "Action": "sqs:SendMessage", "Resource": "arn:aws:sqs:r:a:f"},
            {"Effect": "Allow", "Action": "sqs:GetQueueAttributes", "Resource": "arn:aws:sqs:r:a:q"},
        ]});
        let p = moto_projection(&doc);
        assert_eq!(
            p["Statement"][0]["Action"],
            serde_json::json!(["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:DeleteMessageBatch"])
        );
        assert_eq!(
            p["Statement"][0]["Resource"], "arn:aws:sqs:r:a:q",
            "still on its queue only"
        );
        assert_eq!(
            p["Statement"][1]["Action"],
            serde_json::json!(["sqs:SendMessage", "sqs:SendMessageBatch"])
        );
        assert_eq!(p["Statement"][2]["Action"], "sqs:GetQueueAttributes", "no batch form");
    }

    #[test]
    fn unknown_names_are_named_in_the_error() {
        let e = identity_policies(TEMPLATE, &Stack::default(), Principal::Submit).unwrap_err();
        assert!(e.to_string().contains("no value for"), "{e}");
    }
}
