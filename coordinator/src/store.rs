//! The coordinator's durable store, on one of two backends: a local SQLite file (the embedded
//! default) or a PostgreSQL database (`[store] url = "postgres://..."`).
//!
//! Jobs (with their leases) and nodes are kept as JSON records of the wire types, keyed by id,
//! plus the counters that must never go backwards (job ids, lease ids, fencing epochs). Every
//! change the core reports is written in one transaction before the request that caused it
//! is answered, so an acknowledged submission survives a SIGKILL. Both backends share the
//! schema's history ([`MIGRATIONS`], one version number), the records' encoding and the
//! group commit (one transaction for a batch of calls' changes); the rest of the coordinator
//! sees [`Store`] only, never which backend runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nightshift_common::{GpuInfo, JobView, NodeMode, UnixMillis};
use nightshift_core::{CoreSnapshot, NodeSnapshot, Profile, Usage};
use serde::{Deserialize, Serialize};

use crate::pipelines::{PipelineChanges, PipelineSnapshot};

mod postgres;
mod sqlite;

pub use postgres::{PgStore, redact, session};
pub use sqlite::SqliteStore;

/// One step of the schema's history, in each backend's dialect. Both backends apply the same
/// steps in the same order, so a schema version means the same tables on either.
pub(crate) struct Migration {
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

/// Schema migrations, applied in order; each backend records how many ran (SQLite in
/// `PRAGMA user_version`, PostgreSQL in `nightshift_schema`).
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        sqlite: "
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) STRICT;
        CREATE TABLE jobs (id INTEGER PRIMARY KEY, state TEXT NOT NULL, record TEXT NOT NULL) STRICT;
        CREATE TABLE nodes (name TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT;
        ",
        postgres: "
        CREATE TABLE meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
        CREATE TABLE jobs (id BIGINT PRIMARY KEY, state TEXT NOT NULL, record TEXT NOT NULL);
        CREATE TABLE nodes (name TEXT PRIMARY KEY, record TEXT NOT NULL);
        ",
    },
    // Accounting: one row per ended lease.
    Migration {
        sqlite: "
        CREATE TABLE usage (
            lease_id INTEGER PRIMARY KEY,
            job_id INTEGER NOT NULL,
            team TEXT NOT NULL,
            node TEXT NOT NULL,
            gpus INTEGER NOT NULL,
            started_at INTEGER NOT NULL,
            ended_at INTEGER NOT NULL,
            preempted INTEGER NOT NULL,
            lost_gpu_ms INTEGER NOT NULL
        ) STRICT;
        CREATE INDEX usage_ended ON usage (ended_at);
        ",
        postgres: "
        CREATE TABLE usage (
            lease_id BIGINT PRIMARY KEY,
            job_id BIGINT NOT NULL,
            team TEXT NOT NULL,
            node TEXT NOT NULL,
            gpus BIGINT NOT NULL,
            started_at BIGINT NOT NULL,
            ended_at BIGINT NOT NULL,
            preempted BOOLEAN NOT NULL,
            lost_gpu_ms BIGINT NOT NULL
        );
        CREATE INDEX usage_ended ON usage (ended_at);
        ",
    },
    // Load profiles learned for predictive reclaim.
    Migration {
        sqlite: "CREATE TABLE profiles (service TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT;",
        postgres: "CREATE TABLE profiles (service TEXT PRIMARY KEY, record TEXT NOT NULL);",
    },
    // Pipeline runs: what each started from, every input it handled, the job of each step.
    Migration {
        sqlite: "
        CREATE TABLE pipeline_runs (id INTEGER PRIMARY KEY, record TEXT NOT NULL) STRICT;
        CREATE TABLE pipeline_inputs (
            run INTEGER NOT NULL, seq INTEGER NOT NULL, record TEXT NOT NULL,
            PRIMARY KEY (run, seq)) STRICT;
        CREATE TABLE pipeline_jobs (
            run INTEGER NOT NULL, node INTEGER NOT NULL, retry INTEGER NOT NULL, job INTEGER NOT NULL,
            PRIMARY KEY (run, node, retry)) STRICT;
        ",
        postgres: "
        CREATE TABLE pipeline_runs (id BIGINT PRIMARY KEY, record TEXT NOT NULL);
        CREATE TABLE pipeline_inputs (
            run BIGINT NOT NULL, seq BIGINT NOT NULL, record TEXT NOT NULL,
            PRIMARY KEY (run, seq));
        CREATE TABLE pipeline_jobs (
            run BIGINT NOT NULL, node BIGINT NOT NULL, retry BIGINT NOT NULL, job BIGINT NOT NULL,
            PRIMARY KEY (run, node, retry));
        ",
    },
    // The image each job attempt's container was created from, as its agent reported it.
    Migration {
        sqlite: "
        CREATE TABLE job_images (
            job INTEGER NOT NULL, attempt INTEGER NOT NULL, node TEXT NOT NULL,
            image_id TEXT NOT NULL, recorded_at INTEGER NOT NULL,
            PRIMARY KEY (job, attempt)) STRICT;
        ",
        postgres: "
        CREATE TABLE job_images (
            job BIGINT NOT NULL, attempt BIGINT NOT NULL, node TEXT NOT NULL,
            image_id TEXT NOT NULL, recorded_at BIGINT NOT NULL,
            PRIMARY KEY (job, attempt));
        ",
    },
    // The registry digest (`repo@sha256:...`) the attempt's image was pinned to, when a
    // registry knows the image.
    Migration {
        sqlite: "ALTER TABLE job_images ADD COLUMN image_digest TEXT;",
        postgres: "ALTER TABLE job_images ADD COLUMN image_digest TEXT;",
    },
    // The leader's lease (crate::leader): when it last renewed, on the database's clock, and
    // whether it holds the leadership lock. PostgreSQL's alone: SQLite is single-node and has
    // no leader table. A coordinator that knows no lease refuses this schema, so it never
    // campaigns beside those that do.
    Migration {
        sqlite: "",
        postgres: "
        ALTER TABLE nightshift_leader
            ADD COLUMN renewed_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
            ADD COLUMN lock_held BOOLEAN NOT NULL DEFAULT false;
        ",
    },
];

