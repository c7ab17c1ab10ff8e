//! The coordinator's store, each case on both backends: a SQLite file and a PostgreSQL
//! database of its own on the run's throwaway server (tests/src/postgres.rs).

use std::collections::BTreeMap;

use nightshift_common::{JobSpec, JobState, JobView, NodeMode};
use nightshift_coordinator::store::{
    Changes, ImageRecord, SCHEMA_VERSION, Store, StoreError, StoreUrl,
};
use nightshift_core::{NodeSnapshot, Usage};
use nightshift_tests::postgres::{TestDatabase, database};

/// Where one case's state lives; [`Backend::open`] opens it again, as a restart would.
enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres(TestDatabase),
}

impl Backend {
    fn open(&self) -> Store {
        self.try_open().unwrap()
    }

    fn try_open(&self) -> Result<Store, StoreError> {
        match self {
            Self::Sqlite(dir) => Store::open(dir.path()),
            Self::Postgres(db) => Store::open_url(&StoreUrl::parse(&db.url()).unwrap(), None),
        }
    }
}

/// Runs `case` on a fresh store of each backend, saying which one failed.
fn on_both(name: &str, case: impl Fn(&Backend)) {
    let backends = [
        Backend::Sqlite(tempfile::tempdir().unwrap()),
        Backend::Postgres(database(name)),
    ];
    for backend in &backends {
        let which = match backend {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres(_) => "postgres",
        };
        eprintln!("{name}: on {which}");
        case(backend);
    }
}

fn job(id: u64) -> JobView {
    JobView::queued(id, JobSpec::new("t", "i", 1), 5)
}

#[test]
fn written_changes_come_back_after_reopening() {
    on_both("reopen", |backend| {
        let mut store = backend.open();
        let mut j = job(1);
        store
            .write(&Changes {
                jobs: vec![j.clone()],
                counters: Some((2, 1, 1)),
                ..Default::default()
            })
            .unwrap();
        j.state = JobState::Running;
        j.attempt = 2;
        store
            .write(&Changes {
                jobs: vec![j.clone(), job(2)],
                counters: Some((3, 5, 7)),
                ..Default::default()
            })
            .unwrap();
        drop(store);
        let store = backend.open();
        assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
        let snapshot = store.load().unwrap();
        assert_eq!(snapshot.jobs, vec![j.clone(), job(2)]);
        assert_eq!(
            (
                snapshot.next_job_id,
                snapshot.next_lease_id,
                snapshot.next_epoch
            ),
            (3, 5, 7)
        );
    });
}

#[test]
fn batches_written_together_apply_in_order() {
    on_both("batches", |backend| {
        let mut store = backend.open();
        let mut later = job(1);
        later.state = JobState::Running;
        store
            .write_all(&[
                Changes {
                    jobs: vec![job(1)],
                    counters: Some((2, 1, 1)),
                    ..Default::default()
                },
                Changes {
                    jobs: vec![later.clone(), job(2)],
                    counters: Some((3, 4, 4)),
                    ..Default::default()
                },
            ])
            .unwrap();
        drop(store);
        let snapshot = backend.open().load().unwrap();
        assert_eq!(snapshot.jobs, vec![later.clone(), job(2)]);
        assert_eq!(snapshot.next_lease_id, 4);
    });
}

#[test]
fn counters_never_go_backwards() {
    on_both("counters", |backend| {
        let mut store = backend.open();
        store
            .write(&Changes {
                counters: Some((9, 9, 9)),
                ..Default::default()
            })
            .unwrap();
        store
            .write_all(&[
                Changes {
                    counters: Some((3, 3, 3)),
                    ..Default::default()
                },
                Changes {
                    counters: Some((4, 10, 2)),
                    ..Default::default()
                },
            ])
            .unwrap();
        let s = store.load().unwrap();
        assert_eq!((s.next_job_id, s.next_lease_id, s.next_epoch), (9, 10, 9));
    });
}

#[test]
fn nodes_with_their_checkpoints_come_back_in_name_order() {
    let node = |name: &str, checkpoints| NodeSnapshot {
        name: name.into(),
        service: "llm".into(),
        address: format!("{name}.example"),
        gpus: Vec::new(),
        mode: NodeMode::Lend,
        desired_version: 3,
        mode_since: 9,
        checkpoints,
    };
    on_both("nodes", |backend| {
        let mut store = backend.open();
        store
            .write_all(&[
                Changes {
                    nodes: vec![node("b", vec![(1, 1)]), node("a", Vec::new())],
                    ..Default::default()
                },
                Changes {
                    // Upper case sorts first in byte order, whatever the collation.
                    nodes: vec![node("b", Vec::new()), node("Z", vec![(7, 12), (9, 4)])],
                    ..Default::default()
                },
            ])
            .unwrap();
        drop(store);
        let nodes = backend.open().load().unwrap().nodes;
        assert_eq!(
            nodes,
            vec![
                node("Z", vec![(7, 12), (9, 4)]),
                node("a", Vec::new()),
                node("b", Vec::new())
            ]
        );
    });
}

