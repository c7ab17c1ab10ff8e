//! `nightshift lint FILE`: checks an Argo Workflows file offline and prints each finding as
//! `FILE:LINE: RULE: MESSAGE` (or a [`LintReport`] with `--output json`). Exit 0 when the
//! workflow can run, 2 when it cannot.

use std::io::{Read, Write};
use std::path::Path;

use nightshift_common::{LintFinding, LintReport};

use crate::cli::read_text;
use crate::error::CliError;

/// Reads `path` (`-` is standard input), checks it and prints the verdict.
pub fn run(
    path: &Path,
    stdin: &mut (dyn Read + Send),
    out: &mut (dyn Write + Send),
    json: bool,
) -> Result<i32, CliError> {
    let (shown, text) = read_text(path, stdin, |path, source| CliError::ReadWorkflowFile {
        path,
        source,
    })?;
    let report = report(&shown, &text);
    if json {
        let body = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
        writeln!(out, "{body}")?;
    } else {
        out.write_all(render(&report).as_bytes())?;
    }
    out.flush()?;
    Ok(if report.ok { 0 } else { 2 })
}

/// The verdict on `text`, the content of `file`.
pub fn report(file: &str, text: &str) -> LintReport {
    match nightshift_pipeline::load(text) {
        Ok(wf) => LintReport {
            file: file.to_owned(),
            ok: true,
            workflow: Some(wf.name),
            findings: Vec::new(),
        },
        Err(diags) => LintReport {
            file: file.to_owned(),
            ok: false,
            workflow: None,
            findings: diags.0.iter().map(LintFinding::from).collect(),
        },
    }
}

/// One line per finding, the form compilers use, or a one-line verdict when it is clean.
pub fn render(report: &LintReport) -> String {
    if report.ok {
        return format!(
            "{}: ok, workflow {} can run\n",
            report.file,
            report.workflow.as_deref().unwrap_or("-")
        );
    }
    report
        .findings
        .iter()
        .map(|f| format!("{}:{}: {}: {}\n", report.file, f.line, f.rule, f.message))
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::cli::run;

    const GOOD: &str = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  name: hi\nspec:\n  entrypoint: main\n  templates:\n  - name: main\n    container:\n      image: busybox\n      args: [\"{{workflow.parameters.msg}}\"]\n";

    /// Runs the CLI against a coordinator that cannot be reached: lint must not need one.
    async fn cli(args: &[&str], stdin: &str) -> (i32, String, String) {
        let mut input = stdin.as_bytes();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let args = ["nightshift", "--coordinator", "http://127.0.0.1:9"]
            .into_iter()
            .chain(args.iter().copied());
        let code = run(args, &mut input, &mut out, &mut err).await;
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[tokio::test]
    async fn a_bad_workflow_exits_2_naming_file_line_and_rule() {
        let (code, out, _) = cli(&["lint", "-"], GOOD).await;
        assert_eq!(code, 2);
        assert_eq!(
            out,
            "<stdin>:11: undefined-reference: {{workflow.parameters.msg}}: the workflow has no \
             parameter msg in spec.arguments.parameters\n"
        );
        let (code, out, _) = cli(&["lint", "-o", "json", "-"], GOOD).await;
        assert_eq!(code, 2);
        let report: nightshift_common::LintReport = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (
                report.ok,
                report.findings[0].line,
                report.findings[0].rule.as_str()
            ),
            (false, 11, "undefined-reference")
        );
    }

    #[tokio::test]
    async fn a_good_workflow_exits_0() {
        let good = GOOD.replace("{{workflow.parameters.msg}}", "hello");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wf.yaml");
        std::fs::write(&path, good).unwrap();
        let path = path.to_str().unwrap();
        let (code, out, err) = cli(&["lint", path], "").await;
        assert_eq!((code, err.as_str()), (0, ""));
        assert_eq!(out, format!("{path}: ok, workflow hi can run\n"));
        let (code, out, _) = cli(&["lint", path, "--output", "json"], "").await;
        assert_eq!(code, 0);
        let report: nightshift_common::LintReport = serde_json::from_str(&out).unwrap();
        assert!(report.ok && report.findings.is_empty());
        assert_eq!(report.workflow.as_deref(), Some("hi"));
    }

    #[tokio::test]
    async fn a_missing_file_is_bad_input() {
        let (code, _, err) = cli(&["lint", "/nonexistent/wf.yaml"], "").await;
        assert_eq!(code, 2);
        assert!(
            err.starts_with("error: cannot read workflow file /nonexistent/wf.yaml: "),
            "{err}"
        );
    }
}
