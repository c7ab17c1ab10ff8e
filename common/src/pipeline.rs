//! Pipelines (Argo Workflows files): what `nightshift lint` and a refused submission report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::UnixMillis;

/// The verdict on one workflow file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LintFinding {
    pub line: usize,
    /// A stable kebab-case name: `unsupported-feature`, `cycle`, `undefined-reference`...
    pub rule: String,
    pub message: String,
}

/// `POST /v1/pipelines`: a workflow file's text and parameter overrides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PipelineSubmit {
    /// The file's name, for messages.
    pub file: String,
    pub text: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
}

/// A pipeline run: its steps as a tree (each node names its parent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PipelineRunView {
    pub id: u64,
    pub name: String,
    pub file: String,
    /// Argo's words: `Running`, `Succeeded`, `Failed`, `Error`.
    pub phase: String,
    pub parameters: BTreeMap<String, String>,
    pub started_at: UnixMillis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<UnixMillis>,
    pub nodes: Vec<PipelineNodeView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PipelineNodeView {
    pub id: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<usize>,
    pub name: String,
    pub template: String,
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Error`, `Skipped`, `Omitted`.
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Retries used (a preemption is not a retry).
    pub retries: u32,
    /// The job of each attempt, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<u64>,
    /// Of the newest job: its attempt (raised by each preemption) and preemptions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(default)]
    pub preemptions: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<UnixMillis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<UnixMillis>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outputs: BTreeMap<String, String>,
    /// The image the newest job's container ran, as its ID (`sha256:...`), once the agent
    /// reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PipelineRunList {
    pub runs: Vec<PipelineRunView>,
}

/// The durable record of a run: what it was started from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PipelineRunRecord {
    pub id: u64,
    pub file: String,
    pub text: String,
    pub parameters: BTreeMap<String, String>,
    pub started_at: UnixMillis,
    /// A rerun's steps run the very images the run it repeats ran: by step name, the image
    /// as written and the ID it resolved to then.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pins: BTreeMap<String, ImagePin>,
}

/// The image a step of an earlier run ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ImagePin {
    /// As the workflow names it, e.g. `alpine:3.23`.
    pub image: String,
    /// What it resolved to at launch: the image ID, `sha256:...`.
    pub id: String,
}

/// One input a run handled, as stored: replaying them in order rebuilds the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PipelineInputRecord {
    Tick {
        now: UnixMillis,
    },
    Finished {
        now: UnixMillis,
        node: usize,
        retry: u32,
        /// `succeeded`, `failed` or `errored`.
        outcome: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exit_code: Option<i64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        outputs: BTreeMap<String, String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stdout: Option<String>,
    },
}
