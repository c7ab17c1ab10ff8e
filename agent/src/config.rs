//! `agent.toml`: the agent's typed configuration.
//!
//! Loaded from an optional TOML file, then `NIGHTSHIFT_AGENT__*` environment variables (`__`
//! separates nested keys, e.g. `NIGHTSHIFT_AGENT__REPLICA__IMAGE`). Unknown keys are refused.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nightshift_planner::PlanConfig;
use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// The coordinator's base URL; or several, coordinators sharing a PostgreSQL database
    /// (a list, or one string separated by commas), of which the agent follows the leader.
    #[serde(deserialize_with = "one_or_many")]
    pub coordinator: String,
    /// This node's name; the host name when empty.
    pub node: String,
    /// The service whose replica this node hosts.
    pub service: String,
    /// The address other nodes reach this one at, for gang rendezvous; the node name when
    /// empty.
    pub address: String,
    /// Where a gang's rank-0 container publishes its rendezvous port on this host.
    pub rendezvous_bind_ip: String,
    /// Per-job checkpoint and output directories live under `work_dir/jobs/ID/`.
    pub work_dir: PathBuf,
    /// Where the load balancer's health check (`GET /ready`) answers, over plain HTTP, to
    /// anyone; it carries no job data.
    pub readiness_listen: SocketAddr,
    /// Where the coordinator reads job logs (`GET /v1/jobs/ID/logs`) and what the agent sees
    /// (`GET /status`). With `[tls]` (CA, certificate, key): HTTPS, to the coordinator's
    /// certificate only, on `0.0.0.0:7402` when unset. Without: plain HTTP to anyone who
    /// reaches it, so `127.0.0.1:7402` when unset (a coordinator on another host then cannot
    /// show logs); see [`AgentConfig::api_addr`].
    pub api_listen: Option<SocketAddr>,
    /// Where the agent's own metrics (`GET /metrics`) answer; on `readiness_listen` when
    /// unset.
    pub metrics_listen: Option<SocketAddr>,
    /// The host name or address the coordinator reaches this agent at; the listen address
    /// when it is a specific one, else the host name.
    pub advertise_host: Option<String>,
    /// After turning not-ready, how long to wait before watching the queue, so that the load
    /// balancer's health check has noticed (set it above the check interval).
    pub readiness_grace_s: f64,
    /// Longest wait for in-flight requests to finish before the replica is stopped anyway.
    pub drain_timeout_s: f64,
    /// Longest wait for NVML to show a GPU's memory free after its container stopped.
    pub free_timeout_s: f64,
    /// A GPU counts as free when at most this much of its memory is in use.
    pub free_memory_bytes: u64,
    /// Longest wait for a starting replica's `/health` to answer 200.
    pub health_timeout_s: f64,
    /// A job is not started while the filesystem holding `work_dir` (its checkpoints) has
    /// less than this free; the lease is reported as failed to start, with the figures.
    pub checkpoint_min_free_bytes: u64,
    pub gpus: GpuConfig,
    /// The container engine the agent drives.
    pub engine: EngineConfig,
    pub replica: ReplicaConfig,
    /// Mutual TLS with the coordinator (an `https://` coordinator needs it).
    pub tls: crate::tls::AgentTlsConfig,
    pub failsafe: FailsafeConfig,
    /// Where jobs' checkpoint directories live.
    pub checkpoints: CheckpointsConfig,
    /// Credentials for pulling images, per registry.
    pub registry: crate::engine::registry::RegistryConfig,
}

/// Where jobs' checkpoint directories live: on this host, or on storage every host mounts.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointsConfig {
    pub storage: CheckpointStorage,
    /// With `storage = "shared"`: a directory mounted at this same path on every host (NFS,
    /// Lustre, ...); checkpoints live under `shared_dir/jobs/ID/checkpoints/EPOCH`.
    pub shared_dir: Option<PathBuf>,
    /// With `storage = "object"`: the S3-compatible bucket (`[checkpoints.object]`); each
    /// attempt's directory stays under `work_dir`, restored from the bucket before it starts
    /// and uploaded after its container stops (see [`crate::bucket`]).
    pub object: Option<crate::bucket::ObjectConfig>,
}

