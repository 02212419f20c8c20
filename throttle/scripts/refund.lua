-- refund.lua: gives back a booking whose slot has not come, in each of its
-- limits, as golang.org/x/time/rate's Reservation.Cancel does: the units
-- booked after it keep their slots, so only what they did not build on is
-- returned, and TAT never moves below now. If nothing was booked after it,
-- each TAT goes back exactly to where it was (under several limits a
-- booking may have moved a TAT by more than n * I, to the slot another
-- limit imposed).
--
-- KEYS      the booking's keys
-- ARGV[1]   "" to read the clock with TIME; a microsecond count in tests (clock.lua)
-- ARGV[2]   the booking's slot (microseconds on the Redis clock)
-- ARGV[3..] per key, a pair: the TAT just before the booking and just after
--
-- Returns {now, given_1 .. given_m}: microseconds given back per key.
-- now: set by clock.lua, put before this script by the engine.

local out = {now}
local slot = tonumber(ARGV[2])
for i = 1, #KEYS do
  local give = 0
  local tat = stored(KEYS[i])
  -- A slot that has come gives nothing back; a passed TAT is as good as absent.
  if slot <= now or (tat and tat <= now) then tat = nil end
  if tat then
    local before, after = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
    local later = tat - after
    if later < 0 then later = 0 end
    give = (after - before) - later
    if give > 0 then
      local newtat = tat - give
      if newtat <= now then
        give = tat - now
        redis.call('DEL', KEYS[i])
      else
        redis.call('SET', KEYS[i], string.format('%d', newtat),
          'PX', px(newtat))
      end
    else
      give = 0
    end
  end
  out[#out + 1] = give
end
return out
