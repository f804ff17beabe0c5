-- Ack and delete one delivered queue entry together (no PEL leak), atomically: a script rather
-- than MULTI because redis-py's Cluster pipeline cannot run MULTI (one key: legal on Cluster).
-- Slots: shared/scripts.py, ACK and ack().
-- Returns the number of entries deleted (0 or 1).
local queue = KEYS[1]
local group, entry = unpack(ARGV, 1, 2)
redis.call('XACK', queue, group, entry)
return redis.call('XDEL', queue, entry)
