//! Registry credentials: which user the agent pulls as, per registry.
//!
//! `[registry] auth_file` in `agent.toml` names a file in Docker's `config.json` format,
//! `{"auths": {"HOST[:PORT]": {"auth": base64(USER:PASSWORD)}}}` (or `username` and
//! `password` instead of `auth`). The file is read when the configuration is checked and again
//! before each pull, so that rotated credentials need no restart. A password is never logged:
//! [`RegistryAuth`]'s `Debug` leaves it out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// `[registry]` in `agent.toml`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// Credentials per registry, in Docker's `config.json` format; none when unset (public
    /// images, or registries that ask for none).
    pub auth_file: Option<PathBuf>,
    /// Before a pull, while the file system of the engine's data root has less than this
    /// free, job images this agent pulled that no container uses are removed, oldest first
    /// (never the replica's image). Unset: nothing is removed.
    pub image_min_free_bytes: Option<u64>,
}

/// The credentials for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryAuth {
    /// The registry, as the auth file names it (`host[:port]`).
    pub server: String,
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("server", &self.server)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthFileError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: line {line}: {reason}")]
    Parse {
        path: String,
        line: usize,
        reason: String,
    },
    #[error("{path}: registry {registry}: {reason}")]
    Entry {
        path: String,
        registry: String,
        reason: String,
    },
}

#[derive(Deserialize)]
struct AuthFile {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

impl RegistryConfig {
    /// Every registry's credentials, read from `auth_file`; none when it is unset.
    pub fn credentials(&self) -> Result<Vec<RegistryAuth>, AuthFileError> {
        let Some(path) = &self.auth_file else {
            return Ok(Vec::new());
        };
        let text = std::fs::read_to_string(path).map_err(|source| AuthFileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        parse(path, &text)
    }

    /// The credentials for the registry `image` comes from, if the file names it.
    pub fn auth_for(&self, image: &str) -> Result<Option<RegistryAuth>, AuthFileError> {
        let registry = registry_of(image);
        Ok(self
            .credentials()?
            .into_iter()
            .find(|a| normalize(&a.server) == registry))
    }
}

fn parse(path: &Path, text: &str) -> Result<Vec<RegistryAuth>, AuthFileError> {
    let file: AuthFile = serde_json::from_str(text).map_err(|e| AuthFileError::Parse {
        path: path.display().to_string(),
        line: e.line(),
        // serde_json's message without its position, which `line` carries.
        reason: e
            .to_string()
            .split(" at line ")
            .next()
            .unwrap_or("")
            .to_owned(),
    })?;
    let entry_error = |registry: &str, reason: &str| AuthFileError::Entry {
        path: path.display().to_string(),
        registry: registry.to_owned(),
        reason: reason.to_owned(),
    };
    let mut out = Vec::new();
    for (server, entry) in file.auths {
        let (username, password) = match (entry.auth, entry.username, entry.password) {
            (Some(auth), None, None) => {
                let decoded = decode_base64(auth.trim())
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(|| entry_error(&server, "auth is not base64 of USER:PASSWORD"))?;
                let (user, pass) = decoded
                    .split_once(':')
                    .ok_or_else(|| entry_error(&server, "auth is not base64 of USER:PASSWORD"))?;
                (user.to_owned(), pass.to_owned())
            }
            (None, Some(user), Some(pass)) => (user, pass),
            _ => {
                return Err(entry_error(
                    &server,
                    "needs either auth (base64 of USER:PASSWORD) or username and password",
                ));
            }
        };
        if username.is_empty() {
            return Err(entry_error(&server, "the user name is empty"));
        }
        out.push(RegistryAuth {
            server,
            username,
            password,
        });
    }
    Ok(out)
}

/// The registry an image reference names: its first path component when that looks like a
/// host (a dot, a port or `localhost`), else Docker Hub (`docker.io`).
pub fn registry_of(image: &str) -> String {
    match image.split_once('/') {
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => normalize(first),
        _ => "docker.io".to_owned(),
    }
}

/// The repository of an image reference: without its tag or digest.
pub fn repository(image: &str) -> &str {
    let name = image.split_once('@').map_or(image, |(n, _)| n);
    match name.rfind(':') {
        Some(colon) if !name[colon..].contains('/') => &name[..colon],
        _ => name,
    }
}

/// A registry's name as `config.json` may spell it: an `https://` prefix and a path are
/// dropped, and Docker Hub's several names are one.
fn normalize(server: &str) -> String {
    let host = server
        .trim_start_matches("https://")
        .trim_start_matches("http://");
    let host = host.split('/').next().unwrap_or(host);
    match host {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".to_owned(),
        h => h.to_owned(),
    }
}

/// Standard base64 with padding; `None` when `text` is not that.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes = text.trim_end_matches('=').as_bytes();
    if !text.len().is_multiple_of(4) && text.ends_with('=') {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c)? << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> (tempfile_path::Guard, RegistryConfig) {
        let guard = tempfile_path::write(text);
        let cfg = RegistryConfig {
            auth_file: Some(guard.0.clone()),
            ..RegistryConfig::default()
        };
        (guard, cfg)
    }

