//! The PostgreSQL backend (`[store] url = "postgres://..."`), on tokio-postgres, with TLS to
//! the database through rustls on ring.
//!
//! The store's interface is blocking, like SQLite's, because the cluster writes under its
//! locks (`Cluster::commit`). The connection is driven by a runtime of the store's own (one
//! thread), and a caller waits for its statements' answers on its own thread with a tiny
//! executor ([`block_on`]); so the store works from any thread, inside a tokio runtime or not,
//! and never blocks another runtime's tasks but the caller's.
//!
//! A commit is one transaction for a batch of calls' changes, as on SQLite. Within a batch
//! only the last version of a row matters (the first, for image records, whose first report
//! stands), so each table gets one multi-row statement (`unnest` of arrays) with rows deduped
//! first: a commit costs a handful of round trips however many changes it carries.
//!
//! A lost connection (the server restarted, the network broke) fails the call that found
//! it; the next call connects again.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use nightshift_common::{JobView, UnixMillis};
use nightshift_core::{CoreSnapshot, Usage};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::{Client, Statement};

use super::{
    COUNTERS, Changes, MIGRATIONS, StoreError, StoredNode, StoredProfile, known_version, node_from,
    node_record, parse_record, profile_from, profile_record, to_record,
};
use crate::pipelines::PipelineSnapshot;

/// Serialises migrations of coordinators opening the same database at once (an advisory
/// lock's key: "nightshft" in ASCII).
const MIGRATION_LOCK: i64 = 0x6e69_6768_7473_6674;

/// Leadership of the coordinators sharing the database (crate::leader): the term of the
/// current leader, which rises with each new one, and the URL it serves at. Every write of a
/// leader checks its term in its transaction ([`PgStore::fence`]). PostgreSQL's alone
/// (SQLite is single-node), so not one of the shared [`MIGRATIONS`]: made when missing,
/// before them (a later migration adds the lease's columns).
const LEADER_TABLE: &str = "
    CREATE TABLE IF NOT EXISTS nightshift_leader (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        term BIGINT NOT NULL,
        url TEXT NOT NULL,
        since BIGINT NOT NULL);
    INSERT INTO nightshift_leader (id, term, url, since) VALUES (1, 0, '', 0)
        ON CONFLICT (id) DO NOTHING;
";

/// How long connecting may take when the URL does not say (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a fenced store's transaction may sit idle before the server ends its session.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// TLS through rustls on ring: the server's certificate must chain to `ca_file` (`[store]
/// ca_file`), or to the system's roots when none is set.
fn tls(ca_file: Option<&Path>) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    let roots = match ca_file {
        Some(path) => {
            nightshift_common::tls::load_roots("store.ca_file", path).map_err(|e| e.to_string())?
        }
        None => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            Arc::new(roots)
        }
    };
    let config = rustls::ClientConfig::builder_with_provider(nightshift_common::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// A session of its own on the database at `url`, driven by a task of the current tokio
/// runtime, with the server settings `options` (`-c name=value ...`): the leadership's lock
/// session (crate::leader). Connecting takes at most `timeout`.
pub async fn session(
    url: &str,
    ca_file: Option<&Path>,
    options: &str,
    timeout: Duration,
) -> Result<Client, StoreError> {
    let location = redact(url);
    let connect_error = |reason: String| StoreError::Connect {
        db: location.clone(),
        reason,
    };
    let mut config = parse(url).map_err(|reason| StoreError::Url {
        url: location.clone(),
        reason,
    })?;
    config.connect_timeout(timeout);
    config.application_name("nightshift-coordinator leadership");
    config.keepalives(true);
    config.keepalives_idle(Duration::from_secs(2));
    config.options(options);
    let tls = match config.get_ssl_mode() {
        SslMode::Disable => None,
        _ => Some(tls(ca_file).map_err(&connect_error)?),
    };
    let connected = tokio::time::timeout(timeout, async {
        match tls {
            None => {
                let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                tokio::spawn(connection);
                Ok(client)
            }
            Some(tls) => {
                let (client, connection) = config.connect(tls).await?;
                tokio::spawn(connection);
                Ok::<_, tokio_postgres::Error>(client)
            }
        }
    })
    .await;
    match connected {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(connect_error(format!("cannot connect: {}", describe(&e)))),
        Err(_) => Err(connect_error("connecting timed out".to_owned())),
    }
}

/// Parses a PostgreSQL URL, or says why it cannot be used.
pub(super) fn parse(url: &str) -> Result<tokio_postgres::Config, String> {
    let config: tokio_postgres::Config = url.parse().map_err(|e| format!("{e}"))?;
    if config.get_hosts().is_empty() {
        return Err("names no host".to_owned());
    }
    Ok(config)
}

/// The database `url` names, without its password: `postgres://user@host:port/name`.
pub fn redact(url: &str) -> String {
    let Ok(config) = url.parse::<tokio_postgres::Config>() else {
        // Unparseable: keep the scheme only, never the rest (it may hold a password).
        let scheme = url.split("://").next().unwrap_or("");
        return format!("{scheme}://...");
    };
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let host = match h {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            };
            match config.get_ports().get(i).or(config.get_ports().first()) {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
        .collect();
    let user = config
        .get_user()
        .map(|u| format!("{u}@"))
        .unwrap_or_default();
    let db = config.get_dbname().unwrap_or("");
    format!("postgres://{user}{}/{db}", hosts.join(","))
}

/// What a failed statement says, with the server's own message when it sent one
/// (tokio-postgres' `Display` alone says only "db error").
pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => nightshift_common::logging::error_message(e),
    }
}

