"""The Redis metadata store's Lua scripts: put (with its evictions and the upsert merge), record_use and
remove each run as one script, so concurrent engines never interleave inside them and every reuse counts;
two list reads take one consistent snapshot. redis.py's docstring gives the key layout.

Imports nothing: plain script text, registered by `cachefuse.metadata.redis` (never torch: the scheduler
reads it). Key names come from the prefix in ARGV, so the scripts need standalone Redis or one shard, not
Redis Cluster.
"""

# Shared by the scripts below: drop one variant from every index, returning its fields.
DROP = """
local function drop(p, id)
  local key = p .. 'v:' .. id
  local fields = redis.call('HGETALL', key)
  local chunk = redis.call('HGET', key, 'chunk_key')
  redis.call('DEL', key)
  redis.call('ZREM', p .. 'seq', id)
  redis.call('ZREM', p .. 'by_f_r', id)
  redis.call('ZREM', p .. 'by_last_access', id)
  redis.call('ZREM', p .. 'by_rev', id)
  if chunk then redis.call('ZREM', p .. 'chunk:' .. chunk, id) end
  return fields
end
"""

# ARGV: prefix, max_variants, policy, variant_id, chunk_key, last_access, n, damaged (the by_rev revision
# of a row the caller read and found damaged, '-' if it had none; '' otherwise), n field/value args of the
# new record as given, then the ids pinned in this process.
# Returns {'ok', victim fields...} or {'full', count, unpinned}.
# An upsert merges here, with the row as the write finds it (base.merged_upsert: the larger access_count
# and f_r, the stored statistics when the new record has none), so a reuse or a save another engine made
# after the caller read the row is kept; a row that was removed meanwhile is written as new. A damaged row
# is replaced whole only while it is the revision the caller read: repaired meanwhile, it is merged.
PUT = DROP + """
local p, max, policy, id, chunk = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local last, nf, damaged = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local key = p .. 'v:' .. id
local exists = redis.call('EXISTS', key) == 1
local out = {'ok'}
if not exists then
  local need = redis.call('ZCARD', p .. 'seq') + 1 - max
  if need > 0 then
    local pinned = {}
    for i = 9 + nf, #ARGV do pinned[ARGV[i]] = true end
    local primary = policy == 'f_r' and 'by_f_r' or 'by_last_access'
    local secondary = policy == 'f_r' and 'last_access' or 'f_r'
    local victims, lo = {}, '-inf'
    while #victims < need do  -- walk the primary order one group of equal scores at a time
      local first = redis.call('ZRANGEBYSCORE', p .. primary, lo, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if #first == 0 then break end
      local rows = {}
      for _, other in ipairs(redis.call('ZRANGEBYSCORE', p .. primary, first[2], first[2])) do
        local f = redis.call('HMGET', p .. 'v:' .. other, secondary, 'seq')
        rows[#rows + 1] = {other, tonumber(f[1]) or 0, tonumber(f[2]) or 0}  -- damaged fields sort first
      end
      table.sort(rows, function(a, b) if a[2] ~= b[2] then return a[2] < b[2] end return a[3] < b[3] end)
      for _, row in ipairs(rows) do
        if #victims < need and not pinned[row[1]] then victims[#victims + 1] = row[1] end
      end
      lo = '(' .. first[2]
    end
    if #victims < need then return {'full', redis.call('ZCARD', p .. 'seq'), #victims} end
    for _, other in ipairs(victims) do out[#out + 1] = drop(p, other) end
  end
end
local fields = {}
for i = 9, 8 + nf, 2 do fields[ARGV[i]] = ARGV[i + 1] end
local merge = exists
if exists and damaged ~= '' then
  local rev = redis.call('ZSCORE', p .. 'by_rev', id)
  merge = (rev and tostring(tonumber(rev)) or '-') ~= damaged
end
if merge then
  local old = redis.call('HMGET', key, 'access_count', 'f_r', 'has_stats')
  local count, old_f_r = tonumber(old[1]), tonumber(old[2])
  if count and count > tonumber(fields['access_count']) then fields['access_count'] = old[1] end
  if old_f_r and old_f_r > tonumber(fields['f_r']) then fields['f_r'] = old[2] end
  if old[3] == '1' and fields['has_stats'] == '0' then
    local names = {'inter', 'intra', 'prefix_num_tokens', 'ranked_tokens', 'recompute_ratio', 'cci'}
    local kept = redis.call('HMGET', key, unpack(names))
    local whole = true
    for i = 1, #names do if not kept[i] then whole = false end end
    if whole then
      for i = 1, #names do fields[names[i]] = kept[i] end
      fields['has_stats'] = '1'
    end
  end
end
local flat = {}
for name, value in pairs(fields) do flat[#flat + 1] = name; flat[#flat + 1] = value end
local seq = exists and redis.call('HGET', key, 'seq') or redis.call('INCR', p .. 'next_seq')
redis.call('HSET', key, 'seq', seq, unpack(flat))
redis.call('ZADD', p .. 'seq', seq, id)
redis.call('ZADD', p .. 'chunk:' .. chunk, seq, id)
redis.call('ZADD', p .. 'by_f_r', fields['f_r'], id)
redis.call('ZADD', p .. 'by_last_access', last, id)
redis.call('ZADD', p .. 'by_rev', redis.call('INCR', p .. 'writes'), id)  -- the row's revision
if not exists then redis.call('INCR', p .. 'generation') end
return out
"""

