//! Prometheus metrics (issue 26). Code records through the `metrics` facade; the Prometheus
//! exporter's recorder, installed once per process, renders them at `GET /metrics`. Beside them
//! the handler reads, at scrape time, what is a truth of the shared stores rather than of this
//! process: tasks by status, queue depth, points frozen, projection lag. Every name carries its
//! unit (`_seconds`, `_total` for counters); label values are bounded (route templates, backend
//! names from the configuration, catalog models, fixed kinds), never ids.
//!
//! Every metric is listed with its meaning in README.md ("Metrics").

use std::sync::OnceLock;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{HttpResponse, web};
use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use zhihui_domain::task::TaskStatus;

use crate::http::ApiError;
use crate::startup::AppState;

/// Histogram buckets of durations, 1 ms to 10 min: HTTP answers and appends sit at the bottom,
/// tasks (seconds to minutes on a GPU) at the top.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process's recorder, installed on first use. Tests start many apps in one process: they
/// share it, as every part of one `zhihui serve` does.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .unwrap_or_else(|error| unreachable!("the buckets are not empty: {error}"))
            .build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed: /metrics will be empty");
        }
        handle
    })
}

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

/// The gauges read from PostgreSQL and Redis at each scrape.
async fn scrape_gauges(state: &AppState) -> Result<(), ApiError> {
    let client = state.pg_pool.get().await.context("getting a connection")?;
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
    for (status, count) in by_status {
        metrics::gauge!("zhihui_tasks", "status" => status).set(count as f64);
    }
    let frozen: rust_decimal::Decimal = client
        .query_one("SELECT coalesce(sum(frozen), 0) FROM accounts", &[])
        .await
        .context("summing frozen points")?
        .get(0);
    metrics::gauge!("zhihui_points_frozen").set(decimal_to_f64(frozen));
    drop(client);
    let depth = state.tasks.queue.len().await?;
    metrics::gauge!("zhihui_queue_depth").set(depth as f64);
    for lag in crate::projector::lags(state).await? {
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