/// Runs `fut` to completion on this thread, parking it while the future waits. The futures
/// of a tokio-postgres `Client` only exchange messages with its connection task (which runs
/// on the store's runtime), so any thread may wait for them.
fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// The write statements, prepared once per connection.
struct Statements {
    jobs: Statement,
    nodes: Statement,
    profiles: Statement,
    usage: Statement,
    runs: Statement,
    inputs: Statement,
    pipeline_jobs: Statement,
    images: Statement,
    meta: Statement,
}

const WRITES: [&str; 9] = [
    "INSERT INTO jobs (id, state, record)
     SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[])
     ON CONFLICT (id) DO UPDATE SET state = excluded.state, record = excluded.record",
    "INSERT INTO nodes (name, record) SELECT * FROM unnest($1::text[], $2::text[])
     ON CONFLICT (name) DO UPDATE SET record = excluded.record",
    "INSERT INTO profiles (service, record) SELECT * FROM unnest($1::text[], $2::text[])
     ON CONFLICT (service) DO UPDATE SET record = excluded.record",
    "INSERT INTO usage
     (lease_id, job_id, team, node, gpus, started_at, ended_at, preempted, lost_gpu_ms)
     SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::bigint[],
                          $6::bigint[], $7::bigint[], $8::boolean[], $9::bigint[])
     ON CONFLICT (lease_id) DO UPDATE SET job_id = excluded.job_id, team = excluded.team,
       node = excluded.node, gpus = excluded.gpus, started_at = excluded.started_at,
       ended_at = excluded.ended_at, preempted = excluded.preempted,
       lost_gpu_ms = excluded.lost_gpu_ms",
    "INSERT INTO pipeline_runs (id, record) SELECT * FROM unnest($1::bigint[], $2::text[])
     ON CONFLICT (id) DO UPDATE SET record = excluded.record",
    "INSERT INTO pipeline_inputs (run, seq, record)
     SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[])",
    "INSERT INTO pipeline_jobs (run, node, retry, job)
     SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::bigint[])",
    "INSERT INTO job_images (job, attempt, node, image_id, recorded_at, image_digest)
     SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::bigint[],
                          $6::text[])
     ON CONFLICT DO NOTHING",
    "INSERT INTO meta (key, value) SELECT * FROM unnest($1::text[], $2::bigint[])
     ON CONFLICT (key) DO UPDATE SET value = GREATEST(meta.value, excluded.value)",
];

struct Connection {
    client: Client,
    /// Prepared at the first write (after the migrations made the tables).
    statements: Option<Statements>,
}

