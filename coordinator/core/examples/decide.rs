//! Times the core's decisions at fleet scale, without HTTP or a store: how long lending a
//! fleet and placing a deep queue take, decision by decision.
//!
//! `cargo run --release -p nightshift-core --example decide -- [NODES] [JOBS] [PER_DECISION]`
//!
//! `NODES` idle serving nodes of 4 GPUs (one service, `min_replicas = 1`, no scale-down
//! window or cooldown: the coordinator bench's settings) and `JOBS` queued one-GPU jobs. The
//! first decision lends the nodes the queue needs; each lent node then reports its replica
//! stopped, and decisions follow until the queue is placed, each placing at most
//! `PER_DECISION` jobs (`max_placements_per_decision`, the core's default if not given).
//! Prints each phase's decisions: count, total and longest time, and placements per second
//! of deciding.

use std::time::{Duration, Instant};

use nightshift_common::{
    GpuInfo, GpuStatus, Heartbeat, JobSpec, ReplicaState, ReplicaStatus, ServingSignals,
};
use nightshift_core::{Core, CoreConfig, ScaleDown, ServicePolicy};

const GPUS: u32 = 4;
const T0: u64 = 1_767_225_600_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let nodes = args.first().copied().unwrap_or(10_000);
    let jobs = args.get(1).copied().unwrap_or(10_000);
    let defaults = CoreConfig::default();
    let max_placements_per_decision = args
        .get(2)
        .copied()
        .unwrap_or(defaults.max_placements_per_decision);
    let mut core = Core::new(CoreConfig {
        services: vec![ServicePolicy {
            name: "llm".into(),
            min_replicas: 1,
            cooldown_ms: 0,
            scale_down: ScaleDown {
                window_ms: 0,
                ..ScaleDown::default()
            },
            ..ServicePolicy::default()
        }],
        max_placements_per_decision,
        ..defaults
    });
    let mut now = T0;
    for i in 0..jobs {
        core.submit(now, JobSpec::new(format!("job-{i}"), "trainer:1", 1))?;
    }
    let names: Vec<String> = (0..nodes).map(|i| format!("node-{i:05}")).collect();
    for name in &names {
        core.enroll(now, name, "llm", inventory(name), None)?;
    }
    for name in &names {
        core.observe(now, name, beat(ReplicaState::Serving))?;
    }
    now += 1_000;
    let lending = timed(&mut core, now);
    let lent: Vec<&String> = names
        .iter()
        .filter(|n| core.desired(n).is_some_and(|d| !d.serve))
        .collect();
    println!(
        "{nodes} nodes, {jobs} queued jobs: lending {} nodes took {:.2} ms",
        lent.len(),
        ms(lending)
    );
    for name in &lent {
        core.observe(now, name, beat(ReplicaState::Stopped))?;
    }
    let mut decisions = Vec::new();
    let mut placed = 0;
    loop {
        now += 20;
        let took = timed(&mut core, now);
        let leases: usize = lent.iter().map(|n| core.leases_on(n).count()).sum();
        decisions.push((took, leases - placed));
        if leases == placed {
            break;
        }
        placed = leases;
    }
    let total: Duration = decisions.iter().map(|d| d.0).sum();
    let longest = decisions.iter().map(|d| d.0).max().unwrap_or_default();
    println!(
        "placing {placed} jobs: {} decisions, {:.2} ms in all, longest {:.2} ms, \
         mean {:.2} ms; {:.0} placements per second of deciding",
        decisions.len(),
        ms(total),
        ms(longest),
        ms(total) / decisions.len() as f64,
        placed as f64 / total.as_secs_f64()
    );
    Ok(())
}

fn timed(core: &mut Core, now: u64) -> Duration {
    let started = Instant::now();
    core.tick(now);
    started.elapsed()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

fn inventory(node: &str) -> Vec<GpuInfo> {
    (0..GPUS)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{node}-{i}"),
            name: "bench".into(),
            memory_total_bytes: 80 << 30,
        })
        .collect()
}

fn beat(replica: ReplicaState) -> Heartbeat {
    Heartbeat {
        gpus: (0..GPUS).map(|i| GpuStatus::healthy(i, 0)).collect(),
        replica: ReplicaStatus {
            state: replica,
            signals: ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                ..Default::default()
            },
            url: None,
        },
        jobs: vec![],
        applied_version: 0,
        phases: vec![],
        expired_leases: vec![],
        host: None,
        agent_url: None,
        metrics_url: None,
    }
}
