//! A node as the core sees it: its GPUs, what its agent last reported, and whether it serves
//! or lends.

use std::collections::VecDeque;

use nightshift_common::{
    GpuInfo, GpuStatus, JobRun, JobRunState, NodeMode, PhaseRecord, ReplicaState, ReplicaStatus,
    UnixMillis,
};

use crate::lease::Lease;

/// How many finished phases a node keeps for display.
const PHASES_KEPT: usize = 32;

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub service: String,
    /// Where other nodes reach it (gang rendezvous).
    pub address: String,
    pub gpus: Vec<GpuInfo>,
    pub mode: NodeMode,
    /// Bumped on every change of this node's desired state.
    pub desired_version: u64,
    /// When the mode last changed.
    pub mode_since: UnixMillis,
    // What the agent last reported; empty until its first heartbeat.
    pub applied_version: u64,
    pub last_heartbeat: Option<UnixMillis>,
    pub gpu_status: Vec<GpuStatus>,
    pub replica: Option<ReplicaStatus>,
    pub runs: Vec<JobRun>,
    /// The phases kept, each numbered by the node (`seq`) in the order they arrived.
    pub phases: VecDeque<PhaseRecord>,
    /// The last phase taken from the agent: its process and its own `seq`. A record from
    /// another process (the agent restarted, its `seq` starts again) is new whatever its
    /// `seq`.
    phase_cursor: (Option<u64>, u64),
    /// Phases taken from the agent so far: the `seq` of the latest kept.
    phases_taken: u64,
    /// The latest complete reclaim among `phases`, in milliseconds (see
    /// [`Node::reclaim_ms`]), worked out when phases arrive rather than on every decision.
    reclaim_ms: Option<u64>,
    /// What the lease table holds on this node, kept in step with it where the core grants
    /// and releases: the decisions read every node's every second, and a lookup in the table
    /// per node was most of their cost. The invariant checks compare it with the table.
    pub(crate) held: Held,
    /// Its agent keeps checkpoints on storage every node reaches, a shared directory or a
    /// bucket (its host facts say so):
    /// what it reports holding, any node can resume.
    pub checkpoints_shared: bool,
}

/// The leases on a node and the GPUs they hold together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) leases: usize,
    pub(crate) gpus: usize,
}

impl Held {
    /// What `leases` (one node's) hold together.
    pub(crate) fn of<'a>(leases: impl Iterator<Item = &'a Lease>) -> Self {
        let mut held = Self::default();
        for l in leases {
            held.add(l.gpus.len());
        }
        held
    }

    pub(crate) fn add(&mut self, gpus: usize) {
        self.leases += 1;
        self.gpus += gpus;
    }

    /// Never below zero: a count out of step with the table is an invariant violation to
    /// report, not a reason to stop the coordinator.
    pub(crate) fn remove(&mut self, gpus: usize) {
        self.leases = self.leases.saturating_sub(1);
        self.gpus = self.gpus.saturating_sub(gpus);
    }
}

impl Node {
    pub(crate) fn new(name: &str, service: &str, gpus: Vec<GpuInfo>, now: UnixMillis) -> Self {
        Self {
            name: name.to_owned(),
            service: service.to_owned(),
            address: name.to_owned(),
            gpus,
            mode: NodeMode::Serve,
            desired_version: 1,
            mode_since: now,
            applied_version: 0,
            last_heartbeat: None,
            gpu_status: Vec::new(),
            replica: None,
            runs: Vec::new(),
            phases: VecDeque::new(),
            phase_cursor: (None, 0),
            phases_taken: 0,
            reclaim_ms: None,
            held: Held::default(),
            checkpoints_shared: false,
        }
    }

    /// How long the latest complete reclaim among the kept phases took: its `stop_jobs`,
    /// `confirm_free`, replica (`start_replica`, or `wake_replica` for a replica lent
    /// asleep) and `wait_health` phases, summed. A reclaim counts once its `wait_health` is
    /// recorded: one under way has reported only its quick first phases, and counting them
    /// would make the lead look seconds long while the replica still loads. `None` until a
    /// reclaim with a replica start or wake (the part no reclaim can skip) completed.
    pub fn reclaim_ms(&self) -> Option<u64> {
        self.reclaim_ms
    }

