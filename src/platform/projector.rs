//! The projection runner: follows the global log from a projection's checkpoint and applies it in
//! batches, writing the read-model rows and the checkpoint in ONE PostgreSQL transaction.
//!
//! - Exactly one instance of each projection runs across all zhihui processes: the leader holds a
//!   session advisory lock on a dedicated connection; when that process dies its connection
//!   closes, the lock is released and another process takes over on its next check. As a second
//!   guard, every batch locks the checkpoint row and checks that it still is where this runner
//!   left it: a runner that lost its lock without noticing cannot apply anything twice.
//! - Live, the runner reads from a subscription (woken by new commits), so the lag is a commit
//!   away; [`Projector::project_batch`] reads one page with `read_all`, for tests (driven step by
//!   step) and for replay.
//! - A batch that fails is retried; if it keeps failing, its events are applied one by one to find
//!   the poison event, and the projection stops, naming that event in the log and in its
//!   checkpoint row (`stopped_reason`). It never skips an event.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use serde::Serialize;
use zhihui_projections::{ProjectedEvent, ProjectionName, Reads, Tables};

use crate::platform::configuration::ProjectionSettings;
use crate::platform::event_store::{
    AnyEventStore, EventFilter, EventStore, Position, RecordedEvent,
};

/// Why a runner must not go on with a batch: retrying cannot help, so these are never retried.
#[derive(Debug, thiserror::Error)]
pub enum Halt {
    /// Stopped on a poison event (now, or by an earlier run: `stopped_reason` is set).
    #[error(
        "projection {projection} is stopped: {reason}; fix the cause, then clear stopped_reason or replay"
    )]
    Stopped { projection: String, reason: String },
    /// The checkpoint is not where this runner left it: another runner moved it.
    #[error(
        "projection {projection}: checkpoint moved to {found:?} under this runner (expected {expected:?}): another instance is running"
    )]
    CheckpointMoved {
        projection: String,
        found: Option<Position>,
        expected: Option<Position>,
    },
}

impl Halt {
    /// The halt somewhere in an error's chain, if it is one.
    pub fn of(error: &anyhow::Error) -> Option<&Halt> {
        error.chain().find_map(|cause| cause.downcast_ref::<Halt>())
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOutcome {
    Applied { events: usize },
    CaughtUp,
}

/// Where a projection stands, for `/api/v1/admin/projections` and the CLI.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ProjectionStatus {
    pub projection: String,
    pub leader_here: bool,
    #[schema(value_type = Option<String>)]
    pub checkpoint: Option<String>,
    pub events_applied: i64,
    /// Time from the last applied event's commit to its batch's commit.
    pub last_lag_ms: Option<i64>,
    pub updated_at: Option<DateTime<Utc>>,
    pub stopped_reason: Option<String>,
}

/// Statuses of this process's runners.
pub type Statuses = Arc<Mutex<HashMap<&'static str, ProjectionStatus>>>;

#[derive(Debug, Clone)]
pub struct Projector {
    projection: ProjectionName,
    pool: Pool,
    store: AnyEventStore,
    tables: Tables,
    /// Checkpoint row name: the projection's name, or `<name>__rebuild` during replay.
    checkpoint_name: String,
    settings: ProjectionSettings,
    /// Receives, after each committed batch, every event's lag in microseconds (from its
    /// `recorded_at` to the batch's commit): the lag benchmark's measurement.
    lag_observer: Option<tokio::sync::mpsc::UnboundedSender<Vec<i64>>>,
}

/// A page decoded and folded, ready for its transaction ([`Projector::prepare`]).
#[derive(Debug)]
pub struct PreparedPage {
    prepared: zhihui_projections::Prepared,
    /// Events the page holds (the checkpoint's count).
    events: usize,
    last_recorded_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Copy)]
struct Checkpoint {
    position: Option<Position>,
}

