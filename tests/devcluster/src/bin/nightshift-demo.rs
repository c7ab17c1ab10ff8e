//! `nightshift-demo`: the whole harvest loop on this machine, with Docker and no GPU (see
//! [`nightshift_devcluster::demo`]). `nightshift demo` runs this program.

use clap::{Parser, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "nightshift-demo",
    version,
    about = "Run a self-contained demonstration cluster: a coordinator and an agent with fake \
             GPUs, the vLLM stand-in behind a gateway, a night of lending and a morning surge"
)]
struct Args {
    /// How to print the result: a live timeline and a summary, or one JSON object.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    output: Output,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[tokio::main]
async fn main() {
    nightshift_common::logging::init("warn");
    let args = Args::parse();
    let code = match nightshift_devcluster::demo::run(args.output == Output::Json).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}
