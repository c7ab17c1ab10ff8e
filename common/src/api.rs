//! The coordinator's HTTP API for the CLI and operators: views of jobs and nodes, and errors.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{JobSpec, PhaseRecord, ReplicaStatus, UnixMillis};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    /// Leased GPUs; the agent is draining the replica or starting the container.
    Starting,
    Running,
    /// Its lease was revoked to serve again; it was told to checkpoint and will be requeued.
    Preempting,
    /// Cancelled while it had a lease; waiting for the container to stop.
    Cancelling,
    /// A member of a gang failed; the others are being stopped before a retry or failure.
    Failing,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    /// Every state, in the order above.
    pub const ALL: [JobState; 9] = [
        Self::Queued,
        Self::Starting,
        Self::Running,
        Self::Preempting,
        Self::Cancelling,
        Self::Failing,
        Self::Succeeded,
        Self::Failed,
        Self::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Preempting => "preempting",
            Self::Cancelling => "cancelling",
            Self::Failing => "failing",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// A job as the coordinator knows it. This is also the durable record of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobView {
    pub id: u64,
    pub spec: JobSpec,
    pub state: JobState,
    /// 1 for the first run; raised each time the job is requeued (preempted or retried).
    pub attempt: u32,
    pub preemptions: u32,
    /// Failures so far, counted against `retry.limit`; preemptions never count.
    #[serde(default)]
    pub failures: u32,
    /// A job retried after a failure waits until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<UnixMillis>,
    /// When its container last wrote to its checkpoint directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint_at: Option<UnixMillis>,
    pub submitted_at: UnixMillis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<UnixMillis>,
    /// When the current attempt's container started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_started_at: Option<UnixMillis>,
    /// Milliseconds its ended attempts ran; with the current attempt's time, what counts
    /// against `spec.maxRunSeconds`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ran_ms: u64,
    /// Stopped for running past `spec.maxRunSeconds`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<UnixMillis>,
    /// One lease per node it runs on (one for a single-node job), in rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leases: Vec<LeaseView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outputs: BTreeMap<String, String>,
    /// Why the job is in its state, when that is not obvious (a failure, a refusal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// `spec.image` pinned to its registry digest (`repo@sha256:...`) at the job's first
    /// start: what every later attempt runs. `None` before, and for an image that no
    /// registry knows (built or loaded on the host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// Its latest placements, oldest first (at most the last 20): where each ran, and how it
    /// ended. Empty in records from before they were kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<AttemptView>,
}

impl JobView {
    /// Job `id` as submitted at `submitted_at`: queued for its first attempt, nothing run yet.
    pub fn queued(id: u64, spec: JobSpec, submitted_at: UnixMillis) -> Self {
        Self {
            id,
            spec,
            state: JobState::Queued,
            attempt: 1,
            preemptions: 0,
            failures: 0,
            not_before: None,
            last_checkpoint_at: None,
            submitted_at,
            started_at: None,
            attempt_started_at: None,
            ran_ms: 0,
            timed_out: false,
            finished_at: None,
            leases: Vec::new(),
            exit_code: None,
            outputs: BTreeMap::new(),
            message: None,
            image_digest: None,
            attempts: Vec::new(),
        }
    }
}

/// One placement of a job: the GPUs it was leased, when it ran, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AttemptView {
    /// The job's attempt number it ran as. A placement taken back before its container
    /// started does not raise it, so the next placement has the same number.
    pub attempt: u32,
    /// One per node, in rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<AttemptMember>,
    pub leased_at: UnixMillis,
    /// When its first member's container was seen running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<UnixMillis>,
    /// When its last member was gone; `None` while it holds leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<UnixMillis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ending: Option<AttemptEnding>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    /// Why it ended, when that is not obvious (an exit code, a start failure, a loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Where one member of an attempt ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AttemptMember {
    pub node: String,
    pub gpus: Vec<u32>,
    /// Its lease's fencing epoch.
    pub epoch: u64,
}

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AttemptEnding {
    Succeeded,
    /// Its container exited with an error, or it ran past `maxRunSeconds`.
    Failed,
    /// A member's container could not be started (a missing image, no room for checkpoints).
    FailedToStart,
    /// Taken back so that its nodes serve again, or lost with a node; requeued.
    Preempted,
    Cancelled,
}

