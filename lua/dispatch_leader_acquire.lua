-- Become (or stay) the dispatcher leader: take the lease if nobody holds it, or extend it if we do.
-- KEYS[1] leader lease (string: "<instance>:<fencing token>")
-- ARGV[1] our value, ARGV[2] lease (ms)
-- Returns 1 when we hold the lease now, 0 when someone else does.
-- The lease expires by Redis's own clock (PX): whoever holds it must renew it in time.
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if current then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
