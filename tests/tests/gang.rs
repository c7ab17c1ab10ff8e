//! A two-node gang job on the real Docker engine: both members get torchrun's rendezvous
//! variables, and taking back one of its nodes preempts the whole gang, which later resumes.

use std::collections::BTreeMap;
use std::time::Duration;

use nightshift_cli::client::Client;
use nightshift_common::{JobState, ReplicaState};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(60);

/// The environment of each running job container of `node`, by variable.
fn job_env(node: &str) -> Vec<BTreeMap<String, String>> {
    containers(node, "job")
        .into_iter()
        .filter(|(_, _, state)| state == "running")
        .map(|(id, _, _)| {
            let env: Vec<String> =
                serde_json::from_value(docker_inspect(&id)["Config"]["Env"].clone()).unwrap();
            env.into_iter()
                .filter_map(|e| e.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
                .collect()
        })
        .collect()
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_gets_rendezvous_variables_and_is_preempted_and_resumed_whole() {
    init_tracing();
    require_images();
    let (a, b) = (unique_node("gang-a"), unique_node("gang-b"));
    let _cleanup = (Cleanup(a.clone()), Cleanup(b.clone()));
    let dir = tempfile::tempdir().unwrap();
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let mut agents = Vec::new();
    for (node, address) in [(&a, "10.77.0.1"), (&b, "10.77.0.2")] {
        let mut cfg = agent_config(&coordinator.url, node, &dir.path().join(node.as_str()), 2);
        cfg.address = address.to_owned();
        cfg.rendezvous_bind_ip = "127.0.0.1".to_owned();
        agents.push(start_agent(cfg, 2).await.0);
    }
    for node in [&a, &b] {
        wait_for("the replicas to serve", STARTUP, || async {
            serving(&client, node).await.then_some(())
        })
        .await;
    }

    let mut spec = trainer_job("gang", 2, 1_000_000, 20, 40);
    spec.nodes = 2;
    let job = client.submit(&spec).await.unwrap();
    let running = wait_for("the gang to run", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running && job_env(&a).len() + job_env(&b).len() == 2).then_some(j)
    })
    .await;
    let rank0 = running
        .leases
        .iter()
        .find(|l| l.rank == 0)
        .unwrap()
        .node
        .clone();
    let master = if rank0 == a { "10.77.0.1" } else { "10.77.0.2" };
    let mut ranks = Vec::new();
    for env in job_env(&a).into_iter().chain(job_env(&b)) {
        assert_eq!(env["MASTER_ADDR"], master, "{env:?}");
        assert_eq!(env["MASTER_PORT"], format!("{}", 29_500 + job.id % 1000));
        assert_eq!(
            (env["NNODES"].as_str(), env["WORLD_SIZE"].as_str()),
            ("2", "4")
        );
        assert_eq!(env["NPROC_PER_NODE"], "2");
        ranks.push(env["NODE_RANK"].clone());
    }
    ranks.sort();
    assert_eq!(ranks, ["0", "1"]);

    // Demand returns while both nodes are lent: one node is taken back, and the whole gang stops.
    wait_for("a checkpoint", STARTUP, || async {
        client
            .job(job.id)
            .await
            .ok()?
            .last_checkpoint_at
            .map(|_| ())
    })
    .await;
    let gateway = nightshift_common::GatewaySignals { waiting: 5 };
    reqwest::Client::new()
        .post(format!("{}/v1/services/default/gateway", coordinator.url))
        .json(&gateway)
        .send()
        .await
        .unwrap();
    let requeued = wait_for("the gang to be requeued", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Queued || (j.attempt == 2 && j.state != JobState::Preempting))
            .then_some(j)
    })
    .await;
    assert_eq!(
        (requeued.attempt, requeued.preemptions, requeued.failures),
        (2, 1, 0)
    );
    assert!(
        job_env(&a).is_empty() && job_env(&b).is_empty(),
        "no member runs on after the preemption"
    );

    // Demand gone: the gang is placed again, whole, and resumes.
    let resumed = wait_for("the gang to resume", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running
            && j.attempt == 2
            && job_env(&a).len() + job_env(&b).len() == 2)
            .then_some(j)
    })
    .await;
    assert_eq!(resumed.leases.len(), 2);
    for env in job_env(&a).into_iter().chain(job_env(&b)) {
        assert_eq!(
            (
                env["NIGHTSHIFT_ATTEMPT"].as_str(),
                env["NIGHTSHIFT_RESUMING"].as_str()
            ),
            ("2", "1")
        );
    }
    client.cancel(job.id).await.unwrap();
    for agent in agents {
        agent.stop();
    }
}
