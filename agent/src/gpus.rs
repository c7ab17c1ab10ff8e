//! The `Gpus` port: the GPUs of this host and how a container is given some of them.
//!
//! `gpus/nvml.rs` reads real GPUs through NVML (loaded at run time); `gpus/fake.rs` is an
//! in-memory world of N GPUs for hosts without a driver, tests and the demo.

pub mod fake;
pub mod health;
pub mod nvml;

use std::sync::Arc;

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

    /// Current memory use, readings (utilisation, power, temperature, processes) and health
    /// of every GPU. A reading a GPU does not support is `None`, never an error.
    fn status(&self) -> Result<Vec<GpuStatus>, GpuError>;

    /// How a container gets exactly these GPUs (host indices).
    fn access(&self, indices: &[u32]) -> GpuAccess;
}

/// Shared GPUs: a test keeps one handle to its fake GPUs and gives the agent another.
impl<G: Gpus> Gpus for Arc<G> {
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        G::inventory(self)
    }

    fn status(&self) -> Result<Vec<GpuStatus>, GpuError> {
        G::status(self)
    }

    fn access(&self, indices: &[u32]) -> GpuAccess {
        G::access(self, indices)
    }
}

/// The GPUs this agent runs with: NVML, or fake ones when configured.
pub enum HostGpus {
    Nvml(Box<nvml::NvmlGpus>),
    Fake(fake::FakeGpus),
}

impl HostGpus {
    /// Fake GPUs when `fake` is set, otherwise NVML; fails with NVML's reason when the driver
    /// is missing.
    pub fn open(
        node: &str,
        fake: Option<u32>,
        library: Option<&std::path::Path>,
    ) -> Result<Self, GpuError> {
        match fake {
            Some(n) => Ok(Self::Fake(fake::FakeGpus::new(node, n))),
            None => nvml::NvmlGpus::open(library).map(|g| Self::Nvml(Box::new(g))),
        }
    }
}

impl Gpus for HostGpus {
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        match self {
            Self::Nvml(g) => g.inventory(),
            Self::Fake(g) => g.inventory(),
        }
    }

    fn status(&self) -> Result<Vec<GpuStatus>, GpuError> {
        match self {
            Self::Nvml(g) => g.status(),
            Self::Fake(g) => g.status(),
        }
    }

    fn access(&self, indices: &[u32]) -> GpuAccess {
        match self {
            Self::Nvml(g) => g.access(indices),
            Self::Fake(g) => g.access(indices),
        }
    }
}
