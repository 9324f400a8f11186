-- Take, renew or release a job's lease.
-- KEYS[1]: the lease. ARGV[1]: the caller's token; ARGV[2]: the lease in ms, or 0 to
-- release it; ARGV[3]: a token the caller may take over (the job reaper's), or ''.
-- Returns 1 if the caller holds the lease now (or released its own), 0 if another does.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] and holder ~= ARGV[3] then
  return 0
end
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1
