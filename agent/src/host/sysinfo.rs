//! The `Host` adapter over sysinfo: CPU use since the previous call, memory, and the
//! filesystem holding the checkpoint directory (the mounted disk whose mount point is the
//! longest prefix of the directory's canonical path).

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use nightshift_common::HostFacts;
use sysinfo::{Disks, System};

use super::Host;

pub struct SysinfoHost {
    system: Mutex<Option<System>>,
    disks: Mutex<Option<Disks>>,
}

impl Default for SysinfoHost {
    fn default() -> Self {
        Self::new()
    }
}

impl SysinfoHost {
    /// Never fails: a part sysinfo cannot read is left out of the facts (logged once here).
    pub fn new() -> Self {
        let system = System::new()
            .inspect_err(|e| tracing::warn!(error = %e, "sysinfo cannot read cpu and memory"))
            .ok();
        let disks = Disks::new_with_refreshed_list()
            .inspect_err(|e| tracing::warn!(error = %e, "sysinfo cannot list disks"))
            .ok();
        Self {
            system: Mutex::new(system),
            disks: Mutex::new(disks),
        }
    }
}

impl Host for SysinfoHost {
    fn facts(&self, volume: &Path) -> HostFacts {
        let mut facts = HostFacts::default();
        if let Some(system) = self
            .system
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            system.refresh_cpu_usage();
            system.refresh_memory();
            facts.cpus = system.cpus().len() as u32;
            facts.cpu_usage_percent = f64::from(system.global_cpu_usage());
            facts.memory_total_bytes = system.total_memory();
            facts.memory_available_bytes = system.available_memory();
        }
        if let Some(disks) = self
            .disks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            disks.refresh(true);
            let path = existing_ancestor(volume);
            let disk = disks
                .iter()
                .filter(|d| path.starts_with(d.mount_point()))
                .max_by_key(|d| d.mount_point().as_os_str().len());
            if let Some(d) = disk {
                facts.checkpoint_volume_total_bytes = Some(d.total_space());
                facts.checkpoint_volume_free_bytes = Some(d.available_space());
            }
        }
        facts
    }
}

/// The canonical path of `p`, or of its nearest existing ancestor (the work directory may
/// not exist before the first job).
fn existing_ancestor(p: &Path) -> std::path::PathBuf {
    p.ancestors()
        .find_map(|a| a.canonicalize().ok())
        .unwrap_or_else(|| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_host() {
        let host = SysinfoHost::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let facts = host.facts(&dir.path().join("not-yet/created"));
        assert!(facts.cpus >= 1, "{facts:?}");
        assert!(facts.memory_total_bytes > 0, "{facts:?}");
        assert!(facts.memory_available_bytes <= facts.memory_total_bytes);
        let (free, total) = (
            facts
                .checkpoint_volume_free_bytes
                .expect("the temp dir's disk"),
            facts.checkpoint_volume_total_bytes.expect("total"),
        );
        assert!(free <= total && total > 0, "{facts:?}");
    }
}
