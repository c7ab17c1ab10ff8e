//! The agent's side of mutual TLS: it trusts only the cluster CA (so it verifies the
//! coordinator) and presents its own certificate, whose common name is its node. The same
//! files serve the agent's API (`api.rs`) over HTTPS, to the coordinator's certificate only:
//! the one whose subject carries the organizational unit [`COORDINATOR_UNIT`].
//!
//! Everything runs on rustls' ring provider; aws-lc-rs is not built (tests/run.sh checks).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
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

/// The organizational unit in the subject of the coordinator's certificate
/// (`nightshift-coordinator tls init` issues it with it; agents' certificates never carry it):
/// the one identity the agent serves job data to.
pub const COORDINATOR_UNIT: &str = "nightshift coordinator";

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

fn roots(ca_file: &Path) -> Result<RootCertStore, TlsFileError> {
    let mut roots = RootCertStore::empty();
    for cert in certs("tls.ca_file", ca_file)? {
        roots
            .add(cert)
            .map_err(|e| err("tls.ca_file", ca_file, format!("not a CA certificate: {e}")))?;
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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

/// The OID of a subject's common name (2.5.4.3).
pub const COMMON_NAME: [u8; 3] = [0x55, 0x04, 0x03];
/// The OID of a subject's organizational unit (2.5.4.11).
pub const ORGANIZATIONAL_UNIT: [u8; 3] = [0x55, 0x04, 0x0b];

/// Whether a DER certificate (one the cluster CA was already verified to have signed) is the
/// coordinator's: its subject's organizational unit is [`COORDINATOR_UNIT`].
pub fn is_coordinator(der: &[u8]) -> bool {
    subject_attribute(der, &ORGANIZATIONAL_UNIT).as_deref() == Some(COORDINATOR_UNIT)
}

/// The first value of attribute `oid` (e.g. [`COMMON_NAME`]) in the subject of a DER
/// certificate, if it has one as text.
pub fn subject_attribute(der: &[u8], oid: &[u8]) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, serial,
    //   signature, issuer, validity, subject, ... }, ... }
    let (cert, _) = der_item(der, 0x30)?;
    let (mut tbs, _) = der_item(cert, 0x30)?;
    if tbs.first() == Some(&0xa0) {
        tbs = der_item(tbs, 0xa0)?.1;
    }
    let mut rest = tbs;
    // serial, signature, issuer, validity
    for tag in [0x02, 0x30, 0x30, 0x30] {
        rest = der_item(rest, tag)?.1;
    }
    let (mut subject, _) = der_item(rest, 0x30)?;
    // Name ::= SEQUENCE OF SET OF SEQUENCE { type OID, value }
    while !subject.is_empty() {
        let (set, after) = der_item(subject, 0x31)?;
        subject = after;
        let (atv, _) = der_item(set, 0x30)?;
        let (found, value) = der_item(atv, 0x06)?;
        if found == oid {
            let tag = *value.first()?;
            // UTF8String, PrintableString, IA5String
            if matches!(tag, 0x0c | 0x13 | 0x16) {
                let (text, _) = der_item(value, tag)?;
                return String::from_utf8(text.to_vec()).ok();
            }
        }
    }
    None
}

/// One DER item with tag `tag` at the start of `input`: its contents and what follows.
fn der_item(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    if *input.first()? != tag {
        return None;
    }
    let first = *input.get(1)?;
    let (len, header) = if first < 0x80 {
        (first as usize, 2)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for b in input.get(2..2 + n)? {
            len = (len << 8) | *b as usize;
        }
        (len, 2 + n)
    };
    let end = header.checked_add(len)?;
    Some((input.get(header..end)?, input.get(end..)?))
}
