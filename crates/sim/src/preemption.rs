//! Measured spot preemptions: per-zone availability series replayed over the simulated span.
//!
//! `--preemptions skypilot[:PATH]` reads the 1-node series of SkyPilot's spot traces (Can't Be
//! Late, NSDI'24; <https://github.com/skypilot-org/spot-traces>; a slice ships in
//! `data/skypilot/`). Each file is one zone's series for one instance type:
//! `{"metadata": {"gap_seconds": G}, "data": [0, 1, ...]}`, one value per tick of G seconds. In
//! the 1-node traces **1 means spot unavailable (the instance was preempted, or could not be
//! launched) and 0 available**: the upstream README calls a value "the number of available
//! instances", but the authors' simulator reads the 1-node series as
//! `spot_available = not trace[tick]` (sky_spot `env.py`, `TraceEnv.spot_available`), and so do
//! we. Multi-node series (values above 1) are refused.
//!
//! How the engine uses them (`engine.rs`): while a zone's series reads 1, every spot launch in
//! that zone fails with InsufficientInstanceCapacity (so the control plane's fallback and the
//! unavailable-offering TTL see the shortage as on AWS), and when it turns from 0 to 1, every spot
//! instance in the zone gets the 2-minute notice and is interrupted when it runs out. The series
//! stands for every GPU type of the zone (the measured type was p3.2xlarge): spot pools of one
//! zone are taken as moving together. The random Spot-Advisor interruptions are off in this mode;
//! the random `capacity_error_rate` of every launch call (spot and on-demand) still applies.
//!
//! Zone mapping ([`MeasuredPreemptions::map_zones`]): a simulated zone whose name has a series
//! (`us-east-1c` ← `us-east-1c_v100_1.json`) replays that series; the other zones, in name order,
//! take the unused series in name order; zones left over once every series is used reuse them
//! in name order again. When `m` zones share a series, the k-th of them (k = 0..m-1: the zone
//! named like the series first, then name order) starts k/m of the way into it, so they are not
//! preempted at the same instants. Every
//! series loops over the simulated span and starts (tick 0) at the trace's first arrival.

use std::path::Path;

/// One zone's series.
#[derive(Debug, Clone, PartialEq)]
pub struct ZoneSeries {
    /// Zone the series was measured in (the file name up to its first `_`).
    pub name: String,
    /// Seconds per tick.
    pub gap_s: f64,
    /// Spot unavailable at each tick (the series' 1s).
    pub unavailable: Vec<bool>,
    /// Ticks whose value differs from the tick before (cyclically: tick 0 against the last).
    changes: Vec<u64>,
}

impl ZoneSeries {
    /// A series from its values (0 = available, 1 = unavailable).
    ///
    /// # Errors
    /// An empty series, a gap that is not a positive number, or a value other than 0 and 1.
    pub fn new(name: &str, gap_s: f64, values: &[i64]) -> Result<ZoneSeries, String> {
        if values.is_empty() {
            return Err(format!("{name}: the series is empty"));
        }
        if !(gap_s.is_finite() && gap_s > 0.0) {
            return Err(format!("{name}: gap_seconds {gap_s} is not a positive number"));
        }
        if let Some(v) = values.iter().find(|v| !matches!(v, 0 | 1)) {
            return Err(format!(
                "{name}: value {v} is not 0 or 1; only 1-node series (1 = spot unavailable) can be replayed"
            ));
        }
        let unavailable: Vec<bool> = values.iter().map(|&v| v == 1).collect();
        let n = unavailable.len();
        let changes = (0..n)
            .filter(|&i| unavailable[i] != unavailable[(i + n - 1) % n])
            .map(|i| i as u64)
            .collect();
        Ok(ZoneSeries {
            name: name.to_string(),
            gap_s,
            unavailable,
            changes,
        })
    }

    /// Ticks in one pass of the series.
    pub fn len(&self) -> u64 {
        self.unavailable.len() as u64
    }

    /// Always false (a series has at least one tick).
    pub fn is_empty(&self) -> bool {
        self.unavailable.is_empty()
    }

    /// Unavailable at absolute tick `tick` (the series looped).
    pub fn unavailable_at(&self, tick: u64) -> bool {
        self.unavailable[(tick % self.len()) as usize]
    }

    /// The first absolute tick after `tick` whose value differs from the one before it; `None`
    /// for a constant series.
    pub fn next_change_after(&self, tick: u64) -> Option<u64> {
        let first = *self.changes.first()?;
        let len = self.len();
        let (cycle, pos) = (tick / len, tick % len);
        let i = self.changes.partition_point(|&c| c <= pos);
        Some(match self.changes.get(i) {
            Some(&c) => cycle * len + c,
            None => (cycle + 1) * len + first,
        })
    }

