//! Stateful fakes of the agent's ports, for tests without Docker, NVML or vLLM.
//!
//! One [`FakeNode`] is a small in-memory host: containers that start, run, exit on their own
//! with a code, take their stop signal (or ignore it until the grace kills them); a vLLM in
//! the replica container that becomes healthy after a while, drains its requests slowly,
//! sleeps and wakes; and GPUs whose memory is held by the containers on them and frees only
//! some time after a container ends. Its three handles implement the ports
//! ([`crate::engine::Engine`], [`crate::gpus::Gpus`], [`crate::serving::ServingMetrics`])
//! over that one world, so that what the agent does to one port shows in the others, as on a
//! real host. Time is tokio's: under `tokio::time::pause()` a test runs a minute-long drain
//! in microseconds. The host's own facts are [`crate::host::FixedHost`].
//!
//! Failures are injected by the test: an image that is missing or refused, a vLLM whose sleep
//! frees too little memory or fails, a container that ignores its signal.

mod engine;
mod gpus;
mod vllm;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nightshift_common::labels;
use tokio::time::Instant;

use crate::engine::registry::repository;
use crate::engine::{Container, ContainerState, GpuAccess, ImageInfo};
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

/// Requests in flight on the replica: `total` at `since`, one finishing every `every`, at
/// most `max_running` of them running at once (the rest wait).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Load {
    total: u64,
    max_running: u64,
    every: Duration,
    since: Instant,
}

impl Load {
    fn left(&self, now: Instant) -> u64 {
        if self.every.is_zero() {
            return 0;
        }
        let done =
            (now.saturating_duration_since(self.since).as_nanos() / self.every.as_nanos()) as u64;
        self.total.saturating_sub(done)
    }
}

#[derive(Debug, Clone)]
struct FakeContainer {
    container: Container,
    gpus: Vec<u32>,
    behaviour: Behaviour,
    started_at: Instant,
    /// When it ends on its own or after a signal, and with what code.
    ends: Option<(Instant, i64)>,
    /// When it ended.
    ended_at: Option<Instant>,
    /// The files in its file system.
    files: BTreeMap<String, Vec<u8>>,
    /// vLLM asleep (the replica only).
    asleep: bool,
}

impl FakeContainer {
    fn is_replica(&self) -> bool {
        self.container.labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_REPLICA)
    }

    /// Moves it to `Exited` once its end has come.
    fn settle(&mut self, now: Instant) {
        if let (ContainerState::Running, Some((at, code))) = (self.container.state, self.ends)
            && now >= at
        {
            self.container.state = ContainerState::Exited { exit_code: code };
            self.ended_at = Some(at);
        }
    }

    fn running(&self) -> bool {
        self.container.state == ContainerState::Running
    }

    /// The GPU memory it holds on each of its GPUs at `now`: all of it while it runs, and
    /// still for `frees_after` once it ended.
    fn memory(&self, now: Instant, frees_after: Duration, vllm: &VllmBehaviour) -> u64 {
        let held = match self.container.state {
            ContainerState::Running => true,
            ContainerState::Exited { .. } => self.ended_at.is_some_and(|e| now < e + frees_after),
            _ => false,
        };
        match (held, self.is_replica()) {
            (false, _) => 0,
            (true, false) => self.behaviour.memory_bytes,
            (true, true) if self.asleep => vllm.asleep_bytes,
            (true, true) => vllm.awake_bytes,
        }
    }
}

