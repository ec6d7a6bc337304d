//! Create the resources `template.yaml` declares (a queue and dead-letter queue per lane, the
//! submission queue and its dead-letter queue, the functions' failed-events queue, the jobs, workers and control tables, the bucket, the
//! workers' launch template) through the SDK,
//! for a local emulator (`onoff local`) where `sam deploy` cannot run. Same key schemas, redrive
//! policy and launch template settings as the template; names get a prefix so several runs can
//! share one emulator.

use aws_sdk_dynamodb::types::{AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType};
use aws_sdk_sqs::types::QueueAttributeName;

use crate::settings::{Clients, Resources};

/// What to create.
#[derive(Debug, Clone, PartialEq)]
pub struct ProvisionOptions {
    /// Prefix of every name (`<prefix>-jobs`, `<prefix>-standard`, ...).
    pub prefix: String,
    /// Lanes; one queue and dead-letter queue each.
    pub lanes: Vec<String>,
    /// Receives of one message before SQS moves it to the dead-letter queue (template: 5).
    pub max_receive_count: u32,
    /// Default visibility timeout of the lane queues, seconds (template: 900).
    pub visibility_timeout_s: u32,
    /// Visibility timeout of the submission queue, seconds (template: 360, six times the submit
    /// function's timeout): how long a batch Lambda's SQS event source received stays hidden,
    /// and so when a record the function reported failed comes back.
    pub submission_visibility_timeout_s: u32,
    /// The workers' subnets (template: `WorkerSubnets`): the default subnet of each of these
    /// zones, as a user gives a subnet in some zones of a region and not all; empty: every
    /// zone's.
    pub zones: Vec<String>,
}

/// A failure to create a resource, naming it.
#[derive(Debug, thiserror::Error)]
#[error("create {what}: {message}")]
pub struct ProvisionError {
    /// The resource.
    pub what: String,
    /// The provider's message.
    pub message: String,
}

fn perr(what: impl Into<String>, e: impl std::fmt::Display) -> ProvisionError {
    ProvisionError {
        what: what.into(),
        message: e.to_string(),
    }
}

/// Created resources: the [`Resources`] the functions and agents are configured with, and the
/// dead-letter queue URL of each lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Provisioned {
    /// Names as the functions read them from the environment.
    pub resources: Resources,
    /// `(lane, dead-letter queue URL)`.
    pub dead_letter_queues: Vec<(String, String)>,
    /// URLs of `<prefix>-submissions` (template.yaml `SubmissionQueue`, redriven after
    /// `max_receive_count` receives) and of its dead-letter queue `<prefix>-submissions-dlq`.
    pub submission_queue: (String, String),
    /// URL of `<prefix>-failed-events` (template.yaml `FailedEventsQueue`, 14 days): the
    /// functions' dead-letter queue, where Lambda sends the events a function failed on.
    pub failed_events_queue: String,
}

/// SQS's longest retention, seconds (14 days; SQS's default is 4 days). Every queue keeps
/// messages this long, as in template.yaml.
pub const MAX_RETENTION_S: u32 = 1_209_600;

/// Create the jobs table `name`: key `job_id`, the sparse [`crate::jobs::ACTIVE_INDEX`] on
/// `active_lane` / `job_id`, the [`crate::jobs::ARRIVALS_INDEX`] on `lane` / `created_at`, the
/// sparse [`crate::jobs::RUN_TIMES_INDEX`] on `run_lane` / `finished_at`, TTL on `expires_at` (as
/// template.yaml).
///
/// # Errors
/// [`ProvisionError`] naming the table.
pub async fn jobs_table(c: &Clients, name: &str) -> Result<(), ProvisionError> {
    use aws_sdk_dynamodb::types::{GlobalSecondaryIndex, Projection, ProjectionType, TimeToLiveSpecification};
    let attr = |a: &str| {
        AttributeDefinition::builder()
            .attribute_name(a)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(|e| perr(name, e))
    };
    let key = |a: &str, k: KeyType| {
        KeySchemaElement::builder()
            .attribute_name(a)
            .key_type(k)
            .build()
            .map_err(|e| perr(name, e))
    };
    let index = GlobalSecondaryIndex::builder()
        .index_name(crate::jobs::ACTIVE_INDEX)
        .key_schema(key("active_lane", KeyType::Hash)?)
        .key_schema(key("job_id", KeyType::Range)?)
        .projection(Projection::builder().projection_type(ProjectionType::All).build())
        .build()
        .map_err(|e| perr(name, e))?;
    let arrivals = GlobalSecondaryIndex::builder()
        .index_name(crate::jobs::ARRIVALS_INDEX)
        .key_schema(key("lane", KeyType::Hash)?)
        .key_schema(key("created_at", KeyType::Range)?)
        .projection(
            Projection::builder()
                .projection_type(ProjectionType::Include)
                .non_key_attributes("spec")
                .build(),
        )
        .build()
        .map_err(|e| perr(name, e))?;
    let run_times = GlobalSecondaryIndex::builder()
        .index_name(crate::jobs::RUN_TIMES_INDEX)
        .key_schema(key("run_lane", KeyType::Hash)?)
        .key_schema(key("finished_at", KeyType::Range)?)
        .projection(
            Projection::builder()
                .projection_type(ProjectionType::Include)
                .non_key_attributes("run_s")
                .build(),
        )
        .build()
        .map_err(|e| perr(name, e))?;
    let number = |a: &str| {
        AttributeDefinition::builder()
            .attribute_name(a)
            .attribute_type(ScalarAttributeType::N)
            .build()
            .map_err(|e| perr(name, e))
    };
    c.dynamodb
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(attr("job_id")?)
        .attribute_definitions(attr("active_lane")?)
        .attribute_definitions(attr("lane")?)
        .attribute_definitions(attr("run_lane")?)
        .attribute_definitions(number("created_at")?)
        .attribute_definitions(number("finished_at")?)
        .key_schema(key("job_id", KeyType::Hash)?)
        .global_secondary_indexes(index)
        .global_secondary_indexes(arrivals)
        .global_secondary_indexes(run_times)
        .send()
        .await
        .map_err(|e| perr(format!("table {name}"), aws_sdk_dynamodb::error::DisplayErrorContext(e)))?;
    c.dynamodb
        .update_time_to_live()
        .table_name(name)
        .time_to_live_specification(
            TimeToLiveSpecification::builder()
                .attribute_name("expires_at")
                .enabled(true)
                .build()
                .map_err(|e| perr(name, e))?,
        )
        .send()
        .await
        .map_err(|e| {
            perr(
                format!("TTL of {name}"),
                aws_sdk_dynamodb::error::DisplayErrorContext(e),
            )
        })?;
    Ok(())
}

