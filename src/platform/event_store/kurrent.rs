//! The KurrentDB / EventStoreDB event store, through the maintained `kurrentdb` gRPC client.
//!
//! Selected when `event_store.url` starts with `kurrentdb://` or `esdb://`; for a local
//! development server without TLS use `esdb://localhost:2113?tls=false`.
//!
//! Mapping: [`ExpectedVersion`] -> `StreamState`; our event ids are sent as KurrentDB event ids
//! (the server then ignores a retried append, which is our idempotency); schema version and
//! metadata travel as the event's custom JSON metadata; global positions are KurrentDB's
//! commit/prepare positions; filters are server-side `$all` filters. The mapping functions are
//! pure and unit-tested here, without a server; the conformance suite runs against a real server
//! whenever `KURRENTDB_URL` is set.

use anyhow::Context;
use chrono::{DateTime, Utc};
use futures::stream::BoxStream;
use kurrentdb::{
    AppendToStreamOptions, Client, ClientSettings, CurrentRevision, EventData, ReadAllOptions,
    ReadStreamOptions, StreamPosition, StreamState, SubscribeToAllOptions, SubscriptionEvent,
    SubscriptionFilter,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use uuid::Uuid;
use zhihui_domain::event::Payload;

use super::{
    ActualVersion, AllSlice, AppendOutcome, Direction, EventFilter, EventMetadata, EventStore,
    EventStoreError, ExpectedVersion, NewEvent, Position, ReadFrom, RecordedEvent,
    SubscriptionMessage, validate_append,
};

#[derive(Clone)]
pub struct KurrentEventStore {
    /// Boxed: the client is large and stores are moved around by value.
    client: Box<Client>,
}

impl std::fmt::Debug for KurrentEventStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The settings may carry credentials: print nothing of them.
        f.debug_struct("KurrentEventStore").finish_non_exhaustive()
    }
}

/// What we store in KurrentDB's custom metadata next to the payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredMetadata {
    pub schema_version: u32,
    #[serde(flatten)]
    pub metadata: EventMetadata,
}

impl KurrentEventStore {
    /// Parse the connection string and create the client (it connects lazily).
    pub fn connect(url: &str) -> anyhow::Result<KurrentEventStore> {
        let settings: ClientSettings = url
            .parse()
            .map_err(|error| anyhow::anyhow!("event_store.url is not a KurrentDB URL: {error}"))?;
        let client = Client::new(settings).map_err(|error| anyhow::anyhow!("{error}"))?;
        Ok(KurrentEventStore {
            client: Box::new(client),
        })
    }
}

/// Our expectation as KurrentDB's `StreamState`.
pub fn stream_state(expected: ExpectedVersion) -> StreamState {
    match expected {
        ExpectedVersion::Any => StreamState::Any,
        ExpectedVersion::NoStream => StreamState::NoStream,
        ExpectedVersion::StreamExists => StreamState::StreamExists,
        ExpectedVersion::Exact(version) => StreamState::StreamRevision(version),
    }
}

/// KurrentDB's position as ours (the same two numbers).
pub fn position_from(position: kurrentdb::Position) -> Position {
    Position {
        commit: position.commit,
        prepare: position.prepare,
    }
}

/// Ours as KurrentDB's.
pub fn position_to(position: Position) -> kurrentdb::Position {
    kurrentdb::Position {
        commit: position.commit,
        prepare: position.prepare,
    }
}

/// A client error as ours: version conflicts become the typed conflict, the rest "unavailable".
pub fn map_error(
    stream: &str,
    expected: ExpectedVersion,
    error: kurrentdb::Error,
) -> EventStoreError {
    match error {
        kurrentdb::Error::WrongExpectedVersion { current, .. } => {
            EventStoreError::WrongExpectedVersion {
                stream: stream.to_owned(),
                expected,
                actual: ActualVersion(match current {
                    CurrentRevision::Current(version) => Some(version),
                    CurrentRevision::NoStream => None,
                }),
            }
        }
        other => EventStoreError::Unavailable(anyhow::anyhow!("KurrentDB: {other}")),
    }
}

/// Our new event as KurrentDB event data (our id becomes its id: idempotency).
pub fn event_data(event: &NewEvent) -> Result<EventData, EventStoreError> {
    let stored = StoredMetadata {
        schema_version: event.schema_version,
        metadata: event.metadata.clone(),
    };
    EventData::json(event.event_type.as_str(), &event.payload)
        .and_then(|data| data.id(event.id).metadata_as_json(&stored))
        .map_err(|error| EventStoreError::InvalidAppend(format!("event {}: {error}", event.id)))
}

