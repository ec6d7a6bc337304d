//! Simulator throughput on the full Philly trace (82,247 jobs), one replay per policy (target:
//! < 1 s per policy in release). Prints jobs/s per policy. Reads the trace from
//! `../shared/data/philly_pollux/philly.csv` (or the path in `ONOFF_PHILLY`); without it, says so.
//! Run: `cargo bench -p onoff-sim --bench replay`.

use std::path::PathBuf;
use std::time::Instant;

use onoff_control::catalog::{load_offerings_from_dir, CatalogOptions};
use onoff_policy::PolicyConfig;
use onoff_sim::{run, strategy, SimConfig, Trace, STRATEGIES};

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = std::env::var_os("ONOFF_PHILLY")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../shared/data/philly_pollux/philly.csv"));
    if !path.exists() {
        println!("replay bench skipped: {} not found (set ONOFF_PHILLY)", path.display());
        return;
    }
    let t = Instant::now();
    let trace = Trace::load(&path, Default::default()).expect("trace parses");
    println!("parsed {} jobs in {:.2} s", trace.jobs.len(), t.elapsed().as_secs_f64());
    let offerings = load_offerings_from_dir(&root.join("data/catalog"), &CatalogOptions::default()).expect("catalogue");
    let mut cfg = PolicyConfig::default();
    cfg.limits.max_workers_total = 4096;
    cfg.lanes.iter_mut().for_each(|l| l.max_workers = 4096);
    let sim = SimConfig::default();
    for name in STRATEGIES {
        let mut s = strategy(name, &cfg, &trace, &sim).expect("known strategy");
        let t = Instant::now();
        let r = run(&trace, &offerings, s.as_mut(), &sim, &mut |_| {});
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{name:<15} {:>8.3} s  {:>10.0} jobs/s  ({} decisions, {} launches)",
            secs,
            trace.jobs.len() as f64 / secs,
            r.decisions,
            r.launches
        );
    }
}
