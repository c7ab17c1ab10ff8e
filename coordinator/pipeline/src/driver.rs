//! The pipeline driver: every run's state machine ([`Run`]) beside the job queue, what each
//! decides (the steps to launch as jobs, the jobs to cancel), and what must be stored to
//! rebuild it. It does no I/O and reads no clock: the coordinator passes `now` and the job
//! queue as a port ([`StepJobs`]), and writes [`PipelineChanges`] in the same transaction as
//! the jobs submitted.
//!
//! A run is stored as what it started from ([`PipelineRunRecord`]), every input it handled
//! in order ([`PipelineInputRecord`]) and the job of each (node, retry). After a restart the
//! runs are replayed from their inputs; a `Launch` whose (node, retry) already has a job is
//! not submitted again, so no step runs twice.

use std::collections::BTreeMap;

use nightshift_common::{
    Capture, CaptureFile, CheckpointPolicy, EnvVar, ImagePin, JobFile, JobSpec, JobState, JobView,
    PipelineInputRecord, PipelineNodeView, PipelineRunRecord, PipelineRunView, STDOUT_OUTPUT,
    SpecError, UnixMillis,
};

use crate::run::NodeId;
use crate::{Action, Input, Outcome, Run, StepResult, StepSpec};

/// The job queue as the driver sees it: where a run's steps become jobs.
pub trait StepJobs {
    /// Job `id` as it is now.
    fn job(&self, id: u64) -> Option<JobView>;
    /// Queues the job that runs a step, admitted as a job submitted alone would be; a
    /// refusal says why, and the step errors with it.
    fn submit(&mut self, now: UnixMillis, spec: JobSpec) -> Result<u64, String>;
    /// Cancels job `id`, whose run stopped the step; a job already finished stays so.
    fn cancel(&mut self, now: UnixMillis, id: u64);
}

/// What changed in the pipelines, to be written with the core's changes.
#[derive(Debug, Default)]
pub struct PipelineChanges {
    pub runs: Vec<PipelineRunRecord>,
    /// (run, sequence number, input).
    pub inputs: Vec<(u64, u64, PipelineInputRecord)>,
    /// (run, node, retry, job).
    pub jobs: Vec<(u64, usize, u32, u64)>,
}

impl PipelineChanges {
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty() && self.inputs.is_empty() && self.jobs.is_empty()
    }
}

/// What the store holds about pipelines, to rebuild them.
#[derive(Debug, Default)]
pub struct PipelineSnapshot {
    pub runs: Vec<PipelineRunRecord>,
    /// By run, in order.
    pub inputs: BTreeMap<u64, Vec<PipelineInputRecord>>,
    pub jobs: Vec<(u64, usize, u32, u64)>,
}

struct Active {
    record: PipelineRunRecord,
    run: Run,
    inputs: u64,
    jobs: BTreeMap<(NodeId, u32), u64>,
}

#[derive(Default)]
pub struct Pipelines {
    runs: BTreeMap<u64, Active>,
    pending: PipelineChanges,
    /// The id the next run gets: above every run's, and never lowered
    /// ([`Pipelines::continue_ids_from`]).
    next_id: u64,
}

impl Pipelines {
    /// Rebuilds every run by replaying its inputs.
    pub fn restore(snapshot: PipelineSnapshot) -> Result<Self, String> {
        let mut runs = BTreeMap::new();
        for record in snapshot.runs {
            let wf = crate::load(&record.text)
                .map_err(|e| format!("pipeline run {}: {e}", record.id))?;
            let inputs: Vec<(UnixMillis, Input)> = snapshot
                .inputs
                .get(&record.id)
                .into_iter()
                .flatten()
                .map(input_from_record)
                .collect();
            let (run, _) = Run::replay(
                wf,
                &record.id.to_string(),
                &record.parameters,
                record.started_at,
                &inputs,
            )
            .map_err(|e| format!("pipeline run {}: {e}", record.id))?;
            let active = Active {
                inputs: inputs.len() as u64,
                jobs: BTreeMap::new(),
                record,
                run,
            };
            runs.insert(active.record.id, active);
        }
        for (run, node, retry, job) in snapshot.jobs {
            if let Some(a) = runs.get_mut(&run) {
                a.jobs.insert((node, retry), job);
            }
        }
        let next_id = runs.keys().next_back().map_or(1, |k| k + 1);
        Ok(Self {
            runs,
            pending: PipelineChanges::default(),
            next_id,
        })
    }

