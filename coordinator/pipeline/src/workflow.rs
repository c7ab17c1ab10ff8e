//! The supported subset of an Argo `Workflow`, as nightshift understands it.
//!
//! Every name and string keeps the line it came from, so that checks made after decoding
//! (references, cycles, expressions) still point at the right line.

use std::collections::BTreeMap;

/// A string from the file and its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub text: String,
    pub line: usize,
}

impl Located {
    pub fn new(text: impl Into<String>, line: usize) -> Self {
        Self {
            text: text.into(),
            line,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Workflow {
    /// `metadata.name`, else `metadata.generateName` without its trailing dash.
    pub name: String,
    pub entrypoint: Located,
    /// `spec.arguments.parameters`: the workflow's parameters, overridable at submit.
    pub arguments: Vec<Parameter>,
    pub templates: Vec<Template>,
    pub on_exit: Option<Located>,
    /// At most this many containers of the run at once.
    pub parallelism: Option<u32>,
    pub active_deadline_seconds: Option<u64>,
    /// nightshift's own settings, from `nightshift.io/*` annotations.
    pub extras: Extras,
}

impl Workflow {
    pub fn template(&self, name: &str) -> Option<&Template> {
        self.templates.iter().find(|t| t.name.text == name)
    }
}

/// Settings Argo ignores and nightshift reads: `metadata.annotations` with the `nightshift.io/`
/// prefix, on the workflow (defaults for every step) or on a template's `metadata`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extras {
    pub priority: Option<i32>,
    pub owner: Option<String>,
    pub checkpoint_signal: Option<String>,
    pub grace_period_seconds: Option<u32>,
}

impl Extras {
    /// `self`, with what it leaves unset taken from `base`.
    pub fn over(&self, base: &Extras) -> Extras {
        Extras {
            priority: self.priority.or(base.priority),
            owner: self.owner.clone().or_else(|| base.owner.clone()),
            checkpoint_signal: self
                .checkpoint_signal
                .clone()
                .or_else(|| base.checkpoint_signal.clone()),
            grace_period_seconds: self.grace_period_seconds.or(base.grace_period_seconds),
        }
    }
}

/// A parameter: a workflow argument, a template input, or an argument passed to a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Parameter {
    pub name: Located,
    pub value: Option<Located>,
    /// `default` of an input: used when no argument is passed.
    pub default: Option<Located>,
    /// `enum`: the values allowed.
    pub allowed: Vec<String>,
}

/// Where a template's output parameter comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputSource {
    /// A file in the container, read after it exits.
    Path(String),
    /// A parameter of a step or task of this steps/DAG template (`{{steps.x.outputs...}}`).
    Parameter(Located),
}

#[derive(Debug, Clone, PartialEq)]
pub struct OutputParameter {
    pub name: Located,
    pub source: OutputSource,
    /// Used when the file is missing or cannot be read.
    pub default: Option<String>,
}

/// A file passed between steps through the run's shared storage.
#[derive(Debug, Clone, PartialEq)]
pub struct Artifact {
    pub name: Located,
    /// Where the file is in the container (container templates).
    pub path: Option<String>,
    /// Which artifact this is (steps/DAG outputs and step arguments): `{{...}}`.
    pub from: Option<Located>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    pub name: Located,
    pub inputs: Vec<Parameter>,
    pub input_artifacts: Vec<Artifact>,
    pub outputs: Vec<OutputParameter>,
    pub output_artifacts: Vec<Artifact>,
    pub body: Body,
    pub retry: Option<RetryStrategy>,
    /// Seconds a container may run, from its start; may be a `{{...}}` string.
    pub active_deadline_seconds: Option<Located>,
    /// Duration of the whole node, queueing included (`"20s"`); may be a `{{...}}` string.
    pub timeout: Option<Located>,
    /// At most this many children at once.
    pub parallelism: Option<u32>,
    /// DAG only: stop starting tasks after the first failure (default true).
    pub fail_fast: bool,
    pub extras: Extras,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    Container(Container),
    /// Outer list in order, inner list in parallel.
    Steps(Vec<Vec<Step>>),
    Dag(Vec<Step>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Container {
    pub line: usize,
    pub image: Located,
    pub command: Vec<Located>,
    pub args: Vec<Located>,
    pub env: Vec<(String, Located)>,
    /// `resources.limits["nvidia.com/gpu"]`.
    pub gpus: u32,
}

/// A step of a `steps` template or a task of a `dag` template.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub name: Located,
    pub template: Located,
    pub arguments: Vec<Parameter>,
    pub artifacts: Vec<Artifact>,
    pub loop_over: Option<Loop>,
    pub when: Option<Located>,
    pub continue_on: ContinueOn,
    pub on_exit: Option<Located>,
    /// DAG only: `depends`, or the legacy `dependencies` list rewritten as `a && b`.
    pub depends: Option<Located>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Loop {
    /// `withItems`: each item as JSON.
    Items(Vec<serde_json::Value>, usize),
    /// `withParam`: a `{{...}}` string that must resolve to a JSON list.
    Param(Located),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContinueOn {
    pub failed: bool,
    pub error: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Retry when the container exits non-zero (Argo's default).
    OnFailure,
    /// Retry when the step could not run (image missing, start failure).
    OnError,
    /// Same as `OnError` here: every error nightshift sees is transient or not retried.
    OnTransientError,
    Always,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RetryStrategy {
    /// Retries after the first attempt; `None` is unlimited.
    pub limit: Option<u32>,
    pub policy: RetryPolicy,
    pub backoff: Option<Backoff>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub duration_ms: u64,
    pub factor: f64,
    /// No retry starts after this long since the first attempt.
    pub max_duration_ms: Option<u64>,
    /// Longest single wait.
    pub cap_ms: Option<u64>,
}

impl Backoff {
    /// The wait before retry number `retry` (1-based).
    pub fn delay_ms(&self, retry: u32) -> u64 {
        let exp = i32::try_from(retry.saturating_sub(1)).unwrap_or(i32::MAX);
        let d = (self.duration_ms as f64) * self.factor.powi(exp);
        let d = if d.is_finite() { d as u64 } else { u64::MAX };
        self.cap_ms.map_or(d, |c| d.min(c))
    }
}

/// Template name → the templates it calls (steps, tasks and exit handlers).
pub fn call_graph(wf: &Workflow) -> BTreeMap<&str, Vec<&Located>> {
    wf.templates
        .iter()
        .map(|t| {
            let calls = match &t.body {
                Body::Container(_) => Vec::new(),
                Body::Steps(groups) => groups.iter().flatten().flat_map(step_calls).collect(),
                Body::Dag(tasks) => tasks.iter().flat_map(step_calls).collect(),
            };
            (t.name.text.as_str(), calls)
        })
        .collect()
}

fn step_calls(s: &Step) -> Vec<&Located> {
    std::iter::once(&s.template)
        .chain(s.on_exit.as_ref())
        .collect()
}
