//! `nightshift`: the command line for researchers and operators. All of it lives in
//! [`nightshift_coordinator::cli`]; this file only sets up logging and the runtime.

use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    std::process::exit(nightshift_coordinator::cli::main_with(std::env::args_os()).await);
}
