//! A two-node gang job on the real Docker engine: both members get torchrun's rendezvous
//! variables, and taking back one of its nodes preempts the whole gang, which later resumes.
//! Its members start together: none starts while another's host still pulls its image, and
//! a member whose pull fails fails the gang with no member started.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use nightshift_agent::engine::docker::DockerEngine;
use nightshift_agent::engine::registry::RegistryAuth;
use nightshift_agent::engine::{
    Container, ContainerSpec, Engine, EngineError, ImageInfo, LogStream,
};
use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_agent::serving::http::HttpServing;
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

/// What a [`Gated`] engine does with its image.
const HOLD: u8 = 0;
const OPEN: u8 = 1;
const FAIL: u8 = 2;

/// The real engine, except that one image is missing from it while its gate holds: a pull of
/// it waits until the gate opens (the image "arrives") or fails (the registry refuses).
#[derive(Clone)]
struct Gated {
    inner: Arc<DockerEngine>,
    image: String,
    gate: Arc<AtomicU8>,
    pulls: Arc<AtomicUsize>,
}

impl Gated {
    fn hidden(&self, image: &str) -> bool {
        image == self.image && self.gate.load(Ordering::SeqCst) != OPEN
    }
}

impl Engine for Gated {
    async fn version(&self) -> Result<String, EngineError> {
        self.inner.version().await
    }
    async fn list(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Container>, EngineError> {
        self.inner.list(labels).await
    }
    async fn inspect(&self, id: &str) -> Result<Container, EngineError> {
        self.inner.inspect(id).await
    }
    async fn run(&self, spec: &ContainerSpec) -> Result<String, EngineError> {
        if self.hidden(&spec.image) {
            return Err(EngineError::ImageMissing(spec.image.clone()));
        }
        self.inner.run(spec).await
    }
    async fn image(&self, image: &str) -> Result<Option<ImageInfo>, EngineError> {
        if self.hidden(image) {
            return Ok(None);
        }
        self.inner.image(image).await
    }
    async fn pull(
        &self,
        image: &str,
        auth: Option<&RegistryAuth>,
    ) -> Result<ImageInfo, EngineError> {
        if image != self.image {
            return self.inner.pull(image, auth).await;
        }
        self.pulls.fetch_add(1, Ordering::SeqCst);
        loop {
            match self.gate.load(Ordering::SeqCst) {
                OPEN => break,
                FAIL => {
                    return Err(EngineError::PullFailed {
                        image: image.to_owned(),
                        registry: "registry.test".to_owned(),
                        reason: "manifest unknown".to_owned(),
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let found = self.inner.image(image).await?;
        found.ok_or_else(|| EngineError::ImageMissing(image.to_owned()))
    }
    async fn images(&self) -> Result<Vec<ImageInfo>, EngineError> {
        self.inner.images().await
    }
    async fn remove_image(&self, id: &str) -> Result<(), EngineError> {
        self.inner.remove_image(id).await
    }
    async fn data_root(&self) -> Result<Option<PathBuf>, EngineError> {
        self.inner.data_root().await
    }
    async fn signal(&self, id: &str, signal: &str) -> Result<(), EngineError> {
        self.inner.signal(id, signal).await
    }
    async fn stop(&self, id: &str, grace: Duration) -> Result<(), EngineError> {
        self.inner.stop(id, grace).await
    }
    async fn remove(&self, id: &str) -> Result<(), EngineError> {
        self.inner.remove(id).await
    }
    async fn read_file(
        &self,
        id: &str,
        path: &str,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        self.inner.read_file(id, path, limit).await
    }
    async fn stdout(&self, id: &str, limit: usize) -> Result<String, EngineError> {
        self.inner.stdout(id, limit).await
    }
    async fn logs(&self, id: &str, tail: Option<usize>) -> Result<String, EngineError> {
        self.inner.logs(id, tail).await
    }
    fn log_stream(&self, id: &str, tail: Option<usize>, follow: bool) -> LogStream {
        self.inner.log_stream(id, tail, follow)
    }
}

/// The job containers of `node`, in any state.
fn job_containers(node: &str) -> usize {
    containers(node, "job").len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_member_starts_only_once_every_member_has_its_image() {
    init_tracing();
    require_images();
    let (a, b) = (unique_node("gate-a"), unique_node("gate-b"));
    let _cleanup = (Cleanup(a.clone()), Cleanup(b.clone()));
    let dir = tempfile::tempdir().unwrap();
    let mut config = coordinator_config(&dir.path().join("state"));
    // Rank 0 publishes MASTER_PORT on loopback: not the port of the other gang test's job.
    config.rendezvous_port_base = 29_700;
    let coordinator = TestCoordinator::start(&config).await;
    let client = coordinator.client();
    let docker = Arc::new(DockerEngine::connect().await.expect("docker"));
    let mut gates = BTreeMap::new();
    let mut agents = Vec::new();
    for node in [&a, &b] {
        let gated = Gated {
            inner: docker.clone(),
            image: TRAINER_IMAGE.to_owned(),
            gate: Arc::new(AtomicU8::new(HOLD)),
            pulls: Arc::new(AtomicUsize::new(0)),
        };
        gates.insert(node.clone(), gated.clone());
        let mut cfg = agent_config(&coordinator.url, node, &dir.path().join(node.as_str()), 2);
        cfg.rendezvous_bind_ip = "127.0.0.1".to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gpus = Arc::new(FakeGpus::new(node, 2));
        let serving = HttpServing::new().expect("http client");
        agents.push(
            nightshift_agent::agent::start(cfg, gated, gpus, serving, Some(listener))
                .expect("start agent"),
        );
    }
    for node in [&a, &b] {
        wait_for("the replicas to serve", STARTUP, || async {
            serving(&client, node).await.then_some(())
        })
        .await;
    }

    let mut spec = trainer_job("gated-gang", 2, 1_000_000, 20, 40);
    spec.nodes = 2;
    let job = client.submit(&spec).await.unwrap().id;
    // Both hosts pull; rank 1's image arrives, rank 0's does not yet.
    let leased = wait_for("the gang's leases and both pulls", STARTUP, || async {
        let j = client.job(job).await.ok()?;
        let pulling = gates.values().all(|g| g.pulls.load(Ordering::SeqCst) > 0);
        (j.leases.len() == 2 && pulling).then_some(j)
    })
    .await;
    let rank = |r: u32| {
        leased
            .leases
            .iter()
            .find(|l| l.rank == r)
            .unwrap()
            .node
            .clone()
    };
    let (rank0, rank1) = (rank(0), rank(1));
    gates[&rank1].gate.store(OPEN, Ordering::SeqCst);
    // Rank 1 is ready and rank 0 still pulls: for a while, nothing starts and both serve.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            (job_containers(&rank0), job_containers(&rank1)),
            (0, 0),
            "no member starts before rank 0's image is present"
        );
    }
    assert_eq!(client.job(job).await.unwrap().state, JobState::Starting);
    assert!(
        serving(&client, &rank1).await,
        "rank 1's replica serves on while it waits"
    );
    // Rank 0's image arrives: both members start.
    gates[&rank0].gate.store(OPEN, Ordering::SeqCst);
    wait_for("the gang to run", STARTUP, || async {
        let j = client.job(job).await.ok()?;
        (j.state == JobState::Running && job_env(&a).len() + job_env(&b).len() == 2).then_some(())
    })
    .await;
    client.cancel(job).await.unwrap();
    wait_for("the gang to be cancelled", STARTUP, || async {
        let j = client.job(job).await.ok()?;
        (j.state.is_finished() && job_env(&a).is_empty() && job_env(&b).is_empty()).then_some(())
    })
    .await;

    // A pull that fails on one member fails the gang, and the other member never starts.
    for g in gates.values() {
        g.gate.store(HOLD, Ordering::SeqCst);
    }
    let failing = client.submit(&spec).await.unwrap().id;
    let leased = wait_for("the second gang's leases", STARTUP, || async {
        let j = client.job(failing).await.ok()?;
        (j.leases.len() == 2).then_some(j)
    })
    .await;
    let (first, second) = (&leased.leases[0].node, &leased.leases[1].node);
    gates[second].gate.store(OPEN, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    gates[first].gate.store(FAIL, Ordering::SeqCst);
    let failed = wait_for("the gang to fail", STARTUP, || async {
        assert_eq!(job_containers(second), 0, "the other member never starts");
        let j = client.job(failing).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    assert_eq!(failed.state, JobState::Failed, "{failed:?}");
    let message = failed.message.unwrap_or_default();
    assert!(message.contains("registry registry.test"), "{message}");
    for node in [&a, &b] {
        wait_for("both nodes to serve again", STARTUP, || async {
            serving(&client, node).await.then_some(())
        })
        .await;
    }
    for agent in agents {
        agent.stop();
    }
}
