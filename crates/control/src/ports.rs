//! Ports: the narrow capabilities the use cases need, one trait per capability.
//!
//! Each method's doc says whether it is idempotent and what "not found" means. Adapters (AWS in
//! `crates/aws`, the simulator, the fakes in [`crate::fake`]) implement them.

use onoff_policy::{OfferingKey, WorkerState};

/// Kinds of fleet errors the core acts on; adapters classify provider errors into these once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetErrorKind {
    /// No capacity for the offering (EC2: InsufficientInstanceCapacity, SpotMaxPriceTooLow,
    /// Unsupported, ...): try the next offering, skip this one for a while.
    InsufficientCapacity,
    /// The account's vCPU quota for the offering's bucket of families and capacity type is full
    /// (EC2: VcpuLimitExceeded on-demand, MaxSpotInstanceCountExceeded on spot): every offering of
    /// that bucket and capacity type at least as large is skipped for a while
    /// ([`crate::quota::QuotaBucket`]), and the operator is told which quota to raise.
    QuotaExceeded,
    /// The instance or resource does not exist.
    NotFound,
    /// Rate limited (EC2 RequestLimitExceeded): retried with backoff by the adapter; surfaced when
    /// retries ran out.
    Throttled,
    /// A limit of the whole account and region, whatever the offering (EC2: MaxFleetCountExceeded,
    /// "You've reached your quota for maximum Fleet Requests for this account": EC2 Fleets and
    /// Spot Fleets per region, EC2 User Guide, "EC2 Fleet quotas"). Like throttling, the launches
    /// stop for this run and nothing is marked: every other offering would be refused the same,
    /// and skipping them all would only leave the jobs waiting longer once the limit frees.
    AccountLimit,
    /// A start refused because the instance is still stopping (EC2: `IncorrectInstanceState`,
    /// "not in a state from which it can be started", for an instance EC2 lists stopping, or
    /// stopped by the time it was looked up). EC2 stops an instance in steps, "stopping" for what
    /// its User Guide calls several minutes ("Stop and start Amazon EC2 instances"); once stopped
    /// it starts. Not a capacity error: the offering is not skipped, and [`crate::act::act`] holds
    /// the start for the next decision instead of launching (while the stop is recent).
    Stopping,
    /// Anything else.
    Other,
}

/// An error from a [`Fleet`] call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct FleetError {
    /// What the core should do about it.
    pub kind: FleetErrorKind,
    /// The provider's message (code and text).
    pub message: String,
}

/// One launch: `count` instances over one or more offerings (best first) for one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchRequest {
    /// Lane name (tagged on the instances as `onoff:lane`).
    pub lane: String,
    /// Offerings to spread the instances over, best first (EC2: the fleet's overrides). All of
    /// one capacity type. At least one.
    pub offerings: Vec<OfferingKey>,
    /// Instances wanted in total.
    pub count: u32,
    /// Project the capacity is for (tagged `onoff:project`), if any.
    pub project: Option<String>,
    /// Job the capacity is pinned to, if any.
    pub job: Option<String>,
    /// Idempotency token (EC2: CreateFleet `ClientToken`, at most 64 ASCII characters): a call
    /// repeated with the same token launches nothing new. Set it with
    /// [`LaunchRequest::with_token_for`], so the same decision's retry sends the same token and
    /// another request another one.
    pub client_token: String,
}

impl LaunchRequest {
    /// The idempotency token of this request as part of the decision `decision_id`: `onoff-`
    /// and 32 hex digits of a 128-bit FNV-1a hash of the decision id and every other field
    /// (lane, offerings in order, count, project, job). Deterministic: the same decision and
    /// request give the same token in every process and release; changing any field changes it.
    pub fn idempotency_token(&self, decision_id: &str) -> String {
        self.token_of(&[decision_id.as_bytes()])
    }

    /// [`LaunchRequest::idempotency_token`] of the decision id that `decision_parts` spell
    /// together (`[b"1000", b"/", b"0"]` is the id `"1000/0"`), without building it: the
    /// simulator launches on tens of thousands of its decisions.
    pub fn idempotency_token_of_parts(&self, decision_parts: &[&[u8]]) -> String {
        self.token_of(decision_parts)
    }

    fn token_of(&self, decision_parts: &[&[u8]]) -> String {
        const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
        const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
        let mut h = OFFSET;
        // One field: its parts' bytes, then 0xff (which never occurs in UTF-8, so it separates
        // fields unambiguously). Parts rather than a formatted string: the simulator runs this on
        // every launch of a replay.
        let mut feed = |parts: &[&[u8]]| {
            for b in parts.iter().flat_map(|p| p.iter()).chain(&[0xff]) {
                h ^= u128::from(*b);
                h = h.wrapping_mul(PRIME);
            }
        };
        feed(decision_parts);
        feed(&[self.lane.as_bytes()]);
        for o in &self.offerings {
            // The offering as it displays: `type/zone/capacity`.
            feed(&[
                o.instance_type.as_bytes(),
                b"/",
                o.zone.as_bytes(),
                b"/",
                o.capacity_type.as_str().as_bytes(),
            ]);
        }
        feed(&[&self.count.to_le_bytes()]);
        for opt in [&self.project, &self.job] {
            match opt {
                Some(v) => feed(&[b"+", v.as_bytes()]),
                None => feed(&[b"-"]),
            }
        }
        // `format!("onoff-{h:032x}")`, digit by digit.
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut token = String::with_capacity(38);
        token.push_str("onoff-");
        token.extend((0..32).rev().map(|i| char::from(HEX[((h >> (4 * i)) & 0xf) as usize])));
        token
    }

    /// This request with [`LaunchRequest::client_token`] set to its
    /// [`LaunchRequest::idempotency_token`] for `decision_id`.
    #[must_use]
    pub fn with_token_for(mut self, decision_id: &str) -> Self {
        self.client_token = self.idempotency_token(decision_id);
        self
    }

    /// This request with [`LaunchRequest::client_token`] set to its
    /// [`LaunchRequest::idempotency_token_of_parts`].
    #[must_use]
    pub fn with_token_for_parts(mut self, decision_parts: &[&[u8]]) -> Self {
        self.client_token = self.idempotency_token_of_parts(decision_parts);
        self
    }
}

/// The decimal digits of an integer, on the stack: a part of a decision id
/// ([`LaunchRequest::with_token_for_parts`]) without a formatted string.
#[derive(Debug, Clone, Copy)]
pub struct Decimal {
    buf: [u8; 20],
    start: usize,
}

impl Decimal {
    /// The digits of `n`, as `n.to_string()` writes them.
    pub fn new(n: u64) -> Self {
        let mut buf = [0u8; 20];
        let mut start = buf.len();
        let mut n = n;
        loop {
            start -= 1;
            buf[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                return Self { buf, start };
            }
        }
    }

    /// The digits, ASCII.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

/// An instance a launch created.
#[derive(Debug, Clone, PartialEq)]
pub struct Launched {
    /// Instance id.
    pub instance_id: String,
    /// Offering it came from.
    pub offering: OfferingKey,
}

/// What a launch call did: the instances it created, and the offerings that had no capacity
/// (with the provider's error).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchResult {
    /// Instances created.
    pub launched: Vec<Launched>,
    /// Offerings that could not provide (all or part of) their share.
    pub short: Vec<(OfferingKey, FleetError)>,
}

/// Why EC2 would refuse `req` whole, or launch other than it names: it must name an offering
/// (CreateFleet takes no fleet without a launch template configuration), its offerings must
/// share one capacity type (an EC2 Fleet call launches its target's capacity type; an override
/// names none) and name each (instance type, zone) once (EC2: `InvalidFleetConfig`, "The fleet
/// configuration contains duplicate instance pools"). `None` when it is valid. The EC2 adapter,
/// the fake fleets and the simulator check it before launching, and refuse such a request as EC2
/// would.
#[must_use]
pub fn invalid_fleet_request(req: &LaunchRequest) -> Option<FleetError> {
    let Some(first) = req.offerings.first() else {
        return Some(FleetError {
            kind: FleetErrorKind::Other,
            message: "launch request with no offering".into(),
        });
    };
    if let Some(other) = req.offerings.iter().find(|k| k.capacity_type != first.capacity_type) {
        return Some(FleetError {
            kind: FleetErrorKind::Other,
            message: format!("one launch of two capacity types ({first} and {other}): a fleet call launches one"),
        });
    }
    for (i, k) in req.offerings.iter().enumerate() {
        if req.offerings[..i]
            .iter()
            .any(|o| o.instance_type == k.instance_type && o.zone == k.zone)
        {
            return Some(FleetError {
                kind: FleetErrorKind::Other,
                message: format!(
                    "InvalidFleetConfig: The fleet configuration contains duplicate instance pools ({} in {} twice)",
                    k.instance_type, k.zone
                ),
            });
        }
    }
    None
}

