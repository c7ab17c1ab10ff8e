//! The agent on a modelled host: the real planner's rounds ([`nightshift_planner::pass`],
//! [`nightshift_planner::plan`]) in the executor's order, each step done to the [`Host`].
//!
//! A step that blocks the real executor (stopping containers, vLLM's `/sleep` and
//! `/wake_up`) blocks this agent too, until the host says the call returns; the rest of
//! that plan runs then, as the executor's `await` would. A [`Step::Wait`] is looked at again
//! when the host changes, a new desired state arrives or the wait times out
//! ([`pass::wait_deadline`]); a drain's wait for vLLM's queue, every [`POLL`]. (The agent
//! polls every 200 ms; between these moments its rounds would decide the same.) A round that plans nothing
//! leaves the agent quiet until something it reads changes: the host (a timer of its
//! turns), the desired state, or a deadline of its memory ([`pass::next_deadline`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use nightshift_common::{
    DesiredNode, GpuStatus, Heartbeat, HostFacts, JobRun, JobRunState, PhaseRecord, ReplicaStatus,
    SequenceKind, ServingSignals, UnixMillis,
};
use nightshift_planner::{
    Memory, Moment, Phase, PlanConfig, ReplicaEvent, Step, lifecycle, pass, plan, runs,
};

use crate::host::{Host, RunError, Workload};

/// How soon a waiting sequence looks again: the simulator's one-second step (the agent
/// polls every 200 ms; a step of the model is a second).
pub const POLL: Duration = Duration::from_secs(1);

/// Rounds one pass may take before it counts as making no progress (the executor's bound).
const MAX_ROUNDS: usize = 64;

/// Phases kept for the heartbeat (the agent keeps 32; the coordinator takes each once, and
/// a model's heartbeat follows every few of them: a drain or a reclaim records four).
const PHASES_KEPT: usize = 4;

/// What a call that blocks finishes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    ReplicaStopped,
    Slept,
    Woken,
    JobsStopped { reclaim: bool },
}

/// A blocking call under way, and the rest of its plan.
#[derive(Debug, Clone, PartialEq)]
struct Blocked {
    until: Moment,
    began: Moment,
    done: Done,
    then: Vec<Step>,
}

/// How a plan's steps ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// All run: plan again now.
    Next,
    /// A wait: plan again a poll later.
    Wait,
    /// A call blocks until the host answers.
    Blocked,
    /// A step failed (an illegal replica move, a give-up): the pass ends in an error and
    /// the sequence starts over.
    Failed,
}

/// One agent process on a modelled host.
#[derive(Debug, Clone, PartialEq)]
pub struct Agent {
    pub cfg: PlanConfig,
    pub mem: Memory,
    /// This process among the agent's restarts ([`PhaseRecord::instance`]).
    instance: u64,
    /// The wall-clock time of [`Moment::ZERO`], for the phases' timestamps.
    wall_origin: UnixMillis,
    heard: Option<DesiredNode>,
    /// When the coordinator last acknowledged a heartbeat (sent at that moment).
    last_contact: Option<Moment>,
    /// Quiet until then; `None`: the next tick passes.
    due: Option<Moment>,
    /// The last pass planned nothing: `due` is the memory's next deadline, which moves
    /// with every contact.
    quiet: bool,
    blocked: Option<Blocked>,
    /// The runs published by the latest round (what a heartbeat reports).
    runs: Vec<JobRun>,
    /// The leases the latest round listed, whose runs carry the facts read from the host.
    listed: BTreeSet<u64>,
    phases: VecDeque<PhaseRecord>,
    seq: u64,
    applied_version: u64,
    /// Passes that ended in an error.
    pub errors: u64,
}

impl Agent {
    /// A process starting with an empty memory, as after a restart.
    pub fn new(cfg: PlanConfig, instance: u64, wall_origin: UnixMillis) -> Self {
        Self {
            cfg,
            mem: Memory::default(),
            instance,
            wall_origin,
            heard: None,
            last_contact: None,
            due: None,
            quiet: false,
            blocked: None,
            runs: Vec::new(),
            listed: BTreeSet::new(),
            phases: VecDeque::new(),
            seq: 0,
            applied_version: 0,
            errors: 0,
        }
    }

    /// The desired state the agent last received.
    pub fn desired(&self) -> Option<&DesiredNode> {
        self.heard.as_ref()
    }

