//! What the agent reports of its jobs in every heartbeat: one [`JobRun`] per listed lease
//! (running, pending and whether it is ready to start, exited and whether the agent stopped
//! it, or failed to start), per container of a lease no longer listed while it exists, and
//! per start failure of a lease taken back before the coordinator heard of it.

use std::collections::BTreeMap;

use nightshift_common::labels;
use nightshift_common::{JobRun, JobRunState, LeaseGrant};

use crate::container::{Container, ContainerState, gpus_of, jobs, label_u64, lease_of};
use crate::plan::{Memory, Observation};

/// What the executor read from the host for a listed lease's run: the newest file in its
/// attempt's checkpoint directory (milliseconds since the epoch). The outputs an exited
/// container left are the memory's ([`Memory::outputs`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFacts {
    pub last_checkpoint_at: Option<u64>,
}

/// The state a job container's run is reported in.
pub fn run_state(c: &Container, mem: &Memory) -> JobRunState {
    let stopped = mem.stopped.contains(&c.id);
    match c.state {
        ContainerState::Created => JobRunState::Pending,
        ContainerState::Running | ContainerState::Transitioning if stopped => JobRunState::Stopping,
        ContainerState::Running | ContainerState::Transitioning => JobRunState::Running,
        ContainerState::Exited { exit_code } => JobRunState::Exited {
            exit_code,
            stopped_by_agent: stopped,
        },
    }
}

/// The image a container runs by its registry digest, when it was started by one.
pub fn pinned_image(c: &Container) -> Option<String> {
    c.image.contains("@sha256:").then(|| c.image.clone())
}

/// The runs to report: see the module's header. `facts` are the listed leases' (by lease
/// id); a lease without is reported with none.
pub fn runs(
    leases: &[LeaseGrant],
    obs: &Observation,
    mem: &Memory,
    facts: &BTreeMap<u64, RunFacts>,
) -> Vec<JobRun> {
    let containers = &obs.containers[..];
    let mut runs = Vec::new();
    for lease in leases {
        let container = jobs(containers).find(|c| lease_of(c) == Some(lease.lease_id));
        let state = match (container, mem.start_failures.get(&lease.lease_id)) {
            (Some(c), _) => run_state(c, mem),
            (None, Some(f)) => f.run.state.clone(),
            (None, None) => JobRunState::Pending,
        };
        let ready = state == JobRunState::Pending
            && !obs.missing_images.contains(&lease.job.image)
            && !obs.unrestored.contains(&lease.lease_id);
        let facts = facts.get(&lease.lease_id).cloned().unwrap_or_default();
        runs.push(JobRun {
            job_id: lease.job_id,
            attempt: lease.attempt,
            lease_id: lease.lease_id,
            epoch: lease.epoch,
            gpus: lease.gpus.clone(),
            state,
            last_checkpoint_at: facts.last_checkpoint_at,
            outputs: container
                .and_then(|c| mem.outputs.get(&c.id))
                .cloned()
                .unwrap_or_default(),
            image_id: container.and_then(|c| c.image_id.clone()),
            image_digest: container.and_then(pinned_image),
            ready,
        });
    }
    // Containers of leases no longer listed are still reported while they exist.
    for c in jobs(containers) {
        let Some(lease_id) = lease_of(c) else {
            continue;
        };
        if leases.iter().any(|l| l.lease_id == lease_id) {
            continue;
        }
        runs.push(JobRun {
            job_id: label_u64(c, labels::JOB_ID).unwrap_or(0),
            attempt: label_u64(c, labels::ATTEMPT)
                .and_then(|a| u32::try_from(a).ok())
                .unwrap_or(0),
            lease_id,
            epoch: label_u64(c, labels::EPOCH).unwrap_or(0),
            gpus: gpus_of(c),
            state: run_state(c, mem),
            last_checkpoint_at: None,
            outputs: BTreeMap::new(),
            image_id: c.image_id.clone(),
            image_digest: pinned_image(c),
            ready: false,
        });
    }
    // So are the start failures of leases taken back before the coordinator heard.
    let unheard: Vec<JobRun> = mem
        .start_failures
        .values()
        .filter(|f| f.unlisted_since.is_some())
        .filter(|f| !runs.iter().any(|r| r.lease_id == f.run.lease_id))
        .map(|f| f.run.clone())
        .collect();
    runs.extend(unheard);
    runs
}
