//! The report: GPU-hours harvested by team, by day and by month, each a chart with its
//! table under it, from the API's report handler.

use axum::Extension;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use nightshift_common::Report;
use nightshift_core::report::{DAY_MS, day_start};

use super::{Shared, Viewer, page};
use crate::cluster::now_ms;
use crate::http::report::{ReportQuery, report};

/// The last `days` whole days up to `now`, grouped `by`.
async fn grouped(cluster: Shared, now: u64, days: u64, by: &str) -> Result<Report, String> {
    let q = ReportQuery {
        // Whole days: from the start of the first day shown.
        since: Some(day_start(now) - (days - 1) * DAY_MS),
        until: Some(now),
        by: Some(by.to_owned()),
    };
    report(cluster, Query(q))
        .await
        .map(|r| r.0)
        .map_err(|e| e.message().to_owned())
}

pub async fn page(State(cluster): Shared, Extension(viewer): Extension<Viewer>) -> Response {
    // One now for the three: the same period however long the page takes to build.
    let now = now_ms();
    let by_team = grouped(State(cluster.clone()), now, 30, "team").await;
    let by_day = grouped(State(cluster.clone()), now, 30, "day").await;
    let by_month = grouped(State(cluster), now, 365, "month").await;
    let body = html! {
        div #live-report data-live {
            (section("By team, last 30 days", "by-team", &by_team))
            (section("By day, last 30 days", "by-day", &by_day))
            (section("By month, last 12 months", "by-month", &by_month))
        }
    };
    page::frame("Report", "/ui/report", &viewer, body).into_response()
}

fn section(title: &str, id: &str, r: &Result<Report, String>) -> Markup {
    html! {
        div.panel #(id) {
            h2 { (title) }
            @match r {
                Err(e) => p.error { (e) },
                Ok(r) => {
                    @let items: Vec<(String, f64)> = r.groups.iter()
                        .map(|g| (g.key.clone(), g.totals.harvested_gpu_hours))
                        .collect();
                    @if items.is_empty() {
                        p.muted { "nothing harvested in this period" }
                    } @else {
                        (super::chart::bars(&items, "GPU-hours"))
                    }
                    table.report {
                        thead { tr {
                            th { "" } th.n { "GPU-hours" } th.n { "equivalent GPUs" } th.n { "saved (" (r.currency) ")" }
                            th.n { "preemptions" } th.n { "lost GPU-hours" } th.n { "leases" }
                        } }
                        tbody {
                            @for g in &r.groups {
                                tr { td { (g.key) } (figures(&g.totals)) }
                            }
                            tr.total { td { b { "total" } } (figures(&r.totals)) }
                        }
                    }
                }
            }
        }
    }
}

fn figures(t: &nightshift_common::ReportTotals) -> Markup {
    html! {
        td.n { (page::num(t.harvested_gpu_hours)) }
        td.n { (page::num(t.equivalent_gpus)) }
        td.n { (format!("{:.2}", t.savings)) }
        td.n { (t.preemptions) }
        td.n { (page::num(t.lost_gpu_hours)) }
        td.n { (t.leases) }
    }
}
