//! `zhihui replay`: rebuild a projection's read models from the whole log into fresh tables
//! (`<table>__rebuild`, created `LIKE` the live ones) and swap them in only when complete. The
//! live tables keep serving, and the live runner keeps projecting, until the swap.
//!
//! - Build: pages of `replay.batch_size` events, one transaction each (a long write transaction
//!   would hold the global log's horizon back for everyone: see ARCHITECTURE.md), in a pipeline:
//!   the page after next read, the next decoded and folded, the current one written. The rebuild
//!   has its own checkpoint row (`<name>__rebuild`), so rows and progress still commit together.
//!   Tables whose rows are only inserted (the ledger's) are loaded by binary `COPY` before any of
//!   their keys exist; keys and indexes are built after the load.
//! - Swap, in one transaction: lock `projection_checkpoints` (runners block before they write, so
//!   they hold no transaction id and the log stays readable), read what the live runner applied
//!   beyond the rebuild, apply it to the rebuild tables, rename the tables, carry the checkpoint
//!   over. A runner that was waiting finds the checkpoint moved, stops its batch (`Halt::
//!   CheckpointMoved`) and restarts from the new checkpoint.
//! - The stages ([`prepare_tables`], [`build_all`], [`swap`]) are public so that tests can put
//!   live activity between them.
//! - Index names of the live tables are kept: the rebuild's indexes get the live names back.

use std::time::{Duration, Instant};

use anyhow::Context;
use deadpool_postgres::Pool;
use zhihui_projections::{ProjectionName, Tables};

use crate::platform::configuration::ProjectionSettings;
use crate::platform::event_store::{AnyEventStore, EventStore, Position, RecordedEvent};
use crate::platform::projector::{PreparedPage, Projector, position_from_sql, position_to_sql};

/// What a replay did.
#[derive(Debug, Clone)]
pub struct ReplayReport {
    pub projection: ProjectionName,
    /// Events of the projection's streams applied to the fresh tables.
    pub events: u64,
    pub elapsed: Duration,
    /// Where the swapped-in tables stand.
    pub checkpoint: Option<Position>,
}

