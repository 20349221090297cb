-- Create a bearer-token session, unless the user's sessions were revoked after the login began.
-- KEYS[1] session hash (named by the token's digest), KEYS[2] set of the user's session keys,
-- KEYS[3] the user's last revocation epoch (sessions_revoke_user.lua)
-- ARGV[1] user id, ARGV[2] role, ARGV[3] now (ms, application clock), ARGV[4] idle ttl (ms),
-- ARGV[5] safety ttl (ms, Redis clock): Redis drops the keys after this even if nobody looks,
-- ARGV[6] the credentials epoch read when the login began.
-- A password or role change revokes every session and records the epoch it took: a login that
-- began before it (and may have checked the old password) gets no session: returns -1.
-- The logical expiry (expires_at_ms) is checked against the application clock by
-- session_touch.lua; the Redis TTL only reclaims memory and is always longer.
local revoked = tonumber(redis.call('GET', KEYS[3]) or '0')
if revoked > tonumber(ARGV[6]) then
  return -1
end
local expires_at = tonumber(ARGV[3]) + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'user_id', ARGV[1], 'role', ARGV[2], 'expires_at_ms', expires_at)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('SADD', KEYS[2], KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return expires_at
