//! EC2's vCPU quotas, which moto does not enforce: [`VcpuQuotas`] refuses a CreateFleet's
//! overrides whose quota bucket has no room left, a RunInstances (stoppable spot workers
//! launch by RunInstances) over its quota, and a StartInstances whose stopped instances do not
//! fit their quotas (a start counts against the quota as a launch does; stopped instances count
//! for nothing), as EC2 does.
//!
//! EC2 counts the vCPUs of the running (on-demand) or requested (spot) instances of a bucket of
//! families per region against one quota each (EC2 User Guide, "Amazon EC2 instance type
//! quotas", "Spot Instance quotas"; `onoff_control::quota`). An instant fleet reports what it
//! could not launch in its answer's `errorSet`, one item per refused override, with
//! `VcpuLimitExceeded` (on-demand) or `MaxSpotInstanceCountExceeded` (spot), the codes the EC2 API
//! Reference lists (the adapter's reading of that wire form is tested on its own,
//! `crates/aws/tests/ec2_wire.rs`).
//!
//! How the emulator is made to refuse: before the request is signed, the overrides whose bucket
//! is full are dropped from it and its target capacity is cut to what the quota leaves; a call
//! with nothing left is sent as a dry run (moto then launches nothing and answers
//! `DryRunOperation`). The answer, once read, gets a `CreateFleetError` per refused override (a
//! dry run's becomes an instant fleet's answer with no instances and those errors). A
//! RunInstances whose `MinCount` instances do not fit is sent as a dry run too, and its answer
//! becomes EC2's refusal of the whole call (HTTP 400, `MaxSpotInstanceCountExceeded` for spot,
//! `VcpuLimitExceeded` for on-demand). So does a StartInstances any of whose instances does not
//! fit: the instances' types come from the last [`VcpuQuotas::set_instances`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextMut, FinalizerInterceptorContextMut,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};
use onoff_control::quota::QuotaBucket;
use onoff_policy::CapacityType;

/// One quota: a bucket of families, a capacity type.
pub type QuotaKey = (QuotaBucket, CapacityType);

/// The quotas in play and the vCPUs counted against them.
#[derive(Debug, Default)]
struct Counts {
    /// vCPUs of the live instances, as last told ([`VcpuQuotas::set_live`]).
    live: BTreeMap<QuotaKey, u32>,
    /// vCPUs let through since (at most what the calls asked for).
    since: BTreeMap<QuotaKey, u32>,
    /// Peak of `live` per quota.
    peak: BTreeMap<QuotaKey, u32>,
    /// The instances listed as last told ([`VcpuQuotas::set_instances`]): type, capacity type,
    /// and whether it counts (pending or running).
    instances: BTreeMap<String, (String, CapacityType, bool)>,
}

/// Refuses CreateFleet overrides and RunInstances calls over a vCPU quota, as EC2 does (module
/// docs). Clones share
/// their counts. Given to the control plane's EC2 client of a local run
/// ([`crate::settings::Clients::with_vcpu_quotas`]); the run tells it the live instances.
#[derive(Debug, Clone)]
pub struct VcpuQuotas {
    limits: Arc<BTreeMap<QuotaKey, u32>>,
    vcpus_of: Arc<BTreeMap<String, u32>>,
    counts: Arc<Mutex<Counts>>,
    refused: Arc<AtomicU32>,
}

/// One override of a CreateFleet request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AskedOverride {
    /// `LaunchTemplateConfigs.<config>.Overrides.<index>` (1-based, as sent).
    pub config: u32,
    /// See `config`.
    pub index: u32,
    /// Instance type.
    pub instance_type: String,
    /// Its other fields as sent (`SubnetId`, `AvailabilityZone`, ...), by name.
    pub fields: BTreeMap<String, String>,
}

/// What a CreateFleet asks, read from its form body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetAsk {
    /// The default target capacity type (`spot` unless it says `on-demand`).
    pub capacity: CapacityType,
    /// Total target capacity (instances: onoff weighs none).
    pub count: u32,
    /// The overrides, in the order sent.
    pub overrides: Vec<AskedOverride>,
}

/// What the quotas let a call do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Overrides (positions in [`FleetAsk::overrides`]) left in the request.
    pub kept: Vec<usize>,
    /// Instances the kept overrides may launch (0: the call is refused whole).
    pub count: u32,
    /// Overrides refused (positions), each with the limit of its quota (vCPUs).
    pub refused: Vec<(usize, u32)>,
}

