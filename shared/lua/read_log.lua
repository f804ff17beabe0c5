-- Read a job's event log in whichever form it is: the stream of a running job (one entry per
-- event, the entry id = seq), or the string a finished job's worker compacted it into
-- (shared/eventlog.py; flush.lua swaps one for the other in the script that ends the job, so a
-- reader sees either every event so far or the whole compact log, never a mix).
-- KEYS[1] event log   KEYS[2] job hash   ARGV[1] the lowest seq wanted
-- Returns {'s', entries} (XRANGE from that seq), or {'c', compact log, result} where result is
-- the record's result JSON when the compact form is rebuilt from it (else ''), or {'s', {}}.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'string' then
  local compact = redis.call('GET', KEYS[1])
  local result = ''
  if string.sub(compact, 1, 1) == 'S' then result = redis.call('HGET', KEYS[2], 'result') or '' end
  return {'c', compact, result}
end
if kind ~= 'stream' then return {'s', {}} end
return {'s', redis.call('XRANGE', KEYS[1], ARGV[1] .. '-0', '+')}
