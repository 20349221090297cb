//! Templates and the page a request renders: [`Web`] holds the minijinja environment (the
//! built-in templates compiled in, an operator's directory in front of them), [`Page`] is a
//! request's reader (language, session) with `render` for a whole page and `fragment` for an
//! htmx swap, and [`WebError`] is a refusal rendered as a page (or a redirect to sign in).

use std::future::Future;
use std::pin::Pin;

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpRequest, HttpResponse, ResponseError, web};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, State, context};
use zhihui_domain::rule::Broken;

use super::i18n::Lang;
use super::session::{self, Member};
use crate::http::ApiError;
use crate::platform::configuration::{CookieSecure, Settings};
use crate::state::AppState;

/// The built-in templates, by name.
const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("templates/base.html")),
    ("error.html", include_str!("templates/error.html")),
    ("login.html", include_str!("templates/login.html")),
    ("register.html", include_str!("templates/register.html")),
    ("generate.html", include_str!("templates/generate.html")),
    ("_task_card.html", include_str!("templates/_task_card.html")),
    (
        "_earn_links.html",
        include_str!("templates/_earn_links.html"),
    ),
    ("_alert.html", include_str!("templates/_alert.html")),
    ("_balance.html", include_str!("templates/_balance.html")),
    ("history.html", include_str!("templates/history.html")),
    ("task.html", include_str!("templates/task.html")),
    ("points.html", include_str!("templates/points.html")),
    ("checkin.html", include_str!("templates/checkin.html")),
    (
        "_checkin_panel.html",
        include_str!("templates/_checkin_panel.html"),
    ),
    ("redeem.html", include_str!("templates/redeem.html")),
    ("settings.html", include_str!("templates/settings.html")),
    ("_keys.html", include_str!("templates/_keys.html")),
    (
        "_phone_card.html",
        include_str!("templates/_phone_card.html"),
    ),
    (
        "_username_form.html",
        include_str!("templates/_username_form.html"),
    ),
    (
        "_display_name_form.html",
        include_str!("templates/_display_name_form.html"),
    ),
    (
        "password_reset.html",
        include_str!("templates/password_reset.html"),
    ),
    (
        "_send_code_button.html",
        include_str!("templates/_send_code_button.html"),
    ),
    ("sales.html", include_str!("templates/sales.html")),
    ("_sale.html", include_str!("templates/_sale.html")),
    ("gallery.html", include_str!("templates/gallery.html")),
    (
        "_gallery_tabs.html",
        include_str!("templates/_gallery_tabs.html"),
    ),
    ("_work_grid.html", include_str!("templates/_work_grid.html")),
    ("work.html", include_str!("templates/work.html")),
    (
        "_like_button.html",
        include_str!("templates/_like_button.html"),
    ),
    (
        "_like_inner.html",
        include_str!("templates/_like_inner.html"),
    ),
    ("creator.html", include_str!("templates/creator.html")),
    (
        "_follow_button.html",
        include_str!("templates/_follow_button.html"),
    ),
    (
        "_follow_inner.html",
        include_str!("templates/_follow_inner.html"),
    ),
    ("publish.html", include_str!("templates/publish.html")),
    (
        "gallery_mine.html",
        include_str!("templates/gallery_mine.html"),
    ),
    ("admin/base.html", include_str!("templates/admin/base.html")),
    (
        "admin/overview.html",
        include_str!("templates/admin/overview.html"),
    ),
    (
        "admin/servers.html",
        include_str!("templates/admin/servers.html"),
    ),
    (
        "admin/_servers.html",
        include_str!("templates/admin/_servers.html"),
    ),
    (
        "admin/users.html",
        include_str!("templates/admin/users.html"),
    ),
    ("admin/user.html", include_str!("templates/admin/user.html")),
    (
        "admin/_user.html",
        include_str!("templates/admin/_user.html"),
    ),
    (
        "admin/codes.html",
        include_str!("templates/admin/codes.html"),
    ),
    (
        "admin/_batch.html",
        include_str!("templates/admin/_batch.html"),
    ),
    (
        "admin/promotions.html",
        include_str!("templates/admin/promotions.html"),
    ),
    (
        "admin/reports.html",
        include_str!("templates/admin/reports.html"),
    ),
    (
        "admin/_promotion.html",
        include_str!("templates/admin/_promotion.html"),
    ),
    (
        "admin/audit.html",
        include_str!("templates/admin/audit.html"),
    ),
];

