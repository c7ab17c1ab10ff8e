//! `nightshift-agent`: run the node agent, or validate its configuration.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use nightshift_agent::config::AgentConfig;
use nightshift_agent::engine::docker::DockerEngine;
use nightshift_agent::gpus::HostGpus;
use nightshift_agent::serving::http::HttpServing;

#[derive(Parser)]
#[command(
    version,
    about = "nightshift node agent: lends this host's GPUs to jobs when serving is idle"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent.
    Run {
        /// The coordinator's URL (overrides `coordinator`).
        #[arg(long)]
        coordinator: Option<String>,
        /// This node's name (overrides `node`).
        #[arg(long)]
        node: Option<String>,
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
            let cfg = AgentConfig::load(config.as_deref())?;
            // The TLS files: readable, and the node's certificate signed by the CA.
            nightshift_agent::uplink::Uplink::with_tls(
                &cfg.coordinator,
                &cfg.node_name(),
                &cfg.tls,
            )?;
            println!("configuration is valid");
            Ok(())
        }
        Command::Run {
            coordinator,
            node,
            config,
        } => {
            let mut cfg = AgentConfig::load(config.as_deref())?;
            if let Some(url) = coordinator {
                cfg.coordinator = url;
            }
            if let Some(node) = node {
                cfg.node = node;
            }
            cfg.validate()?;
            let node = cfg.node_name();
            let gpus = HostGpus::open(&node, cfg.gpus.fake, cfg.gpus.nvml_library.as_deref())?;
            let engine = DockerEngine::connect().await?;
            let serving = HttpServing::new()?;
            let listener = tokio::net::TcpListener::bind(cfg.readiness_listen)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.readiness_listen))?;
            tracing::info!(node = %node, readiness = %cfg.readiness_listen, "agent starting");
            let mut agent =
                nightshift_agent::agent::start(cfg, engine, gpus, serving, Some(listener))?;
            tokio::select! {
                _ = agent.wait() => anyhow::bail!("agent tasks ended unexpectedly"),
                _ = shutdown_signal() => {
                    tracing::info!(node = %node, "stopping; managed containers keep running and are adopted on restart");
                    agent.stop();
                    Ok(())
                }
            }
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
}
