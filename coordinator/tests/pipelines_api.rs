//! `/v1/pipelines` served in-process: a bad workflow or parameter is refused with the file's
//! line and queues nothing; a good one queues its first step as a job; a reopened store
//! rebuilds the run with the same jobs and submits nothing twice.

use std::net::SocketAddr;
use std::sync::Arc;

use nightshift_common::{JobList, PipelineRunView};
use nightshift_coordinator::cluster::Cluster;
use nightshift_coordinator::config::CoordinatorConfig;
use serde_json::{Value, json};

const DIAMOND: &str = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  name: d\nspec:\n  entrypoint: main\n  arguments:\n    parameters:\n    - {name: msg, value: hi}\n  templates:\n  - name: main\n    dag:\n      tasks:\n      - {name: A, template: echo}\n      - {name: B, template: echo, depends: A}\n  - name: echo\n    container:\n      image: busybox\n      args: [\"{{workflow.parameters.msg}}\"]\n";

struct Server {
    url: String,
    http: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

async fn start(cfg: &CoordinatorConfig) -> Server {
    let cluster: Arc<Cluster> = nightshift_coordinator::server::open(cfg).unwrap();
    let listener = tokio::net::TcpListener::bind(cfg.listen).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ =
            nightshift_coordinator::server::serve(listener, cluster, std::future::pending()).await;
    });
    Server {
        url,
        http: reqwest::Client::new(),
        task,
    }
}

impl Server {
    async fn submit(&self, text: &str, parameters: Value) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}/v1/pipelines", self.url))
            .json(&json!({"file": "wf.yaml", "text": text, "parameters": parameters}))
            .send()
            .await
            .unwrap();
        (
            resp.status().as_u16(),
            resp.json().await.unwrap_or(Value::Null),
        )
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        self.http
            .get(format!("{}{path}", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

#[tokio::test]
async fn bad_workflows_are_refused_with_their_line_and_queue_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = CoordinatorConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.path().to_owned(),
        ..CoordinatorConfig::default()
    };
    let s = start(&cfg).await;
    let cyclic = DIAMOND.replace(
        "{name: A, template: echo}",
        "{name: A, template: echo, depends: B}",
    );
    let (status, body) = s.submit(&cyclic, json!({})).await;
    assert_eq!(status, 422, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("wf.yaml:14: cycle: tasks of template main depend on each other"),
        "{error}"
    );
    let (status, body) = s.submit(DIAMOND, json!({"mgs": "x"})).await;
    assert_eq!(status, 422, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("parameter mgs is not a parameter"),
        "{body}"
    );
    let jobs: JobList = s.get("/v1/jobs").await;
    assert!(jobs.jobs.is_empty(), "nothing queued: {jobs:?}");
}

#[tokio::test]
async fn a_run_queues_its_first_step_and_survives_a_restart_without_resubmitting() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = CoordinatorConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.path().to_owned(),
        ..CoordinatorConfig::default()
    };
    let s = start(&cfg).await;
    let (status, body) = s.submit(DIAMOND, json!({"msg": "bye"})).await;
    assert_eq!(status, 201, "{body}");
    let run: PipelineRunView = serde_json::from_value(body).unwrap();
    assert_eq!(
        (run.phase.as_str(), run.parameters["msg"].as_str()),
        ("Running", "bye")
    );
    let jobs: JobList = s.get("/v1/jobs").await;
    assert_eq!(jobs.jobs.len(), 1, "only A can start: {jobs:?}");
    let a = &jobs.jobs[0];
    assert_eq!(
        (a.spec.name.as_str(), a.spec.args.as_slice(), a.spec.gpus),
        ("d.A", &["bye".to_owned()][..], 1)
    );
    assert!(a.spec.capture.stdout);
    s.task.abort();
    let _ = s.task.await;

    let s = start(&cfg).await;
    let again: PipelineRunView = s.get(&format!("/v1/pipelines/{}", run.id)).await;
    assert_eq!(again.nodes, run.nodes);
    let jobs: JobList = s.get("/v1/jobs").await;
    assert_eq!(
        jobs.jobs.len(),
        1,
        "the replay submits nothing again: {jobs:?}"
    );
    let list: nightshift_common::PipelineRunList = s.get("/v1/pipelines").await;
    assert_eq!(list.runs.len(), 1);

    // A rerun starts a new run from the same text and parameters: the same resolved step.
    let resp = s
        .http
        .post(format!("{}/v1/pipelines/{}/rerun", s.url, run.id))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 201);
    let rerun: PipelineRunView = resp.json().await.unwrap();
    assert_eq!((rerun.id, &rerun.parameters), (run.id + 1, &run.parameters));
    let jobs: JobList = s.get("/v1/jobs").await;
    assert_eq!(jobs.jobs.len(), 2);
    assert_eq!(jobs.jobs[1].spec, jobs.jobs[0].spec);
    let resp = s
        .http
        .post(format!("{}/v1/pipelines/99/rerun", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
}

#[tokio::test]
async fn each_step_is_admitted_by_the_job_policy() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = CoordinatorConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.path().join("refused"),
        ..CoordinatorConfig::default()
    };
    cfg.policy.allowed_images = vec!["registry.example/".into()];
    let s = start(&cfg).await;
    let (status, body) = s.submit(DIAMOND, json!({})).await;
    assert_eq!(status, 201, "{body}");
    let run: PipelineRunView = serde_json::from_value(body).unwrap();
    let jobs: JobList = s.get("/v1/jobs").await;
    assert!(jobs.jobs.is_empty(), "busybox is not allowed: {jobs:?}");
    let run: PipelineRunView = s.get(&format!("/v1/pipelines/{}", run.id)).await;
    assert_eq!(run.phase, "Failed", "{run:#?}");
    let a = run.nodes.iter().find(|n| n.name == "d.A").expect("step A");
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("policy.allowed_images: image busybox is not under")),
        "{a:#?}"
    );
    s.task.abort();

    // A step under the policy's run-time limit carries it, as a job submitted alone would.
    cfg.policy.allowed_images.clear();
    cfg.policy.max_run_seconds_per_job = 600;
    cfg.data_dir = dir.path().join("limited");
    let s = start(&cfg).await;
    let (status, body) = s.submit(DIAMOND, json!({})).await;
    assert_eq!(status, 201, "{body}");
    let jobs: JobList = s.get("/v1/jobs").await;
    assert_eq!(jobs.jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs.jobs[0].spec.max_run_seconds, Some(600));
}
