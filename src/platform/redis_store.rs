//! The Redis connection shared by the whole process, and its key namespace.
//!
//! One Redis (`redis.url`, with or without replicas) or a Redis Cluster (`redis.cluster_nodes`,
//! a few seed nodes). Either way one multiplexed [`RedisConnection`] carries every command
//! (concurrent commands are pipelined; it reconnects by itself, and in a cluster follows the
//! slots as they move and as replicas are promoted). It is opened on first use rather than at
//! start, so `serve` starts, and `/ready` answers 503 naming Redis, while Redis is down.
//!
//! A cluster connection whose map of slots is stale is opened again (see [`ClusterLink`]): the
//! client library follows MOVED, but a node removed from the cluster keeps running and answers
//! CLUSTERDOWN for every slot it used to hold, which the library retries on that same node.
//!
//! Every key goes through [`RedisStore::key`] or [`RedisStore::tagged`], which prepend the
//! configured prefix (several deployments, and every integration test, share one Redis without
//! seeing each other's keys) and give the key its hash tag: in a cluster a script, a pipeline or
//! a multi-key command may only touch keys of one slot, so keys used together share a tag, and
//! everything else spreads over the nodes by its own. ARCHITECTURE.md lists the key families.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use secrecy::ExposeSecret;

use crate::platform::configuration::RedisSettings;

/// A connection to one Redis or to a cluster; every command of zhihui goes through one.
#[derive(Clone)]
pub enum RedisConnection {
    /// The shared connection to one Redis (reconnects by itself).
    Node(ConnectionManager),
    /// A connection of its own to one Redis, for blocking reads (no response timeout).
    Dedicated(MultiplexedConnection),
    /// A cluster: commands go to the node that holds their slot.
    Cluster(ClusterLink),
}

/// A cluster connection, and what its answers told of its map of slots. An answer that only a
/// stale map explains (CLUSTERDOWN, MOVED or ASK left after the library's own redirects and
/// retries, a node no longer in the map, a node that does not answer) marks it stale; the
/// store then opens a new connection, which reads the map afresh from the seed nodes, at most
/// once per [`REOPEN_INTERVAL`], keeping the old one while the new one cannot open. A
/// connection is also opened again after [`CLUSTER_MAP_MAX_AGE`] whatever it answered.
#[derive(Clone)]
pub struct ClusterLink {
    connection: ClusterConnection,
    health: Arc<LinkHealth>,
}

impl std::fmt::Debug for ClusterLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterLink")
            .field("stale", &self.is_stale())
            .field("age", &self.health.opened.elapsed())
            .finish_non_exhaustive()
    }
}

struct LinkHealth {
    opened: Instant,
    stale: AtomicBool,
    /// Milliseconds after `opened` of the last attempt to open a successor.
    last_reopen_ms: AtomicU64,
}

/// The least time between two attempts to open a stale cluster connection again.
pub const REOPEN_INTERVAL: Duration = Duration::from_secs(1);
/// A cluster connection older than this is opened again: a slot that moved back to a node
/// this process never asked meanwhile would otherwise stay mapped to where it went.
pub const CLUSTER_MAP_MAX_AGE: Duration = Duration::from_secs(60);

impl ClusterLink {
    fn new(connection: ClusterConnection) -> ClusterLink {
        ClusterLink {
            connection,
            health: Arc::new(LinkHealth {
                opened: Instant::now(),
                stale: AtomicBool::new(false),
                last_reopen_ms: AtomicU64::new(0),
            }),
        }
    }

    fn note(&self, result: &redis::RedisResult<impl Sized>) {
        if let Err(error) = result
            && map_looks_stale(error)
            && !self.health.stale.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(error = %error, "the Redis Cluster's map of slots looks stale: opening the connection again");
        }
    }

    /// Whether to try opening a successor now (and, if so, the attempt is counted).
    fn claim_reopen(&self) -> bool {
        let age = self.health.opened.elapsed();
        if !self.health.stale.load(Ordering::Relaxed) && age < CLUSTER_MAP_MAX_AGE {
            return false;
        }
        let now_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX).max(1);
        let last = self.health.last_reopen_ms.load(Ordering::Relaxed);
        let interval = u64::try_from(REOPEN_INTERVAL.as_millis()).unwrap_or(u64::MAX);
        (last == 0 || now_ms.saturating_sub(last) >= interval)
            && self
                .health
                .last_reopen_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Whether this connection's map was found stale (for tests and metrics).
    pub fn is_stale(&self) -> bool {
        self.health.stale.load(Ordering::Relaxed)
    }
}

