//! The agent's planner: what to do next, decided from what the node should be (the desired
//! state), what the executor just read from the host (an [`Observation`]) and what the agent
//! remembers across passes (its [`Memory`]), at a time it is given.
//!
//! [`plan`] is a pure function: no I/O, no clock, no async. It returns [`Step`]s for the
//! executor (the agent's `reconcile.rs`) to run against the ports. A wait in a sequence (the
//! readiness grace, in-flight requests reaching 0, GPU memory freeing, `/health`, the sleep,
//! the timeouts) is a [`Phase`] remembered with when it began: the planner says [`Step::Wait`]
//! until its condition holds or its deadline passes, and is asked again a poll later, so a
//! desired state that changes in the middle of a drain is simply the next plan's input. The
//! sequences themselves are in `drain.rs` (lend the node) and `reclaim.rs` (serve again); the
//! fail-safe's decisions in `failsafe.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_common::labels;
use nightshift_common::{DesiredNode, JobRun, JobRunState, LeaseGrant, ReplicaState, SequenceKind};

use crate::config::PlanConfig;
use crate::container::{
    Container, ContainerState, GRACE_LABEL, gpus_of, jobs, label_u64, lease_of,
};
use crate::lifecycle::ReplicaEvent;
use crate::time::Moment;

/// What vLLM's `/health` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// 200.
    Healthy,
    /// Connection refused or reset: vLLM is still loading, or gone.
    Unreachable,
    /// Any other answer, e.g. 503 after an engine error.
    Unhealthy(u16),
}

/// What the executor read from the host in this round.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Every container this agent manages on the host.
    pub containers: Vec<Container>,
    /// Every GPU of the host, by index.
    pub gpus: Vec<u32>,
    /// Memory in use per GPU; `None` when NVML did not answer this time.
    pub gpu_memory: Option<BTreeMap<u32, u64>>,
    /// The running replica container's vLLM, as probed; `None` when none runs.
    pub replica: Option<ReplicaProbe>,
    /// Free bytes on the volume of the job checkpoints, when known; read only while a
    /// lease waits for its job to start.
    pub checkpoint_free_bytes: Option<u64>,
    /// The images of leases waiting to start that are not on the host (to pull); read only
    /// while a lease waits for its job to start.
    pub missing_images: BTreeSet<String>,
    /// The leases waiting to start whose checkpoint is not restored yet (by lease id):
    /// with object storage, each attempt's checkpoint is fetched from the bucket before its
    /// job starts. Always empty with other storage.
    pub unrestored: BTreeSet<u64>,
}

/// The running replica's vLLM as probed this round.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaProbe {
    pub container_id: String,
    /// Where it answers; `None` while its port is not bound.
    pub url: Option<String>,
    /// `/health`; this and the readings below are `None` when vLLM was not asked this round
    /// (a replica serving with no sequence under way is left alone).
    pub health: Option<Health>,
    pub requests_running: Option<f64>,
    pub requests_waiting: Option<f64>,
    /// `/is_sleeping`; `None` when it did not answer.
    pub is_sleeping: Option<bool>,
    /// `vllm:engine_sleep_state`.
    pub sleep_state: Option<String>,
}

impl ReplicaProbe {
    /// `/is_sleeping`, or the metrics page's `vllm:engine_sleep_state` when that endpoint
    /// does not answer.
    pub fn says_asleep(&self) -> bool {
        match self.is_sleeping {
            Some(asleep) => asleep,
            None => self.sleep_state.as_deref().is_some_and(|s| s != "awake"),
        }
    }
}

/// A lease whose container could not be started. It is reported while its lease is listed,
/// and for a lease TTL after (a reclaim may take the lease back before the coordinator has
/// heard): the attempt fails, it is not taken for a preemption.
#[derive(Debug, Clone, PartialEq)]
pub struct StartFailure {
    /// The run reported: the lease's job, attempt, epoch, GPUs and why.
    pub run: JobRun,
    /// Since when the desired state no longer lists the lease.
    pub unlisted_since: Option<Moment>,
}

impl StartFailure {
    /// The job's own failure: its image is missing, its checkpoint cannot be restored.
    pub fn new(lease: &LeaseGrant, message: String) -> Self {
        Self::reported(lease, message, false)
    }

