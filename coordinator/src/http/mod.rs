//! The coordinator's HTTP shell. Handlers only parse requests and translate them into core
//! calls through [`Cluster::apply`]; they never touch state themselves.

pub mod access;
mod agents;
mod identity;
mod jobs;
mod logs;
mod nodes;
pub mod openapi;
mod pipelines;
mod report;
mod services;
pub mod ui;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::handler::Handler;
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use nightshift_common::ApiError;
use nightshift_core::CoreError;

use crate::cluster::{ApplyError, Cluster};

/// Largest request body accepted, in bytes.
pub const MAX_BODY: usize = 1 << 20;

/// The API without access control (tests, the demo); jobs are admitted by the cluster's
/// job policy ([`Cluster::set_job_policy`]).
pub fn router(cluster: Arc<Cluster>) -> Router {
    build(cluster, None)
}

/// The API with API tokens and roles ([`access`]), admitting jobs and pipeline steps by
/// `policy`.
pub fn app(
    cluster: Arc<Cluster>,
    access: access::AccessState,
    policy: crate::policy::PolicyConfig,
) -> Router {
    cluster.set_job_policy(policy);
    build(cluster, Some(access))
}

/// The access control of the coordinator configured by `cfg`: the tokens of its data
/// directory.
pub fn access_for(
    cfg: &crate::config::CoordinatorConfig,
    cluster: Arc<Cluster>,
) -> Result<access::AccessState, crate::auth::AuthError> {
    Ok(access::AccessState {
        tokens: Arc::new(crate::auth::Tokens::open(&cfg.data_dir)?),
        cluster,
        limiter: Arc::new(crate::ratelimit::RateLimiter::default()),
        auth_failures: Arc::new(crate::ratelimit::RateLimiter::failed_auth()),
    })
}

fn build(cluster: Arc<Cluster>, access: Option<access::AccessState>) -> Router {
    let mut api = api_routes().router;
    if let Some(access) = access.clone() {
        api = api.route_layer(axum::middleware::from_fn_with_state(access, access::check));
    }
    let ui = ui::routes()
        .router
        .route_layer(axum::middleware::from_fn_with_state(
            access.clone(),
            ui::gate,
        ))
        .layer(axum::Extension(access));
    Router::new()
        .merge(open_routes().router)
        .merge(api)
        .merge(agent_routes().router)
        .merge(ui)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(body_limit))
        .with_state(cluster)
}

/// Every route [`build`] serves, as its method and path (`/v1/jobs/{id}`), listed from the
/// tables the router is built from: what the OpenAPI document must describe, no more.
pub fn served_routes() -> Vec<(Method, &'static str)> {
    [open_routes(), api_routes(), agent_routes()]
        .into_iter()
        .flat_map(|r| r.served)
        .collect()
}

/// The web UI's routes ([`ui`]): HTML pages and their forms, assets and event streams, all
/// under `/ui`; not the JSON API, so not in its OpenAPI document.
pub fn ui_routes() -> Vec<(Method, &'static str)> {
    ui::routes().served
}

/// Routes for a router, each recorded with its method and path as it is added, so that
/// [`served_routes`] lists what the router serves without a second list to keep.
struct Routes {
    router: Router<Arc<Cluster>>,
    served: Vec<(Method, &'static str)>,
}

impl Routes {
    fn new() -> Self {
        Self {
            router: Router::new(),
            served: Vec::new(),
        }
    }

    /// `GET path` (and `HEAD`, which axum answers with the `GET` handler).
    fn get<H: Handler<T, Arc<Cluster>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::GET, path, axum::routing::get(h))
    }

    fn post<H: Handler<T, Arc<Cluster>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::POST, path, axum::routing::post(h))
    }

    /// Routes of one path merge: `POST` and `GET /v1/jobs` are two calls.
    fn add(
        mut self,
        method: Method,
        path: &'static str,
        handler: MethodRouter<Arc<Cluster>>,
    ) -> Self {
        self.router = self.router.route(path, handler);
        self.served.push((method, path));
        self
    }
}

/// Open to anyone, even once the coordinator has API tokens: liveness, and the API's
/// description (which says nothing of the cluster's state).
fn open_routes() -> Routes {
    Routes::new()
        .get("/healthz", healthz)
        .get("/v1/openapi.json", openapi::serve)
}

