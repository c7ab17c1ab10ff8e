//! The invariants, checked from the outside: what the API says, what each host's engine
//! holds, what each agent's readiness answers. A [`Snapshot`] is one look at all of them; the
//! checks are plain functions of snapshots and of the [`Ledger`], the harness's own record of
//! what it submitted and saw.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use nightshift_common::{JobState, JobView, NodeMode, NodeView, PipelineRunView};

use super::rig::{Rig, Seen};

/// GPUs per rig host (`[gpus] fake = 4` in up.sh): a running replica holds all of them.
pub const GPUS: u32 = 4;

/// One look at the cluster. A part that did not answer is `None`.
pub struct Snapshot {
    /// When the look began (a job submitted after it may be missing from it).
    pub started: Instant,
    pub at: Instant,
    pub now_ms: u64,
    pub jobs: Option<Vec<JobView>>,
    pub nodes: Option<Vec<NodeView>>,
    pub engines: Vec<Option<Vec<Seen>>>,
}

impl Snapshot {
    pub async fn take(rig: &Rig) -> Self {
        let started = Instant::now();
        let (jobs, nodes, engines) = tokio::join!(
            rig.api.jobs(),
            rig.api.nodes(),
            futures_util::future::join_all((1..=rig.hosts).map(|i| rig.containers(i)))
        );
        Self {
            started,
            at: Instant::now(),
            now_ms: crate::now_ms(),
            jobs: jobs.ok().map(|l| l.jobs),
            nodes: nodes.ok().map(|l| l.nodes),
            engines,
        }
    }

    /// Job containers running on any host, by job: (host, container).
    pub fn running_jobs(&self) -> BTreeMap<u64, Vec<(usize, &Seen)>> {
        let mut out: BTreeMap<u64, Vec<(usize, &Seen)>> = BTreeMap::new();
        for (i, engine) in self.engines.iter().enumerate() {
            for c in engine.iter().flatten() {
                if let (true, Some(job)) = (c.running, c.job) {
                    out.entry(job).or_default().push((i + 1, c));
                }
            }
        }
        out
    }

    pub fn node(&self, host: usize) -> Option<&NodeView> {
        let name = format!("gpu{host}");
        self.nodes.as_ref()?.iter().find(|n| n.name == name)
    }
}

/// What the harness submitted and what it has seen of it.
#[derive(Default)]
pub struct Ledger {
    /// Every job the coordinator accepted.
    pub jobs: BTreeMap<u64, Tracked>,
    pub pipelines: BTreeSet<u64>,
    /// The newest view of each pipeline run.
    pub runs: BTreeMap<u64, PipelineRunView>,
}

pub struct Tracked {
    /// When its submission was answered.
    pub since: Instant,
    /// The state last seen (`None`: not seen yet).
    pub state: Option<JobState>,
}

impl Ledger {
    /// Job `id` was accepted just now.
    pub fn track(&mut self, id: u64) {
        self.jobs.entry(id).or_insert(Tracked {
            since: Instant::now(),
            state: None,
        });
    }
}

/// The invariants that hold at every moment. Each violation is one line naming what broke.
pub fn always(s: &Snapshot, ledger: &mut Ledger) -> Vec<String> {
    let mut v = Vec::new();
    for (i, engine) in s.engines.iter().enumerate() {
        let Some(list) = engine else { continue };
        let host = i + 1;
        let running: Vec<&Seen> = list.iter().filter(|c| c.running).collect();
        let replicas = running.iter().filter(|c| c.replica).count();
        if replicas > 1 {
            v.push(format!("gpu{host}: {replicas} replica containers run"));
        }
        // No GPU held by two containers (a running replica holds every GPU of its host).
        let mut holder: BTreeMap<u32, &str> = BTreeMap::new();
        for c in &running {
            let gpus: Vec<u32> = if c.replica {
                (0..GPUS).collect()
            } else {
                c.gpus.clone()
            };
            for g in gpus {
                if let Some(other) = holder.insert(g, &c.name) {
                    v.push(format!(
                        "gpu{host}: GPU {g} held by {other} and {} at once",
                        c.name
                    ));
                }
            }
        }
    }
    if let Some(jobs) = &s.jobs {
        // No GPU of a node in two live leases.
        let mut leased: BTreeMap<(&str, u32), u64> = BTreeMap::new();
        for j in jobs {
            for l in j
                .leases
                .iter()
                .filter(|l| !l.revoked && l.expires_at > s.now_ms)
            {
                for g in &l.gpus {
                    if let Some(other) = leased.insert((&l.node, *g), l.lease_id) {
                        v.push(format!(
                            "{} GPU {g} in leases {other} and {} at once",
                            l.node, l.lease_id
                        ));
                    }
                }
            }
        }
        // Each job once, none lost, none back from a finished state.
        let mut seen = BTreeSet::new();
        for j in jobs {
            if !seen.insert(j.id) {
                v.push(format!("job {} listed twice", j.id));
            }
            if let Some(t) = ledger.jobs.get_mut(&j.id) {
                if let Some(prev) = t.state
                    && prev.is_finished()
                    && prev != j.state
                {
                    v.push(format!(
                        "job {} was {} and is {} again",
                        j.id,
                        prev.as_str(),
                        j.state.as_str()
                    ));
                }
                t.state = Some(j.state);
            }
        }
        for (id, t) in &ledger.jobs {
            if t.since < s.started && !seen.contains(id) {
                v.push(format!("job {id} is gone from the list"));
            }
        }
    }
    if let Some(nodes) = &s.nodes {
        // The serving floor: min_replicas = 1 in the rig's coordinator.toml.
        if !nodes.iter().any(|n| n.mode == NodeMode::Serve) {
            v.push("no node is meant to serve (the floor is 1)".to_owned());
        }
    }
    v
}

