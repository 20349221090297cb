-- Tasks: the read model of the task streams (projection `tasks`), and the intents of requests
-- that span two streams.

-- One row per recorded task. Derived from the events; `zhihui replay --projection tasks` rebuilds it.
CREATE TABLE tasks (
    task_id          uuid PRIMARY KEY,
    user_id          uuid        NOT NULL,
    status           text        NOT NULL,
    prompt           text        NOT NULL,
    negative_prompt  text        NOT NULL,
    spec             jsonb       NOT NULL,
    price            numeric(20, 2) NOT NULL,
    -- Queue order while queued (lower first); NULL once the task left the queue.
    queue_score      bigint,
    cancel_requested boolean     NOT NULL DEFAULT false,
    prioritised      integer     NOT NULL DEFAULT 0,
    backend          text,
    prompt_id        uuid,
    images           jsonb       NOT NULL DEFAULT '[]',
    failure_reason   text,
    submitted_at     timestamptz NOT NULL,
    finished_at      timestamptz,
    -- Stream version of the last applied event: a second guard against applying one twice.
    stream_version   bigint      NOT NULL,
    updated_at       timestamptz NOT NULL
);
-- A user's tasks, newest first (the list query and its cursor).
CREATE INDEX tasks_by_user_newest ON tasks (user_id, submitted_at DESC, task_id DESC);
-- The queued tasks in queue order: rebuilding the Redis queue.
CREATE INDEX tasks_queued_by_score ON tasks (queue_score) WHERE status = 'queued';

-- A request that writes to more than one stream (freeze then record a task, charge then move a
-- task, cancel then release) writes its intent here first and deletes it when done. A row that
-- outlives `tasks.intent_resolve_after_ms` belongs to a request that crashed; the intent sweeper
-- then brings the account, the task and the Redis queue into agreement (see src/tasks/service.rs).
-- Not a read model: it is the in-flight memory of those requests, never replayed.
CREATE TABLE task_intents (
    intent_id    uuid PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind IN ('submit', 'prioritise', 'cancel')),
    task_id      uuid        NOT NULL,
    user_id      uuid        NOT NULL,
    -- The prioritise operation, for kind = 'prioritise'.
    operation_id uuid,
    created_at   timestamptz NOT NULL
);
CREATE INDEX task_intents_by_age ON task_intents (created_at);
