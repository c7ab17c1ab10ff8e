//! The fake vLLM: the [`ServingMetrics`] port over the replica container of the node's host
//! model. It answers `/health` once its model has loaded, drains its requests slowly,
//! sleeps once they are done (keeping some memory, or too much) and wakes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nightshift_common::ServingSignals;
use nightshift_hostmodel::{VllmError, VllmView};

use super::{World, lock, until};
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

    /// The replica's vLLM now, when it answers.
    fn view(&self) -> Option<VllmView> {
        let mut w = lock(&self.world);
        let now = w.settle();
        w.host.vllm(now).filter(|v| v.health == Health::Healthy)
    }
}

fn error(action: &'static str, url: &str, reason: &str) -> ServingError {
    ServingError {
        action,
        url: url.to_owned(),
        reason: reason.to_owned(),
    }
}

impl ServingMetrics for FakeVllm {
    async fn health(&self, _base_url: &str) -> Health {
        match self.view() {
            Some(_) => Health::Healthy,
            None => Health::Unreachable,
        }
    }

    async fn signals(&self, _base_url: &str) -> ServingSignals {
        let Some(v) = self.view() else {
            return ServingSignals::default();
        };
        ServingSignals {
            requests_running: Some(v.running),
            requests_waiting: Some(v.waiting),
            kv_cache_usage: Some(0.0),
            sleep_state: Some(
                if v.sleeping {
                    "weights_offloaded"
                } else {
                    "awake"
                }
                .to_owned(),
            ),
            ..ServingSignals::default()
        }
    }

    async fn sleep(&self, url: &str, level: u8, timeout: Duration) -> Result<(), ServingError> {
        if self.view().is_none() {
            return Err(error("sleep", url, "connection refused"));
        }
        let answer = {
            let mut w = lock(&self.world);
            let now = w.settle();
            w.vllm_calls.push(VllmCall::Sleep { level });
            w.host.sleep(now, timeout)
        };
        match answer {
            Ok(at) => {
                until(&self.world, Some(at)).await;
                lock(&self.world).settle();
                Ok(())
            }
            Err(VllmError::TimedOut(at)) => {
                until(&self.world, Some(at)).await;
                Err(error("sleep", url, "timed out"))
            }
            Err(VllmError::Failed) => Err(error("sleep", url, "500 Internal Server Error")),
            Err(VllmError::Unreachable) => Err(error("sleep", url, "connection refused")),
        }
    }

    async fn wake_up(&self, url: &str, _timeout: Duration) -> Result<(), ServingError> {
        if self.view().is_none() {
            return Err(error("wake up", url, "connection refused"));
        }
        let answer = {
            let mut w = lock(&self.world);
            let now = w.settle();
            w.vllm_calls.push(VllmCall::WakeUp);
            w.host.wake(now)
        };
        match answer {
            Ok(at) => {
                until(&self.world, Some(at)).await;
                lock(&self.world).settle();
                Ok(())
            }
            Err(VllmError::Failed) => Err(error("wake up", url, "500 Internal Server Error")),
            Err(VllmError::Unreachable | VllmError::TimedOut(_)) => {
                Err(error("wake up", url, "connection refused"))
            }
        }
    }

    async fn is_sleeping(&self, _base_url: &str) -> Option<bool> {
        self.view().and_then(|v| v.asleep)
    }
}
