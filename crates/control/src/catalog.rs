//! The instance catalogue: builds [`Offering`]s from the CSV files in `data/catalog/`.
//!
//! Three inputs, all CSV with a header line (columns are found by name, extra columns are ignored):
//!
//! * instance specs (`gpu_instance_specs.csv`): `instance_type, vcpu, gpu_count, gpu_model,
//!   gpu_memory_gib_total, arch`, one row per EC2 type (`arch` is needed only to filter by
//!   [`CatalogOptions::arch`]);
//! * Linux prices per region (`prices-*.csv`, from `gpu_instance_linux_prices_by_region.csv`):
//!   `instance_type, region, linux_ondemand_usd_hr, spot_avg_usd_hr, pct_interrupt`;
//! * optionally the Spot Instance Advisor feed (`spot-advisor-gpu.csv`): `snapshot_commit_date,
//!   region, os, instance_type, interrupt_label` (and `interrupt_index`).
//!
//! Only the rows of the selected region are checked; a malformed value there is an error naming the
//! file, the line (the header is line 1) and the column. Price rows for instance types missing from
//! the specs are skipped, since no offering can be described without specs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use onoff_policy::{CapacityType, InterruptionBucket, Offering, OfferingKey};

/// What to build offerings for.
#[derive(Debug, Clone)]
pub struct CatalogOptions {
    /// AWS region, e.g. `us-east-1`. Default `us-east-1`.
    pub region: String,
    /// Availability zones to offer in. Default [`zones_for`] the region; an empty list also means
    /// [`zones_for`] the region.
    pub zones: Vec<String>,
    /// Keep only types whose `gpu_model` starts with `NVIDIA`. Default true.
    pub nvidia_only: bool,
    /// Keep only types of this CPU architecture (the specs' `arch` column), the one the workers'
    /// AMI is built for: an x86_64 AMI does not boot on a g5g (arm64). `None` keeps every type.
    /// Default `Some(Arch::X86_64)` (the default AMI's).
    pub arch: Option<Arch>,
}

/// A CPU architecture, as the specs' `arch` column and EC2 name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Arch {
    /// `x86_64`.
    #[default]
    X86_64,
    /// `arm64`.
    Arm64,
}

impl Arch {
    /// The name as EC2 and the specs write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Arm64 => "arm64",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Arch {
    type Err = String;

    /// `x86_64` or `arm64`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "x86_64" => Ok(Arch::X86_64),
            "arm64" => Ok(Arch::Arm64),
            other => Err(format!("unknown architecture {other:?} (expected x86_64 or arm64)")),
        }
    }
}

impl Default for CatalogOptions {
    fn default() -> Self {
        Self::for_region("us-east-1")
    }
}

impl CatalogOptions {
    /// Options for `region` with its default zones, `nvidia_only` and x86_64 types only.
    pub fn for_region(region: &str) -> Self {
        CatalogOptions {
            region: region.to_string(),
            zones: zones_for(region),
            nvidia_only: true,
            arch: Some(Arch::X86_64),
        }
    }
}

/// Default zone names of a region: `us-east-1a..f`, `us-west-2a..d`, `eu-west-1a..c`, otherwise
/// `<region>a..c`.
///
/// Zone names are account-specific letters, not zone IDs; these are the letters that exist.
pub fn zones_for(region: &str) -> Vec<String> {
    let letters = match region {
        "us-east-1" => "abcdef",
        "us-west-2" => "abcd",
        _ => "abc",
    };
    letters.chars().map(|c| format!("{region}{c}")).collect()
}

