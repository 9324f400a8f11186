-- Store a job's finished chunks, each once, and count their rows into its progress.
-- KEYS[1]: the job's chunks hash; KEYS[2]: the job hash (one slot: the job's hash tag).
-- ARGV: per chunk, its index, its packed outputs and its rows.
-- A chunk stored already adds no rows: a write whose answer was lost (the connection
-- dropped after Redis ran it) sends the chunk again, and its second store counts nothing,
-- so `done` counts every row once and only ever rises.
-- Returns {the job's rows done, then the index of each chunk this call stored first}.
local added = 0
local new = {}
for i = 1, #ARGV, 3 do
  if redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    added = added + tonumber(ARGV[i + 2])
    new[#new + 1] = tonumber(ARGV[i])
  end
end
return {redis.call('HINCRBY', KEYS[2], 'done', added), unpack(new)}
