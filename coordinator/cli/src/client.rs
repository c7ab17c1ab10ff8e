//! A typed async client for the coordinator's HTTP API, used by the `nightshift` CLI.
//!
//! Plain HTTP, or HTTPS that trusts only the cluster CA given to [`Client::with_ca`]
//! (`--ca` / `NIGHTSHIFT_CA`): hyper with rustls on ring, as the agent's uplink, so that
//! reqwest's TLS (and its crypto provider) stays out of the build.
//!
//! Every call has a connect timeout ([`CONNECT_TIMEOUT`]) and a whole-request timeout
//! ([`REQUEST_TIMEOUT`]), so the CLI never hangs on a coordinator that is gone. Errors say
//! what went wrong in terms a user can act on: an unreachable coordinator names the URL and
//! how to point the CLI elsewhere; an API refusal keeps the server's [`ApiError`], field
//! included.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, StatusCode};
use nightshift_common::net::{Failover, HttpsClient, coordinator_urls};
use nightshift_common::{ApiError, JobList, JobSpec, JobView, NodeList};
use serde::Serialize;
use serde::de::DeserializeOwned;
use url::Url;

/// How long to wait for the TCP connection to the coordinator.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a whole request may take, answer included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// At most this much of an unexpected (non-JSON) error body is kept for the message.
const BODY_SNIPPET_CHARS: usize = 200;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid coordinator url {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },

    #[error(
        "cannot reach the coordinator at {url}: {} (is nightshift-coordinator running? \
         set --coordinator or NIGHTSHIFT_URL)",
        describe_transport(.source.as_ref())
    )]
    Unreachable {
        url: String,
        #[source]
        source: TransportError,
    },

    /// The TLS handshake failed: most often a certificate the CA in use does not sign.
    #[error(
        "tls handshake with the coordinator at {url} failed: {reason} (the coordinator's \
         certificate was checked against the CA in {}; set --ca or NIGHTSHIFT_CA to the \
         cluster CA, ca.pem of `nightshift-coordinator tls init`)",
        .ca.display()
    )]
    Tls {
        url: String,
        ca: PathBuf,
        reason: String,
    },

    /// `--ca`: the CA file cannot be read or holds no usable certificate.
    #[error("{0}")]
    Ca(String),

    #[error("the coordinator did not answer {request} within {after:?}")]
    Timeout { request: String, after: Duration },

    #[error("{request} failed: {}", describe_transport(.source.as_ref()))]
    Transport {
        request: String,
        #[source]
        source: TransportError,
    },

    /// The coordinator refused the request with its usual error body.
    #[error("{}", display_api(*.status, .error))]
    Api { status: StatusCode, error: ApiError },

    /// An error status whose body is not an [`ApiError`] (a proxy in the way, say).
    #[error("{status} from {request}: {body}")]
    Status {
        request: String,
        status: StatusCode,
        body: String,
    },

    #[error("unexpected answer to {request}: {source}")]
    Decode {
        request: String,
        #[source]
        source: serde_json::Error,
    },
}

impl ClientError {
    /// The HTTP status of an answer the coordinator gave, if it gave one.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Api { status, .. } | Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The request field the coordinator blamed, if any.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Api { error, .. } => error.field.as_deref(),
            _ => None,
        }
    }
}

fn display_api(status: StatusCode, error: &ApiError) -> String {
    match &error.field {
        // The server may already have written "field: rule"; do not say the field twice.
        Some(field) if !error.error.starts_with(&format!("{field}:")) => {
            format!("{status}: {field}: {}", error.error)
        }
        _ => format!("{status}: {}", error.error),
    }
}

/// One coordinator's base URL, which always ends with `/` so that relative API paths join
/// below it, and the base as the user would write it, for messages.
#[derive(Debug)]
struct Base {
    url: Url,
    shown: String,
}

