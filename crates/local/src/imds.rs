//! A local instance metadata service for one emulated instance, speaking IMDSv2: `PUT
//! /latest/api/token` gives a session token, every `GET /latest/meta-data/...` must carry it.
//! Serves the instance's identity, and `spot/instance-action` or
//! `events/recommendations/rebalance` once a notice is injected (404 before, as on EC2).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// What the instance's IMDS answers.
#[derive(Debug, Clone, Default)]
pub struct ImdsState {
    /// `instance-id`.
    pub instance_id: String,
    /// `instance-type`.
    pub instance_type: String,
    /// `placement/availability-zone`.
    pub zone: String,
    /// `instance-life-cycle` (`spot` or `on-demand`).
    pub lifecycle: String,
    /// `spot/instance-action` body, once a spot interruption notice is injected.
    pub spot_action: Option<String>,
    /// `events/recommendations/rebalance` body, once a rebalance recommendation is injected.
    pub rebalance: Option<String>,
}

const TOKEN: &str = "onoff-local-imds-token";

/// A running IMDS endpoint; stops when dropped.
#[derive(Debug)]
pub struct ImdsServer {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    state: Arc<Mutex<ImdsState>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ImdsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

fn answer(state: &Mutex<ImdsState>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if path == "/latest/api/token" {
        if req.method() != Method::PUT {
            return reply(StatusCode::METHOD_NOT_ALLOWED, "");
        }
        let Some(ttl) = req.headers().get("x-aws-ec2-metadata-token-ttl-seconds").cloned() else {
            return reply(StatusCode::BAD_REQUEST, "missing x-aws-ec2-metadata-token-ttl-seconds");
        };
        // EC2 echoes the token's TTL; the SDK's IMDS client refuses a token without it.
        let mut r = reply(StatusCode::OK, TOKEN);
        r.headers_mut().insert("x-aws-ec2-metadata-token-ttl-seconds", ttl);
        return r;
    }
    if req
        .headers()
        .get("x-aws-ec2-metadata-token")
        .and_then(|v| v.to_str().ok())
        != Some(TOKEN)
    {
        return reply(StatusCode::UNAUTHORIZED, "");
    }
    let s = state.lock().expect("lock");
    let body = match path.trim_start_matches("/latest/meta-data/") {
        "instance-id" => Some(s.instance_id.clone()),
        "instance-type" => Some(s.instance_type.clone()),
        "placement/availability-zone" => Some(s.zone.clone()),
        "instance-life-cycle" => Some(s.lifecycle.clone()),
        "spot/instance-action" => s.spot_action.clone(),
        "events/recommendations/rebalance" => s.rebalance.clone(),
        _ => None,
    };
    match body {
        Some(b) => reply(StatusCode::OK, b),
        None => reply(StatusCode::NOT_FOUND, "Not Found"),
    }
}

impl ImdsServer {
    /// Serve `state` on a free loopback port.
    ///
    /// # Errors
    /// The port cannot be bound.
    pub async fn start(state: ImdsState) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(Mutex::new(state));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let st = shared.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let r = answer(&st, &req);
                        async move { Ok::<_, Infallible>(r) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Self { endpoint, state, task })
    }

    /// Inject a spot interruption notice (`action` terminate, at `time`, ISO 8601).
    pub fn spot_notice(&self, time: &str) {
        self.state.lock().expect("lock").spot_action =
            Some(serde_json::json!({ "action": "terminate", "time": time }).to_string());
    }

    /// Inject a rebalance recommendation.
    pub fn rebalance(&self, time: &str) {
        self.state.lock().expect("lock").rebalance = Some(serde_json::json!({ "noticeTime": time }).to_string());
    }
}
