//! Each attempt of a job keeps where it ran (nodes, GPUs, fencing epoch), when, and how it
//! ended, after the job's leases are gone and across a restart of the core.

mod sim;

use nightshift_common::{AttemptEnding, JobState};
use sim::{Cluster, config, spec};

#[test]
fn a_finished_job_still_says_where_each_attempt_ran_and_how_it_ended() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, 20);
    c.core.submit(c.now, spec("train", 2)).unwrap();
    c.run(8);
    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Running);
    let open = &job.attempts[..];
    assert_eq!(open.len(), 1);
    assert_eq!(
        (open[0].attempt, open[0].ending, open[0].ended_at),
        (1, None, None)
    );
    assert!(open[0].started_at.is_some());
    let lease = &job.leases[0];
    assert_eq!(open[0].members.len(), 1);
    let member = &open[0].members[0];
    assert_eq!(
        (member.node.as_str(), &member.gpus, member.epoch),
        ("a", &lease.gpus, lease.epoch)
    );
    let first_epoch = lease.epoch;

    // Its container is stopped under it: preempted, requeued and placed again.
    let now = c.now;
    c.agent("a").restart_engine(now);
    c.run(3);
    c.restart(config(0));
    c.run(40);

    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert!(job.leases.is_empty(), "a finished job holds no lease");
    let [first, second] = &job.attempts[..] else {
        panic!("two attempts: {:?}", job.attempts);
    };
    assert_eq!(
        (first.attempt, first.ending, first.exit_code),
        (1, Some(AttemptEnding::Preempted), None)
    );
    assert_eq!(first.members[0].epoch, first_epoch);
    assert_eq!(
        (second.attempt, second.ending, second.exit_code),
        (2, Some(AttemptEnding::Succeeded), Some(0))
    );
    assert_eq!(second.members[0].node, "a");
    assert_eq!(second.members[0].gpus.len(), 2);
    assert!(
        second.members[0].epoch > first_epoch,
        "a new lease, a newer epoch"
    );
    for a in [first, second] {
        let (leased, started, ended) = (a.leased_at, a.started_at.unwrap(), a.ended_at.unwrap());
        assert!(leased <= started && started <= ended, "{a:?}");
    }
    assert!(first.ended_at <= Some(second.leased_at));
    assert_eq!(second.ended_at, job.finished_at);
}
