//! The integration-test harness: start a real coordinator and real agents in-process (or as
//! processes), against the real Docker engine, with the stand-in images that
//! `tests/images/build.sh` builds.
//!
//! Every test uses its own node names, so the containers it starts carry their own labels and
//! a [`Cleanup`] guard removes exactly those, even when the test panics.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nightshift_agent::agent::AgentHandle;
use nightshift_agent::config::AgentConfig;
use nightshift_agent::engine::docker::DockerEngine;
use nightshift_agent::gpus::Gpus;
use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_agent::reconcile::Reconciler;
use nightshift_agent::serving::http::HttpServing;
use nightshift_agent::state::Shared;
use nightshift_common::{CheckpointPolicy, EnvVar, JobSpec, labels};
use nightshift_coordinator::config::{
    CoordinatorConfig, ScaleDownConfig, ScaleUpConfig, ServiceConfig,
};

pub mod marked;
pub mod postgres;
pub mod secrets;

pub const VLLM_IMAGE: &str = "nightshift/vllm-standin:dev";
pub const TRAINER_IMAGE: &str = "nightshift/toy-trainer:dev";

/// Logs to the test's output and to a file of the run's log directory
/// ([`secrets::run_dir`]), which the end-of-run secret scan reads.
pub fn init_tracing() {
    use tracing_subscriber::fmt::writer::{MakeWriterExt, TestWriter};
    let name = std::env::current_exe()
        .ok()
        .and_then(|e| e.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "test".into());
    let (_, file) = secrets::log_file(&name);
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                "warn,nightshift_agent=info,nightshift_coordinator=info".into()
            }),
        )
        .with_writer(TestWriter::new().and(std::sync::Mutex::new(file)))
        .try_init();
}

/// A unique name for this test's node, so its containers are its own.
pub fn unique_node(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

/// Fails the test with instructions when the stand-in images are missing.
pub fn require_images() {
    for image in [VLLM_IMAGE, TRAINER_IMAGE] {
        let ok = std::process::Command::new("docker")
            .args(["image", "inspect", image])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            ok,
            "image {image} is missing: run tests/images/build.sh (the README's test command does)"
        );
    }
}

/// Removes every container of `node` when dropped.
pub struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_containers(&self.0);
    }
}

pub fn remove_containers(node: &str) {
    let filter = format!("label={}={node}", labels::MANAGED_BY);
    if let Ok(out) = std::process::Command::new("docker")
        .args(["ps", "-aq", "--filter", &filter])
        .output()
    {
        let ids = String::from_utf8_lossy(&out.stdout);
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if !ids.is_empty() {
            let _ = std::process::Command::new("docker")
                .arg("rm")
                .arg("-f")
                .args(ids)
                .output();
        }
    }
}

/// `docker inspect` of a container, as JSON.
pub fn docker_inspect(id: &str) -> serde_json::Value {
    let out = std::process::Command::new("docker")
        .args(["inspect", id])
        .output()
        .expect("docker inspect");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("docker inspect json");
    v[0].clone()
}

/// Containers of `node` with `role`, as (id, name, state) from `docker ps`.
pub fn containers(node: &str, role: &str) -> Vec<(String, String, String)> {
    let out = std::process::Command::new("docker")
        .args([
            "ps",
            "-a",
            "--filter",
            &format!("label={}={node}", labels::MANAGED_BY),
            "--filter",
            &format!("label={}={role}", labels::ROLE),
            "--format",
            "{{.ID}} {{.Names}} {{.State}}",
        ])
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut p = l.split_whitespace();
            Some((
                p.next()?.to_owned(),
                p.next()?.to_owned(),
                p.next()?.to_owned(),
            ))
        })
        .collect()
}

