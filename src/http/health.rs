//! `/health` says the process serves HTTP; `/ready` says it can do its work, i.e. PostgreSQL and
//! Redis both answer. A load balancer routes on `/ready`; an orchestrator restarts on `/health`.

use std::time::Duration;

use actix_web::{HttpResponse, web};
use serde::Serialize;

use crate::http::ApiError;
use crate::state::AppState;

/// How long one dependency check may take before it counts as failed. Shorter than typical
/// load-balancer probe timeouts so that the 503 arrives, rather than a probe time-out.
const READY_CHECK_TIMEOUT_MS: u64 = 2_000;

#[derive(Debug, Serialize)]
struct Status {
    status: &'static str,
}

pub async fn health() -> HttpResponse {
    HttpResponse::Ok().json(Status { status: "ok" })
}

pub async fn ready(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let timeout = Duration::from_millis(READY_CHECK_TIMEOUT_MS);
    let kurrentdb = async {
        match &state.event_store {
            crate::platform::event_store::AnyEventStore::Kurrent(store) => Some(
                tokio::time::timeout(timeout, crate::platform::event_store::kurrent::ping(store))
                    .await,
            ),
            crate::platform::event_store::AnyEventStore::Postgres(_) => None,
        }
    };
    let (postgres, redis, kurrentdb) = tokio::join!(
        tokio::time::timeout(timeout, crate::platform::postgres::ping(&state.pg_pool)),
        tokio::time::timeout(timeout, state.redis.ping()),
        kurrentdb,
    );
    let mut failed = Vec::new();
    let mut checks = vec![("postgres", postgres), ("redis", redis)];
    if let Some(kurrentdb) = kurrentdb {
        checks.push(("kurrentdb", kurrentdb));
    }
    for (name, outcome) in checks {
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(dependency = name, error = %crate::platform::telemetry::error_chain(&error), "readiness check failed");
                failed.push(name.to_string());
            }
            Err(_elapsed) => {
                tracing::warn!(
                    dependency = name,
                    timeout_ms = READY_CHECK_TIMEOUT_MS,
                    "readiness check timed out"
                );
                failed.push(name.to_string());
            }
        }
    }
    if failed.is_empty() {
        Ok(HttpResponse::Ok().json(Status { status: "ready" }))
    } else {
        Err(ApiError::Unavailable {
            dependencies: failed,
        })
    }
}
