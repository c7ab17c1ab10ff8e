//! The whole-system fault simulation, after TigerBeetle's VOPR: many seeds, each a small
//! fleet under random faults of every kind for a simulated day, with the real decision core
//! and the agent's real planner on every host, and every invariant checked after every
//! simulated second:
//!
//! - the core's own (`check_invariants`: ARCHITECTURE.md's invariants 1–4 and 8 as the core
//!   records them);
//! - on each host, as the host model saw it happen: one owner per GPU (invariant 2), and no
//!   job container ever started under an epoch older than one already started on its GPUs
//!   (invariant 3);
//! - across the fleet: no job with two live containers (invariant 4);
//! - the serving floor: replicas serving or starting never below `min_replicas`
//!   (invariant 1).
//!
//! Everything about a seed (its traffic, its backlog, its faults) is drawn from the seed, so
//! a failure is reproduced by its seed alone; [`shrink`] then drops every fault the failure
//! does not need, leaving the shortest fault list that still reproduces it.
//!
//! What is not modelled, and why: a wall-clock step (the coordinator and the agent count
//! time on monotonic clocks; `coordinator/tests/lifecycle.rs` steps the real coordinator's
//! clock), and an agent down for longer than the lease TTL (a process that is down stops
//! nothing: the documented limit of invariant 4, so crashes here last less than the TTL).

use std::collections::BTreeMap;
use std::ops::Range;

use crate::baseline;
use crate::config::SimConfig;
use crate::controller::{CoreController, NoForecast};
use crate::fault::{Fault, FaultKind};
use crate::model::Release;
use crate::rng::Rng;
use crate::trace::{Trace, TraceData};
use crate::world::World;

/// The shape of every seed's run.
#[derive(Debug, Clone, PartialEq)]
pub struct VoprConfig {
    /// Simulated days per seed.
    pub days: f64,
    pub nodes: u32,
    /// Faults injected per simulated day, their kinds drawn evenly.
    pub faults_per_day: u32,
}

impl Default for VoprConfig {
    fn default() -> Self {
        Self {
            days: 1.0,
            nodes: 8,
            faults_per_day: 60,
        }
    }
}

impl VoprConfig {
    /// The fleet of seed `seed`: small and quick to change (a one-minute cold start, jobs of
    /// minutes to an hour), so that a day sees hundreds of drains and reclaims. Odd seeds
    /// lend by putting vLLM to sleep, even ones by stopping it.
    pub fn sim_config(&self, seed: u64) -> SimConfig {
        let mut cfg = SimConfig {
            nodes: self.nodes,
            peak_replicas: (self.nodes * 3 / 4).max(1),
            days: self.days,
            seed,
            min_replicas: 2.min(self.nodes),
            heartbeat_s: 2,
            ..SimConfig::default()
        };
        cfg.lifecycle.cold_start_s = 60;
        if seed % 2 == 1 {
            cfg.lifecycle.release = Release::Sleep;
        }
        for class in &mut cfg.mix {
            class.run_hours = (0.1, 1.0);
        }
        cfg
    }
}

/// A day of traffic drawn from `seed`: quiet at night, a peak at a random hour, noise on
/// every hour.
pub fn trace(seed: u64) -> Trace {
    let mut rng = Rng::stream(seed, 21);
    let night = 1.0 + 3.0 * rng.uniform();
    let peak = 8.0 + 12.0 * rng.uniform();
    let peak_hour = 12.0 + 9.0 * rng.uniform();
    let rates = (0..24)
        .map(|h| {
            let h = f64::from(h);
            let day = (-((h - peak_hour) / 5.0).powi(2)).exp();
            let noise = 0.8 + 0.4 * rng.uniform();
            (h * 3_600.0, (night + (peak - night) * day) * noise)
        })
        .collect();
    Trace {
        name: format!("vopr seed {seed}"),
        span_s: 86_400,
        data: TraceData::Rates(rates),
    }
}

