//! Webhook endpoints, as events: where a user's program wants to be told of its tasks' ends and
//! its points, which kinds of events it wants, which secret generation signs them, and whether
//! it is enabled. One stream per endpoint (`webhook-<id>`, [`Endpoint`]).
//!
//! The secret itself is not here: it is derived from the server's signing key, the endpoint id
//! and the generation (the application's job), so no stored event ever holds it. A rotation
//! starts a new generation and keeps the previous one signing beside it until a given time, so
//! receivers can move to the new secret without missing a message.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::decider::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::user::UserId;

/// Longest endpoint URL.
pub const URL_LENGTH_MAX: usize = 2048;
/// Longest reason an endpoint was disabled for (shown to its owner).
pub const REASON_LENGTH_MAX: usize = 500;

/// The stream of an endpoint.
pub fn endpoint_stream(endpoint_id: Uuid) -> String {
    format!("webhook-{endpoint_id}")
}

/// What an endpoint may be told of. Closed: a type the server does not send cannot be asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WebhookEventType {
    #[serde(rename = "task.succeeded")]
    TaskSucceeded,
    #[serde(rename = "task.failed")]
    TaskFailed,
    #[serde(rename = "task.cancelled")]
    TaskCancelled,
    /// Points credited: an admin's grant, a code, a check-in bonus, a flash sale.
    #[serde(rename = "points.credited")]
    PointsCredited,
}

