-- Claiming one delivered job for a worker, shared by claim_taken.lua (entries taken over from
-- another worker) and read.lua (the jobs it picks, claimed in the same script): a library,
-- shared/scripts.py puts it before them.
local Claim = {}

-- key: the job hash; worker, now (epoch ms), max failed deliveries; lead: the ms the worker takes
-- from a start to the first token (its measured mean; nil: 0).
-- Returns {state, request, queued_at, attempt, deadline, traceparent,
--          lost_worker, lost_started, tenant, relay, preemptions, predicted_ttft}; state is
--   'missing'   no record (expired or never written): the caller only acks the entry;
--   'finished'  already terminal (the entry outlived its job): the caller only acks it;
--   'cancelled' cancelled before (re)start;   'dead' out of deliveries;
--   'expired'   its deadline passed (it never reaches the engine);
--   'late'      its first-token deadline passed before it ever started, or passes before the
--               worker could send a first token (``lead``): it never reaches the engine, whose slot
--               goes to a job that can still make it. A job that ran before, preempted or lost,
--               may have sent tokens, and is never ended by it;   'run' start it.
-- lost_worker/lost_started: the worker and start of the previous attempt when it was lost (the
-- record still says running under another worker: it died or stalled; a hand-back says queued),
-- for its trace ('' otherwise).
-- Every state but missing/finished takes ownership: attempt += 1 and worker = us. That bump is
-- the fence: any write of an earlier owner (flush.lua, renew.lua check worker and attempt) now
-- fails, so a worker that lost its lease can write nothing more about the job. The job's log is in
-- its token shard (Keys.events), another slot: the claimer fences the shard at the new attempt next
-- (take.lua: its previous worker's flushes are then refused there), which also says where its log
-- ends.
function Claim.start(key, worker, now, max_failed, lead)
  local f = redis.call('HMGET', key, 'request', 'queued_at', 'cancel', 'status', 'attempt', 'handoffs', 'deadline',
                       'traceparent', 'worker', 'started_at', 'tenant', 'relay', 'preempted_at', 'preemptions',
                       'runs', 'first_token_deadline', 'predicted_ttft')
  if not f[1] then
    return {'missing', '', '0', 0, '', '', '', '', '', '', 0, ''}
  elseif f[4] == 'done' or f[4] == 'failed' or f[4] == 'cancelled' then
    return {'finished', '', '0', 0, '', '', '', '', '', '', 0, ''}
  end
  -- Deliveries that ended without a hand-back: crashes or stalls.
  local failed = tonumber(f[5] or '0') - tonumber(f[6] or '0')
  local lost_worker, lost_started = '', ''
  if f[4] == 'running' and f[9] and f[9] ~= '' and f[9] ~= worker then
    lost_worker, lost_started = f[9], f[10] or ''
  end
  if f[13] then  -- preempted (preempt.lua): the time it waited again, for its record and its tenant's usage
    redis.call('HINCRBY', key, 'preempted_ms', math.max(0, math.floor(tonumber(now) - tonumber(f[13]))))
    redis.call('HDEL', key, 'preempted_at')
  end
  local attempt = redis.call('HINCRBY', key, 'attempt', 1)
  -- 'runs': each attempt as '<attempt>@<worker>@<epoch ms>', space-separated, oldest first: who ran
  -- the job, a takeover or a preemption showing as one more (the console's job view). Job.finish
  -- drops it when there was only one.
  local run = attempt .. '@' .. worker .. '@' .. math.floor(tonumber(now))
  redis.call('HSET', key, 'worker', worker, 'runs', f[15] and (f[15] .. ' ' .. run) or run)
  local state = 'run'
  if f[3] == '1' then
    state = 'cancelled'
  elseif f[7] and tonumber(f[7]) <= tonumber(now) then
    state = 'expired'
  elseif f[16] and tonumber(f[16]) <= tonumber(now) + tonumber(lead or 0) and not f[10] and not f[14] then
    state = 'late'
  elseif failed >= tonumber(max_failed) then
    state = 'dead'
  else
    redis.call('HSET', key, 'status', 'running', 'started_at', now)
  end
  return {state, f[1], f[2] or '0', attempt, f[7] or '', f[8] or '', lost_worker, lost_started, f[11] or '',
          f[12] or '', tonumber(f[14] or '0'), f[17] or ''}
end
