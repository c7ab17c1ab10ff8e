//! The load balancer's view of this node's replica: `GET /ready` answers 200 only while the
//! replica is healthy and not draining, so HAProxy, nginx or Envoy stop sending it requests
//! before a drain begins. It is open to anyone and says nothing else: what the agent sees
//! (`/status`) and jobs' output are the coordinator's only (`api.rs`). `GET /metrics` is the
//! agent's own metrics (see `telemetry.rs`), on this port or on `metrics_listen`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::state::Shared;

/// `GET /ready`; anything else is 404, with where job data went.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/ready", get(ready))
        .fallback(elsewhere)
        .with_state(shared)
}

/// `GET /metrics`.
pub fn metrics_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(shared)
}

async fn elsewhere() -> (StatusCode, &'static str) {
    (
        StatusCode::NOT_FOUND,
        "not found: this port answers /ready; job data (/status, job logs) is served on \
         api_listen, to the coordinator\n",
    )
}

async fn ready(State(shared): State<Arc<Shared>>) -> (StatusCode, &'static str) {
    if shared.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// OpenMetrics for Prometheus, the classic text format for others (`promtool`, curl).
async fn metrics(
    State(shared): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
) -> impl axum::response::IntoResponse {
    shared.telemetry.coordinator_silence(shared.since_contact());
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let (content_type, body) =
        nightshift_common::exposition::negotiate(shared.telemetry.render(), accept);
    ([(axum::http::header::CONTENT_TYPE, content_type)], body)
}
