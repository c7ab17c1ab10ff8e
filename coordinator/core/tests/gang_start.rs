//! A gang's members start together: each member's lease holds it back
//! (`Rendezvous::wait_for_peers`) until every member's agent has reported its image on its
//! host, a member whose pull fails fails the gang with no other member started, and a gang
//! whose members are not all ready in time gives its GPUs back. Single-node jobs never wait.

mod sim;

use nightshift_common::{JobRunState, JobState, NodeMode, ReplicaState};
use std::time::Duration;

use nightshift_core::CoreConfig;
use nightshift_hostmodel::Pull;
use sim::{Cluster, config, spec};

fn gang_on_two_nodes(config: CoreConfig) -> Cluster {
    let mut c = Cluster::new(config, &[("a", 4), ("b", 4)]);
    let now = c.now;
    c.agent("b").lack_image(Pull::Hangs, now);
    let mut gang = spec("gang", 4);
    gang.nodes = 2;
    c.core.submit(c.now, gang).unwrap();
    c
}

fn config0() -> CoreConfig {
    CoreConfig {
        gang_start_timeout_ms: 60_000,
        ..config(0)
    }
}

fn held(c: &Cluster, node: &str) -> Option<bool> {
    let desired = c.core.desired(node)?;
    let lease = desired.leases.first()?;
    Some(lease.rendezvous.as_ref()?.wait_for_peers)
}

fn running(c: &mut Cluster, node: &str) -> bool {
    c.agent(node)
        .runs()
        .iter()
        .any(|r| r.state == JobRunState::Running)
}

#[test]
fn a_gang_member_waits_serving_until_its_peer_has_its_image() {
    let mut c = gang_on_two_nodes(config0());
    for _ in 0..10 {
        c.run(1);
        assert!(
            !running(&mut c, "a") && !running(&mut c, "b"),
            "no member starts while b pulls"
        );
    }
    assert_eq!(c.core.job(1).unwrap().state, JobState::Starting);
    assert_eq!((held(&c, "a"), held(&c, "b")), (Some(true), Some(true)));
    assert_eq!(
        c.agent("a").replica(),
        ReplicaState::Serving,
        "a's replica serves on while its peer pulls"
    );
    assert!(
        c.core.leases().all(|l| l.ready == (l.node == "a")),
        "a reported ready, b not"
    );

    // The image arrives on b: both are told at once, and start.
    let now = c.now;
    c.agent("b").lack_image(Pull::Takes(Duration::ZERO), now);
    c.run(1);
    assert_eq!((held(&c, "a"), held(&c, "b")), (Some(false), Some(false)));
    c.run(3);
    assert!(running(&mut c, "a") && running(&mut c, "b"));
    assert_eq!(c.core.job(1).unwrap().state, JobState::Running);
}

#[test]
fn a_member_whose_pull_fails_fails_the_gang_before_any_member_starts() {
    let mut c = gang_on_two_nodes(config0());
    // b pulls for a while (a is ready meanwhile), then its pull fails.
    for _ in 0..5 {
        c.run(1);
        assert!(!running(&mut c, "a"), "a does not start while b pulls");
    }
    let now = c.now;
    c.agent("b")
        .lack_image(Pull::Fails(Duration::ZERO, "manifest unknown".into()), now);
    for _ in 0..10 {
        c.run(1);
        assert!(!running(&mut c, "a"), "a never starts its member");
    }
    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    assert_eq!(job.failures, 1);
    assert!(
        job.message.as_deref().unwrap_or("").contains("pulling"),
        "{job:?}"
    );
    assert!(job.leases.is_empty());
}

#[test]
fn a_gang_not_ready_within_its_start_timeout_gives_its_gpus_back() {
    let mut c = gang_on_two_nodes(config0());
    c.run(3);
    // a's node is lent already (say, idle before): it waits with free GPUs.
    assert_eq!(c.core.job(1).unwrap().state, JobState::Starting);
    assert_eq!(
        c.core.next_deadline().map(|d| d <= c.now + 60_000),
        Some(true)
    );
    c.run(62);
    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    let message = job.message.unwrap_or_default();
    assert!(
        message.contains("gang_start_timeout_s") && message.contains("node b"),
        "{message}"
    );
    assert!(!running(&mut c, "a") && !running(&mut c, "b"));
    assert!(c.core.leases().next().is_none(), "every lease given back");
    c.run(3);
    assert!(
        c.core
            .nodes(c.now)
            .iter()
            .all(|n| n.mode == NodeMode::Serve),
        "both nodes serve again"
    );
}

#[test]
fn a_single_node_job_is_never_held() {
    let mut c = Cluster::new(config0(), &[("a", 4)]);
    c.core.submit(c.now, spec("alone", 4)).unwrap();
    while c.core.desired("a").unwrap().leases.is_empty() {
        c.run(1);
    }
    let desired = c.core.desired("a").unwrap();
    assert!(
        desired.leases[0].rendezvous.is_none(),
        "nothing to wait for"
    );
    c.run(3);
    assert!(running(&mut c, "a"));
}

#[test]
fn a_restarted_coordinator_holds_a_waiting_gang_until_all_report_again() {
    let mut c = gang_on_two_nodes(config0());
    c.run(3);
    c.restart(config0());
    assert_eq!((held(&c, "a"), held(&c, "b")), (Some(true), Some(true)));
    c.run(3);
    assert!(!running(&mut c, "a"));
    let now = c.now;
    c.agent("b").lack_image(Pull::Takes(Duration::ZERO), now);
    c.run(4);
    assert!(running(&mut c, "a") && running(&mut c, "b"));
}
