//! Cost-aware offering choice: filter, score by expected cost per job, diversify.

use crate::config::{CapacityPreference, OfferConfig};
use crate::observation::UnavailableOffering;
use crate::offering::{CapacityType, Offering, OfferingKey};
use smallvec::SmallVec;

pub use crate::shape::fits;

/// Speed of `gpu_model` against the reference GPU (1.0 when not configured).
pub fn speed(cfg: &OfferConfig, gpu_model: &str) -> f64 {
    cfg.gpu_speed.get(gpu_model).copied().unwrap_or(1.0)
}

/// Expected cost of one job of `runtime_s` (on the reference GPU) on `offering`, in $:
/// `price/3600 x (boot + T x (1 + rate x (checkpoint/2 + boot)))` where `T = runtime / speed` and
/// `rate` is the offering's expected interruptions per second (0 on-demand). Each interruption
/// loses half a checkpoint interval of work on average plus a cold start of the replacement.
#[inline]
pub fn expected_cost_per_job(offering: &Offering, runtime_s: f64, instances: u32, cfg: &OfferConfig) -> f64 {
    cost_of(
        offering.price_usd_per_h / 3600.0,
        speed(cfg, &offering.gpu_model),
        interruption_loss(offering, cfg),
        cfg.boot_estimate_s,
        runtime_s,
        instances,
    )
}

/// `1 + rate x (checkpoint/2 + boot)`: the factor interruptions multiply an offering's work by.
#[inline]
fn interruption_loss(o: &Offering, cfg: &OfferConfig) -> f64 {
    let lost_per_interruption = cfg.checkpoint_interval_s / 2.0 + cfg.boot_estimate_s;
    1.0 + o.interruption_rate_per_s() * lost_per_interruption
}

/// [`expected_cost_per_job`] from its factors: `usd_per_s x (boot + runtime / speed x loss) x
/// instances`, $. One formula for the scan and the [`PriceTable`], so both give the same bits.
#[inline]
fn cost_of(usd_per_s: f64, speed: f64, loss: f64, boot_s: f64, runtime_s: f64, instances: u32) -> f64 {
    let work = runtime_s / speed * loss;
    usd_per_s * (boot_s + work) * instances as f64
}

/// Whether a job of a spot-first lane may run on an on-demand worker already up (or booting), $
/// figures per hour and instance: `price_usd_per_h` the worker's, `spot_usd_per_h` the best spot
/// price for its shape (`WorkerView::spot_price_usd_per_h`).
///
/// Taking it costs the job `(price - spot) x instances x runtime / 3600` more than spot; it saves
/// the cold start of a spot launch, billed (`spot x instances x boot / 3600`) and waited
/// (`wait_value_usd_per_h x (waited + boot) / 3600`, `boot` = `offers.boot_estimate_s`). A job
/// takes it while the premium is no more than what it saves: a short job, or one that has waited
/// long. Without this an on-demand worker launched for one such job took every job of its shape
/// from the queue, at the on-demand price, for as long as the queue lasted (41 h per instance on
/// the busy week with measured preemptions, README "Against issue 12's targets"). A job whose
/// deadline is at risk on spot is apart: it takes on-demand workers whatever this says.
pub fn worth_an_on_demand_worker(
    price_usd_per_h: f64,
    spot_usd_per_h: f64,
    instances: u32,
    runtime_s: f64,
    waited_s: f64,
    cfg: &crate::PolicyConfig,
) -> bool {
    let n = f64::from(instances.max(1));
    let boot = cfg.offers.boot_estimate_s;
    let premium = (price_usd_per_h - spot_usd_per_h) * n * runtime_s;
    let saved = cfg.scale_down.wait_value_usd_per_h * (waited_s + boot) + spot_usd_per_h * n * boot;
    premium <= saved
}

/// The lowest spot price of an offering with `gpus` GPUs of at least `gpu_memory_gib` GiB each
/// that passes the configured filters (allowed types, price and interruption caps), availability
/// ignored, $/h; `None` when there is none. What an on-demand worker of that shape is compared
/// with (`WorkerView::spot_price_usd_per_h`, [`worth_an_on_demand_worker`]). O(offerings).
pub fn best_spot_price_usd_per_h(
    offerings: &[Offering],
    gpus: u32,
    gpu_memory_gib: f64,
    cfg: &OfferConfig,
) -> Option<f64> {
    offerings
        .iter()
        .filter(|o| {
            o.key.capacity_type == CapacityType::Spot
                && o.gpus == gpus
                && o.gpu_memory_gib + 1e-9 >= gpu_memory_gib
                && passes_configured_filters(o, cfg)
        })
        .map(|o| o.price_usd_per_h)
        .min_by(f64::total_cmp)
}

/// Filter for one request shape.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// GPUs per instance.
    pub gpus: u32,
    /// Minimum GPU memory per GPU, GiB (already the max of the job's and the config's).
    pub min_mem_gib: f64,
    /// Capacity types allowed.
    pub capacity: CapacityPreference,
    /// Instances needed at once.
    pub instances: u32,
    /// Expected run time on the reference GPU, seconds.
    pub runtime_s: f64,
}

