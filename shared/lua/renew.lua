-- Renew the leases of a worker's in-flight jobs (its heartbeat), fenced by (worker, attempt).
-- KEYS[2i-1] the i-th job's hash   KEYS[2i] the queue stream its entry is in
-- ARGV[1] worker id   ARGV[2] idle (ms) to set: 0 renews; a value past the lease hands back
-- ARGV[3] 1 to hand back (the job returns to 'queued' for a peer; not counted as a failure)
-- then per job: queue entry id, attempt.
-- XCLAIM ... JUSTID resets the entry's idle time without counting a delivery. Returns the
-- (0-based) indexes of jobs this worker no longer owns: the caller aborts them.
local lost = {}
for i = 1, #KEYS / 2 do
  local job, queue = KEYS[2 * i - 1], KEYS[2 * i]
  local entry, attempt = ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  local f = redis.call('HMGET', job, 'worker', 'attempt')
  if f[1] == ARGV[1] and f[2] == attempt then
    redis.call('XCLAIM', queue, 'workers', ARGV[1], 0, entry, 'IDLE', ARGV[2], 'JUSTID')
    if ARGV[3] == '1' then
      redis.call('HINCRBY', job, 'handoffs', 1)
      redis.call('HSET', job, 'status', 'queued', 'worker', '')
    end
  else
    table.insert(lost, i - 1)
  end
end
return lost
