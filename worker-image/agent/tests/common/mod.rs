//! Helpers shared by the agent's test files.

use std::sync::Arc;

use onoff_agent::fake::FakeMetadata;
use onoff_agent::ports::Notice;
use onoff_agent::{AgentConfig, ShutdownMode};

/// The agent's settings in these tests: short periods, no real shutdown.
pub fn cfg(dir: &std::path::Path) -> AgentConfig {
    AgentConfig {
        lanes: vec!["standard".into()],
        idle_timeout_s: 120.0,
        heartbeat_s: 30.0,
        lease_s: 60.0,
        notice_grace_s: 30.0,
        imds_poll_s: 5.0,
        poll_wait_s: 10.0,
        retry_delay_s: 15.0,
        rerun_limits: Default::default(),
        shutdown: ShutdownMode::ApiOnly,
        work_dir: dir.to_path_buf(),
        worker_image: None,
        time_scale: 1.0,
        deployment: "test".into(),
        gpus: None,
        job_user: None,
        cache_gib: 1.0,
        policy: Default::default(),
    }
}

/// IMDS shared between a test (which posts notices) and the agent.
pub struct ArcMd(pub Arc<FakeMetadata>);
impl onoff_agent::ports::Metadata for ArcMd {
    async fn identity(&self) -> Result<onoff_agent::ports::Identity, String> {
        self.0.identity().await
    }
    async fn notice(&self) -> Result<Option<Notice>, String> {
        self.0.notice().await
    }
}
