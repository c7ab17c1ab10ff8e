//! A node that goes silent while it runs a job: its lease expires and the job is requeued,
//! but it starts on no other node while its old container may still run there, until the
//! agent's fail-safe has surely stopped it (the lease TTL, then the job's grace period and a
//! margin) or the node reports the container gone; `restart_elsewhere_after_ms` trades that
//! wait away.

mod sim;

use nightshift_common::{JobRunState, JobState, LeaseView};
use nightshift_core::{CoreConfig, STRAGGLER_MARGIN_MS};
use sim::{Cluster, TICK_MS, config, spec};

/// Nodes `a` and `b`, a 4-GPU job running on one of them (returned), whose node then goes
/// silent until its lease has just expired.
fn silent_past_the_ttl(cfg: CoreConfig, grace_s: u32) -> (Cluster, LeaseView) {
    let ttl = cfg.lease_ttl_ms;
    let mut c = Cluster::new(cfg, &[("a", 4), ("b", 4)]);
    c.agent("a").jobs.durations.insert(1, 1_000);
    c.agent("b").jobs.durations.insert(1, 1_000);
    let mut job = spec("train", 4);
    job.checkpoint.grace_period_seconds = grace_s;
    c.core.submit(c.now, job).unwrap();
    c.run(8);
    let first = c.core.job(1).unwrap();
    assert_eq!(first.state, JobState::Running);
    let first = first.leases[0].clone();
    c.agent(&first.node).silent = true;
    // Until the lease, renewed by the node's last heartbeat, has expired.
    for _ in 0..ttl / TICK_MS + 3 {
        if c.core.job(1).unwrap().attempt > 1 {
            break;
        }
        c.run(1);
    }
    assert!(c.now >= first.expires_at);
    assert_eq!(c.core.job(1).unwrap().attempt, 2, "requeued");
    (c, first)
}

fn placed_on(c: &Cluster) -> Option<String> {
    let job = c.core.job(1).unwrap();
    job.leases.first().map(|l| l.node.clone())
}

#[test]
fn a_silent_nodes_job_waits_out_the_fail_safe_bound_before_starting_elsewhere() {
    let (mut c, first) = silent_past_the_ttl(config(0), 20);
    assert_eq!(c.core.job(1).unwrap().state, JobState::Queued);
    let expired_at = first.expires_at;
    let bound = expired_at + 20_000 + STRAGGLER_MARGIN_MS;
    assert_eq!(
        c.core.job(1).unwrap().not_before,
        Some(bound),
        "held until the grace period and the margin have passed after the lease expired"
    );
    assert_eq!(c.core.stragglers().count(), 1);
    let message = c.core.job(1).unwrap().message.unwrap_or_default();
    assert!(
        message.contains("went silent; held until its container there has surely stopped"),
        "{message}"
    );
    // Every step checks the invariants, "no job has two live containers" among them.
    while c.now + TICK_MS < bound {
        c.run(1);
        assert_eq!(
            placed_on(&c),
            None,
            "at {} ms after expiry: started while the old container may run",
            c.now - expired_at
        );
    }
    c.run(3);
    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Running, "placed once the bound passed");
    assert_ne!(job.leases[0].node, first.node);
    assert!(job.leases[0].epoch > first.epoch);
    assert_eq!(c.core.stragglers().count(), 0);
}

#[test]
fn a_silent_node_that_reports_the_container_gone_releases_its_job_at_once() {
    let (mut c, first) = silent_past_the_ttl(config(0), 600);
    let node = first.node.clone();
    c.run(3);
    assert_eq!(placed_on(&c), None);
    // The node comes back and has applied the state without the lease, but reports the old
    // container still running (the agent is stopping it): still held.
    let desired = c.core.desired(&node).unwrap();
    assert!(desired.leases.is_empty());
    let mut beat = c.agent(&node).heartbeat();
    assert_eq!(beat.jobs.len(), 1);
    beat.jobs[0].state = JobRunState::Stopping;
    beat.applied_version = desired.version;
    c.core.heartbeat(c.now, &node, beat.clone()).unwrap();
    c.core.tick(c.now + 1);
    c.assert_invariants();
    assert_eq!(placed_on(&c), None, "the old container still runs");
    // An agent that has not applied the release yet reports nothing authoritative.
    let mut stale = beat.clone();
    stale.jobs.clear();
    stale.applied_version = desired.version - 1;
    c.core.heartbeat(c.now + 2, &node, stale).unwrap();
    assert_eq!(placed_on(&c), None, "a report from before the release");
    // Then it reports the container gone: the job starts at once, long before its 600 s
    // grace period would have run out.
    let mut gone = beat;
    gone.jobs.clear();
    c.core.heartbeat(c.now + 3, &node, gone).unwrap();
    assert_eq!(c.core.stragglers().count(), 0);
    assert_eq!(c.core.job(1).unwrap().not_before, None, "released");
    c.agent(&node).silent = false;
    // Lending a node again takes the scale-down window (3 s) and the cooldown.
    c.run(10);
    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Running, "{job:?}");
    assert!(job.leases[0].epoch > first.epoch);
    assert_eq!(c.core.stragglers().count(), 0);
}

#[test]
fn restart_elsewhere_after_zero_places_the_job_at_once() {
    let cfg = CoreConfig {
        restart_elsewhere_after_ms: Some(0),
        ..config(0)
    };
    let (mut c, first) = silent_past_the_ttl(cfg, 30);
    assert_eq!(c.core.stragglers().count(), 0);
    c.run(2);
    let job = c.core.job(1).unwrap();
    assert_eq!(
        job.state,
        JobState::Running,
        "the operator chose not to wait"
    );
    assert_ne!(job.leases[0].node, first.node);
}

#[test]
fn restart_elsewhere_after_sets_the_wait() {
    let cfg = CoreConfig {
        restart_elsewhere_after_ms: Some(5_000),
        ..config(0)
    };
    let (mut c, _) = silent_past_the_ttl(cfg, 600);
    c.run(3);
    assert_eq!(placed_on(&c), None, "3 s of the 5 s");
    c.run(4);
    assert_eq!(c.core.job(1).unwrap().state, JobState::Running);
}
