-- The first step of a redemption's fast path: the user's failure limit. The window follows the
-- application clock; the Redis TTL only reclaims memory.
-- KEYS[1] the user's failures (hash: started_ms, failures)
-- ARGV[1] now (ms, application clock), ARGV[2] failures max, ARGV[3] the user's forged attempts
-- the calling process counted in memory since its last call (added to the counter first),
-- ARGV[4] the failure window (ms)
-- Returns {'limited', retry after ms} | {'ok'}.
local now, window = tonumber(ARGV[1]), tonumber(ARGV[4])
local counted = redis.call('HMGET', KEYS[1], 'started_ms', 'failures')
local started, failures = tonumber(counted[1] or '0'), tonumber(counted[2] or '0')
if now >= started + window then
  started, failures = now, 0
end
local forged = tonumber(ARGV[3])
if forged > 0 then
  failures = failures + forged
  redis.call('HSET', KEYS[1], 'started_ms', started, 'failures', failures)
  redis.call('PEXPIRE', KEYS[1], window * 2)
end
if failures >= tonumber(ARGV[2]) then
  return {'limited', tostring(started + window - now)}
end
return {'ok'}
