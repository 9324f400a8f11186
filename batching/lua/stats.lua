-- Add to a model's statistics hash in one step (one command instead of one per field).
-- KEYS[1]: the stats hash.
-- ARGV[1]: "field amount field amount ..." to add with HINCRBY; ARGV[2]: "field value ..."
-- to set (latest values, such as last_inference). Fields hold no spaces. Two packed
-- strings cost the sender a third of the Python of one argument per field and number.
-- Sent in the same write as the replies it counts, ahead of them. On a single Redis that
-- write is applied in order: a client that has its answer finds it counted. On a cluster
-- this runs on the model's node while the replies go to their API processes' nodes, at
-- the same time and not ordered with them (workers/streams.py): a client may have its
-- answer a moment before it is counted.
local added = 0
for field, amount in string.gmatch(ARGV[1], '(%S+) (%S+)') do
  redis.call('HINCRBY', KEYS[1], field, amount)
  added = added + 1
end
for field, value in string.gmatch(ARGV[2], '(%S+) (%S+)') do
  redis.call('HSET', KEYS[1], field, value)
end
return added
