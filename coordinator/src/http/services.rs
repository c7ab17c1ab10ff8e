//! `/v1/services/{name}/endpoints` and `/v1/services/{name}/http_sd`: service discovery for
//! load balancers, as JSON and in Prometheus's `http_sd` format. A replica is ready when its
//! node serves and its agent reports it serving.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use nightshift_common::{Endpoint, Endpoints, NodeMode, ReplicaState};
use serde_json::{Value, json};

use super::HttpError;
use crate::cluster::Cluster;

fn endpoints(cluster: &Cluster, service: &str) -> Result<Endpoints, HttpError> {
    cluster.read(|core, now| {
        if !core.config().services.iter().any(|s| s.name == service) {
            return Err(HttpError::new(
                StatusCode::NOT_FOUND,
                format!("unknown service {service:?}"),
                None,
            ));
        }
        let endpoints = core
            .nodes(now)
            .into_iter()
            .filter(|n| n.service == service)
            .filter_map(|n| {
                let replica = n.replica?;
                let ready = n.reachable
                    && n.mode == NodeMode::Serve
                    && replica.state == ReplicaState::Serving;
                Some(Endpoint {
                    node: n.name,
                    url: replica.url?,
                    ready,
                })
            })
            .collect();
        Ok(Endpoints {
            service: service.to_owned(),
            endpoints,
        })
    })
}

pub async fn list(
    State(cluster): State<Arc<Cluster>>,
    Path(service): Path<String>,
) -> Result<Json<Endpoints>, HttpError> {
    endpoints(&cluster, &service).map(Json)
}

/// Prometheus `http_sd_config` targets: one group per ready replica.
pub async fn http_sd(
    State(cluster): State<Arc<Cluster>>,
    Path(service): Path<String>,
) -> Result<Json<Value>, HttpError> {
    let e = endpoints(&cluster, &service)?;
    let groups: Vec<Value> = e
        .endpoints
        .iter()
        .filter(|e| e.ready)
        .map(|e| {
            let target = e
                .url
                .trim_start_matches("http://")
                .trim_start_matches("https://");
            json!({"targets": [target], "labels": {"service": service, "node": e.node}})
        })
        .collect();
    Ok(Json(Value::Array(groups)))
}