pub fn to_projected(event: &RecordedEvent) -> ProjectedEvent {
    ProjectedEvent {
        id: event.id,
        stream: event.stream.clone(),
        stream_version: event.stream_version,
        event_type: event.event_type.clone(),
        schema_version: event.schema_version,
        payload: event.payload.clone(),
        actor: event.metadata.actor.clone(),
        correlation_id: event.metadata.correlation_id,
        recorded_at: event.recorded_at,
    }
}

/// A checkpoint row's two position columns (both NULL before the first batch).
pub(crate) fn position_from_sql(
    commit: Option<i64>,
    prepare: Option<i64>,
) -> anyhow::Result<Option<Position>> {
    Ok(match (commit, prepare) {
        (Some(commit), Some(prepare)) => Some(Position {
            commit: u64::try_from(commit)?,
            prepare: u64::try_from(prepare)?,
        }),
        _ => None,
    })
}

pub(crate) fn position_to_sql(
    position: Option<Position>,
) -> anyhow::Result<(Option<i64>, Option<i64>)> {
    Ok(match position {
        None => (None, None),
        Some(position) => (
            Some(i64::try_from(position.commit)?),
            Some(i64::try_from(position.prepare)?),
        ),
    })
}

impl Projector {
    pub fn live(
        projection: ProjectionName,
        pool: Pool,
        store: AnyEventStore,
        settings: ProjectionSettings,
    ) -> Projector {
        Projector {
            projection,
            pool,
            store,
            tables: Tables::LIVE,
            checkpoint_name: projection.as_str().to_owned(),
            settings,
            lag_observer: None,
        }
    }

    /// Report every event's lag to `observer` (see the field).
    pub fn with_lag_observer(
        self,
        observer: tokio::sync::mpsc::UnboundedSender<Vec<i64>>,
    ) -> Projector {
        Projector {
            lag_observer: Some(observer),
            ..self
        }
    }

    /// A runner writing into `<table>__rebuild` with its own checkpoint (replay).
    pub fn rebuild(
        projection: ProjectionName,
        pool: Pool,
        store: AnyEventStore,
        settings: ProjectionSettings,
    ) -> Projector {
        Projector {
            tables: Tables::REBUILD,
            checkpoint_name: format!("{}__rebuild", projection.as_str()),
            ..Projector::live(projection, pool, store, settings)
        }
    }

    /// The advisory lock this runner leads under.
    fn leader_name(&self) -> String {
        format!("zhihui-projection:{}", self.checkpoint_name)
    }

    fn filter(&self) -> EventFilter {
        crate::platform::event_store::filter_of(self.projection)
    }

    /// Lock the checkpoint row (creating it first) inside `transaction`.
    async fn lock_checkpoint(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
    ) -> anyhow::Result<Checkpoint> {
        const LOCK_ROW: &str = "SELECT commit_position, prepare_position, stopped_reason
                                  FROM projection_checkpoints WHERE projection = $1 FOR UPDATE";
        // The row exists after the first batch: one round trip then; create it only before.
        let row = match transaction
            .query_opt(LOCK_ROW, &[&self.checkpoint_name])
            .await
            .context("locking the checkpoint row")?
        {
            Some(row) => row,
            None => {
                transaction
                    .execute(
                        "INSERT INTO projection_checkpoints (projection) VALUES ($1)
                         ON CONFLICT (projection) DO NOTHING",
                        &[&self.checkpoint_name],
                    )
                    .await
                    .context("creating the checkpoint row")?;
                transaction
                    .query_one(LOCK_ROW, &[&self.checkpoint_name])
                    .await
                    .context("locking the checkpoint row")?
            }
        };
        if let Some(reason) = row.get::<_, Option<String>>(2) {
            return Err(Halt::Stopped {
                projection: self.checkpoint_name.clone(),
                reason,
            }
            .into());
        }
        Ok(Checkpoint {
            position: position_from_sql(row.get(0), row.get(1))?,
        })
    }

