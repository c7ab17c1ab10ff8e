//! A small activator-style gateway in front of one node's replica, as Knative's activator is
//! in front of a scaled-to-zero revision: it forwards OpenAI-style completion requests to the
//! replica while the agent says it is ready, and holds them while it is not (no replica,
//! draining, starting), so clients never see the replica come and go.
//!
//! Three tasks make it up:
//! - the HTTP server (`POST /v1/completions`, `POST /v1/chat/completions`);
//! - a poller that reads `GET {agent}/status` every `poll` and publishes `(ready, replica_url)`
//!   in a watch channel;
//! - a reporter that posts `{"waiting": held}` to `POST {coordinator}/v1/services/{service}/gateway`
//!   every `report_every` while requests are held, and once more when none are, so that the
//!   autoscaler takes the node back from a job when traffic returns.
//!
//! A forward that fails at the connection level (refused, reset before any answer: the replica
//! went away between the readiness poll and the send) is retried after waiting for readiness
//! again, within `hold_timeout`. Any HTTP answer from the replica is passed back as is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, OriginalUri, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use nightshift_common::{ApiError, GatewaySignals};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Largest request body the gateway accepts (long prompts).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Timeout of one call to the agent or the coordinator.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);
/// Timeout of establishing a connection to the replica (a refused one fails at once).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the gateway looks and reports, and how patient it is.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The agent's status endpoint, e.g. `http://127.0.0.1:9000/status`.
    pub agent_status_url: String,
    /// The coordinator's base URL, e.g. `http://127.0.0.1:8080`.
    pub coordinator_url: String,
    /// The service this gateway fronts; its waiting requests are reported under this name.
    pub service: String,
    /// How long a request may wait for a ready replica before the gateway answers 503.
    pub hold_timeout: Duration,
    /// How often the agent's status is read.
    pub poll: Duration,
    /// How often the number of held requests is reported while it is above zero.
    pub report_every: Duration,
}

impl GatewayConfig {
    /// A configuration with the default `poll` (100 ms) and `report_every` (250 ms).
    pub fn new(
        agent_status_url: impl Into<String>,
        coordinator_url: impl Into<String>,
        service: impl Into<String>,
        hold_timeout: Duration,
    ) -> Self {
        Self {
            agent_status_url: agent_status_url.into(),
            coordinator_url: coordinator_url.into(),
            service: service.into(),
            hold_timeout,
            poll: Duration::from_millis(100),
            report_every: Duration::from_millis(250),
        }
    }
}

/// What the gateway has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GatewayStats {
    /// Requests answered by the replica (any status).
    pub forwarded: u64,
    /// Requests that had to wait for a ready replica at least once.
    pub held_total: u64,
    /// The most requests held at the same time.
    pub max_held: u64,
    /// Forwards retried after a connection-level failure.
    pub retried: u64,
    /// Requests the gateway answered with an error itself (hold timeout, broken answer).
    pub failed: u64,
}

/// A running gateway; [`Gateway::stop`] (or dropping it) shuts it down.
pub struct Gateway {
    addr: Option<SocketAddr>,
    inner: Arc<Inner>,
    shutdown: Option<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Gateway {
    /// The address the gateway listens on, when the listener could tell.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Requests held right now for want of a ready replica.
    pub fn held(&self) -> u64 {
        self.inner.counters.held.load(Ordering::Relaxed)
    }

    /// Counters since the start.
    pub fn stats(&self) -> GatewayStats {
        self.inner.counters.stats()
    }

    /// Stops accepting requests and stops polling and reporting. Requests still held are
    /// answered 503 at once.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // The server task ends by itself (graceful shutdown); the poller owns the readiness
        // sender, so aborting it wakes every held request with "gateway stopped".
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts the gateway on `listener`.
pub async fn start(listener: TcpListener, cfg: GatewayConfig) -> Gateway {
    let addr = listener.local_addr().ok();
    let client = build_client();
    let (ready_tx, ready_rx) = watch::channel(Readiness::default());
    let inner = Arc::new(Inner {
        client: client.clone(),
        ready: ready_rx,
        hold_timeout: cfg.hold_timeout,
        poll: cfg.poll,
        counters: Counters::default(),
    });
    let (shutdown_tx, shutdown_rx) = oneshot::channel();
    let poller = tokio::spawn(poll_agent(
        client.clone(),
        cfg.agent_status_url.clone(),
        cfg.poll,
        ready_tx,
    ));
    let reporter = tokio::spawn(report_waiting(client, cfg, inner.clone()));
    let server = tokio::spawn(serve(listener, router(inner.clone()), shutdown_rx));
    tracing::info!(addr = ?addr, "gateway listening");
    Gateway {
        addr,
        inner,
        shutdown: Some(shutdown_tx),
        tasks: vec![poller, reporter, server],
    }
}

fn build_client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "building the HTTP client failed; using the defaults");
            reqwest::Client::new()
        })
}