/// True when `o` passes every filter for `req` at `now`.
#[inline]
pub fn eligible(o: &Offering, req: &Request, cfg: &OfferConfig, unavailable: &[UnavailableOffering], now: f64) -> bool {
    capacity_ok(req.capacity, o.key.capacity_type)
        && fits(
            o.gpus,
            o.gpu_memory_gib,
            req.gpus,
            req.min_mem_gib,
            cfg.max_gpu_oversize,
        )
        && passes_configured_filters(o, cfg)
        && !unavailable.iter().any(|u| u.until > now && u.key == o.key)
}

/// Whether a request preferring `pref` may take capacity of type `ct`.
#[inline]
pub(crate) fn capacity_ok(pref: CapacityPreference, ct: CapacityType) -> bool {
    match pref {
        CapacityPreference::SpotFirst => true,
        CapacityPreference::SpotOnly => ct == CapacityType::Spot,
        CapacityPreference::OnDemand => ct == CapacityType::OnDemand,
    }
}

/// The filters of [`eligible`] that depend on neither the request nor the time: the price cap,
/// the interruption cap (spot only) and the allowed instance types.
#[inline]
fn passes_configured_filters(o: &Offering, cfg: &OfferConfig) -> bool {
    cfg.max_price_usd_per_h.is_none_or(|m| o.price_usd_per_h <= m)
        && (o.key.capacity_type == CapacityType::OnDemand
            || cfg
                .max_interruption
                .is_none_or(|m| o.interruption.is_some_and(|b| b <= m)))
        && (cfg.allowed_instance_types.is_empty() || cfg.allowed_instance_types.contains(&o.key.instance_type))
}

/// GPUs per instance the policy schedules a job asking for `gpus` per instance, with at least
/// `min_mem_gib` GiB per GPU, as: `gpus` itself when an offering passing the configured filters
/// (allowed types, price and interruption caps; any capacity type) fits it under the fit rule
/// ([`fits`]); otherwise the GPU count of the smallest such offering with enough GPUs and memory,
/// looking past a size the allowed types lack (in us-east-1 the default policy allows no x86_64
/// type with 2 GPUs: g3.8xlarge's have 8 GiB, under `min_gpu_memory_gib`; so a 2-GPU job runs on
/// a 4-GPU instance rather than never); `gpus` when none has enough, a job that admission
/// rejects. O(offerings).
pub fn schedule_gpus(offerings: &[Offering], gpus: u32, min_mem_gib: f64, cfg: &OfferConfig) -> u32 {
    let any = Request {
        gpus,
        min_mem_gib,
        capacity: CapacityPreference::SpotFirst,
        instances: 1,
        runtime_s: 0.0,
    };
    let mut smallest: Option<u32> = None;
    for o in offerings {
        if eligible(o, &any, cfg, &[], 0.0) {
            return gpus;
        }
        let big_enough = o.gpus >= gpus && o.gpu_memory_gib + 1e-9 >= min_mem_gib;
        if big_enough
            && smallest.is_none_or(|s| o.gpus < s)
            && eligible(o, &Request { gpus: o.gpus, ..any }, cfg, &[], 0.0)
        {
            smallest = Some(o.gpus);
        }
    }
    smallest.unwrap_or(gpus)
}

/// The fewest GPUs a job may ask for (per instance) and still be served by a worker of
/// `worker_gpus` GPUs with `worker_mem_gib` GiB each, as the policy matches jobs to workers: the
/// least `g` whose scheduled size ([`schedule_gpus`] over `offerings`, at the configured
/// `min_gpu_memory_gib`) fits the worker under the fit rule ([`fits`], `max_gpu_oversize`).
/// With the default rule (no job on twice the GPUs it asks for, rounded up to a power of two),
/// 5 for an 8-GPU worker, 2 for a 4-GPU worker in us-east-1's x86_64 catalogue (a 2-GPU job is
/// scheduled on 4) and 1 for a 1-GPU one. `worker_gpus` when none fits
/// (never less than 1). O(`worker_gpus` × offerings). The agent passes on a job asking for fewer
/// (`WorkerRecord::min_job_gpus`), as the simulator's workers never take one: an 8-GPU worker
/// launched for an 8-GPU job does not run a 1-GPU job at eight times the price while the 8-GPU
/// job waits and another is launched for it.
pub fn smallest_job_gpus(offerings: &[Offering], worker_gpus: u32, worker_mem_gib: f64, cfg: &OfferConfig) -> u32 {
    (1..=worker_gpus)
        .find(|&g| {
            let scheduled = schedule_gpus(offerings, g, cfg.min_gpu_memory_gib, cfg);
            fits(
                worker_gpus,
                worker_mem_gib,
                scheduled,
                cfg.min_gpu_memory_gib,
                cfg.max_gpu_oversize,
            )
        })
        .unwrap_or(worker_gpus)
        .max(1)
}

/// Eligible offerings for `req`, best (lowest expected cost per job) first, with their cost in $;
/// equal costs keep the order of `offerings`.
pub fn rank<'a>(
    offerings: &'a [Offering],
    req: &Request,
    cfg: &OfferConfig,
    unavailable: &[UnavailableOffering],
    now: f64,
) -> Vec<(&'a Offering, f64)> {
    let mut v: Vec<(&Offering, f64)> = offerings
        .iter()
        .filter(|o| eligible(o, req, cfg, unavailable, now))
        .map(|o| (o, expected_cost_per_job(o, req.runtime_s, req.instances, cfg)))
        .collect();
    // Stable: equal costs keep the input order (the catalogue is sorted by key), so the result is
    // deterministic without comparing keys.
    v.sort_by(|a, b| a.1.total_cmp(&b.1));
    v
}

