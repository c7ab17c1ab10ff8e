//! The agent's side of the agent protocol: register, heartbeat, and the long-poll for the
//! node's desired state.
//!
//! Plain HTTP, or HTTPS with mutual TLS (rustls on ring, see [`crate::tls`]): the agent
//! trusts only the cluster CA and presents its node's certificate. Every call has a connect
//! timeout and a whole-request timeout.
//!
//! The coordinator may be several (`coordinator = "http://a:7400,http://b:7400"`, or a list
//! in agent.toml): coordinators sharing a PostgreSQL database, of which one leads and the
//! others answer 503. A call that finds its coordinator unreachable or answering 503 tries
//! the next one at once, and the one that answered is asked first from then on: the agent
//! follows the leader.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use nightshift_common::net::{Failover, HttpsClient};
use nightshift_common::{ApiError, DesiredNode, Heartbeat, RegisterReply, RegisterRequest};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::tls::{AgentTlsConfig, TlsFileError};

/// How long a long-poll waits on the coordinator before it answers unchanged.
pub const LONG_POLL: Duration = Duration::from_secs(25);
/// How long the TCP connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a register or heartbeat may take, answer included.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error("coordinator at {url} unreachable: {source}")]
    Unreachable { url: String, source: BoxError },
    #[error("coordinator does not know node {0}; registering again")]
    UnknownNode(String),
    #[error("coordinator refused: {status}: {error}")]
    Refused { status: StatusCode, error: String },
    #[error("coordinator url {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("{0}")]
    Tls(#[from] TlsFileError),
}

#[derive(Clone)]
pub struct Uplink {
    /// The coordinators' base URLs, in the order configured; the one asked first is the last
    /// that answered.
    bases: Failover<String>,
    node: String,
    client: HttpsClient<Full<Bytes>>,
}

impl Uplink {
    /// An uplink over plain HTTP (or HTTPS trusting no one: tests of refusal).
    pub fn new(base: &str, node: &str) -> Result<Self, UplinkError> {
        Self::with_tls(base, node, &AgentTlsConfig::default())
    }

    /// An uplink that, for an `https://` coordinator, trusts `tls.ca_file` only and presents
    /// `tls.cert_file`.
    pub fn with_tls(base: &str, node: &str, tls: &AgentTlsConfig) -> Result<Self, UplinkError> {
        let bad = |reason: &str| UplinkError::BadUrl {
            url: base.to_owned(),
            reason: reason.to_owned(),
        };
        let config = match tls.client_config()? {
            Some(config) => config,
            None if coordinator_urls(base)
                .iter()
                .any(|u| u.starts_with("https://")) =>
            {
                return Err(bad("https needs tls.ca_file (the cluster CA)"));
            }
            None => nightshift_common::net::trust_nobody().map_err(|e| bad(&e.to_string()))?,
        };
        let bases = coordinator_urls(base)
            .iter()
            .map(|b| b.trim_end_matches('/').to_owned())
            .collect();
        Ok(Self {
            bases: Failover::new(bases).ok_or_else(|| bad("names no coordinator"))?,
            node: node.to_owned(),
            client: nightshift_common::net::https_client(config, CONNECT_TIMEOUT),
        })
    }

    /// The base URL of the coordinator asked first now.
    pub fn base(&self) -> &str {
        self.bases.first()
    }

    pub async fn register(&self, req: &RegisterRequest) -> Result<RegisterReply, UplinkError> {
        self.send(Method::POST, "/v1/agents/register", Some(req), CALL_TIMEOUT)
            .await
    }

    pub async fn heartbeat(&self, beat: &Heartbeat) -> Result<DesiredNode, UplinkError> {
        let path = format!("/v1/agents/{}/heartbeat", self.node);
        self.send(Method::POST, &path, Some(beat), CALL_TIMEOUT)
            .await
    }

    /// Answers as soon as the desired version moves past `after`, or after [`LONG_POLL`].
    pub async fn desired(&self, after: u64) -> Result<DesiredNode, UplinkError> {
        let path = format!(
            "/v1/agents/{}/desired?after={after}&wait_ms={}",
            self.node,
            LONG_POLL.as_millis()
        );
        self.send::<(), _>(Method::GET, &path, None, LONG_POLL + CALL_TIMEOUT)
            .await
    }

    /// Sends to the coordinator asked first; when it is unreachable or answers 503 (a
    /// standby, or a leader stepping down), to the next ones in turn, and the one that
    /// answers is asked first from then on.
    async fn send<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
    ) -> Result<T, UplinkError> {
        self.bases
            .call(
                |base| {
                    let url = format!("{base}{path}");
                    let method = method.clone();
                    async move { self.send_to(method, &url, body, timeout).await }
                },
                |sent| sent.as_ref().is_err_and(fails_over),
                |_| false,
            )
            .await
    }

    async fn send_to<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        url: &str,
        body: Option<&B>,
        timeout: Duration,
    ) -> Result<T, UplinkError> {
        let unreachable = |source: BoxError| UplinkError::Unreachable {
            url: url.to_owned(),
            source,
        };
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| unreachable(e.into()))?,
            None => Vec::new(),
        };
        let req = Request::builder()
            .method(method)
            .uri(url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| UplinkError::BadUrl {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
        let call = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| unreachable(e.into()))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| unreachable(e.into()))?
                .to_bytes();
            Ok::<_, UplinkError>((status, body))
        };
        let (status, body) = tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| unreachable(format!("no answer within {timeout:?}").into()))??;
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| unreachable(e.into()));
        }
        let error = serde_json::from_slice::<ApiError>(&body)
            .map_or_else(|e| format!("unreadable error body: {e}"), |e| e.error);
        if status == StatusCode::NOT_FOUND && error.contains("not registered") {
            return Err(UplinkError::UnknownNode(self.node.clone()));
        }
        Err(UplinkError::Refused { status, error })
    }
}

pub use nightshift_common::net::coordinator_urls;

/// Whether another coordinator may answer a call that failed so: this one is unreachable,
/// or a standby (503).
fn fails_over(e: &UplinkError) -> bool {
    match e {
        UplinkError::Unreachable { .. } => true,
        UplinkError::Refused { status, .. } => *status == StatusCode::SERVICE_UNAVAILABLE,
        _ => false,
    }
}
