//! The agent's drain and reclaim sequences against the real Docker engine, with the test
//! playing the coordinator: it offers desired states and runs reconcile passes.

use std::time::{Duration, Instant};

use nightshift_common::{DesiredNode, EnvVar, JobRunState, LeaseGrant, ReplicaState, SequenceKind};
use nightshift_tests::*;

fn desired(version: u64, serve: bool, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve,
        leases,
        lease_ttl_ms: 600_000,
    }
}

fn lease(
    lease_id: u64,
    epoch: u64,
    job_id: u64,
    gpus: Vec<u32>,
    job: nightshift_common::JobSpec,
) -> LeaseGrant {
    LeaseGrant {
        lease_id,
        epoch,
        job_id,
        attempt: 1,
        gpus,
        job,
        rendezvous: None,
    }
}

fn phase(
    shared: &nightshift_agent::state::Shared,
    seq: SequenceKind,
    name: &str,
) -> nightshift_common::PhaseRecord {
    shared
        .phases()
        .into_iter()
        .rev()
        .find(|p| p.sequence == seq && p.phase == name)
        .unwrap_or_else(|| panic!("no {name} phase in {:?}", shared.phases()))
}

fn now_ms() -> u64 {
    nightshift_agent::state::now_ms()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_in_flight_requests_before_stopping_the_replica() {
    init_tracing();
    require_images();
    let node = unique_node("drain");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, _) =
        reconciler(agent_config("http://127.0.0.1:9", &node, dir.path(), 4), 4).await;

    shared.offer_desired(desired(1, true, vec![]));
    r.pass().await.expect("serve");
    let o = shared.observed();
    assert_eq!(o.replica(), ReplicaState::Serving);
    assert!(shared.ready());
    let url = o.replica_url.expect("replica url");

    // Six requests of 1.5 s each on a replica that runs 4 at a time: about 3 s of work.
    let client = reqwest::Client::new();
    let requests: Vec<_> = (0..6)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let status = complete(&client, &url, 150).await;
                (status, now_ms())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let job = trainer_job("after-drain", 2, 100_000, 10, 50);
    shared.offer_desired(desired(2, false, vec![lease(1, 1, 1, vec![0, 1], job)]));
    r.pass().await.expect("drain and start the job");

    let mut last_done = 0;
    for req in requests {
        let (status, done_at) = req.await.unwrap();
        assert_eq!(status, Ok(200), "every in-flight request completes");
        last_done = last_done.max(done_at);
    }
    let waited = phase(&shared, SequenceKind::Drain, "wait_in_flight");
    let stop = phase(&shared, SequenceKind::Drain, "stop_replica");
    println!(
        "wait_in_flight {} ms, stop_replica {} ms",
        waited.duration_ms, stop.duration_ms
    );
    assert!(
        waited.duration_ms >= 1_000,
        "the drain waited for the requests: {waited:?}"
    );
    assert!(
        last_done <= stop.started_at + 50,
        "the last request ended at {last_done}, before the replica was stopped at {}",
        stop.started_at
    );
    assert!(!shared.ready());
    assert_eq!(shared.observed().replica(), ReplicaState::Stopped);
    let replicas = containers(&node, "replica");
    assert_eq!(replicas.len(), 1);
    assert_eq!(replicas[0].2, "exited");
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].2, "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ignores_its_checkpoint_signal_is_killed_after_its_grace_period() {
    init_tracing();
    require_images();
    let node = unique_node("grace");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, _) =
        reconciler(agent_config("http://127.0.0.1:9", &node, dir.path(), 4), 4).await;

    let mut job = trainer_job("stubborn", 4, 1_000_000, 10, 100);
    job.env.push(EnvVar {
        name: "TRAINER_IGNORE_SIGTERM".into(),
        value: "1".into(),
    });
    job.checkpoint.grace_period_seconds = 2;
    shared.offer_desired(desired(
        1,
        false,
        vec![lease(7, 3, 5, vec![0, 1, 2, 3], job)],
    ));
    r.pass().await.expect("start the job");
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    let id = jobs[0].0.clone();
    tokio::time::sleep(Duration::from_millis(500)).await;

    shared.offer_desired(desired(2, true, vec![]));
    let started = Instant::now();
    r.pass().await.expect("reclaim");
    let stop = phase(&shared, SequenceKind::Reclaim, "stop_jobs");
    println!(
        "stop_jobs {} ms; whole reclaim {:?}",
        stop.duration_ms,
        started.elapsed()
    );
    assert!(
        (2_000..6_000).contains(&stop.duration_ms),
        "killed after the 2 s grace: {stop:?}"
    );
    let run = shared
        .observed()
        .runs
        .into_iter()
        .find(|r| r.lease_id == 7)
        .expect("run reported");
    assert_eq!(
        run.state,
        JobRunState::Exited {
            exit_code: 137,
            stopped_by_agent: true
        },
        "killed"
    );
    assert!(
        docker_inspect(&id).is_null(),
        "the stopped container of a revoked lease is removed"
    );
    assert_eq!(
        shared.observed().replica(),
        ReplicaState::Serving,
        "serving again"
    );
    assert!(shared.ready());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_containers_see_only_their_leased_gpus_and_stale_leases_are_refused() {
    init_tracing();
    require_images();
    let node = unique_node("gpus");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, _) =
        reconciler(agent_config("http://127.0.0.1:9", &node, dir.path(), 4), 4).await;

    let a = lease(
        11,
        5,
        1,
        vec![1, 3],
        trainer_job("a", 2, 1_000_000, 10, 100),
    );
    let b = lease(
        12,
        6,
        2,
        vec![0, 2],
        trainer_job("b", 2, 1_000_000, 10, 100),
    );
    shared.offer_desired(desired(1, false, vec![a.clone(), b.clone()]));
    r.pass().await.expect("start both jobs");

    let mut seen = Vec::new();
    for (id, name, state) in containers(&node, "job") {
        assert_eq!(state, "running", "{name}");
        let c = docker_inspect(&id);
        let env: Vec<String> = serde_json::from_value(c["Config"]["Env"].clone()).unwrap();
        let get = |k: &str| {
            env.iter()
                .find_map(|e| e.strip_prefix(&format!("{k}=")))
                .map(str::to_owned)
        };
        let gpus = get("NVIDIA_VISIBLE_DEVICES").expect("NVIDIA_VISIBLE_DEVICES set");
        assert_eq!(get("CUDA_VISIBLE_DEVICES").as_deref(), Some(gpus.as_str()));
        assert_eq!(get("NIGHTSHIFT_GPUS").as_deref(), Some(gpus.as_str()));
        assert!(
            c["HostConfig"]["DeviceRequests"].is_null(),
            "fake gpus attach no device"
        );
        assert_eq!(c["Config"]["Labels"]["io.nightshift.gpus"], gpus.as_str());
        seen.push(gpus);
    }
    seen.sort();
    assert_eq!(
        seen,
        vec!["0,2".to_owned(), "1,3".to_owned()],
        "each job sees exactly its lease"
    );

    // A lease older than one already honoured on GPU 1 is refused.
    let stale = lease(
        10,
        4,
        3,
        vec![1],
        trainer_job("stale", 1, 1_000_000, 10, 100),
    );
    shared.offer_desired(desired(2, false, vec![a, b, stale]));
    r.pass().await.expect("pass with a stale lease");
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 2, "the stale lease started nothing: {jobs:?}");
    assert!(
        shared.observed().runs.iter().all(|r| r.lease_id != 10),
        "nor is it reported"
    );
}
