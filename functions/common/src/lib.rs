//! What every onoff Lambda function shares: typed settings loaded once at cold start, the SDK
//! clients and adapters built once, the reconcile context handlers run against (real adapters in
//! Lambda, fakes in tests), error kinds mapped to Lambda's diagnostics, and EMF metric lines.
#![warn(missing_docs)]

use onoff_aws::settings::{Resources, SettingsError};
use onoff_control::catalog::{load_offerings, Arch, CatalogOptions};
pub use onoff_control::ports::ScaleAsk;
use onoff_control::ports::{
    ArrivalStatsStore, Backlog, EventLog, Fleet, FleetLister, JobQueue, JobStore, Lease, OfferingAvailability,
    SpotPrices, WorkerRegistry,
};
use onoff_control::reconcile::{reconcile_exclusive, ReconcileOptions, ReconcileReport};
use onoff_policy::{Action, Offering, PolicyConfig, WorkerState};

pub use onoff_control::emf;

/// The EC2 GPU catalogue compiled in (`data/catalog`, see its README for sources).
const SPECS_CSV: &str = include_str!("../../../data/catalog/gpu_instance_specs.csv");
const PRICES_CSV: &str = include_str!("../../../data/catalog/prices-us-east-1.csv");
const ADVISOR_CSV: &str = include_str!("../../../data/catalog/spot-advisor-gpu.csv");

/// Everything a function reads from its environment, once per cold start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Queues, tables, bucket, launch template, subnets.
    pub resources: Resources,
    /// The policy (`ONOFF_POLICY`: TOML text; default `PolicyConfig::default()`).
    pub policy: PolicyConfig,
    /// Offerings of the region (`AWS_REGION`, default us-east-1) from the compiled-in catalogue,
    /// of the workers' architecture only.
    pub offerings: Vec<Offering>,
    /// `ONOFF_ARCH` (default `x86_64`): the CPU architecture of the workers' AMI (`x86_64` or
    /// `arm64`); only instance types of that architecture are offered.
    pub arch: Arch,
    /// `ONOFF_DEPLOYMENT` (default `onoff`): the value of the `onoff:managed` tag.
    pub deployment: String,
    /// Reconcile settings.
    pub reconcile: ReconcileOptions,
    /// How long an invocation holds the reconcile lease when its deadline is unknown (a handler
    /// called outside Lambda), seconds (60). In Lambda the TTL comes from the invocation's
    /// deadline: [`onoff_control::lease::lease_ttl_for_deadline`].
    pub lease_ttl_s: f64,
}

/// A setting that is missing or wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A resource variable.
    #[error(transparent)]
    Resource(#[from] SettingsError),
    /// `ONOFF_POLICY` does not parse or validate.
    #[error("ONOFF_POLICY: {0}")]
    Policy(String),
    /// `ONOFF_ARCH` is not an architecture.
    #[error("ONOFF_ARCH: {0}")]
    Arch(String),
    /// The catalogue has nothing for the region.
    #[error("catalogue: {0}")]
    Catalog(String),
    /// `ONOFF_SUBNETS` names a subnet EC2 does not describe, or no offering is in their zones.
    #[error("ONOFF_SUBNETS: {0}")]
    Subnets(String),
}