/// Launch and retire instances.
#[allow(async_fn_in_trait)]
pub trait Fleet {
    /// Launch up to `req.count` instances spread over `req.offerings` (EC2: one CreateFleet
    /// `instant` call with an override per offering). May create fewer than asked: the offerings
    /// that could not provide their share (no capacity, or any other error naming the offering)
    /// are in [`LaunchResult::short`]. Idempotent by [`LaunchRequest::client_token`]: a call
    /// repeated with the same token (a retry) launches nothing new; a new token launches again.
    ///
    /// # Errors
    /// [`FleetErrorKind::InsufficientCapacity`] when no offering has any capacity; other kinds
    /// when the call as a whole failed.
    async fn launch(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError>;

    /// Terminate running instances. Idempotent: an instance already gone is not an error. EC2
    /// answers not-found for an instance it launched moments ago, too, while the launch
    /// propagates ("Eventual consistency in the Amazon EC2 API"): such an instance may still
    /// run. Its row is Terminating by then, and the reconciler's orphan pass terminates it again
    /// at its next run ([`crate::reconcile::reconcile`]).
    ///
    /// # Errors
    /// Provider failures other than not-found.
    async fn terminate(&self, instance_ids: &[String]) -> Result<(), FleetError>;

    /// Cancel launches that have not finished booting (kept apart from [`Fleet::terminate`]:
    /// Cluster Autoscaler's "cancel unfulfilled launches" vs "delete this node"). Idempotent.
    ///
    /// # Errors
    /// Provider failures other than not-found.
    async fn cancel_launch(&self, instance_ids: &[String]) -> Result<(), FleetError>;

    /// Stop idle instances, keeping their volumes (EC2: StopInstances). Idempotent: an instance
    /// already stopping or stopped is not an error. Returns the instances the provider refused
    /// to stop (EC2: a spot instance of a one-time request, `UnsupportedOperation`; one gone),
    /// each with its error: the caller terminates those instead.
    ///
    /// # Errors
    /// Provider failures of the call as a whole (throttling after retries) before any instance
    /// was stopped; once some were, the rest are returned refused with that error.
    async fn stop(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError>;

    /// Start stopped instances again (EC2: StartInstances). Returns the instances that did not
    /// start, each with its error ([`FleetErrorKind::InsufficientCapacity`] when their type has
    /// no capacity in their zone now: they stay stopped; [`FleetErrorKind::NotFound`] when the
    /// instance is gone, terminated or shutting down: the caller retires it;
    /// [`FleetErrorKind::Stopping`] when it is still stopping: it stays stopped, and starts once
    /// it is). Idempotent: an instance already pending or running is not an error.
    ///
    /// # Errors
    /// Provider failures of the call as a whole (throttling after retries) before any instance
    /// was started; once some were, the rest are returned refused with that error.
    async fn start(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError>;
}

/// The spot prices a provider charges now ([`crate::catalog::SpotQuote`]; EC2:
/// `DescribeSpotPriceHistory`).
#[allow(async_fn_in_trait)]
pub trait SpotPrices {
    /// The price in force for each of `instance_types` in each zone that offers it, one quote per
    /// (type, zone); types and zones the provider quotes nothing for are absent.
    ///
    /// # Errors
    /// Provider failures.
    async fn spot_quotes(&self, instance_types: &[String]) -> Result<Vec<crate::catalog::SpotQuote>, FleetError>;
}

/// Record of a worker kept by the control plane.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRecord {
    /// Instance id.
    pub id: String,
    /// Lane name.
    pub lane: String,
    /// Offering.
    pub offering: OfferingKey,
    /// Price billed, $/h.
    pub price_usd_per_h: f64,
    /// State.
    pub state: WorkerState,
    /// Launch time, unix seconds.
    pub launched_at: f64,
    /// Project it was launched for, if any.
    pub project: Option<String>,
    /// When the worker last became idle (set by its agent), unix seconds.
    pub idle_since: Option<f64>,
    /// The agent's last heartbeat, unix seconds (`None` until the agent starts).
    pub heartbeat_at: Option<f64>,
    /// The job the launch was pinned to (a deadline at risk on spot, [`LaunchRequest::job`]):
    /// the worker's agent claims it first, and while the worker boots the policy counts it as
    /// that job's capacity only.
    pub pinned_job: Option<String>,
    /// Until when the control plane holds this idle worker, unix seconds
    /// ([`crate::reconcile::renew_holds`]): its agent does not end itself for its idle timeout
    /// before then. For a Stopped worker: until when it is kept stopped
    /// ([`WorkerRegistry::mark_stopped`]). `None` when never held.
    pub hold_until: Option<f64>,
    /// For an on-demand worker of a lane that may use spot: the best spot price for its shape
    /// when it was launched, $/h ([`onoff_policy::choice::best_spot_price_usd_per_h`]). Its agent
    /// runs a job only while the on-demand premium is worth it
    /// ([`onoff_policy::choice::worth_an_on_demand_worker`]), and the policy counts it so.
    /// `None` otherwise (and for rows written before it existed).
    pub spot_price_usd_per_h: Option<f64>,
    /// The run time, seconds, the control plane gave a job of the worker's lane that declares
    /// none when it launched or last started the worker: the lane's estimate from its last
    /// jobs to finish, else its prior (`lanes[].default_runtime_s`;
    /// [`crate::reconcile::ReconcileReport::run_time_estimates`]). Its agent counts such a job
    /// of its lane so in its deadline and on-demand-premium rules, as the policy does. `None`
    /// when the lane had neither (and for rows written before it existed) until a reconcile run
    /// gives the row the lane's ([`WorkerRegistry::set_run_time_estimate_if_unset`]): the agent
    /// then counts `offers.default_runtime_s`.
    pub run_time_estimate_s: Option<f64>,
    /// The projects whose cache the worker's volume holds, most recently used first, at most
    /// [`MAX_CACHED_PROJECTS`]: written by its agent when its project cache changes (the agent's
    /// `ONOFF_CACHE_DIR` directories); empty when none, or for rows written before it existed. A
    /// stop keeps the volume, so the policy starts a stopped worker holding a job's project's
    /// cache before an equally cheap one that does not ([`onoff_policy::WorkerView::cached_projects`]).
    pub cached_projects: Vec<String>,
    /// The fewest GPUs a job may ask for and be run by this worker, as the policy matches jobs
    /// to workers ([`onoff_policy::choice::smallest_job_gpus`] at its launch: 5 for an 8-GPU
    /// worker by default). Its agent passes the wake-up message of a smaller job on unclaimed,
    /// for a worker of the job's size. `None` for rows its agent registered or written before it
    /// existed: such a worker takes any job it has the GPUs for.
    pub min_job_gpus: Option<u32>,
}

/// At most this many projects are recorded in a worker's row ([`WorkerRecord::cached_projects`],
/// the most recently used ones): 16 names of at most 64 bytes (`JobSpec::parse`) are about 1 KiB
/// of the 400 KB DynamoDB allows an item ("Service, account, and table quotas in Amazon
/// DynamoDB"), and the default 20 GiB cache (`ONOFF_CACHE_GIB`) holds a few models, not 16.
pub const MAX_CACHED_PROJECTS: usize = 16;

impl WorkerRecord {
    /// A worker as registered at its launch: state Pending, launched at `launched_at` (unix
    /// seconds), billed `price_usd_per_h` ($/h; 0 when its agent registers it, see
    /// [`WorkerRegistry::set_price_if_unpriced`]), with no project, idle time, heartbeat, pinned
    /// job, hold, spot reference, run-time estimate, cached project or smallest job. Set those with struct
    /// update syntax.
    pub fn launched(
        id: impl Into<String>,
        lane: impl Into<String>,
        offering: OfferingKey,
        price_usd_per_h: f64,
        launched_at: f64,
    ) -> Self {
        Self {
            id: id.into(),
            lane: lane.into(),
            offering,
            price_usd_per_h,
            state: WorkerState::Pending,
            launched_at,
            project: None,
            idle_since: None,
            heartbeat_at: None,
            pinned_job: None,
            hold_until: None,
            spot_price_usd_per_h: None,
            run_time_estimate_s: None,
            cached_projects: Vec::new(),
            min_job_gpus: None,
        }
    }
}

/// Errors of state stores.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The item does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// A conditional write lost (someone else changed the item first).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The item exists but does not parse (a hand-edited or corrupt row). Retrying cannot help.
    #[error("malformed item: {0}")]
    Malformed(String),
    /// The store refused the request itself (DynamoDB's ValidationException, e.g. an item over
    /// 400 KB): retrying cannot help.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Anything else (I/O, throttling after retries, missing table): retrying may help.
    #[error("store error: {0}")]
    Other(String),
}

/// Rows listed from a store: those that parse, and the keys of those that do not (skipped, so
/// that one bad row never stops scaling or reaping; callers log and count them).
#[derive(Debug, Clone, PartialEq)]
pub struct Listing<T> {
    /// Rows that parse.
    pub items: Vec<T>,
    /// Rows that do not: (key, what is wrong).
    pub unreadable: Vec<(String, String)>,
}

impl<T> Default for Listing<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            unreadable: Vec::new(),
        }
    }
}

