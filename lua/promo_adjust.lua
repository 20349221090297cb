-- Change a promotion Redis holds (nothing when it does not: the next claim loads it).
-- KEYS[1] promo:<id> (hash), KEYS[2] promo:<id>:users (set)
-- ARGV[1] 'release' (a refused claim's unit back; ARGV[2] the user, released only if still
-- marked, so a repeat releases nothing), 'forget' (a claim turned away as sold out: the user
-- unmarked, the unit kept taken), 'raise' (ARGV[2] units more) or 'end' (ARGV[2] ended at, ms).
-- Returns 1 when changed, 0 otherwise.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if ARGV[1] == 'release' then
  if redis.call('SREM', KEYS[2], ARGV[2]) == 1 then
    redis.call('HINCRBY', KEYS[1], 'left', 1)
    return 1
  end
  return 0
elseif ARGV[1] == 'forget' then
  return redis.call('SREM', KEYS[2], ARGV[2])
elseif ARGV[1] == 'raise' then
  redis.call('HINCRBY', KEYS[1], 'left', ARGV[2])
  return 1
elseif ARGV[1] == 'end' then
  redis.call('HSET', KEYS[1], 'ended_ms', ARGV[2])
  return 1
end
return redis.error_reply('promo_adjust: unknown operation ' .. tostring(ARGV[1]))