impl ReplayReport {
    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Progress callbacks, for the CLI's progress bar.
pub trait ReplayProgress {
    /// Before the build: how many events the projection will read, if the store can tell.
    fn start(&mut self, projection: ProjectionName, events_expected: Option<u64>);
    /// After each committed page: events applied so far.
    fn applied(&mut self, events_so_far: u64);
}

/// No progress shown (tests, benchmarks).
#[derive(Debug)]
pub struct Quiet;

impl ReplayProgress for Quiet {
    fn start(&mut self, _projection: ProjectionName, _events_expected: Option<u64>) {}
    fn applied(&mut self, _events_so_far: u64) {}
}

fn rebuild_checkpoint_name(projection: ProjectionName) -> String {
    format!("{}__rebuild", projection.as_str())
}

/// Rebuild `projection` and swap it in.
pub async fn replay(
    pool: &Pool,
    store: &AnyEventStore,
    projection: ProjectionName,
    settings: &ProjectionSettings,
    batch_size: usize,
    progress: &mut dyn ReplayProgress,
) -> anyhow::Result<ReplayReport> {
    let started = Instant::now();
    prepare_tables(pool, projection).await?;
    progress.start(projection, count_events(pool, store, projection).await);
    let mut events = build_all(pool, store, projection, settings, batch_size, progress).await?;
    let swapping = Instant::now();
    let (checkpoint, gap) = swap(pool, store, projection).await?;
    tracing::info!(
        projection = projection.as_str(),
        gap,
        swap_ms = swapping.elapsed().as_millis(),
        "rebuild swapped in"
    );
    events += gap;
    progress.applied(events);
    Ok(ReplayReport {
        projection,
        events,
        elapsed: started.elapsed(),
        checkpoint,
    })
}

/// Build the rebuild tables up to the end of the log (the stage before [`swap`]). Returns the
/// events applied.
pub async fn build_all(
    pool: &Pool,
    store: &AnyEventStore,
    projection: ProjectionName,
    settings: &ProjectionSettings,
    batch_size: usize,
    progress: &mut dyn ReplayProgress,
) -> anyhow::Result<u64> {
    let projector = Projector::rebuild(
        projection,
        pool.clone(),
        store.clone(),
        ProjectionSettings {
            batch_size,
            ..settings.clone()
        },
    );
    let mut events = 0u64;
    // Build until a pass finds little left, so that the swap only has a short gap to close.
    loop {
        let applied = build(&projector, store, projection, batch_size, events, progress).await?;
        events += applied;
        if applied < batch_size as u64 {
            break;
        }
    }
    let indexing = Instant::now();
    add_secondary_indexes(pool, projection).await?;
    tracing::info!(
        projection = projection.as_str(),
        events,
        indexing_ms = indexing.elapsed().as_millis(),
        "rebuild tables built and indexed"
    );
    Ok(events)
}

/// Give the rebuild tables the live tables' unique constraints and other indexes.
async fn add_secondary_indexes(pool: &Pool, projection: ProjectionName) -> anyhow::Result<()> {
    let mut client = pool.get().await.context("getting a connection")?;
    let transaction = client.transaction().await?;
    for table in projection.tables() {
        let rebuild = Tables::REBUILD.name(table);
        let mut unique = constraint_definitions(&transaction, table, "u").await?;
        if projection.insert_only_tables().contains(table) {
            unique.extend(constraint_definitions(&transaction, table, "p").await?);
        }
        for definition in &unique {
            transaction
                .batch_execute(&format!("ALTER TABLE {rebuild} ADD {definition}"))
                .await
                .with_context(|| format!("adding {definition} to {rebuild}"))?;
        }
        // Plain indexes: those that back no constraint.
        let rows = transaction
            .query(
                "SELECT pg_get_indexdef(x.indexrelid)
                   FROM pg_index x
                  WHERE x.indrelid = to_regclass($1)
                    AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)",
                &[table],
            )
            .await
            .with_context(|| format!("reading the indexes of {table}"))?;
        for row in rows {
            let definition: String = row.get(0);
            let shape = definition
                .split_once(" USING ")
                .map(|(_, shape)| shape)
                .with_context(|| format!("unexpected index definition {definition}"))?;
            let unique = if definition.starts_with("CREATE UNIQUE") {
                "UNIQUE "
            } else {
                ""
            };
            transaction
                .batch_execute(&format!("CREATE {unique}INDEX ON {rebuild} USING {shape}"))
                .await
                .with_context(|| format!("indexing {rebuild}"))?;
        }
    }
    transaction
        .commit()
        .await
        .context("indexing the rebuild tables")?;
    Ok(())
}

/// `pg_get_constraintdef` of a table's constraints of one type (`p` primary key, `u` unique).
async fn constraint_definitions(
    transaction: &tokio_postgres::Transaction<'_>,
    table: &str,
    constraint_type: &str,
) -> anyhow::Result<Vec<String>> {
    let rows = transaction
        .query(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint
              WHERE conrelid = to_regclass($1) AND contype::text = $2",
            &[&table, &constraint_type],
        )
        .await
        .with_context(|| format!("reading the constraints of {table}"))?;
    Ok(rows.iter().map(|row| row.get(0)).collect())
}

/// Drop any earlier rebuild and create empty `<table>__rebuild` tables shaped like the live ones.
pub async fn prepare_tables(pool: &Pool, projection: ProjectionName) -> anyhow::Result<()> {
    let mut client = pool.get().await.context("getting a connection")?;
    let transaction = client.transaction().await?;
    for table in projection.tables() {
        let rebuild = Tables::REBUILD.name(table);
        transaction
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {rebuild};
                 CREATE TABLE {rebuild} (LIKE {table} INCLUDING ALL EXCLUDING INDEXES);"
            ))
            .await
            .with_context(|| format!("creating {rebuild}"))?;
        // The primary key now (upserts need it as their conflict target), except on a table
        // only inserted into; the other indexes after the load, which is faster than
        // maintaining them row by row.
        if projection.insert_only_tables().contains(table) {
            continue;
        }
        for definition in constraint_definitions(&transaction, table, "p").await? {
            transaction
                .batch_execute(&format!("ALTER TABLE {rebuild} ADD {definition}"))
                .await
                .with_context(|| format!("adding the primary key of {rebuild}"))?;
        }
    }
    transaction
        .execute(
            "DELETE FROM projection_checkpoints WHERE projection = $1",
            &[&rebuild_checkpoint_name(projection)],
        )
        .await
        .context("resetting the rebuild checkpoint")?;
    transaction
        .commit()
        .await
        .context("preparing the rebuild tables")?;
    Ok(())
}

