-- Password brute-force guard for one username.
-- KEYS[1] the username's failure state (hash)
-- ARGV[1] operation: 'check' (before verifying), 'fail' (after a wrong password),
--         'reset' (after a right one)
-- ARGV[2] now (ms, application clock), ARGV[3] wrong passwords before the lock,
-- ARGV[4] lock duration (ms), ARGV[5] safety ttl (ms, Redis clock)
-- Returns {status, n}: {'open', attempts left}, {'locked', locked until}
local now = tonumber(ARGV[2])
local op = ARGV[1]
if op == 'reset' then
  redis.call('DEL', KEYS[1])
  return {'open', tonumber(ARGV[3])}
end
local state = redis.call('HMGET', KEYS[1], 'locked_until_ms', 'failures')
local locked_until = tonumber(state[1] or '0')
if locked_until > now then
  return {'locked', locked_until}
end
local failures = tonumber(state[2] or '0')
local failures_max = tonumber(ARGV[3])
if op == 'check' then
  return {'open', failures_max - failures}
end
failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if failures >= failures_max then
  local until_ms = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], 'locked_until_ms', until_ms)
  redis.call('HDEL', KEYS[1], 'failures')
  return {'locked', until_ms}
end
return {'open', failures_max - failures}
