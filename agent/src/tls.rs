//! The agent's side of mutual TLS: it trusts only the cluster CA (so it verifies the
//! coordinator) and presents its own certificate, whose common name is its node. The same
//! files serve the agent's API (`api.rs`) over HTTPS, to the coordinator's certificate only:
//! the one whose subject carries the organizational unit [`COORDINATOR_UNIT`].
//!
//! Everything runs on rustls' ring provider; aws-lc-rs is not built (tests/run.sh checks).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::Deserialize;

// The certificate helpers the coordinator shares (nightshift-common's `tls` feature).
pub use nightshift_common::tls::{
    COMMON_NAME, COORDINATOR_UNIT, ORGANIZATIONAL_UNIT, TlsFileError, is_coordinator,
    subject_attribute,
};
use nightshift_common::tls::{load_certs as certs, provider};

/// `[tls]` of agent.toml: needed when the coordinator's URL is `https://`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentTlsConfig {
    /// The cluster CA (`ca.pem` of `nightshift-coordinator tls init`).
    pub ca_file: Option<PathBuf>,
    /// This node's certificate (`nightshift-coordinator tls issue --node NODE`).
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    pub key_file: Option<PathBuf>,
}

fn err(key: &'static str, path: &Path, reason: impl ToString) -> TlsFileError {
    TlsFileError::new(key, path, reason)
}

fn roots(ca_file: &Path) -> Result<RootCertStore, TlsFileError> {
    let mut roots = RootCertStore::empty();
    for cert in certs("tls.ca_file", ca_file)? {
        roots
            .add(cert)
            .map_err(|e| err("tls.ca_file", ca_file, format!("not a CA certificate: {e}")))?;
    }
    Ok(roots)
}

impl AgentTlsConfig {
    /// Whether the agent's API is served over HTTPS: the CA, a certificate and its key are
    /// all configured.
    pub fn serves_tls(&self) -> bool {
        self.ca_file.is_some() && self.cert_file.is_some() && self.key_file.is_some()
    }

    /// The server configuration of the agent's API: this node's certificate, and clients'
    /// certificates verified against the cluster CA (a client without one gets through the
    /// handshake, to be told 401; one from another CA does not). `None` unless
    /// [`Self::serves_tls`].
    pub fn server_config(&self) -> Result<Option<Arc<ServerConfig>>, TlsFileError> {
        let (Some(ca_file), Some(cert_file), Some(key_file)) =
            (&self.ca_file, &self.cert_file, &self.key_file)
        else {
            return Ok(None);
        };
        let roots = Arc::new(roots(ca_file)?);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .allow_unauthenticated()
            .build()
            .map_err(|e| err("tls.ca_file", ca_file, e))?;
        let chain = certs("tls.cert_file", cert_file)?;
        let key = PrivateKeyDer::from_pem_file(key_file)
            .map_err(|e| err("tls.key_file", key_file, format!("no private key: {e}")))?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| err("tls.ca_file", ca_file, e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| {
                err(
                    "tls.key_file",
                    key_file,
                    format!("does not fit tls.cert_file: {e}"),
                )
            })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(Arc::new(config)))
    }

    /// The client configuration, after checking that every file reads and that the CA
    /// signs this node's certificate. `None` when no CA is configured.
    pub fn client_config(&self) -> Result<Option<ClientConfig>, TlsFileError> {
        let Some(ca_file) = &self.ca_file else {
            return Ok(None);
        };
        let roots = Arc::new(roots(ca_file)?);
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| err("tls.ca_file", ca_file, e))?
            .with_root_certificates(roots.clone());
        let (cert_file, key_file) = match (&self.cert_file, &self.key_file) {
            (Some(c), Some(k)) => (c, k),
            (None, None) => return Ok(Some(builder.with_no_client_auth())),
            (Some(c), None) => return Err(err("tls.key_file", c, "is needed with tls.cert_file")),
            (None, Some(k)) => return Err(err("tls.cert_file", k, "is needed with tls.key_file")),
        };
        let chain = certs("tls.cert_file", cert_file)?;
        let key = PrivateKeyDer::from_pem_file(key_file)
            .map_err(|e| err("tls.key_file", key_file, format!("no private key: {e}")))?;
        // The coordinator will check the chain against the same CA: check it here first, so
        // that a wrong file is named before the agent starts.
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| err("tls.ca_file", ca_file, e))?;
        verifier
            .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
            .map_err(|e| {
                err(
                    "tls.cert_file",
                    cert_file,
                    format!(
                        "is not an agent certificate signed by tls.ca_file {}: {e}",
                        ca_file.display()
                    ),
                )
            })?;
        // The coordinator's certificate is a client certificate too (it reads the agents'
        // job routes), but it must never speak for a node.
        if is_coordinator(&chain[0]) {
            return Err(err(
                "tls.cert_file",
                cert_file,
                "is the coordinator's certificate, not an agent certificate",
            ));
        }
        builder
            .with_client_auth_cert(chain, key)
            .map(Some)
            .map_err(|e| {
                err(
                    "tls.key_file",
                    key_file,
                    format!("does not fit tls.cert_file: {e}"),
                )
            })
    }
}
