//! Pipelines (Argo Workflows files): what `nightshift lint` and a refused submission report.

use serde::{Deserialize, Serialize};

/// The verdict on one workflow file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LintReport {
    pub file: String,
    /// True when the workflow can run: no findings.
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
    pub findings: Vec<LintFinding>,
}

/// One rule a workflow file breaks, at a line (1-based).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LintFinding {
    pub line: usize,
    /// A stable kebab-case name: `unsupported-feature`, `cycle`, `undefined-reference`...
    pub rule: String,
    pub message: String,
}
