-- Move a batch to a new status only from an allowed one (a compare-and-set on one hash).
-- Slots: shared/scripts.py, BATCH_STATUS and batch_status(): allowed is comma-separated; more
-- field, value pairs to set with the move follow the fixed values.
-- Returns 1 when moved, 0 when the batch is missing or in another status.
local batch = KEYS[1]
local status, stamp_field, now, allowed = unpack(ARGV, 1, 4)
local current = redis.call('HGET', batch, 'status')
if not current then return 0 end
local ok = false
for s in string.gmatch(allowed, '[^,]+') do
  if s == current then ok = true end
end
if not ok then return 0 end
redis.call('HSET', batch, 'status', status, stamp_field, now)
local fields = {unpack(ARGV, 5)}
if #fields > 0 then redis.call('HSET', batch, unpack(fields)) end
return 1
