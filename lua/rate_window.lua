-- A counter per fixed window (admission limits: logins per client, code requests per client and
-- overall). The window is named by its start in the key, from the application clock, so the
-- rule follows one clock and tests can move it.
-- KEYS[1] the counter of this scope and window; ARGV[1] most per window, ARGV[2] safety ttl (ms)
-- Returns the count after this request, or -1 when the window is full (nothing counted).
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
if count >= tonumber(ARGV[1]) then
  return -1
end
count = redis.call('INCR', KEYS[1])
if count == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return count
