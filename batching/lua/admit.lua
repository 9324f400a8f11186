-- Admit a request (or one chunk of a job) into a model's stream unless that would exceed
-- the model's row limit, and say where it went.
-- KEYS[1]: the model's rows-waiting counter; KEYS[2]: the priority stream.
-- ARGV[1]: the request's rows (also stored as field r, so an entry that cannot be decoded
-- still releases them); ARGV[2]: max_queue_rows; ARGV[3]: the packed request.
-- Returns {rows waiting after admission, entry id}, or {-(rows waiting) - 1, ''} when
-- rejected: nothing is written for a rejected request.
local waiting = tonumber(redis.call('GET', KEYS[1]) or '0')
if waiting < 0 then waiting = 0 end
local rows = tonumber(ARGV[1])
if waiting + rows > tonumber(ARGV[2]) then
  return {-waiting - 1, ''}
end
local id = redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'r', ARGV[1])
-- A counter below zero (its key deleted while entries waited, then their rows released)
-- must not read as a refusal: the entry is in. The workers' reconciler puts it right.
return {math.max(redis.call('INCRBY', KEYS[1], rows), 0), id}
