-- window.lua: an exact sliding-window log: at most max events in any
-- window of span. One sorted set per key, one member per event, scored by
-- its time (microseconds on the Redis clock); the set expires a span after
-- its last event. It costs memory per event, so it suits small limits
-- where the exact count in the last window matters; GCRA (book.lua) is the
-- choice for many keys or large limits.
--
-- KEYS[1]  the set
-- ARGV[1]  "" to read the clock with TIME; a microsecond count in tests
-- ARGV[2]  span, microseconds
-- ARGV[3]  max
-- ARGV[4]  n, events wanted
--
-- Returns {allowed (1/0), retry_after, remaining, reset_after}, times in
-- microseconds.
-- now: set by clock.lua, put before this script by the engine.
local span = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local n = tonumber(ARGV[4])

-- The window is (now - span, now].
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now - span))
local count = redis.call('ZCARD', KEYS[1])

if count + n <= limit then
  for i = 1, n do
    -- Unique within this instant: the count grows with every event added.
    redis.call('ZADD', KEYS[1], string.format('%d', now), string.format('%d-%d', now, count + i))
  end
  redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil(span / 1000) + 1 + hold))
  return {1, 0, limit - count - n, span}
end

-- Denied: wait until enough of the oldest events leave the window.
local retry = 0
local need = count + n - limit
local oldest = redis.call('ZRANGE', KEYS[1], need - 1, need - 1, 'WITHSCORES')
if oldest[2] then retry = tonumber(oldest[2]) + span - now end
local reset = 0
local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if newest[2] then reset = tonumber(newest[2]) + span - now end
return {0, retry, limit - count, reset}