async fn table(c: &Clients, name: &str, key: &str) -> Result<(), ProvisionError> {
    let attr = AttributeDefinition::builder()
        .attribute_name(key)
        .attribute_type(ScalarAttributeType::S)
        .build()
        .map_err(|e| perr(name, e))?;
    let schema = KeySchemaElement::builder()
        .attribute_name(key)
        .key_type(KeyType::Hash)
        .build()
        .map_err(|e| perr(name, e))?;
    c.dynamodb
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(attr)
        .key_schema(schema)
        .send()
        .await
        .map_err(|e| perr(format!("table {name}"), aws_sdk_dynamodb::error::DisplayErrorContext(e)))?;
    Ok(())
}

async fn queue(c: &Clients, name: &str, attrs: Vec<(QueueAttributeName, String)>) -> Result<String, ProvisionError> {
    let mut req = c.sqs.create_queue().queue_name(name);
    for (k, v) in attrs {
        req = req.attributes(k, v);
    }
    let out = req
        .send()
        .await
        .map_err(|e| perr(format!("queue {name}"), aws_sdk_sqs::error::DisplayErrorContext(e)))?;
    out.queue_url()
        .map(str::to_string)
        .ok_or_else(|| perr(format!("queue {name}"), "no queue URL returned"))
}

/// Create queue `name` and its dead-letter queue `<name>-dlq`, as template.yaml's lane queues:
/// SQS moves a message to the dead-letter queue on its receive after `max_receive_count`
/// receives; both keep messages 14 days ([`MAX_RETENTION_S`]); a received message is hidden for
/// `visibility_timeout_s`. Returns (queue URL, dead-letter queue URL).
///
/// # Errors
/// The first queue call that failed.
pub async fn queue_with_dlq(
    c: &Clients,
    name: &str,
    max_receive_count: u32,
    visibility_timeout_s: u32,
) -> Result<(String, String), ProvisionError> {
    let retention = (QueueAttributeName::MessageRetentionPeriod, MAX_RETENTION_S.to_string());
    let dlq = queue(c, &format!("{name}-dlq"), vec![retention.clone()]).await?;
    let arn = c
        .sqs
        .get_queue_attributes()
        .queue_url(&dlq)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| {
            perr(
                format!("{name} dead-letter queue"),
                aws_sdk_sqs::error::DisplayErrorContext(e),
            )
        })?
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .ok_or_else(|| perr(format!("{name} dead-letter queue"), "no ARN"))?;
    let redrive = serde_json::json!({
        "deadLetterTargetArn": arn,
        "maxReceiveCount": max_receive_count.to_string(),
    })
    .to_string();
    let url = queue(
        c,
        name,
        vec![
            (QueueAttributeName::VisibilityTimeout, visibility_timeout_s.to_string()),
            (QueueAttributeName::RedrivePolicy, redrive),
            retention,
        ],
    )
    .await?;
    Ok((url, dlq))
}