    /// The id the next run will get.
    pub fn next_id(&self) -> u64 {
        self.next_id.max(1)
    }

    /// Gives no run an id below `next`. For a driver rebuilt from the store after a write
    /// failed: the lost driver may have given ids the store never saved, and each must still
    /// name one run only.
    pub fn continue_ids_from(&mut self, next: u64) {
        self.next_id = self.next_id.max(next);
    }

    pub fn take_changes(&mut self) -> PipelineChanges {
        std::mem::take(&mut self.pending)
    }

    /// Starts a run of the workflow `text`; its first steps are submitted by the next
    /// [`Pipelines::drive`] (the coordinator drives in the same call).
    pub fn submit(
        &mut self,
        now: UnixMillis,
        file: &str,
        text: &str,
        parameters: BTreeMap<String, String>,
    ) -> Result<u64, SpecError> {
        self.start(now, file, text, parameters, BTreeMap::new())
    }

    fn start(
        &mut self,
        now: UnixMillis,
        file: &str,
        text: &str,
        parameters: BTreeMap<String, String>,
        pins: BTreeMap<String, ImagePin>,
    ) -> Result<u64, SpecError> {
        let wf = crate::load(text).map_err(|diags| {
            let lines: Vec<String> = diags.0.iter().map(|d| d.display_in(file)).collect();
            SpecError::new("workflow", lines.join("; "))
        })?;
        let id = self.next_id();
        let run = Run::start(wf, &id.to_string(), &parameters, now)
            .map_err(|e| SpecError::new("parameters", e.to_string()))?;
        self.next_id = id + 1;
        let record = PipelineRunRecord {
            id,
            file: file.to_owned(),
            text: text.to_owned(),
            parameters,
            started_at: now,
            pins,
        };
        self.pending.runs.push(record.clone());
        self.runs.insert(
            id,
            Active {
                record,
                run,
                inputs: 0,
                jobs: BTreeMap::new(),
            },
        );
        Ok(id)
    }

    /// Starts a new run from what run `id` was started from: the same file text and
    /// parameters, so every step resolves to the same spec given the same upstream outputs,
    /// and each step that ran before runs the image it ran then (`images`: the image ID of
    /// each job that reported one; see [`Pipelines::jobs_of`]; `job_of`: a job as queued).
    pub fn rerun(
        &mut self,
        job_of: impl Fn(u64) -> Option<JobView>,
        now: UnixMillis,
        id: u64,
        images: &BTreeMap<u64, String>,
    ) -> Option<Result<u64, SpecError>> {
        let a = self.runs.get(&id)?;
        let record = a.record.clone();
        let mut pins = BTreeMap::new();
        for n in &a.run.nodes {
            // The newest job of the step whose image is known.
            let newest = a
                .jobs
                .iter()
                .filter(|((node, _), _)| *node == n.id)
                .rev()
                .find_map(|(_, job)| Some((*job, images.get(job)?)));
            let Some((job, image_id)) = newest else {
                continue;
            };
            // As written: a rerun of a rerun keeps the name the first run resolved.
            let image = match record.pins.get(&n.name) {
                Some(pin) => pin.image.clone(),
                None => match job_of(job) {
                    Some(view) => view.spec.image,
                    None => continue,
                },
            };
            pins.insert(
                n.name.clone(),
                ImagePin {
                    image,
                    id: image_id.clone(),
                },
            );
        }
        Some(self.start(now, &record.file, &record.text, record.parameters, pins))
    }

