-- Name one more API process's relay channel on a job's record (it follows a job it did not queue:
-- a resume, a poll's event stream, a repeated Idempotency-Key), unless the record names it already.
-- From this script on, every event of the job is published there too (flush.lua, expire.lua);
-- every earlier one is in the job's log, which the follower reads next.
-- KEYS[1] job hash   ARGV[1] relay channel
-- Returns 1 when the job's record exists, else 0 (nothing is written).
local relay = redis.call('HGET', KEYS[1], 'relay')
if not relay then
  if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
  redis.call('HSET', KEYS[1], 'relay', ARGV[1])
  return 1
end
for channel in string.gmatch(relay, '%S+') do
  if channel == ARGV[1] then return 1 end
end
redis.call('HSET', KEYS[1], 'relay', relay .. ' ' .. ARGV[1])
return 1
