-- Fair share between tenants (virtual token counters, VTC: Sheng et al., OSDI 2024), shared by
-- the scripts that queue, pick and end jobs (a library: shared/scripts.py puts it before them).
-- A tenant's counter (field 'vtc' of its hash) grows by the tokens its jobs use divided by its
-- weight: by an estimate when a job is picked, corrected to the real count when it ends. Each
-- level's fair set holds, scored by that counter, the tenants with jobs waiting there and room to
-- run one; the pick takes the lowest. A tenant id is only known inside a script (from a waiting
-- entry or a job record), so its own keys are built here, its hash's name plus a suffix, in the
-- three functions below alone (shared/keys.py names them the same way; tests/unit/test_scripts.py
-- holds the two together).
local Fair = {}

-- Keys.tenant_waiting: the tenant's waiting jobs on a level, its line: a sorted set of
-- '<waiting entry id> <job id>' items, the first to start lowest (Fair.order).
function Fair.waiting_list(tkey, level)
  if tonumber(level) == 0 then return tkey .. ':line' end
  return tkey .. ':line:' .. level
end

-- Where a job stands in its tenant's line (its score; docs/tenants.md#a-tenants-own-jobs): jobs
-- that wait again (preempted) first, the most recently preempted first, as they always came; then
-- jobs with a first-token deadline, the earliest first (EDF); then the rest, oldest first. The
-- classes are bands of one number: epoch ms is about 1.8e12, so -now sorts before every deadline,
-- and 1e13 + queued_at after them all (exact in a double to the microsecond).
Fair.LATER = 1e13
function Fair.order(now, first_token_deadline, again)
  if again then return -tonumber(now) end
  if first_token_deadline and first_token_deadline ~= '' then return tonumber(first_token_deadline) end
  return Fair.LATER + tonumber(now)
end

-- Keys.tenant_running: the tenant's jobs picked and not ended.
function Fair.running(tkey)
  return tkey .. ':running'
end

-- Keys.tenant_tokens: the tenant's tokens by the second they ended in.
function Fair.tokens(tkey)
  return tkey .. ':tokens'
end

-- Store a tenant's counter and move it in every fair set it is in.
function Fair.set_vtc(tkey, fairs, tenant, vtc)
  redis.call('HSET', tkey, 'vtc', string.format('%.17g', vtc))
  for _, fair in ipairs(fairs) do redis.call('ZADD', fair, 'XX', vtc, tenant) end
end

