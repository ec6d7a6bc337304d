//! The [`Fleet`] port on EC2: CreateFleet `instant` from the workers' launch template, tagged
//! instances, with the request's idempotency token as `ClientToken` (a retried call launches
//! once); stoppable spot workers by RunInstances from persistent spot requests
//! ([`Ec2Fleet::with_stoppable_spot`]); StopInstances and StartInstances; TerminateInstances (a
//! persistent spot request cancelled first); and a tag-filtered, paginated DescribeInstances.

use aws_sdk_ec2::types::{
    DefaultTargetCapacityType, FleetLaunchTemplateConfigRequest, FleetLaunchTemplateOverridesRequest,
    FleetLaunchTemplateSpecificationRequest, FleetType, InstanceType, ResourceType, SpotAllocationStrategy,
    SpotOptionsRequest, Tag, TagSpecification, TargetCapacitySpecificationRequest,
};
use onoff_control::catalog::SpotQuote;
use onoff_control::ports::{Fleet, FleetError, FleetErrorKind, LaunchRequest, LaunchResult, Launched, SpotPrices};
use onoff_policy::{CapacityType, OfferingKey};

use crate::errors::{classify_ec2_code, fleet_error};

/// Tag every onoff worker carries; its value names the deployment (stack), so two deployments in
/// one account never reap each other's workers.
pub const TAG_MANAGED: &str = "onoff:managed";
/// Tag with the worker's lane.
pub const TAG_LANE: &str = "onoff:lane";
/// Tag with the project the worker was launched for.
pub const TAG_PROJECT: &str = "onoff:project";
/// Tag with the job a launch was pinned to (a deadline at risk on spot,
/// `LaunchRequest::job`), so the reaper can adopt it pinned if its registration failed.
pub const TAG_JOB: &str = "onoff:job";

/// An onoff instance as EC2 describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagedInstance {
    /// Instance id.
    pub instance_id: String,
    /// Instance type.
    pub instance_type: String,
    /// Availability zone.
    pub zone: String,
    /// Spot or on-demand (from the instance lifecycle).
    pub capacity_type: CapacityType,
    /// EC2 state name (`pending`, `running`, ...).
    pub state: String,
    /// Value of the lane tag, if any.
    pub lane: Option<String>,
    /// Value of the project tag, if any.
    pub project: Option<String>,
    /// Value of the job tag (the job the launch was pinned to), if any.
    pub job: Option<String>,
    /// Launch time, unix seconds.
    pub launched_at: Option<f64>,
}

/// Tag EC2 puts on every instance launched from a launch template: the template's id. Nobody can
/// set a tag starting with `aws:`, so it tells which instances the worker template launched.
pub const TAG_LAUNCH_TEMPLATE: &str = "aws:ec2launchtemplate:id";

/// EC2 as the fleet.
#[derive(Debug, Clone)]
pub struct Ec2Fleet {
    client: aws_sdk_ec2::Client,
    launch_template: String,
    subnets: Vec<(String, String)>,
    /// `subnets` with every zone known (looked up once, at the first launch).
    placed: std::sync::Arc<tokio::sync::OnceCell<Vec<(String, String)>>>,
    deployment: String,
    /// Spot launches from persistent requests that stop on interruption (RunInstances), so the
    /// policy can stop them ([`Ec2Fleet::with_stoppable_spot`]).
    stoppable_spot: bool,
    /// The workers' security group, for a RunInstances network interface into a subnet.
    security_group: Option<String>,
    /// The persistent spot request of each instance this fleet launched by RunInstances
    /// (instance id to request id, from RunInstances' answer): a launch cancelled moments later
    /// (`Fleet::cancel_launch`) cancels its requests though DescribeInstances does not list the
    /// instances yet (EC2's lookups are eventually consistent, EC2 API Reference, "Eventual
    /// consistency"). Shared by clones; kept for the process (a function invocation).
    launched_requests: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
}

impl Ec2Fleet {
    /// Launch from the launch template `launch_template`, by id (`lt-...`) or by name (version
    /// `$Latest`), placing by availability zone alone. Given its id, the fleet lists and reaps
    /// only instances EC2 launched from it ([`TAG_LAUNCH_TEMPLATE`]).
    pub fn new(client: aws_sdk_ec2::Client, launch_template: impl Into<String>) -> Self {
        Self {
            client,
            launch_template: launch_template.into(),
            subnets: Vec::new(),
            placed: std::sync::Arc::default(),
            deployment: "onoff".into(),
            stoppable_spot: false,
            security_group: None,
            launched_requests: std::sync::Arc::default(),
        }
    }

    /// Launch spot workers so that they can be stopped (`stoppable`): EC2 stops only spot
    /// instances of persistent requests ("You can't stop the Spot Instance ... because it is
    /// associated with a one-time Spot Instance request"), and an instant fleet makes one-time
    /// requests. So each spot offering of a launch is one RunInstances with a persistent spot
    /// request whose interruption behaviour is `stop` (for RunInstances, persistent requests are
    /// "only supported when the instance interruption behavior is either hibernate or stop", EC2
    /// API reference, SpotMarketOptions), from the same launch template, MinCount = MaxCount (all
    /// of the offering's share or none, as the fallback expects), tagged as a fleet's instances
    /// and their requests. Terminating such a worker cancels its request first: a persistent
    /// request whose instance is terminated opens again and launches another. On-demand launches
    /// stay one CreateFleet. `security_group`: the workers' group, named again on the network
    /// interface into a subnet (it replaces the launch template's interface).
    pub fn with_stoppable_spot(mut self, stoppable: bool, security_group: Option<String>) -> Self {
        self.stoppable_spot = stoppable;
        self.security_group = security_group;
        self
    }