/// Polls `check` every 100 ms until it yields a value, or panics after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An agent configuration for tests: fake GPUs, the stand-in replica on an ephemeral port,
/// short timeouts.
pub fn agent_config(coordinator: &str, node: &str, work_dir: &Path, gpus: u32) -> AgentConfig {
    let mut cfg = AgentConfig {
        coordinator: coordinator.to_owned(),
        node: node.to_owned(),
        work_dir: work_dir.to_owned(),
        readiness_grace_s: 0.3,
        drain_timeout_s: 60.0,
        free_timeout_s: 5.0,
        health_timeout_s: 60.0,
        // The agent's API (/status, job logs) on an ephemeral loopback port.
        api_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..AgentConfig::default()
    };
    cfg.gpus.fake = Some(gpus);
    cfg.replica.image = VLLM_IMAGE.to_owned();
    cfg.replica.host_ip = "127.0.0.1".to_owned();
    cfg.replica.host_port = 0;
    cfg.replica.shutdown_timeout_s = 30.0;
    cfg.replica.env = vec![
        "STANDIN_TOKEN_LATENCY_MS=10".to_owned(),
        "STANDIN_MAX_NUM_SEQS=4".to_owned(),
        "STANDIN_SHUTDOWN_TIMEOUT_S=30".to_owned(),
    ];
    cfg
}

/// A coordinator configuration for tests: one service that may lend every replica, with
/// windows of about a second.
pub fn coordinator_config(data_dir: &Path) -> CoordinatorConfig {
    CoordinatorConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: data_dir.to_owned(),
        heartbeat_interval_ms: 200,
        lease_ttl_ms: 10_000,
        tls: None,
        policy: Default::default(),
        services: vec![ServiceConfig {
            name: "default".into(),
            min_replicas: 0,
            cooldown_s: 1.0,
            gateway_signal_ttl_s: 2.0,
            scale_down: ScaleDownConfig {
                max_waiting: 0.0,
                max_running_per_replica: 4.0,
                window_s: 1.0,
                ..ScaleDownConfig::default()
            },
            scale_up: ScaleUpConfig {
                waiting_per_replica: 2.0,
                running_per_replica: 8.0,
                ..ScaleUpConfig::default()
            },
            ..ServiceConfig::default()
        }],
        ..CoordinatorConfig::default()
    }
}

/// A coordinator served in-process on an ephemeral port.
pub struct TestCoordinator {
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl TestCoordinator {
    pub async fn start(cfg: &CoordinatorConfig) -> Self {
        let cluster = nightshift_coordinator::server::open(cfg).expect("open coordinator state");
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .expect("bind coordinator");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let task = tokio::spawn(async move {
            let _ =
                nightshift_coordinator::server::serve(listener, cluster, std::future::pending())
                    .await;
        });
        Self { url, task }
    }

    pub fn client(&self) -> nightshift_cli::client::Client {
        nightshift_cli::client::Client::new(&self.url).expect("client")
    }
}

impl Drop for TestCoordinator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The setup most Docker tests share: a coordinator in-process and one agent on fake GPUs.
/// Dropped, it stops serving and removes the node's containers (after its work directory).
pub struct OneNode {
    pub node: String,
    pub coordinator: TestCoordinator,
    pub client: nightshift_cli::client::Client,
    pub agent: AgentHandle,
    pub dir: tempfile::TempDir,
    _cleanup: Cleanup,
}

impl OneNode {
    /// A node named after `prefix` with `gpus` fake GPUs.
    pub async fn start(prefix: &str, gpus: u32) -> Self {
        let node = unique_node(prefix);
        let fake = Arc::new(FakeGpus::new(&node, gpus));
        Self::with_gpus(node, fake).await
    }

    /// Node `node` (from [`unique_node`]) on fake GPUs the test keeps a handle to.
    pub async fn with_gpus(node: String, gpus: Arc<FakeGpus>) -> Self {
        let cleanup = Cleanup(node.clone());
        let dir = tempfile::tempdir().expect("tempdir");
        let coordinator =
            TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
        let client = coordinator.client();
        let count = gpus.inventory().map_or(0, |g| g.len() as u32);
        let cfg = agent_config(&coordinator.url, &node, &dir.path().join("work"), count);
        let (agent, _) = start_agent_with(cfg, gpus).await;
        Self {
            node,
            coordinator,
            client,
            agent,
            dir,
            _cleanup: cleanup,
        }
    }

