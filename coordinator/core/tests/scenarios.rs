//! Decision scenarios: a small cluster, a story of load and jobs, and the decisions expected
//! at each point, checked against the invariants after every step.

mod sim;

use nightshift_common::{JobState, NodeMode};
use nightshift_core::{Core, CoreSnapshot, Effect, Violation};
use sim::{Cluster, TICK_MS, config, spec, states};

fn modes(c: &Cluster) -> String {
    c.core
        .nodes(c.now)
        .iter()
        .map(|n| format!("{}={:?}", n.name, n.mode))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One 4-GPU node `a` and one job, `train` on `gpus` GPUs, that runs `run_s` seconds once
/// started: the setup most scenarios start from.
fn node_a_with_train(gpus: u32, run_s: u32) -> Cluster {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, run_s);
    c.core.submit(c.now, spec("train", gpus)).unwrap();
    c
}

#[test]
fn idle_replica_is_lent_only_after_the_window_and_only_for_a_queued_job() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, 100);
    c.run(10);
    assert_eq!(modes(&c), "a=Serve", "nothing queued: nothing lent");
    c.load("a", 0.0, 1.0);
    c.run(1);
    c.core.submit(c.now, spec("train", 4)).unwrap();
    c.run(10);
    assert_eq!(
        modes(&c),
        "a=Serve",
        "a request still runs and no replica would remain"
    );
    c.load("a", 0.0, 0.0);
    c.run(2);
    assert_eq!(modes(&c), "a=Serve", "the 3 s window has not passed");
    c.run(6);
    assert_eq!(modes(&c), "a=Lend");
    assert_eq!(states(&c), "1:running#1");
}

#[test]
fn surge_reclaims_the_node_and_the_job_is_requeued_then_resumes() {
    let mut c = node_a_with_train(4, 30);
    c.run(10);
    assert_eq!(
        (modes(&c), states(&c)),
        ("a=Lend".into(), "1:running#1".into())
    );
    // The replica is down, so the surge shows at the gateway.
    c.core.gateway(c.now, "llm", 12).unwrap();
    assert_eq!(modes(&c), "a=Serve", "reclaim is immediate");
    assert_eq!(states(&c), "1:preempting#1");
    c.run(3);
    assert_eq!(states(&c), "1:queued#2");
    assert!(c.core.node("a").unwrap().replica_serving());
    // Load stays high: no lending while the gateway signal is fresh or the replica busy.
    c.load("a", 5.0, 6.0);
    c.run(10);
    assert_eq!(modes(&c), "a=Serve");
    c.load("a", 0.0, 0.0);
    c.run(8);
    assert_eq!(
        (modes(&c), states(&c)),
        ("a=Lend".into(), "1:running#2".into())
    );
    c.run(40);
    assert_eq!(
        modes(&c),
        "a=Serve",
        "the job finished and the node came back"
    );
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.preemptions),
        (JobState::Succeeded, 2, 1)
    );
}

#[test]
fn serving_floor_keeps_min_replicas_serving() {
    let mut c = Cluster::new(config(1), &[("a", 4), ("b", 4)]);
    c.core.submit(c.now, spec("one", 4)).unwrap();
    c.core.submit(c.now, spec("two", 4)).unwrap();
    c.agent("a").jobs.durations.insert(1, 100);
    c.agent("b").jobs.durations.insert(1, 100);
    c.run(20);
    let lent = c
        .core
        .nodes(c.now)
        .iter()
        .filter(|n| n.mode == NodeMode::Lend)
        .count();
    assert_eq!(lent, 1, "{}", modes(&c));
    assert_eq!(states(&c), "1:running#1 2:queued#1");
}

#[test]
fn waiting_per_replica_over_threshold_takes_a_node_back() {
    let mut c = Cluster::new(config(1), &[("a", 4), ("b", 4)]);
    c.agent("a").jobs.durations.insert(1, 100);
    c.agent("b").jobs.durations.insert(1, 100);
    c.core.submit(c.now, spec("one", 2)).unwrap();
    c.run(10);
    assert_eq!(states(&c), "1:running#1");
    let serving = c
        .core
        .nodes(c.now)
        .into_iter()
        .find(|n| n.mode == NodeMode::Serve)
        .unwrap();
    c.load(&serving.name, 3.0, 1.0);
    c.run(1);
    assert_eq!(modes(&c), "a=Serve b=Serve");
    assert_eq!(states(&c), "1:preempting#1");
}

