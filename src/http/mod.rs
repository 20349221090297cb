//! The HTTP edge: routes, JSON DTOs and the mapping of errors to problem+json. Only this module
//! knows JSON shapes; the domain and the stores never see an HTTP type.

mod health;
pub mod problem;

use actix_web::web;

pub use problem::ApiError;

/// Mount every route. Later issues add `/api/v1/...` scopes here.
pub fn routes(config: &mut web::ServiceConfig) {
    config
        .route("/health", web::get().to(health::health))
        .route("/ready", web::get().to(health::ready));
}
