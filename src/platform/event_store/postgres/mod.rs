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

/// The NOTIFY channel `zhihui_append` signals on commit.
pub const NOTIFY_CHANNEL: &str = "zhihui_events";

/// Wake-ups kept for a subscription that is busy reading: one that falls further behind wakes
/// for everything once (it reads anyway), so the bound costs a read, never an event.
const WAKE_BACKLOG_MAX: usize = 1_024;

/// What a notification says was appended, for subscriptions to decide whether to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// Events of this type, in a stream whose name starts with `category` (the name up to its
    /// first `-`, inclusive; a name without `-` gets one added: `revenue` -> `revenue-`).
    Appended {
        category: String,
        event_type: String,
    },
    /// Anything may have been appended: a notification without a payload we know (an instance
    /// of an older version), or a (re)connect of the LISTEN connection.
    Anything,
}

impl Wake {
    /// Parse a notification's payload (`'<category> <event type>'`). Split at the last space:
    /// an event type is an identifier, while the category comes from a stream id, which the
    /// store does not forbid to hold a space.
    pub fn from_payload(payload: &str) -> Wake {
        match payload.rsplit_once(' ') {
            Some((category, event_type)) if !category.is_empty() && !event_type.is_empty() => {
                Wake::Appended {
                    category: category.to_owned(),
                    event_type: event_type.to_owned(),
                }
            }
            _ => Wake::Anything,
        }
    }

    /// Whether events this wake-up announces may pass `filter` (never `false` for one that does).
    pub fn may_concern(&self, filter: &EventFilter) -> bool {
        let Wake::Appended {
            category,
            event_type,
        } = self
        else {
            return true;
        };
        match filter {
            EventFilter::All => true,
            EventFilter::EventTypes(types) => types.iter().any(|wanted| wanted == event_type),
            // The stream's name starts with `category` (or is `category` without its last
            // '-'); a prefix may match it when either starts with the other ("user-" and
            // "user-name-"), or when the prefix is that name or part of it ("revenue").
            EventFilter::StreamPrefixes(prefixes) => prefixes.iter().any(|prefix| {
                prefix.starts_with(category.as_str()) || category.starts_with(prefix.as_str())
            }),
        }
    }
}

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

struct AppendRequest {
    stream: String,
    expected: ExpectedVersion,
    events: Vec<NewEvent>,
    retries: u32,
    reply: oneshot::Sender<Result<AppendOutcome, EventStoreError>>,
}

const APPEND_SQL: &str = "SELECT status, version, last_position, last_transaction \
     FROM zhihui_append($1, $2, $3, $4, $5, $6, $7, $8)";

/// A group-commit batch of appends to distinct streams, one row per append (`n`: its place).
const APPEND_BATCH_SQL: &str = "SELECT n, status, version, last_position, last_transaction \
     FROM zhihui_append_batch($1, $2, $3, $4, $5, $6, $7, $8, $9)";

const EVENT_COLUMNS: &str = "event_id, stream_id, stream_version, event_type, schema_version, \
     payload, metadata, recorded_at, transaction_id::text::bigint AS commit_position, \
     global_position";