#[test]
fn silent_node_loses_its_lease_and_the_job_runs_elsewhere() {
    let mut c = Cluster::new(config(0), &[("a", 4), ("b", 4)]);
    c.agent("a").jobs.durations.insert(1, 100);
    c.agent("b").jobs.durations.insert(1, 100);
    c.core.submit(c.now, spec("train", 4)).unwrap();
    c.run(8);
    let first = c.core.job(1).unwrap().leases[0].clone();
    c.agent(&first.node).silent = true;
    // The lease TTL (5 s), then the job's grace period (30 s) and the margin: the old
    // container has surely been stopped by the node's fail-safe (tests/silent_node.rs).
    c.run(52);
    let job = c.core.job(1).unwrap();
    let second = job.leases[0].clone();
    assert_ne!(second.node, first.node);
    assert!(
        second.epoch > first.epoch,
        "a new lease is fenced above the old one"
    );
    assert_eq!((job.state, job.attempt), (JobState::Running, 2));
    // The silent node comes back: its leftover container is stopped, never run twice.
    c.agent(&first.node).silent = false;
    c.run(5);
    assert_eq!(c.core.job(1).unwrap().leases[0].node, second.node);
}

#[test]
fn bad_submissions_are_refused_and_change_nothing() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    let err = c.core.submit(c.now, spec("big", 8)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "gpus: 8 is more than any node has (the largest has 4)"
    );
    assert_eq!(err.field(), Some("gpus"));
    let mut empty = spec("x", 1);
    empty.image = String::new();
    assert_eq!(
        c.core.submit(c.now, empty).unwrap_err().field(),
        Some("image")
    );
    assert!(c.core.jobs().is_empty());
    assert!(
        c.core
            .poll_effects()
            .iter()
            .all(|e| !matches!(e, Effect::JobChanged(_)))
    );
}

#[test]
fn cancel_stops_a_running_job_and_frees_the_node() {
    let mut c = node_a_with_train(2, 100);
    c.run(8);
    assert_eq!(states(&c), "1:running#1");
    c.core.cancel(c.now, 1).unwrap();
    c.run(3);
    assert_eq!(states(&c), "1:cancelled#1");
    assert_eq!(modes(&c), "a=Serve");
    assert_eq!(
        c.core.cancel(c.now, 1).unwrap_err().to_string(),
        "job 1 is already cancelled"
    );
}

#[test]
fn restore_keeps_every_job_and_lease_and_fencing_continues_upwards() {
    let mut c = node_a_with_train(2, 100);
    c.core.submit(c.now, spec("later", 4)).unwrap();
    c.run(8);
    let before = c.core.jobs();
    let restored = Core::restore(config(0), c.snapshot(), c.now);
    let after = restored.jobs();
    assert_eq!(after.len(), 2);
    for (b, a) in before.iter().zip(&after) {
        assert_eq!((b.id, b.state, b.attempt), (a.id, a.state, a.attempt));
        let epochs = |v: &nightshift_common::JobView| {
            v.leases
                .iter()
                .map(|l| (l.lease_id, l.epoch, l.rank))
                .collect::<Vec<_>>()
        };
        assert_eq!(epochs(b), epochs(a));
    }
    assert_eq!(restored.next_ids(), c.core.next_ids());
    assert_eq!(
        restored.desired("a").unwrap().leases,
        c.core.desired("a").unwrap().leases
    );
    assert_eq!(restored.check_invariants(), vec![]);
    c.core = restored;
    c.run(10);
}

/// A core restored on a clock an hour behind the one that saved it (a stepped wall clock, a
/// standby's skewed one) gives every lease one TTL from its own now, not the saved expiry an
/// hour ahead: a node that never reports again loses its lease after a TTL.
#[test]
fn a_restore_on_a_clock_behind_renews_leases_for_one_ttl_only() {
    let mut c = node_a_with_train(2, 100);
    c.run(8);
    let saved_ahead = {
        let mut s = c.snapshot();
        for job in &mut s.jobs {
            for l in &mut job.leases {
                l.expires_at += 3_600_000;
            }
        }
        s
    };
    assert!(saved_ahead.jobs.iter().any(|j| !j.leases.is_empty()));
    let restored = Core::restore(config(0), saved_ahead, c.now);
    let ttl = restored.config().lease_ttl_ms;
    for job in restored.jobs() {
        for l in &job.leases {
            assert_eq!(l.expires_at, c.now + ttl, "job {}: {l:?}", job.id);
        }
    }
}

