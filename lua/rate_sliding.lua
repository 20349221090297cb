-- A sliding window: at most ARGV[1] requests in any ARGV[2] ms, whatever the boundaries. Each
-- admitted request is one member of a sorted set scored by its time (the application clock, so
-- tests can move it); members older than the window are dropped first. A refused request adds
-- nothing, so the set never holds more than ARGV[1] members. A fixed window per calendar minute
-- let twice the limit through across a boundary; this cannot.
-- KEYS[1] the scope's set; ARGV[1] most per window, ARGV[2] window (ms), ARGV[3] now (ms)
-- Returns 0 when admitted, else the time (ms) at which the oldest request leaves the window.
local max = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if count >= max then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tonumber(oldest[2]) + window
end
-- Members are the time and a sequence: two requests in one millisecond are two members.
local sequence = count
while redis.call('ZADD', KEYS[1], 'NX', now, now .. ':' .. sequence) == 0 do
  sequence = sequence + 1
end
redis.call('PEXPIRE', KEYS[1], window)
return 0
