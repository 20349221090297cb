//! The PostgreSQL connection pool and the schema migrations.
//!
//! Migrations are the SQL files in `migrations/` (named `V<n>__<what>.sql`), embedded into the
//! binary at build time by refinery. refinery records each applied file with a checksum and aborts
//! when an applied file has changed (`abort_divergent`), so history cannot silently drift. Several
//! instances may start at once: a session-level advisory lock makes them migrate one after another.

use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
    Timeouts, WeakPool,
};

use crate::platform::configuration::DatabaseSettings;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory lock key held while migrating (an arbitrary constant: "zhihui" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x7a68_6968_7569;

/// A pooled connection idle longer than this is checked with one empty round trip before it is
/// handed out again; one used more recently is handed out as it is (unless it already looks
/// closed). See [`build_pool`].
pub const VERIFY_IDLE_AFTER: Duration = Duration::from_secs(1);

/// Build the pool. No connection is opened here: the first use opens one, so `serve` can start
/// (and `/ready` can report) while PostgreSQL is still down.
///
/// Checkouts: a connection whose backend was terminated (a restart, a failover) may not look
/// closed yet when it is taken again, and handing it out would fail a request for nothing; an
/// empty round trip on every checkout (deadpool's `Verified`) catches that, but it was a third of
/// a simple read's PostgreSQL work. So only a connection idle for [`VERIFY_IDLE_AFTER`] is
/// verified: a busy pool's connections were proven by the statement they just ran, and a
/// backend killed under load closes their sockets, which `is_closed` sees.
pub fn build_pool(settings: &DatabaseSettings) -> anyhow::Result<Pool> {
    let pool = pool_of_size(settings, settings.pool_max_size)?;
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    built.retain(|(weak, _)| weak.upgrade().is_some());
    built.push((pool.weak(), settings.clone()));
    Ok(pool)
}

/// Every pool [`build_pool`] made that still lives, with its settings: what a worker's twin of
/// it is built from.
static BUILT: std::sync::Mutex<Vec<(WeakPool, DatabaseSettings)>> =
    std::sync::Mutex::new(Vec::new());

thread_local! {
    /// This HTTP worker's twins of the shared pools (see [`checkout`]).
    static TWINS: std::cell::RefCell<Vec<(WeakPool, Pool)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether `a` and `b` are clones of one pool.
fn same_pool(a: &Pool, b: &Pool) -> bool {
    std::ptr::eq(a.manager(), b.manager())
}

/// A connection of `pool`, for the calling thread: on an HTTP worker's thread from the worker's
/// own twin of `pool` (`database.worker_pool_max_size` connections, opened there, so their I/O
/// runs on the thread the request runs on; see [`crate::platform::worker_local`]), elsewhere from `pool`.
/// The request path checks out its connections here.
pub async fn checkout(pool: &Pool) -> Result<Object, PoolError> {
    match twin_of(pool) {
        Some(twin) => twin.get().await,
        None => pool.get().await,
    }
}

/// This worker's twin of `pool`, made on first use; `None` off a worker thread, or for a pool
/// not made by [`build_pool`].
fn twin_of(pool: &Pool) -> Option<Pool> {
    if !crate::platform::worker_local::on_http_worker() {
        return None;
    }
    TWINS.with(|twins| {
        let mut twins = twins.borrow_mut();
        // A twin whose original is gone goes with it.
        twins.retain(|(original, _)| original.upgrade().is_some());
        if let Some((_, twin)) = twins.iter().find(|(original, _)| {
            original
                .upgrade()
                .is_some_and(|original| same_pool(&original, pool))
        }) {
            return Some(twin.clone());
        }
        let settings = BUILT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|(weak, _)| weak.upgrade().is_some_and(|built| same_pool(&built, pool)))
            .map(|(_, settings)| settings.clone())?;
        // Building opens nothing: the first checkout opens a connection, on this thread.
        let twin = pool_of_size(&settings, settings.worker_pool_max_size).ok()?;
        twins.push((pool.weak(), twin.clone()));
        Some(twin)
    })
}

fn pool_of_size(settings: &DatabaseSettings, max_size: usize) -> anyhow::Result<Pool> {
    // Host by host, skipping a primary on an old timeline (an old primary started again after a
    // failover): see `pg_fencing`.
    let manager = Manager::from_connect(
        settings.pg_config()?,
        crate::platform::pg_fencing::FencedConnect,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let recycle_timeout = Duration::from_millis(settings.connect_timeout_ms);
    let timeouts = Timeouts {
        wait: Some(Duration::from_millis(settings.pool_wait_timeout_ms)),
        create: Some(Duration::from_millis(settings.connect_timeout_ms)),
        recycle: Some(recycle_timeout),
    };
    Pool::builder(manager)
        .max_size(max_size)
        .timeouts(timeouts)
        .runtime(Runtime::Tokio1)
        .pre_recycle(Hook::async_fn(move |client, metrics| {
            Box::pin(async move {
                if metrics.last_used() < VERIFY_IDLE_AFTER {
                    return Ok(());
                }
                match tokio::time::timeout(recycle_timeout, client.simple_query("")).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(error)) => Err(HookError::Backend(error)),
                    Err(_) => Err(HookError::Message(
                        "verifying a connection timed out".into(),
                    )),
                }
            })
        }))
        .build()
        .context("building the PostgreSQL pool")
}

