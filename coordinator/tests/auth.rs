//! API tokens and roles over real HTTPS: no token or an unknown one is 401; a researcher
//! submits as its team and cannot cancel another team's job (403); an admin can. Every log
//! line of the run is captured, and no token or key appears in it. An agent speaks only for
//! the node its client certificate names: a registration is checked on its parsed body.

use std::io::Write;
use std::sync::{Arc, Mutex};

use nightshift_coordinator::auth::{Role, Tokens};
use nightshift_coordinator::config::{CoordinatorConfig, ServiceConfig, TlsConfig};
use nightshift_coordinator::pki::{self, Leaf};
use nightshift_coordinator::policy::PolicyConfig;
use nightshift_coordinator::{http, https, server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Every log line of this test binary.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The test run's log directory (the layout of `nightshift_tests::secrets`, which this crate
/// cannot depend on): `$NIGHTSHIFT_TEST_LOGS`, else `test-logs/` beside `deps/`.
fn run_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("NIGHTSHIFT_TEST_LOGS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().unwrap();
            exe.parent().unwrap().parent().unwrap().join("test-logs")
        });
    std::fs::create_dir_all(dir.join("secrets")).unwrap();
    dir
}

/// Hands this run's logs and secrets (tokens, and each PEM body line of the keys) to the
/// end-of-run scan of `tests/run.sh`.
fn hand_to_the_run_scan(logs: &[u8], secrets: &[String]) {
    let dir = run_dir();
    let pid = std::process::id();
    std::fs::write(dir.join(format!("coordinator-auth-{pid}.log")), logs).unwrap();
    let mut lines = String::new();
    for secret in secrets {
        for line in secret.lines().filter(|l| !l.starts_with("-----")) {
            lines.push_str(line.trim());
            lines.push('\n');
        }
    }
    std::fs::write(
        dir.join("secrets")
            .join(format!("coordinator-auth-{pid}.txt")),
        lines,
    )
    .unwrap();
}

struct Https {
    addr: String,
    config: Arc<rustls::ClientConfig>,
}

fn registration(node: &str) -> String {
    serde_json::to_string(&nightshift_common::RegisterRequest {
        node: node.to_owned(),
        gpus: vec![nightshift_common::GpuInfo {
            index: 0,
            uuid: format!("GPU-{node}-0"),
            name: "fake".into(),
            memory_total_bytes: 80 << 30,
        }],
        service: "default".into(),
        address: None,
        readiness_url: None,
        agent_url: None,
        metrics_url: None,
        agent_version: "test".into(),
    })
    .unwrap()
}

