//! The replica's vLLM on the host model: its load, `/health`, `/sleep` (`mode=wait`) and
//! `/wake_up`, both idempotent as vLLM's are, `/is_sleeping`, and what it holds of each GPU.

use std::time::Duration;

use nightshift_planner::{Health, Moment, ReplicaProbe};

use crate::host::{Host, Replica};

/// The replica container's URL: the model binds no port, so any fixed string serves.
const REPLICA_URL: &str = "http://replica.model";

/// Why vLLM's `/sleep` or `/wake_up` did not do what it was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmError {
    /// No replica answers (none runs, or its model is loading or it is stopping).
    Unreachable,
    /// It answered an error.
    Failed,
    /// It did not answer within the call's timeout, which ran out then.
    TimedOut(Moment),
}

/// The replica's vLLM as its HTTP API answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VllmView {
    pub health: Health,
    /// `/is_sleeping` (vLLM's dev mode), when it answers.
    pub asleep: Option<bool>,
    /// Its weights offloaded (what its metrics' sleep state says, dev mode or not).
    pub sleeping: bool,
    pub running: f64,
    pub waiting: f64,
}

/// The replica container's vLLM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Vllm {
    /// Loading the model: `/health` refuses until then.
    Loading {
        healthy_at: Moment,
    },
    /// Healthy and awake.
    Up,
    /// Told to sleep: it answers then, its memory released.
    FallingAsleep {
        at: Moment,
    },
    Asleep,
    /// Told to wake: it answers then, awake.
    Waking {
        at: Moment,
    },
    /// Signalled: its container exits then (asleep, it holds only its context until then).
    Stopping {
        exits_at: Moment,
        asleep: bool,
    },
    Exited {
        asleep: bool,
    },
}

/// Requests in flight on the replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Load {
    /// One runs until then.
    Until(Moment),
    /// `total` at `since`, one finishing every `every`, at most `max_running` running at
    /// once (the rest wait).
    Queue {
        total: u64,
        max_running: u64,
        every: Duration,
        since: Moment,
    },
}

impl Load {
    /// (running, waiting) at `now`.
    pub(crate) fn at(&self, now: Moment) -> (u64, u64) {
        match *self {
            Load::Until(t) => (u64::from(now < t), 0),
            Load::Queue {
                total,
                max_running,
                every,
                since,
            } => {
                let left = if every.is_zero() {
                    0
                } else {
                    let done = now.duration_since(since).as_nanos() / every.as_nanos();
                    total.saturating_sub(u64::try_from(done).unwrap_or(u64::MAX))
                };
                let running = left.min(max_running);
                (running, left - running)
            }
        }
    }

    /// When the last request in flight is done.
    pub(crate) fn done(&self) -> Moment {
        match *self {
            Load::Until(t) => t,
            Load::Queue {
                total,
                every,
                since,
                ..
            } => since + every.saturating_mul(u32::try_from(total).unwrap_or(u32::MAX)),
        }
    }
}

impl Host {
    /// The replica has requests in flight until `until` (its share of the traffic, and how
    /// long the last of them takes).
    pub fn load(&mut self, until: Moment) {
        self.load = Load::Until(until);
    }

    /// `total` requests in flight from `now`, one finishing every `every`, at most
    /// `max_running` running at once and the rest waiting.
    pub fn queue(&mut self, total: u64, max_running: u64, every: Duration, now: Moment) {
        self.load = Load::Queue {
            total,
            max_running,
            every,
            since: now,
        };
    }

    /// The replica's vLLM as its API answers at `now`; `None` when no replica runs.
    pub fn vllm(&self, now: Moment) -> Option<VllmView> {
        let r = self.replica.as_ref()?;
        let (health, asleep) = match r.vllm {
            Vllm::Loading { .. } | Vllm::Stopping { .. } => (Health::Unreachable, None),
            Vllm::Up | Vllm::FallingAsleep { .. } => (Health::Healthy, Some(false)),
            Vllm::Asleep | Vllm::Waking { .. } => (Health::Healthy, Some(true)),
            Vllm::Exited { .. } => return None,
        };
        let (running, waiting) = if health == Health::Healthy {
            self.load.at(now)
        } else {
            (0, 0)
        };
        Some(VllmView {
            health,
            asleep: asleep.filter(|_| self.vllm_dev_mode),
            sleeping: asleep == Some(true),
            running: running as f64,
            waiting: waiting as f64,
        })
    }

