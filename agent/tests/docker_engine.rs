//! `DockerEngine` against the real Docker engine of this host.
//!
//! Nothing can be pulled, so the tests build their own image, `nightshift-test/busybox:dev`:
//! `FROM scratch` with the host's static `/bin/busybox` and a symlink per applet, entrypoint
//! `busybox sh -c`, so that a test's container is one shell script. Install it with
//! `apt-get install -y busybox-static`. Every test labels its containers with a label of its
//! own and removes them when it ends, passed or failed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail, ensure};
use axum::body::Bytes;
use bollard::Docker;
use bollard::query_parameters::BuildImageOptionsBuilder;
use futures_util::TryStreamExt;
use nightshift_agent::engine::docker::DockerEngine;
use nightshift_agent::engine::{
    ContainerSpec, ContainerState, Engine, EngineError, GpuAccess, PortPublish,
};
use nightshift_common::labels;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::OnceCell;

const IMAGE: &str = "nightshift-test/busybox:dev";
const HOST_BUSYBOX: &str = "/bin/busybox";
/// Marks every container these tests create; the value is unique per test.
const TEST_LABEL: &str = "io.nightshift.test";

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn run_then_list_inspect_and_logs_see_the_container() -> Result<()> {
    let t = Fixture::new("basic").await?;
    let version = t.engine.version().await?;
    assert!(version.starts_with("Docker "), "{version}");

    let mut spec = t.spec("c", "echo hello-from-busybox; sleep 1000");
    spec.labels
        .insert(labels::ROLE.into(), labels::ROLE_JOB.into());
    let id = t.engine.run(&spec).await?;

    let found = t.engine.list(&spec.labels).await?;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].id, id);
    assert_eq!(found[0].name, spec.name);
    assert_eq!(found[0].image, IMAGE);
    assert_eq!(found[0].state, ContainerState::Running);
    // The name resolved to the image's ID, as `docker image inspect` gives it.
    let image_id = std::process::Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", IMAGE])
        .output()?;
    let image_id = String::from_utf8(image_id.stdout)?;
    assert!(image_id.starts_with("sha256:"), "{image_id}");
    assert_eq!(found[0].image_id.as_deref(), Some(image_id.trim()));

    let mut other = t.labels();
    other.insert(labels::ROLE.into(), labels::ROLE_REPLICA.into());
    assert!(
        t.engine.list(&other).await?.is_empty(),
        "a label filter must exclude it"
    );

    let inspected = t.engine.inspect(&id).await?;
    for (key, value) in &spec.labels {
        assert_eq!(inspected.labels.get(key), Some(value), "label {key}");
    }
    assert_eq!(inspected.published_port, None);

    t.wait_for_log(&id, "hello-from-busybox").await?;
    assert_eq!(t.engine.logs(&id, Some(1)).await?, "hello-from-busybox\n");
    t.cleanup().await
}

#[tokio::test]
async fn visible_devices_env_sets_both_variables_and_requests_no_device() -> Result<()> {
    let t = Fixture::new("gpu-env").await?;
    let mut spec = t.spec("c", "sleep 1000");
    spec.gpus = GpuAccess::VisibleDevicesEnv {
        indices: vec![1, 3],
    };
    spec.env = vec![
        ("CUDA_VISIBLE_DEVICES".into(), "0".into()),
        ("A".into(), "b".into()),
    ];
    let id = t.engine.run(&spec).await?;

    let raw = t.docker.inspect_container(&id, None).await?;
    let env = raw.config.and_then(|config| config.env).unwrap_or_default();
    for expected in [
        "NVIDIA_VISIBLE_DEVICES=1,3",
        "CUDA_VISIBLE_DEVICES=1,3",
        "A=b",
    ] {
        assert!(
            env.iter().any(|var| var == expected),
            "{expected} not in {env:?}"
        );
    }
    assert!(
        !env.iter().any(|var| var == "CUDA_VISIBLE_DEVICES=0"),
        "{env:?}"
    );
    let host_config = raw.host_config.unwrap_or_default();
    let requests = host_config.device_requests.unwrap_or_default();
    assert!(requests.is_empty(), "{requests:?}");
    assert_eq!(host_config.init, Some(true));
    t.cleanup().await
}

