-- The oldest entry of each of a model's streams that no consumer of the group has read
-- yet: the first after the group's last-delivered-id (every entry, without a group).
-- KEYS: the streams. ARGV[1]: the consumer group.
-- Returns {Redis's clock now in ms, then per stream that entry's id or ''}: stream IDs
-- are Redis's own ms timestamps, so the age needs no other clock.
local now = redis.call('TIME')
local out = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)}
for i, key in ipairs(KEYS) do
  local start = '-'
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', key)
  if ok then
    for _, group in ipairs(groups) do
      local fields = {}
      for j = 1, #group, 2 do
        fields[group[j]] = group[j + 1]
      end
      if fields['name'] == ARGV[1] then
        start = '(' .. fields['last-delivered-id']
      end
    end
  end
  local first = redis.call('XRANGE', key, start, '+', 'COUNT', 1)
  out[i + 1] = first[1] and first[1][1] or ''
end
return out