/// A window of the global order after ($1, $2), at most $3 events, below the snapshot's horizon,
/// with whether a transaction at or past the horizon holds newer events back: see
/// `read_window`, and when the server answering was started (a promoted standby, or a restart,
/// is another server to the shared tail: `tail.rs`). The filter is applied here ($4: 0 every
/// event, 1 streams starting with one of $5, 2 events of a type in $5): an event it leaves out
/// comes back as its position alone (the reader still moves past it) instead of its payload
/// and metadata, which a subscription would only decode to drop. (`EVENT_COLUMNS`, written
/// out: a `const` cannot be built with `format!`.) No ORDER BY outside: the window's own order
/// comes through the join, and the reader sorts what it got (a sort here cost more than the
/// read).
const WINDOW_SQL: &str = "SELECT w.event_id, w.stream_id, w.stream_version, w.event_type, \
       w.schema_version, \
       CASE WHEN w.wanted THEN w.payload END AS payload, \
       CASE WHEN w.wanted THEN w.metadata END AS metadata, \
       w.recorded_at, w.commit_position, w.global_position, w.wanted, h.held_back, \
       h.server_started \
  FROM (SELECT COALESCE((SELECT transaction_id FROM events \
                          ORDER BY transaction_id DESC, global_position DESC LIMIT 1) \
                        >= pg_snapshot_xmin(pg_current_snapshot()), false) AS held_back, \
               pg_postmaster_start_time() AS server_started) h \
  LEFT JOIN LATERAL ( \
       SELECT event_id, stream_id, stream_version, event_type, schema_version, payload, \
              metadata, recorded_at, transaction_id::text::bigint AS commit_position, \
              global_position, \
              CASE $4::smallint WHEN 0 THEN true \
                                WHEN 1 THEN stream_id ^@ ANY($5::text[]) \
                                ELSE event_type = ANY($5::text[]) END AS wanted \
         FROM events \
        WHERE (transaction_id, global_position) > ($1::bigint::text::xid8, $2::bigint) \
          AND transaction_id < pg_snapshot_xmin(pg_current_snapshot()) \
        ORDER BY transaction_id, global_position LIMIT $3) w ON true";

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

    async fn append_alone(
        &self,
        stream: &str,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<AppendOutcome, EventStoreError> {
        let mut retries = 0;
        let retry_max = Duration::from_millis(self.inner.options.unknown_outcome_retry_max_ms);
        loop {
            let row = until_known(retry_max, || async {
                let client = crate::platform::postgres::checkout(&self.inner.pool)
                    .await
                    .context("getting a connection")?;
                let statement = client
                    .prepare_cached(APPEND_SQL)
                    .await
                    .context("preparing append")?;
                let params = AppendParams::new(stream, expected, events);
                // One statement outside an explicit transaction is its own transaction.
                client
                    .query_one(&statement, &params.as_refs())
                    .await
                    .context("appending")
            })
            .await
            .map_err(unavailable)?;
            match interpret(stream, expected, events, &row)? {
                Interpreted::Done(outcome) => {
                    if outcome.is_ok() {
                        self.inner.announcer.announce(stream, events);
                    }
                    return outcome;
                }
                Interpreted::RetryInNewerTransaction
                    if retries < self.inner.options.append_retries_max =>
                {
                    retries += 1;
                }
                Interpreted::RetryInNewerTransaction => {
                    return Err(EventStoreError::Unavailable(anyhow::anyhow!(
                        "stream {stream}: still behind a newer writer after {retries} retries"
                    )));
                }
            }
        }
    }

    /// Wait until every transaction that had committed events when this call began is below the
    /// horizon, so `read_all` includes the caller's own committed appends (read-your-writes, as
    /// KurrentDB gives on `$all`). Waits at most `read_all_settle_max_ms`; then the read returns
    /// what is safe, never more.
    async fn settle(&self) -> Result<(), EventStoreError> {
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let target: Option<i64> = client
            .query_one("SELECT max(transaction_id)::text::bigint FROM events", &[])
            .await
            .map_err(unavailable)?
            .get(0);
        let Some(target) = target else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(self.inner.options.read_all_settle_max_ms);
        let mut backoff_ms = 1;
        loop {
            let horizon: i64 = client
                .query_one(
                    "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint",
                    &[],
                )
                .await
                .map_err(unavailable)?
                .get(0);
            if horizon > target || tokio::time::Instant::now() >= deadline {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
            backoff_ms = (backoff_ms * 2).min(20);
        }
    }

    /// The safe window of the global log after `after`: events of finished transactions only.
    /// Also says whether committed events exist that an unfinished, older transaction still
    /// holds back (so the caller knows to re-check rather than wait for a NOTIFY).
    async fn read_window(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<(AllSlice, bool), EventStoreError> {
        let (slice, held_back, _) = self.read_window_on(after, max_count, filter).await?;
        Ok((slice, held_back))
    }

    /// [`Self::read_window`], with when the server that answered was started.
    async fn read_window_on(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<(AllSlice, bool, DateTime<Utc>), EventStoreError> {
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let after = after.unwrap_or(Position {
            commit: 0,
            prepare: 0,
        });
        let after_commit = i64::try_from(after.commit).map_err(|_| position_out_of_range(after))?;
        let after_prepare =
            i64::try_from(after.prepare).map_err(|_| position_out_of_range(after))?;
        let limit = i64::try_from(max_count).unwrap_or(i64::MAX);
        // One statement, so one snapshot for the window and the "held back" check (they must
        // agree), and outside a transaction block: read-only, it takes no transaction id and so
        // never holds anyone's horizon back. One round trip where a transaction took four.
        // The check is the newest event's transaction, one probe at the end of the index. (An
        // `EXISTS (... WHERE transaction_id >= horizon)` reads the same, but the planner chose a
        // sequential scan for it, which finds nothing in the usual case and so read the whole
        // table on every wake-up of every subscription.) The outer row is there even when the
        // window is empty: its event columns are then NULL.
        let statement = client
            .prepare_cached(WINDOW_SQL)
            .await
            .map_err(unavailable)?;
        let (kind, list): (i16, &[String]) = match filter {
            EventFilter::All => (0, &[]),
            EventFilter::StreamPrefixes(prefixes) => (1, prefixes),
            EventFilter::EventTypes(types) => (2, types),
        };
        let rows = client
            .query(
                &statement,
                &[&after_commit, &after_prepare, &limit, &kind, &list],
            )
            .await
            .map_err(unavailable)?;
        let held_back: bool = rows
            .first()
            .map(|row| row.try_get("held_back"))
            .transpose()
            .map_err(unavailable)?
            .unwrap_or(false);
        let server_started: DateTime<Utc> = rows
            .first()
            .ok_or_else(|| unavailable_msg("the window read returned no row"))?
            .try_get("server_started")
            .map_err(unavailable)?;
        let empty = rows
            .first()
            .is_none_or(|row| row.get::<_, Option<uuid::Uuid>>("event_id").is_none());
        let rows: &[Row] = if empty { &[] } else { &rows };

        let full = rows.len() >= max_count;
        let mut scanned_to: Option<Position> = None;
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            let position = Position {
                commit: from_i64(row.try_get("commit_position").map_err(unavailable)?),
                prepare: from_i64(row.try_get("global_position").map_err(unavailable)?),
            };
            scanned_to = scanned_to.max(Some(position));
            if row.try_get("wanted").map_err(unavailable)? {
                events.push(event_from_row(row)?);
            }
        }
        // In the window's order already (see WINDOW_SQL); sorted to be sure of it.
        events.sort_by_key(|event| event.position);
        Ok((
            AllSlice {
                events,
                scanned_to,
                end_of_log: !full,
            },
            held_back,
            server_started,
        ))
    }

    /// A subscription's window: from the shared tail when its position lies in it (one read
    /// for all the subscriptions waiting), else read for it alone.
    async fn read_for_subscription(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<(AllSlice, bool), EventStoreError> {
        if let Some(tail) = &self.inner.tail
            && let Some(read) = tail.read(self, after, max_count, filter).await?
        {
            return Ok(read);
        }
        self.read_window(after, max_count, filter).await
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

/// Feed one subscription until its consumer goes away.
async fn run_subscription(
    store: PostgresEventStore,
    mut checkpoint: Option<Position>,
    filter: EventFilter,
    sender: mpsc::Sender<Result<SubscriptionMessage, EventStoreError>>,
) {
    const HELD_BACK_RECHECK_MIN_MS: u64 = 1;
    const READ_ERROR_BACKOFF_MAX_MS: u64 = 2_000;
    let batch_size = store.inner.options.subscription_batch_size;
    let held_back_max = store
        .inner
        .options
        .held_back_recheck_max_ms
        .max(HELD_BACK_RECHECK_MIN_MS);
    let idle_recheck = Duration::from_millis(store.inner.options.subscription_idle_recheck_ms);
    let mut wakes = store.inner.wakes.subscribe();
    let mut caught_up_sent = false;
    let mut held_back_backoff_ms = HELD_BACK_RECHECK_MIN_MS;
    let mut error_backoff_ms = 10;
    loop {
        // Take the wake-ups so far BEFORE reading (the read sees what they announce): one that
        // arrives during the read stays queued and is looked at after it, so no commit can slip
        // between read and wait.
        loop {
            match wakes.try_recv() {
                Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                Err(broadcast::error::TryRecvError::Empty) => break,
                Err(broadcast::error::TryRecvError::Closed) => return,
            }
        }
        let (slice, held_back) = match store
            .read_for_subscription(checkpoint, batch_size, &filter)
            .await
        {
            Ok(read) => {
                error_backoff_ms = 10;
                read
            }
            Err(error) => {
                tracing::warn!(%error, retry_in_ms = error_backoff_ms, "subscription read failed");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(error_backoff_ms)) => {}
                    () = sender.closed() => return,
                }
                error_backoff_ms = (error_backoff_ms * 2).min(READ_ERROR_BACKOFF_MAX_MS);
                continue;
            }
        };
        let delivered_up_to = slice.events.last().map(|event| event.position);
        for event in slice.events {
            if sender
                .send(Ok(SubscriptionMessage::Event(Box::new(event))))
                .await
                .is_err()
            {
                return;
            }
        }
        if let Some(scanned_to) = slice.scanned_to {
            debug_assert!(checkpoint.is_none_or(|previous| scanned_to > previous));
            checkpoint = Some(scanned_to);
            if delivered_up_to != Some(scanned_to)
                && sender
                    .send(Ok(SubscriptionMessage::Checkpoint(scanned_to)))
                    .await
                    .is_err()
            {
                return;
            }
        }
        if !slice.end_of_log {
            continue;
        }
        if !caught_up_sent {
            caught_up_sent = true;
            if sender
                .send(Ok(SubscriptionMessage::CaughtUp))
                .await
                .is_err()
            {
                return;
            }
        }
        if held_back {
            tokio::select! {
                woken = concerning_wake(&mut wakes, &filter) => if !woken { return },
                () = tokio::time::sleep(Duration::from_millis(held_back_backoff_ms)) => {}
                () = sender.closed() => return,
            }
            held_back_backoff_ms = (held_back_backoff_ms * 2).min(held_back_max);
        } else {
            held_back_backoff_ms = HELD_BACK_RECHECK_MIN_MS;
            tokio::select! {
                woken = concerning_wake(&mut wakes, &filter) => if !woken { return },
                () = tokio::time::sleep(idle_recheck) => {}
                () = sender.closed() => return,
            }
        }
    }
}

/// Wait for a wake-up that may concern `filter`; `false` when the store is gone. Falling behind
/// the backlog counts as one (whatever was missed may have).
async fn concerning_wake(wakes: &mut broadcast::Receiver<Wake>, filter: &EventFilter) -> bool {
    loop {
        match wakes.recv().await {
            Ok(wake) if wake.may_concern(filter) => return true,
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(_)) => return true,
            Err(broadcast::error::RecvError::Closed) => return false,
        }
    }
}

/// Commits to announce: wakes for this process's subscriptions at once, notifications for the
/// other processes through the notifier ([`listen`]).
#[derive(Clone)]
struct Announcer {
    wakes: broadcast::Sender<Wake>,
    pending: Arc<PendingNotifications>,
}

/// Payloads waiting for the notifier, each once however many commits stored such events.
#[derive(Default)]
struct PendingNotifications {
    payloads: std::sync::Mutex<std::collections::BTreeSet<String>>,
    ready: tokio::sync::Notify,
}

impl PendingNotifications {
    fn take(&self) -> Vec<String> {
        let mut payloads = self
            .payloads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        std::mem::take(&mut *payloads).into_iter().collect()
    }

    fn put_back(&self, unsent: Vec<String>) {
        self.payloads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .extend(unsent);
        self.ready.notify_one();
    }
}

impl Announcer {
    /// `events` were committed to `stream` (or had been: a duplicate append).
    fn announce(&self, stream: &str, events: &[NewEvent]) {
        let category = format!("{}-", stream.split('-').next().unwrap_or_default());
        let mut payloads = self
            .pending
            .payloads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for event in events {
            let payload = format!("{category} {}", event.event_type);
            // No subscription yet is no error.
            drop(self.wakes.send(Wake::from_payload(&payload)));
            payloads.insert(payload);
        }
        drop(payloads);
        self.pending.ready.notify_one();
    }
}

/// Hold the LISTEN connection; pass on every notification, and wake everyone on every
/// (re)connect (a commit may have happened while we were not listening, so everyone re-reads).
/// The same connection is the notifier: it sends this process's pending notifications.
async fn listen(
    config: tokio_postgres::Config,
    wakes: broadcast::Sender<Wake>,
    pending: Arc<PendingNotifications>,
) {
    const RECONNECT_BACKOFF_MAX_MS: u64 = 2_000;
    let mut backoff_ms = 50;
    loop {
        match listen_once(&config, &wakes, &pending).await {
            Ok(()) => backoff_ms = 50,
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), retry_in_ms = backoff_ms, "event LISTEN connection lost");
            }
        }
        // No subscription yet is no error.
        drop(wakes.send(Wake::Anything));
        tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
        backoff_ms = (backoff_ms * 2).min(RECONNECT_BACKOFF_MAX_MS);
    }
}

