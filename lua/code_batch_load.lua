-- Put a batch into Redis from the store, unless Redis already holds a newer version of it (two
-- loaders racing, or a page issued meanwhile, can never move it backwards).
-- KEYS[1] ranges (sorted set), KEYS[2] batches (hash); see code_redeem.lua
-- ARGV[1] batch id, ARGV[2] first serial, ARGV[3] packed fields (the last one is the version),
-- ARGV[4] version
-- Returns 1 when loaded, 0 when Redis held the same or a newer version.
local packed = redis.call('HGET', KEYS[2], ARGV[1])
if packed then
  local held = tonumber(string.match(packed, '(%d+)$'))
  if held and held >= tonumber(ARGV[4]) then
    return 0
  end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
