//! The revenue recorder: the process manager that mirrors every settled hold, charge and refund of
//! the account streams into the `revenue` stream (see `domain/src/revenue.rs`).
//!
//! - It follows the global log (account streams only) in order and decides with the `Revenue`
//!   decider, appending each page's new events in one append with the expected version. The
//!   expected version is the fence: a second recorder that slipped past the leader lock gets a
//!   conflict, reloads, and finds the movements already recorded.
//! - Its progress is the revenue stream itself: the last event names the position of the account
//!   event it mirrors, so after any crash the recorder resumes right after it and records nothing
//!   twice. A hint row in `projection_checkpoints` (`process:revenue`) only saves re-scanning the
//!   pages without any movement after a restart; it is written after what it covers is recorded.
//! - A movement the decider refuses (a refund larger than the revenue: the streams disagree) stops
//!   the recorder loudly, like a poison event stops a projection.

use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::Pool;
use uuid::Uuid;
use zhihui_domain::account::AccountEvent;
use zhihui_domain::revenue::{
    LogPosition, REVENUE_STREAM, RecordMovement, Revenue, RevenueEvent, RevenueMovement,
    RevenueState,
};
use zhihui_domain::{Decider, DomainEvent};
use zhihui_projections::accounts::account_user_id;

use crate::platform::configuration::ProjectionSettings;
use crate::platform::event_store::{
    AnyEventStore, Direction, EventFilter, EventMetadata, EventStore, EventStoreError,
    ExpectedVersion, NewEvent, Position, ReadFrom, RecordedEvent,
};
use crate::platform::projector::BatchOutcome;

/// Name of the hint row and of the leader lock.
pub const REVENUE_RECORDER: &str = "process:revenue";
/// Appends tried per page before giving up for this round (each conflict means another writer
/// recorded something; reloading and deciding again is always correct).
pub const REVENUE_APPEND_ATTEMPTS_MAX: u32 = 8;

/// Namespace of revenue event ids: `v5(namespace, source event id)`, so the same movement can
/// never be stored twice under two ids.
const REVENUE_EVENT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x5a1e_5e7e_4a11_4d0b_9c33_7e7e_4b0e_0001);

/// A refusal of the revenue decider: retrying cannot help, so the recorder stops.
#[derive(Debug, thiserror::Error)]
#[error(
    "revenue recorder stopped at account event {source_event_id} ({stream}): {reason}; the account and revenue streams disagree"
)]
pub struct RevenueStopped {
    pub source_event_id: Uuid,
    pub stream: String,
    pub reason: String,
}

#[derive(Debug, Default)]
struct Cursor {
    loaded: bool,
    state: RevenueState,
    version: Option<u64>,
    /// Everything up to here has been looked at and its movements recorded.
    scanned_to: Option<Position>,
}

#[derive(Debug)]
pub struct RevenueRecorder {
    store: AnyEventStore,
    pool: Pool,
    settings: ProjectionSettings,
    cursor: tokio::sync::Mutex<Cursor>,
}

pub(crate) fn to_log_position(position: Position) -> LogPosition {
    LogPosition {
        commit: position.commit,
        prepare: position.prepare,
    }
}

fn to_position(position: LogPosition) -> Position {
    Position {
        commit: position.commit,
        prepare: position.prepare,
    }
}

/// Which revenue movement an account event is, if any.
pub fn revenue_movement(event: &AccountEvent) -> Option<RevenueMovement> {
    match event {
        AccountEvent::HoldSettled(_) => Some(RevenueMovement::HoldSettled),
        AccountEvent::Charged(_) => Some(RevenueMovement::Charged),
        AccountEvent::Refunded(_) => Some(RevenueMovement::Refunded),
        AccountEvent::Granted(_)
        | AccountEvent::Frozen(_)
        | AccountEvent::HoldReleased(_)
        | AccountEvent::Credited(_) => None,
    }
}

