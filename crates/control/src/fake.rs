//! In-memory fakes of the ports, for unit tests and the simulator.
//!
//! [`FakeFleet`] records every call, can inject one-shot errors, declare offerings without
//! capacity or failing with any error, holds vCPU quotas per bucket of families and capacity type
//! (for launches and starts alike),
//! and is idempotent by client token as EC2 is, refusing a token reused with other parameters
//! (with [`FakeFleet::stops_take_time`], its stops last until settled, as EC2's do). [`FakeRegistry`] (with the agent's conditional writes and
//! one-shot errors) and [`FakeAvailability`] keep state in memory. [`FakeJobs`] keeps DynamoDB's
//! conditional writes, item limit, lagging index and lost answers. [`contract`]: promises every
//! store and fleet must keep, run against these fakes and against DynamoDB and EC2 (moto) alike.

pub mod contract;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use onoff_policy::{CapacityType, Offering, OfferingKey, WorkerState};

use crate::ports::{
    Fleet, FleetError, FleetErrorKind, LaunchRequest, LaunchResult, Launched, OfferingAvailability, StoreError,
    WorkerRecord, WorkerRegistry,
};
use crate::quota::QuotaBucket;

/// A call made to [`FakeFleet`].
#[derive(Debug, Clone, PartialEq)]
pub enum FleetCall {
    /// `launch`.
    Launch(LaunchRequest),
    /// `terminate`.
    Terminate(Vec<String>),
    /// `cancel_launch`.
    Cancel(Vec<String>),
    /// `stop`.
    Stop(Vec<String>),
    /// `start`.
    Start(Vec<String>),
    /// `cancel_spot_requests`.
    CancelRequests(Vec<String>),
}

/// A fleet in memory.
#[derive(Debug, Default)]
pub struct FakeFleet {
    inner: Mutex<FleetInner>,
}

/// An instance's lane, project and job tags, and its launch time (unix seconds).
type InstanceTags = (Option<String>, Option<String>, Option<String>, f64);

#[derive(Debug, Default)]
struct FleetInner {
    calls: Vec<FleetCall>,
    next_id: u64,
    running: BTreeMap<String, OfferingKey>,
    /// Instances stopped, with their offering (out of `running`).
    stopped: BTreeMap<String, OfferingKey>,
    /// Instances EC2 refuses to stop (a spot instance of a one-time request).
    unstoppable: std::collections::BTreeSet<String>,
    /// Instances whose stop is not over yet: a start is refused.
    still_stopping: std::collections::BTreeSet<String>,
    /// Every stop leaves its instance stopping until [`FakeFleet::set_stopped_fully`].
    stops_take_time: bool,
    /// Instances terminated (EC2 lists them for about an hour, and refuses them a stop).
    terminated: std::collections::BTreeSet<String>,
    no_capacity: Vec<OfferingKey>,
    /// Offerings whose launches fail with this error (any kind).
    failing: BTreeMap<OfferingKey, FleetError>,
    /// Max instances per launch call per offering (partial fulfilment), if set.
    limit: BTreeMap<OfferingKey, u32>,
    one_shot: VecDeque<FleetError>,
    /// Each client token's first call and its result: EC2 answers a repeated token with that
    /// result, and refuses it with other parameters (`IdempotentParameterMismatch`, EC2 API
    /// Reference, "Ensuring idempotency").
    by_token: BTreeMap<String, (LaunchRequest, LaunchResult)>,
    /// Each instance's lane, project and job tags and launch time, as listed (launches of this
    /// fake at time 0).
    tags: BTreeMap<String, InstanceTags>,
    /// vCPU quotas of running instances per bucket of families and capacity type, as EC2 holds
    /// them ([`FakeFleet::set_vcpu_quota`]).
    quotas: BTreeMap<(QuotaBucket, CapacityType), u32>,
    /// What [`crate::ports::SpotPrices::spot_quotes`] answers (default: no quotes), and how
    /// often it was asked.
    spot_quotes: Option<Result<Vec<crate::catalog::SpotQuote>, FleetError>>,
    spot_quote_calls: usize,
    /// vCPUs per instance type, for the quotas.
    vcpus: BTreeMap<String, u32>,
    /// Persistent spot requests ([`FakeFleet::add_spot_request`]), each with whether it is
    /// cancelled.
    spot_requests: BTreeMap<String, (crate::ports::SpotRequest, bool)>,
}

impl FleetInner {
    /// Terminate `ids`: out of the running and stopped ones, remembered as terminated.
    fn end(&mut self, ids: &[String]) {
        for id in ids {
            let known = self.running.remove(id).is_some() | self.stopped.remove(id).is_some();
            self.still_stopping.remove(id);
            if known {
                self.terminated.insert(id.clone());
            }
        }
    }

    /// The quota error a launch of one more `k` meets, if its bucket's quota has no room for it.
    fn over_quota(&self, k: &OfferingKey) -> Option<FleetError> {
        let bucket = QuotaBucket::of(&k.instance_type);
        let limit = *self.quotas.get(&(bucket, k.capacity_type))?;
        let vcpus = |t: &str| self.vcpus.get(t).copied().unwrap_or(0);
        let used: u32 = self
            .running
            .values()
            .filter(|r| r.capacity_type == k.capacity_type && QuotaBucket::of(&r.instance_type) == bucket)
            .map(|r| vcpus(&r.instance_type))
            .sum();
        (used + vcpus(&k.instance_type) > limit).then(|| FleetError {
            kind: FleetErrorKind::QuotaExceeded,
            message: match k.capacity_type {
                CapacityType::OnDemand => format!(
                    "VcpuLimitExceeded: You have requested more vCPU capacity than your current vCPU limit of {limit} \
                     allows for the instance bucket that the specified instance type belongs to"
                ),
                CapacityType::Spot => "MaxSpotInstanceCountExceeded: Max spot instance count exceeded".into(),
            },
        })
    }
}

impl FakeFleet {
    /// An empty fleet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stopping instance `id` is refused with `UnsupportedOperation`, as EC2 refuses to stop a
    /// spot instance of a one-time request.
    pub fn set_unstoppable(&self, id: &str) {
        self.inner.lock().expect("lock").unstoppable.insert(id.to_string());
    }

    /// Starting instance `id` is refused as EC2 refuses an instance still stopping
    /// ([`FleetErrorKind::Stopping`]) until [`FakeFleet::set_stopped_fully`].
    pub fn set_still_stopping(&self, id: &str) {
        self.inner.lock().expect("lock").still_stopping.insert(id.to_string());
    }

    /// From now on every stop leaves its instance stopping, a start refused
    /// ([`FleetErrorKind::Stopping`]) until [`FakeFleet::set_stopped_fully`], as EC2 takes
    /// minutes to stop an instance ("Stop and start Amazon EC2 instances", EC2 User Guide).
    /// Off by default: tests that start an instance a simulated hour after its stop need no
    /// settling.
    pub fn stops_take_time(&self) {
        self.inner.lock().expect("lock").stops_take_time = true;
    }

    /// Instance `id`'s stop is over: it starts again.
    pub fn set_stopped_fully(&self, id: &str) {
        self.inner.lock().expect("lock").still_stopping.remove(id);
    }

    /// Instances stopped (stopped and not started or terminated since), with their offering.
    pub fn stopped(&self) -> BTreeMap<String, OfferingKey> {
        self.inner.lock().expect("lock").stopped.clone()
    }

    /// Every launch of `key` fails with InsufficientCapacity, and so does every start of a
    /// stopped instance of it.
    pub fn set_no_capacity(&self, key: OfferingKey) {
        self.inner.lock().expect("lock").no_capacity.push(key);
    }

    /// Every launch of `key` fails for that offering with `err` (EC2 reports such errors per
    /// override: Unsupported, InvalidParameterValue for the type in that zone, ...).
    pub fn set_launch_error(&self, key: OfferingKey, err: FleetError) {
        self.inner.lock().expect("lock").failing.insert(key, err);
    }

    /// Hold EC2's vCPU quota of `bucket` and `capacity` at `vcpus` running vCPUs (0: none may run),
    /// with each instance type's vCPUs from `offerings`: a launch that would pass it fails for that
    /// offering with VcpuLimitExceeded (on-demand) or MaxSpotInstanceCountExceeded (spot), and so
    /// does the start of a stopped instance (stopped instances do not count).
    pub fn set_vcpu_quota(&self, bucket: QuotaBucket, capacity: CapacityType, vcpus: u32, offerings: &[Offering]) {
        let mut s = self.inner.lock().expect("lock");
        s.quotas.insert((bucket, capacity), vcpus);
        for o in offerings {
            s.vcpus.insert(o.key.instance_type.clone(), o.vcpus);
        }
    }

    /// Launches of `key` create at most `n` instances per call.
    pub fn set_capacity_limit(&self, key: OfferingKey, n: u32) {
        self.inner.lock().expect("lock").limit.insert(key, n);
    }

    /// The next call fails with `err` (one-shot; queue several for several calls).
    pub fn fail_next(&self, err: FleetError) {
        self.inner.lock().expect("lock").one_shot.push_back(err);
    }

    /// Calls made so far.
    pub fn calls(&self) -> Vec<FleetCall> {
        self.inner.lock().expect("lock").calls.clone()
    }

