//! An unhealthy GPU end to end, against the real Docker engine: the agent's fake GPU 1 gets a
//! critical XID event, the heartbeat carries the verdict, the coordinator never leases that
//! GPU, and the node view and `nightshift nodes` say why.

use std::sync::Arc;
use std::time::Duration;

use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_cli::client::Client;
use nightshift_common::{JobState, NodeView};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(90);
const XID_79: &str = "xid 79: the gpu has fallen off the bus";

async fn node_view(client: &Client, node: &str) -> Option<NodeView> {
    client
        .nodes()
        .await
        .ok()?
        .nodes
        .into_iter()
        .find(|n| n.name == node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_with_a_critical_xid_is_never_leased_and_the_node_says_why() {
    init_tracing();
    require_images();
    let node = unique_node("xid");
    let gpus = Arc::new(FakeGpus::new(&node, 4));
    gpus.inject_xid(1, 79).unwrap();
    gpus.inject_xid(2, 13).unwrap(); // an application XID: GPU 2 stays healthy
    let one = OneNode::with_gpus(node.clone(), Arc::clone(&gpus)).await;
    let (client, _coordinator) = (&one.client, &one.coordinator);

    let view = wait_for("the node to report its gpus", STARTUP, || async {
        node_view(client, &node)
            .await
            .filter(|n| n.gpus.iter().all(|g| g.healthy.is_some()))
    })
    .await;
    let health: Vec<_> = view
        .gpus
        .iter()
        .map(|g| (g.index, g.healthy, g.unhealthy_reason.as_deref()))
        .collect();
    assert_eq!(
        health,
        [
            (0, Some(true), None),
            (1, Some(false), Some(XID_79)),
            (2, Some(true), None),
            (3, Some(true), None),
        ]
    );
    let table = nightshift_cli::cli::render_nodes(std::slice::from_ref(&view), 0);
    assert!(
        table.contains(&format!("{node} gpu 1 unhealthy, not leased: {XID_79}")),
        "{table}"
    );

    // Three GPUs are healthy: a 3-GPU job runs on exactly those.
    let job = client
        .submit(&trainer_job("three", 3, 1_000_000, 20, 100))
        .await
        .unwrap()
        .id;
    let view = wait_for("the job to run", STARTUP, || async {
        client
            .job(job)
            .await
            .ok()
            .filter(|j| j.state == JobState::Running)
    })
    .await;
    assert_eq!(view.leases.len(), 1);
    assert_eq!(view.leases[0].gpus, [0, 2, 3]);
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 1, "one job container on the node: {jobs:?}");
    let env = docker_inspect(&jobs[0].0)["Config"]["Env"].clone();
    assert!(
        env.as_array()
            .is_some_and(|e| e.iter().any(|v| v == "NVIDIA_VISIBLE_DEVICES=0,2,3")),
        "the container is given exactly the healthy GPUs: {env}"
    );
}
