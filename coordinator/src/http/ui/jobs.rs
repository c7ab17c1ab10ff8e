//! Jobs: the list (filtered by team, state and name) with a form to submit one; a job's
//! page with its spec, attempts, checkpoint age and live logs, and a cancel button for
//! those the API lets cancel it.

use std::collections::VecDeque;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use futures_util::{Stream, StreamExt};
use maud::{Markup, html};
use nightshift_common::{JobState, JobView};
use serde::Deserialize;

use super::{Shared, Viewer, page};
use crate::cluster::{Cluster, now_ms};
use crate::http::jobs as api;
use crate::http::logs::{LogsQuery, logs};

#[derive(Debug, Default, Deserialize)]
pub struct Filters {
    #[serde(default)]
    team: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    name: String,
}

impl Filters {
    fn keep(&self, j: &JobView) -> bool {
        (self.team.is_empty() || j.spec.team() == self.team)
            && (self.state.is_empty()
                || j.state.as_str() == self.state
                || (self.state == "active" && !j.state.is_finished()))
            && (self.name.is_empty() || j.spec.name.contains(self.name.trim()))
    }
}

/// A job to start from, in the submit form.
const EXAMPLE: &str = r#"{
  "name": "hello",
  "image": "busybox",
  "command": ["sh", "-c", "for i in 1 2 3; do echo step $i; sleep 1; done"],
  "gpus": 1
}"#;

pub async fn list(
    State(cluster): Shared,
    Extension(viewer): Extension<Viewer>,
    Query(f): Query<Filters>,
) -> Response {
    let jobs = api::list(State(cluster.clone())).await.0.jobs;
    render_list(&cluster, &viewer, &jobs, &f, None, EXAMPLE).into_response()
}

fn render_list(
    cluster: &Cluster,
    viewer: &Viewer,
    jobs: &[JobView],
    f: &Filters,
    error: Option<&str>,
    spec: &str,
) -> axum::response::Html<String> {
    let now = now_ms();
    let mut teams: Vec<String> = jobs.iter().map(|j| j.spec.team().to_owned()).collect();
    teams.sort();
    teams.dedup();
    let shown: Vec<&JobView> = jobs.iter().rev().filter(|j| f.keep(j)).collect();
    let may_submit = viewer.may(cluster, Method::POST, "/v1/jobs");
    let body = html! {
        form.filters method="get" action="/ui/jobs" {
            label { "team" select name="team" {
                option value="" { "all" }
                @for t in &teams { option value=(t) selected[*t == f.team] { (t) } }
            } }
            label { "state" select name="state" {
                option value="" { "all" }
                option value="active" selected[f.state == "active"] { "active" }
                @for s in JobState::ALL { option value=(s.as_str()) selected[s.as_str() == f.state] { (s.as_str()) } }
            } }
            label { "name" input type="search" name="name" value=(f.name) placeholder="contains"; }
            button.quiet type="submit" { "Filter" }
        }
        div.panel #live-jobs data-live {
            @if shown.is_empty() {
                p.muted { "no job matches" }
            } @else {
                table #jobs {
                    thead { tr {
                        th.n { "id" } th { "name" } th { "team" } th { "state" } th.n { "GPUs" }
                        th.n { "attempt" } th { "node" } th { "submitted" }
                    } }
                    tbody {
                        @for j in &shown {
                            tr data-job=(j.id) {
                                td.n { a href=(format!("/ui/jobs/{}", j.id)) { (j.id) } }
                                td { a href=(format!("/ui/jobs/{}", j.id)) { (j.spec.name) } }
                                td { (j.spec.team()) }
                                td { (page::badge(j.state.as_str())) }
                                td.n { (j.spec.gpus * j.spec.nodes.max(1)) }
                                td.n { (j.attempt) }
                                td { @if let Some(a) = j.attempts.last() { @for m in &a.members { (m.node) " " } } }
                                td.muted { (page::ago(now, j.submitted_at)) }
                            }
                        }
                    }
                }
            }
        }
        @if may_submit {
            details #submit open[error.is_some()] {
                summary { "Submit a job" }
                div.panel {
                    form method="post" action="/ui/jobs" {
                        p.muted { "The job as JSON, as " code { "POST /v1/jobs" } " takes it (" code { "nightshift submit" } "'s file). "
                            @if let Some(team) = viewer.principal.as_ref().and_then(|p| p.team.as_ref()) {
                                "It is submitted as team " b { (team) } "."
                            } }
                        textarea #spec name="spec" spellcheck="false" { (spec) }
                        @if let Some(e) = error { p.error #submit-error { (e) } }
                        p { button type="submit" #submit-job { "Submit" } }
                    }
                }
            }
        }
    };
    page::frame("Jobs", "/ui/jobs", viewer, body)
}

#[derive(Deserialize)]
pub struct SubmitForm {
    spec: String,
}

