//! Typed settings from the environment, loaded once at cold start, and the SDK clients built once.

use aws_config::retry::RetryConfig;
use aws_config::{BehaviorVersion, SdkConfig};
/// S3 errors' code and message accessor, for crates that read S3 through [`Clients`].
pub use aws_sdk_s3::error::ProvideErrorMetadata as S3ErrorMetadata;

/// Names of the AWS resources the control plane uses (the SAM template's outputs), read from
/// environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources {
    /// `ONOFF_QUEUE_URLS`: lane=url pairs, comma separated, e.g. `express=https://...,standard=https://...`.
    pub queue_urls: Vec<(String, String)>,
    /// `ONOFF_JOBS_TABLE`.
    pub jobs_table: String,
    /// `ONOFF_WORKERS_TABLE`.
    pub workers_table: String,
    /// `ONOFF_CONTROL_TABLE`: leases and unavailable offerings.
    pub control_table: String,
    /// `ONOFF_BUCKET`: job specs and checkpoints.
    pub bucket: String,
    /// `ONOFF_LAUNCH_TEMPLATE`: the workers' launch template, by id (`lt-...`, as template.yaml
    /// sets it) or by name. The reaper terminates only instances EC2 tagged
    /// `aws:ec2launchtemplate:id` with its id.
    pub launch_template: String,
    /// `ONOFF_SUBNETS` (optional): subnets workers launch into, comma separated, each a subnet id
    /// (its zone is looked up with `ec2:DescribeSubnets` at the first launch) or a `zone=subnet`
    /// pair; as (zone, subnet id), the zone empty when not given. Launches in a zone go to its
    /// subnet.
    pub subnets: Vec<(String, String)>,
    /// `ONOFF_SECURITY_GROUP` (optional): the workers' security group, by id. A spot launch that
    /// can be stopped goes through RunInstances (persistent spot requests:
    /// [`crate::fleet::Ec2Fleet::with_stoppable_spot`]), whose network interface into a subnet
    /// must name the group again (it replaces the launch template's).
    pub security_group: Option<String>,
    /// `ONOFF_INSTANCE_ARN_PREFIX`: `arn:<partition>:ec2:<region>:<account>:instance/`; worker
    /// rows are keyed by instance ARN.
    pub instance_arn_prefix: String,
}

/// Parse `ONOFF_SUBNETS`: `subnet-a,us-east-1b=subnet-b` -> `[("", "subnet-a"), ("us-east-1b", "subnet-b")]`.
fn subnets(raw: &str) -> Result<Vec<(String, String)>, SettingsError> {
    raw.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|entry| {
            let (zone, id) = entry.split_once('=').unwrap_or(("", entry));
            let (zone, id) = (zone.trim(), id.trim());
            if !id.starts_with("subnet-") {
                return Err(SettingsError::Malformed {
                    name: "ONOFF_SUBNETS",
                    reason: format!("{entry:?} is not a subnet id (subnet-...) or zone=subnet-..."),
                });
            }
            Ok((zone.to_string(), id.to_string()))
        })
        .collect()
}

/// Parse `a=b,c=d` pairs of the variable `name`.
fn pairs(name: &'static str, raw: &str, what: &str) -> Result<Vec<(String, String)>, SettingsError> {
    raw.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|pair| {
            pair.split_once('=')
                .map(|(a, b)| (a.trim().to_string(), b.trim().to_string()))
                .ok_or_else(|| SettingsError::Malformed {
                    name,
                    reason: format!("{pair:?} is not {what}"),
                })
        })
        .collect()
}

