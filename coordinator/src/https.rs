//! Serving the API over HTTPS (rustls on ring), with agents' client certificates.
//!
//! A client certificate is optional at the TLS level, so that the CLI can connect without
//! one, but when given it must be signed by the cluster CA or the handshake fails. Each
//! connection's requests carry a [`PeerNode`] extension: the node its certificate names, or
//! none. The agent routes' handlers refuse a request without one, and one whose node is
//! another (`http/identity.rs`).
//!
//! The other way round, the log proxy reaches an agent's API over HTTPS
//! ([`agent_client_config`]): it presents the coordinator's certificate (which agents answer,
//! see `pki.rs`) and accepts only the certificate the cluster CA issued to the node it means
//! to reach.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use nightshift_common::tls::TlsFileError;
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ServerConfig};
use tokio::net::TcpListener;

use crate::cluster::Cluster;
use crate::config::TlsConfig;

/// The node named by the connection's client certificate; `PeerNode(None)` on a TLS
/// connection without one. Absent on plain HTTP (no TLS configured).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerNode(pub Option<String>);

#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("{key} ({}): {reason}", path.display())]
    File {
        key: &'static str,
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("tls.ca_file: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

fn file_err(key: &'static str, path: &Path, reason: impl ToString) -> TlsSetupError {
    TlsSetupError::from(TlsFileError::new(key, path, reason))
}

impl From<TlsFileError> for TlsSetupError {
    fn from(e: TlsFileError) -> Self {
        Self::File {
            key: e.key,
            path: e.path,
            reason: e.reason,
        }
    }
}

/// The process's one crypto provider: ring.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    nightshift_common::tls::provider()
}

/// Every certificate in a PEM file; at least one.
pub fn load_certs(
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    Ok(nightshift_common::tls::load_certs(key, path)?)
}

/// The private key of a PEM file.
pub fn load_key(key: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    Ok(nightshift_common::tls::load_key(key, path)?)
}

/// Roots holding the CA certificates of `path`.
pub fn load_roots(key: &'static str, path: &Path) -> Result<Arc<RootCertStore>, TlsSetupError> {
    Ok(nightshift_common::tls::load_roots(key, path)?)
}

/// The server's TLS configuration: its certificate, and agents' certificates verified
/// against the cluster CA.
pub fn server_config(tls: &TlsConfig) -> Result<Arc<ServerConfig>, TlsSetupError> {
    let provider = provider();
    let roots = load_roots("tls.ca_file", &tls.ca_file)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .allow_unauthenticated()
        .build()?;
    let chain = load_certs("tls.cert_file", &tls.cert_file)?;
    let key = load_key("tls.key_file", &tls.key_file)?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
            file_err(
                "tls.key_file",
                &tls.key_file,
                format!("does not fit tls.cert_file: {e}"),
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A client configuration that trusts `ca_file` and, when given, presents a certificate.
pub fn client_config(
    ca_file: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<ClientConfig, TlsSetupError> {
    let roots = load_roots("tls.ca_file", ca_file)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    Ok(match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                load_certs("tls.cert_file", cert)?,
                load_key("tls.key_file", key)?,
            )
            .map_err(|e| {
                file_err(
                    "tls.key_file",
                    key,
                    format!("does not fit tls.cert_file: {e}"),
                )
            })?,
        None => builder.with_no_client_auth(),
    })
}

/// How the coordinator reaches node `node`'s agent API: trusting only a certificate the
/// cluster CA issued to that node, presenting the coordinator's own. Without `[tls]`, plain
/// HTTP only (an empty trust store: no `https://` agent is trusted).
pub fn agent_client_config(
    tls: Option<&TlsConfig>,
    node: &str,
) -> Result<ClientConfig, TlsSetupError> {
    let Some(tls) = tls else {
        return Ok(ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth());
    };
    agent_client_config_as(&tls.ca_file, Some((&tls.cert_file, &tls.key_file)), node)
}

/// [`agent_client_config`] presenting `identity` (a certificate and its key), or none: how
/// tests play another client of an agent's API.
pub fn agent_client_config_as(
    ca_file: &Path,
    identity: Option<(&Path, &Path)>,
    node: &str,
) -> Result<ClientConfig, TlsSetupError> {
    let provider = provider();
    let roots = load_roots("tls.ca_file", ca_file)?;
    let verifier = NodeCertificate {
        node: node.to_owned(),
        chain: WebPkiClientVerifier::builder_with_provider(roots, provider.clone()).build()?,
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let Some((cert, key)) = identity else {
        return Ok(builder.with_no_client_auth());
    };
    builder
        .with_client_auth_cert(
            load_certs("tls.cert_file", cert)?,
            load_key("tls.key_file", key)?,
        )
        .map_err(|e| {
            file_err(
                "tls.key_file",
                key,
                format!("does not fit tls.cert_file: {e}"),
            )
        })
}

/// Accepts an agent's certificate (`tls issue --node`) as a server's: signed by the cluster
/// CA for client authentication, as the coordinator checks it when the agent calls, and
/// naming the node the coordinator meant to reach, whatever host name its URL has.
#[derive(Debug)]
struct NodeCertificate {
    node: String,
    chain: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

impl rustls::client::danger::ServerCertVerifier for NodeCertificate {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.chain
            .verify_client_cert(end_entity, intermediates, now)?;
        match crate::pki::common_name(end_entity) {
            Some(name) if name == self.node => {
                Ok(rustls::client::danger::ServerCertVerified::assertion())
            }
            other => Err(rustls::Error::General(format!(
                "the agent's certificate is for node {}, not {}",
                other.as_deref().unwrap_or("(none)"),
                self.node
            ))),
        }
    }

    // The handshake's signatures are checked as the cluster CA's verifier checks them when
    // the agent calls in.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

/// Serves the API over TLS on `listener` until `shutdown` completes.
pub async fn serve_tls(
    listener: TcpListener,
    cluster: Arc<Cluster>,
    config: Arc<ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = crate::http::router(cluster.clone());
    serve_tls_app(listener, cluster, app, config, shutdown).await
}

/// Serves `app` (the API of `cluster`, e.g. with access control) over TLS.
pub async fn serve_tls_app(
    listener: TcpListener,
    cluster: Arc<Cluster>,
    app: axum::Router,
    config: Arc<ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ticker = tokio::spawn(crate::server::tick(cluster));
    serve_tls_router(listener, app, config, shutdown).await;
    ticker.abort();
    Ok(())
}

/// Serves `app` over TLS on `listener` until `shutdown` completes, ticking no cluster (the
/// leadership ticks its leader's, crate::leader).
pub async fn serve_tls_router(
    listener: TcpListener,
    app: axum::Router,
    config: Arc<ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let peer = |chain: Option<&[rustls::pki_types::CertificateDer<'static>]>| {
        PeerNode(
            chain
                .and_then(|chain| chain.first())
                .and_then(|cert| crate::pki::common_name(cert)),
        )
    };
    nightshift_common::net::serve_tls("api", listener, app, config, peer, shutdown).await;
}
