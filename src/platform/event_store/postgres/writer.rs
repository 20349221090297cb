//! The writing side: group commit. Appends queue to a few writer tasks; each takes a batch,
//! sorted by stream (one lock order), into one transaction: one `zhihui_append_batch` statement
//! (or one `zhihui_append` per append, pipelined), one commit, each append answered by its own
//! status. `until_known` retries an append whose answer was lost with its connection.

use super::*;

pub(super) struct AppendRequest {
    pub(super) stream: String,
    pub(super) expected: ExpectedVersion,
    pub(super) events: Vec<NewEvent>,
    pub(super) retries: u32,
    pub(super) reply: oneshot::Sender<Result<AppendOutcome, EventStoreError>>,
}

pub(super) const APPEND_SQL: &str = "SELECT status, version, last_position, last_transaction \
     FROM zhihui_append($1, $2, $3, $4, $5, $6, $7, $8)";

/// A group-commit batch of appends to distinct streams, one row per append (`n`: its place).
pub(super) const APPEND_BATCH_SQL: &str = "SELECT n, status, version, last_position, last_transaction \
     FROM zhihui_append_batch($1, $2, $3, $4, $5, $6, $7, $8, $9)";

impl PostgresEventStore {
    pub(super) async fn append_alone(
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
            .await;
            let row = match row {
                Ok(row) => row,
                Err(error) => return Err(failed_append(&self.inner.pool, events, error).await),
            };
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
}

/// One group-commit writer: take a batch from the shared queue, commit it, answer each caller.
pub(super) async fn group_writer(
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
                    let single = until_known(unknown_outcome_retry_max, || {
                        commit_batch(&pool, std::slice::from_ref(request), one_statement)
                    })
                    .await;
                    results.push(match single {
                        Ok(mut single) => single.remove(0),
                        Err(error) => {
                            Interpreted::Done(Err(
                                failed_append(&pool, &request.events, error).await
                            ))
                        }
                    });
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
pub(super) async fn commit_batch(
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
pub(super) async fn commit_pipelined(
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

pub(super) fn interpret_all(
    batch: &[AppendRequest],
    rows: &[Row],
) -> anyhow::Result<Vec<Interpreted>> {
    batch
        .iter()
        .zip(rows)
        .map(|(request, row)| interpret(&request.stream, request.expected, &request.events, row))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| anyhow::anyhow!("{error}"))
}

/// The owned parameters of one `zhihui_append` call.
pub(super) struct AppendParams<'a> {
    pub(super) stream: &'a str,
    pub(super) expected_kind: i16,
    pub(super) expected_version: i64,
    pub(super) ids: Vec<Uuid>,
    pub(super) types: Vec<&'a str>,
    pub(super) schema_versions: Vec<i32>,
    // tokio-postgres's `Json` serializes into its buffer: a payload writes its text as it is.
    pub(super) payloads: Vec<Json<&'a Payload>>,
    pub(super) metadata: Vec<Json<&'a EventMetadata>>,
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

pub(super) enum Interpreted {
    Done(Result<AppendOutcome, EventStoreError>),
    RetryInNewerTransaction,
}

/// An expectation as the SQL functions take it: its kind (0 any, 1 no stream, 2 exact, 3 stream
/// exists) and the exact version (-1 when there is none).
pub(super) fn expected_params(expected: ExpectedVersion) -> (i16, i64) {
    match expected {
        ExpectedVersion::Any => (0, -1),
        ExpectedVersion::NoStream => (1, -1),
        ExpectedVersion::Exact(version) => (2, to_i64(version)),
        ExpectedVersion::StreamExists => (3, -1),
    }
}

/// A batch's appends as `zhihui_append_batch` takes them: one entry per append, its events laid
/// end to end.
pub(super) struct BatchParams<'a> {
    pub(super) streams: Vec<&'a str>,
    pub(super) expected_kinds: Vec<i16>,
    pub(super) expected_versions: Vec<i64>,
    pub(super) counts: Vec<i32>,
    pub(super) ids: Vec<Uuid>,
    pub(super) types: Vec<&'a str>,
    pub(super) schema_versions: Vec<i32>,
    pub(super) payloads: Vec<Json<&'a Payload>>,
    pub(super) metadata: Vec<Json<&'a EventMetadata>>,
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

pub(super) fn interpret(
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
            duplicate: status == "duplicate",
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

/// What an append that failed with `error` tells its caller. `zhihui_append` answers an event id
/// already stored itself (`id_reused`), but one stored by a concurrent append surfaces as the
/// unique key's violation once that append commits (ours waited on the key): the same answer,
/// naming the id found stored. Anything else: the store is unavailable.
async fn failed_append(pool: &Pool, events: &[NewEvent], error: anyhow::Error) -> EventStoreError {
    let id_taken = error.chain().any(|cause| {
        cause
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(tokio_postgres::Error::as_db_error)
            .is_some_and(|db| db.constraint() == Some("events_event_id_unique"))
    });
    if !id_taken {
        return EventStoreError::Unavailable(error);
    }
    let ids: Vec<Uuid> = events.iter().map(|event| event.id).collect();
    let stored = async {
        let client = crate::platform::postgres::checkout(pool)
            .await
            .context("getting a connection")?;
        client
            .query_opt(
                "SELECT event_id FROM events WHERE event_id = ANY($1) LIMIT 1",
                &[&ids],
            )
            .await
            .context("finding the event id a concurrent append stored")
    };
    match stored.await {
        Ok(Some(row)) => EventStoreError::EventIdReused {
            event_id: row.get(0),
        },
        Ok(None) => EventStoreError::Unavailable(error),
        Err(lookup) => EventStoreError::Unavailable(error.context(format!("{lookup:#}"))),
    }
}

/// Run `attempt` until it succeeds, fails for a reason a retry cannot change, or `retry_max` has
/// passed since the first failure; between attempts a backoff from 50 ms to 1 s. Only for
/// attempts that are safe to repeat (appends: the event ids decide).
pub(super) async fn until_known<T, F, Fut>(retry_max: Duration, mut attempt: F) -> anyhow::Result<T>
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
                tracing::warn!(error = %format!("{error:#}"), retry_in_ms = backoff.as_millis(), "append's outcome unknown (connection lost or server unavailable); trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(error) => return Err(error),
        }
    }
}