/// Submits through the API's handler, as `POST /v1/jobs`: the same admission, the same
/// refusals (shown under the form, the text kept).
pub async fn submit(
    State(cluster): Shared,
    Extension(viewer): Extension<Viewer>,
    Form(form): Form<SubmitForm>,
) -> Response {
    if let Err(refusal) = viewer.act(&cluster, Method::POST, "/v1/jobs") {
        return refusal;
    }
    let principal = viewer.principal.clone().map(Extension);
    match api::submit(
        State(cluster.clone()),
        principal,
        Bytes::from(form.spec.clone()),
    )
    .await
    {
        Ok((_, job)) => Redirect::to(&format!("/ui/jobs/{}", job.0.id)).into_response(),
        Err(e) => {
            let status = e.status();
            let jobs = api::list(State(cluster.clone())).await.0.jobs;
            let f = Filters::default();
            let html = render_list(&cluster, &viewer, &jobs, &f, Some(e.message()), &form.spec);
            (status, html).into_response()
        }
    }
}

pub async fn show(
    State(cluster): Shared,
    Extension(viewer): Extension<Viewer>,
    Path(id): Path<u64>,
) -> Response {
    let job = match api::show(State(cluster.clone()), Path(id)).await {
        Ok(job) => job.0,
        Err(e) => return page::error(e.status(), e.message()),
    };
    let now = now_ms();
    let may_cancel = !job.state.is_finished()
        && viewer.may(&cluster, Method::POST, &format!("/v1/jobs/{id}/cancel"));
    let spec = serde_json::to_string_pretty(&job.spec).unwrap_or_default();
    let body = html! {
        div #live-job data-live {
            div.actions {
                span #job-state data-state=(job.state.as_str()) { (page::badge(job.state.as_str())) }
                @if may_cancel {
                    form.inline method="post" action=(format!("/ui/jobs/{id}/cancel")) {
                        button.danger #cancel type="submit" { "Cancel job" }
                    }
                }
                @if let Some(m) = &job.message { span.muted { (m) } }
            }
            div.grid {
                div.panel {
                    h2 { "Job" }
                    dl.kv {
                        dt { "id" } dd { (job.id) }
                        dt { "team" } dd { (job.spec.team()) }
                        dt { "image" } dd.mono { (job.image_digest.as_deref().unwrap_or(&job.spec.image)) }
                        dt { "GPUs" } dd { (job.spec.gpus) @if job.spec.nodes > 1 { " × " (job.spec.nodes) " nodes" } }
                        dt { "priority" } dd { (job.spec.priority) }
                        dt { "submitted" } dd { (page::time(job.submitted_at)) }
                        @if let Some(t) = job.finished_at { dt { "finished" } dd { (page::time(t)) } }
                        dt { "attempt" } dd { (job.attempt) " (" (job.preemptions) " preemptions, " (job.failures) " failures)" }
                        @if let Some(code) = job.exit_code { dt { "exit code" } dd { (code) } }
                    }
                }
                div.panel {
                    h2 { "Checkpoint" }
                    dl.kv {
                        dt { "last written" }
                        dd #checkpoint-age { @match job.last_checkpoint_at {
                            Some(t) => { (page::ago(now, t)) " (" (page::time(t)) ")" },
                            None => span.muted { "never" },
                        } }
                        dt { "on reclaim" } dd { (job.spec.checkpoint.signal) ", then " (job.spec.checkpoint.grace_period_seconds) " s to exit" }
                    }
                    @if !job.outputs.is_empty() {
                        h3 { "Outputs" }
                        dl.kv { @for (k, v) in &job.outputs { dt { (k) } dd.mono { (v) } } }
                    }
                }
            }
            div.panel {
                h2 { "Attempts" }
                (attempts(&job))
            }
        }
        div.panel {
            h2 { "Logs " span #log-status.log-status { "connecting" } }
            pre #log.log data-src=(format!("/ui/jobs/{id}/events")) {}
        }
        details {
            summary { "Spec" }
            div.panel { pre.mono #spec { (spec) } }
        }
    };
    page::frame(
        &format!("Job {id}: {}", job.spec.name),
        "/ui/jobs",
        &viewer,
        body,
    )
    .into_response()
}

