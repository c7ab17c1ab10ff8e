//! Job policy at submission ([`crate::policy`]): a refused job is a 403 naming the rule and
//! the field, and nothing is queued. A job submitted with an admin token is accepted whatever
//! its `sandbox:` asks for, and each rule it is let past is written to the audit log; image
//! and GPU limits hold for admins too.

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
    // A body that is not a job goes on, for the handler to refuse with serde's message.
    if let Ok(spec) = serde_json::from_slice::<JobSpec>(&bytes) {
        let owner_gpus: u32 = s.cluster.read(|core, _| {
            core.jobs()
                .iter()
                .filter(|j| !j.state.is_finished() && j.spec.owner == spec.owner)
                .map(|j| j.spec.gpus)
                .sum()
        });
        // Images and GPU limits hold for everyone; only the sandbox may be waived.
        if let Err(e) = s
            .policy
            .check(&spec.image, spec.gpus, spec.owner.as_deref(), owner_gpus)
        {
            return refuse(e);
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
