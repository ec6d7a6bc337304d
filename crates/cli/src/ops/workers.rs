//! `onoff workers`: what the stack runs now, what it costs per hour, and what holds launches back.
//!
//! Three sources, each as the control plane itself reads it:
//! - the workers table's live rows (`WorkerRegistry::list_live`: every state but Terminating), with
//!   the job each worker holds the lease of (the RUNNING rows of the jobs table's sparse active
//!   index, `JobStore::active`, by `lease_owner`);
//! - EC2's pending and running instances of the stack (`Ec2Fleet::describe_managed`, by the
//!   `onoff:managed` tag): an instance no row names is billed all the same (the reconciler adopts
//!   or terminates it within its launch grace), a row no instance backs is a worker the reconciler
//!   finds gone (its job is re-queued);
//! - the offerings marked unavailable after a capacity error, and the vCPU quotas found full
//!   (`QuotaMark`), from the control table: why nothing of a type launches now, and which quota to
//!   raise;
//! - the stack's persistent spot requests that no live worker holds (`FleetLister::list_spot_requests`):
//!   EC2 launches again from such a request until the reconciler cancels it (an instance that
//!   powered off before its agent ran: a worker image that does not pull).

use anyhow::Result;
use comfy_table::{presets::UTF8_BORDERS_ONLY, Table};
use onoff_aws::fleet::ManagedInstance;
use onoff_aws::state::state_name;
use onoff_control::job::JobState;
use onoff_control::ports::{FleetLister, JobRecord, JobStore, SpotRequest, WorkerRecord, WorkerRegistry};
use onoff_control::quota::QuotaMark;
use onoff_policy::{CapacityType, UnavailableOffering, WorkerState};
use serde::Serialize;

use super::{now, span, usd, when, Ops, Target};

/// `onoff workers`.
#[derive(clap::Args, Debug)]
pub struct WorkersArgs {
    /// Only this lane's workers.
    #[arg(long)]
    lane: Option<String>,
    #[command(flatten)]
    target: Target,
}

/// One live worker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerLine {
    pub instance_id: String,
    pub lane: String,
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: &'static str,
    /// The workers table's state: Pending, Running, Idle, Draining or Stopped.
    pub state: &'static str,
    /// Catalogue price the worker is billed at, $/h (0 until the control plane priced it).
    pub price_usd_per_h: f64,
    /// Seconds since launch.
    pub up_s: f64,
    /// The job whose lease it holds, if any.
    pub job: Option<String>,
    /// Seconds idle, when idle.
    pub idle_s: Option<f64>,
    /// Seconds since its agent's last heartbeat (`None` before the agent started).
    pub heartbeat_age_s: Option<f64>,
    /// Until when the control plane holds it (an idle worker kept warm; a stopped worker's
    /// keep, after which it is terminated), unix seconds.
    pub hold_until: Option<f64>,
    /// EC2's state of its instance (`pending`, `running`); `None` when EC2 lists no pending or
    /// running instance for it (the reconciler will find it gone), or when EC2 was not read.
    pub ec2_state: Option<String>,
    /// The projects whose cache its volume holds, most recently used first, as its agent last
    /// recorded them (shown for idle and stopped workers): a stopped worker is started for their
    /// jobs first.
    pub cached_projects: Vec<String>,
}

/// An instance of the stack that no live worker row names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnregisteredInstance {
    pub instance_id: String,
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: &'static str,
    pub ec2_state: String,
    /// Seconds since launch (`None` when EC2 gave no launch time).
    pub up_s: Option<f64>,
}

/// A persistent spot request of the stack that no live worker holds: EC2 launches again from it
/// (open), or it names an instance no row knows, until the reconciler cancels it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnheldSpotRequest {
    pub id: String,
    /// Its instance now (`None`: open, waiting to launch another).
    pub instance_id: Option<String>,
    /// Seconds since it was made.
    pub age_s: f64,
    /// Seconds until the reconciler's next run past its launch grace may cancel it (0: the next).
    pub cancelled_in_s: f64,
}

