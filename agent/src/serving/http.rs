//! The `ServingMetrics` adapter for a live vLLM server: `GET /health` and `GET /metrics`.
//!
//! Every request has its own timeout and the metrics body is read up to a bound, so a stuck
//! or runaway server costs the agent at most one timeout per call. Failures never propagate
//! out of the port: `health` answers [`Health::Unreachable`] when no HTTP answer came, and
//! `signals` answers all-`None` signals, each with a `tracing::debug!` saying why.

use std::error::Error as StdError;
use std::time::Duration;

use nightshift_common::ServingSignals;
use reqwest::StatusCode;
use reqwest::header::ACCEPT;

use super::prometheus::Scrape;
use super::vllm::VllmSnapshot;
use super::{Health, ServingMetrics};

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
        })
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

    /// Reads and parses `{base_url}/metrics`. Lines the parser rejected are in
    /// [`Scrape::errors`]; they do not make this fail.
    pub async fn scrape(&self, base_url: &str) -> Result<Scrape, ScrapeError> {
        let url = endpoint(base_url, "metrics");
        let body = self.fetch_metrics(&url).await?;
        let scrape = Scrape::parse(&String::from_utf8_lossy(&body));
        if let Some(first) = scrape.errors.first() {
            tracing::debug!(
                url,
                errors = scrape.errors.len(),
                first = %first,
                "vllm metrics page has lines that could not be read"
            );
        }
        Ok(scrape)
    }

    /// Everything the agent reads from one scrape.
    pub async fn snapshot(&self, base_url: &str) -> Result<VllmSnapshot, ScrapeError> {
        Ok(VllmSnapshot::from_scrape(&self.scrape(base_url).await?))
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
        match self.snapshot(base_url).await {
            Ok(snapshot) => snapshot.signals(),
            Err(error) => {
                tracing::debug!(error = %chain(&error), "vllm metrics unavailable");
                ServingSignals::default()
            }
        }
    }
}

fn endpoint(base_url: &str, path: &str) -> String {
    format!("{}/{path}", base_url.trim_end_matches('/'))
}

/// An error and its sources, joined by ": ".
fn chain(error: &dyn StdError) -> String {
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
        assert_eq!(
            roomy
                .signals(&format!("{base}/streamed"))
                .await
                .requests_running,
            Some(8.0)
        );
    }

    #[tokio::test]
    async fn garbage_page_is_unknown() {
        let router = Router::new().route(
            "/metrics",
            get(|| async { "<html>hello</html>\n\u{0}\u{1}{{{" }),
        );
        let base = serve(router).await;
        let scrape = serving().scrape(&base).await.expect("a 200 page");
        assert_eq!(scrape.errors.len(), 2);
        assert_eq!(serving().signals(&base).await, ServingSignals::default());
    }
}