    /// The long poll's answer, acted on at the next tick; one older than the desired state
    /// held (a late answer) is dropped, as the agent drops it.
    pub fn receive(&mut self, desired: DesiredNode) {
        if pass::supersedes(&desired, self.heard.as_ref()) {
            self.heard = Some(desired);
            self.wake();
        }
    }

    /// The coordinator acknowledged the heartbeat sent at `at`. Back in touch after a
    /// silence, the fail-safe has something to say; a quiet agent's deadline moves with the
    /// contact (the first one starts the fail-safe's clock).
    pub fn contact(&mut self, at: Moment) {
        self.last_contact = Some(at);
        if self.mem.silence_logged {
            self.wake();
        } else if self.quiet {
            self.due = Some(self.deadline());
        }
    }

    /// Something the agent reads changed: it passes at the next tick.
    fn wake(&mut self) {
        self.due = None;
        self.quiet = false;
    }

    /// When a quiet agent must look again with nothing it observes changed: the next
    /// deadline of its memory ([`pass::next_deadline`]), or never.
    fn deadline(&self) -> Moment {
        pass::next_deadline(&self.cfg, self.heard.as_ref(), self.last_contact, &self.mem)
            .unwrap_or(Moment::from_origin(Duration::MAX))
    }

    /// The earliest moment the agent has anything to do on `host`; `None`: at the next tick.
    pub fn next_tick(&self, host: &Host) -> Option<Moment> {
        let own = match &self.blocked {
            Some(b) => Some(b.until),
            None => self.due,
        }?;
        Some(host.next_event().map_or(own, |h| h.min(own)))
    }

    /// The agent at `now`: the host's timers turn, then a blocked call returns or a pass
    /// runs, if either is due.
    pub fn tick(&mut self, now: Moment, host: &mut Host, workload: &mut dyn Workload) {
        if host.advance(now, workload) {
            self.wake();
        }
        self.read_facts(workload);
        if let Some(b) = self.blocked.take() {
            if now < b.until {
                self.blocked = Some(b);
                return;
            }
            self.finish(b.done, b.began, now);
            let flow = self.execute(b.then, now, host, workload);
            if !self.settle(flow, now) {
                return;
            }
        } else if self.due.is_some_and(|d| now < d) {
            return;
        }
        self.rounds(now, host, workload);
    }

    /// Reads the listed leases' runs' facts afresh (when each job last checkpointed), as the
    /// agent's pass does every second whether or not it has anything to do.
    fn read_facts(&mut self, workload: &dyn Workload) {
        for r in self
            .runs
            .iter_mut()
            .filter(|r| self.listed.contains(&r.lease_id))
        {
            r.last_checkpoint_at = workload.last_checkpoint_at(r.job_id);
        }
    }

    /// Plans and executes until the plan is empty, a wait, a blocking call or an error.
    fn rounds(&mut self, now: Moment, host: &mut Host, workload: &mut dyn Workload) {
        for _ in 0..MAX_ROUNDS {
            let since_contact = self.last_contact.map(|t| now.duration_since(t));
            let begun = pass::begin(&self.cfg, self.heard.as_ref(), since_contact, &mut self.mem);
            let Ok(obs) = host.observe(now, begun.ask_replica) else {
                // The engine does not answer: the pass fails, and what ran is remembered.
                self.mem.engine_lost();
                self.settle(Flow::Failed, now);
                return;
            };
            let leases = pass::observed(begun.desired.as_deref(), &obs, &mut self.mem, now).leases;
            for (image, refused) in host.take_pulled() {
                match refused {
                    Some(reason) => {
                        self.mem
                            .pull_failed(&leases, &obs.containers, &image, &reason);
                    }
                    None => self.mem.images.pulled(&image, &image, None),
                }
            }
            self.runs = runs::runs(&leases, &obs, &self.mem, &BTreeMap::new());
            self.listed = leases.iter().map(|l| l.lease_id).collect();
            let steps = plan(
                &self.cfg,
                begun.desired.as_deref(),
                &leases,
                &obs,
                &self.mem,
                now,
            );
            self.read_facts(workload);
            let last = steps.iter().all(|s| matches!(s, Step::Remove(_)));
            let steps_were_empty = steps.is_empty();
            let flow = if steps_were_empty {
                Flow::Next
            } else {
                self.execute(steps, now, host, workload)
            };
            if last && flow == Flow::Next {
                // The pass is over. One that planned nothing is quiet until something it
                // reads changes; one that removed containers passes again a poll later, as
                // the agent's next pass would.
                self.applied_version = self.heard.as_ref().map_or(0, |d| d.version);
                self.quiet = steps_were_empty;
                self.due = Some(if steps_were_empty {
                    self.deadline()
                } else {
                    now + POLL
                });
                return;
            }
            if !self.settle(flow, now) {
                return;
            }
        }
        self.errors += 1;
        self.due = Some(now + POLL);
    }

