//! The agent's side of mutual TLS: it trusts only the cluster CA (so it verifies the
//! coordinator) and presents its own certificate, whose common name is its node.
//!
//! Everything runs on rustls' ring provider; aws-lc-rs is not built (tests/run.sh checks).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore};
use serde::Deserialize;

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

#[derive(Debug, thiserror::Error)]
#[error("{key} ({}): {reason}", path.display())]
pub struct TlsFileError {
    pub key: &'static str,
    pub path: PathBuf,
    pub reason: String,
}

fn err(key: &'static str, path: &Path, reason: impl ToString) -> TlsFileError {
    TlsFileError {
        key,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

fn certs(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(key, path, format!("cannot read: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(key, path, format!("not a PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(err(key, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl AgentTlsConfig {
    /// The client configuration, after checking that every file reads and that the CA
    /// signs this node's certificate. `None` when no CA is configured.
    pub fn client_config(&self) -> Result<Option<ClientConfig>, TlsFileError> {
        let Some(ca_file) = &self.ca_file else {
            return Ok(None);
        };
        let mut roots = RootCertStore::empty();
        for cert in certs("tls.ca_file", ca_file)? {
            roots
                .add(cert)
                .map_err(|e| err("tls.ca_file", ca_file, format!("not a CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
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
