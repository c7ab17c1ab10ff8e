//! The agent's ports over the host model, for tests without Docker, NVML or vLLM.
//!
//! One [`FakeNode`] is a [`nightshift_hostmodel::Host`], the pure virtual-time host that the
//! fleet simulator and the coordinator's scenario tests run too, seen through the agent's
//! ports: [`FakeEngine`] ([`crate::engine::Engine`]), [`FakeHostGpus`]
//! ([`crate::gpus::Gpus`]) and [`FakeVllm`] ([`crate::serving::ServingMetrics`]), so that
//! what the agent does to one port shows in the others, as on a real host. The model's time is
//! tokio's, counted from the node's creation: under `tokio::time::pause()` a test runs a
//! minute-long drain in microseconds, and a port's call that takes time (a stop, a pull, a
//! sleep) waits on tokio's clock until the model says it returns. The host's own facts are
//! [`crate::host::FixedHost`].
//!
//! What a container does is its image's [`Behaviour`]; failures are injected by the test: an
//! image that is missing or refused, a vLLM whose sleep frees too little memory or fails, a
//! container that ignores its signal, an engine that stops.

mod engine;
mod gpus;
mod vllm;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nightshift_common::labels;
use nightshift_hostmodel::{Exit, Host, Proc, Timings, Workload};
use nightshift_planner::Moment;
use tokio::time::Instant;

use crate::engine::registry::repository;
use crate::engine::{Container, GpuAccess};
use crate::gpus::fake::FakeGpus;

pub use engine::{EngineCall, FakeEngine};
pub use gpus::FakeHostGpus;
pub use vllm::{FakeVllm, VllmCall};

const GIB: u64 = 1 << 30;

/// How the containers of one image behave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behaviour {
    /// Exits on its own this long after it starts, with this code; runs until stopped when
    /// `None`.
    pub exits_after: Option<(Duration, i64)>,
    /// Ignores its stop signal: only the kill at the end of the grace period ends it.
    pub ignores_signal: bool,
    /// How long it takes to exit after its stop signal (saving a checkpoint, say).
    pub exits_on_signal_after: Duration,
    /// Its exit code after the stop signal.
    pub signal_exit_code: i64,
    /// What it writes to standard output.
    pub stdout: String,
    /// Files it leaves in its file system (absolute path, content), beside its spec's.
    pub files: Vec<(String, Vec<u8>)>,
    /// GPU memory it holds on each of its GPUs while it runs.
    pub memory_bytes: u64,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            exits_after: None,
            ignores_signal: false,
            exits_on_signal_after: Duration::from_millis(100),
            signal_exit_code: 143,
            stdout: String::new(),
            files: Vec::new(),
            memory_bytes: 10 * GIB,
        }
    }
}

/// How the vLLM in the replica container behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmBehaviour {
    /// `/health` answers 200 this long after the container starts (the model loads).
    pub healthy_after: Duration,
    /// GPU memory held on each GPU while awake.
    pub awake_bytes: u64,
    /// GPU memory still held on each GPU while asleep (its CUDA context), or more when
    /// sleeping frees too little.
    pub asleep_bytes: u64,
    /// `/sleep` fails.
    pub sleep_fails: bool,
    /// `/wake_up` fails.
    pub wake_fails: bool,
    /// `/is_sleeping` answers (vLLM's dev mode).
    pub dev_mode: bool,
}

impl Default for VllmBehaviour {
    fn default() -> Self {
        Self {
            healthy_after: Duration::from_secs(5),
            awake_bytes: 70 * GIB,
            asleep_bytes: 1_300_000_000,
            sleep_fails: false,
            wake_fails: false,
            dev_mode: true,
        }
    }
}

/// The images' behaviours: the model's workload.
#[derive(Debug, Default)]
struct Behaviours(BTreeMap<String, Behaviour>);

impl Behaviours {
    fn of(&self, p: Proc<'_>) -> Behaviour {
        self.0.get(p.image).cloned().unwrap_or_default()
    }
}

impl Workload for Behaviours {
    fn ends_at(&self, p: Proc<'_>, started: Moment) -> Option<Moment> {
        self.of(p).exits_after.map(|(after, _)| started + after)
    }

    fn save(&self, p: Proc<'_>) -> Duration {
        let b = self.of(p);
        if b.ignores_signal {
            Duration::MAX
        } else {
            b.exits_on_signal_after
        }
    }

    fn exited(&mut self, _exit: &Exit) {}

    fn exit_code(&self, p: Proc<'_>) -> i64 {
        self.of(p).exits_after.map_or(0, |(_, code)| code)
    }

