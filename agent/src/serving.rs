//! The `ServingMetrics` port: the local vLLM replica's health and load, in its own terms.
//!
//! `serving/prometheus.rs` parses the Prometheus text format; `serving/vllm.rs` maps vLLM's
//! metric families (across versions) onto [`ServingSignals`]; `serving/http.rs` is the
//! adapter that scrapes a live server.

pub mod http;
pub mod prometheus;
pub mod vllm;

use std::future::Future;

use nightshift_common::ServingSignals;

/// What `/health` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// 200.
    Healthy,
    /// Connection refused or reset: vLLM is still loading, or gone.
    Unreachable,
    /// Any other answer, e.g. 503 after an engine error.
    Unhealthy(u16),
}

pub trait ServingMetrics: Send + Sync + 'static {
    fn health(&self, base_url: &str) -> impl Future<Output = Health> + Send;

    /// The replica's load. Never fails: anything that goes wrong (unreachable, a bad page, a
    /// missing metric) leaves the affected signal `None`.
    fn signals(&self, base_url: &str) -> impl Future<Output = ServingSignals> + Send;
}
