-- Add to a model's statistics hash in one step (one command instead of one per field).
-- KEYS[1]: the stats hash.
-- ARGV[1]: how many (field, amount) pairs follow to add with HINCRBY; after them,
-- (field, value) pairs to set (latest values, such as last_inference).
-- Sent in the same write as the replies it counts, ahead of them: a client that has its
-- answer finds it counted.
local adds = tonumber(ARGV[1])
for i = 2, 2 * adds, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
for i = 2 * adds + 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return adds