impl Settings {
    /// Read from a lookup (the process environment in Lambda, a map in tests).
    ///
    /// # Errors
    /// [`ConfigError`] naming the variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let resources = Resources::from_lookup(&get)?;
        let policy = match get("ONOFF_POLICY").filter(|p| !p.trim().is_empty()) {
            Some(text) => PolicyConfig::from_toml_str(&text).map_err(|e| ConfigError::Policy(e.to_string()))?,
            None => PolicyConfig::default(),
        };
        for lane in &policy.lanes {
            if resources.queue_url(&lane.name).is_none() {
                return Err(ConfigError::Policy(format!(
                    "lane {:?} has no queue in ONOFF_QUEUE_URLS (lanes with queues: {})",
                    lane.name,
                    resources
                        .queue_urls
                        .iter()
                        .map(|(l, _)| l.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        let arch = match get("ONOFF_ARCH").filter(|a| !a.trim().is_empty()) {
            Some(a) => a.parse::<Arch>().map_err(ConfigError::Arch)?,
            None => Arch::X86_64,
        };
        let region = get("AWS_REGION").unwrap_or_else(|| "us-east-1".into());
        let offerings = load_offerings(
            SPECS_CSV,
            PRICES_CSV,
            Some(ADVISOR_CSV),
            &CatalogOptions {
                arch: Some(arch),
                ..CatalogOptions::for_region(&region)
            },
        )
        .map_err(|e| ConfigError::Catalog(e.to_string()))?;
        Ok(Self {
            resources,
            policy,
            offerings,
            arch,
            deployment: get("ONOFF_DEPLOYMENT").unwrap_or_else(|| "onoff".into()),
            reconcile: ReconcileOptions::default(),
            lease_ttl_s: 60.0,
        })
    }

    /// Read from the process environment.
    ///
    /// # Errors
    /// [`ConfigError`] naming the variable.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Offer only the offerings in `zones` (the zones of the workers' subnets): a worker is
    /// launched into its zone's subnet, and a zone without one cannot take it
    /// ([`onoff_aws::fleet::Ec2Fleet::with_subnets`]), so the policy must not choose it, nor
    /// admission count it. An empty `zones` (no subnets given: the default VPC, every zone) keeps
    /// every offering.
    ///
    /// # Errors
    /// [`ConfigError::Subnets`] when no offering of the catalogue is in any of `zones`.
    pub fn restrict_to_zones(&mut self, zones: &[String]) -> Result<(), ConfigError> {
        if zones.is_empty() {
            return Ok(());
        }
        let before = self.offerings.len();
        self.offerings.retain(|o| zones.contains(&o.key.zone));
        if self.offerings.is_empty() {
            return Err(ConfigError::Subnets(format!(
                "none of the catalogue's {before} GPU offerings is in the subnets' zones ({}); give a subnet in a \
                 zone that has GPU instances",
                zones.join(", ")
            )));
        }
        tracing::info!(zones = %zones.join(","), offerings = self.offerings.len(), of = before, "offerings restricted to the subnets' zones");
        Ok(())
    }
}

/// Restrict `settings`' offerings to the zones of the subnets `fleet` launches into
/// ([`Settings::restrict_to_zones`]), looking the subnets' zones up once
/// (`ec2:DescribeSubnets`; the fleet keeps them for its launches).
///
/// # Errors
/// [`ConfigError::Subnets`]: EC2 failed or does not describe a subnet, or no offering is left.
pub async fn offer_subnet_zones(
    settings: &mut Settings,
    fleet: &onoff_aws::fleet::Ec2Fleet,
) -> Result<(), ConfigError> {
    let subnets = fleet
        .subnet_zones()
        .await
        .map_err(|e| ConfigError::Subnets(e.to_string()))?;
    let zones: Vec<String> = subnets.into_iter().map(|(z, _)| z).collect();
    settings.restrict_to_zones(&zones)
}

/// Errors a handler returns, as Lambda diagnostics: `Retryable` (Lambda or the event source
/// retries) or `NonRetryable` (a bad input; retrying cannot help).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// A dependency failed; retrying may help.
    #[error("{0}")]
    Retryable(String),
    /// The input is bad.
    #[error("{0}")]
    NonRetryable(String),
}

impl From<HandlerError> for lambda_runtime::Diagnostic {
    fn from(e: HandlerError) -> Self {
        let (kind, msg) = match e {
            HandlerError::Retryable(m) => ("Retryable", m),
            HandlerError::NonRetryable(m) => ("NonRetryable", m),
        };
        lambda_runtime::Diagnostic {
            error_type: kind.into(),
            error_message: msg,
        }
    }
}

/// The ports a handler runs against, and the settings.
#[derive(Debug)]
pub struct Ctx<Q, W, J, F, A, E, L> {
    /// Settings.
    pub settings: Settings,
    /// Lane queues.
    pub queues: Q,
    /// Workers table.
    pub workers: W,
    /// Jobs table.
    pub jobs: J,
    /// The fleet.
    pub fleet: F,
    /// Unavailable offerings.
    pub avail: A,
    /// Handled events.
    pub events: E,
    /// The reconcile lease.
    pub lease: L,
    /// The offerings priced at the fleet's spot quotes, kept between invocations of one
    /// execution environment ([`Ctx::priced_offerings`]).
    pub spot_prices: SpotPriceCache,
}

/// How long spot quotes are kept before they are asked for again, seconds: an hour. EC2's spot
/// prices move gradually (the pricing model since 2017 follows long-term supply and demand, not
/// bids), so an hour-old quote is close; one `DescribeSpotPriceHistory` an hour per execution
/// environment is far inside EC2's request limits.
pub const SPOT_QUOTE_TTL_S: f64 = 3600.0;

/// How long after a failed quote call the next one is tried, seconds (300); meanwhile the
/// previous prices (or the catalogue's) are used.
pub const SPOT_QUOTE_RETRY_S: f64 = 300.0;

/// The offerings priced at the fleet's spot quotes, and when to ask again ([`Ctx::priced_offerings`]).
#[derive(Debug, Default)]
pub struct SpotPriceCache {
    inner: std::sync::Mutex<Option<PricedOfferings>>,
}

#[derive(Debug, Clone)]
struct PricedOfferings {
    /// Unix seconds after which the quotes are asked for again.
    refresh_at: f64,
    offerings: std::sync::Arc<Vec<Offering>>,
}

/// The context on AWS.
pub type AwsCtx = Ctx<
    onoff_aws::queue::SqsQueues,
    onoff_aws::state::DynamoWorkers,
    onoff_aws::jobs::DynamoJobs,
    onoff_aws::fleet::Ec2Fleet,
    onoff_aws::state::DynamoControl,
    onoff_aws::state::DynamoControl,
    onoff_aws::state::DynamoControl,
>;

/// Build the AWS clients and adapters once (default credentials chain, region, and
/// `AWS_ENDPOINT_URL` when set). A function that decides or admits then restricts the offerings
/// to the workers' subnets' zones ([`offer_subnet_zones`] with the context's own fleet, which
/// keeps the zones for its launches).
pub async fn aws_ctx(settings: Settings) -> (AwsCtx, onoff_aws::settings::Clients) {
    let c = onoff_aws::settings::Clients::from_env().await;
    (ctx_from_clients(settings, &c), c)
}

/// The fleet adapter of `settings` over `c`'s EC2 client: the launch template, the subnets and
/// the deployment tag of the settings; spot launched stoppable when the policy stops spot workers
/// (`scale_down.stop_idle = spot-and-on-demand`, the default).
pub fn fleet_of(settings: &Settings, c: &onoff_aws::settings::Clients) -> onoff_aws::fleet::Ec2Fleet {
    let stoppable = settings.policy.scale_down.stop_idle == onoff_policy::StopIdle::SpotAndOnDemand;
    onoff_aws::fleet::Ec2Fleet::new(c.ec2.clone(), &settings.resources.launch_template)
        .with_subnets(settings.resources.subnets.clone())
        .with_deployment(&settings.deployment)
        .with_stoppable_spot(stoppable, settings.resources.security_group.clone())
}

/// The context over already built clients (`onoff local` builds them for its emulator).
pub fn ctx_from_clients(settings: Settings, c: &onoff_aws::settings::Clients) -> AwsCtx {
    let r = &settings.resources;
    let control = onoff_aws::state::DynamoControl::new(c.dynamodb.clone(), &r.control_table);
    Ctx {
        queues: onoff_aws::queue::SqsQueues::new(c.sqs.clone(), r.queue_urls.clone()),
        workers: onoff_aws::state::DynamoWorkers::new(c.dynamodb.clone(), &r.workers_table, &r.instance_arn_prefix),
        jobs: onoff_aws::jobs::DynamoJobs::new(c.dynamodb.clone(), &r.jobs_table),
        fleet: fleet_of(&settings, c),
        avail: control.clone(),
        events: control.clone(),
        lease: control,
        spot_prices: SpotPriceCache::default(),
        settings,
    }
}

/// Unix seconds now.
pub fn now() -> f64 {
    onoff_aws::state::unix_now()
}

impl<Q, W, J, F, A, E, L> Ctx<Q, W, J, F, A, E, L>
where
    Q: Backlog + JobQueue,
    W: WorkerRegistry,
    J: JobStore,
    F: Fleet + FleetLister + SpotPrices,
    A: OfferingAvailability + ArrivalStatsStore,
    E: EventLog,
    L: Lease,
{
    /// The offerings to decide on at `now` (unix seconds): the settings' (the catalogue, of the
    /// subnets' zones) with each spot offering at the fleet's current quote for its type and zone
    /// ([`onoff_control::catalog::apply_spot_quotes`]: the catalogue's price is a regional
    /// average of a snapshot; EC2's differ by zone and move). Quotes are asked for at the first
    /// decision of an execution environment and again after [`SPOT_QUOTE_TTL_S`]. When the call
    /// fails, the previous prices (at first, the catalogue's) are used and the call is tried again
    /// after [`SPOT_QUOTE_RETRY_S`]: prices steer the choice, they never stop a decision. A quote
    /// that is no price EC2 charges (under 5 % of on-demand; moto quotes $0.00001) keeps the
    /// catalogue's price, logged as a warning.
    pub async fn priced_offerings(&self, now: f64) -> std::sync::Arc<Vec<Offering>> {
        let cached = self.spot_prices.inner.lock().expect("lock").clone();
        if let Some(p) = cached.as_ref().filter(|p| now < p.refresh_at) {
            return p.offerings.clone();
        }
        let types: Vec<String> = self
            .settings
            .offerings
            .iter()
            .filter(|o| o.key.capacity_type == onoff_policy::CapacityType::Spot)
            .map(|o| o.key.instance_type.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let priced = if types.is_empty() {
            PricedOfferings {
                refresh_at: now + SPOT_QUOTE_TTL_S,
                offerings: std::sync::Arc::new(self.settings.offerings.clone()),
            }
        } else {
            match self.fleet.spot_quotes(&types).await {
                Ok(quotes) => {
                    let mut offerings = self.settings.offerings.clone();
                    let report = onoff_control::catalog::apply_spot_quotes(&mut offerings, &quotes);
                    if let Some((key, price, why)) = report.refused.first() {
                        tracing::warn!(
                            refused = report.refused.len(),
                            first = %key,
                            price,
                            reason = why,
                            "spot quotes refused: those offerings keep the catalogue's price"
                        );
                    }
                    tracing::info!(
                        applied = report.applied,
                        unquoted = report.unquoted,
                        refused = report.refused.len(),
                        "spot offerings priced at the fleet's current quotes"
                    );
                    PricedOfferings {
                        refresh_at: now + SPOT_QUOTE_TTL_S,
                        offerings: std::sync::Arc::new(offerings),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_s = SPOT_QUOTE_RETRY_S, "spot quotes failed: the previous prices stay");
                    PricedOfferings {
                        refresh_at: now + SPOT_QUOTE_RETRY_S,
                        offerings: cached
                            .map_or_else(|| std::sync::Arc::new(self.settings.offerings.clone()), |p| p.offerings),
                    }
                }
            }
        };
        *self.spot_prices.inner.lock().expect("lock") = Some(priced.clone());
        priced.offerings
    }

    /// The start of a completed run that decided the scale request `payload` already: one that
    /// started at least [`SCALE_REQUEST_MARGIN_S`] after the request's `asked_at`, and so saw the
    /// jobs the asker had queued, while no ask is pending (a pending ask is one that came in
    /// after such a run read the count: [`request_scale`]). A request Lambda delivers twice, or
    /// one held back behind the scaler's single reserved slot until the schedule's run went
    /// first, is then answered without a run. `None`: not a scale request, one without
    /// `asked_at` (an older asker's), not decided yet, an ask pending, or the marks could not be
    /// read (the request then runs).
    pub async fn decided_already(&self, payload: &serde_json::Value) -> Option<f64> {
        let asked_at = scale_request_asked_at(payload)?;
        let name = onoff_control::reconcile::RECONCILE_LEASE;
        let started_at = match self.lease.last_done(name).await {
            Ok(Some(started_at)) if started_at >= asked_at + SCALE_REQUEST_MARGIN_S => started_at,
            Ok(_) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "read the last run's start: the request runs");
                return None;
            }
        };
        match self.lease.asks(name).await {
            Ok(asks) if asks.pending_since.is_none() => Some(started_at),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, "read the scale requests pending: the request runs");
                None
            }
        }
    }

    /// Reconcile under the lease (`reap`: the scheduled reconciler's reaper), log each action with
    /// its reason, print EMF metrics, and return a summary. `invocation`: the Lambda context; its
    /// request id owns the lease, held until its deadline plus a margin
    /// ([`onoff_control::lease`]; [`Settings::lease_ttl_s`] when it has no deadline).
    ///
    /// # Errors
    /// [`HandlerError::Retryable`] when the state cannot be read.
    pub async fn reconcile(
        &self,
        now: f64,
        reap: bool,
        invocation: &lambda_runtime::Context,
    ) -> Result<serde_json::Value, HandlerError> {
        let s = &self.settings;
        let opts = ReconcileOptions { reap, ..s.reconcile };
        let ttl_s = onoff_control::lease::lease_ttl_for_deadline(invocation.deadline, now, s.lease_ttl_s);
        let offerings = self.priced_offerings(now).await;
        let report = reconcile_exclusive(
            &s.policy,
            &offerings,
            &opts,
            now,
            &lease_owner(&invocation.request_id),
            ttl_s,
            &self.queues,
            &self.workers,
            &self.jobs,
            &self.fleet,
            &self.avail,
            &self.lease,
        )
        .await
        .map_err(|e| HandlerError::Retryable(e.to_string()))?;
        let Some(report) = report else {
            tracing::info!("another invocation holds the reconcile lease; nothing to do");
            return Ok(serde_json::json!({ "skipped": "lease held by another invocation" }));
        };
        for a in &report.plan.actions {
            tracing::info!(action = ?action_name(a), on = %action_target(a, &s.policy), reason = %a.reason(), "decision");
        }
        // What the decision held back, and why: on AWS the function's answer (`summary`) goes
        // nowhere for an asynchronous invocation, so this is where a job that waits is explained.
        for h in &report.plan.held {
            let lane = s.policy.lanes.get(h.lane).map_or("?", |c| c.name.as_str());
            tracing::info!(lane, count = h.count, reason = %h.reason, "held");
        }
        // Jobs that wait on the operator: a full vCPU quota left out every offering they fit.
        for b in &report.blocked_by_quotas {
            tracing::warn!("{b}");
        }
        // Jobs the reaper ended for waiting past their lane's quota_wait_limit_s.
        for (job, reason) in &report.jobs_past_quota_wait {
            tracing::warn!(%job, %reason, "job FAILED: past its lane's quota wait limit");
        }
        for e in report.errors.iter().chain(&report.acted.errors) {
            tracing::warn!(error = %e, "reconcile");
        }
        for (key, problem) in &report.unreadable {
            tracing::error!(%key, %problem, "row that does not parse: skipped");
        }
        for w in &report.acted.skipped {
            tracing::info!(worker = %w, "not released: it took a job since the decision");
        }
        self.print_metrics(&report, &offerings, now);
        Ok(summary(&report))
    }

    fn print_metrics(&self, report: &ReconcileReport, offerings: &[Offering], now: f64) {
        let stopped_usd_per_h = self.settings.policy.scale_down.stopped_usd_per_h();
        if let Some(line) = fleet_metrics_line(&self.settings.deployment, stopped_usd_per_h, report, offerings, now) {
            emf::emit(&line);
        }
    }
}

/// A spot notice EC2 sent one of the deployment's workers, as the dashboard counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpotNotice {
    /// "EC2 Spot Instance Interruption Warning": the instance is reclaimed in two minutes.
    InterruptionWarning,
    /// "EC2 Instance Rebalance Recommendation": the instance is at elevated risk.
    RebalanceRecommendation,
}

