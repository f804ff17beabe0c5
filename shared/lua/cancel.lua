-- Flag a job as cancelled; the owning worker (if any) is told separately over its control channel.
-- KEYS[1] job hash
-- Returns {status, worker}, or false when the job does not exist.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local f = redis.call('HMGET', KEYS[1], 'status', 'worker')
local status = f[1] or 'queued'
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
end
return {status, f[2] or ''}
