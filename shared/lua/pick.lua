-- Picking, shared by the scripts that give a worker waiting jobs (read.lua: its free slots;
-- preempt.lua: a slot a running job gives way for): a library, shared/scripts.py puts it before
-- them. A tenant's waiting-list item is '<waiting entry id> <job id>' (enqueue.lua).
local Pick = {}

-- Each level's keys, from the ``levels`` key group (shared/scripts.py lays it out: ``levels``
-- items from KEYS[levels_at], ``levels_width`` keys each): three lists indexed by level + 1.
function Pick.levels(levels, levels_at, levels_width)
  local queues, waitings, fairs = {}, {}, {}
  for l = 0, levels - 1 do
    local k = levels_at + l * levels_width
    local queue, waiting, fair = KEYS[k], KEYS[k + 1], KEYS[k + 2]
    queues[l + 1], waitings[l + 1], fairs[l + 1] = queue, waiting, fair
  end
  return queues, waitings, fairs
end

-- The fields of a waiting job a pick reads, in this order.
Pick.FIELDS = {'status', 'estimate', 'affinity', 'adapter', 'charged'}

-- Move ``item`` (just popped from ``tenant``'s waiting list on a level) from the level's
-- waiting stream to its queue stream, charged to the tenant: its counter ``vtc`` grows by the
-- job's estimate over its weight. A job charged already (preempted: it waits again) keeps that
-- charge and adds none, so its tenant pays for it once. ``f``: the job's Pick.FIELDS when read
-- already. Returns the job's fields, or nil when it ended while it waited (it is only dropped).
function Pick.take(item, tenant, vtc, tkey, fairs, waiting, queue, job_prefix, f)
  local space = string.find(item, ' ', 1, true)
  local entry, id = string.sub(item, 1, space - 1), string.sub(item, space + 1)
  redis.call('XDEL', waiting, entry)
  local job = job_prefix .. id
  if not f then f = redis.call('HMGET', job, unpack(Pick.FIELDS)) end
  if f[1] ~= 'queued' then return nil end  -- it ended while it waited (deadline, deleted) or expired
  local t = redis.call('HMGET', tkey, 'weight', 'max_running')
  local weight, cap = tonumber(t[1] or '1'), tonumber(t[2] or '0')
  if weight <= 0 then weight = 1 end
  if not f[5] then
    local cost = tonumber(f[2] or '0')
    Fair.set_vtc(tkey, fairs, tenant, tonumber(vtc) + cost / weight)
    redis.call('HSET', job, 'charged', cost)
  end
  -- At its running limit it leaves every fair set; it is back when one of its jobs ends.
  local running = Fair.running(tkey)
  if redis.call('SADD', running, id) == 1 and cap > 0 and redis.call('SCARD', running) >= cap then
    for _, other in ipairs(fairs) do redis.call('ZREM', other, tenant) end
  end
  redis.call('XADD', queue, '*', 'job', id)
  return f
end

-- How many tenants of a fair set, from the lowest counter on, the share rule looks at.
Pick.WINDOW = 8

-- A tenant's standing for the share rule: its counter, weight and running jobs.
function Pick.standing(tkey)
  local t = redis.call('HMGET', tkey, 'vtc', 'weight')
  local weight = tonumber(t[2] or '1')
  if weight <= 0 then weight = 1 end
  return {vtc = tonumber(t[1] or '0'), weight = weight, running = redis.call('SCARD', Fair.running(tkey))}
end

-- The share rule (docs/tenants.md#the-share-rule): whether waiting tenant ``w`` is owed a slot
-- that tenant ``r`` holds (standings). It is when ``r`` runs at least twice the jobs per weight
-- ``w`` does, and more than ``w`` even after the slot moves (so a move never calls for its own
-- undoing); and ``w``'s counter is at most ``slack`` tokens (one of ``r``'s jobs) over ``r``'s
-- weight ahead of ``r``'s: the counters charge a job in full when it is picked, so a tenant that
-- runs long jobs looks served already, and a tenant far ahead by tokens is owed nothing. Short of
-- twice, the counters alone decide: they share tokens, and slots are only near their share.
function Pick.owed(w, r, slack)
  local mine, theirs = w.running / w.weight, r.running / r.weight
  return 2 * mine <= theirs and (r.running - 1) / r.weight >= (w.running + 1) / w.weight
    and w.vtc <= r.vtc + slack / r.weight
end

-- Read up to ``want`` new entries of a level's queue stream for ``consumer`` and claim each
-- (Claim.start, with the worker's ``lead``), appending {level, entry id, job id, claim row} to
-- ``out``. Returns how many.
function Pick.claim(out, level, queue, group, consumer, want, job_prefix, now, max_failed, lead)
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', want, 'STREAMS', queue, '>')
  if not reply then return 0 end
  for _, entry in ipairs(reply[1][2]) do
    local fields, job = entry[2], ''
    for j = 1, #fields, 2 do
      if fields[j] == 'job' then job = fields[j + 1] end
    end
    table.insert(out, {level, entry[1], job, Claim.start(job_prefix .. job, consumer, now, max_failed, lead)})
  end
  return #reply[1][2]
end

-- Each waiting stream's newest entry id ('0-0' when empty): where a worker's blocking read for
-- new work starts, so a job queued after this script wakes it.
function Pick.tops(waitings)
  local tops = {}
  for level = 1, #waitings do
    local newest = redis.call('XREVRANGE', waitings[level], '+', '-', 'COUNT', 1)
    tops[level] = newest[1] and newest[1][1] or '0-0'
  end
  return tops
end