/// The web app's shared parts: templates and settings.
#[derive(Debug)]
pub struct Web {
    env: Environment<'static>,
    cookie_secure: CookieSecure,
    trust_forwarded: bool,
    /// The platform's offset from UTC in minutes (its day's zone): times in it until the
    /// reader's browser tells its own.
    platform_offset: i32,
}

impl Web {
    pub fn new(settings: &Settings) -> anyhow::Result<Web> {
        let mut env = Environment::new();
        let overrides = settings.web.templates_directory.trim().to_owned();
        env.set_loader(move |name| {
            // An operator's template of the same name wins; names never leave the directory.
            if !overrides.is_empty() && !name.contains("..") {
                let path = std::path::Path::new(&overrides).join(name);
                if path.is_file() {
                    return std::fs::read_to_string(&path).map(Some).map_err(|error| {
                        minijinja::Error::new(
                            minijinja::ErrorKind::InvalidOperation,
                            format!("reading template {}: {error}", path.display()),
                        )
                    });
                }
            }
            Ok(TEMPLATES
                .iter()
                .find(|(built_in, _)| *built_in == name)
                .map(|(_, source)| (*source).to_owned()))
        });
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Chainable);
        let platform_offset = settings.auth.day_utc_offset_minutes;
        env.add_function("t", translate);
        // Our own URL, not user text: safe as it is.
        env.add_function("asset", |name: &str| {
            Value::from_safe_string(super::assets::url(name))
        });
        // A checkpoint as people read it; requests keep sending its file name.
        let tasks = settings.tasks.clone();
        env.add_filter("model_name", move |state: &State, model: &str| {
            let english = state
                .lookup("lang")
                .and_then(|lang| lang.as_str().and_then(Lang::parse))
                == Some(Lang::En);
            tasks.model_name_in(model, english)
        });
        // One clock: in the reader's zone, or the platform's named (see `reader_zone`).
        env.add_filter("localtime", move |state: &State, value: Value| {
            let (offset, label) = reader_zone(state, platform_offset);
            let text = local_time(&value, offset, "%Y-%m-%d %H:%M");
            match label {
                Some(label) if !text.is_empty() => format!("{text} ({label})"),
                _ => text,
            }
        });
        env.add_filter("localdate", move |state: &State, value: Value| {
            local_time(&value, reader_zone(state, platform_offset).0, "%Y-%m-%d")
        });
        Ok(Web {
            env,
            platform_offset,
            cookie_secure: settings.web.cookie_secure,
            trust_forwarded: settings.http.client_ip_from_forwarded,
        })
    }

    fn render(&self, name: &str, context: Value) -> Result<String, minijinja::Error> {
        self.env.get_template(name)?.render(context)
    }

    /// Whether the answer to `request` sets `Secure` cookies.
    pub fn secure_cookies(&self, request: &HttpRequest) -> bool {
        session::secure(request, self.cookie_secure, self.trust_forwarded)
    }

    /// Every built-in template, compiled (a test: a broken template fails the gate, not a page).
    pub fn check_templates(&self) -> Result<(), minijinja::Error> {
        for (name, _) in TEMPLATES {
            self.env.get_template(name)?;
        }
        Ok(())
    }
}

