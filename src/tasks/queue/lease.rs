//! Leases in Redis: the dispatcher leader's (one leader across processes, with a fencing token
//! from a PostgreSQL sequence so tokens grow even across a Redis flush) and the slot leases of
//! prompts in flight (one sorted set per backend: busy slots are the unexpired leases, so a
//! dispatcher that dies cannot leak a slot). Expiries are Redis time (`PX`, `TIME`).

use anyhow::Context;
use deadpool_postgres::Pool;
use redis::AsyncCommands;
use zhihui_domain::task::TaskId;

use crate::platform::redis_store::RedisStore;

/// The leader's term: who, and its fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    pub instance: String,
    pub fencing_token: u64,
    /// The replication id of the Redis holding the queue when the term began
    /// ([`crate::platform::redis_store::RedisStore::replication_id`]): a renewal that finds another one
    /// ends the term, so the next one rebuilds the queue (a promoted replica may lack the last
    /// tasks queued).
    pub redis_replication_id: Option<String>,
}

impl Term {
    /// The value stored under the lease key.
    pub fn value(&self) -> String {
        format!("{}:{}", self.instance, self.fencing_token)
    }
}

/// What the saga knows of one server when it fills: prompts posted there and tasks staged there
/// (floors for the busy slots: after a Redis flush the leases may be gone while prompts run),
/// the model it ran last and the models it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSlots {
    pub capacity: u32,
    pub busy: usize,
    pub staged: usize,
    pub last_model: Option<String>,
    /// `None`: any model (it has not said).
    pub models: Option<Vec<String>>,
}

/// One fill's orders: what to release, and what each server may take.
#[derive(Debug, Clone)]
pub struct FillPlan<'a> {
    /// Every server's name, in the saga's order.
    pub names: &'a [String],
    pub releases: &'a [(usize, TaskId)],
    /// Per server; `None`: nothing may go there (no socket, draining, removed).
    pub servers: &'a [Option<ServerSlots>],
    /// Staged tasks per server beyond its capacity.
    pub depth: u32,
    pub slot_lease_ms: u64,
    /// Queue entries the filler looks at, at most (tasks further back wait for the next fill).
    pub scan_max: usize,
    /// A task goes to the server that ran its model last when several could take it, and a
    /// free server looks ahead for a task of the model it ran last.
    pub prefer_same_model: bool,
    /// How many tasks it could run a free server looks at for one of its last model.
    pub affinity_window: u32,
    /// A task queued this long is never passed over for another of a server's last model.
    pub affinity_wait_max_ms: u64,
}

/// A task taken off the queue onto a server's slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// Index of the server in the configuration.
    pub backend: usize,
    pub task_id: TaskId,
    pub score: i64,
}

/// What a fill did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fill {
    /// In claim order (the queue's order).
    Claimed {
        claims: Vec<Claimed>,
        queue_empty: bool,
    },
    /// The lease is no longer ours: nothing was claimed (the releases were made).
    NotLeader,
}

#[derive(Debug, Clone)]
pub struct Leases {
    redis: RedisStore,
    pool: Pool,
}

impl Leases {
    pub fn new(redis: RedisStore, pool: Pool) -> Leases {
        Leases { redis, pool }
    }

    fn leader_key(&self) -> String {
        self.redis
            .tagged(crate::tasks::queue::QUEUE_TAG, "dispatch:leader")
    }

    fn slots_key(&self, backend: &str) -> String {
        self.redis.tagged(
            crate::tasks::queue::QUEUE_TAG,
            &format!("dispatch:slots:{backend}"),
        )
    }

    fn queue_key(&self) -> String {
        self.redis.tagged(
            crate::tasks::queue::QUEUE_TAG,
            crate::tasks::queue::QUEUE_KEY,
        )
    }

