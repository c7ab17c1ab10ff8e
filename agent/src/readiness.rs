//! The load balancer's view of this node's replica: `GET /ready` answers 200 only while the
//! replica is healthy and not draining, so HAProxy, nginx or Envoy stop sending it requests
//! before a drain begins. `GET /status` shows what the agent sees, as JSON; `GET /metrics`
//! is the agent's own metrics (see `telemetry.rs`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::state::Shared;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/ready", get(ready))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

async fn ready(State(shared): State<Arc<Shared>>) -> (StatusCode, &'static str) {
    if shared.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl axum::response::IntoResponse {
    shared.telemetry.coordinator_silence(shared.since_contact());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.telemetry.render(),
    )
}

async fn status(State(shared): State<Arc<Shared>>) -> axum::Json<serde_json::Value> {
    let o = shared.observed();
    axum::Json(serde_json::json!({
        "node": shared.node,
        "ready": shared.ready(),
        "replica": o.replica.as_str(),
        "replica_url": o.replica_url,
        "applied_version": o.applied_version,
        "jobs": o.runs,
    }))
}
