//! `nightshift-loadgen`: open-loop load against an OpenAI-compatible completions endpoint, with
//! an optional surge part-way through. Prints a summary (or the stats as JSON) and exits 1 when
//! any request failed.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use nightshift_devcluster::loadgen::{LoadGen, LoadGenOptions, LoadStats, RequestShape};

#[derive(Debug, Parser)]
#[command(
    name = "nightshift-loadgen",
    about = "Open-loop load for a completions endpoint"
)]
struct Args {
    /// Base URL of the server (or gateway), e.g. http://127.0.0.1:8000.
    #[arg(long)]
    url: String,
    /// Requests per second.
    #[arg(long)]
    rate: f64,
    /// How long to send, in seconds.
    #[arg(long)]
    duration: f64,
    /// When to switch to --surge-rate, in seconds from the start.
    #[arg(long, requires = "surge_rate")]
    surge_at: Option<f64>,
    /// Requests per second from --surge-at on.
    #[arg(long, requires = "surge_at")]
    surge_rate: Option<f64>,
    /// max_tokens of each request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Words in each prompt.
    #[arg(long, default_value_t = 8)]
    prompt_words: u32,
    /// Model name sent with each request.
    #[arg(long, default_value = "standin-model")]
    model: String,
    /// Timeout of one request, in seconds.
    #[arg(long, default_value_t = 300.0)]
    request_timeout: f64,
    /// How long to wait for requests in flight after the last one is sent, in seconds.
    #[arg(long, default_value_t = 60.0)]
    drain: f64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(stats) if stats.errors == 0 => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nightshift-loadgen: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<LoadStats> {
    let duration = seconds("--duration", args.duration)?;
    let surge = surge(args, duration)?;
    let options = LoadGenOptions {
        request_timeout: seconds("--request-timeout", args.request_timeout)?,
        ..LoadGenOptions::default()
    };
    let shape = RequestShape {
        max_tokens: args.max_tokens,
        prompt_words: args.prompt_words,
        model: args.model.clone(),
    };
    let lg = LoadGen::start_with(&args.url, args.rate, shape, options);
    let mut elapsed = Duration::ZERO;
    if let Some((at, rate)) = surge {
        tokio::time::sleep(at).await;
        lg.set_rate(rate);
        elapsed = at;
    }
    tokio::time::sleep(duration - elapsed).await;
    let stats = lg.finish(seconds("--drain", args.drain)?).await;
    print(args, &stats)?;
    Ok(stats)
}

/// When and to what the rate surges, checked against the duration.
fn surge(args: &Args, duration: Duration) -> anyhow::Result<Option<(Duration, f64)>> {
    let (Some(at), Some(rate)) = (args.surge_at, args.surge_rate) else {
        return Ok(None);
    };
    let at = seconds("--surge-at", at)?;
    if at > duration {
        bail!("--surge-at ({at:?}) is after the end of the run ({duration:?})");
    }
    Ok(Some((at, rate)))
}

fn seconds(flag: &str, s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .with_context(|| format!("{flag} must be a number of seconds >= 0"))
}

fn print(args: &Args, stats: &LoadStats) -> anyhow::Result<()> {
    match args.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(stats)?),
        Output::Text => print_summary(args, stats),
    }
    Ok(())
}

fn print_summary(args: &Args, s: &LoadStats) {
    println!("target:   {}", args.url);
    println!(
        "sent:     {} ({} ok, {} errors, {} in flight)",
        s.sent, s.ok, s.errors, s.in_flight
    );
    println!(
        "latency:  p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        s.latency_ms_p50, s.latency_ms_p99, s.latency_ms_max
    );
    for sample in &s.error_samples {
        println!("error:    {sample}");
    }
}
