//! What a pipeline run leaves behind on real Docker: the image each step ran, by ID, so that
//! `nightshift rerun` runs the very same image after its tag moved; and each step's output
//! through `nightshift logs RUN STEP`.

use std::process::{Command, Stdio};
use std::time::Duration;

use nightshift_common::PipelineRunView;
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(120);

/// A step that fails on its first try and talks, then waits, on its second.
const TALKER: &str = r#"apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: talker-
spec:
  entrypoint: main
  templates:
  - name: main
    steps:
    - - name: talk
        template: talker
  - name: talker
    retryStrategy:
      limit: 1
    container:
      image: busybox
      command: [sh, -c]
      args: ["echo try-{{retries}}; if [ {{retries}} = 0 ]; then exit 3; fi; sleep 300"]
"#;

/// Removes the images this test built, by ID (the first one has lost its tag by then).
struct RemoveImages(Vec<String>);

impl Drop for RemoveImages {
    fn drop(&mut self) {
        for id in &self.0 {
            let _ = Command::new("docker")
                .args(["image", "rm", "-f", id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_runs_the_recorded_image_after_the_tag_moved() {
    init_tracing();
    require_images();
    let node = unique_node("pin");
    // Dropped last: the containers go first, then their images.
    let mut built = RemoveImages(Vec::new());
    let _cleanup = Cleanup(node.clone());
    let tag = format!("nightshift-test/{node}:latest");
    let first = marked::build(None, &tag, "first");
    built.0.push(first.clone());
    let dir = tempfile::tempdir().unwrap();
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let (_agent, _) = start_agent(
        agent_config(&coordinator.url, &node, &dir.path().join("work"), 2),
        2,
    )
    .await;
    let text = marked::workflow(&tag);
    let step = |v: &PipelineRunView| {
        v.nodes
            .iter()
            .find(|n| n.name.ends_with(".mark"))
            .cloned()
            .unwrap_or_else(|| panic!("no step mark in {:#?}", v.nodes))
    };

    let original = marked::finished(&client, marked::submit(&client, &text).await.id).await;
    assert_eq!(original.phase, "Succeeded", "{original:#?}");
    let ran = step(&original);
    assert_eq!(ran.outputs.get("mark").map(String::as_str), Some("first"));
    assert_eq!(ran.image_id.as_deref(), Some(first.as_str()));
    let (code, tree, err) = nightshift(&coordinator.url, &["get", &original.id.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    let short = &first["sha256:".len().."sha256:".len() + 12];
    assert!(tree.contains("mark Succeeded"), "{tree}");
    assert!(tree.contains(&format!("image {short}")), "{tree}");

    // The tag moves to another image.
    let second = marked::build(None, &tag, "second");
    built.0.push(second.clone());
    assert_ne!(first, second);

    let rerun = client.rerun_pipeline(original.id).await.unwrap();
    let rerun = marked::finished(&client, rerun.id).await;
    assert_eq!(rerun.phase, "Succeeded", "{rerun:#?}");
    let again = step(&rerun);
    assert_eq!(again.outputs.get("mark").map(String::as_str), Some("first"));
    assert_eq!(again.image_id.as_deref(), Some(first.as_str()));
    let job = client.job(again.jobs[0]).await.unwrap();
    assert_eq!(
        job.spec.image, first,
        "the step's job names the image by ID"
    );

    // A rerun of the rerun still runs the first image; a new submission runs the tag's.
    let twice = client.rerun_pipeline(rerun.id).await.unwrap();
    let twice = marked::finished(&client, twice.id).await;
    assert_eq!(
        step(&twice).outputs.get("mark").map(String::as_str),
        Some("first")
    );
    let fresh = marked::finished(&client, marked::submit(&client, &text).await.id).await;
    let fresh = step(&fresh);
    assert_eq!(
        fresh.outputs.get("mark").map(String::as_str),
        Some("second")
    );
    assert_eq!(fresh.image_id.as_deref(), Some(second.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_of_a_step_by_name_and_try() {
    init_tracing();
    require_images();
    let one = OneNode::start("steplogs", 2).await;
    let (client, coordinator) = (&one.client, &one.coordinator);
    let run = marked::submit(client, TALKER).await.id;
    let id = run.to_string();
    // The second try runs (and waits) once the first failed.
    let jobs = wait_for("the second try to run", STARTUP, || async {
        let v = client.pipeline(run).await.ok()?;
        let talk = v.nodes.iter().find(|n| n.name.ends_with(".talk"))?;
        (talk.jobs.len() == 2 && talk.phase == "Running").then(|| talk.jobs.clone())
    })
    .await;
    let said = wait_for("the second try to talk", STARTUP, || async {
        let (code, out, _) = nightshift(&coordinator.url, &["logs", &id, "talk"]).await;
        (code == 0 && !out.is_empty()).then_some(out)
    })
    .await;
    assert_eq!(said, "try-1\n");
    let (code, out, err) = nightshift(
        &coordinator.url,
        &["logs", &id, "talk", "--attempt", "2", "--tail", "1"],
    )
    .await;
    assert_eq!((code, out.as_str()), (0, "try-1\n"), "{err}");

    // The first try failed and its lease ended: its output comes from the node it ran on
    // (from the container, or once that is removed, from the agent's kept copy).
    let (code, first, err) =
        nightshift(&coordinator.url, &["logs", &id, "talk", "--attempt", "1"]).await;
    assert_eq!(
        (code, first.as_str()),
        (0, "try-0\n"),
        "job {}: {err}",
        jobs[0]
    );

    let (code, _, err) =
        nightshift(&coordinator.url, &["logs", &id, "talk", "--attempt", "3"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("has 2 tries"), "{err}");
    let (code, _, err) = nightshift(&coordinator.url, &["logs", &id, "shout"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("has no step shout; its steps: talk"), "{err}");
    let (code, _, err) = nightshift(&coordinator.url, &["logs", "999", "talk"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("pipeline run 999 not found"), "{err}");
}
