//! IAM in the local emulator: one role per component with the policies template.yaml gives it,
//! a session of each role, then enforcement on.
//!
//! moto server checks IAM once its count of unauthenticated requests reaches
//! `INITIAL_NO_AUTH_ACTION_COUNT` (moto's IAM docs); its `POST /moto-api/reset-auth` sets that
//! count and zeroes the counter, so `onoff local` sets everything up unauthenticated, then posts
//! `0`: from then on every request must be signed by a known key and allowed by its principal's
//! policies. What moto checks is narrower than IAM (see `onoff_iam::moto_projection`): the
//! action always, the resource only for S3, SQS and STS AssumeRole, no conditions, no resource-
//! or session policies. The rest is covered by evaluating the recorded calls against the
//! template (`onoff_iam::evaluate`).
//!
//! The setup speaks IAM's and STS's Query APIs directly (unsigned: before enforcement moto does
//! not check signatures), so `onoff local` needs no IAM SDK crate.

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A role session's credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Role ARN.
    pub role_arn: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Session token.
    pub session_token: String,
}

impl Session {
    /// The SDK credentials of this session.
    #[must_use]
    pub fn credentials(&self) -> aws_sdk_s3::config::Credentials {
        aws_sdk_s3::config::Credentials::new(
            &self.access_key_id,
            &self.secret_access_key,
            Some(self.session_token.clone()),
            None,
            "onoff-local-iam",
        )
    }

    /// The environment variables that give a process this session.
    #[must_use]
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), self.access_key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY".into(), self.secret_access_key.clone()),
            ("AWS_SESSION_TOKEN".into(), self.session_token.clone()),
        ]
    }
}

fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// POST `body` to `endpoint` + `path`; returns (status, body). HTTP/1.1, `Connection: close`.
async fn post(
    endpoint: &str,
    path: &str,
    service: &str,
    content_type: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/').to_string();
    let mut stream = tokio::net::TcpStream::connect(&hostport)
        .await
        .with_context(|| format!("connect to {endpoint}"))?;
    // moto routes a request by the service in the credential scope.
    let auth = format!(
        "AWS4-HMAC-SHA256 Credential=setup/20260101/us-east-1/{service}/aws4_request, SignedHeaders=host, Signature=0"
    );
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: {content_type}\r\nAuthorization: {auth}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no HTTP status from {endpoint}{path}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

async fn query(endpoint: &str, service: &str, params: &[(&str, &str)]) -> anyhow::Result<String> {
    let body = params
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let action = params.iter().find(|(k, _)| *k == "Action").map_or("", |(_, v)| *v);
    let (status, text) = post(endpoint, "/", service, "application/x-www-form-urlencoded", &body).await?;
    anyhow::ensure!(status == 200, "{service} {action}: HTTP {status}: {text}");
    Ok(text)
}

fn xml_field(xml: &str, tag: &str) -> Option<String> {
    let open = format!("<{tag}>");
    let start = xml.find(&open)? + open.len();
    let end = xml[start..].find(&format!("</{tag}>"))? + start;
    Some(xml[start..end].to_string())
}

/// Create role `name` with `policies` (inline, named `p0`, `p1`, ...) and a trust policy any
/// principal of the account may assume (local stand-in for "Lambda / EC2 assumes the role";
/// moto does not check service principals). Returns the role ARN.
///
/// # Errors
/// The emulator refused a call.
pub async fn create_role(endpoint: &str, name: &str, policies: &[serde_json::Value]) -> anyhow::Result<String> {
    let trust = serde_json::json!({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
    })
    .to_string();
    let out = query(
        endpoint,
        "iam",
        &[
            ("Action", "CreateRole"),
            ("Version", "2010-05-08"),
            ("RoleName", name),
            ("AssumeRolePolicyDocument", &trust),
        ],
    )
    .await?;
    let arn = xml_field(&out, "Arn").with_context(|| format!("CreateRole {name}: no Arn in {out}"))?;
    for (i, p) in policies.iter().enumerate() {
        let doc = p.to_string();
        query(
            endpoint,
            "iam",
            &[
                ("Action", "PutRolePolicy"),
                ("Version", "2010-05-08"),
                ("RoleName", name),
                ("PolicyName", &format!("p{i}")),
                ("PolicyDocument", &doc),
            ],
        )
        .await?;
    }
    Ok(arn)
}

/// A session of `role_arn` named `session_name`, for 12 hours (moto does not expire sessions).
///
/// # Errors
/// The emulator refused the call or its answer has no credentials.
pub async fn assume(endpoint: &str, role_arn: &str, session_name: &str) -> anyhow::Result<Session> {
    let out = query(
        endpoint,
        "sts",
        &[
            ("Action", "AssumeRole"),
            ("Version", "2011-06-15"),
            ("RoleArn", role_arn),
            ("RoleSessionName", session_name),
            ("DurationSeconds", "43200"),
        ],
    )
    .await?;
    let field = |t: &str| xml_field(&out, t).with_context(|| format!("AssumeRole {role_arn}: no {t}"));
    Ok(Session {
        role_arn: role_arn.to_string(),
        access_key_id: field("AccessKeyId")?,
        secret_access_key: field("SecretAccessKey")?,
        session_token: field("SessionToken")?,
    })
}

/// Turn enforcement on (`true`: every request from now on is authenticated and authorized) or
/// off again (a shared emulator, left as it was found).
///
/// # Errors
/// The emulator refused.
pub async fn enforce(endpoint: &str, on: bool) -> anyhow::Result<()> {
    let count = if on { "0" } else { "inf" };
    let (status, text) = post(endpoint, "/moto-api/reset-auth", "iam", "text/plain", count).await?;
    anyhow::ensure!(status == 200, "moto reset-auth: HTTP {status}: {text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode("a b/{\"x\"}"), "a%20b%2F%7B%22x%22%7D");
        assert_eq!(encode("Az09-_.~"), "Az09-_.~");
    }

    #[test]
    fn xml_fields_are_found() {
        let x = "<R><Credentials><AccessKeyId>AK</AccessKeyId></Credentials></R>";
        assert_eq!(xml_field(x, "AccessKeyId").as_deref(), Some("AK"));
        assert_eq!(xml_field(x, "Nope"), None);
    }
}

