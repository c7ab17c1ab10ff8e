//! One policy's run: the simulated fleet, its traffic and its backlog on a virtual clock of
//! one-second steps, in the manner of quinn-proto's test `Pair`. Each step applies due
//! faults, serves the second's arrivals, lets every host act on its desired state, delivers
//! heartbeats, tops up the backlog, ticks the controller and checks the invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_common::UnixMillis;
use nightshift_hostmodel::Pull;

use crate::backlog::{Backlog, SimJob};
use crate::config::SimConfig;
use crate::controller::Controller;
use crate::fault::{Fault, FaultKind};
use crate::host::{Books, Outage, SimHost};
use crate::ledger::Ledger;
use crate::timeline::{MinuteSample, Waits};

/// Simulated time of trace second 0 (midnight of day 1). Any fixed value works; a realistic
/// epoch keeps the core's arithmetic on timestamps like production's.
pub const ORIGIN: UnixMillis = 1_767_225_600_000;

/// Invariant violations kept verbatim; more are only counted.
const VIOLATIONS_KEPT: usize = 20;

/// What a run measured, before it is turned into figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub ledger: Ledger,
    /// The SLO gate: minutes whose requests waited longer than the target on average, or
    /// in which a request found no ready replica (the same minutes as `queue_wait_minutes`).
    pub slo_violation_minutes: u64,
    /// Minutes with fewer ready replicas than the load needed at some second: a planning
    /// signal, not the gate.
    pub capacity_minutes: u64,
    /// Minutes whose requests waited longer than the target on average, or found no ready
    /// replica.
    pub queue_wait_minutes: u64,
    pub slo_minutes_per_day: Vec<u64>,
    /// The wait of each second's arrivals, and what follows from it.
    pub waits: Waits,
    /// One sample per simulated minute, for the charts.
    pub timeline: Vec<MinuteSample>,
    pub violations: Vec<String>,
    pub violation_count: u64,
    /// The second the run ended at its first violation, when asked to.
    pub stopped_at_s: Option<u64>,
}

pub struct World<'a> {
    cfg: &'a SimConfig,
    arrivals: &'a [u32],
    need: &'a [u32],
    faults: &'a [Fault],
    controller: Box<dyn Controller + 'a>,
    /// Hosts in name order.
    nodes: Vec<SimHost>,
    /// Per host: its desired state may have moved since it last fetched it (the long-poll
    /// woke). A host that cannot reach the coordinator fetches once it can again.
    woken: Vec<bool>,
    jobs: BTreeMap<u64, SimJob>,
    backlog: Backlog,
    out: Outcome,
    /// Requests waiting at the gateway and in the replicas' queues.
    queued: f64,
    /// Seconds since the last with a ready replica, each with the queue it left behind: their
    /// arrivals' wait is known once a replica is ready again.
    starved: Vec<(u64, f64)>,
    /// Preemptions up to the end of the last minute closed.
    preempted: u64,
    /// Jobs that ignore their checkpoint signal (a fault).
    stubborn: BTreeSet<u64>,
    /// When a coordinator that is down restarts.
    restart_at: Option<UnixMillis>,
    /// Ends the run at the first invariant violation (the fault simulation's search).
    pub stop_at_first_violation: bool,
    /// The hosts' job starts when the fleet was last checked for a job living twice.
    starts_checked: u64,
}

/// The jobs' side of the hosts for one step.
fn books<'a>(
    cfg: &SimConfig,
    jobs: &'a mut BTreeMap<u64, SimJob>,
    ledger: &'a mut crate::ledger::Ledger,
    stubborn: &'a BTreeSet<u64>,
) -> Books<'a> {
    Books {
        origin: ORIGIN,
        jobs,
        ledger,
        save: Duration::from_secs(cfg.lifecycle.checkpoint_save_s.max(1)),
        stubborn,
        settled: false,
    }
}

/// Per-minute SLO bookkeeping.
#[derive(Default)]
struct Minute {
    min_ready: Option<usize>,
    max_up: usize,
    max_lent: usize,
    arrivals: f64,
    wait_sum_s: f64,
    starved: bool,
}

