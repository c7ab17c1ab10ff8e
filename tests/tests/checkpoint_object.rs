//! Checkpoints in an S3-compatible bucket (`[checkpoints] storage = "object"`), against a
//! real S3 server: moto's (a throwaway process on loopback; `tests/run.sh` installs it in a
//! virtual environment under `target/` and names its `moto_server` in
//! `NIGHTSHIFT_TEST_MOTO`).
//!
//! - The bucket client itself: each attempt's checkpoint under its own epoch, the newest
//!   complete one restored, a half-finished upload never, a late upload of an older attempt
//!   never outranking a newer one, and a restore waiting for a newer attempt's upload.
//! - A job preempted on host A resumes on host B from the checkpoint A uploaded, with real
//!   agents and a coordinator on the real Docker engine (the shape of `checkpoint_shared.rs`),
//!   and the upload is reported as a phase of A's reclaim.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nightshift_agent::bucket::{Bucket, Layout, ObjectConfig};
use nightshift_agent::config::{AgentConfig, CheckpointStorage};
use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_cli::client::Client;
use nightshift_common::{JobState, ReplicaState};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(90);
const ACCESS_KEY: &str = "nightshift-test-key";
const SECRET_KEY: &str = "object-secret-7f3a91c2";

/// `moto_server` on 127.0.0.1 with one bucket; killed when dropped.
struct Moto {
    child: Child,
    port: u16,
    credentials: PathBuf,
}