impl Statements {
    async fn prepare(client: &Client) -> Result<Self, tokio_postgres::Error> {
        let prepared =
            futures_util::future::try_join_all(WRITES.iter().map(|sql| client.prepare(sql)))
                .await?;
        let [
            jobs,
            nodes,
            profiles,
            usage,
            runs,
            inputs,
            pipeline_jobs,
            images,
            meta,
        ] = <[Statement; 9]>::try_from(prepared).expect("one statement per write");
        Ok(Self {
            jobs,
            nodes,
            profiles,
            usage,
            runs,
            inputs,
            pipeline_jobs,
            images,
            meta,
        })
    }
}

pub struct PgStore {
    config: tokio_postgres::Config,
    ca_file: Option<PathBuf>,
    location: String,
    /// Drives the connections (one worker thread); shut down in the background on drop, so
    /// that a store may be dropped inside another runtime.
    runtime: Option<tokio::runtime::Runtime>,
    /// The live connection; none after it was lost, until the next call connects again.
    conn: Mutex<Option<Connection>>,
    /// The leadership term every write is fenced with ([`PgStore::fence`]); none unfenced.
    term: Option<u64>,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // The client first, which ends its connection task.
        self.conn.get_mut().map(Option::take).ok();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// An image record's row: node, image ID, when, registry digest.
type ImageRow = (String, String, i64, Option<String>);

/// The rows of a group commit, deduplicated, as the arrays the write statements take.
#[derive(Default)]
struct Rows {
    jobs: BTreeMap<i64, (String, String)>,
    nodes: BTreeMap<String, String>,
    profiles: BTreeMap<String, String>,
    usage_rows: BTreeMap<i64, Usage>,
    runs: BTreeMap<i64, String>,
    inputs: Vec<(i64, i64, String)>,
    pipeline_jobs: Vec<(i64, i64, i64, i64)>,
    /// By (job, attempt): the first report stands.
    images: BTreeMap<(i64, i64), ImageRow>,
    counters: Option<[u64; 3]>,
}

impl Rows {
    fn of(batches: &[Changes]) -> Self {
        let mut rows = Self::default();
        for changes in batches {
            for job in &changes.jobs {
                let record = to_record(job);
                rows.jobs
                    .insert(job.id as i64, (job.state.as_str().to_owned(), record));
            }
            for n in &changes.nodes {
                rows.nodes.insert(n.name.clone(), node_record(n));
            }
            for (service, p) in &changes.profiles {
                rows.profiles.insert(service.clone(), profile_record(p));
            }
            for u in &changes.usage {
                rows.usage_rows.insert(u.lease_id as i64, u.clone());
            }
            let p = &changes.pipelines;
            for run in &p.runs {
                let record = to_record(run);
                rows.runs.insert(run.id as i64, record);
            }
            for (run, seq, input) in &p.inputs {
                let record = to_record(input);
                rows.inputs.push((*run as i64, *seq as i64, record));
            }
            for (run, node, retry, job) in &p.jobs {
                rows.pipeline_jobs.push((
                    *run as i64,
                    *node as i64,
                    i64::from(*retry),
                    *job as i64,
                ));
            }
            for im in &changes.images {
                rows.images
                    .entry((im.job as i64, i64::from(im.attempt)))
                    .or_insert_with(|| {
                        (
                            im.node.clone(),
                            im.image_id.clone(),
                            im.at as i64,
                            im.image_digest.clone(),
                        )
                    });
            }
            if let Some((job, lease, epoch)) = changes.counters {
                let new = [job, lease, epoch];
                let old = rows.counters.unwrap_or(new);
                rows.counters = Some(std::array::from_fn(|i| old[i].max(new[i])));
            }
        }
        rows
    }
}

impl PgStore {
    /// Connects to the database at `url` and brings its schema up to date.
    pub fn open(url: &str, ca_file: Option<&Path>) -> Result<Self, StoreError> {
        let store = Self::connect_to(url, ca_file)?;
        store.migrate()?;
        Ok(store)
    }

    /// Connects to the database at `url` and reads its schema version, changing nothing:
    /// what `nightshift-coordinator validate` checks.
    pub fn check(url: &str, ca_file: Option<&Path>) -> Result<usize, StoreError> {
        let store = Self::connect_to(url, ca_file)?;
        known_version(&store.location, store.schema_version()?)
    }