/// Why the catalogue could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file or directory.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A required file is missing from the catalogue directory.
    #[error("{dir}: no file matching {pattern}")]
    MissingFile {
        /// The directory.
        dir: String,
        /// The file name or pattern looked for.
        pattern: String,
    },
    /// The file is not well-formed CSV (e.g. a row with the wrong number of fields).
    #[error("{file}, line {line}: malformed CSV: {reason}")]
    Csv {
        /// The file.
        file: String,
        /// 1-based line (the header is line 1).
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// A required column is not in the header.
    #[error("{file}, line 1: missing column `{column}` in the header")]
    MissingColumn {
        /// The file.
        file: String,
        /// The column looked for.
        column: String,
    },
    /// A value could not be used.
    #[error("{file}, line {line}, column `{column}`: {reason} (value {value:?})")]
    BadValue {
        /// The file.
        file: String,
        /// 1-based line (the header is line 1).
        line: u64,
        /// The column.
        column: String,
        /// The value as read.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same instance type appears twice where it must appear once.
    #[error("{file}, line {line}: second row for `{key}` (the first is {first_file}, line {first_line})")]
    Duplicate {
        /// The file of the second row.
        file: String,
        /// Its line.
        line: u64,
        /// What is duplicated (instance type, and region where relevant).
        key: String,
        /// The file of the first row.
        first_file: String,
        /// Its line.
        first_line: u64,
    },
    /// Nothing could be offered in the region.
    #[error("no GPU offerings for region `{region}`: {detail}")]
    NoOfferings {
        /// The region asked for.
        region: String,
        /// Why, with the regions that do have prices.
        detail: String,
    },
}

/// Builds offerings: for each instance type with whole GPUs (gpu_count >= 1 and integral; skip fractional g6f/gr6f),
/// of the architecture [`CatalogOptions::arch`] (when set), priced in the region: one OnDemand offering per zone at linux_ondemand_usd_hr, and one Spot offering per zone at
/// spot_avg_usd_hr when present, with interruption bucket from the spot advisor CSV (newest snapshot, Linux, region)
/// or else from the prices CSV's pct_interrupt column. gpu_memory_gib = gpu_memory_gib_total / gpu_count.
/// nvidia_only keeps gpu_model starting with "NVIDIA". Sorted by key.
///
/// Errors name the inputs as `specs CSV`, `prices CSV` and `spot advisor CSV`;
/// [`load_offerings_from_dir`] names the files.
pub fn load_offerings(
    specs_csv: &str,
    prices_csv: &str,
    advisor_csv: Option<&str>,
    opts: &CatalogOptions,
) -> Result<Vec<Offering>, CatalogError> {
    build(
        Source {
            name: "specs CSV".into(),
            text: specs_csv,
        },
        &[Source {
            name: "prices CSV".into(),
            text: prices_csv,
        }],
        advisor_csv.map(|text| Source {
            name: "spot advisor CSV".into(),
            text,
        }),
        opts,
    )
}

/// Reads `gpu_instance_specs.csv`, every `prices-*.csv` (in name order) and, if present,
/// `spot-advisor-gpu.csv` from `dir`, then does what [`load_offerings`] does.
pub fn load_offerings_from_dir(dir: &Path, opts: &CatalogOptions) -> Result<Vec<Offering>, CatalogError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| CatalogError::Io {
            path: path.display().to_string(),
            source,
        })
    };
    let specs_path = dir.join("gpu_instance_specs.csv");
    if !specs_path.is_file() {
        return Err(CatalogError::MissingFile {
            dir: dir.display().to_string(),
            pattern: "gpu_instance_specs.csv".into(),
        });
    }
    let specs_text = read(&specs_path)?;

    let entries = std::fs::read_dir(dir).map_err(|source| CatalogError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut price_paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| CatalogError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("prices-") && name.ends_with(".csv") && entry.path().is_file() {
            price_paths.push(entry.path());
        }
    }
    price_paths.sort();
    if price_paths.is_empty() {
        return Err(CatalogError::MissingFile {
            dir: dir.display().to_string(),
            pattern: "prices-*.csv".into(),
        });
    }
    let price_texts = price_paths.iter().map(|p| read(p)).collect::<Result<Vec<_>, _>>()?;

    let advisor_path = dir.join("spot-advisor-gpu.csv");
    let advisor_text = if advisor_path.is_file() {
        Some(read(&advisor_path)?)
    } else {
        None
    };

    let prices: Vec<Source> = price_paths
        .iter()
        .zip(&price_texts)
        .map(|(p, t)| Source {
            name: p.display().to_string(),
            text: t,
        })
        .collect();
    build(
        Source {
            name: specs_path.display().to_string(),
            text: &specs_text,
        },
        &prices,
        advisor_text.as_deref().map(|text| Source {
            name: advisor_path.display().to_string(),
            text,
        }),
        opts,
    )
}

struct Source<'a> {
    name: String,
    text: &'a str,
}

/// One instance type's specs (whole-GPU types only).
struct Spec {
    gpus: u32,
    gpu_model: String,
    gpu_memory_gib: f64,
    vcpus: u32,
    /// `None` when the specs have no `arch` column (read only when filtering by it).
    arch: Option<Arch>,
}

/// One priced type in the region.
struct Price {
    ondemand: f64,
    spot_avg: Option<f64>,
    pct_interrupt: Option<InterruptionBucket>,
    file: String,
    line: u64,
}

fn build(
    specs: Source,
    prices: &[Source],
    advisor: Option<Source>,
    opts: &CatalogOptions,
) -> Result<Vec<Offering>, CatalogError> {
    let region = opts.region.as_str();
    let zones = if opts.zones.is_empty() {
        zones_for(region)
    } else {
        opts.zones.clone()
    };
    let specs = parse_specs(&specs, opts.arch.is_some())?;

    let mut priced: BTreeMap<String, Price> = BTreeMap::new();
    let mut regions_seen = BTreeSet::new();
    for src in prices {
        parse_prices(src, region, &mut priced, &mut regions_seen)?;
    }
    let advisor = match &advisor {
        Some(src) => parse_advisor(src, region)?,
        None => BTreeMap::new(),
    };

    let mut offerings = Vec::new();
    for (instance_type, price) in &priced {
        let Some(spec) = specs.get(instance_type) else { continue };
        if opts.nvidia_only && !spec.gpu_model.starts_with("NVIDIA") {
            continue;
        }
        if opts.arch.is_some_and(|a| spec.arch != Some(a)) {
            continue;
        }
        let offering = |zone: &str, capacity_type, price_usd_per_h, interruption| Offering {
            key: OfferingKey {
                instance_type: instance_type.clone(),
                zone: zone.to_string(),
                capacity_type,
            },
            gpus: spec.gpus,
            gpu_model: spec.gpu_model.clone(),
            gpu_memory_gib: spec.gpu_memory_gib,
            vcpus: spec.vcpus,
            price_usd_per_h,
            interruption,
        };
        for zone in &zones {
            offerings.push(offering(zone, CapacityType::OnDemand, price.ondemand, None));
            if let Some(spot) = price.spot_avg {
                let bucket = advisor.get(instance_type).copied().or(price.pct_interrupt);
                offerings.push(offering(zone, CapacityType::Spot, spot, bucket));
            }
        }
    }
    if offerings.is_empty() {
        let present = regions_seen.iter().cloned().collect::<Vec<_>>().join(", ");
        let detail = if priced.is_empty() {
            format!("the prices have no row with an on-demand price for this region (regions present: {present})")
        } else {
            format!(
                "{} instance types are priced there but none has whole {}GPUs{} in the specs",
                priced.len(),
                if opts.nvidia_only { "NVIDIA " } else { "" },
                opts.arch.map(|a| format!(" and arch {a}")).unwrap_or_default()
            )
        };
        return Err(CatalogError::NoOfferings {
            region: region.to_string(),
            detail,
        });
    }
    offerings.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(offerings)
}

