-- Give the leader lease up, if it is still ours, so another process takes over at once.
-- KEYS[1] leader lease, ARGV[1] our value
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