    fn signal_code(&self, p: Proc<'_>) -> i64 {
        self.of(p).signal_exit_code
    }

    fn memory(&self, p: Proc<'_>) -> Option<u64> {
        Some(self.of(p).memory_bytes)
    }
}

#[derive(Debug)]
struct World {
    host: Host,
    /// Where the model's time begins on tokio's clock.
    origin: Instant,
    behaviours: Behaviours,
    engine_calls: Vec<EngineCall>,
    starts: Vec<Start>,
    vllm_calls: Vec<VllmCall>,
}

impl World {
    /// Moves the host to now; returns now.
    fn settle(&mut self) -> Moment {
        let now = Moment::from_origin(Instant::now().duration_since(self.origin));
        self.host.advance(now, &mut self.behaviours);
        now
    }

    /// A moment of the model on tokio's clock.
    fn instant(&self, at: Moment) -> Instant {
        self.origin + at.since_origin()
    }
}

/// A container started, and what its GPUs held at that moment: what the invariant "a job
/// never starts until NVML shows the GPU's memory free" is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub id: String,
    pub labels: BTreeMap<String, String>,
    pub gpus: Vec<u32>,
    /// The most memory any of its GPUs held, from other containers, when it started.
    pub held_bytes: u64,
}

/// A fake host: one host model seen through the engine, GPU and vLLM ports.
#[derive(Clone)]
pub struct FakeNode {
    world: Arc<Mutex<World>>,
    pub engine: Arc<FakeEngine>,
    pub vllm: Arc<FakeVllm>,
    pub gpus: Arc<FakeHostGpus>,
}

impl FakeNode {
    /// A host named `node` with `gpus` idle GPUs, no container, a driver that shows memory
    /// free 2 s after a container ends, pulls that take a second, and a vLLM of
    /// [`VllmBehaviour::default`] that stops 100 ms after its signal.
    pub fn new(node: &str, gpus: u32) -> Self {
        let timings = Timings {
            replica_stop: Duration::from_millis(100),
            sleep: Duration::ZERO,
            wake: Duration::ZERO,
            job_memory: Behaviour::default().memory_bytes,
            frees_after: Duration::from_secs(2),
            ..Timings::default()
        };
        let mut host = Host::new(node, gpus, timings);
        host.images.pull_takes = Duration::from_secs(1);
        let world = Arc::new(Mutex::new(World {
            host,
            origin: Instant::now(),
            behaviours: Behaviours::default(),
            engine_calls: Vec::new(),
            starts: Vec::new(),
            vllm_calls: Vec::new(),
        }));
        let node = Self {
            engine: Arc::new(FakeEngine::new(world.clone())),
            vllm: Arc::new(FakeVllm::new(world.clone())),
            gpus: Arc::new(FakeHostGpus::new(world.clone(), FakeGpus::new(node, gpus))),
            world,
        };
        node.set_vllm(VllmBehaviour::default());
        node
    }