/// `t("key", name=value, ...)`: the page language's text of `key` (the language is the
/// template context's `lang`).
fn translate(state: &State, key: &str, arguments: Kwargs) -> Result<String, minijinja::Error> {
    let lang = state
        .lookup("lang")
        .and_then(|lang| lang.as_str().and_then(Lang::parse))
        .unwrap_or(Lang::Zh);
    let mut filled = Vec::new();
    for name in arguments.args() {
        let value: Value = arguments.get(name)?;
        filled.push((name, value.to_string()));
    }
    arguments.assert_all_used()?;
    Ok(lang.text(key, &filled))
}

/// An RFC 3339 time shown at the platform's UTC offset (the day check-ins count by).
/// The zone a page draws its times in: the one the reader's browser told (`tz_offset` in the
/// context), else the platform's, with its name to show beside each time so that it cannot be
/// read as the reader's own.
fn reader_zone(state: &State, platform_offset: i32) -> (i32, Option<String>) {
    match state
        .lookup("tz_offset")
        .and_then(|value| i32::try_from(value).ok())
    {
        Some(minutes) => (minutes, None),
        None => (platform_offset, Some(zone_label(platform_offset))),
    }
}

/// `UTC+8`, `UTC-5`, `UTC+5:30`.
pub fn zone_label(minutes: i32) -> String {
    let sign = if minutes < 0 { '-' } else { '+' };
    let (hours, rest) = (minutes.unsigned_abs() / 60, minutes.unsigned_abs() % 60);
    if rest == 0 {
        format!("UTC{sign}{hours}")
    } else {
        format!("UTC{sign}{hours}:{rest:02}")
    }
}

/// The zone the reader's browser told, in minutes east of UTC (the `tz` cookie the page's script
/// sets); none that no place on earth has.
fn browser_offset(request: &HttpRequest) -> Option<i32> {
    request
        .cookie(TZ_COOKIE)
        .and_then(|cookie| cookie.value().parse::<i32>().ok())
        .filter(|minutes| (-12 * 60..=14 * 60).contains(minutes))
}

/// Set by the page's script: the browser's offset from UTC in minutes east.
const TZ_COOKIE: &str = "tz";

fn local_time(value: &Value, offset_minutes: i32, format: &str) -> String {
    let Some(text) = value.as_str() else {
        return String::new();
    };
    let Ok(at) = chrono::DateTime::parse_from_rfc3339(text) else {
        return text.to_owned();
    };
    let offset = chrono::FixedOffset::east_opt(offset_minutes * 60)
        .unwrap_or_else(|| chrono::FixedOffset::east_opt(0).unwrap_or_else(|| unreachable!()));
    at.with_timezone(&offset).format(format).to_string()
}

/// A refusal or a failure, as the browser gets it: a page, or a redirect to sign in.
#[derive(Debug)]
pub struct WebError {
    status: StatusCode,
    body: String,
    location: Option<String>,
    htmx: bool,
    /// A failure made where the reader is unknown (a conversion): its page is written in the
    /// reader's language by [`translate_failures`], saying this catalog key.
    translate: Option<&'static str>,
    retry_after_s: Option<u64>,
}

/// The mark of an answer [`translate_failures`] writes again in the reader's language.
#[derive(Clone, Copy, Debug)]
struct Untranslated(&'static str);

impl std::fmt::Display for WebError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.status)
    }
}

impl ResponseError for WebError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        if let Some(location) = &self.location {
            // htmx follows `HX-Redirect` (a swap would put a login page inside a card).
            if self.htmx {
                return HttpResponse::Ok()
                    .insert_header(("HX-Redirect", location.as_str()))
                    .finish();
            }
            return HttpResponse::SeeOther()
                .insert_header((actix_web::http::header::LOCATION, location.as_str()))
                .finish();
        }
        let mut response = HttpResponse::build(self.status);
        response.content_type("text/html; charset=utf-8");
        if let Some(seconds) = self.retry_after_s {
            response.insert_header((actix_web::http::header::RETRY_AFTER, seconds.to_string()));
        }
        let mut response = response.body(self.body.clone());
        if let Some(key) = self.translate {
            response.extensions_mut().insert(Untranslated(key));
        }
        response
    }
}

