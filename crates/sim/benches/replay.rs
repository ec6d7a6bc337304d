//! Simulator throughput on the full Philly trace (82,247 jobs), one replay per policy (target:
//! < 1 s per policy in release). Prints seconds, jobs/s and the peak resident memory of each
//! replay. Reads the trace from `../shared/data/philly_pollux/philly.csv` (or the path in
//! `ONOFF_PHILLY`); without it, says so.
//!
//! `ONOFF_REPEAT=10` replays the trace ten times back to back (822,470 jobs; targets: < 12 s and
//! < 300 MB per policy). `ONOFF_PREEMPTIONS=skypilot` replays the shipped measured preemption
//! series instead of the Spot Advisor rates.
//!
//! Run: `cargo bench -p onoff-sim --bench replay`, or `ONOFF_REPEAT=10 cargo bench -p onoff-sim --bench replay`.
//! `onoff simulate --trace .../philly.csv --repeat 10 --policies onoff` measures the same from the
//! command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use onoff_control::catalog::{load_offerings_from_dir, CatalogOptions};
use onoff_policy::PolicyConfig;
use onoff_sim::{run, strategy, MeasuredPreemptions, Preemptions, SimConfig, Trace, DEFAULT_STRATEGIES};

/// The allocator `onoff simulate` runs with (crates/cli/src/main.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Peak resident memory since the last [`reset_peak_rss`], MB (Linux `VmHWM`).
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// Reset the peak to the current resident memory (Linux: `5` to `/proc/self/clear_refs`).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = std::env::var_os("ONOFF_PHILLY")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../shared/data/philly_pollux/philly.csv"));
    if !path.exists() {
        println!("replay bench skipped: {} not found (set ONOFF_PHILLY)", path.display());
        return;
    }
    let repeat: u32 = std::env::var("ONOFF_REPEAT")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1)
        .max(1);
    let t = Instant::now();
    let trace = Trace::load(&path, Default::default()).expect("trace parses");
    let trace = if repeat > 1 { trace.repeat(repeat) } else { trace };
    println!(
        "parsed {} jobs (x {repeat}) in {:.2} s",
        trace.jobs.len(),
        t.elapsed().as_secs_f64()
    );
    // As `onoff simulate` by default: us-east-1, every architecture (its only 2-GPU NVIDIA type,
    // g5g, is arm64: with x86_64 alone the 2-GPU jobs would never start).
    let catalog = CatalogOptions {
        arch: None,
        ..CatalogOptions::for_region("us-east-1")
    };
    let offerings = load_offerings_from_dir(&root.join("data/catalog"), &catalog).expect("catalogue");
    let mut cfg = PolicyConfig::default();
    cfg.limits.max_workers_total = 4096;
    cfg.lanes.iter_mut().for_each(|l| l.max_workers = 4096);
    let preemptions = match std::env::var("ONOFF_PREEMPTIONS").as_deref() {
        Ok("skypilot") => Preemptions::Measured(Arc::new(
            MeasuredPreemptions::load(&root.join("data/skypilot/aws-04-22-2023")).expect("shipped series"),
        )),
        _ => Preemptions::Advisor,
    };
    println!("preemptions: {}", preemptions.name());
    let sim = SimConfig {
        preemptions,
        ..SimConfig::default()
    };
    for name in DEFAULT_STRATEGIES {
        let mut s = strategy(name, &cfg, &trace, &offerings, &sim).expect("known strategy");
        reset_peak_rss();
        let t = Instant::now();
        let r = run(&trace, &offerings, s.as_mut(), &sim, &mut |_| {});
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{name:<15} {:>8.3} s  {:>10.0} jobs/s  peak RSS {:>5.0} MB  ({} decisions, {} launches)",
            secs,
            trace.jobs.len() as f64 / secs,
            peak_rss_mb().unwrap_or(f64::NAN),
            r.decisions,
            r.launches
        );
    }
}