    /// Instances running (launched and not terminated), with their offering.
    pub fn running(&self) -> BTreeMap<String, OfferingKey> {
        self.inner.lock().expect("lock").running.clone()
    }

    /// Forget calls and state.
    pub fn reset(&self) {
        *self.inner.lock().expect("lock") = FleetInner::default();
    }

    /// Answer [`crate::ports::SpotPrices::spot_quotes`] with `quotes` (the instance types asked
    /// for filter them, as EC2's does) or with an error, from now on.
    pub fn set_spot_quotes(&self, quotes: Result<Vec<crate::catalog::SpotQuote>, FleetError>) {
        self.inner.lock().expect("lock").spot_quotes = Some(quotes);
    }

    /// How many times [`crate::ports::SpotPrices::spot_quotes`] was called.
    pub fn spot_quote_calls(&self) -> usize {
        self.inner.lock().expect("lock").spot_quote_calls
    }
}

impl crate::ports::SpotPrices for FakeFleet {
    async fn spot_quotes(&self, instance_types: &[String]) -> Result<Vec<crate::catalog::SpotQuote>, FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.spot_quote_calls += 1;
        match &s.spot_quotes {
            None => Ok(Vec::new()),
            Some(Err(e)) => Err(e.clone()),
            Some(Ok(q)) => Ok(q
                .iter()
                .filter(|q| instance_types.contains(&q.instance_type))
                .cloned()
                .collect()),
        }
    }
}

impl Fleet for FakeFleet {
    async fn launch(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.calls.push(FleetCall::Launch(req.clone()));
        if let Some(e) = s.one_shot.pop_front() {
            return Err(e);
        }
        // A retried call: the first call's result, nothing launched again; the token with other
        // parameters is refused, as EC2 does ("If you retry a successful request using the same
        // client token, but one or more of the parameters are different ...
        // IdempotentParameterMismatch", EC2 API Reference, "Ensuring idempotency").
        if let Some((first, r)) = s
            .by_token
            .get(&req.client_token)
            .filter(|_| !req.client_token.is_empty())
        {
            if first != req {
                return Err(FleetError {
                    kind: FleetErrorKind::Other,
                    message: format!(
                        "IdempotentParameterMismatch: client token {} was used with other parameters",
                        req.client_token
                    ),
                });
            }
            return Ok(r.clone());
        }
        // What EC2 refuses whole: an instant fleet launches one capacity type, and takes no two
        // overrides of one instance type in one zone's subnet.
        if let Some(e) = crate::ports::invalid_fleet_request(req) {
            return Err(e);
        }
        let no_capacity = |k: &OfferingKey| FleetError {
            kind: FleetErrorKind::InsufficientCapacity,
            message: format!("InsufficientInstanceCapacity: no capacity for {k}"),
        };
        let mut out = LaunchResult::default();
        // Per offering: how many more it can take in this call.
        let mut room: Vec<(OfferingKey, u32)> = Vec::new();
        for k in &req.offerings {
            if s.no_capacity.contains(k) {
                out.short.push((k.clone(), no_capacity(k)));
            } else if let Some(e) = s.failing.get(k) {
                out.short.push((k.clone(), e.clone()));
            } else {
                room.push((k.clone(), s.limit.get(k).copied().unwrap_or(u32::MAX)));
            }
        }
        if room.is_empty() {
            // As an instant fleet that launched nothing: the first offering's error.
            return Err(out.short.swap_remove(0).1);
        }
        // Round-robin over the offerings with room.
        let mut left = req.count;
        let mut over_quota: Vec<(OfferingKey, FleetError)> = Vec::new();
        while left > 0 && room.iter().any(|(_, r)| *r > 0) {
            for (k, r) in room.iter_mut().filter(|(_, r)| *r > 0) {
                if left == 0 {
                    break;
                }
                if let Some(e) = s.over_quota(k) {
                    *r = 0;
                    over_quota.push((k.clone(), e));
                    continue;
                }
                *r -= 1;
                left -= 1;
                s.next_id += 1;
                let id = format!("i-fake{:012}", s.next_id);
                s.running.insert(id.clone(), k.clone());
                let tags = (Some(req.lane.clone()), req.project.clone(), req.job.clone(), 0.0);
                s.tags.insert(id.clone(), tags);
                out.launched.push(Launched {
                    instance_id: id,
                    offering: k.clone(),
                });
            }
        }
        if left > 0 {
            for (k, _) in room.into_iter().filter(|(_, r)| *r == 0) {
                if !over_quota.iter().any(|(q, _)| *q == k) {
                    let e = no_capacity(&k);
                    out.short.push((k, e));
                }
            }
        }
        // Each override's own error, as the EC2 adapter reports an instant fleet's `errors`.
        out.short.extend(over_quota);
        if !req.client_token.is_empty() {
            s.by_token.insert(req.client_token.clone(), (req.clone(), out.clone()));
        }
        Ok(out)
    }

    async fn terminate(&self, instance_ids: &[String]) -> Result<(), FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.calls.push(FleetCall::Terminate(instance_ids.to_vec()));
        if let Some(e) = s.one_shot.pop_front() {
            return Err(e);
        }
        s.end(instance_ids);
        Ok(())
    }

    async fn cancel_launch(&self, instance_ids: &[String]) -> Result<(), FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.calls.push(FleetCall::Cancel(instance_ids.to_vec()));
        if let Some(e) = s.one_shot.pop_front() {
            return Err(e);
        }
        // As the EC2 adapter: a cancelled launch's instances are terminated, stopped ones too.
        s.end(instance_ids);
        Ok(())
    }

    async fn stop(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.calls.push(FleetCall::Stop(instance_ids.to_vec()));
        if let Some(e) = s.one_shot.pop_front() {
            return Err(e);
        }
        let mut refused = Vec::new();
        for id in instance_ids {
            if s.terminated.contains(id) {
                // As EC2 (and the EC2 adapter): refused for its state, not as unknown.
                refused.push((
                    id.clone(),
                    FleetError {
                        kind: FleetErrorKind::Other,
                        message: format!(
                            "IncorrectInstanceState: This instance '{id}' is not in a state from which it can be \
                             stopped."
                        ),
                    },
                ));
            } else if s.unstoppable.contains(id) {
                refused.push((
                    id.clone(),
                    FleetError {
                        kind: FleetErrorKind::Other,
                        message: format!(
                            "UnsupportedOperation: You can't stop the Spot Instance '{id}' because it is associated \
                             with a one-time Spot Instance request."
                        ),
                    },
                ));
            } else if let Some(k) = s.running.remove(id) {
                s.stopped.insert(id.clone(), k);
                if s.stops_take_time {
                    s.still_stopping.insert(id.clone());
                }
            } else if !s.stopped.contains_key(id) {
                refused.push((
                    id.clone(),
                    FleetError {
                        kind: FleetErrorKind::NotFound,
                        message: format!("InvalidInstanceID.NotFound: {id}"),
                    },
                ));
            }
        }
        Ok(refused)
    }

    async fn start(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.calls.push(FleetCall::Start(instance_ids.to_vec()));
        if let Some(e) = s.one_shot.pop_front() {
            return Err(e);
        }
        let mut refused = Vec::new();
        for id in instance_ids {
            let Some(k) = s.stopped.get(id).cloned() else {
                if !s.running.contains_key(id) {
                    refused.push((
                        id.clone(),
                        FleetError {
                            kind: FleetErrorKind::NotFound,
                            message: format!("InvalidInstanceID.NotFound: {id}"),
                        },
                    ));
                }
                continue;
            };
            if s.still_stopping.contains(id) {
                refused.push((
                    id.clone(),
                    FleetError {
                        kind: FleetErrorKind::Stopping,
                        message: format!(
                            "IncorrectInstanceState: The instance '{id}' is not in a state from which it can be \
                             started. (the instance is stopping)"
                        ),
                    },
                ));
                continue;
            }
            if s.no_capacity.contains(&k) {
                refused.push((
                    id.clone(),
                    FleetError {
                        kind: FleetErrorKind::InsufficientCapacity,
                        message: format!("InsufficientInstanceCapacity: no capacity to start {id} ({k})"),
                    },
                ));
                continue;
            }
            // EC2 counts a start against the vCPU quota as it counts a launch.
            if let Some(e) = s.over_quota(&k) {
                refused.push((id.clone(), e));
                continue;
            }
            s.stopped.remove(id);
            s.running.insert(id.clone(), k);
        }
        Ok(refused)
    }
}

impl<F: crate::ports::FleetLister> crate::ports::FleetLister for FaultyFleet<F> {
    async fn list_managed(&self) -> Result<Vec<crate::ports::FleetInstance>, FleetError> {
        self.inner.list_managed().await
    }
    async fn list_spot_requests(&self) -> Result<Vec<crate::ports::SpotRequest>, FleetError> {
        self.inner.list_spot_requests().await
    }
    async fn cancel_spot_requests(&self, ids: &[String]) -> Result<(), FleetError> {
        self.inner.cancel_spot_requests(ids).await
    }
}

