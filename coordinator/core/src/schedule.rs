//! Placing queued jobs on lent nodes, and handing back lent nodes that have nothing to do.
//!
//! Placement is strict FIFO within a priority: if the head of the queue fits on no lent node,
//! nothing behind it jumps ahead (backfill is later work). GPUs are picked lowest index
//! first among those that no lease holds and no leftover container occupies.

use nightshift_common::{NodeMode, UnixMillis};

use crate::core::Core;

impl Core {
    pub(crate) fn place_queued(&mut self, now: UnixMillis) {
        for job in self.queue() {
            let Some(gpus) = self.jobs.get(&job).map(|j| j.spec.gpus as usize) else {
                continue;
            };
            let Some((node, picked)) = self.find_gpus(now, gpus) else {
                break;
            };
            self.grant(now, job, &node, picked);
        }
    }

    /// The lent node with the fewest free GPUs that still fit `count` (packing), and which.
    fn find_gpus(&self, now: UnixMillis, count: usize) -> Option<(String, Vec<u32>)> {
        let ttl = self.config.lease_ttl_ms;
        self.nodes
            .values()
            .filter(|n| n.mode == NodeMode::Lend && n.reachable(now, ttl))
            .filter_map(|n| {
                let held = self.leases.held_gpus(&n.name);
                let occupied = n.occupied_gpus();
                let free: Vec<u32> = n
                    .gpus
                    .iter()
                    .map(|g| g.index)
                    .filter(|i| !held.contains(i) && !occupied.contains(i))
                    .collect();
                (free.len() >= count).then(|| (free.len(), n.name.clone(), free))
            })
            .min_by_key(|(free, name, _)| (*free, name.clone()))
            .map(|(_, name, free)| (name, free.into_iter().take(count).collect()))
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
