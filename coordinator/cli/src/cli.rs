//! The `nightshift` command line: parse arguments, call the coordinator, print the answer.
//!
//! [`main_with`] is the whole program behind a thin `main`; [`run`] is the same with its
//! standard streams passed in, so tests drive it in-process. Exit codes: 0 success, 1 an API
//! or runtime error, 2 a usage error or bad input (a job file that does not parse or
//! validate is refused here, before any request).
//!
//! `--output table` (the default) prints tables and key/value blocks for people;
//! `--output json` prints the API's own objects, pretty-printed, for `jq`. Errors always go
//! to stderr as `error: ...`; with `--output json` they are also printed to stdout as
//! `{"error": "...", "field": ..., "status": ...}` (`status` only when the coordinator
//! answered), so a script reading stdout sees a JSON value either way.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand, ValueEnum};
use nightshift_common::{JobSpec, UnixMillis};
use serde::Serialize;

use crate::client::{Client, ClientError};
pub use crate::error::CliError;
use crate::render::{clean, print, print_json};
pub use crate::render::{
    format_duration, format_relative, render_job, render_jobs, render_nodes, render_report,
};

/// Where the CLI looks for the coordinator unless told otherwise.
pub const DEFAULT_COORDINATOR: &str = "http://127.0.0.1:7400";

#[derive(Debug, Parser)]
#[command(
    name = "nightshift",
    version,
    about = "Run research jobs on idle inference GPUs"
)]
pub struct Cli {
    /// The coordinator's base URL; or several, separated by commas (coordinators sharing a
    /// PostgreSQL database), of which requests follow the leader.
    #[arg(
        long,
        global = true,
        env = "NIGHTSHIFT_URL",
        default_value = DEFAULT_COORDINATOR,
        value_name = "URL"
    )]
    pub coordinator: String,

    /// An API token (`nightshift-coordinator token create`), sent with every request.
    #[arg(
        long,
        global = true,
        env = "NIGHTSHIFT_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<Secret>,

    /// The cluster CA (ca.pem of `nightshift-coordinator tls init`): needed for an
    /// https:// coordinator, whose certificate it must sign.
    #[arg(long, global = true, env = "NIGHTSHIFT_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,

    /// How to print results.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// A secret from the command line or the environment: its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