/// The `k` best eligible offerings for `req` (lowest expected cost per job first; equal costs in
/// the order of `offerings`), as [`rank`] would list them first, without sorting all of them.
/// Builds a [`PriceTable`] for the one call: a caller ranking often over one catalogue keeps one
/// ([`RankMemo`]).
pub fn top<'a>(
    offerings: &'a [Offering],
    req: &Request,
    cfg: &OfferConfig,
    unavailable: &[UnavailableOffering],
    now: f64,
    k: usize,
) -> Vec<(&'a Offering, f64)> {
    PriceTable::new(offerings, cfg).top(offerings, req, unavailable, now, k)
}

/// One offering's parts of [`eligible`] and [`expected_cost_per_job`] that depend on neither the
/// request nor the time.
#[derive(Debug, Clone, Copy)]
struct Row {
    gpus: u32,
    mem_gib: f64,
    capacity_type: CapacityType,
    /// Passes the configured price, interruption and instance-type filters.
    allowed: bool,
    /// Price / 3600, $/s.
    usd_per_s: f64,
    /// [`speed`] of its GPU.
    speed: f64,
    /// 1 + its interruption rate x the work one interruption loses.
    loss: f64,
}

/// [`PriceTable`]'s index of offerings by key.
type ByKey = std::collections::HashMap<OfferingKey, usize, foldhash::fast::FixedState>;

/// [`eligible`] and [`expected_cost_per_job`] over one catalogue and configuration, with what
/// depends on neither the request nor the time computed once: each offering's price per second,
/// GPU speed (a map lookup by model name), interruption loss and configured filters, and the
/// catalogue indexed by GPUs per instance, so a request scans only the offerings the fit rule
/// allows, in groups of equal offerings priced once (one type's zones at one price). Same
/// results as [`top`] and [`eligible`], bit for bit (the same operations in the same order; a
/// property test checks it). Scale-up ranks offerings per job shape and run time on
/// every decision; with the table a full Philly replay takes 7 % fewer instructions
/// (fixed-idle-10m; onoff 2 %, `callgrind`).
#[derive(Debug)]
pub struct PriceTable {
    rows: Vec<Row>,
    /// Index of each offering by key, built at the first [`PriceTable::index_of`] (a
    /// stopped worker's offering) or ranking with offerings unavailable. foldhash, not the
    /// default SipHash: with measured preemptions each ranking looks up every offering marked
    /// unavailable, and SipHash was a seventh of a replay's instructions (`callgrind`).
    by_key: std::sync::OnceLock<ByKey>,
    /// (GPUs per instance, the offerings with that many in [`Group`]s), GPUs ascending.
    by_gpus: Vec<(u32, Vec<Group>)>,
    boot_s: f64,
    max_oversize: u32,
}

/// A set of a [`PriceTable`]'s offerings by index ([`PriceTable::blocked`]): one bit each.
#[derive(Debug, Default)]
pub(crate) struct Blocked(SmallVec<[u64; 8]>);

impl Blocked {
    /// Whether the offering at index `i` is in the set.
    #[inline]
    pub(crate) fn contains(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
}

/// Offerings of one [`PriceTable`] whose [`Row`]s are equal to the bit: the zones of one instance
/// type and capacity type where their prices are the same (the simulator's catalogue has one
/// price per type and region, in each of the region's zones). Whatever depends on the row alone
/// (eligibility but for availability, the expected cost of a request) is worked out once per
/// group: with measured preemptions a replay ranks the catalogue a few times per decision, and
/// the per-offering work was half its instructions (`callgrind`, README "Replays with measured
/// preemptions").
#[derive(Debug)]
struct Group {
    /// The members' row.
    row: Row,
    /// Indices of the members, ascending.
    members: Vec<usize>,
}

impl Row {
    /// Whether two rows are equal to the bit (`f64`s by their bits).
    fn same(&self, o: &Row) -> bool {
        self.gpus == o.gpus
            && self.mem_gib.to_bits() == o.mem_gib.to_bits()
            && self.capacity_type == o.capacity_type
            && self.allowed == o.allowed
            && self.usd_per_s.to_bits() == o.usd_per_s.to_bits()
            && self.speed.to_bits() == o.speed.to_bits()
            && self.loss.to_bits() == o.loss.to_bits()
    }
}

impl PriceTable {
    /// The table of `offerings` under `cfg`. O(offerings).
    pub fn new(offerings: &[Offering], cfg: &OfferConfig) -> Self {
        let rows: Vec<Row> = offerings
            .iter()
            .map(|o| Row {
                gpus: o.gpus,
                mem_gib: o.gpu_memory_gib,
                capacity_type: o.key.capacity_type,
                allowed: passes_configured_filters(o, cfg),
                usd_per_s: o.price_usd_per_h / 3600.0,
                speed: speed(cfg, &o.gpu_model),
                loss: interruption_loss(o, cfg),
            })
            .collect();
        let mut by_gpus: Vec<(u32, Vec<Group>)> = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            let groups = match by_gpus.iter_mut().find(|(g, _)| *g == r.gpus) {
                Some((_, v)) => v,
                None => {
                    by_gpus.push((r.gpus, Vec::new()));
                    &mut by_gpus.last_mut().expect("just pushed").1
                }
            };
            match groups.iter_mut().find(|g| g.row.same(r)) {
                Some(g) => g.members.push(i),
                None => groups.push(Group {
                    row: *r,
                    members: vec![i],
                }),
            }
        }
        by_gpus.sort_by_key(|(g, _)| *g);
        Self {
            rows,
            by_key: std::sync::OnceLock::new(),
            by_gpus,
            boot_s: cfg.boot_estimate_s,
            max_oversize: cfg.max_gpu_oversize,
        }
    }

