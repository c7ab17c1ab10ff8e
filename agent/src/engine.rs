//! The `Engine` port: the container runtime, in the agent's own words.
//!
//! Only `engine/docker.rs` knows about bollard. The reconcile loop sees containers as
//! [`Container`] values found by their labels, and starts them from a [`ContainerSpec`].

pub mod docker;
pub mod registry;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// What to run. The agent builds this from a job's lease or from the replica template.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerSpec {
    /// Container name; unique on the host.
    pub name: String,
    pub image: String,
    /// Replaces the image's entrypoint when non-empty.
    pub entrypoint: Vec<String>,
    /// Replaces the image's command when non-empty.
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub labels: BTreeMap<String, String>,
    pub gpus: GpuAccess,
    /// Host path → container path, read-write.
    pub binds: Vec<(String, String)>,
    /// Publish this container TCP port on the host.
    pub publish: Option<PortPublish>,
    /// The signal `stop` sends first (the image's default when `None`).
    pub stop_signal: Option<String>,
    /// Files placed in the container before it starts: absolute path, content.
    pub files: Vec<(String, Vec<u8>)>,
    /// Supplementary groups (numeric ids) of the container's processes, whatever user the
    /// image runs as: a job's is the group of its directories, which only owner and group
    /// may write.
    pub groups: Vec<u32>,
    /// What a job's accepted `sandbox:` grants beyond an unprivileged container: host
    /// namespaces, capabilities, devices and host mounts.
    pub sandbox: nightshift_common::Sandbox,
}

/// How a container is given its GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum GpuAccess {
    #[default]
    None,
    /// A Docker device request for the NVIDIA runtime, by GPU UUID (or index).
    DeviceRequest { device_ids: Vec<String> },
    /// No device is attached (there is no GPU runtime on this host, e.g. with fake GPUs); the
    /// selection is passed only as `NVIDIA_VISIBLE_DEVICES` and `CUDA_VISIBLE_DEVICES`.
    VisibleDevicesEnv { indices: Vec<u32> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortPublish {
    pub container_port: u16,
    pub host_ip: String,
    /// 0 lets Docker choose a free port; read it back from [`Container::published_port`].
    pub host_port: u16,
}

/// A container the agent manages, as the engine reports it: the planner's view, which it
/// reasons about.
pub use nightshift_planner::{Container, ContainerState};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("container {0} not found")]
    NotFound(String),
    #[error("image {0} not found on this host")]
    ImageMissing(String),
    /// The registry would not give the image: it has no such image or tag, it refused the
    /// credentials, or it could not be reached. Retrying at once is not expected to help.
    #[error("pulling {image} from registry {registry} failed: {reason}")]
    PullFailed {
        image: String,
        registry: String,
        reason: String,
    },
    #[error("{path} in container {container} is larger than {limit} bytes")]
    FileTooLarge {
        container: String,
        path: String,
        limit: u64,
    },
    /// The engine answered and refused to create, prepare or start this container: the
    /// container's specification is at fault (a file under a path that is a file in the
    /// image, an environment value the runtime rejects, a missing entrypoint), not the engine
    /// or the host, so retrying the same container cannot help. Carries the engine's reason.
    #[error("the container engine refused container {container}: {reason}")]
    Refused { container: String, reason: String },
    #[error("container engine: {0}")]
    Other(String),
}

/// An image on the host, as the engine knows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImageInfo {
    /// The engine's image id (`sha256:...`).
    pub id: String,
    /// `repo@sha256:...`, one per registry repository the image was pulled from or pushed
    /// to; empty for an image built or loaded on this host.
    pub repo_digests: Vec<String>,
    /// When it was created, in seconds since the epoch (listings only; 0 when unknown).
    pub created: i64,
    /// Whether a container, running or not, uses it (listings only).
    pub in_use: bool,
}

impl ImageInfo {
    /// `image` pinned to its registry digest (`repo@sha256:...`), when the image came from
    /// that repository; `image` itself when it already names a digest; `None` for an image
    /// known by no registry.
    pub fn pinned(&self, image: &str) -> Option<String> {
        if image.contains('@') {
            return Some(image.to_owned());
        }
        let repo = registry::repository(image);
        self.repo_digests
            .iter()
            .find(|d| d.split_once('@').is_some_and(|(r, _)| r == repo))
            .cloned()
    }
}