/// The workers table.
#[allow(async_fn_in_trait)]
pub trait WorkerRegistry {
    /// Insert a new worker record (state Pending). Idempotent by instance id.
    ///
    /// # Errors
    /// [`StoreError::Other`] on store failure.
    async fn register_launch(&self, record: WorkerRecord) -> Result<(), StoreError>;

    /// Set a worker's state. Not-found is [`StoreError::NotFound`] (the worker is gone).
    ///
    /// # Errors
    /// [`StoreError`] as above.
    async fn set_state(&self, id: &str, state: WorkerState) -> Result<(), StoreError>;

    /// Set a worker's state to `to` only while it is in one of `from` (one conditional write):
    /// `Ok(true)` when written or when the worker already is in `to`, `Ok(false)` when it is in
    /// another state (someone, say its agent claiming a job, changed it first). Idempotent: a
    /// write DynamoDB applied whose answer was lost, sent again by the SDK, finds the row in `to`
    /// and is done, not refused (a scale-down would otherwise leave the instance it marked
    /// Terminating running).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn set_state_if(&self, id: &str, to: WorkerState, from: &[WorkerState]) -> Result<bool, StoreError>;

    /// Give a worker registered without a price (its agent registered it: price 0) the price
    /// `price_usd_per_h` ($/h, its offering's in the catalogue), which its agent then charges its
    /// jobs with. One conditional write: `Ok(true)` when written or the row already has this very
    /// price (the write's own retry, after an answer lost on its way back), `Ok(false)` when the
    /// row has another price.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn set_price_if_unpriced(&self, id: &str, price_usd_per_h: f64) -> Result<bool, StoreError>;

    /// Give a worker whose row has no run-time estimate (launched or started before its lane had
    /// an estimate or a prior, or registered by its agent) the lane's, `run_time_estimate_s`
    /// seconds ([`WorkerRecord::run_time_estimate_s`]), which its agent reads when it next
    /// claims a job that declares none. One conditional write on the row having none:
    /// `Ok(true)` when written or the row already has this very figure (the write's own retry),
    /// `Ok(false)` when it has another.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn set_run_time_estimate_if_unset(&self, id: &str, run_time_estimate_s: f64) -> Result<bool, StoreError>;

    /// Hold an idle worker until `until` (unix seconds): its agent, past its idle timeout, reads
    /// the hold and stays for it (the policy keeps the worker as warm capacity longer than the
    /// agent's safety-net timeout). One conditional write: `Ok(true)` when written or the Idle
    /// worker is already held until exactly `until` (the write's own retry, after an answer lost
    /// on its way back), `Ok(false)` when the worker is not Idle or is held until later.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn hold_idle(&self, id: &str, until: f64) -> Result<bool, StoreError>;

    /// Record that an Idle worker is being stopped: state Stopped, `idle_since` = `at` (unix
    /// seconds, when it was stopped), `hold_until` = `until` (unix seconds: kept stopped until
    /// then, the policy's stopped keep-alive). The row also counts the run the stop ends, from
    /// `launched_at` (unix seconds, the worker's launch or last start) to `at`, in the instance
    /// time billed at its price (DynamoDB: `closed_runs_s` and `stopped_at`, which `onoff cost`
    /// reads; the instance is not billed at its price while stopped). One
    /// conditional write on the state being Idle: `Ok(true)` when written or the row already is
    /// Stopped (the write's own retry), `Ok(false)` when it is in another state (its agent took a
    /// job first: it is not stopped).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn mark_stopped(&self, id: &str, at: f64, until: f64, launched_at: f64) -> Result<bool, StoreError>;

    /// Put back a worker whose start at `at` the provider refused (it is still stopped): state
    /// Stopped, `idle_since` = `stopped_at` and `hold_until` = `stopped_until` again (each removed
    /// when `None`), and `launched_at` = `launched_at` (unix seconds), as
    /// [`WorkerRegistry::mark_started`] found them; so it is kept stopped, and a refused start
    /// held, by its stop as before the start, and the row keeps its own launch time. One
    /// conditional write on the row being Pending since `at` (the refused start's own
    /// write): `Ok(true)` when written or the row already is Stopped with `idle_since` =
    /// `stopped_at` and `launched_at` = `launched_at` (the write's own retry), `Ok(false)` when it
    /// is in another state.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn mark_start_refused(
        &self,
        id: &str,
        at: f64,
        launched_at: f64,
        stopped_at: Option<f64>,
        stopped_until: Option<f64>,
    ) -> Result<bool, StoreError>;

    /// Record that a Stopped worker is being started: state Pending, launched at `at` (unix
    /// seconds: its boot and heartbeat deadlines count from the start), for `project` and pinned
    /// to `job` as a launch would be, with the lane's `run_time_estimate_s` of now
    /// ([`WorkerRecord::run_time_estimate_s`]; `None` removes it), `idle_since`, the hold and the
    /// last heartbeat removed (the agent's from before the stop would read as a dead worker).
    /// One conditional write on the state being Stopped: `Ok(true)` when written or the row
    /// already is Pending since `at` (the write's own retry), `Ok(false)` when it is in another
    /// state.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the worker is unknown; store failures.
    async fn mark_started(
        &self,
        id: &str,
        at: f64,
        project: Option<&str>,
        job: Option<&str>,
        run_time_estimate_s: Option<f64>,
    ) -> Result<bool, StoreError>;

    /// One worker's record; `None` when unknown (not an onoff worker, or its row expired).
    ///
    /// # Errors
    /// Store failures, or a row that does not parse.
    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError>;

    /// Every worker not yet Terminating; rows that do not parse are skipped and listed in
    /// [`Listing::unreadable`].
    ///
    /// # Errors
    /// Store failures.
    async fn list_live(&self) -> Result<Listing<WorkerRecord>, StoreError>;
}

/// Events handled once: EventBridge delivers at least once. Record an event only after its work
/// is done (check with [`EventLog::seen`] first), so a retry after a failure does the work.
#[allow(async_fn_in_trait)]
pub trait EventLog {
    /// Whether `event_id` was recorded as handled. Reads only.
    ///
    /// # Errors
    /// Store failures.
    async fn seen(&self, event_id: &str) -> Result<bool, StoreError>;

    /// Record `event_id` as handled; `true` the first time, `false` when it was already recorded.
    ///
    /// # Errors
    /// Store failures.
    async fn first_time(&self, event_id: &str, now: f64) -> Result<bool, StoreError>;
}

