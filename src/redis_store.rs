//! The Redis connection shared by the whole process, and its key namespace.
//!
//! One multiplexed [`ConnectionManager`] carries every command (concurrent commands are pipelined on
//! one socket, and it reconnects by itself). It is opened on first use rather than at start, so
//! `serve` starts, and `/ready` answers 503 naming Redis, while Redis is down.
//!
//! Every key goes through [`RedisStore::key`], which prepends the configured prefix: several
//! deployments, and every integration test, share one Redis without seeing each other's keys.

use std::time::Duration;

use anyhow::Context;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use secrecy::ExposeSecret;
use tokio::sync::OnceCell;

use crate::configuration::RedisSettings;

/// A revocation that fewer replicas than `redis.revocation_replicas` acknowledged in time: not
/// done as far as a failover is concerned (answered 503 `redis-replicas`; trying again is safe).
#[derive(Debug, thiserror::Error)]
#[error(
    "only {acknowledged} of {wanted} Redis replicas acknowledged the revocation within {wait_ms} ms"
)]
pub struct ReplicasBehind {
    pub acknowledged: u32,
    pub wanted: u32,
    pub wait_ms: u64,
}

#[derive(Clone)]
pub struct RedisStore {
    client: redis::Client,
    connection: std::sync::Arc<OnceCell<ConnectionManager>>,
    key_prefix: String,
    connect_timeout: Duration,
    response_timeout: Duration,
    revocation_replicas: u32,
    revocation_wait: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The client holds the URL, which may carry a password: never print it.
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.key_prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    pub fn new(settings: &RedisSettings) -> anyhow::Result<RedisStore> {
        let client = redis::Client::open(settings.url.expose_secret())
            .context("redis.url is not a valid Redis URL")?;
        Ok(RedisStore {
            client,
            connection: std::sync::Arc::new(OnceCell::new()),
            key_prefix: settings.key_prefix.clone(),
            connect_timeout: Duration::from_millis(settings.connect_timeout_ms),
            response_timeout: Duration::from_millis(settings.response_timeout_ms),
            revocation_replicas: settings.revocation_replicas,
            revocation_wait: Duration::from_millis(settings.revocation_wait_ms),
        })
    }

    /// `<prefix>:<suffix>`, the only way keys are named.
    pub fn key(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.key_prefix)
    }

    /// The client, for connections that cannot be shared (pub/sub).
    pub fn client(&self) -> &redis::Client {
        &self.client
    }

    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// The shared connection, opened on first use. A failed open is not cached: the next call
    /// tries again.
    pub async fn connection(&self) -> anyhow::Result<ConnectionManager> {
        let manager = self
            .connection
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.response_timeout))
                    .set_number_of_retries(1);
                ConnectionManager::new_with_config(self.client.clone(), config)
                    .await
                    .context("connecting to Redis")
            })
            .await?;
        Ok(manager.clone())
    }

    /// After a revocation written on `connection`: wait until `redis.revocation_replicas`
    /// replicas hold it (`WAIT`, which covers every write sent earlier on this connection), or
    /// fail. Replication is asynchronous: without this, a replica promoted after its master died
    /// could lack the revocation, and what was revoked would be valid again.
    pub async fn revocation_replicated(
        &self,
        connection: &mut ConnectionManager,
    ) -> anyhow::Result<()> {
        if self.revocation_replicas == 0 {
            return Ok(());
        }
        let wait_ms = u64::try_from(self.revocation_wait.as_millis()).unwrap_or(u64::MAX);
        let acknowledged: u32 = redis::cmd("WAIT")
            .arg(self.revocation_replicas)
            .arg(wait_ms)
            .query_async(connection)
            .await
            .context("waiting for Redis replicas")?;
        if acknowledged < self.revocation_replicas {
            return Err(ReplicasBehind {
                acknowledged,
                wanted: self.revocation_replicas,
                wait_ms,
            }
            .into());
        }
        Ok(())
    }

    /// Liveness of Redis for `/ready`.
    pub async fn ping(&self) -> anyhow::Result<()> {
        let mut connection = self.connection().await?;
        let answer: String = redis::cmd("PING")
            .query_async(&mut connection)
            .await
            .context("sending PING")?;
        anyhow::ensure!(answer == "PONG", "PING answered {answer:?}");
        Ok(())
    }
}
