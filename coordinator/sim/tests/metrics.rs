//! The figures' definitions (docs/SIMULATOR.md), checked on tiny hand-made traces whose
//! answers can be worked out by hand.

mod common;

use nightshift_sim::baseline::{best_window, need_per_minute, night_window, oracle_gpu_hours};
use nightshift_sim::model::ReplicaModel;
use nightshift_sim::trace::{Gap, Interarrival, Trace, TraceData, Window};
use nightshift_sim::{Policy, SimConfig, simulate};

/// One replica serves 256 / (0.5 + 150 × 0.05) = 32 requests/s; sized for 80 %, 25.6.
#[test]
fn need_is_the_minute_rate_over_a_replica_at_target_utilisation() {
    let model = ReplicaModel::default();
    assert_eq!(model.capacity_rps(), 32.0);
    // Minute 0: idle; minute 1: 25.6/s (exactly one replica); minute 2: 26/s (two);
    // minute 3: 100/s (four).
    let mut arrivals = vec![0u32; 60];
    arrivals.extend(std::iter::repeat_n(0u32, 60));
    for (i, a) in arrivals[60..].iter_mut().enumerate() {
        *a = if i < 36 { 26 } else { 25 }; // 36·26 + 24·25 = 1536 = 25.6 × 60
    }
    arrivals.extend(std::iter::repeat_n(26u32, 60));
    arrivals.extend(std::iter::repeat_n(100u32, 60));
    assert_eq!(need_per_minute(&arrivals, &model, 1), vec![1, 1, 2, 4]);
    assert_eq!(need_per_minute(&arrivals, &model, 3), vec![3, 3, 3, 4]);
}

#[test]
fn oracle_lends_every_gpu_the_load_does_not_need() {
    // 10 nodes of 4 GPUs; three minutes needing 2, 10 and 12 replicas.
    let hours = oracle_gpu_hours(&[2, 10, 12], 10, 4);
    assert!((hours - 32.0 / 60.0).abs() < 1e-12);
}

#[test]
fn fixed_windows_lend_only_what_the_worst_minute_of_their_slots_allows() {
    // Two days: 8 replicas needed 07:00–21:00, 2 otherwise, on 10 nodes.
    let need: Vec<u32> = (0..2 * 1_440)
        .map(|m| {
            if (420..1_260).contains(&(m % 1_440)) {
                8
            } else {
                2
            }
        })
        .collect();
    // No cold start: the best window is exactly the quiet 10 hours, lending 8.
    let w = best_window(&need, 10, 0);
    assert_eq!((w.start_s, w.end_s, w.lent), (21 * 3_600, 7 * 3_600, 8));
    // A cold start of 4 minutes costs the half hour before 07:00.
    let w = best_window(&need, 10, 240);
    assert_eq!(
        (w.start_s, w.end_s, w.lent),
        (21 * 3_600, 6 * 3_600 + 1_800, 8)
    );
    // 20:00–08:00 overlaps the busy hours: it can lend only 10 − 8.
    assert_eq!(night_window(&need, 10, 240).lent, 2);
}

