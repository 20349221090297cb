//! The users application service: registration, lookups by username or phone, role, password
//! and phone changes. It composes two deciders, `User` (one stream per user) and `Claim` (one
//! stream per username or phone number, the uniqueness guard and the lookup), see
//! `zhihui_domain::claim` for why.
//!
//! Registration appends the claim first and the user second. A crash in between leaves an orphan
//! claim (owner without a stream), which blocks its name until it is older than
//! `auth.orphan_claim_release_ms`; then the next registration of that name releases it.

use std::time::Duration;

use uuid::Uuid;
use zhihui_domain::claim::{Claim, ClaimCommand, ClaimError, ClaimState, Identifier};
use zhihui_domain::user::{
    PhoneNumber, RegisteredUser, Role, User, UserCommand, UserError, UserId, UserState, Username,
};

use crate::identity::password::{Passwords, PlainPassword};
use crate::platform::clock::Clock;
use crate::platform::command::{CommandError, RetryPolicy, execute, load};
use crate::platform::event_store::{AnyEventStore, EventMetadata};

/// Times a registration tries to take a name: the first try, and one more after releasing an
/// orphan claim. A third would mean the orphan was replaced by a live claim: the name is taken.
const CLAIM_ATTEMPTS_MAX: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("this {what} is already taken")]
    Taken { what: &'static str },
    #[error(transparent)]
    Rejected(UserError),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

#[derive(Debug, Clone)]
pub struct Users {
    store: AnyEventStore,
    clock: Clock,
    retry: RetryPolicy,
    orphan_claim_release: Duration,
}

fn unexpected<E: std::error::Error + Send + Sync + 'static>(
    error: CommandError<E>,
) -> anyhow::Error {
    error.into_anyhow("a user command")
}

/// Whether `user`'s stream records `identifier` as theirs.
fn holds(user: &RegisteredUser, identifier: &Identifier) -> bool {
    match identifier {
        Identifier::Username(name) => user.username.as_ref() == Some(name),
        Identifier::Phone(phone) => user.phone.as_ref() == Some(phone),
    }
}

impl Users {
    pub fn new(
        store: AnyEventStore,
        clock: Clock,
        retry: RetryPolicy,
        orphan_claim_release: Duration,
    ) -> Users {
        Users {
            store,
            clock,
            retry,
            orphan_claim_release,
        }
    }

    /// The registered user with this id, if any.
    pub async fn get(&self, user_id: UserId) -> anyhow::Result<Option<RegisteredUser>> {
        Ok(
            match load::<User>(&self.store, &user_id.stream()).await?.state {
                UserState::Registered(user) => Some(user),
                UserState::Unregistered => None,
            },
        )
    }

    /// The registered owner of a username or phone number, if any: the claim's holder, when
    /// their stream holds it too (a claim whose user event never followed names nobody).
    pub async fn find(&self, identifier: &Identifier) -> anyhow::Result<Option<RegisteredUser>> {
        match load::<Claim>(&self.store, &identifier.stream())
            .await?
            .state
        {
            ClaimState::Claimed { owner, .. } => Ok(self
                .get(owner)
                .await?
                .filter(|user| holds(user, identifier))),
            ClaimState::Free => Ok(None),
        }
    }

