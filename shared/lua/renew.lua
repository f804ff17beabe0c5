-- Renew the leases of a worker's in-flight jobs (its heartbeat), fenced by (worker, attempt).
-- Slots: shared/scripts.py, RENEW and renew(): per job, its record and the queue stream its entry
-- is in (KEYS), its entry id and attempt (ARGV). idle: 0 renews; a value past the lease
-- hands back (hand_back = '1': the job returns to 'queued' for a peer; not counted as a failure).
-- XCLAIM ... JUSTID resets the entry's idle time without counting a delivery. Returns the
-- (0-based) indexes of jobs this worker no longer owns: the caller aborts them.
local group, worker, idle, hand_back, job_keys_at, job_keys_width, jobs_at, jobs_width = unpack(ARGV, 1, 8)
job_keys_at, job_keys_width = tonumber(job_keys_at), tonumber(job_keys_width)
jobs_at, jobs_width = tonumber(jobs_at), tonumber(jobs_width)

local lost = {}
for i, a, k in Items.each(jobs_at, jobs_width, job_keys_at, job_keys_width) do
  local job, queue = KEYS[k], KEYS[k + 1]
  local entry, attempt = ARGV[a], ARGV[a + 1]
  local f = redis.call('HMGET', job, 'worker', 'attempt')
  if f[1] == worker and f[2] == attempt then
    redis.call('XCLAIM', queue, group, worker, 0, entry, 'IDLE', idle, 'JUSTID')
    if hand_back == '1' then
      redis.call('HINCRBY', job, 'handoffs', 1)
      redis.call('HSET', job, 'status', 'queued', 'worker', '')  -- nobody's until a peer claims it
    end
  else
    table.insert(lost, i)
  end
end
return lost
