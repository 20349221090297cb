-- Replace the hot ranking in one step: readers see the old ranking or the new one, never a
-- half-written one. Built in KEYS[2] and renamed over KEYS[1]; an empty ranking deletes it.
-- KEYS[1] the ranking, KEYS[2] its scratch key (the gallery's hash tag);
-- ARGV score, work id, score, work id, ...
redis.call('DEL', KEYS[2])
if #ARGV == 0 then
  redis.call('DEL', KEYS[1])
  return 0
end
for i = 1, #ARGV, 2 do
  redis.call('ZADD', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('RENAME', KEYS[2], KEYS[1])
return #ARGV / 2