/// The schema version this coordinator writes: the number of [`MIGRATIONS`].
pub const SCHEMA_VERSION: usize = MIGRATIONS.len();

/// `found`, the schema version database `db` records, unless it is newer than this
/// coordinator knows (its tables may then mean something else).
fn known_version(db: &str, found: usize) -> Result<usize, StoreError> {
    if found > SCHEMA_VERSION {
        return Err(StoreError::TooNew {
            db: db.to_owned(),
            found,
            known: SCHEMA_VERSION,
        });
    }
    Ok(found)
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredProfile {
    weekly: Vec<Option<f64>>,
    daily: Vec<Option<f64>>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("database {path}: {source}")]
    Sqlite {
        path: PathBuf,
        source: rusqlite::Error,
    },
    /// `db` names the database without its password (`postgres://user@host:port/name`).
    #[error("database {db}: {}", postgres::describe(source))]
    Postgres {
        db: String,
        source: tokio_postgres::Error,
    },
    #[error("database {db}: {reason}")]
    Connect { db: String, reason: String },
    /// A leader's write found a newer term in the database: another coordinator leads now,
    /// and this one's writes are refused (nothing of the transaction was written).
    #[error(
        "database {db}: deposed: this coordinator led in term {ours}, the database is at term {current}"
    )]
    Deposed { db: String, ours: u64, current: u64 },
    #[error("store url {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("database {db}: {what} holds a record that does not parse: {source}")]
    Corrupt {
        db: String,
        what: String,
        source: serde_json::Error,
    },
    #[error("database {db}: pipeline runs cannot be replayed: {reason}")]
    Pipelines { db: String, reason: String },
    #[error(
        "data directory {dir} is in use by another coordinator ({holder}): only one may run on \
         it; stop that one first (a second would give the same job ids to other submissions)"
    )]
    Locked { dir: PathBuf, holder: String },
    #[error("cannot lock data directory {dir} ({lock_file}): {source}")]
    Lock {
        dir: PathBuf,
        lock_file: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "database {path} is empty (0 bytes) where a database was expected: it may be a lost \
         database; restore it from a backup, or remove the file to start with an empty state"
    )]
    Empty { path: PathBuf },
    #[error(
        "database {db} has schema version {found}, newer than this coordinator knows ({known}); \
         upgrade nightshift-coordinator"
    )]
    TooNew {
        db: String,
        found: usize,
        known: usize,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredNode {
    name: String,
    service: String,
    #[serde(default)]
    address: String,
    gpus: Vec<GpuInfo>,
    mode: NodeMode,
    desired_version: u64,
    mode_since: UnixMillis,
    /// The unfinished jobs whose newest checkpoint this node holds on its own storage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    checkpoints: Vec<StoredCheckpoint>,
}

/// A job's checkpoint held by a node: the job, and the fencing epoch of the attempt that
/// wrote it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredCheckpoint {
    job: u64,
    epoch: u64,
}

