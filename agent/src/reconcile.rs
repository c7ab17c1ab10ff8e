//! The executor: one reconcile pass reads the host through the ports (`Engine`, `Gpus`,
//! `ServingMetrics`, `Host`), asks the pure planner (`nightshift-planner`) what to do, runs
//! its steps, and updates what the agent remembers from their results (an engine refusal
//! becomes a start failure, a failed sleep a stop). It looks again a poll interval later
//! while a sequence waits, until the plan is empty: a pass ends with the host matching the
//! desired state, or with an error, after which the loop (`agent.rs`) tries again.
//!
//! Level-triggered and idempotent: every round looks at the world afresh, so running the
//! same desired state twice changes nothing, and after an agent restart the containers that
//! are already there are adopted. Time is tokio's clock, read here and handed to the
//! planner as a [`Moment`] since the reconciler's origin, so that tests can pause it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use nightshift_common::labels;
use nightshift_common::{DesiredNode, JobRunState, LeaseGrant, SequenceKind};
use nightshift_planner::failsafe::Alarm;
use nightshift_planner::pass;
use nightshift_planner::{
    IllegalMove, Memory, Moment, Note, Observation, PlanConfig, ReplicaEvent, ReplicaProbe, Step,
    StopJob, Stuck,
};
use tokio::time::Instant;