/// The requests of `requests` whose instance is none of `live` (worker ids, every lane), at `now`
/// (unix seconds), oldest first; the reconciler cancels each once `grace_s` passed since it was
/// made (`ReconcileOptions::launch_grace_s`).
pub fn unheld_spot_requests(
    requests: Vec<SpotRequest>,
    live: &[String],
    now: f64,
    grace_s: f64,
) -> Vec<UnheldSpotRequest> {
    let mut out: Vec<UnheldSpotRequest> = requests
        .into_iter()
        .filter(|r| !r.is_held(|i| live.iter().any(|l| l == i)))
        .map(|r| UnheldSpotRequest {
            id: r.id,
            instance_id: r.instance_id,
            age_s: (now - r.created_at).max(0.0),
            cancelled_in_s: (r.created_at + grace_s - now).max(0.0),
        })
        .collect();
    out.sort_by(|a, b| b.age_s.total_cmp(&a.age_s));
    out
}

/// An offering skipped after a capacity error, until `until` (unix seconds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldOffering {
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: &'static str,
    pub until: f64,
}

/// A vCPU quota found full.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FullQuota {
    /// Its name in Service Quotas.
    pub quota: String,
    /// Its Service Quotas code (service `ec2`), when it has one.
    pub code: Option<&'static str>,
    pub capacity_type: &'static str,
    /// The vCPUs of the launch it refused: offerings of the bucket with at least as many are
    /// skipped.
    pub vcpus: u32,
    /// vCPUs at and above which a type would not fit even with the deployment's workers gone
    /// (`QuotaMark::ceiling`), when known.
    pub ceiling: Option<u32>,
    pub until: f64,
    /// What to do about it.
    pub advice: String,
}

/// Everything `onoff workers` shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkersReport {
    pub workers: Vec<WorkerLine>,
    /// Workers per state, in the order Pending, Running, Idle, Draining, Stopped.
    pub counts: Vec<(&'static str, usize)>,
    /// $/h of the live workers (launch prices: catalogue on-demand, spot as EC2 quoted it to the
    /// launching function; a stopped worker at its volume's rate, the policy's
    /// `ScaleDownConfig::stopped_usd_per_h`).
    pub usd_per_h: f64,
    pub unregistered: Vec<UnregisteredInstance>,
    /// Why EC2 was not read, when it was not (the rest still shows).
    pub ec2_error: Option<String>,
    pub unavailable_offerings: Vec<HeldOffering>,
    pub full_quotas: Vec<FullQuota>,
    /// The stack's persistent spot requests no live worker holds ([`unheld_spot_requests`]).
    pub unheld_spot_requests: Vec<UnheldSpotRequest>,
    /// Why EC2's spot requests were not read, when they were not.
    pub spot_requests_error: Option<String>,
    /// Rows of the workers table that did not parse: (instance id, why).
    pub unreadable: Vec<(String, String)>,
}

fn capacity(c: CapacityType) -> &'static str {
    match c {
        CapacityType::Spot => "spot",
        CapacityType::OnDemand => "on-demand",
    }
}

