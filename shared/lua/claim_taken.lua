-- Claim jobs taken over from another worker (entries whose lease lapsed, a dead peer's): one
-- round trip per batch. Slots: shared/scripts.py, CLAIM_TAKEN and claim_taken().
-- Returns, per job, Claim.start's row (claim.lua).
local worker = ARGV[1]
local now = ARGV[2]
local max_failed = ARGV[3]
local jobs_at = tonumber(ARGV[4])
local jobs_width = tonumber(ARGV[5])

local out = {}
for k = jobs_at, #KEYS, jobs_width do
  local job, log = KEYS[k], KEYS[k + 1]
  table.insert(out, Claim.start(job, log, worker, now, max_failed))
end
return out
