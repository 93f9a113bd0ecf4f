"""The Redis tier's Lua scripts: each write, touch and delete runs as one script, so replicas sharing the
server see one consistent LRU index (redis_tier.py describes the layout and the scores)."""

from __future__ import annotations

MODULE_SCORE_OFFSET = 10**15  # above any use count; scores stay exact integers in a double (< 2**53)

_PRELUDE = f"local OFFSET = {MODULE_SCORE_OFFSET}\n" + """
-- KEYS[8]: member -> owner hash, KEYS[9]: owner -> bytes hash; own_prefix names each owner's sorted set.
local function drop_owner(owners, owner_bytes, own_prefix, k, size)
  local o = redis.call('HGET', owners, k)
  if o then
    redis.call('HINCRBY', owner_bytes, o, -size)
    redis.call('ZREM', own_prefix .. o, k)
    redis.call('HDEL', owners, k)
  end
end
-- Remove `member` (its blob and index entries); KEYS as DELETE's. Returns 1 if the blob existed.
local function drop(member, own_prefix)
  local existed = redis.call('DEL', KEYS[1])
  local size = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  local score = redis.call('ZSCORE', KEYS[2], member)
  if score and tonumber(score) < OFFSET then redis.call('DECRBY', KEYS[6], size) end
  drop_owner(KEYS[8], KEYS[9], own_prefix, member, size)
  redis.call('HDEL', KEYS[3], member)
  redis.call('ZREM', KEYS[2], member)
  redis.call('SREM', KEYS[4], member)
  redis.call('DECRBY', KEYS[5], size)
  return existed
end
"""

# KEYS: blob, lru, sizes, pins, total, prefix_total, seq, owners, owner_bytes. ARGV: member, blob, ttl_ms
# (0: none), pinned (0/1), kind, max_bytes, blob key prefix, owner ('' : none), owner limit (0: none),
# own_prefix. Makes room first, then writes: returns the evicted members, or 0 when Redis is full and not enough
# of ours could be evicted (the blob is not written).
#
# Redis over its maxmemory (noeviction) refuses a script's first write that may grow memory, and allows every
# write once the script has made one that cannot (DEL). So the probe INCR fails only on a full Redis, before
# anything is written. The script then evicts so that the tier does not grow, and one blob's size more where it
# can, so Redis has room again for the schema registry's writes. (Written before evicting, a full Redis refused
# the write and the eviction never ran: every later write failed.)
PUT = _PRELUDE + """
local lru, sizes, pins, owners, owner_bytes = KEYS[2], KEYS[3], KEYS[4], KEYS[8], KEYS[9]
local member, blob, ttl_ms, kind = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[5]
local max, kv = tonumber(ARGV[6]), ARGV[7]
local owner, limit, own_prefix = ARGV[8], tonumber(ARGV[9]), ARGV[10]
local score = redis.pcall('INCR', KEYS[7])
local is_full = type(score) == 'table'
if is_full and not string.find(score.err, 'OOM', 1, true) then return redis.error_reply(score.err) end
local total = tonumber(redis.call('GET', KEYS[5]) or '0')
local prefix_total = tonumber(redis.call('GET', KEYS[6]) or '0')
local old_score = redis.call('ZSCORE', lru, member)
local old_size = tonumber(redis.call('HGET', sizes, member) or '0')
local old_owner = redis.call('HGET', owners, member)
local is_old_prefix = old_score and tonumber(old_score) < OFFSET
if old_score and not is_old_prefix then kind = 'module' end
local size = string.len(blob)
local cap = is_full and math.min(max, total) or max  -- the most `total` may be once written
local goal = is_full and cap - size or cap  -- where eviction stops
local evicted = {}
local function evict(k, k_score)
  local s = tonumber(redis.call('HGET', sizes, k) or '0')
  redis.call('DEL', kv .. k)
  total = total - s
  if k_score < OFFSET then prefix_total = prefix_total - s end
  redis.call('HDEL', sizes, k)
  redis.call('ZREM', lru, k)
  drop_owner(owners, owner_bytes, own_prefix, k, s)
  table.insert(evicted, k)
end
-- Evict lowest scores of `ranking` first while `over()` holds, skipping pins and the entry being written.
-- `rank` counts skipped entries, which is where the next unvisited entry sits once removed ones are gone.
local function evict_from(ranking, over)
  local rank = 0
  while over() do
    local batch = redis.call('ZRANGE', ranking, rank, rank + 63, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      if not over() then break end
      local k = batch[i]
      if k == member or redis.call('SISMEMBER', pins, k) == 1 then
        rank = rank + 1
      else
        evict(k, tonumber(batch[i + 1]))
      end
    end
  end
end
if owner ~= '' and limit > 0 then  -- within its share, an owner makes room from its own entries only
  local replaced = old_owner == owner and old_size or 0
  evict_from(own_prefix .. owner, function()
    return tonumber(redis.call('HGET', owner_bytes, owner) or '0') - replaced + size > limit end)
end
evict_from(lru, function() return total - old_size + size > goal end)
if is_full then
  if total - old_size + size > cap then  -- pinned or others' data fills Redis: skip the write
    if #evicted > 0 then
      redis.call('SET', KEYS[5], string.format('%.0f', total))
      redis.call('SET', KEYS[6], string.format('%.0f', prefix_total))
    end
    return 0
  end
  redis.call('DEL', KEYS[1])  -- rewritten below; a write that frees memory first opens the script's writes
  score = redis.call('INCR', KEYS[7])
end
drop_owner(owners, owner_bytes, own_prefix, member, old_size)
if is_old_prefix then prefix_total = prefix_total - old_size end
if ttl_ms > 0 then redis.call('SET', KEYS[1], blob, 'PX', ttl_ms) else redis.call('SET', KEYS[1], blob) end
if kind == 'module' then score = score + OFFSET else prefix_total = prefix_total + size end
local scored = string.format('%.0f', score)
redis.call('HSET', sizes, member, size)
redis.call('ZADD', lru, scored, member)
if owner ~= '' then
  redis.call('HSET', owners, member, owner)
  redis.call('HINCRBY', owner_bytes, owner, size)
  redis.call('ZADD', own_prefix .. owner, scored, member)
end
if ARGV[4] == '1' then redis.call('SADD', pins, member) end
total = total - old_size + size
redis.call('SET', KEYS[5], string.format('%.0f', total))
redis.call('SET', KEYS[6], string.format('%.0f', prefix_total))
return evicted
"""

