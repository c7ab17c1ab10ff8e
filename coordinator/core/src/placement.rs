//! The one placement model: the order queued jobs are placed in, and where each goes. The
//! scheduler places jobs with it ([`Core::place_queued`]), and lending dry-runs it to decide
//! how many serving nodes the queue would use ([`Core::lending_plan`]), so that what lending
//! expects is what placement then does.
//!
//! Jobs are taken in queue order ([`Core::queue`]: priority, fair share, age). A gang is
//! placed all or nothing, one node per member. GPUs are picked lowest index first among those
//! that no lease holds, no leftover container occupies and the agent does not report
//! unhealthy, on the nodes with the fewest free GPUs that fit (best fit: whole nodes stay free
//! for big jobs). When a job does not fit, the nodes it would use next (those with the most
//! free GPUs) are reserved for it and later jobs backfill the rest.
//!
//! One exception to best fit: a job whose newest checkpoint only one node holds (local
//! checkpoint storage, [`crate::checkpoint`]) goes back to that node when it is lent,
//! unreserved and has the GPUs free, since anywhere else it would start from nothing. When
//! it cannot take the job, the job is placed by best fit as any other, and starts afresh.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use nightshift_common::{NodeMode, UnixMillis};

use crate::core::Core;
use crate::index::team;
use crate::node::Node;

/// The free GPUs of a set of nodes, and the same nodes ordered by how many GPUs they have
/// free, kept up to date while jobs are placed: a job's placement is a range query, not a
/// sort of every node. Nodes are known by their position; the scheduler adds them in name
/// order, so that ordering among equals by position is ordering by name, and no name is
/// compared or copied until a job is placed.
#[derive(Clone)]
struct Placement {
    free: Vec<Vec<u32>>,
    /// `(free GPUs, position)` of every node.
    by_free: BTreeSet<(usize, usize)>,
    /// Nodes kept for a job that does not fit yet.
    reserved: Vec<bool>,
}

impl Placement {
    /// Nodes with their free GPUs, lowest index first.
    fn new(free: Vec<Vec<u32>>) -> Self {
        let by_free = free.iter().map(Vec::len).zip(0..).collect();
        let reserved = vec![false; free.len()];
        Self {
            free,
            by_free,
            reserved,
        }
    }

    /// Adds a node with `gpus` free GPUs (a serving node lending would add); its position.
    fn open(&mut self, gpus: usize) -> usize {
        let i = self.free.len();
        self.free.push((0..gpus as u32).collect());
        self.by_free.insert((gpus, i));
        self.reserved.push(false);
        i
    }

    /// Unreserved nodes with at least one free GPU.
    fn any_free(&self) -> bool {
        self.by_free
            .range((1, 0)..)
            .any(|&(_, i)| !self.reserved[i])
    }

    /// `count` distinct unreserved nodes with `gpus` free GPUs each (fewest free first).
    fn find(&self, gpus: usize, count: usize) -> Option<Vec<usize>> {
        let fits: Vec<usize> = self
            .by_free
            .range((gpus, 0)..)
            .map(|&(_, i)| i)
            .filter(|&i| !self.reserved[i])
            .take(count)
            .collect();
        (fits.len() == count).then_some(fits)
    }

    /// Like [`Placement::find`], but with the node at position `prefer` (the one holding the
    /// job's checkpoint) first when it is unreserved and has `gpus` free.
    fn find_preferring(
        &self,
        gpus: usize,
        count: usize,
        prefer: Option<usize>,
    ) -> Option<Vec<usize>> {
        let Some(p) = prefer
            .filter(|&p| p < self.free.len() && !self.reserved[p] && self.free[p].len() >= gpus)
        else {
            return self.find(gpus, count);
        };
        let mut fits = vec![p];
        fits.extend(
            self.by_free
                .range((gpus, 0)..)
                .map(|&(_, i)| i)
                .filter(|&i| i != p && !self.reserved[i])
                .take(count - 1),
        );
        (fits.len() == count).then_some(fits)
    }

