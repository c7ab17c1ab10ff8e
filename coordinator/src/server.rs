//! Running the coordinator: the HTTP server and the ticker that gives the core the time.
//!
//! Stopping is quick: the moment shutdown begins the core decides nothing more
//! ([`Cluster::begin_shutdown`]: a successor may already be up on the same data), open
//! long-polls are answered at once, and connections still busy after [`STOP_GRACE`] are
//! dropped, so that a restart never waits for an agent's long-poll.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::cluster::{ApplyError, Cluster, now_ms};
use crate::config::CoordinatorConfig;
use crate::store::{Store, StoreUrl};

/// Longest the ticker sleeps, even when the core asks for nothing sooner.
const MAX_TICK: Duration = Duration::from_millis(500);

/// How long requests under way may take to finish once shutdown has begun.
pub const STOP_GRACE: Duration = Duration::from_secs(1);

/// Opens the store (`[store] url`, else `data_dir`'s SQLite file) and rebuilds the cluster state from it.
pub fn open(config: &CoordinatorConfig) -> anyhow::Result<Arc<Cluster>> {
    let store = match &config.store.url {
        None => Store::open(&config.data_dir)?,
        Some(url) => Store::open_url(&StoreUrl::parse(url)?, config.store.ca_file.as_deref())?,
    };
    tracing::info!(db = %store.location(), "store opened");
    let cluster = Cluster::open(config.core(), config.accounting.clone(), store)?;
    cluster.set_job_policy(config.policy.clone());
    cluster.set_agent_tls(config.tls.clone());
    Ok(Arc::new(cluster))
}

/// Serves the API on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    cluster: Arc<Cluster>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = crate::http::router(cluster.clone());
    serve_app(listener, cluster, app, shutdown).await
}

/// Serves `app` (the API of `cluster`, e.g. with access control) on `listener` until
/// `shutdown` completes.
pub async fn serve_app(
    listener: TcpListener,
    cluster: Arc<Cluster>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let _ticker = Ticker(tokio::spawn(tick(cluster.clone())));
    // Each request knows its client's address (failed authentications are limited by it).
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(stopping(cluster.clone(), shutdown))
        .into_future();
    tokio::pin!(server);
    let result = tokio::select! {
        result = &mut server => result,
        () = async {
            cluster.stopped().await;
            tokio::time::sleep(STOP_GRACE).await;
        } => {
            tracing::warn!(
                grace_ms = STOP_GRACE.as_millis() as u64,
                "requests still open after the shutdown grace; dropping them"
            );
            Ok(())
        }
    };
    Ok(result?)
}

/// The ticker of a server, stopped with it, also when the server's future is dropped (its
/// task aborted, as tests stop a coordinator) rather than run to its end.
struct Ticker(tokio::task::JoinHandle<()>);

impl Drop for Ticker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `shutdown`, after which the cluster stops deciding and ends its long-polls: the future
/// to hand a server as its shutdown signal.
pub async fn stopping(cluster: Arc<Cluster>, shutdown: impl Future<Output = ()>) {
    shutdown.await;
    cluster.begin_shutdown();
}

/// Wakes the core at its next deadline (lease expiries, scaling windows), at least twice a
/// second.
pub(crate) async fn tick(cluster: Arc<Cluster>) {
    loop {
        crate::clock::note_step();
        let now = now_ms();
        let wait = cluster.next_deadline().map_or(MAX_TICK, |d| {
            Duration::from_millis(d.saturating_sub(now)).min(MAX_TICK)
        });
        tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        match cluster.apply(|core, now| {
            cluster.decide(core, now);
            cluster.timeline.note(now, || core.nodes(now));
            Ok(())
        }) {
            Ok(()) => {}
            Err(ApplyError::ShuttingDown) => return,
            // The commit logged it, sparingly (a full disk fails every tick).
            Err(ApplyError::Store(_)) => {}
            Err(e) => tracing::error!(error = %e, "tick failed"),
        }
    }
}
