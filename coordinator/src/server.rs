//! Running the coordinator: the HTTP server and the ticker that gives the core the time.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::cluster::{Cluster, now_ms};
use crate::config::CoordinatorConfig;
use crate::store::Store;

/// Longest the ticker sleeps, even when the core asks for nothing sooner.
const MAX_TICK: Duration = Duration::from_millis(500);

/// Opens the store in `config.data_dir` and rebuilds the cluster state from it.
pub fn open(config: &CoordinatorConfig) -> anyhow::Result<Arc<Cluster>> {
    let store = Store::open(&config.data_dir)?;
    tracing::info!(db = %store.path().display(), "store opened");
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
    let ticker = tokio::spawn(tick(cluster));
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    ticker.abort();
    Ok(result?)
}

/// Wakes the core at its next deadline (lease expiries, scaling windows), at least twice a
/// second.
pub(crate) async fn tick(cluster: Arc<Cluster>) {
    loop {
        let now = now_ms();
        let wait = cluster.next_deadline().map_or(MAX_TICK, |d| {
            Duration::from_millis(d.saturating_sub(now)).min(MAX_TICK)
        });
        tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        if let Err(e) = cluster.apply(|core, now| {
            cluster.decide(core, now);
            Ok(())
        }) {
            tracing::error!(error = %e, "tick failed");
        }
    }
}