/// What the agent last said about its replica.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Readiness {
    ready: bool,
    replica_url: Option<String>,
}

impl Readiness {
    /// The replica's base URL when requests may be sent to it.
    fn target(&self) -> Option<&str> {
        if self.ready {
            self.replica_url.as_deref()
        } else {
            None
        }
    }
}

/// The fields of the agent's `GET /status` the gateway needs.
#[derive(Debug, Deserialize)]
struct AgentStatus {
    ready: bool,
    #[serde(default)]
    replica_url: Option<String>,
}

struct Inner {
    client: reqwest::Client,
    ready: watch::Receiver<Readiness>,
    hold_timeout: Duration,
    poll: Duration,
    counters: Counters,
}

#[derive(Default)]
struct Counters {
    held: AtomicU64,
    forwarded: AtomicU64,
    held_total: AtomicU64,
    max_held: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
}

impl Counters {
    fn stats(&self) -> GatewayStats {
        GatewayStats {
            forwarded: self.forwarded.load(Ordering::Relaxed),
            held_total: self.held_total.load(Ordering::Relaxed),
            max_held: self.max_held.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

/// Counts one request as held while it lives; it stops counting when dropped, also when the
/// client goes away and the handler is cancelled.
struct HeldGuard<'a> {
    counters: &'a Counters,
}

impl<'a> HeldGuard<'a> {
    fn new(counters: &'a Counters) -> Self {
        let now = counters.held.fetch_add(1, Ordering::Relaxed) + 1;
        counters.max_held.fetch_max(now, Ordering::Relaxed);
        Self { counters }
    }
}

impl Drop for HeldGuard<'_> {
    fn drop(&mut self) {
        self.counters.held.fetch_sub(1, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------------
// Background tasks

async fn serve(listener: TcpListener, app: Router, shutdown: oneshot::Receiver<()>) {
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = shutdown.await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "gateway server failed");
    }
}

/// Reads the agent's status every `poll` and publishes it. When the agent cannot be read, the
/// last known state stands: a replica that really went away shows up as a refused forward,
/// which is retried.
async fn poll_agent(
    client: reqwest::Client,
    url: String,
    poll: Duration,
    tx: watch::Sender<Readiness>,
) {
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match read_status(&client, &url).await {
            Ok(now) => publish(&tx, now),
            Err(e) => tracing::debug!(error = %e, %url, "reading the agent's status failed"),
        }
    }
}

async fn read_status(client: &reqwest::Client, url: &str) -> Result<Readiness, reqwest::Error> {
    let status: AgentStatus = client
        .get(url)
        .timeout(CONTROL_TIMEOUT)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(Readiness {
        ready: status.ready,
        replica_url: status.replica_url,
    })
}

fn publish(tx: &watch::Sender<Readiness>, now: Readiness) {
    tx.send_if_modified(|old| {
        if *old == now {
            return false;
        }
        tracing::info!(ready = now.ready, replica_url = ?now.replica_url, "replica readiness changed");
        *old = now;
        true
    });
}

/// Reports the number of held requests while it is above zero, and once when it drops to zero.
async fn report_waiting(client: reqwest::Client, cfg: GatewayConfig, inner: Arc<Inner>) {
    let url = format!(
        "{}/v1/services/{}/gateway",
        cfg.coordinator_url.trim_end_matches('/'),
        cfg.service
    );
    let mut tick = tokio::time::interval(cfg.report_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_reported = 0;
    loop {
        tick.tick().await;
        let waiting = inner.counters.held.load(Ordering::Relaxed);
        if waiting == 0 && last_reported == 0 {
            continue;
        }
        match send_report(&client, &url, waiting).await {
            Ok(()) => last_reported = waiting,
            Err(e) => {
                tracing::debug!(error = %e, %url, waiting, "reporting to the coordinator failed")
            }
        }
    }
}

async fn send_report(
    client: &reqwest::Client,
    url: &str,
    waiting: u64,
) -> Result<(), reqwest::Error> {
    client
        .post(url)
        .timeout(CONTROL_TIMEOUT)
        .json(&GatewaySignals { waiting })
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Request path

fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/v1/completions", post(proxy))
        .route("/v1/chat/completions", post(proxy))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(inner)
}

/// Why the gateway answers a request itself.
#[derive(Debug, thiserror::Error)]
enum GatewayError {
    #[error("no replica became ready within {0:?}")]
    HoldTimeout(Duration),
    #[error("the gateway is stopping")]
    Stopped,
    #[error("forwarding to the replica failed: {0}")]
    Upstream(reqwest::Error),
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let status = match self {
            GatewayError::HoldTimeout(_) | GatewayError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::Upstream(_) => StatusCode::BAD_GATEWAY,
        };
        let body = ApiError {
            error: self.to_string(),
            field: None,
        };
        (status, axum::Json(body)).into_response()
    }
}

/// The parts of the client's request that travel to the replica.
struct Outgoing {
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

async fn proxy(
    State(inner): State<Arc<Inner>>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let req = Outgoing {
        path,
        headers: forwarded_headers(&headers),
        body,
    };
    match forward_until_answered(&inner, &req).await {
        Ok(resp) => {
            inner.counters.forwarded.fetch_add(1, Ordering::Relaxed);
            resp
        }
        Err(e) => {
            inner.counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, path = %req.path, "request failed at the gateway");
            e.into_response()
        }
    }
}

fn forwarded_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in [CONTENT_TYPE, AUTHORIZATION] {
        if let Some(value) = headers.get(&name) {
            out.insert(name, value.clone());
        }
    }
    out
}

