//! A simulated cluster for core tests: agents that follow their desired state the way the
//! real agent does (drain before jobs, jobs stopped before serving), driven by a virtual
//! clock, in the manner of quinn-proto's test `Pair`.

#![allow(dead_code)]

use std::collections::BTreeMap;

use nightshift_common::{
    CheckpointPolicy, CheckpointStorage, GpuInfo, GpuStatus, Heartbeat, HostFacts, JobRun,
    JobRunState, JobSpec, ReplicaState, ReplicaStatus, RetryPolicy, ServingSignals,
};
use nightshift_core::{Core, CoreConfig, CoreSnapshot, ScaleDown, ScaleUp, ServicePolicy};

pub const TICK_MS: u64 = 1_000;

pub fn spec(name: &str, gpus: u32) -> JobSpec {
    JobSpec {
        name: name.into(),
        image: "trainer:1".into(),
        command: vec![],
        args: vec![],
        env: vec![],
        gpus,
        nodes: 1,
        priority: 0,
        owner: None,
        checkpoint: CheckpointPolicy::default(),
        retry: RetryPolicy::default(),
        capture: Default::default(),
        files: Vec::new(),
        sandbox: Default::default(),
        max_run_seconds: None,
    }
}

pub fn config(min_replicas: u32) -> CoreConfig {
    CoreConfig {
        heartbeat_interval_ms: TICK_MS,
        lease_ttl_ms: 5_000,
        services: vec![ServicePolicy {
            name: "llm".into(),
            min_replicas,
            scale_down: ScaleDown {
                max_waiting: 0.0,
                max_running_per_replica: 2.0,
                window_ms: 3_000,
                ..ScaleDown::default()
            },
            scale_up: ScaleUp {
                waiting_per_replica: 2.0,
                running_per_replica: 8.0,
                ..ScaleUp::default()
            },
            cooldown_ms: 2_000,
            gateway_signal_ttl_ms: 3_000,
            ..ServicePolicy::default()
        }],
        ..CoreConfig::default()
    }
}

/// One simulated agent.
#[derive(Debug, Clone)]
pub struct SimAgent {
    pub name: String,
    pub gpus: u32,
    pub replica: ReplicaState,
    pub runs: Vec<JobRun>,
    /// Steps each job runs before exiting 0, by job id.
    pub durations: BTreeMap<u64, u32>,
    pub progress: BTreeMap<(u64, u64), u32>,
    pub applied: u64,
    pub signals: ServingSignals,
    /// A silent agent neither heartbeats nor acts (a partition or a crash).
    pub silent: bool,
    /// Highest lease epoch honoured per GPU.
    pub fenced: BTreeMap<u32, u64>,
    /// Exit code of each job when it ends by itself (0 when not set).
    pub exit_codes: BTreeMap<u64, i64>,
    /// Last checkpoint time each job reports, by job id.
    pub checkpoints: BTreeMap<u64, u64>,
    /// GPUs the agent reports unhealthy, and why.
    pub unhealthy: BTreeMap<u32, String>,
    /// The agent keeps checkpoints on storage every node mounts (its host facts say so).
    pub checkpoint_storage: CheckpointStorage,
    /// Jobs whose image the agent is still pulling: their members are not ready.
    pub pulling: std::collections::BTreeSet<u64>,
    /// Jobs whose image the agent cannot pull: their members fail to start.
    pub pull_fails: std::collections::BTreeSet<u64>,
    /// The host's checkpoint volume is short of space: it refuses every job it is leased.
    pub short_of_space: bool,
}