    /// The host's refusal: its checkpoint volume is short of space.
    pub fn refused(lease: &LeaseGrant, message: String) -> Self {
        Self::reported(lease, message, true)
    }

    /// Either, as `refused_by_host` says.
    pub fn reported(lease: &LeaseGrant, message: String, refused_by_host: bool) -> Self {
        Self {
            run: JobRun {
                job_id: lease.job_id,
                attempt: lease.attempt,
                lease_id: lease.lease_id,
                epoch: lease.epoch,
                gpus: lease.gpus.clone(),
                state: JobRunState::FailedToStart {
                    message,
                    refused_by_host,
                },
                last_checkpoint_at: None,
                outputs: BTreeMap::new(),
                image_id: None,
                image_digest: None,
                ready: false,
            },
            unlisted_since: None,
        }
    }
}

/// A wait inside a sequence, remembered with when it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Drain: not-ready, waiting out the readiness grace.
    MarkNotReady,
    /// Drain: waiting for no request running and none waiting, or the drain timeout.
    WaitInFlight,
    /// Drain, sleep mode: vLLM was told to sleep; waiting for NVML to show the memory gone.
    ConfirmAsleep,
    /// Drain, sleep mode: the sleep failed; the replica is stopped instead.
    StopInstead,
    /// Drain: the replica stopped; waiting for NVML to show its GPUs free.
    ConfirmStopped,
    /// Waiting for the leased GPUs to be free before jobs start.
    ConfirmFreeForJobs,
    /// Reclaim: waiting for the GPUs to be free before the replica starts.
    ConfirmFreeForReplica,
    /// Reclaim, sleep mode: waiting for the jobs' memory to go before waking vLLM.
    ConfirmFreeForWake,
    /// Reclaim, sleep mode: vLLM was told to wake; waiting until it no longer sleeps.
    WakeReplica,
    /// Waiting for `/health` to answer 200.
    WaitHealth,
}

/// What the agent remembers across passes.
#[derive(Debug, Clone, PartialEq)]
pub struct Memory {
    /// The replica's state; it changes only through [`crate::lifecycle::apply`].
    pub replica: ReplicaState,
    /// Highest fencing epoch honoured per GPU; a lease below it is stale and refused.
    pub fenced: BTreeMap<u32, u64>,
    /// Containers this agent stopped (reclaim, cancel), as opposed to ones that exited alone.
    pub stopped: BTreeSet<String>,
    /// Leases whose container could not be started, with why.
    pub start_failures: BTreeMap<u64, StartFailure>,
    /// Leases the fail-safe stopped (id → epoch): refused until the coordinator drops them.
    pub void: BTreeMap<u64, u64>,
    /// A silence already logged (the fail-safe is loud once, not every pass).
    pub silence_logged: bool,
    /// The wait the current sequence is in, and since when.
    pub phase: Option<(Phase, Moment)>,
    /// Finished containers whose removal failed in this pass (tried again next pass).
    pub unremovable: BTreeSet<String>,
    /// The job containers running at the last look at the engine.
    pub running_jobs: BTreeSet<String>,
    /// While the engine does not answer: the job containers that ran when it went away.
    pub engine_away: Option<BTreeSet<String>>,
    /// The job images: pinned, pulled by this agent, wanted this round.
    pub images: crate::images::Images,
    /// The exited job containers whose checkpoint upload was started (object storage).
    pub uploading: BTreeSet<String>,
    /// Leases whose checkpoint was restored from the object store (lease id → the restore).
    pub restored: BTreeMap<u64, Restore>,
    /// What each exited job container left (its output parameters and captured files),
    /// by container id: read once, reported until the container is removed.
    pub outputs: BTreeMap<String, BTreeMap<String, String>>,
}

/// A lease's checkpoint restored from the object store into its attempt's directory.
#[derive(Debug, Clone, PartialEq)]
pub struct Restore {
    pub lease: LeaseGrant,
    /// The epoch whose checkpoint fills the directory; `None`: there was none to restore.
    pub from_epoch: Option<u64>,
    /// Whether the attempt's container was started since.
    pub started: bool,
}