async fn listen_once(
    config: &tokio_postgres::Config,
    wakes: &broadcast::Sender<Wake>,
    pending: &PendingNotifications,
) -> anyhow::Result<()> {
    let (client, mut connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .context("opening the LISTEN connection")?;
    let (messages_sender, mut messages) = mpsc::unbounded_channel();
    let driver = tokio::spawn(async move {
        let mut stream = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = futures::StreamExt::next(&mut stream).await {
            if messages_sender.send(message).is_err() {
                break;
            }
        }
    });
    // A notification is no data: its transaction need not wait for the WAL to reach the disk
    // (what it announces already did).
    client
        .batch_execute(&format!(
            "LISTEN {NOTIFY_CHANNEL}; SET synchronous_commit = off"
        ))
        .await
        .context("LISTEN")?;
    let notify = client
        .prepare(&format!(
            "SELECT pg_notify('{NOTIFY_CHANNEL}', payload) FROM unnest($1::text[]) AS payload"
        ))
        .await
        .context("preparing NOTIFY")?;
    drop(wakes.send(Wake::Anything));
    loop {
        tokio::select! {
            message = messages.recv() => {
                let Some(message) = message else { break };
                // Notices and other messages carry nothing for us. Our own notifications come
                // back too, and are passed on again: the notifier's transaction may have held
                // the horizon back for a moment, and its end is what lets a subscription read
                // the commits behind it without waiting for its backoff.
                if let tokio_postgres::AsyncMessage::Notification(notification) =
                    message.context("LISTEN connection")?
                {
                    drop(wakes.send(Wake::from_payload(notification.payload())));
                }
            }
            () = pending.ready.notified() => {
                let payloads = pending.take();
                if payloads.is_empty() {
                    continue;
                }
                if let Err(error) = client.execute(&notify, &[&payloads]).await {
                    pending.put_back(payloads);
                    driver.abort();
                    return Err(error).context("NOTIFY");
                }
            }
        }
    }
    driver.abort();
    anyhow::bail!("LISTEN connection closed")
}

/// One group-commit writer: take a batch from the shared queue, commit it, answer each caller.
async fn group_writer(
    pool: Pool,
    announcer: Announcer,
    queue: Arc<Mutex<mpsc::Receiver<AppendRequest>>>,
    max_batch: usize,
    retries_max: u32,
    unknown_outcome_retry_max: Duration,
    one_statement: bool,
) {
    let mut carried_over: Vec<AppendRequest> = Vec::new();
    loop {
        let mut batch = std::mem::take(&mut carried_over);
        {
            let mut queue = queue.lock().await;
            if batch.is_empty() {
                match queue.recv().await {
                    Some(request) => batch.push(request),
                    None => return,
                }
            }
            while batch.len() < max_batch {
                match queue.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
        }
        // One lock order for every writer: no deadlocks between concurrent batches.
        batch.sort_by(|left, right| left.stream.cmp(&right.stream));
        let results = match commit_batch(&pool, &batch, one_statement).await {
            Ok(results) => results,
            Err(error) => {
                tracing::debug!(error = %format!("{error:#}"), size = batch.len(), "group commit failed; appending one by one");
                // Each alone, and again while the failure says the connection broke: the batch
                // may or may not have committed, and only the event ids can tell.
                let mut results = Vec::with_capacity(batch.len());
                for request in &batch {
                    results.push(
                        until_known(unknown_outcome_retry_max, || {
                            commit_batch(&pool, std::slice::from_ref(request), one_statement)
                        })
                        .await
                        .map_or_else(
                            |error| Interpreted::Done(Err(EventStoreError::Unavailable(error))),
                            |mut single| single.remove(0),
                        ),
                    );
                }
                results
            }
        };
        for (mut request, result) in batch.into_iter().zip(results) {
            match result {
                Interpreted::Done(outcome) => {
                    if outcome.is_ok() {
                        announcer.announce(&request.stream, &request.events);
                    }
                    // The caller may have given up (dropped its future); nothing to do then.
                    let _ = request.reply.send(outcome);
                }
                Interpreted::RetryInNewerTransaction if request.retries < retries_max => {
                    request.retries += 1;
                    carried_over.push(request);
                }
                Interpreted::RetryInNewerTransaction => {
                    let stream = request.stream.clone();
                    let _ = request.reply.send(Err(EventStoreError::Unavailable(anyhow::anyhow!(
                        "stream {stream}: still behind a newer writer after {retries_max} retries"
                    ))));
                }
            }
        }
    }
}

/// Run every append of `batch` in one transaction and commit once: a batch of one as a single
/// `zhihui_append` statement; a larger one as one `zhihui_append_batch` statement (three
/// statements inside whatever the batch's size, where one `zhihui_append` per append ran four or
/// five each: `migrations/V14__append_batch.sql`), or, without `one_statement`, as one
/// `zhihui_append` per append, pipelined. An error means the transaction did not commit (or its
/// outcome is unknown) for the whole batch.
async fn commit_batch(
    pool: &Pool,
    batch: &[AppendRequest],
    one_statement: bool,
) -> anyhow::Result<Vec<Interpreted>> {
    let mut client = crate::platform::postgres::checkout(pool)
        .await
        .context("getting a connection")?;
    if let [request] = batch {
        // A batch of one is a single statement: its own transaction, without BEGIN/COMMIT trips.
        let statement = client
            .prepare_cached(APPEND_SQL)
            .await
            .context("preparing append")?;
        let params = AppendParams::new(&request.stream, request.expected, &request.events);
        let row = client
            .query_one(&statement, &params.as_refs())
            .await
            .context("appending")?;
        return interpret_all(batch, &[row]);
    }
    if !one_statement {
        return commit_pipelined(&mut client, batch).await;
    }
    let statement = client
        .prepare_cached(APPEND_BATCH_SQL)
        .await
        .context("preparing the batch append")?;
    let params = BatchParams::new(batch);
    let transaction = client.transaction().await.context("BEGIN")?;
    let rows = transaction
        .query(&statement, &params.as_refs())
        .await
        .context("appending a batch")?;
    // One answer per append, by its place in the batch.
    let mut answers: Vec<Option<Row>> = (0..batch.len()).map(|_| None).collect();
    for row in rows {
        let n: i32 = row.try_get("n").context("an answer's place")?;
        let slot = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|index| answers.get_mut(index))
            .filter(|slot| slot.is_none())
            .with_context(|| {
                format!("zhihui_append_batch answered for place {n} unasked or twice")
            })?;
        *slot = Some(row);
    }
    let rows = answers
        .into_iter()
        .collect::<Option<Vec<Row>>>()
        .context("zhihui_append_batch left an append unanswered")?;
    // Interpret before COMMIT: an unknown status aborts the whole batch rather than committing
    // appends whose callers would be told they failed.
    let results = interpret_all(batch, &rows)?;
    transaction.commit().await.context("COMMIT")?;
    Ok(results)
}

/// `batch` as one `zhihui_append` per append, pipelined in one transaction.
async fn commit_pipelined(
    client: &mut deadpool_postgres::Client,
    batch: &[AppendRequest],
) -> anyhow::Result<Vec<Interpreted>> {
    let statement = client
        .prepare_cached(APPEND_SQL)
        .await
        .context("preparing append")?;
    let params: Vec<AppendParams> = batch
        .iter()
        .map(|request| AppendParams::new(&request.stream, request.expected, &request.events))
        .collect();
    let param_refs: Vec<Vec<&(dyn ToSql + Sync)>> =
        params.iter().map(AppendParams::as_refs).collect();
    let transaction = client.transaction().await.context("BEGIN")?;
    // Issued together, tokio-postgres pipelines them: one round trip for the batch.
    let rows = futures::future::try_join_all(
        param_refs
            .iter()
            .map(|refs| transaction.query_one(&statement, refs)),
    )
    .await
    .context("appending")?;
    // Interpret before COMMIT, as above.
    let results = interpret_all(batch, &rows)?;
    transaction.commit().await.context("COMMIT")?;
    Ok(results)
}

fn interpret_all(batch: &[AppendRequest], rows: &[Row]) -> anyhow::Result<Vec<Interpreted>> {
    batch
        .iter()
        .zip(rows)
        .map(|(request, row)| interpret(&request.stream, request.expected, &request.events, row))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| anyhow::anyhow!("{error}"))
}

