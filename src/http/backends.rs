//! The pool of ComfyUI servers at run time: `/api/v1/admin/backends*` (admins only). Every change
//! is an event of the `backend-pool` stream; the leader follows it without a restart.

use actix_web::{HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use zhihui_domain::pool::{BACKEND_CAPACITY_MAX, BACKEND_NAME_LENGTH_MAX, BACKEND_URL_LENGTH_MAX};
use zhihui_domain::pool::{NewBackend, PoolBackend, PoolError};
use zhihui_domain::rule::{Broken, Rule};

use crate::http::ApiError;
use crate::http::extract::Admin;
use crate::state::AppState;
use crate::tasks::pool::{BackendView, PoolServiceError, state_of};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddBackendRequest {
    /// 1 to 32 letters, digits, `-` and `_`; names the server in task events, Redis and metrics.
    pub name: String,
    /// Its HTTP base URL, e.g. `http://10.0.0.5:8188`.
    pub url: String,
    /// Prompts in flight there at once, 1 to 8 (1 when absent).
    #[serde(
        default,
        deserialize_with = "crate::http::extract::whole::optional_u32"
    )]
    pub capacity: Option<u32>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BackendItem {
    pub name: String,
    pub url: String,
    pub capacity: u32,
    /// `up`, `down`, `draining` (no new prompt; some still run), `drained` (draining and idle),
    /// `resuming` (resumed; the dispatcher leader has not followed yet), or `unknown` (no
    /// dispatcher leader has reported it in the last 10 s).
    pub state: String,
    pub draining: bool,
    /// Prompts posted there and not ended (as the leader last reported).
    pub prompts_in_flight: Option<u32>,
    /// Tasks recorded for it, waiting for a slot there.
    pub staged: Option<u32>,
    /// The checkpoints it offers (`/object_info`); null until it was read.
    pub models: Option<Vec<String>>,
    /// Its ComfyUI version (`/system_stats`).
    pub version: Option<String>,
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    /// The model of the prompt posted there last.
    pub last_model: Option<String>,
    /// Times the posted model changed there, under the current leader.
    pub model_switches: Option<u64>,
    pub tasks_succeeded: i64,
    pub tasks_failed: i64,
    pub added_at: DateTime<Utc>,
    /// When the leader's view was published (null: no recent view).
    pub reported_at: Option<DateTime<Utc>>,
}

impl BackendItem {
    fn of(view: BackendView) -> BackendItem {
        let BackendView {
            backend,
            state,
            status,
            tasks_succeeded,
            tasks_failed,
        } = view;
        BackendItem {
            name: backend.name,
            url: backend.url,
            capacity: backend.capacity,
            state: state.to_owned(),
            draining: backend.draining,
            prompts_in_flight: status.as_ref().map(|s| s.prompts_in_flight),
            staged: status.as_ref().map(|s| s.staged),
            models: backend.models,
            version: backend.version,
            last_error: status.as_ref().and_then(|s| s.last_error.clone()),
            last_error_at: status.as_ref().and_then(|s| s.last_error_at),
            last_model: status.as_ref().and_then(|s| s.last_model.clone()),
            model_switches: status.as_ref().map(|s| s.model_switches),
            tasks_succeeded,
            tasks_failed,
            added_at: backend.added_at,
            reported_at: status.as_ref().map(|s| s.published_at),
        }
    }

    /// A server just changed, before any leader reported on it.
    fn of_backend(backend: PoolBackend) -> BackendItem {
        BackendItem::of(BackendView {
            state: state_of(&backend, None),
            backend,
            status: None,
            tasks_succeeded: 0,
            tasks_failed: 0,
        })
    }
}

pub(crate) fn pool_error(error: PoolServiceError) -> ApiError {
    let rejected = match error {
        PoolServiceError::Rejected(rejected) => rejected,
        PoolServiceError::Unexpected(error) => return ApiError::from(error),
    };
    let detail = rejected.to_string();
    match rejected {
        PoolError::InvalidName(name) => ApiError::invalid(
            "name",
            Broken::new(Rule::ServerName)
                .with("value", format!("{name:?}"))
                .with("max", BACKEND_NAME_LENGTH_MAX),
        ),
        PoolError::InvalidUrl(url) => ApiError::invalid(
            "url",
            Broken::new(Rule::ServerUrl)
                .with("value", format!("{url:?}"))
                .with("max", BACKEND_URL_LENGTH_MAX),
        ),
        PoolError::InvalidCapacity(_) => ApiError::invalid(
            "capacity",
            Broken::new(Rule::Between)
                .with("min", 1)
                .with("max", BACKEND_CAPACITY_MAX),
        ),
        PoolError::NotFound(_) => ApiError::NotFound(detail),
        PoolError::NameTaken(_) => ApiError::Conflict {
            rule: "backend-name-taken",
            detail,
        },
        PoolError::PoolFull => ApiError::Conflict {
            rule: "pool-full",
            detail,
        },
        PoolError::Busy { .. } => ApiError::Conflict {
            rule: "backend-busy",
            detail,
        },
    }
}

