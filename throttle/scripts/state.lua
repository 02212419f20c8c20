-- state.lua: reads the state of a subject's keys (one per limit) without
-- changing anything: what each holds, checked as every other script
-- checks it (stored, clock.lua), and its time to live. Nothing is
-- written, so it books nothing and spends no quota.
--
-- KEYS      the keys
-- ARGV[1]   "" to read the clock with TIME; a microsecond count in tests (clock.lua)
-- ARGV[2..] per key, a pair (I, tau), emission interval and tolerance in
--           microseconds, for the check that a TAT is not further ahead
--           than any booking could put it; or no pairs at all where the
--           limits are unknown (an operator's tool reading keys it found):
--           then only the value's form is checked.
--
-- Returns {now, then per key: exists (1/0), tat (0 when absent), pttl}:
-- pttl is PTTL's answer, milliseconds, -1 for a key without expiry (not
-- one slotbook wrote), -2 for none.
-- now: set by clock.lua, put before this script by the engine.
local out = {now}
local limits = #ARGV > 1
for i = 1, #KEYS do
  local interval, tau
  if limits then
    interval, tau = tonumber(ARGV[2 * i]), tonumber(ARGV[1 + 2 * i])
  end
  local tat = stored(KEYS[i], now, interval, tau)
  if tat then
    out[#out + 1] = 1
    out[#out + 1] = tat
  else
    out[#out + 1] = 0
    out[#out + 1] = 0
  end
  out[#out + 1] = redis.call('PTTL', KEYS[i])
end
return out
