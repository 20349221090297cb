//! The PostgreSQL event store (the default).
//!
//! Appends go through the SQL function `zhihui_append` (migrations/V1__event_store.sql; its
//! body today in V13__leaner_append.sql), which checks the expected version under a row lock on
//! the stream and reports every expected outcome as a status instead of raising, so that many
//! appends can share one transaction.
//!
//! **Group commit.** Appends are queued to a few writer tasks. Each takes every queued append (up
//! to `group_commit_max_batch`), sorts them by stream (one lock order, so writers never deadlock),
//! sends them pipelined in ONE transaction and commits once: one fsync for the whole batch, while
//! each append keeps its own version check. If the batch transaction fails as a whole, each of its
//! appends is retried alone, so one bad append never fails the others.
//!
//! **Gap-safe global order.** Readers of the global log only return events whose writing
//! transaction is below `pg_snapshot_xmin(pg_current_snapshot())`, in (transaction id, sequence)
//! order. Every transaction below that horizon has finished, so no event can later appear before a
//! position a reader has passed. An append is re-queued into a newer transaction when a newer one
//! already wrote its stream (status `retry`), which keeps each stream's events in stream order in
//! the global log. See ARCHITECTURE.md.
//!
//! **Live delivery.** After a commit, the appending process announces what it stored: its own
//! subscriptions are woken at once, and the LISTEN connection (the notifier) sends
//! `pg_notify('zhihui_events', '<category> <type>')` for the other processes, many commits'
//! payloads in one statement, in a transaction that does not wait for its WAL flush. The
//! notification is not sent from inside the append's transaction (as V5's `zhihui_append` did):
//! a NOTIFY makes its commit take one lock for the whole cluster and hold it through the WAL
//! flush, so notifying commits ran one at a time (migrations/V13__leaner_append.sql). A
//! subscription reads again only when a notification may concern its filter (any other payload,
//! and every LISTEN reconnect, concerns everyone); its own process's notifications come back too
//! (the notifier's transaction may have held the horizon back; its end releases what waited
//! behind it). A process that dies between a
//! commit and its notification leaves the other processes' subscriptions unwoken: each re-reads
//! after `subscription_idle_recheck_ms` without a wake-up, so such an event is late by at most
//! that, never skipped. While an unfinished transaction holds the horizon back, a subscription
//! re-checks with a short, capped backoff (it never skips; it waits).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::{GenericClient, Pool};
use futures::stream::BoxStream;
use tokio::sync::{Mutex, broadcast, mpsc, oneshot};
use tokio_postgres::Row;
use tokio_postgres::types::{Json, ToSql};
use uuid::Uuid;
use zhihui_domain::event::Payload;

use super::tail::{LogTail, Window};
use super::{
    ActualVersion, AllSlice, AppendOutcome, Direction, EventFilter, EventMetadata, EventStore,
    EventStoreError, ExpectedVersion, NewEvent, Position, ReadFrom, RecordedEvent,
    SubscriptionMessage, validate_append,
};

mod reader;
pub use reader::PageBoundaries;
mod subscriptions;
mod writer;
use reader::*;
pub use subscriptions::*;
use writer::*;

/// Tuning of the PostgreSQL store; from `[event_store]` settings.
#[derive(Debug, Clone)]
pub struct PostgresEventStoreOptions {
    /// Share transactions between concurrent appends (see module docs). Off: one transaction
    /// per append.
    pub group_commit: bool,
    /// Most appends in one group-commit transaction. Bounds the time locks are held.
    pub group_commit_max_batch: usize,
    /// Writer tasks (each a pooled connection) committing batches in parallel.
    pub group_commit_writers: usize,
    /// A batch of appends as one `zhihui_append_batch` statement; off: one `zhihui_append` per
    /// append, pipelined (the design before it, kept to compare and to fall back on).
    pub group_commit_one_statement: bool,
    /// How often an append that met a newer transaction on its stream is re-queued before it
    /// fails; each retry runs in a fresh, newer transaction, so one retry nearly always suffices.
    pub append_retries_max: u32,
    /// Events fetched per round trip by subscriptions.
    pub subscription_batch_size: usize,
    /// Events kept in the shared tail of the log (`tail`); 0: every subscription reads alone.
    pub subscription_tail_events: usize,
    /// Ceiling of the re-check backoff while an unfinished transaction holds the horizon back.
    pub held_back_recheck_max_ms: u64,
    /// A subscription with no wake-up for this long reads anyway (a notification lost with the
    /// process that committed: see "Live delivery").
    pub subscription_idle_recheck_ms: u64,
    /// Longest `read_all` waits for transactions older than its caller's appends to finish (they
    /// normally last milliseconds; a stuck one must not stall a read forever).
    pub read_all_settle_max_ms: u64,
    /// Connection parameters of the LISTEN connection (the pool's database).
    pub listen_config: tokio_postgres::Config,
    /// How long an append whose outcome is unknown (its connection broke: the primary died, a
    /// failover is under way) is tried again before its caller is told the store is
    /// unavailable. Trying again is safe: the event ids decide, and an append that did land is
    /// answered `duplicate`, so it lands exactly once.
    pub unknown_outcome_retry_max_ms: u64,
}

