//! Placing queued jobs on lent nodes, and handing back lent nodes that have nothing to do.
//!
//! Jobs are taken in queue order (priority, fair share, age). A gang is placed all or
//! nothing, one node per member. GPUs are picked lowest index first among those that no lease
//! holds, no leftover container occupies and the agent does not report unhealthy, on the nodes with the fewest free GPUs that fit
//! (packing, so that whole nodes stay free for big jobs). When the head of the queue does not
//! fit, the nodes it would use next are reserved for it and later jobs backfill the rest.

use std::collections::{BTreeMap, BTreeSet};

use nightshift_common::{NodeMode, UnixMillis};

use crate::core::Core;
use crate::node::Node;

/// The free GPUs of every reachable lent node that has any, by name, and the same nodes
/// ordered by how many GPUs they have free, kept up to date while one round of placement
/// grants leases: a job's placement is a range query, not a sort of every lent node.
struct Capacity {
    free: BTreeMap<String, Vec<u32>>,
    /// `(free GPUs, name)` of every node in `free`.
    by_free: BTreeSet<(usize, String)>,
}

impl Capacity {
    fn new(free: BTreeMap<String, Vec<u32>>) -> Self {
        let by_free = free
            .iter()
            .map(|(name, gpus)| (gpus.len(), name.clone()))
            .collect();
        Self { free, by_free }
    }

    /// Unreserved nodes with at least one free GPU.
    fn any_free(&self, reserved: &BTreeSet<String>) -> bool {
        self.by_free
            .iter()
            .any(|(n, name)| *n > 0 && !reserved.contains(name))
    }

    /// `count` distinct unreserved nodes with `gpus` free GPUs each (fewest free first).
    fn find_placement(
        &self,
        gpus: usize,
        count: usize,
        reserved: &BTreeSet<String>,
    ) -> Option<Vec<(String, Vec<u32>)>> {
        let fits: Vec<&String> = self
            .by_free
            .range((gpus, String::new())..)
            .map(|(_, name)| name)
            .filter(|name| !reserved.contains(*name))
            .take(count)
            .collect();
        if fits.len() < count {
            return None;
        }
        Some(
            fits.into_iter()
                .map(|name| {
                    (
                        name.clone(),
                        self.free[name].iter().copied().take(gpus).collect(),
                    )
                })
                .collect(),
        )
    }

    /// Keeps the nodes with the most free GPUs for a job that does not fit yet (among
    /// equals, by name).
    fn reserve(&self, nodes: usize, reserved: &mut BTreeSet<String>) {
        let mut keep: Vec<String> = Vec::new();
        let mut below = usize::MAX;
        while keep.len() < nodes {
            // The next lower count of free GPUs, then its nodes in name order.
            let Some((count, _)) = self.by_free.range(..(below, String::new())).next_back() else {
                break;
            };
            let count = *count;
            keep.extend(
                self.by_free
                    .range((count, String::new())..(count + 1, String::new()))
                    .map(|(_, name)| name)
                    .filter(|name| !reserved.contains(*name))
                    .take(nodes - keep.len())
                    .cloned(),
            );
            below = count;
        }
        reserved.extend(keep);
    }

    fn take(&mut self, placements: &[(String, Vec<u32>)]) {
        for (node, gpus) in placements {
            if let Some(free) = self.free.get_mut(node) {
                self.by_free.remove(&(free.len(), node.clone()));
                free.retain(|g| !gpus.contains(g));
                self.by_free.insert((free.len(), node.clone()));
            }
        }
    }
}

impl Core {
    /// Places queued jobs in queue order on the lent nodes' free GPUs, at most
    /// `max_placements_per_decision` of them; returns whether it stopped at that limit with
    /// GPUs still free (another decision should follow).
    pub(crate) fn place_queued(&mut self, now: UnixMillis) -> bool {
        if self.index.runnable(now).next().is_none() {
            return false;
        }
        // A node with nothing free can take no job this round, nor does reserving it change
        // what others get: only nodes with a free GPU enter (usually none, once lent nodes
        // are busy), so a decision with nothing to place allocates nothing per node.
        let mut capacity = Capacity::new(
            self.lent_nodes(now)
                .into_iter()
                .filter_map(|n| {
                    let free = self.free_gpus(n);
                    (!free.is_empty()).then(|| (n.name.clone(), free))
                })
                .collect(),
        );
        let mut reserved: BTreeSet<String> = BTreeSet::new();
        // Every job asks for at least one GPU: with none free, the queue need not be ordered.
        if !capacity.any_free(&reserved) {
            return false;
        }
        let mut placed = 0;
        for job in self.queue(now) {
            if !capacity.any_free(&reserved) {
                break;
            }
            if placed >= self.config.max_placements_per_decision {
                return true;
            }
            let Some((gpus, nodes)) = self
                .jobs
                .get(&job)
                .map(|j| (j.spec.gpus as usize, j.spec.nodes as usize))
            else {
                continue;
            };
            match capacity.find_placement(gpus, nodes, &reserved) {
                Some(placements) => {
                    capacity.take(&placements);
                    self.grant(now, job, placements);
                    placed += 1;
                }
                // Keep the nodes with the most free GPUs for this job; others may backfill.
                None => capacity.reserve(nodes, &mut reserved),
            }
        }
        false
    }

    fn lent_nodes(&self, now: UnixMillis) -> Vec<&Node> {
        let ttl = self.config.lease_ttl_ms;
        self.nodes
            .values()
            .filter(|n| n.mode == NodeMode::Lend && n.reachable(now, ttl))
            .collect()
    }

    /// GPUs of `node` that no lease holds, no container occupies and the agent does not
    /// report unhealthy.
    pub(crate) fn free_gpus(&self, n: &Node) -> Vec<u32> {
        // The usual lent node has every GPU leased: one pass over its leases tells (no two
        // leases share a GPU, an invariant; were it broken, this would only place less).
        let on_node = self.leases.on_node(&n.name);
        if on_node.clone().map(|l| l.gpus.len()).sum::<usize>() >= n.gpus.len() {
            return Vec::new();
        }
        let held = |i: u32| on_node.clone().any(|l| l.gpus.contains(&i));
        n.gpus
            .iter()
            .map(|g| g.index)
            .filter(|&i| !held(i) && !n.occupies(i) && !n.reports_unhealthy(i))
            .collect()
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