/// The JSON record of a node, as both backends keep it.
fn node_record(n: &NodeSnapshot) -> String {
    let stored = StoredNode {
        name: n.name.clone(),
        service: n.service.clone(),
        address: n.address.clone(),
        gpus: n.gpus.clone(),
        mode: n.mode,
        desired_version: n.desired_version,
        mode_since: n.mode_since,
        checkpoints: n
            .checkpoints
            .iter()
            .map(|&(job, epoch)| StoredCheckpoint { job, epoch })
            .collect(),
    };
    to_record(&stored)
}

fn node_from(n: StoredNode) -> NodeSnapshot {
    NodeSnapshot {
        address: if n.address.is_empty() {
            n.name.clone()
        } else {
            n.address
        },
        name: n.name,
        service: n.service,
        gpus: n.gpus,
        mode: n.mode,
        desired_version: n.desired_version,
        mode_since: n.mode_since,
        checkpoints: n.checkpoints.iter().map(|c| (c.job, c.epoch)).collect(),
    }
}

fn profile_record(p: &Profile) -> String {
    let stored = StoredProfile {
        weekly: p.weekly.clone(),
        daily: p.daily.clone(),
    };
    to_record(&stored)
}

fn profile_from(p: StoredProfile) -> Profile {
    Profile::from_parts(p.weekly, p.daily)
}

/// The names of the counters kept in `meta`, in the order of [`Changes::counters`].
const COUNTERS: [&str; 3] = ["next_job_id", "next_lease_id", "next_epoch"];

/// Where the state lives, from `[store] url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite:///path/to/nightshift.db`: a database file.
    Sqlite(PathBuf),
    /// `postgres://user:password@host:port/database?sslmode=...`, as libpq's URLs.
    Postgres(String),
}

