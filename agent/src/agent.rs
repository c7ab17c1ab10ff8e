//! Wiring the agent together: registration, the heartbeat and long-poll loops that keep the
//! desired state fresh, the reconcile loop that acts on it, and the HTTP endpoints: the
//! load balancer's `/ready`, the coordinator's API (`api.rs`) and `/metrics`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nightshift_common::{
    CheckpointStorage, Heartbeat, RegisterRequest, ReplicaState, ReplicaStatus, ServingSignals,
};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::config::AgentConfig;
use crate::engine::Engine;
use crate::gpus::Gpus;
use crate::host::Host;
use crate::host::sysinfo::SysinfoHost;
use crate::reconcile::Reconciler;
use crate::serving::ServingMetrics;
use crate::state::Shared;
use crate::uplink::{Uplink, UplinkError};

/// How often the reconcile loop looks again even when nothing new was heard.
const RESYNC: Duration = Duration::from_secs(1);
/// Wait after a failed call to the coordinator before trying again.
const RETRY: Duration = Duration::from_secs(1);

/// A running agent. Dropping it stops its tasks; the containers it manages keep running and
/// are adopted by the next agent.
pub struct AgentHandle {
    pub shared: Arc<Shared>,
    /// The load balancer's health check on its bound address, e.g.
    /// `http://127.0.0.1:7401/ready`.
    pub ready_url: Option<String>,
    /// The agent's API (`/status`, job logs) as the coordinator is told to reach it, e.g.
    /// `https://gpu-01:7402`; none without a readiness listener.
    pub api_url: Option<String>,
    /// Where `/metrics` answers, e.g. `http://127.0.0.1:9101/metrics`.
    pub metrics_url: Option<String>,
    tasks: JoinSet<()>,
}

impl AgentHandle {
    pub fn stop(mut self) {
        self.tasks.abort_all();
    }

    /// Waits until the agent's tasks end (they end only on a fatal error or abort).
    pub async fn wait(&mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Starts the agent's loops on the current runtime.
pub fn start<E: Engine, G: Gpus, S: ServingMetrics>(
    cfg: AgentConfig,
    engine: E,
    gpus: G,
    serving: S,
    readiness: Option<TcpListener>,
) -> anyhow::Result<AgentHandle> {
    let node = cfg.node_name();
    let shared = Arc::new(Shared::new(&node));
    let cfg = Arc::new(cfg);
    let (engine, gpus, serving) = (Arc::new(engine), Arc::new(gpus), Arc::new(serving));
    let uplink = Uplink::with_tls(&cfg.coordinator, &node, &cfg.tls)?;
    let host: Arc<dyn Host> = Arc::new(SysinfoHost::new());
    let mut tasks = JoinSet::new();

    let (mut readiness_url, mut agent_url, mut metrics_url) = (None, None, None);
    let (mut ready_url, mut advertised_metrics) = (None, None);
    if let Some(listener) = readiness {
        let addr = listener.local_addr()?;
        let mut app = crate::readiness::router(shared.clone());
        let metrics_addr = match cfg.metrics_listen {
            None => {
                app = app.merge(crate::readiness::metrics_router(shared.clone()));
                metrics_url = Some(format!("http://{addr}/metrics"));
                addr
            }
            Some(at) => {
                let metrics = bind("metrics_listen", at)?;
                let bound = metrics.local_addr()?;
                metrics_url = Some(format!("http://{bound}/metrics"));
                let router = crate::readiness::metrics_router(shared.clone());
                tasks.spawn(async move {
                    if let Err(e) = axum::serve(metrics, router).await {
                        tracing::error!(error = %e, "metrics endpoint failed");
                    }
                });
                bound
            }
        };
        // What Prometheus scrapes, found through the coordinator's `/v1/nodes/http_sd`.
        advertised_metrics = Some(format!(
            "{}/metrics",
            advertised("http", metrics_addr, reachable_host(metrics_addr, &cfg))
        ));
        tasks.spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "readiness endpoint failed");
            }
        });
        ready_url = Some(format!("http://{addr}/ready"));
        readiness_url = Some(format!(
            "{}/ready",
            advertised("http", addr, cfg.advertise_host.as_deref())
        ));

        let api = bind("api_listen", cfg.api_addr())?;
        let api_addr = api.local_addr()?;
        let app = crate::api::router(shared.clone(), engine.clone(), &node, &cfg.work_dir);
        let scheme = match cfg.tls.server_config()? {
            Some(config) => {
                tasks.spawn(crate::api::serve_tls(api, app, config));
                "https"
            }
            None => {
                if !api_addr.ip().is_loopback() {
                    tracing::warn!(
                        node = %node,
                        api = %api_addr,
                        "job logs and /status are served without credentials to anyone who reaches api_listen: configure [tls] or keep it on loopback"
                    );
                }
                tasks.spawn(crate::api::serve(api, app));
                "http"
            }
        };
        agent_url = Some(advertised(scheme, api_addr, reachable_host(api_addr, &cfg)));
        tracing::info!(node = %node, readiness = %addr, api = %api_addr, tls = scheme == "https", "agent endpoints listening");
    }

    let register = RegisterRequest {
        node: node.clone(),
        gpus: gpus.inventory()?,
        service: cfg.service.clone(),
        address: (!cfg.address.is_empty()).then(|| cfg.address.clone()),
        readiness_url,
        agent_url: agent_url.clone(),
        metrics_url: advertised_metrics,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
    };
    tasks.spawn(heartbeats(
        uplink.clone(),
        register,
        shared.clone(),
        gpus.clone(),
        serving.clone(),
        (
            host.clone(),
            cfg.checkpoint_root().to_owned(),
            cfg.checkpoints.storage,
        ),
    ));
    tasks.spawn(long_poll(uplink, shared.clone()));
    let mut reconciler =
        Reconciler::new(cfg.clone(), engine, gpus, serving, shared.clone()).with_host(host);
    if cfg.checkpoints.storage == crate::config::CheckpointStorage::Object
        && let Some(object) = &cfg.checkpoints.object
    {
        let bucket = crate::bucket::Bucket::new(object)?;
        tracing::info!(
            node = %node, endpoint = %object.endpoint, bucket = %object.bucket,
            prefix = %object.key_prefix(), "checkpoints kept in the bucket"
        );
        reconciler = reconciler.with_bucket(Arc::new(bucket));
    }
    tasks.spawn(reconcile_loop(reconciler));
    Ok(AgentHandle {
        shared,
        ready_url,
        api_url: agent_url,
        metrics_url,
        tasks,
    })
}

