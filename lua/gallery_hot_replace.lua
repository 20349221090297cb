-- Replace the hot ranking in one step: readers see the old ranking or the new one, never a
-- half-written one. Built in KEYS[2] and renamed over KEYS[1]; an empty ranking deletes it.
-- The new ranking comes from the read model, which trails the lists: a work in the new list
-- (KEYS[3]) published at or after ARGV[1] (ms) that the old ranking has and the new one lacks
-- is one the read model has not reached yet, and keeps its place.
-- KEYS[1] the ranking, KEYS[2] its scratch key, KEYS[3] the new list (the gallery's hash tag);
-- ARGV[1] since (ms), then score, work id, score, work id, ...
redis.call('DEL', KEYS[2])
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[2], ARGV[i], ARGV[i + 1])
end
for _, member in ipairs(redis.call('ZRANGE', KEYS[3], ARGV[1], '+inf', 'BYSCORE')) do
  if not redis.call('ZSCORE', KEYS[2], member) then
    local kept = redis.call('ZSCORE', KEYS[1], member)
    if kept then
      redis.call('ZADD', KEYS[2], kept, member)
    end
  end
end
local ranked = redis.call('ZCARD', KEYS[2])
if ranked == 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('RENAME', KEYS[2], KEYS[1])
end
return ranked
