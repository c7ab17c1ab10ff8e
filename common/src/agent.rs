//! The agent protocol: register, heartbeat, desired state.
//!
//! The agent speaks first and always: it registers once, then sends a [`Heartbeat`] every
//! second with what it observes, and long-polls `GET /v1/agents/{node}/desired?after=V` so
//! that a new decision reaches it in milliseconds. The coordinator answers with the node's
//! [`DesiredNode`] and its version; the agent reconciles towards it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{JobSpec, UnixMillis};

/// One GPU as the agent found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    pub node: String,
    pub gpus: Vec<GpuInfo>,
    /// The service whose replica this node hosts.
    pub service: String,
    /// The address other nodes reach this one at (gang rendezvous); the node name when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Where the load balancer's health check for this node's replica answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_url: Option<String>,
    /// The agent's own base URL (job logs at `/v1/jobs/ID/logs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_url: Option<String>,
    /// Where the agent's own metrics answer (`http://host:port/metrics`): the target the
    /// coordinator's service discovery (`/v1/nodes/http_sd`) gives Prometheus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_url: Option<String>,
    pub agent_version: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterReply {
    pub node: String,
    pub heartbeat_interval_ms: u64,
    pub lease_ttl_ms: u64,
}

/// What the agent sees on its host, sent every heartbeat interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    pub gpus: Vec<GpuStatus>,
    pub replica: ReplicaStatus,
    pub jobs: Vec<JobRun>,
    /// The version of the desired state the agent has finished applying.
    pub applied_version: u64,
    /// Recently finished phases of drain and reclaim sequences; the coordinator keeps those
    /// with a `seq` it has not seen yet, so resending is harmless.
    #[serde(default)]
    pub phases: Vec<PhaseRecord>,
    /// Leases the agent stopped on its own because it could not renew them in time (the
    /// fail-safe): their jobs were checkpointed and stopped and the node serves again. The
    /// agent refuses these leases from then on and lists them until the coordinator no
    /// longer grants them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expired_leases: Vec<u64>,
    /// Facts about the host (CPU, memory, the checkpoint volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostFacts>,
    /// The agent's base URL, as at registration (so a restarted coordinator knows it too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_url: Option<String>,
    /// Where its metrics answer, as at registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_url: Option<String>,
}

/// The host's resources as the agent sees them.
impl Heartbeat {
    /// A report of `replica` and `jobs` by an agent that applied `applied_version`, and
    /// nothing more (no GPU status, phase, host facts or URL): what stand-in agents send.
    pub fn report(replica: ReplicaStatus, jobs: Vec<JobRun>, applied_version: u64) -> Self {
        Self {
            gpus: Vec::new(),
            replica,
            jobs,
            applied_version,
            phases: Vec::new(),
            expired_leases: Vec::new(),
            host: None,
            agent_url: None,
            metrics_url: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HostFacts {
    pub cpus: u32,
    /// Busy share of all CPUs since the previous heartbeat, 0 to 100.
    pub cpu_usage_percent: f64,
    pub memory_total_bytes: u64,
    pub memory_available_bytes: u64,
    /// The volume holding the agent's `work_dir` (job checkpoints and outputs).
    pub checkpoint_volume_total_bytes: Option<u64>,
    pub checkpoint_volume_free_bytes: Option<u64>,
    /// Where this agent keeps jobs' checkpoints: with `local` (and from agents that predate
    /// the field) the node holds the checkpoint of each job it ran, and only it can resume
    /// it; with `shared` every host mounts them, and with `object` every host reaches the
    /// same bucket, so any may.
    #[serde(default, skip_serializing_if = "CheckpointStorage::is_local")]
    pub checkpoint_storage: CheckpointStorage,
}

/// Where an agent keeps jobs' checkpoint directories (its `[checkpoints] storage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CheckpointStorage {
    /// Under the agent's `work_dir`, on the host that ran the job.
    #[default]
    Local,
    /// On a directory every host mounts at the same path.
    Shared,
    /// In an S3-compatible bucket every host reaches: restored into the attempt's local
    /// directory before it starts, uploaded after its container stops.
    Object,
}

impl CheckpointStorage {
    pub fn is_local(&self) -> bool {
        *self == Self::Local
    }
}

/// One GPU's state at a heartbeat. Every reading after `healthy` is optional: a GPU or driver
/// that does not support it (NVML's `NotSupported`) leaves it out, and it means "unknown",
/// never zero. Agents that predate a field simply omit it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GpuStatus {
    pub index: u32,
    pub memory_used_bytes: u64,
    /// False when the GPU must not be leased: lost, needing a reset, a critical XID event,
    /// uncorrectable ECC errors or retired pages pending. The coordinator never places a job
    /// on an unhealthy GPU.
    pub healthy: bool,
    /// Why `healthy` is false, for operators (`xid 79: ...`, `2 volatile uncorrectable ecc
    /// errors`); absent when healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_reason: Option<String>,
    /// Share of the last sample period in which a kernel ran, 0 to 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_gpu_percent: Option<u32>,
    /// Share of the last sample period in which device memory was read or written, 0 to 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_memory_percent: Option<u32>,
    /// Power draw in milliwatts, as NVML reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_milliwatts: Option<u32>,
    /// GPU die temperature in degrees Celsius.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_celsius: Option<u32>,
    /// The compute processes on the GPU; `None` when they cannot be listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<Vec<GpuProcess>>,
}

/// A process that holds a GPU context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GpuProcess {
    /// In the host's PID namespace.
    pub pid: u32,
    /// `None` where the driver does not say (NVML's "value not available").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_memory_bytes: Option<u64>,
}