/// The one server named, from the pool just changed.
fn named(pool: &zhihui_domain::pool::PoolState, name: &str) -> Result<BackendItem, ApiError> {
    pool.backend(name)
        .cloned()
        .map(BackendItem::of_backend)
        .ok_or_else(|| ApiError::NotFound(format!("no server named {name} in the pool")))
}

/// Every server of the pool: its state, capacity, prompts in flight, models, version, last error,
/// tasks done and failed.
#[utoipa::path(
    get, path = "/api/v1/admin/backends", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = [BackendItem]), (status = 401, body = crate::http::problem::Problem), (status = 403, body = crate::http::problem::Problem))
)]
pub async fn list(state: web::Data<AppState>, _admin: Admin) -> Result<HttpResponse, ApiError> {
    let views = state.dispatcher.backend_pool().list().await?;
    Ok(HttpResponse::Ok().json(views.into_iter().map(BackendItem::of).collect::<Vec<_>>()))
}

/// Add a server to the pool; the leader connects to it and asks what it offers. Adding the same
/// server again (same URL and capacity) answers it again.
#[utoipa::path(
    post, path = "/api/v1/admin/backends", tag = "admin", security(("bearer" = [])),
    request_body = AddBackendRequest,
    responses((status = 201, body = BackendItem), (status = 401, body = crate::http::problem::Problem), (status = 403, body = crate::http::problem::Problem), (status = 409, body = crate::http::problem::Problem), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn add(
    state: web::Data<AppState>,
    admin: Admin,
    body: crate::http::extract::Json<AddBackendRequest>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let backend = NewBackend::parse(&request.name, &request.url, request.capacity.unwrap_or(1))
        .map_err(|error| pool_error(PoolServiceError::Rejected(error)))?;
    let name = backend.name().to_owned();
    let pool = state
        .dispatcher
        .backend_pool()
        .add(backend, &admin.actor())
        .await
        .map_err(pool_error)?;
    Ok(HttpResponse::Created().json(named(&pool, &name)?))
}

/// Drain a server: no new prompt goes there; the prompts running there finish.
#[utoipa::path(
    post, path = "/api/v1/admin/backends/{name}/drain", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "the server's name")),
    responses((status = 200, body = BackendItem), (status = 401, body = crate::http::problem::Problem), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn drain(
    state: web::Data<AppState>,
    admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    set_draining(&state, &admin, &path, true).await
}

/// Put a drained server back in service.
#[utoipa::path(
    post, path = "/api/v1/admin/backends/{name}/resume", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "the server's name")),
    responses((status = 200, body = BackendItem), (status = 401, body = crate::http::problem::Problem), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn resume(
    state: web::Data<AppState>,
    admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    set_draining(&state, &admin, &path, false).await
}

/// Drain or resume `name`; the server as the pool now has it.
async fn set_draining(
    state: &AppState,
    admin: &Admin,
    name: &str,
    draining: bool,
) -> Result<HttpResponse, ApiError> {
    let pool = state.dispatcher.backend_pool();
    let changed = if draining {
        pool.drain(name, &admin.actor()).await
    } else {
        pool.resume(name, &admin.actor()).await
    };
    Ok(HttpResponse::Ok().json(named(&changed.map_err(pool_error)?, name)?))
}

/// Remove a server on which nothing runs (drain it first and wait until it is `drained`).
#[utoipa::path(
    delete, path = "/api/v1/admin/backends/{name}", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "the server's name")),
    responses((status = 204), (status = 401, body = crate::http::problem::Problem), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem), (status = 409, body = crate::http::problem::Problem))
)]
pub async fn remove(
    state: web::Data<AppState>,
    admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    state
        .dispatcher
        .backend_pool()
        .remove(&path, &admin.actor())
        .await
        .map_err(pool_error)?;
    Ok(HttpResponse::NoContent().finish())
}
