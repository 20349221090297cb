-- The dispatcher leader's filler, in one step: free the slot leases of prompts that ended, then
-- take queued tasks onto the free slots of every server, then stage tasks ahead (one per server
-- per round, up to the depth), each staged task holding a slot lease beyond the capacity.
-- KEYS[1] leader lease, KEYS[2] queue (task id -> score), KEYS[3..] each server's slots
--   (task id -> lease expiry, ms of Redis time), in the configuration's order
-- ARGV[1] our leader value, ARGV[2] slot lease (ms), ARGV[3] staging depth,
-- ARGV[4] R releases, then R pairs (server number from 1, task id),
-- then per server: capacity (-1: claim nothing there), busy, staged: the prompts the caller
--   knows to be posted and staged there (floors: after a flush the set may be empty while
--   prompts still run)
-- Returns {'not-leader'} | {'ok', queue ran dry ('1'|'0'), then per claim: server number,
--   task id, score}, all strings, in claim order.
-- Busy slots are the unexpired leases: a dispatcher that dies stops renewing, its leases run
-- out, and the slots come back by themselves. Time is Redis's (TIME), one clock for every process.
local servers = #KEYS - 2
local cursor = 5
-- A release is ours to make whoever leads: the lease belongs to a prompt that ended.
for _ = 1, tonumber(ARGV[4]) do
  redis.call('ZREM', KEYS[2 + tonumber(ARGV[cursor])], ARGV[cursor + 1])
  cursor = cursor + 2
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {'not-leader'}
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local lease_until = now + tonumber(ARGV[2])
local depth = tonumber(ARGV[3])
local capacity, busy, staged, live = {}, {}, {}, {}
for server = 1, servers do
  capacity[server] = tonumber(ARGV[cursor])
  busy[server] = tonumber(ARGV[cursor + 1])
  staged[server] = tonumber(ARGV[cursor + 2])
  cursor = cursor + 3
  redis.call('ZREMRANGEBYSCORE', KEYS[2 + server], '-inf', now)
  live[server] = redis.call('ZCARD', KEYS[2 + server])
end
local answer = {'ok', '0'}
local function take(server)
  local popped = redis.call('ZPOPMIN', KEYS[2])
  if #popped == 0 then
    answer[2] = '1'
    return false
  end
  redis.call('ZADD', KEYS[2 + server], lease_until, popped[1])
  live[server] = live[server] + 1
  answer[#answer + 1] = tostring(server)
  answer[#answer + 1] = popped[1]
  answer[#answer + 1] = popped[2]
  return true
end
local function taken(server)
  return math.max(live[server], busy[server] + staged[server])
end
-- Free slots everywhere before anything is staged behind a busy server.
for server = 1, servers do
  while capacity[server] >= 0 and taken(server) < capacity[server] do
    if not take(server) then
      return answer
    end
    busy[server] = busy[server] + 1
  end
end
for round = 0, depth - 1 do
  for server = 1, servers do
    if capacity[server] >= 0 and staged[server] <= round
        and taken(server) < capacity[server] + depth then
      if not take(server) then
        return answer
      end
      staged[server] = staged[server] + 1
    end
  end
end
return answer