#[tokio::test]
async fn an_accepted_sandbox_mounts_read_only_and_adds_what_it_names() -> Result<()> {
    let t = Fixture::new("sandbox").await?;
    let host = tempfile::tempdir()?;
    std::fs::write(host.path().join("shard-0.txt"), "dataset-bytes")?;
    let mut spec = t.spec(
        "c",
        "cat /data/shard-0.txt; echo; \
         if echo x > /data/new 2>/dev/null; then echo WRITABLE; else echo READ-ONLY; fi; \
         grep CapEff /proc/self/status; echo pid1=$(cat /proc/1/comm); sleep 1000",
    );
    spec.sandbox = nightshift_common::Sandbox {
        cap_add: vec!["NET_ADMIN".into()],
        host_pid: true,
        mounts: vec![nightshift_common::Mount {
            host: host.path().display().to_string(),
            path: "/data".into(),
            read_only: true,
        }],
        ..Default::default()
    };
    let id = t.engine.run(&spec).await?;
    t.wait_for_log(&id, "pid1=").await?;
    let logs = t.engine.logs(&id, None).await?;
    assert!(logs.contains("dataset-bytes"), "{logs}");
    assert!(logs.contains("READ-ONLY"), "{logs}");
    assert!(
        !host.path().join("new").exists(),
        "the job wrote to the host"
    );

    let raw = t.docker.inspect_container(&id, None).await?;
    let host_config = raw.host_config.unwrap_or_default();
    assert_eq!(host_config.cap_add, Some(vec!["NET_ADMIN".to_owned()]));
    assert_eq!(host_config.pid_mode.as_deref(), Some("host"));
    assert_ne!(host_config.privileged, Some(true));
    let mounts = raw.mounts.unwrap_or_default();
    let data = mounts
        .iter()
        .find(|m| m.destination.as_deref() == Some("/data"))
        .context("no /data mount")?;
    assert_eq!(data.rw, Some(false), "{data:?}");
    // CAP_NET_ADMIN is bit 12 of the effective set; the host's PID 1 is not docker-init.
    let cap_eff = logs
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .context("no CapEff line")?;
    let caps = u64::from_str_radix(cap_eff.trim(), 16)?;
    assert_ne!(caps & (1 << 12), 0, "NET_ADMIN not effective: {cap_eff}");
    assert!(!logs.contains("pid1=docker-init"), "{logs}");
    t.cleanup().await
}

#[tokio::test]
async fn stop_kills_after_the_grace_period_or_returns_when_the_workload_exits() -> Result<()> {
    let t = Fixture::new("stop").await?;
    let grace = Duration::from_secs(2);
    let deaf = t
        .engine
        .run(&t.spec("deaf", "trap '' TERM; echo ready; sleep 1000"))
        .await?;
    let polite = t
        .engine
        .run(&t.spec(
            "polite",
            "trap 'exit 0' TERM; echo ready; while true; do sleep 0.1; done",
        ))
        .await?;
    t.wait_for_log(&deaf, "ready").await?;
    t.wait_for_log(&polite, "ready").await?;

    let deaf_took = timed(t.engine.stop(&deaf, grace)).await?;
    let polite_took = timed(t.engine.stop(&polite, grace)).await?;
    println!("stop, TERM ignored: {deaf_took:?}; stop, TERM handled: {polite_took:?}");

    assert_eq!(
        t.engine.inspect(&deaf).await?.state,
        ContainerState::Exited { exit_code: 137 }
    );
    assert!(
        deaf_took >= grace && deaf_took < grace + Duration::from_secs(5),
        "{deaf_took:?}"
    );
    assert_eq!(
        t.engine.inspect(&polite).await?.state,
        ContainerState::Exited { exit_code: 0 }
    );
    assert!(polite_took < Duration::from_millis(1500), "{polite_took:?}");

    // Stopping a stopped container is a success, and quick; signalling it is a no-op.
    let again = timed(t.engine.stop(&deaf, grace)).await?;
    assert!(again < Duration::from_secs(1), "{again:?}");
    t.engine.signal(&deaf, "SIGUSR1").await?;
    t.cleanup().await
}

