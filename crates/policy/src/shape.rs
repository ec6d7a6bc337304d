//! The GPU fit rule: which worker shapes may serve which job shapes. A leaf module: the choice of
//! offerings and the arrival statistics both use it, neither through the other.

/// True when a worker with `worker_gpus` GPUs of `worker_mem_gib` each may run a job asking for
/// `job_gpus` GPUs per instance with at least `min_mem_gib` per GPU: enough GPUs and memory, and
/// not more than `max_oversize` times the GPUs asked for rounded up to a power of two (with the
/// default 1: a 1-GPU job runs on 1-GPU instances, a 3-GPU job on 4-GPU ones). Paying for GPUs a
/// long job leaves unused costs more than waiting for a fitting worker.
#[must_use]
pub fn fits(worker_gpus: u32, worker_mem_gib: f64, job_gpus: u32, min_mem_gib: f64, max_oversize: u32) -> bool {
    gpu_bounds(job_gpus, max_oversize).contains(&worker_gpus) && worker_mem_gib + 1e-9 >= min_mem_gib
}

/// GPUs per worker [`fits`] allows for a job asking for `job_gpus` per instance: from `job_gpus`
/// to `max_oversize` times it rounded up to a power of two (empty when `max_oversize` is 0).
#[must_use]
pub fn gpu_bounds(job_gpus: u32, max_oversize: u32) -> std::ops::RangeInclusive<u32> {
    job_gpus..=job_gpus.max(1).next_power_of_two().saturating_mul(max_oversize)
}

/// Split a job of `gpus` GPUs over instances: up to `max_gpus_per_instance` run on one instance,
/// larger jobs on `ceil(gpus / max)` instances of `max` GPUs each (0 GPUs counts as 1). Returns
/// (GPUs per instance, instances).
#[must_use]
pub fn job_shape(gpus: u32, max_gpus_per_instance: u32) -> (u32, u32) {
    let g = gpus.max(1);
    let max = max_gpus_per_instance.max(1);
    if g <= max {
        (g, 1)
    } else {
        (max, g.div_ceil(max))
    }
}

#[cfg(test)]
mod tests {
    use super::{fits, job_shape};

    #[test]
    fn jobs_split_over_instances_of_at_most_the_largest_size() {
        assert_eq!(job_shape(0, 8), (1, 1));
        assert_eq!(job_shape(3, 8), (3, 1));
        assert_eq!(job_shape(8, 8), (8, 1));
        assert_eq!(job_shape(12, 8), (8, 2));
        assert_eq!(job_shape(128, 8), (8, 16));
    }

    #[test]
    fn a_job_fits_workers_with_enough_gpus_memory_and_not_too_many_gpus() {
        assert!(fits(1, 24.0, 1, 16.0, 1));
        assert!(!fits(1, 12.0, 1, 16.0, 1), "too little memory");
        assert!(!fits(2, 24.0, 1, 0.0, 1), "twice the GPUs a 1-GPU job asks for");
        assert!(fits(2, 24.0, 1, 0.0, 2), "allowed with max_oversize 2");
        assert!(fits(4, 24.0, 3, 0.0, 1), "3 GPUs round up to 4");
        assert!(!fits(8, 24.0, 3, 0.0, 1));
        assert!(!fits(2, 24.0, 4, 0.0, 4), "too few GPUs whatever the oversize");
    }
}
