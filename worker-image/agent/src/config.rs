//! The agent's settings, read once from the environment (table in `worker-image/README.md`).

use std::path::PathBuf;

/// What idle exit does to the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// TerminateInstances on itself, then `shutdown -h now` as the fallback (the launch template
    /// sets instance-initiated shutdown = terminate).
    Terminate,
    /// TerminateInstances on itself, no fallback (local runs against an emulator: never power off
    /// the machine the agent runs on).
    ApiOnly,
    /// Only exit the process (tests).
    None,
}

/// Agent settings. Durations in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// `ONOFF_LANES`: lanes to poll, preferred first; empty = the worker's lane from its workers-table
    /// row (`standard` when it has none).
    pub lanes: Vec<String>,
    /// `ONOFF_IDLE_TIMEOUT_S` (600): seconds with no job before the agent terminates its instance.
    pub idle_timeout_s: f64,
    /// `ONOFF_HEARTBEAT_S` (60): heartbeat period (the reaper's timeout is 300 s).
    pub heartbeat_s: f64,
    /// `ONOFF_LEASE_S` (300): job lease, renewed every third of it. The control plane's reaper
    /// re-sends a wake-up message for a pending job with none for 600 s (its own `resend_after_s`,
    /// two of these default leases; it does not read this variable).
    pub lease_s: f64,
    /// `ONOFF_NOTICE_GRACE_S` (90): seconds between SIGTERM and SIGKILL after a notice (AWS gives
    /// 120 s between the spot interruption notice and the reclaim).
    pub notice_grace_s: f64,
    /// `ONOFF_IMDS_POLL_S` (5): IMDS polling period for notices.
    pub imds_poll_s: f64,
    /// `ONOFF_POLL_WAIT_S` (10): SQS long-poll wait when idle, at most 20.
    pub poll_wait_s: f64,
    /// `ONOFF_RETRY_DELAY_S` (30): delay of the fresh wake-up message after a failed attempt or a
    /// hand-back, before the job is tried again (SQS caps delays at 900 s).
    pub retry_delay_s: f64,
    /// `ONOFF_MAX_HAND_BACKS` (100): hand-backs to a bigger worker before the job is FAILED
    /// ([`onoff_control::job::RerunLimits`]).
    pub rerun_limits: onoff_control::job::RerunLimits,
    /// `ONOFF_SHUTDOWN` (`terminate`).
    pub shutdown: ShutdownMode,
    /// `ONOFF_WORK_DIR` (`/var/lib/onoff`).
    pub work_dir: PathBuf,
    /// `ONOFF_WORKER_IMAGE`: when set, jobs for another image are failed with a reason.
    pub worker_image: Option<String>,
    /// `ONOFF_TIME_SCALE` (1): job seconds per wall second (local replay only).
    pub time_scale: f64,
    /// `ONOFF_DEPLOYMENT` (`onoff`): metric dimension, and the `onoff:managed` tag of the
    /// persistent spot request the agent cancels before its instance ends.
    pub deployment: String,
    /// `ONOFF_GPUS`: GPUs of this instance (the user data counts the `GPU` lines of `nvidia-smi -L`). A job that asks
    /// for more is handed back to its lane for a bigger worker instead of run here. Unset: no
    /// check.
    pub gpus: Option<u32>,
    /// `ONOFF_JOB_UID` and `ONOFF_JOB_GID` (default: the UID): the user jobs run as, another than
    /// the agent's, so a job can neither read the agent's credentials nor, with the host's
    /// firewall rule (template.yaml's user data), reach the instance metadata service. Needs the
    /// agent to run as root. Unset: jobs run as the agent's user.
    pub job_user: Option<(u32, u32)>,
    /// `ONOFF_CACHE_GIB` ([`crate::cache::DEFAULT_CACHE_GIB`], 20): bound of the project cache
    /// the jobs get as `ONOFF_CACHE_DIR`, kept on this worker between jobs and through stops,
    /// GiB; 0: no cache ([`crate::cache`]).
    pub cache_gib: f64,
    /// `ONOFF_POLICY` (the functions' policy TOML; default `PolicyConfig::default()`): the agent
    /// reads only the deadline rule's figures (`offers.boot_estimate_s`,
    /// `offers.checkpoint_interval_s`, `limits.deadline_margin_s`): a spot worker hands back a
    /// job whose deadline they put at risk on spot (`onoff_policy::deadline::keeps_off_spot`);
    /// and, on an on-demand worker of a spot-first lane, `scale_down.wait_value_usd_per_h`,
    /// `offers.boot_estimate_s`: it hands back a job whose premium there is worth more than the
    /// wait for spot (`onoff_policy::choice::worth_an_on_demand_worker`). Both rules count a job
    /// that declares no run time as the estimate its worker's row holds
    /// (`WorkerRecord::run_time_estimate_s`), else as `offers.default_runtime_s`.
    /// The template's user data sets the wait value only, as one dotted TOML line.
    pub policy: onoff_policy::PolicyConfig,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            lanes: Vec::new(),
            idle_timeout_s: 600.0,
            heartbeat_s: 60.0,
            lease_s: 300.0,
            notice_grace_s: 90.0,
            imds_poll_s: 5.0,
            poll_wait_s: 10.0,
            retry_delay_s: 30.0,
            rerun_limits: onoff_control::job::RerunLimits::default(),
            shutdown: ShutdownMode::Terminate,
            work_dir: PathBuf::from("/var/lib/onoff"),
            worker_image: None,
            time_scale: 1.0,
            deployment: "onoff".into(),
            gpus: None,
            job_user: None,
            cache_gib: crate::cache::DEFAULT_CACHE_GIB,
            policy: onoff_policy::PolicyConfig::default(),
        }
    }
}

