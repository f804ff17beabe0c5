-- Take over the entries a dead worker holds in one level's queue, for a live one, at once (its
-- process is gone, so its leases need not lapse first). One script, so two peers that both saw
-- the death never both take an entry: XCLAIM moves each entry off the dead consumer, and the
-- second peer's XPENDING no longer lists it. The caller then claims the jobs (claim_taken.lua
-- bumps their attempt: the fence against the dead worker, should it be alive after all).
-- Slots: shared/scripts.py, TAKEOVER and takeover(): the dead worker's consumer, the taker's, and
-- at most how many entries to take.
-- Returns {entry id, job id} per entry taken, oldest first. Once the dead consumer holds nothing
-- in this stream it is deleted from the group (DELCONSUMER drops a consumer's pending entries,
-- so never before).
local queue = KEYS[1]
local group, dead, taker, count = unpack(ARGV, 1, 4)

local taken = {}
local want = tonumber(count)
if want > 0 then
  local pending = redis.call('XPENDING', queue, group, '-', '+', want, dead)
  local ids = {}
  for i, p in ipairs(pending) do ids[i] = p[1] end
  if #ids > 0 then
    local claimed = redis.call('XCLAIM', queue, group, taker, 0, unpack(ids))
    for i, entry in ipairs(claimed) do
      local job = false
      if entry then
        local fields = entry[2]
        for j = 1, #fields, 2 do
          if fields[j] == 'job' then job = fields[j + 1] end
        end
      end
      if job then
        table.insert(taken, {entry[1], job})
      else
        -- An entry deleted from the stream (the job ended) whose PEL reference was left behind:
        -- Redis 6.2 returns nil in its place (Redis 7 drops such references itself and returns
        -- nothing for them, so this branch, where ids[i] is the nil's id, is 6.2 only).
        redis.call('XACK', queue, group, entry and entry[1] or ids[i])
      end
    end
  end
end
if #redis.call('XPENDING', queue, group, '-', '+', 1, dead) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', queue, group, dead)
end
return taken
