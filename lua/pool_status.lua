-- Replace the servers' published status whole: a server that was removed disappears with the rest.
-- KEYS[1] the status hash; ARGV name, status (JSON), name, status, ...
redis.call('DEL', KEYS[1])
for i = 1, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
