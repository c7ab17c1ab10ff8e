//! Runs of the conformance workflows driven with a virtual clock and a fake executor that
//! plays the part of the jobs: which steps launch, in what order, with which resolved
//! arguments, and how the run ends.

use std::collections::BTreeMap;
use std::path::PathBuf;

use nightshift_pipeline::run::NodeId;
use nightshift_pipeline::{Action, Input, Outcome, Phase, Run, StepResult, StepSpec};

fn manifest(name: &str) -> String {
    let dir = std::env::var_os("NIGHTSHIFT_CONFORMANCE_DIR").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .map(|a| a.join("shared/conformance/argo-workflows"))
                .find(|p| p.is_dir())
                .expect("shared/conformance/argo-workflows above the crate")
        },
        PathBuf::from,
    );
    std::fs::read_to_string(dir.join(name)).unwrap()
}

fn ok(stdout: &str) -> StepResult {
    StepResult {
        outcome: Outcome::Succeeded,
        files: BTreeMap::new(),
        stdout: Some(stdout.to_owned()),
    }
}

fn failed(code: i64) -> StepResult {
    StepResult {
        outcome: Outcome::Failed { exit_code: code },
        files: BTreeMap::new(),
        stdout: None,
    }
}

/// One launch as the fake executor saw it.
#[derive(Debug, Clone)]
struct Launched {
    at: u64,
    name: String,
    retry: u32,
    spec: StepSpec,
}

struct Sim {
    run: Run,
    now: u64,
    launched: Vec<Launched>,
    cancelled: Vec<(NodeId, String)>,
    /// Jobs out: node, retry, when it ends.
    running: Vec<(NodeId, u32, u64, StepResult)>,
    inputs: Vec<(u64, Input)>,
}

impl Sim {
    fn new(file: &str, params: &[(&str, &str)]) -> Self {
        let wf = nightshift_pipeline::load(&manifest(file)).unwrap();
        let params = params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self {
            run: Run::start(wf, "run-1", &params, 0).unwrap(),
            now: 0,
            launched: Vec::new(),
            cancelled: Vec::new(),
            running: Vec::new(),
            inputs: Vec::new(),
        }
    }

    fn handle(&mut self, input: Input, exec: &mut impl FnMut(&Launched) -> (u64, StepResult)) {
        self.inputs.push((self.now, input.clone()));
        for action in self.run.handle(self.now, input) {
            match action {
                Action::Launch {
                    node,
                    retry,
                    name,
                    spec,
                } => {
                    let l = Launched {
                        at: self.now,
                        name,
                        retry,
                        spec: *spec,
                    };
                    let (took, result) = exec(&l);
                    self.launched.push(l);
                    self.running.push((node, retry, self.now + took, result));
                }
                Action::Cancel { node, reason } => {
                    self.running.retain(|(n, ..)| *n != node);
                    self.cancelled.push((node, reason));
                }
            }
        }
    }

    /// Drives the run to its end: jobs end when `exec` says, ticks fire at deadlines.
    fn drive(mut self, mut exec: impl FnMut(&Launched) -> (u64, StepResult)) -> Self {
        self.handle(Input::Tick, &mut exec);
        for _ in 0..10_000 {
            if self.run.phase.is_finished() {
                return self;
            }
            let next_job = self.running.iter().map(|r| r.2).min();
            let next_tick = self.run.next_deadline();
            let Some(t) = next_job.into_iter().chain(next_tick).min() else {
                panic!(
                    "stuck: nothing running and no deadline\n{:#?}",
                    self.run.nodes
                )
            };
            self.now = self.now.max(t);
            if let Some(i) = self.running.iter().position(|r| r.2 <= self.now) {
                let (node, retry, _, result) = self.running.remove(i);
                self.handle(
                    Input::Finished {
                        node,
                        retry,
                        result,
                    },
                    &mut exec,
                );
            } else {
                self.handle(Input::Tick, &mut exec);
            }
        }
        panic!("did not finish")
    }

