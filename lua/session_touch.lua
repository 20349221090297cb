-- Use a session: valid while now < expires_at_ms; each use slides the expiry forward.
-- KEYS[1] session hash, KEYS[2] set of the user's session keys
-- ARGV[1] now (ms), ARGV[2] idle ttl (ms), ARGV[3] safety ttl (ms, Redis clock)
-- Returns {user_id, role, expires_at_ms} or nil (unknown, revoked or expired; an expired session
-- is deleted here so it can never come back).
local fields = redis.call('HMGET', KEYS[1], 'user_id', 'role', 'expires_at_ms')
if not fields[1] then
  return nil
end
local now = tonumber(ARGV[1])
if now >= tonumber(fields[3]) then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], KEYS[1])
  return nil
end
local expires_at = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'expires_at_ms', expires_at)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {fields[1], fields[2], expires_at}
