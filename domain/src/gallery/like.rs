//! One user's like of one work (`like-<work id>-<user id>`): at most one like per user per work,
//! whatever the races (see the module above). A like needs the work visible when it is given
//! (the application reads the work's latest version into the command); taking a like back is
//! always allowed, so a user can clean up after a work was hidden.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::work::WorkId;
use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::identity::UserId;

/// The stream of one user's like of one work.
pub fn like_stream(work_id: WorkId, user_id: UserId) -> String {
    format!("like-{work_id}-{user_id}")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LikeCommand {
    Like {
        work_id: WorkId,
        user_id: UserId,
        /// Whether the work was published and not hidden, on its stream's latest version.
        work_visible: bool,
        at: DateTime<Utc>,
    },
    Unlike {
        work_id: WorkId,
        user_id: UserId,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkLiked {
    pub work_id: WorkId,
    pub user_id: UserId,
    pub liked_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkUnliked {
    pub work_id: WorkId,
    pub user_id: UserId,
    pub unliked_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LikeEvent {
    Liked(WorkLiked),
    Unliked(WorkUnliked),
}

/// Since when the user likes the work, if they do.
pub type LikeState = Option<DateTime<Utc>>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LikeError {
    #[error("no such work")]
    NoSuchWork,
}

#[derive(Debug)]
pub struct Like;

impl Decider for Like {
    type State = LikeState;
    type Command = LikeCommand;
    type Event = LikeEvent;
    type Error = LikeError;

    fn initial_state() -> LikeState {
        None
    }

    fn decide(state: &LikeState, command: &LikeCommand) -> Result<Vec<LikeEvent>, LikeError> {
        match (state, command) {
            (Some(_), LikeCommand::Like { .. }) | (None, LikeCommand::Unlike { .. }) => Ok(vec![]),
            (
                None,
                LikeCommand::Like {
                    work_visible: false,
                    ..
                },
            ) => Err(LikeError::NoSuchWork),
            (
                None,
                LikeCommand::Like {
                    work_id,
                    user_id,
                    at,
                    ..
                },
            ) => Ok(vec![LikeEvent::Liked(WorkLiked {
                work_id: *work_id,
                user_id: *user_id,
                liked_at: *at,
            })]),
            (
                Some(_),
                LikeCommand::Unlike {
                    work_id,
                    user_id,
                    at,
                },
            ) => Ok(vec![LikeEvent::Unliked(WorkUnliked {
                work_id: *work_id,
                user_id: *user_id,
                unliked_at: *at,
            })]),
        }
    }

    fn evolve(_state: LikeState, event: &LikeEvent) -> LikeState {
        match event {
            LikeEvent::Liked(liked) => Some(liked.liked_at),
            LikeEvent::Unliked(_) => None,
        }
    }
}

impl DomainEvent for LikeEvent {
    fn event_type(&self) -> &'static str {
        match self {
            LikeEvent::Liked(_) => "WorkLiked",
            LikeEvent::Unliked(_) => "WorkUnliked",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            LikeEvent::Liked(payload) => payload_of(payload),
            LikeEvent::Unliked(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<LikeEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "WorkLiked" => Ok(LikeEvent::Liked(parse_payload(event_type, payload)?)),
            "WorkUnliked" => Ok(LikeEvent::Unliked(parse_payload(event_type, payload)?)),
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

    fn work() -> WorkId {
        Uuid::from_u128(7)
    }

    fn user() -> UserId {
        UserId::from_uuid(Uuid::from_u128(1))
    }

    fn like(work_visible: bool, seconds: i64) -> LikeCommand {
        LikeCommand::Like {
            work_id: work(),
            user_id: user(),
            work_visible,
            at: at(seconds),
        }
    }

    fn liked(seconds: i64) -> LikeEvent {
        LikeEvent::Liked(WorkLiked {
            work_id: work(),
            user_id: user(),
            liked_at: at(seconds),
        })
    }

    fn unliked(seconds: i64) -> LikeEvent {
        LikeEvent::Unliked(WorkUnliked {
            work_id: work(),
            user_id: user(),
            unliked_at: at(seconds),
        })
    }

    #[test]
    fn a_like_counts_once_however_often_it_is_sent() {
        given::<Like>(&[]).when(like(true, 0)).then(&[liked(0)]);
        // The second of a double click, decided again after losing the race: nothing new.
        given::<Like>(&[liked(0)]).when(like(true, 1)).then(&[]);
    }

    #[test]
    fn a_work_not_visible_cannot_be_liked_and_a_like_can_always_be_taken_back() {
        given::<Like>(&[])
            .when(like(false, 0))
            .then_error(LikeError::NoSuchWork);
        given::<Like>(&[liked(0)])
            .when(LikeCommand::Unlike {
                work_id: work(),
                user_id: user(),
                at: at(5),
            })
            .then(&[unliked(5)]);
        given::<Like>(&[liked(0), unliked(5)])
            .when(LikeCommand::Unlike {
                work_id: work(),
                user_id: user(),
                at: at(6),
            })
            .then(&[]);
        // Liked again: the like's time is the new one (the first likers are ordered by it).
        given::<Like>(&[liked(0), unliked(5)])
            .when(like(true, 9))
            .then(&[liked(9)]);
        assert_eq!(Like::fold(&[liked(0), unliked(5), liked(9)]), Some(at(9)));
    }

    #[test]
    fn stored_events_read_back_as_themselves() {
        assert_eq!(
            like_stream(work(), user()),
            format!("like-{}-{}", work(), user())
        );
        for event in [liked(0), unliked(5)] {
            let read = LikeEvent::from_stored(
                event.event_type(),
                event.schema_version(),
                &event.to_payload(),
            )
            .unwrap();
            assert_eq!(read, event);
        }
    }
}
