//! Hand-made traces and small fleets shared by the simulator's tests.

#![allow(dead_code)]

use nightshift_sim::SimConfig;
use nightshift_sim::trace::{Trace, TraceData};

/// A day shaped like an inference service's: low at night, a peak in the evening; the rate
/// of each hour given in requests per second.
pub fn diurnal(hourly: &[f64]) -> Trace {
    Trace {
        name: "hand-made diurnal".into(),
        span_s: hourly.len() as u64 * 3_600,
        data: TraceData::Rates(
            hourly
                .iter()
                .enumerate()
                .map(|(h, &r)| (h as f64 * 3_600.0, r))
                .collect(),
        ),
    }
}

pub fn day() -> Trace {
    diurnal(&[
        4.0, 3.0, 2.0, 2.0, 2.0, 3.0, 5.0, 8.0, 10.0, 11.0, 12.0, 12.0, 12.0, 12.0, 11.0, 11.0,
        12.0, 13.0, 15.0, 18.0, 20.0, 18.0, 12.0, 7.0,
    ])
}

/// A small fleet with fast transitions, so that a few simulated hours see many of them.
pub fn small(days: f64) -> SimConfig {
    let mut cfg = SimConfig {
        nodes: 6,
        peak_replicas: 5,
        days,
        seed: 42,
        min_replicas: 1,
        heartbeat_s: 2,
        ..SimConfig::default()
    };
    cfg.lifecycle.cold_start_s = 60;
    for class in &mut cfg.mix {
        class.run_hours = (0.2, 1.0);
    }
    cfg
}
