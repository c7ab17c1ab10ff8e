//! `/v1/jobs`: submit, list, show and cancel jobs.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use nightshift_common::{JobList, JobSpec, JobView};

use super::{HttpError, parse};
use crate::cluster::Cluster;

pub async fn submit(
    State(cluster): State<Arc<Cluster>>,
    body: Bytes,
) -> Result<(StatusCode, Json<JobView>), HttpError> {
    let spec: JobSpec = parse("job", &body)?;
    let job = cluster.apply(|core, now| {
        let id = core.submit(now, spec)?;
        Ok(core.job(id).expect("a job just submitted exists"))
    })?;
    tracing::info!(job.id = job.id, job.name = %job.spec.name, gpus = job.spec.gpus, "job submitted");
    Ok((StatusCode::CREATED, Json(job)))
}

pub async fn list(State(cluster): State<Arc<Cluster>>) -> Json<JobList> {
    Json(JobList {
        jobs: cluster.read(|core, _| core.jobs()),
    })
}

pub async fn show(
    State(cluster): State<Arc<Cluster>>,
    Path(id): Path<u64>,
) -> Result<Json<JobView>, HttpError> {
    cluster
        .read(|core, _| core.job(id))
        .map(Json)
        .ok_or_else(|| HttpError::new(StatusCode::NOT_FOUND, format!("job {id} not found"), None))
}

pub async fn cancel(
    State(cluster): State<Arc<Cluster>>,
    Path(id): Path<u64>,
) -> Result<Json<JobView>, HttpError> {
    let job = cluster.apply(|core, now| {
        core.cancel(now, id)?;
        Ok(core.job(id).expect("a job just cancelled exists"))
    })?;
    tracing::info!(
        job.id = id,
        state = job.state.as_str(),
        "job cancel requested"
    );
    Ok(Json(job))
}