/// The worker image of a local run (jobs name it; no registry is involved).
pub const LOCAL_IMAGE: &str = "onoff-local";

/// The local stand-ins for the deployment's names, as `onoff_iam` resolves the template with:
/// the resources `onoff_aws::provision` created under `prefix` (the stack name), the roles this
/// module creates (`<prefix>-<principal>`), moto's account and us-east-1. Each lane queue of the
/// template ([`onoff_iam::lane_queues`]) stands for the queue of the lane of that name.
///
/// # Errors
/// The template's lane queues cannot be read ([`onoff_iam::lane_queues`]).
pub fn local_stack(
    prefix: &str,
    account: &str,
    res: &onoff_aws::settings::Resources,
) -> Result<onoff_iam::Stack, onoff_iam::Error> {
    let region = "us-east-1";
    let mut refs = std::collections::BTreeMap::new();
    let mut atts = std::collections::BTreeMap::new();
    let queue_arn = |name: &str| format!("arn:aws:sqs:{region}:{account}:{name}");
    for (lane, logical) in onoff_iam::lane_queues(onoff_iam::TEMPLATE, onoff_iam::Principal::Scaler)? {
        let url = res
            .queue_url(&lane)
            .map_or_else(|| format!("http://localhost/{account}/{prefix}-{lane}"), str::to_string);
        let name = url.rsplit('/').next().unwrap_or_default().to_string();
        atts.insert(format!("{logical}.Arn"), queue_arn(&name));
        atts.insert(format!("{logical}.QueueName"), name);
        refs.insert(logical.to_string(), url);
    }
    for (logical, name) in [
        ("SubmissionQueue", format!("{prefix}-submissions")),
        ("FailedEventsQueue", format!("{prefix}-failed-events")),
    ] {
        atts.insert(format!("{logical}.Arn"), queue_arn(&name));
        refs.insert(logical.to_string(), format!("http://localhost/{account}/{name}"));
    }
    for (logical, name) in [
        ("JobsTable", &res.jobs_table),
        ("WorkersTable", &res.workers_table),
        ("ControlTable", &res.control_table),
    ] {
        atts.insert(
            format!("{logical}.Arn"),
            format!("arn:aws:dynamodb:{region}:{account}:table/{name}"),
        );
        refs.insert(logical.to_string(), name.clone());
    }
    refs.insert("Bucket".into(), res.bucket.clone());
    atts.insert("Bucket.Arn".into(), format!("arn:aws:s3:::{}", res.bucket));
    refs.insert("WorkerLaunchTemplate".into(), res.launch_template.clone());
    // The emulator's launch template names no security group; the template's statement for it
    // then names one no launch uses.
    atts.insert("WorkerSecurityGroup.GroupId".into(), format!("sg-{prefix}"));
    for p in onoff_iam::Principal::ALL {
        let role = format!("{prefix}-{}", p.as_str());
        atts.insert(
            format!("{}.Arn", p.role_logical_id()),
            format!("arn:aws:iam::{account}:role/{role}"),
        );
        refs.insert(p.role_logical_id().to_string(), role);
    }
    for f in ["Scaler", "Reconciler", "Interruption", "Submit"] {
        let name = format!("{prefix}-{}", f.to_lowercase());
        atts.insert(
            format!("{f}Function.Arn"),
            format!("arn:aws:lambda:{region}:{account}:function:{name}"),
        );
        refs.insert(format!("{f}Function"), name);
        atts.insert(
            format!("{f}LogGroup.Arn"),
            format!(
                "arn:aws:logs:{region}:{account}:log-group:/aws/lambda/{prefix}-{}:*",
                f.to_lowercase()
            ),
        );
    }
    atts.insert(
        "WorkerLogGroup.Arn".into(),
        format!("arn:aws:logs:{region}:{account}:log-group:/onoff/{prefix}/workers:*"),
    );
    let mut params = std::collections::BTreeMap::new();
    params.insert(
        "WorkerSubnets".into(),
        res.subnets
            .iter()
            .map(|(_, id)| id.as_str())
            .collect::<Vec<_>>()
            .join(","),
    );
    params.insert("WorkerVpcId".into(), "vpc-local".into());
    params.insert("WorkerImageUri".into(), LOCAL_IMAGE.into());
    Ok(onoff_iam::Stack {
        partition: "aws".into(),
        region: region.into(),
        account: account.into(),
        stack_name: prefix.into(),
        refs,
        atts,
        params,
    })
}

