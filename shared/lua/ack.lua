-- Ack and delete one delivered queue entry together (no PEL leak), atomically: a script rather
-- than MULTI because redis-py's Cluster pipeline cannot run MULTI (one key: legal on Cluster).
-- KEYS[1] the queue stream   ARGV[1] the entry id
-- Returns the number of entries deleted (0 or 1).
redis.call('XACK', KEYS[1], 'workers', ARGV[1])
return redis.call('XDEL', KEYS[1], ARGV[1])
