-- After a rebuild: make the score allocator continue after the highest restored score, so new
-- tasks queue behind the restored ones even if the clock went back.
-- KEYS[1] the last allocated score
-- ARGV[1] the highest restored score
local last = redis.call('GET', KEYS[1])
if not last or tonumber(last) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
