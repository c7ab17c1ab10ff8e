//! The `Host` adapter over sysinfo: CPU use since the previous call and memory; and, from
//! statvfs(2) on the checkpoint directory itself, the space of the file system holding it.
//! Not sysinfo's disk list: that leaves out tmpfs and network file systems (NFS, CIFS), where
//! shared checkpoints often live, and the directory's parent file system was measured instead.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::Duration;

use nightshift_common::HostFacts;
use sysinfo::System;

use super::Host;

/// How long a statvfs of the checkpoint volume may take before the facts leave it out: a
/// network mount whose server is gone can hang it, and the reconcile pass must go on.
const VOLUME_TIMEOUT: Duration = Duration::from_secs(1);

pub struct SysinfoHost {
    system: Mutex<Option<System>>,
    /// A statvfs still running past its timeout: no other is started until it returns.
    volume_busy: Arc<AtomicBool>,
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
        Self {
            system: Mutex::new(system),
            volume_busy: Arc::new(AtomicBool::new(false)),
        }
    }

    /// (free to unprivileged writers, total) bytes of the file system holding `volume` (or
    /// its nearest existing ancestor), on a thread of its own, given up after
    /// [`VOLUME_TIMEOUT`].
    fn volume_space(&self, volume: &Path) -> Option<(u64, u64)> {
        if self.volume_busy.swap(true, Ordering::AcqRel) {
            return None;
        }
        let path = existing_ancestor(volume);
        let busy = self.volume_busy.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("statvfs".into())
            .spawn(move || {
                let _ = tx.send(rustix::fs::statvfs(&path));
                busy.store(false, Ordering::Release);
            });
        if let Err(e) = spawned {
            self.volume_busy.store(false, Ordering::Release);
            tracing::warn!(error = %e, "cannot start a thread to read the checkpoint volume");
            return None;
        }
        match rx.recv_timeout(VOLUME_TIMEOUT) {
            Ok(Ok(s)) => Some((
                s.f_bavail.saturating_mul(s.f_frsize),
                s.f_blocks.saturating_mul(s.f_frsize),
            )),
            Ok(Err(e)) => {
                tracing::warn!(volume = %volume.display(), error = %e, "statvfs of the checkpoint volume failed");
                None
            }
            Err(_) => {
                tracing::warn!(volume = %volume.display(), timeout_s = VOLUME_TIMEOUT.as_secs_f64(), "statvfs of the checkpoint volume did not return in time");
                None
            }
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
        if let Some((free, total)) = self.volume_space(volume) {
            facts.checkpoint_volume_free_bytes = Some(free);
            facts.checkpoint_volume_total_bytes = Some(total);
        }
        facts
    }
}

/// The canonical path of `p`, or of its nearest existing ancestor (the work directory may
/// not exist before the first job).
fn existing_ancestor(p: &Path) -> PathBuf {
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

    /// A tmpfs (as a network file system) is missing from sysinfo's disk list; the volume is
    /// read from the directory itself, and matches what `df` says of it.
    #[test]
    fn reads_a_tmpfs_volume_as_df_does() {
        let shm = Path::new("/dev/shm");
        let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
        assert!(
            mounts.lines().any(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                f.get(1) == Some(&"/dev/shm") && f.get(2) == Some(&"tmpfs")
            }),
            "this test needs the tmpfs at /dev/shm:\n{mounts}"
        );
        let facts = SysinfoHost::new().facts(&shm.join("not-yet/created"));
        let df = std::process::Command::new("df")
            .args(["-B1", "--output=size", "/dev/shm"])
            .output()
            .expect("df");
        let size: u64 = String::from_utf8_lossy(&df.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .expect("df's size of /dev/shm");
        assert_eq!(facts.checkpoint_volume_total_bytes, Some(size), "{facts:?}");
        assert!(
            facts
                .checkpoint_volume_free_bytes
                .is_some_and(|f| f <= size)
        );
    }
}
