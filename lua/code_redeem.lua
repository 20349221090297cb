-- A redemption's fast path, once the user's limit passed (code_limit.lua) and the serial's batch
-- was found in the ranges: the batch (issued, not revoked, inside its window), then SET NX of
-- the code's redeemed marker with the user id. Redis is a cache here: 'miss' sends the caller to
-- the store, which loads the batch and calls again; the store (the code's stream) decides who
-- redeemed it, whatever the marker says.
-- KEYS[1] the batch's state (string: "first count issued points from_ms until_ms revoked
-- version"), KEYS[2] the code's redeemed marker; both under the batch's hash tag
-- ARGV[1] serial, ARGV[2] user id, ARGV[3] now (ms, application clock), ARGV[4] how long the
-- marker outlives the window (ms), ARGV[5] the batch id (echoed in the answer)
-- Returns {'miss'} | {'revoked', batch} | {'window', batch, from ms, until ms} |
--         {'first'|'mine', batch, points} | {'taken', batch, points, holder}
local now = tonumber(ARGV[3])
local serial = tonumber(ARGV[1])
local batch = ARGV[5]
local packed = redis.call('GET', KEYS[1])
if not packed then
  return {'miss'}
end
local f = {}
for field in string.gmatch(packed, '[^ ]+') do
  f[#f + 1] = field
end
local first, issued = tonumber(f[1]), tonumber(f[3])
-- Outside what Redis knows to be issued (a newer page, another batch): ask the store.
if serial < first or serial >= first + issued then
  return {'miss'}
end
if f[7] == '1' then
  return {'revoked', batch}
end
local from_ms, until_ms = tonumber(f[5]), tonumber(f[6])
if now < from_ms or now >= until_ms then
  return {'window', batch, f[5], f[6]}
end
local keep = math.max(until_ms - now, 0) + tonumber(ARGV[4])
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', keep) then
  return {'first', batch, f[4]}
end
local holder = redis.call('GET', KEYS[2])
if holder == ARGV[2] then
  return {'mine', batch, f[4]}
end
return {'taken', batch, f[4], holder}
