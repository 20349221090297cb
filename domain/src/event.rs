//! Stored events are a compatibility boundary: each event has a past-tense type name and a schema
//! version, and its payload is plain JSON. [`DomainEvent`] is how an aggregate's event enum crosses
//! that boundary both ways; `from_stored` is where old schema versions are upcast.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// JSON kept as its text (checked to be JSON), decoded only into the type that reads it. Reading
/// the log into a generic JSON tree first (and cloning that tree for each reader) was a third of
/// a busy server's allocations; the text is one allocation, shared by every clone.
#[derive(Clone)]
pub struct JsonText(Arc<RawValue>);

/// An event's payload: its JSON text, as written and as read back.
pub type Payload = JsonText;

impl JsonText {
    /// Serialize a value as a payload.
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<JsonText, serde_json::Error> {
        serde_json::value::to_raw_value(value).map(|raw| JsonText(raw.into()))
    }

    /// A payload from JSON text (checked to be JSON).
    pub fn from_json(text: String) -> Result<JsonText, serde_json::Error> {
        RawValue::from_string(text).map(|raw| JsonText(raw.into()))
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// Whether a string in it holds U+0000, which PostgreSQL's `jsonb` cannot store: the
    /// escape `\u0000` itself, not a text that merely reads `\u0000` (its backslash escaped).
    pub fn holds_nul(&self) -> bool {
        let text = self.as_str().as_bytes();
        let mut from = 0;
        while let Some(found) = self.as_str()[from..].find("\\u0000") {
            let at = from + found;
            let backslashes = text[..=at]
                .iter()
                .rev()
                .take_while(|&&b| b == b'\\')
                .count();
            if backslashes % 2 == 1 {
                return true;
            }
            from = at + 1;
        }
        false
    }

    /// As a JSON tree, for the few readers that want one (inspection, tests).
    pub fn to_value(&self) -> serde_json::Value {
        // The text was checked to be JSON when this payload was made.
        serde_json::from_str(self.as_str()).unwrap_or(serde_json::Value::Null)
    }
}

impl From<serde_json::Value> for JsonText {
    fn from(value: serde_json::Value) -> JsonText {
        JsonText::of(&value).unwrap_or_else(|error| {
            // A JSON tree always serializes.
            unreachable!("a JSON value failed to serialize: {error}")
        })
    }
}

/// Equal when the JSON is (the store may give back the text with its keys reordered and its
/// spacing changed: PostgreSQL's `jsonb` does).
impl PartialEq for JsonText {
    fn eq(&self, other: &JsonText) -> bool {
        self.as_str() == other.as_str() || self.to_value() == other.to_value()
    }
}

impl Eq for JsonText {}

impl std::fmt::Debug for JsonText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for JsonText {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for JsonText {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<JsonText, D::Error> {
        Box::<RawValue>::deserialize(deserializer).map(|raw| JsonText(raw.into()))
    }
}

/// An aggregate's events as they are stored.
pub trait DomainEvent: Sized {
    /// Past-tense type name, e.g. `UserRegistered`. Never renamed once stored.
    fn event_type(&self) -> &'static str;

    /// Schema version of the payload written today.
    fn schema_version(&self) -> u32;

    /// The payload as JSON.
    fn to_payload(&self) -> Payload;

    /// The id this event must be stored under, when the whole log may hold it at most once
    /// whichever stream it is appended to: the store refuses a second event with that id
    /// (PostgreSQL), which makes the event's existence the rule (a code's credit: one per code,
    /// whatever account tries). `None` (most events): a fresh id per append.
    fn unique_id(&self) -> Option<uuid::Uuid> {
        None
    }

    /// Read a stored event, upcasting older schema versions.
    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &Payload,
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
pub fn payload_of<T: Serialize>(payload: &T) -> Payload {
    Payload::of(payload).unwrap_or_else(|error| {
        // Payload structs contain only strings, numbers, ids and times: serialization cannot fail.
        unreachable!("event payload failed to serialize: {error}")
    })
}

/// Deserialize a payload struct, naming the event type when it does not fit.
pub fn parse_payload<T: DeserializeOwned>(
    event_type: &str,
    payload: &Payload,
) -> Result<T, DecodeError> {
    serde_json::from_str(payload.as_str()).map_err(|error| DecodeError::Payload {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Note {
        text: String,
        points: u32,
    }

    #[test]
    fn a_payload_is_the_same_json_whatever_order_and_spacing_the_store_gives_it_back_in() {
        let written = payload_of(&Note {
            text: "一只在雪地里奔跑的红狐狸".into(),
            points: 3,
        });
        // As PostgreSQL's jsonb prints it: shorter keys first, a space after each colon.
        let read =
            Payload::from_json(r#"{"text": "一只在雪地里奔跑的红狐狸", "points": 3}"#.into())
                .unwrap();
        assert_eq!(read, written);
        assert_ne!(read.as_str(), written.as_str());
        let other = Payload::from_json(r#"{"text": "一只猫", "points": 3}"#.into()).unwrap();
        assert_ne!(other, written);
    }

    #[test]
    fn a_payload_decodes_into_its_type_and_a_mismatch_names_the_event_type() {
        let read = Payload::from_json(r#"{"points": 3, "text": "红狐狸"}"#.into()).unwrap();
        let note: Note = parse_payload("NoteWritten", &read).unwrap();
        assert_eq!(
            note,
            Note {
                text: "红狐狸".into(),
                points: 3
            }
        );
        let wrong = Payload::from_json(r#"{"points": "三"}"#.into()).unwrap();
        let error = parse_payload::<Note>("NoteWritten", &wrong).unwrap_err();
        assert!(
            matches!(&error, DecodeError::Payload { event_type, .. } if event_type == "NoteWritten"),
            "{error:?}"
        );
    }

    #[test]
    fn text_that_is_not_json_is_no_payload() {
        assert!(Payload::from_json("{\"text\": ".into()).is_err());
    }

    #[test]
    fn a_payload_serializes_as_the_json_it_holds() {
        let payload = payload_of(&Note {
            text: "狐狸".into(),
            points: 1,
        });
        let shown = serde_json::to_string(&Shown { payload: &payload }).unwrap();
        let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(
            shown,
            serde_json::json!({ "payload": { "text": "狐狸", "points": 1 } })
        );
    }

    #[derive(Serialize)]
    struct Shown<'a> {
        payload: &'a Payload,
    }
}
