-- One prioritise of a task at a time. Two prioritises sent together (a double click, a client
-- without an Idempotency-Key retrying) both read the same place in the queue; each charged its
-- fee before one of them lost at the task's stream and was refunded, and meanwhile the second
-- fee could refuse an unrelated request for want of points. The intent is the claim: the second
-- request finds the first one's row and is told that a prioritise of this task is under way.
-- Intents of crashed requests are resolved by the sweeper, which frees the task for the next.
CREATE UNIQUE INDEX task_intents_one_prioritise ON task_intents (task_id)
    WHERE kind = 'prioritise';
