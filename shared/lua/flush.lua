-- Write a batch of events, fenced by (worker, attempt): one round trip, all-or-nothing per event.
-- Slots: shared/scripts.py, FLUSH and flush(). First the worker's owned-jobs hash (Keys.owned).
-- With a terminal event in the batch (levels > 0), then the keys a job's end writes (the ending
-- group: dead letters, webhooks, the tenant meter's) and per level its queue and fair set; a batch without one sends none of them. Per event: its
-- attempt, seq, event bytes and job id (ARGV; its record's and log's names are the prefixes
-- job_prefix and log_prefix plus the job id: every key of a model shares its hash tag, as in
-- read.lua, and two names fewer per event were a third of the bytes a token cost); then, for the few
-- events that write more than the log and the live path, an extra each: the event's index and
-- what it writes ('' = none).
-- attempt 0 means unfenced (a delivery whose record is missing). An event whose job is now owned
-- by someone else, or by a later attempt, is dropped and its job returned: the caller aborts it.
-- An event already in the log (a retried script after a lost reply) is skipped, so retries are safe.
-- Live events go to the relay channel of every API process the job's record names (field
-- 'relay', read from the owned-jobs hash), one PUBLISH per channel for the whole batch (Job.relay); a job with no follower
-- recorded is published on its own live channel, one event per message.
-- Returns the (0-based) indexes of the events refused, and per event not written after a gap in
-- its log its index and the number of events its log holds (flat pairs).
local owned = KEYS[1]
local group, result_ttl, now, live_prefix, tenant_prefix, job_prefix, log_prefix, day_ttl,
      levels, ending_at, levels_at, levels_width, events_at, events_width, extras_at, extras_width = unpack(ARGV, 1, 16)
levels, ending_at = tonumber(levels), tonumber(ending_at)
levels_at, levels_width = tonumber(levels_at), tonumber(levels_width)
events_at, events_width = tonumber(events_at), tonumber(events_width)
extras_at, extras_width = tonumber(extras_at), tonumber(extras_width)

-- The keys a job's end writes come only with a batch that ends a job (levels > 0); a batch of
-- tokens reads none of them.
local queues, ending = {}, nil
if levels > 0 then
  local fairs = {}
  for l = 0, levels - 1 do
    local k = levels_at + l * levels_width
    local queue, fair = KEYS[k], KEYS[k + 1]
    queues[l], fairs[l + 1] = queue, fair
  end
  local dead_letters, webhooks, clock = KEYS[ending_at], KEYS[ending_at + 1], KEYS[ending_at + 2]
  local usage_day, usage_total, tokens = KEYS[ending_at + 3], KEYS[ending_at + 4], KEYS[ending_at + 5]
  ending = {ttl = result_ttl, webhooks = webhooks, dead_letters = dead_letters, owned = owned,
            meter = {tprefix = tenant_prefix, fairs = fairs, clock = clock, usage_day = usage_day,
                     usage_total = usage_total, tokens = tokens, now = tonumber(now), day_ttl = day_ttl}}
end
local extra_of = {}  -- event index -> where its extra starts
for x = extras_at, #ARGV, extras_width do
  local index = ARGV[x]
  extra_of[tonumber(index)] = x
end

-- Who owns each job of the batch, read once for the whole batch: this worker's owned-jobs hash
-- (Keys.owned) holds, per job it owns, its attempt and its followers, kept equal to the records by
-- every script that changes a job's owner, attempt or followers (claim.lua, renew.lua's hand-back,
-- expire.lua, Job.finish, add_follower.lua). A job not in it (taken by a peer, expired, ended) or
-- there at another attempt is fenced, as a record naming another worker or attempt was. Unfenced
-- events (attempt 0: a delivery whose record is missing) read their record's followers instead.
local held, ids = {}, {}
for a = events_at, extras_at - 1, events_width do
  local attempt, job_id = ARGV[a], ARGV[a + 3]
  if attempt ~= '0' and held[job_id] == nil then
    held[job_id] = false
    table.insert(ids, job_id)
  end