/// Offerings that failed with a capacity error, skipped until a time.
#[allow(async_fn_in_trait)]
pub trait OfferingAvailability {
    /// Mark `key` unavailable until `until` (unix seconds). Idempotent; a later `until` wins.
    ///
    /// # Errors
    /// [`StoreError::Other`] on store failure.
    async fn mark_unavailable(&self, key: &OfferingKey, until: f64) -> Result<(), StoreError>;

    /// Offerings unavailable after `now`.
    ///
    /// # Errors
    /// Store failures.
    async fn list_unavailable(&self, now: f64) -> Result<Vec<onoff_policy::UnavailableOffering>, StoreError>;
}

/// The arrival statistics a lane's decisions keep between reconcile runs: the gaps and declared
/// run times of every arrival folded in so far ([`onoff_policy::observation::ShapeGaps`] per
/// GPUs-per-instance shape, decaying with a one-day half-life), and the creation time of the
/// last arrival folded. The simulator keeps the same statistics in memory, arrival by arrival;
/// the deployed reconciler folds the arrivals created since `folded_to` on each run and keeps
/// the result here ([`ArrivalStatsStore`]), so both decide on the same gaps.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ArrivalStats {
    /// Creation time of the last arrival folded, unix seconds (0: none yet).
    pub folded_to: f64,
    /// Gap and run-time statistics per GPUs-per-instance shape.
    pub gaps: std::collections::BTreeMap<u32, onoff_policy::observation::ShapeGaps>,
}

/// Where the reconciler keeps each lane's [`ArrivalStats`] between runs (DynamoDB: an item of
/// the control table).
#[allow(async_fn_in_trait)]
pub trait ArrivalStatsStore {
    /// The statistics kept for `lane`; `None` before the first save. Statistics kept in another
    /// format (an older build's) come back empty with their `folded_to`, so the next save
    /// replaces them.
    ///
    /// # Errors
    /// Store failures; [`StoreError::Malformed`] for a kept item without its `folded_to`.
    async fn load_arrival_stats(&self, lane: &str) -> Result<Option<ArrivalStats>, StoreError>;

    /// Keep `stats` for `lane` if the kept statistics are still those folded to `previous`
    /// (`None`: none kept yet), so that two runs never fold the same arrivals twice. `false`
    /// when another run saved first (nothing written).
    ///
    /// # Errors
    /// Store failures.
    async fn save_arrival_stats(
        &self,
        lane: &str,
        stats: &ArrivalStats,
        previous: Option<f64>,
    ) -> Result<bool, StoreError>;
}

/// One job's arrival, as the jobs table's arrivals index lists it: finished jobs too.
#[derive(Debug, Clone, PartialEq)]
pub struct ArrivalRecord {
    /// Job id.
    pub id: String,
    /// When the job was created, unix seconds.
    pub created_at: f64,
    /// Its spec (the shape and the declared run time are what the policy reads).
    pub spec: crate::job::JobSpec,
}

/// One job as the jobs table keeps it: the only truth about the job. Queue messages only wake
/// workers up; see docs/control-plane.md, "Job lifecycle".
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// Job id ([`crate::job::job_id_for`] of the idempotency key).
    pub id: String,
    /// The validated spec.
    pub spec: crate::job::JobSpec,
    /// State.
    pub state: crate::job::JobState,
    /// Attempts that counted: claims, less the releases, hand-backs and lost leases.
    pub attempts: u32,
    /// Times a worker too small for the job handed it back.
    pub hand_backs: u32,
    /// Times its lease expired or its worker was lost while RUNNING.
    pub lease_expiries: u32,
    /// Worker holding the lease while RUNNING.
    pub lease_owner: Option<String>,
    /// Lease expiry, unix seconds.
    pub lease_expires_at: Option<f64>,
    /// S3 prefix of the last complete checkpoint.
    pub last_checkpoint: Option<String>,
    /// When a wake-up message for it was last sent to its lane queue, unix seconds (`None`: never).
    pub sent_at: Option<f64>,
    /// Cost so far, $.
    pub cost_usd: f64,
    /// Where the submission came from (`s3://bucket/key#etag` or `sqs:<message id>`).
    pub source: String,
    /// Submission time, unix seconds.
    pub created_at: f64,
    /// Why it failed, or why its last attempt ended early.
    pub reason: Option<String>,
    /// When it reached a final state, unix seconds.
    pub finished_at: Option<f64>,
    /// Seconds from the claim to the end of the attempt that ended it, when a run ended it
    /// ([`crate::job::Settle::run_s`]; `None` for a job cancelled while queued, or not ended):
    /// what [`JobStore::finished_run_times`] lists.
    pub run_s: Option<f64>,
    /// The user asked to cancel it while it ran (`onoff cancel`): its lease holder stops it at
    /// the next renewal and ends it CANCELLED; any end of its lease but success is CANCELLED.
    pub cancel_requested: bool,
    /// When its current lease was taken (RUNNING), unix seconds.
    pub claimed_at: Option<f64>,
    /// Every attempt that ran, oldest first ([`crate::job::AttemptRecord`]).
    pub attempt_log: Vec<crate::job::AttemptRecord>,
    /// What became of the latest attempt's outputs that reported any: files uploaded, or why the
    /// upload failed (`None`: no attempt uploaded any yet).
    pub outputs: Option<crate::job::OutputsRecord>,
}

impl JobRecord {
    /// A new QUEUED job, never sent.
    pub fn new(id: String, spec: crate::job::JobSpec, source: String, now: f64) -> Self {
        Self {
            id,
            spec,
            state: crate::job::JobState::Queued,
            attempts: 0,
            hand_backs: 0,
            lease_expiries: 0,
            lease_owner: None,
            lease_expires_at: None,
            last_checkpoint: None,
            sent_at: None,
            cost_usd: 0.0,
            source,
            created_at: now,
            reason: None,
            finished_at: None,
            run_s: None,
            cancel_requested: false,
            claimed_at: None,
            attempt_log: Vec::new(),
            outputs: None,
        }
    }

    /// Pending (QUEUED or RETRYING) and no wake-up message sent in the last `resend_after_s`: its
    /// message may be gone (never sent, lost, expired), so the reaper sends a fresh one.
    pub fn needs_wake_up(&self, now: f64, resend_after_s: f64) -> bool {
        self.state.is_pending() && self.sent_at.is_none_or(|t| now - t >= resend_after_s)
    }

    /// Since when it has waited for a worker, unix seconds: its submission, or the end of its
    /// last attempt that ran (the attempt log's; a hand-back or a deferral writes none, so the
    /// wait before one counts on).
    pub fn waiting_since(&self) -> f64 {
        self.attempt_log
            .iter()
            .map(|a| a.ended_at)
            .fold(self.created_at, f64::max)
    }
}

/// Result of [`JobStore::create`].
#[derive(Debug, Clone, PartialEq)]
pub enum Created {
    /// A new job.
    New,
    /// The id exists already (a resubmission): its record as stored.
    Existing(Box<JobRecord>),
}

/// Result of [`JobStore::claim`].
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The caller holds the lease now.
    Claimed(Box<JobRecord>),
    /// RUNNING under someone's lease, or finished: the message is irrelevant (if that lease is
    /// lost, the reaper re-queues the job with a fresh message), delete it.
    NotClaimable(crate::job::JobState),
    /// No such job.
    Unknown,
}

/// Result of [`JobStore::renew`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Renewal {
    /// The user asked to cancel the job: stop it and end the attempt as
    /// [`crate::job::AttemptEnd::Cancelled`].
    pub cancel_requested: bool,
}

/// Result of [`JobStore::request_cancel`].
#[derive(Debug, Clone, PartialEq)]
pub enum CancelOutcome {
    /// It was waiting (QUEUED or RETRYING): CANCELLED now.
    Cancelled,
    /// It is RUNNING: its lease holder stops it within a lease renewal and ends it CANCELLED (or
    /// the reaper does, if the lease is lost).
    Requested,
    /// It had already finished, in this state: left as it is.
    AlreadyFinished(crate::job::JobState),
    /// No such job.
    Unknown,
}

