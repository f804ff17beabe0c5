-- Set fields on a job record only while it exists: a late writer (a webhook delivery after the
-- record's TTL ran out) must not recreate it as a partial hash without a TTL.
-- KEYS[1] job hash   ARGV field, value, ...   Returns 1 when written.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
