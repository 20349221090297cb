-- Revoke every session of one user (password or role changed).
-- KEYS[1] set of the user's session keys, KEYS[2] the global credentials epoch, KEYS[3] the
-- user's last revocation epoch; ARGV[1] how long to remember it (ms: longer than any login).
-- The members are full key names written by session_create.lua (the application named them
-- under its prefix); this script reads them, it does not build names. Not cluster-safe by design:
-- zhihui uses one Redis (or a primary with replicas), never a cluster.
-- The epoch orders revocations against logins without clocks: a login reads the global epoch
-- first, and session_create.lua refuses it when this user was revoked at a later epoch.
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[3], epoch, 'PX', ARGV[1])
local sessions = redis.call('SMEMBERS', KEYS[1])
for _, session in ipairs(sessions) do
  redis.call('DEL', session)
end
redis.call('DEL', KEYS[1])
return #sessions