fn attempts(job: &JobView) -> Markup {
    html! {
        @if job.attempts.is_empty() {
            p.muted { "not placed yet" }
        } @else {
            table #attempts {
                thead { tr { th.n { "attempt" } th { "node" } th { "GPUs" } th { "leased" } th { "started" } th { "ended" } th { "why it ended" } } }
                tbody {
                    @for a in job.attempts.iter().rev() {
                        tr {
                            td.n { (a.attempt) }
                            td { @for m in &a.members { (m.node) " " } }
                            td { @for m in &a.members { (format!("{:?}", m.gpus)) " " } }
                            td { (page::time(a.leased_at)) }
                            td { @if let Some(t) = a.started_at { (page::time(t)) } }
                            td { @if let Some(t) = a.ended_at { (page::time(t)) } @else { span.muted { "running" } } }
                            td {
                                @if let Some(e) = a.ending { (page::badge(e.as_str())) }
                                @if let Some(code) = a.exit_code { " exit " (code) }
                                @if let Some(m) = &a.message { " " span.muted { (m) } }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Cancels through the API's handler, as `POST /v1/jobs/{id}/cancel` with the viewer's
/// token: a researcher only its team's jobs.
pub async fn cancel(
    State(cluster): Shared,
    Extension(viewer): Extension<Viewer>,
    Path(id): Path<u64>,
) -> Response {
    if let Err(refusal) = viewer.act(&cluster, Method::POST, &format!("/v1/jobs/{id}/cancel")) {
        return refusal;
    }
    match api::cancel(State(cluster), Path(id)).await {
        Ok(_) => Redirect::to(&format!("/ui/jobs/{id}")).into_response(),
        Err(e) => page::error(e.status(), e.message()),
    }
}

/// How long the browser waits before asking again for logs that are not there yet.
const RETRY: Duration = Duration::from_secs(2);

/// The job's output as server-sent events, one per line, each with its line number as
/// its id: the API's log proxy followed to the end of the container. A browser that
/// reconnects sends the last id it saw and gets only the lines after it. Before the job has
/// run, or while its agent cannot be asked, a `wait` event says why and the browser asks
/// again; at the end, `end` once the job has finished, else `wait` (a next attempt).
pub async fn events(State(cluster): Shared, Path(id): Path<u64>, headers: HeaderMap) -> Response {
    let seen: u64 = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    let q = LogsQuery {
        tail: None,
        follow: true,
    };
    if cluster.read(|core, _| core.job(id)).is_none() {
        return (StatusCode::NOT_FOUND, format!("job {id} not found")).into_response();
    }
    let body = match logs(State(cluster.clone()), Path(id), Query(q)).await {
        Ok(response) => response.into_body(),
        // Not run yet, its agent not reachable, its container not there yet (the agent's
        // 404 while it starts): the browser asks again.
        Err(e) => {
            let wait = Event::default()
                .event("wait")
                .data(one_line(e.message()))
                .retry(RETRY);
            return Sse::new(futures_util::stream::iter([Ok::<
                _,
                std::convert::Infallible,
            >(wait)]))
            .into_response();
        }
    };
    let lines = Lines {
        body: body.into_data_stream().boxed(),
        buf: Vec::new(),
        ready: VecDeque::new(),
        n: 0,
        seen,
        done: false,
    };
    let stream =
        futures_util::stream::unfold((lines, cluster), move |(mut l, cluster)| async move {
            loop {
                if let Some(event) = l.ready.pop_front() {
                    return Some((Ok::<_, std::convert::Infallible>(event), (l, cluster)));
                }
                if l.done {
                    return None;
                }
                match l.body.next().await {
                    Some(Ok(chunk)) => l.push(&chunk),
                    Some(Err(_)) | None => {
                        l.finish();
                        let finished = cluster
                            .read(|core, _| core.job(id))
                            .is_none_or(|j| j.state.is_finished());
                        l.ready.push_back(if finished {
                            Event::default().event("end").data("the job has finished")
                        } else {
                            Event::default()
                                .event("wait")
                                .data("the container stopped; waiting for the next attempt")
                                .retry(RETRY)
                        });
                        l.done = true;
                    }
                }
            }
        });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Splits a byte stream into line events, skipping the first `seen` lines.
struct Lines {
    body: std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, axum::Error>> + Send>>,
    buf: Vec<u8>,
    ready: VecDeque<Event>,
    n: u64,
    seen: u64,
    done: bool,
}

impl Lines {
    fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
        while let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            self.line(&line[..line.len() - 1]);
        }
    }

    fn finish(&mut self) {
        if !self.buf.is_empty() {
            let line = std::mem::take(&mut self.buf);
            self.line(&line);
        }
    }

    fn line(&mut self, line: &[u8]) {
        self.n += 1;
        if self.n > self.seen {
            let text = one_line(&String::from_utf8_lossy(line));
            self.ready
                .push_back(Event::default().id(self.n.to_string()).data(text));
        }
    }
}

/// Text an event's `data` can carry: no carriage return or newline.
fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_numbered_across_chunks_and_the_seen_skipped() {
        let mut l = Lines {
            body: futures_util::stream::empty().boxed(),
            buf: Vec::new(),
            ready: VecDeque::new(),
            n: 0,
            seen: 1,
            done: false,
        };
        l.push(b"one\ntw");
        l.push(b"o\r\nthree");
        l.finish();
        assert_eq!(l.n, 3);
        assert_eq!(l.ready.len(), 2, "line 1 was seen before");
    }

    #[test]
    fn filters_keep_what_they_name() {
        let spec: nightshift_common::JobSpec =
            serde_json::from_str(r#"{"name":"train-7b","image":"busybox","gpus":1,"owner":"nlp"}"#)
                .unwrap();
        let job = JobView::queued(1, spec, 0);
        let f = |team: &str, state: &str, name: &str| Filters {
            team: team.into(),
            state: state.into(),
            name: name.into(),
        };
        assert!(f("", "", "").keep(&job));
        assert!(f("nlp", "queued", "7b").keep(&job));
        assert!(f("", "active", "").keep(&job));
        assert!(!f("cv", "", "").keep(&job));
        assert!(!f("", "running", "").keep(&job));
        assert!(!f("", "", "eval").keep(&job));
    }
}
