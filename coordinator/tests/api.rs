//! The coordinator's HTTP API, served in-process on an ephemeral port: bad input is refused
//! with the field named and changes nothing; a decision reaches a long-polling agent at once.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nightshift_common::{
    DesiredNode, GpuInfo, Heartbeat, JobList, RegisterRequest, ReplicaState, ReplicaStatus,
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
    // Dropping the handle detaches the task: the server runs until the test ends.
    let (url, _task) = serve_in(dir.path()).await;
    Server {
        url,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

/// Serves a coordinator whose state lives in `dir`; aborting the task stops it.
async fn serve_in(dir: &std::path::Path) -> (String, tokio::task::JoinHandle<()>) {
    let cfg = CoordinatorConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.to_owned(),
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
    let task = tokio::spawn(async move {
        let _ =
            nightshift_coordinator::server::serve(listener, cluster, std::future::pending()).await;
    });
    (url, task)
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

    async fn text(&self, path: &str) -> String {
        let resp = self.http.get(format!("{}{path}", self.url)).send().await;
        resp.unwrap().text().await.unwrap()
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
            address: None,
            readiness_url: None,
            agent_url: None,
            metrics_url: None,
            agent_version: "test".into(),
        };
        let (status, _) = self
            .post("/v1/agents/register", serde_json::to_value(req).unwrap())
            .await;
        assert_eq!(status, 200);
    }

    /// A heartbeat of an idle serving replica with no jobs.
    async fn heartbeat(&self, node: &str) -> DesiredNode {
        self.beat(node, ReplicaState::Serving, 0, vec![]).await
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
        (
            job(json!({"gpu": 3})),
            400,
            "gpu: unknown field `gpu`",
            Some("gpu"),
        ),
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
        (
            job(json!({"gpus": "two"})),
            400,
            "gpus: invalid type",
            Some("gpus"),
        ),
        (
            job(json!({"retry": {"limit": -1}})),
            400,
            "retry.limit: invalid value: integer `-1`, expected u32",
            Some("retry.limit"),
        ),
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

    // The GPU gauge finds the node's lease (through the per-node index).
    let metrics = s.text("/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l == "nightshift_gpus{service=\"default\",state=\"lent\"} 2"),
        "{metrics}"
    );
}

fn run(
    lease: &nightshift_common::LeaseGrant,
    state: nightshift_common::JobRunState,
) -> nightshift_common::JobRun {
    nightshift_common::JobRun {
        job_id: lease.job_id,
        attempt: lease.attempt,
        lease_id: lease.lease_id,
        epoch: lease.epoch,
        gpus: lease.gpus.clone(),
        state,
        last_checkpoint_at: None,
        outputs: Default::default(),
        image_id: None,
        image_digest: None,
        ready: false,
    }
}

impl Server {
    async fn beat(
        &self,
        node: &str,
        replica: ReplicaState,
        applied: u64,
        jobs: Vec<nightshift_common::JobRun>,
    ) -> DesiredNode {
        let beat = Heartbeat::report(ReplicaStatus::idle(replica), jobs, applied);
        let (status, body) = self
            .post(
                &format!("/v1/agents/{node}/heartbeat"),
                serde_json::to_value(beat).unwrap(),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_value(body).unwrap()
    }

    async fn report(&self) -> Value {
        self.http
            .get(format!("{}/v1/report?since=0", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

/// Sum of gpus × duration over the recorded leases, in GPU-hours, read from the database.
fn recorded_gpu_hours(dir: &std::path::Path) -> (f64, i64) {
    let conn = rusqlite::Connection::open(dir.join("nightshift.db")).unwrap();
    conn.query_row(
        "SELECT COALESCE(SUM(gpus * (ended_at - started_at)), 0), COUNT(*) FROM usage",
        [],
        |r| Ok((r.get::<_, i64>(0)? as f64 / 3_600_000.0, r.get(1)?)),
    )
    .unwrap()
}

#[tokio::test]
async fn the_report_equals_the_recorded_leases_across_a_restart() {
    use nightshift_common::JobRunState;
    let dir = tempfile::tempdir().unwrap();
    let (url, task) = serve_in(dir.path()).await;
    let mut s = Server {
        url,
        http: reqwest::Client::new(),
        _dir: tempfile::tempdir().unwrap(),
    };
    s.register("n1", 4).await;
    s.heartbeat("n1").await;
    let mut job = json!({"name": "t", "image": "trainer:1", "gpus": 2, "owner": "nlp"});
    s.post("/v1/jobs", job.clone()).await;
    job["gpus"] = json!(4);
    s.post("/v1/jobs", job).await;

    // Job 1 runs, then the coordinator is killed mid-run and restarted on the same state.
    let d = s.beat("n1", ReplicaState::Stopped, 0, vec![]).await;
    let lease1 = d.leases[0].clone();
    s.beat(
        "n1",
        ReplicaState::Stopped,
        d.version,
        vec![run(&lease1, JobRunState::Running)],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    task.abort();
    let _ = task.await;
    let (url, _task) = serve_in(dir.path()).await;
    s.url = url;
    let jobs = s.jobs().await.jobs;
    assert_eq!(jobs.len(), 2);
    assert_eq!(
        jobs[0].leases.first().map(|l| l.epoch),
        Some(lease1.epoch),
        "the lease survived"
    );

    // Job 1 finishes; job 2 runs and finishes.
    let exited = JobRunState::Exited {
        exit_code: 0,
        stopped_by_agent: false,
    };
    let d = s
        .beat(
            "n1",
            ReplicaState::Stopped,
            d.version,
            vec![run(&lease1, exited.clone())],
        )
        .await;
    let lease2 = d
        .leases
        .iter()
        .find(|l| l.job_id == 2)
        .expect("job 2 leased")
        .clone();
    s.beat(
        "n1",
        ReplicaState::Stopped,
        d.version,
        vec![run(&lease2, JobRunState::Running)],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.beat(
        "n1",
        ReplicaState::Stopped,
        d.version,
        vec![run(&lease2, exited)],
    )
    .await;

    let (recorded, rows) = recorded_gpu_hours(dir.path());
    assert_eq!(rows, 2, "one accounting record per lease");
    let report = s.report().await;
    let harvested = report["harvested_gpu_hours"].as_f64().unwrap();
    println!("harvested {harvested} GPU-hours, recorded {recorded}");
    assert!(recorded > 0.0);
    assert!(
        (harvested - recorded).abs() < 1e-6,
        "report {harvested} = recorded {recorded}"
    );
    assert_eq!(report["currency"], "USD");
    assert_eq!(report["preemptions"], 0);
    assert!((report["savings"].as_f64().unwrap() - recorded * 2.0).abs() < 1e-6);
    assert!(report["equivalent_gpus"].as_f64().unwrap() > 0.0);
    assert_eq!(report["lost_gpu_hours"], 0.0);
    // /metrics counts the same GPU time, under the service of the node that lent it, and
    // both jobs as finished.
    let metrics = s.text("/metrics").await;
    let seconds: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("nightshift_harvested_gpu_seconds_total{service=\"default\"} ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no harvested time in:\n{metrics}"));
    assert!(
        (seconds / 3600.0 - recorded).abs() < 1e-6,
        "metrics {seconds} s = recorded {recorded} h"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "nightshift_jobs_finished_total{state=\"succeeded\"} 2"),
        "{metrics}"
    );
}

#[tokio::test]
async fn metrics_and_service_discovery_show_the_serving_replica() {
    let s = start().await;
    s.register("n1", 4).await;
    let beat = json!({
        "gpus": [],
        "replica": {
            "state": "serving",
            "signals": {"requests_running": 0.0, "requests_waiting": 0.0, "kv_cache_usage": 0.0},
            "url": "http://10.0.0.7:8000"
        },
        "jobs": [],
        "applied_version": 1,
        "phases": [
            {"seq": 1, "sequence": "reclaim", "phase": "wait_health", "started_at": 1, "duration_ms": 1500},
            {"seq": 2, "sequence": "reclaim", "phase": "stop_jobs", "started_at": 2, "duration_ms": 200}
        ],
        "metrics_url": "http://10.0.0.7:7401/metrics"
    });
    for _ in 0..2 {
        // Sent twice: the phases are counted once.
        let (status, _) = s.post("/v1/agents/n1/heartbeat", beat.clone()).await;
        assert_eq!(status, 200);
    }
    let endpoints: Value =
        serde_json::from_str(&s.text("/v1/services/default/endpoints").await).unwrap();
    assert_eq!(
        endpoints,
        json!({"service": "default", "endpoints": [{"node": "n1", "url": "http://10.0.0.7:8000", "ready": true}]})
    );
    let sd: Value = serde_json::from_str(&s.text("/v1/services/default/http_sd").await).unwrap();
    assert_eq!(
        sd,
        json!([{"targets": ["10.0.0.7:8000"], "labels": {"service": "default", "node": "n1"}}])
    );
    let missing = s
        .http
        .get(format!("{}/v1/services/nope/endpoints", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    // The agents' own metrics, for Prometheus: where the heartbeat said they are.
    let sd: Value = serde_json::from_str(&s.text("/v1/nodes/http_sd").await).unwrap();
    assert_eq!(
        sd,
        json!([{"targets": ["10.0.0.7:7401"], "labels": {
            "node": "n1", "service": "default",
            "__scheme__": "http", "__metrics_path__": "/metrics"}}])
    );

    let metrics = s.text("/metrics").await;
    for line in [
        "nightshift_gpus{service=\"default\",state=\"serving\"} 4",
        "nightshift_gpus{service=\"default\",state=\"lent\"} 0",
        "nightshift_jobs{state=\"queued\"} 0",
        "nightshift_queue_length 0",
        "nightshift_phase_duration_seconds_count{sequence=\"reclaim\",phase=\"wait_health\"} 1",
        "nightshift_phase_duration_seconds_sum{sequence=\"reclaim\",phase=\"stop_jobs\"} 0.2",
        "nightshift_harvested_gpu_seconds_total{service=\"default\"} 0.0",
        "nightshift_jobs_finished_total{state=\"succeeded\"} 0",
        "nightshift_job_preemptions_total 0",
        "nightshift_vllm_requests_waiting{service=\"default\",node=\"n1\"} 0.0",
        "nightshift_vllm_requests_running{service=\"default\",node=\"n1\"} 0.0",
        // The classic text format (this client does not ask for OpenMetrics).
        "# TYPE nightshift_job_preemptions_total counter",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "missing {line:?} in:\n{metrics}"
        );
    }
    // The ticker decides at least twice a second, and times each decision.
    let decisions = |metrics: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("nightshift_decision_duration_seconds_count "))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no decision count in:\n{metrics}"))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while decisions(&s.text("/metrics").await) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no decision timed in 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
