-- block.lua: shared back-off. Pushes each key's TAT so that no slot is
-- granted before now + d, for every process: after an upstream "429, retry
-- after d". Slots booked before keep their times. Requests resume one
-- interval apart from then, not in a burst.
--
-- The pushed TAT is the pause's floor: it always moves (by at least a
-- microsecond, even when it already lay past the pause's end), so it
-- equals the end of no booking made before the pause, and refund.lua,
-- which gives a booking back only while the TAT still equals its end,
-- never lowers it below the floor. Bookings made after the pause start at
-- or above it, so giving them back cannot go below it either.
--
-- KEYS      the keys
-- ARGV[1]   "" to read the clock with TIME; a microsecond count in tests (clock.lua)
-- ARGV[2]   d, microseconds
-- ARGV[3..] per key, a pair (I, tau): emission interval and tolerance
--
-- Returns {now, tat_1 .. tat_m}.
-- now: set by clock.lua, put before this script by the engine.
local until_ = now + tonumber(ARGV[2])
local out = {now}
for i = 1, #KEYS do
  local interval, tau = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  -- The first slot is tat - tau: put it at until_.
  local target = until_ + tau
  local old = stored(KEYS[i], now, interval, tau)
  local tat = target
  if old and old >= target then tat = old + 1 end
  redis.call('SET', KEYS[i], string.format('%d', tat), 'PX', px(tat, now, hold))
  out[#out + 1] = tat
end
return out