    fn names(&self) -> Vec<&str> {
        self.launched.iter().map(|l| l.name.as_str()).collect()
    }

    fn node(&self, name: &str) -> &nightshift_pipeline::run::RunNode {
        self.run
            .nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }
}

/// `echo` as busybox would: the command and args after `echo`, joined.
fn echo(l: &Launched) -> String {
    let words: Vec<&str> = l
        .spec
        .command
        .iter()
        .chain(&l.spec.args)
        .map(String::as_str)
        .skip_while(|w| *w == "echo")
        .collect();
    words.join(" ")
}

#[test]
fn the_diamond_runs_a_then_b_and_c_together_then_d() {
    let sim = Sim::new("dag-diamond.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    assert_eq!(sim.run.phase, Phase::Succeeded);
    let at: Vec<(&str, u64)> = sim
        .launched
        .iter()
        .map(|l| (l.name.as_str(), l.at))
        .collect();
    assert_eq!(
        at,
        [
            ("dag-diamond.A", 0),
            ("dag-diamond.B", 1000),
            ("dag-diamond.C", 1000),
            ("dag-diamond.D", 2000)
        ]
    );
    let words: Vec<String> = sim.launched.iter().map(echo).collect();
    assert_eq!(words, ["A", "B", "C", "D"]);
    assert_eq!(sim.launched[0].spec.image, "busybox");
    assert_eq!(sim.launched[0].spec.gpus, 0);
}

#[test]
fn enhanced_depends_runs_the_handlers_of_a_failure_and_omits_the_rest() {
    let sim = Sim::new("dag-enhanced-depends.yaml", &[]).drive(|l| {
        let fails = l.spec.command.last().is_some_and(|c| c == "exit 1");
        (1000, if fails { failed(1) } else { ok("") })
    });
    let phase = |n: &str| sim.node(&format!("dag-diamond.{n}")).phase;
    assert_eq!(phase("C"), Phase::Failed);
    assert_eq!(phase("should-execute-1"), Phase::Succeeded);
    assert_eq!(phase("should-execute-2"), Phase::Succeeded);
    assert_eq!(phase("should-execute-3"), Phase::Succeeded);
    assert_eq!(phase("should-not-execute"), Phase::Omitted);
    // C's failure is handled by `C.Failed`, as in Argo's own test of this example.
    assert_eq!(sim.run.phase, Phase::Succeeded);
}

#[test]
fn continue_on_failed_with_parallelism_one() {
    let sim = Sim::new("continue-on-fail.yaml", &[]).drive(|l| {
        let fails = l.spec.args.iter().any(|a| a.contains("exit 1"));
        (1000, if fails { failed(1) } else { ok("hello world") })
    });
    assert_eq!(sim.run.phase, Phase::Succeeded);
    // parallelism: 1: never two at the same time.
    let mut starts: Vec<u64> = sim.launched.iter().map(|l| l.at).collect();
    starts.dedup();
    assert_eq!(starts.len(), 4, "{:?}", sim.names());
    assert_eq!(sim.node("continue-on-fail.C").phase, Phase::Failed);
    assert_eq!(sim.node("continue-on-fail.D").phase, Phase::Succeeded);
}

#[test]
fn a_failed_step_without_continue_on_stops_the_steps() {
    let text = manifest("continue-on-fail.yaml").replace("continueOn:\n          failed: true", "");
    let wf = nightshift_pipeline::load(&text).unwrap();
    let mut sim = Sim::new("continue-on-fail.yaml", &[]);
    sim.run = Run::start(wf, "r", &BTreeMap::new(), 0).unwrap();
    let sim = sim.drive(|l| {
        let fails = l.spec.args.iter().any(|a| a.contains("exit 1"));
        (1000, if fails { failed(1) } else { ok("") })
    });
    assert_eq!(sim.run.phase, Phase::Failed);
    assert!(
        !sim.names().contains(&"continue-on-fail.D"),
        "{:?}",
        sim.names()
    );
}

#[test]
fn output_parameters_flow_from_a_file_to_the_next_step() {
    let sim = Sim::new("output-parameter.yaml", &[]).drive(|l| {
        let mut r = ok(&echo(l));
        if l.spec
            .output_paths
            .iter()
            .any(|(_, p)| p == "/tmp/hello_world.txt")
        {
            r.files.insert("hello-param".into(), "hello world".into());
        }
        (1000, r)
    });
    assert_eq!(sim.run.phase, Phase::Succeeded);
    assert_eq!(sim.launched[1].spec.args, ["hello world"]);
    // The default applies when the file is missing.
    let sim = Sim::new("output-parameter.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    assert_eq!(sim.launched[1].spec.args, ["Foobar"]);
}

#[test]
fn parameter_aggregation_loops_over_outputs_and_results() {
    let sim = Sim::new("parameter-aggregation-dag.yaml", &[]).drive(|l| {
        let script = l.spec.args.join(" ");
        if l.spec.output_paths.len() == 2 {
            // odd-or-even: `echo N > /tmp/num && ...`
            let n: i64 = script
                .split_whitespace()
                .nth(4)
                .and_then(|w| w.parse().ok())
                .unwrap_or_else(|| panic!("{script}"));
            let mut r = ok("");
            r.files.insert("num".into(), format!("{n}\n"));
            let parity = if n % 2 == 0 { "even" } else { "odd" };
            r.files.insert("evenness".into(), format!("{parity}\n"));
            (1000, r)
        } else if script.starts_with("echo $((") {
            // divide-by-2: `echo $((N/2))`
            let n: i64 = script
                .trim_start_matches("echo $((")
                .split('/')
                .next()
                .and_then(|w| w.parse().ok())
                .unwrap_or_else(|| panic!("{script}"));
            (1000, ok(&format!("{}\n", n / 2)))
        } else {
            (1000, ok(&echo(l)))
        }
    });
    assert_eq!(sim.run.phase, Phase::Succeeded, "{:#?}", sim.run.nodes);
    let printed: Vec<String> = sim
        .launched
        .iter()
        .filter(|l| l.name.contains(".print"))
        .map(|l| format!("{} {}", l.name.rsplit('.').next().unwrap(), echo(l)))
        .collect();
    assert!(
        printed.contains(&r#"print-nums ["1","2","3","4"]"#.to_owned()),
        "{printed:?}"
    );
    assert!(
        printed.contains(&r#"print-evenness ["odd","even","odd","even"]"#.to_owned()),
        "{printed:?}"
    );
    // Only the even numbers are divided; their halves are printed one by one.
    let divided: Vec<&str> = sim
        .names()
        .into_iter()
        .filter(|n| n.contains("divide-by-2("))
        .collect();
    assert_eq!(divided.len(), 2, "{divided:?}");
    assert!(
        printed.contains(&"print(0:1) 1".to_owned())
            && printed.contains(&"print(1:2) 2".to_owned()),
        "{printed:?}"
    );
    let skipped = sim
        .run
        .nodes
        .iter()
        .filter(|n| n.phase == Phase::Skipped)
        .count();
    assert_eq!(skipped, 2);
}

#[test]
fn retries_use_the_backoff_and_stop_at_the_limit() {
    // Fails every time: 1 + 10 attempts, waits 1, 2, 4, then capped at 5 seconds, until the
    // one-minute maxDuration stops it.
    let sim = Sim::new("retry-backoff.yaml", &[]).drive(|_| (0, failed(1)));
    assert_eq!(sim.run.phase, Phase::Failed);
    let at: Vec<u64> = sim.launched.iter().map(|l| l.at).collect();
    assert_eq!(&at[..5], [0, 1000, 3000, 7000, 12_000]);
    assert!(at.iter().all(|t| *t <= 60_000), "{at:?}");
    let retries: Vec<u32> = sim.launched.iter().map(|l| l.retry).collect();
    assert_eq!(retries, (0..retries.len() as u32).collect::<Vec<_>>());

    // retry-with-steps: `{{retries}}` is the retry number; success ends the retries.
    let mut n = 0;
    let sim = Sim::new("retry-with-steps.yaml", &[]).drive(|l| {
        n += 1;
        let r = if l.retry < 2 { failed(1) } else { ok("") };
        (1000, r)
    });
    assert_eq!(sim.run.phase, Phase::Succeeded);
    assert_eq!(n, 9, "three steps, three attempts each");
    let last = sim.launched.iter().find(|l| l.retry == 2).unwrap();
    assert!(
        last.spec.args[0].contains("print('retries: 2')"),
        "{:?}",
        last.spec.args
    );
}

#[test]
fn the_exit_handler_sees_the_workflow_status() {
    let sim = Sim::new("exit-handlers.yaml", &[]).drive(|l| {
        let fails = l.spec.args.iter().any(|a| a.contains("exit 1"));
        (
            1000,
            if fails {
                failed(1)
            } else {
                ok(&l.spec.args.join(" "))
            },
        )
    });
    assert_eq!(sim.run.phase, Phase::Failed);
    let names = sim.names();
    assert!(names.contains(&"exit-handlers.onExit.cry"), "{names:?}");
    assert!(
        !names.contains(&"exit-handlers.onExit.celebrate"),
        "{names:?}"
    );
    let email = sim
        .launched
        .iter()
        .find(|l| l.name.ends_with(".notify"))
        .unwrap();
    let text = &email.spec.args[0];
    assert!(
        text.starts_with("echo send e-mail: exit-handlers Failed "),
        "{text}"
    );
    assert!(text.contains(r#""displayName":"exit-handlers""#), "{text}");
}

#[test]
fn step_level_exit_handlers_run_after_each_task() {
    let sim = Sim::new("exit-handler-dag-level.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    assert_eq!(sim.run.phase, Phase::Succeeded);
    let hooks = sim
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".onExit"))
        .count();
    assert_eq!(hooks, 4);
    // D waits for B's and C's handlers.
    let at = |n: &str| sim.launched.iter().find(|l| l.name == n).unwrap().at;
    assert!(at("exit-hanlder-dag-level.D") > at("exit-hanlder-dag-level.B.onExit"));
}

#[test]
fn a_task_timeout_cancels_its_job_and_fails_the_run() {
    let sim = Sim::new("dag-task-level-timeout.yaml", &[]).drive(|_| (15_000, ok("")));
    assert_eq!(sim.run.phase, Phase::Failed);
    assert_eq!(sim.cancelled.len(), 1, "{:?}", sim.cancelled);
    assert!(
        sim.cancelled[0].1.contains("timed out after 10s"),
        "{:?}",
        sim.cancelled
    );
    assert_eq!(sim.node("dag-task-level-timeout.B").phase, Phase::Failed);
    assert_eq!(sim.node("dag-task-level-timeout.C").phase, Phase::Succeeded);
}

#[test]
fn loops_parameters_and_nested_templates() {
    let sim = Sim::new("loops.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    let words: Vec<String> = sim.launched.iter().map(echo).collect();
    assert_eq!(words, ["hello world", "goodbye world"]);
    let sim = Sim::new("arguments-parameters.yaml", &[("message", "goodbye world")])
        .drive(|l| (1000, ok(&echo(l))));
    assert_eq!(sim.launched[0].spec.args, ["goodbye world"]);
    let sim = Sim::new("global-parameters.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    assert_eq!(sim.launched[0].spec.args, ["hello world"]);
    let sim = Sim::new("dag-nested.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    assert_eq!(sim.launched.len(), 16);
    assert_eq!(sim.run.phase, Phase::Succeeded);
    let sim = Sim::new("dag-diamond-steps.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    let words: Vec<String> = sim.launched.iter().map(echo).collect();
    assert_eq!(&words[..3], ["A1", "A2", "A3"]);
    assert_eq!(words.len(), 12);
    let wf = nightshift_pipeline::load(&manifest("global-parameters.yaml")).unwrap();
    let err = Run::start(wf, "r", &BTreeMap::from([("mesage".into(), "x".into())]), 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "parameter mesage is not a parameter of this workflow"
    );
}

#[test]
fn a_replay_of_the_inputs_rebuilds_the_same_run_and_launches() {
    let sim = Sim::new("dag-diamond.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    let wf = nightshift_pipeline::load(&manifest("dag-diamond.yaml")).unwrap();
    let (again, actions) = Run::replay(wf, "run-1", &BTreeMap::new(), 0, &sim.inputs).unwrap();
    assert_eq!(again, sim.run);
    let launches: Vec<(String, u32)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Launch { name, retry, .. } => Some((name.clone(), *retry)),
            Action::Cancel { .. } => None,
        })
        .collect();
    let before: Vec<(String, u32)> = sim
        .launched
        .iter()
        .map(|l| (l.name.clone(), l.retry))
        .collect();
    assert_eq!(launches, before);
}

#[test]
fn a_late_result_of_a_cancelled_attempt_changes_nothing() {
    let mut sim = Sim::new("dag-task-level-timeout.yaml", &[]).drive(|_| (15_000, ok("")));
    let before = sim.run.clone();
    let b = sim.node("dag-task-level-timeout.B").id;
    let actions = sim.run.handle(
        99_000,
        Input::Finished {
            node: b,
            retry: 0,
            result: ok(""),
        },
    );
    assert!(actions.is_empty());
    assert_eq!(sim.run, before);
}

#[test]
fn artifacts_pass_a_file_from_one_step_to_the_next() {
    let sim = Sim::new("artifact-passing.yaml", &[]).drive(|l| {
        let mut r = ok("hello world");
        for (name, _) in &l.spec.artifact_paths {
            r.files.insert(name.clone(), "hello world\n".into());
        }
        (1000, r)
    });
    assert_eq!(sim.run.phase, Phase::Succeeded);
    assert_eq!(
        sim.launched[0].spec.artifact_paths,
        [(
            "artifact:hello-art".to_owned(),
            "/tmp/hello_world.txt".to_owned()
        )]
    );
    assert_eq!(
        sim.launched[1].spec.input_files,
        [("/tmp/message".to_owned(), "hello world\n".to_owned())]
    );
    // Through a nested steps template and back out of it.
    let sim = Sim::new("nested-workflow.yaml", &[]).drive(|l| {
        let mut r = ok("");
        for (name, _) in &l.spec.artifact_paths {
            r.files.insert(name.clone(), "hello world\n".into());
        }
        for (name, _) in &l.spec.output_paths {
            r.files.insert(name.clone(), "my-output-parameter\n".into());
        }
        (1000, r)
    });
    assert_eq!(sim.run.phase, Phase::Succeeded, "{:#?}", sim.run.nodes);
    let last = sim.launched.last().unwrap();
    assert_eq!(
        last.spec.input_files,
        [("/tmp/art".to_owned(), "hello world\n".to_owned())]
    );
    assert!(
        last.spec.args[0].contains("input parameter value: my-output-parameter"),
        "{:?}",
        last.spec.args
    );
    // A missing artifact file fails the step that should have written it.
    let sim = Sim::new("artifact-passing.yaml", &[]).drive(|_| (1000, ok("")));
    assert_eq!(sim.run.phase, Phase::Failed);
    assert_eq!(sim.launched.len(), 1);
    // The message says what an artifact may be (the agent drops a directory or a big file).
    let producer = sim
        .run
        .nodes
        .iter()
        .find(|n| n.name.ends_with(".generate-artifact"))
        .expect("the producing step");
    assert_eq!(
        producer.message.as_deref(),
        Some(
            "output artifact hello-art: /tmp/hello_world.txt was not found in the container, \
             or is a directory or larger than 64 KiB (outputs and artifacts pass between steps \
             as one file of at most 64 KiB, through the coordinator)"
        )
    );
}

#[test]
fn a_loop_past_the_run_limits_errors_instead_of_unfolding() {
    // 300 kB of withParam (100,000 items) took the coordinator past 24 GB: each item's node
    // keeps a copy of its scope, the workflow's parameters included.
    let text = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  name: fan\n\
                spec:\n  entrypoint: main\n  arguments:\n    parameters:\n    - name: items\n\
                \x20     value: '[]'\n    - name: pad\n      value: ''\n  templates:\n\
                \x20 - name: main\n    steps:\n    - - name: each\n        template: work\n\
                \x20       withParam: '{{workflow.parameters.items}}'\n  - name: work\n\
                \x20   container:\n      image: busybox\n      command: ['true']\n";
    let start = |items: usize, pad: usize| {
        let wf = nightshift_pipeline::load(text).unwrap();
        let params = BTreeMap::from([
            (
                "items".to_owned(),
                serde_json::to_string(&vec![0; items]).unwrap(),
            ),
            ("pad".to_owned(), "x".repeat(pad)),
        ]);
        let mut run = Run::start(wf, "r", &params, 0).unwrap();
        run.handle(0, Input::Tick);
        run
    };
    let each = |run: &Run| {
        run.nodes
            .iter()
            .find(|n| n.name.ends_with(".each"))
            .cloned()
            .unwrap()
    };
    // Past the steps of a run, and past the bytes their scopes hold.
    for (items, pad, limit) in [
        (12_000, 0, "10000 steps"),
        (1_000, 100_000, "67108864 bytes"),
    ] {
        let run = start(items, pad);
        assert!(
            run.nodes.len() < 10,
            "{items} items: {} nodes",
            run.nodes.len()
        );
        let each = each(&run);
        assert_eq!(each.phase, Phase::Errored);
        let message = each.message.unwrap_or_default();
        assert!(message.contains(limit), "{message}");
    }
    // Within them, one node per item.
    let run = start(5_000, 1_000);
    assert_eq!(each(&run).children.len(), 5_000);
}

/// The edges of a finished run, by node name.
fn edges(sim: &Sim) -> Vec<(String, String)> {
    let name = |id: NodeId| sim.run.nodes[id].name.clone();
    let mut out: Vec<(String, String)> = sim
        .run
        .edges()
        .into_iter()
        .map(|(a, b)| (name(a), name(b)))
        .collect();
    out.sort();
    out
}

#[test]
fn the_diamond_is_drawn_as_a_diamond() {
    let sim = Sim::new("dag-diamond.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    let e = |a: &str, b: &str| (format!("dag-diamond{a}"), format!("dag-diamond{b}"));
    assert_eq!(
        edges(&sim),
        [
            e("", ".A"),
            e(".A", ".B"),
            e(".A", ".C"),
            e(".B", ".D"),
            e(".C", ".D")
        ]
    );
}

#[test]
fn steps_are_drawn_group_after_group() {
    let sim = Sim::new("steps.yaml", &[]).drive(|l| (1000, ok(&echo(l))));
    let names: Vec<&str> = sim.run.nodes.iter().map(|n| n.name.as_str()).collect();
    let root = names[0];
    let hello1 = sim.node(&format!("{root}.hello1")).name.clone();
    let e = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(
        edges(&sim),
        [
            e(root, &hello1),
            e(&hello1, &format!("{root}.hello2a")),
            e(&hello1, &format!("{root}.hello2b")),
        ]
    );
}
