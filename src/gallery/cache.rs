//! Two levels of cache in front of the read models, for what every visitor reads (a work, the
//! first page of the new list): this process's memory (`moka`), then Redis, then PostgreSQL.
//!
//! The three ways such a cache fails under load, and what stops each here:
//! - **penetration** (requests for ids that do not exist go through to the database every time):
//!   "missing" is cached like any value (`Stamped::value` is `None`), at both levels;
//! - **breakdown** (a popular entry expires and every request rebuilds it at once): in a process,
//!   `moka`'s `try_get_with` runs one load per key while the others wait for it; across processes
//!   the Redis copy carries a logical expiry, and only the request that takes its rebuild lock
//!   (`SET NX PX`) reads the database, while the others keep serving the stale copy (or, with no
//!   copy at all, wait a moment for the winner's);
//! - **avalanche** (many entries expiring in the same second): every lifetime, at both levels, is
//!   the configured one plus a random spread of up to half of it.
//!
//! A change others must not see late (a work hidden, unpublished, published) replaces the Redis
//! copy by a tombstone and tells every process to drop its own (`Envelope::GalleryChanged` on the
//! notification channel), so it is gone everywhere within the channel's delay, not the
//! lifetime's. A rebuild that was already reading when the change came must not bring the old
//! value back: in Redis, it stores only if no tombstone is newer than its start (both times
//! Redis's own, `lua/gallery_cache_*.lua`); in a process, a load during which any value was
//! forgotten is not kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::Rng;
use redis::AsyncCommands;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::keys::{CACHE_CLOCK, CACHE_FORGET, CACHE_STORE};
use crate::platform::clock::Clock;
use crate::platform::redis_store::RedisStore;

/// How long a rebuild lock is held at most (a rebuild that dies leaves it to expire).
const REBUILD_LOCK_MS: u64 = 2_000;
/// How long a request without any copy waits for another's rebuild before reading itself: as
/// long as the rebuild may hold its lock.
const WAIT_FOR_REBUILD: Duration = Duration::from_millis(REBUILD_LOCK_MS);
const WAIT_STEP: Duration = Duration::from_millis(5);
/// How long a tombstone stays: longer than any rebuild that began before it can still run.
const TOMBSTONE_MS: u64 = 10 * 60 * 1000;

/// A cached value (or `None`: known not to exist) with the moment it stops being fresh.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stamped<V> {
    pub fresh_until_ms: i64,
    pub value: Option<V>,
}

/// Counts for tests and benchmarks: how often the source was read.
#[derive(Debug, Default)]
pub struct CacheCounts {
    pub source_loads: AtomicU64,
    pub stale_served: AtomicU64,
}

/// A random lifetime per entry (the avalanche's cure).
struct Spread {
    base: Duration,
}

impl Spread {
    fn lifetime(&self) -> Duration {
        let base_ms = self.base.as_millis() as u64;
        let spread_ms = rand::rng().random_range(0..=base_ms / 2);
        Duration::from_millis(base_ms + spread_ms)
    }
}

impl<K, V> moka::Expiry<K, V> for Spread {
    fn expire_after_create(&self, _key: &K, _value: &V, _created_at: Instant) -> Option<Duration> {
        Some(self.lifetime())
    }
}

/// One family of cached values (works, list pages), keyed by their Redis key.
#[derive(Clone)]
pub struct Layered<V: Clone + Send + Sync + 'static> {
    local: moka::future::Cache<String, Arc<Option<V>>>,
    redis: RedisStore,
    clock: Clock,
    fresh_for: Duration,
    counts: Arc<CacheCounts>,
    /// Moves on every forget in this process: a load that saw it move keeps its value out of
    /// this process's cache.
    forgotten: Arc<AtomicU64>,
}

impl<V: Clone + Send + Sync + 'static> std::fmt::Debug for Layered<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layered")
            .field("entries", &self.local.entry_count())
            .field("fresh_for", &self.fresh_for)
            .finish()
    }
}

