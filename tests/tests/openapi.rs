//! The API's traffic validates against its own OpenAPI document (`/v1/openapi.json`): the
//! real `nightshift` CLI and an agent's calls (register, heartbeats, the long-poll) go to a
//! real coordinator through a recording proxy, and every request body and reply body is
//! checked with a JSON Schema validator against the schema of its operation and status in
//! the document the coordinator serves. No Docker: the agent is played by the test, with the
//! agent protocol's own types.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::header;
use axum::response::Response;
use nightshift_common::{
    DesiredNode, GpuInfo, Heartbeat, JobRun, JobRunState, RegisterRequest, ReplicaState,
    ReplicaStatus, ServingSignals,
};
use nightshift_tests::*;
use serde_json::Value;

/// One request and its reply, as they crossed the proxy.
#[derive(Debug, Clone)]
struct Exchange {
    method: String,
    path: String,
    request: Bytes,
    status: u16,
    content_type: String,
    reply: Bytes,
}

#[derive(Clone)]
struct Recorder {
    upstream: String,
    http: reqwest::Client,
    log: Arc<Mutex<Vec<Exchange>>>,
}

/// Forwards a request to the coordinator as it came, and its answer back, keeping both.
async fn forward(State(r): State<Recorder>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let request = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = r
        .http
        .request(parts.method.clone(), format!("{}{target}", r.upstream))
        .body(request.clone());
    for (name, value) in &parts.headers {
        if name != header::HOST && name != header::CONTENT_LENGTH {
            out = out.header(name, value);
        }
    }
    let answer = out.send().await.expect("the coordinator answers");
    let status = answer.status();
    let content_type = answer
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let reply = answer.bytes().await.unwrap();
    r.log.lock().unwrap().push(Exchange {
        method: parts.method.as_str().to_lowercase(),
        path: parts.uri.path().to_owned(),
        request,
        status: status.as_u16(),
        content_type: content_type.clone(),
        reply: reply.clone(),
    });
    let mut resp = Response::builder().status(status);
    if !content_type.is_empty() {
        resp = resp.header(header::CONTENT_TYPE, content_type);
    }
    resp.body(axum::body::Body::from(reply)).unwrap()
}

/// The path template of the document that `path` is an instance of, and its path item.
fn path_item<'a>(doc: &'a Value, path: &str) -> Option<(&'a str, &'a Value)> {
    let segments: Vec<&str> = path.split('/').collect();
    doc["paths"]
        .as_object()?
        .iter()
        .find(|(template, _)| {
            let t: Vec<&str> = template.split('/').collect();
            t.len() == segments.len()
                && t.iter()
                    .zip(&segments)
                    .all(|(t, s)| t == s || (t.starts_with('{') && t.ends_with('}')))
        })
        .map(|(t, item)| (t.as_str(), item))
}

/// What `instance` breaks of `schema`, a schema of the document (its `$ref`s resolve in the
/// document's components).
fn violations(doc: &Value, schema: &Value, instance: &Value) -> Vec<String> {
    let mut root = schema.clone();
    let obj = root.as_object_mut().expect("a schema object");
    obj.insert("components".into(), doc["components"].clone());
    obj.insert(
        "$schema".into(),
        "https://json-schema.org/draft/2020-12/schema".into(),
    );
    let validator = jsonschema::draft202012::new(&root)
        .unwrap_or_else(|e| panic!("not a JSON Schema: {e}: {schema}"));
    validator
        .iter_errors(instance)
        .map(|e| format!("{e} (at {})", e.instance_path()))
        .collect()
}

/// Checks one exchange against the document: its operation exists, its request body fits the
/// request schema, its status is documented (or falls to `default`) and its reply body fits
/// that response's schema for the media type it came with. The problems, if any.
fn check(doc: &Value, x: &Exchange) -> Vec<String> {
    let what = format!("{} {} -> {}", x.method, x.path, x.status);
    let Some((template, item)) = path_item(doc, &x.path) else {
        return vec![format!("{what}: no such path in the document")];
    };
    let Some(op) = item.get(&x.method) else {
        return vec![format!("{what}: no {} operation on {template}", x.method)];
    };
    let mut problems = Vec::new();
    if !x.request.is_empty() {
        match op["requestBody"]["content"]["application/json"].get("schema") {
            None => problems.push(format!("{what}: a request body, and none is documented")),
            Some(schema) => {
                let body: Value = serde_json::from_slice(&x.request)
                    .unwrap_or_else(|e| panic!("{what}: request body is not JSON: {e}"));
                for v in violations(doc, schema, &body) {
                    problems.push(format!("{what}: request body: {v}"));
                }
            }
        }
    }
    let responses = &op["responses"];
    let Some(response) = responses
        .get(x.status.to_string())
        .or_else(|| responses.get("default"))
    else {
        return vec![format!("{what}: status not documented")];
    };
    let media = x.content_type.split(';').next().unwrap_or("").trim();
    match response.get("content") {
        None if x.reply.is_empty() => {}
        None => problems.push(format!("{what}: a reply body, and none is documented")),
        Some(content) => match content.get(media) {
            None => problems.push(format!(
                "{what}: reply of type {media:?}, documented as {:?}",
                content.as_object().map(|c| c.keys().collect::<Vec<_>>())
            )),
            Some(c) if media == "application/json" => {
                let body: Value = serde_json::from_slice(&x.reply)
                    .unwrap_or_else(|e| panic!("{what}: reply is not JSON: {e}"));
                for v in violations(doc, &c["schema"], &body) {
                    problems.push(format!("{what}: reply: {v}"));
                }
            }
            Some(_) => {}
        },
    }
    problems
}

