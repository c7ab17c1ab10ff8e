//! The overview: the fleet now (nodes and GPUs by state), the queue by team, the harvest
//! today and this month, and each service's last 24 hours.

use std::collections::BTreeMap;

use axum::Extension;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use nightshift_common::{JobState, JobView, NodeMode, NodeView, ReplicaState, ReportTotals};
use nightshift_core::report::{day_start, month_start};

use super::{Shared, Viewer, page};
use crate::cluster::now_ms;
use crate::http::report::{ReportQuery, report};
use crate::http::{jobs, nodes};

/// What a node is doing now, in the words of the overview.
pub fn node_state(n: &NodeView) -> &'static str {
    let replica = n.replica.as_ref().map(|r| r.state);
    if !n.reachable {
        "unreachable"
    } else if n.gpus.iter().any(|g| g.healthy == Some(false)) {
        "unhealthy"
    } else if replica == Some(ReplicaState::Draining) {
        "draining"
    } else if replica == Some(ReplicaState::Sleeping) {
        "sleeping"
    } else if n.mode == NodeMode::Lend {
        "lent"
    } else if replica == Some(ReplicaState::Serving) {
        "serving"
    } else if replica == Some(ReplicaState::Failed) {
        "failed"
    } else {
        "starting"
    }
}

/// What a GPU is doing now: serving, running a job, lent but idle, or unhealthy.
fn gpu_states(nodes: &[NodeView]) -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for n in nodes {
        for g in &n.gpus {
            let state = if g.healthy == Some(false) || !n.reachable {
                "unhealthy"
            } else if g.job_id.is_some() {
                "running jobs"
            } else if n.mode == NodeMode::Lend {
                "lent, idle"
            } else {
                "serving"
            };
            *out.entry(state).or_default() += 1;
        }
    }
    out
}

/// Per team: jobs queued, running, and the GPUs they ask for.
fn queue_by_team(jobs: &[JobView]) -> BTreeMap<String, (usize, usize, u64)> {
    let mut out: BTreeMap<String, (usize, usize, u64)> = BTreeMap::new();
    for j in jobs.iter().filter(|j| !j.state.is_finished()) {
        let e = out.entry(j.spec.team().to_owned()).or_default();
        match j.state {
            JobState::Queued => e.0 += 1,
            _ => e.1 += 1,
        }
        e.2 += u64::from(j.spec.gpus) * u64::from(j.spec.nodes.max(1));
    }
    out
}

/// The harvest since `since`, by the report's own handler.
async fn harvest(cluster: Shared, since: u64) -> Option<(ReportTotals, String)> {
    let q = ReportQuery {
        since: Some(since),
        until: None,
        by: None,
    };
    let r = report(cluster, Query(q)).await.ok()?.0;
    Some((r.totals, r.currency))
}