    /// Every job of run `id`'s steps.
    pub fn jobs_of(&self, id: u64) -> Option<Vec<u64>> {
        Some(self.runs.get(&id)?.jobs.values().copied().collect())
    }

    /// Whether run `id` exists.
    pub fn contains(&self, id: u64) -> bool {
        self.runs.contains_key(&id)
    }

    /// Feeds every run the jobs that ended and the time, and acts on what it decides: each
    /// step to launch is submitted to `jobs` (a refusal errors the step), each to stop is
    /// cancelled there.
    pub fn drive(&mut self, jobs: &mut impl StepJobs, now: UnixMillis) {
        for (id, a) in &mut self.runs {
            if a.run.phase.is_finished() {
                continue;
            }
            let mut queue: Vec<Input> = Vec::new();
            for _ in 0..1000 {
                for (&(node, retry), &job) in &a.jobs {
                    let n = &a.run.nodes[node];
                    if !(n.launched && n.retries == retry) {
                        continue;
                    }
                    if let Some(view) = jobs.job(job)
                        && view.state.is_finished()
                    {
                        queue.push(Input::Finished {
                            node,
                            retry,
                            result: result_of(&view),
                        });
                    }
                }
                let before = a.run.clone();
                let mut actions = Vec::new();
                let mut handled = Vec::new();
                for input in queue.drain(..) {
                    actions.extend(a.run.handle(now, input.clone()));
                    handled.push(input);
                }
                actions.extend(a.run.handle(now, Input::Tick));
                if a.run != before {
                    handled.push(Input::Tick);
                }
                for input in handled {
                    let seq = a.inputs;
                    a.inputs += 1;
                    self.pending.inputs.push((*id, seq, record_of(now, &input)));
                }
                let mut failed_launches = Vec::new();
                for action in actions {
                    match action {
                        Action::Launch {
                            node,
                            retry,
                            name,
                            spec,
                        } => {
                            if a.jobs.contains_key(&(node, retry)) {
                                continue;
                            }
                            let mut job = job_spec(&name, &spec);
                            if let Some(id) = pinned(&a.record.pins, &name, &spec.image) {
                                job.image = id.to_owned();
                            }
                            match jobs.submit(now, job) {
                                Ok(job) => {
                                    a.jobs.insert((node, retry), job);
                                    self.pending.jobs.push((*id, node, retry, job));
                                }
                                Err(message) => failed_launches.push(Input::Finished {
                                    node,
                                    retry,
                                    result: StepResult {
                                        outcome: Outcome::Errored { message },
                                        files: BTreeMap::new(),
                                        stdout: None,
                                    },
                                }),
                            }
                        }
                        Action::Cancel { node, .. } => {
                            let cancelled: Vec<u64> = a
                                .jobs
                                .iter()
                                .filter(|((n, _), _)| *n == node)
                                .map(|(_, j)| *j)
                                .collect();
                            for job in cancelled {
                                jobs.cancel(now, job);
                            }
                        }
                    }
                }
                if failed_launches.is_empty() {
                    break;
                }
                queue = failed_launches;
            }
        }
    }

    /// When a run next needs the time, at the latest.
    pub fn next_deadline(&self) -> Option<UnixMillis> {
        self.runs
            .values()
            .filter_map(|a| a.run.next_deadline())
            .min()
    }