/// A failure of ours or of a store, as a page: a store failing over or restarting is a 503 to
/// retry (with `Retry-After`), never a 500; what is left is our bug, logged here.
impl From<ApiError> for WebError {
    fn from(error: ApiError) -> WebError {
        let (status, key, retry_after_s) = match error {
            ApiError::Unavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "error.unavailable",
                Some(crate::http::problem::UNAVAILABLE_RETRY_AFTER_S),
            ),
            ApiError::Overdue { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "error.overdue",
                Some(crate::http::problem::UNAVAILABLE_RETRY_AFTER_S),
            ),
            ApiError::TooManyRequests { retry_after_s, .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "error.too_many",
                Some(retry_after_s),
            ),
            ApiError::Unexpected(error) => match ApiError::from(error) {
                // Made unexpected before its cause was looked at: a store away stays a 503.
                classified @ (ApiError::Unavailable { .. } | ApiError::TooManyRequests { .. }) => {
                    return WebError::from(classified);
                }
                ApiError::Unexpected(error) => {
                    tracing::error!(error = %crate::platform::telemetry::error_chain(&error), "a page failed");
                    (StatusCode::INTERNAL_SERVER_ERROR, "error.unexpected", None)
                }
                other => return WebError::from(other),
            },
            other => {
                tracing::error!(error = %other, "a page failed on a refusal it did not expect");
                (StatusCode::INTERNAL_SERVER_ERROR, "error.unexpected", None)
            }
        };
        WebError {
            status,
            // Written again in the reader's language by `translate_failures`; this stands only
            // if that cannot be done.
            body: format!(
                "<!doctype html><title>{}</title><p>Please try again later / 请稍后再试</p>",
                status.as_u16()
            ),
            location: None,
            htmx: false,
            translate: Some(key),
            retry_after_s,
        }
    }
}

impl From<anyhow::Error> for WebError {
    fn from(error: anyhow::Error) -> WebError {
        WebError::from(ApiError::from(error))
    }
}

impl From<minijinja::Error> for WebError {
    fn from(error: minijinja::Error) -> WebError {
        WebError::from(anyhow::Error::new(error).context("rendering a template"))
    }
}

/// A request's reader: language, session (if signed in), and how to answer them.
pub struct Page {
    pub request: HttpRequest,
    pub lang: Lang,
    pub member: Option<Member>,
    pub state: web::Data<AppState>,
    web: web::Data<Web>,
}

impl FromRequest for Page {
    type Error = WebError;
    type Future = Pin<Box<dyn Future<Output = Result<Page, WebError>>>>;

    fn from_request(request: &HttpRequest, _payload: &mut Payload) -> Self::Future {
        let request = request.clone();
        Box::pin(async move {
            let state = request
                .app_data::<web::Data<AppState>>()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("AppState is not registered"))?;
            let web = request
                .app_data::<web::Data<Web>>()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("the web app is not registered"))?;
            let lang = Lang::of_request(&request);
            let member = session::member_of(&state, &request).await?;
            let page = Page {
                request,
                lang,
                member,
                state,
                web,
            };
            let unsafe_method = !matches!(
                *page.request.method(),
                actix_web::http::Method::GET | actix_web::http::Method::HEAD
            );
            if unsafe_method {
                if session::from_another_site(&page.request) {
                    return Err(page.refusal(StatusCode::FORBIDDEN, "error.another_site"));
                }
                if let Some(member) = &page.member
                    && !session::csrf_presented(&page.request, member)
                {
                    return Err(page.refusal(StatusCode::FORBIDDEN, "error.csrf"));
                }
            }
            Ok(page)
        })
    }
}

impl Page {
    pub fn state(&self) -> &AppState {
        &self.state
    }

    pub fn web(&self) -> &Web {
        &self.web
    }

    /// The text of `key` in the reader's language.
    pub fn t(&self, key: &str, arguments: &[(&str, String)]) -> String {
        self.lang.text(key, arguments)
    }

