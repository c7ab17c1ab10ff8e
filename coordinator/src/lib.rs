//! nightshift-coordinator: the coordinator service and the CLI.

pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod gateway;
pub mod http;
pub mod lint;
pub mod loadgen;
pub mod pipelines;
pub mod server;
pub mod store;
pub mod workflows;
