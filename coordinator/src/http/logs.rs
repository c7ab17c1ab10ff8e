//! `GET /v1/jobs/{id}/logs?tail=N&follow=bool`: a job's container output, proxied from the
//! agent of the node that holds the job's lease (the agent streams it from Docker), or, for
//! a job with no lease now, from the node of its last ended lease (the agent keeps a
//! finished attempt's output).
//!
//! The agent serves job data on its API port only to the coordinator: with `[tls]` the proxy
//! speaks HTTPS, presents the coordinator's certificate and accepts only the certificate the
//! cluster CA issued to that node ([`crate::https::agent_client_config`]).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use nightshift_common::ApiError;
use serde::Deserialize;

use super::HttpError;
use crate::cluster::Cluster;

/// How long the connection to the agent may take.
const CONNECT: Duration = Duration::from_secs(5);
/// How long the agent may take to start answering (a TLS handshake, finding the container).
const ANSWER: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// Only the last N lines.
    pub(crate) tail: Option<usize>,
    /// Keep streaming until the container exits.
    #[serde(default)]
    pub(crate) follow: bool,
}

/// A job's container output (stdout and stderr), from the agent of its node.
#[utoipa::path(get, path = "/v1/jobs/{id}/logs", tag = "jobs",
    params(("id" = u64, Path, description = "The job."), LogsQuery),
    responses(
        (status = 200, description = "The output; with `follow`, streamed until the container exits.",
            body = String, content_type = "text/plain"),
        (status = 404, description = "No such job.", body = ApiError),
        (status = 409, description = "The job has not run on any node yet.", body = ApiError),
        (status = 502, description = "The agent could not be asked.", body = ApiError),
    ))]
pub async fn logs(
    State(cluster): State<Arc<Cluster>>,
    Path(id): Path<u64>,
    Query(q): Query<LogsQuery>,
) -> Result<Response, HttpError> {
    let job = cluster.read(|core, _| core.job(id)).ok_or_else(|| {
        HttpError::new(StatusCode::NOT_FOUND, format!("job {id} not found"), None)
    })?;
    // A gang's logs are its rank-0 member's.
    let node = match job.leases.into_iter().next() {
        Some(lease) => lease.node,
        None => {
            let last = cluster
                .query_store(|store| store.last_node_of(id))
                .map_err(|e| {
                    HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None)
                })?;
            last.ok_or_else(|| {
                HttpError::new(
                    StatusCode::CONFLICT,
                    format!(
                        "job {id} is {} and has not run on any node yet",
                        job.state.as_str()
                    ),
                    None,
                )
            })?
        }
    };
    let agent = cluster.agent_url(&node).ok_or_else(|| {
        HttpError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the agent of node {node} has not told its url yet"),
            None,
        )
    })?;
    let mut url = format!(
        "{}/v1/jobs/{id}/logs?follow={}",
        agent.trim_end_matches('/'),
        q.follow
    );
    if let Some(n) = q.tail {
        url.push_str(&format!("&tail={n}"));
    }
    let unreachable = |e: &dyn std::fmt::Display| {
        HttpError::new(
            StatusCode::BAD_GATEWAY,
            format!("the agent of node {node} at {agent}: {e}"),
            None,
        )
    };
    let tls = cluster.agent_tls();
    if let Err(why) = scheme_allowed(tls.is_some(), &agent) {
        return Err(unreachable(&why));
    }
    let config = crate::https::agent_client_config(tls.as_ref(), &node)
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None))?;
    let client = nightshift_common::net::https_client::<Empty<Bytes>>(config, CONNECT);
    let request = hyper::Request::get(&url)
        .body(Empty::new())
        .map_err(|e| unreachable(&e))?;
    let response = match tokio::time::timeout(ANSWER, client.request(request)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(unreachable(&nightshift_common::logging::error_message(&e))),
        Err(_) => return Err(unreachable(&format!("no answer within {ANSWER:?}"))),
    };
    let status = response.status();
    if !status.is_success() {
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(HttpError::new(status, body.trim().to_owned(), None));
    }
    tracing::info!(job.id = id, node = %node, follow = q.follow, tail = ?q.tail, tls = tls.is_some(), "proxying job logs");
    Ok((
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::new(response.into_body()),
    )
        .into_response())
}

/// With `[tls]` job output travels over HTTPS only: an agent that offers its API over plain
/// HTTP (an agent from before its API needed the coordinator's certificate) is not asked.
fn scheme_allowed(tls: bool, agent_url: &str) -> Result<(), String> {
    if tls && !agent_url.starts_with("https://") {
        return Err(
            "with [tls] job output is read from agents over https only, and this agent offers \
             plain http: give it [tls] in agent.toml (README, Security)"
                .to_owned(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn with_tls_only_an_https_agent_is_asked() {
        assert!(super::scheme_allowed(true, "https://gpu-01:7402").is_ok());
        assert!(super::scheme_allowed(false, "http://127.0.0.1:7402").is_ok());
        let err = super::scheme_allowed(true, "http://gpu-01:7401").unwrap_err();
        assert!(err.contains("over https only"), "{err}");
    }
}