impl Verdict {
    /// The call goes through unchanged.
    #[must_use]
    pub fn is_pass(&self, ask: &FleetAsk) -> bool {
        self.refused.is_empty() && self.count == ask.count
    }
}

/// Read a CreateFleet's form body: `None` when it names no target capacity or no override.
#[must_use]
pub fn read_ask(params: &[(String, String)]) -> Option<FleetAsk> {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let count = get("TargetCapacitySpecification.TotalTargetCapacity")?.parse().ok()?;
    let capacity = match get("TargetCapacitySpecification.DefaultTargetCapacityType") {
        Some("on-demand") => CapacityType::OnDemand,
        _ => CapacityType::Spot,
    };
    let mut overrides: Vec<AskedOverride> = Vec::new();
    for (name, value) in params {
        let Some((config, index, field)) = override_field(name) else {
            continue;
        };
        let o = match overrides.iter().position(|o| o.config == config && o.index == index) {
            Some(i) => &mut overrides[i],
            None => {
                overrides.push(AskedOverride {
                    config,
                    index,
                    instance_type: String::new(),
                    fields: BTreeMap::new(),
                });
                overrides.last_mut().expect("just pushed")
            }
        };
        if field == "InstanceType" {
            o.instance_type = value.clone();
        } else {
            o.fields.insert(field.to_string(), value.clone());
        }
    }
    overrides.sort_by_key(|o| (o.config, o.index));
    (!overrides.is_empty()).then_some(FleetAsk {
        capacity,
        count,
        overrides,
    })
}

/// Read a RunInstances' form body as a fleet of one override (its instance type, `MinCount`
/// instances; spot when `InstanceMarketOptions.MarketType` says so): `None` without a type or a
/// count (one from the launch template alone is never refused).
#[must_use]
pub fn read_run(params: &[(String, String)]) -> Option<FleetAsk> {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let instance_type = get("InstanceType")?.to_string();
    let count = get("MinCount")?.parse().ok()?;
    let capacity = match get("InstanceMarketOptions.MarketType") {
        Some("spot") => CapacityType::Spot,
        _ => CapacityType::OnDemand,
    };
    Some(FleetAsk {
        capacity,
        count,
        overrides: vec![AskedOverride {
            config: 1,
            index: 1,
            instance_type,
            fields: BTreeMap::new(),
        }],
    })
}

/// EC2's answer to a RunInstances or StartInstances over a vCPU quota: the call refused whole
/// (HTTP 400), with the code an instant fleet's `errorSet` gives for the same capacity type.
fn run_refusal_body(capacity: CapacityType, limit: u32) -> String {
    let (code, message) = match capacity {
        CapacityType::Spot => (
            "MaxSpotInstanceCountExceeded",
            "Max spot instance count exceeded".to_string(),
        ),
        CapacityType::OnDemand => (
            "VcpuLimitExceeded",
            format!(
                "You have requested more vCPU capacity than your current vCPU limit of {limit} allows for the \
                 instance bucket that the specified instance type belongs to. Please visit \
                 http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit."
            ),
        ),
    };
    super::ec2_error_body(code, &message)
}

/// The instance ids of a StartInstances' form body (`InstanceId.N`).
#[must_use]
pub fn read_start(params: &[(String, String)]) -> Vec<String> {
    params
        .iter()
        .filter(|(n, _)| n.strip_prefix("InstanceId.").is_some_and(|i| i.parse::<u32>().is_ok()))
        .map(|(_, v)| v.clone())
        .collect()
}

/// Judge a start of `ids` against `limits` with `used` vCPUs counted already: the vCPUs each
/// quota needs for the stopped instances among `ids` (`instances`: type, capacity type, counted
/// already), and the first quota they do not fit, with its limit (`None`: the call goes through).
/// Unknown instances, or types of unknown size, need nothing.
#[must_use]
pub fn judge_start(
    ids: &[String],
    instances: &BTreeMap<String, (String, CapacityType, bool)>,
    limits: &BTreeMap<QuotaKey, u32>,
    used: impl Fn(QuotaKey) -> u32,
    vcpus_of: impl Fn(&str) -> Option<u32>,
) -> (BTreeMap<QuotaKey, u32>, Option<(QuotaKey, u32)>) {
    let mut need: BTreeMap<QuotaKey, u32> = BTreeMap::new();
    for id in ids {
        let Some((ty, cap, false)) = instances.get(id) else {
            continue;
        };
        let key = (QuotaBucket::of(ty), *cap);
        if limits.contains_key(&key) {
            *need.entry(key).or_default() += vcpus_of(ty).unwrap_or(0);
        }
    }
    let over = need
        .iter()
        .find(|(k, n)| used(**k) + **n > limits[*k])
        .map(|(k, _)| (*k, limits[k]));
    (need, over)
}