    /// Run `id` as the API shows it; `job_of` tells a job as queued.
    pub fn view(
        &self,
        job_of: impl Fn(u64) -> Option<JobView>,
        id: u64,
    ) -> Option<PipelineRunView> {
        let a = self.runs.get(&id)?;
        let run = &a.run;
        let nodes = run
            .nodes
            .iter()
            .map(|n| {
                let jobs: Vec<u64> = a
                    .jobs
                    .iter()
                    .filter(|((node, _), _)| *node == n.id)
                    .map(|(_, j)| *j)
                    .collect();
                let last = jobs.last().and_then(|j| job_of(*j));
                PipelineNodeView {
                    id: n.id,
                    parent: n.parent,
                    name: n.name.clone(),
                    template: n.template.clone(),
                    phase: n.phase.as_str().to_owned(),
                    message: n.message.clone(),
                    retries: n.retries,
                    attempt: last.as_ref().map(|j| j.attempt),
                    preemptions: jobs
                        .iter()
                        .filter_map(|j| job_of(*j))
                        .map(|j| j.preemptions)
                        .sum(),
                    jobs,
                    started_at: n.started_at,
                    finished_at: n.finished_at,
                    outputs: n.outputs.clone(),
                    image_id: None,
                }
            })
            .collect();
        Some(PipelineRunView {
            id,
            name: run.wf.name.clone(),
            file: a.record.file.clone(),
            phase: run.phase.as_str().to_owned(),
            parameters: run.parameters.clone(),
            started_at: run.started_at,
            finished_at: run.finished_at,
            nodes,
        })
    }

    /// Run `id`'s graph as the web UI draws it: `(before, after)` by node id
    /// ([`crate::Run::edges`]).
    pub fn edges(&self, id: u64) -> Option<Vec<(usize, usize)>> {
        Some(self.runs.get(&id)?.run.edges())
    }

    /// Every run as the API shows it, oldest first.
    pub fn list(&self, job_of: impl Fn(u64) -> Option<JobView>) -> Vec<PipelineRunView> {
        self.runs
            .keys()
            .filter_map(|id| self.view(&job_of, *id))
            .collect()
    }
}

/// The job that runs a step: its container, GPUs (at least one: the unit of a lease), the
/// workflow's nightshift settings, and what to capture from it.
fn job_spec(name: &str, spec: &StepSpec) -> JobSpec {
    let defaults = CheckpointPolicy::default();
    JobSpec {
        name: name.chars().take(128).collect(),
        image: spec.image.clone(),
        command: spec.command.clone(),
        args: spec.args.clone(),
        env: spec
            .env
            .iter()
            .map(|(name, value)| EnvVar {
                name: name.clone(),
                value: value.clone(),
            })
            .collect(),
        gpus: spec.gpus.max(1),
        nodes: 1,
        // Argo's retryStrategy is the run's to apply; the job itself is not retried.
        retry: Default::default(),
        priority: spec.extras.priority.unwrap_or(0),
        owner: spec.extras.owner.clone(),
        checkpoint: CheckpointPolicy {
            signal: spec
                .extras
                .checkpoint_signal
                .clone()
                .unwrap_or(defaults.signal),
            grace_period_seconds: spec
                .extras
                .grace_period_seconds
                .unwrap_or(defaults.grace_period_seconds),
        },
        capture: Capture {
            files: spec
                .output_paths
                .iter()
                .chain(&spec.artifact_paths)
                .map(|(name, path)| CaptureFile {
                    name: name.clone(),
                    path: path.clone(),
                })
                .collect(),
            stdout: true,
        },
        files: spec
            .input_files
            .iter()
            .map(|(path, content)| JobFile {
                path: path.clone(),
                content: content.clone(),
            })
            .collect(),
        sandbox: Default::default(),
        max_run_seconds: None,
    }
}

/// The image ID a rerun's step `name` runs instead of `image`: the one the step ran before,
/// or else, for a step the earlier run did not have (a loop over other items), the one every
/// step of the earlier run that named `image` ran, if they agree.
fn pinned<'a>(pins: &'a BTreeMap<String, ImagePin>, name: &str, image: &str) -> Option<&'a str> {
    if let Some(pin) = pins.get(name) {
        return (pin.image == image).then_some(pin.id.as_str());
    }
    let mut ids = pins.values().filter(|p| p.image == image).map(|p| &p.id);
    let first = ids.next()?;
    ids.all(|id| id == first).then_some(first.as_str())
}

