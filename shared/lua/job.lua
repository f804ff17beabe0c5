-- A job's log, its live events and its end, shared by the scripts that write them (a library:
-- shared/scripts.py puts it before them): flush.lua (a batch's events, in token shards), take.lua
-- (a claimed job's last seq), finish.lua (the record's end).
local Job = {}

-- The seq of the newest event in a job's log stream (0: none yet). Its entry ids are its seqs.
function Job.last_seq(log)
  local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)
  if last[1] then return tonumber(string.match(last[1][1], '^(%d+)')) end
  return 0
end

-- Live events on their way out, gathered by Job.relay and sent by Job.send: one message per
-- relay channel (an API process following jobs), each event a line '<job id> <event>'.
function Job.outbox()
  return {lines = {}, channels = {}}
end

-- Send ``event`` of job ``id`` to every follower its record names (``followers``: its 'relay'
-- field, channels separated by spaces), or, with none named, at once on its own live channel
-- (``live_prefix`` .. ``id``: built only then, as this runs once per event).
function Job.relay(outbox, followers, live_prefix, id, event)
  if not followers then
    redis.call('PUBLISH', live_prefix .. id, event)
    return
  end
  for channel in string.gmatch(followers, '%S+') do
    local lines = outbox.lines[channel]
    if not lines then
      lines = {}
      outbox.lines[channel] = lines
      table.insert(outbox.channels, channel)
    end
    table.insert(lines, id .. ' ' .. event)
  end
end

-- One PUBLISH per channel, in first-seen order (a table's pairs() order is not defined).
function Job.send(outbox)
  for _, channel in ipairs(outbox.channels) do
    redis.call('PUBLISH', channel, table.concat(outbox.lines[channel], '\n'))
  end
end

-- End a job, once, in the script that writes its record's end (finish.lua; its terminal event is in
-- its log already, flush.lua): the record's outcome (``outcome``: field, value pairs), its tenant's
-- meter (Fair.ended: ``prompt`` and ``generated`` tokens, -1 when not known), its TTL, its compact
-- log, the webhook outbox.
-- e: {ttl (s) of a finished job's keys, webhooks (the outbox stream), meter (Fair.ended's)}
function Job.finish(job, id, e, outcome, compact, prompt, generated)
  redis.call('HSET', job, unpack(outcome))
  -- Its token counts, '<prompt> <generated>', a field of their own: a list of jobs reads them
  -- without the result's text (shared/browse.py).
  if prompt >= 0 then redis.call('HSET', job, 'tokens', prompt .. ' ' .. generated) end
  -- One attempt says no more than the record's worker and started_at: a finished job keeps its
  -- runs only when it took several (a finished record's every byte lasts LLMQ_RESULT_TTL_S).
  local runs = redis.call('HGET', job, 'runs')
  if runs and not string.find(runs, ' ', 1, true) then redis.call('HDEL', job, 'runs') end
  Fair.ended(job, id, e.meter, prompt, generated)
  -- The relay channels only serve live events, and a finished job has none.
  redis.call('HDEL', job, 'relay')
  redis.call('EXPIRE', job, e.ttl)
  -- The compact log goes in the record's 'log' field, not a key of its own: a key costs Redis
  -- ~200 bytes of bookkeeping (its name, entries in the keyspace and expiry tables) for
  -- LLMQ_RESULT_TTL_S, as much as the log itself. Given only when the writer holds the whole log
  -- and its shard's stream held exactly seqs 1..the terminal one (flush.lua's 'whole'); the stream
  -- is then dropped (settle.lua), and a reader (Queue.read_events) reads the stream while it exists,
  -- else this field.
  if compact ~= '' then redis.call('HSET', job, 'log', compact) end
  -- In the same script as the end, so a finished job's webhook can never be forgotten.
  if redis.call('HEXISTS', job, 'webhook') == 1 then
    redis.call('XADD', e.webhooks, '*', 'job', id)
  end
end
