//! A simulation's settings, with documented defaults, and the core policy derived from them.

use nightshift_core::{CoreConfig, ScaleDown, ScaleUp, ServicePolicy};

use crate::backlog::{JobClass, default_mix};
use crate::controller::SERVICE;
use crate::fault::FaultRates;
use crate::model::{Lifecycle, ReplicaModel};

#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Hosts in the fleet, one replica each.
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// The trace is scaled so that its busiest 10-minute window needs this many replicas.
    pub peak_replicas: u32,
    pub days: f64,
    pub seed: u64,
    /// The service's `min_replicas`.
    pub min_replicas: u32,
    pub replica: ReplicaModel,
    pub lifecycle: Lifecycle,
    pub mix: Vec<JobClass>,
    pub faults: FaultRates,
    /// Seconds between an agent's heartbeats. Production's default is 1 s; the simulator's
    /// default of 5 s keeps a 14-day run fast and is far below every transition time.
    pub heartbeat_s: u64,
    pub lease_ttl_s: u64,
    /// The core lends replicas only while the others would then run at most this fraction
    /// of their sequence slots.
    pub lend_utilisation: f64,
    /// The fraction of its slots one replica is planned to carry: the core takes a node back
    /// when ready replicas run more, and sizes its forecast target with it. The default is
    /// the SLO's own 80 % (`ReplicaModel::target_utilisation`), so the core's target and the
    /// minute's need count replicas the same way.
    pub reclaim_utilisation: f64,
    /// Jobs kept queued beyond what the whole fleet could run at once.
    pub queue_depth: usize,
    /// What one GPU-hour of research compute would cost to rent, for `savings`.
    pub gpu_hour_price: f64,
    /// Fill a windowed trace's gaps (`Trace::gaps`) from the windows around them instead of
    /// simulating them as recorded, without traffic.
    pub fill_trace_gaps: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 32,
            gpus_per_node: 4,
            peak_replicas: 28,
            days: 14.0,
            seed: 1,
            min_replicas: 2,
            replica: ReplicaModel::default(),
            lifecycle: Lifecycle::default(),
            mix: default_mix(),
            faults: FaultRates::default(),
            heartbeat_s: 5,
            lease_ttl_s: 30,
            lend_utilisation: 0.8,
            reclaim_utilisation: 0.8,
            queue_depth: 16,
            gpu_hour_price: 2.0,
            fill_trace_gaps: false,
        }
    }
}

impl SimConfig {
    /// The core's policy for the simulated service: the shipped defaults (scale-down window,
    /// cooldown, waiting thresholds), with the running-request thresholds expressed in this
    /// replica's sequence slots, as an operator configures them for their model.
    pub fn core_config(&self) -> CoreConfig {
        let slots = self.replica.max_seqs;
        let defaults = ServicePolicy::default();
        CoreConfig {
            heartbeat_interval_ms: self.heartbeat_s * 1_000,
            lease_ttl_ms: self.lease_ttl_s * 1_000,
            services: vec![ServicePolicy {
                name: SERVICE.to_owned(),
                min_replicas: self.min_replicas,
                scale_down: ScaleDown {
                    max_running_per_replica: self.lend_utilisation * slots,
                    ..defaults.scale_down.clone()
                },
                scale_up: ScaleUp {
                    running_per_replica: self.reclaim_utilisation * slots,
                    ..defaults.scale_up.clone()
                },
                ..defaults
            }],
            ..CoreConfig::default()
        }
    }

    pub fn horizon_s(&self) -> u64 {
        (self.days * 86_400.0).round() as u64
    }
}
