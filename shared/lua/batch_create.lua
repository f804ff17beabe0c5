-- Record a batch and its lines together (one slot: the batch's keys share its hash tag), so a
-- batch is never visible without its lines, nor lines left without a batch.
-- KEYS[1] batch hash   KEYS[2] lines list
-- ARGV[1] number of hash field/value arguments that follow   then those, then the lines
local n = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2, 1 + n))
-- In chunks: Lua's unpack refuses a few thousand values at once, and a batch has up to 50,000.
local first = 2 + n
while first <= #ARGV do
  local last = math.min(first + 999, #ARGV)
  redis.call('RPUSH', KEYS[2], unpack(ARGV, first, last))
  first = last + 1
end
return 1
