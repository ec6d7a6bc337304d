//! CloudWatch Embedded Metric Format: a JSON log line CloudWatch turns into metrics, no SDK needed.
//! Format: <https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html>.

use std::io::Write;
use std::sync::{Mutex, OnceLock};

type Sink = Mutex<Box<dyn Write + Send>>;
static SINK: OnceLock<Sink> = OnceLock::new();

/// Send every later [`emit`] of this process to `sink` instead of stdout (a process that runs the
/// functions in process, as `onoff local` does, keeps its stdout for its own output). Only the
/// first call takes effect.
pub fn redirect(sink: Box<dyn Write + Send>) {
    let _ = SINK.set(Mutex::new(sink));
}

/// Print one EMF line: to stdout (where Lambda's log capture picks it up), or to the sink set with
/// [`redirect`].
pub fn emit(line: &str) {
    match SINK.get() {
        Some(s) => {
            if let Ok(mut w) = s.lock() {
                let _ = writeln!(w, "{line}");
            }
        }
        None => println!("{line}"),
    }
}

/// One EMF line: `namespace`, timestamp `now` (unix seconds), one dimension set, and metrics as
/// (name, value, unit) with CloudWatch unit names (`Count`, `Seconds`, `None`, ...).
pub fn line(namespace: &str, now: f64, dimensions: &[(&str, &str)], metrics: &[(&str, f64, &str)]) -> String {
    line_with(namespace, now, dimensions, metrics, &[])
}

/// [`line()`] with extra properties that are logged but are not metrics or dimensions (a job id:
/// searchable in CloudWatch Logs Insights without the cost of a high-cardinality dimension).
pub fn line_with(
    namespace: &str,
    now: f64,
    dimensions: &[(&str, &str)],
    metrics: &[(&str, f64, &str)],
    properties: &[(&str, serde_json::Value)],
) -> String {
    let mut root = serde_json::Map::new();
    root.insert(
        "_aws".into(),
        serde_json::json!({
            "Timestamp": (now * 1000.0) as i64,
            "CloudWatchMetrics": [{
                "Namespace": namespace,
                "Dimensions": [dimensions.iter().map(|(k, _)| *k).collect::<Vec<_>>()],
                "Metrics": metrics.iter().map(|(n, _, u)| serde_json::json!({"Name": n, "Unit": u})).collect::<Vec<_>>(),
            }],
        }),
    );
    for (k, v) in dimensions {
        root.insert((*k).into(), serde_json::Value::from(*v));
    }
    for (n, v, _) in metrics {
        root.insert((*n).into(), serde_json::Value::from(*v));
    }
    for (k, v) in properties {
        root.insert((*k).into(), v.clone());
    }
    serde_json::Value::Object(root).to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_line_has_the_emf_envelope_and_the_values() {
        let l = super::line(
            "onoff",
            1_700_000_000.5,
            &[("Lane", "standard")],
            &[("Backlog", 3.0, "Count")],
        );
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["_aws"]["Timestamp"], 1_700_000_000_500i64);
        assert_eq!(v["_aws"]["CloudWatchMetrics"][0]["Namespace"], "onoff");
        assert_eq!(v["_aws"]["CloudWatchMetrics"][0]["Dimensions"][0][0], "Lane");
        assert_eq!(v["_aws"]["CloudWatchMetrics"][0]["Metrics"][0]["Name"], "Backlog");
        assert_eq!(
            (v["Lane"].as_str(), v["Backlog"].as_f64()),
            (Some("standard"), Some(3.0))
        );
    }
}
