//! What the CLI prints: the API's objects as pretty JSON (`--output json`) or, for people,
//! as tables and key/value blocks, with user-supplied text made safe for a terminal.

use std::io::{self, Write};

use nightshift_common::{AttemptMember, AttemptView, JobView, NodeMode, NodeView, UnixMillis};
use serde::Serialize;

use crate::error::CliError;

pub fn print<T: Serialize>(
    out: &mut (dyn Write + Send),
    json: bool,
    value: &T,
    table: impl FnOnce() -> String,
) -> Result<(), CliError> {
    if json {
        print_json(out, value)
    } else {
        out.write_all(table().as_bytes())?;
        Ok(out.flush()?)
    }
}

pub fn print_json<T: Serialize>(out: &mut (dyn Write + Send), value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(io::Error::other)?;
    writeln!(out, "{text}")?;
    Ok(out.flush()?)
}

/// `jobs` as a table: ID, NAME, STATE, ATTEMPT, GPUS, NODE, AGE (since submission) and
/// DURATION (running time, to now or to the end; `-` if it never started).
pub fn render_jobs(jobs: &[JobView], now: UnixMillis) -> String {
    if jobs.is_empty() {
        return "no jobs\n".to_owned();
    }
    let rows = jobs
        .iter()
        .map(|job| {
            vec![
                job.id.to_string(),
                clean(&job.spec.name),
                job.state.as_str().to_owned(),
                job.attempt.to_string(),
                if job.spec.nodes > 1 {
                    format!("{}x{}", job.spec.nodes, job.spec.gpus)
                } else {
                    job.spec.gpus.to_string()
                },
                job_nodes(job),
                format_duration(now.saturating_sub(job.submitted_at)),
                run_time(job, now).map_or("-".to_owned(), format_duration),
            ]
        })
        .collect::<Vec<_>>();
    table(
        &[
            "ID", "NAME", "STATE", "ATTEMPT", "GPUS", "NODE", "AGE", "DURATION",
        ],
        &rows,
    )
}

/// Where the job runs, else where its last attempt ran; `-` if it never was placed.
fn job_nodes(job: &JobView) -> String {
    let nodes: Vec<String> = if job.leases.is_empty() {
        job.attempts
            .last()
            .map(|a| a.members.iter().map(|m| clean(&m.node)).collect())
            .unwrap_or_default()
    } else {
        job.leases.iter().map(|l| clean(&l.node)).collect()
    };
    if nodes.is_empty() {
        "-".to_owned()
    } else {
        nodes.join(",")
    }
}

/// How long the job has run: from its start to its end, or to `now` if still going.
pub fn run_time(job: &JobView, now: UnixMillis) -> Option<u64> {
    let started = job.started_at?;
    Some(job.finished_at.unwrap_or(now).saturating_sub(started))
}