/// The faults of seed `seed`: kinds, hosts, times and durations all drawn from it.
pub fn faults(seed: u64, cfg: &VoprConfig, sim: &SimConfig) -> Vec<Fault> {
    let mut rng = Rng::stream(seed, 22);
    let horizon = sim.horizon_s().max(1);
    let ttl = sim.lease_ttl_s.max(2);
    let n = (f64::from(cfg.faults_per_day) * cfg.days).round() as u64;
    let mut between = |lo: u64, hi: u64| lo + rng.below(hi - lo + 1);
    let mut out: Vec<Fault> = (0..n)
        .map(|_| {
            let kind = FaultKind::ALL[between(0, FaultKind::ALL.len() as u64 - 1) as usize];
            let for_s = match kind {
                // Shorter than the lease TTL: see the module's header.
                FaultKind::AgentCrash => Some(between(1, ttl - 1)),
                FaultKind::Partition | FaultKind::HeartbeatLoss | FaultKind::DesiredLoss => {
                    Some(between(5, 10 * ttl))
                }
                FaultKind::EngineRestart => Some(between(1, 30)),
                FaultKind::DiskFull | FaultKind::SleepFails | FaultKind::PullRefused => {
                    Some(between(60, 1_800))
                }
                FaultKind::SlowPull => Some(between(5, 900)),
                FaultKind::CoordinatorDown => Some(between(1, 4 * ttl)),
                FaultKind::CoordinatorRestart | FaultKind::StubbornJobs => None,
            };
            Fault {
                at_s: between(0, horizon - 1),
                kind,
                node: between(0, u64::from(sim.nodes.max(1)) - 1) as usize,
                for_s,
            }
        })
        .collect();
    out.sort_by_key(|f| (f.at_s, f.node, f.kind));
    out
}

/// One seed's run.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedRun {
    pub seed: u64,
    /// The faults injected (all of them: the run may end early, at its first violation).
    pub faults: Vec<Fault>,
    /// The violations found (the first ones, verbatim) and how many.
    pub violations: Vec<String>,
    pub violation_count: u64,
    /// The simulated second the run ended at, at its first violation.
    pub stopped_at_s: Option<u64>,
    /// Simulated host-hours: hosts × simulated hours run.
    pub host_hours: f64,
}

impl SeedRun {
    pub fn failed(&self) -> bool {
        self.violation_count > 0
    }
}

/// Runs seed `seed` with `faults` (its own, or a subset while shrinking).
pub fn run_seed(seed: u64, cfg: &VoprConfig, faults: &[Fault]) -> SeedRun {
    let sim = cfg.sim_config(seed);
    let trace = trace(seed);
    let scale = crate::scale_factor(&trace, &sim).unwrap_or(1.0);
    let arrivals = crate::arrivals::per_second(&trace, scale, sim.horizon_s(), seed);
    let need = baseline::need_per_minute(&arrivals, &sim.replica, sim.min_replicas);
    let controller = CoreController::new(sim.core_config(), Box::new(NoForecast));
    let mut world = World::new(&sim, &arrivals, &need, faults, Box::new(controller));
    world.stop_at_first_violation = true;
    let out = world.run();
    let seconds = out.stopped_at_s.map_or(arrivals.len() as u64, |s| s + 1);
    SeedRun {
        seed,
        faults: faults.to_vec(),
        violations: out.violations,
        violation_count: out.violation_count,
        stopped_at_s: out.stopped_at_s,
        host_hours: f64::from(sim.nodes) * seconds as f64 / 3_600.0,
    }
}

/// Most reruns one shrink may take.
const SHRINK_RUNS: usize = 600;