    fn launch_template_id(&self) -> Option<&str> {
        self.launch_template
            .starts_with("lt-")
            .then_some(self.launch_template.as_str())
    }

    /// Tag instances `onoff:managed=<name>` and list only those (default `onoff`).
    pub fn with_deployment(mut self, name: impl Into<String>) -> Self {
        self.deployment = name.into();
        self
    }

    /// Launch into these subnets, given as (availability zone, subnet id); an empty zone is looked
    /// up (`ec2:DescribeSubnets`) once ([`Ec2Fleet::subnet_zones`]). An offering's zone picks its
    /// subnet (the override names the subnet, which implies the zone). An offering in a zone
    /// without one is not launched: EC2 would place it by zone alone, in that zone's default
    /// subnet, outside the VPC the workers' security group belongs to (and outside what the
    /// template's scaler role may launch into); it is reported short instead
    /// ([`LaunchResult::short`]). With no subnets at all, every launch is placed by zone alone
    /// (the default VPC).
    pub fn with_subnets(mut self, subnets: Vec<(String, String)>) -> Self {
        self.subnets = subnets;
        self.placed = std::sync::Arc::default();
        self
    }

    /// The subnets given ([`Ec2Fleet::with_subnets`]) as (availability zone, subnet id), each
    /// zone looked up once (`ec2:DescribeSubnets`); empty when none were given (any zone).
    ///
    /// # Errors
    /// EC2 failures, classified; [`FleetErrorKind::Other`] naming a subnet EC2 does not describe.
    pub async fn subnet_zones(&self) -> Result<Vec<(String, String)>, FleetError> {
        Ok(self.placed_subnets().await?.to_vec())
    }

    /// The subnets with their zones, looked up once.
    async fn placed_subnets(&self) -> Result<&[(String, String)], FleetError> {
        let v = self
            .placed
            .get_or_try_init(|| async {
                let unknown: Vec<String> = self
                    .subnets
                    .iter()
                    .filter(|(z, _)| z.is_empty())
                    .map(|(_, s)| s.clone())
                    .collect();
                if unknown.is_empty() {
                    return Ok(self.subnets.clone());
                }
                let out = self
                    .client
                    .describe_subnets()
                    .set_subnet_ids(Some(unknown))
                    .send()
                    .await
                    .map_err(|e| fleet_error(&e))?;
                let zone_of = |id: &str| {
                    out.subnets()
                        .iter()
                        .find(|s| s.subnet_id() == Some(id))
                        .and_then(|s| s.availability_zone())
                        .map(str::to_string)
                };
                self.subnets
                    .iter()
                    .map(|(z, id)| {
                        if !z.is_empty() {
                            return Ok((z.clone(), id.clone()));
                        }
                        zone_of(id).map(|z| (z, id.clone())).ok_or_else(|| FleetError {
                            kind: FleetErrorKind::Other,
                            message: format!("subnet {id} (ONOFF_SUBNETS) is not described by EC2"),
                        })
                    })
                    .collect()
            })
            .await?;
        Ok(v.as_slice())
    }

