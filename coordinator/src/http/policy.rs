//! Job policy at submission ([`crate::policy`]): a refused job is a 403 naming the rule and
//! the field, and nothing is queued. A job submitted with an admin token is accepted whatever
//! its `sandbox:` asks for, and each rule it is let past is written to the audit log; image,
//! GPU and run-time limits hold for admins too. A job that names no run-time limit is given
//! the policy's.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use nightshift_common::JobSpec;

use super::{HttpError, MAX_BODY};
use crate::auth::{Principal, Role};
use crate::cluster::Cluster;
use crate::policy::{PolicyConfig, check_escapes};

#[derive(Clone)]
pub struct PolicyState {
    pub policy: Arc<PolicyConfig>,
    pub cluster: Arc<Cluster>,
}

pub async fn check(State(s): State<PolicyState>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST || req.uri().path() != "/v1/jobs" {
        return next.run(req).await;
    }
    let admin = req
        .extensions()
        .get::<Principal>()
        .filter(|p| p.role == Role::Admin)
        .cloned();
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return HttpError::bad_request(format!("unreadable body: {e}")).into_response(),
    };
    let refuse = |e: crate::policy::PolicyError| {
        tracing::info!(target: "nightshift::audit", rule = e.rule, field = %e.field, "job refused by policy");
        HttpError::new(StatusCode::FORBIDDEN, e.to_string(), Some(&e.field)).into_response()
    };
    let mut broken = Vec::new();
    if let Ok(raw) = serde_json::from_slice::<serde_json::Value>(&bytes)
        && let Err(e) = check_escapes(&raw)
    {
        // Not a field of the job file: the handler could not accept it even when waived.
        return refuse(e);
    }
    let mut bytes = bytes;
    // A body that is not a job goes on, for the handler to refuse with serde's message.
    if let Ok(mut spec) = serde_json::from_slice::<JobSpec>(&bytes) {
        let owner_gpus = |owner: Option<&str>| s.cluster.read(|core, _| core.gpus_asked_by(owner));
        // Images, GPU and run-time limits hold for everyone; only the sandbox may be waived.
        let asked = spec.max_run_seconds;
        if let Err(e) = s.policy.admit(&mut spec, owner_gpus) {
            return refuse(e);
        }
        if spec.max_run_seconds != asked {
            // The policy's run-time limit, filled in: the job carries it from now on.
            match serde_json::to_vec(&spec) {
                Ok(filled) => bytes = filled.into(),
                Err(e) => {
                    return HttpError::bad_request(format!("unencodable job: {e}")).into_response();
                }
            }
        }
        broken.extend(s.policy.check_sandbox(&spec.sandbox));
    }
    match (broken.is_empty(), &admin) {
        (true, _) => {}
        (false, Some(admin)) => {
            for e in &broken {
                tracing::info!(
                    target: "nightshift::audit",
                    token_id = admin.token_id,
                    token_name = %admin.name,
                    rule = e.rule,
                    field = %e.field,
                    "job policy waived by an admin token"
                );
            }
        }
        (false, None) => return refuse(broken.swap_remove(0)),
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
