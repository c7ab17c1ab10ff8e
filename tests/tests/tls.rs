//! Mutual TLS over real HTTPS: the coordinator refuses an agent without a certificate, an
//! agent whose certificate names another node, and a certificate from another CA; the agent
//! refuses a coordinator that the cluster CA did not sign; the agent's API (job logs,
//! `/status`) answers the coordinator's certificate only, and the coordinator talks only to
//! the node it means.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nightshift_agent::tls::AgentTlsConfig;
use nightshift_agent::uplink::{Uplink, UplinkError};
use nightshift_common::{GpuInfo, RegisterRequest};
use nightshift_coordinator::config::{CoordinatorConfig, TlsConfig};
use nightshift_coordinator::pki::{self, Issued, Leaf};
use nightshift_coordinator::{https, server};
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn write(&self, name: &str, issued: &Issued) -> (PathBuf, PathBuf) {
        let (cert, key) = (
            self.dir.path().join(format!("{name}.pem")),
            self.dir.path().join(format!("{name}.key")),
        );
        pki::write_pair(&cert, &key, issued).unwrap();
        (cert, key)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// The cluster CA with the coordinator's and node gpu-a's certificates, and a foreign CA
/// with its own gpu-a certificate.
fn cluster_pki() -> Pki {
    let pki = Pki {
        dir: tempfile::tempdir().unwrap(),
    };
    let ca = pki::new_ca().unwrap();
    pki.write("ca", &ca);
    let names = ["127.0.0.1".to_owned(), "localhost".to_owned()];
    pki.write(
        "coordinator",
        &pki::issue(&ca.key_pem, Leaf::Server(&names)).unwrap(),
    );
    pki.write(
        "gpu-a",
        &pki::issue(&ca.key_pem, Leaf::Agent("gpu-a")).unwrap(),
    );
    let foreign = pki::new_ca().unwrap();
    pki.write("foreign-ca", &foreign);
    pki.write(
        "foreign-gpu-a",
        &pki::issue(&foreign.key_pem, Leaf::Agent("gpu-a")).unwrap(),
    );
    pki.write(
        "foreign-coordinator",
        &pki::issue(&foreign.key_pem, Leaf::Server(&names)).unwrap(),
    );
    pki
}

async fn start(pki: &Pki, server_cert: &str, data: &Path) -> String {
    let tls = TlsConfig {
        ca_file: pki.path("ca.pem"),
        cert_file: pki.path(&format!("{server_cert}.pem")),
        key_file: pki.path(&format!("{server_cert}.key")),
    };
    let cfg = CoordinatorConfig {
        data_dir: data.to_owned(),
        tls: Some(tls.clone()),
        ..CoordinatorConfig::default()
    };
    let cluster = server::open(&cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = https::server_config(&tls).unwrap();
    tokio::spawn(https::serve_tls(
        listener,
        cluster,
        config,
        std::future::pending(),
    ));
    format!("https://{addr}")
}

fn agent_tls(pki: &Pki, ca: &str, identity: Option<&str>) -> AgentTlsConfig {
    AgentTlsConfig {
        ca_file: Some(pki.path(&format!("{ca}.pem"))),
        cert_file: identity.map(|n| pki.path(&format!("{n}.pem"))),
        key_file: identity.map(|n| pki.path(&format!("{n}.key"))),
    }
}

fn registration(node: &str) -> RegisterRequest {
    RegisterRequest {
        node: node.to_owned(),
        gpus: vec![GpuInfo {
            index: 0,
            uuid: format!("GPU-{node}-0"),
            name: "fake".into(),
            memory_total_bytes: 80 << 30,
        }],
        service: "default".into(),
        address: None,
        agent_url: None,
        metrics_url: None,
        readiness_url: None,
        agent_version: "test".into(),
    }
}

fn refused(result: Result<impl std::fmt::Debug, UplinkError>) -> (StatusCode, String) {
    match result {
        Err(UplinkError::Refused { status, error }) => (status, error),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn an_agent_speaks_only_for_the_node_its_certificate_names() {
    let pki = cluster_pki();
    let data = tempfile::tempdir().unwrap();
    let url = start(&pki, "coordinator", data.path()).await;

    // gpu-a with its own certificate: registered.
    let a = Uplink::with_tls(&url, "gpu-a", &agent_tls(&pki, "ca", Some("gpu-a"))).unwrap();
    let reply = a.register(&registration("gpu-a")).await.unwrap();
    assert_eq!(reply.node, "gpu-a");

    // gpu-a's certificate claiming gpu-b: 403, for registration and for the node's routes.
    let b = Uplink::with_tls(&url, "gpu-b", &agent_tls(&pki, "ca", Some("gpu-a"))).unwrap();
    let (status, error) = refused(b.register(&registration("gpu-b")).await);
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(error, "the client certificate is for node gpu-a, not gpu-b");
    let (status, _) = refused(b.desired(0).await);
    assert_eq!(status, StatusCode::FORBIDDEN);

    // No certificate at all: 401.
    let anonymous = Uplink::with_tls(&url, "gpu-a", &agent_tls(&pki, "ca", None)).unwrap();
    let (status, error) = refused(anonymous.register(&registration("gpu-a")).await);
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(error.contains("client certificate"), "{error}");
}

#[tokio::test]
async fn a_certificate_from_another_ca_gets_no_answer() {
    let pki = cluster_pki();
    let data = tempfile::tempdir().unwrap();
    let url = start(&pki, "coordinator", data.path()).await;

    // The agent itself refuses to use it: its CA does not sign it.
    let err = AgentTlsConfig {
        cert_file: Some(pki.path("foreign-gpu-a.pem")),
        key_file: Some(pki.path("foreign-gpu-a.key")),
        ..agent_tls(&pki, "ca", None)
    }
    .client_config()
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("tls.cert_file (")
            && err.contains("is not an agent certificate signed by tls.ca_file"),
        "{err}"
    );

    // Presented anyway, the coordinator ends the handshake: no HTTP answer comes back, where
    // the cluster's own certificate for the same node gets one.
    let addr = url.trim_start_matches("https://");
    let ours = raw_register(addr, &pki, "gpu-a").await;
    assert!(ours.starts_with("HTTP/1.1 200"), "{ours}");
    let foreign = raw_register(addr, &pki, "foreign-gpu-a").await;
    assert!(
        !foreign.starts_with("HTTP/1.1"),
        "a foreign certificate got an HTTP answer: {foreign}"
    );
}

/// Registers gpu-a over a bare TLS connection presenting certificate `cert`; the answer.
async fn raw_register(addr: &str, pki: &Pki, cert: &str) -> String {
    let config = https::client_config(
        &pki.path("ca.pem"),
        Some((
            &pki.path(&format!("{cert}.pem")),
            &pki.path(&format!("{cert}.key")),
        )),
    )
    .unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let body = serde_json::to_string(&registration("gpu-a")).unwrap();
    let request = format!(
        "POST /v1/agents/register HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut answer = Vec::new();
    if let Ok(mut tls) = connector.connect(name, tcp).await {
        let _ = tls.write_all(request.as_bytes()).await;
        let _ = tls.read_to_end(&mut answer).await;
    }
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn the_agent_refuses_a_coordinator_the_cluster_ca_did_not_sign() {
    let pki = cluster_pki();
    let data = tempfile::tempdir().unwrap();
    let url = start(&pki, "foreign-coordinator", data.path()).await;
    let a = Uplink::with_tls(&url, "gpu-a", &agent_tls(&pki, "ca", Some("gpu-a"))).unwrap();
    let err = a.register(&registration("gpu-a")).await.unwrap_err();
    assert!(matches!(err, UplinkError::Unreachable { .. }), "{err:?}");
    let chain = format!("{:?}", err);
    assert!(chain.contains("InvalidCertificate"), "{chain}");
}

#[test]
fn an_https_coordinator_without_a_ca_is_refused_before_starting() {
    let err = Uplink::with_tls("https://c:7400", "gpu-a", &AgentTlsConfig::default())
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        "coordinator url \"https://c:7400\": https needs tls.ca_file (the cluster CA)"
    );
}

/// Runs the `nightshift` binary against `url` with `args`, the CA given as `NIGHTSHIFT_CA`
/// when `ca` is set; its exit code, standard output and standard error.
async fn nightshift(url: &str, ca: Option<&Path>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = tokio::process::Command::new(nightshift_tests::workspace_bin("nightshift"));
    cmd.args(args)
        .env("NIGHTSHIFT_URL", url)
        .env_remove("NIGHTSHIFT_TOKEN")
        .env_remove("NIGHTSHIFT_CA");
    if let Some(ca) = ca {
        cmd.env("NIGHTSHIFT_CA", ca);
    }
    let out = cmd.output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_submits_and_lists_jobs_over_https_trusting_the_cluster_ca() {
    let pki = cluster_pki();
    let data = tempfile::tempdir().unwrap();
    let url = start(&pki, "coordinator", data.path()).await;
    let job = data.path().join("job.yaml");
    std::fs::write(&job, "name: over-tls\nimage: trainer:1\ngpus: 1\n").unwrap();
    let ca = pki.path("ca.pem");

    let (code, out, err) = nightshift(&url, Some(&ca), &["submit", job.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("submitted job 1 (over-tls)"), "{out}");

    let (code, out, err) = nightshift(&url, Some(&ca), &["jobs", "-o", "json"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let list: nightshift_common::JobList = serde_json::from_str(&out).unwrap();
    let names: Vec<_> = list.jobs.iter().map(|j| j.spec.name.as_str()).collect();
    assert_eq!(names, ["over-tls"]);
}

#[tokio::test]
async fn the_cli_says_which_ca_failed_to_verify_the_coordinator() {
    let pki = cluster_pki();
    let data = tempfile::tempdir().unwrap();
    let url = start(&pki, "coordinator", data.path()).await;

    // No CA at all: refused before any connection.
    let (code, _, err) = nightshift(&url, None, &["jobs"]).await;
    assert_ne!(code, 0);
    assert!(
        err.contains("https needs the cluster CA: set --ca FILE or NIGHTSHIFT_CA"),
        "{err}"
    );

    // Another CA: the handshake fails, and the message names the CA file used.
    let foreign = pki.path("foreign-ca.pem");
    let (code, _, err) = nightshift(&url, Some(&foreign), &["jobs"]).await;
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!(
            "tls handshake with the coordinator at {url} failed"
        )) && err.contains("invalid peer certificate")
            && err.contains(&format!("checked against the CA in {}", foreign.display())),
        "{err}"
    );

    // A CA file that is not there.
    let missing = pki.path("missing.pem");
    let (code, _, err) = nightshift(&url, Some(&missing), &["jobs"]).await;
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!("--ca ({}): cannot read", missing.display())),
        "{err}"
    );
}

/// The agent API of node gpu-a with `[tls]`, on the real Docker engine (no container of
/// gpu-a exists), with job 7's kept output holding a secret; its address.
async fn agent_api(pki: &Pki, work: &Path) -> std::net::SocketAddr {
    use nightshift_agent::engine::docker::DockerEngine;
    let kept = nightshift_agent::logs::archive_path(work, 7, 1);
    std::fs::create_dir_all(kept.parent().unwrap()).unwrap();
    std::fs::write(&kept, "toy-trainer: job=7\nAPI_KEY=s3cr3t-in-the-log\n").unwrap();
    let shared = Arc::new(nightshift_agent::state::Shared::new("gpu-a"));
    let engine = Arc::new(DockerEngine::connect().await.expect("docker"));
    let app = nightshift_agent::api::router(shared, engine, "gpu-a", work);
    let config = agent_tls(pki, "ca", Some("gpu-a"))
        .server_config()
        .unwrap()
        .expect("tls serves");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(nightshift_agent::api::serve_tls(listener, app, config));
    addr
}

/// `GET path` of the agent API at `addr` over TLS, presenting certificate `cert` (or none)
/// and expecting node `node`'s certificate; the whole answer, empty when the handshake fails.
async fn agent_get(
    addr: std::net::SocketAddr,
    pki: &Pki,
    cert: Option<&str>,
    node: &str,
    path: &str,
) -> String {
    let (cert_file, key_file) = cert
        .map(|c| (pki.path(&format!("{c}.pem")), pki.path(&format!("{c}.key"))))
        .unzip();
    let identity = cert_file.as_deref().zip(key_file.as_deref());
    let config = https::agent_client_config_as(&pki.path("ca.pem"), identity, node).unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let mut answer = Vec::new();
    if let Ok(mut tls) = connector.connect(name, tcp).await {
        let _ = tls.write_all(request.as_bytes()).await;
        let _ = tls.read_to_end(&mut answer).await;
    }
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn the_agent_api_answers_the_coordinators_certificate_only() {
    let pki = cluster_pki();
    let work = tempfile::tempdir().unwrap();
    let addr = agent_api(&pki, work.path()).await;
    let logs = "/v1/jobs/7/logs";

    // The coordinator's certificate reads the job's output and the agent's status.
    let ok = agent_get(addr, &pki, Some("coordinator"), "gpu-a", logs).await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.contains("s3cr3t-in-the-log"), "{ok}");
    let ok = agent_get(addr, &pki, Some("coordinator"), "gpu-a", "/status").await;
    assert!(
        ok.starts_with("HTTP/1.1 200") && ok.contains("\"node\":\"gpu-a\""),
        "{ok}"
    );

    for path in [logs, "/status"] {
        // No certificate: 401, and nothing of the job.
        let anonymous = agent_get(addr, &pki, None, "gpu-a", path).await;
        assert!(anonymous.starts_with("HTTP/1.1 401"), "{path}: {anonymous}");
        assert!(
            anonymous.contains("only the coordinator's may read job data"),
            "{anonymous}"
        );
        // An agent's certificate, even the node's own: 403.
        let agent = agent_get(addr, &pki, Some("gpu-a"), "gpu-a", path).await;
        assert!(agent.starts_with("HTTP/1.1 403"), "{path}: {agent}");
        assert!(
            agent.contains("node gpu-a's, not the coordinator's"),
            "{agent}"
        );
        // A coordinator certificate from another CA: no handshake, no answer.
        let foreign = agent_get(addr, &pki, Some("foreign-coordinator"), "gpu-a", path).await;
        assert_eq!(foreign, "", "{path}");
        for answer in [&anonymous, &agent] {
            assert!(
                !answer.contains("s3cr3t") && !answer.contains("gpu-a\","),
                "{path} leaked: {answer}"
            );
        }
    }

    // Plain HTTP to the HTTPS port: no HTTP answer.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /v1/jobs/7/logs HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut plain = Vec::new();
    let _ = tcp.read_to_end(&mut plain).await;
    let plain = String::from_utf8_lossy(&plain);
    assert!(
        !plain.contains("s3cr3t") && !plain.starts_with("HTTP/1.1 200"),
        "{plain}"
    );

    // The coordinator, for its part, talks only to the node it means: gpu-a's certificate
    // does not pass for gpu-b's agent.
    let impostor = agent_get(addr, &pki, Some("coordinator"), "gpu-b", logs).await;
    assert_eq!(impostor, "");
}
