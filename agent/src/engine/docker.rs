//! The [`Engine`] adapter for the Docker Engine API, through bollard.
//!
//! This is the only file that knows bollard. It translates a [`ContainerSpec`] into a create
//! request (docker-init as PID 1, no restart policy, GPUs as a device request or as
//! environment) and Docker's answers back into [`Container`] values and [`EngineError`]s.
//! Calls are idempotent where Docker allows it: running a spec whose container already runs
//! returns that container, and stopping or removing a container that is gone succeeds.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bollard::auth::DockerCredentials;
use bollard::errors::Error as DockerError;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerStateStatusEnum, DeviceMapping,
    DeviceRequest, HostConfig, PortBinding, PortMap, RestartPolicy, RestartPolicyNameEnum,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, DownloadFromContainerOptionsBuilder,
    KillContainerOptionsBuilder, ListContainersOptionsBuilder, ListImagesOptionsBuilder,
    LogsOptionsBuilder, RemoveContainerOptionsBuilder, RemoveImageOptionsBuilder,
    StopContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use bollard::{API_DEFAULT_VERSION, Docker};
use futures_util::{StreamExt, TryStreamExt};

use super::registry::{RegistryAuth, registry_of};
use super::{
    Container, ContainerSpec, ContainerState, Engine, EngineError, GpuAccess, ImageInfo, LogStream,
    PortPublish,
};

/// Where bollard looks when `DOCKER_HOST` names no unix socket.
const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";

/// bollard's own request timeout for a local socket, in seconds.
const CONNECT_TIMEOUT_S: u64 = 120;

/// How long a `stop` request may outlast its grace period before the client gives up: Docker
/// answers only once the container has exited, after the kill that follows the grace period.
const STOP_REQUEST_MARGIN: Duration = Duration::from_secs(30);

/// A pull's layer progress is logged at most this often.
const PULL_LOG_EVERY: Duration = Duration::from_secs(5);

/// The Docker engine on this host.
#[derive(Debug, Clone)]
pub struct DockerEngine {
    docker: Docker,
}

impl DockerEngine {
    /// Connects to the local daemon (`DOCKER_HOST` when it is a `unix://` address, else
    /// `/var/run/docker.sock`) and settles on the highest API version both sides speak.
    pub async fn connect() -> Result<Self, EngineError> {
        Self::connect_to(None).await
    }

    /// Connects to the daemon at `host` (a `unix://` address, `[engine] docker_host` of
    /// agent.toml), or where [`DockerEngine::connect`] looks when it is `None`.
    pub async fn connect_to(host: Option<&str>) -> Result<Self, EngineError> {
        let socket = Self::socket(host);
        let unreachable = |err: DockerError| {
            // bollard's own text ("client error (Connect)") hides why: name every cause, so
            // that "permission denied" or "no such file" reaches the operator.
            let reason = nightshift_common::logging::error_message(&err);
            EngineError::Other(format!(
                "cannot reach the docker daemon at {socket}: {reason} \
                 (is dockerd running, and may this user open its socket?)"
            ))
        };
        let docker = Docker::connect_with_unix(&socket, CONNECT_TIMEOUT_S, API_DEFAULT_VERSION)
            .map_err(unreachable)?
            .negotiate_version()
            .await
            .map_err(unreachable)?;
        tracing::info!(socket = %socket, api = %docker.client_version(), "connected to docker");
        Ok(Self { docker })
    }

    /// The socket [`DockerEngine::connect_to`] dials for `host`.
    pub fn socket(host: Option<&str>) -> String {
        host.map_or_else(socket_address, str::to_owned)
    }

    /// The container named `name`, if there is one.
    async fn find_by_name(&self, name: &str) -> Result<Option<Container>, EngineError> {
        match self.inspect(name).await {
            Ok(container) => Ok(Some(container)),
            Err(EngineError::NotFound(_)) => Ok(None),
            Err(err) => Err(err),
        }
    }

    async fn create(&self, spec: &ContainerSpec) -> Result<String, EngineError> {
        let options = CreateContainerOptionsBuilder::new()
            .name(&spec.name)
            .build();
        let created = self
            .docker
            .create_container(Some(options), create_body(spec))
            .await
            .map_err(|err| match err {
                DockerError::DockerResponseServerError {
                    status_code: 404,
                    ref message,
                } if message.to_ascii_lowercase().contains("image") => {
                    EngineError::ImageMissing(spec.image.clone())
                }
                other => refused_or_engine_error(&spec.name, other),
            })?;
        for warning in &created.warnings {
            tracing::warn!(container.name = %spec.name, %warning, "docker create warning");
        }
        Ok(created.id)
    }