# KEYS: blob, lru, seq, owners. ARGV: member, own_prefix, length, head. Marks the entry as just used (keeping
# its kind) if its value still has the length and first bytes (HMAC tag, checksum) the caller verified.
# Returns 1 if touched. Reads are a plain GET first: through Lua, a 14 MB module read 2.5x slower. A full Redis
# refuses the INCR: the entry keeps its place (not an error, which would stop reads from Redis for a while).
TOUCH = _PRELUDE + """
local head = ARGV[4]
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[3])
    or redis.call('GETRANGE', KEYS[1], 0, string.len(head) - 1) ~= head then return 0 end
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if score then
  local seq = redis.pcall('INCR', KEYS[3])
  if type(seq) == 'table' then return 0 end
  if tonumber(score) >= OFFSET then seq = seq + OFFSET end
  local scored = string.format('%.0f', seq)
  redis.call('ZADD', KEYS[2], scored, ARGV[1])
  local owner = redis.call('HGET', KEYS[4], ARGV[1])
  if owner then redis.call('ZADD', ARGV[2] .. owner, scored, ARGV[1]) end
end
return 1
"""

# KEYS: blob, lru, sizes, pins, total, prefix_total, (unused), owners, owner_bytes. ARGV: member, own_prefix.
# Returns 1 if the blob existed.
DELETE = _PRELUDE + """
return drop(ARGV[1], ARGV[2])
"""

# KEYS as DELETE's. ARGV: member, own_prefix, value. Deletes the entry only if its blob is still exactly
# `value` (one that failed verification): a rightful write that landed since is kept. Returns 1 if deleted.
DROP_IF_UNCHANGED = _PRELUDE + """
if redis.call('GET', KEYS[1]) ~= ARGV[3] then return 0 end
return drop(ARGV[1], ARGV[2])
"""
