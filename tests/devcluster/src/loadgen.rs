//! An open-loop load generator for an OpenAI-compatible completions endpoint.
//!
//! Requests leave on a fixed schedule at the current rate, each in its own task, so a slow
//! server does not slow the schedule (a closed-loop generator would hide exactly the queueing
//! the autoscaler must see). The rate can be changed at any time; 0 pauses.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// How many error samples are kept.
const ERROR_SAMPLES: usize = 5;
/// How much of an error answer's body a sample keeps.
const SAMPLE_BODY_CHARS: usize = 200;
/// Words the prompts are made of.
const WORDS: [&str; 8] = [
    "the", "night", "shift", "lends", "idle", "gpus", "to", "research",
];

/// The requests the generator sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestShape {
    pub max_tokens: u32,
    pub prompt_words: u32,
    pub model: String,
}

impl Default for RequestShape {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            prompt_words: 8,
            model: "standin-model".to_owned(),
        }
    }
}

/// How the generator behaves beyond what it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadGenOptions {
    /// Timeout of one request, long enough that requests held by a gateway are not cut short.
    pub request_timeout: Duration,
    /// Requests in flight at most; a request due while this many are in flight is not sent
    /// and counts as an error.
    pub max_in_flight: u64,
}

impl Default for LoadGenOptions {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(300),
            max_in_flight: 10_000,
        }
    }
}

/// What the generator has seen so far. Latencies are those of successful requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LoadStats {
    pub sent: u64,
    pub ok: u64,
    /// Non-2xx answers, transport errors, requests skipped at the in-flight cap and requests
    /// still in flight when [`LoadGen::finish`] gave up on them.
    pub errors: u64,
    pub in_flight: u64,
    pub latency_ms_p50: f64,
    pub latency_ms_p99: f64,
    pub latency_ms_max: f64,
    /// The first few errors, as `HTTP <status>: <body>` or the transport error's message.
    pub error_samples: Vec<String>,
}

/// A running load generator.
pub struct LoadGen {
    rate: watch::Sender<f64>,
    stop: Option<oneshot::Sender<Duration>>,
    scheduler: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl LoadGen {
    /// Starts sending to `{target_base_url}/v1/completions` at `initial_rate_per_s`.
    pub fn start(target_base_url: &str, initial_rate_per_s: f64, request: RequestShape) -> Self {
        Self::start_with(
            target_base_url,
            initial_rate_per_s,
            request,
            LoadGenOptions::default(),
        )
    }

    /// [`LoadGen::start`] with explicit options.
    pub fn start_with(
        target_base_url: &str,
        initial_rate_per_s: f64,
        request: RequestShape,
        options: LoadGenOptions,
    ) -> Self {
        let (rate_tx, rate_rx) = watch::channel(sanitize(initial_rate_per_s));
        let (stop_tx, stop_rx) = oneshot::channel();
        let shared = Arc::new(Shared::default());
        let sender = Sender {
            client: reqwest::Client::new(),
            url: completions_url(target_base_url),
            body: Arc::new(request_body(&request)),
            timeout: options.request_timeout,
            shared: shared.clone(),
        };
        let scheduler = tokio::spawn(schedule(sender, rate_rx, stop_rx, options.max_in_flight));
        Self {
            rate: rate_tx,
            stop: Some(stop_tx),
            scheduler: Some(scheduler),
            shared,
        }
    }

    /// Changes the rate (requests per second) at once; 0 (or anything not positive) pauses.
    pub fn set_rate(&self, rate_per_s: f64) {
        self.rate.send_replace(sanitize(rate_per_s));
    }

    /// The current rate.
    pub fn rate(&self) -> f64 {
        *self.rate.borrow()
    }

    /// What the generator has seen so far.
    pub fn snapshot(&self) -> LoadStats {
        self.shared.snapshot()
    }

    /// Stops issuing requests, waits up to `drain` for those in flight, and counts any still in
    /// flight then as errors.
    pub async fn finish(mut self, drain: Duration) -> LoadStats {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(drain);
        }
        if let Some(scheduler) = self.scheduler.take()
            && let Err(e) = scheduler.await
        {
            tracing::warn!(error = %e, "load generator's scheduler failed");
        }
        self.shared.snapshot()
    }
}

impl Drop for LoadGen {
    fn drop(&mut self) {
        // Dropping the stop sender ends the scheduler, which aborts the requests in flight.
        self.stop.take();
    }
}

fn sanitize(rate: f64) -> f64 {
    if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        0.0
    }
}

fn completions_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1") {
        format!("{base}/completions")
    } else {
        format!("{base}/v1/completions")
    }
}

