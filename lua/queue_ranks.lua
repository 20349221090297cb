-- The queue places of many tasks in one call (the user sockets of one process, after a queue
-- change: one call per change, however many sockets watch).
-- KEYS[1] the queue (sorted set); ARGV task ids
-- Returns one rank (0-based) per task, -1 for a task not in the queue.
local ranks = {}
for i = 1, #ARGV do
  local rank = redis.call('ZRANK', KEYS[1], ARGV[i])
  if rank then
    ranks[i] = rank
  else
    ranks[i] = -1
  end
end
return ranks