    /// The checkpoint as stored (no lock).
    pub async fn checkpoint(&self) -> anyhow::Result<Option<Position>> {
        let mut client = self.pool.get().await.context("getting a connection")?;
        let transaction = client.transaction().await?;
        let checkpoint = self.lock_checkpoint(&transaction).await?;
        transaction.commit().await?;
        Ok(checkpoint.position)
    }

    /// Apply `events` and move the checkpoint from `expected` to `scanned_to`, in one
    /// transaction. Refuses if the checkpoint is not at `expected` (another runner moved it).
    /// Returns the lag of the batch (ms from the last event's commit to now).
    async fn commit_batch(
        &self,
        expected: Option<Position>,
        events: &[RecordedEvent],
        scanned_to: Position,
    ) -> anyhow::Result<Option<i64>> {
        let page = self.prepare(events)?;
        let committed_at = self.commit_prepared(expected, &page, scanned_to).await?;
        if let Some(observer) = &self.lag_observer {
            let lags = events
                .iter()
                .map(|event| {
                    (committed_at - event.recorded_at)
                        .num_microseconds()
                        .unwrap_or(i64::MAX)
                })
                .collect();
            // The observer going away only ends the measurement.
            let _ = observer.send(lags);
        }
        Ok(page
            .last_recorded_at
            .map(|at| (committed_at - at).num_milliseconds().max(0)))
    }

    /// Decode and fold `events` for [`Self::apply_prepared`] (no IO).
    pub fn prepare(&self, events: &[RecordedEvent]) -> anyhow::Result<PreparedPage> {
        Ok(PreparedPage {
            prepared: self
                .projection
                .prepare(events.iter().map(to_projected).collect())?,
            events: events.len(),
            last_recorded_at: events.last().map(|event| event.recorded_at),
        })
    }

    /// Write a prepared page and move the checkpoint from `expected` to `scanned_to`, in one
    /// transaction: [`Self::apply_page`] without retries, for a replay that prepares the next
    /// page meanwhile (it falls back to `apply_page` on an error, which names a poison event).
    pub async fn apply_prepared(
        &self,
        expected: Option<Position>,
        page: &PreparedPage,
        scanned_to: Position,
    ) -> anyhow::Result<()> {
        self.commit_prepared(expected, page, scanned_to)
            .await
            .map(|_committed_at| ())
    }

    /// Refuses if the checkpoint is not at `expected` (another runner moved it). Returns when the
    /// batch committed.
    async fn commit_prepared(
        &self,
        expected: Option<Position>,
        page: &PreparedPage,
        scanned_to: Position,
    ) -> anyhow::Result<DateTime<Utc>> {
        let mut client = self.pool.get().await.context("getting a connection")?;
        let transaction = client.transaction().await.context("starting a batch")?;
        let checkpoint = self.lock_checkpoint(&transaction).await?;
        if checkpoint.position != expected {
            return Err(Halt::CheckpointMoved {
                projection: self.checkpoint_name.clone(),
                found: checkpoint.position,
                expected,
            }
            .into());
        }
        self.projection
            .write_prepared(&transaction, &self.tables, &page.prepared)
            .await?;
        let (commit, prepare) = position_to_sql(Some(scanned_to))?;
        let count = i64::try_from(page.events)?;
        transaction
            .execute(
                "UPDATE projection_checkpoints
                    SET commit_position = $2, prepare_position = $3,
                        events_applied = events_applied + $4,
                        last_recorded_at = COALESCE($5, last_recorded_at), updated_at = now()
                  WHERE projection = $1",
                &[
                    &self.checkpoint_name,
                    &commit,
                    &prepare,
                    &count,
                    &page.last_recorded_at,
                ],
            )
            .await
            .context("moving the checkpoint")?;
        transaction.commit().await.context("committing a batch")?;
        Ok(Utc::now())
    }

