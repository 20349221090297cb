//! The OpenAPI document, generated from the handlers' `#[utoipa::path]` attributes and the DTOs'
//! `ToSchema` derives, served at `/api/openapi.json`.

use actix_web::HttpResponse;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "zhihui",
        description = "Text-to-image backend: points, tasks, queue, dispatch. Errors are \
                       application/problem+json; `type` names the rule that refused the request."
    ),
    paths(
        super::auth::register,
        super::auth::login,
        super::auth::send_code,
        super::auth::logout,
        super::users::me,
        super::users::user,
        super::users::change_password,
        super::users::bind_phone,
        super::users::admin_user,
        super::users::change_role,
        super::accounts::balance,
        super::accounts::ledger,
        super::accounts::grant,
        super::accounts::projections,
        super::tasks::submit,
        super::tasks::task,
        super::tasks::tasks,
        super::tasks::prioritise,
        super::tasks::cancel,
        super::tasks::queue,
        super::tasks::rebuild_queue,
        super::live::image,
        super::live::ticket,
        super::live::original_image,
        super::codes::redeem,
        super::codes::create_batch,
        super::codes::batch,
        super::codes::revoke,
        super::codes::export,
        super::checkins::check_in,
        super::checkins::month,
        super::checkins::active_users,
        super::promotions::create,
        super::promotions::show,
        super::promotions::end,
        super::promotions::raise,
        super::promotions::open,
        super::promotions::claim,
        super::promotions::my_claim,
    ),
    components(schemas(super::problem::Problem)),
    modifiers(&BearerToken),
    tags(
        (name = "auth", description = "register, log in, log out"),
        (name = "users", description = "one's own account"),
        (name = "account", description = "one's points: balance and ledger"),
        (name = "tasks", description = "text-to-image tasks: submit, query, prioritise, cancel"),
        (name = "promotions", description = "flash-sale promotions: list, claim, one's claim"),
        (name = "admin", description = "admin-only endpoints"),
    )
)]
pub struct ApiDoc;

/// Declares the `bearer` scheme the paths refer to.
#[derive(Debug)]
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "opaque token from POST /api/v1/auth/login; idle timeout, renewed on use",
                    ))
                    .build(),
            ),
        );
    }
}

pub async fn document() -> HttpResponse {
    static DOCUMENT: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
    HttpResponse::Ok().json(DOCUMENT.get_or_init(document_json))
}

/// The generated document with what every operation may answer made explicit: error answers
/// are `application/problem+json` (the handlers' `body = Problem` says only the schema), and
/// the answers the shared layers give are listed where they apply: 401 where a token is needed,
/// 403 on admin routes, 422 where parameters or a body are read (a value the extractor refuses),
/// 413 where a JSON body is read, 503 when PostgreSQL or Redis is down.
pub fn document_json() -> serde_json::Value {
    use serde_json::{Value, json};
    let mut document = serde_json::to_value(ApiDoc::openapi()).unwrap_or(Value::Null);
    let problem =
        json!({"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}});
    let Some(paths) = document.get_mut("paths").and_then(Value::as_object_mut) else {
        return document;
    };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for (method, operation) in item.iter_mut() {
            let Some(operation) = operation.as_object_mut() else {
                continue;
            };
            let secured = operation
                .get("security")
                .and_then(Value::as_array)
                .is_some_and(|security| {
                    security.iter().any(|scheme| scheme.get("bearer").is_some())
                });
            let reads_input = operation.contains_key("requestBody")
                || operation
                    .get("parameters")
                    .and_then(Value::as_array)
                    .is_some_and(|parameters| !parameters.is_empty());
            let has_body = operation.contains_key("requestBody");
            let responses = operation.entry("responses").or_insert_with(|| json!({}));
            let Some(responses) = responses.as_object_mut() else {
                continue;
            };
            let mut implied: Vec<(&str, &str)> = Vec::new();
            if path.starts_with("/api/") {
                implied.push((
                    "503",
                    "a dependency (PostgreSQL, Redis) is unavailable; try again",
                ));
            }
            if secured {
                implied.push(("401", "`missing-token` or `invalid-token`"));
            }
            if path.starts_with("/api/v1/admin/") {
                implied.push(("403", "`admin-only`"));
            }
            if reads_input {
                implied.push((
                    "422",
                    "a parameter or field breaks its rule (`field` names it)",
                ));
            }
            if has_body && method != "get" {
                implied.push(("413", "`body-too-large`"));
            }
            for (status, description) in implied {
                responses
                    .entry(status)
                    .or_insert_with(|| json!({"description": description}));
            }
            for (status, response) in responses.iter_mut() {
                let error = status.starts_with('4') || status.starts_with('5');
                let Some(response) = response.as_object_mut() else {
                    continue;
                };
                if error && status != "304" {
                    response.insert("content".into(), problem.clone());
                }
            }
        }
    }
    document
}
