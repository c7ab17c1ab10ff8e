//! A job's image is pinned to its registry digest at its first start: every later attempt
//! runs that digest, whatever the tag names by then.

mod sim;

use nightshift_common::JobState;
use sim::{Cluster, config, spec};

const TAG: &str = "reg:5000/team/train:1";
const PINNED: &str = "reg:5000/team/train@sha256:aaa";

/// The agent of `a` reports that its job containers run `digest`.
fn report_digest(c: &mut Cluster, digest: &str) {
    let mut beat = c.agent("a").heartbeat();
    for run in &mut beat.jobs {
        run.image_digest = Some(digest.to_owned());
    }
    let now = c.now;
    c.core.heartbeat(now, "a", beat).unwrap();
    c.assert_invariants();
}

#[test]
fn the_first_start_pins_the_image_and_later_attempts_run_the_digest() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, 60);
    let mut job = spec("train", 4);
    job.image = TAG.into();
    c.core.submit(c.now, job).unwrap();
    c.run(10);
    assert_eq!(c.core.job(1).unwrap().state, JobState::Running);
    assert_eq!(c.core.desired("a").unwrap().leases[0].job.image, TAG);

    report_digest(&mut c, PINNED);
    let job = c.core.job(1).unwrap();
    assert_eq!(job.image_digest.as_deref(), Some(PINNED));
    assert_eq!(job.spec.image, TAG, "the spec keeps the name as submitted");
    // A later report of another digest (the tag moved, a host pulled it again) changes
    // nothing.
    report_digest(&mut c, "reg:5000/team/train@sha256:bbb");
    assert_eq!(c.core.job(1).unwrap().image_digest.as_deref(), Some(PINNED));

    // Preempted and requeued: the next attempt's lease carries the pinned image.
    c.core.gateway(c.now, "llm", 12).unwrap();
    c.run(3);
    assert_eq!(c.core.job(1).unwrap().state, JobState::Queued);
    c.load("a", 0.0, 0.0);
    c.run(8);
    let job = c.core.job(1).unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Running, 2));
    assert_eq!(c.core.desired("a").unwrap().leases[0].job.image, PINNED);

    // It survives a restart of the coordinator: the view is the durable record.
    let view = c.core.job(1).unwrap();
    let back: nightshift_common::JobView =
        serde_json::from_str(&serde_json::to_string(&view).unwrap()).unwrap();
    assert_eq!(back.image_digest.as_deref(), Some(PINNED));
}

#[test]
fn a_job_that_ends_in_the_report_that_first_shows_it_is_pinned_too() {
    let mut c = Cluster::new(config(0), &[("a", 4)]);
    c.agent("a").jobs.durations.insert(1, 600);
    let mut job = spec("train", 4);
    job.image = TAG.into();
    c.core.submit(c.now, job).unwrap();
    c.run(10);
    let mut beat = c.agent("a").heartbeat();
    for run in &mut beat.jobs {
        run.state = nightshift_common::JobRunState::Exited {
            exit_code: 0,
            stopped_by_agent: false,
        };
        run.image_digest = Some(PINNED.to_owned());
    }
    let now = c.now;
    c.core.heartbeat(now, "a", beat).unwrap();
    let job = c.core.job(1).unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.image_digest.as_deref(), Some(PINNED));
}