    /// After a plan's steps: true when the pass plans again at once.
    fn settle(&mut self, flow: Flow, now: Moment) -> bool {
        self.quiet = false;
        match flow {
            Flow::Next => true,
            Flow::Wait => {
                // A wait changes its mind when what it observes changes (a host timer, a new
                // desired state: both wake the agent) or when it times out. vLLM's queue
                // empties on its own clock, so a drain asks it every poll.
                let timeout = pass::wait_deadline(&self.cfg, &self.mem);
                self.due = Some(match (self.mem.phase, timeout) {
                    (Some((Phase::WaitInFlight, _)), _) | (_, None) => now + POLL,
                    (_, Some(t)) => t.max(now + POLL),
                });
                false
            }
            Flow::Blocked => false,
            Flow::Failed => {
                self.mem.phase = None;
                self.errors += 1;
                self.due = Some(now + POLL);
                false
            }
        }
    }

    /// Runs `steps` in order against the host.
    fn execute(
        &mut self,
        steps: Vec<Step>,
        now: Moment,
        host: &mut Host,
        workload: &mut dyn Workload,
    ) -> Flow {
        let mut steps = steps.into_iter();
        while let Some(step) = steps.next() {
            match step {
                Step::Replica(event) => {
                    if !self.replica_event(event) {
                        return Flow::Failed;
                    }
                }
                Step::Enter(phase) => self.mem.phase = phase.map(|p| (p, now)),
                Step::Record {
                    sequence,
                    phase,
                    began,
                } => self.record(sequence, phase, began, now),
                Step::StopJobs { jobs, reclaim } => {
                    self.mem.stopping(&jobs);
                    let leases: BTreeSet<u64> = jobs.iter().filter_map(|j| j.lease_id).collect();
                    for r in self
                        .runs
                        .iter_mut()
                        .filter(|r| leases.contains(&r.lease_id))
                    {
                        r.state = JobRunState::Stopping;
                    }
                    let until = jobs
                        .iter()
                        .map(|j| host.stop(&j.id, j.grace, now, workload))
                        .max()
                        .unwrap_or(now);
                    return self.block(until, now, Done::JobsStopped { reclaim }, steps);
                }
                Step::StopReplica { id, grace } => {
                    let until = host.stop(&id, grace, now, workload);
                    return self.block(until, now, Done::ReplicaStopped, steps);
                }
                // The planner sleeps a drained replica: its requests are done, and the call
                // answers within any timeout.
                Step::SleepReplica { .. } => match host.sleep(now, Duration::MAX) {
                    Ok(until) => return self.block(until, now, Done::Slept, steps),
                    Err(_) => {
                        self.mem.sleep_failed(now);
                        return Flow::Next;
                    }
                },
                Step::WakeReplica { .. } => match host.wake(now) {
                    Ok(until) => return self.block(until, now, Done::Woken, steps),
                    Err(_) => return Flow::Failed,
                },
                Step::StartReplica => {
                    if host.start_replica(now).is_err() {
                        self.replica_event(ReplicaEvent::Failed);
                        self.mem.phase = None;
                        return Flow::Failed;
                    }
                    if !self.replica_event(ReplicaEvent::Started) {
                        return Flow::Failed;
                    }
                    self.record(SequenceKind::Reclaim, "start_replica", now, now);
                }
                Step::StartJobs(leases) => {
                    for lease in &leases {
                        self.mem.fence(lease);
                        match host.start_job(lease, now, workload) {
                            Ok(_) => {
                                if let Some(r) = self.mem.restored.get_mut(&lease.lease_id) {
                                    r.started = true;
                                }
                            }
                            // The lease's own fault: its attempt fails and the others go on.
                            Err(e @ (RunError::Missing | RunError::Refused(_))) => {
                                let why = match e {
                                    RunError::Refused(why) => why,
                                    _ => format!("image {} is not on the host", lease.job.image),
                                };
                                self.mem.failed_to_start(lease, why, false);
                            }
                            Err(RunError::EngineDown) => {
                                self.mem.engine_lost();
                                return Flow::Failed;
                            }
                        }
                    }
                    self.record(SequenceKind::Drain, "start_jobs", now, now);
                }
                // The pull runs in the engine while the pass goes on waiting, as the
                // executor's background pull; what it ends in is taken in by a later round.
                Step::Pull { image, .. } => {
                    host.start_pull(&image, now);
                    return Flow::Wait;
                }
                // The model's hosts keep checkpoints on their own disk: nothing is restored.
                Step::Restore(_) => return Flow::Wait,
                Step::FailStart {
                    lease,
                    message,
                    refused_by_host,
                } => self.mem.failed_to_start(&lease, message, refused_by_host),
                Step::Remove(c) => {
                    host.remove(&c.id);
                    self.mem.removed(&c);
                }
                Step::Note(_) => {}
                Step::GiveUp(_) => return Flow::Failed,
                Step::Wait => return Flow::Wait,
            }
        }
        Flow::Next
    }

