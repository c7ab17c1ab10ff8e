//! Two coordinators sharing a PostgreSQL database (crate nightshift_coordinator::leader), two
//! agents on fake GPUs following them, jobs running in real Docker containers: the leader's
//! SIGKILL, a freeze past its lock session's timeout, an outage of the database, a freeze of
//! the database backend that holds the leader's lock, and then the clean shutdown of the
//! leader that took over by its lease each leave one leader, every job and every
//! acknowledged submission, every lease once, and the job containers untouched.
//!
//! The database is a server of this test's own (tests/postgres.sh), so that stopping it
//! disturbs no other test.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nightshift_cli::client::Client;
use nightshift_common::{JobList, JobSpec, JobState, JobView};
use nightshift_coordinator::leader::LEADER_LOCK;
use nightshift_tests::postgres::{OwnServer, installed};
use nightshift_tests::*;

/// How long the agents may hear from no leader without their fail-safe acting: longer than
/// the database outage below.
const LEASE_TTL_MS: u64 = 60_000;

/// PostgreSQL is needed: a run by hand without it skips, saying so; tests/run.sh and CI
/// (which install it) fail without it.
fn skip() -> bool {
    if installed() {
        return false;
    }
    if std::env::var_os("NIGHTSHIFT_TEST_POSTGRES").is_some() || std::env::var_os("CI").is_some() {
        panic!("PostgreSQL is not installed (apt-get install postgresql; tests/run.sh does)");
    }
    eprintln!(
        "SKIPPED: the failover tests need PostgreSQL, which is not installed, and \
         NIGHTSHIFT_TEST_POSTGRES is unset (run tests/run.sh, or apt-get install postgresql)"
    );
    true
}

/// A coordinator configuration under `dir` on the database `db`.
fn config(dir: &Path, db: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = coordinator_config(&dir.join("state"));
    cfg.lease_ttl_ms = LEASE_TTL_MS;
    let path = dir.join("coordinator.toml");
    let toml = coordinator_toml(&cfg) + &format!("[store]\nurl = \"{db}\"\n");
    std::fs::write(&path, toml).unwrap();
    path
}

/// Whether the coordinator at `url` leads (a standby answers `/healthz` with 503).
async fn leads(url: &str) -> bool {
    Client::new(url).unwrap().healthz().await.is_ok()
}

/// What the coordinator at `url` answers as a standby: its error, which names the leader.
async fn standby_says(url: &str) -> Option<String> {
    match Client::new(url).unwrap().healthz().await {
        Err(e) if e.status().map(|s| s.as_u16()) == Some(503) => Some(e.to_string()),
        _ => None,
    }
}

/// Every lease of `jobs`, by id: none granted twice, and the GPUs of the live ones on a node
/// never lent twice.
fn leases_once(jobs: &[JobView]) -> BTreeSet<u64> {
    let mut ids = BTreeSet::new();
    let mut lent = BTreeSet::new();
    for job in jobs {
        for lease in &job.leases {
            assert!(ids.insert(lease.lease_id), "lease {} twice", lease.lease_id);
            if !lease.revoked {
                for gpu in &lease.gpus {
                    assert!(
                        lent.insert((lease.node.clone(), *gpu)),
                        "GPU {gpu} of {} lent twice: {jobs:?}",
                        lease.node
                    );
                }
            }
        }
    }
    ids
}

/// The jobs as `nightshift jobs --output json` lists them through both coordinators' URLs.
async fn cli_jobs(urls: &str) -> Vec<JobView> {
    let (code, out, err) = nightshift(urls, &["jobs", "--output", "json"]).await;
    assert_eq!(code, 0, "nightshift jobs failed: {err}");
    serde_json::from_str::<JobList>(&out).unwrap().jobs
}