/// The report from what was read: `live` worker rows, `instances` (EC2's instances of the stack,
/// stopped ones included; `Err` when EC2 could not be read), the `jobs` rows, the `unavailable`
/// marks (offerings and quotas), at `now` (unix seconds), a stopped worker billed
/// `stopped_usd_per_h` ($/h, its volume). Workers sorted by lane, then launch.
pub fn report(
    live: Vec<WorkerRecord>,
    instances: Result<Vec<ManagedInstance>, String>,
    jobs: &[JobRecord],
    unavailable: Vec<UnavailableOffering>,
    lane: Option<&str>,
    now: f64,
    stopped_usd_per_h: f64,
) -> WorkersReport {
    let mut live: Vec<WorkerRecord> = live.into_iter().filter(|w| lane.is_none_or(|l| w.lane == l)).collect();
    live.sort_by(|a, b| a.lane.cmp(&b.lane).then(a.launched_at.total_cmp(&b.launched_at)));
    let (instances, ec2_error) = match instances {
        Ok(i) => (Some(i), None),
        Err(e) => (None, Some(e)),
    };
    let leased = |id: &str| {
        jobs.iter()
            .find(|j| j.state == JobState::Running && j.lease_owner.as_deref() == Some(id))
            .map(|j| j.id.clone())
    };
    let workers: Vec<WorkerLine> = live
        .iter()
        .map(|w| WorkerLine {
            instance_id: w.id.clone(),
            lane: w.lane.clone(),
            instance_type: w.offering.instance_type.clone(),
            zone: w.offering.zone.clone(),
            capacity_type: capacity(w.offering.capacity_type),
            state: state_name(w.state),
            price_usd_per_h: w.price_usd_per_h,
            up_s: (now - w.launched_at).max(0.0),
            job: leased(&w.id),
            idle_s: w
                .idle_since
                .filter(|_| w.state == WorkerState::Idle)
                .map(|t| (now - t).max(0.0)),
            heartbeat_age_s: w.heartbeat_at.map(|t| (now - t).max(0.0)),
            hold_until: w.hold_until.filter(|t| *t > now),
            ec2_state: instances
                .as_ref()
                .and_then(|is| is.iter().find(|i| i.instance_id == w.id).map(|i| i.state.clone())),
            cached_projects: w.cached_projects.clone(),
        })
        .collect();
    let unregistered: Vec<UnregisteredInstance> = instances
        .iter()
        .flatten()
        .filter(|i| lane.is_none_or(|l| i.lane.as_deref() == Some(l)))
        .filter(|i| !live.iter().any(|w| w.id == i.instance_id))
        .map(|i| UnregisteredInstance {
            instance_id: i.instance_id.clone(),
            instance_type: i.instance_type.clone(),
            zone: i.zone.clone(),
            capacity_type: capacity(i.capacity_type),
            ec2_state: i.state.clone(),
            up_s: i.launched_at.map(|t| (now - t).max(0.0)),
        })
        .collect();
    let counts = [
        WorkerState::Pending,
        WorkerState::Running,
        WorkerState::Idle,
        WorkerState::Draining,
        WorkerState::Stopped,
    ]
    .into_iter()
    .map(|s| (state_name(s), live.iter().filter(|w| w.state == s).count()))
    .collect();
    let (quotas, offerings) = QuotaMark::split(unavailable.into_iter().filter(|u| u.until > now).collect());
    let mut unavailable_offerings: Vec<HeldOffering> = offerings
        .into_iter()
        .map(|u| HeldOffering {
            instance_type: u.key.instance_type,
            zone: u.key.zone,
            capacity_type: capacity(u.key.capacity_type),
            until: u.until,
        })
        .collect();
    unavailable_offerings.sort_by(|a, b| {
        (&a.instance_type, &a.zone, a.capacity_type).cmp(&(&b.instance_type, &b.zone, b.capacity_type))
    });
    let full_quotas = quotas
        .into_iter()
        .map(|q| FullQuota {
            quota: q.bucket.name(q.capacity),
            code: q.bucket.code(q.capacity),
            capacity_type: capacity(q.capacity),
            vcpus: q.vcpus,
            ceiling: q.ceiling,
            until: q.until,
            advice: q.bucket.advice(q.capacity, q.vcpus),
        })
        .collect();
    WorkersReport {
        // A fold from +0: an empty f64 sum is -0, printed "-0.0000".
        usd_per_h: live.iter().fold(0.0, |a, w| {
            a + if w.state == WorkerState::Stopped {
                stopped_usd_per_h
            } else {
                w.price_usd_per_h
            }
        }),
        workers,
        counts,
        unregistered,
        ec2_error,
        unavailable_offerings,
        full_quotas,
        unheld_spot_requests: Vec::new(),
        spot_requests_error: None,
        unreadable: Vec::new(),
    }
}