/// `job show` as a key/value block.
pub fn render_job(job: &JobView, now: UnixMillis) -> String {
    let spec = &job.spec;
    let mut kv: Vec<(&str, String)> = vec![
        ("id", job.id.to_string()),
        ("name", clean(&spec.name)),
        ("state", job.state.as_str().to_owned()),
    ];
    if let Some(owner) = &spec.owner {
        kv.push(("owner", clean(owner)));
    }
    kv.push(("image", clean(&spec.image)));
    // What every attempt after the first start runs, whatever the tag now names.
    if let Some(pinned) = job.image_digest.as_ref().filter(|d| **d != spec.image) {
        kv.push(("pinned", clean(pinned)));
    }
    if !spec.command.is_empty() {
        kv.push(("command", shell_words(&spec.command)));
    }
    if !spec.args.is_empty() {
        kv.push(("args", shell_words(&spec.args)));
    }
    if !spec.env.is_empty() {
        let names: Vec<&str> = spec.env.iter().map(|v| v.name.as_str()).collect();
        kv.push(("env", clean(&names.join(", "))));
    }
    kv.push(("gpus", spec.gpus.to_string()));
    kv.push(("priority", spec.priority.to_string()));
    kv.push((
        "checkpoint",
        format!(
            "{}, {}s grace",
            clean(&spec.checkpoint.signal),
            spec.checkpoint.grace_period_seconds
        ),
    ));
    kv.push(("attempt", job.attempt.to_string()));
    kv.push(("preemptions", job.preemptions.to_string()));
    kv.push(("submitted", format_relative(now, job.submitted_at)));
    if let Some(t) = job.started_at {
        kv.push(("started", format_relative(now, t)));
    }
    if let Some(t) = job.finished_at {
        kv.push(("finished", format_relative(now, t)));
    }
    if let Some(d) = run_time(job, now) {
        kv.push(("duration", format_duration(d)));
    }
    if let Some(limit) = spec.max_run_seconds {
        let ran = job.ran_ms
            + job
                .attempt_started_at
                .filter(|_| job.finished_at.is_none())
                .map_or(0, |t| now.saturating_sub(t));
        kv.push((
            "run time",
            format!(
                "{} of its {} limit{}",
                format_duration(ran),
                format_duration(limit * 1000),
                if job.timed_out { ", reached" } else { "" }
            ),
        ));
    }
    for lease in &job.leases {
        let gpus: Vec<String> = lease.gpus.iter().map(u32::to_string).collect();
        let mut text = format!(
            "{}node {}, gpus {}, epoch {}, lease {}, ",
            if job.spec.nodes > 1 {
                format!("rank {}, ", lease.rank)
            } else {
                String::new()
            },
            clean(&lease.node),
            gpus.join(","),
            lease.epoch,
            lease.lease_id
        );
        if lease.revoked {
            text.push_str("revoked");
        } else if lease.expires_at > now {
            text.push_str(&format!(
                "expires {}",
                format_relative(now, lease.expires_at)
            ));
        } else {
            text.push_str(&format!(
                "expired {}",
                format_relative(now, lease.expires_at)
            ));
        }
        kv.push(("lease", text));
    }
    if job.failures > 0 {
        kv.push((
            "failures",
            format!("{} of {} retries", job.failures, job.spec.retry.limit),
        ));
    }
    if let Some(t) = job.not_before {
        kv.push(("retry", format!("not before {}", format_relative(now, t))));
    }
    if let Some(t) = job.last_checkpoint_at {
        kv.push(("checkpoint", format!("last {}", format_relative(now, t))));
    }
    if let Some(code) = job.exit_code {
        kv.push(("exit code", code.to_string()));
    }
    for (i, (key, value)) in job.outputs.iter().enumerate() {
        kv.push((
            if i == 0 { "outputs" } else { "" },
            format!("{} = {}", clean(key), clean(value)),
        ));
    }
    if let Some(message) = &job.message {
        kv.push(("message", clean(message)));
    }
    let mut text = key_values(&kv);
    if !job.attempts.is_empty() {
        text.push_str("attempts:\n");
        for line in render_attempts(&job.attempts, now).lines() {
            text.push_str(&format!("  {line}\n"));
        }
    }
    text
}