    pub fn url(&self) -> &str {
        &self.coordinator.url
    }
}

/// Starts an agent in-process, with its readiness endpoint on an ephemeral port.
pub async fn start_agent(cfg: AgentConfig, gpus: u32) -> (AgentHandle, String) {
    let fake = Arc::new(FakeGpus::new(&cfg.node_name(), gpus));
    start_agent_with(cfg, fake).await
}

/// [`start_agent`] on fake GPUs the test keeps a handle to (to mark one unhealthy, say); the
/// URL of the agent's `/status`.
pub async fn start_agent_with(cfg: AgentConfig, gpus: Arc<FakeGpus>) -> (AgentHandle, String) {
    let engine = DockerEngine::connect().await.expect("docker");
    let serving = HttpServing::new().expect("http client");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind readiness");
    let handle = nightshift_agent::agent::start(cfg, engine, gpus, serving, Some(listener))
        .expect("start agent");
    let status_url = format!("{}/status", handle.api_url.as_deref().expect("api url"));
    (handle, status_url)
}

/// A reconciler driven directly by the test, which plays the coordinator by offering desired
/// states: the agent's sequences against real containers, without the autoscaler's timing.
pub async fn reconciler(
    cfg: AgentConfig,
    gpus: u32,
) -> (
    Reconciler<DockerEngine, FakeGpus, HttpServing>,
    Arc<Shared>,
    Arc<FakeGpus>,
) {
    let node = cfg.node_name();
    let shared = Arc::new(Shared::new(&node));
    let fake = Arc::new(FakeGpus::new(&node, gpus));
    let engine = Arc::new(DockerEngine::connect().await.expect("docker"));
    let serving = Arc::new(HttpServing::new().expect("http client"));
    let r = Reconciler::new(Arc::new(cfg), engine, fake.clone(), serving, shared.clone());
    (r, shared, fake)
}

/// The toy trainer as a job: `target` steps at `rate` per second, a checkpoint every
/// `every` steps.
pub fn trainer_job(name: &str, gpus: u32, target: u64, rate: u64, every: u64) -> JobSpec {
    JobSpec {
        env: vec![
            EnvVar {
                name: "TRAINER_TARGET_STEP".into(),
                value: target.to_string(),
            },
            EnvVar {
                name: "TRAINER_STEPS_PER_SEC".into(),
                value: rate.to_string(),
            },
            EnvVar {
                name: "TRAINER_CHECKPOINT_EVERY".into(),
                value: every.to_string(),
            },
        ],
        checkpoint: CheckpointPolicy {
            signal: "SIGTERM".into(),
            grace_period_seconds: 10,
        },
        ..JobSpec::new(name, TRAINER_IMAGE, gpus)
    }
}

/// Sends one completion request to `base` and returns its HTTP status.
pub async fn complete(
    client: &reqwest::Client,
    base: &str,
    max_tokens: u32,
) -> Result<u16, String> {
    client
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({"model": "standin-model", "prompt": "hello there", "max_tokens": max_tokens}))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string())
}

/// A binary of the workspace, built next to the test executables
/// (`cargo build --workspace --bins` builds them; the README's test command does).
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        bin.display()
    );
    bin
}