    /// Each availability zone's default subnet, as (zone, subnet id).
    ///
    /// # Errors
    /// EC2 failures, classified.
    pub async fn default_subnets(client: &aws_sdk_ec2::Client) -> Result<Vec<(String, String)>, FleetError> {
        let out = client
            .describe_subnets()
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name("default-for-az")
                    .values("true")
                    .build(),
            )
            .send()
            .await
            .map_err(|e| fleet_error(&e))?;
        Ok(out
            .subnets()
            .iter()
            .filter_map(|s| Some((s.availability_zone()?.to_string(), s.subnet_id()?.to_string())))
            .collect())
    }

    /// Every instance of this deployment (tag `onoff:managed` = the deployment name, and, when
    /// the launch template is given by id, launched from it) that is pending, running, stopping
    /// or stopped, across all pages.
    ///
    /// # Errors
    /// EC2 failures, classified.
    pub async fn describe_managed(&self) -> Result<Vec<ManagedInstance>, FleetError> {
        let mut out = Vec::new();
        let mut call = self.client.describe_instances().filters(
            aws_sdk_ec2::types::Filter::builder()
                .name(format!("tag:{TAG_MANAGED}"))
                .values(&self.deployment)
                .build(),
        );
        if let Some(id) = self.launch_template_id() {
            call = call.filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name(format!("tag:{TAG_LAUNCH_TEMPLATE}"))
                    .values(id)
                    .build(),
            );
        }
        let mut pages = call.filters(live_states()).into_paginator().send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| fleet_error(&e))?;
            for r in page.reservations() {
                for i in r.instances() {
                    let tag = |k: &str| {
                        i.tags()
                            .iter()
                            .find(|t| t.key() == Some(k))
                            .and_then(|t| t.value())
                            .map(str::to_string)
                    };
                    out.push(ManagedInstance {
                        instance_id: i.instance_id().unwrap_or_default().to_string(),
                        instance_type: i.instance_type().map(|t| t.as_str().to_string()).unwrap_or_default(),
                        zone: i
                            .placement()
                            .and_then(|p| p.availability_zone())
                            .unwrap_or_default()
                            .to_string(),
                        // moto answers the `instance-lifecycle` filter with HTTP 500: read it here.
                        capacity_type: if i.instance_lifecycle().is_some_and(|l| l.as_str() == "spot") {
                            CapacityType::Spot
                        } else {
                            CapacityType::OnDemand
                        },
                        state: i
                            .state()
                            .and_then(|s| s.name())
                            .map(|n| n.as_str().to_string())
                            .unwrap_or_default(),
                        lane: tag(TAG_LANE),
                        project: tag(TAG_PROJECT),
                        job: tag(TAG_JOB),
                        launched_at: i.launch_time().map(|t| t.as_secs_f64()),
                    });
                }
            }
        }
        Ok(out)
    }

    /// One RunInstances per offering of `req` (all spot), each for its round-robin share of the
    /// count, from persistent spot requests that stop on interruption
    /// ([`Ec2Fleet::with_stoppable_spot`]). An offering whose call fails is in
    /// [`LaunchResult::short`] with its error, as an instant fleet's override would be; a
    /// throttled call, or an account's limit, stops the launch.
    async fn launch_stoppable_spot(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        use aws_sdk_ec2::types::{
            InstanceInterruptionBehavior, InstanceMarketOptionsRequest, InstanceNetworkInterfaceSpecification,
            LaunchTemplateSpecification, MarketType, Placement, SpotInstanceType, SpotMarketOptions,
        };
        let subnets = self.placed_subnets().await?;
        let mut out = LaunchResult::default();
        let n = req.offerings.len() as u32;
        let spec = LaunchTemplateSpecification::builder().version("$Latest");
        let spec = match self.launch_template_id() {
            Some(id) => spec.launch_template_id(id),
            None => spec.launch_template_name(&self.launch_template),
        }
        .build();
        let market = InstanceMarketOptionsRequest::builder()
            .market_type(MarketType::Spot)
            .spot_options(
                SpotMarketOptions::builder()
                    .spot_instance_type(SpotInstanceType::Persistent)
                    .instance_interruption_behavior(InstanceInterruptionBehavior::Stop)
                    .build(),
            )
            .build();
        for (i, key) in req.offerings.iter().enumerate() {
            let count = req.count / n + u32::from((i as u32) < req.count % n);
            if count == 0 {
                continue;
            }
            let mut call = self
                .client
                .run_instances()
                .launch_template(spec.clone())
                .instance_type(InstanceType::from(key.instance_type.as_str()))
                .min_count(count as i32)
                .max_count(count as i32)
                .instance_market_options(market.clone())
                .tag_specifications(self.tags(ResourceType::Instance, req))
                .tag_specifications(self.tags(ResourceType::SpotInstancesRequest, req));
            call = match subnets.iter().find(|(z, _)| *z == key.zone) {
                Some((_, subnet)) => call.network_interfaces(
                    InstanceNetworkInterfaceSpecification::builder()
                        .device_index(0)
                        .subnet_id(subnet)
                        .set_groups(self.security_group.clone().map(|g| vec![g]))
                        .associate_public_ip_address(false)
                        .delete_on_termination(true)
                        .build(),
                ),
                None if subnets.is_empty() => call.placement(Placement::builder().availability_zone(&key.zone).build()),
                None => {
                    out.short.push((key.clone(), no_subnet(&key.zone, subnets)));
                    continue;
                }
            };
            if !req.client_token.is_empty() {
                // One token per offering's call (EC2 takes 64 ASCII characters; this is 40 or so).
                call = call.client_token(format!("{}-{i}", req.client_token));
            }
            match call.send().await {
                Ok(resp) => {
                    let mut known = self
                        .launched_requests
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for i in resp.instances() {
                        if let (Some(id), Some(sir)) = (i.instance_id(), i.spot_instance_request_id()) {
                            known.insert(id.to_string(), sir.to_string());
                        }
                    }
                    out.launched.extend(resp.instances().iter().filter_map(|i| {
                        Some(Launched {
                            instance_id: i.instance_id()?.to_string(),
                            offering: key.clone(),
                        })
                    }));
                }
                Err(e) => {
                    let err = fleet_error(&e);
                    if matches!(err.kind, FleetErrorKind::Throttled | FleetErrorKind::AccountLimit) {
                        if out.launched.is_empty() {
                            return Err(err);
                        }
                        out.short.push((key.clone(), err));
                        break;
                    }
                    out.short.push((key.clone(), err));
                }
            }
        }
        if out.launched.is_empty() && out.short.len() == 1 {
            // Nothing launched, one reason: the call's error, as an instant fleet's.
            return Err(out.short.swap_remove(0).1);
        }
        Ok(out)
    }

    /// Tags of `resource` launched for `req`: the deployment, the lane, the project and the job.
    fn tags(&self, resource: ResourceType, req: &LaunchRequest) -> TagSpecification {
        let mut tags = TagSpecification::builder()
            .resource_type(resource)
            .tags(tag(TAG_MANAGED, &self.deployment))
            .tags(tag(TAG_LANE, &req.lane));
        if let Some(p) = &req.project {
            tags = tags.tags(tag(TAG_PROJECT, p));
        }
        if let Some(j) = &req.job {
            tags = tags.tags(tag(TAG_JOB, j));
        }
        tags.build()
    }

    /// Cancel the persistent spot requests of `ids` (those that have one): a persistent request
    /// whose instance is terminated opens again and launches another ("To ensure that no new
    /// Spot Instance is launched, you must first cancel the Spot request", EC2 User Guide,
    /// "Terminate a Spot Instance"). Cancelling leaves the instances as they are.
    ///
    /// The instances' requests tagged for this deployment are looked up
    /// (DescribeSpotInstanceRequests filtered by `instance-id` and `tag:onoff:managed`, as the
    /// agent looks up its own): a stoppable spot launch tags its persistent request
    /// ([`Ec2Fleet::with_stoppable_spot`]), an instant fleet's spot instance has a one-time request
    /// that carries no tag and needs no cancel, and the functions' role may cancel only tagged
    /// requests (template.yaml, `CancelOnlyThisStacksSpotRequests`): a denied cancel would fail
    /// the termination. Each lookup takes at most [`crate::limits::MAX_FILTER_VALUES`] filter
    /// values (EC2 refuses more, `FilterLimitExceeded`, and none of the instances would end).
    /// Not-found requests are skipped, and the others of their batch still cancelled
    /// ([`without_gone`]: before, one unknown request left its whole batch open, each to launch
    /// again). The requests of instances this fleet launched are known from their launch
    /// (`launched_requests`), whatever the lookups answer yet.
    async fn cancel_spot_requests_of(&self, ids: &[String]) -> Result<(), FleetError> {
        let mut requests: Vec<String> = {
            let launched = self
                .launched_requests
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            ids.iter().filter_map(|id| launched.get(id).cloned()).collect()
        };
        // One filter value goes to the tag.
        for batch in ids.chunks(crate::limits::MAX_FILTER_VALUES - 1) {
            let mut pages = self
                .client
                .describe_spot_instance_requests()
                .filters(
                    aws_sdk_ec2::types::Filter::builder()
                        .name("instance-id")
                        .set_values(Some(batch.to_vec()))
                        .build(),
                )
                .filters(
                    aws_sdk_ec2::types::Filter::builder()
                        .name(format!("tag:{TAG_MANAGED}"))
                        .values(&self.deployment)
                        .build(),
                )
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| fleet_error(&e))?;
                requests.extend(
                    page.spot_instance_requests()
                        .iter()
                        .filter_map(|r| r.spot_instance_request_id().map(str::to_string)),
                );
            }
        }
        requests.sort_unstable();
        requests.dedup();
        onoff_control::ports::FleetLister::cancel_spot_requests(self, &requests).await
    }

    /// The state of instance `id` as EC2 names it (`pending`, `running`, `stopping`, `stopped`,
    /// `shutting-down`, `terminated`); `Ok(None)` when EC2 does not list it (not-found included:
    /// EC2 forgets a terminated instance after about an hour).
    ///
    /// # Errors
    /// The DescribeInstances call's failures other than not-found, classified.
    async fn state_of(&self, id: &str) -> Result<Option<String>, FleetError> {
        let out = match self.client.describe_instances().instance_ids(id).send().await {
            Ok(out) => out,
            Err(e) => {
                let err = fleet_error(&e);
                return if err.kind == FleetErrorKind::NotFound {
                    Ok(None)
                } else {
                    Err(err)
                };
            }
        };
        Ok(out
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .find(|i| i.instance_id() == Some(id))
            .and_then(|i| i.state())
            .and_then(|s| s.name())
            .map(|n| n.as_str().to_string()))
    }

    /// Terminate `ids`, [`crate::limits::MAX_TERMINATE_IDS`] per call (EC2 refuses a longer
    /// list whole), their persistent spot requests cancelled first, or EC2 launches them again.
    /// Whatever the fleet launches now: a worker launched while the policy stopped spot workers
    /// has its persistent request still when `scale_down.stop_idle` no longer covers spot.
    async fn terminate_ids(&self, ids: &[String]) -> Result<(), FleetError> {
        self.cancel_spot_requests_of(ids).await?;
        {
            let mut launched = self
                .launched_requests
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for id in ids {
                launched.remove(id);
            }
        }
        for batch in ids.chunks(crate::limits::MAX_TERMINATE_IDS) {
            self.terminate_batch(batch).await?;
        }
        Ok(())
    }

    /// One TerminateInstances for `ids` ([`without_gone`]: EC2 refuses the call whole when an
    /// id does not exist, gone an hour or more after it terminated, and the rest go again). An
    /// instance EC2 launched moments ago may answer not-found as well (eventual consistency) and
    /// still run: its row is Terminating, and the reconciler's orphan pass terminates it again.
    async fn terminate_batch(&self, ids: &[String]) -> Result<(), FleetError> {
        without_gone(ids, "i-", |ids| async move {
            self.client
                .terminate_instances()
                .set_instance_ids(Some(ids))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| fleet_error(&e))
        })
        .await
    }
}

