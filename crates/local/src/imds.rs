//! A local instance metadata service for one emulated instance, speaking IMDSv2: `PUT
//! /latest/api/token` gives a session token, every `GET /latest/meta-data/...` must carry it.
//! Serves the instance's identity, the instance profile's credentials
//! (`iam/security-credentials/<role>`), and `spot/instance-action` or
//! `events/recommendations/rebalance` once a notice is injected (404 before, as on EC2).
//!
//! Connections from the user jobs run as are refused ([`ImdsState::refuse_uid`]): the local form
//! of the worker's firewall rule (`iptables -m owner --uid-owner <job uid> -j REJECT` on the
//! metadata address, template.yaml's user data). The owner of the connecting socket is read from
//! `/proc/net/tcp`.

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
    /// The instance profile's role name and its credentials (the JSON EC2 serves at
    /// `iam/security-credentials/<role>`).
    pub credentials: Option<(String, String)>,
    /// Connections from sockets this user owns are closed unanswered.
    pub refuse_uid: Option<u32>,
}

/// The user owning the client's end of the loopback TCP connection from `client` to `server`,
/// from `/proc/net/tcp`; `None` when not found (not Linux, or gone).
///
/// Both ends are matched, and sockets in TIME_WAIT are skipped: those belong to no process (the
/// table shows uid 0 for them), and one left by an earlier connection from the same ephemeral
/// port to another server (the test suite's moto traffic reuses ports) would stand in for the
/// job's socket and let its connection through: the likely cause of a CI run in which the job's
/// user was served.
#[must_use]
pub fn socket_uid(client: SocketAddr, server: SocketAddr) -> Option<u32> {
    // /proc/net/tcp: `sl local_address rem_address st ... uid ...`; state 06 is TIME_WAIT.
    let (local, remote) = (proc_net_addr(client)?, proc_net_addr(server)?);
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        (cols.get(1) == Some(&local.as_str()) && cols.get(2) == Some(&remote.as_str()) && cols.get(3) != Some(&"06"))
            .then(|| cols.get(7).and_then(|u| u.parse().ok()))
            .flatten()
    })
}

/// `addr` as `/proc/net/tcp` writes it: hex IPv4 in host byte order (little-endian here), a
/// colon, a hex port; `None` for IPv6 (that table is `tcp6`).
fn proc_net_addr(addr: SocketAddr) -> Option<String> {
    match addr {
        SocketAddr::V4(v4) => Some(format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(v4.ip().octets()),
            v4.port()
        )),
        SocketAddr::V6(_) => None,
    }
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
        "iam/security-credentials" | "iam/security-credentials/" => {
            s.credentials.as_ref().map(|(role, _)| role.clone())
        }
        other => match (&s.credentials, other.strip_prefix("iam/security-credentials/")) {
            (Some((role, json)), Some(asked)) if asked == role => Some(json.clone()),
            _ => None,
        },
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
        let server = listener.local_addr()?;
        let endpoint = format!("http://{server}");
        let state = Arc::new(Mutex::new(state));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, peer)) = listener.accept().await {
                let refuse = shared.lock().expect("lock").refuse_uid;
                if refuse.is_some() && refuse == socket_uid(peer, server) {
                    // Closed unanswered, as the firewall rule rejects it on EC2.
                    drop(stream);
                    continue;
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One HTTP/1.1 request; the whole answer, empty when the server closed unanswered.
    async fn ask(endpoint: &str, method: &str, path: &str, header: &str) -> String {
        let host = endpoint.trim_start_matches("http://");
        let mut s = tokio::net::TcpStream::connect(host).await.expect("connect");
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{header}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        );
        // The server may close before the request is written (refused): that is an answer too.
        let _ = s.write_all(req.as_bytes()).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    fn state(refuse_uid: Option<u32>) -> ImdsState {
        ImdsState {
            instance_id: "i-1".into(),
            credentials: Some(("worker-role".into(), r#"{"Code":"Success","AccessKeyId":"AK"}"#.into())),
            refuse_uid,
            ..ImdsState::default()
        }
    }

    #[tokio::test]
    async fn the_instance_profiles_credentials_are_served_with_a_token() {
        let other = nix::unistd::geteuid().as_raw().wrapping_add(1);
        let imds = ImdsServer::start(state(Some(other))).await.unwrap();
        let token = ask(
            &imds.endpoint,
            "PUT",
            "/latest/api/token",
            "x-aws-ec2-metadata-token-ttl-seconds: 60",
        )
        .await;
        assert!(token.starts_with("HTTP/1.1 200"), "{token}");
        let h = format!("x-aws-ec2-metadata-token: {TOKEN}");
        let role = ask(&imds.endpoint, "GET", "/latest/meta-data/iam/security-credentials/", &h).await;
        assert!(role.ends_with("worker-role"), "{role}");
        let creds = ask(
            &imds.endpoint,
            "GET",
            "/latest/meta-data/iam/security-credentials/worker-role",
            &h,
        )
        .await;
        assert!(creds.contains("\"AccessKeyId\":\"AK\""), "{creds}");
        let none = ask(
            &imds.endpoint,
            "GET",
            "/latest/meta-data/iam/security-credentials/other",
            &h,
        )
        .await;
        assert!(none.starts_with("HTTP/1.1 404"), "{none}");
    }

    /// Whether a `/proc/net/tcp` row (split in columns) is the connection from `from` to `to`.
    fn socket_uid_row_matches(cols: &[&str], from: SocketAddr, to: SocketAddr) -> bool {
        cols.get(1).copied() == proc_net_addr(from).as_deref() && cols.get(2).copied() == proc_net_addr(to).as_deref()
    }

    #[tokio::test]
    async fn the_job_users_connections_are_refused() {
        // This process plays the job: its user is the refused one.
        let me = nix::unistd::geteuid().as_raw();
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let probe = std::net::TcpListener::bind(addr).unwrap();
        let client = std::net::TcpStream::connect(probe.local_addr().unwrap()).unwrap();
        assert_eq!(
            socket_uid(client.local_addr().unwrap(), probe.local_addr().unwrap()),
            Some(me),
            "/proc/net/tcp names the owner"
        );
        // Another server at the same client port is another connection: not this one.
        let elsewhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(socket_uid(client.local_addr().unwrap(), elsewhere), None);
        // Closed by the client first, its end waits in TIME_WAIT, owned by no process (the table
        // says uid 0): it names nobody, so it cannot stand in for a live socket on that port.
        let (server_end, _) = probe.accept().unwrap();
        let (from, to) = (client.local_addr().unwrap(), probe.local_addr().unwrap());
        drop(client);
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(server_end);
        let waiting = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            std::fs::read_to_string("/proc/net/tcp").unwrap().lines().any(|l| {
                let c: Vec<&str> = l.split_whitespace().collect();
                c.get(3) == Some(&"06") && socket_uid_row_matches(&c, from, to)
            })
        });
        assert!(waiting, "the client's end went to TIME_WAIT");
        assert_eq!(socket_uid(from, to), None, "a TIME_WAIT socket names nobody");
        let imds = ImdsServer::start(state(Some(me))).await.unwrap();
        let answer = ask(
            &imds.endpoint,
            "PUT",
            "/latest/api/token",
            "x-aws-ec2-metadata-token-ttl-seconds: 60",
        )
        .await;
        assert_eq!(answer, "", "closed unanswered");
    }
}