    fn latest_reclaim_ms(&self) -> Option<u64> {
        let reclaims: Vec<&PhaseRecord> = self
            .phases
            .iter()
            .filter(|p| p.sequence == nightshift_common::SequenceKind::Reclaim)
            .collect();
        let health = |p: &&PhaseRecord| p.phase == "wait_health";
        // The latest reclaim that ended: from the latest `wait_health` back to the one
        // before it.
        let end = reclaims.iter().rposition(health)?;
        let start = reclaims[..end]
            .iter()
            .rposition(health)
            .map_or(0, |i| i + 1);
        let span = &reclaims[start..=end];
        let latest = |phase: &dyn Fn(&str) -> bool| {
            span.iter()
                .rev()
                .find(|p| phase(&p.phase))
                .map(|p| p.duration_ms)
        };
        let replica = latest(&|p| p == "start_replica" || p == "wake_replica")?;
        let rest: u64 = ["stop_jobs", "confirm_free", "wait_health"]
            .iter()
            .filter_map(|&name| latest(&|p| p == name))
            .sum();
        Some(replica + rest)
    }

    /// Heard from within `ttl_ms`. A node never heard from since the coordinator started
    /// counts from when it was registered or restored (`mode_since` at the latest).
    pub fn reachable(&self, now: UnixMillis, ttl_ms: u64) -> bool {
        self.last_heartbeat.is_some_and(|t| now < t + ttl_ms)
    }

    /// The replica is up and marked ready.
    pub fn replica_serving(&self) -> bool {
        self.replica
            .as_ref()
            .is_some_and(|r| r.state == ReplicaState::Serving)
    }

    /// Whether any job container the agent reports still occupies a GPU.
    pub fn occupies_any(&self) -> bool {
        self.occupying().next().is_some()
    }

    /// Whether a job container the agent reports still occupies GPU `index`.
    pub fn occupies(&self, index: u32) -> bool {
        self.occupying().any(|g| g == index)
    }

    /// The GPUs of the job containers the agent reports as not yet gone (repeats possible).
    fn occupying(&self) -> impl Iterator<Item = u32> + '_ {
        occupying(&self.runs)
    }

    /// Whether the agent's last heartbeat reported GPU `index` unhealthy.
    pub fn reports_unhealthy(&self, index: u32) -> bool {
        self.unhealthy().any(|g| g == index)
    }

    /// How many GPUs the agent may be leased: those its last heartbeat did not report
    /// unhealthy.
    pub fn healthy_gpus(&self) -> usize {
        self.gpus.len().saturating_sub(self.unhealthy().count())
    }

    fn unhealthy(&self) -> impl Iterator<Item = u32> + '_ {
        self.gpu_status
            .iter()
            .filter(|s| !s.healthy)
            .map(|s| s.index)
    }

    /// Keeps the phases of a heartbeat not taken before (a heartbeat resends the agent's
    /// recent ones), renumbered in the node's own sequence so that readers keep one cursor
    /// across the agent's restarts.
    pub(crate) fn record_phases(&mut self, phases: &[PhaseRecord]) {
        let mut added = false;
        for p in phases {
            let (instance, last) = self.phase_cursor;
            if p.instance == instance && p.seq <= last {
                continue;
            }
            self.phase_cursor = (p.instance, p.seq);
            self.phases_taken += 1;
            self.phases.push_back(PhaseRecord {
                seq: self.phases_taken,
                ..p.clone()
            });
            added = true;
            if self.phases.len() > PHASES_KEPT {
                self.phases.pop_front();
            }
        }
        if added {
            self.reclaim_ms = self.latest_reclaim_ms();
        }
    }
}

/// GPUs the job containers among `runs` still occupy (repeats possible).
fn occupying(runs: &[JobRun]) -> impl Iterator<Item = u32> + Clone + '_ {
    runs.iter()
        .filter(|r| {
            !matches!(
                r.state,
                JobRunState::Exited { .. } | JobRunState::FailedToStart { .. }
            )
        })
        .flat_map(|r| r.gpus.iter().copied())
}

