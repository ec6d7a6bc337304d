//! What a submission is checked against before it becomes a job, beyond its own fields: its size,
//! and whether the policy could ever run it on an offering of the catalogue.
//!
//! A job no allowed instance can run would otherwise be accepted, launch instances whose agents
//! hand it back, or wait forever; [`feasible`] rejects it at submission with the reason. It is a
//! pure function of the spec, the offerings and the policy, so the CLI can run the same check.

use onoff_policy::choice::{eligible, schedule_gpus, Request};
use onoff_policy::{Offering, PolicyConfig};

use crate::job::{JobSpec, SpecError};

/// Largest job spec accepted, bytes: 256 KiB.
///
/// A job is one DynamoDB item holding the spec as JSON, and an item is at most 400 KB (names and
/// values together); 256 KiB leaves room for the other attributes and is also SQS's own cap on a
/// message body, so both submission paths (an S3 object, a submission message) share one limit.
/// A larger input belongs in an object the spec names (`input`).
pub const MAX_SPEC_BYTES: u64 = 256 * 1024;

/// The reason a spec of `bytes` bytes is rejected, `None` when it is within [`MAX_SPEC_BYTES`].
pub fn too_large(bytes: u64) -> Option<String> {
    (bytes > MAX_SPEC_BYTES).then(|| {
        format!(
            "job spec is {bytes} bytes; the limit is {MAX_SPEC_BYTES} bytes (256 KiB): put large inputs in an \
             object and name it in the spec's `input`"
        )
    })
}

/// What a spec is checked against at submission, besides its own fields: the lanes that exist and
/// whether the policy could ever run it.
///
/// [`Admission`] is what the control plane uses. A bare list of lane names checks the spec's own
/// fields and its lane only (tests and tools that have no catalogue).
pub trait Rules {
    /// Names of the lanes that exist.
    fn lanes(&self) -> Vec<&str>;

    /// `Ok` when the job could run under these rules.
    ///
    /// # Errors
    /// [`SpecError::Invalid`] naming the field and why no allowed instance can run the job.
    fn runnable(&self, spec: &JobSpec) -> Result<(), SpecError>;
}

impl Rules for [&str] {
    fn lanes(&self) -> Vec<&str> {
        self.to_vec()
    }
    fn runnable(&self, _: &JobSpec) -> Result<(), SpecError> {
        Ok(())
    }
}

impl<const N: usize> Rules for [&str; N] {
    fn lanes(&self) -> Vec<&str> {
        self.to_vec()
    }
    fn runnable(&self, _: &JobSpec) -> Result<(), SpecError> {
        Ok(())
    }
}

/// The policy's lanes, filters and limits, and the region's offerings: a job is admitted only if
/// [`feasible`] under them.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    /// The policy.
    pub policy: &'a PolicyConfig,
    /// The offerings of the region (the catalogue, as the reconciler sees it).
    pub offerings: &'a [Offering],
}

impl Rules for Admission<'_> {
    fn lanes(&self) -> Vec<&str> {
        self.policy.lanes.iter().map(|l| l.name.as_str()).collect()
    }
    fn runnable(&self, spec: &JobSpec) -> Result<(), SpecError> {
        feasible(spec, self.offerings, self.policy)
    }
}

fn invalid(field: &'static str, problem: String) -> SpecError {
    SpecError::Invalid { field, problem }
}

