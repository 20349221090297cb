//! Intent rows ended in groups: one `DELETE` for every request that finished meanwhile.
//!
//! A request that writes to two streams records an intent first (`task_intents`, see
//! `service.rs`) and deletes it when it is done. Each used to run a `DELETE` of its own: a
//! statement, a transaction and a WAL flush per submission, and with them a round trip's CPU on
//! both sides. Taking that statement out of a submission altogether raised `bench_http`'s
//! submissions by a median of 10 % (BENCHMARKS.md, "Eighth pass").
//!
//! So a request hands its intent's id to a task that deletes, and waits for its answer. The task
//! deletes everything handed to it since its last statement in one `DELETE … = ANY($1)`. Under
//! load one statement and one commit end many intents; a request alone waits as long as before.
//! A request still returns only after its intent is gone, so what the sweeper, `audit` and
//! another process see is unchanged. This works like the event store's group commit
//! (`event_store/postgres.rs`), for a row whose loss costs nothing: an intent that outlives its
//! request (the process died first) is resolved by the sweeper, which then finds nothing to do.
//!
//! The task runs on the runtime of the first request that ends an intent, and is started again
//! on the caller's runtime if that one has stopped. A request whose task stopped before
//! answering deletes its row itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;
use deadpool_postgres::Pool;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

/// Intents ended by one statement at most.
pub const INTENTS_PER_STATEMENT_MAX: usize = 1_000;

/// Ends intents, grouping those that end together (cheap to clone: clones share the task).
#[derive(Debug, Clone)]
pub struct IntentEnds {
    pool: Pool,
    sender: Arc<Mutex<Option<mpsc::UnboundedSender<Ending>>>>,
    statements: Arc<AtomicU64>,
}

/// One request's intent, and where its answer goes.
#[derive(Debug)]
struct Ending {
    intent_id: Uuid,
    done: oneshot::Sender<Result<(), String>>,
}

impl IntentEnds {
    pub fn new(pool: Pool) -> IntentEnds {
        IntentEnds {
            pool,
            sender: Arc::new(Mutex::new(None)),
            statements: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Delete the intent row `intent_id` (gone already: nothing to do); returns once it is gone.
    pub async fn end(&self, intent_id: Uuid) -> anyhow::Result<()> {
        let (done, answer) = oneshot::channel();
        // Unbounded: every entry is a caller waiting for its answer, so the channel holds at most
        // as many as there are requests in flight.
        if self.sender().send(Ending { intent_id, done }).is_err() {
            return delete(&self.pool, &self.statements, &[intent_id]).await;
        }
        match answer.await {
            Ok(Ok(())) => Ok(()),
            // The group's statement failed (its error came back as words, which cannot say a
            // store away from a bug: a 503 would have been a 500), or the task stopped with its
            // runtime before answering: this intent alone, whose error is its own.
            Ok(Err(_)) | Err(_) => delete(&self.pool, &self.statements, &[intent_id]).await,
        }
    }

    /// `DELETE` statements run so far (each ends one group of intents).
    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    /// The running task's sender, starting the task on the caller's runtime when none runs.
    fn sender(&self) -> mpsc::UnboundedSender<Ending> {
        let mut sender = self.sender.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(running) = sender.as_ref().filter(|running| !running.is_closed()) {
            return running.clone();
        }
        let (started, receiver) = mpsc::unbounded_channel();
        // The task holds the pool, not the sender: when every clone of this is dropped, its
        // channel closes and the task ends (with the pool's connections).
        tokio::spawn(run(self.pool.clone(), self.statements.clone(), receiver));
        *sender = Some(started.clone());
        started
    }
}

async fn run(
    pool: Pool,
    statements: Arc<AtomicU64>,
    mut receiver: mpsc::UnboundedReceiver<Ending>,
) {
    let mut group = Vec::new();
    while receiver
        .recv_many(&mut group, INTENTS_PER_STATEMENT_MAX)
        .await
        > 0
    {
        let ids: Vec<Uuid> = group.iter().map(|ending| ending.intent_id).collect();
        let result = delete(&pool, &statements, &ids)
            .await
            .map_err(|error| crate::platform::telemetry::error_chain(&error));
        for ending in group.drain(..) {
            // A caller that went away needs no answer.
            let _ = ending.done.send(result.clone());
        }
    }
}

async fn delete(pool: &Pool, statements: &AtomicU64, intent_ids: &[Uuid]) -> anyhow::Result<()> {
    let client = crate::platform::postgres::checkout(pool)
        .await
        .context("getting a connection")?;
    statements.fetch_add(1, Ordering::Relaxed);
    crate::platform::postgres::execute_cached(
        &client,
        "DELETE FROM task_intents WHERE intent_id = ANY($1)",
        &[&intent_ids],
    )
    .await
    .context("deleting intents")?;
    Ok(())
}