/// A job's attempt records as a table, oldest first: ATTEMPT, NODE, GPUS (per node, `/`
/// between nodes), EPOCH, STARTED, ENDED, RAN, ENDING, EXIT and MESSAGE.
pub fn render_attempts(attempts: &[AttemptView], now: UnixMillis) -> String {
    let dash = || "-".to_owned();
    let rows = attempts
        .iter()
        .map(|a| {
            let join = |f: &dyn Fn(&AttemptMember) -> String, sep: &str| {
                if a.members.is_empty() {
                    dash()
                } else {
                    a.members.iter().map(f).collect::<Vec<_>>().join(sep)
                }
            };
            let mut epochs: Vec<u64> = a.members.iter().map(|m| m.epoch).collect();
            epochs.dedup();
            vec![
                a.attempt.to_string(),
                join(&|m| clean(&m.node), ","),
                join(
                    &|m| {
                        let gpus: Vec<String> = m.gpus.iter().map(u32::to_string).collect();
                        gpus.join(",")
                    },
                    "/",
                ),
                if epochs.is_empty() {
                    dash()
                } else {
                    let epochs: Vec<String> = epochs.iter().map(u64::to_string).collect();
                    epochs.join(",")
                },
                a.started_at.map_or_else(dash, |t| format_relative(now, t)),
                a.ended_at.map_or_else(dash, |t| format_relative(now, t)),
                a.started_at.map_or_else(dash, |t| {
                    format_duration(a.ended_at.unwrap_or(now).saturating_sub(t))
                }),
                match (a.ending, a.started_at) {
                    (Some(ending), _) => ending.as_str().to_owned(),
                    (None, Some(_)) => "running".to_owned(),
                    (None, None) => "starting".to_owned(),
                },
                a.exit_code.map_or_else(dash, |c| c.to_string()),
                a.message.as_deref().map_or_else(String::new, clean),
            ]
        })
        .collect::<Vec<_>>();
    table(
        &[
            "ATTEMPT", "NODE", "GPUS", "EPOCH", "STARTED", "ENDED", "RAN", "ENDING", "EXIT",
            "MESSAGE",
        ],
        &rows,
    )
}

/// `nodes` as a table. GPUS is `lent to jobs / total`; JOBS lists the jobs holding them;
/// LAST HEARTBEAT says when the agent last reported, and whether it is considered reachable.
/// Below the table, each GPU the agent reports unhealthy (never leased), and why.
pub fn render_nodes(nodes: &[NodeView], now: UnixMillis) -> String {
    if nodes.is_empty() {
        return "no nodes\n".to_owned();
    }
    let rows = nodes
        .iter()
        .map(|node| {
            let used = node.gpus.iter().filter(|g| g.job_id.is_some()).count();
            let mut jobs: Vec<u64> = node.gpus.iter().filter_map(|g| g.job_id).collect();
            jobs.sort_unstable();
            jobs.dedup();
            let jobs: Vec<String> = jobs.iter().map(u64::to_string).collect();
            let mut heartbeat = node
                .last_heartbeat
                .map_or("never".to_owned(), |t| format_relative(now, t));
            if !node.reachable {
                heartbeat.push_str(" (unreachable)");
            }
            vec![
                clean(&node.name),
                mode_str(node.mode).to_owned(),
                node.replica
                    .as_ref()
                    .map_or("-", |r| r.state.as_str())
                    .to_owned(),
                format!("{used}/{}", node.gpus.len()),
                if jobs.is_empty() {
                    "-".to_owned()
                } else {
                    jobs.join(",")
                },
                heartbeat,
            ]
        })
        .collect::<Vec<_>>();
    let mut text = table(
        &["NAME", "MODE", "REPLICA", "GPUS", "JOBS", "LAST HEARTBEAT"],
        &rows,
    );
    for node in nodes {
        for gpu in node.gpus.iter().filter(|g| g.healthy == Some(false)) {
            let reason = gpu.unhealthy_reason.as_deref().unwrap_or("no reason given");
            text.push_str(&format!(
                "{} gpu {} unhealthy, not leased: {}\n",
                clean(&node.name),
                gpu.index,
                clean(reason)
            ));
        }
    }
    text
}

