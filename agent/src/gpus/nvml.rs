//! `NvmlGpus`: the host's real GPUs, read through NVML.
//!
//! nvml-wrapper loads `libnvidia-ml.so.1` at run time, so the agent builds and starts on a
//! host without a driver; [`NvmlGpus::open`] then fails with a message that says which
//! library it looked for and why it could not use it. Every call is a blocking FFI call:
//! callers on an async runtime wrap them in `spawn_blocking`.
//!
//! Besides memory, each status reads utilisation, power, temperature, the compute processes
//! and the ECC counters. Any of those a GPU does not support (`NotSupported`) is left out
//! (unknown), never an error of the whole status. A GPU is unhealthy when it has fallen off
//! the bus or needs a reset, when a critical XID event arrived for it (a thread waits on an
//! NVML event set), or when its ECC counters say so; `gpus/health.rs` holds the policy.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use nightshift_common::{GpuInfo, GpuProcess, GpuStatus};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

use super::health::{self, EccReadings};
use super::{GpuError, Gpus};
use crate::engine::GpuAccess;

/// The library NVML is loaded from unless a path is given.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// What to do when NVML cannot be used, appended to [`GpuError::Unavailable`] messages.
const REMEDY: &str = "install the NVIDIA driver or set gpus.fake = N to run on fake GPUs";

/// How long the XID watcher waits on the event set before looking at its stop flag.
const XID_WAIT_MS: u32 = 1_000;

/// GPU index → why a critical XID event made it unhealthy (the first such event wins).
type XidVerdicts = Arc<Mutex<BTreeMap<u32, String>>>;

#[derive(Debug)]
pub struct NvmlGpus {
    nvml: Arc<Nvml>,
    xids: XidVerdicts,
    /// Set on drop: the XID watcher thread then ends within [`XID_WAIT_MS`].
    stop_watcher: Arc<AtomicBool>,
}

impl Drop for NvmlGpus {
    fn drop(&mut self) {
        self.stop_watcher.store(true, Ordering::Relaxed);
    }
}

impl NvmlGpus {
    /// Loads NVML from `lib_path`, or from [`DEFAULT_LIBRARY`] on the loader's search path,
    /// and initialises it.
    pub fn open(lib_path: Option<&Path>) -> Result<Self, GpuError> {
        let library = lib_path.map_or(OsStr::new(DEFAULT_LIBRARY), Path::as_os_str);
        let nvml = Nvml::builder()
            .lib_path(library)
            .init()
            .map_err(|error| GpuError::Unavailable(unavailable(library, &error)))?;
        let gpus = Self {
            nvml: Arc::new(nvml),
            xids: XidVerdicts::default(),
            stop_watcher: Arc::new(AtomicBool::new(false)),
        };
        let (nvml, xids, stop) = (
            Arc::clone(&gpus.nvml),
            Arc::clone(&gpus.xids),
            Arc::clone(&gpus.stop_watcher),
        );
        let spawned = std::thread::Builder::new()
            .name("nvml-xid".into())
            .spawn(move || watch_xids(&nvml, &xids, &stop));
        if let Err(error) = spawned {
            tracing::warn!(%error, "could not start the xid watcher; xid events are not seen");
        }
        Ok(gpus)
    }

    fn count(&self) -> Result<u32, GpuError> {
        self.nvml.device_count().map_err(|error| {
            GpuError::Unavailable(format!("NVML could not count the gpus: {error}"))
        })
    }

    fn info(&self, index: u32) -> Result<GpuInfo, NvmlError> {
        let device = self.nvml.device_by_index(index)?;
        Ok(GpuInfo {
            index,
            uuid: device.uuid()?,
            name: device.name()?,
            memory_total_bytes: device.memory_info()?.total,
        })
    }

