//! `nightshift-coordinator`: serve the cluster's API, or validate a configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use nightshift_coordinator::auth::Tokens;
use nightshift_coordinator::config::CoordinatorConfig;
use nightshift_coordinator::server;
use nightshift_coordinator::store::{PgStore, StoreUrl};

#[derive(Parser)]
#[command(
    version,
    about = "nightshift coordinator: lends idle inference GPUs to research jobs"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the HTTP API.
    Serve {
        /// Address to listen on (overrides the configuration's `listen`).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Where the SQLite state lives (overrides `data_dir`).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check a configuration file (and the TLS files it names) and exit.
    Validate {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Copy a stopped coordinator's state from its SQLite file into an empty PostgreSQL
    /// database (then set `[store] url` to it).
    Migrate {
        /// The SQLite state: `sqlite:PATH` (or `sqlite://PATH`), the file or its data
        /// directory.
        #[arg(long)]
        from: String,
        /// The PostgreSQL database: `postgres://USER:PASSWORD@HOST:PORT/DATABASE`.
        #[arg(long)]
        to: String,
        /// The CA (PEM) the database server's certificate must chain to.
        #[arg(long)]
        ca_file: Option<PathBuf>,
    },
    /// The cluster's certificates for mutual TLS between agents and the coordinator.
    #[command(subcommand)]
    Tls(TlsCommand),
    /// API tokens (stored hashed in the data directory).
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Create a token and print it, once. Until the first token exists the API is open.
    Create {
        #[arg(long, value_enum)]
        role: nightshift_coordinator::auth::Role,
        /// The team a researcher acts for (the owner of its jobs).
        #[arg(long)]
        team: Option<String>,
        /// Who holds the token, for the audit log.
        #[arg(long, default_value = "unnamed")]
        name: String,
        /// The coordinator's data directory (where tokens.json lives).
        #[arg(long, default_value = "/var/lib/nightshift/coordinator")]
        data_dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum TlsCommand {
    /// Create the cluster CA and the coordinator's server certificate.
    Init {
        /// Where to write ca.pem, ca.key, coordinator.pem and coordinator.key.
        #[arg(long, default_value = "/etc/nightshift/tls")]
        dir: PathBuf,
        /// A DNS name or IP address agents use to reach the coordinator (repeatable).
        #[arg(long = "server-name", required = true)]
        server_names: Vec<String>,
    },
    /// Issue a new certificate for the coordinator from the existing CA (one made before
    /// agents served job logs over HTTPS lacks the client authentication they ask for).
    Coordinator {
        /// The directory holding ca.key; coordinator.pem and coordinator.key are written there
        /// unless --out says otherwise (neither may exist yet).
        #[arg(long, default_value = "/etc/nightshift/tls")]
        dir: PathBuf,
        #[arg(long)]
        out: Option<PathBuf>,
        /// A DNS name or IP address agents use to reach the coordinator (repeatable).
        #[arg(long = "server-name", required = true)]
        server_names: Vec<String>,
    },
    /// Issue an agent's client certificate: its common name is the node it may speak for.
    Issue {
        #[arg(long)]
        node: String,
        /// The directory holding ca.key; the certificate is written there as NODE.pem and
        /// NODE.key unless --out says otherwise.
        #[arg(long, default_value = "/etc/nightshift/tls")]
        dir: PathBuf,
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    nightshift_common::logging::init("info");
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            nightshift_common::logging::print_error(e.as_ref());
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Validate { config } => {
            let cfg = CoordinatorConfig::load(config.as_deref())?;
            if let Some(tls) = &cfg.tls {
                nightshift_coordinator::https::server_config(tls)?;
            }
            // The token file belongs to the service user: another user may not read it.
            match Tokens::open(&cfg.data_dir) {
                Ok(tokens) => agent_routes(&cfg, &tokens)?,
                Err(e) => eprintln!(
                    "cannot read the API tokens ({e}); serve checks them against [tls] at start"
                ),
            }
            // A PostgreSQL store must be reachable, at a schema this coordinator knows.
            if let Some(url) = &cfg.store.url
                && let StoreUrl::Postgres(url) = StoreUrl::parse(url)?
            {
                let found = PgStore::check(&url, cfg.store.ca_file.as_deref())?;
                let known = nightshift_coordinator::store::SCHEMA_VERSION;
                let db = nightshift_coordinator::store::redact(&url);
                if found < known {
                    println!(
                        "database {db} is reachable, at schema version {found}; serve brings it to {known}"
                    );
                } else {
                    println!("database {db} is reachable, at schema version {found}");
                }
            }
            println!("configuration is valid");
            Ok(())
        }
        Command::Tls(command) => tls(command),
        Command::Migrate { from, to, ca_file } => {
            let path = from
                .strip_prefix("sqlite://")
                .or_else(|| from.strip_prefix("sqlite:"))
                .ok_or_else(|| anyhow::anyhow!("--from {from:?}: must be sqlite:PATH"))?;
            let mut path = PathBuf::from(path);
            if path.is_dir() {
                path.push(nightshift_coordinator::store::DB_FILE);
            }
            let StoreUrl::Postgres(to) = StoreUrl::parse(&to)? else {
                anyhow::bail!("--to: must be a postgres:// URL");
            };
            let copied = nightshift_coordinator::store::migrate(&path, &to, ca_file.as_deref())?;
            println!(
                "copied {} jobs, {} nodes, {} ended leases, {} pipeline runs and {} image \
                 records from {} to {}; set [store] url to it",
                copied.jobs,
                copied.nodes,
                copied.usage,
                copied.pipeline_runs,
                copied.images,
                path.display(),
                nightshift_coordinator::store::redact(&to)
            );
            Ok(())
        }
        Command::Token(TokenCommand::Create {
            role,
            team,
            name,
            data_dir,
        }) => {
            let tokens = Tokens::open(&data_dir)?;
            let now = nightshift_coordinator::cluster::now_ms();
            let (record, token) = tokens.create(&name, role, team.as_deref(), now)?;
            eprintln!(
                "token {} ({}, role {}) created; it is shown once:",
                record.id,
                record.name,
                record.role.as_str()
            );
            println!("{token}");
            Ok(())
        }
        Command::Serve {
            listen,
            data_dir,
            config,
        } => {
            let mut cfg = CoordinatorConfig::load(config.as_deref())?;
            if let Some(listen) = listen {
                cfg.listen = listen;
            }
            if let Some(dir) = data_dir {
                cfg.data_dir = dir;
            }
            let tls = cfg
                .tls
                .as_ref()
                .map(nightshift_coordinator::https::server_config)
                .transpose()?;
            agent_routes(&cfg, &Tokens::open(&cfg.data_dir)?)?;
            // One coordinator per data directory, for as long as this one runs.
            let _lock = nightshift_coordinator::store::DataDirLock::acquire(&cfg.data_dir)?;
            // On PostgreSQL any number may share the database: one leads, the others stand by.
            if let Some(url) = &cfg.store.url
                && let StoreUrl::Postgres(url) = StoreUrl::parse(url)?
            {
                return serve_shared(cfg.clone(), url, tls).await;
            }
            let cluster = server::open(&cfg)?;
            let access = nightshift_coordinator::http::access_for(&cfg, cluster.clone())?;
            if access.tokens.is_empty() {
                tracing::warn!(
                    "no API tokens: the API is open to anyone who reaches it; \
                     create one with nightshift-coordinator token create --role admin"
                );
            }
            let app =
                nightshift_coordinator::http::app(cluster.clone(), access, cfg.policy.clone());
            let listener = tokio::net::TcpListener::bind(cfg.listen)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.listen))?;
            tracing::info!(addr = %listener.local_addr()?, tls = tls.is_some(), "coordinator listening");
            match tls {
                Some(tls) => {
                    let shutdown = server::stopping(cluster.clone(), shutdown_signal());
                    nightshift_coordinator::https::serve_tls_app(
                        listener, cluster, app, tls, shutdown,
                    )
                    .await
                }
                None => server::serve_app(listener, cluster, app, shutdown_signal()).await,
            }
        }
    }
}

/// Refuses API tokens beside agent routes that authenticate nobody (no `[tls]`), unless
/// `[access] agents_without_tls` accepts that, which is then said at every start.
fn agent_routes(cfg: &CoordinatorConfig, tokens: &Tokens) -> anyhow::Result<()> {
    if cfg.agent_routes_without_tls(tokens.path(), !tokens.is_empty())? {
        tracing::warn!(
            "[access] agents_without_tls: the agent routes are served without TLS; anyone \
             who reaches the coordinator may speak for any node and read every job's \
             environment from them, API tokens or not; set [tls] to authenticate agents"
        );
    }
    Ok(())
}

/// Serves as one of the coordinators sharing the PostgreSQL database `url`: the API while
/// this one leads, a 503 naming the leader while it stands by.
async fn serve_shared(
    cfg: CoordinatorConfig,
    url: String,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
) -> anyhow::Result<()> {
    use nightshift_coordinator::leader;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let advertise = cfg.store.advertise_url.clone().unwrap_or_else(|| {
        let scheme = if tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{addr}")
    });
    let switch = leader::Switch::default();
    let build: leader::BuildApp = {
        let cfg = cfg.clone();
        std::sync::Arc::new(move |cluster| {
            let access = nightshift_coordinator::http::access_for(&cfg, cluster.clone())?;
            if access.tokens.is_empty() {
                tracing::warn!(
                    "no API tokens: the API is open to anyone who reaches it; \
                     create one with nightshift-coordinator token create --role admin"
                );
            }
            Ok(nightshift_coordinator::http::app(
                cluster,
                access,
                cfg.policy.clone(),
            ))
        })
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let leadership = tokio::spawn(leader::run(
        cfg.clone(),
        url,
        advertise.clone(),
        switch.clone(),
        build,
        stop_rx,
    ));
    tracing::info!(%addr, tls = tls.is_some(), url = %advertise, "coordinator listening; campaigning for leadership");
    let app = switch.router();
    let shutdown = async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    };
    match tls {
        Some(tls) => {
            nightshift_coordinator::https::serve_tls_router(listener, app, tls, shutdown).await
        }
        None => {
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
            // Open long-polls end with the leader's cluster (the leadership stops it).
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await?;
        }
    }
    let _ = tokio::time::timeout(server::STOP_GRACE, leadership).await;
    Ok(())
}

fn tls(command: TlsCommand) -> anyhow::Result<()> {
    use nightshift_coordinator::pki;
    match command {
        TlsCommand::Init { dir, server_names } => {
            std::fs::create_dir_all(&dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
            let ca = pki::new_ca()?;
            let server = pki::issue(&ca.key_pem, pki::Leaf::Server(&server_names))?;
            pki::write_pair(&dir.join(pki::CA_CERT), &dir.join(pki::CA_KEY), &ca)?;
            pki::write_pair(
                &dir.join(pki::SERVER_CERT),
                &dir.join(pki::SERVER_KEY),
                &server,
            )?;
            println!(
                "wrote {dir}/{{{ca},{cak},{sc},{sk}}}; keep {cak} off the network, and set \
                 [tls] ca_file, cert_file, key_file in coordinator.toml",
                dir = dir.display(),
                ca = pki::CA_CERT,
                cak = pki::CA_KEY,
                sc = pki::SERVER_CERT,
                sk = pki::SERVER_KEY,
            );
            Ok(())
        }
        TlsCommand::Coordinator {
            dir,
            out,
            server_names,
        } => {
            let ca_key = pki::read(&dir.join(pki::CA_KEY))?;
            let issued = pki::issue(&ca_key, pki::Leaf::Server(&server_names))?;
            let out = out.unwrap_or(dir);
            let (cert, key) = (out.join(pki::SERVER_CERT), out.join(pki::SERVER_KEY));
            pki::write_pair(&cert, &key, &issued)?;
            println!(
                "wrote {} and {}; point [tls] cert_file and key_file of coordinator.toml at them",
                cert.display(),
                key.display()
            );
            Ok(())
        }
        TlsCommand::Issue { node, dir, out } => {
            let ca_key = pki::read(&dir.join(pki::CA_KEY))?;
            let issued = pki::issue(&ca_key, pki::Leaf::Agent(&node))?;
            let out = out.unwrap_or(dir);
            let (cert, key) = (
                out.join(format!("{node}.pem")),
                out.join(format!("{node}.key")),
            );
            pki::write_pair(&cert, &key, &issued)?;
            println!(
                "wrote {} and {}; copy them with {} to the agent's host and set [tls] in agent.toml",
                cert.display(),
                key.display(),
                pki::CA_CERT
            );
            Ok(())
        }
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}
