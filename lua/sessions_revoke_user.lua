-- Revoke every session of one user (password or role changed), after the caller took a new
-- credentials epoch (INCR of the global epoch key, a step of its own: that key lives in another
-- slot of a cluster).
-- KEYS[1] set of the user's session keys, KEYS[2] the user's last revocation epoch
-- ARGV[1] the epoch taken, ARGV[2] how long to remember it (ms: longer than any login).
-- The members are full key names written by session_create.lua (under the user's hash tag, so
-- in this script's slot); this script reads them, it does not build names.
-- The epoch orders revocations against logins without clocks: a login reads the global epoch
-- first, and session_create.lua refuses it when this user was revoked at a later epoch. Safe to
-- repeat: a later epoch never gives way to an earlier one.
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) > held then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end
local sessions = redis.call('SMEMBERS', KEYS[1])
for _, session in ipairs(sessions) do
  redis.call('DEL', session)
end
redis.call('DEL', KEYS[1])
return #sessions
