//! `/v1/services/{name}/endpoints` and `/v1/services/{name}/http_sd`: service discovery for
//! load balancers, as JSON and in Prometheus's `http_sd` format. A replica is ready when its
//! node serves and its agent reports it serving. `/v1/nodes/http_sd`: every registered
//! node's agent metrics, for Prometheus to scrape.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use nightshift_common::{ApiError, Endpoint, Endpoints, NodeMode, ReplicaState};
use serde::Serialize;

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

/// A target group of Prometheus's `http_sd_config`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TargetGroup {
    /// `host:port` of each target.
    targets: Vec<String>,
    labels: BTreeMap<String, String>,
}

/// A service's replicas and whether each is ready.
#[utoipa::path(get, path = "/v1/services/{name}/endpoints", tag = "services",
    params(("name" = String, Path, description = "The service.")),
    responses(
        (status = 200, description = "Its replicas.", body = Endpoints),
        (status = 404, description = "No such service.", body = ApiError),
    ))]
pub async fn list(
    State(cluster): State<Arc<Cluster>>,
    Path(service): Path<String>,
) -> Result<Json<Endpoints>, HttpError> {
    endpoints(&cluster, &service).map(Json)
}

/// Prometheus `http_sd_config` targets: one group per ready replica.
#[utoipa::path(get, path = "/v1/services/{name}/http_sd", tag = "services",
    params(("name" = String, Path, description = "The service.")),
    responses(
        (status = 200, description = "One group per ready replica.", body = Vec<TargetGroup>),
        (status = 404, description = "No such service.", body = ApiError),
    ))]
pub async fn http_sd(
    State(cluster): State<Arc<Cluster>>,
    Path(service): Path<String>,
) -> Result<Json<Vec<TargetGroup>>, HttpError> {
    let e = endpoints(&cluster, &service)?;
    let groups = e
        .endpoints
        .iter()
        .filter(|e| e.ready)
        .map(|e| {
            let target = e
                .url
                .trim_start_matches("http://")
                .trim_start_matches("https://");
            TargetGroup {
                targets: vec![target.to_owned()],
                labels: labels([("service", &service), ("node", &e.node)]),
            }
        })
        .collect();
    Ok(Json(groups))
}

/// Prometheus `http_sd_config` targets: each registered node's agent `/metrics`, once the
/// agent has said where that is, labelled with its `node` and `service` (so the agents'
/// series carry them). Every node is listed, reachable or not: Prometheus' `up` then shows a
/// silent agent.
#[utoipa::path(get, path = "/v1/nodes/http_sd", tag = "nodes",
    responses((status = 200, description = "One group per node that told its metrics url.",
        body = Vec<TargetGroup>)))]
pub async fn nodes_http_sd(State(cluster): State<Arc<Cluster>>) -> Json<Vec<TargetGroup>> {
    let nodes: Vec<(String, String)> = cluster.peek(|core| {
        core.node_names()
            .filter_map(|name| core.node(name))
            .map(|n| (n.name.clone(), n.service.clone()))
            .collect()
    });
    let groups = nodes
        .into_iter()
        .filter_map(|(node, service)| {
            let url = cluster.metrics_url(&node)?;
            let Some(target) = scrape_target(&url) else {
                tracing::warn!(node = %node, url = %url, "the agent's metrics url is not http(s)://host:port/path; left out of /v1/nodes/http_sd");
                return None;
            };
            let (scheme, address, path) = target;
            Some(TargetGroup {
                targets: vec![address],
                labels: labels([
                    ("node", &node),
                    ("service", &service),
                    ("__scheme__", &scheme),
                    ("__metrics_path__", &path),
                ]),
            })
        })
        .collect();
    Json(groups)
}

fn labels<const N: usize>(pairs: [(&str, &String); N]) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.clone()))
        .collect()
}

/// `http://host:port/path` as Prometheus wants a target: the scheme, `host:port` and the path.
fn scrape_target(url: &str) -> Option<(String, String, String)> {
    let uri: Uri = url.parse().ok()?;
    let scheme = uri
        .scheme_str()
        .filter(|s| matches!(*s, "http" | "https"))?;
    let authority = uri.authority()?;
    authority.port_u16()?;
    let path = match uri.path() {
        "" => "/metrics",
        p => p,
    };
    Some((
        scheme.to_owned(),
        authority.as_str().to_owned(),
        path.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::scrape_target;

    #[test]
    fn a_metrics_url_becomes_a_prometheus_target() {
        let t = |s: &str, a: &str, p: &str| Some((s.to_owned(), a.to_owned(), p.to_owned()));
        assert_eq!(
            scrape_target("http://10.0.0.7:7401/metrics"),
            t("http", "10.0.0.7:7401", "/metrics")
        );
        assert_eq!(
            scrape_target("https://gpu-1.example:9101/m"),
            t("https", "gpu-1.example:9101", "/m")
        );
        assert_eq!(
            scrape_target("http://[::1]:7401/metrics"),
            t("http", "[::1]:7401", "/metrics")
        );
        for bad in [
            "10.0.0.7:7401",
            "ftp://h:1/metrics",
            "http://h/metrics",
            "not a url",
        ] {
            assert_eq!(scrape_target(bad), None, "{bad}");
        }
    }
}