/// The sessions of a local run: one per function, one for the agents (the worker role), the
/// runner's (it plays EC2, CloudWatch and S3 notifications: allowed everything), the
/// submitter's (puts job specs under `jobs/`) and the operator's (the template's managed policy
/// `OperatorAccess`, as an operator's role on AWS has it: `onoff ... --local`). The job role
/// exists (the agents assume it per job) but has no session here.
#[derive(Debug, Clone)]
pub struct LocalSessions {
    /// Function name (`scaler`, ...) -> its session.
    pub functions: std::collections::BTreeMap<String, Session>,
    /// The worker role's session (every agent).
    pub worker: Session,
    /// The job role's ARN (none while the template has no `JobRole`).
    pub job_role_arn: Option<String>,
    /// Everything allowed.
    pub runner: Session,
    /// `s3:PutObject` under `jobs/` of the bucket.
    pub submitter: Session,
    /// The submitter's role and policy, for the evaluation of its calls ([`check_calls`]).
    pub submitter_caller: onoff_iam::eval::Caller,
    /// `OperatorAccess` only: the operator CLI's session on a local stack.
    pub operator: Session,
    /// The operator's role and `OperatorAccess`, for the evaluation of its calls.
    pub operator_caller: onoff_iam::eval::Caller,
}

impl LocalSessions {
    /// The callers of the principals a deployment does not define (the submitter, the operator),
    /// by the principal their calls are recorded under.
    #[must_use]
    pub fn local_callers(&self) -> std::collections::BTreeMap<String, onoff_iam::eval::Caller> {
        [
            ("submitter".to_string(), self.submitter_caller.clone()),
            ("operator".to_string(), self.operator_caller.clone()),
        ]
        .into_iter()
        .collect()
    }
}

