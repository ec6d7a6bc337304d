//! A sweep: the onoff policy run once per value of one setting, for the cost / wait frontier.
//!
//! `--sweep KEY=V1,V2,...` names any field of [`PolicyConfig`] the way its TOML does: a dotted
//! path (`scale_down.wait_value_usd_per_h`, `lanes.*.predictive_max` for every lane,
//! `lanes.0.predictive_max` for the first), or just the field's name when only one field has it
//! (`wait_value_usd_per_h`). The setting is changed generically through the config's serde form
//! (serialise, set the value, deserialise, [`PolicyConfig::validate`]), so every field, present or
//! added later, can be swept without code here. Values are JSON scalars (`0.5`, `true`, `null`)
//! or bare words taken as strings (`fixed` for `scale_down.mode`).

use onoff_policy::{Offering, PolicyConfig};
use serde::Serialize;
use serde_json::Value;

use crate::engine::{run, RunReport, SimConfig};
use crate::strategies::PolicyStrategy;
use crate::trace::Trace;

/// A parsed `KEY=V1,V2,...`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    /// The setting's dotted path, resolved (`scale_down.wait_value_usd_per_h`).
    pub key: String,
    /// The values, in the order given.
    pub values: Vec<Value>,
}

/// One value's run.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    /// The value the setting had.
    pub value: Value,
    /// Total billed, $.
    pub total_usd: f64,
    /// `total_usd` over the offline lower bound.
    pub x_lower_bound: f64,
    /// Median wait, seconds.
    pub wait_p50_s: f64,
    /// 95th percentile wait, seconds.
    pub wait_p95_s: f64,
    /// 99th percentile wait, seconds.
    pub wait_p99_s: f64,
    /// No other value is at most as costly and at most as slow at p95 while better in one.
    pub on_frontier: bool,
    /// The whole run report.
    pub report: RunReport,
}

/// Result of [`run_sweep`].
#[derive(Debug, Clone, Serialize)]
pub struct SweepResult {
    /// Trace label.
    pub trace: String,
    /// Jobs in the trace.
    pub jobs: usize,
    /// The strategy swept (`onoff`).
    pub strategy: String,
    /// The setting's dotted path.
    pub key: String,
    /// Offline lower bound, $.
    pub lower_bound_usd: f64,
    /// Whether the jobs declared their run times ([`SimConfig::declared_runtimes`]).
    pub declared_runtimes: bool,
    /// One point per value, in the order given.
    pub points: Vec<SweepPoint>,
}

/// Every leaf path of `v` (arrays as `*`), dotted.
fn leaf_paths(v: &Value, prefix: &str, out: &mut Vec<String>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                leaf_paths(x, &join(k), out);
            }
        }
        Value::Array(a) => match a.first() {
            Some(x @ (Value::Object(_) | Value::Array(_))) => leaf_paths(x, &join("*"), out),
            _ => out.push(prefix.to_string()),
        },
        _ => out.push(prefix.to_string()),
    }
}

/// Set `path` (dotted; `*` = every element of an array, a number = one element) to `new` in `v`.
fn set_path(v: &mut Value, path: &[&str], new: &Value) -> Result<(), String> {
    let Some((head, rest)) = path.split_first() else {
        *v = new.clone();
        return Ok(());
    };
    match v {
        Value::Object(m) => {
            if rest.is_empty() {
                m.insert(head.to_string(), new.clone());
                return Ok(());
            }
            let x = m.get_mut(*head).ok_or_else(|| format!("no setting {head:?}"))?;
            set_path(x, rest, new)
        }
        Value::Array(a) if *head == "*" => a.iter_mut().try_for_each(|x| set_path(x, rest, new)),
        Value::Array(a) => {
            let len = a.len();
            let i: usize = head
                .parse()
                .map_err(|_| format!("{head:?} is not an index or `*` of a list"))?;
            let x = a
                .get_mut(i)
                .ok_or_else(|| format!("index {i} is past the list's {len} entries"))?;
            set_path(x, rest, new)
        }
        _ => Err(format!("{head:?} is below a value that is not a table")),
    }
}

/// A value as typed: a JSON scalar, or a bare word as a string.
fn parse_value(s: &str) -> Value {
    serde_json::from_str::<Value>(s)
        .ok()
        .filter(|v| !v.is_object() && !v.is_array())
        .unwrap_or_else(|| Value::String(s.to_string()))
}

