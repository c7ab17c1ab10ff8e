//! Which node may speak on the agent routes: over HTTPS, only an agent whose client
//! certificate (signed by the cluster CA) names that very node.
//!
//! The TLS accept path ([`crate::https`]) puts the certificate's node on every request as a
//! [`PeerNode`] extension; the handlers take it through the extractors here and check it
//! against the node they act for: [`Peer`] for a registration, whose node is in the parsed
//! body, and [`SpeaksFor`] for the routes whose node is the `{node}` of the path. Nothing
//! reads a body for this but the handler's own parse.
//!
//! A request without a certificate is 401; one for another node is 403. On plain HTTP (no
//! TLS configured, as in tests and the demo) there is no [`PeerNode`] and nothing is checked.

use axum::extract::{FromRequestParts, Path};
use axum::http::StatusCode;
use axum::http::request::Parts;

use super::HttpError;
use crate::https::PeerNode;

/// Who is calling an agent route, from its connection's client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Plain HTTP: no TLS, so no identity to check.
    Anyone,
    /// A client certificate naming this node.
    Node(String),
}

impl Peer {
    /// Ok when this peer may speak for `node`; 403 naming both nodes when not.
    pub fn speaks_for(&self, node: &str) -> Result<(), HttpError> {
        match self {
            Peer::Anyone => Ok(()),
            Peer::Node(peer) if peer == node => Ok(()),
            Peer::Node(peer) => Err(HttpError::new(
                StatusCode::FORBIDDEN,
                format!("the client certificate is for node {peer}, not {node}"),
                Some("node"),
            )),
        }
    }

    fn of(parts: &Parts) -> Result<Self, HttpError> {
        match parts.extensions.get::<PeerNode>() {
            None => Ok(Peer::Anyone),
            Some(PeerNode(Some(node))) => Ok(Peer::Node(node.clone())),
            Some(PeerNode(None)) => Err(HttpError::new(
                StatusCode::UNAUTHORIZED,
                "agent routes need a client certificate signed by the cluster CA \
                 (nightshift-coordinator tls issue --node NAME)",
                None,
            )),
        }
    }
}

/// The caller; refuses (401) a TLS connection without a client certificate before the
/// body is read.
impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, HttpError> {
        Peer::of(parts)
    }
}

/// The `{node}` of the path, once the caller is known to speak for it (401 or 403 if not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeaksFor(pub String);

impl<S: Send + Sync> FromRequestParts<S> for SpeaksFor {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, HttpError> {
        let peer = Peer::of(parts)?;
        let Path(node) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| HttpError::bad_request(format!("invalid node in the path: {e}")))?;
        peer.speaks_for(&node)?;
        Ok(SpeaksFor(node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(peer: Option<PeerNode>) -> Parts {
        let mut req = axum::http::Request::new(());
        if let Some(peer) = peer {
            req.extensions_mut().insert(peer);
        }
        req.into_parts().0
    }

    #[test]
    fn plain_http_checks_nothing() {
        let peer = Peer::of(&parts(None)).unwrap();
        assert_eq!(peer, Peer::Anyone);
        assert!(peer.speaks_for("any-node").is_ok());
    }

    #[test]
    fn tls_without_a_certificate_is_401() {
        let err = Peer::of(&parts(Some(PeerNode(None)))).unwrap_err();
        assert_eq!(err.status, StatusCode::UNAUTHORIZED);
        assert!(err.body.error.contains("client certificate"), "{err:?}");
    }

    #[test]
    fn a_certificate_speaks_only_for_its_node() {
        let peer = Peer::of(&parts(Some(PeerNode(Some("gpu-a".into()))))).unwrap();
        assert!(peer.speaks_for("gpu-a").is_ok());
        let err = peer.speaks_for("gpu-b").unwrap_err();
        assert_eq!(err.status, StatusCode::FORBIDDEN);
        assert_eq!(
            err.body.error,
            "the client certificate is for node gpu-a, not gpu-b"
        );
        assert_eq!(err.body.field.as_deref(), Some("node"));
    }
}