/// The number of events the projection will read, when the PostgreSQL store holds them.
async fn count_events(
    pool: &Pool,
    store: &AnyEventStore,
    projection: ProjectionName,
) -> Option<u64> {
    if !matches!(store, AnyEventStore::Postgres(_)) {
        return None;
    }
    let client = pool.get().await.ok()?;
    let row = match projection.reads() {
        zhihui_projections::Reads::StreamPrefixes(prefixes) => {
            let patterns: Vec<String> = prefixes
                .iter()
                .map(|prefix| format!("{}%", prefix.replace('%', "\\%").replace('_', "\\_")))
                .collect();
            client
                .query_one(
                    "SELECT count(*) FROM events WHERE stream_id LIKE ANY($1)",
                    &[&patterns],
                )
                .await
                .ok()?
        }
        zhihui_projections::Reads::EventTypes(types) => client
            .query_one(
                "SELECT count(*) FROM events WHERE event_type = ANY($1)",
                &[&types],
            )
            .await
            .ok()?,
    };
    u64::try_from(row.get::<_, i64>(0)).ok()
}

/// Pages in flight between two stages of [`build`]: enough to keep each stage busy, few enough
/// to bound memory (a page of the largest batch is a few MB).
const PIPELINE_PAGES: usize = 2;

/// Apply pages from the rebuild checkpoint until the end of the log, three stages at once: the
/// log read ahead (a task), the next page decoded and folded (a blocking thread: CPU only), the
/// current page written with its checkpoint (here). On two cores PostgreSQL reads and writes while
/// this process decodes. Returns the events applied.
async fn build(
    projector: &Projector,
    store: &AnyEventStore,
    projection: ProjectionName,
    batch_size: usize,
    applied_before: u64,
    progress: &mut dyn ReplayProgress,
) -> anyhow::Result<u64> {
    // A page that could not be prepared still reaches the writer, with its events: applied
    // with the runner's retries, a poison event among them is found and named.
    type Ready = anyhow::Result<(Vec<RecordedEvent>, Position, anyhow::Result<PreparedPage>)>;
    let filter = crate::platform::event_store::filter_of(projection);
    let mut position = projector.checkpoint().await?;
    let (read_sender, mut read_pages) = tokio::sync::mpsc::channel::<ReadPage>(PIPELINE_PAGES);
    let reader = match store {
        // Pages cut ahead by their boundaries, then read on several connections at once.
        AnyEventStore::Postgres(postgres) => tokio::spawn(read_ranges(
            postgres.clone(),
            position,
            batch_size,
            filter,
            read_sender,
        )),
        AnyEventStore::Kurrent(_) => tokio::spawn(read_pages_in_turn(
            store.clone(),
            position,
            batch_size,
            filter,
            read_sender,
        )),
    };
    let (ready_sender, mut ready_pages) = tokio::sync::mpsc::channel::<Ready>(PIPELINE_PAGES);
    let preparer = {
        let projector = projector.clone();
        tokio::spawn(async move {
            while let Some(read) = read_pages.recv().await {
                let ready = match read {
                    Ok((events, scanned_to)) => {
                        let projector = projector.clone();
                        tokio::task::spawn_blocking(move || {
                            let page = projector.prepare(&events);
                            (events, scanned_to, page)
                        })
                        .await
                        .context("the page preparer failed")
                    }
                    Err(error) => Err(error),
                };
                if ready_sender.send(ready).await.is_err() {
                    return;
                }
            }
        })
    };
    let mut applied = 0u64;
    let written = async {
        while let Some(ready) = ready_pages.recv().await {
            let (events, scanned_to, page) = ready?;
            let written = match page {
                Ok(page) => projector.apply_prepared(position, &page, scanned_to).await,
                Err(error) => Err(error),
            };
            if let Err(error) = written {
                if crate::platform::projector::Halt::of(&error).is_some() {
                    return Err(error);
                }
                // Again with the runner's retries, which find and name a poison event.
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "a replay page failed; applying it with retries");
                projector.apply_page(position, &events, scanned_to).await?;
            }
            position = Some(scanned_to);
            applied += events.len() as u64;
            progress.applied(applied_before + applied);
        }
        anyhow::Ok(())
    }
    .await;
    reader.abort();
    preparer.abort();
    written?;
    Ok(applied)
}