/// The agent, played by the test: the agent protocol's own request types.
struct Agent {
    http: reqwest::Client,
    url: String,
    node: String,
}

impl Agent {
    async fn register(&self) {
        let req = RegisterRequest {
            node: self.node.clone(),
            gpus: (0..2)
                .map(|i| GpuInfo {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    name: "Fake GPU".into(),
                    memory_total_bytes: 80 << 30,
                })
                .collect(),
            service: "default".into(),
            address: Some("127.0.0.1".into()),
            readiness_url: None,
            agent_url: None,
            metrics_url: Some("http://127.0.0.1:9/metrics".into()),
            agent_version: "test".into(),
        };
        let resp = self
            .http
            .post(format!("{}/v1/agents/register", self.url))
            .json(&req)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    }

    async fn beat(&self, jobs: Vec<JobRun>, applied_version: u64) -> DesiredNode {
        let beat = Heartbeat {
            gpus: vec![],
            replica: ReplicaStatus {
                state: ReplicaState::Serving,
                signals: ServingSignals {
                    requests_running: Some(0.0),
                    requests_waiting: Some(0.0),
                    kv_cache_usage: Some(0.0),
                    ..ServingSignals::default()
                },
                url: Some("http://127.0.0.1:8000".into()),
            },
            jobs,
            applied_version,
            phases: vec![],
            expired_leases: vec![],
            host: None,
            agent_url: None,
            metrics_url: None,
        };
        let resp = self
            .http
            .post(format!("{}/v1/agents/{}/heartbeat", self.url, self.node))
            .json(&beat)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.json().await.unwrap()
    }

    async fn desired(&self, after: u64) -> DesiredNode {
        let url = format!(
            "{}/v1/agents/{}/desired?after={after}&wait_ms=0",
            self.url, self.node
        );
        self.http
            .get(url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

const JOB: &str = "name: train\nimage: trainer:1\ngpus: 1\nenv:\n- name: STEPS\n  value: \"10\"\n";

const WORKFLOW: &str = r#"apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: hello-
spec:
  entrypoint: main
  arguments:
    parameters:
    - name: who
      value: world
  templates:
  - name: main
    container:
      image: busybox:1
      command: [echo, "hello {{workflow.parameters.who}}"]
"#;

/// Runs the CLI against `url`, expecting exit code `code`.
async fn cli(url: &str, args: &[&str], code: i32) -> String {
    let (got, out, err) = nightshift(url, args).await;
    assert_eq!(got, code, "nightshift {args:?}: {out}{err}");
    out
}

#[tokio::test]
async fn the_clis_and_the_agents_traffic_validates_against_the_openapi_document() {
    let dir = tempfile::tempdir().unwrap();
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let log = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        upstream: coordinator.url.clone(),
        http: reqwest::Client::new(),
        log: log.clone(),
    };
    let app = axum::Router::new().fallback(forward).with_state(recorder);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let agent = Agent {
        http: reqwest::Client::new(),
        url: url.clone(),
        node: unique_node("openapi"),
    };
    agent.register().await;
    agent.beat(vec![], 0).await;

    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, JOB).unwrap();
    let job_file = job_file.to_str().unwrap();
    cli(&url, &["submit", job_file], 0).await;
    cli(&url, &["-o", "json", "submit", job_file], 0).await;

    // The node is lent to job 1 once the idle replica has been idle a window: the agent
    // says it runs, so that the replies show leases, attempts and a GPU held.
    let (version, lease) = wait_for("a lease for job 1", Duration::from_secs(30), || async {
        let desired = agent.beat(vec![], 0).await;
        let lease = desired.leases.into_iter().find(|l| l.job_id == 1);
        lease.map(|l| (desired.version, l))
    })
    .await;
    let running = JobRun {
        job_id: 1,
        attempt: 1,
        lease_id: lease.lease_id,
        epoch: lease.epoch,
        gpus: lease.gpus.clone(),
        state: JobRunState::Running,
        last_checkpoint_at: None,
        outputs: Default::default(),
        image_id: Some("sha256:0123".into()),
        image_digest: None,
        ready: true,
    };
    agent.beat(vec![running.clone()], version).await;
    agent.desired(version).await;

    for args in [
        &["jobs"][..],
        &["-o", "json", "jobs"],
        &["job", "show", "1"],
        &["-o", "json", "job", "show", "1"],
        &["nodes"],
        &["-o", "json", "nodes"],
        &["report"],
        &["report", "--by", "team"],
        &["-o", "json", "report", "--since", "7d", "--by", "job"],
    ] {
        cli(&url, args, 0).await;
    }
    // Refusals: an unknown job, a job larger than any node (the coordinator's 422), output
    // of a job whose agent told no url.
    cli(&url, &["job", "show", "999"], 1).await;
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "name: big\nimage: trainer:1\ngpus: 8\n").unwrap();
    let (code, _, _) = nightshift(&url, &["submit", bad.to_str().unwrap()]).await;
    assert_ne!(code, 0);
    let (code, _, _) = nightshift(&url, &["logs", "1"]).await;
    assert_ne!(code, 0);

