//! Open-source nginx, whose health checks are passive only, in front of two replicas that real
//! agents manage: POSTs sent without pause while one replica is lent to a job and started
//! again all succeed with the configuration docs/LOAD_BALANCER.md gives (read from the page
//! itself), on the host's network, where a loading replica refuses connections, and on Docker's
//! bridge network, where its proxy accepts and resets them and `non_idempotent` resends them.
//!
//! nginx is a throwaway process (`master_process off`) on 127.0.0.1 with its own prefix under
//! a temporary directory; `tests/run.sh` installs the Debian package when it is missing.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nightshift_agent::config::ReplicaNetwork;
use nightshift_cli::client::Client;
use nightshift_common::{JobState, ReplicaState};
use nightshift_tests::*;

const DOC: &str = include_str!("../../docs/LOAD_BALANCER.md");
const STARTUP: Duration = Duration::from_secs(60);
/// How long the stand-in "loads" after each start: on the bridge network, the time during
/// which Docker's proxy accepts and resets connections to the replica.
const LOAD_DELAY_MS: u64 = 3_000;
/// Clients sending POSTs one after another through nginx.
const CLIENTS: usize = 3;
/// Bounds on the load, whatever happens: requests in all, and seconds.
const MAX_REQUESTS: u64 = 5_000;
const MAX_LOAD: Duration = Duration::from_secs(50);

/// The two tests each run two replicas and nginx; one at a time keeps their timing apart.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The documented configuration for open-source nginx: the page's one `nginx` block without
/// nginx Plus's `health_check`.
fn documented_block() -> &'static str {
    let blocks: Vec<&str> = DOC
        .split("```nginx\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .filter(|block| !block.contains("health_check"))
        .collect();
    assert_eq!(
        blocks.len(),
        1,
        "docs/LOAD_BALANCER.md has one open-source nginx block"
    );
    blocks[0]
}

/// `block` with its `listen` on 127.0.0.1:`port` and its upstream servers replaced by
/// `replicas`, each with the parameters of the page's first server line.
fn localised(block: &str, port: u16, replicas: &[SocketAddr]) -> String {
    let is_server = |l: &str| l.trim_start().starts_with("server ") && !l.trim_end().ends_with('{');
    let first = block.lines().find(|l| is_server(l)).expect("a server line");
    let params: Vec<&str> = first
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .skip(2)
        .collect();
    let mut out = Vec::new();
    let mut servers_written = false;
    for line in block.lines() {
        if is_server(line) {
            if !servers_written {
                for r in replicas {
                    out.push(format!("    server {r} {};", params.join(" ")));
                }
                servers_written = true;
            }
        } else if line.trim() == "listen 80;" {
            out.push(format!("    listen 127.0.0.1:{port};"));
        } else {
            out.push(line.to_owned());
        }
    }
    out.join("\n")
}

/// A whole nginx configuration around `block`, everything under `dir`.
fn nginx_conf(dir: &Path, block: &str) -> String {
    let d = dir.display();
    format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 256; }}\nhttp {{\n\
         log_format upstreams '$status $upstream_addr $upstream_status';\n\
         access_log {d}/access.log upstreams;\n\
         client_body_temp_path {d}/client_body;\nproxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\nuwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n\
         {block}\n}}\n"
    )
}

fn nginx_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("nginx"))
        .find(|bin| bin.is_file())
        .expect("nginx is missing: tests/run.sh installs it (apt-get install nginx)")
}

/// nginx on 127.0.0.1, killed when dropped.
struct Nginx {
    child: std::process::Child,
    dir: tempfile::TempDir,
    url: String,
}

impl Nginx {
    async fn start(block: &str, replicas: &[SocketAddr]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let conf = dir.path().join("nginx.conf");
        let text = nginx_conf(dir.path(), &localised(block, port, replicas));
        tracing::info!(config = %text, "nginx configuration");
        std::fs::write(&conf, text).expect("write nginx.conf");
        let child = std::process::Command::new(nginx_binary())
            .arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn nginx");
        let nginx = Self {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        };
        let client = reqwest::Client::new();
        let url = nginx.url.clone();
        wait_for("nginx to pass a request on", STARTUP, || {
            let (client, url) = (client.clone(), url.clone());
            async move { (complete(&client, &url, 1).await == Ok(200)).then_some(()) }
        })
        .await;
        nginx
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs from [`CLIENTS`] clients, one after another each, until stopped or a bound is hit.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(url: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client");
        let tasks = (0..CLIENTS)
            .map(|_| {
                let (stop, ok, failed, sent) =
                    (stop.clone(), ok.clone(), failed.clone(), sent.clone());
                let (client, url) = (client.clone(), url.to_owned());
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst)
                        && sent.fetch_add(1, Ordering::SeqCst) < MAX_REQUESTS
                        && started.elapsed() < MAX_LOAD
                    {
                        match complete(&client, &url, 3).await {
                            Ok(200) => {
                                ok.fetch_add(1, Ordering::SeqCst);
                            }
                            other => failed.lock().unwrap().push(format!(
                                "{:.1} s: {other:?}",
                                started.elapsed().as_secs_f64()
                            )),
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
            })
            .collect();
        Self {
            stop,
            ok,
            failed,
            tasks,
        }
    }

    /// Stops the clients and returns (succeeded, failures).
    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await.expect("client task");
        }
        let failed = self.failed.lock().unwrap().clone();
        (self.ok.load(Ordering::SeqCst), failed)
    }
}

async fn replica_state(client: &Client, node: &str) -> Option<ReplicaState> {
    let nodes = client.nodes().await.ok()?;
    nodes
        .nodes
        .into_iter()
        .find(|n| n.name == node)?
        .replica
        .map(|r| r.state)
}

