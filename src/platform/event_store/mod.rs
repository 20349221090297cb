//! The event store: the ground truth of zhihui, behind one interface with two implementations.
//!
//! - [`postgres::PostgresEventStore`] (the default) keeps events in the same PostgreSQL database as
//!   the read models. Global order is gap-safe by construction (see ARCHITECTURE.md) and
//!   concurrent appends to different streams share transactions (group commit).
//! - [`kurrent::KurrentEventStore`] talks to KurrentDB / EventStoreDB with the `kurrentdb` gRPC
//!   client; selected when `event_store.url` starts with `kurrentdb://` or `esdb://`.
//!
//! The interface is shaped by what KurrentDB offers: an append is atomic for ONE stream, with an
//! expected version and event ids that make a retried append a no-op. Consistency across streams
//! is the job of process managers reacting to events, never of a transaction spanning streams.

pub mod kurrent;
pub mod postgres;
mod tail;

use anyhow::Context as _;
use std::fmt;

use chrono::{DateTime, Utc};
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Most events one append may carry. An aggregate decision produces a handful; a bigger batch is
/// a programming error, and KurrentDB's default maximum append size is bounded too.
pub const APPEND_EVENTS_MAX: usize = 1_000;

/// Longest stream name, in bytes. Stream names are built from a category and an id.
pub const STREAM_NAME_LENGTH_MAX: usize = 200;

/// What the appender believes about the stream before appending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpectedVersion {
    /// No check (KurrentDB `StreamState::Any`).
    Any,
    /// The stream must not exist yet.
    NoStream,
    /// The stream must exist, whatever its version.
    StreamExists,
    /// The stream's last event must have exactly this version (0-based).
    Exact(u64),
}

impl fmt::Display for ExpectedVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpectedVersion::Any => f.write_str("any"),
            ExpectedVersion::NoStream => f.write_str("no stream"),
            ExpectedVersion::StreamExists => f.write_str("stream exists"),
            ExpectedVersion::Exact(version) => write!(f, "{version}"),
        }
    }
}

/// The actual version of a stream when an expectation failed: `None` = the stream does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualVersion(pub Option<u64>);

impl fmt::Display for ActualVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(version) => write!(f, "{version}"),
            None => f.write_str("no stream"),
        }
    }
}

/// Who caused an event and why: carried by every event, set by the application.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventMetadata {
    /// The request or process that this event belongs to; shared by all its events.
    pub correlation_id: Uuid,
    /// The command or event that directly caused this event.
    pub causation_id: Option<Uuid>,
    /// Who did it: `user:<id>`, `admin:<id>`, `system:<component>`.
    pub actor: String,
}

/// An event to append. Its id makes a retried append idempotent.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub id: Uuid,
    /// Past-tense type name, e.g. `PointsFrozen`. Part of the compatibility boundary.
    pub event_type: String,
    /// Version of the payload's schema for this type; old versions are upcast on load.
    pub schema_version: u32,
    pub payload: zhihui_domain::event::Payload,
    pub metadata: EventMetadata,
}

/// A position in the global log. Ordered: `commit` first, then `prepare`.
///
/// KurrentDB: its commit and prepare positions. PostgreSQL: `commit` is the id (xid8) of the
/// transaction that wrote the event, `prepare` the event's sequence number; see ARCHITECTURE.md
/// for why this order is gap-safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Position {
    pub commit: u64,
    pub prepare: u64,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.commit, self.prepare)
    }
}

/// A stored event.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedEvent {
    pub id: Uuid,
    pub stream: String,
    pub event_type: String,
    pub schema_version: u32,
    pub payload: zhihui_domain::event::Payload,
    pub metadata: EventMetadata,
    /// When the store recorded it (the store's clock).
    pub recorded_at: DateTime<Utc>,
    /// Its version in its stream, 0-based.
    pub stream_version: u64,
    /// Its place in the global log.
    pub position: Position,
}