impl<'a> World<'a> {
    pub fn new(
        cfg: &'a SimConfig,
        arrivals: &'a [u32],
        need: &'a [u32],
        faults: &'a [Fault],
        mut controller: Box<dyn Controller + 'a>,
    ) -> Self {
        let mut out = Outcome::default();
        let nodes: Vec<SimHost> = (0..cfg.nodes)
            .map(|i| {
                let name = format!("node-{i:03}");
                SimHost::new(&name, cfg.gpus_per_node, &cfg.lifecycle, ORIGIN)
            })
            .collect();
        for n in &nodes {
            if let Err(e) = controller.register(ORIGIN, &n.name, n.host.inventory()) {
                out.violations.push(format!("register {}: {e}", n.name));
            }
        }
        Self {
            cfg,
            arrivals,
            need,
            faults,
            controller,
            woken: vec![false; nodes.len()],
            nodes,
            jobs: BTreeMap::new(),
            backlog: Backlog::new(cfg.mix.clone(), cfg.seed),
            out,
            queued: 0.0,
            starved: Vec::new(),
            preempted: 0,
            stubborn: BTreeSet::new(),
            restart_at: None,
            stop_at_first_violation: false,
            starts_checked: 0,
        }
    }

    pub fn run(mut self) -> Outcome {
        let horizon = self.arrivals.len() as u64;
        let mut next_fault = 0;
        let mut minute = Minute::default();
        let days = horizon.div_ceil(86_400) as usize;
        self.out.slo_minutes_per_day = vec![0; days];
        self.out.waits = Waits::new(horizon as usize);
        self.out.timeline.reserve(horizon.div_ceil(60) as usize);
        for s in 0..horizon {
            let now = ORIGIN + s * 1_000;
            while let Some(f) = self.faults.get(next_fault).filter(|f| f.at_s <= s) {
                next_fault += 1;
                self.inject(now, *f);
            }
            self.heal(now);
            self.serve(s, &mut minute);
            self.act(now);
            self.beat(s, now);
            if s % 60 == 0 {
                self.top_up(now);
            }
            self.controller.tick(now);
            self.check(now);
            if s % 60 == 59 || s + 1 == horizon {
                self.close_minute(s / 60, std::mem::take(&mut minute));
            }
            if self.stop_at_first_violation && self.out.violation_count > 0 {
                self.out.stopped_at_s = Some(s);
                break;
            }
        }
        // Arrivals still waiting for a ready replica at the end waited at least until then.
        for (t, _) in std::mem::take(&mut self.starved) {
            self.out.waits.set(t, (horizon - t) as f64);
        }
        let end = ORIGIN + horizon * 1_000;
        for n in &self.nodes {
            n.finish_accounting(end, &self.jobs, &mut self.out.ledger);
        }
        self.out.waits.summarise(self.arrivals);
        self.out
    }

    fn inject(&mut self, now: UnixMillis, f: Fault) {
        let lc = &self.cfg.lifecycle;
        let until = |default_s: u64| now + f.for_s.unwrap_or(default_s) * 1_000;
        let node = f.node.min(self.nodes.len().saturating_sub(1));
        match f.kind {
            FaultKind::CoordinatorRestart => {
                let lost = self.controller.restart(now);
                self.record(now, lost);
            }
            FaultKind::CoordinatorDown => {
                let back = until(lc.partition_s);
                for n in &mut self.nodes {
                    n.fail(Outage::Partitioned { until: back });
                }
                self.restart_at = Some(self.restart_at.map_or(back, |t| t.max(back)));
            }
            FaultKind::AgentCrash => self.nodes[node].fail(Outage::Crashed {
                until: until(lc.agent_restart_s),
            }),
            FaultKind::Partition => self.nodes[node].fail(Outage::Partitioned {
                until: until(lc.partition_s),
            }),
            FaultKind::HeartbeatLoss => self.nodes[node].fail(Outage::Deaf {
                until: until(lc.partition_s),
            }),
            FaultKind::DesiredLoss => self.nodes[node].fail(Outage::Muted {
                until: until(lc.partition_s),
            }),
            FaultKind::EngineRestart => {
                let down = Duration::from_secs(f.for_s.unwrap_or(10));
                let World {
                    nodes,
                    jobs,
                    out,
                    stubborn,
                    cfg,
                    ..
                } = self;
                let mut books = books(cfg, jobs, &mut out.ledger, stubborn);
                nodes[node].restart_engine(now, down, &mut books);
            }
            FaultKind::StubbornJobs => {
                let live: Vec<u64> = self.nodes[node]
                    .host
                    .live_runs()
                    .map(|(job, _, _)| job)
                    .collect();
                self.stubborn.extend(live);
            }
            FaultKind::DiskFull => self.nodes[node].fill_disk(until(600)),
            FaultKind::SleepFails => self.nodes[node].fail_sleeps(until(600)),
            FaultKind::SlowPull => {
                let takes = Duration::from_secs(f.for_s.unwrap_or(120));
                self.nodes[node].lose_image(now, Pull::Takes(takes));
            }
            FaultKind::PullRefused => self.nodes[node].refuse_pulls(now, until(600)),
        }
    }

