//! The coordinator's state behind its HTTP shell: the decision core, the durable store, and a
//! version channel per node that wakes agents long-polling for their desired state.
//!
//! [`Cluster::apply`] is the only way in: it runs one core call with the current time,
//! writes every change the core reports to the store, and only then publishes new desired
//! versions, so an agent never acts on a decision that a crash could forget.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use nightshift_common::UnixMillis;
use nightshift_core::{Core, CoreConfig, CoreError, Effect};
use tokio::sync::watch;

use crate::config::AccountingConfig;
use crate::pipelines::Pipelines;
use crate::store::{Changes, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("state not saved: {0}")]
    Store(#[from] StoreError),
    #[error("pipelines cannot be rebuilt from the store: {0}")]
    Pipelines(String),
}

struct Inner {
    core: Core,
    store: Store,
    pipelines: Pipelines,
}

pub struct Cluster {
    inner: Mutex<Inner>,
    config: CoreConfig,
    /// What a GPU-hour is worth, for reports.
    pub accounting: AccountingConfig,
    pub metrics: crate::metrics::Metrics,
    versions: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Each agent's base URL, as it last said (register, heartbeats): an address book of the
    /// shell, not a decision, so the core does not hold it.
    agent_urls: Mutex<HashMap<String, String>>,
}

/// Wall-clock milliseconds since the Unix epoch: the only clock the core is given.
pub fn now_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Cluster {
    /// Opens the store and rebuilds the core from it.
    pub fn open(
        config: CoreConfig,
        accounting: AccountingConfig,
        store: Store,
    ) -> Result<Self, StoreError> {
        let snapshot = store.load()?;
        let core = Core::restore(config.clone(), snapshot, now_ms());
        let pipelines = Pipelines::restore(store.load_pipelines()?).map_err(|reason| {
            StoreError::Pipelines {
                path: store.path().to_owned(),
                reason,
            }
        })?;
        let versions = core
            .node_names()
            .filter_map(|n| {
                Some((
                    n.to_owned(),
                    watch::channel(core.node(n)?.desired_version).0,
                ))
            })
            .collect();
        Ok(Self {
            inner: Mutex::new(Inner {
                core,
                store,
                pipelines,
            }),
            config,
            accounting,
            metrics: crate::metrics::Metrics::default(),
            versions: Mutex::new(versions),
            agent_urls: Mutex::new(HashMap::new()),
        })
    }

    /// Notes where `node`'s agent answers.
    pub fn note_agent_url(&self, node: &str, url: &str) {
        let mut urls = self.agent_urls.lock().unwrap_or_else(|p| p.into_inner());
        if urls.get(node).map(String::as_str) != Some(url) {
            urls.insert(node.to_owned(), url.to_owned());
        }
    }

    /// Where `node`'s agent answers, once it has said.
    pub fn agent_url(&self, node: &str) -> Option<String> {
        self.agent_urls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .cloned()
    }

    /// Runs `f` on the core at the current time, persists what changed, then wakes the agents
    /// whose desired state moved. If saving fails, the core is rebuilt from the store, so
    /// memory never runs ahead of disk.
    pub fn apply<T>(
        &self,
        f: impl FnOnce(&mut Core, UnixMillis) -> Result<T, CoreError>,
    ) -> Result<T, ApplyError> {
        self.apply_with_pipelines(|core, _, now| f(core, now))
    }

    /// [`Cluster::apply`] with the pipeline runs at hand too. After `f`, every run is fed the
    /// jobs that ended and the time, and the steps it decides to start are submitted, all in
    /// the same batch of changes.
    pub fn apply_with_pipelines<T>(
        &self,
        f: impl FnOnce(&mut Core, &mut Pipelines, UnixMillis) -> Result<T, CoreError>,
    ) -> Result<T, ApplyError> {
        let now = now_ms();
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let inner = &mut *guard;
        let result = f(&mut inner.core, &mut inner.pipelines, now);
        inner.pipelines.drive(&mut inner.core, now);
        let effects = inner.core.poll_effects();
        let pipeline_changes = inner.pipelines.take_changes();
        if effects.is_empty() && pipeline_changes.is_empty() {
            return Ok(result?);
        }
        let mut changes = Changes {
            counters: Some(inner.core.next_ids()),
            pipelines: pipeline_changes,
            ..Default::default()
        };
        let mut moved = Vec::new();
        for effect in &effects {
            match effect {
                Effect::JobChanged(id) => changes.jobs.extend(inner.core.job(*id)),
                Effect::LeaseEnded(usage) => changes.usage.push(usage.clone()),
                Effect::ProfileChanged(service) => {
                    if let Some(p) = inner.core.profile(service) {
                        changes.profiles.push((service.clone(), p.clone()));
                    }
                }
                Effect::NodeChanged(name) => {
                    if let Some(n) = inner.core.node_snapshot(name) {
                        moved.push((name.clone(), n.desired_version));
                        changes.nodes.push(n);
                    }
                }
            }
        }
        if let Err(e) = inner.store.write(&changes) {
            tracing::error!(error = %e, "saving state failed; reloading the core from the store");
            let snapshot = inner.store.load()?;
            inner.core = Core::restore(self.config.clone(), snapshot, now);
            inner.pipelines =
                Pipelines::restore(inner.store.load_pipelines()?).map_err(ApplyError::Pipelines)?;
            return Err(e.into());
        }
        drop(guard);
        let mut versions = self.versions.lock().unwrap_or_else(|p| p.into_inner());
        for (node, version) in moved {
            versions
                .entry(node)
                .and_modify(|tx| {
                    tx.send_if_modified(|v| std::mem::replace(v, version) != version);
                })
                .or_insert_with(|| watch::channel(version).0);
        }
        Ok(result?)
    }

    /// Reads the core at the current time.
    pub fn read<T>(&self, f: impl FnOnce(&Core, UnixMillis) -> T) -> T {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&inner.core, now_ms())
    }

    /// Reads the core and the pipeline runs.
    pub fn read_pipelines<T>(&self, f: impl FnOnce(&Core, &Pipelines) -> T) -> T {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&inner.core, &inner.pipelines)
    }

    /// A receiver of `node`'s desired-state version, or `None` for an unknown node.
    pub fn watch(&self, node: &str) -> Option<watch::Receiver<u64>> {
        self.versions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .map(|tx| tx.subscribe())
    }

    /// Reads the store (accounting queries).
    pub fn read_store<T>(&self, f: impl FnOnce(&Store, &Core, UnixMillis) -> T) -> T {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&inner.store, &inner.core, now_ms())
    }

    /// When the core next wants a tick.
    pub fn next_deadline(&self) -> Option<UnixMillis> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let core = inner.core.next_deadline();
        core.into_iter()
            .chain(inner.pipelines.next_deadline())
            .min()
    }
}