/// The client for the coordinator the command line names, with its token.
fn client(cli: &Cli) -> Result<Client, ClientError> {
    Ok(Client::with_ca(&cli.coordinator, cli.ca.as_deref())?
        .with_token(cli.token.as_ref().map(|t| t.0.clone())))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(Debug, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Submit a job file (YAML or JSON) or an Argo Workflows file; `-` reads standard input.
    Submit {
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// A workflow parameter, overriding its value in the file (workflows only).
        #[arg(short = 'p', long = "parameter", value_name = "NAME=VALUE")]
        parameters: Vec<String>,
    },
    /// Show a pipeline run as a tree of its steps.
    Get {
        #[arg(value_name = "RUN")]
        run: u64,
    },
    /// Run a pipeline again from the file text and parameters it was started with.
    Rerun {
        #[arg(value_name = "RUN")]
        run: u64,
    },
    /// List jobs.
    Jobs,
    /// Inspect one job.
    Job {
        #[command(subcommand)]
        command: JobCommand,
    },
    /// Cancel a job; a running job is stopped first.
    Cancel { id: u64 },
    /// List nodes and what their GPUs are doing.
    Nodes,
    /// Harvested GPU-hours, what they were worth, and what preemption cost.
    Report {
        /// Start of the period: a date (2026-12-01, 2026-12-01T06:00:00Z) or an age (7d, 12h).
        #[arg(long)]
        since: Option<String>,
        /// End of the period (default: now).
        #[arg(long)]
        until: Option<String>,
        /// Group by team, job, day or month.
        #[arg(long, value_parser = ["team", "job", "day", "month"])]
        by: Option<String>,
    },
    /// Print a job's container output (stdout and stderr) while it has one; with STEP, the
    /// output of a pipeline run's step.
    Logs {
        /// A job, or with STEP a pipeline run.
        #[arg(value_name = "JOB|RUN")]
        id: u64,
        /// A step of the run, named as `nightshift get RUN` shows it (or its full name).
        #[arg(value_name = "STEP")]
        step: Option<String>,
        /// The step's Nth try (its Nth job, counting retries from 1) rather than its newest.
        #[arg(long, value_name = "N", requires = "step")]
        attempt: Option<u32>,
        /// Keep printing what the job writes until its container exits.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Only the last N lines, then (with -f) what follows.
        #[arg(long, value_name = "N")]
        tail: Option<usize>,
    },
    /// Run a self-contained demonstration cluster (`nightshift-demo`, installed beside this
    /// program or on PATH).
    Demo,
    /// Simulate a fleet on a traffic trace and compare lending policies.
    Simulate(crate::simulate::SimulateArgs),
    /// Hunt for invariant violations: seeds of a small simulated fleet under random faults,
    /// the real core and planner deciding; exits 1 naming each failing seed.
    Vopr(crate::vopr::VoprArgs),
    /// Check an Argo Workflows file offline; exits 2 when it cannot run, naming each line.
    Lint {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
}

#[derive(Debug, PartialEq, Eq, Subcommand)]
pub enum JobCommand {
    /// Show one job in detail.
    Show { id: u64 },
}

/// The error object printed to stdout under `--output json`.
#[derive(Serialize)]
struct JsonError {
    error: String,
    field: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
}

/// Runs the CLI on the process's standard streams; returns the exit code.
pub async fn main_with<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run(args, &mut io::stdin(), &mut io::stdout(), &mut io::stderr()).await
}

/// Runs the CLI with the given arguments (the first is the program name) and streams.
pub async fn run<I, T>(
    args: I,
    stdin: &mut (dyn Read + Send),
    out: &mut (dyn Write + Send),
    err: &mut (dyn Write + Send),
) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version are "errors" to clap that go to stdout and exit 0.
            let mut text = e.render().to_string();
            if !text.ends_with('\n') {
                text.push('\n');
            }
            let _ = if e.use_stderr() {
                err.write_all(text.as_bytes())
            } else {
                out.write_all(text.as_bytes())
            };
            return e.exit_code();
        }
    };
    let json = cli.output == OutputFormat::Json;
    match execute(&cli, stdin, out).await {
        Ok(code) => code,
        Err(CliError::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => 1,
        Err(e) => {
            report(&e, json, out, err);
            e.exit_code()
        }
    }
}

fn report(e: &CliError, json: bool, out: &mut (dyn Write + Send), err: &mut (dyn Write + Send)) {
    tracing::debug!(error = ?e, "command failed");
    let _ = writeln!(err, "error: {e}");
    if json {
        let status = match e {
            CliError::Client(c) => c.status().map(|s| s.as_u16()),
            _ => None,
        };
        let body = JsonError {
            error: e.to_string(),
            field: e.field(),
            status,
        };
        let _ = print_json(out, &body);
    }
}

