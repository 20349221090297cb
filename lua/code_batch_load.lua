-- Put a batch's state into Redis from the store, unless Redis already holds a newer version of
-- it (two loaders racing, or a page issued meanwhile, can never move it backwards). The caller
-- then adds the batch's first serial to the ranges (another slot of a cluster; ZADD repeats
-- safely).
-- KEYS[1] the batch's state (string; see code_redeem.lua)
-- ARGV[1] packed fields (the last one is the version), ARGV[2] version
-- Returns 1 when loaded, 0 when Redis held the same or a newer version.
local packed = redis.call('GET', KEYS[1])
if packed then
  local held = tonumber(string.match(packed, '(%d+)$'))
  if held and held >= tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