    /// A request htmx made (it wants a fragment).
    pub fn is_htmx(&self) -> bool {
        self.request.headers().contains_key("hx-request")
    }

    /// The signed-in reader, or a redirect to sign in (and back here after).
    pub fn member(&self) -> Result<&Member, WebError> {
        self.member.as_ref().ok_or_else(|| {
            // After signing in, back to the page the reader was on: the address itself for a
            // GET, its query too (the task to publish, the work to make one like, a filter),
            // the page that sent a form otherwise (our own pages send `Referer` to us).
            let address = self
                .request
                .uri()
                .path_and_query()
                .map_or_else(|| self.request.path().to_owned(), |whole| whole.to_string());
            let referring = referring_page(&self.request);
            let next = if self.request.method() == actix_web::http::Method::GET {
                address.as_str()
            } else {
                referring.as_deref().unwrap_or("/generate")
            };
            WebError {
                status: StatusCode::SEE_OTHER,
                body: String::new(),
                location: Some(format!("/login?next={}", encode_path(next))),
                htmx: self.is_htmx(),
                translate: None,
                retry_after_s: None,
            }
        })
    }

    /// The signed-in admin; a plain 403 page for anyone else signed in.
    pub fn admin(&self) -> Result<&Member, WebError> {
        let member = self.member()?;
        if member.is_admin() {
            Ok(member)
        } else {
            Err(self.refusal(StatusCode::FORBIDDEN, "error.admin_only"))
        }
    }

    /// A plain error page saying `key`'s text.
    pub fn refusal(&self, status: StatusCode, key: &str) -> WebError {
        let context = context! {
            ..self.base_context(),
            ..context! { status => status.as_u16(), message => self.t(key, &[]) }
        };
        match self.web.render("error.html", context) {
            Ok(body) => WebError {
                status,
                body,
                location: None,
                htmx: false,
                translate: None,
                retry_after_s: None,
            },
            Err(error) => WebError::from(error),
        }
    }

    /// A refusal into a form's message area (`target`), in the reader's words; a store away or
    /// our bug is the error page instead (503 with `Retry-After`, or 500).
    pub fn refused(&self, target: &str, error: ApiError) -> Result<HttpResponse, WebError> {
        if matches!(
            error,
            ApiError::Unexpected(_) | ApiError::Unavailable { .. }
        ) {
            return Err(WebError::from(error));
        }
        self.alert(target, "error", &self.message_of(&error))
    }

    /// An API error in the reader's words (see `Lang::message_of`).
    pub fn message_of(&self, error: &ApiError) -> String {
        self.lang.message_of(error)
    }

    /// `field` broke `broken`, said in the reader's language (see `Lang::field_message`).
    pub fn field_message(&self, field: &str, broken: &Broken) -> String {
        self.lang.field_message(field, broken)
    }

