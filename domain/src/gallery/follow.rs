//! One user following one creator (`follow-<follower id>-<creator id>`): once per pair, whatever
//! the races. Nobody follows themselves; a creator must exist when followed, and not be blocked
//! by the follower (the application reads both and puts the answers into the command);
//! unfollowing is always allowed.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::identity::UserId;

/// The stream of one follower following one creator.
pub fn follow_stream(follower: UserId, creator: UserId) -> String {
    format!("follow-{follower}-{creator}")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FollowCommand {
    Follow {
        follower: UserId,
        creator: UserId,
        /// Whether the creator is a registered user.
        creator_exists: bool,
        /// Whether the follower blocked the creator (read from the block's stream).
        creator_blocked: bool,
        at: DateTime<Utc>,
    },
    Unfollow {
        follower: UserId,
        creator: UserId,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatorFollowed {
    pub follower: UserId,
    pub creator: UserId,
    pub followed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatorUnfollowed {
    pub follower: UserId,
    pub creator: UserId,
    pub unfollowed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FollowEvent {
    Followed(CreatorFollowed),
    Unfollowed(CreatorUnfollowed),
}

/// Since when the follower follows the creator, if they do.
pub type FollowState = Option<DateTime<Utc>>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FollowError {
    #[error("you cannot follow yourself")]
    FollowingOneself,
    #[error("no such creator")]
    NoSuchCreator,
    #[error("you blocked this creator: unblock them to follow them")]
    CreatorBlocked,
}

#[derive(Debug)]
pub struct Follow;

impl Decider for Follow {
    type State = FollowState;
    type Command = FollowCommand;
    type Event = FollowEvent;
    type Error = FollowError;

    fn initial_state() -> FollowState {
        None
    }

    fn decide(
        state: &FollowState,
        command: &FollowCommand,
    ) -> Result<Vec<FollowEvent>, FollowError> {
        match command {
            FollowCommand::Follow {
                follower, creator, ..
            } if follower == creator => Err(FollowError::FollowingOneself),
            FollowCommand::Follow {
                creator_blocked: true,
                ..
            } => Err(FollowError::CreatorBlocked),
            FollowCommand::Follow { .. } if state.is_some() => Ok(vec![]),
            FollowCommand::Follow {
                creator_exists: false,
                ..
            } => Err(FollowError::NoSuchCreator),
            FollowCommand::Follow {
                follower,
                creator,
                at,
                ..
            } => Ok(vec![FollowEvent::Followed(CreatorFollowed {
                follower: *follower,
                creator: *creator,
                followed_at: *at,
            })]),
            FollowCommand::Unfollow { .. } if state.is_none() => Ok(vec![]),
            FollowCommand::Unfollow {
                follower,
                creator,
                at,
            } => Ok(vec![FollowEvent::Unfollowed(CreatorUnfollowed {
                follower: *follower,
                creator: *creator,
                unfollowed_at: *at,
            })]),
        }
    }

    fn evolve(_state: FollowState, event: &FollowEvent) -> FollowState {
        match event {
            FollowEvent::Followed(followed) => Some(followed.followed_at),
            FollowEvent::Unfollowed(_) => None,
        }
    }
}

impl DomainEvent for FollowEvent {
    fn event_type(&self) -> &'static str {
        match self {
            FollowEvent::Followed(_) => "CreatorFollowed",
            FollowEvent::Unfollowed(_) => "CreatorUnfollowed",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            FollowEvent::Followed(payload) => payload_of(payload),
            FollowEvent::Unfollowed(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<FollowEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "CreatorFollowed" => Ok(FollowEvent::Followed(parse_payload(event_type, payload)?)),
            "CreatorUnfollowed" => Ok(FollowEvent::Unfollowed(parse_payload(event_type, payload)?)),
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

    fn follow(creator: u128, creator_exists: bool) -> FollowCommand {
        FollowCommand::Follow {
            follower: user(1),
            creator: user(creator),
            creator_exists,
            creator_blocked: false,
            at: at(0),
        }
    }

    fn followed() -> FollowEvent {
        FollowEvent::Followed(CreatorFollowed {
            follower: user(1),
            creator: user(2),
            followed_at: at(0),
        })
    }

    #[test]
    fn a_follow_counts_once_and_unfollowing_twice_changes_nothing() {
        given::<Follow>(&[])
            .when(follow(2, true))
            .then(&[followed()]);
        given::<Follow>(&[followed()])
            .when(follow(2, true))
            .then(&[]);
        let unfollowed = FollowEvent::Unfollowed(CreatorUnfollowed {
            follower: user(1),
            creator: user(2),
            unfollowed_at: at(5),
        });
        let unfollow = FollowCommand::Unfollow {
            follower: user(1),
            creator: user(2),
            at: at(5),
        };
        given::<Follow>(&[followed()])
            .when(unfollow.clone())
            .then(std::slice::from_ref(&unfollowed));
        given::<Follow>(&[followed(), unfollowed.clone()])
            .when(unfollow)
            .then(&[]);
        let read = FollowEvent::from_stored(
            unfollowed.event_type(),
            unfollowed.schema_version(),
            &unfollowed.to_payload(),
        )
        .unwrap();
        assert_eq!(read, unfollowed);
    }

    #[test]
    fn nobody_follows_themselves_a_creator_who_does_not_exist_or_one_they_blocked() {
        given::<Follow>(&[])
            .when(follow(1, true))
            .then_error(FollowError::FollowingOneself);
        given::<Follow>(&[])
            .when(follow(3, false))
            .then_error(FollowError::NoSuchCreator);
        let blocked = FollowCommand::Follow {
            follower: user(1),
            creator: user(2),
            creator_exists: true,
            creator_blocked: true,
            at: at(0),
        };
        given::<Follow>(&[])
            .when(blocked.clone())
            .then_error(FollowError::CreatorBlocked);
        // Even when a race left the pair followed: a follow of a blocked creator is refused.
        given::<Follow>(&[followed()])
            .when(blocked)
            .then_error(FollowError::CreatorBlocked);
        assert_eq!(
            follow_stream(user(1), user(2)),
            format!("follow-{}-{}", user(1), user(2))
        );
    }
}
