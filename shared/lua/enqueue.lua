-- Atomically admit, record and queue a job (one round trip, one slot: all keys share the model tag).
-- Slots: shared/scripts.py, ENQUEUE and enqueue(): after the fixed keys, per level its queue
-- stream, waiting stream and fair set, then (one or none) the idempotency key; after the fixed
-- values, the job record's field, value pairs. -1 for max_running, max_queued or
-- tokens_per_minute: no limit. slots, decode_tps, generated_per_job: the model's warm capacity
-- (shared/slo.py; 0: not known); slo_ttft_ms: the job's TTFT SLO ('': none), prefill_ms: its
-- prompt's predicted prefill.
-- Returns the job id that owns the request (ours, or the earlier one for a repeated key), or a
-- refusal: {'full', depth} when the model holds the limit of unfinished jobs; {'queued', running,
-- waiting} when the tenant may have no more jobs waiting; {'tokens', used, retry after (s)} when
-- its last minute's tokens reached its limit; {'slo', predicted TTFT (ms)} when the job is
-- predicted to miss its TTFT SLO (Slo.ahead, Slo.wait_ms: docs/guarantees.md#slos).
-- Checks and writes in one script, so concurrent submitters can never overshoot a limit.
-- Every check reads only, and the first write is the job record: Redis checks its memory limit at
-- a script's first write, and lets the rest of the script run past it (atomicity). A first write
-- that frees memory (an HDEL of old window seconds) would wave the whole script through at
-- maxmemory; a refused HSET leaves nothing behind.
local job, tenant_key, tenants, clock, recent = unpack(KEYS, 1, 5)
local job_id, idempotency_ttl, max_depth, levels, level, tenant, weight, max_running, max_queued,
      tokens_per_minute, now, levels_at, levels_width, idempotency_at, touch, recent_max, dialect,
      owner, queued_at, first_token_deadline, slo_ttft_ms, prefill_ms, slots, decode_tps,
      generated_per_job = unpack(ARGV, 1, 25)
level, max_running, max_queued = tonumber(level), tonumber(max_running), tonumber(max_queued)
tokens_per_minute, now = tonumber(tokens_per_minute), tonumber(now)
levels, levels_at, levels_width = tonumber(levels), tonumber(levels_at), tonumber(levels_width)
idempotency_at = tonumber(idempotency_at)

local idempotency = KEYS[idempotency_at]  -- nil: the request has no Idempotency-Key
if idempotency then
  local existing = redis.call('GET', idempotency)
  if existing then
    -- Under LLMQ_DURABILITY the WAIT after this script counts this connection's last write (Redis
    -- 7.2+): a write here makes it cover the earlier request's job, which may not be replicated yet.
    if touch == '1' then redis.call('EXPIRE', idempotency, idempotency_ttl) end
    return existing
  end
end
-- The model's unfinished jobs (both streams of every level) and the tenant's waiting ones.
local depth, waiting, queues, streams, fairs = 0, 0, {}, {}, {}
for l = 0, levels - 1 do
  local k = levels_at + l * levels_width
  local queue, waiting_stream, fair = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  depth = depth + redis.call('XLEN', queue) + redis.call('XLEN', waiting_stream)
  waiting = waiting + redis.call('ZCARD', Fair.waiting_list(tenant_key, l))
  queues[l + 1], streams[l + 1], fairs[l + 1] = queue, waiting_stream, fair
end
if depth >= tonumber(max_depth) then return {'full', depth} end

local running = redis.call('SCARD', Fair.running(tenant_key))
if max_queued >= 0 then
  -- How many of the tenant's jobs would wait with this one: all of them, or, under a running
  -- limit, those beyond it (a job that can start at once under the limit never counts as waiting).
  local would_wait = waiting + 1
  if max_running > 0 then would_wait = running + waiting + 1 - max_running end
  if would_wait > max_queued then return {'queued', running, waiting} end
end
if tokens_per_minute >= 0 then
  local seconds, used = Fair.window(Fair.tokens(tenant_key), now, false)
  if used >= tokens_per_minute then
    -- Retry once enough of the window's oldest seconds have left it to bring it under the limit.
    table.sort(seconds, function(a, b) return a[1] < b[1] end)
    local left, retry = used, 60
    for _, s in ipairs(seconds) do
      left = left - s[2]
      if left < tokens_per_minute then retry = s[1] + 60 - math.floor(now / 1000); break end
    end
    return {'tokens', used, math.max(1, retry)}
  end
end

-- Its time to first token, predicted from the jobs that start before it; past its SLO, refused
-- before it costs any engine time. The prediction stays on its record: the worker measures its
-- error at the first token.
local score = Fair.order(queued_at, first_token_deadline, false)
local predicted = -1
if tonumber(slots) > 0 then
  local wait = Slo.wait_ms(Slo.ahead(tenant_key, tenant, level, score, streams, fairs), queues, slots, decode_tps,
                           generated_per_job)
  if wait >= 0 then predicted = wait + tonumber(prefill_ms) end
end
if predicted >= 0 and slo_ttft_ms ~= '' and predicted > tonumber(slo_ttft_ms) then return {'slo', predicted} end

redis.call('HSET', job, unpack(ARGV, 26))
if predicted >= 0 then redis.call('HSET', job, 'predicted_ttft', predicted) end
if idempotency then redis.call('SET', idempotency, job_id, 'EX', idempotency_ttl) end
local entry = redis.call('XADD', streams[level + 1], '*', 'job', job_id, 'tenant', tenant)
redis.call('ZADD', Fair.waiting_list(tenant_key, level), score, entry .. ' ' .. job_id)
-- The model's newest jobs, for the console's list (shared/browse.py): what it filters on, in order.
if recent_max ~= '0' then
  redis.call('XADD', recent, 'MAXLEN', '~', recent_max, '*', 'job', job_id, 'tenant', tenant, 'dialect', dialect,
             'owner', owner)
end
redis.call('HSET', tenant_key, 'weight', weight, 'max_running', math.max(max_running, 0))
redis.call('ZADD', tenants, 'NX', now, tenant)
-- At its running limit it joins the fair set when one of its jobs ends (Fair.ended).
if Fair.has_room(tenant_key) then Fair.join(tenant_key, fairs, clock, level, tenant) end
return job_id
