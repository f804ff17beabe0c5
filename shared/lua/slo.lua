-- Where a job stands in its model's queue, and when it should start (docs/guarantees.md#slos):
-- shared by enqueue.lua (admission: a job predicted to miss its first-token deadline is refused)
-- and position.lua (a waiting job's queue position and ETA). A library: shared/scripts.py puts it
-- (after Fair) before them.
local Slo = {}

-- How many tenants of a level's fair order the count looks at: past them the estimate leaves
-- out tenants with the highest counters, who are the last to be served anyway.
Slo.TENANTS = 64

local function weight(tkey)
  local w = tonumber(redis.call('HGET', tkey, 'weight') or '1')
  if not w or w <= 0 then return 1 end
  return w
end

-- How many waiting jobs of the model are estimated to start before a job of ``tenant`` (its hash:
-- ``tkey``, its own keys' prefix) whose
-- score in its tenant's line is ``score`` (Fair.order), on ``level`` (0-based): every job waiting
-- on a more urgent level; the jobs ahead of it in its own line; and of each other tenant waiting
-- on its level, as many as the fair share lets start while this tenant's own jobs up to this one
-- do: their number times the weights' ratio (the counters share tokens; jobs alike share slots so).
function Slo.ahead(tkey, tenant, level, score, waitings, fairs)
  local tenant_prefix = string.sub(tkey, 1, #tkey - #tenant)
  local n = 0
  for l = 1, level do n = n + redis.call('XLEN', waitings[l]) end
  local own = redis.call('ZCOUNT', Fair.waiting_list(tkey, level), '-inf', '(' .. score)
  local turns = (own + 1) / weight(tkey)
  for _, other in ipairs(redis.call('ZRANGE', fairs[level + 1], 0, Slo.TENANTS - 1)) do
    if other ~= tenant then
      local okey = tenant_prefix .. other
      n = n + math.min(redis.call('ZCARD', Fair.waiting_list(okey, level)), math.ceil(turns * weight(okey)))
    end
  end
  return n + own
end

-- Milliseconds until a job with ``ahead`` jobs before it starts, from the model's warm capacity
-- (shared/slo.py Capacity): with a slot free for it, at once; else once ahead - free + 1 running
-- jobs have ended, and jobs end at decode_tps / generated_per_job a second when every slot is
-- busy. -1: not known (no warm worker has measured its speed).
function Slo.wait_ms(ahead, queues, slots, decode_tps, generated_per_job)
  slots, decode_tps, generated_per_job = tonumber(slots), tonumber(decode_tps), tonumber(generated_per_job)
  if slots <= 0 or decode_tps <= 0 or generated_per_job <= 0 then return -1 end
  local busy = 0  -- picked and not ended: their queue entries (finish.lua deletes them)
  for _, queue in ipairs(queues) do busy = busy + redis.call('XLEN', queue) end
  local free = slots - busy
  if ahead < free then return 0 end
  return math.ceil((ahead - free + 1) * generated_per_job / decode_tps * 1000)
end
