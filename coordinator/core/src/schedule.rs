//! Placing queued jobs on lent nodes, and handing back lent nodes that have nothing to do.
//!
//! Jobs are taken in queue order (priority, fair share, age). A gang is placed all or
//! nothing, one node per member. GPUs are picked lowest index first among those that no lease
//! holds, no leftover container occupies and the agent does not report unhealthy, on the nodes with the fewest free GPUs that fit
//! (packing, so that whole nodes stay free for big jobs). When the head of the queue does not
//! fit, the nodes it would use next are reserved for it and later jobs backfill the rest.

use std::collections::BTreeSet;

use nightshift_common::{NodeMode, UnixMillis};

use crate::core::Core;
use crate::node::Node;

impl Core {
    pub(crate) fn place_queued(&mut self, now: UnixMillis) {
        let mut reserved: BTreeSet<String> = BTreeSet::new();
        for job in self.queue(now) {
            let Some((gpus, nodes)) = self
                .jobs
                .get(&job)
                .map(|j| (j.spec.gpus as usize, j.spec.nodes as usize))
            else {
                continue;
            };
            match self.find_placement(now, gpus, nodes, &reserved) {
                Some(placements) => self.grant(now, job, placements),
                None => {
                    // Keep the nodes with the most free GPUs for this job; others may backfill.
                    let mut lent = self.lent_nodes(now, &reserved);
                    lent.sort_by_key(|n| std::cmp::Reverse(self.free_gpus(n).len()));
                    reserved.extend(lent.into_iter().take(nodes).map(|n| n.name.clone()));
                }
            }
        }
    }

    fn lent_nodes(&self, now: UnixMillis, reserved: &BTreeSet<String>) -> Vec<&Node> {
        let ttl = self.config.lease_ttl_ms;
        self.nodes
            .values()
            .filter(|n| {
                n.mode == NodeMode::Lend && n.reachable(now, ttl) && !reserved.contains(&n.name)
            })
            .collect()
    }

    /// GPUs of `node` that no lease holds, no container occupies and the agent does not
    /// report unhealthy.
    pub(crate) fn free_gpus(&self, n: &Node) -> Vec<u32> {
        let held = self.leases.held_gpus(&n.name);
        let occupied = n.occupied_gpus();
        let unhealthy = n.unhealthy_gpus();
        n.gpus
            .iter()
            .map(|g| g.index)
            .filter(|i| !held.contains(i) && !occupied.contains(i) && !unhealthy.contains(i))
            .collect()
    }

    /// `count` distinct lent nodes with `gpus` free GPUs each (fewest free first), and which.
    fn find_placement(
        &self,
        now: UnixMillis,
        gpus: usize,
        count: usize,
        reserved: &BTreeSet<String>,
    ) -> Option<Vec<(String, Vec<u32>)>> {
        let mut fits: Vec<(usize, String, Vec<u32>)> = self
            .lent_nodes(now, reserved)
            .into_iter()
            .filter_map(|n| {
                let free = self.free_gpus(n);
                (free.len() >= gpus).then(|| (free.len(), n.name.clone(), free))
            })
            .collect();
        if fits.len() < count {
            return None;
        }
        fits.sort();
        Some(
            fits.into_iter()
                .take(count)
                .map(|(_, name, free)| (name, free.into_iter().take(gpus).collect()))
                .collect(),
        )
    }

    /// A lent node without any lease, when no queued job can use it, goes back to serving.
    pub(crate) fn return_idle_nodes(&mut self, now: UnixMillis) {
        let idle: Vec<String> = self
            .nodes
            .values()
            .filter(|n| n.mode == NodeMode::Lend && self.leases.on_node(&n.name).next().is_none())
            .map(|n| n.name.clone())
            .collect();
        for node in idle {
            self.set_mode(now, &node, NodeMode::Serve);
        }
    }
}
