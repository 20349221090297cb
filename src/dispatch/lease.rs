//! Leases in Redis: the dispatcher leader's (one leader across processes, with a fencing token
//! from a PostgreSQL sequence so tokens grow even across a Redis flush) and the slot leases of
//! prompts in flight (one sorted set per backend: busy slots are the unexpired leases, so a
//! dispatcher that dies cannot leak a slot). Expiries are Redis time (`PX`, `TIME`).

use anyhow::Context;
use deadpool_postgres::Pool;
use redis::AsyncCommands;
use zhihui_domain::task::TaskId;

use crate::redis_store::RedisStore;

/// The leader's term: who, and its fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    pub instance: String,
    pub fencing_token: u64,
}

impl Term {
    /// The value stored under the lease key.
    pub fn value(&self) -> String {
        format!("{}:{}", self.instance, self.fencing_token)
    }
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    Claimed {
        task_id: TaskId,
        score: i64,
    },
    /// The backend's slots are all busy.
    Full,
    /// Nothing queued.
    Empty,
    /// The lease is no longer ours.
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
        self.redis.key("dispatch:leader")
    }

    fn slots_key(&self, backend: &str) -> String {
        self.redis.key(&format!("dispatch:slots:{backend}"))
    }

    fn queue_key(&self) -> String {
        self.redis.key(crate::tasks::queue::QUEUE_KEY)
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
        let term = Term {
            instance: instance.to_owned(),
            fencing_token: u64::try_from(token).context("a negative fencing token")?,
        };
        let won: i64 = crate::lua::DISPATCH_LEADER_ACQUIRE
            .key(self.leader_key())
            .arg(term.value())
            .arg(lease_ms)
            .invoke_async(&mut connection)
            .await
            .context("taking the leader lease")?;
        Ok((won == 1).then_some(term))
    }

    /// Extend our lease; `false` when it is gone (we are no longer the leader).
    pub async fn renew(&self, term: &Term, lease_ms: u64) -> anyhow::Result<bool> {
        let mut connection = self.redis.connection().await?;
        let renewed: i64 = crate::lua::DISPATCH_LEADER_RENEW
            .key(self.leader_key())
            .arg(term.value())
            .arg(lease_ms)
            .invoke_async(&mut connection)
            .await
            .context("renewing the leader lease")?;
        Ok(renewed == 1)
    }

    pub async fn resign(&self, term: &Term) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = crate::lua::DISPATCH_LEADER_RESIGN
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

    /// Take the first queued task onto a free slot of `backend`.
    pub async fn claim(
        &self,
        term: &Term,
        backend: &str,
        capacity: u32,
        busy_known: usize,
        slot_lease_ms: u64,
    ) -> anyhow::Result<Claim> {
        let mut connection = self.redis.connection().await?;
        let answer: Vec<String> = crate::lua::DISPATCH_CLAIM
            .key(self.leader_key())
            .key(self.queue_key())
            .key(self.slots_key(backend))
            .arg(term.value())
            .arg(capacity)
            .arg(slot_lease_ms)
            .arg(busy_known)
            .invoke_async(&mut connection)
            .await
            .context("claiming a task")?;
        Ok(match answer.as_slice() {
            [kind, task_id, score] if kind == "claimed" => Claim::Claimed {
                task_id: TaskId::parse_str(task_id)
                    .with_context(|| format!("queue member {task_id:?} is not a task id"))?,
                score: crate::tasks::queue::parse_score(score)?,
            },
            [kind] if kind == "full" => Claim::Full,
            [kind] if kind == "empty" => Claim::Empty,
            [kind] if kind == "not-leader" => Claim::NotLeader,
            other => anyhow::bail!("unexpected claim answer {other:?}"),
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
        let mut invocation = crate::lua::DISPATCH_SLOTS_RENEW.key(self.leader_key());
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
