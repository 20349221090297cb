-- The leader takes the first queued task onto a free slot of one backend, in one step.
-- KEYS[1] leader lease, KEYS[2] queue (task id -> score), KEYS[3] the backend's slots
--   (task id -> lease expiry, ms of Redis time)
-- ARGV[1] our leader value, ARGV[2] the backend's capacity, ARGV[3] slot lease (ms),
-- ARGV[4] slots the caller knows to be busy (a floor: after a flush the set may be empty while
--   prompts still run)
-- Returns {'claimed', task id, score} | {'full'} | {'empty'} | {'not-leader'}.
-- Busy slots are the unexpired leases: a dispatcher that dies stops renewing, its leases run
-- out, and the slots come back by themselves. Time is Redis's (TIME), one clock for every process.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {'not-leader'}
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local busy = math.max(redis.call('ZCARD', KEYS[3]), tonumber(ARGV[4]))
if busy >= tonumber(ARGV[2]) then
  return {'full'}
end
local popped = redis.call('ZPOPMIN', KEYS[2])
if #popped == 0 then
  return {'empty'}
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), popped[1])
return {'claimed', popped[1], popped[2]}