/// A malformed setting, naming the variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {name}: {problem}")]
pub struct ConfigError {
    /// The variable.
    pub name: &'static str,
    /// What is wrong.
    pub problem: String,
}

impl AgentConfig {
    /// Read from a lookup (the environment, or a map in tests); unset variables keep defaults.
    ///
    /// # Errors
    /// A variable that does not parse or is out of range.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = Self::default();
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let secs = |name: &'static str, default: f64, min: f64| -> Result<f64, ConfigError> {
            match get(name) {
                None => Ok(default),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= min => Ok(x),
                    _ => Err(ConfigError {
                        name,
                        problem: format!("{v:?} is not a number >= {min}"),
                    }),
                },
            }
        };
        if let Some(l) = get("ONOFF_LANES") {
            c.lanes = l
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
        }
        c.idle_timeout_s = secs("ONOFF_IDLE_TIMEOUT_S", c.idle_timeout_s, 1.0)?;
        c.heartbeat_s = secs("ONOFF_HEARTBEAT_S", c.heartbeat_s, 0.1)?;
        c.lease_s = secs("ONOFF_LEASE_S", c.lease_s, 3.0)?;
        if c.lease_s > 43_200.0 {
            // A received message stays hidden for one lease: SQS's longest visibility timeout
            // is 12 hours (SQS Developer Guide, "Visibility timeout").
            return Err(ConfigError {
                name: "ONOFF_LEASE_S",
                problem: format!("{} s is over SQS's longest visibility timeout, 43,200 s", c.lease_s),
            });
        }
        c.notice_grace_s = secs("ONOFF_NOTICE_GRACE_S", c.notice_grace_s, 0.0)?;
        c.imds_poll_s = secs("ONOFF_IMDS_POLL_S", c.imds_poll_s, 0.1)?;
        c.poll_wait_s = secs("ONOFF_POLL_WAIT_S", c.poll_wait_s, 0.0)?.min(20.0);
        c.retry_delay_s = secs("ONOFF_RETRY_DELAY_S", c.retry_delay_s, 0.0)?;
        if c.retry_delay_s > 900.0 {
            return Err(ConfigError {
                name: "ONOFF_RETRY_DELAY_S",
                problem: format!("{} s is over SQS's longest message delay, 900 s", c.retry_delay_s),
            });
        }
        c.rerun_limits.max_hand_backs =
            secs("ONOFF_MAX_HAND_BACKS", f64::from(c.rerun_limits.max_hand_backs), 1.0)? as u32;
        c.time_scale = secs("ONOFF_TIME_SCALE", c.time_scale, 1e-3)?;
        c.cache_gib = secs("ONOFF_CACHE_GIB", c.cache_gib, 0.0)?;
        c.shutdown = match get("ONOFF_SHUTDOWN").as_deref().map(str::trim) {
            None | Some("terminate") => ShutdownMode::Terminate,
            Some("api-only") => ShutdownMode::ApiOnly,
            Some("none") => ShutdownMode::None,
            Some(other) => {
                return Err(ConfigError {
                    name: "ONOFF_SHUTDOWN",
                    problem: format!("{other:?} is not `terminate`, `api-only` or `none`"),
                })
            }
        };
        if let Some(d) = get("ONOFF_WORK_DIR") {
            c.work_dir = PathBuf::from(d);
        }
        c.worker_image = get("ONOFF_WORKER_IMAGE");
        if let Some(d) = get("ONOFF_DEPLOYMENT") {
            c.deployment = d;
        }
        if let Some(g) = get("ONOFF_GPUS") {
            c.gpus = Some(g.trim().parse::<u32>().map_err(|_| ConfigError {
                name: "ONOFF_GPUS",
                problem: format!("{g:?} is not a whole number of GPUs"),
            })?);
        }
        let id = |name: &'static str, v: String| {
            v.trim().parse::<u32>().map_err(|_| ConfigError {
                name,
                problem: format!("{v:?} is not a numeric user or group id"),
            })
        };
        if let Some(uid) = get("ONOFF_JOB_UID") {
            let uid = id("ONOFF_JOB_UID", uid)?;
            let gid = match get("ONOFF_JOB_GID") {
                Some(g) => id("ONOFF_JOB_GID", g)?,
                None => uid,
            };
            if uid == 0 {
                return Err(ConfigError {
                    name: "ONOFF_JOB_UID",
                    problem: "jobs must not run as root (0)".into(),
                });
            }
            c.job_user = Some((uid, gid));
        }
        if let Some(t) = get("ONOFF_POLICY") {
            c.policy = onoff_policy::PolicyConfig::from_toml_str(&t).map_err(|e| ConfigError {
                name: "ONOFF_POLICY",
                problem: e.to_string(),
            })?;
        }
        if c.notice_grace_s >= 120.0 {
            return Err(ConfigError {
                name: "ONOFF_NOTICE_GRACE_S",
                problem: "must be under the 120 s a spot interruption notice gives".into(),
            });
        }
        Ok(c)
    }

    /// Path of the health file (`<work_dir>/health.json`).
    pub fn health_file(&self) -> PathBuf {
        self.work_dir.join("health.json")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides_and_errors_name_the_variable() {
        let c = AgentConfig::from_lookup(|_| None).unwrap();
        assert_eq!(c, AgentConfig::default());
        let vars = [
            ("ONOFF_LANES", "express, standard"),
            ("ONOFF_IDLE_TIMEOUT_S", "20"),
            ("ONOFF_SHUTDOWN", "none"),
            ("ONOFF_POLL_WAIT_S", "60"),
            ("ONOFF_GPUS", "8"),
        ];
        let c = AgentConfig::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap();
        assert_eq!(c.lanes, vec!["express", "standard"]);
        assert_eq!(
            (c.idle_timeout_s, c.shutdown, c.poll_wait_s),
            (20.0, ShutdownMode::None, 20.0)
        );
        assert_eq!(c.gpus, Some(8));
        assert_eq!(c.cache_gib, 20.0);
        let c = AgentConfig::from_lookup(|k| (k == "ONOFF_CACHE_GIB").then(|| "0".to_string())).unwrap();
        assert_eq!(c.cache_gib, 0.0);
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_CACHE_GIB").then(|| "-1".to_string())).unwrap_err();
        assert_eq!(bad.name, "ONOFF_CACHE_GIB");
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_GPUS").then(|| "eight".to_string())).unwrap_err();
        assert_eq!(bad.name, "ONOFF_GPUS");
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_LEASE_S").then(|| "soon".to_string())).unwrap_err();
        assert_eq!(bad.name, "ONOFF_LEASE_S");
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_LEASE_S").then(|| "43201".to_string())).unwrap_err();
        assert!(bad.to_string().contains("43,200"), "{bad}");
        assert!(AgentConfig::from_lookup(|k| (k == "ONOFF_LEASE_S").then(|| "43200".to_string())).is_ok());
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_NOTICE_GRACE_S").then(|| "150".to_string())).unwrap_err();
        assert!(bad.to_string().contains("120 s"), "{bad}");
        let c = AgentConfig::from_lookup(|k| (k == "ONOFF_JOB_UID").then(|| "10002".to_string())).unwrap();
        assert_eq!(c.job_user, Some((10002, 10002)));
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_JOB_UID").then(|| "0".to_string())).unwrap_err();
        assert_eq!(bad.name, "ONOFF_JOB_UID");
        let c = AgentConfig::from_lookup(|k| {
            (k == "ONOFF_POLICY").then(|| "[offers]\nboot_estimate_s = 200.0\n".to_string())
        })
        .unwrap();
        assert_eq!(c.policy.offers.boot_estimate_s, 200.0);
        // The template's user data: one line (an env file has no newlines), the rest defaults.
        let c = AgentConfig::from_lookup(|k| {
            (k == "ONOFF_POLICY").then(|| "scale_down.wait_value_usd_per_h = 2.5".to_string())
        })
        .unwrap();
        assert_eq!(c.policy.scale_down.wait_value_usd_per_h, 2.5);
        assert_eq!(c.policy.offers.boot_estimate_s, 390.0);
        let bad = AgentConfig::from_lookup(|k| (k == "ONOFF_POLICY").then(|| "[offers\n".to_string())).unwrap_err();
        assert_eq!(bad.name, "ONOFF_POLICY");
    }
}
