-- Flag a job as cancelled; the owning worker (if any) is told separately over its control channel.
-- Slots: shared/scripts.py, CANCEL and cancel().
-- Returns {status, worker}, or false when the job does not exist.
local job = KEYS[1]
if redis.call('EXISTS', job) == 0 then return false end
local f = redis.call('HMGET', job, 'status', 'worker')
local status = f[1] or 'queued'
if status == 'queued' or status == 'running' then
  redis.call('HSET', job, 'cancel', '1')
end
return {status, f[2] or ''}