/// The jobs table, the only truth about a job. Every state change is a conditional write: a
/// transition from a state the job is no longer in, or under a lease the writer no longer holds,
/// fails with [`StoreError::Conflict`] and never applies twice. Who writes what: the table in
/// docs/control-plane.md, "Job lifecycle".
#[allow(async_fn_in_trait)]
pub trait JobStore {
    /// Insert a new job. Idempotent by id: an existing id returns [`Created::Existing`].
    ///
    /// # Errors
    /// [`StoreError::Invalid`] when the record cannot be stored as it is (DynamoDB: the item is
    /// over 400 KB, a ValidationException); store failures.
    async fn create(&self, record: &JobRecord) -> Result<Created, StoreError>;

    /// One job, `None` when unknown.
    ///
    /// # Errors
    /// Store failures; [`StoreError::Malformed`] for a record that does not parse.
    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError>;

    /// Several jobs by id, each read as [`JobStore::get`] reads it (strongly consistent): the
    /// rows that parse in `items`, those that do not in `unreadable` (id, what is wrong); an id
    /// in neither has no row. Any number of ids, repeats read once; the order is not kept. The
    /// DynamoDB adapter reads them 100 to a request (`BatchGetItem`), asking again for the keys
    /// DynamoDB leaves unprocessed.
    ///
    /// # Errors
    /// Store failures, and keys still unprocessed after the adapter's retries.
    async fn get_many(&self, ids: &[String]) -> Result<Listing<JobRecord>, StoreError>;

    /// Record that a wake-up message for `id` was sent at `at` (unix seconds). Idempotent.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown job; store failures.
    async fn mark_sent(&self, id: &str, at: f64) -> Result<(), StoreError>;

    /// Move `id` from `from` to `to` (which [`crate::job::JobState::can_go`] must allow), clearing the
    /// lease unless `to` is RUNNING. For operators and tests; workers and the reaper use
    /// [`JobStore::claim`], [`JobStore::finish`] and [`JobStore::requeue_lost`].
    ///
    /// A job already in `to` is `Ok` (the write's own retry after its answer was lost, as the
    /// SDK sends it: `contract::lost_answers_are_taken_as_done`).
    ///
    /// # Errors
    /// [`StoreError::Conflict`] when the job is in neither `from` nor `to`; [`StoreError::NotFound`];
    /// store failures.
    async fn transition(
        &self,
        id: &str,
        from: crate::job::JobState,
        to: crate::job::JobState,
    ) -> Result<(), StoreError>;

    /// Claim a pending (QUEUED or RETRYING) job for `owner` until `lease_until`; counts an
    /// attempt. A RUNNING job is never taken over here, even with an expired lease: the reaper
    /// ends that lease first ([`JobStore::requeue_lost`]), so every lost lease is counted.
    /// The claim's own retry (the same `owner` and `now`, sent again after an answer lost on its
    /// way back) is [`Claim::Claimed`] with the row it wrote, not someone else's RUNNING job.
    ///
    /// # Errors
    /// Store failures; [`StoreError::Malformed`] when the claimed record does not parse.
    async fn claim(&self, id: &str, owner: &str, lease_until: f64, now: f64) -> Result<Claim, StoreError>;

    /// Keep an error record for a submission that could not become a job: `key` is its source,
    /// `reason` the clear error. Idempotent by key.
    ///
    /// # Errors
    /// Store failures.
    async fn record_error(&self, key: &str, reason: &str, now: f64) -> Result<(), StoreError>;

    /// Every job not yet finished (QUEUED, RUNNING, RETRYING): its cost does not grow with the
    /// number of finished jobs (DynamoDB: a sparse index of active rows). Rows that do not parse
    /// are skipped and listed in [`Listing::unreadable`].
    ///
    /// # Errors
    /// Store failures.
    async fn active(&self) -> Result<Listing<JobRecord>, StoreError>;

    /// Every job of `lane` created after `after` (unix seconds, exclusive), finished or not, in
    /// creation order: the arrivals the policy's statistics are made of (DynamoDB: the
    /// `arrivals` index, eventually consistent, so a job created in the last second or so may be
    /// missing). Error records are not jobs and are not listed. Rows that do not parse are
    /// skipped and listed in [`Listing::unreadable`].
    ///
    /// # Errors
    /// Store failures (on DynamoDB also an index still being built after an update of the
    /// stack).
    async fn arrivals(&self, lane: &str, after: f64) -> Result<Listing<ArrivalRecord>, StoreError>;

    /// The run times ([`JobRecord::run_s`], seconds) of the last `limit` jobs of `lane` to
    /// finish with one, newest first: the estimate of an undeclared job's run time
    /// ([`onoff_policy::RecentRunTimes`]). DynamoDB: the sparse `run_times` index (partition
    /// `run_lane`, written only with `run_s`; sort `finished_at`; `run_s` projected), eventually
    /// consistent. A job that finished without a run (cancelled while queued, failed on lost
    /// leases) is not in it, so however many there are, the `limit` newest run times are read.
    ///
    /// # Errors
    /// Store failures (on DynamoDB also an index still being built after an update of the
    /// stack).
    async fn finished_run_times(&self, lane: &str, limit: u32) -> Result<Vec<f64>, StoreError>;

    /// While `owner` holds the lease: set the job's last complete checkpoint (an S3 prefix) and
    /// its cost so far, `cost_usd` ($, every attempt's: the cost the claim returned plus this
    /// attempt's so far). A value, not an increment: a write whose answer was lost and that the
    /// SDK sends again sets the same cost instead of counting a stretch twice.
    ///
    /// # Errors
    /// [`StoreError::Conflict`] when `owner` does not hold the lease (the job was re-queued or
    /// claimed by another worker); store failures.
    async fn record_progress(
        &self,
        id: &str,
        owner: &str,
        checkpoint: Option<&str>,
        cost_usd: f64,
    ) -> Result<(), StoreError>;

    /// While `owner` holds the lease of a RUNNING job: extend the lease to `lease_until` (unix
    /// seconds).
    ///
    /// # Errors
    /// [`StoreError::Conflict`] when `owner` no longer holds the lease (it expired and the job was
    /// re-queued or claimed by another worker, or the job is not RUNNING); store failures.
    async fn renew(&self, id: &str, owner: &str, lease_until: f64) -> Result<Renewal, StoreError>;

    /// Cancel job `id` (`onoff cancel`): a waiting job goes to CANCELLED at once; a RUNNING one
    /// gets `cancel_requested`, which its lease holder sees at its next renewal ([`Renewal`]) and
    /// which turns any end of its lease but success into CANCELLED ([`JobStore::finish`],
    /// [`JobStore::requeue_lost`]); a finished one is left alone. Idempotent: the call's own
    /// retry (the same `now`, after an answer lost) of a waiting job's cancel is
    /// [`CancelOutcome::Cancelled`], not "already finished".
    ///
    /// # Errors
    /// Store failures.
    async fn request_cancel(&self, id: &str, now: f64) -> Result<CancelOutcome, StoreError>;

    /// While `owner` holds the lease of a RUNNING job: end the attempt as `settle` says
    /// ([`crate::job::Settle::of`]), clearing the lease and appending `settle.attempt` to the
    /// attempt log. A final state stamps `finished_at = now` and leaves the active index. If a
    /// cancel was asked for since the claim, any end but SUCCEEDED is CANCELLED instead (a
    /// cancelled job never waits again). The call's own retry (after an answer lost on its way
    /// back) finds `settle` written ([`crate::job::Settle::written_on`]) and is done.
    ///
    /// # Errors
    /// [`StoreError::Conflict`] when `owner` does not hold the lease (so a job is never finished
    /// twice) or RUNNING cannot go to `settle.to`; store failures.
    async fn finish(&self, id: &str, owner: &str, settle: &crate::job::Settle, now: f64) -> Result<(), StoreError>;

    /// Record what became of attempt `outputs.attempt`'s outputs on job `id`'s row, unless the row
    /// already holds a later attempt's record. Written after the attempt is settled, by the worker
    /// that ran it, so the row is no longer leased to it; the job's state is left alone. A row
    /// that is gone (expired) is not created again.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for no such row; [`StoreError::Conflict`] when a later attempt's
    /// record is there; store failures.
    async fn record_outputs(&self, id: &str, outputs: &crate::job::OutputsRecord) -> Result<(), StoreError>;

