-- Store a rebuilt inbox in place of the old one and mark it live, both for ARGV[1] ms.
-- KEYS[1] the inbox, KEYS[2] its live marker (the user's hash tag);
-- ARGV[1] idle ms, then work id, score, work id, score, ...
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], 1, 'PX', ARGV[1])
return (#ARGV - 1) / 2
