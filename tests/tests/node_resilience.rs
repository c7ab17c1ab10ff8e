//! A node keeps working when one thing on it goes wrong, against the real Docker engine: a job
//! whose container the engine refuses fails alone while the node's other job runs; a drain
//! called off during the readiness grace is abandoned at once; the phases of a restarted agent
//! still reach the coordinator; and a job's directories are closed to the host's other users
//! yet writable by a container running as a non-root user.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use nightshift_common::{DesiredNode, JobFile, JobState, LeaseGrant, ReplicaState};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(90);

fn desired(version: u64, serve: bool, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve,
        leases,
        lease_ttl_ms: 600_000,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_the_engine_refuses_fails_with_its_reason_and_the_other_job_runs() {
    init_tracing();
    require_images();
    let one = OneNode::start("refused", 4).await;
    let client = &one.client;
    // `/toy-trainer` is the image's one file: nothing can be placed under it, which only the
    // engine finds out, when the container is prepared.
    let mut bad = trainer_job("bad", 1, 10, 20, 5);
    bad.files = vec![JobFile {
        path: "/toy-trainer/x".into(),
        content: "hello".into(),
    }];
    bad.retry.limit = 1;
    bad.retry.backoff_seconds = 1;
    let bad = client.submit(&bad).await.unwrap();
    let good = client
        .submit(&trainer_job("good", 1, 40, 20, 10))
        .await
        .unwrap();

    let good_done = wait_for("the good job to succeed", STARTUP, || async {
        let j = client.job(good.id).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    assert_eq!(good_done.state, JobState::Succeeded, "{good_done:#?}");

    let failed = wait_for("the bad job to fail", STARTUP, || async {
        let j = client.job(bad.id).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    // Both attempts failed to start: failures, never preemptions.
    assert_eq!(
        (
            failed.state,
            failed.attempt,
            failed.failures,
            failed.preemptions
        ),
        (JobState::Failed, 2, 2, 0),
        "{failed:#?}"
    );
    let message = failed.message.clone().unwrap_or_default();
    assert!(
        message.contains("refused") && message.contains("not a directory"),
        "the engine's reason: {message}"
    );
    let (code, out, err) = nightshift(one.url(), &["job", "show", &bad.id.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("not a directory"), "{out}");

    // The node goes on serving: nothing of the bad job is left on it.
    wait_for("the node to serve again", STARTUP, || async {
        let o = one.agent.shared.observed();
        (o.replica() == ReplicaState::Serving && o.runs.is_empty()).then_some(())
    })
    .await;
    let leftovers: Vec<_> = containers(&one.node, "job")
        .into_iter()
        .filter(|c| c.1.contains(&format!("-{}-", bad.id)))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_start_is_still_told_after_a_reclaim_takes_its_lease_back() {
    init_tracing();
    require_images();
    let node = unique_node("refusedreclaim");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, _) =
        reconciler(agent_config("http://127.0.0.1:9", &node, dir.path(), 2), 2).await;
    let mut job = trainer_job("bad", 1, 10, 20, 5);
    job.files = vec![JobFile {
        path: "/toy-trainer/x".into(),
        content: "hello".into(),
    }];
    let lease = LeaseGrant {
        lease_id: 5,
        epoch: 5,
        job_id: 5,
        attempt: 1,
        gpus: vec![0],
        job,
        rendezvous: None,
    };
    let failed = |shared: &nightshift_agent::state::Shared| {
        shared
            .observed()
            .runs
            .into_iter()
            .find_map(|r| match r.state {
                nightshift_common::JobRunState::FailedToStart { message, .. }
                    if r.lease_id == 5 =>
                {
                    Some(message)
                }
                _ => None,
            })
    };
    shared.offer_desired(desired(1, false, vec![lease]));
    r.pass()
        .await
        .expect("a refused container fails its lease, not the pass");
    let message = failed(&shared).expect("the start failure reported");
    assert!(message.contains("not a directory"), "{message}");
    // Taken back before the coordinator heard: the failure is still told, so that the
    // attempt fails rather than passing for a preemption.
    shared.offer_desired(desired(2, true, vec![]));
    r.pass().await.expect("serve");
    assert_eq!(failed(&shared), Some(message));
    assert!(containers(&node, "job").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_called_off_during_the_readiness_grace_is_abandoned_at_once() {
    init_tracing();
    require_images();
    let node = unique_node("grace");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = agent_config("http://127.0.0.1:9", &node, dir.path(), 4);
    let grace = Duration::from_secs(5);
    cfg.readiness_grace_s = grace.as_secs_f64();
    let (mut r, shared, _) = reconciler(cfg, 4).await;

    shared.offer_desired(desired(1, true, vec![]));
    r.pass().await.expect("serve");
    assert!(shared.ready());

    // Lent, then taken back 1.5 s into the 5 s grace.
    let lease = LeaseGrant {
        lease_id: 1,
        epoch: 1,
        job_id: 1,
        attempt: 1,
        gpus: vec![0],
        job: trainer_job("lent", 1, 1_000_000, 10, 100),
        rendezvous: None,
    };
    shared.offer_desired(desired(2, false, vec![lease]));
    let surge = {
        let shared = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            shared.offer_desired(desired(3, true, vec![]));
            Instant::now()
        })
    };
    r.pass().await.expect("drain called off");
    let drain_ended = Instant::now();
    let surged = surge.await.unwrap();
    let abandoned_after = drain_ended.saturating_duration_since(surged);
    assert!(
        abandoned_after < Duration::from_secs(1),
        "the drain went on {abandoned_after:?} after the node was asked to serve (grace {grace:?})"
    );
    assert!(containers(&node, "job").is_empty(), "no job started");

    r.pass().await.expect("serve again");
    let ready_after = surged.elapsed();
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    assert!(shared.ready());
    assert!(
        ready_after < Duration::from_secs(2),
        "ready {ready_after:?} after the surge (grace {grace:?})"
    );
    tracing::info!(
        ?abandoned_after,
        ?ready_after,
        "drain called off in its grace"
    );
}

/// The node's phases the coordinator kept that started at or after `at` (Unix ms).
async fn phases_since(
    client: &nightshift_cli::client::Client,
    node: &str,
    at: u64,
) -> Option<Vec<nightshift_common::PhaseRecord>> {
    let nodes = client.nodes().await.ok()?;
    let n = nodes.nodes.into_iter().find(|n| n.name == node)?;
    let later: Vec<_> = n
        .recent_phases
        .into_iter()
        .filter(|p| p.started_at >= at)
        .collect();
    (!later.is_empty()).then_some(later)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agents_phases_still_reach_the_coordinator() {
    init_tracing();
    require_images();
    let mut one = OneNode::start("phases", 2).await;
    // The first agent brings the replica up: its reclaim phases reach the coordinator, up to
    // the replica answering its health check.
    let first = wait_for("the first agent's phases", STARTUP, || async {
        phases_since(&one.client, &one.node, 0)
            .await
            .filter(|p| p.iter().any(|p| p.phase == "wait_health"))
    })
    .await;
    let before = first.iter().map(|p| p.seq).max().unwrap();

    // The agent restarts: a new process with the same node, work directory and replica. It
    // adopts the serving replica, which then dies: the new process brings it back and records
    // the phases of that reclaim, numbered from 1 again by the new process, which the
    // coordinator must keep all the same. (Killing the replica makes the phase certain; an
    // adopted replica that is already healthy records none.)
    let cfg = agent_config(
        &one.coordinator.url,
        &one.node,
        &one.dir.path().join("work"),
        2,
    );
    let old = one.agent;
    old.stop();
    let restarted_at = nightshift_agent::state::now_ms();
    one.agent = start_agent(cfg, 2).await.0;
    let replica = format!("nightshift-replica-{}", one.node);
    let killed = std::process::Command::new("docker")
        .args(["kill", &replica])
        .output()
        .expect("docker kill");
    assert!(
        killed.status.success(),
        "docker kill {replica}: {}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let after = wait_for("a phase after the restart", STARTUP, || {
        phases_since(&one.client, &one.node, restarted_at)
    })
    .await;
    assert!(
        after.iter().all(|p| p.seq > before),
        "numbered after the first agent's {before}: {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_directories_are_closed_to_others_and_writable_by_a_non_root_job() {
    init_tracing();
    require_images();
    let dir = tempfile::tempdir().unwrap();
    // As an agent's work directory: others may pass through, not into a job's directories.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let dirs = nightshift_agent::job::JobDirs::new(dir.path(), 7);
    dirs.create().unwrap();
    let gid = dirs.group().expect("the directories' group");
    assert_eq!(gid, std::fs::metadata(&dirs.outputs).unwrap().gid());

    // The trainer runs as a user that is neither the directories' owner nor in their group:
    // only the supplementary group the agent gives a job container lets it write.
    let run = |group_add: bool| {
        let mut args = vec![
            "run".to_owned(),
            "--rm".into(),
            "--user".into(),
            "4321:4321".into(),
            "-v".into(),
            format!("{}:/nightshift/checkpoint", dirs.checkpoint.display()),
            "-v".into(),
            format!("{}:/nightshift/outputs", dirs.outputs.display()),
            "-e".into(),
            "TRAINER_TARGET_STEP=5".into(),
            "-e".into(),
            "TRAINER_STEPS_PER_SEC=50".into(),
            "-e".into(),
            "TRAINER_CHECKPOINT_EVERY=1".into(),
            "-e".into(),
            "NIGHTSHIFT_CHECKPOINT_DIR=/nightshift/checkpoint".into(),
            "-e".into(),
            "NIGHTSHIFT_OUTPUT_DIR=/nightshift/outputs".into(),
        ];
        if group_add {
            args.extend(["--group-add".into(), gid.to_string()]);
        }
        args.push(TRAINER_IMAGE.into());
        std::process::Command::new("docker")
            .args(&args)
            .output()
            .expect("docker run")
    };
    let refused = run(false);
    assert!(
        !refused.status.success(),
        "a stranger to the group wrote the job's directories: {}",
        String::from_utf8_lossy(&refused.stdout)
    );
    let ran = run(true);
    assert!(
        ran.status.success(),
        "{}{}",
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr)
    );
    assert!(dirs.has_checkpoint(), "the job's checkpoint was written");
}
