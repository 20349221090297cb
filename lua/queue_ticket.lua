-- Allocate the queue score of a new task: later than every score allocated before, and derived
-- from the time so that it stays later than them even after Redis lost the last one (FLUSHALL):
-- score = max((now - epoch) * per_ms, last + spacing). With per_ms = 4096 and times until 2059
-- the score stays below 2^52, exact in a Lua number and in Redis's double scores.
-- KEYS[1] the last allocated score
-- ARGV[1] now (ms, application clock), ARGV[2] epoch (ms), ARGV[3] scores per ms,
-- ARGV[4] least spacing between two scores (room for prioritised tasks in between)
-- Returns the score.
local base = (tonumber(ARGV[1]) - tonumber(ARGV[2])) * tonumber(ARGV[3])
local last = redis.call('GET', KEYS[1])
local score = base
if last then
  score = math.max(base, tonumber(last) + tonumber(ARGV[4]))
end
redis.call('SET', KEYS[1], string.format('%d', score))
return string.format('%d', score)