#[tokio::test]
async fn signal_reaches_a_workload_that_traps_it() -> Result<()> {
    let t = Fixture::new("signal").await?;
    let script = "trap 'echo got-usr1' USR1; echo ready; while true; do sleep 0.1; done";
    let id = t.engine.run(&t.spec("c", script)).await?;
    t.wait_for_log(&id, "ready").await?;

    t.engine.signal(&id, "SIGUSR1").await?;
    t.wait_for_log(&id, "got-usr1").await?;
    assert_eq!(t.engine.inspect(&id).await?.state, ContainerState::Running);
    t.cleanup().await
}

#[tokio::test]
async fn run_is_idempotent_while_running_and_replaces_an_exited_container() -> Result<()> {
    let t = Fixture::new("rerun").await?;
    let running = t.spec("running", "sleep 1000");
    let first = t.engine.run(&running).await?;
    let second = t.engine.run(&running).await?;
    assert_eq!(
        first, second,
        "a running container is returned, not duplicated"
    );
    assert_eq!(t.engine.list(&running.labels).await?.len(), 1);

    let exiting = t.spec("exiting", "exit 3");
    let old = t.engine.run(&exiting).await?;
    t.wait_for_state(&old, ContainerState::Exited { exit_code: 3 })
        .await?;
    let new = t.engine.run(&exiting).await?;
    assert_ne!(old, new);
    assert!(matches!(
        t.engine.inspect(&old).await,
        Err(EngineError::NotFound(_))
    ));
    let ids: Vec<String> = t
        .engine
        .list(&t.labels())
        .await?
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert!(
        ids.contains(&new) && !ids.contains(&old) && ids.len() == 2,
        "{ids:?}"
    );
    t.cleanup().await
}

#[tokio::test]
async fn missing_things_map_to_the_ports_errors() -> Result<()> {
    let t = Fixture::new("missing").await?;
    let mut spec = t.spec("c", "true");
    spec.image = "nightshift-test/never-built:none".into();
    match t.engine.run(&spec).await {
        Err(EngineError::ImageMissing(image)) => assert_eq!(image, spec.image),
        other => bail!("expected ImageMissing, got {other:?}"),
    }
    assert!(
        t.engine.list(&t.labels()).await?.is_empty(),
        "a failed run leaves nothing"
    );

    let ghost = format!("{}-ghost", t.prefix);
    t.engine.stop(&ghost, Duration::from_secs(1)).await?;
    t.engine.remove(&ghost).await?;
    match t.engine.inspect(&ghost).await {
        Err(EngineError::NotFound(id)) => assert_eq!(id, ghost),
        other => bail!("expected NotFound, got {other:?}"),
    }
    assert!(matches!(
        t.engine.signal(&ghost, "SIGTERM").await,
        Err(EngineError::NotFound(_))
    ));
    assert!(matches!(
        t.engine.logs(&ghost, None).await,
        Err(EngineError::NotFound(_))
    ));
    t.cleanup().await
}

#[tokio::test]
async fn a_container_that_cannot_start_is_not_left_behind() -> Result<()> {
    let t = Fixture::new("no-start").await?;
    let mut spec = t.spec("c", "true");
    // Without the NVIDIA runtime Docker cannot select the driver; with it, the GPU is unknown.
    spec.gpus = GpuAccess::DeviceRequest {
        device_ids: vec!["GPU-00000000-0000-0000-0000-000000000000".into()],
    };
    match t.engine.run(&spec).await {
        // The engine's "no" is the container's own fault: the attempt fails, the pass goes on.
        Err(EngineError::Refused { reason, .. }) => println!("start refused: {reason}"),
        other => bail!("expected the engine to refuse the start, got {other:?}"),
    }
    assert!(t.engine.list(&t.labels()).await?.is_empty());
    t.cleanup().await
}

