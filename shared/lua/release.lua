-- A job handed back by its worker (renew.lua's hand-back) leaves its token shard's fence
-- (Keys.fence), unless a later claim holds it already: from here on that worker writes nothing
-- more about it. Slots: shared/scripts.py, RELEASE and release(). Returns 1 when it left.
local fence = KEYS[1]
local job_id, writer = unpack(ARGV, 1, 2)
local current = redis.call('HGET', fence, job_id)
if current and (current == writer or string.sub(current, 1, #writer + 1) == writer .. ' ') then
  redis.call('HDEL', fence, job_id)
  return 1
end
return 0
