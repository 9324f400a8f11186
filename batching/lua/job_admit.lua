-- Admit one chunk of a job, as admit.lua admits a request, and say where it went.
-- KEYS[1]: the model's rows-waiting counter; KEYS[2]: the priority stream.
-- ARGV[1]: the chunk's rows; ARGV[2]: max_queue_rows; ARGV[3]: the packed request.
-- Returns {rows waiting after admission, entry id}, or {-(rows waiting) - 1, ''} when
-- rejected: nothing is written for a rejected chunk.
local waiting = tonumber(redis.call('GET', KEYS[1]) or '0')
if waiting < 0 then waiting = 0 end
local rows = tonumber(ARGV[1])
if waiting + rows > tonumber(ARGV[2]) then
  return {-waiting - 1, ''}
end
local id = redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'r', ARGV[1])
return {redis.call('INCRBY', KEYS[1], rows), id}