#[tokio::test]
async fn a_port_published_on_port_zero_is_reported_and_reachable() -> Result<()> {
    let t = Fixture::new("publish").await?;
    let script = "mkdir -p /www && echo hello-nightshift > /www/index.html \
                  && exec httpd -f -p 8000 -h /www";
    let mut spec = t.spec("c", script);
    spec.publish = Some(PortPublish {
        container_port: 8000,
        host_ip: "127.0.0.1".into(),
        host_port: 0,
    });
    let id = t.engine.run(&spec).await?;

    let port = t
        .engine
        .inspect(&id)
        .await?
        .published_port
        .context("no published port")?;
    let listed = t.engine.list(&spec.labels).await?;
    assert_eq!(listed[0].published_port, Some(port));
    let body = eventually(|| http_get(port, "/index.html")).await?;
    assert!(body.contains("hello-nightshift"), "{body}");
    t.cleanup().await
}

// ---------------------------------------------------------------------------------------------
// Fixture
// ---------------------------------------------------------------------------------------------

/// One test's view of Docker: the engine under test, a raw client for what the port does not
/// show, and a label that marks (and later removes) every container the test made.
struct Fixture {
    engine: DockerEngine,
    docker: Docker,
    /// Unique to this test; the value of [`TEST_LABEL`] and the prefix of container names.
    prefix: String,
}

impl Fixture {
    async fn new(test: &str) -> Result<Self> {
        let docker = Docker::connect_with_local_defaults()?
            .negotiate_version()
            .await?;
        ensure_test_image(&docker).await?;
        Ok(Self {
            engine: DockerEngine::connect().await?,
            docker,
            prefix: format!("nightshift-test-{test}-{}", unique_suffix()),
        })
    }

    /// The labels of every container of this test.
    fn labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (TEST_LABEL.to_owned(), self.prefix.clone()),
            (labels::MANAGED_BY.to_owned(), "test-node".to_owned()),
        ])
    }

    /// A container named `<prefix>-<name>` running `script` in busybox sh.
    fn spec(&self, name: &str, script: &str) -> ContainerSpec {
        ContainerSpec {
            name: format!("{}-{name}", self.prefix),
            image: IMAGE.to_owned(),
            args: vec![script.to_owned()],
            labels: self.labels(),
            ..Default::default()
        }
    }

    async fn wait_for_log(&self, id: &str, needle: &str) -> Result<()> {
        eventually(|| async {
            let logs = self.engine.logs(id, None).await?;
            ensure!(logs.contains(needle), "{needle:?} not yet in logs {logs:?}");
            Ok(())
        })
        .await
    }

    async fn wait_for_state(&self, id: &str, state: ContainerState) -> Result<()> {
        eventually(|| async {
            let current = self.engine.inspect(id).await?.state;
            ensure!(
                current == state,
                "state is {current:?}, waiting for {state:?}"
            );
            Ok(())
        })
        .await
    }

    /// Removes this test's containers and reports a failure to do so; `Drop` repeats it,
    /// quietly, for a test that failed before getting here.
    async fn cleanup(&self) -> Result<()> {
        remove_labelled(&self.engine, &self.prefix).await
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let prefix = self.prefix.clone();
        // The test's runtime may be unwinding; clean up on a thread and runtime of our own.
        let cleanup = std::thread::spawn(move || -> Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let engine = DockerEngine::connect().await?;
                remove_labelled(&engine, &prefix).await
            })
        });
        if let Ok(Err(err)) = cleanup.join() {
            eprintln!(
                "cleanup of containers labelled {TEST_LABEL}={}: {err:#}",
                self.prefix
            );
        }
    }
}

async fn remove_labelled(engine: &DockerEngine, prefix: &str) -> Result<()> {
    let filter = BTreeMap::from([(TEST_LABEL.to_owned(), prefix.to_owned())]);
    for container in engine.list(&filter).await? {
        engine.remove(&container.id).await?;
    }
    Ok(())
}

fn unique_suffix() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:x}{nanos:x}{count}", std::process::id())
}