/// Fewer of `run`'s faults that still make its seed fail, by delta debugging (Zeller's
/// ddmin): the faults after the failure go, then ever smaller chunks of the others, each
/// kept out when the seed still fails without it (with any violation: a fleet is chaotic,
/// and one fault fewer can move the failure elsewhere). At most [`SHRINK_RUNS`] reruns.
/// Returns the failing run with the faults left.
pub fn shrink(run: &SeedRun, cfg: &VoprConfig) -> SeedRun {
    let mut best = run.clone();
    let mut runs = 0;
    let mut chunks = 2;
    loop {
        // Faults after the failure never happened.
        let stop = best.stopped_at_s.unwrap_or(u64::MAX);
        best.faults.retain(|f| f.at_s <= stop);
        let n = best.faults.len();
        if n < 2 || runs >= SHRINK_RUNS {
            break;
        }
        let size = n.div_ceil(chunks);
        let starts: Vec<usize> = (0..n).step_by(size).collect();
        let mut fewer = None;
        // The chunks are tried a core's worth at a time, all of a batch at once; the first
        // that still fails, in chunk order, is taken, and only the reruns up to it count:
        // the result and the budget are those of trying them one by one.
        'round: for batch in starts.chunks(crate::par::cores()) {
            let batch = &batch[..batch.len().min(SHRINK_RUNS.saturating_sub(runs))];
            if batch.is_empty() {
                break;
            }
            let order: Vec<usize> = (0..batch.len()).collect();
            let tried = crate::par::map(&order, |k| {
                let start = batch[k];
                let rest: Vec<Fault> = best.faults[..start]
                    .iter()
                    .chain(&best.faults[(start + size).min(n)..])
                    .copied()
                    .collect();
                run_seed(run.seed, cfg, &rest)
            });
            for t in tried {
                runs += 1;
                if t.failed() {
                    fewer = Some(t);
                    break 'round;
                }
            }
        }
        match fewer {
            Some(tried) => {
                best = tried;
                chunks = (chunks - 1).max(2);
            }
            None if size == 1 => break,
            None => chunks = (chunks * 2).min(n),
        }
    }
    best
}

/// The faults of `run`, by index, without any one of which its seed still fails; none
/// when the list is 1-minimal (as [`shrink`] leaves it when its reruns suffice).
pub fn removable(run: &SeedRun, cfg: &VoprConfig) -> Vec<usize> {
    let each: Vec<usize> = (0..run.faults.len()).collect();
    let fails = crate::par::map(&each, |i| {
        let mut rest = run.faults.clone();
        rest.remove(i);
        run_seed(run.seed, cfg, &rest).failed()
    });
    each.into_iter().filter(|i| fails[*i]).collect()
}

/// The first of `seeds`, in order, whose run fails, looked for a core's worth of seeds at a
/// time; `None` when none does.
pub fn hunt(seeds: Range<u64>, cfg: &VoprConfig) -> Option<SeedRun> {
    let list: Vec<u64> = seeds.collect();
    for batch in list.chunks(crate::par::cores()) {
        let order: Vec<usize> = (0..batch.len()).collect();
        let runs = crate::par::map(&order, |k| {
            let seed = batch[k];
            let sim = cfg.sim_config(seed);
            run_seed(seed, cfg, &faults(seed, cfg, &sim))
        });
        if let Some(failed) = runs.into_iter().find(SeedRun::failed) {
            return Some(failed);
        }
    }
    None
}

/// What a batch of seeds found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    pub seeds: u64,
    pub host_hours: f64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Each failing seed, shrunk.
    pub failures: Vec<SeedRun>,
}

/// Runs `seeds`, on every core; the failing ones are shrunk.
pub fn run(seeds: Range<u64>, cfg: &VoprConfig) -> Summary {
    let list: Vec<u64> = seeds.collect();
    let order: Vec<usize> = (0..list.len()).collect();
    let runs = crate::par::map(&order, |i| {
        let seed = list[i];
        let sim = cfg.sim_config(seed);
        let run = run_seed(seed, cfg, &faults(seed, cfg, &sim));
        let shrunk = run.failed().then(|| shrink(&run, cfg));
        (run, shrunk)
    });
    let mut summary = Summary {
        seeds: list.len() as u64,
        ..Summary::default()
    };
    for (run, shrunk) in runs {
        summary.host_hours += run.host_hours;
        let stop = run.stopped_at_s.unwrap_or(u64::MAX);
        for f in run.faults.iter().filter(|f| f.at_s <= stop) {
            *summary.faults.entry(f.kind.name()).or_default() += 1;
        }
        summary.failures.extend(shrunk);
    }
    summary
}