/// What must hold after each disruption: the same jobs, running under the same leases, in
/// the same containers; and every submission acknowledged since (`acked`, id and name) listed.
async fn unchanged(
    urls: &str,
    before: &[JobView],
    acked: &[(u64, String)],
    containers_before: &[Vec<(String, String, String)>],
    nodes: &[String],
) {
    let mut after = cli_jobs(urls).await;
    for (id, name) in acked {
        assert!(
            after.iter().any(|j| j.id == *id && j.spec.name == *name),
            "acknowledged submission {id} ({name}) is listed: {after:?}"
        );
    }
    after.retain(|j| !acked.iter().any(|(id, _)| *id == j.id));
    assert_eq!(
        after.iter().map(|j| j.id).collect::<Vec<_>>(),
        before.iter().map(|j| j.id).collect::<Vec<_>>(),
        "every job is listed, and no other"
    );
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(a.state, JobState::Running, "job {} runs: {a:?}", a.id);
        assert_eq!(
            b.leases
                .iter()
                .map(|l| (l.lease_id, l.epoch))
                .collect::<Vec<_>>(),
            a.leases
                .iter()
                .map(|l| (l.lease_id, l.epoch))
                .collect::<Vec<_>>(),
            "job {} keeps its lease",
            a.id
        );
    }
    assert_eq!(leases_once(&after), leases_once(before));
    for (node, before) in nodes.iter().zip(containers_before) {
        assert_eq!(
            &containers(node, "job"),
            before,
            "the job containers of {node}"
        );
    }
}

/// The backend (process id) holding the leaders' advisory lock in database `ha`, if one does.
fn lock_holder(pg: &OwnServer) -> Option<String> {
    let key = LEADER_LOCK as u64;
    let pid = pg.psql(
        "ha",
        &format!(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = {} AND objid = {} AND objsubid = 1",
            key >> 32,
            key & 0xffff_ffff
        ),
    );
    (!pid.is_empty()).then_some(pid)
}

/// The leader's term and URL as the database records them.
fn leader_row(pg: &OwnServer) -> (String, String) {
    let row = pg.psql("ha", "SELECT term, url FROM nightshift_leader");
    let (term, url) = row.split_once('|').expect("term|url");
    (term.to_owned(), url.to_owned())
}

/// Whether the leader holds the advisory lock, as the database records it: `t` or `f`.
fn lock_held(pg: &OwnServer) -> String {
    pg.psql("ha", "SELECT lock_held FROM nightshift_leader")
}

