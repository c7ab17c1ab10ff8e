//! The CLI's pipeline commands: `nightshift submit WORKFLOW.yaml -p name=value` (checked
//! offline first: a workflow that does not lint costs no request) and `nightshift get RUN`,
//! a tree of the run's steps with their states, retries, attempts and durations.

use std::collections::BTreeMap;
use std::io::Write;

use nightshift_common::{PipelineNodeView, PipelineRunView, PipelineSubmit, UnixMillis};

use crate::client::Client;
use crate::error::CliError;
use crate::render::{clean, format_duration, print};

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
        let mut line = format!("{}{} {}", "  ".repeat(depth), clean(shown(n)), n.phase);
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
        if let Some(id) = &n.image_id {
            // Docker's short form: the first 12 hex digits.
            let hex = id.strip_prefix("sha256:").unwrap_or(id);
            line.push_str(&format!(" image {}", clean(&hex[..hex.len().min(12)])));
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

/// A step's name as `get` shows it: the last part of its full name (`main.B(1:bar)` → `B(1:bar)`).
fn shown(n: &PipelineNodeView) -> &str {
    n.name.rsplit('.').next().unwrap_or(&n.name)
}

/// The job of `step` in `run` (its full name or as `get` shows it): its newest, or with
/// `attempt` its Nth try. The error names what exists instead.
pub fn step_job(run: &PipelineRunView, step: &str, attempt: Option<u32>) -> Result<u64, String> {
    let mut found: Vec<&PipelineNodeView> = run.nodes.iter().filter(|n| n.name == step).collect();
    if found.is_empty() {
        found = run.nodes.iter().filter(|n| shown(n) == step).collect();
    }
    let leaves = |parent: Option<usize>| -> Vec<String> {
        let mut names: Vec<String> = run
            .nodes
            .iter()
            .filter(|n| !n.jobs.is_empty() || !run.nodes.iter().any(|c| c.parent == Some(n.id)))
            .filter(|n| parent.is_none_or(|p| is_under(run, n, p)))
            .map(|n| clean(shown(n)))
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        names.retain(|n| seen.insert(n.clone()));
        names
    };
    let n = match found.as_slice() {
        [] => {
            return Err(format!(
                "run {} ({}) has no step {}; its steps: {}",
                run.id,
                clean(&run.name),
                clean(step),
                leaves(None).join(", ")
            ));
        }
        [n] => *n,
        many => {
            let names: Vec<String> = many.iter().map(|n| clean(&n.name)).collect();
            return Err(format!(
                "step {} of run {} is ambiguous; name one of: {}",
                clean(step),
                run.id,
                names.join(", ")
            ));
        }
    };
    if n.jobs.is_empty() {
        let inner = leaves(Some(n.id));
        return Err(if inner.is_empty() {
            format!(
                "step {} of run {} is {} and has run no job",
                clean(step),
                run.id,
                n.phase
            )
        } else {
            format!(
                "step {} of run {} runs no container itself; its steps: {}",
                clean(step),
                run.id,
                inner.join(", ")
            )
        });
    }
    match attempt {
        None => Ok(*n.jobs.last().expect("not empty")),
        Some(a) => a
            .checked_sub(1)
            .and_then(|i| n.jobs.get(i as usize))
            .copied()
            .ok_or_else(|| {
                format!(
                    "step {} of run {} has {} {} (jobs {}); --attempt takes 1 to {}",
                    clean(step),
                    run.id,
                    n.jobs.len(),
                    if n.jobs.len() == 1 { "try" } else { "tries" },
                    n.jobs
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    n.jobs.len()
                )
            }),
    }
}

/// Whether `n` sits below the node `ancestor`.
fn is_under(run: &PipelineRunView, n: &PipelineNodeView, ancestor: usize) -> bool {
    let mut parent = n.parent;
    while let Some(p) = parent {
        if p == ancestor {
            return true;
        }
        parent = run.nodes.iter().find(|x| x.id == p).and_then(|x| x.parent);
    }
    false
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
            image_id: None,
        }
    }

    #[test]
    fn a_run_renders_as_an_indented_tree() {
        let mut b = node(2, Some(0), "d.B", "Failed");
        b.jobs = vec![7, 9];
        b.retries = 1;
        b.preemptions = 1;
        b.message = Some("exited with code 1".into());
        b.image_id =
            Some("sha256:caeab3c512c3058cbb2c990113869991a7229395a4ff3cebdec5f3ca4e2146a3".into());
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
             \x20 B Failed 3s job 7,9 retries 1 preempted 1 image caeab3c512c3: exited with code 1\n"
        );
        assert!(is_workflow(
            "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\n"
        ));
        assert!(!is_workflow("name: a\nimage: b\ngpus: 1\n"));
    }

    #[test]
    fn logs_find_a_step_by_its_name_and_try() {
        let mut a = node(1, Some(0), "d.A", "Succeeded");
        a.jobs = vec![4];
        let mut b = node(2, Some(0), "d.B", "Failed");
        b.jobs = vec![7, 9];
        let mut inner = node(3, Some(0), "d.C", "Running");
        inner.jobs = vec![];
        let mut c1 = node(4, Some(3), "d.C.A", "Pending");
        c1.jobs = vec![];
        let loop_child = node(5, Some(0), "d.print(0:x)", "Skipped");
        let run = PipelineRunView {
            id: 3,
            name: "d".into(),
            file: "d.yaml".into(),
            phase: "Running".into(),
            parameters: BTreeMap::new(),
            started_at: 0,
            finished_at: None,
            nodes: vec![node(0, None, "d", "Running"), a, b, inner, c1, loop_child],
        };
        assert_eq!(step_job(&run, "B", None), Ok(9));
        assert_eq!(step_job(&run, "d.B", Some(1)), Ok(7));
        assert_eq!(step_job(&run, "d.A", None), Ok(4));
        assert_eq!(
            step_job(&run, "B", Some(3)).unwrap_err(),
            "step B of run 3 has 2 tries (jobs 7, 9); --attempt takes 1 to 2"
        );
        assert_eq!(
            step_job(&run, "Z", None).unwrap_err(),
            "run 3 (d) has no step Z; its steps: A, B, print(0:x)"
        );
        assert_eq!(
            step_job(&run, "A", None).unwrap_err(),
            "step A of run 3 is ambiguous; name one of: d.A, d.C.A"
        );
        assert_eq!(
            step_job(&run, "C", None).unwrap_err(),
            "step C of run 3 runs no container itself; its steps: A"
        );
        assert_eq!(
            step_job(&run, "d.C.A", None).unwrap_err(),
            "step d.C.A of run 3 is Pending and has run no job"
        );
    }
}
