//! nightshift-cli: the `nightshift` command line for researchers and operators.
//!
//! - [`cli`]: the arguments and [`cli::run`], the whole program with its streams passed in;
//! - [`client`]: a typed client for the coordinator's HTTP API;
//! - [`render`]: what the commands print, as tables or the API's JSON;
//! - [`workflows`] and [`lint`]: Argo Workflows files, checked offline, submitted as runs;
//! - [`simulate`]: the fleet simulator on a traffic trace, offline, and [`simchart`], its HTML page;
//! - [`traces`]: reads the traffic traces from disk for the simulator, which reads nothing;
//! - [`demo`]: hands `nightshift demo` over to the dev cluster's `nightshift-demo`;
//! - [`error`]: why a command failed and the exit code that says so.
//!
//! It is a client only: it never links the coordinator service or the agent.

pub mod cli;
pub mod client;
pub mod demo;
pub mod error;
pub mod lint;
pub mod render;
pub mod simchart;
pub mod simulate;
pub mod traces;
pub mod vopr;
pub mod workflows;
