//! `onoff`: the command line. `onoff simulate` replays a GPU job trace through onoff's policy and
//! the baselines, side by side; `onoff local` runs the whole system on this machine against moto
//! server (control plane in process, a real agent process per instance, a slice of the real trace).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use onoff_control::catalog::{load_offerings_from_dir, CatalogOptions};
use onoff_policy::PolicyConfig;
use onoff_sim::sweep::{run_sweep, Sweep, SweepPoint, SweepResult};
use onoff_sim::synthetic::{self, SyntheticSpec};
use onoff_sim::{
    compare, AzureModel, Comparison, Half, MeasuredPreemptions, Preemptions, RunReport, SimConfig, Trace, TraceFormat,
    STRATEGIES,
};

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
    /// The live workers (state, job or idle time, $/h), instances without a worker row, spot
    /// requests no worker holds, and what holds launches back: offerings skipped after a capacity
    /// error, vCPU quotas found full.
    #[cfg(feature = "local")]
    Workers(ops::WorkersArgs),
    /// What the dead-letter queues and the failed-events queue hold, why (each message's error
    /// record or the function's error) and what to do; read only (the `onoff-dead-letters` alarm).
    #[cfg(feature = "local")]
    DeadLetters(ops::DeadLettersArgs),
}

#[derive(clap::Args)]
struct SimulateArgs {
    /// Trace CSV (Philly `timestamp,duration,num_gpus,gpu_time,cluster` or Azure
    /// `TIMESTAMP,ContextTokens,GeneratedTokens`), or a seeded synthetic trace
    /// `synthetic:KIND[:N]` with KIND `poisson`, `diurnal`, `bursty` or `heavy-tail` and N jobs
    /// (default 5000; parameters in crates/sim/src/synthetic.rs). Default: the shipped busy week
    /// of Philly.
    #[arg(long)]
    trace: Option<String>,
    /// Replay one half of the trace's time span: `train` (the first) or `test` (the second),
    /// arrivals re-based to the half's first job.
    #[arg(long)]
    split: Option<Half>,
    /// Replay only one project's jobs (a Philly virtual cluster: the trace's `cluster` column),
    /// arrivals re-based to its first job; applied before --split. A name the trace lacks is
    /// refused with the list of its projects.
    #[arg(long)]
    project: Option<String>,
    /// Replay the trace this many times back to back (a load test of the simulator; prints wall
    /// time and peak memory).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
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
    /// Strategies to run, comma separated (also `all-on-demand`: onoff on on-demand capacity
    /// only, added by itself when deadlines are on).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "onoff,always-on,min-one-warm,fixed-idle-10m,keda-like,skypilot-like"
    )]
    policies: Vec<String>,
    /// Spot interruptions: `advisor` (random, at the Spot Instance Advisor bucket rates) or
    /// `skypilot[:PATH]` (measured per-zone availability series replayed over the span; PATH a
    /// folder or file of SkyPilot's 1-node traces, default the shipped data/skypilot slice).
    #[arg(long, default_value = "advisor")]
    preemptions: String,
    /// Share of jobs (0..=1, chosen by the seed) given a deadline of --deadline-slack x their run
    /// time after arrival; reports deadlines missed and each policy's cost against all-on-demand.
    #[arg(long, default_value_t = 0.0)]
    deadline_fraction: f64,
    /// Deadline = arrival + this x run time (>= 1).
    #[arg(long, default_value_t = 1.5)]
    deadline_slack: f64,
    /// Run the onoff policy once per value of one policy setting, KEY=V1,V2,... (KEY a dotted
    /// path such as `scale_down.wait_value_usd_per_h`, or a field name only one section has);
    /// prints cost and waits per value; with --out also plots the cost / p95 wait frontier.
    #[arg(long)]
    sweep: Option<String>,
    /// RNG seed (synthetic traces, boot times, capacity errors, interruptions, deadlines).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Shortest GPU cold start, seconds (boot times are uniform between min and max).
    #[arg(long, default_value_t = 180.0)]
    boot_min_s: f64,
    /// Longest GPU cold start, seconds.
    #[arg(long, default_value_t = 600.0)]
    boot_max_s: f64,
    /// Shortest start of a stopped worker, seconds (starts are uniform between min and max: no
    /// image pull, no model download; an assumption, replay your own figures). Default a third
    /// of --boot-min-s (60 s).
    #[arg(long)]
    restart_min_s: Option<f64>,
    /// Longest start of a stopped worker, seconds. Default 30 % of --boot-max-s (180 s): a start
    /// scales with the cold start it stands for.
    #[arg(long)]
    restart_max_s: Option<f64>,
    /// Seconds a stopped worker's instance stays stopping: a start within them is refused, as
    /// EC2 refuses it, and a launch made instead. EC2 takes minutes to stop an instance; 0 (the
    /// default, as the README's figures were measured) is an instant stop.
    #[arg(long, default_value_t = 0.0)]
    stopping_s: f64,
    /// Replay jobs that declare no run time (`est_runtime_s`), as a deployment sees them when
    /// its users do not set it. By default each job declares its trace run time exactly, which
    /// the policy reads (short jobs sharing a worker, the predictive pool's long jobs, when a
    /// running worker frees up).
    #[arg(long)]
    undeclared_runtimes: bool,
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
    /// Write comparison.json, a per-minute timeline CSV per policy, each job's wait per policy
    /// (waits-POLICY.csv) and timeline.svg here (with --sweep: sweep.json and frontier.svg).
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// mimalloc instead of the system allocator: see the dependency's note in Cargo.toml.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        #[cfg(feature = "local")]
        Cmd::Workers(a) => block_on(ops::workers(a)),
        #[cfg(feature = "local")]
        Cmd::DeadLetters(a) => block_on(ops::dead_letters(a)),
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

