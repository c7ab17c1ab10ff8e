//! Wire types shared by the nightshift agent, coordinator and CLI.
//!
//! Everything that crosses a process boundary (the job file, the HTTP API, the agent
//! protocol) is defined here and only here. Every type refuses unknown fields, so a typo in a
//! job file or a mismatched agent is an error that names the field, never a silent default.
//!
//! Behind the `logging` feature, [`logging`] holds the binaries' log setup (journald-aware) and
//! error printing; behind the `tls` feature, [`tls`] the certificate helpers of the agent, the
//! coordinator and the CLI; behind `client` and `server`, [`net`] the HTTP transport they share.

pub mod agent;
pub mod api;
pub mod exposition;
pub mod hidden;
pub mod job;
pub mod labels;
#[cfg(feature = "logging")]
pub mod logging;
#[cfg(any(feature = "client", feature = "server"))]
pub mod net;
pub mod pipeline;
pub mod sandbox;
#[cfg(feature = "tls")]
pub mod tls;
pub mod yaml;

pub use agent::*;
pub use api::*;
pub use job::*;
pub use pipeline::*;
pub use sandbox::{Mount, Sandbox};

/// Milliseconds since the Unix epoch. The coordinator's core takes time only as this value,
/// passed in by its caller.
pub type UnixMillis = u64;
