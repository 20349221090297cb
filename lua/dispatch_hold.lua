-- Rewrite the held servers (drained: the filler claims nothing for them) from one version of the
-- pool, unless a later version was written already: a reader that read the pool before a drain
-- must not undo the drain's own write.
-- KEYS[1] held servers (set of names), KEYS[2] the pool version they were written from
-- ARGV[1] this pool version (events folded), ARGV[2..] the held names
-- Returns 1 when written, 0 when a later version stands.
local written = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[1]) < written then
  return 0
end
redis.call('DEL', KEYS[1])
if #ARGV > 1 then
  redis.call('SADD', KEYS[1], unpack(ARGV, 2))
end
redis.call('SET', KEYS[2], ARGV[1])
return 1
