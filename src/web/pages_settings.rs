//! The reader's own settings: who they are, their password, a phone to bind (to log in with a
//! code, also after forgetting the password), and their API keys (made here and shown once,
//! listed without the key, revoked on every instance at once). The same rules as the API: these
//! pages call its functions.

use actix_web::{HttpResponse, web};
use chrono::Duration;
use minijinja::context;
use minijinja::value::Value;
use serde::Deserialize;
use uuid::Uuid;
use zhihui_domain::api_key::Scope;

use super::pages_user::metadata;
use super::render::{Page, WebError, display_name, ser};
use crate::http::ApiError;
use crate::http::keys::{CreateKeyRequest, CreatedKey};

/// How long a key made here lasts: a choice of whole periods (the API takes any time).
const EXPIRY_DAYS: [u32; 3] = [30, 90, 365];

#[derive(Debug, Deserialize)]
pub struct SettingsQuery {
    /// Back from binding a phone: say so once.
    #[serde(default)]
    phone_bound: Option<String>,
    /// Back from setting a username: say so once.
    #[serde(default)]
    username_set: Option<String>,
    /// Back from changing the display name: say so once.
    #[serde(default)]
    renamed: Option<String>,
}

/// `GET /settings`.
pub async fn settings_page(
    page: Page,
    query: web::Query<SettingsQuery>,
) -> Result<HttpResponse, WebError> {
    let member = page.member()?;
    let user_id = member.session.user_id;
    let Some(user) = page.state().users.get(user_id).await? else {
        return Err(page.refusal(actix_web::http::StatusCode::NOT_FOUND, "error.not_found"));
    };
    let account = context! {
        name => display_name(&user),
        username => user.username.as_ref().map(|name| name.as_str().to_owned()),
        display_name => user.display_name.as_ref().map(ToString::to_string),
        phone => user.phone.as_ref().map(ToString::to_string),
        role => user.role.as_str(),
        registered_at => user.registered_at.to_rfc3339(),
        has_password => user.password_hash.is_some(),
    };
    let keys = keys_context(&page, None).await?;
    let phone_bound = query.phone_bound.is_some() && user.phone.is_some();
    let renamed = query.renamed.is_some();
    let username_set = query.username_set.is_some();
    page.render(
        "settings.html",
        context! { account, phone_bound, renamed, username_set, ..keys },
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct UsernameForm {
    #[serde(default)]
    username: String,
    #[serde(default)]
    password: String,
}

/// `POST /settings/username` (an account made with a phone code): the page again saying so;
/// refused, why, with the name typed kept (never the password).
pub async fn set_username(
    page: Page,
    form: web::Form<UsernameForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let form = form.into_inner();
    let request = crate::http::auth::RegisterRequest {
        username: form.username.clone(),
        password: form.password,
    };
    match crate::http::users::username_of(page.state(), user, &request, &metadata(&page)?).await {
        Ok(_) => Ok(page.redirect("/settings?username_set=1")),
        Err(error @ (ApiError::Unexpected(_) | ApiError::Unavailable { .. })) => {
            Err(WebError::from(error))
        }
        Err(error) => page.fragment(
            "_username_form.html",
            context! {
                username_value => form.username.trim(),
                username_message => page.message_of(&error),
            },
        ),
    }
}

#[derive(Debug, Deserialize)]
pub struct DisplayNameForm {
    #[serde(default)]
    display_name: String,
}

/// `POST /settings/display-name`: the page again saying so (the header shows the new name);
/// refused, why, with what was typed kept.
pub async fn set_display_name(
    page: Page,
    form: web::Form<DisplayNameForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    match crate::http::users::display_name_of(
        page.state(),
        user,
        &form.display_name,
        &metadata(&page)?,
    )
    .await
    {
        Ok(_) => Ok(page.redirect("/settings?renamed=1")),
        Err(error @ (ApiError::Unexpected(_) | ApiError::Unavailable { .. })) => {
            Err(WebError::from(error))
        }
        Err(error) => {
            let has_username = page
                .state()
                .users
                .get(user)
                .await?
                .is_some_and(|user| user.username.is_some());
            page.fragment(
                "_display_name_form.html",
                context! {
                    display_name_value => form.display_name.clone(),
                    display_name_message => page.message_of(&error),
                    has_username,
                },
            )
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct PhoneForm {
    phone: String,
    #[serde(default)]
    code: String,
}

/// The phone card again (htmx): the number typed kept, a message, the send button's wait, and
/// the code's field open once a code is on its way.
fn phone_card(
    page: &Page,
    phone: &str,
    message: (&str, String),
    resend_in: Option<u64>,
    code_ready: bool,
) -> Result<HttpResponse, WebError> {
    let (kind, text) = message;
    page.fragment(
        "_phone_card.html",
        context! {
            bind_phone => phone.trim(),
            phone_message => text,
            phone_message_kind => kind,
            resend_in,
            code_ready,
        },
    )
}

/// `POST /settings/phone/code` (htmx): a code sent to the phone to bind, then the card with the
/// field to type it in; refused, why (a send too soon counts down to the next).
pub async fn send_phone_code(
    page: Page,
    form: web::Form<PhoneForm>,
) -> Result<HttpResponse, WebError> {
    page.member()?;
    let sent = crate::http::auth::send_login_code(page.state(), &page.request, &form.phone).await;
    let resend_in = super::pages_auth::resend_in(&page, &sent);
    match sent {
        Ok(_) => {
            let message = page.t("login.code_sent", &[]);
            phone_card(&page, &form.phone, ("info", message), resend_in, true)
        }
        Err(error @ (ApiError::Unexpected(_) | ApiError::Unavailable { .. })) => {
            Err(WebError::from(error))
        }
        Err(error) => {
            let message = page.message_of(&error);
            // Too soon: a code sent a moment ago is still good.
            phone_card(
                &page,
                &form.phone,
                ("error", message),
                resend_in,
                resend_in.is_some(),
            )
        }
    }
}

/// `POST /settings/phone` (htmx): bound, the page again saying so; refused (a wrong or spent
/// code, a phone another account has), why, in the card.
pub async fn bind_phone(page: Page, form: web::Form<PhoneForm>) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let form = form.into_inner();
    let request = crate::http::users::BindPhoneRequest {
        phone: form.phone.clone(),
        code: form.code,
    };
    match crate::http::users::bind_phone_of(page.state(), user, &request, &metadata(&page)?).await {
        Ok(_) => Ok(page.redirect("/settings?phone_bound=1")),
        Err(error @ (ApiError::Unexpected(_) | ApiError::Unavailable { .. })) => {
            Err(WebError::from(error))
        }
        Err(error) => {
            let message = page.message_of(&error);
            phone_card(&page, &form.phone, ("error", message), None, true)
        }
    }
}

/// The keys' part of the page: the list, the form's choices, and a key just made (this once).
async fn keys_context(page: &Page, created: Option<&CreatedKey>) -> Result<Value, WebError> {
    let member = page.member()?;
    let keys = page.state().api_keys.list(member.session.user_id).await?;
    // The admin scope is an admin's only: nobody else is offered it.
    let scopes: Vec<&str> = Scope::ALL
        .iter()
        .filter(|scope| **scope != Scope::Admin || member.is_admin())
        .map(|scope| scope.as_str())
        .collect();
    Ok(context! {
        keys => ser(&keys),
        scopes,
        expiry_days => EXPIRY_DAYS,
        created => created.map(ser),
    })
}

#[derive(Debug, Default)]
struct KeyForm {
    name: String,
    scopes: Vec<String>,
    expires: String,
}

/// `POST /settings/keys` (htmx): the key, shown this once above the list; refused, why, with
/// what was typed kept in the form.
pub async fn create_key(page: Page, body: web::Bytes) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    // `serde_urlencoded` has no repeated fields (the scopes): read them by hand.
    let mut form = KeyForm::default();
    for (key, value) in url::form_urlencoded::parse(&body) {
        match &*key {
            "name" => form.name = value.into_owned(),
            "scope" => form.scopes.push(value.into_owned()),
            "expires" => form.expires = value.into_owned(),
            _ => {}
        }
    }
    let expires_at = match form.expires.as_str() {
        "" | "never" => None,
        days => match days.parse::<u32>() {
            Ok(days) if EXPIRY_DAYS.contains(&days) => {
                Some(page.state().clock.now() + Duration::days(i64::from(days)))
            }
            _ => {
                return page.refused(
                    "#key-messages",
                    ApiError::invalid_by("expires_at", zhihui_domain::rule::Rule::InFuture),
                );
            }
        },
    };
    let request = CreateKeyRequest {
        name: form.name,
        scopes: form.scopes,
        expires_at,
        requests_per_minute: None,
    };
    match crate::http::keys::create_key(page.state(), user, request, &metadata(&page)?).await {
        Ok(created) => {
            let context = keys_context(&page, Some(&created)).await?;
            page.fragment("_keys.html", context)
        }
        Err(error) => page.refused("#key-messages", error),
    }
}

/// `POST /settings/keys/{id}/revoke` (htmx): the list again without it.
pub async fn revoke_key(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let Ok(key_id) = Uuid::parse_str(&path) else {
        return page.refused("#key-messages", ApiError::NotFound("no such key".into()));
    };
    if let Err(error) =
        crate::http::keys::revoke_key(page.state(), user, key_id, &metadata(&page)?).await
    {
        return page.refused("#key-messages", error);
    }
    let context = keys_context(&page, None).await?;
    page.fragment("_keys.html", context)
}

#[derive(Debug, Deserialize)]
pub struct PasswordForm {
    current_password: String,
    new_password: String,
}

/// `POST /settings/password`: changed, every session ends, and the reader logs in again with
/// the new one (told so); refused, why.
pub async fn change_password(
    page: Page,
    form: web::Form<PasswordForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let form = form.into_inner();
    let request = crate::http::users::ChangePasswordRequest {
        current_password: form.current_password,
        new_password: form.new_password,
    };
    match crate::http::users::change_password_of(page.state(), user, &request, &metadata(&page)?)
        .await
    {
        Ok(()) => Ok(page.redirect("/login?changed=1&next=/settings")),
        Err(ApiError::Unauthorized { .. }) => page.alert(
            "#password-messages",
            "error",
            &page.t("settings.wrong_current", &[]),
        ),
        Err(error) => page.refused("#password-messages", error),
    }
}
