-- Put a promotion into Redis from the store, unless Redis holds it already (a loader racing
-- another, or claims accepted meanwhile, are never overwritten).
-- KEYS[1] promo:<id> (hash), KEYS[2] promo:<id>:users (set)
-- ARGV[1] units left, ARGV[2] starts (ms), ARGV[3] ends (ms), ARGV[4] ended (ms, 0: not ended),
-- ARGV[5] keep (ms), ARGV[6..] the users holding a claim (reserved or granted)
-- Returns 1 when loaded, 0 when Redis held it.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('DEL', KEYS[2])
local batch = {}
for index = 6, #ARGV do
  batch[#batch + 1] = ARGV[index]
  if #batch == 1000 then
    redis.call('SADD', KEYS[2], unpack(batch))
    batch = {}
  end
end
if #batch > 0 then
  redis.call('SADD', KEYS[2], unpack(batch))
end
redis.call('HSET', KEYS[1], 'left', ARGV[1], 'starts_ms', ARGV[2], 'ends_ms', ARGV[3],
  'ended_ms', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if #ARGV >= 6 then
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
return 1
