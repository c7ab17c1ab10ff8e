//! Random sequences of desired states, silences and waits, run on the fakes under paused
//! time, with ARCHITECTURE.md's invariants checked after every pass (as
//! `core/tests/properties.rs` does for the coordinator's core):
//!
//! - no GPU is given to two owners (invariant 2): no two running jobs share a GPU, and a job
//!   runs only beside a replica that is stopped or asleep;
//! - a job never starts until its GPUs' memory is free (invariant 2; down to a sleeping
//!   replica's CUDA context in sleep mode);
//! - a stale lease is never honoured (invariant 3): no job starts on a GPU below an epoch
//!   already started there;
//! - readiness is exactly `Serving`;
//! - a pass that ends well leaves the node as told: serving with no job, or every listed
//!   lease run (or reported failed to start); when the coordinator is silent past the TTL,
//!   serving with the leases void (invariant 5, service first).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use nightshift_common::{
    CheckpointPolicy, DesiredNode, HostFacts, JobSpec, LeaseGrant, ReplicaState, labels,
};
use proptest::prelude::*;

use super::Reconciler;
use crate::config::{AgentConfig, ReclaimMode};
use crate::engine::ContainerState;
use crate::fake::{Behaviour, FakeNode, VllmBehaviour};
use crate::host::FixedHost;
use crate::state::Shared;

const GIB: u64 = 1 << 30;
const TTL_MS: u64 = 20_000;

#[derive(Debug, Clone)]
enum Move {
    Serve,
    /// Jobs on these GPU sets (bit masks of 4 GPUs), those overlapping an earlier one
    /// dropped; `keep` re-lists the current leases instead of new ones where they fit.
    Lend {
        masks: Vec<u8>,
        keep: bool,
    },
    /// Lend, then serve again this many seconds into the pass (mid-drain).
    LendThenServe {
        after_s: u64,
    },
    /// The coordinator says nothing for longer than a lease lives.
    Silence,
    /// Time passes; the coordinator answers as before.
    Idle {
        secs: u64,
    },
}

fn moves() -> impl Strategy<Value = Move> {
    prop_oneof![
        2 => Just(Move::Serve),
        3 => (prop::collection::vec(1u8..16, 1..4), any::<bool>())
            .prop_map(|(masks, keep)| Move::Lend { masks, keep }),
        1 => (0u64..8).prop_map(|after_s| Move::LendThenServe { after_s }),
        1 => Just(Move::Silence),
        1 => (1u64..30).prop_map(|secs| Move::Idle { secs }),
    ]
}

#[derive(Debug, Clone)]
struct Host {
    sleep_mode: bool,
    sleep_frees: bool,
    ignores_signal: bool,
    exits_after_s: Option<u64>,
    frees_after_s: u64,
}

fn hosts() -> impl Strategy<Value = Host> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::option::of(5u64..60),
        0u64..5,
    )
        .prop_map(
            |(sleep_mode, sleep_frees, ignores_signal, exits_after_s, frees_after_s)| Host {
                sleep_mode,
                sleep_frees,
                ignores_signal,
                exits_after_s,
                frees_after_s,
            },
        )
}

struct World {
    node: FakeNode,
    shared: Arc<Shared>,
    cfg: Arc<AgentConfig>,
    r: Reconciler<crate::fake::FakeEngine, crate::fake::FakeHostGpus, crate::fake::FakeVllm>,
    version: u64,
    next_lease: u64,
    leases: Vec<LeaseGrant>,
    _dir: tempfile::TempDir,
}

