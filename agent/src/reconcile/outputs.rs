//! What the executor reports of each run: the runs published for the heartbeat (with what
//! it reads from disk: the newest checkpoint file, the outputs a finished job left) and the
//! outputs captured once per exited container.

use std::collections::BTreeMap;

use nightshift_common::LeaseGrant;
use nightshift_planner::runs::RunFacts;
use nightshift_planner::{Observation, jobs, lease_of};

use crate::engine::{Container, ContainerState, Engine};
use crate::gpus::Gpus;
use crate::job::{self, JobDirs};
use crate::serving::ServingMetrics;

use super::Reconciler;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    /// Rebuilds the job runs reported to the coordinator from the containers and leases; a
    /// lease waiting to start whose image is on the host and whose checkpoint is restored
    /// (object storage) is reported ready.
    pub(super) fn publish_runs(&mut self, obs: &Observation, leases: &[LeaseGrant]) {
        let mut facts = BTreeMap::new();
        for lease in leases {
            let container = jobs(&obs.containers).find(|c| lease_of(c) == Some(lease.lease_id));
            let outputs = container
                .map(|c| self.outputs_of(c, lease.job_id))
                .unwrap_or_default();
            let last_checkpoint_at = self.attempt_dirs(lease).last_checkpoint();
            facts.insert(
                lease.lease_id,
                RunFacts {
                    last_checkpoint_at,
                    outputs,
                },
            );
        }
        let runs = nightshift_planner::runs::runs(leases, obs, &self.mem, &facts);
        self.shared.update(|o| o.runs = runs);
    }

    /// Reads, once per exited container, the outputs its job captures (files from the
    /// container's file system, standard output) together with its output directory.
    pub(super) async fn capture(&mut self, containers: &[Container], leases: &[LeaseGrant]) {
        for lease in leases {
            let Some(c) = jobs(containers).find(|c| lease_of(c) == Some(lease.lease_id)) else {
                continue;
            };
            let capture = &lease.job.capture;
            if capture.is_empty()
                || !matches!(c.state, ContainerState::Exited { .. })
                || self.outputs.contains_key(&c.id)
            {
                continue;
            }
            let mut outputs =
                job::read_outputs(&JobDirs::new(&self.cfg.work_dir, lease.job_id).outputs);
            outputs.extend(job::capture(self.engine.as_ref(), &c.id, capture).await);
            self.outputs.insert(c.id.clone(), outputs);
        }
    }

    pub(super) fn outputs_of(&mut self, c: &Container, job_id: u64) -> BTreeMap<String, String> {
        if !matches!(c.state, ContainerState::Exited { .. }) {
            return BTreeMap::new();
        }
        self.outputs
            .entry(c.id.clone())
            .or_insert_with(|| job::read_outputs(&JobDirs::new(&self.cfg.work_dir, job_id).outputs))
            .clone()
    }
}