impl Moto {
    async fn start(dir: &Path, bucket: &str) -> Self {
        let server = std::env::var_os("NIGHTSHIFT_TEST_MOTO").unwrap_or_else(|| {
            panic!(
                "NIGHTSHIFT_TEST_MOTO is not set: it names moto's moto_server, which tests/run.sh \
                 installs (python3 -m venv target/moto-venv && target/moto-venv/bin/pip install \
                 'moto[server]') and exports"
            )
        });
        secrets::record(SECRET_KEY);
        let port = free_port();
        let child = Command::new(&server)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("moto.log")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", Path::new(&server).display()));
        let credentials = dir.join("s3.credentials");
        std::fs::write(
            &credentials,
            format!(
                "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
            ),
        )
        .unwrap();
        let moto = Self {
            child,
            port,
            credentials,
        };
        wait_for("moto to listen", Duration::from_secs(30), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        // The agent never creates buckets: the test does, as an operator would.
        let made = Command::new("curl")
            .args([
                "-sf",
                "-X",
                "PUT",
                "--aws-sigv4",
                "aws:amz:us-east-1:s3",
                "--user",
            ])
            .arg(format!("{ACCESS_KEY}:{SECRET_KEY}"))
            .arg(format!("{}/{bucket}", moto.endpoint()))
            .output()
            .expect("curl");
        assert!(made.status.success(), "creating the bucket: {made:?}");
        moto
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn config(&self, bucket: &str, prefix: &str) -> ObjectConfig {
        ObjectConfig {
            endpoint: self.endpoint(),
            bucket: bucket.into(),
            prefix: prefix.into(),
            credentials_file: Some(self.credentials.clone()),
            ..ObjectConfig::default()
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write(dir: &Path, files: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

/// The epochs of `job` that have a key `what` (`MANIFEST.json`, `STARTED`, `files/...`).
fn epochs_with(keys: &[String], layout: &Layout, job: u64, what: &str) -> Vec<u64> {
    let root = layout.job(job);
    keys.iter()
        .filter_map(|k| {
            let (epoch, rest) = k.strip_prefix(&root)?.split_once('/')?;
            (rest == what).then(|| epoch.parse().ok()).flatten()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_uploads_under_its_epoch_and_the_newest_complete_one_is_restored() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let moto = Moto::start(dir.path(), "ckpt-unit").await;
    let mut cfg = moto.config("ckpt-unit", "team");
    cfg.upload_wait_s = 1.0;
    let bucket = Bucket::new(&cfg).unwrap();
    let layout = bucket.layout().clone();
    let job = 7;
    let at = |name: &str| dir.path().join(name);

    // Attempt 3 saved step 10; attempt 9, step 20 (in a subdirectory too).
    write(&at("e3"), &[("step-10.ckpt", "ten")]);
    bucket.upload(job, None, 3, "a", &at("e3")).await.unwrap();
    write(
        &at("e9"),
        &[("step-20.ckpt", "twenty"), ("opt/state", "adam")],
    );
    let m = bucket.upload(job, None, 9, "b", &at("e9")).await.unwrap();
    assert_eq!(m.files.len(), 2);

    let keys = bucket.list(&layout.job(job)).await.unwrap();
    assert_eq!(
        epochs_with(&keys, &layout, job, "MANIFEST.json"),
        vec![3, 9]
    );
    assert!(
        keys.contains(&"team/jobs/7/checkpoints/00000000000000000009/files/opt/state".into()),
        "{keys:?}"
    );

    // Attempt 12 restores 9's, the newest, and marks itself started.
    let r = bucket
        .restore(job, None, 12, 3, "c", &at("e12"))
        .await
        .unwrap();
    assert_eq!((r.from_epoch, r.files, r.bytes), (Some(9), 2, 10));
    assert_eq!(read(&at("e12"), "step-20.ckpt"), "twenty");
    assert_eq!(read(&at("e12"), "opt/state"), "adam");
    assert!(!at("e12").join("step-10.ckpt").exists());
    let keys = bucket.list(&layout.job(job)).await.unwrap();
    assert_eq!(epochs_with(&keys, &layout, job, "STARTED"), vec![12]);

    // Attempt 5 uploads late (it ran on after its lease was taken, and saved more): it
    // writes under 5 only, and 9's stays the newest.
    write(&at("e5"), &[("step-15.ckpt", "fifteen")]);
    bucket.upload(job, None, 5, "a", &at("e5")).await.unwrap();
    // An epoch is uploaded once: again (an agent restarted, its copy gone) changes nothing.
    let again = bucket.upload(job, None, 9, "b", &at("gone")).await.unwrap();
    assert_eq!(again, m, "the manifest of 9 stays");
    let keys = bucket.list(&layout.job(job)).await.unwrap();
    assert!(
        epochs_with(&keys, &layout, job, "files/step-15.ckpt") == vec![5],
        "the late upload stays under its own epoch: {keys:?}"
    );
    let r = bucket
        .restore(job, None, 13, 4, "c", &at("e13"))
        .await
        .unwrap();
    assert_eq!(
        r.from_epoch,
        Some(9),
        "an older attempt never replaces a newer one"
    );
    assert!(!at("e13").join("step-15.ckpt").exists());

    // Attempt 12 (started) uploads nothing for now: attempt 14 waits for it up to
    // upload_wait_s, then takes 9's. An upload cut short (files, no manifest) is never
    // restored either.
    bucket
        .put(&layout.file(job, 12, "step-30.ckpt"), b"half".to_vec())
        .await
        .unwrap();
    let r = bucket
        .restore(job, None, 14, 5, "c", &at("e14"))
        .await
        .unwrap();
    assert_eq!(r.from_epoch, Some(9));
    assert!(r.waited >= Duration::from_secs(1), "{r:?}");
    assert!(!at("e14").join("step-30.ckpt").exists());

    // A restore waits for every newer attempt that started (12, 13 and 14 did) until each
    // has uploaded, then takes the newest.
    write(&at("e12"), &[("step-30.ckpt", "thirty")]);
    let mut slow = cfg.clone();
    slow.upload_wait_s = 30.0;
    let waiting = Bucket::new(&slow).unwrap();
    let restore = tokio::spawn({
        let dest = at("e15");
        async move { waiting.restore(job, None, 15, 6, "c", &dest).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    bucket.upload(job, None, 12, "c", &at("e12")).await.unwrap();
    bucket.upload(job, None, 13, "c", &at("e13")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!restore.is_finished(), "14 has not uploaded yet");
    write(&at("e14"), &[("step-40.ckpt", "forty")]);
    bucket.upload(job, None, 14, "c", &at("e14")).await.unwrap();
    let r = restore.await.unwrap().unwrap();
    assert_eq!(
        r.from_epoch,
        Some(14),
        "the newest complete one once none is pending"
    );
    assert!(r.waited >= Duration::from_millis(1400), "{r:?}");
    assert_eq!(read(&at("e15"), "step-40.ckpt"), "forty");

    // An attempt that saved nothing is passed over for the newest that saved something.
    bucket
        .upload(job, None, 15, "c", &at("empty"))
        .await
        .unwrap();
    let r = bucket
        .restore(job, None, 16, 7, "c", &at("e16"))
        .await
        .unwrap();
    assert_eq!(r.from_epoch, Some(14));
    // A lease taken back before its container started is no attempt: the next lease has
    // the same attempt number and a higher epoch, and does not wait for the first's upload.
    bucket.upload(job, None, 16, "c", &at("e16")).await.unwrap();
    let first = bucket
        .restore(job, None, 20, 8, "a", &at("e20"))
        .await
        .unwrap();
    let next = bucket
        .restore(job, None, 21, 8, "b", &at("e21"))
        .await
        .unwrap();
    assert_eq!((first.from_epoch, next.from_epoch), (Some(16), Some(16)));
    assert!(next.waited < Duration::from_millis(500), "{next:?}");
    // A later attempt does wait for them (here up to upload_wait_s, 1 s).
    let r = bucket
        .restore(job, None, 22, 9, "c", &at("e22"))
        .await
        .unwrap();
    assert!(r.waited >= Duration::from_secs(1), "{r:?}");

    // A gang's members keep their attempts per rank: each resumes from its own rank's
    // newest checkpoint, whatever the order of the epochs, never from another rank's nor
    // from the single-node keys of the job.
    let gang = 9;
    let first = bucket
        .restore(gang, Some(0), 40, 1, "a", &at("g40"))
        .await
        .unwrap();
    assert_eq!(first.from_epoch, None);
    bucket
        .restore(gang, Some(1), 41, 1, "b", &at("g41"))
        .await
        .unwrap();
    write(&at("g40"), &[("shard", "rank 0")]);
    write(&at("g41"), &[("shard", "rank 1")]);
    bucket
        .upload(gang, Some(0), 40, "a", &at("g40"))
        .await
        .unwrap();
    bucket
        .upload(gang, Some(1), 41, "b", &at("g41"))
        .await
        .unwrap();
    // Attempt 2 the other way round: rank 1 first, under the lower epoch.
    let r1 = bucket
        .restore(gang, Some(1), 50, 2, "a", &at("g50"))
        .await
        .unwrap();
    let r0 = bucket
        .restore(gang, Some(0), 51, 2, "b", &at("g51"))
        .await
        .unwrap();
    assert_eq!((r0.from_epoch, r1.from_epoch), (Some(40), Some(41)));
    assert_eq!(
        (read(&at("g51"), "shard"), read(&at("g50"), "shard")),
        ("rank 0".into(), "rank 1".into())
    );
    let keys = bucket.list(&layout.job(gang)).await.unwrap();
    assert!(
        keys.contains(&"team/jobs/9/checkpoints/rank-1/00000000000000000041/MANIFEST.json".into()),
        "{keys:?}"
    );
    assert_eq!(
        epochs_with(&keys, &layout, gang, "MANIFEST.json"),
        Vec::<u64>::new()
    );

    // And a job with nothing in the bucket starts from an empty directory.
    let r = bucket
        .restore(8, None, 1, 1, "c", &at("fresh"))
        .await
        .unwrap();
    assert_eq!((r.from_epoch, r.files), (None, 0));
    assert!(std::fs::read_dir(at("fresh")).unwrap().next().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_bucket_fails_with_the_bucket_named() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let moto = Moto::start(dir.path(), "ckpt-there").await;
    let bucket = Bucket::new(&moto.config("ckpt-missing", "")).unwrap();
    let e = bucket
        .restore(1, None, 2, 1, "n", &dir.path().join("x"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bucket ckpt-missing") && e.contains(&moto.endpoint()),
        "{e}"
    );
    assert!(
        !e.contains(SECRET_KEY) && !e.contains("X-Amz-Signature"),
        "{e}"
    );
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

fn env_of(c: &serde_json::Value, key: &str) -> Option<String> {
    let env: Vec<String> = serde_json::from_value(c["Config"]["Env"].clone()).unwrap();
    env.iter()
        .find_map(|e| e.strip_prefix(&format!("{key}=")))
        .map(str::to_owned)
}

fn running_job(node: &str) -> Option<(String, serde_json::Value)> {
    let (id, _, _) = containers(node, "job")
        .into_iter()
        .find(|(_, _, state)| state == "running")?;
    let c = docker_inspect(&id);
    Some((id, c))
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

/// The newest checkpoint step among `names` (the trainer's `step-XXXXXXXX.ckpt`).
fn newest_step<'a>(names: impl Iterator<Item = &'a str>) -> Option<u64> {
    names
        .filter_map(|n| n.strip_prefix("step-")?.strip_suffix(".ckpt")?.parse().ok())
        .max()
}

fn newest_step_in(dir: &Path) -> Option<u64> {
    let names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    newest_step(names.iter().map(String::as_str))
}

fn resumed_step(id: &str) -> Option<u64> {
    let out = Command::new("docker")
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

fn host(
    coordinator: &str,
    node: &str,
    dir: &Path,
    gpus: u32,
    object: &ObjectConfig,
) -> AgentConfig {
    let mut cfg = agent_config(coordinator, node, &dir.join(node), gpus);
    cfg.checkpoints.storage = CheckpointStorage::Object;
    cfg.checkpoints.object = Some(object.clone());
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_object_storage_a_job_preempted_on_one_host_resumes_on_another_from_the_bucket() {
    init_tracing();
    require_images();
    let dir = tempfile::tempdir().unwrap();
    let moto = Moto::start(dir.path(), "ckpt-follow").await;
    let object = moto.config("ckpt-follow", "follow");
    let layout = Layout::new(&object.key_prefix());
    let bucket = Bucket::new(&object).unwrap();
    let (a, b) = (unique_node("ckobj-a"), unique_node("ckobj-b"));
    let _cleanup = (Cleanup(a.clone()), Cleanup(b.clone()));
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    // A has 3 GPUs and B 2, so that lending's own order names B; A starts alone, so the
    // first attempt runs there.
    let gpus_a = Arc::new(FakeGpus::new(&a, 3));
    let (agent_a, _) = start_agent_with(
        host(&coordinator.url, &a, dir.path(), 3, &object),
        gpus_a.clone(),
    )
    .await;
    wait_for("host A to serve", STARTUP, || async {
        serving(&client, &a).await.then_some(())
    })
    .await;
    let job = client
        .submit(&trainer_job("follows-object", 2, 1_000_000, 20, 20))
        .await
        .unwrap();
    let (_, first_c) = wait_for("the job to run on A", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(())?;
        running_job(&a)
    })
    .await;
    assert_eq!(
        env_of(&first_c, "NIGHTSHIFT_RESUMING").as_deref(),
        Some("0")
    );
    let first_epoch: u64 = env_of(&first_c, "NIGHTSHIFT_EPOCH")
        .unwrap()
        .parse()
        .unwrap();
    let first_dir = checkpoint_source(&first_c);
    assert!(
        first_dir.starts_with(dir.path().join(&a)),
        "the attempt's directory is local"
    );
    wait_for("a checkpoint on A", STARTUP, || async {
        newest_step_in(&first_dir).filter(|s| *s >= 40)
    })
    .await;
    let keys = bucket.list(&layout.job(job.id)).await.unwrap();
    assert_eq!(
        epochs_with(&keys, &layout, job.id, "STARTED"),
        vec![first_epoch],
        "the first attempt marked itself started: {keys:?}"
    );
    assert!(epochs_with(&keys, &layout, job.id, "MANIFEST.json").is_empty());

    let (agent_b, _) = start_agent(host(&coordinator.url, &b, dir.path(), 2, &object), 2).await;
    wait_for("host B to serve", STARTUP, || async {
        serving(&client, &b).await.then_some(())
    })
    .await;

    // Demand returns: A is taken back and the job preempted (it checkpoints on SIGTERM);
    // its checkpoint is uploaded after the container stopped.
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
    let manifest = layout.manifest(job.id, first_epoch);
    let uploaded = wait_for("A's upload", STARTUP, || async {
        bucket.get(&manifest).await.ok().flatten()
    })
    .await;
    let uploaded: nightshift_agent::bucket::Manifest = serde_json::from_slice(&uploaded).unwrap();
    assert_eq!(
        (uploaded.epoch, uploaded.node.as_str()),
        (first_epoch, a.as_str())
    );
    let last_step = newest_step(uploaded.files.iter().map(|f| f.path.as_str()))
        .expect("the manifest lists checkpoints");
    assert!(last_step >= 40, "{uploaded:?}");
    // Uploaded, the host's copy is removed: the bucket holds it.
    wait_for("A's copy to be removed", STARTUP, || async {
        (!first_dir.exists()).then_some(())
    })
    .await;
    // The upload is a phase of A's reclaim, reported to the coordinator.
    let phase = wait_for("the upload phase to be reported", STARTUP, || async {
        let nodes = client.nodes().await.ok()?;
        let node = nodes.nodes.into_iter().find(|n| n.name == a)?;
        node.recent_phases
            .into_iter()
            .find(|p| p.phase == "upload_checkpoint")
    })
    .await;
    assert_eq!(phase.sequence, nightshift_common::SequenceKind::Reclaim);
    println!("upload_checkpoint: {} ms", phase.duration_ms);

    wait_for("host A to serve again", STARTUP, || async {
        surge().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        serving(&client, &a).await.then_some(())
    })
    .await;
    // A cannot take the job back (two of its GPUs turn unhealthy): it goes to B, which
    // holds nothing of it but reaches the bucket.
    gpus_a.inject_xid(0, 79).unwrap();
    gpus_a.inject_xid(1, 79).unwrap();
    surge().await;
    let (second, (second_id, second_c)) = wait_for("the job to run again", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running && j.attempt == 2).then_some(())?;
        let node = j.leases.first()?.node.clone();
        Some((j, running_job(&node)?))
    })
    .await;
    assert_eq!(
        second.leases[0].node, b,
        "placed on the other host (no preference for A)"
    );
    let second_epoch = second.leases[0].epoch;
    assert!(second_epoch > first_epoch);
    assert!(checkpoint_source(&second_c).starts_with(dir.path().join(&b)));
    assert_eq!(
        env_of(&second_c, "NIGHTSHIFT_RESUMING").as_deref(),
        Some("1")
    );
    assert_eq!(
        env_of(&second_c, "NIGHTSHIFT_RESUMED_FROM_EPOCH"),
        Some(first_epoch.to_string())
    );
    let resumed = wait_for("the trainer on B to start", STARTUP, || async {
        resumed_step(&second_id)
    })
    .await;
    assert_eq!(
        resumed, last_step,
        "resumed on B from A's last checkpoint, via the bucket"
    );

    // Cancelled, B's attempt uploads under its own epoch; A's stays as it was.
    client.cancel(job.id).await.unwrap();
    let second_manifest = layout.manifest(job.id, second_epoch);
    wait_for("B's upload", STARTUP, || async {
        bucket.get(&second_manifest).await.ok().flatten()
    })
    .await;
    let keys = bucket.list(&layout.job(job.id)).await.unwrap();
    assert_eq!(
        epochs_with(&keys, &layout, job.id, "MANIFEST.json"),
        vec![first_epoch, second_epoch],
        "{keys:?}"
    );
    let again: nightshift_agent::bucket::Manifest =
        serde_json::from_slice(&bucket.get(&manifest).await.unwrap().unwrap()).unwrap();
    assert_eq!(again, uploaded, "B never wrote under A's epoch");
    agent_a.stop();
    agent_b.stop();
}
