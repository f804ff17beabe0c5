-- Claim delivered jobs for one worker: one round trip for the whole batch.
-- KEYS[i] job hash of the i-th delivered entry
-- ARGV[1] worker id   ARGV[2] now (epoch ms)
-- Returns, per job: {state, request, queued_at, attempt} where state is
-- 'run', 'missing' (record expired or never written) or 'cancelled' (cancelled before delivery).
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('HMGET', key, 'request', 'queued_at', 'cancel')
  if not f[1] then
    out[i] = {'missing', '', '0', 0}
  elseif f[3] == '1' then
    out[i] = {'cancelled', f[1], f[2] or '0', 0}
  else
    local attempt = redis.call('HINCRBY', key, 'attempt', 1)
    redis.call('HSET', key, 'status', 'running', 'worker', ARGV[1], 'started_at', ARGV[2])
    out[i] = {'run', f[1], f[2] or '0', attempt}
  end
end
return out