    /// Take `identifier` for `owner`, releasing an orphan claim if one is in the way.
    async fn claim(
        &self,
        identifier: &Identifier,
        owner: UserId,
        metadata: &EventMetadata,
    ) -> Result<(), RegisterError> {
        let stream = identifier.stream();
        let what = match identifier {
            Identifier::Username(_) => "username",
            Identifier::Phone(_) => "phone number",
        };
        for _ in 0..CLAIM_ATTEMPTS_MAX {
            let command = ClaimCommand::Claim {
                owner,
                at: self.clock.now(),
            };
            match execute::<Claim>(&self.store, &stream, &command, metadata, self.retry).await {
                Ok(_) => return Ok(()),
                Err(CommandError::Rejected(ClaimError::TakenByAnother {
                    owner: holder,
                    claimed_at,
                })) => {
                    let age = (self.clock.now() - claimed_at).to_std().unwrap_or_default();
                    // An orphan: its holder never recorded it (never registered, or died
                    // between claiming a name or phone for their account and recording it).
                    let recorded = self
                        .get(holder)
                        .await?
                        .is_some_and(|user| holds(&user, identifier));
                    if age < self.orphan_claim_release || recorded {
                        return Err(RegisterError::Taken { what });
                    }
                    tracing::warn!(%stream, %holder, "releasing an orphan claim");
                    let release = ClaimCommand::ReleaseOrphan {
                        owner: holder,
                        at: self.clock.now(),
                    };
                    match execute::<Claim>(&self.store, &stream, &release, metadata, self.retry)
                        .await
                    {
                        Ok(_) | Err(CommandError::Rejected(ClaimError::NotHeldBy(_))) => {}
                        Err(error) => return Err(unexpected(error).into()),
                    }
                }
                Err(error) => return Err(unexpected(error).into()),
            }
        }
        Err(RegisterError::Taken { what })
    }

    /// Register a user with a username and password.
    /// The name is claimed before the password is hashed: of many concurrent registrations of
    /// one name, only the winner pays for argon2id.
    pub async fn register_with_password(
        &self,
        username: Username,
        password: &PlainPassword,
        passwords: &Passwords,
        role: Role,
        metadata: &EventMetadata,
    ) -> Result<RegisteredUser, RegisterError> {
        let user_id = UserId::from_uuid(Uuid::now_v7());
        self.claim(&Identifier::Username(username.clone()), user_id, metadata)
            .await?;
        let password_hash = passwords.hash(password).await?;
        let command = UserCommand::Register {
            user_id,
            username: Some(username),
            password_hash: Some(password_hash),
            phone: None,
            role,
            at: self.clock.now(),
        };
        self.apply(user_id, &command, metadata).await
    }

    async fn apply(
        &self,
        user_id: UserId,
        command: &UserCommand,
        metadata: &EventMetadata,
    ) -> Result<RegisteredUser, RegisterError> {
        match execute::<User>(
            &self.store,
            &user_id.stream(),
            command,
            metadata,
            self.retry,
        )
        .await
        {
            Ok(executed) => match executed.state {
                UserState::Registered(user) => Ok(user),
                UserState::Unregistered => Err(anyhow::anyhow!(
                    "user {user_id} is not registered after its registration"
                )
                .into()),
            },
            Err(CommandError::Rejected(error)) => Err(RegisterError::Rejected(error)),
            Err(error) => Err(unexpected(error).into()),
        }
    }

    /// The user owning `phone`, registering a new one on the first successful code login.
    pub async fn find_or_register_by_phone(
        &self,
        phone: &PhoneNumber,
        metadata: &EventMetadata,
    ) -> Result<RegisteredUser, RegisterError> {
        let identifier = Identifier::Phone(phone.clone());
        if let Some(user) = self.find(&identifier).await? {
            return Ok(user);
        }
        let user_id = UserId::from_uuid(Uuid::now_v7());
        match self.claim(&identifier, user_id, metadata).await {
            Ok(()) => {}
            // Another first login of this phone won the race: that user is the one.
            Err(RegisterError::Taken { .. }) => {
                if let Some(user) = self.find(&identifier).await? {
                    return Ok(user);
                }
                return Err(RegisterError::Taken {
                    what: "phone number",
                });
            }
            Err(error) => return Err(error),
        }
        let command = UserCommand::Register {
            user_id,
            username: None,
            password_hash: None,
            phone: Some(phone.clone()),
            role: Role::User,
            at: self.clock.now(),
        };
        self.apply(user_id, &command, metadata).await
    }

