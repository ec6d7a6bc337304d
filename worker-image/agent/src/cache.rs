//! What a worker keeps on its volume between jobs, and what it does not.
//!
//! - **Job work dirs** (`<ONOFF_WORK_DIR>/jobs/<job_id>`: checkpoints, resume data, input,
//!   outputs, the job's own files and its AWS session) are removed once the attempt is settled,
//!   and every one left over (an agent killed mid-job) when the agent starts
//!   ([`prepare_work_dir`]). Without that, a warm worker filled its volume a job at a time, and a
//!   stopped worker kept the lot through its stop: each start found less room, until every job on
//!   it failed with "No space left on device".
//! - **The project cache** (`<ONOFF_WORK_DIR>/cache/p-<project>`, [`JobCache`]) is what a job
//!   asks to keep: model weights, datasets, compiled kernels. The job gets its project's directory
//!   as `ONOFF_CACHE_DIR`, and the next job of the same project on this worker finds what it left
//!   there, also after the worker was stopped and started again (the directory is on the
//!   instance's EBS volume, which a stop keeps). Jobs re-downloading a model at every start is a
//!   complaint users of serverless GPU workers make (runpod-workers/worker-vllm#111).
//!
//! The cache is bounded: after each attempt, whole project directories are removed, least
//! recently used first, until the cache holds at most `ONOFF_CACHE_GIB` (default
//! [`DEFAULT_CACHE_GIB`]) and at most half of the room it could have (the volume's free space
//! plus what the cache holds: [`room_limit`]), so the jobs always keep at least as much free
//! space as the cache takes, whatever the AMI and the worker image leave of the volume. A project
//! whose own directory is over the limit on its own is emptied. Whole directories, never single
//! files, so a job never finds half of what it wrote (a model's index without its weights).
//!
//! Projects do not see each other's caches when jobs run as their own user (`ONOFF_JOB_UID`):
//! `cache/` is the agent's, mode 0711 (a job may pass through it, not list it); a project's
//! directory is the job's user's only while a job of that project runs, and the agent's, mode
//! 0700, otherwise. Without `ONOFF_JOB_UID` jobs run as the agent and nothing is kept from them.

use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Default bound of the project cache, GiB: 20 GiB holds a 7B-parameter model in 16-bit weights
/// (about 14 GiB) with room to spare. The stack's root volume is 100 GiB (`WorkerRootVolumeGiB`),
/// of which the AMI, the worker image and a job's own work dir (checkpoints, resume data, input,
/// outputs) take their share; [`room_limit`] keeps the cache to half of what they leave.
pub const DEFAULT_CACHE_GIB: f64 = 20.0;