    /// Offerings in the table.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True for an empty catalogue.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The groups of offerings whose GPU count the fit rule allows for `gpus` per instance.
    fn candidates(&self, gpus: u32) -> impl Iterator<Item = &Group> + '_ {
        let bounds = crate::shape::gpu_bounds(gpus, self.max_oversize);
        self.by_gpus
            .iter()
            .filter(move |(g, _)| bounds.contains(g))
            .flat_map(|(_, v)| v.iter())
    }

    /// [`eligible`] but for availability, for an offering of row `r`.
    #[inline]
    fn eligible(&self, r: &Row, req: &Request) -> bool {
        capacity_ok(req.capacity, r.capacity_type)
            && r.allowed
            && fits(r.gpus, r.mem_gib, req.gpus, req.min_mem_gib, self.max_oversize)
    }

    /// The offerings `unavailable` marks unavailable at `now`, as a set of the catalogue's
    /// indices; entries for offerings not in the catalogue are left out. Worked out once per
    /// ranking ([`PriceTable::top`]) or decision (`decide` shares one among its rankings and
    /// starts): with measured preemptions hundreds of offerings may be marked, and comparing each
    /// candidate's key with each mark was three fifths of a replay's instructions (`callgrind`).
    /// A bit set, not a sorted list: sorting the marks' indices was a twentieth.
    pub(crate) fn blocked(&self, offerings: &[Offering], unavailable: &[UnavailableOffering], now: f64) -> Blocked {
        let mut out = Blocked(SmallVec::new());
        if unavailable.iter().all(|u| u.until <= now) {
            return out;
        }
        out.0.resize(self.rows.len().div_ceil(64), 0);
        let by_key = self.by_key(offerings);
        for i in unavailable
            .iter()
            .filter(|u| u.until > now)
            .filter_map(|u| by_key.get(&u.key).copied())
        {
            out.0[i / 64] |= 1 << (i % 64);
        }
        out
    }

    /// The index of offering `key` in `offerings` (the table's catalogue), if it is there.
    pub(crate) fn index_of(&self, offerings: &[Offering], key: &OfferingKey) -> Option<usize> {
        self.by_key(offerings).get(key).copied()
    }

    /// Index of each offering of `offerings` (the table's catalogue) by key, built once.
    fn by_key(&self, offerings: &[Offering]) -> &ByKey {
        self.by_key
            .get_or_init(|| offerings.iter().enumerate().map(|(i, o)| (o.key.clone(), i)).collect())
    }

    /// [`expected_cost_per_job`] of an offering of row `r`, $.
    #[inline]
    fn cost(&self, r: &Row, runtime_s: f64, instances: u32) -> f64 {
        cost_of(r.usd_per_s, r.speed, r.loss, self.boot_s, runtime_s, instances)
    }

    /// The expected cost per job of `runtime_s` on a stopped worker of the offering at index `i`
    /// of the catalogue the table was built from ([`PriceTable::index_of`]), started again:
    /// [`expected_cost_per_job`] with `offers.restart_estimate_s` in place of the cold start, $
    /// per instance. `None` for an offering the configured filters (allowed types, price and
    /// interruption caps) now exclude.
    pub(crate) fn restart_cost_at(&self, i: usize, runtime_s: f64, cfg: &OfferConfig) -> Option<f64> {
        let r = &self.rows[i];
        r.allowed
            .then(|| cost_of(r.usd_per_s, r.speed, r.loss, cfg.restart_estimate_s, runtime_s, 1))
    }

    /// [`top`] over `offerings`, the catalogue the table was built from (debug builds check its
    /// length).
    pub fn top<'a>(
        &self,
        offerings: &'a [Offering],
        req: &Request,
        unavailable: &[UnavailableOffering],
        now: f64,
        k: usize,
    ) -> Vec<(&'a Offering, f64)> {
        self.top_in(offerings, req, &self.blocked(offerings, unavailable, now), k)
    }

    /// [`PriceTable::top`] with the offerings marked unavailable already looked up
    /// ([`PriceTable::blocked`]).
    pub(crate) fn top_in<'a>(
        &self,
        offerings: &'a [Offering],
        req: &Request,
        blocked: &Blocked,
        k: usize,
    ) -> Vec<(&'a Offering, f64)> {
        self.top_indices(offerings, req, blocked, k)
            .into_iter()
            .map(|(i, c)| (&offerings[i], c))
            .collect()
    }

    /// [`top`] as (index into `offerings`, expected cost per job in $).
    fn top_indices(&self, offerings: &[Offering], req: &Request, blocked: &Blocked, k: usize) -> Vec<(usize, f64)> {
        debug_assert_eq!(offerings.len(), self.rows.len(), "PriceTable: another catalogue");
        let mut best: Vec<(usize, f64)> = Vec::with_capacity(k + 1);
        if k == 0 {
            return best;
        }
        // Candidates come in index order within a GPU count only: order by (cost, index), as a
        // scan in index order that keeps the first of equal costs would.
        let before = |a: (usize, f64), b: &(usize, f64)| a.1 < b.1 || (a.1 == b.1 && a.0 < b.0);
        for g in self.candidates(req.gpus) {
            if !self.eligible(&g.row, req) {
                continue;
            }
            let c = self.cost(&g.row, req.runtime_s, req.instances);
            // Every member costs `c`: none comes before a full list's last at a higher cost.
            if best.len() == k && c > best[k - 1].1 {
                continue;
            }
            for &i in &g.members {
                if blocked.contains(i) {
                    continue;
                }
                if best.len() == k && !before((i, c), &best[k - 1]) {
                    // Members ascend: the rest of the group comes after this one too.
                    break;
                }
                let at = best.partition_point(|e| !before((i, c), e));
                best.insert(at, (i, c));
                best.truncate(k);
            }
        }
        best
    }

    /// The lowest expected cost per job of `req` on spot and on on-demand offerings, $ (infinite
    /// for a kind with none), with the request's capacity preference and availability ignored.
    pub fn cheapest_by_capacity(&self, req: &Request) -> (f64, f64) {
        let any = Request {
            capacity: CapacityPreference::SpotFirst,
            ..*req
        };
        let (mut spot, mut od) = (f64::INFINITY, f64::INFINITY);
        for g in self.candidates(req.gpus) {
            if !self.eligible(&g.row, &any) {
                continue;
            }
            let c = self.cost(&g.row, req.runtime_s, req.instances);
            match g.row.capacity_type {
                CapacityType::Spot => spot = spot.min(c),
                CapacityType::OnDemand => od = od.min(c),
            }
        }
        (spot, od)
    }
}