/// A missing or malformed setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The variable is not set (or empty).
    #[error("environment variable {0} is not set")]
    Missing(&'static str),
    /// The variable is set but malformed.
    #[error("environment variable {name} is malformed: {reason}")]
    Malformed {
        /// Variable name.
        name: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl Resources {
    /// Read from a lookup (the process environment in production, a map in tests).
    ///
    /// # Errors
    /// The first missing or malformed variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, SettingsError> {
        let need = |name: &'static str| {
            get(name)
                .filter(|v| !v.trim().is_empty())
                .ok_or(SettingsError::Missing(name))
        };
        let queue_urls = pairs("ONOFF_QUEUE_URLS", &need("ONOFF_QUEUE_URLS")?, "lane=url")?;
        let subnets = subnets(&get("ONOFF_SUBNETS").unwrap_or_default())?;
        let instance_arn_prefix = need("ONOFF_INSTANCE_ARN_PREFIX")?;
        if !(instance_arn_prefix.starts_with("arn:") && instance_arn_prefix.ends_with(":instance/")) {
            return Err(SettingsError::Malformed {
                name: "ONOFF_INSTANCE_ARN_PREFIX",
                reason: format!("{instance_arn_prefix:?} is not arn:<partition>:ec2:<region>:<account>:instance/"),
            });
        }
        Ok(Self {
            queue_urls,
            subnets,
            jobs_table: need("ONOFF_JOBS_TABLE")?,
            workers_table: need("ONOFF_WORKERS_TABLE")?,
            control_table: need("ONOFF_CONTROL_TABLE")?,
            bucket: need("ONOFF_BUCKET")?,
            launch_template: need("ONOFF_LAUNCH_TEMPLATE")?,
            security_group: get("ONOFF_SECURITY_GROUP").filter(|v| !v.trim().is_empty()),
            instance_arn_prefix,
        })
    }

    /// Read from the process environment.
    ///
    /// # Errors
    /// The first missing or malformed variable.
    pub fn from_env() -> Result<Self, SettingsError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The environment variables [`Resources::from_lookup`] reads, with these values (to configure
    /// a child process or a function run in process).
    pub fn env_pairs(&self) -> Vec<(&'static str, String)> {
        let join = |v: &[(String, String)]| {
            v.iter()
                .map(|(a, b)| if a.is_empty() { b.clone() } else { format!("{a}={b}") })
                .collect::<Vec<_>>()
                .join(",")
        };
        vec![
            ("ONOFF_QUEUE_URLS", join(&self.queue_urls)),
            ("ONOFF_JOBS_TABLE", self.jobs_table.clone()),
            ("ONOFF_WORKERS_TABLE", self.workers_table.clone()),
            ("ONOFF_CONTROL_TABLE", self.control_table.clone()),
            ("ONOFF_BUCKET", self.bucket.clone()),
            ("ONOFF_LAUNCH_TEMPLATE", self.launch_template.clone()),
            ("ONOFF_SUBNETS", join(&self.subnets)),
            ("ONOFF_SECURITY_GROUP", self.security_group.clone().unwrap_or_default()),
            ("ONOFF_INSTANCE_ARN_PREFIX", self.instance_arn_prefix.clone()),
        ]
    }

    /// Queue URL of `lane`.
    pub fn queue_url(&self, lane: &str) -> Option<&str> {
        self.queue_urls.iter().find(|(l, _)| l == lane).map(|(_, u)| u.as_str())
    }
}

/// The SDK clients, built once per process from one `SdkConfig`.
#[derive(Debug, Clone)]
pub struct Clients {
    /// SQS.
    pub sqs: aws_sdk_sqs::Client,
    /// EC2.
    pub ec2: aws_sdk_ec2::Client,
    /// DynamoDB.
    pub dynamodb: aws_sdk_dynamodb::Client,
    /// S3 (path-style addressing when an endpoint override is set, as local emulators need).
    pub s3: aws_sdk_s3::Client,
    /// STS (the agent's per-job sessions).
    pub sts: aws_sdk_sts::Client,
    /// Lambda (submit and interruption ask the scaler to run: an asynchronous invoke).
    pub lambda: aws_sdk_lambda::Client,
    /// CloudWatch Logs (the agent writes each job attempt's output to a stream of its own).
    pub logs: aws_sdk_cloudwatchlogs::Client,
}

impl Clients {
    /// Load the default AWS configuration (region, credentials, `AWS_ENDPOINT_URL`) with the SDK's
    /// standard retry mode (exponential backoff with jitter, 5 attempts) and build every client.
    pub async fn from_env() -> Self {
        let conf = aws_config::defaults(BehaviorVersion::latest())
            .retry_config(RetryConfig::standard().with_max_attempts(5))
            .load()
            .await;
        Self::from_conf(&conf)
    }

    /// Build the clients from a loaded configuration, recording calls if the environment asks
    /// for it ([`crate::record::from_env`]).
    pub fn from_conf(conf: &SdkConfig) -> Self {
        Self::from_conf_recorded(conf, crate::record::from_env())
    }

    /// Build the clients from a loaded configuration, every call recorded by `recorder` if given.
    /// With an endpoint override (an emulator), requests are held to AWS's own limits
    /// ([`crate::limits`]).
    pub fn from_conf_recorded(conf: &SdkConfig, recorder: Option<crate::record::CallRecorder>) -> Self {
        let mut s3 = aws_sdk_s3::config::Builder::from(conf).force_path_style(conf.endpoint_url().is_some());
        let mut sqs = aws_sdk_sqs::config::Builder::from(conf);
        let mut ec2 = aws_sdk_ec2::config::Builder::from(conf);
        let mut dynamodb = aws_sdk_dynamodb::config::Builder::from(conf);
        let mut sts = aws_sdk_sts::config::Builder::from(conf);
        let mut lambda = aws_sdk_lambda::config::Builder::from(conf);
        let mut logs = aws_sdk_cloudwatchlogs::config::Builder::from(conf);
        if conf.endpoint_url().is_some() {
            // An emulator: hold the requests to AWS's own limits, which it does not.
            let l = crate::limits::AwsLimits;
            (s3, sqs, ec2, sts, dynamodb) = (
                s3.interceptor(l),
                sqs.interceptor(l),
                ec2.interceptor(l)
                    .interceptor(crate::limits::OneTimeSpotStops)
                    .interceptor(crate::limits::StoppingInstances::default())
                    .interceptor(crate::limits::TerminatedInstances),
                sts.interceptor(l),
                dynamodb.interceptor(l),
            );
            // And lose the answers of applied writes, when asked to ([`crate::faults`]).
            if let Some(f) = crate::faults::from_env() {
                dynamodb = dynamodb.interceptor(f);
            }
        }
        if let Some(r) = recorder {
            logs = logs.interceptor(r.clone());
            lambda = lambda.interceptor(r.clone());
            s3 = s3.interceptor(r.clone());
            sqs = sqs.interceptor(r.clone());
            ec2 = ec2.interceptor(r.clone());
            dynamodb = dynamodb.interceptor(r.clone());
            sts = sts.interceptor(r);
        }
        Self {
            sqs: aws_sdk_sqs::Client::from_conf(sqs.build()),
            ec2: aws_sdk_ec2::Client::from_conf(ec2.build()),
            dynamodb: aws_sdk_dynamodb::Client::from_conf(dynamodb.build()),
            s3: aws_sdk_s3::Client::from_conf(s3.build()),
            sts: aws_sdk_sts::Client::from_conf(sts.build()),
            lambda: aws_sdk_lambda::Client::from_conf(lambda.build()),
            logs: aws_sdk_cloudwatchlogs::Client::from_conf(logs.build()),
        }
    }

    /// These clients, their DynamoDB writes losing answers as `f` says ([`crate::faults`]; for
    /// an emulator: `onoff local --lose-answers`).
    #[must_use]
    pub fn losing_answers(mut self, f: crate::faults::LoseAnswers) -> Self {
        self.dynamodb = aws_sdk_dynamodb::Client::from_conf(self.dynamodb.config().to_builder().interceptor(f).build());
        self
    }

    /// These clients, with EC2's vCPU quotas played on the EC2 client's CreateFleet,
    /// RunInstances and StartInstances calls ([`crate::faults::VcpuQuotas`]; an emulator
    /// enforces none).
    #[must_use]
    pub fn with_vcpu_quotas(mut self, q: crate::faults::VcpuQuotas) -> Self {
        self.ec2 = aws_sdk_ec2::Client::from_conf(self.ec2.config().to_builder().interceptor(q).build());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    const ALL: &[(&str, &str)] = &[
        ("ONOFF_QUEUE_URLS", "express=http://q/e, standard=http://q/s"),
        ("ONOFF_JOBS_TABLE", "jobs"),
        ("ONOFF_WORKERS_TABLE", "workers"),
        ("ONOFF_CONTROL_TABLE", "control"),
        ("ONOFF_BUCKET", "bucket"),
        ("ONOFF_LAUNCH_TEMPLATE", "onoff-worker"),
        (
            "ONOFF_INSTANCE_ARN_PREFIX",
            "arn:aws:ec2:us-east-1:123456789012:instance/",
        ),
    ];

    #[test]
    fn reads_every_setting() {
        let r = Resources::from_lookup(env(ALL)).unwrap();
        assert_eq!(r.queue_url("standard"), Some("http://q/s"));
        assert_eq!(r.queue_url("express"), Some("http://q/e"));
        assert_eq!(r.launch_template, "onoff-worker");
        assert!(r.subnets.is_empty());
        let mut with = ALL.to_vec();
        with.push(("ONOFF_SUBNETS", "subnet-0,us-east-1a=subnet-1,us-east-1b=subnet-2"));
        let r = Resources::from_lookup(env(&with)).unwrap();
        assert_eq!(r.subnets[0], (String::new(), "subnet-0".to_string()));
        assert_eq!(r.subnets[2], ("us-east-1b".to_string(), "subnet-2".to_string()));
        // The variables it would be configured with read back the same.
        let pairs = r.env_pairs();
        let again = Resources::from_lookup(|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn names_the_missing_or_malformed_variable() {
        let without: Vec<_> = ALL.iter().copied().filter(|(k, _)| *k != "ONOFF_BUCKET").collect();
        assert_eq!(
            Resources::from_lookup(env(&without)),
            Err(SettingsError::Missing("ONOFF_BUCKET"))
        );
        let mut bad = ALL.to_vec();
        bad[0] = ("ONOFF_QUEUE_URLS", "standard");
        let err = Resources::from_lookup(env(&bad)).unwrap_err().to_string();
        assert!(err.contains("ONOFF_QUEUE_URLS") && err.contains("lane=url"), "{err}");
        let mut bad = ALL.to_vec();
        bad.push(("ONOFF_SUBNETS", "us-east-1a"));
        let err = Resources::from_lookup(env(&bad)).unwrap_err().to_string();
        assert!(err.contains("ONOFF_SUBNETS") && err.contains("subnet id"), "{err}");
        let mut bad = ALL.to_vec();
        bad.retain(|(k, _)| *k != "ONOFF_INSTANCE_ARN_PREFIX");
        bad.push(("ONOFF_INSTANCE_ARN_PREFIX", "i-"));
        let err = Resources::from_lookup(env(&bad)).unwrap_err().to_string();
        assert!(err.contains("ONOFF_INSTANCE_ARN_PREFIX"), "{err}");
    }
}