impl SpotNotice {
    /// The value of the metric's `Notice` dimension.
    pub fn dimension(self) -> &'static str {
        match self {
            SpotNotice::InterruptionWarning => "interruption-warning",
            SpotNotice::RebalanceRecommendation => "rebalance-recommendation",
        }
    }
}

/// The EMF line of one spot notice to a worker of `deployment` (namespace `onoff`, metric
/// `SpotNotices`, value 1, dimensions `Deployment` and `Notice`): the interruption function prints
/// it when it drains one of the deployment's own workers, so the dashboard counts onoff's notices,
/// where the EventBridge rule's `TriggeredRules` counts every spot instance's of the account. A
/// custom metric is billed only for the hours it receives data (Amazon CloudWatch pricing), so
/// a month without notices pays nothing for it.
pub fn spot_notice_line(deployment: &str, notice: SpotNotice, now: f64) -> String {
    emf::line(
        "onoff",
        now,
        &[("Deployment", deployment), ("Notice", notice.dimension())],
        &[("SpotNotices", 1.0, "Count")],
    )
}

/// The fleet's EMF line for a reconcile (namespace `onoff`, dimension `Deployment`): worker counts
/// by state, spend, the longest unheld idle time and what the run did. `None` when the run leaves
/// no worker and did nothing (no action, no count above 0): an idle deployment then publishes no
/// custom metric at all. CloudWatch bills a custom metric for each hour it receives data ($0.30
/// per metric-month, prorated by the hour and metered only when metrics are sent: Amazon
/// CloudWatch pricing), so printing these 19 on every scheduled run would keep $5.70 a month of metrics
/// alive through idle months; the alarms on them treat missing data as not breaching, and the
/// run that releases the last worker still prints its zeros.
pub fn fleet_metrics_line(
    deployment: &str,
    stopped_usd_per_h: f64,
    report: &ReconcileReport,
    offerings: &[Offering],
    now: f64,
) -> Option<String> {
    // The fleet as the run left it: no second listing of the workers table per invocation.
    let workers = &report.workers;
    let count = |st: WorkerState| workers.iter().filter(|w| w.state == st).count() as f64;
    // A stopped worker bills its volume only.
    let spend: f64 = workers
        .iter()
        .map(|w| match w.state {
            WorkerState::Stopped => stopped_usd_per_h,
            _ => onoff_control::reconcile::worker_price_usd_per_h(w, offerings),
        })
        .sum();
    let idle_max = idle_seconds_max(workers, now);
    let metrics = [
        ("WorkersPending", count(WorkerState::Pending), "Count"),
        ("WorkersRunning", count(WorkerState::Running), "Count"),
        ("WorkersIdle", count(WorkerState::Idle), "Count"),
        ("GpusIdle", idle_gpus(workers, offerings), "Count"),
        ("WorkersDraining", count(WorkerState::Draining), "Count"),
        ("WorkersStopped", count(WorkerState::Stopped), "Count"),
        ("SpendUsdPerHour", spend, "None"),
        ("IdleSecondsMax", idle_max, "Seconds"),
        ("Launches", report.acted.launched.len() as f64, "Count"),
        ("Starts", report.acted.started.len() as f64, "Count"),
        ("StartsHeldWhileStopping", report.acted.held.len() as f64, "Count"),
        ("Stops", report.acted.stopped.len() as f64, "Count"),
        ("LaunchesRefusedByQuota", report.acted.quotas_full.len() as f64, "Count"),
        ("JobsRequeued", report.jobs_requeued.len() as f64, "Count"),
        ("JobsWoken", report.jobs_woken.len() as f64, "Count"),
        ("JobsFailedLeaseLost", report.jobs_failed.len() as f64, "Count"),
        ("JobsFailedQuotaWait", report.jobs_past_quota_wait.len() as f64, "Count"),
        ("UnreadableRows", report.unreadable.len() as f64, "Count"),
        // What the run failed to do (a wake-up message not sent, a row not written, a call
        // refused): logged one by one as `reconcile` warnings; `onoff-reconcile-errors` goes off
        // when each 5-minute period of 15 minutes has some.
        (
            "ReconcileErrors",
            (report.errors.len() + report.acted.errors.len()) as f64,
            "Count",
        ),
    ];
    let quiet = workers.is_empty() && report.plan.actions.is_empty() && metrics.iter().all(|m| m.1 == 0.0);
    (!quiet).then(|| emf::line("onoff", now, &[("Deployment", deployment)], &metrics))
}

