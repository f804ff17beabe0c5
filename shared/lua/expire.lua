-- End a job whose deadline passed and that nobody ended: called by the API (a client waiting on
-- it, or a poll). A queued job ends at its deadline; a running one only after a grace period, as
-- its worker aborts it at the deadline itself and this is the backstop for a worker that cannot.
-- With ARGV[8] = '1' the job ends now, whatever its deadline: a waiting client's cold wait ran out
-- (no warm worker served the model for LLMQ_COLD_WAIT_S), so no worker is running it either.
-- KEYS[1] job hash   KEYS[2] event log   KEYS[3] webhook outbox   KEYS[4 ..] the fair sets by
--   level, then the fair clock, today's usage, the usage since the start, the model's token window
-- ARGV[1] now (epoch ms)   ARGV[2] grace (ms) for running jobs   ARGV[3] TTL (s) of finished jobs
-- ARGV[4] live channel (when the record names no relay channel)   ARGV[5] the error event's JSON after its seq: '"code":...}'
-- ARGV[6] the record's error JSON   ARGV[7] job id   ARGV[8] '1' to end it now
-- ARGV[9] the tenants' key prefix   ARGV[10] TTL (s) of a day's usage
-- Bumping the attempt fences off the owner: its later writes are refused, so it aborts the job
-- and writes nothing. The stream entry stays until a worker reads or reclaims it and finds the
-- job finished (start.lua), which acks and deletes it.
-- Returns 1 when this call ended the job, else 0.
local f = redis.call('HMGET', KEYS[1], 'status', 'deadline', 'relay')
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
if ARGV[8] ~= '1' then
  if not f[2] then return 0 end
  local due = tonumber(f[2])
  if f[1] == 'running' then due = due + tonumber(ARGV[2]) end
  if tonumber(ARGV[1]) < due then return 0 end
end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local seq = 1
if last[1] then seq = tonumber(string.match(last[1][1], '^(%d+)')) + 1 end
local event = '{"type":"error","seq":' .. seq .. ',' .. ARGV[5]
redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'worker', '', 'status', 'failed', 'error', ARGV[6], 'finished_at', ARGV[1])
local fairs = {}
for k = 4, #KEYS - 4 do table.insert(fairs, KEYS[k]) end
Fair.ended(KEYS[1], ARGV[7], {tprefix = ARGV[9], fairs = fairs, clock = KEYS[#KEYS - 3], usage_day = KEYS[#KEYS - 2],
                             usage_total = KEYS[#KEYS - 1], tokens = KEYS[#KEYS], now = tonumber(ARGV[1]),
                             day_ttl = ARGV[10]}, -1, -1)
redis.call('XADD', KEYS[2], seq .. '-0', 'e', event)
if f[3] then  -- the followers' relay channels, as flush.lua publishes (a line '<job id> <event>')
  for channel in string.gmatch(f[3], '%S+') do redis.call('PUBLISH', channel, ARGV[7] .. ' ' .. event) end
else
  redis.call('PUBLISH', ARGV[4], event)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if redis.call('HEXISTS', KEYS[1], 'webhook') == 1 then redis.call('XADD', KEYS[3], '*', 'job', ARGV[7]) end
return 1
