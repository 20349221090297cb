-- The dispatcher leader's filler, in one step: free the slot leases of prompts that ended, then
-- take queued tasks onto the free slots of the servers that offer their models, then stage tasks
-- ahead (one per server per round, up to the depth), each staged task holding a slot lease
-- beyond the capacity.
-- KEYS[1] leader lease, KEYS[2] queue (task id -> score), KEYS[3] queued tasks' models (hash:
--   task id -> checkpoint), KEYS[4] held servers (set of names: drained, nothing new goes
--   there, whatever the caller thinks), KEYS[5..] each server's slots (task id -> lease expiry,
--   ms of Redis time), in the saga's order
-- ARGV[1] our leader value, ARGV[2] slot lease (ms), ARGV[3] staging depth,
-- ARGV[4] queue entries to look at, at most, ARGV[5] prefer the model a server ran last
--   ('1'|'0'), ARGV[6] how far a free server looks ahead for a task of the model it ran last
--   (entries it could run), ARGV[7] a task queued this long (ms) is never passed over for that,
--   ARGV[8] the score epoch (ms), ARGV[9] scores per ms (a score says when its task was queued),
-- ARGV[10] R releases, then R pairs (server number from 1, task id),
-- then per server: its name, capacity (-1: claim nothing there), busy, staged: the prompts the caller
--   knows to be posted and staged there (floors: after a flush the set may be empty while
--   prompts still run), the model it ran last ('' none), M (-1: any model), then M models
-- Returns {'not-leader'} | {'ok', the queue ran dry for a server that could still take a task
--   ('1'|'0'), then per claim: server number,
--   task id, score}, all strings, in claim order.
-- Tasks are taken in queue order; a task no server with room offers its model is passed over
-- and stays queued in its place (a later task for another model may go first: a free GPU does
-- not wait for a model it lacks). A task whose model is unknown (not in KEYS[3]) may go anywhere.
-- With the preference, a server with room first takes the first task of the model it ran last
-- within its look-ahead (a model switch costs a real GPU seconds to minutes), passing over only
-- tasks queued for less than the wait bound; then each task goes, in order, to the server that
-- ran its model last among those that could take it.
-- Busy slots are the unexpired leases: a dispatcher that dies stops renewing, its leases run
-- out, and the slots come back by themselves. Time is Redis's (TIME), one clock for every process.
local servers = #KEYS - 4
local cursor = 11
-- A release is ours to make whoever leads: the lease belongs to a prompt that ended.
for _ = 1, tonumber(ARGV[10]) do
  redis.call('ZREM', KEYS[4 + tonumber(ARGV[cursor])], ARGV[cursor + 1])
  cursor = cursor + 2
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {'not-leader'}
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local lease_until = now + tonumber(ARGV[2])
local depth = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local prefer = ARGV[5] == '1'
local affinity_window = tonumber(ARGV[6])
local affinity_wait_max = tonumber(ARGV[7])
local score_epoch = tonumber(ARGV[8])
local scores_per_ms = tonumber(ARGV[9])
local capacity, busy, staged, live, last, offers = {}, {}, {}, {}, {}, {}
for server = 1, servers do
  capacity[server] = tonumber(ARGV[cursor + 1])
  if redis.call('SISMEMBER', KEYS[4], ARGV[cursor]) == 1 then
    capacity[server] = -1
  end
  busy[server] = tonumber(ARGV[cursor + 2])
  staged[server] = tonumber(ARGV[cursor + 3])
  last[server] = ARGV[cursor + 4]
  local models = tonumber(ARGV[cursor + 5])
  cursor = cursor + 6
  if models >= 0 then
    offers[server] = {}
    for index = 0, models - 1 do
      offers[server][ARGV[cursor + index]] = true
    end
    cursor = cursor + models
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[4 + server], '-inf', now)
  live[server] = redis.call('ZCARD', KEYS[4 + server])
