//! nightshift-coordinator: the coordinator service and the CLI.

pub mod auth;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod gateway;
pub mod health;
pub mod http;
pub mod https;
pub mod lint;
pub mod loadgen;
pub mod metrics;
pub mod pipelines;
pub mod pki;
pub use nightshift_policy as policy;
pub mod ratelimit;
pub mod server;
pub mod simulate;
pub mod store;
pub mod workflows;