impl StoreUrl {
    /// Parses `[store] url`: `sqlite://` followed by an absolute path, or a PostgreSQL URL
    /// (`postgres://` or `postgresql://`).
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let bad = |reason: &str| StoreError::Url {
            url: postgres::redact(url),
            reason: reason.to_owned(),
        };
        if let Some(path) = url.strip_prefix("sqlite://") {
            if !path.starts_with('/') {
                return Err(bad(
                    "a SQLite url names an absolute path: sqlite:///path/to/nightshift.db",
                ));
            }
            return Ok(Self::Sqlite(PathBuf::from(path)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            postgres::parse(url).map_err(|reason| bad(&reason))?;
            return Ok(Self::Postgres(url.to_owned()));
        }
        Err(bad(
            "must start with sqlite:// (a database file) or postgres:// (a PostgreSQL database)",
        ))
    }
}

/// The store, on whichever backend `[store] url` chose.
pub enum Store {
    Sqlite(SqliteStore),
    /// Boxed: its connection settings make it several times a SQLite store's size.
    Postgres(Box<PgStore>),
}

/// The database file in a data directory when `[store] url` is not set.
pub const DB_FILE: &str = "nightshift.db";

/// An exclusive `flock` on `DIR/coordinator.lock`, which holds the holder's PID: one
/// coordinator process per data directory (`serve` holds it for the life of the process).
/// The kernel lets go of it when the process ends, however it ends, so a crash leaves
/// nothing to clean up.
pub struct DataDirLock {
    _file: std::fs::File,
}

/// The lock file inside a data directory.
pub const LOCK_FILE: &str = "coordinator.lock";

impl DataDirLock {
    /// Takes the lock of `dir` (created if needed), or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<Self, StoreError> {
        use std::io::{Read, Seek, Write};
        std::fs::create_dir_all(dir).map_err(|source| StoreError::DataDir {
            path: dir.to_owned(),
            source,
        })?;
        let lock_file = dir.join(LOCK_FILE);
        let io = |source| StoreError::Lock {
            dir: dir.to_owned(),
            lock_file: lock_file.clone(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_file)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let holder = match text.trim() {
                    "" => "its pid unknown".to_owned(),
                    pid => pid.to_owned(),
                };
                return Err(StoreError::Locked {
                    dir: dir.to_owned(),
                    holder,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        write!(file, "pid {}", std::process::id()).map_err(io)?;
        Ok(Self { _file: file })
    }
}

/// One batch of changes, written atomically.
#[derive(Debug, Default)]
pub struct Changes {
    pub jobs: Vec<JobView>,
    pub nodes: Vec<NodeSnapshot>,
    pub usage: Vec<Usage>,
    pub profiles: Vec<(String, Profile)>,
    pub counters: Option<(u64, u64, u64)>,
    pub pipelines: PipelineChanges,
    /// Image IDs that job attempts' containers ran, as agents reported them; the first
    /// report of an attempt stands (every heartbeat repeats it).
    pub images: Vec<ImageRecord>,
}

/// The image one attempt of a job ran, reported by the agent of `node` at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub job: u64,
    pub attempt: u32,
    pub node: String,
    pub image_id: String,
    /// The image pinned to its registry digest (`repo@sha256:...`), when it came from one.
    pub image_digest: Option<String>,
    pub at: UnixMillis,
}

impl Store {
    /// Opens (creating when needed) `DIR/nightshift.db`, the store when `[store] url` is
    /// not set, and brings its schema up to date. An empty database file is refused: it may
    /// be a lost database. (A coordinator process takes the directory's [`DataDirLock`]
    /// first.)
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        SqliteStore::open(&data_dir.join(DB_FILE)).map(Self::Sqlite)
    }

    /// Opens the store at `url` and brings its schema up to date; `ca_file` (PEM) is the CA
    /// a PostgreSQL server's certificate must chain to, the system's roots when `None`.
    pub fn open_url(url: &StoreUrl, ca_file: Option<&Path>) -> Result<Self, StoreError> {
        match url {
            StoreUrl::Sqlite(path) => SqliteStore::open(path).map(Self::Sqlite),
            StoreUrl::Postgres(url) => {
                PgStore::open(url, ca_file).map(|s| Self::Postgres(Box::new(s)))
            }
        }
    }

    /// Which database this is, for logs and errors: a file's path, or a PostgreSQL URL
    /// without its password.
    pub fn location(&self) -> &str {
        match self {
            Self::Sqlite(s) => s.location(),
            Self::Postgres(s) => s.location(),
        }
    }

    /// Fences every later write with leadership term `term` (PostgreSQL only): a write whose
    /// transaction finds another term in `nightshift_leader` is refused with
    /// [`StoreError::Deposed`], so a deposed leader never writes again.
    pub fn fence(&mut self, term: u64) {
        if let Self::Postgres(s) = self {
            s.fence(term);
        }
    }

    /// The schema version the database is at (after [`Store::open`], [`SCHEMA_VERSION`]).
    pub fn schema_version(&self) -> Result<usize, StoreError> {
        match self {
            Self::Sqlite(s) => s.schema_version(),
            Self::Postgres(s) => s.schema_version(),
        }
    }

    /// Everything needed to rebuild the core.
    pub fn load(&self) -> Result<CoreSnapshot, StoreError> {
        match self {
            Self::Sqlite(s) => s.load(),
            Self::Postgres(s) => s.load(),
        }
    }

    /// The node of a job's most recent ended lease: where its last attempt's output is kept.
    pub fn last_node_of(&self, job_id: u64) -> Result<Option<String>, StoreError> {
        match self {
            Self::Sqlite(s) => s.last_node_of(job_id),
            Self::Postgres(s) => s.last_node_of(job_id),
        }
    }

    /// Every ended lease that overlaps `[since, until)`.
    pub fn usage(&self, since: UnixMillis, until: UnixMillis) -> Result<Vec<Usage>, StoreError> {
        match self {
            Self::Sqlite(s) => s.usage(since, until),
            Self::Postgres(s) => s.usage(since, until),
        }
    }

