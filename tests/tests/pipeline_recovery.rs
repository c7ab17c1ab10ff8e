//! Pipelines survive what jobs survive: a preempted step resumes without touching its retry
//! budget, and a coordinator killed mid-DAG finishes the run after a restart with no step run
//! twice. Real Docker, the coordinator as a process.

use std::collections::BTreeMap;
use std::time::Duration;

use nightshift_cli::client::Client;
use nightshift_common::{JobState, PipelineRunView, PipelineSubmit};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(60);

/// A diamond whose steps take a few seconds, so that a kill lands in the middle.
const SLOW_DIAMOND: &str = r#"apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: slow-diamond-
spec:
  entrypoint: diamond
  templates:
  - name: diamond
    dag:
      tasks:
      - {name: A, template: nap, arguments: {parameters: [{name: s, value: "1"}]}}
      - {name: B, template: nap, depends: A, arguments: {parameters: [{name: s, value: "4"}]}}
      - {name: C, template: nap, depends: A, arguments: {parameters: [{name: s, value: "4"}]}}
      - {name: D, template: nap, depends: B && C, arguments: {parameters: [{name: s, value: "1"}]}}
  - name: nap
    inputs:
      parameters:
      - name: s
    container:
      image: busybox
      command: [sh, -c]
      args: ["sleep {{inputs.parameters.s}}; echo slept {{inputs.parameters.s}}"]
"#;

/// One long step with a retry budget: a preemption must not spend it.
const LONG_STEP: &str = r#"apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  name: long-step
  annotations:
    nightshift.io/grace-period-seconds: "2"
spec:
  entrypoint: work
  templates:
  - name: work
    retryStrategy:
      limit: 1
    container:
      image: busybox
      command: [sh, -c]
      args: ["echo attempt $NIGHTSHIFT_ATTEMPT; sleep 6; echo done"]
"#;

async fn submit(client: &Client, file: &str, text: &str) -> PipelineRunView {
    client
        .submit_pipeline(&PipelineSubmit {
            file: file.to_owned(),
            text: text.to_owned(),
            parameters: BTreeMap::new(),
        })
        .await
        .unwrap()
}

async fn phase_of(client: &Client, run: u64, suffix: &str) -> Option<String> {
    let view = client.pipeline(run).await.ok()?;
    view.nodes
        .into_iter()
        .find(|n| n.name.ends_with(suffix))
        .map(|n| n.phase)
}

async fn finished(client: &Client, run: u64) -> PipelineRunView {
    wait_for("the run to finish", Duration::from_secs(180), || async {
        let v = client.pipeline(run).await.ok()?;
        (v.phase != "Running").then_some(v)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_mid_dag_finishes_the_run_with_no_step_run_twice() {
    init_tracing();
    require_images();
    let node = unique_node("pipekill");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let (coordinator, client) = CoordinatorProcess::start_in(dir.path()).await;
    let url = coordinator.url.clone();
    let (agent, _) = start_agent(agent_config(&url, &node, &dir.path().join("work"), 4), 4).await;
    let run = submit(&client, "slow-diamond.yaml", SLOW_DIAMOND).await.id;
    wait_for("B to run", STARTUP, || async {
        (phase_of(&client, run, ".B").await.as_deref() == Some("Running")).then_some(())
    })
    .await;
    let before = client.pipeline(run).await.unwrap();

    let _coordinator = coordinator.crash_and_restart().await;
    let after = client.pipeline(run).await.unwrap();
    assert_eq!(
        before
            .nodes
            .iter()
            .map(|n| (&n.name, &n.jobs))
            .collect::<Vec<_>>(),
        after
            .nodes
            .iter()
            .map(|n| (&n.name, &n.jobs))
            .collect::<Vec<_>>(),
        "the restarted coordinator knows the same steps and jobs"
    );

    let view = finished(&client, run).await;
    assert_eq!(
        view.phase,
        "Succeeded",
        "{}",
        nightshift_cli::workflows::render_run(&view, 0)
    );
    // Every step ran as exactly one job, which succeeded once; no other job exists.
    let steps: Vec<_> = view.nodes.iter().filter(|n| !n.jobs.is_empty()).collect();
    assert_eq!(steps.len(), 4);
    let jobs = client.jobs().await.unwrap().jobs;
    assert_eq!(jobs.len(), 4, "{jobs:?}");
    for step in steps {
        assert_eq!(step.jobs.len(), 1, "{step:?}");
        let job = client.job(step.jobs[0]).await.unwrap();
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    }
    let d = view.nodes.iter().find(|n| n.name.ends_with(".D")).unwrap();
    assert_eq!(d.phase, "Succeeded");
    agent.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_step_resumes_without_using_its_retries() {
    init_tracing();
    require_images();
    let one = OneNode::start("pipepreempt", 4).await;
    let (client, coordinator) = (&one.client, &one.coordinator);
    let run = submit(client, "long-step.yaml", LONG_STEP).await.id;
    wait_for("the step to run", STARTUP, || async {
        (phase_of(client, run, "long-step").await.as_deref() == Some("Running")
            && client.jobs().await.ok()?.jobs.first()?.state == JobState::Running)
            .then_some(())
    })
    .await;
    // Traffic returns: a gateway holds requests, so the node is taken back to serve.
    let http = reqwest::Client::new();
    let job = client.jobs().await.unwrap().jobs[0].id;
    wait_for("the step to be preempted", STARTUP, || async {
        let _ = http
            .post(format!("{}/v1/services/default/gateway", coordinator.url))
            .json(&serde_json::json!({"waiting": 5}))
            .send()
            .await;
        let j = client.job(job).await.ok()?;
        (j.preemptions >= 1).then_some(())
    })
    .await;
    assert_eq!(
        phase_of(client, run, "long-step").await.as_deref(),
        Some("Running"),
        "a preemption is not a failure"
    );

    let view = finished(client, run).await;
    assert_eq!(
        view.phase,
        "Succeeded",
        "{}",
        nightshift_cli::workflows::render_run(&view, 0)
    );
    let step = &view.nodes[0];
    assert_eq!(step.retries, 0, "the retry budget is untouched: {step:?}");
    assert_eq!(step.jobs, [job], "the same job, resumed: {step:?}");
    assert!(step.preemptions >= 1 && step.attempt >= Some(2), "{step:?}");
    let j = client.job(job).await.unwrap();
    assert_eq!(j.state, JobState::Succeeded);
}
