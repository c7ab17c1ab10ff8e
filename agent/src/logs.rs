//! `GET /v1/jobs/{id}/logs?tail=N&follow=bool` on the agent's HTTP port: a job container's
//! stdout and stderr, from the start or the last `tail` lines, and with `follow` what it
//! writes until it exits. The coordinator proxies `nightshift logs` here.
//!
//! The container is found by its labels (this node, role job, the job id); of several (a
//! job retried on this node), the highest attempt's.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::TryStreamExt;
use nightshift_common::labels;
use serde::Deserialize;

use crate::engine::Engine;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogsQuery {
    /// The last N lines; everything when absent.
    pub tail: Option<usize>,
    #[serde(default)]
    pub follow: bool,
}

struct Ctx<E> {
    engine: Arc<E>,
    node: String,
}

pub fn router<E: Engine>(engine: Arc<E>, node: &str) -> Router {
    Router::new()
        .route("/v1/jobs/{id}/logs", get(logs::<E>))
        .with_state(Arc::new(Ctx {
            engine,
            node: node.to_owned(),
        }))
}

async fn logs<E: Engine>(
    State(ctx): State<Arc<Ctx<E>>>,
    Path(id): Path<u64>,
    Query(q): Query<LogsQuery>,
) -> Response {
    let filter = BTreeMap::from([
        (labels::MANAGED_BY.to_owned(), ctx.node.clone()),
        (labels::ROLE.to_owned(), labels::ROLE_JOB.to_owned()),
        (labels::JOB_ID.to_owned(), id.to_string()),
    ]);
    let containers = match ctx.engine.list(&filter).await {
        Ok(c) => c,
        Err(e) => {
            return (StatusCode::BAD_GATEWAY, format!("container engine: {e}\n")).into_response();
        }
    };
    let latest = containers.iter().max_by_key(|c| {
        c.labels
            .get(labels::ATTEMPT)
            .and_then(|a| a.parse::<u64>().ok())
            .unwrap_or(0)
    });
    let Some(c) = latest else {
        return (
            StatusCode::NOT_FOUND,
            format!("no container of job {id} on node {}\n", ctx.node),
        )
            .into_response();
    };
    tracing::info!(node = %ctx.node, job.id = id, container = %c.name, tail = ?q.tail, follow = q.follow, "streaming job logs");
    let stream = ctx
        .engine
        .log_stream(&c.id, q.tail, q.follow)
        .map_err(std::io::Error::other);
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(stream),
    )
        .into_response()
}
