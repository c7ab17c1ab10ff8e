//! Images from a real registry: Debian's `docker-registry` (a throwaway process on loopback,
//! htpasswd auth) holds a job's image, which the engine does not have. The agent pulls it
//! with the credentials of its `[registry] auth_file`, the job's image is recorded by digest,
//! a rerun after the tag moved runs the old digest, and a wrong password fails the job with
//! the registry named while the node runs the next job.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_cli::client::Client;
use nightshift_common::{JobState, PipelineRunView};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(120);
const USER: &str = "researcher";
const PASSWORD: &str = "pull-secret-5e1c7d";

/// `docker-registry serve` on 127.0.0.1:`port`, storing under `dir`, behind htpasswd auth;
/// killed when dropped.
struct Registry {
    child: Child,
    port: u16,
}

impl Registry {
    fn start(dir: &Path) -> Self {
        let port = free_port();
        let htpasswd = Command::new("htpasswd")
            .args(["-Bbn", USER, PASSWORD])
            .output()
            .expect("htpasswd (apache2-utils; tests/run.sh installs it)");
        assert!(htpasswd.status.success(), "htpasswd -Bbn");
        std::fs::write(dir.join("htpasswd"), &htpasswd.stdout).unwrap();
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}\n\
             http:\n  addr: 127.0.0.1:{port}\nauth:\n  htpasswd:\n    realm: nightshift-test\n    path: {auth}\n",
            root = dir.join("data").display(),
            auth = dir.join("htpasswd").display(),
        );
        let path = dir.join("registry.yml");
        std::fs::write(&path, config).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("registry.log")).unwrap())
            .spawn()
            .expect("docker-registry (tests/run.sh installs it)");
        Self { child, port }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn ready(&self) {
        let addr = self.host();
        wait_for("the registry to listen", Duration::from_secs(20), || {
            let addr = addr.clone();
            async move { tokio::net::TcpStream::connect(addr).await.ok().map(|_| ()) }
        })
        .await;
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the docker CLI with its own client configuration (the registry login stays there).
fn docker(config: &Path, args: &[&str]) -> std::process::Output {
    let out = Command::new("docker")
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("docker");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Builds busybox with `PIN_MARK=mark` as `tag` and pushes it; returns the image's ID.
fn push_marked(config: &Path, tag: &str, mark: &str) -> String {
    let id = marked::build(Some(config), tag, mark);
    docker(config, &["push", "-q", tag]);
    id
}

/// Removes these images from the engine, by ID, whatever names them.
fn remove_images(ids: &[String]) {
    for id in ids {
        let _ = Command::new("docker")
            .args(["image", "rm", "-f", id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Removes the images this test built and pulled when dropped.
struct RemoveImages(Vec<String>);

impl Drop for RemoveImages {
    fn drop(&mut self) {
        remove_images(&self.0);
    }
}

/// The agent's credentials file, in Docker's `config.json` format.
fn write_auth(path: &Path, registry: &str, password: &str) {
    let encoded = Command::new("base64")
        .arg("-w0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin
                .take()
                .unwrap()
                .write_all(format!("{USER}:{password}").as_bytes())?;
            c.wait_with_output()
        })
        .expect("base64");
    let auth = String::from_utf8(encoded.stdout).unwrap();
    secrets::record(&auth);
    std::fs::write(
        path,
        format!(r#"{{"auths": {{"{registry}": {{"auth": "{auth}"}}}}}}"#),
    )
    .unwrap();
}

async fn run_pipeline(client: &Client, text: &str) -> PipelineRunView {
    marked::finished(client, marked::submit(client, text).await.id).await
}

fn mark_step(v: &PipelineRunView) -> nightshift_common::PipelineNodeView {
    v.nodes
        .iter()
        .find(|n| n.name.ends_with(".mark"))
        .cloned()
        .unwrap_or_else(|| panic!("no step mark in {:#?}", v.nodes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_pull_from_a_registry_pin_the_digest_and_name_a_refusing_registry() {
    init_tracing();
    require_images();
    secrets::record(PASSWORD);
    let node = unique_node("registry");
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(dir.path());
    registry.ready().await;
    let host = registry.host();
    let cli_config = dir.path().join("docker-cli");
    std::fs::create_dir_all(&cli_config).unwrap();
    let mut login = Command::new("docker")
        .arg("--config")
        .arg(&cli_config)
        .args(["login", &host, "-u", USER, "--password-stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    login
        .stdin
        .take()
        .unwrap()
        .write_all(PASSWORD.as_bytes())
        .unwrap();
    assert!(login.wait().unwrap().success(), "docker login {host}");

    // Dropped last: the containers go first, then the images.
    let mut images = RemoveImages(Vec::new());
    let _cleanup = Cleanup(node.clone());
    let repo = format!("{host}/nightshift-test/{node}");
    let tag = format!("{repo}:1");
    let first = push_marked(&cli_config, &tag, "first");
    images.0.push(first.clone());
    // The engine has it only in the registry now.
    remove_images(&images.0);

    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let auth = dir.path().join("registry-auth.json");
    write_auth(&auth, &host, PASSWORD);
    let mut cfg = agent_config(&coordinator.url, &node, &dir.path().join("work"), 2);
    cfg.registry.auth_file = Some(PathBuf::from(&auth));
    // Every pull finds the disk "low": the job images the agent pulled and no container uses
    // go first (the replica's and the test's own images are never among them).
    cfg.registry.image_min_free_bytes = Some(u64::MAX);
    let (_agent, _) = start_agent_with(cfg, Arc::new(FakeGpus::new(&node, 2))).await;

    // The agent pulls it with its credentials; the step's job is pinned to the digest.
    let original = run_pipeline(&client, &marked::workflow(&tag)).await;
    assert_eq!(original.phase, "Succeeded", "{original:#?}");
    let ran = mark_step(&original);
    assert_eq!(ran.outputs.get("mark").map(String::as_str), Some("first"));
    let job = client.job(ran.jobs[0]).await.unwrap();
    let pinned = job.image_digest.clone().expect("the job's image pinned");
    assert!(pinned.starts_with(&format!("{repo}@sha256:")), "{pinned}");
    assert_eq!(ran.image_id.as_deref(), Some(pinned.as_str()));
    let (code, shown, err) =
        nightshift(&coordinator.url, &["job", "show", &job.id.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        shown.contains(&format!("pinned:       {pinned}")),
        "{shown}"
    );

    // The tag moves; the engine keeps neither image.
    let second = push_marked(&cli_config, &tag, "second");
    images.0.push(second.clone());
    assert_ne!(first, second);
    remove_images(&images.0);
    let rerun = client.rerun_pipeline(original.id).await.unwrap();
    let rerun = marked::finished(&client, rerun.id).await;
    assert_eq!(rerun.phase, "Succeeded", "{rerun:#?}");
    let again = mark_step(&rerun);
    assert_eq!(
        again.outputs.get("mark").map(String::as_str),
        Some("first"),
        "the rerun ran the old digest, pulled again"
    );
    assert_eq!(client.job(again.jobs[0]).await.unwrap().spec.image, pinned);

    // A wrong password: the job fails naming the registry, and the node runs the next job.
    // The engine holds the first image again (the rerun pulled it by digest), not the tag.
    write_auth(&auth, &host, "not-the-password");
    let mut refused = nightshift_common::JobSpec::new("refused", &tag, 1);
    refused.command = vec!["true".into()];
    let refused = client.submit(&refused).await.unwrap().id;
    let failed = wait_for("the refused job to fail", STARTUP, || async {
        let j = client.job(refused).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    assert_eq!(failed.state, JobState::Failed, "{failed:?}");
    // Before that pull the disk was "low": the agent removed the image it had pulled.
    let kept = Command::new("docker")
        .args(["image", "inspect", &first])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(
        !kept.success(),
        "the unused pulled image {first} was removed"
    );
    let message = failed.message.unwrap_or_default();
    assert!(
        message.contains(&format!("registry {host}")),
        "the registry is named: {message}"
    );
    let mut next = nightshift_common::JobSpec::new("next", "busybox:latest", 1);
    next.command = vec!["true".into()];
    let next = client.submit(&next).await.unwrap().id;
    let done = wait_for("the next job to finish", STARTUP, || async {
        let j = client.job(next).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
}