/// The owned parameters of one `zhihui_append` call.
struct AppendParams<'a> {
    stream: &'a str,
    expected_kind: i16,
    expected_version: i64,
    ids: Vec<Uuid>,
    types: Vec<&'a str>,
    schema_versions: Vec<i32>,
    // tokio-postgres's `Json` serializes into its buffer: a payload writes its text as it is.
    payloads: Vec<Json<&'a Payload>>,
    metadata: Vec<Json<&'a EventMetadata>>,
}

impl<'a> AppendParams<'a> {
    fn new(stream: &'a str, expected: ExpectedVersion, events: &'a [NewEvent]) -> Self {
        let (expected_kind, expected_version) = expected_params(expected);
        AppendParams {
            stream,
            expected_kind,
            expected_version,
            ids: events.iter().map(|event| event.id).collect(),
            types: events
                .iter()
                .map(|event| event.event_type.as_str())
                .collect(),
            schema_versions: events
                .iter()
                .map(|event| i32::try_from(event.schema_version).unwrap_or(i32::MAX))
                .collect(),
            payloads: events.iter().map(|event| Json(&event.payload)).collect(),
            metadata: events.iter().map(|event| Json(&event.metadata)).collect(),
        }
    }

    fn as_refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        vec![
            &self.stream,
            &self.expected_kind,
            &self.expected_version,
            &self.ids,
            &self.types,
            &self.schema_versions,
            &self.payloads,
            &self.metadata,
        ]
    }
}