/// How a finished job ended, for its run.
fn result_of(job: &JobView) -> StepResult {
    let mut files = job.outputs.clone();
    let stdout = files.remove(STDOUT_OUTPUT);
    let outcome = match (job.state, job.exit_code) {
        (JobState::Succeeded, _) => Outcome::Succeeded,
        (JobState::Failed, Some(code)) => Outcome::Failed { exit_code: code },
        (_, _) => Outcome::Errored {
            message: job
                .message
                .clone()
                .unwrap_or_else(|| format!("job {} {}", job.id, job.state.as_str())),
        },
    };
    StepResult {
        outcome,
        files,
        stdout,
    }
}

fn record_of(now: UnixMillis, input: &Input) -> PipelineInputRecord {
    match input {
        Input::Tick => PipelineInputRecord::Tick { now },
        Input::Finished {
            node,
            retry,
            result,
        } => {
            let (outcome, exit_code, message) = match &result.outcome {
                Outcome::Succeeded => ("succeeded", None, None),
                Outcome::Failed { exit_code } => ("failed", Some(*exit_code), None),
                Outcome::Errored { message } => ("errored", None, Some(message.clone())),
            };
            PipelineInputRecord::Finished {
                now,
                node: *node,
                retry: *retry,
                outcome: outcome.to_owned(),
                exit_code,
                message,
                outputs: result.files.clone(),
                stdout: result.stdout.clone(),
            }
        }
    }
}

