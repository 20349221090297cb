-- Revoke one session (logout).
-- KEYS[1] session hash, KEYS[2] set of the user's session keys
-- Returns 1 when a session was revoked, 0 when it did not exist.
redis.call('SREM', KEYS[2], KEYS[1])
return redis.call('DEL', KEYS[1])