/// The revenue movement an account event makes, if any.
pub fn movement_of(recorded: &RecordedEvent) -> anyhow::Result<Option<RecordMovement>> {
    let Some(user_id) = account_user_id(&recorded.stream) else {
        return Ok(None);
    };
    let event = AccountEvent::from_stored(
        &recorded.event_type,
        recorded.schema_version,
        &recorded.payload,
    )
    .with_context(|| format!("decoding event {}", recorded.id))?;
    let Some(movement) = revenue_movement(&event) else {
        return Ok(None);
    };
    Ok(Some(RecordMovement {
        source_event_id: recorded.id,
        source_position: to_log_position(recorded.position),
        user_id,
        movement,
        reference_id: event.reference_id(),
        amount: event.amount(),
        at: event.at(),
    }))
}

impl RevenueRecorder {
    pub fn new(store: AnyEventStore, pool: Pool, settings: ProjectionSettings) -> RevenueRecorder {
        RevenueRecorder {
            store,
            pool,
            settings,
            cursor: tokio::sync::Mutex::new(Cursor::default()),
        }
    }

    fn filter() -> EventFilter {
        EventFilter::StreamPrefixes(vec!["account-".into()])
    }

    /// The revenue account as stored: its state (from the last event alone) and version.
    pub async fn load_state(store: &AnyEventStore) -> anyhow::Result<(RevenueState, Option<u64>)> {
        let last = store
            .read_stream(REVENUE_STREAM, Direction::Backwards, ReadFrom::End, 1)
            .await
            .context("reading the revenue stream")?;
        let Some(last) = last.first() else {
            return Ok((RevenueState::default(), None));
        };
        let event = RevenueEvent::from_stored(&last.event_type, last.schema_version, &last.payload)
            .with_context(|| format!("decoding revenue event {}", last.id))?;
        Ok((RevenueState::from_last(&event), Some(last.stream_version)))
    }

    async fn reload(&self, cursor: &mut Cursor) -> anyhow::Result<()> {
        let (state, version) = Self::load_state(&self.store).await?;
        let hint =
            crate::platform::projector::stored_position(&self.pool, REVENUE_RECORDER).await?;
        let recorded_through = state.recorded_through.map(to_position);
        cursor.scanned_to = recorded_through.max(hint);
        cursor.state = state;
        cursor.version = version;
        cursor.loaded = true;
        Ok(())
    }