/// [`top`]'s rankings kept across decisions over one catalogue, and the catalogue's
/// [`PriceTable`]. The warm pool prices each job shape it holds no live worker for at the
/// offering a launch would take, on every decision: on a full Philly replay (~240,000 decisions
/// over one catalogue) ranking the catalogue for it was 9 % of the instructions (`callgrind`). A
/// ranking is reused while the inputs it was computed from are the same: the catalogue's address
/// and length, the configuration's address, the request and `k`, and the offerings unavailable at
/// the time; the table while the catalogue and the configuration are. Any change to those drops
/// what depends on them. A caller that edits its catalogue or [`OfferConfig`] in place must start
/// a new memo (debug builds panic when the catalogue's prices or shapes changed under one); then
/// what [`RankMemo::top`] returns is always what [`top`] returns for the same inputs.
#[derive(Debug, Default)]
pub struct RankMemo {
    basis: Option<Basis>,
    /// The live unavailable offerings the entries were ranked with.
    unavailable: Vec<OfferingKey>,
    /// (request, k) -> ranking as (offering index, expected cost per job in $). At most
    /// [`RankMemo::MAX_ENTRIES`]: past that, emptied (the warm pool asks for a few shapes).
    entries: Vec<(MemoKey, Vec<(usize, f64)>)>,
    /// Built on first use over the basis' catalogue and configuration.
    table: Option<PriceTable>,
    /// The warm pool's fractile samples per (lane, job shape) with the window demand they were
    /// taken from: the demand changes only as arrivals cross a window's edge, and `decide` runs
    /// on every arrival and minute (`decide::warm::Fractile::memoised`).
    pub(crate) fractiles: Vec<FractileEntry>,
    /// The keep-alive's facts per (lane, worker GPUs): the gap curve and mean worker units of the
    /// job shape those workers serve, with that shape's [`crate::observation::ShapeGaps::stamp`]
    /// (`decide::scale_down`): they change only with an arrival of the shape, and `decide` runs
    /// on every arrival and minute.
    pub(crate) shape_facts: Vec<ShapeFactsEntry>,
}

/// (lane, worker GPUs); the stamp of the shape's statistics and the (horizon, default run time)
/// bits the units were taken for; the facts: the gap curve (all gaps, trusted or not) and the
/// mean worker units of an arrival.
pub(crate) type ShapeFactsEntry = (
    (usize, u32),
    ([u64; 6], u64, u64),
    (std::sync::Arc<crate::keepalive::GapCurve>, f64),
);

/// (lane, GPUs of the job shape), the window demand, and the fractile's samples taken from it.
pub(crate) type FractileEntry = ((usize, u32), Vec<u32>, smallvec::SmallVec<[u32; 32]>);

/// The value kept in `entries` under `key` while `fresh` holds for the stamp it was kept with;
/// else `refresh`'s, which writes the new stamp over the old (a kept stamp's buffer is reused)
/// and returns the value to keep with it. At most 32 entries (a lane has a few job shapes and
/// worker sizes): past that, emptied. The memos of [`RankMemo`] that follow the arrivals (the
/// warm pool's fractile, the keep-alive's gap curve).
pub(crate) fn kept<K: PartialEq, S: Default, V>(
    entries: &mut Vec<(K, S, V)>,
    key: K,
    fresh: impl FnOnce(&S) -> bool,
    refresh: impl FnOnce(&mut S) -> V,
) -> &V {
    const MAX_KEPT: usize = 32;
    let at = match entries.iter().position(|e| e.0 == key) {
        Some(i) if fresh(&entries[i].1) => i,
        Some(i) => {
            entries[i].2 = refresh(&mut entries[i].1);
            i
        }
        None => {
            if entries.len() >= MAX_KEPT {
                entries.clear();
            }
            let mut stamp = S::default();
            let value = refresh(&mut stamp);
            entries.push((key, stamp, value));
            entries.len() - 1
        }
    };
    &entries[at].2
}

