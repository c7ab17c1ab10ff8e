//! Docker labels and environment variables that make up the job container contract.
//!
//! The agent finds the containers it manages by these labels (and adopts them after a restart),
//! so they are part of the on-host protocol: changing one is a breaking change.

/// Present on every container the agent manages; the value is the node name.
pub const MANAGED_BY: &str = "io.nightshift.node";
/// `replica` or `job`.
pub const ROLE: &str = "io.nightshift.role";
pub const ROLE_REPLICA: &str = "replica";
pub const ROLE_JOB: &str = "job";
pub const JOB_ID: &str = "io.nightshift.job-id";
pub const ATTEMPT: &str = "io.nightshift.attempt";
pub const LEASE_ID: &str = "io.nightshift.lease-id";
pub const EPOCH: &str = "io.nightshift.epoch";
/// A gang member's node rank (absent on a single-node job's container): where its
/// checkpoint goes with object storage.
pub const RANK: &str = "io.nightshift.rank";
pub const GPUS: &str = "io.nightshift.gpus";
pub const SERVICE: &str = "io.nightshift.service";

/// Environment given to every job container.
pub mod env {
    pub const JOB_ID: &str = "NIGHTSHIFT_JOB_ID";
    pub const JOB_NAME: &str = "NIGHTSHIFT_JOB_NAME";
    pub const ATTEMPT: &str = "NIGHTSHIFT_ATTEMPT";
    pub const RESUMING: &str = "NIGHTSHIFT_RESUMING";
    pub const CHECKPOINT_DIR: &str = "NIGHTSHIFT_CHECKPOINT_DIR";
    pub const OUTPUT_DIR: &str = "NIGHTSHIFT_OUTPUT_DIR";
    pub const LEASE_ID: &str = "NIGHTSHIFT_LEASE_ID";
    /// The lease's fencing epoch: higher for every later attempt. A job that checkpoints
    /// somewhere of its own (shared storage, an object store) names its writes by it.
    pub const EPOCH: &str = "NIGHTSHIFT_EPOCH";
    /// The epoch of the earlier attempt whose checkpoint was copied into this one's
    /// directory; unset when there was none.
    pub const RESUMED_FROM_EPOCH: &str = "NIGHTSHIFT_RESUMED_FROM_EPOCH";
    pub const GPUS: &str = "NIGHTSHIFT_GPUS";
}

/// Paths inside a job container.
pub const CHECKPOINT_MOUNT: &str = "/nightshift/checkpoint";
pub const OUTPUT_MOUNT: &str = "/nightshift/outputs";
