//! The SQLite backend: one database file in WAL mode, the embedded default.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nightshift_common::{JobView, UnixMillis};
use nightshift_core::{CoreSnapshot, Usage};
use rusqlite::{Connection, OptionalExtension, params};

use super::{
    COUNTERS, Changes, MIGRATIONS, StoreError, StoredNode, StoredProfile, known_version, node_from,
    node_record, parse_record, profile_from, profile_record, to_record,
};
use crate::pipelines::{PipelineChanges, PipelineSnapshot};

pub struct SqliteStore {
    conn: Connection,
    path: PathBuf,
    /// `path`, displayed once.
    location: String,
}

impl SqliteStore {
    /// Opens (creating when needed, with its directory) the database file `path` and brings
    /// its schema up to date. An empty file is refused: it may be a lost database.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::DataDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        let path = path.to_owned();
        // SQLite takes an empty file for a new database; here it is more likely one that was
        // lost (truncated, a failed copy), and starting empty would hide that.
        if std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == 0) {
            return Err(StoreError::Empty { path });
        }
        let conn = Connection::open(&path).map_err(|source| StoreError::Sqlite {
            path: path.clone(),
            source,
        })?;
        let location = path.display().to_string();
        let mut store = Self {
            conn,
            path,
            location,
        };
        store.setup()?;
        Ok(store)
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    fn sql(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    pub fn schema_version(&self) -> Result<usize, StoreError> {
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.sql(e))?;
        Ok(usize::try_from(version).unwrap_or(usize::MAX))
    }

    fn setup(&mut self) -> Result<(), StoreError> {
        self.conn
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000;",
            )
            .map_err(|e| self.sql(e))?;
        let version = known_version(&self.location, self.schema_version()?)?;
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version) {
            let tx = self.conn.transaction().map_err(|e| StoreError::Sqlite {
                path: self.path.clone(),
                source: e,
            })?;
            tx.execute_batch(migration.sqlite)
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
            let value = parse_record(&self.location, || format!("{what} {key}"), &record)?;
            out.push((key, value));
        }
        Ok(out)
    }

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
            snapshot.nodes.push(node_from(n));
        }
        for (service, p) in self.records::<StoredProfile>(
            "SELECT service, record FROM profiles ORDER BY service",
            "profile of",
        )? {
            snapshot.profiles.push((service, profile_from(p)));
        }
        let counter = |key: &str| -> Result<u64, StoreError> {
            let v: Option<i64> = self
                .conn
                .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
                .optional()
                .map_err(|e| self.sql(e))?;
            Ok(v.unwrap_or(0) as u64)
        };
        snapshot.next_job_id = counter(COUNTERS[0])?;
        snapshot.next_lease_id = counter(COUNTERS[1])?;
        snapshot.next_epoch = counter(COUNTERS[2])?;
        Ok(snapshot)
    }

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

    pub fn load_pipelines(&self) -> Result<PipelineSnapshot, StoreError> {
        let rows = self.pipeline_rows()?;
        let mut inputs = BTreeMap::<u64, Vec<_>>::new();
        for (run, _, input) in rows.inputs {
            inputs.entry(run).or_default().push(input);
        }
        Ok(PipelineSnapshot {
            runs: rows.runs,
            inputs,
            jobs: rows.jobs,
        })
    }

    /// Every row of the pipeline tables: runs by id, inputs by run and sequence number (kept,
    /// gaps and all), jobs.
    fn pipeline_rows(&self) -> Result<PipelineChanges, StoreError> {
        let mut rows = PipelineChanges::default();
        let mut stmt = self
            .conn
            .prepare("SELECT id, record FROM pipeline_runs ORDER BY id")
            .map_err(|e| self.sql(e))?;
        let runs = stmt
            .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
            .map_err(|e| self.sql(e))?;
        for row in runs {
            let (id, record) = row.map_err(|e| self.sql(e))?;
            let run = parse_record(&self.location, || format!("pipeline run {id}"), &record)?;
            rows.runs.push(run);
        }
        let mut stmt = self
            .conn
            .prepare("SELECT run, seq, record FROM pipeline_inputs ORDER BY run, seq")
            .map_err(|e| self.sql(e))?;
        let inputs = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)? as u64,
                    r.get::<_, i64>(1)? as u64,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(|e| self.sql(e))?;
        for row in inputs {
            let (run, seq, record) = row.map_err(|e| self.sql(e))?;
            let input = parse_record(
                &self.location,
                || format!("input {seq} of pipeline run {run}"),
                &record,
            )?;
            rows.inputs.push((run, seq, input));
        }
        let mut stmt = self
            .conn
            .prepare("SELECT run, node, retry, job FROM pipeline_jobs")
            .map_err(|e| self.sql(e))?;
        let jobs = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)? as u64,
                    r.get::<_, i64>(1)? as usize,
                    r.get::<_, i64>(2)? as u32,
                    r.get::<_, i64>(3)? as u64,
                ))
            })
            .map_err(|e| self.sql(e))?;
        rows.jobs = jobs.collect::<Result<_, _>>().map_err(|e| self.sql(e))?;
        Ok(rows)
    }

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

    /// Every row of the store as one batch of changes: what `migrate` copies to another
    /// store. Image records and pipeline inputs keep their keys exactly.
    pub fn export(&self) -> Result<Changes, StoreError> {
        let snapshot = self.load()?;
        let mut changes = Changes {
            jobs: snapshot.jobs,
            nodes: snapshot.nodes,
            profiles: snapshot.profiles,
            counters: Some((
                snapshot.next_job_id,
                snapshot.next_lease_id,
                snapshot.next_epoch,
            )),
            usage: self.usage(0, i64::MAX as u64)?,
            pipelines: self.pipeline_rows()?,
            ..Changes::default()
        };
        let mut stmt = self
            .conn
            .prepare(
                "SELECT job, attempt, node, image_id, recorded_at, image_digest FROM job_images
                 ORDER BY job, attempt",
            )
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(super::ImageRecord {
                    job: r.get::<_, i64>(0)? as u64,
                    attempt: r.get::<_, i64>(1)? as u32,
                    node: r.get(2)?,
                    image_id: r.get(3)?,
                    at: r.get::<_, i64>(4)? as u64,
                    image_digest: r.get(5)?,
                })
            })
            .map_err(|e| self.sql(e))?;
        changes.images = rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))?;
        Ok(changes)
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
            let record = to_record(job);
            tx.prepare_cached(
                "INSERT INTO jobs (id, state, record) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![job.id as i64, job.state.as_str(), record]))
            .map_err(sql)?;
        }
        for n in &changes.nodes {
            tx.prepare_cached(
                "INSERT INTO nodes (name, record) VALUES (?1, ?2)
                 ON CONFLICT(name) DO UPDATE SET record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![n.name, node_record(n)]))
            .map_err(sql)?;
        }
        for (service, p) in &changes.profiles {
            tx.prepare_cached(
                "INSERT INTO profiles (service, record) VALUES (?1, ?2)
                 ON CONFLICT(service) DO UPDATE SET record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![service, profile_record(p)]))
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
            let record = to_record(run);
            tx.prepare_cached(
                "INSERT INTO pipeline_runs (id, record) VALUES (?1, ?2)
                 ON CONFLICT(id) DO UPDATE SET record = excluded.record",
            )
            .and_then(|mut st| st.execute(params![run.id as i64, record]))
            .map_err(sql)?;
        }
        for (run, seq, input) in &p.inputs {
            let record = to_record(input);
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
            for (key, value) in COUNTERS.into_iter().zip([job, lease, epoch]) {
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

/// What only the SQLite file has (its lock, an empty file, its pragma); the cases both
/// backends share are tests/tests/store.rs'.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{DataDirLock, LOCK_FILE, Store};
    use nightshift_common::NodeMode;

    #[test]
    fn a_node_record_written_before_checkpoints_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let Store::Sqlite(sqlite) = &store else {
            unreachable!("a data directory holds a SQLite file")
        };
        sqlite
            .conn
            .execute(
                "INSERT INTO nodes (name, record) VALUES ('c', ?1)",
                [r#"{"name":"c","service":"llm","gpus":[],"mode":"serve","desired_version":1,"mode_since":0}"#],
            )
            .unwrap();
        drop(store);
        let nodes = Store::open(dir.path()).unwrap().load().unwrap().nodes;
        assert_eq!(
            (
                nodes[0].name.as_str(),
                nodes[0].checkpoints.len(),
                nodes[0].mode
            ),
            ("c", 0, NodeMode::Serve)
        );
        assert_eq!(
            nodes[0].address, "c",
            "the name stands for a missing address"
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

    #[test]
    fn a_sqlite_url_names_the_database_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sub/state.db");
        let url = crate::store::StoreUrl::parse(&format!("sqlite://{}", file.display())).unwrap();
        let store = Store::open_url(&url, None).unwrap();
        assert_eq!(store.location(), file.display().to_string());
        assert_eq!(
            store.schema_version().unwrap(),
            crate::store::SCHEMA_VERSION
        );
        assert!(file.is_file());
    }
}