impl Default for Memory {
    fn default() -> Self {
        Self {
            replica: ReplicaState::Stopped,
            fenced: BTreeMap::new(),
            stopped: BTreeSet::new(),
            start_failures: BTreeMap::new(),
            void: BTreeMap::new(),
            silence_logged: false,
            phase: None,
            unremovable: BTreeSet::new(),
            running_jobs: BTreeSet::new(),
            engine_away: None,
            images: Default::default(),
            uploading: BTreeSet::new(),
            restored: BTreeMap::new(),
            outputs: BTreeMap::new(),
        }
    }
}

impl Memory {
    /// The phase's start, when the sequence is in `phase`.
    pub fn since(&self, phase: Phase) -> Option<Moment> {
        self.phase.filter(|(p, _)| *p == phase).map(|(_, t)| t)
    }

    /// Learns the epochs of the jobs running on each GPU.
    pub fn learn_fences(&mut self, containers: &[Container]) {
        for c in jobs(containers) {
            let epoch = label_u64(c, labels::EPOCH).unwrap_or(0);
            for gpu in gpus_of(c) {
                let e = self.fenced.entry(gpu).or_default();
                *e = (*e).max(epoch);
            }
        }
    }

    /// The engine did not answer: remembers which job containers ran when it went away
    /// (once, however long it stays away).
    pub fn engine_lost(&mut self) {
        if self.engine_away.is_none() {
            self.engine_away = Some(std::mem::take(&mut self.running_jobs));
        }
    }

