-- Name one more API process's relay channel on a job's record (it follows a job it did not queue:
-- a resume, a poll's event stream, a repeated Idempotency-Key), unless the record names it already.
-- From this script on, every event of the job is published there too (Job.relay: flush.lua,
-- expire.lua); every earlier one is in the job's log, which the follower reads next.
-- Slots: shared/scripts.py, ADD_FOLLOWER and add_follower(): the record; the channel, the job's id
-- and the owned-jobs hashes' prefix (Keys.owned less the worker's id).
-- Returns 1 when the job's record exists, else 0 (nothing is written).
local job = KEYS[1]
local channel, job_id, owned_prefix = unpack(ARGV, 1, 3)
local f = redis.call('HMGET', job, 'relay', 'worker', 'attempt')
local followers = f[1]
if not followers then
  if redis.call('EXISTS', job) == 0 then return 0 end
  followers = channel
else
  for named in string.gmatch(followers, '%S+') do
    if named == channel then return 1 end
  end
  followers = followers .. ' ' .. channel
end
redis.call('HSET', job, 'relay', followers)
-- Its worker's flushes read the followers from its owned-jobs hash (Keys.owned): there too, in
-- this same script, so the next flush after it publishes to the new follower.
if f[2] and f[2] ~= '' then
  local owned = owned_prefix .. f[2]
  if redis.call('HEXISTS', owned, job_id) == 1 then redis.call('HSET', owned, job_id, f[3] .. ' ' .. followers) end
end
return 1
