//! `/v1/nodes` and `/v1/services/{name}/gateway`: what operators and load balancers see and
//! say.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use nightshift_common::{ApiError, GatewaySignals, NodeList};

use super::{HttpError, parse};
use crate::cluster::Cluster;

/// Every node: its mode, GPUs and replica.
/// Report a gateway's waiting requests.
///
/// A gateway in front of a service reports the requests it holds for want of a ready replica.
#[utoipa::path(get, path = "/v1/nodes", tag = "nodes",
    responses((status = 200, description = "Every registered node.", body = NodeList)))]
pub async fn list(State(cluster): State<Arc<Cluster>>) -> Json<NodeList> {
    Json(NodeList {
        nodes: cluster.read(|core, now| core.nodes(now)),
    })
}

#[utoipa::path(post, path = "/v1/services/{name}/gateway", tag = "services",
    params(("name" = String, Path, description = "The service.")),
    request_body = GatewaySignals,
    responses(
        (status = 204, description = "Noted."),
        (status = 422, description = "No such service.", body = ApiError),
    ))]
pub async fn gateway(
    State(cluster): State<Arc<Cluster>>,
    Path(service): Path<String>,
    body: Bytes,
) -> Result<StatusCode, HttpError> {
    let signals: GatewaySignals = parse("gateway signals", &body)?;
    cluster.apply(|core, now| core.gateway(now, &service, signals.waiting))?;
    Ok(StatusCode::NO_CONTENT)
}
