//! `users` (id, username, phone, role) from the user streams. Few and small events: one statement
//! each.

use anyhow::Context;
use zhihui_domain::DomainEvent;
use zhihui_domain::user::UserEvent;

use crate::{ProjectedEvent, Tables};

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let table = tables.name("users");
    for recorded in events {
        // `user-<uuid>` only; `user-name-*` and `user-phone-*` are claim streams.
        let Some(user_id) = recorded
            .stream
            .strip_prefix("user-")
            .and_then(|id| uuid::Uuid::parse_str(id).ok())
        else {
            continue;
        };
        let event = UserEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )
        .with_context(|| format!("event {} of {}", recorded.id, recorded.stream))?;
        let version = i64::try_from(recorded.stream_version)?;
        let at = recorded.recorded_at;
        match &event {
            UserEvent::Registered(e) => {
                let username = e.username.as_ref().map(|name| name.as_str().to_owned());
                let phone = e.phone.as_ref().map(|phone| phone.as_str().to_owned());
                let role = e.role.as_str();
                transaction
                    .execute(
                        &format!(
                            "INSERT INTO {table} (user_id, username, phone, role, registered_at,
                                                  stream_version, updated_at)
                             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (user_id) DO NOTHING"
                        ),
                        &[
                            &user_id,
                            &username,
                            &phone,
                            &role,
                            &e.registered_at,
                            &version,
                            &at,
                        ],
                    )
                    .await
                    .context("inserting a user")?;
            }
            // Every later event moves the version; a role change, a phone binding or a username
            // also sets its column (NULL keeps the current value).
            UserEvent::PasswordChanged(_)
            | UserEvent::RoleChanged(_)
            | UserEvent::PhoneBound(_)
            | UserEvent::ApiKeyCreated(_)
            | UserEvent::ApiKeyRevoked(_)
            | UserEvent::DisplayNameSet(_)
            | UserEvent::UsernameSet(_) => {
                let role = match &event {
                    UserEvent::RoleChanged(e) => Some(e.role.as_str()),
                    _ => None,
                };
                let phone = match &event {
                    UserEvent::PhoneBound(e) => Some(e.phone.as_str().to_owned()),
                    _ => None,
                };
                let username = match &event {
                    UserEvent::UsernameSet(e) => Some(e.username.as_str().to_owned()),
                    _ => None,
                };
                transaction
                    .execute(
                        &format!(
                            "UPDATE {table}
                                SET role = COALESCE($4, role), phone = COALESCE($5, phone),
                                    username = COALESCE($6, username),
                                    stream_version = $2, updated_at = $3
                              WHERE user_id = $1 AND stream_version < $2"
                        ),
                        &[&user_id, &version, &at, &role, &phone, &username],
                    )
                    .await
                    .context("recording a user change")?;
            }
        }
    }
    Ok(())
}
