-- Put a task in the queue at its score (or move it there), unless a dispatcher holds a lease on
-- it: a claimed task is not queued again by a late retry or a rebuild. Its model is kept beside
-- it, for the filler to route by.
-- KEYS[1] queue (sorted set: task id -> score), KEYS[2] leases (sorted set: task id -> expiry),
-- KEYS[3] queued tasks' models (hash: task id -> checkpoint), KEYS[4] their sampler steps
--   (hash: task id -> steps, for wait estimates)
-- ARGV[1] task id, ARGV[2] score, ARGV[3] its model ('': leave what is there), ARGV[4] its steps
-- Returns the 0-based rank, or -1 when the task is leased.
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return -1
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
  redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return redis.call('ZRANK', KEYS[1], ARGV[1])
