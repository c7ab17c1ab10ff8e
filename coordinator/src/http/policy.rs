//! Job policy at submission ([`crate::policy`]): a refused job is a 403 naming the rule and
//! the field, and nothing is queued.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use nightshift_common::JobSpec;

use super::{HttpError, MAX_BODY};
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
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return HttpError::bad_request(format!("unreadable body: {e}")).into_response(),
    };
    let refuse = |e: crate::policy::PolicyError| {
        tracing::info!(target: "nightshift::audit", rule = e.rule, field = %e.field, "job refused by policy");
        HttpError::new(StatusCode::FORBIDDEN, e.to_string(), Some(&e.field)).into_response()
    };
    if let Ok(raw) = serde_json::from_slice::<serde_json::Value>(&bytes)
        && let Err(e) = check_escapes(&raw)
    {
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
        if let Err(e) = s.policy.check(&spec.image, spec.gpus, owner_gpus) {
            return refuse(e);
        }
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