    /// The reaper's end of a lease it found expired or whose worker is lost: applied only while
    /// the job is still RUNNING under exactly the lease it saw (`owner`, `lease_expires_at`), so a
    /// lease renewed or re-claimed meanwhile is never stripped. QUEUED, FAILED, or CANCELLED
    /// when a cancel was asked for (as in [`JobStore::finish`]). The call's own retry finds
    /// `settle` written and is done.
    ///
    /// # Errors
    /// [`StoreError::Conflict`] when the lease changed; store failures.
    async fn requeue_lost(
        &self,
        id: &str,
        owner: &str,
        lease_expires_at: f64,
        settle: &crate::job::Settle,
        now: f64,
    ) -> Result<(), StoreError>;

    /// End job `id` FAILED with `reason` (cut to [`crate::job::MAX_REASON_BYTES`]) while `owner`
    /// holds its lease, without reading the row: for a row that does not parse, which a claim
    /// wrote RUNNING under `owner`'s lease before it answered [`StoreError::Malformed`] (the
    /// claim is one conditional write that returns the row). Stamps `finished_at = now`, clears
    /// the lease and leaves the active index, so the row neither stays RUNNING nor is listed as
    /// unreadable on every run. Done when the row already is FAILED (the write's own retry).
    ///
    /// # Errors
    /// [`StoreError::Conflict`] when `owner` does not hold the lease; store failures.
    async fn fail_unreadable(&self, id: &str, owner: &str, reason: &str, now: f64) -> Result<(), StoreError>;

    /// The reaper's end of a job that waited past its lane's `quota_wait_limit_s`: FAILED with
    /// `reason` (cut to [`crate::job::MAX_REASON_BYTES`]), `finished_at = now`, out of the active
    /// index. Applied only while the row is as `seen` read it: still pending (QUEUED or RETRYING)
    /// with the same attempts, hand-backs, lost leases, attempt-log length and wake-up message
    /// time (`sent_at`: every way back to the queue sends a fresh message, a deferral too, which
    /// changes no count), so a job a worker claimed since, or that ran and came back, is left
    /// alone. `Ok(true)` when this call ended
    /// it (its own write read back, when the answer to it was lost and the SDK sent it again);
    /// `Ok(false)` when the job moved on or is gone.
    ///
    /// # Errors
    /// Store failures.
    async fn fail_waiting(&self, seen: &JobRecord, reason: &str, now: f64) -> Result<bool, StoreError>;
}

/// Queue depth per lane.
#[allow(async_fn_in_trait)]
pub trait Backlog {
    /// Backlog of `lane`.
    ///
    /// # Errors
    /// Queue failures, as text.
    async fn backlog(&self, lane: &str) -> Result<onoff_policy::LaneBacklog, String>;
}

/// An instance the fleet reports.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetInstance {
    /// Instance id.
    pub instance_id: String,
    /// Its offering.
    pub offering: OfferingKey,
    /// Launch time, unix seconds.
    pub launched_at: f64,
    /// The lane it was launched for (EC2: its `onoff:lane` tag), if it says.
    pub lane: Option<String>,
    /// The project it was launched for (EC2: its `onoff:project` tag), if any.
    pub project: Option<String>,
    /// The job the launch was pinned to (EC2: its `onoff:job` tag), if any.
    pub job: Option<String>,
    /// Stopping or stopped (EC2's state), not pending or running.
    pub stopped: bool,
}

/// A persistent spot request onoff made (a stoppable spot worker's, tagged `onoff:managed`)
/// that may still launch: open (waiting to launch, as after its instance terminated), active
/// (its instance runs) or disabled (its instance is stopped).
#[derive(Debug, Clone, PartialEq)]
pub struct SpotRequest {
    /// Request id (`sir-...`).
    pub id: String,
    /// Its instance, if it has one now.
    pub instance_id: Option<String>,
    /// When it was made, unix seconds.
    pub created_at: f64,
}

impl SpotRequest {
    /// Whether a live worker holds it: its instance is one of theirs (`is_live`). One that is
    /// open (no instance) or names an instance no live row knows is held by none, and EC2
    /// launches again from it until it is cancelled.
    pub fn is_held(&self, is_live: impl Fn(&str) -> bool) -> bool {
        self.instance_id.as_deref().is_some_and(is_live)
    }
}

/// Listing the fleet's instances and persistent spot requests, for the reaper.
#[allow(async_fn_in_trait)]
pub trait FleetLister {
    /// Every instance onoff launched (tagged `onoff:managed`) that is pending, running, stopping
    /// or stopped (a stopped worker is kept, not gone).
    ///
    /// # Errors
    /// Provider failures.
    async fn list_managed(&self) -> Result<Vec<FleetInstance>, FleetError>;

    /// Every persistent spot request of this deployment that may still launch ([`SpotRequest`]).
    ///
    /// # Errors
    /// Provider failures.
    async fn list_spot_requests(&self) -> Result<Vec<SpotRequest>, FleetError>;

    /// Cancel the spot requests `ids`, leaving their instances as they are. Idempotent: a request
    /// gone or cancelled already is done.
    ///
    /// # Errors
    /// Provider failures.
    async fn cancel_spot_requests(&self, ids: &[String]) -> Result<(), FleetError>;
}

/// Sending wake-up messages (`{"job_id": ..., "gpus": ...}`, [`wake_up_body`]) to lane queues.
#[allow(async_fn_in_trait)]
pub trait JobQueue {
    /// Send `body` to `lane`'s queue, visible after `delay_s` (SQS: at most 900 s). Not
    /// idempotent: each call sends a message (duplicates are harmless: claims are conditional).
    ///
    /// # Errors
    /// Queue failures, as text.
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String>;
}

/// Send a fresh wake-up message for job `job_id` of `spec` to its lane's queue (visible after
/// `delay_s`) and record it on the row ([`JobRecord::sent_at`]). If either step fails the row
/// stays without a recent send and the reaper sends again within `resend_after_s`.
///
/// # Errors
/// [`WakeError`]: which of the two steps failed.
pub async fn wake<J: JobStore, Q: JobQueue>(
    jobs: &J,
    queue: &Q,
    job_id: &str,
    spec: &crate::job::JobSpec,
    delay_s: u32,
    now: f64,
) -> Result<(), WakeError> {
    queue
        .send(&spec.lane, &wake_up_body(job_id, spec.gpus, now), delay_s)
        .await
        .map_err(WakeError::Queue)?;
    jobs.mark_sent(job_id, now).await.map_err(WakeError::Store)
}

/// Why [`wake`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WakeError {
    /// The message was not sent.
    #[error("send wake-up message: {0}")]
    Queue(String),
    /// The message was sent, `sent_at` not recorded (the job may have been deleted).
    #[error("record wake-up message: {0}")]
    Store(StoreError),
}

/// Body of a wake-up message: `{"job_id": ..., "gpus": ..., "sent_at": ...}`. The job's GPUs
/// let a worker too small for it pass the message on without claiming the job
/// ([`WakeUp::too_big_for`]); the row stays the truth, and a body without them (an older
/// sender's) is claimed as any. `sent_at` (unix seconds) is what [`wake`] records as the row's
/// `sent_at` once the message is sent: a message older than the row's has been superseded by a
/// later one, and a worker passing messages on drops it ([`WakeUp::stale`]).
pub fn wake_up_body(job_id: &str, gpus: u32, sent_at: f64) -> String {
    serde_json::json!({ "job_id": job_id, "gpus": gpus, "sent_at": sent_at }).to_string()
}

/// A wake-up message as a worker reads it ([`wake_up_body`]).
#[derive(Debug, Clone, PartialEq)]
pub struct WakeUp {
    /// The job.
    pub job_id: String,
    /// The GPUs its spec asks for, when the message says.
    pub gpus: Option<u32>,
    /// When it was sent (the row's `sent_at` it was sent under), unix seconds, when it says.
    pub sent_at: Option<f64>,
}

