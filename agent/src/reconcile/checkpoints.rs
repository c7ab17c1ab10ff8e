//! The executor's object-store checkpoints: each waiting lease's checkpoint restored from
//! the bucket before its job starts, and each exited attempt's uploaded, in the background.

use std::collections::BTreeSet;

use nightshift_common::{LeaseGrant, SequenceKind};
use tokio::time::Instant;

use crate::bucket::BucketError;
use crate::engine::{Container, Engine};
use crate::gpus::Gpus;
use crate::job::{self, JobDirs};
use crate::serving::ServingMetrics;

use super::Reconciler;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    /// Starts restoring each lease's checkpoint from the bucket in the background, unless
    /// under way: the attempt's own directory (any leftover of an earlier try removed; no
    /// container has used it) is filled with the newest complete checkpoint below its
    /// epoch. See [`Reconciler::reap_restores`].
    pub(super) fn start_restores(&mut self, leases: &[LeaseGrant]) {
        let Some(bucket) = &self.bucket else {
            return;
        };
        for lease in leases {
            if self.restores.contains_key(&lease.lease_id) {
                continue;
            }
            let dir = self.attempt_dirs(lease).checkpoint;
            let (bucket, node) = (bucket.clone(), self.node().to_owned());
            let (job, epoch, attempt) = (lease.job_id, lease.epoch, lease.attempt);
            let rank = job::gang_rank(lease);
            let task = tokio::spawn(async move {
                bucket
                    .restore_fresh(job, rank, epoch, attempt, &node, &dir)
                    .await
            });
            self.restores.insert(lease.lease_id, (lease.clone(), task));
        }
    }

    /// Takes in the restores that ended (a failed one fails its lease's start, naming the
    /// bucket and the reason), forgets the leases no longer listed (uploading the directory
    /// of one restored but never started, so that a later attempt waits for no upload), and
    /// answers the leases waiting to start that are still to be restored.
    pub(super) async fn reap_restores(
        &mut self,
        leases: &[LeaseGrant],
        containers: &[Container],
    ) -> BTreeSet<u64> {
        if self.bucket.is_none() {
            return BTreeSet::new();
        }
        let done: Vec<u64> = self
            .restores
            .iter()
            .filter(|(_, (_, task))| task.is_finished())
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let Some((lease, task)) = self.restores.remove(&id) else {
                continue;
            };
            let result = task.await.unwrap_or_else(|e| {
                Err(BucketError::Local {
                    path: "restore task".into(),
                    source: std::io::Error::other(e),
                })
            });
            match &result {
                Ok(restored) => tracing::info!(
                    node = %self.node(), job.id = lease.job_id, lease.epoch = lease.epoch,
                    from_epoch = ?restored.from_epoch, files = restored.files,
                    bytes = restored.bytes, waited_s = restored.waited.as_secs_f64(),
                    "checkpoint restored from the bucket"
                ),
                Err(e) => tracing::warn!(
                    node = %self.node(), job.id = lease.job_id, lease.id = lease.lease_id,
                    error = %e, "restoring the checkpoint failed: the job cannot start"
                ),
            }
            let outcome = result.map(|r| r.from_epoch).map_err(|e| e.to_string());
            self.mem.restore_ended(lease, outcome);
        }
        let running: Vec<u64> = self.restores.keys().copied().collect();
        let (abort, uploads) = self.mem.forget_restores(leases, containers, running);
        for id in abort {
            if let Some((_, task)) = self.restores.remove(&id) {
                task.abort();
            }
        }
        for up in uploads {
            self.upload(up.job, up.rank, up.epoch, None);
        }
        nightshift_planner::unrestored(leases, containers, &self.mem)
    }

    /// Starts uploading the checkpoint directory of every job container that stopped
    /// (object storage), once per container: in the background, so that the node's other
    /// leases go on and a reclaim gives the GPUs back as soon as the container is stopped.
    pub(super) fn start_uploads(&mut self, containers: &[Container]) {
        if self.bucket.is_none() {
            return;
        }
        for due in self.mem.uploads_due(containers) {
            self.upload(
                due.job,
                due.rank,
                due.epoch,
                due.reclaim.then_some(Instant::now()),
            );
        }
    }

    /// Uploads the checkpoint directory of `job`'s attempt of `epoch` (as gang rank `rank`)
    /// in the background;
    /// records `upload_checkpoint` (reclaim) when it ends, with `phase_began`, and removes
    /// the directory from the host. One that cannot be uploaded stays.
    pub(super) fn upload(
        &self,
        job: u64,
        rank: Option<u32>,
        epoch: u64,
        phase_began: Option<Instant>,
    ) {
        let Some(bucket) = self.bucket.clone() else {
            return;
        };
        let (work_dir, root) = (&self.cfg.work_dir, self.cfg.checkpoint_root());
        let dir = JobDirs::member(work_dir, root, job, epoch, rank).checkpoint;
        let (node, shared) = (self.node().to_owned(), self.shared.clone());
        tokio::spawn(async move {
            let began = Instant::now();
            match bucket.upload_retrying(job, rank, epoch, &node, &dir).await {
                Ok((manifest, tries)) => {
                    let bytes: u64 = manifest.files.iter().map(|f| f.size).sum();
                    tracing::info!(
                        node = %node, job.id = job, lease.epoch = epoch,
                        files = manifest.files.len(), bytes, tries,
                        took_s = began.elapsed().as_secs_f64(), "checkpoint uploaded"
                    );
                    if let Some(t) = phase_began {
                        shared.record_phase(SequenceKind::Reclaim, "upload_checkpoint", t);
                    }
                }
                Err((e, tries)) => tracing::error!(
                    node = %node, job.id = job, lease.epoch = epoch, error = %e, tries,
                    "checkpoint upload failed: a later attempt resumes from an older one"
                ),
            }
        });
    }
}
