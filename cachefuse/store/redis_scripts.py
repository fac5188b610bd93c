"""The Redis K/V tier's Lua scripts: each runs atomically on the server, so several engines sharing a
namespace see one LRU order, one byte count and whole entries (redis.py's docstring gives the layout).

Imports nothing: plain script text, registered by `cachefuse.store.redis`. Key names come in KEYS and
ARGV (derived from the namespace), so the scripts need standalone Redis or one shard, not Redis Cluster.
"""

# KEYS: entry, lru, clock, sizes, nbytes; ARGV: key, field names. Touches the LRU stamp and returns
# {1, values...}; {0} when absent (its index entry dropped); {-1} when the key holds another type;
# {-2, field, length, size} when a field (the header too) is longer than the whole entry the index records
# (written around the put script): the entry is dropped here, atomically, and no field's bytes are sent,
# where a reply of hundreds of MiB would time out as an io_error on every read and never be dropped.
READ = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  local size = redis.call('HGET', KEYS[4], ARGV[1])
  if size then
    redis.call('HDEL', KEYS[4], ARGV[1])
    redis.call('ZREM', KEYS[2], ARGV[1])
    redis.call('DECRBY', KEYS[5], size)
  end
  return {0}
end
if kind ~= 'hash' then return {-1} end
local size = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '')
if size then
  for i = 2, #ARGV do
    local length = redis.call('HSTRLEN', KEYS[1], ARGV[i])
    if length > size then
      redis.call('DEL', KEYS[1])
      redis.call('HDEL', KEYS[4], ARGV[1])
      redis.call('ZREM', KEYS[2], ARGV[1])
      redis.call('DECRBY', KEYS[5], size)
      return {-2, ARGV[i], length, size}
    end
  end
end
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[3]), ARGV[1])
end
local out = {1}
for i, value in ipairs(redis.call('HMGET', KEYS[1], unpack(ARGV, 2))) do out[i + 1] = value end
return out
"""

# KEYS: entry, lru, sizes, nbytes; ARGV: key, mode ('any': drop whatever is there; 'header': only if
# the header still equals ARGV[3]; 'no-header': only if there is still no header).
DROP = """
if ARGV[2] ~= 'any' and redis.call('TYPE', KEYS[1])['ok'] == 'hash' then
  local header = redis.call('HGET', KEYS[1], 'header')
  if (ARGV[2] == 'header' and header ~= ARGV[3]) or (ARGV[2] == 'no-header' and header) then
    return 0  -- a put replaced the bad entry meanwhile: keep the new one
  end
end
redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return 1
"""

# KEYS: staging, entry, lru, clock, sizes, nbytes; ARGV: key, nbytes, capacity (0: none), entry key
# prefix, pinned keys... Returns {1, victims...}, {0} (does not fit) or {-1} (staging expired).
ADMIT = """
local key, nbytes, capacity, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local out = {1}
if capacity > 0 then
  local pinned = {}
  for i = 5, #ARGV do pinned[ARGV[i]] = true end
  local used = tonumber(redis.call('GET', KEYS[6]) or '0') - tonumber(redis.call('HGET', KEYS[5], key) or '0')
  local victims, start = {}, 0
  while used + nbytes > capacity do  -- least recently used first, as base.plan_eviction
    local batch = redis.call('ZRANGE', KEYS[3], start, start + 127)
    if #batch == 0 then break end
    for _, other in ipairs(batch) do
      if used + nbytes <= capacity then break end
      if other ~= key and not pinned[other] then
        victims[#victims + 1] = other
        used = used - tonumber(redis.call('HGET', KEYS[5], other) or '0')
      end
    end
    start = start + 128
  end
  if used + nbytes > capacity then
    redis.call('DEL', KEYS[1])
    return {0}
  end
  for _, other in ipairs(victims) do
    redis.call('DEL', prefix .. other)
    redis.call('DECRBY', KEYS[6], redis.call('HGET', KEYS[5], other) or '0')
    redis.call('HDEL', KEYS[5], other)
    redis.call('ZREM', KEYS[3], other)
    out[#out + 1] = other
  end
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PERSIST', KEYS[2])
redis.call('DECRBY', KEYS[6], redis.call('HGET', KEYS[5], key) or '0')
redis.call('HSET', KEYS[5], key, nbytes)
redis.call('INCRBY', KEYS[6], nbytes)
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), key)
return out
"""