enum Interpreted {
    Done(Result<AppendOutcome, EventStoreError>),
    RetryInNewerTransaction,
}

/// An expectation as the SQL functions take it: its kind (0 any, 1 no stream, 2 exact, 3 stream
/// exists) and the exact version (-1 when there is none).
fn expected_params(expected: ExpectedVersion) -> (i16, i64) {
    match expected {
        ExpectedVersion::Any => (0, -1),
        ExpectedVersion::NoStream => (1, -1),
        ExpectedVersion::Exact(version) => (2, to_i64(version)),
        ExpectedVersion::StreamExists => (3, -1),
    }
}

/// A batch's appends as `zhihui_append_batch` takes them: one entry per append, its events laid
/// end to end.
struct BatchParams<'a> {
    streams: Vec<&'a str>,
    expected_kinds: Vec<i16>,
    expected_versions: Vec<i64>,
    counts: Vec<i32>,
    ids: Vec<Uuid>,
    types: Vec<&'a str>,
    schema_versions: Vec<i32>,
    payloads: Vec<Json<&'a Payload>>,
    metadata: Vec<Json<&'a EventMetadata>>,
}

impl<'a> BatchParams<'a> {
    fn new(batch: &'a [AppendRequest]) -> Self {
        let events = batch.iter().map(|request| request.events.len()).sum();
        let mut params = BatchParams {
            streams: Vec::with_capacity(batch.len()),
            expected_kinds: Vec::with_capacity(batch.len()),
            expected_versions: Vec::with_capacity(batch.len()),
            counts: Vec::with_capacity(batch.len()),
            ids: Vec::with_capacity(events),
            types: Vec::with_capacity(events),
            schema_versions: Vec::with_capacity(events),
            payloads: Vec::with_capacity(events),
            metadata: Vec::with_capacity(events),
        };
        // Straight into the batch's columns, with no columns of each append's own on the way.
        for request in batch {
            let (kind, version) = expected_params(request.expected);
            params.streams.push(&request.stream);
            params.expected_kinds.push(kind);
            params.expected_versions.push(version);
            params
                .counts
                .push(i32::try_from(request.events.len()).unwrap_or(i32::MAX));
            for event in &request.events {
                params.ids.push(event.id);
                params.types.push(&event.event_type);
                params
                    .schema_versions
                    .push(i32::try_from(event.schema_version).unwrap_or(i32::MAX));
                params.payloads.push(Json(&event.payload));
                params.metadata.push(Json(&event.metadata));
            }
        }
        params
    }