    /// Share of ticks unavailable.
    pub fn unavailable_share(&self) -> f64 {
        self.unavailable.iter().filter(|&&u| u).count() as f64 / self.unavailable.len() as f64
    }
}

/// A simulated zone and the series it replays.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ZoneMapping {
    /// The simulated zone (an offering's zone).
    pub zone: String,
    /// Index of the series in [`MeasuredPreemptions::series`].
    #[serde(skip)]
    pub series: usize,
    /// Name of the series' zone.
    pub series_zone: String,
    /// Ticks the zone starts into its series.
    #[serde(skip)]
    pub offset_ticks: u64,
    /// The same offset in seconds.
    pub offset_s: f64,
    /// Share of the series' ticks with spot unavailable.
    pub unavailable_share: f64,
}

/// A set of zone series (one folder of the SkyPilot traces, or a hand-made set).
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredPreemptions {
    /// Where the series came from (a path or a label).
    pub source: String,
    /// Series sorted by zone name.
    pub series: Vec<ZoneSeries>,
}

#[derive(serde::Deserialize)]
struct SeriesFile {
    metadata: SeriesMeta,
    data: Vec<i64>,
}

#[derive(serde::Deserialize)]
struct SeriesMeta {
    gap_seconds: f64,
}

impl MeasuredPreemptions {
    /// Series from `(zone, gap seconds, values)`, sorted by zone name.
    ///
    /// # Errors
    /// No series, two series of one zone, or a bad series ([`ZoneSeries::new`]).
    pub fn from_series(source: &str, series: &[(&str, f64, Vec<i64>)]) -> Result<Self, String> {
        let mut v = series
            .iter()
            .map(|(n, g, d)| ZoneSeries::new(n, *g, d))
            .collect::<Result<Vec<_>, _>>()?;
        Self::checked(source, &mut v)?;
        Ok(MeasuredPreemptions {
            source: source.to_string(),
            series: v,
        })
    }

