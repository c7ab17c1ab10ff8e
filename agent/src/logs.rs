//! `GET /v1/jobs/{id}/logs?tail=N&follow=bool` on the agent's HTTP port: a job container's
//! stdout and stderr, from the start or the last `tail` lines, and with `follow` what it
//! writes until it exits. The coordinator proxies `nightshift logs` here.
//!
//! The container is found by its labels (this node, role job, the job id); of several (a
//! job retried on this node), the highest attempt's, or the one `attempt=N` names.
//!
//! A finished container is removed once the coordinator has seen it end, so before removing
//! one the agent keeps the end of its output ([`ARCHIVE_LINES`], [`ARCHIVE_CAP`]) in
//! `work_dir/jobs/ID/logs/attempt-N.log` ([`archive`]); a job whose container is gone is
//! answered from there, as Nomad answers from an allocation's log directory after the task
//! exited.

use std::collections::BTreeMap;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::{StreamExt, TryStreamExt};
use nightshift_common::labels;
use serde::Deserialize;

use crate::engine::{Container, Engine};

/// The most output kept of one finished attempt: its last 4 MiB ...
pub const ARCHIVE_CAP: usize = 4 << 20;
/// ... of at most its last 50,000 lines, so that keeping a chatty job's output reads a
/// bounded amount from Docker.
pub const ARCHIVE_LINES: usize = 50_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogsQuery {
    /// The last N lines; everything when absent.
    pub tail: Option<usize>,
    #[serde(default)]
    pub follow: bool,
    /// This attempt's output rather than the latest's.
    pub attempt: Option<u64>,
}

struct Ctx<E> {
    engine: Arc<E>,
    node: String,
    work_dir: PathBuf,
}

pub fn router<E: Engine>(engine: Arc<E>, node: &str, work_dir: &FsPath) -> Router {
    Router::new()
        .route("/v1/jobs/{id}/logs", get(logs::<E>))
        .with_state(Arc::new(Ctx {
            engine,
            node: node.to_owned(),
            work_dir: work_dir.to_owned(),
        }))
}

/// Where a finished attempt's output is kept.
pub fn archive_path(work_dir: &FsPath, job_id: u64, attempt: u64) -> PathBuf {
    archive_dir(work_dir, job_id).join(format!("attempt-{attempt}.log"))
}

fn archive_dir(work_dir: &FsPath, job_id: u64) -> PathBuf {
    work_dir.join("jobs").join(job_id.to_string()).join("logs")
}

fn attempt_of(c: &Container) -> u64 {
    c.labels
        .get(labels::ATTEMPT)
        .and_then(|a| a.parse::<u64>().ok())
        .unwrap_or(0)
}

/// Keeps the end of a job container's output in its attempt's file under `work_dir`,
/// before the container is removed; holds at most twice [`ARCHIVE_CAP`] in memory.
pub async fn archive<E: Engine>(
    engine: &E,
    work_dir: &FsPath,
    container: &Container,
) -> std::io::Result<PathBuf> {
    let job_id = container
        .labels
        .get(labels::JOB_ID)
        .and_then(|id| id.parse::<u64>().ok())
        .ok_or_else(|| std::io::Error::other("the container has no job id label"))?;
    let mut kept: Vec<u8> = Vec::new();
    let mut stream = engine.log_stream(&container.id, Some(ARCHIVE_LINES), false);
    while let Some(chunk) = stream.next().await {
        kept.extend_from_slice(&chunk.map_err(std::io::Error::other)?);
        if kept.len() > 2 * ARCHIVE_CAP {
            kept.drain(..kept.len() - ARCHIVE_CAP);
        }
    }
    if kept.len() > ARCHIVE_CAP {
        kept.drain(..kept.len() - ARCHIVE_CAP);
    }
    let path = archive_path(work_dir, job_id, attempt_of(container));
    let dir = archive_dir(work_dir, job_id);
    tokio::fs::create_dir_all(&dir).await?;
    // Written whole, then renamed: a reader never sees half a file.
    let partial = dir.join(format!(".attempt-{}.log.partial", attempt_of(container)));
    tokio::fs::write(&partial, &kept).await?;
    tokio::fs::rename(&partial, &path).await?;
    Ok(path)
}

/// The kept output of `attempt`, or of the highest attempt kept, with the attempt.
fn archived(work_dir: &FsPath, job_id: u64, attempt: Option<u64>) -> Option<(u64, PathBuf)> {
    if let Some(attempt) = attempt {
        let path = archive_path(work_dir, job_id, attempt);
        return path.is_file().then_some((attempt, path));
    }
    std::fs::read_dir(archive_dir(work_dir, job_id))
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let attempt = name
                .to_str()?
                .strip_prefix("attempt-")?
                .strip_suffix(".log")?
                .parse::<u64>()
                .ok()?;
            Some((attempt, entry.path()))
        })
        .max_by_key(|(attempt, _)| *attempt)
}

