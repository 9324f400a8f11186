-- Withdraw a cancelled job's chunks that no worker has read yet.
-- KEYS[1]: the model's rows-waiting counter; KEYS[2..n]: the stream of each chunk.
-- ARGV[1]: the consumer group; then, per chunk, its entry id and its rows.
-- An entry still in the stream and pending on no consumer was never delivered: it is
-- deleted and its rows released. A delivered one is left alone: the worker holding it
-- answers it and releases its rows itself (so no row is released twice).
-- Returns the rows released.
local released = 0
for i = 2, #KEYS do
  local id = ARGV[2 * i - 2]
  local ok, pending = pcall(redis.call, 'XPENDING', KEYS[i], ARGV[1], id, id, 1)
  if ok and #pending == 0 and redis.call('XDEL', KEYS[i], id) == 1 then
    released = released + tonumber(ARGV[2 * i - 1])
  end
end
if released > 0 then
  redis.call('DECRBY', KEYS[1], released)
end
return released
