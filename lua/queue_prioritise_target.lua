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
local front_step = tonumber(ARGV[3])
-- The full jump almost always has room (scores are spaced apart): read only the two scores it
-- goes between (a third of the Redis time of reading the whole range).
local target = rank - jump
if target == 0 then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {rank, string.format('%d', tonumber(first[2]) - front_step), jump}
end
local pair = redis.call('ZRANGE', KEYS[1], target - 1, target, 'WITHSCORES')
local before, behind = tonumber(pair[2]), tonumber(pair[4])
if behind - before >= 2 then
  return {rank, string.format('%d', before + math.floor((behind - before) / 2)), jump}
end
-- No integer there: fewer places, the nearest to the full jump that has one. Scores of the tasks
-- from rank - jump to rank - 1.
local ahead = redis.call('ZRANGE', KEYS[1], target, rank - 1, 'WITHSCORES')
local function score_at(r)
  return tonumber(ahead[(r - target) * 2 + 2])
end
for places = jump - 1, 1, -1 do
  local at = rank - places
  local gap_behind, gap_before = score_at(at), score_at(at - 1)
  if gap_behind - gap_before >= 2 then
    return {rank, string.format('%d', gap_before + math.floor((gap_behind - gap_before) / 2)), places}
  end
end
return {-2}
