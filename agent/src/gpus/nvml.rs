//! `NvmlGpus`: the host's real GPUs, read through NVML.
//!
//! nvml-wrapper loads `libnvidia-ml.so.1` at run time, so the agent builds and starts on a
//! host without a driver; [`NvmlGpus::open`] then fails with a message that says which
//! library it looked for and why it could not use it. Every call is a blocking FFI call:
//! callers on an async runtime wrap them in `spawn_blocking`. A GPU that has fallen off the
//! bus or needs a reset is reported unhealthy rather than failing the whole status (XID
//! events are later work).

use std::ffi::OsStr;
use std::path::Path;

use nightshift_common::{GpuInfo, GpuStatus};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use super::{GpuError, Gpus};
use crate::engine::GpuAccess;

/// The library NVML is loaded from unless a path is given.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// What to do when NVML cannot be used, appended to [`GpuError::Unavailable`] messages.
const REMEDY: &str = "install the NVIDIA driver or set gpus.fake = N to run on fake GPUs";

#[derive(Debug)]
pub struct NvmlGpus {
    nvml: Nvml,
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
        Ok(Self { nvml })
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
            .and_then(|device| device.memory_info())
            .map(|memory| memory.used);
        match used {
            Ok(memory_used_bytes) => Ok(GpuStatus {
                index,
                memory_used_bytes,
                healthy: true,
            }),
            Err(error) if is_device_fault(&error) => {
                tracing::warn!(gpu.index = index, %error, "gpu is unhealthy");
                Ok(GpuStatus {
                    index,
                    memory_used_bytes: 0,
                    healthy: false,
                })
            }
            Err(error) => Err(device_error(index, &error)),
        }
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
