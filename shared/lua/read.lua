-- Pick, read and claim new jobs for one consumer across the priority levels, most urgent first,
-- up to count in total: one round trip from a free slot to a started job. Never blocks: the caller
-- blocks (on the waiting streams) only when this finds nothing.
-- On each level the fair share picks: the tenant with the lowest counter in the level's fair set
-- (or one close behind it that runs fewer jobs for its weight: next_tenant) gives its oldest
-- waiting job, which moves from the waiting stream to the level's queue stream
-- (charged to the tenant: Pick.take), until count jobs are picked or nobody waits. Then one
-- XREADGROUP takes the queue stream's new entries: the picked ones, and any an older API queued
-- there directly; each is claimed as claim_taken.lua claims (Pick.claim, Claim.start).
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
      levels, levels_at, levels_width, holder_prefix, affinity_ms, hold_ms, own, lead_ms = unpack(ARGV, 1, 15)
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

-- The tenant a level's pick serves next, with its counter: the first of the fair set (the lowest
-- counter) not passed over in this call, unless one of the next Pick.WINDOW would be owed the
-- slot right after the first took it (Pick.owed, as a full worker's preemption would judge it:
-- preempt.lua): then the one that runs the fewest jobs per weight among those. So a pick never
-- gives a slot that a preemption would take back at once.
local function next_tenant(fair, passed, n_passed, level)
  local head = redis.call('ZRANGE', fair, 0, n_passed + Pick.WINDOW - 1, 'WITHSCORES')
  local first, others = nil, {}
  for i = 1, #head, 2 do
    if not passed[head[i]] then
      if first then table.insert(others, {head[i], head[i + 1]}) else first = {head[i], head[i + 1]} end
    end
  end
  if not first or #others == 0 then return first or {} end
  -- The first tenant as it would stand with the slot: a preemption then judges it so, and the
  -- job it took is the one that would give way.
  local h = Pick.standing(tenant_prefix .. first[1])
  local item = redis.call('ZRANGE', Fair.waiting_list(tenant_prefix .. first[1], level), 0, 0)[1]
  local slack = 0
  if item then
    local id = string.sub(item, string.find(item, ' ', 1, true) + 1)
    local f = redis.call('HMGET', job_prefix .. id, 'estimate', 'charged')
    slack = tonumber(f[2] or f[1] or '0')
    if not f[2] then h.vtc = h.vtc + slack / h.weight end
  end
  h.running = h.running + 1
  local best, least = first, nil
  for _, t in ipairs(others) do
    local w = Pick.standing(tenant_prefix .. t[1])
    if Pick.owed(w, h, slack) and (least == nil or w.running / w.weight < least) then
      best, least = t, w.running / w.weight
    end
  end
  return best
end

local queues, waitings, fairs = Pick.levels(levels, levels_at, levels_width)
local out, tops, more = {}, {}, 0
local want = tonumber(count)
local skipped = 0
for level = 0, levels - 1 do
  local queue, waiting, fair = queues[level + 1], waitings[level + 1], fairs[level + 1]
  local picked, last = 0, nil
  local passed, n_passed = {}, 0
  while picked < want and skipped < 100 do
    local top = next_tenant(fair, passed, n_passed, level)
    if not top[1] then break end
    local tenant = top[1]
    local tkey = tenant_prefix .. tenant
    local list = Fair.waiting_list(tkey, level)
    local item, f, pass = nil, nil, false
    if affinity_ms > 0 then
      -- Look before taking: the job may be another worker's for a moment.
      item = redis.call('ZRANGE', list, 0, 0)[1]
      if item then
        local space = string.find(item, ' ', 1, true)
        f = redis.call('HMGET', job_prefix .. string.sub(item, space + 1), unpack(Pick.FIELDS))
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
      item = redis.call('ZPOPMIN', list)[1]
      if redis.call('ZCARD', list) == 0 then redis.call('ZREM', fair, tenant) end
    end
    if item and not pass then
      f = Pick.take(item, tenant, top[2], tkey, fairs, waiting, queue, job_prefix, f)
      if not f then
        skipped = skipped + 1  -- it had ended: dropped
      else
        last = top[2]
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
    want = want - Pick.claim(out, level, queue, group, consumer, want, job_prefix, now, max_failed, lead_ms)
  end
end
if #out == 0 then tops = Pick.tops(waitings) end  -- only a reader about to block needs them
return {out, tops, more, wake}
