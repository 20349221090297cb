//! The Redis connection shared by the whole process, and its key namespace.
//!
//! One Redis (`redis.url`, with or without replicas) or a Redis Cluster (`redis.cluster_nodes`,
//! a few seed nodes). Either way one multiplexed [`RedisConnection`] carries every command
//! (concurrent commands are pipelined; it reconnects by itself, and in a cluster follows the
//! slots as they move and as replicas are promoted). It is opened on first use rather than at
//! start, so `serve` starts, and `/ready` answers 503 naming Redis, while Redis is down.
//!
//! Every key goes through [`RedisStore::key`] or [`RedisStore::tagged`], which prepend the
//! configured prefix (several deployments, and every integration test, share one Redis without
//! seeing each other's keys) and give the key its hash tag: in a cluster a script, a pipeline or
//! a multi-key command may only touch keys of one slot, so keys used together share a tag, and
//! everything else spreads over the nodes by its own. ARCHITECTURE.md lists the key families.

use std::time::Duration;

use anyhow::Context;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use secrecy::ExposeSecret;
use tokio::sync::OnceCell;

use crate::platform::configuration::RedisSettings;

/// A connection to one Redis or to a cluster; every command of zhihui goes through one.
#[derive(Clone)]
pub enum RedisConnection {
    /// The shared connection to one Redis (reconnects by itself).
    Node(ConnectionManager),
    /// A connection of its own to one Redis, for blocking reads (no response timeout).
    Dedicated(MultiplexedConnection),
    /// A cluster: commands go to the node that holds their slot.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConnection::Node(_) => "RedisConnection::Node",
            RedisConnection::Dedicated(_) => "RedisConnection::Dedicated",
            RedisConnection::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Node(connection) => connection.req_packed_command(cmd),
            RedisConnection::Dedicated(connection) => connection.req_packed_command(cmd),
            RedisConnection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Node(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            RedisConnection::Dedicated(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            RedisConnection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Node(connection) => connection.get_db(),
            RedisConnection::Dedicated(connection) => connection.get_db(),
            RedisConnection::Cluster(connection) => connection.get_db(),
        }
    }
}

/// Where Redis is (behind an `Arc`: the cluster's clients are large, the store is cloned often).
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
enum Target {
    Node(redis::Client),
    Cluster {
        /// The shared connection's client (with the response timeout).
        client: ClusterClient,
        /// Blocking reads' client: no response timeout (each read bounds its own wait).
        blocking: ClusterClient,
        /// The seed nodes one by one, for pub/sub: a message published on any node of a
        /// cluster reaches the subscribers of every node.
        seeds: Vec<redis::Client>,
    },
}

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