/// The catalogue and configuration a memo's rankings and table were computed over.
#[derive(Debug, PartialEq)]
struct Basis {
    /// Address and length.
    catalogue: (usize, usize),
    /// [`fingerprint`] of the catalogue (debug builds only; 0 otherwise).
    fingerprint: u64,
    cfg: usize,
}

/// A request and `k`, bit for bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MemoKey {
    gpus: u32,
    min_mem_bits: u64,
    capacity: CapacityPreference,
    instances: u32,
    runtime_bits: u64,
    k: usize,
}

impl RankMemo {
    /// Most rankings kept.
    pub const MAX_ENTRIES: usize = 64;

    /// [`top`] for the same arguments, from the memo when the inputs are unchanged (checked on
    /// every call: O(unavailable offerings)).
    pub fn top<'a>(
        &mut self,
        offerings: &'a [Offering],
        req: &Request,
        cfg: &OfferConfig,
        unavailable: &[UnavailableOffering],
        now: f64,
        k: usize,
    ) -> Vec<(&'a Offering, f64)> {
        self.check(offerings, cfg);
        self.check_unavailable(unavailable, now);
        let key = MemoKey {
            gpus: req.gpus,
            min_mem_bits: req.min_mem_gib.to_bits(),
            capacity: req.capacity,
            instances: req.instances,
            runtime_bits: req.runtime_s.to_bits(),
            k,
        };
        if let Some((_, ranked)) = self.entries.iter().find(|(k, _)| *k == key) {
            return ranked.iter().map(|&(i, c)| (&offerings[i], c)).collect();
        }
        let table = self.table.get_or_insert_with(|| PriceTable::new(offerings, cfg));
        let ranked = table.top_indices(offerings, req, &table.blocked(offerings, unavailable, now), k);
        if self.entries.len() >= Self::MAX_ENTRIES {
            self.entries.clear();
        }
        let out = ranked.iter().map(|&(i, c)| (&offerings[i], c)).collect();
        self.entries.push((key, ranked));
        out
    }

    /// The [`PriceTable`] of `offerings` under `cfg`, built once per catalogue and configuration.
    pub fn table(&mut self, offerings: &[Offering], cfg: &OfferConfig) -> &PriceTable {
        self.check(offerings, cfg);
        self.table.get_or_insert_with(|| PriceTable::new(offerings, cfg))
    }

    /// Drop everything unless the catalogue and configuration are those it was computed over.
    /// The catalogue is recognised by its address and length: fingerprinting its hundreds of
    /// offerings on every call cost half of what the memo saves (full Philly, `callgrind`).
    /// Debug builds (the tests) also fingerprint it and panic when it changed in place.
    fn check(&mut self, offerings: &[Offering], cfg: &OfferConfig) {
        let catalogue = (offerings.as_ptr() as usize, offerings.len());
        let cfg = std::ptr::from_ref(cfg) as usize;
        let fingerprint = if cfg!(debug_assertions) {
            fingerprint(offerings)
        } else {
            0
        };
        if let Some(b) = self.basis.as_ref().filter(|b| b.catalogue == catalogue) {
            assert_eq!(
                b.fingerprint, fingerprint,
                "RankMemo: the catalogue changed in place; start a new memo"
            );
        }
        if self
            .basis
            .as_ref()
            .is_some_and(|b| b.catalogue == catalogue && b.cfg == cfg)
        {
            return;
        }
        *self = Self {
            basis: Some(Basis {
                catalogue,
                fingerprint,
                cfg,
            }),
            ..Self::default()
        };
    }

    /// Drop the rankings unless the offerings unavailable at `now` are those they were ranked with.
    fn check_unavailable(&mut self, unavailable: &[UnavailableOffering], now: f64) {
        let live = || unavailable.iter().filter(|u| u.until > now).map(|u| &u.key);
        if !self.unavailable.iter().eq(live()) {
            self.entries.clear();
            self.unavailable = live().cloned().collect();
        }
    }
}

/// A hash of what ranks an offering besides its names: GPUs, memory, capacity type,
/// interruption bucket, price.
fn fingerprint(offerings: &[Offering]) -> u64 {
    offerings.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, o| {
        let word = o.price_usd_per_h.to_bits()
            ^ o.gpu_memory_gib.to_bits().rotate_left(17)
            ^ (u64::from(o.gpus) << 40)
            ^ ((o.key.capacity_type as u64) << 56)
            ^ (o.interruption.map_or(7, |b| b as u64) << 60);
        (h ^ word).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The offerings a launch is spread over: those within `diversify_tolerance` of the best
/// expected cost, at most `diversify` of them, best first. Empty when `ranked` is empty.
pub fn spread_pool<'a>(ranked: &[(&'a Offering, f64)], cfg: &OfferConfig) -> Vec<&'a Offering> {
    let Some(&(_, best)) = ranked.first() else {
        return Vec::new();
    };
    ranked
        .iter()
        .take_while(|(_, c)| *c <= best * (1.0 + cfg.diversify_tolerance) + 1e-12)
        .take(cfg.diversify as usize)
        .map(|(o, _)| *o)
        .collect()
}