impl GpuStatus {
    /// A healthy GPU with `memory_used_bytes` in use and no other reading.
    pub fn healthy(index: u32, memory_used_bytes: u64) -> Self {
        Self {
            index,
            memory_used_bytes,
            healthy: true,
            ..Self::default()
        }
    }

    /// An unhealthy GPU, and why.
    pub fn unhealthy(index: u32, memory_used_bytes: u64, reason: impl Into<String>) -> Self {
        Self {
            index,
            memory_used_bytes,
            healthy: false,
            unhealthy_reason: Some(reason.into()),
            ..Self::default()
        }
    }
}

/// The life of a vLLM replica on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ReplicaState {
    /// The container runs but `/health` does not answer 200 yet.
    Starting,
    /// Healthy and marked ready on the load-balancer endpoint.
    Serving,
    /// Marked not-ready; waiting for in-flight requests to finish.
    Draining,
    /// No container running: its GPUs are free to lend.
    Stopped,
    /// The container runs but vLLM sleeps (sleep mode): its weights are offloaded, its GPU
    /// memory released, and the GPUs lent; waking it is much faster than a cold start.
    Sleeping,
    /// The container exited on its own or could not be started.
    Failed,
}

impl ReplicaState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Serving => "serving",
            Self::Draining => "draining",
            Self::Stopped => "stopped",
            Self::Sleeping => "sleeping",
            Self::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReplicaStatus {
    pub state: ReplicaState,
    pub signals: ServingSignals,
    /// Where clients reach the replica (service discovery), once its container runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// A replica's load as vLLM reports it. `None` means unknown (no scrape, a bad page, a
/// missing metric), which is never read as zero.
impl ReplicaStatus {
    /// A replica in `state` with no request running or waiting and its KV cache empty.
    pub fn idle(state: ReplicaState) -> Self {
        Self {
            state,
            signals: ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                ..ServingSignals::default()
            },
            url: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ServingSignals {
    pub requests_running: Option<f64>,
    pub requests_waiting: Option<f64>,
    pub kv_cache_usage: Option<f64>,
    /// Prompt tokens per second over the agent's window (counter resets are handled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_per_s: Option<f64>,
    /// Generated tokens per second over the agent's window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation_tokens_per_s: Option<f64>,
    /// Time to first token, median over the window, from histogram deltas, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p50_s: Option<f64>,
    /// Time to first token, 95th percentile over the window, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p95_s: Option<f64>,
    /// How many engine cores (`engine` label values) the replica runs; unknown on V0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engines: Option<u32>,
    /// `vllm:engine_sleep_state`: `awake`, `weights_offloaded` or `discard_all`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep_state: Option<String>,
}

/// A job container on the node as the agent observes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobRun {
    pub job_id: u64,
    pub attempt: u32,
    pub lease_id: u64,
    pub epoch: u64,
    pub gpus: Vec<u32>,
    pub state: JobRunState,
    /// When the job last wrote to its checkpoint directory (the newest file's mtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint_at: Option<UnixMillis>,
    /// Output parameters the job wrote to its output directory, read after it exited.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outputs: BTreeMap<String, String>,
    /// The ID (`sha256:...`, the digest of the image's configuration) of the image the
    /// container was created from: what the job's image name resolved to at launch. Docker
    /// keeps it through `docker save` / `docker load`, and creates a container from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
    /// The image pinned to its registry digest (`repo@sha256:...`, the digest of its
    /// manifest) when it came from a registry: the reference every later attempt of the job
    /// runs, on any host, so that a tag moved since never changes it. `None` for an image
    /// built or loaded on the host, which no registry knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// While `Pending`: the member could start now, its image being on the host. A gang
    /// member's lease holds it back ([`Rendezvous::wait_for_peers`]) until every member of
    /// its gang has said so.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ready: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case", tag = "state", deny_unknown_fields)]
pub enum JobRunState {
    /// Waiting for the replica to drain and the GPUs to be free.
    Pending,
    Running,
    /// The checkpoint signal was sent; waiting for the grace period.
    Stopping,
    /// The container ended. `stopped_by_agent` is true when the agent stopped it (reclaim,
    /// cancel, a revoked lease) rather than the job ending by itself.
    Exited {
        exit_code: i64,
        stopped_by_agent: bool,
    },
    /// The container could not be created or started. `refused_by_host` is true when the
    /// host refused it for a reason of its own (its checkpoint volume short of space), not
    /// the job's: the coordinator queues the job again without counting a failure.
    FailedToStart {
        message: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        refused_by_host: bool,
    },
}

/// The node's desired state. `serve` and `leases` are exclusive in effect: while any lease
/// is listed, the replica stays down; when `serve` is true and no lease is listed, the
/// agent stops every job container and brings the replica back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DesiredNode {
    pub version: u64,
    pub serve: bool,
    pub leases: Vec<LeaseGrant>,
    /// How long a lease stays valid without a successful heartbeat.
    pub lease_ttl_ms: u64,
}

/// A job's right to use given GPUs of this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LeaseGrant {
    pub lease_id: u64,
    /// Fencing epoch: strictly increasing across all leases ever granted. The agent refuses a
    /// lease whose epoch is lower than one it has already honoured on the same GPU.
    pub epoch: u64,
    pub job_id: u64,
    pub attempt: u32,
    pub gpus: Vec<u32>,
    pub job: JobSpec,
    /// For a gang job: where its members meet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rendezvous: Option<Rendezvous>,
}

/// The rendezvous of a gang job, as torchrun's environment variables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Rendezvous {
    /// `MASTER_ADDR`: the address of the rank-0 node.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// `NNODES`.
    pub nnodes: u32,
    /// `NODE_RANK`.
    pub node_rank: u32,
    /// `NPROC_PER_NODE`: one process per GPU.
    pub nproc_per_node: u32,
    /// True until every member of the gang has reported its image on its host
    /// ([`JobRun::ready`]): the agent pulls the image meanwhile, but neither drains its
    /// replica for the lease nor starts the member, so that no member starts (and waits out
    /// its rendezvous) while another's host is still pulling, or runs on when another's pull
    /// fails. The coordinator bounds the wait (`gang_start_timeout_s`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub wait_for_peers: bool,
}

