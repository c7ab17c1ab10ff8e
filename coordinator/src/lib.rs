//! nightshift-coordinator: the coordinator service (HTTP API, cluster state, store, auth).
//! The `nightshift` CLI is the crate nightshift-cli (coordinator/cli); the dev cluster behind
//! `nightshift demo` is nightshift-devcluster (tests/devcluster).

pub mod auth;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod health;
pub mod http;
pub mod https;
pub mod leader;
pub mod metrics;
pub mod pipelines;
pub mod pki;
pub use nightshift_policy as policy;
pub mod ratelimit;
pub mod server;
pub mod store;
pub mod timeline;
