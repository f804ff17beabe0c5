-- Walking a group of a script's layout (shared/scripts.py, Group): the same slots again per item,
-- from ARGV[<group>_at] on, <group>_width values each; the item's keys, if it has any, in a key
-- group of the same items. A library: shared/scripts.py puts it before the scripts that use it.
local Items = {}

-- How many items a value group holds: width values each from ARGV[at] up to ARGV[last] (the end
-- of ARGV unless another group follows).
function Items.count(at, width, last)
  return math.floor(((last or #ARGV) - at) / width) + 1
end

-- For each item of a value group (as Items.count): its 0-based index, the ARGV index of its first
-- value, and the KEYS index of its first key in the key group from keys_at, keys_width each.
function Items.each(at, width, keys_at, keys_width, last)
  local n, i = Items.count(at, width, last), -1
  return function()
    i = i + 1
    if i < n then return i, at + i * width, keys_at + i * keys_width end
  end
end
