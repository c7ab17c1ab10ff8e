//! Autoscaling scenarios: max replicas, headroom, KV-cache pressure, harvest windows and
//! predictive reclaim, each a small story on a simulated cluster with a controlled clock.

mod sim;

use nightshift_common::NodeMode;
use nightshift_core::{CoreConfig, HarvestWindow};
use sim::{Cluster, config, spec};

/// Monday 2026-11-30 00:00 UTC.
const MONDAY: u64 = 1_795_996_800_000;
const MIN: u64 = 60_000;
const HOUR: u64 = 60 * MIN;

fn lent(c: &Cluster) -> usize {
    c.core
        .nodes(c.now)
        .iter()
        .filter(|n| n.mode == NodeMode::Lend)
        .count()
}

fn queue_long_jobs(c: &mut Cluster, n: u64) {
    for _ in 0..n {
        let id = c.core.submit(c.now, spec("train", 4)).unwrap();
        for a in &mut c.agents {
            a.jobs.durations.insert(id, 1_000_000);
        }
    }
}

fn all_load(c: &mut Cluster, waiting: f64, running: f64) {
    let names: Vec<String> = c.agents.iter().map(|a| a.name.clone()).collect();
    for n in names {
        c.load(&n, waiting, running);
    }
}

#[test]
fn nodes_beyond_max_replicas_are_lent_whatever_the_load() {
    let mut cfg = config(1);
    cfg.services[0].max_replicas = Some(1);
    let mut c = Cluster::new(cfg, &[("a", 4), ("b", 4), ("c", 4)]);
    all_load(&mut c, 0.0, 6.0);
    queue_long_jobs(&mut c, 3);
    c.run(10);
    assert_eq!(lent(&c), 2, "busy, but two nodes are beyond max_replicas 1");
    // More load does not take them back: the service needs at most one replica.
    all_load(&mut c, 5.0, 7.0);
    c.run(3);
    assert_eq!(lent(&c), 2);
}

/// Replicas ready and serving, as the load balancer sees them.
fn ready(c: &Cluster) -> usize {
    c.agents
        .iter()
        .filter(|a| a.agent.ready() && c.core.desired(&a.name).is_some_and(|d| d.serve))
        .count()
}

#[test]
fn a_node_coming_back_is_not_traded_for_the_ready_replica_beyond_max_replicas() {
    let mut cfg = config(1);
    cfg.services[0].max_replicas = Some(1);
    let mut c = Cluster::new(cfg, &[("a", 4), ("b", 4), ("c", 4)]);
    // A model that takes 10 s to load.
    for a in &mut c.agents {
        a.host.timings.replica_start = std::time::Duration::from_secs(10);
    }
    queue_long_jobs(&mut c, 2);
    c.run(10);
    assert_eq!((lent(&c), ready(&c)), (2, 1));
    // One job is cancelled: its node, idle, goes back to serving and starts its replica.
    // Another job arrives while it loads. The one ready replica stays: only a replica
    // ready beyond max_replicas is lent, never the last one for one still loading.
    c.core.cancel(c.now, 1).unwrap();
    let coming_back = |c: &Cluster| {
        c.agents.iter().any(|a| {
            c.core.desired(&a.name).is_some_and(|d| d.serve)
                && a.replica() == nightshift_common::ReplicaState::Starting
        })
    };
    for _ in 0..10 {
        if coming_back(&c) {
            break;
        }
        c.run(1);
    }
    assert!(coming_back(&c), "the idle node's replica loads");
    queue_long_jobs(&mut c, 1);
    for _ in 0..20 {
        c.run(1);
        assert!(ready(&c) >= 1, "at {}: no ready replica", c.now);
    }
    assert_eq!(
        (lent(&c), ready(&c)),
        (2, 1),
        "lent again once it was ready"
    );
}

#[test]
fn headroom_keeps_spare_replicas_serving() {
    for (headroom, expect) in [(0, 2), (1, 1)] {
        let mut cfg = config(0);
        cfg.services[0].headroom = headroom;
        let mut c = Cluster::new(cfg, &[("a", 4), ("b", 4)]);
        queue_long_jobs(&mut c, 2);
        c.run(20);
        assert_eq!(lent(&c), expect, "headroom {headroom}");
    }
}

#[test]
fn a_full_kv_cache_takes_a_node_back() {
    let mut c = Cluster::new(config(1), &[("a", 4), ("b", 4)]);
    queue_long_jobs(&mut c, 1);
    c.run(10);
    assert_eq!(lent(&c), 1);
    let serving = c
        .core
        .nodes(c.now)
        .into_iter()
        .find(|n| n.mode == NodeMode::Serve)
        .unwrap()
        .name;
    c.agent(&serving).signals.kv_cache_usage = Some(0.95);
    c.run(1);
    assert_eq!(
        lent(&c),
        0,
        "KV cache at 95% is pressure even with no queue"
    );
}

