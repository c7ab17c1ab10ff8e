//! A simulated GPU host: the host model of `nightshift-hostmodel` (engine, GPUs, vLLM replica,
//! job containers) with the agent's real planner deciding on it, plus what the world does to
//! it (crashes, partitions) and the books its jobs' exits write.
//!
//! The agent here is the code that ships: every drain, reclaim, fence and fail-safe decision
//! is `nightshift-planner`'s, run in the executor's order (`nightshift_hostmodel::Agent`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_common::{Heartbeat, ServingSignals, UnixMillis};
use nightshift_hostmodel::{Agent, Exit, Host, Idle, Proc, Pull, Timings, Workload};
use nightshift_planner::{Moment, PlanConfig, ReclaimMode};

use crate::backlog::{JOB_IMAGE, SimJob};
use crate::ledger::Ledger;
use crate::model::{Lifecycle, Release};

/// Why the agent cannot talk to the coordinator. Overlapping outages of a host merge into
/// the wider one, until the later end; a crashed agent stays down until it restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// The agent process is down until then: nothing is reconciled, containers run on.
    Crashed { until: UnixMillis },
    /// The agent runs but cannot reach the coordinator until then.
    Partitioned { until: UnixMillis },
    /// Its heartbeats are lost until then; its desired state arrives.
    Deaf { until: UnixMillis },
    /// Its desired state does not arrive until then; its heartbeats get through.
    Muted { until: UnixMillis },
}

impl Outage {
    fn until(self) -> UnixMillis {
        match self {
            Self::Crashed { until }
            | Self::Partitioned { until }
            | Self::Deaf { until }
            | Self::Muted { until } => until,
        }
    }

    /// This outage and `other` at once.
    fn merge(self, other: Self) -> Self {
        let until = self.until().max(other.until());
        match (self, other) {
            (Self::Crashed { .. }, Self::Crashed { .. }) => Self::Crashed { until },
            (c @ Self::Crashed { .. }, _) => c,
            (_, c @ Self::Crashed { .. }) => c,
            (Self::Deaf { .. }, Self::Deaf { .. }) => Self::Deaf { until },
            (Self::Muted { .. }, Self::Muted { .. }) => Self::Muted { until },
            _ => Self::Partitioned { until },
        }
    }
}

/// The moment of `at` on the hosts' clock, which starts at the simulation's `origin`.
pub fn moment(origin: UnixMillis, at: UnixMillis) -> Moment {
    Moment::from_origin(Duration::from_millis(at.saturating_sub(origin)))
}

fn unix(origin: UnixMillis, at: Moment) -> UnixMillis {
    origin + at.since_origin().as_millis() as u64
}

/// The agent's configuration on a simulated host: the shipped defaults (`agent.toml`), with
/// the lend mode and drain timeout of the simulation's lifecycle.
pub fn plan_config(lifecycle: &Lifecycle) -> PlanConfig {
    PlanConfig {
        drain_timeout: Duration::from_secs(lifecycle.drain_timeout_s),
        reclaim: match lifecycle.release {
            Release::Stop => ReclaimMode::Stop,
            Release::Sleep => ReclaimMode::Sleep,
        },
        ..PlanConfig::default()
    }
}

/// The host's transition times from the simulation's lifecycle.
pub fn timings(lifecycle: &Lifecycle) -> Timings {
    Timings {
        replica_start: Duration::from_secs(lifecycle.cold_start_s),
        replica_stop: Duration::from_secs(lifecycle.stop_s),
        sleep: Duration::from_secs(lifecycle.sleep_s),
        wake: Duration::from_secs(lifecycle.wake_s),
        ..Timings::default()
    }
}

/// The jobs' side of the hosts: how long each has left, how long its checkpoint takes, and
/// the ledger its exits are written into.
pub struct Books<'a> {
    pub origin: UnixMillis,
    pub jobs: &'a mut BTreeMap<u64, SimJob>,
    pub ledger: &'a mut Ledger,
    /// Time a job needs to save its checkpoint when signalled.
    pub save: Duration,
    /// Jobs that ignore their checkpoint signal (killed when their grace runs out).
    pub stubborn: &'a BTreeSet<u64>,
    /// A job's exit changed its progress (which other runs of the job read).
    pub settled: bool,
}

