-- Preemption (docs/tenants.md#preemption): a worker with no free slot asks whether one of its
-- running jobs should give way to a waiting one, and if so swaps them in one round trip: the
-- running job goes back to wait (at the head of its tenant's waiting list, its charge kept), and
-- the waiting job is picked and claimed for this worker, which then stops the first and starts the
-- second in its slot. The job given back continues later from its published tokens, on any
-- worker, as a crashed worker's job does (workers/continuation.py).
-- Slots: shared/scripts.py, PREEMPT and preempt(): per level its queue, waiting stream and fair
-- set (KEYS); per candidate (at most one per tenant and level, the worker's cheapest to resume, each
-- past LLMQ_PREEMPT_MIN_RUN_MS and LLMQ_PREEMPT_MIN_TOKENS) its record (KEYS) and its id, queue
-- entry, attempt, level and the tokens it has used so far (ARGV).
-- The waiting job: on the most urgent level with work, of the tenant with the fewest running jobs
-- per weight among the first Pick.WINDOW of the fair order (the lowest counters). A candidate gives
-- way to it when it is on a less urgent level; or, on the same level, when the waiting tenant is
-- owed its tenant's slot by the share rule (Pick.owed, the slack the candidate's charge), the rule
-- a pick follows too (read.lua). A job preempted LLMQ_PREEMPT_MAX times already is never chosen.
-- Returns {victim, rows, waiting, tops}: victim = the 0-based candidate given back (-1: none);
-- rows = the picked job's row, as read.lua's; waiting = 1 when a job waits (none given way for:
-- the worker asks again soon); tops = each waiting stream's newest entry id when nothing waits.
local clock = KEYS[1]
local group, consumer, tenant_prefix, job_prefix, now, max_failed, max_preemptions, levels, levels_at,
      levels_width, job_keys_at, job_keys_width, jobs_at, jobs_width, lead_ms = unpack(ARGV, 1, 15)
max_preemptions, levels, levels_at = tonumber(max_preemptions), tonumber(levels), tonumber(levels_at)
levels_width, job_keys_at, job_keys_width = tonumber(levels_width), tonumber(job_keys_at), tonumber(job_keys_width)
jobs_at, jobs_width = tonumber(jobs_at), tonumber(jobs_width)

local queues, waitings, fairs = Pick.levels(levels, levels_at, levels_width)

-- A tenant's standing (Pick.standing), read once per tenant.
local standings = {}
local function standing(tenant)
  local s = standings[tenant]
  if not s then
    s = Pick.standing(tenant_prefix .. tenant)
    standings[tenant] = s
  end
  return s
end

-- Whether a tenant's oldest job on a level still waits; one that ended meanwhile (its deadline,
-- a delete) is dropped, as a pick drops it.
local function live_head(tenant, level)
  local list = Fair.waiting_list(tenant_prefix .. tenant, level)
  for _ = 1, 100 do
    local item = redis.call('ZRANGE', list, 0, 0)[1]
    if not item then return false end
    local space = string.find(item, ' ', 1, true)
    if redis.call('HGET', job_prefix .. string.sub(item, space + 1), 'status') == 'queued' then return true end
    redis.call('ZREM', list, item)
    redis.call('XDEL', waitings[level + 1], string.sub(item, 1, space - 1))
    if redis.call('ZCARD', list) == 0 then redis.call('ZREM', fairs[level + 1], tenant) end
  end
  return false
end

-- The waiting tenant, its level and counter.
local w, w_level, w_vtc, w_score = nil, nil, nil, nil
for level = 0, levels - 1 do
  local head = redis.call('ZRANGE', fairs[level + 1], 0, Pick.WINDOW - 1, 'WITHSCORES')
  local least = nil
  for i = 1, #head, 2 do
    local s = standing(head[i])
    if (least == nil or s.running / s.weight < least) and live_head(head[i], level) then
      w, w_level, w_score, least = head[i], level, head[i + 1], s.running / s.weight
      w_vtc = tonumber(w_score)
    end
  end
  if w then break end
end
if not w then return {-1, {}, 0, Pick.tops(waitings)} end

-- The candidate to give way: a less urgent level first (the least urgent), then the tenant most
-- over its share; the worker lists each tenant's cheapest first.
local ws = standing(w)
local victim, best = nil, nil
for i, a, j in Items.each(jobs_at, jobs_width, job_keys_at, job_keys_width) do
  local job = KEYS[j]
  local job_id, entry, attempt, level, used = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3]), ARGV[a + 4]
  local f = redis.call('HMGET', job, 'worker', 'attempt', 'status', 'tenant', 'preemptions', 'charged')
  if f[1] == consumer and f[2] == attempt and f[3] == 'running' and f[4] and f[4] ~= ''
      and tonumber(f[5] or '0') < max_preemptions then
    local r = standing(f[4])
    local rank = nil
    if level > w_level then
      rank = {2, level, r.running / r.weight}
    elseif level == w_level and f[4] ~= w and Pick.owed(ws, r, tonumber(f[6] or '0')) then
      rank = {1, level, r.running / r.weight}
    end
    if rank and (not best or rank[1] > best[1] or (rank[1] == best[1] and (rank[2] > best[2]
        or (rank[2] == best[2] and rank[3] > best[3])))) then
      victim, best = {index = i, job = job, id = job_id, entry = entry, level = level, used = used, tenant = f[4]}, rank
    end
  end
end
if not victim then return {-1, {}, 1, {}} end

-- Give the victim back: out of this worker's queue entries, first in its tenant's line again. Not
-- a failed delivery (handoffs), its charge kept (Pick.take charges it no more).
local v = victim
redis.call('XACK', queues[v.level + 1], group, v.entry)
redis.call('XDEL', queues[v.level + 1], v.entry)
local started = tonumber(redis.call('HGET', v.job, 'started_at') or now)
redis.call('HINCRBY', v.job, 'preemptions', 1)
redis.call('HINCRBY', v.job, 'handoffs', 1)
redis.call('HINCRBY', v.job, 'run_ms', math.max(0, math.floor(tonumber(now) - started)))
redis.call('HSET', v.job, 'status', 'queued', 'worker', '', 'preempted_at', now, 'used', v.used)
local rkey = tenant_prefix .. v.tenant
redis.call('SREM', Fair.running(rkey), v.id)
local back = redis.call('XADD', waitings[v.level + 1], '*', 'job', v.id, 'tenant', v.tenant)
redis.call('ZADD', Fair.waiting_list(rkey, v.level), Fair.order(now, nil, true), back .. ' ' .. v.id)
Fair.rejoin(rkey, fairs, clock, v.tenant)

-- Pick the waiting job into the slot, and claim it.
local wkey = tenant_prefix .. w
local list = Fair.waiting_list(wkey, w_level)
local item = redis.call('ZPOPMIN', list)[1]
if redis.call('ZCARD', list) == 0 then redis.call('ZREM', fairs[w_level + 1], w) end
Pick.take(item, w, w_score, wkey, fairs, waitings[w_level + 1], queues[w_level + 1], job_prefix)
redis.call('HSET', clock, tostring(w_level), w_score)
local out = {}
Pick.claim(out, w_level, queues[w_level + 1], group, consumer, 1, job_prefix, now, max_failed, lead_ms)
return {v.index, out, 1, {}}
