//! Reclaim: serve again. Job containers have already been sent their checkpoint signal and
//! stopped (see `Reconciler::stop_unleased`); confirm the GPUs are free, start vLLM, wait
//! for `/health`, and mark the replica ready.

use std::time::Duration;

use tokio::time::Instant;

use nightshift_common::{ReplicaState, SequenceKind};

use crate::engine::{Container, ContainerState, Engine};
use crate::gpus::Gpus;
use crate::reconcile::{POLL, ReconcileError, Reconciler, jobs, replica};
use crate::serving::{Health, ServingMetrics};

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    pub(crate) async fn reclaim(&mut self, containers: &[Container]) -> Result<(), ReconcileError> {
        if jobs(containers).any(|c| c.state == ContainerState::Running) {
            // A job is still on its way out; the next pass starts the replica.
            return Ok(());
        }
        let running = replica(containers).filter(|c| c.state == ContainerState::Running);
        if let Some(c) = running {
            let url = crate::replica::url(&self.cfg, c);
            let state = self.shared.observed().replica;
            if state == ReplicaState::Serving || state == ReplicaState::Draining {
                // Serving already, or a drain that was called off: ready again.
                self.shared.update(|o| {
                    o.replica = ReplicaState::Serving;
                    o.replica_url = url;
                });
                self.shared.set_ready(true);
                return Ok(());
            }
            // Sleeping (lent in sleep mode, or adopted asleep after a restart): wake it.
            if let Some(u) = &url
                && (state == ReplicaState::Sleeping
                    || self.serving.is_sleeping(u).await == Some(true))
            {
                let all: Vec<u32> = self.gpus.inventory()?.iter().map(|g| g.index).collect();
                let t = Instant::now();
                self.confirm_free(&all, self.cfg.replica.sleep_max_used_bytes)
                    .await?;
                self.shared
                    .record_phase(SequenceKind::Reclaim, "confirm_free", t);
                self.wake_replica(u).await?;
            }
            // Started earlier or adopted after a restart: wait for it to be healthy.
            self.shared.update(|o| {
                o.replica = ReplicaState::Starting;
                o.replica_url = url.clone();
            });
            return self.become_ready(url.as_deref()).await;
        }

        let t = Instant::now();
        let all: Vec<u32> = self.gpus.inventory()?.iter().map(|g| g.index).collect();
        self.confirm_free(&all, self.cfg.free_memory_bytes).await?;
        self.shared
            .record_phase(SequenceKind::Reclaim, "confirm_free", t);

        let t = Instant::now();
        let spec = crate::replica::container_spec(&self.cfg, self.node(), self.gpus.access(&all));
        let id = self.engine.run(&spec).await.inspect_err(|_| {
            self.shared.update(|o| o.replica = ReplicaState::Failed);
        })?;
        let c = self.engine.inspect(&id).await?;
        let url = crate::replica::url(&self.cfg, &c);
        self.shared.update(|o| {
            o.replica = ReplicaState::Starting;
            o.replica_url = url.clone();
        });
        self.shared
            .record_phase(SequenceKind::Reclaim, "start_replica", t);
        tracing::info!(node = %self.node(), container = %id, url = ?url, "replica started");
        self.become_ready(url.as_deref()).await
    }

    /// Waits for `/health` to answer 200, then marks the replica ready.
    async fn become_ready(&self, url: Option<&str>) -> Result<(), ReconcileError> {
        let t = Instant::now();
        let timeout = Duration::from_secs_f64(self.cfg.health_timeout_s);
        let Some(url) = url else {
            self.shared.update(|o| o.replica = ReplicaState::Failed);
            return Err(ReconcileError::HealthTimeout(Duration::ZERO));
        };
        while self.serving.health(url).await != Health::Healthy {
            if t.elapsed() >= timeout {
                self.shared.update(|o| o.replica = ReplicaState::Failed);
                return Err(ReconcileError::HealthTimeout(timeout));
            }
            tokio::time::sleep(POLL).await;
        }
        self.shared
            .record_phase(SequenceKind::Reclaim, "wait_health", t);
        self.shared.update(|o| o.replica = ReplicaState::Serving);
        self.shared.set_ready(true);
        Ok(())
    }

    /// Before the coordinator has answered: a replica that runs and is healthy is adopted as
    /// serving.
    pub(crate) async fn adopt_replica(&self, containers: &[Container]) {
        let Some(c) = replica(containers).filter(|c| c.state == ContainerState::Running) else {
            return;
        };
        let url = crate::replica::url(&self.cfg, c);
        let healthy = match &url {
            Some(u) => self.serving.health(u).await == Health::Healthy,
            None => false,
        };
        let asleep = match &url {
            Some(u) if healthy => self.serving.is_sleeping(u).await == Some(true),
            _ => false,
        };
        self.shared.update(|o| {
            o.replica = match (healthy, asleep) {
                (true, true) => ReplicaState::Sleeping,
                (true, false) => ReplicaState::Serving,
                _ => ReplicaState::Starting,
            };
            o.replica_url = url;
        });
        self.shared.set_ready(healthy && !asleep);
    }
}
