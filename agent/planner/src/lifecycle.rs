//! The replica's state machine: one transition function, [`apply`], and illegal moves as
//! typed errors ([`IllegalMove`]), as `Job::apply` in the core.
//!
//! It is the only way the replica's state (the agent's `state::Observed::replica`) changes:
//! the planner says what happened as a [`ReplicaEvent`], the executor applies it
//! (`state::Shared::replica_event` in the agent). Readiness (the load balancer's `/ready`) is
//! not stored beside it but derived from it: ready exactly while the replica is `Serving`, so
//! a draining, starting, sleeping or stopped replica is never sent requests.

use nightshift_common::ReplicaState;

/// What happened to the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaEvent {
    /// Found running by an agent that has not heard from the coordinator yet (a restart):
    /// healthy and awake it serves, healthy and asleep it sleeps, else it is starting.
    Adopted { healthy: bool, asleep: bool },
    /// Its container was started, or found running but not yet healthy, or woken.
    Started,
    /// `/health` answers 200.
    Healthy,
    /// Marked not-ready to be drained: the node is to be lent.
    DrainBegan,
    /// The node should serve again before the drain stopped anything.
    DrainAbandoned,
    /// vLLM sleeps with its memory released: its GPUs are lent.
    Slept,
    /// Its container is stopped or gone.
    Stopped,
    /// It could not be started, or did not become healthy in time.
    Failed,
}

impl ReplicaEvent {
    fn name(self) -> &'static str {
        match self {
            Self::Adopted { .. } => "adopt",
            Self::Started => "start",
            Self::Healthy => "become healthy",
            Self::DrainBegan => "begin a drain",
            Self::DrainAbandoned => "abandon a drain",
            Self::Slept => "sleep",
            Self::Stopped => "stop",
            Self::Failed => "fail",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the replica cannot {event} while {from}")]
pub struct IllegalMove {
    pub from: &'static str,
    pub event: &'static str,
}

/// The replica's state after `event` in state `from`.
pub fn apply(from: ReplicaState, event: ReplicaEvent) -> Result<ReplicaState, IllegalMove> {
    use ReplicaEvent as E;
    use ReplicaState as S;
    let to = match (from, event) {
        // What a restarted agent finds overrides what it assumed.
        (_, E::Adopted { healthy, asleep }) => match (healthy, asleep) {
            (true, true) => S::Sleeping,
            (true, false) => S::Serving,
            (false, _) => S::Starting,
        },
        (S::Stopped | S::Failed | S::Sleeping, E::Started) => S::Starting,
        (S::Starting, E::Healthy) => S::Serving,
        (S::Serving | S::Starting | S::Stopped | S::Failed, E::DrainBegan) => S::Draining,
        (S::Draining, E::DrainAbandoned) => S::Serving,
        (S::Draining, E::Slept) => S::Sleeping,
        (_, E::Stopped) => S::Stopped,
        (S::Starting | S::Stopped | S::Failed, E::Failed) => S::Failed,
        _ => {
            return Err(IllegalMove {
                from: from.as_str(),
                event: event.name(),
            });
        }
    };
    Ok(to)
}

/// Whether the load balancer may send the replica requests in `state`.
pub fn ready(state: ReplicaState) -> bool {
    state == ReplicaState::Serving
}

#[cfg(test)]
mod tests {
    use super::*;
    use ReplicaEvent as E;
    use ReplicaState as S;

    #[test]
    fn the_stop_path_and_back() {
        let mut s = S::Stopped;
        for (event, expect) in [
            (E::Started, S::Starting),
            (E::Healthy, S::Serving),
            (E::DrainBegan, S::Draining),
            (E::Stopped, S::Stopped),
            (E::Started, S::Starting),
            (E::Healthy, S::Serving),
        ] {
            s = apply(s, event).unwrap();
            assert_eq!(s, expect, "after {event:?}");
        }
    }

    #[test]
    fn the_sleep_path_and_back() {
        let s = apply(S::Serving, E::DrainBegan).unwrap();
        let s = apply(s, E::Slept).unwrap();
        assert_eq!(s, S::Sleeping);
        assert!(!ready(s));
        let s = apply(s, E::Started).unwrap();
        assert_eq!(apply(s, E::Healthy), Ok(S::Serving));
    }

    #[test]
    fn a_drain_called_off_serves_again() {
        let s = apply(S::Serving, E::DrainBegan).unwrap();
        assert!(!ready(s));
        assert_eq!(apply(s, E::DrainAbandoned), Ok(S::Serving));
    }

    #[test]
    fn illegal_moves_are_typed_errors() {
        assert_eq!(
            apply(S::Serving, E::Slept),
            Err(IllegalMove {
                from: "serving",
                event: "sleep"
            })
        );
        assert!(apply(S::Stopped, E::Healthy).is_err(), "nothing runs");
        assert!(apply(S::Sleeping, E::DrainBegan).is_err());
        assert!(apply(S::Serving, E::DrainAbandoned).is_err());
        assert!(apply(S::Serving, E::Started).is_err());
        assert_eq!(
            apply(S::Serving, E::Failed).unwrap_err().to_string(),
            "the replica cannot fail while serving"
        );
    }

    #[test]
    fn adoption_believes_what_it_finds() {
        for from in [S::Stopped, S::Serving, S::Draining] {
            assert_eq!(
                apply(
                    from,
                    E::Adopted {
                        healthy: true,
                        asleep: false
                    }
                ),
                Ok(S::Serving)
            );
            assert_eq!(
                apply(
                    from,
                    E::Adopted {
                        healthy: true,
                        asleep: true
                    }
                ),
                Ok(S::Sleeping)
            );
            assert_eq!(
                apply(
                    from,
                    E::Adopted {
                        healthy: false,
                        asleep: false
                    }
                ),
                Ok(S::Starting)
            );
        }
    }

    #[test]
    fn only_serving_is_ready() {
        for s in [S::Starting, S::Draining, S::Stopped, S::Sleeping, S::Failed] {
            assert!(!ready(s), "{s:?}");
        }
        assert!(ready(S::Serving));
    }
}