/// `local`: under `work_dir` on the host that ran the job (a later attempt on another host
/// starts from nothing, so the coordinator prefers the host that holds it); `shared`: under
/// `checkpoints.shared_dir`, which every host mounts at the same path (any host resumes from
/// the newest); `object`: in the bucket of `[checkpoints.object]`, which every host reaches
/// (any host resumes from the newest complete upload). The heartbeat tells the coordinator
/// which.
pub use nightshift_common::CheckpointStorage;

/// What the agent does on its own when the coordinator is silent.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailsafeConfig {
    /// Stop the jobs and serve again when the leases cannot be renewed in time. Off, jobs
    /// keep running on expired leases (logged as an error once per silence).
    pub enabled: bool,
    /// How long the coordinator may be silent before the fail-safe acts; the lease TTL the
    /// coordinator announced when unset (a shorter value acts before the leases expire).
    pub silence_s: Option<f64>,
}

impl Default for FailsafeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            silence_s: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// Run on this many fake GPUs instead of NVML (hosts without a driver, tests, demos).
    pub fake: Option<u32>,
    /// The NVML library to load; `libnvidia-ml.so.1` from the loader's path when unset.
    pub nvml_library: Option<PathBuf>,
}

/// The container engine (Docker) the agent drives.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// The Docker daemon's socket, `unix:///PATH`; when unset, `DOCKER_HOST` when it is a
    /// `unix://` address, else `unix:///var/run/docker.sock` (see [`EngineConfig::host`]).
    pub docker_host: Option<String>,
}

impl EngineConfig {
    /// The socket to connect to, `None` meaning Docker's usual places (`DOCKER_HOST`, then
    /// the default socket).
    pub fn host(&self) -> Option<&str> {
        self.docker_host.as_deref()
    }
}

/// The vLLM container this node serves with.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicaConfig {
    pub image: String,
    /// Container name; `nightshift-replica-NODE` when empty.
    pub name: String,
    /// Replaces the image's command (vLLM's arguments).
    pub args: Vec<String>,
    /// `NAME=value` pairs.
    pub env: Vec<String>,
    /// The port vLLM listens on inside the container (on the host's network: on the host).
    pub port: u16,
    /// Where the port is published on the host, and the address the agent reaches vLLM at
    /// (loopback when it is `0.0.0.0` or `::`).
    pub host_ip: String,
    /// 0 lets Docker choose (tests and demos). On the host's network there is nothing to
    /// publish: 0 or `port`.
    pub host_port: u16,
    /// The container's network: `bridge` (its own, `port` published at `host_ip:host_port`
    /// through Docker's proxy) or `host` (the host's own, no proxy). On the host's network a
    /// replica that is loading or stopped refuses connections; through the proxy they are
    /// accepted and then reset, which a balancer with passive checks only (open-source nginx)
    /// does not retry for a POST (docs/LOAD_BALANCER.md).
    pub network: ReplicaNetwork,
    /// How long vLLM gets to finish in-flight requests after SIGTERM before it is killed;
    /// match vLLM's `--shutdown-timeout`.
    pub shutdown_timeout_s: f64,
    /// How the replica gives its GPUs back when the node is lent: `stop` the container, or
    /// put vLLM to `sleep` (needs `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1`), which
    /// falls back to stopping when sleeping frees too little memory.
    pub reclaim: ReclaimMode,
    /// vLLM sleep level: 1 offloads the weights to CPU memory (fast wake), 2 discards them.
    pub sleep_level: u8,
    /// Longest wait for `/sleep?mode=wait` (in-flight requests finish first) to answer.
    pub sleep_timeout_s: f64,
    /// A sleeping replica may keep at most this much memory on each GPU (vLLM keeps its CUDA
    /// context, about 1.2 to 1.4 GiB); more, and the container is stopped instead.
    pub sleep_max_used_bytes: u64,
    /// How long after the sleep NVML may take to show the memory released.
    pub sleep_free_timeout_s: f64,
}

/// The replica container's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaNetwork {
    /// Its own network namespace; Docker publishes the port.
    #[default]
    Bridge,
    /// The host's network namespace: vLLM's port is a port of the host.
    Host,
}

