//! Host facts against the real Docker engine: a job is not started while the checkpoint
//! volume is below the configured free-space floor, and the lease says why: refused by the
//! host, which the coordinator does not count as the job's failure.

use std::sync::Arc;

use nightshift_agent::host::FixedHost;
use nightshift_common::{DesiredNode, HostFacts, JobRunState, LeaseGrant};
use nightshift_tests::*;

fn desired(version: u64, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve: false,
        leases,
        lease_ttl_ms: 600_000,
    }
}

fn lease(lease_id: u64) -> LeaseGrant {
    LeaseGrant {
        lease_id,
        epoch: lease_id,
        job_id: lease_id,
        attempt: 1,
        gpus: vec![0],
        job: trainer_job("needs-space", 1, 1_000_000, 10, 100),
        rendezvous: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_not_started_below_the_checkpoint_space_floor() {
    init_tracing();
    require_images();
    let node = unique_node("floor");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = agent_config("http://127.0.0.1:9", &node, dir.path(), 4);
    cfg.checkpoint_min_free_bytes = 10 << 30;
    let (r, shared, _) = reconciler(cfg, 4).await;
    let host = Arc::new(FixedHost::new(HostFacts {
        checkpoint_volume_free_bytes: Some(512 << 20),
        checkpoint_volume_total_bytes: Some(100 << 30),
        ..HostFacts::default()
    }));
    let mut r = r.with_host(host.clone());

    shared.offer_desired(desired(1, vec![lease(1)]));
    r.pass().await.expect("pass");
    assert!(containers(&node, "job").is_empty(), "nothing started");
    let run = shared
        .observed()
        .runs
        .into_iter()
        .next()
        .expect("run reported");
    let JobRunState::FailedToStart {
        message,
        refused_by_host: true,
    } = run.state
    else {
        panic!("expected a refusal by the host, got {:?}", run.state);
    };
    assert!(
        message.contains("536870912 bytes free") && message.contains("checkpoint_min_free_bytes"),
        "{message}"
    );

    // With room again, the next lease starts.
    host.set(HostFacts {
        checkpoint_volume_free_bytes: Some(50 << 30),
        ..HostFacts::default()
    });
    shared.offer_desired(desired(2, vec![lease(2)]));
    r.pass().await.expect("pass");
    let jobs = containers(&node, "job");
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].2, "running");
}
