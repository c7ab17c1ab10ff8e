//! Where a job's checkpoints live, in every storage: the one rule, written once.
//!
//! Each attempt (lease) of a job keeps its checkpoint apart, named by its lease's fencing
//! epoch, so that an attempt that runs on after its lease was taken from it (a node that lost
//! the coordinator) writes only its own, older location and never the checkpoint of the
//! attempt that replaced it (ARCHITECTURE.md, invariant 3). A gang's members each write their
//! own rank's state, so each rank keeps its attempts apart: a member resumes from the newest
//! earlier attempt *of its rank*, never from another rank's (the members of one attempt have
//! different epochs).
//!
//! - In a host directory (the agent's `work_dir` with local storage, or the directory every
//!   host mounts with shared storage): `ROOT/jobs/JOB/checkpoints[/rank-R]/EPOCH`, and the
//!   job's one directory from before attempts had their own, `ROOT/jobs/JOB/checkpoint`.
//! - In an object store: `PREFIXjobs/JOB/checkpoints[/rank-R]/EPOCH/` with the epoch written
//!   in 20 digits, so that a listing's order is the epochs' order.

use std::path::{Path, PathBuf};

use nightshift_common::LeaseGrant;

/// The checkpoint locations of one job's attempts, of one gang rank (`None`: a single-node
/// job's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointLayout {
    pub job: u64,
    pub rank: Option<u32>,
}

/// The gang rank whose checkpoints a lease's attempt keeps: `None` for a job of one node.
pub fn gang_rank(lease: &LeaseGrant) -> Option<u32> {
    lease
        .rendezvous
        .as_ref()
        .filter(|r| r.nnodes > 1)
        .map(|r| r.node_rank)
}

impl CheckpointLayout {
    pub fn new(job: u64, rank: Option<u32>) -> Self {
        Self { job, rank }
    }

    /// The layout of the attempt that runs under `lease`.
    pub fn of_lease(lease: &LeaseGrant) -> Self {
        Self::new(lease.job_id, gang_rank(lease))
    }

    /// `jobs/JOB/checkpoints[/rank-R]`, relative to a root or a key prefix.
    fn attempts(&self) -> String {
        match self.rank {
            None => format!("jobs/{}/checkpoints", self.job),
            Some(r) => format!("jobs/{}/checkpoints/rank-{r}", self.job),
        }
    }

    /// The directory under `root` that holds every attempt's checkpoint directory.
    pub fn attempts_dir(&self, root: &Path) -> PathBuf {
        root.join(self.attempts())
    }

    /// The checkpoint directory under `root` of the attempt of fencing epoch `epoch`.
    pub fn attempt_dir(&self, root: &Path, epoch: u64) -> PathBuf {
        self.attempts_dir(root).join(epoch.to_string())
    }

    /// Where the copy seeding that directory is made before it is renamed into place.
    pub fn partial_dir(&self, root: &Path, epoch: u64) -> PathBuf {
        self.attempts_dir(root).join(format!("{epoch}.partial"))
    }

    /// The job's one checkpoint directory from before attempts had their own (any rank's).
    pub fn legacy_dir(&self, root: &Path) -> PathBuf {
        root.join(format!("jobs/{}/checkpoint", self.job))
    }

    /// The epoch an entry of [`CheckpointLayout::attempts_dir`] is the directory of, if it
    /// is one (not a partial copy, not another rank's directory).
    pub fn dir_epoch(name: &str) -> Option<u64> {
        name.parse().ok()
    }

    /// The key prefix, below the store's own `prefix` (empty or ending in `/`), under which
    /// every attempt's objects are.
    pub fn attempts_key(&self, prefix: &str) -> String {
        format!("{prefix}{}/", self.attempts())
    }

    /// The key prefix of the objects of the attempt of fencing epoch `epoch`.
    pub fn attempt_key(&self, prefix: &str, epoch: u64) -> String {
        format!("{}{epoch:020}/", self.attempts_key(prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_by_epoch_with_a_gang_member_among_its_rank() {
        let root = Path::new("/var/lib/nightshift/agent");
        let single = CheckpointLayout::new(3, None);
        assert_eq!(
            single.attempt_dir(root, 12),
            Path::new("/var/lib/nightshift/agent/jobs/3/checkpoints/12")
        );
        assert_eq!(
            single.partial_dir(root, 12),
            Path::new("/var/lib/nightshift/agent/jobs/3/checkpoints/12.partial")
        );
        let member = CheckpointLayout::new(3, Some(1));
        assert_eq!(
            member.attempt_dir(root, 12),
            Path::new("/var/lib/nightshift/agent/jobs/3/checkpoints/rank-1/12")
        );
        // The directory from before attempts had their own is the job's, whatever the rank.
        assert_eq!(member.legacy_dir(root), single.legacy_dir(root));
        assert_eq!(
            single.legacy_dir(root),
            Path::new("/var/lib/nightshift/agent/jobs/3/checkpoint")
        );
    }

    #[test]
    fn only_an_attempts_own_directory_names_an_epoch() {
        assert_eq!(CheckpointLayout::dir_epoch("12"), Some(12));
        assert_eq!(CheckpointLayout::dir_epoch("12.partial"), None);
        assert_eq!(CheckpointLayout::dir_epoch("rank-1"), None);
    }

    #[test]
    fn keys_list_in_epoch_order_and_each_rank_apart() {
        let single = CheckpointLayout::new(3, None);
        assert_eq!(single.attempts_key("team/"), "team/jobs/3/checkpoints/");
        assert_eq!(
            single.attempt_key("", 9),
            "jobs/3/checkpoints/00000000000000000009/"
        );
        assert!(single.attempt_key("", 9) < single.attempt_key("", 10));
        let member = CheckpointLayout::new(3, Some(0));
        assert_eq!(
            member.attempt_key("", 9),
            "jobs/3/checkpoints/rank-0/00000000000000000009/"
        );
        assert!(
            !member
                .attempt_key("", 9)
                .starts_with(&CheckpointLayout::new(3, Some(1)).attempts_key(""))
        );
    }
}
