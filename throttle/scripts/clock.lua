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

-- px(tat): the time to live, in milliseconds for SET's PX, of a key
-- holding tat: until tat has passed, rounded up, plus 1 ms.
local function px(tat)
  return string.format('%d', math.ceil((tat - now) / 1000) + 1 + hold)
end

-- stored(key): the TAT a key holds, or nil if it holds none. A value that
-- is not an integer is an error: the key is not slotbook's.
local function stored(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local tat = tonumber(v)
  if tat == nil then
    error(redis.error_reply('slotbook: key ' .. key .. ' does not hold a TAT'))
  end
  return tat
end
