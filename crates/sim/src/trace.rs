//! Trace parsing: turns a real workload trace (CSV) into a list of [`TraceJob`]s.
//!
//! Two formats are recognised from the header line:
//!
//! * **Philly** (Microsoft Philly GPU cluster, 2017, as prepared by the Pollux artifact):
//!   `timestamp,duration,num_gpus,gpu_time,cluster`, timestamps like `2017-10-09 07:01:55`.
//!   One row is one training job: `duration` seconds on `num_gpus` whole GPUs, submitted by the
//!   virtual cluster `cluster` (used as the project).
//! * **Azure** (Azure LLM inference trace 2023, Splitwise): `TIMESTAMP,ContextTokens,GeneratedTokens`,
//!   timestamps like `2023-11-16 18:17:03.9799600` (7 fractional digits). One row is one request,
//!   turned into a one-GPU item whose run time comes from an [`AzureModel`].
//!
//! Timestamps are read as UTC wall-clock times without a date crate (`days_from_civil`).
//! Rows need not be sorted: jobs are sorted by arrival (stable, so ties keep the file's row order)
//! and numbered from 0 in that order. Blank lines are ignored.

use std::path::Path;

/// One unit of work from a trace, times in seconds relative to the first arrival of the trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TraceJob {
    /// Row order after sorting by arrival, from 0.
    pub id: u64,
    /// Seconds since the trace's first arrival (the first job has 0.0).
    pub arrival_s: f64,
    /// Run time on the reference GPU, seconds (> 0; rows with duration <= 0 are clamped to 1.0 s).
    pub duration_s: f64,
    /// Whole GPUs asked for (>= 1).
    pub gpus: u32,
    /// Philly: the virtual cluster; Azure: "azure".
    pub project: String,
}

/// The format of a trace file, detected from its header line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TraceFormat {
    /// `timestamp,duration,num_gpus,gpu_time,cluster` (Philly, via Pollux).
    Philly,
    /// `TIMESTAMP,ContextTokens,GeneratedTokens` (Azure LLM inference 2023).
    Azure,
    /// Made by a seeded generator ([`crate::synthetic`]), not read from a file.
    Synthetic,
}

/// One half of a trace's time span ([`Trace::split`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Half {
    /// Jobs arriving in the first half of the span (`arrival < span / 2`).
    Train,
    /// Jobs arriving in the second half (`arrival >= span / 2`).
    Test,
}

impl Half {
    /// `train` or `test`.
    pub fn name(self) -> &'static str {
        match self {
            Half::Train => "train",
            Half::Test => "test",
        }
    }
}

impl std::str::FromStr for Half {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "train" => Ok(Half::Train),
            "test" => Ok(Half::Test),
            other => Err(format!("{other:?} is not a half: use `train` or `test`")),
        }
    }
}

/// What [`Trace::split`] kept, for reports.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SplitInfo {
    /// The half kept.
    pub half: Half,
    /// Where the half starts in the original trace, seconds after its first arrival (the first
    /// kept arrival; 0 for the train half).
    pub offset_s: f64,
    /// The cut: the middle of the original span, seconds after its first arrival.
    pub cut_s: f64,
    /// Jobs in the original trace.
    pub original_jobs: usize,
}

/// A parsed trace.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Which format the file was in.
    pub format: TraceFormat,
    /// Unix seconds of the first arrival (timestamps read as UTC).
    pub start_unix_s: f64,
    /// Jobs sorted by `arrival_s`, then original row order.
    pub jobs: Vec<TraceJob>,
}

/// Why a trace could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace file {path}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The header line matches no known format.
    #[error(
        "{path}: unknown trace format, header line is {header:?}; expected a Philly header \
         (timestamp,duration,num_gpus,gpu_time,cluster) or an Azure LLM header \
         (TIMESTAMP,ContextTokens,GeneratedTokens)"
    )]
    UnknownFormat {
        /// The file (or the name given to [`Trace::parse_str`]).
        path: String,
        /// The header line as read.
        header: String,
    },
    /// A data row could not be parsed.
    #[error("{path}, line {line}: {reason}")]
    BadRow {
        /// The file (or the name given to [`Trace::parse_str`]).
        path: String,
        /// 1-based line number in the file (the header is line 1).
        line: u64,
        /// What is wrong with the row.
        reason: String,
    },
    /// The file has a header but no data rows (or is empty).
    #[error("{path}: the trace has no jobs")]
    Empty {
        /// The file (or the name given to [`Trace::parse_str`]).
        path: String,
    },
    /// [`Trace::of_project`] found no job of the project.
    #[error("no job of the trace has project {project:?}; its projects: {known}")]
    NoSuchProject {
        /// The project asked for.
        project: String,
        /// The trace's projects with their job counts, most jobs first.
        known: String,
    },
}

