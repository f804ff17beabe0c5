-- Read a job's event log in its token shard: the stream of a running job (one entry per event, the
-- entry id = seq), or the compact string an older worker left in its place. Slots:
-- shared/scripts.py, READ_LOG and read_log().
-- Returns {'s', entries} (XRANGE from that seq), {'c', compact log} or {'n'}: no log in the shard
-- (ended and settled, its compact form is in the record's 'log' field; or never written). The caller
-- reads the record then (another slot): settle.lua drops the stream only after finish.lua wrote the
-- compact form there, so a reader finds every event in one place or the other.
local log = KEYS[1]
local from_seq = ARGV[1]
local kind = redis.call('TYPE', log)['ok']
if kind == 'stream' then return {'s', redis.call('XRANGE', log, from_seq .. '-0', '+')} end
if kind == 'string' then return {'c', redis.call('GET', log)} end
return {'n'}
