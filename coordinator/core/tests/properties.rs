//! Property tests: random sequences of load, submissions (gangs, priorities, teams, failing
//! jobs with retries, run-time limits), cancels and silences against a
//! simulated cluster; the core's checks of ARCHITECTURE.md's invariants (1–4 and 8) run
//! after every step.

mod sim;

use proptest::prelude::*;
use sim::{Cluster, config, spec};

#[derive(Debug, Clone)]
enum Op {
    Submit {
        gpus: u32,
        nodes: u32,
        steps: u32,
        priority: i32,
        team: u8,
        exit_code: i64,
        retries: u32,
        max_run_seconds: Option<u64>,
    },
    Load {
        node: usize,
        waiting: u8,
        running: u8,
    },
    Gateway {
        waiting: u8,
    },
    Cancel {
        job: u64,
    },
    Silence {
        node: usize,
        silent: bool,
    },
    Wait {
        steps: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u32..=4, 1u32..=2, 1u32..20, -1i32..=1, 0u8..3, prop_oneof![4 => Just(0i64), 1 => Just(1i64)], 0u32..3, proptest::option::weighted(0.3, 1u64..15))
            .prop_map(|(gpus, nodes, steps, priority, team, exit_code, retries, max_run_seconds)| Op::Submit {
                gpus, nodes, steps, priority, team, exit_code, retries, max_run_seconds,
            }),
        3 => (0usize..3, 0u8..5, 0u8..12)
            .prop_map(|(node, waiting, running)| Op::Load { node, waiting, running }),
        1 => (0u8..4).prop_map(|waiting| Op::Gateway { waiting }),
        1 => (1u64..12).prop_map(|job| Op::Cancel { job }),
        1 => (0usize..3, any::<bool>()).prop_map(|(node, silent)| Op::Silence { node, silent }),
        4 => (1u8..8).prop_map(|steps| Op::Wait { steps }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_after_every_step(
        min_replicas in 0u32..=2,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut c = Cluster::new(config(min_replicas), &[("a", 4), ("b", 4), ("c", 2)]);
        let names = ["a", "b", "c"];
        let mut next_job = 1u64;
        for op in ops {
            match op {
                Op::Submit { gpus, nodes, steps, priority, team, exit_code, retries, max_run_seconds } => {
                    let mut s = spec("p", gpus);
                    s.priority = priority;
                    s.nodes = nodes;
                    s.owner = Some(format!("team-{team}"));
                    s.retry.limit = retries;
                    s.retry.backoff_seconds = 1;
                    s.max_run_seconds = max_run_seconds;
                    if let Ok(id) = c.core.submit(c.now, s) {
                        for a in &mut c.agents {
                            a.jobs.durations.insert(id, steps);
                            a.jobs.exit_codes.insert(id, exit_code);
                        }
                        prop_assert_eq!(id, next_job);
                        next_job += 1;
                    }
                }
                Op::Load { node, waiting, running } => {
                    c.load(names[node], waiting as f64, running as f64)
                }
                Op::Gateway { waiting } => c.core.gateway(c.now, "llm", waiting as u64).unwrap(),
                Op::Cancel { job } => { let _ = c.core.cancel(c.now, job); }
                Op::Silence { node, silent } => c.agent(names[node]).silent = silent,
                Op::Wait { steps } => c.run(steps as usize),
            }
            c.assert_invariants();
        }
        // Everything heals once the nodes are back and the load is gone.
        for (i, name) in names.iter().enumerate() {
            c.agent(name).silent = false;
            c.load(names[i], 0.0, 0.0);
        }
        c.run(400);
        for job in c.core.jobs() {
            prop_assert!(job.state.is_finished(), "job {} still {:?}", job.id, job.state);
            // A run-time limit holds to within the time a stop takes (a silent node's lease
            // runs out first), and only a job that reached it is stopped for it.
            if let Some(limit) = job.spec.max_run_seconds {
                prop_assert!(job.ran_ms <= limit * 1000 + 10_000, "{job:?}");
                prop_assert!(!job.timed_out || job.ran_ms >= limit * 1000, "{job:?}");
            } else {
                prop_assert!(!job.timed_out, "{job:?}");
            }
        }
    }
}