impl crate::ports::FleetLister for FakeFleet {
    async fn list_managed(&self) -> Result<Vec<crate::ports::FleetInstance>, FleetError> {
        let s = self.inner.lock().expect("lock");
        // Stopped instances too, as EC2 lists them (stopping or stopped).
        Ok(s.running
            .iter()
            .chain(&s.stopped)
            .map(|(id, offering)| {
                let (lane, project, job, launched_at) = s.tags.get(id).cloned().unwrap_or((None, None, None, 0.0));
                crate::ports::FleetInstance {
                    instance_id: id.clone(),
                    offering: offering.clone(),
                    launched_at,
                    lane,
                    project,
                    job,
                    stopped: s.stopped.contains_key(id),
                }
            })
            .collect())
    }

    async fn list_spot_requests(&self) -> Result<Vec<crate::ports::SpotRequest>, FleetError> {
        let s = self.inner.lock().expect("lock");
        Ok(s.spot_requests
            .iter()
            .filter(|(_, r)| !r.1)
            .map(|(id, (r, _))| crate::ports::SpotRequest {
                id: id.clone(),
                ..r.clone()
            })
            .collect())
    }

    async fn cancel_spot_requests(&self, ids: &[String]) -> Result<(), FleetError> {
        let mut s = self.inner.lock().expect("lock");
        s.calls.push(FleetCall::CancelRequests(ids.to_vec()));
        if let Some(e) = s.one_shot.pop_front() {
            return Err(e);
        }
        // Unknown or cancelled already: done, as the EC2 adapter takes not-found.
        for id in ids {
            if let Some(r) = s.spot_requests.get_mut(id) {
                r.1 = true;
            }
        }
        Ok(())
    }
}

impl FakeFleet {
    /// A persistent spot request `id` of this deployment, made at `created_at` (unix seconds),
    /// with its instance now (`None`: open, as after its instance terminated).
    pub fn add_spot_request(&self, id: &str, instance_id: Option<&str>, created_at: f64) {
        let r = crate::ports::SpotRequest {
            id: id.to_string(),
            instance_id: instance_id.map(str::to_string),
            created_at,
        };
        self.inner
            .lock()
            .expect("lock")
            .spot_requests
            .insert(id.to_string(), (r, false));
    }

    /// The spot requests cancelled so far.
    pub fn cancelled_spot_requests(&self) -> Vec<String> {
        let s = self.inner.lock().expect("lock");
        s.spot_requests
            .iter()
            .filter(|(_, r)| r.1)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Stop instance `id` as EC2 does on its own (a spot interruption that stops, a start that
    /// found no capacity): not through [`Fleet::stop`], no call recorded.
    pub fn stop_behind_the_back(&self, id: &str) {
        let mut s = self.inner.lock().expect("lock");
        if let Some(k) = s.running.remove(id) {
            s.stopped.insert(id.to_string(), k);
        }
    }

    /// An instance that exists in the fleet without onoff having launched it through this fake
    /// (an orphan, for reaper tests).
    pub fn add_instance(&self, id: &str, offering: OfferingKey) {
        self.inner
            .lock()
            .expect("lock")
            .running
            .insert(id.to_string(), offering);
    }

    /// An instance launched as `req` asked (its lane, project and pinned job) at `launched_at`
    /// (unix seconds) in `offering`, that no worker row knows: a launch whose registration failed.
    pub fn add_launched_instance(&self, id: &str, offering: OfferingKey, req: &LaunchRequest, launched_at: f64) {
        let mut s = self.inner.lock().expect("lock");
        s.running.insert(id.to_string(), offering);
        let tags = (
            Some(req.lane.clone()),
            req.project.clone(),
            req.job.clone(),
            launched_at,
        );
        s.tags.insert(id.to_string(), tags);
    }
}

/// A workers table in memory, with the same conditional semantics as the DynamoDB adapter.
#[derive(Debug, Default)]
pub struct FakeRegistry {
    workers: Mutex<BTreeMap<String, WorkerRecord>>,
    fail_next: Mutex<VecDeque<StoreError>>,
    /// `get` calls so far (DynamoDB's GetItem).
    gets: std::sync::atomic::AtomicUsize,
}

impl FakeRegistry {
    /// How many times one worker's row was read (`get`, a GetItem) so far.
    pub fn gets(&self) -> usize {
        self.gets.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Snapshot of the records.
    pub fn records(&self) -> BTreeMap<String, WorkerRecord> {
        self.workers.lock().expect("lock").clone()
    }

    /// The next write (`set_state`, `set_state_if`, `mark_busy`) fails with `err` (one-shot;
    /// queue several for several writes).
    pub fn fail_next(&self, err: StoreError) {
        self.fail_next.lock().expect("lock").push_back(err);
    }

    fn injected(&self) -> Result<(), StoreError> {
        match self.fail_next.lock().expect("lock").pop_front() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// One conditional write, as DynamoDB's: `write` applied to row `id` when `condition` holds
    /// (`Ok(true)`), `Ok(false)` when it does not, [`StoreError::NotFound`] for a missing row.
    fn write_if(
        &self,
        id: &str,
        condition: impl FnOnce(&WorkerRecord) -> bool,
        write: impl FnOnce(&mut WorkerRecord),
    ) -> Result<bool, StoreError> {
        self.injected()?;
        let mut m = self.workers.lock().expect("lock");
        let w = m.get_mut(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if !condition(w) {
            return Ok(false);
        }
        write(w);
        Ok(true)
    }

    /// What an agent writes when it takes a job: state Running, heartbeat `now`, no idle-since;
    /// refused (`Ok(false)`) while the worker is Draining, Terminating or Stopped, so a worker the
    /// control plane is retiring takes no new work. As `DynamoWorkers::mark_busy`.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown worker; an injected failure.
    pub fn mark_busy(&self, id: &str, now: f64) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| {
                !matches!(
                    w.state,
                    WorkerState::Draining | WorkerState::Terminating | WorkerState::Stopped
                )
            },
            |w| {
                w.state = WorkerState::Running;
                w.heartbeat_at = Some(now);
                w.idle_since = None;
            },
        )
    }

    /// What the agent writes when its project cache changes, as `DynamoWorkers::set_cached_projects`:
    /// the first [`crate::ports::MAX_CACHED_PROJECTS`] of `projects` (most recently used first),
    /// whatever the row's state.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown worker; an injected failure.
    pub fn set_cached_projects(&self, id: &str, projects: &[String]) -> Result<(), StoreError> {
        let kept = &projects[..projects.len().min(crate::ports::MAX_CACHED_PROJECTS)];
        self.write_if(id, |_| true, |w| w.cached_projects = kept.to_vec())
            .map(|_| ())
    }
}

impl WorkerRegistry for FakeRegistry {
    async fn register_launch(&self, mut record: WorkerRecord) -> Result<(), StoreError> {
        self.injected()?;
        // As the table's adapter: the first MAX_CACHED_PROJECTS only.
        record.cached_projects.truncate(crate::ports::MAX_CACHED_PROJECTS);
        self.workers
            .lock()
            .expect("lock")
            .entry(record.id.clone())
            .or_insert(record);
        Ok(())
    }

    async fn set_state(&self, id: &str, state: WorkerState) -> Result<(), StoreError> {
        self.injected()?;
        match self.workers.lock().expect("lock").get_mut(id) {
            Some(w) => {
                w.state = state;
                Ok(())
            }
            None => Err(StoreError::NotFound(id.to_string())),
        }
    }

    async fn set_state_if(&self, id: &str, to: WorkerState, from: &[WorkerState]) -> Result<bool, StoreError> {
        if from.is_empty() {
            return self.write_if(id, |_| false, |_| {});
        }
        self.write_if(id, |w| from.contains(&w.state) || w.state == to, |w| w.state = to)
    }

    async fn set_price_if_unpriced(&self, id: &str, price_usd_per_h: f64) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| w.price_usd_per_h == 0.0 || w.price_usd_per_h == price_usd_per_h,
            |w| w.price_usd_per_h = price_usd_per_h,
        )
    }

    async fn set_run_time_estimate_if_unset(&self, id: &str, run_time_estimate_s: f64) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| w.run_time_estimate_s.is_none_or(|e| e == run_time_estimate_s),
            |w| w.run_time_estimate_s = Some(run_time_estimate_s),
        )
    }

    async fn hold_idle(&self, id: &str, until: f64) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| w.state == WorkerState::Idle && w.hold_until.is_none_or(|h| h <= until),
            |w| w.hold_until = Some(until),
        )
    }

    async fn mark_stopped(&self, id: &str, at: f64, until: f64, _launched_at: f64) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| matches!(w.state, WorkerState::Idle | WorkerState::Stopped),
            |w| {
                if w.state != WorkerState::Stopped {
                    w.state = WorkerState::Stopped;
                    w.idle_since = Some(at);
                    w.hold_until = Some(until);
                }
            },
        )
    }

    async fn mark_started(
        &self,
        id: &str,
        at: f64,
        project: Option<&str>,
        job: Option<&str>,
        run_time_estimate_s: Option<f64>,
    ) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| w.state == WorkerState::Stopped || (w.state == WorkerState::Pending && w.launched_at == at),
            |w| {
                w.state = WorkerState::Pending;
                w.launched_at = at;
                w.project = project.map(str::to_string);
                w.pinned_job = job.map(str::to_string);
                w.run_time_estimate_s = run_time_estimate_s;
                w.idle_since = None;
                w.hold_until = None;
                w.heartbeat_at = None;
            },
        )
    }

    async fn mark_start_refused(
        &self,
        id: &str,
        at: f64,
        launched_at: f64,
        stopped_at: Option<f64>,
        stopped_until: Option<f64>,
    ) -> Result<bool, StoreError> {
        self.write_if(
            id,
            |w| {
                (w.state == WorkerState::Pending && w.launched_at == at)
                    || (w.state == WorkerState::Stopped && w.idle_since == stopped_at && w.launched_at == launched_at)
            },
            |w| {
                w.state = WorkerState::Stopped;
                w.launched_at = launched_at;
                w.idle_since = stopped_at;
                w.hold_until = stopped_until;
            },
        )
    }

    async fn get(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.workers.lock().expect("lock").get(id).cloned())
    }

    async fn list_live(&self) -> Result<crate::ports::Listing<WorkerRecord>, StoreError> {
        Ok(crate::ports::Listing {
            items: self
                .workers
                .lock()
                .expect("lock")
                .values()
                .filter(|w| w.state != WorkerState::Terminating)
                .cloned()
                .collect(),
            unreadable: Vec::new(),
        })
    }
}

