//! The busy scenario the faults land in: training jobs kept queued, a pipeline always
//! running, and the service's load rising and falling so that nodes are lent and reclaimed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nightshift_common::{JobSpec, PipelineSubmit};
use tokio::sync::watch;

use super::check::Ledger;
use super::rig::Rig;

/// The rig's registry, as the hosts reach it (lib.sh's `NSC_REGISTRY`).
pub const REGISTRY: &str = "198.18.0.1:5000";

/// What the service's gateway reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    /// Alternating nights and days on their own timer.
    Cycle,
    /// No request waits: the autoscaler lends the spare nodes.
    Night,
    /// A surge: requests wait, the autoscaler wants every replica back.
    Day,
}

/// Training jobs kept active at once, each on half a node.
const TRAINING_JOBS: usize = 3;

/// A training job: about a minute of steps, a checkpoint every second, 5 s of grace.
pub fn training_job(n: u64) -> JobSpec {
    spec(&format!(
        "name: fx-train-{n}
image: {REGISTRY}/nightshift/toy-trainer:dev
gpus: 2
checkpoint: {{gracePeriodSeconds: 5}}
env:
  - {{name: TRAINER_TARGET_STEP, value: \"3000\"}}
  - {{name: TRAINER_STEPS_PER_SEC, value: \"50\"}}
  - {{name: TRAINER_CHECKPOINT_EVERY, value: \"50\"}}
"
    ))
}

pub fn spec(yaml: &str) -> JobSpec {
    JobSpec::from_yaml(yaml).unwrap_or_else(|e| panic!("the harness's own job spec: {e}\n{yaml}"))
}

/// Three one-GPU steps in a row.
fn pipeline() -> PipelineSubmit {
    let text = format!(
        "apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: fx-pipe-
spec:
  entrypoint: main
  templates:
  - name: main
    steps:
    - - name: one
        template: work
    - - name: two
        template: work
    - - name: three
        template: work
  - name: work
    container:
      image: {REGISTRY}/busybox:latest
      command: [sh, -c, 'sleep 4; echo done']
      resources:
        limits:
          nvidia.com/gpu: 1
"
    );
    PipelineSubmit {
        file: "fx-pipe.yaml".to_owned(),
        text,
        parameters: Default::default(),
    }
}

/// Keeps the work flowing: every 2 s it tops the training jobs up, starts a pipeline when none
/// runs, and refreshes the runs' views. Calls that fail (the coordinator down, its disk full)
/// are counted, not fatal.
pub async fn keep_busy(
    rig: Arc<Rig>,
    ledger: Arc<Mutex<Ledger>>,
    refused: Arc<std::sync::atomic::AtomicU64>,
    mut stop: watch::Receiver<bool>,
) {
    let mut n = 0u64;
    let mut running_pipeline: Option<u64> = None;
    loop {
        if let Ok(list) = rig.api.jobs().await {
            let active = list
                .jobs
                .iter()
                .filter(|j| j.spec.name.starts_with("fx-train-") && !j.state.is_finished())
                .count();
            for _ in active..TRAINING_JOBS {
                n += 1;
                match rig.api.submit(&training_job(n)).await {
                    Ok(j) => ledger.lock().unwrap().track(j.id),
                    Err(_) => {
                        refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        break;
                    }
                }
            }
        }
        if let Some(id) = running_pipeline
            && let Ok(run) = rig.api.pipeline(id).await
        {
            let done = run.finished_at.is_some();
            ledger.lock().unwrap().runs.insert(id, run);
            if done {
                running_pipeline = None;
            }
        }
        if running_pipeline.is_none() {
            match rig.api.submit_pipeline(&pipeline()).await {
                Ok(run) => {
                    running_pipeline = Some(run.id);
                    let mut l = ledger.lock().unwrap();
                    l.pipelines.insert(run.id);
                    l.runs.insert(run.id, run);
                }
                Err(_) => {
                    refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Drives the service's gateway: in a day, 5 requests waiting, reported every 2 s (the rig's
/// gateway signal lives 5 s); in a night, nothing. `Cycle` alternates nights of 25 s and days
/// of 15 s.
pub async fn drive_load(rig: Arc<Rig>, mut want: watch::Receiver<Load>) {
    let mut cycle_started = Instant::now();
    loop {
        let load = *want.borrow();
        let day = match load {
            Load::Day => true,
            Load::Night => false,
            Load::Cycle => cycle_started.elapsed().as_secs() % 40 >= 25,
        };
        if day {
            let _ = rig.api.gateway("default", 5).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            changed = want.changed() => {
                if changed.is_err() {
                    return;
                }
                if *want.borrow() == Load::Cycle {
                    cycle_started = Instant::now();
                }
            }
        }
    }
}