/// The GPUs of the idle workers: each worker's instance type's GPU count from `offerings` (the
/// region's catalogue), 1 for a type the catalogue lacks. Its hourly average is the idle
/// GPU-hours per hour the dashboard plots (`WorkersIdle` counts instances, which undercounts a
/// multi-GPU worker).
pub fn idle_gpus(workers: &[onoff_control::ports::WorkerRecord], offerings: &[Offering]) -> f64 {
    workers
        .iter()
        .filter(|w| w.state == WorkerState::Idle)
        .map(|w| {
            offerings
                .iter()
                .find(|o| o.key.instance_type == w.offering.instance_type)
                .map_or(1, |o| o.gpus.max(1))
        })
        .map(f64::from)
        .sum()
}

/// What an action acts on, for its log line: the lane, count and offering of a launch or start,
/// the worker of the others.
fn action_target(a: &Action, policy: &PolicyConfig) -> String {
    let lane = |l: usize| policy.lanes.get(l).map_or("?", |c| c.name.as_str());
    match a {
        Action::Launch {
            lane: l,
            offering,
            count,
            ..
        } => format!("lane {}: {count} x {offering}", lane(*l)),
        Action::Start {
            worker,
            lane: l,
            offering,
            ..
        } => format!("lane {}: {worker} ({offering})", lane(*l)),
        Action::Terminate { worker, .. } | Action::CancelLaunch { worker, .. } | Action::Stop { worker, .. } => {
            worker.clone()
        }
    }
}

fn action_name(a: &Action) -> &'static str {
    match a {
        Action::Launch { .. } => "launch",
        Action::Terminate { .. } => "terminate",
        Action::CancelLaunch { .. } => "cancel_launch",
        Action::Stop { .. } => "stop",
        Action::Start { .. } => "start",
    }
}

/// Longest current idle time among idle workers the control plane does not hold, seconds (0 when
/// none): `IdleSecondsMax`, for the alarm on a worker idle longer than expected. A worker the
/// policy keeps as warm capacity is held (`hold_until` ahead, `reconcile::renew_holds`) and idles
/// on purpose; one idle past the alarm's threshold and not held was released by neither the
/// policy nor its agent.
pub fn idle_seconds_max(workers: &[onoff_control::ports::WorkerRecord], now: f64) -> f64 {
    workers
        .iter()
        .filter(|w| w.state == WorkerState::Idle && w.hold_until.is_none_or(|h| h <= now))
        .filter_map(|w| w.idle_since.map(|t| (now - t).max(0.0)))
        .fold(0.0, f64::max)
}

/// Summary of a reconcile as the function's response.
pub fn summary(r: &ReconcileReport) -> serde_json::Value {
    serde_json::json!({
        "launched": r.acted.launched.iter().map(|l| &l.launched.instance_id).collect::<Vec<_>>(),
        "terminated": r.acted.terminated,
        "stopped": r.acted.stopped,
        "started": r.acted.started,
        "starts_held_while_stopping": r.acted.held,
        "cancelled": r.acted.cancelled,
        "scale_down_skipped": r.acted.skipped,
        "orphans_terminated": r.orphans_terminated,
        "orphans_adopted": r.orphans_adopted,
        "idle_holds_renewed": r.workers_held,
        "workers_given_estimates": r.workers_given_estimates,
        "workers_lost": r.workers_lost,
        "workers_gone": r.workers_gone,
        "spot_requests_cancelled": r.spot_requests_cancelled,
        "jobs_requeued": r.jobs_requeued,
        "jobs_failed": r.jobs_failed,
        "jobs_woken": r.jobs_woken,
        "wake_ups_spared": r.wake_ups_spared,
        "quotas_full": r.acted.quotas_full,
        "unreadable": r.unreadable.iter().map(|(k, p)| format!("{k}: {p}")).collect::<Vec<_>>(),
        "held": r.plan.held.iter().map(|h| format!("{} x {}", h.count, h.reason)).collect::<Vec<_>>(),
        "blocked_by_quotas": r.blocked_by_quotas.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "jobs_past_quota_wait": r.jobs_past_quota_wait.iter().map(|(id, _)| id).collect::<Vec<_>>(),
        "errors": r.errors.iter().chain(&r.acted.errors).collect::<Vec<_>>(),
        "asks_settled": r.asks_settled,
        "jobs_read_past_index": r.jobs_read_past_index,
        "arrivals_folded": r.arrivals_folded,
        "run_time_estimates_s": r.run_time_estimates.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
    })
}