/// Waits for a ready replica and forwards; retries connection-level failures until the hold
/// deadline.
async fn forward_until_answered(inner: &Inner, req: &Outgoing) -> Result<Response, GatewayError> {
    let deadline = Instant::now() + inner.hold_timeout;
    let mut was_held = false;
    loop {
        let target = wait_ready(inner, deadline, &mut was_held).await?;
        match send(inner, &target, req).await {
            Ok(resp) => return pass_back(resp).await,
            Err(e) if is_retryable(&e) => {
                inner.counters.retried.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, %target, "replica unreachable; holding the request");
                back_off(inner, deadline, &mut was_held).await?;
            }
            Err(e) => return Err(GatewayError::Upstream(e)),
        }
    }
}

/// The replica's URL once it is ready; counts the request as held while it waits.
async fn wait_ready(
    inner: &Inner,
    deadline: Instant,
    was_held: &mut bool,
) -> Result<String, GatewayError> {
    let mut rx = inner.ready.clone();
    if let Some(url) = rx.borrow_and_update().target() {
        return Ok(url.to_owned());
    }
    let _held = hold(inner, was_held);
    let waited = tokio::time::timeout_at(deadline, rx.wait_for(|r| r.target().is_some())).await;
    match waited {
        Err(_) => Err(GatewayError::HoldTimeout(inner.hold_timeout)),
        Ok(Err(_)) => Err(GatewayError::Stopped),
        Ok(Ok(r)) => r.target().map(str::to_owned).ok_or(GatewayError::Stopped),
    }
}

/// After a refused forward the readiness may still say "ready" until the next poll: wait one
/// poll period (counted as held) before looking again.
async fn back_off(
    inner: &Inner,
    deadline: Instant,
    was_held: &mut bool,
) -> Result<(), GatewayError> {
    let _held = hold(inner, was_held);
    let until = (Instant::now() + inner.poll).min(deadline);
    tokio::time::sleep_until(until).await;
    if Instant::now() >= deadline {
        return Err(GatewayError::HoldTimeout(inner.hold_timeout));
    }
    Ok(())
}

fn hold<'a>(inner: &'a Inner, was_held: &mut bool) -> HeldGuard<'a> {
    if !*was_held {
        *was_held = true;
        inner.counters.held_total.fetch_add(1, Ordering::Relaxed);
    }
    HeldGuard::new(&inner.counters)
}