/// A report as a few readable lines and, when grouped, a table.
pub fn render_report(r: &nightshift_common::Report) -> String {
    let t = &r.totals;
    let mut text = format!(
        "period:             {} to {}\n\
         harvested:          {:.2} GPU-hours ({} leases)\n\
         equivalent GPUs:    {:.2} always-on\n\
         savings:            {:.2} {} at {:.2} per GPU-hour\n\
         preemptions:        {}, {:.2} GPU-hours of work lost\n",
        nightshift_core::report::period_key(r.since, false),
        nightshift_core::report::period_key(r.until, false),
        t.harvested_gpu_hours,
        t.leases,
        t.equivalent_gpus,
        t.savings,
        r.currency,
        r.price_per_gpu_hour,
        t.preemptions,
        t.lost_gpu_hours,
    );
    if !r.groups.is_empty() {
        let rows: Vec<Vec<String>> = r
            .groups
            .iter()
            .map(|g| {
                vec![
                    clean(&g.key),
                    format!("{:.2}", g.totals.harvested_gpu_hours),
                    format!("{:.2}", g.totals.equivalent_gpus),
                    format!("{:.2}", g.totals.savings),
                    g.totals.preemptions.to_string(),
                    format!("{:.2}", g.totals.lost_gpu_hours),
                ]
            })
            .collect();
        text.push('\n');
        text.push_str(&table(
            &[
                r.by.as_deref().unwrap_or("group").to_uppercase().as_str(),
                "GPU-HOURS",
                "EQUIV-GPUS",
                "SAVINGS",
                "PREEMPTIONS",
                "LOST-GPU-HOURS",
            ],
            &rows,
        ));
    }
    text
}

pub fn mode_str(mode: NodeMode) -> &'static str {
    match mode {
        NodeMode::Serve => "serve",
        NodeMode::Lend => "lend",
    }
}

/// Left-aligned columns two spaces apart, no trailing spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    let mut push_row = |cells: &mut dyn Iterator<Item = &str>| {
        let mut line = String::new();
        for (cell, width) in cells.zip(&widths) {
            line.push_str(cell);
            line.extend(std::iter::repeat_n(' ', width - cell.chars().count() + 2));
        }
        text.push_str(line.trim_end());
        text.push('\n');
    };
    push_row(&mut headers.iter().copied());
    for row in rows {
        push_row(&mut row.iter().map(String::as_str));
    }
    text
}

/// `key:` padded so that values line up; an empty key continues the previous entry.
pub fn key_values(kv: &[(&str, String)]) -> String {
    let width = kv.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    let mut text = String::new();
    for (key, value) in kv {
        let label = if key.is_empty() {
            String::new()
        } else {
            format!("{key}:")
        };
        text.push_str(format!("{label:<width$}  {value}").trim_end());
        text.push('\n');
    }
    text
}

/// A duration in the style of `kubectl`: `45s`, `3m12s`, `42m`, `5h3m`, `2d4h`.
pub fn format_duration(ms: u64) -> String {
    let s = ms / 1000;
    let (m, h, d) = (s / 60, s / 3600, s / 86_400);
    match s {
        0..120 => format!("{s}s"),
        120..600 if s.is_multiple_of(60) => format!("{m}m"),
        120..600 => format!("{m}m{}s", s % 60),
        600..3600 => format!("{m}m"),
        3600..86_400 if m.is_multiple_of(60) => format!("{h}h"),
        3600..86_400 => format!("{h}h{}m", m % 60),
        _ if h.is_multiple_of(24) => format!("{d}d"),
        _ => format!("{d}d{}h", h % 24),
    }
}

/// `12s ago` for a past instant, `in 25s` for a future one (lease expiry, clock skew).
pub fn format_relative(now: UnixMillis, at: UnixMillis) -> String {
    if at <= now {
        format!("{} ago", format_duration(now - at))
    } else {
        format!("in {}", format_duration(at - now))
    }
}

/// Words joined by spaces, quoted where a shell would need it.
pub fn shell_words(words: &[String]) -> String {
    let quoted: Vec<String> = words
        .iter()
        .map(|w| {
            let plain = !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c));
            if plain {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect();
    clean(&quoted.join(" "))
}

/// User-supplied text made safe for a terminal and for its reader: control characters and
/// every character a display hides or that reorders its neighbours (zero-width, bidi
/// controls: [`nightshift_common::hidden`]) are escaped as `\u{200b}`, so a job name can
/// neither break a table, send escape sequences, nor pass for another. The coordinator
/// refuses such names now; records from before still hold them.
pub fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if nightshift_common::hidden::is_hidden(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}