    fn block(
        &mut self,
        until: Moment,
        began: Moment,
        done: Done,
        rest: impl Iterator<Item = Step>,
    ) -> Flow {
        self.blocked = Some(Blocked {
            until,
            began,
            done,
            then: rest.collect(),
        });
        Flow::Blocked
    }

    /// A blocking call returned at `now`.
    fn finish(&mut self, done: Done, began: Moment, now: Moment) {
        match done {
            Done::ReplicaStopped => {
                self.replica_event(ReplicaEvent::Stopped);
                self.record(SequenceKind::Drain, "stop_replica", began, now);
            }
            Done::Slept => self.record(SequenceKind::Drain, "sleep_replica", began, now),
            Done::Woken => {}
            Done::JobsStopped { reclaim } => {
                if reclaim {
                    self.record(SequenceKind::Reclaim, "stop_jobs", began, now);
                }
            }
        }
    }

    /// Moves the replica's state; false on an illegal move (the executor's error).
    fn replica_event(&mut self, event: ReplicaEvent) -> bool {
        match lifecycle::apply(self.mem.replica, event) {
            Ok(to) => {
                self.mem.replica = to;
                true
            }
            Err(_) => false,
        }
    }

    fn record(&mut self, sequence: SequenceKind, phase: &str, began: Moment, now: Moment) {
        self.seq += 1;
        self.phases.push_back(PhaseRecord {
            seq: self.seq,
            instance: Some(self.instance),
            sequence,
            phase: phase.to_owned(),
            started_at: self.wall(began),
            duration_ms: now.duration_since(began).as_millis() as u64,
        });
        if self.phases.len() > PHASES_KEPT {
            self.phases.pop_front();
        }
    }

    fn wall(&self, at: Moment) -> UnixMillis {
        self.wall_origin + at.since_origin().as_millis() as u64
    }

    /// Whether the load balancer sends the replica requests.
    pub fn ready(&self) -> bool {
        lifecycle::ready(self.mem.replica)
    }

    /// The heartbeat the agent would send now: the host's GPUs, the replica (with `signals`
    /// while it is ready), the runs the latest round published, the recorded phases and the
    /// leases the fail-safe voided.
    pub fn heartbeat(&self, host: &Host, signals: &ServingSignals) -> Heartbeat {
        Heartbeat {
            gpus: host
                .gpu_indices()
                .into_iter()
                .map(|g| match host.unhealthy.get(&g) {
                    Some(why) => GpuStatus::unhealthy(g, host.gpu_used(g), why.as_str()),
                    None => GpuStatus::healthy(g, host.gpu_used(g)),
                })
                .collect(),
            replica: ReplicaStatus {
                state: self.mem.replica,
                signals: if self.ready() {
                    signals.clone()
                } else {
                    ServingSignals::default()
                },
                url: None,
            },
            jobs: self.runs.clone(),
            applied_version: self.applied_version,
            phases: self.phases.iter().cloned().collect(),
            expired_leases: self.mem.void.keys().copied().collect(),
            // A host that keeps checkpoints on its own disk says nothing of it.
            host: (!host.storage.is_local()).then(|| HostFacts {
                checkpoint_storage: host.storage,
                ..HostFacts::default()
            }),
            agent_url: None,
            metrics_url: None,
        }
    }
}
