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
-- Returns {now, tat_1 .. tat_m, then per run: booked}: the TATs the first
-- request is judged against (max(stored, now)), and how many of each
-- run's requests were booked. A refusal leaves the TATs as they were, so
-- the requests after it in its run (alike) are refused too: a run's
-- bookings are its first requests. The caller works out each request's
-- wait from these as this script does (a booking leaves
-- max(tat_i, t) + n*I_i), so the reply carries one value per run, not per
-- request. Values stay integral.
-- SET gets them through string.format('%d'): Redis 7.0 formats a Lua
-- number argument with snprintf's %.17g, which costs more.
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
  local booked = 0
  if m == 1 and (n - 1) * interval[1] <= tau[1] then
    -- One limit: a booking's slot never lies past tat (n <= burst + 1), so
    -- the j-th booking of the run waits max(0, a + j*step) and leaves
    -- tat + (j+1)*step. The run books every j with a + j*step <= maxwait,
    -- worked out at once rather than request by request (room and step
    -- are integers below 2^53, so the floor of their quotient is exact).
    local step = n * interval[1]
    local room = maxwait - (tat[1] + (n - 1) * interval[1] - tau[1] - now)
    if maxwait >= 0 and room >= 0 then
      booked = room / step
      booked = booked - booked % 1 + 1
      if booked > count then booked = count end
      tat[1] = tat[1] + booked * step
    end
  else
    for _ = 1, count do
      local slot = now
      for i = 1, m do
        local at = tat[i] + (n - 1) * interval[i] - tau[i]
        if at > slot then slot = at end
      end
      -- The rest of the run would see the same TATs: refused too.
      if slot - now > maxwait then break end
      booked = booked + 1
      for i = 1, m do
        if slot > tat[i] then tat[i] = slot end
        tat[i] = tat[i] + n * interval[i]
      end
    end
  end
  k = k + 1
  out[k] = booked
end

for i = 1, m do
  if tat[i] ~= out[1 + i] then
    redis.call('SET', KEYS[i], string.format('%d', tat[i]),
      'PX', px(tat[i], now, hold))
  end
end
return out
