//! `FakeGpus`: an in-memory world of N GPUs, for hosts without a driver, tests and the demo.
//!
//! The world is behind a mutex so that a test holding a shared reference can change it while
//! the agent reads it: set a GPU's used memory and readings (utilisation, power,
//! temperature, processes), mark a GPU unhealthy with a reason, deliver an XID event or ECC
//! counters (judged by the same policy as real GPUs, `gpus/health.rs`), or make the next
//! `status` call fail. Readings nobody set are unknown (`None`), as on a GPU without them. Every call through the [`Gpus`] port is recorded. A container is given
//! fake GPUs only through `NVIDIA_VISIBLE_DEVICES`/`CUDA_VISIBLE_DEVICES`, since there is no
//! GPU runtime to attach them.

use std::sync::{Mutex, MutexGuard, PoisonError};

use nightshift_common::{GpuInfo, GpuProcess, GpuStatus};

use super::health::{self, EccReadings};
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
    /// What `status` reports, health and reason aside.
    status: GpuStatus,
    /// Set by hand (`set_healthy`, `set_unhealthy`) or by a critical XID; cleared only by
    /// hand, as a real XID verdict lasts until the GPU is reset.
    marked: Option<String>,
    ecc: EccReadings,
}

/// What `set_healthy(index, false)` gives as the reason.
pub const MARKED_UNHEALTHY: &str = "marked unhealthy";

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
                status: GpuStatus::healthy(index, 0),
                marked: None,
                ecc: EccReadings::default(),
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
        self.with_gpu(index, |gpu| gpu.status.memory_used_bytes = bytes)
    }

    /// Marks GPU `index` healthy (clearing every reason: XID, ECC counters, set by hand) or
    /// unhealthy with the reason [`MARKED_UNHEALTHY`].
    pub fn set_healthy(&self, index: u32, healthy: bool) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| {
            gpu.marked = (!healthy).then(|| MARKED_UNHEALTHY.to_owned());
            if healthy {
                gpu.ecc = EccReadings::default();
            }
        })
    }

    /// Marks GPU `index` unhealthy, and says why.
    pub fn set_unhealthy(&self, index: u32, reason: &str) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| gpu.marked = Some(reason.to_owned()))
    }

    /// Delivers a critical XID event for GPU `index`, as NVML's event set would: the GPU
    /// becomes unhealthy unless the XID is one NVIDIA attributes to the application.
    pub fn inject_xid(&self, index: u32, xid: u64) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| {
            if gpu.marked.is_none() {
                gpu.marked = health::xid_verdict(xid);
            }
        })
    }

    /// Sets GPU `index`'s ECC counters; they are judged at every `status`.
    pub fn set_ecc(&self, index: u32, ecc: EccReadings) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| gpu.ecc = ecc)
    }

    /// Sets GPU `index`'s utilisation (kernels, memory), in percent.
    pub fn set_utilization(&self, index: u32, gpu: u32, memory: u32) -> Result<(), GpuError> {
        self.with_gpu(index, |g| {
            g.status.utilization_gpu_percent = Some(gpu);
            g.status.utilization_memory_percent = Some(memory);
        })
    }

    /// Sets GPU `index`'s power draw and temperature.
    pub fn set_power_and_temperature(
        &self,
        index: u32,
        milliwatts: u32,
        celsius: u32,
    ) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| {
            gpu.status.power_milliwatts = Some(milliwatts);
            gpu.status.temperature_celsius = Some(celsius);
        })
    }

    /// Sets the compute processes on GPU `index`.
    pub fn set_processes(&self, index: u32, processes: Vec<GpuProcess>) -> Result<(), GpuError> {
        self.with_gpu(index, |gpu| gpu.status.processes = Some(processes))
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
        let reasons = [self.marked.clone(), health::ecc_verdict(&self.ecc)];
        let unhealthy_reason = health::unhealthy_reason(reasons);
        GpuStatus {
            healthy: unhealthy_reason.is_none(),
            unhealthy_reason,
            ..self.status.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(index: u32) -> GpuStatus {
        GpuStatus::healthy(index, 0)
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
                GpuStatus::healthy(1, 70 << 30),
                GpuStatus::unhealthy(2, 0, MARKED_UNHEALTHY),
            ]
        );
        gpus.set_memory_used(1, 0).expect("gpu 1");
        gpus.set_healthy(2, true).expect("gpu 2");
        assert_eq!(gpus.status().expect("status"), [idle(0), idle(1), idle(2)]);
    }

    #[test]
    fn readings_are_unknown_until_set() {
        let gpus = FakeGpus::new("n", 2);
        gpus.set_utilization(1, 93, 40).expect("gpu 1");
        gpus.set_power_and_temperature(1, 650_000, 71)
            .expect("gpu 1");
        let vllm = GpuProcess {
            pid: 3117,
            used_memory_bytes: Some(75 << 30),
        };
        gpus.set_processes(1, vec![vllm.clone()]).expect("gpu 1");
        assert_eq!(
            gpus.status().expect("status"),
            [
                idle(0),
                GpuStatus {
                    utilization_gpu_percent: Some(93),
                    utilization_memory_percent: Some(40),
                    power_milliwatts: Some(650_000),
                    temperature_celsius: Some(71),
                    processes: Some(vec![vllm]),
                    ..idle(1)
                }
            ]
        );
    }

    #[test]
    fn critical_xids_and_ecc_errors_make_a_gpu_unhealthy_with_a_reason() {
        let gpus = FakeGpus::new("n", 4);
        gpus.inject_xid(0, 79).expect("gpu 0");
        gpus.inject_xid(0, 48).expect("gpu 0");
        gpus.inject_xid(1, 13).expect("gpu 1");
        gpus.set_ecc(
            2,
            EccReadings {
                volatile_uncorrected: Some(2),
                pages_pending_retirement: Some(false),
            },
        )
        .expect("gpu 2");
        gpus.set_unhealthy(3, "fan failure").expect("gpu 3");
        let reasons: Vec<_> = gpus
            .status()
            .expect("status")
            .into_iter()
            .map(|s| (s.healthy, s.unhealthy_reason))
            .collect();
        assert_eq!(
            reasons,
            [
                (false, Some("xid 79: the gpu has fallen off the bus".into()),),
                (true, None),
                (false, Some("2 volatile uncorrectable ecc errors".into())),
                (false, Some("fan failure".into())),
            ],
            "the first xid is the reason; an application xid leaves the gpu healthy"
        );
        for index in 0..4 {
            gpus.set_healthy(index, true).expect("gpu");
        }
        assert_eq!(
            gpus.status().expect("status"),
            [idle(0), idle(1), idle(2), idle(3)]
        );
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
