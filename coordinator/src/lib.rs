//! nightshift-coordinator: the coordinator service and the CLI.

pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod gateway;
pub mod http;
pub mod loadgen;
pub mod metrics;
pub mod report;
pub mod server;
pub mod simulate;
pub mod store;
