//! The task queue in Redis: a sorted set of task ids by score (lower first), a sorted set of
//! dispatcher leases by expiry, and the last allocated score. Every multi-step change is one
//! script of `lua/`.
//!
//! The queue is derived state. Each task's score is recorded in its events (`TaskQueued`,
//! `TaskPrioritised`), so [`TaskQueue::rebuild`] can put every queued task back at its score after
//! Redis lost them (FLUSHALL, a restart without persistence): same scores, same order.
//!
//! Scores: `(now - SCORE_EPOCH) * SCORES_PER_MS`, at least `SCORE_SPACING_MIN` above the last one
//! (see `lua/queue_ticket.lua`). Among equal priorities that is first come, first served; a
//! prioritised task gets a score between two others (`lua/queue_prioritise_target.lua`).

pub mod lease;
pub mod scripts;

use anyhow::Context;
use redis::AsyncCommands;
use zhihui_domain::task::TaskId;

use crate::platform::clock::Clock;
use crate::platform::redis_store::RedisStore;

/// The queue's sorted set (under the prefix); the dispatcher's claim script pops it too.
/// The hash tag of the queue and the dispatcher's keys: the filler takes tasks off the queue
/// onto servers' slots in one script, so they must be one slot (the queue is one sorted set
/// anyway: it cannot spread).
pub const QUEUE_TAG: &str = "queue";
pub(crate) const QUEUE_KEY: &str = "queue:tasks";

/// The queued tasks' models (hash, under the prefix): the filler routes each task by it.
pub(crate) const MODELS_KEY: &str = "queue:models";

/// The queued tasks' sampler steps (hash, under the prefix): for wait estimates.
pub(crate) const STEPS_KEY: &str = "queue:steps";

/// Servers no new task may go to (drained or removed), by name: the filler's script (`lease.rs`) checks it, the pool (`tasks::pool`) writes it,
/// so a drain holds from the moment its request is answered, before the leader has read the
/// pool again. Derived: rewritten from the pool whenever the leader reads it.
pub const HELD_KEY: &str = "dispatch:held";
/// The pool version (events folded) [`HELD_KEY`] was written from.
pub(crate) const HELD_VERSION_KEY: &str = "dispatch:held:version";

/// Scores count from 2025-01-01T00:00:00Z (ms).
pub const SCORE_EPOCH_MS: i64 = 1_735_689_600_000;
/// Scores per millisecond: room for 12 halvings between tasks queued a millisecond apart.
pub const SCORES_PER_MS: i64 = 4_096;
/// Least distance between two consecutive new scores (tasks queued within one millisecond).
pub const SCORE_SPACING_MIN: i64 = 64;
/// Largest score Redis (a double) and Lua (a double) hold exactly.
pub const SCORE_MAX: i64 = (1 << 53) - 1;
// Scores stay below 2^53 until 2059: (2^40 ms ~ 34.8 years) * 4096 = 2^52.
const _: () = assert!((1i64 << 40) * SCORES_PER_MS < SCORE_MAX);
/// A task prioritised to the front goes this far ahead of the first one (one millisecond).
pub const FRONT_STEP: i64 = SCORES_PER_MS;

/// A claimed task: leased to the caller until `lease_expires_at_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedTask {
    pub task_id: TaskId,
    pub score: i64,
    pub lease_expires_at_ms: i64,
}

/// Where a prioritise would put a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrioritiseTarget {
    NotQueued,
    AlreadyFirst,
    /// Every gap ahead is exhausted (practically never: 4096 scores per millisecond).
    NoRoom,
    Ahead {
        to_score: i64,
        places: u32,
    },
}

#[derive(Debug, Clone)]
pub struct TaskQueue {
    redis: RedisStore,
    clock: Clock,
}

pub(crate) fn parse_score(text: &str) -> anyhow::Result<i64> {
    let value: f64 = text
        .parse()
        .with_context(|| format!("queue score {text:?} is not a number"))?;
    anyhow::ensure!(
        value.fract() == 0.0 && value.abs() <= SCORE_MAX as f64,
        "queue score {text} is not an exact integer"
    );
    // Exact: checked above.
    #[allow(clippy::cast_possible_truncation)]
    Ok(value as i64)
}