    /// Copies `spec.files` into the created (not yet started) container, as one archive
    /// extracted at `/`; missing parent directories are created.
    async fn place_files(&self, spec: &ContainerSpec, id: &str) -> Result<(), EngineError> {
        let mut archive = tar::Builder::new(Vec::new());
        for (path, content) in &spec.files {
            let mut header = tar::Header::new_gnu();
            header.set_size(content.len() as u64);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            archive
                .append_data(
                    &mut header,
                    path.trim_start_matches('/'),
                    content.as_slice(),
                )
                .map_err(|e| EngineError::Refused {
                    container: spec.name.clone(),
                    reason: format!("file {path}: {e}"),
                })?;
        }
        let bytes = archive.into_inner().map_err(|e| EngineError::Refused {
            container: spec.name.clone(),
            reason: format!("files: {e}"),
        })?;
        let options = UploadToContainerOptionsBuilder::new().path("/").build();
        self.docker
            .upload_to_container(id, Some(options), bollard::body_full(bytes.into()))
            .await
            .map_err(|err| match refused_or_engine_error(&spec.name, err) {
                EngineError::Refused { container, reason } => EngineError::Refused {
                    container,
                    reason: format!("placing its files: {reason}"),
                },
                other => other,
            })
    }

    /// Starts a created container; removes it when it cannot start, so that a failed `run`
    /// leaves nothing behind.
    async fn start(&self, spec: &ContainerSpec, id: &str) -> Result<(), EngineError> {
        let Err(err) = self.docker.start_container(id, None).await else {
            return Ok(());
        };
        let err = refused_or_engine_error(&spec.name, err);
        if let Err(cleanup) = self.remove(id).await {
            tracing::warn!(container.id = %id, error = %cleanup, "cannot remove container that failed to start");
        }
        Err(err)
    }
}

impl Engine for DockerEngine {
    async fn version(&self) -> Result<String, EngineError> {
        let version = self
            .docker
            .version()
            .await
            .map_err(|err| engine_error("version", err))?;
        Ok(format!(
            "Docker {} (API {})",
            version.version.as_deref().unwrap_or("unknown"),
            version.api_version.as_deref().unwrap_or("unknown"),
        ))
    }