#[derive(Clone)]
pub struct PostgresEventStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PostgresEventStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresEventStore")
            .field("group_commit", &self.inner.options.group_commit)
            .finish_non_exhaustive()
    }
}

struct Inner {
    pool: Pool,
    options: PostgresEventStoreOptions,
    /// Queue to the group-commit writers (None when group commit is off).
    appends: Option<mpsc::Sender<AppendRequest>>,
    /// Every NOTIFY (and every LISTEN (re)connect) as a [`Wake`]: each subscription listens.
    wakes: broadcast::Sender<Wake>,
    /// Commits of this process to announce (wakes here, NOTIFY for the others).
    announcer: Announcer,
    /// Background tasks (listener, writers), stopped when the store is dropped.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The newest events, read once for this process's subscriptions (None: each reads alone).
    tail: Option<LogTail>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl PostgresEventStore {
    /// Start the store's background tasks (LISTEN connection, group-commit writers).
    pub fn start(pool: Pool, options: PostgresEventStoreOptions) -> PostgresEventStore {
        assert!(options.group_commit_max_batch >= 1);
        assert!(options.group_commit_writers >= 1);
        assert!(options.subscription_batch_size >= 1);
        let (wakes, _) = broadcast::channel(WAKE_BACKLOG_MAX);
        let announcer = Announcer {
            wakes: wakes.clone(),
            pending: Arc::new(PendingNotifications::default()),
        };
        let mut tasks = vec![tokio::spawn(listen(
            options.listen_config.clone(),
            wakes.clone(),
            announcer.pending.clone(),
        ))];
        let appends = if options.group_commit {
            // Bounded: a flood of appends waits here instead of growing memory without limit.
            let (sender, receiver) =
                mpsc::channel(options.group_commit_max_batch * options.group_commit_writers * 4);
            let receiver = Arc::new(Mutex::new(receiver));
            for _ in 0..options.group_commit_writers {
                tasks.push(tokio::spawn(group_writer(
                    pool.clone(),
                    announcer.clone(),
                    receiver.clone(),
                    options.group_commit_max_batch,
                    options.append_retries_max,
                    Duration::from_millis(options.unknown_outcome_retry_max_ms),
                    options.group_commit_one_statement,
                )));
            }
            Some(sender)
        } else {
            None
        };
        let tail = (options.subscription_tail_events > 0).then(|| {
            LogTail::new(
                options.subscription_tail_events,
                options.subscription_batch_size,
            )
        });
        PostgresEventStore {
            inner: Arc::new(Inner {
                pool,
                options,
                appends,
                wakes,
                announcer,
                tasks,
                tail,
            }),
        }
    }

    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }
}

impl Window for PostgresEventStore {
    async fn window(
        &self,
        after: Position,
        max_count: usize,
    ) -> Result<(AllSlice, bool, DateTime<Utc>), EventStoreError> {
        self.read_window_on(Some(after), max_count, &EventFilter::All)
            .await
    }
}

impl PostgresEventStore {
    /// The event stored under `event_id`, wherever it is (event ids are unique across the log).
    pub async fn event_by_id(
        &self,
        event_id: Uuid,
    ) -> Result<Option<RecordedEvent>, EventStoreError> {
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let statement = client
            .prepare_cached(&format!(
                "SELECT {EVENT_COLUMNS} FROM events WHERE event_id = $1"
            ))
            .await
            .map_err(unavailable)?;
        let row = client
            .query_opt(&statement, &[&event_id])
            .await
            .map_err(unavailable)?;
        row.as_ref().map(event_from_row).transpose()
    }
}