impl WakeUp {
    /// Parse a message body; `None` when it is not `{"job_id": "..."}` (poison).
    pub fn parse(body: &str) -> Option<Self> {
        let v = serde_json::from_str::<serde_json::Value>(body).ok()?;
        Some(Self {
            job_id: v.get("job_id")?.as_str()?.to_string(),
            gpus: v
                .get("gpus")
                .and_then(serde_json::Value::as_u64)
                .and_then(|g| u32::try_from(g).ok()),
            sent_at: v.get("sent_at").and_then(serde_json::Value::as_f64),
        })
    }

    /// Why a worker that would pass this message on should drop it instead, given its job's row:
    /// the job no longer waits (running under a lease, or finished), or a later wake-up message
    /// was sent for it (the row's `sent_at` is later than this message's). `None` when it must go
    /// on. (A message of a job with no row is poison, as on the claim path.)
    ///
    /// Such messages went round for as long as their job's shape waited: each one a worker too
    /// small for it passes on as a fresh message. A duplicate (the reaper's, sent while the first
    /// was in flight) then counted in the lane's queue as another waiting job's message, and the
    /// reaper, which sends as many as the queue falls short of the pending jobs, sent none to a
    /// job whose own message was gone (`reconcile::reap_jobs`): it waited beside an idle worker
    /// of its size.
    pub fn stale(&self, r: &JobRecord) -> Option<String> {
        if !r.state.is_pending() {
            return Some(format!("job {} is {}", self.job_id, r.state.as_str()));
        }
        match (self.sent_at, r.sent_at) {
            (Some(mine), Some(latest)) if latest > mine => Some(format!(
                "a later wake-up message of job {} was sent (at {latest}, this one at {mine})",
                self.job_id
            )),
            _ => None,
        }
    }

    /// Whether the job asks for more GPUs than a worker with `gpus` has (`None`: unknown, as an
    /// agent without `ONOFF_GPUS`): such a worker passes the message on unclaimed.
    pub fn too_big_for(&self, gpus: Option<u32>) -> bool {
        matches!((self.gpus, gpus), (Some(want), Some(have)) if want > have)
    }

    /// Whether the job asks for fewer GPUs than a worker serving jobs from `min_job_gpus` up
    /// takes ([`WorkerRecord::min_job_gpus`]; `None`: any): such a worker passes the message on
    /// unclaimed.
    pub fn too_small_for(&self, min_job_gpus: Option<u32>) -> bool {
        matches!((self.gpus, min_job_gpus), (Some(want), Some(least)) if want < least)
    }
}

/// A complete checkpoint of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRef {
    /// Job id.
    pub job_id: String,
    /// Sequence number (higher is newer).
    pub seq: u64,
    /// Files (paths relative to the checkpoint directory) with their sizes in bytes.
    pub files: Vec<(String, u64)>,
}

/// Object-store prefix of checkpoint `seq` of `job_id`: `checkpoints/<job-id>/<seq as 20 digits>/`
/// (what [`JobRecord::last_checkpoint`] holds).
pub fn checkpoint_prefix(job_id: &str, seq: u64) -> String {
    format!("checkpoints/{job_id}/{seq:020}/")
}

/// Checkpoints in object storage under `checkpoints/<job-id>/<seq>/`, each made complete by a
/// manifest written after every file, so a half-written checkpoint is never resumed from.
#[allow(async_fn_in_trait)]
pub trait CheckpointStore {
    /// Upload every file under `dir` as checkpoint `seq` of `job_id`, then its manifest.
    /// Re-uploading the same `seq` overwrites it.
    ///
    /// # Errors
    /// Local I/O or store failures (the checkpoint then has no manifest and does not count).
    async fn upload(&self, job_id: &str, seq: u64, dir: &std::path::Path) -> Result<CheckpointRef, StoreError>;

    /// The newest complete checkpoint of `job_id`, `None` when there is none.
    ///
    /// # Errors
    /// Store failures.
    async fn latest(&self, job_id: &str) -> Result<Option<CheckpointRef>, StoreError>;

    /// Download checkpoint `r` into `dest` (created if missing).
    ///
    /// # Errors
    /// Local I/O or store failures.
    async fn download(&self, r: &CheckpointRef, dest: &std::path::Path) -> Result<(), StoreError>;
}

/// A named lease, so that two control-plane invocations at once do not both act (two scalers
/// would both launch for the same backlog).
#[allow(async_fn_in_trait)]
pub trait Lease {
    /// Take `name` for `owner` until `now + ttl_s`: succeeds when it is free, expired, or already
    /// held by `owner`. Returns whether `owner` holds it now.
    ///
    /// # Errors
    /// Store failures.
    async fn acquire(&self, name: &str, owner: &str, ttl_s: f64, now: f64) -> Result<bool, StoreError>;

    /// Give `name` back if `owner` holds it (otherwise nothing happens).
    ///
    /// # Errors
    /// Store failures.
    async fn release(&self, name: &str, owner: &str) -> Result<(), StoreError>;

    /// Note that a run under `name` that started at `started_at` (unix seconds) completed. The
    /// latest start is kept: an earlier one written late changes nothing.
    ///
    /// # Errors
    /// Store failures.
    async fn mark_done(&self, name: &str, started_at: f64) -> Result<(), StoreError>;

    /// When the latest completed run under `name` started ([`Lease::mark_done`]), unix seconds;
    /// `None` before the first.
    ///
    /// # Errors
    /// Store failures.
    async fn last_done(&self, name: &str) -> Result<Option<f64>, StoreError>;

    /// Count an ask for a run under `name` (a scale request) and
    /// say whether the asker should invoke the run: [`ScaleAsk::Invoke`] when no ask is pending
    /// (or the pending one is older than `stale_s`, its invocation lost), which makes this one
    /// pending from `now`; [`ScaleAsk::Joined`] when an ask is pending: a run that has not yet
    /// read the count ([`Lease::asks`]) will see this one, and one that has read it will find the
    /// count changed when it settles ([`Lease::settle_asks`]) and run again. The count and the
    /// pending mark change in one conditional write each, so an ask is never lost between a
    /// run's settle and a join.
    ///
    /// `jobs`: the ids of the jobs the ask is for, written before it (at most [`MAX_ASKED_JOBS`]
    /// per ask, none more once [`MAX_KEPT_ASKED_JOBS`] are kept, ids longer than
    /// [`MAX_ASKED_JOB_ID_BYTES`] skipped). They are kept with the count, before it, so the run
    /// that reads the count reads those jobs from the table itself ([`Asks::jobs`]): the `active`
    /// index it lists the backlog through is eventually consistent and may not show them yet.
    ///
    /// # Errors
    /// Store failures (the asker then invokes anyway).
    async fn ask(&self, name: &str, jobs: &[String], now: f64, stale_s: f64) -> Result<ScaleAsk, StoreError>;

    /// The asks counted under `name` so far (0 before the first), the pending one's time and the
    /// jobs asked for and not yet forgotten ([`Lease::forget_asked_jobs`]), read consistently: a
    /// run reads it before it reads the backlog, so every ask counted by then is one whose jobs
    /// it sees (through the index, or read by id).
    ///
    /// # Errors
    /// Store failures.
    async fn asks(&self, name: &str) -> Result<Asks, StoreError>;

    /// Forget the asked jobs `jobs` under `name` (a run read them): asks made since keep theirs.
    /// Nothing to do for no ids.
    ///
    /// # Errors
    /// Store failures.
    async fn forget_asked_jobs(&self, name: &str, jobs: &[String]) -> Result<(), StoreError>;

    /// End the pending ask under `name` if the count is still `seen` (no ask since the run read
    /// it): returns `true` then (also when none was pending), `false` when an ask came in meanwhile
    /// (it stays pending: the run should go again).
    ///
    /// # Errors
    /// Store failures.
    async fn settle_asks(&self, name: &str, seen: u64) -> Result<bool, StoreError>;

    /// End the pending ask under `name` whatever the count (a run that gives up going again: the
    /// next ask invokes afresh).
    ///
    /// # Errors
    /// Store failures.
    async fn drop_pending_ask(&self, name: &str) -> Result<(), StoreError>;
}

/// Most job ids one ask keeps ([`Lease::ask`]): a submission's batch holds at most 10 jobs (the
/// submission queue's `BatchSize`); an ask for more keeps the first ones, and the rest reach the
/// run through the index only.
pub const MAX_ASKED_JOBS: usize = 100;

