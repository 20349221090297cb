-- Redis's time (ms) on the node that holds KEYS[1], a cached gallery value: when a rebuild
-- begins, on the clock that value's tombstones are stamped with (`gallery_cache_forget.lua`).
local now = redis.call('TIME')
return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