    /// A look at the engine's `containers`. After the engine was away, a job container that
    /// ran when it went away and has exited since was stopped with the engine (a dockerd
    /// stop or restart stops its containers: its exit code is the engine's SIGTERM or
    /// SIGKILL, not the job's verdict), so it counts as stopped by the agent's side and the
    /// coordinator requeues the job instead of counting a failure: those containers are
    /// returned, newly in [`Memory::stopped`]. Then remembers which job containers run now.
    pub fn engine_seen<'a>(&mut self, containers: &'a [Container]) -> Vec<&'a Container> {
        let mut stopped_with_engine = Vec::new();
        if let Some(ran) = self.engine_away.take() {
            for c in jobs(containers) {
                if matches!(c.state, ContainerState::Exited { .. })
                    && ran.contains(&c.id)
                    && self.stopped.insert(c.id.clone())
                {
                    stopped_with_engine.push(c);
                }
            }
        }
        self.running_jobs = jobs(containers)
            .filter(|c| c.state == ContainerState::Running)
            .map(|c| c.id.clone())
            .collect();
        stopped_with_engine
    }

    /// The checkpoint uploads to start now (object storage): one for each job container
    /// that has exited, once per container, whether the job ended alone or was stopped.
    /// Containers no longer on the host are forgotten.
    pub fn uploads_due(&mut self, containers: &[Container]) -> Vec<Upload> {
        self.uploading
            .retain(|id| containers.iter().any(|c| &c.id == id));
        let mut due = Vec::new();
        for c in jobs(containers) {
            if !matches!(c.state, ContainerState::Exited { .. }) || self.uploading.contains(&c.id) {
                continue;
            }
            let (Some(job), Some(epoch)) =
                (label_u64(c, labels::JOB_ID), label_u64(c, labels::EPOCH))
            else {
                continue;
            };
            self.uploading.insert(c.id.clone());
            due.push(Upload {
                job,
                rank: label_u64(c, labels::RANK).and_then(|r| u32::try_from(r).ok()),
                epoch,
                reclaim: self.stopped.contains(&c.id),
            });
        }
        due
    }

    /// The restore of `lease`'s checkpoint from the object store ended: done, from the
    /// checkpoint of epoch `from_epoch` (`None`: there was none, the attempt starts afresh),
    /// or failed for a reason, which fails the lease's start: its job does not start
    /// without the checkpoint it would resume from.
    pub fn restore_ended(&mut self, lease: LeaseGrant, outcome: Result<Option<u64>, String>) {
        match outcome {
            Ok(from_epoch) => self.restored(lease, from_epoch),
            Err(reason) => {
                self.failed_to_start(&lease, format!("restoring the checkpoint: {reason}"), false)
            }
        }
    }

    /// The checkpoint of `lease` was restored from the object store, from `from_epoch`'s.
    pub fn restored(&mut self, lease: LeaseGrant, from_epoch: Option<u64>) {
        self.restored.insert(
            lease.lease_id,
            Restore {
                lease,
                from_epoch,
                started: false,
            },
        );
    }

    /// Forgets the restores of the leases the coordinator no longer lists (`leases` are
    /// those it does): of those restores still under way (`running`), the ones to abort;
    /// and, for a lease restored whose container never started, its directory's upload, so
    /// that a later attempt of the job, here or elsewhere, finds the restored checkpoint in
    /// the store rather than waiting for an upload that never comes.
    pub fn forget_restores(
        &mut self,
        leases: &[LeaseGrant],
        containers: &[Container],
        running: impl IntoIterator<Item = u64>,
    ) -> (Vec<u64>, Vec<Upload>) {
        let listed: BTreeSet<u64> = leases.iter().map(|l| l.lease_id).collect();
        let abort: Vec<u64> = running
            .into_iter()
            .filter(|id| !listed.contains(id))
            .collect();
        let gone: Vec<u64> = self
            .restored
            .keys()
            .filter(|id| !listed.contains(id))
            .copied()
            .collect();
        let mut uploads = Vec::new();
        for id in gone {
            let Some(r) = self.restored.remove(&id) else {
                continue;
            };
            let has_container = jobs(containers).any(|c| lease_of(c) == Some(id));
            if !r.started && !has_container {
                uploads.push(Upload {
                    job: r.lease.job_id,
                    rank: crate::gang_rank(&r.lease),
                    epoch: r.lease.epoch,
                    reclaim: false,
                });
            }
        }
        (abort, uploads)
    }

    /// Fences `lease`'s GPUs at its epoch as its container is started: from then on a lease
    /// of a lower epoch on any of them is stale ([`honoured`]), whatever the coordinator
    /// lists (ARCHITECTURE.md, invariant 3).
    pub fn fence(&mut self, lease: &LeaseGrant) {
        for g in &lease.gpus {
            let e = self.fenced.entry(*g).or_default();
            *e = (*e).max(lease.epoch);
        }
    }

    /// `lease`'s job cannot start, for `reason`: its attempt is reported failed (or,
    /// `refused_by_host`, refused) until the coordinator has heard.
    pub fn failed_to_start(&mut self, lease: &LeaseGrant, reason: String, refused_by_host: bool) {
        self.start_failures.insert(
            lease.lease_id,
            StartFailure::reported(lease, reason, refused_by_host),
        );
    }

    /// The exited job containers of listed `leases` whose outputs are still to be read:
    /// each once, and only once it has exited (what a running job writes may change).
    pub fn outputs_due<'a>(
        &self,
        leases: &'a [LeaseGrant],
        containers: &'a [Container],
    ) -> Vec<(&'a LeaseGrant, &'a Container)> {
        leases
            .iter()
            .filter_map(|l| {
                let c = jobs(containers).find(|c| lease_of(c) == Some(l.lease_id))?;
                let due = matches!(c.state, ContainerState::Exited { .. })
                    && !self.outputs.contains_key(&c.id);
                due.then_some((l, c))
            })
            .collect()
    }

    /// vLLM's `/sleep` failed at `now` (it answered an error, or no replica was awake to
    /// sleep): the drain stops the replica instead, as it would in stop mode.
    pub fn sleep_failed(&mut self, now: Moment) {
        self.phase = Some((Phase::StopInstead, now));
    }

    /// The registry would not give `image` (`reason` says why): every lease waiting to start
    /// that needs it fails to start (its attempt is reported failed, naming the registry's
    /// answer), and the node's other leases go on. Returns those leases' ids.
    pub fn pull_failed(
        &mut self,
        leases: &[LeaseGrant],
        containers: &[Container],
        image: &str,
        reason: &str,
    ) -> Vec<u64> {
        let failed: Vec<LeaseGrant> = unstarted(leases, containers, self)
            .into_iter()
            .filter(|l| l.job.image == image)
            .cloned()
            .collect();
        for lease in &failed {
            self.failed_to_start(lease, reason.to_owned(), false);
        }
        failed.iter().map(|l| l.lease_id).collect()
    }

    /// These job containers are being stopped by the agent (a reclaim, a cancel, the
    /// fail-safe): their exit is reported as stopped by the agent, not as the job's verdict.
    pub fn stopping(&mut self, jobs: &[StopJob]) {
        self.stopped.extend(jobs.iter().map(|j| j.id.clone()));
    }

    /// The finished container `c` was removed: nothing of it is remembered any longer.
    pub fn removed(&mut self, c: &Container) {
        self.stopped.remove(&c.id);
        self.outputs.remove(&c.id);
        if let Some(lease) = lease_of(c) {
            self.start_failures.remove(&lease);
        }
    }

    /// Notes which start failures' leases the coordinator no longer lists, and forgets those
    /// unlisted for a lease TTL.
    pub fn track_start_failures(&mut self, desired: &DesiredNode, now: Moment) {
        let ttl = Duration::from_millis(desired.lease_ttl_ms);
        for (id, f) in &mut self.start_failures {
            if desired.leases.iter().any(|l| l.lease_id == *id) {
                f.unlisted_since = None;
            } else {
                f.unlisted_since.get_or_insert(now);
            }
        }
        self.start_failures
            .retain(|_, f| f.unlisted_since.is_none_or(|t| now.duration_since(t) < ttl));
    }
}