/// A page the replay read: its events and the position it ends at.
type ReadPage = anyhow::Result<(Vec<RecordedEvent>, Position)>;

/// Pages read at once by [`read_ranges`] (each its own connection).
const PARALLEL_READS: usize = 2;
/// Pages whose boundaries are found in one go.
const BOUNDARY_PAGES: usize = 8;

/// Read the log after `after` in pages, one after another, until a page reaches its end.
async fn read_pages_in_turn(
    store: AnyEventStore,
    mut after: Option<Position>,
    batch_size: usize,
    filter: crate::platform::event_store::EventFilter,
    pages: tokio::sync::mpsc::Sender<ReadPage>,
) {
    loop {
        let slice = match store.read_all(after, batch_size, &filter).await {
            Ok(slice) => slice,
            Err(error) => {
                let _ = pages
                    .send(Err(anyhow::Error::new(error).context("reading the log")))
                    .await;
                return;
            }
        };
        let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != after) else {
            return;
        };
        after = Some(scanned_to);
        // A closed channel: the writer stopped; so does the reader.
        if pages.send(Ok((slice.events, scanned_to))).await.is_err() || slice.end_of_log {
            return;
        }
    }
}

/// Read the log after `after` in pages cut ahead by their boundaries (PostgreSQL), several at
/// once, handed on in the log's order, until a round of boundaries reaches the log's end. One
/// reader spent about half its time in PostgreSQL and half parsing rows here; two keep both
/// cores on it.
async fn read_ranges(
    store: crate::platform::event_store::postgres::PostgresEventStore,
    mut after: Option<Position>,
    batch_size: usize,
    filter: crate::platform::event_store::EventFilter,
    pages: tokio::sync::mpsc::Sender<ReadPage>,
) {
    use futures::StreamExt;
    loop {
        let boundaries = match store
            .page_boundaries(after, batch_size, BOUNDARY_PAGES)
            .await
        {
            Ok(boundaries) => boundaries,
            Err(error) => {
                let _ = pages
                    .send(Err(
                        anyhow::Error::new(error).context("cutting the log into pages")
                    ))
                    .await;
                return;
            }
        };
        let mut from = after;
        let ranges: Vec<(Option<Position>, Position)> = boundaries
            .ends
            .iter()
            .map(|until| (from.replace(*until), *until))
            .collect();
        let mut reads = futures::stream::iter(ranges)
            .map(|(from, until)| {
                let store = store.clone();
                let filter = filter.clone();
                async move {
                    (
                        until,
                        store.read_range(from, until, batch_size, &filter).await,
                    )
                }
            })
            .buffered(PARALLEL_READS);
        while let Some((until, read)) = reads.next().await {
            let page = read
                .map(|slice| (slice.events, until))
                .map_err(|error| anyhow::Error::new(error).context("reading the log"));
            let failed = page.is_err();
            if pages.send(page).await.is_err() || failed {
                return;
            }
        }
        match boundaries.ends.last() {
            Some(last) if !boundaries.reached_the_end => after = Some(*last),
            _ => return,
        }
    }
}

