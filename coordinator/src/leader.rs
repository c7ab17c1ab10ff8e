//! One leader among the coordinators sharing a PostgreSQL database; the others stand by.
//!
//! Leadership is a session-level advisory lock ([`LEADER_LOCK`]) held on a session of its
//! own (the lock session), plus the one-row table `nightshift_leader (term, url, since)`.
//! The coordinator that takes the lock raises the term, then loads the state and fences
//! every write of its store with that term ([`crate::store::Store::fence`]): a write whose
//! transaction finds another term is refused by the database, so a deposed leader (frozen,
//! cut off, slow to notice) never writes again and two coordinators never grant the same
//! GPUs.
//!
//! The lock session is pinged every [`PING`]; a ping that fails or takes longer than
//! [`PING_TIMEOUT`], or a term that moved, makes the leader step down at once: it stops
//! deciding ([`Cluster::begin_shutdown`]) and its core is dropped. The server ends a lock
//! session idle for [`SESSION_TIMEOUT`] (`idle_session_timeout`: a frozen leader's), and
//! one whose peer is gone (TCP keepalives), which frees the lock for a standby.
//!
//! A standby polls for the lock every [`CAMPAIGN`] and answers every request with 503,
//! naming the leader's advertised URL (header [`LEADER_HEADER`]); the agents and the CLI,
//! given several coordinator URLs, try the next one. A new leader loads the state as a
//! restart does ([`Cluster::open`]): the leases it finds are renewed, so a switch within the
//! lease TTL stops no job.
//!
//! SQLite is single-node: none of this runs for it.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tokio::sync::watch;

use crate::cluster::{Cluster, now_ms};
use crate::config::CoordinatorConfig;
use crate::store::{Store, StoreUrl};

/// The advisory lock's key: "nightldr" in ASCII.
pub const LEADER_LOCK: i64 = 0x6e69_6768_746c_6472;

/// How long the server lets the lock session sit idle before it ends it (and so frees the
/// lock): a leader pings far more often, a frozen one does not.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the leader checks its lock session (and its term).
pub const PING: Duration = Duration::from_secs(1);

/// A ping (or a campaign's try) slower than this counts as a lost session.
pub const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a standby tries to take the lock.
pub const CAMPAIGN: Duration = Duration::from_millis(500);

/// The response header in which a standby names the leader's URL.
pub const LEADER_HEADER: &str = "x-nightshift-leader";

/// What this coordinator is now.
#[derive(Clone)]
enum Role {
    /// Standing by; the leader's advertised URL when one is known.
    Standby(Option<String>),
    /// Leading in `term`: requests go to `app` while the lock session was confirmed lately.
    Leader {
        term: u64,
        app: Router,
        confirmed: Arc<Confirmed>,
    },
}

/// When the lock session last answered a ping with this leader's term. A leader whose
/// confirmation is older than [`PING`] + [`PING_TIMEOUT`] (it was frozen, or its pings
/// hang) serves nothing until it confirms again or steps down: a thawed leader never
/// answers from a core another coordinator has moved past.
pub struct Confirmed {
    epoch: std::time::Instant,
    at_ms: std::sync::atomic::AtomicU64,
}

