-- One pair's membership (a like, a follow) applied to a sorted set, gated by the pair stream's
-- version: an event applied again, or after a later one, changes nothing. The request that
-- appended the event and the gallery worker that follows the log may both apply it, in any order.
-- KEYS[1] the sorted set, KEYS[2] the hash of versions applied (both under one tag).
-- ARGV[1] member, ARGV[2] its stream version, ARGV[3] 'add' or 'rem', ARGV[4] score (ms).
-- Answers the set's size after it.
local seen = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '-1')
local version = tonumber(ARGV[2])
if version > seen then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  if ARGV[3] == 'add' then
    redis.call('ZADD', KEYS[1], ARGV[4], ARGV[1])
  else
    redis.call('ZREM', KEYS[1], ARGV[1])
  end
end
return redis.call('ZCARD', KEYS[1])
