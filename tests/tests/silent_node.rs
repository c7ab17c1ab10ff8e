//! A node whose agent dies while its job runs, end to end: a coordinator in-process, two
//! agents on fake GPUs sharing one work directory (as on shared storage), the real Docker
//! engine. The job is requeued when the dead node's lease expires, but starts on the other
//! node only once the fail-safe's bound has passed (the lease TTL, then the job's grace period
//! and 10 s); the old container, with no agent to stop it, runs on, and the new attempt
//! checkpoints into its own directory, seeded from the old one's.

use std::time::{Duration, Instant};

use nightshift_common::JobState;
use nightshift_core::STRAGGLER_MARGIN_MS;
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(60);
const LEASE_TTL_MS: u64 = 3_000;
const GRACE_S: u32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_job_starts_elsewhere_only_after_the_fail_safe_bound_in_its_own_checkpoint() {
    init_tracing();
    require_images();
    let (a, b) = (unique_node("silent-a"), unique_node("silent-b"));
    let _cleanup = (Cleanup(a.clone()), Cleanup(b.clone()));
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = coordinator_config(&dir.path().join("state"));
    cfg.lease_ttl_ms = LEASE_TTL_MS;
    let coordinator = TestCoordinator::start(&cfg).await;
    let client = coordinator.client();
    let work = dir.path().join("work");

    let (agent_a, _) = start_agent(agent_config(&coordinator.url, &a, &work, 4), 4).await;
    let mut spec = trainer_job("twice", 4, 1_000_000, 50, 10);
    spec.checkpoint.grace_period_seconds = GRACE_S;
    let job = client.submit(&spec).await.unwrap();
    wait_for("the job to run on the first node", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(())
    })
    .await;
    let first = client.job(job.id).await.unwrap().leases[0].clone();
    assert_eq!(first.node, a);
    let (_agent_b, _) = start_agent(agent_config(&coordinator.url, &b, &work, 4), 4).await;
    // The first attempt has checkpointed before its agent dies.
    let first_dir = work.join(format!("jobs/{}/checkpoints/{}", job.id, first.epoch));
    wait_for("a checkpoint of the first attempt", STARTUP, || async {
        std::fs::read_dir(&first_dir)
            .ok()?
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".ckpt"))
            .then_some(())
    })
    .await;

    agent_a.stop();
    let died = Instant::now();
    // The lease expires a TTL after the last heartbeat; the job then waits out the grace
    // period and the margin.
    let bound =
        Duration::from_millis(LEASE_TTL_MS + u64::from(GRACE_S) * 1000 + STRAGGLER_MARGIN_MS);
    let requeued = wait_for("the job to be requeued", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.attempt > 1).then_some(j)
    })
    .await;
    println!("requeued {:?} after the agent died", died.elapsed());
    assert_eq!(requeued.state, JobState::Queued, "held, not placed at once");
    assert!(requeued.not_before.is_some());
    let second = wait_for("the job to run on the other node", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        let l = j.leases.first()?.clone();
        (j.state == JobState::Running).then_some(l)
    })
    .await;
    let took = died.elapsed();
    println!("started on the other node {took:?} after the agent died (bound {bound:?})");
    assert_eq!(second.node, b);
    assert!(
        took >= bound - Duration::from_millis(500),
        "not before the old container has surely stopped: {took:?} < {bound:?}"
    );

    // The dead agent stopped nothing: both containers run, each in its own checkpoint
    // directory, the second started from the first's.
    let running = |node: &str| {
        containers(node, "job")
            .into_iter()
            .filter(|(_, _, state)| state == "running")
            .map(|(id, _, _)| docker_inspect(&id))
            .collect::<Vec<_>>()
    };
    let (old, new) = (running(&a), running(&b));
    assert_eq!((old.len(), new.len()), (1, 1), "the old container runs on");
    let source = |c: &serde_json::Value| {
        c["Mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["Destination"] == "/nightshift/checkpoint")
            .and_then(|m| m["Source"].as_str())
            .unwrap()
            .to_owned()
    };
    assert_eq!(source(&old[0]), first_dir.display().to_string());
    assert_eq!(
        source(&new[0]),
        work.join(format!("jobs/{}/checkpoints/{}", job.id, second.epoch))
            .display()
            .to_string()
    );
    let env: Vec<String> = serde_json::from_value(new[0]["Config"]["Env"].clone()).unwrap();
    assert!(
        env.contains(&format!("NIGHTSHIFT_RESUMED_FROM_EPOCH={}", first.epoch)),
        "{env:?}"
    );
}
