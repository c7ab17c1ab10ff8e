//! `nightshift logs` against the real Docker engine: the coordinator proxies the request to
//! the agent of the node running the job, which streams the container's output.

use std::process::Stdio;
use std::time::Duration;

use nightshift_common::JobState;
use nightshift_tests::*;
use tokio::io::AsyncReadExt;

const STARTUP: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_from_the_start_the_tail_and_following() {
    init_tracing();
    require_images();
    let one = OneNode::start("logs", 4).await;
    let (client, coordinator) = (&one.client, &one.coordinator);
    let job = client
        .submit(&trainer_job("chatty", 4, 1_000_000, 20, 100))
        .await
        .unwrap();
    wait_for("the job to run", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then_some(())
    })
    .await;
    let id = job.id.to_string();
    // The trainer prints its configuration, then "starting fresh".
    let all = wait_for("the first lines", STARTUP, || async {
        let (code, out, _) = nightshift(&coordinator.url, &["logs", &id]).await;
        (code == 0 && out.contains("starting fresh")).then_some(out)
    })
    .await;
    assert!(all.starts_with("toy-trainer: job="), "{all}");
    let (code, tail, err) = nightshift(&coordinator.url, &["logs", &id, "--tail", "1"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(tail, "starting fresh\n");

    let mut follow = tokio::process::Command::new(workspace_bin("nightshift"))
        .args(["--coordinator", &coordinator.url, "logs", &id, "-f"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("nightshift logs -f");
    tokio::time::sleep(Duration::from_secs(1)).await;
    client.cancel(job.id).await.unwrap();
    let mut followed = String::new();
    let mut stdout = follow.stdout.take().expect("stdout");
    tokio::time::timeout(
        Duration::from_secs(60),
        stdout.read_to_string(&mut followed),
    )
    .await
    .expect("the stream ends when the container exits")
    .expect("read");
    let status = follow.wait().await.expect("wait");
    assert!(status.success(), "{status:?}");
    assert!(followed.contains("starting fresh"), "{followed}");
    assert!(
        followed.contains("received SIGTERM"),
        "what the job wrote after the follow began: {followed}"
    );

    // Once the job has ended and its container is removed, the agent's kept copy answers.
    wait_for("the job to end", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Cancelled).then_some(())
    })
    .await;
    wait_for("its container to be removed", STARTUP, || async {
        containers(&one.node, "job").is_empty().then_some(())
    })
    .await;
    let (code, kept, err) = nightshift(&coordinator.url, &["logs", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert!(kept.starts_with("toy-trainer: job="), "{kept}");
    assert!(kept.contains("received SIGTERM"), "{kept}");
    let (code, last, err) = nightshift(&coordinator.url, &["logs", &id, "--tail", "1"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(last.lines().count(), 1, "{last}");
    assert!(kept.ends_with(&last), "{last} is the end of {kept}");

    let (code, _, err) = nightshift(&coordinator.url, &["logs", "999"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("job 999 not found"), "{err}");
}
