//! The SLO gate and the queue-wait figures (docs/SIMULATOR.md, "Figures"), on hand-made
//! arrivals whose queue can be worked out by hand: a fixed lending plan, so that which
//! replicas are ready is known at every second.

use nightshift_core::CoreConfig;
use nightshift_sim::baseline::need_per_minute;
use nightshift_sim::baseline::{Window, window_config};
use nightshift_sim::controller::{CoreController, NoForecast};
use nightshift_sim::report::Figures;
use nightshift_sim::world::World;
use nightshift_sim::{PolicyResult, SimConfig};

fn run(cfg: &SimConfig, arrivals: &[u32], window: Window) -> PolicyResult {
    run_core(cfg, arrivals, window, window_config(cfg, window))
}

/// The core configured as `core`, lending on `window`.
fn run_core(cfg: &SimConfig, arrivals: &[u32], window: Window, core: CoreConfig) -> PolicyResult {
    let need = need_per_minute(arrivals, &cfg.replica, cfg.min_replicas);
    let controller = CoreController::new(core, Box::new(NoForecast));
    let o = World::new(cfg, arrivals, &need, &[], Box::new(controller)).run();
    let figures = Figures {
        oracle_gpu_hours: 1.0,
        days: arrivals.len() as f64 / 86_400.0,
        gpu_hour_price: cfg.gpu_hour_price,
    };
    figures.policy("plan", &o, Some(window))
}

const NEVER: Window = Window {
    start_s: 0,
    end_s: 0,
    lent: 0,
};

#[test]
fn the_gate_is_the_wait_users_feel_and_capacity_minutes_only_plan() {
    // Two replicas, always ready: 64 requests/s.
    let cfg = SimConfig {
        nodes: 2,
        min_replicas: 1,
        ..SimConfig::default()
    };
    let mut arrivals = Vec::new();
    // Minute 0: 128/s for 10 s, then nothing. The queue grows by 64 a second, so the
    // requests of second s wait s + 1 seconds: 5.5 s on average, 10 s at worst. The
    // minute's mean rate (21.3/s) needs one replica: no capacity minute, but the gate's.
    arrivals.extend([128u32; 10]);
    arrivals.extend([0u32; 50]);
    // Minute 1: 60/s needs ⌈60 / 25.6⌉ = 3 replicas, but two serve it without a queue: a
    // capacity minute that no user feels.
    arrivals.extend([60u32; 60]);
    // Minute 2: 66/s, 2 over capacity: the k-th second's requests wait 2k/64 s, 0.95 s on
    // average (within the 2 s target), 1.875 s at worst. Capacity short again.
    arrivals.extend([66u32; 60]);
    let p = run(&cfg, &arrivals, NEVER);
    assert_eq!(p.invariant_violations, 0, "{:?}", p.invariant_examples);
    assert_eq!(p.capacity_minutes, 2);
    assert_eq!(p.queue_wait_minutes, 1);
    assert_eq!(p.slo_violation_minutes, 1);
    assert_eq!(p.slo_violation_minutes_per_day, vec![1]);
    assert_eq!(p.worst_wait_s_per_day, vec![10.0]);
    // Each minute's p99: 10 s, 0 s and 1.875 s; their 99th percentile over three minutes is
    // the highest.
    assert_eq!(p.timeline.p99_wait_s, vec![10.0, 0.0, 1.875]);
    assert_eq!(p.minute_p99_wait_ms, 10_000.0);
    let slo: Vec<_> = p.timeline.minutes.iter().map(|m| m.slo_violated).collect();
    let short: Vec<_> = p
        .timeline
        .minutes
        .iter()
        .map(|m| m.capacity_short)
        .collect();
    assert_eq!(slo, [true, false, false]);
    assert_eq!(short, [false, true, true]);
    for m in &p.timeline.minutes {
        assert_eq!(
            (m.min_ready, m.max_up, m.max_lent, m.preemptions),
            (2, 2, 0, 0)
        );
    }
    assert_eq!(p.timeline.minutes[2].arrivals, 66.0 * 60.0);
}

#[test]
fn a_request_that_finds_no_ready_replica_waits_until_one_is_ready() {
    // One host, lent for the first two minutes: its replica drains and stops, a job runs,
    // and at 140 s the job is signalled, saves for 20 s, and the replica cold-starts in
    // 60 s. A request a second arrives all along.
    let mut cfg = SimConfig {
        nodes: 1,
        // No floor: the core lends the only node (with a floor of one it never would).
        min_replicas: 0,
        ..SimConfig::default()
    };
    cfg.lifecycle.cold_start_s = 60;
    // The core closes a window its reclaim lead before the end: told 100 s until it has
    // measured one (about as long as this reclaim takes), it closes this one at 140 s, and
    // the lead it measures then keeps it closed.
    let window = Window {
        start_s: 0,
        end_s: 240,
        lent: 1,
    };
    let mut core = window_config(&cfg, window);
    core.services[0].default_reclaim_lead_ms = 100_000;
    let arrivals = vec![1u32; 600];
    let p = run_core(&cfg, &arrivals, window, core);
    // The first request without a replica waits from the first seconds until 140 + 20 + 60 s
    // at the earliest; with drains, stops and heartbeats, within a minute of that.
    let worst = p.worst_wait_s_per_day[0];
    assert!((195.0..260.0).contains(&worst), "worst wait {worst} s");
    // Every minute until the replica is back breaks the gate; the rest do not.
    let slo: Vec<_> = p.timeline.minutes.iter().map(|m| m.slo_violated).collect();
    assert!(slo[..3].iter().all(|&v| v), "{slo:?}");
    assert!(slo[5..].iter().all(|&v| !v), "{slo:?}");
    assert_eq!(
        p.slo_violation_minutes,
        slo.iter().filter(|&&v| v).count() as u64
    );
    assert!(p.timeline.minutes[0].max_lent == 1 || p.timeline.minutes[1].max_lent == 1);
    assert_eq!(p.timeline.minutes[9].min_ready, 1);
    // The job was stopped before finishing: one preemption, in the minute it exited.
    let preempted: u32 = p.timeline.minutes.iter().map(|m| m.preemptions).sum();
    assert_eq!(u64::from(preempted), p.preemptions);
    assert!(p.preemptions >= 1);
}
