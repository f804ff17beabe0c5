-- Read new entries for one consumer across the priority levels, most urgent first, up to COUNT
-- in total (a plain multi-stream XREADGROUP would take COUNT from every stream). Never blocks:
-- the caller blocks with XREADGROUP only when this finds nothing.
-- KEYS: every level's queue, in order   ARGV[1] consumer   ARGV[2] how many entries at most
-- Returns {level (0-based), entry id, job id} per entry, in reading order.
local out = {}
local want = tonumber(ARGV[2])
for level = 1, #KEYS do
  if want <= 0 then break end
  local reply = redis.call('XREADGROUP', 'GROUP', 'workers', ARGV[1], 'COUNT', want, 'STREAMS', KEYS[level], '>')
  if reply then
    for _, entry in ipairs(reply[1][2]) do
      local fields, job = entry[2], ''
      for j = 1, #fields, 2 do
        if fields[j] == 'job' then job = fields[j + 1] end
      end
      table.insert(out, {level - 1, entry[1], job})
      want = want - 1
    end
  end
end
return out