impl FakeRegistry {
    /// What an agent's heartbeat writes, as `DynamoWorkers::heartbeat` writes it: `state`,
    /// `idle_since` (removed when `None`) and `heartbeat_at` = `now` (unix seconds). A row the
    /// control plane is retiring (Draining, Terminating or Stopped; for an agent reporting
    /// Draining itself, Terminating or Stopped) keeps its state and idle time: only
    /// `heartbeat_at` is written, and the answer is [`StoreError::Conflict`].
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown worker; [`StoreError::Conflict`] as above; an
    /// injected failure.
    pub fn agent_heartbeat(
        &self,
        id: &str,
        state: WorkerState,
        idle_since: Option<f64>,
        now: f64,
    ) -> Result<(), StoreError> {
        self.injected()?;
        let mut m = self.workers.lock().expect("lock");
        let w = m.get_mut(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        let retiring = if state == WorkerState::Draining {
            matches!(w.state, WorkerState::Terminating | WorkerState::Stopped)
        } else {
            matches!(
                w.state,
                WorkerState::Draining | WorkerState::Terminating | WorkerState::Stopped
            )
        };
        w.heartbeat_at = Some(now);
        if retiring {
            return Err(StoreError::Conflict(format!(
                "{id} is being retired by the control plane (Draining, Terminating or Stopped)"
            )));
        }
        w.state = state;
        w.idle_since = idle_since;
        Ok(())
    }
}

/// Handled event ids in memory.
#[derive(Debug, Default)]
pub struct FakeEventLog {
    seen: Mutex<std::collections::BTreeSet<String>>,
}

impl crate::ports::EventLog for FakeEventLog {
    async fn seen(&self, event_id: &str) -> Result<bool, StoreError> {
        Ok(self.seen.lock().expect("lock").contains(event_id))
    }

    async fn first_time(&self, event_id: &str, _now: f64) -> Result<bool, StoreError> {
        Ok(self.seen.lock().expect("lock").insert(event_id.to_string()))
    }
}

/// Unavailable offerings in memory, and the lanes' kept arrival statistics.
#[derive(Debug, Default)]
pub struct FakeAvailability {
    until: Mutex<BTreeMap<OfferingKey, f64>>,
    arrival_stats: Mutex<BTreeMap<String, crate::ports::ArrivalStats>>,
}

impl crate::ports::ArrivalStatsStore for FakeAvailability {
    async fn load_arrival_stats(&self, lane: &str) -> Result<Option<crate::ports::ArrivalStats>, StoreError> {
        // Through JSON, as the DynamoDB adapter keeps them: what does not survive that fails here too.
        let kept = self.arrival_stats.lock().expect("lock").get(lane).cloned();
        kept.map(|k| {
            let text = serde_json::to_string(&k).map_err(|e| StoreError::Other(format!("encode: {e}")))?;
            serde_json::from_str(&text).map_err(|e| StoreError::Malformed(format!("arrival stats of {lane}: {e}")))
        })
        .transpose()
    }

    async fn save_arrival_stats(
        &self,
        lane: &str,
        stats: &crate::ports::ArrivalStats,
        previous: Option<f64>,
    ) -> Result<bool, StoreError> {
        let mut m = self.arrival_stats.lock().expect("lock");
        if m.get(lane).map(|k| k.folded_to) != previous {
            return Ok(false);
        }
        m.insert(lane.to_string(), stats.clone());
        Ok(true)
    }
}

impl FakeAvailability {
    /// Offerings marked, with their expiry.
    pub fn marked(&self) -> BTreeMap<OfferingKey, f64> {
        self.until.lock().expect("lock").clone()
    }
}

impl OfferingAvailability for FakeAvailability {
    async fn mark_unavailable(&self, key: &OfferingKey, until: f64) -> Result<(), StoreError> {
        let mut m = self.until.lock().expect("lock");
        let e = m.entry(key.clone()).or_insert(until);
        *e = e.max(until);
        Ok(())
    }

    async fn list_unavailable(&self, now: f64) -> Result<Vec<onoff_policy::UnavailableOffering>, StoreError> {
        Ok(self
            .until
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, u)| **u > now)
            .map(|(k, u)| onoff_policy::UnavailableOffering {
                key: k.clone(),
                until: *u,
            })
            .collect())
    }
}

/// A fault-injecting decorator around a real [`Fleet`] adapter: offerings declared without
/// capacity fail with InsufficientCapacity (as EC2 does and local emulators never do), offerings
/// declared failing fail with their error, queued one-shot errors fail the next calls; everything
/// else goes to the wrapped adapter.
#[derive(Debug)]
pub struct FaultyFleet<F> {
    inner: F,
    failing: Mutex<BTreeMap<OfferingKey, FleetError>>,
    one_shot: Mutex<VecDeque<FleetError>>,
}

impl<F> FaultyFleet<F> {
    /// Wrap `inner`.
    pub fn new(inner: F) -> Self {
        Self {
            inner,
            failing: Mutex::new(BTreeMap::new()),
            one_shot: Mutex::new(VecDeque::new()),
        }
    }

    /// Launches of `key` fail with InsufficientInstanceCapacity.
    pub fn set_no_capacity(&self, key: OfferingKey) {
        let err = FleetError {
            kind: FleetErrorKind::InsufficientCapacity,
            message: format!("InsufficientInstanceCapacity (injected) for {key}"),
        };
        self.set_launch_error(key, err);
    }

    /// Launches of `key` fail for that offering with `err` (any kind).
    pub fn set_launch_error(&self, key: OfferingKey, err: FleetError) {
        self.failing.lock().expect("lock").insert(key, err);
    }

    /// The next call fails with `err`.
    pub fn fail_next(&self, err: FleetError) {
        self.one_shot.lock().expect("lock").push_back(err);
    }

    /// The wrapped adapter.
    pub fn inner(&self) -> &F {
        &self.inner
    }

    fn injected(&self) -> Option<FleetError> {
        self.one_shot.lock().expect("lock").pop_front()
    }
}

impl<F: Fleet> Fleet for FaultyFleet<F> {
    async fn launch(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        if let Some(e) = self.injected() {
            return Err(e);
        }
        if let Some(e) = crate::ports::invalid_fleet_request(req) {
            return Err(e);
        }
        let failing = self.failing.lock().expect("lock").clone();
        let (short, ok): (Vec<OfferingKey>, Vec<OfferingKey>) =
            req.offerings.iter().cloned().partition(|k| failing.contains_key(k));
        let mut short: Vec<(OfferingKey, FleetError)> =
            short.into_iter().map(|k| (k.clone(), failing[&k].clone())).collect();
        if ok.is_empty() {
            return Err(short.swap_remove(0).1);
        }
        let mut res = self
            .inner
            .launch(&LaunchRequest {
                offerings: ok,
                ..req.clone()
            })
            .await?;
        res.short.extend(short);
        Ok(res)
    }

    async fn terminate(&self, instance_ids: &[String]) -> Result<(), FleetError> {
        match self.injected() {
            Some(e) => Err(e),
            None => self.inner.terminate(instance_ids).await,
        }
    }

    async fn cancel_launch(&self, instance_ids: &[String]) -> Result<(), FleetError> {
        match self.injected() {
            Some(e) => Err(e),
            None => self.inner.cancel_launch(instance_ids).await,
        }
    }

    async fn stop(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        match self.injected() {
            Some(e) => Err(e),
            None => self.inner.stop(instance_ids).await,
        }
    }

    async fn start(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        match self.injected() {
            Some(e) => Err(e),
            None => self.inner.start(instance_ids).await,
        }
    }
}

/// DynamoDB's item size limit, bytes (400 KB, "Service, account, and table quotas in Amazon
/// DynamoDB").
pub const DYNAMODB_MAX_ITEM_BYTES: usize = 400 * 1024;