    /// One step for tests: read a page of the log after the cursor and record its movements.
    pub async fn record_batch(&self) -> anyhow::Result<BatchOutcome> {
        let mut cursor = self.cursor.lock().await;
        if !cursor.loaded {
            self.reload(&mut cursor).await?;
        }
        let slice = self
            .store
            .read_all(cursor.scanned_to, self.settings.batch_size, &Self::filter())
            .await
            .context("reading the log")?;
        let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != cursor.scanned_to) else {
            return Ok(BatchOutcome::CaughtUp);
        };
        let recorded = self.record(&mut cursor, &slice.events, scanned_to).await?;
        Ok(BatchOutcome::Applied { events: recorded })
    }

    /// Steps until caught up; returns the number of revenue events appended.
    pub async fn catch_up(&self) -> anyhow::Result<u64> {
        let mut appended = 0u64;
        while let BatchOutcome::Applied { events } = self.record_batch().await? {
            appended += events as u64;
        }
        Ok(appended)
    }

    /// Record the movements of `events` (a page of the log ending at `scanned_to`).
    async fn record(
        &self,
        cursor: &mut Cursor,
        events: &[RecordedEvent],
        scanned_to: Position,
    ) -> anyhow::Result<usize> {
        let mut movements = Vec::new();
        for recorded in events {
            if let Some(movement) = movement_of(recorded)? {
                movements.push((movement, recorded));
            }
        }
        let mut appended = 0;
        if !movements.is_empty() {
            appended = self.append_movements(cursor, &movements).await?;
        }
        cursor.scanned_to = Some(scanned_to);
        crate::platform::projector::store_position(&self.pool, REVENUE_RECORDER, scanned_to)
            .await?;
        Ok(appended)
    }

    async fn append_movements(
        &self,
        cursor: &mut Cursor,
        movements: &[(RecordMovement, &RecordedEvent)],
    ) -> anyhow::Result<usize> {
        for _attempt in 0..REVENUE_APPEND_ATTEMPTS_MAX {
            let mut state = cursor.state.clone();
            let mut new_events = Vec::new();
            for (movement, source) in movements {
                let decided =
                    Revenue::decide(&state, movement).map_err(|error| RevenueStopped {
                        source_event_id: source.id,
                        stream: source.stream.clone(),
                        reason: error.to_string(),
                    })?;
                for event in decided {
                    state = Revenue::evolve(state, &event);
                    new_events.push(NewEvent {
                        id: Uuid::new_v5(&REVENUE_EVENT_ID_NAMESPACE, source.id.as_bytes()),
                        event_type: event.event_type().to_owned(),
                        schema_version: event.schema_version(),
                        payload: event.to_payload(),
                        metadata: EventMetadata {
                            correlation_id: source.metadata.correlation_id,
                            causation_id: Some(source.id),
                            actor: REVENUE_RECORDER.into(),
                        },
                    });
                }
            }
            if new_events.is_empty() {
                return Ok(0);
            }
            let expected = match cursor.version {
                None => ExpectedVersion::NoStream,
                Some(version) => ExpectedVersion::Exact(version),
            };
            let count = new_events.len();
            match self
                .store
                .append(REVENUE_STREAM, expected, new_events)
                .await
            {
                Ok(outcome) => {
                    cursor.state = state;
                    cursor.version = Some(outcome.stream_version);
                    return Ok(count);
                }
                Err(
                    EventStoreError::WrongExpectedVersion { .. }
                    | EventStoreError::EventIdReused { .. },
                ) => {
                    // Another writer recorded something: decide again on its state.
                    let scanned_to = cursor.scanned_to;
                    self.reload(cursor).await?;
                    cursor.scanned_to = scanned_to;
                }
                Err(error) => return Err(error).context("appending to the revenue stream"),
            }
        }
        anyhow::bail!(
            "the revenue stream stayed contended after {REVENUE_APPEND_ATTEMPTS_MAX} attempts"
        )
    }

    /// Run forever: wait to be the leader, then follow the log. Returns only when the decider
    /// refuses a movement (the streams disagree) or when the task is aborted.
    pub async fn run(self) -> anyhow::Result<()> {
        let takeover_check = Duration::from_millis(self.settings.takeover_check_ms);
        loop {
            let lock_connection = match crate::platform::leader::try_lead(
                &self.pool,
                REVENUE_RECORDER,
            )
            .await
            {
                Ok(Some(connection)) => connection,
                Ok(None) => {
                    tokio::time::sleep(takeover_check).await;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "cannot reach PostgreSQL to lead the revenue recorder");
                    tokio::time::sleep(takeover_check).await;
                    continue;
                }
            };
            tracing::info!("leading the revenue recorder");
            match self.lead(&lock_connection).await {
                Ok(()) => {}
                Err(error) if error.chain().any(|cause| cause.is::<RevenueStopped>()) => {
                    tracing::error!(error = %crate::platform::telemetry::error_chain(&error), "revenue recorder stopped");
                    crate::platform::leader::resign(lock_connection);
                    return Err(error);
                }
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "revenue recorder restarts");
                    self.cursor.lock().await.loaded = false;
                    tokio::time::sleep(takeover_check).await;
                }
            }
            crate::platform::leader::resign(lock_connection);
        }
    }

    async fn lead(
        &self,
        lock_connection: &crate::platform::leader::LeaderLock,
    ) -> anyhow::Result<()> {
        let mut cursor = self.cursor.lock().await;
        self.reload(&mut cursor).await?;
        let mut subscription = self.store.subscribe_all(cursor.scanned_to, Self::filter());
        let takeover_check = Duration::from_millis(self.settings.takeover_check_ms);
        loop {
            let batch = crate::platform::leader::next_batch(
                &mut subscription,
                lock_connection,
                takeover_check,
                self.settings.batch_size,
            )
            .await?;
            let events = batch.events;
            let scanned_to = batch.scanned_to;
            if let Some(scanned_to) = scanned_to.filter(|to| Some(*to) > cursor.scanned_to) {
                self.record(&mut cursor, &events, scanned_to).await?;
            }
        }
    }
}
