//! The `Host` port: the host's own resources (CPU, memory, the checkpoint volume), reported
//! in heartbeats and checked before a job starts.
//!
//! `host/sysinfo.rs` reads them through sysinfo; [`FixedHost`] is a fake whose facts a test
//! sets.

pub mod sysinfo;

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use nightshift_common::HostFacts;

pub trait Host: Send + Sync + 'static {
    /// The facts now; `volume` is the directory whose filesystem holds job checkpoints.
    fn facts(&self, volume: &Path) -> HostFacts;
}

/// Facts a test sets.
#[derive(Debug, Default)]
pub struct FixedHost(Mutex<HostFacts>);

impl FixedHost {
    pub fn new(facts: HostFacts) -> Self {
        Self(Mutex::new(facts))
    }

    pub fn set(&self, facts: HostFacts) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = facts;
    }
}

impl Host for FixedHost {
    fn facts(&self, _volume: &Path) -> HostFacts {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