    /// GPU-milliseconds of every ended lease, by node.
    pub fn harvested_gpu_ms(&self) -> Result<Vec<(String, u64)>, StoreError> {
        match self {
            Self::Sqlite(s) => s.harvested_gpu_ms(),
            Self::Postgres(s) => s.harvested_gpu_ms(),
        }
    }

    /// Every pipeline run, with its inputs in order and its jobs.
    pub fn load_pipelines(&self) -> Result<PipelineSnapshot, StoreError> {
        match self {
            Self::Sqlite(s) => s.load_pipelines(),
            Self::Postgres(s) => s.load_pipelines(),
        }
    }

    /// The image each of `jobs` ran, when known: its newest attempt's registry digest
    /// (`repo@sha256:...`, which any host can pull), else its image ID (`sha256:...`, which
    /// only an engine that has the image can run).
    pub fn image_ids(&self, jobs: &[u64]) -> Result<BTreeMap<u64, String>, StoreError> {
        match self {
            Self::Sqlite(s) => s.image_ids(jobs),
            Self::Postgres(s) => s.image_ids(jobs),
        }
    }

    /// Writes one batch of changes in a single transaction.
    pub fn write(&mut self, changes: &Changes) -> Result<(), StoreError> {
        self.write_all(std::slice::from_ref(changes))
    }

    /// Writes several batches, in order, in a single transaction: one commit (and one
    /// fsync) for the changes of many calls (group commit).
    pub fn write_all(&mut self, batches: &[Changes]) -> Result<(), StoreError> {
        match self {
            Self::Sqlite(s) => s.write_all(batches),
            Self::Postgres(s) => s.write_all(batches),
        }
    }
}

/// How many rows `migrate` copied, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    pub jobs: usize,
    pub nodes: usize,
    pub usage: usize,
    pub pipeline_runs: usize,
    pub images: usize,
}

/// Copies the whole state of the SQLite file `from` (a stopped coordinator's) into the
/// PostgreSQL database `to`, in one transaction. The database must hold no state yet: a
/// copy never merges two installations' job ids.
pub fn migrate(from: &Path, to: &str, ca_file: Option<&Path>) -> Result<Copied, StoreError> {
    if !from.is_file() {
        return Err(StoreError::Url {
            url: format!("sqlite://{}", from.display()),
            reason: "no such database file".to_owned(),
        });
    }
    // The installation must be stopped: its coordinator holds this lock while it runs.
    let _lock = DataDirLock::acquire(from.parent().unwrap_or(Path::new("")))?;
    let source = SqliteStore::open(from)?;
    let changes = source.export()?;
    let mut target = PgStore::open(to, ca_file)?;
    let there = target.load()?;
    if !there.jobs.is_empty() || !there.nodes.is_empty() || there.next_job_id > 0 {
        return Err(StoreError::Connect {
            db: target.location().to_owned(),
            reason: format!(
                "already holds a coordinator's state ({} jobs, {} nodes); migrate copies into \
                 an empty database only",
                there.jobs.len(),
                there.nodes.len()
            ),
        });
    }
    target.write_all(std::slice::from_ref(&changes))?;
    Ok(Copied {
        jobs: changes.jobs.len(),
        nodes: changes.nodes.len(),
        usage: changes.usage.len(),
        pipeline_runs: changes.pipelines.runs.len(),
        images: changes.images.len(),
    })
}

/// What a failed PostgreSQL statement says, with the server's own message when it sent one.
pub fn describe_pg(e: &tokio_postgres::Error) -> String {
    postgres::describe(e)
}

/// The JSON record of a row, as both backends keep it; [`parse_record`] reads it back.
fn to_record(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("records always serialize")
}

/// Parses a JSON record of `what` (e.g. `job 7`), or says which one does not parse.
fn parse_record<T: serde::de::DeserializeOwned>(
    db: &str,
    what: impl FnOnce() -> String,
    record: &str,
) -> Result<T, StoreError> {
    serde_json::from_str(record).map_err(|source| StoreError::Corrupt {
        db: db.to_owned(),
        what: what(),
        source,
    })
}
