//! The HTTP side of metrics: the middleware that counts requests by route template, and
//! `GET /metrics`, which adds the gauges read from the shared stores at scrape time (tasks by
//! status, queue depth, points frozen, projection lag; the same on every instance: queries take
//! their `max`) to what the process's recorder (`platform::metrics`) holds.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{HttpResponse, web};
use anyhow::Context;
use zhihui_domain::task::TaskStatus;

use crate::http::ApiError;
use crate::platform::metrics::handle;
use crate::state::AppState;

/// Records every request's latency and count by method, route template and status.
pub async fn record_http(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let started = std::time::Instant::now();
    let method = request.method().as_str().to_owned();
    // The template (`/api/v1/tasks/{id}`), never the path: ids would make a series per task.
    let route = request
        .match_pattern()
        .unwrap_or_else(|| "unmatched".into());
    let response = next.call(request).await?;
    let status = response.status().as_u16().to_string();
    let labels = [("method", method), ("route", route), ("status", status)];
    metrics::counter!("zhihui_http_requests_total", &labels).increment(1);
    metrics::histogram!("zhihui_http_request_duration_seconds", &labels)
        .record(started.elapsed().as_secs_f64());
    Ok(response)
}

/// `GET /metrics`: the Prometheus text exposition.
pub async fn exposition(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    scrape_gauges(&state).await?;
    let handle = handle();
    handle.run_upkeep();
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(handle.render()))
}

/// What the shared stores say of the whole platform (the same on every instance): `/metrics`
/// exports it, the admin overview page shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlatformReadings {
    /// Every status of the read model, zero included.
    pub tasks_by_status: Vec<(String, i64)>,
    pub points_frozen: rust_decimal::Decimal,
    pub queue_depth: u64,
    /// Works with open reports (the admins' queue).
    pub works_reported: i64,
    pub projection_lags: Vec<crate::platform::projector::Lag>,
}

/// Read [`PlatformReadings`].
pub async fn platform_readings(state: &AppState) -> Result<PlatformReadings, ApiError> {
    let client = crate::platform::postgres::checkout(&state.pg_pool)
        .await
        .context("getting a connection")?;
    let mut by_status: Vec<(String, i64)> = client
        .query("SELECT status, count(*) FROM tasks GROUP BY status", &[])
        .await
        .context("counting tasks")?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    // Every status is a series, zero included: a series that vanishes reads as "unknown".
    for status in TaskStatus::RECORDED {
        if !by_status.iter().any(|(name, _)| name == status.as_str()) {
            by_status.push((status.as_str().into(), 0));
        }
    }
    by_status.sort_by_key(|(status, _)| {
        TaskStatus::RECORDED
            .iter()
            .position(|known| known.as_str() == status)
    });
    let frozen: rust_decimal::Decimal = client
        .query_one("SELECT coalesce(sum(frozen), 0) FROM accounts", &[])
        .await
        .context("summing frozen points")?
        .get(0);
    let works_reported: i64 = client
        .query_one(
            "SELECT count(DISTINCT work_id) FROM work_reports WHERE status = 'open'",
            &[],
        )
        .await
        .context("counting reported works")?
        .get(0);
    drop(client);
    let depth = state.tasks.queue.len().await?;
    Ok(PlatformReadings {
        tasks_by_status: by_status,
        points_frozen: frozen,
        queue_depth: depth,
        works_reported,
        projection_lags: crate::platform::projector::lags(&state.event_store, &state.pg_pool)
            .await?,
    })
}

/// The gauges read from PostgreSQL and Redis at each scrape.
async fn scrape_gauges(state: &AppState) -> Result<(), ApiError> {
    let readings = platform_readings(state).await?;
    for (status, count) in readings.tasks_by_status {
        metrics::gauge!("zhihui_tasks", "status" => status).set(count as f64);
    }
    metrics::gauge!("zhihui_points_frozen").set(decimal_to_f64(readings.points_frozen));
    metrics::gauge!("zhihui_queue_depth").set(readings.queue_depth as f64);
    metrics::gauge!("zhihui_gallery_works_reported").set(readings.works_reported as f64);
    for lag in readings.projection_lags {
        metrics::gauge!("zhihui_projection_lag_events", "projection" => lag.projection)
            .set(lag.events as f64);
        metrics::gauge!("zhihui_projection_lag_seconds", "projection" => lag.projection)
            .set(lag.seconds);
    }
    Ok(())
}

fn decimal_to_f64(value: rust_decimal::Decimal) -> f64 {
    use rust_decimal::prelude::ToPrimitive;
    value.to_f64().unwrap_or(f64::NAN)
}