    /// Apply a command to an existing user.
    pub async fn update(
        &self,
        user_id: UserId,
        command: UserCommand,
        metadata: &EventMetadata,
    ) -> Result<RegisteredUser, RegisterError> {
        self.apply(user_id, &command, metadata).await
    }

    /// Give a user who signed up with a phone a username and a password: claim the name, hash
    /// the password (only a claim's winner pays for argon2id), record both on the user. A claim
    /// the user's stream then refuses is let go at once.
    pub async fn set_username(
        &self,
        user_id: UserId,
        username: Username,
        password: &PlainPassword,
        passwords: &Passwords,
        metadata: &EventMetadata,
    ) -> Result<RegisteredUser, RegisterError> {
        // Refuse before claiming: a claim this user cannot record would block the name.
        match self.get(user_id).await? {
            None => return Err(RegisterError::Rejected(UserError::NotRegistered)),
            Some(user) => match user.username {
                Some(held) if held == username => return self.get_registered(user_id).await,
                Some(held) => {
                    return Err(RegisterError::Rejected(UserError::UsernameAlreadySet {
                        username: held,
                    }));
                }
                None => {}
            },
        }
        let identifier = Identifier::Username(username.clone());
        self.claim(&identifier, user_id, metadata).await?;
        let password_hash = match passwords.hash(password).await {
            Ok(hash) => hash,
            Err(error) => {
                self.let_go(&identifier, user_id, metadata).await;
                return Err(error.into());
            }
        };
        let command = UserCommand::SetUsername {
            username,
            password_hash,
            at: self.clock.now(),
        };
        match self.apply(user_id, &command, metadata).await {
            // Refused on the stream (another request set a name first): the claim is nobody's.
            // An append whose outcome is unknown keeps it: it may have landed.
            Err(RegisterError::Rejected(error)) => {
                self.let_go(&identifier, user_id, metadata).await;
                Err(RegisterError::Rejected(error))
            }
            other => other,
        }
    }

    async fn get_registered(&self, user_id: UserId) -> Result<RegisteredUser, RegisterError> {
        self.get(user_id)
            .await?
            .ok_or(RegisterError::Rejected(UserError::NotRegistered))
    }

    /// Release `owner`'s claim of `identifier` that their stream never recorded. Best effort:
    /// one left behind is released as an orphan once it is old enough.
    async fn let_go(&self, identifier: &Identifier, owner: UserId, metadata: &EventMetadata) {
        let release = ClaimCommand::ReleaseOrphan {
            owner,
            at: self.clock.now(),
        };
        if let Err(error) = execute::<Claim>(
            &self.store,
            &identifier.stream(),
            &release,
            metadata,
            self.retry,
        )
        .await
        {
            tracing::warn!(error = %unexpected(error), stream = %identifier.stream(), "a claim nobody records was left for the orphan release");
        }
    }

    /// Bind a phone number to a user: claim it, then record it on the user.
    pub async fn bind_phone(
        &self,
        user_id: UserId,
        phone: PhoneNumber,
        metadata: &EventMetadata,
    ) -> Result<RegisteredUser, RegisterError> {
        // Refuse before claiming: a claim for a phone this user cannot bind would block it.
        match self.get(user_id).await? {
            None => return Err(RegisterError::Rejected(UserError::NotRegistered)),
            Some(user) => match user.phone {
                Some(bound) if bound != phone => {
                    return Err(RegisterError::Rejected(UserError::PhoneAlreadyBound {
                        bound,
                    }));
                }
                _ => {}
            },
        }
        let identifier = Identifier::Phone(phone.clone());
        self.claim(&identifier, user_id, metadata).await?;
        let command = UserCommand::BindPhone {
            phone,
            at: self.clock.now(),
        };
        match self.update(user_id, command, metadata).await {
            // Another phone was bound meanwhile: this one is nobody's.
            Err(RegisterError::Rejected(error)) => {
                self.let_go(&identifier, user_id, metadata).await;
                Err(RegisterError::Rejected(error))
            }
            other => other,
        }
    }
}
