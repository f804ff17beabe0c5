-- Record a batch and its lines together (one slot: the batch's keys share its hash tag), so a
-- batch is never visible without its lines, nor lines left without a batch.
-- Slots: shared/scripts.py, BATCH_CREATE and batch_create(): after lines_at, the batch hash's
-- field, value pairs, then from ARGV[lines_at] on the lines.
local batch, lines = unpack(KEYS, 1, 2)
local lines_at = tonumber(ARGV[1])
redis.call('HSET', batch, unpack(ARGV, 2, lines_at - 1))
-- In chunks: Lua's unpack refuses a few thousand values at once, and a batch has up to 50,000.
local first = lines_at
while first <= #ARGV do
  local last = math.min(first + 999, #ARGV)
  redis.call('RPUSH', lines, unpack(ARGV, first, last))
  first = last + 1
end
return 1
