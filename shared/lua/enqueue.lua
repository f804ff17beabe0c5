-- Atomically record a job and queue it (one round trip, one slot: all keys share the model tag).
-- KEYS[1] job hash   KEYS[2] queue stream   KEYS[3] idempotency key (optional)
-- ARGV[1] job id     ARGV[2] idempotency TTL (s)   ARGV[3..] job hash field, value, ...
-- Returns the job id that owns the request: ours, or the earlier one for a repeated key.
if #KEYS == 3 then
  local existing = redis.call('GET', KEYS[3])
  if existing then return existing end
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
return ARGV[1]
