//! The admins' pages: the platform at a glance, the pool of ComfyUI servers, users (find, see,
//! grant, change role), redeem-code batches, promotions, and the audit log (an account's
//! movements, a code's life, the settlement repairs). Every page and action first asks
//! [`Page::admin`]: anyone else gets a plain 403 page, and nothing of these pages is in the
//! user pages' HTML or scripts (the admin link shows to admins only; there is no admin script).

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, web};
use chrono::{DateTime, Utc};
use minijinja::context;
use minijinja::value::Value;
use rust_decimal::Decimal;
use serde::Deserialize;
use uuid::Uuid;
use zhihui_domain::claim::Identifier;
use zhihui_domain::pool::PoolDifference;
use zhihui_domain::user::{Role, UserId, Username};

use super::render::{Page, WebError, account_name, ser};
use crate::http::ApiError;
use crate::http::extract::Admin;

mod reports;
mod sales;

pub use reports::{dismiss_reports, reports};
pub use sales::*;

/// Days of daily active users the overview charts.
const ACTIVE_DAYS: u32 = 30;
/// Users, batches and promotions an admin list shows (the newest).
const ADMIN_LIST_MAX: i64 = 50;

fn admin_of(page: &Page) -> Result<Admin, WebError> {
    Ok(Admin(page.admin()?.session.clone()))
}

fn metadata(page: &Page, admin: &Admin) -> crate::platform::event_store::EventMetadata {
    crate::http::event_metadata(&page.request, admin.actor())
}

fn with_trigger(mut response: HttpResponse, event: &'static str) -> HttpResponse {
    response.headers_mut().insert(
        actix_web::http::header::HeaderName::from_static("hx-trigger"),
        actix_web::http::header::HeaderValue::from_static(event),
    );
    response
}

/// The daily active users as an SVG bar chart's bars (drawn by the template; no script).
fn active_users_chart(days: &[(chrono::NaiveDate, u64)]) -> Value {
    let max = days
        .iter()
        .map(|(_, count)| *count)
        .max()
        .unwrap_or(0)
        .max(1);
    let bar_width = 20;
    let height = 120;
    let bars: Vec<Value> = days
        .iter()
        .enumerate()
        .map(|(index, (day, count))| {
            let bar_height = (*count * height / max).max(u64::from(*count > 0));
            context! {
                x => index * bar_width + 2,
                y => height - bar_height,
                width => bar_width - 4,
                height => bar_height,
                day => day.to_string(),
                count,
            }
        })
        .collect();
    context! {
        bars,
        width => days.len() * bar_width,
        height,
        max,
        first => days.first().map(|(day, _)| day.to_string()),
        last => days.last().map(|(day, _)| day.to_string()),
    }
}

/// The platform at a glance.
pub async fn overview(page: Page) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let state = page.state();
    let today = state.active_users.today();
    let from = today - chrono::Duration::days(i64::from(ACTIVE_DAYS) - 1);
    let report = state.active_users.report(from, today).await?;
    let readings = crate::http::metrics::platform_readings(state)
        .await
        .map_err(|error| page.unexpected(error))?;
    let servers = state.dispatcher.backend_pool().list().await?;
    let servers_up = servers.iter().filter(|view| view.state == "up").count();
    let lag_max = readings
        .projection_lags
        .iter()
        .map(|lag| lag.seconds)
        .fold(0.0_f64, f64::max);
    page.render(
        "admin/overview.html",
        context! {
            chart => active_users_chart(&report.days),
            active_today => report.days.last().map_or(0, |(_, count)| *count),
            distinct => report.distinct,
            readings => ser(&readings),
            lag_max_ms => (lag_max * 1000.0).round() as i64,
            servers_up,
            servers_total => servers.len(),
        },
    )
    .await
}

async fn servers_context(page: &Page) -> Result<Value, WebError> {
    let pool = page.state().dispatcher.backend_pool();
    let servers = pool.list().await?;
    let differences: Vec<Value> = pool
        .differences(page.state().dispatcher.configured())
        .await?
        .iter()
        .map(|difference| {
            let apply = difference.command();
            match difference {
                PoolDifference::NotInPool(backend) => context! {
                    kind => "not_in_pool", name => backend.name(), url => backend.url(),
                    capacity => backend.capacity(), apply,
                },
                PoolDifference::NotConfigured { name } => {
                    context! { kind => "not_configured", name, apply }
                }
                PoolDifference::Differs {
                    name,
                    pool_url,
                    pool_capacity,
                    configured,
                } => context! {
                    kind => "differs", name, pool_url, pool_capacity,
                    url => configured.url(), capacity => configured.capacity(), apply,
                },
            }
        })
        .collect();
    let load = in_flight_by_server(page).await?;
    Ok(context! { servers => ser(&servers), differences, load })
}

