//! The agent's environment as template.yaml's user data writes it (`/etc/onoff/agent.env`): the
//! values, with the stack's references filled in, parse as the agent parses them at start. That
//! the user data sets every variable the agent requires, and none it does not read, is
//! tests/tests/template.rs's `the_workers_user_data_sets_what_the_agent_requires_as_the_functions_have_it`.

use std::collections::BTreeMap;
use std::path::Path;

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The `NAME=value` lines of the user data's env file, and `ONOFF_GPUS` it appends on a GPU
/// instance, as written (CloudFormation references unresolved).
fn template_env() -> BTreeMap<String, String> {
    let template = std::fs::read_to_string(repo().join("template.yaml")).unwrap();
    let mut lines = template.lines().map(str::trim);
    lines
        .by_ref()
        .find(|l| l.starts_with("cat > /etc/onoff/agent.env <<'ENV'"))
        .expect("the user data writes /etc/onoff/agent.env");
    let mut env: BTreeMap<String, String> = lines
        .take_while(|l| *l != "ENV")
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("not NAME=value: {l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect();
    assert!(
        template.contains("echo \"ONOFF_GPUS=$GPUS\" >> /etc/onoff/agent.env"),
        "the user data appends ONOFF_GPUS"
    );
    env.insert("ONOFF_GPUS".into(), "4".into());
    env
}

/// `${Name}` and `${Name.Attr}` filled in as a deployed stack would.
fn resolve(v: &str) -> String {
    let mut out = String::new();
    let mut rest = v;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let end = rest[at..].find('}').expect("a closed reference") + at;
        let name = &rest[at + 2..end];
        out.push_str(match name {
            "AWS::Region" => "us-east-1",
            "AWS::AccountId" => "123456789012",
            "AWS::Partition" => "aws",
            "AWS::StackName" => "gpu",
            "ExpressQueue" => "https://sqs.us-east-1.amazonaws.com/123456789012/gpu-express",
            "StandardQueue" => "https://sqs.us-east-1.amazonaws.com/123456789012/gpu-standard",
            "JobRole.Arn" => "arn:aws:iam::123456789012:role/gpu-JobRole",
            "WorkerIdleTimeoutSeconds" => "3900",
            "WaitValueUsdPerHour" => "1",
            "WorkerCacheGiB" => "64",
            _ => "gpu-resource",
        });
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

#[test]
fn the_user_datas_values_parse_as_the_agent_parses_them() {
    let env: BTreeMap<String, String> = template_env().into_iter().map(|(k, v)| (k, resolve(&v))).collect();
    let get = |k: &str| env.get(k).cloned();
    let cfg = onoff_agent::AgentConfig::from_lookup(get).unwrap();
    assert_eq!(cfg.job_user, Some((10002, 10002)));
    assert_eq!((cfg.idle_timeout_s, cfg.gpus), (3900.0, Some(4)));
    assert_eq!(cfg.policy.scale_down.wait_value_usd_per_h, 1.0);
    assert_eq!(cfg.cache_gib, 64.0, "WorkerCacheGiB");
    // The parameter's default is the agent's own.
    let template = std::fs::read_to_string(repo().join("template.yaml")).unwrap();
    let default: f64 = template
        .lines()
        .skip_while(|l| *l != "  WorkerCacheGiB:")
        .find_map(|l| l.trim().strip_prefix("Default: "))
        .expect("WorkerCacheGiB has a default")
        .parse()
        .unwrap();
    assert_eq!(default, onoff_agent::cache::DEFAULT_CACHE_GIB);
    // The agent's resources, as its main reads them (the control table and launch template are
    // the control plane's only).
    let r = onoff_aws::settings::Resources::from_lookup(|k| match k {
        "ONOFF_CONTROL_TABLE" | "ONOFF_LAUNCH_TEMPLATE" => Some("-".into()),
        _ => get(k),
    })
    .unwrap();
    assert_eq!(r.queue_urls.len(), 2);
    assert_eq!(r.instance_arn_prefix, "arn:aws:ec2:us-east-1:123456789012:instance/");
}

/// The words of the `docker run` that starts the agent's container in `text` (a user data).
fn agent_docker_run(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("ExecStart=/usr/bin/docker run "))
        .expect("the agent's unit runs its container")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[test]
fn the_agents_container_gets_open_file_limits_the_agent_does_not_warn_of_in_both_user_datas() {
    for file in ["template.yaml", "worker-image/examples/user-data.sh"] {
        let words = agent_docker_run(&std::fs::read_to_string(repo().join(file)).unwrap());
        let limits = words
            .windows(2)
            .find(|w| w[0] == "--ulimit" && w[1].starts_with("nofile="))
            .map(|w| w[1]["nofile=".len()..].to_string())
            .unwrap_or_else(|| panic!("{file}: docker run sets no open-file limit: {words:?}"));
        let (soft, hard) = limits.split_once(':').expect("soft:hard");
        let (soft, hard): (u64, u64) = (soft.parse().unwrap(), hard.parse().unwrap());
        assert!(soft <= hard, "{file}: {limits}");
        assert_eq!(
            onoff_agent::process::nofile_warning(Some((soft, hard))),
            None,
            "{file}: {limits}"
        );
        assert!(words.iter().any(|w| w == "--shm-size"), "{file}: {words:?}");
    }
}
