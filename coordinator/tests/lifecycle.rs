//! The coordinator as an operator runs it: the real `nightshift-coordinator` binary started,
//! signalled and started again on one data directory. One owner per data directory; a stop
//! that does not wait for agents' long-polls; a token created beside a running coordinator
//! closes its open API at once; a store that cannot be written is reported by `/healthz` and
//! logged without flooding the log, and does not stop a lent node's jobs; an empty database
//! file is refused.

use std::path::Path;
use std::process::Stdio;
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
    let out = Command::new(bin())
        .args([
            "token",
            "create",
            "--role",
            "admin",
            "--name",
            "root",
            "--data-dir",
        ])
        .arg(&data)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let c = Coordinator::start(&data).await;
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
    use nightshift_common::{
        DesiredNode, GpuInfo, Heartbeat, JobRun, JobRunState, RegisterRequest, ReplicaState,
        ReplicaStatus,
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = "heartbeat_interval_ms = 200\nlease_ttl_ms = 2000\n\n[[services]]\nname = \"chat\"\n\
        min_replicas = 0\ncooldown_s = 0.0\n[services.scale_down]\nwindow_s = 0.5\n";
    let c = Coordinator::start_configured(&data, "ulimit -f 256; trap '' XFSZ;", config).await;
    let http = reqwest::Client::new();
    let post = |path: String, body: serde_json::Value| {
        let req = http.post(format!("{}{path}", c.url)).json(&body);
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let register = RegisterRequest {
        node: "n1".into(),
        gpus: (0..4)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
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
    let (status, body) = post(
        "/v1/agents/register".into(),
        serde_json::to_value(register).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let beat = |replica: ReplicaState, applied: u64, jobs: Vec<JobRun>| {
        Heartbeat::report(ReplicaStatus::idle(replica), jobs, applied)
    };
    let send = |b: Heartbeat| {
        post(
            "/v1/agents/n1/heartbeat".into(),
            serde_json::to_value(b).unwrap(),
        )
    };
    let (status, body) = submit(&c.url, "lent-job", None).await;
    assert_eq!(status, 201, "{body}");
    // The idle node is lent; once its replica is stopped the job is leased to it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut applied = 0;
    let lease = loop {
        let replica = if applied == 0 {
            ReplicaState::Serving
        } else {
            ReplicaState::Stopped
        };
        let (status, body) = send(beat(replica, applied, vec![])).await;
        assert_eq!(status, 200, "{body}");
        let d: DesiredNode = serde_json::from_str(&body).unwrap();
        if !d.serve {
            applied = d.version;
        }
        if let Some(l) = d.leases.first() {
            break l.clone();
        }
        assert!(Instant::now() < deadline, "no lease for the job: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let run = |at: u64| JobRun {
        job_id: lease.job_id,
        attempt: lease.attempt,
        lease_id: lease.lease_id,
        epoch: lease.epoch,
        gpus: lease.gpus.clone(),
        state: JobRunState::Running,
        last_checkpoint_at: Some(at),
        outputs: Default::default(),
        image_id: None,
        image_digest: None,
        ready: false,
    };
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
        let (status, body) = send(beat(ReplicaState::Stopped, applied, vec![run(at)])).await;
        assert_eq!(status, 200, "a heartbeat while the store is full: {body}");
        let d: DesiredNode = serde_json::from_str(&body).unwrap();
        assert!(
            d.leases.iter().any(|l| l.lease_id == lease.lease_id),
            "the lease is gone from the answer: {body}"
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
