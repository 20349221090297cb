-- Revoke every session of one user (password or role changed).
-- KEYS[1] set of the user's session keys.
-- The members are full key names written by session_create.lua (the application named them
-- under its prefix); this script reads them, it does not build names. Not cluster-safe by design:
-- zhihui uses one Redis (or a primary with replicas), never a cluster.
local sessions = redis.call('SMEMBERS', KEYS[1])
for _, session in ipairs(sessions) do
  redis.call('DEL', session)
end
redis.call('DEL', KEYS[1])
return #sessions
