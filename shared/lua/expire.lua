-- End a job whose deadline passed and that nobody ended: called by the API (a client waiting on
-- it, or a poll). A queued job ends at its deadline; a running one only after a grace period, as
-- its worker aborts it at the deadline itself and this is the backstop for a worker that cannot.
-- With at_once = '1' the job ends now, whatever its deadline: a waiting client's cold wait ran
-- out (no warm worker served the model for LLMQ_COLD_WAIT_S), so no worker is running it either;
-- or the job is being deleted.
-- This is the first of the steps (Queue.expire): it takes the job from its owner, as a claim does
-- (attempt + 1, worker = ''), so the owner's renewals fail;
-- then the API fences the token shard at that attempt (take.lua), logs the error event (flush.lua)
-- and ends the record (finish.lua). Should the API stop between, the job is left owned by nobody
-- at a new attempt: its owner loses it at its next renewal and a peer reclaims it (claim.lua then
-- finds its deadline passed, or runs it).
-- Slots: shared/scripts.py, EXPIRE and expire().
-- Returns {attempt, followers} when this call took the job, else 0.
local job = KEYS[1]
local now, grace, at_once = unpack(ARGV, 1, 3)

local f = redis.call('HMGET', job, 'status', 'deadline', 'relay')
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
if at_once ~= '1' then
  if not f[2] then return 0 end
  local due = tonumber(f[2])
  if f[1] == 'running' then due = due + tonumber(grace) end
  if tonumber(now) < due then return 0 end
end
local attempt = redis.call('HINCRBY', job, 'attempt', 1)
redis.call('HSET', job, 'worker', '')
return {attempt, f[3] or ''}
