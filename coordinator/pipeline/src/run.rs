//! A workflow run: the tree of nodes a workflow unfolds into as it runs, and the one
//! transition function that moves it.
//!
//! [`Run::handle`] takes `now` and an [`Input`] (time passing, or a step's job ending) and
//! returns [`Action`]s: launch a step's container as a job, or cancel one. It does no I/O and
//! is deterministic: the same inputs give the same run and the same actions, so the shell
//! persists the inputs and rebuilds a run after a restart by replaying them
//! ([`Run::replay`]). A replayed `Launch` names the same node and retry as before, which is
//! how the shell recognises a job it already submitted and never runs a step twice.
//!
//! Preemption never reaches a run: a preempted job is requeued by the coordinator's core
//! and ends only once, so it neither fails the step nor uses its `retryStrategy`.

use std::collections::BTreeMap;

use nightshift_common::UnixMillis;

mod advance;
mod create;
mod graph;

use crate::scope::Scope;
use crate::workflow::*;

pub type NodeId = usize;

/// Longest `outputs.result` kept, in bytes: the end of stdout beyond it is cut.
pub const MAX_RESULT_BYTES: usize = 256 << 10;

/// Most nodes (steps, tasks, loop items) a run may unfold into.
pub const MAX_RUN_NODES: usize = 10_000;
/// Most bytes the scopes of a loop's items may hold together: each item's node keeps a copy
/// of its scope, the workflow's parameters included.
pub const MAX_LOOP_SCOPE_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Errored,
    /// Its `when` was false.
    Skipped,
    /// Its `depends` was false.
    Omitted,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Errored => "Error",
            Self::Skipped => "Skipped",
            Self::Omitted => "Omitted",
        }
    }

    pub fn is_finished(self) -> bool {
        !matches!(self, Self::Pending | Self::Running)
    }

    fn is_failure(self) -> bool {
        matches!(self, Self::Failed | Self::Errored)
    }
}

/// What a node is, by what its template does.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Container,
    /// `group`: the index of the group of steps now running; `children[g]` its nodes.
    Steps {
        group: usize,
        children: Vec<Vec<NodeId>>,
    },
    /// `tasks`: task name → its node, once started (or omitted).
    Dag {
        tasks: BTreeMap<String, NodeId>,
    },
    /// A step with `withItems`/`withParam`: one child per item.
    Loop,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunNode {
    pub id: NodeId,
    pub parent: Option<NodeId>,
    /// Where it sits, for people: `main.B(1:bar)`.
    pub name: String,
    /// The step or task name as written (without the loop index).
    pub step: String,
    pub template: String,
    pub kind: Kind,
    pub phase: Phase,
    pub message: Option<String>,
    pub children: Vec<NodeId>,
    /// The template's own `{{...}}` values: its inputs and the workflow's.
    pub scope: Scope,
    pub outputs: BTreeMap<String, String>,
    /// Output artifacts: name → content.
    pub artifacts: BTreeMap<String, String>,
    pub result: Option<String>,
    pub continue_on: ContinueOn,
    /// Retries used so far (preemptions are not retries).
    pub retries: u32,
    /// A job is out for this node now.
    pub launched: bool,
    pub retry_at: Option<UnixMillis>,
    /// `timeout`: when the node fails if still running.
    pub deadline: Option<UnixMillis>,
    /// `activeDeadlineSeconds`, applied from each launch.
    pub active_deadline_ms: Option<u64>,
    pub created_at: UnixMillis,
    pub started_at: Option<UnixMillis>,
    pub finished_at: Option<UnixMillis>,
    /// The step's `onExit` template, and its node once started.
    pub on_exit: Option<String>,
    pub hook: Option<NodeId>,
}

impl RunNode {
    /// Finished, and so is its exit hook.
    fn settled(&self, run: &Run) -> bool {
        self.phase.is_finished() && self.hook.is_none_or(|h| run.nodes[h].phase.is_finished())
    }
}

/// A step's container, fully resolved: what the shell submits as a job.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSpec {
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub gpus: u32,
    pub extras: Extras,
    /// Output parameter name → the file to read from the container after it exits.
    pub output_paths: Vec<(String, String)>,
    /// Output artifacts the same way, named [`ARTIFACT_PREFIX`]`NAME`.
    pub artifact_paths: Vec<(String, String)>,
    /// Input artifacts: the file to place in the container before it starts, its content.
    pub input_files: Vec<(String, String)>,
}

/// Prefix of an output artifact among a step's captured files; `:` never appears in an
/// Argo parameter name.
pub const ARTIFACT_PREFIX: &str = "artifact:";

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Submit `spec` as a job for `node`. `retry` is 0 for the first attempt; the pair
    /// (node, retry) identifies the job across replays.
    Launch {
        node: NodeId,
        retry: u32,
        name: String,
        spec: Box<StepSpec>,
    },
    /// Stop the job of `node` (timeout, workflow deadline): its result will be ignored.
    Cancel { node: NodeId, reason: String },
}

