-- refund.lua: gives back a booking whose slot has not come (or, for one no
-- one acted on, whose units still stand), in each of its limits, at most
-- once, and only where that cannot let anything through early:
--
--  - A key goes back only while its TAT still equals the booking's end:
--    nothing booked after it still stands on it. It goes back exactly to
--    its TAT before the booking (never below now). Bookings given back
--    latest first therefore give everything back; a booking that later
--    ones were built on gives nothing, since the TAT alone cannot tell
--    which of the room in front of it is still booked. (This is where
--    slotbook is stricter than golang.org/x/time/rate's Cancel, which gives
--    part back and can then let a later request through early.)
--  - A pause (block.lua) moves the TAT off every earlier booking's end, so
--    no refund reaches below a pause's end.
--  - The first refund of a booking leaves a tombstone, a key named after
--    the booking's id that lives until ARGV[2] (its slot, or for a booking
--    no one acted on, its latest end), and a refund that finds it gives
--    nothing: a refund retried after a lost reply cannot give back a later
--    booking that happens to end where this one did. (A booking refunded
--    as used must not be refunded again as unused: its tombstone is gone
--    once its slot has passed.) The tombstone holds "1", written before
--    the keys are read; once they are given back, if anything was, it
--    holds what was given to each key ("1 g_1 .. g_m"), which a refund
--    that finds it reports, so that a retry after a lost reply can tell
--    what the first attempt gave back.
--  - A key whose end has passed gives nothing and is not written.
--
-- KEYS      the booking's m keys, then its tombstone key (same hash tag)
-- ARGV[1]   "" to read the clock with TIME; a microsecond count in tests (clock.lua)
-- ARGV[2]   the instant until which the booking may come back: its slot
--           (microseconds on the Redis clock), or for a booking no one
--           acted on, the latest of its ends
-- ARGV[3..] per key, a pair: the TAT just before the booking and just after
--
-- Returns {now, given_1 .. given_m, earlier_1 .. earlier_m}: microseconds
-- given back per key by this call, then what the tombstone this call found
-- says an earlier refund of the booking gave back per key (0s if none, or
-- if it holds "1" alone).
-- now: set by clock.lua, put before this script by the engine.

local m = #KEYS - 1
local slot = tonumber(ARGV[2])
local out = {now}
local tomb = false
if slot > now then
  tomb = redis.call('GET', KEYS[m + 1])
end
local live = slot > now and not tomb
if live then
  redis.call('SET', KEYS[m + 1], '1', 'PX', px(slot, now, hold))
end
local record, gave = {'1'}, false
for i = 1, m do
  local give = 0
  if live then
    local before, after = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
    if after > now and stored(KEYS[i], now) == after then
      give = after - math.max(before, now)
      gave = gave or give > 0
      if before > now then
        redis.call('SET', KEYS[i], string.format('%d', before), 'PX', px(before, now, hold))
      else
        redis.call('DEL', KEYS[i])
      end
    end
  end
  out[#out + 1] = give
  record[#record + 1] = string.format('%d', give)
end
if gave then
  redis.call('SET', KEYS[m + 1], table.concat(record, ' '), 'PX', px(slot, now, hold))
end
-- What a tombstone found records: only "1" and exactly m counts of
-- digits, one space before each; anything else records nothing.
local earlier = {}
if tomb and string.find(tomb, '^1 [%d ]*%d$') then
  local parts = {}
  for v in string.gmatch(tomb, '[^ ]+') do parts[#parts + 1] = v end
  if #parts == m + 1 and not string.find(tomb, '  ') then
    for i = 1, m do earlier[i] = tonumber(parts[i + 1]) end
  end
end
for i = 1, m do
  out[#out + 1] = earlier[i] or 0
end
return out