#[derive(Debug)]
struct World {
    next_id: u64,
    containers: BTreeMap<String, FakeContainer>,
    /// Memory still held by removed containers: GPUs, bytes, until when.
    ghosts: Vec<(Vec<u32>, u64, Instant)>,
    missing_images: BTreeSet<String>,
    /// Images pulled onto the host, by tag and by pinned reference.
    images: BTreeMap<String, ImageInfo>,
    /// Pinned reference → the tag it was pulled for.
    pinned: BTreeMap<String, String>,
    /// The registry's images, by `repo:tag` and by every `repo@digest` ever published.
    registry: BTreeMap<String, RemoteImage>,
    /// How long a pull takes.
    pull_takes: Duration,
    /// Counts pulls: a pulled image's creation time, so that the first pulled is the oldest.
    clock: i64,
    refused_images: BTreeMap<String, String>,
    behaviours: BTreeMap<String, Behaviour>,
    /// How long the driver takes to show a GPU's memory free after its container ended.
    frees_after: Duration,
    vllm: VllmBehaviour,
    load: Option<Load>,
    engine_calls: Vec<EngineCall>,
    starts: Vec<Start>,
    vllm_calls: Vec<VllmCall>,
    /// The engine is stopped: every call fails, as a stopped dockerd's socket does.
    engine_down: bool,
}

/// An image in the fake registry.
#[derive(Debug, Clone)]
struct RemoteImage {
    /// `repo@sha256:...`.
    pinned: String,
    /// The tag it was published as.
    tag: String,
    /// The user and password it asks for, if any.
    credentials: Option<(String, String)>,
}

impl World {
    /// `image` when it is on the host: pulled, or any image not marked missing (built or
    /// loaded there, known by no registry); a digest reference only once pulled.
    fn image(&self, image: &str) -> Option<ImageInfo> {
        if let Some(info) = self.images.get(image) {
            return Some(info.clone());
        }
        (!self.missing_images.contains(image) && !image.contains('@')).then(|| ImageInfo {
            id: format!("sha256:fake-{image}"),
            ..ImageInfo::default()
        })
    }

    fn settle(&mut self) {
        let now = Instant::now();
        for c in self.containers.values_mut() {
            c.settle(now);
        }
        self.ghosts.retain(|(_, _, until)| now < *until);
    }

    /// The running replica container.
    fn replica(&mut self) -> Option<&mut FakeContainer> {
        self.settle();
        self.containers
            .values_mut()
            .find(|c| c.is_replica() && c.running())
    }

