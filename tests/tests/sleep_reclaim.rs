//! Sleep-mode reclaim against the real Docker engine and the vLLM stand-in: on lend the
//! replica is put to sleep (not stopped) and the job starts beside it; on reclaim it is woken
//! (not restarted). When sleeping frees too little GPU memory, the replica is stopped instead.
//!
//! Fake GPUs have no process on them, so the test models NVML: a watcher sets every GPU's
//! used memory from the replica's own state, as the driver would see it: `awake` bytes while
//! vLLM is up and awake, `asleep` bytes while it sleeps, nothing once its container is gone.

use std::sync::Arc;
use std::time::Duration;

use nightshift_agent::config::{AgentConfig, ReclaimMode};
use nightshift_agent::gpus::Gpus;
use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_agent::state::Shared;
use nightshift_common::{DesiredNode, LeaseGrant, ReplicaState, SequenceKind};
use nightshift_tests::*;

const GIB: u64 = 1 << 30;

fn desired(version: u64, serve: bool, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve,
        leases,
        lease_ttl_ms: 600_000,
    }
}

fn lease() -> LeaseGrant {
    LeaseGrant {
        lease_id: 1,
        epoch: 1,
        job_id: 1,
        attempt: 1,
        gpus: vec![0, 1, 2, 3],
        job: trainer_job("beside-a-sleeping-replica", 4, 1_000_000, 10, 100),
        rendezvous: None,
    }
}

fn sleep_config(node: &str, dir: &std::path::Path) -> AgentConfig {
    let mut cfg = agent_config("http://127.0.0.1:9", node, dir, 4);
    cfg.replica.reclaim = ReclaimMode::Sleep;
    cfg.replica.env.push("VLLM_SERVER_DEV_MODE=1".into());
    cfg.replica.sleep_max_used_bytes = 2 * GIB;
    cfg.replica.sleep_free_timeout_s = 1.5;
    cfg
}