/// Close the gap to the live checkpoint and swap the tables in, in one transaction. Returns the
/// checkpoint now live and the events applied to close the gap.
pub async fn swap(
    pool: &Pool,
    store: &AnyEventStore,
    projection: ProjectionName,
) -> anyhow::Result<(Option<Position>, u64)> {
    let live_name = projection.as_str();
    let rebuild_name = rebuild_checkpoint_name(projection);
    let mut client = pool.get().await.context("getting a connection")?;
    let transaction = client.transaction().await.context("starting the swap")?;
    // A table lock takes no transaction id: runners queue up behind it before writing anything,
    // so nobody holds the log's horizon back while the gap is read below.
    transaction
        .batch_execute("LOCK TABLE projection_checkpoints IN EXCLUSIVE MODE")
        .await
        .context("locking the checkpoints")?;
    let row = |name: String| {
        let transaction = &transaction;
        async move {
            transaction
                .query_opt(
                    "SELECT commit_position, prepare_position, events_applied
                       FROM projection_checkpoints WHERE projection = $1",
                    &[&name],
                )
                .await
                .with_context(|| format!("reading checkpoint {name}"))
        }
    };
    let live = match row(live_name.to_owned()).await? {
        Some(row) => position_from_sql(row.get(0), row.get(1))?,
        None => None,
    };
    let rebuilt_row = row(rebuild_name.clone())
        .await?
        .context("the rebuild checkpoint is missing")?;
    let rebuilt = position_from_sql(rebuilt_row.get(0), rebuilt_row.get(1))?;
    let mut events_applied: i64 = rebuilt_row.get(2);

    // Events the live runner applied beyond the rebuild: read them all first (reading later,
    // after this transaction has written and so holds an id, would wait on ourselves).
    let mut gap = Vec::new();
    if live > rebuilt {
        let filter = crate::platform::event_store::filter_of(projection);
        let mut after = rebuilt;
        while after < live {
            let slice = store
                .read_all(after, crate::cli::audit::VERIFY_READ_PAGE_MAX, &filter)
                .await
                .context("reading the gap")?;
            let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != after) else {
                anyhow::bail!("the log ended before the live checkpoint {live:?}");
            };
            gap.extend(
                slice
                    .events
                    .into_iter()
                    .filter(|event| Some(event.position) <= live),
            );
            after = Some(scanned_to);
        }
    }
    let checkpoint = live.max(rebuilt);
    let gap_count = gap.len() as u64;
    if !gap.is_empty() {
        let projected: Vec<_> = gap
            .iter()
            .map(crate::platform::projector::to_projected)
            .collect();
        projection
            .apply(&transaction, &Tables::REBUILD, &projected)
            .await
            .context("applying the gap")?;
        events_applied += i64::try_from(gap_count)?;
    }

    for table in projection.tables() {
        let rebuild = Tables::REBUILD.name(table);
        let old = format!("{table}__old");
        let live_indexes = index_definitions(&transaction, table).await?;
        transaction
            .batch_execute(&format!(
                "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;
                 ALTER TABLE {table} RENAME TO {old};
                 ALTER TABLE {rebuild} RENAME TO {table};
                 DROP TABLE {old};"
            ))
            .await
            .with_context(|| format!("swapping {table}"))?;
        // Give the new table's indexes the live names back (same definition, other name).
        for (name, definition) in index_definitions(&transaction, table).await? {
            if let Some((live_name, _)) = live_indexes
                .iter()
                .find(|(_, live_definition)| *live_definition == definition)
                && *live_name != name
            {
                transaction
                    .batch_execute(&format!("ALTER INDEX \"{name}\" RENAME TO \"{live_name}\""))
                    .await
                    .with_context(|| format!("renaming index {name}"))?;
            }
        }
    }
    let (commit, prepare) = position_to_sql(checkpoint)?;
    transaction
        .execute(
            "INSERT INTO projection_checkpoints AS c
                    (projection, commit_position, prepare_position, events_applied, updated_at)
             VALUES ($1, $2, $3, $4, now())
             ON CONFLICT (projection) DO UPDATE
                SET commit_position = EXCLUDED.commit_position,
                    prepare_position = EXCLUDED.prepare_position,
                    events_applied = EXCLUDED.events_applied,
                    updated_at = now(), stopped_reason = NULL",
            &[&live_name, &commit, &prepare, &events_applied],
        )
        .await
        .context("moving the live checkpoint")?;
    transaction
        .execute(
            "DELETE FROM projection_checkpoints WHERE projection = $1",
            &[&rebuild_name],
        )
        .await
        .context("removing the rebuild checkpoint")?;
    transaction.commit().await.context("committing the swap")?;
    Ok((checkpoint, gap_count))
}

/// (index name, definition with the index name taken out) of a table's indexes.
async fn index_definitions(
    transaction: &tokio_postgres::Transaction<'_>,
    table: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let rows = transaction
        .query(
            "SELECT i.relname, pg_get_indexdef(i.oid)
               FROM pg_index x
               JOIN pg_class i ON i.oid = x.indexrelid
              WHERE x.indrelid = to_regclass($1)",
            &[&table],
        )
        .await
        .with_context(|| format!("reading the indexes of {table}"))?;
    Ok(rows
        .iter()
        .map(|row| {
            let name: String = row.get(0);
            let definition: String = row.get(1);
            // "CREATE [UNIQUE] INDEX <name> ON <table> USING ...": compare what follows the name
            // and the table, which differ between the two tables.
            let shape = definition
                .split_once(" USING ")
                .map(|(_, rest)| rest.to_owned())
                .unwrap_or_default();
            let unique = definition.starts_with("CREATE UNIQUE");
            (name, format!("{unique} {shape}"))
        })
        .collect())
}