/// The reconcile lease's owner for one execution: the invocation's request id, which names it in
/// the logs, made unique to this execution. Lambda reuses a request id when it delivers or
/// retries one asynchronous event again ("Why is my Lambda function invoked more than once?",
/// AWS re:Post knowledge center), and the lease lets its owner in again, so two executions of
/// one event would otherwise both hold it and both launch.
fn lease_owner(request_id: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{request_id}/{}-{nanos:x}-{n}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    const BASE: &[(&str, &str)] = &[
        ("ONOFF_QUEUE_URLS", "express=http://q/e,standard=http://q/s"),
        ("ONOFF_JOBS_TABLE", "jobs"),
        ("ONOFF_WORKERS_TABLE", "workers"),
        ("ONOFF_CONTROL_TABLE", "control"),
        ("ONOFF_BUCKET", "bucket"),
        ("ONOFF_LAUNCH_TEMPLATE", "onoff-worker"),
        (
            "ONOFF_INSTANCE_ARN_PREFIX",
            "arn:aws:ec2:us-east-1:123456789012:instance/",
        ),
    ];

    #[test]
    fn the_idle_alarms_metric_leaves_out_workers_the_control_plane_holds() {
        let now = 1_800_000_000.0;
        let worker = |id: &str, state: WorkerState, idle_for: f64, hold: Option<f64>| {
            let offering = onoff_policy::OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: "us-east-1a".into(),
                capacity_type: onoff_policy::CapacityType::Spot,
            };
            onoff_control::ports::WorkerRecord {
                state,
                idle_since: Some(now - idle_for),
                heartbeat_at: Some(now),
                hold_until: hold,
                ..onoff_control::ports::WorkerRecord::launched(id, "standard", offering, 0.39, now - 20_000.0)
            }
        };
        // A warm-pool worker idle for 3 h and held; one idle 2 h whose hold lapsed; one idle 1 h
        // never held; a Running row (its idle_since is stale) is not idle.
        let workers = [
            worker("i-warm", WorkerState::Idle, 10_800.0, Some(now + 600.0)),
            worker("i-lapsed", WorkerState::Idle, 7_200.0, Some(now - 1.0)),
            worker("i-idle", WorkerState::Idle, 3_600.0, None),
            worker("i-busy", WorkerState::Running, 50_000.0, None),
        ];
        assert_eq!(idle_seconds_max(&workers, now), 7_200.0);
        assert_eq!(idle_seconds_max(&workers[..1], now), 0.0);
    }

    #[test]
    fn idle_gpus_count_each_idle_workers_gpus_from_the_catalogue() {
        let ctx = testing::fake_ctx();
        let offerings = &ctx.settings.offerings;
        let gpus_of = |t: &str| offerings.iter().find(|o| o.key.instance_type == t).map(|o| o.gpus);
        assert_eq!((gpus_of("g4dn.12xlarge"), gpus_of("g5.xlarge")), (Some(4), Some(1)));
        let worker = |id: &str, t: &str, state: WorkerState| onoff_control::ports::WorkerRecord {
            state,
            ..onoff_control::ports::WorkerRecord::launched(
                id,
                "standard",
                onoff_policy::OfferingKey {
                    instance_type: t.into(),
                    zone: "us-east-1a".into(),
                    capacity_type: onoff_policy::CapacityType::OnDemand,
                },
                1.0,
                0.0,
            )
        };
        let workers = [
            worker("i-4", "g4dn.12xlarge", WorkerState::Idle),
            worker("i-1", "g5.xlarge", WorkerState::Idle),
            worker("i-busy", "g4dn.12xlarge", WorkerState::Running),
            worker("i-stopped", "g4dn.12xlarge", WorkerState::Stopped),
        ];
        assert_eq!(idle_gpus(&workers, offerings), 5.0);
        // A type the catalogue lacks counts as one GPU, as WorkersIdle counts it.
        let unknown = [worker("i-x", "p9.mystery", WorkerState::Idle)];
        assert_eq!(idle_gpus(&unknown, offerings), 1.0);
        assert_eq!(idle_gpus(&[], offerings), 0.0);
    }

    #[test]
    fn a_spot_notice_is_one_count_of_its_kind_for_its_deployment() {
        for (notice, kind) in [
            (SpotNotice::InterruptionWarning, "interruption-warning"),
            (SpotNotice::RebalanceRecommendation, "rebalance-recommendation"),
        ] {
            let v: serde_json::Value = serde_json::from_str(&spot_notice_line("st", notice, 1_800_000_000.0)).unwrap();
            let cw = &v["_aws"]["CloudWatchMetrics"][0];
            assert_eq!(cw["Namespace"], "onoff");
            assert_eq!(cw["Dimensions"], serde_json::json!([["Deployment", "Notice"]]));
            assert_eq!(
                cw["Metrics"],
                serde_json::json!([{"Name": "SpotNotices", "Unit": "Count"}])
            );
            assert_eq!(
                (v["Deployment"].as_str(), v["Notice"].as_str()),
                (Some("st"), Some(kind))
            );
            assert_eq!(v["SpotNotices"], 1.0);
        }
    }

    #[test]
    fn an_idle_deployment_publishes_no_fleet_metric() {
        let now = 1_800_000_000.0;
        let names = |line: &str| -> Vec<String> {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            v["_aws"]["CloudWatchMetrics"][0]["Metrics"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["Name"].as_str().unwrap().to_string())
                .collect()
        };
        // No worker and nothing done: nothing published, so no metric-hour is billed.
        let quiet = ReconcileReport::default();
        assert_eq!(fleet_metrics_line("st", 0.011, &quiet, &[], now), None);
        // A stopped worker alone keeps the fleet's figures coming (its volume is spend).
        let offering = onoff_policy::OfferingKey {
            instance_type: "g5.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: onoff_policy::CapacityType::Spot,
        };
        let stopped = ReconcileReport {
            workers: vec![onoff_control::ports::WorkerRecord {
                state: WorkerState::Stopped,
                ..onoff_control::ports::WorkerRecord::launched("i-1", "standard", offering, 0.39, now - 600.0)
            }],
            ..ReconcileReport::default()
        };
        let line = fleet_metrics_line("st", 0.011, &stopped, &[], now).expect("a worker: published");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            (v["WorkersStopped"].as_f64(), v["SpendUsdPerHour"].as_f64()),
            (Some(1.0), Some(0.011))
        );
        assert_eq!(v["Deployment"], "st");
        assert_eq!(names(&line).len(), 19);
        // The run that terminates the last worker prints its zeros, so the graphs fall to 0.
        let last = ReconcileReport {
            plan: onoff_policy::Plan {
                actions: vec![Action::Terminate {
                    worker: "i-1".into(),
                    reason: onoff_policy::Reason::StoppedKeepAliveExpired {
                        stopped_s: 86_400.0,
                        keep_s: 86_400.0,
                    },
                }],
                ..Default::default()
            },
            ..ReconcileReport::default()
        };
        let line = fleet_metrics_line("st", 0.011, &last, &[], now).expect("an action: published");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["WorkersStopped"].as_f64(), Some(0.0));
        // A launch refused by a full quota with no worker at all still reaches its alarm.
        let mut refused = ReconcileReport::default();
        refused
            .acted
            .quotas_full
            .push("Running On-Demand G and VT instances (L-DB2E81BA)".into());
        let line = fleet_metrics_line("st", 0.011, &refused, &[], now).expect("a refusal: published");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["LaunchesRefusedByQuota"].as_f64(), Some(1.0));
        // A job the reaper ended past its lane's quota wait limit, with no worker at all.
        let mut past = ReconcileReport::default();
        past.jobs_past_quota_wait.push(("job-1".into(), "waited".into()));
        let line = fleet_metrics_line("st", 0.011, &past, &[], now).expect("an end: published");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["JobsFailedQuotaWait"].as_f64(), Some(1.0));
        // So does a run that failed at something, for its alarm: the reaper's failed send of a
        // wake-up message (a submission left it to the reaper) and a failed write of act.
        let mut failed = ReconcileReport::default();
        failed
            .errors
            .push("wake j-1: send wake-up message: AWS.SimpleQueueService.NonExistentQueue".into());
        failed.acted.errors.push("mark i-1 stopped: throttled".into());
        let line = fleet_metrics_line("st", 0.011, &failed, &[], now).expect("errors: published");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["ReconcileErrors"].as_f64(), Some(2.0));
    }

    fn spot_price(offerings: &[Offering], instance_type: &str, zone: &str) -> f64 {
        offerings
            .iter()
            .find(|o| {
                o.key.instance_type == instance_type
                    && o.key.zone == zone
                    && o.key.capacity_type == onoff_policy::CapacityType::Spot
            })
            .unwrap_or_else(|| panic!("no spot offering {instance_type} in {zone}"))
            .price_usd_per_h
    }

    fn quote(instance_type: &str, zone: &str, usd_per_h: f64) -> onoff_control::catalog::SpotQuote {
        onoff_control::catalog::SpotQuote {
            instance_type: instance_type.into(),
            zone: zone.into(),
            usd_per_h,
        }
    }

    #[test]
    fn decisions_price_spot_at_the_fleets_quotes_asked_again_after_an_hour() {
        let ctx = testing::fake_ctx();
        let now = 1_800_000_000.0;
        let catalogue = spot_price(&ctx.settings.offerings, "g4dn.xlarge", "us-east-1a");
        // g4dn.xlarge: 0.526 $/h on demand, 0.1766 spot in the catalogue (a regional average).
        ctx.fleet.set_spot_quotes(Ok(vec![
            quote("g4dn.xlarge", "us-east-1a", 0.15),
            quote("g4dn.xlarge", "us-east-1b", 0.000_01),
        ]));
        let o = pollster::block_on(ctx.priced_offerings(now));
        assert_eq!(spot_price(&o, "g4dn.xlarge", "us-east-1a"), 0.15);
        assert_eq!(
            spot_price(&o, "g4dn.xlarge", "us-east-1b"),
            catalogue,
            "moto's quote is refused: the catalogue's price stays"
        );
        assert_eq!(spot_price(&o, "g4dn.xlarge", "us-east-1c"), catalogue, "not quoted");
        assert_eq!(ctx.fleet.spot_quote_calls(), 1);
        // Within the hour the same prices, without asking.
        ctx.fleet
            .set_spot_quotes(Ok(vec![quote("g4dn.xlarge", "us-east-1a", 0.16)]));
        let o = pollster::block_on(ctx.priced_offerings(now + SPOT_QUOTE_TTL_S - 1.0));
        assert_eq!(spot_price(&o, "g4dn.xlarge", "us-east-1a"), 0.15);
        assert_eq!(ctx.fleet.spot_quote_calls(), 1);
        let o = pollster::block_on(ctx.priced_offerings(now + SPOT_QUOTE_TTL_S));
        assert_eq!(spot_price(&o, "g4dn.xlarge", "us-east-1a"), 0.16);
        assert_eq!(ctx.fleet.spot_quote_calls(), 2);
        // A failed call keeps the last prices and is tried again after the retry delay.
        ctx.fleet.set_spot_quotes(Err(onoff_control::ports::FleetError {
            kind: onoff_control::ports::FleetErrorKind::Throttled,
            message: "RequestLimitExceeded".into(),
        }));
        let t = now + 2.0 * SPOT_QUOTE_TTL_S;
        assert_eq!(
            spot_price(
                &pollster::block_on(ctx.priced_offerings(t)),
                "g4dn.xlarge",
                "us-east-1a"
            ),
            0.16
        );
        assert_eq!(ctx.fleet.spot_quote_calls(), 3);
        pollster::block_on(ctx.priced_offerings(t + SPOT_QUOTE_RETRY_S - 1.0));
        assert_eq!(ctx.fleet.spot_quote_calls(), 3);
        pollster::block_on(ctx.priced_offerings(t + SPOT_QUOTE_RETRY_S));
        assert_eq!(ctx.fleet.spot_quote_calls(), 4);
        // The settings keep the catalogue's prices: quotes never compound.
        assert_eq!(
            spot_price(&ctx.settings.offerings, "g4dn.xlarge", "us-east-1a"),
            catalogue
        );
    }

    #[test]
    fn a_launch_goes_to_the_zone_ec2_quotes_cheapest_and_its_row_carries_that_price() {
        let ctx = testing::fake_ctx();
        let now = 1_800_000_000.0;
        // One zone's g4dn.xlarge well under every catalogue price of a 1-GPU type.
        ctx.fleet
            .set_spot_quotes(Ok(vec![quote("g4dn.xlarge", "us-east-1d", 0.09)]));
        pollster::block_on(onoff_control::submit::submit(
            r#"{"image":"i","command":["x"],"project":"p"}"#,
            &onoff_control::submit::Source::Sqs { message_id: "m".into() },
            &["express", "standard"],
            now,
            &ctx.jobs,
            &ctx.queues,
        ))
        .unwrap();
        let r = pollster::block_on(ctx.reconcile(now, false, &lambda_runtime::Context::default())).unwrap();
        let launched = r["launched"].as_array().unwrap();
        assert_eq!(launched.len(), 1, "{r}");
        let id = launched[0].as_str().unwrap();
        let offering = &ctx.fleet.running()[id];
        assert_eq!(
            (offering.instance_type.as_str(), offering.zone.as_str()),
            ("g4dn.xlarge", "us-east-1d"),
            "{r}"
        );
        assert_eq!(ctx.workers.records()[id].price_usd_per_h, 0.09);
    }

    #[test]
    fn only_the_zones_the_workers_have_a_subnet_in_are_offered() {
        let all = Settings::from_lookup(env(BASE)).unwrap();
        let zones_of = |s: &Settings| {
            s.offerings
                .iter()
                .map(|o| o.key.zone.clone())
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(zones_of(&all).len(), 6, "the catalogue offers us-east-1a..f");
        let mut s = all.clone();
        s.restrict_to_zones(&["us-east-1b".into(), "us-east-1d".into()])
            .unwrap();
        assert_eq!(
            zones_of(&s).into_iter().collect::<Vec<_>>(),
            ["us-east-1b", "us-east-1d"]
        );
        // Every offering of those zones is kept, spot and on-demand.
        assert_eq!(
            s.offerings.len(),
            all.offerings
                .iter()
                .filter(|o| o.key.zone == "us-east-1b" || o.key.zone == "us-east-1d")
                .count()
        );
        // No subnets given: the default VPC, every zone.
        let mut s = all.clone();
        s.restrict_to_zones(&[]).unwrap();
        assert_eq!(s.offerings.len(), all.offerings.len());
        // Subnets only where the catalogue has nothing: a configuration error naming the zones.
        let mut s = all;
        let err = s.restrict_to_zones(&["us-east-1z".into()]).unwrap_err().to_string();
        assert!(err.contains("ONOFF_SUBNETS") && err.contains("us-east-1z"), "{err}");
    }

    #[test]
    fn settings_load_with_the_compiled_in_catalogue() {
        let s = Settings::from_lookup(env(BASE)).unwrap();
        assert!(s.offerings.iter().any(|o| o.key.instance_type == "g5.xlarge"));
        assert_eq!(s.deployment, "onoff");
        // The default AMI is x86_64: no arm64 type (g5g, the cheapest 1-GPU spot offering in
        // us-east-1) is offered.
        assert_eq!(s.arch, Arch::X86_64);
        assert!(!s.offerings.iter().any(|o| o.key.instance_type.starts_with("g5g.")));
        let mut arm = BASE.to_vec();
        arm.push(("ONOFF_ARCH", "arm64"));
        let s = Settings::from_lookup(env(&arm)).unwrap();
        assert!(!s.offerings.is_empty());
        assert!(s.offerings.iter().all(|o| o.key.instance_type.starts_with("g5g.")));
        let mut bad = BASE.to_vec();
        bad.push(("ONOFF_ARCH", "aarch64"));
        let err = Settings::from_lookup(env(&bad)).unwrap_err().to_string();
        assert!(err.contains("ONOFF_ARCH") && err.contains("aarch64"), "{err}");
        let mut with = BASE.to_vec();
        with.push(("ONOFF_POLICY", "[[lanes]]\nname = \"gold\"\n"));
        let err = Settings::from_lookup(env(&with)).unwrap_err().to_string();
        assert!(err.contains("gold") && err.contains("ONOFF_QUEUE_URLS"), "{err}");
        let mut bad = BASE.to_vec();
        bad.push(("ONOFF_POLICY", "[scale_down]\nrelease_fraction = 3\n"));
        assert!(Settings::from_lookup(env(&bad))
            .unwrap_err()
            .to_string()
            .contains("release_fraction"));
    }

    #[test]
    fn the_reconcile_lease_lasts_until_the_invocation_deadline_plus_a_margin() {
        use onoff_control::lease::LEASE_MARGIN_S;
        let ctx = testing::fake_ctx();
        let now = 1_700_000_000.0;
        // 42.5 s left of the invocation.
        let mut cx = lambda_runtime::Context::default();
        cx.request_id = "req-1".into();
        cx.deadline = 1_700_000_042_500;
        pollster::block_on(ctx.reconcile(now, false, &cx)).unwrap();
        // No deadline (a handler called outside Lambda): the configured TTL.
        let mut local = lambda_runtime::Context::default();
        local.request_id = "req-2".into();
        pollster::block_on(ctx.reconcile(now, false, &local)).unwrap();
        let got: Vec<(String, String, f64)> = ctx
            .lease
            .acquisitions()
            .into_iter()
            .map(|(name, owner, until)| (name, owner.split('/').next().unwrap_or_default().to_string(), until))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "reconcile".to_string(),
                    "req-1".to_string(),
                    now + 42.5 + LEASE_MARGIN_S
                ),
                (
                    "reconcile".to_string(),
                    "req-2".to_string(),
                    now + ctx.settings.lease_ttl_s
                ),
            ]
        );
    }

    #[test]
    fn two_executions_of_one_event_own_the_lease_apart() {
        // Lambda delivers or retries an asynchronous event with its request id unchanged.
        let (a, b) = (lease_owner("req-1"), lease_owner("req-1"));
        assert!(a.starts_with("req-1/") && b.starts_with("req-1/"), "{a} {b}");
        assert_ne!(a, b, "the lease lets its owner in again: one owner each");
        let lease = onoff_control::fake::FakeLease::default();
        use onoff_control::ports::Lease;
        assert!(pollster::block_on(lease.acquire("reconcile", &a, 60.0, 0.0)).unwrap());
        assert!(!pollster::block_on(lease.acquire("reconcile", &b, 60.0, 1.0)).unwrap());
    }

    #[test]
    fn errors_map_to_retryable_and_non_retryable_diagnostics() {
        let d: lambda_runtime::Diagnostic = HandlerError::Retryable("throttled".into()).into();
        assert_eq!(
            (d.error_type.as_str(), d.error_message.as_str()),
            ("Retryable", "throttled")
        );
        let d: lambda_runtime::Diagnostic = HandlerError::NonRetryable("bad".into()).into();
        assert_eq!(d.error_type, "NonRetryable");
    }
}

