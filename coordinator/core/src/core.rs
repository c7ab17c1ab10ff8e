//! [`Core`]: the state of the cluster and the calls that change it.
//!
//! Every mutating call ends with [`Core::decide`], which expires leases, scales each service
//! and places queued jobs, so a decision follows the input that made it possible at once.
//!
//! One exception keeps a large fleet cheap: a heartbeat that reports nothing the decisions
//! read (same replica state and signals, same occupied GPUs, no job event, no new phase, the
//! node already reachable) does not decide again when the last decision changed nothing and
//! is younger than one heartbeat interval. Deciding again would only differ by the time,
//! and time-driven decisions have their deadline in [`Core::next_deadline`] (or, for the
//! rules without one, wait at most one heartbeat interval).

use std::collections::{BTreeMap, BTreeSet};

use nightshift_common::{
    AttemptMember, DesiredNode, GpuInfo, Heartbeat, JobRun, JobRunState, JobSpec, JobState,
    JobView, LeaseGrant, LeaseView, NodeGpuView, NodeMode, NodeView, Rendezvous, SpecError,
    UnixMillis,
};

use crate::checkpoint::Checkpoints;
use crate::config::CoreConfig;
use crate::index::JobIndex;
use crate::job::{IllegalTransition, Job, JobEvent};
use crate::lease::{Lease, LeaseTable, Straggler};
use crate::node::{Held, Node};
use crate::snapshot::{CoreSnapshot, NodeSnapshot};

/// What changed, for the caller to persist and publish.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Effect {
    /// The job's record changed (state, leases, attempt, outputs).
    JobChanged(u64),
    /// The node's durable record changed and, when its `desired_version` moved, agents
    /// waiting on it must be woken.
    NodeChanged(String),
    /// A lease ended: what it used, for accounting.
    LeaseEnded(Usage),
    /// A service's load profile learned a new slot.
    ProfileChanged(String),
}

/// The GPU time one lease used, recorded when it ends.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Usage {
    pub lease_id: u64,
    pub job_id: u64,
    /// The job's owner, or `default`.
    pub team: String,
    pub node: String,
    pub gpus: u32,
    pub started_at: UnixMillis,
    pub ended_at: UnixMillis,
    /// Ended by a preemption (a reclaim, a silent node), not by the job.
    pub preempted: bool,
    /// GPU-milliseconds of work lost: for a preemption, the GPUs times the time since the
    /// job's last checkpoint (or its start, if it never checkpointed).
    pub lost_gpu_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("{0}")]
    InvalidSpec(#[from] SpecError),
    #[error("unknown service {0:?}")]
    UnknownService(String),
    #[error("node {0} is not registered")]
    UnknownNode(String),
    #[error("node {node} is registered for service {registered}, not {asked}")]
    ServiceMismatch {
        node: String,
        registered: String,
        asked: String,
    },
    #[error("job {0} not found")]
    UnknownJob(u64),
    #[error("job {job} is already {state}")]
    AlreadyFinished { job: u64, state: &'static str },
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

impl CoreError {
    /// The request field to blame, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::InvalidSpec(e) => Some(&e.field),
            _ => None,
        }
    }
}

/// Per-service scaling memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ServiceState {
    /// Since when the load has been low enough to lend a replica.
    pub(crate) low_since: Option<UnixMillis>,
    /// The last lend or reclaim.
    pub(crate) last_change: Option<UnixMillis>,
    /// Requests a gateway holds for want of a ready replica, and when it said so.
    pub(crate) gateway: Option<(u64, UnixMillis)>,
    /// What the service's load looks like by time of day and week.
    pub(crate) profile: crate::forecast::Profile,
}

#[derive(Debug, Clone)]
pub struct Core {
    pub(crate) config: CoreConfig,
    pub(crate) nodes: BTreeMap<String, Node>,
    pub(crate) jobs: BTreeMap<u64, Job>,
    /// The queue order and the per-owner counts, kept in step with `jobs`.
    pub(crate) index: JobIndex,
    pub(crate) leases: LeaseTable,
    /// Per job, the node holding its newest checkpoint, where only that node can resume it.
    pub(crate) checkpoints: Checkpoints,
    /// Gangs whose members have not all reported ready, by job: when their start times out
    /// ([`CoreConfig::gang_start_timeout_ms`]). Not persisted: rebuilt from the leases.
    pub(crate) gang_waits: BTreeMap<u64, UnixMillis>,
    pub(crate) next_job_id: u64,
    pub(crate) services: BTreeMap<String, ServiceState>,
    effects: BTreeSet<Effect>,
    /// How many effects have been recorded, ever: whether a step changed anything.
    changes: u64,
    /// Whether the last [`Core::decide`] changed nothing (a fixed point for its inputs).
    settled: bool,
    /// When [`Core::decide`] last ran.
    decided_at: Option<UnixMillis>,
    /// An observation arrived that a decision has not followed yet ([`Core::observe`]).
    pending: bool,
}

impl Core {
    pub fn new(config: CoreConfig) -> Self {
        Self::restore(config, CoreSnapshot::default(), 0)
    }

