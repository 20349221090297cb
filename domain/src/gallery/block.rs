//! One user blocking one creator (`block-<user id>-<creator id>`): the creator's works leave that
//! user's lists and feed. Once per pair, whatever the races; nobody blocks themselves; a creator
//! must exist when blocked; unblocking is always allowed. The rules are a follow's, so the
//! decision is [`Follow`]'s, told in a block's own events.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::follow::{
    CreatorFollowed, CreatorUnfollowed, Follow, FollowCommand, FollowError, FollowEvent,
};
use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::identity::UserId;

/// The stream of one user blocking one creator.
pub fn block_stream(user: UserId, creator: UserId) -> String {
    format!("block-{user}-{creator}")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockCommand {
    Block {
        user: UserId,
        creator: UserId,
        /// Whether the creator is a registered user.
        creator_exists: bool,
        at: DateTime<Utc>,
    },
    Unblock {
        user: UserId,
        creator: UserId,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatorBlocked {
    pub user: UserId,
    pub creator: UserId,
    pub blocked_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatorUnblocked {
    pub user: UserId,
    pub creator: UserId,
    pub unblocked_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    Blocked(CreatorBlocked),
    Unblocked(CreatorUnblocked),
}

/// Since when the user blocks the creator, if they do.
pub type BlockState = Option<DateTime<Utc>>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("you cannot block yourself")]
    BlockingOneself,
    #[error("no such creator")]
    NoSuchCreator,
}

#[derive(Debug)]
pub struct Block;

impl BlockCommand {
    fn as_follow(&self) -> FollowCommand {
        match *self {
            BlockCommand::Block {
                user,
                creator,
                creator_exists,
                at,
            } => FollowCommand::Follow {
                follower: user,
                creator,
                creator_exists,
                creator_blocked: false,
                at,
            },
            BlockCommand::Unblock { user, creator, at } => FollowCommand::Unfollow {
                follower: user,
                creator,
                at,
            },
        }
    }
}

impl From<FollowEvent> for BlockEvent {
    fn from(event: FollowEvent) -> BlockEvent {
        match event {
            FollowEvent::Followed(e) => BlockEvent::Blocked(CreatorBlocked {
                user: e.follower,
                creator: e.creator,
                blocked_at: e.followed_at,
            }),
            FollowEvent::Unfollowed(e) => BlockEvent::Unblocked(CreatorUnblocked {
                user: e.follower,
                creator: e.creator,
                unblocked_at: e.unfollowed_at,
            }),
        }
    }
}

impl BlockEvent {
    fn as_follow(&self) -> FollowEvent {
        match self {
            BlockEvent::Blocked(e) => FollowEvent::Followed(CreatorFollowed {
                follower: e.user,
                creator: e.creator,
                followed_at: e.blocked_at,
            }),
            BlockEvent::Unblocked(e) => FollowEvent::Unfollowed(CreatorUnfollowed {
                follower: e.user,
                creator: e.creator,
                unfollowed_at: e.unblocked_at,
            }),
        }
    }
}

impl Decider for Block {
    type State = BlockState;
    type Command = BlockCommand;
    type Event = BlockEvent;
    type Error = BlockError;

    fn initial_state() -> BlockState {
        None
    }

    fn decide(state: &BlockState, command: &BlockCommand) -> Result<Vec<BlockEvent>, BlockError> {
        match Follow::decide(state, &command.as_follow()) {
            Ok(events) => Ok(events.into_iter().map(BlockEvent::from).collect()),
            Err(FollowError::FollowingOneself) => Err(BlockError::BlockingOneself),
            Err(FollowError::NoSuchCreator) => Err(BlockError::NoSuchCreator),
            // `as_follow` never says "blocked" (a block of a blocked creator is already there).
            Err(FollowError::CreatorBlocked) => Ok(Vec::new()),
        }
    }

    fn evolve(state: BlockState, event: &BlockEvent) -> BlockState {
        Follow::evolve(state, &event.as_follow())
    }
}

impl DomainEvent for BlockEvent {
    fn event_type(&self) -> &'static str {
        match self {
            BlockEvent::Blocked(_) => "CreatorBlocked",
            BlockEvent::Unblocked(_) => "CreatorUnblocked",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            BlockEvent::Blocked(payload) => payload_of(payload),
            BlockEvent::Unblocked(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<BlockEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "CreatorBlocked" => Ok(BlockEvent::Blocked(parse_payload(event_type, payload)?)),
            "CreatorUnblocked" => Ok(BlockEvent::Unblocked(parse_payload(event_type, payload)?)),
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

    fn block(creator: u128, creator_exists: bool) -> BlockCommand {
        BlockCommand::Block {
            user: user(1),
            creator: user(creator),
            creator_exists,
            at: at(0),
        }
    }

    fn blocked() -> BlockEvent {
        BlockEvent::Blocked(CreatorBlocked {
            user: user(1),
            creator: user(2),
            blocked_at: at(0),
        })
    }

    #[test]
    fn a_block_counts_once_and_is_taken_back_once() {
        given::<Block>(&[]).when(block(2, true)).then(&[blocked()]);
        given::<Block>(&[blocked()]).when(block(2, true)).then(&[]);
        let unblocked = BlockEvent::Unblocked(CreatorUnblocked {
            user: user(1),
            creator: user(2),
            unblocked_at: at(5),
        });
        let unblock = BlockCommand::Unblock {
            user: user(1),
            creator: user(2),
            at: at(5),
        };
        given::<Block>(&[blocked()])
            .when(unblock.clone())
            .then(std::slice::from_ref(&unblocked));
        given::<Block>(&[blocked(), unblocked.clone()])
            .when(unblock)
            .then(&[]);
        let read = BlockEvent::from_stored(
            unblocked.event_type(),
            unblocked.schema_version(),
            &unblocked.to_payload(),
        )
        .unwrap();
        assert_eq!(read, unblocked);
    }

    #[test]
    fn nobody_blocks_themselves_or_a_creator_who_does_not_exist() {
        given::<Block>(&[])
            .when(block(1, true))
            .then_error(BlockError::BlockingOneself);
        given::<Block>(&[])
            .when(block(3, false))
            .then_error(BlockError::NoSuchCreator);
        assert_eq!(
            block_stream(user(1), user(2)),
            format!("block-{}-{}", user(1), user(2))
        );
    }
}
