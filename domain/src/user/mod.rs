//! Users: who may log in, with which credentials, and with which role.
//!
//! One stream per user (`user-<id>`). Credentials are a username with an argon2id password hash,
//! a phone number, or both. The hash is computed by the application (it needs random salt) and
//! enters the domain as an opaque [`PasswordHash`] whose `Debug` never shows it.
//!
//! Uniqueness of usernames and phone numbers spans users, so it is not this aggregate's job: see
//! [`crate::claim`].

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Decider;
use crate::api_key::{ACTIVE_KEYS_MAX, KEY_NAME_LENGTH_MAX, Scope};
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};

/// Characters of a display name, at most.
pub const DISPLAY_NAME_LENGTH_MAX: usize = 20;
/// Times a user may change their display name within [`RENAME_WINDOW_HOURS`]: enough to mend a
/// typo or two, not enough to pass for a different person every minute (every change drops the
/// gallery's cached pages on every process).
pub const RENAMES_PER_WINDOW_MAX: usize = 5;
pub const RENAME_WINDOW_HOURS: i64 = 24;

pub use crate::identity::{
    InvalidIdentifier, PHONE_DIGITS_MAX, PHONE_DIGITS_MIN, PasswordHash, PhoneNumber,
    USERNAME_LENGTH_MAX, USERNAME_LENGTH_MIN, UserId, Username,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Admin,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Admin => "admin",
        }
    }
}

/// A registered user as folded from its stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredUser {
    pub user_id: UserId,
    pub username: Option<Username>,
    pub phone: Option<PhoneNumber>,
    pub password_hash: Option<PasswordHash>,
    pub role: Role,
    pub registered_at: DateTime<Utc>,
    /// Every key ever made, revoked ones included (the audit names them).
    pub api_keys: Vec<ApiKey>,
    /// The name the gallery shows, when the user chose one.
    pub display_name: Option<DisplayName>,
    /// When the display name was changed, the latest [`RENAMES_PER_WINDOW_MAX`] times.
    pub renamed_at: Vec<DateTime<Utc>>,
}

/// The name a user shows others (works, likes, their page), in any language: one line, 1 to
/// [`DISPLAY_NAME_LENGTH_MAX`] characters, never `#` (the gallery names a user without a username
/// `user#` and ten hex digits: nobody may take a name that passes for another user's).
/// Not unique: a user's page shows their username or that short id beside it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DisplayName(String);