/// A stop or a start of stopped instances ([`Ec2Fleet::stop_or_start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transition {
    Stop,
    Start,
}

impl Ec2Fleet {
    /// StopInstances or StartInstances for `ids`, classified.
    async fn transition(&self, to: Transition, ids: Vec<String>) -> Result<(), FleetError> {
        match to {
            Transition::Stop => self
                .client
                .stop_instances()
                .set_instance_ids(Some(ids))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| fleet_error(&e)),
            Transition::Start => self
                .client
                .start_instances()
                .set_instance_ids(Some(ids))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| fleet_error(&e)),
        }
    }

    /// [`Fleet::stop`] and [`Fleet::start`]: one call for all of `ids` (when more than one); if
    /// EC2 refuses it, one call per instance, each refusal its own
    /// ([`Ec2Fleet::after_incorrect_state`] for one refused for its state). A throttled call for
    /// all is the call's error (nothing was done); a throttle midway stops the calls
    /// ([`throttled_from`]).
    async fn stop_or_start(&self, to: Transition, ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        if ids.len() > 1 {
            match self.transition(to, ids.to_vec()).await {
                Ok(()) => return Ok(Vec::new()),
                // Nothing was done.
                Err(err) if err.kind == FleetErrorKind::Throttled => return Err(err),
                Err(_) => {}
            }
        }
        let mut refused = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let Err(err) = self.transition(to, vec![id.clone()]).await else {
                continue;
            };
            if err.kind == FleetErrorKind::Throttled {
                return throttled_from(ids, i, refused, err);
            }
            let err = if err.message.starts_with(INCORRECT_STATE) {
                self.after_incorrect_state(to, id, err).await
            } else {
                Some(err)
            };
            refused.extend(err.map(|e| (id.clone(), e)));
        }
        Ok(refused)
    }

    /// What an `IncorrectInstanceState` refusal of `id` means, looked up (the code alone does
    /// not say). A stop: done (`None`) when the instance is stopping or stopped after all, else
    /// refused as it was (gone or going: the caller terminates it). A start: refused as
    /// [`FleetErrorKind::NotFound`] when the instance is shutting down, terminated or no longer
    /// listed (gone: the caller retires its row); as [`FleetErrorKind::Stopping`] when it is
    /// stopping, or stopped by the time it was looked up (its stop was still under way when EC2
    /// refused: it stays a stopped worker, and a start now would do); else as it was. If the
    /// lookup fails, the refusal stands as it was.
    async fn after_incorrect_state(&self, to: Transition, id: &str, mut err: FleetError) -> Option<FleetError> {
        let state = self.state_of(id).await;
        match (to, state) {
            (Transition::Stop, Ok(Some(s))) if s == "stopping" || s == "stopped" => return None,
            (Transition::Start, Ok(None)) => {
                err.kind = FleetErrorKind::NotFound;
                err.message.push_str(" (the instance is no longer listed)");
            }
            (Transition::Start, Ok(Some(s))) if s == "shutting-down" || s == "terminated" => {
                err.kind = FleetErrorKind::NotFound;
                err.message.push_str(&format!(" (the instance is {s})"));
            }
            (Transition::Start, Ok(Some(s))) if s == "stopping" || s == "stopped" => {
                err.kind = FleetErrorKind::Stopping;
                err.message.push_str(&format!(" (the instance is {s})"));
            }
            _ => {}
        }
        Some(err)
    }
}