impl AttemptEnding {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::FailedToStart => "failed to start",
            Self::Preempted => "preempted",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LeaseView {
    pub lease_id: u64,
    pub epoch: u64,
    /// Its node's rank in a gang (0 for a single-node job).
    #[serde(default)]
    pub rank: u32,
    pub node: String,
    pub gpus: Vec<u32>,
    pub granted_at: UnixMillis,
    pub expires_at: UnixMillis,
    /// Set once the coordinator has taken the lease back.
    pub revoked: bool,
}

/// Whether a node's GPUs serve the service or are lent to jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NodeMode {
    Serve,
    Lend,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NodeView {
    pub name: String,
    pub service: String,
    pub mode: NodeMode,
    pub desired_version: u64,
    pub applied_version: u64,
    pub gpus: Vec<NodeGpuView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaStatus>,
    pub reachable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<UnixMillis>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_phases: Vec<PhaseRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NodeGpuView {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
    /// The job holding this GPU under a lease, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u64>,
    /// False when the agent reports the GPU unhealthy (it is then never leased); `None`
    /// before the first heartbeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy: Option<bool>,
    /// Why the GPU is unhealthy, as the agent reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_gpu_percent: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_milliwatts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_celsius: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobList {
    pub jobs: Vec<JobView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NodeList {
    pub nodes: Vec<NodeView>,
}

/// Load reported by a load balancer or gateway in front of a service: requests it holds
/// because no replica is ready. Used to bring a service back from zero serving replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GatewaySignals {
    pub waiting: u64,
}

/// Every 4xx and 5xx answer carries this body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ApiError {
    pub error: String,
    /// The offending field of the request, when one is to blame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// `nightshift report`: GPU time harvested over a period, and what it was worth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub since: UnixMillis,
    pub until: UnixMillis,
    /// `team`, `job`, `day` or `month` when grouped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    pub currency: String,
    pub price_per_gpu_hour: f64,
    #[serde(flatten)]
    pub totals: ReportTotals,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<ReportGroup>,
}

/// The figures of a report, for the whole period or one group.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReportTotals {
    /// GPU-hours under lease inside the period.
    pub harvested_gpu_hours: f64,
    /// `harvested_gpu_hours` ÷ the period's hours: the always-on GPUs it amounts to.
    pub equivalent_gpus: f64,
    /// `harvested_gpu_hours` × the configured price per GPU-hour.
    pub savings: f64,
    /// Leases that ended in a preemption inside the period.
    pub preemptions: u64,
    /// GPU-hours of work lost to those preemptions (since each job's last checkpoint).
    pub lost_gpu_hours: f64,
    /// Leases counted (ended or still running) that overlap the period.
    pub leases: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReportGroup {
    pub key: String,
    #[serde(flatten)]
    pub totals: ReportTotals,
}

/// A service's replicas, for load balancers (`GET /v1/services/{name}/endpoints`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Endpoints {
    pub service: String,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    pub node: String,
    pub url: String,
    /// Serving and not lent: send it requests.
    pub ready: bool,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_state_is_in_all_once() {
        // The match has no wildcard: a new state fails to compile here until it is placed.
        let position = |s: JobState| match s {
            JobState::Queued => 0,
            JobState::Starting => 1,
            JobState::Running => 2,
            JobState::Preempting => 3,
            JobState::Cancelling => 4,
            JobState::Failing => 5,
            JobState::Succeeded => 6,
            JobState::Failed => 7,
            JobState::Cancelled => 8,
        };
        for (i, s) in JobState::ALL.iter().enumerate() {
            assert_eq!(position(*s), i, "{s:?}");
        }
    }

    #[test]
    fn a_job_record_from_before_attempts_were_kept_loads_with_none() {
        let old = r#"{"id": 3, "spec": {"name": "j", "image": "i", "gpus": 2},
            "state": "succeeded", "attempt": 1, "preemptions": 0, "submitted_at": 5,
            "finished_at": 9, "exit_code": 0}"#;
        let job: JobView = serde_json::from_str(old).unwrap();
        assert!(job.attempts.is_empty());
        assert!(!serde_json::to_string(&job).unwrap().contains("attempts"));

        let mut job = job;
        job.attempts.push(AttemptView {
            attempt: 1,
            members: vec![AttemptMember {
                node: "gpu-01".into(),
                gpus: vec![2, 3],
                epoch: 4,
            }],
            leased_at: 6,
            started_at: Some(7),
            ended_at: Some(9),
            ending: Some(AttemptEnding::FailedToStart),
            exit_code: None,
            message: None,
        });
        let text = serde_json::to_string(&job).unwrap();
        assert!(text.contains(r#""ending":"failed_to_start""#), "{text}");
        assert_eq!(serde_json::from_str::<JobView>(&text).unwrap(), job);
    }
}