# ARGV: prefix, variant_id, 1 / max(CFO, eps) (repr), last_access (repr). Returns the fields or nil.
RECORD_USE = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'v:' .. id
if redis.call('EXISTS', key) == 0 then return false end
redis.call('HINCRBY', key, 'access_count', 1)
local f_r = string.format('%.17g', tonumber(redis.call('HGET', key, 'f_r')) + tonumber(ARGV[3]))
redis.call('HSET', key, 'f_r', f_r, 'last_access', ARGV[4])
redis.call('ZADD', p .. 'by_f_r', f_r, id)
redis.call('ZADD', p .. 'by_last_access', ARGV[4], id)
redis.call('ZADD', p .. 'by_rev', redis.call('INCR', p .. 'writes'), id)
return redis.call('HGETALL', key)
"""

# ARGV: prefix, variant_id. Returns the removed fields or nil.
REMOVE = DROP + """
if redis.call('EXISTS', ARGV[1] .. 'v:' .. ARGV[2]) == 0 then return false end
local fields = drop(ARGV[1], ARGV[2])
redis.call('INCR', ARGV[1] .. 'generation')
return fields
"""

# ARGV: prefix. Returns {ids, revisions}: the variant ids in insertion order joined by newlines, and
# "id revision" lines (the store's write count when the row was last written) in revision order. Two
# strings from one script: a consistent reading, and no RESP array of 10,000 members for redis-py to
# parse (~0.3 s in the scheduler's process). A revision set of another type reads as no revisions.
VERSIONS = """
local p = ARGV[1]
local ids = redis.call('ZRANGE', p .. 'seq', 0, -1)
local revs = redis.pcall('ZRANGE', p .. 'by_rev', 0, -1, 'WITHSCORES')
local lines = {}
if not revs.err then
  for i = 1, #revs, 2 do lines[#lines + 1] = revs[i] .. ' ' .. revs[i + 1] end
end
return {table.concat(ids, '\\n'), table.concat(lines, '\\n')}
"""

# ARGV: prefix, index zset suffix ('seq' or 'chunk:<key>'). Returns every listed variant's fields, in
# index order, from one consistent snapshot.
RECORDS = """
local out = {}
for _, id in ipairs(redis.call('ZRANGE', ARGV[1] .. ARGV[2], 0, -1)) do
  local fields = redis.pcall('HGETALL', ARGV[1] .. 'v:' .. id)
  if fields.err then fields = {'variant_id', id} end  -- another type under the key: an unreadable row
  out[#out + 1] = fields
end
return out
"""