/// The result of a successful append (also of a retried, already stored one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    /// Version of the last event now in the stream: the expected version for the next append.
    pub stream_version: u64,
    /// Global position of the last appended event.
    pub position: Position,
    /// The store already held these event ids at these versions, so it stored nothing: a retry of
    /// an append that landed, or (ids that are not fresh: `DomainEvent::unique_id`) the same
    /// events appended by another writer. PostgreSQL tells; KurrentDB does not (always false).
    pub duplicate: bool,
}

/// Where a stream read starts (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    Start,
    End,
    Version(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Forwards,
    Backwards,
}

/// Which events of the global log a reader wants. Like KurrentDB's server-side filters, a filter
/// is on stream-name prefixes OR on event types, not both.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EventFilter {
    /// Every event of the application (KurrentDB: without `$`-prefixed system events).
    #[default]
    All,
    /// Events of streams whose name starts with one of these prefixes.
    StreamPrefixes(Vec<String>),
    /// Events of exactly these types.
    EventTypes(Vec<String>),
}

impl EventFilter {
    pub fn matches(&self, stream: &str, event_type: &str) -> bool {
        match self {
            EventFilter::All => true,
            EventFilter::StreamPrefixes(prefixes) => {
                prefixes.iter().any(|prefix| stream.starts_with(prefix))
            }
            EventFilter::EventTypes(types) => types.iter().any(|wanted| wanted == event_type),
        }
    }
}

/// One page of the global log.
#[derive(Debug, Clone, PartialEq)]
pub struct AllSlice {
    /// Events that passed the filter, in global order.
    pub events: Vec<RecordedEvent>,
    /// The last position read, matching or not: a filtered reader continues after it.
    pub scanned_to: Option<Position>,
    /// False when more events may follow right away (the page was full).
    pub end_of_log: bool,
}

/// What a subscription delivers.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriptionMessage {
    Event(Box<RecordedEvent>),
    /// Progress past events the filter skipped: safe to store as a checkpoint.
    Checkpoint(Position),
    /// Every event that existed when the subscription started has been delivered; live from here.
    CaughtUp,
}

#[derive(Debug, thiserror::Error)]
pub enum EventStoreError {
    #[error("stream {stream}: expected version {expected}, but it is at version {actual}")]
    WrongExpectedVersion {
        stream: String,
        expected: ExpectedVersion,
        actual: ActualVersion,
    },
    #[error("event id {event_id} is already used by a different append")]
    EventIdReused { event_id: Uuid },
    #[error("invalid append: {0}")]
    InvalidAppend(String),
    #[error("event store unavailable: {0:#}")]
    Unavailable(anyhow::Error),
}

impl EventStoreError {
    pub fn is_wrong_expected_version(&self) -> bool {
        matches!(self, EventStoreError::WrongExpectedVersion { .. })
    }
}

