//! The fail-safe against the real Docker engine and a real coordinator process: when the
//! coordinator dies while a job runs, the agent stops the job (checkpoint signal, grace) and
//! restores serving by itself within lease TTL + grace + start; when the coordinator is back,
//! the agent reports what it did, the job is requeued as preempted, and the expired lease is
//! never honoured again.

use std::time::{Duration, Instant};

use nightshift_cli::client::Client;
use nightshift_common::{JobState, ReplicaState};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(60);
const LEASE_TTL: Duration = Duration::from_secs(3);
const GRACE: Duration = Duration::from_secs(3);
/// Starting the stand-in replica and its `/health` answering; generous for a loaded CI host.
const START: Duration = Duration::from_secs(15);

async fn agent_status(url: &str) -> Option<serde_json::Value> {
    reqwest::get(url).await.ok()?.json().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_coordinator_makes_the_agent_serve_again_and_the_expired_lease_is_refused() {
    init_tracing();
    require_images();
    let node = unique_node("failsafe");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    let config = dir.path().join("coordinator.toml");
    let mut cc = coordinator_config(&data);
    cc.lease_ttl_ms = LEASE_TTL.as_millis() as u64;
    std::fs::write(&config, coordinator_toml(&cc)).unwrap();
    let port = free_port();
    let coordinator = CoordinatorProcess::spawn(port, &data, &config);
    let client = Client::new(&coordinator.url).unwrap();
    wait_for("the coordinator", STARTUP, || async {
        client.healthz().await.ok()
    })
    .await;

    let cfg = agent_config(&coordinator.url, &node, &dir.path().join("work"), 4);
    let (agent, status) = start_agent(cfg, 4).await;
    let mut spec = trainer_job("interrupted", 4, 1_000_000, 20, 100);
    spec.checkpoint.grace_period_seconds = GRACE.as_secs() as u32;
    let job = client.submit(&spec).await.unwrap();
    wait_for("the job to run", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(())
    })
    .await;
    let first = client.job(job.id).await.unwrap();
    let old_lease = first.leases.first().cloned().expect("lease");
    assert_eq!(containers(&node, "job").len(), 1);

    coordinator.kill();
    let killed = Instant::now();
    wait_for("the agent to serve again on its own", STARTUP, || async {
        let s = agent_status(&status).await?;
        (s["ready"] == true && s["replica"] == ReplicaState::Serving.as_str()).then_some(())
    })
    .await;
    let took = killed.elapsed();
    println!("serving restored {took:?} after the coordinator died");
    assert!(
        took <= LEASE_TTL + GRACE + START,
        "restored within ttl + grace + start: {took:?}"
    );
    assert!(took >= LEASE_TTL, "not before the lease expired: {took:?}");
    let jobs = containers(&node, "job");
    assert!(
        jobs.iter().all(|(_, _, state)| state != "running"),
        "the job was stopped: {jobs:?}"
    );
    let s = agent_status(&status).await.expect("status");
    assert_eq!(s["replica"], "serving");
    // The agent's own /metrics show what happened.
    let metrics = reqwest::get(agent.metrics_url.clone().expect("metrics url"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    for series in [
        "nightshift_agent_gpu_memory_used_bytes{gpu=\"3\"}",
        "nightshift_agent_phase_duration_seconds_count{sequence=\"reclaim\",phase=\"stop_jobs\"}",
        "nightshift_agent_phase_duration_seconds_count{sequence=\"drain\",phase=\"stop_replica\"}",
        "nightshift_agent_vllm_scrapes_total{result=\"ok\"}",
        "nightshift_agent_reconcile_duration_seconds_count",
        "nightshift_agent_ready 1",
        "nightshift_agent_coordinator_silence_seconds",
    ] {
        assert!(metrics.contains(series), "{series} missing from\n{metrics}");
    }

    // The coordinator comes back with the lease it still believes in; the agent refuses it
    // and reports it; the job is requeued as preempted.
    let coordinator = CoordinatorProcess::spawn(port, &data, &config);
    wait_for("the coordinator again", STARTUP, || async {
        client.healthz().await.ok()
    })
    .await;
    let requeued = wait_for("the job to be requeued", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.attempt >= 2).then_some(j)
    })
    .await;
    println!("requeued: {:?} {:?}", requeued.state, requeued.message);
    assert!(requeued.preemptions >= 1, "{requeued:?}");
    let running_old = std::process::Command::new("docker")
        .args([
            "ps",
            "-q",
            "--filter",
            &format!("label=io.nightshift.node={node}"),
            "--filter",
            &format!("label=io.nightshift.lease-id={}", old_lease.lease_id),
        ])
        .output()
        .expect("docker ps");
    assert!(
        running_old.stdout.is_empty(),
        "nothing runs under the expired lease"
    );
    if let Some(new_lease) = client.job(job.id).await.unwrap().leases.into_iter().next() {
        assert!(
            new_lease.epoch > old_lease.epoch,
            "a new lease has a newer epoch"
        );
    }
    agent.stop();
    drop(coordinator);
}

fn short_lease_desired(version: u64) -> nightshift_common::DesiredNode {
    nightshift_common::DesiredNode {
        version,
        serve: false,
        leases: vec![nightshift_common::LeaseGrant {
            lease_id: 41,
            epoch: 7,
            job_id: 5,
            attempt: 1,
            gpus: vec![0, 1],
            job: {
                let mut j = trainer_job("on-a-short-lease", 2, 1_000_000, 20, 100);
                j.checkpoint.grace_period_seconds = 2;
                j
            },
            rendezvous: None,
        }],
        lease_ttl_ms: 800,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failsafe_can_be_disabled_and_an_expired_lease_stays_refused() {
    init_tracing();
    require_images();
    let node = unique_node("failsafe-cfg");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();

    // Disabled: the coordinator's silence is logged, the job keeps running.
    let mut off = agent_config("http://127.0.0.1:9", &node, dir.path(), 4);
    off.failsafe.enabled = false;
    let (mut r, shared, _) = reconciler(off, 4).await;
    shared.offer_desired(short_lease_desired(1));
    shared.contact();
    r.pass().await.expect("start the job");
    assert_eq!(containers(&node, "job")[0].2, "running");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    r.pass().await.expect("silent coordinator, fail-safe off");
    assert_eq!(containers(&node, "job")[0].2, "running", "left running");
    assert!(shared.observed().expired_leases.is_empty());
    drop(r);

    // Enabled (the default), on the same host: the job is stopped, the node serves.
    let on = agent_config("http://127.0.0.1:9", &node, dir.path(), 4);
    let (mut r, shared, _) = reconciler(on, 4).await;
    shared.offer_desired(short_lease_desired(1));
    shared.contact();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    r.pass().await.expect("fail-safe");
    assert_eq!(shared.observed().expired_leases, vec![41]);
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    assert!(
        containers(&node, "job")
            .iter()
            .all(|(_, _, s)| s != "running"),
        "stopped"
    );

    // The coordinator answers again, still listing the expired lease: it is refused, the
    // node keeps serving, and the lease is reported until the coordinator drops it.
    shared.contact();
    r.pass().await.expect("coordinator back");
    assert!(
        containers(&node, "job")
            .iter()
            .all(|(_, _, s)| s != "running"),
        "the expired lease started nothing"
    );
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    assert_eq!(shared.observed().expired_leases, vec![41]);
    let mut dropped = short_lease_desired(2);
    dropped.leases.clear();
    dropped.serve = true;
    shared.offer_desired(dropped);
    shared.contact();
    r.pass().await.expect("lease dropped");
    assert!(shared.observed().expired_leases.is_empty());
}