pub use onoff_aws::objects::{ObjectError, ObjectRef};

/// The environment variable naming the scaler function (template.yaml sets it on submit and
/// interruption).
pub const SCALER_FUNCTION_VAR: &str = "ONOFF_SCALER_FUNCTION";

/// Asking the scaler to run now. Submit (after new jobs) and interruption (after a notice or a
/// lost worker) ask instead of launching themselves: only the scaler and the reconciler hold
/// launch rights (issue 10).
#[allow(async_fn_in_trait)]
pub trait ScalerTrigger {
    /// Ask the scaler to run; `reason` is logged by it. Returns once the request is accepted,
    /// not when the scaler has run.
    ///
    /// # Errors
    /// The request could not be made (the caller logs it: the alarm and the schedule catch up).
    async fn ask_scaler(&self, reason: &str) -> Result<(), String>;
}

/// Seconds after which a pending scale request ([`request_scale`]) is taken for lost (its
/// invocation failed, was dropped, or its run ended without settling) and the next ask invokes
/// afresh. A run takes seconds; the scaler's single reserved slot may hold an invocation back for
/// a few more (Lambda retries a throttled asynchronous event after 1 s, then longer).
pub const SCALE_REQUEST_STALE_S: f64 = 30.0;

/// Ask for a scaler run after new work (submit's jobs, interruption's drained worker), at most one
/// invocation at a time: the ask is counted under the reconcile lease ([`Lease::ask`]), and only
/// an ask that finds none pending (or one older than [`SCALE_REQUEST_STALE_S`]) invokes the
/// scaler; the others join the pending one, whose run sees them or goes again
/// ([`onoff_control::reconcile::reconcile_exclusive`]). Without this, each of 500 specs uploaded
/// at once queued an asynchronous invocation of a scaler whose reserved concurrency is 1: Lambda
/// throttles all but one, retries them with growing waits, and discards those still queued at
/// the function's `MaximumEventAgeInSeconds` (300 s) into the failed-events queue, whose alarm
/// pages the operator ("How Lambda handles errors and retries with asynchronous invocation",
/// Lambda Developer Guide). A store that cannot count the ask does not stop it: the scaler is
/// invoked anyway. An invocation that fails ends the pending ask, so the next ask invokes.
///
/// `jobs`: the ids of the jobs the ask is for (submit's new jobs; none for a drained worker). The
/// run reads them by id ([`onoff_control::reconcile::ReconcileReport::jobs_read_past_index`]):
/// the `active` index it lists the backlog through is eventually consistent, and a job written
/// just before its ask may not be in it yet.
///
/// # Errors
/// The invocation failed (the caller logs it: the alarm and the schedule catch up).
pub async fn request_scale<L: Lease, T: ScalerTrigger>(
    lease: &L,
    trigger: &T,
    jobs: &[String],
    reason: &str,
) -> Result<ScaleAsk, String> {
    let name = onoff_control::reconcile::RECONCILE_LEASE;
    match lease.ask(name, jobs, now(), SCALE_REQUEST_STALE_S).await {
        Ok(ScaleAsk::Joined) => {
            tracing::info!(reason, "a scale request is pending: this ask joins it");
            return Ok(ScaleAsk::Joined);
        }
        Ok(ScaleAsk::Invoke) => {}
        Err(e) => tracing::warn!(error = %e, "could not count the scale request; invoking the scaler anyway"),
    }
    if let Err(e) = trigger.ask_scaler(reason).await {
        if let Err(d) = lease.drop_pending_ask(name).await {
            tracing::warn!(error = %d, "could not end the pending scale request after a failed invoke");
        }
        return Err(e);
    }
    Ok(ScaleAsk::Invoke)
}