/// Statements the request path runs again and again are prepared once per connection (deadpool's
/// statement cache) and then only bound and executed: one round trip instead of two (parse and
/// describe, then bind and execute), and no parse or plan on the server each time. For a statement
/// whose text is one of a few fixed shapes; text built from user input would fill the cache.
pub async fn query_cached(
    client: &impl deadpool_postgres::GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.query(&statement, params).await
}

/// [`query_cached`], for at most one row.
pub async fn query_opt_cached(
    client: &impl deadpool_postgres::GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.query_opt(&statement, params).await
}

/// [`query_cached`], for a statement that returns no rows: how many it touched.
pub async fn execute_cached(
    client: &impl deadpool_postgres::GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<u64, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.execute(&statement, params).await
}

/// What `migrate` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Names of the migrations applied by this call, in order (`V1__schema_history`...).
    pub applied: Vec<String>,
}

/// Apply pending migrations. Refuses (error) when an applied migration file has changed or when
/// the database holds a migration this binary does not know.
pub async fn migrate(pool: &Pool) -> anyhow::Result<MigrationReport> {
    let mut client = pool
        .get()
        .await
        .context("connecting to PostgreSQL to migrate")?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
        .await
        .context("taking the migration lock")?;
    let outcome = embedded::migrations::runner()
        .set_abort_divergent(true)
        .set_abort_missing(true)
        .run_async(&mut **client)
        .await;
    // Unlock whatever happened; if unlocking fails the connection is broken and the session
    // lock dies with it.
    let unlock = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
        .await;
    let report = outcome.context("applying migrations")?;
    unlock.context("releasing the migration lock")?;
    Ok(MigrationReport {
        applied: report
            .applied_migrations()
            .iter()
            .map(|migration| migration.to_string())
            .collect(),
    })
}

/// Liveness of the database for `/ready`: a round trip on a pooled connection.
pub async fn ping(pool: &Pool) -> anyhow::Result<()> {
    let client = pool.get().await.context("getting a connection")?;
    client
        .simple_query("SELECT 1")
        .await
        .context("running SELECT 1")?;
    Ok(())
}

/// Whether `error` says, anywhere in its cause chain, that PostgreSQL is away (refused, closed,
/// shutting down or starting, read-only, out of connections or resources; see
/// [`sql_state_unavailable`]) or that no connection could be had: nothing about what was being
/// done, which succeeds once the server answers again.
pub fn away(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<tokio_postgres::Error>()
            .is_some_and(|error| {
                error.is_closed() || error.code().is_some_and(sql_state_unavailable)
            })
            || cause
                .downcast_ref::<deadpool_postgres::PoolError>()
                .is_some_and(|pool_error| match pool_error {
                    // The pool's backend errors are its failures to open a connection: no
                    // server (yet) takes writes, e.g. a standby not promoted yet ("database
                    // does not allow writes", no SQLSTATE), a refused or reset connection.
                    deadpool_postgres::PoolError::Backend(_)
                    | deadpool_postgres::PoolError::Timeout(_) => true,
                    _ => false,
                })
    })
}

/// The SQLSTATEs of a server that is not there to answer, rather than of a statement it refused:
/// connection exceptions (class 08), an administrator's or a crash's shutdown, a server still
/// starting (57P01-57P03), a read-only transaction on a server that is (still or newly) a
/// standby (25006), and a server out of a resource (class 53 but its configured limits: no
/// connection slot left, a full disk, no memory; the server may crash and recover from those).
/// The event store retries an append on them; the HTTP edge answers them 503.
pub fn sql_state_unavailable(state: &tokio_postgres::error::SqlState) -> bool {
    use tokio_postgres::error::SqlState;
    state.code().starts_with("08")
        || [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::READ_ONLY_SQL_TRANSACTION,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::INSUFFICIENT_RESOURCES,
            SqlState::DISK_FULL,
            SqlState::OUT_OF_MEMORY,
        ]
        .contains(state)
}