/// How Azure requests become jobs: each request is one item served on one GPU taking
/// (context_tokens / prefill_tokens_per_s + generated_tokens / decode_tokens_per_s) seconds.
///
/// The seconds are the item's share of a GPU's time when it is served in large batches (batch
/// inference), not the latency one request would see alone.
#[derive(Debug, Clone, Copy)]
pub struct AzureModel {
    /// Prompt (context) tokens processed per second of one GPU.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second of one GPU.
    pub decode_tokens_per_s: f64,
}

impl Default for AzureModel {
    /// Llama-2-7B (LLaMA 7B) served by TensorRT-LLM in FP8 on one NVIDIA L40S (the GPU of AWS g6e),
    /// at large batch sizes: prefill 10,619 tokens/s and decode 4,663 tokens/s.
    ///
    /// Source: NVIDIA, TensorRT-LLM `docs/source/performance.md`, table "L40S GPUs (FP8)" (data
    /// from TensorRT-LLM v0.5), <https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/docs/source/performance.md>:
    /// LLaMA 7B, TP 1, input 128 / output 128 at batch 64: 3,240 output tokens/s; input 2048 /
    /// output 128 at batch 32: 581 output tokens/s.
    ///
    /// Derivation (ours): the published figures are output tokens/s only, so the two rates are the
    /// exact solution of `128/T = in/prefill + 128/decode` for both rows
    /// (`1/prefill = (128/581 - 128/3240) / 1920`, then `1/decode`), giving 10,619.3 and 4,662.6.
    /// Both rows have 128 output tokens, like the Azure code trace (median 13, p99 about 250
    /// generated tokens; about 2,000 context tokens on average), so the fit suits it. It
    /// underestimates long generations: the same table's input 128 / output 2048 row (1,622
    /// tokens/s) is about 2.8x slower than this model predicts, because decoding slows as the
    /// context grows.
    fn default() -> Self {
        AzureModel {
            prefill_tokens_per_s: 10_619.0,
            decode_tokens_per_s: 4_663.0,
        }
    }
}

impl AzureModel {
    /// Seconds of one GPU for one request.
    fn item_seconds(&self, context_tokens: f64, generated_tokens: f64) -> f64 {
        context_tokens / self.prefill_tokens_per_s + generated_tokens / self.decode_tokens_per_s
    }
}

