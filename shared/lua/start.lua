-- Claim delivered jobs for one worker (new entries and reclaimed ones): one round trip per batch.
-- KEYS[2i-1] job hash of the i-th entry   KEYS[2i] its event log
-- ARGV[1] worker id   ARGV[2] now (epoch ms)   ARGV[3] max failed deliveries before dead letter
-- Returns, per job: {state, request, queued_at, attempt, last_seq, prompt_ids, deadline}; state is
--   'missing'   no record (expired or never written): the caller only acks the entry;
--   'finished'  already terminal (the entry outlived its job): the caller only acks it;
--   'cancelled' cancelled before (re)start;   'dead' out of deliveries;
--   'expired'   its deadline passed (it never reaches the engine);   'run' start it.
-- Every state but missing/finished takes ownership: attempt += 1 and worker = us. That bump is
-- the fence: any write of an earlier owner (flush.lua, renew.lua check worker and attempt) now
-- fails, so a worker that lost its lease can write nothing more about the job.
local out = {}
for i = 1, #KEYS, 2 do
  local key = KEYS[i]
  local f = redis.call('HMGET', key, 'request', 'queued_at', 'cancel', 'status', 'attempt', 'handoffs', 'prompt_ids', 'deadline')
  local n = (i + 1) / 2
  if not f[1] then
    out[n] = {'missing', '', '0', 0, 0, '', ''}
  elseif f[4] == 'done' or f[4] == 'failed' or f[4] == 'cancelled' then
    out[n] = {'finished', '', '0', 0, 0, '', ''}
  else
    local last = redis.call('XREVRANGE', KEYS[i + 1], '+', '-', 'COUNT', 1)
    local last_seq = 0
    if last[1] then last_seq = tonumber(string.match(last[1][1], '^(%d+)')) end
    -- Deliveries that ended without a hand-back: crashes or stalls.
    local failed = tonumber(f[5] or '0') - tonumber(f[6] or '0')
    local attempt = redis.call('HINCRBY', key, 'attempt', 1)
    redis.call('HSET', key, 'worker', ARGV[1])
    local state = 'run'
    if f[3] == '1' then
      state = 'cancelled'
    elseif f[8] and tonumber(f[8]) <= tonumber(ARGV[2]) then
      state = 'expired'
    elseif failed >= tonumber(ARGV[3]) then
      state = 'dead'
    else
      redis.call('HSET', key, 'status', 'running', 'started_at', ARGV[2])
    end
    out[n] = {state, f[1], f[2] or '0', attempt, last_seq, f[7] or '', f[8] or ''}
  end
end
return out
