-- Release answered entries: acknowledge and delete them, and take the rows of exactly the
-- entries this call deleted off the model's rows-waiting counter, in one step.
-- KEYS[1]: the model's rows-waiting counter; KEYS[2]: the stream.
-- ARGV[1]: the consumer group; then, per entry, its id and its rows.
-- An entry already gone (answered by another process, or lost with a Redis restart)
-- releases nothing: the counter only drops by rows it still counts, so it always equals
-- the rows of the entries in the streams (admit.lua adds both in one step too).
-- Returns the rows released.
local released = 0
for i = 2, #ARGV, 2 do
  redis.pcall('XACK', KEYS[2], ARGV[1], ARGV[i])
  if redis.call('XDEL', KEYS[2], ARGV[i]) == 1 then
    released = released + tonumber(ARGV[i + 1])
  end
end
if released > 0 then
  redis.call('DECRBY', KEYS[1], released)
end
return released