    /// Sabotage for tests: read a page and apply it, then kill this very connection before the
    /// commit (`pg_terminate_backend` of its own backend), as a crash between the two would.
    #[doc(hidden)]
    pub async fn project_batch_killed_before_commit(&self) -> anyhow::Result<usize> {
        let checkpoint = self.checkpoint().await?;
        let slice = self
            .store
            .read_all(checkpoint, self.settings.batch_size, &self.filter())
            .await?;
        let mut client = self.pool.get().await.context("getting a connection")?;
        let transaction = client.transaction().await?;
        self.lock_checkpoint(&transaction).await?;
        let projected: Vec<ProjectedEvent> = slice.events.iter().map(to_projected).collect();
        self.projection
            .apply(&transaction, &self.tables, &projected)
            .await?;
        let killed = transaction
            .simple_query("SELECT pg_terminate_backend(pg_backend_pid())")
            .await;
        anyhow::ensure!(
            killed.is_err(),
            "the connection survived its own termination"
        );
        drop(transaction);
        // A killed process's connections die with its pool: this one is not handed out again
        // (the pool checks only connections idle for a while, see `postgres::build_pool`).
        drop(deadpool_postgres::Object::take(client));
        Ok(projected.len())
    }

    /// One step for tests and replay: read a page after the checkpoint and apply it.
    pub async fn project_batch(&self) -> anyhow::Result<BatchOutcome> {
        let checkpoint = self.checkpoint().await?;
        let slice = self
            .store
            .read_all(checkpoint, self.settings.batch_size, &self.filter())
            .await
            .context("reading the log")?;
        let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != checkpoint) else {
            return Ok(BatchOutcome::CaughtUp);
        };
        self.apply_with_retries(checkpoint, &slice.events, scanned_to)
            .await?;
        Ok(BatchOutcome::Applied {
            events: slice.events.len(),
        })
    }

    /// Apply a page read elsewhere (replay reads ahead), moving the checkpoint from `checkpoint`
    /// to `scanned_to`; retried, and stopped on a poison event, like every batch.
    pub async fn apply_page(
        &self,
        checkpoint: Option<Position>,
        events: &[RecordedEvent],
        scanned_to: Position,
    ) -> anyhow::Result<()> {
        self.apply_with_retries(checkpoint, events, scanned_to)
            .await
            .map(|_lag| ())
    }

    /// Steps until caught up; returns the number of events applied.
    pub async fn catch_up(&self) -> anyhow::Result<u64> {
        let mut applied = 0u64;
        while let BatchOutcome::Applied { events } = self.project_batch().await? {
            applied += events as u64;
        }
        Ok(applied)
    }

    /// Apply a batch; retry it; if it keeps failing, find and name the poison event and stop.
    async fn apply_with_retries(
        &self,
        checkpoint: Option<Position>,
        events: &[RecordedEvent],
        scanned_to: Position,
    ) -> anyhow::Result<Option<i64>> {
        let mut last_error = None;
        for attempt in 0..self.settings.poison_retries_max {
            match self.commit_batch(checkpoint, events, scanned_to).await {
                Ok(lag) => return Ok(lag),
                Err(error) if Halt::of(&error).is_some() => return Err(error),
                Err(error) => {
                    tracing::warn!(
                        projection = %self.checkpoint_name,
                        attempt,
                        error = %crate::platform::telemetry::error_chain(&error),
                        "a projection batch failed; retrying"
                    );
                    last_error = Some(error);
                    tokio::time::sleep(Duration::from_millis(10 << attempt.min(8))).await;
                }
            }
        }
        // PostgreSQL away (down, shutting down, read-only, out of connections) says nothing of
        // the events: the runner starts again once it answers. Looking for a poison event then
        // would name a sound one, and a stop recorded by a server back just in time would hold
        // a healthy projection until an operator cleared it.
        if let Some(error) = last_error.take_if(|error| crate::platform::postgres::away(error)) {
            return Err(error);
        }
        if let Some(error) = &last_error {
            tracing::warn!(projection = %self.checkpoint_name, error = %crate::platform::telemetry::error_chain(error), "looking for the poison event");
        }
        // One by one, to name the event that fails (those before it are applied, in order).
        let mut position = checkpoint;
        for event in events {
            if let Err(error) = self
                .commit_batch(position, std::slice::from_ref(event), event.position)
                .await
            {
                if Halt::of(&error).is_some() || crate::platform::postgres::away(&error) {
                    return Err(error);
                }
                let reason = format!(
                    "event {} ({} #{} of stream {}, position {}) cannot be applied: {}",
                    event.id,
                    event.event_type,
                    event.stream_version,
                    event.stream,
                    event.position,
                    crate::platform::telemetry::error_chain(&error)
                );
                tracing::error!(projection = %self.checkpoint_name, %reason, "projection stopped on a poison event");
                self.stop(&reason).await?;
                return Err(Halt::Stopped {
                    projection: self.checkpoint_name.clone(),
                    reason,
                }
                .into());
            }
            position = Some(event.position);
        }
        // Every event applied alone: the batch as a whole failed for a passing reason.
        self.commit_batch(position, &[], scanned_to).await
    }

    async fn stop(&self, reason: &str) -> anyhow::Result<()> {
        let client = self.pool.get().await.context("getting a connection")?;
        client
            .execute(
                "UPDATE projection_checkpoints SET stopped_reason = $2, updated_at = now()
                  WHERE projection = $1",
                &[&self.checkpoint_name, &reason],
            )
            .await
            .context("recording the stop")?;
        Ok(())
    }

    /// Run forever: wait to be the leader, then follow the log. Returns only on a stop (poison
    /// event) or when the task is aborted.
    pub async fn run(self, statuses: Statuses) -> anyhow::Result<()> {
        let takeover_check = Duration::from_millis(self.settings.takeover_check_ms);
        loop {
            let lock_connection = match crate::platform::leader::try_lead(
                &self.pool,
                &self.leader_name(),
            )
            .await
            {
                Ok(Some(connection)) => connection,
                Ok(None) => {
                    self.publish(&statuses, false, None).await;
                    tokio::time::sleep(takeover_check).await;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(projection = %self.checkpoint_name, error = %crate::platform::telemetry::error_chain(&error), "cannot reach PostgreSQL to lead");
                    tokio::time::sleep(takeover_check).await;
                    continue;
                }
            };
            tracing::info!(projection = %self.checkpoint_name, "leading this projection");
            match self.lead(&lock_connection, &statuses).await {
                Ok(()) => {}
                Err(error) if matches!(Halt::of(&error), Some(Halt::Stopped { .. })) => {
                    crate::platform::leader::resign(lock_connection);
                    self.publish(&statuses, true, None).await;
                    return Err(error);
                }
                Err(error) => {
                    tracing::warn!(projection = %self.checkpoint_name, error = %crate::platform::telemetry::error_chain(&error), "projection runner restarts");
                    tokio::time::sleep(takeover_check).await;
                }
            }
            crate::platform::leader::resign(lock_connection);
        }
    }

    async fn lead(
        &self,
        lock_connection: &crate::platform::leader::LeaderLock,
        statuses: &Statuses,
    ) -> anyhow::Result<()> {
        let mut checkpoint = self.checkpoint().await?;
        let mut subscription = self.store.subscribe_all(checkpoint, self.filter());
        let takeover_check = Duration::from_millis(self.settings.takeover_check_ms);
        let mut last_refresh = tokio::time::Instant::now();
        self.publish(statuses, true, None).await;
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
            let Some(scanned_to) = scanned_to.filter(|to| Some(*to) > checkpoint) else {
                continue;
            };
            let lag = self
                .apply_with_retries(checkpoint, &events, scanned_to)
                .await?;
            checkpoint = Some(scanned_to);
            if let Some(lag) = lag {
                metrics_lag(&self.checkpoint_name, lag);
            }
            // The stored row (events applied, stop reason) is re-read at most once per
            // `takeover_check_ms`: a query per batch would add a round trip to every batch's lag.
            if last_refresh.elapsed() >= takeover_check {
                self.publish(statuses, true, lag).await;
                last_refresh = tokio::time::Instant::now();
            } else {
                publish_lag(statuses, self.projection.as_str(), lag);
            }
        }
    }

    async fn publish(&self, statuses: &Statuses, leader_here: bool, lag_ms: Option<i64>) {
        let stored = self.stored_status().await.ok();
        let mut statuses = statuses.lock().unwrap_or_else(|poison| poison.into_inner());
        let entry = statuses
            .entry(self.projection.as_str())
            .or_insert_with(|| ProjectionStatus {
                projection: self.checkpoint_name.clone(),
                leader_here,
                checkpoint: None,
                events_applied: 0,
                last_lag_ms: None,
                updated_at: None,
                stopped_reason: None,
            });
        entry.leader_here = leader_here;
        if lag_ms.is_some() {
            entry.last_lag_ms = lag_ms;
        }
        if let Some(stored) = stored {
            entry.checkpoint = stored.checkpoint;
            entry.events_applied = stored.events_applied;
            entry.updated_at = stored.updated_at;
            entry.stopped_reason = stored.stopped_reason;
        }
    }

    /// The checkpoint row as stored.
    pub async fn stored_status(&self) -> anyhow::Result<ProjectionStatus> {
        stored_status(&self.pool, &self.checkpoint_name).await
    }
}

