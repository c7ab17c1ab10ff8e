//! The reconcile loop: compare the node's desired state with the containers actually on the
//! host (found by their labels), and act until they match.
//!
//! Level-triggered and idempotent: a pass looks at the world afresh each time, so running it
//! twice changes nothing, and after an agent restart it adopts the containers that are
//! already there. The two sequences of DESIGN.md live in `drain.rs` and `reclaim.rs`; this
//! file decides which one applies and keeps the reported job runs up to date.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use nightshift_common::labels;
use nightshift_common::{JobRun, JobRunState, LeaseGrant, ReplicaState};

use crate::config::AgentConfig;
use crate::engine::{Container, ContainerState, Engine, EngineError};
use crate::gpus::{GpuError, Gpus};
use crate::host::Host;
use crate::host::sysinfo::SysinfoHost;
use crate::job::{self, GRACE_LABEL, JobDirs};
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
}

/// A lease whose container could not be started. It is reported while its lease is listed,
/// and for a lease TTL after (a reclaim may take the lease back before the coordinator has
/// heard): the attempt fails, it is not taken for a preemption.
struct StartFailure {
    /// The run reported: the lease's job, attempt, epoch, GPUs and why.
    run: JobRun,
    /// Since when the desired state no longer lists the lease.
    unlisted_since: Option<Instant>,
}

impl StartFailure {
    fn new(lease: &LeaseGrant, message: String) -> Self {
        Self {
            run: JobRun {
                job_id: lease.job_id,
                attempt: lease.attempt,
                lease_id: lease.lease_id,
                epoch: lease.epoch,
                gpus: lease.gpus.clone(),
                state: JobRunState::FailedToStart { message },
                last_checkpoint_at: None,
                outputs: BTreeMap::new(),
                image_id: None,
            },
            unlisted_since: None,
        }
    }
}

pub struct Reconciler<E, G, S> {
    pub(crate) cfg: Arc<AgentConfig>,
    pub(crate) engine: Arc<E>,
    pub(crate) gpus: Arc<G>,
    pub(crate) serving: Arc<S>,
    pub(crate) shared: Arc<Shared>,
    /// Highest fencing epoch honoured per GPU; a lease below it is stale and refused.
    fenced: HashMap<u32, u64>,
    /// Containers this agent stopped (reclaim, cancel), as opposed to ones that exited alone.
    stopped: HashSet<String>,
    /// Leases whose container could not be started, with why.
    start_failures: HashMap<u64, StartFailure>,
    /// Output parameters read from a finished container, by container id.
    outputs: HashMap<String, BTreeMap<String, String>>,
    /// Leases the fail-safe stopped (id → epoch): refused until the coordinator drops them.
    pub(crate) void: BTreeMap<u64, u64>,
    /// A silence already logged (the fail-safe is loud once, not every pass).
    pub(crate) silence_logged: bool,
    host: Arc<dyn Host>,
}