impl SimAgent {
    pub fn new(name: &str, gpus: u32) -> Self {
        Self {
            name: name.into(),
            gpus,
            replica: ReplicaState::Starting,
            runs: Vec::new(),
            durations: BTreeMap::new(),
            progress: BTreeMap::new(),
            applied: 0,
            signals: ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                ..Default::default()
            },
            silent: false,
            fenced: BTreeMap::new(),
            exit_codes: BTreeMap::new(),
            checkpoints: BTreeMap::new(),
            unhealthy: BTreeMap::new(),
            checkpoint_storage: CheckpointStorage::Local,
            pulling: Default::default(),
            pull_fails: Default::default(),
            short_of_space: false,
        }
    }

    pub fn inventory(&self) -> Vec<GpuInfo> {
        (0..self.gpus)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{}-{i}", self.name),
                name: "sim".into(),
                memory_total_bytes: 80 << 30,
            })
            .collect()
    }

    /// One reconcile step towards the desired state, as the real agent orders it.
    pub fn step(&mut self, core: &Core) {
        let Some(desired) = core.desired(&self.name) else {
            return;
        };
        let leases: Vec<_> = desired
            .leases
            .iter()
            .filter(|l| {
                l.gpus
                    .iter()
                    .all(|g| self.fenced.get(g).is_none_or(|&e| l.epoch >= e))
            })
            .cloned()
            .collect();
        // Jobs not (or no longer) leased are stopped; exited ones are forgotten once their
        // lease is gone from the desired state.
        // A pending run has no container yet (the replica was still draining): unleased, it
        // is simply no longer reported, as the real agent does.
        self.runs.retain(|r| {
            leases.iter().any(|l| l.lease_id == r.lease_id)
                || !matches!(
                    r.state,
                    JobRunState::Exited { .. }
                        | JobRunState::Pending
                        | JobRunState::FailedToStart { .. }
                )
        });
        for r in &mut self.runs {
            let leased = leases.iter().any(|l| l.lease_id == r.lease_id);
            if !leased && !matches!(r.state, JobRunState::Exited { .. }) {
                r.state = JobRunState::Exited {
                    exit_code: 143,
                    stopped_by_agent: true,
                };
            }
        }
        let jobs_live = self
            .runs
            .iter()
            .any(|r| !matches!(r.state, JobRunState::Exited { .. }));
        if desired.serve && leases.is_empty() {
            self.replica = match self.replica {
                _ if jobs_live => ReplicaState::Stopped,
                ReplicaState::Stopped
                | ReplicaState::Sleeping
                | ReplicaState::Draining
                | ReplicaState::Failed => ReplicaState::Starting,
                ReplicaState::Starting | ReplicaState::Serving => ReplicaState::Serving,
            };
        } else {
            // A gang member held for its peers keeps the replica serving (the drain waits),
            // as the real agent's planner does.
            let held = |id: u64| {
                leases.iter().any(|l| {
                    l.lease_id == id && l.rendezvous.as_ref().is_some_and(|r| r.wait_for_peers)
                })
            };
            let all_held = leases.iter().all(|l| held(l.lease_id));
            self.replica = match self.replica {
                ReplicaState::Serving if all_held => ReplicaState::Serving,
                ReplicaState::Serving | ReplicaState::Starting => ReplicaState::Draining,
                _ => ReplicaState::Stopped,
            };
            for l in &leases {
                for g in &l.gpus {
                    self.fenced.insert(*g, l.epoch);
                }
                if !self.runs.iter().any(|r| r.lease_id == l.lease_id) {
                    self.runs.push(JobRun {
                        job_id: l.job_id,
                        attempt: l.attempt,
                        lease_id: l.lease_id,
                        epoch: l.epoch,
                        gpus: l.gpus.clone(),
                        state: JobRunState::Pending,
                        last_checkpoint_at: None,
                        outputs: BTreeMap::new(),
                        image_id: None,
                        image_digest: None,
                        ready: false,
                    });
                }
            }
            for r in &mut self.runs {
                if r.state == JobRunState::Pending && self.pull_fails.contains(&r.job_id) {
                    r.state = JobRunState::FailedToStart {
                        message: format!("pulling the image of job {} failed", r.job_id),
                        refused_by_host: false,
                    };
                }
                if r.state == JobRunState::Pending && self.short_of_space {
                    r.state = JobRunState::FailedToStart {
                        message: "the checkpoint volume is short of space".into(),
                        refused_by_host: true,
                    };
                }
                r.ready = r.state == JobRunState::Pending && !self.pulling.contains(&r.job_id);
            }
            if self.replica == ReplicaState::Stopped {
                for r in &mut self.runs {
                    if r.state == JobRunState::Pending && r.ready && !held(r.lease_id) {
                        r.state = JobRunState::Running;
                        r.ready = false;
                    }
                }
            }
        }
        for r in &mut self.runs {
            if r.state == JobRunState::Running {
                let done = self.progress.entry((r.job_id, r.lease_id)).or_default();
                *done += 1;
                if *done >= self.durations.get(&r.job_id).copied().unwrap_or(5) {
                    r.state = JobRunState::Exited {
                        exit_code: self.exit_codes.get(&r.job_id).copied().unwrap_or(0),
                        stopped_by_agent: false,
                    };
                }
            }
        }
        for r in &mut self.runs {
            r.last_checkpoint_at = self.checkpoints.get(&r.job_id).copied();
        }
        self.applied = desired.version;
    }

    pub fn heartbeat(&self) -> Heartbeat {
        let signals = if self.replica == ReplicaState::Serving {
            self.signals.clone()
        } else {
            ServingSignals::default()
        };
        Heartbeat {
            gpus: (0..self.gpus)
                .map(|i| match self.unhealthy.get(&i) {
                    Some(reason) => GpuStatus::unhealthy(i, 0, reason.as_str()),
                    None => GpuStatus::healthy(i, 0),
                })
                .collect(),
            replica: ReplicaStatus {
                state: self.replica,
                signals,
                url: Some(format!("http://{}:8000", self.name)),
            },
            jobs: self.runs.clone(),
            applied_version: self.applied,
            phases: vec![],
            expired_leases: vec![],
            host: (!self.checkpoint_storage.is_local()).then(|| HostFacts {
                checkpoint_storage: self.checkpoint_storage,
                ..HostFacts::default()
            }),
            agent_url: None,
            metrics_url: None,
        }
    }

    /// No GPU runs a job while the replica holds it.
    pub fn one_owner(&self) -> Result<(), String> {
        let jobs_running = self.runs.iter().any(|r| r.state == JobRunState::Running);
        if jobs_running && self.replica != ReplicaState::Stopped {
            return Err(format!(
                "{}: jobs run while the replica is {:?}",
                self.name, self.replica
            ));
        }
        let mut seen = BTreeMap::new();
        for r in self.runs.iter().filter(|r| r.state == JobRunState::Running) {
            for g in &r.gpus {
                if let Some(other) = seen.insert(*g, r.lease_id) {
                    return Err(format!(
                        "{} gpu {g}: leases {other} and {}",
                        self.name, r.lease_id
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A core and its simulated agents on a virtual clock.
/// Each job's id, state and attempt: `1:running#1 2:queued#1`.
pub fn states(c: &Cluster) -> String {
    c.core
        .jobs()
        .iter()
        .map(|j| format!("{}:{}#{}", j.id, j.state.as_str(), j.attempt))
        .collect::<Vec<_>>()
        .join(" ")
}

pub struct Cluster {
    pub core: Core,
    pub agents: Vec<SimAgent>,
    pub now: u64,
}

impl Cluster {
    pub fn new(config: CoreConfig, nodes: &[(&str, u32)]) -> Self {
        Self::new_at(config, nodes, 1_000_000)
    }

    /// A cluster whose clock starts at `now` (Unix ms).
    pub fn new_at(config: CoreConfig, nodes: &[(&str, u32)], now: u64) -> Self {
        let mut core = Core::new(config);
        let agents: Vec<SimAgent> = nodes.iter().map(|(n, g)| SimAgent::new(n, *g)).collect();
        for a in &agents {
            core.register(now, &a.name, "llm", a.inventory())
                .expect("register");
        }
        Self { core, agents, now }
    }

    /// One heartbeat interval: every agent acts and reports, then the clock advances.
    pub fn step(&mut self) {
        for a in self.agents.iter_mut().filter(|a| !a.silent) {
            a.step(&self.core);
            let beat = a.heartbeat();
            self.core
                .heartbeat(self.now, &a.name, beat)
                .expect("heartbeat");
        }
        self.now += TICK_MS;
        self.core.tick(self.now);
    }

    /// Jumps the clock by `ms`, then runs one step.
    pub fn jump(&mut self, ms: u64) {
        self.now += ms.saturating_sub(TICK_MS);
        self.step();
        self.assert_invariants();
    }

    pub fn run(&mut self, steps: usize) {
        for _ in 0..steps {
            self.step();
            self.assert_invariants();
        }
    }

    /// The core's durable state, as the coordinator persists it.
    pub fn snapshot(&self) -> CoreSnapshot {
        let (next_job_id, next_lease_id, next_epoch) = self.core.next_ids();
        CoreSnapshot {
            jobs: self.core.jobs(),
            nodes: self
                .core
                .node_names()
                .filter_map(|n| self.core.node_snapshot(n))
                .collect(),
            next_job_id,
            next_lease_id,
            next_epoch,
            profiles: Vec::new(),
        }
    }

    /// Restarts the core from its durable state, with `config`.
    pub fn restart(&mut self, config: CoreConfig) {
        self.core = Core::restore(config, self.snapshot(), self.now);
    }

    pub fn assert_invariants(&self) {
        let violations = self.core.check_invariants();
        assert!(violations.is_empty(), "at {}: {violations:?}", self.now);
        for a in &self.agents {
            if let Err(e) = a.one_owner() {
                panic!("at {}: {e}", self.now);
            }
        }
    }

    pub fn agent(&mut self, name: &str) -> &mut SimAgent {
        self.agents
            .iter_mut()
            .find(|a| a.name == name)
            .expect("agent")
    }

    pub fn load(&mut self, name: &str, waiting: f64, running: f64) {
        let a = self.agent(name);
        a.signals.requests_waiting = Some(waiting);
        a.signals.requests_running = Some(running);
    }
}