    fn world(&self) -> MutexGuard<'_, World> {
        lock(&self.world)
    }

    /// Containers of `image` behave so from now on.
    pub fn behave(&self, image: &str, behaviour: Behaviour) {
        self.world()
            .behaviours
            .0
            .insert(image.to_owned(), behaviour);
    }

    /// Running `image` fails: it is not on the host.
    pub fn image_missing(&self, image: &str) {
        self.world().host.lose_image(image);
    }

    /// `image` (`repo:tag`) is in the registry as `digest` (`sha256:...`), behind `user` and
    /// `password` when given, and not on the host: a job needs it pulled. Publishing a tag
    /// again moves it; the host keeps what it pulled.
    pub fn publish(&self, image: &str, digest: &str, credentials: Option<(&str, &str)>) {
        let pinned = format!("{}@{digest}", repository(image));
        self.world()
            .host
            .images
            .publish(image, &pinned, credentials);
    }

    /// A pull takes this long.
    pub fn set_pull_takes(&self, takes: Duration) {
        self.world().host.images.pull_takes = takes;
    }

    /// Removes `image` (a tag) from the host, as `docker rmi` would; a pinned reference
    /// pulled with it stays until that is removed too.
    pub fn remove_image(&self, image: &str) {
        self.world().host.lose_image(image);
    }

    /// Running `image` fails: the engine refuses it, saying `reason`.
    pub fn refuse_image(&self, image: &str, reason: &str) {
        self.world().host.images.refuse(image, reason);
    }

    /// Stops the engine as `systemctl stop docker` does: every running container is
    /// stopped, and every call fails until [`FakeNode::start_engine`].
    pub fn stop_engine(&self) {
        let mut w = self.world();
        let now = w.settle();
        let World {
            host, behaviours, ..
        } = &mut *w;
        host.stop_engine(now, behaviours);
    }

    /// Starts the engine again: it answers, with its containers as they were left.
    pub fn start_engine(&self) {
        self.world().host.start_engine();
    }

    /// The driver shows a GPU's memory free this long after its container ended.
    pub fn set_memory_frees_after(&self, after: Duration) {
        self.world().host.timings.frees_after = after;
    }

    /// The vLLM in the replica container behaves so from now on (its load time, from the
    /// next start).
    pub fn set_vllm(&self, vllm: VllmBehaviour) {
        let mut w = self.world();
        let now = w.settle();
        let host = &mut w.host;
        host.timings.replica_start = vllm.healthy_after;
        host.timings.replica_memory = vllm.awake_bytes;
        host.timings.asleep_memory = vllm.asleep_bytes;
        host.fail_sleeps(if vllm.sleep_fails {
            Moment::from_origin(Duration::MAX)
        } else {
            now
        });
        host.wake_fails = vllm.wake_fails;
        host.vllm_dev_mode = vllm.dev_mode;
    }

    /// `total` requests in flight from now on, one finishing every `every`, at most
    /// `max_running` running at once and the rest waiting.
    pub fn set_load(&self, total: u64, max_running: u64, every: Duration) {
        let mut w = self.world();
        let now = w.settle();
        w.host.queue(total, max_running, every, now);
    }

    /// Every container, as the engine lists it: the replica first.
    pub fn containers(&self) -> Vec<Container> {
        let mut w = self.world();
        w.settle();
        w.host.containers()
    }

    /// The containers whose role label is `role`.
    pub fn containers_of(&self, role: &str) -> Vec<Container> {
        self.containers()
            .into_iter()
            .filter(|c| c.labels.get(labels::ROLE).map(String::as_str) == Some(role))
            .collect()
    }

    /// Writes `content` at `path` in container `id`'s file system.
    pub fn write_file(&self, id: &str, path: &str, content: &[u8]) {
        self.world().host.write_file(id, path, content);
    }

    /// Whether the replica's vLLM sleeps; `None` when no replica runs.
    pub fn replica_asleep(&self) -> Option<bool> {
        let mut w = self.world();
        w.settle();
        w.host.replica_asleep()
    }

    /// The memory in use on GPU `index` now.
    pub fn memory_used(&self, index: u32) -> u64 {
        let mut w = self.world();
        w.settle();
        w.host.gpu_used(index)
    }

    /// Every container started, oldest first, with what its GPUs held then.
    pub fn starts(&self) -> Vec<Start> {
        self.world().starts.clone()
    }

    /// Calls made through the engine port, oldest first.
    pub fn engine_calls(&self) -> Vec<EngineCall> {
        self.world().engine_calls.clone()
    }

    /// Calls made through the vLLM port that change it (sleep, wake up), oldest first.
    pub fn vllm_calls(&self) -> Vec<VllmCall> {
        self.world().vllm_calls.clone()
    }
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on tokio's clock until the model's moment `at`; `None`: forever.
async fn until(world: &Mutex<World>, at: Option<Moment>) {
    match at {
        Some(at) => {
            let at = lock(world).instant(at);
            tokio::time::sleep_until(at).await;
        }
        None => std::future::pending().await,
    }
}