end
local function taken(server)
  return math.max(live[server], busy[server] + staged[server])
end
local function offered(server, model)
  return not model or not offers[server] or offers[server][model]
end
-- The queue's head, read a page at a time as far as it is needed (each entry with its model);
-- entries are taken out as they are claimed.
local page = 32
local entries = {}
local whole_queue = false
local function read_more()
  if whole_queue or #entries >= window then
    return false
  end
  local from = #entries
  local count = math.min(page, window - from)
  local slice = redis.call('ZRANGE', KEYS[2], from, from + count - 1, 'WITHSCORES')
  if #slice < count * 2 then
    whole_queue = true
  end
  if #slice == 0 then
    return false
  end
  local members = {}
  for index = 1, #slice, 2 do
    members[#members + 1] = slice[index]
  end
  local models = redis.call('HMGET', KEYS[3], unpack(members))
  for index = 1, #members do
    entries[#entries + 1] = {
      member = members[index], score = slice[index * 2], model = models[index] or false
    }
  end
  return true
end
local answer = {'ok', '0'}
-- The server for `entry` among those `fits` allows: the one that ran its model last when
-- preferred, else the first.
local function choose(entry, fits)
  local first = nil
  for server = 1, servers do
    if capacity[server] >= 0 and fits(server) and offered(server, entry.model) then
      if not prefer or not entry.model or last[server] == entry.model then
        return server
      end
      first = first or server
    end
  end
  return first
end
local function claim(entry, server)
  redis.call('ZREM', KEYS[2], entry.member)
  redis.call('ZADD', KEYS[4 + server], lease_until, entry.member)
  live[server] = live[server] + 1
  if entry.model then
    last[server] = entry.model
  end
  entry.claimed = true
  answer[#answer + 1] = tostring(server)
  answer[#answer + 1] = entry.member
  answer[#answer + 1] = entry.score
end
-- Go through the queue in order while some server `fits`, giving each entry a server.
local function assign(fits, claimed)
  local index = 1
  while true do
    local open = false
    for server = 1, servers do
      open = open or (capacity[server] >= 0 and fits(server))
    end
    if not open then
      return
    end
    if index > #entries and not read_more() then
      -- A server could still take a task and none is left that it could take.
      answer[2] = '1'
      return
    end
    local entry = entries[index]
    if not entry.claimed then
      local server = choose(entry, fits)
      if server then
        claim(entry, server)
        claimed(server)
      end
    end
    index = index + 1
  end
end
-- With the preference: each server that `fits` takes the first task of the model it ran last
-- within its look-ahead, passing over only tasks that have not waited their bound.
local function affine(fits, claimed)
  if not prefer then
    return
  end
  for server = 1, servers do
    while capacity[server] >= 0 and last[server] ~= '' and fits(server) do
      local index, seen, found = 1, 0, nil
      while seen < affinity_window do
        if index > #entries and not read_more() then
          break
        end
        local entry = entries[index]
        if not entry.claimed and offered(server, entry.model) then
          seen = seen + 1
          if entry.model == last[server] then
            found = entry
            break
          end
          local queued_at = score_epoch + tonumber(entry.score) / scores_per_ms
          if now - queued_at >= affinity_wait_max then
            break
          end
        end
        index = index + 1
      end
      if not found then
        break
      end
      claim(found, server)
      claimed(server)
    end
  end
end
-- Free slots everywhere before anything is staged behind a busy server.
local function has_room(server) return taken(server) < capacity[server] end
local function took_slot(server) busy[server] = busy[server] + 1 end
affine(has_room, took_slot)
assign(has_room, took_slot)
for round = 0, depth - 1 do
  local function may_stage(server)
    return staged[server] <= round and taken(server) < capacity[server] + depth
  end
  local function staged_one(server) staged[server] = staged[server] + 1 end
  affine(may_stage, staged_one)
  assign(may_stage, staged_one)
end
return answer
