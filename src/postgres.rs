//! The PostgreSQL connection pool and the schema migrations.
//!
//! Migrations are the SQL files in `migrations/` (named `V<n>__<what>.sql`), embedded into the
//! binary at build time by refinery. refinery records each applied file with a checksum and aborts
//! when an applied file has changed (`abort_divergent`), so history cannot silently drift. Several
//! instances may start at once: a session-level advisory lock makes them migrate one after another.

use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Timeouts};
use tokio_postgres::NoTls;

use crate::configuration::DatabaseSettings;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory lock key held while migrating (an arbitrary constant: "zhihui" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x7a68_6968_7569;

/// Build the pool. No connection is opened here: the first use opens one, so `serve` can start
/// (and `/ready` can report) while PostgreSQL is still down.
pub fn build_pool(settings: &DatabaseSettings) -> anyhow::Result<Pool> {
    let manager = Manager::from_config(
        settings.pg_config()?,
        NoTls,
        ManagerConfig {
            // Verified (one empty round trip per checkout) rather than Fast: a connection whose
            // backend was terminated may not look closed yet when it returns to the pool, and
            // handing it out again would fail the next request for nothing.
            recycling_method: RecyclingMethod::Verified,
        },
    );
    let timeouts = Timeouts {
        wait: Some(Duration::from_millis(settings.pool_wait_timeout_ms)),
        create: Some(Duration::from_millis(settings.connect_timeout_ms)),
        recycle: Some(Duration::from_millis(settings.connect_timeout_ms)),
    };
    Pool::builder(manager)
        .max_size(settings.pool_max_size)
        .timeouts(timeouts)
        .runtime(Runtime::Tokio1)
        .build()
        .context("building the PostgreSQL pool")
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
