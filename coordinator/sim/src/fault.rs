//! Faults injected on request: agent crashes, coordinator restarts and network partitions,
//! at seeded random times, the same for every policy of a run.

use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// The agent process dies and comes back after `Lifecycle::agent_restart_s` (or the
    /// fault's own duration); its memory is lost, its containers run on.
    AgentCrash,
    /// The coordinator restarts, its core rebuilt from what its store holds.
    CoordinatorRestart,
    /// The node cannot reach the coordinator for `Lifecycle::partition_s` (or the fault's
    /// own duration): neither its heartbeats nor its desired state get through.
    Partition,
    /// The node's heartbeats are lost; its desired state still arrives.
    HeartbeatLoss,
    /// The node's desired state does not arrive (the long poll hangs); its heartbeats get
    /// through.
    DesiredLoss,
    /// The node's container engine restarts: every container stops with it, and the engine
    /// does not answer for the fault's duration (10 s unless given).
    EngineRestart,
    /// The jobs running on the node ignore their checkpoint signal from now on: each stop
    /// waits out its grace period and kills it.
    StubbornJobs,
    /// The node's checkpoint volume reads full for the fault's duration (10 minutes unless
    /// given): no job may start there.
    DiskFull,
    /// The coordinator is down for the fault's duration (every node cut off from it), then
    /// restarts from its store.
    CoordinatorDown,
    /// The node's vLLM answers `/sleep` with an error for the fault's duration (10 minutes
    /// unless given): a lend in sleep mode stops the replica instead.
    SleepFails,
    /// The node's engine loses the jobs' image (pruned by someone else): the next pull of
    /// it takes the fault's duration (2 minutes unless given).
    SlowPull,
    /// The node's engine loses the jobs' image and the registry refuses it for the
    /// fault's duration (10 minutes unless given): every job leased there meanwhile fails
    /// to start. After that, a pull takes 30 s.
    PullRefused,
}

impl FaultKind {
    pub const ALL: [FaultKind; 12] = [
        FaultKind::AgentCrash,
        FaultKind::CoordinatorRestart,
        FaultKind::Partition,
        FaultKind::HeartbeatLoss,
        FaultKind::DesiredLoss,
        FaultKind::EngineRestart,
        FaultKind::StubbornJobs,
        FaultKind::DiskFull,
        FaultKind::CoordinatorDown,
        FaultKind::SleepFails,
        FaultKind::SlowPull,
        FaultKind::PullRefused,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::AgentCrash => "agent-crash",
            Self::CoordinatorRestart => "coordinator-restart",
            Self::Partition => "partition",
            Self::HeartbeatLoss => "heartbeat-loss",
            Self::DesiredLoss => "desired-loss",
            Self::EngineRestart => "engine-restart",
            Self::StubbornJobs => "stubborn-jobs",
            Self::DiskFull => "disk-full",
            Self::CoordinatorDown => "coordinator-down",
            Self::SleepFails => "sleep-fails",
            Self::SlowPull => "slow-pull",
            Self::PullRefused => "pull-refused",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub at_s: u64,
    pub kind: FaultKind,
    /// The node it hits (ignored for the coordinator's faults).
    pub node: usize,
    /// How long it lasts, seconds; `None`: the kind's default.
    pub for_s: Option<u64>,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "t={}s {} node-{:03}",
            self.at_s,
            self.kind.name(),
            self.node
        )?;
        if let Some(d) = self.for_s {
            write!(f, " for {d}s")?;
        }
        Ok(())
    }
}

/// How many faults of each kind per simulated day.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultRates {
    pub agent_crash: u32,
    pub coordinator_restart: u32,
    pub partition: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "bad --faults {0:?}: expected none, default, or kind=N[,kind=N] per day with kinds agent-crash, coordinator-restart, partition"
)]
pub struct FaultSpecError(pub String);

impl FaultRates {
    /// `none`, `default` (4 agent crashes, 2 coordinator restarts and 2 partitions a day), or
    /// `agent-crash=N,coordinator-restart=N,partition=N` (any subset).
    pub fn parse(spec: &str) -> Result<Self, FaultSpecError> {
        match spec.trim() {
            "" | "none" => return Ok(Self::default()),
            "default" => {
                return Ok(Self {
                    agent_crash: 4,
                    coordinator_restart: 2,
                    partition: 2,
                });
            }
            _ => {}
        }
        let mut rates = Self::default();
        for part in spec.split(',') {
            let (kind, n) = part
                .split_once('=')
                .ok_or_else(|| FaultSpecError(spec.to_owned()))?;
            let n: u32 = n
                .trim()
                .parse()
                .map_err(|_| FaultSpecError(spec.to_owned()))?;
            match kind.trim() {
                "agent-crash" => rates.agent_crash = n,
                "coordinator-restart" => rates.coordinator_restart = n,
                "partition" => rates.partition = n,
                _ => return Err(FaultSpecError(spec.to_owned())),
            }
        }
        Ok(rates)
    }

    /// The schedule for `days` days on `nodes` nodes, sorted by time.
    pub fn schedule(&self, days: f64, nodes: usize, seed: u64) -> Vec<Fault> {
        let mut rng = Rng::stream(seed, 11);
        let horizon = (days * 86_400.0) as u64;
        let mut out = Vec::new();
        for (kind, per_day) in [
            (FaultKind::AgentCrash, self.agent_crash),
            (FaultKind::CoordinatorRestart, self.coordinator_restart),
            (FaultKind::Partition, self.partition),
        ] {
            let n = (f64::from(per_day) * days).round() as u64;
            for _ in 0..n {
                out.push(Fault {
                    at_s: rng.below(horizon.max(1)),
                    kind,
                    node: rng.below(nodes.max(1) as u64) as usize,
                    for_s: None,
                });
            }
        }
        out.sort_by_key(|f| (f.at_s, f.node));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs_and_refuses_junk() {
        assert_eq!(FaultRates::parse("none"), Ok(FaultRates::default()));
        let r = FaultRates::parse("agent-crash=3,partition=1").unwrap();
        assert_eq!(
            (r.agent_crash, r.coordinator_restart, r.partition),
            (3, 0, 1)
        );
        assert!(FaultRates::parse("meteor=1").is_err());
        let s = FaultRates::parse("default").unwrap().schedule(2.0, 4, 1);
        assert_eq!(s.len(), 16);
        assert!(s.windows(2).all(|w| w[0].at_s <= w[1].at_s));
    }
}
