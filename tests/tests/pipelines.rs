//! Argo's example workflows, unmodified, run end to end: a coordinator and an agent (fake
//! GPUs, the real Docker engine), every step a job in a container of the local images
//! (`tests/images/argo-examples.sh`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use nightshift_cli::client::Client;
use nightshift_common::{PipelineRunView, PipelineSubmit};
use nightshift_tests::*;

fn conformance_dir() -> PathBuf {
    std::env::var_os("NIGHTSHIFT_CONFORMANCE_DIR").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .map(|a| a.join("shared/conformance/argo-workflows"))
                .find(|p| p.is_dir())
                .expect("shared/conformance/argo-workflows above the tests crate")
        },
        PathBuf::from,
    )
}

async fn submit(client: &Client, file: &str) -> PipelineRunView {
    let text = std::fs::read_to_string(conformance_dir().join(file)).unwrap();
    client
        .submit_pipeline(&PipelineSubmit {
            file: file.to_owned(),
            text,
            parameters: BTreeMap::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The manifests run here and how each must end (the ones that fail on purpose fail).
const RUNS: &[(&str, &str)] = &[
    ("hello-world.yaml", "Succeeded"),
    ("arguments-parameters.yaml", "Succeeded"),
    ("global-parameters.yaml", "Succeeded"),
    ("steps.yaml", "Succeeded"),
    ("loops.yaml", "Succeeded"),
    ("loops-dag.yaml", "Succeeded"),
    ("dag-diamond.yaml", "Succeeded"),
    ("dag-diamond-dependencies.yaml", "Succeeded"),
    ("dag-multiroot.yaml", "Succeeded"),
    ("dag-nested.yaml", "Succeeded"),
    ("dag-diamond-steps.yaml", "Succeeded"),
    ("dag-enhanced-depends.yaml", "Succeeded"),
    ("continue-on-fail.yaml", "Succeeded"),
    ("output-parameter.yaml", "Succeeded"),
    ("parameter-aggregation-dag.yaml", "Succeeded"),
    ("exit-handler-dag-level.yaml", "Succeeded"),
    ("artifact-passing.yaml", "Succeeded"),
    ("nested-workflow.yaml", "Succeeded"),
    ("exit-handlers.yaml", "Failed"),
    ("dag-task-level-timeout.yaml", "Failed"),
    ("timeouts-step.yaml", "Failed"),
];

/// The node of `view` whose name ends with `suffix`.
fn node<'a>(view: &'a PipelineRunView, suffix: &str) -> &'a nightshift_common::PipelineNodeView {
    view.nodes
        .iter()
        .find(|n| n.name.ends_with(suffix))
        .unwrap_or_else(|| panic!("no node *{suffix} in {:#?}", view.nodes))
}

/// What must hold inside some runs besides their end.
fn check_steps(file: &str, view: &PipelineRunView) {
    let phase = |suffix: &str| node(view, suffix).phase.clone();
    match file {
        "output-parameter.yaml" => {
            let generated = &node(view, ".generate-parameter").outputs;
            assert_eq!(
                generated.get("hello-param").map(String::as_str),
                Some("hello world")
            );
        }
        "parameter-aggregation-dag.yaml" => {
            let evenness: Vec<&str> = view
                .nodes
                .iter()
                .filter(|n| n.name.contains(".odd-or-even("))
                .filter_map(|n| n.outputs.get("evenness").map(String::as_str))
                .collect();
            assert_eq!(evenness, ["odd", "even", "odd", "even"]);
            let skipped = view.nodes.iter().filter(|n| n.phase == "Skipped").count();
            assert_eq!(skipped, 2, "odd numbers are not divided");
            let printed = view
                .nodes
                .iter()
                .filter(|n| n.name.contains(".print("))
                .count();
            assert_eq!(printed, 2, "the two halves are printed");
        }
        "dag-enhanced-depends.yaml" => {
            assert_eq!(phase(".C"), "Failed");
            assert_eq!(phase(".should-not-execute"), "Omitted");
            assert_eq!(phase(".should-execute-3"), "Succeeded");
        }
        "artifact-passing.yaml" => {
            assert_eq!(phase(".consume-artifact"), "Succeeded");
        }
        "nested-workflow.yaml" => {
            let nested = &node(view, ".nested-wf").outputs;
            assert_eq!(
                nested.get("nested-out-parameter").map(String::as_str),
                Some("my-output-parameter")
            );
        }
        "continue-on-fail.yaml" => {
            assert_eq!(phase(".C"), "Failed");
            assert_eq!(phase(".D"), "Succeeded");
        }
        "exit-handlers.yaml" => {
            assert_eq!(phase(".onExit.cry"), "Succeeded");
            assert_eq!(phase(".onExit.celebrate"), "Skipped");
        }
        "dag-task-level-timeout.yaml" => {
            // B (10s for a 15s sleep) times out; under load A (20s, queueing included, as
            // in Argo) may time out first, which ends the DAG before B starts.
            let timed_out = view.nodes.iter().find(|n| {
                n.message
                    .as_deref()
                    .is_some_and(|m| m.contains("timed out after"))
            });
            assert!(timed_out.is_some(), "{:#?}", view.nodes);
        }
        "timeouts-step.yaml" => {
            let m = view.nodes[0].message.clone().unwrap_or_default();
            assert!(m.contains("activeDeadlineSeconds"), "{m}");
        }
        _ => {}
    }
    // Every finished container step ran as exactly one job per attempt, and one that
    // succeeded has the image it ran recorded, by ID.
    for n in view.nodes.iter().filter(|n| !n.jobs.is_empty()) {
        assert_eq!(n.jobs.len() as u32, n.retries + 1, "{file}: {n:?}");
        if n.phase == "Succeeded" {
            let id = n.image_id.as_deref().unwrap_or_default();
            assert!(id.starts_with("sha256:"), "{file}: {n:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn argo_examples_run_unmodified_to_their_expected_end() {
    init_tracing();
    require_images();
    let one = OneNode::start("argo", 4).await;
    let client = &one.client;
    let started = std::time::Instant::now();
    let mut runs = Vec::new();
    for (file, expected) in RUNS {
        runs.push((submit(client, file).await.id, *file, *expected));
    }
    let mut report = Vec::new();
    for (id, file, expected) in &runs {
        let view = wait_for(
            &format!("{file} to finish"),
            Duration::from_secs(600),
            || async {
                let v = client.pipeline(*id).await.ok()?;
                (v.phase != "Running").then_some(v)
            },
        )
        .await;
        report.push((file, view.phase.clone(), expected));
        check_steps(file, &view);
        assert_eq!(
            view.phase,
            *expected,
            "{file}:\n{}",
            nightshift_cli::workflows::render_run(&view, 0)
        );
    }
    eprintln!(
        "{} runs finished in {:?}: {report:?}",
        runs.len(),
        started.elapsed()
    );
}