    // Cancelling the running job: the agent stops it.
    cli(&url, &["cancel", "1"], 0).await;
    let stopped = JobRun {
        state: JobRunState::Exited {
            exit_code: 143,
            stopped_by_agent: true,
        },
        ..running
    };
    agent.beat(vec![stopped], version).await;
    cli(&url, &["cancel", "2"], 0).await;
    cli(&url, &["-o", "json", "job", "show", "1"], 0).await;

    // A pipeline run: submitted, shown, rerun, listed.
    let workflow = dir.path().join("hello.yaml");
    std::fs::write(&workflow, WORKFLOW).unwrap();
    cli(
        &url,
        &["submit", workflow.to_str().unwrap(), "-p", "who=you"],
        0,
    )
    .await;
    cli(&url, &["get", "1"], 0).await;
    cli(&url, &["-o", "json", "get", "1"], 0).await;
    cli(&url, &["rerun", "1"], 0).await;

    // What load balancers and Prometheus read, and a gateway's signal.
    let http = reqwest::Client::new();
    for path in [
        "/v1/services/default/endpoints",
        "/v1/services/default/http_sd",
        "/v1/services/nope/endpoints",
        "/v1/nodes/http_sd",
        "/v1/pipelines",
        "/v1/report?since=0",
        "/healthz",
        "/metrics",
    ] {
        http.get(format!("{url}{path}")).send().await.unwrap();
    }
    http.post(format!("{url}/v1/services/default/gateway"))
        .json(&serde_json::json!({"waiting": 3}))
        .send()
        .await
        .unwrap();

    let doc: Value = reqwest::get(format!("{}/v1/openapi.json", coordinator.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let log = log.lock().unwrap().clone();
    let mut problems = Vec::new();
    let mut checked = std::collections::BTreeSet::new();
    for x in &log {
        let found = check(&doc, x);
        if found.is_empty()
            && let Some((template, _)) = path_item(&doc, &x.path)
        {
            checked.insert(format!("{} {template} {}", x.method, x.status));
        }
        problems.extend(found);
    }
    assert!(
        problems.is_empty(),
        "{} of {} exchanges break the OpenAPI document:\n{}",
        problems.len(),
        log.len(),
        problems.join("\n")
    );
    // The CLI's and the agent's operations were all exercised, with their success replies.
    for op in [
        "post /v1/jobs 201",
        "post /v1/jobs 422",
        "get /v1/jobs 200",
        "get /v1/jobs/{id} 200",
        "get /v1/jobs/{id} 404",
        "get /v1/jobs/{id}/logs 503",
        "post /v1/jobs/{id}/cancel 200",
        "get /v1/nodes 200",
        "get /v1/report 200",
        "post /v1/pipelines 201",
        "get /v1/pipelines/{id} 200",
        "post /v1/pipelines/{id}/rerun 201",
        "post /v1/agents/register 200",
        "post /v1/agents/{node}/heartbeat 200",
        "get /v1/agents/{node}/desired 200",
        "get /v1/services/{name}/endpoints 200",
        "get /v1/services/{name}/endpoints 404",
        "post /v1/services/{name}/gateway 204",
    ] {
        assert!(
            checked.contains(op),
            "not exercised: {op}; exercised: {checked:#?}"
        );
    }
}