#[test]
fn ended_leases_are_accounted_by_node() {
    let usage = |lease_id, job_id, node: &str, gpus, started_at, ended_at| Usage {
        lease_id,
        job_id,
        team: "research".into(),
        node: node.into(),
        gpus,
        started_at,
        ended_at,
        preempted: lease_id % 2 == 0,
        lost_gpu_ms: lease_id * 10,
    };
    on_both("usage", |backend| {
        let mut store = backend.open();
        store
            .write_all(&[
                Changes {
                    usage: vec![usage(1, 1, "n1", 4, 1_000, 2_000)],
                    ..Default::default()
                },
                Changes {
                    usage: vec![
                        usage(2, 1, "n2", 2, 2_000, 5_000),
                        usage(3, 2, "n1", 1, 6_000, 7_000),
                    ],
                    ..Default::default()
                },
            ])
            .unwrap();
        drop(store);
        let store = backend.open();
        assert_eq!(
            store.usage(1_500, 6_000).unwrap(),
            vec![
                usage(1, 1, "n1", 4, 1_000, 2_000),
                usage(2, 1, "n2", 2, 2_000, 5_000)
            ]
        );
        assert_eq!(
            store.harvested_gpu_ms().unwrap(),
            vec![("n1".to_owned(), 5_000), ("n2".to_owned(), 6_000)]
        );
        assert_eq!(store.last_node_of(1).unwrap().as_deref(), Some("n2"));
        assert_eq!(store.last_node_of(9).unwrap(), None);
    });
}

#[test]
fn the_first_image_reported_for_an_attempt_stands() {
    let images = |node: &str, at, runs: &[(u64, u32, &str)]| Changes {
        images: runs
            .iter()
            .map(|&(job, attempt, id)| ImageRecord {
                job,
                attempt,
                node: node.to_owned(),
                image_id: id.to_owned(),
                image_digest: None,
                at,
            })
            .collect(),
        ..Changes::default()
    };
    on_both("images", |backend| {
        let mut store = backend.open();
        let runs = [(1, 1, "sha256:aa"), (2, 1, "sha256:bb")];
        store.write(&images("n1", 5, &runs)).unwrap();
        // Every heartbeat repeats it, in one batch or the next; a later attempt (after a
        // preemption) may differ.
        store
            .write_all(&[
                images("n1", 6, &runs),
                images("n2", 7, &[(2, 2, "sha256:cc"), (2, 1, "sha256:zz")]),
                images("n2", 8, &[(2, 2, "sha256:yy")]),
            ])
            .unwrap();
        drop(store);
        let mut store = backend.open();
        assert_eq!(
            store.image_ids(&[1, 2, 3]).unwrap(),
            BTreeMap::from([(1, "sha256:aa".to_owned()), (2, "sha256:cc".to_owned())])
        );
        // A registry digest, when reported, is what the job's image is known by: any host
        // can pull it.
        let mut pinned = images("n1", 8, &[(3, 1, "sha256:dd")]);
        pinned.images[0].image_digest = Some("reg:5000/t@sha256:ee".into());
        store.write(&pinned).unwrap();
        assert_eq!(
            store.image_ids(&[3]).unwrap(),
            BTreeMap::from([(3, "reg:5000/t@sha256:ee".to_owned())])
        );
    });
}

#[test]
fn a_postgres_schema_newer_than_the_coordinator_is_refused() {
    let db = database("newer");
    let url = StoreUrl::parse(&db.url()).unwrap();
    drop(Store::open_url(&url, None).unwrap());
    db.psql("UPDATE nightshift_schema SET version = 99");
    let err = Store::open_url(&url, None).err().unwrap().to_string();
    assert!(
        err.contains(&format!("/{} has schema version 99", db.name)),
        "{err}"
    );
}

