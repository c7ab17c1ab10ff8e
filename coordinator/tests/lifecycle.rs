//! The coordinator as an operator runs it: the real `nightshift-coordinator` binary started,
//! signalled and started again on one data directory. One owner per data directory; a stop
//! that does not wait for agents' long-polls; a token created beside a running coordinator
//! closes its open API at once; a store that cannot be written is reported by `/healthz` and
//! logged without flooding the log, and does not stop a lent node's jobs; reads while writes
//! fail show only what is saved, and no id is given twice; an empty database file is refused;
//! API tokens without `[tls]` are refused unless the configuration accepts them; a step of the
//! wall clock, forward or back, moves no lease and keeps no dead node alive.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The binary under test: this build's, or `NIGHTSHIFT_COORDINATOR_BIN` (an installed one).
fn bin() -> String {
    std::env::var("NIGHTSHIFT_COORDINATOR_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_nightshift-coordinator").to_owned())
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running coordinator and every line it wrote to standard error.
struct Coordinator {
    child: Child,
    url: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Coordinator {
    /// Starts `nightshift-coordinator serve` on `data` through `sh -c 'PREFIX exec BIN ...'`
    /// (for a resource limit), and waits until it answers.
    async fn start_with(data: &Path, prefix: &str) -> Self {
        Self::start_configured(data, prefix, "[[services]]\nname = \"chat\"\n").await
    }

    /// [`Coordinator::start_with`] on the configuration `toml`.
    async fn start_configured(data: &Path, prefix: &str, toml: &str) -> Self {
        let port = free_port();
        let config = data.with_extension("toml");
        std::fs::write(&config, toml).unwrap();
        let script = format!(
            "{prefix} exec '{}' serve --listen 127.0.0.1:{port} --data-dir '{}' --config '{}'",
            bin(),
            data.display(),
            config.display()
        );
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .env("RUST_LOG", "info")
            .env_remove("JOURNAL_STREAM")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        let url = format!("http://127.0.0.1:{port}");
        let c = Self { child, url, log };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if client
                .get(format!("{}/healthz", c.url))
                .send()
                .await
                .is_ok()
            {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "coordinator did not answer: {:?}",
                c.lines()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn start(data: &Path) -> Self {
        Self::start_with(data, "").await
    }

    fn lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn pid(&self) -> i32 {
        self.child.id().unwrap() as i32
    }

    fn signal(&self, signal: &str) {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{signal} failed");
    }
}

/// A configuration that serves API tokens without `[tls]`, as these tests do.
const AGENTS_WITHOUT_TLS: &str =
    "[[services]]\nname = \"chat\"\n[access]\nagents_without_tls = true\n";

/// `nightshift-coordinator token create` on `data`: the token.
async fn create_token(data: &Path) -> String {
    let out = Command::new(bin())
        .args(["token", "create", "--role", "admin", "--name", "root"])
        .arg("--data-dir")
        .arg(data)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

fn job(name: &str) -> serde_json::Value {
    serde_json::json!({"name": name, "image": "trainer:1", "gpus": 1})
}

async fn submit(url: &str, name: &str, token: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new()
        .post(format!("{url}/v1/jobs"))
        .json(&job(name));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

#[tokio::test]
async fn a_second_coordinator_on_the_same_data_directory_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let first = Coordinator::start(&data).await;

    let port = free_port();
    let out = Command::new(bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(&data)
        .arg("--config")
        .arg(data.with_extension("toml"))
        .output();
    let out = tokio::time::timeout(Duration::from_secs(20), out)
        .await
        .expect("the second coordinator kept running")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second one started: {err}");
    assert!(err.contains(&data.display().to_string()), "{err}");
    assert!(err.contains(&format!("pid {}", first.pid())), "{err}");
    assert!(err.contains("another coordinator"), "{err}");

    // The first still serves, alone: its job ids are its own.
    let (status, body) = submit(&first.url, "one", None).await;
    assert_eq!(status, 201, "{body}");
}

/// A registered node's long-poll for a version that will not come, with the longest wait an
/// agent may ask for: SIGTERM ends it, and the process, within about a second.
#[tokio::test]
async fn sigterm_ends_open_long_polls_and_the_process_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Coordinator::start(&dir.path().join("data")).await;
    let client = reqwest::Client::new();
    let reg = client
        .post(format!("{}/v1/agents/register", c.url))
        .json(&serde_json::json!({
            "node": "n1", "service": "chat", "agent_version": "test",
            "gpus": [{"index": 0, "uuid": "GPU-0", "name": "fake", "memory_total_bytes": 80000000000u64}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(reg.status(), 200, "{}", reg.text().await.unwrap());
    // Without registration too: the unauthenticated curl.
    let polls: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{}/v1/agents/n1/desired?after=999999&wait_ms=60000", c.url);
            tokio::spawn(async move { reqwest::get(url).await.map(|r| r.status().as_u16()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let signalled = Instant::now();
    c.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), c.child.wait())
        .await
        .expect("still running 30 s after SIGTERM")
        .unwrap();
    let took = signalled.elapsed();
    eprintln!("stopped {took:?} after SIGTERM with 3 open long-polls (wait_ms=60000)");
    assert!(status.success(), "{status:?}: {:?}", c.lines());
    assert!(
        took < Duration::from_secs(2),
        "took {took:?} to stop: {:?}",
        c.lines()
    );
    for poll in polls {
        // Answered (503: this coordinator no longer decides) or cut; never held.
        let answer = tokio::time::timeout(Duration::from_secs(2), poll)
            .await
            .expect("a long-poll still open after the coordinator exited")
            .unwrap();
        if let Ok(status) = answer {
            assert_eq!(status, 503);
        }
    }
}

#[tokio::test]
async fn a_token_created_beside_a_running_coordinator_closes_the_api_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let c = Coordinator::start(&data).await;
    let (status, body) = submit(&c.url, "open", None).await;
    assert_eq!(status, 201, "open before any token: {body}");

    let out = Command::new(bin())
        .args(["token", "create", "--role", "researcher", "--team", "nlp"])
        .args(["--name", "alice", "--data-dir"])
        .arg(&data)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();

    let (status, body) = submit(&c.url, "closed", None).await;
    assert_eq!(
        status, 401,
        "a call without a token once one exists: {body}"
    );
    let list = reqwest::get(format!("{}/v1/jobs", c.url)).await.unwrap();
    assert_eq!(list.status(), 401);
    let (status, body) = submit(&c.url, "with-token", Some(&token)).await;
    assert_eq!(status, 201, "{body}");
    assert!(
        !c.lines().iter().any(|l| l.contains(&token[4..])),
        "the token is in the log"
    );
}

/// Without `[tls]` the agent routes authenticate nobody: with API tokens on they would
/// serve every job's environment to callers the API refuses. So a coordinator with tokens
/// and no `[tls]` refuses to start (and `validate` refuses its configuration), naming the
/// token file and the setting that accepts it; with `[access] agents_without_tls = true` it
/// starts, and says so in its log.
#[tokio::test]
async fn api_tokens_without_tls_refuse_to_start_unless_the_operator_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let token = create_token(&data).await;
    let config = dir.path().join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = '{}'\n[[services]]\nname = \"chat\"\n",
            data.display()
        ),
    )
    .unwrap();
    let tokens = data.join("tokens.json").display().to_string();
    for command in ["serve", "validate"] {
        let mut run = Command::new(bin());
        run.arg(command).arg("--config").arg(&config);
        if command == "serve" {
            run.args(["--listen", &format!("127.0.0.1:{}", free_port())]);
        }
        let out = tokio::time::timeout(Duration::from_secs(20), run.output())
            .await
            .unwrap_or_else(|_| panic!("{command} started with tokens and no [tls]"))
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {err}");
        assert!(
            err.contains(&format!("{tokens} holds API tokens, but there is no [tls]")),
            "{command}: {err}"
        );
        assert!(
            err.contains("[access] agents_without_tls = true"),
            "{command}: {err}"
        );
    }

    let c = Coordinator::start_configured(&data, "", AGENTS_WITHOUT_TLS).await;
    let warned = || {
        c.lines().iter().any(|l| {
            l.contains("WARN")
                && l.contains(
                    "[access] agents_without_tls: the agent routes are served without TLS",
                )
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !warned() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(warned(), "{:?}", c.lines());
    let list = reqwest::get(format!("{}/v1/jobs", c.url)).await.unwrap();
    assert_eq!(list.status(), 401);
    let (status, body) = submit(&c.url, "with-token", Some(&token)).await;
    assert_eq!(status, 201, "{body}");
}

#[tokio::test]
async fn an_empty_database_file_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let db = data.join("nightshift.db");
    std::fs::write(&db, b"").unwrap();
    std::fs::write(data.with_extension("toml"), "").unwrap();
    let out = Command::new(bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(&data)
        .arg("--config")
        .arg(data.with_extension("toml"))
        .output();
    let out = tokio::time::timeout(Duration::from_secs(20), out)
        .await
        .expect("the coordinator started on an empty database")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&db.display().to_string()), "{err}");
    assert!(err.contains("is empty"), "{err}");
    // Nothing was written over it.
    assert_eq!(std::fs::metadata(&db).unwrap().len(), 0);
}

/// The database cannot grow (a full disk, simulated by a file-size limit on the process):
/// `/healthz` says so with the reason, and the failures are logged once and then summarised,
/// not one line each.
#[tokio::test]
async fn an_unwritable_store_fails_healthz_and_is_logged_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // The schema takes a few pages of the write-ahead log; a few hundred jobs more do not fit.
    // SIGXFSZ is ignored, so a write past the limit fails (EFBIG) instead of killing it.
    let c = Coordinator::start_with(&data, "ulimit -f 256; trap '' XFSZ;").await;
    let health = || async {
        let r = reqwest::get(format!("{}/healthz", c.url)).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_eq!(health().await.0, 200);
    let mut failed = 0;
    let started = Instant::now();
    for i in 0..3000 {
        let (status, _) = submit(&c.url, &format!("j{i}"), None).await;
        if status == 500 {
            failed += 1;
            if failed == 1 {
                break;
            }
        }
    }
    assert_eq!(failed, 1, "the store never filled up");
    // Keep failing for three seconds, as agents' heartbeats and the ticker would.
    let start_failing = Instant::now();
    let mut failures = 0;
    while start_failing.elapsed() < Duration::from_secs(3) {
        let (status, _) = submit(&c.url, "more", None).await;
        assert_eq!(status, 500);
        failures += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = health().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("nightshift.db"), "{body}");
    assert!(
        body.contains("not saved") || body.contains("failing"),
        "{body}"
    );
    // The failure's own lines (whatever the log's format), and every warning or error.
    let lines = c.lines();
    let failure: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("saving state"))
        .collect();
    let loud = lines
        .iter()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .count();
    eprintln!(
        "{failures} failed writes in 3 s ({:?} to fill the store): {} lines about it, \
         {loud} warning/error lines in all",
        start_failing.duration_since(started),
        failure.len()
    );
    assert!(
        !failure.is_empty() && failure.len() <= 2 && loud <= 3,
        "{} lines for {failures} failures: {lines:#?}",
        failure.len()
    );
}

/// Guessing tokens: an address's failed authentications are limited (a burst, then one a
/// second), refused before any token is looked at; the answer says when to try again.
#[tokio::test]
async fn failed_authentications_are_rate_limited_per_client_address() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let token = create_token(&data).await;
    let c = Coordinator::start_configured(&data, "", AGENTS_WITHOUT_TLS).await;
    let client = reqwest::Client::new();
    let guess = |i: usize| {
        client
            .get(format!("{}/v1/jobs", c.url))
            .bearer_auth(format!("nst_{i:064x}"))
            .send()
    };
    let started = Instant::now();
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for i in 0..200 {
        let resp = guess(i).await.unwrap();
        if resp.status() == 429 {
            retry_after = resp.headers().get("retry-after").cloned();
        }
        statuses.push(resp.status().as_u16());
    }
    let took = started.elapsed();
    let unauthorized = statuses.iter().filter(|s| **s == 401).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    eprintln!("200 guesses in {took:?}: {unauthorized} answered 401, {limited} refused 429");
    assert!(
        unauthorized <= 10 + took.as_secs() as usize + 1,
        "{unauthorized} tokens tried in {took:?}"
    );
    assert_eq!(unauthorized + limited, 200, "{statuses:?}");
    assert_eq!(retry_after.unwrap(), "1");
    // A second later the address may try once more.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let resp = client
        .get(format!("{}/v1/jobs", c.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

/// A node's report while the store cannot be written (a full disk): each heartbeat is still
/// answered with the node's saved desired state and its lease, for longer than the lease TTL,
/// so the agent's fail-safe does not stop a job merely because the coordinator cannot write;
/// the job is still running, on its first attempt, once writes work again. Found by the fault
/// harness (`nightshift-bench faults`, disk-full), where every lent host took its replica
/// back 15 s into a full disk.
#[tokio::test]
async fn a_full_store_answers_heartbeats_and_keeps_leases_alive() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = "heartbeat_interval_ms = 200\nlease_ttl_ms = 2000\n\n[[services]]\nname = \"chat\"\n\
        min_replicas = 0\ncooldown_s = 0.0\n[services.scale_down]\nwindow_s = 0.5\n";
    let c = Coordinator::start_configured(&data, "ulimit -f 1024; trap '' XFSZ;", config).await;
    let mut host = Host::register(&c.url, "n1").await;
    // The idle node is lent; once its replica is stopped the job is leased to it.
    let lease = lease_a_job_to(&c, &mut host).await;
    // Fill the store.
    let mut full = false;
    for i in 0..3000 {
        let (status, _) = submit(&c.url, &format!("filler-{i}"), None).await;
        if status == 500 {
            full = true;
            break;
        }
    }
    assert!(full, "the store never filled up");
    // Three lease TTLs of heartbeats, each reporting a new checkpoint (a change to save).
    let started = Instant::now();
    let mut at = 1;
    while started.elapsed() < Duration::from_secs(6) {
        at += 1;
        let d = host.report(std::slice::from_ref(&lease), Some(at)).await;
        assert!(
            d.leases.iter().any(|l| l.lease_id == lease.lease_id),
            "the lease is gone from the answer: {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The store really failed all along, and the job is still on its first attempt.
    let health = reqwest::get(format!("{}/healthz", c.url)).await.unwrap();
    assert_eq!(health.status().as_u16(), 503);
    let job: serde_json::Value = reqwest::get(format!("{}/v1/jobs/{}", c.url, lease.job_id))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(job["attempt"], 1, "{job}");
    assert_eq!(job["preemptions"], 0, "{job}");
}

/// An agent played by the test over the protocol: it registers a node of 4 GPUs, follows
/// its desired state (stops its replica when lent) and reports the jobs it is told.
struct Host {
    http: reqwest::Client,
    url: String,
    node: String,
    applied: u64,
}

impl Host {
    async fn register(url: &str, node: &str) -> Self {
        use nightshift_common::{GpuInfo, RegisterRequest};
        let register = RegisterRequest {
            node: node.into(),
            gpus: (0..4)
                .map(|i| GpuInfo {
                    index: i,
                    uuid: format!("GPU-{node}-{i}"),
                    name: "t".into(),
                    memory_total_bytes: 1,
                })
                .collect(),
            service: "chat".into(),
            address: None,
            readiness_url: None,
            agent_url: None,
            metrics_url: None,
            agent_version: "test".into(),
        };
        let http = reqwest::Client::new();
        let resp = http
            .post(format!("{url}/v1/agents/register"))
            .json(&register)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
        Self {
            http,
            url: url.to_owned(),
            node: node.to_owned(),
            applied: 0,
        }
    }

    /// One heartbeat reporting `jobs` running: its replica serves until the node is lent.
    async fn beat(
        &mut self,
        jobs: &[nightshift_common::LeaseGrant],
    ) -> nightshift_common::DesiredNode {
        self.report(jobs, None).await
    }

    /// [`Host::beat`], each job last checkpointed at `checkpoint_at` (a change to save).
    async fn report(
        &mut self,
        jobs: &[nightshift_common::LeaseGrant],
        checkpoint_at: Option<u64>,
    ) -> nightshift_common::DesiredNode {
        use nightshift_common::{Heartbeat, JobRun, JobRunState, ReplicaState, ReplicaStatus};
        let replica = if self.applied == 0 {
            ReplicaState::Serving
        } else {
            ReplicaState::Stopped
        };
        let runs = jobs
            .iter()
            .map(|l| JobRun {
                job_id: l.job_id,
                attempt: l.attempt,
                lease_id: l.lease_id,
                epoch: l.epoch,
                gpus: l.gpus.clone(),
                state: JobRunState::Running,
                last_checkpoint_at: checkpoint_at,
                outputs: Default::default(),
                image_id: None,
                image_digest: None,
                ready: false,
            })
            .collect();
        let beat = Heartbeat::report(ReplicaStatus::idle(replica), runs, self.applied);
        let resp = self
            .http
            .post(format!("{}/v1/agents/{}/heartbeat", self.url, self.node))
            .json(&beat)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.text().await.unwrap();
        assert_eq!(status, 200, "{}'s heartbeat: {body}", self.node);
        let desired: nightshift_common::DesiredNode = serde_json::from_str(&body).unwrap();
        if !desired.serve {
            self.applied = desired.version;
        }
        desired
    }
}

/// A coordinator under libfaketime (Debian's `faketime` package), whose wall clock the test
/// steps by writing an offset to `clock` (the monotonic clock is left alone, as an NTP step
/// leaves it). `None`, with the reason printed, where libfaketime is not installed.
async fn coordinator_with_a_steppable_clock(
    dir: &Path,
    config: &str,
) -> Option<(Coordinator, std::path::PathBuf)> {
    // Debian's multiarch directory, e.g. /usr/lib/x86_64-linux-gnu/faketime.
    let lib = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join("faketime/libfaketimeMT.so.1"))
        .find(|p| p.exists());
    let Some(lib) = lib else {
        assert!(
            std::env::var_os("CI").is_none(),
            "libfaketimeMT.so.1 is missing: tests/run.sh installs the faketime package"
        );
        eprintln!("skipped: libfaketimeMT.so.1 is missing (apt-get install faketime)");
        return None;
    };
    let lib = lib.display();
    let clock = dir.join("clock");
    std::fs::write(&clock, "+0\n").unwrap();
    let prefix = format!(
        "export LD_PRELOAD={lib} FAKETIME_TIMESTAMP_FILE='{}' FAKETIME_NO_CACHE=1 \
         FAKETIME_DONT_FAKE_MONOTONIC=1;",
        clock.display()
    );
    let c = Coordinator::start_configured(&dir.join("data"), &prefix, config).await;
    Some((c, clock))
}

const STEP_CONFIG: &str = "heartbeat_interval_ms = 1000\nlease_ttl_ms = 3000\n\n[[services]]\n\
    name = \"chat\"\nmin_replicas = 0\ncooldown_s = 0.0\n[services.scale_down]\nwindow_s = 0.5\n";

/// Submits a job of 4 GPUs with a 30 s grace period and heartbeats `host` until the job's
/// lease reaches it; returns the lease.
async fn lease_a_job_to(c: &Coordinator, host: &mut Host) -> nightshift_common::LeaseGrant {
    let spec = serde_json::json!({
        "name": "steady", "image": "trainer:1", "gpus": 4,
        "checkpoint": {"gracePeriodSeconds": 30}
    });
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/jobs", c.url))
        .json(&spec)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201, "{}", resp.text().await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(l) = host.beat(&[]).await.leases.first() {
            return l.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no lease for the job on {}",
            host.node
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn job_json(c: &Coordinator, id: u64) -> serde_json::Value {
    reqwest::get(format!("{}/v1/jobs/{id}", c.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The coordinator's wall clock steps an hour forward while a job runs on a heartbeating
/// node and another node stands idle: no lease expires for it, so the job is never started
/// on the other node (before, every lease looked expired at once and the job ran twice, its
/// old container in its 30 s grace), and it keeps its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_wall_clock_step_expires_no_lease_and_runs_no_job_twice() {
    let dir = tempfile::tempdir().unwrap();
    let Some((c, clock)) = coordinator_with_a_steppable_clock(dir.path(), STEP_CONFIG).await else {
        return;
    };
    let mut a = Host::register(&c.url, "a").await;
    let lease = lease_a_job_to(&c, &mut a).await;
    let mut b = Host::register(&c.url, "b").await;
    let running = [lease.clone()];
    for _ in 0..5 {
        a.beat(&running).await;
        b.beat(&[]).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The step just after a heartbeat, so that the coordinator's next tick comes before the
    // next heartbeat, as agents beat once a second.
    a.beat(&running).await;
    std::fs::write(&clock, "+1h\n").unwrap();
    let stepped = Instant::now();
    // Three lease TTLs of heartbeats after the step.
    while stepped.elapsed() < Duration::from_secs(9) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let on_a = a.beat(&running).await;
        assert!(
            on_a.leases.iter().any(|l| l.lease_id == lease.lease_id),
            "{:?} after the step: a's lease is gone: {on_a:?}",
            stepped.elapsed()
        );
        let on_b = b.beat(&[]).await;
        assert!(
            on_b.leases.iter().all(|l| l.job_id != lease.job_id),
            "{:?} after the step: the job is leased to b too: {on_b:?}",
            stepped.elapsed()
        );
    }
    let job = job_json(&c, lease.job_id).await;
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(job["attempt"], 1, "{job}");
    assert_eq!(job["preemptions"], 0, "{job}");
    // The step is reported to the operator, as the offset it left.
    let metrics = reqwest::get(format!("{}/metrics", c.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let offset: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("nightshift_wall_clock_offset_seconds "))
        .unwrap_or_else(|| panic!("no wall clock offset in {metrics}"))
        .parse()
        .unwrap();
    assert!((offset - 3600.0).abs() < 5.0, "offset {offset}");
    assert!(
        c.lines()
            .iter()
            .any(|l| l.contains("the wall clock stepped")),
        "{:?}",
        c.lines()
    );
}

/// The coordinator's wall clock steps an hour back just as a lent node falls silent (its
/// agent frozen): the node is unreachable and its lease gone one TTL after its last
/// heartbeat, as without the step (before, both waited out the hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backward_wall_clock_step_keeps_no_dead_node_alive() {
    let dir = tempfile::tempdir().unwrap();
    let Some((c, clock)) = coordinator_with_a_steppable_clock(dir.path(), STEP_CONFIG).await else {
        return;
    };
    let mut a = Host::register(&c.url, "a").await;
    let lease = lease_a_job_to(&c, &mut a).await;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.beat(std::slice::from_ref(&lease)).await;
    }
    let silent = Instant::now();
    std::fs::write(&clock, "-1h\n").unwrap();
    let gone = loop {
        let nodes: serde_json::Value = reqwest::get(format!("{}/v1/nodes", c.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let reachable = nodes["nodes"][0]["reachable"].as_bool();
        let job = job_json(&c, lease.job_id).await;
        let leased = job["leases"].as_array().is_some_and(|l| !l.is_empty());
        if reachable == Some(false) && !leased {
            break silent.elapsed();
        }
        assert!(
            silent.elapsed() < Duration::from_secs(10),
            "node a silent for {:?} after a −1 h step, still reachable ({reachable:?}) or \
             holding the job's lease: {job}",
            silent.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("silent node unreachable and its lease gone {gone:?} after its last heartbeat");
    // The TTL (3 s) and a tick.
    assert!(gone < Duration::from_secs(5), "{gone:?}");
}

/// A tmpfs of its own, mounted on a fresh directory and unmounted when dropped: a disk the
/// test fills and frees.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Mounts a tmpfs of `size` (`mount -t tmpfs -o size=SIZE`); `Err` says why where
    /// mounting is not permitted (not root, or a container without CAP_SYS_ADMIN).
    fn mount(size: &str) -> Result<Self, String> {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("running mount");
        if out.status.success() {
            return Ok(Self { dir });
        }
        let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        let refused = ["permission denied", "not permitted", "must be superuser"]
            .iter()
            .any(|w| err.to_lowercase().contains(w));
        assert!(refused, "mount -t tmpfs failed: {err}");
        Err(err)
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a file until the disk is full; returns it.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let file = self.path().join("fill");
        let mut f = std::fs::File::create(&file).unwrap();
        let block = vec![0u8; 4096];
        loop {
            match f.write(&block) {
                Ok(0) => return file,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => return file,
                Err(e) => panic!("filling {}: {e}", file.display()),
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // Lazily: the coordinator, killed on drop, may hold its files a moment longer.
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// What the clients of [`reads_show_no_change_a_failed_write_takes_back_and_no_id_is_given_twice`]
/// were told.
#[derive(Default)]
struct Ledger {
    /// Acknowledged (201): job and pipeline run ids, with the names submitted.
    jobs: BTreeMap<u64, String>,
    runs: BTreeMap<u64, String>,
    /// Refused because their write failed (500).
    failed_jobs: usize,
    failed_runs: usize,
    /// Rounds of reads made ([`read_noted`]), and every job and run they answered: id and
    /// name.
    reads: usize,
    seen_jobs: BTreeSet<(u64, String)>,
    seen_runs: BTreeSet<(u64, String)>,
}

/// A one-step pipeline named `name`.
fn workflow(name: &str) -> serde_json::Value {
    let text = format!(
        "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  name: {name}\nspec:\n  \
         entrypoint: main\n  templates:\n  - name: main\n    dag:\n      tasks:\n      \
         - {{name: A, template: echo}}\n  - name: echo\n    container:\n      image: busybox\n"
    );
    serde_json::json!({"file": "wf.yaml", "text": text})
}

/// Submits the job (or, `pipeline`, the pipeline run) `name`, and notes in `ledger` what the
/// answer said: its id (201), or a failed write (500, saying so). True when acknowledged.
async fn submit_noted(
    http: &reqwest::Client,
    url: &str,
    ledger: &Mutex<Ledger>,
    name: &str,
    pipeline: bool,
) -> bool {
    let (path, body) = if pipeline {
        ("pipelines", workflow(name))
    } else {
        ("jobs", job(name))
    };
    let resp = http
        .post(format!("{url}/v1/{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let mut l = ledger.lock().unwrap();
    match status {
        201 => {
            let id = serde_json::from_str::<serde_json::Value>(&text).unwrap()["id"]
                .as_u64()
                .unwrap();
            let ids = if pipeline { &mut l.runs } else { &mut l.jobs };
            ids.insert(id, name.to_owned());
            true
        }
        500 if text.contains("not saved") => {
            *(if pipeline {
                &mut l.failed_runs
            } else {
                &mut l.failed_jobs
            }) += 1;
            false
        }
        _ => panic!("submitting {name}: {status} {text}"),
    }
}

/// Reads the jobs and pipeline runs as a client would, noting every one answered: the list,
/// and the three ids above the highest acknowledged (where a job whose write is failing
/// would be).
async fn read_noted(http: &reqwest::Client, url: &str, ledger: &Mutex<Ledger>) {
    use nightshift_common::{JobList, JobView, PipelineRunList, PipelineRunView};
    async fn get<T: serde::de::DeserializeOwned>(http: &reqwest::Client, url: String) -> Option<T> {
        let resp = http.get(url).send().await.unwrap();
        match resp.status().as_u16() {
            200 => Some(resp.json().await.unwrap()),
            404 => None,
            s => panic!("a read answered {s}: {}", resp.text().await.unwrap()),
        }
    }
    let (job_above, run_above) = {
        let l = ledger.lock().unwrap();
        let above = |ids: &BTreeMap<u64, String>| ids.keys().next_back().copied().unwrap_or(0);
        (above(&l.jobs), above(&l.runs))
    };
    let mut jobs: Vec<JobView> = Vec::new();
    let mut runs: Vec<PipelineRunView> = Vec::new();
    for id in job_above + 1..=job_above + 3 {
        jobs.extend(get(http, format!("{url}/v1/jobs/{id}")).await);
    }
    for id in run_above + 1..=run_above + 3 {
        runs.extend(get(http, format!("{url}/v1/pipelines/{id}")).await);
    }
    let list: JobList = get(http, format!("{url}/v1/jobs")).await.unwrap();
    jobs.extend(list.jobs);
    let list: PipelineRunList = get(http, format!("{url}/v1/pipelines")).await.unwrap();
    runs.extend(list.runs);
    let mut l = ledger.lock().unwrap();
    l.reads += 1;
    l.seen_jobs
        .extend(jobs.into_iter().map(|j| (j.id, j.spec.name)));
    l.seen_runs.extend(runs.into_iter().map(|r| (r.id, r.name)));
}

/// Reads while writes fail (the data directory on a full tmpfs): no read answers a job or a
/// pipeline run that is not saved, however reads and failed writes interleave; and once
/// space is freed, the next job and run get ids never handed out before, since a failed write
/// takes back what it carried but not the ids it gave. Issue 29 (defect 4): `GET /v1/jobs/2`
/// answered three jobs that were never saved, then the next job saved was given id 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_show_no_change_a_failed_write_takes_back_and_no_id_is_given_twice() {
    let disk = match SmallDisk::mount("3m") {
        Ok(disk) => disk,
        Err(why) => {
            eprintln!("skipped: mounting the tmpfs this test fills is not permitted here: {why}");
            return;
        }
    };
    let c = Coordinator::start(&disk.path().join("data")).await;
    let http = reqwest::Client::new();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    assert!(submit_noted(&http, &c.url, &ledger, "saved-job", false).await);
    assert!(submit_noted(&http, &c.url, &ledger, "saved-run", true).await);
    let fill = disk.fill();

    // Three clients submit jobs and one pipeline runs, two read, until enough writes failed.
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for client in 0..6 {
        let (url, ledger, stop, http) = (c.url.clone(), ledger.clone(), stop.clone(), http.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                match client {
                    0..3 => {
                        let name = format!("lost-{client}-{i}");
                        submit_noted(&http, &url, &ledger, &name, false).await;
                    }
                    3 => {
                        submit_noted(&http, &url, &ledger, &format!("lost-run-{i}"), true).await;
                    }
                    _ => read_noted(&http, &url, &ledger).await,
                }
            }
        }));
    }
    let started = Instant::now();
    loop {
        let (jobs, runs, reads) = {
            let l = ledger.lock().unwrap();
            (l.failed_jobs, l.failed_runs, l.reads)
        };
        if jobs >= 200 && runs >= 20 && reads >= 40 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "in 60 s on the full disk, {jobs} job and {runs} pipeline writes failed; {reads} \
             rounds of reads"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }

    // Space again: the next job and run are saved.
    std::fs::remove_file(&fill).unwrap();
    for (name, pipeline) in [("after", false), ("after-run", true)] {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !submit_noted(&http, &c.url, &ledger, name, pipeline).await {
            assert!(
                Instant::now() < deadline,
                "{name} not saved with space freed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    read_noted(&http, &c.url, &ledger).await;
    let saved_jobs: BTreeMap<u64, String> = reqwest::get(format!("{}/v1/jobs", c.url))
        .await
        .unwrap()
        .json::<nightshift_common::JobList>()
        .await
        .unwrap()
        .jobs
        .into_iter()
        .map(|j| (j.id, j.spec.name))
        .collect();
    let saved_runs: BTreeMap<u64, String> = reqwest::get(format!("{}/v1/pipelines", c.url))
        .await
        .unwrap()
        .json::<nightshift_common::PipelineRunList>()
        .await
        .unwrap()
        .runs
        .into_iter()
        .map(|r| (r.id, r.name))
        .collect();

    let l = ledger.lock().unwrap();
    eprintln!(
        "{} jobs and {} runs acknowledged, {} and {} refused (write failed); {} rounds of reads \
         answered {} jobs and {} runs; {} jobs saved",
        l.jobs.len(),
        l.runs.len(),
        l.failed_jobs,
        l.failed_runs,
        l.reads,
        l.seen_jobs.len(),
        l.seen_runs.len(),
        saved_jobs.len()
    );
    // What each read answered is what the store holds: no read named a change taken back,
    // and no id named two things.
    for (id, name) in &l.seen_jobs {
        assert_eq!(
            saved_jobs.get(id),
            Some(name),
            "a read answered job {id} named {name}: not what the store holds under that id"
        );
    }
    for (id, name) in &l.seen_runs {
        assert_eq!(
            saved_runs.get(id),
            Some(name),
            "a read answered pipeline run {id} named {name}: not what the store holds"
        );
    }
    for (id, name) in &l.jobs {
        assert_eq!(saved_jobs.get(id), Some(name), "acknowledged job {id} lost");
    }
    for (id, name) in &l.runs {
        assert_eq!(saved_runs.get(id), Some(name), "acknowledged run {id} lost");
    }
    // Each failed submission was given an id too, which none may get again: the ids run
    // above all of them.
    let after =
        |ids: &BTreeMap<u64, String>, name: &str| *ids.iter().find(|(_, n)| *n == name).unwrap().0;
    let (job, run) = (after(&l.jobs, "after"), after(&l.runs, "after-run"));
    assert!(
        job > (l.jobs.len() + l.failed_jobs - 1) as u64,
        "the job saved after the failures got id {job}: before it, {} acknowledged and {} \
         refused, each given an id",
        l.jobs.len() - 1,
        l.failed_jobs
    );
    assert!(
        run > (l.runs.len() + l.failed_runs - 1) as u64,
        "the run saved after the failures got id {run}: before it, {} acknowledged and {} \
         refused, each given an id",
        l.runs.len() - 1,
        l.failed_runs
    );
}
