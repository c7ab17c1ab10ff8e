//! nightshift-hostmodel: a GPU host in virtual time, its agent the real planner.
//!
//! A [`Host`] is a pure model of what the agent drives on a GPU host (the container engine,
//! the GPUs' memory, the vLLM replica and the job containers), each transition timed on a
//! clock its caller hands in. An [`Agent`] runs the agent's real decisions against it: the
//! planner's rounds ([`nightshift_planner::pass`], [`nightshift_planner::plan`]) in the
//! order the executor (`agent/src/reconcile.rs`) runs them, so that the fleet simulator
//! (`nightshift simulate`) and the tests measure the code that ships, not a copy of it. What
//! the jobs do (how long they run, how long a checkpoint takes, who keeps the books) is the
//! caller's [`Workload`].
//!
//! Like the planner, this crate does no I/O, reads no clock and spawns nothing
//! (`coordinator/core/tests/tidy.rs` checks).

mod agent;
mod host;
mod images;
mod vllm;

pub use agent::{Agent, POLL};
pub use host::{EngineDown, Exit, Host, Idle, Launch, Proc, RunError, Timings, Workload};
pub use images::{Image, Images, Pull};
pub use vllm::{VllmError, VllmView};