/// Whether two reports' job containers occupy the same GPUs, as sets, compared without
/// building either: a host's handful of GPUs are checked each way.
pub(crate) fn same_occupied(a: &[JobRun], b: &[JobRun]) -> bool {
    let (a, b) = (occupying(a), occupying(b));
    a.clone().all(|g| b.clone().any(|h| h == g)) && b.clone().all(|g| a.clone().any(|h| h == g))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(gpus: &[u32], state: JobRunState) -> JobRun {
        JobRun {
            job_id: 1,
            attempt: 0,
            lease_id: 1,
            epoch: 1,
            gpus: gpus.to_vec(),
            state,
            last_checkpoint_at: None,
            outputs: Default::default(),
            image_id: None,
            image_digest: None,
            ready: false,
        }
    }

    #[test]
    fn occupancy_is_compared_as_a_set_of_gpus_that_live_containers_hold() {
        let running = |g: &[u32]| run(g, JobRunState::Running);
        let exited = |g: &[u32]| {
            run(
                g,
                JobRunState::Exited {
                    exit_code: 0,
                    stopped_by_agent: false,
                },
            )
        };
        assert!(same_occupied(&[], &[]));
        assert!(same_occupied(
            &[running(&[0, 1]), running(&[3])],
            &[running(&[3, 1]), running(&[0, 0])]
        ));
        assert!(same_occupied(
            &[running(&[2]), exited(&[0])],
            &[running(&[2])]
        ));
        assert!(!same_occupied(&[running(&[2])], &[running(&[2, 3])]));
        assert!(!same_occupied(&[running(&[2, 3])], &[running(&[2])]));
        assert!(!same_occupied(&[running(&[1])], &[exited(&[1])]));
    }

    fn phase(instance: u64, seq: u64, name: &str) -> PhaseRecord {
        PhaseRecord {
            seq,
            instance: Some(instance),
            sequence: nightshift_common::SequenceKind::Reclaim,
            phase: name.into(),
            started_at: 0,
            duration_ms: 1,
        }
    }

    #[test]
    fn the_reclaim_lead_counts_a_wake_as_the_replica_phase() {
        let timed = |seq: u64, name: &str, ms: u64| PhaseRecord {
            duration_ms: ms,
            ..phase(1, seq, name)
        };
        let mut n = Node::new("a", "llm", Vec::new(), 0);
        n.record_phases(&[timed(1, "stop_jobs", 20_000)]);
        assert_eq!(n.reclaim_ms(), None, "no replica start or wake yet");
        // A replica lent asleep comes back by a wake: the lead is the jobs' stop and the wake.
        n.record_phases(&[
            timed(2, "wake_replica", 6_000),
            timed(3, "wait_health", 500),
        ]);
        assert_eq!(n.reclaim_ms(), Some(26_500));
        // The next reclaim, a cold start, counts only once it has ended: while its replica
        // loads, the lead stays the last whole reclaim's, not the seconds reported so far.
        n.record_phases(&[
            timed(4, "stop_jobs", 20_000),
            timed(5, "confirm_free", 1_000),
            timed(6, "start_replica", 500),
        ]);
        assert_eq!(n.reclaim_ms(), Some(26_500), "a reclaim under way");
        n.record_phases(&[timed(7, "wait_health", 225_000)]);
        assert_eq!(n.reclaim_ms(), Some(246_500));
    }

    fn kept(n: &Node) -> Vec<(u64, String)> {
        n.phases.iter().map(|p| (p.seq, p.phase.clone())).collect()
    }

    #[test]
    fn phases_of_a_restarted_agent_are_kept_and_resent_ones_are_not() {
        let mut n = Node::new("a", "llm", Vec::new(), 0);
        n.record_phases(&[phase(7, 1, "stop_jobs"), phase(7, 2, "confirm_free")]);
        // Resent with the next heartbeat, with one more.
        n.record_phases(&[
            phase(7, 1, "stop_jobs"),
            phase(7, 2, "confirm_free"),
            phase(7, 3, "start_replica"),
        ]);
        // The agent restarted: its own numbering starts again at 1.
        n.record_phases(&[phase(9, 1, "wait_health")]);
        n.record_phases(&[phase(9, 1, "wait_health")]);
        assert_eq!(
            kept(&n),
            [
                (1, "stop_jobs".into()),
                (2, "confirm_free".into()),
                (3, "start_replica".into()),
                (4, "wait_health".into()),
            ]
        );
    }
}
