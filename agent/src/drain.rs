//! Drain: lend the node. Not-ready on the load-balancer endpoint, wait for vLLM to report no
//! running and no waiting request (or the drain timeout), stop the container, and confirm
//! through NVML that its GPUs are free. Only then may jobs start. With
//! `replica.reclaim = "sleep"` the container is put to sleep instead of stopped (see
//! `sleep.rs`), and stopped after all when sleeping frees too little memory.

use std::time::Duration;

use tokio::time::Instant;

use nightshift_common::{ReplicaState, SequenceKind};

use crate::config::ReclaimMode;
use crate::engine::{Container, ContainerState, Engine};
use crate::gpus::Gpus;
use crate::reconcile::{POLL, ReconcileError, Reconciler, replica};
use crate::serving::{Health, ServingMetrics};

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    pub(crate) async fn drain(&mut self, containers: &[Container]) -> Result<(), ReconcileError> {
        let running = replica(containers).filter(|c| c.state == ContainerState::Running);
        let Some(c) = running else {
            self.shared.set_ready(false);
            self.shared.update(|o| {
                o.replica = ReplicaState::Stopped;
                o.replica_url = None;
            });
            return Ok(());
        };
        let url = crate::replica::url(&self.cfg, c);
        if self.shared.observed().replica == ReplicaState::Sleeping {
            return Ok(());
        }
        let sleep_mode = self.cfg.replica.reclaim == ReclaimMode::Sleep;
        if sleep_mode
            && let Some(u) = &url
            && self.serving.is_sleeping(u).await == Some(true)
        {
            // Adopted after a restart: asleep already; the memory check still applies.
            self.shared.set_ready(false);
            if self.confirm_asleep_and_free(u).await {
                return Ok(());
            }
        }
        let t = Instant::now();
        self.shared.set_ready(false);
        self.shared.update(|o| {
            o.replica = ReplicaState::Draining;
            o.replica_url = url.clone();
        });
        if !self.wait_readiness_grace().await {
            tracing::info!(node = %self.node(), "drain abandoned: the node serves again");
            return Ok(());
        }
        self.shared
            .record_phase(SequenceKind::Drain, "mark_not_ready", t);

        let t = Instant::now();
        if let Some(url) = &url
            && !self.wait_in_flight(url).await
        {
            tracing::info!(node = %self.node(), "drain abandoned: the node serves again");
            return Ok(());
        }
        self.shared
            .record_phase(SequenceKind::Drain, "wait_in_flight", t);

        if sleep_mode
            && let Some(u) = &url
            && self.sleep_replica(u).await
        {
            return Ok(());
        }

        let t = Instant::now();
        let grace = Duration::from_secs_f64(self.cfg.replica.shutdown_timeout_s);
        self.engine.stop(&c.id, grace).await?;
        self.shared.update(|o| {
            o.replica = ReplicaState::Stopped;
            o.replica_url = None;
        });
        self.shared
            .record_phase(SequenceKind::Drain, "stop_replica", t);

        let t = Instant::now();
        let all: Vec<u32> = self.gpus.inventory()?.iter().map(|g| g.index).collect();
        self.confirm_free(&all, self.cfg.free_memory_bytes).await?;
        self.shared
            .record_phase(SequenceKind::Drain, "confirm_free", t);
        Ok(())
    }

    /// Waits out the readiness grace (the load balancer's time to notice not-ready), or
    /// returns false at once when the node should serve again meanwhile: a surge must not
    /// wait for the grace to end before the replica takes requests again.
    async fn wait_readiness_grace(&self) -> bool {
        let mut desired = self.shared.subscribe_desired();
        let grace = tokio::time::sleep(Duration::from_secs_f64(self.cfg.readiness_grace_s));
        tokio::pin!(grace);
        loop {
            if self.wants_serving() {
                return false;
            }
            tokio::select! {
                () = &mut grace => return true,
                // A new desired state; the poll also catches the fail-safe, which turns the
                // node back to serving without one.
                _ = desired.changed() => {}
                () = tokio::time::sleep(POLL) => {}
            }
        }
    }

    /// Waits until vLLM reports nothing running and nothing waiting, the drain timeout runs
    /// out, or vLLM is gone. Returns false when the node should serve again instead.
    async fn wait_in_flight(&self, url: &str) -> bool {
        let timeout = Duration::from_secs_f64(self.cfg.drain_timeout_s);
        let started = Instant::now();
        loop {
            if self.wants_serving() {
                return false;
            }
            let s = self.serving.signals(url).await;
            if s.requests_running == Some(0.0) && s.requests_waiting == Some(0.0) {
                return true;
            }
            if s.requests_running.is_none() && self.serving.health(url).await == Health::Unreachable
            {
                tracing::warn!(node = %self.node(), "replica unreachable while draining; stopping it");
                return true;
            }
            if started.elapsed() >= timeout {
                tracing::warn!(
                    node = %self.node(), running = ?s.requests_running, waiting = ?s.requests_waiting,
                    "drain timeout: stopping the replica with requests in flight"
                );
                return true;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}