/// A parsed CSV: header (trimmed) and data records with their line numbers.
struct Table<'a> {
    file: &'a str,
    headers: Vec<String>,
    rows: Vec<(u64, csv::StringRecord)>,
}

impl<'a> Table<'a> {
    fn read(src: &'a Source) -> Result<Table<'a>, CatalogError> {
        let file = src.name.as_str();
        let text = src.text.strip_prefix('\u{feff}').unwrap_or(src.text);
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(true)
            .trim(csv::Trim::All)
            .from_reader(text.as_bytes());
        let csv_err = |e: csv::Error| {
            let line = e.position().map(|p| p.line()).unwrap_or(0);
            let reason = match e.kind() {
                csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
                    format!("expected {expected_len} fields, found {len}")
                }
                _ => e.to_string(),
            };
            CatalogError::Csv {
                file: file.to_string(),
                line,
                reason,
            }
        };
        let headers = reader.headers().map_err(csv_err)?.iter().map(str::to_string).collect();
        let mut rows = Vec::new();
        for rec in reader.records() {
            let rec = rec.map_err(csv_err)?;
            let line = rec.position().map(|p| p.line()).unwrap_or(0);
            rows.push((line, rec));
        }
        Ok(Table { file, headers, rows })
    }

    fn col(&self, name: &str) -> Result<usize, CatalogError> {
        self.headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| CatalogError::MissingColumn {
                file: self.file.to_string(),
                column: name.to_string(),
            })
    }

    fn bad(&self, line: u64, column: &str, value: &str, reason: &str) -> CatalogError {
        CatalogError::BadValue {
            file: self.file.to_string(),
            line,
            column: column.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }

    /// A finite number >= 0 (or > 0 when `positive`); `None` for an empty cell.
    fn number(
        &self,
        line: u64,
        rec: &csv::StringRecord,
        col: usize,
        name: &str,
        positive: bool,
    ) -> Result<Option<f64>, CatalogError> {
        let v = rec.get(col).unwrap_or("");
        if v.is_empty() {
            return Ok(None);
        }
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() && (x > 0.0 || (!positive && x == 0.0)) => Ok(Some(x)),
            _ => Err(self.bad(
                line,
                name,
                v,
                if positive {
                    "expected a positive number"
                } else {
                    "expected a number >= 0"
                },
            )),
        }
    }

    fn required_number(
        &self,
        line: u64,
        rec: &csv::StringRecord,
        col: usize,
        name: &str,
        positive: bool,
    ) -> Result<f64, CatalogError> {
        self.number(line, rec, col, name, positive)?
            .ok_or_else(|| self.bad(line, name, "", "value is missing"))
    }
}

/// `need_arch`: the `arch` column is required (the catalogue is filtered by it).
fn parse_specs(src: &Source, need_arch: bool) -> Result<BTreeMap<String, Spec>, CatalogError> {
    let t = Table::read(src)?;
    let (c_type, c_vcpu, c_count, c_model, c_mem) = (
        t.col("instance_type")?,
        t.col("vcpu")?,
        t.col("gpu_count")?,
        t.col("gpu_model")?,
        t.col("gpu_memory_gib_total")?,
    );
    let c_arch = if need_arch { Some(t.col("arch")?) } else { None };
    let mut specs = BTreeMap::new();
    let mut first_line: BTreeMap<String, u64> = BTreeMap::new();
    for (line, rec) in &t.rows {
        let line = *line;
        let instance_type = rec.get(c_type).unwrap_or("");
        if instance_type.is_empty() {
            return Err(t.bad(line, "instance_type", "", "value is missing"));
        }
        if let Some(&first) = first_line.get(instance_type) {
            return Err(CatalogError::Duplicate {
                file: t.file.to_string(),
                line,
                key: instance_type.to_string(),
                first_file: t.file.to_string(),
                first_line: first,
            });
        }
        first_line.insert(instance_type.to_string(), line);
        // No GPU count, fewer than one GPU, or a fractional GPU (g6f, gr6f): not an offering.
        let Some(count) = t.number(line, rec, c_count, "gpu_count", false)? else {
            continue;
        };
        if count < 1.0 || count.fract() != 0.0 || count > u32::MAX as f64 {
            continue;
        }
        let vcpu_s = rec.get(c_vcpu).unwrap_or("");
        let vcpus = vcpu_s
            .parse::<u32>()
            .map_err(|_| t.bad(line, "vcpu", vcpu_s, "expected a whole number"))?;
        let mem_total = t.required_number(line, rec, c_mem, "gpu_memory_gib_total", false)?;
        let arch = match c_arch {
            Some(c) => {
                let v = rec.get(c).unwrap_or("");
                Some(v.parse::<Arch>().map_err(|e| t.bad(line, "arch", v, &e))?)
            }
            None => None,
        };
        specs.insert(
            instance_type.to_string(),
            Spec {
                gpus: count as u32,
                gpu_model: rec.get(c_model).unwrap_or("").to_string(),
                gpu_memory_gib: mem_total / count,
                vcpus,
                arch,
            },
        );
    }
    Ok(specs)
}

