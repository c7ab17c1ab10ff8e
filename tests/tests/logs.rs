//! `nightshift logs` against the real Docker engine: the coordinator proxies the request to
//! the agent of the node running the job, which streams the container's output.

use std::process::Stdio;
use std::time::Duration;

use nightshift_common::JobState;
use nightshift_tests::*;
use tokio::io::AsyncReadExt;

const STARTUP: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_from_the_start_the_tail_and_following() {
    init_tracing();
    require_images();
    let one = OneNode::start("logs", 4).await;
    let (client, coordinator) = (&one.client, &one.coordinator);
    let job = client
        .submit(&trainer_job("chatty", 4, 1_000_000, 20, 100))
        .await
        .unwrap();
    wait_for("the job to run", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(())
    })
    .await;
    let id = job.id.to_string();
    // The trainer prints its configuration, then "starting fresh".
    let all = wait_for("the first lines", STARTUP, || async {
        let (code, out, _) = nightshift(&coordinator.url, &["logs", &id]).await;
        (code == 0 && out.contains("starting fresh")).then_some(out)
    })
    .await;
    assert!(all.starts_with("toy-trainer: job="), "{all}");
    let (code, tail, err) = nightshift(&coordinator.url, &["logs", &id, "--tail", "1"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(tail, "starting fresh\n");

    let mut follow = tokio::process::Command::new(workspace_bin("nightshift"))
        .args(["--coordinator", &coordinator.url, "logs", &id, "-f"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("nightshift logs -f");
    tokio::time::sleep(Duration::from_secs(1)).await;
    client.cancel(job.id).await.unwrap();
    let mut followed = String::new();
    let mut stdout = follow.stdout.take().expect("stdout");
    tokio::time::timeout(
        Duration::from_secs(60),
        stdout.read_to_string(&mut followed),
    )
    .await
    .expect("the stream ends when the container exits")
    .expect("read");
    let status = follow.wait().await.expect("wait");
    assert!(status.success(), "{status:?}");
    assert!(followed.contains("starting fresh"), "{followed}");
    assert!(
        followed.contains("received SIGTERM"),
        "what the job wrote after the follow began: {followed}"
    );

    // Once the job has ended and its container is removed, the agent's kept copy answers.
    wait_for("the job to end", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Cancelled).then_some(())
    })
    .await;
    wait_for("its container to be removed", STARTUP, || async {
        containers(&one.node, "job").is_empty().then_some(())
    })
    .await;
    let (code, kept, err) = nightshift(&coordinator.url, &["logs", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert!(kept.starts_with("toy-trainer: job="), "{kept}");
    assert!(kept.contains("received SIGTERM"), "{kept}");
    let (code, last, err) = nightshift(&coordinator.url, &["logs", &id, "--tail", "1"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(last.lines().count(), 1, "{last}");
    assert!(kept.ends_with(&last), "{last} is the end of {kept}");

    let (code, _, err) = nightshift(&coordinator.url, &["logs", "999"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("job 999 not found"), "{err}");
}

/// The load balancer's port (`readiness_listen`) carries no job data: neither a job's output
/// nor `/status` (lease ids, images, the replica's URL) answers there, to anyone; `/ready`
/// says ready or not and nothing else; `/metrics` moves to `metrics_listen` when it is set.
/// Without `[tls]` the agent's API is on loopback, where the coordinator (on this host) reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_balancers_port_gives_no_job_data() {
    init_tracing();
    require_images();
    let node = unique_node("lbport");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let mut cfg = agent_config(&coordinator.url, &node, &dir.path().join("work"), 4);
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let (agent, status) = start_agent(cfg, 4).await;
    let job = client
        .submit(&trainer_job("secretive", 4, 1_000_000, 20, 100))
        .await
        .unwrap();
    let id = job.id.to_string();
    wait_for("the job's first lines", STARTUP, || async {
        let (code, out, _) = nightshift(&coordinator.url, &["logs", &id]).await;
        (code == 0 && out.contains("starting fresh")).then_some(())
    })
    .await;
    let ready = agent.ready_url.clone().expect("ready url");
    let base = ready.trim_end_matches("/ready");
    for path in [
        format!("/v1/jobs/{id}/logs"),
        "/status".to_owned(),
        "/metrics".to_owned(),
    ] {
        let r = reqwest::get(format!("{base}{path}")).await.unwrap();
        let code = r.status();
        let body = r.text().await.unwrap();
        assert!(
            !code.is_success() && !body.contains("toy-trainer") && !body.contains(&id),
            "{path} on the load balancer's port answered {code}: {body}"
        );
    }
    let r = reqwest::get(&ready).await.unwrap();
    let code = r.status();
    let body = r.text().await.unwrap();
    assert!(
        body == "ready\n" || body == "not ready\n",
        "/ready {code}: {body}"
    );

    // The job data is where the coordinator reads it: on loopback, without [tls].
    let api = agent.api_url.clone().expect("api url");
    assert!(api.starts_with("http://127.0.0.1:"), "{api}");
    assert!(status.starts_with(&api), "{status}");
    let seen: serde_json::Value = reqwest::get(&status).await.unwrap().json().await.unwrap();
    assert_eq!(seen["node"], node.as_str());
    // The metrics on their own address.
    let metrics_url = agent.metrics_url.clone().expect("metrics url");
    assert!(!metrics_url.starts_with(base), "{metrics_url}");
    let metrics = reqwest::get(&metrics_url).await.unwrap();
    assert!(metrics.status().is_success());
    let metrics = metrics.text().await.unwrap();
    assert!(metrics.contains("nightshift_agent_ready"), "{metrics}");
}

/// With `[tls]` everywhere, `nightshift logs` still works end to end: the CLI reaches the
/// coordinator over HTTPS, and the coordinator's log proxy reaches the agent's API over HTTPS
/// with its own certificate (the agent answers no other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_through_the_coordinator_over_mutual_tls() {
    use nightshift_coordinator::config::TlsConfig;
    use nightshift_coordinator::pki::{self, Leaf};
    init_tracing();
    require_images();
    let node = unique_node("tlslogs");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let tls_dir = dir.path().join("tls");
    std::fs::create_dir(&tls_dir).unwrap();
    let file = |name: &str| tls_dir.join(name);
    let ca = pki::new_ca().unwrap();
    pki::write_pair(&file("ca.pem"), &file("ca.key"), &ca).unwrap();
    let names = ["127.0.0.1".to_owned()];
    let issued = pki::issue(&ca.key_pem, Leaf::Server(&names)).unwrap();
    pki::write_pair(&file("coordinator.pem"), &file("coordinator.key"), &issued).unwrap();
    let issued = pki::issue(&ca.key_pem, Leaf::Agent(&node)).unwrap();
    pki::write_pair(&file("node.pem"), &file("node.key"), &issued).unwrap();

    let tls = TlsConfig {
        ca_file: file("ca.pem"),
        cert_file: file("coordinator.pem"),
        key_file: file("coordinator.key"),
    };
    let mut ccfg = coordinator_config(&dir.path().join("state"));
    ccfg.tls = Some(tls.clone());
    let cluster = nightshift_coordinator::server::open(&ccfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let server = nightshift_coordinator::https::server_config(&tls).unwrap();
    let serving = tokio::spawn(nightshift_coordinator::https::serve_tls(
        listener,
        cluster,
        server,
        std::future::pending(),
    ));

    let mut cfg = agent_config(&url, &node, &dir.path().join("work"), 4);
    cfg.tls.ca_file = Some(file("ca.pem"));
    cfg.tls.cert_file = Some(file("node.pem"));
    cfg.tls.key_file = Some(file("node.key"));
    let (agent, _) = start_agent(cfg, 4).await;
    let api = agent.api_url.clone().expect("api url");
    assert!(api.starts_with("https://"), "{api}");

    let client = nightshift_cli::client::Client::with_ca(&url, Some(&file("ca.pem"))).unwrap();
    let job = client
        .submit(&trainer_job("over-tls", 4, 1_000_000, 20, 100))
        .await
        .unwrap();
    let id = job.id.to_string();
    let ca = file("ca.pem");
    let logs = || async {
        let out = tokio::process::Command::new(workspace_bin("nightshift"))
            .args(["--coordinator", &url, "--ca"])
            .arg(&ca)
            .args(["logs", &id])
            .env_remove("NIGHTSHIFT_TOKEN")
            .output()
            .await
            .expect("nightshift logs");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let all = wait_for("the job's first lines over https", STARTUP, || async {
        let (code, out, err) = logs().await;
        if code != 0 {
            println!("nightshift logs: {err}");
        }
        (code == 0 && out.contains("starting fresh")).then_some(out)
    })
    .await;
    assert!(all.starts_with("toy-trainer: job="), "{all}");
    client.cancel(job.id).await.unwrap();
    serving.abort();
}
