//! The `Gpus` port: the GPUs of this host and how a container is given some of them.
//!
//! `gpus/nvml.rs` reads real GPUs through NVML (loaded at run time); `gpus/fake.rs` is an
//! in-memory world of N GPUs for hosts without a driver, tests and the demo.

pub mod fake;
pub mod nvml;

use nightshift_common::{GpuInfo, GpuStatus};

use crate::engine::GpuAccess;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// NVML could not be loaded or initialised; the message says which library was looked
    /// for and why it failed.
    #[error("{0}")]
    Unavailable(String),
    #[error("gpu {index}: {message}")]
    Device { index: u32, message: String },
}

pub trait Gpus: Send + Sync + 'static {
    /// Every GPU on the host, in index order.
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError>;

    /// Current memory use and health of every GPU.
    fn status(&self) -> Result<Vec<GpuStatus>, GpuError>;

    /// How a container gets exactly these GPUs (host indices).
    fn access(&self, indices: &[u32]) -> GpuAccess;
}
