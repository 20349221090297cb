//! Leadership across zhihui processes for background workers that must run once (projection
//! runners, process managers): a PostgreSQL session advisory lock held on a dedicated connection.
//! When the holder dies its connection closes, the lock is released, and a follower that checks
//! again takes over. Holding the lock is a liveness optimisation, not the safety guard: every
//! worker also fences its writes (a locked checkpoint row, an expected stream version).

use anyhow::Context;
use deadpool_postgres::Pool;

/// Advisory-lock key of a worker name: stable across processes and releases.
pub fn lock_key(name: &str) -> i64 {
    // FNV-1a: tiny, stable, no dependency; a collision only makes two workers share a lock.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

/// A connection holding a leader lock. It is taken out of its pool the moment the lock is held,
/// so that it never counts against the pool's size (one process may lead many workers: each
/// lock held from the pool would starve the work those workers do with the same pool) and can
/// never go back to the pool locked. Dropping it closes the connection, which releases the lock.
#[derive(Debug)]
pub struct LeaderLock(deadpool_postgres::ClientWrapper);

/// A dedicated connection holding the lock named `name`, or `None` if another process holds it.
pub async fn try_lead(pool: &Pool, name: &str) -> anyhow::Result<Option<LeaderLock>> {
    let connection = pool.get().await.context("getting a connection")?;
    let locked: bool = connection
        .query_one("SELECT pg_try_advisory_lock($1)", &[&lock_key(name)])
        .await
        .with_context(|| format!("trying the lock {name}"))?
        .get(0);
    // Not locked: the connection holds nothing and goes back to the pool.
    Ok(locked.then(|| LeaderLock(deadpool_postgres::Object::take(connection))))
}

/// Give up leadership: the connection closes, which releases the lock.
pub fn resign(lock_connection: LeaderLock) {
    drop(lock_connection);
}

/// Fails when the lock connection is gone (and with it, the lock).
pub async fn still_leading(lock_connection: &LeaderLock) -> anyhow::Result<()> {
    let lock_connection = &lock_connection.0;
    lock_connection
        .simple_query("SELECT 1")
        .await
        .context("the lock connection is gone")?;
    Ok(())
}

/// A batch taken from a subscription: the events delivered so far (at most `batch_max`) and how
/// far the subscription has scanned (`None` when it only said it caught up).
#[derive(Debug)]
pub struct SubscriptionBatch {
    pub events: Vec<crate::platform::event_store::RecordedEvent>,
    pub scanned_to: Option<crate::platform::event_store::Position>,
}

/// Wait for the subscription's next message, checking every `lock_check` that the lock is still
/// held; then take everything already delivered, up to `batch_max` events, without waiting for
/// more (a lone event is applied at once: the lag stays one commit).
pub async fn next_batch(
    subscription: &mut futures::stream::BoxStream<
        'static,
        Result<
            crate::platform::event_store::SubscriptionMessage,
            crate::platform::event_store::EventStoreError,
        >,
    >,
    lock_connection: &LeaderLock,
    lock_check: std::time::Duration,
    batch_max: usize,
) -> anyhow::Result<SubscriptionBatch> {
    use crate::platform::event_store::SubscriptionMessage;
    use futures::StreamExt;

    let first = loop {
        match tokio::time::timeout(lock_check, subscription.next()).await {
            Err(_quiet) => still_leading(lock_connection).await?,
            Ok(None) => anyhow::bail!("the subscription ended"),
            Ok(Some(message)) => break message?,
        }
    };
    let mut batch = SubscriptionBatch {
        events: Vec::new(),
        scanned_to: None,
    };
    let mut next = Some(first);
    while let Some(message) = next.take() {
        match message {
            SubscriptionMessage::Event(event) => {
                batch.scanned_to = Some(event.position);
                batch.events.push(*event);
            }
            SubscriptionMessage::Checkpoint(position) => batch.scanned_to = Some(position),
            SubscriptionMessage::CaughtUp => {}
        }
        if batch.events.len() < batch_max
            && let Some(Some(message)) = futures::FutureExt::now_or_never(subscription.next())
        {
            next = Some(message?);
        }
    }
    Ok(batch)
}
