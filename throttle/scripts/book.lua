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
-- then      runs of requests, each a triple (count, n, max_wait): count
--           requests in a row that each want n units and accept a wait of
--           at most max_wait microseconds (at most the horizon, 366 days).
--           Callers coalesced on one key mostly ask alike, so a batch
--           takes three arguments, not two per request.
--
-- A request's slot is the earliest time every limit allows it:
--   t = max(now, max_i(tat_i + (n-1)*I_i - tau_i))
-- If t - now exceeds its max wait it is refused and writes nothing;
-- otherwise every limit advances: tat_i = max(tat_i, t) + n*I_i.
--
-- Returns {now, tat_1 .. tat_m, then per request: w}: the TATs the first
-- request is judged against (max(stored, now)), and for each request its
-- wait if it was booked, or -1 - wait if it was refused. Every later
-- request is judged against the TATs its predecessors left, which the
-- caller works out from these (a booking leaves max(tat_i, t) + n*I_i), so
-- the reply carries one value per request. Values stay integral. SET gets
-- them through string.format('%d'): Redis 7.0 formats a Lua number
-- argument with snprintf's %.17g, which costs more.
-- now: set by clock.lua, put before this script by the engine.

-- x + 0 converts as tonumber(x) does, without a function call.
local m = ARGV[2] + 0
local interval, tau, tat = {}, {}, {}
-- k counts out's values: out[#out + 1] would search for the end each time.
local out, k = {now}, 1 + m
for i = 1, m do
  interval[i] = ARGV[1 + 2 * i] + 0
  tau[i] = ARGV[2 + 2 * i] + 0
  local t = stored(KEYS[i], now, interval[i], tau[i]) or now
  if t < now then t = now end
  tat[i] = t
  out[1 + i] = t
end

for r = 3 + 2 * m, #ARGV, 3 do
  local count, n, maxwait = ARGV[r] + 0, ARGV[r + 1] + 0, ARGV[r + 2] + 0
  for _ = 1, count do
    local slot = now
    for i = 1, m do
      local at = tat[i] + (n - 1) * interval[i] - tau[i]
      if at > slot then slot = at end
    end
    local wait = slot - now
    k = k + 1
    if wait <= maxwait then
      out[k] = wait
      for i = 1, m do
        if slot > tat[i] then tat[i] = slot end
        tat[i] = tat[i] + n * interval[i]
      end
    else
      out[k] = -1 - wait
    end
  end
end

for i = 1, m do
  if tat[i] ~= out[1 + i] then
    redis.call('SET', KEYS[i], string.format('%d', tat[i]),
      'PX', px(tat[i], now, hold))
  end
end
return out
