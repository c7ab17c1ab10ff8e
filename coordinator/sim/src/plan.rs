//! The baselines' controller: a fixed daily lending window. Inside the window the last
//! `lent` nodes are lent whatever the load; outside it every node serves. Queued jobs are
//! placed FIFO on the lent nodes' free GPUs (fewest free first), and a node leaving the
//! window has its leases revoked, as the core does on reclaim.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use nightshift_common::{
    DesiredNode, GpuInfo, Heartbeat, JobRunState, JobSpec, LeaseGrant, UnixMillis,
};

use crate::controller::Controller;

/// Every day, `lent` nodes are lent from `start_s` to `end_s` (seconds after midnight; a
/// window may wrap past midnight).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start_s: u64,
    pub end_s: u64,
    pub lent: u32,
}

impl Window {
    pub fn contains(&self, second_of_day: u64) -> bool {
        if self.start_s <= self.end_s {
            (self.start_s..self.end_s).contains(&second_of_day)
        } else {
            second_of_day >= self.start_s || second_of_day < self.end_s
        }
    }

    pub fn hours(&self) -> f64 {
        let len = if self.start_s <= self.end_s {
            self.end_s - self.start_s
        } else {
            86_400 - self.start_s + self.end_s
        };
        len as f64 / 3_600.0
    }
}

#[derive(Debug, Clone)]
struct PlanLease {
    id: u64,
    epoch: u64,
    job: u64,
    /// Its node's place in `nodes`.
    at: usize,
    gpus: Vec<u32>,
    revoked: bool,
}

/// A registered node, as the plan keeps it.
#[derive(Debug, Clone)]
struct PlanNode {
    name: String,
    gpus: u32,
    lent: bool,
    /// The ids of its leases, and the GPUs they hold (no two leases share a GPU: the
    /// violations check).
    leases: BTreeSet<u64>,
    held: usize,
}

pub struct PlanController {
    window: Window,
    /// Trace time 0 in the simulation's clock.
    origin: UnixMillis,
    lease_ttl_ms: u64,
    /// Registered nodes, in name order.
    nodes: Vec<PlanNode>,
    versions: BTreeMap<String, u64>,
    /// Nodes whose version moved since [`Controller::moved`] last asked.
    moved: Vec<String>,
    specs: BTreeMap<u64, (JobSpec, u32)>,
    queue: VecDeque<u64>,
    leases: BTreeMap<u64, PlanLease>,
    next_job: u64,
    next_lease: u64,
    changed: bool,
}

impl PlanController {
    pub fn new(window: Window, origin: UnixMillis, lease_ttl_ms: u64) -> Self {
        Self {
            window,
            origin,
            lease_ttl_ms,
            nodes: Vec::new(),
            versions: BTreeMap::new(),
            moved: Vec::new(),
            specs: BTreeMap::new(),
            queue: VecDeque::new(),
            leases: BTreeMap::new(),
            next_job: 1,
            next_lease: 1,
            changed: true,
        }
    }

    /// Where `node` is in `nodes`, or where it would go.
    fn position(&self, node: &str) -> Result<usize, usize> {
        self.nodes.binary_search_by(|n| n.name.as_str().cmp(node))
    }

    fn bump(&mut self, node: &str) {
        if let Some(v) = self.versions.get_mut(node) {
            *v += 1;
            self.moved.push(node.to_owned());
        }
        self.changed = true;
    }

    /// The GPU indices that none of node `at`'s leases holds, lowest first.
    fn free_gpus(&self, at: usize) -> Vec<u32> {
        let held: Vec<u32> = self.nodes[at]
            .leases
            .iter()
            .filter_map(|id| self.leases.get(id))
            .flat_map(|l| l.gpus.iter().copied())
            .collect();
        (0..self.nodes[at].gpus)
            .filter(|g| !held.contains(g))
            .collect()
    }

    fn remove_lease(&mut self, id: u64) -> Option<PlanLease> {
        let lease = self.leases.remove(&id)?;
        let n = &mut self.nodes[lease.at];
        n.leases.remove(&id);
        n.held -= lease.gpus.len();
        Some(lease)
    }

    fn place(&mut self, _now: UnixMillis) {
        if self.queue.is_empty() || !self.nodes.iter().any(|n| n.lent) {
            return;
        }
        while let Some(&job) = self.queue.front() {
            let Some(need) = self.specs.get(&job).map(|(s, _)| s.gpus as usize) else {
                self.queue.pop_front();
                continue;
            };
            // The lent node with the fewest free GPUs that fit; among equals the first, which
            // is the first by name.
            let best = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.lent)
                .map(|(i, n)| ((n.gpus as usize).saturating_sub(n.held), i))
                .filter(|(free, _)| *free >= need)
                .min_by_key(|(free, _)| *free);
            let Some((_, at)) = best else {
                break;
            };
            let gpus: Vec<u32> = self.free_gpus(at).into_iter().take(need).collect();
            self.queue.pop_front();
            let id = self.next_lease;
            self.next_lease += 1;
            let n = &mut self.nodes[at];
            n.leases.insert(id);
            n.held += gpus.len();
            let node = n.name.clone();
            self.leases.insert(
                id,
                PlanLease {
                    id,
                    epoch: id,
                    job,
                    at,
                    gpus,
                    revoked: false,
                },
            );
            if let Some((_, attempt)) = self.specs.get_mut(&job) {
                *attempt += 1;
            }
            self.bump(&node);
        }
    }
}

