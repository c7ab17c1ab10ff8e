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
    /// Show what the agent sees on this host now: GPUs, container engine, managed
    /// containers, vLLM signals. Changes nothing.
    Probe {
        /// vLLM's base URL; `http://127.0.0.1:<replica.host_port>` by default.
        #[arg(long)]
        vllm_url: Option<String>,
        #[arg(long, value_enum, default_value_t = Output::Text)]
        output: Output,
        /// This node's name (overrides `node`); managed containers carry it.
        #[arg(long)]
        node: Option<String>,
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Text,
    Json,
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
        Command::Probe {
            vllm_url,
            output,
            node,
            config,
        } => {
            let mut cfg = AgentConfig::load(config.as_deref())?;
            if let Some(node) = node {
                cfg.node = node;
            }
            let report = probe(&cfg, vllm_url).await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
                Output::Text => print!("{}", nightshift_agent::probe::render_text(&report)),
            }
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
            let engine = DockerEngine::connect_to(cfg.engine.host()).await?;
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

async fn probe(cfg: &AgentConfig, vllm_url: Option<String>) -> anyhow::Result<serde_json::Value> {
    use nightshift_agent::probe;
    let node = cfg.node_name();
    let gpus = HostGpus::open(&node, cfg.gpus.fake, cfg.gpus.nvml_library.as_deref())
        .map_err(|e| e.to_string());
    let gpus = probe::gpus_part(gpus);
    let engine = DockerEngine::connect_to(cfg.engine.host())
        .await
        .map_err(|e| e.to_string());
    let (mut docker, containers) = probe::engine_part(engine, &node).await;
    docker["socket"] = DockerEngine::socket(cfg.engine.host()).into();
    let url = vllm_url.or_else(|| {
        (cfg.replica.host_port != 0).then(|| format!("http://127.0.0.1:{}", cfg.replica.host_port))
    });
    let serving = HttpServing::new()?;
    let (vllm, vllm_error) = match &url {
        Some(url) => probe::vllm_part(&serving, url).await,
        None => (
            serde_json::Value::Null,
            serde_json::json!("no --vllm-url and replica.host_port is 0"),
        ),
    };
    Ok(serde_json::json!({
        "node": node,
        "agent_version": env!("CARGO_PKG_VERSION"),
        "gpus": gpus,
        "docker": docker,
        "containers": containers,
        "vllm": vllm,
        "vllm_error": vllm_error,
    }))
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