    /// Try to become the leader. A new term always has a new, larger token.
    pub async fn acquire(&self, instance: &str, lease_ms: u64) -> anyhow::Result<Option<Term>> {
        let mut connection = self.redis.connection().await?;
        // Cheap check first: do not burn a token while someone else leads.
        let holder: Option<String> = connection
            .get(self.leader_key())
            .await
            .context("reading the leader lease")?;
        if holder.is_some() {
            return Ok(None);
        }
        let client = self.pool.get().await.context("getting a connection")?;
        let token: i64 = client
            .query_one("SELECT nextval('dispatch_fencing_tokens')", &[])
            .await
            .context("taking a fencing token")?
            .get(0);
        let mut term = Term {
            instance: instance.to_owned(),
            fencing_token: u64::try_from(token).context("a negative fencing token")?,
            redis_replication_id: None,
        };
        let won: i64 = crate::tasks::queue::scripts::DISPATCH_LEADER_ACQUIRE
            .key(self.leader_key())
            .arg(term.value())
            .arg(lease_ms)
            .invoke_async(&mut connection)
            .await
            .context("taking the leader lease")?;
        if won != 1 {
            return Ok(None);
        }
        // Read after winning and before the term rebuilds the queue: a failover after this is
        // seen by a renewal. Unread, the term does not start: the lease is given back at once
        // rather than held, unused, until it runs out.
        match self.redis.replication_id(&self.leader_key()).await {
            Ok(id) => term.redis_replication_id = Some(id),
            Err(error) => {
                drop(self.resign(&term).await);
                return Err(error.context("reading the replication id of the queue's Redis"));
            }
        }
        Ok(Some(term))
    }

    /// Extend our lease; `false` when it is gone (we are no longer the leader).
    pub async fn renew(&self, term: &Term, lease_ms: u64) -> anyhow::Result<bool> {
        let mut connection = self.redis.connection().await?;
        let renewed: i64 = crate::tasks::queue::scripts::DISPATCH_LEADER_RENEW
            .key(self.leader_key())
            .arg(term.value())
            .arg(lease_ms)
            .invoke_async(&mut connection)
            .await
            .context("renewing the leader lease")?;
        if renewed != 1 {
            return Ok(false);
        }
        if let Some(began_on) = &term.redis_replication_id {
            let now_on = self.redis.replication_id(&self.leader_key()).await?;
            if &now_on != began_on {
                tracing::warn!(
                    began_on = %began_on,
                    now_on = %now_on,
                    "the Redis holding the queue failed over or restarted (its replication id changed); the dispatcher ends its term so the next one rebuilds the queue"
                );
                return Ok(false);
            }
        }
        Ok(true)
    }

