-- The leader renews the slot leases of the prompts it has in flight on one backend (and puts
-- back any that Redis lost), if it is still the leader.
-- KEYS[1] leader lease, KEYS[2] the backend's slots
-- ARGV[1] our leader value, ARGV[2] slot lease (ms), ARGV[3..] task ids
-- Returns 1, or 0 when we are not the leader (nothing changed).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local time = redis.call('TIME')
local expiry = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + tonumber(ARGV[2])
for index = 3, #ARGV do
  redis.call('ZADD', KEYS[2], expiry, ARGV[index])
end
return 1