impl DisplayName {
    pub fn parse(raw: &str) -> Result<DisplayName, crate::text::InvalidText> {
        let name = crate::text::checked_text(raw, 1, DISPLAY_NAME_LENGTH_MAX, false)?;
        if name.contains('#') {
            return Err(crate::text::InvalidText(
                crate::rule::Broken::new(crate::rule::Rule::NotContain).with("character", "#"),
            ));
        }
        Ok(DisplayName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for DisplayName {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// An API key as the user's stream knows it (never the key itself: its digest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKey {
    pub key_id: Uuid,
    pub name: String,
    pub scopes: Vec<Scope>,
    /// SHA-256 of the key, hex.
    pub digest: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// Requests a minute the key may make.
    pub requests_per_minute: u32,
}

impl ApiKey {
    /// Usable at `now`: not revoked, not expired.
    pub fn is_active(&self, now: DateTime<Utc>) -> bool {
        self.revoked_at.is_none() && self.expires_at.is_none_or(|expires_at| now < expires_at)
    }
}

impl RegisteredUser {
    /// The key whose digest is `digest`.
    pub fn api_key(&self, digest: &str) -> Option<&ApiKey> {
        self.api_keys.iter().find(|key| key.digest == digest)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserState {
    Unregistered,
    Registered(RegisteredUser),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserCommand {
    /// Create the user. Needs a username with a password hash, or a phone number.
    Register {
        user_id: UserId,
        username: Option<Username>,
        password_hash: Option<PasswordHash>,
        phone: Option<PhoneNumber>,
        role: Role,
        at: DateTime<Utc>,
    },
    ChangePassword {
        password_hash: PasswordHash,
        at: DateTime<Utc>,
    },
    ChangeRole {
        role: Role,
        at: DateTime<Utc>,
    },
    BindPhone {
        phone: PhoneNumber,
        at: DateTime<Utc>,
    },
    /// Record a new API key (the application made it and shows it once; the stream keeps its
    /// digest). The same id with the same digest again is done already.
    CreateApiKey {
        key_id: Uuid,
        name: String,
        scopes: Vec<Scope>,
        digest: String,
        expires_at: Option<DateTime<Utc>>,
        requests_per_minute: u32,
        at: DateTime<Utc>,
    },
    RevokeApiKey {
        key_id: Uuid,
        at: DateTime<Utc>,
    },
    /// Give a user who signed up with a phone a username and a password, to log in with them
    /// too. The same username again is done already; a user who has one keeps it.
    SetUsername {
        username: Username,
        password_hash: PasswordHash,
        at: DateTime<Utc>,
    },
    /// Choose the name others see (`None`: none, the username or short id again). The same
    /// name again is done already.
    SetDisplayName {
        name: Option<DisplayName>,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRegistered {
    pub user_id: UserId,
    pub username: Option<Username>,
    pub password_hash: Option<PasswordHash>,
    pub phone: Option<PhoneNumber>,
    pub role: Role,
    pub registered_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PasswordChanged {
    pub password_hash: PasswordHash,
    pub changed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleChanged {
    pub role: Role,
    pub changed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsernameSet {
    pub username: Username,
    pub password_hash: PasswordHash,
    pub set_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisplayNameSet {
    /// `None`: the name was taken away.
    pub name: Option<DisplayName>,
    pub set_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhoneBound {
    pub phone: PhoneNumber,
    pub bound_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserEvent {
    Registered(UserRegistered),
    PasswordChanged(PasswordChanged),
    RoleChanged(RoleChanged),
    PhoneBound(PhoneBound),
    ApiKeyCreated(ApiKeyCreated),
    ApiKeyRevoked(ApiKeyRevoked),
    DisplayNameSet(DisplayNameSet),
    UsernameSet(UsernameSet),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKeyCreated {
    pub key_id: Uuid,
    pub name: String,
    pub scopes: Vec<Scope>,
    pub digest: String,
    pub expires_at: Option<DateTime<Utc>>,
    pub requests_per_minute: u32,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKeyRevoked {
    pub key_id: Uuid,
    pub revoked_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    #[error("user {0} is already registered")]
    AlreadyRegistered(UserId),
    #[error("no such user")]
    NotRegistered,
    #[error("a user needs a username with a password, or a phone number")]
    NoCredentials,
    #[error("a username needs a password, and a password needs a username")]
    UsernameWithoutPassword,
    #[error("this user has no username, so it cannot have a password")]
    PasswordWithoutUsername,
    #[error("another phone number ({bound}) is already bound to this user")]
    PhoneAlreadyBound { bound: PhoneNumber },
    #[error("name: a key's name is 1 to {KEY_NAME_LENGTH_MAX} characters")]
    InvalidKeyName,
    #[error("name: a key's name is one line of text, without control characters")]
    KeyNameNotOneLine,
    #[error("scopes: a key needs at least one scope")]
    NoScopes,
    #[error("scopes: only an admin's key may hold the admin scope")]
    AdminScopeForbidden,
    #[error("this user has {ACTIVE_KEYS_MAX} keys in use, the most: revoke one first")]
    TooManyKeys,
    #[error("expires_at: a key must expire in the future")]
    ExpiryInPast,
    #[error("requests_per_minute: must be at least 1")]
    NoRequests,
    #[error("no such key")]
    KeyNotFound,
    #[error("key {0} exists with other contents")]
    KeyIdTaken(Uuid),
    #[error(
        "the display name was changed {RENAMES_PER_WINDOW_MAX} times in {RENAME_WINDOW_HOURS} hours, the most; it can change again at {again_at}"
    )]
    RenamedTooOften { again_at: DateTime<Utc> },
    #[error("this user already has the username {username}; it cannot change")]
    UsernameAlreadySet { username: Username },
}

#[derive(Debug)]
pub struct User;

impl Decider for User {
    type State = UserState;
    type Command = UserCommand;
    type Event = UserEvent;
    type Error = UserError;

    fn initial_state() -> UserState {
        UserState::Unregistered
    }

    fn decide(state: &UserState, command: &UserCommand) -> Result<Vec<UserEvent>, UserError> {
        match (state, command) {
            (
                UserState::Unregistered,
                UserCommand::Register {
                    user_id,
                    username,
                    password_hash,
                    phone,
                    role,
                    at,
                },
            ) => {
                if username.is_some() != password_hash.is_some() {
                    return Err(UserError::UsernameWithoutPassword);
                }
                if username.is_none() && phone.is_none() {
                    return Err(UserError::NoCredentials);
                }
                Ok(vec![UserEvent::Registered(UserRegistered {
                    user_id: *user_id,
                    username: username.clone(),
                    password_hash: password_hash.clone(),
                    phone: phone.clone(),
                    role: *role,
                    registered_at: *at,
                })])
            }
            (UserState::Registered(user), UserCommand::Register { .. }) => {
                Err(UserError::AlreadyRegistered(user.user_id))
            }
            (UserState::Unregistered, _) => Err(UserError::NotRegistered),
            (UserState::Registered(user), UserCommand::ChangePassword { password_hash, at }) => {
                if user.username.is_none() {
                    return Err(UserError::PasswordWithoutUsername);
                }
                Ok(vec![UserEvent::PasswordChanged(PasswordChanged {
                    password_hash: password_hash.clone(),
                    changed_at: *at,
                })])
            }
            (UserState::Registered(user), UserCommand::ChangeRole { role, at }) => {
                if user.role == *role {
                    return Ok(vec![]);
                }
                Ok(vec![UserEvent::RoleChanged(RoleChanged {
                    role: *role,
                    changed_at: *at,
                })])
            }
            (
                UserState::Registered(user),
                UserCommand::CreateApiKey {
                    key_id,
                    name,
                    scopes,
                    digest,
                    expires_at,
                    requests_per_minute,
                    at,
                },
            ) => {
                if let Some(existing) = user.api_keys.iter().find(|key| key.key_id == *key_id) {
                    // A retried request: done already; anything else reusing the id is refused.
                    return if existing.digest == *digest {
                        Ok(vec![])
                    } else {
                        Err(UserError::KeyIdTaken(*key_id))
                    };
                }
                let name = name.trim();
                if crate::text::is_blank(name) || name.chars().count() > KEY_NAME_LENGTH_MAX {
                    return Err(UserError::InvalidKeyName);
                }
                if crate::text::refuse_controls(name, false).is_err() {
                    return Err(UserError::KeyNameNotOneLine);
                }
                if scopes.is_empty() {
                    return Err(UserError::NoScopes);
                }
                if scopes.contains(&Scope::Admin) && user.role != Role::Admin {
                    return Err(UserError::AdminScopeForbidden);
                }
                if expires_at.is_some_and(|expires_at| expires_at <= *at) {
                    return Err(UserError::ExpiryInPast);
                }
                if *requests_per_minute == 0 {
                    return Err(UserError::NoRequests);
                }
                if user
                    .api_keys
                    .iter()
                    .filter(|key| key.is_active(*at))
                    .count()
                    >= ACTIVE_KEYS_MAX
                {
                    return Err(UserError::TooManyKeys);
                }
                let mut scopes = scopes.clone();
                scopes.sort();
                scopes.dedup();
                Ok(vec![UserEvent::ApiKeyCreated(ApiKeyCreated {
                    key_id: *key_id,
                    name: name.to_owned(),
                    scopes,
                    digest: digest.clone(),
                    expires_at: *expires_at,
                    requests_per_minute: *requests_per_minute,
                    created_at: *at,
                })])
            }
            (UserState::Registered(user), UserCommand::RevokeApiKey { key_id, at }) => {
                let key = user
                    .api_keys
                    .iter()
                    .find(|key| key.key_id == *key_id)
                    .ok_or(UserError::KeyNotFound)?;
                if key.revoked_at.is_some() {
                    return Ok(vec![]);
                }
                Ok(vec![UserEvent::ApiKeyRevoked(ApiKeyRevoked {
                    key_id: *key_id,
                    revoked_at: *at,
                })])
            }
            (
                UserState::Registered(user),
                UserCommand::SetUsername {
                    username,
                    password_hash,
                    at,
                },
            ) => match &user.username {
                Some(held) if held == username => Ok(vec![]),
                Some(held) => Err(UserError::UsernameAlreadySet {
                    username: held.clone(),
                }),
                None => Ok(vec![UserEvent::UsernameSet(UsernameSet {
                    username: username.clone(),
                    password_hash: password_hash.clone(),
                    set_at: *at,
                })]),
            },
            (UserState::Registered(user), UserCommand::SetDisplayName { name, at }) => {
                if user.display_name == *name {
                    return Ok(vec![]);
                }
                let window = chrono::Duration::hours(RENAME_WINDOW_HOURS);
                let recent: Vec<&DateTime<Utc>> = user
                    .renamed_at
                    .iter()
                    .filter(|renamed_at| **renamed_at > *at - window)
                    .collect();
                if recent.len() >= RENAMES_PER_WINDOW_MAX
                    && let Some(oldest) = recent.iter().min()
                {
                    return Err(UserError::RenamedTooOften {
                        again_at: **oldest + window,
                    });
                }
                Ok(vec![UserEvent::DisplayNameSet(DisplayNameSet {
                    name: name.clone(),
                    set_at: *at,
                })])
            }
            (UserState::Registered(user), UserCommand::BindPhone { phone, at }) => {
                match &user.phone {
                    Some(bound) if bound == phone => Ok(vec![]),
                    Some(bound) => Err(UserError::PhoneAlreadyBound {
                        bound: bound.clone(),
                    }),
                    None => Ok(vec![UserEvent::PhoneBound(PhoneBound {
                        phone: phone.clone(),
                        bound_at: *at,
                    })]),
                }
            }
        }
    }

    fn evolve(state: UserState, event: &UserEvent) -> UserState {
        match (state, event) {
            (_, UserEvent::Registered(registered)) => UserState::Registered(RegisteredUser {
                user_id: registered.user_id,
                username: registered.username.clone(),
                phone: registered.phone.clone(),
                password_hash: registered.password_hash.clone(),
                role: registered.role,
                registered_at: registered.registered_at,
                api_keys: Vec::new(),
                display_name: None,
                renamed_at: Vec::new(),
            }),
            (UserState::Registered(mut user), UserEvent::UsernameSet(set)) => {
                user.username = Some(set.username.clone());
                user.password_hash = Some(set.password_hash.clone());
                UserState::Registered(user)
            }
            (UserState::Registered(mut user), UserEvent::DisplayNameSet(set)) => {
                user.display_name = set.name.clone();
                user.renamed_at.push(set.set_at);
                // Only the latest ones can refuse a change.
                if user.renamed_at.len() > RENAMES_PER_WINDOW_MAX {
                    user.renamed_at.remove(0);
                }
                UserState::Registered(user)
            }
            (UserState::Registered(mut user), UserEvent::PasswordChanged(changed)) => {
                user.password_hash = Some(changed.password_hash.clone());
                UserState::Registered(user)
            }
            (UserState::Registered(mut user), UserEvent::RoleChanged(changed)) => {
                user.role = changed.role;
                UserState::Registered(user)
            }
            (UserState::Registered(mut user), UserEvent::PhoneBound(bound)) => {
                user.phone = Some(bound.phone.clone());
                UserState::Registered(user)
            }
            // A stored fact about a user that was never registered cannot be produced by
            // `decide`; folding keeps the state rather than inventing a user.
            (UserState::Registered(mut user), UserEvent::ApiKeyCreated(created)) => {
                user.api_keys.push(ApiKey {
                    key_id: created.key_id,
                    name: created.name.clone(),
                    scopes: created.scopes.clone(),
                    digest: created.digest.clone(),
                    created_at: created.created_at,
                    expires_at: created.expires_at,
                    revoked_at: None,
                    requests_per_minute: created.requests_per_minute,
                });
                UserState::Registered(user)
            }
            (UserState::Registered(mut user), UserEvent::ApiKeyRevoked(revoked)) => {
                if let Some(key) = user
                    .api_keys
                    .iter_mut()
                    .find(|key| key.key_id == revoked.key_id)
                {
                    key.revoked_at = Some(revoked.revoked_at);
                }
                UserState::Registered(user)
            }
            (state @ UserState::Unregistered, _) => state,
        }
    }
}

impl DomainEvent for UserEvent {
    fn event_type(&self) -> &'static str {
        match self {
            UserEvent::Registered(_) => "UserRegistered",
            UserEvent::PasswordChanged(_) => "PasswordChanged",
            UserEvent::RoleChanged(_) => "RoleChanged",
            UserEvent::PhoneBound(_) => "PhoneBound",
            UserEvent::ApiKeyCreated(_) => "ApiKeyCreated",
            UserEvent::ApiKeyRevoked(_) => "ApiKeyRevoked",
            UserEvent::DisplayNameSet(_) => "DisplayNameSet",
            UserEvent::UsernameSet(_) => "UsernameSet",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            UserEvent::Registered(payload) => payload_of(payload),
            UserEvent::PasswordChanged(payload) => payload_of(payload),
            UserEvent::RoleChanged(payload) => payload_of(payload),
            UserEvent::PhoneBound(payload) => payload_of(payload),
            UserEvent::ApiKeyCreated(payload) => payload_of(payload),
            UserEvent::ApiKeyRevoked(payload) => payload_of(payload),
            UserEvent::DisplayNameSet(payload) => payload_of(payload),
            UserEvent::UsernameSet(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<UserEvent, DecodeError> {
        if !matches!(
            event_type,
            "UserRegistered"
                | "PasswordChanged"
                | "RoleChanged"
                | "PhoneBound"
                | "ApiKeyCreated"
                | "ApiKeyRevoked"
                | "DisplayNameSet"
                | "UsernameSet"
        ) {
            return Err(DecodeError::UnknownType {
                event_type: event_type.to_owned(),
            });
        }
        // Every user event is still at its first schema version: nothing to upcast yet.
        expect_version(event_type, schema_version, 1)?;
        Ok(match event_type {
            "UserRegistered" => UserEvent::Registered(parse_payload(event_type, payload)?),
            "PasswordChanged" => UserEvent::PasswordChanged(parse_payload(event_type, payload)?),
            "RoleChanged" => UserEvent::RoleChanged(parse_payload(event_type, payload)?),
            "PhoneBound" => UserEvent::PhoneBound(parse_payload(event_type, payload)?),
            "ApiKeyCreated" => UserEvent::ApiKeyCreated(parse_payload(event_type, payload)?),
            "ApiKeyRevoked" => UserEvent::ApiKeyRevoked(parse_payload(event_type, payload)?),
            "DisplayNameSet" => UserEvent::DisplayNameSet(parse_payload(event_type, payload)?),
            "UsernameSet" => UserEvent::UsernameSet(parse_payload(event_type, payload)?),
            other => {
                return Err(DecodeError::UnknownType {
                    event_type: other.to_owned(),
                });
            }
        })
    }
}

#[cfg(test)]
mod tests;