/// Tries of one checkpoint upload at most (each request is also tried again on its own).
pub const UPLOAD_TRIES: u32 = 5;

/// After `tries` failed tries of a checkpoint upload, how long to wait before the whole
/// upload is tried again (2, 4, 8 and 16 s: the bucket may be back); `None`: give up, and a
/// later attempt resumes from an older checkpoint.
pub fn upload_retry(tries: u32) -> Option<Duration> {
    (tries < UPLOAD_TRIES).then(|| Duration::from_secs(1 << tries.min(16)))
}

/// A checkpoint upload to start: the directory of an attempt whose container exited (or
/// that was restored and never started).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upload {
    pub job: u64,
    /// The gang rank whose checkpoints it is (`None`: a single-node job's).
    pub rank: Option<u32>,
    pub epoch: u64,
    /// The agent stopped the container (a reclaim or a preemption): the upload is a phase
    /// of that sequence. Otherwise the job ended on its own.
    pub reclaim: bool,
}

/// Something the executor does.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Something happened to the replica: its state moves.
    Replica(ReplicaEvent),
    /// The sequence enters `Phase` (stamped when the step runs); `None` ends it.
    Enter(Option<Phase>),
    /// Records a finished phase of a sequence, begun at `began`.
    Record {
        sequence: SequenceKind,
        phase: &'static str,
        began: Moment,
    },
    /// Sends these jobs their checkpoint signal and kills each after its grace, all at once;
    /// records `stop_jobs` when `reclaim`.
    StopJobs { jobs: Vec<StopJob>, reclaim: bool },
    /// Stops the replica container (its SIGTERM, then the kill after `grace`); records
    /// `stop_replica`.
    StopReplica { id: String, grace: Duration },
    /// Puts vLLM to sleep; records `sleep_replica`. When it fails, the sequence enters
    /// [`Phase::StopInstead`] and the rest of the plan is dropped.
    SleepReplica { url: String },
    /// Tells vLLM to wake up.
    WakeReplica { url: String },
    /// Starts the replica's container on every GPU; records `start_replica`.
    StartReplica,
    /// Starts a container for each lease (its own checkpoint directory, fenced GPUs);
    /// records `start_jobs`.
    StartJobs(Vec<LeaseGrant>),
    /// Pulls `image`, which these leases' jobs need, while the replica (if any) still
    /// serves: the executor starts the pull in the background (once) and looks again a poll
    /// later. When the pull fails, each lease fails to start with the registry's reason.
    Pull {
        image: String,
        leases: Vec<LeaseGrant>,
    },
    /// Restores these leases' checkpoints from the bucket (object storage), while the
    /// replica (if any) still serves: the executor starts each restore in the background
    /// (once) and looks again a poll later. A restore that fails fails its lease's start.
    Restore(Vec<LeaseGrant>),
    /// The lease's job cannot start, for this reason: reported as failed to start, or as
    /// refused when the host is the reason (see [`StartFailure::refused`]).
    FailStart {
        lease: Box<LeaseGrant>,
        message: String,
        refused_by_host: bool,
    },
    /// Keeps a finished job's output, then removes its container.
    Remove(Container),
    /// Worth saying in the log.
    Note(Note),
    /// The sequence cannot go on: it ends with this error, and starts over next pass.
    GiveUp(Stuck),
    /// Looks again after a poll interval (or as soon as the desired state changes).
    Wait,
}