async fn execute(
    cli: &Cli,
    stdin: &mut (dyn Read + Send),
    out: &mut (dyn Write + Send),
) -> Result<i32, CliError> {
    let json = cli.output == OutputFormat::Json;
    match &cli.command {
        Command::Demo => return Ok(crate::demo::run(json)?),
        Command::Simulate(args) => {
            let report = crate::simulate::run(args)?;
            if let Some(path) = &args.html {
                let page = crate::simchart::page(&report).map_err(std::io::Error::other)?;
                std::fs::write(path, page)?;
            }
            print(out, json, &report, || report.to_table())?;
        }
        Command::Vopr(args) => {
            let report = crate::vopr::run(args).map_err(CliError::Usage)?;
            print(out, json, &report, || report.to_table())?;
            if !report.failures.is_empty() {
                return Ok(1);
            }
        }
        Command::Lint { file } => return crate::lint::run(file, stdin, out, json),
        Command::Submit { file, parameters } => {
            let (shown, text) = read_text(file, stdin, |path, source| CliError::ReadJobFile {
                path,
                source,
            })?;
            if crate::workflows::is_workflow(&text) {
                return crate::workflows::submit(
                    &client(cli)?,
                    &shown,
                    &text,
                    parameters,
                    out,
                    json,
                )
                .await;
            }
            if let Some(p) = parameters.first() {
                return Err(CliError::Parameter(p.clone()));
            }
            // Read and validate first: a bad file never costs a request.
            let spec = JobSpec::from_yaml(&text).map_err(|source| CliError::JobFile {
                path: shown,
                source,
            })?;
            let job = client(cli)?.submit(&spec).await?;
            print(out, json, &job, || {
                format!(
                    "submitted job {} ({}), now {}\n",
                    job.id,
                    clean(&job.spec.name),
                    job.state.as_str()
                )
            })?;
        }
        Command::Get { run } => {
            let view = client(cli)?.pipeline(*run).await?;
            print(out, json, &view, || {
                crate::workflows::render_run(&view, now_ms())
            })?;
        }
        Command::Rerun { run } => {
            let view = client(cli)?.rerun_pipeline(*run).await?;
            print(out, json, &view, || {
                format!(
                    "started pipeline run {} ({}) as a rerun of {run}\n",
                    view.id,
                    clean(&view.name)
                )
            })?;
        }
        Command::Jobs => {
            let list = client(cli)?.jobs().await?;
            print(out, json, &list, || render_jobs(&list.jobs, now_ms()))?;
        }
        Command::Job {
            command: JobCommand::Show { id },
        } => {
            let job = client(cli)?.job(*id).await?;
            print(out, json, &job, || render_job(&job, now_ms()))?;
        }
        Command::Cancel { id } => {
            let job = client(cli)?.cancel(*id).await?;
            print(out, json, &job, || {
                format!(
                    "job {} ({}) is now {}\n",
                    job.id,
                    clean(&job.spec.name),
                    job.state.as_str()
                )
            })?;
        }
        Command::Logs {
            id,
            step,
            attempt,
            follow,
            tail,
        } => {
            let client = client(cli)?;
            let job = match step {
                Some(step) => {
                    let run = client.pipeline(*id).await?;
                    crate::workflows::step_job(&run, step, *attempt).map_err(CliError::Usage)?
                }
                None => *id,
            };
            client.logs(job, *tail, *follow, out).await?;
        }
        Command::Nodes => {
            let list = client(cli)?.nodes().await?;
            print(out, json, &list, || render_nodes(&list.nodes, now_ms()))?;
        }
        Command::Report { since, until, by } => {
            let now = now_ms();
            let time = |flag: &str, v: Option<&str>| {
                v.map(|t| {
                    nightshift_core::report::parse_time(t, now)
                        .map_err(|e| CliError::Usage(format!("--{flag}: {e}")))
                })
                .transpose()
            };
            let (since, until) = (
                time("since", since.as_deref())?,
                time("until", until.as_deref())?,
            );
            let report = client(cli)?.report(since, until, by.as_deref()).await?;
            print(out, json, &report, || render_report(&report))?;
        }
    }
    Ok(0)
}

/// Reads a file a command takes; `-` is standard input. Returns the name to show and the
/// text; `unreadable` names the error when it cannot be read.
pub(crate) fn read_text(
    path: &Path,
    stdin: &mut (dyn Read + Send),
    unreadable: fn(String, io::Error) -> CliError,
) -> Result<(String, String), CliError> {
    let (shown, text) = if path == Path::new("-") {
        let mut text = String::new();
        let read = stdin.read_to_string(&mut text);
        ("<stdin>".to_owned(), read.map(|_| text))
    } else {
        (path.display().to_string(), std::fs::read_to_string(path))
    };
    let text = text.map_err(|source| unreadable(shown.clone(), source))?;
    Ok((shown, text))
}

