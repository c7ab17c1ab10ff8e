//! `nightshift-sim`: a deterministic, trace-driven simulation of a GPU fleet that runs the
//! real coordinator decision core (`nightshift-core`) against simulated agents, vLLM replicas
//! and research jobs, and compares it with fixed-window baselines and an oracle.
//!
//! Deterministic by construction: a virtual clock of one-second steps, the simulator's own
//! seeded random source ([`rng::Rng`]), one stream per purpose, and no wall clock. Policies,
//! and the trace's clients when drawing arrivals, run on separate cores, each a pure function
//! of its inputs ([`par`]). The same trace, settings and seed give the same report, byte for
//! byte, on any number of cores. See docs/SIMULATOR.md for the model and the
//! precise definition of every figure.

pub mod arrivals;
pub mod backlog;
pub mod baseline;
pub mod config;
pub mod controller;
pub mod fault;
pub mod host;
pub mod ledger;
pub mod model;
mod par;
pub mod report;
pub mod rng;
pub mod timeline;
pub mod trace;
pub mod vopr;
pub mod world;

use std::str::FromStr;

pub use crate::config::SimConfig;
pub use crate::report::{PolicyResult, Report, RunInfo};
pub use crate::trace::{Trace, TraceError};

use crate::controller::{CoreController, NoForecast};
use crate::report::Figures;
use crate::world::{Outcome, World};

/// The policies a run can compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The core as shipped: reactive scaling plus predictive reclaim from its learned profile.
    Nightshift,
    /// The best fixed daily window and lent count, chosen with hindsight.
    FixedWindow,
    /// The literal 20:00–08:00 window, lending what it safely can.
    Night2008,
    /// The core without prediction.
    Reactive,
    /// Perfect foresight and free transitions: the upper bound.
    Oracle,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::Nightshift,
        Policy::FixedWindow,
        Policy::Night2008,
        Policy::Reactive,
        Policy::Oracle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Nightshift => "nightshift",
            Self::FixedWindow => "fixed-window",
            Self::Night2008 => "night-20-08",
            Self::Reactive => "reactive",
            Self::Oracle => "oracle",
        }
    }
}

impl FromStr for Policy {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| SimError::UnknownPolicy(s.to_owned()))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("the trace has no requests to scale")]
    NoLoad,
    #[error("--peak-replicas {peak} is more than --nodes {nodes}")]
    PeakAboveFleet { peak: u32, nodes: u32 },
    #[error("--days must be positive, not {0}")]
    Days(f64),
    #[error("{0}")]
    Faults(String),
    #[error(
        "unknown policy {0:?}: expected nightshift, fixed-window, night-20-08, reactive or oracle"
    )]
    UnknownPolicy(String),
}

/// The factor that makes the trace's busiest 10-minute window need `peak_replicas`.
pub fn scale_factor(trace: &Trace, cfg: &SimConfig) -> Result<f64, SimError> {
    let peak = trace.peak_rate(600);
    if peak <= 0.0 {
        return Err(SimError::NoLoad);
    }
    let per_replica = cfg.replica.capacity_rps() * cfg.replica.target_utilisation;
    Ok(f64::from(cfg.peak_replicas) * per_replica / peak)
}

/// Runs every policy in `policies` on the same trace, fleet, backlog and faults.
pub fn simulate(trace: &Trace, cfg: &SimConfig, policies: &[Policy]) -> Result<Report, SimError> {
    if cfg.days <= 0.0 || cfg.days.is_nan() {
        return Err(SimError::Days(cfg.days));
    }
    if cfg.peak_replicas > cfg.nodes {
        return Err(SimError::PeakAboveFleet {
            peak: cfg.peak_replicas,
            nodes: cfg.nodes,
        });
    }
    // Gaps the run reaches (a shorter trace repeats, and its gaps with it).
    let gaps: Vec<_> = trace
        .gaps()
        .into_iter()
        .filter(|g| g.start_s < cfg.horizon_s())
        .collect();
    let filled;
    let trace = if cfg.fill_trace_gaps && !gaps.is_empty() {
        let mut t = trace.clone();
        t.fill_gaps();
        filled = t;
        &filled
    } else {
        trace
    };
    let scale = scale_factor(trace, cfg)?;
    let arrivals = arrivals::per_second(trace, scale, cfg.horizon_s(), cfg.seed);
    let need = baseline::need_per_minute(&arrivals, &cfg.replica, cfg.min_replicas);
    let faults = cfg.faults.schedule(cfg.days, cfg.nodes as usize, cfg.seed);
    let figures = Figures {
        oracle_gpu_hours: baseline::oracle_gpu_hours(&need, cfg.nodes, cfg.gpus_per_node),
        days: cfg.days,
        gpu_hour_price: cfg.gpu_hour_price,
    };
    let cold = cfg.lifecycle.start_s();
    let run = |policy: Policy| -> PolicyResult {
        match policy {
            Policy::Nightshift | Policy::Reactive => {
                // The same core; `reactive` switches off its learned-profile forecast.
                let mut core = cfg.core_config();
                for service in &mut core.services {
                    service.predictive = policy == Policy::Nightshift;
                }
                let controller = CoreController::new(core, Box::new(NoForecast));
                let o = World::new(cfg, &arrivals, &need, &faults, Box::new(controller)).run();
                figures.policy(policy.name(), &o, None)
            }
            Policy::FixedWindow | Policy::Night2008 => {
                let window = if policy == Policy::FixedWindow {
                    baseline::best_window(&need, cfg.nodes, cold)
                } else {
                    baseline::night_window(&need, cfg.nodes, cold)
                };
                let core = baseline::window_config(cfg, window);
                let controller = CoreController::new(core, Box::new(NoForecast));
                let o = World::new(cfg, &arrivals, &need, &faults, Box::new(controller)).run();
                figures.policy(policy.name(), &o, Some(window))
            }
            Policy::Oracle => {
                let all = figures.oracle_gpu_hours;
                let days = cfg.horizon_s().div_ceil(86_400) as usize;
                let mut o = Outcome {
                    slo_minutes_per_day: vec![0; days],
                    timeline: baseline::oracle_timeline(&arrivals, &need, cfg.nodes),
                    ..Outcome::default()
                };
                o.waits.worst_s_per_day = vec![0.0; days];
                o.waits.minute_p99_s = vec![0.0; need.len()];
                figures.result(policy.name(), all, all, 0.0, &o, None)
            }
        }
    };
    // Each policy's world is independent of the others', so they run on separate cores;
    // the core-driven ones take longest and start first.
    let mut order: Vec<usize> = (0..policies.len()).collect();
    order.sort_by_key(|&i| match policies[i] {
        Policy::Nightshift | Policy::Reactive => 0,
        Policy::FixedWindow | Policy::Night2008 => 1,
        Policy::Oracle => 2,
    });
    let results = par::map(&order, |i| run(policies[i]));
    Ok(Report {
        run: RunInfo {
            trace: trace.name.clone(),
            days: cfg.days,
            nodes: cfg.nodes,
            gpus_per_node: cfg.gpus_per_node,
            peak_replicas: cfg.peak_replicas,
            seed: cfg.seed,
            faults: faults.len() as u64,
            scale: (scale * 1e6).round() / 1e6,
            requests: arrivals.iter().map(|&a| u64::from(a)).sum(),
            replica_capacity_rps: cfg.replica.capacity_rps(),
            trace_gaps: gaps,
            trace_gaps_filled: cfg.fill_trace_gaps,
        },
        policies: results,
        need,
    })
}