/// A projection's checkpoint row as stored (`checkpoint_name`: its name, or `<name>__rebuild`).
pub async fn stored_status(pool: &Pool, checkpoint_name: &str) -> anyhow::Result<ProjectionStatus> {
    let client = pool.get().await.context("getting a connection")?;
    let row = client
        .query_opt(
            "SELECT commit_position, prepare_position, events_applied, updated_at,
                    stopped_reason,
                    (EXTRACT(EPOCH FROM (updated_at - last_recorded_at)) * 1000)::bigint
               FROM projection_checkpoints WHERE projection = $1",
            &[&checkpoint_name],
        )
        .await
        .context("reading the checkpoint row")?;
    Ok(match row {
        None => ProjectionStatus {
            projection: checkpoint_name.to_owned(),
            leader_here: false,
            checkpoint: None,
            events_applied: 0,
            last_lag_ms: None,
            updated_at: None,
            stopped_reason: None,
        },
        Some(row) => ProjectionStatus {
            projection: checkpoint_name.to_owned(),
            leader_here: false,
            checkpoint: match (row.get::<_, Option<i64>>(0), row.get::<_, Option<i64>>(1)) {
                (Some(commit), Some(prepare)) => Some(format!("{commit}/{prepare}")),
                _ => None,
            },
            events_applied: row.get(2),
            last_lag_ms: row.get(5),
            updated_at: Some(row.get(3)),
            stopped_reason: row.get(4),
        },
    })
}

