-- Take a task out of the queue with its model and steps. A script and not MULTI/EXEC: a Redis
-- Cluster client follows a script to the node that owns its slot after the slot moved, while
-- an aborted transaction is only an error.
-- KEYS[1] the queue, KEYS[2] the models, KEYS[3] the steps (one hash tag); ARGV[1] the task
-- Returns 1 when the task was queued, else 0.
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return removed