/// A pipeline run's steps each ran at most as often as their retries allow.
pub fn steps_once(run: &PipelineRunView) -> Vec<String> {
    run.nodes
        .iter()
        .filter(|n| n.jobs.len() > n.retries as usize + 1)
        .map(|n| {
            format!(
                "pipeline {} step {} ran {} jobs {:?} with {} retries",
                run.id,
                n.name,
                n.jobs.len(),
                n.jobs,
                n.retries
            )
        })
        .collect()
}

/// Why the cluster has not converged yet (`None` once it has): every engine answers, the API
/// answers, every node is reachable with its desired state applied, a node meant to serve
/// has its replica ready, a lent node runs no replica.
pub fn unsettled(s: &Snapshot, ready: &[bool]) -> Option<String> {
    let nodes = s.nodes.as_ref()?;
    s.jobs.as_ref()?;
    for (i, engine) in s.engines.iter().enumerate() {
        let host = i + 1;
        let Some(list) = engine else {
            return Some(format!("gpu{host}'s engine does not answer"));
        };
        let Some(n) = nodes.iter().find(|n| n.name == format!("gpu{host}")) else {
            return Some(format!("gpu{host} is not registered"));
        };
        if !n.reachable {
            return Some(format!("gpu{host} is unreachable"));
        }
        if n.applied_version != n.desired_version {
            return Some(format!(
                "gpu{host} applied {} of {}",
                n.applied_version, n.desired_version
            ));
        }
        let replica = list.iter().any(|c| c.replica && c.running);
        match n.mode {
            NodeMode::Serve if !ready[i] => return Some(format!("gpu{host} does not serve yet")),
            NodeMode::Lend if replica => {
                return Some(format!("gpu{host} is lent yet runs its replica"));
            }
            _ => {}
        }
    }
    None
}

/// On a settled cluster: every running job container runs under a live lease the coordinator
/// holds for that node (no orphan), and every lease of a running job has its container
/// (adopted, not lost).
pub fn settled(s: &Snapshot) -> Vec<String> {
    let mut v = Vec::new();
    let Some(jobs) = &s.jobs else {
        return vec!["the API does not answer".to_owned()];
    };
    let mut live: BTreeMap<u64, (&str, u64, JobState)> = BTreeMap::new();
    for j in jobs {
        for l in j.leases.iter().filter(|l| !l.revoked) {
            live.insert(l.lease_id, (&l.node, j.id, j.state));
        }
    }
    for (i, engine) in s.engines.iter().enumerate() {
        let host = format!("gpu{}", i + 1);
        for c in engine.iter().flatten().filter(|c| c.running && !c.replica) {
            match c.lease.and_then(|l| live.get(&l)) {
                Some((node, _, _)) if *node == host => {}
                _ => v.push(format!(
                    "{host}: container {} (job {:?}, lease {:?}) runs under no live lease",
                    c.name, c.job, c.lease
                )),
            }
        }
    }
    for j in jobs.iter().filter(|j| j.state == JobState::Running) {
        for l in j.leases.iter().filter(|l| !l.revoked) {
            let host: usize = l
                .node
                .strip_prefix("gpu")
                .and_then(|h| h.parse().ok())
                .unwrap_or(0);
            let found = s
                .engines
                .get(host.wrapping_sub(1))
                .and_then(Option::as_ref)
                .is_some_and(|list| {
                    list.iter()
                        .any(|c| c.running && c.lease == Some(l.lease_id))
                });
            if !found {
                v.push(format!(
                    "job {} runs on {} under lease {} with no container there",
                    j.id, l.node, l.lease_id
                ));
            }
        }
    }
    v
}
