-- A lease ran out before its task was dispatched: drop the lease and queue the task again at its
-- score, in one step (so it is never both leased and queued, nor neither).
-- KEYS[1] queue, KEYS[2] leases
-- ARGV[1] task id, ARGV[2] score, ARGV[3] now (ms)
-- Returns 1 when requeued, 0 when the lease was renewed or is gone.
local expiry = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not expiry or tonumber(expiry) > tonumber(ARGV[3]) then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