    fn connect_to(url: &str, ca_file: Option<&Path>) -> Result<Self, StoreError> {
        let location = redact(url);
        let mut config = parse(url).map_err(|reason| StoreError::Url {
            url: location.clone(),
            reason,
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("nightshift-coordinator");
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("nightshift-store")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Connect {
                db: location.clone(),
                reason: format!("cannot start the store's runtime: {e}"),
            })?;
        let store = Self {
            config,
            ca_file: ca_file.map(Path::to_owned),
            location,
            runtime: Some(runtime),
            conn: Mutex::new(None),
            term: None,
        };
        Ok(store)
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    fn pg(&self, source: tokio_postgres::Error) -> StoreError {
        StoreError::Postgres {
            db: self.location.clone(),
            source,
        }
    }

    fn connect_error(&self, reason: String) -> StoreError {
        StoreError::Connect {
            db: self.location.clone(),
            reason,
        }
    }

    /// A new connection, its driver spawned on the store's runtime.
    fn connect(&self) -> Result<Client, StoreError> {
        let runtime = self
            .runtime
            .as_ref()
            .expect("the runtime lives as long as the store");
        let config = self.config.clone();
        let connected = if config.get_ssl_mode() == SslMode::Disable {
            runtime.spawn(async move {
                let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                tokio::spawn(connection);
                Ok::<_, tokio_postgres::Error>(client)
            })
        } else {
            let tls = self.tls()?;
            runtime.spawn(async move {
                let (client, connection) = config.connect(tls).await?;
                tokio::spawn(connection);
                Ok(client)
            })
        };
        match block_on(connected) {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) => Err(self.connect_error(format!("cannot connect: {}", describe(&e)))),
            Err(e) => Err(self.connect_error(format!("connecting failed: {e}"))),
        }
    }

    fn tls(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect, StoreError> {
        tls(self.ca_file.as_deref()).map_err(|reason| self.connect_error(reason))
    }

    /// Fences every later write with leadership term `term`: each write transaction first
    /// reads `nightshift_leader`'s term (`FOR SHARE`, so a new leader's bump waits for it
    /// or it sees the bump) and writes nothing unless it is still `term`. A transaction left
    /// idle by a frozen process is ended by the server after [`IDLE_IN_TRANSACTION`], so it
    /// cannot hold a new leader's bump up.
    pub fn fence(&mut self, term: u64) {
        self.term = Some(term);
        let options = self.config.get_options().unwrap_or("").to_owned();
        self.config.options(format!(
            "{options} -c idle_in_transaction_session_timeout={}",
            IDLE_IN_TRANSACTION.as_millis()
        ));
        // The options apply to the next connection.
        *self.conn.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Runs `f` with the live connection, connecting first when there is none. A connection
    /// found closed afterwards, or one that failed with anything but a statement's own error,
    /// is dropped, so that the next call connects again: a server ending the session sends
    /// its FATAL before the client notices the socket close, and a call that saw only the
    /// FATAL must not leave the next one a connection about to be found closed.
    fn with_conn<T>(
        &self,
        f: impl AsyncFnOnce(&mut Connection) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, StoreError> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_some_and(|c| c.client.is_closed()) {
            *slot = None;
        }
        if slot.is_none() {
            let client = self.connect()?;
            *slot = Some(Connection {
                client,
                statements: None,
            });
        }
        let conn = slot.as_mut().expect("connected above");
        let result = block_on(f(conn));
        if conn.client.is_closed() || result.as_ref().is_err_and(|e| !statement_error(e)) {
            *slot = None;
        }
        result.map_err(|e| self.pg(e))
    }

    /// The schema version recorded in the database; 0 for an empty database.
    pub fn schema_version(&self) -> Result<usize, StoreError> {
        self.with_conn(async |c| {
            let exists: Option<String> = c
                .client
                .query_one("SELECT to_regclass('nightshift_schema')::text", &[])
                .await?
                .get(0);
            if exists.is_none() {
                return Ok(0);
            }
            let row = c
                .client
                .query_opt("SELECT version FROM nightshift_schema", &[])
                .await?;
            Ok(row.map_or(0, |r| r.get::<_, i64>(0)))
        })
        .map(|v| usize::try_from(v).unwrap_or(usize::MAX))
    }

    /// Applies the migrations the database lacks, all in one transaction, under an advisory
    /// lock so that two coordinators starting at once do not both apply them.
    fn migrate(&self) -> Result<(), StoreError> {
        let known = MIGRATIONS.len();
        let found = self.with_conn(async |c| {
            let tx = c.client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await?;
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS nightshift_schema (version BIGINT NOT NULL)",
            )
            .await?;
            let found = match tx
                .query_opt("SELECT version FROM nightshift_schema", &[])
                .await?
            {
                Some(row) => row.get::<_, i64>(0),
                None => {
                    tx.execute("INSERT INTO nightshift_schema (version) VALUES (0)", &[])
                        .await?;
                    0
                }
            };
            let found = usize::try_from(found).unwrap_or(usize::MAX);
            if found > known {
                return Ok(found);
            }
            tx.batch_execute(LEADER_TABLE).await?;
            for migration in &MIGRATIONS[found..] {
                tx.batch_execute(migration.postgres).await?;
            }
            tx.execute(
                "UPDATE nightshift_schema SET version = $1",
                &[&(known as i64)],
            )
            .await?;
            tx.commit().await?;
            Ok(found)
        })?;
        known_version(&self.location, found)?;
        Ok(())
    }

    /// Every `(key, record)` row that `sql` selects (the key as text), each record parsed.
    fn records<T: serde::de::DeserializeOwned>(
        &self,
        sql: &str,
        what: &str,
    ) -> Result<Vec<(String, T)>, StoreError> {
        let rows = self.with_conn(async |c| c.client.query(sql, &[]).await)?;
        rows.iter()
            .map(|r| {
                let key: String = r.get(0);
                let record: &str = r.get(1);
                let value = parse_record(&self.location, || format!("{what} {key}"), record)?;
                Ok((key, value))
            })
            .collect()
    }

    pub fn load(&self) -> Result<CoreSnapshot, StoreError> {
        let jobs = self
            .records::<JobView>("SELECT id::text, record FROM jobs ORDER BY id", "job")?
            .into_iter()
            .map(|(_, job)| job)
            .collect();
        let mut snapshot = CoreSnapshot {
            jobs,
            ..CoreSnapshot::default()
        };
        // Byte order, as SQLite sorts, whatever the database's collation.
        for (_, n) in self.records::<StoredNode>(
            "SELECT name, record FROM nodes ORDER BY name COLLATE \"C\"",
            "node",
        )? {
            snapshot.nodes.push(node_from(n));
        }
        for (service, p) in self.records::<StoredProfile>(
            "SELECT service, record FROM profiles ORDER BY service COLLATE \"C\"",
            "profile of",
        )? {
            snapshot.profiles.push((service, profile_from(p)));
        }
        let counters = self.with_conn(async |c| {
            c.client
                .query("SELECT key, value FROM meta", &[])
                .await
                .map(|rows| {
                    rows.iter()
                        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
                        .collect::<BTreeMap<_, _>>()
                })
        })?;
        let counter = |key: &str| counters.get(key).map_or(0, |v| *v as u64);
        snapshot.next_job_id = counter(COUNTERS[0]);
        snapshot.next_lease_id = counter(COUNTERS[1]);
        snapshot.next_epoch = counter(COUNTERS[2]);
        Ok(snapshot)
    }

    pub fn last_node_of(&self, job_id: u64) -> Result<Option<String>, StoreError> {
        self.with_conn(async |c| {
            let row = c
                .client
                .query_opt(
                    "SELECT node FROM usage WHERE job_id = $1 ORDER BY lease_id DESC LIMIT 1",
                    &[&(job_id as i64)],
                )
                .await?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    pub fn usage(&self, since: UnixMillis, until: UnixMillis) -> Result<Vec<Usage>, StoreError> {
        let rows = self.with_conn(async |c| {
            c.client
                .query(
                    "SELECT lease_id, job_id, team, node, gpus, started_at, ended_at, preempted,
                            lost_gpu_ms
                     FROM usage WHERE ended_at >= $1 AND started_at < $2 ORDER BY lease_id",
                    &[&(since as i64), &(until as i64)],
                )
                .await
        })?;
        Ok(rows
            .iter()
            .map(|r| Usage {
                lease_id: r.get::<_, i64>(0) as u64,
                job_id: r.get::<_, i64>(1) as u64,
                team: r.get(2),
                node: r.get(3),
                gpus: r.get::<_, i64>(4) as u32,
                started_at: r.get::<_, i64>(5) as u64,
                ended_at: r.get::<_, i64>(6) as u64,
                preempted: r.get(7),
                lost_gpu_ms: r.get::<_, i64>(8) as u64,
            })
            .collect())
    }

    pub fn harvested_gpu_ms(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows = self.with_conn(async |c| {
            c.client
                .query(
                    "SELECT node, SUM(gpus * (ended_at - started_at))::bigint FROM usage
                     GROUP BY node ORDER BY node COLLATE \"C\"",
                    &[],
                )
                .await
        })?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1).max(0) as u64))
            .collect())
    }

    pub fn load_pipelines(&self) -> Result<PipelineSnapshot, StoreError> {
        let mut snapshot = PipelineSnapshot::default();
        let (runs, inputs, jobs) = self.with_conn(async |c| {
            let runs = c
                .client
                .query("SELECT id, record FROM pipeline_runs ORDER BY id", &[])
                .await?;
            let inputs = c
                .client
                .query(
                    "SELECT run, seq, record FROM pipeline_inputs ORDER BY run, seq",
                    &[],
                )
                .await?;
            let jobs = c
                .client
                .query("SELECT run, node, retry, job FROM pipeline_jobs", &[])
                .await?;
            Ok((runs, inputs, jobs))
        })?;
        for row in &runs {
            let id: i64 = row.get(0);
            let run = parse_record(&self.location, || format!("pipeline run {id}"), row.get(1))?;
            snapshot.runs.push(run);
        }
        for row in &inputs {
            let (run, seq): (i64, i64) = (row.get(0), row.get(1));
            let input = parse_record(
                &self.location,
                || format!("input {seq} of pipeline run {run}"),
                row.get(2),
            )?;
            snapshot.inputs.entry(run as u64).or_default().push(input);
        }
        for row in &jobs {
            snapshot.jobs.push((
                row.get::<_, i64>(0) as u64,
                row.get::<_, i64>(1) as usize,
                row.get::<_, i64>(2) as u32,
                row.get::<_, i64>(3) as u64,
            ));
        }
        Ok(snapshot)
    }

    pub fn image_ids(&self, jobs: &[u64]) -> Result<BTreeMap<u64, String>, StoreError> {
        let ids: Vec<i64> = jobs.iter().map(|j| *j as i64).collect();
        let rows = self.with_conn(async |c| {
            c.client
                .query(
                    "SELECT DISTINCT ON (job) job, COALESCE(image_digest, image_id)
                     FROM job_images WHERE job = ANY($1) ORDER BY job, attempt DESC",
                    &[&ids],
                )
                .await
        })?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
            .collect())
    }