thread_local! {
    /// This HTTP worker's twins of the shared connections, by store (see
    /// [`RedisStore::connection`]).
    static TWINS: std::cell::RefCell<Vec<(std::sync::Weak<Target>, RedisConnection)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

#[derive(Clone)]
pub struct RedisStore {
    target: std::sync::Arc<Target>,
    connection: std::sync::Arc<OnceCell<RedisConnection>>,
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
        let connect_timeout = Duration::from_millis(settings.connect_timeout_ms);
        let response_timeout = Duration::from_millis(settings.response_timeout_ms);
        let seeds: Vec<&str> = settings
            .cluster_nodes
            .expose_secret()
            .split(',')
            .map(str::trim)
            .filter(|seed| !seed.is_empty())
            .collect();
        let target = if seeds.is_empty() {
            Target::Node(
                redis::Client::open(settings.url.expose_secret())
                    .context("redis.url is not a valid Redis URL")?,
            )
        } else {
            let builder = || {
                ClusterClient::builder(seeds.iter().copied())
                    .connection_timeout(connect_timeout)
                    .retries(3)
            };
            Target::Cluster {
                client: builder()
                    .response_timeout(response_timeout)
                    .build()
                    .context("redis.cluster_nodes is not a list of Redis URLs")?,
                blocking: builder()
                    .build()
                    .context("redis.cluster_nodes is not a list of Redis URLs")?,
                seeds: seeds
                    .iter()
                    .map(|seed| redis::Client::open(*seed))
                    .collect::<Result<_, _>>()
                    .context("redis.cluster_nodes is not a list of Redis URLs")?,
            }
        };
        Ok(RedisStore {
            target: std::sync::Arc::new(target),
            connection: std::sync::Arc::new(OnceCell::new()),
            key_prefix: settings.key_prefix.clone(),
            connect_timeout,
            response_timeout,
            revocation_replicas: settings.revocation_replicas,
            revocation_wait: Duration::from_millis(settings.revocation_wait_ms),
        })
    }

    /// `<prefix>:{<name>}`: a key used alone, whose whole name is its hash tag (so keys of one
    /// family spread over a cluster's nodes).
    pub fn key(&self, name: &str) -> String {
        format!("{}:{{{name}}}", self.key_prefix)
    }

    /// `<prefix>:{<tag>}:<rest>`: keys that a script, a pipeline or a multi-key command uses
    /// together share their tag, and so their slot.
    pub fn tagged(&self, tag: &str, rest: &str) -> String {
        format!("{}:{{{tag}}}:{rest}", self.key_prefix)
    }

    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// The shared connection, opened on first use; on an HTTP worker's thread, the worker's own
    /// twin of it, opened there so its I/O runs on the thread the request runs on (see
    /// [`crate::platform::worker_local`]). A failed open is not cached: the next call tries again.
    pub async fn connection(&self) -> anyhow::Result<RedisConnection> {
        if crate::platform::worker_local::on_http_worker() {
            return self.worker_connection().await;
        }
        let connection = self.connection.get_or_try_init(|| self.open()).await?;
        Ok(connection.clone())
    }

    /// This worker's twin of the shared connection.
    async fn worker_connection(&self) -> anyhow::Result<RedisConnection> {
        let mine = |twins: &Vec<(std::sync::Weak<Target>, RedisConnection)>| {
            twins
                .iter()
                .find(|(target, _)| std::ptr::eq(target.as_ptr(), &*self.target))
                .map(|(_, connection)| connection.clone())
        };
        if let Some(connection) = TWINS.with(|twins| mine(&twins.borrow())) {
            return Ok(connection);
        }
        let opened = self.open().await?;
        Ok(TWINS.with(|twins| {
            let mut twins = twins.borrow_mut();
            // Twins of stores gone are dropped; two requests that opened one at once keep the
            // first.
            twins.retain(|(target, _)| target.strong_count() > 0);
            mine(&twins).unwrap_or_else(|| {
                twins.push((std::sync::Arc::downgrade(&self.target), opened.clone()));
                opened
            })
        }))
    }

    async fn open(&self) -> anyhow::Result<RedisConnection> {
        match &*self.target {
            Target::Node(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.response_timeout))
                    .set_number_of_retries(1);
                ConnectionManager::new_with_config(client.clone(), config)
                    .await
                    .map(RedisConnection::Node)
                    .context("connecting to Redis")
            }
            Target::Cluster { client, .. } => client
                .get_async_connection()
                .await
                .map(RedisConnection::Cluster)
                .context("connecting to the Redis Cluster"),
        }
    }

    /// A connection of its own for blocking reads (`XREADGROUP ... BLOCK`): a blocked read
    /// would hold up every command queued behind it on a shared one, and it has no response
    /// timeout (the caller bounds each read by its block time).
    pub async fn blocking_connection(&self) -> anyhow::Result<RedisConnection> {
        match &*self.target {
            Target::Node(client) => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(None);
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(RedisConnection::Dedicated)
                    .context("opening a Redis connection for blocking reads")
            }
            Target::Cluster { blocking, .. } => blocking
                .get_async_connection()
                .await
                .map(RedisConnection::Cluster)
                .context("opening a Redis Cluster connection for blocking reads"),
        }
    }

    /// A pub/sub connection. In a cluster, on the first seed node that answers: a message
    /// published on any node reaches the subscribers of all of them.
    pub async fn pubsub(&self) -> anyhow::Result<redis::aio::PubSub> {
        match &*self.target {
            Target::Node(client) => client
                .get_async_pubsub()
                .await
                .context("opening a Redis pub/sub connection"),
            Target::Cluster { seeds, .. } => {
                let mut last = None;
                for seed in seeds {
                    match tokio::time::timeout(self.connect_timeout, seed.get_async_pubsub()).await
                    {
                        Ok(Ok(pubsub)) => return Ok(pubsub),
                        Ok(Err(error)) => last = Some(anyhow::Error::new(error)),
                        Err(_) => {
                            last = Some(anyhow::anyhow!(
                                "no answer within {:?}",
                                self.connect_timeout
                            ))
                        }
                    }
                }
                Err(last
                    .unwrap_or_else(|| anyhow::anyhow!("no seed node"))
                    .context("opening a Redis pub/sub connection on any seed node"))
            }
        }
    }

    /// After a revocation written on `connection`: wait until `redis.revocation_replicas`
    /// replicas hold it (`WAIT`, which covers every write sent earlier on this connection), or
    /// fail. Replication is asynchronous: without this, a replica promoted after its master died
    /// could lack the revocation, and what was revoked would be valid again.
    pub async fn revocation_replicated(
        &self,
        connection: &mut RedisConnection,
    ) -> anyhow::Result<()> {
        if self.revocation_replicas == 0 {
            return Ok(());
        }
        let wait_ms = u64::try_from(self.revocation_wait.as_millis()).unwrap_or(u64::MAX);
        // In a cluster the client sends WAIT to every primary and answers the least count: the
        // primaries this connection wrote nothing to answer at once with their replicas.
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

    /// `command` on the Redis that holds `key` (its slot's master in a cluster), for what is
    /// per node (`INFO`, `CLIENT LIST`): on a cluster the client would send a keyless command to
    /// every node, or to any.
    pub async fn query_on_node_of<T: redis::FromRedisValue>(
        &self,
        key: &str,
        command: redis::Cmd,
    ) -> anyhow::Result<T> {
        let mut connection = self.connection().await?;
        match &mut connection {
            RedisConnection::Cluster(cluster) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = Route::with_key(key, SlotAddr::Master);
                let value = cluster
                    .route_command(
                        command,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await?;
                Ok(redis::from_redis_value(value)?)
            }
            other => Ok(command.query_async(other).await?),
        }
    }

    /// The replication id of the Redis that holds `key` (its slot's master in a cluster): it
    /// changes when a replica is promoted in its master's place, or when a Redis restarts, the
    /// two events after which Redis may lack its last writes while looking complete.
    pub async fn replication_id(&self, key: &str) -> anyhow::Result<String> {
        let mut info = redis::cmd("INFO");
        info.arg("replication");
        let text: String = self
            .query_on_node_of(key, info)
            .await
            .context("reading INFO replication")?;
        text.lines()
            .find_map(|line| line.strip_prefix("master_replid:"))
            .map(|id| id.trim().to_owned())
            .context("INFO replication has no master_replid")
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

/// The hash tag of one user's keys (sessions, check-ins, redemption failures).
pub fn user_tag(user_id: zhihui_domain::user::UserId) -> String {
    format!("u:{user_id}")
}
