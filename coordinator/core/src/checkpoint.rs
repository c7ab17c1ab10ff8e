//! Where each job's newest checkpoint is, when only one node can resume it.
//!
//! An agent with local checkpoint storage keeps a job's checkpoints under its own `work_dir`:
//! a later attempt placed on another node finds nothing there and starts from the beginning.
//! The core remembers, per unfinished single-node job, the node whose report showed the
//! newest checkpoint (the highest fencing epoch whose attempt had written one), and placement
//! prefers that node for the job's next attempt ([`Core::place_queued`]). A node with shared
//! storage holds nothing of its own: any node resumes the job, and it is forgotten here.
//! Gangs are not remembered: each member's checkpoint lies on its own node, and a gang that
//! must resume needs shared storage, where each member of a later attempt, on any node, is
//! seeded from the newest earlier checkpoint of its own rank (the agent's `JobDirs`).
//!
//! What a node holds is part of its durable record ([`crate::NodeSnapshot::checkpoints`]),
//! so a restarted coordinator still prefers it.
//!
//! [`Core::place_queued`]: crate::Core

use std::collections::BTreeMap;

/// The node holding a job's newest checkpoint, and the epoch of the attempt that wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub node: String,
    pub epoch: u64,
}

/// Per job, the node holding its newest checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Checkpoints {
    by_job: BTreeMap<u64, Holder>,
}

/// What a report changed: the nodes whose durable record (the checkpoints they hold) moved.
pub(crate) type Moved = Vec<String>;

impl Checkpoints {
    /// Rebuilds the table from the nodes' records: `(node, job, epoch)`; where two nodes
    /// claim a job, the higher epoch holds it.
    pub(crate) fn restore<'a>(held: impl Iterator<Item = (&'a str, u64, u64)>) -> Self {
        let mut table = Self::default();
        for (node, job, epoch) in held {
            table.record(job, node, epoch);
        }
        table
    }

    /// The node holding `job`'s newest checkpoint, if only one node can resume it.
    pub(crate) fn of(&self, job: u64) -> Option<&Holder> {
        self.by_job.get(&job)
    }

    /// `node` reported a checkpoint of `job` written by the attempt of fencing epoch `epoch`,
    /// kept on its own storage. An older attempt's report (a lower epoch) changes nothing: a
    /// newer attempt's checkpoint is newer, wherever it lies.
    pub(crate) fn record(&mut self, job: u64, node: &str, epoch: u64) -> Moved {
        match self.by_job.get_mut(&job) {
            Some(h) if h.epoch > epoch || (h.epoch == epoch && h.node == node) => Vec::new(),
            Some(h) => {
                let mut moved = vec![node.to_owned()];
                if h.node != node {
                    moved.push(std::mem::replace(&mut h.node, node.to_owned()));
                }
                h.epoch = epoch;
                moved
            }
            None => {
                self.by_job.insert(
                    job,
                    Holder {
                        node: node.to_owned(),
                        epoch,
                    },
                );
                vec![node.to_owned()]
            }
        }
    }

    /// Forgets `job` (it finished, or its checkpoint is on shared storage now).
    pub(crate) fn forget(&mut self, job: u64) -> Moved {
        self.by_job
            .remove(&job)
            .map(|h| h.node)
            .into_iter()
            .collect()
    }

    /// The jobs whose newest checkpoint `node` holds, with their epochs, by job id.
    pub(crate) fn on_node(&self, node: &str) -> Vec<(u64, u64)> {
        self.by_job
            .iter()
            .filter(|(_, h)| h.node == node)
            .map(|(job, h)| (*job, h.epoch))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_attempt_holds_the_job_and_a_stale_one_changes_nothing() {
        let mut t = Checkpoints::default();
        assert_eq!(t.record(7, "a", 3), vec!["a"]);
        assert!(
            t.record(7, "a", 3).is_empty(),
            "a repeated report moves nothing"
        );
        assert_eq!(t.record(7, "b", 5), vec!["b", "a"]);
        // The attempt on A runs on after its lease expired: its report is older.
        assert!(t.record(7, "a", 3).is_empty());
        assert_eq!(t.of(7).map(|h| (h.node.as_str(), h.epoch)), Some(("b", 5)));
        assert_eq!(t.on_node("b"), vec![(7, 5)]);
        assert!(t.on_node("a").is_empty());
        assert_eq!(t.forget(7), vec!["b"]);
        assert!(t.forget(7).is_empty());
    }

    #[test]
    fn a_restored_table_keeps_the_higher_epoch() {
        let t = Checkpoints::restore([("a", 7, 3), ("b", 7, 5), ("a", 8, 1)].into_iter());
        assert_eq!(t.of(7).map(|h| h.node.as_str()), Some("b"));
        assert_eq!(t.on_node("a"), vec![(8, 1)]);
    }
}