fn request_body(shape: &RequestShape) -> serde_json::Value {
    let prompt: Vec<&str> = (0..shape.prompt_words as usize)
        .map(|i| WORDS[i % WORDS.len()])
        .collect();
    serde_json::json!({
        "model": shape.model,
        "prompt": prompt.join(" "),
        "max_tokens": shape.max_tokens,
    })
}

// ---------------------------------------------------------------------------------------------
// Counters

#[derive(Default)]
struct Shared {
    sent: AtomicU64,
    ok: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicU64,
    latencies_ms: Mutex<Vec<f64>>,
    error_samples: Mutex<Vec<String>>,
}

impl Shared {
    fn record_ok(&self, latency: Duration) {
        self.ok.fetch_add(1, Ordering::Relaxed);
        lock(&self.latencies_ms).push(latency.as_secs_f64() * 1000.0);
    }

    fn record_errors(&self, n: u64, sample: impl FnOnce() -> String) {
        self.errors.fetch_add(n, Ordering::Relaxed);
        let mut samples = lock(&self.error_samples);
        if samples.len() < ERROR_SAMPLES {
            samples.push(sample());
        }
    }

    fn snapshot(&self) -> LoadStats {
        let mut latencies = lock(&self.latencies_ms).clone();
        latencies.sort_by(f64::total_cmp);
        LoadStats {
            sent: self.sent.load(Ordering::Relaxed),
            ok: self.ok.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            latency_ms_p50: percentile(&latencies, 0.50),
            latency_ms_p99: percentile(&latencies, 0.99),
            latency_ms_max: latencies.last().copied().unwrap_or(0.0),
            error_samples: lock(&self.error_samples).clone(),
        }
    }
}

/// Locks a mutex, also one a panicking task poisoned (the data are plain counters).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The nearest-rank percentile of sorted samples; 0 when there are none.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Counts one request in flight while it lives (also when its task is aborted).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: Arc<Shared>) -> Self {
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(shared)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------------
// Schedule and requests

/// Everything one request needs.
#[derive(Clone)]
struct Sender {
    client: reqwest::Client,
    url: String,
    body: Arc<serde_json::Value>,
    timeout: Duration,
    shared: Arc<Shared>,
}

/// Issues requests on the schedule until told to stop, then drains.
async fn schedule(
    sender: Sender,
    mut rate: watch::Receiver<f64>,
    mut stop: oneshot::Receiver<Duration>,
    max_in_flight: u64,
) {
    let mut requests = JoinSet::new();
    let mut next = Instant::now();
    let mut current = *rate.borrow_and_update();
    loop {
        let due = (current > 0.0).then_some(next);
        tokio::select! {
            biased;
            drain = &mut stop => {
                drain_requests(&sender.shared, requests, drain.unwrap_or_default()).await;
                return;
            }
            changed = rate.changed() => {
                if changed.is_err() {
                    // The LoadGen is gone without finishing: stop at once.
                    drain_requests(&sender.shared, requests, Duration::ZERO).await;
                    return;
                }
                current = *rate.borrow_and_update();
                // A new rate starts a new schedule now.
                next = Instant::now();
            }
            () = sleep_until_due(due) => {
                issue(&sender, &mut requests, max_in_flight);
                next += Duration::from_secs_f64(1.0 / current);
            }
            Some(_) = requests.join_next(), if !requests.is_empty() => {}
        }
    }
}

