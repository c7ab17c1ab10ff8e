//! The `ServingMetrics` adapter for a live vLLM server: `GET /health` and `GET /metrics`.
//!
//! Every request has its own timeout and the metrics body is read up to a bound, so a stuck
//! or runaway server costs the agent at most one timeout per call. Failures never propagate
//! out of the port: `health` answers [`Health::Unreachable`] when no HTTP answer came, and
//! `signals` answers all-`None` signals. Why a page could not be read is logged once at
//! `warn` when it starts (and again only when the reason changes), and once at `info` when
//! the page is readable again, not at every scrape.
//!
//! It also drives vLLM's dev-mode sleep endpoints (`/sleep`, `/wake_up`, `/is_sleeping`,
//! mounted with `VLLM_SERVER_DEV_MODE=1`), and keeps a [`LoadWindow`] per replica so that
//! the signals carry token rates and TTFT quantiles from successive scrapes.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nightshift_common::ServingSignals;
use reqwest::StatusCode;
use reqwest::header::ACCEPT;

use super::prometheus::Scrape;
use super::vllm::VllmSnapshot;
use super::window::{DEFAULT_SPAN, LoadWindow};
use super::{Health, ServingError, ServingMetrics};

/// How long `/health` may take, connection included.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);
/// How long `/metrics` may take, body included.
pub const METRICS_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest `/metrics` body read; vLLM's pages are about 60 KiB.
pub const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// The text format the parser reads; without it a server could answer OpenMetrics.
const ACCEPT_TEXT_0_0_4: &str = "text/plain; version=0.0.4";

/// Scrapes a vLLM server over plain HTTP.
#[derive(Debug, Clone)]
pub struct HttpServing {
    client: reqwest::Client,
    health_timeout: Duration,
    metrics_timeout: Duration,
    max_metrics_bytes: usize,
    span: Duration,
    /// Per base URL: the scrapes of the window, and the last problem logged.
    replicas: Arc<Mutex<HashMap<String, ReplicaView>>>,
}

#[derive(Debug)]
struct ReplicaView {
    window: LoadWindow,
    problem: Option<String>,
}

/// A `/metrics` page as read (invalid UTF-8 replaced), to parse.
#[derive(Debug, Clone)]
pub struct Page(String);

impl Page {
    pub fn parse(&self) -> Scrape<'_> {
        Scrape::parse(&self.0)
    }

    pub fn text(&self) -> &str {
        &self.0
    }
}

/// The HTTP client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("could not build the http client for vllm")]
pub struct ClientBuildError(#[source] reqwest::Error);

/// Why a `/metrics` page could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// No HTTP answer: refused, reset, timed out, or a bad URL.
    #[error("get {url} failed")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("get {url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("get {url}: body larger than {limit} bytes")]
    TooLarge { url: String, limit: usize },
}