/// Record a batch's lag in this process's status without reading the stored row.
fn publish_lag(statuses: &Statuses, projection: &str, lag_ms: Option<i64>) {
    let mut statuses = statuses.lock().unwrap_or_else(|poison| poison.into_inner());
    if let (Some(entry), Some(lag_ms)) = (statuses.get_mut(projection), lag_ms) {
        entry.last_lag_ms = Some(lag_ms);
    }
}

fn metrics_lag(projection: &str, lag_ms: i64) {
    tracing::debug!(projection, lag_ms, "projection batch committed");
}

/// The position stored in a checkpoint row, if any (no lock).
pub async fn stored_position(
    pool: &Pool,
    checkpoint_name: &str,
) -> anyhow::Result<Option<Position>> {
    let client = pool.get().await.context("getting a connection")?;
    let row = client
        .query_opt(
            "SELECT commit_position, prepare_position FROM projection_checkpoints
              WHERE projection = $1",
            &[&checkpoint_name],
        )
        .await
        .context("reading a checkpoint row")?;
    match row {
        Some(row) => position_from_sql(row.get(0), row.get(1)),
        None => Ok(None),
    }
}

/// Move a checkpoint row forward to `position` (never back), creating it if needed. For process
/// managers, whose real progress is in their own streams: this row only saves re-reading.
pub async fn store_position(
    pool: &Pool,
    checkpoint_name: &str,
    position: Position,
) -> anyhow::Result<()> {
    let client = pool.get().await.context("getting a connection")?;
    let (commit, prepare) = position_to_sql(Some(position))?;
    client
        .execute(
            "INSERT INTO projection_checkpoints AS c (projection, commit_position, prepare_position)
             VALUES ($1, $2, $3)
             ON CONFLICT (projection) DO UPDATE
                SET commit_position = EXCLUDED.commit_position,
                    prepare_position = EXCLUDED.prepare_position, updated_at = now()
              WHERE c.commit_position IS NULL
                 OR (c.commit_position, c.prepare_position)
                    < (EXCLUDED.commit_position, EXCLUDED.prepare_position)",
            &[&checkpoint_name, &commit, &prepare],
        )
        .await
        .context("storing a checkpoint row")?;
    Ok(())
}