use crate::bucket::{Bucket, BucketError, Restored};
use crate::config::AgentConfig;
use crate::engine::{Container, ContainerState, Engine, EngineError, ImageInfo};
use crate::gpus::{GpuError, Gpus};
use crate::host::Host;
use crate::host::sysinfo::SysinfoHost;
use crate::job::{self, JobDirs};
use crate::serving::ServingMetrics;
use crate::state::Shared;

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Gpus(#[from] GpuError),
    #[error("gpus {gpus:?} still hold memory after {waited:?}: not starting anything on them")]
    GpusBusy { gpus: Vec<u32>, waited: Duration },
    #[error("replica did not become healthy within {0:?}")]
    HealthTimeout(Duration),
    #[error("waking the replica failed: {0}")]
    Wake(crate::serving::ServingError),
    #[error("cannot prepare job directories under {path}: {source}")]
    JobDirs {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Replica(#[from] IllegalMove),
}

impl From<Stuck> for ReconcileError {
    fn from(stuck: Stuck) -> Self {
        match stuck {
            Stuck::GpusBusy { gpus, waited } => Self::GpusBusy { gpus, waited },
            Stuck::HealthTimeout(d) => Self::HealthTimeout(d),
        }
    }
}

pub struct Reconciler<E, G, S> {
    pub(crate) cfg: Arc<AgentConfig>,
    pub(crate) engine: Arc<E>,
    pub(crate) gpus: Arc<G>,
    pub(crate) serving: Arc<S>,
    pub(crate) shared: Arc<Shared>,
    /// What the planner reads of `cfg`.
    plan_cfg: PlanConfig,
    /// What the planner remembers across passes.
    mem: Memory,
    /// Where the planner's time begins: a [`Moment`] is the time since.
    origin: Instant,
    /// Pulls under way, by image, with when each began.
    pulls: BTreeMap<
        String,
        (
            Instant,
            tokio::task::JoinHandle<Result<ImageInfo, EngineError>>,
        ),
    >,
    host: Arc<dyn Host>,
    /// The bucket of object checkpoint storage; `None` with other storage.
    bucket: Option<Arc<Bucket>>,
    /// Restores under way, by lease id, with the lease.
    restores: BTreeMap<
        u64,
        (
            LeaseGrant,
            tokio::task::JoinHandle<Result<Restored, BucketError>>,
        ),
    >,
}

/// How often a sequence that waits looks again.
pub(crate) const POLL: Duration = Duration::from_millis(200);

/// Rounds of one pass at most: a plan that makes no progress ends the pass, loudly, rather
/// than spinning. Waits poll, so this is over an hour of waiting, beyond every timeout.
const MAX_ROUNDS: usize = 20_000;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    pub fn new(
        cfg: Arc<AgentConfig>,
        engine: Arc<E>,
        gpus: Arc<G>,
        serving: Arc<S>,
        shared: Arc<Shared>,
    ) -> Self {
        let mem = Memory {
            replica: shared.observed().replica(),
            ..Memory::default()
        };
        Self {
            plan_cfg: cfg.plan_config(),
            cfg,
            engine,
            gpus,
            serving,
            shared,
            mem,
            origin: Instant::now(),
            pulls: BTreeMap::new(),
            host: Arc::new(SysinfoHost::new()),
            bucket: None,
            restores: BTreeMap::new(),
        }
    }

    /// Keeps checkpoints in `bucket` (object storage): restored before each attempt
    /// starts, uploaded after its container stops.
    pub fn with_bucket(mut self, bucket: Arc<Bucket>) -> Self {
        self.bucket = Some(bucket);
        self
    }

    /// Reads the host's facts (the checkpoint volume's free space) from `host`.
    pub fn with_host(mut self, host: Arc<dyn Host>) -> Self {
        self.host = host;
        self
    }

    pub(crate) fn node(&self) -> &str {
        &self.shared.node
    }

    /// Now, on tokio's clock, as the planner counts time.
    fn now(&self) -> Moment {
        Moment::from_origin(Instant::now().duration_since(self.origin))
    }

    /// A moment the planner kept, back on tokio's clock.
    fn instant(&self, at: Moment) -> Instant {
        self.origin + at.since_origin()
    }

    /// One reconcile pass: observe, plan and execute until the plan is empty.
    pub async fn pass(&mut self) -> Result<(), ReconcileError> {
        self.mem.unremovable.clear();
        let mut changed = self.shared.subscribe_desired();
        let mut acted_on = None;
        for round in 0..MAX_ROUNDS {
            let heard = self.shared.desired();
            acted_on = heard.as_ref().map(|d| d.version);
            let since_contact = self.shared.since_contact();
            let begun = pass::begin(&self.plan_cfg, heard.as_ref(), since_contact, &mut self.mem);
            if let (Some(alarm), Some(d)) = (begun.alarm, &heard) {
                self.alarm(alarm, d);
            }
            let expired: Vec<u64> = self.mem.void.keys().copied().collect();
            if self.shared.observed().expired_leases != expired {
                self.shared.update(|o| o.expired_leases = expired);
            }
            let desired = begun.desired;
            let mut obs = match self.observe(begun.ask_replica).await {
                Ok(obs) => obs,
                Err(e) => {
                    if matches!(e, ReconcileError::Engine(_)) {
                        self.mem.engine_lost();
                    }
                    return Err(e);
                }
            };
            let now = self.now();
            let seen = pass::observed(desired.as_deref(), &obs, &mut self.mem, now);
            for c in &seen.stopped_with_engine {
                if let ContainerState::Exited { exit_code } = c.state {
                    tracing::warn!(
                        node = %self.node(),
                        container = %c.name,
                        exit_code,
                        "a job container stopped while the container engine was away: reported as stopped by the host, not as the job's own exit"
                    );
                }
            }
            for s in seen.stale.iter().filter(|_| round == 0) {
                tracing::warn!(
                    node = %self.node(), lease.id = s.lease_id, lease.epoch = s.epoch,
                    gpu = s.gpu, seen = s.seen, "refusing a stale lease: a newer epoch holds this gpu"
                );
            }
            let leases = seen.leases;
            // The host's facts only while a job waits to start: reading them also restarts
            // the CPU-use window that heartbeats report.
            self.reap_pulls(&leases, &obs.containers).await;
            self.start_uploads(&obs.containers);
            obs.unrestored = self.reap_restores(&leases, &obs.containers).await;
            let waiting: Vec<String> =
                nightshift_planner::unstarted(&leases, &obs.containers, &self.mem)
                    .iter()
                    .map(|l| l.job.image.clone())
                    .collect();
            obs.missing_images = self.missing_images(&waiting).await?;
            if !waiting.is_empty() {
                obs.checkpoint_free_bytes = self
                    .host
                    .facts(self.cfg.checkpoint_root())
                    .checkpoint_volume_free_bytes;
            }
            self.read_outputs(&obs.containers, &leases).await;
            self.publish_runs(&obs, &leases);
            self.shared
                .update(|o| o.replica_url = obs.replica.as_ref().and_then(|p| p.url.clone()));

            let steps = nightshift_planner::plan(
                &self.plan_cfg,
                desired.as_deref(),
                &leases,
                &obs,
                &self.mem,
                self.now(),
            );
            if steps.is_empty() {
                break;
            }
            // Removing finished containers is the last thing a pass does: what they reported
            // stays published until the next pass.
            let last = steps.iter().all(|s| matches!(s, Step::Remove(_)));
            // A step that fails ends the wait the sequence was in: the next pass starts it over
            // (a failed wake is sent again, say, rather than waited on).
            let wait = self
                .execute(steps)
                .await
                .inspect_err(|_| self.mem.phase = None)?;
            if last {
                break;
            }
            if wait {
                tokio::select! {
                    () = tokio::time::sleep(POLL) => {}
                    // A new desired state is planned for at once.
                    _ = changed.changed() => {}
                }
            }
            if round + 1 == MAX_ROUNDS {
                tracing::error!(node = %self.node(), "reconcile pass made no progress; ending it");
            }
        }
        if let Some(version) = acted_on {
            self.shared.update(|o| o.applied_version = version);
        }
        Ok(())
    }

    /// Every container this agent manages on this host.
    pub(crate) async fn managed(&self) -> Result<Vec<Container>, EngineError> {
        let filter = BTreeMap::from([(labels::MANAGED_BY.to_owned(), self.node().to_owned())]);
        self.engine.list(&filter).await
    }

    /// Reads the host: containers, GPU memory, the running replica's vLLM (when `ask`).
    async fn observe(&self, ask: bool) -> Result<Observation, ReconcileError> {
        let containers = self.managed().await?;
        let gpus = self.gpus.inventory()?.iter().map(|g| g.index).collect();
        let gpu_memory = match self.gpus.status() {
            Ok(status) => Some(
                status
                    .iter()
                    .map(|s| (s.index, s.memory_used_bytes))
                    .collect(),
            ),
            Err(e) => {
                tracing::warn!(node = %self.node(), error = %e, "reading gpu memory failed");
                None
            }
        };
        let replica = match nightshift_planner::replica(&containers)
            .filter(|c| c.state == ContainerState::Running)
        {
            Some(c) => Some(self.probe(c, ask).await),
            None => None,
        };
        Ok(Observation {
            containers,
            gpus,
            gpu_memory,
            replica,
            checkpoint_free_bytes: None,
            missing_images: Default::default(),
            unrestored: Default::default(),
        })
    }

    async fn probe(&self, c: &Container, ask: bool) -> ReplicaProbe {
        let url = crate::replica::url(&self.cfg, c);
        let mut probe = ReplicaProbe {
            container_id: c.id.clone(),
            url: url.clone(),
            health: None,
            requests_running: None,
            requests_waiting: None,
            is_sleeping: None,
            sleep_state: None,
        };
        if let Some(u) = url.as_ref().filter(|_| ask) {
            probe.health = Some(self.serving.health(u).await);
            let s = self.serving.signals(u).await;
            probe.requests_running = s.requests_running;
            probe.requests_waiting = s.requests_waiting;
            probe.sleep_state = s.sleep_state;
            probe.is_sleeping = self.serving.is_sleeping(u).await;
        }
        probe
    }

    fn alarm(&self, alarm: Alarm, desired: &DesiredNode) {
        match alarm {
            Alarm::Disabled { silent, leases } => tracing::error!(
                node = %self.node(), silent_s = silent.as_secs_f64(), leases = ?leases,
                "coordinator silent past the lease ttl and the fail-safe is disabled: jobs keep running on expired leases"
            ),
            Alarm::Acting {
                silent,
                limit,
                leases,
            } => tracing::error!(
                node = %self.node(), silent_s = silent.as_secs_f64(),
                limit_s = limit.as_secs_f64(), leases = ?leases, desired.version = desired.version,
                "FAIL-SAFE: the coordinator is silent and these leases expired; checkpointing and stopping their jobs and serving again"
            ),
            Alarm::Back { void } => tracing::warn!(
                node = %self.node(), void = ?void,
                "coordinator answers again; reporting the leases the fail-safe stopped"
            ),
        }
    }

    /// Runs the plan's steps in order; true when it ends waiting.
    async fn execute(&mut self, steps: Vec<Step>) -> Result<bool, ReconcileError> {
        for step in steps {
            match step {
                Step::Replica(event) => {
                    self.mem.replica = self.shared.replica_event(event)?;
                }
                Step::Enter(phase) => self.mem.phase = phase.map(|p| (p, self.now())),
                Step::Record {
                    sequence,
                    phase,
                    began,
                } => self
                    .shared
                    .record_phase(sequence, phase, self.instant(began)),
                Step::StopJobs { jobs, reclaim } => self.stop_jobs(&jobs, reclaim).await?,
                Step::StopReplica { id, grace } => {
                    let t = Instant::now();
                    self.engine.stop(&id, grace).await?;
                    self.mem.replica = self.shared.replica_event(ReplicaEvent::Stopped)?;
                    self.shared.update(|o| o.replica_url = None);
                    self.shared
                        .record_phase(SequenceKind::Drain, "stop_replica", t);
                }
                Step::SleepReplica { url } => {
                    let t = Instant::now();
                    let level = self.cfg.replica.sleep_level;
                    let timeout = Duration::from_secs_f64(self.cfg.replica.sleep_timeout_s);
                    if let Err(e) = self.serving.sleep(&url, level, timeout).await {
                        tracing::warn!(node = %self.node(), error = %e, "vllm sleep failed; stopping the replica instead");
                        self.mem.sleep_failed(self.now());
                        return Ok(false);
                    }
                    self.shared
                        .record_phase(SequenceKind::Drain, "sleep_replica", t);
                }
                Step::WakeReplica { url } => {
                    let timeout = Duration::from_secs_f64(self.cfg.health_timeout_s);
                    self.serving
                        .wake_up(&url, timeout)
                        .await
                        .map_err(ReconcileError::Wake)?;
                    tracing::info!(node = %self.node(), url, "replica woken");
                }
                Step::StartReplica => self.start_replica().await?,
                Step::StartJobs(leases) => self.start_jobs(&leases).await?,
                Step::Pull { image, .. } => {
                    self.start_pull(&image).await;
                    return Ok(true);
                }
                Step::Restore(leases) => {
                    self.start_restores(&leases);
                    return Ok(true);
                }
                Step::FailStart {
                    lease,
                    message,
                    refused_by_host,
                } => self.fail_start(&lease, message, refused_by_host),
                Step::Remove(c) => self.remove(&c).await,
                Step::Note(note) => self.note(note),
                Step::GiveUp(stuck) => return Err(stuck.into()),
                Step::Wait => return Ok(true),
            }
        }
        Ok(false)
    }

    /// Records that `lease`'s job cannot start, for `reason`: its attempt is reported as
    /// failed (or, `refused_by_host`, as refused: no failure is counted) and the node's other
    /// leases go on.
    fn fail_start(&mut self, lease: &LeaseGrant, reason: String, refused_by_host: bool) {
        tracing::warn!(
            node = %self.node(), job.id = lease.job_id, lease.id = lease.lease_id,
            reason = %reason, refused_by_host, "job cannot start"
        );
        self.mem.failed_to_start(lease, reason, refused_by_host);
    }

    fn note(&self, note: Note) {
        let node = self.node();
        match note {
            Note::DrainAbandoned => {
                tracing::info!(node = %node, "drain abandoned: the node serves again")
            }
            Note::DrainTimeout { running, waiting } => tracing::warn!(
                node = %node, running = ?running, waiting = ?waiting,
                "drain timeout: stopping the replica with requests in flight"
            ),
            Note::ReplicaUnreachable => {
                tracing::warn!(node = %node, "replica unreachable while draining; stopping it")
            }
            Note::NotAsleep => tracing::warn!(
                node = %node, "vllm does not report sleeping; stopping the replica instead"
            ),
            Note::SleepFreedTooLittle { limit } => tracing::warn!(
                node = %node, limit_bytes = limit,
                "sleeping freed too little gpu memory; stopping the replica instead"
            ),
        }
    }

    /// Sends each job its checkpoint signal, waits its grace, kills it; all at once.
    async fn stop_jobs(&mut self, jobs: &[StopJob], reclaim: bool) -> Result<(), ReconcileError> {
        let started = Instant::now();
        self.mem.stopping(jobs);
        let leases: BTreeSet<u64> = jobs.iter().filter_map(|j| j.lease_id).collect();
        self.shared.update(|o| {
            for r in o.runs.iter_mut().filter(|r| leases.contains(&r.lease_id)) {
                r.state = JobRunState::Stopping;
            }
        });
        let stops = jobs.iter().map(|j| {
            tracing::info!(node = %self.node(), container = %j.id, grace_s = j.grace.as_secs(), "stopping job");
            self.engine.stop(&j.id, j.grace)
        });
        for result in futures_util::future::join_all(stops).await {
            result?;
        }
        if reclaim {
            self.shared
                .record_phase(SequenceKind::Reclaim, "stop_jobs", started);
        }
        Ok(())
    }

    async fn start_replica(&mut self) -> Result<(), ReconcileError> {
        let t = Instant::now();
        if let Err(e) = self.ensure_replica_image().await {
            self.mem.replica = self.shared.replica_event(ReplicaEvent::Failed)?;
            self.mem.phase = None;
            return Err(e.into());
        }
        let all: Vec<u32> = self.gpus.inventory()?.iter().map(|g| g.index).collect();
        let spec = crate::replica::container_spec(&self.cfg, self.node(), self.gpus.access(&all));
        let id = match self.engine.run(&spec).await {
            Ok(id) => id,
            Err(e) => {
                self.mem.replica = self.shared.replica_event(ReplicaEvent::Failed)?;
                self.mem.phase = None;
                return Err(e.into());
            }
        };
        let c = self.engine.inspect(&id).await?;
        let url = crate::replica::url(&self.cfg, &c);
        self.mem.replica = self.shared.replica_event(ReplicaEvent::Started)?;
        self.shared.update(|o| o.replica_url = url.clone());
        self.shared
            .record_phase(SequenceKind::Reclaim, "start_replica", t);
        tracing::info!(node = %self.node(), container = %id, url = ?url, "replica started");
        Ok(())
    }

    /// Starts a container for each lease, each in its own checkpoint directory.
    async fn start_jobs(&mut self, leases: &[LeaseGrant]) -> Result<(), ReconcileError> {
        let started = Instant::now();
        for lease in leases {
            // This attempt's own checkpoint directory, seeded from the newest earlier one's.
            let mut dirs = self.attempt_dirs(lease);
            match self.mem.restored.get(&lease.lease_id) {
                // Object storage: the directory was restored from the bucket.
                Some(restored) => dirs.resumed_from = restored.from_epoch,
                None if self.bucket.is_some() => {}
                None => dirs.seed().map_err(|source| ReconcileError::JobDirs {
                    path: self.cfg.checkpoint_root().display().to_string(),
                    source,
                })?,
            }
            dirs.create().map_err(|source| ReconcileError::JobDirs {
                path: self.cfg.checkpoint_root().display().to_string(),
                source,
            })?;
            let mut spec = job::container_spec(
                self.node(),
                lease,
                &dirs,
                self.gpus.access(&lease.gpus),
                &self.cfg.rendezvous_bind_ip,
            );
            // The image as pinned when it was found or pulled: a tag moved since cannot
            // change what this attempt runs.
            if let Some(pinned) = self.mem.images.pinned(&lease.job.image) {
                spec.image = pinned.to_owned();
            }
            self.mem.fence(lease);
            match self.engine.run(&spec).await {
                Ok(id) => {
                    if let Some(restored) = self.mem.restored.get_mut(&lease.lease_id) {
                        restored.started = true;
                    }
                    tracing::info!(
                        node = %self.node(), job.id = lease.job_id, lease.id = lease.lease_id,
                        lease.epoch = lease.epoch, gpus = ?lease.gpus, container = %id, "job started"
                    )
                }
                // The lease's own fault: its attempt fails (reported in the heartbeat) and
                // the node's other leases go on.
                Err(
                    e @ (EngineError::ImageMissing(_)
                    | EngineError::Refused { .. }
                    | EngineError::PullFailed { .. }),
                ) => self.fail_start(lease, e.to_string(), false),
                Err(e) => return Err(e.into()),
            }
        }
        self.shared
            .record_phase(SequenceKind::Drain, "start_jobs", started);
        Ok(())
    }

    /// Keeps a finished job's output, then removes its container.
    async fn remove(&mut self, c: &Container) {
        // Its output outlives it: `nightshift logs` answers from the kept copy.
        if let Err(e) = crate::logs::archive(&*self.engine, &self.cfg.work_dir, c).await {
            tracing::warn!(node = %self.node(), container = %c.name, error = %e, "keeping a finished job's output failed");
        }
        if let Err(e) = self.engine.remove(&c.id).await {
            tracing::warn!(node = %self.node(), container = %c.name, error = %e, "removing a finished job failed");
            self.mem.unremovable.insert(c.id.clone());
            return;
        }
        self.mem.removed(c);
    }

    /// The directories of the attempt under `lease`, a gang member's checkpoints among its
    /// rank's; with object storage the attempt's directory is where its checkpoint is
    /// restored (the bucket keeps ranks apart too).
    fn attempt_dirs(&self, lease: &LeaseGrant) -> JobDirs {
        JobDirs::for_lease(&self.cfg.work_dir, self.cfg.checkpoint_root(), lease)
    }
}

mod checkpoints;
mod images;
mod outputs;

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
