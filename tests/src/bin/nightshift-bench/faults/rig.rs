//! The cluster rig as the fault harness drives it: `tests/cluster/up.sh` and `down.sh`, the
//! processes it started (agents, engines, the coordinator), the links of its hosts, and what
//! each part says (the API, each host's engine, each agent's readiness).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bollard::Docker;
use bollard::models::ContainerSummaryStateEnum as State;
use bollard::query_parameters::ListContainersOptionsBuilder;
use nightshift_cli::client::Client;
use nightshift_common::labels;

/// Where tests/cluster/lib.sh keeps everything (`NSC_STATE`).
pub const STATE: &str = "/var/lib/nightshift-cluster";
/// Size in MiB of the tmpfs holding the hosts' shared checkpoint directory.
pub const CHECKPOINT_MB: u64 = 256;
/// The agents' `checkpoint_min_free_bytes`, in MiB: the checkpoint-full fault fills the
/// volume below it.
pub const CHECKPOINT_MIN_FREE_MB: u64 = 64;
/// The namespace holding the rig's bridge (`NSC_SWITCH`); host i's leg on it is `to-gpuI`.
const SWITCH: &str = "nsc-switch";

/// A container one host's engine reports, reduced to what the invariants need.
#[derive(Debug, Clone)]
pub struct Seen {
    pub id: String,
    pub name: String,
    pub running: bool,
    pub replica: bool,
    pub job: Option<u64>,
    pub lease: Option<u64>,
    pub epoch: Option<u64>,
    pub gpus: Vec<u32>,
}

pub struct Rig {
    pub hosts: usize,
    repo: PathBuf,
    pub api: Client,
    engines: Vec<Docker>,
}

impl Rig {
    /// Brings up a rig of `hosts` hosts with the coordinator's data on a tmpfs of `data_mb`
    /// MiB (so that it can be filled), and connects to it.
    pub fn up(repo: &Path, hosts: usize, data_mb: u32) -> anyhow::Result<Self> {
        if Path::new(STATE).exists() {
            bail!("a cluster rig is already up ({STATE} exists): tests/cluster/down.sh first");
        }
        let status = Command::new("bash")
            .arg(repo.join("tests/cluster/up.sh"))
            .arg(hosts.to_string())
            .env("NSC_COORDINATOR_DATA_MB", data_mb.to_string())
            .env("NSC_CHECKPOINT_MB", CHECKPOINT_MB.to_string())
            .env(
                "NSC_CHECKPOINT_MIN_FREE_MB",
                CHECKPOINT_MIN_FREE_MB.to_string(),
            )
            .stdout(Stdio::null())
            .status()
            .context("running tests/cluster/up.sh")?;
        if !status.success() {
            bail!("tests/cluster/up.sh {hosts} failed ({status})");
        }
        Self::attach(repo, hosts)
    }

