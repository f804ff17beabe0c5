-- Set fields on a hash (a job record) only while it exists: a late writer (a webhook delivery
-- after the record's TTL ran out) must not recreate it as a partial hash without a TTL.
-- Slots: shared/scripts.py, SET_IF_EXISTS and set_if_exists(): field, value, ... in ARGV.
-- Returns 1 when written.
local hash = KEYS[1]
if redis.call('EXISTS', hash) == 0 then return 0 end
redis.call('HSET', hash, unpack(ARGV, 1))
return 1
