//! Placing queued jobs on lent nodes, and handing back lent nodes that have nothing to do.
//!
//! Jobs are taken in queue order (priority, fair share, age). A gang is placed all or
//! nothing, one node per member. GPUs are picked lowest index first among those that no lease
//! holds, no leftover container occupies and the agent does not report unhealthy, on the nodes with the fewest free GPUs that fit
//! (packing, so that whole nodes stay free for big jobs). When the head of the queue does not
//! fit, the nodes it would use next are reserved for it and later jobs backfill the rest.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use nightshift_common::{NodeMode, UnixMillis};

use crate::core::Core;
use crate::lease::Lease;
use crate::node::Node;

/// The free GPUs of every reachable lent node that has any, in name order, and the same
/// nodes ordered by how many GPUs they have free, kept up to date while one round of
/// placement grants leases: a job's placement is a range query, not a sort of every lent
/// node. Nodes are known by their position in name order, so that ordering among equals by
/// position is ordering by name, and no name is compared or copied until a job is placed.
struct Capacity {
    names: Vec<String>,
    free: Vec<Vec<u32>>,
    /// `(free GPUs, position)` of every node.
    by_free: BTreeSet<(usize, usize)>,
    /// Nodes kept for a job at the head of the queue that does not fit yet.
    reserved: Vec<bool>,
}

impl Capacity {
    /// `nodes` in name order, each with its free GPUs, lowest index first.
    fn new(nodes: Vec<(String, Vec<u32>)>) -> Self {
        let (names, free): (Vec<String>, Vec<Vec<u32>>) = nodes.into_iter().unzip();
        let by_free = free.iter().map(Vec::len).zip(0..).collect();
        let reserved = vec![false; names.len()];
        Self {
            names,
            free,
            by_free,
            reserved,
        }
    }

    /// Unreserved nodes with at least one free GPU.
    fn any_free(&self) -> bool {
        self.by_free
            .range((1, 0)..)
            .any(|&(_, i)| !self.reserved[i])
    }

    /// `count` distinct unreserved nodes with `gpus` free GPUs each (fewest free first).
    fn find_placement(&self, gpus: usize, count: usize) -> Option<Vec<usize>> {
        let fits: Vec<usize> = self
            .by_free
            .range((gpus, 0)..)
            .map(|&(_, i)| i)
            .filter(|&i| !self.reserved[i])
            .take(count)
            .collect();
        (fits.len() == count).then_some(fits)
    }

    /// Keeps the nodes with the most free GPUs for a job that does not fit yet (among
    /// equals, by name).
    fn reserve(&mut self, nodes: usize) {
        let mut keep: Vec<usize> = Vec::new();
        let mut below = usize::MAX;
        while keep.len() < nodes {
            // The next lower count of free GPUs, then its nodes in name order.
            let Some(&(count, _)) = self.by_free.range(..(below, 0)).next_back() else {
                break;
            };
            keep.extend(
                self.by_free
                    .range((count, 0)..(count + 1, 0))
                    .map(|&(_, i)| i)
                    .filter(|&i| !self.reserved[i])
                    .take(nodes - keep.len()),
            );
            below = count;
        }
        for i in keep {
            self.reserved[i] = true;
        }
    }

    /// Takes the lowest `gpus` free GPUs of each node in `nodes`: the grant's placements.
    fn take(&mut self, nodes: &[usize], gpus: usize) -> Vec<(String, Vec<u32>)> {
        nodes
            .iter()
            .map(|&i| {
                let free = &mut self.free[i];
                self.by_free.remove(&(free.len(), i));
                let taken: Vec<u32> = free.drain(..gpus.min(free.len())).collect();
                self.by_free.insert((free.len(), i));
                (self.names[i].clone(), taken)
            })
            .collect()
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
            self.lent_free(now)
                .into_iter()
                .map(|(n, free)| (n.name.clone(), free))
                .collect(),
        );
        // Every job asks for at least one GPU: with none free, the queue need not be ordered.
        if !capacity.any_free() {
            return false;
        }
        let mut placed = 0;
        for job in self.queue(now) {
            if !capacity.any_free() {
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
            match capacity.find_placement(gpus, nodes) {
                Some(fits) => {
                    let placements = capacity.take(&fits, gpus);
                    self.grant(now, job, placements);
                    placed += 1;
                }
                // Keep the nodes with the most free GPUs for this job; others may backfill.
                None => capacity.reserve(nodes),
            }
        }
        false
    }

    /// Every reachable lent node with a GPU free, and those GPUs, in name order. One walk
    /// of the nodes beside the lease table's per-node index, in name order too, so that no
    /// node is looked up by its name: with thousands of nodes lent, those lookups were most
    /// of a decision's cost.
    pub(crate) fn lent_free(&self, now: UnixMillis) -> Vec<(&Node, Vec<u32>)> {
        let ttl = self.config.lease_ttl_ms;
        let mut held = self.leases.by_node().peekable();
        let mut lent = Vec::new();
        for n in self.nodes.values() {
            let mut ids = None;
            while let Some((node, set)) = held.peek() {
                match (*node).cmp(n.name.as_str()) {
                    Ordering::Less => {}
                    Ordering::Equal => ids = Some(*set),
                    Ordering::Greater => break,
                }
                held.next();
            }
            if n.mode != NodeMode::Lend || !n.reachable(now, ttl) {
                continue;
            }
            let free = self.free_among(n, self.leases.of(ids));
            if !free.is_empty() {
                lent.push((n, free));
            }
        }
        lent
    }

    /// GPUs of `n` that none of its leases (`on_node`) holds, no container occupies and the
    /// agent does not report unhealthy.
    fn free_among<'a>(
        &self,
        n: &Node,
        on_node: impl Iterator<Item = &'a Lease> + Clone,
    ) -> Vec<u32> {
        // The usual lent node has every GPU leased: one pass over its leases tells (no two
        // leases share a GPU, an invariant; were it broken, this would only place less).
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