async fn send(
    inner: &Inner,
    target: &str,
    req: &Outgoing,
) -> Result<reqwest::Response, reqwest::Error> {
    let url = format!("{}{}", target.trim_end_matches('/'), req.path);
    inner
        .client
        .post(url)
        .headers(req.headers.clone())
        .body(req.body.clone())
        .send()
        .await
}

/// A failure before any answer came back: the replica was not there (refused, reset, closed).
/// Timeouts are not retried: the replica may be working on the request.
fn is_retryable(e: &reqwest::Error) -> bool {
    e.is_connect() || (e.is_request() && !e.is_timeout())
}

/// Passes the replica's answer back: status, content type and body.
async fn pass_back(resp: reqwest::Response) -> Result<Response, GatewayError> {
    let status = resp.status();
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let body = resp.bytes().await.map_err(GatewayError::Upstream)?;
    let mut out = Response::new(Body::from(body));
    *out.status_mut() = status;
    if let Some(ct) = content_type {
        out.headers_mut().insert(CONTENT_TYPE, ct);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Json;
    use axum::routing::get;
    use std::sync::Mutex;

    /// What the fake agent says.
    #[derive(Clone, Default)]
    struct FakeAgent(Arc<Mutex<Readiness>>);

    impl FakeAgent {
        fn set(&self, ready: bool, url: Option<String>) {
            *self.0.lock().unwrap() = Readiness {
                ready,
                replica_url: url,
            };
        }
    }

    async fn spawn_app(listener: TcpListener, app: Router) {
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
    }

    async fn bind() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        (l, url)
    }

    async fn fake_agent() -> (FakeAgent, String) {
        let agent = FakeAgent::default();
        let a = agent.clone();
        let app = Router::new().route(
            "/status",
            get(move || {
                let r = a.0.lock().unwrap().clone();
                async move {
                    let replica = if r.ready { "serving" } else { "stopped" };
                    Json(serde_json::json!({
                        "node": "n1", "ready": r.ready, "replica": replica,
                        "replica_url": r.replica_url, "applied_version": 1, "jobs": [],
                    }))
                }
            }),
        );
        let (l, url) = bind().await;
        spawn_app(l, app).await;
        (agent, format!("{url}/status"))
    }

    async fn fake_coordinator() -> (Arc<Mutex<Vec<u64>>>, String) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let app = Router::new().route(
            "/v1/services/{service}/gateway",
            post(
                move |axum::extract::Path(svc): axum::extract::Path<String>,
                      Json(sig): Json<GatewaySignals>| {
                    assert_eq!(svc, "chat");
                    s.lock().unwrap().push(sig.waiting);
                    async { StatusCode::NO_CONTENT }
                },
            ),
        );
        let (l, url) = bind().await;
        spawn_app(l, app).await;
        (seen, url)
    }

    fn replica_app(status: StatusCode) -> Router {
        Router::new().route(
            "/v1/completions",
            post(move |body: String| async move {
                (status, Json(serde_json::json!({ "echo": body })))
            }),
        )
    }

    async fn fake_replica(status: StatusCode) -> String {
        let (l, url) = bind().await;
        spawn_app(l, replica_app(status)).await;
        url
    }

    async fn gateway(agent_url: String, coord_url: String, hold: Duration) -> (Gateway, String) {
        let (l, url) = bind().await;
        let mut cfg = GatewayConfig::new(agent_url, coord_url, "chat", hold);
        cfg.poll = Duration::from_millis(20);
        cfg.report_every = Duration::from_millis(50);
        (start(l, cfg).await, url)
    }

    async fn complete(gw: &str) -> reqwest::Response {
        reqwest::Client::new()
            .post(format!("{gw}/v1/completions"))
            .header(CONTENT_TYPE, "application/json")
            .body(r#"{"model":"m","prompt":"hi"}"#)
            .send()
            .await
            .unwrap()
    }

    async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn forwards_when_ready_and_passes_answers_back_as_is() {
        let (agent, agent_url) = fake_agent().await;
        let (seen, coord_url) = fake_coordinator().await;
        agent.set(
            true,
            Some(fake_replica(StatusCode::INTERNAL_SERVER_ERROR).await),
        );
        let (gw, url) = gateway(agent_url, coord_url, Duration::from_secs(5)).await;
        eventually("readiness", || gw.inner.ready.borrow().target().is_some()).await;
        let resp = complete(&url).await;
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["echo"], r#"{"model":"m","prompt":"hi"}"#);
        let stats = gw.stats();
        assert_eq!(
            (
                stats.forwarded,
                stats.held_total,
                stats.retried,
                stats.failed
            ),
            (1, 0, 0, 0)
        );
        assert!(
            seen.lock().unwrap().is_empty(),
            "nothing held, nothing reported"
        );
        gw.stop();
    }

    #[tokio::test]
    async fn holds_while_not_ready_reports_waiting_then_forwards() {
        let (agent, agent_url) = fake_agent().await;
        let (seen, coord_url) = fake_coordinator().await;
        let (gw, url) = gateway(agent_url, coord_url, Duration::from_secs(10)).await;
        let clients: Vec<_> = (0..3)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { complete(&url).await })
            })
            .collect();
        eventually("3 held", || gw.held() == 3).await;
        eventually("a waiting report", || {
            seen.lock().unwrap().iter().any(|&w| w > 0)
        })
        .await;
        agent.set(true, Some(fake_replica(StatusCode::OK).await));
        for c in clients {
            assert_eq!(c.await.unwrap().status(), StatusCode::OK);
        }
        eventually("a report of 0", || seen.lock().unwrap().last() == Some(&0)).await;
        assert_eq!(gw.held(), 0);
        let stats = gw.stats();
        assert_eq!(
            (stats.forwarded, stats.held_total, stats.max_held),
            (3, 3, 3)
        );
        assert_eq!(stats.failed, 0);
        // Only one report of 0 while nothing is held.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(seen.lock().unwrap().iter().filter(|&&w| w == 0).count(), 1);
        gw.stop();
    }

    #[tokio::test]
    async fn retries_a_refused_forward_until_the_replica_listens() {
        let (agent, agent_url) = fake_agent().await;
        let (_seen, coord_url) = fake_coordinator().await;
        // The agent says ready, but nothing listens on the replica's port yet.
        let (l, replica_url) = bind().await;
        let addr = l.local_addr().unwrap();
        drop(l);
        agent.set(true, Some(replica_url));
        let (gw, url) = gateway(agent_url, coord_url, Duration::from_secs(10)).await;
        eventually("readiness", || gw.inner.ready.borrow().target().is_some()).await;
        let client = tokio::spawn({
            let url = url.clone();
            async move { complete(&url).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(gw.stats().retried > 0, "refused forwards are retried");
        let l = TcpListener::bind(addr).await.unwrap();
        spawn_app(l, replica_app(StatusCode::OK)).await;
        assert_eq!(client.await.unwrap().status(), StatusCode::OK);
        let stats = gw.stats();
        assert_eq!((stats.forwarded, stats.failed), (1, 0));
        gw.stop();
    }

    #[tokio::test]
    async fn retries_a_forward_the_replica_closes_without_an_answer() {
        let (agent, agent_url) = fake_agent().await;
        let (_seen, coord_url) = fake_coordinator().await;
        // The replica reads the first request and closes the connection (it was stopping),
        // then serves.
        let (l, replica_url) = bind().await;
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut conn, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf).await;
            drop(conn);
            axum::serve(l, replica_app(StatusCode::OK)).await.unwrap();
        });
        agent.set(true, Some(replica_url));
        let (gw, url) = gateway(agent_url, coord_url, Duration::from_secs(10)).await;
        eventually("readiness", || gw.inner.ready.borrow().target().is_some()).await;
        assert_eq!(complete(&url).await.status(), StatusCode::OK);
        let stats = gw.stats();
        assert_eq!((stats.forwarded, stats.retried, stats.failed), (1, 1, 0));
        gw.stop();
    }

    #[tokio::test]
    async fn answers_503_after_the_hold_timeout() {
        let (_agent, agent_url) = fake_agent().await;
        let (_seen, coord_url) = fake_coordinator().await;
        let (gw, url) = gateway(agent_url, coord_url, Duration::from_millis(300)).await;
        let started = Instant::now();
        let resp = complete(&url).await;
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(started.elapsed() >= Duration::from_millis(300));
        let body: ApiError = resp.json().await.unwrap();
        assert!(
            body.error.contains("no replica became ready"),
            "{}",
            body.error
        );
        let stats = gw.stats();
        assert_eq!((stats.failed, stats.held_total, stats.forwarded), (1, 1, 0));
        assert_eq!(gw.held(), 0);
        gw.stop();
    }
}
