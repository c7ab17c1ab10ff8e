//! The coordinator's HTTP API, served in-process on an ephemeral port: bad input is refused
//! with the field named and changes nothing; a decision reaches a long-polling agent at once.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nightshift_common::{
    DesiredNode, GpuInfo, Heartbeat, JobList, RegisterRequest, ReplicaState, ReplicaStatus,
    ServingSignals,
};
use nightshift_coordinator::config::{CoordinatorConfig, ScaleDownConfig, ServiceConfig};
use serde_json::{Value, json};

struct Server {
    url: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let cfg = CoordinatorConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.path().to_owned(),
        services: vec![ServiceConfig {
            min_replicas: 0,
            cooldown_s: 0.0,
            scale_down: ScaleDownConfig {
                window_s: 0.0,
                ..ScaleDownConfig::default()
            },
            ..ServiceConfig::default()
        }],
        ..CoordinatorConfig::default()
    };
    let cluster = nightshift_coordinator::server::open(&cfg).unwrap();
    let listener = tokio::net::TcpListener::bind(cfg.listen).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(nightshift_coordinator::server::serve(
        listener,
        cluster,
        std::future::pending(),
    ));
    Server {
        url,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

impl Server {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn jobs(&self) -> JobList {
        self.http
            .get(format!("{}/v1/jobs", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn register(&self, node: &str, gpus: u32) {
        let req = RegisterRequest {
            node: node.into(),
            gpus: (0..gpus)
                .map(|i| GpuInfo {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    name: "t".into(),
                    memory_total_bytes: 1,
                })
                .collect(),
            service: "default".into(),
            readiness_url: None,
            agent_url: None,
            agent_version: "test".into(),
        };
        let (status, _) = self
            .post("/v1/agents/register", serde_json::to_value(req).unwrap())
            .await;
        assert_eq!(status, 200);
    }

    async fn heartbeat(&self, node: &str) -> DesiredNode {
        let beat = Heartbeat {
            gpus: vec![],
            replica: ReplicaStatus {
                state: ReplicaState::Serving,
                signals: ServingSignals {
                    requests_running: Some(0.0),
                    requests_waiting: Some(0.0),
                    kv_cache_usage: Some(0.0),
                    ..Default::default()
                },
            },
            jobs: vec![],
            applied_version: 0,
            phases: vec![],
            expired_leases: vec![],
            host: None,
            agent_url: None,
        };
        let (status, body) = self
            .post(
                &format!("/v1/agents/{node}/heartbeat"),
                serde_json::to_value(beat).unwrap(),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_value(body).unwrap()
    }
}

fn job(extra: Value) -> Value {
    let mut j = json!({"name": "t", "image": "trainer:1", "gpus": 2});
    j.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    j
}

#[tokio::test]
async fn bad_jobs_are_refused_with_the_field_named_and_nothing_is_stored() {
    let s = start().await;
    s.register("n1", 4).await;
    let cases = [
        (job(json!({"gpu": 3})), 400, "unknown field `gpu`", None),
        (
            job(json!({"image": ""})),
            422,
            "image: must not be empty",
            Some("image"),
        ),
        (
            job(json!({"gpus": 8})),
            422,
            "gpus: 8 is more than any node has (the largest has 4)",
            Some("gpus"),
        ),
        (job(json!({"gpus": "two"})), 400, "invalid type", None),
        (
            job(json!({"checkpoint": {"signal": "SIGKILL"}})),
            422,
            "checkpoint.signal: must be one of",
            Some("checkpoint.signal"),
        ),
    ];
    for (body, code, message, field) in cases {
        let (status, err) = s.post("/v1/jobs", body.clone()).await;
        assert_eq!(status, code, "{body} → {err}");
        assert!(
            err["error"].as_str().unwrap().contains(message),
            "{body} → {err}"
        );
        assert_eq!(err["field"].as_str(), field, "{body} → {err}");
    }
    let (status, _) = s.post("/v1/jobs", json!("not an object")).await;
    assert_eq!(status, 400);
    assert!(s.jobs().await.jobs.is_empty(), "nothing was stored");
    let (status, created) = s.post("/v1/jobs", job(json!({}))).await;
    assert_eq!((status, created["id"].as_u64()), (201, Some(1)));
}

#[tokio::test]
async fn unknown_jobs_and_nodes_are_404_and_a_finished_job_cannot_be_cancelled() {
    let s = start().await;
    let resp = s
        .http
        .get(format!("{}/v1/jobs/42", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let (status, err) = s.post("/v1/jobs/42/cancel", json!(null)).await;
    assert_eq!(
        (status, err["error"].as_str()),
        (404, Some("job 42 not found"))
    );
    let (status, _) = s.post("/v1/agents/ghost/heartbeat", json!({"gpus": [], "replica": {"state": "serving", "signals": {"requests_running": null, "requests_waiting": null, "kv_cache_usage": null}}, "jobs": [], "applied_version": 0})).await;
    assert_eq!(status, 404);
    s.post("/v1/jobs", job(json!({}))).await;
    let (status, _) = s.post("/v1/jobs/1/cancel", json!(null)).await;
    assert_eq!(status, 200);
    let (status, err) = s.post("/v1/jobs/1/cancel", json!(null)).await;
    assert_eq!(
        (status, err["error"].as_str()),
        (409, Some("job 1 is already cancelled"))
    );
}

#[tokio::test]
async fn a_decision_reaches_a_long_polling_agent_at_once() {
    let s = start().await;
    s.register("n1", 4).await;
    let before = s.heartbeat("n1").await;
    assert!(before.serve && before.leases.is_empty());

    let poll = {
        let (http, url, after) = (s.http.clone(), s.url.clone(), before.version);
        tokio::spawn(async move {
            let resp = http
                .get(format!(
                    "{url}/v1/agents/n1/desired?after={after}&wait_ms=20000"
                ))
                .send()
                .await
                .unwrap();
            (Instant::now(), resp.json::<DesiredNode>().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let submitted = Instant::now();
    let (status, _) = s.post("/v1/jobs", job(json!({}))).await;
    assert_eq!(status, 201);
    let (answered, desired) = poll.await.unwrap();
    let latency = answered.duration_since(submitted);
    println!("long-poll answered {latency:?} after the submission");
    assert!(
        latency < Duration::from_secs(2),
        "woken by the decision, not the 20 s timeout"
    );
    assert!(!desired.serve);
    assert_eq!(desired.leases.len(), 1);
    assert_eq!(desired.leases[0].gpus, vec![0, 1]);
}
