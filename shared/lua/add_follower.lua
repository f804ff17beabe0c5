-- Name one more API process's relay channel on a job's record (it follows a job it did not queue:
-- a resume, a poll's event stream, a repeated Idempotency-Key), unless the record names it already.
-- From this script on, every event of the job is published there too (Job.relay: flush.lua,
-- expire.lua); every earlier one is in the job's log, which the follower reads next.
-- Slots: shared/scripts.py, ADD_FOLLOWER and add_follower(): the record; the channel. Its
-- worker's flushes read the followers from its token shard's fence, which follow.lua widens next
-- (Queue.add_follower).
-- Returns 1 when the job's record exists, else 0 (nothing is written).
local job = KEYS[1]
local channel = ARGV[1]
local followers = redis.call('HGET', job, 'relay')
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
return 1