fn now_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as UnixMillis)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use nightshift_common::{AttemptEnding, EnvVar, JobList, JobState, JobView, NodeMode};

    use super::*;
    use crate::client::fake::{self, T0};
    use crate::error::parse_error_field;
    use crate::render::shell_words;

    const NOW: UnixMillis = T0 + 300_000;

    async fn cli(args: &[&str], stdin: &str) -> (i32, String, String) {
        let mut input = stdin.as_bytes();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let args = std::iter::once("nightshift").chain(args.iter().copied());
        let code = run(args, &mut input, &mut out, &mut err).await;
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nightshift").chain(args.iter().copied()))
    }

    #[test]
    fn global_flags_go_before_or_after_the_subcommand() {
        let cli = parse(&["--coordinator", "http://c:1", "-o", "json", "jobs"]).unwrap();
        assert_eq!(
            (cli.coordinator.as_str(), cli.output, cli.command),
            ("http://c:1", OutputFormat::Json, Command::Jobs)
        );
        let cli = parse(&[
            "job",
            "show",
            "12",
            "--output",
            "json",
            "--coordinator",
            "http://d",
        ])
        .unwrap();
        assert_eq!(
            cli.command,
            Command::Job {
                command: JobCommand::Show { id: 12 }
            }
        );
        assert_eq!(
            (cli.coordinator.as_str(), cli.output),
            ("http://d", OutputFormat::Json)
        );
        let cli = parse(&["submit", "-"]).unwrap();
        assert_eq!(
            cli.command,
            Command::Submit {
                file: "-".into(),
                parameters: vec![]
            }
        );
        assert_eq!(
            parse(&["cancel", "3"]).unwrap().command,
            Command::Cancel { id: 3 }
        );
        assert_eq!(parse(&["nodes"]).unwrap().command, Command::Nodes);
        assert_eq!(parse(&["demo"]).unwrap().command, Command::Demo);
    }

    #[test]
    fn defaults_are_table_and_the_local_coordinator() {
        let cli = parse(&["jobs"]).unwrap();
        assert_eq!(cli.output, OutputFormat::Table);
        // The environment of the test process may point elsewhere.
        if std::env::var_os("NIGHTSHIFT_URL").is_none() {
            assert_eq!(cli.coordinator, DEFAULT_COORDINATOR);
        }
    }

    #[tokio::test]
    async fn usage_errors_exit_2_and_help_exits_0() {
        for args in [
            &["job", "show", "abc"][..],
            &["--output", "yaml", "jobs"],
            &["submit"],
            &["cancel", "-1"],
            &["frobnicate"],
            // --attempt picks a try of a pipeline step: it needs the STEP.
            &["logs", "3", "--attempt", "2"],
        ] {
            let (code, out, err) = cli(args, "").await;
            assert_eq!(code, 2, "{args:?}: {err}");
            assert!(
                out.is_empty() && err.starts_with("error: "),
                "{args:?}: {err}"
            );
        }
        let (code, out, err) = cli(&[], "").await;
        assert_eq!(code, 2);
        assert!(out.is_empty() && err.contains("Usage: nightshift"), "{err}");
        let (code, out, _) = cli(&["--help"], "").await;
        assert_eq!(code, 0);
        assert!(out.contains("Usage: nightshift"), "{out}");
        let (code, out, _) = cli(&["--version"], "").await;
        assert_eq!(
            (code, out.as_str()),
            (0, concat!("nightshift ", env!("CARGO_PKG_VERSION"), "\n"))
        );
    }

    #[tokio::test]
    async fn an_invalid_coordinator_url_is_bad_input() {
        let (code, _, err) = cli(&["--coordinator", "coord:7400", "jobs"], "").await;
        assert_eq!(code, 2);
        assert_eq!(
            err,
            "error: invalid coordinator url \"coord:7400\": expected http://host:port\n"
        );
    }

    #[tokio::test]
    async fn a_bad_job_file_exits_2_before_any_request() {
        let (url, hits) = fake::serve(fake::coordinator).await;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.yaml");
        std::fs::write(&path, "name: train\nimage: trainer:1\ngpus: 0\n").unwrap();
        let path = path.to_str().unwrap();

        let (code, out, err) = cli(&["--coordinator", &url, "submit", path], "").await;
        assert_eq!((code, out.as_str()), (2, ""));
        assert_eq!(
            err,
            format!("error: job file {path}: gpus: must be at least 1\n")
        );

        let (code, out, _) = cli(&["--coordinator", &url, "-o", "json", "submit", path], "").await;
        assert_eq!(code, 2);
        let body: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(body["field"], "gpus");
        assert_eq!(
            body["error"],
            format!("job file {path}: gpus: must be at least 1")
        );

        let stdin = "name: a\nimage: b\ngpus: 1\nenv:\n  - name: X\n    valu: 1\n";
        let (code, out, err) =
            cli(&["--coordinator", &url, "-o", "json", "submit", "-"], stdin).await;
        assert_eq!(code, 2);
        assert!(
            err.starts_with("error: job file <stdin>: env[0]: unknown field `valu`"),
            "{err}"
        );
        assert!(err.contains("line 6"), "{err}");
        let body: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(body["field"], "env[0].valu");

        let missing = dir.path().join("nope.yaml");
        let missing = missing.to_str().unwrap();
        let (code, _, err) = cli(&["--coordinator", &url, "submit", missing], "").await;
        assert_eq!(code, 2);
        assert!(
            err.starts_with(&format!("error: cannot read job file {missing}: ")),
            "{err}"
        );

        assert_eq!(hits.load(Ordering::SeqCst), 0, "no request may be sent");
    }

    #[tokio::test]
    async fn submit_from_stdin_prints_the_new_job() {
        let (url, hits) = fake::serve(fake::coordinator).await;
        let stdin = "name: sft\nimage: trainer:1\ngpus: 2\n";
        let (code, out, err) = cli(&["--coordinator", &url, "submit", "-"], stdin).await;
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (0, "submitted job 9 (sft), now queued\n", "")
        );
        assert_eq!(hits.load(Ordering::SeqCst), 1);

        let (code, out, _) =
            cli(&["--coordinator", &url, "-o", "json", "submit", "-"], stdin).await;
        assert_eq!(code, 0);
        let job: JobView = serde_json::from_str(&out).unwrap();
        assert_eq!((job.id, job.spec.gpus), (9, 2));
    }

    #[tokio::test]
    async fn an_api_refusal_exits_1_naming_the_field() {
        let (url, _) = fake::serve(fake::coordinator).await;
        let stdin = "name: big\nimage: trainer:1\ngpus: 8\n";
        let (code, out, err) = cli(&["--coordinator", &url, "submit", "-"], stdin).await;
        assert_eq!((code, out.as_str()), (1, ""));
        assert_eq!(
            err,
            "error: 409 Conflict: gpus: no node has more than 4 gpus\n"
        );

        let (code, out, _) =
            cli(&["--coordinator", &url, "-o", "json", "submit", "-"], stdin).await;
        assert_eq!(code, 1);
        let body: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "error": "409 Conflict: gpus: no node has more than 4 gpus",
                "field": "gpus",
                "status": 409,
            })
        );

        let (code, _, err) = cli(&["--coordinator", &url, "job", "show", "99"], "").await;
        assert_eq!(
            (code, err.as_str()),
            (1, "error: 404 Not Found: job 99 not found\n")
        );
    }

    #[tokio::test]
    async fn connection_refused_gives_the_friendly_message() {
        let url = fake::refused_url();
        let (code, out, err) = cli(&["--coordinator", &url, "nodes"], "").await;
        assert_eq!((code, out.as_str()), (1, ""));
        assert_eq!(
            err,
            format!(
                "error: cannot reach the coordinator at {url}: connection refused \
                 (is nightshift-coordinator running? set --coordinator or NIGHTSHIFT_URL)\n"
            )
        );
        let (code, out, _) = cli(&["--coordinator", &url, "-o", "json", "nodes"], "").await;
        assert_eq!(code, 1);
        let body: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(body["field"], serde_json::Value::Null);
        assert!(body.get("status").is_none());
    }

    #[tokio::test]
    async fn json_output_is_the_api_object() {
        let (url, _) = fake::serve(fake::coordinator).await;
        let (code, out, _) = cli(&["--coordinator", &url, "jobs", "-o", "json"], "").await;
        assert_eq!(code, 0);
        let list: JobList = serde_json::from_str(&out).unwrap();
        assert_eq!(list.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [7, 8]);

        let (code, out, _) = cli(&["--coordinator", &url, "jobs"], "").await;
        assert_eq!(code, 0);
        assert!(out.starts_with("ID  NAME"), "{out}");

        let (code, out, _) = cli(&["--coordinator", &url, "cancel", "7"], "").await;
        assert_eq!(
            (code, out.as_str()),
            (0, "job 7 (train-llama) is now cancelling\n")
        );

        let (code, out, _) = cli(&["--coordinator", &url, "job", "show", "7"], "").await;
        assert_eq!(code, 0);
        assert!(
            out.contains("lease:        node gpu-03, gpus 0,1, epoch 7, lease 14"),
            "{out}"
        );

        let (code, out, _) = cli(&["--coordinator", &url, "nodes"], "").await;
        assert_eq!(code, 0);
        assert!(out.contains("gpu-03  lend   stopped  2/4   7"), "{out}");
    }

    #[test]
    fn jobs_table() {
        let jobs = [
            fake::running(7, fake::spec("train-llama", 2)),
            fake::queued(8, fake::spec("eval", 1)),
            JobView {
                state: JobState::Succeeded,
                finished_at: Some(T0 + 252_000),
                exit_code: Some(0),
                leases: Vec::new(),
                attempts: vec![fake::attempt(2, &["gpu-01", "gpu-02"])],
                ..fake::running(12, fake::spec("tab\there", 4))
            },
        ];
        assert_eq!(
            render_jobs(&jobs, NOW),
            "\
ID  NAME         STATE      ATTEMPT  GPUS  NODE           AGE  DURATION
7   train-llama  running    2        2     gpu-03         5m   4m
8   eval         queued     1        1     -              5m   -
12  tab\\there    succeeded  2        4     gpu-01,gpu-02  5m   3m12s
"
        );
        assert_eq!(render_jobs(&[], NOW), "no jobs\n");
    }

    #[test]
    fn tables_show_what_a_display_would_hide() {
        // Names saved before the coordinator refused them: each hidden character is escaped,
        // so `bobjob\u{200b}` no longer prints as `bobjob`, nor does a bidi override turn
        // the rest of the line around.
        let mut spec = fake::spec("\u{202e}nur-lave", 1);
        spec.owner = Some("nlp\u{2066}".into());
        let jobs = [
            fake::queued(7, fake::spec("bobjob", 1)),
            fake::queued(8, fake::spec("bobjob\u{200b}", 1)),
            fake::queued(9, spec.clone()),
        ];
        assert_eq!(
            render_jobs(&jobs, NOW),
            "\
ID  NAME              STATE   ATTEMPT  GPUS  NODE  AGE  DURATION
7   bobjob            queued  1        1     -     5m   -
8   bobjob\\u{200b}    queued  1        1     -     5m   -
9   \\u{202e}nur-lave  queued  1        1     -     5m   -
"
        );
        let block = render_job(&fake::queued(9, spec), NOW);
        assert!(
            block.contains("name:         \\u{202e}nur-lave\n"),
            "{block}"
        );
        assert!(block.contains("owner:        nlp\\u{2066}\n"), "{block}");
    }

    #[test]
    fn job_block() {
        let mut spec = fake::spec("train-llama", 2);
        spec.owner = Some("alice".into());
        spec.command = vec!["python".into(), "train.py".into()];
        spec.args = vec![
            "--lr".into(),
            "1e-4".into(),
            "--note".into(),
            "two words".into(),
        ];
        spec.env = vec![EnvVar {
            name: "HF_HOME".into(),
            value: "/data/hf".into(),
        }];
        let mut job = fake::running(7, spec);
        job.outputs.insert("loss".into(), "0.31".into());
        job.outputs.insert("step".into(), "1200".into());
        job.message = Some("resumed from step 1100".into());
        assert_eq!(
            render_job(&job, NOW),
            "\
id:           7
name:         train-llama
state:        running
owner:        alice
image:        registry.example/team/trainer:1.4
command:      python train.py
args:         --lr 1e-4 --note 'two words'
env:          HF_HOME
gpus:         2
priority:     0
checkpoint:   SIGTERM, 30s grace
attempt:      2
preemptions:  1
submitted:    5m ago
started:      4m ago
duration:     4m
lease:        node gpu-03, gpus 0,1, epoch 7, lease 14, expires in 100s
outputs:      loss = 0.31
              step = 1200
message:      resumed from step 1100
"
        );

        // A finished job keeps where each attempt ran and how it ended.
        let mut job = fake::queued(11, fake::spec("gang", 2));
        job.state = JobState::Succeeded;
        job.attempt = 2;
        job.finished_at = Some(T0 + 252_000);
        let mut preempted = fake::attempt(1, &["gpu-03"]);
        preempted.ended_at = Some(T0 + 100_000);
        preempted.ending = Some(AttemptEnding::Preempted);
        preempted.exit_code = None;
        preempted.message = Some("preempted".into());
        let mut failed = fake::attempt(2, &["gpu-01"]);
        failed.started_at = None;
        failed.ending = Some(AttemptEnding::FailedToStart);
        failed.exit_code = None;
        failed.message = Some("image\tmissing".into());
        job.attempts = vec![preempted, failed, fake::attempt(2, &["gpu-01", "gpu-02"])];
        let text = render_job(&job, NOW);
        assert!(
            text.ends_with(
                "\
attempts:
  ATTEMPT  NODE           GPUS     EPOCH  STARTED  ENDED      RAN    ENDING           EXIT  MESSAGE
  1        gpu-03         0,1      7      4m ago   3m20s ago  40s    preempted        -     preempted
  2        gpu-01         0,1      7      -        48s ago    -      failed to start  -     image\\tmissing
  2        gpu-01,gpu-02  0,1/0,1  7      4m ago   48s ago    3m12s  succeeded        0
"
            ),
            "{text}"
        );

        let mut job = fake::queued(8, fake::spec("eval", 1));
        job.state = JobState::Failed;
        job.exit_code = Some(137);
        let text = render_job(&job, NOW);
        assert!(text.contains("\nexit code:    137\n"), "{text}");
        assert!(!text.contains("lease"), "{text}");
        assert!(!text.contains("run time"), "{text}");

        // A job pinned to its registry digest shows both.
        let mut job = fake::running(10, fake::spec("pinned", 1));
        job.spec.image = "reg:5000/team/eval:1".into();
        job.image_digest = Some("reg:5000/team/eval@sha256:aa".into());
        let text = render_job(&job, NOW);
        assert!(
            text.contains(
                "\nimage:        reg:5000/team/eval:1\npinned:       reg:5000/team/eval@sha256:aa\n"
            ),
            "{text}"
        );

        // Run time counts its ended attempts and the current one.
        let mut job = fake::running(9, fake::spec("bounded", 1));
        job.spec.max_run_seconds = Some(3600);
        job.ran_ms = 600_000;
        job.attempt_started_at = Some(NOW - 300_000);
        let text = render_job(&job, NOW);
        assert!(
            text.contains("\nrun time:     15m of its 1h limit\n"),
            "{text}"
        );
        job.state = JobState::Failed;
        job.finished_at = Some(NOW);
        job.attempt_started_at = None;
        job.ran_ms = 3_600_000;
        job.timed_out = true;
        let text = render_job(&job, NOW);
        assert!(
            text.contains("\nrun time:     1h of its 1h limit, reached\n"),
            "{text}"
        );
    }

    #[test]
    fn nodes_table() {
        let mut lost = fake::node(
            "gpu-04",
            NodeMode::Lend,
            [Some(12), Some(9), Some(12), None],
        );
        lost.reachable = false;
        lost.last_heartbeat = Some(T0);
        lost.gpus[3].healthy = Some(false);
        lost.gpus[3].unhealthy_reason = Some("xid 79: the gpu has fallen off the bus".into());
        let mut new = fake::node("gpu-05", NodeMode::Serve, [None; 4]);
        new.replica = None;
        new.last_heartbeat = None;
        let nodes = [
            fake::node("gpu-01", NodeMode::Serve, [None; 4]),
            fake::node("gpu-03", NodeMode::Lend, [Some(7), Some(7), None, None]),
            lost,
            new,
        ];
        assert_eq!(
            render_nodes(&nodes, NOW),
            "\
NAME    MODE   REPLICA  GPUS  JOBS  LAST HEARTBEAT
gpu-01  serve  serving  0/4   -     1s ago
gpu-03  lend   stopped  2/4   7     1s ago
gpu-04  lend   stopped  3/4   9,12  5m ago (unreachable)
gpu-05  serve  -        0/4   -     never
gpu-04 gpu 3 unhealthy, not leased: xid 79: the gpu has fallen off the bus
"
        );
        assert_eq!(render_nodes(&[], NOW), "no nodes\n");
    }

    #[test]
    fn durations_read_like_kubectl() {
        let cases = [
            (0, "0s"),
            (999, "0s"),
            (45_000, "45s"),
            (119_000, "119s"),
            (120_000, "2m"),
            (192_000, "3m12s"),
            (42 * 60_000, "42m"),
            (2 * 3_600_000, "2h"),
            ((5 * 60 + 3) * 60_000, "5h3m"),
            (3 * 86_400_000, "3d"),
            ((2 * 24 + 4) * 3_600_000, "2d4h"),
        ];
        for (ms, text) in cases {
            assert_eq!(format_duration(ms), text, "{ms} ms");
        }
        assert_eq!(format_relative(NOW, NOW - 12_000), "12s ago");
        assert_eq!(format_relative(NOW, NOW + 25_000), "in 25s");
    }

    #[test]
    fn parse_errors_name_their_field() {
        let cases = [
            (
                "env[0]: unknown field `valu`, expected `name` or `value` at line 6",
                Some("env[0].valu"),
            ),
            ("missing field `gpus`", Some("gpus")),
            (
                "gpus: invalid type: string \"many\", expected u32 at line 3",
                Some("gpus"),
            ),
            (
                "unknown field `foo`, expected one of `name` at line 4 column 1",
                Some("foo"),
            ),
            (
                "did not find expected key, while parsing a block mapping",
                None,
            ),
        ];
        for (rule, field) in cases {
            assert_eq!(parse_error_field(rule).as_deref(), field, "{rule}");
        }
    }

    #[test]
    fn shell_words_quote_only_where_needed() {
        let words = ["python", "-c", "print('hi')", "", "a=b"].map(String::from);
        assert_eq!(
            shell_words(&words),
            r#"python -c 'print('\''hi'\'')' '' a=b"#
        );
    }
}