/// The parts of a KurrentDB recorded event, as ours.
#[allow(clippy::too_many_arguments)]
pub fn recorded_from_parts(
    stream: &str,
    id: Uuid,
    revision: u64,
    event_type: &str,
    data: &[u8],
    custom_metadata: &[u8],
    position: kurrentdb::Position,
    created: DateTime<Utc>,
) -> Result<RecordedEvent, EventStoreError> {
    let payload: Payload = serde_json::from_slice(data).map_err(|error| {
        EventStoreError::Unavailable(anyhow::anyhow!("event {id}: payload is not JSON: {error}"))
    })?;
    let stored: StoredMetadata = serde_json::from_slice(custom_metadata).map_err(|error| {
        EventStoreError::Unavailable(anyhow::anyhow!(
            "event {id}: metadata is not zhihui's: {error}"
        ))
    })?;
    Ok(RecordedEvent {
        id,
        stream: stream.to_owned(),
        event_type: event_type.to_owned(),
        schema_version: stored.schema_version,
        payload,
        metadata: stored.metadata,
        recorded_at: created,
        stream_version: revision,
        position: position_from(position),
    })
}

fn recorded(event: &kurrentdb::RecordedEvent) -> Result<RecordedEvent, EventStoreError> {
    recorded_from_parts(
        event.stream_id(),
        event.id,
        event.revision,
        &event.event_type,
        &event.data,
        &event.custom_metadata,
        event.position,
        event.created,
    )
}

/// Our filter as a server-side `$all` filter. `None`: everything but system events.
pub fn subscription_filter(filter: &EventFilter) -> SubscriptionFilter {
    match filter {
        EventFilter::All => SubscriptionFilter::on_event_type().exclude_system_events(),
        EventFilter::StreamPrefixes(prefixes) => prefixes
            .iter()
            .fold(SubscriptionFilter::on_stream_name(), |filter, prefix| {
                filter.add_prefix(prefix)
            }),
        EventFilter::EventTypes(types) => SubscriptionFilter::on_event_type().regex(format!(
            "^({})$",
            types
                .iter()
                .map(|event_type| regex_escape(event_type))
                .collect::<Vec<_>>()
                .join("|")
        )),
    }
}

fn regex_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        if "\\.+*?()|[]{}^$".contains(character) {
            escaped.push('\\');
        }
        escaped.push(character);
    }
    escaped
}

fn is_not_found(error: &kurrentdb::Error) -> bool {
    matches!(error, kurrentdb::Error::ResourceNotFound)
}

