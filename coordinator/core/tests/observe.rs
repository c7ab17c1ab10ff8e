//! Heartbeats observed without a decision, as the coordinator's shell batches them: a report
//! that changes nothing the decisions read leaves nothing to decide, one that does waits for
//! the next tick.

mod sim;

use sim::{Cluster, config};

#[test]
fn an_unchanged_report_leaves_nothing_to_decide_and_a_changed_one_waits_for_the_tick() {
    let mut c = Cluster::new(config(1), &[("a", 4), ("b", 4)]);
    c.load("a", 0.0, 2.0);
    c.load("b", 0.0, 2.0);
    c.run(5);

    let beat = c.agent("a").heartbeat();
    c.core.observe(c.now, "a", beat).unwrap();
    assert!(!c.core.decision_pending(), "nothing new in the report");

    c.load("a", 9.0, 2.0);
    let beat = c.agent("a").heartbeat();
    c.core.observe(c.now, "a", beat).unwrap();
    assert!(c.core.decision_pending(), "the waiting requests changed");
    c.core.tick(c.now);
    assert!(!c.core.decision_pending());
    assert_eq!(c.core.decided_at(), Some(c.now));
}

#[test]
fn an_enrolled_node_waits_for_the_tick_to_be_decided_on() {
    let mut c = Cluster::new(config(1), &[("a", 4)]);
    c.run(5);
    assert!(!c.core.decision_pending());
    let decided = c.core.decided_at();

    c.now += 1;
    let newcomer = sim::SimAgent::new("b", 4, c.now);
    c.core
        .enroll(c.now, "b", "llm", newcomer.host.inventory(), None)
        .unwrap();
    assert!(c.core.node("b").is_some(), "the node is known at once");
    assert!(c.core.decision_pending(), "a new node may change decisions");
    assert_eq!(c.core.decided_at(), decided, "enrolling decides nothing");
    c.core.tick(c.now);
    assert!(!c.core.decision_pending());
    assert_eq!(c.core.decided_at(), Some(c.now));

    // `register` (enroll, then decide) decides at once.
    c.now += 1;
    c.core
        .register(c.now, "b", "llm", newcomer.host.inventory())
        .unwrap();
    assert_eq!(c.core.decided_at(), Some(c.now));
}
