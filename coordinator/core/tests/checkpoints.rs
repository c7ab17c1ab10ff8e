//! Where a job's next attempt goes when only one node holds its checkpoint (local storage):
//! back to that node when it can take the job, elsewhere (from nothing) when it cannot; and
//! no preference at all when checkpoints are on shared storage or in a bucket.

mod sim;

use nightshift_common::{CheckpointStorage, JobState};
use sim::{Cluster, config, spec, states};

/// Where each job's current lease is, by job id: `1@a 2@b`.
fn placed(c: &Cluster) -> String {
    c.core
        .jobs()
        .iter()
        .filter_map(|j| Some(format!("{}@{}", j.id, j.leases.first()?.node)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Job 1 (1 GPU) runs on `a` with a checkpoint there; job 3 (2 GPUs) runs on `b`, which so
/// has 2 GPUs free; `a` has 3 free once job 2 (3 GPUs, short) is done. Best fit would put
/// job 1's next attempt on `b`.
fn one_job_with_a_checkpoint_on_a(storage: CheckpointStorage) -> Cluster {
    let mut c = Cluster::new(config(0), &[("a", 4), ("b", 4)]);
    for a in &mut c.agents {
        a.jobs.durations.extend([(1, 1_000), (2, 10), (3, 1_000)]);
        a.store_checkpoints(storage);
    }
    c.core.submit(c.now, spec("resumes", 1)).unwrap();
    c.run(8);
    assert_eq!(placed(&c), "1@a");
    let now = c.now;
    c.agent("a").jobs.checkpoints.insert(1, now);
    c.core.submit(c.now, spec("short", 3)).unwrap();
    c.run(2);
    c.core.submit(c.now, spec("other", 2)).unwrap();
    c.run(10);
    assert_eq!(placed(&c), "1@a 3@b");
    assert_eq!(states(&c), "1:running#1 2:succeeded#1 3:running#1");
    c
}

/// Job 1's container on `a` is stopped under it (as a reclaim would, but `a` stays lent):
/// the job is requeued as preempted and placed again within the step.
fn lose_job_1_on_a(c: &mut Cluster) {
    let now = c.now;
    c.agent("a").restart_engine(now);
    c.run(3);
}

#[test]
fn the_next_attempt_goes_back_to_the_node_holding_the_checkpoint_over_best_fit() {
    let mut c = one_job_with_a_checkpoint_on_a(CheckpointStorage::Local);
    lose_job_1_on_a(&mut c);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.preemptions),
        (JobState::Running, 2, 1)
    );
    assert_eq!(
        placed(&c),
        "1@a 3@b",
        "a holds the checkpoint; best fit would say b"
    );
}

#[test]
fn with_shared_storage_any_node_resumes_so_best_fit_places_it() {
    let mut c = one_job_with_a_checkpoint_on_a(CheckpointStorage::Shared);
    lose_job_1_on_a(&mut c);
    assert_eq!(c.core.job(1).unwrap().attempt, 2);
    assert_eq!(placed(&c), "1@b 3@b");
    assert!(c.core.node_snapshot("a").unwrap().checkpoints.is_empty());
}

#[test]
fn with_object_storage_any_node_resumes_so_best_fit_places_it() {
    let mut c = one_job_with_a_checkpoint_on_a(CheckpointStorage::Object);
    lose_job_1_on_a(&mut c);
    assert_eq!(c.core.job(1).unwrap().attempt, 2);
    assert_eq!(
        placed(&c),
        "1@b 3@b",
        "no preference for a: every node reaches the bucket"
    );
    assert!(c.core.node_snapshot("a").unwrap().checkpoints.is_empty());
}

#[test]
fn a_restarted_core_still_prefers_the_node_holding_the_checkpoint() {
    let mut c = one_job_with_a_checkpoint_on_a(CheckpointStorage::Local);
    let held = c.core.node_snapshot("a").unwrap().checkpoints;
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].0, 1, "a holds job 1's checkpoint");
    assert!(c.core.node_snapshot("b").unwrap().checkpoints.is_empty());
    c.restart(config(0));
    assert_eq!(c.core.node_snapshot("a").unwrap().checkpoints, held);
    c.run(2);
    lose_job_1_on_a(&mut c);
    assert_eq!(placed(&c), "1@a 3@b");
}

#[test]
fn when_the_node_holding_it_cannot_take_the_job_it_runs_elsewhere_and_its_checkpoint_moves() {
    let mut c = one_job_with_a_checkpoint_on_a(CheckpointStorage::Local);
    let first = c.core.job(1).unwrap().leases[0].clone();
    // a falls silent: its lease expires, and a is no node to place on.
    c.agent("a").silent = true;
    c.run(52);
    let job = c.core.job(1).unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Running, 2));
    assert_eq!(job.leases[0].node, "b", "placed elsewhere, from nothing");
    assert_eq!(
        c.core.node_snapshot("a").unwrap().checkpoints,
        vec![(1, first.epoch)],
        "until the new attempt checkpoints, a still holds the newest"
    );
    // The attempt on b checkpoints: b holds the newest now, a nothing, even when a comes
    // back and its stale attempt reports its own.
    let second = job.leases[0].epoch;
    let now = c.now;
    c.agent("b").jobs.checkpoints.insert(1, now);
    c.agent("a").silent = false;
    c.run(3);
    assert_eq!(
        c.core.node_snapshot("b").unwrap().checkpoints,
        vec![(1, second)]
    );
    assert!(c.core.node_snapshot("a").unwrap().checkpoints.is_empty());
}

#[test]
fn a_finished_job_is_preferred_nowhere() {
    let mut c = one_job_with_a_checkpoint_on_a(CheckpointStorage::Local);
    c.core.cancel(c.now, 1).unwrap();
    c.run(5);
    assert_eq!(c.core.job(1).unwrap().state, JobState::Cancelled);
    assert!(c.core.node_snapshot("a").unwrap().checkpoints.is_empty());
}

/// Job 1 (1 GPU) ran on `b` (a's GPUs were unhealthy then) and left a checkpoint there; a
/// surge takes `b` back, and once the load is gone one node is lent again: `a` comes first
/// in lending order, `b` holds the checkpoint.
fn reclaimed_from_b_then_lent_again(storage: CheckpointStorage) -> Cluster {
    let mut c = Cluster::new(config(0), &[("a", 4), ("b", 4)]);
    for a in &mut c.agents {
        a.jobs.durations.insert(1, 1_000);
        a.store_checkpoints(storage);
    }
    for g in 0..4 {
        c.agent("a").host.unhealthy.insert(g, "xid 79".into());
    }
    c.core.submit(c.now, spec("resumes", 1)).unwrap();
    c.run(8);
    assert_eq!(placed(&c), "1@b");
    let now = c.now;
    c.agent("b").jobs.checkpoints.insert(1, now);
    c.agent("a").host.unhealthy.clear();
    c.run(2);
    c.core.gateway(c.now, "llm", 12).unwrap();
    c.run(3);
    assert_eq!(states(&c), "1:queued#2");
    c.run(12);
    assert_eq!(states(&c), "1:running#2");
    c
}

#[test]
fn lending_lends_the_node_holding_the_checkpoint_before_the_first_in_its_order() {
    let c = reclaimed_from_b_then_lent_again(CheckpointStorage::Local);
    assert_eq!(placed(&c), "1@b");
}

#[test]
fn with_shared_storage_lending_keeps_its_order() {
    let c = reclaimed_from_b_then_lent_again(CheckpointStorage::Shared);
    assert_eq!(placed(&c), "1@a");
}
