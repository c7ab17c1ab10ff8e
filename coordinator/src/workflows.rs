//! The CLI's pipeline commands: `nightshift submit WORKFLOW.yaml -p name=value` (checked
//! offline first: a workflow that does not lint costs no request) and `nightshift get RUN`,
//! a tree of the run's steps with their states, retries, attempts and durations.

use std::collections::BTreeMap;
use std::io::Write;

use nightshift_common::{PipelineNodeView, PipelineRunView, PipelineSubmit, UnixMillis};

use crate::cli::{CliError, clean, format_duration, print};
use crate::client::Client;

/// Whether `text` is an Argo Workflows file rather than a job file.
pub fn is_workflow(text: &str) -> bool {
    text.lines()
        .any(|l| l.trim_start().starts_with("apiVersion:") && l.contains("argoproj.io/"))
}

/// Lints, then starts a run. Exit 2 (and no request) when the workflow cannot run.
pub async fn submit(
    client: &Client,
    file: &str,
    text: &str,
    parameters: &[String],
    out: &mut (dyn Write + Send),
    json: bool,
) -> Result<i32, CliError> {
    let mut overrides = BTreeMap::new();
    for p in parameters {
        let Some((k, v)) = p.split_once('=') else {
            return Err(CliError::Parameter(p.clone()));
        };
        overrides.insert(k.trim().to_owned(), v.to_owned());
    }
    let report = crate::lint::report(file, text);
    if !report.ok {
        if json {
            print(out, true, &report, String::new)?;
        } else {
            out.write_all(crate::lint::render(&report).as_bytes())?;
        }
        return Ok(2);
    }
    let req = PipelineSubmit {
        file: file.to_owned(),
        text: text.to_owned(),
        parameters: overrides,
    };
    let view = client.submit_pipeline(&req).await?;
    print(out, json, &view, || {
        format!(
            "submitted pipeline run {} ({}), now {}\n",
            view.id,
            clean(&view.name),
            view.phase
        )
    })?;
    Ok(0)
}

/// `get RUN`: the run's header, then one line per step, indented under its parent.
pub fn render_run(run: &PipelineRunView, now: UnixMillis) -> String {
    let took = run
        .finished_at
        .unwrap_or(now)
        .saturating_sub(run.started_at);
    let mut text = format!(
        "run {} ({}) {} after {}\n",
        run.id,
        clean(&run.name),
        run.phase,
        format_duration(took)
    );
    let children = |parent: Option<usize>| -> Vec<&PipelineNodeView> {
        run.nodes.iter().filter(|n| n.parent == parent).collect()
    };
    let mut stack: Vec<(&PipelineNodeView, usize)> =
        children(None).into_iter().rev().map(|n| (n, 0)).collect();
    while let Some((n, depth)) = stack.pop() {
        let name = n.name.rsplit('.').next().unwrap_or(&n.name);
        let mut line = format!("{}{} {}", "  ".repeat(depth), clean(name), n.phase);
        if let Some(started) = n.started_at {
            let d = n.finished_at.unwrap_or(now).saturating_sub(started);
            line.push_str(&format!(" {}", format_duration(d)));
        }
        if !n.jobs.is_empty() {
            let jobs: Vec<String> = n.jobs.iter().map(u64::to_string).collect();
            line.push_str(&format!(" job {}", jobs.join(",")));
        }
        if n.retries > 0 {
            line.push_str(&format!(" retries {}", n.retries));
        }
        if n.preemptions > 0 {
            line.push_str(&format!(" preempted {}", n.preemptions));
        }
        if let Some(m) = &n.message {
            line.push_str(&format!(": {}", clean(m)));
        }
        text.push_str(&line);
        text.push('\n');
        for c in children(Some(n.id)).into_iter().rev() {
            stack.push((c, depth + 1));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: usize, parent: Option<usize>, name: &str, phase: &str) -> PipelineNodeView {
        PipelineNodeView {
            id,
            parent,
            name: name.into(),
            template: "t".into(),
            phase: phase.into(),
            message: None,
            retries: 0,
            jobs: vec![],
            attempt: None,
            preemptions: 0,
            started_at: Some(1_000),
            finished_at: Some(4_000),
            outputs: BTreeMap::new(),
        }
    }

    #[test]
    fn a_run_renders_as_an_indented_tree() {
        let mut b = node(2, Some(0), "d.B", "Failed");
        b.jobs = vec![7, 9];
        b.retries = 1;
        b.preemptions = 1;
        b.message = Some("exited with code 1".into());
        let run = PipelineRunView {
            id: 3,
            name: "d".into(),
            file: "d.yaml".into(),
            phase: "Failed".into(),
            parameters: BTreeMap::new(),
            started_at: 0,
            finished_at: Some(65_000),
            nodes: vec![
                node(0, None, "d", "Failed"),
                node(1, Some(0), "d.A", "Succeeded"),
                b,
            ],
        };
        assert_eq!(
            render_run(&run, 99_000),
            "run 3 (d) Failed after 65s\n\
             d Failed 3s\n\
             \x20 A Succeeded 3s\n\
             \x20 B Failed 3s job 7,9 retries 1 preempted 1: exited with code 1\n"
        );
        assert!(is_workflow(
            "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\n"
        ));
        assert!(!is_workflow("name: a\nimage: b\ngpus: 1\n"));
    }
}
