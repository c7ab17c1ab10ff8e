//! `GET /v1/jobs/{id}/logs?tail=N&follow=bool`: a job's container output, proxied from the
//! agent of the node that holds the job's lease (the agent streams it from Docker), or, for
//! a job with no lease now, from the node of its last ended lease (the agent keeps a
//! finished attempt's output).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::HttpError;
use crate::cluster::Cluster;

/// How long the agent may take to start answering.
const CONNECT: Duration = Duration::from_secs(5);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogsQuery {
    tail: Option<usize>,
    #[serde(default)]
    follow: bool,
}

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
    let unreachable = |e: reqwest::Error| {
        HttpError::new(
            StatusCode::BAD_GATEWAY,
            format!("the agent of node {node} at {agent}: {e}"),
            None,
        )
    };
    let client = reqwest::Client::builder()
        .connect_timeout(CONNECT)
        .no_proxy()
        .build()
        .map_err(unreachable)?;
    let response = client.get(&url).send().await.map_err(unreachable)?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(HttpError::new(status, body.trim().to_owned(), None));
    }
    tracing::info!(job.id = id, node = %node, follow = q.follow, tail = ?q.tail, "proxying job logs");
    let chunks = futures_util::stream::unfold(response, |mut r| async move {
        match r.chunk().await {
            Ok(Some(bytes)) => Some((Ok::<_, std::io::Error>(bytes), r)),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e)), r)),
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(chunks),
    )
        .into_response())
}