#[test]
fn lending_happens_only_inside_the_harvest_window_and_ends_before_it_closes() {
    let mut cfg = config(1);
    cfg.services[0].harvest_windows = vec!["daily 20:00-08:00".parse::<HarvestWindow>().unwrap()];
    cfg.services[0].default_reclaim_lead_ms = 30 * MIN;
    // The clock jumps minutes at a time: nodes must not count as silent meanwhile.
    cfg.lease_ttl_ms = HOUR;
    let mut c = Cluster::new_at(cfg, &[("a", 4), ("b", 4)], MONDAY + 12 * HOUR);
    queue_long_jobs(&mut c, 1);
    c.run(30);
    assert_eq!(lent(&c), 0, "noon: outside the window");
    while c.now < MONDAY + 20 * HOUR + MIN {
        c.jump(15 * MIN);
    }
    c.run(10);
    assert_eq!(lent(&c), 1, "20:00: the window is open");
    while c.now < MONDAY + 31 * HOUR + 25 * MIN {
        c.jump(5 * MIN);
    }
    assert_eq!(
        lent(&c),
        1,
        "07:25 Tuesday: still inside, more than the lead before the end"
    );
    c.jump(10 * MIN);
    assert_eq!(
        lent(&c),
        0,
        "07:35: within the 30-minute lead of 08:00, the node went back"
    );
}

/// Monday: quiet nights, 24 requests running from 08:00 to 20:00. Tuesday night: two nodes
/// lent. Returns the cluster at Tuesday 07:40.
fn learn_a_day_then_lend(predictive: bool) -> Cluster {
    let mut cfg: CoreConfig = config(1);
    cfg.services[0].predictive = predictive;
    cfg.services[0].default_reclaim_lead_ms = 15 * MIN;
    cfg.lease_ttl_ms = HOUR;
    let mut c = Cluster::new_at(cfg, &[("a", 4), ("b", 4), ("c", 4)], MONDAY);
    while c.now < MONDAY + 24 * HOUR {
        let hour = (c.now - MONDAY) / HOUR;
        let running = if (8..20).contains(&hour) { 8.0 } else { 0.0 };
        all_load(&mut c, 0.0, running);
        c.jump(5 * MIN);
    }
    all_load(&mut c, 0.0, 0.0);
    queue_long_jobs(&mut c, 2);
    while c.now < MONDAY + 31 * HOUR + 40 * MIN {
        c.jump(5 * MIN);
    }
    c
}

#[test]
fn the_learned_profile_takes_nodes_back_before_the_morning_ramp() {
    let mut c = learn_a_day_then_lend(true);
    assert_eq!(
        lent(&c),
        2,
        "07:40: the ramp is more than the 15-minute lead away"
    );
    c.jump(10 * MIN);
    assert_eq!(
        lent(&c),
        0,
        "07:50: yesterday's 08:00 ramp needs 3 replicas; all back with no load yet"
    );

    let mut reactive = learn_a_day_then_lend(false);
    reactive.jump(10 * MIN);
    assert_eq!(
        lent(&reactive),
        2,
        "without prediction the nodes stay lent until the load arrives"
    );
}

#[test]
fn time_to_first_token_takes_a_node_back_and_keeps_it_from_being_lent() {
    let mut cfg = config(1);
    cfg.services[0].scale_up.ttft_p95_s = Some(2.0);
    let mut c = Cluster::new(cfg, &[("a", 4), ("b", 4)]);
    for a in &mut c.agents {
        a.signals.ttft_p95_s = Some(1.5);
    }
    queue_long_jobs(&mut c, 1);
    c.run(10);
    assert_eq!(
        lent(&c),
        0,
        "TTFT p95 1.5 s is above half the 2 s limit: not low enough to lend"
    );
    for a in &mut c.agents {
        a.signals.ttft_p95_s = Some(0.4);
    }
    c.run(10);
    assert_eq!(lent(&c), 1);
    let serving = c
        .core
        .nodes(c.now)
        .into_iter()
        .find(|n| n.mode == NodeMode::Serve)
        .unwrap()
        .name;
    c.agent(&serving).signals.ttft_p95_s = Some(2.5);
    c.run(1);
    assert_eq!(
        lent(&c),
        0,
        "TTFT p95 over the limit takes the node back with no queue"
    );
}

#[test]
fn spare_replicas_are_lent_together_for_the_queued_jobs() {
    let mut c = Cluster::new(config(1), &[("a", 4), ("b", 4), ("c", 4), ("d", 4)]);
    queue_long_jobs(&mut c, 2);
    let mut steps = 0;
    while lent(&c) == 0 && steps < 30 {
        c.run(1);
        steps += 1;
    }
    assert_eq!(
        lent(&c),
        2,
        "both queued jobs get a node in the same decision, not one per cooldown"
    );
}

#[test]
fn a_surge_takes_back_as_many_nodes_as_it_needs_at_once() {
    let mut c = Cluster::new(config(1), &[("a", 4), ("b", 4), ("c", 4), ("d", 4)]);
    queue_long_jobs(&mut c, 3);
    c.run(20);
    assert_eq!(lent(&c), 3);
    let serving = c
        .core
        .nodes(c.now)
        .into_iter()
        .find(|n| n.mode == NodeMode::Serve)
        .unwrap()
        .name;
    // 30 requests on one replica sized for 8: four replicas' worth.
    c.load(&serving, 0.0, 30.0);
    c.run(1);
    assert_eq!(lent(&c), 0, "three nodes back in one decision");
}
