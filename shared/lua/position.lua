-- A waiting job's standing (shared/slo.py Standing): how many jobs of its model are estimated to
-- start before it, and in how many ms it should start. The caller read the job's record, so it
-- gives the job's tenant, level and score in its line (Fair.order).
-- Slots: shared/scripts.py, POSITION and position().
-- Returns {ahead, wait ms (-1: not known)}.
local tenant_prefix, tenant, level, score, slots, decode_tps, generated_per_job, levels, levels_at,
      levels_width = unpack(ARGV, 1, 10)
level, levels, levels_at, levels_width = tonumber(level), tonumber(levels), tonumber(levels_at), tonumber(levels_width)
local queues, waitings, fairs = Pick.levels(levels, levels_at, levels_width)
local ahead = Slo.ahead(tenant_prefix .. tenant, tenant, level, score, waitings, fairs)
return {ahead, Slo.wait_ms(ahead, queues, slots, decode_tps, generated_per_job)}
