//! nightshift-planner: the node agent's decisions, pure.
//!
//! [`plan`] decides what the agent does next from what the node should be (the coordinator's
//! desired state), what the executor read from the host (an [`Observation`]) and what the
//! agent remembers across passes (its [`Memory`]), at a [`Moment`] it is given. The drain
//! (`drain.rs`) and the reclaim (`reclaim.rs`) are its two halves, the fail-safe
//! ([`failsafe`]) decides when the coordinator's silence voids the leases, and the replica's
//! state changes only through one transition function ([`lifecycle::apply`]).
//! [`CheckpointLayout`] names where every attempt's checkpoint lives, on disk and in an
//! object store.
//!
//! This crate does no I/O, reads no clock and spawns nothing: it depends on
//! `nightshift-common` and `thiserror` only, which its Cargo.toml enforces and
//! `coordinator/core/tests/tidy.rs` checks. The agent's executor (`agent/src/reconcile.rs`)
//! reads the host through its ports, passes `now`, and runs the [`Step`]s against them.

mod config;
mod container;
mod drain;
pub mod failsafe;
pub mod images;
mod layout;
pub mod lifecycle;
pub mod pass;
mod plan;
mod reclaim;
pub mod runs;
mod time;

pub use config::{PlanConfig, ReclaimMode};
pub use container::{
    Container, ContainerState, GRACE_LABEL, gpus_of, job_labels, jobs, label_u64, lease_of, replica,
};
pub use layout::{CheckpointLayout, gang_rank};
pub use lifecycle::{IllegalMove, ReplicaEvent};
pub use plan::{
    Health, Memory, Note, Observation, Phase, ReplicaProbe, Restore, Stale, StartFailure, Step,
    StopJob, Stuck, UPLOAD_TRIES, Upload, honoured, plan, unrestored, unstarted, upload_retry,
};
pub use time::Moment;
