-- The token-shard half of add_follower.lua: name one more relay channel in the job's fence entry
-- (Keys.fence), where its writer's flushes read the followers, unless it names it already or the
-- job has no entry (not claimed yet: take.lua copies the record's followers then; ended).
-- Slots: shared/scripts.py, FOLLOW and follow(). Returns 1 when the entry names the channel now.
local fence = KEYS[1]
local job_id, channel = unpack(ARGV, 1, 2)
local current = redis.call('HGET', fence, job_id)
if not current then return 0 end
if string.find(' ' .. current .. ' ', ' ' .. channel .. ' ', 1, true) then return 1 end
redis.call('HSET', fence, job_id, current .. ' ' .. channel)
return 1