#[test]
fn leases_restored_for_a_node_not_yet_known_are_its_own_once_it_registers() {
    let mut c = node_a_with_train(2, 100);
    c.run(8);
    let (next_job_id, next_lease_id, next_epoch) = c.core.next_ids();
    let jobs = c.core.jobs();
    assert!(
        jobs.iter().any(|j| !j.leases.is_empty()),
        "a lease to restore"
    );
    // The persisted state lost the node but kept the job's lease on it.
    let snapshot = CoreSnapshot {
        jobs,
        nodes: Vec::new(),
        next_job_id,
        next_lease_id,
        next_epoch,
        profiles: Vec::new(),
    };
    let mut restored = Core::restore(config(0), snapshot, c.now);
    let inventory = c.agent("a").host.inventory();
    restored.register(c.now, "a", "llm", inventory).unwrap();
    // (The node comes back serving under a live lease, which the checks report too: the
    // state it was persisted in was already broken.)
    let counts: Vec<_> = restored
        .check_invariants()
        .into_iter()
        .filter(|v| matches!(v, Violation::HeldMismatch { .. }))
        .collect();
    assert_eq!(counts, vec![]);
}

#[test]
fn a_job_past_its_run_time_is_stopped_and_fails_without_retry_and_preempted_time_is_free() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, 1_000);
    let mut job = spec("train", 4);
    job.max_run_seconds = Some(20);
    job.retry.limit = 3;
    c.core.submit(c.now, job).unwrap();
    c.run(10);
    assert_eq!(states(&c), "1:running#1");
    let first = c.core.job(1).unwrap();
    assert!(first.ran_ms == 0 && first.attempt_started_at.is_some());

    // A reclaim: the time it waits does not count against its limit.
    c.core.gateway(c.now, "llm", 12).unwrap();
    c.run(3);
    assert_eq!(states(&c), "1:queued#2");
    let ran_first = c.core.job(1).unwrap().ran_ms;
    assert!(
        (1_000..20_000).contains(&ran_first),
        "the first attempt ran {ran_first} ms"
    );
    c.load("a", 5.0, 6.0);
    c.run(30);
    assert_eq!(
        states(&c),
        "1:queued#2",
        "30 s queued, still within its limit"
    );
    c.load("a", 0.0, 0.0);
    c.run(8);
    assert_eq!(states(&c), "1:running#2");

    // It is stopped once the two attempts together reach 20 s, and is not retried.
    let restarted = c.now;
    let stopped = loop {
        c.run(1);
        let j = c.core.job(1).unwrap();
        if j.state != JobState::Running {
            break j;
        }
        assert!(c.now - restarted <= 25_000, "never stopped: {j:?}");
    };
    assert_eq!(stopped.state, JobState::Failing);
    assert!(stopped.timed_out);
    assert!(stopped.leases.iter().all(|l| l.revoked), "{stopped:?}");
    assert_eq!(
        stopped.message.as_deref(),
        Some("stopped after running 20 s, its limit (maxRunSeconds: 20)")
    );
    c.run(5);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.failures),
        (JobState::Failed, 2, 1),
        "{job:?}"
    );
    assert!(
        (20_000..23_000).contains(&job.ran_ms),
        "ran {} ms in all",
        job.ran_ms
    );
    assert_eq!(modes(&c), "a=Serve", "its node went back to serving");

    // A restart keeps what it ran and why it stopped.
    let snapshot = CoreSnapshot {
        jobs: c.core.jobs(),
        ..CoreSnapshot::default()
    };
    let restored = Core::restore(config(0), snapshot, c.now);
    assert_eq!(restored.job(1).unwrap(), job);
}

/// Steps until `states` reads `want`, for at most `steps` steps.
fn step_until(c: &mut Cluster, want: &str, steps: usize) {
    for _ in 0..steps {
        if states(c) == want {
            return;
        }
        c.run(1);
    }
    assert_eq!(states(c), want, "never reached within {steps} steps");
}

