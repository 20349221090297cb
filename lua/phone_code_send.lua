-- Record a freshly generated login code for one phone, if the send limits allow it.
-- KEYS[1] the phone's code state (hash)
-- ARGV[1] now (ms, application clock), ARGV[2] day number (application's calendar day),
-- ARGV[3] digest of the new code, ARGV[4] code ttl (ms), ARGV[5] min interval between sends (ms),
-- ARGV[6] sends per day max, ARGV[7] safety ttl of the hash (ms, Redis clock)
-- Returns {status, at_ms}:
--   {'sent', code expires at}, {'locked', locked until}, {'too_soon', next send allowed at},
--   {'daily_limit', 0} (the application knows when its day ends).
-- Wrong-code failures are NOT reset by a new code: sending again never buys more guesses.
local now = tonumber(ARGV[1])
local state = redis.call('HMGET', KEYS[1], 'locked_until_ms', 'last_sent_at_ms', 'day', 'day_count')
local locked_until = tonumber(state[1] or '0')
if locked_until > now then
  return {'locked', locked_until}
end
if state[2] then
  local next_send = tonumber(state[2]) + tonumber(ARGV[5])
  if now < next_send then
    return {'too_soon', next_send}
  end
end
local sent_today = 0
if state[3] == ARGV[2] then
  sent_today = tonumber(state[4] or '0')
end
if sent_today >= tonumber(ARGV[6]) then
  return {'daily_limit', 0}
end
local expires_at = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1],
  'code_digest', ARGV[3], 'code_expires_at_ms', expires_at,
  'last_sent_at_ms', now, 'day', ARGV[2], 'day_count', sent_today + 1)
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return {'sent', expires_at}