/// A job container to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopJob {
    pub id: String,
    pub lease_id: Option<u64>,
    /// Between its checkpoint signal and the kill: its `GRACE_LABEL`, else 30 s.
    pub grace: Duration,
}

/// What the planner wants logged.
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    DrainAbandoned,
    DrainTimeout {
        running: Option<f64>,
        waiting: Option<f64>,
    },
    ReplicaUnreachable,
    NotAsleep,
    SleepFreedTooLittle {
        limit: u64,
    },
}

/// Why a sequence gave up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stuck {
    GpusBusy { gpus: Vec<u32>, waited: Duration },
    HealthTimeout(Duration),
}

/// The steps that bring the host towards `desired` (already stripped of void leases and
/// stale ones by the executor: see [`honoured`] and `failsafe::effective`), given what was
/// observed and what is remembered, at `now`. No step means the host matches.
pub fn plan(
    cfg: &PlanConfig,
    desired: Option<&DesiredNode>,
    leases: &[LeaseGrant],
    obs: &Observation,
    mem: &Memory,
    now: Moment,
) -> Vec<Step> {
    let Some(desired) = desired else {
        return adopt(obs, mem);
    };
    // Jobs whose lease is gone are stopped first: their GPUs go back before anything else.
    let serve = desired.serve && leases.is_empty();
    let unleased: Vec<StopJob> = jobs(&obs.containers)
        .filter(|c| c.state == ContainerState::Running)
        .filter(|c| !leases.iter().any(|l| Some(l.lease_id) == lease_of(c)))
        .map(|c| StopJob {
            id: c.id.clone(),
            lease_id: lease_of(c),
            grace: Duration::from_secs(label_u64(c, GRACE_LABEL).unwrap_or(30)),
        })
        .collect();
    if !unleased.is_empty() {
        return vec![Step::StopJobs {
            jobs: unleased,
            reclaim: serve,
        }];
    }
    let steps = if serve {
        crate::reclaim::plan(cfg, obs, mem, now)
    } else if let Some(refusals) = refuse_short_of_space(cfg, leases, obs, mem) {
        // Nothing is done for a job while its checkpoint volume is short of space: no pull,
        // no restore, no drain. Refused at once, it goes back to the queue, and a replica
        // that serves keeps serving (below, once every lease is refused).
        refusals
    } else if let Some(pull) = pull(leases, obs, mem) {
        // Images are pulled before the drain begins: the replica serves during the pull,
        // and no GPU waits idle for one.
        vec![pull]
    } else if let Some(restore) = restore(leases, obs, mem) {
        // So are checkpoints restored: a restore may wait for another host's upload.
        vec![restore]
    } else if !leases.is_empty()
        && leases
            .iter()
            .all(|l| mem.start_failures.contains_key(&l.lease_id))
        && !jobs(&obs.containers).any(|c| lease_of(c).is_some())
        && mem.replica == ReplicaState::Serving
        && mem.phase.is_none()
    {
        // Every lease failed to start before the drain began (its image could not be
        // pulled, or the host refused it for want of checkpoint space): the replica keeps
        // serving until the coordinator hears and drops them.
        Vec::new()
    } else if held_while_serving(leases, obs, mem) {
        // Gang members whose peers are not all ready (pulling still): the replica serves
        // on until the coordinator says that the whole gang can start.
        Vec::new()
    } else {
        match crate::drain::plan(cfg, obs, mem, now) {
            steps if steps.is_empty() => start_jobs(cfg, leases, obs, mem, now),
            steps => steps,
        }
    };
    if !steps.is_empty() {
        return steps;
    }
    remove_finished(leases, obs, mem)
}

/// Before the coordinator has answered: a replica that runs is adopted (serving when
/// healthy, sleeping when asleep too, else starting); nothing else changes.
fn adopt(obs: &Observation, mem: &Memory) -> Vec<Step> {
    let Some(p) = &obs.replica else {
        return Vec::new();
    };
    let healthy = p.health == Some(Health::Healthy);
    let event = ReplicaEvent::Adopted {
        healthy,
        asleep: healthy && p.is_sleeping == Some(true),
    };
    match crate::lifecycle::apply(mem.replica, event) {
        Ok(to) if to != mem.replica => vec![Step::Replica(event)],
        _ => Vec::new(),
    }
}

