-- Read a job's event log in whichever form it is: the stream of a running job (one entry per
-- event, the entry id = seq), or the compact log a finished job's worker made of it, in the
-- record's 'log' field (shared/eventlog.py; Job.finish swaps one for the other in the script that
-- ends the job, so a reader sees either every event so far or the whole compact log, never a mix).
-- Slots: shared/scripts.py, READ_LOG and read_log().
-- Returns {'s', entries} (XRANGE from that seq), or {'c', compact log, result} where result is
-- the record's result JSON when the compact form is rebuilt from it (else ''), or {'s', {}}.
local log, job = unpack(KEYS, 1, 2)
local from_seq = ARGV[1]
local kind = redis.call('TYPE', log)['ok']
if kind == 'stream' then return {'s', redis.call('XRANGE', log, from_seq .. '-0', '+')} end
-- Ended: the compact log is in the record (Job.finish), or, written by an older worker, the
-- log's own string.
local f = redis.call('HMGET', job, 'log', 'result')
local compact = f[1]
if kind == 'string' then compact = redis.call('GET', log) end
if not compact then return {'s', {}} end
local result = ''
local form = string.sub(compact, 1, 1)  -- shared/eventlog.py's SHAPE and SHAPE_V0 need the result
if form == 'D' or form == 'S' then result = f[2] or '' end
return {'c', compact, result}