impl World {
    fn new(host: &Host) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = AgentConfig {
            node: "n1".into(),
            work_dir: dir.path().to_path_buf(),
            readiness_grace_s: 1.0,
            drain_timeout_s: 20.0,
            free_timeout_s: 10.0,
            health_timeout_s: 60.0,
            ..AgentConfig::default()
        };
        cfg.replica.host_port = 0;
        cfg.replica.shutdown_timeout_s = 5.0;
        cfg.replica.sleep_free_timeout_s = 2.0;
        if host.sleep_mode {
            cfg.replica.reclaim = ReclaimMode::Sleep;
        }
        let node = FakeNode::new("n1", 4);
        node.set_memory_frees_after(Duration::from_secs(host.frees_after_s));
        node.set_vllm(VllmBehaviour {
            asleep_bytes: if host.sleep_frees { GIB } else { 30 * GIB },
            ..VllmBehaviour::default()
        });
        node.behave(
            "trainer:1",
            Behaviour {
                ignores_signal: host.ignores_signal,
                exits_after: host.exits_after_s.map(|s| (Duration::from_secs(s), 0)),
                ..Behaviour::default()
            },
        );
        let shared = Arc::new(Shared::new("n1"));
        let cfg = Arc::new(cfg);
        let r = Reconciler::new(
            cfg.clone(),
            node.engine.clone(),
            node.gpus.clone(),
            node.vllm.clone(),
            shared.clone(),
        )
        .with_host(Arc::new(FixedHost::new(HostFacts {
            checkpoint_volume_free_bytes: Some(100 * GIB),
            ..HostFacts::default()
        })));
        Self {
            node,
            shared,
            cfg,
            r,
            version: 0,
            next_lease: 1,
            leases: Vec::new(),
            _dir: dir,
        }
    }

    fn desired(&mut self, serve: bool) -> DesiredNode {
        self.version += 1;
        DesiredNode {
            version: self.version,
            serve,
            leases: self.leases.clone(),
            lease_ttl_ms: TTL_MS,
        }
    }

    fn lend(&mut self, masks: &[u8], keep: bool) {
        let mut taken = 0u8;
        let mut leases = Vec::new();
        if keep {
            for l in &self.leases {
                let mask = l.gpus.iter().fold(0u8, |m, g| m | 1 << g);
                taken |= mask;
                leases.push(l.clone());
            }
        }
        for &mask in masks {
            if mask & taken != 0 {
                continue;
            }
            taken |= mask;
            let gpus: Vec<u32> = (0..4).filter(|g| mask & (1 << g) != 0).collect();
            let id = self.next_lease;
            self.next_lease += 1;
            leases.push(LeaseGrant {
                lease_id: id,
                epoch: id,
                job_id: id,
                attempt: 1,
                job: JobSpec {
                    checkpoint: CheckpointPolicy {
                        signal: "SIGTERM".into(),
                        grace_period_seconds: 4,
                    },
                    ..JobSpec::new("j", "trainer:1", gpus.len() as u32)
                },
                gpus,
                rendezvous: None,
            });
        }
        self.leases = leases;
    }

    /// ARCHITECTURE.md's invariants 2 and 3 (and readiness), whatever the pass returned.
    fn check_always(&self) {
        let containers = self.node.containers();
        let running_jobs: Vec<_> = containers
            .iter()
            .filter(|c| c.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_JOB))
            .filter(|c| c.state == ContainerState::Running)
            .collect();
        let mut owner: BTreeMap<u32, &str> = BTreeMap::new();
        for c in &running_jobs {
            for g in nightshift_planner::gpus_of(c) {
                if let Some(other) = owner.insert(g, &c.id) {
                    panic!("gpu {g} runs both {other} and {}", c.id);
                }
            }
        }
        let replica_running = containers.iter().any(|c| {
            c.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_REPLICA)
                && c.state == ContainerState::Running
        });
        if !running_jobs.is_empty() && replica_running {
            assert_eq!(
                self.node.replica_asleep(),
                Some(true),
                "a job runs beside an awake replica"
            );
        }
        let mut epochs: BTreeMap<u32, u64> = BTreeMap::new();
        for s in self.node.starts() {
            if s.labels.get(labels::ROLE).map(String::as_str) != Some(labels::ROLE_JOB) {
                continue;
            }
            let limit = self
                .cfg
                .free_memory_bytes
                .max(self.cfg.replica.sleep_max_used_bytes);
            assert!(
                s.held_bytes <= limit,
                "{} started on gpus {:?} holding {} bytes",
                s.id,
                s.gpus,
                s.held_bytes
            );
            let epoch: u64 = s.labels[labels::EPOCH].parse().unwrap();
            for g in &s.gpus {
                let seen = epochs.entry(*g).or_default();
                assert!(epoch >= *seen, "stale epoch {epoch} started on gpu {g}");
                *seen = epoch;
            }
        }
        let o = self.shared.observed();
        assert_eq!(self.shared.ready(), o.replica() == ReplicaState::Serving);
    }

    /// What a pass that ended well must leave.
    fn check_done(&self, serve: bool, silent: bool) {
        let o = self.shared.observed();
        let running_jobs = self
            .node
            .containers_of(labels::ROLE_JOB)
            .into_iter()
            .filter(|c| c.state == ContainerState::Running)
            .count();
        if serve || silent {
            assert_eq!(o.replica(), ReplicaState::Serving, "serving");
            assert_eq!(running_jobs, 0, "no job runs on a serving node");
        } else {
            assert!(
                matches!(o.replica(), ReplicaState::Stopped | ReplicaState::Sleeping),
                "lent: {:?}",
                o.replica()
            );
            for l in &self.leases {
                if o.expired_leases.contains(&l.lease_id) {
                    continue;
                }
                assert!(
                    o.runs.iter().any(|r| r.lease_id == l.lease_id),
                    "lease {} has no run: {:?}",
                    l.lease_id,
                    o.runs
                );
            }
        }
        if silent && !self.leases.is_empty() {
            assert!(!o.expired_leases.is_empty(), "the leases are void");
        }
    }

    async fn play(&mut self, m: &Move) {
        let (serve, silent) = match m {
            Move::Serve => {
                self.leases.clear();
                let d = self.desired(true);
                self.shared.offer_desired(d);
                self.shared.contact();
                (true, false)
            }
            Move::Lend { masks, keep } => {
                self.lend(masks, *keep);
                let d = self.desired(false);
                self.shared.offer_desired(d);
                self.shared.contact();
                (false, false)
            }
            Move::LendThenServe { after_s } => {
                self.lend(&[0b0011], false);
                let d = self.desired(false);
                self.shared.offer_desired(d);
                self.shared.contact();
                self.leases.clear();
                let serve = self.desired(true);
                let shared = self.shared.clone();
                let after = Duration::from_secs(*after_s);
                let surge = async move {
                    tokio::time::sleep(after).await;
                    shared.offer_desired(serve);
                };
                let (result, ()) = tokio::join!(self.r.pass(), surge);
                self.check_always();
                if result.is_ok() {
                    // The surge may have come after the pass: one more settles it.
                    self.shared.contact();
                    let again = self.r.pass().await;
                    self.check_always();
                    if again.is_ok() {
                        self.check_done(true, false);
                    }
                }
                return;
            }
            Move::Silence => {
                tokio::time::sleep(Duration::from_millis(TTL_MS + 1_000)).await;
                (self.leases.is_empty(), true)
            }
            Move::Idle { secs } => {
                tokio::time::sleep(Duration::from_secs(*secs)).await;
                self.shared.contact();
                (self.leases.is_empty(), false)
            }
        };
        let result = self.r.pass().await;
        self.check_always();
        if result.is_ok() {
            // A node whose every listed lease is void serves, however the coordinator
            // answers.
            let void = self.shared.observed().expired_leases;
            let all_void =
                !self.leases.is_empty() && self.leases.iter().all(|l| void.contains(&l.lease_id));
            self.check_done(serve || all_void, silent);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn the_invariants_hold_after_every_pass(
        host in hosts(),
        script in prop::collection::vec(moves(), 1..8),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let mut w = World::new(&host);
            w.play(&Move::Serve).await;
            for m in &script {
                w.play(m).await;
            }
        });
    }
}
