//! Images that differ only by a mark, and the one-step workflow that prints it: how the tests
//! show which image a pipeline step really ran (after its tag moved, or was pulled again).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nightshift_cli::client::Client;
use nightshift_common::{PipelineRunView, PipelineSubmit};

use crate::wait_for;

/// How long a pipeline run may take to finish.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// One step, `mark`, printing the `PIN_MARK` its image sets, kept as its output parameter.
pub fn workflow(image: &str) -> String {
    format!(
        r#"apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: marked-
spec:
  entrypoint: main
  templates:
  - name: main
    steps:
    - - name: mark
        template: print-mark
  - name: print-mark
    container:
      image: {image}
      command: [sh, -c]
      args: ["echo $PIN_MARK | tee /tmp/mark"]
    outputs:
      parameters:
      - name: mark
        valueFrom:
          path: /tmp/mark
"#
    )
}

/// `docker`, with the client configuration in `config` when given (registry credentials kept
/// out of `~/.docker`).
pub fn docker(config: Option<&Path>) -> Command {
    let mut cmd = Command::new("docker");
    if let Some(config) = config {
        cmd.arg("--config").arg(config);
    }
    cmd
}

/// Builds `tag` as busybox with `PIN_MARK=mark` and returns its image ID.
pub fn build(config: Option<&Path>, tag: &str, mark: &str) -> String {
    let mut build = docker(config)
        .args(["build", "-q", "-t", tag, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("docker build");
    build
        .stdin
        .take()
        .unwrap()
        .write_all(format!("FROM busybox:latest\nENV PIN_MARK={mark}\n").as_bytes())
        .unwrap();
    let out = build.wait_with_output().unwrap();
    assert!(out.status.success(), "docker build {tag}");
    image_id(config, tag)
}

/// The ID of the image `reference` names.
pub fn image_id(config: Option<&Path>, reference: &str) -> String {
    let out = docker(config)
        .args(["image", "inspect", "--format", "{{.Id}}", reference])
        .output()
        .unwrap();
    assert!(out.status.success(), "docker image inspect {reference}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Submits the workflow `text` and returns the run as it starts.
pub async fn submit(client: &Client, text: &str) -> PipelineRunView {
    client
        .submit_pipeline(&PipelineSubmit {
            file: "test.yaml".into(),
            text: text.to_owned(),
            parameters: BTreeMap::new(),
        })
        .await
        .expect("submit")
}

/// Run `id` once it has finished.
pub async fn finished(client: &Client, id: u64) -> PipelineRunView {
    wait_for(&format!("run {id} to finish"), RUN_TIMEOUT, || async {
        let v = client.pipeline(id).await.ok()?;
        (v.phase != "Running").then_some(v)
    })
    .await
}
