//! `/v1/agents`: the agent protocol. Register, heartbeat (answered with the desired state),
//! and a long-poll that returns as soon as the node's desired state moves past a version.
//!
//! Over HTTPS each handler speaks only for the node its caller's client certificate names
//! ([`super::identity`]): a registration is checked on its parsed body, the other routes on
//! the `{node}` of their path.
//!
//! A heartbeat's own consequences (job states, released leases) are in its answer; the
//! decisions it makes possible (new placements, a reclaim) follow within
//! [`crate::cluster::DECISION_INTERVAL_MS`] (longer when deciding is slow) and reach the agent through the long-poll.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use nightshift_common::{ApiError, DesiredNode, Heartbeat, RegisterReply, RegisterRequest};
use serde::Deserialize;

use super::identity::{Peer, SpeaksFor};
use super::{HttpError, parse};
use crate::cluster::{ApplyError, Cluster};

/// Longest a long-poll is held open, whatever `wait_ms` asks (agents ask for 25 s).
pub const MAX_WAIT_MS: u64 = 30_000;

/// An agent enrolls its node and GPUs.
#[utoipa::path(post, path = "/v1/agents/register", tag = "agents",
    request_body = RegisterRequest,
    responses(
        (status = 200, description = "Enrolled: how often to heartbeat.", body = RegisterReply),
        (status = 403, description = "The client certificate names another node.", body = ApiError),
        (status = 422, description = "An empty node name.", body = ApiError),
    ))]
pub async fn register(
    State(cluster): State<Arc<Cluster>>,
    peer: Peer,
    body: Bytes,
) -> Result<Json<RegisterReply>, HttpError> {
    let req: RegisterRequest = parse("registration", &body)?;
    peer.speaks_for(&req.node)?;
    if req.node.trim().is_empty() {
        return Err(HttpError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "node: must not be empty",
            Some("node"),
        ));
    }
    let reply = cluster
        .apply_async(|core, now| {
            core.enroll(
                now,
                &req.node,
                &req.service,
                req.gpus.clone(),
                req.address.clone(),
            )?;
            cluster.decide_if_due(core, now);
            let cfg = core.config();
            Ok(RegisterReply {
                node: req.node.clone(),
                heartbeat_interval_ms: cfg.heartbeat_interval_ms,
                lease_ttl_ms: cfg.lease_ttl_ms,
            })
        })
        .await?;
    if let Some(url) = &req.agent_url {
        cluster.note_agent_url(&req.node, url);
    }
    if let Some(url) = &req.metrics_url {
        cluster.note_metrics_url(&req.node, url);
    }
    tracing::info!(node = %req.node, service = %req.service, gpus = req.gpus.len(), version = %req.agent_version, "agent registered");
    Ok(Json(reply))
}

/// An agent reports its node; answered with the node's desired state.
#[utoipa::path(post, path = "/v1/agents/{node}/heartbeat", tag = "agents",
    params(("node" = String, Path, description = "The node, as registered.")),
    request_body = Heartbeat,
    responses(
        (status = 200, description = "The node's desired state.", body = DesiredNode),
        (status = 404, description = "The node is not registered.", body = ApiError),
    ))]
pub async fn heartbeat(
    State(cluster): State<Arc<Cluster>>,
    SpeaksFor(node): SpeaksFor,
    body: Bytes,
) -> Result<Json<DesiredNode>, HttpError> {
    let beat: Heartbeat = parse("heartbeat", &body)?;
    if let Some(url) = &beat.agent_url {
        cluster.note_agent_url(&node, url);
    }
    if let Some(url) = &beat.metrics_url {
        cluster.note_metrics_url(&node, url);
    }
    cluster.record_images(&node, &beat);
    let applied = cluster
        .apply_async(|core, now| {
            core.observe(now, &node, beat)?;
            cluster.decide_if_due(core, now);
            let desired = core
                .desired(&node)
                .expect("a node that just heartbeat exists");
            let phases: Vec<_> = core
                .node(&node)
                .map(|n| n.phases.iter().cloned().collect())
                .unwrap_or_default();
            Ok((desired, phases))
        })
        .await;
    let (desired, phases) = match applied {
        Ok(v) => v,
        // The report could not be saved (a full disk): the core is back to what the store
        // holds, with every lease renewed for a full TTL (`Core::restore`), as after a
        // restart. The node is answered with its desired state as saved, which is all it
        // was ever told: its leases stay alive, so its agent's fail-safe does not stop jobs
        // merely because the coordinator cannot write. Its next heartbeat repeats the report.
        // Deciding anything new (a lend, a reclaim, a placement) waits until writes work.
        Err(ApplyError::Store(e)) => {
            let saved = cluster.read(|core, _| core.desired(&node));
            let Some(desired) = saved else {
                return Err(ApplyError::Store(e).into());
            };
            tracing::debug!(%node, error = %e, "heartbeat not saved; answered with the saved desired state");
            return Ok(Json(desired));
        }
        Err(e) => return Err(e.into()),
    };
    cluster.metrics.observe_phases(&node, &phases);
    Ok(Json(desired))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DesiredQuery {
    /// Answer once the desired version is above this one.
    #[serde(default)]
    after: u64,
    /// How long to wait, in milliseconds (at most 30 000).
    #[serde(default)]
    wait_ms: u64,
}

/// Long-poll: the node's desired state once its version passes `after`, or when `wait_ms`
/// (at most 30 s) runs out.
#[utoipa::path(get, path = "/v1/agents/{node}/desired", tag = "agents",
    params(("node" = String, Path, description = "The node, as registered."), DesiredQuery),
    responses(
        (status = 200, description = "The node's desired state.", body = DesiredNode),
        (status = 404, description = "The node is not registered.", body = ApiError),
    ))]
pub async fn desired(
    State(cluster): State<Arc<Cluster>>,
    SpeaksFor(node): SpeaksFor,
    Query(q): Query<DesiredQuery>,
) -> Result<Json<DesiredNode>, HttpError> {
    let unknown = || {
        HttpError::new(
            StatusCode::NOT_FOUND,
            format!("node {node} is not registered"),
            None,
        )
    };
    let mut rx = cluster.watch(&node).ok_or_else(unknown)?;
    let wait = Duration::from_millis(q.wait_ms.min(MAX_WAIT_MS));
    // Either the version moves past `after`, or the wait runs out: both answer the current
    // desired state. Shutdown ends the wait at once: this coordinator decides nothing more,
    // and its successor should not wait for it.
    tokio::select! {
        _ = tokio::time::timeout(wait, rx.wait_for(|v| *v > q.after)) => {}
        () = cluster.stopped() => {}
    }
    if cluster.is_stopping() {
        return Err(ApplyError::ShuttingDown.into());
    }
    cluster
        .read(|core, _| core.desired(&node))
        .map(Json)
        .ok_or_else(unknown)
}