/// What a job gets, unless the image sets it, to keep the caches of common GPU tooling in its
/// project's cache (`ONOFF_CACHE_DIR`) rather than under its `HOME`, which goes with the attempt:
/// (variable, subdirectory; empty: the project's directory itself).
///
/// - `XDG_CACHE_HOME`: pip's cache, Hugging Face's (`HF_HOME` defaults to
///   `$XDG_CACHE_HOME/huggingface`), torch hub's (`$XDG_CACHE_HOME/torch`), vLLM's.
/// - `TRITON_CACHE_DIR`: Triton's compiled kernels (default `~/.triton/cache`, not under XDG).
/// - `TORCHINDUCTOR_CACHE_DIR`: `torch.compile`'s (default `/tmp/torchinductor_<user>`, in the
///   container's own layer, gone with the container at a stop).
pub const CACHE_ENV_DEFAULTS: [(&str, &str); 3] = [
    ("XDG_CACHE_HOME", ""),
    ("TRITON_CACHE_DIR", "triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
];

/// [`CACHE_ENV_DEFAULTS`] for a project's cache directory `dir`.
pub fn cache_env_defaults(dir: &Path) -> Vec<(String, String)> {
    CACHE_ENV_DEFAULTS
        .iter()
        .map(|(k, sub)| {
            let path = if sub.is_empty() {
                dir.to_path_buf()
            } else {
                dir.join(sub)
            };
            (k.to_string(), path.display().to_string())
        })
        .collect()
}

/// Make the work dir ready for jobs when the agent starts: created if missing; with `job_user`
/// (jobs run as their own user, `ONOFF_JOB_UID`), opened to be passed through (mode 0711: a job
/// reaches its own work dir under it, and lists nothing of the agent's); the work dirs an earlier
/// agent left removed ([`clear_job_dirs`]). Returns how many there were.
///
/// Until 2026-12 the template's user data made `/var/lib/onoff` the agent user's with mode 0750
/// (it makes it 0711 now), and a stopped worker's volume keeps what it had. A job's process
/// changes into its work dir after it has become the job's user, so under a 0750 work dir of
/// another user every job failed to start with "Permission denied" (EACCES).
///
/// # Errors
/// The work dir could not be made or opened: no job could run, so the agent stops.
pub fn prepare_work_dir(work_dir: &Path, job_user: Option<(u32, u32)>) -> io::Result<usize> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(work_dir)?;
    if job_user.is_some() {
        std::fs::set_permissions(work_dir, std::fs::Permissions::from_mode(0o711))?;
    }
    let cleared = clear_job_dirs(work_dir).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "remove the work dirs an earlier agent left");
        0
    });
    if job_user.is_some() {
        let jobs = work_dir.join("jobs");
        std::fs::create_dir_all(&jobs)?;
        std::fs::set_permissions(&jobs, std::fs::Permissions::from_mode(0o711))?;
    }
    Ok(cleared)
}

