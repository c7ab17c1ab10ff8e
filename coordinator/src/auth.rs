//! API tokens with roles, stored hashed.
//!
//! `nightshift-coordinator token create --role R [--team T]` prints a token once; only its
//! SHA-256 is kept, in `DATA_DIR/tokens.json` (mode 0600). The tokens are 256 random bits,
//! so a plain hash is enough: there is nothing to guess that a slow hash would protect. The
//! file belongs to the data directory's owner (the service user), whoever creates a token.
//! A running coordinator looks at the file's metadata on each call that needs it (a `stat`,
//! about a microsecond: its inode, size and modification time) and rereads the file only when
//! that changed. So a token created while it runs works at once, one removed from the file
//! stops working at once, the first token created closes the open API at once, and a client
//! spraying unknown tokens costs a `stat` each, never a read and parse of the file.
//!
//! Roles: `admin` may do everything; `operator` runs the cluster (jobs of every team, gateway
//! signals); `researcher` sees every queue, but submits only as its team and cancels only its
//! team's jobs.

use std::path::{Path, PathBuf};
use std::sync::RwLock;

use ring::digest::{SHA256, digest};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

/// Every token starts with this, so that a leaked one is easy to recognise (and to grep for).
pub const TOKEN_PREFIX: &str = "nst_";
const FILE: &str = "tokens.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Admin,
    Operator,
    Researcher,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Operator => "operator",
            Self::Researcher => "researcher",
        }
    }
}

/// A token as stored: never the token itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRecord {
    pub id: u64,
    pub name: String,
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// Hex SHA-256 of the token.
    pub sha256: String,
    pub created_at: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    tokens: Vec<TokenRecord>,
}

/// Who is calling: what a verified token stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub token_id: u64,
    pub name: String,
    pub role: Role,
    pub team: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("--team is required for the researcher role (a researcher acts for one team)")]
    TeamRequired,
    #[error("no randomness from the operating system")]
    Random,
}

/// The token file of one coordinator.
pub struct Tokens {
    path: PathBuf,
    records: RwLock<Vec<TokenRecord>>,
    /// The token file as last looked at: which file, its size and when it last changed;
    /// and whether it could not be read then (the API is closed until it can).
    seen: std::sync::Mutex<(Option<FileStamp>, bool)>,
    /// How many times the file was read since it was opened.
    reads: std::sync::atomic::AtomicU64,
}

/// What tells one version of the token file from another without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        inode: m.ino(),
        len: m.len(),
        modified: m.modified().ok(),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hash(token: &str) -> String {
    hex(digest(&SHA256, token.as_bytes()).as_ref())
}

