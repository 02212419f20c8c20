-- refund.lua: gives back a booking whose slot has not come, as
-- golang.org/x/time/rate's Reservation.Cancel does: the units booked after
-- it keep their slots, so only what they did not build on is returned, and
-- TAT never moves below now.
--
-- KEYS[1]  the key holding TAT (integer microseconds)
-- ARGV[1]  n * I, the booking's length in microseconds
-- ARGV[2]  the TAT right after the booking was made
-- ARGV[3]  the booking's slot (microseconds on the Redis clock)
-- ARGV[4]  "" to read the clock with TIME; a microsecond count in tests
--
-- Returns {now, refunded microseconds}.
local length = tonumber(ARGV[1])
local booked_end = tonumber(ARGV[2])
local slot = tonumber(ARGV[3])

local now
if ARGV[4] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[4])
end

if slot <= now then return {now, 0} end

local stored = redis.call('GET', KEYS[1])
if not stored then return {now, 0} end
local tat = tonumber(stored)
if tat == nil then
  return redis.error_reply('slotbook: key ' .. KEYS[1] .. ' does not hold a TAT')
end

local later = tat - booked_end
if later < 0 then later = 0 end
local give = length - later
if give <= 0 then return {now, 0} end

local newtat = tat - give
if newtat <= now then
  redis.call('DEL', KEYS[1])
  return {now, tat - now}
end
redis.call('SET', KEYS[1], string.format('%d', newtat),
  'PX', string.format('%d', math.ceil((newtat - now) / 1000) + 1))
return {now, give}