/// `LaunchTemplateConfigs.<c>.Overrides.<i>.<Field>` -> (c, i, Field).
fn override_field(name: &str) -> Option<(u32, u32, &str)> {
    let rest = name.strip_prefix("LaunchTemplateConfigs.")?;
    let (c, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("Overrides.")?;
    let (i, field) = rest.split_once('.')?;
    Some((c.parse().ok()?, i.parse().ok()?, field))
}

/// Judge `ask` against `limits` (vCPUs per quota) with `used` vCPUs counted already: an override
/// whose type's vCPUs do not fit its quota's room is refused; the kept ones may launch as many
/// instances as the tightest of their quotas holds (types without a quota, or of unknown size,
/// are never refused).
#[must_use]
pub fn judge(
    ask: &FleetAsk,
    limits: &BTreeMap<QuotaKey, u32>,
    used: impl Fn(QuotaKey) -> u32,
    vcpus_of: impl Fn(&str) -> Option<u32>,
) -> Verdict {
    let mut v = Verdict {
        kept: Vec::new(),
        count: ask.count,
        refused: Vec::new(),
    };
    for (i, o) in ask.overrides.iter().enumerate() {
        let key = (QuotaBucket::of(&o.instance_type), ask.capacity);
        let (Some(limit), Some(vcpus)) = (limits.get(&key), vcpus_of(&o.instance_type)) else {
            v.kept.push(i);
            continue;
        };
        let room = limit.saturating_sub(used(key));
        if vcpus == 0 || vcpus <= room {
            v.kept.push(i);
            if let Some(fit) = room.checked_div(vcpus) {
                v.count = v.count.min(fit);
            }
        } else {
            v.refused.push((i, *limit));
        }
    }
    if v.kept.is_empty() {
        v.count = 0;
    }
    v
}

/// The form body of `ask`'s request `params` as the verdict leaves it: refused overrides
/// dropped, the kept ones renumbered, the target capacity cut; a dry run when nothing is left.
#[must_use]
pub fn rewrite(params: &[(String, String)], ask: &FleetAsk, v: &Verdict) -> Vec<(String, String)> {
    if v.count == 0 {
        let mut out = params.to_vec();
        out.push(("DryRun".into(), "true".into()));
        return out;
    }
    // New index per kept (config, index), numbered from 1 within each config.
    let mut renumber: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for &i in &v.kept {
        let o = &ask.overrides[i];
        let next = renumber.keys().filter(|(c, _)| *c == o.config).count() as u32 + 1;
        renumber.insert((o.config, o.index), next);
    }
    let mut out = Vec::with_capacity(params.len());
    for (name, value) in params {
        if let Some((c, i, field)) = override_field(name) {
            if let Some(n) = renumber.get(&(c, i)) {
                out.push((
                    format!("LaunchTemplateConfigs.{c}.Overrides.{n}.{field}"),
                    value.clone(),
                ));
            }
            continue;
        }
        let value = match name.as_str() {
            "TargetCapacitySpecification.TotalTargetCapacity"
            | "TargetCapacitySpecification.SpotTargetCapacity"
            | "TargetCapacitySpecification.OnDemandTargetCapacity" => value
                .parse::<u32>()
                .map_or(value.clone(), |n| n.min(v.count).to_string()),
            _ => value.clone(),
        };
        out.push((name.clone(), value));
    }
    out
}

/// The `errorSet` items EC2 answers for the refused overrides (and, when the count was cut, for
/// the first kept one with a quota), each naming its override and launch template as sent.
fn refusal_errors(
    ask: &FleetAsk,
    v: &Verdict,
    params: &[(String, String)],
) -> Vec<aws_sdk_ec2::types::CreateFleetError> {
    use aws_sdk_ec2::types::{
        CreateFleetError, FleetLaunchTemplateOverrides, FleetLaunchTemplateSpecification, InstanceLifecycle,
        InstanceType, LaunchTemplateAndOverridesResponse,
    };
    let get = |k: String| params.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
    let mut refused = v.refused.clone();
    if v.count > 0 && v.count < ask.count {
        if let Some(&i) = v.kept.first() {
            refused.push((i, 0));
        }
    }
    refused
        .into_iter()
        .map(|(i, limit)| {
            let o = &ask.overrides[i];
            let spec = |f: &str| {
                get(format!(
                    "LaunchTemplateConfigs.{}.LaunchTemplateSpecification.{f}",
                    o.config
                ))
            };
            let (code, lifecycle, message) = match ask.capacity {
                CapacityType::Spot => (
                    "MaxSpotInstanceCountExceeded",
                    InstanceLifecycle::Spot,
                    "Max spot instance count exceeded".to_string(),
                ),
                CapacityType::OnDemand => (
                    "VcpuLimitExceeded",
                    InstanceLifecycle::OnDemand,
                    format!(
                        "You have requested more vCPU capacity than your current vCPU limit of {limit} allows for \
                         the instance bucket that the specified instance type belongs to. Please visit \
                         http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit."
                    ),
                ),
            };
            CreateFleetError::builder()
                .launch_template_and_overrides(
                    LaunchTemplateAndOverridesResponse::builder()
                        .launch_template_specification(
                            FleetLaunchTemplateSpecification::builder()
                                .set_launch_template_id(spec("LaunchTemplateId"))
                                .set_launch_template_name(spec("LaunchTemplateName"))
                                .set_version(spec("Version"))
                                .build(),
                        )
                        .overrides(
                            FleetLaunchTemplateOverrides::builder()
                                .instance_type(InstanceType::from(o.instance_type.as_str()))
                                .set_subnet_id(o.fields.get("SubnetId").cloned())
                                .set_availability_zone(o.fields.get("AvailabilityZone").cloned())
                                .build(),
                        )
                        .build(),
                )
                .lifecycle(lifecycle)
                .error_code(code)
                .error_message(message)
                .build()
        })
        .collect()
}

/// The answer's `errorSet` items, from the call's request to its answer.
#[derive(Debug, Clone)]
struct Refusal {
    errors: Vec<aws_sdk_ec2::types::CreateFleetError>,
}

impl Storable for Refusal {
    type Storer = StoreReplace<Self>;
}

/// Refuse the request of `context` (form body `params`) whole: sent as a dry run, which moto
/// answers without doing anything, and its answer replaced by EC2's refusal `body` (HTTP 400).
fn refuse_whole(
    context: &mut BeforeTransmitInterceptorContextMut<'_>,
    cfg: &mut ConfigBag,
    mut params: Vec<(String, String)>,
    body: String,
) {
    params.push(("DryRun".into(), "true".into()));
    let new_body = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(params)
        .finish();
    let request = context.request_mut();
    request
        .headers_mut()
        .insert("content-length", new_body.len().to_string());
    *request.body_mut() = aws_smithy_types::body::SdkBody::from(new_body);
    cfg.interceptor_state().store_put(RunRefusal { body });
}

/// A RunInstances or StartInstances refused whole: the body of EC2's answer, from the call's
/// request to its answer.
#[derive(Debug, Clone)]
struct RunRefusal {
    body: String,
}

impl Storable for RunRefusal {
    type Storer = StoreReplace<Self>;
}

impl VcpuQuotas {
    /// Quotas of `limits` vCPUs each, for the instance types of `vcpus_of` (vCPUs per type:
    /// types not listed are never refused).
    #[must_use]
    pub fn new(limits: BTreeMap<QuotaKey, u32>, vcpus_of: BTreeMap<String, u32>) -> Self {
        Self {
            limits: Arc::new(limits),
            vcpus_of: Arc::new(vcpus_of),
            counts: Arc::default(),
            refused: Arc::default(),
        }
    }

    /// The live instances now (type and capacity type of each): what counts against the
    /// quotas from here on, with what the calls let through after this.
    pub fn set_live<'a>(&self, instances: impl IntoIterator<Item = (&'a str, CapacityType)>) {
        let mut live: BTreeMap<QuotaKey, u32> = BTreeMap::new();
        for (ty, cap) in instances {
            let key = (QuotaBucket::of(ty), cap);
            if self.limits.contains_key(&key) {
                *live.entry(key).or_default() += self.vcpus_of.get(ty).copied().unwrap_or(0);
            }
        }
        let mut c = self.counts.lock().expect("quota counts");
        for (k, n) in &live {
            let p = c.peak.entry(*k).or_default();
            *p = (*p).max(*n);
        }
        c.live = live;
        c.since.clear();
    }

    /// The instances listed now, each as (id, type, capacity type, state as EC2 names it):
    /// the pending and running ones count against the quotas as [`VcpuQuotas::set_live`]
    /// counts them, and a StartInstances of a stopped one is judged by its type.
    pub fn set_instances<'a>(&self, instances: impl IntoIterator<Item = (&'a str, &'a str, CapacityType, &'a str)>) {
        let all: BTreeMap<String, (String, CapacityType, bool)> = instances
            .into_iter()
            .map(|(id, ty, cap, state)| {
                let live = matches!(state, "pending" | "running");
                (id.to_string(), (ty.to_string(), cap, live))
            })
            .collect();
        self.set_live(all.values().filter(|i| i.2).map(|(ty, cap, _)| (ty.as_str(), *cap)));
        self.counts.lock().expect("quota counts").instances = all;
    }

    /// The quotas in play: (quota, limit vCPUs, peak live vCPUs seen by [`VcpuQuotas::set_live`]).
    #[must_use]
    pub fn peaks(&self) -> Vec<(QuotaKey, u32, u32)> {
        let c = self.counts.lock().expect("quota counts");
        self.limits
            .iter()
            .map(|(k, l)| (*k, *l, c.peak.get(k).copied().unwrap_or(0)))
            .collect()
    }

    /// CreateFleet calls refused or cut, and RunInstances and StartInstances calls refused, so
    /// far.
    #[must_use]
    pub fn refused(&self) -> u32 {
        self.refused.load(Ordering::Relaxed)
    }

    /// A StartInstances: through, its instances counted, when they fit their quotas; else sent
    /// as a dry run, its answer to become EC2's refusal of the whole call.
    fn judge_start_request(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let request = context.request_mut();
        let Some(body) = request.body().bytes() else {
            return Ok(());
        };
        let params: Vec<(String, String)> = form_urlencoded::parse(body).into_owned().collect();
        let ids = read_start(&params);
        let over = {
            let mut c = self.counts.lock().expect("quota counts");
            let (need, over) = judge_start(
                &ids,
                &c.instances,
                &self.limits,
                |k| c.live.get(&k).copied().unwrap_or(0) + c.since.get(&k).copied().unwrap_or(0),
                |t| self.vcpus_of.get(t).copied(),
            );
            if over.is_none() {
                for (k, n) in need {
                    *c.since.entry(k).or_default() += n;
                }
            }
            over
        };
        let Some(((_, capacity), limit)) = over else {
            return Ok(());
        };
        self.refused.fetch_add(1, Ordering::Relaxed);
        tracing::info!(instances = ?ids, "emulated vCPU quota: StartInstances refused");
        refuse_whole(context, cfg, params, run_refusal_body(capacity, limit));
        Ok(())
    }
}