/// `call` for `ids`, an idempotent EC2 action that refuses a call whole when one of its ids does
/// not exist (not-found, naming the ids it did not find: "The instance IDs 'i-1, i-2' do not
/// exist", EC2's wording; moto 5.2.5 answers the same). Those are done, and the call goes again
/// without them: a batch with gone ids takes two calls, not one per id (which EC2's request rate
/// would throttle at hundreds). An answer that names none of the batch's ids (`prefix` and
/// letters or digits: `i-`, `sir-`) goes one by one, not-found counting as done.
///
/// # Errors
/// The call's errors other than not-found.
async fn without_gone<F, Fut>(ids: &[String], prefix: &str, call: F) -> Result<(), FleetError>
where
    F: Fn(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<(), FleetError>>,
{
    let mut left: Vec<String> = ids.to_vec();
    // Each round drops at least one id, or goes one by one: at most `ids.len()` rounds.
    while !left.is_empty() {
        let err = match call(left.clone()).await {
            Ok(()) => return Ok(()),
            Err(err) if err.kind == FleetErrorKind::NotFound => err,
            Err(err) => return Err(err),
        };
        let before = left.len();
        let named = named_ids(&err.message, prefix);
        left.retain(|id| !named.contains(&id.as_str()));
        if left.len() == before {
            for id in left {
                match call(vec![id]).await {
                    Ok(()) => {}
                    Err(err) if err.kind == FleetErrorKind::NotFound => {}
                    Err(err) => return Err(err),
                }
            }
            return Ok(());
        }
    }
    Ok(())
}

/// The ids (`prefix` and letters or digits) an EC2 error message names, in order. Instance ids
/// are hex (`i-0f5d8ccc56c69fae4`), spot request ids are not (`sir-86k84j6p`, EC2 API
/// Reference, CancelSpotInstanceRequests examples).
fn named_ids<'m>(message: &'m str, prefix: &str) -> Vec<&'m str> {
    message
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| {
            w.strip_prefix(prefix)
                .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric()))
        })
        .collect()
}

/// DescribeInstances filter for instances that may still bill: pending or running, and stopping
/// or stopped (a stopped worker's volume bills, and a start brings it back).
fn live_states() -> aws_sdk_ec2::types::Filter {
    aws_sdk_ec2::types::Filter::builder()
        .name("instance-state-name")
        .values("pending")
        .values("running")
        .values("stopping")
        .values("stopped")
        .build()
}

/// The EC2 error code StopInstances answers for an instance in a state it cannot stop from:
/// shutting down or terminated (an agent that shut its instance down at its idle timeout, as the
/// scaler stopped it), or still pending. A stop of a stopping or stopped instance succeeds.
/// StartInstances answers it for an instance still stopping, shutting down or terminated.
const INCORRECT_STATE: &str = "IncorrectInstanceState";