    /// Several fields' messages in one line.
    pub fn fields_message<'a>(
        &self,
        fields: impl IntoIterator<Item = (&'a str, &'a Broken)>,
    ) -> String {
        self.lang.fields_message(fields)
    }

    /// The reader's offset from UTC in minutes east: their browser's, else the platform's (the
    /// zone every time on the page is drawn in, and a form's local times are read in).
    pub fn reader_offset_minutes(&self) -> i32 {
        browser_offset(&self.request).unwrap_or(self.web.platform_offset)
    }

    /// An unexpected API error becomes the 500 page; any other is the caller's to show.
    pub fn unexpected(&self, error: ApiError) -> WebError {
        WebError::from(error)
    }

    /// What every template gets: the language, the reader, the CSRF token, where they are.
    fn base_context(&self) -> Value {
        let member = self.member.as_ref();
        let browser = browser_offset(&self.request);
        let other = match self.lang {
            Lang::Zh => Lang::En,
            Lang::En => Lang::Zh,
        };
        // Signing in or up from the header goes back to this page; from the login or sign-up
        // page itself, on to where that page was going.
        let path = self.request.path();
        let auth_next = if path == "/login" || path == "/register" {
            let next = web::Query::<NextParam>::from_query(self.request.query_string())
                .ok()
                .and_then(|query| query.into_inner().next);
            encode_path(&safe_next(next.as_deref()))
        } else {
            encode_path(&self.request.uri().to_string())
        };
        context! {
            lang => self.lang.code(),
            lang_tag => self.lang.tag(),
            other_lang => other.code(),
            path => path,
            return_to => encode_path(&self.request.uri().to_string()),
            auth_next,
            signed_in => member.is_some(),
            is_admin => member.is_some_and(Member::is_admin),
            csrf => member.map(Member::csrf),
            tz_offset => browser,
            page_offset => browser.unwrap_or(self.web.platform_offset),
            zone_label => browser.is_none().then(|| zone_label(self.web.platform_offset)),
        }
    }

    /// A whole page: `template` with the base context and, when signed in, the reader's name
    /// and balance for the header.
    pub async fn render(&self, template: &str, context: Value) -> Result<HttpResponse, WebError> {
        let mut header = context! {};
        if let Some(member) = &self.member {
            let user_id = member.session.user_id;
            let user = self.state.users.get(user_id).await?;
            let name = user.as_ref().map_or_else(String::new, display_name);
            let balance = crate::http::accounts::balance_of(&self.state, user_id)
                .await
                .map_err(|error| self.unexpected(error))?;
            header = context! {
                me => context! { name, user_id => user_id.to_string() },
                balance => ser(&balance),
            };
        }
        let full = context! { ..self.base_context(), ..header, ..context };
        let body = self.web.render(template, full)?;
        Ok(html(StatusCode::OK, body))
    }

    /// A fragment for htmx to swap in (no header parts).
    pub fn fragment(&self, template: &str, context: Value) -> Result<HttpResponse, WebError> {
        let full = context! { ..self.base_context(), ..context };
        let body = self.web.render(template, full)?;
        Ok(html(StatusCode::OK, body))
    }

    /// An alert for htmx to put into the form's message area (`target`), in place of what the
    /// form would have swapped.
    pub fn alert(&self, target: &str, kind: &str, message: &str) -> Result<HttpResponse, WebError> {
        self.alert_with(target, kind, message, false)
    }

    /// [`Page::alert`] for a shortfall of points: followed by the links to where points are
    /// earned (check in, a code, a flash sale).
    pub fn alert_short_of_points(
        &self,
        target: &str,
        message: &str,
    ) -> Result<HttpResponse, WebError> {
        self.alert_with(target, "error", message, true)
    }

    fn alert_with(
        &self,
        target: &str,
        kind: &str,
        message: &str,
        earn: bool,
    ) -> Result<HttpResponse, WebError> {
        let body = self.web.render(
            "_alert.html",
            context! { ..self.base_context(), ..context! { kind, message, earn } },
        )?;
        Ok(HttpResponse::Ok()
            .content_type("text/html; charset=utf-8")
            .insert_header(("HX-Retarget", target))
            .insert_header(("HX-Reswap", "innerHTML"))
            .body(body))
    }

    /// To `path` after an action: htmx follows `HX-Redirect`, a plain form a 303.
    pub fn redirect(&self, path: &str) -> HttpResponse {
        if self.is_htmx() {
            HttpResponse::Ok()
                .insert_header(("HX-Redirect", path))
                .finish()
        } else {
            Page::see_other(path)
        }
    }

    /// After a form without htmx: back to `path`.
    pub fn see_other(path: &str) -> HttpResponse {
        HttpResponse::SeeOther()
            .insert_header((actix_web::http::header::LOCATION, path))
            .finish()
    }
}

#[derive(serde::Deserialize)]
struct NextParam {
    next: Option<String>,
}

/// A serializable view (the API's own DTOs) as a template value.
pub fn ser<T: serde::Serialize + ?Sized>(value: &T) -> Value {
    Value::from(minijinja::value::Serde(value))
}