/// Retries `attempt` every 50 ms for up to 10 s; returns its first success or last error.
async fn eventually<T, F, Fut>(mut attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(err) if Instant::now() >= deadline => return Err(err.context("gave up after 10 s")),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn timed<E>(call: impl Future<Output = Result<(), E>>) -> Result<Duration, E> {
    let start = Instant::now();
    call.await?;
    Ok(start.elapsed())
}

/// A plain HTTP/1.0 GET on 127.0.0.1; the body when the answer is 200.
async fn http_get(port: u16, path: &str) -> Result<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    ensure!(
        response.starts_with("HTTP/1.0 200") || response.starts_with("HTTP/1.1 200"),
        "{response:?}"
    );
    Ok(response)
}

// ---------------------------------------------------------------------------------------------
// The test image
// ---------------------------------------------------------------------------------------------

/// Builds [`IMAGE`] once per test binary (Docker's cache makes a rebuild cheap anyway).
async fn ensure_test_image(docker: &Docker) -> Result<()> {
    static BUILT: OnceCell<()> = OnceCell::const_new();
    BUILT.get_or_try_init(|| build_test_image(docker)).await?;
    Ok(())
}

async fn build_test_image(docker: &Docker) -> Result<()> {
    let context = build_context()?;
    let options = BuildImageOptionsBuilder::new()
        .t(IMAGE)
        .rm(true)
        .forcerm(true)
        .build();
    let mut progress = docker.build_image(
        options,
        None,
        Some(bollard::body_full(Bytes::from(context))),
    );
    while let Some(info) = progress
        .try_next()
        .await
        .context("building the test image")?
    {
        if let Some(detail) = info.error_detail {
            bail!("building {IMAGE}: {}", detail.message.unwrap_or_default());
        }
    }
    Ok(())
}

/// A tar build context: the Dockerfile and `rootfs/` with busybox and its applet links.
fn build_context() -> Result<Vec<u8>> {
    let busybox = std::fs::read(HOST_BUSYBOX).with_context(|| {
        format!(
            "the docker tests build their image from the host's {HOST_BUSYBOX}; \
             install it with `apt-get install -y busybox-static`"
        )
    })?;
    let applets = std::process::Command::new(HOST_BUSYBOX)
        .arg("--list")
        .output()?;
    ensure!(applets.status.success(), "{HOST_BUSYBOX} --list failed");
    let dockerfile = "FROM scratch\n\
                      COPY rootfs/ /\n\
                      ENV PATH=/bin\n\
                      ENTRYPOINT [\"/bin/busybox\", \"sh\", \"-c\"]\n";

    let mut tar = Tar::default();
    tar.file("Dockerfile", 0o644, dockerfile.as_bytes())?;
    tar.directory("rootfs/", 0o755)?;
    tar.directory("rootfs/tmp/", 0o1777)?;
    tar.directory("rootfs/bin/", 0o755)?;
    tar.file("rootfs/bin/busybox", 0o755, &busybox)?;
    for applet in String::from_utf8(applets.stdout)?
        .lines()
        .filter(|a| *a != "busybox")
    {
        tar.symlink(&format!("rootfs/bin/{applet}"), "busybox")?;
    }
    Ok(tar.finish())
}

/// Just enough of a ustar writer for a build context.
#[derive(Default)]
struct Tar {
    bytes: Vec<u8>,
}

impl Tar {
    const BLOCK: usize = 512;

    fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> Result<()> {
        self.header(path, mode, data.len(), b'0', "")?;
        self.bytes.extend_from_slice(data);
        self.pad();
        Ok(())
    }

    fn directory(&mut self, path: &str, mode: u32) -> Result<()> {
        self.header(path, mode, 0, b'5', "")
    }

    fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        self.header(path, 0o777, 0, b'2', target)
    }

    fn finish(mut self) -> Vec<u8> {
        self.bytes.resize(self.bytes.len() + 2 * Self::BLOCK, 0);
        self.bytes
    }

    fn header(&mut self, path: &str, mode: u32, size: usize, kind: u8, link: &str) -> Result<()> {
        ensure!(
            path.len() < 100 && link.len() < 100,
            "tar name too long: {path}"
        );
        let mut header = [0u8; Self::BLOCK];
        let mut put = |offset: usize, value: &[u8]| {
            header[offset..offset + value.len()].copy_from_slice(value);
        };
        put(0, path.as_bytes());
        put(100, format!("{mode:07o}\0").as_bytes());
        put(108, b"0000000\0"); // uid
        put(116, b"0000000\0"); // gid
        put(124, format!("{size:011o}\0").as_bytes());
        put(136, b"00000000000\0"); // mtime
        put(148, b"        "); // checksum, counted as spaces
        put(156, &[kind]);
        put(157, link.as_bytes());
        put(257, b"ustar\0");
        put(263, b"00");
        let checksum: u32 = header.iter().map(|byte| u32::from(*byte)).sum();
        header[148..156].copy_from_slice(format!("{checksum:06o}\0 ").as_bytes());
        self.bytes.extend_from_slice(&header);
        Ok(())
    }

    fn pad(&mut self) {
        let len = self.bytes.len().next_multiple_of(Self::BLOCK);
        self.bytes.resize(len, 0);
    }
}

#[tokio::test]
async fn read_file_and_stdout_read_what_an_exited_container_left() -> Result<()> {
    let t = Fixture::new("readfile").await?;
    let spec = t.spec(
        "c",
        "printf 'hello world' > /tmp/out.txt; head -c 2048 /dev/zero > /tmp/big; mkdir /tmp/d /tmp/full; \
         echo inside > /tmp/full/f; \
         echo to-stderr >&2; echo 0123456789",
    );
    let id = t.engine.run(&spec).await?;
    t.wait_for_state(&id, ContainerState::Exited { exit_code: 0 })
        .await?;
    assert_eq!(t.engine.stdout(&id, 1024).await?, "0123456789\n");
    assert_eq!(t.engine.stdout(&id, 4).await?, "789\n");
    let read = t.engine.read_file(&id, "/tmp/out.txt", 1024).await?;
    assert_eq!(read.as_deref(), Some(&b"hello world"[..]));
    assert_eq!(t.engine.read_file(&id, "/tmp/missing", 1024).await?, None);
    assert_eq!(t.engine.read_file(&id, "/tmp/d", 1024).await?, None);
    // A directory is not a file, even when it holds one.
    assert_eq!(t.engine.read_file(&id, "/tmp/full", 1024).await?, None);
    let err = t.engine.read_file(&id, "/tmp/big", 1024).await.unwrap_err();
    assert!(
        matches!(
            err,
            nightshift_agent::engine::EngineError::FileTooLarge { limit: 1024, .. }
        ),
        "{err}"
    );
    let capture = nightshift_common::Capture {
        files: vec![
            nightshift_common::CaptureFile {
                name: "hello".into(),
                path: "/tmp/out.txt".into(),
            },
            nightshift_common::CaptureFile {
                name: "none".into(),
                path: "/tmp/missing".into(),
            },
        ],
        stdout: true,
    };
    let outputs = nightshift_agent::job::capture(&t.engine, &id, &capture).await;
    assert_eq!(
        outputs,
        BTreeMap::from([
            ("hello".to_owned(), "hello world".to_owned()),
            (
                nightshift_common::STDOUT_OUTPUT.to_owned(),
                "0123456789\n".to_owned()
            ),
        ])
    );
    let gone = t
        .engine
        .read_file("nightshift-no-such-container", "/tmp/x", 1)
        .await;
    assert!(
        matches!(
            gone,
            Err(nightshift_agent::engine::EngineError::NotFound(_))
        ),
        "{gone:?}"
    );
    t.cleanup().await
}

#[tokio::test]
async fn files_are_placed_in_the_container_before_it_starts() -> Result<()> {
    let t = Fixture::new("files").await?;
    let mut spec = t.spec("c", "cat /tmp/message /deep/new/dir/f");
    spec.files = vec![
        ("/tmp/message".to_owned(), b"hello world\n".to_vec()),
        ("/deep/new/dir/f".to_owned(), b"second\n".to_vec()),
    ];
    let id = t.engine.run(&spec).await?;
    t.wait_for_state(&id, ContainerState::Exited { exit_code: 0 })
        .await?;
    assert_eq!(t.engine.stdout(&id, 1024).await?, "hello world\nsecond\n");
    t.cleanup().await
}
