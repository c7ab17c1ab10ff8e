//! Checkpoints that follow a job to another host, against the real Docker engine: a
//! coordinator and two agents (two "hosts" of one engine). With `[checkpoints] storage =
//! "shared"` and the same `shared_dir`, a job preempted on host A resumes on host B from its
//! last checkpoint; with local storage (the default), its next attempt is placed back on A,
//! which holds the checkpoint, although lending would otherwise have taken B first.
//!
//! Host A has 3 fake GPUs and B 2, so that lending's own order (fewest GPUs first) names B;
//! the job asks for 2. A starts alone, so the job's first attempt runs there; B joins before
//! A is taken back (a surge at the gateway).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nightshift_agent::agent::AgentHandle;
use nightshift_agent::config::{AgentConfig, CheckpointStorage};
use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_cli::client::Client;
use nightshift_common::{JobState, JobView, ReplicaState};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(90);

async fn serving(client: &Client, node: &str) -> bool {
    client.nodes().await.is_ok_and(|l| {
        l.nodes.iter().any(|n| {
            n.name == node
                && n.replica
                    .as_ref()
                    .is_some_and(|r| r.state == ReplicaState::Serving)
        })
    })
}

/// Host `node` with `gpus` fake GPUs, its checkpoints under `shared` when given.
fn host(
    coordinator: &str,
    node: &str,
    dir: &Path,
    gpus: u32,
    shared: Option<&Path>,
) -> AgentConfig {
    let mut cfg = agent_config(coordinator, node, &dir.join(node), gpus);
    if let Some(shared) = shared {
        cfg.checkpoints.storage = CheckpointStorage::Shared;
        cfg.checkpoints.shared_dir = Some(shared.to_owned());
    }
    cfg
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

/// The running job container of `node`: its id and inspection.
fn running_job(node: &str) -> Option<(String, serde_json::Value)> {
    let (id, _, _) = containers(node, "job")
        .into_iter()
        .find(|(_, _, state)| state == "running")?;
    let c = docker_inspect(&id);
    Some((id, c))
}

fn env_of(c: &serde_json::Value, key: &str) -> Option<String> {
    let env: Vec<String> = serde_json::from_value(c["Config"]["Env"].clone()).unwrap();
    env.iter()
        .find_map(|e| e.strip_prefix(&format!("{key}=")))
        .map(str::to_owned)
}

fn checkpoint_source(c: &serde_json::Value) -> PathBuf {
    c["Mounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["Destination"] == "/nightshift/checkpoint")
        .and_then(|m| m["Source"].as_str())
        .expect("checkpoint mount")
        .into()
}

/// Where the toy trainer in container `id` resumed from: `Some(step)`, `Some(0)` when it
/// started fresh, `None` before it said.
fn resumed_step(id: &str) -> Option<u64> {
    let out = std::process::Command::new("docker")
        .args(["logs", id])
        .output()
        .expect("docker logs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().find_map(|l| {
        if l.starts_with("starting fresh") {
            return Some(0);
        }
        l.strip_prefix("resumed from step ")?
            .split(' ')
            .next()?
            .parse()
            .ok()
    })
}

/// What the story below found: the first attempt's lease epoch, its checkpoint directory and
/// last checkpoint, and the second attempt's node, container and inspection.
struct Moved {
    first_epoch: u64,
    first_dir: PathBuf,
    last_step: u64,
    second: JobView,
    second_id: String,
    second_c: serde_json::Value,
}

/// A coordinator, host A alone; a job of 2 GPUs runs there and checkpoints; host B joins; a
/// surge takes A back (the job is preempted) and lasts until A serves again;
/// `before_lending` runs; the surge passes and the job runs again.
async fn preempt_on_a_and_run_again(
    prefix: &str,
    shared: bool,
    before_lending: impl FnOnce(&FakeGpus),
) -> (Moved, String, String, Vec<AgentHandle>, tempfile::TempDir) {
    let (a, b) = (
        unique_node(&format!("{prefix}-a")),
        unique_node(&format!("{prefix}-b")),
    );
    let dir = tempfile::tempdir().unwrap();
    let shared_dir = shared.then(|| dir.path().join("shared"));
    if let Some(d) = &shared_dir {
        std::fs::create_dir_all(d).unwrap();
    }
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let gpus_a = Arc::new(FakeGpus::new(&a, 3));
    let (agent_a, _) = start_agent_with(
        host(&coordinator.url, &a, dir.path(), 3, shared_dir.as_deref()),
        gpus_a.clone(),
    )
    .await;
    wait_for("host A to serve", STARTUP, || async {
        serving(&client, &a).await.then_some(())
    })
    .await;

    let job = client
        .submit(&trainer_job("follows", 2, 1_000_000, 20, 20))
        .await
        .unwrap();
    let (first_id, first_c) = wait_for("the job to run on A", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(())?;
        running_job(&a)
    })
    .await;
    assert_eq!(
        env_of(&first_c, "NIGHTSHIFT_RESUMING").as_deref(),
        Some("0")
    );
    let first_dir = checkpoint_source(&first_c);
    let first_epoch: u64 = env_of(&first_c, "NIGHTSHIFT_EPOCH")
        .unwrap()
        .parse()
        .unwrap();
    match &shared_dir {
        Some(d) => assert!(first_dir.starts_with(d), "{}", first_dir.display()),
        None => assert!(first_dir.starts_with(dir.path().join(&a))),
    }
    wait_for("a checkpoint on A", STARTUP, || async {
        let reported = client.job(job.id).await.ok()?.last_checkpoint_at;
        newest_step(&first_dir).filter(|s| *s >= 40 && reported.is_some())
    })
    .await;

    let (agent_b, _) = start_agent(
        host(&coordinator.url, &b, dir.path(), 2, shared_dir.as_deref()),
        2,
    )
    .await;
    wait_for("host B to serve", STARTUP, || async {
        serving(&client, &b).await.then_some(())
    })
    .await;

    // Demand returns: A is taken back and the job preempted (it checkpoints on SIGTERM).
    // The demand is kept up until A serves again, so that both hosts are there to lend once
    // it is gone.
    let surge = || async {
        reqwest::Client::new()
            .post(format!("{}/v1/services/default/gateway", coordinator.url))
            .json(&nightshift_common::GatewaySignals { waiting: 5 })
            .send()
            .await
            .unwrap();
    };
    surge().await;
    wait_for("the job to be preempted", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.preemptions == 1 && j.state != JobState::Preempting).then_some(())
    })
    .await;
    let last_step = newest_step(&first_dir).expect("the first attempt's checkpoint");
    assert!(
        containers(&a, "job")
            .iter()
            .all(|(id, _, state)| state != "running" || *id != first_id)
    );
    wait_for("host A to serve again", STARTUP, || async {
        surge().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        serving(&client, &a).await.then_some(())
    })
    .await;
    before_lending(&gpus_a);
    surge().await;

    // Demand gone: one host is lent again and the job runs, attempt 2.
    let (second, (second_id, second_c)) = wait_for("the job to run again", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running && j.attempt == 2).then_some(())?;
        let node = j.leases.first()?.node.clone();
        Some((j, running_job(&node)?))
    })
    .await;
    client.cancel(job.id).await.unwrap();
    (
        Moved {
            first_epoch,
            first_dir,
            last_step,
            second,
            second_id,
            second_c,
        },
        a,
        b,
        vec![agent_a, agent_b],
        dir,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_shared_storage_a_job_preempted_on_one_host_resumes_on_another() {
    init_tracing();
    require_images();
    // A cannot take the job back (two of its GPUs turn unhealthy once it serves again): the
    // job goes to B, and finds its checkpoint there.
    let (m, a, b, agents, dir) = preempt_on_a_and_run_again("ckshared", true, |gpus| {
        gpus.inject_xid(0, 79).unwrap();
        gpus.inject_xid(1, 79).unwrap();
    })
    .await;
    let _cleanup = (Cleanup(a.clone()), Cleanup(b.clone()));
    assert_eq!(m.second.leases[0].node, b, "placed on the other host");
    let shared = dir.path().join("shared");
    let second_dir = checkpoint_source(&m.second_c);
    assert!(
        second_dir.starts_with(&shared),
        "B's attempt writes the shared directory: {}",
        second_dir.display()
    );
    assert_ne!(second_dir, m.first_dir, "each attempt its own directory");
    assert_eq!(
        env_of(&m.second_c, "NIGHTSHIFT_RESUMING").as_deref(),
        Some("1")
    );
    assert_eq!(
        env_of(&m.second_c, "NIGHTSHIFT_RESUMED_FROM_EPOCH"),
        Some(m.first_epoch.to_string())
    );
    let resumed = wait_for("the trainer on B to start", STARTUP, || async {
        resumed_step(&m.second_id)
    })
    .await;
    assert_eq!(
        resumed, m.last_step,
        "resumed on B from A's last checkpoint"
    );
    assert!(
        !dir.path()
            .join(&b)
            .join("jobs")
            .join(m.second.id.to_string())
            .join("checkpoints")
            .exists(),
        "nothing of the checkpoint under B's work_dir"
    );
    for agent in agents {
        agent.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_local_storage_the_next_attempt_goes_back_to_the_host_holding_the_checkpoint() {
    init_tracing();
    require_images();
    let (m, a, b, agents, dir) = preempt_on_a_and_run_again("cklocal", false, |_| {}).await;
    let _cleanup = (Cleanup(a.clone()), Cleanup(b.clone()));
    assert_eq!(
        m.second.leases[0].node, a,
        "back on A, which holds the checkpoint (lending's own order would take B first)"
    );
    let second_dir = checkpoint_source(&m.second_c);
    assert!(second_dir.starts_with(dir.path().join(&a)));
    assert_eq!(
        env_of(&m.second_c, "NIGHTSHIFT_RESUMING").as_deref(),
        Some("1")
    );
    assert_eq!(
        env_of(&m.second_c, "NIGHTSHIFT_RESUMED_FROM_EPOCH"),
        Some(m.first_epoch.to_string())
    );
    let resumed = wait_for("the trainer on A to start", STARTUP, || async {
        resumed_step(&m.second_id)
    })
    .await;
    assert_eq!(resumed, m.last_step, "resumed from its last checkpoint");
    for agent in agents {
        agent.stop();
    }
}
