//! Checkpoints fenced per attempt, against the real Docker engine with the test playing the
//! coordinator: two attempts of one job running at once (the old one on a lease the
//! coordinator has already given up, as when its node went silent) write separate
//! checkpoint directories, the newer one starts from a copy of the older one's, and a later
//! attempt resumes from the newer one's whatever the stale attempt wrote since.

use std::path::Path;
use std::time::Duration;

use nightshift_common::{DesiredNode, JobSpec, LeaseGrant};
use nightshift_tests::*;

const JOB: u64 = 7;

fn desired(version: u64, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve: false,
        leases,
        lease_ttl_ms: 600_000,
    }
}

/// The toy trainer at `rate` steps a second, a checkpoint every 10 steps.
fn trainer(rate: u64) -> JobSpec {
    let mut job = trainer_job("fenced", 1, 1_000_000, rate, 10);
    job.checkpoint.grace_period_seconds = 2;
    job
}

fn lease(lease_id: u64, epoch: u64, attempt: u32, gpu: u32, job: JobSpec) -> LeaseGrant {
    LeaseGrant {
        lease_id,
        epoch,
        job_id: JOB,
        attempt,
        gpus: vec![gpu],
        job,
        rendezvous: None,
    }
}

/// The newest complete checkpoint's step in `dir` (the trainer's `step-XXXXXXXX.ckpt`).
fn newest_step(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix("step-")?
                .strip_suffix(".ckpt")?
                .parse()
                .ok()
        })
        .max()
}

/// The container of lease `lease_id`: its environment variable `key` and the host source of
/// its checkpoint mount.
fn container_of(node: &str, lease_id: u64) -> (String, serde_json::Value) {
    let (id, _, _) = containers(node, "job")
        .into_iter()
        .find(|(id, _, _)| {
            docker_inspect(id)["Config"]["Labels"]["io.nightshift.lease-id"]
                == lease_id.to_string().as_str()
        })
        .unwrap_or_else(|| panic!("no container for lease {lease_id}"));
    let c = docker_inspect(&id);
    (id, c)
}

fn env_of(c: &serde_json::Value, key: &str) -> Option<String> {
    let env: Vec<String> = serde_json::from_value(c["Config"]["Env"].clone()).unwrap();
    env.iter()
        .find_map(|e| e.strip_prefix(&format!("{key}=")))
        .map(str::to_owned)
}

fn checkpoint_source(c: &serde_json::Value) -> String {
    let mounts = c["Mounts"].as_array().expect("mounts");
    mounts
        .iter()
        .find(|m| m["Destination"] == "/nightshift/checkpoint")
        .and_then(|m| m["Source"].as_str())
        .expect("checkpoint mount")
        .to_owned()
}

fn logs(id: &str) -> String {
    let out = std::process::Command::new("docker")
        .args(["logs", id])
        .output()
        .expect("docker logs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_attempts_at_once_write_their_own_checkpoints_and_the_newer_resumes_the_older() {
    init_tracing();
    require_images();
    let node = unique_node("fence");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut r, shared, _) =
        reconciler(agent_config("http://127.0.0.1:9", &node, dir.path(), 4), 4).await;

    // The first attempt, fast, until it has checkpointed.
    let first = lease(21, 5, 1, 0, trainer(200));
    shared.offer_desired(desired(1, vec![first.clone()]));
    r.pass().await.expect("start the first attempt");
    let first_dir = std::path::PathBuf::from(checkpoint_source(&container_of(&node, 21).1));
    wait_for(
        "the first attempt's checkpoint",
        Duration::from_secs(30),
        || async { newest_step(&first_dir).filter(|s| *s >= 20) },
    )
    .await;

    // The coordinator has moved on (a new lease, a higher epoch) while the first attempt
    // still runs: the second, slow, starts beside it.
    let second = lease(22, 8, 2, 1, trainer(5));
    shared.offer_desired(desired(2, vec![first.clone(), second.clone()]));
    r.pass().await.expect("start the second attempt");
    let (first_id, _) = container_of(&node, 21);
    let (second_id, second_c) = container_of(&node, 22);
    let second_dir = std::path::PathBuf::from(checkpoint_source(&second_c));
    assert_ne!(
        first_dir, second_dir,
        "each attempt mounts its own checkpoint directory"
    );
    let attempts = dir
        .path()
        .join("jobs")
        .join(JOB.to_string())
        .join("checkpoints");
    assert_eq!(
        (first_dir.clone(), second_dir.clone()),
        (attempts.join("5"), attempts.join("8"))
    );
    assert_eq!(env_of(&second_c, "NIGHTSHIFT_EPOCH").as_deref(), Some("8"));
    assert_eq!(
        env_of(&second_c, "NIGHTSHIFT_RESUMED_FROM_EPOCH").as_deref(),
        Some("5"),
        "told whose checkpoint it starts from"
    );
    assert_eq!(
        env_of(&second_c, "NIGHTSHIFT_RESUMING").as_deref(),
        Some("1")
    );
    let resumed = wait_for(
        "the second attempt to start",
        Duration::from_secs(30),
        || async {
            logs(&second_id)
                .lines()
                .find_map(|l| l.strip_prefix("resumed from step "))
                .and_then(|rest| rest.split(' ').next()?.parse::<u64>().ok())
        },
    )
    .await;
    assert!(
        resumed >= 20,
        "resumed from the first's checkpoint: {resumed}"
    );

    // Both run for a while: the stale first attempt races ahead in its own directory and
    // nothing of it reaches the second's.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stale = newest_step(&first_dir).expect("first attempt's checkpoints");
    let own = newest_step(&second_dir).expect("second attempt's checkpoints");
    println!("first attempt at step {stale}, second at {own} (resumed from {resumed})");
    assert!(
        stale > own + 100,
        "the stale attempt's checkpoints (step {stale}) stay out of the second's (step {own})"
    );
    assert!(
        logs(&first_id).contains("checkpoint step"),
        "the first kept writing"
    );

    // Both stop; a third attempt resumes from the second's checkpoint, the newest attempt's,
    // not from the stale attempt's newer steps.
    shared.offer_desired(desired(3, vec![]));
    r.pass().await.expect("stop both");
    let second_last = newest_step(&second_dir).expect("second's last checkpoint");
    let third = lease(23, 11, 3, 2, trainer(5));
    shared.offer_desired(desired(4, vec![third]));
    r.pass().await.expect("start the third attempt");
    let (third_id, third_c) = container_of(&node, 23);
    assert_eq!(
        env_of(&third_c, "NIGHTSHIFT_RESUMED_FROM_EPOCH").as_deref(),
        Some("8")
    );
    let resumed = wait_for(
        "the third attempt to start",
        Duration::from_secs(30),
        || async {
            logs(&third_id)
                .lines()
                .find_map(|l| l.strip_prefix("resumed from step "))
                .and_then(|rest| rest.split(' ').next()?.parse::<u64>().ok())
        },
    )
    .await;
    assert_eq!(resumed, second_last, "the newest attempt's checkpoint");
    assert!(
        !first_dir.exists(),
        "the superseded first directory is gone"
    );
}