    pub async fn resign(&self, term: &Term) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = crate::tasks::queue::scripts::DISPATCH_LEADER_RESIGN
            .key(self.leader_key())
            .arg(term.value())
            .invoke_async(&mut connection)
            .await
            .context("resigning the leader lease")?;
        Ok(())
    }

    /// The current holder's value (`"<instance>:<token>"`), if any.
    pub async fn holder(&self) -> anyhow::Result<Option<String>> {
        let mut connection = self.redis.connection().await?;
        connection
            .get(self.leader_key())
            .await
            .context("reading the leader lease")
    }

    /// In one step (`dispatch_fill.lua`): release the slot leases of ended prompts, then take
    /// queued tasks onto the free slots of the servers that offer their models, then stage up to
    /// `depth` tasks per server beyond its capacity.
    pub async fn fill(&self, term: &Term, plan: &FillPlan<'_>) -> anyhow::Result<Fill> {
        let names = plan.names;
        assert_eq!(names.len(), plan.servers.len(), "one view per server");
        let mut connection = self.redis.connection().await?;
        let mut invocation = crate::tasks::queue::scripts::DISPATCH_FILL.key(self.leader_key());
        invocation.key(self.queue_key());
        invocation.key(self.redis.tagged(
            crate::tasks::queue::QUEUE_TAG,
            crate::tasks::queue::MODELS_KEY,
        ));
        invocation.key(self.redis.tagged(
            crate::tasks::queue::QUEUE_TAG,
            crate::tasks::queue::HELD_KEY,
        ));
        for name in names {
            invocation.key(self.slots_key(name));
        }
        invocation
            .arg(term.value())
            .arg(plan.slot_lease_ms)
            .arg(plan.depth)
            .arg(plan.scan_max.max(1))
            .arg(if plan.prefer_same_model { "1" } else { "0" })
            .arg(plan.affinity_window)
            .arg(plan.affinity_wait_max_ms)
            .arg(crate::tasks::queue::SCORE_EPOCH_MS)
            .arg(crate::tasks::queue::SCORES_PER_MS)
            .arg(plan.releases.len());
        for (backend, task_id) in plan.releases {
            assert!(
                *backend < names.len(),
                "a release names a server of the saga"
            );
            invocation.arg(backend + 1).arg(task_id.to_string());
        }
        for (name, server) in names.iter().zip(plan.servers) {
            invocation.arg(name);
            match server {
                Some(slots) => {
                    invocation
                        .arg(i64::from(slots.capacity))
                        .arg(slots.busy)
                        .arg(slots.staged)
                        .arg(slots.last_model.as_deref().unwrap_or(""));
                    match &slots.models {
                        Some(models) => {
                            invocation.arg(models.len());
                            for model in models {
                                invocation.arg(model);
                            }
                        }
                        None => {
                            invocation.arg(-1);
                        }
                    }
                }
                None => {
                    invocation.arg(-1).arg(0).arg(0).arg("").arg(-1);
                }
            };
        }
        let answer: Vec<String> = invocation
            .invoke_async(&mut connection)
            .await
            .context("filling the servers' slots")?;
        let (queue_empty, rest) = match answer.as_slice() {
            [kind] if kind == "not-leader" => return Ok(Fill::NotLeader),
            [kind, queue_empty, rest @ ..] if kind == "ok" && rest.len() % 3 == 0 => {
                (queue_empty == "1", rest)
            }
            other => anyhow::bail!("unexpected fill answer {other:?}"),
        };
        let claims = rest
            .chunks_exact(3)
            .map(|claim| {
                let server: usize = claim[0]
                    .parse()
                    .with_context(|| format!("server number {:?}", claim[0]))?;
                anyhow::ensure!(
                    (1..=names.len()).contains(&server),
                    "server number {server} out of range"
                );
                Ok(Claimed {
                    backend: server - 1,
                    task_id: TaskId::parse_str(&claim[1])
                        .with_context(|| format!("queue member {:?} is not a task id", claim[1]))?,
                    score: crate::tasks::queue::parse_score(&claim[2])?,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Fill::Claimed {
            claims,
            queue_empty,
        })
    }

    /// Renew (or put back) the slot leases of `tasks` on `backend`; `false` when not the leader.
    pub async fn renew_slots(
        &self,
        term: &Term,
        backend: &str,
        tasks: &[TaskId],
        slot_lease_ms: u64,
    ) -> anyhow::Result<bool> {
        let mut connection = self.redis.connection().await?;
        let mut invocation =
            crate::tasks::queue::scripts::DISPATCH_SLOTS_RENEW.key(self.leader_key());
        invocation
            .key(self.slots_key(backend))
            .arg(term.value())
            .arg(slot_lease_ms);
        for task_id in tasks {
            invocation.arg(task_id.to_string());
        }
        let renewed: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .context("renewing slot leases")?;
        Ok(renewed == 1)
    }

    /// Free a task's slot on `backend`.
    pub async fn release_slot(&self, backend: &str, task_id: TaskId) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = connection
            .zrem(self.slots_key(backend), task_id.to_string())
            .await
            .context("releasing a slot")?;
        Ok(())
    }

    /// Tasks holding an unexpired slot lease on `backend` (Redis time).
    pub async fn busy_slots(&self, backend: &str) -> anyhow::Result<Vec<TaskId>> {
        let mut connection = self.redis.connection().await?;
        let (seconds, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut connection)
            .await
            .context("reading Redis time")?;
        let now_ms = seconds * 1000 + micros / 1000;
        let members: Vec<String> = connection
            .zrangebyscore(self.slots_key(backend), format!("({now_ms}"), "+inf")
            .await
            .context("reading slot leases")?;
        members
            .iter()
            .map(|member| {
                TaskId::parse_str(member)
                    .with_context(|| format!("slot member {member:?} is not a task id"))
            })
            .collect()
    }
}