impl EventStore for PostgresEventStore {
    async fn append(
        &self,
        stream: &str,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome, EventStoreError> {
        validate_append(stream, &events)?;
        let Some(appends) = &self.inner.appends else {
            return self.append_alone(stream, expected, &events).await;
        };
        let (reply, answer) = oneshot::channel();
        appends
            .send(AppendRequest {
                stream: stream.to_owned(),
                expected,
                events,
                retries: 0,
                reply,
            })
            .await
            .map_err(|_| unavailable_msg("the group-commit writers have stopped"))?;
        answer
            .await
            .map_err(|_| unavailable_msg("a group-commit writer stopped before answering"))?
    }

    async fn read_stream(
        &self,
        stream: &str,
        direction: Direction,
        from: ReadFrom,
        max_count: usize,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let limit = i64::try_from(max_count).unwrap_or(i64::MAX);
        let (comparison, order, bound) = match (direction, from) {
            (Direction::Forwards, ReadFrom::Start) => (">=", "ASC", 0_i64),
            (Direction::Forwards, ReadFrom::End) => (">", "ASC", i64::MAX),
            (Direction::Forwards, ReadFrom::Version(v)) => (">=", "ASC", to_i64(v)),
            (Direction::Backwards, ReadFrom::Start) => ("<=", "DESC", 0),
            (Direction::Backwards, ReadFrom::End) => ("<=", "DESC", i64::MAX),
            (Direction::Backwards, ReadFrom::Version(v)) => ("<=", "DESC", to_i64(v)),
        };
        // One event (a stream's last, mostly: a balance, a batch's revocation) is asked for with
        // a literal LIMIT. With `LIMIT $3` PostgreSQL's plan cache prices the generic plan as if
        // a tenth of the stream were read, finds it dearer than a plan for the values given,
        // and so plans the statement anew on every call: `pg_stat_statements` showed as many
        // plans as calls, 53 µs of planning beside 44 µs of execution per `GET /account`.
        let one = max_count == 1;
        let limit_sql = if one { "1" } else { "$3" };
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE stream_id = $1 AND stream_version {comparison} $2 \
              ORDER BY stream_version {order} LIMIT {limit_sql}"
        );
        // Twelve shapes at most, each prepared once per connection.
        let statement = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let rows = if one {
            client.query(&statement, &[&stream, &bound]).await
        } else {
            client.query(&statement, &[&stream, &bound, &limit]).await
        }
        .map_err(unavailable)?;
        rows.iter().map(event_from_row).collect()
    }

    async fn read_all(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<AllSlice, EventStoreError> {
        self.settle().await?;
        Ok(self.read_window(after, max_count, filter).await?.0)
    }

    async fn head(&self) -> Result<Option<Position>, EventStoreError> {
        self.settle().await?;
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        // One statement outside a transaction block: read-only, it takes no transaction id.
        let statement = client
            .prepare_cached(
                "SELECT transaction_id::text::bigint, global_position FROM events \
                  WHERE transaction_id < pg_snapshot_xmin(pg_current_snapshot()) \
                  ORDER BY transaction_id DESC, global_position DESC LIMIT 1",
            )
            .await
            .map_err(unavailable)?;
        let row = client
            .query_opt(&statement, &[])
            .await
            .map_err(unavailable)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let (commit, prepare): (i64, i64) = (row.get(0), row.get(1));
        Ok(Some(Position {
            commit: u64::try_from(commit).map_err(unavailable)?,
            prepare: u64::try_from(prepare).map_err(unavailable)?,
        }))
    }

    fn subscribe_all(
        &self,
        after: Option<Position>,
        filter: EventFilter,
    ) -> BoxStream<'static, Result<SubscriptionMessage, EventStoreError>> {
        let (sender, mut receiver) = mpsc::channel(self.inner.options.subscription_batch_size);
        tokio::spawn(run_subscription(self.clone(), after, filter, sender));
        Box::pin(futures::stream::poll_fn(move |cx| receiver.poll_recv(cx)))
    }
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn from_i64(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// Whether `error` says the connection (or the server behind it) went away, rather than that the
/// statement was refused: a closed or broken connection, no connection to be had, a server
/// shutting down or starting, a standby answering read-only (the old primary demoted, the new
/// one not yet found), a server out of disk, memory or connections. An append that met one is
/// tried again until its outcome is known or the failover wait is over.
pub(crate) fn connection_lost(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        if let Some(pool_error) = cause.downcast_ref::<deadpool_postgres::PoolError>() {
            return match pool_error {
                deadpool_postgres::PoolError::Timeout(_) => true,
                deadpool_postgres::PoolError::Backend(error) => postgres_connection_lost(error),
                _ => false,
            };
        }
        if let Some(error) = cause.downcast_ref::<tokio_postgres::Error>() {
            return postgres_connection_lost(error);
        }
        cause.downcast_ref::<std::io::Error>().is_some()
    })
}

fn postgres_connection_lost(error: &tokio_postgres::Error) -> bool {
    match error.code() {
        // No SQLSTATE: the error is the connection's own (closed, I/O, a timeout, a refused
        // connect), not an answer of the server.
        None => true,
        Some(code) => crate::platform::postgres::sql_state_unavailable(code),
    }
}

fn unavailable<E: Into<anyhow::Error>>(error: E) -> EventStoreError {
    EventStoreError::Unavailable(error.into())
}

fn unavailable_msg(message: impl std::fmt::Display) -> EventStoreError {
    EventStoreError::Unavailable(anyhow::anyhow!("{message}"))
}
