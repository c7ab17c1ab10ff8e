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
        // With one team queued, queue order is the index's own order: it is walked a job at
        // a time instead of being copied whole, since a round usually ends after a few jobs
        // (every free GPU placed, or kept for the head). A grant takes its job out of the
        // index, and the walk goes on after it. Fair share between teams orders up front.
        let mut ordered = (!self.index.one_team_queued()).then(|| self.queue(now).into_iter());
        let mut after = None;
        let mut placed = 0;
        loop {
            let next = match &mut ordered {
                Some(order) => order.next(),
                None => self.index.next_runnable(now, after).map(|(key, id)| {
                    after = Some(key);
                    id
                }),
            };
            let Some(job) = next else {
                break;
            };
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

    /// Every reachable lent node with a GPU free, and those GPUs, in name order. The usual
    /// lent node has every GPU leased, which its count of leased GPUs tells (no two leases
    /// share a GPU, an invariant; were it broken, this would only place less): only nodes
    /// with GPUs left over are looked up in the lease table.
    pub(crate) fn lent_free(&self, now: UnixMillis) -> Vec<(&Node, Vec<u32>)> {
        let ttl = self.config.lease_ttl_ms;
        self.nodes
            .values()
            .filter(|n| {
                n.mode == NodeMode::Lend && n.reachable(now, ttl) && n.held.gpus < n.gpus.len()
            })
            .map(|n| (n, self.free_among(n)))
            .filter(|(_, free)| !free.is_empty())
            .collect()
    }

    /// GPUs of `n` that none of its leases holds, no container occupies and the agent does
    /// not report unhealthy.
    fn free_among(&self, n: &Node) -> Vec<u32> {
        let on_node = self.leases.on_node(&n.name);
        let leased = |i: u32| on_node.clone().any(|l| l.gpus.contains(&i));
        n.gpus
            .iter()
            .map(|g| g.index)
            .filter(|&i| !leased(i) && !n.occupies(i) && !n.reports_unhealthy(i))
            .collect()
    }

    /// A lent node without any lease, when no queued job can use it, goes back to serving.
    pub(crate) fn return_idle_nodes(&mut self, now: UnixMillis) {
        let idle: Vec<String> = self
            .nodes
            .values()
            .filter(|n| n.mode == NodeMode::Lend && n.held.leases == 0)
            .map(|n| n.name.clone())
            .collect();
        for node in idle {
            self.set_mode(now, &node, NodeMode::Serve);
        }
    }
}
