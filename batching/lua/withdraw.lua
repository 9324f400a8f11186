-- Withdraw a request whose client left before its answer (an HTTP client hung up, a gRPC
-- call was cancelled), so that the model never runs it.
-- KEYS[1]: its partition's rows-waiting counter; KEYS[2]: the request's stream; KEYS[3]: the
-- partition's withdrawn set (sorted set, member "<stream> <entry id>", score its deadline in
-- ms); KEYS[4], when given: the model's stats hash (in another slot for a partition other
-- than 0, whose withdrawals the caller counts itself).
-- ARGV[1]: the consumer group; ARGV[2]: the entry id; ARGV[3]: its rows; ARGV[4]: its
-- deadline (ms since the epoch); ARGV[5]: now (ms since the epoch).
-- Not yet delivered to a worker: the entry is deleted, its rows released and it is
-- counted (withdrawn_count); returns 1. Delivered and not answered: it is marked in
-- KEYS[3] for the worker that holds it, which drops it unrun unless it already runs it;
-- marks past their deadline are pruned and the set expires with its last deadline;
-- returns 2. Already answered (or lost): returns 0.
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[2], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and #pending > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[5])
  redis.call('ZADD', KEYS[3], ARGV[4], KEYS[2] .. ' ' .. ARGV[2])
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[3], math.floor(tonumber(last[2])))
  return 2
end
if redis.call('XDEL', KEYS[2], ARGV[2]) == 1 then
  redis.call('DECRBY', KEYS[1], ARGV[3])
  if #KEYS >= 4 then
    redis.call('HINCRBY', KEYS[4], 'withdrawn_count', 1)
  end
  return 1
end
return 0