/// Size of a job row as DynamoDB counts it (attribute names plus values, numbers taken as 21
/// bytes at most), as the DynamoDB adapter writes it.
pub fn job_item_bytes(r: &crate::ports::JobRecord) -> usize {
    let spec = serde_json::to_string(&r.spec).map_or(0, |s| s.len());
    let texts = [
        ("job_id", r.id.len()),
        ("spec", spec),
        ("state", r.state.as_str().len()),
        ("source", r.source.len()),
        ("lane", r.spec.lane.len()),
        ("project", r.spec.project.len()),
        ("active_lane", r.spec.lane.len()),
        ("run_lane", r.run_s.map_or(0, |_| r.spec.lane.len())),
        ("reason", r.reason.as_ref().map_or(0, String::len)),
        ("lease_owner", r.lease_owner.as_ref().map_or(0, String::len)),
        ("last_checkpoint", r.last_checkpoint.as_ref().map_or(0, String::len)),
    ];
    let numbers = ["attempts", "hand_backs", "lease_expiries", "cost_usd", "created_at"];
    let log: usize = r
        .attempt_log
        .iter()
        .map(|a| serde_json::to_string(a).map_or(0, |s| s.len() + 3))
        .sum();
    texts.iter().map(|(k, v)| k.len() + v).sum::<usize>()
        + numbers.iter().map(|k| k.len() + 21).sum::<usize>()
        + if r.attempt_log.is_empty() {
            0
        } else {
            "attempt_log".len() + log
        }
        // A map of three numbers (`attempt`, `files`, `at`) and maybe an `error` text.
        + r.outputs.as_ref().map_or(0, |o| {
            "outputs".len() + 3 + 3 * 21 + "attemptfilesat".len() + o.error.as_ref().map_or(0, |e| "error".len() + e.len())
        })
}

/// A jobs table in memory, with the same conditional semantics as the DynamoDB adapter and
/// DynamoDB's 400 KB item limit.
#[derive(Debug, Default)]
pub struct FakeJobs {
    jobs: Mutex<BTreeMap<String, crate::ports::JobRecord>>,
    errors: Mutex<BTreeMap<String, String>>,
    unreadable: Mutex<BTreeMap<String, String>>,
    fail_next: Mutex<Option<StoreError>>,
    /// With a lagging index: the rows [`crate::ports::JobStore::active`] listed last time, which
    /// it lists next time.
    index: Mutex<Option<Vec<crate::ports::JobRecord>>>,
    /// The next [`crate::ports::JobStore::get_many`] fails with this.
    fail_get_many: Mutex<Option<StoreError>>,
    /// The next [`crate::ports::JobStore::arrivals`] fails with this.
    fail_arrivals: Mutex<Option<StoreError>>,
    /// The next [`crate::ports::JobStore::finished_run_times`] fails with this.
    fail_run_times: Mutex<Option<StoreError>>,
    /// Writes whose answers are lost: see [`FakeJobs::lose_next_answer`].
    answers: LostAnswers,
}

/// Writes whose answers are lost on the way back, so the AWS SDK sends them again with the same
/// arguments (a timeout, a dropped connection; the SDK's default is 3 attempts): the retry meets
/// the state its first try wrote. Shared by the fakes whose adapters take such a retry of their
/// own write as done ([`FakeJobs`], [`FakeLease`]).
#[derive(Debug, Default)]
struct LostAnswers {
    /// The next write's answer is lost.
    next: Mutex<bool>,
    /// Every nth write's answer is lost, and the writes so far.
    every: Mutex<Option<(u32, u32)>>,
    /// Answers lost so far.
    lost: Mutex<u32>,
}

impl LostAnswers {
    /// One write as the SDK sends it: `once` applied, and applied again when its answer was lost;
    /// the last answer returned.
    fn sent<T>(&self, mut once: impl FnMut() -> T) -> T {
        let counted = self.every.lock().expect("lock").as_mut().is_some_and(|(every, n)| {
            *n += 1;
            *n % *every == 0
        });
        if std::mem::take(&mut *self.next.lock().expect("lock")) || counted {
            *self.lost.lock().expect("lock") += 1;
            let _ = once();
        }
        once()
    }
}

impl FakeJobs {
    /// Make [`crate::ports::JobStore::active`] lag as the `active` index may (a global secondary
    /// index is eventually consistent, DynamoDB Developer Guide, "Read consistency"): from now on
    /// each listing shows the rows as they were at the listing before, the first one as they are
    /// now, so the writes made in between are not seen until the next listing.
    pub fn lag_index(&self) {
        *self.index.lock().expect("lock") = Some(self.listed());
    }

    fn listed(&self) -> Vec<crate::ports::JobRecord> {
        let unreadable = self.unreadable.lock().expect("lock");
        self.jobs
            .lock()
            .expect("lock")
            .values()
            .filter(|r| !r.state.is_final() && !unreadable.contains_key(&r.id))
            .cloned()
            .collect()
    }

    /// Records.
    pub fn records(&self) -> BTreeMap<String, crate::ports::JobRecord> {
        self.jobs.lock().expect("lock").clone()
    }

    /// Error records: source -> reason.
    pub fn errors(&self) -> BTreeMap<String, String> {
        self.errors.lock().expect("lock").clone()
    }

    /// The next call fails with `err`.
    pub fn fail_next(&self, err: StoreError) {
        *self.fail_next.lock().expect("lock") = Some(err);
    }

    /// The next batch read ([`crate::ports::JobStore::get_many`]) fails with `err` (DynamoDB's
    /// `BatchGetItem` failing, or keys left unprocessed through every retry), other calls not.
    pub fn fail_next_get_many(&self, err: StoreError) {
        *self.fail_get_many.lock().expect("lock") = Some(err);
    }

    /// The next listing of arrivals ([`crate::ports::JobStore::arrivals`]) fails with `err`
    /// (DynamoDB's answer while the arrivals index is still being built after a stack update),
    /// other calls not.
    pub fn fail_next_arrivals(&self, err: StoreError) {
        *self.fail_arrivals.lock().expect("lock") = Some(err);
    }

    /// The next listing of run times ([`crate::ports::JobStore::finished_run_times`]) fails with
    /// `err` (DynamoDB's answer while the run_times index is still being built), other calls not.
    pub fn fail_next_run_times(&self, err: StoreError) {
        *self.fail_run_times.lock().expect("lock") = Some(err);
    }

    /// Put an active row that does not parse (a hand-edited item): listed as unreadable,
    /// [`StoreError::Malformed`] to `get` and `claim` (a claim of such a row that is also in the
    /// fake as pending is written first, as DynamoDB writes it).
    pub fn put_unreadable(&self, id: &str, problem: &str) {
        self.unreadable.lock().expect("lock").insert(id.into(), problem.into());
    }

