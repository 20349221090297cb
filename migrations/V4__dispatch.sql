-- Dispatch: fencing tokens of dispatcher leaders, and the intent of a dispatch.

-- Every acquisition of the dispatcher leader lease (in Redis) takes the next value: tokens only
-- grow, even after Redis is flushed, so a task stream can refuse the writes of an older leader.
CREATE SEQUENCE dispatch_fencing_tokens;

-- A dispatch writes an intent when it claims a task and deletes it once the task's hold is
-- settled or released; the intent sweeper finishes what a dead dispatcher left (a task back in
-- the queue, a hold of a finished task), and leaves the intent of a task still in flight alone.
ALTER TABLE task_intents DROP CONSTRAINT task_intents_kind_check;
ALTER TABLE task_intents ADD CONSTRAINT task_intents_kind_check
    CHECK (kind IN ('submit', 'prioritise', 'cancel', 'dispatch'));
