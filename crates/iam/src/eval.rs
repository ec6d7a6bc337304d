//! IAM's verdict on one request, from the template's policies: identity policies of the caller's
//! role, the session policy of its session (if any), and the template's resource-based policies
//! (bucket and queue policies). Statement matching (actions, resources with wildcards, policy
//! variables in resources, the condition operators with `IfExists`, `ForAllValues` /
//! `ForAnyValue`, negated operators true on an absent key) is the `iam-rs` crate's; this module
//! combines the policy types as the IAM User Guide's "Policy evaluation logic" does for a request
//! within one account:
//!
//! 1. an explicit `Deny` in any policy (identity, session or resource-based) denies;
//! 2. otherwise the identity policies must allow, and so must the session policy when the
//!    session has one (a session's permissions are the intersection of the two); a resource-based
//!    policy that allows the caller's role also grants access, except to a session with a session
//!    policy ("Session policies": a resource-based policy naming the role ARN is limited by the
//!    session policy);
//! 3. otherwise the request is implicitly denied.
//!
//! Not modelled (the template uses none of them): permissions boundaries, service control
//! policies, cross-account access, `NotPrincipal`.
//!
//! Policy variables (`${ec2:SourceInstanceARN}`) are replaced from the request context in
//! resources and in condition values before matching; a variable the context lacks is left as
//! it is, so it matches nothing.

use std::collections::BTreeMap;

use iam_rs::{Arn, ContextValue, Decision as RsDecision, EvaluationOptions, IAMPolicy, IAMRequest, PolicyEvaluator};
use serde_json::Value as J;

use crate::{Error, Principal, Stack};

/// A request-context value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// One string (most keys).
    One(String),
    /// A multivalued key (`dynamodb:LeadingKeys`, `aws:TagKeys`).
    Many(Vec<String>),
    /// A boolean (`aws:SecureTransport`).
    Bool(bool),
}

/// One authorization question.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The IAM action, e.g. `s3:GetObject`.
    pub action: String,
    /// The resource ARN, or `*` for actions without resource-level permissions.
    pub resource: String,
    /// Request-specific context keys (`s3:prefix`, `dynamodb:LeadingKeys`,
    /// `ec2:ResourceTag/<key>`, `aws:RequestTag/<key>`, ...). The caller's keys
    /// (`aws:PrincipalArn`, `ec2:SourceInstanceARN`) and `aws:SecureTransport` (true) are added by
    /// [`Authorizer::decide`].
    pub context: BTreeMap<String, Value>,
}

impl Request {
    /// `action` on `resource` with no request-specific context.
    #[must_use]
    pub fn new(action: &str, resource: &str) -> Self {
        Self {
            action: action.to_string(),
            resource: resource.to_string(),
            context: BTreeMap::new(),
        }
    }

    /// With the context key `key` set to one string.
    #[must_use]
    pub fn with(mut self, key: &str, value: &str) -> Self {
        self.context.insert(key.to_string(), Value::One(value.to_string()));
        self
    }

    /// With the multivalued context key `key`.
    #[must_use]
    pub fn with_many(mut self, key: &str, values: &[&str]) -> Self {
        self.context.insert(
            key.to_string(),
            Value::Many(values.iter().map(|v| (*v).to_string()).collect()),
        );
        self
    }
}

/// Who asks: a role of the template (or any role, with its policies given) and its session.
#[derive(Debug, Clone, PartialEq)]
pub struct Caller {
    /// The role's ARN (`aws:PrincipalArn`).
    pub role_arn: String,
    /// The role's identity policies.
    pub identity: Vec<J>,
    /// The session policy, if the session was started with one.
    pub session_policy: Option<J>,
    /// The EC2 instance whose role credentials these are (workers): sets
    /// `ec2:SourceInstanceARN`.
    pub instance_arn: Option<String>,
}

/// The verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Allowed.
    Allow,
    /// A `Deny` statement matched: the policy kind (`identity`, `session`, `resource`) and its `Sid`.
    ExplicitDeny(String),
    /// Nothing allowed it (or the session policy did not).
    ImplicitDeny(String),
}

impl Decision {
    /// Whether the request is allowed.
    #[must_use]
    pub fn allowed(&self) -> bool {
        matches!(self, Decision::Allow)
    }
}

/// The template's policies for one stack, ready to answer requests.
#[derive(Debug, Clone)]
pub struct Authorizer {
    stack: Stack,
    roles: BTreeMap<Principal, (String, Vec<J>)>,
    resource_policies: Vec<J>,
}

/// Stand-ins for the characters IAM's special variables `${*}`, `${?}` and `${$}` write (IAM User
/// Guide, "Policy variables", "Special characters"): iam-rs knows no literal `*` or `?` in a
/// pattern, so both the policy's special variables and the request's own characters become these
/// private-use characters before matching; a wildcard still matches them, and only they match
/// each other.
const LITERALS: [(char, char); 3] = [('*', '\u{e000}'), ('?', '\u{e001}'), ('$', '\u{e002}')];