#[test]
fn figures_follow_their_definitions() {
    let cfg = common::small(1.0);
    let report = simulate(&common::day(), &cfg, &Policy::ALL).expect("simulate");
    let oracle = &report.policies[4];
    assert_eq!(oracle.name, "oracle");
    assert_eq!(oracle.harvest_ratio, 1.0);
    assert_eq!(oracle.useful_gpu_hours, oracle.oracle_gpu_hours);
    for p in &report.policies {
        assert_eq!(p.oracle_gpu_hours, oracle.oracle_gpu_hours, "{}", p.name);
        let close = |a: f64, b: f64| (a - b).abs() <= 0.011;
        // The ratio is printed to 4 decimals, the GPU-hours to 2: the product is off by at
        // most half of each last digit.
        let rounding = 0.5e-4 * p.oracle_gpu_hours + 0.005;
        assert!(
            (p.harvest_ratio * p.oracle_gpu_hours - p.useful_gpu_hours).abs() <= rounding,
            "{}",
            p.name
        );
        assert!(
            close(p.equivalent_gpus, p.useful_gpu_hours / 24.0),
            "{}",
            p.name
        );
        assert!(
            close(p.savings, p.useful_gpu_hours * cfg.gpu_hour_price),
            "{}",
            p.name
        );
        assert!(p.useful_gpu_hours + p.lost_gpu_hours <= p.harvested_gpu_hours + 0.01);
        assert!(
            p.useful_gpu_hours <= p.oracle_gpu_hours + 0.01,
            "{} beats the oracle",
            p.name
        );
        assert_eq!(
            p.slo_violation_minutes_per_day.iter().sum::<u64>(),
            p.slo_violation_minutes
        );
        assert!(p.slo_violation_minutes <= p.capacity_minutes + p.queue_wait_minutes);
    }
}

#[test]
fn an_idle_trace_lends_everything_above_the_floor() {
    // Load only in the first hour, none after: the oracle lends 5 of 6 nodes all day long
    // except while the first hour needs more.
    let mut hourly = vec![0.0; 24];
    hourly[0] = 100.0;
    let cfg = SimConfig {
        days: 1.0,
        ..common::small(1.0)
    };
    let report = simulate(
        &common::diurnal(&hourly),
        &cfg,
        &[Policy::Oracle, Policy::Reactive],
    )
    .expect("simulate");
    let oracle = report.policies[0].oracle_gpu_hours;
    assert!(
        oracle > 5.0 * 4.0 * 22.9 && oracle <= 5.0 * 4.0 * 24.0,
        "oracle {oracle}"
    );
    let reactive = &report.policies[1];
    assert_eq!(reactive.invariant_violations, 0);
    assert!(
        reactive.harvest_ratio > 0.5,
        "reactive ratio {}",
        reactive.harvest_ratio
    );
}

#[test]
fn a_gap_in_the_recording_is_reported_and_filled_on_request() {
    // One client, busy all day at 100 requests/s except for an hour (six windows) in which
    // nothing was recorded.
    let clients = vec![
        (0..144u64)
            .filter(|w| !(60..66).contains(w))
            .map(|w| Window {
                start_s: w * 600,
                rate: 100.0,
                law: Interarrival::Poisson,
            })
            .collect(),
    ];
    let trace = Trace {
        name: "one client with a gap".into(),
        span_s: 86_400,
        data: TraceData::Windows {
            window_s: 600,
            clients,
        },
    };
    let gaps = vec![Gap {
        start_s: 36_000,
        windows: 6,
    }];
    let cfg = SimConfig {
        days: 1.0,
        ..common::small(1.0)
    };
    let run = |fill: bool| {
        let cfg = SimConfig {
            fill_trace_gaps: fill,
            ..cfg.clone()
        };
        simulate(&trace, &cfg, &[Policy::Oracle]).expect("simulate")
    };
    let (kept, filled) = (run(false), run(true));
    assert_eq!(kept.run.trace_gaps, gaps);
    assert_eq!(filled.run.trace_gaps, gaps);
    assert!(!kept.run.trace_gaps_filled && filled.run.trace_gaps_filled);
    assert!(kept.to_table().contains("6 windows in 1 stretch"));
    // Filled, the hour carries the load around it (an hour of 100 requests/s, scaled), and
    // the oracle no longer lends the replicas that load needs.
    let more = filled.run.requests as f64 - kept.run.requests as f64;
    let hour = 3_600.0 * 100.0 * kept.run.scale;
    assert!(
        (more - hour).abs() < 0.02 * hour,
        "{more} more requests, {hour} expected"
    );
    let lent = |r: &nightshift_sim::Report| r.policies[0].oracle_gpu_hours;
    assert!(
        lent(&filled) < lent(&kept),
        "{} vs {}",
        lent(&filled),
        lent(&kept)
    );
}
