//! Pipelines for nightshift in the Argo Workflows format: parse a `Workflow`, check it with
//! file line numbers, evaluate `depends` and `when`, fill in parameters, and run it as a
//! state machine that says which steps to launch as jobs; the driver ([`driver`]) keeps every
//! run of the coordinator and turns their decisions into jobs through a port.
//!
//! Like the coordinator's core, this crate does no I/O: it never reads a file, a clock or
//! the environment. The CLI reads the file and passes its text; the coordinator passes `now`.

pub mod decode;
pub mod depends;
pub mod diagnostic;
pub mod driver;
pub mod duration;
pub mod lint;
pub mod placeholder;
pub mod run;
pub mod scope;
pub mod when;
pub mod workflow;
pub mod yaml;

pub use crate::diagnostic::{Diagnostic, Diagnostics, Rule};
pub use crate::driver::{PipelineChanges, PipelineSnapshot, Pipelines, StepJobs};
pub use crate::run::{Action, Input, Outcome, Phase, Run, StepResult, StepSpec};
pub use crate::workflow::Workflow;

/// Parses and checks a workflow file's text: the workflow, or every problem found.
pub fn load(text: &str) -> Result<Workflow, Diagnostics> {
    let doc = yaml::parse(text).map_err(|d| Diagnostics(vec![d]))?;
    let wf = decode::decode(&doc)?;
    let diags = lint::lint(&wf);
    if diags.is_empty() { Ok(wf) } else { Err(diags) }
}
