-- After the record says how jobs ended (finish.lua): drop their fence entries and ending keys in
-- their token shard, and the per-event logs whose compact form the record now holds (the rest
-- keep their TTL). Slots: shared/scripts.py, SETTLE and settle(): per shard its fence (KEYS) and
-- ending keys' prefix (ARGV); per job its log (KEYS), id, shard index, and '1' to drop its log.
local shards_at, shards_width, logs_at, logs_width, shard_args_at, shard_args_width,
      jobs_at, jobs_width = unpack(ARGV, 1, 8)
shards_at, shards_width = tonumber(shards_at), tonumber(shards_width)
logs_at, logs_width = tonumber(logs_at), tonumber(logs_width)
shard_args_at, shard_args_width = tonumber(shard_args_at), tonumber(shard_args_width)
jobs_at, jobs_width = tonumber(jobs_at), tonumber(jobs_width)

for i, a, j in Items.each(jobs_at, jobs_width, logs_at, logs_width) do
  local log = KEYS[j]
  local job_id, shard, drop = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local k = shards_at + tonumber(shard) * shards_width
  local fence = KEYS[k]
  local s = shard_args_at + tonumber(shard) * shard_args_width
  local ending_prefix = ARGV[s]
  redis.call('HDEL', fence, job_id)
  redis.call('DEL', ending_prefix .. job_id)
  if drop == '1' then redis.call('DEL', log) end
end
return Items.count(jobs_at, jobs_width)
