//! The reading side: gap-safe windows of the global log (only transactions below the snapshot's
//! horizon), read-your-writes settling for `read_all`, and the decoding of a row into a
//! `RecordedEvent`.

use super::*;

pub(super) const EVENT_COLUMNS: &str = "event_id, stream_id, stream_version, event_type, schema_version, \
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
pub(super) const WINDOW_SQL: &str = "SELECT w.event_id, w.stream_id, w.stream_version, w.event_type, \
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

/// Positions that cut the log after ($1, $2) into pages of $3 events, at most $4 pages, below the
/// snapshot's horizon (so everything up to them is finished and stays as read); the last row is
/// the last event scanned, which ends a partial page. An index-only walk of the order.
const BOUNDARIES_SQL: &str = "SELECT commit_position, global_position, scanned FROM ( \
       SELECT transaction_id::text::bigint AS commit_position, global_position, \
              row_number() OVER (ORDER BY transaction_id, global_position) AS n, \
              count(*) OVER () AS scanned \
         FROM (SELECT transaction_id, global_position FROM events \
                WHERE (transaction_id, global_position) > ($1::bigint::text::xid8, $2::bigint) \
                  AND transaction_id < pg_snapshot_xmin(pg_current_snapshot()) \
                ORDER BY transaction_id, global_position LIMIT $3::bigint * $4::bigint) o) w \
  WHERE n % $3::bigint = 0 OR n = scanned ORDER BY n";

/// The events after ($1, $2) up to and including ($3, $4), a range [`BOUNDARIES_SQL`] found
/// finished: no horizon to check. Filtered as `WINDOW_SQL` is ($5, $6). The LIMIT ($7, the
/// page's size: never reached) makes the plan walk the order's index, as the window's does;
/// without it the generic plan expects a third of the table and scans and sorts all of it.
const RANGE_SQL: &str = "SELECT w.event_id, w.stream_id, w.stream_version, w.event_type, \
       w.schema_version, \
       CASE WHEN w.wanted THEN w.payload END AS payload, \
       CASE WHEN w.wanted THEN w.metadata END AS metadata, \
       w.recorded_at, w.commit_position, w.global_position, w.wanted \
  FROM (SELECT event_id, stream_id, stream_version, event_type, schema_version, payload, \
               metadata, recorded_at, transaction_id::text::bigint AS commit_position, \
               global_position, \
               CASE $5::smallint WHEN 0 THEN true \
                                 WHEN 1 THEN stream_id ^@ ANY($6::text[]) \
                                 ELSE event_type = ANY($6::text[]) END AS wanted \
          FROM events \
         WHERE (transaction_id, global_position) > ($1::bigint::text::xid8, $2::bigint) \
           AND (transaction_id, global_position) <= ($3::bigint::text::xid8, $4::bigint) \
         ORDER BY transaction_id, global_position LIMIT $7) w";

/// What [`PostgresEventStore::page_boundaries`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageBoundaries {
    /// Each page's last position, in the log's order.
    pub ends: Vec<Position>,
    /// Fewer events than asked for were there: the last page reaches the end of the log as it
    /// was then.
    pub reached_the_end: bool,
}

impl PostgresEventStore {
    /// Where the next `pages` pages of `page_size` events after `after` end (each page's last
    /// position; the last may end a shorter page), among finished transactions only. Empty: the
    /// log has nothing after `after` yet. With [`Self::read_range`], a reader that reads pages
    /// at once on several connections (a replay) instead of one after another.
    pub async fn page_boundaries(
        &self,
        after: Option<Position>,
        page_size: usize,
        pages: usize,
    ) -> Result<PageBoundaries, EventStoreError> {
        self.settle().await?;
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let (after_commit, after_prepare) = sql_position(after)?;
        let statement = client
            .prepare_cached(BOUNDARIES_SQL)
            .await
            .map_err(unavailable)?;
        let rows = client
            .query(
                &statement,
                &[
                    &after_commit,
                    &after_prepare,
                    &i64::try_from(page_size.max(1)).unwrap_or(i64::MAX),
                    &i64::try_from(pages.max(1)).unwrap_or(i64::MAX),
                ],
            )
            .await
            .map_err(unavailable)?;
        let mut boundaries: Vec<Position> = Vec::with_capacity(rows.len());
        let mut scanned = 0_i64;
        for row in &rows {
            scanned = row.try_get(2).map_err(unavailable)?;
            let position = Position {
                commit: from_i64(row.try_get(0).map_err(unavailable)?),
                prepare: from_i64(row.try_get(1).map_err(unavailable)?),
            };
            // The last event can also end a full page: one boundary, not two.
            if boundaries.last() != Some(&position) {
                boundaries.push(position);
            }
        }
        let asked = page_size.max(1).saturating_mul(pages.max(1));
        Ok(PageBoundaries {
            ends: boundaries,
            reached_the_end: usize::try_from(scanned).unwrap_or(0) < asked,
        })
    }

