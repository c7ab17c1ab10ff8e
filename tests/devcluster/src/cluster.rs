//! A cluster of one on this machine, made of the real programs: `nightshift-coordinator serve`
//! (SQLite in a temporary folder) and `nightshift-agent run` with 4 fake GPUs (`[gpus] fake`),
//! each a child process with its own configuration file and log, as an operator would run
//! them. The children are killed when the [`DevCluster`] is stopped or dropped, and (on Linux)
//! when this process dies, so that none outlives the demo.
//!
//! The programs are looked for in `$NIGHTSHIFT_BIN_DIR`, else next to this program's own
//! executable (`target/debug` under `cargo run`). Under `cargo run` (the `CARGO` variable is
//! set), missing ones are built first, in this program's profile.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nightshift_cli::client::Client;
use tokio::process::{Child, Command};

pub const COORDINATOR_BIN: &str = "nightshift-coordinator";
pub const AGENT_BIN: &str = "nightshift-agent";
/// The stand-ins the demo runs, by the names `tests/images/build.sh` builds them under.
pub const VLLM_STANDIN: &str = "vllm-standin";
pub const TOY_TRAINER: &str = "toy-trainer";

/// The image of a stand-in: `nightshift/NAME:TAG`, TAG being `$NIGHTSHIFT_STANDIN_TAG` (`dev`
/// when unset or empty), as `tests/images/build.sh` tags it.
pub fn standin_image(name: &str) -> String {
    let tag = std::env::var("NIGHTSHIFT_STANDIN_TAG")
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "dev".into());
    format!("nightshift/{name}:{tag}")
}

/// Longest wait for a program to answer after it started.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the coordinator and agent programs are.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub coordinator: PathBuf,
    pub agent: PathBuf,
}

impl Binaries {
    /// Finds both programs (see the module's documentation), building them under `cargo run`
    /// when they are missing; an error names the one missing and how to get it.
    pub fn find() -> anyhow::Result<Self> {
        let (dir, from_env) = match std::env::var_os("NIGHTSHIFT_BIN_DIR") {
            Some(dir) => (PathBuf::from(dir), true),
            None => {
                let exe = std::env::current_exe().context("finding this program's path")?;
                let dir = exe.parent().map(Path::to_owned).unwrap_or_default();
                (dir, false)
            }
        };
        let binaries = Self {
            coordinator: dir.join(COORDINATOR_BIN),
            agent: dir.join(AGENT_BIN),
        };
        let missing = binaries.missing();
        if missing.is_empty() {
            return Ok(binaries);
        }
        match std::env::var_os("CARGO") {
            Some(cargo) if !from_env => {
                build(Path::new(&cargo))?;
                match binaries.missing().first() {
                    None => Ok(binaries),
                    Some(path) => bail!(
                        "{} is still missing after `cargo build -p nightshift-coordinator -p \
                         nightshift-agent`",
                        path.display()
                    ),
                }
            }
            _ => bail!(
                "{} is missing: nightshift-demo runs the real {COORDINATOR_BIN} and {AGENT_BIN} \
                 programs, looked for {}; build them with `cargo build -p \
                 nightshift-coordinator -p nightshift-agent` (or start the demo with `cargo run \
                 -p nightshift-devcluster --bin nightshift-demo`, which does), or set \
                 NIGHTSHIFT_BIN_DIR to the folder that holds them",
                missing[0].display(),
                if from_env {
                    "in $NIGHTSHIFT_BIN_DIR"
                } else {
                    "next to nightshift-demo"
                }
            ),
        }
    }

    fn missing(&self) -> Vec<&Path> {
        [&self.coordinator, &self.agent]
            .into_iter()
            .filter(|p| !p.is_file())
            .map(PathBuf::as_path)
            .collect()
    }
}

