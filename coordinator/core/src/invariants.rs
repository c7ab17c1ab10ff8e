//! The invariants of ARCHITECTURE.md ("What always holds") that the core alone can check:
//! 1 (the serving floor), 2 (one owner per GPU), 3 (a stale lease is never honoured), 4 (one
//! live attempt per job) and 8 (the core's records agree); each [`Violation`] names its
//! number. Tests and the simulator call [`Core::check_invariants`] after every step.

use std::collections::BTreeMap;

use nightshift_common::{JobState, NodeMode};

use crate::core::Core;
use crate::node::Held;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// Invariant 1.
    #[error("service {service}: {serving} nodes serve, below min_replicas {min}")]
    ServingFloor {
        service: String,
        serving: usize,
        min: u32,
    },
    /// Invariant 2.
    #[error("node {node} gpu {gpu}: held by leases {first} and {second}")]
    GpuTwoLeases {
        node: String,
        gpu: u32,
        first: u64,
        second: u64,
    },
    /// Invariant 2.
    #[error("node {node}: serves while lease {lease} is still live on it")]
    LiveLeaseOnServingNode { node: String, lease: u64 },
    /// Invariant 3.
    #[error("lease {lease}: epoch {epoch} is not below the next epoch {next}")]
    EpochNotFenced { lease: u64, epoch: u64, next: u64 },
    /// Invariant 3.
    #[error("leases {first} and {second} share epoch {epoch}")]
    EpochReused { first: u64, second: u64, epoch: u64 },
    /// Invariant 8.
    #[error(
        "node {node}: counts {counted_leases} leases holding {counted_gpus} GPUs, the lease \
         table {leases} holding {gpus}"
    )]
    HeldMismatch {
        node: String,
        counted_leases: usize,
        counted_gpus: usize,
        leases: usize,
        gpus: usize,
    },
    /// Invariant 4.
    #[error(
        "job {job}: lease {lease} is live while the container of its expired lease {straggler} \
         may still run on silent node {node}"
    )]
    TwoLiveContainers {
        job: u64,
        lease: u64,
        straggler: u64,
        node: String,
    },
    /// Invariant 8.
    #[error("job {job}: the queue index does not match its record")]
    JobIndexStale { job: u64 },
    /// Invariant 8.
    #[error("job {job}: state {state} does not match its lease ({lease})")]
    JobLeaseMismatch {
        job: u64,
        state: &'static str,
        lease: String,
    },
}

impl Core {
    pub fn check_invariants(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        self.check_floor(&mut out);
        self.check_gpu_owners(&mut out);
        self.check_fencing(&mut out);
        self.check_jobs(&mut out);
        self.check_held(&mut out);
        self.check_stragglers(&mut out);
        if let Some(job) = self.index.stale_entry(self.jobs.values()) {
            out.push(Violation::JobIndexStale { job });
        }
        out
    }

    /// What each node counts of its leases is what the lease table holds on it.
    fn check_held(&self, out: &mut Vec<Violation>) {
        for n in self.nodes.values() {
            let table = Held::of(self.leases.on_node(&n.name));
            if n.held != table {
                out.push(Violation::HeldMismatch {
                    node: n.name.clone(),
                    counted_leases: n.held.leases,
                    counted_gpus: n.held.gpus,
                    leases: table.leases,
                    gpus: table.gpus,
                });
            }
        }
    }

    /// No job has two live containers, as far as the core can know: a job whose expired
    /// lease's container may still run on a silent node holds no live lease elsewhere.
    fn check_stragglers(&self, out: &mut Vec<Violation>) {
        for s in self.leases.stragglers() {
            let Some(job) = self.jobs.get(&s.job) else {
                continue;
            };
            if let Some(l) = job
                .leases
                .iter()
                .filter_map(|id| self.leases.get(*id))
                .find(|l| !l.revoked)
            {
                out.push(Violation::TwoLiveContainers {
                    job: s.job,
                    lease: l.id,
                    straggler: s.lease,
                    node: s.node.clone(),
                });
            }
        }
    }

    /// Never fewer than `min_replicas` nodes in serve mode, as long as the service has that
    /// many nodes at all.
    fn check_floor(&self, out: &mut Vec<Violation>) {
        for policy in &self.config.services {
            let nodes: Vec<_> = self
                .nodes
                .values()
                .filter(|n| n.service == policy.name)
                .collect();
            let serving = nodes.iter().filter(|n| n.mode == NodeMode::Serve).count();
            if serving < (policy.min_replicas as usize).min(nodes.len()) {
                out.push(Violation::ServingFloor {
                    service: policy.name.clone(),
                    serving,
                    min: policy.min_replicas,
                });
            }
        }
    }

    /// One owner per GPU: no two leases share a GPU, and a serving node has no live lease.
    fn check_gpu_owners(&self, out: &mut Vec<Violation>) {
        let mut owner: BTreeMap<(&str, u32), u64> = BTreeMap::new();
        for l in self.leases.all() {
            for &gpu in &l.gpus {
                if let Some(first) = owner.insert((&l.node, gpu), l.id) {
                    out.push(Violation::GpuTwoLeases {
                        node: l.node.clone(),
                        gpu,
                        first,
                        second: l.id,
                    });
                }
            }
            let serving = self
                .nodes
                .get(&l.node)
                .is_some_and(|n| n.mode == NodeMode::Serve);
            if serving && !l.revoked {
                out.push(Violation::LiveLeaseOnServingNode {
                    node: l.node.clone(),
                    lease: l.id,
                });
            }
        }
    }

    fn check_fencing(&self, out: &mut Vec<Violation>) {
        let next = self.leases.next_epoch();
        let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
        for l in self.leases.all() {
            if l.epoch >= next {
                out.push(Violation::EpochNotFenced {
                    lease: l.id,
                    epoch: l.epoch,
                    next,
                });
            }
            if let Some(first) = seen.insert(l.epoch, l.id) {
                out.push(Violation::EpochReused {
                    first,
                    second: l.id,
                    epoch: l.epoch,
                });
            }
        }
    }

    /// Starting and running jobs hold only live leases, jobs being stopped only revoked
    /// ones, other jobs none; every lease a job holds is in the table and names the job.
    fn check_jobs(&self, out: &mut Vec<Violation>) {
        for j in self.jobs.values() {
            let leases: Vec<_> = j.leases.iter().map(|id| self.leases.get(*id)).collect();
            let all = |f: &dyn Fn(&crate::lease::Lease) -> bool| {
                !leases.is_empty()
                    && leases
                        .iter()
                        .all(|l| l.is_some_and(|l| l.job == j.id && f(l)))
            };
            let ok = match j.state {
                JobState::Starting | JobState::Running => all(&|l| !l.revoked),
                JobState::Preempting | JobState::Cancelling | JobState::Failing => {
                    all(&|l| l.revoked)
                }
                _ => j.leases.is_empty(),
            };
            if !ok {
                out.push(Violation::JobLeaseMismatch {
                    job: j.id,
                    state: j.state.as_str(),
                    lease: format!(
                        "{:?}",
                        leases
                            .iter()
                            .map(|l| l.map(|l| (l.id, l.revoked)))
                            .collect::<Vec<_>>()
                    ),
                });
            }
        }
    }
}
