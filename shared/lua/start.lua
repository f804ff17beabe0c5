-- Claim delivered jobs for one worker (reclaimed entries, a dead peer's): one round trip per batch.
-- KEYS[2i-1] job hash of the i-th entry   KEYS[2i] its event log
-- ARGV[1] worker id   ARGV[2] now (epoch ms)   ARGV[3] max failed deliveries before dead letter
-- Returns, per job, Claim.start's row (claim.lua).
local out = {}
for i = 1, #KEYS, 2 do
  out[(i + 1) / 2] = Claim.start(KEYS[i], KEYS[i + 1], ARGV[1], ARGV[2], ARGV[3])
end
return out
