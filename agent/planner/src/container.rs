//! The containers the planner reasons about: the engine's view of a container (the agent's
//! `Engine` port reports them), and what their labels say (role, lease, epoch, GPUs, grace).

use std::collections::BTreeMap;

use nightshift_common::{LeaseGrant, labels};

/// The label with a job's grace period: seconds between its checkpoint signal and the kill.
pub const GRACE_LABEL: &str = "io.nightshift.grace-seconds";

/// A container the agent manages, as the engine reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    pub name: String,
    pub image: String,
    /// The ID (`sha256:...`) of the image it was created from: what `image` resolved to.
    pub image_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub state: ContainerState,
    /// The host port bound to the published container port, once running.
    pub published_port: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerState {
    Created,
    Running,
    /// Paused, restarting or being removed: not ours to touch until it settles.
    Transitioning,
    Exited {
        exit_code: i64,
    },
}

/// The job containers among `containers`.
pub fn jobs(containers: &[Container]) -> impl Iterator<Item = &Container> {
    containers
        .iter()
        .filter(|c| c.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_JOB))
}

/// The replica's container, running or not.
pub fn replica(containers: &[Container]) -> Option<&Container> {
    containers
        .iter()
        .find(|c| c.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_REPLICA))
}

/// The label `key` of `c` as a number, when it is one.
pub fn label_u64(c: &Container, key: &str) -> Option<u64> {
    c.labels.get(key)?.parse().ok()
}

/// The lease a job container runs for.
pub fn lease_of(c: &Container) -> Option<u64> {
    label_u64(c, labels::LEASE_ID)
}

/// The GPUs a job container was given.
pub fn gpus_of(c: &Container) -> Vec<u32> {
    c.labels
        .get(labels::GPUS)
        .map(|g| g.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_default()
}

/// The labels of the container that runs `lease` on `node`: what the planner reads back from
/// it (the node that manages it, its role, job, attempt, lease, epoch, GPUs, grace period and
/// gang rank). The agent's container spec and the host model both take them from here.
pub fn job_labels(node: &str, lease: &LeaseGrant) -> BTreeMap<String, String> {
    let gpus: Vec<String> = lease.gpus.iter().map(u32::to_string).collect();
    let mut labels = BTreeMap::from([
        (labels::MANAGED_BY.to_owned(), node.to_owned()),
        (labels::ROLE.to_owned(), labels::ROLE_JOB.to_owned()),
        (labels::JOB_ID.to_owned(), lease.job_id.to_string()),
        (labels::ATTEMPT.to_owned(), lease.attempt.to_string()),
        (labels::LEASE_ID.to_owned(), lease.lease_id.to_string()),
        (labels::EPOCH.to_owned(), lease.epoch.to_string()),
        (labels::GPUS.to_owned(), gpus.join(",")),
        (
            GRACE_LABEL.to_owned(),
            lease.job.checkpoint.grace_period_seconds.to_string(),
        ),
    ]);
    if let Some(rank) = crate::gang_rank(lease) {
        labels.insert(labels::RANK.to_owned(), rank.to_string());
    }
    labels
}