impl Intercept for VcpuQuotas {
    fn name(&self) -> &'static str {
        "onoff-vcpu-quotas"
    }

    fn modify_before_signing(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let run = match cfg.load::<Metadata>().map(Metadata::name) {
            Some("CreateFleet") => false,
            Some("RunInstances") => true,
            Some("StartInstances") => return self.judge_start_request(context, cfg),
            _ => return Ok(()),
        };
        let request = context.request_mut();
        let Some(body) = request.body().bytes() else {
            return Ok(());
        };
        let params: Vec<(String, String)> = form_urlencoded::parse(body).into_owned().collect();
        let Some(ask) = (if run { read_run(&params) } else { read_ask(&params) }) else {
            return Ok(());
        };
        let verdict = {
            let mut c = self.counts.lock().expect("quota counts");
            let mut v = judge(
                &ask,
                &self.limits,
                |k| c.live.get(&k).copied().unwrap_or(0) + c.since.get(&k).copied().unwrap_or(0),
                |t| self.vcpus_of.get(t).copied(),
            );
            if run && v.count < ask.count {
                // RunInstances launches `MinCount` or none.
                let key = (QuotaBucket::of(&ask.overrides[0].instance_type), ask.capacity);
                v = Verdict {
                    kept: Vec::new(),
                    count: 0,
                    refused: vec![(0, self.limits.get(&key).copied().unwrap_or(0))],
                };
            }
            // Counted as if every instance took the largest kept type of its quota.
            let mut largest: BTreeMap<QuotaKey, u32> = BTreeMap::new();
            for &i in &v.kept {
                let ty = &ask.overrides[i].instance_type;
                let key = (QuotaBucket::of(ty), ask.capacity);
                let n = self.vcpus_of.get(ty).copied().unwrap_or(0);
                let l = largest.entry(key).or_default();
                *l = (*l).max(n);
            }
            for (k, n) in largest {
                *c.since.entry(k).or_default() += n * v.count;
            }
            v
        };
        if verdict.is_pass(&ask) {
            return Ok(());
        }
        if run {
            // `MinCount` instances or none (onoff asks MinCount = MaxCount): refused whole, as a
            // dry run, which moto answers without launching; the answer is EC2's refusal.
            let limit = verdict.refused.first().map_or(0, |r| r.1);
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                instance_type = %ask.overrides[0].instance_type,
                asked = ask.count,
                "emulated vCPU quota: RunInstances refused"
            );
            refuse_whole(context, cfg, params, run_refusal_body(ask.capacity, limit));
            return Ok(());
        }
        let errors = refusal_errors(&ask, &verdict, &params);
        self.refused.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            refused = verdict.refused.len(),
            count = verdict.count,
            asked = ask.count,
            "emulated vCPU quota: CreateFleet overrides refused"
        );
        let new_body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(rewrite(&params, &ask, &verdict))
            .finish();
        request
            .headers_mut()
            .insert("content-length", new_body.len().to_string());
        *request.body_mut() = aws_smithy_types::body::SdkBody::from(new_body);
        cfg.interceptor_state().store_put(Refusal { errors });
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(RunRefusal { body }) = cfg.load::<RunRefusal>().cloned() else {
            return Ok(());
        };
        cfg.interceptor_state().unset::<RunRefusal>();
        super::answer_instead(context.response_mut(), 400, body)
    }

    fn modify_before_attempt_completion(
        &self,
        context: &mut FinalizerInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        use aws_sdk_ec2::operation::create_fleet::{CreateFleetError as CallError, CreateFleetOutput};
        use aws_smithy_runtime_api::client::interceptors::context::Output;
        let Some(Refusal { errors }) = cfg.load::<Refusal>().cloned() else {
            return Ok(());
        };
        cfg.interceptor_state().unset::<Refusal>();
        let Some(result) = context.output_or_error_mut() else {
            return Ok(());
        };
        match result {
            Ok(out) => {
                if let Some(o) = out.downcast_mut::<CreateFleetOutput>() {
                    o.errors.get_or_insert_with(Vec::new).extend(errors);
                }
            }
            Err(e) => {
                let dry_run = e
                    .as_operation_error()
                    .and_then(|e| e.downcast_ref::<CallError>())
                    .is_some_and(|e| aws_sdk_ec2::error::ProvideErrorMetadata::code(e) == Some("DryRunOperation"));
                if dry_run {
                    // Nothing was left to launch: the instant fleet's answer with no instances.
                    *result = Ok(Output::erase(
                        CreateFleetOutput::builder()
                            .fleet_id("fleet-0000000000000000q")
                            .set_errors(Some(errors))
                            .build(),
                    ));
                }
                // Another error (IAM, a bad request): EC2 checks those before quotas.
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    fn fleet(capacity: &str, count: &str, types: &[&str]) -> Vec<(String, String)> {
        let mut p = params(&[
            ("Action", "CreateFleet"),
            (
                "LaunchTemplateConfigs.1.LaunchTemplateSpecification.LaunchTemplateId",
                "lt-1",
            ),
            ("LaunchTemplateConfigs.1.LaunchTemplateSpecification.Version", "$Latest"),
            ("TargetCapacitySpecification.TotalTargetCapacity", count),
            ("TargetCapacitySpecification.DefaultTargetCapacityType", capacity),
            ("Type", "instant"),
        ]);
        for (i, t) in types.iter().enumerate() {
            p.push((
                format!("LaunchTemplateConfigs.1.Overrides.{}.InstanceType", i + 1),
                t.to_string(),
            ));
            p.push((
                format!("LaunchTemplateConfigs.1.Overrides.{}.SubnetId", i + 1),
                format!("subnet-{i}"),
            ));
        }
        p
    }

    fn vcpus(t: &str) -> Option<u32> {
        match t {
            "g5.xlarge" => Some(4),
            "g5.12xlarge" => Some(48),
            "p3.2xlarge" => Some(8),
            _ => None,
        }
    }

    fn g_spot(limit: u32) -> BTreeMap<QuotaKey, u32> {
        [((QuotaBucket::GAndVt, CapacityType::Spot), limit)]
            .into_iter()
            .collect()
    }

    #[test]
    fn a_create_fleet_is_read_from_its_form() {
        let ask = read_ask(&fleet("spot", "3", &["g5.xlarge", "p3.2xlarge"])).unwrap();
        assert_eq!((ask.capacity, ask.count), (CapacityType::Spot, 3));
        let types: Vec<&str> = ask.overrides.iter().map(|o| o.instance_type.as_str()).collect();
        assert_eq!(types, ["g5.xlarge", "p3.2xlarge"]);
        assert_eq!(ask.overrides[1].fields["SubnetId"], "subnet-1");
        assert_eq!(
            read_ask(&fleet("on-demand", "1", &["g5.xlarge"])).unwrap().capacity,
            CapacityType::OnDemand
        );
        assert_eq!(read_ask(&params(&[("Action", "CreateFleet")])), None);
    }

    #[test]
    fn overrides_over_their_quota_are_refused_and_the_count_cut_to_the_room_left() {
        let ask = read_ask(&fleet("spot", "3", &["g5.xlarge", "g5.12xlarge", "p3.2xlarge"])).unwrap();
        // 16 vCPUs of G spot, 8 used: a g5.xlarge fits twice, a g5.12xlarge not at all; P has
        // no quota here.
        let v = judge(&ask, &g_spot(16), |_| 8, vcpus);
        assert_eq!(v.kept, [0, 2]);
        assert_eq!(v.refused, [(1, 16)]);
        assert_eq!(v.count, 2);
        assert!(!v.is_pass(&ask));
        // Room for all: unchanged.
        let v = judge(&ask, &g_spot(1_000), |_| 0, vcpus);
        assert!(v.is_pass(&ask));
        // On-demand has no quota here: spot's is not on-demand's.
        let od = read_ask(&fleet("on-demand", "3", &["g5.12xlarge"])).unwrap();
        assert!(judge(&od, &g_spot(0), |_| 0, vcpus).is_pass(&od));
        // Full: refused whole.
        let v = judge(
            &read_ask(&fleet("spot", "1", &["g5.xlarge"])).unwrap(),
            &g_spot(16),
            |_| 14,
            vcpus,
        );
        assert_eq!((v.kept.len(), v.count, v.refused.len()), (0, 0, 1));
    }

    #[test]
    fn the_request_keeps_only_what_the_quota_allows_and_is_a_dry_run_when_nothing() {
        let p = fleet("spot", "3", &["g5.xlarge", "g5.12xlarge", "p3.2xlarge"]);
        let ask = read_ask(&p).unwrap();
        let v = judge(&ask, &g_spot(16), |_| 8, vcpus);
        let out = rewrite(&p, &ask, &v);
        let back = read_ask(&out).unwrap();
        let types: Vec<&str> = back.overrides.iter().map(|o| o.instance_type.as_str()).collect();
        assert_eq!(types, ["g5.xlarge", "p3.2xlarge"]);
        assert_eq!(back.overrides[1].index, 2, "renumbered");
        assert_eq!(back.overrides[1].fields["SubnetId"], "subnet-2");
        assert_eq!(back.count, 2);
        assert!(!out.iter().any(|(k, _)| k == "DryRun"));
        let g = fleet("spot", "2", &["g5.xlarge", "g5.12xlarge"]);
        let g_ask = read_ask(&g).unwrap();
        let none = judge(&g_ask, &g_spot(16), |_| 16, vcpus);
        assert_eq!(none.count, 0);
        assert!(rewrite(&g, &g_ask, &none).contains(&("DryRun".to_string(), "true".to_string())));
        // Each refused override, and the cut count, is an errorSet item naming the override.
        let errors = refusal_errors(&ask, &v, &p);
        assert_eq!(errors.len(), 2);
        let named = |e: &aws_sdk_ec2::types::CreateFleetError| {
            let l = e.launch_template_and_overrides().unwrap();
            let o = l.overrides().unwrap();
            (
                o.instance_type().unwrap().as_str().to_string(),
                o.subnet_id().unwrap().to_string(),
                l.launch_template_specification()
                    .unwrap()
                    .launch_template_id()
                    .unwrap()
                    .to_string(),
            )
        };
        assert_eq!(
            named(&errors[0]),
            ("g5.12xlarge".into(), "subnet-1".into(), "lt-1".into())
        );
        assert_eq!(
            named(&errors[1]),
            ("g5.xlarge".into(), "subnet-0".into(), "lt-1".into())
        );
        assert!(errors
            .iter()
            .all(|e| e.error_code() == Some("MaxSpotInstanceCountExceeded")));
    }

    #[test]
    fn a_start_is_judged_by_its_stopped_instances_types_against_the_room_left() {
        let p = params(&[
            ("Action", "StartInstances"),
            ("InstanceId.1", "i-a"),
            ("InstanceId.2", "i-b"),
            ("InstanceId.3", "i-c"),
            ("InstanceId.4", "i-unknown"),
            ("Version", "2016-11-15"),
        ]);
        let ids = read_start(&p);
        assert_eq!(ids, ["i-a", "i-b", "i-c", "i-unknown"]);
        let instances: BTreeMap<String, (String, CapacityType, bool)> = [
            ("i-a", "g5.xlarge", CapacityType::Spot, false),
            ("i-b", "g5.xlarge", CapacityType::Spot, false),
            // Running already: counted in `used`, not again.
            ("i-c", "g5.xlarge", CapacityType::Spot, true),
        ]
        .into_iter()
        .map(|(id, t, c, live)| (id.to_string(), (t.to_string(), c, live)))
        .collect();
        let key = (QuotaBucket::GAndVt, CapacityType::Spot);
        // 16 vCPUs, 8 used: both stopped ones (8 vCPUs) fit, and are counted.
        let (need, over) = judge_start(&ids, &instances, &g_spot(16), |_| 8, vcpus);
        assert_eq!((need.get(&key), over), (Some(&8), None));
        // 12 used: they do not, and the call is refused for that quota.
        let (_, over) = judge_start(&ids, &instances, &g_spot(16), |_| 12, vcpus);
        assert_eq!(over, Some((key, 16)));
        // Another capacity type's quota is not theirs.
        let od = [((QuotaBucket::GAndVt, CapacityType::OnDemand), 0)]
            .into_iter()
            .collect();
        assert_eq!(judge_start(&ids, &instances, &od, |_| 0, vcpus).1, None);
    }

    #[test]
    fn listed_instances_count_while_pending_or_running() {
        let q = VcpuQuotas::new(g_spot(16), [("g5.xlarge".to_string(), 4)].into_iter().collect());
        q.set_instances([
            ("i-1", "g5.xlarge", CapacityType::Spot, "running"),
            ("i-2", "g5.xlarge", CapacityType::Spot, "pending"),
            ("i-3", "g5.xlarge", CapacityType::Spot, "stopped"),
            ("i-4", "g5.xlarge", CapacityType::Spot, "stopping"),
        ]);
        let c = q.counts.lock().unwrap();
        assert_eq!(c.live.values().sum::<u32>(), 8);
        assert_eq!(c.instances.len(), 4);
        assert!(!c.instances["i-3"].2);
    }

    #[test]
    fn live_instances_count_against_their_quota_and_the_peak_is_kept() {
        let q = VcpuQuotas::new(g_spot(16), [("g5.xlarge".to_string(), 4)].into_iter().collect());
        q.set_live([("g5.xlarge", CapacityType::Spot), ("g5.xlarge", CapacityType::Spot)]);
        q.set_live([("g5.xlarge", CapacityType::Spot), ("g5.xlarge", CapacityType::OnDemand)]);
        assert_eq!(q.peaks(), [((QuotaBucket::GAndVt, CapacityType::Spot), 16, 8)]);
        assert_eq!(q.counts.lock().unwrap().live.values().sum::<u32>(), 4);
    }
}
