//! How many webhook endpoints a user holds, decided once under any race: one stream per user
//! (`webhook-slots-<user id>`, [`EndpointSlots`]) records each endpoint taking a slot and freeing
//! it. Registrations sent at once (two processes, a script in a loop) append to this one stream
//! at expected versions, so the store lets them through one at a time and the limit holds;
//! counting rows of a read model that trails by moments let them all pass.
//!
//! Endpoints registered before slots were recorded hold none: a `Take` names the endpoints the
//! caller sees listed, and those count as well.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::decider::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::user::UserId;

/// The stream of a user's endpoint slots.
pub fn slots_stream(user_id: UserId) -> String {
    format!("webhook-slots-{user_id}")
}

pub const EVENT_TYPES: &[&str] = &["WebhookSlotTaken", "WebhookSlotFreed"];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotChanged {
    pub endpoint_id: Uuid,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotEvent {
    Taken(SlotChanged),
    Freed(SlotChanged),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotCommand {
    /// `endpoint_id` takes a slot unless `max` are taken, counting `listed` (the user's live
    /// endpoints as listed, which may hold ones older than slots) with the slots' own.
    Take {
        endpoint_id: Uuid,
        listed: Vec<Uuid>,
        max: u32,
        at: DateTime<Utc>,
    },
    Free {
        endpoint_id: Uuid,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("at most {max} webhook endpoints per user")]
    TooMany { max: u32 },
}

/// The endpoints holding a slot, with when each took it.
pub type Slots = BTreeMap<Uuid, DateTime<Utc>>;

#[derive(Debug, Clone, Copy)]
pub struct EndpointSlots;

impl Decider for EndpointSlots {
    type State = Slots;
    type Command = SlotCommand;
    type Event = SlotEvent;
    type Error = SlotError;

    fn initial_state() -> Slots {
        Slots::new()
    }

    fn decide(state: &Slots, command: &SlotCommand) -> Result<Vec<SlotEvent>, SlotError> {
        match command {
            SlotCommand::Take {
                endpoint_id,
                listed,
                max,
                at,
            } => {
                if state.contains_key(endpoint_id) {
                    return Ok(vec![]);
                }
                let held = state
                    .keys()
                    .chain(listed.iter().filter(|listed| *listed != endpoint_id))
                    .collect::<BTreeSet<_>>()
                    .len();
                if held >= *max as usize {
                    return Err(SlotError::TooMany { max: *max });
                }
                Ok(vec![SlotEvent::Taken(SlotChanged {
                    endpoint_id: *endpoint_id,
                    at: *at,
                })])
            }
            SlotCommand::Free { endpoint_id, at } => Ok(if state.contains_key(endpoint_id) {
                vec![SlotEvent::Freed(SlotChanged {
                    endpoint_id: *endpoint_id,
                    at: *at,
                })]
            } else {
                vec![]
            }),
        }
    }

    fn evolve(mut state: Slots, event: &SlotEvent) -> Slots {
        match event {
            SlotEvent::Taken(e) => {
                state.insert(e.endpoint_id, e.at);
            }
            SlotEvent::Freed(e) => {
                state.remove(&e.endpoint_id);
            }
        }
        state
    }
}

impl DomainEvent for SlotEvent {
    fn event_type(&self) -> &'static str {
        match self {
            SlotEvent::Taken(_) => "WebhookSlotTaken",
            SlotEvent::Freed(_) => "WebhookSlotFreed",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            SlotEvent::Taken(e) | SlotEvent::Freed(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<SlotEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "WebhookSlotTaken" => Ok(SlotEvent::Taken(parse_payload(event_type, payload)?)),
            "WebhookSlotFreed" => Ok(SlotEvent::Freed(parse_payload(event_type, payload)?)),
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

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn taken(n: u128) -> SlotEvent {
        SlotEvent::Taken(SlotChanged {
            endpoint_id: id(n),
            at: at(),
        })
    }

    fn take(n: u128, listed: &[u128]) -> SlotCommand {
        SlotCommand::Take {
            endpoint_id: id(n),
            listed: listed.iter().map(|n| id(*n)).collect(),
            max: 3,
            at: at(),
        }
    }

    #[test]
    fn an_endpoint_takes_a_slot_while_fewer_than_the_most_are_held_and_once() {
        given::<EndpointSlots>(&[taken(1), taken(2)])
            .when(take(3, &[]))
            .then(&[taken(3)]);
        given::<EndpointSlots>(&[taken(1), taken(2), taken(3)])
            .when(take(4, &[]))
            .then_error(SlotError::TooMany { max: 3 });
        given::<EndpointSlots>(&[taken(1), taken(2), taken(3)])
            .when(take(3, &[]))
            .then(&[]);
    }

    #[test]
    fn endpoints_older_than_slots_count_as_listed_and_are_not_counted_twice() {
        // Two old endpoints listed, one slot recorded: the third and last is 4.
        given::<EndpointSlots>(&[taken(1)])
            .when(take(4, &[1, 7, 8]))
            .then_error(SlotError::TooMany { max: 3 });
        given::<EndpointSlots>(&[taken(1)])
            .when(take(4, &[1, 7]))
            .then(&[taken(4)]);
    }

    #[test]
    fn a_freed_slot_is_taken_again_and_freeing_twice_is_nothing() {
        let freed = SlotEvent::Freed(SlotChanged {
            endpoint_id: id(1),
            at: at(),
        });
        given::<EndpointSlots>(&[taken(1), taken(2), taken(3), freed.clone()])
            .when(take(4, &[]))
            .then(&[taken(4)]);
        given::<EndpointSlots>(&[taken(1), freed])
            .when(SlotCommand::Free {
                endpoint_id: id(1),
                at: at(),
            })
            .then(&[]);
    }

    #[test]
    fn every_event_round_trips_through_its_payload() {
        for event in [
            taken(1),
            SlotEvent::Freed(SlotChanged {
                endpoint_id: id(2),
                at: at(),
            }),
        ] {
            let back = SlotEvent::from_stored(event.event_type(), 1, &event.to_payload()).unwrap();
            assert_eq!(back, event);
        }
    }
}
