//! The trust boundary around a job: what one job's AWS session may touch.
//!
//! A job is code someone submitted; it runs on the worker but is not the worker. The agent gives
//! each job a session of its own: `sts:AssumeRole` on the deployment's job role (template.yaml
//! `JobRole`) with the [`job_session_policy`] as the session policy. A session's permissions are
//! the intersection of the role's policy and the session policy (IAM User Guide, "Session
//! policies"), so the job can read its input and read and write `checkpoints/<job_id>/` and
//! `outputs/<job_id>/`, and nothing else: not another job's checkpoint, not the tables, not the
//! queues, not EC2.

use serde_json::{json, Value};

/// The prefixes of the deployment bucket a job owns: `checkpoints/<job_id>/` and
/// `outputs/<job_id>/`.
#[must_use]
pub fn job_prefixes(job_id: &str) -> [String; 2] {
    [format!("checkpoints/{job_id}/"), format!("outputs/{job_id}/")]
}

/// The session policy for job `job_id`: the IAM policy document (JSON) the agent passes as
/// `Policy` to `sts:AssumeRole`.
///
/// - `partition`: `aws` (or `aws-cn`, `aws-us-gov`).
/// - `bucket`: the deployment bucket (checkpoints and outputs).
/// - `input`: the job's input object, `(bucket, key)`, if it has one.
///
/// Statements: read the input object; read and write objects under the job's two prefixes
/// (`s3:GetObject`, `s3:PutObject`, `s3:AbortMultipartUpload`); list the bucket only under those
/// prefixes (`s3:prefix`). The packed document stays far below AWS's 2,048-character limit for
/// session policies (AWS STS API Reference, AssumeRole `Policy`) for job ids of the form
/// `job-<16 hex>` and input keys up to ~1 KB.
#[must_use]
pub fn job_session_policy(partition: &str, bucket: &str, job_id: &str, input: Option<(&str, &str)>) -> Value {
    let [ckpt, out] = job_prefixes(job_id);
    let mut statements = vec![
        json!({
            "Sid": "ItsCheckpointsAndOutputs",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
            "Resource": [
                format!("arn:{partition}:s3:::{bucket}/{ckpt}*"),
                format!("arn:{partition}:s3:::{bucket}/{out}*"),
            ],
        }),
        json!({
            "Sid": "ListItsPrefixes",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": format!("arn:{partition}:s3:::{bucket}"),
            "Condition": {"StringLike": {"s3:prefix": [format!("{ckpt}*"), format!("{out}*")]}},
        }),
    ];
    if let Some((b, k)) = input {
        statements.push(json!({
            "Sid": "ItsInput",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": format!("arn:{partition}:s3:::{b}/{k}"),
        }));
    }
    json!({"Version": "2012-10-17", "Statement": statements})
}

/// The role session name for a job's session: the job id with characters outside
/// `[A-Za-z0-9+=,.@_-]` replaced by `_`, cut to 64 (the AssumeRole `RoleSessionName` rules),
/// and at least 2 characters.
#[must_use]
pub fn job_session_name(job_id: &str) -> String {
    let mut s: String = job_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "+=,.@_-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    while s.len() < 2 {
        s.push('_');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_policy_names_only_the_jobs_own_prefixes_and_input() {
        let p = job_session_policy("aws", "b", "job-1", Some(("b", "inputs/x.bin")));
        let text = p.to_string();
        assert!(text.contains("arn:aws:s3:::b/checkpoints/job-1/*"));
        assert!(text.contains("arn:aws:s3:::b/outputs/job-1/*"));
        assert!(text.contains("arn:aws:s3:::b/inputs/x.bin"));
        assert!(
            !text.contains("checkpoints/*"),
            "never the whole checkpoints prefix: {text}"
        );
        assert!(text.len() < 2048, "{} characters", text.len());
        let none = job_session_policy("aws", "b", "job-1", None).to_string();
        assert!(!none.contains("ItsInput"));
    }

    #[test]
    fn session_names_follow_the_sts_rules() {
        assert_eq!(job_session_name("job-0123456789abcdef"), "job-0123456789abcdef");
        assert_eq!(job_session_name("a b/c"), "a_b_c");
        assert_eq!(job_session_name("x"), "x_");
        assert_eq!(job_session_name(&"y".repeat(100)).len(), 64);
    }
}
