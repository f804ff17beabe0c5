-- Write a batch of events to their logs in token shards (Keys.fence): one round trip, all-or-nothing
-- per event, fenced per job by the attempt its shard's fence holds (take.lua installs it after the
-- claim). Slots: shared/scripts.py, FLUSH and flush(). Per shard: its fence (KEYS) and its live
-- channels' and ending keys' prefixes (ARGV); per event: its log (KEYS) and attempt, seq, event
-- bytes, job id and its shard's index in this call (ARGV); per terminal event its index and what
-- the job's record must say once it has ended (the ending group, kept in Keys.ending until the
-- record says it: finish.lua, then settle.lua); per event that carries the prompt's token ids
-- (an attempt's first) its index and the ids, logged in its entry's 'p' field, so whoever reads a
-- token in the log reads the ids to continue after it in the same entries. On a Cluster every shard of one call is one
-- shard (one slot); a single Redis takes every shard of a batch in one call.
-- attempt 0 means unfenced (a delivery whose record is missing). An event whose job's fence names
-- another attempt (or none: taken by an API's expire, or ended and settled) is dropped and its job
-- returned: the caller aborts it. An event already in the log (a retried script after a lost
-- reply) is skipped, so retries are safe.
-- Live events go to the relay channel of every API process the job's fence entry names, one
-- PUBLISH per channel for the whole batch (Job.relay); a job with no follower recorded is
-- published on its own live channel, one event per message.
-- Returns {lost, gaps, whole}: the (0-based) indexes of the events refused; per event not written
-- after a gap in its log its index and the number of events its log holds (flat pairs); the
-- indexes of the terminal events written whose log then held every seq 1..theirs (whole: its
-- compact form may replace it).
local writer, result_ttl, shards_at, shards_width, event_keys_at, event_keys_width, shard_args_at, shard_args_width,
      events_at, events_width, endings_at, endings_width, prompts_at, prompts_width = unpack(ARGV, 1, 14)
shards_at, shards_width = tonumber(shards_at), tonumber(shards_width)
event_keys_at, event_keys_width = tonumber(event_keys_at), tonumber(event_keys_width)
shard_args_at, shard_args_width = tonumber(shard_args_at), tonumber(shard_args_width)
events_at, events_width = tonumber(events_at), tonumber(events_width)
endings_at, endings_width = tonumber(endings_at), tonumber(endings_width)
prompts_at, prompts_width = tonumber(prompts_at), tonumber(prompts_width)

local ending_of = {}  -- event index -> where its ending starts
for x = endings_at, prompts_at - 1, endings_width do
  local index = ARGV[x]
  ending_of[tonumber(index)] = x
end
local prompt_of = {}  -- event index -> the prompt's token ids (JSON)
for p = prompts_at, #ARGV, prompts_width do
  local index, ids = ARGV[p], ARGV[p + 1]
  prompt_of[tonumber(index)] = ids
end

-- Who holds each job of the batch, read once per shard: the shard's fence holds, per job being
-- written, its writer (worker, attempt) and its followers. A job not in it, or there for another
-- writer, is fenced.
local ids = {}  -- shard index -> job ids (attempt > 0), each once
local held = {}
for a = events_at, endings_at - 1, events_width do
  local attempt, job_id, shard = ARGV[a], ARGV[a + 3], ARGV[a + 4]
  if attempt ~= '0' and held[job_id] == nil then
    held[job_id] = false
    ids[shard] = ids[shard] or {}
    table.insert(ids[shard], job_id)
  end
end
for shard, list in pairs(ids) do
  local k = shards_at + tonumber(shard) * shards_width
  local fence = KEYS[k]
  for first = 1, #list, 4000 do  -- one HMGET unless a batch names more jobs than unpack() takes
    local chunk = {unpack(list, first, math.min(first + 3999, #list))}
    local values = redis.call('HMGET', fence, unpack(chunk))
    for n, job_id in ipairs(chunk) do
      if values[n] then
        local attempt, worker, followers = string.match(values[n], '^(%d+)@(%S*) ?(.*)$')
        held[job_id] = {attempt = attempt, worker = worker, relay = followers ~= '' and followers or false}
      end
    end
  end
end

local lost, gaps, whole, outbox = {}, {}, {}, Job.outbox()
-- Per log: how many events it holds when that is fewer than the seq before this batch's first event
-- of it (a gap), else false. Ids are seqs 1..n with none deleted, so its length is its top. A gap
-- is what a Redis failover leaves when it takes back the last events a worker wrote: its later
-- events are not written after it (a reader would skip the missing ones); the worker writes the
-- missing ones again first (workers/runner.py).
local logged_before = {}
for i, a, j in Items.each(events_at, events_width, event_keys_at, event_keys_width, endings_at - 1) do
  local log = KEYS[j]
  local attempt, seq, event, job_id, shard = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local s = shard_args_at + tonumber(shard) * shard_args_width
  local live_prefix, ending_prefix = ARGV[s], ARGV[s + 1]
  local owner = held[job_id]
  local fenced = attempt ~= '0' and not (owner and owner.attempt == attempt and owner.worker == writer)
  -- The entry id is the seq, so XADD itself refuses an event already logged (its id would not be
  -- above the top): the retry check costs no extra command per event. Any other error is Redis
  -- refusing writes (OOM, READONLY, NOREPLICAS), which it does only at a script's first write, so
  -- nothing is written yet: the script fails, and the worker keeps the batch and retries it.
  if not fenced and logged_before[log] == nil then
    local n = redis.call('XLEN', log)
    logged_before[log] = n < tonumber(seq) - 1 and n
  end
  local gap = not fenced and logged_before[log]
  local added = false
  if not fenced and not gap then
    local ids = prompt_of[i]
    if ids then
      added = redis.pcall('XADD', log, seq .. '-0', 'e', event, 'p', ids)
    else
      added = redis.pcall('XADD', log, seq .. '-0', 'e', event)
    end
  end
  if added and added.err and not string.find(added.err, 'equal or smaller than the target stream top', 1, true) then
    return redis.error_reply(added.err)
  end
  if fenced then
    table.insert(lost, i)
  elseif gap then
    table.insert(gaps, i)
    table.insert(gaps, gap)
  else
    if not added.err then
      Job.relay(outbox, owner and owner.relay, live_prefix, job_id, event)
      if seq == '1' then redis.call('EXPIRE', log, result_ttl) end
    end
    local x = ending_of[i]
    if x then  -- terminal: logged now or by the try whose reply was lost
      local status, field, payload, entry, entry_level = ARGV[x + 1], ARGV[x + 2], ARGV[x + 3], ARGV[x + 4], ARGV[x + 5]
      local dead, prompt_tokens, generated_tokens, finished_at = ARGV[x + 6], ARGV[x + 7], ARGV[x + 8], ARGV[x + 9]
      local ending = ending_prefix .. job_id
      redis.call('HSET', ending, 'attempt', attempt, 'seq', seq, 'status', status, 'field', field, 'payload', payload,
                 'entry', entry, 'entry_level', entry_level, 'dead', dead, 'prompt_tokens', prompt_tokens,
                 'generated_tokens', generated_tokens, 'finished_at', finished_at)
      redis.call('EXPIRE', ending, result_ttl)
      redis.call('EXPIRE', log, result_ttl)
      if redis.call('XLEN', log) == tonumber(seq) then table.insert(whole, i) end
    end
  end
end
Job.send(outbox)
return {lost, gaps, whole}
