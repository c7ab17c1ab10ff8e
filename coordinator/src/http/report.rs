//! `/v1/report`: harvested GPU time over a period, from the accounting records and the
//! leases still running.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use nightshift_common::{ApiError, Report};
use nightshift_core::Usage;
use nightshift_core::report::{self, GroupBy};
use serde::Deserialize;

use super::HttpError;
use crate::cluster::Cluster;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ReportQuery {
    /// Unix milliseconds; 30 days before `until` when absent.
    pub(crate) since: Option<u64>,
    /// Unix milliseconds; now when absent.
    pub(crate) until: Option<u64>,
    /// `team`, `job`, `day` or `month`.
    pub(crate) by: Option<String>,
}

const MONTH_MS: u64 = 30 * 86_400_000;

/// Harvested GPU time over a period, and what it was worth.
#[utoipa::path(get, path = "/v1/report", tag = "report",
    params(ReportQuery),
    responses(
        (status = 200, description = "The report.", body = Report),
        (status = 400, description = "A bad period or grouping.", body = ApiError),
    ))]
pub async fn report(
    State(cluster): State<Arc<Cluster>>,
    Query(q): Query<ReportQuery>,
) -> Result<Json<Report>, HttpError> {
    let by =
        q.by.as_deref()
            .map(str::parse::<GroupBy>)
            .transpose()
            .map_err(HttpError::bad_request)?;
    let (price, currency) = (
        cluster.accounting.price_per_gpu_hour,
        cluster.accounting.currency.clone(),
    );
    let report = cluster.read_store(|store, core, now| {
        let until = q.until.unwrap_or(now);
        let since = q.since.unwrap_or(until.saturating_sub(MONTH_MS));
        if since >= until {
            return Err(HttpError::bad_request("since: must be before until"));
        }
        let mut usage = store.usage(since, until).map_err(|e| {
            HttpError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                e.to_string(),
                None,
            )
        })?;
        // Leases still running count up to now.
        usage.extend(core.leases().map(|l| {
            Usage {
                lease_id: l.id,
                job_id: l.job,
                team: core
                    .job(l.job)
                    .and_then(|j| j.spec.owner)
                    .unwrap_or_else(|| "default".to_owned()),
                node: l.node.clone(),
                gpus: l.gpus.len() as u32,
                started_at: l.granted_at,
                ended_at: now.max(l.granted_at),
                preempted: false,
                lost_gpu_ms: 0,
            }
        }));
        Ok(report::build(&usage, since, until, by, price, &currency))
    })?;
    Ok(Json(report))
}