/// One timed phase of a drain or reclaim sequence on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PhaseRecord {
    /// Increasing. From an agent: per agent process (it starts again at 1 when the agent
    /// restarts, which `instance` tells). From the coordinator (`nightshift nodes`): per
    /// node, across the agent's restarts.
    pub seq: u64,
    /// The agent process that recorded it: chosen at random when the agent starts, so that
    /// the coordinator knows a `seq` that starts again from a restarted agent from an old
    /// one resent. Absent from agents that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<u64>,
    pub sequence: SequenceKind,
    pub phase: String,
    pub started_at: UnixMillis,
    pub duration_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SequenceKind {
    Drain,
    Reclaim,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_status_keeps_the_old_wire_form() {
        let old = r#"{"index":2,"memory_used_bytes":5,"healthy":true}"#;
        let parsed: GpuStatus = serde_json::from_str(old).expect("an old agent's status");
        assert_eq!(parsed, GpuStatus::healthy(2, 5));
        assert_eq!(serde_json::to_string(&parsed).expect("json"), old);
    }

    #[test]
    fn gpu_status_with_readings_and_a_reason_round_trips() {
        let status = GpuStatus {
            utilization_gpu_percent: Some(97),
            utilization_memory_percent: Some(41),
            power_milliwatts: Some(650_000),
            temperature_celsius: Some(71),
            processes: Some(vec![GpuProcess {
                pid: 3117,
                used_memory_bytes: None,
            }]),
            ..GpuStatus::unhealthy(1, 7, "xid 79: the gpu has fallen off the bus")
        };
        let json = serde_json::to_string(&status).expect("json");
        assert_eq!(
            json,
            r#"{"index":1,"memory_used_bytes":7,"healthy":false,"unhealthy_reason":"xid 79: the gpu has fallen off the bus","utilization_gpu_percent":97,"utilization_memory_percent":41,"power_milliwatts":650000,"temperature_celsius":71,"processes":[{"pid":3117}]}"#
        );
        assert_eq!(
            serde_json::from_str::<GpuStatus>(&json).expect("parse"),
            status
        );
        let unknown = r#"{"index":0,"memory_used_bytes":0,"healthy":true,"fan_percent":30}"#;
        let error = serde_json::from_str::<GpuStatus>(unknown).expect_err("unknown field");
        assert!(error.to_string().contains("fan_percent"), "{error}");
    }
}
