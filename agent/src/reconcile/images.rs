//! The executor's images: which of the leases' images the host lacks (pinned to their
//! digests when it has them), the pulls in the background and what they end in, room made on
//! the engine's disk by removing job images no one needs, the replica's own image.

use std::collections::BTreeSet;

use nightshift_common::{LeaseGrant, SequenceKind};
use nightshift_planner::images::HostImage;
use tokio::time::Instant;

use crate::engine::registry::RegistryAuth;
use crate::engine::{Container, Engine, EngineError};
use crate::gpus::Gpus;
use crate::host::Host;
use crate::serving::ServingMetrics;

use super::Reconciler;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    /// Of `images`, those not on the host; those there are pinned to their registry digest
    /// when a registry knows them.
    pub(super) async fn missing_images(
        &mut self,
        images: &[String],
    ) -> Result<BTreeSet<String>, EngineError> {
        let mut missing = BTreeSet::new();
        self.mem.images.new_round();
        for image in images {
            match self.engine.image(image).await? {
                Some(info) => self.mem.images.found(image, &info.id, info.pinned(image)),
                None => {
                    missing.insert(image.clone());
                }
            }
        }
        Ok(missing)
    }

    /// Starts pulling `image` in the background, unless that is under way: the replica
    /// serves meanwhile, and the pass goes on planning (a new desired state is acted on at
    /// once), looking again a poll later. See [`Reconciler::reap_pulls`].
    pub(super) async fn start_pull(&mut self, image: &str) {
        if self.pulls.contains_key(image) {
            return;
        }
        self.free_image_space().await;
        let engine = self.engine.clone();
        let auth = self.auth_for(image);
        let owned = image.to_owned();
        let task = tokio::spawn(async move { engine.pull(&owned, auth?.as_ref()).await });
        self.pulls.insert(image.to_owned(), (Instant::now(), task));
    }

    /// Takes in the pulls that ended: a pulled image is pinned and recorded (`pull_image`);
    /// when the registry would not give it, each of `leases` waiting for it fails to start,
    /// with the registry and its reason, and the node's other leases go on. A pull the engine
    /// could not even try is tried again.
    pub(super) async fn reap_pulls(&mut self, leases: &[LeaseGrant], containers: &[Container]) {
        let done: Vec<String> = self
            .pulls
            .iter()
            .filter(|(_, (_, task))| task.is_finished())
            .map(|(image, _)| image.clone())
            .collect();
        for image in done {
            let Some((began, task)) = self.pulls.remove(&image) else {
                continue;
            };
            let result = task
                .await
                .unwrap_or_else(|e| Err(EngineError::Other(format!("the pull of {image}: {e}"))));
            match result {
                Ok(info) => {
                    self.mem
                        .images
                        .pulled(&image, &info.id, info.pinned(&image));
                    self.shared
                        .record_phase(SequenceKind::Drain, "pull_image", began);
                }
                Err(e @ EngineError::PullFailed { .. }) => {
                    let reason = e.to_string();
                    let failed = self.mem.pull_failed(leases, containers, &image, &reason);
                    tracing::warn!(
                        node = %self.node(), image, leases = ?failed, reason = %reason,
                        "pulling an image failed: the leases waiting for it cannot start"
                    );
                }
                Err(e) => {
                    tracing::warn!(node = %self.node(), image, error = %e, "pulling an image failed; trying again");
                }
            }
        }
    }

    /// While the engine's data root has less free space than `image_min_free_bytes`,
    /// removes the job images this agent pulled that no container uses and no waiting lease
    /// needs, oldest first; never the replica's. Failures are logged: a pull goes on anyway.
    pub(super) async fn free_image_space(&mut self) {
        let Some(floor) = self.cfg.registry.image_min_free_bytes else {
            return;
        };
        let root = match self.engine.data_root().await {
            Ok(Some(root)) => root,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(node = %self.node(), error = %e, "cannot find the engine's data root");
                return;
            }
        };
        let free = |host: &dyn Host| host.facts(&root).checkpoint_volume_free_bytes;
        if free(&*self.host).is_none_or(|f| f >= floor) {
            return;
        }
        let replica = match self.engine.image(&self.cfg.replica.image).await {
            Ok(found) => found.map(|i| i.id),
            Err(_) => return,
        };
        let images = match self.engine.images().await {
            Ok(images) => images,
            Err(e) => {
                tracing::warn!(node = %self.node(), error = %e, "cannot list images");
                return;
            }
        };
        let host: Vec<HostImage<'_>> = images
            .iter()
            .map(|i| HostImage {
                id: &i.id,
                created: i.created,
                in_use: i.in_use,
            })
            .collect();
        let removable: Vec<String> = self
            .mem
            .images
            .removable(&host, replica.as_deref())
            .into_iter()
            .map(str::to_owned)
            .collect();
        for id in removable {
            let Some(image) = images.iter().find(|i| i.id == id) else {
                continue;
            };
            let Some(left) = free(&*self.host).filter(|f| *f < floor) else {
                break;
            };
            match self.engine.remove_image(&image.id).await {
                Ok(()) => {
                    tracing::info!(
                        node = %self.node(), image.id = %image.id, digests = ?image.repo_digests,
                        free_bytes = left, floor_bytes = floor,
                        "removed an unused job image: the engine's disk is low"
                    );
                    self.mem.images.removed(&image.id);
                }
                Err(e) => {
                    tracing::warn!(node = %self.node(), image.id = %image.id, error = %e, "removing an unused job image failed")
                }
            }
        }
    }

    /// Pulls the replica's image when the host lacks it.
    pub(super) async fn ensure_replica_image(&self) -> Result<(), EngineError> {
        let image = &self.cfg.replica.image;
        if self.engine.image(image).await?.is_some() {
            return Ok(());
        }
        let auth = self.auth_for(image)?;
        self.engine.pull(image, auth.as_ref()).await.map(|_| ())
    }

    /// The credentials to pull `image` with; a credentials file that cannot be read fails
    /// the pull, naming the registry.
    pub(super) fn auth_for(&self, image: &str) -> Result<Option<RegistryAuth>, EngineError> {
        self.cfg
            .registry
            .auth_for(image)
            .map_err(|e| EngineError::PullFailed {
                image: image.to_owned(),
                registry: crate::engine::registry::registry_of(image),
                reason: format!("reading the registry credentials: {e}"),
            })
    }
}