/// Create everything; returns the names. Not idempotent: run it once per prefix.
///
/// # Errors
/// The first resource that could not be created.
pub async fn provision(c: &Clients, opts: &ProvisionOptions) -> Result<Provisioned, ProvisionError> {
    let p = &opts.prefix;
    let mut queue_urls = Vec::new();
    let mut dead_letter_queues = Vec::new();
    for lane in &opts.lanes {
        let (url, dlq) = queue_with_dlq(
            c,
            &format!("{p}-{lane}"),
            opts.max_receive_count,
            opts.visibility_timeout_s,
        )
        .await?;
        queue_urls.push((lane.clone(), url));
        dead_letter_queues.push((lane.clone(), dlq));
    }
    let submission_queue = queue_with_dlq(
        c,
        &format!("{p}-submissions"),
        opts.max_receive_count,
        opts.submission_visibility_timeout_s,
    )
    .await?;
    let failed_events_queue = queue(
        c,
        &format!("{p}-failed-events"),
        vec![(QueueAttributeName::MessageRetentionPeriod, MAX_RETENTION_S.to_string())],
    )
    .await?;
    let (jobs, workers, control) = (format!("{p}-jobs"), format!("{p}-worker-rows"), format!("{p}-control"));
    jobs_table(c, &jobs).await?;
    table(c, &workers, crate::state::WORKER_KEY).await?;
    table(c, &control, "pk").await?;
    // Named as template.yaml names it (`<stack>-<account>-<region>`): the submit role's policy
    // names the bucket that way, and `onoff local` enforces the template's policies.
    let account = c
        .sts
        .get_caller_identity()
        .send()
        .await
        .map_err(|e| {
            perr(
                "bucket name (the account id)",
                aws_sdk_sts::error::DisplayErrorContext(e),
            )
        })?
        .account
        .unwrap_or_default();
    let region = c.s3.config().region().map(ToString::to_string).unwrap_or_default();
    let bucket = format!("{p}-{account}-{region}").to_lowercase();
    c.s3.create_bucket()
        .bucket(&bucket)
        .send()
        .await
        .map_err(|e| perr(format!("bucket {bucket}"), aws_sdk_s3::error::DisplayErrorContext(e)))?;
    // Versioning, as the template's bucket: submit reads the version an event names.
    c.s3.put_bucket_versioning()
        .bucket(&bucket)
        .versioning_configuration(
            aws_sdk_s3::types::VersioningConfiguration::builder()
                .status(aws_sdk_s3::types::BucketVersioningStatus::Enabled)
                .build(),
        )
        .send()
        .await
        .map_err(|e| {
            perr(
                format!("bucket {bucket} versioning"),
                aws_sdk_s3::error::DisplayErrorContext(e),
            )
        })?;
    let launch_template_name = format!("{p}-worker");
    let image = c
        .ec2
        .describe_images()
        .owners("amazon")
        .send()
        .await
        .map_err(|e| perr("launch template image", aws_sdk_ec2::error::DisplayErrorContext(e)))?
        .images()
        .first()
        .and_then(|i| i.image_id())
        .map(str::to_string)
        .ok_or_else(|| perr("launch template image", "the emulator lists no Amazon image"))?;
    let created = c
        .ec2
        .create_launch_template()
        .launch_template_name(&launch_template_name)
        .launch_template_data(
            aws_sdk_ec2::types::RequestLaunchTemplateData::builder()
                .image_id(image)
                .instance_initiated_shutdown_behavior(aws_sdk_ec2::types::ShutdownBehavior::Terminate)
                .metadata_options(
                    aws_sdk_ec2::types::LaunchTemplateInstanceMetadataOptionsRequest::builder()
                        .http_tokens(aws_sdk_ec2::types::LaunchTemplateHttpTokensState::Required)
                        .http_put_response_hop_limit(2)
                        .build(),
                )
                .build(),
        )
        .send()
        .await
        .map_err(|e| {
            perr(
                format!("launch template {launch_template_name}"),
                aws_sdk_ec2::error::DisplayErrorContext(e),
            )
        })?;
    // By id, as template.yaml sets ONOFF_LAUNCH_TEMPLATE: the reaper then lists only instances
    // EC2 tagged with it.
    let launch_template = created
        .launch_template()
        .and_then(|t| t.launch_template_id())
        .map(str::to_string)
        .ok_or_else(|| perr(format!("launch template {launch_template_name}"), "no id returned"))?;
    // Subnet ids only, as template.yaml gives them: the fleet looks their zones up.
    let subnets: Vec<(String, String)> = crate::fleet::Ec2Fleet::default_subnets(&c.ec2)
        .await
        .map_err(|e| perr("subnets", e))?
        .into_iter()
        .filter(|(zone, _)| opts.zones.is_empty() || opts.zones.contains(zone))
        .map(|(_, id)| (String::new(), id))
        .collect();
    if subnets.is_empty() {
        return Err(perr(
            "subnets",
            format!("no default subnet in {}", opts.zones.join(", ")),
        ));
    }
    Ok(Provisioned {
        resources: Resources {
            queue_urls,
            jobs_table: jobs,
            workers_table: workers,
            control_table: control,
            bucket,
            launch_template,
            subnets,
            // The emulator's default security group serves (moto checks none).
            security_group: None,
            instance_arn_prefix: format!("arn:aws:ec2:{region}:{account}:instance/"),
        },
        dead_letter_queues,
        submission_queue,
        failed_events_queue,
    })
}
