//! What the core's caller persists, and rebuilds the core from after a restart.

use nightshift_common::{GpuInfo, JobView, NodeMode, UnixMillis};

/// The durable part of a node. What its agent reports is not kept: it comes again with the
/// next heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSnapshot {
    pub name: String,
    pub service: String,
    pub address: String,
    pub gpus: Vec<GpuInfo>,
    pub mode: NodeMode,
    pub desired_version: u64,
    pub mode_since: UnixMillis,
    /// `(job, epoch)`: the unfinished jobs whose newest checkpoint this node holds on its own
    /// storage (written by the attempt of that fencing epoch), which their next attempts
    /// prefer it for.
    pub checkpoints: Vec<(u64, u64)>,
}

/// Everything the core needs to resume. Leases travel inside their jobs' views.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CoreSnapshot {
    pub jobs: Vec<JobView>,
    pub nodes: Vec<NodeSnapshot>,
    pub next_job_id: u64,
    pub next_lease_id: u64,
    pub next_epoch: u64,
    /// Each service's learned load profile.
    pub profiles: Vec<(String, crate::forecast::Profile)>,
}
