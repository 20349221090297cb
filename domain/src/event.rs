//! Stored events are a compatibility boundary: each event has a past-tense type name and a schema
//! version, and its payload is plain JSON. [`DomainEvent`] is how an aggregate's event enum crosses
//! that boundary both ways; `from_stored` is where old schema versions are upcast.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// An aggregate's events as they are stored.
pub trait DomainEvent: Sized {
    /// Past-tense type name, e.g. `UserRegistered`. Never renamed once stored.
    fn event_type(&self) -> &'static str;

    /// Schema version of the payload written today.
    fn schema_version(&self) -> u32;

    /// The payload as JSON.
    fn to_payload(&self) -> serde_json::Value;

    /// Read a stored event, upcasting older schema versions.
    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &serde_json::Value,
    ) -> Result<Self, DecodeError>;
}

/// A stored event this build cannot read: a bug or a newer writer, never silently skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("unknown event type {event_type:?}")]
    UnknownType { event_type: String },
    #[error("event type {event_type:?} has no schema version {schema_version}")]
    UnknownVersion {
        event_type: String,
        schema_version: u32,
    },
    #[error("event type {event_type:?}: payload does not match its schema: {message}")]
    Payload { event_type: String, message: String },
}

/// Serialize a payload struct. Payload structs are plain data; failing here is a programming error.
pub fn payload_of<T: Serialize>(payload: &T) -> serde_json::Value {
    serde_json::to_value(payload).unwrap_or_else(|error| {
        // Payload structs contain only strings, numbers, ids and times: serialization cannot fail.
        unreachable!("event payload failed to serialize: {error}")
    })
}

/// Deserialize a payload struct, naming the event type when it does not fit.
pub fn parse_payload<T: DeserializeOwned>(
    event_type: &str,
    payload: &serde_json::Value,
) -> Result<T, DecodeError> {
    T::deserialize(payload).map_err(|error| DecodeError::Payload {
        event_type: event_type.to_owned(),
        message: error.to_string(),
    })
}

/// Refuse a schema version this build does not know.
pub fn expect_version(
    event_type: &str,
    schema_version: u32,
    known: u32,
) -> Result<(), DecodeError> {
    if schema_version == known {
        Ok(())
    } else {
        Err(DecodeError::UnknownVersion {
            event_type: event_type.to_owned(),
            schema_version,
        })
    }
}