/// How a step's job ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Succeeded,
    /// The container exited non-zero.
    Failed {
        exit_code: i64,
    },
    /// The container could not run (image missing, start failure).
    Errored {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    pub outcome: Outcome,
    /// Output parameters read from the container's files after it exited, by name.
    pub files: BTreeMap<String, String>,
    /// The container's standard output (bounded by the caller).
    pub stdout: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// Time passes: start what can start, fire deadlines and backoffs.
    Tick,
    /// The job of `node`'s attempt `retry` ended.
    Finished {
        node: NodeId,
        retry: u32,
        result: StepResult,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    #[error("parameter {0} is not a parameter of this workflow")]
    UnknownParameter(String),
    #[error("parameter {name} = {value:?} is not one of its enum values")]
    NotAllowed { name: String, value: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub wf: Workflow,
    pub id: String,
    pub parameters: BTreeMap<String, String>,
    pub nodes: Vec<RunNode>,
    pub started_at: UnixMillis,
    pub finished_at: Option<UnixMillis>,
    /// The run's outcome once it has finished (exit handler included).
    pub phase: Phase,
    /// The entrypoint's outcome, given to the exit handler as `{{workflow.status}}`.
    pub status: Option<Phase>,
    pub exit_node: Option<NodeId>,
}

impl Run {
    /// Starts a run of `wf` with `overrides` of its parameters.
    pub fn start(
        wf: Workflow,
        id: &str,
        overrides: &BTreeMap<String, String>,
        now: UnixMillis,
    ) -> Result<Self, RunError> {
        let mut parameters = BTreeMap::new();
        for p in &wf.arguments {
            parameters.insert(
                p.name.text.clone(),
                p.value.as_ref().map(|v| v.text.clone()).unwrap_or_default(),
            );
        }
        for (k, v) in overrides {
            let Some(p) = wf.arguments.iter().find(|p| &p.name.text == k) else {
                return Err(RunError::UnknownParameter(k.clone()));
            };
            if !p.allowed.is_empty() && !p.allowed.contains(v) {
                return Err(RunError::NotAllowed {
                    name: k.clone(),
                    value: v.clone(),
                });
            }
            parameters.insert(k.clone(), v.clone());
        }
        let mut run = Self {
            wf,
            id: id.to_owned(),
            parameters,
            nodes: Vec::new(),
            started_at: now,
            finished_at: None,
            phase: Phase::Running,
            status: None,
            exit_node: None,
        };
        let entry = run.wf.entrypoint.text.clone();
        // The entrypoint's inputs come from the workflow's parameters of the same name.
        let args: BTreeMap<String, String> = run.parameters.clone();
        let name = run.wf.name.clone();
        run.create(
            now,
            None,
            &name,
            &name,
            &entry,
            &args,
            ContinueOn::default(),
            None,
        );
        Ok(run)
    }

    /// Rebuilds a run from its start and every input it has handled, in order.
    pub fn replay(
        wf: Workflow,
        id: &str,
        overrides: &BTreeMap<String, String>,
        started_at: UnixMillis,
        inputs: &[(UnixMillis, Input)],
    ) -> Result<(Self, Vec<Action>), RunError> {
        let mut run = Self::start(wf, id, overrides, started_at)?;
        let mut actions = Vec::new();
        for (now, input) in inputs {
            actions.extend(run.handle(*now, input.clone()));
        }
        Ok((run, actions))
    }

    /// The one transition function.
    pub fn handle(&mut self, now: UnixMillis, input: Input) -> Vec<Action> {
        let mut actions = Vec::new();
        if let Input::Finished {
            node,
            retry,
            result,
        } = input
        {
            self.finished(now, node, retry, result);
        }
        if self.phase.is_finished() {
            return actions;
        }
        self.workflow_deadline(now, &mut actions);
        // Each pass may make more progress possible (a finished group starts the next).
        for _ in 0..10_000 {
            let before = self.fingerprint();
            for id in 0..self.nodes.len() {
                self.advance(now, id, &mut actions);
            }
            self.advance_workflow(now);
            if self.fingerprint() == before {
                break;
            }
        }
        actions
    }

    /// When [`Run::handle`] should next get a `Tick`, at the latest.
    pub fn next_deadline(&self) -> Option<UnixMillis> {
        if self.phase.is_finished() {
            return None;
        }
        let wf_deadline = self
            .wf
            .active_deadline_seconds
            .map(|s| self.started_at + s * 1000);
        self.nodes
            .iter()
            .filter(|n| !n.phase.is_finished())
            .flat_map(|n| [n.retry_at, n.deadline])
            .flatten()
            .chain(wf_deadline)
            .min()
    }

    fn fingerprint(&self) -> (usize, usize, usize, Phase) {
        let finished = self.nodes.iter().filter(|n| n.phase.is_finished()).count();
        let launched = self.nodes.iter().filter(|n| n.launched).count();
        let groups: usize = self
            .nodes
            .iter()
            .map(|n| match &n.kind {
                Kind::Steps { group, .. } => *group,
                _ => 0,
            })
            .sum();
        (
            self.nodes.len() + finished * 7 + groups * 13,
            launched,
            finished,
            self.phase,
        )
    }
}

/// When to run the node again after `phase`, if its retry strategy allows.
fn retry_after(t: &Template, node: &RunNode, phase: Phase, now: UnixMillis) -> Option<UnixMillis> {
    let r = t.retry.as_ref()?;
    let applies = matches!(
        (r.policy, phase),
        (RetryPolicy::Always, _)
            | (RetryPolicy::OnFailure, Phase::Failed)
            | (
                RetryPolicy::OnError | RetryPolicy::OnTransientError,
                Phase::Errored
            )
    );
    if !applies || r.limit.is_some_and(|l| node.retries >= l) {
        return None;
    }
    let delay = r
        .backoff
        .as_ref()
        .map_or(0, |b| b.delay_ms(node.retries + 1));
    if let Some(max) = r.backoff.as_ref().and_then(|b| b.max_duration_ms)
        && now + delay > node.created_at + max
    {
        return None;
    }
    Some(now + delay)
}

fn bounded(s: &str) -> String {
    if s.len() <= MAX_RESULT_BYTES {
        return s.to_owned();
    }
    let mut end = MAX_RESULT_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn fmt_ms(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", ms as f64 / 1000.0)
    }
}
