//! `onoff`: the command line. `onoff simulate` replays a GPU job trace through onoff's policy and
//! the baselines, side by side; `onoff local` runs the whole system on this machine against moto
//! server (control plane in process, a real agent process per instance, a slice of the real trace).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use onoff_control::catalog::{load_offerings_from_dir, CatalogOptions};
use onoff_policy::PolicyConfig;
use onoff_sim::{compare, AzureModel, Comparison, SimConfig, Trace, TraceFormat, STRATEGIES};

#[cfg(feature = "local")]
mod local;
#[cfg(feature = "local")]
mod ops;
mod plot;

/// Repository data folder (shipped trace slices and the catalogue), as built.
const DATA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data");

#[derive(Parser)]
#[command(name = "onoff", version, about = "On-off scaling for GPU batch work on AWS", long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay a job trace through onoff's policy and the baselines; print cost and waits side by side.
    Simulate(SimulateArgs),
    /// Run the whole system on this machine against moto server: replay a slice of the Philly
    /// trace as real jobs, with a real agent process per launched instance, spot notices and
    /// worker kills injected; print what it cost and whether every job finished exactly once.
    #[cfg(feature = "local")]
    Local(local::LocalArgs),
    /// Submit a job (a spec file and/or flags, command after `--`); prints its id.
    #[cfg(feature = "local")]
    Submit(ops::SubmitArgs),
    /// List jobs: id, name, project, lane, state, attempts, instance type, wait, run time, cost.
    #[cfg(feature = "local")]
    Jobs(ops::JobsArgs),
    /// One job in full, with its attempts.
    #[cfg(feature = "local")]
    Status(ops::StatusArgs),
    /// A job's own output (one log stream per attempt).
    #[cfg(feature = "local")]
    Logs(ops::LogsArgs),
    /// Cancel a job: at once if it waits, within a lease renewal if it runs.
    #[cfg(feature = "local")]
    Cancel(ops::CancelArgs),
    /// Download what a job wrote to its ONOFF_OUTPUT_DIR.
    #[cfg(feature = "local")]
    Outputs(ops::OutputsArgs),
    /// $ and GPU-hours per job, project or day; spot share, savings, idle workers.
    #[cfg(feature = "local")]
    Cost(ops::CostArgs),
}

#[derive(clap::Args)]
struct SimulateArgs {
    /// Trace CSV (Philly `timestamp,duration,num_gpus,gpu_time,cluster` or Azure
    /// `TIMESTAMP,ContextTokens,GeneratedTokens`). Default: the shipped busy week of Philly.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Policy config (TOML, see docs/policy.md). Default: the built-in defaults with max workers
    /// raised to 4096 so the fleet, not a cap, is what is measured.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Catalogue folder (gpu_instance_specs.csv, prices-*.csv, spot-advisor-gpu.csv).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/catalog"))]
    catalog: PathBuf,
    /// AWS region whose prices are used.
    #[arg(long, default_value = "us-east-1")]
    region: String,
    /// CPU architecture of the workers' AMI: `x86_64`, `arm64`, or `any` (both). A deployment
    /// offers only its AMI's types (`ONOFF_ARCH`, default x86_64); `any`, the default here, is
    /// how the README's figures were measured (us-east-1's only 2-GPU NVIDIA type, g5g, is arm64).
    #[arg(long, default_value = "any")]
    arch: String,
    /// Strategies to run, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "onoff,always-on,min-one-warm,fixed-idle-10m,keda-like"
    )]
    policies: Vec<String>,
    /// RNG seed (boot times, capacity errors, interruptions).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Shortest GPU cold start, seconds (boot times are uniform between min and max).
    #[arg(long, default_value_t = 180.0)]
    boot_min_s: f64,
    /// Longest GPU cold start, seconds.
    #[arg(long, default_value_t = 600.0)]
    boot_max_s: f64,
    /// Probability that a launch call fails with InsufficientCapacity.
    #[arg(long, default_value_t = 0.02)]
    capacity_error_rate: f64,
    /// Multiplier on the Spot Advisor interruption rates (0 disables interruptions).
    #[arg(long, default_value_t = 1.0)]
    interruption_rate_factor: f64,
    /// Jobs checkpoint every this many seconds.
    #[arg(long, default_value_t = 600.0)]
    checkpoint_interval_s: f64,
    /// Jobs also checkpoint on the 2-minute notice (an interruption then loses no work).
    #[arg(long)]
    checkpoint_on_notice: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Write comparison.json, a per-minute timeline CSV per policy and timeline.svg here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Simulate(a) => simulate(a),
        #[cfg(feature = "local")]
        Cmd::Local(a) => local::run(a),
        #[cfg(feature = "local")]
        Cmd::Submit(a) => block_on(ops::submit(a)),
        #[cfg(feature = "local")]
        Cmd::Jobs(a) => block_on(ops::jobs(a)),
        #[cfg(feature = "local")]
        Cmd::Status(a) => block_on(ops::status(a)),
        #[cfg(feature = "local")]
        Cmd::Logs(a) => block_on(ops::logs(a)),
        #[cfg(feature = "local")]
        Cmd::Cancel(a) => block_on(ops::cancel(a)),
        #[cfg(feature = "local")]
        Cmd::Outputs(a) => block_on(ops::outputs(a)),
        #[cfg(feature = "local")]
        Cmd::Cost(a) => block_on(ops::cost(a)),
    }
}

/// Run an operator verb on a runtime of its own.
#[cfg(feature = "local")]
fn block_on(f: impl std::future::Future<Output = Result<()>>) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(f)
}