fn input_from_record(r: &PipelineInputRecord) -> (UnixMillis, Input) {
    match r {
        PipelineInputRecord::Tick { now } => (*now, Input::Tick),
        PipelineInputRecord::Finished {
            now,
            node,
            retry,
            outcome,
            exit_code,
            message,
            outputs,
            stdout,
        } => {
            let outcome = match (outcome.as_str(), exit_code) {
                ("succeeded", _) => Outcome::Succeeded,
                ("failed", Some(code)) => Outcome::Failed { exit_code: *code },
                _ => Outcome::Errored {
                    message: message.clone().unwrap_or_default(),
                },
            };
            (
                *now,
                Input::Finished {
                    node: *node,
                    retry: *retry,
                    result: StepResult {
                        outcome,
                        files: outputs.clone(),
                        stdout: stdout.clone(),
                    },
                },
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIAMOND: &str = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  \
        name: d\nspec:\n  entrypoint: main\n  templates:\n  - name: main\n    dag:\n      \
        tasks:\n      - {name: A, template: echo}\n      - {name: B, template: echo, \
        depends: A}\n  - name: echo\n    container:\n      image: busybox\n";

    /// A job queue in memory: every job as submitted, finished when the test says, and a
    /// refusal for every submission while `refusing` says why.
    #[derive(Default)]
    struct Queue {
        jobs: BTreeMap<u64, JobView>,
        cancelled: Vec<u64>,
        refusing: Option<String>,
    }

    impl Queue {
        fn finish(&mut self, id: u64, state: JobState) {
            self.jobs.get_mut(&id).expect("a job").state = state;
        }
    }

    impl StepJobs for Queue {
        fn job(&self, id: u64) -> Option<JobView> {
            self.jobs.get(&id).cloned()
        }

        fn submit(&mut self, now: UnixMillis, spec: JobSpec) -> Result<u64, String> {
            if let Some(why) = &self.refusing {
                return Err(why.clone());
            }
            let id = self.jobs.len() as u64 + 1;
            let job = JobView::queued(id, spec, now);
            self.jobs.insert(id, job);
            Ok(id)
        }

        fn cancel(&mut self, _: UnixMillis, id: u64) {
            self.cancelled.push(id);
        }
    }

    /// What the store would hold after `changes`.
    fn stored(changes: PipelineChanges) -> PipelineSnapshot {
        let mut inputs: BTreeMap<u64, Vec<PipelineInputRecord>> = BTreeMap::new();
        for (run, _, input) in changes.inputs {
            inputs.entry(run).or_default().push(input);
        }
        PipelineSnapshot {
            runs: changes.runs,
            inputs,
            jobs: changes.jobs,
        }
    }

    fn phases(p: &Pipelines, q: &Queue) -> Vec<(String, String)> {
        let view = p.view(|j| q.job(j), 1).expect("run 1");
        let mut phases = vec![("run".to_owned(), view.phase)];
        phases.extend(view.nodes.into_iter().map(|n| (n.name, n.phase)));
        phases
    }

    #[test]
    fn steps_launch_in_order_and_a_restored_run_launches_none_twice() {
        let mut q = Queue::default();
        let mut p = Pipelines::default();
        let run = p
            .submit(1_000, "wf.yaml", DIAMOND, BTreeMap::new())
            .unwrap();
        assert_eq!(run, 1);
        assert!(q.jobs.is_empty(), "a submitted run launches when driven");
        p.drive(&mut q, 1_000);
        let names: Vec<&str> = q.jobs.values().map(|j| j.spec.name.as_str()).collect();
        assert_eq!(names, ["d.A"]);
        // Rebuilt from what was stored, the run knows A has its job.
        let mut p = Pipelines::restore(stored(p.take_changes())).unwrap();
        p.drive(&mut q, 2_000);
        assert_eq!(q.jobs.len(), 1, "A is not launched again");
        q.finish(1, JobState::Succeeded);
        p.drive(&mut q, 3_000);
        let names: Vec<&str> = q.jobs.values().map(|j| j.spec.name.as_str()).collect();
        assert_eq!(names, ["d.A", "d.B"]);
        q.finish(2, JobState::Succeeded);
        p.drive(&mut q, 4_000);
        let phase = |p: &Pipelines| phases(p, &q)[0].1.clone();
        assert_eq!(phase(&p), "Succeeded");
        assert!(q.cancelled.is_empty());
    }

    #[test]
    fn a_step_the_queue_refuses_errors_with_the_reason() {
        let mut q = Queue {
            refusing: Some("policy.allowed_images: image busybox is not allowed".into()),
            ..Queue::default()
        };
        let mut p = Pipelines::default();
        p.submit(1_000, "wf.yaml", DIAMOND, BTreeMap::new())
            .unwrap();
        p.drive(&mut q, 1_000);
        assert!(q.jobs.is_empty());
        let view = p.view(|j| q.job(j), 1).unwrap();
        let a = view.nodes.iter().find(|n| n.name == "d.A").unwrap();
        assert_eq!(
            a.message.as_deref(),
            Some("policy.allowed_images: image busybox is not allowed")
        );
        assert_eq!(view.phase, "Failed", "{:?}", phases(&p, &q));
    }

    fn pin(image: &str, id: &str) -> ImagePin {
        ImagePin {
            image: image.into(),
            id: id.into(),
        }
    }

    #[test]
    fn a_rerun_pins_by_step_then_by_image_when_the_earlier_steps_agree() {
        let pins = BTreeMap::from([
            ("w.A".to_owned(), pin("busybox", "sha256:aa")),
            ("w.B(0:x)".to_owned(), pin("alpine:3.23", "sha256:bb")),
            ("w.B(1:y)".to_owned(), pin("alpine:3.23", "sha256:bb")),
            ("w.C".to_owned(), pin("tool:1", "sha256:c1")),
            ("w.D".to_owned(), pin("tool:1", "sha256:c2")),
        ]);
        assert_eq!(pinned(&pins, "w.A", "busybox"), Some("sha256:aa"));
        // The step now names another image (a parameter changed): not pinned.
        assert_eq!(pinned(&pins, "w.A", "busybox:musl"), None);
        // A loop child the earlier run did not have: its image, all earlier steps agreeing.
        assert_eq!(pinned(&pins, "w.B(2:z)", "alpine:3.23"), Some("sha256:bb"));
        assert_eq!(pinned(&pins, "w.E", "tool:1"), None, "two IDs: ambiguous");
        assert_eq!(pinned(&pins, "w.E", "never-ran"), None);
        assert_eq!(pinned(&BTreeMap::new(), "w.A", "busybox"), None);
    }
}