    fn as_refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        vec![
            &self.streams,
            &self.expected_kinds,
            &self.expected_versions,
            &self.counts,
            &self.ids,
            &self.types,
            &self.schema_versions,
            &self.payloads,
            &self.metadata,
        ]
    }
}

fn interpret(
    stream: &str,
    expected: ExpectedVersion,
    events: &[NewEvent],
    row: &Row,
) -> Result<Interpreted, EventStoreError> {
    let status: &str = row.try_get("status").map_err(unavailable)?;
    let version: i64 = row.try_get("version").map_err(unavailable)?;
    let outcome = || -> Result<AppendOutcome, EventStoreError> {
        let prepare: i64 = row.try_get("last_position").map_err(unavailable)?;
        let commit: i64 = row.try_get("last_transaction").map_err(unavailable)?;
        Ok(AppendOutcome {
            stream_version: from_i64(version),
            position: Position {
                commit: from_i64(commit),
                prepare: from_i64(prepare),
            },
        })
    };
    Ok(match status {
        "appended" | "duplicate" => Interpreted::Done(outcome()),
        "conflict" => Interpreted::Done(Err(EventStoreError::WrongExpectedVersion {
            stream: stream.to_owned(),
            expected,
            actual: ActualVersion((version >= 0).then(|| from_i64(version))),
        })),
        "id_reused" => Interpreted::Done(Err(EventStoreError::EventIdReused {
            event_id: events.first().map_or(Uuid::nil(), |event| event.id),
        })),
        "retry" => Interpreted::RetryInNewerTransaction,
        other => {
            return Err(unavailable_msg(format!(
                "zhihui_append answered unknown status {other:?}"
            )));
        }
    })
}