/// The report as text: a table of workers, a summary line, then what else bills or holds back.
pub fn render(r: &WorkersReport, now: f64) -> String {
    let mut out = String::new();
    if r.workers.is_empty() {
        out.push_str("no live workers\n");
    } else {
        let mut t = Table::new();
        t.load_preset(UTF8_BORDERS_ONLY);
        t.set_header([
            "instance",
            "lane",
            "type",
            "zone",
            "capacity",
            "state",
            "$/h",
            "up",
            "job / idle",
            "heartbeat",
            "ec2",
        ]);
        for w in &r.workers {
            // What its volume holds for the next job of a project, on a worker waiting for one.
            let cache = if w.cached_projects.is_empty() {
                String::new()
            } else {
                format!("; cache: {}", w.cached_projects.join(", "))
            };
            let doing = match (&w.job, w.idle_s) {
                (Some(j), _) => j.clone(),
                (None, _) if w.state == state_name(WorkerState::Stopped) => format!(
                    "stopped{}{cache}",
                    w.hold_until
                        .map_or_else(String::new, |t| format!(", kept {} more", span(t - now)))
                ),
                (None, Some(s)) => format!(
                    "idle {}{}{cache}",
                    span(s),
                    w.hold_until
                        .map_or_else(String::new, |t| format!(", held {} more", span(t - now)))
                ),
                (None, None) => "-".into(),
            };
            t.add_row([
                w.instance_id.clone(),
                w.lane.clone(),
                w.instance_type.clone(),
                w.zone.clone(),
                w.capacity_type.to_string(),
                w.state.to_string(),
                usd(w.price_usd_per_h),
                span(w.up_s),
                doing,
                w.heartbeat_age_s
                    .map_or_else(|| "none yet".into(), |s| format!("{} ago", span(s))),
                w.ec2_state.clone().unwrap_or_else(|| {
                    if r.ec2_error.is_some() {
                        "?".into()
                    } else {
                        "gone".into()
                    }
                }),
            ]);
        }
        out.push_str(&format!("{t}\n"));
    }
    let counts: Vec<String> = r
        .counts
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(s, n)| format!("{n} {}", s.to_ascii_lowercase()))
        .collect();
    out.push_str(&format!(
        "{} worker(s){}: ${}/h at launch prices (not your AWS bill)\n",
        r.workers.len(),
        if counts.is_empty() {
            String::new()
        } else {
            format!(" ({})", counts.join(", "))
        },
        usd(r.usd_per_h)
    ));
    if let Some(e) = &r.ec2_error {
        out.push_str(&format!(
            "EC2 not read ({e}): instances without a worker row are not shown\n"
        ));
    }
    if r.workers.iter().any(|w| w.ec2_state.is_none()) && r.ec2_error.is_none() {
        out.push_str(
            "gone: EC2 lists no pending or running instance for the worker; the reconciler re-queues its job \
             once the launch grace is over\n",
        );
    }
    for i in &r.unregistered {
        out.push_str(&format!(
            "instance {} ({} {} {}, {}, up {}) has no worker row: billed all the same; the reconciler adopts it \
             or terminates it\n",
            i.instance_id,
            i.instance_type,
            i.zone,
            i.capacity_type,
            i.ec2_state,
            i.up_s.map_or_else(|| "?".into(), span)
        ));
    }
    for q in &r.unheld_spot_requests {
        out.push_str(&format!(
            "spot request {} ({}, made {} ago) is held by no worker: EC2 launches again from it until the \
             reconciler cancels it ({})\n",
            q.id,
            q.instance_id
                .as_deref()
                .map_or_else(|| "open, no instance".to_string(), |i| format!("instance {i}")),
            span(q.age_s),
            if q.cancelled_in_s > 0.0 {
                format!("at its first run in {}", span(q.cancelled_in_s))
            } else {
                "at its next run".to_string()
            }
        ));
    }
    if let Some(e) = &r.spot_requests_error {
        out.push_str(&format!("EC2 spot requests not read ({e})\n"));
    }
    for q in &r.full_quotas {
        let never = match q.ceiling {
            Some(c) if c > q.vcpus => format!("; {c} or more would not fit even with this deployment's workers gone"),
            _ => String::new(),
        };
        out.push_str(&format!(
            "quota full until {}: {} (launches of {} vCPUs or more refused{never})\n  {}\n",
            when(q.until),
            q.quota,
            q.vcpus,
            q.advice
        ));
    }
    if !r.unavailable_offerings.is_empty() {
        out.push_str(&format!(
            "{} offering(s) skipped after a capacity error:\n",
            r.unavailable_offerings.len()
        ));
        for o in &r.unavailable_offerings {
            out.push_str(&format!(
                "  {} {} {} until {}\n",
                o.instance_type,
                o.zone,
                o.capacity_type,
                when(o.until)
            ));
        }
    }
    for (id, why) in &r.unreadable {
        out.push_str(&format!("unreadable worker row {id}: {why}\n"));
    }
    out
}