#[test]
fn a_lease_taken_back_before_its_container_started_is_no_attempt_and_no_preemption() {
    let mut c = node_a_with_train(4, 30);
    // Leased, the replica still draining: the agent reports the lease pending, no container.
    step_until(&mut c, "1:starting#1", 20);
    let granted = c.core.desired("a").unwrap().leases[0].clone();
    assert_eq!(granted.attempt, 1);
    c.core.gateway(c.now, "llm", 12).unwrap();
    assert_eq!(states(&c), "1:preempting#1");
    c.run(3);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.preemptions, job.failures),
        (JobState::Queued, 1, 0, 0),
        "{job:?}"
    );
    assert!(
        job.message
            .as_deref()
            .is_some_and(|m| m.starts_with("requeued before its container started")),
        "{job:?}"
    );
    // Lent again, it runs as attempt 1.
    c.load("a", 0.0, 0.0);
    step_until(&mut c, "1:running#1", 30);
    assert_eq!(c.core.desired("a").unwrap().leases[0].attempt, 1);
    c.run(40);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.preemptions),
        (JobState::Succeeded, 1, 0)
    );
}

#[test]
fn a_lease_taken_back_after_its_container_ran_is_still_a_preemption() {
    let mut c = node_a_with_train(4, 30);
    step_until(&mut c, "1:running#1", 20);
    c.core.gateway(c.now, "llm", 12).unwrap();
    c.run(3);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.preemptions),
        (JobState::Queued, 2, 1)
    );
}

#[test]
fn a_job_its_host_refuses_waits_its_backoff_without_a_failure() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").short_of_space = true;
    let mut job = spec("big-checkpoints", 4);
    job.retry.limit = 0;
    c.core.submit(c.now, job).unwrap();
    step_until(&mut c, "1:starting#1", 20);
    c.run(1);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.attempt, job.failures, job.preemptions),
        (JobState::Queued, 1, 0, 0),
        "no failure, no preemption: {job:?}"
    );
    assert!(
        job.message
            .as_deref()
            .is_some_and(|m| m.contains("refused by node a") && m.contains("below the floor")),
        "{job:?}"
    );
    // Not asked again before its retry backoff (10 s by default) from the heartbeat that
    // reported the refusal, one tick ago...
    let refused_at = c.now - TICK_MS;
    while c.now < refused_at + 10_000 {
        assert_eq!(states(&c), "1:queued#1", "at {} ms", c.now - refused_at);
        c.run(1);
    }
    // ...then placed again, and started now that the host has room.
    c.agent("a").short_of_space = false;
    step_until(&mut c, "1:running#1", 10);
    assert_eq!(c.core.job(1).unwrap().failures, 0);
}

#[test]
fn a_member_that_cannot_start_fails_its_attempt_even_while_preempted() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    let mut job = spec("bad", 4);
    job.retry.limit = 0;
    c.core.submit(c.now, job).unwrap();
    step_until(&mut c, "1:starting#1", 20);
    let lease = c.core.desired("a").unwrap().leases[0].clone();
    // The node is taken back before the agent's report of the failed start arrives.
    c.core.gateway(c.now, "llm", 12).unwrap();
    assert_eq!(states(&c), "1:preempting#1");
    let mut beat = c.agent("a").heartbeat();
    beat.jobs = vec![nightshift_common::JobRun {
        job_id: 1,
        attempt: 1,
        lease_id: lease.lease_id,
        epoch: lease.epoch,
        gpus: lease.gpus.clone(),
        state: nightshift_common::JobRunState::FailedToStart {
            message: "the container engine refused container x: not a directory".into(),
            refused_by_host: false,
        },
        last_checkpoint_at: None,
        outputs: Default::default(),
        image_id: None,
        image_digest: None,
        ready: false,
    }];
    c.core.heartbeat(c.now, "a", beat).unwrap();
    c.assert_invariants();
    let job = c.core.job(1).unwrap();
    assert_eq!(
        (job.state, job.failures, job.preemptions),
        (JobState::Failed, 1, 0),
        "a failure, not a preemption: {job:?}"
    );
    assert!(
        job.message
            .as_deref()
            .is_some_and(|m| m.contains("not a directory")),
        "{job:?}"
    );
}