    /// Writes several batches in a single transaction: one commit for the changes of many
    /// calls (group commit), each table's rows in one statement.
    pub fn write_all(&mut self, batches: &[Changes]) -> Result<(), StoreError> {
        let rows = Rows::of(batches);
        let term = self.term;
        let written = self.with_conn(async |c| {
            if c.statements.is_none() {
                c.statements = Some(Statements::prepare(&c.client).await?);
            }
            let st = c.statements.as_ref().expect("prepared above");
            let tx = c.client.transaction().await?;
            if let Some(ours) = term {
                let row = tx
                    .query_one(
                        "SELECT term FROM nightshift_leader WHERE id = 1 FOR SHARE",
                        &[],
                    )
                    .await?;
                let current = row.get::<_, i64>(0) as u64;
                if current != ours {
                    // Dropped uncommitted: rolled back.
                    return Ok(Err(current));
                }
            }
            if !rows.jobs.is_empty() {
                let ids: Vec<i64> = rows.jobs.keys().copied().collect();
                let (states, records): (Vec<&str>, Vec<&str>) = rows
                    .jobs
                    .values()
                    .map(|(s, r)| (s.as_str(), r.as_str()))
                    .unzip();
                tx.execute(&st.jobs, &[&ids, &states, &records]).await?;
            }
            for (statement, table) in [(&st.nodes, &rows.nodes), (&st.profiles, &rows.profiles)] {
                if !table.is_empty() {
                    let keys: Vec<&str> = table.keys().map(String::as_str).collect();
                    let records: Vec<&str> = table.values().map(String::as_str).collect();
                    tx.execute(statement, &[&keys, &records]).await?;
                }
            }
            if !rows.usage_rows.is_empty() {
                let u: Vec<&Usage> = rows.usage_rows.values().collect();
                let col = |f: fn(&Usage) -> i64| u.iter().map(|u| f(u)).collect::<Vec<i64>>();
                let teams: Vec<&str> = u.iter().map(|u| u.team.as_str()).collect();
                let nodes: Vec<&str> = u.iter().map(|u| u.node.as_str()).collect();
                let preempted: Vec<bool> = u.iter().map(|u| u.preempted).collect();
                tx.execute(
                    &st.usage,
                    &[
                        &col(|u| u.lease_id as i64),
                        &col(|u| u.job_id as i64),
                        &teams,
                        &nodes,
                        &col(|u| i64::from(u.gpus)),
                        &col(|u| u.started_at as i64),
                        &col(|u| u.ended_at as i64),
                        &preempted,
                        &col(|u| u.lost_gpu_ms as i64),
                    ],
                )
                .await?;
            }
            if !rows.runs.is_empty() {
                let ids: Vec<i64> = rows.runs.keys().copied().collect();
                let records: Vec<&str> = rows.runs.values().map(String::as_str).collect();
                tx.execute(&st.runs, &[&ids, &records]).await?;
            }
            if !rows.inputs.is_empty() {
                let runs: Vec<i64> = rows.inputs.iter().map(|i| i.0).collect();
                let seqs: Vec<i64> = rows.inputs.iter().map(|i| i.1).collect();
                let records: Vec<&str> = rows.inputs.iter().map(|i| i.2.as_str()).collect();
                tx.execute(&st.inputs, &[&runs, &seqs, &records]).await?;
            }
            if !rows.pipeline_jobs.is_empty() {
                let pj = &rows.pipeline_jobs;
                let runs: Vec<i64> = pj.iter().map(|j| j.0).collect();
                let nodes: Vec<i64> = pj.iter().map(|j| j.1).collect();
                let retries: Vec<i64> = pj.iter().map(|j| j.2).collect();
                let jobs: Vec<i64> = pj.iter().map(|j| j.3).collect();
                tx.execute(&st.pipeline_jobs, &[&runs, &nodes, &retries, &jobs])
                    .await?;
            }
            if !rows.images.is_empty() {
                let im = &rows.images;
                let jobs: Vec<i64> = im.keys().map(|k| k.0).collect();
                let attempts: Vec<i64> = im.keys().map(|k| k.1).collect();
                let nodes: Vec<&str> = im.values().map(|v| v.0.as_str()).collect();
                let ids: Vec<&str> = im.values().map(|v| v.1.as_str()).collect();
                let at: Vec<i64> = im.values().map(|v| v.2).collect();
                let digests: Vec<Option<&str>> = im.values().map(|v| v.3.as_deref()).collect();
                tx.execute(&st.images, &[&jobs, &attempts, &nodes, &ids, &at, &digests])
                    .await?;
            }
            if let Some(values) = rows.counters {
                let values: Vec<i64> = values.iter().map(|v| *v as i64).collect();
                tx.execute(&st.meta, &[&COUNTERS.to_vec(), &values]).await?;
            }
            tx.commit().await.map(Ok)
        })?;
        written.map_err(|current| StoreError::Deposed {
            db: self.location.clone(),
            ours: term.unwrap_or_default(),
            current,
        })
    }
}

/// Whether `e` is an error of one statement (severity ERROR: a constraint, a serialization
/// failure, a fenced write), after which the session is still good. Anything else (a FATAL
/// or PANIC from the server, an I/O error, a closed connection, a timeout) leaves it in doubt.
fn statement_error(e: &tokio_postgres::Error) -> bool {
    e.as_db_error()
        .is_some_and(|db| db.parsed_severity() == Some(tokio_postgres::error::Severity::Error))
}
