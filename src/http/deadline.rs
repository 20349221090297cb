//! Every route's deadline. A request not answered within `http.read_deadline_ms` (GET, HEAD) or
//! `http.write_deadline_ms` (the rest) is answered 503 with `Retry-After`
//! ([`ApiError::Overdue`]): a store that stops answering without closing its connections (a
//! paused server, a network partition) would otherwise hold the request, and its client, for as
//! long as it stays away. The handler is dropped where it stood, as when its client goes away:
//! a command half done is what a crash leaves, which its intent covers; the steps that must all
//! happen once begun (a task command, a role or password change and the sessions it ends) run
//! as tasks of their own (`worker_local::off_worker`) and go on to their end.
//!
//! Each route is wrapped, not the app: an app-wide middleware holding the request would keep the
//! router from writing the path's parameters into it.

use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::middleware::{Next, from_fn};
use actix_web::{FromRequest, Handler, HttpResponse, Responder, Route, web};

use crate::http::ApiError;
use crate::state::AppState;

/// `handler` on `route` (`web::get()`, ...), answered [`ApiError::Overdue`] past its deadline,
/// in `answer`'s form (the API's problem, a page).
pub fn within_deadline<F, Args>(
    route: Route,
    handler: F,
    answer: fn(ApiError) -> HttpResponse,
) -> Route
where
    F: Handler<Args>,
    Args: FromRequest + 'static,
    F::Output: Responder + 'static,
{
    route
        .to(handler)
        .wrap(from_fn(move |request, next| overdue(answer, request, next)))
}

async fn overdue(
    answer: fn(ApiError) -> HttpResponse,
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<actix_web::body::BoxBody>, actix_web::Error> {
    let Some(deadline) = deadline_of(&request) else {
        return Ok(next.call(request).await?.map_into_boxed_body());
    };
    // Routed already: holding the request no longer keeps the router from writing into it.
    let asked = request.request().clone();
    match tokio::time::timeout(deadline, next.call(request)).await {
        Ok(response) => Ok(response?.map_into_boxed_body()),
        Err(_) => {
            tracing::warn!(method = %asked.method(), path = asked.path(), ?deadline, "a request ran past its deadline");
            let after_s = deadline.as_millis().div_ceil(1000);
            let response = answer(ApiError::Overdue {
                after_s: u64::try_from(after_s).unwrap_or(u64::MAX),
            });
            Ok(ServiceResponse::new(asked, response))
        }
    }
}

fn deadline_of(request: &ServiceRequest) -> Option<Duration> {
    let settings = &request.app_data::<web::Data<AppState>>()?.http_settings;
    Some(Duration::from_millis(
        if matches!(*request.method(), Method::GET | Method::HEAD) {
            settings.read_deadline_ms
        } else {
            settings.write_deadline_ms
        },
    ))
}

#[cfg(test)]
mod tests {
    /// Every route of the API and of the pages is registered through its deadline: one
    /// registered with a bare `.to(handler)` would wait on a store that stops answering for as
    /// long as it is away.
    #[test]
    fn every_route_is_registered_with_its_deadline() {
        for (file, source) in [
            ("src/http/mod.rs", include_str!("mod.rs")),
            ("src/web/mod.rs", include_str!("../web/mod.rs")),
        ] {
            let bare: Vec<&str> = source
                .lines()
                .filter(|line| line.contains("().to("))
                .collect();
            assert!(bare.is_empty(), "{file}: {bare:?}");
            assert!(source.contains("within_deadline("), "{file}");
        }
    }
}
