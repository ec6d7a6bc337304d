//! Jobs as child processes: argv (no shell), stdout and stderr streamed line by line. Each job
//! runs in its own process group (its pid is the group id), and stop and kill go to the whole
//! group: SIGTERM to stop, SIGKILL to kill, so a job's helpers (a launcher's workers, a shell's
//! background commands) never outlive it. When the job's own process exits, whatever it left
//! running in its group is killed too, and so is the whole job if the agent drops its handle.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;

use crate::ports::{Control, JobCommand, JobEvent, JobExit, JobHandle, Launcher};

/// Starts jobs as processes, as the agent's user or, with `user`, as another (uid, gid); the
/// agent must then run as root (it sets the ids between fork and exec, dropping supplementary
/// groups).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessLauncher {
    /// The user jobs run as ([`crate::AgentConfig::job_user`]).
    pub user: Option<(u32, u32)>,
}

impl ProcessLauncher {
    /// Jobs run as `user` (uid, gid), if given.
    #[must_use]
    pub fn as_user(user: Option<(u32, u32)>) -> Self {
        Self { user }
    }
}

/// Whether this process can start jobs as another user: it runs as root.
#[must_use]
pub fn can_switch_user() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Hand `dir` and everything under it to `uid`:`gid` (the job's work dir, after the agent wrote
/// the resume data and input into it).
///
/// # Errors
/// A chown failed.
pub fn chown_tree(dir: &std::path::Path, uid: u32, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))?;
    if dir.is_dir() && !dir.is_symlink() {
        for entry in std::fs::read_dir(dir)? {
            chown_tree(&entry?.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// Give the job its AWS session through a `credential_process` (AWS SDKs and CLI Reference Guide,
/// "Sourcing credentials with an external process"): `<dir>/credentials.json` holds the
/// process output, `<dir>/config` names `cat` of it as the default profile's
/// `credential_process`. SDKs run the process again when the expiration nears, so rewriting the
/// file ([`write_job_credentials`] again) renews a running job's session. Both files are mode
/// 0600 and, with `user`, owned by the job's user. Returns the variables that point the job's
/// SDKs at them (`AWS_CONFIG_FILE`, and `AWS_SHARED_CREDENTIALS_FILE` at an empty file).
///
/// # Errors
/// The files could not be written.
pub fn write_job_credentials(
    dir: &std::path::Path,
    creds: &crate::ports::JobCredentials,
    user: Option<(u32, u32)>,
) -> std::io::Result<Vec<(String, String)>> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir)?;
    let write = |name: &str, text: &str| -> std::io::Result<std::path::PathBuf> {
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&tmp, Some(uid), Some(gid))?;
        }
        // Atomic: a job's SDK reading the file never sees half of it.
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    };
    let creds_path = write("credentials.json", &creds.process_json())?;
    let config = format!("[default]\ncredential_process = cat {}\n", creds_path.display());
    let config_path = write("config", &config)?;
    let empty = write("credentials", "")?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
    }
    Ok(vec![
        ("AWS_CONFIG_FILE".into(), config_path.display().to_string()),
        ("AWS_SHARED_CREDENTIALS_FILE".into(), empty.display().to_string()),
        ("AWS_SDK_LOAD_CONFIG".into(), "1".into()),
    ])
}

/// Prefixes of the agent's variables a job does not inherit: the agent's settings (`ONOFF_*`:
/// tables, queues, its role's names; a job gets its own `ONOFF_*` variables) and AWS's
/// (`AWS_ACCESS_KEY_ID`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`, `AWS_CONTAINER_CREDENTIALS_*`,
/// `AWS_EC2_METADATA_SERVICE_ENDPOINT`, ...: whatever would lead an SDK to the agent's
/// credentials), except [`JOB_ENV_AWS_KEPT`]. A job's AWS credentials are its own session's
/// ([`crate::ports::Objects::job_session`]).
pub const JOB_ENV_WITHHELD_PREFIXES: &[&str] = &["ONOFF_", "AWS_"];

/// `AWS_*` variables a job does inherit: the region, and an endpoint override (local emulators;
/// on AWS it is unset). They carry no credentials.
pub const JOB_ENV_AWS_KEPT: &[&str] = &["AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"];

