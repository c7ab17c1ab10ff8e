//! The same seed gives the same report, byte for byte; another seed gives another.

mod common;

use nightshift_sim::fault::FaultRates;
use nightshift_sim::{Policy, simulate};

#[test]
fn same_seed_prints_identical_json() {
    let mut cfg = common::small(0.5);
    cfg.faults = FaultRates::parse("default").expect("spec");
    let run = |seed| {
        let mut c = cfg.clone();
        c.seed = seed;
        simulate(&common::day(), &c, &Policy::ALL)
            .expect("simulate")
            .to_json()
    };
    let (a, b) = (run(7), run(7));
    assert_eq!(a, b);
    assert!(a.contains("\"policies\""));
    assert_ne!(a, run(8));
}

#[test]
fn same_seed_draws_the_same_charts() {
    // What `--html` draws (each policy's minute-by-minute timeline and the minutes' need)
    // is not in the JSON: the whole report, timelines included, must repeat.
    let mut cfg = common::small(0.5);
    cfg.faults = FaultRates::parse("default").expect("spec");
    let run = || simulate(&common::day(), &cfg, &Policy::ALL).expect("simulate");
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    assert_eq!(a.need.len(), 720);
    for p in &a.policies {
        assert_eq!(p.timeline.minutes.len(), 720, "{}", p.name);
        assert_eq!(p.timeline.p99_wait_s.len(), 720, "{}", p.name);
    }
}
