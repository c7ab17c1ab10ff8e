//! `/v1/jobs`: submit, list, show and cancel jobs.
//!
//! A submission is parsed once and admitted once, on the parsed spec, by the job policy
//! ([`crate::policy::PolicyConfig::admit`], as each pipeline step is): the caller's team, images, GPU and
//! run-time limits, the sandbox. A refusal is a 403 naming the rule and the field, and
//! nothing is queued; each sandbox rule an admin's token is let past is written to the audit
//! log.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use nightshift_common::{ApiError, JobList, JobSpec, JobView};

use super::{HttpError, access, parse};
use crate::auth::{Principal, Role};
use crate::cluster::Cluster;
use crate::policy::{PolicyError, Refusal, Submitter, check_escapes};

/// Queue a job.
#[utoipa::path(
    post,
    path = "/v1/jobs",
    tag = "jobs",
    request_body = JobSpec,
    responses(
        (status = 201, description = "Queued.", body = JobView),
        (status = 400, description = "Not a job: the field and why.", body = ApiError),
        (status = 403, description = "Refused by the job policy or the caller's role.", body = ApiError),
        (status = 422, description = "A job the coordinator cannot run.", body = ApiError),
    )
)]
pub async fn submit(
    State(cluster): State<Arc<Cluster>>,
    principal: Option<Extension<Principal>>,
    body: Bytes,
) -> Result<(StatusCode, Json<JobView>), HttpError> {
    let principal = principal.map(|Extension(p)| p);
    let spec = parse_job(&body)?;
    let who = match &principal {
        None => Submitter::Anyone,
        Some(p) => match p.role {
            Role::Admin => Submitter::Admin,
            Role::Operator => Submitter::Anyone,
            Role::Researcher => Submitter::Team(p.team.as_deref()),
        },
    };
    let policy = cluster.job_policy();
    // Admitted under the core's lock: a team's GPUs are counted with the job it then queues.
    let (job, waived) = cluster
        .apply(|core, now| {
            let admitted = match policy.admit(who, spec, |owner| core.gpus_asked_by(owner)) {
                Ok(admitted) => admitted,
                Err(refusal) => return Ok(Err(refusal)),
            };
            let id = core.submit(now, admitted.spec)?;
            let job = core.job(id).expect("a job just submitted exists");
            Ok(Ok((job, admitted.waived)))
        })?
        .map_err(|refusal| refused(principal.as_ref(), refusal))?;
    if let Some(admin) = &principal {
        for e in &waived {
            tracing::info!(
                target: "nightshift::audit",
                token_id = admin.token_id,
                token_name = %admin.name,
                job.id = job.id,
                rule = e.rule,
                field = %e.field,
                "job policy waived by an admin token"
            );
        }
    }
    tracing::info!(job.id = job.id, job.name = %job.spec.name, gpus = job.spec.gpus, "job submitted");
    Ok((StatusCode::CREATED, Json(job)))
}

/// The job of `body`. One that names a Kubernetes field at the top level (`privileged`,
/// `hostPath`, ...) is refused by the sandbox rule rather than as a bare unknown field, so
/// that the researcher knows it is policy, not a typo.
fn parse_job(body: &[u8]) -> Result<JobSpec, HttpError> {
    parse("job", body).map_err(|e| {
        let raw = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body);
        match raw.map(|raw| check_escapes(raw.keys().map(String::as_str))) {
            Ok(Err(escape)) => by_policy(escape),
            _ => e,
        }
    })
}

/// 403 for a job admission refused, audited.
fn refused(principal: Option<&Principal>, refusal: Refusal) -> HttpError {
    match refusal {
        Refusal::Policy(e) => by_policy(e),
        Refusal::NotItsTeam { .. } => {
            let who = principal.map_or_else(|| "the caller".to_owned(), access::who);
            HttpError::new(
                StatusCode::FORBIDDEN,
                format!("{who} {refusal}"),
                Some(refusal.field()),
            )
        }
    }
}

fn by_policy(e: PolicyError) -> HttpError {
    tracing::info!(target: "nightshift::audit", rule = e.rule, field = %e.field, "job refused by policy");
    HttpError::new(StatusCode::FORBIDDEN, e.to_string(), Some(&e.field))
}

/// Every job.
#[utoipa::path(get, path = "/v1/jobs", tag = "jobs",
    responses((status = 200, description = "Every job, oldest first.", body = JobList)))]
pub async fn list(State(cluster): State<Arc<Cluster>>) -> Json<JobList> {
    Json(JobList {
        jobs: cluster.read(|core, _| core.jobs()),
    })
}

/// One job.
#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = u64, Path, description = "The job.")),
    responses(
        (status = 200, description = "The job.", body = JobView),
        (status = 404, description = "No such job.", body = ApiError),
    ))]
pub async fn show(
    State(cluster): State<Arc<Cluster>>,
    Path(id): Path<u64>,
) -> Result<Json<JobView>, HttpError> {
    cluster
        .read(|core, _| core.job(id))
        .map(Json)
        .ok_or_else(|| HttpError::new(StatusCode::NOT_FOUND, format!("job {id} not found"), None))
}

/// Cancel a job; one that runs is stopped first.
#[utoipa::path(post, path = "/v1/jobs/{id}/cancel", tag = "jobs",
    params(("id" = u64, Path, description = "The job.")),
    responses(
        (status = 200, description = "The job, cancelled or cancelling.", body = JobView),
        (status = 404, description = "No such job.", body = ApiError),
        (status = 409, description = "The job has finished.", body = ApiError),
    ))]
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
