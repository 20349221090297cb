-- Count a failed redemption of one user. The window starts with the first failure and follows
-- the application clock; the Redis TTL only reclaims memory.
-- KEYS[1] the user's failures (hash: started_ms, failures)
-- ARGV[1] now (ms, application clock), ARGV[2] window (ms)
-- Returns the failures in the window so far.
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local counted = redis.call('HMGET', KEYS[1], 'started_ms', 'failures')
local started, failures = tonumber(counted[1] or '0'), tonumber(counted[2] or '0')
if now >= started + window then
  started, failures = now, 0
end
failures = failures + 1
redis.call('HSET', KEYS[1], 'started_ms', started, 'failures', failures)
redis.call('PEXPIRE', KEYS[1], window * 2)
return failures
