-- Check a login code for one phone. A right code is used up; the failures-max-th wrong code in a
-- row locks the phone and voids its code.
-- KEYS[1] the phone's code state (hash)
-- ARGV[1] now (ms, application clock), ARGV[2] digest of the submitted code,
-- ARGV[3] wrong codes before the lock, ARGV[4] lock duration (ms), ARGV[5] safety ttl (ms)
-- Returns {status, n}:
--   {'ok', 0}, {'locked', locked until}, {'expired', 0} (no code, or past its expiry),
--   {'wrong', attempts left before the lock}
local now = tonumber(ARGV[1])
local state = redis.call('HMGET', KEYS[1], 'locked_until_ms', 'code_digest', 'code_expires_at_ms')
local locked_until = tonumber(state[1] or '0')
if locked_until > now then
  return {'locked', locked_until}
end
if not state[2] or now >= tonumber(state[3]) then
  return {'expired', 0}
end
if state[2] ~= ARGV[2] then
  local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  local failures_max = tonumber(ARGV[3])
  if failures >= failures_max then
    local until_ms = now + tonumber(ARGV[4])
    redis.call('HSET', KEYS[1], 'locked_until_ms', until_ms)
    redis.call('HDEL', KEYS[1], 'failures', 'code_digest', 'code_expires_at_ms')
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
    return {'locked', until_ms}
  end
  return {'wrong', failures_max - failures}
end
redis.call('HDEL', KEYS[1], 'failures', 'code_digest', 'code_expires_at_ms')
return {'ok', 0}
