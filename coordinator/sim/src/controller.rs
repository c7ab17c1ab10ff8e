//! What decides for the simulated fleet: the real decision core ([`CoreController`]), for
//! every policy: `nightshift` and `reactive` as configured, the `fixed-window` and
//! `night-20-08` baselines on a fixed schedule (`baseline::window_config`). It speaks the
//! agent protocol's types, as the coordinator does.

use nightshift_common::{DesiredNode, GpuInfo, Heartbeat, JobSpec, JobState, UnixMillis};
use nightshift_core::{Core, CoreConfig, CoreSnapshot, Effect};

/// The service every simulated node belongs to.
pub const SERVICE: &str = "llm";

pub trait Controller {
    fn register(&mut self, now: UnixMillis, node: &str, gpus: Vec<GpuInfo>) -> Result<(), String>;
    fn heartbeat(&mut self, now: UnixMillis, node: &str, beat: Heartbeat) -> Result<(), String>;
    /// The gateway holds `waiting` requests for want of a ready replica.
    fn gateway(&mut self, now: UnixMillis, waiting: u64);
    fn submit(&mut self, now: UnixMillis, spec: JobSpec) -> Result<u64, String>;
    /// Time passes; called every simulated second.
    fn tick(&mut self, now: UnixMillis);
    /// The version of the node's desired state.
    fn version(&self, node: &str) -> Option<u64>;
    /// The nodes whose desired state may have moved since the last call, as the
    /// coordinator's shell learns from the core's effects whom to wake (repeats possible).
    fn moved(&mut self) -> Vec<String>;
    fn desired(&self, node: &str) -> Option<DesiredNode>;
    /// Violations of the invariants the controller can check, when its state changed since
    /// the last call.
    fn violations(&mut self) -> Vec<String>;
    /// The coordinator restarts: its state is rebuilt from what it persisted. Returns the
    /// jobs lost in the restart (must be none).
    fn restart(&mut self, now: UnixMillis) -> Vec<String>;
}

/// A hook for an external load forecast. The core learns its own profile (the `predictive`
/// policy setting), so both core policies run with [`NoForecast`]; the hook stays for
/// experiments with forecasts from outside the core.
pub trait Forecast {
    /// Replicas the service will need at `at`, if known.
    fn replicas_needed(&self, at: UnixMillis) -> Option<u32>;
}

pub struct NoForecast;

impl Forecast for NoForecast {
    fn replicas_needed(&self, _at: UnixMillis) -> Option<u32> {
        None
    }
}

/// The real decision core, driven through its public API.
pub struct CoreController {
    core: Core,
    config: CoreConfig,
    changed: bool,
    /// Nodes whose record changed since [`Controller::moved`] last asked.
    moved: Vec<String>,
    pub forecast: Box<dyn Forecast>,
}

impl CoreController {
    pub fn new(config: CoreConfig, forecast: Box<dyn Forecast>) -> Self {
        Self {
            core: Core::new(config.clone()),
            config,
            changed: true,
            moved: Vec::new(),
            forecast,
        }
    }

    pub fn core(&self) -> &Core {
        &self.core
    }

    /// Every change of a node's desired version comes with a `NodeChanged` effect, which is
    /// what the coordinator's shell publishes to the agents' long-polls.
    fn note_effects(&mut self) {
        let effects = self.core.poll_effects();
        if !effects.is_empty() {
            self.changed = true;
        }
        for effect in effects {
            if let Effect::NodeChanged(node) = effect {
                self.moved.push(node);
            }
        }
    }

    fn snapshot(&self) -> CoreSnapshot {
        let (next_job_id, next_lease_id, next_epoch) = self.core.next_ids();
        CoreSnapshot {
            jobs: self.core.jobs(),
            nodes: self
                .core
                .node_names()
                .filter_map(|n| self.core.node_snapshot(n))
                .collect(),
            profiles: self
                .core
                .config()
                .services
                .iter()
                .filter_map(|s| Some((s.name.clone(), self.core.profile(&s.name)?.clone())))
                .collect(),
            next_job_id,
            next_lease_id,
            next_epoch,
        }
    }
}

impl Controller for CoreController {
    fn register(&mut self, now: UnixMillis, node: &str, gpus: Vec<GpuInfo>) -> Result<(), String> {
        let r = self.core.register(now, node, SERVICE, gpus);
        self.note_effects();
        r.map_err(|e| e.to_string())
    }

    /// Like the coordinator's shell, which decides once for all the reports that arrived
    /// meanwhile: the report is observed now and the decision made at the second's tick,
    /// before any agent can act on it.
    fn heartbeat(&mut self, now: UnixMillis, node: &str, beat: Heartbeat) -> Result<(), String> {
        let r = self.core.observe(now, node, beat);
        self.note_effects();
        r.map_err(|e| e.to_string())
    }

    fn gateway(&mut self, now: UnixMillis, waiting: u64) {
        let _ = self.core.gateway(now, SERVICE, waiting);
        self.note_effects();
    }

    fn submit(&mut self, now: UnixMillis, spec: JobSpec) -> Result<u64, String> {
        let r = self.core.submit(now, spec);
        self.note_effects();
        r.map_err(|e| e.to_string())
    }

    fn tick(&mut self, now: UnixMillis) {
        if self.core.decision_pending() || self.core.next_deadline().is_some_and(|d| d <= now) {
            self.core.tick(now);
            self.note_effects();
        }
    }

    fn version(&self, node: &str) -> Option<u64> {
        self.core.node(node).map(|n| n.desired_version)
    }

    fn moved(&mut self) -> Vec<String> {
        std::mem::take(&mut self.moved)
    }

    fn desired(&self, node: &str) -> Option<DesiredNode> {
        self.core.desired(node)
    }

    fn violations(&mut self) -> Vec<String> {
        if !std::mem::take(&mut self.changed) {
            return Vec::new();
        }
        self.core
            .check_invariants()
            .into_iter()
            .map(|v| v.to_string())
            .collect()
    }

    fn restart(&mut self, now: UnixMillis) -> Vec<String> {
        let snapshot = self.snapshot();
        let before: Vec<(u64, JobState)> = snapshot.jobs.iter().map(|j| (j.id, j.state)).collect();
        self.core = Core::restore(self.config.clone(), snapshot, now);
        self.changed = true;
        let after: Vec<(u64, JobState)> =
            self.core.jobs().iter().map(|j| (j.id, j.state)).collect();
        if before == after {
            Vec::new()
        } else {
            vec![format!(
                "coordinator restart changed the jobs: {} before, {} after",
                before.len(),
                after.len()
            )]
        }
    }
}
