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
/// prefixes (`s3:prefix`). The input key is an exact object, never a pattern: its `*`, `?` and
/// `$` are written `${*}`, `${?}` and `${$}` (IAM User Guide, "Policy variables", "Special
/// characters"), so a key like `inputs/a*` grants `inputs/a*` and not every key that starts
/// with `inputs/a`. Send it with [`session_policy_text`].
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
            "Resource": format!("arn:{partition}:s3:::{b}/{}", arn_literal(k)),
        }));
    }
    json!({"Version": "2012-10-17", "Statement": statements})
}

/// The most characters AWS STS takes as a session policy's plaintext (AWS STS API Reference,
/// AssumeRole, `Policy`: "can't exceed 2,048 characters").
pub const MAX_SESSION_POLICY_CHARS: usize = 2048;

/// `text` for the resource part of an ARN, as itself: IAM's wildcards and the start of a policy
/// variable written as the special variables `${*}`, `${?}` and `${$}`.
#[must_use]
pub fn arn_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '*' => out.push_str("${*}"),
            '?' => out.push_str("${?}"),
            '$' => out.push_str("${$}"),
            c => out.push(c),
        }
    }
    out
}

/// Why STS would refuse a session policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionPolicyError {
    /// Longer than [`MAX_SESSION_POLICY_CHARS`].
    #[error("the job's session policy is {chars} characters; AWS STS takes at most 2,048")]
    TooLong {
        /// Characters of the policy text.
        chars: usize,
    },
    /// A character outside what STS accepts.
    #[error("the job's session policy holds {0:?}; AWS STS takes only U+0020-U+00FF, tab, LF and CR")]
    Character(char),
}

/// Whether AWS STS takes `text` as an AssumeRole session policy, as far as its documented rules
/// go: at most [`MAX_SESSION_POLICY_CHARS`] characters, each within U+0020–U+00FF or a tab,
/// line feed or carriage return (AWS STS API Reference, AssumeRole, `Policy`). The packed size,
/// a separate limit STS checks after compressing the policy, is not predictable and not checked.
///
/// # Errors
/// The first rule `text` breaks.
pub fn sts_session_policy_check(text: &str) -> Result<(), SessionPolicyError> {
    if let Some(c) = text
        .chars()
        .find(|&c| !(('\u{20}'..='\u{ff}').contains(&c) || matches!(c, '\t' | '\n' | '\r')))
    {
        return Err(SessionPolicyError::Character(c));
    }
    let chars = text.chars().count();
    if chars > MAX_SESSION_POLICY_CHARS {
        return Err(SessionPolicyError::TooLong { chars });
    }
    Ok(())
}

/// `policy` as the text to send to STS: JSON with every character beyond ASCII written as a
/// `\uXXXX` escape (the same document: JSON readers decode the escapes), so a key in any script
/// stays within the characters STS takes.
///
/// # Errors
/// The text breaks [`sts_session_policy_check`] (too long).
pub fn session_policy_text(policy: &Value) -> Result<String, SessionPolicyError> {
    let raw = policy.to_string();
    let mut text = String::with_capacity(raw.len());
    for c in raw.chars() {
        if c.is_ascii() {
            text.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                text.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    sts_session_policy_check(&text)?;
    Ok(text)
}

/// The longest a deployment makes the rest of a job's session policy: the `aws-us-gov`
/// partition, a 63-character bucket (S3's longest name) and a job id of [`crate::job::job_id_for`]'s
/// form. [`crate::job::JobSpec::validate`] holds an input to what fits beside it.
///
/// # Errors
/// The policy naming this input would be refused by STS in some deployment.
pub fn session_policy_fits(input_bucket: &str, input_key: &str) -> Result<(), SessionPolicyError> {
    let bucket = "b".repeat(63);
    let policy = job_session_policy(
        "aws-us-gov",
        &bucket,
        "job-0123456789abcdef",
        Some((input_bucket, input_key)),
    );
    session_policy_text(&policy).map(|_| ())
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
    fn an_input_key_is_one_object_in_any_script_as_sts_takes_it() {
        // Wildcards and the start of a policy variable are the key's own characters.
        let p = job_session_policy("aws", "b", "job-1", Some(("b", "inputs/a*b?$x.csv")));
        assert!(
            p.to_string().contains(r#""arn:aws:s3:::b/inputs/a${*}b${?}${$}x.csv""#),
            "{p}"
        );
        // Beyond Latin-1, the plain JSON text is one STS refuses; the text sent is ASCII and
        // reads back as the same document.
        let p = job_session_policy("aws", "b", "job-1", Some(("b", "inputs/run’s 入力.csv")));
        assert_eq!(
            sts_session_policy_check(&p.to_string()),
            Err(SessionPolicyError::Character('’'))
        );
        let text = session_policy_text(&p).unwrap();
        assert!(
            text.is_ascii() && text.contains(r"run\u2019s \u5165\u529b.csv"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), p);
        // A character beyond the Basic Multilingual Plane is a surrogate pair, as JSON has it.
        let p = job_session_policy("aws", "b", "job-1", Some(("b", "inputs/🚀")));
        let text = session_policy_text(&p).unwrap();
        assert!(text.contains(r"\ud83d\ude80"), "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), p);
    }

    #[test]
    fn an_input_key_that_does_not_fit_the_session_policy_is_refused_before_sts() {
        // 1,024 bytes of UTF-8, S3's most, but 2,041 characters once escaped.
        let key = format!("inputs/{}", "入".repeat(339));
        assert!(key.len() <= 1024);
        let p = job_session_policy("aws", "b", "job-1", Some(("b", &key)));
        assert!(matches!(session_policy_text(&p), Err(SessionPolicyError::TooLong { chars }) if chars > 2048));
        assert!(session_policy_fits("b", &key).is_err());
        // The longest deployment still leaves room for a plain 1,024-byte key.
        let ascii = format!("inputs/{}", "k".repeat(1017));
        assert!(session_policy_fits(
            "a-63-character-bucket-name-is-the-longest-s3-allows-xxxxxxxxxxx",
            &ascii
        )
        .is_ok());
        assert_eq!(sts_session_policy_check("{\t\"a\":\"\u{ff}\"}\r\n"), Ok(()));
        assert_eq!(
            sts_session_policy_check("\u{7}"),
            Err(SessionPolicyError::Character('\u{7}'))
        );
    }

    #[test]
    fn session_names_follow_the_sts_rules() {
        assert_eq!(job_session_name("job-0123456789abcdef"), "job-0123456789abcdef");
        assert_eq!(job_session_name("a b/c"), "a_b_c");
        assert_eq!(job_session_name("x"), "x_");
        assert_eq!(job_session_name(&"y".repeat(100)).len(), 64);
    }
}
