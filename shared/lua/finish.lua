-- The model-slot half of a flush (flush.lua writes the logs, in token shards): what a batch's events
-- write to their jobs' records, fenced by the record's attempt. A first token stores its time (the
-- prompt's token ids are logged with their event, in the shard: flush.lua); a terminal event (logged first, its ending kept in
-- the shard: Keys.ending) ends the job here: the record's outcome and compact log, its tenant's
-- meter, the webhook outbox, XACK + XDEL of its queue entry, the dead letters. Also run by a
-- claimer that found a job's terminal event logged and its record not ended (take.lua: 'ended'),
-- with its own attempt, and by an API ending a job (expire).
-- Slots: shared/scripts.py, FINISH and finish(). With a terminal event among the items (levels > 0)
-- the ending keys and per level its queue and fair set; per item its record (KEYS) and its values.
-- attempt 0 (a delivery whose record is missing) is unfenced.
-- Returns the (0-based) indexes of the items refused (another attempt holds the record). A record
-- already ended at the item's attempt (a retry after a lost reply) is left as it is.
local group, result_ttl, now, tenant_prefix, day_ttl, levels, ending_at, levels_at, levels_width,
      jobs_at, jobs_width, items_at, items_width = unpack(ARGV, 1, 13)
levels, ending_at = tonumber(levels), tonumber(ending_at)
levels_at, levels_width = tonumber(levels_at), tonumber(levels_width)
jobs_at, jobs_width = tonumber(jobs_at), tonumber(jobs_width)
items_at, items_width = tonumber(items_at), tonumber(items_width)

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
  local finished = KEYS[ending_at + 6]
  ending = {ttl = result_ttl, webhooks = webhooks, dead_letters = dead_letters, finished = finished,
            meter = {tprefix = tenant_prefix, fairs = fairs, clock = clock, usage_day = usage_day,
                     usage_total = usage_total, tokens = tokens, now = tonumber(now), day_ttl = day_ttl}}
end

local refused = {}
for i, a, j in Items.each(items_at, items_width, jobs_at, jobs_width) do
  local job = KEYS[j]
  local job_id, attempt, first_token_at, status = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local field, payload, entry, entry_level, dead = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8]
  local compact, prompt_tokens, generated_tokens, finished_at = ARGV[a + 9], ARGV[a + 10], ARGV[a + 11], ARGV[a + 12]
  -- The writer's own end time when it sent one (its ending has the same, for reads before this).
  if finished_at == '' then finished_at = now end
  local f = redis.call('HMGET', job, 'attempt', 'status')
  -- attempt 0 is unfenced (a delivery whose record is missing).
  local ok = attempt == '0' or f[1] == attempt
  -- Ended at this attempt already: this is a retry whose first reply was lost; nothing to write.
  local done = f[2] == 'done' or f[2] == 'failed' or f[2] == 'cancelled'
  if not ok then
    table.insert(refused, i)
  elseif not done then
    if first_token_at ~= '' then redis.call('HSET', job, 'first_token_at', first_token_at) end
    if status ~= '' then
      Job.finish(job, job_id, ending, {'status', status, field, payload, 'finished_at', finished_at},
                 compact, tonumber(prompt_tokens), tonumber(generated_tokens))
      if entry ~= '' then
        if dead == '1' then
          -- The dead-letter stream is a record for operators, so it may be trimmed (never the queue).
          redis.call('XADD', ending.dead_letters, 'MAXLEN', '~', 10000, '*', 'job', job_id, 'entry', entry,
                     'attempts', attempt, 'at', now)
        end
        -- Each level's throughput (the console's, shared/browse.py): jobs ended after a delivery.
        redis.call('HINCRBY', ending.finished, entry_level, 1)
        -- Only entries delivered to us get here: acked and deleted together (no PEL leak).
        local queue = queues[tonumber(entry_level)]
        redis.call('XACK', queue, group, entry)
        redis.call('XDEL', queue, entry)
      end
    end
  end
end
return refused