/// The host GPU indices a container is given.
fn gpu_indices(access: &GpuAccess) -> Vec<u32> {
    match access {
        GpuAccess::None => Vec::new(),
        GpuAccess::VisibleDevicesEnv { indices } => indices.clone(),
        GpuAccess::DeviceRequest { device_ids } => device_ids
            .iter()
            .filter_map(|d| d.rsplit('-').next()?.parse().ok())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{ContainerSpec, ContainerState, Engine, EngineError};
    use crate::gpus::Gpus;
    use crate::serving::{Health, ServingMetrics};

    fn spec(name: &str, image: &str, role: &str, gpus: Vec<u32>) -> ContainerSpec {
        ContainerSpec {
            name: name.into(),
            image: image.into(),
            labels: BTreeMap::from([(labels::ROLE.to_owned(), role.to_owned())]),
            gpus: GpuAccess::VisibleDevicesEnv { indices: gpus },
            ..ContainerSpec::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn containers_exit_alone_take_their_signal_or_are_killed_after_the_grace() {
        let node = FakeNode::new("n", 2);
        node.behave(
            "done:1",
            Behaviour {
                exits_after: Some((Duration::from_secs(3), 2)),
                ..Behaviour::default()
            },
        );
        node.behave(
            "deaf:1",
            Behaviour {
                ignores_signal: true,
                ..Behaviour::default()
            },
        );
        let e = &node.engine;
        let done = e.run(&spec("a", "done:1", "job", vec![0])).await.unwrap();
        let deaf = e.run(&spec("b", "deaf:1", "job", vec![1])).await.unwrap();
        let polite = e.run(&spec("c", "polite:1", "job", vec![])).await.unwrap();
        tokio::time::sleep(Duration::from_secs(4)).await;
        let state = |id: &str| {
            node.containers()
                .into_iter()
                .find(|c| c.id == id)
                .map(|c| c.state)
        };
        assert_eq!(state(&done), Some(ContainerState::Exited { exit_code: 2 }));
        let t = Instant::now();
        e.stop(&polite, Duration::from_secs(10)).await.unwrap();
        assert_eq!(t.elapsed(), Duration::from_millis(100));
        assert_eq!(
            state(&polite),
            Some(ContainerState::Exited { exit_code: 143 })
        );
        let t = Instant::now();
        e.stop(&deaf, Duration::from_secs(10)).await.unwrap();
        assert_eq!(t.elapsed(), Duration::from_secs(10));
        assert_eq!(
            state(&deaf),
            Some(ContainerState::Exited { exit_code: 137 })
        );
        node.image_missing("gone:1");
        assert!(matches!(
            e.run(&spec("d", "gone:1", "job", vec![])).await,
            Err(EngineError::ImageMissing(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_container_whose_work_ends_while_it_saves_exits_with_its_own_code() {
        let node = FakeNode::new("n", 1);
        node.behave(
            "nearly-done:1",
            Behaviour {
                exits_after: Some((Duration::from_secs(3), 0)),
                exits_on_signal_after: Duration::from_secs(5),
                ..Behaviour::default()
            },
        );
        let e = &node.engine;
        let id = e
            .run(&spec("a", "nearly-done:1", "job", vec![0]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = Instant::now();
        e.stop(&id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(t.elapsed(), Duration::from_secs(1), "its work ended first");
        assert_eq!(
            e.inspect(&id).await.unwrap().state,
            ContainerState::Exited { exit_code: 0 }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn gpu_memory_frees_some_time_after_its_container_ends() {
        let node = FakeNode::new("n", 2);
        node.set_memory_frees_after(Duration::from_secs(2));
        let id = node
            .engine
            .run(&spec("a", "t:1", "job", vec![1]))
            .await
            .unwrap();
        let used = |i: u32| node.gpus.status().unwrap()[i as usize].memory_used_bytes;
        assert_eq!((used(0), used(1)), (0, 10 * GIB));
        node.engine.stop(&id, Duration::from_secs(5)).await.unwrap();
        node.engine.remove(&id).await.unwrap();
        assert_eq!(used(1), 10 * GIB, "the driver still shows it");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(used(1), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn vllm_loads_drains_slowly_sleeps_and_wakes() {
        let node = FakeNode::new("n", 1);
        let v = &node.vllm;
        node.engine
            .run(&spec("r", "vllm", labels::ROLE_REPLICA, vec![0]))
            .await
            .unwrap();
        assert_eq!(v.health("u").await, Health::Unreachable, "loading");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(v.health("u").await, Health::Healthy);
        node.set_load(5, 2, Duration::from_secs(1));
        let s = v.signals("u").await;
        assert_eq!(
            (s.requests_running, s.requests_waiting),
            (Some(2.0), Some(3.0))
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        let s = v.signals("u").await;
        assert_eq!(
            (s.requests_running, s.requests_waiting),
            (Some(1.0), Some(0.0))
        );
        assert_eq!(node.memory_used(0), 70 * GIB);
        // `mode=wait`: the last request finishes first.
        let t = Instant::now();
        v.sleep("u", 1, Duration::from_secs(60)).await.unwrap();
        assert_eq!(t.elapsed(), Duration::from_secs(1));
        assert_eq!(v.is_sleeping("u").await, Some(true));
        assert_eq!(node.memory_used(0), 1_300_000_000);
        v.wake_up("u", Duration::from_secs(60)).await.unwrap();
        assert_eq!(v.is_sleeping("u").await, Some(false));
        assert_eq!(
            node.vllm_calls(),
            [VllmCall::Sleep { level: 1 }, VllmCall::WakeUp]
        );
    }
}
