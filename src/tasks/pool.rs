//! The pool of ComfyUI servers at run time: what an admin changes (add, drain, resume, remove),
//! what every process reads (the `backend-pool` stream, [`BackendPool`]), and what the leader
//! sees of each server (published to Redis for `GET /admin/backends`).
//!
//! The stream is the truth: every process folds it, the leader follows it (a pool event wakes
//! it), and a new leader starts from it. The configuration's `dispatch.backends` seed it once,
//! when the stream is still empty.
//!
//! A submit for a model no server offers is refused ([`PoolService::may_run`]). The pool is
//! cached per process to keep that check off the store, but a cache may only speed up an
//! acceptance: a refusal is decided on the stream's latest version.
//!
//! Live state (socket up, prompts in flight, last error, model switches) is the leader's: it
//! publishes it to one Redis hash about once a second ([`STATUS_KEY`]); a reading older than
//! [`STATUS_STALE_MS`] says "unknown", never a guess.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use zhihui_domain::pool::{
    BackendPool, NewBackend, POOL_STREAM, PoolBackend, PoolCommand, PoolDifference, PoolError,
    PoolState,
};

use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError, RetryPolicy};
use crate::platform::configuration::BackendSettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata};
use crate::platform::lua::redis_script;
use crate::platform::redis_store::RedisStore;
use crate::tasks::queue::lease::Leases;
use crate::tasks::queue::{HELD_KEY, HELD_VERSION_KEY};

redis_script!(POOL_STATUS, "pool_status.lua");

/// The leader's view of each server (hash: name -> JSON [`BackendStatus`]).
pub const STATUS_KEY: &str = "dispatch:backends";
/// A pool read longer ago than this no longer accepts a model by itself: a server inspected or
/// removed since (by another process) may have taken the model away. Bounds how long a process
/// accepts tasks for a model nobody offers any more (they would wait in the queue).
const POOL_CACHE_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(5);
pub use crate::platform::configuration::STATUS_STALE_MS;

/// Queued tasks estimated per read, at most: the estimate replays the queue from its head, so a
/// task further back gets none (its place still shows).
pub const ESTIMATE_QUEUE_MAX: usize = 1_000;
/// How long a read of the queue's head serves estimates (see [`PoolService::queue_head`]).
pub const QUEUE_HEAD_MAX_AGE: std::time::Duration = std::time::Duration::from_millis(250);
/// Steps assumed for a queued task whose steps are not beside it in Redis (queued before they
/// were kept there): the catalog's default.
const STEPS_UNKNOWN: u32 = 20;

/// When a queued task should start and end, or why there is no telling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitEstimate {
    At {
        start: DateTime<Utc>,
        end: DateTime<Utc>,
    },
    /// No server is in service at all.
    NoServer,
    /// No server in service offers its model.
    NoServerFor { model: String },
}

impl WaitEstimate {
    /// Why there is no telling, as a code a page words in its reader's language.
    pub fn unknown_reason(&self) -> Option<&'static str> {
        match self {
            WaitEstimate::At { .. } => None,
            WaitEstimate::NoServer => Some("no_server"),
            WaitEstimate::NoServerFor { .. } => Some("no_server_for_model"),
        }
    }

    /// Why there is no telling, in a sentence (the API's `estimate_note`).
    pub fn unknown_note(&self) -> Option<String> {
        match self {
            WaitEstimate::At { .. } => None,
            WaitEstimate::NoServer => Some("no image server is in service now".into()),
            WaitEstimate::NoServerFor { model } => Some(format!(
                "no image server in service offers model {model} now; it waits for one"
            )),
        }
    }
}

