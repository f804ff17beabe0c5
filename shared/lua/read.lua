-- Pick, read and claim new jobs for one consumer across the priority levels, most urgent first,
-- up to count in total: one round trip from a free slot to a started job. Never blocks: the caller
-- blocks (on the waiting streams) only when this finds nothing.
-- On each level the fair share picks: the tenant with the lowest counter in the level's fair set
-- gives its oldest waiting job, which moves from the waiting stream to the level's queue stream
-- (charged to the tenant: Fair), until count jobs are picked or nobody waits. Then one
-- XREADGROUP takes the queue stream's new entries: the picked ones, and any an older API queued
-- there directly; each is claimed as claim_taken.lua claims (Claim.start, claim.lua).
-- Slots: shared/scripts.py, READ and read().
-- Returns {rows, tops, more}: rows = {level (0-based), entry id, job id, Claim.start's row} per
-- entry, in reading order; tops = each waiting stream's newest entry id ('0-0' when empty), where
-- the caller's blocking read starts; more = 1 when it stopped early on ended jobs (read again).
local clock = KEYS[1]
local group, consumer, count, tenant_prefix, job_prefix, now, max_failed,
      levels, levels_at, levels_width = unpack(ARGV, 1, 10)
levels, levels_at, levels_width = tonumber(levels), tonumber(levels_at), tonumber(levels_width)

local queues, waitings, fairs = {}, {}, {}
for l = 0, levels - 1 do
  local k = levels_at + l * levels_width
  local queue, waiting, fair = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  queues[l + 1], waitings[l + 1], fairs[l + 1] = queue, waiting, fair
end
local out, tops, more = {}, {}, 0
local want = tonumber(count)
local skipped = 0
for level = 0, levels - 1 do
  local queue, waiting, fair = queues[level + 1], waitings[level + 1], fairs[level + 1]
  local picked, last = 0, nil
  while picked < want and skipped < 100 do
    local top = redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES')
    if not top[1] then break end
    local tenant = top[1]
    local tkey = tenant_prefix .. tenant
    local list = Fair.waiting_list(tkey, level)
    local item = redis.call('LPOP', list)
    if redis.call('LLEN', list) == 0 then redis.call('ZREM', fair, tenant) end
    if item then
      local space = string.find(item, ' ', 1, true)
      local entry, id = string.sub(item, 1, space - 1), string.sub(item, space + 1)
      redis.call('XDEL', waiting, entry)
      local job = job_prefix .. id
      local f = redis.call('HMGET', job, 'status', 'estimate')
      if f[1] ~= 'queued' then
        skipped = skipped + 1  -- it ended while it waited (deadline, deleted) or expired: drop it
      else
        last = top[2]
        local cost = tonumber(f[2] or '0')
        local t = redis.call('HMGET', tkey, 'weight', 'max_running')
        local weight, cap = tonumber(t[1] or '1'), tonumber(t[2] or '0')
        if weight <= 0 then weight = 1 end
        Fair.set_vtc(tkey, fairs, tenant, tonumber(top[2]) + cost / weight)
        redis.call('HSET', job, 'charged', cost)
        -- At its running limit it leaves every fair set; it is back when one of its jobs ends.
        local running = Fair.running(tkey)
        if redis.call('SADD', running, id) == 1 and cap > 0 and redis.call('SCARD', running) >= cap then
          for _, other in ipairs(fairs) do redis.call('ZREM', other, tenant) end
        end
        redis.call('XADD', queue, '*', 'job', id)
        picked = picked + 1
      end
    end
  end
  if last then redis.call('HSET', clock, tostring(level), last) end
  if skipped >= 100 then more = 1 end
  if want > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', want, 'STREAMS', queue, '>')
    if reply then
      for _, entry in ipairs(reply[1][2]) do
        local fields, job = entry[2], ''
        for j = 1, #fields, 2 do
          if fields[j] == 'job' then job = fields[j + 1] end
        end
        table.insert(out, {level, entry[1], job,
                           Claim.start(job_prefix .. job, consumer, now, max_failed)})
        want = want - 1
      end
    end
  end
end
if #out == 0 then  -- only a reader about to block needs them
  for level = 1, levels do
    local newest = redis.call('XREVRANGE', waitings[level], '+', '-', 'COUNT', 1)
    tops[level] = newest[1] and newest[1][1] or '0-0'
  end
end
return {out, tops, more}