/// An integer score or count as Redis answers it: an integer, or a score's text (RESP2) or double
/// (RESP3).
fn score_value(value: &redis::Value) -> anyhow::Result<i64> {
    match value {
        redis::Value::Int(n) => Ok(*n),
        redis::Value::BulkString(bytes) => parse_score(std::str::from_utf8(bytes)?),
        redis::Value::SimpleString(text) => parse_score(text),
        redis::Value::Double(value) => parse_score(&value.to_string()),
        other => anyhow::bail!("unexpected queue answer {other:?}"),
    }
}

fn parse_task_id(text: &str) -> anyhow::Result<TaskId> {
    TaskId::parse_str(text).with_context(|| format!("queue member {text:?} is not a task id"))
}

impl TaskQueue {
    pub fn new(redis: RedisStore, clock: Clock) -> TaskQueue {
        TaskQueue { redis, clock }
    }

    fn queue_key(&self) -> String {
        self.redis.tagged(QUEUE_TAG, QUEUE_KEY)
    }

    /// Each queued task's model (task id -> checkpoint), for the dispatcher's filler.
    pub(crate) fn models_key(&self) -> String {
        self.redis.tagged(QUEUE_TAG, MODELS_KEY)
    }

    fn steps_key(&self) -> String {
        self.redis.tagged(QUEUE_TAG, STEPS_KEY)
    }

    fn leases_key(&self) -> String {
        self.redis.tagged(QUEUE_TAG, "queue:leases")
    }

    fn progress_key(&self, task_id: TaskId) -> String {
        self.redis.key(&format!("task-progress:{task_id}"))
    }

    fn last_score_key(&self) -> String {
        self.redis.tagged(QUEUE_TAG, "queue:last_score")
    }

    /// A score for a new task (later than every earlier one).
    pub async fn next_score(&self) -> anyhow::Result<i64> {
        let mut connection = self.redis.connection().await?;
        let score: String = crate::tasks::queue::scripts::QUEUE_TICKET
            .key(self.last_score_key())
            .arg(self.clock.now_ms())
            .arg(SCORE_EPOCH_MS)
            .arg(SCORES_PER_MS)
            .arg(SCORE_SPACING_MIN)
            .invoke_async(&mut connection)
            .await
            .context("allocating a queue score")?;
        let score = parse_score(&score)?;
        anyhow::ensure!(score <= SCORE_MAX, "queue scores are exhausted");
        Ok(score)
    }

    /// Queue `task_id` at `score` (or move it there), for a server that offers `work`'s model,
    /// with its steps (`None`: keep what it was queued with, or any server); its 0-based rank,
    /// `None` when leased.
    pub async fn enqueue(
        &self,
        task_id: TaskId,
        score: i64,
        work: Option<(&str, u32)>,
    ) -> anyhow::Result<Option<u64>> {
        let mut connection = self.redis.connection().await?;
        let (model, steps) = work.unwrap_or(("", 0));
        let rank: i64 = crate::tasks::queue::scripts::QUEUE_ENQUEUE
            .key(self.queue_key())
            .key(self.leases_key())
            .key(self.models_key())
            .key(self.steps_key())
            .arg(task_id.to_string())
            .arg(score)
            .arg(model)
            .arg(steps)
            .invoke_async(&mut connection)
            .await
            .context("queueing a task")?;
        Ok(u64::try_from(rank).ok())
    }

