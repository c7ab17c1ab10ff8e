//! The fleet's physical model: what a replica can serve, how long its transitions take, and
//! the SLO it is held to. Defaults are grounded in published figures (docs/SIMULATOR.md and
//! notes on vLLM §4–5); every one can be changed.

/// One vLLM replica (one node, 4 GPUs) as a queueing server.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaModel {
    /// Sequences decoded at once (vLLM's default `max_num_seqs` is 256).
    pub max_seqs: f64,
    /// Mean output tokens per request (NVIDIA Dynamo planner's default OSL is 150).
    pub output_tokens: f64,
    /// Inter-token latency at full batch, ms (Dynamo's default ITL target is 50 ms).
    pub itl_ms: f64,
    /// Prefill time of a request, ms (Dynamo's default TTFT target is 500 ms).
    pub prefill_ms: f64,
    /// The load one replica is sized for: a replica is "needed" per this much of its capacity.
    pub target_utilisation: f64,
    /// The queue-wait (time to first token beyond prefill) a minute's requests may see on
    /// average, ms.
    pub queue_wait_target_ms: f64,
}

impl Default for ReplicaModel {
    fn default() -> Self {
        Self {
            max_seqs: 256.0,
            output_tokens: 150.0,
            itl_ms: 50.0,
            prefill_ms: 500.0,
            target_utilisation: 0.8,
            queue_wait_target_ms: 2_000.0,
        }
    }
}

impl ReplicaModel {
    /// Seconds a request occupies a sequence slot.
    pub fn latency_s(&self) -> f64 {
        (self.prefill_ms + self.output_tokens * self.itl_ms) / 1_000.0
    }

    /// Requests per second one replica completes at full batch (Little's law).
    pub fn capacity_rps(&self) -> f64 {
        self.max_seqs / self.latency_s()
    }

    /// Output tokens per second at full batch.
    pub fn token_throughput(&self) -> f64 {
        self.capacity_rps() * self.output_tokens
    }

    /// Replicas the load `rate` (requests/s) needs, at least `floor`.
    pub fn needed(&self, rate: f64, floor: u32) -> u32 {
        let per = self.capacity_rps() * self.target_utilisation;
        ((rate / per).ceil() as u32).max(floor)
    }
}

/// How a replica gives its GPUs up and gets them back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Stop the container; serving again is a cold start.
    Stop,
    /// vLLM sleep level 1; serving again is a wake.
    Sleep,
}

/// Transition times, seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Lifecycle {
    pub release: Release,
    /// Launch to ready of a 70B replica on 4 GPUs with a cold compile cache (about 225 s,
    /// measured for Llama-3.1-70B TP=4 on vLLM 0.19.1).
    pub cold_start_s: u64,
    /// Level-1 wake of a large model (3–6 s published; the upper end).
    pub wake_s: u64,
    /// Falling asleep (about 5.7 s measured for a 3B model).
    pub sleep_s: u64,
    /// Stopping the container and confirming the GPUs free.
    pub stop_s: u64,
    /// Longest a drain waits for in-flight requests (they take `latency_s` on average).
    pub drain_timeout_s: u64,
    /// Time a job needs to save a checkpoint when signalled (bounded by its grace period).
    pub checkpoint_save_s: u64,
    /// How long a crashed agent stays away before it registers again.
    pub agent_restart_s: u64,
    /// How long a partition lasts (longer than the lease TTL, so leases expire).
    pub partition_s: u64,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            release: Release::Stop,
            cold_start_s: 225,
            wake_s: 6,
            sleep_s: 6,
            stop_s: 10,
            drain_timeout_s: 60,
            checkpoint_save_s: 20,
            agent_restart_s: 15,
            partition_s: 120,
        }
    }
}

impl Lifecycle {
    /// From released GPUs to a ready replica.
    pub fn start_s(&self) -> u64 {
        match self.release {
            Release::Stop => self.cold_start_s,
            Release::Sleep => self.wake_s,
        }
    }

    /// From a drained replica to free GPUs.
    pub fn release_s(&self) -> u64 {
        match self.release {
            Release::Stop => self.stop_s,
            Release::Sleep => self.sleep_s,
        }
    }
}
