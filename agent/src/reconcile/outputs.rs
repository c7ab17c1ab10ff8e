//! What the executor reports of each run: the runs published for the heartbeat (with the
//! newest checkpoint file it reads from disk) and what each exited container left, read once
//! when the planner says so ([`nightshift_planner::Memory::outputs_due`]).

use nightshift_common::LeaseGrant;
use nightshift_planner::Observation;
use nightshift_planner::runs::RunFacts;

use crate::engine::{Container, Engine};
use crate::gpus::Gpus;
use crate::job::{self, JobDirs};
use crate::serving::ServingMetrics;

use super::Reconciler;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    /// Rebuilds the job runs reported to the coordinator from the containers and leases; a
    /// lease waiting to start whose image is on the host and whose checkpoint is restored
    /// (object storage) is reported ready.
    pub(super) fn publish_runs(&mut self, obs: &Observation, leases: &[LeaseGrant]) {
        let facts = leases
            .iter()
            .map(|lease| {
                let last_checkpoint_at = self.attempt_dirs(lease).last_checkpoint();
                (lease.lease_id, RunFacts { last_checkpoint_at })
            })
            .collect();
        let runs = nightshift_planner::runs::runs(leases, obs, &self.mem, &facts);
        self.shared.update(|o| o.runs = runs);
    }

    /// Reads what each exited job container the planner names left: the output parameters
    /// in its job's output directory and, when its job asks, files from the container's
    /// file system and its standard output.
    pub(super) async fn read_outputs(&mut self, containers: &[Container], leases: &[LeaseGrant]) {
        let due: Vec<(LeaseGrant, String)> = self
            .mem
            .outputs_due(leases, containers)
            .into_iter()
            .map(|(l, c)| (l.clone(), c.id.clone()))
            .collect();
        for (lease, id) in due {
            let mut outputs =
                job::read_outputs(&JobDirs::new(&self.cfg.work_dir, lease.job_id).outputs);
            let capture = &lease.job.capture;
            if !capture.is_empty() {
                outputs.extend(job::capture(self.engine.as_ref(), &id, capture).await);
            }
            self.mem.outputs.insert(id, outputs);
        }
    }
}
