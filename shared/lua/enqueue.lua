-- Atomically admit, record and queue a job (one round trip, one slot: all keys share the model tag).
-- KEYS[1] job hash   KEYS[2] the tenant's hash   KEYS[3] the model's tenants   KEYS[4] the fair clock
--   then per level (ARGV[4] of them), 3 keys: queue stream, waiting stream, fair set;
--   last, optional: idempotency key
-- ARGV[1] job id   ARGV[2] idempotency TTL (s)   ARGV[3] depth limit   ARGV[4] number of levels
-- ARGV[5] the job's level (0-based)   ARGV[6] tenant   ARGV[7] its weight   ARGV[8] max_running
--   ARGV[9] max_queued   ARGV[10] tokens_per_minute (-1: no limit for these three)
--   ARGV[11] now (epoch ms)   ARGV[12..] job hash field, value, ...
-- Returns the job id that owns the request (ours, or the earlier one for a repeated key), or a
-- refusal: {'full', depth} when the model holds the limit of unfinished jobs; {'queued', running,
-- waiting} when the tenant may have no more jobs waiting; {'tokens', used, retry after (s)} when
-- its last minute's tokens reached its limit.
-- Checks and writes in one script, so concurrent submitters can never overshoot a limit.
local levels = tonumber(ARGV[4])
local idem = KEYS[5 + 3 * levels]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return existing end
end
local tkey, tenant = KEYS[2], ARGV[6]
local fairs, depth, waiting = {}, 0, 0
for l = 0, levels - 1 do
  local k = 5 + 3 * l
  depth = depth + redis.call('XLEN', KEYS[k]) + redis.call('XLEN', KEYS[k + 1])
  waiting = waiting + redis.call('LLEN', Fair.waiting_list(tkey, l))
  fairs[l + 1] = KEYS[k + 2]
end
if depth >= tonumber(ARGV[3]) then return {'full', depth} end

local max_running, max_queued = tonumber(ARGV[8]), tonumber(ARGV[9])
local per_minute, now = tonumber(ARGV[10]), tonumber(ARGV[11])
local running = redis.call('SCARD', tkey .. ':running')
if max_queued >= 0 then
  -- How many of the tenant's jobs would wait with this one: all of them, or, under a running
  -- limit, those beyond it (a job that can start at once under the limit never counts as waiting).
  local would_wait = waiting + 1
  if max_running > 0 then would_wait = running + waiting + 1 - max_running end
  if would_wait > max_queued then return {'queued', running, waiting} end
end
if per_minute >= 0 then
  local seconds, used = Fair.window(tkey .. ':tokens', now)
  if used >= per_minute then
    -- Retry once enough of the window's oldest seconds have left it to bring it under the limit.
    table.sort(seconds, function(a, b) return a[1] < b[1] end)
    local left, retry = used, 60
    for _, s in ipairs(seconds) do
      left = left - s[2]
      if left < per_minute then retry = s[1] + 60 - math.floor(now / 1000); break end
    end
    return {'tokens', used, math.max(1, retry)}
  end
end

if idem then redis.call('SET', idem, ARGV[1], 'EX', ARGV[2]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 12))
local level = tonumber(ARGV[5])
local entry = redis.call('XADD', KEYS[6 + 3 * level], '*', 'job', ARGV[1], 'tenant', tenant)
redis.call('RPUSH', Fair.waiting_list(tkey, level), entry .. ' ' .. ARGV[1])
redis.call('HSET', tkey, 'weight', ARGV[7], 'max_running', math.max(max_running, 0))
redis.call('ZADD', KEYS[3], 'NX', now, tenant)
-- At its running limit it joins the fair set when one of its jobs ends (Fair.ended).
if Fair.has_room(tkey) then Fair.join(tkey, fairs, KEYS[4], level, tenant) end
return ARGV[1]
