//! One leader among the coordinators sharing a PostgreSQL database; the others stand by.
//!
//! Leadership is a lease in the one-row table `nightshift_leader (term, url, since,
//! renewed_at, lock_held)`, plus a session-level advisory lock ([`LEADER_LOCK`]) held on a
//! session of the leader's own (the lock session). A coordinator that takes over raises the
//! term, then loads the state and fences every write of its store with that term
//! ([`crate::store::Store::fence`]): a write whose transaction finds another term is refused
//! by the database, so a deposed leader (frozen, cut off, slow to notice) never writes again
//! and two coordinators never grant the same GPUs.
//!
//! The leader renews its lease every [`PING`] on the lock session: `renewed_at` is set to
//! the database's clock (never a coordinator's), where the term is still its own; no row
//! renewed (another took over), a failed renewal or one slower than [`PING_TIMEOUT`] makes
//! it step down at once: it stops deciding ([`Cluster::begin_shutdown`]) and its core is
//! dropped. It serves nothing once its last renewal was sent more than [`PING`] +
//! [`PING_TIMEOUT`] ago, which is before the lease can expire ([`LEASE`]), so it stops
//! serving before any other may lead. On a clean shutdown it gives the lease up.
//!
//! A standby tries every [`CAMPAIGN`] for the lock, and reads the lease. It takes over
//! (raising the term in one conditional `UPDATE`, so that of two standbys one wins) when the
//! lease is older than [`LEASE`], whether or not it got the lock: a lock session whose
//! database backend froze keeps the lock, and no server timeout ends a stopped process. It
//! takes over at once when it got the lock and the leader held it (`lock_held`): the
//! leader's lock session has ended, as a killed process's does with its connection. A
//! standby that gets the lock from a leader that took over by the lease (and so holds no
//! lock) lets it go at once; that leader takes the lock at its next renewal, so that its own
//! death is seen at once again. The server ends a lock session idle for [`SESSION_TIMEOUT`]
//! (`idle_session_timeout`: a frozen coordinator's), and one whose peer is gone (TCP
//! keepalives), which frees the lock.
//!
//! A standby answers every request with 503, naming the leader's advertised URL (header
//! [`LEADER_HEADER`]); the agents and the CLI, given several coordinator URLs, try the next
//! one. A new leader loads the state as a restart does ([`Cluster::open`]), renewing its
//! lease meanwhile: the leases it finds are renewed, so a switch within the lease TTL stops
//! no job.
//!
//! SQLite is single-node: none of this runs for it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

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

/// How often the leader renews its lease (and checks its term) on the lock session.
pub const PING: Duration = Duration::from_secs(1);

/// A renewal (or a campaign's try) slower than this counts as a lost session.
pub const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a lease lasts past its last renewal, on the database's clock: a standby takes
/// over a leader that renewed none for this long.
pub const LEASE: Duration = Duration::from_secs(5);

// A leader stops serving (its last renewal sent longer ago than PING + PING_TIMEOUT) before
// its lease can expire in the database (renewed after it was sent, expired LEASE later).
const _: () = assert!(PING.as_millis() + PING_TIMEOUT.as_millis() < LEASE.as_millis());

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

/// When the leader's lease was last renewed, as the send time of the renewal the database
/// answered (the database stamped it later). A leader whose last renewal was sent more than
/// [`PING`] + [`PING_TIMEOUT`] ago (it was frozen, or its renewals hang) serves nothing
/// until it renews again or steps down: it stops before its lease can expire, so it never
/// answers from a core another coordinator has moved past.
pub struct Confirmed {
    /// The send time of the renewal it was made with; the ones after it count from here.
    epoch: Instant,
    at_ms: AtomicU64,
}

impl Confirmed {
    fn new(sent: Instant) -> Self {
        Self {
            epoch: sent,
            at_ms: AtomicU64::new(0),
        }
    }