fn parse_prices(
    src: &Source,
    region: &str,
    priced: &mut BTreeMap<String, Price>,
    regions_seen: &mut BTreeSet<String>,
) -> Result<(), CatalogError> {
    let t = Table::read(src)?;
    let (c_type, c_region, c_od, c_spot, c_pct) = (
        t.col("instance_type")?,
        t.col("region")?,
        t.col("linux_ondemand_usd_hr")?,
        t.col("spot_avg_usd_hr")?,
        t.col("pct_interrupt")?,
    );
    for (line, rec) in &t.rows {
        let line = *line;
        let row_region = rec.get(c_region).unwrap_or("");
        regions_seen.insert(row_region.to_string());
        if row_region != region {
            continue;
        }
        let instance_type = rec.get(c_type).unwrap_or("");
        if instance_type.is_empty() {
            return Err(t.bad(line, "instance_type", "", "value is missing"));
        }
        if let Some(first) = priced.get(instance_type) {
            return Err(CatalogError::Duplicate {
                file: t.file.to_string(),
                line,
                key: format!("{instance_type} in {region}"),
                first_file: first.file.clone(),
                first_line: first.line,
            });
        }
        // No on-demand price: the type is not sold in the region.
        let Some(ondemand) = t.number(line, rec, c_od, "linux_ondemand_usd_hr", true)? else {
            continue;
        };
        let spot_avg = t.number(line, rec, c_spot, "spot_avg_usd_hr", true)?;
        let pct = rec.get(c_pct).unwrap_or("");
        let pct_interrupt = if pct.is_empty() {
            None
        } else {
            Some(InterruptionBucket::from_label(pct).ok_or_else(|| {
                t.bad(
                    line,
                    "pct_interrupt",
                    pct,
                    "expected one of <5%, 5-10%, 10-15%, 15-20%, >20%",
                )
            })?)
        };
        priced.insert(
            instance_type.to_string(),
            Price {
                ondemand,
                spot_avg,
                pct_interrupt,
                file: t.file.to_string(),
                line,
            },
        );
    }
    Ok(())
}

/// Interruption bucket per instance type from the newest advisor snapshot for (region, Linux).
fn parse_advisor(src: &Source, region: &str) -> Result<BTreeMap<String, InterruptionBucket>, CatalogError> {
    let t = Table::read(src)?;
    let (c_snap, c_region, c_os, c_type, c_label) = (
        t.col("snapshot_commit_date")?,
        t.col("region")?,
        t.col("os")?,
        t.col("instance_type")?,
        t.col("interrupt_label")?,
    );
    let c_index = t.col("interrupt_index").ok();
    let rows: Vec<&(u64, csv::StringRecord)> = t
        .rows
        .iter()
        .filter(|(_, r)| {
            r.get(c_region) == Some(region) && r.get(c_os).is_some_and(|os| os.eq_ignore_ascii_case("linux"))
        })
        .collect();
    // Snapshot dates are ISO `YYYY-MM-DD`, so the newest is the greatest string.
    let Some(newest) = rows
        .iter()
        .filter_map(|(_, r)| r.get(c_snap))
        .filter(|s| !s.is_empty())
        .max()
    else {
        return Ok(BTreeMap::new());
    };
    let mut out = BTreeMap::new();
    let mut first_line: BTreeMap<&str, u64> = BTreeMap::new();
    for (line, rec) in rows.iter().map(|(l, r)| (*l, r)) {
        if rec.get(c_snap) != Some(newest) {
            continue;
        }
        let instance_type = rec.get(c_type).unwrap_or("");
        if instance_type.is_empty() {
            return Err(t.bad(line, "instance_type", "", "value is missing"));
        }
        if let Some(&first) = first_line.get(instance_type) {
            return Err(CatalogError::Duplicate {
                file: t.file.to_string(),
                line,
                key: format!("{instance_type} in {region} (Linux, snapshot {newest})"),
                first_file: t.file.to_string(),
                first_line: first,
            });
        }
        first_line.insert(instance_type, line);
        let label = rec.get(c_label).unwrap_or("");
        let bucket = InterruptionBucket::from_label(label)
            .or_else(|| {
                c_index
                    .and_then(|c| rec.get(c))
                    .and_then(|i| i.parse::<u8>().ok())
                    .and_then(InterruptionBucket::from_index)
            })
            .ok_or_else(|| {
                t.bad(
                    line,
                    "interrupt_label",
                    label,
                    "expected one of <5%, 5-10%, 10-15%, 15-20%, >20%",
                )
            })?;
        out.insert(instance_type.to_string(), bucket);
    }
    Ok(out)
}

/// One spot price EC2 quotes now (`ec2:DescribeSpotPriceHistory`): what a spot instance of the
/// type costs in the zone, $/h.
#[derive(Debug, Clone, PartialEq)]
pub struct SpotQuote {
    /// EC2 instance type, e.g. `g5.xlarge`.
    pub instance_type: String,
    /// Availability zone, e.g. `us-east-1a`.
    pub zone: String,
    /// Price, $/h.
    pub usd_per_h: f64,
}