impl Workload for Books<'_> {
    fn ends_at(&self, p: Proc<'_>, started: Moment) -> Option<Moment> {
        let j = self.jobs.get(&p.job)?;
        Some(started + Duration::from_millis(j.startup_ms + j.remaining_ms()))
    }

    fn save(&self, p: Proc<'_>) -> Duration {
        if self.stubborn.contains(&p.job) {
            // It ignores its signal: killed when its grace runs out.
            return Duration::MAX;
        }
        self.save
    }

    fn exited(&mut self, e: &Exit) {
        let Some(job) = self.jobs.get_mut(&e.job) else {
            return;
        };
        let (started, at) = (unix(self.origin, e.started), unix(self.origin, e.at));
        match e.signalled.filter(|_| !e.finished) {
            None => self.ledger.finish(job, &e.gpus, started, at),
            Some(s) => self
                .ledger
                .preempt(job, &e.gpus, started, unix(self.origin, s), at),
        }
        self.settled = true;
    }
}

/// One simulated host and its agent.
pub struct SimHost {
    pub name: String,
    pub host: Host,
    /// The agent process; `None` while it is crashed.
    pub agent: Option<Agent>,
    cfg: PlanConfig,
    origin: UnixMillis,
    /// Agent processes started on the host so far.
    incarnations: u64,
    pub outage: Option<Outage>,
    /// What the fleet last measured on this replica (while it is ready).
    pub signals: ServingSignals,
    /// Nothing is due on the host before then; `None`: at the next step.
    next: Option<Moment>,
    /// The last step changed something (the owners are checked again).
    pub stepped: bool,
    /// A fault (the engine's restart) took the serving replica down, and it has not served
    /// again since, nor was the host lent: the serving floor counts it, as no decision took
    /// it away.
    replica_lost: bool,
    /// The registry refuses the jobs' image until then.
    pulls_refused_until: Option<UnixMillis>,
}

impl SimHost {
    /// A host whose replica serves, its agent just started (it adopts the replica at its
    /// first step, before the coordinator answers).
    pub fn new(name: &str, gpus: u32, lifecycle: &Lifecycle, origin: UnixMillis) -> Self {
        let cfg = plan_config(lifecycle);
        let mut host = Self {
            name: name.to_owned(),
            host: Host::serving(name, gpus, timings(lifecycle)),
            agent: None,
            cfg,
            origin,
            incarnations: 0,
            outage: None,
            signals: ServingSignals::default(),
            next: None,
            stepped: false,
            replica_lost: false,
            pulls_refused_until: None,
        };
        host.start_agent();
        // The fleet serves when the simulation begins: the agent has adopted its replica.
        if let Some(agent) = &mut host.agent {
            agent.tick(Moment::ZERO, &mut host.host, &mut Idle);
            host.next = agent.next_tick(&host.host);
        }
        host
    }

    fn start_agent(&mut self) {
        self.incarnations += 1;
        self.agent = Some(Agent::new(self.cfg.clone(), self.incarnations, self.origin));
        self.next = None;
    }

    /// The load balancer sends the replica requests: its agent says it is ready, or, with the
    /// agent down, its vLLM still serves as it was.
    pub fn ready(&self) -> bool {
        match &self.agent {
            Some(a) => a.ready(),
            None => self.host.replica_serving(),
        }
    }

    /// The replica serves or is starting to, or a fault took it down and the agent is
    /// bringing it back (the serving floor counts these).
    pub fn up(&self) -> bool {
        self.host.replica_up() || self.replica_lost
    }

    /// A job runs (or is saving on its signal) on the host's GPUs.
    pub fn lent(&self) -> bool {
        self.host.lent()
    }

    /// Its heartbeats reach the coordinator.
    pub fn sends(&self) -> bool {
        self.agent.is_some() && matches!(self.outage, None | Some(Outage::Muted { .. }))
    }

    /// Its desired state reaches it.
    pub fn hears(&self) -> bool {
        self.agent.is_some() && matches!(self.outage, None | Some(Outage::Deaf { .. }))
    }

    /// Ends outages whose time is up; true when the agent came back from a crash (and must
    /// register again).
    pub fn heal(&mut self, now: UnixMillis) -> bool {
        if self.pulls_refused_until.is_some_and(|t| now >= t) {
            self.pulls_refused_until = None;
            self.lose_image(now, Pull::Takes(Duration::from_secs(30)));
        }
        let Some(outage) = self.outage.filter(|o| now >= o.until()) else {
            return false;
        };
        self.outage = None;
        self.next = None;
        if let Outage::Crashed { .. } = outage {
            self.start_agent();
            return true;
        }
        false
    }