/// Polls both coordinators (`urls`) every 100 ms until one leads in a term past `term`,
/// asserting meanwhile that never both serve, nor one from an older term, and that it comes
/// within 10 s of `since`: its URL, and when the old leader `old` stopped serving.
async fn next_leader(
    pg: &OwnServer,
    urls: [&str; 2],
    old: &str,
    term: &str,
    since: Instant,
) -> (String, Option<Duration>) {
    let mut stopped = None;
    loop {
        let (la, lb) = tokio::join!(leads(urls[0]), leads(urls[1]));
        assert!(
            !(la && lb),
            "two leaders at once, {:?} after the disruption",
            since.elapsed()
        );
        let old_serves = (la && urls[0] == old) || (lb && urls[1] == old);
        if stopped.is_none() && !old_serves {
            stopped = Some(since.elapsed());
        }
        let (now, url) = leader_row(pg);
        if now != term {
            // Whoever serves now leads in the new term: none serves from the old one.
            for (serves, at) in [(la, urls[0]), (lb, urls[1])] {
                assert!(
                    !serves || url == at,
                    "{at} serves while {url} leads in term {now}"
                );
            }
            if la || lb {
                return (url, stopped);
            }
        }
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "no coordinator leads 10 s after the disruption (term {now}; the old leader \
             stopped serving after {stopped:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A process stopped with SIGSTOP, continued when dropped (a stopped backend would hold the
/// server's shutdown up).
struct Stopped(String);

impl Stopped {
    fn new(pid: &str) -> Self {
        let status = std::process::Command::new("kill")
            .args(["-STOP", pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -STOP {pid} failed");
        Self(pid.to_owned())
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0])
            .status();
    }
}

/// Submits a one-GPU job (queued: every GPU is lent) every 200 ms through `urls` until `stop`,
/// recording the id and name of each one acknowledged.
async fn submit_until(urls: String, acked: Arc<Mutex<Vec<(u64, String)>>>, stop: Arc<AtomicBool>) {
    let client = Client::new(&urls).unwrap();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let name = format!("ha-freeze-{n}");
        if let Ok(job) = client.submit(&JobSpec::new(&name, TRAINER_IMAGE, 1)).await {
            acked.lock().unwrap().push((job.id, name));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_on_postgres_fail_over_and_stop_no_job() {
    if skip() {
        return;
    }
    init_tracing();
    require_images();
    let pg = OwnServer::start("ha");
    let db = pg.database("ha");
    let dir = tempfile::tempdir().unwrap();
    let (port_a, port_b) = (free_port(), free_port());
    let (config_a, config_b) = (
        config(&dir.path().join("a"), &db),
        config(&dir.path().join("b"), &db),
    );
    let (state_a, state_b) = (dir.path().join("a/state"), dir.path().join("b/state"));

    let a = CoordinatorProcess::spawn(port_a, &state_a, &config_a);
    let url_a = a.url.clone();
    wait_for("a to lead", Duration::from_secs(60), || async {
        leads(&url_a).await.then_some(())
    })
    .await;
    let mut b = CoordinatorProcess::spawn(port_b, &state_b, &config_b);
    let url_b = b.url.clone();
    let says = wait_for("b to stand by", Duration::from_secs(60), || async {
        standby_says(&url_b).await
    })
    .await;
    assert!(
        says.contains(&url_a),
        "the standby names the leader: {says}"
    );
    let both = format!("{url_a},{url_b}");
    let client = Client::new(&both).unwrap();

    let nodes = [unique_node("ha-1"), unique_node("ha-2")];
    let _cleanup: Vec<Cleanup> = nodes.iter().map(|n| Cleanup(n.clone())).collect();
    let mut agents = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let cfg = agent_config(&both, node, &dir.path().join(format!("work-{i}")), 4);
        agents.push(start_agent(cfg, 4).await.0);
    }
    let mut jobs = Vec::new();
    for name in ["ha-job-1", "ha-job-2"] {
        jobs.push(
            client
                .submit(&trainer_job(name, 4, 1_000_000, 20, 100))
                .await
                .unwrap()
                .id,
        );
    }
    wait_for("both jobs to run", Duration::from_secs(120), || async {
        let list = client.jobs().await.ok()?.jobs;
        list.iter()
            .all(|j| j.state == JobState::Running)
            .then_some(())
    })
    .await;
    let before = cli_jobs(&both).await;
    assert_eq!(before.len(), 2);
    let containers_before: Vec<_> = nodes.iter().map(|n| containers(n, "job")).collect();
    assert!(
        containers_before
            .iter()
            .flatten()
            .filter(|c| c.2 == "running")
            .count()
            == 2,
        "one job container runs on each node: {containers_before:?}"
    );
    let term = |pg: &OwnServer| pg.psql("ha", "SELECT term FROM nightshift_leader");
    assert_eq!(term(&pg), "1");

    // The leader dies: the standby leads within 10 s, with every job and lease.
    let killed = Instant::now();
    a.kill();
    wait_for("b to lead", Duration::from_secs(10), || async {
        leads(&url_b).await.then_some(())
    })
    .await;
    eprintln!("failover after SIGKILL: {:?}", killed.elapsed());
    assert_eq!(term(&pg), "2");
    // Several heartbeats through the new leader.
    tokio::time::sleep(Duration::from_secs(3)).await;
    unchanged(&both, &before, &[], &containers_before, &nodes).await;

    // The new leader freezes past its lock session's timeout: the restarted first one
    // leads; thawed, the frozen one finds its term stale and stands by.
    let mut a = CoordinatorProcess::spawn(port_a, &state_a, &config_a);
    wait_for("a to stand by", Duration::from_secs(60), || async {
        standby_says(&url_a).await
    })
    .await;
    b.signal("STOP");
    let frozen = Instant::now();
    wait_for("a to lead again", Duration::from_secs(30), || async {
        leads(&url_a).await.then_some(())
    })
    .await;
    eprintln!("failover after SIGSTOP: {:?}", frozen.elapsed());
    assert_eq!(term(&pg), "3");
    b.signal("CONT");
    // At once: its lock session was last confirmed before the freeze, so it serves nothing.
    assert!(!leads(&url_b).await, "the thawed coordinator still leads");
    wait_for(
        "b, thawed, to stand by for a",
        Duration::from_secs(10),
        || async { standby_says(&url_b).await.filter(|s| s.contains(&url_a)) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(term(&pg), "3", "the thawed coordinator took nothing back");
    unchanged(&both, &before, &[], &containers_before, &nodes).await;

    // The database stops for 20 s: both coordinators stand by; it starts again: one leads,
    // and nothing is lost.
    pg.halt();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !leads(&url_a).await && !leads(&url_b).await,
        "no leader without the database"
    );
    tokio::time::sleep(Duration::from_secs(15)).await;
    pg.resume();
    let back = Instant::now();
    wait_for(
        "a leader after the outage",
        Duration::from_secs(30),
        || async { (leads(&url_a).await || leads(&url_b).await).then_some(()) },
    )
    .await;
    eprintln!(
        "a leader after the database came back: {:?}",
        back.elapsed()
    );
    assert_eq!(term(&pg), "4");
    tokio::time::sleep(Duration::from_secs(3)).await;
    unchanged(&both, &before, &[], &containers_before, &nodes).await;

    // The database backend of the leader's lock session freezes: the leader's renewals hang
    // and it steps down, while the stopped backend keeps the advisory lock (no timeout of the
    // server's acts in a stopped process). A coordinator (the other, or the old leader as a
    // standby) leads within 10 s by the lease; never two at once; every submission
    // acknowledged around the switches is kept.
    let old_leader = if leads(&url_a).await { &url_a } else { &url_b };
    let holder = wait_for(
        "the leader's lock session to hold the lock",
        Duration::from_secs(10),
        || async {
            // The same backend twice, a second apart: a standby never keeps the lock.
            let first = lock_holder(&pg)?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            (lock_holder(&pg)? == first).then_some(first)
        },
    )
    .await;
    let (acked, stop_writing) = (
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(AtomicBool::new(false)),
    );
    let writer = tokio::spawn(submit_until(
        both.clone(),
        acked.clone(),
        stop_writing.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let frozen = Stopped::new(&holder);
    let since = Instant::now();
    let (leader, stopped) = next_leader(&pg, [&url_a, &url_b], old_leader, "4", since).await;
    let failover = since.elapsed();
    eprintln!(
        "failover after the lock backend froze: {failover:?} (the old leader stopped serving \
         after {stopped:?}; {leader} leads)"
    );
    assert!(
        failover < Duration::from_secs(10),
        "a coordinator leads {failover:?} after the leader's lock backend froze"
    );
    assert_eq!(term(&pg), "5");
    assert_eq!(lock_held(&pg), "f", "the frozen backend keeps the lock");

    // That leader, by the lease and without the lock, shuts down cleanly: it gives the lease
    // up, and the other leads at its next try rather than a lease later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leaving = if leader == url_a { &mut a } else { &mut b };
    let since = Instant::now();
    let status = leaving.terminate().await;
    assert!(status.success(), "the leader's clean shutdown: {status}");
    let (leader, _) = next_leader(&pg, [&url_a, &url_b], &leader, "5", since).await;
    let handover = since.elapsed();
    eprintln!("a leader after the leader by the lease shut down: {handover:?} ({leader} leads)");
    assert!(
        handover < Duration::from_secs(3),
        "the standby leads {handover:?} after the leader's clean shutdown (the lease lasts {:?})",
        nightshift_coordinator::leader::LEASE
    );
    assert_eq!(term(&pg), "6");
    let standby = if leader == url_a { &url_b } else { &url_a };
    leaving.respawn();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_writing.store(true, Ordering::Relaxed);
    writer.await.unwrap();

    // Thawed, the backend finds its client gone and ends, freeing the lock: the leader takes
    // it (so that its own death is seen at once again), and a standby that gets it first
    // lets it go without deposing the leader.
    drop(frozen);
    wait_for(
        "the leader to hold the lock again",
        Duration::from_secs(10),
        || async { (lock_held(&pg) == "t").then_some(()) },
    )
    .await;
    wait_for(
        "the other coordinator to stand by for the leader",
        Duration::from_secs(10),
        || async { standby_says(standby).await.filter(|s| s.contains(&leader)) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(term(&pg), "6", "the lock's return deposed no one");
    assert!(leads(&leader).await && !leads(standby).await);
    let acked = acked.lock().unwrap().clone();
    eprintln!(
        "{} submissions acknowledged around the switches",
        acked.len()
    );
    assert!(!acked.is_empty(), "some submissions were acknowledged");
    unchanged(&both, &before, &acked, &containers_before, &nodes).await;
    drop(client);
    for agent in agents {
        agent.stop();
    }
    drop((a, b));
}