#[test]
fn postgres_over_tls_checks_the_servers_certificate() {
    let db = database("tls");
    let url = StoreUrl::parse(&db.tls_url()).unwrap();
    let mut store = Store::open_url(&url, Some(&db.ca_file())).unwrap();
    store
        .write(&Changes {
            jobs: vec![job(1)],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(store.load().unwrap().jobs, vec![job(1)]);
    drop(store);
    // The server's certificate is signed by the test CA only: the system's roots refuse it.
    let err = Store::open_url(&url, None).err().unwrap().to_string();
    assert!(err.contains("cannot connect"), "{err}");
    assert!(!err.contains("password"), "{err}");
}

#[test]
fn the_store_location_never_shows_the_password() {
    let url = "postgres://nightshift:s3cret@db.example:5433/state?sslmode=require";
    let parsed = StoreUrl::parse(url).unwrap();
    assert_eq!(parsed, StoreUrl::Postgres(url.to_owned()));
    assert_eq!(
        nightshift_coordinator::store::redact(url),
        "postgres://nightshift@db.example:5433/state"
    );
    for bad in [
        "mysql://x",
        "sqlite://relative/path",
        "postgres://u:s3cret@/?port=x",
    ] {
        let err = StoreUrl::parse(bad).err().unwrap().to_string();
        assert!(!err.contains("s3cret"), "{err}");
    }
}

#[test]
fn validate_checks_that_the_postgres_store_is_reachable_and_its_schema_known() {
    use nightshift_tests::{coordinator_config, coordinator_toml, free_port, workspace_bin};
    let db = database("validate");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("coordinator.toml");
    let validate = |url: &str| {
        let toml = coordinator_toml(&coordinator_config(&dir.path().join("state")))
            + &format!("[store]\nurl = \"{url}\"\n");
        std::fs::write(&config, toml).unwrap();
        let out = std::process::Command::new(workspace_bin("nightshift-coordinator"))
            .arg("validate")
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = validate(&db.url());
    assert!(ok, "{out}{err}");
    assert!(
        out.contains(&format!(
            "is reachable, at schema version 0; serve brings it to {SCHEMA_VERSION}"
        )),
        "{out}"
    );
    drop(Store::open_url(&StoreUrl::parse(&db.url()).unwrap(), None).unwrap());
    let (ok, out, _) = validate(&db.url());
    assert!(
        ok && out.contains(&format!("at schema version {SCHEMA_VERSION}\n")),
        "{out}"
    );
    assert_eq!(
        db.psql("SELECT count(*) FROM jobs"),
        "0",
        "validate changes nothing"
    );

    let nobody = format!("postgres://postgres:s3cret@127.0.0.1:{}/x", free_port());
    let (ok, out, err) = validate(&nobody);
    assert!(!ok, "{out}");
    assert!(err.contains("cannot connect"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

#[test]
fn migrate_copies_a_stopped_sqlite_installation_into_an_empty_postgres_database() {
    use nightshift_tests::workspace_bin;
    let dir = tempfile::tempdir().unwrap();
    let db = database("migrate");
    let mut running = job(2);
    running.state = JobState::Running;
    let usage = Usage {
        lease_id: 4,
        job_id: 1,
        team: "nlp".into(),
        node: "n1".into(),
        gpus: 2,
        started_at: 1_000,
        ended_at: 3_000,
        preempted: true,
        lost_gpu_ms: 500,
    };
    let node = NodeSnapshot {
        name: "n1".into(),
        service: "llm".into(),
        address: "10.0.0.1".into(),
        gpus: Vec::new(),
        mode: NodeMode::Lend,
        desired_version: 7,
        mode_since: 9,
        checkpoints: vec![(2, 5)],
    };
    let mut sqlite = Store::open(dir.path()).unwrap();
    let mut pipelines = Changes::default();
    pipelines.pipelines.runs = vec![pipeline_run(1)];
    // Sequence numbers as stored, gaps and all.
    pipelines.pipelines.inputs = vec![(1, 0, finished(3, 0)), (1, 4, finished(4, 1))];
    pipelines.pipelines.jobs = vec![(1, 0, 0, 1), (1, 1, 0, 2)];
    sqlite.write(&pipelines).unwrap();
    sqlite
        .write(&Changes {
            jobs: vec![job(1), running.clone()],
            nodes: vec![node.clone()],
            usage: vec![usage.clone()],
            counters: Some((3, 5, 6)),
            images: vec![ImageRecord {
                job: 2,
                attempt: 1,
                node: "n1".into(),
                image_id: "sha256:aa".into(),
                image_digest: Some("reg/t@sha256:bb".into()),
                at: 2_000,
            }],
            ..Default::default()
        })
        .unwrap();
    let before = sqlite.load().unwrap();
    drop(sqlite);

    let migrate = || {
        let out = std::process::Command::new(workspace_bin("nightshift-coordinator"))
            .arg("migrate")
            .arg("--from")
            .arg(format!("sqlite:{}", dir.path().display()))
            .arg("--to")
            .arg(db.url())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A coordinator still running on it holds its data directory's lock: refused.
    let lock = nightshift_coordinator::store::DataDirLock::acquire(dir.path()).unwrap();
    let (ok, _, err) = migrate();
    assert!(
        !ok && err.contains("in use by another coordinator"),
        "{err}"
    );
    drop(lock);

    let (ok, out, err) = migrate();
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("copied 2 jobs, 1 nodes, 1 ended leases, 1 pipeline runs and 1 image records"),
        "{out}"
    );
    let pg = Store::open_url(&StoreUrl::parse(&db.url()).unwrap(), None).unwrap();
    let after = pg.load().unwrap();
    assert_eq!(after.jobs, before.jobs);
    assert_eq!(after.nodes, vec![node]);
    assert_eq!(
        (after.next_job_id, after.next_lease_id, after.next_epoch),
        (3, 5, 6)
    );
    assert_eq!(pg.usage(0, u64::MAX >> 1).unwrap(), vec![usage]);
    let p = pg.load_pipelines().unwrap();
    assert_eq!(p.runs, vec![pipeline_run(1)]);
    assert_eq!(
        p.inputs,
        BTreeMap::from([(1, vec![finished(3, 0), finished(4, 1)])])
    );
    assert_eq!(
        db.psql("SELECT string_agg(seq::text, ',' ORDER BY seq) FROM pipeline_inputs"),
        "0,4"
    );
    assert_eq!(
        pg.image_ids(&[2]).unwrap(),
        BTreeMap::from([(2, "reg/t@sha256:bb".to_owned())])
    );
    drop(pg);

    // A second copy would merge two installations' ids: refused, nothing changed.
    let (ok, _, err) = migrate();
    assert!(!ok);
    assert!(
        err.contains("already holds a coordinator's state (2 jobs, 1 nodes)"),
        "{err}"
    );
    assert_eq!(db.psql("SELECT count(*) FROM jobs"), "2");
}

#[test]
fn a_lost_postgres_connection_is_replaced_by_the_next_call() {
    let db = database("reconnect");
    let mut store = Store::open_url(&StoreUrl::parse(&db.url()).unwrap(), None).unwrap();
    let write = |store: &mut Store, id| {
        store.write(&Changes {
            jobs: vec![job(id)],
            counters: Some((id + 1, 1, 1)),
            ..Default::default()
        })
    };
    write(&mut store, 1).unwrap();
    // The server ends the store's session, as a restart or a failover would.
    let ended = db.psql(&format!(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = '{}' AND pid <> pg_backend_pid()) t",
        db.name
    ));
    assert_eq!(ended, "1");
    // A call that finds the connection broken fails (the cluster then reloads its core from
    // the store, which connects again), one that finds it closed connects at once; either
    // way nothing is half-written and the call after works.
    let mut failed = 0;
    for attempt in 0..2 {
        match write(&mut store, 2) {
            Ok(()) => break,
            Err(e) => {
                failed += 1;
                assert_eq!(attempt, 0, "only the first call after the loss fails: {e}");
            }
        }
    }
    assert!(failed <= 1);
    let snapshot = store.load().unwrap();
    assert_eq!(snapshot.jobs, vec![job(1), job(2)]);
    assert_eq!(snapshot.next_job_id, 3);
}

fn pipeline_run(id: u64) -> nightshift_common::pipeline::PipelineRunRecord {
    nightshift_common::pipeline::PipelineRunRecord {
        id,
        file: "wf.yaml".into(),
        text: format!("# run {id}"),
        parameters: BTreeMap::from([("lr".to_owned(), "0.1".to_owned())]),
        started_at: 100 + id,
        pins: BTreeMap::new(),
    }
}

fn finished(now: u64, node: usize) -> nightshift_common::pipeline::PipelineInputRecord {
    nightshift_common::pipeline::PipelineInputRecord::Finished {
        now,
        node,
        retry: 0,
        outcome: "succeeded".into(),
        exit_code: Some(0),
        message: None,
        outputs: BTreeMap::from([("loss".to_owned(), "0.5".to_owned())]),
        stdout: None,
    }
}

#[test]
fn pipeline_runs_come_back_with_their_inputs_in_order_and_their_jobs() {
    use nightshift_common::pipeline::PipelineInputRecord::Tick;
    on_both("pipelines", |backend| {
        let mut store = backend.open();
        let mut first = Changes::default();
        first.pipelines.runs = vec![pipeline_run(1), pipeline_run(2)];
        first.pipelines.inputs = vec![(1, 0, Tick { now: 5 }), (2, 0, Tick { now: 6 })];
        first.pipelines.jobs = vec![(1, 0, 0, 10), (2, 0, 0, 11)];
        let mut second = Changes::default();
        let mut edited = pipeline_run(1);
        edited.started_at = 1;
        second.pipelines.runs = vec![edited.clone()];
        second.pipelines.inputs = vec![(1, 2, finished(9, 0)), (1, 1, Tick { now: 7 })];
        second.pipelines.jobs = vec![(1, 1, 2, 12)];
        store.write_all(&[first, second]).unwrap();
        drop(store);
        let p = backend.open().load_pipelines().unwrap();
        assert_eq!(p.runs, vec![edited.clone(), pipeline_run(2)]);
        assert_eq!(
            p.inputs,
            BTreeMap::from([
                (1, vec![Tick { now: 5 }, Tick { now: 7 }, finished(9, 0)]),
                (2, vec![Tick { now: 6 }]),
            ])
        );
        let mut jobs = p.jobs.clone();
        jobs.sort();
        assert_eq!(jobs, vec![(1, 0, 0, 10), (1, 1, 2, 12), (2, 0, 0, 11)]);
    });
}

#[test]
fn a_deposed_leaders_writes_are_refused_by_the_database() {
    let db = database("fence");
    let url = StoreUrl::parse(&db.url()).unwrap();
    let mut old = Store::open_url(&url, None).unwrap();
    // The leadership raised the term to 1 for the first leader (crate::leader).
    db.psql("UPDATE nightshift_leader SET term = term + 1, url = 'http://a:7400'");
    old.fence(1);
    let write = |store: &mut Store, id| {
        store.write(&Changes {
            jobs: vec![job(id)],
            counters: Some((id + 1, 1, 1)),
            ..Default::default()
        })
    };
    write(&mut old, 1).unwrap();
    // A second coordinator takes over: term 2.
    db.psql("UPDATE nightshift_leader SET term = term + 1, url = 'http://b:7400'");
    let mut new = Store::open_url(&url, None).unwrap();
    new.fence(2);
    match write(&mut old, 2) {
        Err(StoreError::Deposed { ours, current, .. }) => assert_eq!((ours, current), (1, 2)),
        other => panic!("a deposed leader's write went through: {other:?}"),
    }
    // Nothing of the refused transaction was written; the new leader writes.
    assert_eq!(db.psql("SELECT count(*) FROM jobs"), "1");
    assert_eq!(
        db.psql("SELECT value FROM meta WHERE key = 'next_job_id'"),
        "2"
    );
    write(&mut new, 3).unwrap();
    let snapshot = new.load().unwrap();
    assert_eq!(snapshot.jobs, vec![job(1), job(3)]);
    // The old one stays refused, however often it tries.
    assert!(matches!(
        write(&mut old, 4),
        Err(StoreError::Deposed { .. })
    ));
}

#[test]
fn a_term_raised_while_a_leaders_write_is_open_waits_for_it() {
    // The bump takes the row's lock; a write holds it FOR SHARE: the bump waits for the
    // write to end, so the new leader loads after it, never beside it.
    let db = database("fence_wait");
    let url = StoreUrl::parse(&db.url()).unwrap();
    let mut old = Store::open_url(&url, None).unwrap();
    db.psql("UPDATE nightshift_leader SET term = 1");
    old.fence(1);
    let holder = std::thread::spawn({
        let url = db.url();
        move || {
            // Psql holds the share lock for a moment, as a slow write would.
            let bin = std::fs::read_dir("/usr/lib/postgresql")
                .unwrap()
                .flatten()
                .map(|e| e.path().join("bin/psql"))
                .find(|p| p.exists())
                .unwrap();
            std::process::Command::new(bin)
                .args([
                    "-X",
                    "-q",
                    &url,
                    "-c",
                    "BEGIN; SELECT term FROM nightshift_leader WHERE id = 1 FOR SHARE; \
                     SELECT pg_sleep(1); COMMIT;",
                ])
                .output()
                .unwrap()
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let started = std::time::Instant::now();
    db.psql("UPDATE nightshift_leader SET term = 2");
    let waited = started.elapsed();
    assert!(holder.join().unwrap().status.success());
    assert!(
        waited >= std::time::Duration::from_millis(400),
        "the bump did not wait for the open write: {waited:?}"
    );
    let refused = old.write(&Changes {
        jobs: vec![job(1)],
        ..Default::default()
    });
    assert!(
        matches!(refused, Err(StoreError::Deposed { .. })),
        "{refused:?}"
    );
}
