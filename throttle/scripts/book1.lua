-- book1.lua: book.lua for the common case, one request on one key, without
-- its tables and loops: the same decision and the same reply
-- {now, tat, w} (w: the wait if booked, -1 - wait if refused), for less
-- server CPU per call.
--
-- KEYS[1]  the key holding TAT (integer microseconds on the Redis clock)
-- ARGV     "" or a test clock, I, tau, n, max_wait (microseconds)
-- now: set by clock.lua, put before this script by the engine.
-- x + 0 converts as tonumber(x) does, without a function call.
local interval, tau, n, maxwait = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0, ARGV[5] + 0
local tat = stored(KEYS[1], now, interval, tau) or now
if tat < now then tat = now end
local wait = tat + (n - 1) * interval - tau - now
if wait < 0 then wait = 0 end
if wait > maxwait then return {now, tat, -1 - wait} end
local new = tat + n * interval
redis.call('SET', KEYS[1], string.format('%d', new), 'PX', px(new, now, hold))
return {now, tat, wait}
