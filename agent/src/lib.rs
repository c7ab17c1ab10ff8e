//! nightshift-agent: the node agent.
//!
//! It registers with the coordinator, heartbeats what it sees, and reconciles the host towards
//! the node's desired state: a serving vLLM replica, or job containers on leased GPUs. What
//! to do is decided by the pure planner (`nightshift-planner`); [`reconcile`] executes it.

pub mod agent;
pub mod api;
pub mod bucket;
pub mod config;
pub mod engine;
#[cfg(any(test, feature = "fakes"))]
pub mod fake;
pub mod gpus;
pub mod host;
pub mod job;
pub mod logs;
pub mod probe;
pub mod readiness;
pub mod reconcile;
pub mod replica;
pub mod serving;
pub mod state;
pub mod telemetry;
pub mod tls;
pub mod uplink;