pub async fn page(State(cluster): Shared, Extension(viewer): Extension<Viewer>) -> Response {
    let now = now_ms();
    let nodes = nodes::list(State(cluster.clone())).await.0.nodes;
    let jobs = jobs::list(State(cluster.clone())).await.0.jobs;
    let day = harvest(State(cluster.clone()), day_start(now)).await;
    let this_month = harvest(
        State(cluster.clone()),
        month_start(now).min(now.saturating_sub(1)),
    )
    .await;
    let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &nodes {
        *by_state.entry(node_state(n)).or_default() += 1;
    }
    let services: Vec<String> = {
        let mut s: Vec<String> = nodes.iter().map(|n| n.service.clone()).collect();
        s.extend(cluster.read(|core, _| {
            core.config()
                .services
                .iter()
                .map(|s| s.name.clone())
                .collect::<Vec<_>>()
        }));
        s.sort();
        s.dedup();
        s
    };
    let body = html! {
        div #live-fleet.grid data-live {
            div.panel {
                h2 { "Nodes" }
                div.stat {
                    div { div.v #nodes-total { (nodes.len()) } div.k { "total" } }
                    @for state in ["serving", "draining", "lent", "sleeping", "unhealthy", "unreachable", "starting", "failed"] {
                        @if let Some(n) = by_state.get(state) {
                            div { div.v { (n) } div.k { (state) } }
                        }
                    }
                }
            }
            div.panel {
                h2 { "GPUs" }
                div.stat {
                    @for (state, n) in gpu_states(&nodes) {
                        div { div.v { (n) } div.k { (state) } }
                    }
                    @if nodes.is_empty() { p.muted { "no node has registered yet" } }
                }
            }
            div.panel {
                h2 { "Harvest" }
                (harvest_panel("today", day.as_ref()))
                (harvest_panel("this month", this_month.as_ref()))
            }
        }
        div.panel #live-queue data-live {
            h2 { "Queue by team" }
            @let queue = queue_by_team(&jobs);
            @if queue.is_empty() {
                p.muted { "nothing queued or running" }
            } @else {
                table {
                    thead { tr { th { "team" } th.n { "queued" } th.n { "running" } th.n { "GPUs asked" } th {} } }
                    tbody {
                        @for (team, (queued, running, gpus)) in &queue {
                            tr {
                                td { (team) }
                                td.n { (queued) }
                                td.n { (running) }
                                td.n { (gpus) }
                                td { a href=(format!("/ui/jobs?team={team}")) { "jobs" } }
                            }
                        }
                    }
                }
            }
        }
        @for service in &services {
            div.panel #(format!("live-timeline-{service}")) data-live {
                h2 { "Service " (service) ": the last 24 hours" }
                (super::chart::timeline(&cluster.timeline.of(service, now.saturating_sub(crate::timeline::SPAN_MS)), now))
            }
        }
    };
    page::frame("Overview", "/ui/", &viewer, body).into_response()
}

fn harvest_panel(when: &str, h: Option<&(ReportTotals, String)>) -> Markup {
    html! {
        h3 { (when) }
        @match h {
            Some((t, currency)) => div.stat {
                div { div.v { (page::num(t.harvested_gpu_hours)) } div.k { "GPU-hours" } }
                div { div.v { (page::num(t.equivalent_gpus)) } div.k { "equivalent GPUs" } }
                div { div.v { (format!("{:.2}", t.savings)) " " span.muted { (currency) } } div.k { "saved" } }
            },
            None => p.muted { "the report could not be read" },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{NodeGpuView, ReplicaStatus, ServingSignals};

    fn node(mode: NodeMode, state: ReplicaState, job: Option<u64>) -> NodeView {
        NodeView {
            name: "gpu-1".into(),
            service: "llm".into(),
            mode,
            desired_version: 1,
            applied_version: 1,
            gpus: vec![NodeGpuView {
                index: 0,
                uuid: "GPU-0".into(),
                name: "H100".into(),
                memory_total_bytes: 80 << 30,
                memory_used_bytes: None,
                job_id: job,
                healthy: Some(true),
                unhealthy_reason: None,
                utilization_gpu_percent: None,
                power_milliwatts: None,
                temperature_celsius: None,
            }],
            replica: Some(ReplicaStatus {
                state,
                signals: ServingSignals::default(),
                url: None,
            }),
            reachable: true,
            last_heartbeat: None,
            recent_phases: vec![],
        }
    }

    #[test]
    fn nodes_and_gpus_are_counted_by_state() {
        let serving = node(NodeMode::Serve, ReplicaState::Serving, None);
        let lent = node(NodeMode::Lend, ReplicaState::Stopped, Some(4));
        let sleeping = node(NodeMode::Lend, ReplicaState::Sleeping, None);
        let mut sick = node(NodeMode::Serve, ReplicaState::Serving, None);
        sick.gpus[0].healthy = Some(false);
        assert_eq!(node_state(&serving), "serving");
        assert_eq!(node_state(&lent), "lent");
        assert_eq!(node_state(&sleeping), "sleeping");
        assert_eq!(node_state(&sick), "unhealthy");
        let gpus = gpu_states(&[serving, lent, sleeping, sick]);
        let gpus: Vec<(&str, usize)> = gpus.into_iter().collect();
        assert_eq!(
            gpus,
            [
                ("lent, idle", 1),
                ("running jobs", 1),
                ("serving", 1),
                ("unhealthy", 1)
            ]
        );
    }
}
