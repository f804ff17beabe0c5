-- Write a batch of events, fenced by (worker, attempt): one round trip, all-or-nothing per event.
-- KEYS[1] dead-letter stream   KEYS[2] webhook outbox
--   then per event: job hash, event log, the queue stream it came from
-- ARGV[1] worker id   ARGV[2] TTL (s) of finished records and logs   ARGV[3] now (epoch ms)
-- then per event 12 values: attempt, seq, event bytes, live channel, first_token_at,
--   terminal status ('' for token events), 'result' or 'error', its JSON, queue entry id,
--   the job id when it goes to the dead-letter stream (else ''), prompt token ids JSON, job id.
-- attempt 0 means unfenced (a delivery whose record is missing). An event whose job is now owned
-- by someone else, or by a later attempt, is dropped and its job returned: the caller aborts it.
-- An event already in the log (a retried script after a lost reply) is skipped, so retries are safe.
local lost = {}
local per = 12
for i = 0, (#ARGV - 3) / per - 1 do
  local a = 3 + i * per
  local job, log, queue = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  local attempt = ARGV[a + 1]
  local owned = true
  if attempt ~= '0' then
    local f = redis.call('HMGET', job, 'worker', 'attempt')
    owned = f[1] == ARGV[1] and f[2] == attempt
  end
  if not owned then
    table.insert(lost, i)
  else
    local seq = ARGV[a + 2]
    -- The entry id is the seq, so XADD itself refuses an event already logged (its id would not
    -- be above the top): the retry check costs no extra command per event.
    local added = redis.pcall('XADD', log, seq .. '-0', 'e', ARGV[a + 3])
    if type(added) ~= 'table' or not added.err then
      redis.call('PUBLISH', ARGV[a + 4], ARGV[a + 3])
      if seq == '1' then redis.call('EXPIRE', log, ARGV[2]) end
      if ARGV[a + 5] ~= '' then redis.call('HSET', job, 'first_token_at', ARGV[a + 5]) end
      if ARGV[a + 11] ~= '' then redis.call('HSET', job, 'prompt_ids', ARGV[a + 11]) end
      local status = ARGV[a + 6]
      if status ~= '' then
        redis.call('HSET', job, 'status', status, ARGV[a + 7], ARGV[a + 8], 'finished_at', ARGV[3])
        redis.call('EXPIRE', job, ARGV[2])
        redis.call('EXPIRE', log, ARGV[2])
        -- In the same script as the end, so a finished job's webhook can never be forgotten.
        if redis.call('HEXISTS', job, 'webhook') == 1 then
          redis.call('XADD', KEYS[2], '*', 'job', ARGV[a + 12])
        end
        local entry = ARGV[a + 9]
        if entry ~= '' then
          if ARGV[a + 10] ~= '' then
            -- The dead-letter stream is a record for operators, so it may be trimmed (never the queue).
            redis.call('XADD', KEYS[1], 'MAXLEN', '~', 10000, '*', 'job', ARGV[a + 10],
              'entry', entry, 'attempts', attempt, 'at', ARGV[3])
          end
          -- Only entries delivered to us get here: acked and deleted together (no PEL leak).
          redis.call('XACK', queue, 'workers', entry)
          redis.call('XDEL', queue, entry)
        end
      end
    end
  end
end
return lost