/// The payload of a scale request (an asynchronous invoke of the scaler) asked for at
/// `asked_at`, unix seconds.
#[must_use]
pub fn scale_request(reason: &str, asked_at: f64) -> serde_json::Value {
    serde_json::json!({ "source": "onoff.scale-request", "reason": reason, "asked_at": asked_at })
}

/// When the scale request `payload` ([`scale_request`]) was asked for, unix seconds; `None` for
/// any other payload (an alarm's, a direct invocation's) and for a request without the time (an
/// older asker's).
#[must_use]
pub fn scale_request_asked_at(payload: &serde_json::Value) -> Option<f64> {
    if payload.get("source").and_then(serde_json::Value::as_str) != Some("onoff.scale-request") {
        return None;
    }
    payload.get("asked_at").and_then(serde_json::Value::as_f64)
}

/// Seconds by which a scale request must precede the start of a completed run for that run to
/// have decided it ([`Ctx::decided_already`]). The run lists jobs through the `active` index,
/// which is eventually consistent (a write reaches a global secondary index "within a fraction of
/// a second" in normal conditions, DynamoDB Developer Guide, "Read consistency"), and the asker's
/// clock and the scaler's may differ a little.
pub const SCALE_REQUEST_MARGIN_S: f64 = 5.0;

impl ScalerTrigger for onoff_aws::settings::Clients {
    /// `lambda:InvokeFunction` with `InvocationType` `Event` on [`SCALER_FUNCTION_VAR`]: Lambda
    /// queues the event and answers 202 at once (Lambda Developer Guide, "Invoking a Lambda
    /// function asynchronously").
    async fn ask_scaler(&self, reason: &str) -> Result<(), String> {
        let function = std::env::var(SCALER_FUNCTION_VAR)
            .ok()
            .filter(|f| !f.is_empty())
            .ok_or_else(|| format!("{SCALER_FUNCTION_VAR} is not set"))?;
        self.lambda
            .invoke()
            .function_name(&function)
            .invocation_type(aws_sdk_lambda::types::InvocationType::Event)
            .payload(aws_sdk_lambda::primitives::Blob::new(
                scale_request(reason, now()).to_string(),
            ))
            .send()
            .await
            .map(|_| ())
            .map_err(|e| format!("invoke {function}: {}", aws_sdk_lambda::error::DisplayErrorContext(e)))
    }
}