    /// Move a queued task to `score`; nothing when it is no longer queued (claimed meanwhile).
    pub async fn move_to(&self, task_id: TaskId, score: i64) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _changed: i64 = redis::cmd("ZADD")
            .arg(self.queue_key())
            .arg("XX")
            .arg(score)
            .arg(task_id.to_string())
            .query_async(&mut connection)
            .await
            .context("moving a task in the queue")?;
        Ok(())
    }

    /// Take a task out of the queue, with its model (repeated once on a cluster connection
    /// opened again, when the first attempt met a stale map of the slots).
    pub async fn remove(&self, task_id: TaskId) -> anyhow::Result<()> {
        let member = task_id.to_string();
        let _removed: i64 = self
            .redis
            .repeatable(|mut connection| {
                let member = member.clone();
                async move {
                    crate::tasks::queue::scripts::QUEUE_REMOVE
                        .key(self.queue_key())
                        .key(self.models_key())
                        .key(self.steps_key())
                        .arg(member)
                        .invoke_async(&mut connection)
                        .await
                }
            })
            .await
            .context("removing a task from the queue")?;
        Ok(())
    }

    /// `pipe`, also dropping `member`'s model and steps from beside the queue.
    fn forgetting_work<'a>(
        &self,
        pipe: &'a mut redis::Pipeline,
        member: &str,
    ) -> &'a mut redis::Pipeline {
        pipe.hdel(self.models_key(), member)
            .ignore()
            .hdel(self.steps_key(), member)
            .ignore()
    }

    /// Forget a task's model once its dispatch is recorded (it will not be queued again).
    pub async fn forget_model(&self, task_id: TaskId) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: () = self
            .forgetting_work(&mut redis::pipe(), &task_id.to_string())
            .query_async(&mut connection)
            .await
            .context("forgetting a dispatched task's model")?;
        Ok(())
    }

    /// The first `count` queued tasks, in order, each with its model and steps (when known).
    pub async fn head(
        &self,
        count: usize,
    ) -> anyhow::Result<Vec<(TaskId, Option<String>, Option<u32>)>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let mut connection = self.redis.connection().await?;
        let members: Vec<String> = connection
            .zrange(
                self.queue_key(),
                0,
                isize::try_from(count).unwrap_or(isize::MAX) - 1,
            )
            .await
            .context("reading the queue's head")?;
        if members.is_empty() {
            return Ok(Vec::new());
        }
        let (models, steps): (Vec<Option<String>>, Vec<Option<u32>>) = redis::pipe()
            .cmd("HMGET")
            .arg(self.models_key())
            .arg(&members)
            .cmd("HMGET")
            .arg(self.steps_key())
            .arg(&members)
            .query_async(&mut connection)
            .await
            .context("reading queued tasks' work")?;
        members
            .iter()
            .zip(models)
            .zip(steps)
            .map(|((member, model), steps)| Ok((parse_task_id(member)?, model, steps)))
            .collect()
    }

    /// The model each of `task_ids` was queued for (`None`: not known here).
    pub async fn models(&self, task_ids: &[TaskId]) -> anyhow::Result<Vec<Option<String>>> {
        if task_ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut connection = self.redis.connection().await?;
        let members: Vec<String> = task_ids.iter().map(ToString::to_string).collect();
        redis::cmd("HMGET")
            .arg(self.models_key())
            .arg(&members)
            .query_async(&mut connection)
            .await
            .context("reading queued tasks' models")
    }

    /// 0-based rank of a queued task.
    pub async fn rank(&self, task_id: TaskId) -> anyhow::Result<Option<u64>> {
        let mut connection = self.redis.connection().await?;
        let rank: Option<u64> = connection
            .zrank(self.queue_key(), task_id.to_string())
            .await
            .context("reading a queue position")?;
        Ok(rank)
    }

    /// A task's 0-based place and its score in the queue, read together; `None` when the queue
    /// does not hold it.
    pub async fn place(&self, task_id: TaskId) -> anyhow::Result<Option<(u64, f64)>> {
        let mut connection = self.redis.connection().await?;
        let member = task_id.to_string();
        let (rank, score): (Option<u64>, Option<f64>) = redis::pipe()
            .atomic()
            .zrank(self.queue_key(), &member)
            .zscore(self.queue_key(), &member)
            .query_async(&mut connection)
            .await
            .context("reading a queue place")?;
        Ok(rank.zip(score))
    }

    /// The 0-based places of many tasks in one call (`None`: not in the queue), in order.
    pub async fn ranks(&self, task_ids: &[TaskId]) -> anyhow::Result<Vec<Option<u64>>> {
        if task_ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut script = crate::tasks::queue::scripts::QUEUE_RANKS.key(self.queue_key());
        for task_id in task_ids {
            script.arg(task_id.to_string());
        }
        let mut connection = self.redis.connection().await?;
        let ranks: Vec<i64> = script
            .invoke_async(&mut connection)
            .await
            .context("reading queue positions")?;
        Ok(ranks
            .into_iter()
            .map(|rank| u64::try_from(rank).ok())
            .collect())
    }

    pub async fn len(&self) -> anyhow::Result<u64> {
        let mut connection = self.redis.connection().await?;
        let length: u64 = connection
            .zcard(self.queue_key())
            .await
            .context("reading the queue length")?;
        Ok(length)
    }

    /// The whole queue in order, with scores (admin views, rebuild checks).
    pub async fn entries(&self) -> anyhow::Result<Vec<(TaskId, i64)>> {
        let mut connection = self.redis.connection().await?;
        let raw: Vec<(String, String)> = redis::cmd("ZRANGE")
            .arg(self.queue_key())
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut connection)
            .await
            .context("reading the queue")?;
        raw.iter()
            .map(|(member, score)| Ok((parse_task_id(member)?, parse_score(score)?)))
            .collect()
    }

    /// Where a prioritise of `task_id` would put it (reads only). `known_score` is the score its
    /// events give it. When the queue holds the task at that score, one round trip of two plain
    /// commands answers: its score, and the scores of the tasks `jump_max` and `jump_max + 1`
    /// places ahead (ahead by score is ahead by rank: tickets only increase and a move lands
    /// strictly between two scores, so no two tasks share one). Otherwise (the queue disagrees,
    /// fewer tasks ahead than the jump, no integer between the two scores) the script reads by
    /// rank. The plain read costs Redis one walk of the sorted set where the script's rank and
    /// range cost two, and no script call.
    pub async fn prioritise_target(
        &self,
        task_id: TaskId,
        known_score: Option<i64>,
        jump_max: u32,
    ) -> anyhow::Result<PrioritiseTarget> {
        if let Some(score) = known_score
            && let Some(target) = self
                .prioritise_target_by_score(task_id, score, jump_max)
                .await?
        {
            return Ok(target);
        }
        self.prioritise_target_by_rank(task_id, jump_max).await
    }

    /// The plain read of `prioritise_target` alone; `None` when it cannot answer (the script
    /// must).
    pub async fn prioritise_target_by_score(
        &self,
        task_id: TaskId,
        score: i64,
        jump_max: u32,
    ) -> anyhow::Result<Option<PrioritiseTarget>> {
        let mut connection = self.redis.connection().await?;
        let (held, ahead): (Option<redis::Value>, Vec<redis::Value>) = redis::pipe()
            .zscore(self.queue_key(), task_id.to_string())
            .cmd("ZRANGE")
            .arg(self.queue_key())
            .arg(format!("({score}"))
            .arg("-inf")
            .arg("BYSCORE")
            .arg("REV")
            .arg("LIMIT")
            .arg(jump_max - 1)
            .arg(2)
            .arg("WITHSCORES")
            .query_async(&mut connection)
            .await
            .context("finding a prioritise target")?;
        let Some(held) = held else {
            return Ok(Some(PrioritiseTarget::NotQueued));
        };
        if score_value(&held)? != score {
            return Ok(None);
        }
        // Nearest first: the task `jump_max` places ahead, then the one before it (member and
        // score flat under RESP2, in pairs under RESP3).
        let flat: Vec<&redis::Value> = ahead
            .iter()
            .flat_map(|entry| match entry {
                redis::Value::Array(pair) => pair.iter().collect(),
                single => vec![single],
            })
            .collect();
        let scores = flat
            .into_iter()
            .skip(1)
            .step_by(2)
            .map(score_value)
            .collect::<anyhow::Result<Vec<i64>>>()?;
        Ok(match scores.as_slice() {
            [front] => Some(PrioritiseTarget::Ahead {
                to_score: front - FRONT_STEP,
                places: jump_max,
            }),
            [behind, before] if behind - before >= 2 => Some(PrioritiseTarget::Ahead {
                to_score: before + (behind - before) / 2,
                places: jump_max,
            }),
            _ => None,
        })
    }

    /// `prioritise_target` by the task's rank, in one script.
    async fn prioritise_target_by_rank(
        &self,
        task_id: TaskId,
        jump_max: u32,
    ) -> anyhow::Result<PrioritiseTarget> {
        let mut connection = self.redis.connection().await?;
        let answer: Vec<redis::Value> = crate::tasks::queue::scripts::QUEUE_PRIORITISE_TARGET
            .key(self.queue_key())
            .arg(task_id.to_string())
            .arg(jump_max)
            .arg(FRONT_STEP)
            .invoke_async(&mut connection)
            .await
            .context("finding a prioritise target")?;
        match answer.as_slice() {
            [code] => Ok(match score_value(code)? {
                -1 => PrioritiseTarget::NotQueued,
                0 => PrioritiseTarget::AlreadyFirst,
                _ => PrioritiseTarget::NoRoom,
            }),
            [_rank, score, places] => Ok(PrioritiseTarget::Ahead {
                to_score: score_value(score)?,
                places: u32::try_from(score_value(places)?)?,
            }),
            other => anyhow::bail!("unexpected prioritise answer {other:?}"),
        }
    }

    /// Take the first task, leased for `lease_ms`.
    pub async fn claim(&self, lease_ms: u64) -> anyhow::Result<Option<ClaimedTask>> {
        let mut connection = self.redis.connection().await?;
        let claimed: Option<(String, String, String)> = crate::tasks::queue::scripts::QUEUE_CLAIM
            .key(self.queue_key())
            .key(self.leases_key())
            .arg(self.clock.now_ms())
            .arg(lease_ms)
            .invoke_async(&mut connection)
            .await
            .context("claiming a task")?;
        claimed
            .map(|(member, score, expiry)| {
                Ok(ClaimedTask {
                    task_id: parse_task_id(&member)?,
                    score: parse_score(&score)?,
                    lease_expires_at_ms: parse_score(&expiry)?,
                })
            })
            .transpose()
    }

    /// End a lease (the task was dispatched elsewhere, cancelled, or finished).
    pub async fn release_lease(&self, task_id: TaskId) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _removed: i64 = connection
            .zrem(self.leases_key(), task_id.to_string())
            .await
            .context("releasing a lease")?;
        Ok(())
    }

    /// Leased task ids whose lease ran out by now.
    pub async fn expired_leases(&self, limit: usize) -> anyhow::Result<Vec<TaskId>> {
        let mut connection = self.redis.connection().await?;
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.leases_key())
            .arg("-inf")
            .arg(self.clock.now_ms())
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut connection)
            .await
            .context("reading expired leases")?;
        members.iter().map(|member| parse_task_id(member)).collect()
    }

    /// Queue a task whose lease ran out again at `score`; false if the lease was renewed.
    pub async fn requeue_expired(&self, task_id: TaskId, score: i64) -> anyhow::Result<bool> {
        let mut connection = self.redis.connection().await?;
        let requeued: i64 = crate::tasks::queue::scripts::QUEUE_REQUEUE
            .key(self.queue_key())
            .key(self.leases_key())
            .arg(task_id.to_string())
            .arg(score)
            .arg(self.clock.now_ms())
            .invoke_async(&mut connection)
            .await
            .context("requeueing a task")?;
        Ok(requeued == 1)
    }

    /// Make sure the score allocator is past `score` (after a rebuild, so that new tasks queue
    /// behind the restored ones even if the clock went back).
    pub async fn ensure_scores_after(&self, score: i64) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = crate::tasks::queue::scripts::QUEUE_SCORES_AFTER
            .key(self.last_score_key())
            .arg(score)
            .invoke_async(&mut connection)
            .await
            .context("restoring the last score")?;
        Ok(())
    }

    /// Sampling progress of a running task, `(value, max)`, as the dispatcher last reported it
    /// (`task:progress:<id>`, a hash with a TTL; absent before the first step).
    /// Record a running task's progress (read by `GET /tasks/{id}`), kept for `ttl_ms`.
    pub async fn set_progress(
        &self,
        task_id: TaskId,
        value: u64,
        max: u64,
        ttl_ms: u64,
    ) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = crate::tasks::queue::scripts::TASK_PROGRESS
            .key(self.progress_key(task_id))
            .arg(value)
            .arg(max)
            .arg(ttl_ms)
            .invoke_async(&mut connection)
            .await
            .context("recording progress")?;
        Ok(())
    }

    pub async fn clear_progress(&self, task_id: TaskId) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = connection
            .del(self.progress_key(task_id))
            .await
            .context("clearing progress")?;
        Ok(())
    }

    pub async fn progress(&self, task_id: TaskId) -> anyhow::Result<Option<(u64, u64)>> {
        let mut connection = self.redis.connection().await?;
        let (value, max): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(self.progress_key(task_id))
            .arg("value")
            .arg("max")
            .query_async(&mut connection)
            .await
            .context("reading a task's progress")?;
        Ok(value.zip(max))
    }
}
