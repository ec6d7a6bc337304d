//! Jobs as child processes: argv (no shell), stdout and stderr streamed line by line, SIGTERM to
//! stop, SIGKILL to kill. The child is killed if the agent drops it.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
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
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {program:?}: {e}"))?;
        let pid = child.id().map(|p| Pid::from_raw(p as i32));
        let (etx, events) = mpsc::channel(256);
        let (control, mut crx) = mpsc::channel(4);
        let readers = [
            child.stdout.take().map(|o| forward(o, etx.clone())),
            child.stderr.take().map(|e| forward(e, etx.clone())),
        ];
        tokio::spawn(async move {
            let mut control_open = true;
            let status = loop {
                tokio::select! {
                    st = child.wait() => break st,
                    c = crx.recv(), if control_open => match c {
                        Some(Control::Stop) => {
                            if let Some(pid) = pid {
                                let _ = kill(pid, Signal::SIGTERM);
                            }
                        }
                        Some(Control::Kill) => {
                            let _ = child.start_kill();
                        }
                        None => control_open = false,
                    },
                }
            };
            // Output before the exit; a grandchild holding the pipes open does not hold us up.
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
        assert_eq!((lines, code), (vec!["stopping".to_string()], Some(143)));
        let h = ProcessLauncher.start(&cmd(&["sleep", "30"])).unwrap();
        h.control.send(Control::Kill).await.unwrap();
        let (_, code) = collect(h).await;
        assert_eq!(code, None, "killed by a signal");
    }
}