/// Whether a job inherits the agent's variable `name`: every one but [`JOB_ENV_WITHHELD_PREFIXES`]
/// (less [`JOB_ENV_AWS_KEPT`]). So what the image sets (`ENV` of the worker image or of one
/// built `FROM` it: `PATH`, `PYTHONUNBUFFERED`, `PYTHONPATH`, `HF_HOME`, `NVIDIA_*`, ...) reaches
/// the job, as it would reach a process the container ran itself.
pub fn job_inherits(name: &str) -> bool {
    JOB_ENV_AWS_KEPT.contains(&name) || !JOB_ENV_WITHHELD_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The job's environment, each name once, later entries winning: `defaults` (what the agent
/// offers unless the image sets it: [`crate::cache::CACHE_ENV_DEFAULTS`]), the inherited part of `agent_env`
/// ([`job_inherits`]), `AWS_EC2_METADATA_DISABLED=true` (SDKs in the job do not look for
/// credentials or a region in the instance metadata), then the job's own `vars`.
pub fn job_env(
    agent_env: impl IntoIterator<Item = (String, String)>,
    defaults: &[(String, String)],
    vars: &[(String, String)],
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = defaults.to_vec();
    env.extend(agent_env.into_iter().filter(|(k, _)| job_inherits(k)));
    env.push(("AWS_EC2_METADATA_DISABLED".into(), "true".into()));
    env.extend(vars.iter().cloned());
    // Each name once, at its last value (as `Command::envs` would leave it).
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<(String, String)> = env.into_iter().rev().filter(|(k, _)| seen.insert(k.clone())).collect();
    out.reverse();
    out
}

/// Where POSIX shared memory lives: `shm_open`, Python's `multiprocessing` queues and
/// `shared_memory`, the tensors PyTorch's DataLoader workers (`num_workers > 0`) hand their
/// parent, NCCL's buffers between GPUs of one instance. A tmpfs: it takes memory only as it fills.
pub const SHM_DIR: &str = "/dev/shm";

/// Size of [`SHM_DIR`] under which the agent warns when it starts: 1 GiB, bytes. Docker gives a
/// container 64 MiB of it unless `docker run --shm-size` says otherwise (Docker's reference,
/// "docker container run": `--shm-size`, "If you omit the size entirely, the system uses
/// `64m`"), and a DataLoader passing batches of a few tens of MB through it fails with "No space
/// left on device" or a bus error. template.yaml's user data gives the agent's container half
/// of the instance's memory, as a Linux host sizes its own `/dev/shm`.
pub const SHM_WARN_BYTES: u64 = 1 << 30;

/// Size of the filesystem holding `path`, bytes (`statvfs`: `f_blocks` × `f_frsize`); `None` when
/// it cannot be read.
pub fn fs_size_bytes(path: &std::path::Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    Some(s.blocks().saturating_mul(s.fragment_size()))
}

/// The warning the agent logs at start for a `/dev/shm` of `bytes`, if it is under
/// [`SHM_WARN_BYTES`] (or could not be read: `None`).
pub fn shm_warning(bytes: Option<u64>) -> Option<String> {
    let advice = "jobs that share memory between processes (PyTorch DataLoader workers, NCCL \
                  within an instance) may fail with \"No space left on device\" or a bus error: \
                  run the agent's container with --shm-size (template.yaml's user data gives it \
                  half of the instance's memory)";
    match bytes {
        Some(b) if b >= SHM_WARN_BYTES => None,
        Some(b) => Some(format!("{SHM_DIR} holds only {} MiB: {advice}", b >> 20)),
        None => Some(format!("{SHM_DIR} could not be read: {advice}")),
    }
}

/// Soft limit on open files under which the agent warns when it starts: 4096. A job inherits
/// the agent's limits. Docker 25 and later give a container systemd's 1024 soft limit
/// (moby/moby#45534, containerd/containerd#8924) unless the daemon or `docker run --ulimit`
/// sets one; PyTorch's DataLoader workers pass each shared tensor as a file descriptor, and at
/// 1024 fail with "Too many open files". template.yaml's user data sets 32768 (soft) and 65536
/// (hard), what Amazon Linux 2's Docker package gives every container
/// (`--default-ulimit nofile=32768:65536` in its `/etc/sysconfig/docker`), so a worker's jobs find
/// the same on any AMI.
pub const NOFILE_WARN: u64 = 4096;

/// This process's limits on open files, (soft, hard) (`getrlimit(RLIMIT_NOFILE)`; unlimited is
/// `u64::MAX`); `None` when they cannot be read.
pub fn nofile_limits() -> Option<(u64, u64)> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).ok()
}