    fn checked(source: &str, v: &mut [ZoneSeries]) -> Result<(), String> {
        if v.is_empty() {
            return Err(format!("{source}: no preemption series"));
        }
        v.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = v.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(format!("{source}: two series for zone {}", w[0].name));
        }
        Ok(())
    }

    /// Read a SkyPilot series file, or every `*.json` file of a folder (not its subfolders).
    ///
    /// # Errors
    /// Unreadable files, JSON not of the form above, multi-node values, no file, or two files
    /// of one zone; the message names the file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let files: Vec<std::path::PathBuf> = if path.is_dir() {
            let mut f: Vec<_> = std::fs::read_dir(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json"))
                .collect();
            f.sort();
            f
        } else {
            vec![path.to_path_buf()]
        };
        let mut series = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).map_err(|e| format!("cannot read {}: {e}", f.display()))?;
            let parsed: SeriesFile = serde_json::from_str(&text).map_err(|e| {
                format!(
                    "{}: not a SkyPilot series ({{\"metadata\": {{\"gap_seconds\": N}}, \"data\": [...]}}): {e}",
                    f.display()
                )
            })?;
            let stem = f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let zone = stem.split('_').next().unwrap_or(&stem).to_string();
            series.push(
                ZoneSeries::new(&zone, parsed.metadata.gap_seconds, &parsed.data)
                    .map_err(|e| format!("{}: {e}", f.display()))?,
            );
        }
        let source = path.display().to_string();
        Self::checked(&source, &mut series)?;
        Ok(MeasuredPreemptions { source, series })
    }

    /// Map simulated `zones` onto the series (rules in the module docs). Zones are deduplicated
    /// and sorted; the result is in that order.
    pub fn map_zones(&self, zones: &[String]) -> Vec<ZoneMapping> {
        let mut zones: Vec<&String> = zones.iter().collect();
        zones.sort();
        zones.dedup();
        let s = self.series.len();
        let mut pick: Vec<Option<usize>> = zones
            .iter()
            .map(|z| self.series.iter().position(|x| &x.name == *z))
            .collect();
        let mut used = vec![false; s];
        pick.iter().flatten().for_each(|&i| used[i] = true);
        let mut unused = (0..s).filter(|&i| !used[i]);
        let mut reuse = 0usize;
        for p in pick.iter_mut().filter(|p| p.is_none()) {
            *p = Some(unused.next().unwrap_or_else(|| {
                reuse += 1;
                (reuse - 1) % s
            }));
        }
        let pick: Vec<usize> = pick.into_iter().map(|p| p.expect("every zone has a series")).collect();
        let users = |i: usize| pick.iter().filter(|&&p| p == i).count() as u64;
        // Offsets: the zone named like its series first (it keeps offset 0), then name order.
        let exact = |k: usize| self.series[pick[k]].name == *zones[k];
        let order = (0..zones.len())
            .filter(|&k| exact(k))
            .chain((0..zones.len()).filter(|&k| !exact(k)));
        let mut nth = vec![0u64; s];
        let mut offsets = vec![0u64; zones.len()];
        for k in order {
            let i = pick[k];
            offsets[k] = nth[i] * self.series[i].len() / users(i);
            nth[i] += 1;
        }
        zones
            .iter()
            .enumerate()
            .map(|(k, z)| {
                let sr = &self.series[pick[k]];
                ZoneMapping {
                    zone: (*z).clone(),
                    series: pick[k],
                    series_zone: sr.name.clone(),
                    offset_ticks: offsets[k],
                    offset_s: offsets[k] as f64 * sr.gap_s,
                    unavailable_share: sr.unavailable_share(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/skypilot/aws-04-22-2023");

    #[test]
    fn next_change_loops_over_the_series() {
        // 0 0 1 1 1 0: changes at ticks 2 (-> 1) and 5 (-> 0); tick 0 equals the last tick.
        let s = ZoneSeries::new("z", 10.0, &[0, 0, 1, 1, 1, 0]).unwrap();
        assert_eq!(s.next_change_after(0), Some(2));
        assert_eq!(s.next_change_after(2), Some(5));
        assert_eq!(s.next_change_after(5), Some(8));
        assert_eq!(s.next_change_after(7), Some(8));
        assert!(s.unavailable_at(8) && !s.unavailable_at(11) && s.unavailable_at(14));
        // A change at tick 0 of the loop: 1 0 0.
        let w = ZoneSeries::new("w", 1.0, &[1, 0, 0]).unwrap();
        assert_eq!(w.next_change_after(0), Some(1));
        assert_eq!(w.next_change_after(1), Some(3));
        assert_eq!(ZoneSeries::new("c", 1.0, &[1, 1]).unwrap().next_change_after(0), None);
        assert!((s.unavailable_share() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn bad_series_are_refused_with_the_reason() {
        assert!(ZoneSeries::new("z", 10.0, &[]).unwrap_err().contains("empty"));
        assert!(ZoneSeries::new("z", 0.0, &[0]).unwrap_err().contains("gap"));
        assert!(ZoneSeries::new("z", 10.0, &[0, 4]).unwrap_err().contains("1-node"));
        assert!(MeasuredPreemptions::from_series("x", &[])
            .unwrap_err()
            .contains("no preemption"));
        let two = MeasuredPreemptions::from_series("x", &[("a", 1.0, vec![0]), ("a", 1.0, vec![1])]);
        assert!(two.unwrap_err().contains("two series"));
    }

    #[test]
    fn zones_map_by_name_then_unused_then_shared_with_offsets() {
        let m = MeasuredPreemptions::from_series(
            "t",
            &[
                ("us-west-2c", 1.0, vec![0; 100]),
                ("us-east-1c", 1.0, vec![0; 100]),
                ("us-east-1f", 1.0, vec![0; 40]),
                ("us-west-2b", 1.0, vec![0; 10]),
            ],
        )
        .unwrap();
        let zones: Vec<String> = ["f", "e", "d", "c", "b", "a"]
            .iter()
            .map(|l| format!("us-east-1{l}"))
            .collect();
        let got: Vec<(String, String, u64)> = m
            .map_zones(&zones)
            .into_iter()
            .map(|z| (z.zone, z.series_zone, z.offset_ticks))
            .collect();
        let want = [
            ("us-east-1a", "us-west-2b", 0),
            ("us-east-1b", "us-west-2c", 0),
            ("us-east-1c", "us-east-1c", 0),
            ("us-east-1d", "us-east-1c", 50),
            ("us-east-1e", "us-east-1f", 20),
            ("us-east-1f", "us-east-1f", 0),
        ];
        let want: Vec<(String, String, u64)> = want
            .iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), *c))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_shipped_slice_loads_as_four_zones() {
        let m = MeasuredPreemptions::load(Path::new(SHIPPED)).unwrap();
        let names: Vec<&str> = m.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c"]);
        for s in &m.series {
            assert_eq!(s.gap_s, 32.0);
            assert_eq!(s.len(), 19_961);
        }
        // Shares of unavailable ticks as counted in data/README.md.
        let shares: Vec<f64> = m.series.iter().map(|s| s.unavailable_share()).collect();
        for (got, want) in shares.iter().zip([0.314, 0.592, 0.793, 0.731]) {
            assert!((got - want).abs() < 0.001, "{shares:?}");
        }
        let e = MeasuredPreemptions::load(Path::new("/nonexistent/x.json")).unwrap_err();
        assert!(e.contains("/nonexistent/x.json"), "{e}");
    }
}
