//! Claims: one stream per unique identifier (a username, a phone number) saying which user owns it.
//!
//! Uniqueness spans users, and an append touches one stream, so the identifier gets a stream of its
//! own: `user-name-<name>` or `user-phone-<e164>`. Two concurrent registrations of one name both
//! try to append `IdentifierClaimed` at the same expected version; the event store lets exactly one
//! through, the other reloads and is refused. Login reads the claim to find the user id, so the
//! lookup is as consistent as the uniqueness.
//!
//! A claim whose owner never got registered (the process died between the two appends) is an
//! orphan. The application sees that the owner's stream is empty and, once the claim is older than
//! a bound, releases it with `ReleaseOrphan`: the decider only lets that release the claim it was
//! decided against, never a newer one.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::user::{PhoneNumber, UserId, Username};

/// Which identifier a claim stream guards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identifier {
    Username(Username),
    Phone(PhoneNumber),
}

impl Identifier {
    pub fn stream(&self) -> String {
        match self {
            Identifier::Username(name) => format!("user-name-{name}"),
            Identifier::Phone(phone) => format!("user-phone-{phone}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimState {
    Free,
    Claimed {
        owner: UserId,
        claimed_at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimCommand {
    Claim {
        owner: UserId,
        at: DateTime<Utc>,
    },
    /// Release a claim whose owner was never registered. `owner` is the orphan the caller checked.
    ReleaseOrphan {
        owner: UserId,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentifierClaimed {
    pub owner: UserId,
    pub claimed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrphanClaimReleased {
    pub owner: UserId,
    pub released_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimEvent {
    Claimed(IdentifierClaimed),
    OrphanReleased(OrphanClaimReleased),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("already taken")]
    TakenByAnother {
        owner: UserId,
        claimed_at: DateTime<Utc>,
    },
    #[error("the claim is not held by {0} any more")]
    NotHeldBy(UserId),
}

#[derive(Debug)]
pub struct Claim;

impl Decider for Claim {
    type State = ClaimState;
    type Command = ClaimCommand;
    type Event = ClaimEvent;
    type Error = ClaimError;

    fn initial_state() -> ClaimState {
        ClaimState::Free
    }

    fn decide(state: &ClaimState, command: &ClaimCommand) -> Result<Vec<ClaimEvent>, ClaimError> {
        match (state, command) {
            (ClaimState::Free, ClaimCommand::Claim { owner, at }) => {
                Ok(vec![ClaimEvent::Claimed(IdentifierClaimed {
                    owner: *owner,
                    claimed_at: *at,
                })])
            }
            (ClaimState::Claimed { owner: holder, .. }, ClaimCommand::Claim { owner, .. })
                if holder == owner =>
            {
                Ok(vec![])
            }
            (
                ClaimState::Claimed {
                    owner: holder,
                    claimed_at,
                },
                ClaimCommand::Claim { .. },
            ) => Err(ClaimError::TakenByAnother {
                owner: *holder,
                claimed_at: *claimed_at,
            }),
            (
                ClaimState::Claimed { owner: holder, .. },
                ClaimCommand::ReleaseOrphan { owner, at },
            ) if holder == owner => Ok(vec![ClaimEvent::OrphanReleased(OrphanClaimReleased {
                owner: *owner,
                released_at: *at,
            })]),
            (_, ClaimCommand::ReleaseOrphan { owner, .. }) => Err(ClaimError::NotHeldBy(*owner)),
        }
    }

    fn evolve(_state: ClaimState, event: &ClaimEvent) -> ClaimState {
        match event {
            ClaimEvent::Claimed(claimed) => ClaimState::Claimed {
                owner: claimed.owner,
                claimed_at: claimed.claimed_at,
            },
            ClaimEvent::OrphanReleased(_) => ClaimState::Free,
        }
    }
}

impl DomainEvent for ClaimEvent {
    fn event_type(&self) -> &'static str {
        match self {
            ClaimEvent::Claimed(_) => "IdentifierClaimed",
            ClaimEvent::OrphanReleased(_) => "OrphanClaimReleased",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            ClaimEvent::Claimed(payload) => payload_of(payload),
            ClaimEvent::OrphanReleased(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<ClaimEvent, DecodeError> {
        match event_type {
            "IdentifierClaimed" => {
                expect_version(event_type, schema_version, 1)?;
                Ok(ClaimEvent::Claimed(parse_payload(event_type, payload)?))
            }
            "OrphanClaimReleased" => {
                expect_version(event_type, schema_version, 1)?;
                Ok(ClaimEvent::OrphanReleased(parse_payload(
                    event_type, payload,
                )?))
            }
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::decider::given;
    use uuid::Uuid;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn user(n: u128) -> UserId {
        UserId::from_uuid(Uuid::from_u128(n))
    }

    fn claimed_by(n: u128) -> ClaimEvent {
        ClaimEvent::Claimed(IdentifierClaimed {
            owner: user(n),
            claimed_at: at(0),
        })
    }

    #[test]
    fn given_free_when_claim_then_claimed() {
        given::<Claim>(&[])
            .when(ClaimCommand::Claim {
                owner: user(1),
                at: at(0),
            })
            .then(&[claimed_by(1)]);
    }

    #[test]
    fn given_claimed_when_another_claims_then_taken() {
        given::<Claim>(&[claimed_by(1)])
            .when(ClaimCommand::Claim {
                owner: user(2),
                at: at(5),
            })
            .then_error(ClaimError::TakenByAnother {
                owner: user(1),
                claimed_at: at(0),
            });
    }

    #[test]
    fn given_claimed_when_the_owner_claims_again_then_nothing_new() {
        given::<Claim>(&[claimed_by(1)])
            .when(ClaimCommand::Claim {
                owner: user(1),
                at: at(5),
            })
            .then(&[]);
    }

    #[test]
    fn given_an_orphan_when_released_then_it_can_be_claimed_again() {
        let released = ClaimEvent::OrphanReleased(OrphanClaimReleased {
            owner: user(1),
            released_at: at(60),
        });
        given::<Claim>(&[claimed_by(1)])
            .when(ClaimCommand::ReleaseOrphan {
                owner: user(1),
                at: at(60),
            })
            .then(std::slice::from_ref(&released));
        given::<Claim>(&[claimed_by(1), released])
            .when(ClaimCommand::Claim {
                owner: user(2),
                at: at(61),
            })
            .then(&[ClaimEvent::Claimed(IdentifierClaimed {
                owner: user(2),
                claimed_at: at(61),
            })]);
    }

    #[test]
    fn given_a_newer_claim_when_the_old_orphan_is_released_then_refused() {
        given::<Claim>(&[claimed_by(2)])
            .when(ClaimCommand::ReleaseOrphan {
                owner: user(1),
                at: at(60),
            })
            .then_error(ClaimError::NotHeldBy(user(1)));
    }

    #[test]
    fn streams_are_named_by_the_normalised_identifier() {
        assert_eq!(
            Identifier::Username(Username::parse("Alice").unwrap()).stream(),
            "user-name-alice"
        );
        assert_eq!(
            Identifier::Phone(PhoneNumber::parse("13800138000").unwrap()).stream(),
            "user-phone-+8613800138000"
        );
    }
}