    /// The agent crashes (its memory is lost) or is cut off.
    pub fn fail(&mut self, outage: Outage) {
        let merged = self.outage.map_or(outage, |o| o.merge(outage));
        if let Outage::Crashed { .. } = merged {
            self.agent = None;
        }
        self.outage = Some(merged);
        self.next = None;
    }

    /// The container engine restarts at `now`, down for `down`.
    pub fn restart_engine(&mut self, now: UnixMillis, down: Duration, books: &mut Books<'_>) {
        self.replica_lost |= self.host.replica_up();
        self.host
            .restart_engine(moment(self.origin, now), down, books);
        self.next = None;
    }

    /// vLLM's `/sleep` fails until `until`.
    pub fn fail_sleeps(&mut self, until: UnixMillis) {
        self.host.fail_sleeps(moment(self.origin, until));
    }

    /// The engine loses the jobs' image at `now`; pulling it again does what `pull` says.
    pub fn lose_image(&mut self, now: UnixMillis, pull: Pull) {
        self.host.lack(JOB_IMAGE, pull, moment(self.origin, now));
        self.next = None;
    }

    /// The engine loses the jobs' image at `now`, and the registry refuses it (at once)
    /// until `until`; from then a pull takes 30 s.
    pub fn refuse_pulls(&mut self, now: UnixMillis, until: UnixMillis) {
        let refusal = Pull::Fails(Duration::from_secs(1), "the registry answers 503".into());
        self.lose_image(now, refusal);
        self.pulls_refused_until = Some(until);
    }

    /// The checkpoint volume reads full until `until`.
    pub fn fill_disk(&mut self, until: UnixMillis) {
        self.host.fill_disk(moment(self.origin, until));
        self.next = None;
    }

    /// The desired state the agent last received, by version.
    pub fn desired_version(&self) -> Option<u64> {
        self.agent.as_ref()?.desired().map(|d| d.version)
    }

    /// The long poll's answer.
    pub fn receive(&mut self, desired: nightshift_common::DesiredNode) {
        if let Some(a) = &mut self.agent {
            a.receive(desired);
            self.next = None;
        }
    }

    /// Another host's run of a job settled its progress: the host's running jobs end at
    /// another time.
    pub fn refresh(&mut self, books: &Books<'_>) {
        self.host.refresh(books);
        self.next = None;
    }

    /// One second of the host at `now`: its timers turn and its agent acts, when anything
    /// is due. A ready replica's requests in flight take `drain` to finish.
    pub fn step(&mut self, now: UnixMillis, drain: Duration, books: &mut Books<'_>) {
        let at = moment(self.origin, now);
        self.stepped = self.next.is_none_or(|t| at >= t);
        if !self.stepped {
            return;
        }
        if self.ready() {
            // vLLM's requests in flight: the last one arrived now and takes the drain time.
            self.host.load(at + drain);
        }
        match &mut self.agent {
            Some(agent) => {
                agent.tick(at, &mut self.host, books);
                self.next = agent.next_tick(&self.host);
                let lent = agent.desired().is_some_and(|d| !d.serve);
                self.replica_lost &= !self.host.replica_up() && !lent;
            }
            None => {
                self.host.advance(at, books);
                self.next = self.host.next_event();
            }
        }
    }

    /// The heartbeat its agent sends; `None` while the agent is down.
    pub fn heartbeat(&self) -> Option<Heartbeat> {
        let agent = self.agent.as_ref()?;
        Some(agent.heartbeat(&self.host, &self.signals))
    }

    /// The coordinator acknowledged the heartbeat sent at `now`.
    pub fn contact(&mut self, now: UnixMillis) {
        if let Some(a) = &mut self.agent {
            a.contact(moment(self.origin, now));
            if a.next_tick(&self.host).is_none() {
                self.next = None;
            }
        }
    }

    /// Jobs still running when the simulation ends are counted as if checkpointed now.
    pub fn finish_accounting(
        &self,
        now: UnixMillis,
        jobs: &BTreeMap<u64, SimJob>,
        ledger: &mut Ledger,
    ) {
        for (job, gpus, started) in self.host.live_runs() {
            if let Some(job) = jobs.get(&job) {
                ledger.truncate(job, gpus, unix(self.origin, started), now);
            }
        }
    }
}