impl EventStore for KurrentEventStore {
    async fn append(
        &self,
        stream: &str,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome, EventStoreError> {
        validate_append(stream, &events)?;
        let data = events
            .iter()
            .map(event_data)
            .collect::<Result<Vec<_>, _>>()?;
        let options = AppendToStreamOptions::default().stream_state(stream_state(expected));
        let result = self
            .client
            .append_to_stream(stream.to_owned(), &options, data)
            .await
            .map_err(|error| map_error(stream, expected, error))?;
        Ok(AppendOutcome {
            stream_version: result.next_expected_version,
            position: position_from(result.position),
            // KurrentDB answers a repeated append like a new one.
            duplicate: false,
        })
    }

    async fn read_stream(
        &self,
        stream: &str,
        direction: Direction,
        from: ReadFrom,
        max_count: usize,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        let position = match from {
            ReadFrom::Start => StreamPosition::Start,
            ReadFrom::End => StreamPosition::End,
            ReadFrom::Version(version) => StreamPosition::Position(version),
        };
        let options = ReadStreamOptions::default()
            .position(position)
            .max_count(max_count);
        let options = match direction {
            Direction::Forwards => options.forwards(),
            Direction::Backwards => options.backwards(),
        };
        let mut read = match self.client.read_stream(stream.to_owned(), &options).await {
            Ok(read) => read,
            Err(error) if is_not_found(&error) => return Ok(Vec::new()),
            Err(error) => return Err(map_error(stream, ExpectedVersion::Any, error)),
        };
        let mut events = Vec::new();
        loop {
            match read.next().await {
                Ok(Some(resolved)) => events.push(recorded(resolved.get_original_event())?),
                Ok(None) => return Ok(events),
                Err(error) if is_not_found(&error) => return Ok(Vec::new()),
                Err(error) => return Err(map_error(stream, ExpectedVersion::Any, error)),
            }
        }
    }

    async fn head(&self) -> Result<Option<Position>, EventStoreError> {
        let options = ReadAllOptions::default()
            .backwards()
            .position(StreamPosition::End)
            .max_count(1);
        let mut read = self
            .client
            .read_all(&options)
            .await
            .map_err(|error| map_error("$all", ExpectedVersion::Any, error))?;
        Ok(read
            .next()
            .await
            .map_err(|error| map_error("$all", ExpectedVersion::Any, error))?
            .map(|resolved| resolved.get_original_event().position)
            .map(position_from))
    }

    async fn read_all(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<AllSlice, EventStoreError> {
        let start = after.map_or(StreamPosition::Start, |position| {
            StreamPosition::Position(position_to(position))
        });
        // One more than asked: KurrentDB's position is inclusive, ours exclusive.
        let options = ReadAllOptions::default()
            .forwards()
            .position(start)
            .max_count(max_count + 1)
            .filter(subscription_filter(filter));
        let mut read = self
            .client
            .read_all(&options)
            .await
            .map_err(|error| map_error("$all", ExpectedVersion::Any, error))?;
        let mut events = Vec::new();
        while let Some(resolved) = read
            .next()
            .await
            .map_err(|error| map_error("$all", ExpectedVersion::Any, error))?
        {
            let event = recorded(resolved.get_original_event())?;
            if after.is_some_and(|after| event.position <= after) {
                continue;
            }
            if events.len() < max_count {
                events.push(event);
            } else {
                break;
            }
        }
        let scanned_to = events
            .last()
            .map(|event: &RecordedEvent| event.position)
            .or(after);
        let end_of_log = events.len() < max_count;
        Ok(AllSlice {
            events,
            scanned_to: if scanned_to == after {
                None
            } else {
                scanned_to
            },
            end_of_log,
        })
    }

    fn subscribe_all(
        &self,
        after: Option<Position>,
        filter: EventFilter,
    ) -> BoxStream<'static, Result<SubscriptionMessage, EventStoreError>> {
        const SUBSCRIPTION_BUFFER: usize = 512;
        let (sender, mut receiver) = mpsc::channel(SUBSCRIPTION_BUFFER);
        let client = (*self.client).clone();
        tokio::spawn(async move {
            let start = after.map_or(StreamPosition::Start, |position| {
                StreamPosition::Position(position_to(position))
            });
            let options = SubscribeToAllOptions::default()
                .position(start)
                .filter(subscription_filter(&filter));
            let mut subscription = client.subscribe_to_all(&options).await;
            loop {
                let message = match subscription.next_subscription_event().await {
                    Ok(SubscriptionEvent::EventAppeared(resolved)) => {
                        recorded(resolved.get_original_event())
                            .map(|event| SubscriptionMessage::Event(Box::new(event)))
                    }
                    Ok(SubscriptionEvent::Checkpoint(position)) => {
                        Ok(SubscriptionMessage::Checkpoint(position_from(position)))
                    }
                    Ok(SubscriptionEvent::CaughtUp(_)) => Ok(SubscriptionMessage::CaughtUp),
                    Ok(_) => continue,
                    Err(error) => Err(map_error("$all", ExpectedVersion::Any, error)),
                };
                let failed = message.is_err();
                if sender.send(message).await.is_err() || failed {
                    return;
                }
            }
        });
        Box::pin(futures::stream::poll_fn(move |cx| receiver.poll_recv(cx)))
    }
}

/// A quick round trip for readiness checks.
pub async fn ping(store: &KurrentEventStore) -> anyhow::Result<()> {
    store
        .client
        .server_info()
        .await
        .map(|_| ())
        .context("KurrentDB server info")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> EventMetadata {
        EventMetadata {
            correlation_id: Uuid::from_u128(7),
            causation_id: Some(Uuid::from_u128(8)),
            actor: "user:1".into(),
        }
    }

    #[test]
    fn expected_versions_map_to_stream_states() {
        assert!(matches!(
            stream_state(ExpectedVersion::Any),
            StreamState::Any
        ));
        assert!(matches!(
            stream_state(ExpectedVersion::NoStream),
            StreamState::NoStream
        ));
        assert!(matches!(
            stream_state(ExpectedVersion::StreamExists),
            StreamState::StreamExists
        ));
        assert!(matches!(
            stream_state(ExpectedVersion::Exact(41)),
            StreamState::StreamRevision(41)
        ));
    }

    #[test]
    fn positions_round_trip_and_keep_their_order() {
        let low = Position {
            commit: 10,
            prepare: 9,
        };
        let high = Position {
            commit: 11,
            prepare: 2,
        };
        assert_eq!(position_from(position_to(low)), low);
        assert!(position_from(position_to(low)) < position_from(position_to(high)));
    }

    #[test]
    fn wrong_expected_version_becomes_the_typed_conflict() {
        let error = kurrentdb::Error::WrongExpectedVersion {
            expected: StreamState::StreamRevision(3),
            current: CurrentRevision::Current(5),
        };
        match map_error("account-1", ExpectedVersion::Exact(3), error) {
            EventStoreError::WrongExpectedVersion {
                stream,
                expected,
                actual,
            } => {
                assert_eq!(stream, "account-1");
                assert_eq!(expected, ExpectedVersion::Exact(3));
                assert_eq!(actual, ActualVersion(Some(5)));
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
        let error = kurrentdb::Error::WrongExpectedVersion {
            expected: StreamState::StreamExists,
            current: CurrentRevision::NoStream,
        };
        assert!(matches!(
            map_error("s", ExpectedVersion::StreamExists, error),
            EventStoreError::WrongExpectedVersion {
                actual: ActualVersion(None),
                ..
            }
        ));
        assert!(matches!(
            map_error(
                "s",
                ExpectedVersion::Any,
                kurrentdb::Error::DeadlineExceeded
            ),
            EventStoreError::Unavailable(_)
        ));
    }

    #[test]
    fn event_data_carries_our_id_and_a_recorded_event_reads_back() {
        let event = NewEvent {
            id: Uuid::from_u128(42),
            event_type: "PointsGranted".into(),
            schema_version: 2,
            payload: serde_json::json!({"amount": "10.00"}).into(),
            metadata: metadata(),
        };
        event_data(&event).expect("valid event data");
        let custom = serde_json::to_vec(&StoredMetadata {
            schema_version: 2,
            metadata: metadata(),
        })
        .expect("serialize");
        let created = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).expect("timestamp");
        let recorded = recorded_from_parts(
            "account-1",
            event.id,
            4,
            "PointsGranted",
            br#"{"amount":"10.00"}"#,
            &custom,
            kurrentdb::Position {
                commit: 100,
                prepare: 99,
            },
            created,
        )
        .expect("maps");
        assert_eq!(recorded.id, event.id);
        assert_eq!(recorded.schema_version, 2);
        assert_eq!(recorded.metadata, metadata());
        assert_eq!(recorded.payload, event.payload);
        assert_eq!(recorded.stream_version, 4);
        assert_eq!(
            recorded.position,
            Position {
                commit: 100,
                prepare: 99
            }
        );
        assert_eq!(recorded.recorded_at, created);
    }

    #[test]
    fn foreign_metadata_is_an_error_not_a_silent_default() {
        let result = recorded_from_parts(
            "s",
            Uuid::nil(),
            0,
            "T",
            b"{}",
            b"{\"something\":1}",
            kurrentdb::Position {
                commit: 1,
                prepare: 1,
            },
            Utc::now(),
        );
        assert!(result.is_err());
    }

    #[test]
    fn event_type_filters_are_anchored_and_escaped() {
        assert_eq!(regex_escape("a.b$"), "a\\.b\\$");
        // The filter itself is opaque; building one for each kind must not panic.
        let _ = subscription_filter(&EventFilter::All);
        let _ = subscription_filter(&EventFilter::StreamPrefixes(vec!["account-".into()]));
        let _ = subscription_filter(&EventFilter::EventTypes(vec!["PointsFrozen".into()]));
    }

    #[test]
    fn urls_select_the_store() {
        assert!(super::super::selects_kurrentdb(
            "esdb://localhost:2113?tls=false"
        ));
        assert!(super::super::selects_kurrentdb(
            "kurrentdb://admin:changeit@h:2113"
        ));
        assert!(super::super::selects_kurrentdb("esdb+discover://h:2113"));
        assert!(!super::super::selects_kurrentdb(""));
        assert!(!super::super::selects_kurrentdb("postgres://h/db"));
    }
}
