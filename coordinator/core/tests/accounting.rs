//! Accounting agrees with the job: each lease's usage record says it was preempted exactly
//! when the job counts a preemption for it, whatever stopped the job afterwards.

mod sim;

use nightshift_common::JobState;
use nightshift_core::{Effect, Usage};
use sim::{Cluster, config, spec};

/// Runs `steps` heartbeat intervals, keeping the usage records of the leases that ended.
fn run(c: &mut Cluster, steps: usize, usage: &mut Vec<Usage>) {
    for _ in 0..steps {
        c.step();
        c.assert_invariants();
        take_usage(c, usage);
    }
}

fn take_usage(c: &mut Cluster, usage: &mut Vec<Usage>) {
    usage.extend(c.core.poll_effects().into_iter().filter_map(|e| match e {
        Effect::LeaseEnded(u) => Some(u),
        _ => None,
    }));
}

fn state(c: &Cluster) -> (JobState, u32) {
    let j = c.core.job(1).unwrap();
    (j.state, j.attempt)
}

#[test]
fn a_job_preempted_once_then_cancelled_counts_one_preemption_in_its_usage() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, 1_000);
    c.core.submit(c.now, spec("train", 4)).unwrap();
    let mut usage = Vec::new();
    run(&mut c, 10, &mut usage);
    assert_eq!(state(&c), (JobState::Running, 1));

    // A surge takes the node back: the first lease ends in a preemption.
    c.core.gateway(c.now, "llm", 12).unwrap();
    take_usage(&mut c, &mut usage);
    run(&mut c, 3, &mut usage);
    assert_eq!(state(&c), (JobState::Queued, 2));
    c.load("a", 0.0, 0.0);
    run(&mut c, 20, &mut usage);
    assert_eq!(state(&c), (JobState::Running, 2));

    // Cancelled: its revoked member is reported stopped, which is no preemption.
    c.core.cancel(c.now, 1).unwrap();
    take_usage(&mut c, &mut usage);
    run(&mut c, 5, &mut usage);
    let job = c.core.job(1).unwrap();
    assert_eq!((job.state, job.preemptions), (JobState::Cancelled, 1));
    assert_eq!(usage.len(), 2, "{usage:?}");
    let preempted: Vec<bool> = usage.iter().map(|u| u.preempted).collect();
    assert_eq!(preempted, [true, false], "{usage:?}");
}
