//! `nightshift-coordinator`: serve the cluster's API, or validate a configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use nightshift_coordinator::config::CoordinatorConfig;
use nightshift_coordinator::server;

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
    /// Check a configuration file and exit.
    Validate {
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Validate { config } => {
            CoordinatorConfig::load(config.as_deref())?;
            println!("configuration is valid");
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
            let cluster = server::open(&cfg)?;
            let listener = tokio::net::TcpListener::bind(cfg.listen)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.listen))?;
            tracing::info!(addr = %listener.local_addr()?, "coordinator listening");
            server::serve(listener, cluster, shutdown_signal()).await
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
