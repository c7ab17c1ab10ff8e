//! nightshift-devcluster: the cluster behind `nightshift demo`, on one machine.
//!
//! - [`cluster`]: the real `nightshift-coordinator` and `nightshift-agent` programs started as
//!   child processes, with their configuration files written to a temporary folder;
//! - [`demo`]: the harvest story told on that cluster (`nightshift-demo`);
//! - [`gateway`]: an activator-style gateway that holds requests while no replica is ready;
//! - [`loadgen`]: open-loop load for a completions endpoint (also `nightshift-loadgen`).

pub mod cluster;
pub mod demo;
pub mod gateway;
pub mod loadgen;