impl Session {
    /// The JSON EC2's instance metadata serves at `iam/security-credentials/<role>` for this
    /// session (the local IMDS serves the worker role's session so).
    #[must_use]
    pub fn imds_json(&self) -> String {
        serde_json::json!({
            "Code": "Success",
            "Type": "AWS-HMAC",
            "AccessKeyId": self.access_key_id,
            "SecretAccessKey": self.secret_access_key,
            "Token": self.session_token,
            "Expiration": "2099-01-01T00:00:00Z",
            "LastUpdated": "2026-01-01T00:00:00Z",
        })
        .to_string()
    }

    /// The role's name (the last part of its ARN).
    #[must_use]
    pub fn role_name(&self) -> &str {
        self.role_arn.rsplit('/').next().unwrap_or_default()
    }
}

/// Create the roles of `stack` in the emulator with the template's policies (as moto evaluates
/// them), a session of each, then turn enforcement on.
///
/// # Errors
/// The template does not resolve for the stack, or the emulator refused a setup call.
pub async fn setup(endpoint: &str, stack: &onoff_iam::Stack) -> anyhow::Result<LocalSessions> {
    use onoff_iam::Principal;
    let mut arns = std::collections::BTreeMap::new();
    for p in Principal::ALL {
        if !onoff_iam::has_role(onoff_iam::TEMPLATE, p)? {
            continue;
        }
        let docs = onoff_iam::identity_policies(onoff_iam::TEMPLATE, stack, p)
            .with_context(|| format!("the template's policies of {}", p.as_str()))?;
        let projected: Vec<serde_json::Value> = docs.iter().map(onoff_iam::moto_projection).collect();
        let name = format!("{}-{}", stack.stack_name, p.as_str());
        arns.insert(p, create_role(endpoint, &name, &projected).await?);
    }
    let all = serde_json::json!({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]});
    let runner = create_role(endpoint, &format!("{}-runner", stack.stack_name), &[all]).await?;
    let bucket = stack.refs.get("Bucket").cloned().unwrap_or_default();
    // A submitter puts job specs under jobs/ or sends them to the submission queue (on AWS the
    // bucket's and the queue's policies name the submitter principals).
    let submissions = stack.atts.get("SubmissionQueue.Arn").cloned().unwrap_or_default();
    let put_jobs = serde_json::json!({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:PutObject", "Resource": format!("arn:aws:s3:::{bucket}/jobs/*")},
        {"Effect": "Allow", "Action": "sqs:SendMessage", "Resource": submissions},
    ]});
    let (submitter, submitter_caller) = local_role(endpoint, stack, "submitter", put_jobs).await?;
    // The operator's role has what an operator's role on AWS is given: the template's managed
    // policy, resolved for this stack (its resources' names are the stack's).
    let operator_access = onoff_iam::managed_policy(onoff_iam::TEMPLATE, stack, "OperatorAccess")
        .context("the template's OperatorAccess policy")?;
    let (operator, operator_caller) = local_role(endpoint, stack, "operator", operator_access).await?;
    let mut functions = std::collections::BTreeMap::new();
    for p in [
        Principal::Scaler,
        Principal::Reconciler,
        Principal::Interruption,
        Principal::Submit,
    ] {
        functions.insert(p.as_str().to_string(), assume(endpoint, &arns[&p], p.as_str()).await?);
    }
    let sessions = LocalSessions {
        functions,
        worker: assume(endpoint, &arns[&Principal::Worker], "worker").await?,
        job_role_arn: arns.get(&Principal::Job).cloned(),
        runner: assume(endpoint, &runner, "runner").await?,
        submitter: assume(endpoint, &submitter, "submitter").await?,
        submitter_caller,
        operator: assume(endpoint, &operator, "operator").await?,
        operator_caller,
    };
    enforce(endpoint, true).await?;
    Ok(sessions)
}

/// Role `<stack>-<name>` with `policy` (as moto evaluates it, [`onoff_iam::moto_projection`]),
/// and its caller for the evaluation of its recorded calls (the policy in full).
///
/// # Errors
/// The emulator refused a call.
async fn local_role(
    endpoint: &str,
    stack: &onoff_iam::Stack,
    name: &str,
    policy: serde_json::Value,
) -> anyhow::Result<(String, onoff_iam::eval::Caller)> {
    let arn = create_role(
        endpoint,
        &format!("{}-{name}", stack.stack_name),
        &[onoff_iam::moto_projection(&policy)],
    )
    .await?;
    let caller = onoff_iam::eval::Caller {
        role_arn: arn.clone(),
        identity: vec![policy],
        session_policy: None,
        instance_arn: None,
    };
    Ok((arn, caller))
}

/// The recorded calls of a run evaluated against template.yaml's full policies
/// (`onoff_iam::eval`): conditions, session and resource-based policies included, which moto
/// does not evaluate.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PolicyCheck {
    /// IAM requests evaluated (a call can be several: a launch is its template, subnets,
    /// instances, tags and the passed role).
    pub requests: usize,
    /// Of those, denied.
    pub denied: usize,
    /// Requests evaluated per principal (`worker/<id>` counted as `worker`).
    pub requests_by_principal: std::collections::BTreeMap<String, usize>,
    /// The denied ones, `principal: action on resource (why)`, at most 20 distinct.
    pub denied_requests: Vec<String>,
    /// Calls of operations the evaluation does not cover (`service Operation`, distinct).
    pub not_covered: Vec<String>,
}

/// Evaluate every call of `calls` (a run's `calls.jsonl`) made by a template principal (the four
/// functions, `worker/<instance-id>`) or by a local one of `local_callers` (the `submitter`, the
/// `operator`: [`LocalSessions::local_callers`]). The runner's calls (it plays EC2 and the event
/// sources) are not IAM's business.
///
/// # Errors
/// The template does not resolve for `stack`.
pub fn check_calls(
    calls: &[onoff_iam::calls::Call],
    stack: &onoff_iam::Stack,
    world: &onoff_iam::calls::World,
    local_callers: &std::collections::BTreeMap<String, onoff_iam::eval::Caller>,
) -> anyhow::Result<PolicyCheck> {
    use onoff_iam::Principal;
    let auth = onoff_iam::eval::Authorizer::for_template(onoff_iam::TEMPLATE, stack)?;
    let mut out = PolicyCheck::default();
    let mut denied = std::collections::BTreeSet::new();
    let mut not_covered = std::collections::BTreeSet::new();
    for call in calls {
        let (who, rest) = call.principal.split_once('/').unwrap_or((call.principal.as_str(), ""));
        let caller = match who {
            "worker" => auth.worker(rest)?,
            name => match (local_callers.get(name), name.parse::<Principal>()) {
                (Some(c), _) => c.clone(),
                (None, Ok(p)) if p != Principal::Worker && p != Principal::Job => auth.caller(p)?,
                _ => continue,
            },
        };
        let requests = match onoff_iam::calls::requests(call, stack, world) {
            Ok(r) => r,
            Err(why) => {
                not_covered.insert(why);
                continue;
            }
        };
        for r in requests {
            out.requests += 1;
            *out.requests_by_principal.entry(who.to_string()).or_default() += 1;
            let d = auth.decide(&caller, &r)?;
            if !d.allowed() {
                out.denied += 1;
                denied.insert(format!("{}: {} on {} ({d:?})", call.principal, r.action, r.resource));
            }
        }
    }
    out.denied_requests = denied.into_iter().take(20).collect();
    out.not_covered = not_covered.into_iter().collect();
    Ok(out)
}
