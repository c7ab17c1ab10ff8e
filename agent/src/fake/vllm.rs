//! The fake vLLM: the replica container's server. It answers `/health` once its model has
//! loaded, drains its requests slowly, sleeps (keeping some memory, or too much) and wakes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nightshift_common::ServingSignals;
use tokio::time::Instant;

use super::{World, lock};
use crate::serving::{Health, ServingError, ServingMetrics};

/// A call made through the [`ServingMetrics`] port that changes vLLM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmCall {
    Sleep { level: u8 },
    WakeUp,
}

/// The [`ServingMetrics`] port of a [`super::FakeNode`]: whatever the URL, it is the
/// replica container of the node.
pub struct FakeVllm {
    world: Arc<Mutex<World>>,
}

impl FakeVllm {
    pub(super) fn new(world: Arc<Mutex<World>>) -> Self {
        Self { world }
    }

    /// Whether the replica runs and its model has loaded.
    fn up(&self) -> bool {
        let mut w = lock(&self.world);
        let healthy_after = w.vllm.healthy_after;
        w.replica()
            .is_some_and(|c| Instant::now() >= c.started_at + healthy_after)
    }

    fn unreachable(action: &'static str, url: &str) -> ServingError {
        ServingError {
            action,
            url: url.to_owned(),
            reason: "connection refused".to_owned(),
        }
    }
}

impl ServingMetrics for FakeVllm {
    async fn health(&self, _base_url: &str) -> Health {
        if self.up() {
            Health::Healthy
        } else {
            Health::Unreachable
        }
    }

    async fn signals(&self, _base_url: &str) -> ServingSignals {
        if !self.up() {
            return ServingSignals::default();
        }
        let mut w = lock(&self.world);
        let (left, max_running) = match w.load {
            Some(load) => (load.left(Instant::now()), load.max_running),
            None => (0, 0),
        };
        let asleep = w.replica().is_some_and(|c| c.asleep);
        let running = left.min(max_running);
        ServingSignals {
            requests_running: Some(running as f64),
            requests_waiting: Some((left - running) as f64),
            kv_cache_usage: Some(0.0),
            sleep_state: Some(if asleep { "weights_offloaded" } else { "awake" }.to_owned()),
            ..ServingSignals::default()
        }
    }

    async fn sleep(&self, url: &str, level: u8, timeout: Duration) -> Result<(), ServingError> {
        if !self.up() {
            return Err(Self::unreachable("sleep", url));
        }
        // `mode=wait`: in-flight requests finish first.
        let done = {
            let mut w = lock(&self.world);
            w.vllm_calls.push(VllmCall::Sleep { level });
            if w.vllm.sleep_fails {
                return Err(ServingError {
                    action: "sleep",
                    url: url.to_owned(),
                    reason: "500 Internal Server Error".to_owned(),
                });
            }
            w.load
                .map(|l| l.since + l.every * u32::try_from(l.total).unwrap_or(u32::MAX))
        };
        if let Some(done) = done.filter(|d| *d > Instant::now()) {
            if done > Instant::now() + timeout {
                tokio::time::sleep(timeout).await;
                return Err(ServingError {
                    action: "sleep",
                    url: url.to_owned(),
                    reason: "timed out".to_owned(),
                });
            }
            tokio::time::sleep_until(done).await;
        }
        if let Some(c) = lock(&self.world).replica() {
            c.asleep = true;
        }
        Ok(())
    }

    async fn wake_up(&self, url: &str, _timeout: Duration) -> Result<(), ServingError> {
        if !self.up() {
            return Err(Self::unreachable("wake up", url));
        }
        let mut w = lock(&self.world);
        w.vllm_calls.push(VllmCall::WakeUp);
        if w.vllm.wake_fails {
            return Err(ServingError {
                action: "wake up",
                url: url.to_owned(),
                reason: "500 Internal Server Error".to_owned(),
            });
        }
        if let Some(c) = w.replica() {
            c.asleep = false;
        }
        Ok(())
    }

    async fn is_sleeping(&self, _base_url: &str) -> Option<bool> {
        if !self.up() || !lock(&self.world).vllm.dev_mode {
            return None;
        }
        lock(&self.world).replica().map(|c| c.asleep)
    }
}