    fn injected(&self) -> Result<(), StoreError> {
        match self.fail_next.lock().expect("lock").take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The next write to the table is applied and its answer lost on the way back, so it is sent
    /// again with the same arguments, as the AWS SDK retries a request whose answer did not
    /// arrive (a timeout, a dropped connection; the SDK's default is 3 attempts): the retry meets
    /// the row its first try wrote, and its answer is the one returned. The DynamoDB adapter
    /// takes such a retry of its own write as done; so does this fake, and a caller that mistook
    /// it for a refusal fails a test here as it would fail on AWS.
    pub fn lose_next_answer(&self) {
        *self.answers.next.lock().expect("lock") = true;
    }

    /// From now on the answer of every `n`th write (`n` at least 2) is lost, as
    /// [`FakeJobs::lose_next_answer`] loses one (`onoff local --lose-answers N` does the same
    /// to DynamoDB's answers).
    pub fn lose_every(&self, n: u32) {
        *self.answers.every.lock().expect("lock") = Some((n.max(2), 0));
    }

    /// One write as the SDK sends it ([`LostAnswers::sent`]).
    fn sent<T>(&self, once: impl FnMut() -> T) -> T {
        self.answers.sent(once)
    }

    /// Answers lost so far ([`FakeJobs::lose_next_answer`], [`FakeJobs::lose_every`]).
    pub fn answers_lost(&self) -> u32 {
        *self.answers.lost.lock().expect("lock")
    }

    /// DynamoDB's answer to a write that would leave `r` over the item limit.
    fn fits(r: &crate::ports::JobRecord) -> Result<(), StoreError> {
        let size = job_item_bytes(r);
        if size > DYNAMODB_MAX_ITEM_BYTES {
            return Err(StoreError::Invalid(format!(
                "ValidationException: Item size has exceeded the maximum allowed size ({size} bytes > {DYNAMODB_MAX_ITEM_BYTES})"
            )));
        }
        Ok(())
    }

    /// Apply `settle` to `r` as one write: nothing changes when the row would outgrow the
    /// item limit.
    fn apply_checked(r: &mut crate::ports::JobRecord, settle: &crate::job::Settle, now: f64) -> Result<(), StoreError> {
        let mut after = r.clone();
        Self::apply(&mut after, settle, now);
        Self::fits(&after)?;
        *r = after;
        Ok(())
    }

    fn malformed(&self, id: &str) -> Result<(), StoreError> {
        match self.unreadable.lock().expect("lock").get(id) {
            Some(p) => Err(StoreError::Malformed(format!("job item {id}: {p}"))),
            None => Ok(()),
        }
    }

    /// Apply `settle` to `r` (the lease is ended); a cancel asked for wins over any end but
    /// success.
    fn apply(r: &mut crate::ports::JobRecord, settle: &crate::job::Settle, now: f64) {
        let mut settle = settle.clone();
        if r.cancel_requested && settle.to != crate::job::JobState::Succeeded {
            settle.to = crate::job::JobState::Cancelled;
            settle.reason = Some(crate::job::CANCELLED_REASON.into());
        }
        if let Some(a) = &settle.attempt {
            // As the jobs table keeps it: JSON text, read back by the next get.
            let text = serde_json::to_string(a).expect("an attempt record serialises");
            r.attempt_log
                .push(serde_json::from_str(&text).expect("an attempt record parses"));
        }
        r.claimed_at = None;
        r.state = settle.to;
        r.attempts = settle.attempts;
        r.hand_backs = settle.hand_backs;
        r.lease_expiries = settle.lease_expiries;
        if settle.reason.is_some() {
            r.reason.clone_from(&settle.reason);
        }
        r.lease_owner = None;
        r.lease_expires_at = None;
        if settle.to.is_final() {
            r.finished_at = Some(now);
            r.run_s = settle.run_s();
        }
    }
}

/// A lease call on a row that is gone, as DynamoDB answers it: its condition on the lease fails
/// (there is no row to hold one), so [`StoreError::Conflict`], as the trait documents, not
/// [`StoreError::NotFound`].
fn gone_lease(id: &str) -> StoreError {
    StoreError::Conflict(format!("no lease of {id}: the row is gone"))
}

impl crate::ports::JobStore for FakeJobs {
    async fn create(&self, record: &crate::ports::JobRecord) -> Result<crate::ports::Created, StoreError> {
        self.injected()?;
        Self::fits(record)?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            match m.get(&record.id) {
                Some(r) => Ok(crate::ports::Created::Existing(Box::new(r.clone()))),
                None => {
                    m.insert(record.id.clone(), record.clone());
                    Ok(crate::ports::Created::New)
                }
            }
        })
    }

    async fn get(&self, id: &str) -> Result<Option<crate::ports::JobRecord>, StoreError> {
        self.injected()?;
        self.malformed(id)?;
        Ok(self.jobs.lock().expect("lock").get(id).cloned())
    }

    async fn get_many(&self, ids: &[String]) -> Result<crate::ports::Listing<crate::ports::JobRecord>, StoreError> {
        self.injected()?;
        if let Some(e) = self.fail_get_many.lock().expect("lock").take() {
            return Err(e);
        }
        let mut out = crate::ports::Listing::default();
        let mut seen = std::collections::BTreeSet::new();
        for id in ids.iter().filter(|id| seen.insert(id.as_str())) {
            if let Err(StoreError::Malformed(why)) = self.malformed(id) {
                out.unreadable.push((id.clone(), why));
            } else if let Some(r) = self.jobs.lock().expect("lock").get(id) {
                out.items.push(r.clone());
            }
        }
        Ok(out)
    }

    async fn mark_sent(&self, id: &str, at: f64) -> Result<(), StoreError> {
        self.injected()?;
        self.sent(|| match self.jobs.lock().expect("lock").get_mut(id) {
            Some(r) => {
                r.sent_at = Some(at);
                Ok(())
            }
            None => Err(StoreError::NotFound(id.into())),
        })
    }

    async fn transition(
        &self,
        id: &str,
        from: crate::job::JobState,
        to: crate::job::JobState,
    ) -> Result<(), StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| StoreError::NotFound(id.into()))?;
            if r.state == to && from.can_go(to) {
                // Already there: this call's own retry after a lost answer (or another's move
                // to the same state); as DynamoDB's adapter takes it.
                return Ok(());
            }
            if r.state != from || !from.can_go(to) {
                return Err(StoreError::Conflict(format!(
                    "{id} is {}, not {}",
                    r.state.as_str(),
                    from.as_str()
                )));
            }
            r.state = to;
            if to != crate::job::JobState::Running {
                r.lease_owner = None;
                r.lease_expires_at = None;
            }
            Ok(())
        })
    }

    async fn claim(
        &self,
        id: &str,
        owner: &str,
        lease_until: f64,
        now: f64,
    ) -> Result<crate::ports::Claim, StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let Some(r) = m.get_mut(id) else {
                self.malformed(id)?;
                return Ok(crate::ports::Claim::Unknown);
            };
            if !r.state.is_pending() {
                self.malformed(id)?;
                // As the DynamoDB adapter: refused by this very claim, written on a try whose
                // answer was lost (its own time is on the row), is this claim.
                if r.state == crate::job::JobState::Running
                    && r.lease_owner.as_deref() == Some(owner)
                    && r.claimed_at == Some(now)
                {
                    return Ok(crate::ports::Claim::Claimed(Box::new(r.clone())));
                }
                return Ok(crate::ports::Claim::NotClaimable(r.state));
            }
            r.state = crate::job::JobState::Running;
            r.lease_owner = Some(owner.into());
            r.lease_expires_at = Some(lease_until);
            r.claimed_at = Some(now);
            r.attempts += 1;
            // As on DynamoDB: the claim is one conditional write that returns the row, so a row
            // that does not parse is claimed (RUNNING under this lease) before the caller learns it.
            self.malformed(id)?;
            Ok(crate::ports::Claim::Claimed(Box::new(r.clone())))
        })
    }

    async fn record_error(&self, key: &str, reason: &str, _now: f64) -> Result<(), StoreError> {
        self.injected()?;
        // The item as the DynamoDB adapter writes it: `job_id` (`crate::job::error_record_id`),
        // `reason`, and two numbers (`created_at`, `expires_at`).
        let id = crate::job::error_record_id(key);
        // `job_id` is the jobs table's `active` index's sort key, held to 1,024 bytes.
        if id.len() > crate::job::MAX_INDEX_SORT_KEY_BYTES {
            return Err(StoreError::Invalid(format!(
                "ValidationException: the index sort key job_id is {} bytes; at most {}",
                id.len(),
                crate::job::MAX_INDEX_SORT_KEY_BYTES
            )));
        }
        let size = "job_id".len()
            + id.len()
            + "reason".len()
            + reason.len()
            + "created_at".len()
            + "expires_at".len()
            + 2 * 21;
        if size > DYNAMODB_MAX_ITEM_BYTES {
            return Err(StoreError::Invalid(format!(
                "ValidationException: Item size has exceeded the maximum allowed size ({size} bytes > {DYNAMODB_MAX_ITEM_BYTES})"
            )));
        }
        self.sent(|| {
            self.errors
                .lock()
                .expect("lock")
                .entry(key.into())
                .or_insert_with(|| reason.into());
        });
        Ok(())
    }

    async fn active(&self) -> Result<crate::ports::Listing<crate::ports::JobRecord>, StoreError> {
        self.injected()?;
        let now = self.listed();
        let items = match self.index.lock().expect("lock").as_mut() {
            Some(before) => std::mem::replace(before, now),
            None => now,
        };
        // An unreadable row is listed while it is in the index: unless a pending or running row
        // of its id ended (`fail_unreadable`), which left the index.
        let jobs = self.jobs.lock().expect("lock");
        let unreadable = self
            .unreadable
            .lock()
            .expect("lock")
            .iter()
            .filter(|(id, _)| jobs.get(*id).is_none_or(|r| !r.state.is_final()))
            .map(|(id, p)| (id.clone(), p.clone()))
            .collect();
        Ok(crate::ports::Listing { items, unreadable })
    }

    async fn arrivals(
        &self,
        lane: &str,
        after: f64,
    ) -> Result<crate::ports::Listing<crate::ports::ArrivalRecord>, StoreError> {
        self.injected()?;
        if let Some(e) = self.fail_arrivals.lock().expect("lock").take() {
            return Err(e);
        }
        // Every job, finished ones too (an unreadable row's lane is unknown here: not listed).
        let mut items: Vec<crate::ports::ArrivalRecord> = self
            .jobs
            .lock()
            .expect("lock")
            .values()
            .filter(|r| r.spec.lane == lane && r.created_at > after)
            .map(|r| crate::ports::ArrivalRecord {
                id: r.id.clone(),
                created_at: r.created_at,
                spec: r.spec.clone(),
            })
            .collect();
        // The index's sort key is the creation time alone: ties in any order (here by id).
        items.sort_by(|a, b| a.created_at.total_cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
        Ok(crate::ports::Listing {
            items,
            unreadable: Vec::new(),
        })
    }

    async fn finished_run_times(&self, lane: &str, limit: u32) -> Result<Vec<f64>, StoreError> {
        self.injected()?;
        if let Some(e) = self.fail_run_times.lock().expect("lock").take() {
            return Err(e);
        }
        let jobs = self.jobs.lock().expect("lock");
        // Every job of the lane that finished with a run time (the index is sparse on
        // `run_lane`, written with `run_s`), newest first (ties by id, descending), as the index
        // reads backwards; `limit` of them.
        let mut finished: Vec<&crate::ports::JobRecord> = jobs
            .values()
            .filter(|r| r.spec.lane == lane && r.finished_at.is_some() && r.run_s.is_some())
            .collect();
        finished.sort_by(|a, b| {
            b.finished_at
                .unwrap_or(0.0)
                .total_cmp(&a.finished_at.unwrap_or(0.0))
                .then_with(|| b.id.cmp(&a.id))
        });
        Ok(finished
            .into_iter()
            .take(limit as usize)
            .filter_map(|r| r.run_s)
            .collect())
    }

    async fn record_progress(
        &self,
        id: &str,
        owner: &str,
        checkpoint: Option<&str>,
        cost_usd: f64,
    ) -> Result<(), StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| gone_lease(id))?;
            if r.lease_owner.as_deref() != Some(owner) {
                return Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}")));
            }
            if let Some(c) = checkpoint {
                r.last_checkpoint = Some(c.into());
            }
            r.cost_usd = cost_usd;
            Ok(())
        })
    }

    async fn renew(&self, id: &str, owner: &str, lease_until: f64) -> Result<crate::ports::Renewal, StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| gone_lease(id))?;
            if r.state != crate::job::JobState::Running || r.lease_owner.as_deref() != Some(owner) {
                return Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}")));
            }
            r.lease_expires_at = Some(lease_until);
            Ok(crate::ports::Renewal {
                cancel_requested: r.cancel_requested,
            })
        })
    }

    async fn request_cancel(&self, id: &str, now: f64) -> Result<crate::ports::CancelOutcome, StoreError> {
        use crate::job::JobState;
        use crate::ports::CancelOutcome;
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let Some(r) = m.get_mut(id) else {
                return Ok(CancelOutcome::Unknown);
            };
            Ok(match r.state {
                JobState::Queued | JobState::Retrying => {
                    r.state = JobState::Cancelled;
                    r.reason = Some(crate::job::CANCELLED_REASON.into());
                    r.finished_at = Some(now);
                    CancelOutcome::Cancelled
                }
                JobState::Running => {
                    r.cancel_requested = true;
                    CancelOutcome::Requested
                }
                // As the DynamoDB adapter: this very cancel, written on a try whose answer was
                // lost (its own end time is on the row).
                JobState::Cancelled if r.finished_at == Some(now) => CancelOutcome::Cancelled,
                done => CancelOutcome::AlreadyFinished(done),
            })
        })
    }

    async fn finish(&self, id: &str, owner: &str, settle: &crate::job::Settle, now: f64) -> Result<(), StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| gone_lease(id))?;
            if r.state != crate::job::JobState::Running
                || r.lease_owner.as_deref() != Some(owner)
                || !r.state.can_go(settle.to)
            {
                // As the DynamoDB adapter: this very settle, written on a try whose answer was
                // lost, is done.
                if settle.written_on(r) {
                    return Ok(());
                }
                return Err(StoreError::Conflict(format!(
                    "{owner} does not hold the lease of {id} ({})",
                    r.state.as_str()
                )));
            }
            Self::apply_checked(r, settle, now)
        })
    }

    async fn record_outputs(&self, id: &str, outputs: &crate::job::OutputsRecord) -> Result<(), StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| StoreError::NotFound(id.into()))?;
            if let Some(had) = r.outputs.as_ref().filter(|o| o.attempt > outputs.attempt) {
                return Err(StoreError::Conflict(format!(
                    "{id} holds the outputs of attempt {}, later than {}",
                    had.attempt, outputs.attempt
                )));
            }
            let mut after = r.clone();
            let mut o = outputs.clone();
            o.error = o.error.map(crate::job::bounded_reason);
            after.outputs = Some(o);
            Self::fits(&after)?;
            *r = after;
            Ok(())
        })
    }

    async fn requeue_lost(
        &self,
        id: &str,
        owner: &str,
        lease_expires_at: f64,
        settle: &crate::job::Settle,
        now: f64,
    ) -> Result<(), StoreError> {
        self.injected()?;
        let ends_lease = matches!(
            settle.to,
            crate::job::JobState::Queued | crate::job::JobState::Failed | crate::job::JobState::Cancelled
        );
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| gone_lease(id))?;
            if r.state != crate::job::JobState::Running
                || r.lease_owner.as_deref() != Some(owner)
                || r.lease_expires_at != Some(lease_expires_at)
                || !ends_lease
            {
                // As the DynamoDB adapter: this very re-queue, written on a try whose answer was
                // lost, is done.
                if ends_lease && settle.written_on(r) {
                    return Ok(());
                }
                return Err(StoreError::Conflict(format!(
                    "the lease of {id} changed since it was seen"
                )));
            }
            Self::apply_checked(r, settle, now)
        })
    }

    async fn fail_unreadable(&self, id: &str, owner: &str, reason: &str, now: f64) -> Result<(), StoreError> {
        self.injected()?;
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let r = m.get_mut(id).ok_or_else(|| gone_lease(id))?;
            if r.state == crate::job::JobState::Failed {
                // The write's own retry.
                return Ok(());
            }
            if r.state != crate::job::JobState::Running || r.lease_owner.as_deref() != Some(owner) {
                return Err(StoreError::Conflict(format!("{owner} does not hold the lease of {id}")));
            }
            r.state = crate::job::JobState::Failed;
            r.reason = Some(crate::job::bounded_reason(reason.to_string()));
            r.finished_at = Some(now);
            r.lease_owner = None;
            r.lease_expires_at = None;
            r.claimed_at = None;
            // Out of the active index (no longer listed), and as unreadable as before.
            Ok(())
        })
    }

    async fn fail_waiting(&self, seen: &crate::ports::JobRecord, reason: &str, now: f64) -> Result<bool, StoreError> {
        use crate::job::JobState;
        self.injected()?;
        let reason = crate::job::bounded_reason(reason.to_string());
        self.sent(|| {
            let mut m = self.jobs.lock().expect("lock");
            let Some(r) = m.get_mut(&seen.id) else {
                return Ok(false);
            };
            let as_seen = r.state.is_pending()
                && r.attempts == seen.attempts
                && r.hand_backs == seen.hand_backs
                && r.lease_expiries == seen.lease_expiries
                && r.attempt_log.len() == seen.attempt_log.len()
                && r.sent_at == seen.sent_at;
            if !as_seen {
                // As the DynamoDB adapter: this very end, written on a try whose answer was lost.
                return Ok(r.state == JobState::Failed
                    && r.finished_at == Some(now)
                    && r.reason.as_deref() == Some(reason.as_str()));
            }
            r.state = JobState::Failed;
            r.reason = Some(reason.clone());
            r.finished_at = Some(now);
            r.lease_owner = None;
            r.lease_expires_at = None;
            Ok(true)
        })
    }
}