/// The trace of `--trace` (a file or `synthetic:KIND[:N]`) and its label for reports.
fn load_trace(spec: Option<&str>, seed: u64) -> Result<(Trace, String)> {
    let Some(spec) = spec else {
        let path = Path::new(DATA_DIR).join("philly/philly-busy-week.csv");
        return Ok((
            Trace::load(&path, AzureModel::default())?,
            "philly-busy-week.csv".into(),
        ));
    };
    if let Some(s) = SyntheticSpec::parse(spec).map_err(anyhow::Error::msg)? {
        return Ok((synthetic::generate(&s, seed), format!("{} (seed {seed})", s.label())));
    }
    let path = PathBuf::from(spec);
    let label = path
        .file_name()
        .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into());
    Ok((Trace::load(&path, AzureModel::default())?, label))
}

/// `--preemptions advisor | skypilot[:PATH]`.
fn load_preemptions(spec: &str) -> Result<Preemptions> {
    match spec.split_once(':').unwrap_or((spec, "")) {
        ("advisor", "") => Ok(Preemptions::Advisor),
        ("skypilot", path) => {
            let path = if path.is_empty() {
                Path::new(DATA_DIR).join("skypilot/aws-04-22-2023")
            } else {
                PathBuf::from(path)
            };
            let m = MeasuredPreemptions::load(&path).map_err(|e| anyhow::anyhow!("--preemptions: {e}"))?;
            Ok(Preemptions::Measured(std::sync::Arc::new(m)))
        }
        _ => bail!("--preemptions {spec:?}: use `advisor` or `skypilot[:PATH]`"),
    }
}