/// How often waits poll what they wait for.
pub(crate) const POLL: Duration = Duration::from_millis(200);

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    pub fn new(
        cfg: Arc<AgentConfig>,
        engine: Arc<E>,
        gpus: Arc<G>,
        serving: Arc<S>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            cfg,
            engine,
            gpus,
            serving,
            shared,
            fenced: HashMap::new(),
            stopped: HashSet::new(),
            start_failures: HashMap::new(),
            outputs: HashMap::new(),
            void: BTreeMap::new(),
            silence_logged: false,
            host: Arc::new(SysinfoHost::new()),
        }
    }

    /// Reads the host's facts (the checkpoint volume's free space) from `host`.
    pub fn with_host(mut self, host: Arc<dyn Host>) -> Self {
        self.host = host;
        self
    }

    pub(crate) fn node(&self) -> &str {
        &self.shared.node
    }

    /// Whether the node should serve right now (the desired state may change mid-sequence).
    pub(crate) fn wants_serving(&self) -> bool {
        self.effective_desired()
            .is_some_and(|d| d.serve && d.leases.is_empty())
    }

    /// One reconcile pass.
    pub async fn pass(&mut self) -> Result<(), ReconcileError> {
        self.track_failsafe();
        let containers = self.managed().await?;
        self.learn_fences(&containers);
        let Some(desired) = self.effective_desired() else {
            // Not heard from the coordinator yet: adopt what runs and report it, change nothing.
            self.adopt_replica(&containers).await;
            self.publish_runs(&containers, &[]);
            return Ok(());
        };
        let leases = self.honoured(&desired.leases);
        let told_for = Duration::from_millis(desired.lease_ttl_ms);
        for (id, f) in &mut self.start_failures {
            if desired.leases.iter().any(|l| l.lease_id == *id) {
                f.unlisted_since = None;
            } else {
                f.unlisted_since.get_or_insert_with(Instant::now);
            }
        }
        self.start_failures
            .retain(|_, f| f.unlisted_since.is_none_or(|t| t.elapsed() < told_for));
        self.capture(&containers, &leases).await;
        self.publish_runs(&containers, &leases);

        // Jobs whose lease is gone are stopped first: their GPUs go back before anything else.
        let unleased: Vec<&Container> = jobs(&containers)
            .filter(|c| !leases.iter().any(|l| Some(l.lease_id) == lease_of(c)))
            .collect();
        let serve = desired.serve && leases.is_empty();
        self.stop_unleased(&unleased, serve).await?;

        let containers = self.managed().await?;
        if serve {
            self.reclaim(&containers).await?;
        } else {
            self.drain(&containers).await?;
            let containers = self.managed().await?;
            if matches!(
                self.shared.observed().replica,
                ReplicaState::Stopped | ReplicaState::Sleeping
            ) {
                self.start_jobs(&containers, &leases).await?;
            }
        }
        // Report what ended before forgetting it: a removed container's exit is still told.
        let containers = self.managed().await?;
        self.capture(&containers, &leases).await;
        self.publish_runs(&containers, &leases);
        self.remove_finished(&containers, &leases).await;
        self.shared.update(|o| o.applied_version = desired.version);
        Ok(())
    }

    /// Every container this agent manages on this host.
    pub(crate) async fn managed(&self) -> Result<Vec<Container>, EngineError> {
        let filter = BTreeMap::from([(labels::MANAGED_BY.to_owned(), self.node().to_owned())]);
        self.engine.list(&filter).await
    }

    fn learn_fences(&mut self, containers: &[Container]) {
        for c in jobs(containers) {
            let epoch = label_u64(c, labels::EPOCH).unwrap_or(0);
            for gpu in gpus_of(c) {
                let e = self.fenced.entry(gpu).or_default();
                *e = (*e).max(epoch);
            }
        }
    }

    /// The leases to act on: those not older than an epoch already honoured on their GPUs.
    fn honoured(&self, leases: &[LeaseGrant]) -> Vec<LeaseGrant> {
        leases
            .iter()
            .filter(|l| {
                let stale = l.gpus.iter().find_map(|g| {
                    self.fenced
                        .get(g)
                        .filter(|&&e| l.epoch < e)
                        .map(|e| (*g, *e))
                });
                if let Some((gpu, seen)) = stale {
                    tracing::warn!(
                        node = %self.node(), lease.id = l.lease_id, lease.epoch = l.epoch,
                        gpu, seen, "refusing a stale lease: a newer epoch holds this gpu"
                    );
                }
                stale.is_none()
            })
            .cloned()
            .collect()
    }

    /// Sends each unleased running job its checkpoint signal, waits its grace, kills it.
    async fn stop_unleased(
        &mut self,
        unleased: &[&Container],
        reclaiming: bool,
    ) -> Result<(), ReconcileError> {
        let running: Vec<&Container> = unleased
            .iter()
            .copied()
            .filter(|c| c.state == ContainerState::Running)
            .collect();
        if running.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        self.shared.set_ready(false);
        for c in &running {
            self.stopped.insert(c.id.clone());
        }
        self.mark_stopping(&running);
        let stops = running.iter().map(|c| {
            let grace = Duration::from_secs(label_u64(c, GRACE_LABEL).unwrap_or(30));
            tracing::info!(node = %self.node(), container = %c.name, grace_s = grace.as_secs(), "stopping job");
            self.engine.stop(&c.id, grace)
        });
        for result in futures_util::future::join_all(stops).await {
            result?;
        }
        if reclaiming {
            self.shared.record_phase(
                nightshift_common::SequenceKind::Reclaim,
                "stop_jobs",
                started,
            );
        }
        Ok(())
    }

    fn mark_stopping(&self, running: &[&Container]) {
        let leases: HashSet<u64> = running.iter().filter_map(|c| lease_of(c)).collect();
        self.shared.update(|o| {
            for r in o.runs.iter_mut().filter(|r| leases.contains(&r.lease_id)) {
                r.state = JobRunState::Stopping;
            }
        });
    }

    /// Starts a container for each honoured lease that has none yet.
    async fn start_jobs(
        &mut self,
        containers: &[Container],
        leases: &[LeaseGrant],
    ) -> Result<(), ReconcileError> {
        let missing: Vec<&LeaseGrant> = leases
            .iter()
            .filter(|l| !jobs(containers).any(|c| lease_of(c) == Some(l.lease_id)))
            .filter(|l| !self.start_failures.contains_key(&l.lease_id))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let gpus: Vec<u32> = missing
            .iter()
            .flat_map(|l| l.gpus.iter().copied())
            .collect();
        self.confirm_free(&gpus, self.free_limit()).await?;
        let started = Instant::now();
        for lease in missing {
            if let Some(message) = self.checkpoint_volume_short() {
                tracing::warn!(node = %self.node(), job.id = lease.job_id, lease.id = lease.lease_id, reason = %message, "job cannot start");
                self.start_failures
                    .insert(lease.lease_id, StartFailure::new(lease, message));
                continue;
            }
            // This attempt's own checkpoint directory, seeded from the newest earlier one's.
            let mut dirs = JobDirs::attempt(&self.cfg.work_dir, lease.job_id, lease.epoch);
            dirs.seed()
                .and_then(|()| dirs.create())
                .map_err(|source| ReconcileError::JobDirs {
                    path: self.cfg.work_dir.display().to_string(),
                    source,
                })?;
            let spec = job::container_spec(
                self.node(),
                lease,
                &dirs,
                self.gpus.access(&lease.gpus),
                &self.cfg.rendezvous_bind_ip,
            );
            for g in &lease.gpus {
                self.fenced.insert(*g, lease.epoch);
            }
            match self.engine.run(&spec).await {
                Ok(id) => tracing::info!(
                    node = %self.node(), job.id = lease.job_id, lease.id = lease.lease_id,
                    lease.epoch = lease.epoch, gpus = ?lease.gpus, container = %id, "job started"
                ),
                // The lease's own fault: its attempt fails (reported in the heartbeat) and
                // the node's other leases go on.
                Err(e @ (EngineError::ImageMissing(_) | EngineError::Refused { .. })) => {
                    tracing::warn!(
                        node = %self.node(), job.id = lease.job_id, lease.id = lease.lease_id,
                        error = %e, "job cannot start"
                    );
                    self.start_failures
                        .insert(lease.lease_id, StartFailure::new(lease, e.to_string()));
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.shared.record_phase(
            nightshift_common::SequenceKind::Drain,
            "start_jobs",
            started,
        );
        Ok(())
    }

    /// Why no job may start for lack of checkpoint space, if so.
    fn checkpoint_volume_short(&self) -> Option<String> {
        let floor = self.cfg.checkpoint_min_free_bytes;
        let free = self
            .host
            .facts(&self.cfg.work_dir)
            .checkpoint_volume_free_bytes?;
        (free < floor).then(|| {
            format!(
                "the checkpoint volume of {} has {free} bytes free, below the floor of {floor} (checkpoint_min_free_bytes)",
                self.cfg.work_dir.display()
            )
        })
    }

    /// How much memory a GPU may still hold and count as free: a sleeping replica keeps its
    /// CUDA context.
    pub(crate) fn free_limit(&self) -> u64 {
        if self.shared.observed().replica == ReplicaState::Sleeping {
            self.cfg.replica.sleep_max_used_bytes
        } else {
            self.cfg.free_memory_bytes
        }
    }

    /// Waits until NVML shows at most `limit` bytes used on each of `gpus`, up to the
    /// configured timeout.
    pub(crate) async fn confirm_free(
        &self,
        gpus: &[u32],
        limit: u64,
    ) -> Result<(), ReconcileError> {
        self.wait_free(
            gpus,
            limit,
            Duration::from_secs_f64(self.cfg.free_timeout_s),
        )
        .await
    }

    pub(crate) async fn wait_free(
        &self,
        gpus: &[u32],
        limit: u64,
        timeout: Duration,
    ) -> Result<(), ReconcileError> {
        let started = Instant::now();
        loop {
            let status = self.gpus.status()?;
            let busy: Vec<u32> = status
                .iter()
                .filter(|s| gpus.contains(&s.index) && s.memory_used_bytes > limit)
                .map(|s| s.index)
                .collect();
            if busy.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(ReconcileError::GpusBusy {
                    gpus: busy,
                    waited: timeout,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Removes exited job containers whose lease the coordinator no longer lists: it has
    /// seen them end (or revoked them, and counts them gone).
    async fn remove_finished(&mut self, containers: &[Container], leases: &[LeaseGrant]) {
        for c in jobs(containers) {
            let leased = leases.iter().any(|l| Some(l.lease_id) == lease_of(c));
            if leased || !matches!(c.state, ContainerState::Exited { .. }) {
                continue;
            }
            // Its output outlives it: `nightshift logs` answers from the kept copy.
            if let Err(e) = crate::logs::archive(&*self.engine, &self.cfg.work_dir, c).await {
                tracing::warn!(node = %self.node(), container = %c.name, error = %e, "keeping a finished job's output failed");
            }
            if let Err(e) = self.engine.remove(&c.id).await {
                tracing::warn!(node = %self.node(), container = %c.name, error = %e, "removing a finished job failed");
                continue;
            }
            self.stopped.remove(&c.id);
            self.outputs.remove(&c.id);
            if let Some(lease) = lease_of(c) {
                self.start_failures.remove(&lease);
            }
        }
    }

    /// Rebuilds the job runs reported to the coordinator from the containers and leases.
    fn publish_runs(&mut self, containers: &[Container], leases: &[LeaseGrant]) {
        let mut runs = Vec::new();
        for lease in leases {
            let container = jobs(containers).find(|c| lease_of(c) == Some(lease.lease_id));
            let state = match (container, self.start_failures.get(&lease.lease_id)) {
                (Some(c), _) => self.run_state(c),
                (None, Some(f)) => f.run.state.clone(),
                (None, None) => JobRunState::Pending,
            };
            let outputs = container
                .map(|c| self.outputs_of(c, lease.job_id))
                .unwrap_or_default();
            let last_checkpoint_at =
                JobDirs::attempt(&self.cfg.work_dir, lease.job_id, lease.epoch).last_checkpoint();
            runs.push(JobRun {
                job_id: lease.job_id,
                attempt: lease.attempt,
                lease_id: lease.lease_id,
                epoch: lease.epoch,
                gpus: lease.gpus.clone(),
                state,
                last_checkpoint_at,
                outputs,
                image_id: container.and_then(|c| c.image_id.clone()),
            });
        }
        // Containers of leases no longer listed are still reported while they exist.
        for c in jobs(containers) {
            let Some(lease_id) = lease_of(c) else {
                continue;
            };
            if leases.iter().any(|l| l.lease_id == lease_id) {
                continue;
            }
            runs.push(JobRun {
                job_id: label_u64(c, labels::JOB_ID).unwrap_or(0),
                attempt: label_u64(c, labels::ATTEMPT).unwrap_or(0) as u32,
                lease_id,
                epoch: label_u64(c, labels::EPOCH).unwrap_or(0),
                gpus: gpus_of(c),
                state: self.run_state(c),
                last_checkpoint_at: None,
                outputs: BTreeMap::new(),
                image_id: c.image_id.clone(),
            });
        }
        // So are the start failures of leases taken back before the coordinator heard.
        runs.extend(
            self.start_failures
                .values()
                .filter(|f| f.unlisted_since.is_some())
                .filter(|f| !runs.iter().any(|r| r.lease_id == f.run.lease_id))
                .map(|f| f.run.clone())
                .collect::<Vec<_>>(),
        );
        self.shared.update(|o| o.runs = runs);
    }

    fn run_state(&self, c: &Container) -> JobRunState {
        match c.state {
            ContainerState::Created => JobRunState::Pending,
            ContainerState::Running | ContainerState::Transitioning
                if self.stopped.contains(&c.id) =>
            {
                JobRunState::Stopping
            }
            ContainerState::Running | ContainerState::Transitioning => JobRunState::Running,
            ContainerState::Exited { exit_code } => JobRunState::Exited {
                exit_code,
                stopped_by_agent: self.stopped.contains(&c.id),
            },
        }
    }

    /// Reads, once per exited container, the outputs its job captures (files from the
    /// container's file system, standard output) together with its output directory.
    async fn capture(&mut self, containers: &[Container], leases: &[LeaseGrant]) {
        for lease in leases {
            let Some(c) = jobs(containers).find(|c| lease_of(c) == Some(lease.lease_id)) else {
                continue;
            };
            let capture = &lease.job.capture;
            if capture.is_empty()
                || !matches!(c.state, ContainerState::Exited { .. })
                || self.outputs.contains_key(&c.id)
            {
                continue;
            }
            let mut outputs =
                job::read_outputs(&JobDirs::new(&self.cfg.work_dir, lease.job_id).outputs);
            outputs.extend(job::capture(self.engine.as_ref(), &c.id, capture).await);
            self.outputs.insert(c.id.clone(), outputs);
        }
    }

    fn outputs_of(&mut self, c: &Container, job_id: u64) -> BTreeMap<String, String> {
        if !matches!(c.state, ContainerState::Exited { .. }) {
            return BTreeMap::new();
        }
        self.outputs
            .entry(c.id.clone())
            .or_insert_with(|| job::read_outputs(&JobDirs::new(&self.cfg.work_dir, job_id).outputs))
            .clone()
    }
}

pub(crate) fn jobs(containers: &[Container]) -> impl Iterator<Item = &Container> {
    containers
        .iter()
        .filter(|c| c.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_JOB))
}

pub(crate) fn replica(containers: &[Container]) -> Option<&Container> {
    containers
        .iter()
        .find(|c| c.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_REPLICA))
}

fn label_u64(c: &Container, key: &str) -> Option<u64> {
    c.labels.get(key)?.parse().ok()
}

fn lease_of(c: &Container) -> Option<u64> {
    label_u64(c, labels::LEASE_ID)
}

fn gpus_of(c: &Container) -> Vec<u32> {
    c.labels
        .get(labels::GPUS)
        .map(|g| g.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
