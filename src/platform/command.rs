//! Command handling: load a stream, fold it, let the decider decide, append with the expected
//! version; on a concurrency conflict reload and decide again.
//!
//! The retry loop is why no client ever sees a concurrency error: a conflict only means someone
//! else's event landed first, and deciding again on the newer state is always correct. Retries are
//! bounded (`attempts_max`) and spread with jitter so that many clients on one stream do not retry
//! in lockstep.

use std::time::Duration;

use anyhow::Context;
use rand::Rng;
use uuid::Uuid;
use zhihui_domain::{Decider, DomainEvent};

use crate::platform::event_store::{
    AnyEventStore, Direction, EventMetadata, EventStore, EventStoreError, ExpectedVersion,
    NewEvent, ReadFrom,
};

pub use crate::platform::event_store::STREAM_READ_PAGE_MAX;

/// How hard to try when other writers keep winning the race for a stream.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub attempts_max: u32,
    /// First backoff; doubles per attempt, with full jitter.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            attempts_max: 64,
            backoff_base: Duration::from_millis(1),
            backoff_max: Duration::from_millis(50),
        }
    }
}

/// A stream's state and the version its last event has (`None`: no event yet).
#[derive(Debug)]
pub struct Loaded<S> {
    pub state: S,
    pub version: Option<u64>,
}