impl HttpServing {
    /// A client with the default timeouts and body bound; it ignores proxy variables, since
    /// the replica is on this host.
    pub fn new() -> Result<Self, ClientBuildError> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(HEALTH_TIMEOUT)
            .build()
            .map_err(ClientBuildError)?;
        Ok(Self {
            client,
            health_timeout: HEALTH_TIMEOUT,
            metrics_timeout: METRICS_TIMEOUT,
            max_metrics_bytes: MAX_METRICS_BYTES,
            span: DEFAULT_SPAN,
            replicas: Arc::default(),
        })
    }

    /// The window token rates and TTFT quantiles are computed over.
    pub fn with_window(mut self, span: Duration) -> Self {
        self.span = span;
        self
    }

    /// Logs why `url`'s page is unusable, once per reason, or that it is usable again.
    /// Returns whether it logged.
    fn note_problem(&self, url: &str, problem: Option<String>) -> bool {
        let mut replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        let view = replicas
            .entry(url.to_owned())
            .or_insert_with(|| ReplicaView {
                window: LoadWindow::new(self.span),
                problem: None,
            });
        if view.problem == problem {
            return false;
        }
        match &problem {
            Some(reason) => {
                tracing::warn!(url, reason = %reason, "vllm metrics unusable; signals unknown until this changes")
            }
            None => tracing::info!(url, "vllm metrics readable again"),
        }
        view.problem = problem;
        true
    }

    /// Why `url`'s last page was unusable, if it was.
    pub fn problem(&self, url: &str) -> Option<String> {
        let replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        replicas.get(url).and_then(|v| v.problem.clone())
    }

    fn derive(&self, url: &str, snapshot: &VllmSnapshot) -> super::window::Derived {
        let mut replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        replicas
            .entry(url.to_owned())
            .or_insert_with(|| ReplicaView {
                window: LoadWindow::new(self.span),
                problem: None,
            })
            .window
            .push(Instant::now(), snapshot)
    }

    async fn control(
        &self,
        method: reqwest::Method,
        url: String,
        action: &'static str,
        timeout: Duration,
    ) -> Result<reqwest::Response, ServingError> {
        let failed = |reason: String| ServingError {
            action,
            url: url.clone(),
            reason,
        };
        let response = self
            .client
            .request(method, &url)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| failed(chain(&e)))?;
        if !response.status().is_success() {
            return Err(failed(format!("status {}", response.status().as_u16())));
        }
        Ok(response)
    }

    pub fn with_timeouts(mut self, health: Duration, metrics: Duration) -> Self {
        self.health_timeout = health;
        self.metrics_timeout = metrics;
        self
    }

    pub fn with_max_metrics_bytes(mut self, limit: usize) -> Self {
        self.max_metrics_bytes = limit;
        self
    }

    /// Reads `{base_url}/metrics`; [`Page::parse`] reads its samples. Lines the parser
    /// rejects are in [`Scrape::errors`]; they do not make this fail.
    pub async fn scrape(&self, base_url: &str) -> Result<Page, ScrapeError> {
        let url = endpoint(base_url, "metrics");
        let body = self.fetch_metrics(&url).await?;
        Ok(Page(match String::from_utf8(body) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }))
    }

    /// Everything the agent reads from one scrape.
    pub async fn snapshot(&self, base_url: &str) -> Result<VllmSnapshot, ScrapeError> {
        Ok(VllmSnapshot::from_scrape(
            &self.scrape(base_url).await?.parse(),
        ))
    }

    async fn fetch_metrics(&self, url: &str) -> Result<Vec<u8>, ScrapeError> {
        let request_failed = |source| ScrapeError::Request {
            url: url.to_owned(),
            source,
        };
        let too_large = || ScrapeError::TooLarge {
            url: url.to_owned(),
            limit: self.max_metrics_bytes,
        };
        let mut response = self
            .client
            .get(url)
            .header(ACCEPT, ACCEPT_TEXT_0_0_4)
            .timeout(self.metrics_timeout)
            .send()
            .await
            .map_err(request_failed)?;
        if response.status() != StatusCode::OK {
            return Err(ScrapeError::Status {
                url: url.to_owned(),
                status: response.status().as_u16(),
            });
        }
        if response
            .content_length()
            .is_some_and(|len| len > self.max_metrics_bytes as u64)
        {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(request_failed)? {
            if body.len() + chunk.len() > self.max_metrics_bytes {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }
}

impl ServingMetrics for HttpServing {
    async fn health(&self, base_url: &str) -> Health {
        let url = endpoint(base_url, "health");
        match self
            .client
            .get(&url)
            .timeout(self.health_timeout)
            .send()
            .await
        {
            Ok(response) if response.status() == StatusCode::OK => Health::Healthy,
            Ok(response) => Health::Unhealthy(response.status().as_u16()),
            Err(error) => {
                tracing::debug!(url, error = %chain(&error), "vllm health check got no answer");
                Health::Unreachable
            }
        }
    }

    async fn signals(&self, base_url: &str) -> ServingSignals {
        let page = match self.scrape(base_url).await {
            Ok(page) => page,
            Err(error) => {
                self.note_problem(base_url, Some(chain(&error)));
                return ServingSignals::default();
            }
        };
        let scrape = page.parse();
        let snapshot = VllmSnapshot::from_scrape(&scrape);
        let problem = match (scrape.errors.first(), scrape.samples.is_empty()) {
            (Some(first), _) => Some(format!(
                "{} unreadable lines, the first: {first}",
                scrape.errors.len()
            )),
            (None, true) => Some("the page has no samples".to_owned()),
            (None, false) => None,
        };
        self.note_problem(base_url, problem);
        let derived = self.derive(base_url, &snapshot);
        ServingSignals {
            prompt_tokens_per_s: derived.prompt_tokens_per_s,
            generation_tokens_per_s: derived.generation_tokens_per_s,
            ttft_p50_s: derived.ttft_p50_s,
            ttft_p95_s: derived.ttft_p95_s,
            ..snapshot.signals()
        }
    }

    async fn sleep(
        &self,
        base_url: &str,
        level: u8,
        timeout: Duration,
    ) -> Result<(), ServingError> {
        let url = format!("{}?level={level}&mode=wait", endpoint(base_url, "sleep"));
        self.control(reqwest::Method::POST, url, "sleep", timeout)
            .await
            .map(drop)
    }

    async fn wake_up(&self, base_url: &str, timeout: Duration) -> Result<(), ServingError> {
        let url = endpoint(base_url, "wake_up");
        self.control(reqwest::Method::POST, url, "wake up", timeout)
            .await
            .map(drop)
    }

    async fn is_sleeping(&self, base_url: &str) -> Option<bool> {
        let url = endpoint(base_url, "is_sleeping");
        let response = self
            .control(
                reqwest::Method::GET,
                url,
                "ask whether asleep",
                self.health_timeout,
            )
            .await
            .ok()?;
        let body: serde_json::Value = response.json().await.ok()?;
        body.get("is_sleeping")?.as_bool()
    }
}

fn endpoint(base_url: &str, path: &str) -> String {
    format!("{}/{path}", base_url.trim_end_matches('/'))
}

/// An error and its sources, joined by ": ".
pub(crate) fn chain(error: &dyn StdError) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::body::Body;
    use axum::http::HeaderMap;
    use axum::routing::get;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/fixtures/vllm-metrics/kvwarden-vllm-0.19.1-llama3.1-8b-idle.prom"
    );

    /// Serves `router` on 127.0.0.1 and returns its base URL.
    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
        format!("http://{addr}")
    }

    fn vllm() -> Router {
        let page = std::fs::read_to_string(FIXTURE).expect("fixture readable");
        Router::new()
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/metrics", get(move || async move { page }))
    }

    /// A base URL where nothing listens.
    fn closed_port() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("local addr");
        drop(listener);
        format!("http://{addr}")
    }

    fn serving() -> HttpServing {
        HttpServing::new().expect("client")
    }

    #[tokio::test]
    async fn healthy_server_and_its_signals() {
        let base = serve(vllm()).await;
        let serving = serving();
        assert_eq!(serving.health(&base).await, Health::Healthy);
        assert_eq!(serving.health(&format!("{base}/")).await, Health::Healthy);
        assert_eq!(
            serving.signals(&base).await,
            ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                engines: Some(1),
                sleep_state: Some("awake".into()),
                ..ServingSignals::default()
            }
        );
        let snapshot = serving.snapshot(&base).await.expect("snapshot");
        assert_eq!(snapshot.prompt_tokens_total, Some(115_898.0));
    }

    #[tokio::test]
    async fn asks_for_the_0_0_4_text_format() {
        let router = Router::new().route(
            "/metrics",
            get(|headers: HeaderMap| async move {
                let accept = headers
                    .get(ACCEPT)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                let running = if accept == ACCEPT_TEXT_0_0_4 { 1 } else { 0 };
                format!("vllm:num_requests_running {running}\n")
            }),
        );
        let base = serve(router).await;
        assert_eq!(serving().signals(&base).await.requests_running, Some(1.0));
    }

    #[tokio::test]
    async fn engine_error_is_unhealthy_with_its_code() {
        let router = Router::new()
            .route("/health", get(|| async { StatusCode::SERVICE_UNAVAILABLE }))
            .route(
                "/metrics",
                get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
            );
        let base = serve(router).await;
        let serving = serving();
        assert_eq!(serving.health(&base).await, Health::Unhealthy(503));
        assert_eq!(serving.signals(&base).await, ServingSignals::default());
        assert!(matches!(
            serving.scrape(&base).await,
            Err(ScrapeError::Status { status: 500, .. })
        ));
    }

    #[tokio::test]
    async fn closed_port_is_unreachable_and_unknown() {
        let base = closed_port();
        let serving = serving();
        assert_eq!(serving.health(&base).await, Health::Unreachable);
        assert_eq!(serving.signals(&base).await, ServingSignals::default());
        let error = serving.scrape(&base).await.expect_err("nothing listens");
        assert!(matches!(error, ScrapeError::Request { .. }), "{error:?}");
        assert!(error.to_string().contains(&base), "{error}");
    }

    #[tokio::test]
    async fn bad_url_is_unreachable() {
        let serving = serving();
        assert_eq!(serving.health("not a url").await, Health::Unreachable);
        assert_eq!(
            serving.signals("not a url").await,
            ServingSignals::default()
        );
    }

    #[tokio::test]
    async fn slow_server_times_out() {
        let slow = || async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            "vllm:num_requests_running 1\n"
        };
        let router = Router::new()
            .route("/health", get(slow))
            .route("/metrics", get(slow));
        let base = serve(router).await;
        let serving =
            serving().with_timeouts(Duration::from_millis(100), Duration::from_millis(100));
        let started = std::time::Instant::now();
        assert_eq!(serving.health(&base).await, Health::Unreachable);
        assert_eq!(serving.signals(&base).await, ServingSignals::default());
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn oversized_pages_are_refused() {
        let line = "vllm:num_requests_running 1\n";
        let streamed = move || async move {
            let chunks = (0..8).map(move |_| Ok::<_, std::io::Error>(line));
            Body::from_stream(futures_util::stream::iter(chunks))
        };
        let router = Router::new()
            .route("/metrics", get(move || async move { line.repeat(8) }))
            .route("/streamed/metrics", get(streamed));
        let base = serve(router).await;
        let limit = line.len() * 4;
        let serving = serving().with_max_metrics_bytes(limit);
        for base in [base.clone(), format!("{base}/streamed")] {
            let error = serving.scrape(&base).await.expect_err("too large");
            assert!(
                matches!(error, ScrapeError::TooLarge { .. }),
                "{base}: {error:?}"
            );
            assert_eq!(serving.signals(&base).await, ServingSignals::default());
        }
        let roomy = self::serving().with_max_metrics_bytes(line.len() * 8);
        let whole = roomy
            .scrape(&format!("{base}/streamed"))
            .await
            .expect("fits");
        assert_eq!(whole.parse().samples.len(), 8, "every chunk was read");
        assert_eq!(
            roomy
                .signals(&format!("{base}/streamed"))
                .await
                .requests_running,
            Some(1.0),
            "the same series repeated counts once"
        );
    }

    #[test]
    fn a_problem_is_logged_once_until_it_changes() {
        let serving = serving();
        let url = "http://127.0.0.1:1";
        assert!(serving.note_problem(url, Some("truncated".into())));
        assert!(!serving.note_problem(url, Some("truncated".into())));
        assert!(serving.note_problem(url, Some("status 500".into())));
        assert!(serving.note_problem(url, None), "recovery is logged");
        assert!(!serving.note_problem(url, None));
    }

    #[tokio::test]
    async fn rates_come_from_successive_scrapes() {
        let scrapes = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let router = Router::new().route(
            "/metrics",
            get(move || {
                let n = scrapes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    format!(
                        "vllm:generation_tokens_total{{engine=\"0\"}} {}\n\
                         vllm:prompt_tokens_total{{engine=\"0\"}} 7\n",
                        1000 + 500 * n
                    )
                }
            }),
        );
        let base = serve(router).await;
        let serving = serving();
        let first = serving.signals(&base).await;
        assert_eq!(
            first.generation_tokens_per_s, None,
            "one scrape has no rate"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let second = serving.signals(&base).await;
        let rate = second.generation_tokens_per_s.expect("a rate");
        assert!(rate > 100.0 && rate <= 2_000.0, "{rate}");
        assert_eq!(second.prompt_tokens_per_s, Some(0.0));
        assert_eq!(second.engines, Some(1));
    }

    #[tokio::test]
    async fn garbage_page_is_unknown() {
        let router = Router::new().route(
            "/metrics",
            get(|| async { "<html>hello</html>\n\u{0}\u{1}{{{" }),
        );
        let base = serve(router).await;
        let page = serving().scrape(&base).await.expect("a 200 page");
        let scrape = page.parse();
        assert_eq!(scrape.errors.len(), 2);
        let serving = serving();
        assert_eq!(serving.signals(&base).await, ServingSignals::default());
        let problem = serving.problem(&base).expect("the reason is kept");
        assert!(problem.contains("2 unreadable lines"), "{problem}");
    }
}
