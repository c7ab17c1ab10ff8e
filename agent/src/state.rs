//! What the agent's tasks share: the desired state from the coordinator, what the reconcile
//! loop last observed (the replica's state among it, from which the load balancer's
//! readiness is derived), the phase log, and the agent's own metrics.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use nightshift_common::{DesiredNode, JobRun, PhaseRecord, ReplicaState, SequenceKind, UnixMillis};
use nightshift_planner::lifecycle;
use nightshift_planner::{IllegalMove, ReplicaEvent};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::telemetry::Telemetry;

/// Phases kept for heartbeats; the coordinator deduplicates by `seq`.
const PHASES_SENT: usize = 32;

#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// Private, so that nothing outside this module can assign it: [`Shared::replica_event`]
    /// is its one writer, through the replica's transition function. Read it with
    /// [`Observed::replica`].
    replica: ReplicaState,
    /// Where the replica answers, once its container runs.
    pub replica_url: Option<String>,
    pub runs: Vec<JobRun>,
    pub applied_version: u64,
    /// Leases stopped by the fail-safe, reported until the coordinator drops them.
    pub expired_leases: Vec<u64>,
}

impl Observed {
    /// The replica's state, as its transition function last left it.
    pub fn replica(&self) -> ReplicaState {
        self.replica
    }
}

pub struct Shared {
    pub node: String,
    observed: Mutex<Observed>,
    phases: Mutex<VecDeque<PhaseRecord>>,
    next_seq: AtomicU64,
    /// This process among the agent's restarts (see [`PhaseRecord::instance`]).
    instance: u64,
    desired: watch::Sender<Option<DesiredNode>>,
    /// When the coordinator last answered a heartbeat.
    last_contact: Mutex<Option<Instant>>,
    /// The agent's own metrics.
    pub telemetry: Telemetry,
}

/// A random id for this agent process: the standard library's per-process random hash keys,
/// mixed with the start time and the process id.
fn instance_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

pub fn now_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Shared {
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_owned(),
            observed: Mutex::new(Observed {
                replica: ReplicaState::Stopped,
                replica_url: None,
                runs: Vec::new(),
                applied_version: 0,
                expired_leases: Vec::new(),
            }),
            phases: Mutex::new(VecDeque::new()),
            next_seq: AtomicU64::new(1),
            instance: instance_id(),
            desired: watch::channel(None).0,
            last_contact: Mutex::new(None),
            telemetry: Telemetry::new(),
        }
    }

    /// Whether the load balancer may send requests to this node's replica: only while it
    /// serves (not starting, draining, asleep or stopped).
    pub fn ready(&self) -> bool {
        let o = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        lifecycle::ready(o.replica)
    }

    /// Moves the replica's state by `event` through its transition function, the only way it
    /// changes; readiness follows.
    pub fn replica_event(&self, event: ReplicaEvent) -> Result<ReplicaState, IllegalMove> {
        let (from, to) = {
            let mut o = self.observed.lock().unwrap_or_else(|p| p.into_inner());
            let from = o.replica;
            o.replica = lifecycle::apply(from, event)?;
            (from, o.replica)
        };
        let ready = lifecycle::ready(to);
        self.telemetry.ready(ready);
        if from != to {
            tracing::info!(node = %self.node, from = from.as_str(), to = to.as_str(), "replica state changed");
        }
        if lifecycle::ready(from) != ready {
            tracing::info!(node = %self.node, ready, "readiness changed");
        }
        Ok(to)
    }

    pub fn observed(&self) -> Observed {
        self.observed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn update(&self, f: impl FnOnce(&mut Observed)) {
        f(&mut self.observed.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Records a finished phase of a drain or reclaim sequence.
    pub fn record_phase(&self, sequence: SequenceKind, phase: &str, started: Instant) {
        let took = started.elapsed();
        self.telemetry.phase(sequence, phase, took);
        let duration_ms = took.as_millis() as u64;
        let record = PhaseRecord {
            seq: self.next_seq.fetch_add(1, Ordering::SeqCst),
            instance: Some(self.instance),
            sequence,
            phase: phase.to_owned(),
            started_at: now_ms().saturating_sub(duration_ms),
            duration_ms,
        };
        tracing::info!(node = %self.node, sequence = ?sequence, phase, duration_ms, "phase done");
        let mut phases = self.phases.lock().unwrap_or_else(|p| p.into_inner());
        phases.push_back(record);
        if phases.len() > PHASES_SENT {
            phases.pop_front();
        }
    }

    pub fn phases(&self) -> Vec<PhaseRecord> {
        self.phases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    pub fn desired(&self) -> Option<DesiredNode> {
        self.desired.borrow().clone()
    }

    pub fn subscribe_desired(&self) -> watch::Receiver<Option<DesiredNode>> {
        self.desired.subscribe()
    }

    /// Offers a desired state heard from the coordinator; one older than what is held (a
    /// late answer) is dropped.
    pub fn offer_desired(&self, desired: DesiredNode) {
        self.desired.send_if_modified(|held| {
            let newer = nightshift_planner::pass::supersedes(&desired, held.as_ref());
            if newer {
                *held = Some(desired);
            }
            newer
        });
    }

    pub fn contact(&self) {
        self.contact_since(Instant::now());
    }

    /// The coordinator acknowledged a heartbeat sent at `sent`: the node's leases were renewed
    /// no earlier than that.
    pub fn contact_since(&self, sent: Instant) {
        let mut last = self.last_contact.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|t| t < sent) {
            *last = Some(sent);
        }
    }

    /// How long since the coordinator last acknowledged a heartbeat, counted from its sending
    /// (`None` before the first).
    pub fn since_contact(&self) -> Option<std::time::Duration> {
        self.last_contact
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|t| t.elapsed())
    }
}
