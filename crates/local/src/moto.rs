//! moto server, the local AWS: started on a free loopback port, stopped when dropped.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A moto server process.
#[derive(Debug)]
pub struct Moto {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    child: Option<tokio::process::Child>,
}

/// Where moto server is looked for: `ONOFF_MOTO_SERVER`, then `.venv/bin/moto_server` under the
/// current directory and under the repository the binary was built from.
pub fn find_moto_server() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("ONOFF_MOTO_SERVER") {
        return Some(PathBuf::from(p));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    [Path::new(".").to_path_buf(), repo]
        .into_iter()
        .map(|r| r.join(".venv/bin/moto_server"))
        .find(|p| p.exists())
}

impl Moto {
    /// Use an emulator that is already running at `endpoint` (not stopped on drop).
    pub fn existing(endpoint: &str) -> Self {
        Self {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            child: None,
        }
    }

    /// Start `moto_server` on a free port and wait until it answers (up to 30 s). Its output goes
    /// to `log`.
    ///
    /// # Errors
    /// The program cannot be started, or it does not answer in time.
    pub async fn start(program: &Path, log: &Path) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let out = std::fs::File::create(log)?;
        let child = tokio::process::Command::new(program)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(out.try_clone()?)
            .stderr(out)
            // Its own process group: a Ctrl-C at the terminal reaches onoff, which still needs the
            // emulator to clean up, not moto.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start moto server {}: {e}", program.display()))?;
        let moto = Self {
            endpoint: format!("http://127.0.0.1:{port}"),
            child: Some(child),
        };
        for _ in 0..300 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                return Ok(moto);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!(
            "moto server did not answer on port {port} within 30 s; see {}",
            log.display()
        )
    }

    /// Stop the server (if this process started it).
    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill().await;
        }
    }
}