/// Reading job spec objects: the version a submission event names.
#[allow(async_fn_in_trait)]
pub trait ObjectReader {
    /// Size of the object version, bytes, without reading it.
    ///
    /// # Errors
    /// [`ObjectError`]: not found, changed (read without a version id after an overwrite), other.
    async fn size(&self, obj: &ObjectRef) -> Result<u64, ObjectError>;

    /// The object version's bytes.
    ///
    /// # Errors
    /// As [`ObjectReader::size`].
    async fn read(&self, obj: &ObjectRef) -> Result<Vec<u8>, ObjectError>;
}

impl ObjectReader for onoff_aws::settings::Clients {
    async fn size(&self, obj: &ObjectRef) -> Result<u64, ObjectError> {
        onoff_aws::objects::S3Objects::new(self.s3.clone()).size(obj).await
    }
    async fn read(&self, obj: &ObjectRef) -> Result<Vec<u8>, ObjectError> {
        onoff_aws::objects::S3Objects::new(self.s3.clone()).read(obj).await
    }
}

/// Fakes for handler tests: a context over the in-memory ports, and objects in memory.
pub mod testing {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use onoff_control::fake::{
        FakeAvailability, FakeEventLog, FakeFleet, FakeJobs, FakeLease, FakeQueue, FakeRegistry,
    };

    use super::{Ctx, ObjectError, ObjectReader, ObjectRef, Settings};

    /// The context over fakes.
    pub type FakeCtx = Ctx<FakeQueue, FakeRegistry, FakeJobs, FakeFleet, FakeAvailability, FakeEventLog, FakeLease>;

    /// A fake context with lanes `express` and `standard` and the compiled-in catalogue.
    pub fn fake_ctx() -> FakeCtx {
        let vars = [
            ("ONOFF_QUEUE_URLS", "express=q-express,standard=q-standard"),
            ("ONOFF_JOBS_TABLE", "jobs"),
            ("ONOFF_WORKERS_TABLE", "workers"),
            ("ONOFF_CONTROL_TABLE", "control"),
            ("ONOFF_BUCKET", "bucket"),
            ("ONOFF_LAUNCH_TEMPLATE", "onoff-worker"),
            (
                "ONOFF_INSTANCE_ARN_PREFIX",
                "arn:aws:ec2:us-east-1:123456789012:instance/",
            ),
        ];
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        Ctx {
            settings: Settings::from_lookup(get).expect("test settings are valid"),
            queues: FakeQueue::default(),
            workers: FakeRegistry::default(),
            jobs: FakeJobs::default(),
            fleet: FakeFleet::new(),
            avail: FakeAvailability::default(),
            events: FakeEventLog::default(),
            lease: FakeLease::default(),
            spot_prices: super::SpotPriceCache::default(),
        }
    }

    /// One stored version of a fake object.
    #[derive(Debug, Clone)]
    struct Version {
        id: String,
        etag: String,
        body: Vec<u8>,
    }

    /// Objects in memory, versioned as on a bucket with versioning: each put adds a version.
    #[derive(Debug, Default)]
    pub struct FakeObjects {
        versions: Mutex<BTreeMap<(String, String), Vec<Version>>>,
        reads: AtomicUsize,
        /// Reasons of the scale requests made ([`super::ScalerTrigger`]).
        pub scale_requests: Mutex<Vec<String>>,
    }

    impl super::ScalerTrigger for FakeObjects {
        async fn ask_scaler(&self, reason: &str) -> Result<(), String> {
            self.scale_requests.lock().expect("lock").push(reason.to_string());
            Ok(())
        }
    }

    impl FakeObjects {
        /// Put an object; returns the new version's id (`v1`, `v2`, ... per key). Its ETag is a
        /// hash of the bytes, so equal bytes have equal ETags.
        pub fn put(&self, bucket: &str, key: &str, body: impl AsRef<[u8]>) -> String {
            let body = body.as_ref().to_vec();
            let etag = onoff_control::job::job_id_for(&String::from_utf8_lossy(&body))
                .trim_start_matches("job-")
                .to_string();
            let mut map = self.versions.lock().expect("lock");
            let versions = map.entry((bucket.into(), key.into())).or_default();
            let id = format!("v{}", versions.len() + 1);
            versions.push(Version {
                id: id.clone(),
                etag,
                body,
            });
            id
        }

        /// ETag of the current version of an object.
        pub fn etag(&self, bucket: &str, key: &str) -> Option<String> {
            let map = self.versions.lock().expect("lock");
            map.get(&(bucket.into(), key.into()))?.last().map(|v| v.etag.clone())
        }

        /// How many reads (GetObject) there were; sizes (HeadObject) do not count.
        pub fn reads(&self) -> usize {
            self.reads.load(Ordering::Relaxed)
        }

        fn find(&self, obj: &ObjectRef) -> Result<Version, ObjectError> {
            let map = self.versions.lock().expect("lock");
            let versions = map.get(&(obj.bucket.clone(), obj.key.clone()));
            let found = match &obj.version {
                Some(id) => versions.and_then(|vs| vs.iter().find(|v| &v.id == id)),
                None => versions.and_then(|vs| vs.last()),
            };
            let v = found.ok_or_else(|| ObjectError::NotFound(format!("{obj}: NoSuchKey")))?;
            match (&obj.version, &obj.etag) {
                (None, Some(e)) if !e.is_empty() && e.trim_matches('"') != v.etag => {
                    Err(ObjectError::Changed(format!("{obj}: PreconditionFailed")))
                }
                _ => Ok(v.clone()),
            }
        }
    }

    impl ObjectReader for FakeObjects {
        async fn size(&self, obj: &ObjectRef) -> Result<u64, ObjectError> {
            self.find(obj).map(|v| v.body.len() as u64)
        }
        async fn read(&self, obj: &ObjectRef) -> Result<Vec<u8>, ObjectError> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            self.find(obj).map(|v| v.body)
        }
    }
}