/// Starts a container for each honoured lease that has none yet, once the replica is
/// stopped or asleep and NVML shows the leased GPUs free.
fn start_jobs(
    cfg: &PlanConfig,
    leases: &[LeaseGrant],
    obs: &Observation,
    mem: &Memory,
    now: Moment,
) -> Vec<Step> {
    if !matches!(mem.replica, ReplicaState::Stopped | ReplicaState::Sleeping) {
        return Vec::new();
    }
    // A gang member held for its peers waits here with its GPUs free (its node was lent
    // already, or drained for another lease): the coordinator bounds the wait.
    let missing: Vec<&LeaseGrant> = unstarted(leases, &obs.containers, mem)
        .into_iter()
        .filter(|l| !waits_for_peers(l))
        .collect();
    if missing.is_empty() {
        return Vec::new();
    }
    let gpus: Vec<u32> = missing
        .iter()
        .flat_map(|l| l.gpus.iter().copied())
        .collect();
    // A sleeping replica keeps its CUDA context.
    let limit = if mem.replica == ReplicaState::Sleeping {
        cfg.sleep_max_used_bytes
    } else {
        cfg.free_memory_bytes
    };
    let Some(began) = mem.since(Phase::ConfirmFreeForJobs) else {
        return vec![Step::Enter(Some(Phase::ConfirmFreeForJobs))];
    };
    let timeout = cfg.free_timeout;
    if let Some(stuck) = busy(obs, &gpus, limit, began, now, timeout) {
        return stuck;
    }
    let mut steps = Vec::new();
    let mut start = Vec::new();
    for lease in missing {
        // The volume may have filled during the drain.
        match checkpoint_volume_short(cfg, obs) {
            Some(message) => steps.push(Step::FailStart {
                lease: Box::new(lease.clone()),
                message,
                refused_by_host: true,
            }),
            None => start.push(lease.clone()),
        }
    }
    steps.push(Step::StartJobs(start));
    steps.push(Step::Enter(None));
    steps
}

/// The first image that leases waiting to start need and the host lacks, with those
/// leases: gang members and the node's other leases alike wait until every leased image is
/// there, so that the drain (and the GPUs' idle time) begins only once all can start.
fn pull(leases: &[LeaseGrant], obs: &Observation, mem: &Memory) -> Option<Step> {
    let waiting = unstarted(leases, &obs.containers, mem);
    let image = waiting
        .iter()
        .map(|l| &l.job.image)
        .find(|i| obs.missing_images.contains(*i))?;
    Some(Step::Pull {
        image: image.clone(),
        leases: waiting
            .into_iter()
            .filter(|l| &l.job.image == image)
            .cloned()
            .collect(),
    })
}

/// The leases waiting to start whose checkpoint is still to be restored, if any.
fn restore(leases: &[LeaseGrant], obs: &Observation, mem: &Memory) -> Option<Step> {
    let waiting: Vec<LeaseGrant> = unstarted(leases, &obs.containers, mem)
        .into_iter()
        .filter(|l| obs.unrestored.contains(&l.lease_id))
        .cloned()
        .collect();
    (!waiting.is_empty()).then_some(Step::Restore(waiting))
}

/// Whether the lease is a gang member that must not start yet: not every member of its gang
/// has its image on its host.
pub fn waits_for_peers(lease: &LeaseGrant) -> bool {
    lease.rendezvous.as_ref().is_some_and(|r| r.wait_for_peers)
}

/// Whether the replica serves, no drain has begun, and every lease waiting to start is a
/// gang member held for its peers: draining now would only leave the GPUs idle.
fn held_while_serving(leases: &[LeaseGrant], obs: &Observation, mem: &Memory) -> bool {
    let waiting = unstarted(leases, &obs.containers, mem);
    mem.replica == ReplicaState::Serving
        && mem.phase.is_none()
        && !waiting.is_empty()
        && waiting.iter().all(|l| waits_for_peers(l))
}

/// The leases with no container yet and no failure to start one.
pub fn unstarted<'a>(
    leases: &'a [LeaseGrant],
    containers: &[Container],
    mem: &Memory,
) -> Vec<&'a LeaseGrant> {
    leases
        .iter()
        .filter(|l| !jobs(containers).any(|c| lease_of(c) == Some(l.lease_id)))
        .filter(|l| !mem.start_failures.contains_key(&l.lease_id))
        .collect()
}

