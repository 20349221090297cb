-- The flash-sale gate: the window, the one-per-user check and the stock decrement of one claim,
-- and the claim appended to the claims stream, in one step.
-- KEYS[1] promo:<id> (hash: left, starts_ms, ends_ms, ended_ms), KEYS[2] promo:<id>:users (set),
-- KEYS[3] promo:claims (stream)
-- ARGV[1] user id, ARGV[2] claim id, ARGV[3] now (ms), ARGV[4] promotion id,
-- ARGV[5] stream length kept (approximate; acknowledged entries are trimmed first)
-- Returns {'miss'} when Redis does not hold the promotion (load it from the store and retry),
-- {'not-open', starts_ms, ends_ms, ended_ms}, {'already-claimed'}, {'sold-out'},
-- or {'ok', entry id}.
local fields = redis.call('HMGET', KEYS[1], 'left', 'starts_ms', 'ends_ms', 'ended_ms')
if not fields[1] then
  return {'miss'}
end
local left = tonumber(fields[1])
local starts = tonumber(fields[2])
local ends = tonumber(fields[3])
local ended = tonumber(fields[4])
local now = tonumber(ARGV[3])
if now < starts or now >= ends or (ended > 0 and now >= ended) then
  return {'not-open', fields[2], fields[3], fields[4]}
end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  return {'already-claimed'}
end
if left <= 0 then
  return {'sold-out'}
end
redis.call('HINCRBY', KEYS[1], 'left', -1)
redis.call('SADD', KEYS[2], ARGV[1])
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*',
  'claim', ARGV[2], 'promotion', ARGV[4], 'user', ARGV[1], 'at', ARGV[3])
return {'ok', id}