    fn status_of(&self, index: u32) -> Result<GpuStatus, GpuError> {
        let used = self
            .nvml
            .device_by_index(index)
            .and_then(|device| Ok((device.memory_info()?.used, device)));
        let (memory_used_bytes, device) = match used {
            Ok(read) => read,
            Err(error) if is_device_fault(&error) => {
                tracing::warn!(gpu.index = index, %error, "gpu is unhealthy");
                return Ok(GpuStatus::unhealthy(index, 0, format!("nvml: {error}")));
            }
            Err(error) => return Err(device_error(index, &error)),
        };
        let mut read = Readings::new(index);
        let utilization = read.optional("utilization", device.utilization_rates());
        let processes = read
            .optional("processes", device.running_compute_processes())
            .map(|list| list.into_iter().map(process).collect());
        let ecc = EccReadings {
            volatile_uncorrected: read.optional(
                "ecc errors",
                device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
            ),
            pages_pending_retirement: read
                .optional("retired pages", device.are_pages_pending_retired()),
        };
        let status = GpuStatus {
            utilization_gpu_percent: utilization.as_ref().map(|u| u.gpu),
            utilization_memory_percent: utilization.as_ref().map(|u| u.memory),
            power_milliwatts: read.optional("power", device.power_usage()),
            temperature_celsius: read
                .optional("temperature", device.temperature(TemperatureSensor::Gpu)),
            processes,
            ..GpuStatus::healthy(index, memory_used_bytes)
        };
        let reasons = [
            read.fault,
            self.xid_verdict(index),
            health::ecc_verdict(&ecc),
        ];
        let unhealthy_reason = health::unhealthy_reason(reasons);
        Ok(GpuStatus {
            healthy: unhealthy_reason.is_none(),
            unhealthy_reason,
            ..status
        })
    }

    fn xid_verdict(&self, index: u32) -> Option<String> {
        self.xids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&index)
            .cloned()
    }

    fn uuids(&self, indices: &[u32]) -> Result<Vec<String>, NvmlError> {
        indices
            .iter()
            .map(|&index| self.nvml.device_by_index(index)?.uuid())
            .collect()
    }
}

impl Gpus for NvmlGpus {
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        (0..self.count()?)
            .map(|index| {
                self.info(index)
                    .map_err(|error| device_error(index, &error))
            })
            .collect()
    }

    /// A GPU whose memory cannot be read because of a device fault is reported with
    /// `healthy: false` and `memory_used_bytes: 0`, which then means "unknown"; any other
    /// NVML failure fails the call.
    fn status(&self) -> Result<Vec<GpuStatus>, GpuError> {
        (0..self.count()?)
            .map(|index| self.status_of(index))
            .collect()
    }

    /// A device request by UUID; by index for every GPU when any UUID cannot be read, so
    /// that one request never mixes the two.
    fn access(&self, indices: &[u32]) -> GpuAccess {
        let device_ids = self.uuids(indices).unwrap_or_else(|error| {
            tracing::warn!(?indices, %error, "could not read gpu uuids; requesting gpus by index");
            indices.iter().map(u32::to_string).collect()
        });
        GpuAccess::DeviceRequest { device_ids }
    }
}

/// The optional readings of one GPU's status: a reading the GPU does not support is `None`
/// silently; a device fault makes it `None` and the GPU unhealthy; any other failure makes it
/// `None` and is logged at debug level (it would repeat every heartbeat).
struct Readings {
    index: u32,
    fault: Option<String>,
}

impl Readings {
    fn new(index: u32) -> Self {
        Self { index, fault: None }
    }

    fn optional<T>(&mut self, what: &str, result: Result<T, NvmlError>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(NvmlError::NotSupported) => None,
            Err(error) if is_device_fault(&error) => {
                tracing::warn!(gpu.index = self.index, %error, reading = what, "gpu is unhealthy");
                self.fault
                    .get_or_insert_with(|| format!("nvml: {what}: {error}"));
                None
            }
            Err(error) => {
                tracing::debug!(gpu.index = self.index, %error, reading = what, "gpu reading unavailable");
                None
            }
        }
    }
}

fn process(info: nvml_wrapper::struct_wrappers::device::ProcessInfo) -> GpuProcess {
    GpuProcess {
        pid: info.pid,
        used_memory_bytes: match info.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Some(bytes),
            UsedGpuMemory::Unavailable => None,
        },
    }
}

/// Waits on an NVML event set for critical XID events on every GPU that supports them, and
/// records the verdict of each (see `gpus/health.rs`) until `stop` is set. A GPU without XID
/// events is still judged by its ECC counters.
fn watch_xids(nvml: &Nvml, verdicts: &Mutex<BTreeMap<u32, String>>, stop: &AtomicBool) {
    let mut set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(error) => {
            tracing::warn!(%error, "no nvml event set; xid events are not seen");
            return;
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    let mut watched = 0;
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let supported = device
            .supported_event_types()
            .is_ok_and(|types| types.contains(EventTypes::CRITICAL_XID_ERROR));
        if !supported {
            tracing::info!(
                gpu.index = index,
                "gpu has no xid events; health from ecc only"
            );
            continue;
        }
        // A failed registration frees the set (nvml-wrapper's contract): stop there.
        set = match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(set) => set,
            Err(error) => {
                tracing::warn!(gpu.index = index, %error, "could not watch xid events");
                return;
            }
        };
        watched += 1;
    }
    tracing::info!(gpus = watched, "watching xid events");
    while watched > 0 && !stop.load(Ordering::Relaxed) {
        let event = match set.wait(XID_WAIT_MS) {
            Ok(event) => event,
            Err(NvmlError::Timeout) => continue,
            Err(error) => {
                tracing::warn!(%error, "waiting for xid events failed");
                std::thread::sleep(std::time::Duration::from_millis(u64::from(XID_WAIT_MS)));
                continue;
            }
        };
        let Some(XidError::Value(xid)) = event.event_data else {
            continue;
        };
        let Ok(index) = event.device.index() else {
            tracing::warn!(xid, "xid event for a gpu whose index cannot be read");
            continue;
        };
        match health::xid_verdict(xid) {
            Some(reason) => {
                tracing::error!(gpu.index = index, xid, %reason, "gpu is unhealthy: it will not be leased");
                verdicts
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(index)
                    .or_insert(reason);
            }
            None => tracing::warn!(
                gpu.index = index,
                xid,
                "application xid; the gpu stays healthy"
            ),
        }
    }
}

