-- Take the first task of the queue and lease it to a dispatcher until `now + lease`.
-- KEYS[1] queue, KEYS[2] leases
-- ARGV[1] now (ms), ARGV[2] lease (ms)
-- Returns {task id, score, lease expiry} or nil when the queue is empty.
local popped = redis.call('ZPOPMIN', KEYS[1])
if #popped == 0 then
  return nil
end
local expiry = tonumber(ARGV[1]) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], expiry, popped[1])
return {popped[1], popped[2], string.format('%d', expiry)}