    fn heal(&mut self, now: UnixMillis) {
        if self.restart_at.is_some_and(|t| now >= t) {
            self.restart_at = None;
            let lost = self.controller.restart(now);
            self.record(now, lost);
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].heal(now) {
                let (name, inv) = (self.nodes[i].name.clone(), self.nodes[i].host.inventory());
                if let Err(e) = self.controller.register(now, &name, inv) {
                    self.record(now, vec![format!("register {name}: {e}")]);
                }
                // A restarted agent long-polls for its desired state at once.
                self.woken[i] = true;
            }
        }
    }

    /// The second's arrivals meet the ready replicas (a fluid FIFO queue).
    fn serve(&mut self, s: u64, minute: &mut Minute) {
        let model = &self.cfg.replica;
        let (mut ready, mut up, mut lent) = (0, 0, 0);
        for n in &self.nodes {
            ready += usize::from(n.ready());
            up += usize::from(n.up());
            lent += usize::from(n.lent());
        }
        let arrived = f64::from(self.arrivals[s as usize]);
        let capacity = ready as f64 * model.capacity_rps();
        let offered = self.queued + arrived;
        let served = offered.min(capacity);
        self.queued = offered - served;
        minute.min_ready = Some(minute.min_ready.map_or(ready, |m| m.min(ready)));
        minute.max_up = minute.max_up.max(up);
        minute.max_lent = minute.max_lent.max(lent);
        minute.arrivals += arrived;
        if ready == 0 {
            minute.starved |= arrived > 0.0 || self.queued > 0.0;
            if arrived > 0.0 {
                self.starved.push((s, self.queued));
            }
        } else {
            // Requests that found no ready replica are the head of the queue: each waited
            // from its second until now, then for the queue ahead of it beyond what the
            // ready replicas serve this second.
            for (t, ahead) in std::mem::take(&mut self.starved) {
                let rest = (ahead - capacity).max(0.0) / capacity;
                self.out.waits.set(t, (s - t) as f64 + rest);
            }
            // A request arriving now waits for the queue ahead of it to drain.
            let wait_s = self.queued / capacity;
            minute.wait_sum_s += arrived * wait_s;
            self.out.waits.set(s, wait_s);
            let running = (served / ready as f64 * model.latency_s()).min(model.max_seqs);
            let waiting = self.queued / ready as f64;
            for n in self.nodes.iter_mut().filter(|n| n.ready()) {
                n.signals.requests_running = Some(running);
                n.signals.requests_waiting = Some(waiting);
                n.signals.kv_cache_usage = Some(running / model.max_seqs);
            }
        }
        if ready == 0 && self.queued > 0.0 {
            let now = ORIGIN + s * 1_000;
            self.controller.gateway(now, self.queued.ceil() as u64);
        }
    }

    /// Each host fetches a changed desired state (the long-poll) and acts for one second.
    fn act(&mut self, now: UnixMillis) {
        let drain = Duration::from_secs_f64(self.cfg.replica.latency_s());
        let mut books = books(
            self.cfg,
            &mut self.jobs,
            &mut self.out.ledger,
            &self.stubborn,
        );
        for node in self.controller.moved() {
            if let Ok(i) = self
                .nodes
                .binary_search_by(|n| n.name.as_str().cmp(node.as_str()))
            {
                self.woken[i] = true;
            }
        }
        for (n, woken) in self.nodes.iter_mut().zip(&mut self.woken) {
            if *woken && n.hears() {
                *woken = false;
                let v = self.controller.version(&n.name);
                if v.is_some()
                    && v != n.desired_version()
                    && let Some(d) = self.controller.desired(&n.name)
                {
                    n.receive(d);
                }
            }
            n.step(now, drain, &mut books);
        }
        // A job's progress is what other hosts' runs of it (a container left running on a
        // partitioned host) compare against.
        if books.settled {
            for n in &mut self.nodes {
                n.refresh(&books);
            }
        }
    }

    /// Heartbeats, staggered over the interval by node.
    fn beat(&mut self, s: u64, now: UnixMillis) {
        let every = self.cfg.heartbeat_s.max(1);
        for (i, n) in self.nodes.iter_mut().enumerate() {
            if !n.sends() || !(s + i as u64).is_multiple_of(every) {
                continue;
            }
            let Some(beat) = n.heartbeat() else {
                continue;
            };
            match self.controller.heartbeat(now, &n.name, beat) {
                Ok(()) => n.contact(now),
                Err(e) => {
                    if self.out.violations.len() < VIOLATIONS_KEPT {
                        self.out
                            .violations
                            .push(format!("heartbeat {}: {e}", n.name));
                    }
                    self.out.violation_count += 1;
                }
            }
        }
    }

    /// Keeps the backlog deep enough that every lendable GPU could be busy.
    fn top_up(&mut self, now: UnixMillis) {
        let target = (self.cfg.nodes * self.cfg.gpus_per_node) as usize + self.cfg.queue_depth;
        let outstanding = self.jobs.values().filter(|j| j.remaining_ms() > 0).count();
        for _ in outstanding..target {
            let Some((job, spec)) = self.backlog.next_job() else {
                return;
            };
            match self.controller.submit(now, spec) {
                Ok(id) => {
                    self.jobs.insert(id, job);
                }
                Err(e) => {
                    self.record(now, vec![format!("submit: {e}")]);
                    return;
                }
            }
        }
    }

    fn check(&mut self, now: UnixMillis) {
        let mut found = self.controller.violations();
        // A host that did not step is as it was when last checked, and every violation found
        // then was recorded: one found again is recorded again, as stepping every second
        // would.
        // A host that did not step is as it was when last checked.
        for n in self.nodes.iter().filter(|n| n.stepped) {
            if let Err(e) = n.host.check_owners() {
                found.push(e);
            }
        }
        // One live attempt per job (invariant 4): no job's container lives on two hosts, or
        // twice on one. Only a start can break it, so the fleet is looked at after one.
        let starts: u64 = self.nodes.iter().map(|n| n.host.job_starts()).sum();
        if starts != self.starts_checked {
            self.starts_checked = starts;
            let mut seen: BTreeMap<u64, &str> = BTreeMap::new();
            for n in &self.nodes {
                for (job, _, _) in n.host.live_runs() {
                    if let Some(other) = seen.insert(job, &n.name) {
                        found.push(format!(
                            "job {job} has live containers on {other} and {}",
                            n.name
                        ));
                    }
                }
            }
        }
        let up = self.nodes.iter().filter(|n| n.up()).count();
        let floor = self.cfg.min_replicas as usize;
        if up < floor.min(self.nodes.len()) {
            found.push(format!(
                "serving floor: {up} replicas serving or starting, below {floor}"
            ));
        }
        self.record(now, found);
    }

    fn record(&mut self, now: UnixMillis, found: Vec<String>) {
        for v in found {
            if self.out.violations.len() < VIOLATIONS_KEPT {
                let s = (now - ORIGIN) / 1_000;
                self.out.violations.push(format!("t={s}s: {v}"));
            }
            self.out.violation_count += 1;
        }
    }

    fn close_minute(&mut self, index: u64, m: Minute) {
        let need = self.need.get(index as usize).copied().unwrap_or(0) as usize;
        let short = m.min_ready.unwrap_or(0) < need;
        let wait_ms = if m.arrivals > 0.0 {
            m.wait_sum_s / m.arrivals * 1_000.0
        } else {
            0.0
        };
        let slow = m.starved || wait_ms > self.cfg.replica.queue_wait_target_ms;
        self.out.capacity_minutes += u64::from(short);
        self.out.queue_wait_minutes += u64::from(slow);
        let preempted = self.out.ledger.preemptions;
        self.out.timeline.push(MinuteSample {
            arrivals: m.arrivals,
            min_ready: m.min_ready.unwrap_or(0) as u32,
            max_up: m.max_up as u32,
            max_lent: m.max_lent as u32,
            capacity_short: short,
            slo_violated: slow,
            preemptions: (preempted - self.preempted) as u32,
        });
        self.preempted = preempted;
        // The gate is the wait users feel; capacity minutes are a planning signal.
        if slow {
            self.out.slo_violation_minutes += 1;
            if let Some(d) = self
                .out
                .slo_minutes_per_day
                .get_mut((index / 1_440) as usize)
            {
                *d += 1;
            }
        }
    }
}
