//! Tunables of the decision core, with defaults that suit a production fleet.

/// Timing of the agent protocol and one service's scaling policy.
#[derive(Debug, Clone, PartialEq)]
pub struct CoreConfig {
    /// How often agents heartbeat.
    pub heartbeat_interval_ms: u64,
    /// How long a lease stays valid without a heartbeat from its node. A node silent for this
    /// long is unreachable: its leases expire and their jobs are requeued.
    pub lease_ttl_ms: u64,
    pub services: Vec<ServicePolicy>,
    /// How long after a silent node's lease expired its job may start on another node, while
    /// the old container may still run there. `None`: until the old container has surely
    /// stopped, as the agent's fail-safe bounds it (it stops a job once the coordinator is
    /// silent past the lease TTL: checkpoint signal, the job's grace period, kill), that is
    /// the job's grace period plus [`STRAGGLER_MARGIN_MS`] after the lease expired, or until
    /// the node reports the container gone, whichever comes first. `Some(0)` starts the job
    /// elsewhere at once (two attempts may then run side by side for a while).
    pub restart_elsewhere_after_ms: Option<u64>,
    /// A job that has run less than this is taken back only when no other lent node will do
    /// (like Slurm's `PreemptExemptTime`).
    pub preempt_exempt_ms: u64,
    /// Weights of teams (a job's `owner`) for fair share; a team not listed weighs 1.
    pub team_weights: std::collections::BTreeMap<String, f64>,
    /// First port of gang rendezvous; a job uses `base + id % 1000`.
    pub rendezvous_port_base: u16,
    /// How long a gang's members may take, from their leases' grant, to all report their
    /// image on their hosts (and so be started together). Past it the members not ready fail
    /// to start, which fails the attempt (its retries apply) and frees every member's GPUs:
    /// a gang that cannot start never holds GPUs for ever.
    pub gang_start_timeout_ms: u64,
    /// Jobs one decision places at most; the rest follow at the next decision. Bounds the
    /// work, and the batch of changes to write, that a decision holds everything else up
    /// for when a large queue meets many free GPUs at once. A decision's fixed cost (a walk
    /// of the nodes and the queue) is paid once for all it places: at 10,000 agents, 512 a
    /// decision placed a 10,000-job queue at 5,600-7,100 jobs/s where 256 placed 3,400-3,800
    /// (commit 11e8d48; the placement figures now are in docs/BENCHMARKS.md).
    pub max_placements_per_decision: usize,
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 1_000,
            lease_ttl_ms: 30_000,
            services: vec![ServicePolicy::default()],
            restart_elsewhere_after_ms: None,
            preempt_exempt_ms: 0,
            team_weights: std::collections::BTreeMap::new(),
            rendezvous_port_base: 29_500,
            gang_start_timeout_ms: 900_000,
            max_placements_per_decision: 512,
        }
    }
}

/// What the hold of a silent node's job adds to its grace period: the agent's fail-safe
/// noticing the silence (a reconcile pass), the kill after the grace period and the
/// container's removal, and the coordinator's own tick.
pub const STRAGGLER_MARGIN_MS: u64 = 10_000;

/// When a service lends replicas' GPUs and when it takes them back.
#[derive(Debug, Clone, PartialEq)]
pub struct ServicePolicy {
    pub name: String,
    /// Replicas that always serve (or are starting): never lent.
    pub min_replicas: u32,
    pub scale_down: ScaleDown,
    pub scale_up: ScaleUp,
    /// After any lend or reclaim, wait this long before lending again.
    pub cooldown_ms: u64,
    /// A gateway's report of held requests counts for this long.
    pub gateway_signal_ttl_ms: u64,
    /// Most replicas the service ever needs: nodes beyond it may be lent whatever the load.
    pub max_replicas: Option<u32>,
    /// Spare replicas kept serving beyond what the load needs.
    pub headroom: u32,
    /// When lending is allowed (local time); empty means always.
    pub harvest_windows: Vec<crate::calendar::HarvestWindow>,
    /// Local time's offset from UTC, for harvest windows and load profiles.
    pub utc_offset_minutes: i32,
    /// Reclaim ahead of the load the service's profile predicts.
    pub predictive: bool,
    /// The reclaim lead time until one has been measured on the service's nodes.
    pub default_reclaim_lead_ms: u64,
}

impl Default for ServicePolicy {
    fn default() -> Self {
        Self {
            name: "default".to_owned(),
            min_replicas: 1,
            scale_down: ScaleDown::default(),
            scale_up: ScaleUp::default(),
            cooldown_ms: 300_000,
            gateway_signal_ttl_ms: 5_000,
            max_replicas: None,
            headroom: 0,
            harvest_windows: Vec::new(),
            utc_offset_minutes: 0,
            predictive: true,
            default_reclaim_lead_ms: 600_000,
        }
    }
}

/// Lending is careful: the load must stay low for a whole window.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleDown {
    /// Requests waiting, summed over the service's serving replicas, at most this.
    pub max_waiting: f64,
    /// Requests running per replica that would remain after lending one, at most this. With
    /// no replica remaining, nothing may be running.
    pub max_running_per_replica: f64,
    /// How long the load must stay low before a replica is lent.
    pub window_ms: u64,
    /// KV-cache usage (0–1) of every serving replica at most this.
    pub max_kv_cache_usage: f64,
}

impl Default for ScaleDown {
    fn default() -> Self {
        Self {
            max_waiting: 0.0,
            max_running_per_replica: 4.0,
            window_ms: 600_000,
            max_kv_cache_usage: 0.7,
        }
    }
}

/// Reclaiming is fast: one bad reading is enough.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleUp {
    /// Requests waiting per serving replica at or above this takes a node back.
    pub waiting_per_replica: f64,
    /// Requests running per serving replica at or above this takes a node back; also the
    /// load one replica is counted to carry when predicting how many are needed.
    pub running_per_replica: f64,
    /// KV-cache usage (0–1) of any serving replica at or above this takes a node back.
    pub kv_cache_usage: f64,
    /// A serving replica's time to first token (p95, seconds) at or above this takes a node
    /// back; lending needs every replica below half of it. Off when unset.
    pub ttft_p95_s: Option<f64>,
    /// Generated tokens per second per serving replica at or above this takes a node back;
    /// lending needs the remaining replicas below half of it. Off when unset.
    pub generation_tokens_per_s_per_replica: Option<f64>,
}

impl Default for ScaleUp {
    fn default() -> Self {
        Self {
            waiting_per_replica: 2.0,
            running_per_replica: 32.0,
            kv_cache_usage: 0.9,
            ttft_p95_s: None,
            generation_tokens_per_s_per_replica: None,
        }
    }
}
