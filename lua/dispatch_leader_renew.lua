-- Extend our leader lease; never take it back once it is gone (a new acquisition needs a new
-- fencing token, so that writes of the old term stay refusable).
-- KEYS[1] leader lease, ARGV[1] our value, ARGV[2] lease (ms)
-- Returns 1 when extended, 0 when the lease is no longer ours (expired, taken, flushed).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
