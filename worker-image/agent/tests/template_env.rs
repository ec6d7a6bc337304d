//! The agent's environment as template.yaml's user data writes it (`/etc/onoff/agent.env`): every
//! variable it sets is one the agent reads and worker-image/README.md documents (a misspelt name
//! would be ignored on every worker, its default silently in force), and the values, with the
//! stack's references filled in, parse as the agent parses them at start.

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
            _ => "gpu-resource",
        });
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The string literals of the files that read the agent's settings.
fn sources() -> String {
    let mut text = String::new();
    for dir in ["worker-image/agent/src", "crates/aws/src"] {
        for e in std::fs::read_dir(repo().join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "rs") {
                text.push_str(&std::fs::read_to_string(p).unwrap());
            }
        }
    }
    text
}

#[test]
fn every_variable_the_user_data_sets_is_one_the_agent_reads_and_the_readme_documents() {
    let env = template_env();
    assert!(env.len() >= 10, "{env:?}");
    let code = sources();
    let readme = std::fs::read_to_string(repo().join("worker-image/README.md")).unwrap();
    for name in env.keys() {
        if name == "AWS_REGION" {
            continue;
        }
        assert!(
            code.contains(&format!("\"{name}\"")),
            "template.yaml sets {name}, which the agent never reads"
        );
        assert!(
            readme.contains(&format!("`{name}`")),
            "template.yaml sets {name}, which worker-image/README.md does not document"
        );
    }
}

#[test]
fn the_user_datas_values_parse_as_the_agent_parses_them() {
    let env: BTreeMap<String, String> = template_env().into_iter().map(|(k, v)| (k, resolve(&v))).collect();
    let get = |k: &str| env.get(k).cloned();
    let cfg = onoff_agent::AgentConfig::from_lookup(get).unwrap();
    assert_eq!(cfg.job_user, Some((10002, 10002)));
    assert_eq!((cfg.idle_timeout_s, cfg.gpus), (3900.0, Some(4)));
    assert_eq!(cfg.policy.scale_down.wait_value_usd_per_h, 1.0);
    assert_eq!(
        cfg.cache_gib,
        onoff_agent::cache::DEFAULT_CACHE_GIB,
        "the template leaves the cache bound"
    );
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
