-- Write a batch of events, fenced by (worker, attempt): one round trip, all-or-nothing per event.
-- KEYS[1] dead-letter stream   KEYS[2] webhook outbox   KEYS[3 .. 2+L] the model's queue streams,
--   by level (L = ARGV[5]); KEYS[3+L .. 2+2L] its fair sets; then the fair clock, today's usage,
--   the usage since the start, the model's token window (Fair.ended); then per event: job hash,
--   event log
-- ARGV[1] worker id   ARGV[2] TTL (s) of finished records and logs   ARGV[3] now (epoch ms)
-- ARGV[4] the live channels' prefix (a job's own channel is it .. job id)   ARGV[5] levels
-- ARGV[6] the tenants' key prefix   ARGV[7] TTL (s) of a day's usage
-- then per event: attempt, seq, event bytes, job id, and how many values follow: 0 for an event
--   that only goes to the log and the live path (almost every one), else 11, for what else it
--   writes ('' = none): first_token_at, prompt token ids JSON, terminal status, 'result' or
--   'error', its JSON, queue entry id, its level, '1' when it goes to the dead-letter stream,
--   the job's whole log in compact form (shared/eventlog.py) to replace the stream with, and its
--   prompt and generated tokens (-1: not known) for its tenant's share and usage.
-- Few values per event on purpose: packing them was most of a worker's own cost per token.
-- attempt 0 means unfenced (a delivery whose record is missing). An event whose job is now owned
-- by someone else, or by a later attempt, is dropped and its job returned: the caller aborts it.
-- An event already in the log (a retried script after a lost reply) is skipped, so retries are safe.
-- Live events go to the relay channel of every API process the job's record names (field
-- 'relay'), one PUBLISH per channel for the whole batch, each event a line '<job id> <event>';
-- a job with no follower recorded is published on its own live channel, one event per message.
local lost = {}
local relayed, channels = {}, {}
local levels = tonumber(ARGV[5])
local fairs = {}
for l = 1, levels do fairs[l] = KEYS[2 + levels + l] end
local base = 6 + 2 * levels  -- the per-event keys follow
local meter = {tprefix = ARGV[6], fairs = fairs, clock = KEYS[base - 3], usage_day = KEYS[base - 2],
               usage_total = KEYS[base - 1], tokens = KEYS[base], now = tonumber(ARGV[3]), day_ttl = ARGV[7]}
local a, i = 7, 0
while a < #ARGV do
  local job, log = KEYS[base + 1 + 2 * i], KEYS[base + 2 + 2 * i]
  local attempt, seq, event, id = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local more = ARGV[a + 5] ~= '0'
  local m = a + 5  -- the 11 more values are ARGV[m + 1 .. m + 11]
  local f = redis.call('HMGET', job, 'worker', 'attempt', 'relay')
  local owned = attempt == '0' or (f[1] == ARGV[1] and f[2] == attempt)
  if not owned then
    table.insert(lost, i)
  else
    -- The entry id is the seq, so XADD itself refuses an event already logged (its id would not
    -- be above the top), as it does once the log is compacted (a string): the retry check costs
    -- no extra command per event.
    local added = redis.pcall('XADD', log, seq .. '-0', 'e', event)
    if type(added) ~= 'table' or not added.err then
      if f[3] then
        for channel in string.gmatch(f[3], '%S+') do
          local lines = relayed[channel]
          if not lines then
            lines = {}
            relayed[channel] = lines
            table.insert(channels, channel)
          end
          table.insert(lines, id .. ' ' .. event)
        end
      else
        redis.call('PUBLISH', ARGV[4] .. id, event)
      end
      if seq == '1' then redis.call('EXPIRE', log, ARGV[2]) end
      if more then
        local first_token_at, prompt_ids, status = ARGV[m + 1], ARGV[m + 2], ARGV[m + 3]
        if first_token_at ~= '' then redis.call('HSET', job, 'first_token_at', first_token_at) end
        if prompt_ids ~= '' then redis.call('HSET', job, 'prompt_ids', prompt_ids) end
        if status ~= '' then
          redis.call('HSET', job, 'status', status, ARGV[m + 4], ARGV[m + 5], 'finished_at', ARGV[3])
          Fair.ended(job, id, meter, tonumber(ARGV[m + 10]), tonumber(ARGV[m + 11]))
          -- The prompt's token ids only serve a continuation, and the relay channels only live
          -- events, and a finished job has neither: for a long prompt the ids would outweigh the
          -- result for LLMQ_RESULT_TTL_S.
          redis.call('HDEL', job, 'prompt_ids', 'relay')
          redis.call('EXPIRE', job, ARGV[2])
          -- The compact log replaces the per-event stream in this same script, so a reader
          -- (read_log.lua) finds one or the other whole. Only when the stream holds exactly seqs
          -- 1..this one (ids are seqs, so its length says so): what the writer compacted is then
          -- what was logged. A retried flush finds a string here and its XADD fails: skipped.
          local compact = ARGV[m + 9]
          if compact ~= '' and redis.call('XLEN', log) == tonumber(seq) then
            redis.call('DEL', log)
            redis.call('SET', log, compact)
            redis.call('EXPIRE', log, ARGV[2])  -- not SET's EX: that refuses a TTL <= 0, EXPIRE deletes
          else
            redis.call('EXPIRE', log, ARGV[2])
          end
          -- In the same script as the end, so a finished job's webhook can never be forgotten.
          if redis.call('HEXISTS', job, 'webhook') == 1 then
            redis.call('XADD', KEYS[2], '*', 'job', id)
          end
          local entry = ARGV[m + 6]
          if entry ~= '' then
            if ARGV[m + 8] == '1' then
              -- The dead-letter stream is a record for operators, so it may be trimmed (never the queue).
              redis.call('XADD', KEYS[1], 'MAXLEN', '~', 10000, '*', 'job', id,
                'entry', entry, 'attempts', attempt, 'at', ARGV[3])
            end
            -- Only entries delivered to us get here: acked and deleted together (no PEL leak).
            local queue = KEYS[3 + tonumber(ARGV[m + 7])]
            redis.call('XACK', queue, 'workers', entry)
            redis.call('XDEL', queue, entry)
          end
        end
      end
    end
  end
  a, i = a + (more and 16 or 5), i + 1
end
-- In first-seen order (a table's pairs() order is not defined).
for _, channel in ipairs(channels) do
  redis.call('PUBLISH', channel, table.concat(relayed[channel], '\n'))
end
return lost
