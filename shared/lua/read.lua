-- Pick, read and claim new jobs for one consumer across the priority levels, most urgent first,
-- up to count in total: one round trip from a free slot to a started job. Never blocks: the caller
-- blocks (on the waiting streams) only when this finds nothing.
-- On each level the fair share picks: the tenant with the lowest counter in the level's fair set
-- gives its oldest waiting job, which moves from the waiting stream to the level's queue stream
-- (charged to the tenant: Fair), until count jobs are picked or nobody waits. Then one
-- XREADGROUP takes the queue stream's new entries: the picked ones, and any an older API queued
-- there directly; each is claimed as claim_taken.lua claims (Claim.start, claim.lua).
-- Affinity (affinity_ms > 0, with two or more live workers; docs/adapters.md#affinity): a tenant's
-- oldest job whose prefix key, or else adapter, another live worker holds (it started the last job
-- of that key: holder keys, LLMQ_AFFINITY_HOLD_S) is passed over for at most affinity_ms from its
-- queueing, and the next tenant by the fair order is asked instead; after that anyone takes it.
-- A job this worker holds, or whose adapter it has loaded (own), or that nobody holds, is taken as
-- before. Each job taken makes this worker its keys' holder.
-- Slots: shared/scripts.py, READ and read().
-- Returns {rows, tops, more, wake}: rows = {level (0-based), entry id, job id, Claim.start's row}
-- per entry, in reading order; tops = each waiting stream's newest entry id ('0-0' when empty),
-- where the caller's blocking read starts; more = 1 when it stopped early on ended jobs (read
-- again); wake = ms until a job passed over becomes anyone's (0: none was), the longest the
-- caller may block.
local clock, workers, affinity = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, count, tenant_prefix, job_prefix, now, max_failed,
      levels, levels_at, levels_width, holder_prefix, affinity_ms, hold_ms, own = unpack(ARGV, 1, 14)
levels, levels_at, levels_width = tonumber(levels), tonumber(levels_at), tonumber(levels_width)
affinity_ms = tonumber(affinity_ms)
-- Alone, a worker has nobody to leave a job for: the pick is the plain one.
if affinity_ms > 0 and redis.call('ZCOUNT', workers, now, '+inf') < 2 then affinity_ms = 0 end
local mine = {}
for name in string.gmatch(own, '[^\n]+') do mine[name] = true end
local wake = 0

-- The live worker that holds affinity key ``key`` ('p:<prefix>' or 'a:<adapter>'), if any.
local function holder(key)
  local who = redis.call('GET', holder_prefix .. key)
  if not who or who == consumer then return who end
  local until_ms = redis.call('ZSCORE', workers, who)
  if until_ms and tonumber(until_ms) >= tonumber(now) then return who end
  return nil
end

-- Whom a job is for: this worker, another one, or nil (anyone).
local function owner(prefix, adapter)
  if prefix then
    local who = holder('p:' .. prefix)
    if who then return who end
  end
  if adapter then
    if mine[adapter] then return consumer end
    return holder('a:' .. adapter)
  end
  return nil
end

-- The first tenant of the fair set not passed over in this call, with its counter.
local function first_tenant(fair, passed, n_passed)
  if n_passed == 0 then return redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES') end
  local head = redis.call('ZRANGE', fair, 0, n_passed, 'WITHSCORES')
  for i = 1, #head, 2 do
    if not passed[head[i]] then return {head[i], head[i + 1]} end
  end
  return {}
end

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
  local passed, n_passed = {}, 0
  while picked < want and skipped < 100 do
    local top = first_tenant(fair, passed, n_passed)
    if not top[1] then break end
    local tenant = top[1]
    local tkey = tenant_prefix .. tenant
    local list = Fair.waiting_list(tkey, level)
    local item, f, pass = nil, nil, false
    if affinity_ms > 0 then
      -- Look before taking: the job may be another worker's for a moment.
      item = redis.call('LINDEX', list, 0)
      if item then
        local space = string.find(item, ' ', 1, true)
        f = redis.call('HMGET', job_prefix .. string.sub(item, space + 1), 'status', 'estimate', 'affinity', 'adapter')
        if f[1] == 'queued' and (f[3] or f[4]) then
          local who = owner(f[3], f[4])
          local left = affinity_ms - (tonumber(now) - tonumber(string.match(item, '^(%d+)')))
          if who and who ~= consumer and left > 0 then
            pass = true
            passed[tenant], n_passed = true, n_passed + 1
            if wake == 0 or left < wake then wake = math.ceil(left) end
            redis.call('HINCRBY', affinity, 'waits', 1)
          elseif who == consumer then
            redis.call('HINCRBY', affinity, 'hits', 1)
          elseif who then
            redis.call('HINCRBY', affinity, 'misses', 1)
          end
        end
      end
    end
    if not pass then
      item = redis.call('LPOP', list)
      if redis.call('LLEN', list) == 0 then redis.call('ZREM', fair, tenant) end
    end
    if item and not pass then
      local space = string.find(item, ' ', 1, true)
      local entry, id = string.sub(item, 1, space - 1), string.sub(item, space + 1)
      redis.call('XDEL', waiting, entry)
      local job = job_prefix .. id
      if not f then f = redis.call('HMGET', job, 'status', 'estimate') end
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
        if affinity_ms > 0 then  -- this worker holds the job's keys now
          if f[3] then redis.call('SET', holder_prefix .. 'p:' .. f[3], consumer, 'PX', hold_ms) end
          if f[4] then redis.call('SET', holder_prefix .. 'a:' .. f[4], consumer, 'PX', hold_ms) end
        end
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
return {out, tops, more, wake}