/// Runs the `nightshift` CLI against the coordinator at `url`: its exit code, stdout and
/// stderr.
pub async fn nightshift(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(workspace_bin("nightshift"))
        .arg("--coordinator")
        .arg(url)
        .args(args)
        .output()
        .await
        .expect("run nightshift");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// The coordinator configuration of [`coordinator_config`] as a TOML file's text.
pub fn coordinator_toml(cfg: &CoordinatorConfig) -> String {
    let s = &cfg.services[0];
    format!(
        "heartbeat_interval_ms = {}\nlease_ttl_ms = {}\n[[services]]\nname = \"{}\"\nmin_replicas = {}\n\
         cooldown_s = {}\ngateway_signal_ttl_s = {}\n[services.scale_down]\nmax_waiting = {}\n\
         max_running_per_replica = {}\nwindow_s = {}\n[services.scale_up]\nwaiting_per_replica = {}\n\
         running_per_replica = {}\n",
        cfg.heartbeat_interval_ms,
        cfg.lease_ttl_ms,
        s.name,
        s.min_replicas,
        s.cooldown_s,
        s.gateway_signal_ttl_s,
        s.scale_down.max_waiting,
        s.scale_down.max_running_per_replica,
        s.scale_down.window_s,
        s.scale_up.waiting_per_replica,
        s.scale_up.running_per_replica,
    )
}

/// A real `nightshift-coordinator serve` process, killed when dropped.
pub struct CoordinatorProcess {
    child: std::process::Child,
    pub url: String,
    port: u16,
    data: std::path::PathBuf,
    config: std::path::PathBuf,
}

async fn wait_healthy(client: &nightshift_cli::client::Client) {
    wait_for(
        "the coordinator to answer",
        Duration::from_secs(60),
        || async { client.healthz().await.ok() },
    )
    .await;
}

impl CoordinatorProcess {
    /// Starts the binary on `port` with `data` as its data directory and `config` (TOML).
    /// Its output goes to a log file of the run ([`secrets::log_file`]).
    pub fn spawn(port: u16, data: &Path, config: &Path) -> Self {
        Self::spawn_bin(&workspace_bin("nightshift-coordinator"), port, data, config)
    }

    /// [`CoordinatorProcess::spawn`] of the binary `bin` (a benchmark's sibling).
    pub fn spawn_bin(bin: &Path, port: u16, data: &Path, config: &Path) -> Self {
        let (_, log) = secrets::log_file("nightshift-coordinator");
        let child = std::process::Command::new(bin)
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(data)
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .expect("spawn nightshift-coordinator");
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            port,
            data: data.to_owned(),
            config: config.to_owned(),
        }
    }

    /// A coordinator on a free port with its state and `coordinator.toml` (from
    /// [`coordinator_config`]) under `dir`, answering `/healthz`; and a client for it.
    pub async fn start_in(dir: &Path) -> (Self, nightshift_cli::client::Client) {
        Self::start_with(dir, "").await
    }

    /// [`CoordinatorProcess::start_in`] with `extra` appended to its `coordinator.toml`
    /// (e.g. a `[store]` table).
    pub async fn start_with(dir: &Path, extra: &str) -> (Self, nightshift_cli::client::Client) {
        let data = dir.join("state");
        let config = dir.join("coordinator.toml");
        let toml = coordinator_toml(&coordinator_config(&data)) + extra;
        std::fs::write(&config, toml).expect("write config");
        let process = Self::spawn(free_port(), &data, &config);
        let client = nightshift_cli::client::Client::new(&process.url).expect("client");
        wait_healthy(&client).await;
        (process, client)
    }

    /// Kills it with SIGKILL, as a crash would, starts it again on the same port and state,
    /// and waits until it answers.
    pub async fn crash_and_restart(self) -> Self {
        let (port, data, config) = (self.port, self.data.clone(), self.config.clone());
        self.kill();
        let process = Self::spawn(port, &data, &config);
        let client = nightshift_cli::client::Client::new(&process.url).expect("client");
        wait_healthy(&client).await;
        process
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the process.
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// SIGTERM, as a clean shutdown would (`systemctl stop`), then waits up to 30 s for the
    /// process to exit: its exit status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal("TERM");
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the coordinator") {
                return status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the coordinator did not exit within 30 s of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts it again on the same port, state and configuration (after it exited).
    pub fn respawn(&mut self) {
        let (port, data, config) = (self.port, self.data.clone(), self.config.clone());
        *self = Self::spawn(port, &data, &config);
    }

    /// SIGKILL, then reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