/// The lowest share of the on-demand price a spot quote may be and still be taken: 5 %. AWS
/// sells spot capacity "at up to a 90% discount compared to On-Demand prices" (Amazon EC2 Spot
/// Instances, aws.amazon.com/ec2/spot); a quote under a twentieth of on-demand is not a price EC2
/// charges (moto, the local emulator, quotes $0.00001 for every type).
pub const MIN_SPOT_SHARE_OF_ON_DEMAND: f64 = 0.05;

/// What [`apply_spot_quotes`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpotQuoteReport {
    /// Spot offerings whose price is now EC2's quote.
    pub applied: usize,
    /// Spot offerings EC2 quoted nothing for: they keep the catalogue's price.
    pub unquoted: usize,
    /// Quotes not taken, with the reason: not a positive finite price, or under
    /// [`MIN_SPOT_SHARE_OF_ON_DEMAND`] of the type's on-demand price. Their offerings keep the
    /// catalogue's price.
    pub refused: Vec<(OfferingKey, f64, &'static str)>,
}

/// Price each spot offering at EC2's current quote for its type and zone, in place of the
/// catalogue's (a regional average of a snapshot, `data/catalog`): spot prices differ by zone
/// and move, and both steer which offering is the cheapest per job and what the budget breaker
/// counts. A quote is refused (the catalogue's price kept) when it is not a positive finite
/// number or is under [`MIN_SPOT_SHARE_OF_ON_DEMAND`] of the type's on-demand price in the
/// catalogue. A quote above on-demand is taken as it is: such an offering is then priced out of
/// the choice, as on AWS, where the default maximum price is the on-demand price. On-demand
/// offerings and quotes for offerings not in `offerings` are left alone.
pub fn apply_spot_quotes(offerings: &mut [Offering], quotes: &[SpotQuote]) -> SpotQuoteReport {
    let quoted: BTreeMap<(&str, &str), f64> = quotes
        .iter()
        .map(|q| ((q.instance_type.as_str(), q.zone.as_str()), q.usd_per_h))
        .collect();
    let on_demand: BTreeMap<String, f64> = offerings
        .iter()
        .filter(|o| o.key.capacity_type == CapacityType::OnDemand)
        .map(|o| (o.key.instance_type.clone(), o.price_usd_per_h))
        .collect();
    let mut report = SpotQuoteReport::default();
    for o in offerings
        .iter_mut()
        .filter(|o| o.key.capacity_type == CapacityType::Spot)
    {
        let Some(&q) = quoted.get(&(o.key.instance_type.as_str(), o.key.zone.as_str())) else {
            report.unquoted += 1;
            continue;
        };
        let floor = on_demand
            .get(&o.key.instance_type)
            .map_or(0.0, |od| od * MIN_SPOT_SHARE_OF_ON_DEMAND);
        if !(q.is_finite() && q > 0.0) {
            report.refused.push((o.key.clone(), q, "not a positive price"));
        } else if q < floor {
            report
                .refused
                .push((o.key.clone(), q, "under 5 % of the on-demand price"));
        } else {
            o.price_usd_per_h = q;
            report.applied += 1;
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    const CATALOG_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/catalog");

    fn shipped(opts: &CatalogOptions) -> Result<Vec<Offering>, CatalogError> {
        load_offerings_from_dir(Path::new(CATALOG_DIR), opts)
    }

    fn find<'a>(offs: &'a [Offering], ty: &str, zone: &str, ct: CapacityType) -> &'a Offering {
        offs.iter()
            .find(|o| o.key.instance_type == ty && o.key.zone == zone && o.key.capacity_type == ct)
            .unwrap_or_else(|| panic!("no offering {ty}/{zone}/{ct:?}"))
    }

    const SPECS: &str = "instance_type,vcpu,memory_gib,gpu_count,gpu_model,gpu_memory_gib_total,arch\n\
                         g5.xlarge,4,16,1,NVIDIA A10G,24,x86_64\n\
                         g5.12xlarge,48,192,4,NVIDIA A10G,96,x86_64\n\
                         g6f.large,2,8,0.125,NVIDIA L4,3,x86_64\n\
                         g4ad.xlarge,4,16,1,AMD Radeon Pro V520,8,x86_64\n";
    const PRICES: &str = "instance_type,region,linux_ondemand_usd_hr,spot_min_usd_hr,spot_avg_usd_hr,spot_max_usd_hr,pct_interrupt,pct_savings_od\n\
                          g5.xlarge,us-east-1,1.006,0.3837,0.39388,0.4034,>20%,56\n\
                          g5.12xlarge,us-east-1,5.672,,,,,\n\
                          g6f.large,us-east-1,0.2,0.1,0.1,0.1,<5%,50\n\
                          g4ad.xlarge,us-east-1,0.37853,0.1011,0.104475,0.1089,<5%,68\n\
                          g5.xlarge,ap-south-1,0.9,,,,,\n";
    const ADVISOR: &str = "snapshot_commit_date,region,os,instance_type,interrupt_index,interrupt_label\n\
                           2024-02-28,us-east-1,Linux,g5.xlarge,0,<5%\n\
                           2025-06-28,us-east-1,Windows,g5.xlarge,1,5-10%\n\
                           2025-06-28,us-east-1,Linux,g5.xlarge,3,15-20%\n";

    #[test]
    fn zones_per_region() {
        assert_eq!(zones_for("us-east-1").len(), 6);
        assert_eq!(zones_for("us-east-1")[5], "us-east-1f");
        assert_eq!(
            zones_for("us-west-2"),
            ["us-west-2a", "us-west-2b", "us-west-2c", "us-west-2d"]
        );
        assert_eq!(zones_for("eu-west-1"), ["eu-west-1a", "eu-west-1b", "eu-west-1c"]);
        assert_eq!(zones_for("ap-south-1"), ["ap-south-1a", "ap-south-1b", "ap-south-1c"]);
        let d = CatalogOptions::default();
        assert_eq!(
            (d.region.as_str(), d.zones.len(), d.nvidia_only),
            ("us-east-1", 6, true)
        );
    }

    #[test]
    fn shipped_catalog_loads_for_us_east_1() {
        let offs = shipped(&CatalogOptions::default()).unwrap();
        let od = find(&offs, "g5.xlarge", "us-east-1a", CapacityType::OnDemand);
        assert_eq!(od.price_usd_per_h, 1.006);
        assert_eq!(od.gpus, 1);
        assert_eq!(od.gpu_memory_gib, 24.0);
        assert_eq!(od.vcpus, 4);
        assert_eq!(od.gpu_model, "NVIDIA A10G");
        assert_eq!(od.interruption, None);
        let spot = find(&offs, "g5.xlarge", "us-east-1f", CapacityType::Spot);
        assert_eq!(spot.price_usd_per_h, 0.39388);
        assert_eq!(spot.interruption, Some(InterruptionBucket::Over20));
        // The advisor (15-20%) wins over the prices file's pct_interrupt (>20%).
        let g4dn = find(&offs, "g4dn.xlarge", "us-east-1b", CapacityType::Spot);
        assert_eq!(g4dn.interruption, Some(InterruptionBucket::From15To20));
        // Not in the advisor feed: the prices file's bucket.
        let b200 = find(&offs, "p6-b200.48xlarge", "us-east-1c", CapacityType::Spot);
        assert_eq!(b200.interruption, Some(InterruptionBucket::Under5));
        assert_eq!(b200.gpus, 8);
        let p4d = find(&offs, "p4d.24xlarge", "us-east-1a", CapacityType::OnDemand);
        assert_eq!((p4d.gpus, p4d.gpu_memory_gib), (8, 40.0));

        // 52 x86_64 NVIDIA whole-GPU types priced in us-east-1, 42 of them with a spot price, 6
        // zones; the 6 arm64 g5g types (all with a spot price) are left out.
        assert_eq!(offs.len(), (52 + 42) * 6);
        assert!(!offs.iter().any(|o| o.key.instance_type.starts_with("g5g.")));
        assert!(
            offs.windows(2).all(|w| w[0].key < w[1].key),
            "sorted by key, no duplicates"
        );
        assert!(offs
            .iter()
            .all(|o| o.gpu_model.starts_with("NVIDIA") && o.gpus >= 1 && o.price_usd_per_h > 0.0));
        assert!(offs.iter().all(|o| o.key.zone.starts_with("us-east-1")));
        assert!(offs
            .iter()
            .all(|o| (o.key.capacity_type == CapacityType::OnDemand) == o.interruption.is_none()));
        // Fractional-GPU types are never offerings.
        assert!(!offs
            .iter()
            .any(|o| o.key.instance_type.starts_with("g6f.") || o.key.instance_type.starts_with("gr6f.")));
    }

    #[test]
    fn shipped_catalog_other_regions_and_non_nvidia() {
        let west = shipped(&CatalogOptions::for_region("us-west-2")).unwrap();
        let zones: BTreeSet<&str> = west.iter().map(|o| o.key.zone.as_str()).collect();
        assert_eq!(zones.len(), 4);
        let eu = shipped(&CatalogOptions::for_region("eu-west-1")).unwrap();
        assert!(eu
            .iter()
            .all(|o| ["eu-west-1a", "eu-west-1b", "eu-west-1c"].contains(&o.key.zone.as_str())));
        assert!(!eu.is_empty());

        let all = shipped(&CatalogOptions {
            nvidia_only: false,
            ..CatalogOptions::default()
        })
        .unwrap();
        assert!(all.iter().any(|o| o.gpu_model.starts_with("AMD")));
        assert!(!all.iter().any(|o| o.key.instance_type.starts_with("g6f.")));

        let one_zone = CatalogOptions {
            zones: vec!["us-east-1d".into()],
            ..CatalogOptions::default()
        };
        assert_eq!(shipped(&one_zone).unwrap().len(), 52 + 42);
    }

    #[test]
    fn offerings_are_filtered_by_the_ami_architecture() {
        let zone = |arch| CatalogOptions {
            zones: vec!["us-east-1d".into()],
            arch,
            ..CatalogOptions::default()
        };
        let arm = shipped(&zone(Some(Arch::Arm64))).unwrap();
        assert_eq!(arm.len(), 6 + 6);
        assert!(arm.iter().all(|o| o.key.instance_type.starts_with("g5g.")));
        assert_eq!(shipped(&zone(None)).unwrap().len(), 58 + 48);
        assert_eq!(CatalogOptions::default().arch, Some(Arch::X86_64));
        assert_eq!("arm64".parse::<Arch>(), Ok(Arch::Arm64));
        assert!("aarch64".parse::<Arch>().is_err());

        // From strings: an arm64 row is skipped for x86_64; the column is needed only to filter.
        let specs = format!("{SPECS}g5g.xlarge,4,8,1,NVIDIA T4G,16,arm64\n");
        let prices = format!("{PRICES}g5g.xlarge,us-east-1,0.42,0.1183,0.129125,0.14,<5%,70\n");
        let opts = CatalogOptions {
            zones: vec!["us-east-1a".into()],
            ..CatalogOptions::default()
        };
        let x86 = load_offerings(&specs, &prices, None, &opts).unwrap();
        assert!(!x86.iter().any(|o| o.key.instance_type == "g5g.xlarge"));
        let any = CatalogOptions {
            arch: None,
            ..opts.clone()
        };
        let all = load_offerings(&specs, &prices, None, &any).unwrap();
        assert!(all.iter().any(|o| o.key.instance_type == "g5g.xlarge"));
        let no_col = SPECS.replace(",arch", "").replace(",x86_64", "");
        assert!(load_offerings(&no_col, PRICES, None, &any).is_ok());
        assert!(matches!(
            load_offerings(&no_col, PRICES, None, &opts),
            Err(CatalogError::MissingColumn { .. })
        ));
        let bad = SPECS.replace(
            "g5.xlarge,4,16,1,NVIDIA A10G,24,x86_64",
            "g5.xlarge,4,16,1,NVIDIA A10G,24,mips",
        );
        let err = load_offerings(&bad, PRICES, None, &opts).unwrap_err();
        assert!(err.to_string().contains("column `arch`"), "{err}");
    }

    #[test]
    fn unknown_region_is_a_clear_error() {
        let err = shipped(&CatalogOptions::for_region("mars-north-1")).unwrap_err();
        assert!(matches!(err, CatalogError::NoOfferings { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("mars-north-1") && msg.contains("us-east-1") && msg.contains("eu-west-1"),
            "{msg}"
        );
    }

    #[test]
    fn malformed_price_names_file_line_and_column() {
        let bad = PRICES.replace("g5.12xlarge,us-east-1,5.672", "g5.12xlarge,us-east-1,5.67.2");
        let err = load_offerings(SPECS, &bad, None, &CatalogOptions::default()).unwrap_err();
        match &err {
            CatalogError::BadValue {
                line, column, value, ..
            } => {
                assert_eq!(
                    (*line, column.as_str(), value.as_str()),
                    (3, "linux_ondemand_usd_hr", "5.67.2")
                );
            }
            other => panic!("expected BadValue, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("prices CSV") && msg.contains("line 3") && msg.contains("linux_ondemand_usd_hr"),
            "{msg}"
        );

        let neg = PRICES.replace("0.39388", "-1");
        assert!(matches!(
            load_offerings(SPECS, &neg, None, &CatalogOptions::default()),
            Err(CatalogError::BadValue { line: 2, .. })
        ));
        let label = PRICES.replace(">20%,56", "often,56");
        assert!(matches!(
            load_offerings(SPECS, &label, None, &CatalogOptions::default()),
            Err(CatalogError::BadValue { line: 2, .. })
        ));
        // A malformed value in another region's row does not matter.
        let other = PRICES.replace("ap-south-1,0.9", "ap-south-1,cheap");
        assert!(load_offerings(SPECS, &other, None, &CatalogOptions::default()).is_ok());
        // Wrong field count and missing column.
        let short = PRICES.replace("g5.12xlarge,us-east-1,5.672,,,,,", "g5.12xlarge,us-east-1");
        assert!(matches!(
            load_offerings(SPECS, &short, None, &CatalogOptions::default()),
            Err(CatalogError::Csv { line: 3, .. })
        ));
        let nocol = PRICES.replace("linux_ondemand_usd_hr", "od");
        assert!(matches!(
            load_offerings(SPECS, &nocol, None, &CatalogOptions::default()),
            Err(CatalogError::MissingColumn { .. })
        ));
        let bad_spec = SPECS.replace("g5.12xlarge,48", "g5.12xlarge,many");
        let err = load_offerings(&bad_spec, PRICES, None, &CatalogOptions::default()).unwrap_err();
        assert!(err.to_string().contains("specs CSV, line 3, column `vcpu`"), "{err}");
        let dup = format!("{PRICES}g5.xlarge,us-east-1,1.1,,,,,\n");
        assert!(matches!(
            load_offerings(SPECS, &dup, None, &CatalogOptions::default()),
            Err(CatalogError::Duplicate {
                line: 7,
                first_line: 2,
                ..
            })
        ));
    }

    #[test]
    fn spot_offerings_take_ec2s_quote_per_zone_unless_it_is_no_price_ec2_charges() {
        let opts = CatalogOptions {
            zones: vec!["us-east-1a".into(), "us-east-1b".into()],
            ..CatalogOptions::default()
        };
        let mut offs = load_offerings(SPECS, PRICES, None, &opts).unwrap();
        let catalogue = offs.clone();
        let quote = |t: &str, z: &str, p: f64| SpotQuote {
            instance_type: t.into(),
            zone: z.into(),
            usd_per_h: p,
        };
        let report = apply_spot_quotes(
            &mut offs,
            &[
                // g5.xlarge is 1.006 $/h on demand: 0.31 is a price, 0.00001 (moto's) is not.
                quote("g5.xlarge", "us-east-1a", 0.31),
                quote("g5.xlarge", "us-east-1b", 0.000_01),
                // Not an offering here: ignored.
                quote("g5.xlarge", "us-east-1c", 0.2),
                quote("p5.48xlarge", "us-east-1a", 30.0),
            ],
        );
        let price = |o: &[Offering], z: &str, ct| find(o, "g5.xlarge", z, ct).price_usd_per_h;
        assert_eq!(price(&offs, "us-east-1a", CapacityType::Spot), 0.31);
        assert_eq!(
            price(&offs, "us-east-1b", CapacityType::Spot),
            price(&catalogue, "us-east-1b", CapacityType::Spot),
            "a refused quote keeps the catalogue's price"
        );
        assert_eq!(
            price(&offs, "us-east-1a", CapacityType::OnDemand),
            1.006,
            "on-demand is never quoted"
        );
        assert_eq!(report.applied, 1);
        assert_eq!(report.unquoted, 0);
        assert_eq!(report.refused.len(), 1);
        assert_eq!(report.refused[0].0.to_string(), "g5.xlarge/us-east-1b/spot");
        // The floor is 5 % of on-demand (0.0503 $/h); a quote above on-demand is taken.
        let mut offs = catalogue.clone();
        let report = apply_spot_quotes(
            &mut offs,
            &[
                quote("g5.xlarge", "us-east-1a", 0.051),
                quote("g5.xlarge", "us-east-1b", 0.050),
            ],
        );
        assert_eq!((report.applied, report.refused.len()), (1, 1));
        let r = apply_spot_quotes(&mut offs, &[quote("g5.xlarge", "us-east-1b", 1.2)]);
        assert_eq!((r.applied, r.unquoted), (1, 1));
        assert_eq!(price(&offs, "us-east-1b", CapacityType::Spot), 1.2);
        for bad in [f64::NAN, 0.0, -1.0, f64::INFINITY] {
            let mut o = catalogue.clone();
            let r = apply_spot_quotes(&mut o, &[quote("g5.xlarge", "us-east-1a", bad)]);
            assert_eq!((r.applied, r.refused[0].2), (0, "not a positive price"), "{bad}");
            assert_eq!(o, catalogue);
        }
    }

    #[test]
    fn offerings_from_strings() {
        let zones = vec!["us-east-1a".to_string(), "us-east-1b".to_string()];
        let opts = CatalogOptions {
            zones,
            ..CatalogOptions::default()
        };
        let offs = load_offerings(SPECS, PRICES, None, &opts).unwrap();
        let keys: Vec<String> = offs.iter().map(|o| o.key.to_string()).collect();
        assert_eq!(
            keys,
            [
                "g5.12xlarge/us-east-1a/on-demand",
                "g5.12xlarge/us-east-1b/on-demand",
                "g5.xlarge/us-east-1a/spot",
                "g5.xlarge/us-east-1a/on-demand",
                "g5.xlarge/us-east-1b/spot",
                "g5.xlarge/us-east-1b/on-demand",
            ]
        );
        assert_eq!(offs[0].gpu_memory_gib, 24.0);
        assert_eq!(
            offs[2].interruption,
            Some(InterruptionBucket::Over20),
            "from pct_interrupt"
        );

        // Newest Linux snapshot of the advisor wins over pct_interrupt.
        let offs = load_offerings(SPECS, PRICES, Some(ADVISOR), &opts).unwrap();
        assert_eq!(offs[2].interruption, Some(InterruptionBucket::From15To20));
        // Label missing: the index is used.
        let by_index = ADVISOR.replace("3,15-20%", "3,");
        let offs = load_offerings(SPECS, PRICES, Some(&by_index), &opts).unwrap();
        assert_eq!(offs[2].interruption, Some(InterruptionBucket::From15To20));

        // Empty zone list: the region's default zones.
        let offs = load_offerings(
            SPECS,
            PRICES,
            None,
            &CatalogOptions {
                zones: vec![],
                ..CatalogOptions::default()
            },
        )
        .unwrap();
        assert_eq!(offs.len(), 3 * 6);

        // Another region with its default zones.
        let south = load_offerings(SPECS, PRICES, None, &CatalogOptions::for_region("ap-south-1")).unwrap();
        assert_eq!(south.len(), 3);
        assert!(south
            .iter()
            .all(|o| o.price_usd_per_h == 0.9 && o.key.zone.starts_with("ap-south-1")));
        // No NVIDIA type with whole GPUs priced in the region.
        let specs_no_g5 = SPECS.replace("g5.xlarge,4,16,1,NVIDIA A10G,24,x86_64\n", "");
        let err = load_offerings(&specs_no_g5, PRICES, None, &CatalogOptions::for_region("ap-south-1")).unwrap_err();
        assert!(err.to_string().contains("none has whole NVIDIA GPUs"), "{err}");
    }

    #[test]
    fn missing_files_in_dir() {
        let dir = std::env::temp_dir().join(format!("onoff-catalog-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("gpu_instance_specs.csv"), SPECS).unwrap();
        let err = load_offerings_from_dir(&dir, &CatalogOptions::default()).unwrap_err();
        assert!(
            matches!(err, CatalogError::MissingFile { .. }) && err.to_string().contains("prices-*.csv"),
            "{err}"
        );
        std::fs::write(dir.join("prices-test.csv"), PRICES).unwrap();
        let offs = load_offerings_from_dir(&dir, &CatalogOptions::default()).unwrap();
        assert_eq!(offs.len(), 3 * 6);
        let bad = PRICES.replace("1.006", "x");
        std::fs::write(dir.join("prices-test.csv"), bad).unwrap();
        let err = load_offerings_from_dir(&dir, &CatalogOptions::default()).unwrap_err();
        assert!(err.to_string().contains("prices-test.csv, line 2"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = load_offerings_from_dir(&dir, &CatalogOptions::default()).unwrap_err();
        assert!(matches!(err, CatalogError::MissingFile { .. }));
    }
}