impl Trace {
    /// Reads and parses a trace file, detecting the format from its header line.
    pub fn load(path: &Path, azure: AzureModel) -> Result<Trace, TraceError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: name.clone(),
            source,
        })?;
        Self::parse_str(&name, &text, azure)
    }

    /// Parses trace text; `name` is used in error messages.
    pub fn parse_str(name: &str, text: &str, azure: AzureModel) -> Result<Trace, TraceError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if text.trim().is_empty() {
            return Err(TraceError::Empty { path: name.to_string() });
        }
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(true)
            .trim(csv::Trim::All)
            .from_reader(text.as_bytes());
        let header_line = text
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string();
        let headers = reader
            .headers()
            .map_err(|e| csv_error(name, &e))?
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect::<Vec<_>>();
        let col = |n: &str| headers.iter().position(|h| h == n);

        let format;
        let columns: Columns;
        if let (Some(ts), Some(ctx), Some(gen)) = (col("timestamp"), col("contexttokens"), col("generatedtokens")) {
            format = TraceFormat::Azure;
            columns = Columns::Azure { ts, ctx, gen };
        } else if let (Some(ts), Some(dur), Some(gpus)) = (col("timestamp"), col("duration"), col("num_gpus")) {
            format = TraceFormat::Philly;
            columns = Columns::Philly {
                ts,
                dur,
                gpus,
                cluster: col("cluster"),
            };
        } else {
            return Err(TraceError::UnknownFormat {
                path: name.to_string(),
                header: header_line,
            });
        }

        // (arrival in unix nanoseconds, job without id/arrival)
        let mut rows: Vec<(i64, f64, u32, String)> = Vec::new();
        for record in reader.records() {
            let record = record.map_err(|e| csv_error(name, &e))?;
            let line = record.position().map(|p| p.line()).unwrap_or(0);
            let bad = |reason: String| TraceError::BadRow {
                path: name.to_string(),
                line,
                reason,
            };
            let field = |i: usize, what: &str| -> Result<&str, TraceError> {
                record.get(i).ok_or_else(|| bad(format!("missing column {what}")))
            };
            match columns {
                Columns::Philly { ts, dur, gpus, cluster } => {
                    let ts_s = field(ts, "timestamp")?;
                    let t = parse_timestamp_ns(ts_s).map_err(|r| bad(format!("timestamp {ts_s:?}: {r}")))?;
                    let d_s = field(dur, "duration")?;
                    let d: f64 = d_s
                        .parse()
                        .ok()
                        .filter(|d: &f64| d.is_finite())
                        .ok_or_else(|| bad(format!("duration {d_s:?} is not a finite number")))?;
                    let g_s = field(gpus, "num_gpus")?;
                    let g = parse_gpus(g_s).map_err(|r| bad(format!("num_gpus {g_s:?}: {r}")))?;
                    let project = match cluster {
                        Some(c) => field(c, "cluster")?.to_string(),
                        None => String::new(),
                    };
                    rows.push((t, clamp_duration(d), g, project));
                }
                Columns::Azure { ts, ctx, gen } => {
                    let ts_s = field(ts, "TIMESTAMP")?;
                    let t = parse_timestamp_ns(ts_s).map_err(|r| bad(format!("TIMESTAMP {ts_s:?}: {r}")))?;
                    let c_s = field(ctx, "ContextTokens")?;
                    let c: u64 = c_s
                        .parse()
                        .map_err(|_| bad(format!("ContextTokens {c_s:?} is not a whole number")))?;
                    let g_s = field(gen, "GeneratedTokens")?;
                    let g: u64 = g_s
                        .parse()
                        .map_err(|_| bad(format!("GeneratedTokens {g_s:?} is not a whole number")))?;
                    let d = azure.item_seconds(c as f64, g as f64);
                    rows.push((t, clamp_duration(d), 1, "azure".to_string()));
                }
            }
        }
        if rows.is_empty() {
            return Err(TraceError::Empty { path: name.to_string() });
        }
        // Stable: equal arrivals keep the file's row order.
        rows.sort_by_key(|r| r.0);
        let t0 = rows[0].0;
        let jobs = rows
            .into_iter()
            .enumerate()
            .map(|(i, (t, duration_s, gpus, project))| TraceJob {
                id: i as u64,
                arrival_s: (t - t0) as f64 / 1e9,
                duration_s,
                gpus,
                project,
            })
            .collect();
        let start_unix_s = t0.div_euclid(1_000_000_000) as f64 + t0.rem_euclid(1_000_000_000) as f64 / 1e9;
        Ok(Trace {
            format,
            start_unix_s,
            jobs,
        })
    }

    /// Last arrival minus first arrival, seconds (0 for a one-job trace).
    pub fn span_s(&self) -> f64 {
        match (self.jobs.first(), self.jobs.last()) {
            (Some(a), Some(b)) => b.arrival_s - a.arrival_s,
            _ => 0.0,
        }
    }

    /// Sum of duration x GPUs over all jobs, GPU-seconds.
    pub fn gpu_seconds(&self) -> f64 {
        self.jobs.iter().map(|j| j.duration_s * j.gpus as f64).sum()
    }

    /// One half of the trace by time, for a train/test split: the cut is the middle of the span
    /// (first to last arrival); `Train` keeps the jobs arriving before it, `Test` those at or after
    /// it. Jobs are whole: a train job running past the cut stays a train job. Arrivals are
    /// re-based so the first kept job arrives at 0 (and `start_unix_s` moves with it), ids are
    /// renumbered from 0.
    ///
    /// # Errors
    /// The half has no job (a trace whose jobs all arrive at one instant has an empty train half).
    pub fn split(&self, half: Half) -> Result<(Trace, SplitInfo), TraceError> {
        let cut = self.span_s() / 2.0;
        let (kept, offset_s) = self
            .subset(|j| match half {
                Half::Train => j.arrival_s < cut,
                Half::Test => j.arrival_s >= cut,
            })
            .ok_or_else(|| TraceError::Empty {
                path: format!("the {} half", half.name()),
            })?;
        let info = SplitInfo {
            half,
            offset_s,
            cut_s: cut,
            original_jobs: self.jobs.len(),
        };
        Ok((kept, info))
    }

    /// The jobs of one project (a Philly virtual cluster, the trace's `cluster` column), as a
    /// trace of their own: arrivals re-based so the project's first job arrives at 0 (and
    /// `start_unix_s` moves with it), ids renumbered from 0. A tenant's own workload, for
    /// replaying the policy on a trace it was not tuned to.
    ///
    /// # Errors
    /// [`TraceError::NoSuchProject`] when no job has that project; it lists the trace's projects.
    pub fn of_project(&self, project: &str) -> Result<Trace, TraceError> {
        self.subset(|j| j.project == project)
            .map(|(t, _)| t)
            .ok_or_else(|| TraceError::NoSuchProject {
                project: project.to_string(),
                known: self
                    .projects()
                    .iter()
                    .map(|(p, n)| format!("{p} ({n} job{})", if *n == 1 { "" } else { "s" }))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The trace's projects and their job counts, most jobs first (ties by name).
    pub fn projects(&self) -> Vec<(String, usize)> {
        let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for j in &self.jobs {
            *counts.entry(j.project.as_str()).or_default() += 1;
        }
        let mut out: Vec<(String, usize)> = counts.into_iter().map(|(p, n)| (p.to_string(), n)).collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    /// The jobs `keep` keeps, re-based so the first kept one arrives at 0 (`start_unix_s` moves
    /// with it) and renumbered from 0, with the first kept arrival in the original trace
    /// (seconds); `None` when it keeps none.
    fn subset(&self, keep: impl Fn(&TraceJob) -> bool) -> Option<(Trace, f64)> {
        let kept: Vec<&TraceJob> = self.jobs.iter().filter(|j| keep(j)).collect();
        let first = kept.first()?.arrival_s;
        let jobs = kept
            .into_iter()
            .enumerate()
            .map(|(i, j)| TraceJob {
                id: i as u64,
                arrival_s: j.arrival_s - first,
                ..j.clone()
            })
            .collect();
        let trace = Trace {
            format: self.format,
            start_unix_s: self.start_unix_s + first,
            jobs,
        };
        Some((trace, first))
    }

    /// The trace `times` times back to back (a load test of the engine): copy `k` arrives
    /// `k x (span + mean gap)` after the first, the mean gap (`span / (jobs - 1)`, or 60 s for a
    /// one-job trace) keeping the last job of a copy apart from the first of the next. Ids run on.
    pub fn repeat(&self, times: u32) -> Trace {
        let n = self.jobs.len();
        let gap = if n > 1 { self.span_s() / (n - 1) as f64 } else { 60.0 };
        let period = self.span_s() + gap;
        let mut jobs = Vec::with_capacity(n * times as usize);
        for k in 0..times.max(1) {
            for j in &self.jobs {
                jobs.push(TraceJob {
                    id: jobs.len() as u64,
                    arrival_s: j.arrival_s + k as f64 * period,
                    ..j.clone()
                });
            }
        }
        Trace {
            format: self.format,
            start_unix_s: self.start_unix_s,
            jobs,
        }
    }
}

#[derive(Clone, Copy)]
enum Columns {
    Philly {
        ts: usize,
        dur: usize,
        gpus: usize,
        cluster: Option<usize>,
    },
    Azure {
        ts: usize,
        ctx: usize,
        gen: usize,
    },
}

fn clamp_duration(d: f64) -> f64 {
    if d > 0.0 {
        d
    } else {
        1.0
    }
}

fn csv_error(name: &str, e: &csv::Error) -> TraceError {
    let line = e.position().map(|p| p.line()).unwrap_or(0);
    let reason = match e.kind() {
        csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
            format!("expected {expected_len} fields, found {len}")
        }
        _ => e.to_string(),
    };
    TraceError::BadRow {
        path: name.to_string(),
        line,
        reason,
    }
}

/// Whole GPUs: `4`, or `4.0`; at least 1.
fn parse_gpus(s: &str) -> Result<u32, String> {
    let g: f64 = s.parse().map_err(|_| "not a number".to_string())?;
    if !(g.is_finite() && g.fract() == 0.0) {
        return Err("not a whole number of GPUs".into());
    }
    if g < 1.0 {
        return Err("a job must ask for at least 1 GPU".into());
    }
    if g > u32::MAX as f64 {
        return Err("too many GPUs".into());
    }
    Ok(g as u32)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400; // [0, 399]
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if is_leap(y) => 29,
        _ => 28,
    }
}

/// `YYYY-MM-DD HH:MM:SS[.f{1,9}]` (a `T` instead of the space and a trailing `Z` are accepted),
/// read as UTC, to unix nanoseconds.
fn parse_timestamp_ns(s: &str) -> Result<i64, String> {
    let s = s.trim();
    let s = s.strip_suffix('Z').unwrap_or(s);
    let (date, time) = s
        .split_once([' ', 'T'])
        .ok_or_else(|| "expected `YYYY-MM-DD HH:MM:SS`".to_string())?;
    let num = |part: &str, what: &str| -> Result<i64, String> {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("bad {what} {part:?}"));
        }
        part.parse::<i64>().map_err(|_| format!("bad {what} {part:?}"))
    };
    let mut dp = date.split('-');
    let (Some(y), Some(mo), Some(d), None) = (dp.next(), dp.next(), dp.next(), dp.next()) else {
        return Err("expected a date `YYYY-MM-DD`".into());
    };
    let (y, mo, d) = (num(y, "year")?, num(mo, "month")?, num(d, "day")?);
    if !(1..=12).contains(&mo) {
        return Err(format!("month {mo} out of range"));
    }
    if d < 1 || d > days_in_month(y, mo as u32) as i64 {
        return Err(format!("day {d} out of range"));
    }
    let (hms, frac) = match time.split_once('.') {
        Some((hms, frac)) => (hms, Some(frac)),
        None => (time, None),
    };
    let mut tp = hms.split(':');
    let (Some(h), Some(mi), Some(sec), None) = (tp.next(), tp.next(), tp.next(), tp.next()) else {
        return Err("expected a time `HH:MM:SS`".into());
    };
    let (h, mi, sec) = (num(h, "hour")?, num(mi, "minute")?, num(sec, "second")?);
    if h > 23 || mi > 59 || sec > 59 {
        return Err("time of day out of range".into());
    }
    let nanos = match frac {
        None => 0,
        Some(f) => {
            if f.is_empty() || f.len() > 9 || !f.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("bad fractional seconds {f:?}"));
            }
            num(f, "fractional seconds")? * 10i64.pow(9 - f.len() as u32)
        }
    };
    let secs = days_from_civil(y, mo as u32, d as u32) * 86_400 + h * 3600 + mi * 60 + sec;
    secs.checked_mul(1_000_000_000)
        .and_then(|ns| ns.checked_add(nanos))
        .ok_or_else(|| "timestamp out of range".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PHILLY_WEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/philly/philly-busy-week.csv");
    const PHILLY_SHORT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/philly/philly-short.csv");
    const AZURE_10MIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/azure/azure-code-10min.csv");

    fn unix(s: &str) -> i64 {
        parse_timestamp_ns(s).unwrap().div_euclid(1_000_000_000)
    }

    #[test]
    fn days_from_civil_matches_known_unix_times() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
        assert_eq!(unix("1970-01-01 00:00:00"), 0);
        assert_eq!(unix("1969-12-31 00:00:00"), -86_400);
        assert_eq!(unix("2000-03-01 00:00:00"), 951_868_800);
        assert_eq!(unix("2017-10-09 07:01:55"), 1_507_532_515);
        assert_eq!(unix("2023-11-16 18:17:03"), 1_700_158_623);
        assert_eq!(unix("2024-02-29 23:59:59"), 1_709_251_199);
        assert_eq!(unix("2017-10-09T07:01:55Z"), 1_507_532_515);
    }

    #[test]
    fn timestamps_with_fractions_and_bad_timestamps() {
        assert_eq!(
            parse_timestamp_ns("2023-11-16 18:17:03.9799600").unwrap(),
            1_700_158_623_979_960_000
        );
        assert_eq!(
            parse_timestamp_ns("2023-11-16 18:17:03.5").unwrap(),
            1_700_158_623_500_000_000
        );
        for bad in [
            "2023-11-16",
            "2023-13-01 00:00:00",
            "2023-02-29 00:00:00",
            "2023-11-16 24:00:00",
            "2023-11-16 18:17:03.",
            "2023-11-16 18:17:03.1234567890",
            "2023-11-16 18:17",
            "yesterday",
        ] {
            assert!(parse_timestamp_ns(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn shipped_philly_week_parses() {
        let t = Trace::load(Path::new(PHILLY_WEEK), AzureModel::default()).unwrap();
        assert_eq!(t.format, TraceFormat::Philly);
        assert_eq!(t.jobs.len(), 9931);
        assert_eq!(t.start_unix_s, unix("2017-10-22 00:01:55") as f64);
        assert_eq!(t.jobs[0].arrival_s, 0.0);
        assert!(t.jobs.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert!(t
            .jobs
            .iter()
            .enumerate()
            .all(|(i, j)| j.id == i as u64 && j.gpus >= 1 && j.duration_s > 0.0));
        assert!(t.span_s() < 7.0 * 86_400.0 && t.span_s() > 6.9 * 86_400.0);
        // 135,894.6 GPU-hours (data/README.md).
        assert!(
            (t.gpu_seconds() / 3600.0 - 135_894.6).abs() < 0.1,
            "{}",
            t.gpu_seconds() / 3600.0
        );
        assert!(t.jobs.iter().any(|j| j.project == "6c71a0"));
    }

    #[test]
    fn shipped_philly_short_parses() {
        let t = Trace::load(Path::new(PHILLY_SHORT), AzureModel::default()).unwrap();
        assert_eq!(t.format, TraceFormat::Philly);
        assert_eq!(t.jobs.len(), 200);
        assert_eq!(t.start_unix_s, unix("2017-10-22 02:01:55") as f64);
        assert_eq!(t.jobs[0].duration_s, 72.0);
        assert_eq!(t.jobs[0].project, "11cb48");
        assert_eq!(t.span_s(), 24.0 * 60.0 + 59.0);
    }

    #[test]
    fn shipped_azure_slice_parses() {
        let t = Trace::load(Path::new(AZURE_10MIN), AzureModel::default()).unwrap();
        assert_eq!(t.format, TraceFormat::Azure);
        assert_eq!(t.jobs.len(), 1482);
        assert_eq!(t.start_unix_s, 1_700_158_623.979_96);
        assert!(t.span_s() < 600.0 && t.span_s() > 580.0);
        assert!(t.jobs.iter().all(|j| j.gpus == 1 && j.project == "azure"));
        // First row: 4808 context tokens, 10 generated.
        let m = AzureModel::default();
        let want = 4808.0 / m.prefill_tokens_per_s + 10.0 / m.decode_tokens_per_s;
        assert!((t.jobs[0].duration_s - want).abs() < 1e-12);
        // Second row arrives 0.052 s later.
        assert!((t.jobs[1].arrival_s - 0.052).abs() < 1e-9);
    }

    #[test]
    fn rows_are_sorted_by_arrival_then_row_order() {
        let text = "timestamp,duration,num_gpus,gpu_time,cluster\n\
                    2017-10-09 07:01:55,66.0,1,66.0,b\n\
                    2017-10-09 06:13:03,2951.0,2,5902.0,a\n\
                    2017-10-09 07:01:55,10.0,4,40.0,c\n\
                    2017-10-09 06:13:03,0.0,1,0.0,d\n\
                    \n";
        let t = Trace::parse_str("mem", text, AzureModel::default()).unwrap();
        let order: Vec<&str> = t.jobs.iter().map(|j| j.project.as_str()).collect();
        assert_eq!(order, ["a", "d", "b", "c"]);
        assert_eq!(t.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(
            t.jobs.iter().map(|j| j.arrival_s).collect::<Vec<_>>(),
            [0.0, 0.0, 2932.0, 2932.0]
        );
        assert_eq!(t.jobs[1].duration_s, 1.0, "zero duration is clamped to 1 s");
        assert_eq!(t.start_unix_s, unix("2017-10-09 06:13:03") as f64);
        assert_eq!(t.span_s(), 2932.0);
        assert_eq!(t.gpu_seconds(), 2951.0 * 2.0 + 1.0 + 66.0 + 40.0);
    }

    #[test]
    fn bad_row_names_file_and_line() {
        let text = "timestamp,duration,num_gpus,gpu_time,cluster\n\
                    2017-10-09 07:01:55,66.0,1,66.0,b\n\
                    2017-10-09 06:13:03,lots,2,5902.0,a\n";
        match Trace::parse_str("t.csv", text, AzureModel::default()) {
            Err(e @ TraceError::BadRow { line: 3, .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("t.csv") && msg.contains("line 3") && msg.contains("duration"),
                    "{msg}"
                );
            }
            other => panic!("expected BadRow at line 3, got {other:?}"),
        }
        for (row, what) in [
            ("2017-10-09 06:13:03,5.0,0,0.0,a", "num_gpus"),
            ("2017-10-09 06:13:03,5.0,1.5,0.0,a", "num_gpus"),
            ("2017-10-09 25:13:03,5.0,1,5.0,a", "timestamp"),
            ("2017-10-09 06:13:03,5.0,1", "fields"),
        ] {
            let text = format!("timestamp,duration,num_gpus,gpu_time,cluster\n{row}\n");
            match Trace::parse_str("t.csv", &text, AzureModel::default()) {
                Err(e @ TraceError::BadRow { line: 2, .. }) => assert!(e.to_string().contains(what), "{e}"),
                other => panic!("{row}: expected BadRow at line 2, got {other:?}"),
            }
        }
        let azure = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,-4,10\n";
        assert!(matches!(
            Trace::parse_str("a.csv", azure, AzureModel::default()),
            Err(TraceError::BadRow { line: 2, .. })
        ));
    }

    #[test]
    fn unknown_header_and_empty_and_missing_file() {
        match Trace::parse_str("x.csv", "a,b,c\n1,2,3\n", AzureModel::default()) {
            Err(e @ TraceError::UnknownFormat { .. }) => {
                let TraceError::UnknownFormat { ref header, .. } = e else {
                    unreachable!()
                };
                assert_eq!(header, "a,b,c");
                assert!(e.to_string().contains("x.csv"));
            }
            other => panic!("expected UnknownFormat, got {other:?}"),
        }
        assert!(matches!(
            Trace::parse_str(
                "e.csv",
                "TIMESTAMP,ContextTokens,GeneratedTokens\n",
                AzureModel::default()
            ),
            Err(TraceError::Empty { .. })
        ));
        assert!(matches!(
            Trace::parse_str("e.csv", "", AzureModel::default()),
            Err(TraceError::Empty { .. })
        ));
        let missing = Trace::load(Path::new("/nonexistent/trace.csv"), AzureModel::default());
        match missing {
            Err(e @ TraceError::Io { .. }) => assert!(e.to_string().contains("/nonexistent/trace.csv")),
            other => panic!("expected Io, got {other:?}"),
        }
    }

    #[test]
    fn azure_item_durations_follow_the_model() {
        let model = AzureModel {
            prefill_tokens_per_s: 1000.0,
            decode_tokens_per_s: 10.0,
        };
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:17:04.0319600,500,20\n\
                    2023-11-16 18:17:03.9799600,2000,0\n\
                    2023-11-16 18:17:05.0000000,0,0\n";
        let t = Trace::parse_str("a", text, model).unwrap();
        assert_eq!(t.format, TraceFormat::Azure);
        assert_eq!(t.jobs.len(), 3);
        assert_eq!(t.jobs[0].duration_s, 2.0); // 2000/1000 + 0/10
        assert!((t.jobs[1].arrival_s - 0.052).abs() < 1e-12);
        assert_eq!(t.jobs[1].duration_s, 2.5); // 500/1000 + 20/10
        assert_eq!(t.jobs[2].duration_s, 1.0, "a zero-token request is clamped to 1 s");
        assert!(t.jobs.iter().all(|j| j.gpus == 1 && j.project == "azure"));

        // The default model reproduces both published rows it was fitted to (within 0.1 %).
        let m = AzureModel::default();
        for (input, out_tok_s) in [(128.0, 3240.0), (2048.0, 581.0)] {
            let predicted = 128.0 / m.item_seconds(input, 128.0);
            assert!((predicted / out_tok_s - 1.0).abs() < 1e-3, "{input}: {predicted}");
        }
    }

    fn hand_trace(arrivals: &[f64]) -> Trace {
        Trace {
            format: TraceFormat::Philly,
            start_unix_s: 1_000.0,
            jobs: arrivals
                .iter()
                .enumerate()
                .map(|(i, &a)| TraceJob {
                    id: i as u64,
                    arrival_s: a,
                    duration_s: 10.0 * (i + 1) as f64,
                    gpus: 1,
                    project: format!("p{i}"),
                })
                .collect(),
        }
    }

    #[test]
    fn split_keeps_one_half_of_the_span_rebased() {
        // Span 0..100 s, cut at 50 s.
        let t = hand_trace(&[0.0, 10.0, 40.0, 50.0, 60.0, 100.0]);
        let (train, info) = t.split(Half::Train).unwrap();
        assert_eq!(
            train.jobs.iter().map(|j| j.arrival_s).collect::<Vec<_>>(),
            [0.0, 10.0, 40.0]
        );
        assert_eq!(
            train.jobs.iter().map(|j| j.project.as_str()).collect::<Vec<_>>(),
            ["p0", "p1", "p2"]
        );
        assert_eq!(train.start_unix_s, 1_000.0);
        assert_eq!(
            info,
            SplitInfo {
                half: Half::Train,
                offset_s: 0.0,
                cut_s: 50.0,
                original_jobs: 6
            }
        );
        let (test, info) = t.split(Half::Test).unwrap();
        // The job at the cut goes to the test half; arrivals re-based to its first job.
        assert_eq!(
            test.jobs.iter().map(|j| j.arrival_s).collect::<Vec<_>>(),
            [0.0, 10.0, 50.0]
        );
        assert_eq!(test.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(test.jobs[0].duration_s, 40.0);
        assert_eq!(test.start_unix_s, 1_050.0);
        assert_eq!((info.half, info.offset_s), (Half::Test, 50.0));
        // The halves partition the jobs.
        assert_eq!(train.jobs.len() + test.jobs.len(), t.jobs.len());
        // One instant: no train half.
        let one = hand_trace(&[0.0, 0.0]);
        assert!(matches!(one.split(Half::Train), Err(TraceError::Empty { .. })));
        assert_eq!(one.split(Half::Test).unwrap().0.jobs.len(), 2);
        assert_eq!("test".parse::<Half>(), Ok(Half::Test));
        assert!("both".parse::<Half>().is_err());
    }

    #[test]
    fn the_shipped_week_splits_into_two_halves_of_its_span() {
        let t = Trace::load(Path::new(PHILLY_WEEK), AzureModel::default()).unwrap();
        let (a, ia) = t.split(Half::Train).unwrap();
        let (b, ib) = t.split(Half::Test).unwrap();
        assert_eq!(a.jobs.len() + b.jobs.len(), 9931);
        assert!(a.span_s() < t.span_s() / 2.0 && b.span_s() <= t.span_s() / 2.0);
        assert!((ib.offset_s - ia.cut_s) >= 0.0 && ib.offset_s - ia.cut_s < 3600.0);
        assert_eq!(b.start_unix_s, t.start_unix_s + ib.offset_s);
    }

    #[test]
    fn a_project_replays_alone_rebased_to_its_first_job() {
        let mut t = hand_trace(&[0.0, 10.0, 40.0, 50.0, 60.0, 100.0]);
        for (j, p) in t.jobs.iter_mut().zip(["a", "b", "a", "c", "b", "a"]) {
            j.project = p.into();
        }
        let b = t.of_project("b").unwrap();
        assert_eq!(b.jobs.iter().map(|j| j.arrival_s).collect::<Vec<_>>(), [0.0, 50.0]);
        assert_eq!(b.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(
            b.jobs.iter().map(|j| j.duration_s).collect::<Vec<_>>(),
            [20.0, 50.0],
            "the project's own jobs"
        );
        assert_eq!(b.start_unix_s, 1_010.0);
        assert_eq!(t.of_project("a").unwrap().jobs.len(), 3);
        assert_eq!(
            t.projects(),
            [("a".to_string(), 3), ("b".to_string(), 2), ("c".to_string(), 1)]
        );
        let err = t.of_project("z").unwrap_err();
        assert!(matches!(err, TraceError::NoSuchProject { .. }));
        assert!(
            err.to_string().contains("\"z\"") && err.to_string().contains("a (3 jobs), b (2 jobs), c (1 job)"),
            "{err}"
        );
    }

    #[test]
    fn repeat_puts_copies_back_to_back() {
        // Span 100 s over 4 jobs: mean gap 33.3 s, period 133.3 s.
        let t = hand_trace(&[0.0, 10.0, 40.0, 100.0]);
        let r = t.repeat(3);
        assert_eq!(r.jobs.len(), 12);
        let period = 100.0 + 100.0 / 3.0;
        assert!((r.jobs[4].arrival_s - period).abs() < 1e-9);
        assert!((r.jobs[11].arrival_s - (2.0 * period + 100.0)).abs() < 1e-9);
        assert!(r.jobs.windows(2).all(|w| w[0].arrival_s < w[1].arrival_s));
        assert!(r.jobs.iter().enumerate().all(|(i, j)| j.id == i as u64));
        assert!((r.gpu_seconds() - 3.0 * t.gpu_seconds()).abs() < 1e-9);
        assert_eq!(t.repeat(1).jobs, t.jobs);
    }
}