#[tokio::test]
async fn an_agent_registers_only_the_node_its_certificate_names() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pki::new_ca().unwrap();
    let names = ["127.0.0.1".to_owned()];
    let (ca_pem, ca_key) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
    pki::write_pair(&ca_pem, &ca_key, &ca).unwrap();
    let pair = |name: &str, leaf: Leaf<'_>| {
        let (cert, key) = (
            dir.path().join(format!("{name}.pem")),
            dir.path().join(format!("{name}.key")),
        );
        pki::write_pair(&cert, &key, &pki::issue(&ca.key_pem, leaf).unwrap()).unwrap();
        (cert, key)
    };
    let (cert, key) = pair("c", Leaf::Server(&names));
    let (agent_cert, agent_key) = pair("gpu-a", Leaf::Agent("gpu-a"));

    let data = tempfile::tempdir().unwrap();
    let tls = TlsConfig {
        ca_file: ca_pem.clone(),
        cert_file: cert,
        key_file: key,
    };
    let cfg = CoordinatorConfig {
        data_dir: data.path().to_owned(),
        tls: Some(tls.clone()),
        ..CoordinatorConfig::default()
    };
    let cluster = server::open(&cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = https::server_config(&tls).unwrap();
    tokio::spawn(https::serve_tls(
        listener,
        cluster,
        config,
        std::future::pending(),
    ));
    let gpu_a = Https {
        addr: addr.clone(),
        config: Arc::new(https::client_config(&ca_pem, Some((&agent_cert, &agent_key))).unwrap()),
    };
    let anonymous = Https {
        addr,
        config: Arc::new(https::client_config(&ca_pem, None).unwrap()),
    };

    // Its own node: registered, and its routes answer.
    let (status, body) = gpu_a
        .call("POST", "/v1/agents/register", None, &registration("gpu-a"))
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = gpu_a
        .call("GET", "/v1/agents/gpu-a/desired?after=0", None, "")
        .await;
    assert_eq!(status, 200, "{body}");

    // Another node, in the body or in the path: 403 naming both.
    let (status, body) = gpu_a
        .call("POST", "/v1/agents/register", None, &registration("gpu-b"))
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(r#""error":"the client certificate is for node gpu-a, not gpu-b""#)
            && body.contains(r#""field":"node""#),
        "{body}"
    );
    for (method, path) in [
        ("POST", "/v1/agents/gpu-b/heartbeat"),
        ("GET", "/v1/agents/gpu-b/desired"),
    ] {
        let (status, body) = gpu_a.call(method, path, None, "{}").await;
        assert_eq!(status, 403, "{method} {path}: {body}");
        assert!(body.contains("not gpu-b"), "{body}");
    }

    // A body that is no registration: the handler's own parse answers, naming the field.
    let (status, body) = gpu_a
        .call("POST", "/v1/agents/register", None, r#"{"node": 7}"#)
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid registration: node"), "{body}");

    // No certificate: 401 before the body is looked at, whatever it holds.
    for body in [registration("gpu-a"), "not json".to_owned()] {
        let (status, answer) = anonymous
            .call("POST", "/v1/agents/register", None, &body)
            .await;
        assert_eq!(status, 401, "{answer}");
        assert!(answer.contains("client certificate"), "{answer}");
    }
    let (status, _) = anonymous
        .call("POST", "/v1/agents/gpu-a/heartbeat", None, "{}")
        .await;
    assert_eq!(status, 401);
}

impl Https {
    /// One HTTP/1.1 request on its own TLS connection; the status and the body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (u16, String) {
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let tcp = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let mut tls = connector.connect(name, tcp).await.unwrap();
        let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{auth}\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = tls.read_to_end(&mut answer).await;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let status = answer
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = answer
            .split_once("\r\n\r\n")
            .map_or(String::new(), |(_, b)| b.to_owned());
        (status, body)
    }
}

fn job(name: &str, owner: Option<&str>) -> String {
    let owner = owner.map_or(String::new(), |o| format!(r#","owner":"{o}""#));
    format!(r#"{{"name":"{name}","image":"registry.example/t:1","gpus":1{owner}}}"#)
}

fn id_of(body: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["id"].as_u64().unwrap()
}

#[tokio::test]
async fn roles_over_https_and_no_secret_in_the_logs() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .init();

    let dir = tempfile::tempdir().unwrap();
    let ca = pki::new_ca().unwrap();
    let names = ["127.0.0.1".to_owned()];
    let server_cert = pki::issue(&ca.key_pem, Leaf::Server(&names)).unwrap();
    let (ca_pem, ca_key) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
    let (cert, key) = (dir.path().join("c.pem"), dir.path().join("c.key"));
    pki::write_pair(&ca_pem, &ca_key, &ca).unwrap();
    pki::write_pair(&cert, &key, &server_cert).unwrap();

    let data = tempfile::tempdir().unwrap();
    let tokens = Tokens::open(data.path()).unwrap();
    let (_, admin) = tokens.create("ops", Role::Admin, None, 1).unwrap();
    let (_, nlp) = tokens
        .create("alice", Role::Researcher, Some("nlp"), 1)
        .unwrap();
    let (_, vision) = tokens
        .create("bob", Role::Researcher, Some("vision"), 1)
        .unwrap();

    let tls = TlsConfig {
        ca_file: ca_pem.clone(),
        cert_file: cert,
        key_file: key,
    };
    let cfg = CoordinatorConfig {
        data_dir: data.path().to_owned(),
        tls: Some(tls.clone()),
        services: vec![ServiceConfig {
            min_replicas: 0,
            ..ServiceConfig::default()
        }],
        ..CoordinatorConfig::default()
    };
    let cluster = server::open(&cfg).unwrap();
    let access = http::access_for(&cfg, cluster.clone()).unwrap();
    let policy = PolicyConfig {
        allowed_images: vec!["registry.example/".into()],
        host_mount_allowlist: vec!["/datasets".into()],
        max_run_seconds_per_job: 3600,
        ..PolicyConfig::default()
    };
    let app = http::app(cluster.clone(), access, policy);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = https::server_config(&tls).unwrap();
    tokio::spawn(https::serve_tls_app(
        listener,
        cluster,
        app,
        config,
        std::future::pending(),
    ));
    let client = Https {
        addr,
        config: Arc::new(https::client_config(&ca_pem, None).unwrap()),
    };

    // No token, an unknown token: 401.
    let (status, body) = client.call("GET", "/v1/jobs", None, "").await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("NIGHTSHIFT_TOKEN"), "{body}");
    let (status, _) = client.call("GET", "/v1/jobs", Some("nst_0000"), "").await;
    assert_eq!(status, 401);

    // Researchers submit as their team; another team's owner is refused, naming the field.
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &job("sft", None))
        .await;
    assert_eq!(status, 201, "{body}");
    assert!(body.contains(r#""owner":"nlp""#), "{body}");
    let nlp_job = id_of(&body);
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&vision), &job("vit", None))
        .await;
    assert_eq!(status, 201, "{body}");
    let vision_job = id_of(&body);
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &job("x", Some("vision")))
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(r#""field":"owner""#), "{body}");

    // Policy: a privileged job, or an image from elsewhere, is refused naming the rule.
    let privileged = r#"{"name":"p","image":"registry.example/t:1","gpus":1,"privileged":true}"#;
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), privileged)
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains("policy.sandbox: privileged: jobs may not use privileged containers"),
        "{body}"
    );
    let elsewhere = r#"{"name":"e","image":"docker.io/evil:1","gpus":1}"#;
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&admin), elsewhere)
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("policy.allowed_images"), "{body}");

    // The sandbox section: a privileged container is refused for a researcher naming the
    // rule, and an admin's token waives it (audited); a mount under the allowlist passes.
    let sandboxed = |name: &str, sandbox: &str| {
        format!(
            r#"{{"name":"{name}","image":"registry.example/t:1","gpus":1,"sandbox":{sandbox}}}"#
        )
    };
    let privileged = sandboxed("p2", r#"{"privileged":true}"#);
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &privileged)
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(
            "policy.allow_privileged: sandbox.privileged: a privileged container is not allowed"
        ) && body.contains(r#""field":"sandbox.privileged""#),
        "{body}"
    );
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&admin), &privileged)
        .await;
    assert_eq!(status, 201, "{body}");
    assert!(body.contains(r#""privileged":true"#), "{body}");
    let mount = |host: &str| {
        sandboxed(
            "m",
            &format!(r#"{{"mounts":[{{"host":"{host}","path":"/data"}}]}}"#),
        )
    };
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &mount("/datasets/imagenet"))
        .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &mount("/etc"))
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("policy.host_mount_allowlist"), "{body}");

    // A run-time limit: filled into a job that names none, refused above it (admins too).
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &job("bounded", None))
        .await;
    assert_eq!(status, 201, "{body}");
    assert!(body.contains(r#""maxRunSeconds":3600"#), "{body}");
    let timed = |seconds: u64| {
        format!(
            r#"{{"name":"t","image":"registry.example/t:1","gpus":1,"maxRunSeconds":{seconds}}}"#
        )
    };
    let (status, body) = client
        .call("POST", "/v1/jobs", Some(&nlp), &timed(60))
        .await;
    assert_eq!(status, 201, "{body}");
    assert!(body.contains(r#""maxRunSeconds":60"#), "{body}");
    for token in [&nlp, &admin] {
        let (status, body) = client
            .call("POST", "/v1/jobs", Some(token), &timed(7200))
            .await;
        assert_eq!(status, 403, "{body}");
        assert!(
            body.contains(
                "policy.max_run_seconds_per_job: 7200 s of run time asked, at most 3600 s"
            ) && body.contains(r#""field":"maxRunSeconds""#),
            "{body}"
        );
    }

    // Everyone sees every queue.
    let (status, body) = client.call("GET", "/v1/jobs", Some(&nlp), "").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("\"vit\"") && body.contains("\"sft\""),
        "{body}"
    );

    // A researcher cannot cancel another team's job, nor send gateway signals.
    let (status, body) = client
        .call(
            "POST",
            &format!("/v1/jobs/{vision_job}/cancel"),
            Some(&nlp),
            "",
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains("may cancel only its team's jobs") && body.contains("belongs to vision"),
        "{body}"
    );
    let (status, _) = client
        .call(
            "POST",
            "/v1/services/default/gateway",
            Some(&nlp),
            r#"{"waiting":1}"#,
        )
        .await;
    assert_eq!(status, 403);

    // Its own team's job, yes; and an admin cancels anyone's.
    let (status, body) = client
        .call(
            "POST",
            &format!("/v1/jobs/{nlp_job}/cancel"),
            Some(&nlp),
            "",
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = client
        .call(
            "POST",
            &format!("/v1/jobs/{vision_job}/cancel"),
            Some(&admin),
            "",
        )
        .await;
    assert_eq!(status, 200, "{body}");

    // The audit log names who did what; no token and no key is in any log line.
    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let server_key = std::fs::read_to_string(dir.path().join("c.key")).unwrap();
    hand_to_the_run_scan(
        logs.as_bytes(),
        &[
            admin.clone(),
            nlp.clone(),
            vision.clone(),
            std::fs::read_to_string(&ca_key).unwrap(),
            server_key,
        ],
    );
    assert!(
        logs.contains("nightshift::audit") && logs.contains("alice"),
        "no audit lines: {logs}"
    );
    assert!(
        logs.lines()
            .any(|l| l.contains("job policy waived by an admin token")
                && l.contains("ops")
                && l.contains("policy.allow_privileged")),
        "no audit line for the waiver"
    );
    for secret in [&admin, &nlp, &vision] {
        assert!(!logs.contains(secret.as_str()), "a token is in the logs");
        assert!(!logs.contains(&secret[4..]), "a token is in the logs");
    }
    let key_pem = std::fs::read_to_string(&ca_key).unwrap();
    let key_body = key_pem.lines().nth(1).unwrap();
    assert!(!logs.contains(key_body), "the CA key is in the logs");
    assert!(
        !logs.contains("PRIVATE KEY"),
        "a private key is in the logs"
    );
}