impl Sweep {
    /// Parse `KEY=V1,V2,...` against `base` (to resolve a bare field name and check each value).
    ///
    /// # Errors
    /// No `=`, no value, a key that names no field (or several: the message lists them), or a
    /// value the config refuses (the message says which and why).
    pub fn parse(spec: &str, base: &PolicyConfig) -> Result<Sweep, String> {
        let (key, values) = spec
            .split_once('=')
            .ok_or_else(|| format!("--sweep {spec:?}: expected KEY=V1,V2,..."))?;
        let key = key.trim();
        let values: Vec<Value> = values
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(parse_value)
            .collect();
        if values.is_empty() {
            return Err(format!("--sweep {key}: no values"));
        }
        let tree = serde_json::to_value(base).map_err(|e| e.to_string())?;
        let mut paths = Vec::new();
        leaf_paths(&tree, "", &mut paths);
        let key = if key.contains('.') {
            key.to_string()
        } else {
            let hits: Vec<&String> = paths.iter().filter(|p| p.rsplit('.').next() == Some(key)).collect();
            match hits.as_slice() {
                [one] => (*one).clone(),
                [] => {
                    return Err(format!(
                        "--sweep: no policy setting is named {key:?}; settings are: {}",
                        paths.join(", ")
                    ))
                }
                many => {
                    let names: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
                    return Err(format!(
                        "--sweep: {key:?} is ambiguous, give one of: {}",
                        names.join(", ")
                    ));
                }
            }
        };
        let sweep = Sweep { key, values };
        for v in &sweep.values {
            sweep.apply(base, v)?;
        }
        Ok(sweep)
    }

    /// `base` with the setting at `value`.
    ///
    /// # Errors
    /// The path names no field, the value has the wrong type, or the result fails
    /// [`PolicyConfig::validate`].
    pub fn apply(&self, base: &PolicyConfig, value: &Value) -> Result<PolicyConfig, String> {
        let bad = |e: String| format!("--sweep {}={value}: {e}", self.key);
        let mut tree = serde_json::to_value(base).map_err(|e| bad(e.to_string()))?;
        let path: Vec<&str> = self.key.split('.').collect();
        set_path(&mut tree, &path, value).map_err(bad)?;
        let cfg: PolicyConfig = serde_json::from_value(tree).map_err(|e| bad(e.to_string()))?;
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        Ok(cfg)
    }
}