/// Requests the replica at `addr` has completed since it started (vLLM's counter).
async fn served(addr: SocketAddr) -> f64 {
    let Ok(r) = reqwest::get(format!("http://{addr}/metrics")).await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What the clients and nginx saw.
struct Outcome {
    ok: u64,
    failed: Vec<String>,
    access_log: String,
    error_log: String,
}

impl Outcome {
    fn assert_nothing_lost(&self) {
        let (ok, failed) = (self.ok, &self.failed);
        assert!(
            failed.is_empty(),
            "{} of {} requests failed: {failed:#?}\nnginx's error log:\n{}",
            failed.len(),
            ok + failed.len() as u64,
            self.error_log
        );
        assert!(ok >= 100, "only {ok} requests were sent");
        // nginx's `$upstream_addr` lists both replicas for a request it took from one to
        // the other.
        let retried = self.access_log.lines().filter(|l| l.contains(", ")).count();
        assert!(
            retried > 0,
            "nginx never met the lent replica down:\n{}",
            self.access_log
        );
    }
}

/// Two agents' replicas on `network` behind nginx configured with `block`; one replica is
/// lent to a job and started again while the clients send POSTs.
async fn through_a_lend(network: ReplicaNetwork, block: &str) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let mut nodes = Vec::new();
    let mut replicas = Vec::new();
    let mut agents = Vec::new();
    let mut cleanups = Vec::new();
    for i in 0..2 {
        let node = unique_node(&format!("nginx{i}"));
        cleanups.push(Cleanup(node.clone()));
        let mut cfg = agent_config(
            &coordinator.url,
            &node,
            &dir.path().join(format!("work{i}")),
            4,
        );
        // A fixed port: nginx's upstream names it, through every restart.
        let port = free_port();
        cfg.replica.network = network;
        cfg.replica
            .env
            .push(format!("STANDIN_LOAD_DELAY_MS={LOAD_DELAY_MS}"));
        match network {
            ReplicaNetwork::Host => {
                cfg.replica.port = port;
                cfg.replica.host_port = 0;
                cfg.replica.env.push(format!("STANDIN_PORT={port}"));
                cfg.replica.env.push("STANDIN_HOST=127.0.0.1".to_owned());
            }
            ReplicaNetwork::Bridge => cfg.replica.host_port = port,
        }
        replicas.push(SocketAddr::from(([127, 0, 0, 1], port)));
        agents.push(start_agent(cfg, 4).await.0);
        nodes.push(node);
    }
    for node in &nodes {
        wait_for("both replicas to serve", STARTUP, || async {
            (replica_state(&client, node).await == Some(ReplicaState::Serving)).then_some(())
        })
        .await;
    }
    let nginx = Nginx::start(block, &replicas).await;
    let load = Load::start(&nginx.url);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // One job of four GPUs: one node is lent (drained, stopped), runs it for about a second,
    // and serves again (the replica starts and loads).
    let job = client
        .submit(&trainer_job("lend-one", 4, 20, 20, 100))
        .await
        .unwrap();
    let lent = wait_for("the job to run", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        (j.state == JobState::Running).then(|| j.leases.first().map(|l| l.node.clone()))?
    })
    .await;
    let done = wait_for("the job to end", STARTUP, || async {
        let j = client.job(job.id).await.ok()?;
        j.state.is_finished().then_some(j)
    })
    .await;
    assert_eq!(done.state, JobState::Succeeded, "{done:#?}");
    let lent_at = replicas[nodes.iter().position(|n| *n == lent).expect("a test node")];
    wait_for("the lent replica to serve again", STARTUP, || async {
        (replica_state(&client, &lent).await == Some(ReplicaState::Serving)).then_some(())
    })
    .await;
    // nginx tries the replica again within fail_timeout and finds it serving.
    wait_for(
        "nginx to send the restarted replica requests",
        Duration::from_secs(10),
        || async { (served(lent_at).await > 0.0).then_some(()) },
    )
    .await;
    let (ok, failed) = load.finish().await;
    let (access_log, error_log) = (nginx.read("access.log"), nginx.read("error.log"));
    tracing::info!(ok, failed = failed.len(), %error_log, "load through nginx");
    for a in agents {
        a.stop();
    }
    drop(cleanups);
    Outcome {
        ok,
        failed,
        access_log,
        error_log,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_checks_lose_no_post_when_replicas_use_the_host_network() {
    init_tracing();
    require_images();
    let _one = ONE_AT_A_TIME.lock().await;
    let seen = through_a_lend(ReplicaNetwork::Host, documented_block()).await;
    seen.assert_nothing_lost();
    // The lent replica refused while it was down (stopped, then loading).
    assert!(
        seen.error_log.contains("(111: Connection refused)"),
        "{}",
        seen.error_log
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_checks_lose_no_post_on_the_bridge_network() {
    init_tracing();
    require_images();
    let _one = ONE_AT_A_TIME.lock().await;
    let seen = through_a_lend(ReplicaNetwork::Bridge, documented_block()).await;
    seen.assert_nothing_lost();
    // Docker's proxy accepted while the replica loaded and then dropped the connection, and
    // nginx resent those. Whether nginx sees a reset or a bare close depends on whether its
    // request had reached the proxy's socket when the proxy gave up: either shows the proxy
    // answering for a replica that was not listening yet.
    assert!(
        seen.error_log.contains("(104: Connection reset by peer)")
            || seen
                .error_log
                .contains("upstream prematurely closed connection while reading response header"),
        "{}",
        seen.error_log
    );
}