impl Tokens {
    /// The tokens of `data_dir` (none when it has no token file yet).
    pub fn open(data_dir: &Path) -> Result<Self, AuthError> {
        let path = data_dir.join(FILE);
        let seen = stamp(&path);
        let records = read(&path)?;
        Ok(Self {
            path,
            records: RwLock::new(records),
            seen: std::sync::Mutex::new((seen, false)),
            reads: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// The token file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether no token exists, so that the API is open. While none is known, the file is
    /// looked at each time (its metadata; it is read only when that changed), so a token
    /// that `token create` writes beside the running coordinator counts from the next call.
    pub fn is_empty(&self) -> bool {
        if !self.records.read().map_or(true, |r| r.is_empty()) {
            return false;
        }
        let unreadable = self.reread_if_changed();
        !unreadable && self.records.read().map_or(true, |r| r.is_empty())
    }

    /// Rereads the file if it is not the one last looked at. True while it cannot be read:
    /// a token file that exists but does not parse closes the API rather than open it.
    fn reread_if_changed(&self) -> bool {
        let now = stamp(&self.path);
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.0 == now {
            return seen.1;
        }
        let fresh = read(&self.path);
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = &fresh {
            tracing::warn!(error = %e, "token file cannot be read; the API is closed until it can");
        }
        *seen = (now, fresh.is_err());
        if let (Ok(fresh), Ok(mut r)) = (fresh, self.records.write()) {
            *r = fresh;
        }
        seen.1
    }

    /// Creates a token; returns its record and the token, which is shown once and never
    /// stored.
    pub fn create(
        &self,
        name: &str,
        role: Role,
        team: Option<&str>,
        now: u64,
    ) -> Result<(TokenRecord, String), AuthError> {
        if role == Role::Researcher && team.is_none() {
            return Err(AuthError::TeamRequired);
        }
        let mut secret = [0u8; 32];
        SystemRandom::new()
            .fill(&mut secret)
            .map_err(|_| AuthError::Random)?;
        let token = format!("{TOKEN_PREFIX}{}", hex(&secret));
        let mut records = read(&self.path)?;
        let record = TokenRecord {
            id: records.iter().map(|r| r.id).max().unwrap_or(0) + 1,
            name: name.to_owned(),
            role,
            team: team.map(str::to_owned),
            sha256: hash(&token),
            created_at: now,
        };
        records.push(record.clone());
        write(&self.path, &records)?;
        if let Ok(mut r) = self.records.write() {
            *r = records;
        }
        Ok((record, token))
    }

    /// The principal of `token`, if it is one of ours in the file as it is now: the file is
    /// reread first if it changed since it was last looked at, and only then. A file that
    /// cannot be read keeps the tokens last read from it.
    pub fn verify(&self, token: &str) -> Option<Principal> {
        let wanted = hash(token);
        let find = |records: &[TokenRecord]| {
            records
                .iter()
                // Equal-length hex of a hash: comparing it leaks nothing about the token.
                .find(|r| r.sha256 == wanted)
                .map(|r| Principal {
                    token_id: r.id,
                    name: r.name.clone(),
                    role: r.role,
                    team: r.team.clone(),
                })
        };
        self.reread_if_changed();
        self.records.read().ok().and_then(|r| find(&r))
    }

    /// How many times the token file was read, opening included.
    pub fn reads(&self) -> u64 {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn read(path: &Path) -> Result<Vec<TokenRecord>, AuthError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<TokenFile>(&bytes)
            .map(|f| f.tokens)
            .map_err(|source| AuthError::Parse {
                path: path.to_owned(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(AuthError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Writes the file whole (a temporary file renamed over it), readable by its owner only.
fn write(path: &Path, records: &[TokenRecord]) -> Result<(), AuthError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| AuthError::Io {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(&TokenFile {
        tokens: records.to_vec(),
    })
    .map_err(|source| AuthError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(&text).map_err(io)?;
    f.sync_all().map_err(io)?;
    // `token create` runs as root; the service runs as the data directory's owner.
    let dir = path.parent().unwrap_or(Path::new("."));
    if let (Ok(d), Ok(t)) = (std::fs::metadata(dir), f.metadata()) {
        use std::os::unix::fs::MetadataExt;
        if (d.uid(), d.gid()) != (t.uid(), t.gid()) {
            std::os::unix::fs::chown(&tmp, Some(d.uid()), Some(d.gid())).map_err(io)?;
        }
    }
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stored_hashed_and_verified() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::open(dir.path()).unwrap();
        assert!(tokens.is_empty());
        let (record, token) = tokens
            .create("alice", Role::Researcher, Some("nlp"), 1)
            .unwrap();
        assert!(
            token.starts_with(TOKEN_PREFIX) && token.len() == 4 + 64,
            "{token}"
        );
        let stored = std::fs::read_to_string(dir.path().join(FILE)).unwrap();
        assert!(!stored.contains(&token[4..]), "the token itself is stored");
        assert!(stored.contains(&record.sha256));

        // A second view of the same file (the running coordinator) learns of it on a miss.
        let running = Tokens::open(dir.path()).unwrap();
        let (_, admin) = tokens.create("root", Role::Admin, None, 2).unwrap();
        let p = running.verify(&admin).unwrap();
        assert_eq!((p.role, p.team, p.token_id), (Role::Admin, None, 2));
        assert_eq!(running.verify(&token).unwrap().team.as_deref(), Some("nlp"));
        assert_eq!(running.verify("nst_00"), None);

        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_token_created_by_another_process_closes_the_open_api_at_once() {
        let dir = tempfile::tempdir().unwrap();
        // The running coordinator, which knows of no token: the API is open.
        let running = Tokens::open(dir.path()).unwrap();
        assert!(running.is_empty());
        assert!(
            running.is_empty(),
            "an unchanged absent file changes nothing"
        );
        // `nightshift-coordinator token create`, another process with its own view.
        let cli = Tokens::open(dir.path()).unwrap();
        cli.create("alice", Role::Researcher, Some("nlp"), 1)
            .unwrap();
        assert!(
            !running.is_empty(),
            "the API is still open after a token was created"
        );

        // A token file that exists but cannot be read closes the API, not opens it.
        let dir = tempfile::tempdir().unwrap();
        let running = Tokens::open(dir.path()).unwrap();
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        assert!(!running.is_empty());
        assert!(!running.is_empty());
    }

    #[test]
    fn unknown_tokens_do_not_reread_an_unchanged_file() {
        let dir = tempfile::tempdir().unwrap();
        let cli = Tokens::open(dir.path()).unwrap();
        let (_, alice) = cli
            .create("alice", Role::Researcher, Some("nlp"), 1)
            .unwrap();
        let running = Tokens::open(dir.path()).unwrap();
        let opened = running.reads();

        // Sprayed wrong tokens, and the known one: not one read of the unchanged file.
        for i in 0..1000 {
            assert_eq!(running.verify(&format!("{TOKEN_PREFIX}{i:064x}")), None);
        }
        assert!(running.verify(&alice).is_some());
        assert_eq!(running.reads(), opened, "an unchanged file was reread");

        // Rotation: a new token works at once, and one removed from the file stops at once.
        let (_, bob) = cli.create("bob", Role::Admin, None, 2).unwrap();
        assert_eq!(running.verify(&bob).unwrap().name, "bob");
        assert_eq!(running.reads(), opened + 1);
        let text = std::fs::read_to_string(dir.path().join(FILE)).unwrap();
        let mut file: TokenFile = serde_json::from_str(&text).unwrap();
        file.tokens.retain(|r| r.name != "alice");
        let fewer = serde_json::to_vec_pretty(&file).unwrap();
        let tmp = dir.path().join("edited.json");
        std::fs::write(&tmp, fewer).unwrap();
        std::fs::rename(&tmp, dir.path().join(FILE)).unwrap();
        assert_eq!(running.verify(&alice), None, "a removed token still works");
        assert!(running.verify(&bob).is_some());
        assert_eq!(running.reads(), opened + 2);
    }

    #[test]
    fn a_researcher_needs_a_team() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::open(dir.path()).unwrap();
        let err = tokens.create("bob", Role::Researcher, None, 1).unwrap_err();
        assert!(err.to_string().starts_with("--team is required"), "{err}");
    }
}