/// Peak resident memory of this process so far, MB (Linux `VmHWM`); `None` elsewhere.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn simulate(a: SimulateArgs) -> Result<()> {
    let (trace, mut label) = load_trace(a.trace.as_deref(), a.seed)?;
    let trace = match &a.project {
        Some(p) => {
            label = format!("{label} (project {p})");
            trace.of_project(p)?
        }
        None => trace,
    };
    let mut split_info = None;
    let trace = match a.split {
        Some(half) => {
            let (t, info) = trace.split(half)?;
            label = format!("{label} ({} half)", half.name());
            split_info = Some(info);
            t
        }
        None => trace,
    };
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let trace = if a.repeat > 1 {
        label = format!("{label} x {}", a.repeat);
        trace.repeat(a.repeat)
    } else {
        trace
    };
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
    let restart_min_s = a.restart_min_s.unwrap_or(a.boot_min_s / 3.0);
    let restart_max_s = a.restart_max_s.unwrap_or(a.boot_max_s * 0.3).max(restart_min_s);
    if !(restart_min_s >= 0.0 && a.restart_max_s.is_none_or(|m| m >= restart_min_s)) {
        bail!("--restart-min-s must be >= 0 and <= --restart-max-s");
    }
    if !(a.stopping_s.is_finite() && a.stopping_s >= 0.0) {
        bail!("--stopping-s must be a number >= 0");
    }
    if !(0.0..=1.0).contains(&a.capacity_error_rate) {
        bail!("--capacity-error-rate must be within 0..=1");
    }
    if !(0.0..=1.0).contains(&a.deadline_fraction) {
        bail!("--deadline-fraction must be within 0..=1");
    }
    if !(a.deadline_slack.is_finite() && a.deadline_slack >= 1.0) {
        bail!("--deadline-slack must be a number >= 1 (a deadline before the run time cannot be met)");
    }
    let preemptions = load_preemptions(&a.preemptions)?;
    let sim = SimConfig {
        seed: a.seed,
        boot_min_s: a.boot_min_s,
        boot_max_s: a.boot_max_s,
        restart_min_s,
        restart_max_s,
        stopping_s: a.stopping_s,
        // A stopped worker's volume bills what the policy's configuration says it is.
        stopped_usd_per_h: cfg.scale_down.stopped_usd_per_h(),
        capacity_error_rate: a.capacity_error_rate,
        interruptions: a.interruption_rate_factor > 0.0,
        interruption_rate_factor: a.interruption_rate_factor,
        preemptions,
        deadline_fraction: a.deadline_fraction,
        deadline_slack: a.deadline_slack,
        checkpoint_interval_s: a.checkpoint_interval_s,
        checkpoint_on_notice: a.checkpoint_on_notice,
        timeline: a.out.is_some() && a.sweep.is_none(),
        declared_runtimes: !a.undeclared_runtimes,
        ..SimConfig::default()
    };
    if let Some(spec) = &a.sweep {
        let sweep = Sweep::parse(spec, &cfg).map_err(anyhow::Error::msg)?;
        return simulate_sweep(&a, &label, &trace, &offerings, &cfg, &sim, &sweep);
    }
    let mut names: Vec<&str> = a.policies.iter().map(String::as_str).collect();
    if sim.deadline_fraction > 0.0 && !names.contains(&onoff_sim::ALL_ON_DEMAND) {
        names.push(onoff_sim::ALL_ON_DEMAND);
    }
    let bar = progress_bar(a.quiet || a.json, names.len());
    let started = std::time::Instant::now();
    let mut cmp = compare(&label, &trace, &offerings, &cfg, &sim, &names, &mut |i, p| {
        bar.set_message(names[i].to_string());
        bar.set_position((i * 100) as u64 + (p * 100.0) as u64);
    })
    .map_err(anyhow::Error::msg)?;
    cmp.split = split_info;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&cmp)?);
    } else {
        print_table(&cmp);
        let per: Vec<String> = cmp
            .policies
            .iter()
            .map(|p| format!("{} {:.2} s", p.name, p.wall_s))
            .collect();
        eprintln!(
            "({} jobs x {} policies in {:.1} s: {}; peak RSS {})",
            cmp.jobs,
            names.len(),
            started.elapsed().as_secs_f64(),
            per.join(", "),
            peak_rss_mb().map_or_else(|| "n/a".into(), |m| format!("{m:.0} MB"))
        );
    }
    if let Some(dir) = &a.out {
        write_out(dir, &cmp)?;
        if !a.json {
            println!(
                "wrote {}/comparison.json, timeline-*.csv, waits-*.csv, timeline.svg",
                dir.display()
            );
        }
    }
    let lost: u64 = cmp.policies.iter().map(|p| p.jobs_lost).sum();
    if lost > 0 {
        bail!("{lost} job(s) lost: a policy failed to finish every job within the horizon");
    }
    Ok(())
}

fn progress_bar(hidden: bool, runs: usize) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new((runs * 100) as u64);
    b.set_style(
        ProgressStyle::with_template("{spinner} {msg:>16} [{bar:40}] {pos}/{len} % {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    b
}

fn simulate_sweep(
    a: &SimulateArgs,
    label: &str,
    trace: &Trace,
    offerings: &[onoff_policy::Offering],
    cfg: &PolicyConfig,
    sim: &SimConfig,
    sweep: &Sweep,
) -> Result<()> {
    let bar = progress_bar(a.quiet || a.json, sweep.values.len());
    let started = std::time::Instant::now();
    let r = run_sweep(label, trace, offerings, cfg, sim, sweep, &mut |i, p| {
        bar.set_message(format!("{}", sweep.values[i]));
        bar.set_position((i * 100) as u64 + (p * 100.0) as u64);
    })
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_sweep(&r);
        eprintln!(
            "({} jobs x {} values in {:.1} s; peak RSS {})",
            r.jobs,
            r.points.len(),
            started.elapsed().as_secs_f64(),
            peak_rss_mb().map_or_else(|| "n/a".into(), |m| format!("{m:.0} MB"))
        );
    }
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("sweep.json"), serde_json::to_string_pretty(&r)?)?;
        plot::frontier_svg(&dir.join("frontier.svg"), &r)?;
        if !a.json {
            println!("wrote {}/sweep.json, frontier.svg", dir.display());
        }
    }
    let lost: u64 = r.points.iter().map(|p| p.report.jobs_lost).sum();
    if lost > 0 {
        bail!("{lost} job(s) lost: a run failed to finish every job within the horizon");
    }
    Ok(())
}