/// Run `onoff workers`.
///
/// # Errors
/// The stack; the workers, jobs or control table cannot be read. EC2 failing to answer is shown,
/// not an error.
pub async fn workers(a: WorkersArgs) -> Result<()> {
    let ops = Ops::connect(&a.target).await?;
    let ctx = onoff_fn_common::ctx_from_clients(ops.settings.clone(), &ops.clients);
    let now = now();
    let listed = ctx
        .workers
        .list_live()
        .await
        .map_err(|e| anyhow::anyhow!("reading the workers table: {e}"))?;
    // The running jobs only: the sparse active index, not every row the table keeps.
    let active = ops
        .jobs
        .active()
        .await
        .map_err(|e| anyhow::anyhow!("reading the active jobs: {e}"))?;
    let jobs = active.items;
    let unavailable = ctx
        .avail
        .unavailable(now)
        .await
        .map_err(|e| anyhow::anyhow!("reading the unavailable offerings: {e}"))?;
    let instances = ctx.fleet.describe_managed().await.map_err(|e| e.to_string());
    let requests = ctx.fleet.list_spot_requests().await.map_err(|e| e.to_string());
    let live_ids: Vec<String> = listed.items.iter().map(|w| w.id.clone()).collect();
    let mut r = report(
        listed.items,
        instances,
        &jobs,
        unavailable,
        a.lane.as_deref(),
        now,
        ops.settings.policy.scale_down.stopped_usd_per_h(),
    );
    r.unreadable = listed.unreadable;
    match requests {
        Ok(requests) => {
            r.unheld_spot_requests =
                unheld_spot_requests(requests, &live_ids, now, ops.settings.reconcile.launch_grace_s);
        }
        Err(e) => r.spot_requests_error = Some(e),
    }
    if ops.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", render(&r, now));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use onoff_policy::OfferingKey;

    fn key(t: &str, zone: &str, c: CapacityType) -> OfferingKey {
        OfferingKey {
            instance_type: t.into(),
            zone: zone.into(),
            capacity_type: c,
        }
    }

    fn instance(id: &str, state: &str) -> ManagedInstance {
        ManagedInstance {
            instance_id: id.into(),
            instance_type: "g5.xlarge".into(),
            zone: "us-east-1a".into(),
            capacity_type: CapacityType::Spot,
            state: state.into(),
            lane: Some("standard".into()),
            project: None,
            job: None,
            launched_at: Some(900.0),
        }
    }

    #[test]
    fn a_report_joins_rows_jobs_instances_and_marks() {
        let now = 1000.0;
        let spot = key("g5.xlarge", "us-east-1a", CapacityType::Spot);
        let busy = WorkerRecord {
            state: WorkerState::Running,
            heartbeat_at: Some(990.0),
            ..WorkerRecord::launched("i-busy", "standard", spot.clone(), 0.5, 100.0)
        };
        let idle = WorkerRecord {
            state: WorkerState::Idle,
            idle_since: Some(940.0),
            hold_until: Some(1300.0),
            cached_projects: vec!["llm".into()],
            ..WorkerRecord::launched("i-idle", "standard", spot.clone(), 0.25, 50.0)
        };
        let gone = WorkerRecord::launched("i-gone", "express", spot.clone(), 1.0, 200.0);
        // Stopped: billed its volume (0.01 $/h here), not its instance's 0.40 $/h.
        let stopped = WorkerRecord {
            state: WorkerState::Stopped,
            idle_since: Some(400.0),
            hold_until: Some(now + 3.0 * 3600.0),
            cached_projects: vec!["llm".into(), "asr".into()],
            ..WorkerRecord::launched("i-stop", "standard", spot.clone(), 0.40, 20.0)
        };
        let spec: onoff_control::job::JobSpec =
            serde_json::from_str(r#"{"image":"img","command":["x"],"project":"p"}"#).unwrap();
        let mut job = JobRecord::new("job-1".into(), spec.clone(), "test".into(), 10.0);
        job.state = JobState::Running;
        job.lease_owner = Some("i-busy".into());
        let mut done = JobRecord::new("job-0".into(), spec, "test".into(), 5.0);
        done.state = JobState::Succeeded;
        done.lease_owner = Some("i-idle".into());
        let quota = QuotaMark {
            bucket: onoff_control::quota::QuotaBucket::of("g5.xlarge"),
            capacity: CapacityType::Spot,
            vcpus: 4,
            until: 1180.0,
            ceiling: Some(36),
        };
        let marks = vec![
            UnavailableOffering {
                key: key("g5.2xlarge", "us-east-1b", CapacityType::Spot),
                until: 1100.0,
            },
            UnavailableOffering {
                key: key("g5.4xlarge", "us-east-1b", CapacityType::Spot),
                until: 999.0,
            },
            UnavailableOffering {
                key: quota.key(),
                until: quota.until,
            },
        ];
        let r = report(
            vec![gone, idle, busy, stopped],
            Ok(vec![
                instance("i-busy", "running"),
                instance("i-idle", "running"),
                instance("i-stop", "stopped"),
                instance("i-stray", "pending"),
            ]),
            &[job, done],
            marks,
            None,
            now,
            0.01,
        );
        let ids: Vec<&str> = r.workers.iter().map(|w| w.instance_id.as_str()).collect();
        assert_eq!(ids, ["i-gone", "i-stop", "i-idle", "i-busy"], "by lane, then launch");
        let busy = &r.workers[3];
        assert_eq!(busy.job.as_deref(), Some("job-1"));
        assert_eq!(
            (busy.state, busy.up_s, busy.heartbeat_age_s),
            ("Running", 900.0, Some(10.0))
        );
        let idle = &r.workers[2];
        let stopped = &r.workers[1];
        assert_eq!((stopped.state, stopped.idle_s), ("Stopped", None));
        assert_eq!(stopped.ec2_state.as_deref(), Some("stopped"));
        assert_eq!(idle.job, None, "a finished job's lease owner is not its worker's job");
        assert_eq!((idle.idle_s, idle.hold_until), (Some(60.0), Some(1300.0)));
        assert_eq!(r.workers[0].ec2_state, None, "no instance backs i-gone");
        assert_eq!(busy.ec2_state.as_deref(), Some("running"));
        assert_eq!(
            r.counts,
            [
                ("Pending", 1),
                ("Running", 1),
                ("Idle", 1),
                ("Draining", 0),
                ("Stopped", 1)
            ]
        );
        assert!((r.usd_per_h - 1.76).abs() < 1e-12, "{}", r.usd_per_h);
        assert_eq!(r.unregistered.len(), 1);
        assert_eq!(r.unregistered[0].instance_id, "i-stray");
        assert_eq!(r.unavailable_offerings.len(), 1, "the expired mark is left out");
        assert_eq!(r.unavailable_offerings[0].instance_type, "g5.2xlarge");
        assert_eq!(r.full_quotas.len(), 1);
        assert_eq!(r.full_quotas[0].code, Some("L-3819A6DF"));
        let text = render(&r, now);
        for needle in [
            "4 worker(s) (1 pending, 1 running, 1 idle, 1 stopped): $1.7600/h",
            "idle 60s, held 5m00s more; cache: llm",
            "stopped, kept 3h00m more; cache: llm, asr",
            "gone: EC2 lists no pending or running instance",
            "instance i-stray (g5.xlarge us-east-1a spot, pending, up 100s) has no worker row",
            "All G and VT Spot Instance Requests",
            "--quota-code L-3819A6DF",
            "launches of 4 vCPUs or more refused; 36 or more would not fit even with this deployment's workers gone",
            "g5.2xlarge us-east-1b spot until",
        ] {
            assert!(text.contains(needle), "{needle:?} in:\n{text}");
        }
        // One lane: its workers and instances only.
        let express = report(
            vec![WorkerRecord::launched("i-gone", "express", spot, 1.0, 200.0)],
            Ok(vec![instance("i-stray", "pending")]),
            &[],
            Vec::new(),
            Some("express"),
            now,
            0.01,
        );
        assert_eq!(express.workers.len(), 1);
        assert!(express.unregistered.is_empty(), "i-stray is the standard lane's");
    }

    #[test]
    fn no_workers_cost_nothing() {
        let r = report(Vec::new(), Ok(Vec::new()), &[], Vec::new(), None, 10.0, 0.01);
        let text = render(&r, 10.0);
        assert!(text.starts_with("no live workers\n"), "{text}");
        assert!(text.contains("0 worker(s): $0.0000/h"), "{text}");
    }

    #[test]
    fn ec2_unread_is_said_and_nothing_is_called_gone() {
        let w = WorkerRecord::launched(
            "i-1",
            "standard",
            key("g5.xlarge", "us-east-1a", CapacityType::OnDemand),
            1.0,
            0.0,
        );
        let r = report(
            vec![w],
            Err("UnauthorizedOperation: no".into()),
            &[],
            Vec::new(),
            None,
            10.0,
            0.01,
        );
        assert_eq!(r.workers[0].ec2_state, None);
        let text = render(&r, 10.0);
        assert!(text.contains("EC2 not read (UnauthorizedOperation: no)"), "{text}");
        assert!(!text.contains("gone:"), "{text}");
        let row = text.lines().find(|l| l.contains("i-1")).expect("the worker's row");
        assert!(
            row.trim_end_matches(['│', ' ']).ends_with('?'),
            "EC2's state unknown: {row}"
        );
    }

    #[test]
    fn spot_requests_no_live_worker_holds_are_shown_with_when_the_reconciler_cancels_them() {
        let req = |id: &str, instance: Option<&str>, created_at: f64| SpotRequest {
            id: id.into(),
            instance_id: instance.map(str::to_string),
            created_at,
        };
        let live = vec!["i-live".to_string(), "i-stopped".to_string()];
        let now = 1_000.0;
        let unheld = unheld_spot_requests(
            vec![
                req("sir-live", Some("i-live"), 0.0),
                req("sir-stopped", Some("i-stopped"), 0.0),
                req("sir-young", None, now - 60.0),
                req("sir-open", None, now - 600.0),
                req("sir-other", Some("i-replacement"), now - 300.0),
            ],
            &live,
            now,
            180.0,
        );
        let ids: Vec<&str> = unheld.iter().map(|u| u.id.as_str()).collect();
        assert_eq!(
            ids,
            ["sir-open", "sir-other", "sir-young"],
            "oldest first, held ones left out"
        );
        assert_eq!(unheld[2].cancelled_in_s, 120.0);
        assert_eq!(unheld[0].cancelled_in_s, 0.0);
        let mut r = report(Vec::new(), Ok(Vec::new()), &[], Vec::new(), None, now, 0.01);
        r.unheld_spot_requests = unheld;
        let text = render(&r, now);
        assert!(
            text.contains("spot request sir-open (open, no instance, made 10m00s ago) is held by no worker"),
            "{text}"
        );
        assert!(text.contains("(instance i-replacement, made 5m00s ago)"), "{text}");
        assert!(text.contains("at its first run in 2m00s"), "{text}");
        assert!(text.contains("at its next run"), "{text}");
        r.spot_requests_error = Some("UnauthorizedOperation: no".into());
        assert!(render(&r, now).contains("EC2 spot requests not read (UnauthorizedOperation: no)"));
    }
}
