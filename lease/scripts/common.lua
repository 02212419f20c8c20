-- common.lua: put before every lease script.
--
-- KEYS (all of one subject, sharing its hash tag):
--   H  holders: sorted set of lease ids scored by expiry (microseconds,
--      Redis clock)
--   T  tokens: hash of lease id -> fencing token
--   Q  queue: sorted set of waiting ids scored by arrival (a number from C)
--   W  waiters: sorted set of the same ids scored by expiry: a waiter whose
--      process stops refreshing it leaves the queue when it passes
--   C  counter: INCR'd for every arrival and grant; the fencing tokens. It
--      never expires, so tokens stay monotonic per subject.
--   NB the prefix of the per-process wake-up lists: NB .. proc holds
--      "id token" for each grant made for proc by another process's call.
--   L  left: sorted set of the ids of waiters that gave up (leave.lua),
--      scored by expiry (a TTL on): an acquire call of one that arrives
--      after its leave call (both were in flight: the acquire's reply was
--      lost) must not queue it again, for a lease nobody would hold.
-- ARGV[1] the calling process's id (lease ids are proc .. '.' .. n)
-- ARGV[2] N, the most leases held at once
-- ARGV[3] TTL in microseconds (a lease, and a waiter, lives that long
--         unless refreshed)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local H, T, Q, W, C, NB, L = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local proc = ARGV[1]
local limit = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local mine = {}  -- grants to the calling process: id, token, time left (µs), ...
local expired = 0

local function fmt(n) return string.format('%d', n) end

local function owner(id) return string.match(id, '^(.*)%.[^.]*$') end

-- sweep drops holders whose expiry has passed (their process stopped
-- extending them: it died, or stalled longer than the TTL), with the
-- wake-up of a grant its process never read (read later, it would hand
-- out a lease nobody holds), and waiters whose process stopped
-- refreshing them.
local function sweep()
  local dead = redis.call('ZRANGEBYSCORE', H, '-inf', fmt(now))
  for _, id in ipairs(dead) do
    local token = redis.call('HGET', T, id)
    redis.call('ZREM', H, id)
    redis.call('HDEL', T, id)
    if token then
      redis.call('LREM', NB .. owner(id), 0, id .. ' ' .. token)
    end
  end
  expired = #dead
  local gone = redis.call('ZRANGEBYSCORE', W, '-inf', fmt(now))
  for _, id in ipairs(gone) do
    redis.call('ZREM', W, id)
    redis.call('ZREM', Q, id)
  end
  redis.call('ZREMRANGEBYSCORE', L, '-inf', fmt(now))
end

-- grant makes id a holder until now + ttl and returns its fencing token.
local function grant(id)
  local token = redis.call('INCR', C)
  redis.call('ZADD', H, fmt(now + ttl), id)
  redis.call('HSET', T, id, token)
  return token
end

-- granted adds id, held already with token, to mine, with its time left.
local function granted(id, token)
  mine[#mine + 1] = id
  mine[#mine + 1] = tonumber(token)
  mine[#mine + 1] = tonumber(redis.call('ZSCORE', H, id) or now) - now
end

-- admit grants leases to the waiters at the head of the queue while fewer
-- than N are held, first come first served. A grant to the calling process
-- goes in its reply; one to another process goes on that process's list.
--
-- Every waiter in Q has its expiry in W (acquire.lua and keep.lua add
-- both; sweep, admit and leave.lua drop both). An id in Q with none is
-- no waiter's any more: W was lost since it queued (overwritten, and
-- then deleted, or evicted), and with it the expiry that would have
-- dropped it once its process stopped refreshing it (a waiter that gave
-- up while its leave call could not run). It is dropped, not granted a
-- lease nobody would hold for a TTL; a waiter still waiting queues again
-- at its next poll (keep.lua).
local function admit()
  local room = limit - redis.call('ZCARD', H)
  while room > 0 do
    local head = redis.call('ZRANGE', Q, 0, 0)
    if #head == 0 then break end
    local id = head[1]
    redis.call('ZREM', Q, id)
    if redis.call('ZREM', W, id) == 1 then
      local token = grant(id)
      local p = owner(id)
      if p == proc then
        mine[#mine + 1] = id
        mine[#mine + 1] = token
        mine[#mine + 1] = ttl
      else
        local n = NB .. p
        redis.call('RPUSH', n, id .. ' ' .. fmt(token))
        redis.call('PEXPIRE', n, fmt(math.ceil(ttl / 1000) + 1000))
      end
      room = room - 1
    end
  end
end

-- expireLike gives key the lifetime of the latest expiry in zset, plus a
-- second, so that a subject nobody uses any more costs nothing.
local function expireLike(key, zset)
  local last = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', key)
    return
  end
  redis.call('PEXPIRE', key, fmt(math.ceil((tonumber(last[2]) - now) / 1000) + 1000))
end

-- finish sets the expiries and returns {status, expired, mine, extra}:
-- mine holds each grant to the calling process as id, token and the
-- microseconds Redis holds it for from now.
local function finish(status, extra)
  expireLike(H, H)
  expireLike(T, H)
  expireLike(W, W)
  expireLike(Q, W)
  expireLike(L, L)
  return {status, expired, mine, extra or {}}
end
