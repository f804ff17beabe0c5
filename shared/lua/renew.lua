-- Renew the leases of a worker's in-flight jobs (its heartbeat), fenced by (worker, attempt).
-- KEYS[1] queue stream   KEYS[2..] job hashes
-- ARGV[1] worker id   ARGV[2] idle (ms) to set: 0 renews; a value past the lease hands back
-- ARGV[3] 1 to hand back (the job returns to 'queued' for a peer; not counted as a failure)
-- then per job: queue entry id, attempt.
-- XCLAIM ... JUSTID resets the entry's idle time without counting a delivery. Returns the
-- indexes of jobs this worker no longer owns: the caller aborts them.
local lost = {}
for i = 2, #KEYS do
  local entry, attempt = ARGV[2 * i], ARGV[2 * i + 1]
  local f = redis.call('HMGET', KEYS[i], 'worker', 'attempt')
  if f[1] == ARGV[1] and f[2] == attempt then
    redis.call('XCLAIM', KEYS[1], 'workers', ARGV[1], 0, entry, 'IDLE', ARGV[2], 'JUSTID')
    if ARGV[3] == '1' then
      redis.call('HINCRBY', KEYS[i], 'handoffs', 1)
      redis.call('HSET', KEYS[i], 'status', 'queued', 'worker', '')
    end
  else
    table.insert(lost, i - 2)
  end
end
return lost
