//! A coordinator and an agent together, against the real Docker engine: restarts of either
//! side lose nothing and duplicate nothing.

use std::time::Duration;

use nightshift_cli::client::Client;
use nightshift_common::{JobState, ReplicaState};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(60);

async fn replica_state(client: &Client, node: &str) -> Option<ReplicaState> {
    let nodes = client.nodes().await.ok()?;
    nodes
        .nodes
        .into_iter()
        .find(|n| n.name == node)?
        .replica
        .map(|r| r.state)
}

async fn job_state(client: &Client, id: u64) -> Option<JobState> {
    client.job(id).await.ok().map(|j| j.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restart_adopts_running_containers_without_duplicating_them() {
    init_tracing();
    require_images();
    let node = unique_node("adopt");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let work = dir.path().join("work");

    // A serving replica survives an agent restart as the same container.
    let (agent, _) = start_agent(agent_config(&coordinator.url, &node, &work, 4), 4).await;
    wait_for("the replica to serve", STARTUP, || async {
        (replica_state(&client, &node).await == Some(ReplicaState::Serving)).then_some(())
    })
    .await;
    let replica = containers(&node, "replica");
    agent.stop();
    let (agent, _) = start_agent(agent_config(&coordinator.url, &node, &work, 4), 4).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        containers(&node, "replica"),
        replica,
        "the same replica container, still running"
    );
    assert_eq!(
        replica_state(&client, &node).await,
        Some(ReplicaState::Serving)
    );

    // A running job survives an agent restart as the same container.
    let job = client
        .submit(&trainer_job("long", 4, 1_000_000, 20, 100))
        .await
        .unwrap();
    wait_for("the job to run", STARTUP, || async {
        (job_state(&client, job.id).await == Some(JobState::Running)).then_some(())
    })
    .await;
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 1);
    let lease = client.job(job.id).await.unwrap().leases[0].clone();
    agent.stop();
    let (agent, _) = start_agent(agent_config(&coordinator.url, &node, &work, 4), 4).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        containers(&node, "job"),
        jobs,
        "the same job container, not a second one"
    );
    let after = client.job(job.id).await.unwrap();
    assert_eq!((after.state, after.attempt), (JobState::Running, 1));
    assert_eq!(after.leases.first().map(|l| l.epoch), Some(lease.epoch));
    let replicas = containers(&node, "replica");
    assert!(
        replicas.iter().all(|(_, _, s)| s != "running"),
        "the replica stays down: {replicas:?}"
    );
    agent.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_with_sigkill_keeps_every_queued_and_running_job() {
    let dir = tempfile::tempdir().unwrap();
    sigkill_keeps_every_job(dir.path(), "sigkill", "").await;
    assert!(dir.path().join("state/nightshift.db").is_file());
}

/// The same on the PostgreSQL store: the restarted coordinator finds everything in the
/// database, and nothing in its data directory's SQLite file, which it never makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_on_postgres_killed_with_sigkill_keeps_every_job() {
    let db = nightshift_tests::postgres::database("sigkill");
    let dir = tempfile::tempdir().unwrap();
    let store = format!("[store]\nurl = \"{}\"\n", db.url());
    sigkill_keeps_every_job(dir.path(), "sigkill-pg", &store).await;
    assert!(!dir.path().join("state/nightshift.db").exists());
    assert_eq!(db.psql("SELECT count(*) FROM jobs"), "4");
}

/// A coordinator (with `extra` in its configuration) and an agent with a running job and
/// two queued: after a SIGKILL and a restart on the same state, every job is as it was, the
/// agent's container carries on under the same lease, and ids continue.
async fn sigkill_keeps_every_job(dir: &std::path::Path, prefix: &str, extra: &str) {
    init_tracing();
    require_images();
    let node = unique_node(prefix);
    let _cleanup = Cleanup(node.clone());
    let (coordinator, client) = CoordinatorProcess::start_with(dir, extra).await;
    let url = coordinator.url.clone();
    let (agent, _) = start_agent(agent_config(&url, &node, &dir.join("work"), 4), 4).await;
    wait_for("the replica to serve", STARTUP, || async {
        (replica_state(&client, &node).await == Some(ReplicaState::Serving)).then_some(())
    })
    .await;
    let running = client
        .submit(&trainer_job("running", 4, 1_000_000, 20, 100))
        .await
        .unwrap();
    let queued: Vec<u64> = vec![
        client
            .submit(&trainer_job("queued-1", 2, 100, 20, 100))
            .await
            .unwrap()
            .id,
        client
            .submit(&trainer_job("queued-2", 4, 100, 20, 100))
            .await
            .unwrap()
            .id,
    ];
    wait_for("the first job to run", STARTUP, || async {
        (job_state(&client, running.id).await == Some(JobState::Running)).then_some(())
    })
    .await;
    let before = client.jobs().await.unwrap().jobs;
    let container = containers(&node, "job");

    let _coordinator = coordinator.crash_and_restart().await;

    let after = client.jobs().await.unwrap().jobs;
    assert_eq!(after.len(), 3, "{after:?}");
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(
            (b.id, b.state, b.attempt),
            (a.id, a.state, a.attempt),
            "job {} unchanged",
            b.id
        );
        let epochs =
            |j: &nightshift_common::JobView| j.leases.iter().map(|l| l.epoch).collect::<Vec<_>>();
        assert_eq!(epochs(b), epochs(a));
    }
    assert_eq!(after[0].state, JobState::Running);
    for id in &queued {
        assert_eq!(job_state(&client, *id).await, Some(JobState::Queued));
    }
    // The agent carries on under the same lease: the same container, the job still running.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        job_state(&client, running.id).await,
        Some(JobState::Running)
    );
    assert_eq!(containers(&node, "job"), container);
    let next = client
        .submit(&trainer_job("after-restart", 1, 10, 20, 100))
        .await
        .unwrap();
    assert_eq!(next.id, 4, "ids continue where they were");
    agent.stop();
}
