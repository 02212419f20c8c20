-- book.lua: judges a list of requests against one or more GCRA keys (the
-- limits of one subject), in order, and books each request that fits its
-- max wait in all of them at once. Each key holds one integer: TAT, the
-- theoretical arrival time, in microseconds on the Redis clock.
--
-- KEYS      the m keys (one per limit; in a cluster they share a hash tag)
-- ARGV[1]   "" to read the clock with TIME; a microsecond count in tests (clock.lua)
-- ARGV[2]   m
-- ARGV[3..] m pairs (I, tau): emission interval and tolerance (burst * I),
--           microseconds
-- then      pairs (n, max_wait): units wanted, longest acceptable wait in
--           microseconds (at most the horizon, 366 days)
--
-- A request's slot is the earliest time every limit allows it:
--   t = max(now, max_i(tat_i + (n-1)*I_i - tau_i))
-- If t - now exceeds its max wait it is refused and writes nothing;
-- otherwise every limit advances: tat_i = max(tat_i, t) + n*I_i.
--
-- Returns {now, then per request: booked (1/0), wait, tat_1 .. tat_m}, the
-- TATs the request was judged against (before it was booked: the caller
-- computes the TATs after, for a refund to restore). Values stay integral.
-- SET gets them through string.format('%d'): Redis 7.0 formats a Lua
-- number argument with snprintf's %.17g, which costs more.
-- now: set by clock.lua, put before this script by the engine.

-- x + 0 converts as tonumber(x) does, without a function call.
local m = ARGV[2] + 0
local interval, tau, tat, first = {}, {}, {}, {}
for i = 1, m do
  interval[i] = ARGV[1 + 2 * i] + 0
  tau[i] = ARGV[2 + 2 * i] + 0
  local t = stored(KEYS[i], now, interval[i], tau[i]) or now
  if t < now then t = now end
  tat[i] = t
  first[i] = t
end

-- k counts out's values: out[#out + 1] would search for the end each time.
local out, k = {now}, 1
for r = 3 + 2 * m, #ARGV, 2 do
  local n = ARGV[r] + 0
  local maxwait = ARGV[r + 1] + 0
  local slot = now
  for i = 1, m do
    local at = tat[i] + (n - 1) * interval[i] - tau[i]
    if at > slot then slot = at end
  end
  local wait = slot - now
  local booked = wait <= maxwait
  out[k + 1] = booked and 1 or 0
  out[k + 2] = wait
  k = k + 2
  for i = 1, m do
    k = k + 1
    out[k] = tat[i]
  end
  if booked then
    for i = 1, m do
      if slot > tat[i] then tat[i] = slot end
      tat[i] = tat[i] + n * interval[i]
    end
  end
end

for i = 1, m do
  if tat[i] ~= first[i] then
    redis.call('SET', KEYS[i], string.format('%d', tat[i]),
      'PX', px(tat[i], now, hold))
  end
end
return out