    /// Rebuilds the core from what was persisted. Leases are extended to `now + ttl`, so that
    /// agents get a full lease period to report in after a coordinator restart.
    pub fn restore(config: CoreConfig, snapshot: CoreSnapshot, now: UnixMillis) -> Self {
        let ttl = config.lease_ttl_ms;
        let mut leases = Vec::new();
        let mut jobs = BTreeMap::new();
        for view in snapshot.jobs {
            for l in &view.leases {
                leases.push(Lease {
                    id: l.lease_id,
                    epoch: l.epoch,
                    job: view.id,
                    rank: l.rank,
                    node: l.node.clone(),
                    gpus: l.gpus.clone(),
                    granted_at: l.granted_at,
                    // Renewed as a heartbeat would: a TTL from now, never the saved expiry,
                    // which a clock ahead of this one (a stepped wall clock, another
                    // coordinator's) may have put far in the future.
                    expires_at: now + ttl,
                    revoked: l.revoked,
                    granted_version: 0,
                    ready: false,
                });
            }
            jobs.insert(view.id, job_from_view(view));
        }
        let checkpoints = Checkpoints::restore(snapshot.nodes.iter().flat_map(|n| {
            n.checkpoints
                .iter()
                .map(|&(job, epoch)| (n.name.as_str(), job, epoch))
        }));
        let mut nodes: BTreeMap<String, Node> = snapshot
            .nodes
            .into_iter()
            .map(|s| {
                let mut node = Node::new(&s.name, &s.service, s.gpus, s.mode_since);
                node.mode = s.mode;
                node.desired_version = s.desired_version;
                node.address = s.address;
                (s.name, node)
            })
            .collect();
        let leases = LeaseTable::restore(leases, snapshot.next_lease_id, snapshot.next_epoch);
        for n in nodes.values_mut() {
            n.held = Held::of(leases.on_node(&n.name));
        }
        // A gang still starting waits for its members again, as long as it had left, and at
        // least a lease TTL: its agents report ready again at their next heartbeat.
        let gang_waits = jobs
            .values()
            .filter(|j: &&Job| j.spec.nodes > 1 && j.state == JobState::Starting)
            .filter_map(|j| {
                let granted = j
                    .leases
                    .iter()
                    .filter_map(|id| leases.get(*id))
                    .map(|l| l.granted_at)
                    .min()?;
                Some((
                    j.id,
                    (granted + config.gang_start_timeout_ms).max(now + ttl),
                ))
            })
            .collect();
        let max_job = jobs.keys().copied().max().unwrap_or(0);
        let mut profiles: BTreeMap<String, crate::forecast::Profile> =
            snapshot.profiles.into_iter().collect();
        let services = config
            .services
            .iter()
            .map(|s| {
                let profile = profiles.remove(&s.name).unwrap_or_default();
                (
                    s.name.clone(),
                    ServiceState {
                        profile,
                        ..ServiceState::default()
                    },
                )
            })
            .collect();
        Self {
            config,
            nodes,
            index: JobIndex::build(jobs.values()),
            jobs,
            leases,
            checkpoints,
            gang_waits,
            next_job_id: snapshot.next_job_id.max(max_job + 1).max(1),
            services,
            effects: BTreeSet::new(),
            changes: 0,
            settled: false,
            decided_at: None,
            pending: false,
        }
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// Records a change. Every change to a job passes here, which keeps the job index in
    /// step with the jobs.
    fn effect(&mut self, effect: Effect) {
        if let Effect::JobChanged(id) = &effect
            && let Some(job) = self.jobs.get(id)
        {
            self.index.sync(job);
        }
        self.changes += 1;
        self.effects.insert(effect);
    }

    /// What changed since the last call, each entity once.
    pub fn poll_effects(&mut self) -> Vec<Effect> {
        if self.effects.is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut self.effects).into_iter().collect()
    }

    // ---- inputs -------------------------------------------------------------------------

    /// An agent announces itself. Registering again (after an agent restart) keeps the node's
    /// mode and leases; only its GPU inventory is refreshed.
    pub fn register(
        &mut self,
        now: UnixMillis,
        node: &str,
        service: &str,
        gpus: Vec<GpuInfo>,
    ) -> Result<(), CoreError> {
        self.enroll(now, node, service, gpus, None)?;
        self.decide(now);
        Ok(())
    }

    /// [`Core::register`] without the decision, with the address other nodes reach this one
    /// at: [`Core::decision_pending`] says a decision should follow. When a whole fleet
    /// (re)starts, a shell decides once for many registrations instead of once each, which
    /// would cost every registration a pass over every node already known.
    pub fn enroll(
        &mut self,
        now: UnixMillis,
        node: &str,
        service: &str,
        gpus: Vec<GpuInfo>,
        address: Option<String>,
    ) -> Result<(), CoreError> {
        if !self.services.contains_key(service) {
            return Err(CoreError::UnknownService(service.to_owned()));
        }
        let n = match self.nodes.get_mut(node) {
            Some(n) if n.service != service => {
                return Err(CoreError::ServiceMismatch {
                    node: node.to_owned(),
                    registered: n.service.clone(),
                    asked: service.to_owned(),
                });
            }
            Some(n) => {
                n.gpus = gpus;
                n
            }
            None => {
                // Leases restored for a node not known yet are its own from the start.
                let mut n = Node::new(node, service, gpus, now);
                n.held = Held::of(self.leases.on_node(node));
                self.nodes.entry(node.to_owned()).or_insert(n)
            }
        };
        n.last_heartbeat = Some(now);
        n.address = address.unwrap_or_else(|| node.to_owned());
        self.effect(Effect::NodeChanged(node.to_owned()));
        self.pending = true;
        Ok(())
    }

    /// What an agent observes. Renews the node's leases and moves its jobs along, then
    /// decides if the report could change a decision.
    pub fn heartbeat(
        &mut self,
        now: UnixMillis,
        node: &str,
        beat: Heartbeat,
    ) -> Result<(), CoreError> {
        self.observe(now, node, beat)?;
        if self.pending {
            self.decide(now);
        }
        Ok(())
    }