fn print_sweep(r: &SweepResult) {
    println!(
        "trace {}: {} jobs; offline lower bound ${:.2}{}; {} by {}",
        r.trace,
        r.jobs,
        r.lower_bound_usd,
        if r.declared_runtimes {
            ""
        } else {
            "; run times undeclared"
        },
        r.strategy,
        r.key
    );
    println!(
        "{:>12} {:>12} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "value", "total $", "x bound", "wait p50", "wait p95", "wait p99", "frontier"
    );
    for p in &r.points {
        println!(
            "{:>12} {:>12.2} {:>8.3} {:>8.0}s {:>8.0}s {:>8.0}s {:>9}",
            p.value.to_string(),
            p.total_usd,
            p.x_lower_bound,
            p.wait_p50_s,
            p.wait_p95_s,
            p.wait_p99_s,
            if p.on_frontier { "*" } else { "" }
        );
    }
    for p in &r.points {
        if let Some(note) = limit_note(&format!("{} at {} = {}", r.strategy, r.key, p.value), &p.report) {
            println!("{note}");
        }
    }
    if let Some(note) = flat_sweep_note(r) {
        println!("{note}");
    }
}

/// A note when every value of a sweep (two or more) gave the same cost and waits: the trace's
/// fleet does not respond to the setting, and the frontier is one point. For the wait value it
/// names what sizes a fleet of short jobs instead (docs/policy.md, "What a wait is worth").
fn flat_sweep_note(r: &SweepResult) -> Option<String> {
    let first = r.points.first()?;
    let same = |p: &SweepPoint| {
        (p.total_usd, p.wait_p50_s, p.wait_p95_s, p.wait_p99_s)
            == (first.total_usd, first.wait_p50_s, first.wait_p95_s, first.wait_p99_s)
    };
    if r.points.len() < 2 || !r.points.iter().all(same) {
        return None;
    }
    let hint = if r.key.ends_with("wait_value_usd_per_h") {
        ": a fleet serving short jobs is sized by offers.short_job_horizon_s instead (docs/policy.md)"
    } else {
        ""
    };
    Some(format!(
        "note: every value of {} gave the same cost and waits on this trace{hint}",
        r.key
    ))
}

fn print_table(c: &Comparison) {
    println!(
        "trace {}: {} jobs, {:.0} GPU-hours; offline lower bound ${:.2}; preemptions {}{}",
        c.trace,
        c.jobs,
        c.gpu_hours,
        c.lower_bound_usd,
        c.preemptions.name(),
        if c.declared_runtimes {
            ""
        } else {
            "; run times undeclared"
        }
    );
    if let Some(s) = &c.split {
        println!(
            "{} half of {} jobs: from {:.0} s, cut at {:.0} s",
            s.half.name(),
            s.original_jobs,
            s.offset_s,
            s.cut_s
        );
    }
    let deadlines = c.deadline_fraction > 0.0;
    if deadlines {
        let (jobs, warm, slack) = c.policies.first().map_or((0, 0, 0), |p| {
            (p.deadline_jobs, p.deadlines_need_warm, p.deadlines_with_slack)
        });
        println!(
            "deadlines: {jobs} jobs ({:.0} %), due {} x run time after arrival ({warm} of them met only on a \
             worker already up: less slack than the shortest cold start; {slack} with more slack than the \
             longest, whose misses are in brackets); all-on-demand ${:.2}",
            c.deadline_fraction * 100.0,
            c.deadline_slack,
            c.all_on_demand_usd.unwrap_or(0.0)
        );
    }
    print!(
        "{:<15} {:>12} {:>8} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>7} {:>6} {:>9} {:>6}",
        "policy",
        "total $",
        "x bound",
        "$/job",
        "idle GPUh",
        "launches",
        "starts",
        "wait p50",
        "wait p95",
        "wait p99",
        "interr",
        "lost",
        "lost GPUh",
        "OD %"
    );
    if deadlines {
        print!(" {:>13} {:>7}", "dl missed", "x OD");
    }
    println!();
    for p in &c.policies {
        print!(
            "{:<15} {:>12.2} {:>8.3} {:>9.3} {:>9.1} {:>9} {:>8} {:>8.0}s {:>8.0}s {:>8.0}s {:>7} {:>6} {:>9.2} {:>6.1}",
            p.name,
            p.total_usd,
            p.total_usd / c.lower_bound_usd,
            p.usd_per_job,
            p.idle_gpu_hours,
            p.launches,
            p.restarts,
            p.wait_p50_s,
            p.wait_p95_s,
            p.wait_p99_s,
            p.interruptions,
            p.jobs_lost,
            p.lost_work_gpu_hours,
            if p.total_usd > 0.0 {
                100.0 * p.on_demand_usd / p.total_usd
            } else {
                0.0
            }
        );
        if deadlines {
            print!(
                " {:>13} {:>7.3}",
                format!("{} ({})", p.deadlines_missed, p.deadlines_missed_with_slack),
                p.cost_vs_all_on_demand.unwrap_or(f64::NAN)
            );
        }
        println!();
    }
    for note in c.policies.iter().filter_map(|p| limit_note(&p.name, p)) {
        println!("{note}");
    }
    if let Some(note) = tail_note(&c.policies) {
        println!("{note}");
    }
}