impl fmt::Display for Base {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

/// One coordinator's base URL, validated.
fn parse_base(base_url: &str, ca: Option<&Path>) -> Result<Base, ClientError> {
    let invalid = |reason: &str| ClientError::InvalidUrl {
        url: base_url.to_owned(),
        reason: reason.to_owned(),
    };
    if !base_url.contains("://") {
        return Err(invalid("expected http://host:port"));
    }
    let mut base = Url::parse(base_url.trim()).map_err(|e| invalid(&e.to_string()))?;
    match (base.scheme(), ca) {
        ("http", _) | ("https", Some(_)) => {}
        ("https", None) => {
            return Err(invalid(
                "https needs the cluster CA: set --ca FILE or NIGHTSHIFT_CA",
            ));
        }
        _ => return Err(invalid("the scheme must be http:// or https://")),
    }
    if base.host_str().is_none_or(str::is_empty) {
        return Err(invalid("a host is required"));
    }
    if !base.username().is_empty() || base.password().is_some() {
        return Err(invalid("credentials in the url are not supported"));
    }
    if base.query().is_some() || base.fragment().is_some() {
        return Err(invalid("a query or fragment is not allowed"));
    }
    if !base.path().ends_with('/') {
        let path = format!("{}/", base.path());
        base.set_path(&path);
    }
    let shown = base.as_str().trim_end_matches('/').to_owned();
    Ok(Base { url: base, shown })
}

/// The cause of a failed connection or exchange (hyper's, or the TLS layer's).
pub type TransportError = Box<dyn std::error::Error + Send + Sync>;

/// The TLS error in `err`'s chain, if the failure was the handshake's.
fn tls_cause<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        // An io::Error's source() skips the error it wraps: follow that one instead.
        next = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

use nightshift_common::net::describe_transport;

/// A client for one coordinator, or for several sharing a PostgreSQL database (of which
/// one leads and the others answer 503): a request that finds its coordinator unreachable
/// or answering 503 goes to the next one, which is asked first from then on. Cheap to
/// clone; clones share a connection pool.
#[derive(Clone)]
pub struct Client {
    http: HttpsClient<Full<Bytes>>,
    /// The CA the coordinator's certificate is checked against (`https://` only).
    ca: Option<PathBuf>,
    /// Each coordinator's base; the one asked first is the last that answered (shared by
    /// clones).
    bases: Failover<Base>,
    request_timeout: Duration,
    /// Sent as `Authorization: Bearer`; never logged or shown.
    token: Option<String>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.shown())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client for the coordinator at `base_url`, e.g. `http://127.0.0.1:7400`. A path is
    /// kept as a prefix (`http://gw/nightshift` talks to `http://gw/nightshift/v1/jobs`).
    /// An `https://` URL needs [`Client::with_ca`].
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        Self::with_timeouts(base_url, None, CONNECT_TIMEOUT, REQUEST_TIMEOUT)
    }

    /// A client that, for an `https://` coordinator, trusts only the CA certificates of
    /// `ca` (the cluster CA); `None` behaves as [`Client::new`].
    pub fn with_ca(base_url: &str, ca: Option<&Path>) -> Result<Self, ClientError> {
        Self::with_timeouts(base_url, ca, CONNECT_TIMEOUT, REQUEST_TIMEOUT)
    }

    /// [`Client::with_ca`] with other timeouts than the defaults.
    pub fn with_timeouts(
        base_url: &str,
        ca: Option<&Path>,
        connect: Duration,
        request: Duration,
    ) -> Result<Self, ClientError> {
        let bases = coordinator_urls(base_url)
            .into_iter()
            .map(|u| parse_base(u, ca))
            .collect::<Result<Vec<_>, _>>()?;
        let bases = Failover::new(bases).ok_or_else(|| ClientError::InvalidUrl {
            url: base_url.to_owned(),
            reason: "expected http://host:port".to_owned(),
        })?;
        let http = http_client(ca, connect)?;
        Ok(Self {
            http,
            ca: ca.map(Path::to_owned),
            bases,
            request_timeout: request,
            token: None,
        })
    }

    /// The base of the coordinator asked first now.
    fn base(&self) -> &Url {
        &self.bases.first().url
    }

    /// That base as the user would write it.
    fn shown(&self) -> &str {
        &self.bases.first().shown
    }

    /// Sends `token` (an API token, `NIGHTSHIFT_TOKEN`) with every request.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// The base URL of the coordinator asked first now, without a trailing `/`.
    pub fn base_url(&self) -> &str {
        self.shown()
    }

    /// `POST /v1/jobs`: queues a job.
    pub async fn submit(&self, spec: &JobSpec) -> Result<JobView, ClientError> {
        self.call(Method::POST, "v1/jobs", Some(spec)).await
    }

    /// `GET /v1/jobs`.
    pub async fn jobs(&self) -> Result<JobList, ClientError> {
        self.call::<(), _>(Method::GET, "v1/jobs", None).await
    }

    /// `GET /v1/jobs/{id}`.
    pub async fn job(&self, id: u64) -> Result<JobView, ClientError> {
        self.call::<(), _>(Method::GET, &format!("v1/jobs/{id}"), None)
            .await
    }

    /// `POST /v1/jobs/{id}/cancel`: the job as it is right after the request, which is
    /// `cancelling` while its container is being stopped.
    pub async fn cancel(&self, id: u64) -> Result<JobView, ClientError> {
        self.call::<(), _>(Method::POST, &format!("v1/jobs/{id}/cancel"), None)
            .await
    }

    /// `GET /v1/jobs/{id}/logs`: writes the job's container output to `out` as it comes;
    /// with `follow`, until the container exits (no overall timeout then).
    pub async fn logs(
        &self,
        id: u64,
        tail: Option<usize>,
        follow: bool,
        out: &mut (dyn std::io::Write + Send),
    ) -> Result<(), ClientError> {
        let mut path = format!("v1/jobs/{id}/logs?follow={follow}");
        if let Some(n) = tail {
            path.push_str(&format!("&tail={n}"));
        }
        let url = self
            .base()
            .join(&path)
            .map_err(|e| ClientError::InvalidUrl {
                url: format!("{}/{path}", self.shown()),
                reason: e.to_string(),
            })?;
        let request = format!("GET {url}");
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let response = self
            .exchange(&request, Method::GET, url, None, deadline)
            .await?;
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let bytes = self.body(&request, body, deadline).await?;
            return Err(error_from_body(request, status, &bytes));
        }
        loop {
            // Followed logs last as long as the job; only the connection is bounded.
            let frame = if follow {
                body.frame().await
            } else {
                tokio::time::timeout_at(deadline, body.frame())
                    .await
                    .map_err(|_| self.timeout(&request))?
            };
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|e| self.transport(&request, Box::new(e)))?;
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            out.write_all(&chunk).map_err(|e| ClientError::Status {
                request: request.clone(),
                status,
                body: format!("cannot write the logs: {e}"),
            })?;
            let _ = out.flush();
        }
        Ok(())
    }

    /// `POST /v1/pipelines`: starts a pipeline run of a workflow file.
    pub async fn submit_pipeline(
        &self,
        req: &nightshift_common::PipelineSubmit,
    ) -> Result<nightshift_common::PipelineRunView, ClientError> {
        self.call(Method::POST, "v1/pipelines", Some(req)).await
    }

    /// `GET /v1/pipelines/{id}`.
    pub async fn pipeline(
        &self,
        id: u64,
    ) -> Result<nightshift_common::PipelineRunView, ClientError> {
        self.call::<(), _>(Method::GET, &format!("v1/pipelines/{id}"), None)
            .await
    }

    /// `POST /v1/pipelines/{id}/rerun`: a new run of what run `id` ran.
    pub async fn rerun_pipeline(
        &self,
        id: u64,
    ) -> Result<nightshift_common::PipelineRunView, ClientError> {
        self.call::<(), _>(Method::POST, &format!("v1/pipelines/{id}/rerun"), None)
            .await
    }

    /// `GET /v1/nodes`.
    pub async fn nodes(&self) -> Result<NodeList, ClientError> {
        self.call::<(), _>(Method::GET, "v1/nodes", None).await
    }

    /// `GET /v1/report`: accounting over `[since, until)` (Unix ms; the coordinator's defaults
    /// when `None`), grouped by `by`.
    pub async fn report(
        &self,
        since: Option<u64>,
        until: Option<u64>,
        by: Option<&str>,
    ) -> Result<nightshift_common::Report, ClientError> {
        let mut query = Vec::new();
        if let Some(s) = since {
            query.push(format!("since={s}"));
        }
        if let Some(u) = until {
            query.push(format!("until={u}"));
        }
        if let Some(b) = by {
            query.push(format!("by={b}"));
        }
        let path = if query.is_empty() {
            "v1/report".to_owned()
        } else {
            format!("v1/report?{}", query.join("&"))
        };
        self.call::<(), _>(Method::GET, &path, None).await
    }

    /// `POST /v1/services/{service}/gateway`: a gateway's requests held for want of a ready
    /// replica (what a load balancer in front of the service reports).
    pub async fn gateway(&self, service: &str, waiting: u64) -> Result<(), ClientError> {
        let signals = nightshift_common::GatewaySignals { waiting };
        let path = format!("v1/services/{service}/gateway");
        let (request, status, body) = self.send(Method::POST, &path, Some(&signals)).await?;
        if status.is_success() {
            return Ok(());
        }
        Err(error_from_body(request, status, &body))
    }

    /// `GET /healthz`: `Ok` when the coordinator answers 200.
    pub async fn healthz(&self) -> Result<(), ClientError> {
        let (request, status, body) = self.send::<()>(Method::GET, "healthz", None).await?;
        if status.is_success() {
            return Ok(());
        }
        Err(error_from_body(request, status, &body))
    }

    async fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let (request, status, bytes) = self.send(method, path, body).await?;
        if !status.is_success() {
            return Err(error_from_body(request, status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|source| ClientError::Decode { request, source })
    }

    /// Sends one request and reads its whole answer, within the request timeout; returns
    /// its description ("GET http://...") for later messages.
    async fn send<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(String, StatusCode, Bytes), ClientError> {
        self.bases
            .call(
                |base| self.send_to(base, method.clone(), path, body),
                |sent| match sent {
                    Err(ClientError::Unreachable { .. } | ClientError::Timeout { .. }) => true,
                    Ok((_, status, _)) => *status == StatusCode::SERVICE_UNAVAILABLE,
                    Err(_) => false,
                },
                // A standby's answer (which names the leader) says more than a failure.
                Result::is_ok,
            )
            .await
    }

    /// [`Client::send`] to the coordinator at `base`.
    async fn send_to<B: Serialize + ?Sized>(
        &self,
        base: &Base,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(String, StatusCode, Bytes), ClientError> {
        let Base { url: base, shown } = base;
        let url = base.join(path).map_err(|e| ClientError::InvalidUrl {
            url: format!("{shown}/{path}"),
            reason: e.to_string(),
        })?;
        let request = format!("{method} {url}");
        let body =
            body.map(serde_json::to_vec)
                .transpose()
                .map_err(|e| ClientError::Transport {
                    request: request.clone(),
                    source: Box::new(e),
                })?;
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let response = self.exchange(&request, method, url, body, deadline).await?;
        let status = response.status();
        let bytes = self.body(&request, response.into_body(), deadline).await?;
        Ok((request, status, bytes))
    }

    /// Sends a request and waits for its answer's head until `deadline`.
    async fn exchange(
        &self,
        request: &str,
        method: Method,
        url: Url,
        json: Option<Vec<u8>>,
        deadline: tokio::time::Instant,
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        tracing::debug!(%method, %url, "request");
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(url.as_str())
            .header(
                USER_AGENT,
                concat!("nightshift/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(token) = &self.token {
            builder = builder.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match json {
            Some(json) => {
                builder = builder.header(CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(json))
            }
            None => Full::new(Bytes::new()),
        };
        let req = builder.body(body).map_err(|e| ClientError::InvalidUrl {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        match tokio::time::timeout_at(deadline, self.http.request(req)).await {
            Err(_) => Err(self.timeout(request)),
            Ok(Err(e)) if e.is_connect() => Err(self.unreachable(Box::new(e))),
            Ok(Err(e)) => Err(self.transport(request, Box::new(e))),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// The whole body of an answer, read until `deadline`.
    async fn body(
        &self,
        request: &str,
        body: Incoming,
        deadline: tokio::time::Instant,
    ) -> Result<Bytes, ClientError> {
        match tokio::time::timeout_at(deadline, body.collect()).await {
            Err(_) => Err(self.timeout(request)),
            Ok(Err(e)) => Err(self.transport(request, Box::new(e))),
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
        }
    }

    fn timeout(&self, request: &str) -> ClientError {
        ClientError::Timeout {
            request: request.to_owned(),
            after: self.request_timeout,
        }
    }

    /// A failed connection: a TLS refusal names the CA in use; anything else is "cannot
    /// reach".
    fn unreachable(&self, source: TransportError) -> ClientError {
        if let (Some(tls), Some(ca)) = (tls_cause(source.as_ref()), &self.ca) {
            return ClientError::Tls {
                url: self.shown().to_owned(),
                ca: ca.clone(),
                reason: tls.to_string(),
            };
        }
        ClientError::Unreachable {
            url: self.shown().to_owned(),
            source,
        }
    }

    fn transport(&self, request: &str, source: TransportError) -> ClientError {
        ClientError::Transport {
            request: request.to_owned(),
            source,
        }
    }
}

/// The connection pool: HTTP, and HTTPS trusting only the certificates of `ca`.
fn http_client(
    ca: Option<&Path>,
    connect: Duration,
) -> Result<HttpsClient<Full<Bytes>>, ClientError> {
    let config = match ca {
        Some(ca) => {
            let roots = nightshift_common::tls::load_roots("--ca", ca)
                .map_err(|e| ClientError::Ca(e.to_string()))?;
            rustls::ClientConfig::builder_with_provider(nightshift_common::tls::provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| ClientError::Ca(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth()
        }
        // Plain HTTP only: no https:// peer is ever trusted.
        None => {
            nightshift_common::net::trust_nobody().map_err(|e| ClientError::Ca(e.to_string()))?
        }
    };
    Ok(nightshift_common::net::https_client(config, connect))
}

fn error_from_body(request: String, status: StatusCode, body: &[u8]) -> ClientError {
    match serde_json::from_slice::<ApiError>(body) {
        Ok(error) => ClientError::Api { status, error },
        Err(_) => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let mut body: String = text.chars().take(BODY_SNIPPET_CHARS).collect();
            if text.chars().count() > BODY_SNIPPET_CHARS {
                body.push_str("...");
            }
            if body.is_empty() {
                body = "empty body".to_owned();
            }
            ClientError::Status {
                request,
                status,
                body,
            }
        }
    }
}

/// An in-process stand-in for the coordinator's API with canned answers, shared by the
/// client's and the CLI's tests.
#[cfg(test)]
pub(crate) mod fake {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, Full};
    use hyper::body::{Bytes, Incoming};
    use hyper::{HeaderMap, Method, StatusCode};
    use hyper_util::rt::TokioIo;
    use nightshift_common::{
        ApiError, AttemptEnding, AttemptMember, AttemptView, CheckpointPolicy, JobList, JobSpec,
        JobState, JobView, LeaseView, NodeGpuView, NodeList, NodeMode, NodeView, ReplicaState,
        ReplicaStatus, ServingSignals,
    };
    use serde::Serialize;

    pub const T0: u64 = 1_700_000_000_000;

    pub fn spec(name: &str, gpus: u32) -> JobSpec {
        JobSpec {
            name: name.into(),
            image: "registry.example/team/trainer:1.4".into(),
            command: vec![],
            args: vec![],
            env: vec![],
            gpus,
            nodes: 1,
            priority: 0,
            owner: None,
            checkpoint: CheckpointPolicy::default(),
            retry: Default::default(),
            capture: Default::default(),
            files: Vec::new(),
            sandbox: Default::default(),
            max_run_seconds: None,
        }
    }

    pub fn queued(id: u64, spec: JobSpec) -> JobView {
        JobView::queued(id, spec, T0)
    }

    /// An attempt that ran on `nodes` (GPUs 0 and 1 of each, epoch 7) and succeeded.
    pub fn attempt(attempt: u32, nodes: &[&str]) -> AttemptView {
        AttemptView {
            attempt,
            members: nodes
                .iter()
                .map(|n| AttemptMember {
                    node: (*n).into(),
                    gpus: vec![0, 1],
                    epoch: 7,
                })
                .collect(),
            leased_at: T0 + 50_000,
            started_at: Some(T0 + 60_000),
            ended_at: Some(T0 + 252_000),
            ending: Some(AttemptEnding::Succeeded),
            exit_code: Some(0),
            message: None,
        }
    }

    pub fn running(id: u64, spec: JobSpec) -> JobView {
        let gpus = (0..spec.gpus).collect();
        JobView {
            state: JobState::Running,
            attempt: 2,
            preemptions: 1,
            started_at: Some(T0 + 60_000),
            leases: vec![LeaseView {
                lease_id: 14,
                epoch: 7,
                rank: 0,
                node: "gpu-03".into(),
                gpus,
                granted_at: T0 + 50_000,
                expires_at: T0 + 400_000,
                revoked: false,
            }],
            ..queued(id, spec)
        }
    }

    pub fn node(name: &str, mode: NodeMode, jobs: [Option<u64>; 4]) -> NodeView {
        NodeView {
            name: name.into(),
            service: "llama-70b".into(),
            mode,
            desired_version: 3,
            applied_version: 3,
            gpus: jobs
                .iter()
                .enumerate()
                .map(|(i, job_id)| NodeGpuView {
                    index: i as u32,
                    uuid: format!("GPU-{name}-{i}"),
                    name: "NVIDIA H100 80GB HBM3".into(),
                    memory_total_bytes: 80 << 30,
                    memory_used_bytes: Some(1 << 30),
                    job_id: *job_id,
                    healthy: Some(true),
                    unhealthy_reason: None,
                    utilization_gpu_percent: Some(if job_id.is_some() { 97 } else { 0 }),
                    power_milliwatts: Some(312_000),
                    temperature_celsius: Some(54),
                })
                .collect(),
            replica: Some(ReplicaStatus {
                state: match mode {
                    NodeMode::Serve => ReplicaState::Serving,
                    NodeMode::Lend => ReplicaState::Stopped,
                },
                signals: ServingSignals::default(),
                url: None,
            }),
            reachable: true,
            last_heartbeat: Some(T0 + 299_000),
            recent_phases: vec![],
        }
    }

    /// A request as the fake sees it.
    pub struct Request {
        pub method: Method,
        pub path: String,
        pub headers: HeaderMap,
        pub body: Bytes,
    }

    /// The fake's answer: a status and a body, or none at all (a coordinator that hangs).
    pub enum Reply {
        Body(StatusCode, String),
        Never,
    }

    /// `value` as a JSON body.
    pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Reply {
        Reply::Body(status, serde_json::to_string(value).unwrap())
    }

    fn not_found(id: u64) -> Reply {
        let error = ApiError {
            error: format!("job {id} not found"),
            field: None,
        };
        json(StatusCode::NOT_FOUND, &error)
    }

    /// The canned coordinator: job 7 exists (running), job 8 is queued; submitting more than
    /// 4 GPUs is refused with 409 on `gpus`.
    pub fn coordinator(req: &Request) -> Reply {
        let job_id = |rest: &str| rest.parse::<u64>().ok();
        match (&req.method, req.path.as_str()) {
            (&Method::GET, "/healthz") => Reply::Body(StatusCode::OK, "ok".into()),
            (&Method::POST, "/v1/jobs") => {
                let spec: JobSpec = match serde_json::from_slice(&req.body) {
                    Ok(spec) => spec,
                    Err(e) => return Reply::Body(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()),
                };
                if spec.gpus > 4 {
                    let error = ApiError {
                        error: "no node has more than 4 gpus".into(),
                        field: Some("gpus".into()),
                    };
                    return json(StatusCode::CONFLICT, &error);
                }
                json(StatusCode::CREATED, &queued(9, spec))
            }
            (&Method::GET, "/v1/jobs") => json(
                StatusCode::OK,
                &JobList {
                    jobs: vec![
                        running(7, spec("train-llama", 2)),
                        queued(8, spec("eval", 1)),
                    ],
                },
            ),
            (&Method::GET, "/v1/nodes") => json(
                StatusCode::OK,
                &NodeList {
                    nodes: vec![
                        node("gpu-01", NodeMode::Serve, [None; 4]),
                        node("gpu-03", NodeMode::Lend, [Some(7), Some(7), None, None]),
                    ],
                },
            ),
            (method, path) => {
                let Some(rest) = path.strip_prefix("/v1/jobs/") else {
                    return Reply::Body(StatusCode::NOT_FOUND, String::new());
                };
                match (method, rest.strip_suffix("/cancel")) {
                    (&Method::POST, Some(id)) => match job_id(id) {
                        Some(7) => json(
                            StatusCode::OK,
                            &JobView {
                                state: JobState::Cancelling,
                                ..running(7, spec("train-llama", 2))
                            },
                        ),
                        Some(id) => not_found(id),
                        None => Reply::Body(StatusCode::BAD_REQUEST, String::new()),
                    },
                    (&Method::GET, None) => match job_id(rest) {
                        Some(7) => json(StatusCode::OK, &running(7, spec("train-llama", 2))),
                        Some(id) => not_found(id),
                        None => Reply::Body(StatusCode::BAD_REQUEST, String::new()),
                    },
                    _ => Reply::Body(StatusCode::METHOD_NOT_ALLOWED, String::new()),
                }
            }
        }
    }

    /// Serves `routes` on an ephemeral port (HTTP/1.1 on hyper); returns its base URL and a
    /// count of the requests it has received.
    pub async fn serve(
        routes: impl Fn(&Request) -> Reply + Send + Sync + 'static,
    ) -> (String, Arc<AtomicUsize>) {
        let hits = Arc::new(AtomicUsize::new(0));
        let routes = Arc::new(routes);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counter = hits.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (routes, counter) = (routes.clone(), counter.clone());
                let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                    let (routes, counter) = (routes.clone(), counter.clone());
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        let (parts, body) = req.into_parts();
                        let body = body.collect().await?.to_bytes();
                        let request = Request {
                            method: parts.method,
                            path: parts.uri.path().to_owned(),
                            headers: parts.headers,
                            body,
                        };
                        let (status, body) = match routes(&request) {
                            Reply::Body(status, body) => (status, body),
                            Reply::Never => std::future::pending().await,
                        };
                        let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
                        *response.status_mut() = status;
                        Ok::<_, hyper::Error>(response)
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (format!("http://{addr}"), hits)
    }

    /// A base URL on which nothing listens.
    pub fn refused_url() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        format!("http://{addr}")
    }
}

#[cfg(test)]
mod tests {
    use nightshift_common::{JobState, NodeList};

    use super::fake::{self, Reply, json, serve};
    use super::*;

    #[tokio::test]
    async fn calls_decode_the_api_objects() {
        let (url, hits) = serve(fake::coordinator).await;
        let client = Client::new(&url).unwrap();
        client.healthz().await.unwrap();
        let job = client.submit(&fake::spec("sft", 2)).await.unwrap();
        assert_eq!(
            (job.id, job.state, job.spec.name.as_str()),
            (9, JobState::Queued, "sft")
        );
        assert_eq!(client.jobs().await.unwrap().jobs.len(), 2);
        assert_eq!(client.job(7).await.unwrap().leases[0].node, "gpu-03");
        assert_eq!(client.cancel(7).await.unwrap().state, JobState::Cancelling);
        assert_eq!(client.nodes().await.unwrap().nodes[1].name, "gpu-03");
        assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 6);
    }

    #[tokio::test]
    async fn refusals_keep_status_and_field() {
        let (url, _) = serve(fake::coordinator).await;
        let client = Client::new(&url).unwrap();
        let err = client.submit(&fake::spec("big", 8)).await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::CONFLICT));
        assert_eq!(err.field(), Some("gpus"));
        assert_eq!(
            err.to_string(),
            "409 Conflict: gpus: no node has more than 4 gpus"
        );

        let err = client.job(99).await.unwrap_err();
        assert_eq!(err.to_string(), "404 Not Found: job 99 not found");
    }

    #[tokio::test]
    async fn a_body_that_is_not_the_api_object_is_a_decode_error() {
        let (url, _) = serve(|req| match req.path.as_str() {
            "/v1/nodes" => Reply::Body(StatusCode::OK, r#"{"nodes": [{"name": 3}]}"#.into()),
            _ => Reply::Body(StatusCode::BAD_GATEWAY, "upstream connect error".into()),
        })
        .await;
        let client = Client::new(&url).unwrap();
        let err = client.nodes().await.unwrap_err();
        assert!(matches!(err, ClientError::Decode { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with(&format!("unexpected answer to GET {url}/v1/nodes: "))
        );

        let err = client.jobs().await.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("502 Bad Gateway from GET {url}/v1/jobs: upstream connect error")
        );
    }

    #[tokio::test]
    async fn a_coordinator_that_never_answers_times_out() {
        let (url, _) = serve(|_| Reply::Never).await;
        let client = Client::with_timeouts(&url, None, CONNECT_TIMEOUT, Duration::from_millis(200));
        let err = client.unwrap().jobs().await.unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("the coordinator did not answer GET {url}/v1/jobs within 200ms")
        );
    }

    #[tokio::test]
    async fn several_coordinators_the_one_that_answers_is_followed() {
        let standby = |_: &fake::Request| {
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                &ApiError {
                    error: "this coordinator is a standby".into(),
                    field: None,
                },
            )
        };
        let (standby_url, standby_hits) = serve(standby).await;
        let (leader_url, leader_hits) = serve(fake::coordinator).await;
        let dead = fake::refused_url();
        let client = Client::new(&format!("{dead},{standby_url}, {leader_url}")).unwrap();
        assert_eq!(client.base_url(), dead);
        assert_eq!(client.jobs().await.unwrap().jobs.len(), 2);
        assert_eq!(
            client.base_url(),
            leader_url,
            "the leader is asked first now"
        );
        assert_eq!(standby_hits.load(std::sync::atomic::Ordering::SeqCst), 1);
        client.job(7).await.unwrap();
        assert_eq!(standby_hits.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(leader_hits.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A refusal by the leader is its answer: no other coordinator is asked.
        let err = client.job(99).await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::NOT_FOUND));
        assert_eq!(standby_hits.load(std::sync::atomic::Ordering::SeqCst), 1);
        // None leads: the standby's answer, not the dead one's silence.
        let none = Client::new(&format!("{dead},{standby_url}")).unwrap();
        let err = none.jobs().await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE), "{err}");
    }

    #[tokio::test]
    async fn connection_refused_is_explained() {
        let url = fake::refused_url();
        let err = Client::new(&url).unwrap().jobs().await.unwrap_err();
        assert!(matches!(err, ClientError::Unreachable { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "cannot reach the coordinator at {url}: connection refused \
                 (is nightshift-coordinator running? set --coordinator or NIGHTSHIFT_URL)"
            )
        );
    }

    #[tokio::test]
    async fn a_token_goes_as_a_bearer_and_is_never_shown() {
        let (url, _) = serve(|req| {
            let auth = req
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            if auth == Some("Bearer nst_secret") {
                json(StatusCode::OK, &NodeList { nodes: vec![] })
            } else {
                let error = ApiError {
                    error: "an API token is required".into(),
                    field: None,
                };
                json(StatusCode::UNAUTHORIZED, &error)
            }
        })
        .await;
        let anonymous = Client::new(&url).unwrap();
        let err = anonymous.nodes().await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::UNAUTHORIZED));
        let client = Client::new(&url)
            .unwrap()
            .with_token(Some("nst_secret".into()));
        assert!(client.nodes().await.unwrap().nodes.is_empty());
        assert!(!format!("{client:?}").contains("nst_secret"));
    }

    #[test]
    fn base_url_is_validated_and_normalised() {
        let c = Client::new("http://127.0.0.1:7400").unwrap();
        assert_eq!(c.base_url(), "http://127.0.0.1:7400");
        assert_eq!(
            c.base().join("v1/jobs").unwrap().as_str(),
            "http://127.0.0.1:7400/v1/jobs"
        );

        let c = Client::new("http://gw.example/nightshift").unwrap();
        assert_eq!(
            c.base().join("v1/jobs").unwrap().as_str(),
            "http://gw.example/nightshift/v1/jobs"
        );

        for (url, reason) in [
            ("127.0.0.1:7400", "expected http://host:port"),
            ("localhost:7400", "expected http://host:port"),
            ("http://", "empty host"),
            ("https://coord:7400", "https needs the cluster CA"),
            ("ftp://coord", "scheme"),
            ("http://coord:7400/?x=1", "query"),
            ("http://user:pw@coord:7400", "credentials"),
        ] {
            let err = Client::new(url).unwrap_err();
            assert!(
                matches!(err, ClientError::InvalidUrl { .. }),
                "{url}: {err:?}"
            );
            let msg = err.to_string();
            assert!(msg.contains(url) && msg.contains(reason), "{url}: {msg}");
        }
    }

    #[test]
    fn api_error_names_status_and_field_once() {
        let err = ClientError::Api {
            status: StatusCode::CONFLICT,
            error: ApiError {
                error: "no node has 8 gpus".into(),
                field: Some("gpus".into()),
            },
        };
        assert_eq!(err.to_string(), "409 Conflict: gpus: no node has 8 gpus");
        assert_eq!(err.field(), Some("gpus"));

        let err = ClientError::Api {
            status: StatusCode::BAD_REQUEST,
            error: ApiError {
                error: "gpus: must be at least 1".into(),
                field: Some("gpus".into()),
            },
        };
        assert_eq!(err.to_string(), "400 Bad Request: gpus: must be at least 1");

        let err = ClientError::Api {
            status: StatusCode::NOT_FOUND,
            error: ApiError {
                error: "job 7 not found".into(),
                field: None,
            },
        };
        assert_eq!(err.to_string(), "404 Not Found: job 7 not found");
    }

    #[test]
    fn a_foreign_error_body_is_kept_short() {
        let err = error_from_body(
            "GET http://c/v1/jobs".into(),
            StatusCode::BAD_GATEWAY,
            "<html>".repeat(100).as_bytes(),
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with("502 Bad Gateway from GET http://c/v1/jobs: <html>"),
            "{msg}"
        );
        assert!(msg.ends_with("..."), "{msg}");
        assert_eq!(err.status(), Some(StatusCode::BAD_GATEWAY));
    }
}
