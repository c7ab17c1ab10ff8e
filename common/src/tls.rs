//! Certificate helpers shared by the agent, the coordinator and the CLI (the `tls` feature):
//! reading PEM certificates, keys and CA roots with a message that names the setting and the
//! file, and reading a certificate's subject, which is how each side tells the coordinator's
//! certificate ([`COORDINATOR_UNIT`]) from an agent's (whose common name is its node).
//!
//! Everything runs on rustls' ring provider; aws-lc-rs is not built (tests/run.sh checks).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The organizational unit in the subject of the coordinator's certificate
/// (`nightshift-coordinator tls init` issues it with it; agents' certificates never carry it):
/// the one identity an agent serves job data to.
pub const COORDINATOR_UNIT: &str = "nightshift coordinator";

/// The OID of a subject's common name (2.5.4.3).
pub const COMMON_NAME: [u8; 3] = [0x55, 0x04, 0x03];
/// The OID of a subject's organizational unit (2.5.4.11).
pub const ORGANIZATIONAL_UNIT: [u8; 3] = [0x55, 0x04, 0x0b];

/// A certificate or key file that cannot be used, named by the setting that points at it
/// (`tls.ca_file`, `--ca`).
#[derive(Debug, thiserror::Error)]
#[error("{key} ({}): {reason}", path.display())]
pub struct TlsFileError {
    pub key: &'static str,
    pub path: PathBuf,
    pub reason: String,
}

impl TlsFileError {
    pub fn new(key: &'static str, path: &Path, reason: impl ToString) -> Self {
        Self {
            key,
            path: path.to_owned(),
            reason: reason.to_string(),
        }
    }
}

/// The process's one crypto provider: ring.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file; at least one.
pub fn load_certs(
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let err = |reason: String| TlsFileError::new(key, path, reason);
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(format!("cannot read: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("not a PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(err("holds no PEM certificate".to_owned()));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn load_key(key: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| TlsFileError::new(key, path, format!("no private key: {e}")))
}

/// Roots holding the CA certificates of `path`.
pub fn load_roots(key: &'static str, path: &Path) -> Result<Arc<RootCertStore>, TlsFileError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(key, path)? {
        roots.add(cert).map_err(|e| {
            TlsFileError::new(key, path, format!("not a usable CA certificate: {e}"))
        })?;
    }
    Ok(Arc::new(roots))
}

/// Whether a DER certificate (one the cluster CA was already verified to have signed) is the
/// coordinator's: its subject's organizational unit is [`COORDINATOR_UNIT`].
pub fn is_coordinator(der: &[u8]) -> bool {
    subject_attribute(der, &ORGANIZATIONAL_UNIT).as_deref() == Some(COORDINATOR_UNIT)
}

/// The subject common name of a DER certificate, if it has one as text.
pub fn common_name(der: &[u8]) -> Option<String> {
    subject_attribute(der, &COMMON_NAME)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_has_no_subject() {
        assert_eq!(common_name(b"\x30\x03garbage"), None);
        assert_eq!(common_name(b""), None);
        assert!(!is_coordinator(b"\x30\x82\xff\xff"));
    }

    #[test]
    fn a_missing_file_names_its_setting() {
        let err = load_roots("--ca", Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--ca (/nonexistent/ca.pem): cannot read"),
            "{err}"
        );
    }
}