-- Put a tenant into the fair set of ``level`` (0-based) if it is not there. One that was idle
-- starts at the lowest counter there (or the last picked one's when nobody waits), never below:
-- the tokens it did not use while idle are not owed to it.
function Fair.join(tkey, fairs, clock, level, tenant)
  local fair = fairs[level + 1]
  if redis.call('ZSCORE', fair, tenant) then return end
  local vtc = tonumber(redis.call('HGET', tkey, 'vtc') or '0')
  local low = redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES')
  local floor = tonumber(low[2] or redis.call('HGET', clock, tostring(level)) or '0')
  if floor > vtc then
    vtc = floor
    Fair.set_vtc(tkey, fairs, tenant, vtc)
  end
  redis.call('ZADD', fair, vtc, tenant)
end

-- Whether a tenant may have one more job running.
function Fair.has_room(tkey)
  local cap = tonumber(redis.call('HGET', tkey, 'max_running') or '0')
  return cap <= 0 or redis.call('SCARD', Fair.running(tkey)) < cap
end

-- A tenant with room to run one more job waits in the fair set of every level it has jobs waiting
-- on (after one of its jobs left the running set: it ended, or it was preempted).
function Fair.rejoin(tkey, fairs, clock, tenant)
  if not Fair.has_room(tkey) then return end
  for level = 0, #fairs - 1 do
    if redis.call('ZCARD', Fair.waiting_list(tkey, level)) > 0 then
      Fair.join(tkey, fairs, clock, level, tenant)
    end
  end
end

-- A job ended (in the script that ends it, once): meter it, and if it was picked (running, or
-- preempted and waiting again: it still holds its charge), correct its tenant's counter from the
-- estimate to ``prompt + generated`` (when known, >= 0), and free its running place. A preempted
-- job's earlier attempts count too: their tokens (``used``, when the end does not know better),
-- their engine time, its preemptions and its time waiting again.
-- m: {tprefix, fairs, clock, usage_day, usage_total, tokens, now (ms), day TTL (s)}
function Fair.ended(job, id, m, prompt, generated)
  local f = redis.call('HMGET', job, 'tenant', 'charged', 'started_at', 'adapter', 'used', 'run_ms', 'preemptions',
                       'preempted_ms', 'owner')
  local tenant = f[1]
  if not tenant or tenant == '' then return end
  local tkey = m.tprefix .. tenant
  if f[5] then  -- tokens used before a preemption: never counted as fewer
    local before_prompt, before_generated = string.match(f[5], '^(%d+) (%d+)$')
    prompt, generated = math.max(prompt, tonumber(before_prompt)), math.max(generated, tonumber(before_generated))
  end
  local known = prompt >= 0
  local engine_ms = tonumber(f[6] or '0')
  local running = redis.call('SREM', Fair.running(tkey), id) == 1
  if running or f[2] then
    local t = redis.call('HMGET', tkey, 'vtc', 'weight')
    local weight = tonumber(t[2] or '1')
    if weight <= 0 then weight = 1 end
    if known and f[2] then
      Fair.set_vtc(tkey, m.fairs, tenant, tonumber(t[1] or '0') + (prompt + generated - tonumber(f[2])) / weight)
    end
  end
  if running then
    if f[3] then engine_ms = engine_ms + math.max(0, math.floor(m.now - tonumber(f[3]))) end
    Fair.rejoin(tkey, m.fairs, m.clock, tenant)
  end
  -- The tenant's usage, and with an adapter also the tenant's usage of it ('<tenant>/<adapter>:').
  local metered = {tenant}
  if f[4] then table.insert(metered, tenant .. '/' .. f[4]) end
  for _, usage in ipairs({m.usage_day, m.usage_total}) do
    for _, who in ipairs(metered) do
      redis.call('HINCRBY', usage, who .. ':requests', 1)
      if known then
        redis.call('HINCRBY', usage, who .. ':prompt_tokens', prompt)
        redis.call('HINCRBY', usage, who .. ':generated_tokens', generated)
      end
      if engine_ms > 0 then redis.call('HINCRBY', usage, who .. ':engine_ms', engine_ms) end
      if f[7] then
        redis.call('HINCRBY', usage, who .. ':preemptions', f[7])
        redis.call('HINCRBY', usage, who .. ':preempted_ms', f[8] or '0')
      end
    end
  end
  redis.call('EXPIRE', m.usage_day, m.day_ttl)
  -- Nothing reads them once the job has ended (its usage is counted): a finished record keeps
  -- only what its readers need, for LLMQ_RESULT_TTL_S. Its tenant only when a gateway's header
  -- named it: otherwise it is its owner, or 'default' (JobRecord.tenant_of).
  redis.call('HDEL', job, 'estimate', 'charged', 'used', 'run_ms', 'preempted_at', 'predicted_ttft')
  if tenant == ((f[9] and f[9] ~= '') and f[9] or 'default') then redis.call('HDEL', job, 'tenant') end
  if known and prompt + generated > 0 then
    local second = math.floor(m.now / 1000)
    for _, window in ipairs({Fair.tokens(tkey), m.tokens}) do
      redis.call('HINCRBY', window, second, prompt + generated)
      redis.call('EXPIRE', window, 120)
      if redis.call('HLEN', window) > 90 then Fair.window(window, second * 1000, true) end
    end
  end
end

-- A token window's seconds of the last minute as {second, tokens}, and their sum; with ``prune``
-- older seconds are deleted on the way (never in enqueue.lua, whose first write is its record).
function Fair.window(window, now, prune)
  local since, used, seconds = math.floor(now / 1000) - 59, 0, {}
  local raw = redis.call('HGETALL', window)
  for i = 1, #raw, 2 do
    local second, tokens = tonumber(raw[i]), tonumber(raw[i + 1])
    if second < since then
      if prune then redis.call('HDEL', window, raw[i]) end
    else
      used = used + tokens
      table.insert(seconds, {second, tokens})
    end
  end
  return seconds, used
end