impl WebhookEventType {
    pub const ALL: [WebhookEventType; 4] = [
        WebhookEventType::TaskSucceeded,
        WebhookEventType::TaskFailed,
        WebhookEventType::TaskCancelled,
        WebhookEventType::PointsCredited,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WebhookEventType::TaskSucceeded => "task.succeeded",
            WebhookEventType::TaskFailed => "task.failed",
            WebhookEventType::TaskCancelled => "task.cancelled",
            WebhookEventType::PointsCredited => "points.credited",
        }
    }

    pub fn parse(text: &str) -> Option<WebhookEventType> {
        WebhookEventType::ALL
            .into_iter()
            .find(|kind| kind.as_str() == text)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EndpointState {
    pub endpoint_id: Option<Uuid>,
    pub user_id: Option<UserId>,
    pub url: String,
    pub event_types: Vec<WebhookEventType>,
    /// The secret generation that signs now.
    pub generation: u32,
    /// Until then the generation before also signs (a rotation's overlap).
    pub previous_until: Option<DateTime<Utc>>,
    pub disabled: Option<String>,
    pub removed: bool,
}

impl EndpointState {
    pub fn exists(&self) -> bool {
        self.endpoint_id.is_some() && !self.removed
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointCommand {
    /// The application checked the URL (its address) before.
    Register {
        endpoint_id: Uuid,
        user_id: UserId,
        url: String,
        event_types: Vec<WebhookEventType>,
        at: DateTime<Utc>,
    },
    RotateSecret {
        previous_until: DateTime<Utc>,
        at: DateTime<Utc>,
    },
    Disable {
        reason: String,
        at: DateTime<Utc>,
    },
    Enable {
        at: DateTime<Utc>,
    },
    Remove {
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRegistered {
    pub endpoint_id: Uuid,
    pub user_id: UserId,
    pub url: String,
    pub event_types: Vec<WebhookEventType>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretRotated {
    pub generation: u32,
    pub previous_until: DateTime<Utc>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointDisabled {
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointChanged {
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointEvent {
    Registered(EndpointRegistered),
    SecretRotated(SecretRotated),
    Disabled(EndpointDisabled),
    Enabled(EndpointChanged),
    Removed(EndpointChanged),
}

/// The event types of endpoint streams (the webhook router follows them).
pub const ENDPOINT_EVENT_TYPES: [&str; 5] = [
    "WebhookEndpointRegistered",
    "WebhookSecretRotated",
    "WebhookEndpointDisabled",
    "WebhookEndpointEnabled",
    "WebhookEndpointRemoved",
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("url: must be an http(s) URL of at most {URL_LENGTH_MAX} characters")]
    InvalidUrl,
    #[error(
        "event_types: at least one of task.succeeded, task.failed, task.cancelled, points.credited"
    )]
    NoEventTypes,
    #[error("endpoint {0} exists with other settings")]
    IdTaken(Uuid),
    #[error("no such webhook endpoint")]
    NotFound,
    #[error("previous_until: the old secret's overlap must end in the future")]
    OverlapInPast,
}

#[derive(Debug)]
pub struct Endpoint;

impl Decider for Endpoint {
    type State = EndpointState;
    type Command = EndpointCommand;
    type Event = EndpointEvent;
    type Error = EndpointError;

    fn initial_state() -> EndpointState {
        EndpointState::default()
    }

    fn decide(
        state: &EndpointState,
        command: &EndpointCommand,
    ) -> Result<Vec<EndpointEvent>, EndpointError> {
        match command {
            EndpointCommand::Register {
                endpoint_id,
                user_id,
                url,
                event_types,
                at,
            } => {
                let mut event_types = event_types.clone();
                event_types.sort();
                event_types.dedup();
                if state.endpoint_id.is_some() {
                    // A retried registration is done already; anything else is another one.
                    return if state.url == *url && state.event_types == event_types {
                        Ok(vec![])
                    } else {
                        Err(EndpointError::IdTaken(*endpoint_id))
                    };
                }
                let scheme_ok = url.starts_with("https://") || url.starts_with("http://");
                if !scheme_ok || url.len() > URL_LENGTH_MAX || url.chars().any(char::is_whitespace)
                {
                    return Err(EndpointError::InvalidUrl);
                }
                if event_types.is_empty() {
                    return Err(EndpointError::NoEventTypes);
                }
                Ok(vec![EndpointEvent::Registered(EndpointRegistered {
                    endpoint_id: *endpoint_id,
                    user_id: *user_id,
                    url: url.clone(),
                    event_types,
                    at: *at,
                })])
            }
            _ if !state.exists() => Err(EndpointError::NotFound),
            EndpointCommand::RotateSecret { previous_until, at } => {
                if previous_until <= at {
                    return Err(EndpointError::OverlapInPast);
                }
                Ok(vec![EndpointEvent::SecretRotated(SecretRotated {
                    generation: state.generation + 1,
                    previous_until: *previous_until,
                    at: *at,
                })])
            }
            EndpointCommand::Disable { reason, at } => {
                if state.disabled.is_some() {
                    return Ok(vec![]);
                }
                Ok(vec![EndpointEvent::Disabled(EndpointDisabled {
                    reason: reason.chars().take(REASON_LENGTH_MAX).collect(),
                    at: *at,
                })])
            }
            EndpointCommand::Enable { at } => {
                if state.disabled.is_none() {
                    return Ok(vec![]);
                }
                Ok(vec![EndpointEvent::Enabled(EndpointChanged { at: *at })])
            }
            EndpointCommand::Remove { at } => {
                Ok(vec![EndpointEvent::Removed(EndpointChanged { at: *at })])
            }
        }
    }

    fn evolve(mut state: EndpointState, event: &EndpointEvent) -> EndpointState {
        match event {
            EndpointEvent::Registered(e) => {
                state.endpoint_id = Some(e.endpoint_id);
                state.user_id = Some(e.user_id);
                state.url.clone_from(&e.url);
                state.event_types.clone_from(&e.event_types);
                state.generation = 1;
            }
            EndpointEvent::SecretRotated(e) => {
                state.generation = e.generation;
                state.previous_until = Some(e.previous_until);
            }
            EndpointEvent::Disabled(e) => state.disabled = Some(e.reason.clone()),
            EndpointEvent::Enabled(_) => state.disabled = None,
            EndpointEvent::Removed(_) => state.removed = true,
        }
        state
    }
}

impl DomainEvent for EndpointEvent {
    fn event_type(&self) -> &'static str {
        match self {
            EndpointEvent::Registered(_) => "WebhookEndpointRegistered",
            EndpointEvent::SecretRotated(_) => "WebhookSecretRotated",
            EndpointEvent::Disabled(_) => "WebhookEndpointDisabled",
            EndpointEvent::Enabled(_) => "WebhookEndpointEnabled",
            EndpointEvent::Removed(_) => "WebhookEndpointRemoved",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            EndpointEvent::Registered(e) => payload_of(e),
            EndpointEvent::SecretRotated(e) => payload_of(e),
            EndpointEvent::Disabled(e) => payload_of(e),
            EndpointEvent::Enabled(e) | EndpointEvent::Removed(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<EndpointEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "WebhookEndpointRegistered" => Ok(EndpointEvent::Registered(parse_payload(
                event_type, payload,
            )?)),
            "WebhookSecretRotated" => Ok(EndpointEvent::SecretRotated(parse_payload(
                event_type, payload,
            )?)),
            "WebhookEndpointDisabled" => {
                Ok(EndpointEvent::Disabled(parse_payload(event_type, payload)?))
            }
            "WebhookEndpointEnabled" => {
                Ok(EndpointEvent::Enabled(parse_payload(event_type, payload)?))
            }
            "WebhookEndpointRemoved" => {
                Ok(EndpointEvent::Removed(parse_payload(event_type, payload)?))
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

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn id() -> Uuid {
        Uuid::from_u128(42)
    }

    fn register(url: &str, types: Vec<WebhookEventType>) -> EndpointCommand {
        EndpointCommand::Register {
            endpoint_id: id(),
            user_id: UserId::from_uuid(Uuid::from_u128(1)),
            url: url.into(),
            event_types: types,
            at: at(0),
        }
    }

    fn registered() -> EndpointEvent {
        EndpointEvent::Registered(EndpointRegistered {
            endpoint_id: id(),
            user_id: UserId::from_uuid(Uuid::from_u128(1)),
            url: "https://shop.example/hooks".into(),
            event_types: vec![
                WebhookEventType::TaskSucceeded,
                WebhookEventType::PointsCredited,
            ],
            at: at(0),
        })
    }

    #[test]
    fn an_endpoint_is_registered_once_with_its_types_sorted() {
        given::<Endpoint>(&[])
            .when(register(
                "https://shop.example/hooks",
                vec![
                    WebhookEventType::PointsCredited,
                    WebhookEventType::TaskSucceeded,
                    WebhookEventType::PointsCredited,
                ],
            ))
            .then(&[registered()]);
        given::<Endpoint>(&[registered()])
            .when(register(
                "https://shop.example/hooks",
                vec![
                    WebhookEventType::TaskSucceeded,
                    WebhookEventType::PointsCredited,
                ],
            ))
            .then(&[]);
        given::<Endpoint>(&[registered()])
            .when(register(
                "https://other.example",
                vec![WebhookEventType::TaskFailed],
            ))
            .then_error(EndpointError::IdTaken(id()));
        given::<Endpoint>(&[])
            .when(register(
                "ftp://shop.example",
                vec![WebhookEventType::TaskFailed],
            ))
            .then_error(EndpointError::InvalidUrl);
        given::<Endpoint>(&[])
            .when(register("https://shop.example", vec![]))
            .then_error(EndpointError::NoEventTypes);
    }

    #[test]
    fn a_rotation_starts_a_generation_and_keeps_the_old_one_for_a_while() {
        given::<Endpoint>(&[registered()])
            .when(EndpointCommand::RotateSecret {
                previous_until: at(100),
                at: at(10),
            })
            .then(&[EndpointEvent::SecretRotated(SecretRotated {
                generation: 2,
                previous_until: at(100),
                at: at(10),
            })]);
        given::<Endpoint>(&[registered()])
            .when(EndpointCommand::RotateSecret {
                previous_until: at(5),
                at: at(10),
            })
            .then_error(EndpointError::OverlapInPast);
    }

    #[test]
    fn disabling_enabling_and_removing_are_idempotent_and_need_the_endpoint() {
        let disabled = EndpointEvent::Disabled(EndpointDisabled {
            reason: "410 Gone".into(),
            at: at(1),
        });
        given::<Endpoint>(&[registered()])
            .when(EndpointCommand::Disable {
                reason: "410 Gone".into(),
                at: at(1),
            })
            .then(std::slice::from_ref(&disabled));
        given::<Endpoint>(&[registered(), disabled.clone()])
            .when(EndpointCommand::Disable {
                reason: "again".into(),
                at: at(2),
            })
            .then(&[]);
        given::<Endpoint>(&[registered(), disabled])
            .when(EndpointCommand::Enable { at: at(3) })
            .then(&[EndpointEvent::Enabled(EndpointChanged { at: at(3) })]);
        given::<Endpoint>(&[])
            .when(EndpointCommand::Enable { at: at(3) })
            .then_error(EndpointError::NotFound);
        let removed = EndpointEvent::Removed(EndpointChanged { at: at(4) });
        given::<Endpoint>(&[registered(), removed])
            .when(EndpointCommand::Disable {
                reason: "x".into(),
                at: at(5),
            })
            .then_error(EndpointError::NotFound);
    }

    #[test]
    fn every_event_round_trips_through_its_payload() {
        let events = [
            registered(),
            EndpointEvent::SecretRotated(SecretRotated {
                generation: 2,
                previous_until: at(9),
                at: at(1),
            }),
            EndpointEvent::Disabled(EndpointDisabled {
                reason: "410".into(),
                at: at(2),
            }),
            EndpointEvent::Enabled(EndpointChanged { at: at(3) }),
            EndpointEvent::Removed(EndpointChanged { at: at(4) }),
        ];
        for event in events {
            let back =
                EndpointEvent::from_stored(event.event_type(), 1, &event.to_payload()).unwrap();
            assert_eq!(back, event);
            assert!(ENDPOINT_EVENT_TYPES.contains(&event.event_type()));
        }
    }
}