    /// [`Core::heartbeat`] without the decision: the report's own consequences (job states,
    /// released and revoked leases) happen now, and [`Core::decision_pending`] says whether a
    /// decision should follow. A shell with many agents decides once for many reports, on
    /// [`Core::tick`], instead of once per report.
    pub fn observe(
        &mut self,
        now: UnixMillis,
        node: &str,
        beat: Heartbeat,
    ) -> Result<(), CoreError> {
        let changes_before = self.changes;
        let ttl = self.config.lease_ttl_ms;
        let n = self
            .nodes
            .get_mut(node)
            .ok_or_else(|| CoreError::UnknownNode(node.to_owned()))?;
        // What the decisions read of a node, before and after this report: whether it is
        // reachable, its replica, the GPUs job containers occupy and its latest phase. The
        // report's parts replace the node's, so the old ones are compared, not copied.
        let reachable = n.reachable(now, ttl);
        let last_phase = n.phases.back().map(|p| p.seq);
        n.last_heartbeat = Some(now);
        n.applied_version = beat.applied_version;
        if let Some(host) = &beat.host {
            // Shared directories and buckets alike: any host resumes from the newest.
            n.checkpoints_shared = !host.checkpoint_storage.is_local();
        }
        n.gpu_status = beat.gpus;
        let replica = n.replica.replace(beat.replica);
        n.record_phases(&beat.phases);
        let runs = std::mem::replace(&mut n.runs, beat.jobs);
        let observed_change = n.reachable(now, ttl) != reachable
            || n.replica != replica
            || !crate::node::same_occupied(&runs, &n.runs)
            || n.phases.back().map(|p| p.seq) != last_phase;
        let applied = n.applied_version;
        // Leases the agent's fail-safe stopped while it could not reach us: their jobs were
        // checkpointed and stopped; requeue them as preempted before anything is renewed.
        for id in &beat.expired_leases {
            let Some(lease) = self.leases.get(*id).filter(|l| l.node == node).cloned() else {
                continue;
            };
            let message = format!(
                "preempted: node {node} lost the coordinator and stopped the job (fail-safe)"
            );
            if self
                .jobs
                .get(&lease.job)
                .is_some_and(|j| j.leases.contains(id))
            {
                self.member_event(
                    now,
                    lease.job,
                    lease.id,
                    JobEvent::MemberLost {
                        lease: *id,
                        message,
                        ran: false,
                    },
                );
            } else {
                self.release(now, *id, true);
            }
        }
        self.leases.renew(node, now, self.config.lease_ttl_ms);

        // What the report tells each of the node's leases, worked out from the leases and
        // the report as they are now, before the events below change the table.
        struct Told {
            lease: u64,
            job: u64,
            epoch: u64,
            checkpoint_at: Option<UnixMillis>,
            event: Option<JobEvent>,
            /// The member can start (its image is there) or has started.
            ready: bool,
        }
        let runs: &[JobRun] = self.nodes.get(node).map_or(&[], |n| &n.runs);
        let told: Vec<Told> = self
            .leases
            .on_node(node)
            .map(|lease| {
                let run = runs
                    .iter()
                    .find(|r| r.lease_id == lease.id && r.epoch == lease.epoch);
                let event = match run.map(|r| &r.state) {
                    Some(JobRunState::Running | JobRunState::Stopping) => Some(JobEvent::Started),
                    Some(JobRunState::Pending) => None,
                    Some(JobRunState::Exited {
                        exit_code,
                        stopped_by_agent,
                    }) => {
                        if lease.revoked || *stopped_by_agent {
                            Some(JobEvent::MemberLost {
                                lease: lease.id,
                                message: format!("stopped on node {node} (exit code {exit_code})"),
                                ran: true,
                            })
                        } else {
                            let outputs = run.map(|r| r.outputs.clone()).unwrap_or_default();
                            Some(JobEvent::MemberExited {
                                lease: lease.id,
                                exit_code: *exit_code,
                                outputs,
                            })
                        }
                    }
                    Some(JobRunState::FailedToStart {
                        message,
                        refused_by_host: false,
                    }) => Some(JobEvent::MemberStartFailed {
                        lease: lease.id,
                        message: message.clone(),
                    }),
                    Some(JobRunState::FailedToStart {
                        message,
                        refused_by_host: true,
                    }) => Some(JobEvent::MemberRefused {
                        lease: lease.id,
                        message: format!("refused by node {node}: {message}"),
                    }),
                    // Not reported although the agent has applied the state that granted it
                    // (or the lease was revoked): the container is gone.
                    None if lease.revoked || applied >= lease.granted_version.max(1) => {
                        Some(JobEvent::MemberLost {
                            lease: lease.id,
                            message: if lease.revoked {
                                format!("its lease on node {node} was revoked")
                            } else {
                                format!("container vanished from node {node}")
                            },
                            ran: false,
                        })
                    }
                    None => None,
                };
                let ready = match run {
                    Some(r) if r.state == JobRunState::Pending => r.ready,
                    Some(_) => true,
                    None => false,
                };
                Told {
                    lease: lease.id,
                    job: lease.job,
                    epoch: lease.epoch,
                    checkpoint_at: run.and_then(|r| r.last_checkpoint_at),
                    event,
                    ready,
                }
            })
            .collect();
        // Before the events: a job that ran and ended within one report is pinned too.
        self.pin_images(node);
        self.stragglers_reported_gone(node);
        for told in told {
            if let Some(at) = told.checkpoint_at
                && let Some(job) = self.jobs.get_mut(&told.job)
                && job.last_checkpoint_at < Some(at)
            {
                job.last_checkpoint_at = Some(at);
                self.effect(Effect::JobChanged(told.job));
            }
            if told.checkpoint_at.is_some() {
                self.checkpoint_reported(node, told.job, told.epoch);
            }
            if told.ready && self.leases.mark_ready(told.lease) {
                self.member_ready(told.job);
            }
            if let Some(event) = told.event {
                self.member_event(now, told.job, told.lease, event);
            }
        }
        let quiet = !observed_change && self.changes == changes_before;
        let settled = self.settled
            && self
                .decided_at
                .is_some_and(|t| now < t + self.config.heartbeat_interval_ms);
        if !(quiet && settled) {
            self.pending = true;
        }
        Ok(())
    }