/// Remove `<work_dir>/jobs` and everything under it: the work dirs of attempts that no agent
/// runs any more. Called when the agent starts, when no attempt of its own is under way. Returns
/// how many job dirs there were.
///
/// # Errors
/// A removal failed (the caller logs it and goes on: it costs room, not correctness).
pub fn clear_job_dirs(work_dir: &Path) -> io::Result<usize> {
    let jobs = work_dir.join("jobs");
    let n = match std::fs::read_dir(&jobs) {
        Ok(entries) => entries.count(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    std::fs::remove_dir_all(&jobs)?;
    Ok(n)
}

/// Remove one attempt's work dir, `<work_dir>/jobs/<job_id>`, once it is settled: nothing in it
/// is read again (its checkpoints and outputs are in S3, its log lines shipped).
///
/// # Errors
/// A removal failed; a dir that is not there is no error.
pub fn clear_job_dir(work_dir: &Path, job_id: &str) -> io::Result<()> {
    match std::fs::remove_dir_all(work_dir.join("jobs").join(job_id)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The per-project cache under `<work_dir>/cache` (module docs).
#[derive(Debug, Clone)]
pub struct JobCache {
    root: PathBuf,
    max_bytes: u64,
}

/// What a trim removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trimmed {
    /// The projects whose directories were removed, least recently used first.
    pub projects: Vec<String>,
    /// Bytes they held.
    pub bytes: u64,
    /// Bytes the cache holds after the trim.
    pub kept_bytes: u64,
    /// The limit it was trimmed to, bytes ([`room_limit`]).
    pub limit_bytes: u64,
    /// The projects whose directories the cache still holds with a byte or more in them, most
    /// recently used first: what the agent records in its worker's row
    /// ([`onoff_control::ports::WorkerRecord::cached_projects`]), so the policy starts this
    /// worker, once stopped, for their jobs first. An empty directory (a job that kept nothing)
    /// is not listed, nor one whose name is no project's
    /// ([`onoff_policy::config::is_plain_name`]).
    pub held: Vec<String>,
}

/// What the cache may hold, bytes: its bound, and at most half of the room it could have (the
/// volume's `free_bytes` plus the `cache_bytes` it holds), so jobs keep as much free space as the
/// cache takes. `free_bytes` unknown (the volume could not be read): the bound alone.
pub fn room_limit(max_bytes: u64, cache_bytes: u64, free_bytes: Option<u64>) -> u64 {
    free_bytes.map_or(max_bytes, |free| max_bytes.min(free.saturating_add(cache_bytes) / 2))
}

/// Free bytes of the volume holding `path`, for an unprivileged user (`f_bavail`).
fn free_bytes(path: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    Some(s.blocks_available().saturating_mul(s.fragment_size()))
}

impl JobCache {
    /// The cache under `work_dir`, bounded to `max_gib` GiB; `None` when `max_gib` is 0 (no
    /// cache: jobs get no `ONOFF_CACHE_DIR`).
    pub fn new(work_dir: &Path, max_gib: f64) -> Option<Self> {
        (max_gib > 0.0).then(|| Self {
            root: work_dir.join("cache"),
            max_bytes: (max_gib * f64::from(1u32 << 30)) as u64,
        })
    }

    /// Project `project`'s directory. A project name is 1-64 of `A-Z a-z 0-9 - _ .`
    /// (`JobSpec::parse`), so with its `p-` prefix it is never `.` or `..`.
    pub fn dir_of(&self, project: &str) -> PathBuf {
        self.root.join(format!("p-{project}"))
    }

    /// Bytes `project`'s directory holds (0 when it has none, or its files cannot be read).
    pub fn bytes_of(&self, project: &str) -> u64 {
        tree_bytes(&self.dir_of(project)).unwrap_or(0)
    }

    /// Make `project`'s directory ready for one of its jobs and return it: created if new,
    /// marked as used now (its modification time, which [`JobCache::trim`] orders by), and with
    /// `user`, handed to the job's user, files and all.
    ///
    /// # Errors
    /// The directory could not be made, or handed over.
    pub fn lend(&self, project: &str, user: Option<(u32, u32)>) -> io::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&self.root)?;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o711))?;
        let dir = self.dir_of(project);
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        std::fs::File::open(&dir)?.set_modified(SystemTime::now())?;
        if let Some((uid, gid)) = user {
            crate::process::chown_tree(&dir, uid, gid)?;
        }
        Ok(dir)
    }

    /// Take `project`'s directory back from the job's user once its attempt is settled: with
    /// `user`, the directory and its files become the agent's again, so the next job, of
    /// another project, cannot read them. (A chown leaves the directory's time of use as it is.)
    ///
    /// # Errors
    /// The hand-back failed; the caller then removes the directory, so no other project's job
    /// finds it readable.
    pub fn take_back(&self, project: &str, user: Option<(u32, u32)>) -> io::Result<()> {
        let dir = self.dir_of(project);
        if user.is_none() || !dir.exists() {
            return Ok(());
        }
        let me = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
        crate::process::chown_tree(&dir, me.0, me.1)
    }

    /// Take every project's directory back ([`JobCache::take_back`]): when the agent starts, so
    /// a directory an earlier agent lent and never took back (killed mid-job) is not left
    /// readable to the next job, of another project. Returns the projects it could not take
    /// back; their directories are removed.
    pub fn take_back_all(&self, user: Option<(u32, u32)>) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut failed = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(project) = name.strip_prefix("p-") else {
                continue;
            };
            if self.take_back(project, user).is_err() {
                let _ = std::fs::remove_dir_all(e.path());
                failed.push(project.to_string());
            }
        }
        failed
    }

    /// Remove whole project directories, least recently used first, until the cache holds at
    /// most its limit ([`room_limit`] of its bound and the volume's free space). A directory
    /// whose size the walk cannot read counts as over the limit, and is removed.
    ///
    /// # Errors
    /// The cache could not be listed; a removal that fails is skipped (it is retried at the next
    /// trim).
    pub fn trim(&self) -> io::Result<Trimmed> {
        self.trim_with(free_bytes(&self.root))
    }

    /// [`JobCache::trim`] with the volume's free bytes given (`None`: unknown).
    ///
    /// # Errors
    /// As [`JobCache::trim`].
    pub fn trim_with(&self, free_bytes: Option<u64>) -> io::Result<Trimmed> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Trimmed::default()),
            Err(e) => return Err(e),
        };
        let mut dirs: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
        for entry in entries {
            let path = entry?.path();
            let used = std::fs::symlink_metadata(&path)
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let bytes = tree_bytes(&path).unwrap_or(u64::MAX);
            dirs.push((used, bytes, path));
        }
        dirs.sort();
        let mut total: u64 = dirs.iter().map(|d| d.1).fold(0, u64::saturating_add);
        let mut out = Trimmed {
            limit_bytes: room_limit(self.max_bytes, total, free_bytes),
            ..Trimmed::default()
        };
        for (_, bytes, path) in dirs {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if total > out.limit_bytes {
                let removed = if path.is_dir() && !path.is_symlink() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                if removed.is_ok() {
                    total = total.saturating_sub(bytes);
                    out.bytes = out.bytes.saturating_add(bytes);
                    out.projects.push(name.strip_prefix("p-").unwrap_or(&name).to_string());
                    continue;
                }
            }
            let real_dir = path.is_dir() && !path.is_symlink();
            // Only a project's directory is listed: one named by a job running as the agent
            // (`p-` and up to 253 bytes of anything) is not a project's, and would grow the
            // worker's row by what it names.
            if let Some(project) = name
                .strip_prefix("p-")
                .filter(|p| bytes > 0 && real_dir && onoff_policy::config::is_plain_name(p))
            {
                out.held.push(project.to_string());
            }
        }
        // Oldest first so far.
        out.held.reverse();
        out.kept_bytes = total;
        Ok(out)
    }
}