    pub(crate) fn probe(&self, r: &Replica, now: Moment, ask: bool) -> ReplicaProbe {
        let mut probe = ReplicaProbe {
            container_id: r.ctr.container.id.clone(),
            url: Some(REPLICA_URL.to_owned()),
            health: None,
            requests_running: None,
            requests_waiting: None,
            is_sleeping: None,
            sleep_state: None,
        };
        if let Some(v) = self.vllm(now).filter(|_| ask) {
            probe.health = Some(v.health);
            probe.is_sleeping = v.asleep;
            if v.health == Health::Healthy {
                probe.requests_running = Some(v.running);
                probe.requests_waiting = Some(v.waiting);
            }
        }
        probe
    }

    /// What the replica holds of each of its GPUs at `now`.
    pub(crate) fn replica_holds(&self, r: &Replica, now: Moment) -> u64 {
        let t = &self.timings;
        match r.vllm {
            Vllm::Exited { .. } if !r.ctr.lingers(now, t.frees_after) => 0,
            Vllm::Asleep | Vllm::Stopping { asleep: true, .. } | Vllm::Exited { asleep: true } => {
                t.asleep_memory
            }
            _ => t.replica_memory,
        }
    }

    /// The replica's container runs and its vLLM is awake (loading, serving, or on its way
    /// to sleep or out): it counts towards the serving floor.
    pub fn replica_up(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| {
            matches!(
                r.vllm,
                Vllm::Loading { .. } | Vllm::Up | Vllm::FallingAsleep { .. }
            )
        })
    }

    /// The replica's vLLM is healthy and awake.
    pub fn replica_serving(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| r.vllm == Vllm::Up)
    }

    /// vLLM's `/sleep` (`mode=wait`: the requests in flight finish first), given `timeout`
    /// to answer: returns when it answers, its memory released.
    pub fn sleep(&mut self, now: Moment, timeout: Duration) -> Result<Moment, VllmError> {
        let fails = self.sleep_fails_until.is_some_and(|t| now < t);
        let (done, sleep) = (self.load.done(), self.timings.sleep);
        let r = self.replica.as_mut().ok_or(VllmError::Unreachable)?;
        match r.vllm {
            Vllm::Loading { .. } | Vllm::Stopping { .. } | Vllm::Exited { .. } => {
                Err(VllmError::Unreachable)
            }
            _ if fails => Err(VllmError::Failed),
            Vllm::Asleep => Ok(now),
            Vllm::FallingAsleep { at } => Ok(at),
            Vllm::Waking { .. } => Err(VllmError::Failed),
            Vllm::Up => {
                let at = done.max(now) + sleep;
                if at.duration_since(now) > timeout {
                    return Err(VllmError::TimedOut(now + timeout));
                }
                r.vllm = Vllm::FallingAsleep { at };
                Ok(at)
            }
        }
    }

    /// vLLM's `/wake_up`: returns when it answers, awake.
    pub fn wake(&mut self, now: Moment) -> Result<Moment, VllmError> {
        let fails = self.wake_fails;
        let wake = self.timings.wake;
        let r = self.replica.as_mut().ok_or(VllmError::Unreachable)?;
        match r.vllm {
            Vllm::Loading { .. } | Vllm::Stopping { .. } | Vllm::Exited { .. } => {
                Err(VllmError::Unreachable)
            }
            _ if fails => Err(VllmError::Failed),
            Vllm::Up => Ok(now),
            Vllm::Waking { at } => Ok(at),
            Vllm::FallingAsleep { .. } => Err(VllmError::Failed),
            Vllm::Asleep => {
                let at = now + wake;
                r.vllm = Vllm::Waking { at };
                Ok(at)
            }
        }
    }

    /// Whether the replica's vLLM sleeps (or is on its way back); `None` when no replica
    /// answers.
    pub fn replica_asleep(&self) -> Option<bool> {
        self.replica.as_ref().and_then(|r| match r.vllm {
            Vllm::Asleep | Vllm::Waking { .. } => Some(true),
            Vllm::Up | Vllm::FallingAsleep { .. } | Vllm::Loading { .. } => Some(false),
            Vllm::Stopping { .. } | Vllm::Exited { .. } => None,
        })
    }

    /// vLLM's `/sleep` answers an error until `until` (a vLLM started without
    /// `--enable-sleep-mode`, a failing CUDA call).
    pub fn fail_sleeps(&mut self, until: Moment) {
        self.sleep_fails_until = Some(until);
    }
}