async fn sleep_until_due(due: Option<Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn issue(sender: &Sender, requests: &mut JoinSet<()>, max_in_flight: u64) {
    let shared = &sender.shared;
    if shared.in_flight.load(Ordering::Relaxed) >= max_in_flight {
        shared.record_errors(1, || {
            format!("not sent: {max_in_flight} requests in flight")
        });
        return;
    }
    shared.sent.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight::new(shared.clone());
    let sender = sender.clone();
    requests.spawn(async move {
        let _guard = guard;
        sender.send_one().await;
    });
}

impl Sender {
    async fn send_one(&self) {
        let started = Instant::now();
        match self.exchange().await {
            Ok(()) => self.shared.record_ok(started.elapsed()),
            Err(sample) => self.shared.record_errors(1, || sample),
        }
    }

    /// One request and its whole answer; the error is the sample to keep.
    async fn exchange(&self) -> Result<(), String> {
        let resp = self
            .client
            .post(&self.url)
            .timeout(self.timeout)
            .json(&*self.body)
            .send()
            .await
            .map_err(|e| format!("transport: {e}"))?;
        let status = resp.status();
        let body = resp
            .text()
            .await
            .map_err(|e| format!("HTTP {status}, body: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            let body: String = body.chars().take(SAMPLE_BODY_CHARS).collect();
            Err(format!("HTTP {status}: {body}"))
        }
    }
}

/// Waits up to `drain` for the requests in flight; counts the rest as errors and aborts them.
async fn drain_requests(shared: &Shared, mut requests: JoinSet<()>, drain: Duration) {
    let _ = tokio::time::timeout(drain, async {
        while requests.join_next().await.is_some() {}
    })
    .await;
    let left = requests.len() as u64;
    if left > 0 {
        shared.record_errors(left, || {
            format!("{left} requests still in flight after {drain:?}")
        });
    }
    requests.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use tokio::net::TcpListener;

    async fn server(app: Router) -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        url
    }

    fn answering(status: StatusCode, delay: Duration) -> Router {
        Router::new().route(
            "/v1/completions",
            post(move |body: String| async move {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(v["model"], "standin-model");
                tokio::time::sleep(delay).await;
                (status, "{\"choices\":[]}")
            }),
        )
    }

    #[tokio::test]
    async fn honours_the_rate() {
        let url = server(answering(StatusCode::OK, Duration::ZERO)).await;
        let lg = LoadGen::start(&url, 50.0, RequestShape::default());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let stats = lg.finish(Duration::from_secs(5)).await;
        assert!((45..=55).contains(&stats.sent), "{stats:?}");
        assert_eq!(stats.ok, stats.sent, "{stats:?}");
        assert_eq!((stats.errors, stats.in_flight), (0, 0));
        assert!(stats.latency_ms_max >= stats.latency_ms_p99);
        assert!(stats.latency_ms_p99 >= stats.latency_ms_p50);
    }

    #[tokio::test]
    async fn open_loop_a_slow_server_does_not_slow_the_schedule() {
        let url = server(answering(StatusCode::OK, Duration::from_millis(500))).await;
        let lg = LoadGen::start(&url, 40.0, RequestShape::default());
        tokio::time::sleep(Duration::from_millis(400)).await;
        let s = lg.snapshot();
        assert!(s.sent >= 12 && s.ok == 0 && s.in_flight == s.sent, "{s:?}");
        let stats = lg.finish(Duration::from_secs(5)).await;
        assert_eq!((stats.ok, stats.errors), (stats.sent, 0), "{stats:?}");
        assert!(stats.latency_ms_p50 >= 500.0, "{stats:?}");
    }

    #[tokio::test]
    async fn counts_non_2xx_answers_as_errors() {
        let url = server(answering(StatusCode::INTERNAL_SERVER_ERROR, Duration::ZERO)).await;
        let lg = LoadGen::start(&url, 100.0, RequestShape::default());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stats = lg.finish(Duration::from_secs(5)).await;
        assert!(stats.sent >= 20, "{stats:?}");
        assert_eq!((stats.ok, stats.errors), (0, stats.sent));
        assert_eq!(stats.error_samples.len(), ERROR_SAMPLES);
        assert!(stats.error_samples[0].starts_with("HTTP 500"), "{stats:?}");
    }

    #[tokio::test]
    async fn set_rate_pauses_and_resumes() {
        let url = server(answering(StatusCode::OK, Duration::ZERO)).await;
        let lg = LoadGen::start(&url, 0.0, RequestShape::default());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(lg.snapshot().sent, 0);
        lg.set_rate(100.0);
        tokio::time::sleep(Duration::from_millis(300)).await;
        lg.set_rate(0.0);
        let paused_at = lg.snapshot().sent;
        assert!((25..=35).contains(&paused_at), "{paused_at}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = lg.finish(Duration::from_secs(5)).await;
        assert_eq!(stats.sent, paused_at);
        assert_eq!(stats.errors, 0);
    }

    #[tokio::test]
    async fn requests_left_after_the_drain_are_errors() {
        let url = server(answering(StatusCode::OK, Duration::from_secs(30))).await;
        let lg = LoadGen::start(&url, 20.0, RequestShape::default());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = lg.finish(Duration::from_millis(100)).await;
        assert!(stats.sent >= 3, "{stats:?}");
        assert_eq!(
            (stats.ok, stats.errors, stats.in_flight),
            (0, stats.sent, 0)
        );
    }

    #[tokio::test]
    async fn transport_errors_are_errors() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        let lg = LoadGen::start(&format!("{url}/v1/"), 50.0, RequestShape::default());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = lg.finish(Duration::from_secs(5)).await;
        assert!(stats.errors >= 5 && stats.errors == stats.sent, "{stats:?}");
        assert!(stats.error_samples[0].starts_with("transport"), "{stats:?}");
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
    }
}