fn html(status: StatusCode, body: String) -> HttpResponse {
    HttpResponse::build(status)
        .content_type("text/html; charset=utf-8")
        .body(body)
}

/// How a user is named on their own pages: the display name they chose, else
/// [`account_name`].
pub fn display_name(user: &zhihui_domain::user::RegisteredUser) -> String {
    match &user.display_name {
        Some(name) => name.as_str().to_owned(),
        None => account_name(user),
    }
}

/// The account as its credentials name it (what admins look for; a display name is anyone's
/// to choose): the username, else the phone with its middle hidden.
pub fn account_name(user: &zhihui_domain::user::RegisteredUser) -> String {
    if let Some(name) = &user.username {
        return name.as_str().to_owned();
    }
    user.phone.as_ref().map_or_else(String::new, |phone| {
        let digits = phone.to_string();
        let count = digits.chars().count();
        digits
            .chars()
            .enumerate()
            .map(|(index, c)| {
                if index >= count.saturating_sub(8) && index < count.saturating_sub(4) {
                    '*'
                } else {
                    c
                }
            })
            .collect()
    })
}

/// A same-site path for `next=`: only a path of ours (no scheme, no host), percent-encoded.
pub fn encode_path(path: &str) -> String {
    let path = if path.starts_with('/') && !path.starts_with("//") {
        path
    } else {
        "/"
    };
    let mut out = String::with_capacity(path.len());
    for byte in path.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(char::from(byte));
            }
            other => out.push_str(&format!("%{other:02X}")),
        }
    }
    out
}