/// For emulators only: what EC2 does and moto 5.2.5 does not. EC2 tags every instance launched
/// from a launch template `aws:ec2launchtemplate:id` ([`TAG_LAUNCH_TEMPLATE`]); moto tags those of
/// RunInstances but not those of CreateFleet. This tags every instance of `deployment` that lacks
/// it with `launch_template_id`. `onoff local` (which plays EC2) calls it right after each function
/// that may launch returns, before anything lists the instances; the moto tests likewise. Best
/// effort: errors are ignored.
pub async fn tag_as_ec2_does(ec2: &aws_sdk_ec2::Client, deployment: &str, launch_template_id: &str) {
    // Every page: the emulator keeps terminated instances, so new ones may be pages away.
    let mut pages = ec2
        .describe_instances()
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name(format!("tag:{TAG_MANAGED}"))
                .values(deployment)
                .build(),
        )
        .filters(live_states())
        .into_paginator()
        .send();
    let mut untagged: Vec<String> = Vec::new();
    while let Some(Ok(page)) = pages.next().await {
        untagged.extend(
            page.reservations()
                .iter()
                .flat_map(|r| r.instances())
                .filter(|i| !i.tags().iter().any(|t| t.key() == Some(TAG_LAUNCH_TEMPLATE)))
                .filter_map(|i| i.instance_id().map(str::to_string)),
        );
    }
    if untagged.is_empty() {
        return;
    }
    let _ = ec2
        .create_tags()
        .set_resources(Some(untagged))
        .tags(tag(TAG_LAUNCH_TEMPLATE, launch_template_id))
        .send()
        .await;
}

fn tag(key: &str, value: &str) -> Tag {
    Tag::builder().key(key).value(value).build()
}

/// The Linux spot price EC2 charges now for each of the instance types in each zone that offers
/// it: one paginated `ec2:DescribeSpotPriceHistory` with the start time now, which returns the
/// price in force per (type, zone, product) and the time it last changed ("the last price change
/// before the start time, which is the effective price as of the start time", EC2 API
/// reference). Every product is asked for and only the `Linux/UNIX` and `Linux/UNIX (Amazon
/// VPC)` lines are kept; where both are given for a (type, zone), the most recently changed one.
/// Prices EC2 writes as text that does not parse are left out. Errors: EC2 failures, classified.
impl SpotPrices for Ec2Fleet {
    async fn spot_quotes(&self, instance_types: &[String]) -> Result<Vec<SpotQuote>, FleetError> {
        let mut latest: std::collections::BTreeMap<(String, String), (f64, f64)> = std::collections::BTreeMap::new();
        let mut pages = self
            .client
            .describe_spot_price_history()
            .start_time(aws_sdk_ec2::primitives::DateTime::from(std::time::SystemTime::now()))
            .set_instance_types(Some(
                instance_types.iter().map(|t| InstanceType::from(t.as_str())).collect(),
            ))
            // The most one page may hold: a region's GPU types fit in one or two.
            .max_results(1000)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| fleet_error(&e))?;
            for p in page.spot_price_history() {
                // Linux lines only, filtered here rather than with `ProductDescriptions`: moto
                // refuses the signature of a request carrying "Linux/UNIX (Amazon VPC)" as the
                // Rust SDK encodes it (AuthFailure under IAM enforcement; boto3's passes), and
                // EC2 takes either.
                if !p
                    .product_description()
                    .is_some_and(|d| matches!(d.as_str(), "Linux/UNIX" | "Linux/UNIX (Amazon VPC)"))
                {
                    continue;
                }
                let (Some(t), Some(zone), Some(price)) = (
                    p.instance_type(),
                    p.availability_zone(),
                    p.spot_price().and_then(|s| s.parse::<f64>().ok()),
                ) else {
                    continue;
                };
                let changed = p.timestamp().map_or(0.0, |d| d.as_secs_f64());
                let e = latest
                    .entry((t.as_str().to_string(), zone.to_string()))
                    .or_insert((changed, price));
                if changed >= e.0 {
                    *e = (changed, price);
                }
            }
        }
        Ok(latest
            .into_iter()
            .map(|((instance_type, zone), (_, usd_per_h))| SpotQuote {
                instance_type,
                zone,
                usd_per_h,
            })
            .collect())
    }
}

