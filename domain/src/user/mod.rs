//! Users: who may log in, with which credentials, and with which role.
//!
//! One stream per user (`user-<id>`). Credentials are a username with an argon2id password hash,
//! a phone number, or both. The hash is computed by the application (it needs random salt) and
//! enters the domain as an opaque [`PasswordHash`] whose `Debug` never shows it.
//!
//! Uniqueness of usernames and phone numbers spans users, so it is not this aggregate's job: see
//! [`crate::claim`].

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Decider;
use crate::api_key::{ACTIVE_KEYS_MAX, KEY_NAME_LENGTH_MAX, Scope};
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};

/// Shortest username. Two-letter names are too easy to confuse and to squat.
pub const USERNAME_LENGTH_MIN: usize = 3;
/// Longest username: fits a UI line and an audit table column.
pub const USERNAME_LENGTH_MAX: usize = 32;
/// E.164 allows at most 15 digits after the country code's `+`.
pub const PHONE_DIGITS_MAX: usize = 15;
/// Shorter numbers than this are service numbers, not phones that receive codes.
pub const PHONE_DIGITS_MIN: usize = 8;

/// A user's id: a UUIDv7 chosen by the application (time-ordered, not guessable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UserId(Uuid);

impl UserId {
    pub fn from_uuid(id: Uuid) -> UserId {
        UserId(id)
    }

