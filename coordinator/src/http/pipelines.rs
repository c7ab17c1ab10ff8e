//! `/v1/pipelines`: submit an Argo Workflows file as a pipeline run, list runs, show one.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use nightshift_common::{ApiError, PipelineRunList, PipelineRunView, PipelineSubmit};

use super::{HttpError, parse};
use crate::cluster::Cluster;

/// Start a pipeline run of an Argo Workflows file.
///
/// A workflow that does not lint, or unknown parameters, are refused (422) and nothing is
/// queued. Its steps are admitted as they launch, by the job policy that admits a job
/// submitted alone ([`crate::policy::PolicyConfig::admit`]): a step refused errors.
#[utoipa::path(post, path = "/v1/pipelines", tag = "pipelines",
    request_body = PipelineSubmit,
    responses(
        (status = 201, description = "The run, started.", body = PipelineRunView),
        (status = 400, description = "Not a pipeline submission.", body = ApiError),
        (status = 422, description = "The workflow does not lint, or its parameters are unknown.", body = ApiError),
    ))]
pub async fn submit(
    State(cluster): State<Arc<Cluster>>,
    body: Bytes,
) -> Result<(StatusCode, Json<PipelineRunView>), HttpError> {
    let req: PipelineSubmit = parse("pipeline", &body)?;
    let view = cluster.apply_with_pipelines(|_, pipelines, now| {
        let id = pipelines.submit(now, &req.file, &req.text, req.parameters.clone())?;
        Ok(id)
    })?;
    let view = cluster
        .read_pipelines(|core, p| p.view(|j| core.job(j), view))
        .map(|v| with_images(&cluster, v))
        .ok_or_else(|| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, "run vanished", None))?;
    tracing::info!(pipeline.id = view.id, pipeline.name = %view.name, "pipeline submitted");
    Ok((StatusCode::CREATED, Json(view)))
}

/// Every pipeline run.
/// Run a pipeline again.
///
/// Starts a new run of what run `id` ran: the same file text and parameters.
#[utoipa::path(get, path = "/v1/pipelines", tag = "pipelines",
    responses((status = 200, description = "Every run.", body = PipelineRunList)))]
pub async fn list(State(cluster): State<Arc<Cluster>>) -> Json<PipelineRunList> {
    let runs = cluster.read_pipelines(|core, p| p.list(|j| core.job(j)));
    Json(PipelineRunList {
        runs: runs.into_iter().map(|v| with_images(&cluster, v)).collect(),
    })
}

/// One pipeline run, with its steps.
#[utoipa::path(get, path = "/v1/pipelines/{id}", tag = "pipelines",
    params(("id" = u64, Path, description = "The run.")),
    responses(
        (status = 200, description = "The run.", body = PipelineRunView),
        (status = 404, description = "No such run.", body = ApiError),
    ))]
pub async fn show(
    State(cluster): State<Arc<Cluster>>,
    Path(id): Path<u64>,
) -> Result<Json<PipelineRunView>, HttpError> {
    cluster
        .read_pipelines(|core, p| p.view(|j| core.job(j), id))
        .map(|v| Json(with_images(&cluster, v)))
        .ok_or_else(|| {
            HttpError::new(
                StatusCode::NOT_FOUND,
                format!("pipeline run {id} not found"),
                None,
            )
        })
}

#[utoipa::path(post, path = "/v1/pipelines/{id}/rerun", tag = "pipelines",
    params(("id" = u64, Path, description = "The run to run again.")),
    responses(
        (status = 201, description = "The new run.", body = PipelineRunView),
        (status = 404, description = "No such run.", body = ApiError),
    ))]
pub async fn rerun(
    State(cluster): State<Arc<Cluster>>,
    Path(id): Path<u64>,
) -> Result<(StatusCode, Json<PipelineRunView>), HttpError> {
    let not_found = || {
        HttpError::new(
            StatusCode::NOT_FOUND,
            format!("pipeline run {id} not found"),
            None,
        )
    };
    let jobs = cluster
        .read_pipelines(|_, p| p.jobs_of(id))
        .ok_or_else(not_found)?;
    let images = cluster
        .query_store(|store| store.image_ids(&jobs))
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None))?;
    let new = cluster.apply_with_pipelines(|core, pipelines, now| {
        let rerun = pipelines.rerun(|j| core.job(j), now, id, &images);
        Ok(rerun.unwrap_or_else(|| Err(nightshift_common::SpecError::new("run", "not found")))?)
    })?;
    let view = cluster
        .read_pipelines(|core, p| p.view(|j| core.job(j), new))
        .map(|v| with_images(&cluster, v))
        .ok_or_else(not_found)?;
    tracing::info!(pipeline.id = view.id, rerun.of = id, "pipeline rerun");
    Ok((StatusCode::CREATED, Json(view)))
}

/// `view` with the image each step's newest job ran, as recorded from its agent. The store
/// failing to answer leaves them out rather than failing the request.
fn with_images(cluster: &Cluster, mut view: PipelineRunView) -> PipelineRunView {
    let jobs: Vec<u64> = view
        .nodes
        .iter()
        .filter_map(|n| n.jobs.last().copied())
        .collect();
    if jobs.is_empty() {
        return view;
    }
    match cluster.query_store(|store| store.image_ids(&jobs)) {
        Ok(images) => {
            for n in &mut view.nodes {
                n.image_id = n.jobs.last().and_then(|j| images.get(j)).cloned();
            }
        }
        Err(e) => {
            tracing::warn!(pipeline.id = view.id, error = %e, "reading launched images failed")
        }
    }
    view
}