/// The connection failed, timed out or was refused, rather than Redis answering.
pub fn connection_failed(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
}

/// Errors that only a stale map of slots explains, or that a new map may cure.
fn map_looks_stale(error: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    if connection_failed(error) {
        return true;
    }
    match error.kind() {
        ErrorKind::Server(
            ServerErrorKind::ClusterDown
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask
            | ServerErrorKind::MasterDown,
        ) => true,
        ErrorKind::ClusterConnectionNotFound | ErrorKind::Io => true,
        _ => error.clone().into_server_errors().is_some_and(|errors| {
            errors.iter().any(|(_, error)| {
                matches!(
                    error.kind(),
                    Some(
                        ServerErrorKind::ClusterDown
                            | ServerErrorKind::Moved
                            | ServerErrorKind::Ask
                    )
                )
            })
        }),
    }
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
            RedisConnection::Cluster(link) => {
                let link = link.clone();
                Box::pin(async move {
                    let mut connection = link.connection.clone();
                    let result = connection.req_packed_command(cmd).await;
                    link.note(&result);
                    result
                })
            }
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
            RedisConnection::Cluster(link) => {
                let link = link.clone();
                Box::pin(async move {
                    let mut connection = link.connection.clone();
                    let result = connection
                        .req_packed_commands(pipeline, offset, count)
                        .await;
                    link.note(&result);
                    result
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Node(connection) => connection.get_db(),
            RedisConnection::Dedicated(connection) => connection.get_db(),
            RedisConnection::Cluster(link) => link.connection.get_db(),
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

/// The process's shared connection: opened on first use, opened again when stale.
#[derive(Default)]
struct Shared {
    current: std::sync::RwLock<Option<RedisConnection>>,
    opening: tokio::sync::Mutex<()>,
}

impl Shared {
    fn current(&self) -> Option<RedisConnection> {
        self.current.read().ok().and_then(|current| current.clone())
    }
}

impl RedisConnection {
    /// A stale (or old) cluster connection whose turn to be opened again has come; the call
    /// claims the turn.
    fn wants_reopen(&self) -> bool {
        match self {
            RedisConnection::Cluster(link) => link.claim_reopen(),
            _ => false,
        }
    }

    /// Whether another caller already claimed this connection's reopening (it is being
    /// replaced: wait for the successor rather than use it).
    fn is_claimed_for_reopen(&self) -> bool {
        match self {
            RedisConnection::Cluster(link) => {
                let stale_or_old =
                    link.is_stale() || link.health.opened.elapsed() >= CLUSTER_MAP_MAX_AGE;
                stale_or_old && link.health.last_reopen_ms.load(Ordering::Relaxed) != 0
            }
            _ => false,
        }
    }
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
    shared: Arc<Shared>,
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
            shared: Arc::new(Shared::default()),
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
        if let Some(current) = self.shared.current()
            && !current.wants_reopen()
        {
            return Ok(current);
        }
        // One opening at a time; whoever waited here finds the new one.
        let _opening = self.shared.opening.lock().await;
        let current = self.shared.current();
        if let Some(current) = &current
            && !current.is_claimed_for_reopen()
        {
            return Ok(current.clone());
        }
        let opened = self.reopen(current).await?;
        if let Ok(mut slot) = self.shared.current.write() {
            *slot = Some(opened.clone());
        }
        Ok(opened)
    }

    /// `step` on the shared connection; when its error is one a stale map of the cluster's slots
    /// explains, once more on the connection opened again in its place (a node removed from
    /// the cluster would otherwise fail the step until a later call). Only for steps that are
    /// safe to repeat.
    pub async fn repeatable<T, F, Fut>(&self, mut step: F) -> anyhow::Result<T>
    where
        F: FnMut(RedisConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let connection = self.connection().await?;
        let cluster = matches!(connection, RedisConnection::Cluster(_));
        match step(connection).await {
            Err(error) if cluster && map_looks_stale(&error) => {
                let connection = self.connection().await?;
                Ok(step(connection).await?)
            }
            other => Ok(other?),
        }
    }

    /// A new connection in place of `current` (none yet, or a stale cluster connection); when
    /// it cannot be opened, the stale one serves on (it may still reach most slots).
    async fn reopen(&self, current: Option<RedisConnection>) -> anyhow::Result<RedisConnection> {
        match (self.open().await, current) {
            (Ok(opened), Some(_)) => {
                tracing::info!("opened the Redis Cluster connection again");
                Ok(opened)
            }
            (Ok(opened), None) => Ok(opened),
            (Err(error), Some(current)) => {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "could not open the Redis Cluster connection again; the old one serves on");
                Ok(current)
            }
            (Err(error), None) => Err(error),
        }
    }

    /// This worker's twin of the shared connection.
    async fn worker_connection(&self) -> anyhow::Result<RedisConnection> {
        let mine = |twins: &Vec<(std::sync::Weak<Target>, RedisConnection)>| {
            twins
                .iter()
                .find(|(target, _)| std::ptr::eq(target.as_ptr(), &*self.target))
                .map(|(_, connection)| connection.clone())
        };
        let current = TWINS.with(|twins| mine(&twins.borrow()));
        if let Some(connection) = &current
            && !connection.wants_reopen()
        {
            return Ok(connection.clone());
        }
        let replacing = current.is_some();
        let opened = self.reopen(current).await?;
        Ok(TWINS.with(|twins| {
            let mut twins = twins.borrow_mut();
            // Twins of stores gone are dropped; two requests that opened one at once keep the
            // first (a stale one is replaced by its successor).
            twins.retain(|(target, _)| {
                target.strong_count() > 0
                    && !(replacing && std::ptr::eq(target.as_ptr(), &*self.target))
            });
            mine(&twins).unwrap_or_else(|| {
                twins.push((Arc::downgrade(&self.target), opened.clone()));
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
                .map(|connection| RedisConnection::Cluster(ClusterLink::new(connection)))
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
                .map(|connection| RedisConnection::Cluster(ClusterLink::new(connection)))
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
                        // A timeout is as much "Redis away" as a refused connection: typed as
                        // Redis's own I/O error, it is answered 503.
                        Err(_) => {
                            last = Some(anyhow::Error::new(redis::RedisError::from(
                                std::io::Error::new(
                                    std::io::ErrorKind::TimedOut,
                                    format!("no answer within {:?}", self.connect_timeout),
                                ),
                            )))
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
            RedisConnection::Cluster(link) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = Route::with_key(key, SlotAddr::Master);
                let value = link
                    .connection
                    .clone()
                    .route_command(
                        command,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await;
                link.note(&value);
                Ok(redis::from_redis_value(value?)?)
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

    /// The replication ids of every master (one Redis: its own), sorted and joined: another
    /// answer means a master restarted, a replica took a master's place, or masters came or
    /// went, after any of which Redis may lack writes it had acknowledged while looking
    /// complete.
    pub async fn masters_identity(&self) -> anyhow::Result<String> {
        let mut info = redis::cmd("INFO");
        info.arg("replication");
        let mut connection = self.connection().await?;
        let texts: Vec<String> = match &mut connection {
            RedisConnection::Cluster(link) => {
                use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
                let answers = link
                    .connection
                    .clone()
                    .route_command(
                        info,
                        RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
                    )
                    .await;
                link.note(&answers);
                let Value::Map(answers) = answers.context("reading INFO replication")? else {
                    anyhow::bail!("INFO replication on every master answered other than a map");
                };
                answers
                    .into_iter()
                    .map(|(_, answer)| {
                        redis::from_redis_value::<String>(answer)
                            .context("reading INFO replication of a master")
                    })
                    .collect::<anyhow::Result<_>>()?
            }
            other => vec![
                info.query_async(other)
                    .await
                    .context("reading INFO replication")?,
            ],
        };
        let mut ids = texts
            .iter()
            .map(|text| {
                text.lines()
                    .find_map(|line| line.strip_prefix("master_replid:"))
                    .map(|id| id.trim().to_owned())
                    .context("INFO replication has no master_replid")
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        ids.sort();
        Ok(ids.join(","))
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