impl Fleet for Ec2Fleet {
    async fn launch(&self, req: &LaunchRequest) -> Result<LaunchResult, FleetError> {
        if let Some(e) = onoff_control::ports::invalid_fleet_request(req) {
            return Err(e);
        }
        let first = &req.offerings[0];
        if self.stoppable_spot && first.capacity_type == CapacityType::Spot {
            return self.launch_stoppable_spot(req).await;
        }
        let capacity = match first.capacity_type {
            CapacityType::Spot => DefaultTargetCapacityType::Spot,
            CapacityType::OnDemand => DefaultTargetCapacityType::OnDemand,
        };
        let target = TargetCapacitySpecificationRequest::builder()
            .total_target_capacity(req.count as i32)
            .default_target_capacity_type(capacity)
            .build();
        let spec = FleetLaunchTemplateSpecificationRequest::builder().version("$Latest");
        let spec = match self.launch_template_id() {
            Some(id) => spec.launch_template_id(id),
            None => spec.launch_template_name(&self.launch_template),
        };
        let mut config = FleetLaunchTemplateConfigRequest::builder().launch_template_specification(spec.build());
        let subnets = self.placed_subnets().await?;
        let mut out = LaunchResult::default();
        let mut placed = 0;
        for key in &req.offerings {
            let o = FleetLaunchTemplateOverridesRequest::builder()
                .instance_type(InstanceType::from(key.instance_type.as_str()));
            let o = match subnets.iter().find(|(z, _)| *z == key.zone) {
                Some((_, subnet)) => o.subnet_id(subnet).build(),
                None if subnets.is_empty() => o.availability_zone(&key.zone).build(),
                None => {
                    out.short.push((key.clone(), no_subnet(&key.zone, subnets)));
                    continue;
                }
            };
            config = config.overrides(o);
            placed += 1;
        }
        if placed == 0 {
            return Err(no_subnet(&first.zone, subnets));
        }
        // Spread over the overrides (the policy chose them, all within its cost tolerance).
        let strategy = if req.offerings.len() > 1 {
            SpotAllocationStrategy::Diversified
        } else {
            SpotAllocationStrategy::PriceCapacityOptimized
        };
        let mut call = self.client.create_fleet();
        if !req.client_token.is_empty() {
            // EC2 keeps the token's result: the SDK's own retries, and a repeated call with it,
            // launch nothing new.
            call = call.client_token(&req.client_token);
        }
        let resp = call
            .r#type(FleetType::Instant)
            .launch_template_configs(config.build())
            .target_capacity_specification(target)
            .spot_options(SpotOptionsRequest::builder().allocation_strategy(strategy).build())
            .tag_specifications(self.tags(ResourceType::Instance, req))
            .send()
            .await
            .map_err(|e| fleet_error(&e))?;
        // Which offering an override names: by type and zone, or by type and subnet.
        let offering_of_override = |o: Option<&aws_sdk_ec2::types::FleetLaunchTemplateOverrides>| -> OfferingKey {
            let ty = o.and_then(|o| o.instance_type()).map(|t| t.as_str().to_string());
            let zone = o.and_then(|o| o.availability_zone()).map(str::to_string).or_else(|| {
                let subnet = o.and_then(|o| o.subnet_id())?;
                subnets.iter().find(|(_, s)| s == subnet).map(|(z, _)| z.clone())
            });
            req.offerings
                .iter()
                .find(|k| {
                    ty.as_deref().is_none_or(|t| t == k.instance_type) && zone.as_deref().is_none_or(|z| z == k.zone)
                })
                .unwrap_or(first)
                .clone()
        };
        for i in resp.instances() {
            let offering = offering_of_override(i.launch_template_and_overrides().and_then(|l| l.overrides()));
            for id in i.instance_ids() {
                out.launched.push(Launched {
                    instance_id: id.clone(),
                    offering: offering.clone(),
                });
            }
        }
        let mut other: Option<FleetError> = None;
        for e in resp.errors() {
            let code = e.error_code().unwrap_or("UnfulfillableCapacity");
            let err = FleetError {
                kind: classify_ec2_code(code),
                message: format!("{code}: {}", e.error_message().unwrap_or_default()),
            };
            let overrides = e.launch_template_and_overrides().and_then(|l| l.overrides());
            // An error naming its override (no capacity, Unsupported, InvalidParameterValue for
            // that type, ...) belongs to that offering: the caller skips it and falls back.
            // Throttling, an account's limit, and errors naming no override, are the call's.
            let stop = matches!(err.kind, FleetErrorKind::Throttled | FleetErrorKind::AccountLimit);
            if !stop && (overrides.is_some() || req.offerings.len() == 1) {
                out.short.push((offering_of_override(overrides), err));
            } else if stop {
                // Throttling or an account's limit wins: the caller stops and retries rather than
                // falling back.
                other = Some(err);
            } else {
                other.get_or_insert(err);
            }
        }
        if out.launched.is_empty() {
            // An instant fleet reports failures in `errors`, not as an API error.
            if let Some(e) = other {
                return Err(e);
            }
            if out.short.is_empty() {
                return Err(FleetError {
                    kind: FleetErrorKind::InsufficientCapacity,
                    message: "UnfulfillableCapacity: no instance launched".into(),
                });
            }
        }
        Ok(out)
    }

    async fn terminate(&self, instance_ids: &[String]) -> Result<(), FleetError> {
        self.terminate_ids(instance_ids).await
    }

    async fn cancel_launch(&self, instance_ids: &[String]) -> Result<(), FleetError> {
        // An `instant` fleet leaves no request behind to cancel: a launch still booting is an
        // instance in `pending`, and terminating it is how it is cancelled.
        self.terminate_ids(instance_ids).await
    }

    /// One StopInstances for all the instances; if EC2 refuses it (a call is refused whole for
    /// one instance it will not stop: a spot instance of a one-time request,
    /// `UnsupportedOperation`; one shutting down), one StopInstances per instance, so the others
    /// still stop (a stop of an instance already stopping is done, so whatever the refused call
    /// did, the second pass is safe). One call per instance from the start took a scaler that
    /// stops a burst's hundred idle workers a hundred sequential round trips within its 60 s
    /// timeout. A stopping or stopped instance is done; the rest are refused with their error
    /// (not-found, and `IncorrectInstanceState` for one shutting down or terminated, included:
    /// the caller terminates them, which is idempotent).
    async fn stop(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        self.stop_or_start(Transition::Stop, instance_ids).await
    }

    /// One StartInstances for all the instances; if EC2 refuses it, one StartInstances per
    /// instance, so that one without capacity (`InsufficientInstanceCapacity`: its type has none
    /// in its zone now; it stays stopped) does not hold the others back (a start of an instance
    /// already pending or running is done, so whatever the refused call did, the second pass is
    /// safe: EC2 answers a start of one with its state). One refused for its state
    /// (`IncorrectInstanceState`) is looked up: shutting down, terminated or no longer listed, it
    /// is refused as [`FleetErrorKind::NotFound`] (gone: the caller retires its row); still
    /// stopping (or stopped by the lookup), as [`FleetErrorKind::Stopping`] (it stays a stopped
    /// worker, and `control::act` may hold the start for the next decision). If the lookup fails,
    /// EC2's error is kept as it was.
    async fn start(&self, instance_ids: &[String]) -> Result<Vec<(String, FleetError)>, FleetError> {
        self.stop_or_start(Transition::Start, instance_ids).await
    }
}

