-- Atomically admit, record and queue a job (one round trip, one slot: all keys share the model tag).
-- KEYS[1] job hash   KEYS[2] the queue of the job's priority level
-- KEYS[3 .. 2+ARGV[4]] every level's queue (for the depth limit)   last, optional: idempotency key
-- ARGV[1] job id   ARGV[2] idempotency TTL (s)   ARGV[3] depth limit   ARGV[4] number of levels
-- ARGV[5..] job hash field, value, ...
-- Returns the job id that owns the request (ours, or the earlier one for a repeated key), or,
-- when the model already holds the limit of unfinished jobs, that depth as an integer.
-- Finished entries are XDEL'd, so the lengths count exactly the queued and running jobs; checking
-- them here, in the same script as the XADD, means concurrent submitters can never overshoot.
local levels = tonumber(ARGV[4])
local idem = KEYS[3 + levels]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return existing end
end
local depth = 0
for i = 3, 2 + levels do depth = depth + redis.call('XLEN', KEYS[i]) end
if depth >= tonumber(ARGV[3]) then return depth end
if idem then redis.call('SET', idem, ARGV[1], 'EX', ARGV[2]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
return ARGV[1]
