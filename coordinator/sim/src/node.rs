//! A simulated GPU host: its agent, its vLLM replica and its job containers, each a timed
//! state machine that follows the desired state the way the real agent orders things (drain
//! before jobs, jobs stopped before serving, fencing epochs honoured per GPU, service first
//! when the coordinator is unreachable past the lease TTL).

use std::collections::BTreeMap;

use nightshift_common::{
    DesiredNode, GpuInfo, GpuStatus, Heartbeat, JobRun, JobRunState, LeaseGrant, PhaseRecord,
    ReplicaState, ReplicaStatus, SequenceKind, ServingSignals, UnixMillis,
};

use crate::backlog::SimJob;
use crate::ledger::Ledger;
use crate::model::{Lifecycle, Release};

/// The replica's phase; `until` is when a timed phase ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Serving,
    Draining { until: UnixMillis },
    Releasing { until: UnixMillis },
    Released,
    Starting { until: UnixMillis },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Leased, waiting for the GPUs to be free.
    Pending,
    Running {
        started_at: UnixMillis,
    },
    /// Signalled at `signalled_at`; exits at `until`.
    Stopping {
        started_at: UnixMillis,
        signalled_at: UnixMillis,
        until: UnixMillis,
    },
    Exited {
        exit_code: i64,
        by_agent: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub lease_id: u64,
    pub epoch: u64,
    pub job_id: u64,
    pub attempt: u32,
    pub gpus: Vec<u32>,
    pub state: RunState,
    /// The exit has been reported in a heartbeat.
    pub reported: bool,
}

impl Run {
    fn live(&self) -> bool {
        !matches!(self.state, RunState::Pending | RunState::Exited { .. })
    }
}

/// Why the agent cannot talk to the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// The agent process is down until then: nothing is reconciled, containers run on.
    Crashed { until: UnixMillis },
    /// The agent runs but cannot reach the coordinator until then.
    Partitioned { until: UnixMillis },
}

#[derive(Debug, Clone)]
pub struct SimNode {
    pub name: String,
    pub gpus: u32,
    pub phase: Phase,
    pub runs: Vec<Run>,
    /// The last desired state received, and when a heartbeat was last answered.
    pub desired: Option<DesiredNode>,
    pub last_renewed: UnixMillis,
    pub outage: Option<Outage>,
    /// Highest lease epoch honoured per GPU.
    pub fenced: BTreeMap<u32, u64>,
    /// What the fleet last measured on this replica (per ready replica).
    pub signals: ServingSignals,
    /// Stepping the host changes nothing before then, unless something it reads changes
    /// first, which [`SimNode::poke`]s it: `None` when its next step must run.
    quiet_until: Option<UnixMillis>,
    /// The last step ran (it was not quiet).
    pub stepped: bool,
    /// The last one-owner check of this host found nothing wrong.
    pub owners_ok: bool,
    /// The reclaim under way: when the agent saw it, and when its replica began to start
    /// (or wake).
    reclaim_began: Option<UnixMillis>,
    start_began: Option<UnixMillis>,
    /// The phases of the latest reclaims, resent in every heartbeat as the real agent does
    /// (the coordinator keeps each once, by `seq`), from which it measures the reclaim lead.
    phases: Vec<PhaseRecord>,
}

/// Reclaim phases a heartbeat resends.
const PHASES_SENT: usize = 4;

/// The world a node acts in during one step.
pub struct StepCtx<'a> {
    pub now: UnixMillis,
    pub lifecycle: &'a Lifecycle,
    /// Mean time in-flight requests need to finish, ms.
    pub drain_ms: u64,
    pub jobs: &'a mut BTreeMap<u64, SimJob>,
    pub ledger: &'a mut Ledger,
}

impl SimNode {
    pub fn new(name: &str, gpus: u32, now: UnixMillis) -> Self {
        Self {
            name: name.to_owned(),
            gpus,
            phase: Phase::Serving,
            runs: Vec::new(),
            desired: None,
            last_renewed: now,
            outage: None,
            fenced: BTreeMap::new(),
            signals: ServingSignals::default(),
            quiet_until: None,
            stepped: false,
            owners_ok: false,
            reclaim_began: None,
            start_began: None,
            phases: Vec::new(),
        }
    }

    /// Something the host's step reads from outside changed (its desired state, a
    /// heartbeat's answer, an outage, a job's progress elsewhere): its next step runs.
    pub fn poke(&mut self) {
        self.quiet_until = None;
    }