/// The API of operators, researchers and load balancers; behind API tokens ([`access`]).
fn api_routes() -> Routes {
    Routes::new()
        .post("/v1/jobs", jobs::submit)
        .get("/v1/jobs", jobs::list)
        .get("/v1/jobs/{id}", jobs::show)
        .post("/v1/jobs/{id}/cancel", jobs::cancel)
        .get("/v1/jobs/{id}/logs", logs::logs)
        .post("/v1/pipelines", pipelines::submit)
        .get("/v1/pipelines", pipelines::list)
        .get("/v1/pipelines/{id}", pipelines::show)
        .post("/v1/pipelines/{id}/rerun", pipelines::rerun)
        .get("/v1/nodes", nodes::list)
        .get("/v1/nodes/http_sd", services::nodes_http_sd)
        .get("/v1/report", report::report)
        .get("/v1/services/{name}/endpoints", services::list)
        .get("/v1/services/{name}/http_sd", services::http_sd)
        .get("/metrics", metrics)
        .post("/v1/services/{name}/gateway", nodes::gateway)
}

/// The one body limit: a body longer than [`MAX_BODY`] is refused (413) before access
/// control or a handler sees it, at once when its length is declared, else once that
/// much has arrived. What is passed on is whole, so nothing after this fails to read it.
async fn body_limit(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let too_large = || {
        let error = format!("request body larger than the limit of {MAX_BODY} bytes");
        HttpError::new(StatusCode::PAYLOAD_TOO_LARGE, error, None).into_response()
    };
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(bytes) => bytes,
        Err(e) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                return too_large();
            }
            return HttpError::bad_request(format!("unreadable body: {e}")).into_response();
        }
    };
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// The agent protocol; over HTTPS each handler checks that the client certificate names
/// the node it acts for ([`identity`]).
fn agent_routes() -> Routes {
    Routes::new()
        .post("/v1/agents/register", agents::register)
        .post("/v1/agents/{node}/heartbeat", agents::heartbeat)
        .get("/v1/agents/{node}/desired", agents::desired)
}

/// `ok`, or 503 with the reason: shutting down, or the store failing to save.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "meta",
    security(()),
    responses(
        (status = 200, description = "Healthy: `ok`.", body = String, content_type = "text/plain"),
        (status = 503, description = "Why not.", body = String, content_type = "text/plain"),
    )
)]
async fn healthz(axum::extract::State(cluster): axum::extract::State<Arc<Cluster>>) -> Response {
    match cluster.unhealthy() {
        None => "ok".into_response(),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
    }
}

/// OpenMetrics for Prometheus, the classic text format for others (`promtool`, curl).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "meta",
    responses((status = 200, description = "The metrics, as `Accept` asks.", content(
        (String = "text/plain"),
        (String = "application/openmetrics-text"),
    )))
)]
async fn metrics(
    axum::extract::State(cluster): axum::extract::State<Arc<Cluster>>,
    headers: axum::http::HeaderMap,
) -> Response {
    // The store's sum first, then the core: neither lock is held while the other is read.
    let harvested = cluster.query_store(|store| {
        store.harvested_gpu_ms().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading harvested gpu time failed");
            Vec::new()
        })
    });
    let text = cluster.peek(|core| {
        cluster
            .metrics
            .render(core, crate::cluster::now_ms(), &harvested)
    });
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let (content_type, body) = nightshift_common::exposition::negotiate(text, accept);
    ([(axum::http::header::CONTENT_TYPE, content_type)], body).into_response()
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

    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What went wrong, as the body says it.
    pub fn message(&self) -> &str {
        &self.body.error
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
            ApplyError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
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
            ApplyError::Store(_) | ApplyError::Pipelines(_) | ApplyError::ShuttingDown => None,
        };
        Self::new(status, e.to_string(), field)
    }
}

/// Parses a JSON body, answering 400 with serde's message, the path of the field it is about
/// (`retry.limit: invalid value: integer ...`) and the position, when it does not fit.
pub fn parse<T: serde::de::DeserializeOwned>(what: &str, body: &[u8]) -> Result<T, HttpError> {
    let mut json = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let field = e.path().to_string();
        let e = e.into_inner();
        if field == "." {
            return HttpError::bad_request(format!("invalid {what}: {e}"));
        }
        HttpError::new(
            StatusCode::BAD_REQUEST,
            format!("invalid {what}: {field}: {e}"),
            Some(&field),
        )
    })
}