impl Confirmed {
    fn new() -> Self {
        Self {
            epoch: std::time::Instant::now(),
            at_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn now(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.at_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn fresh(&self) -> bool {
        let at = self.at_ms.load(std::sync::atomic::Ordering::Relaxed);
        let age = (self.epoch.elapsed().as_millis() as u64).saturating_sub(at);
        age <= (PING + PING_TIMEOUT).as_millis() as u64
    }
}

/// The role, shared by the leadership task and the request dispatcher.
#[derive(Clone)]
pub struct Switch(Arc<RwLock<Role>>);

impl Default for Switch {
    fn default() -> Self {
        Self(Arc::new(RwLock::new(Role::Standby(None))))
    }
}

impl Switch {
    fn set(&self, role: Role) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = role;
    }

    fn get(&self) -> Role {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The term this coordinator leads in, if it leads.
    pub fn term(&self) -> Option<u64> {
        match self.get() {
            Role::Leader { term, .. } => Some(term),
            Role::Standby(_) => None,
        }
    }

    /// The router to serve: the leader's API while this coordinator leads, a 503 naming the
    /// leader otherwise.
    pub fn router(&self) -> Router {
        Router::new().fallback(dispatch).with_state(self.clone())
    }
}

async fn dispatch(State(switch): State<Switch>, req: Request) -> Response {
    use tower_service::Service;
    let role = match switch.get() {
        Role::Leader { confirmed, .. } if !confirmed.fresh() => Role::Standby(None),
        role => role,
    };
    match role {
        Role::Leader { mut app, .. } => match app.call(req).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        Role::Standby(leader) => {
            let error = match &leader {
                Some(url) => format!("this coordinator is a standby; the leader is at {url}"),
                None => "this coordinator is a standby; no leader is known yet".to_owned(),
            };
            // The API's error body (clients parse it strictly); the URL in the header.
            let body = serde_json::json!({ "error": error });
            let mut response = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
            if let Some(url) = leader
                && let Ok(value) = url.parse()
            {
                response.headers_mut().insert(LEADER_HEADER, value);
            }
            response
        }
    }
}

/// Builds the API of a new leader's cluster (access control, policy).
pub type BuildApp = Arc<dyn Fn(Arc<Cluster>) -> anyhow::Result<Router> + Send + Sync>;

/// The server settings of the lock session: ended by the server when idle (frozen), or when
/// its peer is gone.
fn session_options() -> String {
    format!(
        "-c idle_session_timeout={} -c tcp_keepalives_idle=2 -c tcp_keepalives_interval=1 \
         -c tcp_keepalives_count=3",
        SESSION_TIMEOUT.as_millis()
    )
}

/// Campaigns for leadership of the database at `url`, and leads when elected, until
/// `shutdown` turns true; `switch` follows the role. `advertise` is the URL clients reach
/// this coordinator at, which standbys name.
pub async fn run(
    config: CoordinatorConfig,
    url: String,
    advertise: String,
    switch: Switch,
    build: BuildApp,
    mut shutdown: watch::Receiver<bool>,
) {
    let ca_file: Option<PathBuf> = config.store.ca_file.clone();
    let db = crate::store::redact(&url);
    let mut logged_failure = false;
    while !*shutdown.borrow() {
        let client = match crate::store::session(
            &url,
            ca_file.as_deref(),
            &session_options(),
            PING_TIMEOUT * 2,
        )
        .await
        {
            Ok(c) => c,
            Err(e) => {
                if !logged_failure {
                    tracing::error!(error = %e, "leadership: cannot reach the database; standing by");
                    logged_failure = true;
                }
                switch.set(Role::Standby(None));
                wait(&mut shutdown, PING).await;
                continue;
            }
        };
        logged_failure = false;
        // Standing by until the lock is ours.
        let mut known: Option<String> = None;
        let won = loop {
            if *shutdown.borrow() {
                return;
            }
            let tried = tokio::time::timeout(
                PING_TIMEOUT,
                client.query_one("SELECT pg_try_advisory_lock($1)", &[&LEADER_LOCK]),
            )
            .await;
            match tried {
                Ok(Ok(row)) if row.get::<_, bool>(0) => break true,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %crate::store::describe_pg(&e), "leadership: the lock session failed");
                    break false;
                }
                Err(_) => {
                    tracing::warn!("leadership: the lock session does not answer");
                    break false;
                }
            }
            // The leader's URL, for the requests this standby turns away (the table is
            // missing until the first coordinator made the schema).
            let leader = tokio::time::timeout(
                PING_TIMEOUT,
                client.query_opt("SELECT url FROM nightshift_leader WHERE id = 1", &[]),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
            .map(|r| r.get::<_, String>(0))
            .filter(|u| !u.is_empty());
            if leader != known {
                tracing::info!(
                    leader = leader.as_deref().unwrap_or("unknown"),
                    "standing by"
                );
                known = leader.clone();
            }
            switch.set(Role::Standby(leader));
            wait(&mut shutdown, CAMPAIGN).await;
        };
        if !won {
            switch.set(Role::Standby(None));
            wait(&mut shutdown, CAMPAIGN).await;
            continue;
        }
        let Some((term, cluster)) = take_over(&config, &url, &advertise, &client).await else {
            // Let go of the lock (with the session) so that another may try.
            drop(client);
            switch.set(Role::Standby(None));
            wait(&mut shutdown, PING).await;
            continue;
        };
        let app = match build(cluster.clone()) {
            Ok(app) => app,
            Err(e) => {
                tracing::error!(error = %e, "leadership: cannot build the API; standing by");
                cluster.begin_shutdown();
                drop(client);
                switch.set(Role::Standby(None));
                wait(&mut shutdown, PING).await;
                continue;
            }
        };
        let ticker = tokio::spawn(crate::server::tick(cluster.clone()));
        let confirmed = Arc::new(Confirmed::new());
        confirmed.now();
        switch.set(Role::Leader {
            term,
            app,
            confirmed: confirmed.clone(),
        });
        tracing::info!(term, db = %db, url = %advertise, "leading");
        let why = lead(&client, term, &cluster, &confirmed, &mut shutdown).await;
        // Step down at once: no more decisions, the core dropped with the cluster.
        switch.set(Role::Standby(None));
        cluster.begin_shutdown();
        ticker.abort();
        drop(client);
        match why {
            Some(why) => tracing::error!(term, reason = %why, "stepped down"),
            None => {
                tracing::info!(term, "stepped down: shutting down");
                return;
            }
        }
        drop(cluster);
    }
}

/// Sleeps `d`, or less if `shutdown` turns true.
async fn wait(shutdown: &mut watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        () = tokio::time::sleep(d) => {}
        _ = shutdown.wait_for(|s| *s) => {}
    }
}

/// Holding the lock: raises the term, then opens the store fenced with it and rebuilds the
/// cluster from what the database holds (renewing the leases it finds, as a restart does).
async fn take_over(
    config: &CoordinatorConfig,
    url: &str,
    advertise: &str,
    client: &tokio_postgres::Client,
) -> Option<(u64, Arc<Cluster>)> {
    // The schema first (the leader table is one of its migrations).
    let (config2, url2) = (config.clone(), url.to_owned());
    let store = tokio::task::spawn_blocking(move || {
        Store::open_url(&StoreUrl::Postgres(url2), config2.store.ca_file.as_deref())
    })
    .await;
    let mut store = match store {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "leadership: cannot open the store");
            return None;
        }
        Err(e) => {
            tracing::error!(error = %e, "leadership: opening the store failed");
            return None;
        }
    };
    let bumped = tokio::time::timeout(
        PING_TIMEOUT * 5,
        client.query_one(
            "UPDATE nightshift_leader SET term = term + 1, url = $1, since = $2 WHERE id = 1 \
             RETURNING term",
            &[&advertise, &(now_ms() as i64)],
        ),
    )
    .await;
    let term = match bumped {
        Ok(Ok(row)) => row.get::<_, i64>(0) as u64,
        Ok(Err(e)) => {
            tracing::error!(error = %crate::store::describe_pg(&e), "leadership: cannot raise the term");
            return None;
        }
        Err(_) => {
            tracing::error!("leadership: raising the term timed out");
            return None;
        }
    };
    store.fence(term);
    let config2 = config.clone();
    let opened = tokio::task::spawn_blocking(move || {
        let cluster = Cluster::open(config2.core(), config2.accounting.clone(), store)?;
        cluster.set_job_policy(config2.policy.clone());
        cluster.set_agent_tls(config2.tls.clone());
        Ok::<_, crate::store::StoreError>(cluster)
    })
    .await;
    match opened {
        Ok(Ok(cluster)) => Some((term, Arc::new(cluster))),
        Ok(Err(e)) => {
            tracing::error!(error = %e, term, "leadership: cannot load the state");
            None
        }
        Err(e) => {
            tracing::error!(error = %e, term, "leadership: loading the state failed");
            None
        }
    }
}

/// Leads until the lock session is lost, the term moves, a write is refused (deposed), or
/// shutdown: says why it stopped, `None` for shutdown.
async fn lead(
    client: &tokio_postgres::Client,
    term: u64,
    cluster: &Cluster,
    confirmed: &Confirmed,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<String> {
    loop {
        wait(shutdown, PING).await;
        if *shutdown.borrow() {
            return None;
        }
        if cluster.is_stopping() {
            return Some("a write was refused: another coordinator leads".to_owned());
        }
        let pinged = tokio::time::timeout(
            PING_TIMEOUT,
            client.query_one("SELECT term FROM nightshift_leader WHERE id = 1", &[]),
        )
        .await;
        match pinged {
            Ok(Ok(row)) => {
                let current = row.get::<_, i64>(0) as u64;
                if current != term {
                    return Some(format!("the database is at term {current}"));
                }
                confirmed.now();
            }
            Ok(Err(e)) => {
                return Some(format!(
                    "the lock session failed: {}",
                    crate::store::describe_pg(&e)
                ));
            }
            Err(_) => {
                return Some(format!(
                    "the lock session did not answer within {} ms",
                    PING_TIMEOUT.as_millis()
                ));
            }
        }
    }
}