/// Share of a policy's bill the keep-alive after the last job must reach before the table says
/// so: on a trace of minutes or hours it is a large part of what the policies differ in.
const TAIL_NOTE_SHARE: f64 = 0.05;

/// A line giving each policy's share of its bill spent after the last job
/// (`RunReport::keep_alive_tail_usd`), when at least one reaches [`TAIL_NOTE_SHARE`]; `None`
/// otherwise. On a short trace a keep-alive of minutes is a large part of the bill, and the table
/// alone would not say that it is the end of the trace, not the traffic, that the costs differ by.
fn tail_note(policies: &[RunReport]) -> Option<String> {
    let share = |p: &RunReport| {
        if p.total_usd > 0.0 {
            p.keep_alive_tail_usd / p.total_usd
        } else {
            0.0
        }
    };
    if !policies.iter().any(|p| share(p) >= TAIL_NOTE_SHARE) {
        return None;
    }
    let shares: Vec<String> = policies
        .iter()
        .filter(|p| p.keep_alive_tail_usd > 0.0)
        .map(|p| match 100.0 * share(p) {
            pct if pct < 0.5 => format!("{} <1 %", p.name),
            pct => format!("{} {pct:.0} %", p.name),
        })
        .collect();
    Some(format!(
        "note: the keep-alive after the last job is a large part of the bill on this trace ({}; \
         keep_alive_tail_usd in --json): a trace this short weighs the end of the work, not only \
         the work",
        shares.join(", ")
    ))
}

/// Share of a policy's decisions a configured limit must hold launches in before the table says
/// so: from 1 % on, the limit shapes the waits more than rounding does.
const LIMIT_NOTE_SHARE: f64 = 0.01;

/// A line saying which configured limits held the launches of run `r` (named `label`) in at least
/// [`LIMIT_NOTE_SHARE`] of its decisions (`RunReport::held_by_limit`), `None` when none did: a cap
/// far below the demand turns waits of minutes into days, and the table alone would blame the
/// policy.
fn limit_note(label: &str, r: &RunReport) -> Option<String> {
    let bound: Vec<String> = r
        .held_by_limit
        .iter()
        .filter(|(_, &n)| r.decisions > 0 && n as f64 >= LIMIT_NOTE_SHARE * r.decisions as f64)
        .map(|(limit, &n)| format!("{limit} in {:.0} %", 100.0 * n as f64 / r.decisions as f64))
        .collect();
    (!bound.is_empty()).then(|| {
        format!(
            "note: {label} held launches for {} of its {} decisions: its waits are those limits' (the \
             policy config's [limits] and [[lanes]] max_workers)",
            bound.join(", "),
            r.decisions
        )
    })
}

fn write_out(dir: &Path, c: &Comparison) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("comparison.json"), serde_json::to_string_pretty(c)?)?;
    for p in &c.policies {
        let mut s = String::from("minute,backlog,running_jobs,pending,busy,idle,draining,stopped,usd_per_h\n");
        for r in &p.timeline {
            s.push_str(&format!(
                "{},{},{},{},{},{},{},{},{:.4}\n",
                r.minute, r.backlog, r.running_jobs, r.pending, r.busy, r.idle, r.draining, r.stopped, r.usd_per_h
            ));
        }
        std::fs::write(dir.join(format!("timeline-{}.csv", p.name)), s)?;
        let mut s = String::from("job,arrival_s,gpus,instances,run_s,wait_s\n");
        for j in &p.job_waits {
            s.push_str(&format!(
                "{},{:.3},{},{},{:.3},{:.3}\n",
                j.job, j.arrival_s, j.gpus, j.instances, j.run_s, j.wait_s
            ));
        }
        std::fs::write(dir.join(format!("waits-{}.csv", p.name)), s)?;
    }
    plot::timeline_svg(&dir.join("timeline.svg"), c)?;
    Ok(())
}