/// Run the onoff policy once per value of `sweep`. `progress(value_index, share_done)`.
///
/// # Errors
/// A value the config refuses, or a job shape no offering serves.
pub fn run_sweep(
    label: &str,
    trace: &Trace,
    offerings: &[Offering],
    base: &PolicyConfig,
    sim: &SimConfig,
    sweep: &Sweep,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<SweepResult, String> {
    let lower = crate::lower_bound_usd(trace, offerings, base, sim)
        .map_err(|g| format!("no offering in the catalogue has {g} GPUs with the configured filters"))?;
    let mut points = Vec::new();
    // A stopped worker's volume bills what the policy's configuration says (`onoff simulate`
    // ties the two): a swept volume size or price is billed at each value's rate.
    let tied = (sim.stopped_usd_per_h - base.scale_down.stopped_usd_per_h()).abs() < 1e-12;
    for (i, v) in sweep.values.iter().enumerate() {
        let cfg = sweep.apply(base, v)?;
        let sim = SimConfig {
            stopped_usd_per_h: if tied {
                cfg.scale_down.stopped_usd_per_h()
            } else {
                sim.stopped_usd_per_h
            },
            ..sim.clone()
        };
        let mut s = PolicyStrategy::new("onoff", cfg);
        let r = run(trace, offerings, &mut s, &sim, &mut |p| progress(i, p));
        points.push(SweepPoint {
            value: v.clone(),
            total_usd: r.total_usd,
            x_lower_bound: if lower > 0.0 { r.total_usd / lower } else { 0.0 },
            wait_p50_s: r.wait_p50_s,
            wait_p95_s: r.wait_p95_s,
            wait_p99_s: r.wait_p99_s,
            on_frontier: false,
            report: r,
        });
    }
    for i in 0..points.len() {
        let (c, w) = (points[i].total_usd, points[i].wait_p95_s);
        points[i].on_frontier = !points
            .iter()
            .any(|q| q.total_usd <= c && q.wait_p95_s <= w && (q.total_usd < c || q.wait_p95_s < w));
    }
    Ok(SweepResult {
        trace: label.to_string(),
        jobs: trace.jobs.len(),
        strategy: "onoff".into(),
        key: sweep.key.clone(),
        lower_bound_usd: lower,
        declared_runtimes: sim.declared_runtimes,
        points,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_survives_its_serde_form() {
        let base = PolicyConfig::default();
        let back: PolicyConfig = serde_json::from_value(serde_json::to_value(&base).unwrap()).unwrap();
        assert_eq!(back, base);
    }

    #[test]
    fn keys_resolve_by_path_or_unique_name() {
        let base = PolicyConfig::default();
        let s = Sweep::parse("wait_value_usd_per_h=0, 0.5,2", &base).unwrap();
        assert_eq!(s.key, "scale_down.wait_value_usd_per_h");
        assert_eq!(s.values, [Value::from(0), Value::from(0.5), Value::from(2)]);
        let cfg = s.apply(&base, &s.values[1]).unwrap();
        assert_eq!(cfg.scale_down.wait_value_usd_per_h, 0.5);
        // Everything else is untouched.
        let mut want = base.clone();
        want.scale_down.wait_value_usd_per_h = 0.5;
        assert_eq!(cfg, want);

        // A lane field: every lane with `*`, one with its index.
        let s = Sweep::parse("predictive_max=0,10", &base).unwrap();
        assert_eq!(s.key, "lanes.*.predictive_max");
        let cfg = s.apply(&base, &Value::from(10)).unwrap();
        assert!(cfg.lanes.iter().all(|l| l.predictive_max == 10));
        let s = Sweep::parse("lanes.0.predictive_max=3", &base).unwrap();
        let cfg = s.apply(&base, &s.values[0]).unwrap();
        assert_eq!(cfg.lanes[0].predictive_max, 3);
        assert_eq!(cfg.lanes[1..], base.lanes[1..]);

        // Words are strings: an enum by its TOML name; an option from null to a number.
        let s = Sweep::parse("scale_down.mode=fixed,adaptive", &base).unwrap();
        let cfg = s.apply(&base, &s.values[0]).unwrap();
        assert_eq!(cfg.scale_down.mode, onoff_policy::KeepAliveMode::Fixed);
        let s = Sweep::parse("max_usd_per_h=100", &base).unwrap();
        assert_eq!(s.apply(&base, &s.values[0]).unwrap().limits.max_usd_per_h, Some(100.0));
    }

    #[test]
    fn bad_sweeps_say_what_is_wrong() {
        let base = PolicyConfig::default();
        let e = Sweep::parse("wait_value_usd_per_h", &base).unwrap_err();
        assert!(e.contains("KEY=V1,V2"), "{e}");
        let e = Sweep::parse("wait_value_usd_per_h=", &base).unwrap_err();
        assert!(e.contains("no values"), "{e}");
        let e = Sweep::parse("no_such_knob=1", &base).unwrap_err();
        assert!(
            e.contains("no_such_knob") && e.contains("scale_down.wait_value_usd_per_h"),
            "{e}"
        );
        let e = Sweep::parse("scale_down.no_such_knob=1", &base).unwrap_err();
        assert!(e.contains("no_such_knob"), "{e}");
        let e = Sweep::parse("wait_value_usd_per_h=cheap", &base).unwrap_err();
        assert!(e.contains("cheap"), "{e}");
        // validate() refuses a share above 1.
        let e = Sweep::parse("release_fraction=0.5,2", &base).unwrap_err();
        assert!(e.contains("release_fraction") && e.contains("0..=1"), "{e}");
        let e = Sweep::parse("lanes.9.predictive_max=1", &base).unwrap_err();
        assert!(e.contains("index 9"), "{e}");
    }

    #[test]
    fn a_sweep_runs_once_per_value_and_marks_the_frontier() {
        use onoff_policy::{CapacityType, OfferingKey};
        let offering = Offering {
            key: OfferingKey {
                instance_type: "one.gpu".into(),
                zone: "us-east-1a".into(),
                capacity_type: CapacityType::OnDemand,
            },
            gpus: 1,
            gpu_model: "NVIDIA T".into(),
            gpu_memory_gib: 24.0,
            vcpus: 8,
            price_usd_per_h: 1.0,
            interruption: None,
        };
        // Two jobs 3,000 s apart, 300 s boots: a fixed idle timeout of 60 s releases the worker
        // between them (two launches), one of 3,600 s keeps it (one launch, no second wait).
        let trace = Trace {
            format: crate::TraceFormat::Philly,
            start_unix_s: 1_500_000_000.0,
            jobs: [0.0, 3000.0]
                .iter()
                .enumerate()
                .map(|(i, &a)| crate::TraceJob {
                    id: i as u64,
                    arrival_s: a,
                    duration_s: 600.0,
                    gpus: 1,
                    project: "p".into(),
                })
                .collect(),
        };
        let mut base = PolicyConfig::default();
        base.lanes.iter_mut().for_each(|l| l.predictive_max = 0);
        base.scale_down.mode = onoff_policy::KeepAliveMode::Fixed;
        // Released workers terminated (the billing below is hand-computed for that).
        base.scale_down.stop_idle = onoff_policy::StopIdle::Never;
        base.anti_thrash.scale_down_delay_after_scale_up_s = 0.0;
        base.offers.min_gpu_memory_gib = 0.0;
        let sim = SimConfig {
            boot_min_s: 300.0,
            boot_max_s: 300.0,
            capacity_error_rate: 0.0,
            interruptions: false,
            ..SimConfig::default()
        };
        let sweep = Sweep::parse("fixed_idle_timeout_s=60,3600", &base).unwrap();
        let r = run_sweep(
            "t",
            &trace,
            std::slice::from_ref(&offering),
            &base,
            &sim,
            &sweep,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(r.key, "scale_down.fixed_idle_timeout_s");
        assert_eq!(r.points.len(), 2);
        let (short, long) = (&r.points[0], &r.points[1]);
        assert_eq!(short.report.launches, 2);
        assert_eq!(long.report.launches, 1);
        // Short: worker 1 from 0 to 960 s (boot 300, job 600, released at the first tick with
        // 60 s idle), worker 2 from 3,000 to 3,960 s likewise: 1,920 s at $1/h. Long: one worker
        // from 0 to the second job's end at 3,600 s, then its 3,600 s keep-alive: 7,200 s.
        assert!((short.total_usd - 1920.0 / 3600.0).abs() < 1e-9, "{}", short.total_usd);
        assert!((long.total_usd - 2.0).abs() < 1e-9, "{}", long.total_usd);
        assert!((r.lower_bound_usd - 1200.0 / 3600.0).abs() < 1e-9);
        assert!((short.x_lower_bound - 1920.0 / 1200.0).abs() < 1e-9);
        // Waits: 300 and 300 s against 300 and 0 s (p50 is the lower of two).
        assert_eq!((short.wait_p50_s, short.wait_p95_s), (300.0, 300.0));
        assert_eq!((long.wait_p50_s, long.wait_p95_s), (0.0, 300.0));
        // Same p95, the short timeout cheaper: it alone is on the (cost, p95) frontier.
        assert!(short.on_frontier && !long.on_frontier);

        // Stopped instead of terminated: a swept volume bills at each value's rate (before, at
        // the base's: ten times the volume billed less, kept a tenth as long).
        base.scale_down.stop_idle = onoff_policy::StopIdle::SpotAndOnDemand;
        let sim = SimConfig {
            stopped_usd_per_h: base.scale_down.stopped_usd_per_h(),
            ..sim
        };
        let sweep = Sweep::parse("stopped_volume_gib=100,1000", &base).unwrap();
        let r = run_sweep("t", &trace, &[offering], &base, &sim, &sweep, &mut |_, _| {}).unwrap();
        let (small, big) = (&r.points[0].report, &r.points[1].report);
        assert_eq!((small.restarts, big.restarts), (1, 1), "{small:?} {big:?}");
        assert!(
            big.stopped_usd > small.stopped_usd && small.stopped_usd > 0.0,
            "{} against {}",
            big.stopped_usd,
            small.stopped_usd
        );
    }
}
