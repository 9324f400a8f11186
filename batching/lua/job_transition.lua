-- Move a job to a new state if it is in one of the states it may leave.
-- KEYS[1]: the job hash. ARGV[1]: the new state; ARGV[2]: the states it may leave,
-- comma-separated; ARGV[3..]: field, value pairs written with the new state.
-- Returns the state the job was in (false for an unknown job); the caller compares it
-- with the states it allowed to learn whether the move happened.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
if string.find(',' .. ARGV[2] .. ',', ',' .. state .. ',', 1, true) then
  redis.call('HSET', KEYS[1], 'state', ARGV[1], unpack(ARGV, 3))
end
return state