    /// The events after `after` up to and including `until`, a boundary [`Self::page_boundaries`]
    /// returned, filtered; `scanned_to` is `until`.
    pub async fn read_range(
        &self,
        after: Option<Position>,
        until: Position,
        page_size: usize,
        filter: &EventFilter,
    ) -> Result<AllSlice, EventStoreError> {
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let statement = client
            .prepare_cached(RANGE_SQL)
            .await
            .map_err(unavailable)?;
        let (kind, list) = filter_parameters(filter);
        let (after_commit, after_prepare) = sql_position(after)?;
        let (until_commit, until_prepare) = sql_position(Some(until))?;
        let rows = client
            .query(
                &statement,
                &[
                    &after_commit,
                    &after_prepare,
                    &until_commit,
                    &until_prepare,
                    &kind,
                    &list,
                    &i64::try_from(page_size).unwrap_or(i64::MAX),
                ],
            )
            .await
            .map_err(unavailable)?;
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            if row.try_get("wanted").map_err(unavailable)? {
                events.push(event_from_row(row)?);
            }
        }
        Ok(AllSlice {
            events,
            scanned_to: Some(until),
            end_of_log: false,
        })
    }

    /// Wait until every transaction that had committed events when this call began is below the
    /// horizon, so `read_all` includes the caller's own committed appends (read-your-writes, as
    /// KurrentDB gives on `$all`). Waits at most `read_all_settle_max_ms`; then the read returns
    /// what is safe, never more.
    pub(super) async fn settle(&self) -> Result<(), EventStoreError> {
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
    pub(super) async fn read_window(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<(AllSlice, bool), EventStoreError> {
        let (slice, held_back, _) = self.read_window_on(after, max_count, filter).await?;
        Ok((slice, held_back))
    }

    /// [`Self::read_window`], with when the server that answered was started.
    pub(super) async fn read_window_on(
        &self,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<(AllSlice, bool, DateTime<Utc>), EventStoreError> {
        let client = crate::platform::postgres::checkout(&self.inner.pool)
            .await
            .map_err(unavailable)?;
        let (after_commit, after_prepare) = sql_position(after)?;
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
        let (kind, list) = filter_parameters(filter);
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
    pub(super) async fn read_for_subscription(
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

/// A position as the statements take it (`None`: before the first event).
fn sql_position(position: Option<Position>) -> Result<(i64, i64), EventStoreError> {
    let position = position.unwrap_or(Position {
        commit: 0,
        prepare: 0,
    });
    Ok((
        i64::try_from(position.commit).map_err(|_| position_out_of_range(position))?,
        i64::try_from(position.prepare).map_err(|_| position_out_of_range(position))?,
    ))
}

/// A filter as the statements take it: 0 every event, 1 stream prefixes, 2 event types; the list.
fn filter_parameters(filter: &EventFilter) -> (i16, &[String]) {
    match filter {
        EventFilter::All => (0, &[]),
        EventFilter::StreamPrefixes(prefixes) => (1, prefixes),
        EventFilter::EventTypes(types) => (2, types),
    }
}

pub(super) fn event_from_row(row: &Row) -> Result<RecordedEvent, EventStoreError> {
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

pub(super) fn position_out_of_range(position: Position) -> EventStoreError {
    EventStoreError::InvalidAppend(format!("position {position} is out of range"))
}
