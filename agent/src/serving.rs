//! The `ServingMetrics` port: the local vLLM replica's health, load and sleep mode, in its
//! own terms.
//!
//! `serving/prometheus.rs` parses the Prometheus text format; `serving/vllm.rs` maps vLLM's
//! metric families (across versions) onto [`ServingSignals`]; `serving/window.rs` derives
//! rates and TTFT quantiles from successive scrapes; `serving/http.rs` is the adapter that
//! scrapes a live server and drives its sleep endpoints.

pub mod http;
pub mod prometheus;
pub mod vllm;
pub mod window;

use std::future::Future;
use std::time::Duration;

use nightshift_common::ServingSignals;

/// What `/health` said: the planner's view, which it reasons about.
pub use nightshift_planner::Health;

pub trait ServingMetrics: Send + Sync + 'static {
    fn health(&self, base_url: &str) -> impl Future<Output = Health> + Send;

    /// The replica's load. Never fails: anything that goes wrong (unreachable, a bad page, a
    /// missing metric) leaves the affected signal `None`.
    fn signals(&self, base_url: &str) -> impl Future<Output = ServingSignals> + Send;

    /// Puts the replica to sleep at `level`, letting in-flight requests finish first
    /// (`mode=wait`); answers when vLLM has released the memory, or fails after `timeout`.
    fn sleep(
        &self,
        base_url: &str,
        level: u8,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), ServingError>> + Send;

    /// Wakes a sleeping replica.
    fn wake_up(
        &self,
        base_url: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), ServingError>> + Send;

    /// `/is_sleeping`; `None` when it did not answer (not in dev mode, unreachable).
    fn is_sleeping(&self, base_url: &str) -> impl Future<Output = Option<bool>> + Send;
}

/// A sleep-mode call that did not succeed.
#[derive(Debug, thiserror::Error)]
#[error("{action} {url}: {reason}")]
pub struct ServingError {
    pub action: &'static str,
    pub url: String,
    pub reason: String,
}
