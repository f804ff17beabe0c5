-- Claim jobs taken over from another worker (entries whose lease lapsed, a dead peer's): one
-- round trip per batch. Slots: shared/scripts.py, CLAIM_TAKEN and claim_taken(): per job its
-- record (KEYS).
-- Returns, per job, Claim.start's row (claim.lua).
local worker, now, max_failed, jobs_at, jobs_width = unpack(ARGV, 1, 5)
jobs_at, jobs_width = tonumber(jobs_at), tonumber(jobs_width)

local out = {}
for k = jobs_at, #KEYS, jobs_width do
  local job = KEYS[k]
  table.insert(out, Claim.start(job, worker, now, max_failed))
end
return out
