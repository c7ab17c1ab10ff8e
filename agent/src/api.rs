//! The agent's API for the coordinator: `GET /status` (what the agent sees: its leases, their
//! images, the replica's URL) and `GET /v1/jobs/{id}/logs` (a job's output, `logs.rs`). Both
//! are job data, so they are served apart from the load balancer's port (`readiness_listen`,
//! which answers `/ready` only), on `api_listen`:
//!
//! - with `[tls]` (CA, certificate and key): HTTPS, and only to a client whose certificate
//!   the cluster CA signed for the coordinator (organizational unit
//!   [`crate::tls::COORDINATOR_UNIT`]). No certificate is 401, another certificate of the
//!   cluster (an agent's) is 403, one from another CA ends the handshake;
//! - without: plain HTTP, by default on loopback only, since whoever reaches the address reads
//!   every job's output; another address is the operator's choice, warned about at start.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rustls::ServerConfig;
use tokio::net::TcpListener;

use crate::engine::Engine;
use crate::state::Shared;

/// Who is calling, from the connection's client certificate (verified against the cluster CA
/// during the handshake). Only set on HTTPS connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No client certificate.
    Anonymous,
    /// The coordinator's certificate.
    Coordinator,
    /// Another certificate of the cluster: an agent's, named by its common name.
    Other(Option<String>),
}

impl Caller {
    fn of(chain: Option<&[rustls::pki_types::CertificateDer<'_>]>) -> Self {
        match chain.and_then(|c| c.first()) {
            None => Caller::Anonymous,
            Some(cert) if crate::tls::is_coordinator(cert) => Caller::Coordinator,
            Some(cert) => Caller::Other(crate::tls::subject_attribute(
                cert,
                &crate::tls::COMMON_NAME,
            )),
        }
    }
}

/// `/status` and the job log route, unguarded: [`serve_tls`] adds the guard.
pub fn router<E: Engine>(
    shared: Arc<Shared>,
    engine: Arc<E>,
    node: &str,
    work_dir: &std::path::Path,
) -> Router {
    Router::new()
        .route("/status", get(status))
        .with_state(shared)
        .merge(crate::logs::router(engine, node, work_dir))
}

async fn status(State(shared): State<Arc<Shared>>) -> axum::Json<serde_json::Value> {
    let o = shared.observed();
    axum::Json(serde_json::json!({
        "node": shared.node,
        "ready": shared.ready(),
        "replica": o.replica().as_str(),
        "replica_url": o.replica_url,
        "applied_version": o.applied_version,
        "jobs": o.runs,
    }))
}

/// Answers only the coordinator; a request without a [`Caller`] (not from [`serve_tls`]) is
/// refused too.
async fn guard(request: Request, next: Next) -> Response {
    let refuse = |status, why: String| {
        tracing::info!(path = %request.uri().path(), status = %status, "agent api request refused");
        (status, why).into_response()
    };
    match request.extensions().get::<Caller>() {
        Some(Caller::Coordinator) => next.run(request).await,
        Some(Caller::Anonymous) | None => refuse(
            StatusCode::UNAUTHORIZED,
            "a client certificate is needed: only the coordinator's may read job data\n".into(),
        ),
        Some(Caller::Other(name)) => refuse(
            StatusCode::FORBIDDEN,
            format!(
                "the client certificate is {}, not the coordinator's: only the coordinator may read job data\n",
                name.as_deref()
                    .map_or("unnamed".to_owned(), |n| format!("node {n}'s"))
            ),
        ),
    }
}

/// Serves `app` over plain HTTP (no `[tls]`).
pub async fn serve(listener: TcpListener, app: Router) {
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "agent api failed");
    }
}

/// Serves `app` over HTTPS to the coordinator only (see the module's header).
pub async fn serve_tls(listener: TcpListener, app: Router, config: Arc<ServerConfig>) {
    let app = app.layer(axum::middleware::from_fn(guard));
    nightshift_common::net::serve_tls(
        "agent api",
        listener,
        app,
        config,
        Caller::of,
        std::future::pending(),
    )
    .await;
}
