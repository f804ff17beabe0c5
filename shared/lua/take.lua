-- Install the fence (worker, attempt) of jobs just claimed in their token shard (Keys.fence), after the claim bumped
-- their record's attempt (claim.lua, or expire.lua for an end the API writes): from this script on,
-- the shard refuses every earlier attempt's writes (flush.lua). Monotonic: an entry at a later
-- attempt stays (this claim was overtaken: lost). The followers the record named at the claim join
-- those already in the entry (add_follower's follow.lua may have run between the two).
-- Slots: shared/scripts.py, TAKE and take(): per shard its fence (KEYS) and its ending keys' prefix
-- (ARGV); per job its log (KEYS) and id, attempt, followers and shard index (ARGV).
-- Returns per job {state, last_seq, ending}: state 'ok' (fenced for this attempt), 'lost' (a later
-- attempt holds it) or 'ended' (its terminal event is logged and the record may not say so yet:
-- ending is Keys.ending's fields, flat, for finish.lua; the fence is left as it is).
local shards_at, shards_width, logs_at, logs_width, shard_args_at, shard_args_width,
      jobs_at, jobs_width, worker = unpack(ARGV, 1, 9)
shards_at, shards_width = tonumber(shards_at), tonumber(shards_width)
logs_at, logs_width = tonumber(logs_at), tonumber(logs_width)
shard_args_at, shard_args_width = tonumber(shard_args_at), tonumber(shard_args_width)
jobs_at, jobs_width = tonumber(jobs_at), tonumber(jobs_width)

local out = {}
for i, a, j in Items.each(jobs_at, jobs_width, logs_at, logs_width) do
  local log = KEYS[j]
  local job_id, attempt, followers, shard = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local k = shards_at + tonumber(shard) * shards_width
  local fence = KEYS[k]
  local s = shard_args_at + tonumber(shard) * shard_args_width
  local ending_prefix = ARGV[s]
  local ending = redis.call('HGETALL', ending_prefix .. job_id)
  local current = redis.call('HGET', fence, job_id)
  local was, named = nil, ''
  if current then was, named = string.match(current, '^(%d+)@%S* ?(.*)$') end
  if ending[1] then
    table.insert(out, {'ended', Job.last_seq(log), ending})
  elseif was and tonumber(was) > tonumber(attempt) then
    table.insert(out, {'lost', 0, {}})
  else
    local all = named
    for channel in string.gmatch(followers, '%S+') do
      if not string.find(' ' .. all .. ' ', ' ' .. channel .. ' ', 1, true) then
        all = all == '' and channel or all .. ' ' .. channel
      end
    end
    local writer = attempt .. '@' .. worker
    redis.call('HSET', fence, job_id, all == '' and writer or writer .. ' ' .. all)
    table.insert(out, {'ok', Job.last_seq(log), {}})
  end
end
return out
