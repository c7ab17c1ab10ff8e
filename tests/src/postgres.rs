//! PostgreSQL for tests: a fresh database per test on the throwaway server of the run.
//!
//! tests/run.sh starts the server (tests/postgres.sh) and exports its URL as
//! `NIGHTSHIFT_TEST_POSTGRES`; a test that needs it gets its own database there, so tests run
//! in parallel. Run by hand (`cargo test` without run.sh, the variable unset), the first test
//! of the process starts a server of its own the same way, which a watchdog stops once the
//! test process has ended. Either way a test never passes without a database: a server that
//! cannot be reached or started fails it, with the reason.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The server: its URL without a database (`postgres://postgres@127.0.0.1:PORT`), and the CA
/// that signed its TLS certificate.
struct Server {
    base: String,
    ca: PathBuf,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        if let Ok(base) = std::env::var("NIGHTSHIFT_TEST_POSTGRES") {
            let ca = std::env::var("NIGHTSHIFT_TEST_POSTGRES_CA").expect(
                "NIGHTSHIFT_TEST_POSTGRES is set but NIGHTSHIFT_TEST_POSTGRES_CA is not: \
                 both come from tests/postgres.sh start",
            );
            return Server {
                base: base.trim_end_matches('/').to_owned(),
                ca: ca.into(),
            };
        }
        start_own()
    })
}

/// Starts a server for this test process (tests/postgres.sh), and a watchdog that stops it
/// and removes its directory once this process is gone.
fn start_own() -> Server {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/postgres.sh");
    let dir = std::env::temp_dir().join(format!("nightshift-pg-{}", std::process::id()));
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg("start")
        .arg(&dir)
        .output()
        .expect("run tests/postgres.sh");
    assert!(
        out.status.success(),
        "NIGHTSHIFT_TEST_POSTGRES is unset and tests/postgres.sh could not start PostgreSQL \
         (tests/run.sh installs Debian's postgresql): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("tests/postgres.sh printed no {name}: {text}"))
            .to_owned()
    };
    // Started in the background by a shell that exits at once (and is reaped here): the
    // watchdog outlives this process, which is its point.
    let watchdog = format!(
        "(while kill -0 {pid} 2>/dev/null; do sleep 1; done; bash {script} stop {dir}) &",
        pid = std::process::id(),
        dir = dir.display()
    );
    std::process::Command::new("sh")
        .args(["-c", &watchdog])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("start the PostgreSQL watchdog");
    Server {
        base: var("NIGHTSHIFT_TEST_POSTGRES"),
        ca: var("NIGHTSHIFT_TEST_POSTGRES_CA").into(),
    }
}

/// A database of its own on the test server.
pub struct TestDatabase {
    pub name: String,
    base: String,
}

impl TestDatabase {
    /// The database's URL, over plain TCP (`sslmode=disable`).
    pub fn url(&self) -> String {
        format!("{}/{}?sslmode=disable", self.base, self.name)
    }

    /// The database's URL over TLS (`sslmode=require`): the server's certificate must chain
    /// to [`TestDatabase::ca_file`].
    pub fn tls_url(&self) -> String {
        format!("{}/{}?sslmode=require", self.base, self.name)
    }

    /// The CA that signed the server's certificate.
    pub fn ca_file(&self) -> PathBuf {
        server().ca.clone()
    }

    /// Runs one SQL command in this database (with psql), panicking with its error.
    pub fn psql(&self, sql: &str) -> String {
        psql(&self.url(), sql)
    }
}

/// A new, empty database named after `prefix`, for one test.
pub fn database(prefix: &str) -> TestDatabase {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let server = server();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // A name SQL takes unquoted: letters, digits and `_`, in lower case.
    let name = crate::unique_node(&format!("{prefix}_{n}"))
        .replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        .to_lowercase();
    psql(
        &format!("{}/postgres?sslmode=disable", server.base),
        &format!("CREATE DATABASE {name}"),
    );
    TestDatabase {
        name,
        base: server.base.clone(),
    }
}

fn psql(url: &str, sql: &str) -> String {
    let psql = ["/usr/bin/psql"]
        .into_iter()
        .map(PathBuf::from)
        .chain(
            std::fs::read_dir("/usr/lib/postgresql")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().join("bin/psql")),
        )
        .find(|p| p.exists())
        .expect("psql (Debian's postgresql-client) is installed");
    let out = std::process::Command::new(psql)
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            url,
            "-c",
            sql,
        ])
        .output()
        .expect("run psql");
    assert!(
        out.status.success(),
        "psql {sql:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A PostgreSQL server of one test's own (tests/postgres.sh), which the test may stop and
/// start again (an outage of the database) without disturbing the other tests; stopped and
/// removed when dropped.
pub struct OwnServer {
    dir: PathBuf,
    /// `postgres://postgres@127.0.0.1:PORT`, no database.
    pub base: String,
}

/// Whether PostgreSQL can be had here: tests/postgres.sh finds its binaries.
pub fn installed() -> bool {
    std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.path().join("bin/pg_ctl").exists())
}

impl OwnServer {
    /// Starts a server on a free port, in a directory of its own.
    pub fn start(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "nightshift-pg-{}-{}",
            crate::unique_node(name),
            std::process::id()
        ));
        let text = postgres_sh("start", &dir);
        let base = text
            .lines()
            .find_map(|l| l.strip_prefix("NIGHTSHIFT_TEST_POSTGRES="))
            .unwrap_or_else(|| panic!("tests/postgres.sh printed no URL: {text}"))
            .to_owned();
        Self { dir, base }
    }

    /// A new database on this server; its URL (plain TCP).
    pub fn database(&self, name: &str) -> String {
        psql(
            &format!("{}/postgres?sslmode=disable", self.base),
            &format!("CREATE DATABASE {name}"),
        );
        format!("{}/{name}?sslmode=disable", self.base)
    }

    /// Runs one SQL command in database `db` of this server.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        psql(&format!("{}/{db}?sslmode=disable", self.base), sql)
    }

    /// Stops the server (fast shutdown: sessions end), keeping its data.
    pub fn halt(&self) {
        postgres_sh("halt", &self.dir);
    }

    /// Starts it again on the same port.
    pub fn resume(&self) {
        postgres_sh("resume", &self.dir);
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/postgres.sh");
        let _ = std::process::Command::new("bash")
            .arg(script)
            .arg("stop")
            .arg(&self.dir)
            .output();
    }
}

fn postgres_sh(command: &str, dir: &std::path::Path) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/postgres.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(command)
        .arg(dir)
        .output()
        .expect("run tests/postgres.sh");
    assert!(
        out.status.success(),
        "tests/postgres.sh {command} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
