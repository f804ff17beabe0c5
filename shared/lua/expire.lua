-- End a job whose deadline passed and that nobody ended: called by the API (a client waiting on
-- it, or a poll). A queued job ends at its deadline; a running one only after a grace period, as
-- its worker aborts it at the deadline itself and this is the backstop for a worker that cannot.
-- With at_once = '1' the job ends now, whatever its deadline: a waiting client's cold wait ran
-- out (no warm worker served the model for LLMQ_COLD_WAIT_S), so no worker is running it either;
-- or the job is being deleted.
-- Slots: shared/scripts.py, EXPIRE and expire().
-- Bumping the attempt fences off the owner: its later writes are refused, so it aborts the job
-- and writes nothing. The stream entry stays until a worker reads or reclaims it and finds the
-- job finished (claim.lua), which acks and deletes it.
-- Returns 1 when this call ended the job, else 0.
local job = KEYS[1]
local log = KEYS[2]
local webhooks = KEYS[3]
local clock = KEYS[4]
local usage_day = KEYS[5]
local usage_total = KEYS[6]
local tokens = KEYS[7]
local now = ARGV[1]
local grace = ARGV[2]
local result_ttl = ARGV[3]
local live = ARGV[4]
local event_tail = ARGV[5]
local error_json = ARGV[6]
local job_id = ARGV[7]
local at_once = ARGV[8]
local tenant_prefix = ARGV[9]
local day_ttl = ARGV[10]
local levels = tonumber(ARGV[11])
local levels_at = tonumber(ARGV[12])
local levels_width = tonumber(ARGV[13])

local f = redis.call('HMGET', job, 'status', 'deadline', 'relay')
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
if at_once ~= '1' then
  if not f[2] then return 0 end
  local due = tonumber(f[2])
  if f[1] == 'running' then due = due + tonumber(grace) end
  if tonumber(now) < due then return 0 end
end
local fairs = {}
for l = 0, levels - 1 do
  local k = levels_at + l * levels_width
  local fair = KEYS[k]
  fairs[l + 1] = fair
end
local seq = Job.last_seq(log) + 1
local event = '{"type":"error","seq":' .. seq .. ',' .. event_tail
redis.call('HINCRBY', job, 'attempt', 1)
redis.call('XADD', log, seq .. '-0', 'e', event)
Job.finish(job, log, job_id,
           {ttl = result_ttl, webhooks = webhooks,
            meter = {tprefix = tenant_prefix, fairs = fairs, clock = clock, usage_day = usage_day,
                     usage_total = usage_total, tokens = tokens, now = tonumber(now), day_ttl = day_ttl}},
           {'worker', '', 'status', 'failed', 'error', error_json, 'finished_at', now}, seq, '', -1, -1)
local outbox = Job.outbox()
Job.relay(outbox, f[3], live, job_id, event)
Job.send(outbox)
return 1
