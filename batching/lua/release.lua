-- Release answered entries: acknowledge and delete them, and take the rows of exactly the
-- entries this call deleted off the model's rows-waiting counter, in one step.
-- KEYS[1]: the model's rows-waiting counter; KEYS[2]: the stream.
-- ARGV[1]: the consumer group; then, per entry, its id and its rows.
-- An entry already gone (answered by another process, or lost with a Redis restart)
-- releases nothing: the counter only drops by rows it still counts, so it always equals
-- the rows of the entries in the streams (admission adds both in one step too).
-- One XACK for all the entries and one XDEL per distinct row count (a batch of one-row
-- requests: one), whose count of deleted entries times those rows is exactly what they
-- held: a call per entry cost Redis about twice as much. In chunks of CHUNK ids (Lua's
-- unpack has a stack limit).
-- Returns the rows released.
local CHUNK = 500
local function each_chunk(ids, call)
  for i = 1, #ids, CHUNK do
    call(unpack(ids, i, math.min(i + CHUNK - 1, #ids)))
  end
end
local ids, by_rows = {}, {}
for i = 2, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
  local same = by_rows[ARGV[i + 1]]
  if same == nil then
    same = {}
    by_rows[ARGV[i + 1]] = same
  end
  same[#same + 1] = ARGV[i]
end
each_chunk(ids, function(...) redis.pcall('XACK', KEYS[2], ARGV[1], ...) end)
local released = 0
for rows, same in pairs(by_rows) do
  each_chunk(same, function(...)
    released = released + tonumber(rows) * redis.call('XDEL', KEYS[2], ...)
  end)
end
if released > 0 then
  redis.call('DECRBY', KEYS[1], released)
end
return released