/// `text` from a request (a resource or a context value) with `*`, `?` and `$` as their
/// [`LITERALS`] stand-ins.
fn literal(text: &str) -> String {
    text.chars()
        .map(|c| LITERALS.iter().find(|(from, _)| *from == c).map_or(c, |(_, to)| *to))
        .collect()
}

fn substitute(text: &str, ctx: &BTreeMap<String, Value>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[i..]);
            return out;
        };
        let key = &after[..end];
        let special = LITERALS
            .iter()
            .find(|(from, _)| key.len() == 1 && key.starts_with(*from));
        match (special, ctx.get(key)) {
            (Some((_, to)), _) => out.push(*to),
            (None, Some(Value::One(v))) => out.push_str(&literal(v)),
            _ => {
                out.push_str("${");
                out.push_str(key);
                out.push('}');
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

/// `doc` with policy variables replaced in `Resource` and in condition values.
fn with_variables(doc: &J, ctx: &BTreeMap<String, Value>) -> J {
    fn walk(v: &J, ctx: &BTreeMap<String, Value>) -> J {
        match v {
            J::String(s) => J::String(substitute(s, ctx)),
            J::Array(a) => J::Array(a.iter().map(|x| walk(x, ctx)).collect()),
            J::Object(m) => J::Object(m.iter().map(|(k, x)| (k.clone(), walk(x, ctx))).collect()),
            other => other.clone(),
        }
    }
    let mut out = doc.clone();
    let statements: Vec<&mut J> = match out.get_mut("Statement") {
        Some(J::Array(a)) => a.iter_mut().collect(),
        Some(one @ J::Object(_)) => vec![one],
        _ => Vec::new(),
    };
    for st in statements {
        for key in ["Resource", "Condition"] {
            if let Some(v) = st.get(key) {
                let replaced = walk(v, ctx);
                st[key] = replaced;
            }
        }
    }
    out
}

/// What a set of policies says: `Some(Ok(()))` allow, `Some(Err(sid))` explicit deny, `None`
/// nothing matched.
fn verdict(
    docs: &[J],
    principal: &str,
    req: &Request,
    ctx: &BTreeMap<String, Value>,
) -> Result<Option<Result<(), String>>, Error> {
    let mut policies = Vec::new();
    for d in docs {
        let text = with_variables(d, ctx).to_string();
        policies.push(IAMPolicy::from_json(&text).map_err(|e| Error::Shape(format!("policy {text}: {e}")))?);
    }
    let resource = if req.resource == "*" {
        // Any ARN: a statement with `Resource: "*"` matches it, one naming an ARN does not.
        "arn:aws:iam::000000000000:no-resource-level-permissions".to_string()
    } else {
        literal(&req.resource)
    };
    let arn = Arn::parse(&resource).map_err(|e| Error::Shape(format!("resource {resource}: {e}")))?;
    let mut context = iam_rs::Context::new();
    for (k, v) in ctx {
        let v = match v {
            Value::One(s) => ContextValue::String(literal(s)),
            Value::Many(xs) => ContextValue::StringList(xs.iter().map(|x| literal(x)).collect()),
            Value::Bool(b) => ContextValue::Boolean(*b),
        };
        context.insert(k.clone(), v);
    }
    let request = IAMRequest::new_with_context(
        iam_rs::Principal::Aws(iam_rs::PrincipalId::String(principal.to_string())),
        &req.action,
        arn,
        context,
    );
    let evaluator = PolicyEvaluator::with_policies(policies).with_options(EvaluationOptions {
        stop_on_explicit_deny: false,
        collect_match_details: true,
        ..EvaluationOptions::default()
    });
    let result = evaluator
        .evaluate(&request)
        .map_err(|e| Error::Shape(format!("evaluating {} on {}: {e}", req.action, req.resource)))?;
    Ok(match result.decision {
        RsDecision::Allow => Some(Ok(())),
        RsDecision::Deny => {
            let sid = result
                .statement_details
                .iter()
                .find(|m| m.conditions_satisfied && m.effect == iam_rs::IAMEffect::Deny)
                .and_then(|m| m.sid.clone())
                .unwrap_or_else(|| "(no Sid)".into());
            Some(Err(sid))
        }
        RsDecision::NotApplicable => None,
    })
}

impl Authorizer {
    /// Every role of `template` resolved for `stack`, and its resource-based policies.
    ///
    /// # Errors
    /// The template does not resolve for the stack.
    pub fn for_template(template: &str, stack: &Stack) -> Result<Self, Error> {
        let mut roles = BTreeMap::new();
        for p in Principal::ALL {
            if !crate::has_role(template, p)? {
                continue;
            }
            let arn = stack
                .atts
                .get(&format!("{}.Arn", p.role_logical_id()))
                .cloned()
                .unwrap_or_else(|| {
                    format!(
                        "arn:{}:iam::{}:role/{}-{}",
                        stack.partition,
                        stack.account,
                        stack.stack_name,
                        p.as_str()
                    )
                });
            roles.insert(p, (arn, crate::identity_policies(template, stack, p)?));
        }
        Ok(Self {
            stack: stack.clone(),
            roles,
            resource_policies: crate::resource_policies(template, stack)?,
        })
    }

    /// The stack the policies were resolved for.
    #[must_use]
    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    /// `p`'s role as a caller: its ARN and identity policies, no session policy, no instance.
    ///
    /// # Errors
    /// The template has no role for `p`.
    pub fn caller(&self, p: Principal) -> Result<Caller, Error> {
        let (role_arn, identity) = self
            .roles
            .get(&p)
            .cloned()
            .ok_or_else(|| Error::Shape(format!("the template has no role for {}", p.as_str())))?;
        Ok(Caller {
            role_arn,
            identity,
            session_policy: None,
            instance_arn: None,
        })
    }

    /// The worker role's credentials on instance `instance_id` (`ec2:SourceInstanceARN`).
    ///
    /// # Errors
    /// The template has no worker role.
    pub fn worker(&self, instance_id: &str) -> Result<Caller, Error> {
        let mut c = self.caller(Principal::Worker)?;
        c.instance_arn = Some(self.instance_arn(instance_id));
        Ok(c)
    }

    /// A job's session: the job role narrowed by `session_policy`.
    ///
    /// # Errors
    /// The template has no job role.
    pub fn job(&self, session_policy: J) -> Result<Caller, Error> {
        let mut c = self.caller(Principal::Job)?;
        c.session_policy = Some(session_policy);
        Ok(c)
    }

    /// `arn:<partition>:ec2:<region>:<account>:instance/<id>`.
    #[must_use]
    pub fn instance_arn(&self, instance_id: &str) -> String {
        let s = &self.stack;
        format!(
            "arn:{}:ec2:{}:{}:instance/{instance_id}",
            s.partition, s.region, s.account
        )
    }

    /// IAM's verdict on `req` made by `caller`.
    ///
    /// # Errors
    /// A policy or the resource does not parse.
    pub fn decide(&self, caller: &Caller, req: &Request) -> Result<Decision, Error> {
        let mut ctx = req.context.clone();
        ctx.entry("aws:PrincipalArn".into())
            .or_insert_with(|| Value::One(caller.role_arn.clone()));
        ctx.entry("aws:SecureTransport".into()).or_insert(Value::Bool(true));
        if let Some(i) = &caller.instance_arn {
            ctx.entry("ec2:SourceInstanceARN".into())
                .or_insert_with(|| Value::One(i.clone()));
        }
        if req.resource != "*" {
            ctx.entry("aws:ARN".into())
                .or_insert_with(|| Value::One(req.resource.clone()));
        }
        let principal = caller.role_arn.as_str();
        let identity = verdict(&caller.identity, principal, req, &ctx)?;
        let session = match &caller.session_policy {
            Some(p) => Some(verdict(std::slice::from_ref(p), principal, req, &ctx)?),
            None => None,
        };
        let resource = verdict(&self.resource_policies, principal, req, &ctx)?;
        for (kind, v) in [("identity", &identity), ("resource", &resource)] {
            if let Some(Err(sid)) = v {
                return Ok(Decision::ExplicitDeny(format!("{kind} policy, {sid}")));
            }
        }
        if let Some(Some(Err(sid))) = &session {
            return Ok(Decision::ExplicitDeny(format!("session policy, {sid}")));
        }
        let identity_allows = matches!(identity, Some(Ok(())));
        let session_allows = match &session {
            None => true,
            Some(v) => matches!(v, Some(Ok(()))),
        };
        if identity_allows && session_allows {
            return Ok(Decision::Allow);
        }
        if session.is_none() && matches!(resource, Some(Ok(()))) {
            return Ok(Decision::Allow);
        }
        Ok(Decision::ImplicitDeny(if identity_allows {
            "the session policy does not allow it".into()
        } else {
            "no identity policy allows it".into()
        }))
    }

    /// Whether `caller` may assume `p`'s role: its identity policies allow `sts:AssumeRole` on the
    /// role, and the role's trust policy names the caller's role.
    ///
    /// # Errors
    /// The template has no role for `p`, or a policy does not parse.
    pub fn may_assume(&self, template: &str, caller: &Caller, p: Principal) -> Result<bool, Error> {
        let (role_arn, _) = self
            .roles
            .get(&p)
            .ok_or_else(|| Error::Shape(format!("the template has no role for {}", p.as_str())))?;
        let req = Request::new("sts:AssumeRole", role_arn);
        if !self.decide(caller, &req)?.allowed() {
            return Ok(false);
        }
        let mut trust = crate::trust_policy(template, &self.stack, p)?;
        // A trust policy's statements name no resource (the role is the resource).
        if let Some(J::Array(statements)) = trust.get_mut("Statement") {
            for st in statements {
                if st.get("Resource").is_none() {
                    st["Resource"] = J::String("*".into());
                }
            }
        }
        let mut ctx = BTreeMap::new();
        ctx.insert("aws:PrincipalArn".into(), Value::One(caller.role_arn.clone()));
        Ok(matches!(verdict(&[trust], &caller.role_arn, &req, &ctx)?, Some(Ok(()))))
    }
}
