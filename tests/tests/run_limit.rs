//! A job's run-time limit (`maxRunSeconds`) on the real Docker engine: the coordinator takes
//! its lease back when the limit is reached, the agent stops the container with the job's
//! checkpoint signal, and the job fails without a retry.

use std::time::Duration;

use nightshift_common::JobState;
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_stopped_at_its_run_time_limit_and_not_retried() {
    init_tracing();
    require_images();
    let one = OneNode::start("runlimit", 4).await;
    let (client, coordinator) = (&one.client, &one.coordinator);
    let mut spec = trainer_job("bounded", 4, 1_000_000, 20, 100);
    spec.max_run_seconds = Some(3);
    spec.retry.limit = 2;
    let job = client.submit(&spec).await.unwrap();
    let running = wait_for("the job to run", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(j)
    })
    .await;
    let started = running
        .attempt_started_at
        .expect("a running job's attempt start");

    let ended = wait_for("the job to end", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    assert_eq!(
        (ended.state, ended.attempt, ended.failures),
        (JobState::Failed, 1, 1),
        "{ended:#?}"
    );
    assert!(ended.timed_out, "{ended:#?}");
    assert_eq!(
        ended.message.as_deref(),
        Some("stopped after running 3 s, its limit (maxRunSeconds: 3)")
    );
    // Stopped at its limit: the signal, the trainer's checkpoint and exit took the rest.
    let ran = ended.ran_ms;
    assert!((3_000..8_000).contains(&ran), "ran {ran} ms");
    assert!(ended.finished_at.unwrap() >= started + 3_000);

    // The container got the checkpoint signal, not a kill.
    let (code, out, err) = nightshift(&coordinator.url, &["logs", &job.id.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("received SIGTERM"), "{out}");
}