fn load_config(path: Option<&Path>, format: TraceFormat) -> Result<PolicyConfig> {
    if let Some(p) = path {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading policy config {}", p.display()))?;
        return PolicyConfig::from_toml_str(&text).with_context(|| format!("in {}", p.display()));
    }
    let mut cfg = PolicyConfig::default();
    cfg.limits.max_workers_total = 4096;
    for l in &mut cfg.lanes {
        l.max_workers = 4096;
    }
    if format == TraceFormat::Azure {
        // The Azure items' run time is defined on an L40S (48 GiB): only such GPUs serve them.
        cfg.offers.min_gpu_memory_gib = 48.0;
    }
    Ok(cfg)
}

fn simulate(a: SimulateArgs) -> Result<()> {
    let trace_path = a
        .trace
        .clone()
        .unwrap_or_else(|| Path::new(DATA_DIR).join("philly/philly-busy-week.csv"));
    let trace = Trace::load(&trace_path, AzureModel::default())?;
    let cfg = load_config(a.config.as_deref(), trace.format)?;
    let catalog_opts = CatalogOptions {
        arch: match a.arch.as_str() {
            "any" => None,
            other => Some(other.parse().map_err(|e: String| anyhow::anyhow!("--arch: {e}"))?),
        },
        ..CatalogOptions::for_region(&a.region)
    };
    let offerings = load_offerings_from_dir(&a.catalog, &catalog_opts)
        .with_context(|| format!("loading the catalogue from {}", a.catalog.display()))?;
    for p in &a.policies {
        if !STRATEGIES.contains(&p.as_str()) {
            bail!("unknown policy {p:?}; choose from {}", STRATEGIES.join(", "));
        }
    }
    if !(a.boot_min_s >= 0.0 && a.boot_max_s >= a.boot_min_s) {
        bail!("--boot-min-s must be >= 0 and <= --boot-max-s");
    }
    if !(0.0..=1.0).contains(&a.capacity_error_rate) {
        bail!("--capacity-error-rate must be within 0..=1");
    }
    let sim = SimConfig {
        seed: a.seed,
        boot_min_s: a.boot_min_s,
        boot_max_s: a.boot_max_s,
        capacity_error_rate: a.capacity_error_rate,
        interruptions: a.interruption_rate_factor > 0.0,
        interruption_rate_factor: a.interruption_rate_factor,
        checkpoint_interval_s: a.checkpoint_interval_s,
        checkpoint_on_notice: a.checkpoint_on_notice,
        timeline: a.out.is_some(),
        ..SimConfig::default()
    };
    let names: Vec<&str> = a.policies.iter().map(String::as_str).collect();
    let label = trace_path
        .file_name()
        .map_or_else(|| trace_path.display().to_string(), |n| n.to_string_lossy().into());
    let bar = if a.quiet || a.json {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new((names.len() * 100) as u64);
        b.set_style(
            ProgressStyle::with_template("{spinner} {msg:>16} [{bar:40}] {pos}/{len} % {elapsed}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b
    };
    let started = std::time::Instant::now();
    let cmp = compare(&label, &trace, &offerings, &cfg, &sim, &names, &mut |i, p| {
        bar.set_message(names[i].to_string());
        bar.set_position((i * 100) as u64 + (p * 100.0) as u64);
    })
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&cmp)?);
    } else {
        print_table(&cmp);
        eprintln!(
            "({} jobs x {} policies in {:.1} s)",
            cmp.jobs,
            names.len(),
            started.elapsed().as_secs_f64()
        );
    }
    if let Some(dir) = &a.out {
        write_out(dir, &cmp)?;
        if !a.json {
            println!("wrote {}/comparison.json, timeline-*.csv, timeline.svg", dir.display());
        }
    }
    let lost: u64 = cmp.policies.iter().map(|p| p.jobs_lost).sum();
    if lost > 0 {
        bail!("{lost} job(s) lost: a policy failed to finish every job within the horizon");
    }
    Ok(())
}

fn print_table(c: &Comparison) {
    println!(
        "trace {}: {} jobs, {:.0} GPU-hours; offline lower bound ${:.2}",
        c.trace, c.jobs, c.gpu_hours, c.lower_bound_usd
    );
    println!(
        "{:<15} {:>12} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>9}",
        "policy",
        "total $",
        "x bound",
        "$/job",
        "idle GPUh",
        "launches",
        "wait p50",
        "wait p95",
        "wait p99",
        "interr",
        "lost",
        "lost GPUh"
    );
    for p in &c.policies {
        println!(
            "{:<15} {:>12.2} {:>8.3} {:>9.3} {:>9.1} {:>9} {:>8.0}s {:>8.0}s {:>8.0}s {:>7} {:>6} {:>9.2}",
            p.name,
            p.total_usd,
            p.total_usd / c.lower_bound_usd,
            p.usd_per_job,
            p.idle_gpu_hours,
            p.launches,
            p.wait_p50_s,
            p.wait_p95_s,
            p.wait_p99_s,
            p.interruptions,
            p.jobs_lost,
            p.lost_work_gpu_hours
        );
    }
}

fn write_out(dir: &Path, c: &Comparison) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("comparison.json"), serde_json::to_string_pretty(c)?)?;
    for p in &c.policies {
        let mut s = String::from("minute,backlog,running_jobs,pending,busy,idle,draining,usd_per_h\n");
        for r in &p.timeline {
            s.push_str(&format!(
                "{},{},{},{},{},{},{},{:.4}\n",
                r.minute, r.backlog, r.running_jobs, r.pending, r.busy, r.idle, r.draining, r.usd_per_h
            ));
        }
        std::fs::write(dir.join(format!("timeline-{}.csv", p.name)), s)?;
    }
    plot::timeline_svg(&dir.join("timeline.svg"), c)?;
    Ok(())
}
