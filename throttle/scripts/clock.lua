-- clock.lua: put before every script that reads the clock. now is the
-- Redis clock in microseconds (TIME), unless ARGV[1] holds an explicit
-- time: the module's own tests pass one through an internal hook; nothing
-- outside the module can.
local now
local hold = 0
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[1])
  -- A test clock does not move with Redis's, which expires keys: keep
  -- them an hour longer, so that Redis never drops a TAT the test clock
  -- has not passed (the scripts treat a passed TAT as an absent key).
  hold = 3600000
end

-- HORIZON: no booking lies further ahead than this (366 days, in
-- microseconds; the engine's MaxHorizon). A stored TAT further ahead than
-- the horizon plus what one limit's burst adds is not one slotbook wrote.
local HORIZON = 31622400000000

-- px(tat): the time to live, in milliseconds for SET's PX, of a key
-- holding tat: until tat has passed, rounded up, plus 1 ms.
local function px(tat)
  return string.format('%d', math.ceil((tat - now) / 1000) + 1 + hold)
end

-- stored(key, interval, tau): the TAT a key holds, or nil if it holds
-- none. A value that is not a plain decimal integer of at most 2^53, or
-- (given the key's limit) lies further ahead than any booking under that
-- limit could have put it, is an error naming the key: never a silent
-- permanent denial. The reply starts with SLOTBOOK_CORRUPT, which the
-- engine turns into ErrCorruptState.
local function stored(key, interval, tau)
  local v = redis.call('GET', key)
  if not v then return nil end
  local tat
  if #v <= 16 and string.match(v, '^%d+$') then tat = tonumber(v) end
  if tat == nil or tat > 9007199254740992 then
    return error({err = 'SLOTBOOK_CORRUPT key ' .. key .. ' holds ' .. string.format('%q', string.sub(v, 1, 40)) ..
      ', not a TAT (an integer count of microseconds, at most 2^53): Reset the subject'})
  end
  if interval and tat - now > HORIZON + 2 * tau + interval then
    return error({err = 'SLOTBOOK_CORRUPT key ' .. key .. ' holds a TAT ' .. string.format('%d', tat - now) ..
      ' microseconds ahead, further than any booking under its limit reaches: Reset the subject'})
  end
  return tat
end