/// `Ok` when some offering could ever run `spec` under `cfg`: one instance (the agent runs a job
/// on one instance) that passes every filter the policy applies when it launches for the job's
/// lane (capacity type, `offers.allowed_instance_types`, `offers.max_price_usd_per_h`,
/// `offers.max_interruption`, the GPU fit with `offers.max_gpu_oversize`, GPU memory of at least
/// the job's and `offers.min_gpu_memory_gib`), costs no more than `limits.max_usd_per_h`, and a
/// project quota that can hold the job's GPUs. Offerings that are unavailable for a while (a
/// capacity error) still count: that passes.
///
/// # Errors
/// [`SpecError::Invalid`] naming the field and the reason, e.g. `gpus: 64: the largest allowed
/// instance has 8 GPUs (p4d.24xlarge)`.
pub fn feasible(spec: &JobSpec, offerings: &[Offering], cfg: &PolicyConfig) -> Result<(), SpecError> {
    let Some(lane) = cfg.lanes.iter().find(|l| l.name == spec.lane) else {
        let names: Vec<&str> = cfg.lanes.iter().map(|l| l.name.as_str()).collect();
        return Err(invalid(
            "lane",
            format!(
                "unknown lane {}; lanes: {}",
                crate::job::quoted(&spec.lane),
                names.join(", ")
            ),
        ));
    };
    if let Some(max) = cfg.project_quota(&spec.project).max_gpus {
        if spec.gpus > max {
            return Err(invalid(
                "gpus",
                format!(
                    "{}: more than project {}'s quota of {max} GPUs (limits.projects)",
                    spec.gpus, spec.project
                ),
            ));
        }
    }
    let oc = &cfg.offers;
    let min_mem = spec.min_gpu_memory_gib.max(oc.min_gpu_memory_gib);
    // The policy's own filter, for a job of `gpus` GPUs of `mem` GiB each on one instance.
    let admits = |o: &Offering, gpus: u32, mem: f64| {
        let req = Request {
            gpus,
            min_mem_gib: mem,
            capacity: lane.capacity,
            instances: 1,
            runtime_s: oc.default_runtime_s,
        };
        eligible(o, &req, oc, &[], 0.0) && cfg.limits.max_usd_per_h.is_none_or(|cap| o.price_usd_per_h <= cap)
    };
    // Scheduled as the policy schedules it: past a size the allowed offerings lack.
    let gpus = schedule_gpus(offerings, spec.gpus, min_mem, oc);
    if offerings.iter().any(|o| admits(o, gpus, min_mem)) {
        return Ok(());
    }

    // Say why: the first constraint that no allowed offering meets.
    // Allowed: passes the filters that do not depend on the job (a job that fits it exactly).
    let allowed: Vec<&Offering> = offerings.iter().filter(|o| admits(o, o.gpus, 0.0)).collect();
    let Some(largest) = allowed
        .iter()
        .max_by(|a, b| a.gpus.cmp(&b.gpus).then(a.gpu_memory_gib.total_cmp(&b.gpu_memory_gib)))
    else {
        return Err(invalid(
            "lane",
            format!(
                "{:?}: no instance type of the catalogue passes the policy's filters for this lane (capacity {:?}, \
                 offers.allowed_instance_types, offers.max_price_usd_per_h, offers.max_interruption, \
                 limits.max_usd_per_h)",
                spec.lane, lane.capacity
            ),
        ));
    };
    if spec.gpus > largest.gpus {
        return Err(invalid(
            "gpus",
            format!(
                "{}: the largest allowed instance has {} GPUs ({})",
                spec.gpus, largest.gpus, largest.key.instance_type
            ),
        ));
    }
    let roomiest = allowed
        .iter()
        .filter(|o| o.gpus >= spec.gpus)
        .max_by(|a, b| a.gpu_memory_gib.total_cmp(&b.gpu_memory_gib))
        .expect("the largest has enough GPUs");
    if roomiest.gpu_memory_gib + 1e-9 < min_mem {
        let asked = if spec.min_gpu_memory_gib >= oc.min_gpu_memory_gib {
            format!("{} GiB per GPU", spec.min_gpu_memory_gib)
        } else {
            format!(
                "the policy's offers.min_gpu_memory_gib, {} GiB per GPU,",
                oc.min_gpu_memory_gib
            )
        };
        return Err(invalid(
            "min_gpu_memory_gib",
            format!(
                "{asked} is more than any allowed instance with {} GPU(s) or more has: at most {} GiB ({})",
                spec.gpus, roomiest.gpu_memory_gib, roomiest.key.instance_type
            ),
        ));
    }
    // Enough GPUs and memory exist, only on instances bigger than the fit rule lets this job use.
    let limit = gpus.max(1).next_power_of_two().saturating_mul(oc.max_gpu_oversize);
    let smallest = allowed
        .iter()
        .filter(|o| o.gpus >= spec.gpus && o.gpu_memory_gib + 1e-9 >= min_mem)
        .min_by_key(|o| o.gpus)
        .expect("the roomiest fits");
    Err(invalid(
        "gpus",
        format!(
            "{}: a {}-GPU job may use an instance of at most {limit} GPUs (offers.max_gpu_oversize {}), and the \
             smallest allowed instance with {min_mem} GiB per GPU has {} ({})",
            spec.gpus, spec.gpus, oc.max_gpu_oversize, smallest.gpus, smallest.key.instance_type
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{load_offerings, CatalogOptions};

    fn us_east_1() -> Vec<Offering> {
        load_offerings(
            include_str!("../../../data/catalog/gpu_instance_specs.csv"),
            include_str!("../../../data/catalog/prices-us-east-1.csv"),
            Some(include_str!("../../../data/catalog/spot-advisor-gpu.csv")),
            &CatalogOptions::for_region("us-east-1"),
        )
        .unwrap()
    }

    fn spec(extra: &str) -> JobSpec {
        let text = format!(r#"{{"image":"i","command":["x"],"project":"p"{extra}}}"#);
        JobSpec::parse(&text, &["express", "standard"], 0.0).unwrap()
    }

    fn reason(spec: &JobSpec, cfg: &PolicyConfig) -> String {
        feasible(spec, &us_east_1(), cfg).unwrap_err().to_string()
    }

    #[test]
    fn ordinary_jobs_are_feasible_under_the_default_policy() {
        let cfg = PolicyConfig::default();
        for extra in [
            "",
            r#","gpus":3"#,
            r#","gpus":8,"min_gpu_memory_gib":80"#,
            r#","lane":"express","gpus":4"#,
        ] {
            assert_eq!(feasible(&spec(extra), &us_east_1(), &cfg), Ok(()), "{extra}");
        }
    }

    #[test]
    fn more_gpus_than_the_largest_allowed_instance_is_rejected() {
        let r = reason(&spec(r#","gpus":64"#), &PolicyConfig::default());
        assert!(
            r.contains("field gpus: 64: the largest allowed instance has 8 GPUs"),
            "{r}"
        );
        // The largest *allowed*: with only 4-GPU types allowed, 8 GPUs is too many.
        let mut cfg = PolicyConfig::default();
        cfg.offers.allowed_instance_types = vec!["g5.xlarge".into(), "g5.12xlarge".into()];
        let r = reason(&spec(r#","gpus":8"#), &cfg);
        assert!(
            r.contains("8: the largest allowed instance has 4 GPUs (g5.12xlarge)"),
            "{r}"
        );
    }

    #[test]
    fn more_gpu_memory_than_any_allowed_instance_has_is_rejected() {
        let r = reason(&spec(r#","min_gpu_memory_gib":500"#), &PolicyConfig::default());
        assert!(
            r.contains("field min_gpu_memory_gib: 500 GiB per GPU is more than any allowed instance"),
            "{r}"
        );
        // The policy's own minimum counts too, and the reason says it was the policy's.
        let mut cfg = PolicyConfig::default();
        cfg.offers.allowed_instance_types = vec!["g4dn.xlarge".into()];
        cfg.offers.min_gpu_memory_gib = 24.0;
        let r = reason(&spec(""), &cfg);
        assert!(
            r.contains("offers.min_gpu_memory_gib, 24 GiB per GPU, is more than") && r.contains("16 GiB (g4dn.xlarge)"),
            "{r}"
        );
    }

    #[test]
    fn a_size_the_allowed_types_lack_is_looked_past_and_unknown_types_are_rejected() {
        // Only 8-GPU instances allowed: a 1-GPU job runs on one rather than never.
        let mut cfg = PolicyConfig::default();
        cfg.offers.allowed_instance_types = vec!["p4d.24xlarge".into()];
        assert_eq!(feasible(&spec(""), &us_east_1(), &cfg), Ok(()));
        // The default x86_64 catalogue has no 2-GPU type the policy allows (g3.8xlarge's M60s
        // have less memory than offers.min_gpu_memory_gib): a 2-GPU job goes to a 4-GPU one.
        let cfg = PolicyConfig::default();
        let mem = cfg.offers.min_gpu_memory_gib;
        assert_eq!(schedule_gpus(&us_east_1(), 2, mem, &cfg.offers), 4);
        assert_eq!(feasible(&spec(r#","gpus":2"#), &us_east_1(), &cfg), Ok(()));
        // Allowed types the catalogue does not have: nothing passes at all.
        let mut cfg = PolicyConfig::default();
        cfg.offers.allowed_instance_types = vec!["x9.huge".into()];
        let r = reason(&spec(""), &cfg);
        assert!(
            r.contains("field lane: \"standard\": no instance type of the catalogue passes"),
            "{r}"
        );
    }

    #[test]
    fn price_budget_capacity_and_quota_limits_count() {
        // A price cap below every 8-GPU offering (the cheapest, g4dn.metal on spot, is $2.83/h).
        let mut cfg = PolicyConfig::default();
        cfg.offers.max_price_usd_per_h = Some(2.5);
        assert!(reason(&spec(r#","gpus":8"#), &cfg).contains("the largest allowed instance has 4 GPUs"));
        // The budget breaker never lets a launch above it happen.
        let mut cfg = PolicyConfig::default();
        cfg.limits.max_usd_per_h = Some(2.5);
        assert!(reason(&spec(r#","gpus":8"#), &cfg).contains("the largest allowed instance has 4 GPUs"));
        // A project quota below the job's GPUs.
        let mut cfg = PolicyConfig::default();
        cfg.limits.projects.insert(
            "p".into(),
            onoff_policy::ProjectQuota {
                max_gpus: Some(2),
                weight: 1.0,
            },
        );
        assert!(reason(&spec(r#","gpus":4"#), &cfg).contains("more than project p's quota of 2 GPUs"));
        // An unknown lane (the spec was parsed against other lanes).
        let mut cfg = PolicyConfig::default();
        cfg.lanes.truncate(1);
        assert!(reason(&spec(""), &cfg).contains("unknown lane \"standard\"; lanes: express"));
    }
}
