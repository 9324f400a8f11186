-- Admit several requests into one model's priority stream, each as admit.lua would in
-- turn: a request that would take the model past its row limit is refused and writes
-- nothing, and the ones after it are still tried against the rows admitted so far.
-- KEYS[1]: the rows-waiting counter of the stream's partition (queue.partitions; the
-- model's, with one); KEYS[2]: the priority stream.
-- ARGV[1]: max_queue_rows (the partition's share of it); then, per request, its rows (also stored as field r, so an
-- entry that cannot be decoded still releases them) and the packed request.
-- Returns, per request in order, {rows waiting after its admission, entry id}, or
-- {-(rows waiting) - 1, ''} when refused.
local waiting = tonumber(redis.call('GET', KEYS[1]) or '0')
if waiting < 0 then waiting = 0 end
local limit = tonumber(ARGV[1])
local admitted = 0
local out = {}
for i = 2, #ARGV, 2 do
  local rows = tonumber(ARGV[i])
  if waiting + rows > limit then
    out[#out + 1] = {-waiting - 1, ''}
  else
    waiting = waiting + rows
    admitted = admitted + rows
    out[#out + 1] = {waiting, redis.call('XADD', KEYS[2], '*', 'd', ARGV[i + 1], 'r', ARGV[i])}
  end
end
-- One INCRBY for all of them. A counter below zero (its key deleted while entries waited,
-- then their rows released) must not read as a refusal: the entries are in, and the
-- workers' reconciler puts the counter right.
if admitted > 0 then
  redis.call('INCRBY', KEYS[1], admitted)
end
return out
