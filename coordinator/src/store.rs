//! The coordinator's durable store: one SQLite file in WAL mode.
//!
//! Jobs (with their leases) and nodes are kept as JSON records of the wire types, keyed by id,
//! plus the counters that must never go backwards (job ids, lease ids, fencing epochs). Every
//! change the core reports is written in one transaction before the request that caused it
//! is answered, so an acknowledged submission survives a SIGKILL.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nightshift_common::{GpuInfo, JobView, NodeMode, UnixMillis};
use nightshift_core::{CoreSnapshot, NodeSnapshot, Profile, Usage};

use crate::pipelines::{PipelineChanges, PipelineSnapshot};
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

/// Schema migrations, applied in order; `PRAGMA user_version` records how many ran.
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) STRICT;
    CREATE TABLE jobs (id INTEGER PRIMARY KEY, state TEXT NOT NULL, record TEXT NOT NULL) STRICT;
    CREATE TABLE nodes (name TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT;
    ",
    // Accounting: one row per ended lease.
    "
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
    // Load profiles learned for predictive reclaim.
    "
    CREATE TABLE profiles (service TEXT PRIMARY KEY, record TEXT NOT NULL) STRICT;
    ",
    // Pipeline runs: what each started from, every input it handled, the job of each step.
    "
    CREATE TABLE pipeline_runs (id INTEGER PRIMARY KEY, record TEXT NOT NULL) STRICT;
    CREATE TABLE pipeline_inputs (
        run INTEGER NOT NULL, seq INTEGER NOT NULL, record TEXT NOT NULL,
        PRIMARY KEY (run, seq)) STRICT;
    CREATE TABLE pipeline_jobs (
        run INTEGER NOT NULL, node INTEGER NOT NULL, retry INTEGER NOT NULL, job INTEGER NOT NULL,
        PRIMARY KEY (run, node, retry)) STRICT;
    ",
    // The image each job attempt's container was created from, as its agent reported it.
    "
    CREATE TABLE job_images (
        job INTEGER NOT NULL, attempt INTEGER NOT NULL, node TEXT NOT NULL,
        image_id TEXT NOT NULL, recorded_at INTEGER NOT NULL,
        PRIMARY KEY (job, attempt)) STRICT;
    ",
    // The registry digest (`repo@sha256:...`) the attempt's image was pinned to, when a
    // registry knows the image.
    "
    ALTER TABLE job_images ADD COLUMN image_digest TEXT;
    ",
];

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
    #[error("database {path}: {what} holds a record that does not parse: {source}")]
    Corrupt {
        path: PathBuf,
        what: String,
        source: serde_json::Error,
    },
    #[error("database {path}: pipeline runs cannot be replayed: {reason}")]
    Pipelines { path: PathBuf, reason: String },
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
        "database {path} has schema version {found}, newer than this coordinator knows ({known}); \
         upgrade nightshift-coordinator"
    )]
    TooNew {
        path: PathBuf,
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

pub struct Store {
    conn: Connection,
    path: PathBuf,
}

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
    /// Opens (creating when needed) `DIR/nightshift.db` and brings its schema up to date.
    /// An empty database file is refused: it may be a lost database. (A coordinator process
    /// takes the directory's [`DataDirLock`] first.)
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(data_dir).map_err(|source| StoreError::DataDir {
            path: data_dir.to_owned(),
            source,
        })?;
        let path = data_dir.join("nightshift.db");
        // SQLite takes an empty file for a new database; here it is more likely one that was
        // lost (truncated, a failed copy), and starting empty would hide that.
        if std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == 0) {
            return Err(StoreError::Empty { path });
        }
        let conn = Connection::open(&path).map_err(|source| StoreError::Sqlite {
            path: path.clone(),
            source,
        })?;
        let mut store = Self { conn, path };
        store.setup()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn sql(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn setup(&mut self) -> Result<(), StoreError> {
        self.conn
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000;",
            )
            .map_err(|e| self.sql(e))?;
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.sql(e))?;
        let version = usize::try_from(version).unwrap_or(usize::MAX);
        if version > MIGRATIONS.len() {
            return Err(StoreError::TooNew {
                path: self.path.clone(),
                found: version,
                known: MIGRATIONS.len(),
            });
        }
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version) {
            let tx = self.conn.transaction().map_err(|e| StoreError::Sqlite {
                path: self.path.clone(),
                source: e,
            })?;
            tx.execute_batch(migration)
                .and_then(|()| tx.pragma_update(None, "user_version", (i + 1) as i64))
                .and_then(|()| tx.commit())
                .map_err(|source| StoreError::Sqlite {
                    path: self.path.clone(),
                    source,
                })?;
        }
        Ok(())
    }

    /// Every `(key, record)` row that `sql` selects, each record parsed from JSON; `what`
    /// names a row in the error when one does not parse.
    fn records<T: serde::de::DeserializeOwned>(
        &self,
        sql: &str,
        what: &str,
    ) -> Result<Vec<(String, T)>, StoreError> {
        let mut stmt = self.conn.prepare(sql).map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([], |r| {
                let key = match r.get::<_, rusqlite::types::Value>(0)? {
                    rusqlite::types::Value::Integer(i) => i.to_string(),
                    rusqlite::types::Value::Text(t) => t,
                    other => format!("{other:?}"),
                };
                Ok((key, r.get::<_, String>(1)?))
            })
            .map_err(|e| self.sql(e))?;
        let mut out = Vec::new();
        for row in rows {
            let (key, record) = row.map_err(|e| self.sql(e))?;
            let value = serde_json::from_str(&record).map_err(|source| StoreError::Corrupt {
                path: self.path.clone(),
                what: format!("{what} {key}"),
                source,
            })?;
            out.push((key, value));
        }
        Ok(out)
    }

    /// Everything needed to rebuild the core.
    pub fn load(&self) -> Result<CoreSnapshot, StoreError> {
        let jobs = self
            .records::<JobView>("SELECT id, record FROM jobs ORDER BY id", "job")?
            .into_iter()
            .map(|(_, job)| job)
            .collect();
        let mut snapshot = CoreSnapshot {
            jobs,
            ..CoreSnapshot::default()
        };
        for (_, n) in
            self.records::<StoredNode>("SELECT name, record FROM nodes ORDER BY name", "node")?
        {
            snapshot.nodes.push(NodeSnapshot {
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
            });
        }
        for (service, p) in self.records::<StoredProfile>(
            "SELECT service, record FROM profiles ORDER BY service",
            "profile of",
        )? {
            snapshot
                .profiles
                .push((service, Profile::from_parts(p.weekly, p.daily)));
        }
        let counter = |key: &str| -> Result<u64, StoreError> {
            let v: Option<i64> = self
                .conn
                .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
                .optional()
                .map_err(|e| self.sql(e))?;
            Ok(v.unwrap_or(0) as u64)
        };
        snapshot.next_job_id = counter("next_job_id")?;
        snapshot.next_lease_id = counter("next_lease_id")?;
        snapshot.next_epoch = counter("next_epoch")?;
        Ok(snapshot)
    }

    /// The node of a job's most recent ended lease: where its last attempt's output is kept.
    pub fn last_node_of(&self, job_id: u64) -> Result<Option<String>, StoreError> {
        self.conn
            .query_row(
                "SELECT node FROM usage WHERE job_id = ?1 ORDER BY lease_id DESC LIMIT 1",
                [job_id as i64],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Every ended lease that overlaps `[since, until)`.
    pub fn usage(&self, since: UnixMillis, until: UnixMillis) -> Result<Vec<Usage>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT lease_id, job_id, team, node, gpus, started_at, ended_at, preempted, lost_gpu_ms
                 FROM usage WHERE ended_at >= ?1 AND started_at < ?2 ORDER BY lease_id",
            )
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map(params![since as i64, until as i64], |r| {
                Ok(Usage {
                    lease_id: r.get::<_, i64>(0)? as u64,
                    job_id: r.get::<_, i64>(1)? as u64,
                    team: r.get(2)?,
                    node: r.get(3)?,
                    gpus: r.get(4)?,
                    started_at: r.get::<_, i64>(5)? as u64,
                    ended_at: r.get::<_, i64>(6)? as u64,
                    preempted: r.get(7)?,
                    lost_gpu_ms: r.get::<_, i64>(8)? as u64,
                })
            })
            .map_err(|e| self.sql(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))
    }

    /// GPU-milliseconds of every ended lease, by node.
    pub fn harvested_gpu_ms(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT node, SUM(gpus * (ended_at - started_at)) FROM usage
                 GROUP BY node ORDER BY node",
            )
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64))
            })
            .map_err(|e| self.sql(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))
    }

    /// Every pipeline run, with its inputs in order and its jobs.
    pub fn load_pipelines(&self) -> Result<PipelineSnapshot, StoreError> {
        let mut snapshot = PipelineSnapshot::default();
        let corrupt = |what: String, source| StoreError::Corrupt {
            path: self.path.clone(),
            what,
            source,
        };
        let mut stmt = self
            .conn
            .prepare("SELECT id, record FROM pipeline_runs ORDER BY id")
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
            .map_err(|e| self.sql(e))?;
        for row in rows {
            let (id, record) = row.map_err(|e| self.sql(e))?;
            let run = serde_json::from_str(&record)
                .map_err(|e| corrupt(format!("pipeline run {id}"), e))?;
            snapshot.runs.push(run);
        }
        let mut stmt = self
            .conn
            .prepare("SELECT run, seq, record FROM pipeline_inputs ORDER BY run, seq")
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(|e| self.sql(e))?;
        for row in rows {
            let (run, seq, record) = row.map_err(|e| self.sql(e))?;
            let input = serde_json::from_str(&record)
                .map_err(|e| corrupt(format!("input {seq} of pipeline run {run}"), e))?;
            snapshot.inputs.entry(run as u64).or_default().push(input);
        }
        let mut stmt = self
            .conn
            .prepare("SELECT run, node, retry, job FROM pipeline_jobs")
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)? as u64,
                    r.get::<_, i64>(1)? as usize,
                    r.get::<_, i64>(2)? as u32,
                    r.get::<_, i64>(3)? as u64,
                ))
            })
            .map_err(|e| self.sql(e))?;
        for row in rows {
            snapshot.jobs.push(row.map_err(|e| self.sql(e))?);
        }
        Ok(snapshot)
    }

    /// The image each of `jobs` ran, when known: its newest attempt's registry digest
    /// (`repo@sha256:...`, which any host can pull), else its image ID (`sha256:...`, which
    /// only an engine that has the image can run).
    pub fn image_ids(&self, jobs: &[u64]) -> Result<BTreeMap<u64, String>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT COALESCE(image_digest, image_id) FROM job_images WHERE job = ?1
                 ORDER BY attempt DESC LIMIT 1",
            )
            .map_err(|e| self.sql(e))?;
        let mut out = BTreeMap::new();
        for job in jobs {
            let id: Option<String> = stmt
                .query_row([*job as i64], |r| r.get(0))
                .optional()
                .map_err(|e| self.sql(e))?;
            out.extend(id.map(|id| (*job, id)));
        }
        Ok(out)
    }

    /// Writes one batch of changes in a single transaction.
    pub fn write(&mut self, changes: &Changes) -> Result<(), StoreError> {
        self.write_all(std::slice::from_ref(changes))
    }

    /// Writes several batches, in order, in a single transaction: one commit (and one
    /// fsync) for the changes of many calls (group commit).
    pub fn write_all(&mut self, batches: &[Changes]) -> Result<(), StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(sql)?;
        for changes in batches {
            Self::write_in(&tx, &sql, changes)?;
        }
        tx.commit().map_err(sql)
    }

    fn write_in(
        tx: &rusqlite::Transaction<'_>,
        sql: &impl Fn(rusqlite::Error) -> StoreError,
        changes: &Changes,
    ) -> Result<(), StoreError> {
        for job in &changes.jobs {
            let record = serde_json::to_string(job).expect("wire types always serialize");
            tx.prepare_cached(
                "INSERT INTO jobs (id, state, record) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![job.id as i64, job.state.as_str(), record]))
            .map_err(sql)?;
        }
        for n in &changes.nodes {
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
            let record = serde_json::to_string(&stored).expect("wire types always serialize");
            tx.prepare_cached(
                "INSERT INTO nodes (name, record) VALUES (?1, ?2)
                 ON CONFLICT(name) DO UPDATE SET record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![n.name, record]))
            .map_err(sql)?;
        }
        for (service, p) in &changes.profiles {
            let stored = StoredProfile {
                weekly: p.weekly.clone(),
                daily: p.daily.clone(),
            };
            let record = serde_json::to_string(&stored).expect("profiles always serialize");
            tx.prepare_cached(
                "INSERT INTO profiles (service, record) VALUES (?1, ?2)
                 ON CONFLICT(service) DO UPDATE SET record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![service, record]))
            .map_err(sql)?;
        }
        for u in &changes.usage {
            tx.prepare_cached(
                "INSERT OR REPLACE INTO usage
                 (lease_id, job_id, team, node, gpus, started_at, ended_at, preempted, lost_gpu_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    u.lease_id as i64,
                    u.job_id as i64,
                    u.team,
                    u.node,
                    u.gpus,
                    u.started_at as i64,
                    u.ended_at as i64,
                    u.preempted,
                    u.lost_gpu_ms as i64
                ])
            })
            .map_err(sql)?;
        }
        let p = &changes.pipelines;
        for run in &p.runs {
            let record = serde_json::to_string(run).expect("wire types always serialize");
            tx.prepare_cached(
                "INSERT INTO pipeline_runs (id, record) VALUES (?1, ?2)
                 ON CONFLICT(id) DO UPDATE SET record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![run.id as i64, record]))
            .map_err(sql)?;
        }
        for (run, seq, input) in &p.inputs {
            let record = serde_json::to_string(input).expect("wire types always serialize");
            tx.prepare_cached("INSERT INTO pipeline_inputs (run, seq, record) VALUES (?1, ?2, ?3)")
                .and_then(|mut st| st.execute(params![*run as i64, *seq as i64, record]))
                .map_err(sql)?;
        }
        for (run, node, retry, job) in &p.jobs {
            tx.prepare_cached(
                "INSERT INTO pipeline_jobs (run, node, retry, job) VALUES (?1, ?2, ?3, ?4)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    *run as i64,
                    *node as i64,
                    *retry as i64,
                    *job as i64
                ])
            })
            .map_err(sql)?;
        }
        for im in &changes.images {
            tx.prepare_cached(
                "INSERT INTO job_images (job, attempt, node, image_id, recorded_at, image_digest)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT DO NOTHING",
            )
            .and_then(|mut st| {
                st.execute(params![
                    im.job as i64,
                    i64::from(im.attempt),
                    im.node,
                    im.image_id,
                    im.at as i64,
                    im.image_digest
                ])
            })
            .map_err(sql)?;
        }
        if let Some((job, lease, epoch)) = changes.counters {
            for (key, value) in [
                ("next_job_id", job),
                ("next_lease_id", lease),
                ("next_epoch", epoch),
            ] {
                tx.prepare_cached(
                    "INSERT INTO meta (key, value) VALUES (?1, ?2)
                     ON CONFLICT(key) DO UPDATE SET value = MAX(value, excluded.value)",
                )
                .and_then(|mut st| st.execute(params![key, value as i64]))
                .map_err(sql)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{JobSpec, JobState};

    fn job(id: u64) -> JobView {
        JobView::queued(id, JobSpec::new("t", "i", 1), 5)
    }

    #[test]
    fn written_changes_come_back_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        let mut j = job(1);
        store
            .write(&Changes {
                jobs: vec![j.clone()],
                counters: Some((2, 1, 1)),
                ..Default::default()
            })
            .unwrap();
        j.state = JobState::Running;
        j.attempt = 2;
        store
            .write(&Changes {
                jobs: vec![j.clone(), job(2)],
                counters: Some((3, 5, 7)),
                ..Default::default()
            })
            .unwrap();
        drop(store);
        let snapshot = Store::open(dir.path()).unwrap().load().unwrap();
        assert_eq!(snapshot.jobs, vec![j, job(2)]);
        assert_eq!(
            (
                snapshot.next_job_id,
                snapshot.next_lease_id,
                snapshot.next_epoch
            ),
            (3, 5, 7)
        );
    }

    #[test]
    fn the_checkpoints_a_node_holds_come_back_and_old_records_have_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        let node = |name: &str, checkpoints| NodeSnapshot {
            name: name.into(),
            service: "llm".into(),
            address: name.into(),
            gpus: Vec::new(),
            mode: NodeMode::Lend,
            desired_version: 3,
            mode_since: 9,
            checkpoints,
        };
        store
            .write(&Changes {
                nodes: vec![node("a", vec![(7, 12), (9, 4)]), node("b", Vec::new())],
                ..Default::default()
            })
            .unwrap();
        // A record written before nodes held checkpoints.
        store
            .conn
            .execute(
                "INSERT INTO nodes (name, record) VALUES ('c', ?1)",
                [r#"{"name":"c","service":"llm","gpus":[],"mode":"serve","desired_version":1,"mode_since":0}"#],
            )
            .unwrap();
        let record: String = store
            .conn
            .query_row("SELECT record FROM nodes WHERE name = 'b'", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert!(!record.contains("checkpoints"), "{record}");
        drop(store);
        let nodes = Store::open(dir.path()).unwrap().load().unwrap().nodes;
        assert_eq!(nodes[0], node("a", vec![(7, 12), (9, 4)]));
        assert_eq!(nodes[1], node("b", Vec::new()));
        assert_eq!(
            (nodes[2].name.as_str(), nodes[2].checkpoints.len()),
            ("c", 0)
        );
    }

    #[test]
    fn batches_written_together_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        let mut later = job(1);
        later.state = JobState::Running;
        store
            .write_all(&[
                Changes {
                    jobs: vec![job(1)],
                    counters: Some((2, 1, 1)),
                    ..Default::default()
                },
                Changes {
                    jobs: vec![later.clone(), job(2)],
                    counters: Some((3, 4, 4)),
                    ..Default::default()
                },
            ])
            .unwrap();
        drop(store);
        let snapshot = Store::open(dir.path()).unwrap().load().unwrap();
        assert_eq!(snapshot.jobs, vec![later, job(2)]);
        assert_eq!(snapshot.next_lease_id, 4);
    }

    #[test]
    fn counters_never_go_backwards() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        store
            .write(&Changes {
                counters: Some((9, 9, 9)),
                ..Default::default()
            })
            .unwrap();
        store
            .write(&Changes {
                counters: Some((3, 3, 3)),
                ..Default::default()
            })
            .unwrap();
        let s = store.load().unwrap();
        assert_eq!((s.next_job_id, s.next_lease_id, s.next_epoch), (9, 9, 9));
    }

    #[test]
    fn the_first_image_reported_for_an_attempt_stands() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        let images = |node: &str, at, runs: &[(u64, u32, &str)]| Changes {
            images: runs
                .iter()
                .map(|&(job, attempt, id)| ImageRecord {
                    job,
                    attempt,
                    node: node.to_owned(),
                    image_id: id.to_owned(),
                    image_digest: None,
                    at,
                })
                .collect(),
            ..Changes::default()
        };
        let runs = [(1, 1, "sha256:aa"), (2, 1, "sha256:bb")];
        store.write(&images("n1", 5, &runs)).unwrap();
        // Every heartbeat repeats it; a later attempt (after a preemption) may differ.
        store.write(&images("n1", 6, &runs)).unwrap();
        store
            .write(&images(
                "n2",
                7,
                &[(1, 1, "sha256:zz"), (1, 2, "sha256:cc")],
            ))
            .unwrap();
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(
            store.image_ids(&[1, 2, 3]).unwrap(),
            BTreeMap::from([(1, "sha256:cc".to_owned()), (2, "sha256:bb".to_owned())])
        );
        let first: (String, String) = store
            .conn
            .query_row(
                "SELECT image_id, node FROM job_images WHERE job = 1 AND attempt = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(first, ("sha256:aa".to_owned(), "n1".to_owned()));
        // A registry digest, when reported, is what the job's image is known by: any host
        // can pull it.
        let mut store = store;
        let mut pinned = images("n1", 8, &[(3, 1, "sha256:dd")]);
        pinned.images[0].image_digest = Some("reg:5000/t@sha256:ee".into());
        store.write(&pinned).unwrap();
        assert_eq!(
            store.image_ids(&[3]).unwrap(),
            BTreeMap::from([(3, "reg:5000/t@sha256:ee".to_owned())])
        );
    }

    #[test]
    fn a_newer_schema_is_refused_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        drop(Store::open(dir.path()).unwrap());
        let conn = Connection::open(dir.path().join("nightshift.db")).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
        drop(conn);
        let err = Store::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("nightshift.db has schema version 99"), "{err}");
    }

    #[test]
    fn one_lock_holder_per_data_directory_until_it_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path()).unwrap();
        let err = DataDirLock::acquire(dir.path()).err().unwrap().to_string();
        let pid = format!("pid {}", std::process::id());
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(
            err.contains(&format!("another coordinator ({pid})")),
            "{err}"
        );
        drop(first);
        let again = DataDirLock::acquire(dir.path()).unwrap();
        let recorded = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(recorded, pid);
        drop(again);
    }

    #[test]
    fn an_empty_database_file_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("nightshift.db");
        std::fs::write(&db, b"").unwrap();
        let err = Store::open(dir.path()).err().unwrap().to_string();
        assert!(
            err.starts_with(&format!("database {} is empty (0 bytes)", db.display())),
            "{err}"
        );
        assert!(err.contains("restore it from a backup"), "{err}");
        assert_eq!(std::fs::metadata(&db).unwrap().len(), 0);
    }
}