/// Per server, the tasks running there and the tasks sent there that wait to run next (posted
/// ahead so the GPU never idles), from the tasks' own events (the read model).
async fn in_flight_by_server(page: &Page) -> Result<Value, WebError> {
    let client = crate::platform::postgres::checkout(&page.state().pg_pool)
        .await
        .map_err(anyhow::Error::new)?;
    let rows = client
        .query(
            "SELECT backend, count(*) FILTER (WHERE status = 'running'),
                    count(*) FILTER (WHERE status = 'dispatched')
               FROM tasks WHERE status IN ('dispatched', 'running') AND backend IS NOT NULL
              GROUP BY backend",
            &[],
        )
        .await
        .map_err(anyhow::Error::new)?;
    let load: std::collections::BTreeMap<String, Value> = rows
        .iter()
        .map(|row| {
            let running: i64 = row.get(1);
            let waiting: i64 = row.get(2);
            (row.get(0), context! { running, waiting })
        })
        .collect();
    Ok(Value::from(load))
}

/// The pool: every server's state, models and prompts in flight; add, drain, resume, remove.
pub async fn servers(page: Page) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let context = servers_context(&page).await?;
    // The table asking for itself again while a server settles (see `_servers.html`).
    if page.is_htmx() {
        return page.fragment("admin/_servers.html", context);
    }
    page.render("admin/servers.html", context).await
}

#[derive(Debug, Deserialize)]
pub struct ServerForm {
    name: String,
    url: String,
    capacity: Option<String>,
}

/// `POST /admin/servers`: add a server (every process follows).
pub async fn add_server(page: Page, form: web::Form<ServerForm>) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let capacity = match form.capacity.as_deref().map(str::trim) {
        None | Some("") => 1,
        Some(text) => match text.parse::<u32>() {
            Ok(capacity) => capacity,
            Err(_) => {
                return page.alert(
                    "#servers-messages",
                    "error",
                    &page.t(
                        "error.field",
                        &[
                            ("field", page.t("field.capacity", &[])),
                            ("message", page.t("error.not_a_whole_number", &[])),
                        ],
                    ),
                );
            }
        },
    };
    let backend =
        match zhihui_domain::pool::NewBackend::parse(form.name.trim(), form.url.trim(), capacity) {
            Ok(backend) => backend,
            Err(error) => {
                return page.refused(
                    "#servers-messages",
                    crate::http::backends::pool_error(
                        crate::tasks::pool::PoolServiceError::Rejected(error),
                    ),
                );
            }
        };
    if let Err(error) = page
        .state()
        .dispatcher
        .backend_pool()
        .add(backend, &admin.actor())
        .await
    {
        return page.refused(
            "#servers-messages",
            crate::http::backends::pool_error(error),
        );
    }
    let context = servers_context(&page).await?;
    page.fragment("admin/_servers.html", context)
}

/// `POST /admin/servers/{name}/{drain|resume|remove}` (each asks for confirmation first).
pub async fn server_action(
    page: Page,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let (name, action) = path.into_inner();
    let pool = page.state().dispatcher.backend_pool();
    let done = match action.as_str() {
        "drain" => pool.drain(&name, &admin.actor()).await,
        "resume" => pool.resume(&name, &admin.actor()).await,
        "remove" => pool.remove(&name, &admin.actor()).await,
        _ => return Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found")),
    };
    if let Err(error) = done {
        return page.refused(
            "#servers-messages",
            crate::http::backends::pool_error(error),
        );
    }
    let context = servers_context(&page).await?;
    page.fragment("admin/_servers.html", context)
}

#[derive(Debug, Deserialize)]
pub struct FindQuery {
    q: Option<String>,
}

