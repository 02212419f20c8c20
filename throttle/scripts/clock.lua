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

-- Every call runs this file and builds its two functions anew, so they
-- are kept lean: no C function where Lua arithmetic does the same, and no
-- upvalues (a function that used now or hold from here would cost an
-- allocation per call for each, and their closing when the script ends):
-- callers pass now and hold.

-- px(tat, now, hold): the time to live, in milliseconds for SET's PX, of
-- a key holding tat: until tat has passed, rounded up, plus 1 ms (plus
-- hold). With d = (now - tat) / 1000, exactly -((tat - now) / 1000), the
-- rounded-up count is -floor(d), which Lua computes as d % 1 - d (its % is
-- a - floor(a/b)*b): math.ceil's result, without a function call.
local function px(tat, now, hold)
  local d = (now - tat) / 1000
  return string.format('%d', d % 1 - d + 1 + hold)
end

-- stored(key, now, interval, tau): the TAT a key holds, or nil if it
-- holds none. A value that is not a plain decimal integer of at most
-- 2^53, or (given the key's limit) lies further ahead than any booking
-- under that limit could have put it, is an error naming the key: never a
-- silent permanent denial. The reply starts with SLOTBOOK_CORRUPT, which the
-- engine turns into ErrCorruptState.
local function stored(key, now, interval, tau)
  local v = redis.call('GET', key)
  if not v then return nil end
  -- Only digits, so v + 0 is tonumber(v) (both read it with strtod).
  local tat
  if #v <= 16 and string.find(v, '^%d+$') then tat = v + 0 end
  if tat == nil or tat > 9007199254740992 then
    return error({err = 'SLOTBOOK_CORRUPT key ' .. key .. ' holds ' .. string.format('%q', string.sub(v, 1, 40)) ..
      ', not a TAT (an integer count of microseconds, at most 2^53): Reset the subject'})
  end
  -- 31622400000000: the horizon, 366 days in microseconds (the engine's
  -- MaxHorizon). No booking lies further ahead; a stored TAT further ahead
  -- than the horizon plus twice what one limit's burst reaches (tau + I)
  -- is not one slotbook wrote.
  if interval and tat - now > 31622400000000 + 2 * (tau + interval) then
    return error({err = 'SLOTBOOK_CORRUPT key ' .. key .. ' holds a TAT ' .. string.format('%d', tat - now) ..
      ' microseconds ahead, further than any booking under its limit reaches: Reset the subject'})
  end
  return tat
end
