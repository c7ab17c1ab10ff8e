//! nightshift-agent: the node agent.
//!
//! It registers with the coordinator, heartbeats what it sees, and reconciles the host towards
//! the node's desired state: a serving vLLM replica, or job containers on leased GPUs.

pub mod agent;
pub mod api;
pub mod config;
pub mod drain;
pub mod engine;
pub mod failsafe;
#[cfg(any(test, feature = "fakes"))]
pub mod fake;
pub mod gpus;
pub mod host;
pub mod job;
pub mod lifecycle;
pub mod logs;
pub mod plan;
pub mod probe;
pub mod readiness;
pub mod reclaim;
pub mod reconcile;
pub mod replica;
pub mod serving;
pub mod state;
pub mod telemetry;
pub mod tls;
pub mod uplink;