/// How far a projection is behind the event store (for `/metrics`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Lag {
    pub projection: &'static str,
    /// Events it reads that are committed and not applied yet.
    pub events: i64,
    /// Age of the oldest of them (0 when there is none).
    pub seconds: f64,
}

/// Every projection's lag. PostgreSQL event store only (the events are in the same database):
/// with KurrentDB the list is empty, and the projections' own `last_lag_ms` still tells.
pub async fn lags(
    event_store: &crate::platform::event_store::AnyEventStore,
    pg_pool: &deadpool_postgres::Pool,
) -> anyhow::Result<Vec<Lag>> {
    if !matches!(
        event_store,
        crate::platform::event_store::AnyEventStore::Postgres(_)
    ) {
        return Ok(Vec::new());
    }
    let client = crate::platform::postgres::checkout(pg_pool)
        .await
        .context("getting a connection")?;
    // Every checkpoint in one read, on the connection the counts use.
    let checkpoints: HashMap<String, (i64, i64)> = client
        .query(
            "SELECT projection, commit_position, prepare_position FROM projection_checkpoints
              WHERE commit_position IS NOT NULL AND prepare_position IS NOT NULL",
            &[],
        )
        .await
        .context("reading the checkpoints")?
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect();
    let mut lags = Vec::new();
    for projection in ProjectionName::ALL {
        // No checkpoint yet: every event is ahead of it.
        let (commit, prepare) = checkpoints
            .get(projection.as_str())
            .copied()
            .unwrap_or((0, -1));
        let (filter, values): (&str, Vec<String>) = match projection.reads() {
            Reads::StreamPrefixes(prefixes) => (
                "stream_id LIKE ANY($3)",
                prefixes
                    .into_iter()
                    .map(|prefix| format!("{prefix}%"))
                    .collect(),
            ),
            Reads::EventTypes(types) => ("event_type = ANY($3)", types),
        };
        // Committed rows only (below the snapshot's horizon), as the projection itself reads.
        let row = client
            .query_one(
                &format!(
                    "SELECT count(*), EXTRACT(EPOCH FROM (now() - min(recorded_at)))::float8
                       FROM events
                      WHERE (transaction_id, global_position) > ($1::bigint::text::xid8, $2::bigint)
                        AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
                        AND {filter}"
                ),
                &[&commit, &prepare, &values],
            )
            .await
            .with_context(|| format!("measuring the lag of {}", projection.as_str()))?;
        lags.push(Lag {
            projection: projection.as_str(),
            events: row.get(0),
            seconds: row.get::<_, Option<f64>>(1).unwrap_or(0.0).max(0.0),
        });
    }
    Ok(lags)
}