    fn memory_used(&self, gpu: u32) -> u64 {
        let now = Instant::now();
        let held: u64 = self
            .containers
            .values()
            .filter(|c| c.gpus.contains(&gpu))
            .map(|c| c.memory(now, self.frees_after, &self.vllm))
            .sum();
        let ghosts: u64 = self
            .ghosts
            .iter()
            .filter(|(gpus, _, until)| gpus.contains(&gpu) && now < *until)
            .map(|(_, bytes, _)| bytes)
            .sum();
        held + ghosts
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

/// A fake host: one world seen through the engine, GPU and vLLM ports.
#[derive(Clone)]
pub struct FakeNode {
    world: Arc<Mutex<World>>,
    pub engine: Arc<FakeEngine>,
    pub vllm: Arc<FakeVllm>,
    pub gpus: Arc<FakeHostGpus>,
}

impl FakeNode {
    /// A host named `node` with `gpus` idle GPUs, no container, a driver that shows memory
    /// free 2 s after a container ends, and a vLLM of [`VllmBehaviour::default`].
    pub fn new(node: &str, gpus: u32) -> Self {
        let world = Arc::new(Mutex::new(World {
            next_id: 1,
            containers: BTreeMap::new(),
            ghosts: Vec::new(),
            missing_images: BTreeSet::new(),
            images: BTreeMap::new(),
            pinned: BTreeMap::new(),
            registry: BTreeMap::new(),
            pull_takes: Duration::from_secs(1),
            clock: 0,
            refused_images: BTreeMap::new(),
            behaviours: BTreeMap::new(),
            frees_after: Duration::from_secs(2),
            vllm: VllmBehaviour::default(),
            load: None,
            engine_calls: Vec::new(),
            starts: Vec::new(),
            vllm_calls: Vec::new(),
            engine_down: false,
        }));
        Self {
            engine: Arc::new(FakeEngine::new(world.clone())),
            vllm: Arc::new(FakeVllm::new(world.clone())),
            gpus: Arc::new(FakeHostGpus::new(world.clone(), FakeGpus::new(node, gpus))),
            world,
        }
    }

    fn world(&self) -> MutexGuard<'_, World> {
        lock(&self.world)
    }

    /// Containers of `image` behave so from now on.
    pub fn behave(&self, image: &str, behaviour: Behaviour) {
        self.world().behaviours.insert(image.to_owned(), behaviour);
    }

    /// Running `image` fails: it is not on the host.
    pub fn image_missing(&self, image: &str) {
        self.world().missing_images.insert(image.to_owned());
    }

    /// `image` (`repo:tag`) is in the registry as `digest` (`sha256:...`), behind `user` and
    /// `password` when given, and not on the host: a job needs it pulled. Publishing a tag
    /// again moves it; the host keeps what it pulled.
    pub fn publish(&self, image: &str, digest: &str, credentials: Option<(&str, &str)>) {
        let mut w = self.world();
        let remote = RemoteImage {
            pinned: format!("{}@{digest}", repository(image)),
            tag: image.to_owned(),
            credentials: credentials.map(|(u, p)| (u.to_owned(), p.to_owned())),
        };
        w.registry.insert(remote.pinned.clone(), remote.clone());
        w.registry.insert(image.to_owned(), remote);
        if !w.images.contains_key(image) {
            w.missing_images.insert(image.to_owned());
        }
    }

    /// A pull takes this long.
    pub fn set_pull_takes(&self, takes: Duration) {
        self.world().pull_takes = takes;
    }

    /// Removes `image` (a tag) from the host, as `docker rmi` would; a pinned reference
    /// pulled with it stays until that is removed too.
    pub fn remove_image(&self, image: &str) {
        let mut w = self.world();
        w.images.remove(image);
        w.missing_images.insert(image.to_owned());
    }

    /// Running `image` fails: the engine refuses it, saying `reason`.
    pub fn refuse_image(&self, image: &str, reason: &str) {
        self.world()
            .refused_images
            .insert(image.to_owned(), reason.to_owned());
    }

    /// The driver shows a GPU's memory free this long after its container ended.
    /// Stops the engine as `systemctl stop docker` does: every running container is
    /// stopped (SIGTERM: exit code 143), and every call fails until [`FakeNode::start_engine`].
    pub fn stop_engine(&self) {
        let mut w = self.world();
        let now = Instant::now();
        for c in w.containers.values_mut() {
            if c.running() {
                c.container.state = ContainerState::Exited { exit_code: 143 };
                c.ended_at = Some(now);
            }
        }
        w.engine_down = true;
    }

    /// Starts the engine again: it answers, with its containers as they were left.
    pub fn start_engine(&self) {
        self.world().engine_down = false;
    }

    pub fn set_memory_frees_after(&self, after: Duration) {
        self.world().frees_after = after;
    }

    /// The vLLM in the replica container behaves so from now on.
    pub fn set_vllm(&self, vllm: VllmBehaviour) {
        self.world().vllm = vllm;
    }

    /// `total` requests in flight from now on, one finishing every `every`, at most
    /// `max_running` running at once and the rest waiting.
    pub fn set_load(&self, total: u64, max_running: u64, every: Duration) {
        self.world().load = Some(Load {
            total,
            max_running,
            every,
            since: Instant::now(),
        });
    }

    /// Every container, as the engine lists it, oldest first.
    pub fn containers(&self) -> Vec<Container> {
        let mut w = self.world();
        w.settle();
        w.containers.values().map(|c| c.container.clone()).collect()
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
        if let Some(c) = self.world().containers.get_mut(id) {
            c.files.insert(path.to_owned(), content.to_vec());
        }
    }

    /// Whether the replica's vLLM sleeps.
    pub fn replica_asleep(&self) -> Option<bool> {
        self.world().replica().map(|c| c.asleep)
    }

    /// The memory in use on GPU `index` now.
    pub fn memory_used(&self, index: u32) -> u64 {
        let mut w = self.world();
        w.settle();
        w.memory_used(index)
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
    use crate::engine::{ContainerSpec, Engine, EngineError};
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
        v.sleep("u", 1, Duration::from_secs(60)).await.unwrap();
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
