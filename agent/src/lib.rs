//! nightshift-agent: the node agent.
//!
//! It registers with the coordinator, heartbeats what it sees, and reconciles the host towards
//! the node's desired state: a serving vLLM replica, or job containers on leased GPUs.

pub mod engine;
pub mod gpus;
pub mod serving;