fn event_from_row(row: &Row) -> Result<RecordedEvent, EventStoreError> {
    // Both decoded from the row's bytes, never into a JSON tree on the way: the metadata into its
    // type, the payload kept as its text.
    let Json(metadata): Json<EventMetadata> = row
        .try_get("metadata")
        .map_err(|error| unavailable_msg(format!("stored metadata is malformed: {error}")))?;
    let Json(payload): Json<Payload> = row
        .try_get("payload")
        .map_err(|error| unavailable_msg(format!("a stored payload is not JSON: {error}")))?;
    let schema_version: i32 = row.try_get("schema_version").map_err(unavailable)?;
    let recorded_at: DateTime<Utc> = row.try_get("recorded_at").map_err(unavailable)?;
    Ok(RecordedEvent {
        id: row.try_get("event_id").map_err(unavailable)?,
        stream: row.try_get("stream_id").map_err(unavailable)?,
        event_type: row.try_get("event_type").map_err(unavailable)?,
        schema_version: u32::try_from(schema_version).unwrap_or(0),
        payload,
        metadata,
        recorded_at,
        stream_version: from_i64(row.try_get("stream_version").map_err(unavailable)?),
        position: Position {
            commit: from_i64(row.try_get("commit_position").map_err(unavailable)?),
            prepare: from_i64(row.try_get("global_position").map_err(unavailable)?),
        },
    })
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn from_i64(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn position_out_of_range(position: Position) -> EventStoreError {
    EventStoreError::InvalidAppend(format!("position {position} is out of range"))
}

/// Run `attempt` until it succeeds, fails for a reason a retry cannot change, or `retry_max` has
/// passed since the first failure; between attempts a backoff from 50 ms to 1 s. Only for
/// attempts that are safe to repeat (appends: the event ids decide).
async fn until_known<T, F, Fut>(retry_max: Duration, mut attempt: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut first_failure: Option<tokio::time::Instant> = None;
    let mut backoff = Duration::from_millis(50);
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if connection_lost(&error) => {
                let since = *first_failure.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= retry_max {
                    return Err(error.context(format!(
                        "the database was unreachable for {} ms",
                        retry_max.as_millis()
                    )));
                }
                tracing::warn!(error = %format!("{error:#}"), retry_in_ms = backoff.as_millis(), "append's outcome unknown (connection lost); trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(error) => return Err(error),
        }
    }
}

/// Whether `error` says the connection (or the server behind it) went away, rather than that the
/// statement was refused: a closed or broken connection, no connection to be had, a server
/// shutting down or starting, a standby answering read-only (the old primary demoted, the new
/// one not yet found).
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
    use tokio_postgres::error::SqlState;
    match error.code() {
        // No SQLSTATE: the error is the connection's own (closed, I/O, a timeout, a refused
        // connect), not an answer of the server.
        None => true,
        Some(code) => {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                    SqlState::READ_ONLY_SQL_TRANSACTION,
                    SqlState::TOO_MANY_CONNECTIONS,
                ]
                .contains(code)
        }
    }
}