/// Highest price in the [`spread_pool`], $/h: what one instance of a spread launch may cost, so
/// budget checks book that (0 when `ranked` is empty).
pub fn spread_max_price(ranked: &[(&Offering, f64)], cfg: &OfferConfig) -> f64 {
    spread_pool(ranked, cfg)
        .iter()
        .map(|o| o.price_usd_per_h)
        .fold(0.0, f64::max)
}

/// Spread `count` instances over the [`spread_pool`] round-robin (the best gets the remainder).
/// Returns (offering, instances) pairs, best first; empty when `ranked` is empty.
pub fn spread<'a>(ranked: &[(&'a Offering, f64)], count: u32, cfg: &OfferConfig) -> Vec<(&'a Offering, u32)> {
    let pool = spread_pool(ranked, cfg);
    let n = pool.len() as u32;
    pool.into_iter()
        .enumerate()
        .map(|(i, o)| (o, count / n + u32::from((i as u32) < count % n)))
        .filter(|(_, c)| *c > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CapacityPreference;
    use crate::offering::{CapacityType, OfferingKey};

    fn offering(ty: &str, zone: &str, price: f64) -> Offering {
        Offering {
            key: OfferingKey {
                instance_type: ty.into(),
                zone: zone.into(),
                capacity_type: CapacityType::OnDemand,
            },
            gpus: 1,
            gpu_model: "NVIDIA X".into(),
            gpu_memory_gib: 24.0,
            vcpus: 4,
            price_usd_per_h: price,
            interruption: None,
        }
    }

    /// An x86_64 catalogue with no 2-GPU type: (type, GPUs, GiB per GPU) g4dn.xlarge (1, 16),
    /// g4dn.12xlarge (4, 16), p4d.24xlarge (8, 40).
    fn no_two_gpu_type() -> Vec<Offering> {
        [
            ("g4dn.xlarge", 1, 16.0),
            ("g4dn.12xlarge", 4, 16.0),
            ("p4d.24xlarge", 8, 40.0),
        ]
        .iter()
        .map(|(ty, g, mem)| Offering {
            gpus: *g,
            gpu_memory_gib: *mem,
            ..offering(ty, "z", 1.0)
        })
        .collect()
    }

    #[test]
    fn a_job_is_scheduled_past_a_size_the_catalogue_lacks() {
        let offs = no_two_gpu_type();
        let cfg = OfferConfig::default();
        // (GPUs asked, GiB per GPU asked, scheduled as)
        let cases = [
            (1, 0.0, 1),
            (2, 0.0, 4), // no 2-GPU type: the next size up
            (3, 0.0, 3), // 3 rounds up to 4, which exists: the fit rule serves it as it is
            (4, 0.0, 4),
            (5, 0.0, 5),   // rounds up to 8, which exists
            (1, 32.0, 8),  // only the 8-GPU type has 32 GiB per GPU
            (16, 0.0, 16), // nothing has 16 GPUs: left as it is (admission rejects it)
            (1, 500.0, 1), // nothing has the memory: left as it is
        ];
        for (gpus, mem, want) in cases {
            assert_eq!(schedule_gpus(&offs, gpus, mem, &cfg), want, "{gpus} GPUs, {mem} GiB");
        }
        // Only the allowed types count: with just the 8-GPU type allowed, a 1-GPU job takes it.
        let only_p4d = OfferConfig {
            allowed_instance_types: vec!["p4d.24xlarge".into()],
            ..OfferConfig::default()
        };
        assert_eq!(schedule_gpus(&offs, 1, 0.0, &only_p4d), 8);
        // With max_gpu_oversize 2 the 4-GPU type fits a 2-GPU job by the rule itself.
        let oversize = OfferConfig {
            max_gpu_oversize: 2,
            ..OfferConfig::default()
        };
        assert_eq!(schedule_gpus(&offs, 2, 0.0, &oversize), 2);
    }

    #[test]
    fn a_worker_serves_jobs_from_the_fewest_gpus_the_fit_rule_gives_it() {
        let offs = no_two_gpu_type();
        let cfg = OfferConfig::default();
        // (worker GPUs, GiB per GPU, fewest job GPUs it serves)
        for (gpus, mem, want) in [
            (1, 16.0, 1),
            (4, 16.0, 2), // a 2-GPU job is scheduled on 4 GPUs here; a 1-GPU one is not
            (8, 40.0, 5), // 5 to 8 round up to 8; 4 on 8 is twice the GPUs
        ] {
            assert_eq!(smallest_job_gpus(&offs, gpus, mem, &cfg), want, "{gpus} GPUs");
        }
        // Every one of them agrees with the matching rule the policy uses.
        for (gpus, mem) in [(1, 16.0), (4, 16.0), (8, 40.0)] {
            let least = smallest_job_gpus(&offs, gpus, mem, &cfg);
            for g in 1..=gpus {
                let scheduled = schedule_gpus(&offs, g, cfg.min_gpu_memory_gib, &cfg);
                let served = fits(gpus, mem, scheduled, cfg.min_gpu_memory_gib, cfg.max_gpu_oversize);
                assert_eq!(served, g >= least, "{g} GPUs on {gpus}");
            }
        }
        // Oversize 2: an 8-GPU worker serves from 3 GPUs (rounded up to 4, times 2).
        let oversize = OfferConfig {
            max_gpu_oversize: 2,
            ..OfferConfig::default()
        };
        assert_eq!(smallest_job_gpus(&offs, 8, 40.0, &oversize), 3);
        // Only the 8-GPU type allowed: a 1-GPU job is scheduled on it, so it serves every job.
        let only_p4d = OfferConfig {
            allowed_instance_types: vec!["p4d.24xlarge".into()],
            ..OfferConfig::default()
        };
        assert_eq!(smallest_job_gpus(&offs, 8, 40.0, &only_p4d), 1);
    }

    #[test]
    fn top_k_is_the_head_of_rank_ties_in_input_order() {
        let prices = [0.5, 0.2, 0.9, 0.2, 0.3, 0.2, 0.7, 0.3];
        let offs: Vec<Offering> = prices
            .iter()
            .enumerate()
            .map(|(i, p)| offering("t", &format!("z{i}"), *p))
            .collect();
        let req = one_gpu_hour();
        let cfg = OfferConfig::default();
        let all = rank(&offs, &req, &cfg, &[], 0.0);
        for k in 0..=offs.len() + 1 {
            let t = top(&offs, &req, &cfg, &[], 0.0, k);
            let want: Vec<_> = all.iter().take(k).map(|(o, _)| o.key.zone.clone()).collect();
            let got: Vec<_> = t.iter().map(|(o, _)| o.key.zone.clone()).collect();
            assert_eq!(got, want, "k = {k}");
        }
    }

    /// A 1-GPU, one-hour, spot-first request.
    fn one_gpu_hour() -> Request {
        Request {
            gpus: 1,
            min_mem_gib: 0.0,
            capacity: CapacityPreference::SpotFirst,
            instances: 1,
            runtime_s: 3600.0,
        }
    }

    fn zones(ranked: &[(&Offering, f64)]) -> Vec<String> {
        ranked.iter().map(|(o, _)| o.key.zone.clone()).collect()
    }

    #[test]
    fn the_memo_returns_what_top_returns_as_unavailable_offerings_come_and_go() {
        let offs: Vec<Offering> = [0.5, 0.2, 0.9, 0.3]
            .iter()
            .enumerate()
            .map(|(i, p)| offering("t", &format!("z{i}"), *p))
            .collect();
        let req = one_gpu_hour();
        let cfg = OfferConfig::default();
        let gone = |zone: &str, until: f64| UnavailableOffering {
            key: offs.iter().find(|o| o.key.zone == zone).unwrap().key.clone(),
            until,
        };
        // (now, unavailable, k, request GPUs): each step through one memo, one decision apart.
        let steps: Vec<(f64, Vec<UnavailableOffering>, usize, u32)> = vec![
            (0.0, vec![], 2, 1),
            (1.0, vec![], 2, 1),                    // a hit
            (2.0, vec![gone("z1", 100.0)], 2, 1),   // the best is out: ranked again
            (3.0, vec![gone("z1", 100.0)], 3, 1),   // another k
            (4.0, vec![gone("z1", 100.0)], 2, 2),   // another shape: nothing fits
            (200.0, vec![gone("z1", 100.0)], 2, 1), // expired: back to the first ranking
        ];
        let mut memo = RankMemo::default();
        let mut seen = Vec::new();
        for (now, unavailable, k, gpus) in steps {
            let req = Request { gpus, ..req };
            let want = top(&offs, &req, &cfg, &unavailable, now, k);
            let got = memo.top(&offs, &req, &cfg, &unavailable, now, k);
            assert_eq!(zones(&got), zones(&want), "at {now}");
            assert_eq!(
                got.iter().map(|e| e.1).collect::<Vec<_>>(),
                want.iter().map(|e| e.1).collect::<Vec<_>>()
            );
            seen.push(zones(&got));
        }
        assert_eq!(seen[0], ["z1", "z3"]);
        assert_eq!(seen[2], ["z3", "z0"], "the unavailable best is skipped");
        assert!(seen[4].is_empty());
        assert_eq!(seen[5], seen[0]);
        // A different configuration (another address) is not served the first one's rankings.
        let cheap_types_only = OfferConfig {
            max_price_usd_per_h: Some(0.25),
            ..OfferConfig::default()
        };
        assert_eq!(zones(&memo.top(&offs, &req, &cheap_types_only, &[], 300.0, 2)), ["z1"]);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "catalogue changed in place")]
    fn a_memo_over_a_catalogue_changed_in_place_panics_in_debug_builds() {
        let mut offs = vec![offering("t", "z0", 0.5), offering("t", "z1", 0.2)];
        let req = one_gpu_hour();
        let cfg = OfferConfig::default();
        let mut memo = RankMemo::default();
        memo.top(&offs, &req, &cfg, &[], 0.0, 1);
        offs[1].price_usd_per_h = 0.9;
        memo.top(&offs, &req, &cfg, &[], 1.0, 1);
    }
}