impl Controller for PlanController {
    fn register(&mut self, _now: UnixMillis, node: &str, gpus: Vec<GpuInfo>) -> Result<(), String> {
        if let Err(at) = self.position(node) {
            self.nodes.insert(
                at,
                PlanNode {
                    name: node.to_owned(),
                    gpus: gpus.len() as u32,
                    lent: false,
                    leases: BTreeSet::new(),
                    held: 0,
                },
            );
            for l in self.leases.values_mut().filter(|l| l.at >= at) {
                l.at += 1;
            }
            self.versions.insert(node.to_owned(), 1);
            self.moved.push(node.to_owned());
        }
        Ok(())
    }

    fn heartbeat(&mut self, _now: UnixMillis, node: &str, beat: Heartbeat) -> Result<(), String> {
        let Ok(at) = self.position(node) else {
            return Ok(());
        };
        let ids: Vec<u64> = self.nodes[at].leases.iter().copied().collect();
        for id in ids {
            let Some((job, revoked)) = self.leases.get(&id).map(|l| (l.job, l.revoked)) else {
                continue;
            };
            let run = beat.jobs.iter().find(|r| r.lease_id == id);
            let outcome = match run.map(|r| &r.state) {
                Some(JobRunState::Exited {
                    exit_code: 0,
                    stopped_by_agent: false,
                }) => Some(false),
                Some(JobRunState::Exited { .. } | JobRunState::FailedToStart { .. }) => Some(true),
                None if revoked => Some(true),
                _ => None,
            };
            if let Some(requeue) = outcome {
                self.remove_lease(id);
                if requeue {
                    self.queue.push_front(job);
                }
                self.bump(node);
            }
        }
        Ok(())
    }

    fn gateway(&mut self, _now: UnixMillis, _waiting: u64) {}

    fn submit(&mut self, _now: UnixMillis, spec: JobSpec) -> Result<u64, String> {
        let id = self.next_job;
        self.next_job += 1;
        self.specs.insert(id, (spec, 0));
        self.queue.push_back(id);
        Ok(id)
    }

    fn tick(&mut self, now: UnixMillis) {
        let second_of_day = now.saturating_sub(self.origin) / 1_000 % 86_400;
        let lend = if self.window.contains(second_of_day) {
            self.window.lent as usize
        } else {
            0
        };
        let first_lent = self.nodes.len().saturating_sub(lend);
        for i in 0..self.nodes.len() {
            let want = i >= first_lent;
            if self.nodes[i].lent != want {
                let node = self.nodes[i].name.clone();
                for id in &self.nodes[i].leases {
                    if let Some(l) = self.leases.get_mut(id) {
                        l.revoked = true;
                    }
                }
                self.bump(&node);
                self.nodes[i].lent = want;
            }
        }
        self.place(now);
    }

    fn version(&self, node: &str) -> Option<u64> {
        self.versions.get(node).copied()
    }

    fn moved(&mut self) -> Vec<String> {
        std::mem::take(&mut self.moved)
    }

    fn desired(&self, node: &str) -> Option<DesiredNode> {
        let version = *self.versions.get(node)?;
        let at = self.position(node).ok()?;
        let leases = self.nodes[at]
            .leases
            .iter()
            .filter_map(|id| self.leases.get(id))
            .filter(|l| !l.revoked)
            .filter_map(|l| {
                let (spec, attempt) = self.specs.get(&l.job)?;
                Some(LeaseGrant {
                    lease_id: l.id,
                    epoch: l.epoch,
                    job_id: l.job,
                    attempt: *attempt,
                    gpus: l.gpus.clone(),
                    job: spec.clone(),
                    rendezvous: None,
                })
            })
            .collect();
        Some(DesiredNode {
            version,
            serve: !self.nodes[at].lent,
            leases,
            lease_ttl_ms: self.lease_ttl_ms,
        })
    }

    fn violations(&mut self) -> Vec<String> {
        if !std::mem::take(&mut self.changed) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut owner: BTreeMap<(usize, u32), u64> = BTreeMap::new();
        for l in self.leases.values() {
            for g in &l.gpus {
                if let Some(first) = owner.insert((l.at, *g), l.id) {
                    out.push(format!(
                        "node {} gpu {g}: leases {first} and {}",
                        self.nodes[l.at].name, l.id
                    ));
                }
            }
        }
        out
    }

    fn restart(&mut self, _now: UnixMillis) -> Vec<String> {
        // The schedule keeps its whole state durable; a restart changes nothing.
        Vec::new()
    }
}