/// How the replica gives its GPUs back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReclaimMode {
    /// Stop the container; start it again on reclaim (a cold start).
    #[default]
    Stop,
    /// vLLM sleep mode; `wake_up` on reclaim.
    Sleep,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            coordinator: "http://127.0.0.1:7400".into(),
            node: String::new(),
            service: "default".into(),
            address: String::new(),
            rendezvous_bind_ip: "0.0.0.0".into(),
            work_dir: PathBuf::from("/var/lib/nightshift/agent"),
            readiness_listen: SocketAddr::from(([0, 0, 0, 0], 7401)),
            api_listen: None,
            metrics_listen: None,
            advertise_host: None,
            readiness_grace_s: 5.0,
            drain_timeout_s: 120.0,
            free_timeout_s: 30.0,
            free_memory_bytes: 1 << 30,
            health_timeout_s: 900.0,
            checkpoint_min_free_bytes: 1 << 30,
            gpus: GpuConfig::default(),
            engine: EngineConfig::default(),
            replica: ReplicaConfig::default(),
            tls: crate::tls::AgentTlsConfig::default(),
            failsafe: FailsafeConfig::default(),
            checkpoints: CheckpointsConfig::default(),
            registry: Default::default(),
        }
    }
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            image: "vllm/vllm-openai:latest".into(),
            name: String::new(),
            args: Vec::new(),
            env: Vec::new(),
            port: 8000,
            host_ip: "0.0.0.0".into(),
            host_port: 8000,
            network: ReplicaNetwork::Bridge,
            shutdown_timeout_s: 60.0,
            reclaim: ReclaimMode::Stop,
            sleep_level: 1,
            sleep_timeout_s: 300.0,
            sleep_max_used_bytes: 2 << 30,
            sleep_free_timeout_s: 10.0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Load(#[from] config::ConfigError),
    /// The file on its own: every syntax error, wrong type and unknown key, with its line.
    #[error("{0}")]
    File(#[from] nightshift_configfile::FileError),
    /// A rule broken by a key of the file, at its line.
    #[error("{0}")]
    Located(nightshift_configfile::Problem),
    #[error("{key}: {rule}")]
    Invalid { key: &'static str, rule: String },
}

impl AgentConfig {
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        nightshift_configfile::load(file, "NIGHTSHIFT_AGENT", |cfg: &Self, lines| {
            cfg.validate().map_err(|e| match (e, lines) {
                (ConfigError::Invalid { key, rule }, Some(lines)) => {
                    ConfigError::Located(lines.problem(key, rule))
                }
                (e, _) => e,
            })
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, rule: &str| {
            Err(ConfigError::Invalid {
                key,
                rule: rule.into(),
            })
        };
        let urls = crate::uplink::coordinator_urls(&self.coordinator);
        if urls.is_empty()
            || !urls
                .iter()
                .all(|u| u.starts_with("http://") || u.starts_with("https://"))
        {
            return invalid(
                "coordinator",
                "must be an http:// or https:// URL, or several (a list, or separated by commas)",
            );
        }
        if self.replica.image.trim().is_empty() {
            return invalid("replica.image", "must not be empty");
        }
        if let Some(bad) = self.replica.env.iter().find(|e| !e.contains('=')) {
            return Err(ConfigError::Invalid {
                key: "replica.env",
                rule: format!("{bad:?} is not NAME=value"),
            });
        }
        for (key, v) in [
            ("readiness_grace_s", self.readiness_grace_s),
            ("drain_timeout_s", self.drain_timeout_s),
            ("free_timeout_s", self.free_timeout_s),
            ("health_timeout_s", self.health_timeout_s),
            (
                "replica.shutdown_timeout_s",
                self.replica.shutdown_timeout_s,
            ),
            ("replica.sleep_timeout_s", self.replica.sleep_timeout_s),
            (
                "replica.sleep_free_timeout_s",
                self.replica.sleep_free_timeout_s,
            ),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return invalid(key, "must be a duration in seconds >= 0");
            }
        }
        if let Some(v) = self.failsafe.silence_s
            && !(v.is_finite() && v > 0.0)
        {
            return invalid("failsafe.silence_s", "must be a duration in seconds > 0");
        }
        match (self.checkpoints.storage, &self.checkpoints.shared_dir) {
            (CheckpointStorage::Shared, None) => {
                return invalid(
                    "checkpoints.storage",
                    "\"shared\" needs checkpoints.shared_dir, the directory every host mounts",
                );
            }
            (CheckpointStorage::Shared, Some(dir)) if !dir.is_absolute() => {
                return Err(ConfigError::Invalid {
                    key: "checkpoints.shared_dir",
                    rule: format!(
                        "{} is not an absolute path (every host must mount it at the same one)",
                        dir.display()
                    ),
                });
            }
            (CheckpointStorage::Local | CheckpointStorage::Object, Some(_)) => {
                return invalid(
                    "checkpoints.shared_dir",
                    "is read only with checkpoints.storage = \"shared\"",
                );
            }
            _ => {}
        }
        match (self.checkpoints.storage, &self.checkpoints.object) {
            (CheckpointStorage::Object, None) => {
                return invalid(
                    "checkpoints.storage",
                    "\"object\" needs [checkpoints.object]: endpoint, bucket, credentials_file",
                );
            }
            (CheckpointStorage::Object, Some(object)) => {
                if let Err(e) = object.check() {
                    return Err(ConfigError::Invalid {
                        key: e.key,
                        rule: e.reason,
                    });
                }
            }
            (_, Some(_)) => {
                return invalid(
                    "checkpoints.object",
                    "is read only with checkpoints.storage = \"object\"",
                );
            }
            (_, None) => {}
        }
        // Read now, so that a bad file stops the agent at start rather than its first pull.
        if let Err(e) = self.registry.credentials() {
            return Err(ConfigError::Invalid {
                key: "registry.auth_file",
                rule: e.to_string(),
            });
        }
        if let Some(host) = &self.engine.docker_host {
            match host.strip_prefix("unix://") {
                Some(path) if path.starts_with('/') && path.len() > 1 => {}
                _ => {
                    return Err(ConfigError::Invalid {
                        key: "engine.docker_host",
                        rule: format!(
                            "{host:?} is not a unix:///PATH address (the agent drives the \
                             docker daemon of its own host, through its socket)"
                        ),
                    });
                }
            }
        }
        if !matches!(self.replica.sleep_level, 1 | 2) {
            return invalid("replica.sleep_level", "must be 1 or 2");
        }
        if self.replica.network == ReplicaNetwork::Host
            && self.replica.host_port != 0
            && self.replica.host_port != self.replica.port
        {
            return Err(ConfigError::Invalid {
                key: "replica.host_port",
                rule: format!(
                    "must be 0 or equal to replica.port ({}) when replica.network is \"host\": \
                     the replica listens on the host's own port",
                    self.replica.port
                ),
            });
        }
        Ok(())
    }

    /// Where the agent's API (job logs, `/status`) listens: `api_listen`, else port 7402 on
    /// every address with `[tls]` (only the coordinator's certificate is answered) and on
    /// loopback without (nothing asks for credentials there).
    pub fn api_addr(&self) -> SocketAddr {
        self.api_listen.unwrap_or_else(|| {
            let ip = if self.tls.serves_tls() {
                [0, 0, 0, 0]
            } else {
                [127, 0, 0, 1]
            };
            SocketAddr::from((ip, 7402))
        })
    }

    /// The directory under which jobs' checkpoint directories live (`ROOT/jobs/ID/...`):
    /// `checkpoints.shared_dir` with shared storage, else `work_dir`.
    pub fn checkpoint_root(&self) -> &Path {
        match (self.checkpoints.storage, &self.checkpoints.shared_dir) {
            (CheckpointStorage::Shared, Some(dir)) => dir,
            _ => &self.work_dir,
        }
    }

    /// The node name, defaulting to the host name.
    pub fn node_name(&self) -> String {
        if !self.node.is_empty() {
            return self.node.clone();
        }
        std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into())
    }

    pub fn replica_name(&self, node: &str) -> String {
        if self.replica.name.is_empty() {
            format!("nightshift-replica-{node}")
        } else {
            self.replica.name.clone()
        }
    }
}

/// The planner's part of the configuration, as plain values.
impl AgentConfig {
    /// What the planner reads: its timeouts, limits and modes. The durations were checked
    /// finite and not negative by [`AgentConfig::validate`].
    pub fn plan_config(&self) -> PlanConfig {
        PlanConfig {
            readiness_grace: Duration::from_secs_f64(self.readiness_grace_s),
            drain_timeout: Duration::from_secs_f64(self.drain_timeout_s),
            free_timeout: Duration::from_secs_f64(self.free_timeout_s),
            free_memory_bytes: self.free_memory_bytes,
            health_timeout: Duration::from_secs_f64(self.health_timeout_s),
            checkpoint_min_free_bytes: self.checkpoint_min_free_bytes,
            work_dir: self.checkpoint_root().to_owned(),
            replica_stop_grace: Duration::from_secs_f64(self.replica.shutdown_timeout_s),
            reclaim: match self.replica.reclaim {
                ReclaimMode::Stop => nightshift_planner::ReclaimMode::Stop,
                ReclaimMode::Sleep => nightshift_planner::ReclaimMode::Sleep,
            },
            sleep_max_used_bytes: self.replica.sleep_max_used_bytes,
            sleep_free_timeout: Duration::from_secs_f64(self.replica.sleep_free_timeout_s),
            failsafe: self.failsafe.enabled,
            failsafe_silence: self.failsafe.silence_s.map(Duration::from_secs_f64),
        }
    }
}

/// A string, or a list of strings joined with commas (`coordinator`).
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => s,
        OneOrMany::Many(v) => v.join(","),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_planner_reads_the_same_defaults() {
        assert_eq!(AgentConfig::default().plan_config(), PlanConfig::default());
        let mut cfg = AgentConfig::default();
        cfg.replica.reclaim = ReclaimMode::Sleep;
        cfg.readiness_grace_s = 0.25;
        cfg.failsafe.silence_s = Some(1.5);
        let plan = cfg.plan_config();
        assert_eq!(plan.reclaim, nightshift_planner::ReclaimMode::Sleep);
        assert_eq!(plan.readiness_grace, Duration::from_millis(250));
        assert_eq!(plan.failsafe_silence, Some(Duration::from_millis(1_500)));
    }

    #[test]
    fn a_file_and_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "node = \"gpu-01\"\n[gpus]\nfake = 4\n[replica]\nimage = \"v:1\"\n",
        )
        .unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(
            (cfg.node_name(), cfg.gpus.fake),
            ("gpu-01".to_owned(), Some(4))
        );
        std::fs::write(&path, "[replica]\nimgae = \"v:1\"\n").unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("imgae"), "{err}");
    }

    #[test]
    fn coordinator_is_one_url_or_several() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        let load = |text: &str| {
            std::fs::write(&path, format!("{text}\n[replica]\nimage = \"v:1\"\n")).unwrap();
            AgentConfig::load(Some(&path))
        };
        let one = load("coordinator = \"http://a:7400\"").unwrap();
        assert_eq!(one.coordinator, "http://a:7400");
        let list = load("coordinator = [\"http://a:7400\", \"https://b:7400\"]").unwrap();
        assert_eq!(list.coordinator, "http://a:7400,https://b:7400");
        assert_eq!(
            crate::uplink::coordinator_urls(&list.coordinator),
            ["http://a:7400", "https://b:7400"]
        );
        let commas = load("coordinator = \"http://a:7400, http://b:7400\"").unwrap();
        assert_eq!(
            crate::uplink::coordinator_urls(&commas.coordinator),
            ["http://a:7400", "http://b:7400"]
        );
        let err = load("coordinator = [\"http://a:7400\", \"b:7400\"]")
            .unwrap_err()
            .to_string();
        assert!(err.contains("coordinator"), "{err}");
    }

    #[test]
    fn a_bad_file_names_file_key_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "node = \"gpu-01\"\ndrain_timeout_s = \"soon\"\n[replica]\nport = 70000\nenv = [\"NOEQUALS\"]\n",
        )
        .unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        let file = path.display();
        assert_eq!(
            err,
            format!(
                "{file}: line 2: drain_timeout_s: invalid type: string \"soon\", expected f64\n\
                 {file}: line 4: replica.port: invalid value: integer `70000`, expected u16"
            )
        );
        // Once the types are right, a rule checked after loading is placed at its line too.
        std::fs::write(&path, "[replica]\nenv = [\"NOEQUALS\"]\n").unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("{file}: line 2: replica.env: \"NOEQUALS\" is not NAME=value")
        );
    }

    #[test]
    fn reclaim_mode_and_sleep_level() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(&path, "[replica]\nreclaim = \"sleep\"\nsleep_level = 1\n").unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.replica.reclaim, ReclaimMode::Sleep);
        std::fs::write(&path, "[replica]\nreclaim = \"nap\"\n").unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("nap"), "{err}");
        let mut cfg = AgentConfig::default();
        cfg.replica.sleep_level = 3;
        assert_eq!(
            cfg.validate().unwrap_err().to_string(),
            "replica.sleep_level: must be 1 or 2"
        );
    }

    #[test]
    fn host_network_takes_the_port_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "[replica]\nnetwork = \"host\"\nport = 8001\nhost_port = 0\n",
        )
        .unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.replica.network, ReplicaNetwork::Host);
        assert_eq!(
            AgentConfig::default().replica.network,
            ReplicaNetwork::Bridge
        );
        // A published port that differs from the one vLLM listens on cannot be honoured.
        std::fs::write(
            &path,
            "[replica]\nnetwork = \"host\"\nport = 8001\nhost_port = 8000\n",
        )
        .unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: line 4: replica.host_port: must be 0 or equal to replica.port (8001) when \
                 replica.network is \"host\": the replica listens on the host's own port",
                path.display()
            )
        );
        std::fs::write(&path, "[replica]\nnetwork = \"overlay\"\n").unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("overlay"), "{err}");
    }

    #[test]
    fn the_agent_api_is_on_loopback_unless_tls_guards_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(&path, "[replica]\nimage = \"v:1\"\n").unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.api_addr().to_string(), "127.0.0.1:7402");
        assert_eq!(cfg.metrics_listen, None);
        std::fs::write(
            &path,
            "metrics_listen = \"10.0.0.5:9101\"\n[tls]\nca_file = \"ca.pem\"\n\
             cert_file = \"n.pem\"\nkey_file = \"n.key\"\n",
        )
        .unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.api_addr().to_string(), "0.0.0.0:7402");
        assert_eq!(cfg.metrics_listen, Some("10.0.0.5:9101".parse().unwrap()));
        std::fs::write(&path, "api_listen = \"0.0.0.0:9\"\n").unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.api_addr().to_string(), "0.0.0.0:9");
    }

    #[test]
    fn checkpoints_are_local_unless_a_shared_dir_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(&path, "work_dir = \"/w\"\n").unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.checkpoints.storage, CheckpointStorage::Local);
        assert_eq!(cfg.checkpoint_root(), Path::new("/w"));
        std::fs::write(
            &path,
            "work_dir = \"/w\"\n[checkpoints]\nstorage = \"shared\"\nshared_dir = \"/mnt/ckpt\"\n",
        )
        .unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.checkpoints.storage, CheckpointStorage::Shared);
        assert_eq!(cfg.checkpoint_root(), Path::new("/mnt/ckpt"));

        let file = path.display();
        let err = |text: &str| {
            std::fs::write(&path, text).unwrap();
            AgentConfig::load(Some(&path)).unwrap_err().to_string()
        };
        assert_eq!(
            err("[checkpoints]\nstorage = \"shared\"\n"),
            format!(
                "{file}: line 2: checkpoints.storage: \"shared\" needs checkpoints.shared_dir, \
                 the directory every host mounts"
            )
        );
        assert_eq!(
            err("[checkpoints]\nstorage = \"shared\"\nshared_dir = \"ckpt\"\n"),
            format!(
                "{file}: line 3: checkpoints.shared_dir: ckpt is not an absolute path (every \
                 host must mount it at the same one)"
            )
        );
        assert_eq!(
            err("[checkpoints]\nshared_dir = \"/mnt/ckpt\"\n"),
            format!(
                "{file}: line 2: checkpoints.shared_dir: is read only with \
                 checkpoints.storage = \"shared\""
            )
        );
        let e = err("[checkpoints]\nstorage = \"s3\"\n");
        assert!(e.contains("line 2") && e.contains("s3"), "{e}");
    }

    #[test]
    fn object_storage_needs_a_bucket_and_a_credentials_file_and_names_the_bad_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        let creds = dir.path().join("s3.credentials");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = AKID\naws_secret_access_key = hush-hush\n",
        )
        .unwrap();
        let good = format!(
            "[checkpoints]\nstorage = \"object\"\n[checkpoints.object]\n\
             endpoint = \"http://127.0.0.1:9000\"\nbucket = \"ckpt\"\nprefix = \"team\"\n\
             credentials_file = {:?}\n",
            creds.display().to_string()
        );
        std::fs::write(&path, &good).unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.checkpoints.storage, CheckpointStorage::Object);
        let object = cfg.checkpoints.object.as_ref().unwrap();
        assert_eq!(
            (object.region.as_str(), object.key_prefix()),
            ("us-east-1", "team/".into())
        );
        assert_eq!(
            cfg.checkpoint_root(),
            cfg.work_dir,
            "attempt directories stay local"
        );

        let file = path.display();
        let err = |text: &str| {
            std::fs::write(&path, text).unwrap();
            AgentConfig::load(Some(&path)).unwrap_err().to_string()
        };
        assert_eq!(
            err("[checkpoints]\nstorage = \"object\"\n"),
            format!(
                "{file}: line 2: checkpoints.storage: \"object\" needs [checkpoints.object]: \
                 endpoint, bucket, credentials_file"
            )
        );
        let e = err(&good.replace("http://127.0.0.1:9000", "ftp://x"));
        assert!(
            e.contains("checkpoints.object.endpoint: \"ftp://x\" is not an http"),
            "{e}"
        );
        let e = err(&good.replace("\"ckpt\"", "\"No_Such\""));
        assert!(e.contains("checkpoints.object.bucket:"), "{e}");
        let e = err(&good.replace("s3.credentials", "missing.credentials"));
        assert!(
            e.contains("checkpoints.object.credentials_file:") && e.contains("missing.credentials"),
            "{e}"
        );
        std::fs::write(&creds, "[default]\naws_access_key_id = AKID\n").unwrap();
        let e = err(&good);
        assert!(
            e.contains("checkpoints.object.credentials_file:")
                && e.contains("no aws_secret_access_key"),
            "{e}"
        );
        assert!(!e.contains("AKID"), "{e}");
        let e = err(&good.replace("\"object\"\n", "\"local\"\n"));
        assert!(
            e.contains("checkpoints.object: is read only with checkpoints.storage = \"object\""),
            "{e}"
        );
    }

    #[test]
    fn the_docker_socket_is_named_in_the_engine_section() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(&path, "node = \"n\"\n").unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.engine.host(), None);
        std::fs::write(
            &path,
            "node = \"n\"\n[engine]\ndocker_host = \"unix:///run/user/1000/docker.sock\"\n",
        )
        .unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        assert_eq!(cfg.engine.host(), Some("unix:///run/user/1000/docker.sock"));

        let file = path.display();
        for bad in [
            "tcp://10.0.0.1:2375",
            "/run/docker.sock",
            "unix://",
            "unix://run/d.sock",
        ] {
            std::fs::write(
                &path,
                format!("node = \"n\"\n[engine]\ndocker_host = {bad:?}\n"),
            )
            .unwrap();
            let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "{file}: line 3: engine.docker_host: {bad:?} is not a unix:///PATH address \
                     (the agent drives the docker daemon of its own host, through its socket)"
                )
            );
        }
        std::fs::write(&path, "[engine]\ndocker_hots = \"unix:///d.sock\"\n").unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert!(
            err.contains("line 2") && err.contains("docker_hots"),
            "{err}"
        );
    }

    #[test]
    fn bad_env_pair_is_named() {
        let mut cfg = AgentConfig::default();
        cfg.replica.env = vec!["NOEQUALS".into()];
        assert_eq!(
            cfg.validate().unwrap_err().to_string(),
            "replica.env: \"NOEQUALS\" is not NAME=value"
        );
    }

    #[test]
    fn a_bad_registry_auth_file_stops_the_load_at_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let (path, auth) = (dir.path().join("agent.toml"), dir.path().join("auth.json"));
        std::fs::write(
            &path,
            format!(
                "node = \"n\"\n[registry]\nauth_file = {:?}\n",
                auth.display().to_string()
            ),
        )
        .unwrap();
        std::fs::write(&auth, r#"{"auths": {"r:5000": {"auth": "dTpw"}}}"#).unwrap();
        let cfg = AgentConfig::load(Some(&path)).unwrap();
        let a = cfg.registry.auth_for("r:5000/x:1").unwrap().unwrap();
        assert_eq!((a.username.as_str(), a.password.as_str()), ("u", "p"));
        std::fs::write(&auth, r#"{"auths": {"r:5000": {"auth": "!!"}}}"#).unwrap();
        let err = AgentConfig::load(Some(&path)).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: line 3: registry.auth_file: {}: registry r:5000: auth is not base64 of USER:PASSWORD",
                path.display(),
                auth.display()
            )
        );
        assert!(!err.contains("dTpw"));
    }
}
