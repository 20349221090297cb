//! The OpenAPI document, generated from the handlers' `#[utoipa::path]` attributes and the DTOs'
//! `ToSchema` derives, served at `/api/openapi.json`.

use actix_web::{HttpResponse, web};
use rust_decimal::Decimal;
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::platform::configuration::TaskSettings;
use crate::state::AppState;

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
        super::auth::reset_password,
        super::users::me,
        super::users::user,
        super::users::change_password,
        super::users::bind_phone,
        super::users::set_display_name,
        super::users::set_username,
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
        super::backends::list,
        super::backends::add,
        super::backends::drain,
        super::backends::resume,
        super::backends::remove,
        super::live::image,
        super::live::ticket,
        super::live::original_image,
        super::codes::redeem,
        super::codes::create_batch,
        super::codes::batch,
        super::codes::revoke,
        super::codes::export,
        super::gallery::hot,
        super::gallery::newest,
        super::gallery::work,
        super::gallery::image,
        super::gallery::creator,
        super::gallery::creator_works,
        super::gallery::publish,
        super::gallery::unpublish,
        super::gallery::like,
        super::gallery::unlike,
        super::gallery::follow,
        super::gallery::unfollow,
        super::gallery::block,
        super::gallery::unblock,
        super::gallery::feed,
        super::gallery::my_likes,
        super::gallery::my_works,
        super::gallery::hide,
        super::gallery::report,
        super::gallery::reports,
        super::gallery::dismiss_reports,
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
        super::keys::create,
        super::keys::list,
        super::keys::revoke,
        super::keys::admin_create,
        super::keys::admin_list,
        super::keys::admin_revoke,
        super::webhooks::register,
        super::webhooks::list,
        super::webhooks::rotate,
        super::webhooks::disable,
        super::webhooks::enable,
        super::webhooks::remove,
        super::webhooks::deliveries,
        super::webhooks::redeliver,
    ),
    components(schemas(
        super::problem::Problem,
        crate::webhooks::TaskMessage,
        crate::webhooks::CreditMessage
    )),
    modifiers(&BearerToken),
    tags(
        (name = "auth", description = "register, log in, log out"),
        (name = "users", description = "one's own account"),
        (name = "account", description = "one's points: balance and ledger"),
        (name = "tasks", description = "text-to-image tasks: submit, query, prioritise, cancel"),
        (name = "promotions", description = "flash-sale promotions: list, claim, one's claim"),
        (name = "keys", description = "API keys for programs: made with a person's session, shown once"),
        (name = "webhooks", description = "endpoints called back, signed (Standard Webhooks), on a task's end and on a credit"),
        (name = "gallery", description = "the creators' gallery: works, likes, follows, the feed (reading the public gallery needs no key)"),
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
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("zhk_ + 60 letters and digits")
                    .description(Some(
                        "an API key from POST /api/v1/me/keys (sent as `Authorization: Bearer \
                         zhk_...`); each operation lists the scope it needs: tasks:write, \
                         tasks:read, account:read, codes:redeem, webhooks, admin",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as this server's configuration makes it true (see [`document_for`]).
pub async fn document(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(document_for(
        state.tasks.settings(),
        state.api_keys.rate_max,
    ))
}

/// The document with the task catalog this server runs with: the submit body's models, sizes,
/// samplers, schedulers, step and image bounds, guidance values and prompt lengths are stated
/// as the catalog checks them, so a client (or a fuzzer) can build a request the server accepts.
/// Likewise the most requests a minute an API key may be given (`key_rate_max`).
pub fn document_for(tasks: &TaskSettings, key_rate_max: u32) -> Value {
    let mut document = document_json();
    constrain(
        &mut document,
        "CreateKeyRequest",
        "requests_per_minute",
        json!({"minimum": 1, "maximum": key_rate_max}),
    );
    let strings = |values: &[String]| json!({"enum": values});
    let whole = |minimum: u32, maximum: u32| json!({"minimum": minimum, "maximum": maximum});
    // The guidance values the catalog takes, each with its one decimal place.
    let mut cfgs = Vec::new();
    let mut cfg = tasks.cfg_min;
    while cfg <= tasks.cfg_max {
        let mut value = cfg;
        value.rescale(crate::tasks::catalog::CFG_SCALE_MAX);
        cfgs.push(value.to_string());
        cfg += Decimal::new(1, crate::tasks::catalog::CFG_SCALE_MAX);
    }
    let prompt = |length_max: usize, at_least_one: bool| {
        let mut rule = json!({"maxLength": length_max, "pattern": PROMPT_PATTERN});
        if at_least_one {
            rule["minLength"] = json!(1);
            rule["pattern"] = json!(PROMPT_PATTERN_NOT_BLANK);
        }
        rule
    };
    for (property, rule) in [
        ("prompt", prompt(tasks.prompt_length_max, true)),
        (
            "negative_prompt",
            prompt(tasks.negative_prompt_length_max, false),
        ),
        ("images", whole(1, tasks.images_per_task_max)),
        ("model", strings(&tasks.models)),
        ("resolution", strings(&tasks.resolution_presets)),
        ("steps", whole(tasks.steps_min, tasks.steps_max)),
        ("cfg", json!({"enum": cfgs})),
        ("sampler", strings(&tasks.samplers)),
        ("scheduler", strings(&tasks.schedulers)),
        (
            "seed",
            json!({"minimum": 0, "maximum": crate::tasks::catalog::SEED_MAX}),
        ),
    ] {
        constrain(&mut document, "SubmitTaskRequest", property, rule);
    }
    document
}

/// Merges `rule` into the schema of `property` of the component `schema`.
fn constrain(document: &mut Value, schema: &str, property: &str, rule: Value) {
    let Some(target) = document
        .pointer_mut(&format!(
            "/components/schemas/{schema}/properties/{property}"
        ))
        .and_then(Value::as_object_mut)
    else {
        unreachable!("the document has no {schema}.{property} to constrain");
    };
    if let Value::Object(rule) = rule {
        for (key, value) in rule {
            // An enum lists the values of the property's type; `null` (absent) stays allowed.
            if key == "enum" && target.get("type").is_some_and(Value::is_array) {
                let mut values = value.as_array().cloned().unwrap_or_default();
                values.push(Value::Null);
                target.insert(key, Value::Array(values));
                continue;
            }
            target.insert(key, value);
        }
    }
}

/// A prompt: no control character but tab and line breaks, and no direction control (what
/// `PromptText::parse` refuses).
const PROMPT_PATTERN: &str = "^[^\\u0000-\\u0008\\u000B\\u000C\\u000E-\\u001F\\u007F-\\u009F\\u202A-\\u202E\\u2066-\\u2069]*$";
/// The same, with something that shows: not white space, and not a code point that draws
/// nothing (`zhihui_domain::text::is_blank`; those outside the first plane, tags and the like,
/// a pattern without the `u` flag cannot name).
const PROMPT_PATTERN_NOT_BLANK: &str = "^[^\\u0000-\\u0008\\u000B\\u000C\\u000E-\\u001F\\u007F-\\u009F\\u202A-\\u202E\\u2066-\\u2069]*[^\\s\\u0000-\\u001F\\u007F-\\u009F\\u00AD\\u034F\\u061C\\u115F\\u1160\\u17B4\\u17B5\\u180B-\\u180F\\u200B-\\u200F\\u202A-\\u202E\\u2060-\\u206F\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0\\uFFF0-\\uFFF8][^\\u0000-\\u0008\\u000B\\u000C\\u000E-\\u001F\\u007F-\\u009F\\u202A-\\u202E\\u2066-\\u2069]*$";

/// One line of free text (a title, a reason, a note, a key's name): no control characters, line
/// separators or direction controls (`zhihui_domain::text::refuse_controls`).
const ONE_LINE_PATTERN: &str =
    "^[^\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029\\u202A-\\u202E\\u2066-\\u2069]*$";
/// The same, with something that shows (as for a prompt).
const ONE_LINE_PATTERN_NOT_BLANK: &str = "^[^\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029\\u202A-\\u202E\\u2066-\\u2069]*[^\\s\\u0000-\\u001F\\u007F-\\u009F\\u00AD\\u034F\\u061C\\u115F\\u1160\\u17B4\\u17B5\\u180B-\\u180F\\u200B-\\u200F\\u2028\\u2029\\u202A-\\u202E\\u2060-\\u206F\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0\\uFFF0-\\uFFF8][^\\u0000-\\u001F\\u007F-\\u009F\\u2028\\u2029\\u202A-\\u202E\\u2066-\\u2069]*$";

/// What the request bodies and parameters are checked against, stated in the document from the
/// constants the checks use. Rules that tie two fields together (an end after a start, a day
/// range) or need the server's secrets (a redeem code's signature) cannot be said in a schema;
/// `scripts/fuzz-api.toml` names those operations.
fn constrain_inputs(document: &mut Value) {
    use zhihui_domain::points::AMOUNT_MAX;
    let amount_max_digits = AMOUNT_MAX.to_string().len();
    // Positive, at most two decimal places, at most AMOUNT_MAX (a power of ten).
    let positive = format!(
        "[1-9][0-9]{{0,{}}}(\\.[0-9]{{1,2}})?|{AMOUNT_MAX}(\\.00?)?|0\\.(0[1-9]|[1-9][0-9]?)",
        amount_max_digits - 2
    );
    let amount = json!({"pattern": format!("^({positive})$")});
    let amount_or_zero = json!({"pattern": format!("^(0(\\.00?)?|{positive})$")});
    let text = |length_max: usize| json!({"minLength": 1, "maxLength": length_max, "pattern": ONE_LINE_PATTERN_NOT_BLANK});
    let phone = json!({"pattern": format!(
        "^(\\+[1-9][0-9]{{{},{}}}|1[0-9]{{10}})$",
        zhihui_domain::user::PHONE_DIGITS_MIN - 1,
        zhihui_domain::user::PHONE_DIGITS_MAX - 1
    )});
    let phone_code = json!({"pattern": format!(
        "^[0-9]{{{}}}$",
        crate::identity::phone_codes::CODE_DIGITS
    )});
    let stock = json!({"minimum": 1, "maximum": zhihui_domain::promotion::STOCK_MAX});
    // A list of at least one of the names the server knows (the domain's own list).
    let names = |names: &[&str]| json!({"minItems": 1, "items": {"type": "string", "enum": names}});
    for (schema, property, rule) in [
        ("GrantRequest", "amount", amount.clone()),
        (
            "GrantRequest",
            "reason",
            text(super::accounts::GRANT_REASON_LENGTH_MAX),
        ),
        (
            "RevokeRequest",
            "reason",
            text(super::codes::REVOKE_REASON_LENGTH_MAX),
        ),
        (
            "BatchRequest",
            "count",
            json!({"minimum": 1, "maximum": zhihui_domain::redeem::BATCH_COUNT_MAX}),
        ),
        ("BatchRequest", "points", amount.clone()),
        (
            "BatchRequest",
            "note",
            json!({"maxLength": zhihui_domain::redeem::BATCH_NOTE_LENGTH_MAX, "pattern": ONE_LINE_PATTERN}),
        ),
        (
            "CreateKeyRequest",
            "name",
            text(zhihui_domain::api_key::KEY_NAME_LENGTH_MAX),
        ),
        (
            "PromotionRequest",
            "title",
            text(zhihui_domain::promotion::TITLE_LENGTH_MAX),
        ),
        ("PromotionRequest", "points", amount.clone()),
        ("PromotionRequest", "price", amount_or_zero),
        ("PromotionRequest", "stock", stock.clone()),
        ("StockRequest", "add", stock),
        (
            "AddBackendRequest",
            "name",
            json!({"pattern": format!(
                "^[A-Za-z0-9_-]{{1,{}}}$",
                zhihui_domain::pool::BACKEND_NAME_LENGTH_MAX
            )}),
        ),
        (
            "AddBackendRequest",
            "url",
            json!({"pattern": "^https?://[!-.0-~][!-~]*$", "maxLength": zhihui_domain::pool::BACKEND_URL_LENGTH_MAX}),
        ),
        (
            "AddBackendRequest",
            "capacity",
            json!({"minimum": 1, "maximum": zhihui_domain::pool::BACKEND_CAPACITY_MAX}),
        ),
        (
            "DisplayNameRequest",
            "display_name",
            json!({
                "maxLength": zhihui_domain::user::DISPLAY_NAME_LENGTH_MAX,
                "pattern": ONE_LINE_PATTERN.replacen("[^", "[^#", 1),
            }),
        ),
        (
            "ReportBody",
            "reason",
            json!({"enum": zhihui_domain::gallery::report::ReportReason::ALL.map(|reason| reason.as_str())}),
        ),
        (
            "ReportBody",
            "note",
            json!({"maxLength": zhihui_domain::gallery::report::REPORT_NOTE_LENGTH_MAX, "pattern": ONE_LINE_PATTERN}),
        ),
        ("CodeRequest", "phone", phone.clone()),
        ("BindPhoneRequest", "phone", phone.clone()),
        ("BindPhoneRequest", "code", phone_code.clone()),
        (
            "RedeemRequest",
            "code",
            json!({"pattern": zhihui_domain::redeem::format::CODE_PATTERN}),
        ),
        (
            "CreateKeyRequest",
            "scopes",
            names(&zhihui_domain::api_key::Scope::ALL.map(|scope| scope.as_str())),
        ),
        (
            "RegisterEndpointRequest",
            "event_types",
            names(&zhihui_domain::webhook::WebhookEventType::ALL.map(|kind| kind.as_str())),
        ),
    ] {
        constrain(document, schema, property, rule);
    }
    // Log in with a name and a password, or with a phone and its code: one or the other.
    let login = document.pointer_mut("/components/schemas/LoginRequest");
    if let Some(Value::Object(login)) = login {
        let string = |rule: Value| {
            let mut schema = json!({"type": "string"});
            if let (Value::Object(schema), Value::Object(rule)) = (&mut schema, rule) {
                schema.extend(rule);
            }
            schema
        };
        let absent = json!({"type": "null"});
        login.insert(
            "oneOf".into(),
            json!([
                {
                    "required": ["username", "password"],
                    "properties": {
                        "username": string(json!({})),
                        "password": string(json!({})),
                        "phone": absent,
                        "code": absent,
                    },
                },
                {
                    "required": ["phone", "code"],
                    "properties": {
                        "username": absent,
                        "password": absent,
                        "phone": string(phone),
                        "code": string(phone_code),
                    },
                },
            ]),
        );
    }
    // Every Idempotency-Key header, and the days of the reports.
    let Some(paths) = document.get_mut("paths").and_then(Value::as_object_mut) else {
        return;
    };
    for operation in paths
        .values_mut()
        .filter_map(Value::as_object_mut)
        .flat_map(|item| item.values_mut())
    {
        let Some(parameters) = operation
            .get_mut("parameters")
            .and_then(Value::as_array_mut)
        else {
            continue;
        };
        for parameter in parameters {
            let rule = match (parameter["in"].as_str(), parameter["name"].as_str()) {
                (Some("header"), Some("Idempotency-Key")) => json!({"pattern": format!(
                    "^[\\x21-\\x7E]{{1,{}}}$",
                    super::accounts::IDEMPOTENCY_KEY_LENGTH_MAX
                )}),
                (Some("query"), Some("from" | "to")) => json!({"format": "date"}),
                _ => continue,
            };
            if let (Some(Value::Object(schema)), Value::Object(rule)) =
                (parameter.get_mut("schema"), rule)
            {
                schema.extend(rule);
            }
        }
    }
}

/// The generated document with what every operation may answer made explicit: error answers
/// are `application/problem+json` (the handlers' `body = Problem` says only the schema), and
/// the answers the shared layers give are listed where they apply: 401 where a token is needed,
/// 403 on admin routes, 422 where parameters or a body are read (a value the extractor refuses),
/// 413 where a JSON body is read, 503 when PostgreSQL or Redis is down or does not answer in time.
pub fn document_json() -> Value {
    let mut document = serde_json::to_value(ApiDoc::openapi()).unwrap_or(Value::Null);
    constrain_inputs(&mut document);
    describe_webhooks(&mut document);
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
            // Which API key scope the operation takes, from the table the server checks.
            let scope = actix_web::http::Method::from_bytes(method.to_uppercase().as_bytes())
                .ok()
                .and_then(|method| crate::http::extract::scope_for(&method, path));
            if secured {
                let mut security = vec![json!({"bearer": []})];
                if let Some(scope) = scope {
                    security.push(json!({"api_key": [scope.as_str()]}));
                }
                operation.insert("security".into(), Value::Array(security));
            }
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
                    "`unavailable`: a dependency (PostgreSQL, Redis) is away or failing over; `request-overdue`: the request ran past its deadline; both with `Retry-After`",
                ));
            }
            if path.starts_with("/api/v1/admin/") {
                implied.push(("403", "`admin-only` (or `scope-missing` for an API key)"));
            }
            if secured {
                implied.push(("401", "`missing-token`, `invalid-token` or `invalid-key`"));
                implied.push((
                    "403",
                    "`scope-missing`: an API key without the operation's scope, or on an operation that takes a person's session",
                ));
            }
            if scope.is_some() {
                implied.push((
                    "429",
                    "`key-rate-limited`: the API key made its requests of the last minute (`Retry-After`)",
                ));
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

/// The `webhooks` section (OpenAPI 3.1): what zhihui POSTs to an endpoint, for each event type,
/// with the Standard Webhooks headers and what the endpoint's answer means.
fn describe_webhooks(document: &mut Value) {
    use zhihui_domain::webhook::WebhookEventType;
    let header = |name: &str, description: &str| {
        json!({
            "name": name, "in": "header", "required": true,
            "description": description, "schema": {"type": "string"},
        })
    };
    let parameters = json!([
        header(
            "webhook-id",
            "the message's id: the event's id, the same on every retry and redelivery (drop a repeat by it)",
        ),
        header(
            "webhook-timestamp",
            "seconds since 1970 when this attempt was signed; refuse one far from your clock",
        ),
        header(
            "webhook-signature",
            "space-separated `v1,<base64 HMAC-SHA256 of id.timestamp.body>` under the endpoint's \
             secret (two during a rotation: either may match)",
        ),
    ]);
    let responses = json!({
        "2XX": {"description": "delivered: not sent again (unless redelivered)"},
        "410": {"description": "gone: the endpoint is disabled, nothing more is sent"},
        "default": {
            "description": "any other answer, a timeout or no connection: tried again \
                            (by default after 5 s, 5 min, 30 min, 2 h, 5 h, then every 10 h: 12 retries over about 3.6 days, each give or take its jitter), \
                            later if `Retry-After` asks; a long run of failures disables the endpoint",
        },
    });
    let mut webhooks = serde_json::Map::new();
    for kind in WebhookEventType::ALL {
        let (schema, summary) = match kind {
            WebhookEventType::TaskSucceeded => {
                ("TaskMessage", "a task succeeded: its images are ready")
            }
            WebhookEventType::TaskFailed => {
                ("TaskMessage", "a task failed: its points are returned")
            }
            WebhookEventType::TaskCancelled => (
                "TaskMessage",
                "a task was cancelled: its points are returned",
            ),
            WebhookEventType::PointsCredited => (
                "CreditMessage",
                "points were credited: a grant, a code, a check-in, a promotion",
            ),
        };
        webhooks.insert(
            kind.as_str().to_owned(),
            json!({"post": {
                "summary": summary,
                "parameters": parameters,
                "requestBody": {
                    "required": true,
                    "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}},
                },
                "responses": responses,
            }}),
        );
    }
    if let Some(document) = document.as_object_mut() {
        document.insert("webhooks".into(), Value::Object(webhooks));
    }
}
