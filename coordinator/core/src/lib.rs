//! The coordinator's decision core: node modes (serve or lend), the job queue, the lease table
//! with fencing epochs, and one service's autoscaler.
//!
//! It does no I/O: it never reads a clock, the environment or a random source, and knows
//! nothing of HTTP or SQLite. Every call takes `now` from its caller and records what changed
//! as [`Effect`]s, which the caller drains with [`Core::poll_effects`] to persist and publish.
//! The HTTP shell drives it in production; tests and the simulator drive it with a virtual
//! clock.

mod autoscale;
mod calendar;
mod checkpoint;
mod config;
mod core;
mod forecast;
mod index;
mod invariants;
mod job;
mod lease;
mod node;
mod placement;
pub mod report;
mod snapshot;

pub use crate::calendar::{HarvestWindow, WindowError};
pub use crate::checkpoint::Holder as CheckpointHolder;
pub use crate::config::{CoreConfig, STRAGGLER_MARGIN_MS, ScaleDown, ScaleUp, ServicePolicy};
pub use crate::core::{Core, CoreError, Effect, Usage};
pub use crate::forecast::Profile;
pub use crate::invariants::Violation;
pub use crate::job::{IllegalTransition, Job, JobEvent};
pub use crate::lease::{Lease, Straggler};
pub use crate::node::Node;
pub use crate::snapshot::{CoreSnapshot, NodeSnapshot};

pub use nightshift_common::UnixMillis;