    pub fn inventory(&self) -> Vec<GpuInfo> {
        (0..self.gpus)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{}-{i}", self.name),
                name: "sim-h100".into(),
                memory_total_bytes: 80 << 30,
            })
            .collect()
    }

    pub fn ready(&self) -> bool {
        self.phase == Phase::Serving
    }

    /// The replica serves or is starting to (the serving floor counts these).
    pub fn up(&self) -> bool {
        matches!(self.phase, Phase::Serving | Phase::Starting { .. })
    }

    /// A job runs (or is saving on its signal) on the host's GPUs: the host is lent.
    pub fn lent(&self) -> bool {
        self.runs.iter().any(Run::live)
    }

    /// The replica holds its GPUs in every phase but `Released`.
    pub fn replica_holds_gpus(&self) -> bool {
        self.phase != Phase::Released
    }

    pub fn reachable(&self) -> bool {
        self.outage.is_none()
    }

    pub fn crashed(&self) -> bool {
        matches!(self.outage, Some(Outage::Crashed { .. }))
    }

    /// Ends outages whose time is up; true when the agent came back from a crash (and must
    /// register again).
    pub fn heal(&mut self, now: UnixMillis) -> bool {
        match self.outage {
            Some(Outage::Crashed { until }) if now >= until => {
                self.fail(None);
                true
            }
            Some(Outage::Partitioned { until }) if now >= until => {
                self.fail(None);
                false
            }
            _ => false,
        }
    }

    /// The agent crashes or is cut off (or, with `None`, is back).
    pub fn fail(&mut self, outage: Option<Outage>) {
        self.outage = outage;
        self.poke();
    }

    /// The long-poll's answer: a newer desired state.
    pub fn receive(&mut self, desired: Option<DesiredNode>) {
        self.desired = desired;
        self.poke();
    }

    /// One second of the host: containers progress, then the agent reconciles (unless down).
    /// Returns whether a job's progress was settled (which other hosts' runs of the same job
    /// read).
    ///
    /// A step that changes nothing is a fixed point: until a time it compares against comes
    /// (a phase's or a container's end, a finished job's exit, the lease TTL) or something
    /// it reads changes (a poke), the next steps would change nothing either, so they are
    /// skipped. The output is the same as stepping every second, only cheaper.
    pub fn step(&mut self, ctx: &mut StepCtx<'_>) -> bool {
        self.stepped = self.quiet_until.is_none_or(|t| ctx.now >= t);
        if !self.stepped {
            return false;
        }
        let (phase, runs) = (self.phase, self.runs.len());
        let mut changed = self.progress_jobs(ctx);
        let settled = changed;
        if !self.crashed() {
            // Reconciling reads the desired state while it changes the runs: lend it out.
            let desired = self.desired.take();
            changed |= self.reconcile(ctx, desired.as_ref());
            self.desired = desired;
        }
        changed |= self.phase != phase || self.runs.len() != runs;
        self.quiet_until = (!changed).then(|| self.next_due(ctx));
        settled
    }

    /// The first time a comparison of this host's step against the clock can turn.
    fn next_due(&self, ctx: &StepCtx<'_>) -> UnixMillis {
        let phase = match self.phase {
            Phase::Draining { until } | Phase::Releasing { until } | Phase::Starting { until } => {
                until
            }
            Phase::Serving | Phase::Released => UnixMillis::MAX,
        };
        let runs = self.runs.iter().map(|r| match r.state {
            RunState::Running { started_at } => {
                ctx.jobs.get(&r.job_id).map_or(UnixMillis::MAX, |job| {
                    started_at + job.startup_ms + job.remaining_ms()
                })
            }
            RunState::Stopping { until, .. } => until,
            RunState::Pending | RunState::Exited { .. } => UnixMillis::MAX,
        });
        let ttl = self
            .desired
            .as_ref()
            .map_or(UnixMillis::MAX, |d| self.last_renewed + d.lease_ttl_ms);
        runs.fold(phase.min(ttl), UnixMillis::min)
    }

    /// Returns whether it changed a run's state or added one (the phase and the number of
    /// runs the caller compares itself).
    fn reconcile(&mut self, ctx: &StepCtx<'_>, desired: Option<&DesiredNode>) -> bool {
        let now = ctx.now;
        let mut changed = false;
        let ttl_ok = desired.is_some_and(|d| now < self.last_renewed + d.lease_ttl_ms);
        // Service first: past the lease TTL without the coordinator, serve with no jobs.
        let (serve, grants): (bool, &[LeaseGrant]) = match desired {
            Some(d) if ttl_ok || self.reachable() => (d.serve, &d.leases),
            _ => (true, &[]),
        };
        // The grants the agent honours: none under an epoch older than its GPUs have seen.
        // (Read before this step fences anything: the runs it starts come from these.)
        let fenced = &self.fenced;
        let honoured = |l: &&LeaseGrant| {
            l.gpus
                .iter()
                .all(|g| fenced.get(g).is_none_or(|&e| l.epoch >= e))
        };
        let leases = || grants.iter().filter(honoured);
        let leased = |id: u64| leases().any(|l| l.lease_id == id);

        // Forget reported exits and never-started runs whose lease is gone.
        let runs = self.runs.len();
        self.runs.retain(|r| {
            leased(r.lease_id)
                || match r.state {
                    RunState::Pending => false,
                    RunState::Exited { .. } => !r.reported,
                    _ => true,
                }
        });
        changed |= self.runs.len() != runs;
        // Signal the jobs that lost their lease.
        for r in &mut self.runs {
            if let RunState::Running { started_at } = r.state
                && !leased(r.lease_id)
            {
                let save = ctx.lifecycle.checkpoint_save_s * 1_000;
                r.state = RunState::Stopping {
                    started_at,
                    signalled_at: now,
                    until: now + save.max(1_000),
                };
                changed = true;
            }
        }
        let jobs_live = self.runs.iter().any(Run::live);

        if serve && leases().next().is_none() {
            let before = self.phase;
            self.phase = match self.phase {
                Phase::Serving | Phase::Draining { .. } => Phase::Serving,
                Phase::Releasing { until } if now >= until => Phase::Released,
                p @ Phase::Releasing { .. } => p,
                Phase::Released if jobs_live => Phase::Released,
                Phase::Released => Phase::Starting {
                    until: now + ctx.lifecycle.start_s() * 1_000,
                },
                Phase::Starting { until } if now >= until => Phase::Serving,
                p @ Phase::Starting { .. } => p,
            };
            self.note_reclaim(ctx, before);
            return changed;
        }
        self.reclaim_began = None;
        self.start_began = None;
        self.phase = match self.phase {
            Phase::Serving => Phase::Draining {
                until: now + ctx.drain_ms.min(ctx.lifecycle.drain_timeout_s * 1_000),
            },
            Phase::Draining { until } | Phase::Starting { until } if now < until => self.phase,
            Phase::Draining { .. } | Phase::Starting { .. } => Phase::Releasing {
                until: now + ctx.lifecycle.release_s() * 1_000,
            },
            Phase::Releasing { until } if now >= until => Phase::Released,
            p => p,
        };
        // A starting replica being lent again is stopped at once, not left to finish.
        if let Phase::Starting { .. } = self.phase {
            self.phase = Phase::Releasing {
                until: now + ctx.lifecycle.stop_s * 1_000,
            };
        }
        for l in leases() {
            if !self.runs.iter().any(|r| r.lease_id == l.lease_id) {
                self.runs.push(Run {
                    lease_id: l.lease_id,
                    epoch: l.epoch,
                    job_id: l.job_id,
                    attempt: l.attempt,
                    gpus: l.gpus.clone(),
                    state: RunState::Pending,
                    reported: false,
                });
                changed = true;
            }
        }
        if self.phase != Phase::Released {
            return changed;
        }
        // A host has a handful of GPUs: a short list, not a set.
        let mut busy = self.busy_gpus();
        // A gang member waits until the coordinator says that every member is ready.
        let held: Vec<u64> = leases()
            .filter(|l| l.rendezvous.as_ref().is_some_and(|r| r.wait_for_peers))
            .map(|l| l.lease_id)
            .collect();
        for r in &mut self.runs {
            if r.state == RunState::Pending
                && !held.contains(&r.lease_id)
                && r.gpus.iter().all(|g| !busy.contains(g))
            {
                busy.extend(r.gpus.iter().copied());
                for g in &r.gpus {
                    self.fenced.insert(*g, r.epoch);
                }
                r.state = RunState::Running { started_at: now };
                changed = true;
            }
        }
        changed
    }

    /// Whether a live job container holds GPU `gpu`.
    fn job_holds(&self, gpu: u32) -> bool {
        self.runs.iter().any(|r| r.live() && r.gpus.contains(&gpu))
    }

    /// GPUs that live job containers hold.
    fn busy_gpus(&self) -> Vec<u32> {
        self.runs
            .iter()
            .filter(|r| r.live())
            .flat_map(|r| r.gpus.iter().copied())
            .collect()
    }

    /// Jobs finish their work; signalled jobs exit when their checkpoint is saved. Returns
    /// whether any did.
    fn progress_jobs(&mut self, ctx: &mut StepCtx<'_>) -> bool {
        let now = ctx.now;
        let mut exited = false;
        for r in &mut self.runs {
            let Some(job) = ctx.jobs.get_mut(&r.job_id) else {
                continue;
            };
            match r.state {
                RunState::Running { started_at }
                    if now >= started_at + job.startup_ms + job.remaining_ms() =>
                {
                    ctx.ledger.finish(job, &r.gpus, started_at, now);
                    r.state = RunState::Exited {
                        exit_code: 0,
                        by_agent: false,
                    };
                    r.reported = false;
                    exited = true;
                }
                RunState::Stopping {
                    started_at,
                    signalled_at,
                    until,
                } if now >= until => {
                    ctx.ledger
                        .preempt(job, &r.gpus, started_at, signalled_at, now);
                    r.state = RunState::Exited {
                        exit_code: 143,
                        by_agent: true,
                    };
                    r.reported = false;
                    exited = true;
                }
                _ => {}
            }
        }
        exited
    }

    /// Times the reclaim under way as the real agent records it: the jobs' stop (their
    /// checkpoint save and the GPUs' release) as `stop_jobs`, then the replica's start or
    /// wake up to ready.
    fn note_reclaim(&mut self, ctx: &StepCtx<'_>, before: Phase) {
        let now = ctx.now;
        if self.phase == Phase::Serving {
            if let (Phase::Starting { .. }, Some(began), Some(start)) =
                (before, self.reclaim_began, self.start_began)
            {
                let replica = match ctx.lifecycle.release {
                    Release::Stop => "start_replica",
                    Release::Sleep => "wake_replica",
                };
                for (phase, from, to) in [("stop_jobs", began, start), (replica, start, now)] {
                    let seq = self.phases.last().map_or(1, |p| p.seq + 1);
                    self.phases.push(PhaseRecord {
                        seq,
                        instance: None,
                        sequence: SequenceKind::Reclaim,
                        phase: phase.to_owned(),
                        started_at: from,
                        duration_ms: to - from,
                    });
                }
                let excess = self.phases.len().saturating_sub(PHASES_SENT);
                self.phases.drain(..excess);
            }
            self.reclaim_began = None;
            self.start_began = None;
            return;
        }
        self.reclaim_began.get_or_insert(now);
        if matches!(self.phase, Phase::Starting { .. }) && before == Phase::Released {
            self.start_began = Some(now);
        }
    }

    /// What the agent reports; marks exits as reported (its next step forgets them).
    pub fn heartbeat(&mut self) -> Heartbeat {
        self.poke();
        let replica_busy = self.replica_holds_gpus();
        let gpus = (0..self.gpus)
            .map(|i| {
                let busy = replica_busy || self.job_holds(i);
                GpuStatus::healthy(i, if busy { 70 << 30 } else { 0 })
            })
            .collect();
        let state = match self.phase {
            Phase::Serving => ReplicaState::Serving,
            Phase::Draining { .. } | Phase::Releasing { .. } => ReplicaState::Draining,
            Phase::Released => ReplicaState::Stopped,
            Phase::Starting { .. } => ReplicaState::Starting,
        };
        let signals = if self.ready() {
            self.signals.clone()
        } else {
            ServingSignals::default()
        };
        let jobs = self
            .runs
            .iter_mut()
            .map(|r| {
                r.reported = true;
                JobRun {
                    job_id: r.job_id,
                    attempt: r.attempt,
                    lease_id: r.lease_id,
                    epoch: r.epoch,
                    gpus: r.gpus.clone(),
                    state: match r.state {
                        RunState::Pending => JobRunState::Pending,
                        RunState::Running { .. } => JobRunState::Running,
                        RunState::Stopping { .. } => JobRunState::Stopping,
                        RunState::Exited {
                            exit_code,
                            by_agent,
                        } => JobRunState::Exited {
                            exit_code,
                            stopped_by_agent: by_agent,
                        },
                    },
                    last_checkpoint_at: None,
                    outputs: BTreeMap::new(),
                    image_id: None,
                    image_digest: None,
                    // The simulated hosts hold every image: a pending member is ready.
                    ready: r.state == RunState::Pending,
                }
            })
            .collect();
        Heartbeat {
            gpus,
            replica: ReplicaStatus {
                state,
                signals,
                url: None,
            },
            jobs,
            applied_version: self.desired.as_ref().map_or(0, |d| d.version),
            phases: self.phases.clone(),
            expired_leases: Vec::new(),
            host: None,
            agent_url: None,
            metrics_url: None,
        }
    }

    /// One owner per GPU on the host itself: no job runs while the replica holds the GPUs,
    /// and no two live jobs share one.
    pub fn check_owners(&self) -> Result<(), String> {
        // A host has a handful of GPUs: each live job's GPUs are checked against the ones
        // before it, with nothing to allocate.
        let live = || self.runs.iter().filter(|r| r.live());
        for (k, r) in live().enumerate() {
            if self.replica_holds_gpus() {
                return Err(format!(
                    "node {}: job {} runs while the replica holds the gpus ({:?})",
                    self.name, r.job_id, self.phase
                ));
            }
            for (j, g) in r.gpus.iter().enumerate() {
                let earlier = live()
                    .take(k)
                    .find(|o| o.gpus.contains(g))
                    .or_else(|| r.gpus[..j].contains(g).then_some(r));
                if let Some(other) = earlier {
                    return Err(format!(
                        "node {} gpu {g}: leases {} and {}",
                        self.name, other.lease_id, r.lease_id
                    ));
                }
                if self.fenced.get(g).is_some_and(|&e| r.epoch < e) {
                    return Err(format!(
                        "node {} gpu {g}: lease {} runs under stale epoch {}",
                        self.name, r.lease_id, r.epoch
                    ));
                }
            }
        }
        Ok(())
    }

    /// Jobs still running when the simulation ends are counted as if checkpointed now.
    pub fn finish_accounting(
        &mut self,
        now: UnixMillis,
        jobs: &BTreeMap<u64, SimJob>,
        ledger: &mut Ledger,
    ) {
        for r in &self.runs {
            let started = match r.state {
                RunState::Running { started_at } | RunState::Stopping { started_at, .. } => {
                    started_at
                }
                _ => continue,
            };
            if let Some(job) = jobs.get(&r.job_id) {
                ledger.truncate(job, &r.gpus, started, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(lease_id: u64, epoch: u64, gpus: &[u32], state: RunState) -> Run {
        Run {
            lease_id,
            epoch,
            job_id: lease_id,
            attempt: 1,
            gpus: gpus.to_vec(),
            state,
            reported: false,
        }
    }

    const RUNNING: RunState = RunState::Running { started_at: 0 };

    fn host(phase: Phase, runs: Vec<Run>) -> SimNode {
        let mut n = SimNode::new("node-000", 4, 0);
        n.phase = phase;
        n.runs = runs;
        n
    }

    #[test]
    fn one_owner_per_gpu_holds_for_disjoint_jobs() {
        let n = host(
            Phase::Released,
            vec![run(1, 1, &[0, 1], RUNNING), run(2, 2, &[2], RUNNING)],
        );
        assert_eq!(n.check_owners(), Ok(()));
    }

    #[test]
    fn a_shared_gpu_names_both_leases() {
        let exited = RunState::Exited {
            exit_code: 0,
            by_agent: false,
        };
        // An exited container owns nothing; the two live ones share GPU 1.
        let n = host(
            Phase::Released,
            vec![
                run(7, 1, &[1], exited),
                run(1, 2, &[0, 1], RUNNING),
                run(2, 3, &[2, 1], RUNNING),
            ],
        );
        assert_eq!(
            n.check_owners(),
            Err("node node-000 gpu 1: leases 1 and 2".to_owned())
        );
        let twice = host(Phase::Released, vec![run(3, 1, &[2, 2], RUNNING)]);
        assert_eq!(
            twice.check_owners(),
            Err("node node-000 gpu 2: leases 3 and 3".to_owned())
        );
    }

    #[test]
    fn a_job_under_the_replica_or_a_stale_epoch_is_reported() {
        let serving = host(Phase::Serving, vec![run(1, 1, &[0], RUNNING)]);
        assert!(
            serving
                .check_owners()
                .unwrap_err()
                .contains("replica holds")
        );
        let mut fenced = host(Phase::Released, vec![run(1, 4, &[0], RUNNING)]);
        fenced.fenced.insert(0, 5);
        assert!(fenced.check_owners().unwrap_err().contains("stale epoch 4"));
    }
}
