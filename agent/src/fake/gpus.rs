//! The fake host's GPUs: [`FakeGpus`] (health, readings, injected failures) with the memory
//! the host model's containers hold on them, freed only some time after a container ends.

use std::sync::{Arc, Mutex};

use nightshift_common::{GpuInfo, GpuStatus};

use super::{World, lock};
use crate::engine::GpuAccess;
use crate::gpus::fake::FakeGpus;
use crate::gpus::{GpuError, Gpus};

/// The [`Gpus`] port of a [`super::FakeNode`].
pub struct FakeHostGpus {
    world: Arc<Mutex<World>>,
    /// Everything but the containers' memory; set directly to model more.
    pub inner: FakeGpus,
}

impl FakeHostGpus {
    pub(super) fn new(world: Arc<Mutex<World>>, inner: FakeGpus) -> Self {
        Self { world, inner }
    }
}

impl Gpus for FakeHostGpus {
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.inner.inventory()
    }

    fn status(&self) -> Result<Vec<GpuStatus>, GpuError> {
        let mut status = self.inner.status()?;
        let mut w = lock(&self.world);
        w.settle();
        for s in &mut status {
            s.memory_used_bytes += w.host.gpu_used(s.index);
        }
        Ok(status)
    }

    fn access(&self, indices: &[u32]) -> GpuAccess {
        self.inner.access(indices)
    }
}
