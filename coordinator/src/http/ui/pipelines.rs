//! Pipelines: the runs, and a run's page: its graph drawn from its steps with their
//! states, its parameters, each step's outputs and logs, and a rerun button.

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::Method;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use nightshift_common::PipelineNodeView;
use serde::Deserialize;

use super::{Shared, Viewer, page};
use crate::cluster::now_ms;
use crate::http::pipelines as api;

pub async fn list(State(cluster): Shared, Extension(viewer): Extension<Viewer>) -> Response {
    let runs = api::list(State(cluster)).await.0.runs;
    let now = now_ms();
    let body = html! {
        div.panel #live-runs data-live {
            @if runs.is_empty() {
                p.muted { "no pipeline run yet: " code { "nightshift pipeline submit FILE" } }
            } @else {
                table #runs {
                    thead { tr { th.n { "id" } th { "name" } th { "file" } th { "phase" } th.n { "steps" } th { "started" } th { "took" } } }
                    tbody {
                        @for r in runs.iter().rev() {
                            tr {
                                td.n { a href=(format!("/ui/pipelines/{}", r.id)) { (r.id) } }
                                td { a href=(format!("/ui/pipelines/{}", r.id)) { (r.name) } }
                                td.mono { (r.file) }
                                td { (page::badge(&r.phase)) }
                                td.n { (r.nodes.iter().filter(|n| !n.jobs.is_empty()).count()) }
                                td.muted { (page::ago(now, r.started_at)) }
                                td { (page::duration(r.finished_at.unwrap_or(now).saturating_sub(r.started_at))) }
                            }
                        }
                    }
                }
            }
        }
    };
    page::frame("Pipelines", "/ui/pipelines", &viewer, body).into_response()
}

#[derive(Debug, Deserialize)]
pub struct Selected {
    step: Option<usize>,
}

pub async fn show(
    State(cluster): Shared,
    Extension(viewer): Extension<Viewer>,
    Path(id): Path<u64>,
    Query(sel): Query<Selected>,
) -> Response {
    let run = match api::show(State(cluster.clone()), Path(id)).await {
        Ok(run) => run.0,
        Err(e) => return page::error(e.status(), e.message()),
    };
    let edges = cluster
        .read_pipelines(|_, p| p.edges(id))
        .unwrap_or_default();
    let now = now_ms();
    let may_rerun = viewer.may(&cluster, Method::POST, &format!("/v1/pipelines/{id}/rerun"));
    // The step shown below the graph: the one asked for, else the newest that ran a job.
    let step: Option<&PipelineNodeView> = match sel.step {
        Some(s) => run.nodes.iter().find(|n| n.id == s),
        None => run
            .nodes
            .iter()
            .filter(|n| !n.jobs.is_empty())
            .max_by_key(|n| n.started_at),
    };
    let body = html! {
        div #live-run data-live {
            div.actions {
                span #run-phase data-phase=(run.phase) { (page::badge(&run.phase)) }
                span.muted { "started " (page::time(run.started_at)) ", "
                    (page::duration(run.finished_at.unwrap_or(now).saturating_sub(run.started_at))) }
                @if may_rerun {
                    form.inline method="post" action=(format!("/ui/pipelines/{id}/rerun")) {
                        button.quiet #rerun type="submit" { "Rerun" }
                    }
                }
            }
            div.panel {
                h2 { "Steps" }
                (super::chart::dag(id, &run.nodes, &edges, step.map(|s| s.id)))
            }
            div.grid {
                div.panel {
                    h2 { "Parameters" }
                    @if run.parameters.is_empty() { p.muted { "none" } }
                    dl.kv { @for (k, v) in &run.parameters { dt { (k) } dd.mono { (v) } } }
                    h3 { "File" } p.mono { (run.file) }
                }
                @if let Some(s) = step {
                    div.panel #step data-step=(s.id) {
                        h2 { "Step " (s.name) }
                        dl.kv {
                            dt { "phase" } dd { (page::badge(&s.phase)) }
                            dt { "template" } dd { (s.template) }
                            @if let Some(m) = &s.message { dt { "message" } dd { (m) } }
                            dt { "retries" } dd { (s.retries) " (" (s.preemptions) " preemptions)" }
                            @if let Some(t) = s.started_at { dt { "started" } dd { (page::time(t)) } }
                            @if let Some(t) = s.finished_at { dt { "finished" } dd { (page::time(t)) } }
                            dt { "jobs" } dd { @for j in &s.jobs { a href=(format!("/ui/jobs/{j}")) { (j) } " " } }
                            @if let Some(image) = &s.image_id { dt { "image" } dd.mono { (image) } }
                        }
                        @if !s.outputs.is_empty() {
                            h3 { "Outputs" }
                            dl.kv { @for (k, v) in &s.outputs { dt { (k) } dd.mono { (v) } } }
                        }
                    }
                }
            }
        }
        @if let Some(job) = step.and_then(|s| s.jobs.last()) {
            div.panel {
                h2 { "Logs of job " a href=(format!("/ui/jobs/{job}")) { (job) } " " span #log-status.log-status { "connecting" } }
                pre #log.log data-src=(format!("/ui/jobs/{job}/events")) {}
            }
        }
    };
    page::frame(
        &format!("Pipeline run {id}: {}", run.name),
        "/ui/pipelines",
        &viewer,
        body,
    )
    .into_response()
}

/// Reruns through the API's handler, as `POST /v1/pipelines/{id}/rerun`.
pub async fn rerun(
    State(cluster): Shared,
    Extension(viewer): Extension<Viewer>,
    Path(id): Path<u64>,
) -> Response {
    if let Err(refusal) = viewer.act(&cluster, Method::POST, &format!("/v1/pipelines/{id}/rerun")) {
        return refusal;
    }
    match api::rerun(State(cluster), Path(id)).await {
        Ok((_, run)) => Redirect::to(&format!("/ui/pipelines/{}", run.0.id)).into_response(),
        Err(e) => page::error(e.status(), e.message()),
    }
}
