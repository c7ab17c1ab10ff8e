//! `nightshift`: the command line for researchers and operators. All of it lives in
//! [`nightshift_cli::cli`]; this file only sets up logging and the runtime.

#[tokio::main]
async fn main() {
    nightshift_common::logging::init("warn");
    std::process::exit(nightshift_cli::cli::main_with(std::env::args_os()).await);
}