/// The one interface both stores implement. The conformance suite (`tests/api/event_store.rs`)
/// runs the same test functions against each.
pub trait EventStore: Send + Sync {
    /// Append `events` atomically to ONE stream if `expected` holds. Retrying an append with the
    /// same event ids and expectation stores nothing new and succeeds.
    fn append(
        &self,
        stream: &str,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> impl Future<Output = Result<AppendOutcome, EventStoreError>> + Send;

    /// At most `max_count` events of one stream; empty when the stream does not exist.
    fn read_stream(
        &self,
        stream: &str,
        direction: Direction,
        from: ReadFrom,
        max_count: usize,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>, EventStoreError>> + Send;

    /// At most `max_count` events of the global log strictly after `after` (from the beginning
    /// when `None`), forwards.
    fn read_all(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> impl Future<Output = Result<AllSlice, EventStoreError>> + Send;

    /// Catch up from `after`, then follow live. The stream ends only when the consumer drops it
    /// or on an error it reports.
    fn subscribe_all(
        &self,
        after: Option<Position>,
        filter: EventFilter,
    ) -> BoxStream<'static, Result<SubscriptionMessage, EventStoreError>>;

    /// Position of the last event a global-log reader can see now (`None`: empty log). A
    /// subscription from here delivers only what comes next (`zhihui events tail`).
    fn head(&self) -> impl Future<Output = Result<Option<Position>, EventStoreError>> + Send;
}

/// Checks shared by both stores before anything is sent.
pub(crate) fn validate_append(stream: &str, events: &[NewEvent]) -> Result<(), EventStoreError> {
    if stream.is_empty() || stream.len() > STREAM_NAME_LENGTH_MAX {
        return Err(EventStoreError::InvalidAppend(format!(
            "stream name must be 1 to {STREAM_NAME_LENGTH_MAX} bytes"
        )));
    }
    if stream.starts_with('$') {
        return Err(EventStoreError::InvalidAppend(
            "stream names starting with '$' are reserved".into(),
        ));
    }
    if events.is_empty() || events.len() > APPEND_EVENTS_MAX {
        return Err(EventStoreError::InvalidAppend(format!(
            "an append carries 1 to {APPEND_EVENTS_MAX} events"
        )));
    }
    let mut ids: Vec<Uuid> = events.iter().map(|event| event.id).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|pair| pair[0] == pair[1]) {
        return Err(EventStoreError::InvalidAppend(
            "event ids must be distinct within an append".into(),
        ));
    }
    if let Some(event) = events
        .iter()
        .find(|event| event.event_type.is_empty() || event.schema_version == 0)
    {
        return Err(EventStoreError::InvalidAppend(format!(
            "event {}: type must not be empty and schema version starts at 1",
            event.id
        )));
    }
    Ok(())
}

/// The configured store: PostgreSQL or KurrentDB. A closed enum, so callers need no boxing.
#[derive(Debug, Clone)]
pub enum AnyEventStore {
    Postgres(postgres::PostgresEventStore),
    Kurrent(kurrent::KurrentEventStore),
}

impl AnyEventStore {
    /// The store's kind, as the metrics label it.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyEventStore::Postgres(_) => "postgres",
            AnyEventStore::Kurrent(_) => "kurrentdb",
        }
    }

    /// Whether the store refuses an event id already used anywhere in the log (`EventIdReused`):
    /// PostgreSQL, by its unique key. KurrentDB checks ids per stream only (and only for recent
    /// appends), so a rule held by a unique event id needs a stream of its own there.
    pub fn event_ids_unique_across_streams(&self) -> bool {
        matches!(self, AnyEventStore::Postgres(_))
    }

    /// The event stored under `event_id`, where the store indexes ids across the log
    /// (PostgreSQL); `None` on KurrentDB, which has no such index (what is found by id there
    /// also has a stream of its own: see `event_ids_unique_across_streams`).
    pub async fn event_by_id(
        &self,
        event_id: Uuid,
    ) -> Result<Option<RecordedEvent>, EventStoreError> {
        match self {
            AnyEventStore::Postgres(store) => store.event_by_id(event_id).await,
            AnyEventStore::Kurrent(_) => Ok(None),
        }
    }
}