/// Lane queues in memory: every message sent (a log), and the messages each lane's queue holds
/// now, which its backlog counts as SQS's `GetQueueAttributes` does (sent with a delay: delayed;
/// else visible). Workers' receives and losses are the test's: [`FakeQueue::receive`],
/// [`FakeQueue::lose`].
#[derive(Debug, Default)]
pub struct FakeQueue {
    sent: Mutex<Vec<(String, String)>>,
    delays: Mutex<Vec<u32>>,
    held: Mutex<Vec<(String, String, u32)>>,
    fail_next: Mutex<Option<String>>,
    fail_backlog: Mutex<Option<String>>,
}

impl crate::ports::Backlog for FakeQueue {
    async fn backlog(&self, lane: &str) -> Result<onoff_policy::LaneBacklog, String> {
        if let Some(e) = self.fail_backlog.lock().expect("lock").take() {
            return Err(e);
        }
        let mut b = onoff_policy::LaneBacklog::default();
        for (_, _, delay) in self.held.lock().expect("lock").iter().filter(|(l, _, _)| l == lane) {
            if *delay > 0 {
                b.delayed += 1;
            } else {
                b.visible += 1;
            }
        }
        Ok(b)
    }
}

impl FakeQueue {
    /// (lane, body) of every message sent.
    pub fn sent(&self) -> Vec<(String, String)> {
        self.sent.lock().expect("lock").clone()
    }

    /// The delay of every message sent, seconds, in order.
    pub fn delays(&self) -> Vec<u32> {
        self.delays.lock().expect("lock").clone()
    }

    /// The next send fails with `reason`.
    pub fn fail_next(&self, reason: &str) {
        *self.fail_next.lock().expect("lock") = Some(reason.into());
    }

    /// The next backlog read fails with `reason`.
    pub fn fail_next_backlog(&self, reason: &str) {
        *self.fail_backlog.lock().expect("lock") = Some(reason.into());
    }

    /// A worker receives (and deletes) the oldest message `lane`'s queue holds: its body.
    pub fn receive(&self, lane: &str) -> Option<String> {
        let mut held = self.held.lock().expect("lock");
        let i = held.iter().position(|(l, _, _)| l == lane)?;
        Some(held.remove(i).1)
    }

    /// The messages `lane`'s queue holds are lost (retention, the dead-letter queue, a
    /// hand-deleted message): all of them, or those of `job_id`. How many.
    pub fn lose(&self, lane: &str, job_id: Option<&str>) -> usize {
        let mut held = self.held.lock().expect("lock");
        let before = held.len();
        let of = |b: &str| crate::ports::WakeUp::parse(b).map(|w| w.job_id);
        held.retain(|(l, b, _)| l != lane || job_id.is_some_and(|j| of(b).as_deref() != Some(j)));
        before - held.len()
    }
}

