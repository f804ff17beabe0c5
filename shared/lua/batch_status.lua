-- Move a batch to a new status only from an allowed one (a compare-and-set on one hash).
-- KEYS[1] batch hash
-- ARGV[1] new status   ARGV[2] its timestamp field   ARGV[3] now (s)   ARGV[4] allowed, comma-separated
-- ARGV[5..] more field, value pairs to set with the move
-- Returns 1 when moved, 0 when the batch is missing or in another status.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(ARGV[4], '[^,]+') do
  if s == status then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
if #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
return 1
