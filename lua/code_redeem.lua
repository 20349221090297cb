-- The fast path of a redemption: the user's failure limit, the batch (issued, not revoked,
-- inside its window), then SET NX of the code's redeemed marker with the user id. Redis is a
-- cache here: 'miss' sends the caller to the store, which loads the batch and calls again; the
-- store (the code's stream) decides who redeemed it, whatever the marker says.
-- KEYS[1] ranges (sorted set: batch id scored by its first serial)
-- KEYS[2] batches (hash: batch id -> "first count issued points from_ms until_ms revoked version")
-- KEYS[3] the user's failures (hash: started_ms, failures; the window follows the application
-- clock, the Redis TTL only reclaims memory)
-- KEYS[4] the code's redeemed marker
-- ARGV[1] serial, ARGV[2] user id, ARGV[3] now (ms, application clock), ARGV[4] failures max,
-- ARGV[5] how long the marker outlives the window (ms), ARGV[6] the user's forged attempts the
-- calling process counted in memory since its last call (added to the counter first),
-- ARGV[7] the failure window (ms)
-- Returns {'limited', retry after ms} | {'miss'} | {'revoked', batch} |
--         {'window', batch, from ms, until ms} | {'first'|'mine', batch, points} |
--         {'taken', batch, points, holder}
local now, window = tonumber(ARGV[3]), tonumber(ARGV[7])
local counted = redis.call('HMGET', KEYS[3], 'started_ms', 'failures')
local started, failures = tonumber(counted[1] or '0'), tonumber(counted[2] or '0')
if now >= started + window then
  started, failures = now, 0
end
local forged = tonumber(ARGV[6])
if forged > 0 then
  failures = failures + forged
  redis.call('HSET', KEYS[3], 'started_ms', started, 'failures', failures)
  redis.call('PEXPIRE', KEYS[3], window * 2)
end
if failures >= tonumber(ARGV[4]) then
  return {'limited', tostring(started + window - now)}
end
local serial = tonumber(ARGV[1])
local found = redis.call('ZREVRANGEBYSCORE', KEYS[1], serial, '-inf', 'LIMIT', 0, 1)
if #found == 0 then
  return {'miss'}
end
local batch = found[1]
local packed = redis.call('HGET', KEYS[2], batch)
if not packed then
  return {'miss'}
end
local f = {}
for field in string.gmatch(packed, '[^ ]+') do
  f[#f + 1] = field
end
local first, issued = tonumber(f[1]), tonumber(f[3])
-- Beyond what Redis knows to be issued (a newer page, another batch): ask the store.
if serial >= first + issued then
  return {'miss'}
end
if f[7] == '1' then
  return {'revoked', batch}
end
local from_ms, until_ms = tonumber(f[5]), tonumber(f[6])
if now < from_ms or now >= until_ms then
  return {'window', batch, f[5], f[6]}
end
local keep = math.max(until_ms - now, 0) + tonumber(ARGV[5])
if redis.call('SET', KEYS[4], ARGV[2], 'NX', 'PX', keep) then
  return {'first', batch, f[4]}
end
local holder = redis.call('GET', KEYS[4])
if holder == ARGV[2] then
  return {'mine', batch, f[4]}
end
return {'taken', batch, f[4], holder}