impl crate::ports::JobQueue for FakeQueue {
    async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<(), String> {
        if let Some(e) = self.fail_next.lock().expect("lock").take() {
            return Err(e);
        }
        self.sent.lock().expect("lock").push((lane.into(), body.into()));
        self.delays.lock().expect("lock").push(delay_s);
        self.held
            .lock()
            .expect("lock")
            .push((lane.into(), body.into(), delay_s));
        Ok(())
    }
}

impl FakeJobs {
    /// Put a record as is (test setup: a job already leased, say).
    pub fn put(&self, record: crate::ports::JobRecord) {
        self.jobs.lock().expect("lock").insert(record.id.clone(), record);
    }
}

/// Leases in memory; every successful acquisition is recorded.
#[derive(Debug, Default)]
pub struct FakeLease {
    held: Mutex<BTreeMap<String, (String, f64)>>,
    acquired: Mutex<Vec<(String, String, f64)>>,
    done: Mutex<BTreeMap<String, f64>>,
    /// Per name: the asks counted, the pending ask's time and the jobs asked for.
    asks: Mutex<BTreeMap<String, crate::ports::Asks>>,
    /// Asks to count (at time 0) right after the next [`Lease::asks`] read: a test's stand-in
    /// for submissions that come in while a run is under way.
    asks_during_next_run: Mutex<u64>,
    /// Per name: the token of the ask that made the pending one (the DynamoDB adapter's
    /// `pending_by`), and the last token handed out.
    pending_by: Mutex<(BTreeMap<String, u64>, u64)>,
    /// Writes whose answers are lost: see [`FakeLease::lose_next_answer`].
    answers: LostAnswers,
}

impl FakeLease {
    /// (name, owner, until) of every successful acquisition, in order.
    pub fn acquisitions(&self) -> Vec<(String, String, f64)> {
        self.acquired.lock().expect("lock").clone()
    }

    /// When the pending ask under `name` was made, if one is pending.
    pub fn pending_ask(&self, name: &str) -> Option<f64> {
        self.asks.lock().expect("lock").get(name).and_then(|a| a.pending_since)
    }

    /// Count `n` asks right after the next read of the count, as if they came in while that run
    /// was under way (they join the pending ask, or make one).
    pub fn ask_during_next_run(&self, n: u64) {
        *self.asks_during_next_run.lock().expect("lock") = n;
    }

    /// The next write is applied and its answer lost, so it is sent again with the same
    /// arguments, as the SDK retries it ([`FakeJobs::lose_next_answer`]): an ask's retry finds
    /// its own pending mark (its token, as the DynamoDB adapter's `pending_by`) and invokes, and
    /// is counted twice, as DynamoDB's `ADD` counts it.
    pub fn lose_next_answer(&self) {
        *self.answers.next.lock().expect("lock") = true;
    }

    /// One write as the SDK sends it ([`LostAnswers::sent`]).
    fn sent<T>(&self, once: impl FnMut() -> T) -> T {
        self.answers.sent(once)
    }
}

impl crate::ports::Lease for FakeLease {
    async fn acquire(&self, name: &str, owner: &str, ttl_s: f64, now: f64) -> Result<bool, StoreError> {
        Ok(self.sent(|| {
            let mut m = self.held.lock().expect("lock");
            let free = m.get(name).is_none_or(|(o, until)| *until < now || o == owner);
            if free {
                m.insert(name.into(), (owner.into(), now + ttl_s));
                self.acquired
                    .lock()
                    .expect("lock")
                    .push((name.into(), owner.into(), now + ttl_s));
            }
            free
        }))
    }

    async fn release(&self, name: &str, owner: &str) -> Result<(), StoreError> {
        self.sent(|| {
            let mut m = self.held.lock().expect("lock");
            if m.get(name).is_some_and(|(o, _)| o == owner) {
                m.remove(name);
            }
        });
        Ok(())
    }

    async fn mark_done(&self, name: &str, started_at: f64) -> Result<(), StoreError> {
        self.sent(|| {
            let mut m = self.done.lock().expect("lock");
            let t = m.entry(name.into()).or_insert(started_at);
            *t = t.max(started_at);
        });
        Ok(())
    }

    async fn last_done(&self, name: &str) -> Result<Option<f64>, StoreError> {
        Ok(self.done.lock().expect("lock").get(name).copied())
    }

    async fn ask(
        &self,
        name: &str,
        jobs: &[String],
        now: f64,
        stale_s: f64,
    ) -> Result<crate::ports::ScaleAsk, StoreError> {
        // This ask's token (a retry of it sends the same).
        let token = {
            let mut p = self.pending_by.lock().expect("lock");
            p.1 += 1;
            p.1
        };
        Ok(self.sent(|| {
            let mut m = self.asks.lock().expect("lock");
            let a = m.entry(name.into()).or_default();
            a.count += 1;
            // The adapter's rules: short ids only, so many per ask, none once the set is full.
            if a.jobs.len() < crate::ports::MAX_KEPT_ASKED_JOBS {
                let short = jobs
                    .iter()
                    .filter(|j| !j.is_empty() && j.len() <= crate::ports::MAX_ASKED_JOB_ID_BYTES);
                for j in short.take(crate::ports::MAX_ASKED_JOBS) {
                    if let Err(at) = a.jobs.binary_search(j) {
                        a.jobs.insert(at, j.clone());
                    }
                }
            }
            let mut by = self.pending_by.lock().expect("lock");
            let own = by.0.get(name) == Some(&token);
            match a.pending_since {
                Some(at) if at >= now - stale_s && !own => crate::ports::ScaleAsk::Joined,
                _ => {
                    a.pending_since = Some(now);
                    by.0.insert(name.into(), token);
                    crate::ports::ScaleAsk::Invoke
                }
            }
        }))
    }

    async fn asks(&self, name: &str) -> Result<crate::ports::Asks, StoreError> {
        let seen = self.asks.lock().expect("lock").get(name).cloned().unwrap_or_default();
        let during = std::mem::take(&mut *self.asks_during_next_run.lock().expect("lock"));
        for _ in 0..during {
            self.ask(name, &[], seen.pending_since.unwrap_or(0.0), f64::INFINITY)
                .await?;
        }
        Ok(seen)
    }

    async fn forget_asked_jobs(&self, name: &str, jobs: &[String]) -> Result<(), StoreError> {
        self.sent(|| {
            if let Some(a) = self.asks.lock().expect("lock").get_mut(name) {
                a.jobs.retain(|j| !jobs.contains(j));
            }
        });
        Ok(())
    }

    async fn settle_asks(&self, name: &str, seen: u64) -> Result<bool, StoreError> {
        Ok(self.sent(|| {
            let mut m = self.asks.lock().expect("lock");
            match m.get_mut(name) {
                Some(a) if a.count == seen => {
                    a.pending_since = None;
                    true
                }
                Some(_) => false,
                None => seen == 0,
            }
        }))
    }

    async fn drop_pending_ask(&self, name: &str) -> Result<(), StoreError> {
        self.sent(|| {
            if let Some(a) = self.asks.lock().expect("lock").get_mut(name) {
                a.pending_since = None;
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{JobSpec, OutputsRecord, MAX_REASON_BYTES};
    use crate::ports::{JobRecord, JobStore};

    /// The same rules as the DynamoDB adapter (moto test
    /// `the_outputs_record_is_written_once_the_attempt_ended_latest_attempt_wins`).
    #[test]
    fn the_outputs_record_of_a_later_attempt_is_never_replaced_by_an_earlier_one() {
        pollster::block_on(async {
            let jobs = FakeJobs::default();
            let spec: JobSpec = serde_json::from_str(r#"{"image":"img","command":["x"],"project":"p"}"#).unwrap();
            jobs.create(&JobRecord::new("job-o".into(), spec, "test".into(), 0.0))
                .await
                .unwrap();
            let rec = |attempt, error: Option<String>| OutputsRecord {
                attempt,
                files: 1,
                error,
                at: f64::from(attempt),
            };
            jobs.record_outputs("job-o", &rec(2, Some("e".repeat(5000))))
                .await
                .unwrap();
            let o = jobs.get("job-o").await.unwrap().unwrap().outputs.unwrap();
            assert!(o.error.unwrap().len() <= MAX_REASON_BYTES);
            assert!(matches!(
                jobs.record_outputs("job-o", &rec(1, None)).await,
                Err(StoreError::Conflict(_))
            ));
            assert_eq!(jobs.get("job-o").await.unwrap().unwrap().outputs.unwrap().attempt, 2);
            jobs.record_outputs("job-o", &rec(3, None)).await.unwrap();
            assert_eq!(jobs.get("job-o").await.unwrap().unwrap().outputs, Some(rec(3, None)));
            assert!(matches!(
                jobs.record_outputs("job-gone", &rec(1, None)).await,
                Err(StoreError::NotFound(_))
            ));
            assert_eq!(jobs.get("job-gone").await.unwrap(), None);
        });
    }
}
