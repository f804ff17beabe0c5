-- Claim jobs taken over from another worker (entries whose lease lapsed, a dead peer's): one
-- round trip per batch. Slots: shared/scripts.py, CLAIM_TAKEN and claim_taken(): the taker's
-- owned-jobs hash (Keys.owned), then per job its record (KEYS) and its id (ARGV).
-- Returns, per job, Claim.start's row (claim.lua).
local owned = KEYS[1]
local worker, now, max_failed, owned_prefix, jobs_at, jobs_width, ids_at, ids_width = unpack(ARGV, 1, 8)
jobs_at, jobs_width, ids_at, ids_width = tonumber(jobs_at), tonumber(jobs_width), tonumber(ids_at), tonumber(ids_width)

local out = {}
local i = 0
for k = jobs_at, #KEYS, jobs_width do
  local job = KEYS[k]
  local a = ids_at + i * ids_width
  local job_id = ARGV[a]
  table.insert(out, Claim.start(job, worker, now, max_failed, job_id, owned, owned_prefix))
  i = i + 1
end
return out
