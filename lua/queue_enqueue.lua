-- Put a task in the queue at its score (or move it there), unless a dispatcher holds a lease on
-- it: a claimed task is not queued again by a late retry or a rebuild.
-- KEYS[1] queue (sorted set: task id -> score), KEYS[2] leases (sorted set: task id -> expiry)
-- ARGV[1] task id, ARGV[2] score
-- Returns the 0-based rank, or -1 when the task is leased.
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return -1
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return redis.call('ZRANK', KEYS[1], ARGV[1])
