//! `FakeGpus`: an in-memory world of N GPUs, for hosts without a driver, tests and the demo.
//!
//! The world is behind a mutex so that a test holding a shared reference can change it while
//! the agent reads it: set a GPU's used memory, mark a GPU unhealthy, or make the next
//! `status` call fail. Every call through the [`Gpus`] port is recorded. A container is given
//! fake GPUs only through `NVIDIA_VISIBLE_DEVICES`/`CUDA_VISIBLE_DEVICES`, since there is no
//! GPU runtime to attach them.

use std::sync::{Mutex, MutexGuard, PoisonError};

use nightshift_common::{GpuInfo, GpuStatus};

use super::{GpuError, Gpus};
use crate::engine::GpuAccess;

/// The model name fake GPUs report unless told otherwise.
pub const DEFAULT_MODEL: &str = "NVIDIA H100 80GB HBM3 (fake)";
/// The memory of a fake GPU unless told otherwise: 80 GiB.
pub const DEFAULT_MEMORY_BYTES: u64 = 80 * 1024 * 1024 * 1024;

/// A call made through the [`Gpus`] port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuCall {
    Inventory,
    Status,
    Access(Vec<u32>),
}

#[derive(Debug)]
pub struct FakeGpus {
    world: Mutex<World>,
}

#[derive(Debug)]
struct World {
    gpus: Vec<FakeGpu>,
    next_status_error: Option<GpuError>,
    calls: Vec<GpuCall>,
}

#[derive(Debug)]
struct FakeGpu {
    info: GpuInfo,
    memory_used_bytes: u64,
    healthy: bool,
}

impl FakeGpus {
    /// `count` idle, healthy GPUs of the default model, with UUIDs `GPU-fake-<node>-<index>`.
    pub fn new(node: &str, count: u32) -> Self {
        Self::with_model(node, count, DEFAULT_MODEL, DEFAULT_MEMORY_BYTES)
    }

    pub fn with_model(node: &str, count: u32, name: &str, memory_total_bytes: u64) -> Self {
        let gpus = (0..count)
            .map(|index| FakeGpu {
                info: GpuInfo {
                    index,
                    uuid: format!("GPU-fake-{node}-{index}"),
                    name: name.to_owned(),
                    memory_total_bytes,
                },
                memory_used_bytes: 0,
                healthy: true,
            })
            .collect();
        Self {
            world: Mutex::new(World {
                gpus,
                next_status_error: None,
                calls: Vec::new(),
            }),
        }
    }

    /// Sets the memory in use on GPU `index`, as a process on it would.
    pub fn set_memory_used(&self, index: u32, bytes: u64) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| gpu.memory_used_bytes = bytes)
    }

    /// Marks GPU `index` healthy or not, as a lost GPU or an XID error would.
    pub fn set_healthy(&self, index: u32, healthy: bool) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| gpu.healthy = healthy)
    }

    /// Makes the next `status` call, and only that one, return `error`.
    pub fn fail_next_status(&self, error: GpuError) {
        self.world().next_status_error = Some(error);
    }

    /// The calls made through the port so far, oldest first.
    pub fn calls(&self) -> Vec<GpuCall> {
        self.world().calls.clone()
    }

    fn with_gpu(&self, index: u32, change: impl FnOnce(&mut FakeGpu)) -> Result<(), GpuError> {
        let mut world = self.world();
        let gpu = world
            .gpus
            .get_mut(index as usize)
            .ok_or_else(|| GpuError::Device {
                index,
                message: "no such fake gpu".to_owned(),
            })?;
        change(gpu);
        Ok(())
    }

    /// The world, even if a panicking test thread poisoned the lock: its data stays usable.
    fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Gpus for FakeGpus {
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let mut world = self.world();
        world.calls.push(GpuCall::Inventory);
        Ok(world.gpus.iter().map(|gpu| gpu.info.clone()).collect())
    }

    fn status(&self) -> Result<Vec<GpuStatus>, GpuError> {
        let mut world = self.world();
        world.calls.push(GpuCall::Status);
        if let Some(error) = world.next_status_error.take() {
            return Err(error);
        }
        Ok(world.gpus.iter().map(FakeGpu::status).collect())
    }

    fn access(&self, indices: &[u32]) -> GpuAccess {
        self.world().calls.push(GpuCall::Access(indices.to_vec()));
        GpuAccess::VisibleDevicesEnv {
            indices: indices.to_vec(),
        }
    }
}