    /// Keeps the nodes with the most free GPUs for a job that does not fit yet (among
    /// equals, by position).
    fn reserve(&mut self, nodes: usize) {
        let mut keep: Vec<usize> = Vec::new();
        let mut below = usize::MAX;
        while keep.len() < nodes {
            // The next lower count of free GPUs, then its nodes in position order.
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

    /// Takes the lowest `gpus` free GPUs of each node in `nodes`.
    fn take(&mut self, nodes: &[usize], gpus: usize) -> Vec<(usize, Vec<u32>)> {
        nodes
            .iter()
            .map(|&i| {
                let free = &mut self.free[i];
                self.by_free.remove(&(free.len(), i));
                let taken: Vec<u32> = free.drain(..gpus.min(free.len())).collect();
                self.by_free.insert((free.len(), i));
                (i, taken)
            })
            .collect()
    }
}

/// What a dry run of placement with serving nodes to lend came to.
struct Plan {
    /// The candidates lent, in the order they were opened.
    chosen: Vec<usize>,
    /// Whether every job was placed.
    all_placed: bool,
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
        let (names, free): (Vec<String>, Vec<Vec<u32>>) = self
            .lent_free(now)
            .into_iter()
            .map(|(n, free)| (n.name.clone(), free))
            .unzip();
        let mut placement = Placement::new(free);
        // Every job asks for at least one GPU: with none free, the queue need not be ordered.
        if !placement.any_free() {
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
            if !placement.any_free() {
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
            let prefer = self.checkpoint_node(job, &names);
            match placement.find_preferring(gpus, nodes, prefer) {
                Some(fits) => {
                    let placements = placement
                        .take(&fits, gpus)
                        .into_iter()
                        .map(|(i, gpus)| (names[i].clone(), gpus))
                        .collect();
                    self.grant(now, job, placements);
                    placed += 1;
                }
                // Keep the nodes with the most free GPUs for this job; others may backfill.
                None => placement.reserve(nodes),
            }
        }
        false
    }

    /// Which of the serving nodes that could be lent (named `candidates`, of `healthy` GPUs
    /// each, in the order to lend them) the queue would use, at most `spare`: placement of
    /// the runnable queue dry-run on the lent nodes' free GPUs, lending the next candidate
    /// that fits (the one holding its checkpoint first) for a job that fits nowhere, up to
    /// the first job that cannot be placed even so (small jobs behind a big one do not take
    /// nodes it will reserve). Empty when the lent nodes take the whole queue.
    pub(crate) fn lending_plan(
        &self,
        now: UnixMillis,
        candidates: &[&str],
        healthy: &[usize],
        spare: usize,
    ) -> Vec<usize> {
        if spare == 0 || healthy.is_empty() {
            return Vec::new();
        }
        let (names, free): (Vec<&str>, Vec<Vec<u32>>) = self
            .lent_free(now)
            .into_iter()
            .map(|(n, free)| (n.name.as_str(), free))
            .unzip();
        let lent = Placement::new(free);
        let queue = self.queue(now);
        // While a deep queue is being placed, what lent nodes have free usually takes all of
        // it: then no serving node is needed.
        if self
            .dry_run(&queue, &names, lent.clone(), &[], &[], 0)
            .all_placed
        {
            return Vec::new();
        }
        self.dry_run(&queue, &names, lent, candidates, healthy, spare)
            .chosen
    }

    /// Places `queue` in order on `placement`, as [`Core::place_queued`] would, opening
    /// candidates (of `healthy` GPUs each, no more than `spare` in all) for a job that fits
    /// nowhere: each the first not yet opened with enough GPUs (the candidate holding the
    /// job's checkpoint before any other), as few as the job needs, and none when even they
    /// would not make it fit. Stops once `spare` candidates are open, or at the first job
    /// that does not fit even so. `names` are the lent nodes', `candidates` the serving
    /// ones' (a job goes back to the node holding its checkpoint, as it would be placed).
    fn dry_run(
        &self,
        queue: &[u64],
        names: &[&str],
        mut placement: Placement,
        candidates: &[&str],
        healthy: &[usize],
        spare: usize,
    ) -> Plan {
        let mut plan = Plan {
            chosen: Vec::new(),
            all_placed: true,
        };
        let mut taken = vec![false; healthy.len()];
        for id in queue {
            if spare > 0 && plan.chosen.len() >= spare {
                plan.all_placed = false;
                return plan;
            }
            let Some(job) = self.jobs.get(id) else {
                continue;
            };
            let (gpus, nodes) = (job.spec.gpus as usize, job.spec.nodes as usize);
            let prefer = self.checkpoint_node(*id, names);
            if let Some(fits) = placement.find_preferring(gpus, nodes, prefer) {
                placement.take(&fits, gpus);
                continue;
            }
            plan.all_placed = false;
            let mut opened: Vec<usize> = Vec::new();
            // The serving candidate holding the job's checkpoint, and its position once open.
            let holder = self
                .checkpoints
                .of(*id)
                .and_then(|h| candidates.iter().position(|c| *c == h.node));
            let mut prefer = None;
            let fits = loop {
                if plan.chosen.len() + opened.len() >= spare {
                    break None;
                }
                // A GPU reported unhealthy is never leased: only healthy ones count.
                let usable = |c: usize| !taken[c] && !opened.contains(&c) && healthy[c] >= gpus;
                let Some(next) = holder
                    .filter(|&c| usable(c))
                    .or_else(|| (0..healthy.len()).find(|&c| usable(c)))
                else {
                    break None;
                };
                opened.push(next);
                let at = placement.open(healthy[next]);
                if Some(next) == holder {
                    prefer = Some(at);
                }
                if let Some(fits) = placement.find_preferring(gpus, nodes, prefer) {
                    break Some(fits);
                }
            };
            match fits {
                Some(fits) => {
                    placement.take(&fits, gpus);
                    for c in opened {
                        taken[c] = true;
                        plan.chosen.push(c);
                    }
                }
                // Lending stops here: the scheduler would reserve the nodes with the most
                // free GPUs for this job, a node lent for a later one among them, so
                // lending for the jobs behind it would lend nodes they may not get.
                None => return plan,
            }
        }
        plan
    }

    /// The position among `names` (in name order) of the node holding `job`'s newest
    /// checkpoint, where only that node can resume it.
    fn checkpoint_node<S: AsRef<str>>(&self, job: u64, names: &[S]) -> Option<usize> {
        let holder = self.checkpoints.of(job)?;
        names
            .binary_search_by(|n| n.as_ref().cmp(holder.node.as_str()))
            .ok()
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

    /// Queued jobs that may run now, in the order they run: higher priority first; within a
    /// priority, the team furthest below its weighted fair share of GPUs first (counting what
    /// it runs and what it would get ahead in the queue); then first submitted.
    ///
    /// The job index keeps the queued jobs in priority and age order, so one team (the
    /// common case, where fair share has nothing to balance) costs a walk of the queue and
    /// nothing else; teams are balanced over that walk, with their usage counted from the
    /// lease table (what runs), not from every job ever submitted.
    pub(crate) fn queue(&self, now: UnixMillis) -> Vec<u64> {
        if self.index.one_team_queued() {
            return self.index.runnable(now).collect();
        }
        let mut running: Vec<u64> = self.leases.all().map(|l| l.job).collect();
        running.sort_unstable();
        running.dedup();
        let mut usage: BTreeMap<String, f64> = BTreeMap::new();
        for j in running.iter().filter_map(|id| self.jobs.get(id)) {
            if !j.leases.is_empty() {
                *usage.entry(team(j).to_owned()).or_default() +=
                    f64::from(j.spec.gpus * j.spec.nodes);
            }
        }
        let mut by_priority: BTreeMap<Reverse<i32>, BTreeMap<String, VecDeque<&crate::job::Job>>> =
            BTreeMap::new();
        for j in self.index.runnable(now).filter_map(|id| self.jobs.get(&id)) {
            by_priority
                .entry(Reverse(j.spec.priority))
                .or_default()
                .entry(team(j).to_owned())
                .or_default()
                .push_back(j);
        }
        let mut order = Vec::new();
        for (_, mut teams) in by_priority {
            while let Some(name) = teams
                .iter()
                .filter(|(_, q)| !q.is_empty())
                .min_by(|(a, qa), (b, qb)| {
                    let share = |t: &str| usage.get(t).copied().unwrap_or(0.0) / self.weight(t);
                    share(a).total_cmp(&share(b)).then_with(|| {
                        (qa[0].submitted_at, qa[0].id).cmp(&(qb[0].submitted_at, qb[0].id))
                    })
                })
                .map(|(name, _)| name.clone())
            {
                let Some(j) = teams.get_mut(&name).and_then(VecDeque::pop_front) else {
                    break;
                };
                *usage.entry(name).or_default() += f64::from(j.spec.gpus * j.spec.nodes);
                order.push(j.id);
            }
        }
        order
    }

    fn weight(&self, team: &str) -> f64 {
        self.config
            .team_weights
            .get(team)
            .copied()
            .filter(|w| *w > 0.0)
            .unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Positions of the nodes a job of `gpus` × `nodes` gets, or `None`.
    fn place(p: &mut Placement, gpus: usize, nodes: usize) -> Option<Vec<usize>> {
        let fits = p.find(gpus, nodes)?;
        Some(p.take(&fits, gpus).into_iter().map(|(i, _)| i).collect())
    }

    #[test]
    fn best_fit_keeps_whole_nodes_for_big_jobs() {
        // First fit would put the 1-GPU job on the node with 3 free, and the 3-GPU job
        // would then fit nowhere.
        let mut p = Placement::new(vec![vec![1, 2, 3], vec![0]]);
        assert_eq!(place(&mut p, 1, 1), Some(vec![1]));
        assert_eq!(place(&mut p, 3, 1), Some(vec![0]));
        assert!(!p.any_free());
    }

    #[test]
    fn the_node_holding_the_checkpoint_goes_first_when_it_can_take_the_job() {
        // Best fit would take node 1 (1 free); node 0 holds the checkpoint and has room.
        let p = Placement::new(vec![vec![0, 1, 2], vec![0]]);
        assert_eq!(p.find(1, 1), Some(vec![1]));
        assert_eq!(p.find_preferring(1, 1, Some(0)), Some(vec![0]));
        // Too few GPUs free there, or kept for another job: best fit.
        assert_eq!(p.find_preferring(2, 1, Some(1)), Some(vec![0]));
        let mut kept = p.clone();
        kept.reserved[0] = true;
        assert_eq!(kept.find_preferring(1, 1, Some(0)), Some(vec![1]));
        // A gang: the preferred node, then best fit for the others.
        let p = Placement::new(vec![vec![0, 1], vec![0, 1, 2, 3], vec![0, 1]]);
        assert_eq!(p.find_preferring(2, 2, Some(1)), Some(vec![1, 0]));
        assert_eq!(p.find_preferring(2, 4, Some(1)), None);
    }

    #[test]
    fn a_job_that_does_not_fit_reserves_the_roomiest_nodes_and_others_backfill() {
        let mut p = Placement::new(vec![vec![0, 1], vec![0, 1, 2], vec![0]]);
        assert_eq!(place(&mut p, 4, 1), None);
        p.reserve(1);
        // The node with 3 free is kept; a 2-GPU job takes the node with 2.
        assert_eq!(place(&mut p, 2, 1), Some(vec![0]));
        assert_eq!(place(&mut p, 2, 1), None);
        assert_eq!(place(&mut p, 1, 1), Some(vec![2]));
    }
}