/// `next=` back to a path: decoded, and only a path of ours.
pub fn safe_next(next: Option<&str>) -> String {
    let Some(next) = next else {
        return "/generate".into();
    };
    let mut bytes = Vec::with_capacity(next.len());
    let raw = next.as_bytes();
    let mut index = 0;
    while index < raw.len() {
        let hex = |byte: u8| char::from(byte).to_digit(16);
        match (raw[index], raw.get(index + 1), raw.get(index + 2)) {
            (b'%', Some(high), Some(low)) if hex(*high).is_some() && hex(*low).is_some() => {
                let value = hex(*high).unwrap_or(0) * 16 + hex(*low).unwrap_or(0);
                bytes.push(u8::try_from(value).unwrap_or(b'/'));
                index += 3;
            }
            (byte, _, _) => {
                bytes.push(byte);
                index += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&bytes).into_owned();
    let ours = decoded.starts_with('/')
        && !decoded.starts_with("//")
        && !decoded.contains('\\')
        && !decoded.chars().any(char::is_control);
    if ours && !decoded.starts_with("/login") && !decoded.starts_with("/register") {
        decoded
    } else {
        "/generate".into()
    }
}

/// The path and query of the page of ours that sent `request` (its `Referer`, when it names
/// this site), for going back to it.
fn referring_page(request: &HttpRequest) -> Option<String> {
    let referer = request
        .headers()
        .get(actix_web::http::header::REFERER)?
        .to_str()
        .ok()?;
    let url = url::Url::parse(referer).ok()?;
    let host = match url.port() {
        Some(port) => format!("{}:{port}", url.host_str()?),
        None => url.host_str()?.to_owned(),
    };
    if host != request.connection_info().host() {
        return None;
    }
    let back = match url.query() {
        Some(query) => format!("{}?{query}", url.path()),
        None => url.path().to_owned(),
    };
    (back.starts_with('/') && !back.starts_with("//") && !back.starts_with("/login"))
        .then_some(back)
}

/// Whether a request asks for a page (a browser's navigation), not data: it accepts HTML and is
/// not addressed to the API.
pub fn wants_page(request: &HttpRequest) -> bool {
    !request.path().starts_with("/api/")
        && request
            .headers()
            .get(actix_web::http::header::ACCEPT)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|accept| accept.contains("text/html"))
}

/// The failure page saying `key`, in the reader's language and with the site's navigation; the
/// reader's session is looked up when the store that keeps it answers (it may be what failed).
pub async fn failure_page(request: &HttpRequest, status: StatusCode, key: &str) -> Option<String> {
    let state = request.app_data::<web::Data<AppState>>()?.clone();
    let web = request.app_data::<web::Data<Web>>()?.clone();
    let member = session::member_of(&state, request).await.ok().flatten();
    let page = Page {
        request: request.clone(),
        lang: Lang::of_request(request),
        member,
        state,
        web,
    };
    let context = context! {
        ..page.base_context(),
        ..context! { status => status.as_u16(), message => page.t(key, &[]) }
    };
    page.web.render("error.html", context).ok()
}

/// Answers marked [`Untranslated`] (failures converted where the reader was unknown) written
/// again as the failure page in the reader's language, status and headers kept. So are the
/// API's problems that a page's address met before its handler ran (a query or a path it
/// cannot read, e.g. `/gallery/publish` without its task): a page never answers JSON.
pub async fn translate_failures(
    request: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<actix_web::dev::ServiceResponse<actix_web::body::BoxBody>, actix_web::Error> {
    let page = !request.path().starts_with("/api/")
        && !matches!(request.path(), "/health" | "/ready" | "/metrics");
    let mut response = next.call(request).await?.map_into_boxed_body();
    let marked = response
        .response()
        .extensions()
        .get::<Untranslated>()
        .map(|Untranslated(key)| *key);
    let met_before_the_page = || {
        let error = response.response().error()?.as_error::<ApiError>()?;
        match error {
            ApiError::Validation { field, .. } if field == "form" => Some("error.bad_form"),
            ApiError::Refused {
                rule: "body-too-large",
                ..
            } => Some("error.too_large_page"),
            ApiError::Validation { .. } => Some("error.bad_address"),
            ApiError::NotFound(_) => Some("error.not_found"),
            _ => None,
        }
    };
    let Some(key) = marked.or_else(|| page.then(met_before_the_page).flatten()) else {
        return Ok(response);
    };
    let status = response.status();
    let Some(body) = failure_page(response.request(), status, key).await else {
        return Ok(response);
    };
    response.headers_mut().insert(
        actix_web::http::header::CONTENT_TYPE,
        actix_web::http::header::HeaderValue::from_static("text/html; charset=utf-8"),
    );
    response
        .headers_mut()
        .remove(actix_web::http::header::CONTENT_LENGTH);
    Ok(response.map_body(|_, _| actix_web::body::BoxBody::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_template_compiles() {
        let settings = Settings::load(None).expect("default settings");
        let web = Web::new(&settings).expect("the web app builds");
        web.check_templates().expect("every template compiles");
    }

    #[test]
    fn a_page_failure_made_unexpected_before_its_cause_was_read_is_still_a_503_when_a_store_is_away()
     {
        let away = anyhow::Error::new(crate::platform::event_store::EventStoreError::Unavailable(
            anyhow::anyhow!("connection closed"),
        ));
        let page = WebError::from(ApiError::Unexpected(away));
        assert_eq!(page.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            page.retry_after_s,
            Some(crate::http::problem::UNAVAILABLE_RETRY_AFTER_S)
        );
        let bug = WebError::from(ApiError::Unexpected(anyhow::anyhow!("a bug")));
        assert_eq!(bug.status, StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn next_is_only_ever_a_path_of_ours() {
        assert_eq!(safe_next(Some("/history?page=2")), "/history?page=2");
        assert_eq!(safe_next(Some("%2Fpoints")), "/points");
        for hostile in [
            "//evil.example/",
            "https://evil.example/",
            "/\\evil.example",
            "%2F%2Fevil.example",
            "/login",
            "javascript:alert(1)",
        ] {
            assert_eq!(safe_next(Some(hostile)), "/generate", "{hostile}");
        }
        assert_eq!(safe_next(None), "/generate");
        assert_eq!(
            encode_path("/history?status=failed&x=中"),
            "/history%3Fstatus%3Dfailed%26x%3D%E4%B8%AD"
        );
    }
}
