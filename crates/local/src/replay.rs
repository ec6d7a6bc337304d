//! Trace jobs as job specs: each Philly job becomes a run of the example workload whose length is
//! the job's duration compressed like the arrivals (and cut to `max_job_s`).

use onoff_control::job::job_id_for;
use onoff_sim::{AzureModel, Trace, TraceFormat};

use crate::LocalOptions;

/// One job to submit.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayJob {
    /// Name (the S3 key is `jobs/<name>.json`).
    pub name: String,
    /// The job id submit will give it (from its client token).
    pub job_id: String,
    /// Wall seconds after the start when it is submitted.
    pub at_s: f64,
    /// Wall seconds it should run.
    pub run_s: f64,
    /// The job spec.
    pub spec: serde_json::Value,
    /// Its lane (the spec's `lane`).
    pub lane: String,
}

/// The jobs of the replay, in arrival order, spread over `lanes` in turn (the i-th job in
/// `lanes[i % lanes.len()]`: a Philly job names no lane).
///
/// # Errors
/// The trace cannot be read, is not a Philly trace, or has no jobs in the window; `lanes` is
/// empty.
pub fn plan(opts: &LocalOptions, lanes: &[String]) -> anyhow::Result<Vec<ReplayJob>> {
    anyhow::ensure!(!lanes.is_empty(), "no lane to replay the jobs into");
    anyhow::ensure!(opts.compress > 0.0, "--compress must be > 0");
    anyhow::ensure!(opts.item_ms > 0.0, "--item-ms must be > 0");
    let trace = Trace::load(&opts.trace, AzureModel::default())?;
    anyhow::ensure!(
        trace.format == TraceFormat::Philly,
        "{} is not a Philly trace (timestamp,duration,num_gpus,gpu_time,cluster)",
        opts.trace.display()
    );
    let jobs: Vec<_> = trace.jobs.iter().skip(opts.skip).take(opts.jobs).collect();
    anyhow::ensure!(
        !jobs.is_empty(),
        "no jobs in {} after skipping {}",
        opts.trace.display(),
        opts.skip
    );
    let first = jobs[0].arrival_s;
    let workload = std::fs::canonicalize(&opts.workload).unwrap_or_else(|_| opts.workload.clone());
    Ok(jobs
        .iter()
        .enumerate()
        .map(|(i, j)| {
            let lane = &lanes[i % lanes.len()];
            let run_s = (j.duration_s / opts.compress).min(opts.max_job_s);
            let items = ((run_s * 1000.0 / opts.item_ms).round() as u64).max(2);
            let token = format!("philly-{}", j.id);
            let spec = serde_json::json!({
                "image": crate::iam::LOCAL_IMAGE,
                "command": [
                    opts.python, workload.display().to_string(),
                    "--items", items.to_string(), "--seed", j.id.to_string(), "--size", "16",
                    "--checkpoint-every", "2", "--min-item-ms", opts.item_ms.to_string(), "--model-mb", "1",
                ],
                "gpus": j.gpus.min(8),
                "lane": lane,
                "project": j.project,
                "max_attempts": 3,
                "checkpoint_interval_s": 60.0,
                "est_runtime_s": run_s.max(1.0),
                "client_token": token,
            });
            ReplayJob {
                name: format!("philly-{:05}", j.id),
                job_id: job_id_for(&onoff_control::submit::token_key(&token, &j.project)),
                at_s: (j.arrival_s - first) / opts.compress,
                run_s,
                spec,
                lane: lane.clone(),
            }
        })
        .collect())
}