/// Job ids kept under one name past which an ask keeps none of its own ([`Lease::ask`]): the set
/// holds at most this plus [`MAX_ASKED_JOBS`] - 1 ids. With ids of at most
/// [`MAX_ASKED_JOB_ID_BYTES`] that is under 70 KB, far from DynamoDB's 400 KB item limit. A set that full means runs have not forgotten what they read
/// for many asks; those jobs reach the run through the index.
pub const MAX_KEPT_ASKED_JOBS: usize = 1_000;

/// Longest job id an ask keeps, bytes (onoff's own are 20: [`crate::job::job_id_for`]).
pub const MAX_ASKED_JOB_ID_BYTES: usize = 64;

/// The scale requests counted under a name ([`Lease::asks`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Asks {
    /// Asks counted so far.
    pub count: u64,
    /// When the pending ask was made (unix seconds), if one is pending.
    pub pending_since: Option<f64>,
    /// The jobs asked for and not yet forgotten ([`Lease::forget_asked_jobs`]), ids ascending.
    pub jobs: Vec<String>,
}

/// What [`Lease::ask`] tells an asker to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleAsk {
    /// No run is pending: invoke one (this ask is now the pending one).
    Invoke,
    /// A run is pending and will see this ask: nothing to invoke.
    Joined,
}

// References forward, so several users (agents in tests, the local runner) can share one store.
impl<T: JobStore> JobStore for &T {
    async fn create(&self, record: &JobRecord) -> Result<Created, StoreError> {
        (**self).create(record).await
    }
    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        (**self).get(id).await
    }
    async fn mark_sent(&self, id: &str, at: f64) -> Result<(), StoreError> {
        (**self).mark_sent(id, at).await
    }
    async fn transition(
        &self,
        id: &str,
        from: crate::job::JobState,
        to: crate::job::JobState,
    ) -> Result<(), StoreError> {
        (**self).transition(id, from, to).await
    }
    async fn claim(&self, id: &str, owner: &str, lease_until: f64, now: f64) -> Result<Claim, StoreError> {
        (**self).claim(id, owner, lease_until, now).await
    }
    async fn record_error(&self, key: &str, reason: &str, now: f64) -> Result<(), StoreError> {
        (**self).record_error(key, reason, now).await
    }
    async fn active(&self) -> Result<Listing<JobRecord>, StoreError> {
        (**self).active().await
    }
    async fn arrivals(&self, lane: &str, after: f64) -> Result<Listing<ArrivalRecord>, StoreError> {
        (**self).arrivals(lane, after).await
    }
    async fn finished_run_times(&self, lane: &str, limit: u32) -> Result<Vec<f64>, StoreError> {
        (**self).finished_run_times(lane, limit).await
    }
    async fn get_many(&self, ids: &[String]) -> Result<Listing<JobRecord>, StoreError> {
        (**self).get_many(ids).await
    }
    async fn record_progress(
        &self,
        id: &str,
        owner: &str,
        checkpoint: Option<&str>,
        cost_usd: f64,
    ) -> Result<(), StoreError> {
        (**self).record_progress(id, owner, checkpoint, cost_usd).await
    }
    async fn renew(&self, id: &str, owner: &str, lease_until: f64) -> Result<Renewal, StoreError> {
        (**self).renew(id, owner, lease_until).await
    }
    async fn request_cancel(&self, id: &str, now: f64) -> Result<CancelOutcome, StoreError> {
        (**self).request_cancel(id, now).await
    }
    async fn finish(&self, id: &str, owner: &str, settle: &crate::job::Settle, now: f64) -> Result<(), StoreError> {
        (**self).finish(id, owner, settle, now).await
    }
    async fn record_outputs(&self, id: &str, outputs: &crate::job::OutputsRecord) -> Result<(), StoreError> {
        (**self).record_outputs(id, outputs).await
    }
    async fn requeue_lost(
        &self,
        id: &str,
        owner: &str,
        lease_expires_at: f64,
        settle: &crate::job::Settle,
        now: f64,
    ) -> Result<(), StoreError> {
        (**self).requeue_lost(id, owner, lease_expires_at, settle, now).await
    }
    async fn fail_unreadable(&self, id: &str, owner: &str, reason: &str, now: f64) -> Result<(), StoreError> {
        (**self).fail_unreadable(id, owner, reason, now).await
    }
    async fn fail_waiting(&self, seen: &JobRecord, reason: &str, now: f64) -> Result<bool, StoreError> {
        (**self).fail_waiting(seen, reason, now).await
    }
}

impl<T: JobQueue> JobQueue for &T {
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String> {
        (**self).send(lane, body, delay_s).await
    }
}

impl<T: CheckpointStore> CheckpointStore for &T {
    async fn upload(&self, job_id: &str, seq: u64, dir: &std::path::Path) -> Result<CheckpointRef, StoreError> {
        (**self).upload(job_id, seq, dir).await
    }
    async fn latest(&self, job_id: &str) -> Result<Option<CheckpointRef>, StoreError> {
        (**self).latest(job_id).await
    }
    async fn download(&self, r: &CheckpointRef, dest: &std::path::Path) -> Result<(), StoreError> {
        (**self).download(r, dest).await
    }
}

#[cfg(test)]
mod tests {
    use super::{wake_up_body, WakeUp};

    #[test]
    fn a_wake_up_says_its_jobs_gpus_and_a_body_without_them_is_claimed_as_any() {
        let w = WakeUp::parse(&wake_up_body("job-8", 8, 1_700_000_000.125)).unwrap();
        assert_eq!(
            w,
            WakeUp {
                job_id: "job-8".into(),
                gpus: Some(8),
                sent_at: Some(1_700_000_000.125),
            }
        );
        assert!(w.too_big_for(Some(4)));
        assert!(!w.too_big_for(Some(8)));
        assert!(!w.too_big_for(None), "a worker that does not know its GPUs claims");
        // An older sender's body: no GPUs, never passed on.
        let old = WakeUp::parse(r#"{"job_id":"job-8"}"#).unwrap();
        assert_eq!(old.gpus, None);
        assert!(!old.too_big_for(Some(1)));
        // Poison: not an object with a string job_id.
        for bad in ["", "job-8", r#"{"job_id":8}"#, r#"{"id":"job-8"}"#] {
            assert_eq!(WakeUp::parse(bad), None, "{bad:?}");
        }
        // GPUs that are not a count are ignored, not poison.
        assert_eq!(WakeUp::parse(r#"{"job_id":"j","gpus":"8"}"#).unwrap().gpus, None);
    }

    #[test]
    fn a_message_is_stale_once_its_job_stops_waiting_or_a_later_one_was_sent() {
        use super::JobRecord;
        use crate::job::{JobSpec, JobState};
        let t = 1_700_000_000.0;
        let spec: JobSpec = serde_json::from_str(r#"{"image":"i","command":["x"],"project":"p","gpus":8}"#).unwrap();
        let mut row = JobRecord::new("job-8".into(), spec, "test".into(), t);
        let at = |sent: f64| WakeUp::parse(&wake_up_body("job-8", 8, sent)).unwrap();
        // Waiting, and this is the message its row was last sent under (or a later one whose
        // `sent_at` is not recorded yet): it goes on.
        row.sent_at = Some(t + 10.0);
        assert_eq!(at(t + 10.0).stale(&row), None);
        assert_eq!(at(t + 20.0).stale(&row), None);
        // An earlier one: a later message was sent, this one is a duplicate.
        assert!(at(t).stale(&row).is_some_and(|w| w.contains("later wake-up")));
        // An older sender's body (no time) is never taken for a duplicate.
        let old = WakeUp::parse(r#"{"job_id":"job-8","gpus":8}"#).unwrap();
        assert_eq!(old.stale(&row), None);
        // A row never sent (the reaper's to send): nothing is later.
        row.sent_at = None;
        assert_eq!(at(t).stale(&row), None);
        // The job runs, or has finished: no message need go on.
        for s in [JobState::Running, JobState::Succeeded, JobState::Cancelled] {
            row.state = s;
            assert!(at(t).stale(&row).is_some_and(|w| w.contains(s.as_str())), "{s:?}");
            assert!(old.stale(&row).is_some(), "{s:?}");
        }
    }
}
