//! The cluster's certificates: a CA (`nightshift-coordinator tls init`), the coordinator's
//! certificate, and one client certificate per agent whose common name is its node
//! (`tls issue --node NAME`). Also reading a peer certificate's common name, which is how
//! the coordinator knows which node an agent may speak for.
//!
//! The coordinator's certificate serves the API (server authentication) and is also the
//! client certificate the log proxy presents to agents (client authentication); its subject's
//! organizational unit, [`COORDINATOR_UNIT`], is what an agent checks before it serves job
//! data, so an agent's certificate (which never carries it) cannot read another node's logs.
//!
//! The CA is not parsed back from its PEM: its distinguished name is fixed, so the issuer is
//! rebuilt from that name and the CA's key, which is all a signature needs.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// The CA's common name; fixed, so that the issuer can be rebuilt from the key alone.
pub const CA_NAME: &str = "nightshift cluster CA";

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const SERVER_CERT: &str = "coordinator.pem";
pub const SERVER_KEY: &str = "coordinator.key";

pub use nightshift_common::tls::{COORDINATOR_UNIT, common_name, is_coordinator};

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: already exists; remove it to make a new one", .0.display())]
    Exists(PathBuf),
    #[error("{what}: {source}")]
    Cert { what: String, source: rcgen::Error },
    #[error("node {0:?}: must be letters, digits, '-', '_' or '.'")]
    BadNode(String),
}

/// A certificate and its private key, both PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

fn cert_err(what: &str) -> impl FnOnce(rcgen::Error) -> PkiError + '_ {
    move |source| PkiError::Cert {
        what: what.to_owned(),
        source,
    }
}

/// The current year, near enough for certificate validity.
fn this_year() -> i32 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    1970 + (secs / 31_556_952) as i32
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

/// A new cluster CA, valid for 10 years.
pub fn new_ca() -> Result<Issued, PkiError> {
    let key = KeyPair::generate().map_err(cert_err("ca key"))?;
    let mut params = ca_params();
    params.not_before = rcgen::date_time_ymd(this_year() - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(this_year() + 10, 1, 1);
    let cert = params.self_signed(&key).map_err(cert_err("ca"))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// What a leaf certificate is for.
pub enum Leaf<'a> {
    /// The coordinator: server authentication for these DNS names or IP addresses, and
    /// client authentication as [`COORDINATOR_UNIT`] (the log proxy, to agents).
    Server(&'a [String]),
    /// An agent: client authentication, common name (and DNS name) = the node.
    Agent(&'a str),
}

/// A certificate signed by the CA whose private key is `ca_key_pem`, valid for 2 years.
pub fn issue(ca_key_pem: &str, leaf: Leaf<'_>) -> Result<Issued, PkiError> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(cert_err("ca key"))?;
    let issuer = Issuer::new(ca_params(), ca_key);
    let key = KeyPair::generate().map_err(cert_err("key"))?;
    let (names, cn, unit, eku) = match leaf {
        Leaf::Server(names) => (
            names.to_vec(),
            names.first().cloned().unwrap_or_default(),
            Some(COORDINATOR_UNIT),
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        ),
        Leaf::Agent(node) => {
            let ok = !node.is_empty()
                && node
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if !ok {
                return Err(PkiError::BadNode(node.to_owned()));
            }
            (
                vec![node.to_owned()],
                node.to_owned(),
                None,
                vec![ExtendedKeyUsagePurpose::ClientAuth],
            )
        }
    };
    let mut params = CertificateParams::new(names).map_err(cert_err("names"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(unit) = unit {
        dn.push(DnType::OrganizationalUnitName, unit);
    }
    params.distinguished_name = dn;
    params.extended_key_usages = eku;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = rcgen::date_time_ymd(this_year() - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(this_year() + 2, 1, 1);
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(cert_err("certificate"))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Writes a certificate and its key (mode 0600) without overwriting either.
pub fn write_pair(cert: &Path, key: &Path, issued: &Issued) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    for path in [cert, key] {
        if path.exists() {
            return Err(PkiError::Exists(path.to_owned()));
        }
    }
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| PkiError::Io { path, source }
    };
    for (path, text, mode) in [
        (cert, &issued.cert_pem, 0o644),
        (key, &issued.key_pem, 0o600),
    ] {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .map_err(io(path))?;
        f.write_all(text.as_bytes()).map_err(io(path))?;
    }
    Ok(())
}

/// Reads a whole file, naming it on failure.
pub fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Io {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    use super::*;

    #[test]
    fn an_agent_certificate_names_its_node() {
        let ca = new_ca().unwrap();
        let agent = issue(&ca.key_pem, Leaf::Agent("gpu-01")).unwrap();
        let der = CertificateDer::from_pem_slice(agent.cert_pem.as_bytes()).unwrap();
        assert_eq!(common_name(&der).as_deref(), Some("gpu-01"));
        let ca_der = CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap();
        assert_eq!(common_name(&ca_der).as_deref(), Some(CA_NAME));
        assert_eq!(common_name(b"\x30\x03garbage"), None);
    }

    #[test]
    fn only_the_coordinators_certificate_names_the_coordinator() {
        let ca = new_ca().unwrap();
        let names = ["coord.example".to_owned()];
        let coordinator = issue(&ca.key_pem, Leaf::Server(&names)).unwrap();
        let der = CertificateDer::from_pem_slice(coordinator.cert_pem.as_bytes()).unwrap();
        assert!(is_coordinator(&der));
        assert_eq!(common_name(&der).as_deref(), Some("coord.example"));
        // A node named like the unit is still a node.
        for node in ["gpu-01", "nightshift.coordinator"] {
            let agent = issue(&ca.key_pem, Leaf::Agent(node)).unwrap();
            let der = CertificateDer::from_pem_slice(agent.cert_pem.as_bytes()).unwrap();
            assert!(!is_coordinator(&der), "{node}");
        }
    }

    #[test]
    fn a_node_name_that_is_not_a_name_is_refused() {
        let ca = new_ca().unwrap();
        let err = issue(&ca.key_pem, Leaf::Agent("gpu 01/x")).err().unwrap();
        assert_eq!(
            err.to_string(),
            "node \"gpu 01/x\": must be letters, digits, '-', '_' or '.'"
        );
    }

    #[test]
    fn keys_are_written_private_and_never_overwritten() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("a.pem"), dir.path().join("a.key"));
        let ca = new_ca().unwrap();
        write_pair(&cert, &key, &ca).unwrap();
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let err = write_pair(&cert, &key, &ca).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("already exists; remove it to make a new one")
        );
    }
}