/// What the leader sees of one server, as it publishes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    pub name: String,
    /// Its socket is open.
    pub up: bool,
    /// Draining, as the leader follows the pool.
    #[serde(default)]
    pub draining: bool,
    pub prompts_in_flight: u32,
    pub staged: u32,
    pub last_model: Option<String>,
    /// How often the model of the next prompt posted there differed from the one before.
    pub model_switches: u64,
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    /// Measured seconds per step by model (the capped mean of the last runs that found it loaded).
    #[serde(default)]
    pub seconds_per_step: std::collections::BTreeMap<String, f64>,
    /// Seconds from `published_at` until each slot is free for a queued task.
    #[serde(default)]
    pub slots_free_in: Vec<f64>,
    /// Measured seconds a run spends loading its model after a run of another, by model.
    #[serde(default)]
    pub load_seconds: std::collections::BTreeMap<String, f64>,
    pub published_at: DateTime<Utc>,
}

/// One server as `GET /admin/backends` and `zhihui backends list` show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendView {
    pub backend: PoolBackend,
    /// `up`, `down`, `draining` (prompts still in flight), `drained` (draining, idle),
    /// `resuming` (resumed; the leader has not followed yet) or `unknown` (no leader has
    /// reported recently).
    pub state: &'static str,
    pub status: Option<BackendStatus>,
    pub tasks_succeeded: i64,
    pub tasks_failed: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum PoolServiceError {
    #[error(transparent)]
    Rejected(PoolError),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

impl From<CommandError<PoolError>> for PoolServiceError {
    fn from(error: CommandError<PoolError>) -> PoolServiceError {
        match error {
            CommandError::Rejected(rejected) => PoolServiceError::Rejected(rejected),
            other => PoolServiceError::Unexpected(other.into_anyhow("a command on the pool")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct PoolService {
    store: AnyEventStore,
    redis: RedisStore,
    database: Pool,
    leases: Leases,
    clock: Clock,
    /// The pool as last read here, and when: accepts a model quickly (while younger than
    /// [`POOL_CACHE_MAX_AGE`]); never refuses one.
    cached: Arc<Mutex<Option<(PoolState, std::time::Instant)>>>,
    /// The queue's head as last read for estimates ([`PoolService::queue_head`]).
    head: Arc<tokio::sync::Mutex<Option<QueueHead>>>,
}

/// A read of the queue's first [`ESTIMATE_QUEUE_MAX`] tasks, with their model and steps.
#[derive(Debug)]
struct QueueHead {
    taken: std::time::Instant,
    tasks: Vec<(uuid::Uuid, Option<String>, Option<u32>)>,
    index: HashMap<uuid::Uuid, usize>,
}

impl PoolService {
    pub fn new(
        store: AnyEventStore,
        redis: RedisStore,
        database: Pool,
        leases: Leases,
        clock: Clock,
    ) -> PoolService {
        PoolService {
            store,
            redis,
            database,
            leases,
            clock,
            cached: Arc::new(Mutex::new(None)),
            head: Arc::new(tokio::sync::Mutex::new(None)),
        }
    }

    /// The pool on the stream's latest version.
    pub async fn load(&self) -> anyhow::Result<PoolState> {
        let state = command::load::<BackendPool>(&self.store, POOL_STREAM)
            .await?
            .state;
        self.remember(&state);
        Ok(state)
    }

    fn remember(&self, state: &PoolState) {
        if let Ok(mut cached) = self.cached.lock() {
            *cached = Some((state.clone(), std::time::Instant::now()));
        }
    }

    async fn execute(
        &self,
        command: PoolCommand,
        actor: &str,
    ) -> Result<PoolState, PoolServiceError> {
        let metadata = EventMetadata {
            correlation_id: uuid::Uuid::now_v7(),
            causation_id: None,
            actor: actor.to_owned(),
        };
        let executed = command::execute::<BackendPool>(
            &self.store,
            POOL_STREAM,
            &command,
            &metadata,
            RetryPolicy::default(),
        )
        .await?;
        self.remember(&executed.state);
        Ok(executed.state)
    }

    /// Record the configured servers if the pool has never been recorded (first start); a pool
    /// already recorded is left as the admins made it.
    pub async fn seed(&self, configured: &[BackendSettings]) -> anyhow::Result<PoolState> {
        let backends = parse_configured(configured)?;
        let command = PoolCommand::Seed {
            backends,
            at: self.clock.now(),
        };
        self.execute(command, "system:configuration")
            .await
            .map_err(|error| anyhow::anyhow!("seeding the pool: {error}"))
    }

    pub async fn add(
        &self,
        backend: NewBackend,
        actor: &str,
    ) -> Result<PoolState, PoolServiceError> {
        let at = self.clock.now();
        self.execute(PoolCommand::Add { backend, at }, actor).await
    }

    /// Drain a server: recorded, then held in Redis so the filler claims nothing more for it
    /// from now on (a task claimed for it before stays: at most `staged_per_backend` more).
    pub async fn drain(&self, name: &str, actor: &str) -> Result<PoolState, PoolServiceError> {
        let command = PoolCommand::Drain {
            name: name.to_owned(),
            at: self.clock.now(),
        };
        let state = self.execute(command, actor).await?;
        self.hold(&state).await?;
        Ok(state)
    }

    pub async fn resume(&self, name: &str, actor: &str) -> Result<PoolState, PoolServiceError> {
        let command = PoolCommand::Resume {
            name: name.to_owned(),
            at: self.clock.now(),
        };
        let state = self.execute(command, actor).await?;
        self.hold(&state).await?;
        Ok(state)
    }

    /// Rewrite the held servers from `state`: its draining servers (unless a later version of
    /// the pool was written already: a reader that read it before a drain must not undo it).
    pub async fn hold(&self, state: &PoolState) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let mut invocation = crate::tasks::queue::scripts::DISPATCH_HOLD
            .key(self.redis.tagged(crate::tasks::queue::QUEUE_TAG, HELD_KEY));
        invocation
            .key(
                self.redis
                    .tagged(crate::tasks::queue::QUEUE_TAG, HELD_VERSION_KEY),
            )
            .arg(state.events);
        for backend in state.backends.iter().filter(|backend| backend.draining) {
            invocation.arg(&backend.name);
        }
        let _written: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .context("holding drained servers")?;
        Ok(())
    }

    /// Remove a server nothing runs on: its slot leases (prompts posted or staged there, Redis
    /// time) say how many run there now. An idle server is drained first (held in Redis), so
    /// that no task is claimed for it between the answer and the moment the leader follows the
    /// removal; a server found busy is refused and left as it was.
    pub async fn remove(&self, name: &str, actor: &str) -> Result<PoolState, PoolServiceError> {
        let busy = self.leases.busy_slots(name).await?.len();
        if busy == 0 && self.load().await?.backend(name).is_some() {
            self.drain(name, actor).await?;
        }
        // Read again after the hold: a claim may have slipped in before it.
        let in_flight = if busy == 0 {
            self.leases.busy_slots(name).await?.len()
        } else {
            busy
        };
        let command = PoolCommand::Remove {
            name: name.to_owned(),
            prompts_in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
            at: self.clock.now(),
        };
        self.execute(command, actor).await
    }

    /// Give a server another address or capacity, when nothing runs there (its slot leases).
    pub async fn reconfigure(
        &self,
        backend: NewBackend,
        actor: &str,
    ) -> Result<PoolState, PoolServiceError> {
        let in_flight = self.leases.busy_slots(backend.name()).await?.len();
        let command = PoolCommand::Reconfigure {
            backend,
            prompts_in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
            at: self.clock.now(),
        };
        self.execute(command, actor).await
    }

    /// How `configured` differs from the pool on the stream's latest version (nothing when the
    /// pool was never recorded: the first leader seeds it from the configuration).
    pub async fn differences(
        &self,
        configured: &[BackendSettings],
    ) -> anyhow::Result<Vec<PoolDifference>> {
        // Not remembered: a reading for operators must not stand in for the submit's check.
        let state = command::load::<BackendPool>(&self.store, POOL_STREAM)
            .await?
            .state;
        if !state.seeded {
            return Ok(Vec::new());
        }
        Ok(zhihui_domain::pool::differences(
            &state,
            &parse_configured(configured)?,
        ))
    }

    /// Log each difference between the configuration and the pool, with the command that
    /// applies it (at every start: a changed configuration is never taken silently, nor
    /// ignored silently).
    pub async fn warn_of_differences(&self, configured: &[BackendSettings]) -> anyhow::Result<()> {
        let differences = self.differences(configured).await?;
        for difference in &differences {
            tracing::warn!(
                difference = %difference,
                apply = %difference.command(),
                "dispatch.backends differs from the pool, which the backend-pool stream holds: the pool is used"
            );
        }
        if !differences.is_empty() {
            tracing::warn!(
                count = differences.len(),
                "run `zhihui backends apply-config` to make the pool what dispatch.backends says, or change dispatch.backends"
            );
        }
        Ok(())
    }

    /// Make the pool what `configured` says, one recorded change per difference: servers added,
    /// reconfigured, removed. A server that still runs a prompt is neither removed nor
    /// reconfigured (its result says so); one configured away is drained meanwhile, so apply
    /// again once it is idle.
    pub async fn apply_configuration(
        &self,
        configured: &[BackendSettings],
        actor: &str,
    ) -> anyhow::Result<Vec<(PoolDifference, Result<(), PoolServiceError>)>> {
        let mut applied = Vec::new();
        for difference in self.differences(configured).await? {
            let outcome = match &difference {
                PoolDifference::NotInPool(backend) => self.add(backend.clone(), actor).await,
                PoolDifference::NotConfigured { name } => {
                    let removed = self.remove(name, actor).await;
                    if matches!(
                        removed,
                        Err(PoolServiceError::Rejected(PoolError::Busy { .. }))
                    ) {
                        // Configured away: nothing new goes there while its prompts finish.
                        self.drain(name, actor).await?;
                    }
                    removed
                }
                PoolDifference::Differs { configured, .. } => {
                    self.reconfigure(configured.clone(), actor).await
                }
            };
            applied.push((difference, outcome.map(|_| ())));
        }
        Ok(applied)
    }

    /// What a server said it offers, recorded when it says something new.
    pub async fn inspected(
        &self,
        name: &str,
        models: Vec<String>,
        version: String,
    ) -> Result<PoolState, PoolServiceError> {
        let command = PoolCommand::Inspect {
            name: name.to_owned(),
            models,
            version,
            at: self.clock.now(),
        };
        self.execute(command, "system:dispatcher").await
    }

    /// Whether some server of the pool offers `model` (or has not said yet). A "yes" may come
    /// from this process's cache; a "no" only from the stream's latest version.
    pub async fn may_run(&self, model: &str) -> anyhow::Result<bool> {
        let cached = self.cached.lock().ok().and_then(|cached| {
            cached
                .as_ref()
                .filter(|(_, read_at)| read_at.elapsed() < POOL_CACHE_MAX_AGE)
                .map(|(state, _)| state.may_run(model))
        });
        if cached == Some(true) {
            return Ok(true);
        }
        Ok(self.load().await?.may_run(model))
    }

    /// The leader's view of every server, replacing the last one (a removed server drops out).
    pub async fn publish_status(&self, statuses: &[BackendStatus]) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let mut invocation = POOL_STATUS.key(self.redis.key(STATUS_KEY));
        for status in statuses {
            let json = serde_json::to_string(status).context("encoding a backend status")?;
            invocation.arg(&status.name).arg(json);
        }
        let _published: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .context("publishing the servers' status")?;
        Ok(())
    }

    async fn statuses(&self) -> anyhow::Result<HashMap<String, BackendStatus>> {
        let mut connection = self.redis.connection().await?;
        let raw: HashMap<String, String> = connection
            .hgetall(self.redis.key(STATUS_KEY))
            .await
            .context("reading the servers' status")?;
        let mut statuses = HashMap::new();
        for (name, json) in raw {
            // A status this version cannot read is shown as unknown, not as an error.
            if let Ok(status) = serde_json::from_str::<BackendStatus>(&json) {
                statuses.insert(name, status);
            }
        }
        Ok(statuses)
    }

    /// The pool as this process last read it (read now if never, or too long ago).
    async fn current(&self) -> anyhow::Result<PoolState> {
        let cached = self.cached.lock().ok().and_then(|cached| {
            cached
                .as_ref()
                .filter(|(_, read_at)| read_at.elapsed() < POOL_CACHE_MAX_AGE)
                .map(|(state, _)| state.clone())
        });
        match cached {
            Some(state) => Ok(state),
            None => self.load().await,
        }
    }

    /// The queue's head for estimates, as far as `wanted` reaches into it: the last read if it
    /// is younger than [`QUEUE_HEAD_MAX_AGE`] and holds every wanted task, else a new read.
    /// One read at a time: requests that arrive during a read wait for it and share it, so
    /// reading the head (up to [`ESTIMATE_QUEUE_MAX`] tasks) costs a process a few reads a
    /// second under any load, instead of one per request. An estimate may so be made from a
    /// head up to that age (a task ahead just dispatched or moved): estimates are a forecast;
    /// positions are read fresh, and the servers' state is read on each call.
    async fn queue_head(
        &self,
        queue: &crate::tasks::queue::TaskQueue,
        wanted: &[uuid::Uuid],
    ) -> anyhow::Result<Vec<(uuid::Uuid, Option<String>, Option<u32>)>> {
        let mut slot = self.head.lock().await;
        let reach = |head: &QueueHead| -> Option<usize> {
            wanted
                .iter()
                .map(|task| head.index.get(task).copied())
                .try_fold(0, |reach, at| at.map(|at| reach.max(at + 1)))
        };
        if let Some(head) = slot.as_ref()
            && head.taken.elapsed() < QUEUE_HEAD_MAX_AGE
            && let Some(reach) = reach(head)
        {
            return Ok(head.tasks[..reach].to_vec());
        }
        let tasks = queue.head(ESTIMATE_QUEUE_MAX).await?;
        let index = tasks
            .iter()
            .enumerate()
            .map(|(at, (task, _, _))| (*task, at))
            .collect();
        let head = QueueHead {
            taken: std::time::Instant::now(),
            tasks,
            index,
        };
        // A wanted task not in a new read has left the queue, or is beyond the estimated head.
        let reach = wanted
            .iter()
            .filter_map(|task| head.index.get(task))
            .map(|at| at + 1)
            .max()
            .unwrap_or(0);
        let answer = head.tasks[..reach].to_vec();
        *slot = Some(head);
        Ok(answer)
    }

    /// Wait estimates for queued tasks, given with their 1-based places: those among the
    /// queue's first [`ESTIMATE_QUEUE_MAX`] get one (a task further back gets none, and is not
    /// looked for in the head): the servers in service as the leader last published them (their
    /// slots' free times, aged since; their measured step times), replayed over the queue's
    /// head by [`crate::tasks::estimate::estimate`].
    pub async fn estimates(
        &self,
        queue: &crate::tasks::queue::TaskQueue,
        places: impl IntoIterator<Item = (uuid::Uuid, u64)>,
    ) -> anyhow::Result<HashMap<uuid::Uuid, WaitEstimate>> {
        use crate::tasks::estimate::{ServerOutlook, Waiting, estimate};

        let wanted: Vec<uuid::Uuid> = places
            .into_iter()
            .filter(|(_, position)| *position <= ESTIMATE_QUEUE_MAX as u64)
            .map(|(task, _)| task)
            .collect();
        if wanted.is_empty() {
            return Ok(HashMap::new());
        }
        let head = self.queue_head(queue, &wanted).await?;
        if head.is_empty() {
            return Ok(HashMap::new());
        }
        let pool = self.current().await?;
        let statuses = self.statuses().await?;
        let now = self.clock.now();
        let outlooks: Vec<ServerOutlook> = pool
            .backends
            .iter()
            .filter(|backend| !backend.draining)
            .filter_map(|backend| {
                let status = statuses.get(&backend.name)?;
                let age_ms = (now - status.published_at).num_milliseconds();
                if age_ms > STATUS_STALE_MS || !status.up || status.draining {
                    return None;
                }
                let age = age_ms.max(0) as f64 / 1_000.0;
                let mut slots: Vec<f64> = status
                    .slots_free_in
                    .iter()
                    .map(|free_in| (free_in - age).max(0.0))
                    .collect();
                if slots.is_empty() {
                    slots = vec![0.0; backend.capacity.max(1) as usize];
                }
                Some(ServerOutlook {
                    name: backend.name.clone(),
                    models: backend.models.clone(),
                    slots_free_in: slots,
                    seconds_per_step: status.seconds_per_step.clone(),
                    loaded_model: status.last_model.clone(),
                    load_seconds: status.load_seconds.clone(),
                })
            })
            .collect();
        let waiting: Vec<Waiting> = head
            .iter()
            .map(|(_, model, steps)| Waiting {
                model: model.clone(),
                steps: steps.unwrap_or(STEPS_UNKNOWN),
            })
            .collect();
        let estimates = estimate(&outlooks, &waiting);
        let seconds = |value: f64| chrono::Duration::milliseconds((value * 1_000.0).round() as i64);
        Ok(head
            .into_iter()
            .zip(estimates)
            .map(|((task_id, model, _), estimated)| {
                let answer = match estimated {
                    Some(at) => WaitEstimate::At {
                        start: now + seconds(at.start_in),
                        end: now + seconds(at.end_in),
                    },
                    None if outlooks.is_empty() => WaitEstimate::NoServer,
                    None => WaitEstimate::NoServerFor {
                        model: model.unwrap_or_else(|| "?".into()),
                    },
                };
                (task_id, answer)
            })
            .collect())
    }

    /// Every server: the pool (latest version), the leader's view, and tasks done and failed
    /// there (the `tasks` read model).
    pub async fn list(&self) -> anyhow::Result<Vec<BackendView>> {
        let pool = self.load().await?;
        let statuses = self.statuses().await?;
        let client = crate::platform::postgres::checkout(&self.database)
            .await
            .context("getting a connection")?;
        let rows = client
            .query(
                "SELECT backend,
                        count(*) FILTER (WHERE status = 'succeeded'),
                        count(*) FILTER (WHERE status = 'failed')
                   FROM tasks WHERE backend IS NOT NULL GROUP BY backend",
                &[],
            )
            .await
            .context("counting tasks per server")?;
        let counts: HashMap<String, (i64, i64)> = rows
            .iter()
            .map(|row| (row.get(0), (row.get(1), row.get(2))))
            .collect();
        let now = self.clock.now();
        Ok(pool
            .backends
            .into_iter()
            .map(|backend| {
                let status = statuses
                    .get(&backend.name)
                    .filter(|status| {
                        (now - status.published_at).num_milliseconds() <= STATUS_STALE_MS
                    })
                    .cloned();
                let (tasks_succeeded, tasks_failed) =
                    counts.get(&backend.name).copied().unwrap_or((0, 0));
                BackendView {
                    state: state_of(&backend, status.as_ref()),
                    backend,
                    status,
                    tasks_succeeded,
                    tasks_failed,
                }
            })
            .collect())
    }
}

/// `dispatch.backends`, checked as the pool checks a server.
fn parse_configured(configured: &[BackendSettings]) -> anyhow::Result<Vec<NewBackend>> {
    configured
        .iter()
        .map(|backend| NewBackend::parse(&backend.name, &backend.url, backend.capacity))
        .collect::<Result<Vec<_>, _>>()
        .context("dispatch.backends")
}

/// A server's one-word state for operators.
pub fn state_of(backend: &PoolBackend, status: Option<&BackendStatus>) -> &'static str {
    // Resumed by the admin, still drained by the leader until it has followed the pool: it
    // takes no task yet, and says so.
    if !backend.draining && status.is_some_and(|status| status.draining) {
        return "resuming";
    }
    match (backend.draining, status) {
        (true, Some(status)) if status.prompts_in_flight + status.staged == 0 => "drained",
        (true, _) => "draining",
        (false, Some(status)) if status.up => "up",
        (false, Some(_)) => "down",
        (false, None) => "unknown",
    }
}