/// A listener on `addr`, for configuration key `key`.
fn bind(key: &str, addr: std::net::SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| anyhow::anyhow!("cannot listen on {key} {addr}: {e}"))?;
    Ok(TcpListener::from_std(listener)?)
}

/// The base URL others reach this agent at: `advertise_host` (or the listen address when it
/// is a specific one, else this host's name) with the bound port.
/// The host to advertise for a listener on `addr`: `advertise_host`, except that a loopback
/// listener is reachable there only, whatever the advertised host.
fn reachable_host(addr: std::net::SocketAddr, cfg: &AgentConfig) -> Option<&str> {
    (!addr.ip().is_loopback())
        .then_some(cfg.advertise_host.as_deref())
        .flatten()
}

fn advertised(scheme: &str, addr: std::net::SocketAddr, host: Option<&str>) -> String {
    let host = match host {
        Some(h) => h.to_owned(),
        None if !addr.ip().is_unspecified() => addr.ip().to_string(),
        None => std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into()),
    };
    format!("{scheme}://{host}:{}", addr.port())
}

async fn register(uplink: &Uplink, req: &RegisterRequest) -> Duration {
    loop {
        match uplink.register(req).await {
            Ok(reply) => {
                tracing::info!(node = %req.node, heartbeat_ms = reply.heartbeat_interval_ms, "registered");
                return Duration::from_millis(reply.heartbeat_interval_ms.max(50));
            }
            Err(e) => {
                tracing::warn!(node = %req.node, error = %e, "registration failed; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

async fn heartbeats<G: Gpus, S: ServingMetrics>(
    uplink: Uplink,
    req: RegisterRequest,
    shared: Arc<Shared>,
    gpus: Arc<G>,
    serving: Arc<S>,
    (host, volume, storage): (Arc<dyn Host>, PathBuf, CheckpointStorage),
) {
    let mut interval = register(&uplink, &req).await;
    loop {
        let mut beat = observe(
            &shared,
            gpus.as_ref(),
            serving.as_ref(),
            req.address.as_deref(),
        )
        .await;
        // The checkpoint volume's free space, and whether every host sees it (the
        // coordinator then places the job's next attempt anywhere).
        let mut facts = host.facts(&volume);
        facts.checkpoint_storage = storage;
        beat.host = Some(facts);
        beat.agent_url = req.agent_url.clone();
        beat.metrics_url = req.metrics_url.clone();
        // The coordinator renews this node's leases when it receives the heartbeat, after
        // it was sent: counting the fail-safe's silence from the sending keeps the agent's
        // deadline at or before the coordinator's expiry.
        let sent = tokio::time::Instant::now();
        match uplink.heartbeat(&beat).await {
            Ok(desired) => {
                shared.contact_since(sent);
                shared.offer_desired(desired);
            }
            Err(UplinkError::UnknownNode(_)) => {
                tracing::warn!(node = %req.node, "coordinator forgot this node; registering again");
                interval = register(&uplink, &req).await;
                continue;
            }
            Err(e) => tracing::warn!(node = %req.node, error = %e, "heartbeat failed"),
        }
        tokio::time::sleep(interval).await;
    }
}

/// What the agent sees right now, as a heartbeat. The replica's URL is advertised with
/// `address` as its host when one is configured.
pub async fn observe<G: Gpus, S: ServingMetrics>(
    shared: &Shared,
    gpus: &G,
    serving: &S,
    address: Option<&str>,
) -> Heartbeat {
    let o = shared.observed();
    let gpu_status = gpus.status().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading gpu status failed");
        Vec::new()
    });
    let live = matches!(
        o.replica(),
        ReplicaState::Serving | ReplicaState::Draining | ReplicaState::Starting
    );
    shared.telemetry.gpus(&gpu_status);
    let signals = match (&o.replica_url, live) {
        (Some(url), true) => {
            let signals = serving.signals(url).await;
            shared.telemetry.scrape(signals.requests_running.is_some());
            signals
        }
        _ => ServingSignals::default(),
    };
    Heartbeat {
        gpus: gpu_status,
        replica: ReplicaStatus {
            state: o.replica(),
            signals,
            url: o
                .replica_url
                .as_deref()
                .map(|u| replica_url_seen_from(u, address)),
        },
        jobs: o.runs,
        applied_version: o.applied_version,
        phases: shared.phases(),
        expired_leases: o.expired_leases,
        host: None,
        agent_url: None,
        metrics_url: None,
    }
}

async fn long_poll(uplink: Uplink, shared: Arc<Shared>) {
    loop {
        let after = shared.desired().map_or(0, |d| d.version);
        match uplink.desired(after).await {
            // Not a contact for the fail-safe: only a heartbeat renews the leases.
            Ok(desired) => {
                shared.offer_desired(desired);
            }
            Err(e) => {
                tracing::debug!(error = %e, "long-poll failed");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

async fn reconcile_loop<E: Engine, G: Gpus, S: ServingMetrics>(mut r: Reconciler<E, G, S>) {
    let mut desired = r.shared.subscribe_desired();
    loop {
        let span = tracing::info_span!("reconcile", node = %r.shared.node);
        let _enter = span.enter();
        drop(_enter);
        let started = std::time::Instant::now();
        let result = r.pass().await;
        r.shared
            .telemetry
            .reconcile(started.elapsed(), result.is_ok());
        if let Err(e) = result {
            tracing::warn!(node = %r.shared.node, error = %e, "reconcile pass failed; retrying");
        }
        let _ = tokio::time::timeout(RESYNC, desired.changed()).await;
    }
}

/// `http://127.0.0.1:8000` seen from other hosts: the same URL with `address` as host.
fn replica_url_seen_from(url: &str, address: Option<&str>) -> String {
    let Some(address) = address else {
        return url.to_owned();
    };
    let Some(rest) = url.strip_prefix("http://") else {
        return url.to_owned();
    };
    match rest.rsplit_once(':') {
        Some((_, port)) => format!("http://{address}:{port}"),
        None => format!("http://{address}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_replica_url_is_advertised_with_the_node_address() {
        assert_eq!(
            super::replica_url_seen_from("http://127.0.0.1:8000", Some("10.1.2.3")),
            "http://10.1.2.3:8000"
        );
        assert_eq!(
            super::replica_url_seen_from("http://127.0.0.1:8000", None),
            "http://127.0.0.1:8000"
        );
    }
}