/// Users: find one by username, phone or id; the newest otherwise.
pub async fn users(page: Page, query: web::Query<FindQuery>) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let state = page.state();
    let wanted = query.q.as_deref().map(str::trim).filter(|q| !q.is_empty());
    if let Some(wanted) = wanted {
        let found = if let Ok(id) = Uuid::parse_str(wanted) {
            state.users.get(UserId::from_uuid(id)).await?
        } else if let Ok(name) = Username::parse(wanted) {
            state.users.find(&Identifier::Username(name)).await?
        } else if let Ok(phone) = zhihui_domain::user::PhoneNumber::parse(wanted) {
            state.users.find(&Identifier::Phone(phone)).await?
        } else {
            None
        };
        if let Some(user) = found {
            return Ok(Page::see_other(&format!("/admin/users/{}", user.user_id)));
        }
    }
    let rows = {
        let client = crate::platform::postgres::checkout(&state.pg_pool)
            .await
            .map_err(anyhow::Error::new)?;
        client
            .query(
                "SELECT user_id, username, phone, role, registered_at FROM users
                  ORDER BY registered_at DESC LIMIT $1",
                &[&ADMIN_LIST_MAX],
            )
            .await
            .map_err(anyhow::Error::new)?
    };
    let listed: Vec<Value> = rows
        .iter()
        .map(|row| {
            let registered_at: DateTime<Utc> = row.get(4);
            context! {
                user_id => row.get::<_, Uuid>(0).to_string(),
                username => row.get::<_, Option<String>>(1),
                phone => row.get::<_, Option<String>>(2),
                role => row.get::<_, String>(3),
                registered_at => registered_at.to_rfc3339(),
            }
        })
        .collect();
    page.render(
        "admin/users.html",
        context! { users => listed, query => wanted, not_found => wanted.is_some() },
    )
    .await
}

async fn user_context(page: &Page, user_id: UserId) -> Result<Option<Value>, WebError> {
    let state = page.state();
    let Some(user) = state.users.get(user_id).await? else {
        return Ok(None);
    };
    let balance = crate::http::accounts::balance_of(state, user_id)
        .await
        .map_err(|error| page.unexpected(error))?;
    let ledger = crate::http::accounts::ledger_page(state, user_id, Some(20), None)
        .await
        .map_err(|error| page.unexpected(error))?;
    Ok(Some(context! {
        user => context! {
            user_id => user_id.to_string(),
            name => account_name(&user),
            display_name => user.display_name.as_ref().map(ToString::to_string),
            username => user.username.as_ref().map(|name| name.as_str().to_owned()),
            phone => user.phone.as_ref().map(ToString::to_string),
            role => user.role.as_str(),
            registered_at => user.registered_at.to_rfc3339(),
        },
        account => ser(&balance),
        entries => ser(&ledger.entries),
        grant_key => Uuid::new_v4().to_string(),
        own => page.member().is_ok_and(|me| me.session.user_id == user_id),
    }))
}

fn parse_user(page: &Page, raw: &str) -> Result<UserId, WebError> {
    Uuid::parse_str(raw)
        .map(UserId::from_uuid)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))
}

/// One user: account, ledger, grant points, change role.
pub async fn user(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let user_id = parse_user(&page, &path)?;
    let Some(context) = user_context(&page, user_id).await? else {
        return Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found"));
    };
    page.render("admin/user.html", context).await
}

#[derive(Debug, Deserialize)]
pub struct GrantForm {
    amount: String,
    reason: String,
    /// One per rendering of the form: a repeated submit grants once.
    key: Option<String>,
}

/// `POST /admin/users/{id}/grant`: the API's grant, with its rules (amount, reason) and its
/// idempotency (one key per form).
pub async fn grant(
    page: Page,
    path: web::Path<String>,
    form: web::Form<GrantForm>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let user_id = parse_user(&page, &path)?;
    let Ok(amount) = form.amount.trim().parse::<Decimal>() else {
        return page.alert(
            "#grant-messages",
            "error",
            &page.t(
                "error.field",
                &[
                    ("field", page.t("field.amount", &[])),
                    ("message", page.t("error.not_a_number", &[])),
                ],
            ),
        );
    };
    let operation_id = match form
        .key
        .as_deref()
        .and_then(|key| Uuid::parse_str(key).ok())
    {
        Some(key) => crate::http::accounts::operation_id_of_key(
            &format!("grant:{user_id}"),
            &format!("web-{key}"),
        ),
        None => Uuid::now_v7(),
    };
    let request = crate::http::accounts::GrantRequest {
        amount,
        reason: form.reason.clone(),
    };
    let metadata = metadata(&page, &admin);
    match crate::http::accounts::grant_points(
        page.state(),
        &admin,
        user_id,
        &request,
        operation_id,
        metadata,
    )
    .await
    {
        Ok(_) => {
            let Some(context) = user_context(&page, user_id).await? else {
                return Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found"));
            };
            let context = context! { ..context, ..context! { granted => two_places(amount) } };
            Ok(with_trigger(
                page.fragment("admin/_user.html", context)?,
                "balance-changed",
            ))
        }
        Err(error) => page.refused("#grant-messages", error),
    }
}

