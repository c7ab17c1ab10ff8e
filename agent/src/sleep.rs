//! Sleep mode: the second way a replica gives its GPUs back. On lend, vLLM is put to sleep
//! (`/sleep?level=N&mode=wait`, so in-flight requests finish first); the agent confirms it
//! sleeps (`/is_sleeping`, else `vllm:engine_sleep_state`) and that NVML shows the memory
//! released down to `replica.sleep_max_used_bytes` per GPU. When it is not, the caller stops
//! the container as on the stop path. On reclaim, `/wake_up`, then the usual `/health` wait.
//! Each step is a recorded phase: `sleep_replica` and `confirm_free` on lend (plus
//! `sleep_insufficient` when falling back), `confirm_free` and `wake_replica` on reclaim.

use std::time::Duration;

use tokio::time::Instant;

use nightshift_common::{ReplicaState, SequenceKind};

use crate::engine::Engine;
use crate::gpus::Gpus;
use crate::reconcile::{POLL, ReconcileError, Reconciler};
use crate::serving::ServingMetrics;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    /// Puts the replica at `url` to sleep. True when it sleeps with its memory released
    /// (the replica is then `Sleeping`); false when the container must be stopped instead.
    pub(crate) async fn sleep_replica(&self, url: &str) -> bool {
        let t = Instant::now();
        let level = self.cfg.replica.sleep_level;
        let timeout = Duration::from_secs_f64(self.cfg.replica.sleep_timeout_s);
        if let Err(e) = self.serving.sleep(url, level, timeout).await {
            tracing::warn!(node = %self.node(), error = %e, "vllm sleep failed; stopping the replica instead");
            return false;
        }
        self.shared
            .record_phase(SequenceKind::Drain, "sleep_replica", t);
        self.confirm_asleep_and_free(url).await
    }

    /// Confirms that vLLM says it sleeps and that NVML shows its memory released; marks the
    /// replica `Sleeping` when both hold.
    pub(crate) async fn confirm_asleep_and_free(&self, url: &str) -> bool {
        let t = Instant::now();
        if !self.says_asleep(url).await {
            tracing::warn!(node = %self.node(), url, "vllm does not report sleeping; stopping the replica instead");
            return false;
        }
        let all: Vec<u32> = match self.gpus.inventory() {
            Ok(g) => g.iter().map(|g| g.index).collect(),
            Err(e) => {
                tracing::warn!(node = %self.node(), error = %e, "cannot list gpus; stopping the replica instead");
                return false;
            }
        };
        let limit = self.cfg.replica.sleep_max_used_bytes;
        let wait = Duration::from_secs_f64(self.cfg.replica.sleep_free_timeout_s);
        if let Err(e) = self.wait_free(&all, limit, wait).await {
            tracing::warn!(
                node = %self.node(), error = %e, limit_bytes = limit,
                "sleeping freed too little gpu memory; stopping the replica instead"
            );
            self.shared
                .record_phase(SequenceKind::Drain, "sleep_insufficient", t);
            return false;
        }
        self.shared.update(|o| o.replica = ReplicaState::Sleeping);
        self.shared
            .record_phase(SequenceKind::Drain, "confirm_free", t);
        tracing::info!(node = %self.node(), url, "replica sleeps; its gpus are lent");
        true
    }

    /// `/is_sleeping`, or the metrics page's `vllm:engine_sleep_state` when that endpoint
    /// does not answer.
    async fn says_asleep(&self, url: &str) -> bool {
        match self.serving.is_sleeping(url).await {
            Some(asleep) => asleep,
            None => self
                .serving
                .signals(url)
                .await
                .sleep_state
                .is_some_and(|s| s != "awake"),
        }
    }

    /// Wakes the replica and waits until it no longer reports sleeping.
    pub(crate) async fn wake_replica(&self, url: &str) -> Result<(), ReconcileError> {
        let t = Instant::now();
        let timeout = Duration::from_secs_f64(self.cfg.health_timeout_s);
        self.serving
            .wake_up(url, timeout)
            .await
            .map_err(ReconcileError::Wake)?;
        while self.says_asleep(url).await {
            if t.elapsed() >= timeout {
                return Err(ReconcileError::HealthTimeout(timeout));
            }
            tokio::time::sleep(POLL).await;
        }
        self.shared.update(|o| o.replica = ReplicaState::Starting);
        self.shared
            .record_phase(SequenceKind::Reclaim, "wake_replica", t);
        tracing::info!(node = %self.node(), url, "replica woke up");
        Ok(())
    }
}