    /// A file under the system's temporary directory, removed on drop.
    mod tempfile_path {
        pub struct Guard(pub std::path::PathBuf);
        impl Drop for Guard {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        pub fn write(text: &str) -> Guard {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "nightshift-auth-{}-{}.json",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&path, text).unwrap();
            Guard(path)
        }
    }

    #[test]
    fn reads_docker_config_auths() {
        // base64("alice:s3cr:et")
        let (_g, cfg) = cfg(
            r#"{"auths": {"127.0.0.1:5000": {"auth": "YWxpY2U6czNjcjpldA=="},
            "https://index.docker.io/v1/": {"username": "bob", "password": "pw"}}}"#,
        );
        let a = cfg
            .auth_for("127.0.0.1:5000/team/trainer:1")
            .unwrap()
            .unwrap();
        assert_eq!(
            (a.username.as_str(), a.password.as_str()),
            ("alice", "s3cr:et")
        );
        let b = cfg.auth_for("library/ubuntu:24.04").unwrap().unwrap();
        assert_eq!(b.username, "bob");
        assert!(cfg.auth_for("ghcr.io/x/y:1").unwrap().is_none());
        assert!(
            !format!("{a:?}").contains("s3cr"),
            "the password is never shown"
        );
    }

    #[test]
    fn bad_files_say_where() {
        let (_g, c) = cfg("{\n  \"auths\": {\n    \"r:5000\": {\"auth\": 12}\n");
        let e = c.credentials().unwrap_err().to_string();
        assert!(e.contains(": line 3: invalid type"), "{e}");
        let (_g, c) = cfg(r#"{"auths": {"r:5000": {"auth": "bm9jb2xvbg=="}}}"#);
        let e = c.credentials().unwrap_err().to_string();
        assert!(
            e.ends_with("registry r:5000: auth is not base64 of USER:PASSWORD"),
            "{e}"
        );
        let (_g, c) = cfg(r#"{"auths": {"r:5000": {"username": "u"}}}"#);
        assert!(c.credentials().is_err());
    }

    #[test]
    fn names_registries_and_repositories() {
        assert_eq!(registry_of("127.0.0.1:5000/a/b:1"), "127.0.0.1:5000");
        assert_eq!(registry_of("localhost/a"), "localhost");
        assert_eq!(registry_of("ubuntu:24.04"), "docker.io");
        assert_eq!(registry_of("team/trainer"), "docker.io");
        assert_eq!(repository("127.0.0.1:5000/a/b:1"), "127.0.0.1:5000/a/b");
        assert_eq!(repository("127.0.0.1:5000/a/b"), "127.0.0.1:5000/a/b");
        assert_eq!(repository("r/a@sha256:00"), "r/a");
        assert_eq!(decode_base64("YWJj").unwrap(), b"abc");
        assert_eq!(decode_base64("YWI=").unwrap(), b"ab");
        assert!(decode_base64("Y").is_none());
    }
}
