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
    HttpResponse::Ok().json(ApiDoc::openapi())
}