/// What a successful command did.
#[derive(Debug)]
pub struct Executed<D: Decider> {
    /// The state after the new events (equal to the loaded state when nothing happened).
    pub state: D::State,
    /// The new events; empty when the command was already done (idempotent repeat).
    pub new_events: Vec<D::Event>,
    /// The stream's version after them (its last event's), `None` while it has none: what a
    /// derived copy applying them in any order compares to keep the newest.
    pub version: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum CommandError<E> {
    /// The decider refused: the caller shows this rule to the user.
    #[error(transparent)]
    Rejected(E),
    /// Still conflicting after every retry. Sized so that it does not happen under the
    /// documented load; if it does, it is our failure (503), not the user's.
    #[error("stream {stream} stayed contended after {attempts} attempts")]
    Contended { stream: String, attempts: u32 },
    #[error(transparent)]
    Store(#[from] anyhow::Error),
}

/// A stream still conflicting after every retry, as an error of its own: the HTTP layer answers it
/// 503 (try again), never 500.
#[derive(Debug, thiserror::Error)]
#[error("stream {stream} stayed contended after {attempts} attempts")]
pub struct StreamContended {
    pub stream: String,
    pub attempts: u32,
}

impl<E: std::error::Error + Send + Sync + 'static> CommandError<E> {
    /// The failure as an `anyhow::Error` whose cause chain still holds what the store said: a
    /// store's own error as it came (wrapping the whole `CommandError` would hide it, since
    /// `Store` is transparent and forwards only its inner error's sources), contention as
    /// [`StreamContended`]. `context` says what was being done.
    pub fn into_anyhow(
        self,
        context: impl std::fmt::Display + Send + Sync + 'static,
    ) -> anyhow::Error {
        match self {
            CommandError::Store(error) => error.context(context),
            CommandError::Contended { stream, attempts } => {
                anyhow::Error::new(StreamContended { stream, attempts }).context(context)
            }
            CommandError::Rejected(error) => anyhow::Error::new(error).context(context),
        }
    }
}

/// A stream known not to exist yet (its id was just made): the state an append expecting
/// "no stream" is decided on without reading it. Should it exist after all, that append is
/// refused and [`execute_on`] reads it and decides again.
pub fn unwritten<D: Decider>() -> Loaded<D::State> {
    Loaded {
        state: D::initial_state(),
        version: None,
    }
}

/// Load and fold a whole stream.
pub async fn load<D>(store: &AnyEventStore, stream: &str) -> anyhow::Result<Loaded<D::State>>
where
    D: Decider,
    D::Event: DomainEvent,
{
    catch_up::<D>(store, stream, D::initial_state(), None).await
}

/// Fold the events of `stream` after `version` into `state`.
pub async fn catch_up<D>(
    store: &AnyEventStore,
    stream: &str,
    state: D::State,
    version: Option<u64>,
) -> anyhow::Result<Loaded<D::State>>
where
    D: Decider,
    D::Event: DomainEvent,
{
    catch_up_inspecting::<D>(store, stream, state, version, |_| {}).await
}

/// Load and fold a whole stream, showing each event to `inspect` on the way (for what the
/// state does not keep, such as a task's workflow): one read where two would otherwise be made.
pub async fn load_inspecting<D>(
    store: &AnyEventStore,
    stream: &str,
    inspect: impl FnMut(&D::Event),
) -> anyhow::Result<Loaded<D::State>>
where
    D: Decider,
    D::Event: DomainEvent,
{
    catch_up_inspecting::<D>(store, stream, D::initial_state(), None, inspect).await
}

async fn catch_up_inspecting<D>(
    store: &AnyEventStore,
    stream: &str,
    mut state: D::State,
    mut version: Option<u64>,
    mut inspect: impl FnMut(&D::Event),
) -> anyhow::Result<Loaded<D::State>>
where
    D: Decider,
    D::Event: DomainEvent,
{
    loop {
        let from = match version {
            None => ReadFrom::Start,
            Some(last) => ReadFrom::Version(last + 1),
        };
        let page = store
            .read_stream(stream, Direction::Forwards, from, STREAM_READ_PAGE_MAX)
            .await
            .with_context(|| format!("reading stream {stream}"))?;
        let page_len = page.len();
        for recorded in page {
            let expected_version = version.map_or(0, |last| last + 1);
            assert_eq!(
                recorded.stream_version, expected_version,
                "stream {stream} is not contiguous"
            );
            let event = D::Event::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(|| format!("decoding event {} of {stream}", recorded.id))?;
            inspect(&event);
            state = D::evolve(state, &event);
            version = Some(recorded.stream_version);
        }
        if page_len < STREAM_READ_PAGE_MAX {
            return Ok(Loaded { state, version });
        }
    }
}

/// Encode domain events for the store, with fresh time-ordered ids.
pub fn to_new_events<E: DomainEvent>(events: &[E], metadata: &EventMetadata) -> Vec<NewEvent> {
    events
        .iter()
        .map(|event| NewEvent {
            // An event the log may hold once carries its own id; every other a fresh one.
            id: event.unique_id().unwrap_or_else(Uuid::now_v7),
            event_type: event.event_type().to_owned(),
            schema_version: event.schema_version(),
            payload: event.to_payload(),
            metadata: metadata.clone(),
        })
        .collect()
}

/// Refuses events the store cannot hold (a NUL inside a text): a bug upstream, since every text
/// field refuses control characters, and one that must fail only its own command, never the
/// others batched into the same append.
pub(crate) fn storable(events: &[NewEvent]) -> anyhow::Result<()> {
    match events.iter().find(|event| event.payload.holds_nul()) {
        Some(event) => Err(anyhow::anyhow!(
            "a {} event holds a NUL character, which the event store cannot hold",
            event.event_type
        )),
        None => Ok(()),
    }
}

/// Load, decide, append; on a version conflict, again (see the module comment).
pub async fn execute<D>(
    store: &AnyEventStore,
    stream: &str,
    command: &D::Command,
    metadata: &EventMetadata,
    policy: RetryPolicy,
) -> Result<Executed<D>, CommandError<D::Error>>
where
    D: Decider,
    D::Event: DomainEvent,
{
    let loaded = load::<D>(store, stream).await?;
    execute_on::<D>(store, stream, loaded, command, metadata, policy).await
}

/// [`execute`] on a state the caller has just loaded: the first attempt appends without reading
/// the stream again; a conflict reloads as usual.
pub async fn execute_on<D>(
    store: &AnyEventStore,
    stream: &str,
    mut loaded: Loaded<D::State>,
    command: &D::Command,
    metadata: &EventMetadata,
    policy: RetryPolicy,
) -> Result<Executed<D>, CommandError<D::Error>>
where
    D: Decider,
    D::Event: DomainEvent,
{
    for attempt in 1..=policy.attempts_max {
        if attempt > 1 {
            loaded = load::<D>(store, stream).await?;
        }
        let new_events = D::decide(&loaded.state, command).map_err(CommandError::Rejected)?;
        if new_events.is_empty() {
            return Ok(Executed {
                state: loaded.state,
                new_events,
                version: loaded.version,
            });
        }
        let expected = match loaded.version {
            None => ExpectedVersion::NoStream,
            Some(version) => ExpectedVersion::Exact(version),
        };
        let encoded = to_new_events(&new_events, metadata);
        storable(&encoded).map_err(CommandError::Store)?;
        match store.append(stream, expected, encoded).await {
            Ok(_) => {
                let appended = new_events.len() as u64;
                let version = Some(loaded.version.map_or(appended - 1, |last| last + appended));
                let state = new_events.iter().fold(loaded.state, D::evolve);
                return Ok(Executed {
                    state,
                    new_events,
                    version,
                });
            }
            Err(EventStoreError::WrongExpectedVersion { .. }) => {
                backoff(policy, attempt).await;
            }
            Err(error) => {
                return Err(CommandError::Store(
                    anyhow::Error::new(error).context(format!("appending to {stream}")),
                ));
            }
        }
    }
    Err(CommandError::Contended {
        stream: stream.to_owned(),
        attempts: policy.attempts_max,
    })
}

/// Full jitter: a random wait in `[0, min(max, base * 2^attempt))`.
pub(crate) async fn backoff(policy: RetryPolicy, attempt: u32) {
    let ceiling = policy
        .backoff_base
        .saturating_mul(1u32 << attempt.min(16))
        .min(policy.backoff_max);
    let ceiling_us = u64::try_from(ceiling.as_micros())
        .unwrap_or(u64::MAX)
        .max(1);
    let wait_us = rand::rng().random_range(0..ceiling_us);
    tokio::time::sleep(Duration::from_micros(wait_us)).await;
}
