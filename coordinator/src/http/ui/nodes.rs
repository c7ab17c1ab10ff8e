//! Nodes: each node's GPUs, its replica's state and vLLM's signals, its leases, and the
//! drain and reclaim it last went through, phase by phase.

use axum::Extension;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use nightshift_common::{JobView, NodeView, PhaseRecord, SequenceKind};

use super::{Shared, Viewer, page};
use crate::cluster::now_ms;
use crate::http::{jobs, nodes};

/// The phases of the last sequence of `kind`: the newest run of consecutive records of
/// that kind.
pub fn last_sequence(phases: &[PhaseRecord], kind: SequenceKind) -> Vec<&PhaseRecord> {
    let mut sorted: Vec<&PhaseRecord> = phases.iter().collect();
    sorted.sort_by_key(|p| (p.started_at, p.seq));
    let Some(end) = sorted.iter().rposition(|p| p.sequence == kind) else {
        return Vec::new();
    };
    let start = sorted[..end]
        .iter()
        .rposition(|p| p.sequence != kind)
        .map_or(0, |i| i + 1);
    sorted[start..=end].to_vec()
}

pub async fn page(State(cluster): Shared, Extension(viewer): Extension<Viewer>) -> Response {
    let nodes = nodes::list(State(cluster.clone())).await.0.nodes;
    let jobs = jobs::list(State(cluster)).await.0.jobs;
    let now = now_ms();
    let body = html! {
        div #live-nodes data-live {
            @if nodes.is_empty() { div.panel { p.muted { "no node has registered yet" } } }
            @for n in &nodes { (node(n, &jobs, now)) }
        }
    };
    page::frame("Nodes", "/ui/nodes", &viewer, body).into_response()
}

fn node(n: &NodeView, jobs: &[JobView], now: u64) -> Markup {
    let state = super::overview::node_state(n);
    let leases: Vec<(&JobView, &nightshift_common::LeaseView)> = jobs
        .iter()
        .flat_map(|j| j.leases.iter().map(move |l| (j, l)))
        .filter(|(_, l)| l.node == n.name)
        .collect();
    html! {
        div.panel.node data-node=(n.name) {
            div.actions {
                h2 { (n.name) }
                (page::badge(state))
                span.muted { "service " (n.service) ", mode " (format!("{:?}", n.mode).to_lowercase())
                    @if let Some(t) = n.last_heartbeat { ", heartbeat " (page::ago(now, t)) } }
            }
            div.grid {
                div {
                    h3 { "Replica" }
                    @match &n.replica {
                        None => p.muted { "no replica reported" },
                        Some(r) => dl.kv {
                            dt { "state" } dd { (page::badge(r.state.as_str())) }
                            @if let Some(url) = &r.url { dt { "url" } dd.mono { (url) } }
                            (signal("requests running", r.signals.requests_running, ""))
                            (signal("requests waiting", r.signals.requests_waiting, ""))
                            (signal("KV cache", r.signals.kv_cache_usage.map(|v| v * 100.0), " %"))
                            (signal("prompt tokens/s", r.signals.prompt_tokens_per_s, ""))
                            (signal("generated tokens/s", r.signals.generation_tokens_per_s, ""))
                            (signal("TTFT p50", r.signals.ttft_p50_s, " s"))
                            (signal("TTFT p95", r.signals.ttft_p95_s, " s"))
                            @if let Some(s) = &r.signals.sleep_state { dt { "sleep state" } dd { (s) } }
                        },
                    }
                }
                div {
                    h3 { "Leases" }
                    @if leases.is_empty() { p.muted { "none" } }
                    @else {
                        table {
                            thead { tr { th { "lease" } th { "job" } th { "GPUs" } th.n { "epoch" } th { "expires" } } }
                            tbody { @for (j, l) in &leases { tr {
                                td { (l.lease_id) @if l.revoked { " " (page::badge("revoked")) } }
                                td { a href=(format!("/ui/jobs/{}", j.id)) { (j.id) " " (j.spec.name) } }
                                td { (format!("{:?}", l.gpus)) }
                                td.n { (l.epoch) }
                                td.muted { (page::ago(now, l.expires_at)) }
                            } } }
                        }
                    }
                }
                div {
                    h3 { "Last drain and reclaim" }
                    (phases(&n.recent_phases))
                }
            }
            h3 { "GPUs" }
            table.gpus {
                thead { tr { th.n { "#" } th { "model" } th { "memory" } th.n { "util" } th.n { "temp" } th.n { "power" } th { "health" } th { "job" } } }
                tbody {
                    @for g in &n.gpus {
                        tr {
                            td.n { (g.index) }
                            td { (g.name) }
                            td { @if let Some(u) = g.memory_used_bytes { (page::bytes(u)) " / " } (page::bytes(g.memory_total_bytes)) }
                            td.n { @if let Some(u) = g.utilization_gpu_percent { (u) " %" } }
                            td.n { @if let Some(t) = g.temperature_celsius { (t) " °C" } }
                            td.n { @if let Some(p) = g.power_milliwatts { (p / 1000) " W" } }
                            td { @match g.healthy {
                                Some(true) => (page::badge("healthy")),
                                Some(false) => { (page::badge("unhealthy")) " " span.muted { (g.unhealthy_reason.as_deref().unwrap_or("")) } },
                                None => span.muted { "unknown" },
                            } }
                            td { @if let Some(j) = g.job_id { a href=(format!("/ui/jobs/{j}")) { (j) } } }
                        }
                    }
                }
            }
        }
    }
}

fn signal(name: &str, v: Option<f64>, unit: &str) -> Markup {
    html! {
        dt { (name) }
        dd { @match v { Some(v) => { (page::num((v * 100.0).round() / 100.0)) (unit) }, None => span.muted { "unknown" } } }
    }
}

fn phases(records: &[PhaseRecord]) -> Markup {
    html! {
        @for (kind, name) in [(SequenceKind::Drain, "drain"), (SequenceKind::Reclaim, "reclaim")] {
            @let seq = last_sequence(records, kind);
            @if !seq.is_empty() {
                @let total: u64 = seq.iter().map(|p| p.duration_ms).sum();
                table.phases {
                    thead { tr { th { (name) ", " (page::time(seq[0].started_at)) } th.n { (page::duration(total)) } } }
                    tbody { @for p in &seq { tr { td { (p.phase) } td.n { (page::duration(p.duration_ms)) } } } }
                }
            }
        }
        @if records.is_empty() { p.muted { "none yet" } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, kind: SequenceKind, phase: &str) -> PhaseRecord {
        PhaseRecord {
            seq,
            instance: None,
            sequence: kind,
            phase: phase.into(),
            started_at: seq * 1000,
            duration_ms: 10,
        }
    }

    #[test]
    fn the_last_drain_is_its_newest_run_of_phases() {
        use SequenceKind::{Drain, Reclaim};
        let records = [
            rec(1, Drain, "old"),
            rec(2, Reclaim, "checkpoint"),
            rec(3, Drain, "mark_not_ready"),
            rec(4, Drain, "stop"),
        ];
        let phases: Vec<&str> = last_sequence(&records, Drain)
            .iter()
            .map(|p| p.phase.as_str())
            .collect();
        assert_eq!(phases, ["mark_not_ready", "stop"]);
        let phases: Vec<&str> = last_sequence(&records, Reclaim)
            .iter()
            .map(|p| p.phase.as_str())
            .collect();
        assert_eq!(phases, ["checkpoint"]);
    }
}