impl<V> Layered<V>
where
    V: Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
{
    pub fn new(redis: RedisStore, clock: Clock, fresh_for: Duration, capacity: u64) -> Layered<V> {
        // This process's copy lives a quarter of the shared one's lifetime: it is what a
        // missed invalidation could leave behind.
        let local = moka::future::Cache::builder()
            .max_capacity(capacity)
            .expire_after(Spread {
                base: (fresh_for / 4).max(Duration::from_millis(5)),
            })
            .build();
        Layered {
            local,
            redis,
            clock,
            fresh_for,
            counts: Arc::new(CacheCounts::default()),
            forgotten: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn counts(&self) -> &CacheCounts {
        &self.counts
    }

    /// The value under `key`, loading it with `load` (the source) when neither level has it.
    pub async fn get<F, Fut>(
        &self,
        key: &str,
        lock_key: &str,
        load: F,
    ) -> anyhow::Result<Arc<Option<V>>>
    where
        F: FnOnce() -> Fut + Send,
        Fut: std::future::Future<Output = anyhow::Result<Option<V>>> + Send,
    {
        Box::pin(kept_unless_forgotten(
            &self.local,
            &self.forgotten,
            key.to_owned(),
            async { self.shared(key, lock_key, load).await.map(Arc::new) },
        ))
        .await
    }

    /// Drop this process's copy of `key` (another process changed it, or this one did).
    pub async fn forget_local(&self, key: &str) {
        self.forgotten.fetch_add(1, Ordering::AcqRel);
        self.local.invalidate(key).await;
    }

    /// Drop every copy this process holds.
    pub fn forget_all_local(&self) {
        self.forgotten.fetch_add(1, Ordering::AcqRel);
        self.local.invalidate_all();
    }

    /// Replace the shared copy of `key` by a tombstone and drop this process's (the caller
    /// tells the others).
    pub async fn forget(&self, key: &str) -> anyhow::Result<()> {
        self.forget_local(key).await;
        let mut connection = self.redis.connection().await?;
        let _: i64 = CACHE_FORGET
            .key(key)
            .arg(TOMBSTONE_MS)
            .invoke_async(&mut connection)
            .await
            .context("dropping a cached gallery value")?;
        Ok(())
    }

    async fn read_shared(&self, key: &str) -> anyhow::Result<Option<Stamped<V>>> {
        let mut connection = self.redis.connection().await?;
        let text: Option<String> = connection
            .get(key)
            .await
            .context("reading a cached gallery value")?;
        Ok(text.and_then(|text| serde_json::from_str(&text).ok()))
    }

    async fn shared<F, Fut>(&self, key: &str, lock_key: &str, load: F) -> anyhow::Result<Option<V>>
    where
        F: FnOnce() -> Fut + Send,
        Fut: std::future::Future<Output = anyhow::Result<Option<V>>> + Send,
    {
        let now_ms = self.clock.now_ms();
        let cached = self.read_shared(key).await?;
        if let Some(cached) = &cached
            && cached.fresh_until_ms > now_ms
        {
            return Ok(cached.value.clone());
        }
        let mut connection = self.redis.connection().await?;
        let won: bool = redis::cmd("SET")
            .arg(lock_key)
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(REBUILD_LOCK_MS)
            .query_async::<Option<String>>(&mut connection)
            .await
            .context("taking a cache rebuild lock")?
            .is_some();
        if !won {
            if let Some(stale) = cached {
                self.counts.stale_served.fetch_add(1, Ordering::Relaxed);
                return Ok(stale.value);
            }
            // Nothing to serve meanwhile: wait for the winner's copy.
            let deadline = Instant::now() + WAIT_FOR_REBUILD;
            while Instant::now() < deadline {
                tokio::time::sleep(WAIT_STEP).await;
                if let Some(copy) = self.read_shared(key).await? {
                    return Ok(copy.value);
                }
            }
        } else if let Some(copy) = self.read_shared(key).await?
            && copy.fresh_until_ms > self.clock.now_ms()
        {
            // Another rebuild finished between this request's read and its lock: use its copy.
            let _: Result<i64, _> = connection.del(lock_key).await;
            return Ok(copy.value);
        }
        // When this rebuild begins, on the clock the tombstones are stamped with.
        let began_ms: i64 = CACHE_CLOCK
            .key(key)
            .invoke_async(&mut connection)
            .await
            .context("reading Redis's clock")?;
        self.counts.source_loads.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("zhihui_gallery_cache_loads_total").increment(1);
        let value = load().await;
        let value = match value {
            Ok(value) => value,
            Err(error) => {
                if won {
                    let _: Result<i64, _> = connection.del(lock_key).await;
                }
                return Err(error);
            }
        };
        let lifetime = Spread {
            base: self.fresh_for,
        }
        .lifetime();
        let stamped = Stamped {
            fresh_until_ms: now_ms + lifetime.as_millis() as i64,
            value: value.clone(),
        };
        // The copy outlives its freshness: stale, it is what others serve during a rebuild.
        let keep_ms = (lifetime.as_millis() as u64).saturating_mul(10);
        let text = serde_json::to_string(&stamped).context("encoding a cached gallery value")?;
        let _stored: i64 = CACHE_STORE
            .key(key)
            .arg(text)
            .arg(keep_ms)
            .arg(began_ms)
            .invoke_async(&mut connection)
            .await
            .context("storing a cached gallery value")?;
        if won {
            let _: Result<i64, _> = connection.del(lock_key).await;
        }
        Ok(value)
    }
}

/// A load's failure as each of its waiters gets it: `moka` hands every waiter the same
/// `Arc`, and the failure's causes stay reachable through it, so a store that is away is still
/// told apart from a bug (a 503 to retry, not a 500).
#[derive(Debug)]
pub(crate) struct SharedFailure(pub(crate) Arc<anyhow::Error>);

impl std::fmt::Display for SharedFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for SharedFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.0.as_ref().as_ref())
    }
}

/// `moka`'s shared failure as an error of its own, its causes kept.
/// `key` from `cache`, loaded by `load` on a miss; a load that ran while anything was forgotten
/// (`forgotten` moved) is handed to its callers but not kept: `moka` keeps what a load returns
/// even when its key was invalidated meanwhile, and that read was concurrent with the change.
pub(crate) async fn kept_unless_forgotten<K, V, Fut>(
    cache: &moka::future::Cache<K, Arc<V>>,
    forgotten: &AtomicU64,
    key: K,
    load: Fut,
) -> anyhow::Result<Arc<V>>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    V: Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Arc<V>>>,
{
    let before = forgotten.load(Ordering::Acquire);
    let value = cache
        .try_get_with(key.clone(), load)
        .await
        .map_err(shared_failure)?;
    if forgotten.load(Ordering::Acquire) != before {
        cache.invalidate(&key).await;
    }
    Ok(value)
}

pub(crate) fn shared_failure(error: Arc<anyhow::Error>) -> anyhow::Error {
    anyhow::Error::new(SharedFailure(error))
}
