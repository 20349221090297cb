-- Record a running task's progress and let it expire (a crashed dispatcher leaves nothing behind).
-- KEYS[1] the task's progress hash
-- ARGV[1] value, ARGV[2] max, ARGV[3] time to live (ms)
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'max', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
