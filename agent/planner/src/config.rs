//! What the planner reads of the agent's configuration: its timeouts, limits and modes, as
//! plain values. The agent builds a [`PlanConfig`] from its `agent.toml`
//! (`AgentConfig::plan_config`); the planner knows nothing of files or environment.

use std::path::PathBuf;
use std::time::Duration;

/// The planner's configuration. Each field names the `agent.toml` key it comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanConfig {
    /// `readiness_grace_s`: after turning not-ready, how long before watching the queue.
    pub readiness_grace: Duration,
    /// `drain_timeout_s`: longest wait for in-flight requests before the replica is stopped.
    pub drain_timeout: Duration,
    /// `free_timeout_s`: longest wait for NVML to show GPUs free.
    pub free_timeout: Duration,
    /// `free_memory_bytes`: a GPU counts as free with at most this much memory in use.
    pub free_memory_bytes: u64,
    /// `health_timeout_s`: longest wait for a starting (or waking) replica to be healthy.
    pub health_timeout: Duration,
    /// `checkpoint_min_free_bytes`: no job starts while its checkpoint volume has less free.
    pub checkpoint_min_free_bytes: u64,
    /// `work_dir`: where the checkpoints live (named when the volume is short).
    pub work_dir: PathBuf,
    /// `replica.shutdown_timeout_s`: between the replica's SIGTERM and its kill.
    pub replica_stop_grace: Duration,
    /// `replica.reclaim`: how the replica gives its GPUs back.
    pub reclaim: ReclaimMode,
    /// `replica.sleep_max_used_bytes`: the most a sleeping replica may keep on each GPU.
    pub sleep_max_used_bytes: u64,
    /// `replica.sleep_free_timeout_s`: how long NVML may take to show a sleep's memory gone.
    pub sleep_free_timeout: Duration,
    /// `failsafe.enabled`: stop the jobs and serve when the coordinator is silent too long.
    pub failsafe: bool,
    /// `failsafe.silence_s`: the silence the fail-safe allows; the lease TTL when `None`.
    pub failsafe_silence: Option<Duration>,
}

/// How the replica gives its GPUs back when the node is lent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReclaimMode {
    /// Stop the container; start it again on reclaim.
    #[default]
    Stop,
    /// Put vLLM to sleep; wake it on reclaim.
    Sleep,
}

/// The defaults of `agent.toml` (the agent checks that they agree).
impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            readiness_grace: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(120),
            free_timeout: Duration::from_secs(30),
            free_memory_bytes: 1 << 30,
            health_timeout: Duration::from_secs(900),
            checkpoint_min_free_bytes: 1 << 30,
            work_dir: PathBuf::from("/var/lib/nightshift/agent"),
            replica_stop_grace: Duration::from_secs(60),
            reclaim: ReclaimMode::Stop,
            sleep_max_used_bytes: 2 << 30,
            sleep_free_timeout: Duration::from_secs(10),
            failsafe: true,
            failsafe_silence: None,
        }
    }
}