    /// Pins each job that `node` runs under a current lease to the registry digest its
    /// container reported, at its first start.
    fn pin_images(&mut self, node: &str) {
        let reported: Vec<(u64, String)> = self.nodes.get(node).map_or(Vec::new(), |n| {
            n.runs
                .iter()
                .filter_map(|r| Some((r.job_id, r.lease_id, r.image_digest.as_ref()?)))
                .filter(|(job, lease, _)| {
                    self.jobs.get(job).is_some_and(|j| j.leases.contains(lease))
                })
                .map(|(job, _, digest)| (job, digest.clone()))
                .collect()
        });
        for (job, digest) in reported {
            if self
                .jobs
                .get_mut(&job)
                .is_some_and(|j| j.pin_image(&digest))
            {
                self.effect(Effect::JobChanged(job));
            }
        }
    }

    /// A member of `job` has just reported ready: once every member of a gang is, each
    /// member's node is told that its member may start (its desired state changes).
    fn member_ready(&mut self, job: u64) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        if j.spec.nodes <= 1 || !self.gang_ready(j) {
            return;
        }
        let nodes: BTreeSet<String> = j
            .leases
            .iter()
            .filter_map(|id| self.leases.get(*id))
            .map(|l| l.node.clone())
            .collect();
        self.gang_waits.remove(&job);
        for node in nodes {
            self.bump(&node);
        }
    }

    /// Whether every member of `job` has reported ready.
    fn gang_ready(&self, job: &Job) -> bool {
        job.leases
            .iter()
            .all(|id| self.leases.get(*id).is_some_and(|l| l.ready))
    }

    /// Fails the members of each gang that have not reported ready by its start deadline:
    /// the attempt fails to start (its retry policy applies), every member's lease is taken
    /// back and no member has started (each waits for all).
    fn enforce_gang_starts(&mut self, now: UnixMillis) {
        let due: Vec<u64> = self
            .gang_waits
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(job, _)| *job)
            .collect();
        let timeout_s = self.config.gang_start_timeout_ms / 1000;
        for id in due {
            self.gang_waits.remove(&id);
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            if job.state.is_finished() || job.stopping() || self.gang_ready(job) {
                continue;
            }
            let late: Vec<(u64, String)> = job
                .leases
                .iter()
                .filter_map(|l| self.leases.get(*l))
                .filter(|l| !l.ready)
                .map(|l| (l.id, l.node.clone()))
                .collect();
            for (lease, node) in late {
                let message = format!(
                    "the gang's members were not all ready within {timeout_s} s \
                     (gang_start_timeout_s): node {node} still has no image for its member"
                );
                self.member_event(
                    now,
                    id,
                    lease,
                    JobEvent::MemberStartFailed { lease, message },
                );
            }
        }
    }

    /// Whether an observation is waiting for a decision.
    pub fn decision_pending(&self) -> bool {
        self.pending
    }

    /// When the decisions last ran.
    pub fn decided_at(&self) -> Option<UnixMillis> {
        self.decided_at
    }

    /// A load balancer or gateway in front of `service` holds `waiting` requests because no
    /// replica is ready.
    pub fn gateway(
        &mut self,
        now: UnixMillis,
        service: &str,
        waiting: u64,
    ) -> Result<(), CoreError> {
        let s = self
            .services
            .get_mut(service)
            .ok_or_else(|| CoreError::UnknownService(service.to_owned()))?;
        s.gateway = Some((waiting, now));
        self.decide(now);
        Ok(())
    }

    pub fn submit(&mut self, now: UnixMillis, spec: JobSpec) -> Result<u64, CoreError> {
        spec.validate()?;
        self.check_fits(&spec)?;
        let id = self.next_job_id;
        self.next_job_id += 1;
        self.jobs.insert(id, Job::new(id, spec, now));
        self.effect(Effect::JobChanged(id));
        self.decide(now);
        Ok(id)
    }

    /// Refuses a job that no placement could ever satisfy, rather than queueing it forever.
    fn check_fits(&self, spec: &JobSpec) -> Result<(), CoreError> {
        if self.nodes.is_empty() {
            return Ok(());
        }
        let largest = self
            .nodes
            .values()
            .map(|n| n.gpus.len() as u32)
            .max()
            .unwrap_or(0);
        if spec.gpus > largest {
            return Err(SpecError::new(
                "gpus",
                format!(
                    "{} is more than any node has (the largest has {largest})",
                    spec.gpus
                ),
            )
            .into());
        }
        // Per service, the nodes big enough for one member that may be lent at once while
        // `min_replicas` keep serving.
        let lendable: u32 = self
            .config
            .services
            .iter()
            .map(|policy| {
                let nodes: Vec<&Node> = self
                    .nodes
                    .values()
                    .filter(|n| n.service == policy.name)
                    .collect();
                let fit = nodes
                    .iter()
                    .filter(|n| n.gpus.len() as u32 >= spec.gpus)
                    .count() as u32;
                fit.min((nodes.len() as u32).saturating_sub(policy.min_replicas))
            })
            .sum();
        if spec.nodes > lendable {
            return Err(SpecError::new(
                "nodes",
                format!(
                    "{} nodes with {} GPUs each can never be lent at once (at most {lendable}: \
                     min_replicas keeps the rest serving)",
                    spec.nodes, spec.gpus
                ),
            )
            .into());
        }
        Ok(())
    }

    pub fn cancel(&mut self, now: UnixMillis, id: u64) -> Result<(), CoreError> {
        let job = self.jobs.get(&id).ok_or(CoreError::UnknownJob(id))?;
        if job.state.is_finished() {
            return Err(CoreError::AlreadyFinished {
                job: id,
                state: job.state.as_str(),
            });
        }
        if job.state == JobState::Cancelling {
            return Ok(());
        }
        self.job_event(now, id, JobEvent::Cancel)?;
        self.decide(now);
        Ok(())
    }

    /// Time passes: stop jobs past their run-time limit, expire leases, and make the
    /// decisions whose windows have run out.
    pub fn tick(&mut self, now: UnixMillis) {
        self.decide(now);
    }

    /// Stops every running job that has used up its `maxRunSeconds`, found in the job
    /// index by when each reaches it: a decision that stops none looks at no job.
    fn enforce_run_limits(&mut self, now: UnixMillis) {
        let over: Vec<u64> = self.index.run_limits_reached(now).collect();
        for id in over {
            let _ = self.job_event(now, id, JobEvent::RunLimit);
        }
    }

    /// When `tick` should next be called, at the latest.
    pub fn next_deadline(&self) -> Option<UnixMillis> {
        self.deadlines().min()
    }

    /// [`Core::next_deadline`] less the deadlines that the last decision already met (a
    /// scaling window that ran out before it, for instance, and stays out while nothing
    /// changes): what a shell that decides on its own schedule must still wake for.
    pub fn next_decision_deadline(&self) -> Option<UnixMillis> {
        self.deadlines()
            .filter(|d| self.decided_at.is_none_or(|t| *d > t))
            .min()
    }

    fn deadlines(&self) -> impl Iterator<Item = UnixMillis> + '_ {
        let windows = self.services.iter().filter_map(|(name, s)| {
            let policy = self.config.services.iter().find(|p| &p.name == name)?;
            let low = s.low_since.map(|t| t + policy.scale_down.window_ms);
            let cool = s.last_change.map(|t| t + policy.cooldown_ms);
            low.max(cool)
        });
        let silence = self
            .nodes
            .values()
            .filter_map(|n| n.last_heartbeat.map(|t| t + self.config.lease_ttl_ms));
        // A retried job's backoff; a running job's run-time limit.
        let backoffs = self.index.next_backoffs(self.decided_at);
        let run_limits = self.index.next_run_limits(self.decided_at);
        let gangs = self.gang_waits.values().copied();
        self.leases
            .next_expiry()
            .into_iter()
            .chain(gangs)
            .chain(windows)
            .chain(silence)
            .chain(backoffs)
            .chain(run_limits)
    }

    // ---- decisions ----------------------------------------------------------------------

    pub(crate) fn decide(&mut self, now: UnixMillis) {
        let changes_before = self.changes;
        self.enforce_run_limits(now);
        self.enforce_gang_starts(now);
        self.expire_leases(now);
        self.leases.forget_stragglers_until(now);
        let services: Vec<String> = self.services.keys().cloned().collect();
        for service in &services {
            self.autoscale(now, service);
        }
        let more = self.place_queued(now);
        // Lent nodes still waiting for the rest of the queue are not idle.
        if !more {
            self.return_idle_nodes(now);
        }
        self.settled = self.changes == changes_before;
        self.decided_at = Some(now);
        // Placement stopped at its limit per decision: the next decision places more.
        self.pending = more;
    }

    fn expire_leases(&mut self, now: UnixMillis) {
        for id in self.leases.expired(now) {
            let Some(lease) = self.leases.get(id).cloned() else {
                continue;
            };
            let message = format!(
                "lease {} expired: node {} went silent",
                lease.id, lease.node
            );
            if self
                .jobs
                .get(&lease.job)
                .is_some_and(|j| j.leases.contains(&id))
            {
                self.member_event(
                    now,
                    lease.job,
                    id,
                    JobEvent::MemberLost {
                        lease: id,
                        message,
                        ran: false,
                    },
                );
                self.hold_for_straggler(now, &lease);
            } else {
                self.release(now, id, true);
            }
        }
    }

    /// The container of `lease`, expired because its node went silent, may still run there:
    /// its job starts nowhere else until the bound of [`CoreConfig::restart_elsewhere_after_ms`]
    /// has passed or the node reports the container gone.
    fn hold_for_straggler(&mut self, now: UnixMillis, lease: &Lease) {
        let Some(job) = self.jobs.get_mut(&lease.job) else {
            return;
        };
        let hold = self.config.restart_elsewhere_after_ms.unwrap_or_else(|| {
            u64::from(job.spec.checkpoint.grace_period_seconds) * 1000
                + crate::config::STRAGGLER_MARGIN_MS
        });
        let until = lease.expires_at.saturating_add(hold);
        if until <= now || job.state.is_finished() {
            return;
        }
        if job.not_before < Some(until) {
            job.not_before = Some(until);
        }
        if let Some(message) = &mut job.message {
            message.push_str(
                "; held until its container there has surely stopped (restart_elsewhere_after_s)",
            );
        }
        let released_version = self.nodes.get(&lease.node).map_or(0, |n| n.desired_version);
        self.leases.add_straggler(Straggler {
            lease: lease.id,
            epoch: lease.epoch,
            job: lease.job,
            node: lease.node.clone(),
            until,
            released_version,
        });
        self.effect(Effect::JobChanged(lease.job));
    }

    /// Forgets the stragglers of `node` whose container its report shows gone (no longer
    /// listed, or exited, by an agent that has applied the state without their lease), and
    /// lets their jobs be placed again.
    fn stragglers_reported_gone(&mut self, node: &str) {
        let Some(n) = self.nodes.get(node) else {
            return;
        };
        let gone: Vec<Straggler> = self
            .leases
            .stragglers_on(node)
            .into_iter()
            .filter(|s| {
                n.applied_version >= s.released_version
                    && !n.runs.iter().any(|r| {
                        r.lease_id == s.lease
                            && r.epoch == s.epoch
                            && !matches!(r.state, JobRunState::Exited { .. })
                    })
            })
            .collect();
        for s in gone {
            self.leases.forget_straggler(node, s.lease);
            // Another member's straggler may still hold the job.
            let rest = self
                .leases
                .stragglers()
                .filter(|o| o.job == s.job)
                .map(|o| o.until)
                .max();
            if let Some(job) = self.jobs.get_mut(&s.job)
                && job.not_before == Some(s.until)
                && rest.is_none_or(|r| r < s.until)
            {
                job.not_before = rest;
                self.effect(Effect::JobChanged(s.job));
            }
        }
    }

    // ---- helpers for the decision modules -----------------------------------------------

    /// A report about one member of a job. A report that no longer fits the job (a late
    /// duplicate) changes nothing.
    fn member_event(&mut self, now: UnixMillis, job: u64, lease: u64, event: JobEvent) {
        if self
            .jobs
            .get(&job)
            .is_some_and(|j| j.leases.contains(&lease))
        {
            let _ = self.job_event(now, job, event);
        }
    }

    /// Applies `event` to a job, and keeps the lease table in step with it: leases the job
    /// let go of are released (and accounted), and a job being stopped has all its remaining
    /// leases revoked.
    pub(crate) fn job_event(
        &mut self,
        now: UnixMillis,
        id: u64,
        event: JobEvent,
    ) -> Result<(), CoreError> {
        let job = self.jobs.get_mut(&id).ok_or(CoreError::UnknownJob(id))?;
        let (state, attempt) = (job.state, job.attempt);
        // A lease taken back before its attempt began (no member reported running or
        // exited) preempted nothing: no work was lost.
        let began = job.attempt_began() || event.container_existed();
        let preemption = began
            && !matches!(event, JobEvent::MemberStartFailed { .. })
            && match state {
                JobState::Preempting => true,
                // Stopped for a cancellation or a failure: its revoked members are reported
                // lost, but nothing preempted them (the job counts no preemption either).
                JobState::Cancelling | JobState::Failing => false,
                _ => matches!(event, JobEvent::MemberLost { .. }),
            };
        // The job's leases change only by the member that leaves, or when it is leased
        // (which moves it out of the queue): the state and the lease that left tell.
        let released = job.apply(now, event)?;
        let changed = released.is_some() || (state, attempt) != (job.state, job.attempt);
        // Usually none: a report that a running job still runs changes and allocates nothing.
        let revoked = if job.stopping() {
            job.leases.clone()
        } else {
            Vec::new()
        };
        if let Some(lease) = released {
            self.release(now, lease, preemption);
        }
        for lease in revoked {
            self.revoke(lease);
        }
        if changed {
            self.effect(Effect::JobChanged(id));
        }
        if changed
            && !state.is_finished()
            && self.jobs.get(&id).is_some_and(|j| j.state.is_finished())
        {
            // A finished job resumes nowhere: the node holding its checkpoint is no longer
            // preferred for it.
            for node in self.checkpoints.forget(id) {
                self.effect(Effect::NodeChanged(node));
            }
        }
        Ok(())
    }

    /// `node` reported that the attempt of fencing epoch `epoch` of `job` has a checkpoint:
    /// on its own storage, the node now holds the job's newest checkpoint (unless a newer
    /// attempt's is known); on shared storage, any node can resume the job.
    fn checkpoint_reported(&mut self, node: &str, job: u64, epoch: u64) {
        let single = self
            .jobs
            .get(&job)
            .is_some_and(|j| j.spec.nodes == 1 && !j.state.is_finished());
        let shared = self.nodes.get(node).is_some_and(|n| n.checkpoints_shared);
        let moved = match (single, shared) {
            (true, false) => self.checkpoints.record(job, node, epoch),
            (true, true) => self.checkpoints.forget(job),
            (false, _) => Vec::new(),
        };
        for node in moved {
            self.effect(Effect::NodeChanged(node));
        }
    }

    /// Grants one lease per placement (in rank order) to `job`.
    pub(crate) fn grant(&mut self, now: UnixMillis, job: u64, placements: Vec<(String, Vec<u32>)>) {
        let ttl = self.config.lease_ttl_ms;
        let mut leases = Vec::new();
        for (rank, (node, gpus)) in placements.into_iter().enumerate() {
            let Some(n) = self.nodes.get_mut(&node) else {
                continue;
            };
            n.desired_version += 1;
            n.held.add(gpus.len());
            let version = n.desired_version;
            leases.push(
                self.leases
                    .grant(now, ttl, job, rank as u32, &node, gpus, version)
                    .id,
            );
            self.effect(Effect::NodeChanged(node));
        }
        if self
            .job_event(
                now,
                job,
                JobEvent::Leased {
                    leases: leases.clone(),
                },
            )
            .is_err()
        {
            for lease in leases {
                self.release(now, lease, false);
            }
            return;
        }
        let members = leases
            .iter()
            .filter_map(|id| self.leases.get(*id))
            .map(|l| AttemptMember {
                node: l.node.clone(),
                gpus: l.gpus.clone(),
                epoch: l.epoch,
            })
            .collect();
        if let Some(j) = self.jobs.get_mut(&job) {
            j.place_attempt(members);
            if j.spec.nodes > 1 {
                self.gang_waits
                    .insert(job, now + self.config.gang_start_timeout_ms);
            }
        }
    }

    pub(crate) fn revoke(&mut self, lease: u64) {
        let Some(l) = self.leases.get(lease) else {
            return;
        };
        if l.revoked {
            return;
        }
        let node = l.node.clone();
        self.leases.revoke(lease);
        self.bump(&node);
    }

    fn release(&mut self, now: UnixMillis, lease: u64, preempted: bool) {
        let Some(l) = self.leases.release(lease) else {
            return;
        };
        if let Some(n) = self.nodes.get_mut(&l.node) {
            n.held.remove(l.gpus.len());
        }
        self.bump(&l.node);
        let job = self.jobs.get(&l.job);
        let gpus = l.gpus.len() as u32;
        let lost_gpu_ms = match job {
            Some(j) if preempted => {
                let since = j
                    .last_checkpoint_at
                    .max(j.attempt_started_at)
                    .unwrap_or(l.granted_at);
                now.saturating_sub(since.max(l.granted_at)) * u64::from(gpus)
            }
            _ => 0,
        };
        self.effect(Effect::LeaseEnded(Usage {
            lease_id: l.id,
            job_id: l.job,
            team: job
                .and_then(|j| j.spec.owner.clone())
                .unwrap_or_else(|| "default".to_owned()),
            node: l.node,
            gpus,
            started_at: l.granted_at,
            ended_at: now.max(l.granted_at),
            preempted,
            lost_gpu_ms,
        }));
    }

    pub(crate) fn profile_changed(&mut self, service: &str) {
        self.effects
            .insert(Effect::ProfileChanged(service.to_owned()));
    }

    /// A service's learned load profile, for persisting.
    pub fn profile(&self, service: &str) -> Option<&crate::forecast::Profile> {
        self.services.get(service).map(|s| &s.profile)
    }

    /// Marks the node's desired state as changed.
    pub(crate) fn bump(&mut self, node: &str) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.desired_version += 1;
            self.effect(Effect::NodeChanged(node.to_owned()));
        }
    }

    pub(crate) fn set_mode(&mut self, now: UnixMillis, node: &str, mode: NodeMode) {
        let Some(n) = self.nodes.get_mut(node) else {
            return;
        };
        if n.mode == mode {
            return;
        }
        n.mode = mode;
        n.mode_since = now;
        let service = n.service.clone();
        self.bump(node);
        if let Some(s) = self.services.get_mut(&service) {
            s.last_change = Some(now);
            s.low_since = None;
        }
    }

    // ---- views --------------------------------------------------------------------------

    /// The desired state of `node`: serve, or run these leases.
    pub fn desired(&self, node: &str) -> Option<DesiredNode> {
        let n = self.nodes.get(node)?;
        let leases = self
            .leases
            .on_node(node)
            .filter(|l| !l.revoked)
            .filter_map(|l| {
                let job = self.jobs.get(&l.job)?;
                Some(LeaseGrant {
                    lease_id: l.id,
                    epoch: l.epoch,
                    job_id: l.job,
                    attempt: job.attempt,
                    gpus: l.gpus.clone(),
                    job: job.attempt_spec(),
                    rendezvous: self.rendezvous(job, l),
                })
            })
            .collect();
        Some(DesiredNode {
            version: n.desired_version,
            serve: n.mode == NodeMode::Serve,
            leases,
            lease_ttl_ms: self.config.lease_ttl_ms,
        })
    }

    /// Where the members of a gang meet: the rank-0 node's address.
    fn rendezvous(&self, job: &Job, lease: &Lease) -> Option<Rendezvous> {
        if job.spec.nodes <= 1 {
            return None;
        }
        let master = job
            .leases
            .iter()
            .filter_map(|id| self.leases.get(*id))
            .find(|l| l.rank == 0)
            .and_then(|l| self.nodes.get(&l.node))?;
        Some(Rendezvous {
            master_addr: master.address.clone(),
            master_port: self
                .config
                .rendezvous_port_base
                .saturating_add((job.id % 1000) as u16),
            nnodes: job.spec.nodes,
            node_rank: lease.rank,
            nproc_per_node: job.spec.gpus,
            wait_for_peers: !self.gang_ready(job),
        })
    }

    pub fn job(&self, id: u64) -> Option<JobView> {
        self.jobs.get(&id).map(|j| self.job_view(j))
    }

    /// GPUs that `owner`'s unfinished jobs ask for (a gang's on every node).
    pub fn gpus_asked_by(&self, owner: Option<&str>) -> u32 {
        u32::try_from(self.index.asked_by(owner)).unwrap_or(u32::MAX)
    }

    /// Every job, oldest first.
    pub fn jobs(&self) -> Vec<JobView> {
        self.jobs.values().map(|j| self.job_view(j)).collect()
    }

    fn job_view(&self, j: &Job) -> JobView {
        let mut leases: Vec<LeaseView> = j
            .leases
            .iter()
            .filter_map(|id| self.leases.get(*id))
            .map(|l| LeaseView {
                lease_id: l.id,
                epoch: l.epoch,
                rank: l.rank,
                node: l.node.clone(),
                gpus: l.gpus.clone(),
                granted_at: l.granted_at,
                expires_at: l.expires_at,
                revoked: l.revoked,
            })
            .collect();
        leases.sort_by_key(|l| l.rank);
        JobView {
            id: j.id,
            spec: j.spec.clone(),
            state: j.state,
            attempt: j.attempt,
            preemptions: j.preemptions,
            failures: j.failures,
            not_before: j.not_before,
            last_checkpoint_at: j.last_checkpoint_at,
            submitted_at: j.submitted_at,
            started_at: j.started_at,
            attempt_started_at: j.attempt_started_at,
            ran_ms: j.ran_ms,
            timed_out: j.timed_out,
            finished_at: j.finished_at,
            leases,
            exit_code: j.exit_code,
            outputs: j.outputs.clone(),
            message: j.message.clone(),
            image_digest: j.image_digest.clone(),
            attempts: j.attempts.clone(),
        }
    }

    pub fn node_names(&self) -> impl Iterator<Item = &str> {
        self.nodes.keys().map(String::as_str)
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.get(name)
    }

    pub fn node_snapshot(&self, name: &str) -> Option<NodeSnapshot> {
        self.nodes.get(name).map(|n| NodeSnapshot {
            name: n.name.clone(),
            service: n.service.clone(),
            address: n.address.clone(),
            gpus: n.gpus.clone(),
            mode: n.mode,
            desired_version: n.desired_version,
            mode_since: n.mode_since,
            checkpoints: self.checkpoints.on_node(name),
        })
    }

    pub fn nodes(&self, now: UnixMillis) -> Vec<NodeView> {
        self.nodes
            .values()
            .map(|n| self.node_view(n, now))
            .collect()
    }

    fn node_view(&self, n: &Node, now: UnixMillis) -> NodeView {
        let holder = |index: u32| {
            self.leases
                .on_node(&n.name)
                .find(|l| l.gpus.contains(&index))
                .map(|l| l.job)
        };
        NodeView {
            name: n.name.clone(),
            service: n.service.clone(),
            mode: n.mode,
            desired_version: n.desired_version,
            applied_version: n.applied_version,
            gpus: n
                .gpus
                .iter()
                .map(|g| {
                    let status = n.gpu_status.iter().find(|s| s.index == g.index);
                    NodeGpuView {
                        index: g.index,
                        uuid: g.uuid.clone(),
                        name: g.name.clone(),
                        memory_total_bytes: g.memory_total_bytes,
                        memory_used_bytes: status.map(|s| s.memory_used_bytes),
                        job_id: holder(g.index),
                        healthy: status.map(|s| s.healthy),
                        unhealthy_reason: status.and_then(|s| s.unhealthy_reason.clone()),
                        utilization_gpu_percent: status.and_then(|s| s.utilization_gpu_percent),
                        power_milliwatts: status.and_then(|s| s.power_milliwatts),
                        temperature_celsius: status.and_then(|s| s.temperature_celsius),
                    }
                })
                .collect(),
            replica: n.replica.clone(),
            reachable: n.reachable(now, self.config.lease_ttl_ms),
            last_heartbeat: n.last_heartbeat,
            recent_phases: n.phases.iter().cloned().collect(),
        }
    }

    /// Expired leases of silent nodes whose containers may still run, holding their jobs.
    pub fn stragglers(&self) -> impl Iterator<Item = &Straggler> {
        self.leases.stragglers()
    }

    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
        self.leases.all()
    }

    /// The leases on `node`, found through the table's per-node index.
    pub fn leases_on<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Lease> + 'a {
        self.leases.on_node(node)
    }

    /// Each job's state, submission time and preemptions so far, without building its view
    /// (for counts).
    pub fn job_states(&self) -> impl Iterator<Item = (JobState, UnixMillis, u32)> + '_ {
        self.jobs
            .values()
            .map(|j| (j.state, j.submitted_at, j.preemptions))
    }

    pub fn next_ids(&self) -> (u64, u64, u64) {
        (
            self.next_job_id,
            self.leases.next_id(),
            self.leases.next_epoch(),
        )
    }
}

fn job_from_view(v: JobView) -> Job {
    let mut leases: Vec<&LeaseView> = v.leases.iter().collect();
    leases.sort_by_key(|l| l.rank);
    Job {
        id: v.id,
        leases: leases.iter().map(|l| l.lease_id).collect(),
        spec: v.spec,
        state: v.state,
        attempt: v.attempt,
        preemptions: v.preemptions,
        failures: v.failures,
        not_before: v.not_before,
        submitted_at: v.submitted_at,
        started_at: v.started_at,
        // A view from before run times were kept has no attempt start: a job holding leases
        // then counts from its first start.
        attempt_started_at: v
            .attempt_started_at
            .or_else(|| v.started_at.filter(|_| !v.leases.is_empty())),
        ran_ms: v.ran_ms,
        timed_out: v.timed_out,
        last_checkpoint_at: v.last_checkpoint_at,
        finished_at: v.finished_at,
        exit_code: v.exit_code,
        outputs: v.outputs,
        message: v.message,
        image_digest: v.image_digest,
        attempts: v.attempts,
    }
}