    /// Connects to the rig that is up.
    pub fn attach(repo: &Path, hosts: usize) -> anyhow::Result<Self> {
        let env = std::fs::read_to_string(Path::new(STATE).join("env"))
            .context("reading the rig's env file")?;
        let var = |name: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("export {name}=")))
                .map(str::to_owned)
                .with_context(|| format!("{name} is not in the rig's env file"))
        };
        let ca = PathBuf::from(var("NIGHTSHIFT_CA")?);
        let api = Client::with_timeouts(
            &var("NIGHTSHIFT_URL")?,
            Some(&ca),
            Duration::from_secs(2),
            Duration::from_secs(5),
        )?
        .with_token(Some(var("NIGHTSHIFT_TOKEN")?));
        let engines = (1..=hosts)
            .map(|i| {
                Docker::connect_with_unix(&sock(i), 10, bollard::API_DEFAULT_VERSION)
                    .with_context(|| format!("connecting to gpu{i}'s engine"))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            hosts,
            repo: repo.to_owned(),
            api,
            engines,
        })
    }

    /// Removes everything the rig made.
    pub fn down(repo: &Path) -> anyhow::Result<()> {
        let status = Command::new("bash")
            .arg(repo.join("tests/cluster/down.sh"))
            .stdout(Stdio::null())
            .status()
            .context("running tests/cluster/down.sh")?;
        if !status.success() {
            bail!("tests/cluster/down.sh failed ({status}): it names what it left");
        }
        Ok(())
    }

    /// Runs `script` in bash with tests/cluster/lib.sh sourced (its helpers start the rig's
    /// processes exactly as up.sh does).
    async fn lib(&self, script: &str) -> anyhow::Result<()> {
        let lib = self.repo.join("tests/cluster/lib.sh");
        let out = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(format!(". '{}' && {script}", lib.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .await
            .with_context(|| format!("running `{script}`"))?;
        if !out.status.success() {
            bail!(
                "`{script}` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Cuts host `i` off the rig's network (its leg on the switch goes down), or restores it.
    pub async fn link(&self, i: usize, up: bool) -> anyhow::Result<()> {
        let state = if up { "up" } else { "down" };
        run(
            "ip",
            &["-n", SWITCH, "link", "set", &format!("to-gpu{i}"), state],
        )
        .await
    }

    /// Host `i`'s agent's pid, when it runs.
    pub fn agent_pid(&self, i: usize) -> Option<i32> {
        pid_running(&Path::new(STATE).join(format!("gpu{i}/agent.pid")))
    }

    /// The coordinator's pid, when it runs.
    pub fn coordinator_pid(&self) -> Option<i32> {
        pid_running(&Path::new(STATE).join("coordinator/pid"))
    }

    /// Host `i`'s dockerd's pid, when it runs.
    pub fn engine_pid(&self, i: usize) -> Option<i32> {
        pid_running(&Path::new(STATE).join(format!("gpu{i}/dockerd.pid")))
    }

    /// Starts host `i`'s agent as systemd would restart it.
    pub async fn start_agent(&self, i: usize) -> anyhow::Result<()> {
        self.lib(&format!("nsc_agent_start {i}")).await
    }

    /// Starts host `i`'s engine and waits until it answers.
    pub async fn start_engine(&self, i: usize) -> anyhow::Result<()> {
        self.lib(&format!("nsc_engine_start {i} && nsc_engine_wait {i}"))
            .await
    }

    /// Starts the coordinator on its data and waits until `/healthz` answers.
    pub async fn start_coordinator(&self) -> anyhow::Result<()> {
        self.lib("nsc_coordinator_start && nsc_coordinator_wait 30")
            .await
    }

    /// The checkpoint directory every host shares (a tmpfs of [`CHECKPOINT_MB`]).
    pub fn checkpoints(&self) -> PathBuf {
        Path::new(STATE).join("shared/checkpoints")
    }

    /// The coordinator's data directory (a tmpfs of the harness's size).
    pub fn coordinator_data(&self) -> PathBuf {
        Path::new(STATE).join("coordinator/data")
    }

    /// What host `i`'s engine holds; `None` while the engine does not answer.
    pub async fn containers(&self, i: usize) -> Option<Vec<Seen>> {
        let mut filters = std::collections::HashMap::new();
        filters.insert("label".to_owned(), vec![labels::ROLE.to_owned()]);
        let opts = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let list = tokio::time::timeout(
            Duration::from_secs(5),
            self.engines[i - 1].list_containers(Some(opts)),
        )
        .await
        .ok()?
        .ok()?;
        Some(
            list.into_iter()
                .map(|c| {
                    let l: BTreeMap<String, String> =
                        c.labels.unwrap_or_default().into_iter().collect();
                    let num = |k: &str| l.get(k).and_then(|v| v.parse().ok());
                    Seen {
                        id: c.id.unwrap_or_default(),
                        name: c
                            .names
                            .and_then(|n| n.first().cloned())
                            .unwrap_or_default()
                            .trim_start_matches('/')
                            .to_owned(),
                        // A container stopping, paused or restarting still holds its GPUs.
                        running: matches!(
                            c.state,
                            Some(
                                State::RUNNING
                                    | State::PAUSED
                                    | State::RESTARTING
                                    | State::STOPPING
                            )
                        ),
                        replica: l.get(labels::ROLE).map(String::as_str)
                            == Some(labels::ROLE_REPLICA),
                        job: num(labels::JOB_ID),
                        lease: num(labels::LEASE_ID),
                        epoch: num(labels::EPOCH),
                        gpus: l
                            .get(labels::GPUS)
                            .map(|g| g.split(',').filter_map(|s| s.parse().ok()).collect())
                            .unwrap_or_default(),
                    }
                })
                .collect(),
        )
    }

    /// Whether host `i`'s agent says its replica serves (`/ready` answers 200), asked from
    /// inside the host's namespace, so that it answers while the host is cut off.
    pub async fn ready(&self, i: usize) -> bool {
        let url = format!("http://198.18.0.{}:7401/ready", 10 + i);
        let out = tokio::process::Command::new("ip")
            .args(["netns", "exec", &format!("nsc-gpu{i}"), "curl", "-s"])
            .args([
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "1",
                &url,
            ])
            .stdin(Stdio::null())
            .output()
            .await;
        matches!(out, Ok(o) if o.stdout == b"200")
    }
}

/// Host i's engine socket (lib.sh's `nsc_sock`).
fn sock(i: usize) -> String {
    format!("{STATE}/gpu{i}/docker.sock")
}

/// The pid in `file` when that process runs.
fn pid_running(file: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
    alive(pid).then_some(pid)
}

/// Sends `sig` to `pid` and waits up to `within` for it to exit; false when it did not.
pub async fn signal_and_wait(pid: i32, sig: &str, within: Duration) -> anyhow::Result<bool> {
    run("kill", &[&format!("-{sig}"), &pid.to_string()]).await?;
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if !alive(pid) {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(false)
}

/// Whether process `pid` runs: it exists and is not a zombie (exited, not yet reaped by its
/// parent).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, r)| !r.starts_with(['Z', 'X'])))
        .unwrap_or(false)
}

async fn run(cmd: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = tokio::process::Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