    async fn list(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Container>, EngineError> {
        let filters = HashMap::from([("label", label_filters(labels))]);
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let summaries = self
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|err| engine_error("list", err))?;
        // The summary carries no exit code; inspect gives the whole, consistent picture.
        let mut containers = Vec::with_capacity(summaries.len());
        for id in summaries.into_iter().filter_map(|summary| summary.id) {
            match self.inspect(&id).await {
                Ok(container) => containers.push(container),
                // Removed between the list and the inspect.
                Err(EngineError::NotFound(_)) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(containers)
    }

    async fn image(&self, image: &str) -> Result<Option<ImageInfo>, EngineError> {
        match self.docker.inspect_image(image).await {
            Ok(found) => Ok(Some(ImageInfo {
                id: found.id.unwrap_or_default(),
                repo_digests: found.repo_digests.unwrap_or_default(),
                ..ImageInfo::default()
            })),
            Err(err) if is_not_found(&err) => Ok(None),
            Err(err) => Err(engine_error(image, err)),
        }
    }

    async fn pull(
        &self,
        image: &str,
        auth: Option<&RegistryAuth>,
    ) -> Result<ImageInfo, EngineError> {
        let registry = registry_of(image);
        let failed = |reason: String| EngineError::PullFailed {
            image: image.to_owned(),
            registry: registry.clone(),
            reason,
        };
        let (from_image, tag) = split_reference(image);
        let mut options = CreateImageOptionsBuilder::new().from_image(from_image);
        if let Some(tag) = tag {
            options = options.tag(tag);
        }
        let credentials = auth.map(|a| DockerCredentials {
            username: Some(a.username.clone()),
            password: Some(a.password.clone()),
            serveraddress: Some(a.server.clone()),
            ..Default::default()
        });
        tracing::info!(image, registry = %registry, authenticated = auth.is_some(), "pulling image");
        let began = std::time::Instant::now();
        let mut stream = self
            .docker
            .create_image(Some(options.build()), None, credentials);
        let mut progress = PullProgress::default();
        while let Some(event) = stream.next().await {
            let info = event.map_err(|err| match err {
                DockerError::DockerResponseServerError { message, .. } => failed(message),
                DockerError::DockerStreamError { error } => failed(error),
                other => engine_error(image, other),
            })?;
            if let Some(detail) = info.error_detail {
                return Err(failed(
                    detail.message.unwrap_or_else(|| "unknown error".into()),
                ));
            }
            progress.note(&info);
            if progress.due(PULL_LOG_EVERY) {
                tracing::info!(
                    image,
                    layers = progress.layers.len(),
                    done = progress.done(),
                    downloaded_bytes = progress.current(),
                    total_bytes = progress.total(),
                    "pulling image"
                );
            }
        }
        let pulled = self.image(image).await?.ok_or_else(|| {
            failed("the engine reported the pull done but has no such image".into())
        })?;
        tracing::info!(
            image, registry = %registry, id = %pulled.id, digests = ?pulled.repo_digests,
            layers = progress.layers.len(), elapsed_s = began.elapsed().as_secs_f64(), "image pulled"
        );
        Ok(pulled)
    }

    async fn images(&self) -> Result<Vec<ImageInfo>, EngineError> {
        let used: std::collections::HashSet<String> = self
            .docker
            .list_containers(Some(ListContainersOptionsBuilder::new().all(true).build()))
            .await
            .map_err(|err| engine_error("images", err))?
            .into_iter()
            .filter_map(|c| c.image_id)
            .collect();
        let images = self
            .docker
            .list_images(Some(ListImagesOptionsBuilder::new().build()))
            .await
            .map_err(|err| engine_error("images", err))?;
        Ok(images
            .into_iter()
            .map(|i| ImageInfo {
                in_use: used.contains(&i.id),
                id: i.id,
                repo_digests: i.repo_digests,
                created: i.created,
            })
            .collect())
    }

    async fn remove_image(&self, id: &str) -> Result<(), EngineError> {
        let options = RemoveImageOptionsBuilder::new().force(false).build();
        match self.docker.remove_image(id, Some(options), None).await {
            Ok(_) => Ok(()),
            // Gone already, or a container uses it (409): nothing to do.
            Err(DockerError::DockerResponseServerError {
                status_code: 404 | 409,
                ..
            }) => Ok(()),
            Err(err) => Err(engine_error(id, err)),
        }
    }

    async fn data_root(&self) -> Result<Option<std::path::PathBuf>, EngineError> {
        let info = self
            .docker
            .info()
            .await
            .map_err(|err| engine_error("info", err))?;
        Ok(info.docker_root_dir.map(Into::into))
    }

    async fn inspect(&self, id: &str) -> Result<Container, EngineError> {
        let response = self
            .docker
            .inspect_container(id, None)
            .await
            .map_err(|err| engine_error(id, err))?;
        Ok(to_container(response))
    }

    async fn run(&self, spec: &ContainerSpec) -> Result<String, EngineError> {
        if let Some(existing) = self.find_by_name(&spec.name).await? {
            if matches!(
                existing.state,
                ContainerState::Running | ContainerState::Transitioning
            ) {
                tracing::debug!(container.name = %spec.name, container.id = %existing.id, "already running");
                return Ok(existing.id);
            }
            tracing::info!(
                container.name = %spec.name, container.id = %existing.id, state = ?existing.state,
                "removing stale container before re-running"
            );
            self.remove(&existing.id).await?;
        }
        let id = self.create(spec).await?;
        if !spec.files.is_empty()
            && let Err(err) = self.place_files(spec, &id).await
        {
            if let Err(cleanup) = self.remove(&id).await {
                tracing::warn!(container.id = %id, error = %cleanup, "cannot remove container whose files could not be placed");
            }
            return Err(err);
        }
        self.start(spec, &id).await?;
        tracing::info!(container.name = %spec.name, container.id = %id, image = %spec.image, "container started");
        Ok(id)
    }

    async fn signal(&self, id: &str, signal: &str) -> Result<(), EngineError> {
        let options = KillContainerOptionsBuilder::new().signal(signal).build();
        match self.docker.kill_container(id, Some(options)).await {
            Ok(()) => {
                tracing::debug!(container.id = %id, signal, "signal sent");
                Ok(())
            }
            // A container that is not running has no process left to tell anything (a paused
            // one, also 409, is an error).
            Err(DockerError::DockerResponseServerError {
                status_code: 409,
                ref message,
            }) if message.contains("is not running") => {
                tracing::debug!(container.id = %id, signal, "signal to a stopped container dropped");
                Ok(())
            }
            Err(err) => Err(engine_error(id, err)),
        }
    }

    async fn stop(&self, id: &str, grace: Duration) -> Result<(), EngineError> {
        let seconds = grace_seconds(grace);
        let options = StopContainerOptionsBuilder::new().t(seconds).build();
        // The request lasts as long as the grace period; the default client timeout may not.
        let docker = self
            .docker
            .clone()
            .with_timeout(grace + STOP_REQUEST_MARGIN);
        match docker.stop_container(id, Some(options)).await {
            // 304 (already stopped) is a success for bollard.
            Ok(()) => {
                tracing::debug!(container.id = %id, grace_s = seconds, "container stopped");
                Ok(())
            }
            Err(err) if is_not_found(&err) => Ok(()),
            Err(err) => Err(engine_error(id, err)),
        }
    }

    async fn remove(&self, id: &str) -> Result<(), EngineError> {
        let options = RemoveContainerOptionsBuilder::new().force(true).build();
        match self.docker.remove_container(id, Some(options)).await {
            Ok(()) => {
                tracing::debug!(container.id = %id, "container removed");
                Ok(())
            }
            Err(err) if is_not_found(&err) => Ok(()),
            Err(err) => Err(engine_error(id, err)),
        }
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        let options = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        // A tar archive of the file: its header, the content, padding. A file within `limit`
        // never needs more than this many bytes of it.
        let budget = limit + 64 * 1024;
        let mut stream = self.docker.download_from_container(id, Some(options));
        let mut archive = Vec::new();
        loop {
            match stream.try_next().await {
                Ok(Some(chunk)) => {
                    archive.extend_from_slice(&chunk);
                    if archive.len() as u64 > budget {
                        return Err(too_large(id, path, limit));
                    }
                }
                Ok(None) => break,
                Err(DockerError::DockerResponseServerError {
                    status_code: 404,
                    message,
                }) if !message.contains("No such container") => return Ok(None),
                Err(err) => return Err(engine_error(id, err)),
            }
        }
        first_file(&archive, limit).map_err(|e| match e {
            TarError::TooLarge => too_large(id, path, limit),
            TarError::Read(e) => EngineError::Other(format!("{id}: archive of {path}: {e}")),
        })
    }

    async fn stdout(&self, id: &str, limit: usize) -> Result<String, EngineError> {
        let options = LogsOptionsBuilder::new()
            .stdout(true)
            .stderr(false)
            .follow(false)
            .tail("all")
            .build();
        let bytes = self
            .docker
            .logs(id, Some(options))
            .try_fold(Vec::new(), |mut bytes, chunk| async move {
                bytes.extend_from_slice(&chunk.into_bytes());
                // Keep the end: drop what is beyond twice the limit as it comes.
                if bytes.len() > 2 * limit {
                    bytes.drain(..bytes.len() - limit);
                }
                Ok(bytes)
            })
            .await
            .map_err(|err| engine_error(id, err))?;
        let start = bytes.len().saturating_sub(limit);
        Ok(String::from_utf8_lossy(&bytes[start..]).into_owned())
    }

    async fn logs(&self, id: &str, tail: Option<usize>) -> Result<String, EngineError> {
        let tail = tail.map_or_else(|| "all".to_owned(), |lines| lines.to_string());
        let options = LogsOptionsBuilder::new()
            .stdout(true)
            .stderr(true)
            .follow(false)
            .tail(&tail)
            .build();
        let bytes = self
            .docker
            .logs(id, Some(options))
            .try_fold(Vec::new(), |mut bytes, chunk| async move {
                bytes.extend_from_slice(&chunk.into_bytes());
                Ok(bytes)
            })
            .await
            .map_err(|err| engine_error(id, err))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn log_stream(&self, id: &str, tail: Option<usize>, follow: bool) -> LogStream {
        let tail = tail.map_or_else(|| "all".to_owned(), |lines| lines.to_string());
        let options = LogsOptionsBuilder::new()
            .stdout(true)
            .stderr(true)
            .follow(follow)
            .tail(&tail)
            .build();
        let subject = id.to_owned();
        Box::pin(
            self.docker
                .logs(id, Some(options))
                .map_ok(|chunk| chunk.into_bytes().to_vec())
                .map_err(move |err| engine_error(&subject, err)),
        )
    }
}

fn too_large(id: &str, path: &str, limit: u64) -> EngineError {
    EngineError::FileTooLarge {
        container: id.to_owned(),
        path: path.to_owned(),
        limit,
    }
}

enum TarError {
    TooLarge,
    Read(std::io::Error),
}

/// The content of the first regular file of a tar archive; `None` when it holds none or
/// starts with a directory (the path was a directory: none of its files is "the" file).
fn first_file(archive: &[u8], limit: u64) -> Result<Option<Vec<u8>>, TarError> {
    use std::io::Read;
    let mut tar = tar::Archive::new(archive);
    for entry in tar.entries().map_err(TarError::Read)? {
        let mut entry = entry.map_err(TarError::Read)?;
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            return Ok(None);
        }
        if !kind.is_file() {
            continue;
        }
        if entry.size() > limit {
            return Err(TarError::TooLarge);
        }
        let mut content = Vec::new();
        entry.read_to_end(&mut content).map_err(TarError::Read)?;
        return Ok(Some(content));
    }
    Ok(None)
}

/// The socket `connect_with_local_defaults` dials, for error messages.
fn socket_address() -> String {
    std::env::var("DOCKER_HOST")
        .ok()
        .filter(|host| host.starts_with("unix://"))
        .unwrap_or_else(|| DEFAULT_SOCKET.to_owned())
}

/// Docker's answer, in the port's words: 404 is `NotFound(subject)`.
fn engine_error(subject: &str, err: DockerError) -> EngineError {
    if is_not_found(&err) {
        EngineError::NotFound(subject.to_owned())
    } else {
        EngineError::Other(format!("{subject}: {err}"))
    }
}

/// An error creating, preparing or starting the container `subject`: the engine's answer is
/// a refusal of this container, carrying the engine's own message; a failure to reach the
/// engine at all is not, nor a conflict (409: a container of that name appeared meanwhile),
/// which the next pass resolves.
fn refused_or_engine_error(subject: &str, err: DockerError) -> EngineError {
    match err {
        DockerError::DockerResponseServerError {
            status_code,
            message,
        } if status_code != 409 => EngineError::Refused {
            container: subject.to_owned(),
            reason: message,
        },
        other => engine_error(subject, other),
    }
}

/// `repo:tag` → (`repo`, `tag`); a digest reference is passed whole as the image.
fn split_reference(image: &str) -> (&str, Option<&str>) {
    if image.contains('@') {
        return (image, None);
    }
    let repo = super::registry::repository(image);
    match image[repo.len()..].strip_prefix(':') {
        Some(tag) => (repo, Some(tag)),
        None => (repo, Some("latest")),
    }
}

/// A pull's layers as Docker reports them, for a progress line every few seconds rather
/// than one per event.
#[derive(Default)]
struct PullProgress {
    /// Layer id → (bytes downloaded, bytes in all, done).
    layers: BTreeMap<String, (i64, i64, bool)>,
    last_log: Option<std::time::Instant>,
}

impl PullProgress {
    fn note(&mut self, info: &bollard::models::CreateImageInfo) {
        let Some(id) = &info.id else { return };
        let layer = self.layers.entry(id.clone()).or_default();
        if let Some(d) = &info.progress_detail
            && info.status.as_deref() == Some("Downloading")
        {
            layer.0 = d.current.unwrap_or(layer.0);
            layer.1 = d.total.unwrap_or(layer.1);
        }
        if matches!(
            info.status.as_deref(),
            Some("Pull complete" | "Already exists" | "Download complete")
        ) {
            layer.0 = layer.1;
            layer.2 = info.status.as_deref() != Some("Download complete");
        }
    }

    fn due(&mut self, every: Duration) -> bool {
        let now = std::time::Instant::now();
        match self.last_log {
            Some(t) if now.duration_since(t) < every => false,
            _ => {
                self.last_log = Some(now);
                true
            }
        }
    }

    fn done(&self) -> usize {
        self.layers.values().filter(|l| l.2).count()
    }

    fn current(&self) -> i64 {
        self.layers.values().map(|l| l.0).sum()
    }

    fn total(&self) -> i64 {
        self.layers.values().map(|l| l.1).sum()
    }
}

fn is_not_found(err: &DockerError) -> bool {
    matches!(
        err,
        DockerError::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// Docker's `t`: whole seconds, rounded up, at least one.
fn grace_seconds(grace: Duration) -> i32 {
    let rounded_up = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    i32::try_from(rounded_up.max(1)).unwrap_or(i32::MAX)
}

/// `label` filters: a container must carry every `key=value`.
fn label_filters(labels: &BTreeMap<String, String>) -> Vec<String> {
    labels
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect()
}

/// `host:container[:ro]` binds: the agent's own (read-write), then the sandbox's mounts.
fn binds(spec: &ContainerSpec) -> Vec<String> {
    let own = spec
        .binds
        .iter()
        .map(|(host, container)| format!("{host}:{container}"));
    let sandbox = spec.sandbox.mounts.iter().map(|m| {
        let mode = if m.read_only { "ro" } else { "rw" };
        format!("{}:{}:{mode}", m.host, m.path)
    });
    own.chain(sandbox).collect()
}

fn create_body(spec: &ContainerSpec) -> ContainerCreateBody {
    let (gpu_env, device_requests) = gpu_settings(&spec.gpus);
    let sandbox = &spec.sandbox;
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        entrypoint: non_empty(&spec.entrypoint),
        cmd: non_empty(&spec.args),
        env: Some(environment(&spec.env, &gpu_env)),
        labels: Some(spec.labels.clone().into_iter().collect()),
        stop_signal: spec.stop_signal.clone(),
        exposed_ports: spec.publish.as_ref().map(|publish| vec![port_key(publish)]),
        host_config: Some(HostConfig {
            binds: Some(binds(spec)),
            group_add: (!spec.groups.is_empty())
                .then(|| spec.groups.iter().map(u32::to_string).collect()),
            privileged: sandbox.privileged.then_some(true),
            network_mode: sandbox.host_network.then(|| "host".to_owned()),
            pid_mode: sandbox.host_pid.then(|| "host".to_owned()),
            cap_add: non_empty(&sandbox.cap_add),
            devices: (!sandbox.devices.is_empty()).then(|| {
                sandbox
                    .devices
                    .iter()
                    .map(|path| DeviceMapping {
                        path_on_host: Some(path.clone()),
                        path_in_container: Some(path.clone()),
                        cgroup_permissions: Some("rwm".to_owned()),
                    })
                    .collect()
            }),
            // docker-init as PID 1 forwards signals to a workload that installs no handler.
            init: Some(true),
            restart_policy: Some(RestartPolicy {
                name: Some(RestartPolicyNameEnum::NO),
                maximum_retry_count: None,
            }),
            device_requests,
            // On the host's network the port is the host's already.
            port_bindings: spec
                .publish
                .as_ref()
                .filter(|_| !sandbox.host_network)
                .map(port_bindings),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn non_empty(words: &[String]) -> Option<Vec<String>> {
    (!words.is_empty()).then(|| words.to_vec())
}

/// The GPU environment and the device request for one way of giving GPUs.
fn gpu_settings(gpus: &GpuAccess) -> (Vec<(String, String)>, Option<Vec<DeviceRequest>>) {
    match gpus {
        GpuAccess::None => (Vec::new(), None),
        // The selection in the environment too, as Docker's own `--gpus` sets it: it
        // overrides an image's `ENV NVIDIA_VISIBLE_DEVICES=all` (CUDA's base images have
        // one), which a toolkit that reads the variable would otherwise honour.
        GpuAccess::DeviceRequest { device_ids } => (
            vec![("NVIDIA_VISIBLE_DEVICES".to_owned(), device_ids.join(","))],
            Some(vec![DeviceRequest {
                driver: Some("nvidia".to_owned()),
                device_ids: Some(device_ids.clone()),
                capabilities: Some(vec![vec!["gpu".to_owned()]]),
                ..Default::default()
            }]),
        ),
        GpuAccess::VisibleDevicesEnv { indices } => {
            let list = indices
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let env = ["NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"]
                .map(|key| (key.to_owned(), list.clone()));
            (env.to_vec(), None)
        }
    }
}

/// `KEY=VALUE` pairs: the spec's, except those the GPU selection sets, then the GPU ones.
fn environment(env: &[(String, String)], gpu_env: &[(String, String)]) -> Vec<String> {
    let overridden = |key: &String| gpu_env.iter().any(|(gpu_key, _)| gpu_key == key);
    env.iter()
        .filter(|(key, _)| !overridden(key))
        .chain(gpu_env)
        .map(|(key, value)| format!("{key}={value}"))
        .collect()
}

fn port_key(publish: &PortPublish) -> String {
    format!("{}/tcp", publish.container_port)
}

/// An empty host port lets Docker choose a free one.
fn port_bindings(publish: &PortPublish) -> PortMap {
    let host_port = match publish.host_port {
        0 => String::new(),
        port => port.to_string(),
    };
    let binding = PortBinding {
        host_ip: Some(publish.host_ip.clone()),
        host_port: Some(host_port),
    };
    HashMap::from([(port_key(publish), Some(vec![binding]))])
}

fn to_container(response: ContainerInspectResponse) -> Container {
    let config = response.config.unwrap_or_default();
    let published_port = response
        .network_settings
        .and_then(|settings| settings.ports)
        .and_then(|ports| first_host_port(&ports));
    Container {
        id: response.id.unwrap_or_default(),
        name: response
            .name
            .map(|name| name.trim_start_matches('/').to_owned())
            .unwrap_or_default(),
        // The reference the container was created from, not the image id.
        image: config
            .image
            .or_else(|| response.image.clone())
            .unwrap_or_default(),
        image_id: response.image.filter(|id| !id.is_empty()),
        labels: config.labels.unwrap_or_default().into_iter().collect(),
        state: response
            .state
            .map_or(ContainerState::Transitioning, |state| {
                to_state(state.status, state.exit_code)
            }),
        published_port,
    }
}

fn to_state(status: Option<ContainerStateStatusEnum>, exit_code: Option<i64>) -> ContainerState {
    match status {
        Some(ContainerStateStatusEnum::CREATED) => ContainerState::Created,
        Some(ContainerStateStatusEnum::RUNNING) => ContainerState::Running,
        Some(ContainerStateStatusEnum::EXITED | ContainerStateStatusEnum::DEAD) => {
            ContainerState::Exited {
                exit_code: exit_code.unwrap_or_default(),
            }
        }
        _ => ContainerState::Transitioning,
    }
}

/// The host port bound to a published container port (the agent publishes at most one).
fn first_host_port(ports: &PortMap) -> Option<u16> {
    let mut keys: Vec<&String> = ports.keys().collect();
    keys.sort();
    keys.into_iter()
        .filter_map(|key| ports.get(key).cloned().flatten())
        .flatten()
        .filter_map(|binding| binding.host_port?.parse::<u16>().ok())
        .find(|port| *port != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_becomes_host_config_and_an_empty_one_adds_nothing() {
        let mut spec = ContainerSpec {
            binds: vec![("/var/lib/ns/ckpt/1".into(), "/checkpoint".into())],
            publish: Some(PortPublish {
                container_port: 29500,
                host_ip: "0.0.0.0".into(),
                host_port: 29500,
            }),
            ..ContainerSpec::default()
        };
        let plain = create_body(&spec).host_config.unwrap();
        assert_eq!(plain.binds.unwrap(), ["/var/lib/ns/ckpt/1:/checkpoint"]);
        assert_eq!(
            (plain.privileged, plain.network_mode, plain.pid_mode),
            (None, None, None)
        );
        assert_eq!((plain.cap_add, plain.devices), (None, None));
        assert!(plain.port_bindings.is_some());

        spec.sandbox = nightshift_common::Sandbox {
            privileged: true,
            host_network: true,
            host_pid: true,
            cap_add: vec!["IPC_LOCK".into()],
            devices: vec!["/dev/infiniband/uverbs0".into()],
            mounts: vec![
                nightshift_common::Mount {
                    host: "/datasets/a".into(),
                    path: "/data".into(),
                    read_only: true,
                },
                nightshift_common::Mount {
                    host: "/scratch/1".into(),
                    path: "/scratch".into(),
                    read_only: false,
                },
            ],
        };
        let hc = create_body(&spec).host_config.unwrap();
        assert_eq!(
            hc.binds.unwrap(),
            [
                "/var/lib/ns/ckpt/1:/checkpoint",
                "/datasets/a:/data:ro",
                "/scratch/1:/scratch:rw"
            ]
        );
        assert_eq!(hc.privileged, Some(true));
        assert_eq!(hc.network_mode.as_deref(), Some("host"));
        assert_eq!(hc.pid_mode.as_deref(), Some("host"));
        assert_eq!(hc.cap_add.unwrap(), ["IPC_LOCK"]);
        let device = &hc.devices.unwrap()[0];
        assert_eq!(
            (
                device.path_on_host.as_deref(),
                device.path_in_container.as_deref()
            ),
            (
                Some("/dev/infiniband/uverbs0"),
                Some("/dev/infiniband/uverbs0")
            )
        );
        // The host's network has no port mapping.
        assert!(hc.port_bindings.is_none());
    }

    #[test]
    fn grace_is_rounded_up_to_whole_seconds_and_at_least_one() {
        assert_eq!(grace_seconds(Duration::ZERO), 1);
        assert_eq!(grace_seconds(Duration::from_millis(200)), 1);
        assert_eq!(grace_seconds(Duration::from_secs(2)), 2);
        assert_eq!(grace_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(grace_seconds(Duration::from_secs(u64::MAX)), i32::MAX);
    }

    #[test]
    fn visible_devices_env_overrides_the_spec_and_requests_no_device() {
        let (gpu_env, requests) = gpu_settings(&GpuAccess::VisibleDevicesEnv {
            indices: vec![1, 3],
        });
        assert!(requests.is_none());
        let env = [
            ("CUDA_VISIBLE_DEVICES".to_owned(), "0".to_owned()),
            ("A".to_owned(), "b".to_owned()),
        ];
        assert_eq!(
            environment(&env, &gpu_env),
            [
                "A=b",
                "NVIDIA_VISIBLE_DEVICES=1,3",
                "CUDA_VISIBLE_DEVICES=1,3"
            ]
        );
    }

    #[test]
    fn device_request_names_the_nvidia_driver_and_gpu_capability() {
        let (gpu_env, requests) = gpu_settings(&GpuAccess::DeviceRequest {
            device_ids: vec!["GPU-a".to_owned(), "GPU-b".to_owned()],
        });
        // An image's own ENV gives way to the container's.
        assert_eq!(
            gpu_env,
            vec![(
                "NVIDIA_VISIBLE_DEVICES".to_owned(),
                "GPU-a,GPU-b".to_owned()
            )]
        );
        let request = &requests.unwrap_or_default()[0];
        assert_eq!(request.driver.as_deref(), Some("nvidia"));
        assert_eq!(
            request.device_ids,
            Some(vec!["GPU-a".to_owned(), "GPU-b".to_owned()])
        );
        assert_eq!(request.capabilities, Some(vec![vec!["gpu".to_owned()]]));
        assert_eq!(request.count, None);
    }

    #[test]
    fn port_zero_is_left_for_docker_to_choose() {
        let publish = PortPublish {
            container_port: 8000,
            host_ip: "127.0.0.1".to_owned(),
            host_port: 0,
        };
        let bindings = port_bindings(&publish);
        let binding = &bindings["8000/tcp"].clone().unwrap_or_default()[0];
        assert_eq!(binding.host_ip.as_deref(), Some("127.0.0.1"));
        assert_eq!(binding.host_port.as_deref(), Some(""));
    }

    #[test]
    fn host_port_is_read_from_the_first_bound_port() {
        let ports = HashMap::from([
            ("9000/tcp".to_owned(), None),
            (
                "8000/tcp".to_owned(),
                Some(vec![PortBinding {
                    host_ip: Some("127.0.0.1".to_owned()),
                    host_port: Some("49153".to_owned()),
                }]),
            ),
        ]);
        assert_eq!(first_host_port(&ports), Some(49153));
        assert_eq!(first_host_port(&HashMap::new()), None);
    }

    #[test]
    fn exited_and_dead_report_the_exit_code_other_states_are_transitioning() {
        use ContainerStateStatusEnum as S;
        assert_eq!(
            to_state(Some(S::EXITED), Some(137)),
            ContainerState::Exited { exit_code: 137 }
        );
        assert_eq!(
            to_state(Some(S::DEAD), Some(1)),
            ContainerState::Exited { exit_code: 1 }
        );
        assert_eq!(to_state(Some(S::CREATED), None), ContainerState::Created);
        assert_eq!(to_state(Some(S::RUNNING), Some(0)), ContainerState::Running);
        assert_eq!(
            to_state(Some(S::PAUSED), None),
            ContainerState::Transitioning
        );
        assert_eq!(to_state(None, None), ContainerState::Transitioning);
    }
}
