//! The coordinator's HTTP shell. Handlers only parse requests and translate them into core
//! calls through [`Cluster::apply`]; they never touch state themselves.

mod agents;
mod jobs;
mod nodes;
mod pipelines;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use nightshift_common::ApiError;
use nightshift_core::CoreError;

use crate::cluster::{ApplyError, Cluster};

/// Largest request body accepted, in bytes.
pub const MAX_BODY: usize = 1 << 20;

pub fn router(cluster: Arc<Cluster>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1/jobs", post(jobs::submit).get(jobs::list))
        .route("/v1/jobs/{id}", get(jobs::show))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route(
            "/v1/pipelines",
            post(pipelines::submit).get(pipelines::list),
        )
        .route("/v1/pipelines/{id}", get(pipelines::show))
        .route("/v1/pipelines/{id}/rerun", post(pipelines::rerun))
        .route("/v1/nodes", get(nodes::list))
        .route("/v1/services/{name}/gateway", post(nodes::gateway))
        .route("/v1/agents/register", post(agents::register))
        .route("/v1/agents/{node}/heartbeat", post(agents::heartbeat))
        .route("/v1/agents/{node}/desired", get(agents::desired))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(cluster)
}

/// An error answer: a status and an [`ApiError`] body.
#[derive(Debug)]
pub struct HttpError {
    status: StatusCode,
    body: ApiError,
}

impl HttpError {
    pub fn new(status: StatusCode, error: impl Into<String>, field: Option<&str>) -> Self {
        Self {
            status,
            body: ApiError {
                error: error.into(),
                field: field.map(str::to_owned),
            },
        }
    }

    pub fn bad_request(error: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, None)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

impl From<ApplyError> for HttpError {
    fn from(e: ApplyError) -> Self {
        let status = match &e {
            ApplyError::Store(_) | ApplyError::Pipelines(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApplyError::Core(c) => match c {
                CoreError::InvalidSpec(_) | CoreError::UnknownService(_) => {
                    StatusCode::UNPROCESSABLE_ENTITY
                }
                CoreError::UnknownJob(_) | CoreError::UnknownNode(_) => StatusCode::NOT_FOUND,
                CoreError::AlreadyFinished { .. }
                | CoreError::ServiceMismatch { .. }
                | CoreError::Illegal(_) => StatusCode::CONFLICT,
            },
        };
        let field = match &e {
            ApplyError::Core(c) => c.field(),
            ApplyError::Store(_) | ApplyError::Pipelines(_) => None,
        };
        Self::new(status, e.to_string(), field)
    }
}

/// Parses a JSON body, answering 400 with serde's message (which names the field and the
/// position) when it does not fit.
pub fn parse<T: serde::de::DeserializeOwned>(what: &str, body: &[u8]) -> Result<T, HttpError> {
    serde_json::from_slice(body).map_err(|e| HttpError::bad_request(format!("invalid {what}: {e}")))
}