fn two_places(mut value: Decimal) -> String {
    value.rescale(zhihui_domain::points::POINTS_SCALE);
    value.to_string()
}

#[derive(Debug, Deserialize)]
pub struct RoleForm {
    role: String,
}

/// `POST /admin/users/{id}/role`: the user's sessions end; the role holds from their next login.
pub async fn change_role(
    page: Page,
    path: web::Path<String>,
    form: web::Form<RoleForm>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let user_id = parse_user(&page, &path)?;
    let role = match form.role.as_str() {
        "admin" => Role::Admin,
        "user" => Role::User,
        _ => return page.alert("#role-messages", "error", &page.t("error.not_found", &[])),
    };
    let metadata = metadata(&page, &admin);
    if let Err(error) =
        crate::http::users::change_role_of(page.state(), &admin, user_id, role, &metadata).await
    {
        return page.refused("#role-messages", error);
    }
    let Some(context) = user_context(&page, user_id).await? else {
        return Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found"));
    };
    page.fragment(
        "admin/_user.html",
        context! { ..context, ..context! { role_changed => true } },
    )
}

#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    account: Option<String>,
    code: Option<String>,
}

/// The audit log: an account's movements (who moved what), a code's life, the repairs the
/// settlement reconciler made.
pub async fn audit(page: Page, query: web::Query<AuditQuery>) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let state = page.state();
    let account_query = query
        .account
        .as_deref()
        .map(str::trim)
        .filter(|q| !q.is_empty());
    let mut account = None;
    let mut account_missing = false;
    if let Some(wanted) = account_query {
        let found = if let Ok(id) = Uuid::parse_str(wanted) {
            state.users.get(UserId::from_uuid(id)).await?
        } else if let Ok(name) = Username::parse(wanted) {
            state.users.find(&Identifier::Username(name)).await?
        } else {
            None
        };
        match found {
            Some(user) => {
                let mut movements = crate::points::ledger::account_movements(
                    &state.event_store,
                    user.user_id,
                    None,
                    None,
                )
                .await?;
                movements.reverse();
                account = Some(context! {
                    user_id => user.user_id.to_string(),
                    name => account_name(&user),
                    movements => ser(&movements),
                });
            }
            None => account_missing = true,
        }
    }
    let code_query = query
        .code
        .as_deref()
        .map(str::trim)
        .filter(|q| !q.is_empty());
    let mut code = None;
    let mut code_error = None;
    if let Some(text) = code_query {
        match state.codes.life(text).await? {
            Some(life) => {
                code = Some(context! {
                    code => life.code,
                    serial => life.serial,
                    batch => life.batch.as_ref().map(|batch| context! {
                        batch_id => batch.batch_id.to_string(),
                        points => batch.spec.points.to_string(),
                        valid_from => batch.spec.valid_from.to_rfc3339(),
                        valid_until => batch.spec.valid_until.to_rfc3339(),
                        note => batch.spec.note.clone(),
                        revoked_at => batch.revoked_at.map(|at| at.to_rfc3339()),
                    }),
                    redemption => life.redemption.as_ref().map(|redeemed| context! {
                        user_id => redeemed.user_id.to_string(),
                        at => redeemed.at.to_rfc3339(),
                    }),
                    credited => life.credit.as_ref().map(|credit| context! {
                        amount => credit.amount.to_string(),
                        at => credit.at.to_rfc3339(),
                    }),
                });
            }
            None => code_error = Some(page.t("admin.not_a_code", &[("code", text.to_owned())])),
        }
    }
    let repairs = crate::points::settlements::repairs(&state.pg_pool, None).await?;
    let repairs: Vec<&crate::points::settlements::Repair> =
        repairs.iter().rev().take(100).collect();
    page.render(
        "admin/audit.html",
        context! {
            account_query,
            account,
            account_missing,
            code_query,
            code,
            code_error,
            repairs => ser(&repairs),
        },
    )
    .await
}
