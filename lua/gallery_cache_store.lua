-- Store a rebuilt gallery value, unless it was forgotten (`gallery_cache_forget.lua`) after its
-- rebuild began: what the rebuild read may predate the change (a hide), and storing it would
-- bring the change back for the value's whole lifetime.
--
-- KEYS[1]: the cached value. ARGV[1]: its text; ARGV[2]: how long Redis keeps it (ms);
-- ARGV[3]: when the rebuild began (ms, Redis's TIME).
-- Returns 1 when stored, 0 when forgotten meanwhile.
local current = redis.call('GET', KEYS[1])
if current then
  local ok, decoded = pcall(cjson.decode, current)
  if ok and type(decoded) == 'table' and decoded.forgotten_at_ms ~= nil
      and tonumber(decoded.forgotten_at_ms) >= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
