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

use crate::ports::{Control, JobCommand, JobEvent, JobHandle, Launcher};

/// Starts jobs as processes.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessLauncher;

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
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .envs(cmd.env.iter().map(|(k, v)| (k, v)))
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
            let code = status.ok().and_then(|s| s.code());
            let _ = etx.send(JobEvent::Exited(code)).await;
        });
        Ok(JobHandle { events, control })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn collect(mut h: JobHandle) -> (Vec<String>, Option<i32>) {
        let mut lines = Vec::new();
        while let Some(ev) = h.events.recv().await {
            match ev {
                JobEvent::Line(l) => lines.push(l),
                JobEvent::Exited(c) => return (lines, c),
            }
        }
        panic!("no exit event")
    }

    fn cmd(argv: &[&str]) -> JobCommand {
        JobCommand {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: vec![("ONOFF_JOB_ID".into(), "job-1".into())],
            cwd: std::env::temp_dir(),
        }
    }

    #[tokio::test]
    async fn streams_lines_and_exit_code_without_a_shell() {
        let h = ProcessLauncher
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
        let (lines, code) = collect(ProcessLauncher.start(&cmd(&["echo", "a;", "exit", "3"])).unwrap()).await;
        assert_eq!((lines, code), (vec!["a; exit 3".to_string()], Some(0)));
        let err = ProcessLauncher.start(&cmd(&["/nonexistent/program"])).unwrap_err();
        assert!(err.contains("/nonexistent/program"), "{err}");
    }

    #[tokio::test]
    async fn stop_sends_sigterm_and_kill_kills() {
        let h = ProcessLauncher
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
        let h = ProcessLauncher.start(&cmd(&["sleep", "30"])).unwrap();
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
        let mut h = ProcessLauncher.start(&cmd(&["sh", "-c", script])).unwrap();
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