impl FakeGpu {
    fn status(&self) -> GpuStatus {
        GpuStatus {
            index: self.info.index,
            memory_used_bytes: self.memory_used_bytes,
            healthy: self.healthy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(index: u32) -> GpuStatus {
        GpuStatus {
            index,
            memory_used_bytes: 0,
            healthy: true,
        }
    }

    #[test]
    fn inventory_of_default_gpus() {
        let gpus = FakeGpus::new("node-a", 4);
        let inventory = gpus.inventory().expect("inventory");
        assert_eq!(inventory.len(), 4);
        assert_eq!(
            inventory[2],
            GpuInfo {
                index: 2,
                uuid: "GPU-fake-node-a-2".into(),
                name: "NVIDIA H100 80GB HBM3 (fake)".into(),
                memory_total_bytes: 85_899_345_920,
            }
        );
        let indices: Vec<u32> = inventory.iter().map(|gpu| gpu.index).collect();
        assert_eq!(indices, [0, 1, 2, 3]);
    }

    #[test]
    fn uuids_are_stable_and_unique_per_node() {
        let uuids = |node| -> Vec<String> {
            let inventory = FakeGpus::new(node, 2).inventory().expect("inventory");
            inventory.into_iter().map(|gpu| gpu.uuid).collect()
        };
        assert_eq!(uuids("a"), uuids("a"));
        assert_eq!(uuids("a"), ["GPU-fake-a-0", "GPU-fake-a-1"]);
        assert_ne!(uuids("a"), uuids("b"));
    }

    #[test]
    fn custom_model_and_no_gpus() {
        let gpus = FakeGpus::with_model("n", 1, "Tiny GPU", 1024);
        let inventory = gpus.inventory().expect("inventory");
        assert_eq!(
            (inventory[0].name.as_str(), inventory[0].memory_total_bytes),
            ("Tiny GPU", 1024)
        );
        let none = FakeGpus::new("n", 0);
        assert_eq!(none.inventory().expect("inventory"), vec![]);
        assert_eq!(none.status().expect("status"), vec![]);
    }

    #[test]
    fn status_reflects_injected_memory_and_health() {
        let gpus = FakeGpus::new("n", 3);
        assert_eq!(gpus.status().expect("status"), [idle(0), idle(1), idle(2)]);
        gpus.set_memory_used(1, 70 << 30).expect("gpu 1");
        gpus.set_healthy(2, false).expect("gpu 2");
        assert_eq!(
            gpus.status().expect("status"),
            [
                idle(0),
                GpuStatus {
                    index: 1,
                    memory_used_bytes: 70 << 30,
                    healthy: true
                },
                GpuStatus {
                    index: 2,
                    memory_used_bytes: 0,
                    healthy: false
                },
            ]
        );
        gpus.set_memory_used(1, 0).expect("gpu 1");
        gpus.set_healthy(2, true).expect("gpu 2");
        assert_eq!(gpus.status().expect("status"), [idle(0), idle(1), idle(2)]);
    }

    #[test]
    fn unknown_gpu_is_an_error() {
        let gpus = FakeGpus::new("n", 2);
        let error = gpus.set_memory_used(2, 1).expect_err("no gpu 2");
        assert_eq!(error.to_string(), "gpu 2: no such fake gpu");
        assert!(matches!(
            gpus.set_healthy(7, false),
            Err(GpuError::Device { index: 7, .. })
        ));
    }

    #[test]
    fn injected_failure_hits_only_the_next_status() {
        let gpus = FakeGpus::new("n", 1);
        gpus.fail_next_status(GpuError::Unavailable("nvml went away".into()));
        let error = gpus.status().expect_err("injected failure");
        assert_eq!(error.to_string(), "nvml went away");
        assert_eq!(gpus.status().expect("status"), [idle(0)]);
        assert!(gpus.inventory().is_ok());
    }

    #[test]
    fn access_uses_visible_devices_env() {
        let gpus = FakeGpus::new("n", 4);
        assert_eq!(
            gpus.access(&[1, 3]),
            GpuAccess::VisibleDevicesEnv {
                indices: vec![1, 3]
            }
        );
        assert_eq!(
            gpus.access(&[]),
            GpuAccess::VisibleDevicesEnv { indices: vec![] }
        );
    }

    #[test]
    fn calls_are_recorded_in_order() {
        let gpus = FakeGpus::new("n", 2);
        gpus.inventory().expect("inventory");
        gpus.fail_next_status(GpuError::Unavailable("boom".into()));
        let _ = gpus.status();
        gpus.status().expect("status");
        gpus.access(&[0]);
        gpus.set_memory_used(0, 5).expect("setter");
        assert_eq!(
            gpus.calls(),
            [
                GpuCall::Inventory,
                GpuCall::Status,
                GpuCall::Status,
                GpuCall::Access(vec![0])
            ]
        );
    }

    #[test]
    fn shared_between_threads() {
        let gpus = std::sync::Arc::new(FakeGpus::new("n", 1));
        let writer = std::sync::Arc::clone(&gpus);
        std::thread::spawn(move || writer.set_memory_used(0, 42).expect("gpu 0"))
            .join()
            .expect("thread");
        assert_eq!(gpus.status().expect("status")[0].memory_used_bytes, 42);
    }
}