impl EventStore for AnyEventStore {
    async fn append(
        &self,
        stream: &str,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome, EventStoreError> {
        let started = std::time::Instant::now();
        let (store_kind, outcome) = match self {
            AnyEventStore::Postgres(store) => {
                ("postgres", store.append(stream, expected, events).await)
            }
            AnyEventStore::Kurrent(store) => {
                ("kurrentdb", store.append(stream, expected, events).await)
            }
        };
        let result = match &outcome {
            Ok(_) => "ok",
            Err(error) if error.is_wrong_expected_version() => "wrong_expected_version",
            Err(_) => "error",
        };
        metrics::histogram!(
            "zhihui_event_store_append_duration_seconds",
            "store" => store_kind,
            "result" => result
        )
        .record(started.elapsed().as_secs_f64());
        outcome
    }

    async fn read_stream(
        &self,
        stream: &str,
        direction: Direction,
        from: ReadFrom,
        max_count: usize,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        match self {
            AnyEventStore::Postgres(store) => {
                store.read_stream(stream, direction, from, max_count).await
            }
            AnyEventStore::Kurrent(store) => {
                store.read_stream(stream, direction, from, max_count).await
            }
        }
    }

    async fn read_all(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<AllSlice, EventStoreError> {
        match self {
            AnyEventStore::Postgres(store) => store.read_all(after, max_count, filter).await,
            AnyEventStore::Kurrent(store) => store.read_all(after, max_count, filter).await,
        }
    }

    async fn head(&self) -> Result<Option<Position>, EventStoreError> {
        match self {
            AnyEventStore::Postgres(store) => store.head().await,
            AnyEventStore::Kurrent(store) => store.head().await,
        }
    }

    fn subscribe_all(
        &self,
        after: Option<Position>,
        filter: EventFilter,
    ) -> BoxStream<'static, Result<SubscriptionMessage, EventStoreError>> {
        match self {
            AnyEventStore::Postgres(store) => store.subscribe_all(after, filter),
            AnyEventStore::Kurrent(store) => store.subscribe_all(after, filter),
        }
    }
}

/// Which store a URL selects: KurrentDB for `kurrentdb://`, `kurrent://`, `esdb://` (and their
/// `+discover` forms), PostgreSQL (the database of the read models) when empty.
pub fn selects_kurrentdb(url: &str) -> bool {
    let scheme = url.split("://").next().unwrap_or("");
    matches!(
        scheme.trim_end_matches("+discover"),
        "kurrentdb" | "kurrent" | "esdb"
    ) && url.contains("://")
}

/// The filter that reads what a projection needs.
pub fn filter_of(projection: zhihui_projections::ProjectionName) -> EventFilter {
    match projection.reads() {
        zhihui_projections::Reads::StreamPrefixes(prefixes) => {
            EventFilter::StreamPrefixes(prefixes)
        }
        zhihui_projections::Reads::EventTypes(types) => EventFilter::EventTypes(types),
    }
}

/// Build the configured store. PostgreSQL uses the given pool (the read models' database).
pub fn from_settings(
    settings: &crate::platform::configuration::Settings,
    pool: deadpool_postgres::Pool,
) -> anyhow::Result<AnyEventStore> {
    use secrecy::ExposeSecret;
    let url = settings.event_store.url.expose_secret();
    if selects_kurrentdb(url) {
        return Ok(AnyEventStore::Kurrent(kurrent::KurrentEventStore::connect(
            url,
        )?));
    }
    anyhow::ensure!(
        url.is_empty(),
        "event_store.url must be empty (PostgreSQL) or start with kurrentdb:// or esdb://"
    );
    Ok(AnyEventStore::Postgres(
        postgres::PostgresEventStore::start(
            pool,
            postgres::PostgresEventStoreOptions {
                group_commit: settings.event_store.group_commit,
                group_commit_max_batch: settings.event_store.group_commit_max_batch,
                group_commit_writers: settings.event_store.group_commit_writers,
                group_commit_one_statement: settings.event_store.group_commit_one_statement,
                append_retries_max: settings.event_store.append_retries_max,
                subscription_batch_size: settings.event_store.subscription_batch_size,
                subscription_tail_events: settings.event_store.subscription_tail_events,
                held_back_recheck_max_ms: settings.event_store.held_back_recheck_max_ms,
                subscription_idle_recheck_ms: settings.event_store.subscription_idle_recheck_ms,
                read_all_settle_max_ms: settings.event_store.read_all_settle_max_ms,
                listen_config: settings.database.pg_config()?,
                unknown_outcome_retry_max_ms: settings.database.failover_wait_ms,
            },
        ),
    ))
}

/// Events per read of a stream (loading one, reading it whole).
pub const STREAM_READ_PAGE_MAX: usize = 1_000;

/// Every event of `stream`, oldest first.
pub async fn read_whole_stream(
    store: &AnyEventStore,
    stream: &str,
) -> anyhow::Result<Vec<RecordedEvent>> {
    let mut events: Vec<RecordedEvent> = Vec::new();
    loop {
        let from = match events.last() {
            None => ReadFrom::Start,
            Some(last) => ReadFrom::Version(last.stream_version + 1),
        };
        let page = store
            .read_stream(stream, Direction::Forwards, from, STREAM_READ_PAGE_MAX)
            .await
            .with_context(|| format!("reading stream {stream}"))?;
        let full = page.len() == STREAM_READ_PAGE_MAX;
        events.extend(page);
        if !full {
            return Ok(events);
        }
    }
}
