//! The simulator under faults: agent crashes, coordinator restarts and partitions, with the
//! core's checks of ARCHITECTURE.md's invariants (1–4 and 8) after every step, must report no
//! violation.

mod common;

use nightshift_sim::fault::FaultRates;
use nightshift_sim::{Policy, simulate};

#[test]
fn a_day_with_many_faults_keeps_every_invariant() {
    let mut cfg = common::small(1.0);
    cfg.faults = FaultRates {
        agent_crash: 24,
        coordinator_restart: 12,
        partition: 12,
    };
    let report = simulate(
        &common::day(),
        &cfg,
        &[Policy::Nightshift, Policy::FixedWindow],
    )
    .expect("simulate");
    assert_eq!(report.run.faults, 48);
    for p in &report.policies {
        assert_eq!(
            p.invariant_violations, 0,
            "{}: {:?}",
            p.name, p.invariant_examples
        );
        assert!(p.harvested_gpu_hours > 0.0, "{} lent nothing", p.name);
        assert!(p.jobs_completed > 0, "{} finished no job", p.name);
    }
    // Partitions outlast the lease TTL, so some jobs were stopped by their agents.
    assert!(report.policies[0].preemptions > 0);
}

#[test]
fn faults_cost_the_core_work_but_not_correctness() {
    let calm = simulate(&common::day(), &common::small(1.0), &[Policy::Reactive]).expect("calm");
    let mut cfg = common::small(1.0);
    cfg.faults = FaultRates::parse("default").expect("spec");
    let stormy = simulate(&common::day(), &cfg, &[Policy::Reactive]).expect("stormy");
    assert_eq!(stormy.policies[0].invariant_violations, 0);
    assert!(calm.policies[0].useful_gpu_hours > 0.0);
    assert_ne!(calm.policies[0], stormy.policies[0]);
}