/// Sets the fake GPUs' used memory from the replica's state until aborted.
fn model_nvml(
    shared: Arc<Shared>,
    gpus: Arc<FakeGpus>,
    awake: u64,
    asleep: u64,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()
            .expect("client");
        loop {
            let used = match shared.observed().replica_url {
                None => 0,
                Some(url) => match client.get(format!("{url}/is_sleeping")).send().await {
                    Err(_) => 0,
                    Ok(r) => match r.json::<serde_json::Value>().await {
                        Ok(v) if v["is_sleeping"] == true => asleep,
                        Ok(_) => awake,
                        Err(_) => 0,
                    },
                },
            };
            for g in 0..4 {
                gpus.set_memory_used(g, used).expect("fake gpu");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

fn phases(shared: &Shared, seq: SequenceKind) -> Vec<String> {
    shared
        .phases()
        .into_iter()
        .filter(|p| p.sequence == seq)
        .map(|p| p.phase)
        .collect()
}

async fn is_sleeping(url: &str) -> Option<bool> {
    let v: serde_json::Value = reqwest::get(format!("{url}/is_sleeping"))
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    v["is_sleeping"].as_bool()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lend_sleeps_the_replica_and_reclaim_wakes_it() {
    init_tracing();
    require_images();
    let node = unique_node("sleep");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, gpus) = reconciler(sleep_config(&node, dir.path()), 4).await;
    let watcher = model_nvml(shared.clone(), gpus.clone(), 70 * GIB, 1_300_000_000);

    shared.offer_desired(desired(1, true, vec![]));
    r.pass().await.expect("serve");
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    let url = shared.observed().replica_url.expect("replica url");
    let replica_id = containers(&node, "replica")[0].0.clone();

    shared.offer_desired(desired(2, false, vec![lease()]));
    r.pass().await.expect("lend by sleeping");
    assert_eq!(shared.observed().replica(), ReplicaState::Sleeping);
    assert!(!shared.ready(), "a sleeping replica is not ready");
    assert_eq!(is_sleeping(&url).await, Some(true), "vllm sleeps");
    let replicas = containers(&node, "replica");
    assert_eq!(replicas.len(), 1);
    assert_eq!(
        (replicas[0].0.as_str(), replicas[0].2.as_str()),
        (replica_id.as_str(), "running"),
        "the replica container is kept, asleep"
    );
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].2, "running");
    let drain = phases(&shared, SequenceKind::Drain);
    for p in [
        "mark_not_ready",
        "wait_in_flight",
        "sleep_replica",
        "confirm_free",
        "start_jobs",
    ] {
        assert!(drain.contains(&p.to_owned()), "{p} missing from {drain:?}");
    }
    assert!(
        !drain.contains(&"stop_replica".to_owned()),
        "not stopped: {drain:?}"
    );

    // Idempotent: another pass changes nothing.
    r.pass().await.expect("second pass");
    assert_eq!(containers(&node, "job").len(), 1);
    assert_eq!(shared.observed().replica(), ReplicaState::Sleeping);

    let before = phases(&shared, SequenceKind::Reclaim).len();
    shared.offer_desired(desired(3, true, vec![]));
    r.pass().await.expect("reclaim by waking");
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    assert!(shared.ready());
    assert_eq!(is_sleeping(&url).await, Some(false), "awake again");
    assert_eq!(
        containers(&node, "replica")[0].0,
        replica_id,
        "the same container serves: no cold start"
    );
    let reclaim = phases(&shared, SequenceKind::Reclaim).split_off(before);
    for p in ["stop_jobs", "confirm_free", "wake_replica", "wait_health"] {
        assert!(
            reclaim.contains(&p.to_owned()),
            "{p} missing from {reclaim:?}"
        );
    }
    assert!(
        !reclaim.contains(&"start_replica".to_owned()),
        "{reclaim:?}"
    );
    let wake = shared
        .phases()
        .into_iter()
        .find(|p| p.phase == "wake_replica")
        .expect("wake phase");
    println!("phases: {:?}", shared.phases());
    assert!(wake.duration_ms < 5_000, "{wake:?}");
    let client = reqwest::Client::new();
    assert_eq!(complete(&client, &url, 4).await, Ok(200), "it serves again");
    watcher.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleeping_that_frees_too_little_memory_falls_back_to_stopping() {
    init_tracing();
    require_images();
    let node = unique_node("sleep-fallback");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, gpus) = reconciler(sleep_config(&node, dir.path()), 4).await;
    // Asleep, vLLM still holds 30 GiB per GPU: more than the 2 GiB a sleeping replica may keep.
    let watcher = model_nvml(shared.clone(), gpus.clone(), 70 * GIB, 30 * GIB);

    shared.offer_desired(desired(1, true, vec![]));
    r.pass().await.expect("serve");
    shared.offer_desired(desired(2, false, vec![lease()]));
    r.pass().await.expect("lend: sleep, then stop");

    assert_eq!(shared.observed().replica(), ReplicaState::Stopped);
    let replicas = containers(&node, "replica");
    assert_eq!(replicas[0].2, "exited", "the replica was stopped after all");
    assert_eq!(containers(&node, "job")[0].2, "running");
    let drain = phases(&shared, SequenceKind::Drain);
    for p in [
        "sleep_replica",
        "sleep_insufficient",
        "stop_replica",
        "confirm_free",
    ] {
        assert!(drain.contains(&p.to_owned()), "{p} missing from {drain:?}");
    }
    let used: Vec<u64> = gpus
        .status()
        .expect("status")
        .iter()
        .map(|s| s.memory_used_bytes)
        .collect();
    assert_eq!(used, vec![0; 4], "the job started on free gpus");

    shared.offer_desired(desired(3, true, vec![]));
    r.pass().await.expect("reclaim by starting");
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    assert!(phases(&shared, SequenceKind::Reclaim).contains(&"start_replica".to_owned()));
    watcher.abort();
}