/// Bytes of the files under `path` (symbolic links not followed, their own size counted).
fn tree_bytes(path: &Path) -> io::Result<u64> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.is_dir() {
        return Ok(meta.len());
    }
    let mut sum = 0u64;
    for entry in std::fs::read_dir(path)? {
        sum = sum.saturating_add(tree_bytes(&entry?.path())?);
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn write(path: &Path, bytes: usize) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, vec![0u8; bytes]).unwrap();
    }

    fn age(dir: &Path, secs_ago: u64) {
        let t = SystemTime::now() - Duration::from_secs(secs_ago);
        std::fs::File::open(dir).unwrap().set_modified(t).unwrap();
    }

    #[test]
    fn the_least_recently_used_projects_go_first_whole_until_the_cache_fits() {
        let work = tempfile::tempdir().unwrap();
        // A bound of 3 KiB.
        let cache = JobCache::new(work.path(), 3.0 / f64::from(1u32 << 20)).unwrap();
        for (p, bytes, ago) in [("old", 1500, 300), ("mid", 1000, 200), ("new", 1000, 100)] {
            let d = cache.lend(p, None).unwrap();
            write(&d.join("model/weights.bin"), bytes);
            write(&d.join("model/index.json"), 10);
            age(&d, ago);
        }
        // 3,530 bytes held, 3,072 allowed: `old` goes, whole; the two others stay.
        let t = cache.trim_with(None).unwrap();
        assert_eq!(t.projects, vec!["old".to_string()]);
        assert_eq!((t.bytes, t.kept_bytes), (1510, 2020));
        assert_eq!(
            t.held,
            vec!["new".to_string(), "mid".to_string()],
            "most recently used first"
        );
        assert!(!cache.dir_of("old").exists());
        assert!(cache.dir_of("mid").join("model/weights.bin").exists());
        // Within the bound: nothing goes.
        assert_eq!(cache.trim_with(None).unwrap().projects, Vec::<String>::new());
        // Lending a project marks it used: `mid` is now the newest, so `new` goes next.
        cache.lend("mid", None).unwrap();
        write(&cache.dir_of("mid").join("more.bin"), 2000);
        let t = cache.trim_with(None).unwrap();
        assert_eq!(t.projects, vec!["new".to_string()]);
        assert_eq!(t.kept_bytes, 3010);
        assert_eq!(t.held, vec!["mid".to_string()]);
    }

    #[test]
    fn a_project_directory_the_job_left_empty_is_not_listed_as_held() {
        let work = tempfile::tempdir().unwrap();
        let cache = JobCache::new(work.path(), 1.0).unwrap();
        assert_eq!(
            cache.trim_with(None).unwrap().held,
            Vec::<String>::new(),
            "no cache yet"
        );
        let d = cache.lend("kept", None).unwrap();
        write(&d.join("hub/model.bin"), 100);
        age(&d, 60);
        cache.lend("nothing", None).unwrap();
        // A stray file beside the project directories is no project.
        write(&work.path().join("cache/p-stray"), 10);
        // Nor a directory whose name no project could have (a job running as the agent made
        // it): 200 bytes, or a space.
        write(&work.path().join(format!("cache/p-{}/f", "x".repeat(200))), 10);
        write(&work.path().join("cache/p-not a project/f"), 10);
        let t = cache.trim_with(None).unwrap();
        assert_eq!(t.held, vec!["kept".to_string()], "{t:?}");
        assert!(cache.dir_of("nothing").exists(), "kept on the volume, only not listed");
    }

    #[test]
    fn the_cache_takes_at_most_half_the_room_it_could_have() {
        let gib = 1u64 << 30;
        // 20 GiB allowed, 10 GiB free and 14 GiB cached: 24 GiB of room, 12 for the cache.
        assert_eq!(room_limit(20 * gib, 14 * gib, Some(10 * gib)), 12 * gib);
        // A roomy volume: the bound.
        assert_eq!(room_limit(20 * gib, 14 * gib, Some(500 * gib)), 20 * gib);
        assert_eq!(room_limit(20 * gib, 14 * gib, None), 20 * gib);
        // Trimmed on a volume with 1,000 bytes free: 3,530 bytes cached, 2,265 allowed.
        let work = tempfile::tempdir().unwrap();
        let cache = JobCache::new(work.path(), 1.0).unwrap();
        for (p, bytes, ago) in [("old", 1500, 300), ("mid", 1000, 200), ("new", 1000, 100)] {
            let d = cache.lend(p, None).unwrap();
            write(&d.join("model/weights.bin"), bytes);
            write(&d.join("model/index.json"), 10);
            age(&d, ago);
        }
        let t = cache.trim_with(Some(1000)).unwrap();
        assert_eq!(t.limit_bytes, 2265);
        assert_eq!((t.projects, t.kept_bytes), (vec!["old".to_string()], 2020));
        // The volume as it is: never more than its bound, nor more than half the room.
        let t = cache.trim().unwrap();
        assert!(t.limit_bytes <= 1 << 30 && t.kept_bytes <= t.limit_bytes, "{t:?}");
    }

    #[test]
    fn a_project_over_the_bound_on_its_own_is_emptied() {
        let work = tempfile::tempdir().unwrap();
        let cache = JobCache::new(work.path(), 1.0 / f64::from(1u32 << 20)).unwrap();
        let d = cache.lend("big", None).unwrap();
        write(&d.join("w.bin"), 2000);
        let t = cache.trim_with(None).unwrap();
        assert_eq!((t.projects, t.kept_bytes), (vec!["big".to_string()], 0));
        // Lent again, it starts empty.
        let d = cache.lend("big", None).unwrap();
        assert_eq!(std::fs::read_dir(d).unwrap().count(), 0);
    }

    #[test]
    fn no_cache_at_zero_gib_and_leftover_job_dirs_are_cleared() {
        let work = tempfile::tempdir().unwrap();
        assert!(JobCache::new(work.path(), 0.0).is_none());
        assert_eq!(clear_job_dirs(work.path()).unwrap(), 0, "no jobs dir yet");
        write(&work.path().join("jobs/job-1/input/x"), 10);
        write(&work.path().join("jobs/job-2/checkpoint/3/f"), 10);
        clear_job_dir(work.path(), "job-1").unwrap();
        assert!(!work.path().join("jobs/job-1").exists());
        clear_job_dir(work.path(), "job-1").unwrap();
        assert_eq!(clear_job_dirs(work.path()).unwrap(), 1);
        assert!(!work.path().join("jobs").exists());
    }

    /// As root (the agent on a worker), with the work dir as the template's user data makes it
    /// (the agent user's, 10001, mode 0750): a job of user 10002 starts in its work dir only once
    /// the agent has prepared it, and still lists nothing of the agent's.
    #[tokio::test]
    async fn a_job_of_its_own_user_starts_in_its_work_dir_under_the_agents_work_dir() {
        use crate::ports::{JobCommand, JobEvent, Launcher};
        use std::os::unix::fs::PermissionsExt;
        if !crate::process::can_switch_user() {
            eprintln!("not root: jobs cannot be started as another user here");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let work = tmp.path().join("onoff");
        std::fs::create_dir(&work).unwrap();
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o750)).unwrap();
        std::os::unix::fs::chown(&work, Some(10001), Some(10001)).unwrap();
        let user = (10002, 10002);
        let launcher = crate::process::ProcessLauncher::as_user(Some(user));
        let run = |argv: &[&str]| {
            let dir = work.join("jobs/job-1");
            std::fs::create_dir_all(&dir).unwrap();
            crate::process::chown_tree(&dir, user.0, user.1).unwrap();
            let started = launcher.start(&JobCommand {
                argv: argv.iter().map(|a| a.to_string()).collect(),
                env: vec![],
                defaults: vec![],
                cwd: dir,
            });
            async move {
                let mut h = started?;
                let mut code = None;
                while let Some(ev) = h.events.recv().await {
                    if let JobEvent::Exited(c) = ev {
                        code = c.code();
                    }
                }
                Ok::<_, String>(code)
            }
        };
        // As the user data leaves it: the job cannot even start.
        let refused = run(&["true"]).await.unwrap_err();
        assert!(refused.contains("Permission denied"), "{refused}");
        assert_eq!(prepare_work_dir(&work, Some(user)).unwrap(), 1, "the earlier job dir");
        assert!(!work.join("jobs/job-1").exists());
        assert_eq!(run(&["true"]).await.unwrap(), Some(0));
        // Its own dir it may write; the agent's it may pass through, not list.
        assert_eq!(run(&["sh", "-c", "touch mine"]).await.unwrap(), Some(0));
        assert_ne!(run(&["ls", work.to_str().unwrap()]).await.unwrap(), Some(0));
        assert!(work.join("jobs/job-1/mine").exists());
        // Its project's cache is its own while it runs; taken back, the next job (another
        // project's, the same user) reads nothing of it, and lent again, it is all there.
        let cache = JobCache::new(&work, 1.0).unwrap();
        let a = cache.lend("a", Some(user)).unwrap();
        let model = a.join("model.bin").display().to_string();
        assert_eq!(run(&["sh", "-c", &format!("echo w > {model}")]).await.unwrap(), Some(0));
        cache.take_back("a", Some(user)).unwrap();
        cache.lend("b", Some(user)).unwrap();
        assert_ne!(run(&["cat", &model]).await.unwrap(), Some(0));
        cache.take_back("b", Some(user)).unwrap();
        cache.lend("a", Some(user)).unwrap();
        assert_eq!(run(&["cat", &model]).await.unwrap(), Some(0));
        // Left lent (the agent killed mid-job): the next agent takes it back as it starts.
        assert!(cache.take_back_all(Some(user)).is_empty());
        assert_ne!(run(&["cat", &model]).await.unwrap(), Some(0));
    }

    #[test]
    fn the_cache_root_may_be_passed_through_not_listed_and_a_project_dir_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let work = tempfile::tempdir().unwrap();
        let cache = JobCache::new(work.path(), 1.0).unwrap();
        let d = cache.lend("vision", None).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&work.path().join("cache")), mode(&d)), (0o711, 0o700));
        assert_eq!(d, work.path().join("cache/p-vision"));
    }
}
