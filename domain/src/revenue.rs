//! The system revenue account: one stream (`revenue`) that receives every settled hold and every
//! charge, and gives back every refund. Points leave user accounts only towards it, so
//! "points in accounts + revenue = grants + credits" is a check anyone can run
//! (`zhihui audit verify`).
//!
//! It is written by one process manager (`src/revenue.rs`) that follows the account streams in
//! global order. Each event names the account event it mirrors and that event's position in the
//! global log: the stream's last event therefore says how far the manager got, and a movement at or
//! before that position is already recorded (a repeat decides nothing). That makes the manager
//! idempotent without any other bookkeeping, on either event store.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::points::{Amount, Points};

/// The one revenue stream.
pub const REVENUE_STREAM: &str = "revenue";

/// Where an event sits in the global log (the store's position, as plain numbers: the domain knows
/// no store). Ordered like the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LogPosition {
    pub commit: u64,
    pub prepare: u64,
}

/// Which account movement the revenue account mirrors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RevenueMovement {
    /// A task's hold was deducted (frozen -> revenue).
    HoldSettled,
    /// A direct charge such as the prioritise fee (available -> revenue).
    Charged,
    /// An earlier charge was refunded (revenue -> available).
    Refunded,
}

/// One movement into or out of the revenue account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevenueRecorded {
    /// The account event this mirrors, and where it is in the global log.
    pub source_event_id: Uuid,
    pub source_position: LogPosition,
    pub user_id: Uuid,
    pub movement: RevenueMovement,
    /// The hold (task) or operation the movement belongs to.
    pub reference_id: Uuid,
    pub amount: Amount,
    /// When the account movement happened.
    pub at: DateTime<Utc>,
    pub total_after: Points,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevenueEvent {
    Recorded(RevenueRecorded),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevenueState {
    pub total: Points,
    /// Position of the last mirrored account event: everything up to it is recorded.
    pub recorded_through: Option<LogPosition>,
}

/// Record one account movement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordMovement {
    pub source_event_id: Uuid,
    pub source_position: LogPosition,
    pub user_id: Uuid,
    pub movement: RevenueMovement,
    pub reference_id: Uuid,
    pub amount: Amount,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RevenueError {
    /// A refund larger than the revenue held: the account streams and the revenue stream disagree
    /// (a refund is always of an earlier charge, which the log orders before it).
    #[error("refund of {required} exceeds the revenue total {total}")]
    RefundExceedsRevenue { total: Points, required: Amount },
    /// Movements must arrive in log order; an older one than the last recorded is a repeat.
    #[error("movement at {0:?} is not after the last recorded one")]
    OutOfOrder(LogPosition),
}

#[derive(Debug)]
pub struct Revenue;

impl Decider for Revenue {
    type State = RevenueState;
    type Command = RecordMovement;
    type Event = RevenueEvent;
    type Error = RevenueError;

    fn initial_state() -> RevenueState {
        RevenueState::default()
    }

    fn decide(
        state: &RevenueState,
        command: &RecordMovement,
    ) -> Result<Vec<RevenueEvent>, RevenueError> {
        if state
            .recorded_through
            .is_some_and(|through| command.source_position <= through)
        {
            return Ok(vec![]);
        }
        let total_after = match command.movement {
            RevenueMovement::HoldSettled | RevenueMovement::Charged => state.total + command.amount,
            RevenueMovement::Refunded => {
                (state.total - command.amount).ok_or(RevenueError::RefundExceedsRevenue {
                    total: state.total,
                    required: command.amount,
                })?
            }
        };
        Ok(vec![RevenueEvent::Recorded(RevenueRecorded {
            source_event_id: command.source_event_id,
            source_position: command.source_position,
            user_id: command.user_id,
            movement: command.movement,
            reference_id: command.reference_id,
            amount: command.amount,
            at: command.at,
            total_after,
        })])
    }

    fn evolve(_state: RevenueState, event: &RevenueEvent) -> RevenueState {
        let RevenueEvent::Recorded(recorded) = event;
        RevenueState {
            total: recorded.total_after,
            recorded_through: Some(recorded.source_position),
        }
    }
}

impl RevenueState {
    /// The state after the stream's last event: it carries everything the state holds, so loading
    /// the revenue account reads one event, however long the stream is.
    pub fn from_last(event: &RevenueEvent) -> RevenueState {
        Revenue::evolve(RevenueState::default(), event)
    }
}

impl DomainEvent for RevenueEvent {
    fn event_type(&self) -> &'static str {
        "RevenueRecorded"
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        let RevenueEvent::Recorded(recorded) = self;
        payload_of(recorded)
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<RevenueEvent, DecodeError> {
        if event_type != "RevenueRecorded" {
            return Err(DecodeError::UnknownType {
                event_type: event_type.to_owned(),
            });
        }
        expect_version(event_type, schema_version, 1)?;
        Ok(RevenueEvent::Recorded(parse_payload(event_type, payload)?))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::decider::given;

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn record(prepare: u64, movement: RevenueMovement, amount: i64) -> RecordMovement {
        RecordMovement {
            source_event_id: Uuid::from_u128(u128::from(prepare)),
            source_position: LogPosition {
                commit: prepare,
                prepare,
            },
            user_id: Uuid::from_u128(7),
            movement,
            reference_id: Uuid::from_u128(100 + u128::from(prepare)),
            amount: Amount::whole(amount),
            at: at(),
        }
    }

    fn recorded(command: &RecordMovement, total_after: i64) -> RevenueEvent {
        RevenueEvent::Recorded(RevenueRecorded {
            source_event_id: command.source_event_id,
            source_position: command.source_position,
            user_id: command.user_id,
            movement: command.movement,
            reference_id: command.reference_id,
            amount: command.amount,
            at: command.at,
            total_after: Points::whole(total_after),
        })
    }

    #[test]
    fn settled_holds_and_charges_add_to_revenue() {
        let settled = record(1, RevenueMovement::HoldSettled, 4);
        let charged = record(2, RevenueMovement::Charged, 5);
        given::<Revenue>(&[])
            .when(settled.clone())
            .then(&[recorded(&settled, 4)]);
        given::<Revenue>(&[recorded(&settled, 4)])
            .when(charged.clone())
            .then(&[recorded(&charged, 9)]);
    }

    #[test]
    fn refunds_take_from_revenue_but_never_below_zero() {
        let charged = record(1, RevenueMovement::Charged, 5);
        let refunded = record(2, RevenueMovement::Refunded, 5);
        given::<Revenue>(&[recorded(&charged, 5)])
            .when(refunded.clone())
            .then(&[recorded(&refunded, 0)]);
        let too_much = record(3, RevenueMovement::Refunded, 6);
        given::<Revenue>(&[recorded(&charged, 5)])
            .when(too_much)
            .then_error(RevenueError::RefundExceedsRevenue {
                total: Points::whole(5),
                required: Amount::whole(6),
            });
    }

    #[test]
    fn a_movement_at_or_before_the_last_recorded_position_is_a_repeat() {
        let first = record(1, RevenueMovement::HoldSettled, 4);
        let second = record(2, RevenueMovement::HoldSettled, 3);
        let past = [recorded(&first, 4), recorded(&second, 7)];
        given::<Revenue>(&past).when(second).then(&[]);
        given::<Revenue>(&past).when(first).then(&[]);
    }

    #[test]
    fn the_last_event_alone_gives_the_state() {
        let first = record(1, RevenueMovement::HoldSettled, 4);
        let second = record(2, RevenueMovement::Charged, 3);
        let events = [recorded(&first, 4), recorded(&second, 7)];
        assert_eq!(RevenueState::from_last(&events[1]), Revenue::fold(&events));
    }

    #[test]
    fn events_round_trip_through_storage() {
        let event = recorded(&record(9, RevenueMovement::Refunded, 2), 1);
        let back = RevenueEvent::from_stored(
            event.event_type(),
            event.schema_version(),
            &event.to_payload(),
        )
        .unwrap();
        assert_eq!(back, event);
        assert!(RevenueEvent::from_stored("RevenueRecorded", 2, &event.to_payload()).is_err());
    }
}