    pub fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// The user's event stream.
    pub fn stream(&self) -> String {
        format!("user-{}", self.0)
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a username or phone number was refused. The message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidIdentifier(pub String);

/// A username: 3 to 32 characters, ASCII letters, digits, `_`, `-` or `.`, starting with a letter.
/// Stored lowercase, so `Alice` and `alice` are one name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Username(String);

impl Username {
    pub fn parse(raw: &str) -> Result<Username, InvalidIdentifier> {
        let name = raw.trim().to_ascii_lowercase();
        let length = name.chars().count();
        if !(USERNAME_LENGTH_MIN..=USERNAME_LENGTH_MAX).contains(&length) {
            return Err(InvalidIdentifier(format!(
                "must be {USERNAME_LENGTH_MIN} to {USERNAME_LENGTH_MAX} characters long"
            )));
        }
        if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
            return Err(InvalidIdentifier("must start with a letter".into()));
        }
        if let Some(bad) = name
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || "_-.".contains(*c)))
        {
            return Err(InvalidIdentifier(format!(
                "may only contain letters, digits, '_', '-' and '.', not {bad:?}"
            )));
        }
        Ok(Username(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Username {
    type Error = InvalidIdentifier;
    fn try_from(raw: String) -> Result<Username, InvalidIdentifier> {
        Username::parse(&raw)
    }
}

impl From<Username> for String {
    fn from(name: Username) -> String {
        name.0
    }
}

impl fmt::Display for Username {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A phone number in E.164 form (`+` and 8 to 15 digits). Spaces and dashes are dropped; an
/// 11-digit mainland China mobile number without a country code (`13800138000`) becomes `+86...`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PhoneNumber(String);

impl PhoneNumber {
    pub fn parse(raw: &str) -> Result<PhoneNumber, InvalidIdentifier> {
        let compact: String = raw
            .chars()
            .filter(|c| !matches!(c, ' ' | '-' | '(' | ')'))
            .collect();
        let (digits, national_cn) = match compact.strip_prefix('+') {
            Some(digits) => (digits.to_owned(), false),
            None => (compact.clone(), true),
        };
        if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
            return Err(InvalidIdentifier(
                "must be digits, optionally after a leading '+'".into(),
            ));
        }
        if national_cn {
            return if digits.len() == 11 && digits.starts_with('1') {
                Ok(PhoneNumber(format!("+86{digits}")))
            } else {
                Err(InvalidIdentifier(
                    "needs a country code (+...) unless it is an 11-digit mainland mobile number"
                        .into(),
                ))
            };
        }
        if !(PHONE_DIGITS_MIN..=PHONE_DIGITS_MAX).contains(&digits.len()) || digits.starts_with('0')
        {
            return Err(InvalidIdentifier(format!(
                "must be '+', a country code and {PHONE_DIGITS_MIN} to {PHONE_DIGITS_MAX} digits in all"
            )));
        }
        Ok(PhoneNumber(format!("+{digits}")))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for PhoneNumber {
    type Error = InvalidIdentifier;
    fn try_from(raw: String) -> Result<PhoneNumber, InvalidIdentifier> {
        PhoneNumber::parse(&raw)
    }
}

impl From<PhoneNumber> for String {
    fn from(phone: PhoneNumber) -> String {
        phone.0
    }
}

impl fmt::Display for PhoneNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An argon2id hash in PHC string form (`$argon2id$v=19$m=...`). Opaque here; its `Debug` and
/// `Display` are redacted so that it never reaches a log line.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PasswordHash(String);

impl PasswordHash {
    pub fn parse(phc: &str) -> Result<PasswordHash, InvalidIdentifier> {
        if phc.starts_with("$argon2id$") {
            Ok(PasswordHash(phc.to_owned()))
        } else {
            Err(InvalidIdentifier(
                "a password hash must be an argon2id PHC string".into(),
            ))
        }
    }

    /// The PHC string, for the password verifier only.
    pub fn expose_phc(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for PasswordHash {
    type Error = InvalidIdentifier;
    fn try_from(raw: String) -> Result<PasswordHash, InvalidIdentifier> {
        PasswordHash::parse(&raw)
    }
}

impl From<PasswordHash> for String {
    fn from(hash: PasswordHash) -> String {
        hash.0
    }
}

impl fmt::Debug for PasswordHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PasswordHash(<redacted>)")
    }
}

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
                if name.is_empty() || name.chars().count() > KEY_NAME_LENGTH_MAX {
                    return Err(UserError::InvalidKeyName);
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
            }),
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
            other => {
                return Err(DecodeError::UnknownType {
                    event_type: other.to_owned(),
                });
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::decider::given;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn alice() -> UserId {
        UserId::from_uuid(Uuid::from_u128(1))
    }

    fn hash(tag: &str) -> PasswordHash {
        PasswordHash::parse(&format!("$argon2id$v=19$m=19456,t=2,p=1${tag}")).unwrap()
    }

    fn registered_alice() -> UserEvent {
        UserEvent::Registered(UserRegistered {
            user_id: alice(),
            username: Some(Username::parse("alice").unwrap()),
            password_hash: Some(hash("one")),
            phone: None,
            role: Role::User,
            registered_at: at(0),
        })
    }

    fn create_key(key_id: u128, scopes: Vec<Scope>, at_seconds: i64) -> UserCommand {
        UserCommand::CreateApiKey {
            key_id: Uuid::from_u128(key_id),
            name: "  商城后台 ".into(),
            scopes,
            digest: format!("digest-{key_id}"),
            expires_at: Some(at(at_seconds + 3600)),
            requests_per_minute: 600,
            at: at(at_seconds),
        }
    }

    fn key_created(key_id: u128, scopes: Vec<Scope>, at_seconds: i64) -> UserEvent {
        UserEvent::ApiKeyCreated(ApiKeyCreated {
            key_id: Uuid::from_u128(key_id),
            name: "商城后台".into(),
            scopes,
            digest: format!("digest-{key_id}"),
            expires_at: Some(at(at_seconds + 3600)),
            requests_per_minute: 600,
            created_at: at(at_seconds),
        })
    }

    #[test]
    fn given_a_user_when_create_key_then_created_once_with_its_scopes_sorted() {
        given::<User>(&[registered_alice()])
            .when(create_key(
                7,
                vec![Scope::TasksRead, Scope::TasksWrite, Scope::TasksRead],
                1,
            ))
            .then(&[key_created(7, vec![Scope::TasksWrite, Scope::TasksRead], 1)]);
        // The same request again is done already; another digest under the id is refused.
        given::<User>(&[
            registered_alice(),
            key_created(7, vec![Scope::TasksRead], 1),
        ])
        .when(create_key(7, vec![Scope::TasksRead], 2))
        .then(&[]);
        let mut other = create_key(7, vec![Scope::TasksRead], 2);
        if let UserCommand::CreateApiKey { digest, .. } = &mut other {
            *digest = "someone else".into();
        }
        given::<User>(&[
            registered_alice(),
            key_created(7, vec![Scope::TasksRead], 1),
        ])
        .when(other)
        .then_error(UserError::KeyIdTaken(Uuid::from_u128(7)));
    }

    #[test]
    fn given_a_user_when_create_key_breaking_a_rule_then_refused_naming_it() {
        given::<User>(&[registered_alice()])
            .when(create_key(1, vec![Scope::Admin], 1))
            .then_error(UserError::AdminScopeForbidden);
        given::<User>(&[registered_alice()])
            .when(create_key(1, vec![], 1))
            .then_error(UserError::NoScopes);
        let mut expired = create_key(1, vec![Scope::TasksRead], 10);
        if let UserCommand::CreateApiKey { expires_at, .. } = &mut expired {
            *expires_at = Some(at(5));
        }
        given::<User>(&[registered_alice()])
            .when(expired)
            .then_error(UserError::ExpiryInPast);
        let mut unnamed = create_key(1, vec![Scope::TasksRead], 1);
        if let UserCommand::CreateApiKey { name, .. } = &mut unnamed {
            *name = "   ".into();
        }
        given::<User>(&[registered_alice()])
            .when(unnamed)
            .then_error(UserError::InvalidKeyName);
        let mut full = vec![registered_alice()];
        for id in 0..ACTIVE_KEYS_MAX as u128 {
            full.push(key_created(100 + id, vec![Scope::TasksRead], 1));
        }
        given::<User>(&full)
            .when(create_key(1, vec![Scope::TasksRead], 2))
            .then_error(UserError::TooManyKeys);
        // Expired keys no longer count.
        given::<User>(&full)
            .when(create_key(1, vec![Scope::TasksRead], 4000))
            .then(&[key_created(1, vec![Scope::TasksRead], 4000)]);
    }

    #[test]
    fn given_a_key_when_revoked_then_revoked_once_and_no_longer_active() {
        let revoked = UserEvent::ApiKeyRevoked(ApiKeyRevoked {
            key_id: Uuid::from_u128(7),
            revoked_at: at(5),
        });
        given::<User>(&[
            registered_alice(),
            key_created(7, vec![Scope::TasksRead], 1),
        ])
        .when(UserCommand::RevokeApiKey {
            key_id: Uuid::from_u128(7),
            at: at(5),
        })
        .then(std::slice::from_ref(&revoked));
        given::<User>(&[
            registered_alice(),
            key_created(7, vec![Scope::TasksRead], 1),
            revoked.clone(),
        ])
        .when(UserCommand::RevokeApiKey {
            key_id: Uuid::from_u128(7),
            at: at(6),
        })
        .then(&[]);
        given::<User>(&[registered_alice()])
            .when(UserCommand::RevokeApiKey {
                key_id: Uuid::from_u128(7),
                at: at(6),
            })
            .then_error(UserError::KeyNotFound);
        let state = User::fold(&[
            registered_alice(),
            key_created(7, vec![Scope::TasksRead], 1),
            revoked,
        ]);
        let UserState::Registered(user) = state else {
            panic!("registered");
        };
        let key = user.api_key("digest-7").unwrap();
        assert!(!key.is_active(at(6)));
        assert_eq!(key.revoked_at, Some(at(5)));
    }

    #[test]
    fn given_nothing_when_register_with_name_and_password_then_registered() {
        given::<User>(&[])
            .when(UserCommand::Register {
                user_id: alice(),
                username: Some(Username::parse("Alice").unwrap()),
                password_hash: Some(hash("one")),
                phone: None,
                role: Role::User,
                at: at(0),
            })
            .then(&[registered_alice()]);
    }

    #[test]
    fn given_nothing_when_register_with_phone_only_then_registered() {
        let phone = PhoneNumber::parse("+8613800138000").unwrap();
        given::<User>(&[])
            .when(UserCommand::Register {
                user_id: alice(),
                username: None,
                password_hash: None,
                phone: Some(phone.clone()),
                role: Role::User,
                at: at(0),
            })
            .then(&[UserEvent::Registered(UserRegistered {
                user_id: alice(),
                username: None,
                password_hash: None,
                phone: Some(phone),
                role: Role::User,
                registered_at: at(0),
            })]);
    }

    #[test]
    fn given_nothing_when_register_without_credentials_then_refused() {
        given::<User>(&[])
            .when(UserCommand::Register {
                user_id: alice(),
                username: None,
                password_hash: None,
                phone: None,
                role: Role::User,
                at: at(0),
            })
            .then_error(UserError::NoCredentials);
    }

    #[test]
    fn given_nothing_when_register_name_without_password_then_refused() {
        given::<User>(&[])
            .when(UserCommand::Register {
                user_id: alice(),
                username: Some(Username::parse("alice").unwrap()),
                password_hash: None,
                phone: None,
                role: Role::User,
                at: at(0),
            })
            .then_error(UserError::UsernameWithoutPassword);
    }

    #[test]
    fn given_registered_when_register_again_then_refused() {
        given::<User>(&[registered_alice()])
            .when(UserCommand::Register {
                user_id: alice(),
                username: Some(Username::parse("alice").unwrap()),
                password_hash: Some(hash("two")),
                phone: None,
                role: Role::User,
                at: at(1),
            })
            .then_error(UserError::AlreadyRegistered(alice()));
    }

    #[test]
    fn given_nothing_when_change_role_then_not_registered() {
        given::<User>(&[])
            .when(UserCommand::ChangeRole {
                role: Role::Admin,
                at: at(1),
            })
            .then_error(UserError::NotRegistered);
    }

    #[test]
    fn given_registered_when_change_role_then_changed_and_a_repeat_is_a_no_op() {
        given::<User>(&[registered_alice()])
            .when(UserCommand::ChangeRole {
                role: Role::Admin,
                at: at(1),
            })
            .then(&[UserEvent::RoleChanged(RoleChanged {
                role: Role::Admin,
                changed_at: at(1),
            })]);
        given::<User>(&[
            registered_alice(),
            UserEvent::RoleChanged(RoleChanged {
                role: Role::Admin,
                changed_at: at(1),
            }),
        ])
        .when(UserCommand::ChangeRole {
            role: Role::Admin,
            at: at(2),
        })
        .then(&[]);
    }

    #[test]
    fn given_registered_when_change_password_then_changed() {
        given::<User>(&[registered_alice()])
            .when(UserCommand::ChangePassword {
                password_hash: hash("two"),
                at: at(1),
            })
            .then(&[UserEvent::PasswordChanged(PasswordChanged {
                password_hash: hash("two"),
                changed_at: at(1),
            })]);
    }

    #[test]
    fn given_phone_bound_when_bind_another_then_refused_and_the_same_is_a_no_op() {
        let first = PhoneNumber::parse("+8613800138000").unwrap();
        let second = PhoneNumber::parse("+8613900139000").unwrap();
        let history = [
            registered_alice(),
            UserEvent::PhoneBound(PhoneBound {
                phone: first.clone(),
                bound_at: at(1),
            }),
        ];
        given::<User>(&history)
            .when(UserCommand::BindPhone {
                phone: second,
                at: at(2),
            })
            .then_error(UserError::PhoneAlreadyBound {
                bound: first.clone(),
            });
        given::<User>(&history)
            .when(UserCommand::BindPhone {
                phone: first,
                at: at(2),
            })
            .then(&[]);
    }

    #[test]
    fn usernames_follow_the_rules_and_are_case_insensitive() {
        assert_eq!(Username::parse(" Alice ").unwrap().as_str(), "alice");
        assert!(Username::parse("al").is_err());
        assert!(Username::parse(&"a".repeat(33)).is_err());
        assert!(Username::parse("1alice").is_err());
        assert!(Username::parse("ali ce").is_err());
        assert!(Username::parse("alice\"}").is_err());
        assert!(Username::parse("a.l-i_c3").is_ok());
    }

    #[test]
    fn phone_numbers_are_normalised_to_e164() {
        assert_eq!(
            PhoneNumber::parse("138 0013 8000").unwrap().as_str(),
            "+8613800138000"
        );
        assert_eq!(
            PhoneNumber::parse("+1 (415) 555-0100").unwrap().as_str(),
            "+14155550100"
        );
        assert!(PhoneNumber::parse("12345").is_err());
        assert!(PhoneNumber::parse("+12ab").is_err());
        assert!(PhoneNumber::parse("+0123456789").is_err());
        assert!(PhoneNumber::parse(&format!("+{}", "1".repeat(16))).is_err());
    }

    #[test]
    fn a_password_hash_never_shows_in_debug_output() {
        let printed = format!("{:?}", registered_alice());
        assert!(!printed.contains("argon2id"), "{printed}");
    }

    #[test]
    fn every_event_round_trips_through_its_stored_form() {
        let events = [
            registered_alice(),
            UserEvent::PasswordChanged(PasswordChanged {
                password_hash: hash("two"),
                changed_at: at(1),
            }),
            UserEvent::RoleChanged(RoleChanged {
                role: Role::Admin,
                changed_at: at(2),
            }),
            UserEvent::PhoneBound(PhoneBound {
                phone: PhoneNumber::parse("+8613800138000").unwrap(),
                bound_at: at(3),
            }),
            key_created(9, vec![Scope::TasksWrite, Scope::Admin], 4),
            UserEvent::ApiKeyRevoked(ApiKeyRevoked {
                key_id: Uuid::from_u128(9),
                revoked_at: at(5),
            }),
        ];
        for event in events {
            let stored = event.to_payload();
            let back = UserEvent::from_stored(event.event_type(), event.schema_version(), &stored)
                .unwrap();
            assert_eq!(back, event);
        }
    }

    #[test]
    fn a_stored_v1_payload_still_folds() {
        // Written by the first release; must keep loading as long as such events exist.
        let payload = serde_json::json!({
            "user_id": "00000000-0000-0000-0000-000000000001",
            "username": "alice",
            "password_hash": "$argon2id$v=19$m=19456,t=2,p=1$one",
            "phone": null,
            "role": "user",
            "registered_at": "2027-01-15T08:00:00Z"
        })
        .into();
        let event = UserEvent::from_stored("UserRegistered", 1, &payload).unwrap();
        let state = User::fold(&[event]);
        assert!(matches!(state, UserState::Registered(user) if user.role == Role::User));
        assert_eq!(
            UserEvent::from_stored("UserRegistered", 9, &payload),
            Err(DecodeError::UnknownVersion {
                event_type: "UserRegistered".into(),
                schema_version: 9
            })
        );
        assert!(matches!(
            UserEvent::from_stored("UserVanished", 1, &payload),
            Err(DecodeError::UnknownType { .. })
        ));
    }
}
