-- Reserve one large request's rows in its partition's counter, as admit_many.lua would
-- admit it, without its bytes: the API appends the entry with a plain XADD once this
-- answers (api/dispatch.py), so Redis never copies the bytes into Lua and out again.
-- KEYS[1]: the rows-waiting counter of the stream's partition.
-- ARGV[1]: max_queue_rows (the partition's share of it); ARGV[2]: the request's rows.
-- Returns the rows waiting after the reservation, or -(rows waiting) - 1 when refused
-- (nothing written). A counter below zero reads as zero, as in admit_many.lua.
local waiting = tonumber(redis.call('GET', KEYS[1]) or '0')
if waiting < 0 then waiting = 0 end
local rows = tonumber(ARGV[2])
if waiting + rows > tonumber(ARGV[1]) then
  return -waiting - 1
end
redis.call('INCRBY', KEYS[1], rows)
return waiting + rows