/// EC2 throttled the per-instance call for `instance_ids[at]` (after the SDK's retries). Before
/// anything was done, the whole call failed: `Err`. After some calls went through, those stand
/// (an instance started must be reported started, or its row would say stopped while it runs,
/// billed): the rest are refused with the throttle error, with the ones `refused` already.
fn throttled_from(
    instance_ids: &[String],
    at: usize,
    mut refused: Vec<(String, FleetError)>,
    err: FleetError,
) -> Result<Vec<(String, FleetError)>, FleetError> {
    if at == 0 {
        return Err(err);
    }
    refused.extend(instance_ids[at..].iter().map(|id| (id.clone(), err.clone())));
    Ok(refused)
}

impl onoff_control::ports::FleetLister for Ec2Fleet {
    async fn list_managed(&self) -> Result<Vec<onoff_control::ports::FleetInstance>, FleetError> {
        Ok(self
            .describe_managed()
            .await?
            .into_iter()
            .map(|i| onoff_control::ports::FleetInstance {
                offering: offering_of(&i),
                launched_at: i.launched_at.unwrap_or(0.0),
                instance_id: i.instance_id,
                lane: i.lane,
                project: i.project,
                job: i.job,
                stopped: matches!(i.state.as_str(), "stopping" | "stopped"),
            })
            .collect())
    }

    /// DescribeSpotInstanceRequests for this deployment's tag (`onoff:managed`) and the states
    /// that may still launch (`open`, `active`, `disabled`; not `closed`, `cancelled` or
    /// `failed`), every page. An instant fleet's one-time requests carry no tag and are not
    /// listed. Allowed by the functions' `FindThisStacksSpotRequests` grant.
    async fn list_spot_requests(&self) -> Result<Vec<onoff_control::ports::SpotRequest>, FleetError> {
        let mut pages = self
            .client
            .describe_spot_instance_requests()
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name(format!("tag:{TAG_MANAGED}"))
                    .values(&self.deployment)
                    .build(),
            )
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name("state")
                    .values("open")
                    .values("active")
                    .values("disabled")
                    .build(),
            )
            .into_paginator()
            .send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| fleet_error(&e))?;
            out.extend(page.spot_instance_requests().iter().filter_map(|r| {
                Some(onoff_control::ports::SpotRequest {
                    id: r.spot_instance_request_id()?.to_string(),
                    instance_id: r.instance_id().map(str::to_string),
                    // Undated (EC2 dates every request): never old enough to cancel.
                    created_at: r.create_time().map_or(f64::MAX, |t| t.as_secs_f64()),
                })
            }));
        }
        Ok(out)
    }

    /// CancelSpotInstanceRequests, allowed for this stack's tagged requests only
    /// (`CancelOnlyThisStacksSpotRequests`), [`crate::limits::MAX_TERMINATE_IDS`] per call;
    /// not-found ones are done, and the others of their batch still cancelled (`without_gone`).
    async fn cancel_spot_requests(&self, requests: &[String]) -> Result<(), FleetError> {
        for batch in requests.chunks(crate::limits::MAX_TERMINATE_IDS) {
            without_gone(batch, "sir-", |ids| async move {
                self.client
                    .cancel_spot_instance_requests()
                    .set_spot_instance_request_ids(Some(ids))
                    .send()
                    .await
                    .map(|_| ())
                    .map_err(|e| fleet_error(&e))
            })
            .await?;
        }
        Ok(())
    }
}

/// An offering in `zone`, which none of the fleet's `subnets` is in.
fn no_subnet(zone: &str, subnets: &[(String, String)]) -> FleetError {
    let zones: Vec<&str> = subnets.iter().map(|(z, _)| z.as_str()).collect();
    FleetError {
        kind: FleetErrorKind::Other,
        message: format!(
            "no subnet in {zone} (ONOFF_SUBNETS has {}): not launched there, as EC2 would place it in the \
             zone's default subnet, outside the workers' VPC",
            zones.join(", ")
        ),
    }
}

/// The offering an instance came from.
pub fn offering_of(i: &ManagedInstance) -> OfferingKey {
    OfferingKey {
        instance_type: i.instance_type.clone(),
        zone: i.zone.clone(),
        capacity_type: i.capacity_type,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ids_a_not_found_error_names_are_read_in_both_wordings() {
        assert_eq!(
            named_ids(
                "InvalidInstanceID.NotFound: The instance IDs 'i-0f5d8ccc56c69fae4, i-0eecca434287a1a33' do not exist",
                "i-"
            ),
            ["i-0f5d8ccc56c69fae4", "i-0eecca434287a1a33"]
        );
        assert_eq!(
            named_ids(
                "InvalidInstanceID.NotFound: The instance ID 'i-02a1ecf35d5cae548' does not exist",
                "i-"
            ),
            ["i-02a1ecf35d5cae548"]
        );
        assert_eq!(
            named_ids(
                "InvalidSpotInstanceRequestID.NotFound: The spot instance request ID 'sir-8f2a3b4c' does not exist",
                "sir-"
            ),
            ["sir-8f2a3b4c"]
        );
        // Spot request ids as EC2 makes them: letters and digits, not only hex.
        assert_eq!(
            named_ids(
                "InvalidSpotInstanceRequestID.NotFound: The spot instance request ID 'sir-86k84j6p' does not exist",
                "sir-"
            ),
            ["sir-86k84j6p"]
        );
        // Words that look like ids but are not, or ids of another kind: nothing.
        assert!(named_ids("InvalidInstanceID.NotFound: i- is-not i-x-y instances", "i-").is_empty());
        assert!(named_ids("The instance ID 'i-02a1' does not exist", "sir-").is_empty());
    }
}