/// The leases waiting to start whose checkpoint is still to be restored from the object
/// store (with object storage, every lease's is restored before it starts).
pub fn unrestored(leases: &[LeaseGrant], containers: &[Container], mem: &Memory) -> BTreeSet<u64> {
    unstarted(leases, containers, mem)
        .into_iter()
        .filter(|l| !mem.restored.contains_key(&l.lease_id))
        .map(|l| l.lease_id)
        .collect()
}

/// Refusals of the leases waiting to start, while the checkpoint volume is short of space.
fn refuse_short_of_space(
    cfg: &PlanConfig,
    leases: &[LeaseGrant],
    obs: &Observation,
    mem: &Memory,
) -> Option<Vec<Step>> {
    let message = checkpoint_volume_short(cfg, obs)?;
    let waiting = unstarted(leases, &obs.containers, mem);
    (!waiting.is_empty()).then(|| {
        waiting
            .into_iter()
            .map(|lease| Step::FailStart {
                lease: Box::new(lease.clone()),
                message: message.clone(),
                refused_by_host: true,
            })
            .collect()
    })
}

/// Why no job may start for lack of checkpoint space, if so.
fn checkpoint_volume_short(cfg: &PlanConfig, obs: &Observation) -> Option<String> {
    let floor = cfg.checkpoint_min_free_bytes;
    let free = obs.checkpoint_free_bytes?;
    (free < floor).then(|| {
        format!(
            "the checkpoint volume of {} has {free} bytes free, below the floor of {floor} (checkpoint_min_free_bytes)",
            cfg.work_dir.display()
        )
    })
}

/// Removes exited job containers whose lease the coordinator no longer lists: it has seen
/// them end (or revoked them, and counts them gone).
fn remove_finished(leases: &[LeaseGrant], obs: &Observation, mem: &Memory) -> Vec<Step> {
    jobs(&obs.containers)
        .filter(|c| matches!(c.state, ContainerState::Exited { .. }))
        .filter(|c| !leases.iter().any(|l| Some(l.lease_id) == lease_of(c)))
        .filter(|c| !mem.unremovable.contains(&c.id))
        .map(|c| Step::Remove(c.clone()))
        .collect()
}

/// While any of `gpus` holds more than `limit` bytes: a wait, or past `timeout` since
/// `began`, giving up. `None` once they are all free.
pub(crate) fn busy(
    obs: &Observation,
    gpus: &[u32],
    limit: u64,
    began: Moment,
    now: Moment,
    timeout: Duration,
) -> Option<Vec<Step>> {
    let busy: Vec<u32> = match &obs.gpu_memory {
        Some(memory) => gpus
            .iter()
            .copied()
            .filter(|g| memory.get(g).is_some_and(|used| *used > limit))
            .collect(),
        None => gpus.to_vec(),
    };
    if busy.is_empty() {
        return None;
    }
    if now.duration_since(began) >= timeout {
        return Some(vec![
            Step::Enter(None),
            Step::GiveUp(Stuck::GpusBusy {
                gpus: busy,
                waited: timeout,
            }),
        ]);
    }
    Some(vec![Step::Wait])
}

/// A stale lease: older than an epoch already honoured on one of its GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stale {
    pub lease_id: u64,
    pub epoch: u64,
    pub gpu: u32,
    pub seen: u64,
}

/// The leases to act on (those not older than an epoch already honoured on their GPUs),
/// and the stale ones refused.
pub fn honoured(
    leases: &[LeaseGrant],
    fenced: &BTreeMap<u32, u64>,
) -> (Vec<LeaseGrant>, Vec<Stale>) {
    let mut ok = Vec::new();
    let mut stale = Vec::new();
    for l in leases {
        let older = l
            .gpus
            .iter()
            .find_map(|g| fenced.get(g).filter(|&&e| l.epoch < e).map(|e| (*g, *e)));
        match older {
            Some((gpu, seen)) => stale.push(Stale {
                lease_id: l.lease_id,
                epoch: l.epoch,
                gpu,
                seen,
            }),
            None => ok.push(l.clone()),
        }
    }
    (ok, stale)
}

#[cfg(test)]
mod tests;
