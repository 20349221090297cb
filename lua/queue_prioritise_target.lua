-- Where a prioritised task goes: ahead of up to `jump` tasks. Reads only; the move is applied
-- (ZADD XX) after it is recorded as an event. The new score lies strictly between the scores of
-- the two tasks it goes between (integer midpoint); at the front it is the first score minus
-- `front_step`. When two neighbours have no integer between them the task jumps fewer places.
-- KEYS[1] queue
-- ARGV[1] task id, ARGV[2] jump (places, at most), ARGV[3] front step
-- Returns {-1} not queued, {0} already first, {-2} no room, or {rank, new score, places}.
local rank = redis.call('ZRANK', KEYS[1], ARGV[1])
if not rank then
  return {-1}
end
if rank == 0 then
  return {0}
end
local jump = math.min(tonumber(ARGV[2]), rank)
-- Scores of the tasks from rank - jump - 1 (or 0) to rank - 1.
local first = math.max(rank - jump - 1, 0)
local ahead = redis.call('ZRANGE', KEYS[1], first, rank - 1, 'WITHSCORES')
local function score_at(r)
  return tonumber(ahead[(r - first) * 2 + 2])
end
for places = jump, 1, -1 do
  local target = rank - places
  local behind = score_at(target)
  if target == 0 then
    return {rank, string.format('%d', behind - tonumber(ARGV[3])), places}
  end
  local before = score_at(target - 1)
  if behind - before >= 2 then
    return {rank, string.format('%d', before + math.floor((behind - before) / 2)), places}
  end
end
return {-2}
