-- Recompute a model's rows-waiting counter from its streams, where the two disagree.
-- KEYS[1]: the counter; KEYS[2..n]: the model's priority streams.
-- ARGV[1]: the most rows one entry may hold (max_batch_size); ARGV[2]: the most stream
-- bytes worth reading entry by entry.
-- The truth is the sum of the entries' r fields (their rows). Reading an entry copies its
-- payload, so streams larger than ARGV[2] bytes (MEMORY USAGE's estimate, from a few of
-- their nodes) are not read: the counter is only brought within what their entries can
-- hold, one to ARGV[1] rows each. Empty streams always mean zero. Costs one XLEN per
-- stream when they are empty.
-- Returns {counter before, counter after}.
local counted = tonumber(redis.call('GET', KEYS[1]) or '0')
local entries, bytes = 0, 0
for i = 2, #KEYS do
  local n = redis.call('XLEN', KEYS[i])
  if n > 0 then
    entries = entries + n
    bytes = bytes + redis.call('MEMORY', 'USAGE', KEYS[i])
  end
end
local truth = 0
if entries > 0 and bytes <= tonumber(ARGV[2]) then
  for i = 2, #KEYS do
    for _, entry in ipairs(redis.call('XRANGE', KEYS[i], '-', '+')) do
      local fields, rows = entry[2], 1
      for j = 1, #fields, 2 do
        if fields[j] == 'r' then rows = tonumber(fields[j + 1]) or 1 end
      end
      truth = truth + rows
    end
  end
elseif entries > 0 then
  truth = math.min(math.max(counted, entries), entries * tonumber(ARGV[1]))
end
if truth ~= counted then
  redis.call('SET', KEYS[1], truth)
end
return {counted, truth}
