//! A simulated cluster for core tests, in the manner of quinn-proto's test `Pair`: the real
//! core and, on every node, the agent's real planner running a modelled host
//! (`nightshift-hostmodel`), all on one virtual clock stepped a heartbeat interval at a time.
//! What a test sets on a node is what the world does to it (how long its jobs run and how
//! they exit, an image its host lacks, an unhealthy GPU, a full disk, a partition); what the
//! node does about it is the agent's own code.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use nightshift_common::{
    CheckpointPolicy, CheckpointStorage, JobRun, JobSpec, ReplicaState, RetryPolicy,
    ServingSignals, UnixMillis,
};
use nightshift_core::{Core, CoreConfig, CoreSnapshot, ScaleDown, ScaleUp, ServicePolicy};
use nightshift_hostmodel::{Agent, Exit, Host, Proc, Pull, Timings, Workload};
use nightshift_planner::{Moment, PlanConfig};

pub const TICK_MS: u64 = 1_000;

/// The image every job of [`spec`] runs.
pub const IMAGE: &str = "trainer:1";

pub fn spec(name: &str, gpus: u32) -> JobSpec {
    JobSpec {
        name: name.into(),
        image: IMAGE.into(),
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

/// The agents' configuration: `agent.toml`'s defaults, with the waits scaled to the tests'
/// one-second heartbeats (no grace before watching the queue, a short drain).
pub fn plan_config() -> PlanConfig {
    PlanConfig {
        readiness_grace: Duration::ZERO,
        drain_timeout: Duration::from_secs(10),
        ..PlanConfig::default()
    }
}

/// The hosts' transitions, each within one heartbeat: a replica loads in a second, stops
/// and sleeps at once.
pub fn timings() -> Timings {
    Timings {
        replica_start: Duration::from_secs(1),
        replica_stop: Duration::ZERO,
        sleep: Duration::ZERO,
        wake: Duration::ZERO,
        ..Timings::default()
    }
}

/// What the jobs on one host do.
#[derive(Debug, Clone, Default)]
pub struct Jobs {
    /// Seconds each job runs before it ends on its own, by job id (5 when not set).
    pub durations: BTreeMap<u64, u32>,
    /// Exit code of each job when it ends on its own (0 when not set).
    pub exit_codes: BTreeMap<u64, i64>,
    /// When each job last wrote a checkpoint, by job id.
    pub checkpoints: BTreeMap<u64, UnixMillis>,
}

impl Workload for Jobs {
    fn ends_at(&self, p: Proc<'_>, started: Moment) -> Option<Moment> {
        let secs = self.durations.get(&p.job).copied().unwrap_or(5);
        Some(started + Duration::from_secs(u64::from(secs)))
    }

    /// Checkpoints take no time: a signalled job exits at once.
    fn save(&self, _p: Proc<'_>) -> Duration {
        Duration::ZERO
    }

    fn exited(&mut self, _exit: &Exit) {}

    fn exit_code(&self, p: Proc<'_>) -> i64 {
        self.exit_codes.get(&p.job).copied().unwrap_or(0)
    }

    fn last_checkpoint_at(&self, job: u64) -> Option<UnixMillis> {
        self.checkpoints.get(&job).copied()
    }
}

/// One node: a modelled host and the agent's planner on it.
#[derive(Debug, Clone)]
pub struct SimAgent {
    pub name: String,
    pub host: Host,
    pub agent: Agent,
    pub jobs: Jobs,
    /// What the replica's vLLM reports while it is ready.
    pub signals: ServingSignals,
    /// Partitioned from the coordinator: neither its heartbeats nor the desired state cross
    /// (the agent acts on its own meanwhile, as it would).
    pub silent: bool,
    /// The host's checkpoint volume is short of space.
    pub short_of_space: bool,
    /// What the host's volume was last told.
    disk_full: bool,
    /// Where the cluster's clock started, which the agent counts from.
    origin: UnixMillis,
}

impl SimAgent {
    /// A node whose replica already serves, its agent just started.
    pub fn new(name: &str, gpus: u32, origin: UnixMillis) -> Self {
        Self {
            name: name.into(),
            host: Host::serving(name, gpus, timings()),
            agent: Agent::new(plan_config(), 1, origin),
            jobs: Jobs::default(),
            signals: ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                ..Default::default()
            },
            silent: false,
            short_of_space: false,
            disk_full: false,
            origin,
        }
    }

    fn moment(&self, now: UnixMillis) -> Moment {
        Moment::from_origin(Duration::from_millis(now - self.origin))
    }

    /// The agent at `now`, having received `core`'s desired state unless partitioned.
    pub fn step(&mut self, core: &Core, now: UnixMillis) {
        let at = self.moment(now);
        if !self.silent
            && let Some(desired) = core.desired(&self.name)
        {
            self.agent.receive(desired.clone());
        }
        if self.short_of_space != self.disk_full {
            // Full for longer than any test runs, or no longer.
            let until = if self.short_of_space {
                at + Duration::from_secs(30 * 86_400)
            } else {
                at
            };
            self.host.fill_disk(until);
            self.disk_full = self.short_of_space;
        }
        self.agent.tick(at, &mut self.host, &mut self.jobs);
    }

    /// The heartbeat the agent sends now.
    pub fn heartbeat(&self) -> nightshift_common::Heartbeat {
        self.agent.heartbeat(&self.host, &self.signals)
    }

    /// The coordinator answered the heartbeat sent at `now`.
    pub fn contact(&mut self, now: UnixMillis) {
        let at = self.moment(now);
        self.agent.contact(at);
    }

    /// The replica's state, as the agent reports it.
    pub fn replica(&self) -> ReplicaState {
        self.agent.mem.replica
    }

    /// The runs the agent reports.
    pub fn runs(&self) -> Vec<JobRun> {
        self.heartbeat().jobs
    }

    /// The host lacks the jobs' image from `now`; pulling it does what `pull` says.
    pub fn lack_image(&mut self, pull: Pull, now: UnixMillis) {
        let at = self.moment(now);
        self.host.lack(IMAGE, pull, at);
    }

    /// The host's container engine restarts at `now`, back a second later: every container
    /// stops with it.
    pub fn restart_engine(&mut self, now: UnixMillis) {
        let at = self.moment(now);
        self.host
            .restart_engine(at, Duration::from_secs(1), &mut self.jobs);
    }

    /// Keeps checkpoints on `storage`, as its host facts say.
    pub fn store_checkpoints(&mut self, storage: CheckpointStorage) {
        self.host.storage = storage;
    }
}

/// Each job's id, state and attempt: `1:running#1 2:queued#1`.
pub fn states(c: &Cluster) -> String {
    c.core
        .jobs()
        .iter()
        .map(|j| format!("{}:{}#{}", j.id, j.state.as_str(), j.attempt))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A core and its simulated nodes on a virtual clock.
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
        let agents: Vec<SimAgent> = nodes
            .iter()
            .map(|(n, g)| SimAgent::new(n, *g, now))
            .collect();
        for a in &agents {
            core.register(now, &a.name, "llm", a.host.inventory())
                .expect("register");
        }
        Self { core, agents, now }
    }

    /// One heartbeat interval: every agent acts and reports, then the clock advances.
    pub fn step(&mut self) {
        for a in &mut self.agents {
            a.step(&self.core, self.now);
            if a.silent {
                continue;
            }
            let beat = a.heartbeat();
            self.core
                .heartbeat(self.now, &a.name, beat)
                .expect("heartbeat");
            a.contact(self.now);
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

    /// The core's invariants, and one owner of every GPU on every host (never a stale
    /// epoch's start).
    pub fn assert_invariants(&self) {
        let violations = self.core.check_invariants();
        assert!(violations.is_empty(), "at {}: {violations:?}", self.now);
        for a in &self.agents {
            if let Err(e) = a.host.check_owners() {
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
