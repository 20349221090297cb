-- Forget a cached gallery value: a tombstone instead of the value, stamped with Redis's own time
-- (one clock that every process shares), so that a rebuild that began before it cannot store
-- what it read before the change (`gallery_cache_store.lua`). A reader takes the tombstone for a
-- miss and rebuilds.
--
-- KEYS[1]: the cached value. ARGV[1]: how long the tombstone stays (ms), longer than any rebuild.
-- Returns the tombstone's time (ms).
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('SET', KEYS[1], cjson.encode({ forgotten_at_ms = ms }), 'PX', ARGV[1])
return ms