/// The warning the agent logs at start for open-file limits `limits` (soft, hard), if the soft
/// one is under [`NOFILE_WARN`] (or they could not be read: `None`).
pub fn nofile_warning(limits: Option<(u64, u64)>) -> Option<String> {
    let advice = "jobs that open many files or pass many tensors between processes (PyTorch \
                  DataLoader workers) may fail with \"Too many open files\": run the agent's \
                  container with --ulimit nofile=32768:65536 (template.yaml's user data does)";
    match limits {
        Some((soft, _)) if soft >= NOFILE_WARN => None,
        Some((soft, hard)) => Some(format!("open files are limited to {soft} (hard {hard}): {advice}")),
        None => Some(format!("the open-file limit could not be read: {advice}")),
    }
}

fn forward<R: AsyncRead + Unpin + Send + 'static>(r: R, tx: mpsc::Sender<JobEvent>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            if tx.send(JobEvent::Line(l)).await.is_err() {
                break;
            }
        }
    })
}

/// A job's process group; SIGKILLs the whole group when dropped (the agent dropped the job, or
/// the job's own process exited and left something behind).
#[derive(Debug)]
struct Group(Option<Pid>);

impl Group {
    fn signal(&self, sig: Signal) {
        if let Some(pgid) = self.0 {
            // ESRCH once every member is gone: nothing to do.
            let _ = killpg(pgid, sig);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.signal(Signal::SIGKILL);
    }
}

impl Launcher for ProcessLauncher {
    fn start(&self, cmd: &JobCommand) -> Result<JobHandle, String> {
        let (program, args) = cmd.argv.split_first().ok_or("empty command")?;
        let mut command = tokio::process::Command::new(program);
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        let mut child = command
            .args(args)
            .env_clear()
            .envs(job_env(std::env::vars(), &cmd.defaults, &cmd.env))
            .current_dir(&cmd.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, led by the job's process: signals reach every process
            // the job started, and a terminal's Ctrl-C to the agent does not reach the job.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {program:?}: {e}"))?;
        let group = Group(child.id().and_then(|p| i32::try_from(p).ok()).map(Pid::from_raw));
        let (etx, events) = mpsc::channel(256);
        let (control, mut crx) = mpsc::channel(4);
        let readers = [
            child.stdout.take().map(|o| forward(o, etx.clone())),
            child.stderr.take().map(|e| forward(e, etx.clone())),
        ];
        tokio::spawn(async move {
            let mut killed = false;
            let status = loop {
                tokio::select! {
                    st = child.wait() => break st,
                    c = crx.recv(), if !killed => match c {
                        Some(Control::Stop) => group.signal(Signal::SIGTERM),
                        // Killed, or the handle dropped: nobody watches the job any more.
                        Some(Control::Kill) | None => {
                            group.signal(Signal::SIGKILL);
                            let _ = child.start_kill();
                            killed = true;
                        }
                    },
                }
            };
            // The job is over: nothing it started may run on (and hold a GPU) into the next job.
            drop(group);
            // Output before the exit; pipes still open (a grandchild that left the group) do not
            // hold us up.
            for r in readers.into_iter().flatten() {
                let _ = tokio::time::timeout(Duration::from_secs(2), r).await;
            }
            let exit = match status {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    match (s.code(), s.signal()) {
                        (Some(c), _) => JobExit::Code(c),
                        (None, Some(n)) => JobExit::Signal(n),
                        (None, None) => JobExit::Unknown,
                    }
                }
                Err(_) => JobExit::Unknown,
            };
            let _ = etx.send(JobEvent::Exited(exit)).await;
        });
        Ok(JobHandle { events, control })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_inherits_no_credentials_and_no_settings_of_the_agent() {
        let agent = [
            ("PATH", "/usr/bin"),
            ("AWS_ACCESS_KEY_ID", "AKIAAGENT"),
            ("AWS_SECRET_ACCESS_KEY", "agent-secret"),
            ("AWS_SESSION_TOKEN", "agent-token"),
            ("AWS_PROFILE", "agent"),
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1:2"),
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:1"),
            ("ONOFF_JOBS_TABLE", "jobs"),
            ("AWS_REGION", "us-east-1"),
            ("NVIDIA_VISIBLE_DEVICES", "0"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let env = job_env(agent, &[], &[("AWS_ACCESS_KEY_ID".into(), "ASIAJOB".into())]);
        let get = |k: &str| {
            env.iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("AWS_ACCESS_KEY_ID"), ["ASIAJOB"], "only the job's own key");
        for withheld in [
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_PROFILE",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT",
            "ONOFF_JOBS_TABLE",
        ] {
            assert!(get(withheld).is_empty(), "{withheld} reached the job");
        }
        assert_eq!(get("AWS_EC2_METADATA_DISABLED"), ["true"]);
        assert_eq!(get("PATH"), ["/usr/bin"]);
        assert_eq!(get("AWS_REGION"), ["us-east-1"]);
        assert_eq!(get("NVIDIA_VISIBLE_DEVICES"), ["0"]);
    }

    #[test]
    fn a_job_inherits_what_the_image_sets_and_the_image_wins_over_the_agents_defaults() {
        // The worker image's ENV and a derived image's (PYTHONPATH, HF_HOME, a variable of the
        // user's own) reach the job; an image's XDG_CACHE_HOME wins over the agent's default,
        // and the job's own variables over both.
        let agent = [
            ("PYTHONUNBUFFERED", "1"),
            ("PYTHONPATH", "/app"),
            ("HF_HOME", "/models"),
            ("MODEL_NAME", "llama"),
            ("XDG_CACHE_HOME", "/image-cache"),
            ("ONOFF_WORK_DIR", "/var/lib/onoff"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let defaults = [
            ("XDG_CACHE_HOME".to_string(), "/var/lib/onoff/cache/p-a".to_string()),
            ("TORCH_HOME".to_string(), "/default-torch".to_string()),
        ];
        let vars = [("HF_HOME".to_string(), "/job-models".to_string())];
        let env: std::collections::BTreeMap<_, _> = job_env(agent.clone(), &defaults, &vars).into_iter().collect();
        assert_eq!(env.len(), job_env(agent, &defaults, &vars).len(), "each name once");
        assert_eq!(env["PYTHONUNBUFFERED"], "1");
        assert_eq!(env["PYTHONPATH"], "/app");
        assert_eq!(env["MODEL_NAME"], "llama");
        assert_eq!(env["XDG_CACHE_HOME"], "/image-cache", "the image's own wins");
        assert_eq!(env["TORCH_HOME"], "/default-torch", "a default the image leaves stays");
        assert_eq!(env["HF_HOME"], "/job-models", "the job's own wins");
        assert!(!env.contains_key("ONOFF_WORK_DIR"));
    }

    #[test]
    fn a_containers_default_shm_is_warned_of_and_half_of_an_instances_memory_is_not() {
        // Docker's default, 64 MiB: warned of, with the size and the remedy.
        let w = shm_warning(Some(64 << 20)).expect("64 MiB is warned of");
        assert!(w.contains("64 MiB") && w.contains("--shm-size"), "{w}");
        assert!(shm_warning(None).is_some(), "an unreadable /dev/shm is warned of");
        // Half of the smallest GPU instance's memory (g4dn.xlarge, 16 GiB) is not.
        assert_eq!(shm_warning(Some(8 << 30)), None);
        assert_eq!(shm_warning(Some(SHM_WARN_BYTES)), None);
        // This machine's /dev/shm is read as a size, not as free space.
        let size = fs_size_bytes(std::path::Path::new(SHM_DIR)).expect("/dev/shm is readable here");
        assert!(size > 0);
    }

    #[test]
    fn a_containers_default_open_file_limit_is_warned_of_and_the_templates_is_not() {
        // Docker 25+'s default for a container: warned of, with the limits and the remedy.
        let w = nofile_warning(Some((1024, 524_288))).expect("1024 is warned of");
        assert!(
            w.contains("1024") && w.contains("524288") && w.contains("--ulimit"),
            "{w}"
        );
        assert!(nofile_warning(None).is_some(), "unreadable limits are warned of");
        // What the template's user data sets, and unlimited, are not.
        assert_eq!(nofile_warning(Some((32_768, 65_536))), None);
        assert_eq!(nofile_warning(Some((NOFILE_WARN, NOFILE_WARN))), None);
        assert_eq!(nofile_warning(Some((u64::MAX, u64::MAX))), None);
        // This process's are read, soft within hard.
        let (soft, hard) = nofile_limits().expect("readable here");
        assert!(0 < soft && soft <= hard, "{soft} {hard}");
    }

    #[tokio::test]
    async fn a_job_process_does_not_see_the_agents_credentials() {
        // The variables are set in this (the agent's) process: the job must not see its secret
        // or its settings, and must see what an image's ENV would set, unless the job's own
        // default gives way to it.
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "agent-secret-for-the-test");
        std::env::set_var("ONOFF_SETTING_FOR_THE_TEST", "agent-setting");
        std::env::set_var("IMAGE_VAR_FOR_THE_TEST", "from-the-image");
        let h = ProcessLauncher::default()
            .start(&JobCommand {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    "echo secret=${AWS_SECRET_ACCESS_KEY:-none} setting=${ONOFF_SETTING_FOR_THE_TEST:-none} \
                     image=${IMAGE_VAR_FOR_THE_TEST:-none} default=${DEFAULT_FOR_THE_TEST:-none}"
                        .into(),
                ],
                env: vec![],
                defaults: vec![
                    ("IMAGE_VAR_FOR_THE_TEST".into(), "the-agents-default".into()),
                    ("DEFAULT_FOR_THE_TEST".into(), "the-agents-default".into()),
                ],
                cwd: std::env::temp_dir(),
            })
            .expect("starts");
        let (lines, code) = collect(h).await;
        assert_eq!(code, Some(0));
        assert_eq!(
            lines,
            ["secret=none setting=none image=from-the-image default=the-agents-default"]
        );
    }

    #[tokio::test]
    async fn a_job_a_signal_ends_reports_the_signal() {
        for (sig, n) in [("KILL", 9), ("BUS", 7)] {
            let mut h = ProcessLauncher::default()
                .start(&cmd(&["sh", "-c", &format!("kill -{sig} $$")]))
                .unwrap();
            let mut exit = None;
            while let Some(ev) = h.events.recv().await {
                if let JobEvent::Exited(e) = ev {
                    exit = Some(e);
                }
            }
            assert_eq!(exit, Some(JobExit::Signal(n)), "{sig}");
        }
    }

    #[test]
    fn job_credentials_are_a_private_credential_process_file() {
        let dir = std::env::temp_dir().join(format!("onoff-creds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let creds = crate::ports::JobCredentials {
            access_key_id: "ASIA1".into(),
            secret_access_key: "s".into(),
            session_token: "t".into(),
            expiration: "2030-01-01T00:00:00Z".into(),
            lifetime_s: 3600.0,
        };
        let vars = write_job_credentials(&dir, &creds, None).unwrap();
        let config = &vars.iter().find(|(k, _)| k == "AWS_CONFIG_FILE").unwrap().1;
        let text = std::fs::read_to_string(config).unwrap();
        assert!(text.starts_with("[default]\ncredential_process = cat "), "{text}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("credentials.json")).unwrap()).unwrap();
        assert_eq!(json["AccessKeyId"], "ASIA1");
        assert_eq!(json["Expiration"], "2030-01-01T00:00:00Z");
        use std::os::unix::fs::PermissionsExt;
        for f in ["credentials.json", "config"] {
            let mode = std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{f}");
        }
        // Rewritten in place: the newest session.
        let newer = crate::ports::JobCredentials {
            access_key_id: "ASIA2".into(),
            ..creds
        };
        write_job_credentials(&dir, &newer, None).unwrap();
        assert!(std::fs::read_to_string(dir.join("credentials.json"))
            .unwrap()
            .contains("ASIA2"));
        assert!(!format!("{newer:?}").contains("\"s\""), "Debug shows no secret");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_job_runs_as_its_own_user_when_the_agent_is_root() {
        if !can_switch_user() {
            eprintln!("not root: jobs cannot be started as another user here");
            return;
        }
        let h = ProcessLauncher::as_user(Some((10002, 10002)))
            .start(&cmd(&["sh", "-c", "echo $(id -u):$(id -g):$(id -G)"]))
            .unwrap();
        let (lines, code) = collect(h).await;
        assert_eq!(code, Some(0));
        assert_eq!(lines, ["10002:10002:10002"], "no supplementary group of the agent's");
    }

    async fn collect(mut h: JobHandle) -> (Vec<String>, Option<i32>) {
        let mut lines = Vec::new();
        while let Some(ev) = h.events.recv().await {
            match ev {
                JobEvent::Line(l) => lines.push(l),
                JobEvent::Exited(c) => return (lines, c.code()),
            }
        }
        panic!("no exit event")
    }

    fn cmd(argv: &[&str]) -> JobCommand {
        JobCommand {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: vec![("ONOFF_JOB_ID".into(), "job-1".into())],
            defaults: vec![],
            cwd: std::env::temp_dir(),
        }
    }

    #[tokio::test]
    async fn streams_lines_and_exit_code_without_a_shell() {
        let h = ProcessLauncher::default()
            .start(&cmd(&[
                "sh",
                "-c",
                "echo ONOFF_ITEMS 3; echo $ONOFF_JOB_ID >&2; exit 7",
            ]))
            .unwrap();
        let (lines, code) = collect(h).await;
        assert_eq!(code, Some(7));
        assert!(lines.contains(&"ONOFF_ITEMS 3".to_string()) && lines.contains(&"job-1".to_string()));
        // argv is not a shell string: `;` is an argument of echo.
        let (lines, code) = collect(
            ProcessLauncher::default()
                .start(&cmd(&["echo", "a;", "exit", "3"]))
                .unwrap(),
        )
        .await;
        assert_eq!((lines, code), (vec!["a; exit 3".to_string()], Some(0)));
        let err = ProcessLauncher::default()
            .start(&cmd(&["/nonexistent/program"]))
            .unwrap_err();
        assert!(err.contains("/nonexistent/program"), "{err}");
    }

    #[tokio::test]
    async fn stop_sends_sigterm_and_kill_kills() {
        let h = ProcessLauncher::default()
            .start(&cmd(&[
                "sh",
                "-c",
                "trap 'echo stopping; exit 143' TERM; echo up; while true; do sleep 0.05; done",
            ]))
            .unwrap();
        let mut h = h;
        assert_eq!(h.events.recv().await, Some(JobEvent::Line("up".into())));
        h.control.send(Control::Stop).await.unwrap();
        let (lines, code) = collect(h).await;
        // SIGTERM goes to the whole group: the loop's `sleep` gets it too, and the shell may
        // report it ("Terminated") before its trap runs.
        assert_eq!(
            (lines.last().map(String::as_str), code),
            (Some("stopping"), Some(143)),
            "{lines:?}"
        );
        let h = ProcessLauncher::default().start(&cmd(&["sleep", "30"])).unwrap();
        h.control.send(Control::Kill).await.unwrap();
        let (_, code) = collect(h).await;
        assert_eq!(code, None, "killed by a signal");
    }

    /// Whether `pid` still runs: absent from /proc, or a zombie waiting for its reaper, is gone.
    fn running(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // `pid (comm) S ...`: the state follows the last `)`.
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .is_some_and(|s| s != 'Z' && s != 'X'),
            Err(_) => false,
        }
    }

    async fn gone(pid: i32) -> bool {
        for _ in 0..100 {
            if !running(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Start `script` under `sh -c`; it prints the pid of a background `sleep` first.
    /// (Whether that still runs is for the caller: a script that exits at once takes it along.)
    async fn with_grandchild(script: &str) -> (JobHandle, i32) {
        let mut h = ProcessLauncher::default().start(&cmd(&["sh", "-c", script])).unwrap();
        let Some(JobEvent::Line(l)) = h.events.recv().await else {
            panic!("no pid line")
        };
        (h, l.trim().parse().unwrap())
    }

    #[tokio::test]
    async fn kill_and_stop_reach_the_whole_process_group() {
        // Kill: the shell and the sleep it started both go.
        let (h, pid) = with_grandchild("sleep 1000 & echo $!; wait").await;
        assert!(running(pid), "the grandchild {pid} runs");
        h.control.send(Control::Kill).await.unwrap();
        let (_, code) = collect(h).await;
        assert_eq!(code, None);
        assert!(gone(pid).await, "the grandchild {pid} outlived the kill");
        // Stop: SIGTERM reaches the grandchild too.
        let (h, pid) = with_grandchild("sleep 1000 & echo $!; wait").await;
        assert!(running(pid), "the grandchild {pid} runs");
        h.control.send(Control::Stop).await.unwrap();
        let _ = collect(h).await;
        assert!(gone(pid).await, "the grandchild {pid} outlived the stop");
        // A job that exits and leaves something running: it is killed with the job.
        let (h, pid) = with_grandchild("sleep 1000 & echo $!; exit 0").await;
        let (_, code) = collect(h).await;
        assert_eq!(code, Some(0));
        assert!(gone(pid).await, "the grandchild {pid} outlived its job");
        // Dropping the job (the agent going away) takes the group with it.
        let (h, pid) = with_grandchild("sleep 1000 & echo $!; wait").await;
        assert!(running(pid), "the grandchild {pid} runs");
        drop(h);
        assert!(gone(pid).await, "the grandchild {pid} outlived the dropped job");
    }
}
