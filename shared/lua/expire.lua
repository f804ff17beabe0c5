-- End a job whose deadline passed and that nobody ended: called by the API (a client waiting on
-- it, or a poll). A queued job ends at its deadline; a running one only after a grace period, as
-- its worker aborts it at the deadline itself and this is the backstop for a worker that cannot.
-- With at_once = '1' the job ends now, whatever its deadline: a waiting client's cold wait ran
-- out (no warm worker served the model for LLMQ_COLD_WAIT_S), so no worker is running it either;
-- or the job is being deleted.
-- Slots: shared/scripts.py, EXPIRE and expire().
-- Bumping the attempt, and taking the job out of its owner's owned-jobs hash (Job.finish), fences
-- off the owner: its later writes are refused, so it aborts the job and writes nothing. The stream entry stays until a worker reads or reclaims it and finds the
-- job finished (claim.lua), which acks and deletes it.
-- Returns 1 when this call ended the job, else 0.
local job, log, webhooks, clock, usage_day, usage_total, tokens = unpack(KEYS, 1, 7)
local now, grace, result_ttl, live_prefix, event_tail, error_json, job_id, at_once, tenant_prefix, day_ttl,
      owned_prefix, levels, levels_at, levels_width = unpack(ARGV, 1, 14)
levels, levels_at, levels_width = tonumber(levels), tonumber(levels_at), tonumber(levels_width)

local f = redis.call('HMGET', job, 'status', 'deadline', 'relay', 'worker')
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
           {ttl = result_ttl, webhooks = webhooks, owned = f[4] and f[4] ~= '' and owned_prefix .. f[4] or nil,
            meter = {tprefix = tenant_prefix, fairs = fairs, clock = clock, usage_day = usage_day,
                     usage_total = usage_total, tokens = tokens, now = tonumber(now), day_ttl = day_ttl}},
           {'worker', '', 'status', 'failed', 'error', error_json, 'finished_at', now}, seq, '', -1, -1)
local outbox = Job.outbox()
Job.relay(outbox, f[3], live_prefix, job_id, event)
Job.send(outbox)
return 1
