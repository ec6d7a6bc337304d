//! `onoff-agent`: the worker agent's entrypoint (`run`, the default) and the image's health check
//! (`health`). Settings come from the environment: see `worker-image/README.md`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use onoff_agent::aws::{DynamoRegistry, Ec2Instance, Imds, S3Objects, SqsInbox};
use onoff_agent::process::ProcessLauncher;
use onoff_agent::{AgentConfig, Deps};

#[derive(Parser)]
#[command(
    name = "onoff-agent",
    version,
    about = "onoff worker agent: claims jobs from the lane queues, runs them, checkpoints to S3, reacts to spot notices, terminates its instance when idle."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent until idle timeout, a notice, or SIGTERM (the default).
    Run,
    /// Exit 0 when the running agent wrote its health file within three heartbeats, 1 otherwise.
    Health,
}

fn need(name: &str) -> Result<String, String> {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| format!("environment variable {name} is not set"))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The agent's resources from the environment: (queue settings, jobs table, workers table,
/// bucket).
fn resources(cfg: &AgentConfig) -> Result<(onoff_aws::settings::Resources, String, String, String), String> {
    if cfg.job_user.is_some() && !onoff_agent::process::can_switch_user() {
        return Err(
            "ONOFF_JOB_UID is set, but the agent does not run as root and cannot start jobs as another user \
             (run its container with --user 0:0 and the capabilities template.yaml's user data gives it, \
             or unset ONOFF_JOB_UID)"
                .into(),
        );
    }
    let queue_urls = onoff_aws::settings::Resources::from_lookup(|k| match k {
        // Only the queues, tables and bucket matter to the agent; the rest is the control plane's.
        "ONOFF_CONTROL_TABLE" | "ONOFF_LAUNCH_TEMPLATE" => Some("-".into()),
        _ => std::env::var(k).ok(),
    })
    .map_err(|e| e.to_string())?;
    Ok((
        queue_urls,
        need("ONOFF_JOBS_TABLE")?,
        need("ONOFF_WORKERS_TABLE")?,
        need("ONOFF_BUCKET")?,
    ))
}

async fn run(cfg: AgentConfig) -> Result<(), String> {
    let clients = onoff_aws::settings::Clients::from_env().await;
    let imds_endpoint = std::env::var("AWS_EC2_METADATA_SERVICE_ENDPOINT").ok();
    let metadata = Imds::new(imds_endpoint.as_deref())?;
    let instance = Ec2Instance {
        client: clients.ec2.clone(),
        mode: cfg.shutdown,
        deployment: cfg.deployment.clone(),
    };
    let (queue_urls, jobs_table, workers_table, bucket) = match resources(&cfg) {
        Ok(r) => r,
        Err(e) => {
            // A setting wrong on every instance: the instance powers off after this exit, and
            // with its persistent spot request open EC2 would launch another to fail the same way.
            if let Ok(me) = onoff_agent::ports::Metadata::identity(&metadata).await {
                onoff_agent::agent::release_request_on_exit(&instance, &me.instance_id, &e).await;
            }
            return Err(e);
        }
    };
    let deps = Deps {
        metadata,
        inbox: SqsInbox(onoff_aws::queue::SqsQueues::new(
            clients.sqs.clone(),
            queue_urls.queue_urls,
        )),
        jobs: onoff_aws::jobs::DynamoJobs::new(clients.dynamodb.clone(), jobs_table),
        registry: DynamoRegistry(onoff_aws::state::DynamoWorkers::new(
            clients.dynamodb.clone(),
            workers_table,
            queue_urls.instance_arn_prefix.clone(),
        )),
        checkpoints: onoff_aws::checkpoints::S3Checkpoints::new(clients.s3.clone(), bucket.clone()),
        objects: S3Objects {
            s3: clients.s3.clone(),
            sts: clients.sts.clone(),
            job_role_arn: std::env::var("ONOFF_JOB_ROLE_ARN").ok().filter(|s| !s.is_empty()),
            bucket: bucket.clone(),
            logs: std::env::var("ONOFF_LOG_GROUP")
                .ok()
                .filter(|s| !s.is_empty())
                .map(|g| (clients.logs.clone(), g)),
            streams: std::sync::Arc::default(),
        },
        instance,
        launcher: ProcessLauncher::as_user(cfg.job_user),
    };
    let report = onoff_agent::run(&deps, &cfg, onoff_aws::state::unix_now(), shutdown_signal())
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(
        exit = ?report.exit,
        jobs = report.jobs.len(),
        dropped = report.dropped,
        poison = report.poison,
        "agent stopped"
    );
    Ok(())
}

fn health(cfg: &AgentConfig) -> Result<(), String> {
    let path = cfg.health_file();
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let at = v["at"].as_f64().ok_or_else(|| format!("{}: no `at`", path.display()))?;
    let age = onoff_aws::state::unix_now() - at;
    if age > 3.0 * cfg.heartbeat_s {
        return Err(format!(
            "last heartbeat {age:.0} s ago (limit {:.0} s)",
            3.0 * cfg.heartbeat_s
        ));
    }
    println!("healthy: {} {} ({age:.0} s ago)", v["instance_id"], v["state"]);
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let cfg = match AgentConfig::from_lookup(|k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("onoff-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command.unwrap_or(Command::Run) {
        Command::Health => health(&cfg),
        Command::Run => {
            tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                // Colour only on a terminal: journald, CloudWatch Logs and files get plain text.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .init();
            match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => rt.block_on(run(cfg)),
                Err(e) => Err(format!("tokio runtime: {e}")),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("onoff-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
