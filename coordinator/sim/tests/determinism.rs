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