/// A container's output as it comes, in chunks (stdout and stderr interleaved).
pub type LogStream = futures_util::stream::BoxStream<'static, Result<Vec<u8>, EngineError>>;

/// The container runtime. Every call is idempotent where the runtime allows it: stopping a
/// stopped container or removing a removed one succeeds.
pub trait Engine: Send + Sync + 'static {
    /// The engine's version, e.g. `Docker 28.2.2 (API 1.50)`.
    fn version(&self) -> impl Future<Output = Result<String, EngineError>> + Send;

    /// Every container, running or not, whose labels include all of `labels`.
    fn list(
        &self,
        labels: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<Vec<Container>, EngineError>> + Send;

    fn inspect(&self, id: &str) -> impl Future<Output = Result<Container, EngineError>> + Send;

    /// Creates and starts a container; returns its id. Fails with `ImageMissing` when the
    /// image is not on the host and `Refused` when the engine answers that it cannot create,
    /// prepare or start this container (nothing is left behind then); any other error (the
    /// engine unreachable, say) is the engine's, not the container's.
    fn run(&self, spec: &ContainerSpec)
    -> impl Future<Output = Result<String, EngineError>> + Send;

    /// The image `image` (a `repo:tag` or `repo@sha256:...` reference) when it is on the
    /// host.
    fn image(
        &self,
        image: &str,
    ) -> impl Future<Output = Result<Option<ImageInfo>, EngineError>> + Send;

    /// Pulls `image` from its registry, with `auth` when given, logging its progress; fails
    /// with `PullFailed` (naming the registry and why) when the registry will not give it.
    fn pull(
        &self,
        image: &str,
        auth: Option<&registry::RegistryAuth>,
    ) -> impl Future<Output = Result<ImageInfo, EngineError>> + Send;

    /// Every image on the host, with when it was created and whether a container uses it.
    fn images(&self) -> impl Future<Output = Result<Vec<ImageInfo>, EngineError>> + Send;

    /// Removes the image `id`, unless a container uses it (then nothing happens).
    fn remove_image(&self, id: &str) -> impl Future<Output = Result<(), EngineError>> + Send;

    /// The directory where the engine keeps its images (Docker's data root), when it says.
    fn data_root(&self) -> impl Future<Output = Result<Option<PathBuf>, EngineError>> + Send;

    /// Sends `signal` (e.g. `SIGTERM`) to the container's main process.
    fn signal(
        &self,
        id: &str,
        signal: &str,
    ) -> impl Future<Output = Result<(), EngineError>> + Send;

    /// Sends the container's stop signal, waits up to `grace`, then kills it.
    fn stop(
        &self,
        id: &str,
        grace: Duration,
    ) -> impl Future<Output = Result<(), EngineError>> + Send;

    fn remove(&self, id: &str) -> impl Future<Output = Result<(), EngineError>> + Send;

    /// The content of the regular file `path` in the container's file system, running or
    /// exited (not yet removed): `None` when there is no such file, `FileTooLarge` above
    /// `limit` bytes. This is how a step's output parameters are read after it exits.
    fn read_file(
        &self,
        id: &str,
        path: &str,
        limit: u64,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, EngineError>> + Send;

    /// The container's standard output alone, its last `limit` bytes at most.
    fn stdout(
        &self,
        id: &str,
        limit: usize,
    ) -> impl Future<Output = Result<String, EngineError>> + Send;

    /// The last `tail` lines (all when `None`) of the container's stdout and stderr.
    fn logs(
        &self,
        id: &str,
        tail: Option<usize>,
    ) -> impl Future<Output = Result<String, EngineError>> + Send;

    /// The container's stdout and stderr: the last `tail` lines (all when `None`), then,
    /// with `follow`, what it writes until it exits.
    fn log_stream(&self, id: &str, tail: Option<usize>, follow: bool) -> LogStream;
}