/// `$CARGO build -p nightshift-coordinator -p nightshift-agent`, in this program's profile
/// (so into the folder this program runs from).
fn build(cargo: &Path) -> anyhow::Result<()> {
    let mut command = std::process::Command::new(cargo);
    command.args([
        "build",
        "-p",
        "nightshift-coordinator",
        "-p",
        "nightshift-agent",
    ]);
    if !cfg!(debug_assertions) {
        command.arg("--release");
    }
    eprintln!("building {COORDINATOR_BIN} and {AGENT_BIN} (first run only): {command:?}");
    let status = command
        .status()
        .with_context(|| format!("running {}", cargo.display()))?;
    if !status.success() {
        bail!("building {COORDINATOR_BIN} and {AGENT_BIN} failed ({status})");
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1 (bound, then released for the child to take).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One child program, its log file, and what it is called in messages.
struct Program {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Program {
    fn spawn(name: &'static str, mut command: Command, log: PathBuf) -> anyhow::Result<Self> {
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true);
        die_with_parent(&mut command);
        let child = command
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self { name, child, log })
    }

    /// An error if the program has exited, with the end of its log.
    fn check_running(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => bail!(
                "{} exited ({status}); the end of its log ({}):\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 20)
            ),
        }
    }

    async fn stop(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// The last `n` lines of a log file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Linux: the child gets SIGTERM when this process dies, even by SIGKILL, so that no
/// coordinator or agent outlives the demo.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    #[allow(unsafe_code)]
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_: &mut Command) {}

/// The running coordinator and agent.
pub struct DevCluster {
    /// The coordinator's base URL.
    pub url: String,
    /// The agent's `/status` (what it sees: readiness, replica state).
    pub agent_status_url: String,
    /// The node the agent serves as; its containers carry it.
    pub node: String,
    /// The agent's work directory (jobs' checkpoints under `jobs/ID/checkpoints`).
    pub agent_work_dir: PathBuf,
    coordinator: Program,
    agent: Program,
}

impl DevCluster {
    /// Writes `coordinator.toml` and `agent.toml` under `dir`, starts both programs and waits
    /// until the coordinator and the agent's API answer.
    pub async fn start(binaries: &Binaries, dir: &Path, node: &str) -> anyhow::Result<Self> {
        let (port, readiness_port, api_port) = (free_port()?, free_port()?, free_port()?);
        let url = format!("http://127.0.0.1:{port}");
        let coordinator_toml = dir.join("coordinator.toml");
        std::fs::write(&coordinator_toml, COORDINATOR_TOML)
            .with_context(|| format!("writing {}", coordinator_toml.display()))?;
        let mut command = Command::new(&binaries.coordinator);
        command
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(dir.join("coordinator"))
            .arg("--config")
            .arg(&coordinator_toml);
        let mut coordinator =
            Program::spawn(COORDINATOR_BIN, command, dir.join("coordinator.log"))?;
        let client = Client::new(&url)?;
        wait_until(&mut coordinator, || async {
            client.healthz().await.is_ok()
        })
        .await?;

        let agent_work_dir = dir.join("agent");
        let agent_toml = dir.join("agent.toml");
        std::fs::write(
            &agent_toml,
            agent_toml_text(&url, node, &agent_work_dir, readiness_port, api_port),
        )
        .with_context(|| format!("writing {}", agent_toml.display()))?;
        let mut command = Command::new(&binaries.agent);
        command.arg("run").arg("--config").arg(&agent_toml);
        let mut agent = Program::spawn(AGENT_BIN, command, dir.join("agent.log"))?;
        let agent_status_url = format!("http://127.0.0.1:{api_port}/status");
        let http = reqwest::Client::new();
        wait_until(&mut agent, || async {
            http.get(&agent_status_url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await?;
        Ok(Self {
            url,
            agent_status_url,
            node: node.to_owned(),
            agent_work_dir,
            coordinator,
            agent,
        })
    }

    /// An error if either program has exited, with the end of its log.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        self.coordinator.check_running()?;
        self.agent.check_running()
    }

    /// Kills the agent, then the coordinator, and waits for both.
    pub async fn stop(&mut self) {
        self.agent.stop().await;
        self.coordinator.stop().await;
    }

    /// Where the programs' logs are.
    pub fn logs(&self) -> [&Path; 2] {
        [&self.coordinator.log, &self.agent.log]
    }
}

/// Polls `ready` until it holds, failing if `program` exits or [`START_TIMEOUT`] passes.
async fn wait_until<F, Fut>(program: &mut Program, mut ready: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    while !ready().await {
        program.check_running()?;
        if started.elapsed() > START_TIMEOUT {
            bail!(
                "{} did not answer within {START_TIMEOUT:?}; the end of its log ({}):\n{}",
                program.name,
                program.log.display(),
                tail(&program.log, 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// One service that may lend its only replica (so the gateway holds requests meanwhile),
/// with windows of about two seconds, and a fast heartbeat.
const COORDINATOR_TOML: &str = r#"# nightshift-demo's coordinator
heartbeat_interval_ms = 250
lease_ttl_ms = 15000

[[services]]
name = "default"
# One node: lending it leaves none serving, so the gateway holds requests meanwhile.
min_replicas = 0
cooldown_s = 2.0
gateway_signal_ttl_s = 1.0

[services.scale_down]
max_waiting = 0.0
max_running_per_replica = 4.0
window_s = 2.0

[services.scale_up]
waiting_per_replica = 2.0
running_per_replica = 8.0
"#;

/// The agent: 4 fake GPUs, the vLLM stand-in as its replica on an ephemeral port, every port
/// on loopback.
fn agent_toml_text(
    coordinator: &str,
    node: &str,
    work_dir: &Path,
    readiness_port: u16,
    api_port: u16,
) -> String {
    let quoted = |s: &str| serde_json::to_string(s).unwrap_or_default();
    format!(
        r#"# nightshift-demo's agent
coordinator = {coordinator}
node = {node}
work_dir = {work_dir}
readiness_listen = "127.0.0.1:{readiness_port}"
api_listen = "127.0.0.1:{api_port}"
readiness_grace_s = 0.5
drain_timeout_s = 60.0
free_timeout_s = 10.0
health_timeout_s = 120.0

[gpus]
fake = 4

[replica]
image = {image}
host_ip = "127.0.0.1"
host_port = 0
shutdown_timeout_s = 30.0
env = [
    # A model load of 3 s, so that the cold start shows on the timeline.
    "STANDIN_LOAD_DELAY_MS=3000",
    "STANDIN_TOKEN_LATENCY_MS=10",
    "STANDIN_MAX_NUM_SEQS=16",
    "STANDIN_SHUTDOWN_TIMEOUT_S=30",
]
"#,
        coordinator = quoted(coordinator),
        node = quoted(node),
        work_dir = quoted(&work_dir.to_string_lossy()),
        image = quoted(&standin_image(VLLM_STANDIN)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_config_quotes_what_it_is_given() {
        let text = agent_toml_text(
            "http://127.0.0.1:1",
            "demo-1",
            Path::new("/tmp/a \"b\""),
            2,
            3,
        );
        assert!(text.contains("work_dir = \"/tmp/a \\\"b\\\"\"\n"), "{text}");
        assert!(text.contains("api_listen = \"127.0.0.1:3\"\n"), "{text}");
        assert!(text.contains("[gpus]\nfake = 4\n"), "{text}");
    }

    #[test]
    fn missing_programs_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let binaries = Binaries {
            coordinator: dir.path().join(COORDINATOR_BIN),
            agent: dir.path().join(AGENT_BIN),
        };
        assert_eq!(binaries.missing().len(), 2);
        std::fs::write(&binaries.coordinator, "").unwrap();
        assert_eq!(binaries.missing(), [binaries.agent.as_path()]);
    }
}