end
for first = 1, #ids, 4000 do  -- one HMGET unless a batch names more jobs than unpack() takes
  local chunk = {unpack(ids, first, math.min(first + 3999, #ids))}
  local values = redis.call('HMGET', owned, unpack(chunk))
  for n, job_id in ipairs(chunk) do
    if values[n] then
      local attempt, followers = string.match(values[n], '^(%d+) ?(.*)$')
      held[job_id] = {attempt = attempt, relay = followers ~= '' and followers or false}
    end
  end
end

local lost, gaps, outbox = {}, {}, Job.outbox()
-- Per log: how many events it holds when that is fewer than the seq before this batch's first event
-- of it (a gap), else false. Ids are seqs 1..n with none deleted, so its length is its top. A gap
-- is what a Redis failover leaves when it takes back the last events a worker wrote: its later
-- events are not written after it (a reader would skip the missing ones); the worker writes the
-- missing ones again first (workers/runner.py).
local logged_before = {}
local ended, ENDED = {}, {err = 'WRONGTYPE the job ended: its log is compact'}  -- skipped as logged
local i = 0
for a = events_at, extras_at - 1, events_width do
  local attempt, seq, event, job_id = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local job, log = job_prefix .. job_id, log_prefix .. job_id
  local owner = held[job_id]
  local fenced = attempt ~= '0' and not (owner and owner.attempt == attempt)
  -- The entry id is the seq, so XADD itself refuses an event already logged (its id would not be
  -- above the top), as it does once the log is compacted (a string): the retry check costs no
  -- extra command per event. Any other error is Redis refusing writes (OOM, READONLY, NOREPLICAS),
  -- which it does only at a script's first write, so nothing is written yet: the script fails,
  -- and the worker keeps the batch and retries it (skipping an event as logged would drop it).
  if not fenced and logged_before[log] == nil then
    local n = redis.pcall('XLEN', log)  -- a compact log (a string): the job has ended, XADD refuses
    -- No stream, and the record holds the compact log (Job.finish): ended too, nothing is added.
    ended[log] = n == 0 and redis.call('HEXISTS', job, 'log') == 1
    logged_before[log] = type(n) == 'number' and n < tonumber(seq) - 1 and n
  end
  local gap = not fenced and not ended[log] and logged_before[log]
  local added = not fenced and not gap and (ended[log] and ENDED or redis.pcall('XADD', log, seq .. '-0', 'e', event))
  if added and added.err and not (string.find(added.err, 'equal or smaller than the target stream top', 1, true)
                                  or string.find(added.err, 'WRONGTYPE', 1, true)) then
    return redis.error_reply(added.err)
  end
  if fenced then
    table.insert(lost, i)
  elseif gap then
    table.insert(gaps, i)
    table.insert(gaps, gap)
  elseif not added.err then
    Job.relay(outbox, owner and owner.relay or (attempt == '0' and redis.call('HGET', job, 'relay')), live_prefix,
              job_id, event)
    if seq == '1' then redis.call('EXPIRE', log, result_ttl) end
    local x = extra_of[i]
    if x then
      local first_token_at, prompt_ids, status = ARGV[x + 1], ARGV[x + 2], ARGV[x + 3]
      local field, payload, entry, entry_level = ARGV[x + 4], ARGV[x + 5], ARGV[x + 6], ARGV[x + 7]
      local dead, compact, prompt_tokens, generated_tokens = ARGV[x + 8], ARGV[x + 9], ARGV[x + 10], ARGV[x + 11]
      if first_token_at ~= '' then redis.call('HSET', job, 'first_token_at', first_token_at) end
      if prompt_ids ~= '' then redis.call('HSET', job, 'prompt_ids', prompt_ids) end
      if status ~= '' then
        Job.finish(job, log, job_id, ending, {'status', status, field, payload, 'finished_at', now}, seq, compact,
                   tonumber(prompt_tokens), tonumber(generated_tokens))
        if entry ~= '' then
          if dead == '1' then
            -- The dead-letter stream is a record for operators, so it may be trimmed (never the queue).
            redis.call('XADD', ending.dead_letters, 'MAXLEN', '~', 10000, '*', 'job', job_id, 'entry', entry,
                       'attempts', attempt, 'at', now)
          end
          -- Only entries delivered to us get here: acked and deleted together (no PEL leak).
          local queue = queues[tonumber(entry_level)]
          redis.call('XACK', queue, group, entry)
          redis.call('XDEL', queue, entry)
        end
      end
    end
  end
  i = i + 1
end
Job.send(outbox)
return {lost, gaps}
