//! Which node may speak on the agent routes: over HTTPS, only an agent whose client
//! certificate (signed by the cluster CA) names that very node.
//!
//! The node spoken for is the `{node}` of the path, or the `node` of a registration's body.
//! A request without a certificate is 401; one for another node is 403. On plain HTTP (no
//! TLS configured, as in tests and the demo) there is no [`PeerNode`] and nothing is checked.

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{HttpError, MAX_BODY};
use crate::https::PeerNode;

pub async fn agent_identity(req: Request, next: Next) -> Response {
    let Some(PeerNode(peer)) = req.extensions().get::<PeerNode>().cloned() else {
        return next.run(req).await;
    };
    let Some(peer) = peer else {
        return HttpError::new(
            StatusCode::UNAUTHORIZED,
            "agent routes need a client certificate signed by the cluster CA \
             (nightshift-coordinator tls issue --node NAME)",
            None,
        )
        .into_response();
    };
    let (claimed, req) = match claimed_node(req).await {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    match claimed {
        Some(node) if node == peer => next.run(req).await,
        Some(node) => HttpError::new(
            StatusCode::FORBIDDEN,
            format!("the client certificate is for node {peer}, not {node}"),
            Some("node"),
        )
        .into_response(),
        None => HttpError::bad_request("no node named in the request").into_response(),
    }
}

/// The node a request speaks for, and the request to pass on (its body read and put back).
async fn claimed_node(req: Request) -> Result<(Option<String>, Request), HttpError> {
    let path = req.uri().path().to_owned();
    let mut segments = path.trim_start_matches('/').split('/');
    if let (Some("v1"), Some("agents"), Some(node), Some(_)) = (
        segments.next(),
        segments.next(),
        segments.next(),
        segments.next(),
    ) {
        return Ok((Some(node.to_owned()), req));
    }
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|e| HttpError::bad_request(format!("unreadable body: {e}")))?;
    let node = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("node").and_then(|n| n.as_str()).map(str::to_owned));
    Ok((node, Request::from_parts(parts, Body::from(bytes))))
}