fn unavailable<E: Into<anyhow::Error>>(error: E) -> EventStoreError {
    EventStoreError::Unavailable(error.into())
}

fn unavailable_msg(message: impl std::fmt::Display) -> EventStoreError {
    EventStoreError::Unavailable(anyhow::anyhow!("{message}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(names: &[&str]) -> EventFilter {
        EventFilter::EventTypes(names.iter().map(|name| (*name).to_owned()).collect())
    }

    fn prefixes(names: &[&str]) -> EventFilter {
        EventFilter::StreamPrefixes(names.iter().map(|name| (*name).to_owned()).collect())
    }

    #[test]
    fn a_payload_names_the_category_and_type_and_anything_else_wakes_everyone() {
        assert_eq!(
            Wake::from_payload("task- TaskQueued"),
            Wake::Appended {
                category: "task-".into(),
                event_type: "TaskQueued".into()
            }
        );
        assert_eq!(
            Wake::from_payload("revenue- RevenueRecorded"),
            Wake::Appended {
                category: "revenue-".into(),
                event_type: "RevenueRecorded".into()
            }
        );
        assert_eq!(
            Wake::from_payload("odd name- Renamed"),
            Wake::Appended {
                category: "odd name-".into(),
                event_type: "Renamed".into()
            }
        );
        // V1's empty payload (an instance not yet upgraded), and anything unknown.
        for payload in ["", " ", "task-", " TaskQueued", "task- "] {
            assert_eq!(Wake::from_payload(payload), Wake::Anything, "{payload:?}");
        }
    }

    #[test]
    fn a_subscription_is_woken_for_whatever_may_pass_its_filter() {
        let queued = Wake::from_payload("task- TaskQueued");
        let frozen = Wake::from_payload("account- PointsFrozen");
        let claimed = Wake::from_payload("user- IdentifierClaimed");
        let revenue = Wake::from_payload("revenue- RevenueRecorded");
        assert!(queued.may_concern(&EventFilter::All));
        assert!(queued.may_concern(&types(&["TaskQueued", "TaskCancelRequested"])));
        assert!(!frozen.may_concern(&types(&["TaskQueued", "TaskCancelRequested"])));
        assert!(frozen.may_concern(&prefixes(&["account-"])));
        assert!(!queued.may_concern(&prefixes(&["account-", "revenue"])));
        assert!(revenue.may_concern(&prefixes(&["account-", "revenue"])));
        // "user-name-alice" and "user-<uuid>" share the category "user-": both prefixes may match.
        assert!(claimed.may_concern(&prefixes(&["user-name-"])));
        assert!(claimed.may_concern(&prefixes(&["user-"])));
        assert!(claimed.may_concern(&prefixes(&["us"])));
        assert!(!claimed.may_concern(&prefixes(&["task-"])));
        for filter in [EventFilter::All, types(&["X"]), prefixes(&["x-"])] {
            assert!(Wake::Anything.may_concern(&filter));
        }
    }
}