    /// A renewal sent at `sent` was answered.
    fn renewed(&self, sent: Instant) {
        // Rounded down: an earlier send only shortens the window.
        let ms = sent.saturating_duration_since(self.epoch).as_millis() as u64;
        self.at_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn fresh(&self) -> bool {
        let at = self.at_ms.load(Ordering::Relaxed);
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

/// The lease as a standby reads it.
#[derive(Debug, Clone, PartialEq)]
struct Lease {
    /// The leader's advertised URL; empty before the first leader.
    url: String,
    /// Whether the leader holds the lock (took it, and its lock session lives).
    lock_held: bool,
    /// Whether it was last renewed more than [`LEASE`] ago.
    expired: bool,
}

/// Whether a standby may try to take over, having got the lock or not, given the lease it
/// read: `None` when the database has none (an empty database, or one of a schema before the
/// lease, whose leader holds the lock while it lives). The conditional raise of the term
/// ([`take_over`]) decides again, atomically, on the same rule.
fn may_take_over(got_lock: bool, lease: Option<&Lease>) -> bool {
    match lease {
        None => got_lock,
        Some(lease) => lease.expired || (got_lock && lease.lock_held),
    }
}

/// How a try to take over ended.
enum TakeOver {
    /// Leading in `term`: the cluster loaded, the lease last renewed by a statement sent at
    /// `renewed`.
    Leads {
        term: u64,
        cluster: Arc<Cluster>,
        renewed: Instant,
    },
    /// Another coordinator took over first, or the leader renewed meanwhile.
    Lost,
    /// The store, the database or the lock session failed (logged).
    Failed,
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
        let Some(got_lock) = stand_by(&client, &switch, &mut shutdown).await else {
            if *shutdown.borrow() {
                return;
            }
            switch.set(Role::Standby(None));
            wait(&mut shutdown, CAMPAIGN).await;
            continue;
        };
        let (term, cluster, renewed) =
            match take_over(&config, &url, &advertise, &client, got_lock).await {
                TakeOver::Leads {
                    term,
                    cluster,
                    renewed,
                } => (term, cluster, renewed),
                TakeOver::Lost => {
                    tracing::info!("leadership: another coordinator leads; standing by");
                    // A new session: the lock, if this one had it, goes with the old.
                    drop(client);
                    wait(&mut shutdown, CAMPAIGN).await;
                    continue;
                }
                TakeOver::Failed => {
                    // Let go of the lock (with the session) so that another may try.
                    drop(client);
                    switch.set(Role::Standby(None));
                    wait(&mut shutdown, PING).await;
                    continue;
                }
            };
        let app = match build(cluster.clone()) {
            Ok(app) => app,
            Err(e) => {
                tracing::error!(error = %e, "leadership: cannot build the API; standing by");
                cluster.begin_shutdown();
                release(&client, term).await;
                drop(client);
                switch.set(Role::Standby(None));
                wait(&mut shutdown, PING).await;
                continue;
            }
        };
        let ticker = tokio::spawn(crate::server::tick(cluster.clone()));
        let confirmed = Arc::new(Confirmed::new(renewed));
        switch.set(Role::Leader {
            term,
            app,
            confirmed: confirmed.clone(),
        });
        tracing::info!(term, lock = got_lock, db = %db, url = %advertise, "leading");
        let why = lead(&client, term, got_lock, &cluster, &confirmed, &mut shutdown).await;
        // Step down at once: no more decisions, the core dropped with the cluster.
        switch.set(Role::Standby(None));
        cluster.begin_shutdown();
        ticker.abort();
        match why {
            Some(why) => {
                drop(client);
                tracing::error!(term, reason = %why, "stepped down");
            }
            None => {
                // The lease given up: a standby takes over at its next try.
                release(&client, term).await;
                drop(client);
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

/// Stands by on the lock session `client`, a campaign round every [`CAMPAIGN`], until this
/// coordinator may take over: then says whether it got the lock. `None` when the session
/// failed, or at shutdown.
async fn stand_by(
    client: &tokio_postgres::Client,
    switch: &Switch,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<bool> {
    let mut known: Option<String> = None;
    loop {
        if *shutdown.borrow() {
            return None;
        }
        let round = tokio::time::timeout(PING_TIMEOUT, async {
            let got_lock = client
                .query_one("SELECT pg_try_advisory_lock($1)", &[&LEADER_LOCK])
                .await?
                .get::<_, bool>(0);
            Ok::<_, tokio_postgres::Error>((got_lock, read_lease(client).await?))
        })
        .await;
        let (got_lock, lease) = match round {
            Ok(Ok(round)) => round,
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::store::describe_pg(&e), "leadership: the lock session failed");
                return None;
            }
            Err(_) => {
                tracing::warn!("leadership: the lock session does not answer");
                return None;
            }
        };
        if may_take_over(got_lock, lease.as_ref()) {
            return Some(got_lock);
        }
        if got_lock {
            // The leader took over by its lease and holds no lock: it takes it next.
            tracing::info!(
                "leadership: got the lock while a leader renews its lease; letting it go"
            );
            let unlocked = tokio::time::timeout(
                PING_TIMEOUT,
                client.query_one("SELECT pg_advisory_unlock($1)", &[&LEADER_LOCK]),
            )
            .await;
            if !matches!(unlocked, Ok(Ok(_))) {
                tracing::warn!("leadership: the lock session failed letting the lock go");
                return None;
            }
        }
        // The leader's URL, for the requests this standby turns away.
        let leader = lease.map(|l| l.url).filter(|u| !u.is_empty());
        if leader != known {
            tracing::info!(
                leader = leader.as_deref().unwrap_or("unknown"),
                "standing by"
            );
            known = leader.clone();
        }
        switch.set(Role::Standby(leader));
        wait(shutdown, CAMPAIGN).await;
    }
}

/// The lease, or `None` where the database has none yet (no leader table: no coordinator
/// made the schema; no lease's columns: a schema from before the lease).
async fn read_lease(
    client: &tokio_postgres::Client,
) -> Result<Option<Lease>, tokio_postgres::Error> {
    use tokio_postgres::error::SqlState;
    let row = client
        .query_opt(
            "SELECT url, lock_held, renewed_at < clock_timestamp() - make_interval(secs => $1) \
             FROM nightshift_leader WHERE id = 1",
            &[&LEASE.as_secs_f64()],
        )
        .await;
    match row {
        Ok(row) => Ok(row.map(|r| Lease {
            url: r.get(0),
            lock_held: r.get(1),
            expired: r.get(2),
        })),
        Err(e)
            if e.code() == Some(&SqlState::UNDEFINED_TABLE)
                || e.code() == Some(&SqlState::UNDEFINED_COLUMN) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Takes over, if the lease still allows it: opens the store (bringing the schema up to
/// date), raises the term where the lease expired or this coordinator got the lock from a
/// leader that held it, then fences the store with the new term and rebuilds the cluster
/// from what the database holds (renewing the leases it finds, as a restart does), renewing
/// its own lease meanwhile.
async fn take_over(
    config: &CoordinatorConfig,
    url: &str,
    advertise: &str,
    client: &tokio_postgres::Client,
    got_lock: bool,
) -> TakeOver {
    // The schema first (the leader table and its lease are migrations).
    let (config2, url2) = (config.clone(), url.to_owned());
    let store = tokio::task::spawn_blocking(move || {
        Store::open_url(&StoreUrl::Postgres(url2), config2.store.ca_file.as_deref())
    })
    .await;
    let mut store = match store {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "leadership: cannot open the store");
            return TakeOver::Failed;
        }
        Err(e) => {
            tracing::error!(error = %e, "leadership: opening the store failed");
            return TakeOver::Failed;
        }
    };
    // Waits for a write in flight of the old leader (it holds the row FOR SHARE), so the
    // load below sees it; of two standbys raising at once, the second finds the lease renewed.
    let sent = Instant::now();
    let raised = tokio::time::timeout(
        PING_TIMEOUT * 5,
        client.query_opt(
            "UPDATE nightshift_leader SET term = term + 1, url = $1, since = $2, \
             renewed_at = clock_timestamp(), lock_held = $3 \
             WHERE id = 1 AND (renewed_at < clock_timestamp() - make_interval(secs => $4) \
             OR ($3 AND lock_held)) RETURNING term",
            &[
                &advertise,
                &(now_ms() as i64),
                &got_lock,
                &LEASE.as_secs_f64(),
            ],
        ),
    )
    .await;
    let term = match raised {
        Ok(Ok(Some(row))) => row.get::<_, i64>(0) as u64,
        Ok(Ok(None)) => return TakeOver::Lost,
        Ok(Err(e)) => {
            tracing::error!(error = %crate::store::describe_pg(&e), "leadership: cannot raise the term");
            return TakeOver::Failed;
        }
        Err(_) => {
            tracing::error!("leadership: raising the term timed out");
            return TakeOver::Failed;
        }
    };
    store.fence(term);
    let config2 = config.clone();
    let mut loading = tokio::task::spawn_blocking(move || {
        let cluster = Cluster::open(config2.core(), config2.accounting.clone(), store)?;
        cluster.set_job_policy(config2.policy.clone());
        cluster.set_agent_tls(config2.tls.clone());
        Ok::<_, crate::store::StoreError>(cluster)
    });
    // A long load must not let the lease expire under it.
    let mut renewed = sent;
    let mut lost: Option<String> = None;
    let opened = loop {
        tokio::select! {
            opened = &mut loading => break opened,
            () = tokio::time::sleep(PING), if lost.is_none() => {
                let sent = Instant::now();
                match tokio::time::timeout(PING_TIMEOUT, renew(client, term, got_lock)).await {
                    Ok(Ok(true)) => renewed = sent,
                    Ok(Ok(false)) => lost = Some("another coordinator took over".to_owned()),
                    Ok(Err(e)) => lost = Some(crate::store::describe_pg(&e)),
                    Err(_) => lost = Some("the lock session does not answer".to_owned()),
                }
            }
        }
    };
    match (opened, lost) {
        (Ok(Ok(cluster)), None) => TakeOver::Leads {
            term,
            cluster: Arc::new(cluster),
            renewed,
        },
        (Ok(Ok(cluster)), Some(why)) => {
            tracing::error!(term, reason = %why, "leadership: the lease was lost while loading the state");
            cluster.begin_shutdown();
            TakeOver::Failed
        }
        (Ok(Err(e)), _) => {
            tracing::error!(error = %e, term, "leadership: cannot load the state");
            TakeOver::Failed
        }
        (Err(e), _) => {
            tracing::error!(error = %e, term, "leadership: loading the state failed");
            TakeOver::Failed
        }
    }
}

/// Renews the lease of `term` on the database's clock, recording whether this leader holds
/// the lock; false when the term is no longer the database's (deposed).
async fn renew(
    client: &tokio_postgres::Client,
    term: u64,
    lock_held: bool,
) -> Result<bool, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "UPDATE nightshift_leader SET renewed_at = clock_timestamp(), lock_held = $2 \
             WHERE id = 1 AND term = $1 RETURNING term",
            &[&(term as i64), &lock_held],
        )
        .await?;
    Ok(row.is_some())
}

/// Gives the lease of `term` up, so that a standby takes over at its next try rather than
/// after [`LEASE`] (the lock goes with the session, which the caller drops).
async fn release(client: &tokio_postgres::Client, term: u64) {
    let released = tokio::time::timeout(
        PING_TIMEOUT,
        client.execute(
            "UPDATE nightshift_leader SET renewed_at = '-infinity', lock_held = false \
             WHERE id = 1 AND term = $1",
            &[&(term as i64)],
        ),
    )
    .await;
    match released {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(term, error = %crate::store::describe_pg(&e), "leadership: cannot give the lease up; it expires");
        }
        Err(_) => tracing::warn!(
            term,
            "leadership: giving the lease up timed out; it expires"
        ),
    }
}

/// Leads until a renewal fails or is slow, the term moves, a write is refused (deposed), or
/// shutdown: says why it stopped, `None` for shutdown. Takes the lock while it has not got
/// it (it took over by the lease).
async fn lead(
    client: &tokio_postgres::Client,
    term: u64,
    mut lock_held: bool,
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
        let sent = Instant::now();
        let had_lock = lock_held;
        let renewed = tokio::time::timeout(PING_TIMEOUT, async {
            if !lock_held {
                lock_held = client
                    .query_one("SELECT pg_try_advisory_lock($1)", &[&LEADER_LOCK])
                    .await?
                    .get::<_, bool>(0);
            }
            renew(client, term, lock_held).await
        })
        .await;
        match renewed {
            Ok(Ok(true)) => {
                confirmed.renewed(sent);
                if lock_held && !had_lock {
                    tracing::info!(term, "leading, and holding the lock");
                }
            }
            Ok(Ok(false)) => {
                let current = tokio::time::timeout(
                    PING_TIMEOUT,
                    client.query_one("SELECT term FROM nightshift_leader WHERE id = 1", &[]),
                )
                .await;
                return Some(match current {
                    Ok(Ok(row)) => format!("the database is at term {}", row.get::<_, i64>(0)),
                    _ => "another coordinator took over".to_owned(),
                });
            }
            Ok(Err(e)) => {
                return Some(format!(
                    "the lock session failed: {}",
                    crate::store::describe_pg(&e)
                ));
            }
            Err(_) => {
                return Some(format!(
                    "the lease was not renewed within {} ms",
                    PING_TIMEOUT.as_millis()
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(lock_held: bool, expired: bool) -> Lease {
        Lease {
            url: "http://a:7400".to_owned(),
            lock_held,
            expired,
        }
    }

    #[test]
    fn a_standby_takes_over_an_expired_lease_or_a_lock_its_leader_lost() {
        // (got the lock, the lease) -> may take over
        let cases = [
            // An empty database, or a schema before the lease: the lock alone decides.
            (true, None, true),
            (false, None, false),
            // A live leader holding the lock: no standby can have got it.
            (false, Some(lease(true, false)), false),
            // The leader held the lock and a standby got it: the leader's session ended.
            (true, Some(lease(true, false)), true),
            // A leader by the lease (no lock) keeps leading while it renews, whoever gets
            // the lock.
            (true, Some(lease(false, false)), false),
            (false, Some(lease(false, false)), false),
            // An expired lease is taken over, lock or none (a frozen backend keeps it).
            (false, Some(lease(true, true)), true),
            (false, Some(lease(false, true)), true),
            (true, Some(lease(false, true)), true),
        ];
        for (got_lock, lease, expected) in cases {
            assert_eq!(
                may_take_over(got_lock, lease.as_ref()),
                expected,
                "got the lock: {got_lock}, lease: {lease:?}"
            );
        }
    }

    #[test]
    fn a_leader_stops_serving_before_its_lease_expires() {
        let sent = Instant::now() - LEASE;
        let confirmed = Confirmed::new(sent);
        assert!(!confirmed.fresh(), "a renewal sent a lease ago is stale");
        confirmed.renewed(Instant::now());
        assert!(confirmed.fresh());
        // An older renewal answered late does not move the confirmation back.
        confirmed.renewed(sent);
        assert!(confirmed.fresh());
    }
}