/// The last `tail` lines of `text` (all of it when `None`), as Docker counts them: a final
/// line without a newline is a line.
fn last_lines(text: &[u8], tail: Option<usize>) -> &[u8] {
    let Some(n) = tail else {
        return text;
    };
    if n == 0 {
        return &text[text.len()..];
    }
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let start = body
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, b)| **b == b'\n')
        .nth(n - 1)
        .map_or(0, |(at, _)| at + 1);
    &text[start..]
}

async fn logs<E: Engine>(
    State(ctx): State<Arc<Ctx<E>>>,
    Path(id): Path<u64>,
    Query(q): Query<LogsQuery>,
) -> Response {
    let filter = BTreeMap::from([
        (labels::MANAGED_BY.to_owned(), ctx.node.clone()),
        (labels::ROLE.to_owned(), labels::ROLE_JOB.to_owned()),
        (labels::JOB_ID.to_owned(), id.to_string()),
    ]);
    let containers = match ctx.engine.list(&filter).await {
        Ok(c) => c,
        Err(e) => {
            return (StatusCode::BAD_GATEWAY, format!("container engine: {e}\n")).into_response();
        }
    };
    let chosen = match q.attempt {
        Some(attempt) => containers.iter().find(|c| attempt_of(c) == attempt),
        None => containers.iter().max_by_key(|c| attempt_of(c)),
    };
    let Some(c) = chosen else {
        return from_archive(&ctx, id, &q).await;
    };
    tracing::info!(node = %ctx.node, job.id = id, container = %c.name, tail = ?q.tail, follow = q.follow, "streaming job logs");
    let stream = ctx
        .engine
        .log_stream(&c.id, q.tail, q.follow)
        .map_err(std::io::Error::other);
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Answers from a finished attempt's kept output; the attempt has ended, so `follow` only
/// means "to its end".
async fn from_archive<E>(ctx: &Ctx<E>, id: u64, q: &LogsQuery) -> Response {
    let which = q
        .attempt
        .map_or_else(String::new, |a| format!(" attempt {a}"));
    let Some((attempt, path)) = archived(&ctx.work_dir, id, q.attempt) else {
        return (
            StatusCode::NOT_FOUND,
            format!(
                "no container and no kept output of job {id}{which} on node {}\n",
                ctx.node
            ),
        )
            .into_response();
    };
    match tokio::fs::read(&path).await {
        Ok(text) => {
            tracing::info!(node = %ctx.node, job.id = id, attempt, tail = ?q.tail, "serving kept job logs");
            let lines = last_lines(&text, q.tail).to_vec();
            ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], lines).into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot read {}: {e}\n", path.display()),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_lines_counts_like_docker() {
        let text = b"a\nb\nc\n";
        assert_eq!(last_lines(text, None), text);
        assert_eq!(last_lines(text, Some(1)), b"c\n");
        assert_eq!(last_lines(text, Some(2)), b"b\nc\n");
        assert_eq!(last_lines(text, Some(9)), text);
        assert_eq!(last_lines(text, Some(0)), b"");
        assert_eq!(last_lines(b"a\nno newline", Some(1)), b"no newline");
        assert_eq!(last_lines(b"", Some(3)), b"");
    }

    #[test]
    fn the_highest_kept_attempt_unless_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(archived(dir.path(), 7, None), None);
        std::fs::create_dir_all(archive_dir(dir.path(), 7)).unwrap();
        for attempt in [1, 3, 2] {
            std::fs::write(archive_path(dir.path(), 7, attempt), b"x").unwrap();
        }
        // Neither a partial write nor a stray file is an attempt.
        std::fs::write(
            archive_dir(dir.path(), 7).join(".attempt-4.log.partial"),
            b"",
        )
        .unwrap();
        std::fs::write(archive_dir(dir.path(), 7).join("notes"), b"").unwrap();
        assert_eq!(
            archived(dir.path(), 7, None),
            Some((3, archive_path(dir.path(), 7, 3)))
        );
        assert_eq!(
            archived(dir.path(), 7, Some(2)),
            Some((2, archive_path(dir.path(), 7, 2)))
        );
        assert_eq!(archived(dir.path(), 7, Some(5)), None);
        assert_eq!(archived(dir.path(), 8, None), None);
    }
}