/// Errors that say this GPU is broken, not that NVML or the driver is.
fn is_device_fault(error: &NvmlError) -> bool {
    matches!(
        error,
        NvmlError::GpuLost
            | NvmlError::ResetRequired
            | NvmlError::IrqIssue
            | NvmlError::CorruptedInfoROM
            | NvmlError::InsufficientPower
            | NvmlError::Unknown
    )
}

fn device_error(index: u32, error: &NvmlError) -> GpuError {
    GpuError::Device {
        index,
        message: format!("NVML: {error}"),
    }
}

fn unavailable(library: &OsStr, error: &NvmlError) -> String {
    let library = library.to_string_lossy();
    let what = match error {
        NvmlError::LibloadingError(cause) => format!("could not load {library} ({cause})"),
        NvmlError::FailedToLoadSymbol(cause) => {
            format!("{library} lacks a required function ({cause})")
        }
        other => format!("loaded {library} but could not initialise it ({other})"),
    };
    format!("NVML unavailable: {what}; {REMEDY}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_library_missing_names_it() {
        match NvmlGpus::open(None) {
            Err(GpuError::Unavailable(message)) => {
                assert!(message.contains("libnvidia-ml.so.1"), "{message}");
                assert!(message.starts_with("NVML unavailable: "), "{message}");
                assert!(message.ends_with(REMEDY), "{message}");
            }
            Err(other) => panic!("expected Unavailable, got {other:?}"),
            // A host with a driver: nothing to check here, see `reads_real_gpus`.
            Ok(_) => {}
        }
    }

    #[test]
    fn given_library_missing_names_the_path() {
        let path = Path::new("/nonexistent/nightshift/libnvidia-ml.so.1");
        let Err(GpuError::Unavailable(message)) = NvmlGpus::open(Some(path)) else {
            panic!("a missing library must be Unavailable");
        };
        assert_eq!(
            message,
            "NVML unavailable: could not load /nonexistent/nightshift/libnvidia-ml.so.1 \
             (/nonexistent/nightshift/libnvidia-ml.so.1: cannot open shared object file: \
             No such file or directory); \
             install the NVIDIA driver or set gpus.fake = N to run on fake GPUs"
        );
    }

    #[test]
    fn a_library_that_is_not_nvml() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("libnvidia-ml.so.1");
        std::fs::write(&path, b"not an ELF file").expect("write");
        let Err(GpuError::Unavailable(message)) = NvmlGpus::open(Some(&path)) else {
            panic!("a bogus library must be Unavailable");
        };
        assert!(message.contains(&*path.to_string_lossy()), "{message}");
        assert!(
            message.starts_with("NVML unavailable: could not load "),
            "{message}"
        );
    }

    #[test]
    fn device_faults_are_told_apart_from_driver_errors() {
        assert!(is_device_fault(&NvmlError::GpuLost));
        assert!(is_device_fault(&NvmlError::ResetRequired));
        assert!(!is_device_fault(&NvmlError::DriverNotLoaded));
        assert!(!is_device_fault(&NvmlError::LibRmVersionMismatch));
        assert!(!is_device_fault(&NvmlError::NoPermission));
        assert_eq!(
            device_error(3, &NvmlError::NoPermission).to_string(),
            "gpu 3: NVML: the current user does not have permission to perform this operation"
        );
    }

    #[test]
    fn unavailable_messages_for_init_failures() {
        let library = OsStr::new(DEFAULT_LIBRARY);
        assert_eq!(
            unavailable(library, &NvmlError::DriverNotLoaded),
            "NVML unavailable: loaded libnvidia-ml.so.1 but could not initialise it \
             (NVIDIA driver is not loaded); \
             install the NVIDIA driver or set gpus.fake = N to run on fake GPUs"
        );
        let missing = unavailable(
            library,
            &NvmlError::FailedToLoadSymbol("nvmlInit_v2".into()),
        );
        assert!(
            missing.contains("lacks a required function (nvmlInit_v2)"),
            "{missing}"
        );
    }

    #[test]
    fn unsupported_readings_are_unknown_and_faults_unhealthy() {
        let mut read = Readings::new(2);
        assert_eq!(read.optional("power", Ok(250_000_u32)), Some(250_000));
        assert_eq!(
            read.optional::<u32>("power", Err(NvmlError::NotSupported)),
            None
        );
        assert_eq!(
            read.optional::<u32>("fan", Err(NvmlError::NoPermission)),
            None
        );
        assert_eq!(
            read.fault, None,
            "unsupported or forbidden is not unhealthy"
        );
        assert_eq!(
            read.optional::<u32>("temperature", Err(NvmlError::GpuLost)),
            None
        );
        assert_eq!(
            read.optional::<u32>("power", Err(NvmlError::ResetRequired)),
            None
        );
        assert_eq!(
            read.fault.as_deref(),
            Some("nvml: temperature: device fell off the bus or has otherwise become inacessible"),
            "the first fault is the reason"
        );
    }

    #[test]
    fn process_memory_may_be_unknown() {
        use nvml_wrapper::struct_wrappers::device::ProcessInfo;
        let info = |used_gpu_memory| ProcessInfo {
            pid: 4242,
            used_gpu_memory,
            gpu_instance_id: None,
            compute_instance_id: None,
        };
        assert_eq!(
            process(info(UsedGpuMemory::Used(1 << 30))),
            GpuProcess {
                pid: 4242,
                used_memory_bytes: Some(1 << 30)
            }
        );
        assert_eq!(
            process(info(UsedGpuMemory::Unavailable)).used_memory_bytes,
            None
        );
    }

    /// Runs only on a host with an NVIDIA driver: `cargo test -- --ignored reads_real_gpus`.
    #[test]
    #[ignore = "needs an NVIDIA driver"]
    fn reads_real_gpus() {
        let gpus = NvmlGpus::open(None).expect("NVML on a GPU host");
        let inventory = gpus.inventory().expect("inventory");
        assert!(!inventory.is_empty());
        for (position, gpu) in inventory.iter().enumerate() {
            assert_eq!(gpu.index as usize, position);
            assert!(gpu.uuid.starts_with("GPU-"), "{gpu:?}");
            assert!(
                !gpu.name.is_empty() && gpu.memory_total_bytes > 0,
                "{gpu:?}"
            );
        }
        let status = gpus.status().expect("status");
        assert_eq!(status.len(), inventory.len());
        for (gpu, state) in inventory.iter().zip(&status) {
            assert_eq!(state.index, gpu.index);
            assert!(
                state.healthy && state.memory_used_bytes <= gpu.memory_total_bytes,
                "{state:?}"
            );
            assert_eq!(state.unhealthy_reason, None, "{state:?}");
            // Each reading is unknown or in range; a data-centre GPU reports them all.
            for percent in [
                state.utilization_gpu_percent,
                state.utilization_memory_percent,
            ] {
                assert!(percent.is_none_or(|p| p <= 100), "{state:?}");
            }
            assert!(state.power_milliwatts.is_some_and(|mw| mw > 0), "{state:?}");
            assert!(
                state
                    .temperature_celsius
                    .is_some_and(|c| (5..=110).contains(&c)),
                "{state:?}"
            );
            let processes = state.processes.as_ref().expect("compute processes listed");
            for p in processes {
                assert!(p.pid > 0, "{state:?}");
                assert!(
                    p.used_memory_bytes
                        .is_none_or(|b| b <= gpu.memory_total_bytes),
                    "{state:?}"
                );
            }
        }
        // The XID watcher thread started and registered (or logged why not) without
        // marking a healthy GPU unhealthy.
        std::thread::sleep(std::time::Duration::from_millis(1_500));
        for state in gpus.status().expect("status again") {
            assert!(state.healthy, "{state:?}");
        }
        let indices: Vec<u32> = inventory.iter().map(|gpu| gpu.index).collect();
        let device_ids = inventory.iter().map(|gpu| gpu.uuid.clone()).collect();
        assert_eq!(
            gpus.access(&indices),
            GpuAccess::DeviceRequest { device_ids }
        );
        println!("{inventory:#?}\n{status:#?}");
    }
}
